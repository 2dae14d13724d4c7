-- On a table partitioned before this migration, the enqueue functions of
-- sql/partitioned_enqueue.sql, whose look for an aggregate's pending messages reads only
-- the partitions not settled. A plain table keeps its own.
DO $partitioned_head_probes$
BEGIN
    IF EXISTS (SELECT 1 FROM {partitions}) THEN
        EXECUTE $partitioned_enqueue$
{partitioned_enqueue}
$partitioned_enqueue$;
    END IF;
END
$partitioned_head_probes$;

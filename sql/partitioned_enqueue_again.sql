-- The enqueue functions of sql/partitioned_enqueue.sql made again on a partitioned table,
-- and nothing done on a plain one: what each migration that changes them runs (14, 17, 19
-- and 21), so a table partitioned before it gets the functions a new one would have.
DO $partitioned_enqueue_again$
BEGIN
    IF EXISTS (SELECT 1 FROM {partitions}) THEN
        EXECUTE $partitioned_enqueue$
{partitioned_enqueue}
$partitioned_enqueue$;
    END IF;
END
$partitioned_enqueue_again$;

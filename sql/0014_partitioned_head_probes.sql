-- On a table partitioned before this migration, the enqueue functions of
-- sql/partitioned_enqueue.sql, whose look for an aggregate's pending messages reads only
-- the partitions not settled. A plain table keeps its own.
{partitioned_enqueue_again}

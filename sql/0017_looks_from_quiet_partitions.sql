-- On a partitioned table, the enqueue functions of sql/partitioned_enqueue.sql as they are
-- now, whose look for an aggregate's pending messages starts at the first partition not
-- quiet (migration 16), where it started at the first not settled: a dead letter kept no
-- longer brings back the cost of every partition after it. A plain table keeps its own.
{partitioned_enqueue_again}

-- On a partitioned table, the enqueue functions of sql/partitioned_enqueue.sql as they are
-- now, whose look for an aggregate's pending messages reads the first three partitions not
-- quiet alone and every one from the fourth on, where migration 19's read every one from
-- the second on: messages held in two or three old partitions (scheduled far ahead, or
-- parked) no longer cost every enqueue a look into each partition after the second. A
-- plain table keeps its own.
{partitioned_enqueue_again}

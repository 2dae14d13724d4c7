-- On a partitioned table, the enqueue functions of sql/partitioned_enqueue.sql as they are
-- now, whose look for an aggregate's pending messages reads the first partition not quiet
-- and every one from the next not quiet on, leaving out the quiet ones between (migration
-- 18 has the upkeep mark them quiet past a partition still holding a message): a message
-- scheduled far ahead, or parked, in an old partition no longer costs every enqueue a look
-- into each partition after it. A plain table keeps its own.
{partitioned_enqueue_again}

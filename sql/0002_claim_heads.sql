-- Ordered rows leave the due index.
--
-- Version 1 kept every pending row in one due index, so a claim walked every row waiting
-- behind its aggregate's head and probed for an older sibling on each: with 36,000 rows
-- behind 40 heads one claim took 277 ms. Now each pending row is in exactly one claim index:
-- rows without an aggregate key in {unordered_idx}, in the order they become due; rows with
-- one in {agg_idx}, where the claim visits one head per aggregate (a skip scan) and reads a
-- run behind each due head. A claim costs what it returns plus the aggregates it passes,
-- never the rows waiting behind a head.
CREATE INDEX {unordered_idx} ON {table} (available_at, id)
    WHERE status = 'pending' AND aggregate_key IS NULL;

DROP INDEX {due_idx_qualified};

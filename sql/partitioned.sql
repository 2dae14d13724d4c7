-- A partitioned outbox: the table of migrations 0001 to 0014, made again as a table
-- partitioned by id ranges (see migration 0012 for why ids, and how they follow time). Run
-- by `migrate` on an outbox built with `partition_interval`, on a table that holds no row.
--
-- A unique index of a partitioned table must hold the partition key, so the key's
-- uniqueness is in two parts: a unique index on each partition, and, for keys the caller
-- gave, a look for the key in every partition before the insert. The look sees every key
-- written before the last cut, because the cut waits for such producers to commit (see
-- {partition_fn}); after the cut, producers write to one partition, whose index decides.
-- Keys the crate makes need neither: nothing else can hold them.

-- No producer may write while the table is found empty and made again (the crate's own
-- check comes after the same lock).
LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE;
DO $do$
BEGIN
    IF EXISTS (SELECT FROM {table}) THEN
        RAISE EXCEPTION 'outbox {name} holds rows, and only an empty table is made partitioned'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
END
$do$;
ALTER TABLE {table} RENAME TO {unpartitioned_name};
CREATE TABLE {table} (LIKE {unpartitioned} INCLUDING DEFAULTS INCLUDING CONSTRAINTS
                      INCLUDING IDENTITY INCLUDING STORAGE INCLUDING COMMENTS)
    PARTITION BY RANGE (id);
DROP TABLE {unpartitioned};
ALTER TABLE {table} ADD CONSTRAINT {pkey} PRIMARY KEY (id);
CREATE INDEX {ready_idx} ON {table} (available_at, id)
    WHERE status = 'pending' AND (head OR aggregate_key IS NULL);
CREATE INDEX {ordered_idx} ON {table} (head, aggregate_key, id)
    WHERE status IN ('pending', 'parked') AND aggregate_key IS NOT NULL;
CREATE INDEX {done_idx} ON {table} (status, done_at) WHERE status <> 'pending';

-- The functions of earlier versions, for producers of those versions, which never wrote
-- to a partitioned table.
DROP FUNCTION {enqueue_fn}(text, text, text, bytea, text, text[], timestamptz, bigint, integer,
                           boolean);
DROP FUNCTION {enqueue_fn}(text, text, text, bytea, text, text[], timestamptz, bigint, integer,
                           boolean, boolean);
DROP FUNCTION {enqueue_n_fn}(text[], text[], text[], bytea[], text[], text[], timestamptz[],
                             bigint[], integer[], integer[], integer[], boolean);
DROP FUNCTION {enqueue_n_fn}(text[], text[], text[], bytea[], text[], text[], timestamptz[],
                             bigint[], integer[], integer[], integer[], boolean[], boolean);
DROP FUNCTION {lock_heads_fn}(text[]);

INSERT INTO {partitions} (n, every, ahead) VALUES (0, {every}, {ahead});
SELECT {partition_fn}(false);

-- What an enqueue of keys the caller gave does first: hold off the next cut until this
-- transaction ends, and look for the keys in every partition. The look is forced to probe
-- each partition's key index: a partition still empty when a plan was made looks cheaper
-- to read whole, and stays so in the cached plan for a while after it has filled. (The
-- lock is written out in both functions: a call of a third cost as much as the probe.)
--
-- Under REPEATABLE READ and SERIALIZABLE the snapshot may predate keys committed just
-- before the last cut, in the partition before, which the look cannot see (nor does
-- SERIALIZABLE's conflict check, which knows no uniqueness). So a row that such a
-- transaction writes into a partition its snapshot does not know as open (a cut came after
-- it) is a serialization failure, to be retried, as a plain table's unique index would
-- give; see {enqueue_fn} and {enqueue_n_fn}.
CREATE FUNCTION {key_taken_fn}(p_key text) RETURNS boolean
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $fn$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({key_epoch_lock});
    RETURN EXISTS (SELECT 1 FROM {table} t WHERE t.key = p_key);
END
$fn$;

-- The keys of a batch that a partition holds, sorted.
CREATE FUNCTION {keys_taken_fn}(p_keys text[]) RETURNS text[]
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $fn$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({key_epoch_lock});
    RETURN ARRAY(SELECT k
                 FROM (SELECT DISTINCT k FROM unnest(p_keys) AS k) AS keys,
                      LATERAL (SELECT 1 FROM {table} t WHERE t.key = keys.k LIMIT 1) AS found
                 ORDER BY k);
END
$fn$;

-- The enqueue functions for a partitioned table follow, from sql/partitioned_enqueue.sql.

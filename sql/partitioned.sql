-- A partitioned outbox: the table the migrations made, made again as a table partitioned by
-- id ranges (see sql/functions/partitions.sql for why ids, and how they follow time). Run by
-- `migrate` on an outbox built with `partition_interval`, on a table that holds no row; the
-- enqueue functions of sql/functions/enqueue_partitioned.sql are made after it.
--
-- A unique index of a partitioned table must hold the partition key, so a key is unique in
-- each partition by an index of its own (made with the partition), and across partitions by
-- the enqueue functions' look into each.

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
-- to a partitioned table (sql/functions/earlier_producers.sql).
DROP FUNCTION IF EXISTS {enqueue_fn}(text, text, text, bytea, text, text[], timestamptz, bigint,
                                     integer, boolean);
DROP FUNCTION IF EXISTS {enqueue_fn}(text, text, text, bytea, text, text[], timestamptz, bigint,
                                     integer, boolean, boolean);
DROP FUNCTION IF EXISTS {enqueue_n_fn}(text[], text[], text[], bytea[], text[], text[],
                                       timestamptz[], bigint[], integer[], integer[], integer[],
                                       boolean);
DROP FUNCTION IF EXISTS {enqueue_n_fn}(text[], text[], text[], bytea[], text[], text[],
                                       timestamptz[], bigint[], integer[], integer[], integer[],
                                       boolean[], boolean);
DROP FUNCTION IF EXISTS {lock_heads_fn}(text[]);

INSERT INTO {partitions} (n, every, ahead) VALUES (0, {every}, {ahead});
SELECT {partition_fn}(false);

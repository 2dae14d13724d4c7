-- A partitioned outbox: the table of migrations 0001 to 0012, made again as a table
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

-- One message. `p_key_generated`: the key is the crate's own, so nothing else can hold it.
CREATE OR REPLACE FUNCTION {enqueue_fn}(
    p_key text, p_topic text, p_aggregate_key text, p_payload bytea, p_content_type text,
    p_headers text[], p_at timestamptz, p_delay_us bigint, p_max_attempts integer,
    p_park boolean, p_notify boolean, p_key_generated boolean)
RETURNS boolean LANGUAGE plpgsql AS $fn$
DECLARE
    held text;
    lock_key bigint;
    new_id bigint;
BEGIN
    -- The lock of {lock_n_fn} for one aggregate, written out here: calling a function from
    -- this one cost five times what the lock does.
    IF p_aggregate_key IS NOT NULL THEN
        lock_key := hashtextextended(p_aggregate_key, {lock_seed});
        held := current_setting('postgres_outbox.aggregate_locks', true);
        IF held IS NULL OR NOT starts_with(held, pg_current_xact_id()::text || ':') THEN
            held := pg_current_xact_id()::text || ':,';
        END IF;
        IF strpos(held, ',' || lock_key || ',') = 0 AND strpos(held, ',t{table_lock_text},') = 0 THEN
            IF length(held) - length(replace(held, ',', '')) <= 64 THEN
                PERFORM pg_advisory_xact_lock_shared({table_lock} + (lock_key & 15)),
                        pg_advisory_xact_lock(lock_key),
                        set_config('postgres_outbox.aggregate_locks', held || lock_key || ',',
                                   false);
            ELSE
                PERFORM pg_advisory_xact_lock({table_lock} + bucket)
                FROM generate_series(0, 15) AS bucket;
                PERFORM set_config('postgres_outbox.aggregate_locks',
                                   held || 't{table_lock_text},', false);
            END IF;
        END IF;
    END IF;
    IF p_key_generated THEN
        INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                             available_at, max_attempts, park, head)
        VALUES (p_key, p_topic, p_aggregate_key, p_payload, p_content_type, p_headers,
                coalesce(p_at, now() + p_delay_us * interval '1 microsecond'), p_max_attempts,
                p_park,
                p_aggregate_key IS NOT NULL
                AND current_setting('transaction_isolation') = 'read committed'
                AND NOT EXISTS (SELECT 1 FROM {table} o
                                WHERE o.head IN (false, true)
                                  AND o.aggregate_key = p_aggregate_key
                                  AND o.status IN ('pending', 'parked')));
    -- Under REPEATABLE READ, ON CONFLICT meets a key a transaction committed after this
    -- one's snapshot as a serialization failure: a duplicate all the same, and in a block of
    -- its own it leaves the caller's transaction usable (see migration 0005).
    ELSIF current_setting('transaction_isolation') = 'repeatable read' THEN
        IF {key_taken_fn}(p_key) THEN
            RETURN false;
        END IF;
        BEGIN
            INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                                 available_at, max_attempts, park)
            VALUES (p_key, p_topic, p_aggregate_key, p_payload, p_content_type, p_headers,
                    coalesce(p_at, now() + p_delay_us * interval '1 microsecond'),
                    p_max_attempts, p_park)
            ON CONFLICT DO NOTHING
            RETURNING id INTO new_id;
        EXCEPTION WHEN serialization_failure THEN
            RETURN false;
        END;
        IF new_id IS NULL THEN
            RETURN false;
        END IF;
        IF new_id >> 40 > (SELECT max(n) FROM {partitions} WHERE opened_at IS NOT NULL) THEN
            RAISE EXCEPTION 'outbox {name}: a partition cut came after this transaction''s snapshot'
                USING ERRCODE = 'serialization_failure', HINT = 'Run the transaction again.';
        END IF;
    ELSE
        IF {key_taken_fn}(p_key) THEN
            RETURN false;
        END IF;
        INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                             available_at, max_attempts, park, head)
        VALUES (p_key, p_topic, p_aggregate_key, p_payload, p_content_type, p_headers,
                coalesce(p_at, now() + p_delay_us * interval '1 microsecond'), p_max_attempts,
                p_park,
                p_aggregate_key IS NOT NULL
                AND current_setting('transaction_isolation') = 'read committed'
                AND NOT EXISTS (SELECT 1 FROM {table} o
                                WHERE o.head IN (false, true)
                                  AND o.aggregate_key = p_aggregate_key
                                  AND o.status IN ('pending', 'parked')))
        ON CONFLICT DO NOTHING
        RETURNING id INTO new_id;
        IF new_id IS NULL THEN
            RETURN false;
        END IF;
        -- SERIALIZABLE: a key written in another partition is no conflict its checks see.
        IF current_setting('transaction_isolation') <> 'read committed'
           AND new_id >> 40 > (SELECT max(n) FROM {partitions} WHERE opened_at IS NOT NULL) THEN
            RAISE EXCEPTION 'outbox {name}: a partition cut came after this transaction''s snapshot'
                USING ERRCODE = 'serialization_failure', HINT = 'Run the transaction again.';
        END IF;
    END IF;
    IF p_notify THEN
        PERFORM {notify_fn}();
    END IF;
    RETURN true;
END
$fn$;

-- A batch. `p_keys_generated`: every key is the crate's own.
CREATE OR REPLACE FUNCTION {enqueue_n_fn}(
    p_keys text[], p_topics text[], p_aggregate_keys text[], p_payloads bytea[],
    p_content_types text[], p_headers text[], p_at timestamptz[], p_delay_us bigint[],
    p_max_attempts integer[], p_header_offsets integer[], p_header_lens integer[],
    p_parks boolean[], p_notify boolean, p_keys_generated boolean)
RETURNS text[] LANGUAGE plpgsql AS $fn$
DECLARE
    busy text[];
    inserted bigint[];
    existing text[];
BEGIN
    PERFORM {lock_n_fn}(p_aggregate_keys);
    busy := {busy_fn}(p_aggregate_keys);
    IF p_keys_generated THEN
        INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                             available_at, max_attempts, park, head)
        SELECT i.key, i.topic, i.aggregate_key, i.payload, i.content_type,
               p_headers[i.header_offset + 1 : i.header_offset + i.header_len],
               coalesce(i.available_at, now() + i.delay_us * interval '1 microsecond'),
               i.max_attempts, i.park,
               i.aggregate_key IS NOT NULL AND i.first AND NOT (i.aggregate_key = ANY (busy))
        FROM (SELECT u.*, row_number() OVER (PARTITION BY u.aggregate_key
                                             ORDER BY u.ord) = 1 AS first
              FROM unnest(p_keys, p_topics, p_aggregate_keys, p_payloads, p_content_types,
                          p_at, p_delay_us, p_max_attempts, p_header_offsets, p_header_lens,
                          p_parks)
                   WITH ORDINALITY
                   AS u(key, topic, aggregate_key, payload, content_type, available_at,
                        delay_us, max_attempts, header_offset, header_len, park, ord)
             ) AS i
        ORDER BY i.ord;
        IF p_notify THEN
            PERFORM {notify_fn}();
        END IF;
        RETURN NULL;
    END IF;
    existing := {keys_taken_fn}(p_keys);
    IF cardinality(existing) > 0 THEN
        RETURN existing;
    END IF;
    -- A subtransaction per batch, so that under REPEATABLE READ a key committed after this
    -- transaction's snapshot (a serialization failure, see {enqueue_fn}) is a duplicate
    -- that leaves the caller's transaction usable. The snapshot cannot see which keys
    -- exist, so the error names them all.
    BEGIN
        WITH ins AS (
            INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                                 available_at, max_attempts, park, head)
            SELECT i.key, i.topic, i.aggregate_key, i.payload, i.content_type,
                   p_headers[i.header_offset + 1 : i.header_offset + i.header_len],
                   coalesce(i.available_at, now() + i.delay_us * interval '1 microsecond'),
                   i.max_attempts, i.park,
                   i.aggregate_key IS NOT NULL AND i.first
                   AND NOT (i.aggregate_key = ANY (busy))
            FROM (SELECT u.*, row_number() OVER (PARTITION BY u.aggregate_key
                                                 ORDER BY u.ord) = 1 AS first
                  FROM unnest(p_keys, p_topics, p_aggregate_keys, p_payloads,
                              p_content_types, p_at, p_delay_us, p_max_attempts,
                              p_header_offsets, p_header_lens, p_parks)
                       WITH ORDINALITY
                       AS u(key, topic, aggregate_key, payload, content_type, available_at,
                            delay_us, max_attempts, header_offset, header_len, park, ord)
                 ) AS i
            ORDER BY i.ord
            ON CONFLICT DO NOTHING
            RETURNING id)
        SELECT array_agg(id) INTO inserted FROM ins;
    EXCEPTION WHEN serialization_failure THEN
        IF current_setting('transaction_isolation') <> 'repeatable read' THEN
            RAISE;
        END IF;
        RETURN (SELECT array_agg(k ORDER BY k) FROM unnest(p_keys) AS k);
    END;
    IF current_setting('transaction_isolation') <> 'read committed'
       AND (SELECT max(i) FROM unnest(inserted) AS i) >> 40
           > (SELECT max(n) FROM {partitions} WHERE opened_at IS NOT NULL) THEN
        RAISE EXCEPTION 'outbox {name}: a partition cut came after this transaction''s snapshot'
            USING ERRCODE = 'serialization_failure', HINT = 'Run the transaction again.';
    END IF;
    IF coalesce(cardinality(inserted), 0) = cardinality(p_keys) THEN
        IF p_notify THEN
            PERFORM {notify_fn}();
        END IF;
        RETURN NULL;
    END IF;
    IF inserted IS NOT NULL THEN
        DELETE FROM {table} WHERE id = ANY (inserted);
    END IF;
    SELECT array_agg(t.key ORDER BY t.key) INTO existing
    FROM {table} t WHERE t.key = ANY (p_keys);
    RETURN coalesce(existing, '{}');
END
$fn$;

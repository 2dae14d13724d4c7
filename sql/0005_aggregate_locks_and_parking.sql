-- Order under racing producers, and dead letters that park their aggregate.
--
-- Ids are drawn when a row is inserted, not when it commits. Two open transactions writing
-- one aggregate could commit in the other order, and a relay that claimed in between saw the
-- later id as the aggregate's head while the earlier one was still invisible. Now every
-- enqueue of an aggregate first takes a transaction-scoped advisory lock keyed by the table
-- and the aggregate, so a second producer of that aggregate waits until the first commits
-- or rolls back, exactly as if both had locked the aggregate's own row: per aggregate, id
-- order is commit order. Rows without an aggregate key take no lock.
--
-- PostgreSQL's lock table is shared by every session and finite (about
-- max_locks_per_transaction x max_connections entries), so one transaction takes at most 64
-- aggregate locks. Past that it locks the table's ordered enqueues instead: sixteen bucket
-- locks, all of them, exclusively, in order. Every aggregate lock holder also holds its
-- aggregate's bucket, shared; one lock shared by every producer was a point of contention
-- (measured at 16 producers: 4% of the throughput, against none for sixteen). The setting
-- postgres_outbox.aggregate_locks lists the lock keys the transaction holds
-- ('<xid>:,k1,k2,' and 't<key>' for a table's lock), so an aggregate it has locked already
-- costs no lock and no count. It is set for the session, not the transaction, and tagged
-- with the transaction's id: a transaction-local setting cost three times as much per
-- enqueue (measured: 8.5 against 2.5 us), and a stale value is simply not this
-- transaction's.

-- Per message: whether its death parks its aggregate (NULL: the relay's setting).
ALTER TABLE {table} ADD COLUMN park boolean;

-- 'parked': a dead letter that still holds the later messages of its aggregate back, until
-- an operator redrives or skips it. The rows already stored passed the stricter check, so the
-- new one is not validated against them (that would read the whole table under the lock).
DO $do$
DECLARE
    constraint_name name;
BEGIN
    SELECT conname INTO constraint_name FROM pg_constraint
    WHERE conrelid = '{table}'::regclass AND contype = 'c'
      AND pg_get_constraintdef(oid) LIKE '%status%';
    IF constraint_name IS NOT NULL THEN
        EXECUTE format('ALTER TABLE {table} DROP CONSTRAINT %I', constraint_name);
    END IF;
END
$do$;
ALTER TABLE {table} ADD CONSTRAINT {status_constraint}
    CHECK (status IN ('pending', 'sent', 'dead', 'parked')) NOT VALID;

-- A parked row stays in the aggregate index, as its aggregate's head: the claim's skip scan
-- finds it, sees it is not due and passes the aggregate by, so what waits behind it stays.
DROP INDEX {agg_idx_qualified};
CREATE INDEX {agg_idx} ON {table} (aggregate_key, id)
    WHERE status IN ('pending', 'parked') AND aggregate_key IS NOT NULL;

-- Locks a batch's aggregates in the byte order of their keys, so two batches never wait on
-- each other in a circle, and a producer that enqueues one aggregate at a time in that
-- order never waits in a circle with a batch either.
CREATE FUNCTION {lock_n_fn}(p_aggregate_keys text[]) RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    xact text := pg_current_xact_id()::text || ':';
    held text := current_setting('postgres_outbox.aggregate_locks', true);
    keys text[];
BEGIN
    IF held IS NULL OR NOT starts_with(held, xact) THEN
        held := xact || ',';
    END IF;
    IF strpos(held, ',t{table_lock_text},') > 0 THEN
        RETURN;
    END IF;
    SELECT array_agg(k ORDER BY a) INTO keys
    FROM (SELECT a, hashtextextended(a, {lock_seed})::text AS k
          FROM (SELECT DISTINCT a COLLATE "C" AS a FROM unnest(p_aggregate_keys) AS a
                WHERE a IS NOT NULL) AS distinct_keys) AS keyed
    WHERE strpos(held, ',' || k || ',') = 0;
    IF keys IS NULL THEN
        RETURN;
    END IF;
    IF length(held) - length(replace(held, ',', '')) - 1 + cardinality(keys) <= 64 THEN
        PERFORM pg_advisory_xact_lock_shared({table_lock} + (k::bigint & 15))
        FROM unnest(keys) AS k;
        PERFORM pg_advisory_xact_lock(k::bigint) FROM unnest(keys) AS k;
        PERFORM set_config('postgres_outbox.aggregate_locks',
                           held || array_to_string(keys, ',') || ',', false);
    ELSE
        PERFORM pg_advisory_xact_lock({table_lock} + bucket)
        FROM generate_series(0, 15) AS bucket;
        PERFORM set_config('postgres_outbox.aggregate_locks', held || 't{table_lock_text},',
                           false);
    END IF;
END
$fn$;

-- The enqueue functions of migration 0004, with the lock and the message's park setting.
CREATE FUNCTION {enqueue_fn}(
    p_key text, p_topic text, p_aggregate_key text, p_payload bytea, p_content_type text,
    p_headers text[], p_at timestamptz, p_delay_us bigint, p_max_attempts integer,
    p_park boolean, p_notify boolean)
RETURNS boolean LANGUAGE plpgsql AS $fn$
DECLARE
    xact text;
    held text;
    lock_key bigint;
    k text;
BEGIN
    -- The lock of {lock_n_fn} for one aggregate, written out here: calling a function from
    -- this one cost five times what the lock does (measured: 13 against 2.5 us).
    IF p_aggregate_key IS NOT NULL THEN
        xact := pg_current_xact_id()::text || ':';
        held := current_setting('postgres_outbox.aggregate_locks', true);
        IF held IS NULL OR NOT starts_with(held, xact) THEN
            held := xact || ',';
        END IF;
        lock_key := hashtextextended(p_aggregate_key, {lock_seed});
        k := lock_key::text;
        IF strpos(held, ',' || k || ',') = 0 AND strpos(held, ',t{table_lock_text},') = 0 THEN
            IF length(held) - length(replace(held, ',', '')) <= 64 THEN
                PERFORM pg_advisory_xact_lock_shared({table_lock} + (lock_key & 15)),
                        pg_advisory_xact_lock(lock_key),
                        set_config('postgres_outbox.aggregate_locks', held || k || ',', false);
            ELSE
                PERFORM pg_advisory_xact_lock({table_lock} + bucket)
                FROM generate_series(0, 15) AS bucket;
                PERFORM set_config('postgres_outbox.aggregate_locks',
                                   held || 't{table_lock_text},', false);
            END IF;
        END IF;
    END IF;
    -- Under REPEATABLE READ, ON CONFLICT meets a key a transaction committed after this
    -- one's snapshot as a serialization failure: it is a duplicate all the same, and in a
    -- block of its own it leaves the caller's transaction usable. (Not under SERIALIZABLE,
    -- where a serialization failure may mean something else: it is the caller's to retry.)
    IF current_setting('transaction_isolation') = 'repeatable read' THEN
        BEGIN
            INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                                 available_at, max_attempts, park)
            VALUES (p_key, p_topic, p_aggregate_key, p_payload, p_content_type, p_headers,
                    coalesce(p_at, now() + p_delay_us * interval '1 microsecond'),
                    p_max_attempts, p_park)
            ON CONFLICT (key) DO NOTHING;
        EXCEPTION WHEN serialization_failure THEN
            RETURN false;
        END;
    ELSE
        INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                             available_at, max_attempts, park)
        VALUES (p_key, p_topic, p_aggregate_key, p_payload, p_content_type, p_headers,
                coalesce(p_at, now() + p_delay_us * interval '1 microsecond'), p_max_attempts,
                p_park)
        ON CONFLICT (key) DO NOTHING;
    END IF;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF p_notify THEN
        PERFORM {notify_fn}();
    END IF;
    RETURN true;
END
$fn$;

CREATE FUNCTION {enqueue_n_fn}(
    p_keys text[], p_topics text[], p_aggregate_keys text[], p_payloads bytea[],
    p_content_types text[], p_headers text[], p_at timestamptz[], p_delay_us bigint[],
    p_max_attempts integer[], p_header_offsets integer[], p_header_lens integer[],
    p_parks boolean[], p_notify boolean)
RETURNS text[] LANGUAGE plpgsql AS $fn$
DECLARE
    inserted tid[];
    existing text[];
BEGIN
    PERFORM {lock_n_fn}(p_aggregate_keys);
    -- A subtransaction per batch, so that under REPEATABLE READ a key committed after this
    -- transaction's snapshot (a serialization failure, see {enqueue_fn}) is a duplicate
    -- that leaves the caller's transaction usable. The snapshot cannot see which keys
    -- exist, so the error names them all.
    BEGIN
        WITH ins AS (
            INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                                 available_at, max_attempts, park)
            SELECT i.key, i.topic, i.aggregate_key, i.payload, i.content_type,
                   p_headers[i.header_offset + 1 : i.header_offset + i.header_len],
                   coalesce(i.available_at, now() + i.delay_us * interval '1 microsecond'),
                   i.max_attempts, i.park
            FROM unnest(p_keys, p_topics, p_aggregate_keys, p_payloads, p_content_types,
                        p_at, p_delay_us, p_max_attempts, p_header_offsets, p_header_lens,
                        p_parks)
                 WITH ORDINALITY
                 AS i(key, topic, aggregate_key, payload, content_type, available_at,
                      delay_us, max_attempts, header_offset, header_len, park, ord)
            ORDER BY i.ord
            ON CONFLICT (key) DO NOTHING
            RETURNING ctid)
        SELECT array_agg(ctid) INTO inserted FROM ins;
    EXCEPTION WHEN serialization_failure THEN
        IF current_setting('transaction_isolation') <> 'repeatable read' THEN
            RAISE;
        END IF;
        RETURN (SELECT array_agg(k ORDER BY k) FROM unnest(p_keys) AS k);
    END;
    IF coalesce(cardinality(inserted), 0) = cardinality(p_keys) THEN
        IF p_notify THEN
            PERFORM {notify_fn}();
        END IF;
        RETURN NULL;
    END IF;
    IF inserted IS NOT NULL THEN
        DELETE FROM {table} WHERE ctid = ANY (inserted);
    END IF;
    SELECT array_agg(t.key ORDER BY t.key) INTO existing
    FROM {table} t WHERE t.key = ANY (p_keys);
    RETURN coalesce(existing, '{}');
END
$fn$;

-- Producers of the previous version, still running during a rolling upgrade, call the old
-- signatures: they now take the locks too. A later migration drops them.
CREATE OR REPLACE FUNCTION {enqueue_fn}(
    p_key text, p_topic text, p_aggregate_key text, p_payload bytea, p_content_type text,
    p_headers text[], p_at timestamptz, p_delay_us bigint, p_max_attempts integer,
    p_notify boolean)
RETURNS boolean LANGUAGE sql AS $fn$
    SELECT {enqueue_fn}(p_key, p_topic, p_aggregate_key, p_payload, p_content_type,
                        p_headers, p_at, p_delay_us, p_max_attempts, NULL, p_notify)
$fn$;

CREATE OR REPLACE FUNCTION {enqueue_n_fn}(
    p_keys text[], p_topics text[], p_aggregate_keys text[], p_payloads bytea[],
    p_content_types text[], p_headers text[], p_at timestamptz[], p_delay_us bigint[],
    p_max_attempts integer[], p_header_offsets integer[], p_header_lens integer[],
    p_notify boolean)
RETURNS text[] LANGUAGE sql AS $fn$
    SELECT {enqueue_n_fn}(p_keys, p_topics, p_aggregate_keys, p_payloads, p_content_types,
                          p_headers, p_at, p_delay_us, p_max_attempts, p_header_offsets,
                          p_header_lens, NULL, p_notify)
$fn$;

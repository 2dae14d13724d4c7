-- The enqueue functions producers of earlier versions call, kept on a plain table so that
-- they go on working through a rolling upgrade: 0.1's (without the park setting) and
-- 0.2.0's, which now mark heads as today's do. A table made partitioned never had such
-- producers, and has none of these.

-- 0.2.0's single enqueue, marking heads: one statement inserts and checks (a second
-- statement cost more than the check).
CREATE OR REPLACE FUNCTION {enqueue_fn}(
    p_key text, p_topic text, p_aggregate_key text, p_payload bytea, p_content_type text,
    p_headers text[], p_at timestamptz, p_delay_us bigint, p_max_attempts integer,
    p_park boolean, p_notify boolean)
RETURNS boolean LANGUAGE plpgsql AS $fn$
DECLARE
    xact text;
    held text;
    lock_key bigint;
    k text;
    isolation text := current_setting('transaction_isolation');
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
    -- Only READ COMMITTED sees what the producers before it committed: elsewhere no row is
    -- marked as a head.
    IF isolation = 'repeatable read' THEN
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
                             available_at, max_attempts, park, head)
        VALUES (p_key, p_topic, p_aggregate_key, p_payload, p_content_type, p_headers,
                coalesce(p_at, now() + p_delay_us * interval '1 microsecond'), p_max_attempts,
                p_park,
                p_aggregate_key IS NOT NULL AND isolation = 'read committed'
                AND NOT EXISTS (SELECT 1 FROM {table} o
                                WHERE o.head IN (false, true)
                                  AND o.aggregate_key = p_aggregate_key
                                  AND o.status IN ('pending', 'parked')))
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

-- 0.1's, through 0.2.0's.
CREATE OR REPLACE FUNCTION {enqueue_fn}(
    p_key text, p_topic text, p_aggregate_key text, p_payload bytea, p_content_type text,
    p_headers text[], p_at timestamptz, p_delay_us bigint, p_max_attempts integer,
    p_notify boolean)
RETURNS boolean LANGUAGE sql AS $fn$
    SELECT {enqueue_fn}(p_key, p_topic, p_aggregate_key, p_payload, p_content_type,
                        p_headers, p_at, p_delay_us, p_max_attempts, NULL, p_notify)
$fn$;

-- 0.2.0's batch enqueue, marking heads: a row is one when it is the first of its aggregate
-- in the batch and the aggregate has no pending or parked row, one probe of the ordered
-- index per aggregate (a LATERAL subquery with LIMIT 1 cannot become a read of every
-- pending row into a hash, whatever the sizes and statistics).
CREATE OR REPLACE FUNCTION {enqueue_n_fn}(
    p_keys text[], p_topics text[], p_aggregate_keys text[], p_payloads bytea[],
    p_content_types text[], p_headers text[], p_at timestamptz[], p_delay_us bigint[],
    p_max_attempts integer[], p_header_offsets integer[], p_header_lens integer[],
    p_parks boolean[], p_notify boolean)
RETURNS text[] LANGUAGE plpgsql AS $fn$
DECLARE
    inserted tid[];
    existing text[];
    marks boolean := current_setting('transaction_isolation') = 'read committed';
BEGIN
    PERFORM {lock_n_fn}(p_aggregate_keys);
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
                   marks AND i.aggregate_key IS NOT NULL AND i.first AND busy.found IS NULL
            FROM (SELECT u.*, row_number() OVER (PARTITION BY u.aggregate_key
                                                 ORDER BY u.ord) = 1 AS first
                  FROM unnest(p_keys, p_topics, p_aggregate_keys, p_payloads,
                              p_content_types, p_at, p_delay_us, p_max_attempts,
                              p_header_offsets, p_header_lens, p_parks)
                       WITH ORDINALITY
                       AS u(key, topic, aggregate_key, payload, content_type, available_at,
                            delay_us, max_attempts, header_offset, header_len, park, ord)
                 ) AS i
            -- Probed only for the rows that may be heads.
            LEFT JOIN LATERAL (SELECT true AS found FROM {table} o
                               WHERE marks AND i.first
                                 AND o.head IN (false, true)
                                 AND o.aggregate_key = i.aggregate_key
                                 AND o.status IN ('pending', 'parked')
                               LIMIT 1) AS busy ON true
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

-- 0.1's, through 0.2.0's.
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

-- The locks and busy aggregates of a batch about to be copied in, as a producer between
-- 0.2.0 and today's {lock_heads_fn}(text[], boolean) asked for them.
CREATE OR REPLACE FUNCTION {lock_heads_fn}(p_aggregate_keys text[]) RETURNS text[]
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM {lock_n_fn}(p_aggregate_keys);
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN ARRAY(SELECT DISTINCT k FROM unnest(p_aggregate_keys) AS k
                     WHERE k IS NOT NULL);
    END IF;
    RETURN ARRAY(SELECT d.k
                 FROM (SELECT DISTINCT k FROM unnest(p_aggregate_keys) AS k
                       WHERE k IS NOT NULL) AS d,
                      LATERAL (SELECT FROM {table} o
                               WHERE o.head IN (false, true) AND o.aggregate_key = d.k
                                 AND o.status IN ('pending', 'parked')
                               LIMIT 1) AS busy);
END
$fn$;

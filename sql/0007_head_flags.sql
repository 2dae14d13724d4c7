-- Heads known at enqueue.
--
-- Most ordered traffic gives every entity its own aggregate, so nearly every pending row is
-- its aggregate's head; yet the claim found each one by a skip scan of the aggregate index,
-- and workers scanning side by side all passed the same heads in flight: a third of a
-- claim's time went to claims that found nothing (measured: 153 of 355 claims on a 20,000
-- row backlog). Now an enqueue that holds its aggregate's lock (migration 0005) and sees no
-- pending or parked row of that aggregate marks its row as the head, and heads wait in
-- {ready_idx} beside the rows without an aggregate: one index of the rows a claim can take
-- as they are, locked as the claim reads them, exactly as unordered rows were.
--
-- The flag is exact when true: the producer's lock makes every earlier row of the aggregate
-- committed and visible to its check, and only an operator's redrive brings an older row
-- back, which takes the same locks and clears the flag behind it. It may be false on a head:
-- a row enqueued while its predecessor was pending or in flight, or under REPEATABLE READ or
-- SERIALIZABLE (whose snapshot may predate an earlier producer's commit). The claim's skip
-- scan finds those whose predecessors are gone: no promotion on the relay's side, so no race
-- between a promotion and a producer that has not committed yet. Rows written before this
-- migration, by hand or by a producer of 0.2.0 (whose COPY path does not set the flag) take
-- that path too.
ALTER TABLE {table} ADD COLUMN head boolean NOT NULL DEFAULT false;

CREATE INDEX {ready_idx} ON {table} (available_at, id)
    WHERE status = 'pending' AND (head OR aggregate_key IS NULL);

-- The rows of aggregates by flag first: the skip scan reads the unmarked ones in aggregate
-- order, a probe of the marked ones tells whether one is still ahead of them, and an enqueue
-- probes both for its own aggregate (two short scans, one index). A row waiting behind its
-- head is in no other index than the two every row is in, as before this migration, so a
-- claim of it costs the same; only a marked head is in one more, {ready_idx}.
CREATE INDEX {ordered_idx} ON {table} (head, aggregate_key, id)
    WHERE status IN ('pending', 'parked') AND aggregate_key IS NOT NULL;

-- Replaced by the two above. (A relay of 0.2.0 has no index for its skip scan from here on:
-- stop those before migrating.)
DROP INDEX {agg_idx_qualified};
DROP INDEX {unordered_idx_qualified};

-- The enqueue function of migration 0005, marking heads. One statement inserts and checks:
-- a second statement cost more than the check.
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

-- The batch enqueue function of migration 0005, marking heads: a row is one when it is the
-- first of its aggregate in the batch and the aggregate has no pending or parked row.
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
                   marks AND i.aggregate_key IS NOT NULL AND i.first
                   AND NOT EXISTS (SELECT 1 FROM {table} o
                                   WHERE o.head IN (false, true)
                                     AND o.aggregate_key = i.aggregate_key
                                     AND o.status IN ('pending', 'parked'))
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

-- Locks a batch's aggregates as {lock_n_fn} does, then returns those that cannot take a new
-- head: the ones with a pending or parked row (every one of them outside READ COMMITTED).
-- A large batch copied in marks its heads from this.
CREATE FUNCTION {lock_heads_fn}(p_aggregate_keys text[]) RETURNS text[]
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM {lock_n_fn}(p_aggregate_keys);
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN ARRAY(SELECT DISTINCT k FROM unnest(p_aggregate_keys) AS k
                     WHERE k IS NOT NULL);
    END IF;
    -- A probe per key, each an index lookup whatever the statistics say: one scan of all
    -- the keys at once was 3.0 against 4.3 ms for 1,000 new keys (the locks alone 1.1), but
    -- its generic plan on a table not analysed yet filters the whole index instead.
    RETURN ARRAY(SELECT DISTINCT k FROM unnest(p_aggregate_keys) AS k
                 WHERE EXISTS (SELECT 1 FROM {table} o
                               WHERE o.head IN (false, true) AND o.aggregate_key = k
                                 AND o.status IN ('pending', 'parked')));
END
$fn$;

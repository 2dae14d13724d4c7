-- Enqueue on a plain table (enqueue_partitioned.sql is a partitioned table's).
--
-- Through functions: PL/pgSQL keeps each statement's plan for the session, where a statement
-- sent as text is parsed and planned on every call; still one round trip. A producer pays
-- for every statement an enqueue runs in its transaction, and for every expression of it
-- (PL/pgSQL compiles each one at its first use in a transaction). So a message whose key
-- the crate made (a UUIDv7, the default) is inserted plainly: no key of another message can
-- equal it, so it needs no ON CONFLICT, nor the subtransaction REPEATABLE READ needs around
-- one.
--
-- Heads are marked at enqueue: a message with an aggregate key whose producer holds the
-- aggregate's lock (locks.sql) and sees no pending or parked row of it is the head, and
-- waits in the ready index beside the rows without an aggregate, for the claim to take as
-- they are. The flag is exact when true; it may be false on a head (a row enqueued while
-- its predecessor was pending, or outside READ COMMITTED, whose snapshot may predate an
-- earlier producer's commit), and the claim finds those through the ordered index.

-- The aggregates of a batch that cannot take a new head (all of them outside READ
-- COMMITTED): one scan of the ordered index for every key at once (1,000 new aggregates
-- beside 110,000 pending rows: 1.7 against 4.4 ms for a probe each). Without the settings
-- the planner may take a bitmap of the index's head column alone and filter every pending
-- row.
CREATE OR REPLACE FUNCTION {busy_fn}(p_aggregate_keys text[]) RETURNS text[]
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $fn$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN ARRAY(SELECT DISTINCT k FROM unnest(p_aggregate_keys) AS k WHERE k IS NOT NULL);
    END IF;
    RETURN ARRAY(SELECT DISTINCT o.aggregate_key FROM {table} o
                 WHERE o.head IN (false, true) AND o.aggregate_key = ANY (p_aggregate_keys)
                   AND o.status IN ('pending', 'parked'));
END
$fn$;

-- One message; false when its key exists. `p_at` is an absolute time, or NULL for now()
-- plus the delay `p_delay_us`; `p_key_generated`: the key is the crate's own, so nothing
-- else can hold it. Under REPEATABLE READ, ON CONFLICT meets a key a transaction committed
-- after this one's snapshot as a serialization failure: a duplicate all the same, and in a
-- block of its own it leaves the caller's transaction usable. (Not under SERIALIZABLE,
-- where a serialization failure may mean something else: it is the caller's to retry.)
CREATE OR REPLACE FUNCTION {enqueue_fn}(
    p_key text, p_topic text, p_aggregate_key text, p_payload bytea, p_content_type text,
    p_headers text[], p_at timestamptz, p_delay_us bigint, p_max_attempts integer,
    p_park boolean, p_notify boolean, p_key_generated boolean)
RETURNS boolean LANGUAGE plpgsql AS $fn$
DECLARE
    held text;
    lock_key bigint;
    done text;
BEGIN
    -- The lock of {lock_n_fn} for one aggregate, written out here (calling a function from
    -- this one cost five times what the lock does): `LOCK_AGGREGATE` in src/schema/statements.rs.
    IF p_aggregate_key IS NOT NULL THEN
{lock_aggregate}
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
        IF NOT FOUND THEN
            RETURN false;
        END IF;
    ELSE
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
        ON CONFLICT (key) DO NOTHING;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
    END IF;
    IF p_notify THEN
        PERFORM {notify_fn}();
    END IF;
    RETURN true;
END
$fn$;

-- The head mark of a message with an aggregate and the crate's key, for the INSERTs a
-- `Producer` prepares (src/producer/sql.rs), which take the aggregate's lock themselves
-- before they call this: the look for an earlier message, in a statement of its own, so that
-- its snapshot follows the lock and sees what a producer this one waited for committed (the
-- INSERT's own snapshot predates the lock). VOLATILE, as it must stay: a stable function's
-- statements run in its caller's snapshot. {placed_fn} calls it the same way.
DROP FUNCTION IF EXISTS {head_fn}(text, boolean);
CREATE OR REPLACE FUNCTION {head_fn}(p_aggregate_key text)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    RETURN current_setting('transaction_isolation') = 'read committed'
           AND NOT EXISTS (SELECT 1 FROM {table} o
                           WHERE o.head IN (false, true)
                             AND o.aggregate_key = p_aggregate_key
                             AND o.status IN ('pending', 'parked'));
END
$fn$;

-- Many messages, all or nothing: NULL when every one was inserted, otherwise the keys that
-- already exist, with this call's own rows taken out again (found by their tuple ids, so a
-- row an earlier statement of the transaction wrote is never touched). Headers travel
-- flattened and are sliced out by offset and length, as PostgreSQL has no ragged arrays.
-- `p_keys_generated`: every key is the crate's own.
CREATE OR REPLACE FUNCTION {enqueue_n_fn}(
    p_keys text[], p_topics text[], p_aggregate_keys text[], p_payloads bytea[],
    p_content_types text[], p_headers text[], p_at timestamptz[], p_delay_us bigint[],
    p_max_attempts integer[], p_header_offsets integer[], p_header_lens integer[],
    p_parks boolean[], p_notify boolean, p_keys_generated boolean)
RETURNS text[] LANGUAGE plpgsql AS $fn$
DECLARE
    busy text[];
    inserted tid[];
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

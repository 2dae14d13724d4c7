-- Cheaper enqueues.
--
-- Keys compare as bytes. Under a linguistic collation (the database default, even C.UTF-8
-- before PostgreSQL 17) every comparison in the key, aggregate and inbox indexes went
-- through strcoll; "C" compares with memcmp. Only order within an aggregate matters to the
-- outbox, and that is the id's, so nothing depends on the keys' linguistic order. The
-- indexes are rebuilt; the rows are not rewritten.
ALTER TABLE {table}
    ALTER COLUMN key TYPE text COLLATE "C",
    ALTER COLUMN aggregate_key TYPE text COLLATE "C";
ALTER TABLE {inbox}
    ALTER COLUMN consumer TYPE text COLLATE "C",
    ALTER COLUMN key TYPE text COLLATE "C";
ALTER TABLE {failures}
    ALTER COLUMN consumer TYPE text COLLATE "C",
    ALTER COLUMN key TYPE text COLLATE "C";

-- Relays with a worker waiting for work, so enqueue notifies only while one does: each
-- notifying commit takes a lock that every notifying commit in the cluster queues on, and
-- producers need not pay it while every relay is busy (or none listens). A relay keeps its
-- row fresh while it waits and deletes it once busy; enqueue ignores rows not refreshed for a
-- minute (a relay that died). Unlogged: after a crash it starts empty, and relays fill it
-- again as they go idle.
CREATE UNLOGGED TABLE {waiting} (
    relay text        PRIMARY KEY,
    seen  timestamptz NOT NULL DEFAULT now()
);

-- Wakes a waiting relay, if there is one; the notification goes out at commit. The one place
-- that decides whether an enqueue notifies.
CREATE FUNCTION {notify_fn}() RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    IF EXISTS (SELECT 1 FROM {waiting} WHERE seen > now() - interval '1 minute') THEN
        PERFORM pg_notify('{channel}', '');
    END IF;
END
$fn$;

-- Enqueue through functions: PL/pgSQL keeps each statement's plan for the session, where a
-- statement sent as text is parsed and planned on every call. Still one round trip.
--
-- One message; false when its key exists. $7 is an absolute time or NULL for now() plus the
-- delay $8 (microseconds); the notification, when asked for and a relay waits, is delivered
-- at commit.
CREATE FUNCTION {enqueue_fn}(
    p_key text, p_topic text, p_aggregate_key text, p_payload bytea, p_content_type text,
    p_headers text[], p_at timestamptz, p_delay_us bigint, p_max_attempts integer,
    p_notify boolean)
RETURNS boolean LANGUAGE plpgsql AS $fn$
BEGIN
    INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                         available_at, max_attempts)
    VALUES (p_key, p_topic, p_aggregate_key, p_payload, p_content_type, p_headers,
            coalesce(p_at, now() + p_delay_us * interval '1 microsecond'), p_max_attempts)
    ON CONFLICT (key) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF p_notify THEN
        PERFORM {notify_fn}();
    END IF;
    RETURN true;
END
$fn$;

-- Many messages, all or nothing: NULL when every one was inserted, otherwise the keys that
-- already exist, with this call's own rows taken out again (found by their tuple ids, so a
-- row an earlier statement of the transaction wrote is never touched). Headers travel
-- flattened and are sliced out by offset and length, as PostgreSQL has no ragged arrays.
CREATE FUNCTION {enqueue_n_fn}(
    p_keys text[], p_topics text[], p_aggregate_keys text[], p_payloads bytea[],
    p_content_types text[], p_headers text[], p_at timestamptz[], p_delay_us bigint[],
    p_max_attempts integer[], p_header_offsets integer[], p_header_lens integer[],
    p_notify boolean)
RETURNS text[] LANGUAGE plpgsql AS $fn$
DECLARE
    inserted tid[];
    existing text[];
BEGIN
    WITH ins AS (
        INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                             available_at, max_attempts)
        SELECT i.key, i.topic, i.aggregate_key, i.payload, i.content_type,
               p_headers[i.header_offset + 1 : i.header_offset + i.header_len],
               coalesce(i.available_at, now() + i.delay_us * interval '1 microsecond'),
               i.max_attempts
        FROM unnest(p_keys, p_topics, p_aggregate_keys, p_payloads, p_content_types, p_at,
                    p_delay_us, p_max_attempts, p_header_offsets, p_header_lens)
             WITH ORDINALITY
             AS i(key, topic, aggregate_key, payload, content_type, available_at, delay_us,
                  max_attempts, header_offset, header_len, ord)
        ORDER BY i.ord
        ON CONFLICT (key) DO NOTHING
        RETURNING ctid)
    SELECT array_agg(ctid) INTO inserted FROM ins;
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

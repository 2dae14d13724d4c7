-- Places in an aggregate's publication sequence (`OutboxBuilder::sequence`, migration 7),
-- for the rows an enqueue function just wrote: the rows of the keys `p_keys` that have an
-- aggregate and no place yet, each aggregate's in id order, after the last place its
-- counter gave. Called in the producer's transaction once the enqueue function returned,
-- which took the aggregates' locks (locks.sql): no other producer of these aggregates can
-- take a place until this transaction ends, so places follow commit order, and a rollback
-- takes them back with the counter. Returns how many rows it placed.
--
-- A place given after the insert costs the row a second version; the single enqueue of a
-- message with the crate's key, the common one, gets its place in its INSERT instead (the
-- statements of src/producer/sql.rs).
--
-- Planned once per session: the generic plan looked ten times dearer than a custom one, so
-- PL/pgSQL planned the statement again on every call, which cost more than the statement
-- (measured: 450 against 70 us a call).
CREATE OR REPLACE FUNCTION {place_fn}(p_keys text[]) RETURNS bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    placed bigint;
BEGIN
    WITH fresh AS MATERIALIZED (
        SELECT t.id, t.aggregate_key COLLATE "C" AS aggregate_key,
               row_number() OVER (PARTITION BY t.aggregate_key ORDER BY t.id) AS n,
               count(*) OVER (PARTITION BY t.aggregate_key) AS total
        FROM {table} t
        WHERE t.key = ANY (p_keys) AND t.aggregate_key IS NOT NULL AND t.sequence IS NULL),
    bumped AS (
        INSERT INTO {sequences} AS s (aggregate_key, last)
        SELECT aggregate_key, max(total) FROM fresh GROUP BY aggregate_key
        ORDER BY aggregate_key
        ON CONFLICT (aggregate_key) DO UPDATE SET last = s.last + excluded.last
        RETURNING s.aggregate_key, s.last),
    written AS (
        UPDATE {table} t SET sequence = b.last - f.total + f.n
        FROM fresh f JOIN bumped b ON b.aggregate_key = f.aggregate_key
        WHERE t.id = f.id
        RETURNING 1)
    SELECT count(*) INTO placed FROM written;
    RETURN placed;
END
$fn$;

-- A message with an aggregate and the crate's key, with its place, for `Outbox::enqueue`:
-- what the INSERT a `Producer` prepares does (src/producer/sql.rs, `ordered_placed`), in a
-- function, whose statements are planned once per session where that INSERT sent as text
-- is planned on every call (measured over an enqueue without places: 170-210 us
-- against 35-75).
-- The aggregate's lock first (`LOCK_AGGREGATE` in src/schema/statements.rs), then the head
-- mark and the counter's place.
CREATE OR REPLACE FUNCTION {placed_fn}(
    p_key text, p_topic text, p_aggregate_key text, p_payload bytea, p_content_type text,
    p_headers text[], p_at timestamptz, p_delay_us bigint, p_max_attempts integer,
    p_park boolean, p_notify boolean)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    held text;
    lock_key bigint;
    done text;
    is_head boolean;
    place bigint;
BEGIN
{lock_aggregate}
    IF p_notify THEN
        PERFORM {notify_fn}();
    END IF;
    is_head := {head_fn}(p_aggregate_key);
    INSERT INTO {sequences} AS s (aggregate_key, last) VALUES (p_aggregate_key, 1)
    ON CONFLICT (aggregate_key) DO UPDATE SET last = s.last + 1
    RETURNING s.last INTO place;
    INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                         available_at, max_attempts, park, head, sequence)
    VALUES (p_key, p_topic, p_aggregate_key, p_payload, p_content_type, p_headers,
            coalesce(p_at, now() + p_delay_us * interval '1 microsecond'), p_max_attempts,
            p_park, is_head, place);
END
$fn$;

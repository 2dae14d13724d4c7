-- Order under racing producers: an enqueue of an aggregate first takes a transaction-scoped
-- advisory lock keyed by the table and the aggregate, so a second producer of that aggregate
-- waits until the first commits or rolls back: per aggregate, id order is commit order. Rows
-- without an aggregate key take no lock.
--
-- PostgreSQL's lock table is shared and finite (about max_locks_per_transaction x
-- max_connections entries), so one transaction takes at most 64 aggregate locks. Past that
-- it locks the table's ordered enqueues instead: sixteen bucket locks, all of them,
-- exclusively, in order. Every aggregate lock holder also holds its aggregate's bucket,
-- shared; one lock shared by every producer was a point of contention (measured at 16
-- producers: 4% of the throughput, against none for sixteen). The setting
-- postgres_outbox.aggregate_locks lists the lock keys the transaction holds
-- ('<xid>:,k1,k2,' and 't<key>' for a table's lock), so an aggregate it has locked already
-- costs no lock and no count. It is set for the session, not the transaction, and tagged
-- with the transaction's id: a transaction-local setting cost three times as much per
-- enqueue (measured: 8.5 against 2.5 us), and a stale value is simply not this
-- transaction's. The single enqueue writes the same lock out in its own body (see
-- enqueue.sql): calling this function from it cost five times what the lock does.

-- Locks a batch's aggregates in the byte order of their keys, so two batches never wait on
-- each other in a circle, and a producer that enqueues one aggregate at a time in that
-- order never waits in a circle with a batch either. A batch of more aggregates than a
-- transaction may lock goes to the table's lock without hashing each key first.
CREATE OR REPLACE FUNCTION {lock_n_fn}(p_aggregate_keys text[]) RETURNS void
LANGUAGE plpgsql AS $fn$
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
    IF cardinality(p_aggregate_keys) <= 64
       OR (SELECT count(DISTINCT a COLLATE "C") FROM unnest(p_aggregate_keys) AS a) <= 64 THEN
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
            RETURN;
        END IF;
    END IF;
    PERFORM pg_advisory_xact_lock({table_lock} + bucket) FROM generate_series(0, 15) AS bucket;
    PERFORM set_config('postgres_outbox.aggregate_locks', held || 't{table_lock_text},', false);
END
$fn$;

-- A large batch about to be copied in: its locks, its busy aggregates (see {busy_fn} in
-- enqueue.sql), and its notification, in one round trip.
CREATE OR REPLACE FUNCTION {lock_heads_fn}(p_aggregate_keys text[], p_notify boolean) RETURNS text[]
LANGUAGE plpgsql AS $fn$
BEGIN
    IF p_notify THEN
        PERFORM {notify_fn}();
    END IF;
    IF p_aggregate_keys IS NULL THEN
        RETURN '{}';
    END IF;
    PERFORM {lock_n_fn}(p_aggregate_keys);
    RETURN {busy_fn}(p_aggregate_keys);
END
$fn$;

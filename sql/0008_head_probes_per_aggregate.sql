-- Head checks that stay index probes.
--
-- Migration 0007 checked a batch's aggregates for pending rows with EXISTS subqueries, and
-- the planner runs those as one read of every pending row into a hash as soon as it costs
-- that below a probe per aggregate, which it does early: its index costs assume pages on
-- disk. Measured: 1,000 new aggregates beside 20,000 pending rows took 14 ms against 2 ms
-- for the probes, and an `enqueue_all` of 1,000 scheduled rows read a table of 100,000 rows
-- whole (17 ms); the cost grows with the table, not the batch. A LATERAL subquery with
-- LIMIT 1 cannot become a hash: one probe of {ordered_idx} per aggregate, whatever the sizes
-- and statistics. The functions are otherwise those of migration 0007.
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

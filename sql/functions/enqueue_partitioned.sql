-- Enqueue on a partitioned table (enqueue.sql is a plain table's, and says why functions,
-- and how heads are marked).
--
-- A unique index of a partitioned table must hold the partition key, so the key's
-- uniqueness is in two parts: a unique index on each partition, and, for keys the caller
-- gave, a look for the key in every partition before the insert. The look sees every key
-- written before the last cut, because the cut waits for such producers to commit (see
-- {partition_fn} in partitions.sql); after the cut, producers write to one partition, whose
-- index decides. Keys the crate makes need neither: nothing else can hold them.
--
-- A message with an aggregate key is a head when no earlier message of its aggregate is
-- pending or parked. That look reads only the partitions that may hold such a message,
-- those not quiet (a quiet partition holds sent and dead rows only, and nothing may write to
-- it again but a redrive, which marks it not quiet first): the first three alone and every
-- one from the fourth on. So messages held in old partitions, scheduled far ahead or
-- parked, bring no partition after them back into the look, up to three of them, and the
-- look's cost follows the backlog, not the partitions kept. The partitions are a variable,
-- so the look leaves the quiet ones out when it starts. As a subquery of the same statement
-- it gave back half of what it saves, from a function of its own a fifth to a third
-- (`cargo bench --bench outbox partitions`). When those partitions follow one another (the
-- open one and those ahead, nothing held back before them), the look is one range from the
-- first of them, which leaves the others out at a fraction of what pruning by the ranges'
-- ORs costs (`LOOK_IN_ONE_RUN` in src/schema/statements.rs).

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
CREATE OR REPLACE FUNCTION {key_taken_fn}(p_key text) RETURNS boolean
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $fn$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({key_epoch_lock});
    RETURN EXISTS (SELECT 1 FROM {table} t WHERE t.key = p_key);
END
$fn$;

-- The keys of a batch that a partition holds, sorted.
CREATE OR REPLACE FUNCTION {keys_taken_fn}(p_keys text[]) RETURNS text[]
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $fn$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({key_epoch_lock});
    RETURN ARRAY(SELECT k
                 FROM (SELECT DISTINCT k FROM unnest(p_keys) AS k) AS keys,
                      LATERAL (SELECT 1 FROM {table} t WHERE t.key = keys.k LIMIT 1) AS found
                 ORDER BY k);
END
$fn$;

-- The aggregates of a batch that cannot take a new head, in the partitions not quiet.
CREATE OR REPLACE FUNCTION {busy_fn}(p_aggregate_keys text[]) RETURNS text[]
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $fn$
DECLARE
    look bigint[];
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN ARRAY(SELECT DISTINCT k FROM unnest(p_aggregate_keys) AS k WHERE k IS NOT NULL);
    END IF;
    look := {look_partitions};
    -- A probe per aggregate: with every key in one condition, ranges of the primary key
    -- look cheaper to the planner, and it reads every row in them.
    IF {look_in_one_run} THEN
        RETURN ARRAY(SELECT k
                     FROM (SELECT DISTINCT k FROM unnest(p_aggregate_keys) AS k) AS keys,
                          LATERAL (SELECT 1 FROM {table} o
                                   WHERE o.head IN (false, true) AND o.aggregate_key = keys.k
                                     AND o.status IN ('pending', 'parked')
                                     AND {from_look}
                                   LIMIT 1) AS found);
    END IF;
    RETURN ARRAY(SELECT k
                 FROM (SELECT DISTINCT k FROM unnest(p_aggregate_keys) AS k) AS keys,
                      LATERAL (SELECT 1 FROM {table} o
                               WHERE o.head IN (false, true) AND o.aggregate_key = keys.k
                                 AND o.status IN ('pending', 'parked')
                                 AND {in_look}
                               LIMIT 1) AS found);
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
    done text;
    new_id bigint;
    look bigint[];
    is_head boolean := false;
BEGIN
    -- The lock of {lock_n_fn} for one aggregate, written out here (calling a function from
    -- this one cost five times what the lock does): `LOCK_AGGREGATE` in src/schema/statements.rs.
    IF p_aggregate_key IS NOT NULL THEN
{lock_aggregate}
    END IF;
    -- The look for an earlier message, after the lock, so that its snapshot sees what earlier
    -- producers of the aggregate committed: `LOOK_EARLIER` in src/schema/statements.rs, as
    -- {head_fn} has it.
    IF p_aggregate_key IS NOT NULL
       AND current_setting('transaction_isolation') = 'read committed' THEN
{look_earlier}
    END IF;
    IF p_key_generated THEN
        INSERT INTO {table} (key, topic, aggregate_key, payload, content_type, headers,
                             available_at, max_attempts, park, head)
        VALUES (p_key, p_topic, p_aggregate_key, p_payload, p_content_type, p_headers,
                coalesce(p_at, now() + p_delay_us * interval '1 microsecond'), p_max_attempts,
                p_park, is_head);
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
        IF new_id >> {id_bits} > (SELECT max(n) FROM {partitions} WHERE opened_at IS NOT NULL) THEN
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
                p_park, is_head)
        ON CONFLICT DO NOTHING
        RETURNING id INTO new_id;
        IF new_id IS NULL THEN
            RETURN false;
        END IF;
        -- SERIALIZABLE: a key written in another partition is no conflict its checks see.
        IF current_setting('transaction_isolation') <> 'read committed'
           AND new_id >> {id_bits} > (SELECT max(n) FROM {partitions} WHERE opened_at IS NOT NULL) THEN
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

-- The head mark for the INSERTs a `Producer` prepares, as enqueue.sql's {head_fn} (which says
-- why it is apart from the INSERT), looking into the partitions {enqueue_fn} looks into.
DROP FUNCTION IF EXISTS {head_fn}(text, boolean);
CREATE OR REPLACE FUNCTION {head_fn}(p_aggregate_key text)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    look bigint[];
    is_head boolean;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN false;
    END IF;
    -- `LOOK_EARLIER` in src/schema/statements.rs, as {enqueue_fn} has it.
{look_earlier}
    RETURN is_head;
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
       AND (SELECT max(i) FROM unnest(inserted) AS i) >> {id_bits}
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

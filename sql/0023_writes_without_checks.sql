-- Rows written without CHECK constraints.
--
-- PostgreSQL compiles a table's CHECK constraints from the catalog's text again for every
-- statement that writes a row. On this table that was the status and attempt-budget
-- checks: about 10 us of server time for each single enqueue in a profile with four
-- producers (a hand-written outbox row has none); every claim and outcome statement, an
-- UPDATE, compiled them too (once a statement, however many rows). Neither could ever
-- fail on what the crate writes: a message's attempt budget is refused outside
-- 1..=i32::MAX before any SQL is sent, and every status is a literal of the crate's own
-- statements. So both go, from the table and from each partition, which holds copies of
-- its own (made by LIKE), and so does the id range each partition was given so that
-- attaching it would not read it: once attached, its bounds say the same, and every row
-- routed to it paid for the check again. A check of the application's stays.
DO $do$
DECLARE
    rel regclass;
    con name;
BEGIN
    -- The table first: a partition's copy of a constraint the table still has cannot go.
    FOR rel IN SELECT '{table}'::regclass
               UNION ALL
               SELECT * FROM (SELECT inhrelid::regclass FROM pg_inherits
                              WHERE inhparent = '{table}'::regclass ORDER BY inhrelid) AS parts
    LOOP
        FOR con IN SELECT conname FROM pg_constraint
                   WHERE conrelid = rel AND contype = 'c'
                     AND ((conname = 'ids' AND rel <> '{table}'::regclass)
                          OR pg_get_constraintdef(oid) IN (
                              'CHECK ((max_attempts >= 1))',
                              'CHECK ((status = ANY (ARRAY[''pending''::text, ''sent''::text, '
                              || '''dead''::text, ''parked''::text]))) NOT VALID',
                              'CHECK ((status = ANY (ARRAY[''pending''::text, ''sent''::text, '
                              || '''dead''::text, ''parked''::text])))'))
        LOOP
            EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', rel, con);
        END LOOP;
    END LOOP;
END
$do$;

-- The partition maker of migration 0012, with no id range left on the partitions it makes:
-- a new partition is empty, so attaching it reads nothing either way. With the owner's
-- rights, as migration 0015 made it.
CREATE OR REPLACE FUNCTION {partition_fn}(p_cut boolean) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    width constant bigint := 1099511627776;
    seq text;
    last bigint;
    called boolean;
    open_n bigint;
    open_row {partitions};
    k bigint;
    part text;
    made boolean := true;
BEGIN
    PERFORM FROM {partitions} LIMIT 1;
    IF NOT FOUND OR NOT pg_try_advisory_xact_lock({partition_lock}) THEN
        RETURN NULL;
    END IF;
    seq := pg_get_serial_sequence('{table}', 'id');
    EXECUTE format('SELECT last_value, is_called FROM %s', seq) INTO last, called;
    open_n := (CASE WHEN called THEN last + 1 ELSE last END) / width;
    SELECT * INTO open_row FROM {partitions} WHERE n = open_n;
    IF NOT FOUND THEN
        -- Past the last partition made (2^40 ids in one interval): the newest one's settings.
        SELECT * INTO open_row FROM {partitions} ORDER BY n DESC LIMIT 1;
    END IF;
    -- What a cut that failed after its setval left unwritten (and the first call's own).
    UPDATE {partitions} SET opened_at = clock_timestamp()
    WHERE n = open_n AND opened_at IS NULL;
    UPDATE {partitions} SET closed_at = clock_timestamp()
    WHERE n < open_n AND closed_at IS NULL;
    SELECT * INTO open_row FROM {partitions} WHERE n = open_n;
    IF NOT FOUND THEN
        SELECT * INTO open_row FROM {partitions} ORDER BY n DESC LIMIT 1;
    END IF;

    -- Made apart and attached: ATTACH locks the table against DDL only, where CREATE TABLE
    -- .. PARTITION OF would lock out producers and relays too.
    PERFORM set_config('lock_timeout', '500ms', true);
    FOR k IN open_n .. open_n + open_row.ahead LOOP
        part := format('%s%I', '{schema_prefix}', '{name}_p' || k);
        CONTINUE WHEN to_regclass(part) IS NOT NULL;
        BEGIN
            EXECUTE format('CREATE TABLE %s (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
                              WITH (autovacuum_vacuum_scale_factor = 0.01,
                                    autovacuum_vacuum_threshold = 1000,
                                    autovacuum_analyze_scale_factor = 0.02)', part);
            -- Keys are unique in each partition by this index, and across partitions by
            -- the enqueue functions' look into each (see the partitioned outbox's DDL).
            EXECUTE format('CREATE UNIQUE INDEX %I ON %s (key)', '{name}_k' || k, part);
            EXECUTE format('ALTER TABLE {table} ATTACH PARTITION %s FOR VALUES FROM (%s) TO (%s)',
                           part, k * width, (k + 1) * width);
        EXCEPTION WHEN lock_not_available THEN
            RAISE WARNING 'outbox {name}: partition % not made: the table is locked', k;
            made := false;
            EXIT;
        END;
        INSERT INTO {partitions} (n, every, ahead)
        VALUES (k, open_row.every, open_row.ahead)
        ON CONFLICT (n) DO UPDATE SET made_at = now();
        INSERT INTO {counts} (part, slot) SELECT k, generate_series(0, 15)
        ON CONFLICT DO NOTHING;
    END LOOP;

    IF (p_cut OR floor(extract(epoch FROM now()) / extract(epoch FROM open_row.every))
                 > floor(extract(epoch FROM open_row.opened_at)
                         / extract(epoch FROM open_row.every)))
       AND EXISTS (SELECT FROM {partitions} WHERE n = open_n + 1 AND made_at < now())
       AND to_regclass(format('%s%I', '{schema_prefix}', '{name}_p' || (open_n + 1))) IS NOT NULL
    THEN
        -- A producer of a key the caller gave holds {key_epoch_lock} shared from before it
        -- looks for the key in every partition until it commits. The cut waits until none
        -- does: every such key written before the cut is then committed, where every probe
        -- after it sees it. A REPEATABLE READ producer that began before the lock was had
        -- may not see them: the cut's time, taken once the lock is, turns it away.
        PERFORM set_config('lock_timeout', '100ms', true);
        BEGIN
            PERFORM pg_advisory_xact_lock({key_epoch_lock});
        EXCEPTION WHEN lock_not_available THEN
            RAISE WARNING 'outbox {name}: partition % not cut: a producer held it', open_n;
            p_cut := NULL;
        END;
        IF p_cut IS NOT NULL THEN
            UPDATE {partitions} SET closed_at = clock_timestamp() WHERE n = open_n;
            UPDATE {partitions} SET opened_at = clock_timestamp() WHERE n = open_n + 1;
            PERFORM setval(seq, (open_n + 1) * width, false);
            open_n := open_n + 1;
        END IF;
    END IF;
    RETURN (SELECT count(*) FROM {partitions} WHERE n > open_n
              AND to_regclass(format('%s%I', '{schema_prefix}', '{name}_p' || n))
                  IS NOT NULL);
END
$fn$;

-- CREATE OR REPLACE gives a function its settings anew (its grants stay): the search path
-- of migration 0015, decided the same way.
{partition_search_path}

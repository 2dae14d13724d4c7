-- Partitions, for outboxes that ask for them (`partition_interval`).
--
-- A busy outbox deletes as many rows as it writes, and DELETE is the wall queues built on
-- PostgreSQL hit first: each row a dead tuple for vacuum to find, a day's purge slower than
-- a day's traffic. A partitioned outbox instead drops a partition whole once every row in
-- it is sent: the cost of dropping one table.
--
-- The partition key is the id, not the enqueue time. Every statement after an enqueue (the
-- claim's lock, the outcome, a fence) finds its row by id, so by id each touches one
-- partition; by time each would probe every partition's primary key, which would have to
-- hold the time as well. Ids follow time because the relay moves the id sequence on: each
-- partition holds 2^40 ids, and when a partition has been open for its interval (by the
-- clock: a day's partition is cut at midnight UTC) the sequence jumps to the first id of
-- the next one, which exists by then. A partition is created a few intervals ahead, and a
-- partition whose interval passed with no relay running simply stays open longer: a
-- producer never meets an id no partition takes, and there is no default partition to
-- fill up.
--
-- This migration creates the bookkeeping and the two functions on every outbox. On a plain
-- one, whose {partitions} stays empty, the relay's periodic call returns at once.

-- The sent count by partition as well as by slot, so that dropping a partition takes its
-- rows off the count without counting them. On a plain table every row is in partition 0.
ALTER TABLE {counts} ADD COLUMN part bigint NOT NULL DEFAULT 0;
DO $do$
BEGIN
    EXECUTE format('ALTER TABLE {counts} DROP CONSTRAINT %I',
                   (SELECT conname FROM pg_constraint
                    WHERE conrelid = '{counts}'::regclass AND contype = 'p'));
END
$do$;
ALTER TABLE {counts} ADD PRIMARY KEY (part, slot);

-- One row per partition: partition n holds ids [n * 2^40, (n + 1) * 2^40). `every` is how
-- long it stays open once ids start to fall in it (`opened_at`); `closed_at`, when the
-- sequence moved past it; `made_at`, when the transaction that made its table began.
CREATE TABLE {partitions} (
    n         bigint      PRIMARY KEY CHECK (n >= 0),
    every     interval    NOT NULL CHECK (every > interval '0'),
    ahead     integer     NOT NULL CHECK (ahead >= 1),
    made_at   timestamptz NOT NULL DEFAULT now(),
    opened_at timestamptz,
    closed_at timestamptz
);

-- Keeps the partitions: makes what is missing ahead of the open one, then cuts the open one
-- when its interval is over. One caller at a time (retention included); the others return
-- at once. `p_cut`: cut now, whatever the clock says. Returns how many partitions exist
-- ahead of the open one, NULL on a plain outbox or when another caller holds the upkeep.
--
-- The cut moves the sequence (setval, which no rollback undoes) only to a partition made
-- by an earlier, committed transaction, and as the very last thing it does, after the
-- bookkeeping; a cut whose transaction failed after all is seen and written down by the
-- next call. It waits at most 100 ms for producers of the caller's keys (see below), and
-- gives up until the next call rather than keep them queued behind it.
CREATE FUNCTION {partition_fn}(p_cut boolean) RETURNS integer
LANGUAGE plpgsql AS $fn$
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
            EXECUTE format('ALTER TABLE %s ADD CONSTRAINT ids CHECK (id >= %s AND id < %s)',
                           part, k * width, (k + 1) * width);
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

-- Retention by partition: drops the oldest partition if the sequence has moved past it and
-- its rows are all sent, the last of them before `p_before`, and its sent count with it.
-- A partition that holds a pending, dead or parked row stays whole until that row is sent,
-- redriven and sent, skipped or purged, and so do the ones after it. The table is locked
-- for the drop itself (a second at most, or the partition waits for the next call), and
-- the check made again under the lock, which only READ COMMITTED sees through: producers
-- that drew ids in the partition just before the cut have committed, or rolled back, by
-- then. One partition per call, so no lock outlives a drop; one caller at a time (the
-- upkeep's lock), so two never lock the table and a partition in turn. Returns the rows the
-- partition held, NULL when none was dropped. `p_dry`: drops nothing, and returns the rows
-- of every partition calls would drop now.
CREATE FUNCTION {retire_fn}(p_before timestamptz, p_dry boolean)
RETURNS bigint LANGUAGE plpgsql AS $fn$
DECLARE
    width constant bigint := 1099511627776;
    seq text;
    last bigint;
    called boolean;
    p record;
    part text;
    -- Through the partial indexes: pending rows in the claim's two, dead and parked ones in
    -- the done index, whose last sent entry is the newest.
    probe constant text := 'SELECT EXISTS (SELECT 1 FROM %1$s WHERE status = ''pending''
                                             AND (head OR aggregate_key IS NULL))
                                OR EXISTS (SELECT 1 FROM %1$s
                                           WHERE status IN (''pending'', ''parked'')
                                             AND aggregate_key IS NOT NULL)
                                OR EXISTS (SELECT 1 FROM %1$s WHERE status IN (''dead'', ''parked'')),
                                (SELECT max(done_at) FROM %1$s WHERE status = ''sent'')';
    unfinished boolean;
    newest timestamptz;
    n_sent bigint;
    total bigint;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'outbox {name}: partitions are dropped under READ COMMITTED only'
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    PERFORM pg_advisory_xact_lock({partition_lock});
    seq := pg_get_serial_sequence('{table}', 'id');
    EXECUTE format('SELECT last_value, is_called FROM %s', seq) INTO last, called;
    FOR p IN SELECT n FROM {partitions}
             WHERE n < (CASE WHEN called THEN last + 1 ELSE last END) / width ORDER BY n LOOP
        part := format('%s%I', '{schema_prefix}', '{name}_p' || p.n);
        IF to_regclass(part) IS NULL THEN
            -- Dropped by hand: its bookkeeping goes too.
            IF NOT p_dry THEN
                DELETE FROM {partitions} WHERE n = p.n;
                DELETE FROM {counts} c WHERE c.part = p.n;
            END IF;
            CONTINUE;
        END IF;
        EXECUTE format(probe, part) INTO unfinished, newest;
        EXIT WHEN unfinished OR newest >= p_before;
        SELECT coalesce(sum(c.sent), 0) INTO n_sent FROM {counts} c WHERE c.part = p.n;
        IF p_dry THEN
            total := coalesce(total, 0) + n_sent;
            CONTINUE;
        END IF;
        PERFORM set_config('lock_timeout', '1s', true);
        BEGIN
            LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE;
            EXECUTE format(probe, part) INTO unfinished, newest;
            IF unfinished OR newest >= p_before THEN
                RETURN NULL;
            END IF;
            EXECUTE format('DROP TABLE %s', part);
        EXCEPTION WHEN lock_not_available THEN
            RAISE WARNING 'outbox {name}: partition % not dropped: the table is busy', p.n;
            RETURN NULL;
        END;
        DELETE FROM {partitions} WHERE n = p.n;
        SELECT coalesce(sum(c.sent), 0) INTO n_sent FROM {counts} c WHERE c.part = p.n;
        DELETE FROM {counts} c WHERE c.part = p.n;
        RETURN n_sent;
    END LOOP;
    RETURN total;
END
$fn$;

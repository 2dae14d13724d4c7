-- Settled partitions: a closed partition whose rows are all sent, and into which no
-- transaction can still write, holds nothing `stats` counts, now or later (a sent row never
-- becomes anything else). `stats` starts its reads after the last settled partition, so
-- its cost follows the partitions that may hold a backlog, not the days retention keeps.
--
-- A producer may write into a partition after the cut that closed it: it drew its id just
-- before the cut, in a transaction still running. Such a transaction holds a virtual
-- transaction id from before the cut, so the cut writes down every one running then, and
-- a partition settles only once none is left and no prepared transaction (whose row may be
-- in it, still invisible) waits in the database.
ALTER TABLE {partitions} ADD COLUMN settled_at timestamptz;
ALTER TABLE {partitions} ADD COLUMN cut_vxids text[];
-- Partitions closed before this migration: whatever runs now may have drawn ids in them.
UPDATE {partitions} SET cut_vxids = ARRAY(SELECT virtualxid FROM pg_locks
                                          WHERE locktype = 'virtualxid')
WHERE closed_at IS NOT NULL;

-- Migration 0012's upkeep, with two changes: a cut writes down the virtual transactions
-- running once its setval is done, and the upkeep settles closed partitions, oldest first,
-- stopping at the first that is not settled.
CREATE OR REPLACE FUNCTION {partition_fn}(p_cut boolean) RETURNS integer
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
    -- Pending, parked or dead rows, through the partial indexes (as {retire_fn} looks).
    unsettled constant text := 'SELECT EXISTS (SELECT 1 FROM %1$s WHERE status = ''pending''
                                                 AND (head OR aggregate_key IS NULL))
                                    OR EXISTS (SELECT 1 FROM %1$s
                                               WHERE status IN (''pending'', ''parked'')
                                                 AND aggregate_key IS NOT NULL)
                                    OR EXISTS (SELECT 1 FROM %1$s
                                               WHERE status IN (''dead'', ''parked''))';
    p {partitions};
    busy boolean;
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
    UPDATE {partitions} SET closed_at = clock_timestamp(),
                            cut_vxids = ARRAY(SELECT virtualxid FROM pg_locks
                                              WHERE locktype = 'virtualxid')
    WHERE n < open_n AND closed_at IS NULL;
    SELECT * INTO open_row FROM {partitions} WHERE n = open_n;
    IF NOT FOUND THEN
        SELECT * INTO open_row FROM {partitions} ORDER BY n DESC LIMIT 1;
    END IF;

    -- Settled, oldest first: a closed partition with nothing but sent rows, once every
    -- transaction that ran at its cut has ended and none is prepared (any prepared one: its
    -- session, and so its virtual transaction, is gone). Each look in this order: PREPARE
    -- lists a transaction as prepared before it lets its virtual one go, and the rows are
    -- read last, under READ COMMITTED only, by a snapshot taken after both looks (an older
    -- one could miss the row of a producer that has just ended). A partition locked
    -- against reads, or dropped by hand meanwhile, waits for the next upkeep; the ones
    -- before it stay settled.
    PERFORM set_config('lock_timeout', '500ms', true);
    FOR p IN SELECT * FROM {partitions}
             WHERE n < open_n AND closed_at IS NOT NULL AND settled_at IS NULL
               AND current_setting('transaction_isolation') = 'read committed'
             ORDER BY n LOOP
        part := format('%s%I', '{schema_prefix}', '{name}_p' || p.n);
        IF to_regclass(part) IS NOT NULL THEN
            EXIT WHEN EXISTS (SELECT FROM pg_locks WHERE locktype = 'virtualxid'
                                                     AND virtualxid = ANY (p.cut_vxids));
            EXIT WHEN EXISTS (SELECT FROM pg_prepared_xacts
                              WHERE database = current_database());
            BEGIN
                EXECUTE format(unsettled, part) INTO busy;
            EXCEPTION WHEN lock_not_available OR undefined_table THEN
                busy := true;
            END;
            EXIT WHEN busy;
        END IF;
        UPDATE {partitions} SET settled_at = clock_timestamp(), cut_vxids = NULL
        WHERE n = p.n;
    END LOOP;

    -- Made apart and attached: ATTACH locks the table against DDL only, where CREATE TABLE
    -- .. PARTITION OF would lock out producers and relays too. (lock_timeout: as set above.)
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
            -- After the setval, every transaction that drew an id in the closed partition
            -- is running, and written down (the row is locked already: nothing to wait for).
            UPDATE {partitions} SET cut_vxids = ARRAY(SELECT virtualxid FROM pg_locks
                                                      WHERE locktype = 'virtualxid')
            WHERE n = open_n;
            open_n := open_n + 1;
        END IF;
    END IF;
    RETURN (SELECT count(*) FROM {partitions} WHERE n > open_n
              AND to_regclass(format('%s%I', '{schema_prefix}', '{name}_p' || n))
                  IS NOT NULL);
END
$fn$;

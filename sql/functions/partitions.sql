-- The upkeep of a partitioned outbox's partitions, run by relays (and retention by `purge`).
-- On a plain outbox, whose {partitions} stays empty, each returns at once.
--
-- Partition n holds ids [n * 2^40, (n + 1) * 2^40): the partition key is the id, not the
-- enqueue time, because every statement after an enqueue (the claim's lock, the outcome, a
-- fence) finds its row by id, and so touches one partition. Ids follow time because the
-- upkeep moves the id sequence on: when a partition has been open for its interval (by the
-- clock: a day's partition is cut at midnight UTC) the sequence jumps to the first id of the
-- next one, which exists by then. Partitions are made a few intervals ahead, and one whose
-- interval passed with no relay running simply stays open longer: a producer never meets an
-- id no partition takes, and there is no default partition to fill up. A busy outbox then
-- drops a partition whole once every row in it is sent, where DELETE left a dead tuple per
-- row for vacuum.
--
-- Making, attaching and dropping a partition takes the owner's rights, so these run with the
-- rights of the role that migrated (SECURITY DEFINER), as a maintenance job would, and only
-- for roles granted EXECUTE on them (README, "Roles and grants"); {ids_drawn_fn}, which
-- tells only what max(id) tells anyone who may read the table, keeps PUBLIC's.

-- Keeps the partitions: makes what is missing ahead of the open one, then cuts the open one
-- when its interval is over. One caller at a time (retention included); the others return
-- at once. `p_cut`: cut now, whatever the clock says. Returns how many partitions exist
-- ahead of the open one, NULL on a plain outbox or when another caller holds the upkeep.
--
-- The cut moves the sequence (setval, which no rollback undoes) only to a partition made
-- by an earlier, committed transaction, and as the very last thing it does, after the
-- bookkeeping; a cut whose transaction failed after all is seen and written down by the
-- next call. It waits at most 100 ms for producers of the caller's keys (see below), and
-- gives up until the next call rather than keep them queued behind it. A partition gets no
-- CHECK constraint of its own (PostgreSQL compiles every CHECK again for each statement
-- that writes a row): attaching an empty one reads nothing either way.
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

-- Settles closed partitions and marks them quiet, oldest first.
--
-- A closed partition is *quiet* once no transaction is left that may write into it (a
-- producer may write into a partition after the cut that closed it: it drew its id just
-- before the cut) and it holds no pending or parked row; enqueues' looks for an
-- aggregate's pending messages and `stats()` leave quiet partitions out. A redrive, the one
-- way a row of a quiet partition becomes pending again, marks it not quiet in the same
-- statement. A quiet partition is *settled* once it holds no dead row either and every one
-- before it is settled: `stats()` starts its reads after the last settled one. The dead
-- letters of a partition are counted once, as it becomes quiet (more than 100,000: not
-- quiet, and marked -1 rather than counted on every call), and purges take what they
-- delete off that count.
CREATE OR REPLACE FUNCTION {settle_fn}() RETURNS void
LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    q {partitions};
    p {partitions};
    part text;
    waiting boolean;
    kept boolean;
    counted bigint;
    too_many boolean;
    blocked boolean;
    settling boolean := true;
    -- Pending or parked rows, through the claim's two partial indexes; dead or parked ones
    -- through the done index.
    probe constant text := 'SELECT EXISTS (SELECT 1 FROM %1$s WHERE status = ''pending''
                                             AND (head OR aggregate_key IS NULL))
                                OR EXISTS (SELECT 1 FROM %1$s
                                           WHERE status IN (''pending'', ''parked'')
                                             AND aggregate_key IS NOT NULL),
                                EXISTS (SELECT 1 FROM %1$s WHERE status IN (''dead'', ''parked''))';
BEGIN
    -- The rows are read last, by a snapshot taken after the looks at the transactions: an
    -- older one (REPEATABLE READ's) could miss the row of a producer that has just ended.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN;
    END IF;
    -- One caller at a time, as for the rest of the upkeep (a relay calls this beside
    -- {partition_fn}, which takes the same lock), and never beside a retire.
    IF NOT pg_try_advisory_xact_lock({partition_lock}) THEN
        RETURN;
    END IF;
    -- Written down by a transaction that sees the cut committed, never by the one that
    -- made it (its row's version is not its own, and the cut came before it began): a
    -- redrive whose snapshot predates the cut sees the partition open, marks it nothing,
    -- and must be among the transactions waited for. This one, which writes no row of the
    -- outbox, is not. A row a redrive holds is left to it.
    PERFORM set_config('lock_timeout', '500ms', true);
    UPDATE {partitions} SET cut_vxids = ARRAY(SELECT virtualxid FROM pg_locks
                                              WHERE locktype = 'virtualxid'
                                                AND pid IS DISTINCT FROM pg_backend_pid())
    WHERE n IN (SELECT n FROM {partitions}
                WHERE closed_at IS NOT NULL AND settled_at IS NULL AND cut_vxids IS NULL
                  AND closed_at < transaction_timestamp()
                  AND xmin IS DISTINCT FROM pg_current_xact_id_if_assigned()::xid
                FOR UPDATE SKIP LOCKED);
    -- The transactions first, then the prepared ones: PREPARE lists a transaction as
    -- prepared before it lets its virtual one go.
    FOR q IN SELECT * FROM {partitions}
             WHERE closed_at IS NOT NULL AND settled_at IS NULL ORDER BY n LOOP
        CONTINUE WHEN q.quiet_at IS NOT NULL AND NOT settling AND q.dead IS NOT NULL;
        -- Locked before its rows are read, and written only under the lock: a redrive
        -- that makes a row of it pending holds this lock until it commits (the partition
        -- is left to it, SKIP LOCKED), and once the lock is had, the read after it sees
        -- what such a redrive committed, while one still to come waits for this
        -- transaction, then marks the partition not quiet.
        SELECT * INTO p FROM {partitions} WHERE n = q.n FOR UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        part := format('%s%I', '{schema_prefix}', '{name}_p' || p.n);
        waiting := false;
        kept := false;
        counted := 0;
        too_many := false;
        blocked := false;
        IF to_regclass(part) IS NOT NULL THEN
            -- A quiet partition passed these once, and only a redrive writes to it since.
            IF p.quiet_at IS NULL THEN
                EXIT WHEN p.cut_vxids IS NULL;
                EXIT WHEN EXISTS (SELECT FROM pg_locks WHERE locktype = 'virtualxid'
                                                         AND virtualxid = ANY (p.cut_vxids));
                EXIT WHEN EXISTS (SELECT FROM pg_prepared_xacts
                                  WHERE database = current_database());
            END IF;
            BEGIN
                EXECUTE format(probe, part) INTO waiting, kept;
                -- Its dead letters, counted once, as it becomes quiet: from then on only
                -- an operator changes them (see above). A purge that deletes some locks
                -- this partition's row as well: one holding it now made this call stop
                -- above, and one to come waits for this count, then takes its rows off.
                -- One found with too many to count is not counted again on every call
                -- (one such partition costs about 20 ms, and they all run under the
                -- upkeep's timeout), only once a purge or a redrive has cleared its mark,
                -- or its dead letters are all gone.
                IF kept AND NOT waiting AND (p.quiet_at IS NULL OR p.dead IS NULL) THEN
                    IF p.dead = -1 THEN
                        too_many := true;
                    ELSE
                        EXECUTE format('SELECT count(*) FROM (SELECT FROM %s
                                                              WHERE status IN (''dead'', ''parked'')
                                                              LIMIT 100001) AS letters', part)
                        INTO counted;
                        too_many := counted > 100000;
                    END IF;
                END IF;
            EXCEPTION WHEN lock_not_available OR undefined_table THEN
                blocked := true;
            END;
            -- A partition locked against reads (so, likely, the ones after it), or dropped
            -- by hand meanwhile, waits for the next call.
            EXIT WHEN blocked;
            -- Pending or parked rows keep this one from being quiet, not the ones after
            -- it: each is judged by its own rows. (A quiet one found holding them, as a
            -- row set pending by hand would leave it, is read again from now on.)
            IF waiting OR too_many THEN
                IF too_many AND p.dead IS DISTINCT FROM -1 THEN
                    UPDATE {partitions} SET quiet_at = NULL, dead = -1 WHERE n = p.n;
                ELSIF waiting AND p.quiet_at IS NOT NULL THEN
                    UPDATE {partitions} SET quiet_at = NULL, dead = NULL WHERE n = p.n;
                END IF;
                settling := false;
                CONTINUE;
            END IF;
        END IF;
        settling := settling AND NOT kept;
        IF p.quiet_at IS NULL OR settling OR p.dead IS NULL THEN
            UPDATE {partitions}
            SET quiet_at = coalesce(quiet_at, clock_timestamp()),
                settled_at = CASE WHEN settling THEN clock_timestamp() END,
                cut_vxids = CASE WHEN settling THEN NULL ELSE cut_vxids END,
                dead = counted
            WHERE n = p.n;
        END IF;
    END LOOP;
END
$fn$;

-- Retention by partition: each call drops one partition whose rows are all sent, the last
-- of them before `p_before`, with its sent count (or with `p_dry`, counts the rows of
-- every partition calls would drop), under the upkeep's lock, after looking again under
-- the table's lock (a second at most). A partition holding a pending, dead or parked row
-- is kept whole, and the later ones are judged by their own rows.
CREATE OR REPLACE FUNCTION {retire_fn}(p_before timestamptz, p_dry boolean)
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER AS $fn$
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
        CONTINUE WHEN unfinished OR newest >= p_before;
        SELECT coalesce(sum(c.sent), 0) INTO n_sent FROM {counts} c WHERE c.part = p.n;
        IF p_dry THEN
            total := coalesce(total, 0) + n_sent;
            CONTINUE;
        END IF;
        PERFORM set_config('lock_timeout', '1s', true);
        BEGIN
            LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE;
            -- A producer that drew its id before the cut may have committed a row since.
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

-- Where the id sequence stands, for `stats()` and `topic_stats()`: the partition of the last
-- id drawn. No row can have an id past the end of it, so they leave the partitions ahead
-- out of their plans. It reads the sequence itself, not the bookkeeping: a cut moves the
-- sequence before its bookkeeping commits. With the owner's rights, as reading the sequence
-- takes rights on it that no side is given.
CREATE OR REPLACE FUNCTION {ids_drawn_fn}() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    width constant bigint := 1099511627776;
    last bigint;
    called boolean;
BEGIN
    EXECUTE format('SELECT last_value, is_called FROM %s',
                   pg_get_serial_sequence('{table}', 'id'))
    INTO last, called;
    -- Not called: `last` is the next id (as a cut leaves it), and none has been drawn there.
    RETURN (CASE WHEN called THEN last ELSE last - 1 END) / width;
END
$fn$;

-- Running with the owner's rights, they must not find functions or tables a caller put in
-- their way, and PostgreSQL picks a function of a closer signature wherever it is on the
-- search_path, pg_catalog first or not. So a body that names the outbox's objects with
-- their schema (as `migrate` renders them) searches pg_catalog alone (and pg_temp last,
-- for tables only, which it never names unqualified). A body rendered without a schema
-- (`Outbox::sql()` of a name without one) searches the table's schema too, after
-- pg_catalog, which PostgreSQL searches first when the path does not name it (naming it
-- first would make it where the body creates a partition), so CREATE on that schema must
-- then be kept from roles that are not trusted (PostgreSQL 15 keeps it from PUBLIC on
-- `public`). CREATE OR REPLACE gives a function its settings anew (its grants stay), so
-- this runs each time the functions are made.
DO $do$
DECLARE
    home name := (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = '{table}'::regclass);
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY['{partition_fn}(boolean)'::regprocedure,
                             '{settle_fn}()'::regprocedure,
                             '{retire_fn}(timestamptz, boolean)'::regprocedure,
                             '{ids_drawn_fn}()'::regprocedure] LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f,
                       CASE WHEN strpos((SELECT prosrc FROM pg_proc WHERE oid = f),
                                        '"' || replace(home, '"', '""') || '".') > 0
                            THEN 'pg_catalog, pg_temp'
                            ELSE quote_ident(home) || ', pg_temp' END);
    END LOOP;
END
$do$;
REVOKE EXECUTE ON FUNCTION {partition_fn}(boolean), {settle_fn}(),
                           {retire_fn}(timestamptz, boolean) FROM PUBLIC;

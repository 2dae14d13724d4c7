-- A dead letter, parked message or scheduled message kept in a closed partition no longer
-- costs every partition after it.
--
-- Retention by partition stopped at the first partition it could not drop: one dead letter
-- kept, or one message scheduled a month ahead, ended retention for good, and the disk
-- filled. A purge by age now keeps such a partition whole (its sent rows with it) and goes
-- on to the next, and it judges each partition by its own rows, not by the oldest
-- partition's: a partition whose last row was sent after the cutoff is kept, and a later
-- one whose rows all went out before it is dropped. Nothing else depends on the partitions
-- going oldest first.
--
-- A dead letter also kept its partition, and every one after it, from settling, so each
-- enqueue's look for its aggregate's pending messages read them all again. That look
-- needs only the partitions that may hold a pending or parked row, so it now starts from
-- the first partition not *quiet*: closed, no transaction left that may write into it, and
-- no pending or parked row in it (dead and sent ones may stay). Settled partitions (no
-- dead row either, which `stats` counts) are quiet too. A redrive, the one way a dead row
-- becomes pending again, marks its partition not quiet in the same statement; the upkeep
-- locks a partition's row before it reads its rows, so the two meet in one order or the
-- other and never both miss each other. A redrive that still took the partition for open
-- (its snapshot predates the cut) marks nothing, and is one of the transactions the
-- upkeep waits for before a partition is quiet.
ALTER TABLE {partitions} ADD COLUMN quiet_at timestamptz;
UPDATE {partitions} SET quiet_at = settled_at WHERE settled_at IS NOT NULL;

-- Marks closed partitions quiet, and settled, oldest first: it stops at the first that is
-- not quiet, and settles none after the first that keeps a dead row. A partition already
-- quiet is read again only while every one before it is settled, to settle it once its
-- dead rows are gone, and is locked and written only then: the bookkeeping of a dead
-- letter kept, and of every quiet partition after it, is left alone call after call.
CREATE OR REPLACE FUNCTION {settle_fn}() RETURNS void
LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    q {partitions};
    p {partitions};
    part text;
    waiting boolean;
    kept boolean;
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
    -- prepared before it lets its virtual one go. A partition locked against reads, or
    -- dropped by hand meanwhile, waits for the next call; the ones before it stay settled.
    FOR q IN SELECT * FROM {partitions}
             WHERE closed_at IS NOT NULL AND settled_at IS NULL ORDER BY n LOOP
        CONTINUE WHEN q.quiet_at IS NOT NULL AND NOT settling;
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
            EXCEPTION WHEN lock_not_available OR undefined_table THEN
                waiting := true;
            END;
            EXIT WHEN waiting;
        END IF;
        settling := settling AND NOT kept;
        IF p.quiet_at IS NULL OR settling THEN
            UPDATE {partitions}
            SET quiet_at = coalesce(quiet_at, clock_timestamp()),
                settled_at = CASE WHEN settling THEN clock_timestamp() END,
                cut_vxids = CASE WHEN settling THEN NULL ELSE cut_vxids END
            WHERE n = p.n;
        END IF;
    END LOOP;
END
$fn$;

-- Retention, as migrations 12 and 15 made it, but for the partitions it keeps: each call
-- drops one partition (or with `p_dry`, counts the rows of every partition calls would
-- drop), under the upkeep's lock, after looking again under the table's lock.
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

-- CREATE OR REPLACE gives a function its settings anew (its grants stay): the search path
-- of migration 15, decided the same way.
DO $do$
DECLARE
    home name := (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = '{table}'::regclass);
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY['{settle_fn}()'::regprocedure,
                             '{retire_fn}(timestamptz, boolean)'::regprocedure] LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f,
                       CASE WHEN strpos((SELECT prosrc FROM pg_proc WHERE oid = f),
                                        '"' || replace(home, '"', '""') || '".') > 0
                            THEN 'pg_catalog, pg_temp'
                            ELSE quote_ident(home) || ', pg_temp' END);
    END LOOP;
END
$do$;

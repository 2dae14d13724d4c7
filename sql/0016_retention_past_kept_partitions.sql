-- Retention by partition no longer stops at the first partition it may not drop. A closed
-- partition holding a pending, dead or parked row was kept whole, and so was every
-- partition after it: one dead letter kept, or one message scheduled a month ahead, ended
-- retention for good, and the disk filled. A purge by age now keeps such a partition whole
-- (its sent rows with it) and goes on to the next, and it judges each partition by its own
-- rows, not by the oldest partition's: a partition whose last row was sent after the
-- cutoff is kept, and a later one whose rows all went out before it is dropped. Nothing
-- else depends on the partitions going oldest first: the ones that may hold a backlog are
-- read from the oldest not settled on (migration 13), whatever was dropped after it, and
-- a sent row is never read again.
--
-- The function is the one of migrations 12 and 15 otherwise: each call drops one partition
-- (or with `p_dry`, counts the rows of every partition calls would drop), under the
-- upkeep's lock, after looking again under the table's lock, with the owner's rights.
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

-- CREATE OR REPLACE gives the function its settings anew (its grants stay): the search path
-- of migration 15, decided the same way.
DO $do$
DECLARE
    home name := (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = '{table}'::regclass);
    f regprocedure := '{retire_fn}(timestamptz, boolean)'::regprocedure;
BEGIN
    EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f,
                   CASE WHEN strpos((SELECT prosrc FROM pg_proc WHERE oid = f),
                                    '"' || replace(home, '"', '""') || '".') > 0
                        THEN 'pg_catalog, pg_temp'
                        ELSE quote_ident(home) || ', pg_temp' END);
END
$do$;

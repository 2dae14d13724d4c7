-- A dead letter kept no longer costs `stats()` every partition after it.
--
-- `stats()` read dead letters from the oldest partition not settled, so one dead letter
-- kept in an old partition had it plan and start an index scan of every partition since:
-- 16-22 ms at 120 partitions against 6-7 with none kept. Yet the dead letters of a quiet
-- partition change only by an operator's hand: no row of it is pending, so none can die
-- there. A redrive marks the partition not quiet in the statement that makes its rows
-- pending (migration 16), and a purge now takes what it deletes off the partition's count
-- in the statement that deletes them. So the upkeep counts a partition's dead letters once,
-- when it marks the partition quiet, and `stats()` reads dead letters from the first
-- partition not quiet on, as it reads pending ones, and adds the counts of the quiet
-- partitions before it.
--
-- A message that holds its partition from being quiet (one scheduled a month ahead, a parked
-- one) kept every later partition from being quiet too: the upkeep stopped at it. It now
-- goes on past it, so the later ones are quiet as soon as their own rows allow, and
-- migration 19 has the looks, and `stats()`, leave them out.
--
-- `dead`: the dead letters of a quiet partition not settled, as the upkeep counted them and
-- purges took them off since; 0 once settled; -1 while too many to count (not quiet; see
-- {settle_fn}); NULL while not quiet otherwise, or not counted yet (the upkeep counts a
-- quiet one then). A purge by a version older than this migration leaves the count too
-- high; setting it and `quiet_at` to NULL has the partition read until the upkeep counts
-- it again (README, "Partitioned outboxes").
--
-- The upkeep's lock first, before any lock on the bookkeeping (a retire takes them in that
-- order): no upkeep marks a partition quiet uncounted while this runs.
SELECT pg_advisory_xact_lock({partition_lock});
ALTER TABLE {partitions} ADD COLUMN dead bigint;

-- The partitions quiet already: counted now. (Should one escape, under a snapshot taken
-- before an upkeep of the previous version committed, the upkeep counts it next.)
DO $do$
DECLARE
    p record;
    part text;
    kept bigint;
BEGIN
    FOR p IN SELECT n FROM {partitions}
             WHERE quiet_at IS NOT NULL AND settled_at IS NULL ORDER BY n FOR UPDATE LOOP
        part := format('%s%I', '{schema_prefix}', '{name}_p' || p.n);
        kept := 0;
        IF to_regclass(part) IS NOT NULL THEN
            EXECUTE format('SELECT count(*) FROM (SELECT FROM %s
                                                  WHERE status IN (''dead'', ''parked'')
                                                  LIMIT 100001) AS letters', part)
            INTO kept;
        END IF;
        -- Too many to count (see {settle_fn} below): read, not counted.
        UPDATE {partitions}
        SET dead = CASE WHEN kept <= 100000 THEN kept ELSE -1 END,
            quiet_at = CASE WHEN kept <= 100000 THEN quiet_at END
        WHERE n = p.n;
    END LOOP;
    UPDATE {partitions} SET dead = 0 WHERE settled_at IS NOT NULL;
END
$do$;

-- The upkeep of migration 16, counting the dead letters of each partition it marks quiet
-- (and of a quiet one not counted), and going on past a partition that still holds
-- pending or parked rows to mark the later ones quiet (it stopped there). A partition of
-- more than 100,000 dead letters is not quiet: the count runs inside the relay's upkeep
-- statement, under its timeout (a second or more), which one of millions could pass, and
-- fail the whole upkeep, cuts and partitions ahead included; so the looks and `stats()`
-- read that partition instead, and the upkeep, having marked it (-1), does not count it
-- again until a purge or a redrive changes its dead letters (after deleting some by hand,
-- set `dead` to NULL), or none is left.
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

-- CREATE OR REPLACE gives a function its settings anew (its grants stay): the search path
-- of migration 15, decided the same way.
{settle_search_path}

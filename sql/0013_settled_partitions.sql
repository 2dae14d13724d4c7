-- Settled partitions: a closed partition whose rows are all sent, and into which no
-- transaction can still write, holds nothing `stats` counts, now or later (a sent row never
-- becomes anything else). `stats` starts its reads after the last settled partition, so
-- its cost follows the partitions that may hold a backlog, not the days retention keeps.
--
-- A producer may write into a partition after the cut that closed it: it drew its id just
-- before the cut, in a transaction still running. So the first {settle_fn} to find a
-- partition closed (relays call it beside {partition_fn}, every few seconds) writes down
-- every virtual transaction running then, and a partition settles only once none of them
-- is left and no prepared transaction (whose row may be in it, still invisible, its
-- virtual transaction gone) waits in the database. However late after the cut the list is
-- written, it holds every transaction that ran at the cut and may yet write.
ALTER TABLE {partitions} ADD COLUMN settled_at timestamptz;
ALTER TABLE {partitions} ADD COLUMN cut_vxids text[];

-- Settles closed partitions, oldest first, stopping at the first that is not settled.
CREATE FUNCTION {settle_fn}() RETURNS void
LANGUAGE plpgsql AS $fn$
DECLARE
    p {partitions};
    part text;
    busy boolean;
    -- Pending, parked or dead rows, through the partial indexes (as {retire_fn} looks).
    unsettled constant text := 'SELECT EXISTS (SELECT 1 FROM %1$s WHERE status = ''pending''
                                                 AND (head OR aggregate_key IS NULL))
                                    OR EXISTS (SELECT 1 FROM %1$s
                                               WHERE status IN (''pending'', ''parked'')
                                                 AND aggregate_key IS NOT NULL)
                                    OR EXISTS (SELECT 1 FROM %1$s
                                               WHERE status IN (''dead'', ''parked''))';
BEGIN
    -- The rows are read last, by a snapshot taken after the looks at the transactions: an
    -- older one (REPEATABLE READ's) could miss the row of a producer that has just ended.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN;
    END IF;
    UPDATE {partitions} SET cut_vxids = ARRAY(SELECT virtualxid FROM pg_locks
                                              WHERE locktype = 'virtualxid')
    WHERE closed_at IS NOT NULL AND settled_at IS NULL AND cut_vxids IS NULL;
    -- The transactions first, then the prepared ones: PREPARE lists a transaction as
    -- prepared before it lets its virtual one go. A partition locked against reads, or
    -- dropped by hand meanwhile, waits for the next call; the ones before it stay settled.
    PERFORM set_config('lock_timeout', '500ms', true);
    FOR p IN SELECT * FROM {partitions}
             WHERE closed_at IS NOT NULL AND settled_at IS NULL ORDER BY n LOOP
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
END
$fn$;

-- Where the id sequence stands, for `stats()` and `topic_stats()` on a partitioned table: the
-- partition of the last id drawn. No row can have an id past the end of it, so they leave
-- the partitions ahead (made empty, two by default) out of their plans, each of which cost
-- them as much to plan as a partition holding the backlog. It reads the sequence itself,
-- not the partitions' bookkeeping: a cut moves the sequence before its bookkeeping
-- commits, and producers may commit rows past it in between. A row visible to a snapshot
-- drew its id before the snapshot was taken, so the sequence read after is past it.
--
-- With the owner's rights, as reading the sequence takes rights on it that no side is
-- given. PUBLIC keeps EXECUTE on it, as on the enqueue functions: where the sequence stands
-- is what max(id) tells anyone who may read the table, and `stats()` may be run by any
-- role that may (`Access::Relay` grants it by name too).
CREATE FUNCTION {ids_drawn_fn}() RETURNS bigint
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

-- The search path of migration 15, decided the same way.
{ids_drawn_search_path}

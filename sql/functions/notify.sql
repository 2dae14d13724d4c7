-- Waking relays: which channel the producers notify on, and the one place that decides
-- whether an enqueue notifies.
--
-- Each notifying commit takes a lock that every notifying commit in the cluster queues on, so
-- enqueue notifies only while a relay waits for work ({waiting}: a relay keeps its row fresh
-- while it waits and deletes it once busy; rows not refreshed for a minute are a relay that
-- died). The notification goes out at commit.

-- Relays ask the database which channel the producers notify on, rather than work it out
-- from the table's name as they were given it (`orders` and `public.orders` would differ).
CREATE OR REPLACE FUNCTION {channel_fn}() RETURNS text LANGUAGE sql IMMUTABLE AS $fn$
    SELECT '{channel}'::text
$fn$;

-- Whether a relay waits, and the notification if one does, is `NOTIFY_IF_WAITING` in
-- src/schema/statements.rs: the enqueue functions call this one, and the statements a
-- `Producer` prepares hold the same expression.
CREATE OR REPLACE FUNCTION {notify_fn}() RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM {notify_if_waiting};
END
$fn$;

-- Partition upkeep for roles that do not own the table. Making, attaching and dropping a
-- partition takes the owner's rights, and a partition the upkeep makes belongs to the
-- owner, so a relay running as a role of its own could neither keep the partitions nor
-- read them to settle them: its upkeep failed, logged once, and the open partition stayed
-- open. The three upkeep functions now run with the rights of the role that migrated (the
-- owner), as a maintenance job would, and only for roles granted EXECUTE on them: the
-- owner may run them as before, anyone else must be given them (a retire called with
-- `now()` drops every partition whose rows are all sent).
--
-- Running with the owner's rights, they must not find functions or tables a caller put in
-- their way, and PostgreSQL picks a function of a closer signature wherever it is on the
-- search_path, pg_catalog first or not. So a body that names the outbox's objects with
-- their schema (as `migrate` renders them) searches pg_catalog alone (and pg_temp last,
-- for tables only, which it never names unqualified). A body rendered without a schema
-- (`Outbox::sql()` of a name without one) searches the table's schema too, after
-- pg_catalog, which PostgreSQL searches first when the path does not name it (naming it
-- first would make it where the body creates a partition), so CREATE on that schema must
-- then be kept from roles that are not trusted (PostgreSQL 15 keeps it from PUBLIC on
-- `public`).
DO $do$
DECLARE
    home name := (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = '{table}'::regclass);
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY['{partition_fn}(boolean)'::regprocedure,
                             '{settle_fn}()'::regprocedure,
                             '{retire_fn}(timestamptz, boolean)'::regprocedure] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %s', f,
                       CASE WHEN strpos((SELECT prosrc FROM pg_proc WHERE oid = f),
                                        '"' || replace(home, '"', '""') || '".') > 0
                            THEN 'pg_catalog, pg_temp'
                            ELSE quote_ident(home) || ', pg_temp' END);
    END LOOP;
END
$do$;
REVOKE EXECUTE ON FUNCTION {partition_fn}(boolean), {settle_fn}(),
                           {retire_fn}(timestamptz, boolean) FROM PUBLIC;

-- A relay whose upkeep fails (a role not granted it, say) says so in its report, so that
-- `doctor` names the cause at once, where the cut overdue it leads to shows only after
-- two intervals: the error's text, without the server's DETAIL, until an upkeep works.
ALTER TABLE {relays} ADD COLUMN upkeep_error text;

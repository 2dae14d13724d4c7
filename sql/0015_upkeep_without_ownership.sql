-- Partition upkeep for roles that do not own the table. Making, attaching and dropping a
-- partition takes the owner's rights, and a partition the upkeep makes belongs to the
-- owner, so a relay running as a role of its own could neither keep the partitions nor
-- read them to settle them: its upkeep failed, logged once, and the open partition stayed
-- open. The three upkeep functions now run with the rights of the role that migrated (the
-- owner), as a maintenance job would, and only for roles granted EXECUTE on them: the
-- owner may run them as before, anyone else must be given them (a retire called with
-- `now()` drops every partition whose rows are all sent).
--
-- Their bodies name the table and its companions without a schema when the outbox was
-- built without one; they now resolve them in the table's schema, whatever the caller's
-- search_path, and never in a schema the caller could write to first.
DO $do$
DECLARE
    home text := (SELECT quote_ident(n.nspname)
                  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = '{table}'::regclass);
BEGIN
    EXECUTE format('ALTER FUNCTION {partition_fn}(boolean)
                      SECURITY DEFINER SET search_path = %s, pg_temp', home);
    EXECUTE format('ALTER FUNCTION {settle_fn}()
                      SECURITY DEFINER SET search_path = %s, pg_temp', home);
    EXECUTE format('ALTER FUNCTION {retire_fn}(timestamptz, boolean)
                      SECURITY DEFINER SET search_path = %s, pg_temp', home);
END
$do$;
REVOKE EXECUTE ON FUNCTION {partition_fn}(boolean), {settle_fn}(),
                           {retire_fn}(timestamptz, boolean) FROM PUBLIC;

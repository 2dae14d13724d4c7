DO $do$
DECLARE
    home name := (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = '{table}'::regclass);
    f regprocedure := '{function}'::regprocedure;
BEGIN
    EXECUTE format('ALTER FUNCTION %s SET search_path = %s', f,
                   CASE WHEN strpos((SELECT prosrc FROM pg_proc WHERE oid = f),
                                    '"' || replace(home, '"', '""') || '".') > 0
                        THEN 'pg_catalog, pg_temp'
                        ELSE quote_ident(home) || ', pg_temp' END);
END
$do$;

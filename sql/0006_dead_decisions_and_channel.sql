-- A consumer's decision to give up on a message, and the NOTIFY channel where relays can
-- read it.
--
-- A consumer decides a message is dead (a permanent error, or its last failure) before it
-- stores the dead letter. If the dead-letter queue refuses that, or the channel is lost in
-- between, the message is delivered again; the decision is kept with its failure count so
-- the redelivery goes to the dead letters without running the handler again.
ALTER TABLE {failures} ADD COLUMN dead boolean NOT NULL DEFAULT false;

-- Relays used to work the channel out from the table's name as they were given it, so a
-- relay given `orders` and producers migrated as `public.orders` listened and notified on
-- different channels. `migrate` now resolves the name to its schema before rendering, and
-- relays ask this function which channel the producers notify on.
CREATE FUNCTION {channel_fn}() RETURNS text LANGUAGE sql IMMUTABLE AS $fn$
    SELECT '{channel}'::text
$fn$;

CREATE OR REPLACE FUNCTION {notify_fn}() RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    IF EXISTS (SELECT 1 FROM {waiting} WHERE seen > now() - interval '1 minute') THEN
        PERFORM pg_notify('{channel}', '');
    END IF;
END
$fn$;

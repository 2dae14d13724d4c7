-- Added after migration 7 had been applied by builds of 0.3.0 in development: in a
-- migration of its own so that those tables get it too.
--
-- A publication sequence per aggregate (`OutboxBuilder::sequence`): a producer that asks for
-- it gives each message of an aggregate its place in the aggregate's order, 1, 2, 3, ...,
-- from a counter per aggregate bumped in its own transaction, under the aggregate's lock
-- (sql/functions/locks.sql): places follow commit order, a rollback takes its places back,
-- and a purge of sent rows leaves the counters. The relay publishes the place as
-- `x-outbox-sequence`; NULL on rows of producers that do not ask, and on rows without an
-- aggregate.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS sequence bigint;
CREATE TABLE IF NOT EXISTS {sequences} (
    aggregate_key text COLLATE "C" PRIMARY KEY,
    last          bigint NOT NULL
);
-- The last place each RabbitMQ consumer processed of each aggregate, written in the
-- handler's transaction beside the dedupe record: a delivery that skips a place (a hole) or
-- comes behind the last one is reported to the handler.
CREATE TABLE IF NOT EXISTS {consumed} (
    consumer      text   NOT NULL,
    aggregate_key text   COLLATE "C" NOT NULL,
    last          bigint NOT NULL,
    PRIMARY KEY (consumer, aggregate_key)
);

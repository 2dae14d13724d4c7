-- The tables of 0.3.0, from those 0.2.0 left (migrations 1 to 6). The functions are not
-- here: each is in the file of sql/functions/ that names its job, made again whenever its
-- text changes.
--
-- Written to run over a table at any of the seventeen migrations numbered 7 to 23 that
-- builds between 0.2.0 and 0.3.0 applied (never released; `migrate` forgets their rows and
-- runs this one): each change is made only where it is missing, and they are cumulative.
--
-- It locks the table against writes while it builds two indexes, and waits for producers'
-- open transactions (up to 5 s, then `migrate` fails with 55P03: run it again). A relay of
-- 0.2.0 has no index for its claim from here on: stop those first.

-- Heads known at enqueue. Most ordered traffic gives every entity its own aggregate, so
-- nearly every pending row is its aggregate's head; yet the claim found each one by a skip
-- scan of the aggregate index, and workers scanning side by side all passed the same heads
-- in flight: a third of a claim's time went to claims that found nothing (measured: 153 of
-- 355 claims on a 20,000 row backlog). An enqueue marks its row the head when it holds its
-- aggregate's lock and sees no pending or parked row of the aggregate (sql/functions/
-- enqueue.sql), and heads wait in {ready_idx} beside the rows without an aggregate: one
-- index of the rows a claim can take as they are. The rows of aggregates wait in
-- {ordered_idx}, by flag first: the claim's skip scan reads the unmarked ones in aggregate
-- order, a probe of the marked ones tells whether one is still ahead of them. Rows written
-- before, or by a producer of 0.2.0 (whose copy path does not set the flag), are unmarked.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS head boolean NOT NULL DEFAULT false;
CREATE INDEX IF NOT EXISTS {ready_idx} ON {table} (available_at, id)
    WHERE status = 'pending' AND (head OR aggregate_key IS NULL);
CREATE INDEX IF NOT EXISTS {ordered_idx} ON {table} (head, aggregate_key, id)
    WHERE status IN ('pending', 'parked') AND aggregate_key IS NOT NULL;
DROP INDEX IF EXISTS {agg_idx_qualified};
DROP INDEX IF EXISTS {unordered_idx_qualified};

-- Claims counted apart from attempts. A claim used to count as an attempt, so a claim that
-- never got an outcome recorded (a relay crashed, or could not write the outcome before its
-- lease ran out) cost the message an attempt. `attempts` counts the verdicts on a message
-- (a publisher's or a handler's), and `claims` the claims in a row that ended without any
-- outcome: only a crash loop makes it grow, and the claim ends a message whose claims pass
-- the relay's `max_claims` as a dead letter with its own reason.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS claims integer NOT NULL DEFAULT 0;

-- Rows written without CHECK constraints. PostgreSQL compiles a table's CHECK constraints
-- from the catalog's text again for every statement that writes a row: about 10 us of
-- server time for each single enqueue with four producers, and every claim and outcome
-- compiled them too. Neither could fail on what the crate writes (an attempt budget is
-- refused outside 1..=i32::MAX before any SQL is sent, and every status is a literal of
-- the crate's own statements). So the status and attempt-budget checks go, from the table
-- and from each partition (which holds copies of its own, made by LIKE), and so does the id
-- range a partition made before 0.3.0 was given: once attached, its bounds say the same.
-- A check of the application's stays.
DO $do$
DECLARE
    rel regclass;
    con name;
BEGIN
    -- The table first: a partition's copy of a constraint the table still has cannot go.
    FOR rel IN SELECT '{table}'::regclass
               UNION ALL
               SELECT * FROM (SELECT inhrelid::regclass FROM pg_inherits
                              WHERE inhparent = '{table}'::regclass ORDER BY inhrelid) AS parts
    LOOP
        FOR con IN SELECT conname FROM pg_constraint
                   WHERE conrelid = rel AND contype = 'c'
                     AND ((conname = 'ids' AND rel <> '{table}'::regclass)
                          OR pg_get_constraintdef(oid) IN (
                              'CHECK ((max_attempts >= 1))',
                              'CHECK ((status = ANY (ARRAY[''pending''::text, ''sent''::text, '
                              || '''dead''::text, ''parked''::text]))) NOT VALID',
                              'CHECK ((status = ANY (ARRAY[''pending''::text, ''sent''::text, '
                              || '''dead''::text, ''parked''::text])))'))
        LOOP
            EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', rel, con);
        END LOOP;
    END LOOP;
END
$do$;

-- Relays say how they are: each keeps a row here, written every few seconds on a
-- connection it already holds (which process, when last seen, whether its publishers reach
-- their destination and since when not, how many rows it published, when it last claimed,
-- its poll interval, and why its upkeep of the partitions failed), so `health`, `doctor`
-- and `serve` can tell. A relay deletes its row when it shuts down; the row of one that
-- died stays, with its last sighting, until a relay forgets rows unseen for a day.
CREATE TABLE IF NOT EXISTS {relays} (
    relay         text        PRIMARY KEY,
    client_addr   text,
    pid           integer     NOT NULL,
    started_at    timestamptz NOT NULL,
    seen_at       timestamptz NOT NULL DEFAULT now(),
    publisher     text        NOT NULL CHECK (publisher IN ('unknown', 'up', 'down')),
    down_since    timestamptz,
    published     bigint      NOT NULL DEFAULT 0,
    upkeep_error  text,
    claimed_at    timestamptz,
    poll_interval interval
);
ALTER TABLE {relays} ADD COLUMN IF NOT EXISTS upkeep_error text,
                     ADD COLUMN IF NOT EXISTS claimed_at timestamptz,
                     ADD COLUMN IF NOT EXISTS poll_interval interval;

-- The sent count by partition as well as by slot, so that dropping a partition takes its
-- rows off the count without counting them. On a plain table every row is in partition 0.
ALTER TABLE {counts} ADD COLUMN IF NOT EXISTS part bigint NOT NULL DEFAULT 0;
DO $do$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = '{counts}'::regclass AND contype = 'p'
                     AND cardinality(conkey) = 2) THEN
        EXECUTE format('ALTER TABLE {counts} DROP CONSTRAINT %I',
                       (SELECT conname FROM pg_constraint
                        WHERE conrelid = '{counts}'::regclass AND contype = 'p'));
        ALTER TABLE {counts} ADD PRIMARY KEY (part, slot);
    END IF;
END
$do$;

-- One row per partition of a partitioned outbox (sql/partitioned.sql; on a plain one it
-- stays empty): partition n holds ids [n * 2^40, (n + 1) * 2^40). `every` is how long it
-- stays open once ids start to fall in it (`opened_at`); `closed_at`, when the sequence
-- moved past it; `made_at`, when the transaction that made its table began. `settled_at`,
-- `quiet_at` and `cut_vxids`: see {settle_fn}; `dead`, the dead letters of a quiet
-- partition not settled, as the upkeep counted them and purges took them off since (0 once
-- settled; -1 while too many to count; NULL while not quiet, or not counted yet, which the
-- upkeep then does).
CREATE TABLE IF NOT EXISTS {partitions} (
    n          bigint      PRIMARY KEY CHECK (n >= 0),
    every      interval    NOT NULL CHECK (every > interval '0'),
    ahead      integer     NOT NULL CHECK (ahead >= 1),
    made_at    timestamptz NOT NULL DEFAULT now(),
    opened_at  timestamptz,
    closed_at  timestamptz,
    settled_at timestamptz,
    cut_vxids  text[],
    quiet_at   timestamptz,
    dead       bigint
);
-- The upkeep's lock first, before any lock on the bookkeeping (a retire takes them in that
-- order), for a table partitioned before 0.3.0 whose bookkeeping is brought up to date.
SELECT pg_advisory_xact_lock({partition_lock});
ALTER TABLE {partitions} ADD COLUMN IF NOT EXISTS settled_at timestamptz,
                         ADD COLUMN IF NOT EXISTS cut_vxids text[],
                         ADD COLUMN IF NOT EXISTS quiet_at timestamptz,
                         ADD COLUMN IF NOT EXISTS dead bigint;
UPDATE {partitions} SET quiet_at = settled_at WHERE settled_at IS NOT NULL AND quiet_at IS NULL;
UPDATE {partitions} SET dead = 0 WHERE settled_at IS NOT NULL AND dead IS NULL;

-- A failure counted once however often its reply is lost, and a dead letter known to be
-- stored.
--
-- A consumer counts a handler's failure in a statement of its own after the rollback. When
-- the reply to it is lost (the connection dies, the server stops answering) the count may
-- or may not have been made, and counting again must not charge the one failure twice: each
-- count names the handling it is for (`attempt`), and a count for the same handling answers
-- with the count it made.
--
-- A consumer acks a message it gives up on only once its dead letter is stored (confirmed by
-- the broker); if that ack is lost, the broker delivers the message again. `buried` says the
-- dead letter is stored, so the redelivery is acked without a second dead letter. The row
-- stays until the message is handled again (a redriven copy: its success deletes the row,
-- its failure starts a count afresh) or until `Purge::Inbox` ages it out.
ALTER TABLE {failures}
    ADD COLUMN IF NOT EXISTS attempt uuid,
    ADD COLUMN IF NOT EXISTS buried boolean NOT NULL DEFAULT false;

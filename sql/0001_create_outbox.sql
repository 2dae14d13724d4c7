-- The outbox, its inbox and its counters.
--
-- One column, available_at, says when a pending row may next be claimed: after an enqueue delay,
-- after a retry's backoff, or after a claim's lease runs out. So the claim is one range scan of
-- {due_idx}, ordered exactly as the index is, and never walks sent rows.
CREATE TABLE {table} (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key           text        NOT NULL,
    topic         text        NOT NULL,
    aggregate_key text,
    payload       bytea       NOT NULL,
    content_type  text,
    headers       text[]      NOT NULL DEFAULT '{}',
    status        text        NOT NULL DEFAULT 'pending'
                              CHECK (status IN ('pending', 'sent', 'dead')),
    attempts      integer     NOT NULL DEFAULT 0,
    max_attempts  integer     CHECK (max_attempts >= 1),
    available_at  timestamptz NOT NULL DEFAULT now(),
    lease_until   timestamptz,
    last_error    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    done_at       timestamptz,
    CONSTRAINT {key_constraint} UNIQUE (key)
)
-- Every row is updated twice (claim, outcome), so the due index fills with entries for dead
-- row versions until vacuum; with the default 20% threshold a busy outbox waits long for it,
-- and claims and stats wade through them meanwhile. Vacuum after 1% instead.
WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
      autovacuum_analyze_scale_factor = 0.02);

-- The claim: pending rows in the order they become due.
CREATE INDEX {due_idx} ON {table} (available_at, id) WHERE status = 'pending';

-- The claim's "oldest pending row of its aggregate" test; rows without an aggregate cost nothing.
CREATE INDEX {agg_idx} ON {table} (aggregate_key, id)
    WHERE status = 'pending' AND aggregate_key IS NOT NULL;

-- Purge, dead-letter listing and the dead count; pending rows (the producer's inserts) skip it.
CREATE INDEX {done_idx} ON {table} (status, done_at) WHERE status <> 'pending';

-- Consumer-side deduplication: one row per (consumer, message key) processed.
CREATE TABLE {inbox} (
    consumer     text        NOT NULL,
    key          text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, key)
);

-- Sent rows are counted here rather than counted by scanning them. Writers add to one of
-- sixteen slots at random so concurrent relays rarely wait on each other.
CREATE TABLE {counts} (
    slot smallint PRIMARY KEY,
    sent bigint   NOT NULL DEFAULT 0
);
INSERT INTO {counts} (slot) SELECT generate_series(0, 15);

//! The relay's statements, rendered once per table, and the settings of its sessions.

use std::time::Duration;

use crate::schema::render::{render, RenderError, Values};
use crate::schema::statements::{
    borrowed, checked, shared, Statements, PARKS, READY_ROWS, RECORD_TEMPLATE,
};
use crate::schema::table::{quote, TableName};

/// The relay's statements: the claim, the outcomes, its waiting and reports, and the
/// upkeep of a partitioned table.
#[derive(Debug)]
pub(crate) struct RelaySql {
    /// The claim, its aggregate scan starting at the first aggregate key.
    pub(crate) claim: String,
    /// The claim, its aggregate scan starting after the key in `$4`.
    pub(crate) claim_after: String,
    /// The claim of the ready rows alone, after a producer's notification.
    pub(crate) claim_ready: String,
    /// The payloads a claim's reply left out: of the rows `$1`, the `$3` bytes from byte
    /// `$2` on (1 for the first).
    pub(crate) payload_slices: String,
    pub(crate) record_outcomes: String,
    /// Marks relay $1 as waiting for work (and forgets relays long gone).
    pub(crate) register_waiting: String,
    pub(crate) unregister_waiting: String,
    /// A relay's report of itself (and forgets reports unseen for a day).
    pub(crate) report_relay: String,
    pub(crate) forget_relay: String,
    /// Keeps a partitioned outbox's partitions and settles the closed ones
    /// (`sql/functions/partitions.sql`; NULL on a plain one).
    pub(crate) maintain_partitions: String,
    pub(crate) probe: String,
}

impl Statements for RelaySql {
    fn render(table: &TableName) -> Result<Self, RenderError> {
        let t = table.quoted();
        let vars = shared(
            table,
            &[
                "table",
                "waiting",
                "counts",
                "relays",
                "partition_fn",
                "settle_fn",
                "parks",
                "id_bits",
            ],
        )?;
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = RelaySql {
            claim: claim(&t, "")?,
            claim_after: claim(&t, "AND b.aggregate_key > $4")?,
            claim_ready: claim_ready(&t)?,
            // A payload never changes: no fence is needed to read it.
            payload_slices: values.render(
                "SELECT id, substring(payload FROM $2 FOR $3) FROM {table} WHERE id = ANY ($1)"
            )?,
            // Every outcome of a batch in one statement, each row fenced on id + the attempts
            // it had when claimed + still pending + the lease its claim stamped, so a relay
            // whose lease was lost and whose row was claimed since changes nothing, however
            // late it writes. A verdict (sent, retry, dead) counts an attempt; a hand-back
            // does not. Any outcome ends the row's run of claims without one.
            // $1 ids, $2 attempts at the claim, $3 outcome ('sent' | 'retry' | 'dead' | 'release'),
            // $4 retry delay in microseconds, $5 error text, $6 counter slot, $7 lease stamps,
            // $8 whether a dead row parks its aggregate, unless the row says.
            record_outcomes: values.render(
                "WITH o AS (
                   SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::bigint[],
                                        $5::text[], $7::timestamptz[])
                     AS o(id, attempts, outcome, delay_us, error, lease)),
                 upd AS (
                   UPDATE {table} t SET
                     status = CASE o.outcome WHEN 'sent' THEN 'sent'
                                             WHEN 'dead' THEN CASE WHEN {parks} THEN 'parked'
                                                                   ELSE 'dead' END
                                             ELSE 'pending' END,
                     attempts = CASE o.outcome WHEN 'release' THEN t.attempts
                                               ELSE t.attempts + 1 END,
                     claims = 0,
                     available_at = CASE o.outcome
                                      WHEN 'retry' THEN now() + o.delay_us * interval '1 microsecond'
                                      WHEN 'release' THEN now()
                                      ELSE t.available_at END,
                     lease_until = NULL,
                     done_at = CASE WHEN o.outcome IN ('sent', 'dead') THEN now() END,
                     last_error = COALESCE(o.error, t.last_error)
                   FROM o
                   WHERE t.id = o.id AND t.attempts = o.attempts AND t.status = 'pending'
                     AND t.lease_until = o.lease
                   RETURNING t.status, t.id),
                 -- Counted by partition (migration 7; all are partition 0 on a plain
                 -- table), so a partition dropped is taken off the count without a count.
                 c AS (SELECT id >> {id_bits} AS part, count(*) AS n,
                              count(*) FILTER (WHERE status = 'sent') AS sent
                       FROM upd GROUP BY 1),
                 bump AS (UPDATE {counts} k SET sent = k.sent + c.sent FROM c
                          WHERE k.part = c.part AND k.slot = $6 AND c.sent > 0)
                 SELECT coalesce(sum(n), 0)::bigint, coalesce(sum(sent), 0)::bigint FROM c"
            )?,
            register_waiting: values.render(
                "WITH expired AS (DELETE FROM {waiting} WHERE seen < now() - interval '1 hour')
                 INSERT INTO {waiting} (relay) VALUES ($1)
                 ON CONFLICT (relay) DO UPDATE SET seen = now()"
            )?,
            unregister_waiting: values.render("DELETE FROM {waiting} WHERE relay = $1")?,
            report_relay: values.render(
                "WITH gone AS (DELETE FROM {relays} WHERE seen_at < now() - interval '1 day')
                 INSERT INTO {relays}
                   (relay, client_addr, pid, started_at, publisher, down_since, published,
                    upkeep_error, claimed_at, poll_interval)
                 VALUES ($1, host(inet_client_addr()), $2, $3, $4, $5, $6, $7,
                         now() - $8::bigint * interval '1 microsecond',
                         $9::bigint * interval '1 microsecond')
                 ON CONFLICT (relay) DO UPDATE SET
                   seen_at = now(), publisher = excluded.publisher,
                   down_since = excluded.down_since, published = excluded.published,
                   upkeep_error = excluded.upkeep_error, claimed_at = excluded.claimed_at,
                   poll_interval = excluded.poll_interval"
            )?,
            forget_relay: values.render("DELETE FROM {relays} WHERE relay = $1")?,
            maintain_partitions: values.render("SELECT {partition_fn}(false), {settle_fn}()")?,
            probe: values.render("SELECT 1 FROM {table} LIMIT 0")?,
        };
        values.finish()?;
        Ok(statements)
    }
}

/// The claim: one statement that leases up to `$1` rows and `$3` payload bytes.
///
/// Rows a claim can take as they are (rows without an aggregate key, and heads marked at
/// enqueue, see migration 0007) come from the ready index, oldest due first, locked as they
/// are read under `FOR UPDATE SKIP LOCKED`: workers side by side take different rows, and
/// each row costs what an unordered one does. The other rows with an aggregate key wait
/// behind a head, or were not marked as one: a skip scan of the unmarked part of the ordered
/// index visits the first of each aggregate, starting after the caller's cursor, until it has
/// seen `2 x $1` due ones or `$5` in all; one is due when its time has come and no marked
/// head of its aggregate is still pending or parked (a probe of the marked part: only a
/// marked head can be ahead of an aggregate's first unmarked row). A lease pushes
/// `available_at` forward, so a leased head is not due and its aggregate is passed over; a
/// parked head is never due, nor is anything behind it. So the cost is what the claim
/// returns plus the heads it passes, never the rows waiting behind a head.
///
/// Behind every due head, marked or found, the claim reads a run of consecutive due rows:
/// it ends at the first row of the aggregate still pending or parked that is not due, so
/// a parked message in the middle holds back everything behind it. With a batch's worth
/// of heads or more, each gives one row (runs of one: the most aggregates, each in the
/// first confirm round). With fewer, they are shared among the `$6`
/// workers: runs are as long as fills the batch from a worker's share of all the heads seen
/// (due or in flight), so each claim takes about that share. A scan late in the key space
/// sees only the aggregates after its cursor, so the caller may pass in `$9` the most an
/// earlier claim of its lap saw, and runs are sized by that when it is more; the statement
/// returns what it saw with every row (and the one row of an empty claim). Ready rows and
/// found heads take turns, and found heads get at least half the batch when there are that
/// many, so neither kind starves the other.
///
/// Workers scanning the same aggregates see the same found heads, so twice the batch is read
/// as candidates and locked in order with `SKIP LOCKED` until the batch is full: a head
/// another claim holds costs a skipped row, not an empty claim.
///
/// A run is read from the statement's snapshot, so a concurrent claim may have taken (and
/// a concurrent outcome finished) part of it meanwhile. Every run row is therefore locked and
/// rechecked, and an aggregate keeps only the unbroken prefix of its run that starts at its
/// head: a run missing its head, or any row before another, is cut there; so is a run that
/// does not fit the batch or the byte budget. A row is locked only in the version the
/// snapshot read (its `ctid`): one changed since by a transaction that committed meanwhile,
/// which may have put a redriven message ahead of it (see [`redrive_hold`]), is passed over
/// rather than rechecked. That keeps the order strict whatever runs alongside.
///
/// A claim leases a row and counts one more claim without an outcome (`claims`, which any
/// outcome sets back to 0; `attempts` counts only verdicts, see migration 7). A row whose
/// claims would pass `$7` (`max_claims`) has been in hand that often, in a row, when a relay
/// crashed or lost its connection: a crash loop, maybe its own doing. It becomes dead (or
/// parked, see `PARKS`, with the caller's setting in `$8`) here instead of being published
/// again. Every row (and the one
/// row of an empty claim) carries where the next claim's scan should start: after the last
/// aggregate this claim took from the scan, else after the last one it visited, or at the
/// first (NULL) once the scan has passed the last aggregate.
fn claim(t: &str, after: &str) -> Result<String, RenderError> {
    // The rows of the skip scan: those of an aggregate that were not marked as its head.
    let behind = "b.status IN ('pending', 'parked') AND b.aggregate_key IS NOT NULL AND NOT b.head";
    // A row found by the scan is due when it is pending, its time has come and no marked
    // head of its aggregate is before it. (The marked part holds a head per aggregate at
    // most, and none of the rows sent behind it: the probe reads next to nothing.)
    let b_due = render(
        "b.status = 'pending' AND b.available_at <= now()
         AND NOT EXISTS (SELECT 1 FROM {table} p
                         WHERE p.head AND p.aggregate_key = b.aggregate_key AND p.id < b.id
                           AND p.status IN ('pending', 'parked'))",
        &[("table", t)],
    )?;
    render(
        "WITH RECURSIVE behind(aggregate_key, id, due, n, d, version) AS (
           (SELECT f.aggregate_key, f.id, f.due, 1, f.due::int, f.version FROM (
              SELECT b.aggregate_key, b.id, {b_due} AS due, b.ctid AS version FROM {table} b
              WHERE {behind} {after}
              ORDER BY b.aggregate_key, b.id LIMIT 1) f)
           UNION ALL
           SELECT nx.aggregate_key, nx.id, nx.due, h.n + 1, h.d + nx.due::int, nx.version
           FROM behind h CROSS JOIN LATERAL (
             SELECT b.aggregate_key, b.id, {b_due} AS due, b.ctid AS version FROM {table} b
             WHERE {behind} AND b.aggregate_key > h.aggregate_key
             ORDER BY b.aggregate_key, b.id LIMIT 1) nx
           WHERE h.n < $5 AND h.d < 2 * $1),
         -- A batch of one goes to either kind at random.
         ready AS (
           SELECT o.id, o.aggregate_key, o.available_at, {bytes} AS bytes FROM {table} o
           WHERE {ready_rows}
           ORDER BY o.available_at, o.id
           LIMIT $1 - least((SELECT count(*) FROM behind WHERE due),
                            CASE WHEN $1 > 1 THEN $1 / 2 ELSE (random() < 0.5)::int END)
           FOR UPDATE SKIP LOCKED),
         -- Ready rows take the odd places, found heads the even ones.
         placed AS (
           SELECT id, aggregate_key, bytes,
                  2 * row_number() OVER (ORDER BY available_at, id) - 1 AS hpos
           FROM ready),
         heads AS (
           SELECT aggregate_key, id, due, 2 * n AS hpos, true AS scanned, false AS held, version
           FROM behind
           UNION ALL
           SELECT aggregate_key, id, true, hpos, false, true, NULL::tid
           FROM placed WHERE aggregate_key IS NOT NULL),
         -- Sized by every aggregate seen, due or in flight, so that a claim finding only a
         -- few free heads while other workers hold the rest takes short runs of them, not
         -- one long run: every confirm round stays wide. (The scan may pass the row behind
         -- a ready head: one aggregate. A batch of ready heads needs no counting.)
         seen AS (
           SELECT CASE WHEN (SELECT count(*) FROM placed
                             WHERE aggregate_key IS NOT NULL) >= $1 THEN $1
                       ELSE (SELECT count(DISTINCT aggregate_key) FROM heads)
                  END AS n),
         run_len AS (
           SELECT CASE WHEN n >= $1 THEN 1
                       ELSE greatest(1, ceil($1::numeric / greatest(1, ceil(n::numeric / $6))))
                  END::bigint AS r
           FROM (SELECT greatest($9, (SELECT n FROM seen)) AS n) a),
         -- Materialized: a row locked below that a concurrent claim changed is rechecked
         -- against the candidates, and inlined they would be read again for every such
         -- row (measured: 200 ms and 118,000 buffers for one claim of 40 aggregates).
         ocand AS MATERIALIZED (
           -- Runs of one are the due heads themselves: no need to read behind them.
           (SELECT h.id, h.aggregate_key, h.hpos, 1::bigint AS rn, h.scanned, false AS held,
                   h.version
            FROM heads h
            WHERE h.due AND NOT h.held AND (SELECT r FROM run_len) = 1
            ORDER BY h.hpos LIMIT 2 * $1)
           UNION ALL
           -- Behind a marked head (locked already) its run goes on with the unmarked rows
           -- after it; a found head starts its run. The run ends at the first row that is
           -- not due: a parked one holds back everything behind it.
           (SELECT r.id, h.aggregate_key, h.hpos, r.rn, h.scanned, h.held, r.version
            FROM heads h CROSS JOIN LATERAL (
              SELECT s.id, s.rn, s.version FROM (
                SELECT o.id, o.version, row_number() OVER w + h.held::int AS rn,
                       bool_and(o.status = 'pending' AND o.available_at <= now()) OVER w AS due
                FROM (SELECT o.id, o.ctid AS version, o.status, o.available_at FROM {table} o
                      WHERE NOT o.head AND o.status IN ('pending', 'parked')
                        AND o.aggregate_key = h.aggregate_key AND o.id >= h.id
                      ORDER BY o.id LIMIT (SELECT r FROM run_len) - h.held::int) o
                WINDOW w AS (ORDER BY o.id)) s
              WHERE s.due) r
            WHERE h.due AND (SELECT r FROM run_len) > 1
            ORDER BY h.hpos, r.rn
            LIMIT 2 * $1)),
         olock AS (
           SELECT o.id, c.aggregate_key, c.hpos, c.rn, c.scanned, c.held, {bytes} AS bytes
           FROM ocand c JOIN {table} o ON o.id = c.id
           -- The version read: a row changed since the statement's snapshot (a redrive
           -- put a message ahead of it, see redrive_hold) is left for the next claim.
           WHERE o.ctid = c.version AND o.status = 'pending' AND o.available_at <= now()
           ORDER BY c.hpos, c.rn
           LIMIT $1 - (SELECT count(*) FROM ready)
           FOR UPDATE OF o SKIP LOCKED),
         -- A run behind a ready head starts at 2: the head is the ready row.
         ovalid AS (
           SELECT id, aggregate_key, hpos, rn, scanned, bytes, held,
                  row_number() OVER (PARTITION BY aggregate_key ORDER BY rn) AS pos
           FROM olock),
         picked AS (
           SELECT id, aggregate_key, scanned, bytes, hpos, rn FROM ovalid
           WHERE pos + held::int = rn
           UNION ALL
           SELECT id, aggregate_key, false, bytes, hpos, 1 FROM placed),
         take AS (
           SELECT id, aggregate_key, scanned, rank FROM (
             SELECT id, aggregate_key, scanned, row_number() OVER k AS rank,
                    sum(coalesce(bytes, 0)) OVER k AS total
             FROM picked WINDOW k AS (ORDER BY hpos, rn, id)) p
           WHERE rank <= $1 AND (rank = 1 OR total <= $3)),
         upd AS ({lease_taken}),
         scan AS (
           SELECT coalesce(
             (SELECT aggregate_key FROM take WHERE scanned ORDER BY rank DESC LIMIT 1),
             CASE WHEN (SELECT count(*) FROM behind) >= $5
                       OR (SELECT count(*) FROM behind WHERE due) >= 2 * $1
                  THEN (SELECT aggregate_key FROM behind ORDER BY n DESC LIMIT 1) END)
             AS next_cursor),
         reply AS ({reply})
         SELECT reply.*, scan.next_cursor, (SELECT n FROM seen) AS seen
         FROM scan LEFT JOIN reply ON true",
        &[
            ("table", t),
            ("after", after),
            ("behind", behind),
            ("b_due", &b_due),
            ("bytes", CLAIMED_BYTES),
            ("ready_rows", READY_ROWS),
            ("lease_taken", &lease_taken(t)?),
            ("reply", CLAIM_REPLY),
        ],
    )
}

/// What a claimed row `o` weighs against a claim's byte budget: its payload and headers.
const CLAIMED_BYTES: &str = "octet_length(o.payload) + pg_column_size(o.headers)";

/// The lease a claim takes on the rows of its `take`, in the statement's parameters `$2`
/// (lease), `$7` (`max_claims`) and `$8` (parks): one more claim without an outcome, or the
/// end of a crash loop (see [`claim`]).
fn lease_taken(t: &str) -> Result<String, RenderError> {
    let over = "t.claims + 1 > $7";
    render(
        "UPDATE {table} t SET
  claims = t.claims + 1,
  status = CASE WHEN NOT {over} THEN 'pending'
                WHEN {parks} THEN 'parked' ELSE 'dead' END,
  available_at = CASE WHEN {over} THEN t.available_at
                      ELSE now() + $2::bigint * interval '1 microsecond' END,
  lease_until = CASE WHEN {over} THEN NULL
                     ELSE now() + $2::bigint * interval '1 microsecond' END,
  done_at = CASE WHEN {over} THEN now() END,
  last_error = CASE WHEN {over}
                 THEN 'claimed ' || t.claims + 1 || ' times in a row without an '
                      || 'outcome (a relay crashed, or lost its connection, with '
                      || 'the message in hand each time): more than max_claims ('
                      || $7 || ') allows'
                 ELSE t.last_error END
-- An id list, not a join: a join may be planned as a merge along the primary key
-- from its first id, through every sent row.
WHERE t.id = ANY (ARRAY(SELECT id FROM take))
RETURNING {claimed_columns}, t.status, t.claims",
        &[
            ("table", t),
            ("over", over),
            ("parks", PARKS),
            ("claimed_columns", &claimed_columns()?),
        ],
    )
}

/// A record as a claim hands it over: its attempt is the one this claim starts (`attempts`
/// counts the verdicts so far, see migration 7).
fn claimed_columns() -> Result<String, RenderError> {
    render(RECORD_TEMPLATE, &[("attempt", "t.attempts + 1 AS attempt")])
}

/// The rows a claim leased or finished (`upd`), as the statement returns them: each
/// payload while the payloads so far, in id order, come to `$10` bytes at most, and none
/// after that but those of rows that died at the claim (rare, and told to metrics whole) (a claim's reply must arrive within the caller's deadline whatever the link;
/// the caller reads the rest, `payload_slices`, in statements of their own). The last
/// column holds the length of a payload left out.
const CLAIM_REPLY: &str = "SELECT r.id, r.key, r.topic, r.aggregate_key,
       CASE WHEN r.inline THEN r.payload END AS payload, r.content_type, r.headers,
       r.attempt, r.max_attempts, r.created_at, r.lease_until, r.park, r.sequence, r.status,
       r.claims,
       CASE WHEN NOT r.inline THEN octet_length(r.payload) END AS deferred
     FROM (SELECT u.*, u.status <> 'pending'
                       OR sum(octet_length(u.payload)) OVER (ORDER BY u.id) <= $10 AS inline
           FROM upd u) r";

/// The claim of a worker woken by a producer's notification: the ready rows alone (rows
/// without an aggregate key and heads marked at enqueue, see [`claim`]), oldest due first,
/// as many as `$1` rows and `$3` bytes allow, under the same lease, with the same columns
/// and parameters (`$4`, `$5`, `$6` and `$9` unused) and no cursor. A commit that notified
/// made its rows ready, unless an earlier row of their aggregate is still pending (those
/// wait for that row's outcome, which wakes the full claim) or the commit wrote several rows
/// of one aggregate: then rows wait behind a ready head, and this claim takes nothing, so
/// that the full claim takes each head with its run. So it reads an index range a few rows
/// long and probes the aggregates it found, where the full claim scans the aggregates for
/// heads. A worker falls back to the full claim when this one takes nothing, and claims
/// fully after it, so nothing waits longer for it.
fn claim_ready(t: &str) -> Result<String, RenderError> {
    render(
        "WITH ready AS (
           SELECT o.id, o.aggregate_key, o.available_at, {bytes} AS bytes FROM {table} o
           WHERE {ready_rows}
           ORDER BY o.available_at, o.id
           LIMIT $1
           FOR UPDATE SKIP LOCKED),
         runs AS (
           SELECT EXISTS (SELECT 1 FROM ready r JOIN {table} b
                            ON NOT b.head AND b.aggregate_key = r.aggregate_key
                               AND b.id > r.id AND b.status IN ('pending', 'parked'))
             AS found),
         take AS (
           SELECT id FROM (
             SELECT id, row_number() OVER k AS rank, sum(coalesce(bytes, 0)) OVER k AS total
             FROM ready WINDOW k AS (ORDER BY available_at, id)) p
           WHERE (rank = 1 OR total <= $3) AND NOT (SELECT found FROM runs)),
         upd AS ({lease_taken}),
         reply AS ({reply})
         SELECT reply.*, NULL::text AS next_cursor, 0::bigint AS seen FROM reply",
        &[
            ("table", t),
            ("bytes", CLAIMED_BYTES),
            ("ready_rows", READY_ROWS),
            ("lease_taken", &lease_taken(t)?),
            ("reply", CLAIM_REPLY),
        ],
    )
}

/// Session settings of a relay worker's connection (see `relay/worker.rs` for why each).
/// The table name is a validated identifier: nothing in it can end the literal.
pub(crate) fn relay_session(table: &TableName, statement_timeout: Duration) -> String {
    checked(render(
        "SET application_name = 'outbox relay {table}'; \
         SET statement_timeout = {ms}; \
         SET idle_in_transaction_session_timeout = {ms}; \
         SET jit = off; \
         SET synchronous_commit = off; \
         SET default_transaction_isolation = 'read committed'",
        &[
            ("table", table.as_str()),
            ("ms", &statement_timeout.as_millis().to_string()),
        ],
    ))
}

/// Undoes [`relay_session`] before a pooled connection goes back.
pub(crate) const RELAY_SESSION_RESET: &str = "RESET application_name; RESET statement_timeout; \
     RESET idle_in_transaction_session_timeout; RESET jit; RESET plan_cache_mode; \
     RESET enable_seqscan; RESET synchronous_commit; RESET default_transaction_isolation";

/// A relay session's plans on a partitioned table: planned once per connection. Planned for each
/// claim's values (which PostgreSQL keeps choosing, as their estimates look cheaper), every
/// statement plans every partition: half the relay's rate with a dozen partitions (`cargo bench
/// --bench outbox scale`, BENCHMARKS.md "At scale"). And no sequential scan where an index serves:
/// a plan made while a partition ahead was empty would read it whole once it is the open one, until
/// the next analyze. A plain table keeps the server's choices.
pub(crate) const PARTITIONED_PLANS: &str =
    "SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off";

/// Session settings of a relay's listener connection.
pub(crate) const LISTENER_SESSION: &str = "SET application_name = 'postgres-outbox listener'";

/// Undoes [`LISTENER_SESSION`] and the LISTEN before a pooled connection goes back.
pub(crate) const LISTENER_SESSION_RESET: &str = "UNLISTEN *; RESET application_name";

/// Listens on a channel, as the migrations named it (quoted here: it may be a hash).
pub(crate) fn listen(channel: &str) -> String {
    checked(render("LISTEN {channel}", &[("channel", &quote(channel))]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::render::placeholders;
    use crate::schema::statements::tests::{renders_for_every_table, tables};

    #[test]
    fn every_template_renders_for_every_table() {
        renders_for_every_table::<RelaySql>();
    }

    #[test]
    fn session_settings_render_for_every_table() {
        for table in tables() {
            let setup = relay_session(&table, Duration::from_millis(2500));
            assert!(placeholders(&setup).is_empty(), "{setup}");
            assert!(setup.contains(&format!("'outbox relay {}'", table.as_str())));
            assert!(setup.contains("statement_timeout = 2500;"), "{setup}");
            assert!(setup.contains("idle_in_transaction_session_timeout = 2500;"));
            assert!(setup.ends_with("default_transaction_isolation = 'read committed'"));
            // Whatever a relay session sets goes before its connection goes back.
            for set in setup.split(';').chain(PARTITIONED_PLANS.split(';')) {
                let name = set.trim().trim_start_matches("SET ").split(' ').next();
                let name = name.unwrap_or_default();
                assert!(
                    RELAY_SESSION_RESET.contains(&format!("RESET {name};"))
                        || RELAY_SESSION_RESET.ends_with(&format!("RESET {name}")),
                    "{name} is set and never reset"
                );
            }
            let channel = table.channel();
            assert_eq!(listen(&channel), format!("LISTEN {}", quote(&channel)));
        }
    }
}

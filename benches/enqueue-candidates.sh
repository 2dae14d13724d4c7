#!/usr/bin/env bash
# Where a single enqueue's cost goes against a hand-written INSERT, part by part, measured
# with pgbench on the server alone (no client library):
#
#   benches/enqueue-candidates.sh            # CLIENTS="1 4 16" ROUNDS=3 SECS=4 PARTITIONED=0
#
# Every transaction is the business write (INSERT INTO orders .. RETURNING id) plus one
# outbox row of 512 bytes whose aggregate is its own (`order-<n>`). Variants, in turns:
#   raw          a hand-written outbox row (uuid key, jsonb headers, one partial index)
#   raw_locked   the same, taking the aggregate's transaction-scoped lock first in the same
#                statement: all it takes by hand to keep commit order per aggregate
#   unordered    this crate's row without an aggregate, as a `Producer` writes it (a plain
#                prepared INSERT): against raw
#   locked       this crate's row with its aggregate, marked as its head, after the locks a
#                `Producer` takes (the bucket's, shared, and the aggregate's), with no look
#                for an earlier message: what marking heads costs nothing of
#   inline_look  `locked` with that look written into the INSERT (not a design: the
#                statement's snapshot predates the lock, so after a wait it marks wrongly)
#   ordered      the `Producer`'s ordered INSERT: `locked`, marking by the head function,
#                whose look reads a snapshot taken after the lock
#   enqueue      the enqueue function with the same message, notify off (prepared here, where
#                `Outbox::enqueue` sends the call as text)
# With PARTITIONED=1 the crate's table and the hand-written one are both partitioned by id
# ranges, the open partition and two ahead, the key unique in each partition: the looks
# read those three, in one range (no partition is held back by an old message).
# Prints `bench=enqueue-candidate table=<plain|partitioned> clients=<n> variant=<v>
# tps=<median> runs=[<each round's tps>] vs_raw=<ratio> vs_locked=<ratio>`, the median
# against those of `raw` and of `raw_locked` at the same client count. Needs psql, pgbench
# and cargo; uses a scratch schema dropped at the end.
set -euo pipefail

url=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
clients=${CLIENTS:-1 4 16}
rounds=${ROUNDS:-3}
secs=${SECS:-4}
partitioned=${PARTITIONED:-0}
schema="enqueue_candidates_$$"
dir=$(mktemp -d)
cleanup() {
    psql -qX "$url" -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap cleanup EXIT

cd "$(dirname "$0")/.."
table=plain
migrate_args=()
if [ "$partitioned" = 1 ]; then
    table=partitioned
    migrate_args=(--partition-interval 1d)
fi
psql -qX -v ON_ERROR_STOP=1 "$url" -c "CREATE SCHEMA $schema"
cargo run -q --release --features cli --bin postgres-outbox -- \
    --database-url "$url" --table "$schema.ob" migrate ${migrate_args[@]+"${migrate_args[@]}"} \
    >/dev/null 2>"$dir/err" || { cat "$dir/err" >&2; exit 1; }

if [ "$partitioned" = 1 ]; then
    raw_key="key uuid NOT NULL"
    raw_by="PARTITION BY RANGE (id)"
else
    raw_key="key uuid NOT NULL UNIQUE"
    raw_by=""
fi
psql -qX -v ON_ERROR_STOP=1 "$url" <<SQL
CREATE TABLE $schema.orders (id bigserial PRIMARY KEY, customer text NOT NULL,
                             total numeric NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE $schema.raw (id bigserial PRIMARY KEY, $raw_key, topic text NOT NULL,
    aggregate_key text, payload bytea NOT NULL, headers jsonb NOT NULL DEFAULT '{}',
    status text NOT NULL DEFAULT 'pending', attempts integer NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(), lease_until timestamptz,
    created_at timestamptz NOT NULL DEFAULT now()) $raw_by;
CREATE INDEX ON $schema.raw (available_at, id) WHERE status = 'pending';
SQL
if [ "$partitioned" = 1 ]; then
    for k in 0 1 2; do
        psql -qX -v ON_ERROR_STOP=1 "$url" <<SQL
CREATE TABLE $schema.raw_p$k PARTITION OF $schema.raw
    FOR VALUES FROM ($((k << 40))) TO ($(((k + 1) << 40)));
CREATE UNIQUE INDEX ON $schema.raw_p$k (key);
SQL
    done
fi

payload="decode(repeat('ab', 512), 'hex')"
business="INSERT INTO $schema.orders (customer, total) VALUES ('c', 10) RETURNING id;"
agg="'order-' || :n"
# The locks of a `Producer`'s ordered INSERT (`LOCK_ONE` in src/schema/statements.rs); the
# keys' seeds change nothing of the cost.
locks="pg_advisory_xact_lock_shared(1 + (hashtextextended($agg, 7) & 15)), pg_advisory_xact_lock(hashtextextended($agg, 7))"
look="NOT EXISTS (SELECT 1 FROM $schema.ob o WHERE o.head IN (false, true) AND o.aggregate_key = $agg AND o.status IN ('pending', 'parked'))"
columns="key, topic, aggregate_key, payload, content_type, headers, available_at, max_attempts, park, head"
row="gen_random_uuid()::text, 'order.created', $agg, $payload, 'application/json', '{}'::text[], now(), NULL, NULL"
write() {
    printf '\\set n random(1, 1000000000)\nBEGIN;\n%s\n%s\nCOMMIT;\n' "$business" "$2" >"$dir/$1.sql"
}
write raw "INSERT INTO $schema.raw (key, topic, aggregate_key, payload, headers) VALUES (gen_random_uuid(), 'order.created', $agg, $payload, '{\"content-type\":\"application/json\"}'::jsonb);"
write raw_locked "INSERT INTO $schema.raw (key, topic, aggregate_key, payload, headers) SELECT gen_random_uuid(), 'order.created', $agg, $payload, '{\"content-type\":\"application/json\"}'::jsonb FROM (SELECT pg_advisory_xact_lock(hashtextextended($agg, 0))) AS locked;"
write unordered "INSERT INTO $schema.ob (key, topic, payload, content_type, headers, available_at, max_attempts, park) VALUES (gen_random_uuid()::text, 'order.created', $payload, 'application/json', '{}'::text[], now(), NULL, NULL);"
write locked "INSERT INTO $schema.ob ($columns) SELECT $row, true FROM (SELECT $locks OFFSET 0) AS locked;"
write inline_look "INSERT INTO $schema.ob ($columns) SELECT $row, $look FROM (SELECT $locks OFFSET 0) AS locked;"
write ordered "INSERT INTO $schema.ob ($columns) SELECT $row, $schema.ob_head($agg) FROM (SELECT $locks OFFSET 0) AS locked;"
write enqueue "SELECT $schema.ob_enqueue(gen_random_uuid()::text, 'order.created', $agg, $payload, 'application/json', '{}'::text[], NULL, 0, NULL, NULL, false, true);"
variants="raw raw_locked unordered locked inline_look ordered enqueue"

median() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
for c in $clients; do
    declare -A tps=()
    for _ in $(seq "$rounds"); do
        for v in $variants; do
            # libpq takes the URL where pgbench takes a database name.
            t=$(pgbench -n -M prepared -c "$c" -j "$((c < 4 ? c : 4))" -T "$secs" \
                -f "$dir/$v.sql" "$url" 2>"$dir/err" | awk '/^tps/ {t = int($3)} END {print t}') ||
                { cat "$dir/err" >&2; exit 1; }
            [ -n "$t" ] || { cat "$dir/err" >&2; exit 1; }
            tps[$v]="${tps[$v]:-} $t"
        done
    done
    raw=$(median "${tps[raw]}")
    raw_locked=$(median "${tps[raw_locked]}")
    for v in $variants; do
        m=$(median "${tps[$v]}")
        echo "bench=enqueue-candidate table=$table clients=$c variant=$v tps=$m runs=[${tps[$v]# }]" \
            "vs_raw=$(awk -v a="$m" -v b="$raw" 'BEGIN {printf "%.2f", a / b}')" \
            "vs_locked=$(awk -v a="$m" -v b="$raw_locked" 'BEGIN {printf "%.2f", a / b}')"
    done
    unset tps
done

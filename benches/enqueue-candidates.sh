#!/usr/bin/env bash
# Where a single enqueue's cost goes against a hand-written INSERT, and what each part of
# strict order costs, measured with pgbench on the server alone (no client library):
#
#   benches/enqueue-candidates.sh            # CLIENTS="1 4 16" ROUNDS=3 SECS=4
#
# Every transaction is the business write (INSERT INTO orders .. RETURNING id) plus one
# outbox row of 512 bytes whose aggregate is its own (`order-<n>`). Variants, in turns:
#   raw          a hand-written outbox row (uuid key, jsonb headers, one partial index)
#   row          this crate's row by a plain prepared INSERT, marked as its head: what any
#                design keeping this table pays, with no lock and no probe
#   sql_lock     the aggregate lock and the head probe in one SQL statement, no PL/pgSQL
#                (not a design: the probe's snapshot predates the lock)
#   no_lock      the enqueue function without the aggregate lock (racing producers of one
#                aggregate could commit out of order)
#   no_tracking  the enqueue function without counting the locks a transaction holds
#                (a transaction enqueueing thousands of aggregates would fill the lock table)
#   enqueue      the enqueue function as shipped (migration 0010)
# Prints `bench=enqueue-candidate clients=<n> variant=<v> tps=<median> vs_raw=<ratio>`.
# Needs psql, pgbench and cargo; uses a scratch schema dropped at the end.
set -euo pipefail

url=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
clients=${CLIENTS:-1 4 16}
rounds=${ROUNDS:-3}
secs=${SECS:-4}
schema="enqueue_candidates_$$"
dir=$(mktemp -d)
cleanup() {
    psql -qX "$url" -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap cleanup EXIT

cd "$(dirname "$0")/.."
cargo run -q --release --features cli --bin postgres-outbox -- \
    --database-url "$url" --table "$schema.ob" migrate >/dev/null 2>&1

# The enqueue function of migration 0010 with one part left out: its body is the shipped
# one's (read from the catalog), edited.
psql -qX -v ON_ERROR_STOP=1 "$url" <<SQL
CREATE TABLE $schema.orders (id bigserial PRIMARY KEY, customer text NOT NULL,
                             total numeric NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE $schema.raw (id bigserial PRIMARY KEY, key uuid NOT NULL UNIQUE, topic text NOT NULL,
    aggregate_key text, payload bytea NOT NULL, headers jsonb NOT NULL DEFAULT '{}',
    status text NOT NULL DEFAULT 'pending', attempts integer NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(), lease_until timestamptz,
    created_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX ON $schema.raw (available_at, id) WHERE status = 'pending';
DO \$do\$
DECLARE
    shipped text;
    args text;
BEGIN
    SELECT p.prosrc, pg_get_function_arguments(p.oid) INTO shipped, args
    FROM pg_proc p WHERE p.oid = (SELECT max(oid) FROM pg_proc
                                  WHERE proname = 'ob_enqueue'
                                    AND pronamespace = '$schema'::regnamespace);
    -- The lock block is the first IF ... END IF of the body.
    EXECUTE format('CREATE FUNCTION $schema.no_lock(%s) RETURNS boolean LANGUAGE plpgsql AS %L',
                   args, regexp_replace(shipped, 'IF p_aggregate_key IS NOT NULL THEN.*?\n    END IF;', '', 's'));
    EXECUTE format('CREATE FUNCTION $schema.no_tracking(%s) RETURNS boolean LANGUAGE plpgsql AS %L',
                   args, regexp_replace(shipped,
                       'IF p_aggregate_key IS NOT NULL THEN.*?\n    END IF;',
                       E'IF p_aggregate_key IS NOT NULL THEN\n'
                       || E'        lock_key := hashtextextended(p_aggregate_key, 0);\n'
                       || E'        PERFORM pg_advisory_xact_lock_shared(lock_key & 15), pg_advisory_xact_lock(lock_key);\n'
                       || E'    END IF;', 's'));
END
\$do\$;
SQL

payload="decode(repeat('ab', 512), 'hex')"
business="INSERT INTO $schema.orders (customer, total) VALUES ('c', 10) RETURNING id;"
agg="'order-' || :n"
call() {
    echo "SELECT $schema.$1(gen_random_uuid()::text, 'order.created', $agg, $payload, 'application/json', '{}'::text[], NULL, 0, NULL, false, false, true);"
}
write() {
    printf '\\set n random(1, 1000000000)\nBEGIN;\n%s\n%s\nCOMMIT;\n' "$business" "$2" >"$dir/$1.sql"
}
probe="NOT EXISTS (SELECT 1 FROM $schema.ob o WHERE o.head IN (false, true) AND o.aggregate_key = $agg AND o.status IN ('pending', 'parked'))"
columns="key, topic, aggregate_key, payload, content_type, headers, available_at, max_attempts, park, head"
write raw "INSERT INTO $schema.raw (key, topic, aggregate_key, payload, headers) VALUES (gen_random_uuid(), 'order.created', $agg, $payload, '{\"content-type\":\"application/json\"}'::text::jsonb);"
write row "INSERT INTO $schema.ob ($columns) VALUES (gen_random_uuid()::text, 'order.created', $agg, $payload, 'application/json', '{}'::text[], now(), NULL, false, true);"
write sql_lock "WITH l AS (SELECT pg_advisory_xact_lock_shared(hashtextextended($agg, 0) & 15), pg_advisory_xact_lock(hashtextextended($agg, 0))) INSERT INTO $schema.ob ($columns) SELECT gen_random_uuid()::text, 'order.created', $agg, $payload, 'application/json', '{}'::text[], now(), NULL, false, $probe FROM l;"
write no_lock "$(call no_lock)"
write no_tracking "$(call no_tracking)"
write enqueue "$(call ob_enqueue)"
variants="raw row sql_lock no_lock no_tracking enqueue"

for c in $clients; do
    declare -A tps=()
    for _ in $(seq "$rounds"); do
        for v in $variants; do
            # libpq takes the URL where pgbench takes a database name.
            t=$(pgbench -n -M prepared -c "$c" -j "$((c < 4 ? c : 4))" -T "$secs" \
                -f "$dir/$v.sql" "$url" 2>"$dir/err" | awk '/^tps/ {print int($3)}') ||
                { cat "$dir/err" >&2; exit 1; }
            tps[$v]="${tps[$v]:-} $t"
        done
    done
    median() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
    raw=$(median "${tps[raw]}")
    for v in $variants; do
        m=$(median "${tps[$v]}")
        echo "bench=enqueue-candidate clients=$c variant=$v tps=$m runs=[${tps[$v]# }] vs_raw=$(awk -v a="$m" -v b="$raw" 'BEGIN {printf "%.2f", a / b}')"
    done
    unset tps
done

//! The PostgreSQL server features the crate's SQL relies on, and the release that brought each.
//!
//! PostgreSQL 13 is the stated minimum, but this machine's package sources carry only
//! PostgreSQL 15, so the suite cannot run against 13 or 14 here. This list stands in for that
//! version matrix: `FEATURES` names every feature from 9.0 on (and a few older ones the claim
//! is built on) that the migrations in `sql/` or the statements in `src/` use, and the tests
//! hold it against the SQL text: nothing listed is newer than 13, nothing listed has gone
//! unused, and nothing in `DENIED` (constructs from 14 on) appears at all. The README's
//! "PostgreSQL versions" section is this list as a table.
//!
//! To update it: SQL that starts using a feature from 9.0 on gets an entry, with the version
//! from the release notes and a pattern that finds it; SQL that stops using one fails
//! `every_listed_feature_is_still_used` until its entry goes. A construct from after 13
//! belongs in `DENIED` until the minimum is raised (then `MINIMUM`, the entries and the README
//! change together). Needs no server: `cargo test --test postgres_versions`.
//!
//! What is searched: `sql/**/*.sql` without its `--` comments, and the string literals of every
//! `src/**/*.rs` file without the `--` comments inside them. Rust comments and Rust code are
//! not searched, so a comment that names a construct (or `str::starts_with`) is not a use.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

/// The oldest PostgreSQL the crate supports.
const MINIMUM: Version = Version(13, 0);

/// A PostgreSQL release: major and minor before 10 (9.5), the major alone from 10 on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Version(u32, u32);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 >= 10 {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{}.{}", self.0, self.1)
        }
    }
}

/// A server feature and how to find it in SQL.
///
/// A pattern matches case-insensitively and whatever the whitespace: a run of it counts as
/// one space, and none is needed beside a parenthesis or a comma. A pattern that starts or
/// ends with a letter, digit or underscore matches a whole word there (`SET jit` does not
/// match `RESET jit`). `...` stands for at most `GAP` bytes of anything. A feature is used
/// where any one of its patterns matches.
struct Feature {
    name: &'static str,
    since: Version,
    patterns: &'static [&'static str],
}

/// How far apart the parts of a pattern split by `...` may be: one clause, not the next
/// statement.
const GAP: usize = 100;

/// Every server feature the crate's SQL uses that came in 8.4 or later, oldest first.
const FEATURES: &[Feature] = &[
    // 8.4: older than anything supported, listed because the claim is built on them.
    Feature {
        name: "WITH RECURSIVE",
        since: Version(8, 4),
        patterns: &["WITH RECURSIVE"],
    },
    Feature {
        name: "window functions (row_number, lag, first_value ... OVER)",
        since: Version(8, 4),
        patterns: &["OVER (", "OVER w"],
    },
    Feature {
        name: "array_agg()",
        since: Version(8, 4),
        patterns: &["array_agg("],
    },
    Feature {
        name: "unnest()",
        since: Version(8, 4),
        patterns: &["unnest("],
    },
    Feature {
        name: "per-table autovacuum settings (WITH (autovacuum_...))",
        since: Version(8, 4),
        patterns: &["autovacuum_vacuum_scale_factor"],
    },
    Feature {
        name: "DO blocks",
        since: Version(9, 0),
        patterns: &["DO $"],
    },
    Feature {
        name: "PL/pgSQL installed by default (LANGUAGE plpgsql)",
        since: Version(9, 0),
        patterns: &["LANGUAGE plpgsql"],
    },
    Feature {
        // Named by what they aggregate: the ORDER BY of the query may follow any aggregate.
        name: "ORDER BY inside an aggregate (array_agg(x ORDER BY y))",
        since: Version(9, 0),
        patterns: &["array_agg(k ORDER BY", "array_agg(t.key ORDER BY"],
    },
    Feature {
        name: "pg_notify()",
        since: Version(9, 0),
        patterns: &["pg_notify("],
    },
    Feature {
        name: "application_name setting",
        since: Version(9, 0),
        patterns: &["application_name"],
    },
    Feature {
        name: "COPY option list (FORMAT binary)",
        since: Version(9, 0),
        patterns: &["(FORMAT binary)"],
    },
    Feature {
        name: "data-modifying statements in WITH",
        since: Version(9, 1),
        patterns: &["AS (INSERT", "AS (UPDATE", "AS (DELETE"],
    },
    Feature {
        name: "CREATE UNLOGGED TABLE",
        since: Version(9, 1),
        patterns: &["CREATE UNLOGGED TABLE"],
    },
    Feature {
        name: "column collations (COLLATE \"C\")",
        since: Version(9, 1),
        patterns: &["COLLATE \"C\""],
    },
    Feature {
        name: "format() (with %I)",
        since: Version(9, 1),
        patterns: &["format('"],
    },
    Feature {
        name: "pg_advisory_xact_lock()",
        since: Version(9, 1),
        patterns: &["pg_advisory_xact_lock("],
    },
    Feature {
        name: "pg_advisory_xact_lock_shared()",
        since: Version(9, 1),
        patterns: &["pg_advisory_xact_lock_shared("],
    },
    Feature {
        name: "CREATE TABLE IF NOT EXISTS",
        since: Version(9, 1),
        patterns: &["CREATE TABLE IF NOT EXISTS"],
    },
    Feature {
        name: "CHECK constraints NOT VALID",
        since: Version(9, 2),
        patterns: &["CHECK ... NOT VALID"],
    },
    Feature {
        // Before 9.2 a setting outside the server's own needed custom_variable_classes.
        name: "custom settings (postgres_outbox.*) without custom_variable_classes",
        since: Version(9, 2),
        patterns: &[
            "set_config('postgres_outbox.",
            "current_setting('postgres_outbox.",
        ],
    },
    Feature {
        name: "LATERAL",
        since: Version(9, 3),
        patterns: &["JOIN LATERAL"],
    },
    Feature {
        name: "CREATE SCHEMA IF NOT EXISTS",
        since: Version(9, 3),
        patterns: &["CREATE SCHEMA IF NOT EXISTS"],
    },
    Feature {
        name: "lock_timeout setting",
        since: Version(9, 3),
        patterns: &["lock_timeout"],
    },
    Feature {
        name: "aggregate FILTER (WHERE ...)",
        since: Version(9, 4),
        patterns: &["FILTER (WHERE"],
    },
    Feature {
        // Named by their first argument: a pattern cannot count arguments.
        name: "unnest() of several arrays",
        since: Version(9, 4),
        patterns: &["unnest(p_keys,", "unnest($1::bigint[],"],
    },
    Feature {
        name: "WITH ORDINALITY",
        since: Version(9, 4),
        patterns: &["WITH ORDINALITY"],
    },
    Feature {
        name: "cardinality()",
        since: Version(9, 4),
        patterns: &["cardinality("],
    },
    Feature {
        name: "INSERT ... ON CONFLICT DO NOTHING",
        since: Version(9, 5),
        patterns: &["ON CONFLICT ... DO NOTHING"],
    },
    Feature {
        name: "INSERT ... AS alias ... ON CONFLICT DO UPDATE (EXCLUDED)",
        since: Version(9, 5),
        patterns: &["ON CONFLICT ... DO UPDATE"],
    },
    Feature {
        name: "FOR UPDATE SKIP LOCKED",
        since: Version(9, 5),
        patterns: &["SKIP LOCKED"],
    },
    Feature {
        name: "current_setting(name, missing_ok)",
        since: Version(9, 6),
        patterns: &["current_setting(..., true)"],
    },
    Feature {
        name: "idle_in_transaction_session_timeout setting",
        since: Version(9, 6),
        patterns: &["idle_in_transaction_session_timeout"],
    },
    Feature {
        // 9.4 brought it taking cstring; a bound text parameter needs 9.6's text version.
        name: "to_regclass(text)",
        since: Version(9, 6),
        patterns: &["to_regclass("],
    },
    Feature {
        name: "GENERATED ALWAYS AS IDENTITY",
        since: Version(10, 0),
        patterns: &[
            "GENERATED ALWAYS AS IDENTITY",
            "GENERATED BY DEFAULT AS IDENTITY",
        ],
    },
    Feature {
        // From 11 on too, what a partitioned outbox needs: a primary key and ON CONFLICT
        // DO NOTHING on a partitioned table; those have no pattern of their own.
        name: "declarative partitioning (PARTITION BY RANGE, ATTACH PARTITION)",
        since: Version(11, 0),
        patterns: &["PARTITION BY RANGE", "ATTACH PARTITION"],
    },
    Feature {
        // Internal and undocumented, but stable: hash partitioning is built on it.
        name: "hashtextextended()",
        since: Version(11, 0),
        patterns: &["hashtextextended("],
    },
    Feature {
        name: "starts_with()",
        since: Version(11, 0),
        patterns: &["starts_with("],
    },
    Feature {
        // An unknown setting is an error, so SET jit fails before 11.
        name: "jit setting",
        since: Version(11, 0),
        patterns: &["SET jit", "SET LOCAL jit", "RESET jit"],
    },
    Feature {
        // Before 12 every CTE was materialized and the keyword is a syntax error.
        name: "WITH ... AS MATERIALIZED",
        since: Version(12, 0),
        patterns: &["AS MATERIALIZED ("],
    },
    Feature {
        // What makes 13 the minimum: txid_current() is what came before.
        name: "pg_current_xact_id() (xid8)",
        since: Version(13, 0),
        patterns: &["pg_current_xact_id("],
    },
];

/// Constructs from after 13 that the SQL must not use while 13 is the minimum, with the
/// release that brought each.
const DENIED: &[Feature] = &[
    Feature {
        name: "CREATE OR REPLACE TRIGGER",
        since: Version(14, 0),
        patterns: &["CREATE OR REPLACE TRIGGER"],
    },
    Feature {
        name: "BEGIN ATOMIC function bodies",
        since: Version(14, 0),
        patterns: &["BEGIN ATOMIC"],
    },
    Feature {
        name: "OUT parameters of procedures",
        since: Version(14, 0),
        patterns: &["PROCEDURE ... (OUT", "PROCEDURE ... , OUT"],
    },
    Feature {
        name: "SEARCH and CYCLE clauses of recursive queries",
        since: Version(14, 0),
        patterns: &[
            "SEARCH DEPTH FIRST BY",
            "SEARCH BREADTH FIRST BY",
            "CYCLE ... SET ... USING",
        ],
    },
    Feature {
        name: "GROUP BY DISTINCT",
        since: Version(14, 0),
        patterns: &["GROUP BY DISTINCT"],
    },
    Feature {
        name: "DETACH PARTITION CONCURRENTLY",
        since: Version(14, 0),
        patterns: &["DETACH PARTITION ... CONCURRENTLY"],
    },
    Feature {
        name: "column compression (COMPRESSION lz4)",
        since: Version(14, 0),
        patterns: &[
            "COMPRESSION lz4",
            "COMPRESSION pglz",
            "default_toast_compression",
        ],
    },
    Feature {
        name: "multiranges and range_agg()",
        since: Version(14, 0),
        patterns: &[
            "range_agg(",
            "int4multirange",
            "int8multirange",
            "nummultirange",
            "tsmultirange",
            "tstzmultirange",
            "datemultirange",
        ],
    },
    Feature {
        name: "trim_array()",
        since: Version(14, 0),
        patterns: &["trim_array("],
    },
    Feature {
        name: "date_bin()",
        since: Version(14, 0),
        patterns: &["date_bin("],
    },
    Feature {
        name: "bit_count()",
        since: Version(14, 0),
        patterns: &["bit_count("],
    },
    Feature {
        name: "string_to_table()",
        since: Version(14, 0),
        patterns: &["string_to_table("],
    },
    Feature {
        name: "unistr()",
        since: Version(14, 0),
        patterns: &["unistr("],
    },
    Feature {
        name: "pg_wait_for_backend_termination()",
        since: Version(14, 0),
        patterns: &["pg_wait_for_backend_termination("],
    },
    Feature {
        name: "idle_session_timeout setting",
        since: Version(14, 0),
        patterns: &["idle_session_timeout"],
    },
    Feature {
        name: "client_connection_check_interval setting",
        since: Version(14, 0),
        patterns: &["client_connection_check_interval"],
    },
    Feature {
        name: "MERGE",
        since: Version(15, 0),
        patterns: &["MERGE INTO"],
    },
    Feature {
        name: "NULLS NOT DISTINCT",
        since: Version(15, 0),
        patterns: &["NULLS NOT DISTINCT"],
    },
    Feature {
        name: "security_invoker views",
        since: Version(15, 0),
        patterns: &["security_invoker"],
    },
    Feature {
        name: "regexp_count(), regexp_instr(), regexp_like(), regexp_substr()",
        since: Version(15, 0),
        patterns: &[
            "regexp_count(",
            "regexp_instr(",
            "regexp_like(",
            "regexp_substr(",
        ],
    },
    Feature {
        name: "ALTER TABLE ... SET ACCESS METHOD",
        since: Version(15, 0),
        patterns: &["SET ACCESS METHOD"],
    },
    Feature {
        name: "any_value()",
        since: Version(16, 0),
        patterns: &["any_value("],
    },
    Feature {
        name: "random_normal()",
        since: Version(16, 0),
        patterns: &["random_normal("],
    },
    Feature {
        name: "pg_input_is_valid(), pg_input_error_info()",
        since: Version(16, 0),
        patterns: &["pg_input_is_valid(", "pg_input_error_info("],
    },
    Feature {
        name: "SQL/JSON constructors and IS JSON",
        since: Version(16, 0),
        patterns: &[
            "json_object(",
            "json_array(",
            "json_objectagg(",
            "json_arrayagg(",
            // Not a bare "IS JSON": Rust strings are searched too, and prose says "is JSON".
            "IS JSON OBJECT",
            "IS JSON ARRAY",
            "IS JSON SCALAR",
            "IS JSON VALUE",
            "IS NOT JSON",
        ],
    },
    Feature {
        name: "array_sample(), array_shuffle()",
        since: Version(16, 0),
        patterns: &["array_sample(", "array_shuffle("],
    },
    Feature {
        name: "date_add(), date_subtract()",
        since: Version(16, 0),
        patterns: &["date_add(", "date_subtract("],
    },
    Feature {
        name: "SYSTEM_USER",
        since: Version(16, 0),
        patterns: &["SYSTEM_USER"],
    },
    Feature {
        name: "JSON_TABLE and the SQL/JSON query functions",
        since: Version(17, 0),
        patterns: &["json_table(", "json_query(", "json_value(", "json_exists("],
    },
    Feature {
        name: "transaction_timeout setting",
        since: Version(17, 0),
        patterns: &["transaction_timeout"],
    },
    Feature {
        name: "uuid_extract_timestamp(), uuid_extract_version()",
        since: Version(17, 0),
        patterns: &["uuid_extract_timestamp(", "uuid_extract_version("],
    },
    Feature {
        name: "uuidv7(), uuidv4()",
        since: Version(18, 0),
        patterns: &["uuidv7(", "uuidv4("],
    },
    Feature {
        name: "WITHOUT OVERLAPS, NOT ENFORCED constraints",
        since: Version(18, 0),
        patterns: &[
            "WITHOUT OVERLAPS",
            "CHECK ... NOT ENFORCED",
            "REFERENCES ... NOT ENFORCED",
        ],
    },
];

/// Behaviour that changed after 13 and SQL written so that every supported version gives the
/// same result; each pattern finds the guarded form.
const CHANGED: &[Feature] = &[Feature {
    // `since`: the release whose change the guard absorbs. The stats read it as f64.
    name: "extract() returns numeric, was double precision (cast back with ::float8)",
    since: Version(14, 0),
    patterns: &["extract(epoch ...)::float8"],
}];

/// One file's searchable SQL: each piece (a whole `.sql` file, or one string literal of a
/// Rust file) without its SQL comments, normalized for `uses`.
struct Source {
    file: String,
    pieces: Vec<String>,
}

/// The crate's SQL: `sql/**/*.sql` and `src/**/*.rs`.
fn crate_sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = Vec::new();
    collect(&root.join("sql"), "sql", &mut paths);
    collect(&root.join("src"), "rs", &mut paths);
    paths.sort();
    paths
        .iter()
        .map(|path| {
            let text = fs::read_to_string(path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            let file = path
                .strip_prefix(root)
                .expect("collected under the crate's directory")
                .display()
                .to_string();
            if file.ends_with(".sql") {
                sql_source(&file, &text)
            } else {
                rust_source(&file, &text)
            }
        })
        .collect()
}

/// Every file under `dir` whose name ends in `.ext`.
fn collect(dir: &Path, ext: &str, paths: &mut Vec<PathBuf>) {
    let entries =
        fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            collect(&path, ext, paths);
        } else if path.extension().is_some_and(|e| e == ext) {
            paths.push(path);
        }
    }
}

fn sql_source(file: &str, text: &str) -> Source {
    Source {
        file: file.to_owned(),
        pieces: vec![normalize(&strip_sql_comments(text))],
    }
}

fn rust_source(file: &str, code: &str) -> Source {
    Source {
        file: file.to_owned(),
        pieces: string_literals(code)
            .iter()
            .map(|literal| normalize(&strip_sql_comments(literal)))
            .collect(),
    }
}

/// The contents of the string literals in Rust code (plain, raw and byte strings), escapes
/// resolved; comments, char literals and lifetimes are skipped.
fn string_literals(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let at = |i: usize| chars.get(i).copied();
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let mut literals = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match (chars[i], at(i + 1)) {
            ('/', Some('/')) => {
                while at(i).is_some_and(|c| c != '\n') {
                    i += 1;
                }
            }
            ('/', Some('*')) => {
                // Block comments nest in Rust.
                let mut depth = 0;
                while i < chars.len() {
                    match (chars[i], at(i + 1)) {
                        ('/', Some('*')) => {
                            depth += 1;
                            i += 2;
                        }
                        ('*', Some('/')) => {
                            depth -= 1;
                            i += 2;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => i += 1,
                    }
                }
            }
            ('"', _) => {
                let (literal, end) = cooked(&chars, i + 1);
                literals.push(literal);
                i = end;
            }
            ('r', Some('"' | '#'))
                if i == 0
                    || !is_word(chars[i - 1])
                    || (chars[i - 1] == 'b' && (i == 1 || !is_word(chars[i - 2]))) =>
            {
                let hashes = chars[i + 1..].iter().take_while(|&&c| c == '#').count();
                let open = i + 1 + hashes;
                if at(open) != Some('"') {
                    // A raw identifier, r#type.
                    i = open;
                    continue;
                }
                let close = (open + 1..chars.len())
                    .find(|&j| {
                        chars[j] == '"'
                            && chars[j + 1..].iter().take_while(|&&c| c == '#').count() >= hashes
                    })
                    .expect("a raw string literal is closed");
                literals.push(chars[open + 1..close].iter().collect());
                i = close + 1 + hashes;
            }
            ('\'', Some('\\')) => {
                // An escaped char literal: '\'', '\\', '\u{..}'.
                i += 3;
                while at(i).is_some_and(|c| c != '\'') {
                    i += 1;
                }
                i += 1;
            }
            ('\'', Some(_)) if at(i + 2) == Some('\'') => i += 3,
            // A lifetime or a label, or anything else.
            _ => i += 1,
        }
    }
    literals
}

/// A plain string literal's contents from `start` (just after its opening quote), and the
/// index just after its closing quote.
fn cooked(chars: &[char], start: usize) -> (String, usize) {
    let mut literal = String::new();
    let mut i = start;
    while i < chars.len() {
        match chars[i] {
            '"' => return (literal, i + 1),
            '\\' => {
                match chars.get(i + 1) {
                    // A line continuation drops the newline and the next line's indent.
                    Some('\n') => {
                        i += 2;
                        while chars.get(i).is_some_and(|c| c.is_whitespace()) {
                            i += 1;
                        }
                        continue;
                    }
                    Some('n') => literal.push('\n'),
                    Some('t') => literal.push('\t'),
                    Some('r') => literal.push('\r'),
                    Some(&c) => literal.push(c),
                    None => {}
                }
                i += 2;
            }
            c => {
                literal.push(c);
                i += 1;
            }
        }
    }
    panic!("a string literal is not closed");
}

/// SQL without its `--` comments (each up to the end of its line); a `--` inside a quoted
/// string stays.
fn strip_sql_comments(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut quoted = false;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\'' {
            quoted = !quoted;
        }
        if !quoted && c == '-' && chars.peek() == Some(&'-') {
            while chars.peek().is_some_and(|&c| c != '\n') {
                chars.next();
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Lower case, every run of whitespace one space, none beside a parenthesis or a comma: the
/// form `uses` compares, so that a pattern need not spell the source's layout.
fn normalize(text: &str) -> String {
    let tight = |c: char| matches!(c, '(' | ')' | ',');
    let mut out = String::with_capacity(text.len());
    let mut space = false;
    for c in text.chars().flat_map(char::to_lowercase) {
        if c.is_whitespace() {
            space = true;
            continue;
        }
        if space && !tight(c) && out.chars().last().is_some_and(|last| !tight(last)) {
            out.push(' ');
        }
        space = false;
        out.push(c);
    }
    out
}

/// Whether normalized `text` matches `pattern` (see `Feature`).
fn uses(text: &str, pattern: &str) -> bool {
    let parts: Vec<String> = pattern
        .split("...")
        .map(normalize)
        .filter(|part| !part.is_empty())
        .collect();
    !parts.is_empty() && matches_from(text, &parts, 0, None)
}

/// Whether `parts` occur in order from `from`, the first of them within `gap` bytes of it.
fn matches_from(text: &str, parts: &[String], from: usize, gap: Option<usize>) -> bool {
    let Some((part, rest)) = parts.split_first() else {
        return true;
    };
    let mut start = from;
    while let Some(offset) = text[start..].find(part.as_str()) {
        let at = start + offset;
        if gap.is_some_and(|gap| at - from > gap) {
            return false;
        }
        let end = at + part.len();
        if whole_word(text, at, end) && matches_from(text, rest, end, Some(GAP)) {
            return true;
        }
        start = at + text[at..].chars().next().map_or(1, char::len_utf8);
    }
    false
}

/// Whether `text[at..end]` neither starts nor ends inside a word.
fn whole_word(text: &str, at: usize, end: usize) -> bool {
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let first = text[at..end].chars().next();
    let last = text[at..end].chars().next_back();
    let before = text[..at].chars().next_back();
    let after = text[end..].chars().next();
    let starts_inside = first.is_some_and(word) && before.is_some_and(word);
    let ends_inside = last.is_some_and(word) && after.is_some_and(word);
    !starts_inside && !ends_inside
}

/// The files in which `feature` is used.
fn files_using<'a>(feature: &Feature, sources: &'a [Source]) -> Vec<&'a str> {
    sources
        .iter()
        .filter(|source| {
            source
                .pieces
                .iter()
                .any(|piece| feature.patterns.iter().any(|pattern| uses(piece, pattern)))
        })
        .map(|source| source.file.as_str())
        .collect()
}

/// One line per listed feature newer than `minimum`, naming the files that use it.
fn newer_than(features: &[Feature], minimum: Version, sources: &[Source]) -> Vec<String> {
    features
        .iter()
        .filter(|feature| feature.since > minimum)
        .map(|feature| {
            format!(
                "{} needs PostgreSQL {}, above the minimum {minimum}; used in {}",
                feature.name,
                feature.since,
                files_using(feature, sources).join(", ")
            )
        })
        .collect()
}

/// One line per listed feature that no source uses.
fn unused(features: &[Feature], sources: &[Source]) -> Vec<String> {
    features
        .iter()
        .filter(|feature| files_using(feature, sources).is_empty())
        .map(|feature| {
            format!(
                "{} (PostgreSQL {}) is listed, but no file of sql/ or src/ matches {:?}",
                feature.name, feature.since, feature.patterns
            )
        })
        .collect()
}

/// One line per (feature, file) where a source uses one of `features`.
fn uses_of(features: &[Feature], sources: &[Source]) -> Vec<String> {
    features
        .iter()
        .flat_map(|feature| {
            files_using(feature, sources).into_iter().map(move |file| {
                format!(
                    "{} (PostgreSQL {}) is used in {file}",
                    feature.name, feature.since
                )
            })
        })
        .collect()
}

#[test]
fn every_listed_feature_is_in_postgresql_13() {
    let problems = newer_than(FEATURES, MINIMUM, &crate_sources());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_listed_feature_is_still_used() {
    let problems = unused(FEATURES, &crate_sources());
    assert!(
        problems.is_empty(),
        "remove these from FEATURES (and the README's table), or fix their patterns:\n{}",
        problems.join("\n")
    );
}

#[test]
fn nothing_newer_than_postgresql_13_is_used() {
    let problems = uses_of(DENIED, &crate_sources());
    assert!(
        problems.is_empty(),
        "the minimum is PostgreSQL {MINIMUM}:\n{}",
        problems.join("\n")
    );
}

#[test]
fn every_guard_against_a_changed_behaviour_is_still_in_place() {
    let problems = unused(CHANGED, &crate_sources());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_deny_list_holds_only_constructs_newer_than_13_and_none_that_is_listed_as_used() {
    for denied in DENIED {
        assert!(
            denied.since > MINIMUM,
            "{} (PostgreSQL {}) is allowed at the minimum {MINIMUM}: it belongs in FEATURES, if used",
            denied.name,
            denied.since
        );
        assert!(
            FEATURES.iter().all(|feature| feature.name != denied.name),
            "{} is both listed and denied",
            denied.name
        );
    }
}

// The checks' own tests: a guard that cannot fail guards nothing.

#[test]
fn a_denied_construct_is_reported_with_its_name_version_and_file() {
    let sample = [sql_source(
        "sql/9999_sample.sql",
        "-- An upsert in one statement.\n\
         MERGE INTO t USING s ON t.id = s.id\n\
         WHEN MATCHED THEN UPDATE SET n = s.n;",
    )];
    let problems = uses_of(DENIED, &sample);
    assert_eq!(
        problems,
        ["MERGE (PostgreSQL 15) is used in sql/9999_sample.sql"]
    );
}

#[test]
fn a_denied_construct_in_a_rust_string_is_reported_but_not_in_a_comment() {
    let code = r###"
        // MERGE INTO would do it in one statement, from PostgreSQL 15.
        /* So would MERGE INTO, /* nested */ and any_value(x). */
        const QUOTE: char = '"';
        const ESCAPED: char = '\'';
        fn update<'a>(x: &'a str) -> String {
            format!("-- not MERGE INTO either\nUPDATE t SET a = 1 WHERE b = '{x}'")
        }
        const UPSERT: &str = "MERGE \
                              INTO t USING s ON t.id = s.id";
        const RAW: &str = r#"SELECT "any_value"(x), any_value(y) FROM t"#;
    "###;
    let problems = uses_of(DENIED, &[rust_source("src/sample.rs", code)]);
    assert_eq!(
        problems,
        [
            "MERGE (PostgreSQL 15) is used in src/sample.rs",
            "any_value() (PostgreSQL 16) is used in src/sample.rs",
        ]
    );
}

#[test]
fn a_listed_feature_the_sql_no_longer_uses_is_reported() {
    let listed = [
        Feature {
            name: "INSERT ... ON CONFLICT DO NOTHING",
            since: Version(9, 5),
            patterns: &["ON CONFLICT ... DO NOTHING"],
        },
        Feature {
            name: "FOR UPDATE SKIP LOCKED",
            since: Version(9, 5),
            patterns: &["SKIP LOCKED"],
        },
    ];
    let sample = [sql_source(
        "sql/9999_sample.sql",
        "INSERT INTO t (k) VALUES ('a')\n  ON CONFLICT (k)\n  DO NOTHING;\n\
         -- SKIP LOCKED would let claims pass each other.",
    )];
    let problems = unused(&listed, &sample);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].starts_with("FOR UPDATE SKIP LOCKED (PostgreSQL 9.5)"));
}

#[test]
fn a_listed_feature_newer_than_the_minimum_is_reported_with_the_files_using_it() {
    let listed = [Feature {
        name: "date_bin()",
        since: Version(14, 0),
        patterns: &["date_bin("],
    }];
    let sample = [
        sql_source(
            "sql/9999_sample.sql",
            "SELECT date_bin('15 minutes', now(), 'epoch');",
        ),
        sql_source("sql/9998_other.sql", "SELECT now();"),
    ];
    assert_eq!(
        newer_than(&listed, Version(13, 0), &sample),
        ["date_bin() needs PostgreSQL 14, above the minimum 13; used in sql/9999_sample.sql"]
    );
}

#[test]
fn patterns_ignore_case_and_layout_match_whole_words_and_bound_their_gaps() {
    let text = normalize(
        "SELECT count(*) FILTER ( WHERE x )\n  FROM t\n WHERE lease_until > now()\n \
         ON CONFLICT (a, b) DO NOTHING",
    );
    assert!(uses(&text, "filter (where"));
    assert!(uses(&text, "SELECT ... FROM t"));
    assert!(uses(&text, "ON CONFLICT ... DO NOTHING"));
    assert!(uses(&text, "(a,b)"));
    assert!(!uses(&text, "until"), "inside a word");
    assert!(!uses(&text, "SET jit"));
    let far = normalize(&format!("SELECT {} FROM t", "x, ".repeat(60)));
    assert!(!uses(&far, "SELECT ... FROM t"), "more than GAP apart");
}

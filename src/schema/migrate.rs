//! The schema's files in `sql/`, rendered per table, and how `Outbox::migrate` and
//! `Outbox::sql` apply them.
//!
//! Tables change only through versioned migrations (`sql/NNNN_*.sql`): each runs once, and
//! is recorded by version in `<table>_migrations`, so one a release shipped must never change
//! (the test `shipped_migrations_render_exactly_as_they_shipped`). Functions live in
//! `sql/functions/`, one file per job, written as they run today: a file is run again
//! (each function in it a `CREATE OR REPLACE`, which keeps its grants) whenever its text,
//! rendered for the table, differs from what `<table>_functions` records. Its revision,
//! recorded beside the text's hash, is raised with every change to the file, so that a
//! process of an older version, migrating on its start during a rolling upgrade, never puts
//! its own functions back over a newer one's.
//!
//! A table's enqueue functions depend on its form: a partitioned table has its own (a key's
//! uniqueness and the look for an aggregate's pending messages cross partitions), and none of
//! those earlier producers call. So the files apply in two steps: those of every table
//! before a plain table is made partitioned (which calls the partition maker), those of the
//! table's form after.

use std::time::Duration;

use postgres::{GenericClient, Transaction};

use crate::schema::partitioning::render_partitioned;
use crate::schema::render::{render, RenderError, Values};
use crate::schema::statements::{
    bigint, borrowed, checked, from_look, in_look, look_earlier, notify_if_waiting, objects,
    shared, Statements, LOCK_AGGREGATE, LOOK_IN_ONE_RUN, LOOK_PARTITIONS, LOOK_RANGES,
    PARTITION_ID_BITS,
};
use crate::schema::table::{quote, TableName};

/// A migration file, embedded in the binary.
pub(crate) struct Migration {
    pub(crate) version: i32,
    pub(crate) name: &'static str,
    template: &'static str,
}

/// The versioned schema files in `sql/`, oldest first. Never edit one that has shipped, nor
/// what it renders to: add a new file instead. 0.2.0 shipped 1 to 6.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_create_outbox",
        template: include_str!("../../sql/0001_create_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "0002_claim_heads",
        template: include_str!("../../sql/0002_claim_heads.sql"),
    },
    Migration {
        version: 3,
        name: "0003_consumer_failures",
        template: include_str!("../../sql/0003_consumer_failures.sql"),
    },
    Migration {
        version: 4,
        name: "0004_enqueue_functions",
        template: include_str!("../../sql/0004_enqueue_functions.sql"),
    },
    Migration {
        version: 5,
        name: "0005_aggregate_locks_and_parking",
        template: include_str!("../../sql/0005_aggregate_locks_and_parking.sql"),
    },
    Migration {
        version: 6,
        name: "0006_dead_decisions_and_channel",
        template: include_str!("../../sql/0006_dead_decisions_and_channel.sql"),
    },
    Migration {
        version: 7,
        name: "0007_since_0_2_0",
        template: include_str!("../../sql/0007_since_0_2_0.sql"),
    },
    Migration {
        version: 8,
        name: "0008_publication_sequence",
        template: include_str!("../../sql/0008_publication_sequence.sql"),
    },
];

/// The migrations numbered 7 to 23 that builds between 0.2.0 and 0.3.0 applied, never
/// released, which migration 7 replaces: a table that records them is brought to it by
/// forgetting them and running it (it makes each change only where it is missing).
const SQUASHED: &[&str] = &[
    "0007_head_flags",
    "0008_head_probes_per_aggregate",
    "0009_claims_apart_from_attempts",
    "0010_leaner_enqueue",
    "0011_relay_reports",
    "0012_partitions",
    "0013_settled_partitions",
    "0014_partitioned_head_probes",
    "0015_upkeep_without_ownership",
    "0016_past_kept_partitions",
    "0017_looks_from_quiet_partitions",
    "0018_counted_dead_letters",
    "0019_looks_past_held_partitions",
    "0020_ids_drawn",
    "0021_looks_in_ranges",
    "0022_relay_claims",
    "0023_writes_without_checks",
];

/// Which tables a function file is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    Any,
    Plain,
    Partitioned,
}

/// A file of functions, embedded in the binary.
pub(crate) struct Functions {
    pub(crate) name: &'static str,
    /// Raised with every change to the file (see the module's documentation).
    revision: i32,
    form: Form,
    template: &'static str,
}

/// The function files in `sql/functions/`, in the order they are made: a function of the
/// SQL language must find the functions it calls already made.
pub(crate) const FUNCTIONS: &[Functions] = &[
    Functions {
        name: "notify",
        revision: 1,
        form: Form::Any,
        template: include_str!("../../sql/functions/notify.sql"),
    },
    Functions {
        name: "locks",
        revision: 1,
        form: Form::Any,
        template: include_str!("../../sql/functions/locks.sql"),
    },
    Functions {
        name: "partitions",
        revision: 1,
        form: Form::Any,
        template: include_str!("../../sql/functions/partitions.sql"),
    },
    Functions {
        name: "sequence",
        revision: 1,
        form: Form::Any,
        template: include_str!("../../sql/functions/sequence.sql"),
    },
    Functions {
        name: "enqueue",
        revision: 1,
        form: Form::Plain,
        template: include_str!("../../sql/functions/enqueue.sql"),
    },
    Functions {
        name: "earlier_producers",
        revision: 1,
        form: Form::Plain,
        template: include_str!("../../sql/functions/earlier_producers.sql"),
    },
    Functions {
        name: "enqueue_partitioned",
        revision: 1,
        form: Form::Partitioned,
        template: include_str!("../../sql/functions/enqueue_partitioned.sql"),
    },
];

/// `<table>_functions`: what each function file made, as it was rendered.
const FUNCTIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS {functions} (
    name       text        PRIMARY KEY,
    revision   integer     NOT NULL,
    hash       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())";

/// Whether the file `{name}` needs making: it is not recorded at its revision and hash,
/// nor at a later revision.
const MADE: &str = "EXISTS (SELECT FROM {functions} WHERE name = {name}
                    AND (revision > {revision} OR (revision = {revision} AND hash = {hash})))";

const RECORD_FUNCTIONS: &str = "INSERT INTO {functions} (name, revision, hash)
    VALUES ({name}, {revision}, {hash})
    ON CONFLICT (name) DO UPDATE
    SET revision = excluded.revision, hash = excluded.hash, applied_at = now()";

/// The records of the files of the form the table is not.
const FORGET_FUNCTIONS: &str = "DELETE FROM {functions} WHERE name = ANY ({names})";

/// One function file in the script of `Outbox::sql`.
const FUNCTIONS_STEP: &str = "-- functions/{name}.sql\n\
     DO $outbox_functions$\n\
     BEGIN\n\
     IF {form} AND NOT {made} THEN\n\
     EXECUTE $outbox_ddl$\n{body}\n$outbox_ddl$;\n\
     {record};\n\
     END IF;\n\
     END\n\
     $outbox_functions$;\n\n";

/// One migration in the script of `Outbox::sql`.
const SCRIPT_STEP: &str = "-- {name}\n\
     DO $outbox_migration$\n\
     BEGIN\n\
     IF NOT EXISTS ({applied} WHERE version = {version}) THEN\n\
     EXECUTE $outbox_ddl$\n{body}\n$outbox_ddl$;\n\
     {record};\n\
     END IF;\n\
     END\n\
     $outbox_migration$;\n\n";

/// The partitioned table in the script of `Outbox::sql`, made once, from an empty table.
const PARTITIONED_STEP: &str = "-- partitioned\n\
     DO $outbox_migration$\n\
     BEGIN\n\
     IF NOT EXISTS (SELECT 1 FROM {partitions}) THEN\n\
     IF EXISTS (SELECT 1 FROM {table}) THEN\n\
     RAISE EXCEPTION 'outbox {name} holds rows, and only an empty table is made partitioned';\n\
     END IF;\n\
     EXECUTE $outbox_ddl$\n{body}\n$outbox_ddl$;\n\
     END IF;\n\
     END\n\
     $outbox_migration$;\n\n";

/// The schema's files rendered for one table, with the statements that keep their records.
pub(crate) struct Schema {
    /// Every migration's DDL, in the order of `MIGRATIONS`.
    pub(crate) migrations: Vec<String>,
    /// Every function file's DDL, in the order of `FUNCTIONS`.
    functions: Vec<String>,
    /// Forgets the rows of the migrations migration 7 replaces.
    pub(crate) forget_squashed: String,
    pub(crate) functions_table: String,
    /// Whether function file $1 needs making at revision $2 and hash $3.
    needs_making: String,
    record_functions: String,
    forget_functions: String,
}

impl Schema {
    /// # Panics
    ///
    /// If a template does not match its values: a fault of this crate, the same for every
    /// table (see `render.rs`), which the test `every_file_renders_for_every_table` shows.
    pub(crate) fn new(table: &TableName) -> Schema {
        checked(Schema::render(table))
    }

    fn render(table: &TableName) -> Result<Schema, RenderError> {
        let functions = table.companion("_functions");
        let bound = [
            ("functions", functions.as_str()),
            ("name", "$1"),
            ("revision", "$2"),
            ("hash", "$3"),
        ];
        Ok(Schema {
            migrations: render_migrations(table)?,
            functions: render_functions(table)?,
            forget_squashed: forget_squashed(table)?,
            functions_table: render(FUNCTIONS_TABLE, &[("functions", &functions)])?,
            needs_making: format!("SELECT NOT {}", render(MADE, &bound)?),
            record_functions: render(RECORD_FUNCTIONS, &bound)?,
            forget_functions: render(
                FORGET_FUNCTIONS,
                &[("functions", &functions), ("names", "$1")],
            )?,
        })
    }

    /// Makes the functions of the files of `form` that need it, and records them.
    pub(crate) fn make_functions(
        &self,
        tx: &mut Transaction<'_>,
        table: &str,
        form: Form,
    ) -> Result<(), postgres::Error> {
        for (file, ddl) in FUNCTIONS.iter().zip(&self.functions) {
            if file.form != form {
                continue;
            }
            let hash = hash(ddl);
            let params: [&(dyn postgres::types::ToSql + Sync); 3] =
                [&file.name, &file.revision, &hash];
            if !tx.query_one(&self.needs_making, &params)?.get::<_, bool>(0) {
                continue;
            }
            log::info!("outbox {table}: making the functions of {}.sql", file.name);
            tx.batch_execute(ddl)?;
            tx.execute(&self.record_functions, &params)?;
        }
        Ok(())
    }

    /// Forgets the function files of the form a table is not (a plain table's, once it is
    /// made partitioned).
    pub(crate) fn forget_functions(
        &self,
        client: &mut impl GenericClient,
        partitioned: bool,
    ) -> Result<(), postgres::Error> {
        let other = if partitioned {
            Form::Plain
        } else {
            Form::Partitioned
        };
        let names: Vec<&str> = FUNCTIONS
            .iter()
            .filter(|file| file.form == other)
            .map(|file| file.name)
            .collect();
        client.execute(&self.forget_functions, &[&names])?;
        Ok(())
    }
}

/// The form of functions a table takes.
pub(crate) fn form(partitioned: bool) -> Form {
    if partitioned {
        Form::Partitioned
    } else {
        Form::Plain
    }
}

/// FNV-1a, 64 bits, in hex: what a function file was rendered to, for its record.
/// (Collisions need not be guarded against: nobody chooses the texts to make one.)
fn hash(text: &str) -> String {
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

fn forget_squashed(table: &TableName) -> Result<String, RenderError> {
    let names: Vec<String> = SQUASHED.iter().map(|name| format!("'{name}'")).collect();
    render(
        "DELETE FROM {migrations} WHERE version > 6 AND name IN ({names})",
        &[
            ("migrations", &table.companion("_migrations")),
            ("names", &names.join(", ")),
        ],
    )
}

/// Renders the migrations together: each must find a value for every placeholder, and each
/// value must be used by one of them.
fn render_migrations(table: &TableName) -> Result<Vec<String>, RenderError> {
    let mut vars = objects(table);
    vars.retain(|(name, _)| {
        ![
            "lock_heads_fn",
            "partition_fn",
            "retire_fn",
            "ids_drawn_fn",
            "head_fn",
            "place_fn",
            "placed_fn",
        ]
        .contains(name)
    });
    vars.extend([
        ("channel", table.channel()),
        ("table_lock_text", table.ordered_lock_key().to_string()),
        ("table_lock", bigint(table.ordered_lock_key())),
        ("lock_seed", bigint(table.aggregate_lock_seed())),
        ("key_constraint", table.derived("_key")),
        ("status_constraint", table.derived("_status")),
        ("due_idx", table.derived("_due")),
        ("due_idx_qualified", table.companion("_due")),
        ("unordered_idx", table.derived("_unordered")),
        ("unordered_idx_qualified", table.companion("_unordered")),
        ("agg_idx", table.derived("_agg")),
        ("ready_idx", table.derived("_ready")),
        ("ordered_idx", table.derived("_ordered")),
        ("agg_idx_qualified", table.companion("_agg")),
        ("done_idx", table.derived("_done")),
        ("partition_lock", bigint(table.partition_lock_key())),
    ]);
    let mut values = Values::new(&borrowed(&vars))?;
    let rendered = MIGRATIONS
        .iter()
        .map(|migration| values.render(migration.template))
        .collect::<Result<Vec<String>, RenderError>>()?;
    values.finish()?;
    Ok(rendered)
}

/// Renders the function files together, as `render_migrations` the migrations.
fn render_functions(table: &TableName) -> Result<Vec<String>, RenderError> {
    let mut vars = objects(table);
    vars.retain(|(name, _)| !["inbox", "failures", "relays", "consumed"].contains(name));
    let partitions = table.companion("_partitions");
    let look_partitions = render(
        LOOK_PARTITIONS,
        &[
            ("partitions", &partitions),
            ("look_ranges", &LOOK_RANGES.to_string()),
        ],
    )?;
    vars.extend([
        ("channel", table.channel()),
        ("busy_fn", table.companion("_busy")),
        ("key_taken_fn", table.companion("_key_taken")),
        ("keys_taken_fn", table.companion("_keys_taken")),
        ("table_lock_text", table.ordered_lock_key().to_string()),
        ("table_lock", bigint(table.ordered_lock_key())),
        ("lock_seed", bigint(table.aggregate_lock_seed())),
        ("partition_lock", bigint(table.partition_lock_key())),
        ("key_epoch_lock", bigint(table.key_epoch_lock_key())),
        ("schema_prefix", table.schema_prefix()),
        ("name", table.name().to_owned()),
        ("look_partitions", look_partitions.clone()),
        ("look_earlier", look_earlier(table, &look_partitions)),
        ("in_look", in_look()),
        ("from_look", from_look()),
        ("look_in_one_run", LOOK_IN_ONE_RUN.to_owned()),
        ("id_bits", PARTITION_ID_BITS.to_string()),
        ("notify_if_waiting", notify_if_waiting(table)),
        (
            "lock_aggregate",
            render(
                LOCK_AGGREGATE,
                &[
                    ("lock_seed", &bigint(table.aggregate_lock_seed())),
                    ("table_lock", &bigint(table.ordered_lock_key())),
                    ("table_lock_text", &table.ordered_lock_key().to_string()),
                ],
            )?,
        ),
    ]);
    let mut values = Values::new(&borrowed(&vars))?;
    let rendered = FUNCTIONS
        .iter()
        .map(|file| values.render(file.template))
        .collect::<Result<Vec<String>, RenderError>>()?;
    values.finish()?;
    Ok(rendered)
}

/// The DDL script of `Outbox::sql`: the migrations for the table `sql` was rendered for,
/// each run, and recorded, only if `<table>_migrations` does not record it; then the
/// function files, each run only if `<table>_functions` does not record its text.
pub(crate) fn script(
    table: &TableName,
    sql: &MigrateSql,
    partition_interval: Option<Duration>,
) -> String {
    checked(render_script(table, sql, partition_interval))
}

fn render_script(
    table: &TableName,
    sql: &MigrateSql,
    partition_interval: Option<Duration>,
) -> Result<String, RenderError> {
    let schema = Schema::render(table)?;
    let mut ddl = String::new();
    if let Some(create_schema) = &sql.create_schema {
        ddl.push_str(create_schema);
        ddl.push_str(";\n\n");
    }
    ddl.push_str(&sql.migrations_table);
    ddl.push_str(";\n\n");
    ddl.push_str(&schema.forget_squashed);
    ddl.push_str(";\n\n");
    let migrations_table = table.companion("_migrations");
    for (migration, body) in MIGRATIONS.iter().zip(&schema.migrations) {
        let version = migration.version.to_string();
        let record = render(
            RECORD_MIGRATION,
            &[
                ("migrations", &migrations_table),
                ("version", &version),
                ("name", &format!("'{}'", migration.name)),
            ],
        )?;
        ddl.push_str(&render(
            SCRIPT_STEP,
            &[
                ("name", migration.name),
                ("applied", &sql.applied_versions),
                ("version", &version),
                ("body", body),
                ("record", &record),
            ],
        )?);
    }
    ddl.push_str(&schema.functions_table);
    ddl.push_str(";\n\n");
    ddl.push_str(&functions_steps(table, sql, &schema, Form::Any)?);
    if let Some(every) = partition_interval {
        ddl.push_str(&render(
            PARTITIONED_STEP,
            &[
                ("partitions", &table.companion("_partitions")),
                ("table", &table.quoted()),
                ("name", table.as_str()),
                ("body", &render_partitioned(table, every)?),
            ],
        )?);
    }
    ddl.push_str(&functions_steps(table, sql, &schema, Form::Plain)?);
    ddl.push_str(&functions_steps(table, sql, &schema, Form::Partitioned)?);
    Ok(ddl)
}

/// The steps of the script that make the function files of `form`, on a table of that
/// form (found when the script runs) and only where they need it; a table of the other
/// form forgets the files of this one.
fn functions_steps(
    table: &TableName,
    sql: &MigrateSql,
    schema: &Schema,
    form: Form,
) -> Result<String, RenderError> {
    let functions = table.companion("_functions");
    let condition = match form {
        Form::Any => "true".to_owned(),
        Form::Plain => format!("NOT ({})", sql.is_partitioned),
        Form::Partitioned => format!("({})", sql.is_partitioned),
    };
    let mut steps = String::new();
    for (file, body) in FUNCTIONS.iter().zip(&schema.functions) {
        if file.form != form {
            continue;
        }
        let literals = [
            ("functions", functions.as_str()),
            ("name", &format!("'{}'", file.name)),
            ("revision", &file.revision.to_string()),
            ("hash", &format!("'{}'", hash(body))),
        ];
        steps.push_str(&render(
            FUNCTIONS_STEP,
            &[
                ("name", file.name),
                ("form", &condition),
                ("made", &render(MADE, &literals)?),
                ("body", body),
                ("record", &render(RECORD_FUNCTIONS, &literals)?),
            ],
        )?);
    }
    if form != Form::Any {
        let forget = render(
            FORGET_FUNCTIONS,
            &[("functions", &functions), ("names", &names_of(form))],
        )?;
        steps.push_str(&format!(
            "DO $outbox_functions$\nBEGIN\nIF NOT ({condition}) THEN\n{forget};\nEND IF;\n\
             END\n$outbox_functions$;\n\n"
        ));
    }
    Ok(steps)
}

/// The names of the function files of `form`, as an SQL array literal.
fn names_of(form: Form) -> String {
    let names: Vec<String> = FUNCTIONS
        .iter()
        .filter(|file| file.form == form)
        .map(|file| format!("'{}'", file.name))
        .collect();
    format!("ARRAY[{}]", names.join(", "))
}

/// The statements of a migration, and of what an `Outbox` asks of its table itself:
/// its schema, its kind, its channel.
#[derive(Debug)]
pub(crate) struct MigrateSql {
    /// Creates the table's schema, if its name has one.
    pub(crate) create_schema: Option<String>,
    /// Bounds the wait of a migration for its locks, see `MIGRATION_LOCK_TIMEOUT`.
    pub(crate) migration_lock_timeout: String,
    pub(crate) migrations_table: String,
    pub(crate) applied_versions: String,
    pub(crate) record_migration: String,
    /// The channel producers notify on, as the migrations rendered it.
    pub(crate) channel: String,
    /// The schema the table is in, or would be created in, on this connection.
    pub(crate) schema_of: String,
    /// Whether the table is partitioned.
    pub(crate) is_partitioned: String,
}

impl Statements for MigrateSql {
    fn render(table: &TableName) -> Result<Self, RenderError> {
        let vars = shared(table, &["table", "channel_fn", "migrations"])?;
        let mut values = Values::new(&borrowed(&vars))?;
        let statements = MigrateSql {
            create_schema: match table.schema() {
                Some(schema) => Some(render(CREATE_SCHEMA, &[("schema", &quote(schema))])?),
                None => None,
            },
            migration_lock_timeout: render(
                "SET LOCAL lock_timeout = {ms}",
                &[("ms", &MIGRATION_LOCK_TIMEOUT.as_millis().to_string())],
            )?,
            migrations_table: values.render(
                "CREATE TABLE IF NOT EXISTS {migrations} (
                   version    integer     PRIMARY KEY,
                   name       text        NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())",
            )?,
            applied_versions: values.render("SELECT version FROM {migrations}")?,
            record_migration: render(
                RECORD_MIGRATION,
                &[
                    ("migrations", &table.companion("_migrations")),
                    ("version", "$1"),
                    ("name", "$2"),
                ],
            )?,
            channel: values.render("SELECT {channel_fn}()")?,
            schema_of: values.render(
                "SELECT coalesce(
                 (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.oid = to_regclass($1)),
                 current_schema())::text",
            )?,
            // From the catalog, which every role may read.
            is_partitioned: values.render(
                "SELECT coalesce((SELECT relkind = 'p' FROM pg_class
                                  WHERE oid = to_regclass('{table}')), false)",
            )?,
        };
        values.finish()?;
        Ok(statements)
    }
}

/// Records a migration as applied: `{version}` and `{name}` are `$1` and `$2` in the
/// statement, SQL literals in the script of `Outbox::sql`.
pub(crate) const RECORD_MIGRATION: &str =
    "INSERT INTO {migrations} (version, name) VALUES ({version}, {name}) ON CONFLICT DO NOTHING";

const CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS {schema}";

/// How long a migration waits for its locks on the outbox's tables.
pub(crate) const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::render::placeholders;
    use crate::schema::statements::tests::{renders_for_every_table, tables};

    #[test]
    fn every_template_renders_for_every_table() {
        renders_for_every_table::<MigrateSql>();
    }

    #[test]
    fn statements_a_migration_runs_render_as_they_always_did() {
        let qualified = MigrateSql::render(&TableName::parse("app.events").unwrap()).unwrap();
        assert_eq!(
            qualified.create_schema.as_deref(),
            Some("CREATE SCHEMA IF NOT EXISTS \"app\"")
        );
        assert_eq!(
            qualified.migration_lock_timeout,
            "SET LOCAL lock_timeout = 5000"
        );
        assert_eq!(
            qualified.record_migration,
            "INSERT INTO \"app\".\"events_migrations\" (version, name) VALUES ($1, $2) \
             ON CONFLICT DO NOTHING"
        );
        let plain = MigrateSql::render(&TableName::parse("orders").unwrap()).unwrap();
        assert_eq!(plain.create_schema, None);
    }

    #[test]
    fn every_file_renders_for_every_table() {
        for table in tables() {
            let statements = MigrateSql::render(&table).unwrap();
            let schema = Schema::render(&table).unwrap();
            assert_eq!(schema.migrations.len(), MIGRATIONS.len());
            assert_eq!(schema.functions.len(), FUNCTIONS.len());
            let names = MIGRATIONS.iter().map(|migration| migration.name);
            let files = FUNCTIONS.iter().map(|file| file.name);
            let rendered = schema.migrations.iter().chain(&schema.functions);
            for (name, ddl) in names.chain(files).zip(rendered) {
                assert!(
                    placeholders(ddl).is_empty(),
                    "{name} for {}: {:?}",
                    table.as_str(),
                    placeholders(ddl)
                );
            }
            let script = render_script(&table, &statements, None).unwrap();
            assert!(placeholders(&script).is_empty(), "{}", table.as_str());
            for ddl in schema.migrations.iter().chain(&schema.functions) {
                assert!(script.contains(ddl.as_str()));
            }
            let day = Duration::from_secs(24 * 3600);
            // Its rendering is tested in `partitioning`; here, that the script carries it.
            let partitioned = render_partitioned(&table, day).unwrap();
            let script = render_script(&table, &statements, Some(day)).unwrap();
            assert!(script.contains(&partitioned), "{}", table.as_str());
        }
    }

    #[test]
    fn the_partition_width_is_the_one_the_partition_functions_spell_out() {
        let width = format!("width constant bigint := {};", 1_i64 << PARTITION_ID_BITS);
        let spelled = |text: &str| text.matches("width constant bigint :=").count();
        let partitions = FUNCTIONS
            .iter()
            .find(|file| file.name == "partitions")
            .expect("the partitions' functions");
        // The maker, retire and where the ids stand.
        assert_eq!(partitions.template.matches(&width).count(), 3);
        for file in FUNCTIONS {
            let template = file.template;
            assert_eq!(template.matches(&width).count(), spelled(template));
        }
    }

    /// A migration that has shipped runs again nowhere (`<table>_migrations` records it by
    /// version), so what it renders to must never change: these are FNV-1a hashes of each
    /// one's text for two tables. A new migration gets its line here once it ships.
    #[test]
    fn shipped_migrations_render_exactly_as_they_shipped() {
        const SHIPPED: &[(&str, &str, &str)] = &[
            ("0001_create_outbox", "6bd898957c61a736", "23f0358641f8e4c9"),
            ("0002_claim_heads", "345024989bee64e2", "733aa623f6ca2b84"),
            (
                "0003_consumer_failures",
                "fb4b85027f0482eb",
                "a320c35870137bd0",
            ),
            (
                "0004_enqueue_functions",
                "37ab89ac2a884a5b",
                "a34721122649e59a",
            ),
            (
                "0005_aggregate_locks_and_parking",
                "b34fc8f12b5af881",
                "2ce43565f7f3b0c2",
            ),
            (
                "0006_dead_decisions_and_channel",
                "f26b6bfb40e6866a",
                "ddbd10632dac8a0c",
            ),
        ];
        let plain = render_migrations(&TableName::parse("orders_outbox").unwrap()).unwrap();
        let qualified = render_migrations(&TableName::parse("app.events").unwrap()).unwrap();
        for shipped in SHIPPED {
            let i = MIGRATIONS
                .iter()
                .position(|migration| migration.name == shipped.0)
                .unwrap_or_else(|| panic!("the shipped migration {} is gone", shipped.0));
            let rendered = (MIGRATIONS[i].name, hash(&plain[i]), hash(&qualified[i]));
            assert_eq!(
                (rendered.0, rendered.1.as_str(), rendered.2.as_str()),
                *shipped,
                "{} renders differently from what shipped: add a new migration instead",
                shipped.0
            );
        }
    }

    /// A function file is made again where its record is older than its revision, so a
    /// change to what it renders to must come with a new revision (and a new line here):
    /// otherwise tables that recorded the revision before keep their functions as they were,
    /// whenever a process of the previous version migrated last.
    #[test]
    fn function_files_change_only_with_a_new_revision() {
        const REVISIONS: &[(&str, i32, &str, &str)] = &[
            ("notify", 1, "85c98c994ac7b570", "ea7ae2afa2ecc698"),
            ("locks", 1, "bf905854dcdb635b", "b3c22edf51415f53"),
            ("partitions", 1, "c971ed11eb57e220", "64321eae82fbd4c5"),
            ("sequence", 1, "a30442308d969497", "643c96ade25568e0"),
            ("enqueue", 1, "08daa0e4730a9a96", "6c0ce5d87a8177d2"),
            (
                "earlier_producers",
                1,
                "959f2f0332b79da0",
                "e2bb7e2aa18a48fe",
            ),
            (
                "enqueue_partitioned",
                1,
                "f0d4484ba518170c",
                "f88c0ce956514923",
            ),
        ];
        let plain = render_functions(&TableName::parse("orders_outbox").unwrap()).unwrap();
        let qualified = render_functions(&TableName::parse("app.events").unwrap()).unwrap();
        let rendered: Vec<(&str, i32, String, String)> = FUNCTIONS
            .iter()
            .zip(plain.iter().zip(&qualified))
            .map(|(file, (plain, qualified))| {
                (file.name, file.revision, hash(plain), hash(qualified))
            })
            .collect();
        let rendered: Vec<(&str, i32, &str, &str)> = rendered
            .iter()
            .map(|(name, revision, plain, qualified)| {
                (*name, *revision, &plain[..], &qualified[..])
            })
            .collect();
        assert_eq!(rendered, REVISIONS);
    }
}

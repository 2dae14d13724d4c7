//! The README's quickstart runs as written: its code block is `examples/quickstart.rs`, word
//! for word, and this test runs that file, its tables in the test run's own schema (dropped
//! when the tests end), its queue the broker's to delete when its connection closes, and
//! its exchange deleted here once it has run.

mod common;

include!("../examples/quickstart.rs");

#[test]
fn the_readme_quickstart_is_the_example_and_runs() {
    let readme = include_str!("../README.md");
    let example = include_str!("../examples/quickstart.rs");
    assert!(
        readme.contains(&format!("```rust,no_run\n{example}```")),
        "README.md's quickstart is not examples/quickstart.rs word for word"
    );
    std::env::set_var("DATABASE_URL", common::database_url());
    std::env::set_var("AMQP_URL", common::amqp_url());
    let ran = main();
    // The example declares `shop` durable, as an application would; a test run leaves
    // nothing behind, whether the example ran or not.
    common::broker::Broker::new().delete_exchange("shop");
    ran.expect("the quickstart runs");
}

//! The README's quickstart runs as written: its code block is `examples/quickstart.rs`, word
//! for word, and this test runs that file, its tables in the test run's own schema (dropped
//! when the tests end) and its queue the broker's to delete when its connection closes.

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
    main().expect("the quickstart runs");
}

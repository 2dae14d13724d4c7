//! The one way the crate's SQL text is made: templates with `{name}` placeholders, checked.
//!
//! A placeholder is `{`, a name (an ASCII letter or underscore, then letters, digits and
//! underscores) and `}`, with nothing in between. Every other brace is text: the SQL's own
//! array literals (`'{}'`, `'{dead,parked}'`, `'{{1,2},{3,4}}'`) pass through untouched, and
//! there is no escape syntax that could change what existing SQL means. A one-element array
//! literal of a bare word (`'{dead}'`) has the placeholder's shape, so it fails to render
//! unless a value is given for it: give it itself, `("dead", "{dead}")`.
//!
//! Rendering fails when a placeholder has no value, or when a value is used by none of the
//! templates rendered with it (a renamed placeholder whose old value lingers). Values are
//! inserted as they are and never scanned again, so whether a template renders depends on
//! its text and the names given alone, never on the values (the table): rendering each
//! template once, as the tests do, proves it renders for every table.

use std::fmt;

/// A template that does not match the values given for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RenderError {
    /// A placeholder of the template has no value.
    Missing(String),
    /// A value is used by none of the templates rendered with it.
    Unused(String),
    /// A value is given twice, or under a name no placeholder can have.
    BadName(String),
}

impl fmt::Display for RenderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RenderError::Missing(name) => write!(f, "placeholder {{{name}}} has no value"),
            RenderError::Unused(name) => {
                write!(f, "the value for {{{name}}} is used by no template")
            }
            RenderError::BadName(name) => {
                write!(f, "{name:?} is given twice or is not a placeholder name")
            }
        }
    }
}

impl std::error::Error for RenderError {}

/// Renders one template: every placeholder must have a value and every value must be used.
pub(crate) fn render(template: &str, vars: &[(&str, &str)]) -> Result<String, RenderError> {
    let mut values = Values::new(vars)?;
    let text = values.render(template)?;
    values.finish()?;
    Ok(text)
}

/// Values shared by a set of templates (the statements of a table, its migrations): each
/// template must find a value for every placeholder, and [`Values::finish`] checks that every
/// value was used by at least one of them.
pub(crate) struct Values<'a> {
    vars: Vec<(&'a str, &'a str)>,
    used: Vec<bool>,
}

impl<'a> Values<'a> {
    pub(crate) fn new(vars: &[(&'a str, &'a str)]) -> Result<Values<'a>, RenderError> {
        check_names(vars, &[])?;
        Ok(Values {
            vars: vars.to_vec(),
            used: vec![false; vars.len()],
        })
    }

    /// The template with every placeholder replaced by its value.
    pub(crate) fn render(&mut self, template: &str) -> Result<String, RenderError> {
        self.render_with(template, &[])
    }

    /// As [`Values::render`], with values of its own besides the shared ones: `own`, for
    /// one of several renderings of the same template (as `by_ranges` in operations/sql/stats.rs makes, one for
    /// each count of ranges). They need not all be used, and none may share a name with a
    /// shared value.
    pub(crate) fn render_with(
        &mut self,
        template: &str,
        own: &[(&str, &str)],
    ) -> Result<String, RenderError> {
        check_names(own, &self.vars)?;
        let mut out = String::with_capacity(template.len() + template.len() / 4);
        let mut rest = template;
        while let Some((open, name)) = next_placeholder(rest) {
            let value = match own.iter().find(|(n, _)| *n == name) {
                Some((_, value)) => value,
                None => {
                    let i = self
                        .vars
                        .iter()
                        .position(|(n, _)| *n == name)
                        .ok_or_else(|| RenderError::Missing(name.to_owned()))?;
                    self.used[i] = true;
                    self.vars[i].1
                }
            };
            out.push_str(&rest[..open]);
            out.push_str(value);
            rest = &rest[open + name.len() + 2..];
        }
        out.push_str(rest);
        Ok(out)
    }

    /// Fails if a value was used by none of the templates rendered.
    pub(crate) fn finish(self) -> Result<(), RenderError> {
        match self.used.iter().position(|used| !used) {
            Some(i) => Err(RenderError::Unused(self.vars[i].0.to_owned())),
            None => Ok(()),
        }
    }
}

/// Fails on a name of `vars` no placeholder can have, or given twice, there or in `shared`.
fn check_names(vars: &[(&str, &str)], shared: &[(&str, &str)]) -> Result<(), RenderError> {
    for (i, (name, _)) in vars.iter().enumerate() {
        let placeholder_name = !name.is_empty() && name_len(name.as_bytes()) == name.len();
        let twice = vars[..i].iter().chain(shared).any(|(n, _)| n == name);
        if !placeholder_name || twice {
            return Err(RenderError::BadName((*name).to_owned()));
        }
    }
    Ok(())
}

/// The placeholders `text` holds, in order: what a rendered text must no longer have.
#[cfg(test)]
pub(crate) fn placeholders(text: &str) -> Vec<&str> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some((open, name)) = next_placeholder(rest) {
        found.push(name);
        rest = &rest[open + name.len() + 2..];
    }
    found
}

/// Where the first placeholder of `text` opens, and its name. A brace that does not open
/// one is text, so `{{d}}` holds the placeholder `d`.
fn next_placeholder(text: &str) -> Option<(usize, &str)> {
    let mut from = 0;
    while let Some(at) = text[from..].find('{') {
        let open = from + at;
        let after = &text[open + 1..];
        let len = name_len(after.as_bytes());
        if len > 0 && after.as_bytes().get(len) == Some(&b'}') {
            return Some((open, &after[..len]));
        }
        from = open + 1;
    }
    None
}

/// The length of the placeholder name `text` starts with, 0 if it starts with none.
fn name_len(text: &[u8]) -> usize {
    match text.first() {
        Some(c) if c.is_ascii_alphabetic() || *c == b'_' => text
            .iter()
            .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_')
            .count(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_placeholder_is_replaced_once_and_values_are_not_scanned_again() {
        let text = render(
            "SELECT {a} FROM {table} WHERE x = {a}",
            &[("a", "{table}"), ("table", "\"t\"")],
        )
        .unwrap();
        assert_eq!(text, "SELECT {table} FROM \"t\" WHERE x = {table}");
    }

    #[test]
    fn braces_that_are_not_placeholders_are_text() {
        let sql = "SELECT '{}'::text[], '{dead,parked}', '{{1,2},{3,4}}', '{ x }', '{1}', \
                   '{x-y}', '{', '}', {t}{";
        let text = render(sql, &[("t", "T")]).unwrap();
        assert_eq!(
            text,
            "SELECT '{}'::text[], '{dead,parked}', '{{1,2},{3,4}}', '{ x }', '{1}', \
             '{x-y}', '{', '}', T{"
        );
    }

    #[test]
    fn placeholders_are_found_where_render_would_replace_them() {
        assert_eq!(
            placeholders("{a} '{}' {b}{c} '{x,y}' {{d}} {e"),
            ["a", "b", "c", "d"]
        );
    }

    #[test]
    fn a_placeholder_without_a_value_fails() {
        let err = render("SELECT * FROM {tabel}", &[("table", "t")]).unwrap_err();
        assert_eq!(err, RenderError::Missing("tabel".into()));
        assert_eq!(err.to_string(), "placeholder {tabel} has no value");
        // A bare word in braces has a placeholder's shape, whatever its case.
        let err = render("SELECT '{Dead}'::text[]", &[]).unwrap_err();
        assert_eq!(err, RenderError::Missing("Dead".into()));
        // ...and renders when it is given as its own value.
        let text = render("SELECT '{dead}'::text[]", &[("dead", "{dead}")]).unwrap();
        assert_eq!(text, "SELECT '{dead}'::text[]");
    }

    #[test]
    fn a_value_no_template_uses_fails() {
        let err = render("SELECT 1", &[("table", "t")]).unwrap_err();
        assert_eq!(err, RenderError::Unused("table".into()));

        let mut values = Values::new(&[("a", "1"), ("b", "2")]).unwrap();
        assert_eq!(values.render("{a}").unwrap(), "1");
        assert_eq!(values.render("{a}{a}").unwrap(), "11");
        assert_eq!(
            values.finish().unwrap_err(),
            RenderError::Unused("b".into())
        );

        let mut values = Values::new(&[("a", "1"), ("b", "2")]).unwrap();
        values.render("{a}").unwrap();
        values.render("{b}").unwrap();
        values.finish().unwrap();
    }

    #[test]
    fn values_of_one_rendering_go_beside_the_shared_ones() {
        let mut values = Values::new(&[("table", "t"), ("unused", "u")]).unwrap();
        let template = "SELECT {table} WHERE {range}";
        for range in ["a", "b"] {
            let text = values
                .render_with(template, &[("range", range), ("other", "o")])
                .unwrap();
            assert_eq!(text, format!("SELECT t WHERE {range}"));
        }
        // Own values are not scanned again, and are for that rendering alone.
        let text = values.render_with("{r}", &[("r", "{table}")]).unwrap();
        assert_eq!(text, "{table}");
        assert_eq!(
            values.render("{range}").unwrap_err(),
            RenderError::Missing("range".into())
        );
        // None may take a shared value's name, nor be given twice.
        for own in [
            &[("table", "x")][..],
            &[("r", "1"), ("r", "2")],
            &[("1r", "1")],
        ] {
            assert!(
                matches!(values.render_with("{r}", own), Err(RenderError::BadName(_))),
                "{own:?}"
            );
        }
        // Shared values still have to be used by some template; own ones need not be.
        assert_eq!(
            values.finish().unwrap_err(),
            RenderError::Unused("unused".into())
        );
    }

    #[test]
    fn names_must_be_unique_placeholder_names() {
        for vars in [
            &[("a", "1"), ("a", "2")][..],
            &[("", "1")],
            &[("1a", "1")],
            &[("a b", "1")],
            &[("{a}", "1")],
        ] {
            assert!(
                matches!(Values::new(vars), Err(RenderError::BadName(_))),
                "{vars:?}"
            );
        }
    }
}

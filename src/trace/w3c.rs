//! The grammar of W3C Trace Context (<https://www.w3.org/TR/trace-context/>): what a
//! producer may put in `traceparent` and `tracestate`. A malformed value would be dropped or
//! misread by every service downstream; it is refused at enqueue instead.

use crate::error::{Error, Result};

/// The length of a version-00 `traceparent`, and of the part every version starts with.
const TRACEPARENT_LEN: usize = 55;

/// A `tracestate` holds at most this many list members.
const MAX_MEMBERS: usize = 32;

/// The longest `tracestate` accepted: the spec asks every vendor to pass on at least this
/// much, and lets them cut a longer one.
pub(crate) const MAX_TRACESTATE: usize = 512;

/// The parts of a valid `traceparent`, as hex text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TraceParent<'a> {
    pub(crate) trace_id: &'a str,
    // Read by the RabbitMQ spans (trace/spans.rs), which build a remote span context of them.
    #[cfg_attr(
        not(all(feature = "opentelemetry", feature = "rabbitmq")),
        allow(dead_code)
    )]
    pub(crate) parent_id: &'a str,
    #[cfg_attr(
        not(all(feature = "opentelemetry", feature = "rabbitmq")),
        allow(dead_code)
    )]
    pub(crate) flags: &'a str,
}

/// Parses a `traceparent`: `version-traceid-parentid-flags`, all lowercase hex. A version
/// after 00 may carry more after a further `-`, which is ignored, as the spec asks.
pub(crate) fn parse_traceparent(value: &str) -> Result<TraceParent<'_>> {
    let bad = |why: &str| Error::invalid("traceparent", format!("{why} (got {value:?})"));
    if value.len() < TRACEPARENT_LEN || !value.is_char_boundary(TRACEPARENT_LEN) {
        return Err(bad("must be version-traceid-parentid-flags, 55 characters"));
    }
    let (head, rest) = value.split_at(TRACEPARENT_LEN);
    let parts: Vec<&str> = head.split('-').collect();
    let [version, trace_id, parent_id, flags] = parts[..] else {
        return Err(bad("must be version-traceid-parentid-flags"));
    };
    let sizes = [(version, 2), (trace_id, 32), (parent_id, 16), (flags, 2)];
    if sizes
        .iter()
        .any(|&(part, len)| part.len() != len || !lower_hex(part))
    {
        return Err(bad(
            "must be 2, 32, 16 and 2 lowercase hex digits, separated by '-'",
        ));
    }
    match version {
        "ff" => return Err(bad("version ff is invalid")),
        "00" if !rest.is_empty() => return Err(bad("version 00 is exactly 55 characters")),
        _ if !rest.is_empty() && !rest.starts_with('-') => {
            return Err(bad("a later version continues only after a '-'"))
        }
        _ => {}
    }
    if all_zero(trace_id) {
        return Err(bad("the trace id must not be all zeros"));
    }
    if all_zero(parent_id) {
        return Err(bad("the parent id must not be all zeros"));
    }
    Ok(TraceParent {
        trace_id,
        parent_id,
        flags,
    })
}

/// Checks a `tracestate`: comma-separated `key=value` members (empty ones allowed), at most
/// 32 of them with distinct keys, at most 512 characters in all.
pub(crate) fn check_tracestate(value: &str) -> Result<()> {
    let bad = |why: String| Error::invalid("tracestate", why);
    if value.len() > MAX_TRACESTATE {
        return Err(bad(format!(
            "is {} bytes; at most {MAX_TRACESTATE} are accepted",
            value.len()
        )));
    }
    let mut keys: Vec<&str> = Vec::new();
    for member in value.split(',') {
        let member = member.trim_matches(|c| c == ' ' || c == '\t');
        if member.is_empty() {
            continue;
        }
        let Some((key, val)) = member.split_once('=') else {
            return Err(bad(format!("member {member:?} is not key=value")));
        };
        if !valid_key(key) {
            return Err(bad(format!(
                "key {key:?} is not a W3C tracestate key (lowercase letters, digits, _-*/, \
                 optionally tenant@system)"
            )));
        }
        if !valid_value(val) {
            return Err(bad(format!(
                "the value of {key:?} must be 1 to 256 printable ASCII characters without \
                 ',' or '='"
            )));
        }
        if keys.contains(&key) {
            return Err(bad(format!("key {key:?} appears twice")));
        }
        keys.push(key);
    }
    if keys.len() > MAX_MEMBERS {
        return Err(bad(format!(
            "has {} members; at most {MAX_MEMBERS} are allowed",
            keys.len()
        )));
    }
    Ok(())
}

fn lower_hex(s: &str) -> bool {
    s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn all_zero(s: &str) -> bool {
    s.bytes().all(|b| b == b'0')
}

fn key_char(b: u8) -> bool {
    matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'*' | b'/')
}

/// `simple-key` (a lowercase letter, then up to 255 key characters) or `multi-tenant-key`
/// (`tenant@system`: a letter or digit and up to 240 more, then a letter and up to 13 more).
fn valid_key(key: &str) -> bool {
    let starts = |s: &str, digit_ok: bool| {
        s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || (digit_ok && b.is_ascii_digit()))
    };
    let rest_ok = |s: &str| s.bytes().all(key_char);
    match key.split_once('@') {
        None => starts(key, false) && key.len() <= 256 && rest_ok(key),
        Some((tenant, system)) => {
            starts(tenant, true)
                && tenant.len() <= 241
                && rest_ok(tenant)
                && starts(system, false)
                && system.len() <= 14
                && rest_ok(system)
        }
    }
}

/// Up to 256 characters of 0x20-0x7E except ',' and '=' (the member is trimmed already,
/// so the last is not a space, as the grammar asks).
fn valid_value(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 256
        && value
            .bytes()
            .all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_specs_example_traceparent_parses() {
        let parsed = parse_traceparent(GOOD).unwrap();
        assert_eq!(parsed.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parsed.parent_id, "00f067aa0ba902b7");
        assert_eq!(parsed.flags, "01");
        // A later version may carry more after a '-'.
        assert!(parse_traceparent(&format!("01{}-what-comes-next", &GOOD[2..])).is_ok());
        assert!(parse_traceparent(&format!("cc{}", &GOOD[2..])).is_ok());
    }

    #[test]
    fn malformed_traceparents_are_refused() {
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            &GOOD.to_uppercase(),
            &format!("ff{}", &GOOD[2..]),
            &format!("{GOOD}-extra"),
            &format!("{GOOD}0"),
            &format!("01{}x", &GOOD[2..]),
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-é",
        ];
        for value in bad {
            assert!(parse_traceparent(value).is_err(), "{value:?}");
        }
    }

    #[test]
    fn tracestate_follows_the_list_grammar() {
        for good in [
            "",
            "rojo=00f067aa0ba902b7",
            "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
            "rojo=1 , ,\tcongo=2",
            "0tenant@vendor=x",
            "a*/_-=v a l",
        ] {
            assert!(check_tracestate(good).is_ok(), "{good:?}");
        }
        let too_many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        let long = format!("k={}", "v".repeat(MAX_TRACESTATE));
        for bad in [
            "rojo",
            "Rojo=1",
            "1abc=1",
            "rojo=",
            "rojo=a=b",
            "rojo=a\tb",
            "rojo=1,rojo=2",
            "tenant@Vendor=1",
            "tenant@systemnameistoolong=1",
            "rojo=caf\u{e9}",
            &too_many.join(","),
            &long,
        ] {
            assert!(check_tracestate(bad).is_err(), "{bad:?}");
        }
        let exactly_32: Vec<String> = (0..32).map(|i| format!("k{i}=v")).collect();
        assert!(check_tracestate(&exactly_32.join(",")).is_ok());
    }
}

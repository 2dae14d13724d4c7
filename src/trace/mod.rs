//! W3C Trace Context carried as message headers: checked at enqueue, read back by publishers
//! and handlers, and (feature `opentelemetry`) captured from and reported to OpenTelemetry.

#[cfg(feature = "opentelemetry")]
pub(crate) mod otel;
#[cfg(all(feature = "opentelemetry", feature = "rabbitmq"))]
pub(crate) mod spans;
pub(crate) mod w3c;

/// The header that carries the W3C `traceparent`.
pub const TRACEPARENT: &str = "traceparent";
/// The header that carries the W3C `tracestate`.
pub const TRACESTATE: &str = "tracestate";

/// The value of header `name`, if present.
pub(crate) fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

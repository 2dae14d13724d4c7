//! A message as AMQP carries it, as far as enqueue must know to refuse what no broker would
//! take: the headers the relay adds, and the one frame all of a message's properties travel
//! in. (No AMQP crate here: the core builds without one.)

/// The header carrying the message's attempt number (1 on the first try).
pub const ATTEMPT_HEADER: &str = "x-outbox-attempt";

/// The header carrying the aggregate key, when the message has one.
pub const AGGREGATE_HEADER: &str = "x-outbox-aggregate-key";

/// The header carrying the message's place in its aggregate's publication sequence, when
/// the outbox gives places (`OutboxBuilder::sequence`): an integer, 1 for an aggregate's
/// first message.
pub const SEQUENCE_HEADER: &str = "x-outbox-sequence";

/// The frame size RabbitMQ offers by default (`frame_max`). A message's properties travel in
/// one frame, so properties larger than that make the broker close the channel.
pub(crate) const FRAME_MAX: usize = 131_072;

/// What the content header frame carries besides the properties: class, weight, body size
/// and property flags, with room to spare.
const HEADER_FRAME_OVERHEAD: usize = 64;

/// About how many bytes a message's properties take on the wire: each header is a name
/// (length byte and bytes), a type byte and a long string (four length bytes and bytes),
/// with the relay's own headers; then the message id, the content type and the fixed
/// properties.
pub(crate) fn properties_size(
    key: &str,
    content_type: Option<&str>,
    aggregate_key: Option<&str>,
    headers: &[(String, String)],
) -> usize {
    let header = |name: usize, value: usize| 1 + name + 1 + 4 + value;
    let given: usize = headers
        .iter()
        .map(|(name, value)| header(name.len(), value.len()))
        .sum();
    // A place comes only with an aggregate.
    let ours = header(ATTEMPT_HEADER.len(), 8)
        + aggregate_key.map_or(0, |a| {
            header(AGGREGATE_HEADER.len(), a.len()) + header(SEQUENCE_HEADER.len(), 8)
        });
    let fixed = 1 + key.len() + content_type.map_or(0, |c| 1 + c.len()) + 16;
    4 + given + ours + fixed
}

/// Whether properties of this size fit in one frame.
pub(crate) fn fits_one_frame(properties: usize) -> bool {
    properties + HEADER_FRAME_OVERHEAD <= FRAME_MAX
}

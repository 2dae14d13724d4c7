//! A confirmed, pipelined RabbitMQ publisher.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, UNIX_EPOCH};

use amiquip::{
    AmqpProperties, AmqpValue, Channel, Confirm, ConfirmPayload, Connection,
    ConnectionBlockedNotification, FieldTable, Publish, Return,
};
use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use super::connect::{close_within, Endpoint, Endpoints};
use super::error::Error;
use super::publisher_config::PublisherConfig;
use crate::producer::message::MAX_SHORT_STRING;
use crate::publish::publisher::{PublishError, Publisher};
use crate::publish::record::Record;
use crate::runtime::wire::{
    fits_one_frame, properties_size, AGGREGATE_HEADER, ATTEMPT_HEADER, FRAME_MAX, SEQUENCE_HEADER,
};

/// How long closing a connection may take before it is left to finish in the background.
const CLOSE_BOUND: Duration = Duration::from_secs(2);

/// Publishes records to a RabbitMQ exchange with publisher confirms.
///
/// Each batch is published in full, then its confirms are drained, so one round trip's wait
/// covers the whole batch; a batch in order ([`Publisher::publish_in_order`]) streams, each
/// aggregate's next record published as soon as its predecessor is confirmed. A record
/// counts as sent only once the broker has confirmed it and has not returned it as
/// unroutable ([`mandatory`](PublisherConfig::mandatory), on by default).
///
/// **Whose fault.** A nack of a record, or its return as unroutable, is that record's failed
/// attempt; a record the broker could never take (over 255 bytes in a short string, a body
/// over [`max_message_size`](PublisherConfig::max_message_size)) fails permanently. Anything
/// else is the broker's or the network's doing and reported as
/// [`PublishError::unavailable`], which costs no attempt: a channel or connection closed
/// under the batch (the exchange deleted, access revoked), confirms that never come, and a
/// connection the broker blocks during a resource alarm (`connection.blocked`). While
/// blocked it publishes nothing and says so at once; once unblocked it first waits for the
/// confirms still owed, then goes on.
///
/// Messages are persistent; the routing key is the topic, the message id the record's key,
/// the timestamp its enqueue time; the record's headers travel as AMQP headers, plus
/// `x-outbox-aggregate-key` when set, `x-outbox-sequence` when the record has a place in its
/// aggregate's sequence ([`Record::sequence`]) and `x-outbox-attempt` (the attempt, 1 for
/// the first), as the wire format consumers read. [`first_attempt_header(false)`](PublisherConfig::first_attempt_header)
/// leaves the header off first attempts, so a message with no other header carries no
/// header table, which the broker reads for every message that has one (see
/// BENCHMARKS.md).
///
/// ```no_run
/// use postgres_outbox::rabbitmq::{PublisherConfig, RabbitPublisher};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // The defaults:
/// let publisher = RabbitPublisher::connect("amqp://guest:guest@localhost:5672", "events")?;
/// // Anything else, through its config:
/// let tuned = PublisherConfig::new("amqp://guest:guest@localhost:5672", "events")?
///     .confirm_timeout(std::time::Duration::from_secs(5))
///     .connect()?;
/// # let _ = (publisher, tuned);
/// # Ok(())
/// # }
/// ```
pub struct RabbitPublisher {
    endpoints: Endpoints,
    /// Which of `endpoints` the connection is to.
    at: usize,
    endpoint: Endpoint,
    exchange: String,
    mandatory: bool,
    /// Whether a first attempt carries `x-outbox-attempt: 1` too.
    first_attempt_header: bool,
    confirm_timeout: Duration,
    max_message_size: usize,
    /// `None` only while being closed.
    connection: Option<Connection>,
    /// `None` only while being closed: it goes with the connection, as closing it may wait.
    channel: Option<Channel>,
    /// Set when the broker closed the channel for a message over its size limit and a new
    /// channel took its place: the records in flight on the old one were not confirmed.
    resized: bool,
    confirms: Receiver<Confirm>,
    returns: Receiver<Return>,
    /// The broker's `connection.blocked` and `connection.unblocked` notifications; it
    /// disconnects once the connection's I/O thread has ended (the connection is lost).
    blocking: Receiver<ConnectionBlockedNotification>,
    /// Notifications read by `is_broken`, which looks through a shared reference, and not yet
    /// taken note of.
    notes: Mutex<Vec<ConnectionBlockedNotification>>,
    /// The broker's reason, while it blocks this connection.
    blocked: Option<String>,
    /// Tags published before the broker blocked the connection, whose confirms were not
    /// waited for: settled before anything else is published, so their returns are not
    /// taken for a later batch's.
    owed: BTreeMap<u64, ()>,
    /// The delivery tag the next publish gets; tags start at 1 on every channel.
    next_tag: u64,
    /// Why the connection cannot be used again, once it cannot.
    broken: Option<String>,
}

impl fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("endpoint", &self.endpoint)
            .field("exchange", &self.exchange)
            .field("mandatory", &self.mandatory)
            .field("blocked", &self.blocked)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl RabbitPublisher {
    /// Connects with the default settings: the shorthand for
    /// `PublisherConfig::new(url, exchange)?.connect()` (see [`PublisherConfig`], the one
    /// place to configure a publisher, and [`PublisherConfig::connect`]).
    pub fn connect(url: &str, exchange: &str) -> Result<RabbitPublisher, Error> {
        PublisherConfig::new(url, exchange)?.connect()
    }

    /// Connects as `config` says (see [`PublisherConfig::connect`]).
    pub(super) fn open(config: &PublisherConfig) -> Result<RabbitPublisher, Error> {
        let (endpoints, exchange) = (&config.endpoints, config.exchange.as_str());
        if exchange.len() > MAX_SHORT_STRING {
            return Err(Error::InvalidName(format!(
                "exchange name is {} bytes; at most {MAX_SHORT_STRING}",
                exchange.len()
            )));
        }
        let (mut connection, at) = endpoints.open()?;
        let endpoint = endpoints.get(at).clone();
        if !exchange.is_empty() {
            // A failed passive declare closes its channel, so it gets one of its own.
            let checked = connection
                .open_channel(None)
                .and_then(|probe| probe.exchange_declare_passive(exchange).map(drop));
            if let Err(e) = checked {
                close_within(connection, None, CLOSE_BOUND);
                return Err(Error::broker(
                    format!("exchange {exchange:?} cannot be published to on {endpoint}"),
                    e,
                ));
            }
        }
        let opened = (|| {
            let blocking = connection.listen_for_connection_blocked()?;
            let (channel, confirms, returns) = confirming_channel(&mut connection)?;
            Ok::<_, amiquip::Error>((channel, confirms, returns, blocking))
        })();
        let (channel, confirms, returns, blocking) = match opened {
            Ok(parts) => parts,
            Err(e) => {
                close_within(connection, None, CLOSE_BOUND);
                return Err(Error::broker("cannot open a confirming channel", e));
            }
        };
        log::debug!("rabbitmq publisher connected to {endpoint}");
        Ok(RabbitPublisher {
            endpoints: endpoints.clone(),
            at,
            endpoint,
            exchange: exchange.to_owned(),
            mandatory: config.mandatory,
            first_attempt_header: config.first_attempt_header,
            confirm_timeout: config.confirm_timeout,
            max_message_size: config.max_message_size,
            connection: Some(connection),
            resized: false,
            channel: Some(channel),
            confirms,
            returns,
            blocking,
            notes: Mutex::new(Vec::new()),
            blocked: None,
            owed: BTreeMap::new(),
            next_tag: 1,
            broken: None,
        })
    }

    /// Closes the connection, waiting at most two seconds.
    pub fn close(mut self) {
        self.let_go();
    }

    /// Closes the channel and the connection on a thread of their own, waiting at most two
    /// seconds: a connection the broker blocks never answers a channel's close.
    fn let_go(&mut self) {
        if let Some(connection) = self.connection.take() {
            close_within(connection, self.channel.take(), CLOSE_BOUND);
        }
    }

    fn properties(&self, record: &Record) -> AmqpProperties {
        let mut headers: FieldTable = BTreeMap::new();
        for (name, value) in &record.headers {
            headers.insert(name.clone(), AmqpValue::LongString(value.clone()));
        }
        if record.attempt > 1 || self.first_attempt_header {
            headers.insert(
                ATTEMPT_HEADER.to_owned(),
                AmqpValue::LongLongInt(i64::from(record.attempt)),
            );
        }
        if let Some(aggregate) = &record.aggregate_key {
            headers.insert(
                AGGREGATE_HEADER.to_owned(),
                AmqpValue::LongString(aggregate.clone()),
            );
        }
        if let Some(place) = record.sequence {
            headers.insert(SEQUENCE_HEADER.to_owned(), AmqpValue::LongLongInt(place));
        }
        let timestamp = record
            .created_at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut properties = AmqpProperties::default()
            .with_delivery_mode(2)
            .with_message_id(record.key.clone())
            .with_timestamp(timestamp);
        if !headers.is_empty() {
            properties = properties.with_headers(headers);
        }
        if let Some(content_type) = &record.content_type {
            properties = properties.with_content_type(content_type.clone());
        }
        properties
    }

    /// Why nothing can be published now, if nothing can: the connection is broken, the
    /// broker blocks it, or confirms owed from before a block do not come.
    fn unavailable(&mut self) -> Option<String> {
        self.read_notes();
        if self.broken.is_none() && self.blocked.is_none() && !self.owed.is_empty() {
            self.settle_owed();
        }
        (self.broken.is_some() || self.blocked.is_some()).then(|| self.not_confirmed())
    }

    /// Takes note of the block notifications received so far, and of a connection lost.
    fn read_notes(&mut self) {
        let gone = self.lost();
        let notes = std::mem::take(self.notes.get_mut().unwrap_or_else(|e| e.into_inner()));
        for notification in notes {
            self.note(notification);
        }
        if gone && self.broken.is_none() {
            let why = format!("the connection to {} was lost", self.endpoint);
            log::warn!("rabbitmq: {why}");
            self.break_off(why);
        }
    }

    /// Moves the notifications received into `notes`; true once the connection's I/O thread
    /// has ended.
    fn lost(&self) -> bool {
        let mut notes = self.notes.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match self.blocking.try_recv() {
                Ok(notification) => notes.push(notification),
                Err(TryRecvError::Empty) => return false,
                Err(TryRecvError::Disconnected) => return true,
            }
        }
    }

    fn note(&mut self, notification: ConnectionBlockedNotification) {
        match notification {
            ConnectionBlockedNotification::Blocked(reason) => {
                log::warn!("rabbitmq: {} blocks publishing: {reason}", self.endpoint);
                self.blocked = Some(reason);
            }
            ConnectionBlockedNotification::Unblocked => {
                log::info!("rabbitmq: {} takes messages again", self.endpoint);
                self.blocked = None;
            }
        }
    }

    /// Waits for the confirms owed from before a block; then drops the returns received
    /// meanwhile, which belong to those publishes (a return arrives before its confirm).
    fn settle_owed(&mut self) {
        let mut owed = std::mem::take(&mut self.owed);
        self.await_confirms(&mut owed, &mut |_, _| {});
        if owed.is_empty() {
            while self.returns.try_recv().is_ok() {}
        } else {
            self.owed = owed;
        }
    }

    /// Waits for the confirms of `tags` (delivery tag to what it stands for), calling
    /// `settle` with what each confirmed tag stands for and its outcome, until none is left,
    /// the connection fails (broken), or the confirm timeout passes: broken, unless the
    /// broker blocks the connection, when the tags are owed.
    fn await_confirms<V>(
        &mut self,
        tags: &mut BTreeMap<u64, V>,
        settle: &mut dyn FnMut(V, Result<(), &'static str>),
    ) {
        let deadline = crate::runtime::clock::deadline(self.confirm_timeout);
        while !tags.is_empty() {
            // A plain wait: a hot aggregate waits here once per message, and a select over
            // the block notifications and a timer cost a fifth of its rate. Whether the
            // broker blocks the connection only matters once the confirms are late.
            match self.confirms.recv_deadline(deadline) {
                Ok(confirm) => {
                    let (payload, outcome) = confirmed(confirm);
                    for settled in settle_tags(tags, payload) {
                        settle(settled, outcome);
                    }
                }
                Err(failed) => {
                    let unconfirmed = std::mem::take(tags);
                    self.confirms_failed(failed, unconfirmed.into_keys());
                    return;
                }
            }
        }
    }

    /// No confirm came for the `unconfirmed` tags: the channel closed (broken), or the
    /// confirm timeout passed (broken, unless the broker blocks the connection: then the
    /// tags are owed).
    fn confirms_failed(
        &mut self,
        failed: RecvTimeoutError,
        unconfirmed: impl Iterator<Item = u64>,
    ) {
        let why = match failed {
            RecvTimeoutError::Disconnected => match self.why_closed() {
                Closed::Oversize(limit) if self.reopen(limit) => return,
                Closed::Oversize(limit) => format!(
                    "{} closed the channel for a message over its limit of {limit} bytes, and \
                     no new channel could be opened",
                    self.endpoint
                ),
                Closed::Why(why) => why,
            },
            RecvTimeoutError::Timeout => {
                self.read_notes();
                if self.blocked.is_some() {
                    // The confirms come once the broker unblocks the connection.
                    self.owed.extend(unconfirmed.map(|tag| (tag, ())));
                    return;
                }
                format!(
                    "no confirm from {} within {:?}; reconnecting",
                    self.endpoint, self.confirm_timeout
                )
            }
        };
        log::warn!("rabbitmq: {why}");
        self.break_off(why);
    }

    /// Publishes one record under the next delivery tag: `Ok(true)` once handed to the
    /// connection, `Ok(false)` if the connection failed (now broken), `Err` for a record
    /// the broker could never take (never sent).
    fn send(&mut self, record: &Record) -> Result<bool, PublishError> {
        check_limits(record, self.max_message_size)?;
        let publish = Publish {
            body: &record.payload,
            routing_key: record.topic.clone(),
            mandatory: self.mandatory,
            immediate: false,
            properties: self.properties(record),
        };
        let published = match &self.channel {
            Some(channel) => channel.basic_publish(self.exchange.as_str(), publish),
            None => Err(amiquip::Error::ClientClosedChannel),
        };
        if let Err(e) = published {
            let why = format!("publishing to {} failed: {e}", self.endpoint);
            log::warn!("rabbitmq: {why}; reconnecting");
            self.break_off(why);
            return Ok(false);
        }
        self.next_tag += 1;
        Ok(true)
    }

    /// Why records handed over have no confirm: the connection failed, or the broker
    /// blocks it.
    fn not_confirmed(&self) -> String {
        self.broken.clone().unwrap_or_else(|| match &self.blocked {
            Some(reason) => format!("the broker blocks publishing ({reason})"),
            None => "not confirmed".to_owned(),
        })
    }

    /// Gives the connection up: this publisher is broken, and the next connection to these
    /// endpoints starts at the one after it.
    fn break_off(&mut self, why: String) {
        self.broken = Some(why);
        self.endpoints.lost(self.at);
    }

    /// Why the channel closed. On a closed channel amiquip answers a passive declare at once
    /// with the broker's reason (a missing exchange, refused access, a message over the size
    /// limit) without sending anything; only called once the channel is known to be closed.
    fn why_closed(&self) -> Closed {
        let probe = if self.exchange.is_empty() {
            "amq.direct"
        } else {
            &self.exchange
        };
        let checked = match &self.channel {
            Some(channel) => channel.exchange_declare_passive(probe).map(drop),
            None => Err(amiquip::Error::ClientClosedChannel),
        };
        match checked {
            Err(e) => match size_limit(&e) {
                Some(limit) => Closed::Oversize(limit),
                None => Closed::Why(format!("the channel to {} was closed: {e}", self.endpoint)),
            },
            Ok(_) => Closed::Why(format!("the connection to {} was lost", self.endpoint)),
        }
    }

    /// The broker closed the channel because a message was larger than `limit`, its
    /// `max_message_size`: that message's own fault, not an outage. Remembers the limit
    /// (such a record now fails permanently before it is sent) and opens a new channel on
    /// the same connection. False if none could be opened (the publisher is then broken).
    fn reopen(&mut self, limit: usize) -> bool {
        if limit >= self.max_message_size {
            // A record within the limit known was refused: not a size this can learn.
            return false;
        }
        log::warn!(
            "rabbitmq: {} refused a message over its max_message_size of {limit} bytes; larger \
             ones now fail permanently before they are sent",
            self.endpoint
        );
        self.max_message_size = self.max_message_size.min(limit);
        let Some(connection) = self.connection.as_mut() else {
            return false;
        };
        match confirming_channel(connection) {
            Ok((channel, confirms, returns)) => {
                // The closed channel's close needs no answer.
                self.channel = Some(channel);
                self.confirms = confirms;
                self.returns = returns;
                // Tags start again at 1 on the new channel; the old one's mean nothing.
                self.next_tag = 1;
                self.owed.clear();
                self.resized = true;
                true
            }
            Err(e) => {
                log::warn!(
                    "rabbitmq: cannot open a new channel on {}: {e}",
                    self.endpoint
                );
                false
            }
        }
    }
}

/// Why a channel closed.
enum Closed {
    /// The broker refused a message larger than this many bytes.
    Oversize(usize),
    Why(String),
}

/// The size limit a broker gave as its reason for closing a channel (RabbitMQ: `406
/// PRECONDITION_FAILED - message size 2097152 is larger than configured max size 1048576`).
fn size_limit(error: &amiquip::Error) -> Option<usize> {
    match error {
        amiquip::Error::ServerClosedChannel {
            code: 406, message, ..
        } => {
            let (_, rest) = message.split_once("larger than configured max size ")?;
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        }
        _ => None,
    }
}

/// A channel that confirms, with its confirms and returns listened to.
fn confirming_channel(
    connection: &mut Connection,
) -> Result<(Channel, Receiver<Confirm>, Receiver<Return>), amiquip::Error> {
    let channel = connection.open_channel(None)?;
    // Listen first: confirms that arrive before anyone listens are dropped.
    let confirms = channel.listen_for_publisher_confirms()?;
    let returns = channel.listen_for_returns()?;
    channel.enable_publisher_confirms()?;
    Ok((channel, confirms, returns))
}

/// A confirm's payload, and the outcome it gives the messages it covers.
fn confirmed(confirm: Confirm) -> (ConfirmPayload, Result<(), &'static str>) {
    match confirm {
        Confirm::Ack(payload) => (payload, Ok(())),
        Confirm::Nack(payload) => (payload, Err("the broker nacked the message")),
    }
}

/// Takes out of `tags` the ones a confirm covers (its own, or with `multiple` every one up
/// to it), and returns what they stand for, in tag order.
fn settle_tags<V>(tags: &mut BTreeMap<u64, V>, payload: ConfirmPayload) -> Vec<V> {
    if !payload.multiple {
        return tags.remove(&payload.delivery_tag).into_iter().collect();
    }
    let after = match payload.delivery_tag.checked_add(1) {
        Some(after) => tags.split_off(&after),
        None => BTreeMap::new(),
    };
    std::mem::replace(tags, after).into_values().collect()
}

/// A returned message's key (its message id), and why it is a failed attempt.
fn unroutable(returned: &Return) -> (Option<&str>, String) {
    (
        returned.properties.message_id().as_deref(),
        format!(
            "unroutable: returned by the broker ({} {})",
            returned.reply_code, returned.reply_text
        ),
    )
}

/// A batch streamed in order: which record follows which in its aggregate, and which are
/// handed over and not yet confirmed.
struct Stream<'b> {
    /// The first record of every aggregate, and every record without a key.
    firsts: Vec<usize>,
    /// The record after each one in its aggregate.
    next: Vec<Option<usize>>,
    /// The delivery tag of every record handed over and not yet confirmed, to the record.
    unconfirmed: BTreeMap<u64, usize>,
    /// Key to record, for the same.
    by_key: HashMap<&'b str, usize>,
    /// Records in flight the broker returned as unroutable, with its reason.
    returned: HashMap<usize, String>,
    batch: &'b [Record],
}

impl<'b> Stream<'b> {
    fn new(batch: &'b [Record]) -> Stream<'b> {
        let mut firsts = Vec::new();
        let mut next = vec![None; batch.len()];
        let mut last: HashMap<&str, usize> = HashMap::new();
        for (i, record) in batch.iter().enumerate() {
            match &record.aggregate_key {
                None => firsts.push(i),
                Some(aggregate) => match last.insert(aggregate, i) {
                    Some(before) => next[before] = Some(i),
                    None => firsts.push(i),
                },
            }
        }
        Stream {
            firsts,
            next,
            unconfirmed: BTreeMap::new(),
            by_key: HashMap::new(),
            returned: HashMap::new(),
            batch,
        }
    }

    /// Forgets what was in flight on a channel that closed, and returns those records, to
    /// be handed over again, in batch order.
    fn restart(&mut self) -> Vec<usize> {
        let mut again: Vec<usize> = std::mem::take(&mut self.unconfirmed)
            .into_values()
            .collect();
        again.sort_unstable();
        self.by_key.clear();
        self.returned.clear();
        again
    }

    fn sent(&mut self, tag: u64, i: usize) {
        self.unconfirmed.insert(tag, i);
        self.by_key.insert(self.batch[i].key.as_str(), i);
    }

    fn returned(&mut self, returned: &Return) {
        let (key, why) = unroutable(returned);
        if let Some(&i) = key.and_then(|key| self.by_key.get(key)) {
            self.returned.insert(i, why);
        }
    }

    /// The records a confirm settles (its tag's, or with `multiple` every one up to it), and
    /// their outcomes.
    fn settle(&mut self, confirm: Confirm) -> Vec<(usize, Result<(), PublishError>)> {
        let (payload, outcome) = confirmed(confirm);
        settle_tags(&mut self.unconfirmed, payload)
            .into_iter()
            .map(|i| {
                self.by_key.remove(self.batch[i].key.as_str());
                let result = match (outcome, self.returned.remove(&i)) {
                    (Err(nack), _) => Err(PublishError::transient(nack)),
                    (Ok(()), Some(why)) => Err(PublishError::transient(why)),
                    (Ok(()), None) => Ok(()),
                };
                (i, result)
            })
            .collect()
    }
}

/// Checks what the broker would refuse by closing the channel (or the whole connection),
/// failing every other record of the batch with it: short strings over 255 bytes, a body over
/// `max_body` bytes, properties too large for one frame. Such a record can never be sent, so
/// it fails permanently, alone.
fn check_limits(record: &Record, max_body: usize) -> Result<(), PublishError> {
    let mut fields = vec![
        ("topic", record.topic.as_str()),
        ("key", record.key.as_str()),
    ];
    if let Some(content_type) = &record.content_type {
        fields.push(("content type", content_type));
    }
    fields.extend(
        record
            .headers
            .iter()
            .map(|(name, _)| ("header name", name.as_str())),
    );
    for (field, value) in fields {
        if value.len() > MAX_SHORT_STRING {
            return Err(PublishError::permanent(format!(
                "{field} is {} bytes; AMQP carries at most {MAX_SHORT_STRING}",
                value.len()
            )));
        }
    }
    if record.payload.len() > max_body {
        return Err(PublishError::permanent(format!(
            "the body is {} bytes; the broker takes at most {max_body}",
            record.payload.len()
        )));
    }
    let properties = properties_size(
        &record.key,
        record.content_type.as_deref(),
        record.aggregate_key.as_deref(),
        &record.headers,
    );
    if !fits_one_frame(properties) {
        return Err(PublishError::permanent(format!(
            "the properties and headers take about {properties} bytes; one AMQP frame \
             carries at most {FRAME_MAX}"
        )));
    }
    Ok(())
}

impl PublisherConfig {
    /// A publisher with these settings: connects to the first endpoint that answers and
    /// opens a confirming channel. The exchange must already exist: a missing one (or one
    /// this user may not see) is an error here, at once, rather than a failure of every
    /// publish. Once the publisher's connection is lost (it then reports itself broken, and
    /// the relay builds a new one), the next connection starts at the endpoint after it.
    pub fn connect(&self) -> Result<RabbitPublisher, Error> {
        RabbitPublisher::open(self)
    }
}

impl Publisher for RabbitPublisher {
    fn publish(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        #[cfg(feature = "opentelemetry")]
        let span = crate::trace::spans::publish_span(&self.exchange, batch);
        let results = self.publish_pipelined(batch);
        #[cfg(feature = "opentelemetry")]
        crate::trace::spans::end_publish(span, results.iter().filter(|r| r.is_err()).count());
        results
    }

    /// Broken once a failure said so, or once the connection's I/O thread has ended (a
    /// connection lost while nothing was published on it).
    fn is_broken(&self) -> bool {
        self.broken.is_some() || self.lost()
    }

    /// One channel: the broker puts each queue's messages in the order they were published.
    fn keeps_order(&self) -> bool {
        true
    }

    fn publish_in_order(
        &mut self,
        batch: &[Record],
        outcomes: &mut [Option<Result<(), PublishError>>],
        proceed: &dyn Fn() -> bool,
    ) {
        #[cfg(feature = "opentelemetry")]
        let span = crate::trace::spans::publish_span(&self.exchange, batch);
        self.stream(batch, outcomes, proceed);
        #[cfg(feature = "opentelemetry")]
        crate::trace::spans::end_publish(
            span,
            outcomes
                .iter()
                .filter(|o| !matches!(o, Some(Ok(()))))
                .count(),
        );
    }
}

impl RabbitPublisher {
    /// [`Publisher::publish`]: every record of the batch goes out at once, then the
    /// confirms are awaited.
    fn publish_pipelined(&mut self, batch: &[Record]) -> Vec<Result<(), PublishError>> {
        if let Some(why) = self.unavailable() {
            return batch
                .iter()
                .map(|_| Err(PublishError::unavailable(why.clone())))
                .collect();
        }
        let mut results: Vec<Option<Result<(), PublishError>>> = Vec::with_capacity(batch.len());
        results.resize_with(batch.len(), || None);
        // Delivery tag to record, for every record handed over.
        let mut index = BTreeMap::new();
        let mut by_key = HashMap::with_capacity(batch.len());
        for (i, record) in batch.iter().enumerate() {
            if let Err(e) = check_limits(record, self.max_message_size) {
                results[i] = Some(Err(e));
                continue;
            }
            if !self.send(record).unwrap_or(true) {
                break;
            }
            index.insert(self.next_tag - 1, i);
            by_key.insert(record.key.as_str(), i);
        }
        self.await_confirms(&mut index, &mut |i, outcome| {
            results[i] = Some(outcome.map_err(PublishError::transient));
        });
        // The broker returns an unroutable mandatory message before it acks it, and amiquip
        // hands both over in the order they arrived, so every return for this batch is queued
        // by now.
        while let Ok(returned) = self.returns.try_recv() {
            let (key, why) = unroutable(&returned);
            if let Some(&i) = key.and_then(|key| by_key.get(key)) {
                results[i] = Some(Err(PublishError::transient(why)));
            }
        }
        if std::mem::take(&mut self.resized) {
            // A record over the limit closed the channel under the others: it now fails
            // alone, before it is sent, and they go again on the new channel.
            let again: Vec<usize> = (0..batch.len()).filter(|&i| results[i].is_none()).collect();
            let records: Vec<Record> = again.iter().map(|&i| batch[i].clone()).collect();
            for (i, result) in again.into_iter().zip(self.publish_pipelined(&records)) {
                results[i] = Some(result);
            }
        }
        // Not confirmed: the connection failed, or the broker blocks it. Not the records'
        // fault either way.
        let why = self.not_confirmed();
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(PublishError::unavailable(why.clone()))))
            .collect()
    }

    /// [`Publisher::publish_in_order`]. Streams: the first record of every aggregate (and every record without a key) goes
    /// out at once, and each aggregate's next one as soon as the broker confirms the one
    /// before it, so no aggregate waits for another's confirm.
    fn stream(
        &mut self,
        batch: &[Record],
        outcomes: &mut [Option<Result<(), PublishError>>],
        proceed: &dyn Fn() -> bool,
    ) {
        if let Some(why) = self.unavailable() {
            for outcome in outcomes.iter_mut() {
                *outcome = Some(Err(PublishError::unavailable(why.clone())));
            }
            return;
        }
        let mut stream = Stream::new(batch);
        let mut due = std::mem::take(&mut stream.firsts);
        let mut handing_over = true;
        loop {
            if handing_over {
                self.read_notes();
                for i in due.drain(..) {
                    if self.broken.is_some() || self.blocked.is_some() || !proceed() {
                        handing_over = false;
                        break;
                    }
                    match self.send(&batch[i]) {
                        Ok(true) => stream.sent(self.next_tag - 1, i),
                        Ok(false) => break,
                        Err(e) => outcomes[i] = Some(Err(e)),
                    }
                }
            }
            if stream.unconfirmed.is_empty() {
                break;
            }
            // The confirm timeout bounds the wait for the next confirm: a stream that
            // keeps being confirmed may take longer as a whole.
            match self
                .confirms
                .recv_deadline(crate::runtime::clock::deadline(self.confirm_timeout))
            {
                Ok(confirm) => {
                    // A return comes before the confirm of its message.
                    while let Ok(returned) = self.returns.try_recv() {
                        stream.returned(&returned);
                    }
                    for (i, result) in stream.settle(confirm) {
                        if result.is_ok() {
                            due.extend(stream.next[i]);
                        }
                        outcomes[i] = Some(result);
                    }
                }
                Err(failed) => {
                    self.confirms_failed(failed, stream.unconfirmed.keys().copied());
                    if !std::mem::take(&mut self.resized) {
                        break;
                    }
                    // A record over the limit closed the channel: what was in flight goes
                    // again on the new one, each record still its aggregate's next, and the
                    // one too large fails alone when it is sent.
                    due.extend(stream.restart());
                    handing_over = true;
                }
            }
        }
        // Not confirmed: the connection failed, or the broker blocks it. Not the records'
        // fault either way.
        let why = self.not_confirmed();
        for &i in stream.unconfirmed.values() {
            outcomes[i] = Some(Err(PublishError::unavailable(why.clone())));
        }
    }
}

impl Drop for RabbitPublisher {
    fn drop(&mut self) {
        self.let_go();
    }
}

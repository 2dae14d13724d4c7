//! The consumer's broker side: one thread owns the connection and its channel, receives
//! deliveries, hands them to the workers one aggregate at a time, acks what committed,
//! schedules retries and dead-letters what failed for good.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amiquip::{
    Channel, Connection, ConnectionBlockedNotification, ConsumerMessage, ConsumerOptions,
};
use crossbeam_channel::{after, at, never, select, Receiver, Sender};

use super::blocks::{note_block, read_blocks};
use super::dead_letter::{DeadLetterQueue, Death, Refused};
use super::delivery::{view, Delivery};
use super::lanes::{Lanes, Tag};
use super::shared::Shared;
use super::succession::Succession;
use super::worker::{Done, Job, Outcome, Task};
use crate::error::describe;
use crate::rabbitmq::connect::Endpoints;
use crate::rabbitmq::deadline::{Closed, Cutter};
use crate::runtime::retry::reconnect_delay;

/// The longest a committed delivery's ack is held back to go out with others.
const ACK_DELAY: Duration = Duration::from_millis(5);
/// The longest a call on the broker connection may wait for its answer (opening a channel,
/// a declare) before the connection is cut. A broker that answers at all does so in
/// milliseconds; one that does not within this is not reading the connection.
const BROKER_BOUND: Duration = Duration::from_secs(5);
/// The longest a cancel, or closing the connection and its channels, may take before the
/// connection is cut.
const CLOSE_BOUND: Duration = Duration::from_secs(2);

/// Why one connection's consuming ended.
enum Ended {
    Stopped,
    Lost(String),
}

/// A delivery received and not yet settled.
struct Held {
    raw: amiquip::Delivery,
    view: Arc<Delivery>,
    suspect: bool,
    /// Given up on, its dead letter not yet stored: the dead-letter queue refused it, and
    /// it is tried again (never the handler) after a backoff.
    dying: Option<Dying>,
}

struct Dying {
    reason: String,
    failures: u32,
    /// Refused this many times so far.
    refusals: u32,
    /// Its dead letter is stored; a worker records that before the original is acked.
    stored: bool,
}

/// What one channel holds.
struct Link<'c> {
    connection: &'c mut Connection,
    /// Bounds every call on the connection.
    cutter: &'c Cutter,
    channel: &'c Channel,
    /// The dead-letter queue's channel, when there is one and it is open (after a refusal
    /// that broke it, it is opened again at the next try).
    dead_letters: Option<DeadLetterQueue>,
    held: HashMap<Tag, Held>,
    lanes: Lanes,
    cancelled: Arc<AtomicBool>,
    /// Told to stop: settle what runs, start nothing.
    stopping: bool,
    /// Why the broker does not read the connection now, while it does not (a resource
    /// alarm): no dead letter is published, no channel opened, no cancel sent meanwhile.
    blocked: Option<String>,
    /// The broker's notices that it stops reading the connection (once it has published a
    /// dead letter during a resource alarm) and reads it again; `None` once the
    /// connection's I/O thread has ended.
    blocking: Option<Receiver<ConnectionBlockedNotification>>,
    /// Dead-letter channels given up while the broker did not read the connection: closing
    /// one waits for the broker's answer, so they close with the connection.
    retired: Vec<DeadLetterQueue>,
    /// Committed deliveries whose ack has not gone out yet, and when it must.
    acks: Vec<amiquip::Delivery>,
    ack_by: Option<Instant>,
}

pub(super) struct Dispatcher {
    shared: Arc<Shared>,
    endpoints: Endpoints,
    tasks: Sender<Task>,
    results: Receiver<Done>,
    /// Counts channels, so a result from a lost one is known for what it is.
    generation: u64,
    /// Jobs handed to workers and not yet reported back, from any channel.
    in_flight: usize,
    /// The last connection got as far as consuming.
    consuming: bool,
    /// How the last connection ended, for the next one to consume behind it.
    succession: Succession,
}

impl Dispatcher {
    pub(super) fn new(
        shared: Arc<Shared>,
        endpoints: Endpoints,
        tasks: Sender<Task>,
        results: Receiver<Done>,
    ) -> Dispatcher {
        Dispatcher {
            shared,
            endpoints,
            tasks,
            results,
            generation: 0,
            in_flight: 0,
            consuming: false,
            succession: Succession::default(),
        }
    }

    /// Consumes, reconnecting with backoff, until told to stop; then waits for the jobs
    /// still running and returns, which tells the workers to end.
    pub(super) fn run(mut self) {
        let mut losses = 0u32;
        loop {
            self.consuming = false;
            match self.consume() {
                Ended::Stopped => break,
                Ended::Lost(why) => {
                    // The backoff grows only while reconnecting keeps failing.
                    if self.consuming {
                        losses = 0;
                    }
                    losses += 1;
                    let pause = reconnect_delay(losses);
                    log::warn!(
                        "rabbitmq consumer {}: {why}; reconnecting in {pause:?}",
                        self.shared.config.name
                    );
                    let resume = after(pause);
                    // Results of the lost channel still come in meanwhile; once every worker
                    // has gone (they only end by panicking) there are none to wait for.
                    let mut results = self.results.clone();
                    let stopped = loop {
                        select! {
                            recv(self.shared.stop.receiver()) -> _ => break true,
                            recv(resume) -> _ => break false,
                            recv(results) -> done => match done {
                                Ok(done) => self.stale(done),
                                Err(_) => results = never(),
                            },
                        }
                    };
                    if stopped {
                        break;
                    }
                }
            }
        }
        // Results still owed, from a channel that is gone; not past the shutdown's deadline.
        let deadline = self.shared.stop_deadline();
        while self.in_flight > 0 {
            match self.results.recv_deadline(deadline) {
                Ok(done) => self.stale(done),
                Err(_) => break,
            }
        }
    }

    /// Consumes on one connection until told to stop or the connection fails.
    fn consume(&mut self) -> Ended {
        let (mut connection, at, socket) = match self.endpoints.open_cuttable() {
            Ok(opened) => opened,
            Err(e) => return Ended::Lost(e.to_string()),
        };
        let cutter = Cutter::new(socket);
        let ended = self.consume_on(&mut connection, &cutter);
        if let Ended::Lost(_) = ended {
            // The next connection starts at the endpoint after this one.
            self.endpoints.lost(at);
        }
        // Closing hands every delivery not acked back to the queue, once the broker has
        // closed the connection on its side; until it says so, it may still hold them.
        self.succession
            .closed(cutter.close(connection, CLOSE_BOUND) == Closed::Confirmed);
        ended
    }

    fn consume_on(&mut self, connection: &mut Connection, cutter: &Cutter) -> Ended {
        let shared = self.shared.clone();
        let config = &shared.config;
        let blocking = match connection.listen_for_connection_blocked() {
            Ok(notices) => notices,
            Err(e) => return Ended::Lost(format!("cannot listen for blocks: {e}")),
        };
        let dead_letters = match &config.dead_letter_queue {
            Some(queue) => match cutter.within(BROKER_BOUND, || {
                DeadLetterQueue::open(connection, queue, config.dead_letter_queue_type)
            }) {
                Ok(d) => Some(d),
                Err(e) => return Ended::Lost(format!("dead-letter queue {queue:?}: {e}")),
            },
            None => None,
        };
        let channel = match cutter.within(BROKER_BOUND, || connection.open_channel(None)) {
            Ok(channel) => channel,
            Err(e) => return Ended::Lost(format!("cannot open a channel: {e}")),
        };
        if let Err(e) = cutter.within(BROKER_BOUND, || channel.qos(0, config.prefetch, false)) {
            return Ended::Lost(format!("cannot set prefetch: {e}"));
        }
        let queue =
            match self
                .succession
                .await_old_consumer(&channel, cutter, &self.shared, BROKER_BOUND)
            {
                Ok(Some(queue)) => queue,
                Ok(None) => return Ended::Stopped,
                Err(why) => return Ended::Lost(why),
            };
        let consumer =
            match cutter.within(BROKER_BOUND, || queue.consume(ConsumerOptions::default())) {
                Ok(c) => c,
                Err(e) => return Ended::Lost(format!("cannot consume: {e}")),
            };
        log::info!(
            "rabbitmq consumer {}: consuming {} with {} workers",
            config.name,
            config.queue,
            config.concurrency
        );
        self.generation += 1;
        self.consuming = true;
        let mut link = Link {
            connection,
            cutter,
            channel: &channel,
            dead_letters,
            held: HashMap::new(),
            lanes: Lanes::default(),
            cancelled: Arc::new(AtomicBool::new(false)),
            stopping: false,
            blocked: None,
            blocking: Some(blocking),
            retired: Vec::new(),
            acks: Vec::new(),
            ack_by: None,
        };
        // Acks go out in groups: one frame for many deliveries costs the broker and the
        // connection's I/O thread far less than a frame each. A group goes when it is a
        // quarter of the prefetch, so the broker is never starved of credit, or after
        // ACK_DELAY. Deferring an ack is safe: the delivery has committed, and a redelivery
        // after a crash meanwhile is acked as a duplicate.
        let ack_group = usize::from(config.prefetch / 4).max(1);
        let ended = loop {
            let retry = match link.lanes.next_retry() {
                Some(when) => at(when),
                None => never(),
            };
            let flush = match link.ack_by {
                Some(when) => at(when),
                None => never(),
            };
            let blocking = link.blocking.clone().unwrap_or_else(never);
            let step = select! {
                recv(self.shared.stop.receiver()) -> _ => {
                    // A blocked connection is not read: a cancel would wait for the alarm
                    // to clear. Deliveries that come meanwhile are not started; they go
                    // back with the channel.
                    read_blocks(&link.blocking, &mut link.blocked, &config.name);
                    if link.blocked.is_none() {
                        let _ = cutter.within(CLOSE_BOUND, || consumer.cancel());
                    }
                    break self.drain(&mut link);
                }
                recv(blocking) -> notice => {
                    match notice {
                        Ok(notice) => note_block(&mut link.blocked, notice, &config.name),
                        // The connection's I/O thread has ended: the consumer's channel
                        // says why.
                        Err(_) => link.blocking = None,
                    }
                    Ok(())
                }
                recv(consumer.receiver()) -> message => match message {
                    Ok(ConsumerMessage::Delivery(delivery)) => self.arrive(&mut link, delivery),
                    Ok(other) => Err(format!("consumer ended: {other:?}")),
                    Err(_) => Err("consumer channel closed".into()),
                },
                recv(self.results) -> done => match done {
                    Ok(done) => self.settle(&mut link, done),
                    Err(_) => Err("every worker has ended".into()),
                },
                recv(retry) -> _ => link
                    .lanes
                    .due(Instant::now())
                    .into_iter()
                    .try_for_each(|tag| self.start(&mut link, tag)),
                recv(flush) -> _ => Self::flush_acks(&mut link),
            };
            let step = step.and_then(|()| {
                if link.acks.len() >= ack_group {
                    Self::flush_acks(&mut link)
                } else {
                    Ok(())
                }
            });
            if let Err(why) = step {
                break Ended::Lost(why);
            }
        };
        // Whatever is still held goes back to the queue with the channel; a job waiting
        // out a database outage need not wait for a channel that is gone.
        link.cancelled.store(true, Ordering::SeqCst);
        read_blocks(&link.blocking, &mut link.blocked, &config.name);
        let Link {
            dead_letters,
            blocked,
            retired,
            ..
        } = link;
        // Dropping the consumer cancels it and dropping a channel closes it, each waiting
        // for the broker's answer, which a blocked connection never gets: cut it first.
        if blocked.is_some() || !retired.is_empty() {
            cutter.cut();
        }
        cutter.within(CLOSE_BOUND, || drop(consumer));
        cutter.within(CLOSE_BOUND, || {
            drop(retired);
            drop(dead_letters);
            drop(channel);
        });
        ended
    }

    /// Told to stop: nothing new starts; the jobs running finish and are settled (acked
    /// when committed) until the shutdown's deadline; the rest goes back to the queue when
    /// the channel closes, right after, even if a handler still runs (it cannot be
    /// interrupted: its delivery comes again, and if it committed, is acked as a duplicate).
    fn drain(&mut self, link: &mut Link<'_>) -> Ended {
        link.stopping = true;
        let deadline = at(self.shared.stop_deadline());
        while self.in_flight > 0 {
            select! {
                recv(self.results) -> done => match done {
                    Ok(done) => {
                        if let Err(why) = self.settle(link, done) {
                            return Ended::Lost(why);
                        }
                    }
                    Err(_) => break,
                },
                recv(deadline) -> _ => {
                    log::warn!(
                        "rabbitmq consumer {}: {} handlers still running at the shutdown \
                         deadline; what the consumer holds goes back to the queue",
                        self.shared.config.name,
                        self.in_flight
                    );
                    break;
                },
            }
        }
        match Self::flush_acks(link) {
            Ok(()) => Ended::Stopped,
            Err(why) => Ended::Lost(why),
        }
    }

    /// Sends the acks held back: one `multiple` ack for every delivery below the oldest
    /// one still unsettled, and single acks for the rest.
    fn flush_acks(link: &mut Link<'_>) -> Result<(), String> {
        link.ack_by = None;
        if link.acks.is_empty() {
            return Ok(());
        }
        let floor = link.held.keys().min().copied().unwrap_or(Tag::MAX);
        let mut below = std::mem::take(&mut link.acks);
        below.sort_unstable_by_key(|d| d.delivery_tag());
        let above = below.split_off(below.partition_point(|d| d.delivery_tag() < floor));
        let failed = |e: amiquip::Error| format!("cannot ack: {e}");
        if let Some(last) = below.pop() {
            last.ack_multiple(link.channel).map_err(failed)?;
        }
        for delivery in above {
            delivery.ack(link.channel).map_err(failed)?;
        }
        Ok(())
    }

    fn arrive(&mut self, link: &mut Link<'_>, mut raw: amiquip::Delivery) -> Result<(), String> {
        let tag = raw.delivery_tag();
        let view = view(&mut raw);
        // Without a message id there is nothing to deduplicate on: it cannot be handled
        // exactly once, and the handler never sees it.
        let dying = view.key.is_empty().then(|| Dying {
            reason: "the message has no usable message id (none, or not UTF-8)".to_owned(),
            failures: 0,
            refusals: 0,
            stored: false,
        });
        let aggregate = view.aggregate_key.clone();
        let suspect = raw.redelivered;
        link.held.insert(
            tag,
            Held {
                raw,
                view: Arc::new(view),
                suspect,
                dying,
            },
        );
        if link.lanes.arrive(tag, aggregate.as_deref()) {
            self.start(link, tag)?;
        }
        Ok(())
    }

    /// Hands a held delivery to a worker, or, if it was given up on, tries its dead letter
    /// again.
    fn start(&mut self, link: &mut Link<'_>, tag: Tag) -> Result<(), String> {
        if link.stopping {
            return Ok(());
        }
        let Some(held) = link.held.get(&tag) else {
            return Ok(());
        };
        if held.dying.is_some() {
            return self.bury(link, tag);
        }
        let job = Job {
            tag,
            generation: self.generation,
            delivery: held.view.clone(),
            suspect: held.suspect,
            cancelled: link.cancelled.clone(),
        };
        if self.tasks.send(Task::Handle(job)).is_ok() {
            self.in_flight += 1;
        }
        Ok(())
    }

    /// A result from a channel that is gone: counted, never acked (the broker delivers the
    /// message again, and a committed one is then acked as a duplicate).
    fn stale(&mut self, done: Done) {
        self.in_flight -= 1;
        self.count(&done.outcome, None);
    }

    fn settle(&mut self, link: &mut Link<'_>, done: Done) -> Result<(), String> {
        if done.generation != self.generation {
            self.stale(done);
            return Ok(());
        }
        self.in_flight -= 1;
        let Some(held) = link.held.get_mut(&done.tag) else {
            return Ok(());
        };
        held.suspect |= matches!(done.outcome, Outcome::Failed { .. });
        let view = held.view.clone();
        self.count(&done.outcome, Some(&view));
        let shared = self.shared.clone();
        let config = &shared.config;
        let aggregate = view.aggregate_key.as_deref();
        match done.outcome {
            Outcome::Committed(_) | Outcome::Duplicate => {
                if let Some(held) = link.held.remove(&done.tag) {
                    link.acks.push(held.raw);
                    link.ack_by
                        .get_or_insert_with(|| Instant::now() + ACK_DELAY);
                }
                // The effects are committed, so the next of the aggregate may start before
                // the ack goes out: a redelivery of this one would be a duplicate.
                self.advance(link, done.tag, aggregate)?;
            }
            Outcome::Failed {
                error,
                failures,
                dead: true,
            } => {
                if let Some(held) = link.held.get_mut(&done.tag) {
                    held.dying = Some(Dying {
                        reason: describe(&error),
                        failures,
                        refusals: 0,
                        stored: false,
                    });
                }
                self.bury(link, done.tag)?;
            }
            Outcome::Failed {
                error, failures, ..
            } => {
                shared.counters.retried.fetch_add(1, Ordering::SeqCst);
                let delay = config.retry.delay(failures);
                log::warn!(
                    "rabbitmq consumer {}: handler failed on {} (failure {failures} of {}); \
                     retrying in {delay:?}: {}",
                    config.name,
                    view.key,
                    config.retry.max_attempts,
                    describe(&error)
                );
                if !link.stopping {
                    link.lanes.retry_at(done.tag, Instant::now() + delay);
                }
            }
            Outcome::Buried => {
                let recorded = held_dying(link, done.tag).is_some_and(|dying| dying.stored);
                if recorded {
                    return self.finish_burial(link, done.tag);
                }
                // A redelivery of a message whose dead letter is stored: its ack was lost.
                if let Some(held) = link.held.remove(&done.tag) {
                    log::debug!(
                        "rabbitmq consumer {}: {} was dead-lettered before; acking it",
                        config.name,
                        view.key
                    );
                    shared.counters.duplicates.fetch_add(1, Ordering::SeqCst);
                    shared.observe(|m| m.duplicate(&view));
                    link.acks.push(held.raw);
                    link.ack_by
                        .get_or_insert_with(|| Instant::now() + ACK_DELAY);
                }
                self.advance(link, done.tag, aggregate)?;
            }
            // Only when stopping: it goes back to the queue with the channel.
            Outcome::Abandoned => {}
        }
        Ok(())
    }

    /// Counters and metrics for a job's outcome; `view` is `None` for a stale one.
    fn count(&self, outcome: &Outcome, view: Option<&Delivery>) {
        let counters = &self.shared.counters;
        match outcome {
            Outcome::Committed(took) => {
                counters.processed.fetch_add(1, Ordering::SeqCst);
                if let Some(view) = view {
                    self.shared.observe(|m| m.handled(view, *took));
                }
            }
            Outcome::Duplicate => {
                counters.duplicates.fetch_add(1, Ordering::SeqCst);
                if let Some(view) = view {
                    log::debug!(
                        "rabbitmq consumer {}: duplicate {}",
                        self.shared.config.name,
                        view.key
                    );
                    self.shared.observe(|m| m.duplicate(view));
                }
            }
            Outcome::Failed { error, .. } => {
                if let Some(view) = view {
                    self.shared.observe(|m| m.failed(view, error));
                }
            }
            // Counted by `settle`, which knows what it stands for.
            Outcome::Buried | Outcome::Abandoned => {}
        }
    }

    /// A delivery is settled: the next of its aggregate may start. After a dead letter,
    /// called only once it has gone out, so a channel lost meanwhile cannot let the next one
    /// commit ahead of a redelivery of this one.
    fn advance(
        &mut self,
        link: &mut Link<'_>,
        tag: Tag,
        aggregate: Option<&str>,
    ) -> Result<(), String> {
        match link.lanes.settle(tag, aggregate) {
            Some(next) => self.start(link, next),
            None => Ok(()),
        }
    }

    /// Gives up on a held, dying delivery: its dead letter goes to the dead-letter queue
    /// (confirmed) and then the delivery is acked, or it is rejected to the queue's own
    /// dead-letter exchange. A dead-letter queue that refuses it (full, gone, its channel
    /// closed, confirms that do not come) is that queue's outage, not the message's doing:
    /// the delivery stays held, its lane with it, and the dead letter is tried again after
    /// a backoff; the handler never runs again. Only a lost channel ends consuming.
    fn bury(&mut self, link: &mut Link<'_>, tag: Tag) -> Result<(), String> {
        let shared = self.shared.clone();
        let config = &shared.config;
        let Some(held) = link.held.get_mut(&tag) else {
            return Ok(());
        };
        let Some(dying) = held.dying.as_mut().filter(|dying| !dying.stored) else {
            return Ok(());
        };
        let key = held.view.key.clone();
        read_blocks(&link.blocking, &mut link.blocked, &config.name);
        let refused = match &config.dead_letter_queue {
            Some(name) => {
                if link.dead_letters.is_none() && link.blocked.is_none() {
                    let queue_type = config.dead_letter_queue_type;
                    let connection = &mut *link.connection;
                    link.dead_letters = link
                        .cutter
                        .within(BROKER_BOUND, || {
                            DeadLetterQueue::open(connection, name, queue_type)
                        })
                        .map_err(|e| log::debug!("dead-letter queue {name:?}: {e}"))
                        .ok();
                }
                let death = Death {
                    reason: &dying.reason,
                    failures: dying.failures,
                    consumer: &config.name,
                    queue: &config.queue,
                };
                match (&link.blocked, &link.dead_letters) {
                    (Some(reason), _) => Some(Refused::Declined(format!(
                        "the broker does not read this connection now ({reason})"
                    ))),
                    (None, Some(queue)) => queue
                        .publish(&held.raw.properties, &held.view.body, &death)
                        .err(),
                    (None, None) => Some(Refused::Broken(format!(
                        "cannot open a channel to dead-letter queue {name:?}"
                    ))),
                }
            }
            None => None,
        };
        if let Some(refused) = refused {
            let why = match refused {
                Refused::Declined(why) => why,
                Refused::Broken(why) => {
                    // Its confirm may be what the broker, not reading the connection, is
                    // holding back: then closing it would wait as long.
                    read_blocks(&link.blocking, &mut link.blocked, &config.name);
                    if let Some(broken) = link.dead_letters.take() {
                        if link.blocked.is_some() {
                            link.retired.push(broken);
                        } else {
                            link.cutter.within(CLOSE_BOUND, || drop(broken));
                        }
                    }
                    why
                }
            };
            dying.refusals += 1;
            let pause = reconnect_delay(dying.refusals);
            log::warn!(
                "rabbitmq consumer {}: cannot store the dead letter of {key:?}; holding it \
                 (its handler does not run again) and trying again in {pause:?}: {why}",
                config.name
            );
            link.lanes.retry_at(tag, Instant::now() + pause);
            return Ok(());
        }
        // A message with a failure count has a row to record the stored dead letter in:
        // recorded before the ack, a redelivery after a lost ack is acked, not buried twice.
        if config.dead_letter_queue.is_some() && dying.failures > 0 {
            dying.stored = true;
            let job = Job {
                tag,
                generation: self.generation,
                delivery: held.view.clone(),
                suspect: true,
                cancelled: link.cancelled.clone(),
            };
            if self.tasks.send(Task::Bury(job)).is_ok() {
                self.in_flight += 1;
            }
            return Ok(());
        }
        self.finish_burial(link, tag)
    }

    /// Settles a delivery whose dead letter is stored (acked), or that goes to the queue's
    /// dead-letter exchange (rejected).
    fn finish_burial(&mut self, link: &mut Link<'_>, tag: Tag) -> Result<(), String> {
        let shared = self.shared.clone();
        let config = &shared.config;
        let Some(held) = link.held.remove(&tag) else {
            return Ok(());
        };
        let Some(dying) = held.dying else {
            return Ok(());
        };
        let key = &held.view.key;
        if config.dead_letter_queue.is_some() {
            held.raw
                .ack(link.channel)
                .map_err(|e| format!("cannot ack: {e}"))?;
        } else {
            held.raw
                .reject(link.channel, false)
                .map_err(|e| format!("cannot reject: {e}"))?;
            if dying.failures > 0 {
                let _ = self.tasks.send(Task::Forget(key.clone()));
            }
        }
        log::error!(
            "rabbitmq consumer {}: dead-lettered {key:?} after {} failures: {}",
            config.name,
            dying.failures,
            dying.reason
        );
        shared.counters.rejected.fetch_add(1, Ordering::SeqCst);
        shared.observe(|m| m.dead_lettered(&held.view));
        self.advance(link, tag, held.view.aggregate_key.as_deref())
    }
}

fn held_dying<'a>(link: &'a Link<'_>, tag: Tag) -> Option<&'a Dying> {
    link.held.get(&tag).and_then(|held| held.dying.as_ref())
}

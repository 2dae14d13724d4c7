//! The consumer's broker side: one thread owns the connection and its channel, receives
//! deliveries, hands them to the workers one aggregate at a time, acks what committed,
//! schedules retries and dead-letters what failed for good.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amiquip::{Channel, Connection, ConsumerMessage, ConsumerOptions};
use crossbeam_channel::{after, at, never, select, Receiver, Sender};

use super::dead_letter::{DeadLetterQueue, Death};
use super::lanes::{Lanes, Tag};
use super::worker::{Done, Job, Outcome, Task};
use super::{view, Delivery, Shared};
use crate::rabbitmq::connect::{close_within, Endpoint};
use crate::retry::{reconnect_delay, RetryPolicy};

/// The longest a committed delivery's ack is held back to go out with others.
const ACK_DELAY: Duration = Duration::from_millis(5);

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
}

/// What one channel holds.
struct Link<'c> {
    channel: &'c Channel,
    dead_letters: Option<DeadLetterQueue>,
    held: HashMap<Tag, Held>,
    lanes: Lanes,
    cancelled: Arc<AtomicBool>,
    /// Told to stop: settle what runs, start nothing.
    stopping: bool,
    /// Committed deliveries whose ack has not gone out yet, and when it must.
    acks: Vec<amiquip::Delivery>,
    ack_by: Option<Instant>,
}

pub(super) struct Dispatcher {
    shared: Arc<Shared>,
    endpoint: Endpoint,
    tasks: Sender<Task>,
    results: Receiver<Done>,
    /// Disconnected when the consumer is told to stop.
    stop: Receiver<()>,
    /// Counts channels, so a result from a lost one is known for what it is.
    generation: u64,
    /// Jobs handed to workers and not yet reported back, from any channel.
    in_flight: usize,
    /// The last connection got as far as consuming.
    consuming: bool,
}

impl Dispatcher {
    pub(super) fn new(
        shared: Arc<Shared>,
        endpoint: Endpoint,
        tasks: Sender<Task>,
        results: Receiver<Done>,
        stop: Receiver<()>,
    ) -> Dispatcher {
        Dispatcher {
            shared,
            endpoint,
            tasks,
            results,
            stop,
            generation: 0,
            in_flight: 0,
            consuming: false,
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
                            recv(self.stop) -> _ => break true,
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
        while self.in_flight > 0 {
            match self.results.recv() {
                Ok(done) => self.stale(done),
                Err(_) => break,
            }
        }
    }

    /// Consumes on one connection until told to stop or the connection fails.
    fn consume(&mut self) -> Ended {
        let mut connection = match self.endpoint.open() {
            Ok(c) => c,
            Err(e) => return Ended::Lost(e.to_string()),
        };
        let ended = self.consume_on(&mut connection);
        // Closing hands every delivery not acked back to the queue.
        close_within(connection, Duration::from_secs(2));
        ended
    }

    fn consume_on(&mut self, connection: &mut Connection) -> Ended {
        let config = &self.shared.config;
        let dead_letters = match &config.dead_letter_queue {
            Some(queue) => match DeadLetterQueue::open(connection, queue) {
                Ok(d) => Some(d),
                Err(e) => return Ended::Lost(format!("dead-letter queue {queue:?}: {e}")),
            },
            None => None,
        };
        let channel = match connection.open_channel(None) {
            Ok(channel) => channel,
            Err(e) => return Ended::Lost(format!("cannot open a channel: {e}")),
        };
        if let Err(e) = channel.qos(0, config.prefetch, false) {
            return Ended::Lost(format!("cannot set prefetch: {e}"));
        }
        let queue = match channel.queue_declare_passive(config.queue.as_str()) {
            Ok(q) => q,
            Err(e) => return Ended::Lost(format!("queue {:?}: {e}", config.queue)),
        };
        let consumer = match queue.consume(ConsumerOptions::default()) {
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
            channel: &channel,
            dead_letters,
            held: HashMap::new(),
            lanes: Lanes::default(),
            cancelled: Arc::new(AtomicBool::new(false)),
            stopping: false,
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
            let step = select! {
                recv(self.stop) -> _ => {
                    let _ = consumer.cancel();
                    break self.drain(&mut link);
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
                recv(retry) -> _ => {
                    for tag in link.lanes.due(Instant::now()) {
                        self.start(&mut link, tag);
                    }
                    Ok(())
                },
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
        ended
    }

    /// Told to stop: nothing new starts; the jobs running finish and are settled (acked
    /// when committed); the rest goes back to the queue when the channel closes.
    fn drain(&mut self, link: &mut Link<'_>) -> Ended {
        link.stopping = true;
        while self.in_flight > 0 {
            let Ok(done) = self.results.recv() else { break };
            if let Err(why) = self.settle(link, done) {
                return Ended::Lost(why);
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
        if view.key.is_empty() {
            // Without a message id there is nothing to deduplicate on: it cannot be handled
            // exactly once, and the handler never sees it.
            let held = Held {
                raw,
                view: Arc::new(view),
                suspect: false,
            };
            return self.dead_letter(link, held, "the message has no message id", 0);
        }
        let aggregate = view.aggregate_key.clone();
        let suspect = raw.redelivered;
        link.held.insert(
            tag,
            Held {
                raw,
                view: Arc::new(view),
                suspect,
            },
        );
        if link.lanes.arrive(tag, aggregate.as_deref()) {
            self.start(link, tag);
        }
        Ok(())
    }

    /// Hands a held delivery to a worker.
    fn start(&mut self, link: &mut Link<'_>, tag: Tag) {
        if link.stopping {
            return;
        }
        let Some(held) = link.held.get(&tag) else {
            return;
        };
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
                self.advance(link, done.tag, aggregate);
            }
            Outcome::Failed { error, failures }
                if error.is_permanent() || failures >= config.max_failures =>
            {
                if let Some(held) = link.held.remove(&done.tag) {
                    self.dead_letter(link, held, &error.to_string(), failures)?;
                }
                self.advance(link, done.tag, aggregate);
            }
            Outcome::Failed { error, failures } => {
                shared.counters.retried.fetch_add(1, Ordering::SeqCst);
                let policy = RetryPolicy {
                    max_attempts: config.max_failures,
                    backoff_min: config.backoff_min,
                    backoff_max: config.backoff_max,
                };
                let delay = policy.backoff(failures);
                log::warn!(
                    "rabbitmq consumer {}: handler failed on {} (failure {failures} of {}); \
                     retrying in {delay:?}: {error}",
                    config.name,
                    view.key,
                    config.max_failures
                );
                if !link.stopping {
                    link.lanes.retry_at(done.tag, Instant::now() + delay);
                }
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
            Outcome::Abandoned => {}
        }
    }

    /// A delivery is settled: the next of its aggregate may start. After a dead letter,
    /// called only once it has gone out, so a channel lost meanwhile cannot let the next one
    /// commit ahead of a redelivery of this one.
    fn advance(&mut self, link: &mut Link<'_>, tag: Tag, aggregate: Option<&str>) {
        if let Some(next) = link.lanes.settle(tag, aggregate) {
            self.start(link, next);
        }
    }

    /// Gives up on a delivery: to the dead-letter queue (confirmed) and then acked, or
    /// rejected to the queue's own dead-letter exchange.
    fn dead_letter(
        &mut self,
        link: &mut Link<'_>,
        held: Held,
        reason: &str,
        failures: u32,
    ) -> Result<(), String> {
        let config = &self.shared.config;
        let key = held.view.key.clone();
        match &link.dead_letters {
            Some(queue) => {
                let death = Death {
                    reason,
                    failures,
                    consumer: &config.name,
                    queue: &config.queue,
                };
                queue.publish(&held.raw.properties, &held.view.body, &death)?;
                held.raw
                    .ack(link.channel)
                    .map_err(|e| format!("cannot ack: {e}"))?;
            }
            None => held
                .raw
                .reject(link.channel, false)
                .map_err(|e| format!("cannot reject: {e}"))?,
        }
        log::error!(
            "rabbitmq consumer {}: dead-lettered {key:?} after {failures} failures: {reason}",
            config.name
        );
        self.shared.counters.rejected.fetch_add(1, Ordering::SeqCst);
        self.shared.observe(|m| m.dead_lettered(&held.view));
        if failures > 0 {
            let _ = self.tasks.send(Task::Forget(key));
        }
        Ok(())
    }
}

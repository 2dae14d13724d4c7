//! Workers: each owns a publisher and turns jobs into outcomes.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{after, select, Receiver, Sender};

use super::config::RelayConfig;
use super::{release, Job, Shared};
use crate::publish::{PublishError, Publisher};
use crate::record::Record;
use crate::retry::reconnect_delay;
use crate::retry::Outcome;

/// Publishes jobs until the work channel closes (the dispatcher stopped and the queue is
/// empty). Once the relay is stopping, jobs not yet started are released instead.
pub(crate) fn run(
    shared: &Shared,
    work: &Receiver<Job>,
    stop: &Receiver<()>,
    outcomes: &Sender<Vec<(Record, Outcome)>>,
    done: &Sender<usize>,
) {
    let config = &shared.config;
    let table = config.outbox.table();
    let mut publisher: Option<Box<dyn Publisher>> = None;
    let mut factory_failures = 0u32;
    // How long a publish of one job takes, smoothed: a record whose lease would run out
    // before a publish this long could finish is not worth starting.
    let mut typical = Duration::ZERO;

    while let Ok(job) = work.recv() {
        let n = job.records.len();
        if shared.stopping() {
            release(shared, outcomes, job.records);
            let _ = done.send(n);
            continue;
        }
        // Capped at half the lease: `typical` only changes when something is published, so
        // one publish slower than half the lease would otherwise make this worker hand back
        // every later job, fresh ones included, forever.
        let margin = (typical * 2).max(config.lease / 10).min(config.lease / 2);
        if Instant::now() + margin >= job.deadline {
            log::debug!(
                "outbox {table}: {n} records waited too long for a worker; handing them back"
            );
            release(shared, outcomes, job.records);
            let _ = done.send(n);
            continue;
        }
        let records = job.records;

        let live = match &mut publisher {
            Some(p) => p,
            None => {
                match (config.factory)() {
                    Ok(p) => {
                        factory_failures = 0;
                        publisher.insert(p)
                    }
                    Err(e) => {
                        // No attempt was made, so none is counted: hand the rows back and wait
                        // before trying the factory again.
                        factory_failures += 1;
                        let pause =
                            reconnect_delay(factory_failures).max(Duration::from_millis(500));
                        log::warn!("outbox {table}: could not build a publisher, retrying in {pause:?}: {e}");
                        release(shared, outcomes, records);
                        let _ = done.send(n);
                        select! {
                            recv(stop) -> _ => {},
                            recv(after(pause)) -> _ => {},
                        }
                        continue;
                    }
                }
            }
        };

        shared
            .publishing
            .fetch_add(records.len() as u64, Ordering::SeqCst);
        let started = Instant::now();
        let results = attempt(config, live.as_mut(), &records, job.claimed_at);
        let took = started.elapsed();
        typical = if typical.is_zero() {
            took
        } else {
            (typical * 7 + took) / 8
        };
        if live.is_broken() {
            log::warn!("outbox {table}: publisher broke; building a new one");
            publisher = None;
        }
        let sent = results
            .iter()
            .filter(|o| matches!(o, Outcome::Sent))
            .count();
        log::debug!(
            "outbox {table}: published {sent} of {} in {took:?}",
            records.len()
        );
        let _ = outcomes.send(records.into_iter().zip(results).collect());
        shared.publishing.fetch_sub(n as u64, Ordering::SeqCst);
        let _ = done.send(n);
    }
}

/// Publishes `records` and decides each one's outcome. A panicking publisher is a failed
/// attempt for the whole batch, never a dead relay.
pub(crate) fn attempt(
    config: &RelayConfig,
    publisher: &mut dyn Publisher,
    records: &[Record],
    claimed_at: Instant,
) -> Vec<Outcome> {
    let table = config.outbox.table();
    let results =
        catch_unwind(AssertUnwindSafe(|| publisher.publish(records))).unwrap_or_else(|_| {
            log::error!("outbox {table}: publisher panicked");
            records
                .iter()
                .map(|_| Err(PublishError::transient("publisher panicked")))
                .collect()
        });
    let mut results = results.into_iter();
    records
        .iter()
        .map(|record| {
            let result = results.next().unwrap_or_else(|| {
                Err(PublishError::transient(
                    "publisher returned fewer outcomes than records",
                ))
            });
            match result {
                Ok(()) => {
                    log::trace!("outbox {table}: published {}", record.key);
                    config.metrics.published(record, claimed_at.elapsed());
                    Outcome::Sent
                }
                Err(error) => {
                    config.metrics.failed(record, &error);
                    let outcome = config.retry.after_failure(table, record, &error);
                    if let Outcome::Dead { .. } = outcome {
                        config.metrics.dead_lettered(record);
                    }
                    outcome
                }
            }
        })
        .collect()
}

//! The dispatcher: claims due rows and hands them to the workers.

use std::time::Instant;

use crossbeam_channel::{after, select, tick, Receiver, Sender};

use super::pool::Session;
use super::{Job, Shared};
use crate::error::Result;
use crate::retry::reconnect_delay;
use crate::store;

/// Claims until told to stop. Returns an error only when the relay cannot go on (its table
/// is gone); database outages are logged and retried with backoff.
pub(crate) fn run(
    shared: &Shared,
    work: &Sender<Job>,
    done: &Receiver<usize>,
    wake: &Receiver<()>,
    stop: &Receiver<()>,
) -> Result<()> {
    let config = &shared.config;
    let table = config.outbox.table();
    let mut session = Session::new(config.pool.clone());
    let ticker = tick(config.poll_interval);
    // Two batches at most: one being published, the next claimed while it waits for confirms.
    let max_in_flight = 2 * config.batch_size;
    let mut in_flight = 0usize;
    let mut want_claim = true;
    let mut failures = 0u32;

    loop {
        if shared.stopping() {
            return Ok(());
        }
        if want_claim && in_flight + config.batch_size <= max_in_flight {
            let claimed_at = Instant::now();
            match session
                .run(|conn| store::claim(conn, &config.outbox, config.batch_size, config.lease))
            {
                Ok(records) => {
                    failures = 0;
                    let n = records.len();
                    log::debug!("outbox {table}: claimed {n} rows");
                    if n > 0 {
                        config.metrics.claimed(n);
                        in_flight += n;
                        let deadline = claimed_at + config.lease;
                        for records in split(records, config.concurrency) {
                            let job = Job {
                                records,
                                claimed_at,
                                deadline,
                            };
                            if work.send(job).is_err() {
                                return Ok(());
                            }
                        }
                    }
                    // A full batch suggests more are due; a short one means we caught up.
                    want_claim = n == config.batch_size;
                    continue;
                }
                Err(e) if e.is_not_migrated() => {
                    log::error!("outbox {table}: relay stopping: {e}");
                    return Err(e);
                }
                Err(e) => {
                    failures += 1;
                    let pause = reconnect_delay(failures);
                    log::warn!("outbox {table}: claim failed, retrying in {pause:?}: {e}");
                    select! {
                        recv(stop) -> _ => return Ok(()),
                        recv(after(pause)) -> _ => continue,
                    }
                }
            }
        }
        select! {
            recv(stop) -> _ => return Ok(()),
            recv(done) -> n => match n {
                Ok(n) => in_flight = in_flight.saturating_sub(n),
                Err(_) => return Ok(()),
            },
            recv(wake) -> _ => want_claim = true,
            recv(ticker) -> _ => want_claim = true,
        }
    }
}

/// Splits a batch evenly across the workers, so each publishes a pipelined slice.
fn split(mut records: Vec<crate::Record>, workers: usize) -> Vec<Vec<crate::Record>> {
    let size = records.len().div_ceil(workers).max(1);
    let mut parts = Vec::with_capacity(workers);
    while records.len() > size {
        let rest = records.split_off(size);
        parts.push(records);
        records = rest;
    }
    parts.push(records);
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: i64) -> crate::Record {
        crate::Record {
            id,
            key: id.to_string(),
            topic: "t".into(),
            aggregate_key: None,
            payload: Vec::new(),
            content_type: None,
            headers: Vec::new(),
            attempt: 1,
            max_attempts: None,
            created_at: std::time::SystemTime::now(),
            lease: None,
        }
    }

    #[test]
    fn split_keeps_order_and_sizes_even() {
        let parts = split((0..10).map(record).collect(), 4);
        let sizes: Vec<usize> = parts.iter().map(Vec::len).collect();
        assert_eq!(sizes, [3, 3, 3, 1]);
        let ids: Vec<i64> = parts.iter().flatten().map(|r| r.id).collect();
        assert_eq!(ids, (0..10).collect::<Vec<_>>());
        assert_eq!(split((0..2).map(record).collect(), 4).len(), 2);
        assert_eq!(split((0..5).map(record).collect(), 1).len(), 1);
    }
}

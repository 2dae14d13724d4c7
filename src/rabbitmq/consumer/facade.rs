//! A consumer's [`ConsumerMetrics`] reported to the `metrics` crate facade (features
//! `rabbitmq` and `metrics`; the names are in [`facade`](crate::facade)'s table).

use std::time::Duration;

use metrics::{counter, histogram};

use super::delivery::{Delivery, SequenceGap};
use super::metrics::ConsumerMetrics;
use crate::publish::publisher::HandlerError;

/// A `rabbitmq::Consumer`'s [`ConsumerMetrics`], reported to the `metrics` facade under
/// its queue and consumer name (see [`facade`](crate::facade)'s table).
///
/// ```
/// use postgres_outbox::rabbitmq::ConsumerConfig;
/// use postgres_outbox::QueueMetrics;
/// let config = ConsumerConfig::new("amqp://guest:guest@localhost:5672", "invoices", "invoicing")
///     .metrics(QueueMetrics::new("invoices", "invoicing"));
/// # let _ = config;
/// ```
#[derive(Debug, Clone)]
pub struct QueueMetrics {
    labels: [(&'static str, String); 2],
}

impl QueueMetrics {
    /// Reports under `queue` and `consumer` labels.
    pub fn new(queue: &str, consumer: &str) -> QueueMetrics {
        QueueMetrics {
            labels: [
                ("queue", queue.to_owned()),
                ("consumer", consumer.to_owned()),
            ],
        }
    }
}

impl ConsumerMetrics for QueueMetrics {
    fn handled(&self, _delivery: &Delivery, took: Duration) {
        counter!("outbox_consumer_handled_total", &self.labels).increment(1);
        histogram!("outbox_consumer_handle_seconds", &self.labels).record(took.as_secs_f64());
    }

    fn duplicate(&self, _delivery: &Delivery) {
        counter!("outbox_consumer_duplicates_total", &self.labels).increment(1);
    }

    fn failed(&self, _delivery: &Delivery, _error: &HandlerError) {
        counter!("outbox_consumer_failed_total", &self.labels).increment(1);
    }

    fn dead_lettered(&self, _delivery: &Delivery) {
        counter!("outbox_consumer_dead_lettered_total", &self.labels).increment(1);
    }

    fn database_failed(&self, _error: &crate::error::Error) {
        counter!("outbox_consumer_database_failures_total", &self.labels).increment(1);
    }

    fn out_of_sequence(&self, _delivery: &Delivery, gap: &SequenceGap) {
        let missing = gap.missing();
        let (kind, missing) = match gap {
            SequenceGap::Hole { .. } => ("hole", missing.end - missing.start),
            _ => ("behind", 0),
        };
        let [queue, consumer] = &self.labels;
        let labels = [queue.clone(), consumer.clone(), ("gap", kind.to_owned())];
        counter!("outbox_consumer_sequence_gaps_total", &labels).increment(1);
        if missing > 0 {
            counter!("outbox_consumer_sequence_missing_total", &self.labels)
                .increment(u64::try_from(missing).unwrap_or(u64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use metrics_util::debugging::DebugValue;

    use super::*;
    use crate::facade::tests::reported;
    use crate::publish::publisher::PublishError;

    #[test]
    fn consumer_events_become_counters_and_a_histogram_per_queue() {
        use crate::rabbitmq::{ConsumerMetrics, Delivery, SequenceGap};
        let delivery = Delivery::new("k", "t", Vec::new());
        let metrics = QueueMetrics::new("invoices", "billing");
        let seen = reported(|| {
            metrics.handled(&delivery, Duration::from_millis(500));
            metrics.duplicate(&delivery);
            metrics.failed(&delivery, &PublishError::transient("no"));
            metrics.failed(&delivery, &PublishError::transient("no"));
            metrics.dead_lettered(&delivery);
            metrics.out_of_sequence(
                &delivery,
                &SequenceGap::Hole {
                    expected: 2,
                    got: 5,
                },
            );
            metrics.out_of_sequence(&delivery, &SequenceGap::Behind { last: 5, got: 4 });
        });
        let names: Vec<(String, Vec<String>, DebugValue)> = seen
            .into_iter()
            .map(|(_, name, labels, value)| (name, labels, value))
            .collect();
        let labels = vec!["consumer=billing".to_owned(), "queue=invoices".to_owned()];
        assert_eq!(
            names,
            [
                (
                    "outbox_consumer_dead_lettered_total".into(),
                    labels.clone(),
                    DebugValue::Counter(1)
                ),
                (
                    "outbox_consumer_duplicates_total".into(),
                    labels.clone(),
                    DebugValue::Counter(1)
                ),
                (
                    "outbox_consumer_failed_total".into(),
                    labels.clone(),
                    DebugValue::Counter(2)
                ),
                (
                    "outbox_consumer_handle_seconds".into(),
                    labels.clone(),
                    DebugValue::Histogram(vec![0.5.into()])
                ),
                (
                    "outbox_consumer_handled_total".into(),
                    labels.clone(),
                    DebugValue::Counter(1)
                ),
                (
                    "outbox_consumer_sequence_gaps_total".into(),
                    vec![
                        "consumer=billing".to_owned(),
                        "gap=behind".to_owned(),
                        "queue=invoices".to_owned()
                    ],
                    DebugValue::Counter(1)
                ),
                (
                    "outbox_consumer_sequence_gaps_total".into(),
                    vec![
                        "consumer=billing".to_owned(),
                        "gap=hole".to_owned(),
                        "queue=invoices".to_owned()
                    ],
                    DebugValue::Counter(1)
                ),
                (
                    "outbox_consumer_sequence_missing_total".into(),
                    labels,
                    DebugValue::Counter(3)
                ),
            ]
        );
    }
}

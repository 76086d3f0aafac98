//! Delivery events: what happened to one notification at one sink (a ping
//! of a heartbeat, or a write of the alert state file), counted where it
//! happens.
//!
//! Owns [`DeliveryEvent`] and the hook that counts it ([`DeliveryCounter`],
//! given by whoever exports metrics). The notifier logs each event at the
//! place it happens and counts it there with the same call site, so nothing
//! diffs counters afterwards. Every event is plain data defined here
//! (the heartbeat's [`PingResult`] too), so this file imports no sink. It
//! must never block or fail a delivery, nor import a sink's file.

use std::fmt;
use std::sync::Arc;

/// What one sink did with one notification (an Alertmanager post counts as
/// one notification).
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum DeliveryResult {
    Delivered,
    /// One failed attempt (retried, or dead-lettered: then also `DeadLettered`).
    Failed,
    /// Refused: the sink's queue was full.
    Dropped,
    DeadLettered,
}

impl DeliveryResult {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// How a ping ended (`result` of `fleet_reconciler_heartbeat_pings_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PingResult {
    /// The receiver answered 2xx.
    Ok,
    /// A transport error, a timeout or any other status.
    Failed,
    /// The previous ping of the URL was still due or in flight: none was sent.
    Skipped,
}

impl PingResult {
    pub const ALL: [PingResult; 3] = [PingResult::Ok, PingResult::Failed, PingResult::Skipped];

    pub fn as_str(self) -> &'static str {
        match self {
            PingResult::Ok => "ok",
            PingResult::Failed => "failed",
            PingResult::Skipped => "skipped",
        }
    }
}

/// One delivery event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeliveryEvent {
    /// `sink` is the sink's kind (`json`, `slack`, `pagerduty`, `alertmanager`).
    Sink {
        sink: &'static str,
        result: DeliveryResult,
    },
    /// How a ping of `alerts.heartbeat[index]` ended.
    Heartbeat { index: usize, result: PingResult },
    /// A write of the alert state file failed.
    StateWriteFailed,
}

/// Counts delivery events; the default counts nothing.
#[derive(Clone, Default)]
pub struct DeliveryCounter(Option<Arc<dyn Fn(DeliveryEvent) + Send + Sync>>);

impl DeliveryCounter {
    pub fn new(count: impl Fn(DeliveryEvent) + Send + Sync + 'static) -> DeliveryCounter {
        DeliveryCounter(Some(Arc::new(count)))
    }

    pub(crate) fn count(&self, event: DeliveryEvent) {
        if let Some(count) = &self.0 {
            count(event);
        }
    }

    pub(crate) fn sink(&self, sink: &'static str, result: DeliveryResult) {
        self.count(DeliveryEvent::Sink { sink, result });
    }
}

impl fmt::Debug for DeliveryCounter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "DeliveryCounter(counting)"
        } else {
            "DeliveryCounter(none)"
        })
    }
}

//! The time source of the loop, the executor and the service.
//!
//! Owns the one way these read the wall clock, so that a test can run them
//! on tokio's paused clock ([`TokioClock`]) instead of real time. It must
//! never be read inside the planner: `planner::plan` takes `now` as input.

use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, Utc};

/// Tells the time.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> DateTime<Utc>;
}

/// A clock shared by the parts of one daemon.
pub type SharedClock = Arc<dyn Clock>;

/// The system's wall clock: what the daemon uses.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// The system clock, shared.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// Wall time that follows tokio's clock from a fixed start: under
/// `tokio::time::pause()` it moves only when tokio's time does (by
/// `advance`, or by auto-advance when every task waits on a timer), so
/// deadlines of hours pass in no real time.
#[derive(Clone, Debug)]
pub struct TokioClock {
    start_utc: DateTime<Utc>,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// A clock that reads `start_utc` now (tokio's `Instant::now()`).
    pub fn starting_at(start_utc: DateTime<Utc>) -> TokioClock {
        TokioClock {
            start_utc,
            start: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> DateTime<Utc> {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.start);
        chrono::Duration::from_std(elapsed)
            .ok()
            .and_then(|d| self.start_utc.checked_add_signed(d))
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_tokio_clock_moves_with_paused_time_only() {
        let start = DateTime::<Utc>::from_timestamp(1_800_000_000, 0).expect("time");
        let clock = TokioClock::starting_at(start);
        assert_eq!(clock.now(), start);
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert_eq!(clock.now(), start + chrono::Duration::hours(1));
        // Auto-advance: a sleep of a day returns at once, a day later.
        tokio::time::sleep(Duration::from_secs(86_400)).await;
        assert_eq!(clock.now(), start + chrono::Duration::hours(25));
    }
}

//! Observe: what the fleet is, read-only.
//!
//! One sweep ([`sweep::Sweeper::sweep`]) lists every configured app's
//! machines through [`crate::fly`], polls the started ones' health endpoints
//! ([`probe`]) and asks the git mirror ([`overlay`]) how far each reported
//! ref trails the release tip. The result is a [`sweep::Observation`]: what
//! was seen, with no verdict on it (`decide::prepare` makes it the snapshot
//! the planner decides on). Nothing under `observe` writes to Fly, POSTs to
//! an agent, judges what it saw, or names a later stage's types.

pub mod gate;
pub mod overlay;
pub mod probe;
pub mod sweep;

/// A hook told how long one probe or git fetch took and how it ended (a
/// fixed vocabulary: `report`/`unreachable`/`bad_report`, `ok`/`failed`);
/// the metrics module feeds its latency histograms with it.
pub type DurationObserver = std::sync::Arc<dyn Fn(&'static str, std::time::Duration) + Send + Sync>;

//! `prepare`: one sweep's observation → the [`Snapshot`] the planner plans on.
//!
//! Owns the order of that step: judge each drifted row ([`severity`]),
//! carry stale apps' last listings ([`LastListings`]), and fold the result
//! into the planner's memory ([`Tracker`]). It must never read the world
//! (no clients, no clock: `now` is an argument).

use chrono::{DateTime, Utc};

use crate::decide::listings::LastListings;
use crate::decide::policy::Policy;
use crate::decide::severity;
use crate::decide::snapshot::Snapshot;
use crate::decide::tracker::Tracker;
use crate::observe::sweep::Observation;

/// Prepares one sweep's observation for planning at `now`: judges it,
/// carries stale apps' last listings (a carried row keeps the verdict it
/// had), and folds the result into `tracker`. The loop keeps `listings`
/// and `tracker` across sweeps; a one-shot command passes fresh ones.
pub fn prepare(
    policy: &Policy,
    observation: Observation,
    listings: &mut LastListings,
    tracker: &mut Tracker,
    now: DateTime<Utc>,
) -> Snapshot {
    let mut snapshot = severity::judge(policy, observation);
    // An app this sweep could not list keeps its last listing, as stale.
    if listings.carry(&mut snapshot, now) {
        snapshot.summarize();
    }
    tracker.observe(&snapshot, now);
    tracker.observe_canaries(policy, &snapshot, now);
    snapshot
}

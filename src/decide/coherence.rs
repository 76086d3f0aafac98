//! Coherence as one sweep measured it, kept past the sweep: the fleet's
//! and each app's figures at one instant.
//!
//! Owns [`CoherenceSample`]: the fleet alerts judge it
//! ([`crate::decide::alerts`]) and the status page's trend keeps a ring of
//! them ([`crate::report::server::CoherenceTrend`]). The figures themselves
//! are [`Coherence`], the one shape the snapshot computes and the wire
//! writes (an `AppSummary` row carries one inline); a sample copies them
//! from the snapshot and must never compute a coherence of its own.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

pub use crate::decide::snapshot::Coherence;
use crate::decide::snapshot::{AppSummary, Snapshot};
use crate::model::AppName;

/// The coherence a successful sweep measured.
#[derive(Clone, Debug, PartialEq)]
pub struct CoherenceSample {
    /// When the sweep finished.
    pub at: DateTime<Utc>,
    pub fleet: Coherence,
    /// Per app of the sweep (see [`CoherenceSample::of`] for which).
    pub apps: BTreeMap<AppName, Coherence>,
}

impl CoherenceSample {
    /// The figures of `report`, a sweep that finished `at`, for every app
    /// it names: an app it could not list and never had listed counts as
    /// the sweep shows it (no machines).
    pub fn of(report: &Snapshot, at: DateTime<Utc>) -> CoherenceSample {
        CoherenceSample::with_apps(report, at, |_| true)
    }

    /// [`CoherenceSample::of`] without the apps never listed: they have no
    /// figures of their own (a gap in the trend's line, not a 100 %).
    pub fn of_listed(report: &Snapshot, at: DateTime<Utc>) -> CoherenceSample {
        CoherenceSample::with_apps(report, at, |a| {
            a.stale.as_ref().is_none_or(|s| s.last_listed_at.is_some())
        })
    }

    // The fleet's figures are the snapshot's whichever apps are kept: an
    // app left out was never listed, so it has no machines to count.
    fn with_apps(
        report: &Snapshot,
        at: DateTime<Utc>,
        keep: impl Fn(&AppSummary) -> bool,
    ) -> CoherenceSample {
        CoherenceSample {
            at,
            fleet: report.coherence,
            apps: report
                .apps
                .iter()
                .filter(|a| keep(a))
                .map(|a| (a.name.clone(), a.coherence))
                .collect(),
        }
    }
}

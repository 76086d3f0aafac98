//! Coherence as one sweep measured it: on-tip ÷ started machines, for the
//! fleet and for each app.
//!
//! Owns the one in-memory shape of those figures, [`CoherenceSample`]: the
//! fleet alerts judge it ([`crate::report::notify`]) and the status page's
//! trend keeps a ring of them ([`crate::report::server::CoherenceTrend`]).
//! It copies the sweep's figures from the snapshot's `AppSummary` rows (the
//! wire's shape of the same three numbers) and must never compute a
//! coherence of its own.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::decide::snapshot::{AppSummary, Snapshot};

/// On-tip ÷ started machines of the fleet or one app.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Coherence {
    pub ratio: f64,
    pub on_tip: usize,
    pub machines: usize,
}

impl From<&AppSummary> for Coherence {
    fn from(a: &AppSummary) -> Coherence {
        Coherence {
            ratio: a.coherence,
            on_tip: a.on_tip,
            machines: a.machines,
        }
    }
}

/// The coherence a successful sweep measured.
#[derive(Clone, Debug, PartialEq)]
pub struct CoherenceSample {
    /// When the sweep finished.
    pub at: DateTime<Utc>,
    pub fleet: Coherence,
    /// Per app of the sweep (see [`CoherenceSample::of`] for which).
    pub apps: BTreeMap<String, Coherence>,
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

    fn with_apps(
        report: &Snapshot,
        at: DateTime<Utc>,
        keep: impl Fn(&AppSummary) -> bool,
    ) -> CoherenceSample {
        let apps: BTreeMap<String, Coherence> = report
            .apps
            .iter()
            .filter(|a| keep(a))
            .map(|a| (a.name.clone(), Coherence::from(a)))
            .collect();
        CoherenceSample {
            at,
            fleet: Coherence {
                ratio: report.coherence,
                on_tip: apps.values().map(|c| c.on_tip).sum(),
                machines: apps.values().map(|c| c.machines).sum(),
            },
            apps,
        }
    }
}

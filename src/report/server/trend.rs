//! Coherence over time: a bounded in-memory ring of the last sweeps'
//! coherence figures, for the fleet and per app, that the status page draws.
//!
//! Owns only memory: [`super::FleetView::record_sweep`] appends one
//! [`CoherenceSample`] (without the apps never listed) per successful
//! sweep, the oldest falls out past [`TREND_SAMPLES`]. It records the
//! figures the sweep computed and never computes a coherence of its own; a restart of the daemon starts an empty ring (the long history
//! is Prometheus's `fleet_coherence`).

use std::collections::VecDeque;

use crate::decide::coherence::CoherenceSample;
use crate::model::AppName;

/// Samples kept: two hours of sweeps at a 30 s interval.
pub const TREND_SAMPLES: usize = 240;

/// The ring: oldest sample first, at most `capacity` of them.
#[derive(Clone, Debug, PartialEq)]
pub struct CoherenceTrend {
    samples: VecDeque<CoherenceSample>,
    capacity: usize,
}

impl Default for CoherenceTrend {
    fn default() -> CoherenceTrend {
        CoherenceTrend::with_capacity(TREND_SAMPLES)
    }
}

impl CoherenceTrend {
    /// An empty ring of at most `capacity` samples (at least one).
    pub fn with_capacity(capacity: usize) -> CoherenceTrend {
        let capacity = capacity.max(1);
        CoherenceTrend {
            samples: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Appends `sample`, dropping the oldest when full.
    pub fn push(&mut self, sample: CoherenceSample) {
        while self.samples.len() >= self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Oldest first.
    pub fn samples(&self) -> impl ExactSizeIterator<Item = &CoherenceSample> {
        self.samples.iter()
    }

    pub fn first(&self) -> Option<&CoherenceSample> {
        self.samples.front()
    }

    pub fn latest(&self) -> Option<&CoherenceSample> {
        self.samples.back()
    }

    /// One value per sample, oldest first: the fleet's coherence (`None`
    /// app), or the app's, `None` where a sample lacks the app.
    pub fn series(&self, app: Option<&AppName>) -> Vec<Option<f64>> {
        self.samples
            .iter()
            .map(|s| match app {
                None => Some(s.fleet.ratio),
                Some(name) => s.apps.get(name).map(|p| p.ratio),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::coherence::Coherence;
    use crate::decide::snapshot::Snapshot;
    use chrono::{DateTime, Utc};
    use std::collections::BTreeMap;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap_or_default()
    }

    fn sample(s: i64, fleet: f64, apps: &[(&str, f64)]) -> CoherenceSample {
        let ratio = |ratio| Coherence {
            ratio,
            on_tip: 0,
            machines: 0,
        };
        CoherenceSample {
            at: t(s),
            fleet: ratio(fleet),
            apps: apps
                .iter()
                .map(|(n, c)| (AppName::from(*n), ratio(*c)))
                .collect(),
        }
    }

    #[test]
    fn the_ring_is_bounded_and_keeps_the_newest_in_order() {
        let mut ring = CoherenceTrend::with_capacity(3);
        assert!(ring.is_empty() && ring.latest().is_none());
        for i in 0..5 {
            ring.push(sample(i, i as f64 / 10.0, &[]));
            assert!(ring.len() <= 3);
        }
        assert_eq!(ring.len(), 3);
        let at: Vec<_> = ring.samples().map(|s| s.at).collect();
        assert_eq!(at, [t(2), t(3), t(4)]);
        assert_eq!(ring.series(None), [Some(0.2), Some(0.3), Some(0.4)]);
        assert_eq!(ring.first().map(|s| s.at), Some(t(2)));
        assert_eq!(ring.latest().map(|s| s.at), Some(t(4)));
    }

    #[test]
    fn the_default_ring_holds_the_documented_number_of_samples() {
        let mut ring = CoherenceTrend::default();
        for i in 0..(TREND_SAMPLES as i64 + 10) {
            ring.push(sample(i, 1.0, &[]));
        }
        assert_eq!(ring.len(), TREND_SAMPLES);
        assert_eq!(ring.capacity(), TREND_SAMPLES);
        assert_eq!(ring.first().map(|s| s.at), Some(t(10)));
        // A zero capacity still keeps the latest sample.
        let mut one = CoherenceTrend::with_capacity(0);
        one.push(sample(1, 1.0, &[]));
        one.push(sample(2, 0.5, &[]));
        assert_eq!(one.series(None), [Some(0.5)]);
    }

    #[test]
    fn a_sample_keeps_the_sweeps_figures_and_skips_apps_never_listed() {
        use crate::decide::snapshot::AppSummary;
        use crate::observe::sweep::{StaleApp, TipReport};
        let app = |name: &str, on_tip, machines, stale: Option<Option<DateTime<Utc>>>| AppSummary {
            name: name.into(),
            coherence: Coherence::of(on_tip, machines),
            stale: stale.map(|last_listed_at| StaleApp {
                error: format!("cannot list machines of app {name}"),
                kind: "transport".into(),
                last_listed_at,
            }),
        };
        let report = Snapshot {
            tip: TipReport {
                branch: "release".into(),
                commit: crate::model::CommitId::parse(&"c0ffee".repeat(7)[..40]).unwrap(),
            },
            // Not the apps' sums: a sample copies the snapshot's figures.
            coherence: Coherence {
                ratio: 0.6,
                on_tip: 3,
                machines: 6,
            },
            apps: vec![
                app("a", 1, 4, None),
                app("b", 2, 2, Some(Some(t(-60)))),
                app("c", 0, 0, Some(None)),
            ],
            machines: Vec::new(),
            slots: Default::default(),
            halts: Default::default(),
            gate: Default::default(),
        };
        let s = CoherenceSample::of_listed(&report, t(5));
        assert_eq!((s.at, s.fleet.ratio), (t(5), 0.6));
        assert_eq!((s.fleet.on_tip, s.fleet.machines), (3, 6));
        let a = Coherence {
            ratio: 0.25,
            on_tip: 1,
            machines: 4,
        };
        // A stale app shown from its last listing keeps those figures; one
        // never listed has none (a gap).
        let b = Coherence {
            ratio: 1.0,
            on_tip: 2,
            machines: 2,
        };
        assert_eq!(
            s.apps,
            BTreeMap::from([(AppName::from("a"), a), (AppName::from("b"), b)])
        );
        // The fleet alerts count every app the sweep names.
        let all = CoherenceSample::of(&report, t(5));
        assert_eq!(all.apps.len(), 3);
        assert_eq!(
            all.apps.get(&AppName::from("c")).map(|c| c.machines),
            Some(0)
        );
    }

    #[test]
    fn apps_that_appear_and_disappear_leave_gaps() {
        let mut ring = CoherenceTrend::with_capacity(10);
        ring.push(sample(0, 1.0, &[("a", 1.0)]));
        ring.push(sample(1, 0.5, &[("a", 0.5), ("b", 0.25)]));
        ring.push(sample(2, 0.75, &[("b", 0.75)]));
        assert_eq!(
            ring.series(Some(&AppName::from("a"))),
            [Some(1.0), Some(0.5), None]
        );
        assert_eq!(
            ring.series(Some(&AppName::from("b"))),
            [None, Some(0.25), Some(0.75)]
        );
        assert_eq!(ring.series(Some(&AppName::from("c"))), [None, None, None]);
        assert_eq!(ring.series(None), [Some(1.0), Some(0.5), Some(0.75)]);
    }
}

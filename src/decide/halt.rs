//! A release that halts itself (`[release] halt_after_failures` within
//! `halt_window`): which rotations toward the tip this run saw end failed,
//! and which apps' tips are halted now.
//!
//! Owns the planner's memory of failed rotations ([`FailureMemory`], kept in
//! the `Tracker`) and the judgement [`halts`]: a tip is halted for an app
//! when the coordinator's record says so (sealed, or unverifiable: fail
//! closed), or when this run saw enough of its rotations end failed within
//! the window — each end timed by this run's first sight of it, on this
//! replica's clock, never by the marker's `at` (another clock wrote it). A
//! failure already there at the run's first sweep counts for nothing (when
//! it ended is unknown on this clock), and one a `resume` lifted never counts
//! again. It must never do I/O; the record is written by the executor
//! ([`crate::act::executor::Executor::record_halt`]).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::decide::policy::Policy;
use crate::decide::snapshot::Snapshot;
use crate::metadata::controls::Found;
use crate::metadata::halt::{HaltFailure, HaltOutcome, HaltRecord, HaltView, MAX_HALT_FAILURES};
use crate::model::{AppName, CommitId};

/// The evidence text the planner writes for an attempt that crash-looped
/// (`planner::Rotation::restarting`); a failure whose evidence begins so
/// ended crash-looping.
pub const CRASH_LOOP_EVIDENCE: &str = "crash loop";

/// One failed rotation as this run first saw it.
#[derive(Clone, Debug)]
struct FailureSight {
    failure: HaltFailure,
    /// This run's first sight of its end (this replica's clock).
    at: DateTime<Utc>,
    /// Already failed at this run's first sweep: when it ended is unknown.
    before_run: bool,
}

/// Failed rotations toward the tip, per app, by marker tag.
#[derive(Clone, Debug, Default)]
pub struct FailureMemory {
    /// Whether a sweep of this run was folded in yet.
    swept: bool,
    tip: Option<CommitId>,
    seen: BTreeMap<AppName, BTreeMap<String, FailureSight>>,
}

impl FailureMemory {
    /// Folds in one sweep: each readable marker toward the tip that records
    /// a failure, first seen now unless seen before. A new tip forgets all.
    pub fn observe(&mut self, snapshot: &Snapshot, now: DateTime<Utc>) {
        let tip = &snapshot.tip.commit;
        if self.tip.as_ref() != Some(tip) {
            self.seen.clear();
            self.tip = Some(tip.clone());
        }
        let stale = snapshot.stale_app_names();
        for m in &snapshot.machines {
            let m = &m.seen;
            if stale.contains(m.app.as_str()) || m.inputs.metadata_unknown().is_some() {
                continue;
            }
            let Some(Ok(marker)) = m.inputs.controls.marker.as_ref() else {
                continue;
            };
            let Some(failed) = marker.failed.as_ref().filter(|_| marker.target == *tip) else {
                continue;
            };
            let outcome = if failed.evidence.starts_with(CRASH_LOOP_EVIDENCE) {
                HaltOutcome::CrashLooping
            } else {
                HaltOutcome::Failed
            };
            let swept = self.swept;
            self.seen
                .entry(m.app.clone())
                .or_default()
                .entry(marker.tag.clone())
                .or_insert_with(|| FailureSight {
                    failure: HaltFailure {
                        machine_id: m.machine_id.clone(),
                        tag: marker.tag.clone(),
                        outcome,
                        evidence: failed.evidence.clone(),
                    },
                    at: now,
                    before_run: !swept,
                });
        }
        self.swept = true;
    }

    /// The failures of `app` toward `tip` that count now: seen end within
    /// `window` of `now` by this run, and not lifted by a `resume`.
    fn counted(
        &self,
        app: &AppName,
        window: std::time::Duration,
        lifted: &[String],
        now: DateTime<Utc>,
    ) -> Vec<&HaltFailure> {
        let window = chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX);
        let since = now
            .checked_sub_signed(window)
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        self.seen
            .get(app)
            .into_iter()
            .flat_map(|m| m.values())
            .filter(|s| !s.before_run && s.at >= since && !lifted.contains(&s.failure.tag))
            .map(|s| &s.failure)
            .collect()
    }
}

/// Why an app's tip is halted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HaltSource {
    /// The coordinator's sealed record says so.
    Recorded { by: String, at: DateTime<Utc> },
    /// This run saw the failures; the record is to be written.
    Detected,
    /// The coordinator's record is not one we sealed: halted (fail closed).
    Unverified(Found),
}

/// One app's halted tip.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Halted {
    pub tip: CommitId,
    /// The evidence: the failed rotations (none for an unverifiable record).
    pub failures: Vec<HaltFailure>,
    pub source: HaltSource,
    /// What earlier resumes of the tip lifted (kept in the record written).
    pub lifted: Vec<String>,
}

impl Halted {
    /// The record that says so, for the executor to write on the
    /// coordinator: only for a halt this run detected.
    pub fn record(&self, owner: &str, now: DateTime<Utc>) -> Option<HaltRecord> {
        (self.source == HaltSource::Detected).then(|| HaltRecord::Halted {
            tip: self.tip.clone(),
            failures: self.failures.clone(),
            by: owner.to_string(),
            at: now,
            lifted: self.lifted.clone(),
        })
    }
}

/// The apps whose current tip is halted, and why.
pub fn halts(
    policy: &Policy,
    snapshot: &Snapshot,
    memory: &FailureMemory,
    now: DateTime<Utc>,
) -> BTreeMap<AppName, Halted> {
    let tip = &snapshot.tip.commit;
    let mut out = BTreeMap::new();
    for app in &snapshot.apps {
        let view = snapshot.halts.get(&app.name);
        let halted = match view {
            Some(HaltView::Unverified(found)) => Some(Halted {
                tip: tip.clone(),
                failures: Vec::new(),
                source: HaltSource::Unverified(found.clone()),
                lifted: Vec::new(),
            }),
            Some(HaltView::Record(HaltRecord::Halted {
                tip: t,
                failures,
                by,
                at,
                lifted,
            })) if t == tip => Some(Halted {
                lifted: lifted.clone(),
                tip: tip.clone(),
                failures: failures.clone(),
                source: HaltSource::Recorded {
                    by: by.clone(),
                    at: *at,
                },
            }),
            _ => None,
        };
        let halted = halted.or_else(|| {
            let n = policy.release.halt_after_failures;
            if n == 0 {
                return None;
            }
            let lifted = match view {
                Some(HaltView::Record(r)) => r.lifted(tip),
                _ => &[],
            };
            let counted = memory.counted(&app.name, policy.release.halt_window.get(), lifted, now);
            (counted.len() >= n as usize).then(|| Halted {
                tip: tip.clone(),
                failures: counted
                    .into_iter()
                    .take(MAX_HALT_FAILURES)
                    .cloned()
                    .collect(),
                source: HaltSource::Detected,
                lifted: lifted.to_vec(),
            })
        });
        if let Some(h) = halted {
            out.insert(app.name.clone(), h);
        }
    }
    out
}

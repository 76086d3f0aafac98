//! A machine's rotation history: the steps the executor carried out for it,
//! typed and bounded, and the one line each is shown as.
//!
//! Owns the per-machine record ([`History`], at most [`HISTORY_LINES`] steps
//! per machine, forgotten with the machine) and its rendering: the status
//! page, `GET /api/v1/machines/{id}` and `status MACHINE` all show
//! [`HistoryEntry::line`]. An entry keeps only what its line shows: the
//! step's own description ([`StepText`], whose words the step's `Display`
//! writes too), not its markers nor its target (the machine it is filed
//! under), so a day of releases over 10,000 machines stays small. It must
//! never decide or act, nor word a step itself: it records what the
//! executor reports.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::act::executor::{Outcome, StepReport};
use crate::decide::step::StepText;
use crate::model::MachineId;

/// Steps of rotation history kept per machine.
pub const HISTORY_LINES: usize = 20;

/// One step the executor carried out for a machine, and how it ended.
///
/// The step and outcome are shared: a release restarts thousands of
/// machines with the same step and the same `done`, so an entry is a time
/// and two pointers (32 bytes) rather than its own copy of each.
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryEntry {
    /// When the sweep that carried it out ran.
    pub at: DateTime<Utc>,
    pub step: Arc<HistoryStep>,
    pub outcome: Arc<Outcome>,
}

/// What a step did, with what its line shows: the step's own description
/// ([`StepText`]), less the markers it wrote (the machine's marker shows
/// where it stands now).
pub type HistoryStep = StepText;

impl HistoryEntry {
    pub fn of(report: &StepReport, at: DateTime<Utc>) -> HistoryEntry {
        HistoryEntry {
            at,
            step: Arc::new(HistoryStep::of(&report.step)),
            outcome: Arc::new(report.outcome.clone()),
        }
    }

    /// The line shown for this entry of machine `machine_id` of `app`:
    /// `2026-05-01T12:00:00Z restart app/id (…) → done`.
    pub fn line(&self, app: &str, machine_id: &str) -> String {
        format!(
            "{} {} → {}",
            self.at.format("%Y-%m-%dT%H:%M:%SZ"),
            Shown {
                step: self.step.as_ref(),
                app,
                machine_id,
            },
            self.outcome
        )
    }
}

/// The lines of `entries` (a machine's history), oldest first.
pub fn lines(entries: &[HistoryEntry], app: &str, machine_id: &str) -> Vec<String> {
    entries.iter().map(|e| e.line(app, machine_id)).collect()
}

/// A history step's text for the machine it is filed under.
struct Shown<'a> {
    step: &'a HistoryStep,
    app: &'a str,
    machine_id: &'a str,
}

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `Target`'s own text.
        let target = format_args!("{}/{}", self.app, self.machine_id);
        self.step.write(f, &target)
    }
}

/// One machine's entries, oldest first; shared with the server's view (a
/// sweep copies a pointer per machine, not its entries).
pub type MachineHistory = Arc<[HistoryEntry]>;

/// Every machine's recent steps.
#[derive(Debug, Default)]
pub struct History {
    machines: HashMap<MachineId, MachineHistory>,
}

/// Distinct steps (or outcomes) one sweep shares among its entries; past
/// this many, an entry keeps its own (a sweep of many different failures
/// costs no quadratic search).
const SHARED_PER_SWEEP: usize = 64;

/// `value` as an already shared equal one of `seen`, else newly shared.
fn shared<T: PartialEq>(seen: &mut Vec<Arc<T>>, value: T) -> Arc<T> {
    if let Some(same) = seen.iter().find(|s| ***s == value) {
        return Arc::clone(same);
    }
    let new = Arc::new(value);
    if seen.len() < SHARED_PER_SWEEP {
        seen.push(Arc::clone(&new));
    }
    new
}

impl History {
    /// Files the sweep's steps (carried out `at`) under their machines.
    pub fn record(&mut self, steps: &[StepReport], at: DateTime<Utc>) {
        let (mut kinds, mut outcomes) = (Vec::new(), Vec::new());
        let mut added: HashMap<&MachineId, Vec<HistoryEntry>> = HashMap::new();
        for s in steps {
            let entry = HistoryEntry {
                at,
                step: shared(&mut kinds, HistoryStep::of(&s.step)),
                outcome: shared(&mut outcomes, s.outcome.clone()),
            };
            added
                .entry(&s.step.target.machine_id)
                .or_default()
                .push(entry);
        }
        for (id, new) in added {
            let old = self.machines.get(id).map(|h| h.as_ref()).unwrap_or(&[]);
            // The newest HISTORY_LINES of the old entries and the new.
            let over = (old.len() + new.len()).saturating_sub(HISTORY_LINES);
            let entries = old.iter().cloned().chain(new).skip(over).collect();
            self.machines.insert(id.clone(), entries);
        }
    }

    /// Forgets the machines `keep` says are gone.
    pub fn retain(&mut self, mut keep: impl FnMut(&MachineId) -> bool) {
        self.machines.retain(|id, _| keep(id));
    }

    pub fn of(&self, id: &MachineId) -> Option<&MachineHistory> {
        self.machines.get(id)
    }

    /// Machines with any history.
    pub fn len(&self) -> usize {
        self.machines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.machines.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act::executor::{Declined, Failure};
    use crate::decide::planner::{RestartGuard, Step, StepKind, Target};
    use crate::decide::step::{AdvanceWhy, ReleaseWhy, RestartWhy, WithdrawWhy};
    use crate::metadata::marker::{self, Marker};
    use crate::metadata::marker::{Ending, Phase};
    use crate::metadata::unprobed::Unprobed;
    use crate::model::{PolicyAction, Severity};
    use chrono::TimeZone;

    fn at(minute: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 5, 1, 12, minute, 7)
            .single()
            .unwrap_or_default()
    }

    /// A rotation's marker, as an agent of ours wrote it, at `phase`.
    fn marker(phase: Phase) -> Marker {
        let written = format!(
            r#"{{"tag":"t1","target":"{}","phase":"claiming","mode":"grace","action":"restart","severity":"high","started_at":"2026-05-01T12:00:07Z","attempt_started_at":"2026-05-01T12:01:07Z","owner":"r1"}}"#,
            "ab".repeat(20)
        );
        let parsed = Marker::parse(&written).expect("a marker of ours");
        Marker { phase, ..parsed }
    }

    /// One step of every kind (and every ending of a release).
    fn every_kind() -> Vec<StepKind> {
        let ending = |ending, failed: bool, retry_at| StepKind::Release {
            marker: Marker {
                ending: Some(ending),
                retry_at,
                failed: failed.then(|| marker::Failure {
                    at: at(3),
                    attempts: 3,
                    evidence: "crash loop".into(),
                    approval: None,
                }),
                ..marker(Phase::Releasing)
            },
            undrain: crate::decide::step::Undrain::Needed,
            clear_approval: false,
            why: ReleaseWhy::TipMovedPastApproval,
        };
        let mut kinds = vec![
            StepKind::Claim {
                marker: marker(Phase::Claiming),
                drain: true,
                reload: false,
            },
            StepKind::Claim {
                marker: marker(Phase::Claiming),
                drain: false,
                reload: true,
            },
            StepKind::Withdraw {
                why: WithdrawWhy::PoolAtCap,
            },
            StepKind::Advance {
                marker: marker(Phase::Draining),
                cordon: true,
                why: AdvanceWhy::BackoffElapsed,
            },
            StepKind::Drain,
            StepKind::RecordUnprobed {
                record: Unprobed {
                    since: at(2),
                    action: PolicyAction::Restart,
                    severity: Severity::Low,
                },
            },
            StepKind::ClearUnprobed,
            ending(Ending::Yielded, false, Some(at(30))),
            ending(Ending::Yielded, false, None),
            ending(Ending::Finished, false, None),
            ending(Ending::Cancelled, false, None),
            ending(Ending::Yielded, true, Some(at(30))),
        ];
        for guard in [
            RestartGuard::MayInterrupt,
            RestartGuard::Idle,
            RestartGuard::Unprobeable,
        ] {
            kinds.push(StepKind::Restart {
                marker: marker(Phase::Restarting),
                guard,
                why: RestartWhy::GraceElapsed,
            });
        }
        kinds
    }

    fn report(kind: StepKind, outcome: Outcome) -> StepReport {
        StepReport {
            step: Step {
                target: Target {
                    app: "app-1".into(),
                    machine_id: "m7".into(),
                    pool: "gpu".into(),
                    health_url: Some("http://m7.vm.app-1.internal:8080/health".into()),
                },
                expected: None,
                kind,
            },
            outcome,
            events: Vec::new(),
        }
    }

    #[test]
    fn every_kind_of_step_shows_the_line_the_step_itself_reads_as() {
        let outcomes = [
            Outcome::Done,
            Outcome::Skipped(Declined::Held),
            Outcome::Failed(Failure::Fly {
                kind: "status",
                error: "restart of app-1/m7: 500".into(),
            }),
        ];
        let kinds = every_kind();
        assert_eq!(kinds.len(), 15);
        for (i, kind) in kinds.into_iter().enumerate() {
            let s = report(kind, outcomes[i % outcomes.len()].clone());
            // The line the reporter wrote before history was typed.
            let before = format!(
                "{} {} → {}",
                at(9).format("%Y-%m-%dT%H:%M:%SZ"),
                s.step,
                s.outcome
            );
            assert_eq!(HistoryEntry::of(&s, at(9)).line("app-1", "m7"), before);
        }
    }

    /// Each kind's text as it has always read (logs, `plan`, history):
    /// pinned, now that the step and its history line share one description.
    #[test]
    fn every_kind_of_step_reads_as_it_always_has() {
        let texts: Vec<String> = every_kind()
            .into_iter()
            .map(|kind| report(kind, Outcome::Done).step.to_string())
            .collect();
        let want = [
            "claim a rotation slot for app-1/m7 (pool gpu, grace mode, drain requested)",
            "claim a rotation slot for app-1/m7 (pool gpu, grace mode, reload requested)",
            "app-1/m7: withdraw the claim (its pool is at its cap)",
            "app-1/m7: draining (backoff elapsed; draining again)",
            "app-1/m7: ask the agent to drain again",
            "app-1/m7: record that the agent gives no usable report since 2026-05-01T12:02:07+00:00",
            "app-1/m7: the agent answers again",
            "app-1/m7 yields its slot (the tip moved past the approved commit; approve the new tip); retry at 2026-05-01T12:30:07+00:00",
            "app-1/m7 yields its slot (the tip moved past the approved commit; approve the new tip); retry at ",
            "app-1/m7 reports the target: uncordon and finish",
            "app-1/m7: rotation cancelled (the tip moved past the approved commit; approve the new tip); undo it",
            "app-1/m7: the rotation failed (the tip moved past the approved commit; approve the new tip); undo it and release its slot, no new attempt for abababababab",
            "restart app-1/m7 (restart grace elapsed; live work may be interrupted)",
            "restart app-1/m7 (restart grace elapsed)",
            "restart app-1/m7 (restart grace elapsed; only if still unprobeable)",
        ];
        assert_eq!(texts, want);
    }

    #[test]
    fn a_machine_keeps_its_last_steps_and_is_forgotten_when_gone() {
        let mut history = History::default();
        let m7: MachineId = "m7".into();
        for minute in 0..(HISTORY_LINES as u32 + 5) {
            // Two steps of one machine in one sweep are both kept, in order.
            let steps = [
                report(StepKind::Drain, Outcome::Done),
                report(StepKind::ClearUnprobed, Outcome::Done),
            ];
            history.record(&steps, at(minute));
        }
        let kept = history.of(&m7).map(|h| h.to_vec()).unwrap_or_default();
        assert_eq!(kept.len(), HISTORY_LINES);
        assert_eq!(
            kept.last().map(|e| e.at),
            Some(at(HISTORY_LINES as u32 + 4))
        );
        assert_eq!(
            kept.last().map(|e| &*e.step),
            Some(&HistoryStep::ClearUnprobed)
        );
        assert_eq!(kept.first().map(|e| &*e.step), Some(&HistoryStep::Drain));
        assert_eq!(kept.first().map(|e| e.at), Some(at(15)));

        history.retain(|id| id != &m7);
        assert!(history.of(&m7).is_none() && history.is_empty());
    }

    #[test]
    fn machines_given_the_same_step_in_a_sweep_share_it() {
        let mut history = History::default();
        let steps: Vec<StepReport> = ["m1", "m2", "m3"]
            .into_iter()
            .map(|id| {
                let mut s = report(StepKind::Drain, Outcome::Done);
                s.step.target.machine_id = id.into();
                s
            })
            .collect();
        history.record(&steps, at(1));
        let first = |id: &str| {
            history
                .of(&id.into())
                .and_then(|h| h.first().cloned())
                .expect("an entry")
        };
        let (m1, m3) = (first("m1"), first("m3"));
        assert!(Arc::ptr_eq(&m1.step, &m3.step) && Arc::ptr_eq(&m1.outcome, &m3.outcome));
        assert_eq!(
            m1.line("app-1", "m1"),
            format!(
                "{} app-1/m1: ask the agent to drain again → done",
                at(1).format("%Y-%m-%dT%H:%M:%SZ")
            )
        );
        // Small: a time and two pointers.
        assert!(std::mem::size_of::<HistoryEntry>() <= 32);
    }
}

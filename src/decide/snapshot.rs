//! The snapshot the planner and every view read: a sweep's observation
//! with each drifted row's verdict, stale apps' last listings and the
//! coherence figures.
//!
//! Owns the [`Snapshot`] and its rows ([`JudgedMachine`], [`Verdict`],
//! [`AppSummary`]) and the coherence figures ([`Coherence`], the one shape
//! of those figures, which the wire and the alerts reuse), computed by
//! `Snapshot::summarize`. [`crate::decide::prepare()`] makes it (what
//! omicron calls preparing the planning input). It must never read the
//! world (no clients, no clock) nor decide steps: that is
//! [`crate::decide::planner`]'s.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::decide::reason::SharedReason;
use crate::model::{AppName, MachineStatus, PolicyAction, Severity};
use crate::observe::sweep::{
    AppListing, Observation, ObservedMachine, SlotsView, StaleApp, TipReport,
};

/// What the planner plans on and every view shows, as of one sweep.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub tip: TipReport,
    /// Over the whole fleet: the sums of the apps' figures.
    pub coherence: Coherence,
    pub apps: Vec<AppSummary>,
    pub machines: Vec<JudgedMachine>,
    /// The coordinator's slot set as the sweep read it.
    pub slots: SlotsView,
    /// Each app's halt record on the coordinator, as the sweep read it.
    pub halts: crate::metadata::halt::Halts,
    /// The alert gate as the sweep read it (`[gates.alertmanager]`).
    pub gate: crate::observe::gate::GateView,
}

// The coherence of the fleet or of one app: on-tip ÷ started machines (1.0
// with no started machine), with the two counts. The one shape of these
// figures: an app's row on the wire carries them inline (`AppSummary`), the
// fleet alerts and the status page's trend keep them
// (`decide::coherence::CoherenceSample`). `//` comments on the type: its
// schema is flattened into `AppSummary`'s, and a doc comment would add a
// description to that one in docs/fleet.schema.json.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Coherence {
    /// Machines in state `started` (the coherence denominator).
    pub machines: usize,
    pub on_tip: usize,
    // Named `coherence` where the fleet document writes it.
    #[serde(rename = "coherence")]
    pub ratio: f64,
}

impl Coherence {
    /// `on_tip` of `machines` started machines.
    pub fn of(on_tip: usize, machines: usize) -> Coherence {
        Coherence {
            machines,
            on_tip,
            ratio: if machines == 0 {
                1.0
            } else {
                on_tip as f64 / machines as f64
            },
        }
    }
}

// One configured app's figures. Written as it is in the fleet document
// (`report::wire`), whose published schema names it: a `//` comment, as a
// doc comment would become a description in docs/fleet.schema.json. The
// figures are written inline (`machines`, `on_tip`, `coherence`).
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(into = "AppSummaryWire", from = "AppSummaryWire")]
#[schemars(with = "AppSummaryWire")]
pub struct AppSummary {
    pub name: AppName,
    pub coherence: Coherence,
    pub stale: Option<StaleApp>,
}

impl AppSummary {
    /// No listing of the app was ever had: its figures are not a coherence
    /// (0 of 0 would read as 1.0) and are written without one.
    pub fn never_listed(&self) -> bool {
        self.stale
            .as_ref()
            .is_some_and(|s| s.last_listed_at.is_none())
    }
}

// `AppSummary` as the fleet document writes it: the figures inline, and
// no `coherence` for an app never listed (its `stale` says why).
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema)]
#[schemars(rename = "AppSummary")]
struct AppSummaryWire {
    // A plain string in the published schema, as it was before the name
    // was typed.
    #[schemars(with = "String")]
    name: AppName,
    /// Machines in state `started` (the coherence denominator).
    machines: usize,
    on_tip: usize,
    /// On-tip ÷ started (1.0 with no started machine); absent for an app
    /// never listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    coherence: Option<f64>,
    /// Set when this sweep could not list the app's machines; absent when it
    /// could. The figures above and the app's machines are then those of its
    /// last listing (none when there was none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stale: Option<StaleApp>,
}

impl From<AppSummary> for AppSummaryWire {
    fn from(a: AppSummary) -> AppSummaryWire {
        let never_listed = a.never_listed();
        AppSummaryWire {
            name: a.name,
            machines: a.coherence.machines,
            on_tip: a.coherence.on_tip,
            coherence: (!never_listed).then_some(a.coherence.ratio),
            stale: a.stale,
        }
    }
}

impl From<AppSummaryWire> for AppSummary {
    fn from(w: AppSummaryWire) -> AppSummary {
        let counted = Coherence::of(w.on_tip, w.machines);
        AppSummary {
            name: w.name,
            coherence: Coherence {
                ratio: w.coherence.unwrap_or(counted.ratio),
                ..counted
            },
            stale: w.stale,
        }
    }
}

/// Why a drifted row (`drifted`, `unknown_ref`, `ambiguous_ref`) is what
/// it is and what its pool does about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub severity: Severity,
    /// The pool's action for that severity, or `observe` while the drift's
    /// path rules are not checked on every missing commit.
    pub action: PolicyAction,
    /// The rule, its evidence and the newest missing commits; shared by
    /// every machine on the same ref.
    pub reason: SharedReason,
}

/// A machine as seen, and, when it drifted, the verdict on it.
///
/// What was seen is `seen`, read as such (`m.seen.status`): a function that
/// reads only that takes the [`ObservedMachine`]; one that also needs the
/// verdict takes this. Deliberately no `Deref` to the observed row, so a
/// judged row never silently passes for one that was only seen:
///
/// ```compile_fail,E0308
/// use fleet_reconciler::decide::snapshot::JudgedMachine;
/// use fleet_reconciler::observe::sweep::ObservedMachine;
/// fn seen(m: &JudgedMachine) -> &ObservedMachine {
///     m // only `&m.seen` is the observed row
/// }
/// ```
#[derive(Clone, Debug)]
pub struct JudgedMachine {
    pub seen: ObservedMachine,
    /// Shared by every machine on the same ref in the same pool (a pointer
    /// per row, not a copy): `None` for a row that is not drifted.
    pub verdict: Option<Arc<Verdict>>,
}

impl JudgedMachine {
    pub fn new(seen: ObservedMachine, verdict: Option<Verdict>) -> JudgedMachine {
        JudgedMachine {
            seen,
            verdict: verdict.map(Arc::new),
        }
    }

    pub fn severity(&self) -> Option<Severity> {
        self.verdict.as_ref().map(|v| v.severity)
    }

    pub fn action(&self) -> Option<PolicyAction> {
        self.verdict.as_ref().map(|v| v.action)
    }

    pub fn reason(&self) -> Option<&SharedReason> {
        self.verdict.as_ref().map(|v| &v.reason)
    }
}

/// The apps of `apps` that the sweep could not list, with why.
pub fn stale_apps(apps: &[AppSummary]) -> impl Iterator<Item = (&AppName, &StaleApp)> {
    apps.iter()
        .filter_map(|a| a.stale.as_ref().map(|s| (&a.name, s)))
}

impl Snapshot {
    /// `observation`'s rows, each with the verdict `verdict` gives it, and
    /// the coherence figures of those rows.
    pub fn judged(
        observation: Observation,
        mut verdict: impl FnMut(&ObservedMachine) -> Option<Arc<Verdict>>,
    ) -> Snapshot {
        let Observation {
            tip,
            apps,
            machines,
            slots,
            halts,
            gate,
        } = observation;
        let machines = machines
            .into_iter()
            .map(|seen| JudgedMachine {
                verdict: verdict(&seen),
                seen,
            })
            .collect();
        let mut snapshot = Snapshot {
            tip,
            coherence: Coherence::of(0, 0),
            apps: apps
                .into_iter()
                .map(|AppListing { name, stale }| AppSummary {
                    name,
                    coherence: Coherence::of(0, 0),
                    stale,
                })
                .collect(),
            machines,
            slots,
            halts,
            gate,
        };
        snapshot.summarize();
        snapshot
    }

    /// True when every started machine reports the tip.
    pub fn is_coherent(&self) -> bool {
        self.machines.iter().all(|m| {
            matches!(
                m.seen.status,
                MachineStatus::OnTip | MachineStatus::NotRunning
            )
        })
    }

    pub fn count(&self, app: Option<&AppName>, status: MachineStatus) -> usize {
        self.machines
            .iter()
            .filter(|m| app.is_none_or(|a| &m.seen.app == a) && m.seen.status == status)
            .count()
    }

    /// The apps this sweep could not list, with why.
    pub fn stale_apps(&self) -> impl Iterator<Item = (&AppName, &StaleApp)> {
        stale_apps(&self.apps)
    }

    /// Names of the apps this sweep could not list (as text: the slot set
    /// names an app in its keys' text).
    pub fn stale_app_names(&self) -> HashSet<&str> {
        self.stale_apps().map(|(name, _)| name.as_str()).collect()
    }

    /// Recomputes per-app and fleet coherence from the machines.
    pub(crate) fn summarize(&mut self) {
        let mut counts: HashMap<&AppName, (usize, usize)> = HashMap::new();
        for m in &self.machines {
            if m.seen.status == MachineStatus::NotRunning {
                continue;
            }
            let c = counts.entry(&m.seen.app).or_default();
            c.0 += 1;
            if m.seen.status == MachineStatus::OnTip {
                c.1 += 1;
            }
        }
        for app in &mut self.apps {
            let (started, on_tip) = counts.get(&app.name).copied().unwrap_or_default();
            app.coherence = Coherence::of(on_tip, started);
        }
        let started: usize = self.apps.iter().map(|a| a.coherence.machines).sum();
        let on_tip: usize = self.apps.iter().map(|a| a.coherence.on_tip).sum();
        self.coherence = Coherence::of(on_tip, started);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::reason::{Reason, RuleMatch};
    use crate::model::MachineState;

    /// A row is no bigger than it was made (480 bytes on 64-bit targets,
    /// from 576: shared region, pool and ref texts, the rarely set parts
    /// behind one pointer): 100,000 of them are held at once.
    #[test]
    fn a_judged_row_is_no_bigger_than_before() {
        println!(
            "JudgedMachine {} B, ObservedMachine {} B",
            std::mem::size_of::<JudgedMachine>(),
            std::mem::size_of::<ObservedMachine>()
        );
        assert!(
            std::mem::size_of::<JudgedMachine>() <= 480,
            "{} bytes",
            std::mem::size_of::<JudgedMachine>()
        );
    }

    #[test]
    fn coherence_counts_started_machines_and_verdicts_read_through() {
        let config = crate::config::test_config("");
        let tip = crate::observe::overlay::Tip {
            branch: "release".into(),
            commit: crate::model::CommitId::parse(&"a".repeat(40)).expect("commit"),
        };
        let row = |id: &str, status, state| ObservedMachine {
            status,
            ..ObservedMachine::listed("app", id, id, state)
        };
        let observation = crate::observe::sweep::observation(
            &config,
            &tip,
            vec![
                row("m1", MachineStatus::OnTip, MachineState::Started),
                row("m2", MachineStatus::Drifted, MachineState::Started),
                row("m3", MachineStatus::NotRunning, MachineState::Stopped),
            ],
        );
        let verdict = Arc::new(Verdict {
            severity: Severity::High,
            action: PolicyAction::Manual,
            reason: SharedReason(Arc::new(Reason {
                rule: RuleMatch::NoMatch {
                    level: Severity::Low,
                },
                evidence: Vec::new(),
                behind: Some(1),
                missing: Vec::new(),
                evidence_partial: false,
            })),
        });
        let snapshot = Snapshot::judged(observation, |m| {
            (m.status == MachineStatus::Drifted).then(|| Arc::clone(&verdict))
        });
        assert_eq!(snapshot.coherence, Coherence::of(1, 2));
        assert_eq!(snapshot.coherence.ratio, 0.5);
        assert_eq!(snapshot.apps[0].coherence, Coherence::of(1, 2));
        assert!(!snapshot.is_coherent());
        let m2 = &snapshot.machines[1];
        assert_eq!(
            (m2.severity(), m2.action()),
            (Some(Severity::High), Some(PolicyAction::Manual))
        );
        assert!(snapshot.machines[0].reason().is_none());
    }
}

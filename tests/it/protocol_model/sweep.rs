//! "Sweep and plan": the real `Snapshot` built from the abstract world as
//! the sweep would see it, the real `Tracker::observe` and `plan`, and each
//! planned `Step` turned into the executor's calls (mirrored as data).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use fleet_reconciler::config::Config;
use fleet_reconciler::decide::Snapshot;
use fleet_reconciler::decide::alerts::AlertKind;
use fleet_reconciler::decide::planner::{
    FetchState, PlanInput, RestartGuard, Step, StepKind, Undrain, plan,
};
use fleet_reconciler::decide::reason::{Reason, RuleMatch, SharedReason};
use fleet_reconciler::decide::snapshot::Verdict;
use fleet_reconciler::metadata::marker::{Ending, Marker, Phase};
use fleet_reconciler::metadata::slots::SlotSet;
use fleet_reconciler::model::{CommitId, MachineStatus};
use fleet_reconciler::observe::overlay::Tip;
use fleet_reconciler::observe::probe::{Activity, AgentReport, RotationState};
use fleet_reconciler::observe::sweep::{
    FlyChecks, MachineInputs, ObservedMachine, SlotsView, Unusual, observation,
};

use fleet_reconciler::decide::listings::LastListings;
use fleet_reconciler::metadata::{HOLD_KEY, MARKER_KEY};

use super::world::{
    APP, COMMITS, Cond, Exec, Guard, HoldMarker, Known, MarkerWrite, Need, Op, POOL_KEY, Refused,
    World, at, severity,
};

fn config() -> Config {
    let text = format!(
        "[overlay]\nrepo = \"/r\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n\
         [[apps]]\nname = \"{APP}\"\npool_key = \"{POOL_KEY}\"\n"
    );
    Config::parse(Path::new("model.toml"), &text).expect("the model's config parses")
}

pub fn commit(i: u8) -> CommitId {
    CommitId::parse(COMMITS[usize::from(i)]).expect("a commit id")
}

/// The commit index of a commit id (markers name targets by id).
pub fn commit_index(c: &CommitId) -> u8 {
    COMMITS
        .iter()
        .position(|x| *x == c.as_str())
        .and_then(|i| u8::try_from(i).ok())
        .unwrap_or(u8::MAX)
}

/// The agent's report, as replica `r`'s probe would read it.
pub fn report(w: &World, r: usize, i: usize) -> Option<AgentReport> {
    let m = &w.machines[i];
    let reached = m.started && m.host_ok && m.agent_ok && !w.replicas[r].cut_off;
    reached.then(|| AgentReport {
        overlay_ref: COMMITS[usize::from(m.loaded)].into(),
        activity: Some(if m.busy {
            Activity::Busy
        } else {
            Activity::Idle
        }),
        live_sessions: Some(u64::from(m.busy)),
        last_input_at: None,
        heartbeat_at: None,
        capabilities: vec![],
        rotation: m.fenced.as_ref().map(|tag| RotationState {
            fenced: true,
            checkpoint: Some(tag.clone()),
        }),
    })
}

fn reason() -> SharedReason {
    SharedReason(Arc::new(Reason {
        rule: RuleMatch::NoMatch {
            level: fleet_reconciler::model::Severity::Medium,
        },
        evidence: Vec::new(),
        behind: Some(1),
        missing: Vec::new(),
        evidence_partial: false,
    }))
}

/// The snapshot replica `r` gets from one sweep of the world, as
/// `decide::prepare` hands it to the planner: a machine whose host is out
/// keeps the hold and marker of the last sweep that knew them
/// (`LastListings::carry`, fed the replica's memory of that sweep).
pub fn snapshot(w: &World, r: usize) -> Snapshot {
    let mut snap = listed(w, r);
    let known: Vec<Option<HoldMarker>> = w
        .machines
        .iter()
        .zip(&w.replicas[r].known)
        .map(|(m, k)| match k {
            Known::Never => None,
            Known::Same => Some(m.hold_marker()),
            Known::Was(v) => Some(v.clone()),
        })
        .collect();
    let carried = w
        .machines
        .iter()
        .zip(&known)
        .any(|(m, k)| !m.host_ok && k.is_some());
    if carried {
        let mut before = w.clone();
        for (m, k) in before.machines.iter_mut().zip(&known) {
            let Some((hold, marker)) = k else {
                continue;
            };
            m.host_ok = true;
            m.metadata = BTreeMap::from([(POOL_KEY.to_string(), POOL_KEY_VALUE.to_string())]);
            for (key, value) in [(HOLD_KEY, hold), (MARKER_KEY, marker)] {
                if let Some(v) = value {
                    m.metadata.insert(key.to_string(), v.clone());
                }
            }
        }
        let now = at(w.time + w.replicas[r].skew);
        let mut listings = LastListings::default();
        listings.carry(&mut listed(&before, r), now);
        listings.carry(&mut snap, now);
    }
    snap
}

/// The snapshot of one sweep of the world, before `prepare`.
fn listed(w: &World, r: usize) -> Snapshot {
    let policy = w.replicas[r].conf.policy();
    let tip = Tip {
        branch: "release".into(),
        commit: commit(w.tip),
    };
    let (seen, verdicts): (Vec<ObservedMachine>, Vec<Option<Verdict>>) = w
        .machines
        .iter()
        .enumerate()
        // `FlyClient::list_machines` leaves out machines made for a one-off
        // command (#32 item 13h), by the real predicate on the machine as
        // Fly lists it.
        .filter(|(i, m)| !listed_by_fly(*i, m).is_some_and(|f| f.is_one_off_command()))
        .map(|(i, m)| {
            let id = format!("m{i}");
            let report = report(w, r, i);
            let status = if !m.started {
                MachineStatus::NotRunning
            } else if !m.host_ok || !m.agent_ok || w.replicas[r].cut_off {
                MachineStatus::Unreachable
            } else if m.loaded == w.tip {
                MachineStatus::OnTip
            } else {
                MachineStatus::Drifted
            };
            let verdict = (status == MachineStatus::Drifted).then(|| Verdict {
                severity: severity(w.tip),
                action: policy.action(&POOL_KEY_VALUE.into(), severity(w.tip)),
                reason: reason(),
            });
            let seen = ObservedMachine {
                region: "iad".into(),
                pool: POOL_KEY_VALUE.into(),
                status,
                reported_ref: report.as_ref().map(|r| r.overlay_ref.clone()),
                commit: (status == MachineStatus::Drifted).then(|| commit(m.loaded)),
                commits_behind: (status == MachineStatus::Drifted).then_some(1),
                commits_ahead: (status == MachineStatus::Drifted).then_some(0),
                inputs: MachineInputs {
                    report,
                    metadata: if m.host_ok {
                        m.metadata.clone()
                    } else {
                        BTreeMap::new()
                    },
                    unusual: (!m.host_ok || m.check_failing == Some(true) || !m.exits.is_empty())
                        .then(|| {
                            Box::new(Unusual {
                                metadata_unknown: (!m.host_ok)
                                    .then(|| "host_status unreachable".into()),
                                checks: if m.check_failing == Some(true) {
                                    vec![fleet_reconciler::fly::MachineCheck {
                                        name: "health".into(),
                                        status: "critical".into(),
                                        output: String::new(),
                                        updated_at: Some(at(m.checks_at)),
                                    }]
                                } else {
                                    Vec::new()
                                },
                                events: m
                                    .exits
                                    .iter()
                                    .map(|e| exit_event(e, m.restart_marked.unwrap_or(w.time)))
                                    .collect(),
                            })
                        }),
                    fly_checks: match m.check_failing {
                        None => FlyChecks::NoneDefined,
                        Some(true) => FlyChecks::NotAllPassing,
                        Some(false) => {
                            FlyChecks::AllPassingSince(at(m.checks_at).timestamp_millis())
                        }
                    }
                    .into(),
                    instance_id: format!("i{}", m.instance),
                    cordoned: m.host_ok.then_some(m.cordoned),
                    stop_timeout_secs: m.stop_timeout,
                    health_url: Some(format!("http://agents/{id}/health")),
                    ..MachineInputs::default()
                },
                ..ObservedMachine::listed(
                    APP,
                    &id,
                    &id,
                    if m.started { "started" } else { "stopped" }.into(),
                )
            };
            (seen, verdict)
        })
        .unzip();
    let mut verdicts = verdicts.into_iter();
    let mut snapshot = Snapshot::judged(observation(&config(), &tip, seen), |_| {
        verdicts.next().flatten().map(Arc::new)
    });
    snapshot.slots = match w.slot_set() {
        Some(set) => SlotsView::Known(set),
        None => SlotsView::Unknown("unreadable".into()),
    };
    snapshot
}

const POOL_KEY_VALUE: &str = super::world::POOL;

/// Machine `i` as Fly's listing shows it (id, state, host, metadata).
fn listed_by_fly(i: usize, m: &super::world::Machine) -> Option<fleet_reconciler::fly::Machine> {
    serde_json::from_value(serde_json::json!({
        "id": format!("m{i}"),
        "state": if m.started { "started" } else { "stopped" },
        "host_status": if m.host_ok { "ok" } else { "unreachable" },
        "config": {"metadata": m.metadata},
    }))
    .ok()
}

/// Fly's event for one exit (`request.exit_event`, as fly-go reads it),
/// just after our restart was marked at true time `marked`.
fn exit_event(e: &super::world::Exit, marked: i64) -> fleet_reconciler::fly::MachineEvent {
    use super::world::Exit;
    let (time, ours) = match *e {
        Exit::Requested => (marked, true),
        Exit::Crash => (marked + 1, false),
    };
    fleet_reconciler::fly::MachineEvent {
        kind: fleet_reconciler::fly::MachineEvent::EXIT.into(),
        status: "stopped".into(),
        source: "flyd".into(),
        timestamp: at(time).timestamp_millis(),
        exit: Some(fleet_reconciler::fly::ExitDetail {
            exit_code: if ours { 143 } else { 1 },
            restarting: true,
            requested_stop: ours,
        }),
    }
}

/// Replica `r` sweeps and plans: its tracker folds the sweep in, the real
/// planner plans at the replica's own clock, and each step becomes the
/// calls the executor makes for it.
pub fn sweep_and_plan(w: &mut World, r: usize, hosts_go_out: bool) {
    let snap = snapshot(w, r);
    let time = w.time;
    let machines = w.machines.clone();
    let replica = &mut w.replicas[r];
    for (i, m) in machines.iter().enumerate() {
        if hosts_go_out && m.host_ok {
            replica.known[i] = Known::Same;
        }
        replica.cordon_seen[i] = match (m.cordoned, m.host_ok) {
            (false, _) => None,
            (true, true) => replica.cordon_seen[i].or(Some(time)),
            (true, false) => replica.cordon_seen[i],
        };
    }
    let now = at(w.time + w.replicas[r].skew);
    let replica = &mut w.replicas[r];
    replica.mem.0.observe(&snap, now);
    let policy = replica.conf.policy();
    let owner = format!("r{r}");
    let p = plan(&PlanInput {
        policy: &policy,
        snapshot: &snap,
        tracker: &replica.mem.0,
        owner: &owner,
        fetch: FetchState {
            fetched_at: Some(now),
            failing: false,
        },
        now,
    });
    let answered: Vec<bool> = (0..w.machines.len())
        .map(|i| {
            let id = super::world::machine_id(i);
            p.alerts.iter().any(|a| {
                a.machine_id.as_ref() == Some(&id)
                    && matches!(a.kind, AlertKind::RotationStuck | AlertKind::RotationFailed)
            }) || p.steps().iter().any(|s| s.target.machine_id == id)
        })
        .collect();
    // A refused undo was logged for this plan to act on: once its step on
    // the machine is over (or it planned none), the cordon needs a record
    // of its own.
    for (i, m) in w.machines.iter_mut().enumerate() {
        let id = super::world::machine_id(i);
        let acting = p.steps().iter().any(|s| s.target.machine_id == id);
        m.undo_refused = match m.undo_refused {
            Refused::Logged if acting => Refused::Acting,
            _ => Refused::No,
        };
    }
    tip_move_alerted(w, r, &p);
    if w.record.finished_unchecked.is_none() {
        w.record.finished_unchecked = finished_unchecked(w, &p.steps());
    }
    if w.record.over_cap_kept.is_none() {
        w.record.over_cap_kept = over_cap_kept(w, &snap, r, &p.steps());
    }
    attempts_ended(w, r, &p.steps());
    if w.record.one_off_touched.is_none() {
        w.record.one_off_touched = p
            .steps()
            .iter()
            .find(|s| w.machines.get(index(s)).is_some_and(|m| m.one_off))
            .map(|s| format!("r{r} at t={} planned {s} on a console machine", w.time));
    }
    let tip = w.tip;
    let replica = &mut w.replicas[r];
    replica.last_plan = Some((time, answered));
    replica.queue = p
        .steps()
        .into_iter()
        .filter_map(|s| calls(s, tip))
        .collect();
}

fn index(step: &Step) -> usize {
    step.target
        .machine_id
        .as_str()
        .strip_prefix('m')
        .and_then(|n| n.parse().ok())
        .unwrap_or(usize::MAX)
}

/// The executor's calls for one step (`Executor::run` → `under_lease`),
/// planned on a snapshot of the tip `tip`.
fn calls(step: &Step, tip: u8) -> Option<Exec> {
    let machine = index(step);
    let expected = step.expected.as_ref().map(Marker::to_value);
    // `Watch::of`: a manual rotation's commit must stay approved.
    let approval = step
        .new_marker()
        .or(step.expected.as_ref())
        .filter(|m| m.action == fleet_reconciler::model::PolicyAction::Manual)
        .map(|m| {
            (
                commit_index(&m.target),
                m.approval.as_ref().map(|a| a.as_str().to_string()),
            )
        });
    let need = if step.needs_slot() {
        Need::Disruptive
    } else {
        Need::Write
    };
    let mut ops = vec![Op::Acquire, Op::Check(need)];
    match &step.kind {
        // `Executor::claim`.
        StepKind::Claim {
            marker,
            drain,
            reload,
        } => {
            let ours = step
                .expected
                .as_ref()
                .is_some_and(|m| m.phase == Phase::Claiming && m.tag == marker.tag);
            if !ours {
                ops.push(Op::WriteMarker(MarkerWrite::ClaimIntent(marker.to_value())));
            }
            ops.push(Op::WinSlot {
                tag: marker.tag.clone(),
            });
            ops.push(Op::Check(Need::Write));
            ops.push(Op::WriteMarker(MarkerWrite::FirstPhase { reload: *reload }));
            ops.push(Op::Check(Need::Disruptive));
            if !*reload {
                ops.push(Op::Cordon);
                if *drain {
                    ops.push(Op::Check(Need::Disruptive));
                    ops.push(Op::Drain {
                        tag: marker.tag.clone(),
                        tolerant: true,
                    });
                }
            }
        }
        // `Executor::withdraw`: a cordon Fly shows at the first read is
        // lifted first, then read again (#32 item 7).
        StepKind::Withdraw { .. } => {
            ops.push(Op::If(
                Cond::Cordoned,
                vec![Op::Uncordon, Op::Check(Need::Write)],
            ));
            ops.push(Op::DeleteMarker);
            if let Some(m) = &step.expected {
                ops.push(Op::ReleaseSlot { tag: m.tag.clone() });
            }
        }
        // `Executor::advance`.
        StepKind::Advance { marker, cordon, .. } => {
            if *cordon {
                ops.push(Op::VerifySlot {
                    tag: marker.tag.clone(),
                });
            }
            if step.expected.as_ref() != Some(marker) {
                ops.push(Op::WriteMarker(MarkerWrite::Exact(marker.to_value())));
            }
            if *cordon {
                ops.push(Op::Check(Need::Disruptive));
                ops.push(Op::Cordon);
                if marker.drain_requested && marker.phase == Phase::Draining {
                    ops.push(Op::Check(Need::Disruptive));
                    ops.push(Op::Drain {
                        tag: marker.tag.clone(),
                        tolerant: false,
                    });
                }
            }
        }
        // `under_lease`'s `StepKind::Drain`.
        StepKind::Drain => {
            let m = step.expected.as_ref()?;
            ops.push(Op::VerifySlot { tag: m.tag.clone() });
            ops.push(Op::Check(Need::Disruptive));
            ops.push(Op::Drain {
                tag: m.tag.clone(),
                tolerant: false,
            });
        }
        // `Executor::restart`, in the order after #32 item 11: the probe,
        // then the check immediately before the restart.
        StepKind::Restart { marker, guard, .. } => {
            let e = step.expected.as_ref()?;
            ops.push(Op::VerifySlot {
                tag: marker.tag.clone(),
            });
            if e.may_have_cordoned() {
                ops.push(Op::Check(Need::Disruptive));
                ops.push(Op::Cordon);
            }
            ops.push(Op::Check(Need::Write));
            ops.push(Op::WriteMarker(MarkerWrite::Restarting(marker.to_value())));
            let guard = match guard {
                RestartGuard::MayInterrupt => Guard::MayInterrupt,
                RestartGuard::Idle => Guard::Idle,
                RestartGuard::Unprobeable => Guard::Unprobeable,
            };
            ops.push(Op::Probe {
                guard,
                expected: e.to_value(),
                target: commit_index(&marker.target),
            });
            ops.push(Op::Check(if guard == Guard::MayInterrupt {
                Need::Interrupting
            } else {
                Need::Disruptive
            }));
            // `restart`'s 429 arm puts the plan's marker back (#32 item 13d);
            // an unprobeable restart is declined when Fly's checks all pass
            // at that read (`Declined::FlyChecksPass`, #32 item 3).
            if guard == Guard::Unprobeable {
                ops.push(Op::FlyChecksPass {
                    expected: e.to_value(),
                });
            }
            ops.push(Op::Restart {
                expected: e.to_value(),
            });
        }
        // `Executor::release_rotation` (the uncordon, clear_approval and
        // undrain decisions of `under_lease` are made on the first read).
        StepKind::Release {
            marker,
            undrain,
            clear_approval,
            ..
        } => {
            if step.expected.as_ref() != Some(marker) {
                ops.push(Op::WriteMarker(MarkerWrite::Exact(marker.to_value())));
            }
            // `under_lease`: uncordon where the marker may have cordoned, or
            // wherever Fly shows a cordon (#32 item 7).
            let uncordon = vec![Op::Check(Need::Write), Op::Uncordon];
            if marker.may_have_cordoned() {
                ops.extend(uncordon);
            } else {
                ops.push(Op::If(Cond::Cordoned, uncordon));
            }
            // `under_lease`, Release arm: a given-up undrain is never asked
            // (#32 item 4). `undrain_anyway`'s `is_started` holds: the
            // model's machines never stop.
            let anyway = step
                .expected
                .as_ref()
                .is_some_and(|e| e.drain_requested && e.phase != Phase::Yielded);
            let undrain = match undrain {
                Undrain::Needed => true,
                Undrain::NotNeeded => anyway,
                Undrain::GivenUp => false,
            };
            if undrain {
                ops.push(Op::Check(Need::Write));
                ops.push(Op::Undrain {
                    tag: marker.tag.clone(),
                });
            }
            // Only the approval this rotation used, whatever its ending.
            if *clear_approval {
                ops.push(Op::If(
                    Cond::ApprovalToClear {
                        named: marker.approval.as_ref().map(|a| a.as_str().to_string()),
                        target: commit_index(&marker.target),
                    },
                    vec![Op::Check(Need::Write), Op::DeleteApproval],
                ));
            }
            match marker.ending.unwrap_or(Ending::Cancelled) {
                Ending::Yielded => {
                    let mut y = marker.clone();
                    y.phase = Phase::Yielded;
                    y.ending = None;
                    y.cordoned = Some(false);
                    y.drain_requested = false;
                    ops.push(Op::Check(Need::Write));
                    ops.push(Op::WriteMarker(MarkerWrite::Exact(y.to_value())));
                }
                Ending::Finished | Ending::Cancelled => {
                    ops.push(Op::Check(Need::Write));
                    ops.push(Op::DeleteMarker);
                }
            }
            ops.push(Op::ReleaseSlot {
                tag: marker.tag.clone(),
            });
        }
        StepKind::RecordUnprobed { record } => {
            ops.push(Op::SetUnprobed(Some(record.to_value())));
        }
        StepKind::ClearUnprobed => ops.push(Op::SetUnprobed(None)),
    }
    ops.push(Op::ReadAfterAndRelease);
    Some(Exec {
        label: step.to_string(),
        machine,
        ops,
        watch: expected,
        approval,
        first_instance: None,
        first_cordoned: false,
        first_approval: None,
        plan_tip: tip,
        seen_instance: None,
        last_call: None,
        hold_unreported: false,
        leased: false,
        seen_approval: None,
        busy_at_probe: None,
        unprobeable: false,
        put_back: None,
        putting_back: false,
        checks_seen: None,
        calls: 0,
        hold_at: None,
        overtaken: false,
        given_up: match &step.kind {
            StepKind::Release {
                marker,
                undrain: Undrain::GivenUp,
                ..
            } => Some(marker.tag.clone()),
            _ => None,
        },
    })
}

/// The slot set with the stale slots of our pool reclaimed, as
/// `Executor::stale_slots` judges them (anything unreadable is live).
pub fn reclaim_stale(w: &World, set: &mut SlotSet) {
    let (app, pool) = (APP.into(), POOL_KEY_VALUE.into());
    let stale: Vec<_> = set
        .slots(&app, &pool)
        .iter()
        .filter(|slot| {
            let Some(i) = slot
                .machine_id
                .as_str()
                .strip_prefix('m')
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|i| *i < w.machines.len())
            else {
                return true;
            };
            let m = &w.machines[i];
            let live = if !m.host_ok {
                true
            } else {
                match m.metadata.get(fleet_reconciler::metadata::MARKER_KEY) {
                    None => m.cordoned,
                    Some(v) => Marker::parse(v).is_none_or(|mk| {
                        mk.tag == slot.tag && (mk.phase.holds_slot() || mk.phase == Phase::Claiming)
                    }),
                }
            };
            !live
        })
        .cloned()
        .collect();
    for s in stale {
        set.remove(&app, &pool, &s.machine_id, &s.tag);
    }
}

/// #32 item 9, judged on the plan: a pool whose live slots (as the
/// snapshot read them) exceed the replica's cap ends at least as many
/// rotations as the excess, or every rotation that has not restarted
/// (`draining`, `reloading`) if they are fewer. Those that restarted go
/// on: interrupting them again would gain nothing.
fn over_cap_kept(w: &World, snap: &Snapshot, r: usize, steps: &[&Step]) -> Option<String> {
    let SlotsView::Known(set) = &snap.slots else {
        return None;
    };
    let cap = usize::from(w.replicas[r].conf.cap());
    let live = set.slots(&APP.into(), &POOL_KEY_VALUE.into()).len();
    let excess = live.checked_sub(cap).filter(|e| *e > 0)?;
    let yieldable = w
        .machines
        .iter()
        .filter(|m| m.host_ok)
        .filter_map(|m| m.metadata.get(MARKER_KEY).and_then(|v| Marker::parse(v)))
        .filter(|mk| matches!(mk.phase, Phase::Draining | Phase::Reloading))
        .count();
    let ending = steps
        .iter()
        .filter(|s| matches!(s.kind, StepKind::Release { .. }))
        .count();
    (ending < excess.min(yieldable)).then(|| {
        format!(
            "r{r} at t={}: {live} live slots over cap {cap}, {yieldable} not restarted, {ending} ended",
            w.time
        )
    })
}

/// #32 item 13b, judged on the plan: a rotation that restarted a machine
/// whose config defines Fly checks finishes as verified only on a result
/// Fly wrote after our `restarting` marker (its `restart_at`): an empty or
/// older list is not "passing".
fn finished_unchecked(w: &World, steps: &[&Step]) -> Option<String> {
    steps.iter().find_map(|s| {
        let StepKind::Release { marker, .. } = &s.kind else {
            return None;
        };
        let restarted = s.expected.as_ref()?.phase == Phase::Restarting;
        let m = w.machines.get(index(s))?;
        let unchecked =
            m.check_failing.is_some() && m.restart_marked.is_some_and(|r| m.checks_at <= r);
        (restarted && marker.ending == Some(Ending::Finished) && unchecked).then(|| {
            format!(
                "m{} finished at t={} on checks last run at t={}, restarted at t={:?}",
                index(s),
                w.time,
                m.checks_at,
                m.restart_marked
            )
        })
    })
}

/// "A tip that moves within a step" (docs/safety.md): the plan that
/// finishes a rotation whose restart loaded a tip the pool would not have
/// restarted it for raises `rotation_stuck` for the machine; judged once,
/// at that plan.
fn tip_move_alerted(w: &mut World, r: usize, p: &fleet_reconciler::decide::planner::Plan) {
    for i in 0..w.machines.len() {
        if !w.machines[i].loaded_unauthorized {
            continue;
        }
        let id = super::world::machine_id(i);
        let finished = p.steps().iter().any(|s| {
            s.target.machine_id == id
                && matches!(&s.kind, StepKind::Release { marker, .. } if marker.ending == Some(Ending::Finished))
        });
        if !finished {
            continue;
        }
        w.machines[i].loaded_unauthorized = false;
        let alerted = p
            .alerts
            .iter()
            .any(|a| a.kind == AlertKind::RotationStuck && a.machine_id.as_ref() == Some(&id));
        if !alerted && w.record.tip_move_unalerted.is_none() {
            w.record.tip_move_unalerted = Some(format!(
                "m{i}: r{r} finished its rotation on tip {} with no alert",
                w.tip
            ));
        }
    }
}

/// #32 items 13c and 13e, judged on the plan: a step that ends a
/// restart's attempt (back off, or fail past `max_attempts`) while, in
/// truth, the machine came back on its target with fewer crashes since
/// our restart than a crash loop (our own restart's exit is no crash), or
/// is still being stopped within its stop timeout.
///
/// An ending by replica `r` at the verify deadline while `r` cannot read
/// the agent (cut off, or the agent unreachable) and too few exits of any
/// kind for a crash loop is not judged as failed on our exit: no exit
/// ended it, and verification needs the agent's report of the target
/// (F10), so backing off is the fail-closed outcome, not a miscount
/// (the bench's `checks_flap` trace,
/// `a_cut_off_replica_backs_off_an_unprobeable_restart_it_cannot_verify`).
fn attempts_ended(w: &mut World, r: usize, steps: &[&Step]) {
    for s in steps {
        let restarting = s
            .expected
            .as_ref()
            .is_some_and(|e| e.phase == Phase::Restarting);
        let ended = match &s.kind {
            StepKind::Advance { marker, .. } => marker.phase == Phase::Backoff,
            StepKind::Release { marker, .. } => marker.failed.is_some(),
            _ => false,
        };
        let Some(m) = w.machines.get(index(s)) else {
            continue;
        };
        if !restarting || !ended {
            continue;
        }
        let target = s.expected.as_ref().map(|e| commit_index(&e.target));
        let crashes = m
            .exits
            .iter()
            .filter(|e| matches!(e, super::world::Exit::Crash))
            .count();
        let back = m.back_at.is_none() && m.started && Some(m.loaded) == target;
        let exits_may_have_ended_it =
            m.exits.len() >= fleet_reconciler::decide::planner::CRASH_LOOP_EXITS;
        let verifiable = report(w, r, index(s)).is_some();
        if back
            && (verifiable || exits_may_have_ended_it)
            && crashes < fleet_reconciler::decide::planner::CRASH_LOOP_EXITS
            && m.check_failing != Some(true)
            && w.record.failed_on_own_exit.is_none()
        {
            w.record.failed_on_own_exit = Some(format!(
                "m{} back on its target with {crashes} crash(es) since the restart, its attempt ended at t={} ({s})",
                index(s),
                w.time
            ));
        }
        if let Some(b) = m.back_at.filter(|b| *b > w.time)
            && w.record.failed_while_stopping.is_none()
        {
            w.record.failed_while_stopping = Some(format!(
                "m{} still stopping (back at t={b}, stop timeout {} s), its attempt ended at t={} ({s})",
                index(s),
                m.stop_timeout,
                w.time
            ));
        }
    }
}

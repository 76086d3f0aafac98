//! Property test of the planner: random snapshots, markers, holds,
//! approvals, reports, slot sets (known, unknown or not configured), hidden
//! metadata, outside updates and `now` never yield a step that restarts
//! live work outside the policy, claims past a cap, acts on a held machine
//! or one whose metadata is unknown, needs a slot while the slot set is
//! unknown, continues a rotation its machine was updated out of, retries a
//! failed rotation unasked, or restarts a manual machine without a current
//! approval; nor does any timestamp or duration from outside make it panic.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use chrono::{DateTime, Duration as Cd, Utc};
use std::num::NonZeroU32;

use fleet_reconciler::config::{ActionMap, Config, PoolConfig};
use fleet_reconciler::decide::Snapshot;
use fleet_reconciler::decide::planner::{
    FetchState, PlanInput, RestartGuard, StepKind, Tracker, plan, restart_allowed,
};
use fleet_reconciler::decide::policy::Policy;
use fleet_reconciler::decide::reason::{Reason, RuleMatch, SharedReason};
use fleet_reconciler::decide::snapshot::{JudgedMachine, Verdict};
use fleet_reconciler::metadata::marker::{Ending, Failure, Marker, Phase, RotationMode};
use fleet_reconciler::metadata::operator::{Approval, ApprovalId, ApprovalMode};
use fleet_reconciler::metadata::slots::{Slot, SlotSet};
use fleet_reconciler::metadata::unprobed::Unprobed;
use fleet_reconciler::metadata::{APPROVE_KEY, HOLD_KEY, MARKER_KEY, UNPROBED_KEY};
use fleet_reconciler::model::{CommitId, MachineStatus, PolicyAction, Severity};
use fleet_reconciler::observe::overlay::Tip;
use fleet_reconciler::observe::probe::{Activity, AgentReport, Capability, RotationState};
use fleet_reconciler::observe::sweep::{
    MachineInputs, ObservedMachine, SlotsView, Unusual, observation,
};
use proptest::prelude::*;

const TIP: &str = "1111111111111111111111111111111111111111";
const OLD: &str = "2222222222222222222222222222222222222222";
const POOLS: [&str; 3] = ["restart", "wait", "manual"];

/// The report's apps (all the report builder reads of a config).
fn config() -> Config {
    let text = r#"
[overlay]
repo = "/r"
branch = "release"
mirror_dir = "/m"
[[apps]]
name = "app"
pool_key = "pool"
"#;
    Config::parse(Path::new("props.toml"), text).unwrap()
}

/// Pools `restart` (cap 2), `wait` and `manual` (cap 1), built directly.
fn policy(max_attempts: u32) -> Policy {
    use PolicyAction::{AlertAndWait, Manual, Reload, Restart};
    let pool = |cap: u32, actions: [PolicyAction; 4]| PoolConfig {
        max_concurrent_rotations: NonZeroU32::new(cap).unwrap(),
        actions: ActionMap::from(actions),
        ..PoolConfig::default()
    };
    let mut policy = Policy::default()
        .with_pool("restart", pool(2, [Restart; 4]))
        .with_pool(
            "wait",
            pool(1, [AlertAndWait, Reload, AlertAndWait, AlertAndWait]),
        )
        .with_pool("manual", pool(1, [Manual; 4]));
    policy.rotation.min_drift_age = std::time::Duration::from_secs(120);
    policy.rotation.restart_grace = std::time::Duration::from_secs(60);
    policy.rotation.max_attempts = NonZeroU32::new(max_attempts).unwrap();
    policy
}

fn t0() -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).unwrap()
}

/// An offset from `t0`, sometimes absurd (as a hostile peer would write).
fn time() -> impl Strategy<Value = DateTime<Utc>> {
    prop_oneof![
        8 => (-7200i64..7200).prop_map(|s| t0() + Cd::seconds(s)),
        1 => Just(DateTime::<Utc>::MAX_UTC),
        1 => Just(DateTime::<Utc>::MIN_UTC),
    ]
}

fn phase() -> impl Strategy<Value = Phase> {
    prop_oneof![
        1 => Just(Phase::Claiming),
        6 => Just(Phase::Draining),
        1 => Just(Phase::Reloading),
        1 => Just(Phase::Restarting),
        1 => Just(Phase::Backoff),
        1 => Just(Phase::Releasing),
        1 => Just(Phase::Yielded),
    ]
}

fn mode() -> impl Strategy<Value = RotationMode> {
    prop_oneof![
        Just(RotationMode::Wait),
        Just(RotationMode::Grace),
        Just(RotationMode::Now),
        Just(RotationMode::Reload),
    ]
}

fn action() -> impl Strategy<Value = PolicyAction> {
    prop_oneof![
        Just(PolicyAction::Observe),
        Just(PolicyAction::AlertAndWait),
        Just(PolicyAction::Restart),
        Just(PolicyAction::Reload),
        Just(PolicyAction::Manual),
    ]
}

fn severity() -> impl Strategy<Value = Severity> {
    prop_oneof![
        Just(Severity::Low),
        Just(Severity::Medium),
        Just(Severity::High),
        Just(Severity::Critical),
    ]
}

fn commit() -> impl Strategy<Value = CommitId> {
    prop_oneof![4 => Just(TIP), 1 => Just(OLD)]
        .prop_map(|c| CommitId::parse(c).expect("a commit id"))
}

fn tip() -> CommitId {
    CommitId::parse(TIP).expect("a commit id")
}

fn marker() -> impl Strategy<Value = Marker> {
    (
        (phase(), mode(), action(), severity(), commit()),
        (time(), time(), time(), time()),
        (any::<bool>(), proptest::option::of(any::<bool>()), 0u32..4),
        proptest::option::of(prop_oneof![
            Just(Ending::Finished),
            Just(Ending::Yielded),
            Just(Ending::Cancelled)
        ]),
        0u8..3,
        (
            proptest::option::of(prop_oneof![Just("i1".to_string()), Just("i2".to_string())]),
            proptest::option::weighted(0.2, (time(), 1u32..5, proptest::option::of(any::<bool>()))),
        ),
    )
        .prop_map(
            |(
                (phase, mode, action, severity, target),
                (started, attempt, restart_at, retry_at),
                (drain_requested, cordoned, attempt_n),
                ending,
                tag,
                (instance_id, failed),
            )| Marker {
                tag: format!("tag-{tag}"),
                target,
                phase,
                mode,
                action,
                severity,
                started_at: started,
                attempt_started_at: attempt,
                attempt: attempt_n,
                owner: "other".into(),
                restart_at: Some(restart_at),
                retry_at: Some(retry_at),
                drain_requested,
                cordoned,
                ending,
                instance_id,
                pool: None,
                // The approval that stood at the failure: sometimes the one
                // the machine carries (`approval_value`'s of the tip).
                failed: failed.map(|(at, attempts, stood)| Failure {
                    at,
                    attempts,
                    evidence: "still old".into(),
                    approval: stood.map(|now| ApprovalId::of(&approval_value(&tip(), now))),
                }),
                approval: None,
            },
        )
}

fn report() -> impl Strategy<Value = AgentReport> {
    (
        (
            any::<bool>(),
            prop_oneof![3 => Just(0u64), 1 => 1u64..3],
            proptest::option::weighted(0.2, time()),
        ),
        proptest::option::weighted(0.3, time()),
        (any::<bool>(), any::<bool>()),
        proptest::option::of((any::<bool>(), proptest::option::of(0u8..3))),
    )
        .prop_map(
            |((busy, sessions, input), heartbeat, (drain, reload), rotation)| AgentReport {
                overlay_ref: OLD.into(),
                activity: Some(if busy { Activity::Busy } else { Activity::Idle }),
                live_sessions: Some(sessions),
                last_input_at: input,
                heartbeat_at: heartbeat,
                capabilities: [
                    drain.then_some(Capability::Drain),
                    reload.then_some(Capability::Reload),
                ]
                .into_iter()
                .flatten()
                .collect(),
                rotation: rotation.map(|(fenced, checkpoint)| RotationState {
                    fenced,
                    checkpoint: checkpoint.map(|t| format!("tag-{t}")),
                }),
            },
        )
}

fn status() -> impl Strategy<Value = MachineStatus> {
    prop_oneof![
        1 => Just(MachineStatus::OnTip),
        6 => Just(MachineStatus::Drifted),
        1 => Just(MachineStatus::UnknownRef),
        1 => Just(MachineStatus::Unreachable),
        1 => Just(MachineStatus::BadReport),
        1 => Just(MachineStatus::NotRunning),
    ]
}

#[derive(Clone, Debug)]
struct Machine {
    pool: usize,
    status: MachineStatus,
    started: bool,
    severity: Severity,
    report: AgentReport,
    held: bool,
    approval: Option<(CommitId, bool)>,
    marker: Option<Marker>,
    garbage_marker: bool,
    unprobed: Option<DateTime<Utc>>,
    slotted: bool,
    /// Fly shows no metadata (host not ok).
    metadata_unknown: bool,
    /// The machine's instance as listed (`i1` unless updated from outside).
    instance_id: String,
}

fn machine() -> impl Strategy<Value = Machine> {
    (
        (
            0usize..3,
            status(),
            prop::bool::weighted(0.9),
            severity(),
            report(),
        ),
        (
            prop::bool::weighted(0.15),
            proptest::option::weighted(0.7, (commit(), any::<bool>())),
            proptest::option::weighted(0.7, marker()),
            prop::bool::weighted(0.05),
        ),
        (
            proptest::option::of(time()),
            prop::bool::weighted(0.8),
            prop::bool::weighted(0.1),
            prop_oneof![4 => Just("i1".to_string()), 1 => Just("i2".to_string())],
        ),
    )
        .prop_map(
            |(
                (pool, status, started, severity, report),
                (held, approval, marker, garbage_marker),
                (unprobed, slotted, metadata_unknown, instance_id),
            )| Machine {
                pool,
                status,
                started,
                severity,
                report,
                held,
                approval,
                marker,
                garbage_marker,
                unprobed,
                slotted,
                metadata_unknown,
                instance_id,
            },
        )
}

/// The machine as the sweep would see it, and the verdict `prepare` would
/// give it.
/// The metadata value of the approval of `target` (`now`, else `when-idle`).
fn approval_value(target: &CommitId, now: bool) -> String {
    let a = Approval {
        target: target.clone(),
        mode: if now {
            ApprovalMode::Now
        } else {
            ApprovalMode::WhenIdle
        },
        by: "op".into(),
        at: t0(),
    };
    serde_json::to_string(&a).unwrap_or_default()
}

fn to_report(policy: &Policy, i: usize, m: &Machine) -> (ObservedMachine, Option<Verdict>) {
    let pool = POOLS[m.pool];
    let mut metadata = BTreeMap::from([("pool".to_string(), pool.to_string())]);
    if m.held {
        metadata.insert(HOLD_KEY.into(), "ops".into());
    }
    if let Some((target, now)) = &m.approval {
        metadata.insert(APPROVE_KEY.into(), approval_value(target, *now));
    }
    if let Some(mk) = &m.marker {
        metadata.insert(MARKER_KEY.into(), mk.to_value());
    }
    if m.garbage_marker {
        metadata.insert(MARKER_KEY.into(), "{garbage".into());
    }
    if let Some(since) = m.unprobed {
        let u = Unprobed {
            since,
            action: PolicyAction::AlertAndWait,
            severity: Severity::Low,
        };
        metadata.insert(UNPROBED_KEY.into(), u.to_value());
    }
    let usable = matches!(
        m.status,
        MachineStatus::OnTip | MachineStatus::Drifted | MachineStatus::UnknownRef
    );
    let status = if m.started {
        m.status
    } else {
        MachineStatus::NotRunning
    };
    let classified = status.is_classified();
    if m.metadata_unknown {
        // Fly shows no config: no metadata, and the pool label falls back.
        metadata.clear();
    }
    let mut report = m.report.clone();
    if status == MachineStatus::OnTip {
        report.overlay_ref = TIP.into();
    }
    let verdict = classified.then(|| Verdict {
        severity: m.severity,
        action: policy.action(&pool.into(), m.severity),
        reason: SharedReason(std::sync::Arc::new(Reason {
            rule: RuleMatch::NoMatch { level: m.severity },
            evidence: Vec::new(),
            behind: None,
            missing: Vec::new(),
            evidence_partial: false,
        })),
    });
    let seen = ObservedMachine {
        region: "iad".into(),
        pool: pool.into(),
        state: if m.started { "started" } else { "stopped" }.into(),
        status,
        reported_ref: (usable && m.started).then(|| report.overlay_ref.clone()),
        commit: (status == MachineStatus::Drifted)
            .then(|| fleet_reconciler::model::CommitId::parse(OLD))
            .flatten(),
        inputs: MachineInputs {
            report: (usable && m.started).then_some(report),
            metadata,
            unusual: m.metadata_unknown.then(|| {
                Box::new(Unusual {
                    metadata_unknown: Some("host_status unreachable".to_string()),
                    ..Unusual::default()
                })
            }),
            instance_id: m.instance_id.clone(),
            health_url: Some(format!("http://agents/m{i}/health")),
            ..MachineInputs::default()
        },
        ..ObservedMachine::listed(
            "app",
            &format!("m{i}"),
            &format!("m{i}"),
            fleet_reconciler::model::MachineState::Stopped,
        )
    };
    (seen, verdict)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn the_planner_keeps_every_promise(
        machines in prop::collection::vec(machine(), 1..8),
        first_seen in -7200i64..0,
        now in 0i64..20000,
        slots in 0u8..3,
        fetch_failing in any::<bool>(),
        max_attempts in 1u32..4,
    ) {
        let config = config();
        let policy = policy(max_attempts);
        let slots_known = slots == 0;
        let slots_unknown = slots == 1;
        let now = t0() + Cd::seconds(now);
        let (seen, verdicts): (Vec<ObservedMachine>, Vec<Option<Verdict>>) =
            machines.iter().enumerate().map(|(i, m)| to_report(&policy, i, m)).unzip();
        let mut verdicts = verdicts.into_iter();
        let mut report = Snapshot::judged(
            observation(
                &config,
                &Tip { branch: "release".into(), commit: CommitId::parse(TIP).unwrap() },
                seen,
            ),
            |_| verdicts.next().flatten().map(std::sync::Arc::new),
        );
        if slots_known {
            let mut set = SlotSet::parse(None).unwrap();
            for (i, m) in machines.iter().enumerate() {
                if let (true, Some(mk)) = (m.slotted, &m.marker) {
                    set.try_add(&"app".into(), &POOLS[m.pool].into(), Slot {
                        machine_id: format!("m{i}").into(),
                        tag: mk.tag.clone(),
                        owner: "other".into(),
                        since: t0(),
                    }, 10);
                }
            }
            report.slots = SlotsView::Known(set.clone());
        }
        if slots_unknown {
            report.slots = SlotsView::Unknown("coordinator host unreachable".into());
        }
        let mut tracker = Tracker::default();
        tracker.observe(&report, t0() + Cd::seconds(first_seen));
        tracker.observe(&report, now);
        let fetch = FetchState { fetched_at: Some(now), failing: fetch_failing };
        let p = plan(&PlanInput { policy: &policy, snapshot: &report, tracker: &tracker, owner: "r", fetch, now });

        let by_id: HashMap<&str, (&Machine, &JudgedMachine)> = machines
            .iter()
            .zip(&report.machines)
            .map(|(m, r)| (r.seen.machine_id.as_str(), (m, r)))
            .collect();
        // One step per machine.
        let mut seen = std::collections::HashSet::new();
        for s in p.steps() {
            prop_assert!(seen.insert(s.target.machine_id.clone()), "two steps for {}", s.target.machine_id);
        }
        // Claims never go past a pool's cap (rotations holding slots count).
        // Known: the coordinator's slots, plus readable markers holding
        // capacity without one. Otherwise every marker that may hold one.
        let mut out: HashMap<&str, usize> = HashMap::new();
        for (m, _) in by_id.values() {
            // Unreadable: garbage, or timestamps too far from now to be ours.
            let near = |t: DateTime<Utc>| (t - now).abs() <= Cd::days(366);
            let readable = m.marker.as_ref().filter(|mk| {
                !m.garbage_marker
                    && !m.metadata_unknown
                    && [Some(mk.started_at), Some(mk.attempt_started_at), mk.restart_at, mk.retry_at]
                        .into_iter()
                        .flatten()
                        .all(near)
            });
            let holds = if slots_known {
                // A slot is live while its machine may still need it: hidden
                // metadata, an unreadable marker, or its rotation in progress.
                let live = m.slotted
                    && m.marker.as_ref().is_some_and(|mk| {
                        m.metadata_unknown
                            || readable.is_none()
                            || mk.phase.holds_slot()
                            || mk.phase == Phase::Claiming
                    });
                // Without its slot, a rotation being undone on a machine
                // that stopped (autostop) serves nothing either way: its
                // slot was let go so the pool is not starved (docs/safety.md,
                // "Why the cap holds", 3), so it counts only while started.
                live || readable.is_some_and(|mk| {
                    mk.phase.holds_slot() && (mk.phase != Phase::Releasing || m.started)
                })
            } else {
                m.metadata_unknown
                    || m.garbage_marker
                    || m.marker.as_ref().is_some_and(|mk| mk.phase.holds_slot())
            };
            if holds {
                *out.entry(POOLS[m.pool]).or_default() += 1;
            }
        }
        let mut claims: HashMap<&str, usize> = HashMap::new();
        for s in p.steps() {
            let (m, r) = by_id[s.target.machine_id.as_str()];
            // Never act on a held machine, nor on one whose hold cannot be seen.
            prop_assert!(!m.held, "step on a held machine: {s}");
            prop_assert!(!m.metadata_unknown, "step on a machine whose metadata is unknown: {s}");
            let disruptive = matches!(s.kind,
                StepKind::Claim { .. } | StepKind::Drain | StepKind::Restart { .. }
                | StepKind::Advance { cordon: true, .. });
            if disruptive {
                prop_assert!(m.started, "disruptive step on a stopped machine: {s}");
                // Unknown is not empty: nothing that needs a slot.
                prop_assert!(!slots_unknown, "{s} while the slot set is unknown");
                // Updated from outside: the rotation is never continued.
                let updated = s.expected.as_ref()
                    .and_then(|e| e.instance_id.as_deref())
                    .is_some_and(|ours| ours != m.instance_id)
                    && s.expected.as_ref().is_some_and(|e| e.phase.holds_slot());
                prop_assert!(!updated, "{s} after an outside update");
            }
            // A failed rotation is not retried for its target unasked.
            if let (StepKind::Claim { .. }, Some(e)) = (&s.kind, s.expected.as_ref())
                && let Some(f) = &e.failed
                && e.phase == Phase::Yielded
                && e.target == tip()
            {
                // Only by an approval of the tip other than the one that
                // stood when it failed (no two clocks compared).
                let new_approval = m
                    .approval
                    .as_ref()
                    .filter(|(t, _)| *t == tip())
                    .map(|(t, now)| ApprovalId::of(&approval_value(t, *now)))
                    .is_some_and(|id| f.approval.as_ref() != Some(&id));
                prop_assert!(new_approval, "{s} retries a failed rotation");
            }
            // No new attempt once rotation.max_attempts restarts failed.
            if let (StepKind::Advance { marker, .. }, Some(e)) = (&s.kind, s.expected.as_ref())
                && e.phase == Phase::Backoff
                && marker.phase == Phase::Draining
            {
                prop_assert!(e.attempt < max_attempts, "{s} after {} failed attempts", e.attempt);
            }
            if let StepKind::Claim { .. } = s.kind {
                prop_assert!(!fetch_failing, "claim on an uncertain tip: {s}");
                // Completing our own claim whose slot is already won takes
                // no new slot: that slot is counted in use above.
                let completes_won = slots_known
                    && m.slotted
                    && s.expected.as_ref().is_some_and(|e| e.phase == Phase::Claiming);
                if !completes_won {
                    *claims.entry(POOLS[m.pool]).or_default() += 1;
                }
            }
            if let StepKind::Restart { marker, guard, .. } = &s.kind {
                let expected = s.expected.as_ref().expect("a restart continues a rotation");
                // A manual machine only with an approval naming its commit.
                if expected.action == PolicyAction::Manual {
                    let approved = m.approval.as_ref().is_some_and(|(t, _)| marker.target == *t);
                    prop_assert!(approved, "manual restart without a current approval: {s}");
                    prop_assert_eq!(&marker.target, &tip());
                }
                match guard {
                    // Live work only where the policy says so.
                    RestartGuard::MayInterrupt => {
                        let grace = expected.mode == RotationMode::Grace
                            && expected.action == PolicyAction::Restart
                            && policy.action(&POOLS[m.pool].into(), expected.severity)
                                == PolicyAction::Restart
                            && expected.attempt_started_at
                                .checked_add_signed(Cd::from_std(policy.rotation.restart_grace).unwrap())
                                .is_some_and(|t| t <= now);
                        let approved_now = expected.mode == RotationMode::Now
                            && m.approval.as_ref().is_some_and(|(t, now)| *now && t == &expected.target);
                        prop_assert!(grace || (approved_now && expected.action == PolicyAction::Manual),
                            "may interrupt without grace or approval: {s} from {expected:?}");
                    }
                    RestartGuard::Idle => {
                        let r = r.seen.inputs.report.as_ref().expect("idle is judged on a report");
                        prop_assert!(restart_allowed(&policy, r, expected, now).is_ok(), "{s}");
                    }
                    RestartGuard::Unprobeable => {
                        prop_assert!(matches!(r.seen.status, MachineStatus::Unreachable | MachineStatus::BadReport), "{s}");
                        prop_assert!(matches!(expected.action,
                            PolicyAction::AlertAndWait | PolicyAction::Restart | PolicyAction::Reload), "{s}");
                        prop_assert!(POOLS[m.pool] != "manual", "a ceiling restart in a manual pool: {s}");
                    }
                }
            }
        }
        for (pool, n) in claims {
            let cap = policy.pool(&pool.into()).max_concurrent_rotations.get() as usize;
            let used = out.get(pool).copied().unwrap_or(0);
            prop_assert!(used + n <= cap.max(used), "pool {pool}: {used} in use + {n} claims > cap {cap}");
        }
    }
}

//! Planner unit tests: fixtures in, steps and alerts out. No network, no clock.

use chrono::{DateTime, Duration as Cd, Utc};

use super::*;
use crate::config::Config;
use crate::decide::decision::Decision;
use crate::decide::reason::{Reason, RuleMatch, SharedReason};
use crate::decide::snapshot::{Snapshot, Verdict};
use crate::metadata::marker::{Ending, Marker, Phase, RotationMode};
use crate::metadata::operator::{Approval, ApprovalMode};
use crate::metadata::{APPROVE_KEY, HOLD_KEY, MARKER_KEY, UNPROBED_KEY};
use crate::model::{AppName, CommitId, MachineId};
use crate::observe::probe::{Activity, AgentReport, Capability, RotationState};
use crate::observe::sweep::{MachineInputs, ObservedMachine, SlotsView};

const TIP: &str = "1111111111111111111111111111111111111111";
const OLD: &str = "2222222222222222222222222222222222222222";

/// The record keys the fixtures' reconciler holds.
static KEYS: std::sync::LazyLock<crate::metadata::seal::RecordKeys> =
    std::sync::LazyLock::new(|| {
        crate::metadata::seal::RecordKeys::new(
            crate::metadata::seal::RecordKey::from_hex(&"7e".repeat(32)).expect("a key"),
        )
    });

/// `body` as the reconciler (or an operator) writes it under `key` on `id`: sealed.
fn sealed(id: &str, key: &str, body: &str) -> String {
    KEYS.seal(id, key, body)
}

fn mid(id: &str) -> MachineId {
    MachineId::from(id)
}

fn commit(id: &str) -> CommitId {
    CommitId::parse(id).expect("a commit id")
}

fn t0() -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).unwrap()
}

fn config(extra: &str) -> Config {
    crate::config::test_config(&format!(
        r#"
[pools.default]
max_concurrent_rotations = 1
actions = {{ low = "alert-and-wait", medium = "restart", high = "manual", critical = "reload" }}
[pools.wide]
max_concurrent_rotations = 2
actions = {{ low = "observe", medium = "alert-and-wait", high = "alert-and-wait", critical = "alert-and-wait" }}
{extra}
"#
    ))
}

/// The policy of `config("")`, built directly: `default` (cap 1) and
/// `wide` (cap 2) pools, built-in rotation and severity rules.
fn policy() -> Policy {
    use crate::config::{ActionMap, PoolConfig};
    use PolicyAction::{AlertAndWait, Manual, Observe, Reload, Restart};
    use std::num::NonZeroU32;
    let pool = |cap: u32, actions: [PolicyAction; 4]| PoolConfig {
        max_concurrent_rotations: NonZeroU32::new(cap).unwrap(),
        actions: ActionMap::from(actions),
        ..PoolConfig::default()
    };
    Policy::default()
        .with_pool("default", pool(1, [AlertAndWait, Restart, Manual, Reload]))
        .with_pool(
            "wide",
            pool(2, [Observe, AlertAndWait, AlertAndWait, AlertAndWait]),
        )
}

#[test]
fn the_direct_policy_is_the_configs() {
    let (direct, parsed) = (policy(), Policy::from_config(&config("")));
    for pool in ["default", "wide", "other"].map(PoolName::from) {
        assert_eq!(
            direct.pool(&pool).actions,
            parsed.pool(&pool).actions,
            "{pool}"
        );
        assert_eq!(
            direct.pool(&pool).max_concurrent_rotations,
            parsed.pool(&pool).max_concurrent_rotations,
            "{pool}"
        );
    }
    assert_eq!(direct.rotation.retry_after, parsed.rotation.retry_after);
}

/// A machine fixture, chainable: the machine as seen, and its verdict.
#[derive(Clone)]
struct M(ObservedMachine, Option<Verdict>);

/// A reason for fixtures' verdicts (the planner reads only its rule's text).
fn some_reason() -> SharedReason {
    SharedReason(std::sync::Arc::new(Reason {
        rule: RuleMatch::NoMatch {
            level: Severity::Low,
        },
        evidence: Vec::new(),
        behind: Some(3),
        missing: Vec::new(),
        evidence_partial: false,
    }))
}

/// The snapshot of `machines` against the tip: each machine's controls
/// parsed from its metadata, as the sweep parses them, and its verdict.
fn snapshot(config: &Config, machines: Vec<M>) -> Snapshot {
    let tip = crate::observe::overlay::Tip {
        branch: "release".into(),
        commit: crate::model::CommitId::parse(TIP).unwrap(),
    };
    let (seen, verdicts): (Vec<ObservedMachine>, Vec<Option<Verdict>>) =
        machines.into_iter().map(|M(m, v)| (m, v)).unzip();
    let mut verdicts = verdicts.into_iter();
    // As the daemon sweeps: only records sealed by its key count.
    let observation = crate::observe::sweep::observation_with(
        config,
        crate::metadata::controls::Trust::Verify(&KEYS),
        &tip,
        seen,
    );
    Snapshot::judged(observation, |_| {
        verdicts.next().flatten().map(std::sync::Arc::new)
    })
}

impl M {
    fn on_tip(id: &str) -> M {
        M(
            ObservedMachine {
                region: "iad".into(),
                status: MachineStatus::OnTip,
                reported_ref: Some(TIP.into()),
                commit: CommitId::parse(TIP),
                commits_behind: Some(0),
                commits_ahead: Some(0),
                inputs: MachineInputs {
                    report: Some(AgentReport {
                        overlay_ref: TIP.into(),
                        activity: Some(Activity::Idle),
                        live_sessions: Some(0),
                        last_input_at: None,
                        heartbeat_at: None,
                        capabilities: vec![],
                        rotation: None,
                    }),
                    health_url: Some(format!("http://agents/{id}/health")),
                    ..MachineInputs::default()
                },
                ..ObservedMachine::listed("app", id, id, crate::model::MachineState::Started)
            },
            None,
        )
    }

    /// Drifted at `severity`, with the action the `default` pool maps it to.
    fn drifted(id: &str, severity: Severity) -> M {
        let mut m = M::on_tip(id);
        m.0.status = MachineStatus::Drifted;
        m.0.reported_ref = Some(OLD.into());
        m.0.commit = CommitId::parse(OLD);
        m.0.commits_behind = Some(3);
        m.1 = Some(Verdict {
            severity,
            action: policy().action(&"default".into(), severity),
            reason: some_reason(),
        });
        if let Some(r) = m.0.inputs.report.as_mut() {
            r.overlay_ref = OLD.into();
        }
        m
    }

    fn pool(mut self, pool: &str, action: PolicyAction) -> M {
        self.0.pool = pool.into();
        self.0.inputs.metadata.insert("pool".into(), pool.into());
        if let Some(v) = &mut self.1 {
            v.action = action;
        }
        self
    }

    fn busy(mut self) -> M {
        if let Some(r) = self.0.inputs.report.as_mut() {
            r.activity = Some(Activity::Busy);
            r.live_sessions = Some(1);
        }
        self
    }

    fn input_at(mut self, at: DateTime<Utc>) -> M {
        if let Some(r) = self.0.inputs.report.as_mut() {
            r.last_input_at = Some(at);
        }
        self
    }

    fn cooperative(mut self, checkpoint: Option<&str>, heartbeat: DateTime<Utc>) -> M {
        if let Some(r) = self.0.inputs.report.as_mut() {
            r.capabilities = vec![Capability::Drain];
            r.heartbeat_at = Some(heartbeat);
            r.rotation = Some(RotationState {
                fenced: checkpoint.is_some(),
                checkpoint: checkpoint.map(str::to_string),
            });
        }
        self
    }

    fn reloadable(mut self) -> M {
        if let Some(r) = self.0.inputs.report.as_mut() {
            r.capabilities.push(Capability::Reload);
        }
        self
    }

    fn unreachable(mut self) -> M {
        self.0.status = MachineStatus::Unreachable;
        self.0.inputs.report = None;
        self.0.reported_ref = None;
        self.1 = None;
        self
    }

    fn held(mut self) -> M {
        self.0
            .inputs
            .metadata
            .insert(HOLD_KEY.into(), "ops: incident".into());
        self
    }

    fn approved(self, target: &str, mode: ApprovalMode) -> M {
        let a = Approval {
            target: commit(target),
            mode,
            by: "alice".into(),
            at: t0(),
        };
        self.put(APPROVE_KEY, &serde_json::to_string(&a).unwrap())
    }

    fn marker(self, marker: &Marker) -> M {
        self.put(MARKER_KEY, &marker.to_value())
    }

    /// `body` under `key`, sealed as the reconciler or an operator writes it.
    fn put(mut self, key: &str, body: &str) -> M {
        let value = sealed(self.0.machine_id.as_str(), key, body);
        self.0.inputs.metadata.insert(key.into(), value);
        self
    }
}

fn marker(id: &str, phase: Phase, mode: RotationMode, since: DateTime<Utc>) -> Marker {
    Marker {
        tag: Marker::new_tag(id, &commit(TIP), since, 7),
        target: commit(TIP),
        phase,
        mode,
        action: PolicyAction::AlertAndWait,
        severity: Severity::Low,
        started_at: since,
        attempt_started_at: since,
        attempt: 0,
        owner: "r1".into(),
        restart_at: (phase == Phase::Restarting).then_some(since),
        retry_at: None,
        drain_requested: false,
        cordoned: None,
        ending: None,
        instance_id: None,
        pool: None,
        failed: None,
        approval: None,
    }
}

/// A fetch that succeeded after everything these fixtures observe.
fn fetched() -> FetchState {
    FetchState {
        fetched_at: Some(t0() + Cd::days(365)),
        failing: false,
    }
}

struct Fx {
    /// Only for building the report (its apps).
    config: Config,
    policy: Policy,
    machines: Vec<M>,
    tracker: Tracker,
}

impl Fx {
    fn new(extra: &str) -> Fx {
        Fx {
            config: config(extra),
            policy: policy(),
            machines: Vec::new(),
            tracker: Tracker::default(),
        }
    }

    fn rotation(mut self, set: impl FnOnce(&mut crate::config::RotationConfig)) -> Fx {
        set(&mut self.policy.rotation);
        self
    }

    fn with(mut self, m: M) -> Fx {
        self.machines.push(m);
        self
    }

    fn report(&self) -> Snapshot {
        snapshot(&self.config, self.machines.clone())
    }

    /// Observes the fleet at `first_seen` (starting drift clocks), then plans at `now`.
    fn plan_at(&mut self, first_seen: DateTime<Utc>, now: DateTime<Utc>) -> Plan {
        let report = self.report();
        self.tracker.observe(&report, first_seen);
        self.tracker.observe(&report, now);
        plan(&PlanInput {
            policy: &self.policy,
            snapshot: &report,
            tracker: &self.tracker,
            owner: "r1",
            fetch: fetched(),
            now,
        })
    }
}

/// Steps other than the probe-failure record's bookkeeping.
fn rotation_steps(plan: &Plan) -> Vec<&Step> {
    plan.steps()
        .into_iter()
        .filter(|s| {
            !matches!(
                s.kind,
                StepKind::RecordUnprobed { .. } | StepKind::ClearUnprobed
            )
        })
        .collect()
}

fn kinds(plan: &Plan) -> Vec<(&str, &str)> {
    plan.steps()
        .into_iter()
        .map(|s| (s.target.machine_id.as_str(), s.kind()))
        .collect()
}

fn alerts(plan: &Plan, kind: AlertKind) -> Vec<&str> {
    plan.alerts
        .iter()
        .filter(|a| a.kind == kind)
        .filter_map(|a| a.machine_id.as_ref().map(MachineId::as_str))
        .collect()
}

fn restart_of<'a>(plan: &'a Plan, id: &str) -> Option<(&'a Marker, bool)> {
    let id = MachineId::from(id);
    plan.steps().into_iter().find_map(|s| match &s.kind {
        StepKind::Restart { marker, guard, .. } if s.target.machine_id == id => {
            Some((marker, *guard == RestartGuard::MayInterrupt))
        }
        _ => None,
    })
}

// ---- drift grace period --------------------------------------------------

#[test]
fn young_drift_triggers_nothing_and_aged_drift_alerts_and_claims() {
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low));
    let young = fx.plan_at(t0(), t0() + Cd::seconds(119));
    assert!(
        young.steps().is_empty() && young.alerts.is_empty(),
        "{young:?}"
    );

    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low));
    let aged = fx.plan_at(t0(), t0() + Cd::seconds(120));
    assert_eq!(alerts(&aged, AlertKind::Drift), ["m1"]);
    assert_eq!(kinds(&aged), [("m1", "claim")]);
    let StepKind::Claim {
        marker,
        drain,
        reload,
    } = &aged.steps()[0].kind
    else {
        panic!()
    };
    assert_eq!(
        (marker.phase, marker.mode, *drain, *reload),
        (Phase::Claiming, RotationMode::Wait, false, false)
    );
    assert_eq!(marker.target, CommitId::parse(TIP).unwrap());
    assert_eq!(aged.steps()[0].expected, None);
}

/// One entry per machine, each with at most one step: a claim takes the
/// place of the same machine's bookkeeping, and starts after the steps of
/// rotations in progress and of bookkeeping (report order), as before.
#[test]
fn each_machine_has_one_entry_and_claims_start_last() {
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("")
        .with(
            M::drifted("a", Severity::Medium)
                .pool("wide", PolicyAction::AlertAndWait)
                .unprobed_since(t0()),
        )
        .with(M::drifted("b", Severity::Low).marker(&marker(
            "b",
            Phase::Draining,
            RotationMode::Wait,
            t0(),
        )))
        .with(M::on_tip("c").unprobed_since(t0()));
    let plan = fx.plan_at(t0(), now);
    assert_eq!(
        kinds(&plan),
        [("b", "restart"), ("c", "clear_unprobed"), ("a", "claim")]
    );
    assert_eq!(
        plan.machines
            .keys()
            .map(|id| id.as_str())
            .collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
    let a = &plan.machines[&mid("a")];
    assert!(matches!(a.decision, Decision::Claiming { .. }), "{a:?}");
    assert_eq!(a.step.as_ref().map(Step::kind), Some("claim"));
    assert_eq!(a.drift_since, Some(t0()));
    assert_eq!(plan.machines[&mid("c")].decision, Decision::OnTip);
    assert_eq!(plan.machines[&mid("c")].drift_since, None);
}

#[test]
fn drift_clock_restarts_when_the_machine_was_on_tip_in_between() {
    let mut tracker = Tracker::default();
    let fx = Fx::new("").with(M::drifted("m1", Severity::Low));
    let drifted = fx.report();
    let healthy = Fx::new("").with(M::on_tip("m1")).report();
    tracker.observe(&drifted, t0());
    tracker.observe(&healthy, t0() + Cd::seconds(60));
    tracker.observe(&drifted, t0() + Cd::seconds(200));
    assert_eq!(
        tracker.drift_since(&mid("m1")),
        Some(t0() + Cd::seconds(200))
    );
}

/// `check` sweeps once and plans nothing: its tracker keeps no entry per
/// machine (at 10,000 machines that map was ≈ 1.5 MiB of its peak RSS).
#[test]
fn a_one_shot_tracker_keeps_nothing() {
    let drifted = Fx::new("").with(M::drifted("m1", Severity::Low)).report();
    let mut kept = Tracker::default();
    kept.observe(&drifted, t0());
    assert_eq!(kept.drift_since(&mid("m1")), Some(t0()));
    let mut one_shot = Tracker::one_shot();
    one_shot.observe(&drifted, t0());
    assert_eq!(one_shot.drift_since(&mid("m1")), None);
    assert!(one_shot.machines.is_empty());
}

#[test]
fn a_missed_probe_neither_clears_nor_restarts_a_drift() {
    let cfg = policy();
    let drifted = Fx::new("").with(M::drifted("m1", Severity::High)).report();
    let mut bad = M::drifted("m1", Severity::High).unreachable();
    bad.0.status = MachineStatus::BadReport;
    let gone = Fx::new("")
        .with(M::drifted("m1", Severity::High).unreachable())
        .report();
    let garbled = Fx::new("").with(bad).report();
    let mut tracker = Tracker::default();
    tracker.observe(&drifted, t0());
    for (i, report) in [&gone, &garbled].into_iter().enumerate() {
        let now = t0() + Cd::minutes(10 + i as i64);
        tracker.observe(report, now);
        let p = plan(&PlanInput {
            policy: &cfg,
            snapshot: report,
            tracker: &tracker,
            owner: "r",
            fetch: fetched(),
            now,
        });
        let drift: Vec<_> = p
            .alerts
            .iter()
            .filter(|a| a.kind == AlertKind::Drift)
            .collect();
        assert_eq!(drift.len(), 1, "case {i}: the drift alert keeps firing");
        assert_eq!(drift[0].severity, Severity::High);
        assert!(
            p.steps().is_empty(),
            "nothing is claimed on carried knowledge"
        );
    }
    tracker.observe(&drifted, t0() + Cd::minutes(20));
    assert_eq!(
        tracker.drift_since(&mid("m1")),
        Some(t0()),
        "the drift clock did not restart"
    );
    let healthy = Fx::new("").with(M::on_tip("m1")).report();
    tracker.observe(&healthy, t0() + Cd::minutes(21));
    let p = plan(&PlanInput {
        policy: &cfg,
        snapshot: &healthy,
        tracker: &tracker,
        owner: "r",
        fetch: fetched(),
        now: t0() + Cd::minutes(21),
    });
    assert!(p.alerts.is_empty());
}

// ---- holds and approvals -------------------------------------------------

#[test]
fn a_held_machine_is_never_acted_on_and_its_hold_never_cleared() {
    let later = t0() + Cd::hours(10);
    for m in [
        M::drifted("m1", Severity::Low).held(),
        M::drifted("m1", Severity::Low).held().marker(&marker(
            "m1",
            Phase::Draining,
            RotationMode::Now,
            t0(),
        )),
        M::on_tip("m1")
            .held()
            .marker(&marker("m1", Phase::Restarting, RotationMode::Wait, t0())),
        M::drifted("m1", Severity::Low).held().marker(&marker(
            "m1",
            Phase::Draining,
            RotationMode::Wait,
            t0(),
        )),
    ] {
        let mut fx = Fx::new("").with(m);
        let plan = fx.plan_at(t0(), later);
        assert!(
            plan.steps().is_empty(),
            "held machine got steps: {:?}",
            plan.steps()
        );
        assert_eq!(
            plan.decisions()
                .get(&mid("m1"))
                .map(Decision::label)
                .as_deref(),
            Some("held")
        );
    }
    // It is still reported as drifting.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).held());
    assert_eq!(alerts(&fx.plan_at(t0(), later), AlertKind::Drift), ["m1"]);
}

#[test]
fn manual_waits_for_an_approval_of_the_current_tip() {
    let later = t0() + Cd::hours(1);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::High));
    let plan = fx.plan_at(t0(), later);
    assert!(plan.steps().is_empty());
    assert_eq!(alerts(&plan, AlertKind::ManualApprovalRequired), ["m1"]);

    // An approval of another commit authorizes nothing.
    let mut fx =
        Fx::new("").with(M::drifted("m1", Severity::High).approved(OLD, ApprovalMode::Now));
    let plan = fx.plan_at(t0(), later);
    assert!(plan.steps().is_empty());
    assert_eq!(alerts(&plan, AlertKind::ManualApprovalRequired), ["m1"]);

    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::High)
            .approved(TIP, ApprovalMode::Now)
            .input_at(later),
    );
    let plan = fx.plan_at(t0(), later);
    let StepKind::Claim { marker, .. } = &plan.steps()[0].kind else {
        panic!("{plan:?}")
    };
    assert_eq!(
        marker.mode,
        RotationMode::Now,
        "approve = go now, even with recent input"
    );
    assert!(alerts(&plan, AlertKind::ManualApprovalRequired).is_empty());

    let mut fx =
        Fx::new("").with(M::drifted("m1", Severity::High).approved(TIP, ApprovalMode::WhenIdle));
    let StepKind::Claim { marker, .. } = &fx.plan_at(t0(), later).steps()[0].kind.clone() else {
        panic!()
    };
    assert_eq!(marker.mode, RotationMode::Wait);
}

#[test]
fn approve_now_restarts_live_work_and_when_idle_does_not() {
    let now = t0() + Cd::seconds(30);
    let mut m = marker("m1", Phase::Draining, RotationMode::Now, t0());
    m.action = PolicyAction::Manual;
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::High)
            .busy()
            .approved(TIP, ApprovalMode::Now)
            .marker(&m),
    );
    let plan = fx.plan_at(t0(), now);
    let (next, interrupts) = restart_of(&plan, "m1").expect("approved now: restart");
    assert!(interrupts);
    assert_eq!(next.phase, Phase::Restarting);
    // The marker alone authorizes nothing: without a standing "now" approval
    // (or in a pool that is not `restart`), live work is waited for.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::High).busy().marker(&m));
    assert!(restart_of(&fx.plan_at(t0(), now), "m1").is_none());
    let mut wrong_pool = m.clone();
    wrong_pool.action = PolicyAction::Restart;
    wrong_pool.mode = RotationMode::Grace;
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::High).busy().marker(&wrong_pool));
    assert!(restart_of(&fx.plan_at(t0(), now), "m1").is_none());

    let mut m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    m.action = PolicyAction::Manual;
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::High)
            .busy()
            .approved(TIP, ApprovalMode::WhenIdle)
            .marker(&m),
    );
    assert!(fx.plan_at(t0(), t0() + Cd::minutes(59)).steps().is_empty());
}

#[test]
fn finishing_a_manual_rotation_consumes_the_approval() {
    let m = marker("m1", Phase::Restarting, RotationMode::Now, t0());
    let mut fx = Fx::new("").with(M::on_tip("m1").approved(TIP, ApprovalMode::Now).marker(&m));
    let plan = fx.plan_at(t0(), t0() + Cd::seconds(40));
    let StepKind::Release {
        clear_approval,
        undrain,
        marker: next,
        ..
    } = &plan.steps()[0].kind
    else {
        panic!("{plan:?}")
    };
    assert!(*clear_approval && *undrain != Undrain::Needed);
    assert_eq!(next.ending, Some(Ending::Finished));
    assert_eq!(plan.steps()[0].expected.as_ref(), Some(&m));
}

// ---- alert-and-wait and restart ---------------------------------------------

#[test]
fn alert_and_wait_never_restarts_live_work() {
    let m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    for busy in [
        M::drifted("m1", Severity::Low).busy(),
        M::drifted("m1", Severity::Low).input_at(t0() + Cd::minutes(55)),
        M::drifted("m1", Severity::Low).unreachable(),
    ] {
        for minutes in [0, 1, 10, 59] {
            let mut fx = Fx::new("").with(busy.clone().marker(&m));
            let plan = fx.plan_at(t0(), t0() + Cd::minutes(minutes));
            assert!(
                restart_of(&plan, "m1").is_none(),
                "restarted at +{minutes}m: {:?}",
                plan.steps()
            );
        }
    }
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&m));
    let (_, interrupts) =
        restart_of(&fx.plan_at(t0(), t0() + Cd::minutes(3)), "m1").expect("idle: restart");
    assert!(!interrupts);
}

#[test]
fn restart_interrupts_work_only_after_its_grace() {
    let mut m = marker("m1", Phase::Draining, RotationMode::Grace, t0());
    m.action = PolicyAction::Restart;
    m.severity = Severity::Medium;
    // (The grace counts from the cordon Fly shows: seen cordoned at t0.)
    let busy = M::drifted("m1", Severity::Medium)
        .busy()
        .fly_cordoned(true)
        .marker(&m);
    let mut fx = Fx::new("").with(busy.clone());
    assert!(restart_of(&fx.plan_at(t0(), t0() + Cd::seconds(59)), "m1").is_none());
    let mut fx = Fx::new("").with(busy);
    let plan = fx.plan_at(t0(), t0() + Cd::seconds(60));
    let (next, interrupts) = restart_of(&plan, "m1").unwrap();
    assert!(interrupts);
    assert_eq!(next.restart_at, Some(t0() + Cd::seconds(60)));
    // Idle before the grace: restarted at once, interrupting nothing.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Medium).marker(&m));
    let (_, interrupts) = restart_of(&fx.plan_at(t0(), t0() + Cd::seconds(5)), "m1").unwrap();
    assert!(!interrupts);
}

#[test]
fn recent_input_keeps_a_machine_out_of_rotation() {
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).input_at(now - Cd::minutes(9)));
    let plan = fx.plan_at(t0(), now);
    assert!(plan.steps().is_empty());
    assert_eq!(
        plan.decisions()
            .get(&mid("m1"))
            .map(Decision::label)
            .as_deref(),
        Some("recent input")
    );
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).input_at(now - Cd::minutes(11)));
    assert_eq!(kinds(&fx.plan_at(t0(), now)), [("m1", "claim")]);
}

#[test]
fn drain_ceiling_yields_instead_of_killing_work() {
    let m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).busy().marker(&m));
    let plan = fx.plan_at(t0(), t0() + Cd::hours(1));
    let StepKind::Release {
        marker: next, why, ..
    } = &plan.steps()[0].kind
    else {
        panic!("{plan:?}")
    };
    assert_eq!(*why, ReleaseWhy::DrainCeiling);
    assert_eq!(
        (next.phase, next.ending),
        (Phase::Releasing, Some(Ending::Yielded))
    );
    assert_eq!(next.retry_at, Some(t0() + Cd::hours(2)));
    assert!(restart_of(&plan, "m1").is_none());
}

#[test]
fn yielded_rotations_free_their_slot_alert_and_retry_after_retry_after() {
    let mut y = marker("y", Phase::Yielded, RotationMode::Wait, t0());
    y.retry_at = Some(t0() + Cd::hours(2));
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("")
        .with(M::drifted("y", Severity::Low).busy().marker(&y))
        .with(M::drifted("z", Severity::Low));
    let plan = fx.plan_at(t0(), now);
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["y"]);
    assert_eq!(
        kinds(&plan),
        [("z", "claim")],
        "the yielded slot is free for z"
    );

    let mut fx = Fx::new("").with(M::drifted("y", Severity::Low).busy().marker(&y));
    let plan = fx.plan_at(t0(), t0() + Cd::hours(2));
    assert_eq!(kinds(&plan), [("y", "claim")]);
    assert_eq!(plan.steps()[0].expected.as_ref(), Some(&y));
}

#[test]
fn a_due_retry_waits_for_a_slot_like_any_claim() {
    let now = t0() + Cd::hours(2);
    let mut y = marker("y", Phase::Yielded, RotationMode::Wait, t0());
    y.retry_at = Some(now - Cd::minutes(1));
    let x = marker(
        "x",
        Phase::Draining,
        RotationMode::Wait,
        now - Cd::minutes(5),
    );
    let mut fx = Fx::new("")
        .with(M::drifted("x", Severity::Low).busy().marker(&x))
        .with(M::drifted("y", Severity::Low).marker(&y));
    let plan = fx.plan_at(t0(), now);
    assert!(plan.steps().is_empty(), "{:?}", plan.steps());
    assert_eq!(
        plan.decisions()
            .get(&mid("y"))
            .map(Decision::label)
            .as_deref(),
        Some("waiting for a slot")
    );
}

// ---- cooperating agents -------------------------------------------------------

#[test]
fn a_cooperating_agent_is_restarted_only_on_its_own_fresh_idle_checkpoint() {
    let mut m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    m.drain_requested = true;
    let now = t0() + Cd::minutes(5);
    let fresh = now - Cd::seconds(10);
    let stale = now - Cd::seconds(31);
    let cases = [
        (
            M::drifted("m1", Severity::Low).cooperative(Some(&m.tag), fresh),
            true,
        ),
        (
            M::drifted("m1", Severity::Low).cooperative(None, fresh),
            false,
        ),
        (
            M::drifted("m1", Severity::Low).cooperative(Some("other-rotation"), fresh),
            false,
        ),
        (
            M::drifted("m1", Severity::Low).cooperative(Some(&m.tag), stale),
            false,
        ),
        (
            M::drifted("m1", Severity::Low)
                .cooperative(Some(&m.tag), fresh)
                .busy(),
            false,
        ),
    ];
    for (i, (machine, restarts)) in cases.into_iter().enumerate() {
        let mut fx = Fx::new("").with(machine.marker(&m));
        let plan = fx.plan_at(t0(), now);
        assert_eq!(
            restart_of(&plan, "m1").is_some(),
            restarts,
            "case {i}: {:?}",
            plan.steps()
        );
    }
}

#[test]
fn checkpoint_deadline_releases_the_fence_and_yields() {
    let mut m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    m.drain_requested = true;
    let now = t0() + Cd::minutes(20);
    let mut fenced = M::drifted("m1", Severity::Low).cooperative(None, now);
    if let Some(r) = fenced.0.inputs.report.as_mut() {
        r.rotation = Some(RotationState {
            fenced: true,
            checkpoint: None,
        });
    }
    let mut fx = Fx::new("").with(fenced.marker(&m));
    let plan = fx.plan_at(t0(), now);
    let StepKind::Release {
        undrain,
        why,
        marker: next,
        ..
    } = &plan.steps()[0].kind
    else {
        panic!("{plan:?}")
    };
    assert_eq!(*undrain, Undrain::Needed);
    assert_eq!(*why, ReleaseWhy::CheckpointDeadline);
    assert_eq!(next.retry_at, Some(now + Cd::hours(1)));
}

#[test]
fn claims_of_cooperating_agents_request_a_drain_and_reload_agents_a_reload() {
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).cooperative(None, now));
    let StepKind::Claim { drain, marker, .. } = &fx.plan_at(t0(), now).steps()[0].kind.clone()
    else {
        panic!()
    };
    assert!(*drain && marker.drain_requested);

    // critical → reload in the default pool; only for agents that advertise it.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Critical).reloadable());
    let StepKind::Claim { reload, marker, .. } = &fx.plan_at(t0(), now).steps()[0].kind.clone()
    else {
        panic!()
    };
    assert!(*reload);
    assert_eq!(
        (marker.phase, marker.mode),
        (Phase::Claiming, RotationMode::Reload)
    );
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Critical));
    let StepKind::Claim { reload, marker, .. } = &fx.plan_at(t0(), now).steps()[0].kind.clone()
    else {
        panic!()
    };
    assert!(!*reload);
    assert_eq!(marker.mode, RotationMode::Wait);
}

#[test]
fn unproven_reload_falls_back_to_alert_and_wait() {
    let mut m = marker("m1", Phase::Reloading, RotationMode::Reload, t0());
    (m.action, m.severity) = (PolicyAction::Reload, Severity::Critical);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Critical).reloadable().marker(&m));
    assert!(fx.plan_at(t0(), t0() + Cd::minutes(4)).steps().is_empty());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Critical).reloadable().marker(&m));
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(5));
    let StepKind::Advance {
        marker: next,
        cordon,
        ..
    } = &plan.steps()[0].kind
    else {
        panic!("{plan:?}")
    };
    assert!(*cordon);
    assert_eq!(
        (next.phase, next.mode),
        (Phase::Draining, RotationMode::Wait)
    );
}

// ---- caps -----------------------------------------------------------------------

#[test]
fn pool_caps_hold_and_the_most_severe_go_first() {
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("")
        .with(M::drifted("a", Severity::Low))
        .with(M::drifted("b", Severity::Medium))
        .with(M::drifted("c", Severity::Low));
    assert_eq!(kinds(&fx.plan_at(t0(), now)), [("b", "claim")]);

    // One rotation already in progress fills the default pool's single slot.
    let m = marker(
        "x",
        Phase::Draining,
        RotationMode::Wait,
        now - Cd::minutes(10),
    );
    let mut fx = Fx::new("")
        .with(M::drifted("x", Severity::Low).busy().marker(&m))
        .with(M::drifted("a", Severity::Low));
    let plan = fx.plan_at(t0(), now);
    assert!(plan.steps().is_empty(), "{:?}", plan.steps());
    assert_eq!(
        plan.decisions()
            .get(&mid("a"))
            .map(Decision::label)
            .as_deref(),
        Some("waiting for a slot")
    );
    assert_eq!(
        plan.rotations_in_progress
            .get(&("app".into(), "default".into())),
        Some(&1)
    );

    // Pools that share no capacity have separate caps.
    let mut fx = Fx::new("")
        .with(M::drifted("x", Severity::Low).busy().marker(&m))
        .with(M::drifted("w1", Severity::Medium).pool("wide", PolicyAction::AlertAndWait))
        .with(M::drifted("w2", Severity::Medium).pool("wide", PolicyAction::AlertAndWait))
        .with(M::drifted("w3", Severity::Medium).pool("wide", PolicyAction::AlertAndWait));
    assert_eq!(
        kinds(&fx.plan_at(t0(), now)),
        [("w1", "claim"), ("w2", "claim")]
    );
}

#[test]
fn an_unreadable_marker_is_left_alone_and_holds_its_slot() {
    let now = t0() + Cd::hours(1);
    let mut odd = M::drifted("x", Severity::Low);
    odd.0
        .inputs
        .metadata
        .insert(MARKER_KEY.into(), "{\"v\":99}".into());
    let mut fx = Fx::new("").with(odd).with(M::drifted("a", Severity::Low));
    let plan = fx.plan_at(t0(), now);
    assert!(plan.steps().is_empty(), "{:?}", plan.steps());
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["x"]);
}

/// Markers of older reconcilers kept `target` as text: one whose target is no
/// commit this reconciler can compare (an abbreviation, a SHA-256 id, not
/// hex) is unreadable, naming the field, the machine and the key; it is
/// never compared with the tip by text. (Another case reads as its
/// lowercase commit: `metadata::marker`'s tests.)
#[test]
fn a_marker_whose_target_is_no_commit_id_is_unreadable() {
    let m = marker("m1", Phase::Restarting, RotationMode::Wait, t0());
    let too_long = "1".repeat(64);
    let not_hex = format!("{}g", &TIP[..39]);
    for target in ["1111111", too_long.as_str(), not_hex.as_str(), ""] {
        let machine = M::on_tip("m1");
        let value = m
            .to_value()
            .replace(&format!("\"{TIP}\""), &format!("\"{target}\""));
        let machine = machine.put(MARKER_KEY, &value);
        let mut fx = Fx::new("").with(machine);
        let plan = fx.plan_at(t0(), t0() + Cd::seconds(30));
        assert!(plan.steps().is_empty(), "{target}: {:?}", plan.steps());
        match plan.decisions().get(&mid("m1")) {
            Some(Decision::UnreadableMarker { why }) => {
                assert!(why.contains("`target`"), "{target}: {why}")
            }
            other => panic!("{target}: {other:?}"),
        }
        let alert = plan
            .alerts
            .iter()
            .find(|a| a.kind == AlertKind::RotationStuck)
            .unwrap_or_else(|| panic!("{target}: no alert"));
        assert!(
            alert.summary.contains("m1") && alert.summary.contains(MARKER_KEY),
            "{}",
            alert.summary
        );
    }
}

// ---- verify, backoff, resume --------------------------------------------------------

#[test]
fn verify_finishes_on_tip_and_backs_off_when_still_old() {
    let m = marker("m1", Phase::Restarting, RotationMode::Wait, t0());
    let mut fx = Fx::new("").with(M::on_tip("m1").marker(&m));
    assert_eq!(
        kinds(&fx.plan_at(t0(), t0() + Cd::seconds(30))),
        [("m1", "finish")]
    );

    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&m));
    assert!(fx.plan_at(t0(), t0() + Cd::minutes(4)).steps().is_empty());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&m));
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(5));
    let StepKind::Advance {
        marker: next,
        cordon,
        ..
    } = &plan.steps()[0].kind
    else {
        panic!("{plan:?}")
    };
    assert!(!*cordon, "stays cordoned; nothing to do");
    assert_eq!((next.phase, next.attempt), (Phase::Backoff, 1));
    assert_eq!(
        next.retry_at,
        Some(t0() + Cd::minutes(5) + Cd::seconds(450))
    );
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["m1"]);

    // Backoff grows per attempt and is capped at retry_after.
    let c = policy();
    assert_eq!(
        super::verify_backoff(&c, 1),
        std::time::Duration::from_secs(900)
    );
    assert_eq!(
        super::verify_backoff(&c, 7),
        std::time::Duration::from_secs(3600)
    );

    let mut b = next.clone();
    b.retry_at = Some(t0() + Cd::minutes(10));
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&b));
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(10));
    let StepKind::Advance { marker: again, .. } = &plan.steps()[0].kind else {
        panic!("{plan:?}")
    };
    assert_eq!((again.phase, again.attempt), (Phase::Draining, 1));
}

/// #32 part 2, "a tip that moves within a step": a restart planned on one
/// tip loads the newer one (the agent loads the release tip when it boots).
/// The pool never judged that commit for this machine: where it might not
/// have allowed the restart (a more severe drift the pool leaves to an
/// operator; a manual rotation without an approval of it), the verify that
/// finishes the rotation says so.
#[test]
fn a_restart_that_loaded_a_newer_tip_than_its_target_is_alerted() {
    const PLANNED: &str = "3333333333333333333333333333333333333333";
    let now = t0() + Cd::seconds(30);
    let stuck = |plan: &Plan| -> Vec<String> {
        plan.alerts
            .iter()
            .filter(|a| a.kind == AlertKind::RotationStuck)
            .map(|a| a.summary.clone())
            .collect()
    };
    // Automatic: `restart` at medium, but the `default` pool leaves high
    // to an operator (`manual`) and critical to `reload`.
    let mut m = marker("m1", Phase::Restarting, RotationMode::Grace, t0());
    (m.action, m.severity, m.target) = (PolicyAction::Restart, Severity::Medium, commit(PLANNED));
    let mut fx = Fx::new("").with(M::on_tip("m1").marker(&m));
    let plan = fx.plan_at(t0(), now);
    assert_eq!(kinds(&plan), [("m1", "finish")]);
    let found = stuck(&plan);
    assert_eq!(found.len(), 1, "{:?}", plan.alerts);
    for part in ["m1", &PLANNED[..7], &TIP[..7], "manual"] {
        assert!(found[0].contains(part), "{part} in {}", found[0]);
    }
    // Loaded the commit it was planned for: nothing to say.
    m.target = commit(TIP);
    let mut fx = Fx::new("").with(M::on_tip("m1").marker(&m));
    let plan = fx.plan_at(t0(), now);
    assert_eq!(kinds(&plan), [("m1", "finish")]);
    assert!(stuck(&plan).is_empty(), "{:?}", plan.alerts);

    // Manual: approved for the planned commit only.
    let mut m = marker("m1", Phase::Restarting, RotationMode::Now, t0());
    (m.action, m.severity, m.target) = (PolicyAction::Manual, Severity::High, commit(PLANNED));
    let mut fx = Fx::new("").with(
        M::on_tip("m1")
            .marker(&m)
            .approved(PLANNED, ApprovalMode::Now),
    );
    let found = stuck(&fx.plan_at(t0(), now));
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("approval"), "{}", found[0]);
    // An approval of the commit it loaded stands for it.
    let mut fx = Fx::new("").with(M::on_tip("m1").marker(&m).approved(TIP, ApprovalMode::Now));
    assert!(stuck(&fx.plan_at(t0(), now)).is_empty());
}

#[test]
fn a_fresh_planner_resumes_with_deadlines_counted_from_its_first_sight() {
    // A new daemon: empty tracker, marker written 61 s ago by another owner
    // (another clock). Its memory is lost, so the grace counts from its own
    // first sight of the marker: later than the original deadline, never
    // earlier.
    let mut m = marker("m1", Phase::Draining, RotationMode::Grace, t0());
    m.owner = "old-replica".into();
    m.action = PolicyAction::Restart;
    m.severity = Severity::Medium;
    let report = Fx::new("")
        .with(
            M::drifted("m1", Severity::Medium)
                .busy()
                .fly_cordoned(true)
                .marker(&m),
        )
        .report();
    let mut tracker = Tracker::default();
    let plan = sweep_plan(&mut tracker, &report, t0() + Cd::seconds(61));
    assert!(restart_of(&plan, "m1").is_none(), "{:?}", plan.steps());
    let plan = sweep_plan(&mut tracker, &report, t0() + Cd::seconds(121));
    let (next, interrupts) =
        restart_of(&plan, "m1").expect("grace counted from the first sight of the marker");
    assert!(interrupts);
    assert_eq!(next.started_at, t0(), "the rotation keeps its start");
    // A rotation already restarting is not restarted again by a new daemon.
    let r = marker("m2", Phase::Restarting, RotationMode::Grace, t0());
    let report = Fx::new("")
        .with(M::drifted("m2", Severity::Medium).marker(&r))
        .report();
    let plan = sweep_plan(&mut tracker, &report, t0() + Cd::seconds(121));
    assert!(plan.steps().is_empty(), "{:?}", plan.steps());
}

fn plan_fn(report: &Snapshot, tracker: &Tracker, now: DateTime<Utc>) -> Plan {
    plan(&PlanInput {
        policy: &policy(),
        snapshot: report,
        tracker,
        owner: "r",
        fetch: fetched(),
        now,
    })
}

#[test]
fn unreachable_past_the_probe_failure_ceiling_is_restarted() {
    // Seen drifted, then unreachable (the shared record written, Fly's
    // check failing) for 4 h: claimed with an immediate restart.
    let cfg = policy();
    let mut tracker = Tracker::default();
    let drifted = Fx::new("").with(M::drifted("m1", Severity::Low)).report();
    let first = Fx::new("")
        .with(
            M::drifted("m1", Severity::Low)
                .unreachable()
                .check("critical"),
        )
        .report();
    let gone = Fx::new("")
        .with(
            M::drifted("m1", Severity::Low)
                .unreachable()
                .check("critical")
                .unprobed_since(t0() + Cd::minutes(1)),
        )
        .report();
    tracker.observe(&drifted, t0());
    let p = sweep_plan(&mut tracker, &first, t0() + Cd::minutes(1));
    assert_eq!(kinds(&p), [("m1", "record_unprobed")]);
    tracker.observe(&gone, t0() + Cd::minutes(1));
    tracker.observe(&gone, t0() + Cd::hours(3));
    let p = plan(&PlanInput {
        policy: &cfg,
        snapshot: &gone,
        tracker: &tracker,
        owner: "r",
        fetch: fetched(),
        now: t0() + Cd::hours(3),
    });
    assert!(rotation_steps(&p).is_empty());
    let now = t0() + Cd::minutes(1) + Cd::hours(4);
    tracker.observe(&gone, now);
    let p = plan(&PlanInput {
        policy: &cfg,
        snapshot: &gone,
        tracker: &tracker,
        owner: "r",
        fetch: fetched(),
        now,
    });
    let StepKind::Claim {
        marker: claimed, ..
    } = &p.steps()[0].kind
    else {
        panic!("{p:?}")
    };
    // The pool's own policy (alert-and-wait), never the operator's "now".
    assert_eq!(claimed.mode, RotationMode::Wait);

    // Never seen drifted (no record either): unreachable alone is not a
    // reason to restart.
    let mut tracker = Tracker::default();
    tracker.observe(&first, t0());
    tracker.observe(&first, t0() + Cd::hours(5));
    let p = plan(&PlanInput {
        policy: &cfg,
        snapshot: &first,
        tracker: &tracker,
        owner: "r",
        fetch: fetched(),
        now: t0() + Cd::hours(5),
    });
    assert!(rotation_steps(&p).is_empty());

    // Mid-rotation: draining and unreachable past the ceiling → restart.
    let m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let gone = Fx::new("")
        .with(
            M::drifted("m1", Severity::Low)
                .unreachable()
                .check("critical")
                .unprobed_since(t0())
                .marker(&m),
        )
        .report();
    let mut tracker = Tracker::default();
    tracker.observe(&gone, t0());
    tracker.observe(&gone, t0() + Cd::minutes(59));
    let p = plan(&PlanInput {
        policy: &cfg,
        snapshot: &gone,
        tracker: &tracker,
        owner: "r",
        fetch: fetched(),
        now: t0() + Cd::minutes(59),
    });
    assert!(rotation_steps(&p).is_empty());
    // (the drain ceiling of 1 h comes first in the default config; widen it)
    let mut wide = policy();
    wide.rotation.drain_ceiling = std::time::Duration::from_secs(10 * 3600);
    tracker.observe(&gone, t0() + Cd::hours(4));
    let p = plan(&PlanInput {
        policy: &wide,
        snapshot: &gone,
        tracker: &tracker,
        owner: "r",
        fetch: fetched(),
        now: t0() + Cd::hours(4),
    });
    assert!(restart_of(&p, "m1").is_some(), "{p:?}");
}

#[test]
fn unreachable_machines_of_observe_and_manual_pools_are_never_restarted() {
    let cfg = policy();
    for (pool, action) in [
        ("wide", PolicyAction::Observe),
        ("default", PolicyAction::Manual),
    ] {
        let drifted = Fx::new("")
            .with(M::drifted("m1", Severity::High).pool(pool, action))
            .report();
        let gone = Fx::new("")
            .with(
                M::drifted("m1", Severity::High)
                    .pool(pool, action)
                    .unreachable(),
            )
            .report();
        let mut tracker = Tracker::default();
        tracker.observe(&drifted, t0());
        tracker.observe(&gone, t0() + Cd::minutes(1));
        let now = t0() + Cd::hours(10);
        tracker.observe(&gone, now);
        let p = plan(&PlanInput {
            policy: &cfg,
            snapshot: &gone,
            tracker: &tracker,
            owner: "r",
            fetch: fetched(),
            now,
        });
        assert!(
            rotation_steps(&p).is_empty(),
            "{pool}/{action}: {:?}",
            p.steps()
        );
    }
}

#[test]
fn observe_pools_report_but_never_act() {
    let now = t0() + Cd::hours(1);
    let mut fx =
        Fx::new("").with(M::drifted("w", Severity::Low).pool("wide", PolicyAction::Observe));
    let plan = fx.plan_at(t0(), now);
    assert!(plan.steps().is_empty());
    assert_eq!(alerts(&plan, AlertKind::Drift), ["w"]);
}

// ---- safety under stale snapshots and faults (issue 8) ---------------------------

impl Fx {
    /// Like `plan_at`, with the fetch state and the coordinator's slots given.
    fn plan_with(
        &mut self,
        first_seen: DateTime<Utc>,
        now: DateTime<Utc>,
        fetch: FetchState,
        slots: SlotsView,
    ) -> Plan {
        let mut report = self.report();
        report.slots = slots;
        self.tracker.observe(&report, first_seen);
        self.tracker.observe(&report, now);
        plan(&PlanInput {
            policy: &self.policy,
            snapshot: &report,
            tracker: &self.tracker,
            owner: "r1",
            fetch,
            now,
        })
    }
}

impl M {
    fn manual_approved(self, target: &str) -> M {
        self.approved(target, ApprovalMode::WhenIdle)
    }

    fn bad_report(mut self) -> M {
        self.0.status = MachineStatus::BadReport;
        self.0.inputs.report = None;
        self.0.reported_ref = None;
        self.1 = None;
        self
    }

    fn unprobed_since(self, since: DateTime<Utc>) -> M {
        let record = Unprobed {
            since,
            action: PolicyAction::AlertAndWait,
            severity: Severity::Low,
        };
        self.put(UNPROBED_KEY, &record.to_value())
    }

    fn state(mut self, state: &str) -> M {
        self.0.state = state.into();
        self
    }
}

fn release_of(plan: &Plan, id: &str) -> Option<(Marker, bool, ReleaseWhy)> {
    let id = MachineId::from(id);
    plan.steps().into_iter().find_map(|s| match &s.kind {
        StepKind::Release {
            marker,
            undrain,
            why,
            ..
        } if s.target.machine_id == id => Some((marker.clone(), *undrain == Undrain::Needed, *why)),
        _ => None,
    })
}

fn guard_of(plan: &Plan, id: &str) -> Option<RestartGuard> {
    let id = MachineId::from(id);
    plan.steps().into_iter().find_map(|s| match &s.kind {
        StepKind::Restart { guard, .. } if s.target.machine_id == id => Some(*guard),
        _ => None,
    })
}

#[test]
fn scenario_3_a_ceiling_restart_needs_the_agent_still_unprobeable() {
    // Claimed past the ceiling in the pool's own mode (tested above); mid-rotation
    // the restart is guarded: it happens only while the agent cannot be probed.
    let m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let wide = |r: &mut crate::config::RotationConfig| {
        r.drain_ceiling = std::time::Duration::from_secs(10 * 3600);
    };
    let now = t0() + Cd::hours(5);
    let mut fx = Fx::new("").rotation(wide).with(
        M::drifted("m1", Severity::Low)
            .unreachable()
            .check("critical")
            .unprobed_since(t0())
            .marker(&m),
    );
    let plan = fx.plan_at(t0(), now);
    assert_eq!(guard_of(&plan, "m1"), Some(RestartGuard::Unprobeable));
    // The agent answers again, busy: judged by its report, never restarted.
    let mut fx = Fx::new("").rotation(wide).with(
        M::drifted("m1", Severity::Low)
            .busy()
            .unprobed_since(t0())
            .marker(&m),
    );
    let plan = fx.plan_at(t0(), now);
    assert!(restart_of(&plan, "m1").is_none(), "{plan:?}");
    assert!(
        plan.steps()
            .into_iter()
            .all(|s| s.kind == StepKind::ClearUnprobed || s.kind().starts_with("drain")),
        "{plan:?}"
    );
}

#[test]
fn scenario_4_a_due_retry_of_a_hung_agent_replaces_its_yielded_marker() {
    let mut y = marker("m1", Phase::Yielded, RotationMode::Wait, t0());
    y.retry_at = Some(t0() + Cd::hours(1));
    let now = t0() + Cd::hours(5);
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .unreachable()
            .check("critical")
            .unprobed_since(t0())
            .marker(&y),
    );
    let plan = fx.plan_at(t0(), now);
    let claim = plan
        .steps()
        .into_iter()
        .find(|s| matches!(s.kind, StepKind::Claim { .. }))
        .expect("claimed");
    assert_eq!(
        claim.expected.as_ref(),
        Some(&y),
        "the claim replaces the yielded marker, so the executor can carry it out"
    );
}

#[test]
fn scenario_6_an_uncertain_tip_starts_no_rotation_and_proves_nothing() {
    let now = t0() + Cd::hours(1);
    let failing = FetchState {
        fetched_at: Some(t0() - Cd::hours(1)),
        failing: true,
    };
    let mut unknown = M::drifted("m1", Severity::Critical);
    unknown.0.status = MachineStatus::UnknownRef;
    unknown.0.commits_behind = None;
    for m in [unknown.clone(), M::drifted("m2", Severity::Low)] {
        let mut fx = Fx::new("").with(m);
        let plan = fx.plan_with(t0(), now, failing, SlotsView::NotConfigured);
        assert!(plan.steps().is_empty(), "{plan:?}");
    }
    // A healthy fetch, but older than the first sight of the unknown ref: wait.
    let stale_ok = FetchState {
        fetched_at: Some(t0() - Cd::minutes(1)),
        failing: false,
    };
    let mut fx = Fx::new("").with(unknown.clone());
    let plan = fx.plan_with(t0(), now, stale_ok, SlotsView::NotConfigured);
    assert!(plan.steps().is_empty(), "{plan:?}");
    // A fetch after it was first seen still cannot resolve it: now it counts.
    let mut fx = Fx::new("").with(unknown.clone());
    let plan = fx.plan_with(t0(), now, fetched(), SlotsView::NotConfigured);
    assert_eq!(kinds(&plan), [("m1", "claim")]);
    // Verify: a commit the mirror lacks while the mirror is stale is no failure.
    let r = marker("m1", Phase::Restarting, RotationMode::Wait, t0());
    let mut fx = Fx::new("").with(unknown.marker(&r));
    let plan = fx.plan_with(t0(), now, failing, SlotsView::NotConfigured);
    assert!(plan.steps().is_empty(), "{plan:?}");
}

#[test]
fn scenario_7_an_approval_binds_one_rotation_to_one_commit() {
    let now = t0() + Cd::minutes(30);
    let mut m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    m.action = PolicyAction::Manual;
    // Approval deleted by the operator: the rotation stops before any restart.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::High).marker(&m));
    let plan = fx.plan_at(t0(), now);
    assert!(restart_of(&plan, "m1").is_none());
    let (next, _, why) = release_of(&plan, "m1").expect("cancelled");
    assert_eq!(next.ending, Some(Ending::Cancelled));
    assert_eq!(why, ReleaseWhy::ApprovalRevoked);
    // Still approved: restarted onto the approved commit.
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::High)
            .manual_approved(TIP)
            .marker(&m),
    );
    let plan = fx.plan_at(t0(), now);
    assert_eq!(
        restart_of(&plan, "m1").map(|(m, _)| m.target.clone()),
        Some(commit(TIP))
    );
    // The tip moved past the approved commit: stop, and ask again for the new tip.
    let mut old = m.clone();
    old.target = commit(OLD);
    let mut older = M::drifted("m1", Severity::High).manual_approved(OLD);
    older.0.commit = CommitId::parse(&"3".repeat(40));
    let mut fx = Fx::new("").with(older.marker(&old));
    let plan = fx.plan_at(t0(), now);
    assert!(restart_of(&plan, "m1").is_none());
    let (_, _, why) = release_of(&plan, "m1").expect("cancelled");
    assert_eq!(why, ReleaseWhy::TipMovedPastApproval);
}

#[test]
fn scenario_8_bad_reports_count_toward_the_probe_failure_ceiling() {
    let cfg = policy();
    let mut tracker = Tracker::default();
    let drifted = Fx::new("").with(M::drifted("m1", Severity::Low)).report();
    // The shared record, written at the first failure; Fly's check failing.
    let failed = |m: M| m.check("critical").unprobed_since(t0() + Cd::minutes(30));
    let gone = Fx::new("")
        .with(failed(M::drifted("m1", Severity::Low).unreachable()))
        .report();
    let garbage = Fx::new("")
        .with(failed(M::drifted("m1", Severity::Low).bad_report()))
        .report();
    tracker.observe(&drifted, t0());
    // Alternating timeouts and garbage never reset the clock.
    for i in 1..=8 {
        let report = if i % 2 == 0 { &gone } else { &garbage };
        tracker.observe(report, t0() + Cd::minutes(30 * i));
    }
    let now = t0() + Cd::minutes(30) + Cd::hours(4);
    tracker.observe(&garbage, now);
    let p = plan(&PlanInput {
        policy: &cfg,
        snapshot: &garbage,
        tracker: &tracker,
        owner: "r",
        fetch: fetched(),
        now,
    });
    assert_eq!(kinds(&p), [("m1", "claim")], "{p:?}");
}

#[test]
fn probe_failure_evidence_is_persisted_and_survives_a_new_daemon() {
    let cfg = policy();
    let mut tracker = Tracker::default();
    let drifted = Fx::new("").with(M::drifted("m1", Severity::Low)).report();
    let gone = Fx::new("")
        .with(M::drifted("m1", Severity::Low).unreachable())
        .report();
    tracker.observe(&drifted, t0());
    tracker.observe(&gone, t0() + Cd::minutes(1));
    let p = plan(&PlanInput {
        policy: &cfg,
        snapshot: &gone,
        tracker: &tracker,
        owner: "r",
        fetch: fetched(),
        now: t0() + Cd::minutes(1),
    });
    let StepKind::RecordUnprobed { record } = &p.steps()[0].kind else {
        panic!("{p:?}")
    };
    assert_eq!(record.since, t0() + Cd::minutes(1));
    // A new daemon (empty tracker, started at +2 h) reads the record: the
    // ceiling counts from its first sight of it (a delay, never a hastening).
    let recorded = Fx::new("")
        .with(
            M::drifted("m1", Severity::Low)
                .unreachable()
                .check("critical")
                .unprobed_since(t0() + Cd::minutes(1)),
        )
        .report();
    let mut fresh = Tracker::default();
    fresh.observe(&recorded, t0() + Cd::hours(2));
    let p = sweep_plan(&mut fresh, &recorded, t0() + Cd::minutes(1) + Cd::hours(4));
    assert!(rotation_steps(&p).is_empty(), "{p:?}");
    let p = sweep_plan(&mut fresh, &recorded, t0() + Cd::hours(6));
    assert_eq!(kinds(&p), [("m1", "claim")], "{p:?}");
    // The agent answers again: the record goes.
    let back = Fx::new("")
        .with(M::drifted("m1", Severity::Low).busy().unprobed_since(t0()))
        .report();
    let p = plan_fn(&back, &fresh, t0() + Cd::minutes(2));
    assert_eq!(kinds(&p), [("m1", "clear_unprobed")]);
}

#[test]
fn a_requested_drain_needs_the_checkpoint_even_if_drain_is_no_longer_advertised() {
    let mut m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    m.drain_requested = true;
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&m));
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(3));
    assert!(restart_of(&plan, "m1").is_none(), "{plan:?}");
}

#[test]
fn a_heartbeat_from_the_future_is_not_fresh() {
    let mut m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    m.drain_requested = true;
    let now = t0() + Cd::minutes(5);
    for (heartbeat, restarts) in [
        (now + Cd::seconds(3), true),
        (now + Cd::minutes(10), false),
        (now + Cd::days(3000), false),
    ] {
        let mut fx = Fx::new("").with(
            M::drifted("m1", Severity::Low)
                .cooperative(Some(&m.tag), heartbeat)
                .marker(&m),
        );
        let plan = fx.plan_at(t0(), now);
        assert_eq!(restart_of(&plan, "m1").is_some(), restarts, "{heartbeat}");
    }
}

#[test]
fn a_hold_mid_rotation_keeps_its_slot_and_says_what_waits_on_it() {
    let now = t0() + Cd::hours(1);
    let m = marker("x", Phase::Draining, RotationMode::Wait, t0());
    let mut fx = Fx::new("")
        .with(M::drifted("x", Severity::Low).held().marker(&m))
        .with(M::drifted("a", Severity::Low));
    let plan = fx.plan_at(t0(), now);
    assert!(plan.steps().is_empty(), "{:?}", plan.steps());
    assert_eq!(
        plan.decisions()
            .get(&mid("a"))
            .map(Decision::label)
            .as_deref(),
        Some("waiting for a slot")
    );
    let stuck: Vec<&Alert> = plan
        .alerts
        .iter()
        .filter(|a| a.kind == AlertKind::RotationStuck)
        .collect();
    assert_eq!(stuck.len(), 1);
    assert!(
        stuck[0].summary.contains("held mid-rotation")
            && stuck[0].summary.contains("pool default")
            && stuck[0].summary.contains("fleet-reconciler release x"),
        "{}",
        stuck[0].summary
    );
}

#[test]
fn a_machine_that_leaves_started_ends_its_rotation() {
    let now = t0() + Cd::minutes(10);
    for phase in [Phase::Draining, Phase::Backoff, Phase::Restarting] {
        let mut m = marker("m1", phase, RotationMode::Now, t0());
        m.drain_requested = true;
        let mut stopped = M::drifted("m1", Severity::Low).state("stopped");
        stopped.0.status = MachineStatus::NotRunning;
        stopped.0.inputs.report = None;
        let mut fx = Fx::new("").with(stopped.marker(&m));
        let plan = fx.plan_at(t0(), now);
        let (next, undrain, _) =
            release_of(&plan, "m1").unwrap_or_else(|| panic!("{phase}: {plan:?}"));
        assert_eq!(next.ending, Some(Ending::Cancelled));
        assert!(!undrain, "a stopped agent has no fence to lift");
        assert!(restart_of(&plan, "m1").is_none());
    }
}

#[test]
fn an_unfinished_claim_is_completed_or_withdrawn() {
    let now = t0() + Cd::hours(1);
    let c = marker("m1", Phase::Claiming, RotationMode::Wait, t0());
    // Still a candidate: the claim goes on under its tag (its slot may be won).
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&c));
    let plan = fx.plan_at(t0(), now);
    let StepKind::Claim { marker: again, .. } = &plan.steps()[0].kind else {
        panic!("{plan:?}")
    };
    assert_eq!(again.tag, c.tag);
    assert_eq!(plan.steps()[0].expected.as_ref(), Some(&c));
    // It counts for nothing: a claiming marker holds no slot.
    assert_eq!(plan.rotations_in_progress.values().sum::<usize>(), 0);
    // On the tip, or its pool full: withdrawn.
    let mut fx = Fx::new("").with(M::on_tip("m1").marker(&c));
    assert_eq!(kinds(&fx.plan_at(t0(), now)), [("m1", "withdraw")]);
    let x = marker(
        "x",
        Phase::Draining,
        RotationMode::Wait,
        now - Cd::minutes(10),
    );
    let mut fx = Fx::new("")
        .with(M::drifted("x", Severity::Low).busy().marker(&x))
        .with(M::drifted("m1", Severity::Low).marker(&c));
    let plan = fx.plan_at(t0(), now);
    assert_eq!(kinds(&plan), [("m1", "withdraw")], "{plan:?}");
}

#[test]
fn a_rotation_without_its_slot_is_undone() {
    let now = t0() + Cd::minutes(3);
    let m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let mut set = crate::metadata::slots::SlotSet::parse(None).unwrap();
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&m));
    let plan = fx.plan_with(t0(), now, fetched(), SlotsView::Known(set.clone()));
    assert!(restart_of(&plan, "m1").is_none());
    let (next, _, _) = release_of(&plan, "m1").expect("undone");
    assert_eq!(next.ending, Some(Ending::Cancelled));
    // With its slot it proceeds.
    set.try_add(
        &"app".into(),
        &"default".into(),
        crate::metadata::slots::Slot {
            machine_id: "m1".into(),
            tag: m.tag.clone(),
            owner: "r1".into(),
            since: t0(),
        },
        1,
    );
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&m));
    let plan = fx.plan_with(t0(), now, fetched(), SlotsView::Known(set));
    assert!(restart_of(&plan, "m1").is_some(), "{plan:?}");
}

#[test]
fn a_drain_the_agent_never_got_is_asked_again() {
    let mut m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    m.drain_requested = true;
    let now = t0() + Cd::minutes(2);
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .cooperative(None, now)
            .busy()
            .marker(&m),
    );
    assert_eq!(kinds(&fx.plan_at(t0(), now)), [("m1", "drain")]);
}

#[test]
fn an_unfinished_undo_is_retried_and_a_yield_keeps_its_retry_time() {
    let now = t0() + Cd::hours(1);
    let mut r = marker("m1", Phase::Releasing, RotationMode::Wait, t0());
    r.ending = Some(Ending::Yielded);
    r.retry_at = Some(now + Cd::hours(1));
    r.drain_requested = true;
    let mut fenced = M::drifted("m1", Severity::Low).cooperative(None, now);
    if let Some(rep) = fenced.0.inputs.report.as_mut() {
        rep.rotation = Some(RotationState {
            fenced: true,
            checkpoint: None,
        });
    }
    let mut fx = Fx::new("").with(fenced.marker(&r));
    let plan = fx.plan_at(t0(), now);
    let (next, undrain, _) = release_of(&plan, "m1").expect("retried");
    assert_eq!(next, r, "the same undo, unchanged");
    assert!(undrain);
    // Held: nothing, not even the undo.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).held().marker(&r));
    assert!(fx.plan_at(t0(), now).steps().is_empty());
}

// ---- an app the sweep could not list (issue 10 item 10) ----------------------

impl M {
    fn in_app(mut self, app: &str) -> M {
        self.0.app = app.into();
        self
    }
}

/// Marks `app` as not listed by the sweep (its machines are its last listing).
fn stale(mut report: Snapshot, app: &str) -> Snapshot {
    let summary = report
        .apps
        .iter_mut()
        .find(|a| a.name == AppName::from(app))
        .expect("a configured app");
    summary.stale = Some(crate::observe::sweep::StaleApp {
        error: format!(
            "cannot list machines of app {app}: Fly API: list_machines for app {app} answered 503: unavailable"
        ),
        kind: "status".into(),
        last_listed_at: Some(t0()),
    });
    report
}

/// In app `other`: a machine for every kind of step the planner makes.
fn busy_other_app(now: DateTime<Utc>) -> (Fx, SlotsView) {
    let draining = marker("o-drain", Phase::Draining, RotationMode::Wait, t0());
    let orphan = marker("o-orphan", Phase::Draining, RotationMode::Wait, t0());
    let mut releasing = marker("o-undo", Phase::Releasing, RotationMode::Wait, t0());
    releasing.ending = Some(Ending::Cancelled);
    let mut restarting = marker("o-verify", Phase::Restarting, RotationMode::Wait, t0());
    restarting.restart_at = Some(now - Cd::hours(1));
    let unprobed = Unprobed {
        since: t0(),
        action: PolicyAction::AlertAndWait,
        severity: Severity::Low,
    };
    let mut set = crate::metadata::slots::SlotSet::parse(None).unwrap();
    for (id, m) in [
        ("o-drain", &draining),
        ("o-undo", &releasing),
        ("o-verify", &restarting),
    ] {
        set.try_add(
            &"other".into(),
            &"default".into(),
            crate::metadata::slots::Slot {
                machine_id: id.into(),
                tag: m.tag.clone(),
                owner: "r1".into(),
                since: t0(),
            },
            10,
        );
    }
    let answers = M::on_tip("o-answers")
        .in_app("other")
        .put(UNPROBED_KEY, &unprobed.to_value());
    let fx = Fx::new("[[apps]]\nname = \"other\"\npool_key = \"pool\"\n")
        .with(M::drifted("a-drift", Severity::Low))
        .with(
            M::drifted("o-drift", Severity::Low)
                .in_app("other")
                .pool("wide", PolicyAction::AlertAndWait),
        )
        .with(
            M::drifted("o-drain", Severity::Low)
                .in_app("other")
                .marker(&draining),
        )
        .with(
            M::drifted("o-orphan", Severity::Low)
                .in_app("other")
                .marker(&orphan),
        )
        .with(
            M::drifted("o-undo", Severity::Low)
                .in_app("other")
                .marker(&releasing),
        )
        .with(
            M::drifted("o-verify", Severity::Low)
                .in_app("other")
                .marker(&restarting),
        )
        .with(
            M::drifted("o-held", Severity::Low)
                .in_app("other")
                .held()
                .marker(&marker("o-held", Phase::Draining, RotationMode::Wait, t0())),
        )
        .with(answers);
    // Room for all of `other`'s rotations: none is over its pool's cap.
    let mut fx = fx;
    fx.policy = policy().with_pool(
        "default",
        crate::config::PoolConfig {
            max_concurrent_rotations: std::num::NonZeroU32::new(5).unwrap(),
            ..policy().pool(&"default".into()).clone()
        },
    );
    (fx, SlotsView::Known(set))
}

/// The plan over [`busy_other_app`] five minutes in, with `other` not
/// listed by the sweep when `stale_other`.
fn plan_busy_other_app(stale_other: bool) -> Plan {
    let now = t0() + Cd::minutes(5);
    let (mut fx, slots) = busy_other_app(now);
    let mut report = fx.report();
    report.slots = slots;
    if stale_other {
        report = stale(report, "other");
    }
    fx.tracker.observe(&report, t0());
    fx.tracker.observe(&report, now);
    plan(&PlanInput {
        policy: &fx.policy,
        snapshot: &report,
        tracker: &fx.tracker,
        owner: "r1",
        fetch: fetched(),
        now,
    })
}

#[test]
fn every_kind_of_step_for_the_machines_of_an_app_that_was_listed() {
    // Listed, `other` has work of every kind: a claim, a restart, two undos,
    // a verify backoff, a bookkeeping step, and alerts.
    let listed = plan_busy_other_app(false);
    let mut steps = kinds(&listed);
    steps.sort_unstable();
    assert_eq!(
        steps,
        [
            ("a-drift", "claim"),
            ("o-answers", "clear_unprobed"),
            ("o-drain", "restart"),
            ("o-drift", "claim"),
            ("o-orphan", "cancel"),
            ("o-undo", "cancel"),
            ("o-verify", "advance"),
        ],
        "{listed:?}"
    );
    assert!(
        listed
            .alerts
            .iter()
            .any(|a| a.app == Some(AppName::from("other")))
    );
}

#[test]
fn no_step_for_the_machines_of_an_app_that_could_not_be_listed() {
    // Not listed: nothing at all for `other` (not even the undos), while
    // `app` is planned exactly as before.
    let unlisted = plan_busy_other_app(true);
    assert_eq!(kinds(&unlisted), [("a-drift", "claim")], "{unlisted:?}");
    assert!(
        unlisted
            .alerts
            .iter()
            .all(|a| a.app == Some(AppName::from("app"))),
        "no alert of its own: {:?}",
        unlisted.alerts
    );
    assert_eq!(alerts(&unlisted, AlertKind::Drift), ["a-drift"]);
}

#[test]
fn the_rotations_of_an_app_that_could_not_be_listed_wait_and_say_so() {
    let unlisted = plan_busy_other_app(true);
    // The rotations in progress wait where they are, and say so.
    assert_eq!(
        unlisted.decisions().get(&mid("o-drain")),
        Some(&Decision::AppNotListed {
            held: false,
            phase: Some(Phase::Draining)
        })
    );
    assert_eq!(
        unlisted
            .decisions()
            .get(&mid("o-drain"))
            .map(Decision::label)
            .as_deref(),
        Some("draining; paused: app not listed")
    );
    assert_eq!(
        unlisted
            .decisions()
            .get(&mid("o-held"))
            .map(Decision::label)
            .as_deref(),
        Some("held; paused: app not listed")
    );
    assert_eq!(
        unlisted
            .decisions()
            .get(&mid("o-drift"))
            .map(Decision::label)
            .as_deref(),
        Some("paused: app not listed")
    );
}

#[test]
fn the_slots_of_an_app_that_could_not_be_listed_count_in_its_own_pool_only() {
    let unlisted = plan_busy_other_app(true);
    // Their slots still count against their own pool, and only there.
    assert_eq!(
        unlisted
            .rotations_in_progress
            .get(&("other".into(), "default".into())),
        Some(&5)
    );
    assert_eq!(
        unlisted
            .decisions()
            .get(&mid("a-drift"))
            .map(Decision::label)
            .as_deref(),
        Some("claiming")
    );
}

#[test]
fn a_stale_listing_neither_starts_nor_stops_a_machines_clocks() {
    let config = config("[[apps]]\nname = \"other\"\n");
    let report = |machines: Vec<M>| snapshot(&config, machines);
    let mut tracker = Tracker::default();
    tracker.observe(
        &report(vec![
            M::drifted("d", Severity::Low).in_app("other"),
            M::on_tip("u").in_app("other"),
        ]),
        t0(),
    );
    // Whatever a stale listing says, nothing new is known: no clock moves.
    let later = t0() + Cd::minutes(10);
    tracker.observe(
        &stale(
            report(vec![
                M::on_tip("d").in_app("other"),
                M::on_tip("u").in_app("other").unreachable(),
            ]),
            "other",
        ),
        later,
    );
    assert_eq!(tracker.drift_since(&mid("d")), Some(t0()));
    assert_eq!(tracker.unprobed_since(&mid("u")), None);
    // Listed again: the clocks follow the listing.
    tracker.observe(
        &report(vec![
            M::on_tip("d").in_app("other"),
            M::on_tip("u").in_app("other").unreachable(),
        ]),
        later,
    );
    assert_eq!(tracker.drift_since(&mid("d")), None);
    assert_eq!(tracker.unprobed_since(&mid("u")), Some(later));
}

// ---- decisions: one fixture per variant (issue 11) -------------------------------

/// The decision the planner makes for `id` when `fx` is first seen at
/// `first_seen` and planned at `now`.
fn decision_of(fx: &mut Fx, id: &str, first_seen: DateTime<Utc>, now: DateTime<Utc>) -> Decision {
    let plan = fx.plan_at(first_seen, now);
    plan.decisions()
        .get(&mid(id))
        .cloned()
        .unwrap_or_else(|| panic!("no decision for {id}: {plan:?}"))
}

#[test]
fn every_machine_of_the_report_gets_a_decision() {
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("")
        .with(M::on_tip("a"))
        .with(M::drifted("b", Severity::Low))
        .with(M::drifted("c", Severity::High).held())
        .with(M::on_tip("d").unreachable());
    let plan = fx.plan_at(t0(), now);
    assert_eq!(
        plan.decisions()
            .keys()
            .map(MachineId::as_str)
            .collect::<Vec<_>>(),
        ["a", "b", "c", "d"]
    );
    // The one drift clock: the tracker's, for the machines off the tip.
    assert_eq!(plan.drift_since(&mid("b")), Some(t0()));
    assert_eq!(plan.drift_since(&mid("c")), Some(t0()));
    assert_eq!(plan.drift_since(&mid("a")), None);
}

#[test]
fn decision_on_tip() {
    let mut fx = Fx::new("").with(M::on_tip("m1"));
    assert_eq!(decision_of(&mut fx, "m1", t0(), t0()), Decision::OnTip);
}

#[test]
fn decision_not_running() {
    let mut m = M::on_tip("m1");
    m.0.state = "stopped".into();
    m.0.status = MachineStatus::NotRunning;
    m.0.inputs.report = None;
    let mut fx = Fx::new("").with(m);
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::hours(1)),
        Decision::NotRunning {
            state: "stopped".into()
        }
    );
}

#[test]
fn decision_drift_younger_than_min_drift_age() {
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low));
    // min_drift_age defaults to 2m.
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::seconds(30)),
        Decision::DriftYoung {
            since: t0(),
            until: t0() + Cd::minutes(2)
        }
    );
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low));
    assert!(matches!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::minutes(2)),
        Decision::Claiming { .. }
    ));
}

#[test]
fn decision_observe_only() {
    let mut fx =
        Fx::new("").with(M::drifted("w", Severity::Low).pool("wide", PolicyAction::Observe));
    assert_eq!(
        decision_of(&mut fx, "w", t0(), t0() + Cd::hours(1)),
        Decision::ObserveOnly {
            severity: Severity::Low
        }
    );
}

#[test]
fn decision_held_by_whom_since_when_and_mid_which_phase() {
    let hold = crate::metadata::operator::Hold {
        by: "alice".into(),
        reason: "incident 42".into(),
        at: t0() - Cd::minutes(3),
    };
    let mut m = M::drifted("m1", Severity::Low).marker(&marker(
        "m1",
        Phase::Draining,
        RotationMode::Wait,
        t0(),
    ));
    m.0.inputs
        .metadata
        .insert(HOLD_KEY.into(), serde_json::to_string(&hold).unwrap());
    let mut fx = Fx::new("").with(m);
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::hours(1)),
        Decision::Held {
            by: Some("alice".into()),
            since: Some(t0() - Cd::minutes(3)),
            reason: Some("incident 42".into()),
            phase: Some(Phase::Draining),
        }
    );
    // A hold value that is not ours still holds; who and why are unknown.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).held());
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::hours(1)),
        Decision::Held {
            by: None,
            since: None,
            reason: None,
            phase: None
        }
    );
}

#[test]
fn decision_awaiting_approval_of_the_tip() {
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::High));
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::hours(1)),
        Decision::AwaitingApproval {
            target: commit(TIP),
            severity: Severity::High
        }
    );
    // An approval of another commit leaves it waiting.
    let mut fx =
        Fx::new("").with(M::drifted("m1", Severity::High).approved(OLD, ApprovalMode::Now));
    assert!(matches!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::hours(1)),
        Decision::AwaitingApproval { .. }
    ));
}

#[test]
fn decision_waiting_for_a_slot_names_the_pool_and_its_use() {
    let now = t0() + Cd::hours(1);
    let x = marker(
        "x",
        Phase::Draining,
        RotationMode::Wait,
        now - Cd::minutes(10),
    );
    let mut fx = Fx::new("")
        .with(M::drifted("x", Severity::Low).busy().marker(&x))
        .with(M::drifted("a", Severity::Low));
    assert_eq!(
        decision_of(&mut fx, "a", t0(), now),
        Decision::WaitingForSlot {
            pool: "default".into(),
            in_use: 1,
            cap: 1
        }
    );
    // Two claims for the wide pool's two slots, the third waits on both.
    let mut fx = Fx::new("")
        .with(M::drifted("w1", Severity::High).pool("wide", PolicyAction::AlertAndWait))
        .with(M::drifted("w2", Severity::Medium).pool("wide", PolicyAction::AlertAndWait))
        .with(M::drifted("w3", Severity::Low).pool("wide", PolicyAction::AlertAndWait));
    let plan = fx.plan_at(t0(), now);
    assert_eq!(
        plan.decisions().get(&mid("w3")),
        Some(&Decision::WaitingForSlot {
            pool: "wide".into(),
            in_use: 2,
            cap: 2
        })
    );
}

#[test]
fn decision_recent_input_until_the_guard_passes() {
    let now = t0() + Cd::hours(1);
    let input = now - Cd::minutes(9);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).input_at(input));
    // recent_input_guard defaults to 10m.
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), now),
        Decision::RecentInput {
            until: input + Cd::minutes(10)
        }
    );
    // Mid-drain, the same guard shows as the same decision.
    let m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let draining = t0() + Cd::minutes(30);
    let input = draining - Cd::minutes(1);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).input_at(input).marker(&m));
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), draining),
        Decision::RecentInput {
            until: input + Cd::minutes(10)
        }
    );
}

#[test]
fn decision_live_work_since_the_drain_and_until_its_ceiling() {
    let now = t0() + Cd::minutes(5);
    let m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).busy().marker(&m));
    // drain_ceiling defaults to 1h.
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), now),
        Decision::LiveWork {
            since: t0(),
            deadline: t0() + Cd::hours(1)
        }
    );
    // A requested drain without a checkpoint yields at the earlier checkpoint deadline (20m).
    let mut m = m;
    m.drain_requested = true;
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .busy()
            .cooperative(None, now)
            .marker(&m),
    );
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), now),
        Decision::LiveWork {
            since: t0(),
            deadline: t0() + Cd::minutes(20)
        }
    );
}

#[test]
fn decision_claiming_with_its_mode() {
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low));
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), now),
        Decision::Claiming {
            mode: RotationMode::Wait
        }
    );
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Medium));
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), now),
        Decision::Claiming {
            mode: RotationMode::Grace
        }
    );
}

#[test]
fn decision_in_rotation_with_the_phase_and_its_deadline() {
    // Restarted and back up: verifying until the verify deadline (5m).
    let r = marker("m1", Phase::Restarting, RotationMode::Wait, t0());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&r));
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::minutes(1)),
        Decision::InRotation {
            phase: Phase::Restarting,
            deadline: Some(t0() + Cd::minutes(5)),
            verifying: true
        }
    );
    // Backing off: until the retry.
    let mut b = marker("m1", Phase::Backoff, RotationMode::Wait, t0());
    b.retry_at = Some(t0() + Cd::minutes(40));
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&b));
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::minutes(10)),
        Decision::InRotation {
            phase: Phase::Backoff,
            deadline: Some(t0() + Cd::minutes(40)),
            verifying: false
        }
    );
    // Draining an idle cooperative agent: waiting for its checkpoint.
    let mut d = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    d.drain_requested = true;
    let now = t0() + Cd::minutes(5);
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .cooperative(None, now)
            .marker(&d),
    );
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), now),
        Decision::InRotation {
            phase: Phase::Draining,
            deadline: Some(t0() + Cd::minutes(20)),
            verifying: false
        }
    );
    // Undoing: until `rotation.release_ceiling` (30m) from the undo's start,
    // past which it is alerted.
    let r = releasing_fenced("m1");
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).unreachable().marker(&r));
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), t0() + Cd::minutes(10)),
        Decision::InRotation {
            phase: Phase::Releasing,
            deadline: Some(t0() + Cd::minutes(30)),
            verifying: false
        }
    );
}

#[test]
fn decision_yielded_until_its_retry() {
    let now = t0() + Cd::hours(1);
    let mut y = marker("m1", Phase::Yielded, RotationMode::Wait, t0());
    y.retry_at = Some(now + Cd::minutes(30));
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&y));
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), now),
        Decision::Yielded {
            retry_at: Some(now + Cd::minutes(30))
        }
    );
}

#[test]
fn decision_unprobeable_since_and_ceiling() {
    let now = t0() + Cd::hours(1);
    // Seen drifted under alert-and-wait (the persisted record), Fly's check
    // failing: the ceiling (4h) applies, from this run's first sight of the
    // record (t0; its own `since` is another clock's).
    let since = t0() - Cd::minutes(10);
    let mut fx = Fx::new("").with(
        M::on_tip("m1")
            .unreachable()
            .check("critical")
            .unprobed_since(since),
    );
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), now),
        Decision::Unprobeable {
            since: Some(t0()),
            ceiling_at: Some(t0() + Cd::hours(4))
        }
    );
    // Never seen drifted: no ceiling, only the clock of this run.
    let mut fx = Fx::new("").with(M::on_tip("m1").bad_report());
    assert_eq!(
        decision_of(&mut fx, "m1", t0(), now),
        Decision::Unprobeable {
            since: Some(t0()),
            ceiling_at: None
        }
    );
}

#[test]
fn decision_tip_uncertain_and_unconfirmed_ref() {
    let now = t0() + Cd::hours(1);
    let failing = FetchState {
        fetched_at: Some(t0() - Cd::hours(1)),
        failing: true,
    };
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low));
    let plan = fx.plan_with(t0(), now, failing, SlotsView::NotConfigured);
    assert_eq!(
        plan.decisions().get(&mid("m1")),
        Some(&Decision::TipUncertain {
            fetched_at: Some(t0() - Cd::hours(1))
        })
    );
    // A machine on the tip is on the tip, whatever the fetch does.
    let mut fx = Fx::new("").with(M::on_tip("m1"));
    let plan = fx.plan_with(t0(), now, failing, SlotsView::NotConfigured);
    assert_eq!(plan.decisions().get(&mid("m1")), Some(&Decision::OnTip));

    let mut unknown = M::drifted("m1", Severity::Critical);
    unknown.0.status = MachineStatus::UnknownRef;
    unknown.0.commits_behind = None;
    let stale_ok = FetchState {
        fetched_at: Some(t0() - Cd::minutes(1)),
        failing: false,
    };
    let mut fx = Fx::new("").with(unknown);
    let plan = fx.plan_with(t0(), now, stale_ok, SlotsView::NotConfigured);
    assert_eq!(
        plan.decisions().get(&mid("m1")),
        Some(&Decision::UnconfirmedRef { since: Some(t0()) })
    );
}

#[test]
fn decision_unreadable_marker_names_the_field() {
    let mut m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    m.retry_at = Some(t0() + Cd::days(5000));
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&m));
    match decision_of(&mut fx, "m1", t0(), t0() + Cd::hours(1)) {
        Decision::UnreadableMarker { why } => assert!(why.contains("retry_at"), "{why}"),
        other => panic!("{other:?}"),
    }
}

// ---- issue 19: every wait with a ceiling, Fly as it really behaves ----------

impl M {
    fn metadata_unknown(mut self, why: &str) -> M {
        self.0.inputs.metadata.clear();
        self.0.inputs.unusual_mut().metadata_unknown = Some(why.into());
        self
    }

    fn instance(mut self, id: &str) -> M {
        self.0.inputs.instance_id = id.into();
        self
    }

    fn fly_cordoned(mut self, cordoned: bool) -> M {
        self.0.inputs.cordoned = Some(cordoned);
        self
    }

    fn check(mut self, status: &str) -> M {
        self.0
            .inputs
            .unusual_mut()
            .checks
            .push(crate::fly::MachineCheck {
                name: "http".into(),
                status: status.into(),
                output: String::new(),
                updated_at: None,
            });
        self
    }

    fn exit_at(mut self, at: DateTime<Utc>) -> M {
        self.0
            .inputs
            .unusual_mut()
            .events
            .push(crate::fly::MachineEvent {
                kind: "exit".into(),
                status: "stopped".into(),
                source: "flyd".into(),
                timestamp: at.timestamp_millis(),
                // A crash Fly restarted (fly-go `MachineExitEvent`).
                exit: Some(crate::fly::ExitDetail {
                    exit_code: 1,
                    restarting: true,
                    requested_stop: false,
                }),
            });
        self
    }
}

/// A slot set holding `tag` for `machine_id` in `pool` of app `app`.
fn slots_with(entries: &[(&str, &str, &str)]) -> SlotsView {
    let mut set = crate::metadata::slots::SlotSet::parse(None).unwrap();
    for (pool, machine_id, tag) in entries {
        set.try_add(
            &"app".into(),
            &(*pool).into(),
            crate::metadata::slots::Slot {
                machine_id: (*machine_id).into(),
                tag: (*tag).into(),
                owner: "r1".into(),
                since: t0(),
            },
            10,
        );
    }
    SlotsView::Known(set)
}

fn failing_fetch() -> FetchState {
    FetchState {
        fetched_at: Some(t0() - Cd::hours(1)),
        failing: true,
    }
}

fn advance_of(plan: &Plan, id: &str) -> Option<(Marker, bool)> {
    let id = MachineId::from(id);
    plan.steps().into_iter().find_map(|s| match &s.kind {
        StepKind::Advance { marker, cordon, .. } if s.target.machine_id == id => {
            Some((marker.clone(), *cordon))
        }
        _ => None,
    })
}

/// A `releasing` undo whose agent was asked to drain and is cordoned.
fn releasing_fenced(id: &str) -> Marker {
    let mut r = marker(id, Phase::Releasing, RotationMode::Wait, t0());
    r.ending = Some(Ending::Yielded);
    r.retry_at = Some(t0() + Cd::hours(2));
    r.drain_requested = true;
    r.cordoned = Some(true);
    r
}

#[test]
fn item6_a_releasing_undo_gives_up_the_undrain_of_an_unreachable_agent_past_its_ceiling() {
    let r = releasing_fenced("m1");
    // Within rotation.release_ceiling (30 min): the whole undo is retried.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).unreachable().marker(&r));
    let (_, undrain, _) = release_of(&fx.plan_at(t0(), t0() + Cd::minutes(10)), "m1").unwrap();
    assert!(undrain);
    // Past it: the undrain of the unreachable agent is given up, the uncordon
    // is not, and an alert names the machine.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).unreachable().marker(&r));
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(31));
    let (next, undrain, _) = release_of(&plan, "m1").expect("the undo still runs");
    assert!(!undrain, "the undrain of an unreachable agent is given up");
    assert!(next.may_have_cordoned(), "the uncordon is never given up");
    assert_eq!(
        next.ending,
        Some(Ending::Yielded),
        "the rotation still ends"
    );
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["m1"]);
    // An agent that answers and still reports its fence keeps its slot (its
    // capacity is out), is undrained again, and is alerted.
    let mut fenced = M::drifted("m1", Severity::Low).cooperative(None, t0());
    if let Some(rep) = fenced.0.inputs.report.as_mut() {
        rep.rotation = Some(RotationState {
            fenced: true,
            checkpoint: None,
        });
    }
    let mut fx = Fx::new("").with(fenced.marker(&r));
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(31));
    let (_, undrain, _) = release_of(&plan, "m1").unwrap();
    assert!(undrain);
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["m1"]);
}

#[test]
fn item6_an_unreachable_fenced_agent_past_the_probe_failure_ceiling_is_restarted() {
    // Automatic policy, unreachable for 5 h (persisted evidence): the restart
    // clears its fence; only if it is still unprobeable.
    let r = releasing_fenced("m1");
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .unreachable()
            .check("critical")
            .unprobed_since(t0() - Cd::hours(5))
            .marker(&r),
    );
    let plan = fx.plan_at(t0() - Cd::hours(5), t0() + Cd::minutes(31));
    assert_eq!(
        guard_of(&plan, "m1"),
        Some(RestartGuard::Unprobeable),
        "{plan:?}"
    );
    let (next, _) = restart_of(&plan, "m1").unwrap();
    assert_eq!((next.phase, next.ending), (Phase::Restarting, None));
    // Not for a manual rotation: its undrain is given up instead.
    let mut manual = r.clone();
    manual.action = PolicyAction::Manual;
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .unreachable()
            .unprobed_since(t0() - Cd::hours(5))
            .marker(&manual),
    );
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(31));
    assert!(guard_of(&plan, "m1").is_none());
    assert!(!release_of(&plan, "m1").unwrap().1);
}

#[test]
fn item7_an_unreadable_marker_takes_no_slot_the_coordinator_does_not_give_it() {
    let now = t0() + Cd::hours(1);
    // A newer daemon's phase: unreadable here.
    let newer = marker("x", Phase::Draining, RotationMode::Wait, t0())
        .to_value()
        .replace("\"draining\"", "\"quiescing\"");
    // Sealed by a newer reconciler holding the same key.
    let odd = M::drifted("x", Severity::Low).put(MARKER_KEY, &newer);
    let mut fx = Fx::new("")
        .with(odd.clone())
        .with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(t0(), now, fetched(), slots_with(&[]));
    assert_eq!(kinds(&plan), [("a", "claim")], "{plan:?}");
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["x"]);
    assert!(matches!(
        plan.decisions()[&mid("x")],
        Decision::UnreadableMarker { .. }
    ));
    // When the coordinator does hold a slot for it, it is counted.
    let mut fx = Fx::new("").with(odd).with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(
        t0(),
        now,
        fetched(),
        slots_with(&[("default", "x", "x-newer-tag")]),
    );
    assert!(plan.steps().is_empty(), "{plan:?}");
    assert!(matches!(
        plan.decisions()[&mid("a")],
        Decision::WaitingForSlot { in_use: 1, .. }
    ));
}

#[test]
fn item8_a_backoff_that_cannot_move_on_ends_uncordoned() {
    // The coordinator is unreadable: the backoff cannot go back to draining.
    let mut b = marker("m1", Phase::Backoff, RotationMode::Wait, t0());
    b.attempt = 1;
    b.retry_at = Some(t0() + Cd::minutes(10));
    b.cordoned = Some(true);
    let unknown = SlotsView::Unknown("coordinator host unreachable".into());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&b));
    let plan = fx.plan_with(t0(), t0() + Cd::minutes(11), fetched(), unknown.clone());
    assert!(plan.steps().is_empty(), "needs a slot: {plan:?}");
    // Due for longer than verify_deadline (5 min): it yields, uncordoning.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&b));
    let plan = fx.plan_with(t0(), t0() + Cd::minutes(16), fetched(), unknown);
    let (next, _, _) = release_of(&plan, "m1").expect("the backoff has a ceiling");
    assert!(next.may_have_cordoned());
    assert_eq!(next.ending, Some(Ending::Yielded));
}

#[test]
fn item9_a_machine_that_never_verifies_ends_as_failed_after_max_attempts() {
    // Third restart (two failed before) did not verify either.
    let mut r = marker("m1", Phase::Restarting, RotationMode::Grace, t0());
    r.action = PolicyAction::Restart;
    r.attempt = 2;
    r.cordoned = Some(true);
    let now = t0() + Cd::minutes(5);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Medium).marker(&r));
    let plan = fx.plan_at(t0(), now);
    let (next, _, _) = release_of(&plan, "m1").expect("no fourth attempt");
    assert!(next.may_have_cordoned(), "uncordoned by the undo");
    let failed = next
        .failed
        .clone()
        .expect("the marker remembers the failure");
    assert_eq!((failed.attempts, failed.at), (3, now));
    assert_eq!(next.retry_at, None);
    assert_eq!(plan.steps()[0].kind(), "fail");
    assert_eq!(alerts(&plan, AlertKind::RotationFailed), ["m1"]);
    // Fewer attempts: backoff as before.
    let mut fx = Fx::new("")
        .rotation(|r| r.max_attempts = std::num::NonZeroU32::new(4).unwrap())
        .with(M::drifted("m1", Severity::Medium).marker(&r));
    let plan = fx.plan_at(t0(), now);
    assert_eq!(advance_of(&plan, "m1").unwrap().0.phase, Phase::Backoff);

    // Ended: the yielded marker with the failure. No new attempt for that tip.
    let mut ended = next.clone();
    ended.phase = Phase::Yielded;
    ended.ending = None;
    ended.cordoned = Some(false);
    ended.drain_requested = false;
    let later = now + Cd::hours(5);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Medium).marker(&ended));
    let plan = fx.plan_at(t0(), later);
    assert!(plan.steps().is_empty(), "{plan:?}");
    assert_eq!(alerts(&plan, AlertKind::RotationFailed), ["m1"]);
    match &plan.decisions()[&mid("m1")] {
        Decision::RotationFailed {
            target, attempts, ..
        } => assert_eq!((target.as_str(), *attempts), (TIP, 3)),
        other => panic!("{other:?}"),
    }
    // `plan` says so (the status page and `status MACHINE` render the same value).
    let table = crate::report::render::plan_to_table(&fx.report(), &plan);
    assert!(
        table.contains("rotation failed") && table.contains("failed after 3 restart(s)"),
        "{table}"
    );
    // An operator's approval after the failure re-arms it.
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Medium)
            .approved_at(TIP, ApprovalMode::WhenIdle, later)
            .marker(&ended),
    );
    let plan = fx.plan_at(t0(), later);
    assert_eq!(kinds(&plan), [("m1", "claim")], "{plan:?}");
    // So does a new tip.
    let mut old = ended.clone();
    old.target = commit(OLD);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Medium).marker(&old));
    assert_eq!(kinds(&fx.plan_at(t0(), later)), [("m1", "claim")]);
}

#[test]
fn item10_a_draining_rotation_proves_nothing_on_a_stale_mirror() {
    // It came up on a release the mirror lacks (maybe newer than our tip).
    let d = marker("m1", Phase::Draining, RotationMode::Grace, t0());
    let mut d = d;
    d.action = PolicyAction::Restart;
    d.severity = Severity::Medium;
    let mut unknown = M::drifted("m1", Severity::Medium);
    unknown.0.status = MachineStatus::UnknownRef;
    unknown.0.commit = None;
    unknown.0.commits_behind = None;
    let now = t0() + Cd::minutes(5);
    let mut fx = Fx::new("").with(unknown.clone().marker(&d));
    let plan = fx.plan_with(t0(), now, failing_fetch(), SlotsView::NotConfigured);
    assert!(restart_of(&plan, "m1").is_none(), "{plan:?}");
    // Nor does a backoff go back to draining (cordon) on it.
    let mut b = marker("m1", Phase::Backoff, RotationMode::Wait, t0());
    b.retry_at = Some(now);
    let mut fx = Fx::new("").with(unknown.clone().marker(&b));
    let plan = fx.plan_with(t0(), now, failing_fetch(), SlotsView::NotConfigured);
    assert!(advance_of(&plan, "m1").is_none(), "{plan:?}");
    // A good fetch: the same rotation goes on.
    let mut fx = Fx::new("").with(unknown.marker(&d));
    let plan = fx.plan_with(t0(), now, fetched(), SlotsView::NotConfigured);
    assert!(restart_of(&plan, "m1").is_some(), "{plan:?}");
}

#[test]
fn item11_a_machine_whose_metadata_is_unknown_gets_no_step_and_keeps_its_slot() {
    let now = t0() + Cd::hours(1);
    let dark = M::drifted("m1", Severity::Low).metadata_unknown("host_status unreachable");
    let mut fx = Fx::new("")
        .with(dark.clone())
        .with(M::drifted("a", Severity::Low));
    // The coordinator holds a slot for it: counted, and nothing reclaims it.
    let plan = fx.plan_with(
        t0(),
        now,
        fetched(),
        slots_with(&[("default", "m1", "m1-tag")]),
    );
    assert!(plan.steps().is_empty(), "{plan:?}");
    assert!(matches!(
        plan.decisions()[&mid("a")],
        Decision::WaitingForSlot { in_use: 1, .. }
    ));
    match &plan.decisions()[&mid("m1")] {
        Decision::MetadataUnknown { why } => assert!(why.contains("host_status"), "{why}"),
        other => panic!("{other:?}"),
    }
    // Not even a probe-failure record or an undo.
    let mut fx = Fx::new("").with(dark.unreachable());
    let plan = fx.plan_with(t0(), now, fetched(), slots_with(&[]));
    assert!(plan.steps().is_empty(), "{plan:?}");
}

#[test]
fn item11_an_unknown_slot_set_is_never_an_empty_one() {
    let unknown = SlotsView::Unknown("coordinator host unreachable".into());
    let now = t0() + Cd::minutes(10);
    // No claim.
    let mut fx = Fx::new("").with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(t0(), now, fetched(), unknown.clone());
    assert!(plan.steps().is_empty(), "{plan:?}");
    assert!(matches!(
        plan.decisions()[&mid("a")],
        Decision::SlotsUnknown { .. }
    ));
    // No restart of a rotation in progress; its undo still goes.
    let d = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let r = releasing_fenced("m2");
    let mut fx = Fx::new("")
        .with(M::drifted("m1", Severity::Low).marker(&d))
        .with(M::drifted("m2", Severity::Low).marker(&r));
    let plan = fx.plan_with(t0(), now, fetched(), unknown.clone());
    assert_eq!(kinds(&plan), [("m2", "yield")], "{plan:?}");
    // However long it stays unknown, the planner raises no
    // `coordinator_unreadable`: that is `decide::alerts`' (its tests).
    let mut fx = Fx::new("").with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(now, now + Cd::seconds(90), fetched(), unknown);
    assert!(
        !plan
            .alerts
            .iter()
            .any(|a| a.kind == AlertKind::CoordinatorUnreadable),
        "{:?}",
        plan.alerts
    );
}

#[test]
fn item14_verification_waits_for_fly_health_and_a_crash_loop_ends_the_attempt() {
    let mut r = marker("m1", Phase::Restarting, RotationMode::Wait, t0());
    r.cordoned = Some(true);
    // Reports the target, but a Fly check is critical: not verified yet.
    let mut fx = Fx::new("").with(M::on_tip("m1").check("critical").marker(&r));
    let plan = fx.plan_at(t0(), t0() + Cd::seconds(30));
    assert!(release_of(&plan, "m1").is_none(), "{plan:?}");
    // All checks passing: finished.
    let mut fx = Fx::new("").with(M::on_tip("m1").check("passing").marker(&r));
    assert_eq!(
        kinds(&fx.plan_at(t0(), t0() + Cd::seconds(30))),
        [("m1", "finish")]
    );
    // Crash-looping (two exits since the restart): the attempt ends now,
    // even though its last report shows the target.
    let looping = M::on_tip("m1")
        .exit_at(t0() + Cd::seconds(10))
        .exit_at(t0() + Cd::seconds(40))
        .marker(&r);
    let mut fx = Fx::new("").with(looping);
    let plan = fx.plan_at(t0(), t0() + Cd::seconds(60));
    let (next, _) = advance_of(&plan, "m1").expect("backoff");
    assert_eq!((next.phase, next.attempt), (Phase::Backoff, 1));
    // An exit before the restart is not a crash loop.
    let once = M::on_tip("m1")
        .exit_at(t0() - Cd::seconds(10))
        .exit_at(t0() + Cd::seconds(10))
        .marker(&r);
    let mut fx = Fx::new("").with(once);
    assert_eq!(
        kinds(&fx.plan_at(t0(), t0() + Cd::seconds(60))),
        [("m1", "finish")]
    );
    // The cordon lost at the restart is asserted again.
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .fly_cordoned(false)
            .marker(&r),
    );
    let plan = fx.plan_at(t0(), t0() + Cd::seconds(60));
    let (again, cordon) = advance_of(&plan, "m1").expect("re-cordon");
    assert!(cordon);
    assert_eq!(again, r, "the marker is unchanged");
}

#[test]
fn item16_an_outside_update_mid_rotation_ends_the_rotation() {
    let mut d = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    d.instance_id = Some("01-ours".into());
    let now = t0() + Cd::minutes(2);
    // Same instance: restarted when idle, the recorded instance kept.
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .instance("01-ours")
            .marker(&d),
    );
    let plan = fx.plan_at(t0(), now);
    assert_eq!(
        restart_of(&plan, "m1").unwrap().0.instance_id.as_deref(),
        Some("01-ours")
    );
    // A marker of an older version (no instance recorded): nothing to compare.
    let mut old = d.clone();
    old.instance_id = None;
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .instance("02-theirs")
            .marker(&old),
    );
    assert!(restart_of(&fx.plan_at(t0(), now), "m1").is_some());
    // `fly deploy` replaced it: never act on the stale plan.
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .instance("02-theirs")
            .marker(&d),
    );
    let plan = fx.plan_at(t0(), now);
    assert!(restart_of(&plan, "m1").is_none(), "{plan:?}");
    let (next, _, why) = release_of(&plan, "m1").expect("ended safely");
    assert_eq!(next.ending, Some(Ending::Cancelled));
    assert_eq!(why, ReleaseWhy::UpdatedFromOutside);
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["m1"]);
    // Updated onto the target: finished.
    let mut fx = Fx::new("").with(M::on_tip("m1").instance("02-theirs").marker(&d));
    assert_eq!(kinds(&fx.plan_at(t0(), now)), [("m1", "finish")]);
    // Mid-undo: the update restarted the agent, which lifted its fence; no
    // restart of ours follows the stale plan.
    let mut r = releasing_fenced("m1");
    r.instance_id = Some("01-ours".into());
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .unreachable()
            .unprobed_since(t0() - Cd::hours(5))
            .instance("02-theirs")
            .marker(&r),
    );
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(31));
    assert!(restart_of(&plan, "m1").is_none(), "{plan:?}");
    let (next, undrain, _) = release_of(&plan, "m1").unwrap();
    assert!(!undrain && next.may_have_cordoned());
    // Claims record the pool (the instance is the executor's to record, from
    // the machine it reads under the lease, not from this older snapshot).
    let mut fx = Fx::new("").with(M::drifted("a", Severity::Low).instance("07-a"));
    let plan = fx.plan_at(t0(), t0() + Cd::hours(1));
    let StepKind::Claim { marker, .. } = &plan.steps()[0].kind else {
        panic!("{plan:?}")
    };
    assert_eq!(marker.instance_id, None);
    assert_eq!(marker.pool, Some(PoolName::from("default")));
}

#[test]
fn item17_a_pool_label_edited_mid_rotation_keeps_the_pool_of_its_slot() {
    let mut d = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    d.pool = Some("default".into());
    let now = t0() + Cd::minutes(2);
    let relabelled = M::drifted("m1", Severity::Low).pool("wide", PolicyAction::AlertAndWait);
    let mut fx = Fx::new("")
        .with(relabelled.marker(&d))
        .with(M::drifted("w", Severity::Medium).pool("wide", PolicyAction::AlertAndWait));
    let plan = fx.plan_with(
        t0(),
        now,
        fetched(),
        slots_with(&[("default", "m1", d.tag.as_str())]),
    );
    let step = plan
        .steps()
        .into_iter()
        .find(|s| s.target.machine_id == MachineId::from("m1"))
        .expect("a step");
    assert!(matches!(step.kind, StepKind::Restart { .. }), "{plan:?}");
    assert_eq!(
        step.target.pool,
        PoolName::from("default"),
        "slot calls go to its own pool"
    );
    // It takes no slot of its new pool: `w` claims there.
    assert!(kinds(&plan).contains(&("w", "claim")), "{plan:?}");
    assert_eq!(
        plan.rotations_in_progress
            .get(&("app".into(), "default".into())),
        Some(&1)
    );
}

#[test]
fn item7_a_slot_left_behind_does_not_block_its_pool() {
    // The coordinator still lists a slot whose rotation ended (no marker, or
    // a yielded one): the next claim reclaims it, so it is not counted.
    let now = t0() + Cd::hours(1);
    let mut y = marker("x", Phase::Yielded, RotationMode::Wait, t0());
    y.retry_at = Some(now + Cd::hours(1));
    for x in [M::on_tip("x"), M::drifted("x", Severity::Low).marker(&y)] {
        let mut fx = Fx::new("").with(x).with(M::drifted("a", Severity::Low));
        let plan = fx.plan_with(
            t0(),
            now,
            fetched(),
            slots_with(&[("default", "x", &y.tag)]),
        );
        assert_eq!(kinds(&plan), [("a", "claim")], "{plan:?}");
    }
    // A machine gone from a listed app holds nothing either.
    let mut fx = Fx::new("").with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(
        t0(),
        now,
        fetched(),
        slots_with(&[("default", "gone", "t")]),
    );
    assert_eq!(kinds(&plan), [("a", "claim")], "{plan:?}");
    // A live rotation's slot is counted.
    let d = marker("x", Phase::Draining, RotationMode::Wait, t0());
    let mut fx = Fx::new("")
        .with(M::drifted("x", Severity::Low).busy().marker(&d))
        .with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(
        t0(),
        now,
        fetched(),
        slots_with(&[("default", "x", &d.tag)]),
    );
    assert!(matches!(
        plan.decisions()[&mid("a")],
        Decision::WaitingForSlot { in_use: 1, .. }
    ));
}

#[test]
fn a_slot_whose_machine_is_cordoned_without_a_marker_is_kept_and_alerted() {
    // Our cordon landed after `fly deploy` reverted the marker, and its
    // undo failed: the machine's capacity is out, so its slot still counts
    // (the cap holds) and a human is told how to uncordon it.
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("")
        .with(M::on_tip("x").fly_cordoned(true))
        .with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(t0(), now, fetched(), slots_with(&[("default", "x", "t1")]));
    assert!(
        matches!(
            plan.decisions()[&mid("a")],
            Decision::WaitingForSlot { in_use: 1, .. }
        ),
        "{plan:?}"
    );
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["x"], "{plan:?}");
    // Uncordoned, the slot is left behind and reclaimed by the next claim.
    let mut fx = Fx::new("")
        .with(M::on_tip("x").fly_cordoned(false))
        .with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(t0(), now, fetched(), slots_with(&[("default", "x", "t1")]));
    assert_eq!(kinds(&plan), [("a", "claim")], "{plan:?}");
    assert!(alerts(&plan, AlertKind::RotationStuck).is_empty());
}

// ---- issue #32: authority and approvals ----------------------------------------

/// Only the `default` pool, with `actions` (low, medium, high, critical) and cap `cap`.
fn default_pool(cap: u32, actions: [PolicyAction; 4]) -> Policy {
    use crate::config::{ActionMap, PoolConfig};
    Policy::default().with_pool(
        "default",
        PoolConfig {
            max_concurrent_rotations: std::num::NonZeroU32::new(cap).unwrap(),
            actions: ActionMap::from(actions),
            ..PoolConfig::default()
        },
    )
}

/// The marker the executor leaves once `step` went through (the slot won
/// and the cordon made for a claim, the marker written for a restart, the
/// undo done for a yield).
fn applied(step: &Step) -> Marker {
    match &step.kind {
        StepKind::Claim { marker, .. } => Marker {
            phase: Phase::Draining,
            cordoned: Some(true),
            instance_id: Some("i1".into()),
            ..marker.clone()
        },
        StepKind::Restart { marker, .. } => marker.clone(),
        StepKind::Release { marker, .. } if marker.ending == Some(Ending::Yielded) => Marker {
            phase: Phase::Yielded,
            ending: None,
            cordoned: Some(false),
            drain_requested: false,
            ..marker.clone()
        },
        other => panic!("not applied by this helper: {other:?}"),
    }
}

/// The one rotation step of `id` in `plan`.
fn step_of<'a>(plan: &'a Plan, id: &str) -> &'a Step {
    let steps = rotation_steps(plan);
    let id = MachineId::from(id);
    steps
        .into_iter()
        .find(|s| s.target.machine_id == id)
        .unwrap_or_else(|| panic!("no step for {id}: {plan:?}"))
}

impl M {
    /// An approval of `target` written at `at` (another value than `approved`'s).
    fn approved_at(self, target: &str, mode: ApprovalMode, at: DateTime<Utc>) -> M {
        let a = Approval {
            target: commit(target),
            mode,
            by: "bob".into(),
            at,
        };
        self.put(APPROVE_KEY, &serde_json::to_string(&a).unwrap())
    }
}

/// #32 item 1: a rotation keeps no authority it was claimed with. m1 drifted
/// low and was claimed (alert-and-wait) while busy; then the tip moved to a
/// `Security:` commit: critical, which the pool maps to `manual`. Idle now,
/// it was restarted onto the critical release with no approval. Every phase
/// that can still lead to a restart judges the current severity and policy.
#[test]
fn issue32_item1_a_rotation_whose_authority_changed_is_cancelled_and_claimed_afresh() {
    use PolicyAction::{AlertAndWait, Manual, Restart};
    let now = t0() + Cd::minutes(5);
    let security = default_pool(1, [AlertAndWait, Restart, Manual, Manual]);
    let claimed = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Critical)
            .pool("default", Manual)
            .marker(&claimed),
    );
    fx.policy = security.clone();
    let plan = fx.plan_at(t0(), now);
    assert!(
        restart_of(&plan, "m1").is_none(),
        "restarted onto a critical release without an approval: {plan:?}"
    );
    let (next, _, why) = release_of(&plan, "m1").expect("cancelled");
    assert_eq!(next.ending, Some(Ending::Cancelled));
    assert_eq!(why, ReleaseWhy::AuthorityChanged);
    // The next sweep claims it under the current policy: an operator is asked.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Critical).pool("default", Manual));
    fx.policy = security.clone();
    let plan = fx.plan_at(t0(), now);
    assert_eq!(alerts(&plan, AlertKind::ManualApprovalRequired), ["m1"]);
    assert!(plan.steps().is_empty(), "{plan:?}");

    // The daemon restarted with the pool changed to `manual`: same severity.
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .pool("default", Manual)
            .marker(&claimed),
    );
    fx.policy = default_pool(1, [Manual; 4]);
    let plan = fx.plan_at(t0(), now);
    assert!(restart_of(&plan, "m1").is_none(), "{plan:?}");
    assert_eq!(
        release_of(&plan, "m1").map(|r| r.2),
        Some(ReleaseWhy::AuthorityChanged)
    );

    // `restart` below critical: the grace never interrupts a machine whose
    // current severity the pool leaves to an operator.
    let mut grace = marker("m1", Phase::Draining, RotationMode::Grace, t0());
    grace.action = Restart;
    grace.severity = Severity::Medium;
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Critical)
            .busy()
            .pool("default", Manual)
            .marker(&grace),
    );
    fx.policy = default_pool(1, [Restart, Restart, Restart, Manual]);
    let plan = fx.plan_at(t0(), now);
    assert!(restart_of(&plan, "m1").is_none(), "{plan:?}");
    assert_eq!(
        release_of(&plan, "m1").map(|r| r.2),
        Some(ReleaseWhy::AuthorityChanged)
    );

    // A failed verify's next attempt is judged again.
    let mut backoff = marker("m1", Phase::Backoff, RotationMode::Wait, t0());
    backoff.restart_at = Some(t0());
    backoff.attempt = 1;
    backoff.retry_at = Some(now - Cd::seconds(1));
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Critical)
            .pool("default", Manual)
            .marker(&backoff),
    );
    fx.policy = security.clone();
    let plan = fx.plan_at(t0(), now);
    assert_eq!(
        release_of(&plan, "m1").map(|r| r.2),
        Some(ReleaseWhy::AuthorityChanged),
        "{plan:?}"
    );

    // The restart already sent: its verify goes on.
    let restarting = marker("m1", Phase::Restarting, RotationMode::Wait, t0());
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Critical)
            .pool("default", Manual)
            .marker(&restarting),
    );
    fx.policy = security.clone();
    let plan = fx.plan_at(t0(), t0() + Cd::seconds(30));
    assert!(release_of(&plan, "m1").is_none(), "{plan:?}");

    // Unprobeable: no current severity, the marker's stands.
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .unreachable()
            .marker(&claimed),
    );
    fx.policy = security;
    let plan = fx.plan_at(t0(), now);
    assert!(release_of(&plan, "m1").is_none(), "{plan:?}");
}

/// #32 item 6: a yield does not reset `max_attempts`. A retry that drained
/// into a busy agent yielded, and the next claim started at attempt 0: 3
/// restarts with `max_attempts = 2`.
#[test]
fn issue32_item6_a_claim_after_a_yield_carries_the_restart_count_on() {
    let two = |r: &mut crate::config::RotationConfig| {
        r.max_attempts = std::num::NonZeroU32::new(2).unwrap();
    };
    let now = t0() + Cd::hours(3);
    // One restart did not verify; its retry yielded at the drain ceiling.
    let mut y = marker("m1", Phase::Yielded, RotationMode::Wait, t0());
    y.attempt = 1;
    y.restart_at = Some(t0());
    y.retry_at = Some(now - Cd::minutes(1));
    let mut fx = Fx::new("")
        .rotation(two)
        .with(M::drifted("m1", Severity::Low).marker(&y));
    let claim = fx.plan_at(t0(), now);
    let draining = applied(step_of(&claim, "m1"));
    let mut fx = Fx::new("")
        .rotation(two)
        .with(M::drifted("m1", Severity::Low).marker(&draining));
    let restart = fx.plan_at(t0(), now + Cd::seconds(10));
    let restarting = restart_of(&restart, "m1")
        .expect("restart 2 of 2")
        .0
        .clone();
    // Restart 2 did not verify: the rotation fails, no third restart.
    let mut fx = Fx::new("")
        .rotation(two)
        .with(M::drifted("m1", Severity::Low).marker(&restarting));
    let plan = fx.plan_at(t0(), now + Cd::minutes(10));
    let (next, _, why) = release_of(&plan, "m1").unwrap_or_else(|| panic!("{plan:?}"));
    assert_eq!(why, ReleaseWhy::MaxAttempts);
    assert_eq!(next.failed.map(|f| f.attempts), Some(2));

    // Judged before every restart: a rotation whose count is spent fails
    // instead of restarting again.
    let mut spent = marker("m1", Phase::Draining, RotationMode::Wait, now);
    spent.attempt = 2;
    let mut fx = Fx::new("")
        .rotation(two)
        .with(M::drifted("m1", Severity::Low).marker(&spent));
    let plan = fx.plan_at(t0(), now + Cd::seconds(10));
    assert!(restart_of(&plan, "m1").is_none(), "{plan:?}");
    assert_eq!(
        release_of(&plan, "m1").map(|r| r.2),
        Some(ReleaseWhy::MaxAttempts)
    );
}
/// #32 item 9: a lowered cap is not exceeded by rotations in flight. Two busy
/// machines claimed under cap 2; the daemon restarts with cap 1: the newest
/// that has not restarted yields; one that has restarted is never touched.
#[test]
fn issue32_item9_rotations_over_a_lowered_cap_yield_the_newest_first() {
    let now = t0() + Cd::minutes(5);
    let a = marker("a", Phase::Draining, RotationMode::Wait, t0());
    let b = marker(
        "b",
        Phase::Draining,
        RotationMode::Wait,
        t0() + Cd::minutes(1),
    );
    let mut fx = Fx::new("")
        .with(M::drifted("a", Severity::Low).busy().marker(&a))
        .with(M::drifted("b", Severity::Low).busy().marker(&b));
    let plan = fx.plan_at(t0(), now);
    let (next, _, _) = release_of(&plan, "b").unwrap_or_else(|| panic!("{plan:?}"));
    assert_eq!(next.ending, Some(Ending::Yielded));
    assert!(next.retry_at.is_some());
    assert_eq!(kinds(&plan), [("b", "yield")], "{plan:?}");
    assert_eq!(
        release_of(&plan, "b").map(|r| r.2),
        Some(ReleaseWhy::OverCap)
    );

    // The newest has restarted: the other one yields.
    let r = marker(
        "a",
        Phase::Restarting,
        RotationMode::Wait,
        t0() + Cd::minutes(2),
    );
    let mut fx = Fx::new("")
        .with(M::drifted("a", Severity::Low).busy().marker(&r))
        .with(M::drifted("b", Severity::Low).busy().marker(&b));
    let plan = fx.plan_at(t0(), now);
    assert_eq!(
        release_of(&plan, "b").map(|r| r.2),
        Some(ReleaseWhy::OverCap),
        "{plan:?}"
    );
    assert!(release_of(&plan, "a").is_none(), "{plan:?}");

    // Within the cap, nothing yields.
    let mut fx = Fx::new("").with(M::drifted("b", Severity::Low).busy().marker(&b));
    assert!(fx.plan_at(t0(), now).steps().is_empty());
}

/// #32 item 2: an approval authorizes exactly one rotation. `approve --now`,
/// the busy machine restarted as approved, then `fly deploy` replaced it
/// during verify: the rotation ended cancelled, the approval stayed, and
/// the next sweep restarted the busy machine again.
#[test]
fn issue32_item2_an_approval_is_consumed_by_the_rotation_that_restarted() {
    let now = t0() + Cd::hours(1);
    let busy = || M::drifted("m1", Severity::High).busy().instance("i1");
    let mut fx = Fx::new("").with(busy().approved(TIP, ApprovalMode::Now));
    let draining = applied(step_of(&fx.plan_at(t0(), now), "m1"));
    // The claim names the approval it uses.
    let used = fx.report().machines[0]
        .seen
        .inputs
        .controls
        .approval_id
        .clone();
    assert!(used.is_some());
    assert_eq!(draining.approval, used);
    let mut fx = Fx::new("").with(busy().approved(TIP, ApprovalMode::Now).marker(&draining));
    let plan = fx.plan_at(t0(), now + Cd::seconds(10));
    let restarting = restart_of(&plan, "m1").expect("approved now").0.clone();
    let deployed = || busy().instance("i2").marker(&restarting);
    let cancelled = |plan: &Plan| match &step_of(plan, "m1").kind {
        StepKind::Release {
            clear_approval,
            why,
            marker,
            ..
        } => {
            assert_eq!(*why, ReleaseWhy::UpdatedFromOutside);
            assert_eq!(marker.ending, Some(Ending::Cancelled));
            *clear_approval
        }
        other => panic!("{other:?}"),
    };
    let mut fx = Fx::new("").with(deployed().approved(TIP, ApprovalMode::Now));
    let plan = fx.plan_at(t0(), now + Cd::seconds(20));
    assert!(
        cancelled(&plan),
        "the approval outlives the rotation it authorized: {plan:?}"
    );
    // A newer approval written since the claim: the one the rotation used is
    // still consumed (listed as spent: written back, it must approve
    // nothing, #33); the newer one stays for the next rotation, as the
    // executor deletes only the approval the marker names
    // (`executor::tests::consumption_spends_the_named_approval_and_deletes_only_it`).
    let mut fx =
        Fx::new("").with(deployed().approved_at(TIP, ApprovalMode::Now, t0() + Cd::minutes(61)));
    assert!(cancelled(&fx.plan_at(t0(), now + Cd::seconds(20))));
    // A rotation that never restarted leaves its approval standing.
    let mut fx = Fx::new("").with(
        busy()
            .instance("i2")
            .approved(TIP, ApprovalMode::Now)
            .marker(&draining),
    );
    assert!(!cancelled(&fx.plan_at(t0(), now + Cd::seconds(20))));
}

/// #33 (what remained) item 1: the executor's last read requires the very
/// approval a `manual` rotation was claimed with (the one its marker names),
/// so that a consumed approval written back cannot pass it. An operator who
/// re-approves mid-rotation (another mode, or the same one again: a new
/// approval either way) thus replaces the rotation's authority. Before, the
/// planner checked only that some approval named the commit: the rotation
/// went on under the old mode (its steps then declined by the executor at
/// every call). Now it is cancelled before any further step, undone like a
/// revoke; the next sweep claims afresh under the new approval, in its
/// mode. The same approval still standing lets it go on.
#[test]
fn a_rotation_whose_approval_was_replaced_is_cancelled_and_claimed_afresh() {
    let now = t0() + Cd::hours(1);
    let busy = || M::drifted("m1", Severity::High).busy().instance("i1");
    let mut fx = Fx::new("").with(busy().approved(TIP, ApprovalMode::Now));
    let draining = applied(step_of(&fx.plan_at(t0(), now), "m1"));
    assert_eq!(draining.mode, RotationMode::Now);
    // Still the approval it was claimed with: the interrupting restart.
    let mut fx = Fx::new("").with(busy().approved(TIP, ApprovalMode::Now).marker(&draining));
    assert!(restart_of(&fx.plan_at(t0(), now + Cd::seconds(10)), "m1").is_some());
    // Narrowed to when-idle after the claim (a new approval of the same commit).
    let narrowed = || busy().approved_at(TIP, ApprovalMode::WhenIdle, t0() + Cd::minutes(61));
    let mut fx = Fx::new("").with(narrowed().marker(&draining));
    let plan = fx.plan_at(t0(), now + Cd::seconds(10));
    assert!(restart_of(&plan, "m1").is_none(), "{plan:?}");
    let (next, _, why) = release_of(&plan, "m1").expect("cancelled");
    assert_eq!(
        (next.ending, why),
        (Some(Ending::Cancelled), ReleaseWhy::ApprovalRevoked)
    );
    // The next sweep claims under the new approval, naming it, in its mode.
    let mut fx = Fx::new("").with(narrowed());
    let claim = fx.plan_at(t0(), now + Cd::seconds(20));
    let claimed = applied(step_of(&claim, "m1"));
    let new_id = fx.report().machines[0]
        .seen
        .inputs
        .controls
        .approval_id
        .clone();
    assert_eq!(claimed.approval, new_id);
    assert_ne!(claimed.approval, draining.approval);
    assert_eq!(claimed.mode, RotationMode::Wait);
}

/// #32 item 5: a failed rotation is re-armed by a new approval, never by
/// comparing an operator host's clock with a replica's. An approval stamped
/// 10 minutes ahead re-armed the failed target after every failure: 10
/// restarts with `max_attempts = 1`.
#[test]
fn issue32_item5_only_a_new_approval_rearms_a_failed_target() {
    let one = |r: &mut crate::config::RotationConfig| {
        r.max_attempts = std::num::NonZeroU32::MIN;
    };
    let now = t0() + Cd::hours(1);
    let ahead = now + Cd::minutes(10);
    let mut r = marker("m1", Phase::Restarting, RotationMode::Grace, now);
    (r.action, r.severity) = (PolicyAction::Restart, Severity::Medium);
    let m = || M::drifted("m1", Severity::Medium).approved_at(TIP, ApprovalMode::WhenIdle, ahead);
    let mut fx = Fx::new("").rotation(one).with(m().marker(&r));
    let plan = fx.plan_at(t0(), now + Cd::minutes(6));
    let failed = step_of(&plan, "m1");
    assert_eq!(
        release_of(&plan, "m1").map(|r| r.2),
        Some(ReleaseWhy::MaxAttempts)
    );
    let yielded = applied(failed);
    let failed_with = yielded.failed.as_ref().and_then(|f| f.approval.clone());
    assert!(failed_with.is_some(), "{yielded:?}");
    let mut fx = Fx::new("").rotation(one).with(m().marker(&yielded));
    let plan = fx.plan_at(t0(), now + Cd::minutes(7));
    assert!(
        rotation_steps(&plan).is_empty(),
        "the approval that stood when it failed re-armed it: {plan:?}"
    );
    assert!(matches!(
        plan.decisions()[&mid("m1")],
        Decision::RotationFailed { .. }
    ));
    // A new approval of the target re-arms it, once.
    let mut fx = Fx::new("").rotation(one).with(
        M::drifted("m1", Severity::Medium)
            .approved_at(TIP, ApprovalMode::WhenIdle, now - Cd::days(1))
            .marker(&yielded),
    );
    let plan = fx.plan_at(t0(), now + Cd::minutes(7));
    assert_eq!(kinds(&plan), [("m1", "claim")], "{plan:?}");
    // ... and the rotation it re-armed names it, to consume it.
    let new = fx.report().machines[0]
        .seen
        .inputs
        .controls
        .approval_id
        .clone();
    assert!(new.is_some() && new != failed_with);
    assert_eq!(applied(step_of(&plan, "m1")).approval, new);
    assert_eq!(
        applied(step_of(&plan, "m1")).attempt,
        0,
        "re-armed: starts over"
    );
    // A failure recorded by an older version names no approval: any
    // approval of the target re-arms it (the rotation then consumes it).
    let mut older = yielded.clone();
    if let Some(f) = older.failed.as_mut() {
        f.approval = None;
    }
    let mut fx = Fx::new("").rotation(one).with(m().marker(&older));
    let plan = fx.plan_at(t0(), now + Cd::minutes(7));
    assert_eq!(kinds(&plan), [("m1", "claim")], "{plan:?}");
}

// ---- issue #32: one clock, and probe evidence from every replica ---------

/// One replica's sweep: `tracker` (its memory) observes `report` at `now`,
/// then it plans.
fn sweep_plan(tracker: &mut Tracker, report: &Snapshot, now: DateTime<Utc>) -> Plan {
    tracker.observe(report, now);
    plan_fn(report, tracker, now)
}

/// A `draining` rotation of a `restart` pool, written by `owner` at `at`
/// (its own clock).
fn grace_marker(id: &str, owner: &str, at: DateTime<Utc>) -> Marker {
    let mut m = marker(id, Phase::Draining, RotationMode::Grace, at);
    m.owner = owner.into();
    m.action = PolicyAction::Restart;
    m.severity = Severity::Medium;
    m.cordoned = Some(true);
    m
}

#[test]
fn item8_a_replica_whose_clock_is_behind_does_not_cut_the_grace() {
    // A's clock is 10 minutes behind: its claim says t0 - 10m. B first sees
    // it (cordoned, busy) at t0: the 60 s grace runs on B's clock from t0.
    let m = grace_marker("m1", "replica-a", t0() - Cd::minutes(10));
    let report = Fx::new("")
        .with(
            M::drifted("m1", Severity::Medium)
                .busy()
                .fly_cordoned(true)
                .marker(&m),
        )
        .report();
    let mut b = Tracker::default();
    let plan = sweep_plan(&mut b, &report, t0());
    assert!(
        restart_of(&plan, "m1").is_none(),
        "restarted at B's first sight of a marker written by a clock 10 min behind: {:?}",
        plan.steps()
    );
    assert_eq!(
        plan.decision(&mid("m1")),
        Some(&Decision::LiveWork {
            since: t0(),
            deadline: t0() + Cd::hours(1)
        }),
        "the shown deadlines are on B's clock"
    );
    let plan = sweep_plan(&mut b, &report, t0() + Cd::seconds(59));
    assert!(restart_of(&plan, "m1").is_none(), "{:?}", plan.steps());
    let plan = sweep_plan(&mut b, &report, t0() + Cd::seconds(60));
    assert!(restart_of(&plan, "m1").is_some_and(|(_, interrupts)| interrupts));

    // The drain ceiling (1 h) too: a marker 2 h old by its writer's clock,
    // first seen now, does not yield at once.
    let w = marker(
        "m2",
        Phase::Draining,
        RotationMode::Wait,
        t0() - Cd::hours(2),
    );
    let report = Fx::new("")
        .with(M::drifted("m2", Severity::Low).busy().marker(&w))
        .report();
    let mut b = Tracker::default();
    let plan = sweep_plan(&mut b, &report, t0());
    assert!(release_of(&plan, "m2").is_none(), "{:?}", plan.steps());
    let plan = sweep_plan(&mut b, &report, t0() + Cd::hours(1));
    assert_eq!(
        release_of(&plan, "m2").map(|(_, _, why)| why),
        Some(ReleaseWhy::DrainCeiling)
    );

    // A yielded marker's retry: written by a clock 10 min behind (retry_at
    // = its now + 1 h), first seen at t0: not due before t0 + 1 h.
    let mut y = marker(
        "m3",
        Phase::Yielded,
        RotationMode::Wait,
        t0() - Cd::minutes(10),
    );
    y.retry_at = Some(t0() + Cd::minutes(50));
    let report = Fx::new("")
        .with(M::drifted("m3", Severity::Low).marker(&y))
        .report();
    let mut b = Tracker::default();
    b.observe(&report, t0());
    let plan = sweep_plan(&mut b, &report, t0() + Cd::minutes(55));
    assert_eq!(
        plan.decision(&mid("m3")),
        Some(&Decision::Yielded {
            retry_at: Some(t0() + Cd::hours(1))
        }),
        "{:?}",
        plan.steps()
    );
    let plan = sweep_plan(&mut b, &report, t0() + Cd::hours(1));
    assert_eq!(kinds(&plan), [("m3", "claim")]);
}

#[test]
fn item12_the_grace_counts_from_the_cordon_fly_confirmed() {
    // The marker is written at t0; the cordon lands 3 s later (after a 429
    // and a 500): Fly first says cordoned at t0 + 3 s.
    let m = grace_marker("m1", "r", t0());
    let machine = M::drifted("m1", Severity::Medium).busy().marker(&m);
    let before = Fx::new("")
        .with(machine.clone().fly_cordoned(false))
        .report();
    let after = Fx::new("")
        .with(machine.clone().fly_cordoned(true))
        .report();
    let mut r = Tracker::default();
    let plan = sweep_plan(&mut r, &before, t0() + Cd::seconds(2));
    assert!(restart_of(&plan, "m1").is_none());
    let plan = sweep_plan(&mut r, &after, t0() + Cd::seconds(3));
    assert!(restart_of(&plan, "m1").is_none());
    let plan = sweep_plan(&mut r, &after, t0() + Cd::seconds(62));
    assert!(
        restart_of(&plan, "m1").is_none(),
        "busy work interrupted 59 s after the cordon against a 60 s grace: {:?}",
        plan.steps()
    );
    let plan = sweep_plan(&mut r, &after, t0() + Cd::seconds(63));
    assert!(restart_of(&plan, "m1").is_some_and(|(_, interrupts)| interrupts));

    // Never seen cordoned: the grace has not started (the drain ceiling
    // still yields, interrupting nothing).
    for cordoned in [None, Some(false)] {
        let mut m = machine.clone();
        m.0.inputs.cordoned = cordoned;
        let report = Fx::new("").with(m).report();
        let mut r = Tracker::default();
        r.observe(&report, t0());
        let plan = sweep_plan(&mut r, &report, t0() + Cd::minutes(59));
        assert!(
            restart_of(&plan, "m1").is_none(),
            "{cordoned:?}: {:?}",
            plan.steps()
        );
    }
}

#[test]
fn item3_a_replica_cut_off_from_the_agents_never_restarts_what_another_sees() {
    // Replica A saw m1 drifted, then lost the agents for 5 h. Replica B
    // probes m1 every sweep and clears the shared record each time: A's own
    // memory is no evidence for the ceiling.
    let drifted = Fx::new("").with(M::drifted("m1", Severity::Low)).report();
    let cut_off = |m: M| Fx::new("").with(m.unreachable().check("critical")).report();
    let no_record = cut_off(M::drifted("m1", Severity::Low));
    let mut a = Tracker::default();
    a.observe(&drifted, t0());
    a.observe(&no_record, t0() + Cd::minutes(1));
    let plan = sweep_plan(&mut a, &no_record, t0() + Cd::hours(5));
    assert!(
        rotation_steps(&plan).is_empty(),
        "A claimed on its own memory while B clears the record: {:?}",
        plan.steps()
    );
    assert_eq!(
        kinds(&plan),
        [("m1", "record_unprobed")],
        "A still records what it sees"
    );
    assert_eq!(alerts(&plan, AlertKind::Drift), ["m1"], "and alerts");

    // The record counts from A's first sight of it; B's clear and A's new
    // record start that clock over.
    let record = cut_off(M::drifted("m1", Severity::Low).unprobed_since(t0()));
    // B's clear: a sealed note naming the record (#33: a bare deletion is
    // someone else's, and would still count).
    let note = crate::metadata::unprobed::Cleared {
        cleared: Unprobed {
            since: t0(),
            action: PolicyAction::AlertAndWait,
            severity: Severity::Low,
        }
        .fingerprint(),
    };
    let cleared_by_b = cut_off(M::drifted("m1", Severity::Low).put(UNPROBED_KEY, &note.to_value()));
    let mut a = Tracker::default();
    a.observe(&record, t0() + Cd::minutes(1));
    a.observe(&cleared_by_b, t0() + Cd::hours(2));
    a.observe(&record, t0() + Cd::hours(2) + Cd::minutes(1));
    let plan = sweep_plan(&mut a, &record, t0() + Cd::hours(5));
    assert!(rotation_steps(&plan).is_empty(), "{:?}", plan.steps());
    let plan = sweep_plan(&mut a, &record, t0() + Cd::hours(6) + Cd::minutes(1));
    assert_eq!(kinds(&plan), [("m1", "claim")], "{:?}", plan.steps());

    // A record whose `since` another replica's clock wrote 5 h back counts
    // from this replica's first sight.
    let mut a = Tracker::default();
    a.observe(&record, t0() + Cd::hours(1));
    let plan = sweep_plan(&mut a, &record, t0() + Cd::hours(2));
    assert!(rotation_steps(&plan).is_empty(), "{:?}", plan.steps());
    assert_eq!(
        plan.decision(&mid("m1")),
        Some(&Decision::Unprobeable {
            since: Some(t0() + Cd::hours(1)),
            ceiling_at: Some(t0() + Cd::hours(5)),
        })
    );
}

#[test]
fn item3_the_probe_failure_ceiling_restarts_only_what_fly_calls_failing() {
    let wide = |r: &mut crate::config::RotationConfig| {
        r.drain_ceiling = std::time::Duration::from_secs(10 * 3600);
    };
    let now = t0() + Cd::hours(5);
    let unreachable = |id: &str| {
        M::drifted(id, Severity::Low)
            .unreachable()
            .unprobed_since(t0())
    };
    let d = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    for (checks, ok) in [
        (None, false),
        (Some("passing"), false),
        (Some("critical"), true),
    ] {
        let with = |m: M| match checks {
            Some(c) => m.check(c),
            None => m,
        };
        // No rotation yet (seen drifted first): a claim only if Fly's checks fail.
        let mut fx = Fx::new("").with(with(unreachable("m1")));
        let seen_drifted = Fx::new("").with(M::drifted("m1", Severity::Low)).report();
        fx.tracker.observe(&seen_drifted, t0());
        let plan = fx.plan_at(t0(), now);
        assert_eq!(
            kinds(&plan) == [("m1", "claim")],
            ok,
            "{checks:?}: {:?}",
            plan.steps()
        );
        if !ok {
            assert!(
                matches!(
                    plan.decision(&mid("m1")),
                    Some(Decision::Unprobeable {
                        ceiling_at: None,
                        ..
                    })
                ),
                "{checks:?}: {:?}",
                plan.decision(&mid("m1"))
            );
            let drift = plan
                .alerts
                .iter()
                .find(|a| a.kind == AlertKind::Drift)
                .expect("stays alerted");
            assert!(drift.summary.contains("Fly's checks"), "{}", drift.summary);
        }
        // Draining: the unprobeable restart needs them failing too.
        let mut fx = Fx::new("")
            .rotation(wide)
            .with(with(unreachable("m1")).marker(&d));
        let plan = fx.plan_at(t0(), now);
        assert_eq!(
            guard_of(&plan, "m1") == Some(RestartGuard::Unprobeable),
            ok,
            "{checks:?}: {:?}",
            plan.steps()
        );
        // Releasing a fenced agent past both ceilings: restarted only then;
        // else its undrain is given up.
        let r = releasing_fenced("m1");
        let mut fx = Fx::new("").with(with(unreachable("m1")).marker(&r));
        let plan = fx.plan_at(t0(), t0() + Cd::hours(5));
        assert_eq!(
            guard_of(&plan, "m1") == Some(RestartGuard::Unprobeable),
            ok,
            "{checks:?}: {:?}",
            plan.steps()
        );
    }
}

/// #32 item 7. Before: a machine cordoned with no marker was counted and
/// alerted only while it still held a coordinator slot; after a withdraw
/// (which deleted the marker and the slot, not the cordon) it was out of
/// the count and nobody was told.
#[test]
fn a_machine_cordoned_without_a_marker_or_a_slot_is_counted_and_alerted() {
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("")
        .with(M::on_tip("x").fly_cordoned(true))
        .with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(t0(), now, fetched(), slots_with(&[]));
    assert!(
        matches!(
            plan.decisions()[&mid("a")],
            Decision::WaitingForSlot { in_use: 1, .. }
        ),
        "the cordoned machine's capacity is out: {plan:?}"
    );
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["x"], "{plan:?}");
    // Without a known slot set too.
    let mut fx = Fx::new("")
        .with(M::on_tip("x").fly_cordoned(true))
        .with(M::drifted("a", Severity::Low));
    let plan = fx.plan_at(t0(), now);
    assert!(
        matches!(
            plan.decisions()[&mid("a")],
            Decision::WaitingForSlot { in_use: 1, .. }
        ),
        "{plan:?}"
    );
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["x"], "{plan:?}");
}

// ---- issue 32 item 13: Fly's own clients and docs ----------------------------

impl M {
    fn fly_checks(mut self, checks: crate::observe::sweep::FlyChecks) -> M {
        self.0.inputs.fly_checks = checks.into();
        self
    }

    fn stop_timeout_secs(mut self, secs: u16) -> M {
        self.0.inputs.stop_timeout_secs = secs;
        self
    }

    /// An exit event at `at` with its `request.exit_event` details.
    fn exit_detail(mut self, at: DateTime<Utc>, exit: Option<crate::fly::ExitDetail>) -> M {
        self.0
            .inputs
            .unusual_mut()
            .events
            .push(crate::fly::MachineEvent {
                kind: "exit".into(),
                status: "stopped".into(),
                source: "flyd".into(),
                timestamp: at.timestamp_millis(),
                exit,
            });
        self
    }
}

/// flyctl waits for fresh check results after a restart: a config that
/// defines checks verifies only once every one has a passing result
/// written after the restart; one without checks is judged as before.
#[test]
fn item13b_verification_needs_a_check_result_newer_than_the_restart() {
    use crate::observe::sweep::FlyChecks;
    let r = marker("m1", Phase::Restarting, RotationMode::Wait, t0());
    let now = t0() + Cd::seconds(30);
    let ms = |t: DateTime<Utc>| t.timestamp_millis();
    for (checks, verified) in [
        // Every check passing, but the oldest result predates the restart.
        (
            FlyChecks::AllPassingSince(ms(t0() - Cd::seconds(10))),
            false,
        ),
        // Written at the restart's very instant: not after it.
        (FlyChecks::AllPassingSince(ms(t0())), false),
        // A defined check without a result (the list empty after a boot).
        (FlyChecks::NotAllPassing, false),
        // Every result written after the restart.
        (FlyChecks::AllPassingSince(ms(t0() + Cd::seconds(5))), true),
        // No check defined: the agent's report and `started` decide.
        (FlyChecks::NoneDefined, true),
    ] {
        let mut fx = Fx::new("").with(M::on_tip("m1").fly_checks(checks).marker(&r));
        let plan = fx.plan_at(t0(), now);
        assert_eq!(
            release_of(&plan, "m1").is_some(),
            verified,
            "{checks:?}: {:?}",
            kinds(&plan)
        );
    }
}

/// flyctl's `isConstantlyRestarting`: only an exit Fly restarted, with a
/// non-zero code and not requested, is a crash. Our own restart's exit
/// (requested), a clean exit and an exit without details are not.
#[test]
fn item13c_only_unrequested_crashes_fly_restarted_count_toward_a_crash_loop() {
    use crate::fly::ExitDetail;
    let r = marker("m1", Phase::Restarting, RotationMode::Wait, t0());
    let ours = ExitDetail {
        exit_code: 143,
        restarting: true,
        requested_stop: true,
    };
    let crash = ExitDetail {
        exit_code: 1,
        restarting: true,
        requested_stop: false,
    };
    let clean = ExitDetail {
        exit_code: 0,
        restarting: true,
        requested_stop: false,
    };
    let not_restarted = ExitDetail {
        exit_code: 1,
        restarting: false,
        requested_stop: false,
    };
    for other in [Some(ours), Some(clean), Some(not_restarted), None] {
        let m = M::on_tip("m1")
            .exit_detail(t0() + Cd::seconds(1), other)
            .exit_detail(t0() + Cd::seconds(20), Some(crash))
            .marker(&r);
        let mut fx = Fx::new("").with(m);
        assert_eq!(
            kinds(&fx.plan_at(t0(), t0() + Cd::seconds(60))),
            [("m1", "finish")],
            "one crash and {other:?} is no crash loop"
        );
    }
    // Two crashes are one.
    let m = M::on_tip("m1")
        .exit_detail(t0() + Cd::seconds(1), Some(crash))
        .exit_detail(t0() + Cd::seconds(20), Some(crash))
        .marker(&r);
    let mut fx = Fx::new("").with(m);
    let (next, _) = advance_of(&fx.plan_at(t0(), t0() + Cd::seconds(60)), "m1").expect("backoff");
    assert_eq!(next.phase, Phase::Backoff);
}

/// A restart may wait the machine's stop timeout before the machine even
/// stops: the verify deadline starts after it.
#[test]
fn item13e_the_verify_deadline_adds_the_machines_stop_timeout() {
    let r = marker("m1", Phase::Restarting, RotationMode::Wait, t0());
    // verify_deadline is 5 min; the stop timeout 300 s more.
    let slow = || {
        M::drifted("m1", Severity::Low)
            .stop_timeout_secs(300)
            .marker(&r)
    };
    let mut fx = Fx::new("").with(slow());
    match decision_of(&mut fx, "m1", t0(), t0() + Cd::minutes(6)) {
        Decision::InRotation { deadline, .. } => {
            assert_eq!(deadline, Some(t0() + Cd::minutes(10)));
        }
        other => panic!("{other:?}"),
    }
    // Past verify_deadline but within the stop timeout plus it: no verdict yet.
    let mut fx = Fx::new("").with(slow());
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(6));
    assert!(advance_of(&plan, "m1").is_none(), "{:?}", kinds(&plan));
    // Past both: the attempt failed.
    let mut fx = Fx::new("").with(slow());
    let (next, _) = advance_of(&fx.plan_at(t0(), t0() + Cd::minutes(11)), "m1").expect("backoff");
    assert_eq!(next.phase, Phase::Backoff);
    // Exits count within the longer window too.
    let crashing = M::on_tip("m1")
        .stop_timeout_secs(300)
        .exit_at(t0() + Cd::minutes(6))
        .exit_at(t0() + Cd::minutes(7))
        .marker(&r);
    let mut fx = Fx::new("").with(crashing);
    let (next, _) = advance_of(&fx.plan_at(t0(), t0() + Cd::minutes(8)), "m1").expect("backoff");
    assert_eq!(next.phase, Phase::Backoff);
    // Without a stop timeout, nothing is added.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&r));
    let (next, _) = advance_of(&fx.plan_at(t0(), t0() + Cd::minutes(6)), "m1").expect("backoff");
    assert_eq!(next.phase, Phase::Backoff);
}

// ---- issue 32: waits the protocol model found unalerted -----------------------

/// Found by the protocol model (`ceilings`): a rotation mid-drain whose
/// host becomes unreachable. Its metadata is unknown, so nothing is done
/// to it, but the marker its last listing knew (carried by
/// `LastListings`, as `decide::prepare` does) is past its drain ceiling on
/// our clock: it is alerted as stuck, naming the outage, with no step.
#[test]
fn item32_a_rotation_past_its_ceiling_on_an_unreachable_host_is_alerted() {
    use crate::decide::listings::LastListings;
    let d = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let mut known = M::drifted("m1", Severity::Medium).busy().marker(&d);
    known.0.inputs.cordoned = Some(true);
    let dark = || {
        M::drifted("m1", Severity::Medium)
            .unreachable()
            .metadata_unknown("host_status unreachable")
    };
    let (config, policy) = (config(""), policy());
    let mut listings = LastListings::default();
    let mut tracker = Tracker::default();
    let mut sweep = |m: M, now: DateTime<Utc>| {
        let mut report = snapshot(&config, vec![m]);
        listings.carry(&mut report, now);
        tracker.observe(&report, now);
        plan(&PlanInput {
            policy: &policy,
            snapshot: &report,
            tracker: &tracker,
            owner: "r1",
            fetch: fetched(),
            now,
        })
    };
    sweep(known, t0());
    // Within the drain ceiling (1 h): only the outage is decided.
    let plan = sweep(dark(), t0() + Cd::minutes(30));
    assert!(plan.steps().is_empty(), "{plan:?}");
    assert!(
        alerts(&plan, AlertKind::RotationStuck).is_empty(),
        "{plan:?}"
    );
    // Past it: alerted, still no step.
    let plan = sweep(dark(), t0() + Cd::hours(2));
    assert!(plan.steps().is_empty(), "{plan:?}");
    assert!(matches!(
        plan.decisions()[&mid("m1")],
        Decision::MetadataUnknown { .. }
    ));
    let stuck: Vec<&str> = plan
        .alerts
        .iter()
        .filter(|a| a.kind == AlertKind::RotationStuck)
        .map(|a| a.summary.as_str())
        .collect();
    assert_eq!(stuck.len(), 1, "{plan:?}");
    assert!(stuck[0].contains("host_status unreachable"), "{}", stuck[0]);
}

/// A machine Fly shows cordoned whose metadata is unknown and whose marker
/// no listing knew: a cordon nothing may undo while the host is out.
#[test]
fn item32_a_cordon_on_an_unreachable_host_with_no_known_marker_is_alerted() {
    let mut dark = M::drifted("m1", Severity::Medium)
        .unreachable()
        .metadata_unknown("host_status unreachable");
    dark.0.inputs.cordoned = Some(true);
    let mut fx = Fx::new("").with(dark);
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(1));
    assert!(plan.steps().is_empty(), "{plan:?}");
    assert_eq!(
        alerts(&plan, AlertKind::RotationStuck),
        vec!["m1"],
        "{plan:?}"
    );
}

/// Found by the protocol model (`undo_refused` start). Before: a claim that
/// won its slot and lost its answer (or whose daemon died right after) was
/// withdrawn on the next sweep as "pool at cap": `slots_in_use` counts the
/// claim's own slot, and `claim` counted it against the claim. It is
/// completed under its tag instead; another machine still waits.
#[test]
fn a_claim_that_already_won_its_slot_is_completed_not_withdrawn() {
    let now = t0() + Cd::hours(1);
    let c = marker("m1", Phase::Claiming, RotationMode::Wait, t0());
    let mut set = crate::metadata::slots::SlotSet::parse(None).unwrap();
    set.try_add(
        &"app".into(),
        &"default".into(),
        crate::metadata::slots::Slot {
            machine_id: "m1".into(),
            tag: c.tag.clone(),
            owner: "r1".into(),
            since: t0(),
        },
        1,
    );
    let mut fx = Fx::new("")
        .with(M::drifted("m1", Severity::Low).marker(&c))
        .with(M::drifted("m2", Severity::Low));
    let plan = fx.plan_with(t0(), now, fetched(), SlotsView::Known(set));
    assert_eq!(kinds(&plan), [("m1", "claim")], "{plan:?}");
    let StepKind::Claim { marker: again, .. } = &step_of(&plan, "m1").kind else {
        panic!("{plan:?}")
    };
    assert_eq!(again.tag, c.tag, "completed under its own tag");
    assert!(
        matches!(
            plan.decision(&MachineId::from("m2")),
            Some(Decision::WaitingForSlot {
                in_use: 1,
                cap: 1,
                ..
            })
        ),
        "{plan:?}"
    );
}

// ---- issue 33: records an agent cannot forge -------------------------------

/// `value` put under `key` as an agent would: raw, unsealed.
fn raw(mut m: M, key: &str, value: &str) -> M {
    m.0.inputs.metadata.insert(key.into(), value.into());
    m
}

fn tampered_keys(plan: &Plan, id: &str) -> Vec<String> {
    plan.alerts
        .iter()
        .filter(|a| {
            a.kind == AlertKind::MetadataTampered && a.machine_id.as_ref() == Some(&mid(id))
        })
        .map(|a| a.details.get("keys").cloned().unwrap_or_default())
        .collect()
}

/// An agent writes `approve now` on its own machine: unsealed, so it
/// approves nothing, and `metadata_tampered` names the machine and key.
/// The same approval written by an operator (sealed) approves.
#[test]
fn an_unsealed_approval_approves_nothing_and_is_alerted() {
    let later = t0() + Cd::minutes(30);
    let approval = serde_json::to_string(&Approval {
        target: commit(TIP),
        mode: ApprovalMode::Now,
        by: "agent".into(),
        at: t0(),
    })
    .unwrap();
    let forged = raw(
        M::drifted("m1", Severity::High).busy(),
        APPROVE_KEY,
        &approval,
    );
    let mut fx = Fx::new("").with(forged);
    let plan = fx.plan_at(t0(), later);
    assert!(plan.steps().is_empty(), "{:?}", plan.steps());
    assert_eq!(alerts(&plan, AlertKind::ManualApprovalRequired), ["m1"]);
    assert_eq!(tampered_keys(&plan, "m1"), [APPROVE_KEY]);
    let alert = plan
        .alerts
        .iter()
        .find(|a| a.kind == AlertKind::MetadataTampered)
        .unwrap();
    assert!(
        alert.summary.contains("m1") && alert.summary.contains("unsigned"),
        "{}",
        alert.summary
    );
    assert_eq!(alert.severity, Severity::High);
    // `plan` says so.
    let table = crate::report::render::plan_to_table(&fx.report(), &plan);
    assert!(
        table.contains("metadata_tampered:") && table.contains(APPROVE_KEY),
        "{table}"
    );
    // Another machine's sealed approval, copied onto this one: moved, refused.
    let neighbours = sealed("m2", APPROVE_KEY, &approval);
    let mut fx = Fx::new("").with(raw(
        M::drifted("m1", Severity::High).busy(),
        APPROVE_KEY,
        &neighbours,
    ));
    let plan = fx.plan_at(t0(), later);
    assert!(plan.steps().is_empty(), "{:?}", plan.steps());
    assert_eq!(tampered_keys(&plan, "m1"), [APPROVE_KEY]);
    // Sealed for this machine (the operator's write): it approves, no alert.
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::High)
            .busy()
            .put(APPROVE_KEY, &approval),
    );
    let plan = fx.plan_at(t0(), later);
    assert_eq!(kinds(&plan), [("m1", "claim")]);
    assert!(tampered_keys(&plan, "m1").is_empty());
}

/// A forged `restarting` marker (unsealed), or a sealed one whose phase an
/// agent rewrote: foreign, left alone (no step), its slot counted only if the
/// coordinator names it, and alerted as tampered.
#[test]
fn a_forged_or_altered_marker_is_foreign_and_alerted() {
    let now = t0() + Cd::hours(1);
    let restarting = marker("x", Phase::Restarting, RotationMode::Wait, t0());
    let draining = marker("x", Phase::Draining, RotationMode::Wait, t0());
    let altered = sealed("x", MARKER_KEY, &draining.to_value()).replace("draining", "restarting");
    for value in [restarting.to_value(), altered] {
        let mut fx = Fx::new("")
            .with(raw(M::drifted("x", Severity::Low), MARKER_KEY, &value))
            .with(M::drifted("a", Severity::Low));
        // The coordinator names no slot for it: it takes none, `a` may claim.
        let plan = fx.plan_with(t0(), now, fetched(), slots_with(&[]));
        assert_eq!(kinds(&plan), [("a", "claim")], "{plan:?}");
        assert!(matches!(
            plan.decisions()[&mid("x")],
            Decision::UnreadableMarker { .. }
        ));
        assert_eq!(tampered_keys(&plan, "x"), [MARKER_KEY]);
        // The coordinator names its tag: its slot is counted, `a` waits.
        let mut fx = Fx::new("")
            .with(raw(M::drifted("x", Severity::Low), MARKER_KEY, &value))
            .with(M::drifted("a", Severity::Low));
        let plan = fx.plan_with(
            t0(),
            now,
            fetched(),
            slots_with(&[("default", "x", &restarting.tag)]),
        );
        assert!(plan.steps().is_empty(), "{plan:?}");
    }
}

/// Clearing or forging the unprobed record: an unsealed one counts as none
/// (it can only ever delay the ceiling), and is alerted.
#[test]
fn an_unsealed_unprobed_record_counts_as_none_and_is_alerted() {
    let record = Unprobed {
        since: t0() - Cd::days(30),
        action: PolicyAction::AlertAndWait,
        severity: Severity::Low,
    };
    let mut fx = Fx::new("").with(raw(
        M::drifted("m1", Severity::Low).unreachable(),
        UNPROBED_KEY,
        &record.to_value(),
    ));
    let plan = fx.plan_at(t0(), t0() + Cd::seconds(30));
    assert_eq!(tampered_keys(&plan, "m1"), [UNPROBED_KEY]);
    assert!(
        rotation_steps(&plan).is_empty(),
        "a forged old record starts no ceiling: {:?}",
        plan.steps()
    );
}

/// A hold holds whatever its value: sealed, unsealed, or garbage.
#[test]
fn any_hold_value_holds() {
    for value in ["ops: incident".to_string(), sealed("m1", HOLD_KEY, "{}")] {
        let mut fx = Fx::new("").with(raw(M::drifted("m1", Severity::Medium), HOLD_KEY, &value));
        let plan = fx.plan_at(t0(), t0() + Cd::hours(1));
        assert!(plan.steps().is_empty(), "{value}: {:?}", plan.steps());
        assert!(matches!(
            plan.decisions()[&mid("m1")],
            Decision::Held { .. }
        ));
    }
}

/// A slot set an agent rewrote on a coordinator in its app: unknown (no
/// claim), and alerted at once, naming the coordinator and the key.
#[test]
fn a_tampered_slot_set_takes_no_slot_and_is_alerted_at_once() {
    let mut fx = Fx::new("")
        .rotation(|r| r.coordinator = Some("app/c1".parse().expect("a coordinator")))
        .with(M::drifted("a", Severity::Low));
    let tampered = SlotsView::Tampered("coordinator app/c1: unsigned".into());
    let plan = fx.plan_with(t0(), t0() + Cd::hours(1), fetched(), tampered);
    assert!(rotation_steps(&plan).is_empty(), "{plan:?}");
    assert_eq!(tampered_keys(&plan, "c1"), [crate::metadata::SLOTS_KEY]);
}

/// An agent deletes the probe-failure record of a broken machine every few
/// sweeps, to keep it in service: this replica saw the record, so it still
/// counts from its first sight (the ceiling is not reset), the deletion is
/// alerted, and the record is written back. Our own clear (a sealed note
/// naming the record) forgets it, as does a usable report.
#[test]
fn a_deleted_unprobed_record_still_counts_and_is_alerted() {
    let broken = || {
        M::drifted("m1", Severity::Low)
            .unreachable()
            .check("critical")
    };
    let with_record = Fx::new("").with(broken().unprobed_since(t0())).report();
    let deleted = Fx::new("").with(broken()).report();
    let mut tracker = Tracker::default();
    let seen_drifted = Fx::new("").with(M::drifted("m1", Severity::Low)).report();
    tracker.observe(&seen_drifted, t0());
    tracker.observe(&with_record, t0());
    // Deleted an hour in: alerted, and written back with its first sight.
    let p = sweep_plan(&mut tracker, &deleted, t0() + Cd::hours(1));
    assert_eq!(tampered_keys(&p, "m1"), [UNPROBED_KEY]);
    let StepKind::RecordUnprobed { record } = &p.steps()[0].kind else {
        panic!("{p:?}")
    };
    assert_eq!(
        record.since,
        t0(),
        "the ceiling counts from the first sight"
    );
    // Deleted again just past the ceiling (4 h): restarted all the same.
    let p = sweep_plan(&mut tracker, &deleted, t0() + Cd::hours(4) + Cd::minutes(1));
    assert_eq!(kinds(&p)[0], ("m1", "claim"), "{p:?}");
    // Our own clear names the record: forgotten, nothing alerted.
    let mut tracker = Tracker::default();
    tracker.observe(&seen_drifted, t0());
    tracker.observe(&with_record, t0());
    let record = Unprobed {
        since: t0(),
        action: PolicyAction::AlertAndWait,
        severity: Severity::Low,
    };
    let note = crate::metadata::unprobed::Cleared {
        cleared: record.fingerprint(),
    };
    let cleared = Fx::new("")
        .with(broken().put(UNPROBED_KEY, &note.to_value()))
        .report();
    let p = sweep_plan(&mut tracker, &cleared, t0() + Cd::hours(1));
    assert!(tampered_keys(&p, "m1").is_empty(), "{:?}", p.alerts);
    assert!(tracker.lost_record(&mid("m1")).is_none());
    // A replayed older note (another record's) is no clear of this one.
    let mut tracker = Tracker::default();
    tracker.observe(&seen_drifted, t0());
    tracker.observe(&with_record, t0());
    let other = crate::metadata::unprobed::Cleared {
        cleared: "0123456789abcdef".into(),
    };
    let replayed = Fx::new("")
        .with(broken().put(UNPROBED_KEY, &other.to_value()))
        .report();
    let p = sweep_plan(&mut tracker, &replayed, t0() + Cd::hours(1));
    assert_eq!(tampered_keys(&p, "m1"), [UNPROBED_KEY]);
}

/// The worst replays an agent can make of its own machine's older sealed
/// markers: `restarting` or `draining` (even with mode `now`), whose tag no
/// longer holds a slot. Nothing is restarted or cordoned on their strength:
/// the coordinator's set (out of the agent's reach) says the rotation holds
/// no slot.
#[test]
fn a_replayed_sealed_marker_whose_slot_is_gone_restarts_nothing() {
    let now = t0() + Cd::hours(2);
    for phase in [Phase::Restarting, Phase::Draining, Phase::Backoff] {
        let mut old = marker("m1", phase, RotationMode::Now, t0());
        old.cordoned = Some(true);
        old.retry_at = Some(t0());
        let mut fx = Fx::new("").with(
            M::drifted("m1", Severity::High)
                .approved(TIP, ApprovalMode::Now)
                .marker(&old),
        );
        let plan = fx.plan_with(t0(), now, fetched(), slots_with(&[]));
        // Undone (uncordon, undrain) and ended: the next sweep judges afresh.
        assert_eq!(kinds(&plan), [("m1", "cancel")], "{phase:?}");
        for s in plan.steps() {
            assert!(
                !matches!(
                    s.kind,
                    StepKind::Restart { .. }
                        | StepKind::Advance { cordon: true, .. }
                        | StepKind::Drain
                ),
                "{phase:?}: {s:?}"
            );
        }
    }
}

/// An agent deletes the slot set of a coordinator in its app: the set reads
/// as empty, but a rotation that still holds capacity (its sealed marker in
/// `draining`, cordoned) counts against the cap: no second claim.
#[test]
fn an_emptied_slot_set_does_not_lift_the_cap_while_a_rotation_holds_capacity() {
    let mut m = marker("x", Phase::Draining, RotationMode::Wait, t0());
    m.cordoned = Some(true);
    let mut x = M::drifted("x", Severity::Low).busy().marker(&m);
    x.0.inputs.cordoned = Some(true);
    let mut fx = Fx::new("").with(x).with(M::drifted("a", Severity::Low));
    let plan = fx.plan_with(t0(), t0() + Cd::minutes(5), fetched(), slots_with(&[]));
    assert!(
        !kinds(&plan).contains(&("a", "claim")),
        "{:?}",
        kinds(&plan)
    );
}

#[path = "halt_tests.rs"]
mod halt;

#[path = "guard_tests.rs"]
mod guard;

#[path = "gate_tests.rs"]
mod gate;

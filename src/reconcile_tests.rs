//! Planner unit tests: fixtures in, steps and alerts out. No network, no clock.

use std::collections::BTreeMap;
use std::path::Path;

use chrono::{DateTime, Duration as Cd, Utc};

use super::*;
use crate::operator::{APPROVE_KEY, Approval, ApprovalMode, HOLD_KEY, MARKER_KEY};
use crate::probe::{Activity, AgentReport, Capability, RotationState};
use crate::rotation::{Marker, Phase, RotationMode};
use crate::sweep::{FleetReport, MachineReport};

const TIP: &str = "1111111111111111111111111111111111111111";
const OLD: &str = "2222222222222222222222222222222222222222";

fn t0() -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).unwrap()
}

fn config(extra: &str) -> Config {
    let text = format!(
        r#"
[overlay]
repo = "/r"
branch = "release"
mirror_dir = "/m"
[[apps]]
name = "app"
pool_key = "pool"
[pools.default]
max_concurrent_rotations = 1
actions = {{ low = "alert-and-wait", medium = "restart", high = "manual", critical = "reload" }}
[pools.wide]
max_concurrent_rotations = 2
actions = {{ low = "observe", medium = "alert-and-wait", high = "alert-and-wait", critical = "alert-and-wait" }}
{extra}
"#
    );
    Config::parse(Path::new("t.toml"), &text).unwrap()
}

/// A machine fixture, chainable.
#[derive(Clone)]
struct M(MachineReport);

impl M {
    fn on_tip(id: &str) -> M {
        M(MachineReport {
            app: "app".into(),
            machine_id: id.into(),
            name: id.into(),
            region: "iad".into(),
            pool: "default".into(),
            state: "started".into(),
            status: MachineStatus::OnTip,
            reported_ref: Some(TIP.into()),
            commit: Some(TIP.into()),
            commits_behind: Some(0),
            commits_ahead: Some(0),
            severity: None,
            action: None,
            detail: None,
            report: Some(AgentReport {
                overlay_ref: TIP.into(),
                activity: Some(Activity::Idle),
                live_sessions: Some(0),
                last_input_at: None,
                heartbeat_at: None,
                capabilities: vec![],
                rotation: None,
            }),
            metadata: BTreeMap::new(),
            version: "v1".into(),
            health_url: Some(format!("http://agents/{id}/health")),
        })
    }

    /// Drifted at `severity`, with the action the `default` pool maps it to.
    fn drifted(id: &str, severity: Severity) -> M {
        let mut m = M::on_tip(id);
        m.0.status = MachineStatus::Drifted;
        m.0.reported_ref = Some(OLD.into());
        m.0.commit = Some(OLD.into());
        m.0.commits_behind = Some(3);
        m.0.severity = Some(severity);
        m.0.action = Some(config("").pool("default").actions.for_severity(severity));
        if let Some(r) = m.0.report.as_mut() {
            r.overlay_ref = OLD.into();
        }
        m
    }

    fn pool(mut self, pool: &str, action: PolicyAction) -> M {
        self.0.pool = pool.into();
        self.0.metadata.insert("pool".into(), pool.into());
        self.0.action = Some(action);
        self
    }

    fn busy(mut self) -> M {
        if let Some(r) = self.0.report.as_mut() {
            r.activity = Some(Activity::Busy);
            r.live_sessions = Some(1);
        }
        self
    }

    fn input_at(mut self, at: DateTime<Utc>) -> M {
        if let Some(r) = self.0.report.as_mut() {
            r.last_input_at = Some(at);
        }
        self
    }

    fn cooperative(mut self, checkpoint: Option<&str>, heartbeat: DateTime<Utc>) -> M {
        if let Some(r) = self.0.report.as_mut() {
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
        if let Some(r) = self.0.report.as_mut() {
            r.capabilities.push(Capability::Reload);
        }
        self
    }

    fn unreachable(mut self) -> M {
        self.0.status = MachineStatus::Unreachable;
        self.0.report = None;
        self.0.reported_ref = None;
        self.0.severity = None;
        self.0.action = None;
        self
    }

    fn held(mut self) -> M {
        self.0
            .metadata
            .insert(HOLD_KEY.into(), "ops: incident".into());
        self
    }

    fn approved(mut self, target: &str, mode: ApprovalMode) -> M {
        let a = Approval {
            target: target.into(),
            mode,
            by: "alice".into(),
            at: t0(),
        };
        self.0
            .metadata
            .insert(APPROVE_KEY.into(), serde_json::to_string(&a).unwrap());
        self
    }

    fn marker(mut self, marker: &Marker) -> M {
        self.0.metadata.insert(MARKER_KEY.into(), marker.to_value());
        self
    }
}

fn marker(id: &str, phase: Phase, mode: RotationMode, since: DateTime<Utc>) -> Marker {
    Marker {
        tag: Marker::new_tag(id, TIP, since),
        target: TIP.into(),
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
    }
}

struct Fx {
    config: Config,
    machines: Vec<MachineReport>,
    tracker: Tracker,
}

impl Fx {
    fn new(extra: &str) -> Fx {
        Fx {
            config: config(extra),
            machines: Vec::new(),
            tracker: Tracker::default(),
        }
    }

    fn with(mut self, m: M) -> Fx {
        self.machines.push(m.0);
        self
    }

    fn report(&self) -> FleetReport {
        crate::sweep::build_report(
            &self.config,
            &crate::overlay::Tip {
                branch: "release".into(),
                commit: crate::model::CommitId::parse(TIP).unwrap(),
            },
            self.machines.clone(),
        )
    }

    /// Observes the fleet at `first_seen` (starting drift clocks), then plans at `now`.
    fn plan_at(&mut self, first_seen: DateTime<Utc>, now: DateTime<Utc>) -> Plan {
        let report = self.report();
        self.tracker.observe(&report, first_seen);
        self.tracker.observe(&report, now);
        plan(&PlanInput {
            config: &self.config,
            report: &report,
            tracker: &self.tracker,
            owner: "r1",
            now,
        })
    }
}

fn kinds(plan: &Plan) -> Vec<(&str, &str)> {
    plan.steps
        .iter()
        .map(|s| (s.target.machine_id.as_str(), s.kind()))
        .collect()
}

fn alerts(plan: &Plan, kind: AlertKind) -> Vec<&str> {
    plan.alerts
        .iter()
        .filter(|a| a.kind == kind)
        .filter_map(|a| a.machine_id.as_deref())
        .collect()
}

fn restart_of<'a>(plan: &'a Plan, id: &str) -> Option<(&'a Marker, bool)> {
    plan.steps.iter().find_map(|s| match &s.kind {
        StepKind::Restart {
            marker, interrupts, ..
        } if s.target.machine_id == id => Some((marker, *interrupts)),
        _ => None,
    })
}

// ---- drift grace period --------------------------------------------------

#[test]
fn young_drift_triggers_nothing_and_aged_drift_alerts_and_claims() {
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low));
    let young = fx.plan_at(t0(), t0() + Cd::seconds(119));
    assert!(
        young.steps.is_empty() && young.alerts.is_empty(),
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
    } = &aged.steps[0].kind
    else {
        panic!()
    };
    assert_eq!(
        (marker.phase, marker.mode, *drain, *reload),
        (Phase::Draining, RotationMode::Wait, false, false)
    );
    assert_eq!(marker.target, TIP);
    assert_eq!(aged.steps[0].expected, None);
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
    assert_eq!(tracker.drift_since("m1"), Some(t0() + Cd::seconds(200)));
}

#[test]
fn a_missed_probe_neither_clears_nor_restarts_a_drift() {
    let cfg = config("");
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
            config: &cfg,
            report,
            tracker: &tracker,
            owner: "r",
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
            p.steps.is_empty(),
            "nothing is claimed on carried knowledge"
        );
    }
    tracker.observe(&drifted, t0() + Cd::minutes(20));
    assert_eq!(
        tracker.drift_since("m1"),
        Some(t0()),
        "the drift clock did not restart"
    );
    let healthy = Fx::new("").with(M::on_tip("m1")).report();
    tracker.observe(&healthy, t0() + Cd::minutes(21));
    let p = plan(&PlanInput {
        config: &cfg,
        report: &healthy,
        tracker: &tracker,
        owner: "r",
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
            plan.steps.is_empty(),
            "held machine got steps: {:?}",
            plan.steps
        );
        assert_eq!(plan.phases.get("m1").map(String::as_str), Some("held"));
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
    assert!(plan.steps.is_empty());
    assert_eq!(alerts(&plan, AlertKind::ManualApprovalRequired), ["m1"]);

    // An approval of another commit authorizes nothing.
    let mut fx =
        Fx::new("").with(M::drifted("m1", Severity::High).approved(OLD, ApprovalMode::Now));
    let plan = fx.plan_at(t0(), later);
    assert!(plan.steps.is_empty());
    assert_eq!(alerts(&plan, AlertKind::ManualApprovalRequired), ["m1"]);

    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::High)
            .approved(TIP, ApprovalMode::Now)
            .input_at(later),
    );
    let plan = fx.plan_at(t0(), later);
    let StepKind::Claim { marker, .. } = &plan.steps[0].kind else {
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
    let StepKind::Claim { marker, .. } = &fx.plan_at(t0(), later).steps[0].kind else {
        panic!()
    };
    assert_eq!(marker.mode, RotationMode::Wait);
}

#[test]
fn approve_now_restarts_live_work_and_when_idle_does_not() {
    let now = t0() + Cd::seconds(30);
    let m = marker("m1", Phase::Draining, RotationMode::Now, t0());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::High).busy().marker(&m));
    let plan = fx.plan_at(t0(), now);
    let (next, interrupts) = restart_of(&plan, "m1").expect("approved now: restart");
    assert!(interrupts);
    assert_eq!(next.phase, Phase::Restarting);

    let m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::High).busy().marker(&m));
    assert!(fx.plan_at(t0(), t0() + Cd::minutes(59)).steps.is_empty());
}

#[test]
fn finishing_a_manual_rotation_consumes_the_approval() {
    let m = marker("m1", Phase::Restarting, RotationMode::Now, t0());
    let mut fx = Fx::new("").with(M::on_tip("m1").approved(TIP, ApprovalMode::Now).marker(&m));
    let plan = fx.plan_at(t0(), t0() + Cd::seconds(40));
    assert_eq!(
        plan.steps[0].kind,
        StepKind::Finish {
            clear_approval: true,
            undrain: false
        }
    );
    assert_eq!(plan.steps[0].expected.as_ref(), Some(&m));
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
                plan.steps
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
    let busy = M::drifted("m1", Severity::Medium).busy().marker(&m);
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
    assert!(plan.steps.is_empty());
    assert_eq!(
        plan.phases.get("m1").map(String::as_str),
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
    let StepKind::Yield {
        marker: next, why, ..
    } = &plan.steps[0].kind
    else {
        panic!("{plan:?}")
    };
    assert_eq!(*why, "drain ceiling reached");
    assert_eq!(next.phase, Phase::Yielded);
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
    assert_eq!(plan.steps[0].expected.as_ref(), Some(&y));
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
    assert!(plan.steps.is_empty(), "{:?}", plan.steps);
    assert_eq!(
        plan.phases.get("y").map(String::as_str),
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
            plan.steps
        );
    }
}

#[test]
fn checkpoint_deadline_releases_the_fence_and_yields() {
    let mut m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    m.drain_requested = true;
    let now = t0() + Cd::minutes(20);
    let mut fx = Fx::new("").with(
        M::drifted("m1", Severity::Low)
            .cooperative(None, now)
            .marker(&m),
    );
    let plan = fx.plan_at(t0(), now);
    let StepKind::Yield {
        undrain,
        why,
        marker: next,
    } = &plan.steps[0].kind
    else {
        panic!("{plan:?}")
    };
    assert!(*undrain);
    assert_eq!(*why, "checkpoint deadline reached");
    assert_eq!(next.retry_at, Some(now + Cd::hours(1)));
}

#[test]
fn claims_of_cooperating_agents_request_a_drain_and_reload_agents_a_reload() {
    let now = t0() + Cd::hours(1);
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).cooperative(None, now));
    let StepKind::Claim { drain, marker, .. } = &fx.plan_at(t0(), now).steps[0].kind else {
        panic!()
    };
    assert!(*drain && marker.drain_requested);

    // critical → reload in the default pool; only for agents that advertise it.
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Critical).reloadable());
    let StepKind::Claim { reload, marker, .. } = &fx.plan_at(t0(), now).steps[0].kind else {
        panic!()
    };
    assert!(*reload);
    assert_eq!(
        (marker.phase, marker.mode),
        (Phase::Reloading, RotationMode::Reload)
    );
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Critical));
    let StepKind::Claim { reload, marker, .. } = &fx.plan_at(t0(), now).steps[0].kind else {
        panic!()
    };
    assert!(!*reload);
    assert_eq!(marker.mode, RotationMode::Wait);
}

#[test]
fn unproven_reload_falls_back_to_alert_and_wait() {
    let m = marker("m1", Phase::Reloading, RotationMode::Reload, t0());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Critical).reloadable().marker(&m));
    assert!(fx.plan_at(t0(), t0() + Cd::minutes(4)).steps.is_empty());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Critical).reloadable().marker(&m));
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(5));
    let StepKind::Advance {
        marker: next,
        cordon,
        ..
    } = &plan.steps[0].kind
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
    assert!(plan.steps.is_empty(), "{:?}", plan.steps);
    assert_eq!(
        plan.phases.get("a").map(String::as_str),
        Some("waiting for a slot")
    );
    assert_eq!(
        plan.rotations_in_progress
            .get(&("app".to_string(), "default".to_string())),
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
        .metadata
        .insert(MARKER_KEY.into(), "{\"v\":99}".into());
    let mut fx = Fx::new("").with(odd).with(M::drifted("a", Severity::Low));
    let plan = fx.plan_at(t0(), now);
    assert!(plan.steps.is_empty(), "{:?}", plan.steps);
    assert_eq!(alerts(&plan, AlertKind::RotationStuck), ["x"]);
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
    assert!(fx.plan_at(t0(), t0() + Cd::minutes(4)).steps.is_empty());
    let mut fx = Fx::new("").with(M::drifted("m1", Severity::Low).marker(&m));
    let plan = fx.plan_at(t0(), t0() + Cd::minutes(5));
    let StepKind::Advance {
        marker: next,
        cordon,
        ..
    } = &plan.steps[0].kind
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
    let c = config("");
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
    let StepKind::Advance { marker: again, .. } = &plan.steps[0].kind else {
        panic!("{plan:?}")
    };
    assert_eq!((again.phase, again.attempt), (Phase::Draining, 1));
}

#[test]
fn a_fresh_planner_resumes_with_the_original_deadlines() {
    // A new daemon: empty tracker, marker written 61 s ago by another owner.
    let mut m = marker("m1", Phase::Draining, RotationMode::Grace, t0());
    m.owner = "old-replica".into();
    let report = Fx::new("")
        .with(M::drifted("m1", Severity::Medium).busy().marker(&m))
        .report();
    let tracker = Tracker::default();
    let plan = plan(&PlanInput {
        config: &config(""),
        report: &report,
        tracker: &tracker,
        owner: "new-replica",
        now: t0() + Cd::seconds(61),
    });
    let (next, interrupts) =
        restart_of(&plan, "m1").expect("grace counted from the marker, not from our start");
    assert!(interrupts);
    assert_eq!(next.started_at, t0(), "the rotation keeps its start");
    // A rotation already restarting is not restarted again by a new daemon.
    let r = marker("m2", Phase::Restarting, RotationMode::Grace, t0());
    let report = Fx::new("")
        .with(M::drifted("m2", Severity::Medium).marker(&r))
        .report();
    let plan = plan_fn(&report, &tracker, t0() + Cd::seconds(61));
    assert!(plan.steps.is_empty(), "{:?}", plan.steps);
}

fn plan_fn(report: &FleetReport, tracker: &Tracker, now: DateTime<Utc>) -> Plan {
    plan(&PlanInput {
        config: &config(""),
        report,
        tracker,
        owner: "r",
        now,
    })
}

#[test]
fn unreachable_past_the_probe_failure_ceiling_is_restarted() {
    // Seen drifted, then unreachable for 4 h: claimed with an immediate restart.
    let cfg = config("");
    let mut tracker = Tracker::default();
    let drifted = Fx::new("").with(M::drifted("m1", Severity::Low)).report();
    let gone = Fx::new("")
        .with(M::drifted("m1", Severity::Low).unreachable())
        .report();
    tracker.observe(&drifted, t0());
    tracker.observe(&gone, t0() + Cd::minutes(1));
    tracker.observe(&gone, t0() + Cd::hours(3));
    let p = plan(&PlanInput {
        config: &cfg,
        report: &gone,
        tracker: &tracker,
        owner: "r",
        now: t0() + Cd::hours(3),
    });
    assert!(p.steps.is_empty());
    let now = t0() + Cd::minutes(1) + Cd::hours(4);
    tracker.observe(&gone, now);
    let p = plan(&PlanInput {
        config: &cfg,
        report: &gone,
        tracker: &tracker,
        owner: "r",
        now,
    });
    let StepKind::Claim {
        marker: claimed, ..
    } = &p.steps[0].kind
    else {
        panic!("{p:?}")
    };
    assert_eq!(claimed.mode, RotationMode::Now);

    // Never seen drifted: unreachable alone is not a reason to restart.
    let mut tracker = Tracker::default();
    tracker.observe(&gone, t0());
    tracker.observe(&gone, t0() + Cd::hours(5));
    let p = plan(&PlanInput {
        config: &cfg,
        report: &gone,
        tracker: &tracker,
        owner: "r",
        now: t0() + Cd::hours(5),
    });
    assert!(p.steps.is_empty());

    // Mid-rotation: draining and unreachable past the ceiling → restart.
    let m = marker("m1", Phase::Draining, RotationMode::Wait, t0());
    let gone = Fx::new("")
        .with(M::drifted("m1", Severity::Low).unreachable().marker(&m))
        .report();
    let mut tracker = Tracker::default();
    tracker.observe(&gone, t0());
    tracker.observe(&gone, t0() + Cd::minutes(59));
    let p = plan(&PlanInput {
        config: &cfg,
        report: &gone,
        tracker: &tracker,
        owner: "r",
        now: t0() + Cd::minutes(59),
    });
    assert!(p.steps.is_empty());
    // (the drain ceiling of 1 h comes first in the default config; widen it)
    let wide = config("[rotation]\ndrain_ceiling = \"10h\"\n");
    tracker.observe(&gone, t0() + Cd::hours(4));
    let p = plan(&PlanInput {
        config: &wide,
        report: &gone,
        tracker: &tracker,
        owner: "r",
        now: t0() + Cd::hours(4),
    });
    assert!(restart_of(&p, "m1").is_some(), "{p:?}");
}

#[test]
fn unreachable_machines_of_observe_and_manual_pools_are_never_restarted() {
    let cfg = config("");
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
            config: &cfg,
            report: &gone,
            tracker: &tracker,
            owner: "r",
            now,
        });
        assert!(p.steps.is_empty(), "{pool}/{action}: {:?}", p.steps);
    }
}

#[test]
fn observe_pools_report_but_never_act() {
    let now = t0() + Cd::hours(1);
    let mut fx =
        Fx::new("").with(M::drifted("w", Severity::Low).pool("wide", PolicyAction::Observe));
    let plan = fx.plan_at(t0(), now);
    assert!(plan.steps.is_empty());
    assert_eq!(alerts(&plan, AlertKind::Drift), ["w"]);
}

//! The planner's claim gating by the alert gate (`[gates.alertmanager]`,
//! #36 item 4).

use super::*;
use crate::decide::guardrail::Guard;
use crate::observe::gate::{FiringAlert, GateView};

fn firing(pairs: &[&[(&str, &str)]]) -> GateView {
    GateView::Read {
        firing: pairs
            .iter()
            .map(|labels| FiringAlert {
                labels: labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            })
            .collect(),
        more: 0,
    }
}

/// Plans `machines` (drift aged an hour) with the gate as `gate` says,
/// under a policy that fails open or not; `beta` is a second configured app.
fn gated(machines: Vec<M>, gate: GateView, fail_open: bool) -> Plan {
    let now = t0() + Cd::hours(1);
    let config = config("");
    let mut policy = policy();
    policy.gate_fail_open = fail_open;
    let mut report = snapshot(&config, machines);
    report.apps.push(crate::decide::snapshot::AppSummary {
        name: AppName::from("beta"),
        coherence: crate::decide::snapshot::Coherence::of(0, 0),
        stale: None,
    });
    report.gate = gate;
    let mut tracker = Tracker::default();
    tracker.observe(&report, t0());
    tracker.observe(&report, now);
    plan(&PlanInput {
        policy: &policy,
        snapshot: &report,
        tracker: &tracker,
        owner: "r1",
        fetch: fetched(),
        now,
    })
}

fn d1() -> M {
    M::drifted("d1", Severity::Medium)
}

fn agent_error(app: &str) -> Vec<(&str, &str)> {
    vec![
        ("alertname", "AgentErrorRate"),
        ("severity", "critical"),
        ("app", app),
    ]
}

#[test]
fn a_firing_alert_holds_new_claims_and_lifts_when_it_resolves() {
    // Open (read, nothing matching fires), or not configured: d1 claims.
    for open in [GateView::NotConfigured, firing(&[])] {
        let p = gated(vec![d1()], open, false);
        assert_eq!(kinds(&p), [("d1", "claim")], "{:?}", p.decisions());
        assert!(
            p.alerts
                .iter()
                .all(|a| a.kind != AlertKind::GateUnreachable)
        );
    }
    let p = gated(vec![d1()], firing(&[&agent_error("app")]), false);
    assert!(kinds(&p).is_empty(), "{:?}", kinds(&p));
    let decision = p.decision(&mid("d1")).unwrap();
    assert_eq!(
        decision,
        &Decision::Guarded {
            guard: Guard::AlertFiring {
                alert: r#"AgentErrorRate{app="app"}"#.into()
            }
        }
    );
    assert_eq!(decision.label(), "guardrail: alert_firing");
    assert!(
        decision
            .to_string()
            .starts_with(r#"blocked by alert AgentErrorRate{app="app"}"#),
        "{decision}"
    );
    assert_eq!(decision.kind(), "guarded");
}

#[test]
fn an_alert_naming_another_configured_app_does_not_hold_this_one() {
    let p = gated(vec![d1()], firing(&[&agent_error("beta")]), false);
    assert_eq!(kinds(&p), [("d1", "claim")]);
    // An app label naming no configured app (the reconciler's own, an
    // unrelated service), or none: the whole fleet is held.
    for labels in [
        agent_error("somewhere-else"),
        vec![("alertname", "AgentErrorRate")],
    ] {
        let p = gated(vec![d1()], firing(&[&labels]), false);
        assert!(kinds(&p).is_empty(), "{labels:?}: {:?}", kinds(&p));
    }
    // `fly_app` is read before `app` (a scrape sets `app` to its own app).
    let both = [("alertname", "A"), ("fly_app", "beta"), ("app", "app")];
    let p = gated(vec![d1()], firing(&[&both]), false);
    assert_eq!(kinds(&p), [("d1", "claim")]);
}

#[test]
fn rotations_under_way_finish_and_our_unfinished_claim_is_withdrawn() {
    let now = t0() + Cd::hours(1);
    let draining = marker(
        "x",
        Phase::Draining,
        RotationMode::Wait,
        now - Cd::minutes(1),
    );
    let claiming = marker("c", Phase::Claiming, RotationMode::Wait, t0());
    let p = gated(
        vec![
            M::drifted("x", Severity::Low).marker(&draining),
            M::drifted("c", Severity::Low).marker(&claiming),
        ],
        firing(&[&agent_error("app")]),
        false,
    );
    assert!(
        matches!(p.decision(&mid("x")), Some(Decision::InRotation { .. })),
        "{:?}",
        p.decision(&mid("x"))
    );
    let withdraw = p
        .steps()
        .into_iter()
        .find(|s| s.target.machine_id == mid("c"))
        .expect("a step for c");
    assert!(
        matches!(
            withdraw.kind,
            StepKind::Withdraw {
                why: WithdrawWhy::Guarded
            }
        ),
        "{withdraw:?}"
    );
    assert!(matches!(
        p.decision(&mid("c")),
        Some(Decision::Guarded { .. })
    ));
}

#[test]
fn an_unreadable_gate_holds_and_pages_unless_it_fails_open() {
    let down = || GateView::Unreachable("GET /api/v2/alerts: connection failed".into());
    let p = gated(vec![d1()], down(), false);
    assert!(kinds(&p).is_empty(), "{:?}", kinds(&p));
    assert_eq!(
        p.decision(&mid("d1")),
        Some(&Decision::Guarded {
            guard: Guard::GateUnreachable {
                error: "GET /api/v2/alerts: connection failed".into()
            }
        })
    );
    let pages: Vec<&Alert> = p
        .alerts
        .iter()
        .filter(|a| a.kind == AlertKind::GateUnreachable)
        .collect();
    let [page] = pages[..] else {
        panic!("one gate_unreachable: {:?}", p.alerts);
    };
    assert_eq!(page.severity, Severity::High);
    assert!(
        page.summary.contains("connection failed"),
        "{}",
        page.summary
    );

    let p = gated(vec![d1()], down(), true);
    assert_eq!(kinds(&p), [("d1", "claim")]);
    let low: Vec<Severity> = p
        .alerts
        .iter()
        .filter(|a| a.kind == AlertKind::GateUnreachable)
        .map(|a| a.severity)
        .collect();
    assert_eq!(low, [Severity::Low], "fail open: shown, not paged");
}

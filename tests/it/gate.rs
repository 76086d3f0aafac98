//! The alert gate (`[gates.alertmanager]`, #36 item 4) in the real loop
//! (sweep → plan → execute) against the simulated fleet: a small axum
//! server on loopback poses as Alertmanager's `GET /api/v2/alerts`, and a
//! real Alertmanager (`ALERTMANAGER_BIN`, run by `.ci/run`; ignored
//! without it) answers the last test. The claim gating itself is tested in
//! `src/decide/guardrail_tests.rs`, the matchers in `src/observe/gate.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::RawQuery;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use fleet_reconciler::config::Config;
use fleet_reconciler::decide::alerts::AlertKind;
use fleet_reconciler::observe::gate::AlertGate;
use fleet_reconciler::sim::{Sim, SimMachine};
use secrecy::SecretString;
use serde_json::{Value, json};

use crate::common::eventually;
use crate::rotation::{Daemon, World, all, config, converged, fleet, more_sweeps, restarts, world};

/// What the fake Alertmanager answers.
#[derive(Clone)]
pub(crate) enum Answer {
    Alerts(Vec<Value>),
    Down,
}

/// A stand-in for Alertmanager's `GET /api/v2/alerts`: answers what the
/// test sets, and keeps each query string it was asked.
pub(crate) struct FakeAlertmanager {
    pub(crate) url: String,
    answer: Arc<Mutex<Answer>>,
    queries: Arc<Mutex<Vec<String>>>,
}

impl FakeAlertmanager {
    pub(crate) async fn start(answer: Answer) -> FakeAlertmanager {
        let answer = Arc::new(Mutex::new(answer));
        let queries: Arc<Mutex<Vec<String>>> = Arc::default();
        let (a, q) = (answer.clone(), queries.clone());
        let app = Router::new().route(
            "/am/api/v2/alerts",
            get(move |RawQuery(query): RawQuery| {
                let (a, q) = (a.clone(), q.clone());
                async move {
                    q.lock().unwrap().push(query.unwrap_or_default());
                    let answer = a.lock().unwrap().clone();
                    let r: Response = match answer {
                        Answer::Alerts(alerts) => axum::Json(alerts).into_response(),
                        Answer::Down => StatusCode::SERVICE_UNAVAILABLE.into_response(),
                    };
                    r
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/am/", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        FakeAlertmanager {
            url,
            answer,
            queries,
        }
    }

    pub(crate) fn set(&self, answer: Answer) {
        *self.answer.lock().unwrap() = answer;
    }
}

/// An alert as Alertmanager lists it (`gettableAlert`, what the gate reads).
pub(crate) fn alert(labels: Value) -> Value {
    json!({
        "labels": labels,
        "annotations": {},
        "startsAt": "2026-01-01T00:00:00Z",
        "endsAt": "2026-01-01T01:00:00Z",
        "updatedAt": "2026-01-01T00:00:00Z",
        "fingerprint": "0",
        "receivers": [{"name": "x"}],
        "status": {"state": "active", "silencedBy": [], "inhibitedBy": []},
    })
}

pub(crate) fn agent_error_rate() -> Value {
    alert(json!({"alertname": "AgentErrorRate", "severity": "critical", "app": "app"}))
}

/// The rotation tests' config with `[gates.alertmanager]` after it.
fn gated_config(sim: &Sim, w: &World, fail_open: bool) -> Arc<Config> {
    let gate = format!(
        r#"max_attempts = 1
verify_deadline = "5s"
restart_grace = "0s"
[gates.alertmanager]
url_env = "AM_GATE_URL"
matchers = ['severity="critical"', 'alertname=~"Agent.*"']
fail_open = {fail_open}
timeout = "2s"
"#
    );
    config(sim, w, "m", &all("restart"), 1, &gate)
}

fn gate_of(config: &Config, url: &str) -> AlertGate {
    let gate = config.gates.alertmanager.as_ref().expect("a gate");
    AlertGate::new(gate, &SecretString::from(url.to_owned())).unwrap()
}

async fn drifted(w: &World) -> Sim {
    Sim::start(fleet(w, vec![SimMachine::new("m0").loaded(w.old.clone())]))
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_matching_alert_holds_claims_until_it_resolves() {
    let w = world();
    let sim = drifted(&w).await;
    // Firing: one that matches, and ones that do not (another severity,
    // the daemon's own).
    let am = FakeAlertmanager::start(Answer::Alerts(vec![
        agent_error_rate(),
        alert(json!({"alertname": "AgentSlow", "severity": "warning"})),
        alert(
            json!({"alertname": "AgentX", "severity": "critical", "service": "fleet-reconciler"}),
        ),
    ]))
    .await;
    let cfg = gated_config(&sim, &w, false);
    let d = Daemon::start_gated(&sim, cfg.clone(), "r1", gate_of(&cfg, &am.url)).await;
    more_sweeps(&d, 8).await;
    assert!(
        restarts(&sim, "m0").is_empty(),
        "a claim went through a firing alert"
    );
    assert_eq!(d.label("m0").as_deref(), Some("guardrail: alert_firing"));
    assert!(
        am.queries
            .lock()
            .unwrap()
            .iter()
            .all(|q| q == "active=true&silenced=false&inhibited=false"),
        "{:?}",
        am.queries.lock().unwrap()
    );
    // Only ones that do not match fire now: the gate opens.
    am.set(Answer::Alerts(vec![alert(
        json!({"alertname": "AgentSlow", "severity": "warning"}),
    )]));
    converged(&sim, "m0", &w.tip, Duration::from_secs(30)).await;
    assert!(!d.alerted(AlertKind::GateUnreachable, ""));
    d.stop().await;
    sim.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_unreachable_alertmanager_holds_claims_and_pages() {
    let w = world();
    let sim = drifted(&w).await;
    let am = FakeAlertmanager::start(Answer::Down).await;
    let cfg = gated_config(&sim, &w, false);
    let d = Daemon::start_gated(&sim, cfg.clone(), "r1", gate_of(&cfg, &am.url)).await;
    eventually("gate_unreachable", Duration::from_secs(20), async || {
        d.alerted(AlertKind::GateUnreachable, "")
    })
    .await;
    more_sweeps(&d, 8).await;
    assert!(
        restarts(&sim, "m0").is_empty(),
        "fail closed let a claim through"
    );
    assert_eq!(
        d.label("m0").as_deref(),
        Some("guardrail: gate_unreachable")
    );
    // Back, with nothing firing: the claim goes through.
    am.set(Answer::Alerts(Vec::new()));
    converged(&sim, "m0", &w.tip, Duration::from_secs(30)).await;
    d.stop().await;
    sim.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn fail_open_lets_claims_through_an_unreachable_alertmanager() {
    let w = world();
    let sim = drifted(&w).await;
    // Nothing listens there: connection refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cfg = gated_config(&sim, &w, true);
    let gate = gate_of(&cfg, &format!("http://127.0.0.1:{port}"));
    let d = Daemon::start_gated(&sim, cfg, "r1", gate).await;
    converged(&sim, "m0", &w.tip, Duration::from_secs(30)).await;
    assert!(
        d.alerted(AlertKind::GateUnreachable, ""),
        "fail open is still shown"
    );
    d.stop().await;
    sim.shutdown().await;
}

/// Against the real Alertmanager (`.ci/run` sets `ALERTMANAGER_BIN`): a
/// matching alert posted to it holds claims; once it resolves (its
/// `endsAt` passes), the gate lifts and the machine rotates. Real time:
/// Alertmanager keeps its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real Alertmanager: run by .ci/run with ALERTMANAGER_BIN"]
async fn the_gate_follows_a_real_alertmanager() {
    let bin = std::env::var("ALERTMANAGER_BIN")
        .ok()
        .filter(|b| !b.is_empty())
        .expect("ALERTMANAGER_BIN: the Alertmanager binary to run (prometheus-alertmanager)");
    let am = crate::one_voice::RealAlertmanager::start(&bin).await;
    let http = reqwest::Client::new();
    let post = |labels: Value, ends_in: chrono::Duration| {
        let now = chrono::Utc::now();
        let body = json!([{
            "labels": labels,
            "startsAt": now.to_rfc3339(),
            "endsAt": (now + ends_in).to_rfc3339(),
        }]);
        let (http, url) = (http.clone(), format!("{}/api/v2/alerts", am.url));
        async move {
            let r = http.post(url).json(&body).send().await.unwrap();
            assert!(r.status().is_success(), "{}", r.status());
        }
    };
    // Firing for a while: long enough to see claims held.
    let labels = json!({"alertname": "AgentErrorRate", "severity": "critical", "app": "app"});
    post(labels.clone(), chrono::Duration::minutes(10)).await;
    // Another that matches no matcher, and one of the daemon's own.
    post(
        json!({"alertname": "AgentSlow", "severity": "warning"}),
        chrono::Duration::minutes(10),
    )
    .await;

    let w = world();
    let sim = drifted(&w).await;
    let cfg = gated_config(&sim, &w, false);
    let d = Daemon::start_gated(&sim, cfg.clone(), "r1", gate_of(&cfg, &am.url)).await;
    eventually(
        "blocked by the alert",
        Duration::from_secs(20),
        async || d.label("m0").as_deref() == Some("guardrail: alert_firing"),
    )
    .await;
    more_sweeps(&d, 5).await;
    assert!(
        restarts(&sim, "m0").is_empty(),
        "a claim went through a firing alert"
    );

    // Resolved (endsAt now): the gate lifts.
    post(labels, chrono::Duration::zero()).await;
    converged(&sim, "m0", &w.tip, Duration::from_secs(30)).await;
    assert!(!d.alerted(AlertKind::GateUnreachable, ""));
    d.stop().await;
    sim.shutdown().await;
}

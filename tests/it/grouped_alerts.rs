//! One release through a fleet of 32 drifted machines in two apps and two
//! severities, with the daemon (`run`, in-process, on tokio's paused clock
//! shared with the sim) paging a PagerDuty-format receiver on loopback
//! (#20 item 1): grouped by default, the receiver sees one incident per
//! (app, tip, severity), 4 here, plus the fleet alerts, each updated as its
//! machines converge and resolved when the last one has; with
//! `group_by = ["machine"]`, one incident per machine, as before grouping.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use fleet_reconciler::clock::TokioClock;
use fleet_reconciler::config::Config;
use fleet_reconciler::report::notify::SinkSecrets;
use fleet_reconciler::service::{self, ServiceSecrets};
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::common::daemon::{Service, service_secrets};
use crate::common::{OverlayRepo, eventually};

const TOKEN: &str = "grouped-test-token";
/// Machines per app and severity: 2 apps × 2 severities × 8 = 32.
const PER_GROUP: usize = 8;

/// A PagerDuty Events v2 receiver on loopback: records every body.
struct PagerDuty {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl PagerDuty {
    async fn start() -> PagerDuty {
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let sink = bodies.clone();
        let app = Router::new().route(
            "/v2/enqueue",
            post(move |body: String| {
                let sink = sink.clone();
                async move {
                    sink.lock()
                        .unwrap()
                        .push(serde_json::from_str(&body).unwrap());
                    (
                        axum::http::StatusCode::ACCEPTED,
                        r#"{"status":"success","message":"Event processed"}"#,
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v2/enqueue", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        PagerDuty { url, bodies }
    }

    fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

/// `service::run` in a task on the sim's clock, paging `pd`.
struct Daemon {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), service::ServiceError>>,
}

impl Daemon {
    fn start(config: &str, sim: &Sim, pd: &PagerDuty) -> Daemon {
        let config = Arc::new(Config::parse(Path::new("grouped.toml"), config).unwrap());
        let secrets = ServiceSecrets {
            webhooks: vec![SinkSecrets {
                url: pd.url.clone().into(),
                routing_key: Some("routing-key".into()),
                hmac_secret: None,
            }],
            ..service_secrets(TOKEN)
        };
        let Service { stop, task, .. } = Service::start("t", config, secrets, sim);
        Daemon { stop, task }
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

/// Per dedup key, the bodies the receiver got, in order.
fn incidents(bodies: &[Value]) -> BTreeMap<String, Vec<Value>> {
    let mut out: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for b in bodies {
        let key = b["dedup_key"].as_str().unwrap().to_owned();
        out.entry(key).or_default().push(b.clone());
    }
    out
}

/// The `drift_detected` incidents among `all`.
fn drift_incidents(all: &BTreeMap<String, Vec<Value>>) -> BTreeMap<&String, &Vec<Value>> {
    all.iter()
        .filter(|(_, b)| class(b) == "drift_detected")
        .collect()
}

fn class(bodies: &[Value]) -> &str {
    bodies
        .iter()
        .find_map(|b| b["payload"]["class"].as_str())
        .unwrap_or("?")
}

/// Runs one release through the fleet with `group_by`; returns the
/// receiver's bodies once every machine runs the tip and every incident the
/// receiver heard of is resolved.
async fn release(group_by: &str) -> (Vec<Value>, String) {
    let overlay = OverlayRepo::new();
    let tip = overlay.tip();
    let mut fleet = SimFleet::new(TOKEN)
        .clock(Arc::new(TokioClock::starting_at(chrono::Utc::now())))
        .release_tip(tip.clone())
        .restart_delay(Duration::from_millis(100));
    for app in ["alpha", "beta"] {
        let mut a = SimApp::new(app);
        for i in 0..2 * PER_GROUP {
            // Even machines 1 commit behind (low), odd ones 6 (high).
            let behind = if i % 2 == 0 { 1 } else { 6 };
            a = a.machine(SimMachine::new(format!("{app}-{i:02}")).loaded(overlay.behind(behind)));
        }
        fleet = fleet.app(a);
    }
    fleet = fleet.app(SimApp::new("fleet-reconciler").machine(SimMachine::new("coord0").stopped()));
    let sim = Sim::start(fleet).await.unwrap();
    let pd = PagerDuty::start().await;

    let text = overlay
        .config(&sim.api_url(), "mirror.git")
        .fly("max_retries = 0")
        .app("alpha", Some(&sim.health_url_template()))
        .app("beta", Some(&sim.health_url_template()))
        .with(&format!(
            r#"
[sweep]
interval = "200ms"
[pools.default]
max_concurrent_rotations = 3
actions = {{ low = "restart", medium = "restart", high = "restart", critical = "restart" }}
[[severity]]
level = "high"
min_commits_behind = 5
[rotation]
min_drift_age = "0s"
restart_grace = "1s"
verify_deadline = "20s"
coordinator = "fleet-reconciler/coord0"
[alerts]
coherence_for = "1s"
group_by = {group_by}
runbook_url = "https://runbooks.example/docs/operations.md"
[[alerts.webhooks]]
url_env = "PD_URL"
format = "pagerduty"
routing_key_env = "PD_KEY"
min_severity = "low"
[server]
public_url = "https://fleet.example.com/"
"#
        ))
        .text();
    let daemon = Daemon::start(&text, &sim, &pd);

    let on_tip = || {
        sim.machines()
            .iter()
            .filter(|m| m.app != "fleet-reconciler")
            .all(|m| m.loaded_ref == tip)
    };
    eventually(
        "every machine on the tip",
        Duration::from_secs(600),
        async || on_tip(),
    )
    .await;
    eventually(
        "every incident resolved",
        Duration::from_secs(120),
        async || {
            let all = incidents(&pd.bodies());
            !all.is_empty()
                && all
                    .values()
                    .all(|b| b.last().unwrap()["event_action"] == "resolve")
        },
    )
    .await;
    daemon.stop().await;
    sim.shutdown().await;
    (pd.bodies(), tip)
}

#[tokio::test(start_paused = true)]
async fn one_release_pages_one_incident_per_app_tip_and_severity() {
    let (bodies, tip) = release(r#"["app", "tip", "severity"]"#).await;
    let all = incidents(&bodies);
    let drift = drift_incidents(&all);
    let expected: BTreeSet<String> = ["alpha", "beta"]
        .iter()
        .flat_map(|app| {
            ["low", "high"]
                .map(|sev| format!("fleet-reconciler/drift_detected/{app}/*/{tip}/severity={sev}"))
        })
        .collect();
    assert_eq!(
        drift.keys().map(|k| (*k).clone()).collect::<BTreeSet<_>>(),
        expected,
        "one incident per app, tip and severity"
    );
    let mut problems = Vec::new();
    for (key, b) in &drift {
        let triggers: Vec<&Value> = b
            .iter()
            .filter(|b| b["event_action"] == "trigger")
            .collect();
        let first = &triggers[0]["payload"];
        let summary = first["summary"].as_str().unwrap();
        if !summary.starts_with(&format!("{PER_GROUP} machines of ")) {
            problems.push(format!(
                "{key}: first summary does not count {PER_GROUP} machines: {summary}"
            ));
        }
        if first["custom_details"]["machines"] != PER_GROUP.to_string().as_str() {
            problems.push(format!(
                "{key}: details.machines {}",
                first["custom_details"]["machines"]
            ));
        }
        if first.get("component").is_some() {
            problems.push(format!(
                "{key}: a group names no single machine as component"
            ));
        }
        // Updated as machines converge: later triggers carry fewer machines.
        let updates: Vec<&Value> = triggers
            .iter()
            .filter(|t| t["payload"]["custom_details"]["update"] == "true")
            .copied()
            .collect();
        if updates.is_empty() {
            problems.push(format!("{key}: never updated while its machines converged"));
        }
        let counts: Vec<usize> = triggers
            .iter()
            .map(|t| {
                t["payload"]["custom_details"]["machines"]
                    .as_str()
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        if counts.windows(2).any(|w| w[1] > w[0]) || counts.last() >= counts.first() {
            problems.push(format!(
                "{key}: machine counts do not fall as the fleet converges: {counts:?}"
            ));
        }
        // Links: runbook, status page, and the rule behind the severity.
        let links: Vec<&str> = first_links(triggers[0]);
        if !links.contains(&"https://runbooks.example/docs/operations.md#drift_detected")
            || !links.contains(&"https://fleet.example.com/")
        {
            problems.push(format!("{key}: links {links:?}"));
        }
        let rule = first["custom_details"]["severity_rule"]
            .as_str()
            .unwrap_or_default();
        let wanted_rule = if key.ends_with("high") {
            "min_commits_behind = 5"
        } else {
            "no rule matched"
        };
        if !rule.contains(wanted_rule) {
            problems.push(format!(
                "{key}: severity_rule {rule:?}, expected {wanted_rule:?}"
            ));
        }
        if first["custom_details"]["tip"] != tip.as_str() {
            problems.push(format!("{key}: tip {}", first["custom_details"]["tip"]));
        }
        if b.iter().filter(|b| b["event_action"] == "resolve").count() != 1 {
            problems.push(format!("{key}: not resolved exactly once"));
        }
    }
    // Everything else is a fleet alert, one incident each: no per-machine page.
    for (key, b) in &all {
        if drift.contains_key(key) {
            continue;
        }
        let class = class(b);
        if !["coherence_below_threshold", "action_failed"].contains(&class) {
            problems.push(format!("unexpected incident {key} ({class})"));
        }
    }
    let fleet = all.len() - drift.len();
    assert!(
        problems.is_empty(),
        "{}\n{} incidents ({fleet} fleet)",
        problems.join("\n"),
        all.len()
    );
    assert!(
        all.len() <= 4 + 3,
        "4 groups + coherence (fleet, alpha, beta): {:?}",
        all.keys()
    );
}

fn first_links(trigger: &Value) -> Vec<&str> {
    trigger["links"]
        .as_array()
        .map(|l| l.iter().filter_map(|l| l["href"].as_str()).collect())
        .unwrap_or_default()
}

#[tokio::test(start_paused = true)]
async fn group_by_machine_pages_one_incident_per_machine_as_before() {
    let (bodies, tip) = release(r#"["machine"]"#).await;
    let all = incidents(&bodies);
    let drift = drift_incidents(&all);
    let expected: BTreeSet<String> = ["alpha", "beta"]
        .iter()
        .flat_map(|app| {
            let tip = tip.clone();
            (0..2 * PER_GROUP)
                .map(move |i| format!("fleet-reconciler/drift_detected/{app}/{app}-{i:02}/{tip}"))
        })
        .collect();
    assert_eq!(
        drift.keys().map(|k| (*k).clone()).collect::<BTreeSet<_>>(),
        expected,
        "today's keys: one incident per machine"
    );
    for (key, b) in &drift {
        let actions: Vec<&str> = b
            .iter()
            .map(|b| b["event_action"].as_str().unwrap())
            .collect();
        assert_eq!(
            actions,
            ["trigger", "resolve"],
            "{key}: paged once, resolved once"
        );
        let payload = &b[0]["payload"];
        let machine = key.split('/').nth(3).unwrap();
        assert_eq!(payload["component"], machine, "{key}");
        assert!(
            payload["summary"].as_str().unwrap().starts_with(machine),
            "{key}: the planner's own summary: {}",
            payload["summary"]
        );
        assert!(
            first_links(&b[0])
                .contains(&format!("https://fleet.example.com/machines/{machine}").as_str()),
            "{key}: the machine page is linked: {:?}",
            first_links(&b[0])
        );
    }
}

/// A restart with grouped incidents: the daemon's drift clocks start over
/// (no drift alert for `min_drift_age`), the machine alerts from before are
/// carried until the planner raises them again, and they group into the same
/// incident: nothing is resolved, updated or paged again.
#[tokio::test(start_paused = true)]
async fn a_restart_neither_resolves_nor_pages_a_group_again() {
    let overlay = OverlayRepo::new();
    let mut app = SimApp::new("alpha");
    for i in 0..3 {
        app = app.machine(SimMachine::new(format!("alpha-{i:02}")).loaded(overlay.behind(1)));
    }
    let sim = Sim::start(
        SimFleet::new(TOKEN)
            .clock(Arc::new(TokioClock::starting_at(chrono::Utc::now())))
            // The second run lists at once after the first, without
            // retries: Fly's per-app list limit would fail its sweeps.
            .list_rate_limit(None)
            .release_tip(overlay.tip())
            .app(app),
    )
    .await
    .unwrap();
    let pd = PagerDuty::start().await;
    let text = overlay
        .config(&sim.api_url(), "mirror.git")
        .fly("max_retries = 0")
        .app("alpha", Some(&sim.health_url_template()))
        .with(
            r#"
[sweep]
interval = "200ms"
[pools.default]
actions = { low = "observe", medium = "observe", high = "observe", critical = "observe" }
[rotation]
min_drift_age = "2s"
[[alerts.webhooks]]
url_env = "PD_URL"
format = "pagerduty"
routing_key_env = "PD_KEY"
min_severity = "low"
"#,
        )
        .text();
    let run1 = Daemon::start(&text, &sim, &pd);
    eventually("the group paged", Duration::from_secs(30), async || {
        !pd.bodies().is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    run1.stop().await;

    let run2 = Daemon::start(&text, &sim, &pd);
    // Past min_drift_age and a few sweeps more: the planner has raised the
    // drift again itself.
    tokio::time::sleep(Duration::from_secs(5)).await;
    run2.stop().await;
    sim.shutdown().await;
    let bodies = pd.bodies();
    let actions: Vec<(&str, &str)> = bodies
        .iter()
        .map(|b| {
            (
                b["event_action"].as_str().unwrap(),
                b["dedup_key"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        actions.len(),
        1,
        "paged once, nothing after the restart: {bodies:#?}"
    );
    assert_eq!(actions[0].0, "trigger");
    assert!(
        actions[0]
            .1
            .starts_with("fleet-reconciler/drift_detected/alpha/*/")
    );
    assert_eq!(bodies[0]["payload"]["custom_details"]["machines"], "3");
}

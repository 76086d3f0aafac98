//! `run` in-process when one app cannot be listed mid-run (a deleted app, a
//! token without access to it, a partial Fly outage): the other app is still
//! swept, reported and reconciled; the unlistable app keeps its last listing,
//! shown as stale, with no step planned for its machines (a rotation in
//! progress there waits); its data age grows; `app_unlistable` fires after
//! three sweep intervals and resolves once the app lists again.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::{Secrets, SweepOutcome};
use fleet_reconciler::metadata::MARKER_KEY;
use fleet_reconciler::model::AppName;
use fleet_reconciler::report::notify::SinkSecrets;
use fleet_reconciler::service::{self, ServiceSecrets};
use fleet_reconciler::sim::{Behaviour, RequestTarget, Sim, SimApp, SimFleet, SimMachine};
use tokio_util::sync::CancellationToken;

use crate::common::{OverlayRepo, eventually};

const TOKEN: &str = "unlistable-test-token";

/// The value of the series of `name` whose labels contain `labels`.
fn gauge(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_unlistable_app_does_not_stop_the_fleet() {
    let overlay = OverlayRepo::new();
    let (tip, old) = (overlay.tip(), overlay.behind(1));
    let sim = Sim::start(
        SimFleet::new(TOKEN)
            .release_tip(tip.clone())
            .restart_delay(Duration::from_millis(100))
            .app(
                SimApp::new("alpha")
                    .machine(SimMachine::new("a1").loaded(tip.clone()))
                    .machine(SimMachine::new("a2").loaded(tip.clone())),
            )
            .app(
                SimApp::new("beta")
                    .machine(
                        SimMachine::new("b1")
                            .loaded(old.clone())
                            .behaviour(Behaviour::BusyFor(Duration::from_secs(3600))),
                    )
                    .machine(SimMachine::new("b2").loaded(tip.clone())),
            )
            .app(SimApp::new("fleet-reconciler").machine(SimMachine::new("coord0").stopped())),
    )
    .await
    .unwrap();

    let received = Arc::new(Mutex::new(Vec::<serde_json::Value>::new()));
    let sink = received.clone();
    let hook_app = Router::new().route(
        "/hook",
        post(move |body: String| {
            let sink = sink.clone();
            async move {
                if let Ok(v) = serde_json::from_str(&body) {
                    sink.lock().unwrap().push(v);
                }
                "ok"
            }
        }),
    );
    let hook = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_url = format!("http://{}/hook", hook.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(hook, hook_app).await.unwrap() });

    let text = format!(
        r#"
[fly]
api_url = "{api}"
max_retries = 0
[overlay]
repo = "{repo}"
branch = "release"
mirror_dir = "{mirror}"
[sweep]
interval = "300ms"
[probe]
timeout = "1s"
[[apps]]
name = "alpha"
health_url = "{health}"
[[apps]]
name = "beta"
health_url = "{health}"
[pools.default]
max_concurrent_rotations = 2
actions = {{ low = "alert-and-wait", medium = "alert-and-wait", high = "alert-and-wait", critical = "alert-and-wait" }}
[rotation]
min_drift_age = "0s"
coordinator = "fleet-reconciler/coord0"
# Per machine, as these tests count (#20: grouped by default).
[alerts]
group_by = ["machine"]
[[alerts.webhooks]]
url_env = "HOOK"
format = "json"
"#,
        api = sim.api_url(),
        repo = overlay.repo_path.display(),
        mirror = overlay.dir.path().join("mirror.git").display(),
        health = sim.health_url_template(),
    );
    let config = Arc::new(Config::parse(Path::new("unlistable.toml"), &text).unwrap());
    let secrets = ServiceSecrets {
        core: Secrets {
            fly_token: TOKEN.into(),
            git_token: None,
            record_keys: Some(fleet_reconciler::sim::record_keys()),
        },
        webhooks: vec![SinkSecrets {
            url: hook_url.into(),
            routing_key: None,
            hmac_secret: None,
        }],
        ..ServiceSecrets::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    // Every planned step, by app, once `watching` is set.
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let planned = Arc::new(Mutex::new(Vec::<(String, String, &'static str)>::new()));
    let task = {
        let (watching, planned) = (watching.clone(), planned.clone());
        tokio::spawn(service::run(
            service::RunArgs::new(config, secrets, listener, "t".into(), stop.clone()),
            move |o| {
                if let SweepOutcome::Swept(cycle) = o
                    && watching.load(std::sync::atomic::Ordering::SeqCst)
                {
                    planned
                        .lock()
                        .unwrap()
                        .extend(cycle.plan.steps().into_iter().map(|s| {
                            (
                                s.target.app.to_string(),
                                s.target.machine_id.to_string(),
                                s.kind(),
                            )
                        }));
                }
            },
        ))
    };

    let http = reqwest::Client::new();
    let get = |path: &'static str| {
        let (http, url) = (http.clone(), format!("{base}{path}"));
        async move {
            match http.get(url).send().await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            }
        }
    };
    let events = |event: &str, app: &str| {
        received
            .lock()
            .unwrap()
            .iter()
            .filter(|v| v["event"] == event && v["app"] == app)
            .count()
    };

    // A rotation is in progress in beta: b1 is claimed, cordoned and waits
    // for its live work to end.
    eventually("b1 draining", Duration::from_secs(30), async || {
        sim.machine("b1").is_some_and(|m| {
            m.cordoned
                && m.metadata
                    .get(MARKER_KEY)
                    .is_some_and(|v| v.contains("draining"))
        })
    })
    .await;

    // beta can no longer be listed (a token without access to it). Once two
    // listings were refused, every cycle reported after sees beta unlistable.
    sim.fail_app("beta", Some(403));
    let refused_lists = || {
        sim.requests()
            .iter()
            .filter(|r| {
                r.target == RequestTarget::FlyApi
                    && r.app.as_deref() == Some("beta")
                    && r.machine_id.is_none()
                    && r.status == Some(403)
            })
            .count()
    };
    eventually(
        "two refused listings of beta",
        Duration::from_secs(15),
        async || refused_lists() >= 2,
    )
    .await;
    watching.store(true, std::sync::atomic::Ordering::SeqCst);
    sim.clear_requests();
    // Work for both apps: alpha drifts; beta's b1 goes idle (a managed b1
    // would now be restarted).
    sim.set_loaded_ref("a1", &old);
    sim.set_behaviour("b1", Behaviour::Normal);

    // alpha is still swept and reconciled: a1 rotates back to the tip.
    eventually(
        "a1 rotated while beta cannot be listed",
        Duration::from_secs(30),
        async || {
            sim.machine("a1").is_some_and(|m| {
                m.restart_count == 1
                    && m.loaded_ref == tip
                    && !m.cordoned
                    && !m.metadata.contains_key(MARKER_KEY)
            })
        },
    )
    .await;

    // beta is reported stale, with the error naming it, and its last
    // listing kept.
    let fleet: serde_json::Value = serde_json::from_str(&get("/api/v1/fleet").await).unwrap();
    let beta = fleet["apps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "beta")
        .unwrap()
        .clone();
    let error = beta["stale"]["error"].as_str().unwrap_or_default();
    assert!(error.contains("beta") && error.contains("403"), "{beta}");
    assert!(beta["stale"]["last_listed_at"].is_string(), "{beta}");
    assert_eq!(
        (beta["machines"].as_u64(), beta["on_tip"].as_u64()),
        (Some(2), Some(1))
    );
    let ids: Vec<&str> = fleet["machines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["machine_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a1", "a2", "b1", "b2"], "beta's last listing is kept");
    let alpha = &fleet["apps"][0];
    assert!(alpha["stale"].is_null(), "{alpha}");
    let page = get("/").await;
    assert!(
        page.contains("beta") && page.contains("could not be listed"),
        "the status page says so"
    );

    // Its data age grows; alpha's stays within a sweep or two.
    let first = get("/metrics").await;
    let age = |text: &str, app: &str| {
        gauge(
            text,
            "fleet_reconciler_app_data_age_seconds",
            &format!("fly_app=\"{app}\""),
        )
    };
    let beta_age =
        age(&first, "beta").expect("fleet_reconciler_app_data_age_seconds{fly_app=\"beta\"}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let second = get("/metrics").await;
    assert!(
        age(&second, "beta").unwrap() >= beta_age + 0.6,
        "beta's age grows: {beta_age} then {:?}",
        age(&second, "beta")
    );
    let alpha_age = age(&second, "alpha").unwrap();
    assert!(alpha_age < 5.0 && alpha_age < beta_age + 0.6, "{second}");
    // Its last known figures stay exported.
    assert_eq!(
        gauge(
            &second,
            "fleet_reconciler_overlay_coherence_ratio",
            "fly_app=\"beta\""
        ),
        Some(0.5),
        "{second}"
    );

    // The alert, after three sweep intervals; only for beta.
    eventually(
        "app_unlistable for beta",
        Duration::from_secs(15),
        async || events("app_unlistable", "beta") == 1,
    )
    .await;
    assert_eq!(events("app_unlistable", "alpha"), 0);
    let alert = received
        .lock()
        .unwrap()
        .iter()
        .find(|v| v["event"] == "app_unlistable")
        .cloned()
        .unwrap();
    assert!(
        alert["summary"]
            .as_str()
            .unwrap_or_default()
            .contains("beta"),
        "{alert}"
    );

    // Nothing was done to beta's machines: no step planned, no call made,
    // the rotation in progress waits (b1 cordoned, marker kept, not restarted).
    let planned_beta: Vec<_> = planned
        .lock()
        .unwrap()
        .iter()
        .filter(|(app, _, _)| app == "beta")
        .cloned()
        .collect();
    assert!(
        planned_beta.is_empty(),
        "steps planned for beta: {planned_beta:?}"
    );
    assert!(
        planned.lock().unwrap().iter().any(|(_, id, _)| id == "a1"),
        "alpha was reconciled"
    );
    let calls: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| r.app.as_deref() == Some("beta") && r.machine_id.is_some())
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(calls.is_empty(), "calls on beta's machines: {calls:?}");
    let b1 = sim.machine("b1").unwrap();
    assert_eq!(b1.restart_count, 0);
    assert!(b1.cordoned && b1.metadata.contains_key(MARKER_KEY));

    // Its machines' own alerts stand (b1's drift alert is not resolved).
    assert_eq!(events("drift_detected", "beta"), 1);
    assert_eq!(events("drift_resolved", "beta"), 0);

    // beta lists again: the alert resolves, and the rotation goes on.
    sim.fail_app("beta", None);
    eventually(
        "app_unlistable resolved",
        Duration::from_secs(15),
        async || events("app_listing_recovered", "beta") == 1,
    )
    .await;
    eventually(
        "b1 rotated once beta lists again",
        Duration::from_secs(30),
        async || {
            sim.machine("b1").is_some_and(|m| {
                m.restart_count == 1
                    && m.loaded_ref == tip
                    && !m.cordoned
                    && !m.metadata.contains_key(MARKER_KEY)
            })
        },
    )
    .await;
    let metrics = get("/metrics").await;
    assert!(age(&metrics, "beta").unwrap() < 5.0, "{metrics}");
    let fleet: serde_json::Value = serde_json::from_str(&get("/api/v1/fleet").await).unwrap();
    assert!(fleet["apps"][1]["stale"].is_null(), "{fleet}");

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    sim.shutdown().await;
}

/// Before: `hold`/`release`/`approve` looked the machine up app by app and
/// stopped at the first app that answered anything but 404, so one
/// unreadable app blocked a hold on a machine of another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_hold_reaches_a_machine_past_an_unreadable_app() {
    use fleet_reconciler::act::operator::{Operator, OperatorError};
    use fleet_reconciler::metadata::HOLD_KEY;
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        SimFleet::new(TOKEN)
            .release_tip(overlay.tip())
            .app(SimApp::new("alpha").machine(SimMachine::new("a1").loaded(overlay.tip())))
            .app(SimApp::new("beta").machine(SimMachine::new("b1").loaded(overlay.tip()))),
    )
    .await
    .unwrap();
    sim.fail_app("alpha", Some(403));
    let text = overlay
        .config(&sim.api_url(), "mirror.git")
        .fly("max_retries = 0")
        .app("alpha", None)
        .app("beta", None)
        .text();
    let config = Config::parse(Path::new("operator.toml"), &text).unwrap();
    let secrets = Secrets {
        fly_token: TOKEN.into(),
        git_token: None,
        record_keys: Some(fleet_reconciler::sim::record_keys()),
    };
    let operator = Operator::new(
        fleet_reconciler::daemon::fly_client(&config, &secrets).unwrap(),
        &config,
        secrets.record_keys.clone(),
    );
    let written = operator
        .hold(&"b1".into(), "oncall", "investigating", chrono::Utc::now())
        .await
        .expect("the hold reaches beta's machine");
    assert_eq!(written.app, AppName::from("beta"));
    assert!(written.fenced, "written under the lease");
    assert!(sim.machine("b1").unwrap().metadata.contains_key(HOLD_KEY));

    // A machine in no readable app: the error names the app not searched.
    let err = operator
        .hold(&"zz".into(), "oncall", "x", chrono::Utc::now())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, OperatorError::Unsearched { unsearched, .. } if unsearched == "alpha"),
        "{err}"
    );
    assert!(err.to_string().contains("alpha"), "{err}");
    sim.shutdown().await;
}

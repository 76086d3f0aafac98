//! The `run` service in-process: what on-call receives when sweeps fail.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::Secrets;
use fleet_reconciler::notify::SinkSecrets;
use fleet_reconciler::service::{self, ServiceSecrets};
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};
use tokio_util::sync::CancellationToken;

mod common;

use common::{OverlayRepo, until};

const TOKEN: &str = "service-test-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_sweeps_do_not_resolve_machine_alerts() {
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        SimFleet::new(TOKEN)
            .release_tip(overlay.tip())
            .app(SimApp::new("agents").machine(SimMachine::new("m1").loaded(overlay.behind(1)))),
    )
    .await
    .unwrap();

    let received = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = received.clone();
    let app = Router::new().route(
        "/hook",
        post(move |body: String| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().push(body);
                "ok"
            }
        }),
    );
    let hook = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_url = format!("http://{}/hook", hook.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(hook, app).await.unwrap() });

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
interval = "200ms"
[[apps]]
name = "agents"
health_url = "{health}"
[pools.default]
actions = {{ low = "observe", medium = "observe", high = "observe", critical = "observe" }}
[rotation]
min_drift_age = "0s"
[[alerts.webhooks]]
url_env = "HOOK"
format = "json"
"#,
        api = sim.api_url(),
        repo = overlay.repo_path.display(),
        mirror = overlay.dir.path().join("mirror.git").display(),
        health = sim.health_url_template(),
    );
    let config = Arc::new(Config::parse(Path::new("service.toml"), &text).unwrap());
    let secrets = ServiceSecrets {
        core: Secrets {
            fly_token: TOKEN.into(),
            git_token: None,
        },
        webhooks: vec![SinkSecrets {
            url: hook_url,
            routing_key: None,
            hmac_secret: None,
        }],
        ..ServiceSecrets::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stop = CancellationToken::new();
    let sweeps = Arc::new(Mutex::new((0usize, 0usize)));
    let counts = sweeps.clone();
    let task = tokio::spawn(service::run(
        config,
        secrets,
        listener,
        "t".into(),
        stop.clone(),
        move |o| {
            let mut c = counts.lock().unwrap();
            match o {
                fleet_reconciler::daemon::SweepOutcome::Swept(_) => c.0 += 1,
                fleet_reconciler::daemon::SweepOutcome::Failed { .. } => c.1 += 1,
            }
        },
    ));

    let has = |event: &str| {
        received
            .lock()
            .unwrap()
            .iter()
            .any(|b| b.contains(&format!("\"event\":\"{event}\"")))
    };
    until("drift_detected delivered", Duration::from_secs(15), || {
        has("drift_detected")
    })
    .await;
    // The Fly API fails for a few sweeps: nothing is known about m1 meanwhile.
    let failed_before = sweeps.lock().unwrap().1;
    sim.fail_next(6, 503, None);
    until("sweeps failed", Duration::from_secs(15), || {
        sweeps.lock().unwrap().1 >= failed_before + 3
    })
    .await;
    until("sweeps recovered", Duration::from_secs(15), || {
        sim.pending_failures() == 0
    })
    .await;
    let ok_after = sweeps.lock().unwrap().0;
    until("a good sweep after", Duration::from_secs(15), || {
        sweeps.lock().unwrap().0 >= ok_after + 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !has("drift_resolved"),
        "a failed sweep resolved a drift that never cleared"
    );
    let triggers = received
        .lock()
        .unwrap()
        .iter()
        .filter(|b| b.contains("\"event\":\"drift_detected\""))
        .count();
    assert_eq!(triggers, 1, "paged once, not again after the failures");

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    sim.shutdown().await;
}

//! Health URLs are built from machine names, ids, regions and IPs that the
//! Fly API hands back: a value must stay in its placeholder's slot. Against
//! the simulated fleet over loopback, with a second "trap" server that a
//! hostile machine name tries to send the probe (and then the drain, with
//! the agent bearer token) to; the trap must receive nothing it should not.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use fleet_reconciler::act::executor::{Executor, ExecutorConfig};
use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::{self, LoopOptions, Secrets, SweepOutcome};
use fleet_reconciler::metadata::MARKER_KEY;
use fleet_reconciler::model::MachineStatus;
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};
use tokio_util::sync::CancellationToken;

use crate::common::{OverlayRepo, eventually};

const TOKEN: &str = "health-url-test-token";
const AGENT_TOKEN: &str = "agent-secret";
/// Tries to move the host: `http://{name}:PORT/…` becomes `http://x@TRAP/:PORT/…`.
const HOST_THIEF: &str = "m1";
/// Tries to move the path: `/agents/{name}/{machine_id}/health` becomes `/admin?/…`.
const PATH_THIEF: &str = "e1";
const PATH_THIEF_NAME: &str = "a/../../admin?";

/// What the trap saw: method, path and query, Authorization header.
type Seen = Arc<Mutex<Vec<(String, String, Option<String>)>>>;
/// Each machine's status and detail in the latest sweep.
type Statuses = Arc<Mutex<HashMap<String, (MachineStatus, Option<String>)>>>;

/// Answers every GET with a drifted, busy report advertising `drain`, so
/// that a reconciler fooled into probing it goes on to drain "its" agent.
async fn trap(State((seen, old)): State<(Seen, String)>, req: Request) -> axum::response::Response {
    let auth = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let target = req
        .uri()
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    seen.lock()
        .unwrap()
        .push((req.method().to_string(), target, auth));
    let report = serde_json::json!({
        "overlay_ref": old,
        "activity": "busy",
        "live_sessions": 1,
        "heartbeat_at": chrono::Utc::now().to_rfc3339(),
        "capabilities": ["drain"],
    });
    axum::response::Response::new(axum::body::Body::from(report.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_name_cannot_move_the_probe_or_the_drain() {
    let overlay = OverlayRepo::new();
    let (tip, old) = (overlay.tip(), overlay.behind(1));

    let seen: Seen = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let trap_addr = listener.local_addr().unwrap();
    let app = Router::new()
        .fallback(trap)
        .with_state((seen.clone(), old.clone()));
    let trap_task = tokio::spawn(async move { axum::serve(listener, app).await });

    let busy = |id: &str| {
        SimMachine::new(id)
            .loaded(old.clone())
            .cooperative()
            .agent_token(AGENT_TOKEN)
            .behaviour(fleet_reconciler::sim::Behaviour::BusyFor(
                Duration::from_secs(1),
            ))
    };
    let sim = Sim::start(
        SimFleet::new(TOKEN)
            .release_tip(tip.clone())
            .restart_delay(Duration::from_millis(200))
            .app(SimApp::new("app").machines([
                busy(HOST_THIEF).name(format!("x@{trap_addr}/")),
                // An honest machine, to show the template works and the loop ran.
                busy("m2").name("localhost"),
            ]))
            .app(SimApp::new("edge").machine(busy(PATH_THIEF).name(PATH_THIEF_NAME)))
            .app(SimApp::new("coord").machine(SimMachine::new("c0").stopped())),
    )
    .await
    .unwrap();
    let port = sim.addr().port();
    let text = format!(
        r#"
[fly]
api_url = "{api}"
request_timeout = "5s"
[overlay]
repo = "{repo}"
branch = "release"
fetch_interval = "1h"
mirror_dir = "{mirror}"
[sweep]
interval = "150ms"
[probe]
timeout = "500ms"
[[apps]]
name = "app"
health_url = "http://{{name}}:{port}/agents/{{machine_id}}/health"
agent_token_env = "AGENT_TOKEN"
[[apps]]
name = "edge"
health_url = "http://{trap_addr}/agents/{{name}}/{{machine_id}}/health"
agent_token_env = "AGENT_TOKEN"
[pools.default]
max_concurrent_rotations = 3
actions = {{ low = "alert-and-wait", medium = "alert-and-wait", high = "alert-and-wait", critical = "alert-and-wait" }}
[rotation]
min_drift_age = "0s"
coordinator = "coord/c0"
"#,
        api = sim.api_url(),
        repo = overlay.repo_path.display(),
        mirror = overlay.dir.path().join("mirror.git").display(),
    );
    let config = Arc::new(Config::parse(Path::new("health_urls.toml"), &text).unwrap());

    let sweeper = daemon::connect(
        config.clone(),
        &Secrets {
            fly_token: TOKEN.into(),
            git_token: None,
            record_keys: Some(fleet_reconciler::sim::record_keys()),
        },
    )
    .await
    .unwrap();
    let tokens = HashMap::from([
        ("app".to_string(), AGENT_TOKEN.into()),
        ("edge".to_string(), AGENT_TOKEN.into()),
    ]);
    let mut tuning = ExecutorConfig::new("r1");
    tuning.start_wait = Duration::from_secs(5);
    tuning.record_keys = sweeper.record_keys.clone();
    let executor = Executor::new(
        sweeper.fly.clone(),
        config.clone(),
        Arc::new(fleet_reconciler::decide::policy::Policy::from_config(
            &config,
        )),
        tokens,
        tuning,
    )
    .unwrap();
    let stop = CancellationToken::new();
    let statuses: Statuses = Arc::default();
    let loop_task = {
        let (stop, statuses) = (stop.clone(), statuses.clone());
        tokio::spawn(async move {
            let options = LoopOptions {
                executor: Some(&executor),
                refresh: None,
                owner: "r1".into(),
                clock: fleet_reconciler::clock::system(),
                restored_alerts: Vec::new(),
                delivery: None,
            };
            daemon::reconcile_loop(&sweeper, options, stop, |outcome| {
                if let SweepOutcome::Swept(cycle) = outcome {
                    let mut s = statuses.lock().unwrap();
                    for m in &cycle.report.machines {
                        s.insert(
                            m.seen.machine_id.to_string(),
                            (m.seen.status, m.seen.detail.clone()),
                        );
                    }
                }
            })
            .await;
        })
    };

    // The honest machine is probed, drained and rotated through its URL.
    eventually("m2 converges", Duration::from_secs(30), async || {
        sim.machine("m2").is_some_and(|m| {
            m.loaded_ref == tip && !m.cordoned && !m.metadata.contains_key(MARKER_KEY)
        })
    })
    .await;
    // A few more sweeps, in which a fooled reconciler would drain the thieves.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), loop_task)
        .await
        .expect("loop stops")
        .unwrap();

    // The path thief's values stay one path segment of its own slot; the
    // host thief never reaches the trap at all.
    let own_slot = "/agents/a%2F..%2F..%2Fadmin%3F/";
    let seen = seen.lock().unwrap().clone();
    let strays: Vec<_> = seen
        .iter()
        .filter(|(_, p, _)| !p.starts_with(own_slot))
        .collect();
    assert!(
        strays.is_empty(),
        "the trap received requests outside {own_slot}: {strays:#?}"
    );
    let (status, detail) = statuses.lock().unwrap()[HOST_THIEF].clone();
    assert_eq!(status, MachineStatus::Unreachable, "{detail:?}");
    let detail = detail.unwrap_or_default();
    assert!(detail.contains("health URL"), "{detail}");
    assert!(
        sim.machine(HOST_THIEF).is_some_and(|m| !m.cordoned),
        "a machine we cannot probe is left alone"
    );

    trap_task.abort();
    sim.shutdown().await;
}

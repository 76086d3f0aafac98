//! `[[alerts.heartbeat]]` through the real binary (issue 34 item 2): `run`
//! against the simulator pings a loopback receiver after every successful
//! sweep; the receiver, like healthchecks.io or a PagerDuty heartbeat, pages
//! when the pings stop, and they stop when the daemon is SIGKILLed or when
//! no sweep succeeds. A failing ping is logged without its URL and counted.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};

use crate::common::{ChildGuard, ConfigToml, OverlayRepo, eventually, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
const FLY_TOKEN: &str = "fly-secret-token-heartbeat";
/// The check's secret, as healthchecks.io puts it in the ping URL.
const PING_PATH: &str = "/ping/5ecret-check-uuid";
/// A receiver that is down: every ping to it fails.
const BROKEN_PATH: &str = "/ping/broken-5ecret";
/// Sweeps every 300 ms; the receiver pages after this long without a ping
/// (many intervals, so a slow machine does not page a live daemon in the
/// parts of the test that wait for pings).
const PAGE_AFTER: Duration = Duration::from_secs(3);

/// A dead-man's-switch receiver: counts pings, and its own watchdog turns
/// "no ping for PAGE_AFTER" into a paged state with the ping count it paged
/// at (cleared by the next ping).
#[derive(Default)]
struct Receiver {
    pings: usize,
    last: Option<Instant>,
    paged_at: Option<usize>,
}

async fn receiver() -> (String, String, Arc<Mutex<Receiver>>) {
    let state = Arc::new(Mutex::new(Receiver::default()));
    let seen = state.clone();
    let app = Router::new()
        .route(
            PING_PATH,
            get(move || {
                let seen = seen.clone();
                async move {
                    let mut r = seen.lock().unwrap();
                    r.pings += 1;
                    r.last = Some(Instant::now());
                    // A ping after a page is a recovery, as the services
                    // treat it: only the silence at the end counts.
                    r.paged_at = None;
                    "OK"
                }
            }),
        )
        .route(
            BROKEN_PATH,
            get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "down") }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    // The receiver's watchdog: it pages once pings stop, as the services do
    // (only after a first ping: a check that never started is "new").
    let watched = state.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut r = watched.lock().unwrap();
            if r.paged_at.is_none() && r.last.is_some_and(|at| at.elapsed() > PAGE_AFTER) {
                r.paged_at = Some(r.pings);
            }
        }
    });
    (
        format!("http://{addr}{PING_PATH}"),
        format!("http://{addr}{BROKEN_PATH}"),
        state,
    )
}

fn config(sim: &Sim, overlay: &OverlayRepo, port: u16) -> std::path::PathBuf {
    ConfigToml::new(
        &sim.api_url(),
        &overlay.repo_path,
        overlay.dir.path().join("mirror.git"),
    )
    .overlay("fetch_interval = \"1s\"")
    .app("agents", Some(&sim.health_url_template()))
    .with(&format!(
        r#"
[sweep]
interval = "300ms"
[probe]
timeout = "1s"
[pools.default]
actions = {{ low = "observe", medium = "observe", high = "observe", critical = "observe" }}
[[alerts.heartbeat]]
url_env = "HB_URL"
[[alerts.heartbeat]]
url_env = "HB_BROKEN_URL"
timeout = "2s"
[server]
listen = "127.0.0.1:{port}"
"#
    ))
    .write(overlay.dir.path().join("fleet-reconciler.toml"))
}

async fn fleet(tip: &str) -> Sim {
    Sim::start(
        SimFleet::new(FLY_TOKEN).release_tip(tip.to_string()).app(
            SimApp::new("agents")
                .machine(SimMachine::new("m1").loaded(tip.to_string()))
                .machine(SimMachine::new("m2").loaded(tip.to_string())),
        ),
    )
    .await
    .unwrap()
}

async fn metric(base: &str, series: &str) -> Option<u64> {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_pings_each_sweep_and_the_receiver_pages_when_the_daemon_is_killed() {
    let overlay = OverlayRepo::new();
    let sim = fleet(&overlay.tip()).await;
    let (ping_url, broken_url, received) = receiver().await;
    let port = free_port();
    let config_path = config(&sim, &overlay, port);
    let mut child = ChildGuard(
        Command::new(BIN)
            .args(["run", "--config"])
            .arg(&config_path)
            .env("FLEET_RECONCILER_FLY_TOKEN", FLY_TOKEN)
            .env("HB_URL", &ping_url)
            .env("HB_BROKEN_URL", &broken_url)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stderr = child.0.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let base = format!("http://127.0.0.1:{port}");

    // Sweeps succeed, and each pings: the count keeps growing.
    eventually("5 pings", Duration::from_secs(60), async || {
        received.lock().unwrap().pings >= 5
    })
    .await;
    // The broken receiver's failures are counted (and logged, below).
    eventually(
        "a failed ping counted",
        Duration::from_secs(60),
        async || {
            metric(
                &base,
                "fleet_reconciler_heartbeat_pings_total{heartbeat=\"1\",result=\"failed\"}",
            )
            .await
            .is_some_and(|n| n >= 1)
        },
    )
    .await;
    let ok = metric(
        &base,
        "fleet_reconciler_heartbeat_pings_total{heartbeat=\"0\",result=\"ok\"}",
    )
    .await
    .unwrap_or(0);
    assert!(ok >= 1, "pings to the working receiver counted ok: {ok}");

    // SIGKILL: no shutdown path runs, no last word is sent.
    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-KILL", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = child.0.wait().unwrap();
    assert!(!status.success(), "killed: {status}");
    let pings_at_kill = received.lock().unwrap().pings;

    // The receiver notices the silence and pages, after the last ping the
    // daemon sent before it was killed.
    eventually("the receiver pages", Duration::from_secs(60), async || {
        received.lock().unwrap().paged_at.is_some()
    })
    .await;
    let (paged_at, pings) = {
        let r = received.lock().unwrap();
        (r.paged_at, r.pings)
    };
    assert_eq!(paged_at, Some(pings), "no ping after the receiver paged");
    assert!(pings >= pings_at_kill);

    let log = log.join().unwrap();
    assert!(
        log.contains("heartbeat ping failed") && log.contains("HB_BROKEN_URL"),
        "the failing ping is logged, naming its variable"
    );
    for secret in [PING_PATH, BROKEN_PATH, "5ecret", &ping_url, &broken_url] {
        assert!(!log.contains(secret), "log contains {secret}");
    }
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_whose_sweeps_fail_does_not_ping() {
    let overlay = OverlayRepo::new();
    let sim = fleet(&overlay.tip()).await;
    let (ping_url, broken_url, received) = receiver().await;
    let port = free_port();
    let config_path = config(&sim, &overlay, port);
    // Fly refuses the token: no app can be listed, so no sweep succeeds.
    let _child = ChildGuard(
        Command::new(BIN)
            .args(["run", "--config"])
            .arg(&config_path)
            .env("FLEET_RECONCILER_FLY_TOKEN", "not-the-token")
            .env("HB_URL", &ping_url)
            .env("HB_BROKEN_URL", &broken_url)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");
    eventually("3 failed sweeps", Duration::from_secs(60), async || {
        let text = match reqwest::get(format!("{base}/metrics")).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => return false,
        };
        text.lines()
            .filter(|l| {
                l.starts_with("fleet_reconciler_sweeps_total{") && !l.contains("\"success\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum::<u64>()
            >= 3
    })
    .await;
    assert_eq!(received.lock().unwrap().pings, 0, "a failed sweep pinged");
    sim.shutdown().await;
}

//! The `run` service in-process: what on-call receives when sweeps fail.
//!
//! The service and the sim read one clock (`run_with_clock`), on tokio's
//! paused time in every test but the one about scrapes during an analysis,
//! which needs real threads.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use fleet_reconciler::clock::TokioClock;
use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::Secrets;
use fleet_reconciler::decide::alerts::{Alert, AlertKind};
use fleet_reconciler::report::notify::SinkSecrets;
use fleet_reconciler::service::{self, ServiceSecrets};
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};
use tokio_util::sync::CancellationToken;

use crate::common::{OverlayRepo, eventually};

const TOKEN: &str = "service-test-token";

/// A fleet on the overlay's tip whose clock follows tokio's (paused, except
/// on the one multi-thread test, where it is real time).
fn fleet(overlay: &OverlayRepo) -> SimFleet {
    SimFleet::new(TOKEN)
        .clock(Arc::new(TokioClock::starting_at(chrono::Utc::now())))
        .release_tip(overlay.tip())
}

#[tokio::test(start_paused = true)]
async fn failing_sweeps_do_not_resolve_machine_alerts() {
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        fleet(&overlay)
            .app(SimApp::new("agents").machine(SimMachine::new("m1").loaded(overlay.behind(1)))),
    )
    .await
    .unwrap();
    let hook = Hook::start().await;
    let service = Service::start(&sim, &overlay, &hook);

    let delivered = |event: &str| hook.bodies().iter().filter(|b| b["event"] == event).count();
    eventually(
        "drift_detected delivered",
        Duration::from_secs(15),
        async || delivered("drift_detected") > 0,
    )
    .await;
    // The Fly API fails for a few sweeps: nothing is known about m1 meanwhile.
    let failed_before = service.failed();
    sim.fail_next(6, 503, None);
    eventually("sweeps failed", Duration::from_secs(15), async || {
        service.failed() >= failed_before + 3
    })
    .await;
    eventually("sweeps recovered", Duration::from_secs(15), async || {
        sim.pending_failures() == 0
    })
    .await;
    service.sweeps_after(2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        delivered("drift_resolved"),
        0,
        "a failed sweep resolved a drift that never cleared"
    );
    assert_eq!(
        delivered("drift_detected"),
        1,
        "paged once, not again after the failures"
    );

    service.stop().await;
    sim.shutdown().await;
}

/// #35 item 2: `alert_sink_failing` is decided by the loop
/// (`decide::alerts::evaluate`) from the delivery state the notifier
/// reports, not added by the notifier: a webhook that refuses what it is
/// sent (404) is in the next turns' alert set, named as before.
#[tokio::test(start_paused = true)]
async fn a_failing_webhook_is_in_the_alert_set_the_loop_evaluates() {
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        fleet(&overlay)
            .app(SimApp::new("agents").machine(SimMachine::new("m1").loaded(overlay.behind(1)))),
    )
    .await
    .unwrap();
    let hook = Hook::start().await;
    hook.fail_with(404);
    let service = Service::start(&sim, &overlay, &hook);
    let failing = |alerts: &[Alert]| {
        alerts
            .iter()
            .find(|a| a.kind == AlertKind::SinkFailing)
            .cloned()
    };
    eventually(
        "alert_sink_failing in a turn's alerts",
        Duration::from_secs(15),
        async || failing(&service.last_alerts()).is_some(),
    )
    .await;
    let alert = failing(&service.last_alerts()).unwrap();
    assert_eq!(alert.details["sinks"], "0:json:HOOK");
    assert!(
        alert.summary.starts_with(
            "Alerts are not reaching every webhook: webhook 0 (json, URL in HOOK) has failed since "
        ) && alert
            .summary
            .contains(": HTTP 404; 1 notification(s) dead-lettered"),
        "{}",
        alert.summary
    );
    assert!(hook.bodies().is_empty(), "{:?}", hook.bodies());

    service.stop().await;
    sim.shutdown().await;
}

/// The value of the series of `name` whose labels contain `labels`.
fn gauge(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// `run` after a release: the new tip is fetched and analysed while
/// `/metrics` keeps serving the last sweep's figures, and then serves the new
/// ones: no scrape in between finds the fleet's series missing, zeroed or
/// half updated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_tip_is_analysed_while_the_last_figures_stay_served() {
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        fleet(&overlay).app(
            SimApp::new("agents")
                .machine(SimMachine::new("m1").loaded(overlay.behind(1)))
                .machine(SimMachine::new("m2")),
        ),
    )
    .await
    .unwrap();
    let text = overlay
        .config(&sim.api_url(), "mirror.git")
        .overlay("fetch_interval = \"50ms\"")
        .app("agents", Some(&sim.health_url_template()))
        .with(
            r#"
[sweep]
interval = "50ms"
[pools.default]
actions = { low = "observe", medium = "observe", high = "observe", critical = "observe" }
"#,
        )
        .text();
    let config = Arc::new(Config::parse(Path::new("service.toml"), &text).unwrap());
    let secrets = ServiceSecrets {
        core: Secrets {
            fly_token: TOKEN.into(),
            git_token: None,
            record_keys: Some(fleet_reconciler::sim::record_keys()),
        },
        ..ServiceSecrets::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_url = format!("http://{}/metrics", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let task = tokio::spawn(service::run(
        service::RunArgs::new(config, secrets, listener, "t".into(), stop.clone()),
        |_| {},
    ));
    let client = reqwest::Client::new();
    let scrape = || async {
        tokio::time::timeout(Duration::from_secs(5), async {
            client.get(&metrics_url).send().await?.text().await
        })
        .await
        .expect("scrape timed out")
        .unwrap_or_default()
    };
    let m1 = "machine_id=\"m1\"";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while gauge(
        &scrape().await,
        "fleet_reconciler_overlay_commits_behind",
        m1,
    ) != Some(1.0)
    {
        assert!(tokio::time::Instant::now() < deadline, "first sweep");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    // A release: three commits on top of the tip, published at once (the
    // fetcher runs beside the sweeps and could see a half-made release).
    let repo = git2::Repository::open_bare(&overlay.repo_path).unwrap();
    let mut parent = repo
        .find_commit(git2::Oid::from_str(&overlay.tip()).unwrap())
        .unwrap();
    let sig = git2::Signature::now("Dev", "dev@example.com").unwrap();
    for i in 0..3 {
        let tree = parent.tree().unwrap();
        let oid = repo
            .commit(None, &sig, &sig, &format!("next {i}"), &tree, &[&parent])
            .unwrap();
        parent = repo.find_commit(oid).unwrap();
    }
    repo.reference("refs/heads/release", parent.id(), true, "release")
        .unwrap();

    let mut scrapes = 0;
    loop {
        let text = scrape().await;
        scrapes += 1;
        let behind = gauge(&text, "fleet_reconciler_overlay_commits_behind", m1);
        let coherence = gauge(
            &text,
            "fleet_reconciler_overlay_coherence_ratio",
            "fly_app=\"agents\"",
        );
        // The last sweep before the release (m1 behind 1, m2 on the tip) or
        // the first after it (m1 behind 4, m2 behind 3): never a gap.
        match (behind, coherence) {
            (Some(1.0), Some(0.5)) => {}
            (Some(4.0), Some(0.0)) => break,
            other => panic!("scrape {scrapes}: m1 behind and coherence {other:?}"),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "new tip never analysed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    sim.shutdown().await;
}

// ------------------------------------------------------------ restarts

/// A json webhook receiver on loopback that records what it accepts and
/// answers `fail` (when non-zero) instead.
struct Hook {
    url: String,
    accepted: Arc<Mutex<Vec<serde_json::Value>>>,
    fail: Arc<std::sync::atomic::AtomicU16>,
}

impl Hook {
    async fn start() -> Hook {
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let fail = Arc::new(std::sync::atomic::AtomicU16::new(0));
        let (sink, status) = (accepted.clone(), fail.clone());
        let app = Router::new().route(
            "/hook",
            post(move |body: String| {
                let (sink, status) = (sink.clone(), status.clone());
                async move {
                    let code = status.load(std::sync::atomic::Ordering::SeqCst);
                    if code != 0 {
                        return axum::http::StatusCode::from_u16(code).unwrap();
                    }
                    sink.lock()
                        .unwrap()
                        .push(serde_json::from_str(&body).unwrap());
                    axum::http::StatusCode::OK
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Hook {
            url,
            accepted,
            fail,
        }
    }

    fn fail_with(&self, code: u16) {
        self.fail.store(code, std::sync::atomic::Ordering::SeqCst);
    }

    fn bodies(&self) -> Vec<serde_json::Value> {
        self.accepted.lock().unwrap().clone()
    }

    /// Bodies of `event` for `machine`.
    fn of(&self, event: &str, machine: &str) -> Vec<serde_json::Value> {
        self.bodies()
            .into_iter()
            .filter(|b| b["event"] == event && b["machine_id"] == machine)
            .collect()
    }
}

/// `service::run` in a task, with one json webhook; the config keeps its
/// mirror (and so, by default, the alert state) in `overlay.dir`.
struct Service {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), service::ServiceError>>,
    sweeps: Arc<Mutex<usize>>,
    /// Sweeps that failed as a whole.
    failed: Arc<Mutex<usize>>,
    /// The alerts of the last turn (swept or failed), as the loop evaluated them.
    alerts: Arc<Mutex<Vec<Alert>>>,
}

impl Service {
    fn start(sim: &Sim, overlay: &OverlayRepo, hook: &Hook) -> Service {
        Service::start_with(sim, overlay, hook, "0s")
    }

    fn start_with(sim: &Sim, overlay: &OverlayRepo, hook: &Hook, min_drift_age: &str) -> Service {
        let text = overlay
            .config(&sim.api_url(), "mirror.git")
            .fly("max_retries = 0")
            .app("agents", Some(&sim.health_url_template()))
            .with(&format!(
                r#"
[sweep]
interval = "200ms"
[pools.default]
actions = {{ low = "observe", medium = "observe", high = "observe", critical = "observe" }}
[rotation]
min_drift_age = "{min_drift_age}"
# Per machine, as these tests count (#20: grouped by default).
[alerts]
group_by = ["machine"]
[[alerts.webhooks]]
url_env = "HOOK"
format = "json"
"#
            ))
            .text();
        let config = Arc::new(Config::parse(Path::new("service.toml"), &text).unwrap());
        let secrets = ServiceSecrets {
            core: Secrets {
                fly_token: TOKEN.into(),
                git_token: None,
                record_keys: Some(fleet_reconciler::sim::record_keys()),
            },
            webhooks: vec![SinkSecrets {
                url: hook.url.clone().into(),
                routing_key: None,
                hmac_secret: None,
            }],
            ..ServiceSecrets::default()
        };
        let stop = CancellationToken::new();
        let (sweeps, failed) = (Arc::new(Mutex::new(0)), Arc::new(Mutex::new(0)));
        let (counted, counted_failed) = (sweeps.clone(), failed.clone());
        let alerts = Arc::new(Mutex::new(Vec::new()));
        let last = alerts.clone();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let task = tokio::spawn(service::run(
            service::RunArgs::new(config, secrets, listener, "t".into(), stop.clone())
                .with_clock(sim.clock()),
            move |o| match o {
                fleet_reconciler::daemon::SweepOutcome::Swept(cycle) => {
                    *counted.lock().unwrap() += 1;
                    *last.lock().unwrap() = cycle.alerts.alerts.clone();
                }
                fleet_reconciler::daemon::SweepOutcome::Failed { alerts, .. } => {
                    *counted_failed.lock().unwrap() += 1;
                    *last.lock().unwrap() = alerts.alerts.clone();
                }
                fleet_reconciler::daemon::SweepOutcome::Observed { .. }
                | fleet_reconciler::daemon::SweepOutcome::Acted { .. } => {}
            },
        ));
        Service {
            stop,
            task,
            sweeps,
            failed,
            alerts,
        }
    }

    fn last_alerts(&self) -> Vec<Alert> {
        self.alerts.lock().unwrap().clone()
    }

    fn failed(&self) -> usize {
        *self.failed.lock().unwrap()
    }

    fn sweeps(&self) -> usize {
        *self.sweeps.lock().unwrap()
    }

    async fn sweeps_after(&self, n: usize) {
        let seen = *self.sweeps.lock().unwrap();
        eventually("more sweeps", Duration::from_secs(15), async || {
            *self.sweeps.lock().unwrap() >= seen + n
        })
        .await;
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

/// Issue 10, item 4: run 1 pages; it stops; meanwhile one agent reaches the
/// tip. Run 2 resolves that alert, does not page again for the alerts still
/// firing, and delivers what run 1 could not deliver before it stopped.
#[tokio::test(start_paused = true)]
async fn alert_state_survives_a_restart() {
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        fleet(&overlay).app(
            SimApp::new("agents")
                .machine(SimMachine::new("m1").loaded(overlay.behind(1)))
                .machine(SimMachine::new("m2").loaded(overlay.behind(1)))
                .machine(SimMachine::new("m3")),
        ),
    )
    .await
    .unwrap();
    let hook = Hook::start().await;

    // Run 1: m1 and m2 are paged; then the receiver fails, and m3's drift
    // cannot be delivered before the daemon stops.
    let run1 = Service::start(&sim, &overlay, &hook);
    eventually("m1 and m2 paged", Duration::from_secs(15), async || {
        !hook.of("drift_detected", "m1").is_empty() && !hook.of("drift_detected", "m2").is_empty()
    })
    .await;
    hook.fail_with(503);
    sim.set_loaded_ref("m3", &overlay.behind(2));
    run1.sweeps_after(3).await;
    run1.stop().await;
    let stopped = sim.now();
    assert!(hook.of("drift_detected", "m3").is_empty());
    // Payload times have whole seconds: run 2's are all later than `stopped`.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // While it is down, m1 reaches the tip; the receiver is back.
    sim.set_loaded_ref("m1", &overlay.tip());
    hook.fail_with(0);

    let run2 = Service::start(&sim, &overlay, &hook);
    run2.sweeps_after(5).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    run2.stop().await;

    let mut problems = Vec::new();
    if hook.of("drift_resolved", "m1").len() != 1 {
        problems.push(format!(
            "m1 reached the tip while the daemon was down: expected one drift_resolved, got {}",
            hook.of("drift_resolved", "m1").len()
        ));
    }
    let m2 = hook.of("drift_detected", "m2");
    if m2.len() != 1 {
        problems.push(format!(
            "m2 still drifts: paged once in run 1, expected no new page in run 2, got {} drift_detected",
            m2.len()
        ));
    }
    let m3 = hook.of("drift_detected", "m3");
    let queued_in_run1 = m3.iter().any(|b| {
        b["at"]
            .as_str()
            .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok())
            .is_some_and(|at| at <= stopped)
    });
    if m3.len() != 1 || !queued_in_run1 {
        problems.push(format!(
            "m3's trigger, queued when run 1 stopped, should be delivered once by run 2; got {m3:?}"
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    sim.shutdown().await;
}

/// After a restart the planner raises a drift alert only `min_drift_age`
/// after it sees the drift again, and the first sweeps may fail: neither
/// resolves an alert that still holds (nor pages it again), while one the
/// first good sweep shows cleared resolves at once.
#[tokio::test(start_paused = true)]
async fn a_restart_carries_alerts_over_failed_sweeps_and_the_drift_clock() {
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        fleet(&overlay).app(
            SimApp::new("agents")
                .machine(SimMachine::new("m1").loaded(overlay.behind(1)))
                .machine(SimMachine::new("m2").loaded(overlay.behind(1))),
        ),
    )
    .await
    .unwrap();
    let hook = Hook::start().await;
    let run1 = Service::start_with(&sim, &overlay, &hook, "2s");
    eventually("m1 and m2 paged", Duration::from_secs(15), async || {
        !hook.of("drift_detected", "m1").is_empty() && !hook.of("drift_detected", "m2").is_empty()
    })
    .await;
    run1.stop().await;

    sim.set_loaded_ref("m1", &overlay.tip());
    // The Fly API fails the first sweeps of run 2 (max_retries = 0).
    sim.fail_next(4, 503, None);
    let run2 = Service::start_with(&sim, &overlay, &hook, "2s");
    eventually("Fly answers again", Duration::from_secs(15), async || {
        sim.pending_failures() == 0
    })
    .await;
    let first_good = run2.sweeps();
    eventually("m1 resolved", Duration::from_secs(15), async || {
        !hook.of("drift_resolved", "m1").is_empty()
    })
    .await;
    assert!(
        run2.sweeps() <= first_good + 3,
        "m1 is on the tip: resolved by the first good sweep, not after a grace"
    );
    // Past min_drift_age: the planner raises m2's drift itself.
    tokio::time::sleep(Duration::from_secs(3)).await;
    run2.sweeps_after(2).await;
    run2.stop().await;
    assert!(
        hook.of("drift_resolved", "m2").is_empty(),
        "m2 never reached the tip: {:#?}",
        hook.bodies()
    );
    assert_eq!(hook.of("drift_detected", "m2").len(), 1, "paged once");
    sim.shutdown().await;
}

/// A state file that cannot be read is moved aside (kept for a post-mortem)
/// and the daemon starts with empty state, then writes a valid file.
#[tokio::test(start_paused = true)]
async fn a_corrupt_alert_state_file_is_moved_aside() {
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        fleet(&overlay)
            .app(SimApp::new("agents").machine(SimMachine::new("m1").loaded(overlay.behind(1)))),
    )
    .await
    .unwrap();
    let hook = Hook::start().await;
    // The default: beside overlay.mirror_dir.
    let state = overlay.dir.path().join("alert-state.json");
    std::fs::write(&state, "{\"version\": 1, \"sinks\": [tr").unwrap();

    let run = Service::start(&sim, &overlay, &hook);
    eventually("m1 paged", Duration::from_secs(15), async || {
        !hook.of("drift_detected", "m1").is_empty()
    })
    .await;
    run.sweeps_after(2).await;
    run.stop().await;

    let aside: Vec<_> = std::fs::read_dir(overlay.dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("alert-state.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "moved aside: {aside:?}");
    assert_eq!(
        std::fs::read_to_string(overlay.dir.path().join(&aside[0])).unwrap(),
        "{\"version\": 1, \"sinks\": [tr"
    );
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(saved["version"], 1);
    sim.shutdown().await;
}

//! `fleet-reconciler run` end to end: the real binary against the simulator,
//! a real overlay repository and a local webhook receiver; the operator CLI;
//! SIGTERM; and a trace-level log that must not contain any secret.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use fleet_reconciler::metadata::{HOLD_KEY, MARKER_KEY};
use fleet_reconciler::sim::{Behaviour, Sim, SimApp, SimFleet, SimMachine};

use crate::common::{ChildGuard, ConfigToml, OverlayRepo, WithSecrets, eventually, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
const FLY_TOKEN: &str = "fly-secret-token-e2e";
const ADMIN_TOKEN: &str = "admin-secret-token-e2e";
const HOOK_PATH: &str = "/hooks/T000/B000/secret-hook-path";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_remediates_serves_and_stops_cleanly_without_leaking_secrets() {
    let overlay = OverlayRepo::new();
    let (dir, repo_path) = (&overlay.dir, &overlay.repo_path);
    let (tip, old) = (overlay.tip(), overlay.behind(1));

    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN)
            .release_tip(tip.clone())
            .restart_delay(Duration::from_millis(200))
            .app(
                SimApp::new("agents")
                    .machine(SimMachine::new("m1").loaded(old.clone()))
                    .machine(SimMachine::new("m2").loaded(tip.clone()))
                    .machine(
                        SimMachine::new("busy")
                            .loaded(old.clone())
                            .behaviour(Behaviour::BusyFor(Duration::from_secs(3600))),
                    ),
            )
            .app(SimApp::new("fleet-reconciler").machine(SimMachine::new("coord0").stopped())),
    )
    .await
    .unwrap();

    // A webhook receiver whose URL is a secret.
    let received = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = received.clone();
    let app = Router::new().route(
        HOOK_PATH,
        post(move |body: String| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().push(body);
                "ok"
            }
        }),
    );
    let hook = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_url = format!(
        "http://{}{HOOK_PATH}?token=hook-query-secret",
        hook.local_addr().unwrap()
    );
    tokio::spawn(async move { axum::serve(hook, app).await.unwrap() });

    let port = free_port();
    let config_path = ConfigToml::new(&sim.api_url(), repo_path, dir.path().join("mirror.git"))
        .overlay("fetch_interval = \"1s\"")
        .app("agents", Some(&sim.health_url_template()))
        .with(&format!(
            r#"
[sweep]
interval = "300ms"
[probe]
timeout = "1s"
[pools.default]
max_concurrent_rotations = 2
actions = {{ low = "alert-and-wait", medium = "alert-and-wait", high = "alert-and-wait", critical = "manual" }}
[rotation]
min_drift_age = "0s"
coordinator = "fleet-reconciler/coord0"
[[alerts.webhooks]]
url_env = "E2E_WEBHOOK_URL"
format = "json"
secret_env = "E2E_WEBHOOK_SECRET"
[server]
listen = "127.0.0.1:{port}"
admin_token_env = "E2E_ADMIN_TOKEN"
"#
        ))
        .write(dir.path().join("fleet-reconciler.toml"));

    let mut child = ChildGuard(
        Command::new(BIN)
            .arg("run")
            .arg("--config")
            .arg(&config_path)
            .with_secrets(FLY_TOKEN)
            .env("E2E_ADMIN_TOKEN", ADMIN_TOKEN)
            .env("E2E_WEBHOOK_URL", &hook_url)
            .env("E2E_WEBHOOK_SECRET", "hmac-secret-e2e")
            .env("RUST_LOG", "trace")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Drain stderr continuously so the child never blocks on a full pipe.
    let log = child.drain_stderr();

    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    eventually("ready", Duration::from_secs(30), async || {
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;

    // m1 (idle) converges; busy is waited for (cordoned, never restarted).
    eventually("m1 on tip", Duration::from_secs(30), async || {
        sim.machine("m1").is_some_and(|m| {
            m.loaded_ref == tip && !m.cordoned && !m.metadata.contains_key(MARKER_KEY)
        })
    })
    .await;
    let busy = sim.machine("busy").unwrap();
    assert_eq!(busy.restart_count, 0);

    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("fleet_reconciler_overlay_coherence_ratio{fly_app=\"agents\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("fleet_reconciler_actions_total"),
        "{metrics}"
    );
    let fleet: serde_json::Value = http
        .get(format!("{base}/api/v1/fleet"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(fleet["tip"]["commit"], tip.as_str());
    let page = http.get(&base).send().await.unwrap().text().await.unwrap();
    assert!(
        page.contains("busy"),
        "status page lists the drifted machine"
    );

    // Admin API: refused without the token, accepted with it.
    let r = http
        .post(format!("{base}/api/v1/machines/m2/hold"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .post(format!("{base}/api/v1/machines/m2/hold"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .post(format!("{base}/api/v1/machines/m2/hold"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{:?}", r.text().await);
    assert!(sim.machine("m2").unwrap().metadata.contains_key(HOLD_KEY));

    // The operator CLI talks to Fly directly with the same config.
    let cli = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .arg("--config")
            .arg(&config_path)
            .with_secrets(FLY_TOKEN)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = cli(&["release", "m2"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(!sim.machine("m2").unwrap().metadata.contains_key(HOLD_KEY));
    let (code, out, err) = cli(&["hold", "busy", "--reason", "debugging"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        sim.machine("busy")
            .unwrap()
            .metadata
            .get(HOLD_KEY)
            .is_some_and(|v| v.contains("debugging"))
    );
    let (code, _, err) = cli(&["hold", "nope"]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("machine nope is not in any configured app"),
        "{err}"
    );
    let (code, out, _) = cli(&["status", "--url", &base]);
    assert_eq!(code, Some(1), "busy still drifts: {out}");
    assert!(out.contains("busy") && out.contains("drifted"), "{out}");
    // One machine: its detail and why it has its severity.
    let (code, out, err) = cli(&["status", "busy", "--url", &base]);
    assert_eq!(code, Some(1), "busy drifts: {out}{err}");
    for expected in [
        "machine:  busy",
        "app:      agents",
        "status:   drifted",
        "behind:   1, ahead 0",
        "severity: low",
        "action:   alert-and-wait",
        "reason:\n  no rule matched: the default level, low",
        "  missing: 1 commit(s), newest 1 shown:",
        &format!("    {} ", &tip[..12]),
    ] {
        assert!(out.contains(expected), "{expected:?} in\n{out}");
    }
    let (code, out, err) = cli(&["status", "busy", "--url", &base, "--output", "json"]);
    assert_eq!(code, Some(1), "{out}{err}");
    let detail: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(detail["machine"]["machine_id"], "busy");
    assert_eq!(detail["machine"]["reason"]["behind"], 1);
    assert_eq!(
        detail["machine"]["reason"]["missing"][0]["commit"],
        tip.as_str()
    );
    assert_eq!(detail["tip"], tip.as_str());
    let (code, out, err) = cli(&["status", "m2", "--url", &base]);
    assert_eq!(code, Some(0), "m2 is on the tip: {out}{err}");
    assert!(!out.contains("reason:"), "{out}");
    let (code, out, err) = cli(&["status", "nope", "--url", &base]);
    assert_eq!(code, Some(2), "{out}");
    assert!(
        err.contains("machine nope is not known to the daemon"),
        "{err}"
    );

    // A webhook arrived (drift of busy), signed.
    eventually("webhook delivered", Duration::from_secs(15), async || {
        !received.lock().unwrap().is_empty()
    })
    .await;
    assert!(
        received
            .lock()
            .unwrap()
            .iter()
            .any(|b| b.contains("drift_detected"))
    );
    eventually("delivery counted", Duration::from_secs(10), async || {
        let m = http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        m.lines().any(|l| {
            l.starts_with("fleet_reconciler_webhook_deliveries_total{")
                && l.contains("result=\"delivered\"")
                && !l.ends_with(" 0")
        })
    })
    .await;

    // SIGTERM: clean exit, no lease left behind.
    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "exit status {status}");
    for id in ["m1", "m2", "busy"] {
        assert!(
            sim.machine(id).unwrap().lease.is_none(),
            "{id} lease left behind"
        );
    }

    // A full trace-level log: no Fly token, admin token, webhook URL or its secrets.
    let log = log.join().unwrap();
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "trace logging was on"
    );
    for secret in [
        FLY_TOKEN,
        ADMIN_TOKEN,
        HOOK_PATH,
        "hook-query-secret",
        "hmac-secret-e2e",
        &hook_url,
    ] {
        assert!(!log.contains(secret), "log contains {secret}");
    }
    for body in received.lock().unwrap().iter() {
        assert!(
            !body.contains(HOOK_PATH) && !body.contains(FLY_TOKEN),
            "payload leaks a secret: {body}"
        );
    }
    sim.shutdown().await;
}

/// Issue 10, item 4 through the real binary: `run` pages, stops on SIGTERM,
/// the agent reaches the tip meanwhile, and the second `run` resolves the
/// alert from the state file it finds beside the mirror, without paging
/// again what still drifts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_run_resolves_what_the_first_paged_and_pages_nothing_again() {
    let overlay = OverlayRepo::new();
    let (tip, old) = (overlay.tip(), overlay.behind(1));
    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN).release_tip(tip.clone()).app(
            SimApp::new("agents")
                .machine(SimMachine::new("m1").loaded(old.clone()))
                .machine(SimMachine::new("m2").loaded(old.clone())),
        ),
    )
    .await
    .unwrap();
    let received = Arc::new(Mutex::new(Vec::<serde_json::Value>::new()));
    let sink = received.clone();
    let app = Router::new().route(
        "/hook",
        post(move |body: String| {
            let sink = sink.clone();
            async move {
                sink.lock()
                    .unwrap()
                    .push(serde_json::from_str(&body).unwrap());
                "ok"
            }
        }),
    );
    let hook = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_url = format!("http://{}/hook", hook.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(hook, app).await.unwrap() });
    let count = |event: &str, machine: &str| {
        received
            .lock()
            .unwrap()
            .iter()
            .filter(|b| b["event"] == event && b["machine_id"] == machine)
            .count()
    };

    let config_path = overlay
        .config(&sim.api_url(), "data/overlay.git")
        .app("agents", Some(&sim.health_url_template()))
        .with(&format!(
            r#"
[sweep]
interval = "200ms"
[pools.default]
actions = {{ low = "observe", medium = "observe", high = "observe", critical = "observe" }}
[rotation]
min_drift_age = "0s"
# Per machine, as this test counts (#20: grouped by default).
[alerts]
group_by = ["machine"]
[[alerts.webhooks]]
url_env = "E2E_WEBHOOK_URL"
format = "json"
secret_env = "E2E_WEBHOOK_SECRET"
[server]
listen = "127.0.0.1:{port}"
"#,
            port = free_port(),
        ))
        .write(overlay.dir.path().join("fleet-reconciler.toml"));
    let start = || {
        ChildGuard(
            Command::new(BIN)
                .arg("run")
                .arg("--config")
                .arg(&config_path)
                .with_secrets(FLY_TOKEN)
                .env("E2E_WEBHOOK_URL", &hook_url)
                .env("E2E_WEBHOOK_SECRET", "hmac-secret-e2e")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let stop = async |mut child: ChildGuard| {
        let pid = child.0.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let start = std::time::Instant::now();
        loop {
            if let Some(s) = child.0.try_wait().unwrap() {
                assert!(s.success(), "exit status {s}");
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "did not stop on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };

    let first = start();
    eventually("m1 and m2 paged", Duration::from_secs(30), async || {
        count("drift_detected", "m1") == 1 && count("drift_detected", "m2") == 1
    })
    .await;
    stop(first).await;

    sim.set_loaded_ref("m1", &tip);
    let second = start();
    eventually("m1 resolved", Duration::from_secs(30), async || {
        count("drift_resolved", "m1") == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop(second).await;
    assert_eq!(
        count("drift_detected", "m2"),
        1,
        "m2 paged again after the restart"
    );
    assert_eq!(count("drift_detected", "m1"), 1);
    assert_eq!(count("drift_resolved", "m2"), 0);
    // The state file: beside the mirror, private, no secret in it.
    let state = overlay.dir.path().join("data/alert-state.json");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let text = std::fs::read_to_string(&state).unwrap();
    assert!(!text.contains("hmac-secret-e2e") && !text.contains(&hook_url));
    sim.shutdown().await;
}

/// A new commit on the overlay's release branch (same tree), as a release.
fn release_a_new_tip(repo_path: &std::path::Path) -> String {
    let repo = git2::Repository::open_bare(repo_path).unwrap();
    let parent = repo
        .find_reference("refs/heads/release")
        .unwrap()
        .peel_to_commit()
        .unwrap();
    let sig = git2::Signature::new(
        "Overlay Bot",
        "overlay@example.com",
        &git2::Time::new(1_900_000_000, 0),
    )
    .unwrap();
    let tree = parent.tree().unwrap();
    repo.commit(
        Some("refs/heads/release"),
        &sig,
        &sig,
        "A new release",
        &tree,
        &[&parent],
    )
    .unwrap()
    .to_string()
}

/// The value of an unlabelled sample (or the first sample) of `name`.
fn sample(metrics: &str, name: &str) -> Option<String> {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .map(|l| l.rsplit(' ').next().unwrap_or_default().to_owned())
}

/// #22: the sweep at a new tip takes a while (here an agent that never
/// answers holds each sweep for its probe timeout); from the moment the
/// daemon has fetched the new tip until that sweep ends, `GET /api/v1/fleet`
/// and `/metrics` answer at once with the previous sweep's figures, never
/// an empty or partial document, and then with the new tip's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_the_previous_sweeps_figures_while_a_new_tip_is_swept() {
    let overlay = OverlayRepo::new();
    let (dir, repo_path) = (&overlay.dir, &overlay.repo_path);
    let old_tip = overlay.tip();
    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN).release_tip(old_tip.clone()).app(
            SimApp::new("agents")
                .machine(SimMachine::new("m1").loaded(old_tip.clone()))
                .machine(SimMachine::new("m2").loaded(old_tip.clone()))
                .machine(SimMachine::new("slow").behaviour(Behaviour::Hang)),
        ),
    )
    .await
    .unwrap();
    let port = free_port();
    let config_path = ConfigToml::new(&sim.api_url(), repo_path, dir.path().join("mirror.git"))
        .overlay("fetch_interval = \"200ms\"")
        .app("agents", Some(&sim.health_url_template()))
        .with(&format!(
            r#"
[sweep]
interval = "200ms"
[probe]
timeout = "4s"
[pools.default]
actions = {{ low = "observe", medium = "observe", high = "observe", critical = "observe" }}
[server]
listen = "127.0.0.1:{port}"
"#
        ))
        .write(dir.path().join("fleet-reconciler.toml"));
    let mut child = ChildGuard(
        Command::new(BIN)
            .arg("run")
            .arg("--config")
            .arg(&config_path)
            .with_secrets(FLY_TOKEN)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // The log, line by line as it comes: it says when the new tip is fetched.
    let log = Arc::new(Mutex::new(String::new()));
    let mut stderr = child.0.stderr.take().unwrap();
    let sink = log.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });

    let base = format!("http://127.0.0.1:{port}");
    // Each answer must come well within one held sweep (4 s): a server that
    // waited for the sweep would time out here.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let fleet = async || -> serde_json::Value {
        http.get(format!("{base}/api/v1/fleet"))
            .send()
            .await
            .expect("GET /api/v1/fleet answers while a sweep runs")
            .json()
            .await
            .unwrap()
    };
    let metrics = async || -> String {
        http.get(format!("{base}/metrics"))
            .send()
            .await
            .expect("GET /metrics answers while a sweep runs")
            .text()
            .await
            .unwrap()
    };
    let first = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let answer = http.get(format!("{base}/api/v1/fleet")).send().await;
        if answer.as_ref().is_ok_and(|r| r.status() == 200) {
            break;
        }
        assert!(
            std::time::Instant::now() < first,
            "no first sweep: {answer:?}\n{}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = fleet().await;
    assert_eq!(before["tip"]["commit"], old_tip.as_str(), "{before}");
    let statuses = |doc: &serde_json::Value| -> Vec<(String, String)> {
        doc["machines"]
            .as_array()
            .map(|rows| {
                rows.iter()
                    .map(|m| {
                        (
                            m["machine_id"].as_str().unwrap_or_default().to_owned(),
                            m["status"].as_str().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let previous = statuses(&before);
    assert_eq!(
        previous,
        [
            ("m1".to_owned(), "on_tip".to_owned()),
            ("m2".to_owned(), "on_tip".to_owned()),
            ("slow".to_owned(), "unreachable".to_owned()),
        ]
    );
    let previous_metrics = metrics().await;
    let coherence = sample(
        &previous_metrics,
        "fleet_reconciler_fleet_overlay_coherence_ratio",
    );
    assert!(coherence.is_some(), "{previous_metrics}");

    let new_tip = release_a_new_tip(repo_path);
    let mut seen_after_fetch = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let after = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the new tip's sweep never ended"
        );
        // Whether the daemon had fetched the new tip (its INFO line names
        // it) before these two answers.
        let had_new_tip = log.lock().unwrap().contains(&new_tip);
        let doc = fleet().await;
        let text = metrics().await;
        if doc["tip"]["commit"] == new_tip.as_str() {
            break doc;
        }
        assert_eq!(doc["tip"]["commit"], old_tip.as_str(), "{doc}");
        assert_eq!(statuses(&doc), previous, "{doc}");
        assert_eq!(doc["coherence"], before["coherence"], "{doc}");
        let shown_tip = text
            .lines()
            .find(|l| l.starts_with("fleet_reconciler_overlay_tip_info{"))
            .unwrap_or_default();
        // The metrics of the same moment may already be the new sweep's.
        if !shown_tip.contains(&new_tip) {
            assert!(shown_tip.contains(&old_tip), "{text}");
            assert_eq!(
                sample(&text, "fleet_reconciler_fleet_overlay_coherence_ratio"),
                coherence,
                "{text}"
            );
            if had_new_tip {
                seen_after_fetch += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        seen_after_fetch > 0,
        "no answer came while the new tip was being swept: {}",
        log.lock().unwrap()
    );
    assert_eq!(
        after["machines"].as_array().map(Vec::len),
        Some(3),
        "{after}"
    );
    assert!(
        statuses(&after)
            .iter()
            .any(|(id, status)| id == "m1" && status == "drifted"),
        "{after}"
    );
    drop(child);
}

/// Issue 33, "a missing key (first start)": `run` with a pool that acts and
/// no record key refuses to start (exit 2), naming the variable and its
/// config key, before it writes anything; a value that is no key is refused
/// the same way. (An observe-only config needs none: preflight's unit test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_without_a_record_key_refuses_to_start_naming_the_variable() {
    let overlay = OverlayRepo::new();
    let (dir, repo_path) = (&overlay.dir, &overlay.repo_path);
    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN)
            .release_tip(overlay.tip())
            .app(SimApp::new("agents").machine(SimMachine::new("m1").loaded(overlay.behind(1))))
            .app(SimApp::new("fleet-reconciler").machine(SimMachine::new("coord0").stopped())),
    )
    .await
    .unwrap();
    let port = free_port();
    let config_path = ConfigToml::new(&sim.api_url(), repo_path, dir.path().join("mirror.git"))
        .app("agents", Some(&sim.health_url_template()))
        .with(&format!(
            r#"
[pools.default]
actions = {{ low = "restart", medium = "restart", high = "restart", critical = "restart" }}
[rotation]
min_drift_age = "0s"
coordinator = "fleet-reconciler/coord0"
[server]
listen = "127.0.0.1:{port}"
"#
        ))
        .write(dir.path().join("fleet-reconciler.toml"));
    for (key, named) in [(None, "is not set"), (Some("abcd"), "at least 32 bytes")] {
        let mut cmd = Command::new(BIN);
        cmd.arg("run")
            .arg("--config")
            .arg(&config_path)
            .env("FLEET_RECONCILER_FLY_TOKEN", FLY_TOKEN)
            .env_remove("FLEET_RECONCILER_RECORD_KEY")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(k) = key {
            cmd.env("FLEET_RECONCILER_RECORD_KEY", k);
        }
        let mut child = ChildGuard(cmd.spawn().unwrap());
        let log = child.drain_stderr();
        eventually("run exits", Duration::from_secs(30), async || {
            child.0.try_wait().unwrap().is_some()
        })
        .await;
        let code = child.0.try_wait().unwrap().and_then(|s| s.code());
        let stderr = log.join().unwrap();
        assert_eq!(code, Some(2), "{key:?}: {stderr}");
        assert!(
            stderr.contains("FLEET_RECONCILER_RECORD_KEY")
                && stderr.contains("records.key_env")
                && stderr.contains(named),
            "{key:?}: {stderr}"
        );
    }
    let m1 = sim.machine("m1").unwrap();
    assert_eq!(m1.restart_count, 0);
    assert!(!m1.metadata.contains_key(MARKER_KEY), "{:?}", m1.metadata);
    sim.shutdown().await;
}

//! `/readyz` while the coordinator cannot be read (issue 34 item 2): the
//! real binary against the simulator with a `rotation.coordinator` that Fly
//! does not have. Sweeps succeed, but nothing can rotate: not ready, with
//! the reason, one WARN line (not one per sweep), and `coordinator_unreadable`.

use std::process::{Command, Stdio};
use std::time::Duration;

use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};

use crate::common::{ChildGuard, ConfigToml, OverlayRepo, WithSecrets, eventually, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
const FLY_TOKEN: &str = "fly-token-readyz";

async fn successful_sweeps(base: &str) -> u64 {
    let Ok(r) = reqwest::get(format!("{base}/metrics")).await else {
        return 0;
    };
    r.text()
        .await
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("fleet_reconciler_sweeps_total{result=\"success\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_not_ready_while_the_coordinator_cannot_be_read() {
    let overlay = OverlayRepo::new();
    let (tip, old) = (overlay.tip(), overlay.behind(1));
    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN)
            .release_tip(tip.clone())
            .app(
                SimApp::new("agents")
                    .machine(SimMachine::new("m1").loaded(old))
                    .machine(SimMachine::new("m2").loaded(tip)),
            )
            .app(SimApp::new("fleet-reconciler").machine(SimMachine::new("coord0").stopped())),
    )
    .await
    .unwrap();
    let port = free_port();
    let config_path = ConfigToml::new(
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
actions = {{ low = "alert-and-wait", medium = "alert-and-wait", high = "alert-and-wait", critical = "manual" }}
[rotation]
min_drift_age = "0s"
# Not a machine Fly has: its slot set cannot be read.
coordinator = "fleet-reconciler/gone0"
[server]
listen = "127.0.0.1:{port}"
"#
    ))
    .write(overlay.dir.path().join("fleet-reconciler.toml"));
    let mut child = ChildGuard(
        Command::new(BIN)
            .args(["run", "--config"])
            .arg(&config_path)
            .with_secrets(FLY_TOKEN)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let log = child.drain_stderr();
    let base = format!("http://127.0.0.1:{port}");
    // Enough successful sweeps for the alert's grace (3 intervals) to pass.
    eventually("6 successful sweeps", Duration::from_secs(60), async || {
        successful_sweeps(&base).await >= 6
    })
    .await;

    let r = reqwest::get(format!("{base}/readyz")).await.unwrap();
    let status = r.status();
    let body = r.text().await.unwrap();
    assert_eq!(
        status, 503,
        "ready while the coordinator is unreadable: {body}"
    );
    assert!(
        body.contains("coordinator") && body.contains("gone0"),
        "the reason names the coordinator: {body}"
    );
    // Liveness is another matter: the loop runs.
    let r = reqwest::get(format!("{base}/healthz")).await.unwrap();
    assert_eq!(r.status(), 200);

    // The alert fires (the notifier logs it as it starts firing).
    eventually(
        "coordinator_unreadable fires",
        Duration::from_secs(60),
        async || successful_sweeps(&base).await >= 10,
    )
    .await;
    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let _ = child.0.wait();
    let log = log.join().unwrap();
    assert!(
        log.contains("coordinator_unreadable"),
        "the alert fired: {log}"
    );
    let warns: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("slot set cannot be read"))
        .collect();
    assert_eq!(
        warns.len(),
        1,
        "one WARN line when the coordinator became unreadable, not one per sweep: {warns:#?}"
    );
    sim.shutdown().await;
}

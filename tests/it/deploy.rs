//! The Fly app as `fly.toml` describes it: the config the image ships, run by
//! the real binary, serves what Fly's checks and Prometheus scrape, on the
//! port `fly.toml` names.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use fleet_reconciler::config::Config;
use fleet_reconciler::demo::DemoRepo;
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};

use crate::common::{ChildGuard, WithSecrets, eventually, free_port};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
const TOKEN: &str = "deploy-test-fly-token";
const IMAGE_CONFIG: &str = "/etc/fleet-reconciler/fleet-reconciler.toml";

fn fly_toml() -> toml::Table {
    let text = std::fs::read_to_string(Path::new(ROOT).join("fly.toml")).unwrap();
    text.parse().expect("fly.toml parses as TOML")
}

/// The config the image ships: fly.toml's FLEET_CONFIG build arg.
fn shipped_config_path(fly: &toml::Table) -> PathBuf {
    let rel = fly["build"]["args"]["FLEET_CONFIG"]
        .as_str()
        .expect("fly.toml [build.args] FLEET_CONFIG");
    Path::new(ROOT).join(rel)
}

fn int(v: &toml::Value) -> i64 {
    v.as_integer().expect("an integer")
}

#[test]
fn fly_toml_matches_the_config_the_image_ships() {
    let fly = fly_toml();
    let path = shipped_config_path(&fly);
    let config = Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let port = i64::from(config.server.listen.port());

    assert_eq!(int(&fly["metrics"]["port"]), port, "[metrics] port");
    assert_eq!(fly["metrics"]["path"].as_str(), Some("/metrics"));
    let checks = fly["checks"].as_table().expect("[checks]");
    assert!(!checks.is_empty());
    for (name, check) in checks {
        assert_eq!(int(&check["port"]), port, "[checks.{name}] port");
    }
    assert!(
        checks
            .values()
            .any(|c| c["path"].as_str() == Some("/healthz")),
        "a check on /healthz"
    );
    // Reachable over 6PN: the wildcard, not loopback.
    assert!(
        config.server.listen.ip().is_unspecified(),
        "server.listen must not be loopback"
    );
    // Internal only: nothing for Fly's proxy to publish.
    assert!(!fly.contains_key("http_service"));
    if let Some(services) = fly.get("services").and_then(|s| s.as_array()) {
        assert!(services.iter().all(|s| s.get("ports").is_none()));
    }
    // The mirror lives on the volume.
    let mount = fly["mounts"]["destination"].as_str().unwrap();
    assert!(config.overlay.mirror_dir.starts_with(mount), "{mount}");
    assert!(
        fly["restart"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["policy"].as_str() == Some("always"))
    );
    // The Dockerfile installs the config where its CMD reads it.
    let dockerfile = std::fs::read_to_string(Path::new(ROOT).join("Dockerfile")).unwrap();
    assert!(dockerfile.contains(&format!("COPY ${{FLEET_CONFIG}} {IMAGE_CONFIG}")));
    assert!(dockerfile.contains(&format!(r#"CMD ["run", "--config", "{IMAGE_CONFIG}"]"#)));
    assert!(dockerfile.contains(&format!("EXPOSE {port}")));
}

async fn get(client: &reqwest::Client, url: &str) -> Option<(u16, String)> {
    let resp = client.get(url).send().await.ok()?;
    let status = resp.status().as_u16();
    Some((status, resp.text().await.unwrap_or_default()))
}

/// `run` with the shipped config (apps, repository and API swapped for a
/// simulated fleet, webhooks dropped) answers the paths of fly.toml's checks
/// and [metrics].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_config_serves_fly_checks_and_metrics() {
    let fly = fly_toml();
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("overlay.git");
    let history = DemoRepo::create(&repo).unwrap().build_history().unwrap();
    let tip = history.release.last().unwrap().to_string();
    let sim = Sim::start(
        SimFleet::new(TOKEN)
            .release_tip(tip.clone())
            .app(
                SimApp::new("agents-prod")
                    .machine(SimMachine::new("m1").loaded(tip.clone()))
                    .machine(SimMachine::new("m2").loaded(tip.clone())),
            )
            .app(SimApp::new("fleet-reconciler").machine(SimMachine::new("coord0").stopped())),
    )
    .await
    .unwrap();

    let mut config: toml::Table = std::fs::read_to_string(shipped_config_path(&fly))
        .unwrap()
        .parse()
        .unwrap();
    let port = free_port();
    config["fly"]["api_url"] = sim.api_url().into();
    config["overlay"]["repo"] = repo.display().to_string().into();
    config["overlay"]["mirror_dir"] = dir
        .path()
        .join("data/overlay.git")
        .display()
        .to_string()
        .into();
    config["sweep"]["interval"] = "1s".into();
    // docs/deploy.md: the operator names the coordination machine they created.
    config["rotation"]
        .as_table_mut()
        .unwrap()
        .insert("coordinator".into(), "fleet-reconciler/coord0".into());
    config["server"]["listen"] = format!("127.0.0.1:{port}").into();
    config.insert(
        "apps".into(),
        toml::Value::Array(vec![toml::Value::Table(toml::toml! {
            name = "agents-prod"
            pool_key = "pool"
        })]),
    );
    config["apps"][0]
        .as_table_mut()
        .unwrap()
        .insert("health_url".into(), sim.health_url_template().into());
    if let Some(alerts) = config.get_mut("alerts").and_then(|a| a.as_table_mut()) {
        alerts.remove("webhooks");
    }
    let path = dir.path().join("fleet-reconciler.toml");
    std::fs::write(&path, toml::to_string(&config).unwrap()).unwrap();

    let mut cmd = Command::new(BIN);
    cmd.arg("run")
        .arg("--config")
        .arg(&path)
        .with_secrets(TOKEN)
        .env("FLEET_ADMIN_TOKEN", "deploy-test-admin-token")
        .env_remove("OVERLAY_GIT_TOKEN")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let _daemon = ChildGuard(cmd.spawn().expect("spawn fleet-reconciler run"));

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    // Ready = a sweep succeeded; then every path Fly uses answers.
    eventually(
        &format!("the daemon ready on {base}"),
        Duration::from_secs(60),
        async || {
            matches!(
                get(&client, &format!("{base}/readyz")).await,
                Some((200, _))
            )
        },
    )
    .await;
    for check in fly["checks"].as_table().unwrap().values() {
        let path = check["path"].as_str().unwrap();
        let (status, _) = get(&client, &format!("{base}{path}"))
            .await
            .expect("check answered");
        assert_eq!(status, 200, "fly.toml check {path}");
    }
    let metrics_path = fly["metrics"]["path"].as_str().unwrap();
    let (status, body) = get(&client, &format!("{base}{metrics_path}"))
        .await
        .expect("metrics answered");
    assert_eq!(status, 200);
    assert!(
        body.contains(r#"fleet_reconciler_overlay_coherence_ratio{fly_app="agents-prod"} 1"#),
        "{body}"
    );
    for name in [
        "fleet_reconciler_machines",
        "fleet_reconciler_sweep_duration_seconds_bucket",
        "fleet_reconciler_last_sweep_success_timestamp_seconds",
        "fleet_reconciler_overlay_tip_age_seconds",
    ] {
        assert!(body.contains(name), "{name} missing from /metrics");
    }
    sim.shutdown().await;
}

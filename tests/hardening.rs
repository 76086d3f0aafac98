//! Hostile environments and peers (issue 10, first slice): what the daemon
//! sends where, and what it keeps of what it is sent.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};

mod common;

use common::OverlayRepo;

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
const TOKEN: &str = "hardening-test-token";

/// A "proxy" on loopback that counts the connections it is offered and
/// answers none of them.
async fn counting_listener() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            drop(socket);
        }
    });
    (url, count)
}

/// Before: reqwest honoured `HTTP(S)_PROXY`/`ALL_PROXY`, so the Fly token
/// went to whatever proxy the environment named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_goes_through_a_proxy_from_the_environment() {
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        SimFleet::new(TOKEN)
            .release_tip(overlay.tip())
            .app(SimApp::new("app").machine(SimMachine::new("m1").loaded(overlay.tip()))),
    )
    .await
    .unwrap();
    let (proxy, offered) = counting_listener().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(
        &config,
        format!(
            "[fly]\napi_url = \"{}\"\n[overlay]\nrepo = \"{}\"\nbranch = \"release\"\nmirror_dir = \"{}\"\n[[apps]]\nname = \"app\"\nhealth_url = \"{}\"\n",
            sim.api_url(),
            overlay.repo_path.display(),
            dir.path().join("mirror.git").display(),
            sim.health_url_template(),
        ),
    )
    .unwrap();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BIN)
            .args(["check", "--config"])
            .arg(&config)
            .env("FLY_API_TOKEN", TOKEN)
            .env("HTTP_PROXY", &proxy)
            .env("HTTPS_PROXY", &proxy)
            .env("ALL_PROXY", &proxy)
            .env("http_proxy", &proxy)
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        offered.load(Ordering::SeqCst),
        0,
        "a request went to the environment's proxy"
    );
    sim.shutdown().await;
}

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
        SimFleet::new(TOKEN).release_tip(overlay.tip()).app(
            SimApp::new("agents")
                .machine(SimMachine::new("m1").loaded(overlay.behind(1)))
                .machine(SimMachine::new("m2")),
        ),
    )
    .await
    .unwrap();
    let text = format!(
        r#"
[fly]
api_url = "{api}"
[overlay]
repo = "{repo}"
branch = "release"
mirror_dir = "{mirror}"
fetch_interval = "50ms"
[sweep]
interval = "50ms"
[[apps]]
name = "agents"
health_url = "{health}"
[pools.default]
actions = {{ low = "observe", medium = "observe", high = "observe", critical = "observe" }}
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
        ..ServiceSecrets::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_url = format!("http://{}/metrics", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let task = tokio::spawn(service::run(
        config,
        secrets,
        listener,
        "t".into(),
        stop.clone(),
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
    while gauge(&scrape().await, "fleet_overlay_commits_behind", m1) != Some(1.0) {
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
        let behind = gauge(&text, "fleet_overlay_commits_behind", m1);
        let coherence = gauge(&text, "fleet_overlay_coherence_ratio", "app=\"agents\"");
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

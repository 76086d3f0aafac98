//! The Alertmanager sink (`[[alerts.alertmanager]]`, #20 item 3) against a
//! loopback receiver speaking Alertmanager's `POST /api/v2/alerts`: the
//! labels and annotations Prometheus would send, every firing alert re-sent
//! with every update, `endsAt` on resolve, retried through an outage, and
//! carried over a restart by the alert state file. Plus the `demo
//! --alertmanager` flag, end to end with the real binary.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use chrono::{DateTime, TimeZone, Utc};
use fleet_reconciler::config::{AlertmanagerConfig, AlertsConfig, PublicUrl};
use fleet_reconciler::decide::alerts::{Alert, AlertKind};
use fleet_reconciler::model::{CommitId, Severity};
use fleet_reconciler::report::notify::{
    Notifier, NotifierOptions, Seen, alertmanager_urls_from_env,
};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::common::{ChildGuard, eventually, free_port};

const WAIT: Duration = Duration::from_secs(15 * 60);
const TIP: &str = "0123456789abcdef0123456789abcdef01234567";

/// An Alertmanager stand-in: records each post to `/api/v2/alerts` (a JSON
/// array of alerts); answers `fail` instead while it is non-zero.
struct Am {
    base: String,
    posts: Arc<Mutex<Vec<Vec<Value>>>>,
    fail: Arc<AtomicU16>,
}

impl Am {
    async fn start() -> Am {
        let posts = Arc::new(Mutex::new(Vec::new()));
        let fail = Arc::new(AtomicU16::new(0));
        let (sink, status) = (posts.clone(), fail.clone());
        let app = Router::new().route(
            "/api/v2/alerts",
            post(move |body: String| {
                let (sink, status) = (sink.clone(), status.clone());
                async move {
                    let code = status.load(Ordering::SeqCst);
                    if code != 0 {
                        return axum::http::StatusCode::from_u16(code).unwrap();
                    }
                    let alerts: Vec<Value> = serde_json::from_str(&body).unwrap();
                    sink.lock().unwrap().push(alerts);
                    axum::http::StatusCode::OK
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Am { base, posts, fail }
    }

    fn posts(&self) -> Vec<Vec<Value>> {
        self.posts.lock().unwrap().clone()
    }

    async fn expect(&self, n: usize) -> Vec<Vec<Value>> {
        eventually(&format!("{n} posts"), WAIT, async || {
            self.posts().len() >= n
        })
        .await;
        self.posts()
    }
}

fn config() -> AlertsConfig {
    AlertsConfig {
        alertmanagers: vec![AlertmanagerConfig {
            url_env: "AM_URL".into(),
            min_severity: Severity::Low,
            labels: BTreeMap::from([("team".into(), "agent-platform".into())]),
        }],
        runbook_url: "https://runbooks.example/ops.md".into(),
        ..AlertsConfig::default()
    }
}

fn options(state: Option<&std::path::Path>) -> NotifierOptions {
    NotifierOptions {
        state_file: state.map(ToOwned::to_owned),
        save_interval: Duration::from_millis(20),
        public_url: Some(PublicUrl::parse("https://fleet.example.com/").unwrap()),
        ..NotifierOptions::default()
    }
}

struct Running {
    notifier: Notifier,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn start(am: &Am, state: Option<&std::path::Path>) -> Running {
        let notifier = Notifier::with_sinks(
            &config(),
            vec![],
            vec![am.base.clone().into()],
            options(state),
        )
        .unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (n, stop) = (notifier.clone(), stop.clone());
            async move { n.run(stop).await }
        });
        Running {
            notifier,
            stop,
            task,
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .unwrap()
            .unwrap();
    }
}

fn t(secs: i64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 5, 1, 12, 0, 0).unwrap() + chrono::Duration::seconds(secs)
}

fn drift(app: &str, machine: &str, severity: Severity) -> Alert {
    Alert {
        kind: AlertKind::Drift,
        app: Some(app.into()),
        machine_id: Some(machine.into()),
        commit: CommitId::parse(TIP),
        severity,
        summary: format!("{machine} in {app} runs an overlay 3 commit(s) behind the release tip"),
        details: BTreeMap::from([
            ("pool".into(), "dispatch".into()),
            ("region".into(), "iad".into()),
            ("commits_behind".into(), "3".into()),
        ]),
    }
}

fn sweep_failing() -> Alert {
    Alert {
        kind: AlertKind::SweepFailing,
        app: None,
        machine_id: None,
        commit: None,
        severity: Severity::Critical,
        summary: "Sweeps are failing (3 in a row)".into(),
        details: BTreeMap::new(),
    }
}

/// The alert of `post` whose `alertname` is `name`.
fn find<'a>(post: &'a [Value], name: &str) -> &'a Value {
    post.iter()
        .find(|a| a["labels"]["alertname"] == name)
        .unwrap_or_else(|| panic!("no {name} in {post:#?}"))
}

#[tokio::test(start_paused = true)]
async fn alerts_are_posted_as_prometheus_does_resent_while_firing_and_ended_on_resolve() {
    let am = Am::start().await;
    let n = Running::start(&am, None);
    let firing = [
        drift("agents", "m1", Severity::High),
        drift("agents", "m2", Severity::High),
        sweep_failing(),
    ];
    n.notifier.update(&firing, &[], t(0));
    let posts = am.expect(1).await;
    let first = &posts[0];
    assert_eq!(
        first.len(),
        2,
        "one grouped drift incident and sweep_failing: {first:#?}"
    );
    let d = find(first, "drift_detected");
    let labels: BTreeMap<String, String> = serde_json::from_value(d["labels"].clone()).unwrap();
    assert_eq!(
        labels,
        BTreeMap::from([
            ("alertname".into(), "drift_detected".into()),
            ("fly_app".into(), "agents".into()),
            ("service".into(), "fleet-reconciler".into()),
            ("severity".into(), "high".into()),
            ("team".into(), "agent-platform".into()),
            ("tip".into(), TIP.into()),
        ]),
        "identity only; the agents' app as fly_app, never `app`"
    );
    let summary = d["annotations"]["summary"].as_str().unwrap();
    assert!(
        summary.starts_with("2 machines of agents trail"),
        "{summary}"
    );
    assert_eq!(
        d["annotations"]["runbook_url"],
        "https://runbooks.example/ops.md#drift_detected"
    );
    assert!(
        d["annotations"]["description"]
            .as_str()
            .unwrap()
            .contains("machine_ids: m1, m2"),
        "{}",
        d["annotations"]["description"]
    );
    assert_eq!(d["generatorURL"], "https://fleet.example.com/");
    assert_eq!(d["startsAt"], "2026-05-01T12:00:00Z");
    assert_eq!(
        d["endsAt"], "2026-05-01T12:01:30Z",
        "a firing alert ends alerts.stale_after (90 s) after the view it is drawn from"
    );
    let s = find(first, "sweep_failing");
    assert_eq!(s["labels"]["severity"], "critical");
    assert!(s["labels"].get("fly_app").is_none());

    // Re-sent with every update (every sweep) while firing, startsAt unchanged.
    n.notifier.update(&firing, &[], t(30));
    am.expect(2).await;
    n.notifier.update(&firing, &[], t(60));
    let posts = am.expect(3).await;
    for p in &posts[1..] {
        assert_eq!(p.len(), 2);
        assert_eq!(
            find(p, "drift_detected")["startsAt"],
            "2026-05-01T12:00:00Z"
        );
    }

    // The sweeps recover: sweep_failing is posted once with endsAt, then not again.
    n.notifier.update(&firing[..2], &[], t(90));
    let posts = am.expect(4).await;
    let ended = find(&posts[3], "sweep_failing");
    assert_eq!(ended["endsAt"], "2026-05-01T12:01:30Z");
    assert_eq!(
        find(&posts[3], "drift_detected")["endsAt"],
        "2026-05-01T12:03:00Z",
        "moved ahead with every fresh view"
    );
    n.notifier.update(&firing[..2], &[], t(120));
    let posts = am.expect(5).await;
    assert_eq!(
        posts[4].len(),
        1,
        "the resolve was accepted: not sent again"
    );
    n.stop().await;
}

/// #37: Alertmanager lets the younger post win when it resolves
/// (`Alert.Merge`), so a post whose `endsAt` is not ahead of its own time
/// would end an alert another, fresher replica still asserts. A view exactly
/// `stale_after` old (90 s) says nothing of the app: the drift alert is not
/// posted with `endsAt` now, while the sweep's own `sweep_failing` is.
#[tokio::test(start_paused = true)]
async fn a_view_at_the_edge_of_stale_after_posts_no_ending_alert() {
    let am = Am::start().await;
    let n = Running::start(&am, None);
    let firing = [drift("agents", "m1", Severity::High), sweep_failing()];
    n.notifier.update(&firing, &[], t(0));
    am.expect(1).await;
    let seen = Seen {
        sweep: Some(t(0)),
        ..Seen::default()
    };
    n.notifier.update_seen(&firing, &[], t(90), &seen);
    let posts = am.expect(2).await;
    let last = &posts[1];
    assert!(
        last.iter()
            .all(|a| a["labels"]["alertname"] != "drift_detected"),
        "a drift alert from a view stale_after old was posted: {last:#?}"
    );
    assert_eq!(
        find(last, "sweep_failing")["labels"]["severity"],
        "critical"
    );
    n.stop().await;
}

/// An outage of Alertmanager: the post is retried, and a resolve owed
/// meanwhile is not lost.
#[tokio::test(start_paused = true)]
async fn a_resolve_is_retried_until_alertmanager_takes_it() {
    let am = Am::start().await;
    let n = Running::start(&am, None);
    n.notifier.update(&[sweep_failing()], &[], t(0));
    am.expect(1).await;
    am.fail.store(503, Ordering::SeqCst);
    n.notifier.update(&[], &[], t(30));
    tokio::time::sleep(Duration::from_secs(5 * 60)).await;
    assert_eq!(am.posts().len(), 1);
    am.fail.store(0, Ordering::SeqCst);
    let posts = am.expect(2).await;
    assert_eq!(posts[1].len(), 1);
    assert_eq!(posts[1][0]["endsAt"], "2026-05-01T12:00:30Z");
    let stats = n.notifier.alertmanager_stats();
    assert!(stats[0].failed_attempts >= 1, "{stats:?}");
    eventually("nothing owed", WAIT, async || {
        n.notifier.alertmanager_stats()[0].resolving == 0
    })
    .await;
    n.stop().await;
}

/// A restart keeps each alert's `startsAt` and ends what cleared while the
/// daemon was down, once `alerts.resolve_after` has passed.
#[tokio::test(start_paused = true)]
async fn the_sink_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("alert-state.json");
    let am = Am::start().await;
    let first = Running::start(&am, Some(&state));
    let a = drift("agents-a", "m1", Severity::High);
    let b = drift("agents-b", "m2", Severity::Low);
    first.notifier.update(&[a.clone(), b.clone()], &[], t(0));
    am.expect(1).await;
    first.stop().await;

    let second = Running::start(&am, Some(&state));
    second
        .notifier
        .update(std::slice::from_ref(&a), &[], t(300));
    let posts = am.expect(2).await;
    let last = &posts[1];
    let by_app = |app: &str| {
        last.iter()
            .find(|x| x["labels"]["fly_app"] == app)
            .unwrap_or_else(|| panic!("no {app}: {last:#?}"))
            .clone()
    };
    assert_eq!(
        by_app("agents-a")["startsAt"],
        "2026-05-01T12:00:00Z",
        "not a new alert"
    );
    assert_eq!(by_app("agents-a")["endsAt"], "2026-05-01T12:06:30Z");
    // Cleared while down: this run has not seen it clear for
    // alerts.resolve_after (90 s) yet, and an `endsAt` of now would be a
    // resolve to Alertmanager, so nothing is said of it...
    assert!(
        last.iter().all(|x| x["labels"]["fly_app"] != "agents-b"),
        "agents-b posted before its hold-down ended: {last:#?}"
    );
    // ...until the hold-down has passed: then it is resolved.
    second
        .notifier
        .update(std::slice::from_ref(&a), &[], t(390));
    let posts = am.expect(3).await;
    let last = &posts[2];
    let b = last
        .iter()
        .find(|x| x["labels"]["fly_app"] == "agents-b")
        .unwrap_or_else(|| panic!("no resolve of agents-b: {last:#?}"));
    assert_eq!(b["startsAt"], "2026-05-01T12:00:00Z");
    assert_eq!(b["endsAt"], "2026-05-01T12:06:30Z", "resolved");
    second.stop().await;
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(saved["alertmanagers"][0]["url_env"], "AM_URL");
    assert!(
        !std::fs::read_to_string(&state).unwrap().contains(&am.base),
        "no URL in the state file"
    );
}

#[test]
fn urls_and_variables_are_checked_without_echoing_the_url() {
    let e = alertmanager_urls_from_env(&config(), |_| None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("alerts.alertmanager[0]") && e.contains("AM_URL"),
        "{e}"
    );
    for (url, problem) in [
        (
            "http://am.example.com:9093/secret-path",
            "neither loopback nor",
        ),
        ("ftp://am/secret-path", "http(s)"),
        ("https://user:secret-path@am/", "credentials"),
    ] {
        let e = Notifier::with_sinks(&config(), vec![], vec![url.into()], options(None))
            .unwrap_err()
            .to_string();
        assert!(e.contains(problem) && e.contains("AM_URL"), "{e}");
        assert!(!e.contains("secret-path"), "{e}");
    }
    // Fly's private network is accepted in clear text.
    assert!(
        Notifier::with_sinks(
            &config(),
            vec![],
            vec!["http://am.internal:9093".into()],
            options(None)
        )
        .is_ok()
    );
}

/// `demo --alertmanager URL` posts the demo's alerts there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_posts_to_an_alertmanager() {
    let am = Am::start().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = fleet_reconciler::demo::DEMO_CONFIG.replace(
        "listen = \"127.0.0.1:8080\"",
        &format!("listen = \"127.0.0.1:{port}\""),
    );
    let path = dir.path().join("demo.toml");
    std::fs::write(&path, config).unwrap();
    let _child = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_fleet-reconciler"))
            .args([
                "demo",
                "--sweeps",
                "0",
                "--alertmanager",
                &am.base,
                "--demo-config",
            ])
            .arg(&path)
            .stdout(std::fs::File::create(dir.path().join("stdout.txt")).unwrap())
            .stderr(std::fs::File::create(dir.path().join("stderr.txt")).unwrap())
            .spawn()
            .unwrap(),
    );
    eventually(
        "a drift incident posted",
        Duration::from_secs(120),
        async || {
            am.posts()
                .iter()
                .flatten()
                .any(|a| a["labels"]["alertname"] == "drift_detected")
        },
    )
    .await;
    let names: BTreeSet<String> = am
        .posts()
        .iter()
        .flatten()
        .filter_map(|a| a["labels"]["alertname"].as_str().map(str::to_owned))
        .collect();
    assert!(
        !names.contains("sweep_failing"),
        "a cold start is not a failing daemon: {names:?}"
    );
    let any = am.posts().concat();
    let d = any
        .iter()
        .find(|a| a["labels"]["alertname"] == "drift_detected")
        .unwrap();
    assert!(
        d["generatorURL"]
            .as_str()
            .unwrap()
            .starts_with(&format!("http://127.0.0.1:{port}/")),
        "links the demo's status page: {d:#?}"
    );
    assert_eq!(d["labels"]["team"], "agent-platform");
    // Posts are counted with the webhook deliveries, as format "alertmanager".
    let counted = || async {
        let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines()
            .find(|l| {
                l.contains("webhook_deliveries_total{")
                    && l.contains("format=\"alertmanager\"")
                    && l.contains("result=\"delivered\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    eventually(
        "alertmanager posts counted",
        Duration::from_secs(60),
        async || counted().await.is_some_and(|n| n >= 1.0),
    )
    .await;
}

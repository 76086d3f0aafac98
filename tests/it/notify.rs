//! The notifier against local webhook receivers on loopback: bodies of every
//! format, dedupe/repeat/resolve, retries through an outage, refused redirects,
//! secrets kept out of logs, a sweep never blocked; and the fleet-level alerts.
//!
//! Every test but the one about a hanging receiver (which measures real
//! time) runs on tokio's paused clock with the shipped retry and timeout
//! settings: a wait costs no real time, and none can flake on a busy machine.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, TimeZone, Utc};
use fleet_reconciler::clock::TokioClock;
use fleet_reconciler::config::{
    AlertsConfig, Config, DEFAULT_GROUP_BY, GroupField, PublicUrl, WebhookConfig, WebhookFormat,
};
use fleet_reconciler::decide::Snapshot;
use fleet_reconciler::decide::alerts::{Alert, AlertKind};
use fleet_reconciler::decide::alerts::{
    Coherence, CoherenceSample, FleetAlertInput, FleetAlertRules, FleetAlertTracker,
    RestoredMachineAlerts,
};
use fleet_reconciler::demo::DEMO_CONFIG;
use fleet_reconciler::events::{ActionEvent, EventKind, EventRotation};
use fleet_reconciler::model::{AppName, CommitId, MachineId, PolicyAction, Severity};
use fleet_reconciler::report::notify::{
    DETAIL_MACHINES, Notifier, NotifierOptions, SinkSecrets, runbook_anchor, sink_secrets_from_env,
};
use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::common::eventually;

/// Upper bound on every wait in this file: tokio's paused time (every test
/// but one runs on it), so ten retries a minute apart fit in no real time.
const WAIT: Duration = Duration::from_secs(15 * 60);
/// How long a test waits to see that nothing more is sent: five retry
/// intervals of the shipped options.
const QUIET: Duration = Duration::from_secs(5 * 60);
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

// ------------------------------------------------------------------ receiver

#[derive(Clone, Debug)]
enum Mode {
    Accept,
    Fail(u16),
    /// Answer 302 to this location.
    Redirect(String),
    /// Never answer.
    Hang,
}

#[derive(Clone, Debug)]
struct Recorded {
    path_and_query: String,
    headers: HeaderMap,
    body: Bytes,
}

impl Recorded {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("webhook bodies are JSON")
    }
}

struct ReceiverState {
    mode: Mutex<Mode>,
    attempts: AtomicUsize,
    accepted: Mutex<Vec<Recorded>>,
}

/// A webhook receiver on a loopback port: records what it accepts, and can be
/// told to fail, redirect or hang.
struct Receiver {
    addr: SocketAddr,
    state: Arc<ReceiverState>,
    task: JoinHandle<()>,
}

async fn receive(
    State(state): State<Arc<ReceiverState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    state.attempts.fetch_add(1, Ordering::SeqCst);
    let mode = state.mode.lock().unwrap().clone();
    match mode {
        Mode::Accept => {
            let path_and_query = uri.path_and_query().map(|p| p.to_string());
            state.accepted.lock().unwrap().push(Recorded {
                path_and_query: path_and_query.unwrap_or_default(),
                headers,
                body,
            });
            (StatusCode::ACCEPTED, "{\"status\":\"success\"}").into_response()
        }
        Mode::Fail(code) => (
            StatusCode::from_u16(code).unwrap(),
            // A body that echoes the request, as some receivers do: never logged.
            body,
        )
            .into_response(),
        Mode::Redirect(to) => (StatusCode::FOUND, [(header::LOCATION, to)]).into_response(),
        Mode::Hang => {
            std::future::pending::<()>().await;
            unreachable!()
        }
    }
}

impl Receiver {
    async fn start() -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Receiver::serve(listener)
    }

    fn serve(listener: tokio::net::TcpListener) -> Receiver {
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ReceiverState {
            mode: Mutex::new(Mode::Accept),
            attempts: AtomicUsize::new(0),
            accepted: Mutex::new(Vec::new()),
        });
        let app = Router::new().fallback(receive).with_state(state.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Receiver { addr, state, task }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn set(&self, mode: Mode) {
        *self.state.mode.lock().unwrap() = mode;
    }

    fn attempts(&self) -> usize {
        self.state.attempts.load(Ordering::SeqCst)
    }

    fn accepted(&self) -> Vec<Recorded> {
        self.state.accepted.lock().unwrap().clone()
    }

    fn bodies(&self) -> Vec<Value> {
        self.accepted().iter().map(Recorded::json).collect()
    }

    /// Waits until `n` requests were accepted and returns their bodies.
    async fn expect(&self, n: usize) -> Vec<Value> {
        eventually(&format!("{n} accepted requests"), WAIT, async || {
            self.accepted().len() >= n
        })
        .await;
        self.bodies()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ------------------------------------------------------------------ fixtures

fn hook(format: WebhookFormat, min_severity: Severity) -> WebhookConfig {
    WebhookConfig {
        url_env: "WEBHOOK_URL".into(),
        format,
        routing_key_env: (format == WebhookFormat::Pagerduty).then(|| "PD_ROUTING_KEY".into()),
        secret_env: None,
        min_severity,
        repeat_interval: Duration::from_secs(30 * 60),
    }
}

fn plain(url: String) -> SinkSecrets {
    SinkSecrets {
        url: url.into(),
        routing_key: None,
        hmac_secret: None,
    }
}

fn json_sink(rx: &Receiver) -> (WebhookConfig, SinkSecrets) {
    (
        hook(WebhookFormat::Json, Severity::Low),
        plain(rx.url("/h")),
    )
}

/// The shipped options (a minute between retries, 10 s per request): the
/// tests run on paused tokio time, where those pass in no real time.
fn shipped() -> NotifierOptions {
    NotifierOptions::default()
}

/// A notifier whose delivery task is running.
struct Running {
    notifier: Notifier,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    fn start(sinks: Vec<(WebhookConfig, SinkSecrets)>, options: NotifierOptions) -> Running {
        let (hooks, secrets): (Vec<_>, Vec<_>) = sinks.into_iter().unzip();
        let config = AlertsConfig {
            webhooks: hooks,
            // Per machine, no hold-down: these tests are about the per-sink state machine.
            group_by: vec![GroupField::Machine],
            resolve_after: Duration::ZERO,
            ..AlertsConfig::default()
        };
        Running::start_with(config, secrets, options)
    }

    /// A notifier for `config` (its webhooks given `secrets`), running.
    fn start_with(
        config: AlertsConfig,
        secrets: Vec<SinkSecrets>,
        options: NotifierOptions,
    ) -> Running {
        let notifier = Notifier::with_options(&config, secrets, options).unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn({
            let notifier = notifier.clone();
            let shutdown = shutdown.clone();
            async move { notifier.run(shutdown).await }
        });
        Running {
            notifier,
            shutdown,
            task,
        }
    }

    fn update(&self, firing: &[Alert], at: DateTime<Utc>) {
        self.notifier.update(firing, &[], at);
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("run returns after shutdown")
            .unwrap();
    }
}

fn drift(machine: &str, severity: Severity) -> Alert {
    Alert {
        kind: AlertKind::Drift,
        app: Some("agents-prod".into()),
        machine_id: Some(machine.into()),
        commit: CommitId::parse(COMMIT),
        severity,
        summary: format!("{machine} is 3 commits behind the release tip"),
        details: BTreeMap::from([
            ("commits_behind".into(), "3".into()),
            ("pool".into(), "default".into()),
        ]),
    }
}

fn t(mins: i64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 5, 1, 12, 0, 0).unwrap() + chrono::Duration::minutes(mins)
}

fn event(kind: EventKind, machine: &str) -> ActionEvent {
    ActionEvent {
        kind,
        app: "agents-prod".into(),
        machine_id: machine.into(),
        rotation: Some(EventRotation {
            commit: CommitId::parse(COMMIT).unwrap(),
            action: PolicyAction::Restart,
        }),
        severity: Severity::High,
        summary: format!("restart of {machine} failed: machine did not start"),
        at: t(0),
    }
}

/// (event, status, machine_id, repeat) of JSON bodies, for sequence asserts.
fn seq(bodies: &[Value]) -> Vec<(String, String, String, bool)> {
    bodies
        .iter()
        .map(|b| {
            (
                b["event"].as_str().unwrap().to_owned(),
                b["status"].as_str().unwrap().to_owned(),
                b["machine_id"].as_str().unwrap_or("*").to_owned(),
                b["repeat"].as_bool().unwrap(),
            )
        })
        .collect()
}

fn s(event: &str, status: &str, machine: &str, repeat: bool) -> (String, String, String, bool) {
    (event.into(), status.into(), machine.into(), repeat)
}

// ------------------------------------------------------------------ formats

#[tokio::test(start_paused = true)]
async fn json_body_follows_the_schema_and_is_signed() {
    let rx = Receiver::start().await;
    let secret = "whsec-test-0001";
    let mut json = hook(WebhookFormat::Json, Severity::Low);
    json.secret_env = Some("WEBHOOK_SECRET".into());
    let sink = SinkSecrets {
        hmac_secret: Some(secret.into()),
        ..plain(rx.url("/hook"))
    };
    let n = Running::start(vec![(json, sink)], shipped());

    let alert = drift("m1", Severity::High);
    n.update(std::slice::from_ref(&alert), t(0));
    n.notifier.update(
        std::slice::from_ref(&alert),
        &[event(EventKind::ActionFailed, "m1")],
        t(1),
    );
    n.update(&[], t(2));
    let bodies = rx.expect(3).await;

    let b = &bodies[0];
    assert_eq!(b["version"], 1);
    assert_eq!(b["event"], "drift_detected");
    assert_eq!(b["status"], "firing");
    assert_eq!(b["repeat"], false);
    assert_eq!(b["dedup_key"], alert.dedup_key().as_str());
    assert_eq!(b["app"], "agents-prod");
    assert_eq!(b["machine_id"], "m1");
    assert_eq!(b["commit"], COMMIT);
    assert_eq!(b["severity"], "high");
    assert_eq!(b["summary"], alert.summary);
    assert_eq!(b["details"]["commits_behind"], "3");
    assert_eq!(b["at"], "2026-05-01T12:00:00Z");
    let keys: Vec<&str> = b.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "app",
            "at",
            "commit",
            "dedup_key",
            "details",
            "event",
            "machine_id",
            "repeat",
            "severity",
            "status",
            "summary",
            "update",
            "version"
        ],
        "schema changed? document it in docs/alerts.md"
    );
    assert_eq!(b["update"], false);
    // Where to act: the runbook section of the kind (no public_url: no page links).
    assert_eq!(
        b["details"]["runbook_url"],
        "https://github.com/your-org/fleet-reconciler/blob/main/docs/operations.md#drift_detected"
    );
    assert_eq!(b["details"]["tip"], COMMIT);
    assert!(b["details"].get("status_url").is_none());

    let e = &bodies[1];
    assert_eq!(
        (&e["event"], &e["status"]),
        (&"action_failed".into(), &"event".into())
    );
    assert_eq!(e["details"]["action"], "restart");
    assert_eq!(
        e["dedup_key"],
        format!("fleet-reconciler/action_failed/agents-prod/m1/{COMMIT}")
    );

    let r = &bodies[2];
    assert_eq!(
        (&r["event"], &r["status"]),
        (&"drift_resolved".into(), &"resolved".into())
    );
    assert_eq!(r["dedup_key"], alert.dedup_key().as_str());
    assert_eq!(r["at"], "2026-05-01T12:02:00Z");

    // The signature is an HMAC-SHA256 of "<timestamp>.<exact body bytes>",
    // recomputed here.
    for req in rx.accepted() {
        assert_eq!(req.headers[header::CONTENT_TYPE], "application/json");
        let sig = req.headers["x-fleet-signature"].to_str().unwrap();
        let ts = req.headers["x-fleet-timestamp"].to_str().unwrap();
        let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(format!("{ts}.").as_bytes());
        mac.update(&req.body);
        let expected = format!("sha256={}", hex::encode(mac.finalize().into_bytes()));
        assert_eq!(sig, expected);
        assert_eq!(req.path_and_query, "/hook");
    }
    n.stop().await;
}

#[tokio::test(start_paused = true)]
async fn unsigned_json_has_no_signature_header() {
    let rx = Receiver::start().await;
    let n = Running::start(vec![json_sink(&rx)], shipped());
    n.update(&[drift("m1", Severity::Low)], t(0));
    rx.expect(1).await;
    assert!(!rx.accepted()[0].headers.contains_key("x-fleet-signature"));
    assert!(!rx.accepted()[0].headers.contains_key("x-fleet-timestamp"));
    n.stop().await;
}

#[tokio::test(start_paused = true)]
async fn slack_body_has_text_and_blocks() {
    let rx = Receiver::start().await;
    let n = Running::start(
        vec![(
            hook(WebhookFormat::Slack, Severity::Low),
            plain(rx.url("/services/T0/B0/x")),
        )],
        shipped(),
    );
    n.update(&[drift("m1", Severity::Critical)], t(0));
    n.update(&[], t(1));
    let bodies = rx.expect(2).await;

    let b = &bodies[0];
    let text = b["text"].as_str().unwrap();
    assert!(
        text.contains("FIRING") && text.contains("critical"),
        "{text}"
    );
    assert!(text.contains("drift_detected") && text.contains("m1 is 3 commits behind"));
    let blocks = b["blocks"].as_array().unwrap();
    assert_eq!(blocks[0]["type"], "header");
    assert_eq!(blocks[0]["text"]["type"], "plain_text");
    assert!(
        blocks[0]["text"]["text"]
            .as_str()
            .unwrap()
            .contains("drift_detected")
    );
    assert_eq!(blocks[1]["type"], "section");
    assert_eq!(
        blocks[1]["text"]["text"],
        "m1 is 3 commits behind the release tip"
    );
    let fields: Vec<&str> = blocks[1]["fields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["text"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        [
            "*App*\nagents-prod",
            "*Machine*\nm1",
            "*Severity*\ncritical",
            "*Commit*\n`0123456`"
        ]
    );
    assert_eq!(blocks[2]["type"], "context");

    let r = &bodies[1];
    assert!(r["text"].as_str().unwrap().starts_with("RESOLVED"));
    assert!(
        r["blocks"][0]["text"]["text"]
            .as_str()
            .unwrap()
            .contains("drift_resolved")
    );
    n.stop().await;
}

#[tokio::test(start_paused = true)]
async fn pagerduty_trigger_and_resolve_follow_events_v2() {
    let rx = Receiver::start().await;
    let routing_key = "R0UTINGKEY0123456789abcdef012345";
    let sink = SinkSecrets {
        routing_key: Some(routing_key.into()),
        ..plain(rx.url("/v2/enqueue"))
    };
    let n = Running::start(
        vec![(hook(WebhookFormat::Pagerduty, Severity::Low), sink)],
        shipped(),
    );
    let alerts = [
        drift("m-low", Severity::Low),
        drift("m-medium", Severity::Medium),
        drift("m-high", Severity::High),
        drift("m-critical", Severity::Critical),
    ];
    n.update(&alerts, t(0));
    let bodies = rx.expect(4).await;
    let mut mapped = BTreeMap::new();
    for b in &bodies {
        assert_eq!(b["routing_key"], routing_key);
        assert_eq!(b["event_action"], "trigger");
        let p = &b["payload"];
        let machine = p["component"].as_str().unwrap();
        let alert = alerts
            .iter()
            .find(|a| a.machine_id == Some(MachineId::from(machine)))
            .unwrap();
        assert_eq!(b["dedup_key"], alert.dedup_key().as_str());
        assert_eq!(p["summary"], alert.summary);
        assert_eq!(p["source"], "fleet-reconciler/agents-prod");
        assert_eq!(p["group"], "agents-prod");
        assert_eq!(p["class"], "drift_detected");
        assert_eq!(p["custom_details"]["commits_behind"], "3");
        assert_eq!(p["custom_details"]["commit"], COMMIT);
        mapped.insert(
            machine.to_owned(),
            p["severity"].as_str().unwrap().to_owned(),
        );
    }
    let expected: BTreeMap<String, String> = [
        ("m-low", "info"),
        ("m-medium", "warning"),
        ("m-high", "error"),
        ("m-critical", "critical"),
    ]
    .into_iter()
    .map(|(m, s)| (m.to_owned(), s.to_owned()))
    .collect();
    assert_eq!(mapped, expected);

    // A new message and a higher severity: same incident (same dedup_key).
    let mut escalated = drift("m-low", Severity::High);
    escalated.summary = "m-low is now 25 commits behind".into();
    let rest = [escalated, alerts[1].clone(), alerts[2].clone()];
    n.update(&rest, t(1));
    let bodies = rx.expect(6).await;
    // Resolves are queued before new triggers of the same sweep.
    let esc = &bodies[5];
    assert_eq!(esc["event_action"], "trigger");
    assert_eq!(esc["dedup_key"], alerts[0].dedup_key().as_str());
    assert_eq!(esc["payload"]["severity"], "error");
    assert_eq!(esc["payload"]["summary"], "m-low is now 25 commits behind");
    // m-critical cleared: its resolve carries exactly three fields.
    let resolve = &bodies[4];
    let mut keys: Vec<&str> = resolve
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["dedup_key", "event_action", "routing_key"]);
    assert_eq!(resolve["event_action"], "resolve");
    assert_eq!(resolve["dedup_key"], alerts[3].dedup_key().as_str());
    n.stop().await;
}

#[tokio::test(start_paused = true)]
async fn pagerduty_is_paged_for_failed_actions_only() {
    let rx = Receiver::start().await;
    let sink = SinkSecrets {
        routing_key: Some("rk".into()),
        ..plain(rx.url("/v2/enqueue"))
    };
    let n = Running::start(
        vec![(hook(WebhookFormat::Pagerduty, Severity::Low), sink)],
        shipped(),
    );
    let events = [
        event(EventKind::ActionStarted, "m1"),
        event(EventKind::ActionFailed, "m1"),
    ];
    n.notifier.update(&[], &events, t(0));
    n.notifier
        .update(&[], &[event(EventKind::ActionSucceeded, "m1")], t(5));
    // Barrier: once this trigger is in, everything queued before it was sent.
    n.update(&[drift("barrier", Severity::High)], t(6));
    let bodies = rx.expect(3).await;
    let actions: Vec<(&str, &str)> = bodies
        .iter()
        .map(|b| {
            (
                b["event_action"].as_str().unwrap(),
                b["payload"]["class"].as_str().unwrap_or("-"),
            )
        })
        .collect();
    assert_eq!(
        actions,
        [
            ("trigger", "action_failed"),
            ("resolve", "-"),
            ("trigger", "drift_detected")
        ]
    );
    assert_eq!(bodies[0]["dedup_key"], bodies[1]["dedup_key"]);
    n.stop().await;
}

// ------------------------------------------------------------------ state machine

#[tokio::test(start_paused = true)]
async fn unchanged_alerts_repeat_once_per_interval_and_resolve_when_cleared() {
    let rx = Receiver::start().await;
    let n = Running::start(vec![json_sink(&rx)], shipped());
    let a = drift("a", Severity::Medium);
    let b = drift("b", Severity::Medium);
    n.update(std::slice::from_ref(&a), t(0));
    n.update(std::slice::from_ref(&a), t(1));
    n.update(std::slice::from_ref(&a), t(10));
    // b is the barrier: FIFO delivery means any duplicate of a would come first.
    n.update(&[a.clone(), b.clone()], t(10));
    assert_eq!(
        seq(&rx.expect(2).await),
        [
            s("drift_detected", "firing", "a", false),
            s("drift_detected", "firing", "b", false)
        ]
    );
    n.update(&[a.clone(), b.clone()], t(31)); // a: 31 min since its trigger → one repeat
    n.update(&[a.clone(), b.clone()], t(35)); // nothing due
    n.update(std::slice::from_ref(&b), t(36)); // a converged → resolve
    n.update(std::slice::from_ref(&b), t(41)); // b: 31 min → one repeat
    n.update(&[], t(42)); // b converged
    let bodies = rx.expect(6).await;
    assert_eq!(
        seq(&bodies),
        [
            s("drift_detected", "firing", "a", false),
            s("drift_detected", "firing", "b", false),
            s("drift_detected", "firing", "a", true),
            s("drift_resolved", "resolved", "a", false),
            s("drift_detected", "firing", "b", true),
            s("drift_resolved", "resolved", "b", false),
        ]
    );
    // Nothing else comes: the next thing through is a new barrier.
    n.update(&[drift("c", Severity::Low)], t(43));
    let bodies = rx.expect(7).await;
    assert_eq!(bodies.len(), 7);
    assert_eq!(bodies[6]["machine_id"], "c");
    assert_eq!(n.notifier.stats()[0].delivered, 7);
    n.stop().await;
}

#[tokio::test(start_paused = true)]
async fn min_severity_filters_triggers_and_resolves_follow_them() {
    let high_rx = Receiver::start().await;
    let all_rx = Receiver::start().await;
    let n = Running::start(
        vec![
            (
                hook(WebhookFormat::Json, Severity::High),
                plain(high_rx.url("/h")),
            ),
            (
                hook(WebhookFormat::Json, Severity::Low),
                plain(all_rx.url("/a")),
            ),
        ],
        shipped(),
    );
    let low = drift("low", Severity::Low);
    let high = drift("high", Severity::High);
    n.update(&[low.clone(), high.clone()], t(0));
    n.update(&[], t(1));
    // An event below the threshold is filtered the same way.
    let mut minor = event(EventKind::ActionSucceeded, "low");
    minor.severity = Severity::Low;
    n.notifier.update(&[], &[minor], t(2));
    let barrier = drift("barrier", Severity::Critical);
    n.update(&[barrier], t(3));
    assert_eq!(
        seq(&high_rx.expect(3).await),
        [
            s("drift_detected", "firing", "high", false),
            s("drift_resolved", "resolved", "high", false),
            s("drift_detected", "firing", "barrier", false),
        ]
    );
    let all = all_rx.expect(6).await;
    let mut machines: Vec<(String, String)> = seq(&all)[..4]
        .iter()
        .map(|(e, _, m, _)| (e.clone(), m.clone()))
        .collect();
    machines.sort();
    assert_eq!(
        machines,
        [
            ("drift_detected".into(), "high".into()),
            ("drift_detected".into(), "low".into()),
            ("drift_resolved".into(), "high".into()),
            ("drift_resolved".into(), "low".into()),
        ]
    );
    assert_eq!(all[4]["event"], "action_succeeded");
    assert_eq!(all[5]["machine_id"], "barrier");
    n.stop().await;
}

// ------------------------------------------------------------------ delivery

#[tokio::test(start_paused = true)]
async fn an_outage_loses_nothing_and_keeps_order() {
    let rx = Receiver::start().await;
    rx.set(Mode::Fail(503));
    let n = Running::start(vec![json_sink(&rx)], shipped());
    let a = drift("a", Severity::High);
    let b = drift("b", Severity::High);
    n.update(std::slice::from_ref(&a), t(0));
    n.update(&[a.clone(), b.clone()], t(1));
    n.update(std::slice::from_ref(&b), t(2));
    eventually("three failed attempts", WAIT, async || rx.attempts() >= 3).await;
    assert!(rx.accepted().is_empty());
    assert_eq!(n.notifier.queued(), 3);
    rx.set(Mode::Accept);
    assert_eq!(
        seq(&rx.expect(3).await),
        [
            s("drift_detected", "firing", "a", false),
            s("drift_detected", "firing", "b", false),
            s("drift_resolved", "resolved", "a", false),
        ]
    );
    let stats = &n.notifier.stats()[0];
    assert!(stats.failed_attempts >= 3, "{stats:?}");
    assert_eq!((stats.delivered, stats.queued, stats.dropped), (3, 0, 0));
    n.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_receiver_that_is_down_gets_everything_once_it_is_up() {
    // A socket bound but not listening holds the port (no other test can take
    // it) and refuses connections until the receiver listens on it.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    let n = Running::start(
        vec![(
            hook(WebhookFormat::Json, Severity::Low),
            plain(format!("http://{addr}/h")),
        )],
        shipped(),
    );
    let a = drift("a", Severity::High);
    n.update(std::slice::from_ref(&a), t(0));
    n.update(&[], t(1));
    eventually("two refused attempts", WAIT, async || {
        n.notifier.stats()[0].failed_attempts >= 2
    })
    .await;
    let rx = Receiver::serve(socket.listen(64).unwrap());
    assert_eq!(
        seq(&rx.expect(2).await),
        [
            s("drift_detected", "firing", "a", false),
            s("drift_resolved", "resolved", "a", false),
        ]
    );
    n.stop().await;
}

#[tokio::test(start_paused = true)]
async fn redirects_are_refused() {
    let elsewhere = Receiver::start().await;
    let redirecting = Receiver::start().await;
    redirecting.set(Mode::Redirect(elsewhere.url("/stolen")));
    let n = Running::start(vec![json_sink(&redirecting)], shipped());
    n.update(&[drift("a", Severity::High)], t(0));
    eventually("a retried redirect", WAIT, async || {
        redirecting.attempts() >= 2
    })
    .await;
    assert_eq!(elsewhere.attempts(), 0, "the redirect was followed");
    let stats = &n.notifier.stats()[0];
    assert_eq!((stats.delivered, stats.queued), (0, 1), "{stats:?}");
    // Once the receiver answers itself, the same notification goes through.
    redirecting.set(Mode::Accept);
    assert_eq!(redirecting.expect(1).await[0]["machine_id"], "a");
    assert_eq!(elsewhere.attempts(), 0);
    n.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_never_waits_for_a_hanging_receiver() {
    let rx = Receiver::start().await;
    rx.set(Mode::Hang);
    let options = NotifierOptions {
        request_timeout: Duration::from_secs(60),
        flush_deadline: Duration::from_millis(300),
        queue_capacity: 5000,
        ..shipped()
    };
    let n = Running::start(vec![json_sink(&rx)], options);
    n.update(&[drift("first", Severity::High)], t(0));
    eventually("a request in flight", WAIT, async || rx.attempts() >= 1).await;

    let many: Vec<Alert> = (0..2000)
        .map(|i| drift(&format!("m{i}"), Severity::High))
        .collect();
    for minute in 1..=3 {
        let started = Instant::now();
        n.update(&many, t(minute));
        let took = started.elapsed();
        // A blocked update would wait out the 60 s request timeout.
        assert!(took < Duration::from_secs(10), "update took {took:?}");
    }
    // In flight: the first trigger; then its resolve (it cleared) and 2000 triggers.
    assert_eq!(n.notifier.queued(), 2002);

    // Shutdown gives up on the hanging request after the flush deadline.
    let started = Instant::now();
    n.stop().await;
    // The flush deadline is 300 ms; waiting for the request would take 60 s.
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test(start_paused = true)]
async fn shutdown_flushes_what_is_queued() {
    let rx = Receiver::start().await;
    let config = AlertsConfig {
        webhooks: vec![hook(WebhookFormat::Json, Severity::Low)],
        // Per machine, no hold-down: these tests are about the per-sink state machine.
        group_by: vec![GroupField::Machine],
        resolve_after: Duration::ZERO,
        ..AlertsConfig::default()
    };
    let notifier = Notifier::with_options(&config, vec![plain(rx.url("/h"))], shipped()).unwrap();
    notifier.update(
        &[drift("a", Severity::Low), drift("b", Severity::Low)],
        &[],
        t(0),
    );
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    tokio::time::timeout(WAIT, notifier.run(shutdown))
        .await
        .expect("the flush ends");
    assert_eq!(rx.accepted().len(), 2);
    assert_eq!(notifier.queued(), 0);
}

// ------------------------------------------------------------------ secrets

/// Installs (once) a global TRACE subscriber, bridging the `log` crate too,
/// that writes into a buffer.
fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static BUF: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    BUF.get_or_init(|| {
        #[derive(Clone)]
        struct Sink(Arc<Mutex<Vec<u8>>>);
        impl Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = Sink(buf.clone());
        use tracing_subscriber::util::SubscriberInitExt;
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish()
            .try_init()
            .expect("no other global subscriber in this test binary");
        buf
    })
    .clone()
}

#[tokio::test(start_paused = true)]
async fn secrets_stay_out_of_logs_errors_and_payloads() {
    let logs = captured_logs();
    let rx = Receiver::start().await;
    let json_url = rx.url("/hooks/T0SECRETPATH/B0SECRETPATH?token=query-sekrit-5551");
    let slack_url = rx.url("/services/T000/B000/SLACKSEKRITXXXXXXXXXX");
    let pd_url = rx.url("/v2/enqueue?key=pd-url-sekrit-77");
    let routing_key = "pd-routing-sekrit-93a1c0ffee";
    let hmac_secret = "hmac-sekrit-7c1f00d";
    let secrets = [
        json_url.as_str(),
        "T0SECRETPATH",
        "query-sekrit-5551",
        slack_url.as_str(),
        "SLACKSEKRIT",
        pd_url.as_str(),
        "pd-url-sekrit-77",
        routing_key,
        hmac_secret,
    ];

    // Secrets come from the environment through the helper, as in main.
    let mut json = hook(WebhookFormat::Json, Severity::Low);
    json.url_env = "JSON_URL".into();
    json.secret_env = Some("JSON_SECRET".into());
    let mut slack = hook(WebhookFormat::Slack, Severity::Low);
    slack.url_env = "SLACK_URL".into();
    let mut pd = hook(WebhookFormat::Pagerduty, Severity::Low);
    pd.url_env = "PD_URL".into();
    let config = AlertsConfig {
        webhooks: vec![json, slack, pd],
        // Per machine, no hold-down: these tests are about the per-sink state machine.
        group_by: vec![GroupField::Machine],
        resolve_after: Duration::ZERO,
        ..AlertsConfig::default()
    };
    let env: BTreeMap<&str, &str> = BTreeMap::from([
        ("JSON_URL", json_url.as_str()),
        ("JSON_SECRET", hmac_secret),
        ("SLACK_URL", slack_url.as_str()),
        ("PD_URL", pd_url.as_str()),
        ("PD_ROUTING_KEY", routing_key),
    ]);
    let sinks = sink_secrets_from_env(&config, |k| env.get(k).map(|v| v.to_string())).unwrap();
    // A missing variable is named, and no value of the others leaks into the error.
    let missing = sink_secrets_from_env(&config, |k| {
        (k != "PD_ROUTING_KEY").then(|| env[k].to_string())
    })
    .unwrap_err()
    .to_string();
    assert!(missing.contains("PD_ROUTING_KEY"), "{missing}");
    let mut texts = vec![missing, format!("{sinks:?}")];

    let notifier = Notifier::with_options(&config, sinks, shipped()).unwrap();
    texts.push(format!("{notifier:?}"));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (notifier, shutdown) = (notifier.clone(), shutdown.clone());
        async move { notifier.run(shutdown).await }
    });

    // A full run: failures (with echoed bodies), a redirect, then deliveries.
    rx.set(Mode::Fail(500));
    let a = drift("a", Severity::Critical);
    notifier.update(std::slice::from_ref(&a), &[], t(0));
    notifier.update(
        std::slice::from_ref(&a),
        &[event(EventKind::ActionFailed, "a")],
        t(1),
    );
    eventually("failed attempts", WAIT, async || rx.attempts() >= 6).await;
    rx.set(Mode::Redirect(json_url.clone()));
    eventually("redirected attempts", WAIT, async || rx.attempts() >= 12).await;
    rx.set(Mode::Accept);
    notifier.update(&[], &[], t(40));
    // json: trigger, event, resolve; slack: the same; pagerduty: trigger, event trigger, resolve.
    rx.expect(9).await;
    shutdown.cancel();
    tokio::time::timeout(WAIT, task).await.unwrap().unwrap();

    let logs = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    assert!(
        logs.contains("webhook delivered") && logs.contains("webhook delivery failed"),
        "the capture works"
    );
    assert!(logs.contains("redirect refused"));
    for secret in secrets {
        assert!(!logs.contains(secret), "{secret} in the logs");
        for text in &texts {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
    }
    for req in rx.accepted() {
        let body = String::from_utf8(req.body.to_vec()).unwrap();
        for secret in secrets {
            // The routing key is part of the PagerDuty API; nothing else may appear.
            if secret == routing_key && req.path_and_query.starts_with("/v2/enqueue") {
                continue;
            }
            assert!(!body.contains(secret), "{secret} in a payload: {body}");
        }
        assert!(!body.contains("127.0.0.1"), "a URL in a payload: {body}");
    }
}

#[test]
fn missing_env_names_the_variable() {
    let mut pd = hook(WebhookFormat::Pagerduty, Severity::High);
    pd.url_env = "ONCALL_WEBHOOK_URL".into();
    let config = AlertsConfig {
        webhooks: vec![pd],
        // Per machine, no hold-down: these tests are about the per-sink state machine.
        group_by: vec![GroupField::Machine],
        resolve_after: Duration::ZERO,
        ..AlertsConfig::default()
    };
    let e = sink_secrets_from_env(&config, |_| None).unwrap_err();
    assert!(e.to_string().contains("ONCALL_WEBHOOK_URL"), "{e}");
    let e = sink_secrets_from_env(&config, |k| {
        (k == "ONCALL_WEBHOOK_URL").then(|| "https://events.pagerduty.com/v2/enqueue".into())
    })
    .unwrap_err();
    assert!(e.to_string().contains("PD_ROUTING_KEY"), "{e}");
    assert!(!e.to_string().contains("pagerduty.com"), "{e}");
    // Empty counts as unset.
    let e = sink_secrets_from_env(&config, |_| Some(String::new())).unwrap_err();
    assert!(e.to_string().contains("ONCALL_WEBHOOK_URL"), "{e}");
}

// ------------------------------------------------------------------ fleet alerts

fn rules() -> FleetAlertRules {
    FleetAlertRules {
        coherence_threshold: 1.0,
        coherence_for: Duration::from_secs(15 * 60),
        sweep_interval: Duration::from_secs(30),
        fetch_interval: Duration::from_secs(60),
        max_consecutive_sweep_failures: 3,
        stale_intervals: 3,
        first_fetch_timeout: Duration::from_secs(120),
    }
}

fn sample(apps: &[(&str, usize, usize)]) -> CoherenceSample {
    let apps: BTreeMap<AppName, Coherence> = apps
        .iter()
        .map(|&(name, on_tip, machines)| (AppName::from(name), Coherence::of(on_tip, machines)))
        .collect();
    let on: usize = apps.values().map(|c| c.on_tip).sum();
    let all: usize = apps.values().map(|c| c.machines).sum();
    CoherenceSample {
        // The tracker reads the time it is given, not the sample's.
        at: DateTime::<Utc>::UNIX_EPOCH,
        fleet: Coherence::of(on, all),
        apps,
    }
}

/// A healthy sweep at `now` with this coherence.
fn healthy(c: &CoherenceSample, now: DateTime<Utc>) -> FleetAlertInput<'_> {
    FleetAlertInput {
        coherence: Some(c),
        last_sweep_success: Some(now),
        consecutive_sweep_failures: 0,
        last_tip_fetch: Some(now),
        tip_commit: Some(COMMIT),
    }
}

fn keys(alerts: &[Alert]) -> Vec<String> {
    alerts.iter().map(|a| a.dedup_key().to_string()).collect()
}

#[test]
fn coherence_alert_fires_after_coherence_for_and_resolves_when_restored() {
    let mut tracker = FleetAlertTracker::new(rules());
    let drifting = sample(&[("a", 3, 4), ("b", 4, 4)]);
    let coherent = sample(&[("a", 4, 4), ("b", 4, 4)]);
    assert!(tracker.evaluate(&healthy(&coherent, t(0)), t(0)).is_empty());
    assert!(tracker.evaluate(&healthy(&drifting, t(1)), t(1)).is_empty());
    assert!(
        tracker
            .evaluate(&healthy(&drifting, t(15)), t(15))
            .is_empty()
    );
    let firing = tracker.evaluate(&healthy(&drifting, t(16)), t(16));
    assert_eq!(
        keys(&firing),
        [
            "fleet-reconciler/coherence_below_threshold/*/*/*",
            "fleet-reconciler/coherence_below_threshold/a/*/*",
        ]
    );
    assert!(
        firing
            .iter()
            .all(|a| a.kind == AlertKind::CoherenceBelowThreshold && a.severity == Severity::High)
    );
    assert!(firing[1].summary.contains("75%"), "{}", firing[1].summary);
    assert!(
        firing[1].summary.contains("3 of 4"),
        "{}",
        firing[1].summary
    );
    assert_eq!(firing[1].details["below_since"], "2026-05-01T12:01:00Z");

    // A failed sweep measures nothing: the alert holds.
    let failed = FleetAlertInput {
        coherence: None,
        last_sweep_success: Some(t(16)),
        consecutive_sweep_failures: 1,
        last_tip_fetch: Some(t(16)),
        tip_commit: Some(COMMIT),
    };
    assert_eq!(keys(&tracker.evaluate(&failed, t(17))), keys(&firing));

    // Restored: resolves at once; a new dip starts a new clock.
    assert!(
        tracker
            .evaluate(&healthy(&coherent, t(18)), t(18))
            .is_empty()
    );
    assert!(
        tracker
            .evaluate(&healthy(&drifting, t(19)), t(19))
            .is_empty()
    );
    assert!(
        tracker
            .evaluate(&healthy(&drifting, t(33)), t(33))
            .is_empty()
    );
    assert_eq!(tracker.evaluate(&healthy(&drifting, t(34)), t(34)).len(), 2);
}

#[test]
fn a_single_app_fleet_gets_one_coherence_alert() {
    let mut tracker = FleetAlertTracker::new(rules());
    let drifting = sample(&[("a", 1, 2)]);
    tracker.evaluate(&healthy(&drifting, t(0)), t(0));
    let firing = tracker.evaluate(&healthy(&drifting, t(20)), t(20));
    assert_eq!(
        keys(&firing),
        ["fleet-reconciler/coherence_below_threshold/a/*/*"]
    );
}

#[test]
fn tip_stale_after_three_fetch_intervals() {
    let mut tracker = FleetAlertTracker::new(rules());
    let c = sample(&[("a", 1, 1)]);
    let fetched_at = |fetch: DateTime<Utc>, now: DateTime<Utc>| FleetAlertInput {
        last_tip_fetch: Some(fetch),
        ..healthy(&c, now)
    };
    assert!(tracker.evaluate(&fetched_at(t(0), t(3)), t(3)).is_empty());
    let stale = tracker.evaluate(&fetched_at(t(0), t(4)), t(4));
    assert_eq!(keys(&stale), ["fleet-reconciler/tip_stale/*/*/*"]);
    assert_eq!(stale[0].severity, Severity::High);
    assert_eq!(stale[0].details["last_fetch"], "2026-05-01T12:00:00Z");
    assert!(tracker.evaluate(&fetched_at(t(5), t(5)), t(5)).is_empty());

    // Never fetched: measured from the tracker's first evaluation.
    let mut fresh = FleetAlertTracker::new(rules());
    let never = |now| FleetAlertInput {
        last_tip_fetch: None,
        ..healthy(&c, now)
    };
    assert!(fresh.evaluate(&never(t(0)), t(0)).is_empty());
    assert!(fresh.evaluate(&never(t(3)), t(3)).is_empty());
    assert_eq!(
        fresh.evaluate(&never(t(4)), t(4))[0].kind,
        AlertKind::TipStale
    );
}

#[test]
fn sweeps_failing_after_three_failures_or_three_intervals() {
    let mut tracker = FleetAlertTracker::new(rules());
    let c = sample(&[("a", 1, 1)]);
    let failing = |failures: u32, last: Option<DateTime<Utc>>, now| FleetAlertInput {
        coherence: None,
        last_sweep_success: last,
        consecutive_sweep_failures: failures,
        last_tip_fetch: Some(now),
        tip_commit: Some(COMMIT),
    };
    let base = t(0);
    let secs = |s: i64| base + chrono::Duration::seconds(s);
    assert!(tracker.evaluate(&healthy(&c, base), base).is_empty());
    assert!(
        tracker
            .evaluate(&failing(2, Some(base), secs(60)), secs(60))
            .is_empty()
    );
    let firing = tracker.evaluate(&failing(3, Some(base), secs(89)), secs(89));
    assert_eq!(keys(&firing), ["fleet-reconciler/sweep_failing/*/*/*"]);
    assert_eq!(firing[0].severity, Severity::Critical);
    assert!(
        tracker
            .evaluate(&healthy(&c, secs(120)), secs(120))
            .is_empty()
    );
    // No failure reported, but no success for more than 3 intervals either (a hung sweep).
    let hung = tracker.evaluate(&failing(0, Some(secs(120)), secs(211)), secs(211));
    assert_eq!(hung[0].kind, AlertKind::SweepFailing);
    // Never succeeded since start.
    let mut fresh = FleetAlertTracker::new(rules());
    assert!(fresh.evaluate(&failing(1, None, base), base).is_empty());
    assert_eq!(
        fresh.evaluate(&failing(2, None, secs(91)), secs(91))[0].details["last_success"],
        "never"
    );
}

/// A cold start (#20 item 5): the first mirror clone outlasts three sweep
/// intervals, so the first sweeps fail for want of a tip. A daemon that is
/// starting is not failing: no critical `sweep_failing` (nor `tip_stale`)
/// before the first fetch has had its `overlay.fetch_timeout`. The demo's
/// own config: sweeps every 2 s, fetches every 1 s.
#[test]
fn a_cold_start_pages_nothing_while_the_first_clone_runs() {
    let config = Config::parse(Path::new("demo.toml"), DEMO_CONFIG).unwrap();
    let rules = FleetAlertRules::from_config(&config);
    let at = |s: i64| t(0) + chrono::Duration::seconds(s);
    let starting = |failures: u32| FleetAlertInput {
        coherence: None,
        last_sweep_success: None,
        consecutive_sweep_failures: failures,
        last_tip_fetch: None,
        tip_commit: None,
    };
    let mut tracker = FleetAlertTracker::new(rules.clone());
    // "no overlay tip yet: the first fetch has not finished yet", every 2 s for 12 s.
    for (i, s) in [2, 4, 6, 8, 10, 12].into_iter().enumerate() {
        let firing = tracker.evaluate(&starting(i as u32 + 1), at(s));
        assert!(firing.is_empty(), "at {s} s: {:?}", keys(&firing));
    }
    // The clone is done, the first sweep succeeds: still nothing.
    let c = sample(&[("agents-dispatch", 0, 17), ("agents-chat", 0, 17)]);
    let first = FleetAlertInput {
        tip_commit: Some(COMMIT),
        ..healthy(&c, at(14))
    };
    assert!(
        keys(&tracker.evaluate(&first, at(14)))
            .iter()
            .all(|k| !k.contains("sweep_failing") && !k.contains("tip_stale"))
    );

    // A first fetch that never ends is a failing daemon once it has had its
    // fetch_timeout and three sweep intervals.
    let mut stuck = FleetAlertTracker::new(rules);
    let limit = config.overlay.fetch_timeout.get().as_secs() as i64 + 6;
    let mut n = 0;
    for s in (2..=limit).step_by(2) {
        n += 1;
        assert!(stuck.evaluate(&starting(n), at(s)).is_empty(), "at {s} s");
    }
    let firing = stuck.evaluate(&starting(n + 1), at(limit + 4));
    let kinds: Vec<AlertKind> = firing.iter().map(|a| a.kind).collect();
    assert!(kinds.contains(&AlertKind::SweepFailing), "{kinds:?}");
    assert!(kinds.contains(&AlertKind::TipStale), "{kinds:?}");
}

#[tokio::test(start_paused = true)]
async fn fleet_alerts_reach_pagerduty_and_resolve() {
    let rx = Receiver::start().await;
    let sink = SinkSecrets {
        routing_key: Some("rk".into()),
        ..plain(rx.url("/v2/enqueue"))
    };
    let n = Running::start(
        vec![(hook(WebhookFormat::Pagerduty, Severity::High), sink)],
        shipped(),
    );
    let mut tracker = FleetAlertTracker::new(rules());
    let drifting = sample(&[("a", 0, 2)]);
    for minute in [0, 10, 20] {
        let alerts = tracker.evaluate(&healthy(&drifting, t(minute)), t(minute));
        n.update(&alerts, t(minute));
    }
    let coherent = sample(&[("a", 2, 2)]);
    n.update(&tracker.evaluate(&healthy(&coherent, t(21)), t(21)), t(21));
    let bodies = rx.expect(2).await;
    assert_eq!(bodies[0]["event_action"], "trigger");
    assert_eq!(bodies[0]["payload"]["severity"], "error");
    assert_eq!(bodies[0]["payload"]["class"], "coherence_below_threshold");
    assert_eq!(bodies[1]["event_action"], "resolve");
    assert_eq!(bodies[0]["dedup_key"], bodies[1]["dedup_key"]);
    n.stop().await;
}

// ------------------------------------------------------------------ transport

/// Routing keys and signed bodies must not travel in clear text: `http://`
/// is refused at startup except to a loopback receiver.
#[test]
fn plain_http_is_refused_except_on_loopback() {
    let config = AlertsConfig {
        webhooks: vec![hook(WebhookFormat::Pagerduty, Severity::High)],
        // Per machine, no hold-down: these tests are about the per-sink state machine.
        group_by: vec![GroupField::Machine],
        resolve_after: Duration::ZERO,
        ..AlertsConfig::default()
    };
    let pd = |url: &str| SinkSecrets {
        url: url.into(),
        routing_key: Some("rk".into()),
        hmac_secret: None,
    };
    for url in [
        "http://events.pagerduty.com/v2/enqueue",
        "http://10.0.0.7:8080/hook",
        "http://[fd00::1]/hook",
        "http://localhost.example.com/hook",
        "HTTP://hooks.example.com/hook",
    ] {
        let e = Notifier::new(&config, vec![pd(url)])
            .expect_err(url)
            .to_string();
        assert!(
            e.contains("alerts.webhooks[0]") && e.contains("WEBHOOK_URL") && e.contains("https"),
            "{url}: {e}"
        );
        assert!(
            !e.contains("pagerduty.com") && !e.contains("example.com"),
            "{e}"
        );
    }
    for url in [
        "https://events.pagerduty.com/v2/enqueue",
        "http://127.0.0.1:9/hook",
        "http://127.8.9.10/hook",
        "http://[::1]:9/hook",
        "http://localhost:9/hook",
        "http://LOCALHOST/hook",
    ] {
        assert!(Notifier::new(&config, vec![pd(url)]).is_ok(), "{url}");
    }
}

/// A replayed request must be detectable: the signature covers a timestamp
/// header, `HMAC(secret, "<timestamp>.<body>")`.
#[tokio::test(start_paused = true)]
async fn the_signature_covers_a_timestamp() {
    let rx = Receiver::start().await;
    let secret = "whsec-replay-0002";
    let mut json = hook(WebhookFormat::Json, Severity::Low);
    json.secret_env = Some("WEBHOOK_SECRET".into());
    let sink = SinkSecrets {
        hmac_secret: Some(secret.into()),
        ..plain(rx.url("/hook"))
    };
    // The notifier's clock reads t(0) on paused time: the stamp is exact.
    let options = NotifierOptions {
        clock: Arc::new(TokioClock::starting_at(t(0))),
        ..shipped()
    };
    let n = Running::start(vec![(json, sink)], options);
    n.update(&[drift("m1", Severity::High)], t(0));
    rx.expect(1).await;
    n.stop().await;

    let req = &rx.accepted()[0];
    let ts = req
        .headers
        .get("x-fleet-timestamp")
        .expect("an X-Fleet-Timestamp header")
        .to_str()
        .unwrap()
        .to_owned();
    let sent: i64 = ts.parse().expect("unix seconds");
    // Sent at once: no timer of the notifier's was due before the send.
    assert_eq!(sent, t(0).timestamp(), "the time of sending");
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(ts.as_bytes());
    mac.update(b".");
    mac.update(&req.body);
    let expected = format!("sha256={}", hex::encode(mac.finalize().into_bytes()));
    assert_eq!(req.headers["x-fleet-signature"], expected.as_str());
    // The body alone no longer verifies: a replay with a new timestamp fails.
    let mut body_only = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    body_only.update(&req.body);
    let body_only = format!("sha256={}", hex::encode(body_only.finalize().into_bytes()));
    assert_ne!(req.headers["x-fleet-signature"], body_only.as_str());
}

// ------------------------------------------------------------------ dead letters

/// A receiver that answers 404 (or 410) is not retried forever at the head of
/// its queue: each notification gets one attempt and is dead-lettered, the
/// other webhooks get `alert_sink_failing`, and later alerts still go out.
#[tokio::test(start_paused = true)]
async fn a_gone_receiver_is_dead_lettered_without_blocking_anything() {
    let gone = Receiver::start().await;
    gone.set(Mode::Fail(404));
    let ok = Receiver::start().await;
    let n = Running::start(vec![json_sink(&gone), json_sink(&ok)], shipped());
    let (a, b) = (drift("a", Severity::High), drift("b", Severity::High));
    n.update(std::slice::from_ref(&a), t(0));
    eventually("a's trigger tried", WAIT, async || gone.attempts() >= 1).await;
    // Once tried, never retried (several retry intervals go by).
    tokio::time::sleep(QUIET).await;
    assert_eq!(gone.attempts(), 1, "a 404 is not retried");

    // The next sweep tells the other webhook, and b still reaches `gone`'s queue.
    n.update(&[a.clone(), b.clone()], t(1));
    let bodies = ok.expect(3).await;
    let failing: Vec<&Value> = bodies
        .iter()
        .filter(|b| b["event"] == "alert_sink_failing")
        .collect();
    assert_eq!(failing.len(), 1, "{bodies:#?}");
    let f = failing[0];
    assert_eq!(
        (&f["status"], &f["severity"]),
        (&"firing".into(), &"high".into())
    );
    let summary = f["summary"].as_str().unwrap();
    assert!(
        summary.contains("json") && summary.contains("HTTP 404"),
        "{summary}"
    );
    assert!(!summary.contains("127.0.0.1"), "no URL: {summary}");
    eventually("b's trigger tried", WAIT, async || gone.attempts() >= 2).await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(gone.attempts(), 2);

    // The receiver is fixed: the next alert goes out at once, the dead ones do
    // not come back, and the still-firing alerts are triggered again for it.
    gone.set(Mode::Accept);
    let c = drift("c", Severity::High);
    n.update(&[a.clone(), b.clone(), c.clone()], t(2));
    let got = gone.expect(1).await;
    assert_eq!(seq(&got)[0], s("drift_detected", "firing", "c", false));
    eventually("the delivery counted", WAIT, async || {
        n.notifier.stats()[0].delivered >= 1
    })
    .await;
    n.update(&[a.clone(), b.clone(), c.clone()], t(3));
    let got = seq(&gone.expect(3).await);
    assert_eq!(
        got[1..],
        [
            s("drift_detected", "firing", "a", false),
            s("drift_detected", "firing", "b", false),
        ]
    );
    // …and the other webhook hears that it recovered.
    let resolved = ok.expect(5).await;
    assert!(
        resolved
            .iter()
            .any(|b| b["event"] == "alert_sink_recovered" && b["status"] == "resolved"),
        "{resolved:#?}"
    );
    n.stop().await;
}

// ------------------------------------------------------------------ restarts

/// `shipped()` with the state in `path`.
fn persisted(path: &std::path::Path) -> NotifierOptions {
    NotifierOptions {
        state_file: Some(path.to_owned()),
        save_interval: Duration::from_millis(20),
        ..shipped()
    }
}

/// Two notifiers, one after the other, sharing a state file: what the first
/// paged is not paged again by the second, and what cleared in between is
/// resolved by it.
#[tokio::test(start_paused = true)]
async fn a_restart_resolves_what_cleared_and_pages_nothing_again() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("alert-state.json");
    let rx = Receiver::start().await;
    let (a, b) = (drift("a", Severity::High), drift("b", Severity::High));

    let first = Running::start(vec![json_sink(&rx)], persisted(&state));
    first.update(&[a.clone(), b.clone()], t(0));
    rx.expect(2).await;
    first.stop().await;

    // Meanwhile `a` reached the tip; `b` still drifts.
    let second = Running::start(vec![json_sink(&rx)], persisted(&state));
    assert_eq!(second.notifier.restored_alerts(), [a.clone(), b.clone()]);
    assert_eq!(second.notifier.stats()[0].firing, 2);
    second.update(std::slice::from_ref(&b), t(5));
    let got = seq(&rx.expect(3).await);
    assert_eq!(got[2], s("drift_resolved", "resolved", "a", false));
    // `b` was notified at t(0): its repeat is due at t(30), not before.
    second.update(std::slice::from_ref(&b), t(29));
    second.update(std::slice::from_ref(&b), t(30));
    let got = seq(&rx.expect(4).await);
    assert_eq!(got[3], s("drift_detected", "firing", "b", true));
    tokio::time::sleep(QUIET).await;
    assert_eq!(rx.accepted().len(), 4, "{:#?}", rx.bodies());
    second.stop().await;
}

/// What could not be delivered before shutdown (receiver down, flush
/// deadline passed) is delivered by the next notifier, in order, one-shot
/// events included, without waiting for a sweep.
#[tokio::test(start_paused = true)]
async fn notifications_queued_at_shutdown_are_delivered_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("alert-state.json");
    let rx = Receiver::start().await;
    rx.set(Mode::Fail(503));

    let first = Running::start(vec![json_sink(&rx)], persisted(&state));
    let a = drift("a", Severity::High);
    first.notifier.update(
        std::slice::from_ref(&a),
        &[event(EventKind::ActionFailed, "a")],
        t(0),
    );
    eventually("an attempt", WAIT, async || rx.attempts() >= 1).await;
    first.stop().await;
    assert!(rx.accepted().is_empty());

    rx.set(Mode::Accept);
    let second = Running::start(vec![json_sink(&rx)], persisted(&state));
    assert_eq!(second.notifier.queued(), 2);
    let bodies = rx.expect(2).await;
    assert_eq!(
        seq(&bodies),
        [
            s("drift_detected", "firing", "a", false),
            s("action_failed", "event", "a", false),
        ]
    );
    assert_eq!(
        bodies[0]["at"], "2026-05-01T12:00:00Z",
        "the original trigger"
    );
    // Still firing: nothing new.
    second.update(std::slice::from_ref(&a), t(1));
    tokio::time::sleep(QUIET).await;
    assert_eq!(rx.accepted().len(), 2);
    second.stop().await;
}

/// A state file that cannot be used (not JSON, another document, another
/// version) is moved aside with a WARN naming it, and the notifier starts
/// with empty state and writes a valid file.
#[tokio::test(start_paused = true)]
async fn an_unusable_state_file_is_moved_aside_and_named() {
    let logs = captured_logs();
    for (i, content) in [
        "{\"kind\": \"fleet-reconciler/alert-st",
        "{\"kind\": \"fleet-reconciler/alert-state\", \"version\": 99}",
        "[1, 2, 3]",
    ]
    .into_iter()
    .enumerate()
    {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join(format!("state-{i}.json"));
        std::fs::write(&state, content).unwrap();
        let rx = Receiver::start().await;
        let n = Running::start(vec![json_sink(&rx)], persisted(&state));
        assert!(n.notifier.restored_alerts().is_empty());
        assert_eq!(n.notifier.stats()[0].firing, 0);
        let aside: Vec<std::path::PathBuf> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains(".corrupt-"))
            .collect();
        assert_eq!(aside.len(), 1, "{aside:?}");
        assert_eq!(std::fs::read_to_string(&aside[0]).unwrap(), content);
        let logged = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
        let line = logged
            .lines()
            .find(|l| l.contains("moved aside") && l.contains(&*state.to_string_lossy()))
            .unwrap_or_else(|| panic!("no WARN naming {}:\n{logged}", state.display()));
        assert!(
            line.contains("WARN") && line.contains(&*aside[0].to_string_lossy()),
            "{line}"
        );
        if i == 1 {
            assert!(line.contains("unknown version Some(99)"), "{line}");
        }

        n.update(&[drift("a", Severity::High)], t(0));
        rx.expect(1).await;
        n.stop().await;
        let saved: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
        assert_eq!(saved["kind"], "fleet-reconciler/alert-state");
        assert_eq!(saved["version"], 1);
        assert_eq!(saved["sinks"][0]["firing"].as_object().unwrap().len(), 1);
    }
}

/// The file is private (0600, in a 0700 directory it creates), written by
/// rename (no temp file left), and names webhooks only by format and variable.
#[tokio::test(start_paused = true)]
async fn the_state_file_is_private_and_holds_no_secret() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("new/alerts/state.json");
    let rx = Receiver::start().await;
    let mut signed = hook(WebhookFormat::Json, Severity::Low);
    signed.secret_env = Some("WEBHOOK_SECRET".into());
    let sink = SinkSecrets {
        hmac_secret: Some("hmac-sekrit-in-state".into()),
        ..plain(rx.url("/hooks/SEKRIT-PATH"))
    };
    let n = Running::start(vec![(signed, sink)], persisted(&state));
    n.update(&[drift("a", Severity::High)], t(0));
    rx.expect(1).await;
    n.stop().await;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o600);
    assert_eq!(mode(&dir.path().join("new/alerts")), 0o700);
    assert_eq!(mode(&dir.path().join("new")), 0o700);
    let names: Vec<_> = std::fs::read_dir(dir.path().join("new/alerts"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["state.json"]);
    let text = std::fs::read_to_string(&state).unwrap();
    for secret in ["SEKRIT-PATH", "hmac-sekrit-in-state", "127.0.0.1"] {
        assert!(!text.contains(secret), "{secret} in the state file");
    }
    let saved: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(saved["sinks"][0]["format"], "json");
    assert_eq!(saved["sinks"][0]["url_env"], "WEBHOOK_URL");
}

/// Dead letters are counted, kept in the state file with their error, and
/// survive a restart, as does the failing state (no second page of
/// `alert_sink_failing`).
#[tokio::test(start_paused = true)]
async fn dead_letters_are_counted_kept_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("alert-state.json");
    let gone = Receiver::start().await;
    gone.set(Mode::Fail(410));
    let ok = Receiver::start().await;
    let mut pd = hook(WebhookFormat::Slack, Severity::Low);
    pd.url_env = "GONE_URL".into();
    let sinks = || vec![(pd.clone(), plain(gone.url("/h"))), json_sink(&ok)];
    let first = Running::start(sinks(), persisted(&state));
    let a = drift("a", Severity::High);
    first.update(std::slice::from_ref(&a), t(0));
    eventually("dead-lettered", WAIT, async || {
        first.notifier.stats()[0].failing
    })
    .await;
    let stats = &first.notifier.stats()[0];
    assert_eq!(
        (
            stats.dead_lettered,
            stats.dead_letters,
            stats.queued,
            stats.failed_attempts
        ),
        (1, 1, 0, 1),
        "{stats:?}"
    );
    first.update(std::slice::from_ref(&a), t(1));
    let bodies = ok.expect(2).await;
    assert_eq!(bodies[1]["event"], "alert_sink_failing");
    assert_eq!(bodies[1]["details"]["sinks"], "0:slack:GONE_URL");
    assert_eq!(bodies[1]["details"]["dead_letters"], "1");
    first.stop().await;

    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    let dead = &saved["sinks"][0]["dead_letters"];
    assert_eq!(dead.as_array().unwrap().len(), 1, "{saved:#}");
    assert_eq!(dead[0]["error"], "HTTP 410");
    assert_eq!(dead[0]["notification"]["event"], "drift_detected");
    assert_eq!(saved["sinks"][0]["failing"]["reason"], "HTTP 410");

    let second = Running::start(sinks(), persisted(&state));
    let stats = &second.notifier.stats()[0];
    assert!(stats.failing && stats.dead_letters == 1, "{stats:?}");
    second.update(std::slice::from_ref(&a), t(2));
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        ok.accepted().len(),
        2,
        "nothing paged again: {:#?}",
        ok.bodies()
    );
    assert_eq!(gone.attempts(), 1, "nothing new for the failing sink");
    second.stop().await;
}

/// A sink that keeps failing transiently is declared failing after
/// `dead_letter_after` attempts in a row; then each notification gets one
/// attempt, and nothing waits at the head of its queue.
#[tokio::test(start_paused = true)]
async fn a_receiver_failing_for_long_is_dead_lettered_after_the_bound() {
    let rx = Receiver::start().await;
    rx.set(Mode::Fail(503));
    let options = NotifierOptions {
        dead_letter_after: 3,
        ..shipped()
    };
    let n = Running::start(vec![json_sink(&rx)], options);
    n.update(
        &[drift("a", Severity::High), drift("b", Severity::High)],
        t(0),
    );
    eventually("both dead-lettered", WAIT, async || {
        n.notifier.stats()[0].dead_letters == 2
    })
    .await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(rx.attempts(), 4, "a: 3 attempts, then b: 1");
    let stats = &n.notifier.stats()[0];
    assert!(stats.failing && stats.queued == 0, "{stats:?}");
    n.stop().await;
}

// ------------------------------------------------------------------ carried over a restart

/// A sweep's snapshot with these (machine, status) in app agents-prod, tip
/// COMMIT, none judged.
fn report(machines: &[(&str, &str)]) -> Snapshot {
    use fleet_reconciler::observe::sweep::{Observation, ObservedMachine, SlotsView, TipReport};
    let machines = machines
        .iter()
        .map(|(id, status)| ObservedMachine {
            region: "ams".into(),
            status: serde_json::from_value(Value::from(*status)).unwrap(),
            ..ObservedMachine::listed("agents-prod", id, id, "started".into())
        })
        .collect();
    let observation = Observation {
        tip: TipReport {
            branch: "release".into(),
            commit: CommitId::parse(COMMIT).unwrap(),
        },
        apps: Vec::new(),
        machines,
        slots: SlotsView::NotConfigured,
        halts: Default::default(),
        gate: Default::default(),
    };
    Snapshot::judged(observation, |_| None)
}

/// After a restart the planner raises a drift alert only `min_drift_age`
/// after it sees the drift again: until then the alert from before is
/// carried, unless the sweep shows it cleared.
#[test]
fn restored_machine_alerts_are_carried_until_confirmed_or_cleared() {
    let restored = [
        drift("on-tip", Severity::High),
        drift("gone", Severity::High),
        drift("stopped", Severity::High),
        drift("drifting", Severity::High),
        drift("unreachable", Severity::High),
        Alert {
            commit: CommitId::parse(&"e".repeat(40)),
            ..drift("old-tip", Severity::High)
        },
        // Fleet-level: not carried here (see FleetAlertTracker::restore).
        Alert {
            app: None,
            machine_id: None,
            commit: None,
            ..drift("x", Severity::High)
        },
    ];
    let mut carry = RestoredMachineAlerts::new(&restored, Duration::from_secs(150));
    assert_eq!(carry.carried().len(), 6, "failed sweeps carry all of them");
    let sweep = report(&[
        ("on-tip", "on_tip"),
        ("stopped", "not_running"),
        ("drifting", "drifted"),
        ("unreachable", "unreachable"),
        ("old-tip", "drifted"),
    ]);
    let machines = |alerts: Vec<Alert>| -> Vec<String> {
        alerts
            .into_iter()
            .filter_map(|a| a.machine_id.map(String::from))
            .collect()
    };
    assert_eq!(
        machines(carry.after_sweep(&sweep, &[], t(0))),
        ["drifting", "unreachable"]
    );
    // Still within min_drift_age + margin of the first sweep that saw it drifted.
    assert_eq!(
        machines(carry.after_sweep(&sweep, &[], t(2))),
        ["drifting", "unreachable"]
    );
    // The planner raises it: it is the planner's again.
    let planned = [drift("drifting", Severity::High)];
    assert_eq!(
        machines(carry.after_sweep(&sweep, &planned, t(2))),
        ["unreachable"]
    );
    assert_eq!(machines(carry.carried()), ["unreachable"]);

    // Not raised within the grace: dropped (so resolved).
    let mut carry = RestoredMachineAlerts::new(&restored, Duration::from_secs(150));
    carry.after_sweep(&sweep, &[], t(0));
    assert_eq!(
        machines(carry.after_sweep(&sweep, &[], t(3))),
        ["unreachable"]
    );
}

/// Fleet alerts from before a restart: coherence keeps its clock (no new
/// wait of `coherence_for`), sweep_failing holds until a sweep succeeds and
/// tip_stale until a fetch does.
#[test]
fn restored_fleet_alerts_keep_firing_until_the_evidence_clears_them() {
    let c = sample(&[("a", 1, 2), ("b", 2, 2)]);
    let mut before = FleetAlertTracker::new(rules());
    before.evaluate(&healthy(&c, t(0)), t(0));
    let firing = before.evaluate(&healthy(&c, t(20)), t(20));
    assert_eq!(
        keys(&firing),
        [
            "fleet-reconciler/coherence_below_threshold/*/*/*",
            "fleet-reconciler/coherence_below_threshold/a/*/*",
        ]
    );
    let failing = Alert {
        kind: AlertKind::SweepFailing,
        ..firing[0].clone()
    };
    let stale = Alert {
        kind: AlertKind::TipStale,
        ..firing[0].clone()
    };
    let restored = [firing.clone(), vec![failing, stale]].concat();

    // A failed sweep first: everything still fires.
    let mut after = FleetAlertTracker::new(rules());
    after.restore(&restored);
    let failed = FleetAlertInput {
        coherence: None,
        last_sweep_success: None,
        consecutive_sweep_failures: 1,
        last_tip_fetch: None,
        tip_commit: None,
    };
    let got = after.evaluate(&failed, t(30));
    assert_eq!(
        keys(&got),
        [
            "fleet-reconciler/coherence_below_threshold/*/*/*",
            "fleet-reconciler/coherence_below_threshold/a/*/*",
            "fleet-reconciler/sweep_failing/*/*/*",
            "fleet-reconciler/tip_stale/*/*/*",
        ]
    );
    assert_eq!(got[1].details["below_since"], "2026-05-01T12:00:00Z");
    // A good sweep: coherence still below (keeps firing from its old clock),
    // sweeps and fetches work again.
    let got = after.evaluate(&healthy(&c, t(31)), t(31));
    assert_eq!(
        keys(&got),
        [
            "fleet-reconciler/coherence_below_threshold/*/*/*",
            "fleet-reconciler/coherence_below_threshold/a/*/*",
        ]
    );
    // And a sweep that sees coherence restored resolves it.
    let ok = sample(&[("a", 2, 2), ("b", 2, 2)]);
    assert!(after.evaluate(&healthy(&ok, t(32)), t(32)).is_empty());
}

// ------------------------------------------------------------------ grouped incidents and links

fn drift_in(app: &str, machine: &str, pool: &str, severity: Severity) -> Alert {
    Alert {
        app: Some(app.into()),
        details: BTreeMap::from([
            ("pool".into(), pool.into()),
            ("region".into(), "iad".into()),
            (
                "severity_rule".into(),
                "rule #1: level = \"high\", min_commits_behind = 20".into(),
            ),
        ]),
        ..drift(machine, severity)
    }
}

fn approval(app: &str, machine: &str) -> Alert {
    Alert {
        kind: AlertKind::ManualApprovalRequired,
        summary: format!("{machine} needs an operator"),
        ..drift_in(app, machine, "default", Severity::High)
    }
}

fn grouped(group_by: &[GroupField], webhooks: Vec<WebhookConfig>) -> AlertsConfig {
    AlertsConfig {
        group_by: group_by.to_vec(),
        webhooks,
        runbook_url: "https://runbooks.example/ops.md".into(),
        ..AlertsConfig::default()
    }
}

fn public() -> NotifierOptions {
    NotifierOptions {
        public_url: Some(PublicUrl::parse("https://fleet.example.com/base").unwrap()),
        ..shipped()
    }
}

/// Manual approvals waiting for one tip are one incident per app, beside the
/// drift incidents: not a second incident per machine.
#[tokio::test(start_paused = true)]
async fn approvals_are_one_incident_per_app_and_tip() {
    let rx = Receiver::start().await;
    let n = Running::start_with(
        grouped(
            &DEFAULT_GROUP_BY,
            vec![hook(WebhookFormat::Json, Severity::Low)],
        ),
        vec![plain(rx.url("/h"))],
        public(),
    );
    let mut alerts = Vec::new();
    for m in ["m1", "m2", "m3"] {
        alerts.push(drift_in("agents-a", m, "default", Severity::High));
        alerts.push(approval("agents-a", m));
    }
    alerts.push(drift_in("agents-b", "m4", "default", Severity::High));
    alerts.push(approval("agents-b", "m4"));
    n.update(&alerts, t(0));
    let bodies = rx.expect(4).await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(rx.accepted().len(), 4, "{bodies:#?}");
    let keys: BTreeSet<&str> = bodies
        .iter()
        .map(|b| b["dedup_key"].as_str().unwrap())
        .collect();
    assert_eq!(
        keys,
        BTreeSet::from([
            format!("fleet-reconciler/drift_detected/agents-a/*/{COMMIT}/severity=high").as_str(),
            format!("fleet-reconciler/drift_detected/agents-b/*/{COMMIT}/severity=high").as_str(),
            format!("fleet-reconciler/manual_approval_required/agents-a/*/{COMMIT}").as_str(),
            format!("fleet-reconciler/manual_approval_required/agents-b/*/{COMMIT}").as_str(),
        ])
    );
    let a = bodies
        .iter()
        .find(|b| b["event"] == "manual_approval_required" && b["app"] == "agents-a")
        .unwrap();
    assert!(
        a["summary"].as_str().unwrap().starts_with(
            "3 machines of agents-a await approval for release tip 0123456: m1, m2, m3"
        ),
        "{}",
        a["summary"]
    );
    assert_eq!(a["machine_id"], Value::Null);
    assert_eq!(a["details"]["machines"], "3");
    assert_eq!(a["details"]["machine_ids"], "m1, m2, m3");
    assert_eq!(
        a["details"]["runbook_url"],
        "https://runbooks.example/ops.md#manual_approval_required"
    );
    assert_eq!(
        a["details"]["status_url"],
        "https://fleet.example.com/base/"
    );
    assert!(
        a["details"].get("machine_url").is_none(),
        "a group has no one machine page"
    );
    n.stop().await;
}

/// One group, one incident: triggered once, updated as machines join or
/// converge (not when only text changes), resolved when empty; its repeat
/// schedule and its members survive a restart (nothing paged again).
#[tokio::test(start_paused = true)]
async fn a_group_is_updated_as_machines_join_and_converge_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("alert-state.json");
    let rx = Receiver::start().await;
    let config = || {
        grouped(
            &DEFAULT_GROUP_BY,
            vec![hook(WebhookFormat::Json, Severity::Low)],
        )
    };
    let options = || NotifierOptions {
        public_url: public().public_url,
        ..persisted(&state)
    };
    let m = |id: &str| drift_in("agents", id, "default", Severity::Medium);
    let first = Running::start_with(config(), vec![plain(rx.url("/h"))], options());
    first.update(&[m("m1"), m("m2")], t(0));
    rx.expect(1).await;
    // Only a summary changed (commits behind): not news.
    let mut m2 = m("m2");
    m2.summary = "m2 is 4 commits behind".into();
    first.update(&[m("m1"), m2], t(1));
    first.update(&[m("m1"), m("m2"), m("m3")], t(2));
    rx.expect(2).await;
    first.stop().await;

    let second = Running::start_with(config(), vec![plain(rx.url("/h"))], options());
    second.update(&[m("m1"), m("m2"), m("m3")], t(3));
    second.update(&[m("m3")], t(4));
    rx.expect(3).await;
    // Empty for less than alerts.resolve_after (90 s): held, not resolved.
    second.update(&[], t(5));
    second.update(&[], t(5) + chrono::Duration::seconds(89));
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        rx.bodies().len(),
        3,
        "held open while empty for < resolve_after"
    );
    second.update(&[], t(5) + chrono::Duration::seconds(90));
    let bodies = rx.expect(4).await;
    tokio::time::sleep(QUIET).await;
    let got: Vec<(String, bool, String)> = rx
        .bodies()
        .iter()
        .map(|b| {
            (
                b["status"].as_str().unwrap().to_owned(),
                b["update"].as_bool().unwrap(),
                b["details"]["machines"].as_str().unwrap_or("-").to_owned(),
            )
        })
        .collect();
    let e = |status: &str, update: bool, n: &str| (status.to_owned(), update, n.to_owned());
    assert_eq!(
        got,
        [
            e("firing", false, "2"),
            e("firing", true, "3"),
            e("firing", true, "1"),
            e("resolved", false, "1"),
        ],
        "{bodies:#?}"
    );
    let keys: BTreeSet<&str> = bodies
        .iter()
        .map(|b| b["dedup_key"].as_str().unwrap())
        .collect();
    assert_eq!(keys.len(), 1, "one incident: {keys:?}");
    assert!(
        bodies[3]["summary"]
            .as_str()
            .unwrap()
            .starts_with("Resolved: 1 machine of agents trails")
    );
    second.stop().await;
}

/// The bounded list: ten machines named in the summary, the rest counted.
#[test]
fn a_large_group_names_ten_machines_and_counts_the_rest() {
    let config = grouped(
        &[GroupField::App, GroupField::Tip],
        vec![hook(WebhookFormat::Json, Severity::Low)],
    );
    let alerts: Vec<Alert> = (0..60)
        .map(|i| drift_in("agents", &format!("m{i:02}"), "default", Severity::Low))
        .collect();
    // No delivery runs: what would be sent is read from the state file.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("s.json");
    let n = Notifier::with_options(
        &config,
        vec![plain("http://127.0.0.1:9/h".into())],
        persisted(&state),
    )
    .unwrap();
    n.update(&alerts, &[], t(0));
    n.save().unwrap();
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    let queued = &saved["sinks"][0]["queue"][0];
    let summary = queued["summary"].as_str().unwrap();
    assert!(
        summary.starts_with(
            "60 machines of agents trail release tip 0123456 (severity low): m00, m01"
        ),
        "{summary}"
    );
    assert!(summary.ends_with("m09 and 50 more"), "{summary}");
    let ids = queued["details"]["machine_ids"].as_str().unwrap();
    assert!(
        ids.ends_with(&format!("m{:02} and 10 more", DETAIL_MACHINES - 1)),
        "{ids}"
    );
    assert_eq!(saved["sinks"][0]["firing"].as_object().unwrap().len(), 1);
    // The state file's own alerts stay per machine (a restart carries them).
    assert_eq!(saved["alerts"].as_array().unwrap().len(), 60);
}

/// Every payload links where to act: the runbook section of its kind, the
/// status page, the machine page of a machine alert, the release tip and
/// the rule that decided the severity; in each format's own place.
#[tokio::test(start_paused = true)]
async fn payloads_link_the_runbook_the_pages_the_tip_and_the_rule() {
    let (json_rx, slack_rx, pd_rx) = (
        Receiver::start().await,
        Receiver::start().await,
        Receiver::start().await,
    );
    let config = grouped(
        &[GroupField::Machine],
        vec![
            hook(WebhookFormat::Json, Severity::Low),
            hook(WebhookFormat::Slack, Severity::Low),
            hook(WebhookFormat::Pagerduty, Severity::Low),
        ],
    );
    let n = Running::start_with(
        config,
        vec![
            plain(json_rx.url("/h")),
            plain(slack_rx.url("/h")),
            SinkSecrets {
                routing_key: Some("rk".into()),
                ..plain(pd_rx.url("/v2/enqueue"))
            },
        ],
        public(),
    );
    let stale = Alert {
        kind: AlertKind::TipStale,
        app: None,
        machine_id: None,
        commit: None,
        severity: Severity::High,
        summary: "The overlay release branch has not been fetched for 20m".into(),
        details: BTreeMap::new(),
    };
    n.update(
        &[drift_in("agents", "m1", "default", Severity::High), stale],
        t(0),
    );
    let json = json_rx.expect(2).await;
    let d = json
        .iter()
        .find(|b| b["event"] == "drift_detected")
        .unwrap();
    assert_eq!(
        d["details"]["runbook_url"],
        "https://runbooks.example/ops.md#drift_detected"
    );
    assert_eq!(
        d["details"]["status_url"],
        "https://fleet.example.com/base/"
    );
    assert_eq!(
        d["details"]["machine_url"],
        "https://fleet.example.com/base/machines/m1"
    );
    assert_eq!(d["details"]["tip"], COMMIT);
    assert_eq!(
        d["details"]["severity_rule"],
        "rule #1: level = \"high\", min_commits_behind = 20"
    );
    let s = json.iter().find(|b| b["event"] == "tip_stale").unwrap();
    assert_eq!(
        s["details"]["runbook_url"],
        "https://runbooks.example/ops.md#tip_stale"
    );
    assert_eq!(
        s["details"]["severity_rule"],
        "tip_stale is always high (docs/alerts.md)"
    );
    assert!(s["details"].get("machine_url").is_none());

    let slack = slack_rx.expect(2).await;
    let context = slack
        .iter()
        .find(|b| b["text"].as_str().unwrap().contains("drift_detected"))
        .unwrap()["blocks"][2]["elements"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        context.contains("<https://runbooks.example/ops.md#drift_detected|Runbook>")
            && context.contains("<https://fleet.example.com/base/|Status page>")
            && context.contains("<https://fleet.example.com/base/machines/m1|Machine page>"),
        "{context}"
    );

    let pd = pd_rx.expect(2).await;
    let p = pd
        .iter()
        .find(|b| b["payload"]["class"] == "drift_detected")
        .unwrap();
    let links: Vec<(&str, &str)> = p["links"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["text"].as_str().unwrap(), l["href"].as_str().unwrap()))
        .collect();
    assert_eq!(
        links,
        [
            ("Runbook", "https://runbooks.example/ops.md#drift_detected"),
            ("Status page", "https://fleet.example.com/base/"),
            ("Machine page", "https://fleet.example.com/base/machines/m1"),
        ]
    );
    assert_eq!(p["client_url"], "https://fleet.example.com/base/");
    n.stop().await;
}

/// Each alert kind's runbook anchor is a section of docs/operations.md.
#[test]
fn every_runbook_anchor_is_a_section_of_the_operations_guide() {
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let anchors: BTreeSet<String> = guide
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            l.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == '_' || *c == '-' || *c == ' ')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect();
    let kinds = [
        AlertKind::Drift,
        AlertKind::ManualApprovalRequired,
        AlertKind::RotationStuck,
        AlertKind::CoherenceBelowThreshold,
        AlertKind::TipStale,
        AlertKind::SweepFailing,
        AlertKind::AppUnlistable,
        AlertKind::RotationFailed,
        AlertKind::CoordinatorUnreadable,
        AlertKind::SinkFailing,
    ];
    for kind in kinds {
        let anchor = runbook_anchor(kind);
        assert!(
            anchors.contains(anchor),
            "docs/operations.md has no section #{anchor}"
        );
    }
    assert!(anchors.contains("action_failed"));
}

/// Pins, byte for byte, every alert the fleet rules and the restored machine
/// alerts produce over a sequence of turns (trigger, repeat, failed sweeps,
/// stale tip, restart with the state's alerts, clear), so that moving the
/// rules (issue 35) changes no payload. `UPDATE_SCHEMA=1` rewrites the pin.
#[test]
fn fleet_alert_sequence_is_pinned_byte_for_byte() {
    let mut log: Vec<(String, Vec<Alert>)> = Vec::new();
    let mut tracker = FleetAlertTracker::new(rules());
    let below = sample(&[("a", 3, 4), ("b", 4, 4)]);
    let ok = sample(&[("a", 4, 4), ("b", 4, 4)]);
    let failed =
        |failures: u32, last: DateTime<Utc>, fetch: Option<DateTime<Utc>>| FleetAlertInput {
            coherence: None,
            last_sweep_success: Some(last),
            consecutive_sweep_failures: failures,
            last_tip_fetch: fetch,
            tip_commit: None,
        };
    for m in [0, 16, 17] {
        let got = tracker.evaluate(&healthy(&below, t(m)), t(m));
        log.push((format!("below t{m}"), got));
    }
    for (n, m) in [(1, 18), (2, 19), (3, 20), (4, 21)] {
        let got = tracker.evaluate(&failed(n, t(17), Some(t(17))), t(m));
        log.push((format!("failed {n} t{m}"), got));
    }
    let firing = log.last().map(|(_, a)| a.clone()).unwrap_or_default();
    let got = tracker.evaluate(&healthy(&ok, t(22)), t(22));
    log.push(("cleared t22".into(), got));

    // A restart with what fired before, machine alerts included.
    let mut after = FleetAlertTracker::new(rules());
    let restored_all = [
        firing,
        vec![
            drift("drifting", Severity::High),
            drift("gone", Severity::High),
        ],
    ]
    .concat();
    after.restore(&restored_all);
    let mut carry = RestoredMachineAlerts::new(&restored_all, Duration::from_secs(150));
    let got = after.evaluate(&failed(1, t(29), None), t(30));
    log.push((
        "restored failed t30".into(),
        [carry.carried(), got].concat(),
    ));
    let sweep = report(&[("drifting", "drifted")]);
    let got = after.evaluate(&healthy(&below, t(31)), t(31));
    log.push((
        "restored swept t31".into(),
        [carry.after_sweep(&sweep, &[], t(31)), got].concat(),
    ));
    let got = after.evaluate(&healthy(&ok, t(35)), t(35));
    log.push((
        "restored swept t35".into(),
        [carry.after_sweep(&sweep, &[], t(35)), got].concat(),
    ));

    let text = log
        .iter()
        .map(|(step, alerts)| {
            format!(
                "== {step}\n{}\n",
                serde_json::to_string_pretty(alerts).unwrap()
            )
        })
        .collect::<String>();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/notify_pins/fleet_alerts.txt");
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let pinned = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        pinned == text,
        "alerts differ from {}:\n{text}",
        path.display()
    );
}

/// Pins, byte for byte, what each webhook format sends (bodies, signature
/// headers) over a sequence: triggers and events, a group joined, a repeat,
/// a failure resolved by a success, a resolve. `UPDATE_SCHEMA=1` rewrites
/// the pin.
#[tokio::test(start_paused = true)]
async fn webhook_payloads_are_pinned_byte_for_byte() {
    let rxs = [
        Receiver::start().await,
        Receiver::start().await,
        Receiver::start().await,
    ];
    let mut json = hook(WebhookFormat::Json, Severity::Low);
    json.secret_env = Some("WEBHOOK_SECRET".into());
    let sinks = vec![
        SinkSecrets {
            hmac_secret: Some("whsec-pin-0001".into()),
            ..plain(rxs[0].url("/json"))
        },
        plain(rxs[1].url("/slack")),
        SinkSecrets {
            routing_key: Some("R0UTINGKEY0000000000000000000000".into()),
            ..plain(rxs[2].url("/pd"))
        },
    ];
    let config = AlertsConfig {
        resolve_after: Duration::ZERO,
        ..grouped(
            &DEFAULT_GROUP_BY,
            vec![
                json,
                hook(WebhookFormat::Slack, Severity::Low),
                hook(WebhookFormat::Pagerduty, Severity::Low),
            ],
        )
    };
    let options = NotifierOptions {
        clock: Arc::new(TokioClock::starting_at(t(0))),
        ..public()
    };
    let n = Running::start_with(config, sinks, options);
    let a = drift_in("agents-prod", "m-a", "default", Severity::High);
    let b = drift_in("agents-prod", "m-b", "default", Severity::High);
    let failed = event(EventKind::ActionFailed, "m-a");
    let started = event(EventKind::ActionStarted, "m-b");
    let succeeded = event(EventKind::ActionSucceeded, "m-a");
    // Each update waits for the last one's deliveries: an incident with a
    // notification queued is not updated (it would stack).
    let delivered = async |counts: [usize; 3]| {
        for (rx, n) in rxs.iter().zip(counts) {
            rx.expect(n).await;
        }
    };
    n.notifier
        .update(std::slice::from_ref(&a), &[started, failed], t(0));
    delivered([3, 3, 2]).await;
    n.notifier.update(&[a.clone(), b.clone()], &[], t(1));
    delivered([4, 4, 3]).await;
    n.notifier.update(&[a.clone(), b.clone()], &[], t(32));
    delivered([5, 5, 4]).await;
    n.notifier
        .update(&[a, b, approval("agents-prod", "m-c")], &[succeeded], t(33));
    delivered([7, 7, 6]).await;
    n.notifier.update(&[], &[], t(40));
    delivered([9, 9, 8]).await;
    n.stop().await;

    let mut text = String::new();
    for rx in &rxs {
        for r in rx.accepted() {
            text.push_str(&format!("== {}\n", r.path_and_query));
            // The stamp is the delivery's time (paused time moves while the
            // test waits): the signature is checked against it, not pinned.
            if let Some(ts) = r.headers.get("X-Fleet-Timestamp") {
                let ts: i64 = ts.to_str().unwrap().parse().unwrap();
                let signature = r.headers.get("X-Fleet-Signature").unwrap();
                assert_eq!(
                    signature.to_str().unwrap(),
                    fleet_reconciler::report::notify::sign(b"whsec-pin-0001", ts, &r.body)
                );
                text.push_str("signed\n");
            }
            if let Some(v) = r.headers.get("content-type") {
                text.push_str(&format!("content-type: {}\n", v.to_str().unwrap()));
            }
            text.push_str(std::str::from_utf8(&r.body).unwrap());
            text.push('\n');
        }
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/notify_pins/webhooks.txt");
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let pinned = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        pinned == text,
        "payloads differ from {}:\n{text}",
        path.display()
    );
}

/// Deliveries are counted where they happen, through the metrics' hook
/// alone (no reporter in between): a failed attempt, a dead letter, a
/// delivery, each once, per sink kind.
#[tokio::test(start_paused = true)]
async fn deliveries_are_counted_as_they_happen() {
    let metrics = fleet_reconciler::report::metrics::Metrics::new(false).unwrap();
    let rx = Receiver::start().await;
    rx.set(Mode::Fail(500));
    let options = NotifierOptions {
        counter: metrics.delivery_counter(),
        dead_letter_after: 2,
        ..shipped()
    };
    let n = Running::start(vec![json_sink(&rx)], options);
    n.update(&[drift("m1", Severity::High)], t(0));
    eventually("two failed attempts", WAIT, async || rx.attempts() >= 2).await;
    rx.set(Mode::Accept);
    n.update(
        &[drift("m1", Severity::High), drift("m2", Severity::High)],
        t(1),
    );
    rx.expect(1).await;
    n.stop().await;
    let text = metrics.render().unwrap();
    let count = |result: &str| {
        let head = format!(
            "fleet_reconciler_webhook_deliveries_total{{format=\"json\",result=\"{result}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(head.as_str()))
            .map(str::to_owned)
    };
    assert_eq!(count("failed").as_deref(), Some("2"), "{text}");
    assert_eq!(count("dead_lettered").as_deref(), Some("1"), "{text}");
    assert!(count("delivered").is_some_and(|n| n != "0"), "{text}");
}

//! The HTTP server over real loopback HTTP: health and readiness, the fleet
//! API, admin controls writing metadata on the simulated Fly API, the refresh
//! hook, the status page, and the `status` client.
//!
//! The tests run on tokio's paused clock, which the sim and the server both
//! read (`Harness::clock`): staleness, limits and timeouts are exact, and no
//! wait costs real time. Only the hand-run screenshot server runs on real time.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use fleet_reconciler::act::executor::{Declined, Outcome};
use fleet_reconciler::act::operator::Operator;
use fleet_reconciler::clock::{SharedClock, TokioClock};
use fleet_reconciler::config::{Config, HealthUrlTemplate};
use fleet_reconciler::daemon::{self, Secrets};
use fleet_reconciler::decide::Snapshot;
use fleet_reconciler::decide::decision::Decision;
use fleet_reconciler::demo;
use fleet_reconciler::metadata::marker::{Marker, Phase, RotationMode};
use fleet_reconciler::metadata::operator::{Approval, ApprovalMode, Hold};
use fleet_reconciler::metadata::{APPROVE_KEY, HOLD_KEY, MARKER_KEY};
use fleet_reconciler::model::{CommitId, MachineId, PolicyAction, Severity};
use fleet_reconciler::observe::sweep::Sweeper;
use fleet_reconciler::report::history::{HistoryEntry, HistoryStep, MachineHistory};
use fleet_reconciler::report::metrics::Metrics;
use fleet_reconciler::report::render;
use fleet_reconciler::report::server::{
    self, FleetView, MachineExtra, ServerLimits, ServerState, StatusError,
};
use fleet_reconciler::report::wire::FleetDocument;
use fleet_reconciler::sim::{Behaviour, Sim, SimApp, SimFleet, SimMachine};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::common::{OverlayRepo as Overlay, within};

/// Two steps of a machine's history, as the reporter files them.
fn two_steps(at: DateTime<Utc>) -> MachineHistory {
    Arc::from([
        HistoryEntry {
            at,
            step: Arc::new(HistoryStep::Drain),
            outcome: Arc::new(Outcome::Done),
        },
        HistoryEntry {
            at,
            step: Arc::new(HistoryStep::Finish),
            outcome: Arc::new(Outcome::Skipped(Declined::Held)),
        },
    ])
}

/// The lines [`two_steps`] is shown as for machine `target` (`app/id`).
fn two_steps_shown(at: DateTime<Utc>, target: &str) -> [String; 2] {
    let at = at.format("%Y-%m-%dT%H:%M:%SZ");
    [
        format!("{at} {target}: ask the agent to drain again → done"),
        format!(
            "{at} {target} reports the target: uncordon and finish → skipped: an operator put the machine on hold"
        ),
    ]
}

const FLY_TOKEN: &str = "server-test-fly-token";
const ADMIN: &str = "s3cret-admin-token-0123456789";
const HOSTILE: &str = "<script>alert('pwned')</script>";

/// alpha: on tip, 3 behind (low), before the security fix (critical), a
/// hostile name (1 behind), unreachable; beta: on tip, stopped.
fn fleet(o: &Overlay) -> SimFleet {
    let h = &o.history;
    SimFleet::new(FLY_TOKEN)
        .clock(Arc::new(TokioClock::starting_at(Utc::now())))
        .release_tip(o.tip())
        .app(
            SimApp::new("alpha")
                .machine(SimMachine::new("a1").name("alpha-ok").loaded(o.tip()))
                .machine(
                    SimMachine::new("a-behind")
                        .name("alpha-behind")
                        .region("ams")
                        .loaded(o.behind(3)),
                )
                .machine(
                    SimMachine::new("a-crit")
                        .name("alpha-critical")
                        .loaded(h.release[h.security_fix - 1].to_string()),
                )
                .machine(
                    SimMachine::new("a-hostile")
                        .name(HOSTILE)
                        .loaded(o.behind(1)),
                )
                .machine(
                    SimMachine::new("a-500")
                        .name("alpha-down")
                        .loaded(o.tip())
                        .behaviour(Behaviour::HttpError(500)),
                ),
        )
        .app(
            SimApp::new("beta")
                .machine(SimMachine::new("b1").name("beta-ok").loaded(o.tip()))
                .machine(SimMachine::new("b-off").loaded(o.tip()).stopped()),
        )
}

/// The test config; `server` is the body of a `[server]` section (may be empty).
fn config(sim: &Sim, o: &Overlay, server: &str) -> Config {
    let text = format!(
        r#"
[fly]
api_url = "{api}"
request_timeout = "5s"
max_retries = 2

[overlay]
repo = "{repo}"
branch = "release"
mirror_dir = "{mirror}"

[sweep]
interval = "30s"

[probe]
timeout = "2s"
concurrency = 8

[[apps]]
name = "alpha"
health_url = "{health}"

[[apps]]
name = "beta"
health_url = "{health}"

[server]
{server}
"#,
        api = sim.api_url(),
        repo = o.repo_path.display(),
        mirror = o.dir.path().join("mirror.git").display(),
        health = sim.health_url_template(),
    );
    Config::parse(Path::new("server-test.toml"), &text).unwrap()
}

async fn connect(config: Config) -> Sweeper {
    within(daemon::connect(
        Arc::new(config),
        &Secrets {
            fly_token: FLY_TOKEN.into(),
            git_token: None,
            record_keys: Some(fleet_reconciler::sim::record_keys()),
        },
    ))
    .await
    .unwrap()
}

/// A running server over a simulated fleet; nothing swept until a test says so.
struct Harness {
    overlay: Overlay,
    sim: Sim,
    sweeper: Sweeper,
    state: ServerState,
    /// The sim's clock, which the server reads too: tokio's paused time.
    clock: SharedClock,
    base: String,
    http: reqwest::Client,
    shutdown: CancellationToken,
    server: JoinHandle<std::io::Result<()>>,
}

impl Harness {
    async fn start(admin: Option<&str>) -> Harness {
        Harness::start_configured(admin, "").await
    }

    /// With `server` as the `[server]` section of the config (limits).
    async fn start_configured(admin: Option<&str>, server: &str) -> Harness {
        let overlay = Overlay::new();
        let sim = Sim::start(fleet(&overlay)).await.unwrap();
        Harness::start_full(overlay, sim, admin, server).await
    }

    async fn start_with(overlay: Overlay, sim: Sim, admin: Option<&str>) -> Harness {
        Harness::start_full(overlay, sim, admin, "").await
    }

    async fn start_full(overlay: Overlay, sim: Sim, admin: Option<&str>, server: &str) -> Harness {
        let config = config(&sim, &overlay, server);
        let sweeper = connect(config).await;
        let metrics = Arc::new(Metrics::new(true).unwrap());
        let clock = sim.clock();
        let view = FleetView::new(sweeper.config.sweep.interval.get(), clock.now());
        let operator = Operator::new(
            sweeper.fly.clone(),
            &sweeper.config,
            sweeper.record_keys.clone(),
        )
        .with_lease_patience(Duration::from_secs(2));
        let state = ServerState::new(metrics, view)
            .with_clock(clock.clone())
            .with_operator(operator)
            .with_admin_token(admin.map(str::to_string), "FLEET_ADMIN_TOKEN")
            .with_limits(ServerLimits::from_config(&sweeper.config.server));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(server::serve(listener, state.clone(), shutdown.clone()));
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        Harness {
            overlay,
            sim,
            sweeper,
            state,
            clock,
            base,
            http,
            shutdown,
            server,
        }
    }

    /// One sweep, published as the daemon loop would.
    async fn sweep(&self) -> Snapshot {
        let report = within(daemon::check(&self.sweeper)).await.unwrap();
        let now = self.clock.now();
        self.state.view().record_sweep(report.clone(), now);
        self.state
            .metrics()
            .record_sweep(&report, Duration::from_millis(300), now);
        report
    }

    async fn get(&self, path: &str) -> reqwest::Response {
        within(self.http.get(format!("{}{path}", self.base)).send())
            .await
            .unwrap()
    }

    async fn post(
        &self,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> reqwest::Response {
        let mut req = self.http.post(format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        within(req.send()).await.unwrap()
    }

    async fn stop(self) {
        self.shutdown.cancel();
        within(self.server).await.unwrap().unwrap();
        self.sim.shutdown().await;
    }
}

async fn json_of(resp: reqwest::Response) -> Value {
    within(resp.json::<Value>()).await.unwrap()
}

async fn text_of(resp: reqwest::Response) -> String {
    within(resp.text()).await.unwrap()
}

fn content_type(resp: &reqwest::Response) -> String {
    resp.headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

#[tokio::test(start_paused = true)]
async fn health_readiness_and_fleet_before_and_after_a_sweep() {
    let h = Harness::start(Some(ADMIN)).await;
    let resp = h.get("/healthz").await;
    assert_eq!(resp.status(), StatusCode::OK);

    let resp = h.get("/readyz").await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = json_of(resp).await;
    let err = body["error"].as_str().unwrap();
    assert!(err.contains("no successful sweep yet"), "{err}");

    let resp = h.get("/api/v1/fleet").await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(json_of(resp).await["error"].is_string());
    assert_eq!(
        h.get("/api/v1/machines/a1").await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );

    let report = h.sweep().await;
    let resp = h.get("/readyz").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(json_of(resp).await["status"], "ready");

    let resp = h.get("/api/v1/fleet").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(content_type(&resp).starts_with("application/json"));
    assert!(resp.headers().contains_key("last-modified"));
    let mut body = json_of(resp).await;
    // The view's age, on the daemon's clock: fresh.
    let view = body.as_object_mut().unwrap();
    assert_eq!(view.remove("stale"), Some(Value::Bool(false)));
    assert_eq!(view.remove("age_secs"), Some(0.into()));
    assert!(view.remove("swept_at").is_some_and(|v| v.is_string()));
    assert!(!view.contains_key("stale_reason"));
    // Besides, exactly the `check --output json` document of that sweep.
    let expected: Value =
        serde_json::from_str(&render::to_json(&FleetDocument::of(&report))).unwrap();
    assert_eq!(body, expected);
    assert_eq!(body["tip"]["branch"], "release");
    assert_eq!(body["tip"]["commit"], h.overlay.tip());
    assert_eq!(body["apps"][0]["name"], "alpha");
    assert_eq!(body["apps"][0]["machines"], 5);
    assert_eq!(body["apps"][0]["on_tip"], 1);
    assert_eq!(body["apps"][0]["coherence"], 0.2);
    let machines = body["machines"].as_array().unwrap();
    assert_eq!(machines.len(), 7);
    let behind = machines
        .iter()
        .find(|m| m["machine_id"] == "a-behind")
        .unwrap();
    assert_eq!(behind["status"], "drifted");
    assert_eq!(behind["commits_behind"], 3);
    assert_eq!(behind["severity"], "low");
    assert!(behind.get("metadata").is_none() && behind.get("report").is_none());
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn readiness_goes_stale_after_three_intervals() {
    let h = Harness::start(None).await;
    h.sweep().await;
    assert_eq!(h.get("/readyz").await.status(), StatusCode::OK);
    // The last success was 91 s ago with a 30 s interval; a failure since.
    h.state.view().update(|o| {
        o.last_success = Some(h.clock.now() - TimeDelta::seconds(91));
    });
    h.state.view().record_failure(
        "cannot list machines of app alpha: Fly API unreachable",
        h.clock.now(),
    );
    let resp = h.get("/readyz").await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let err = json_of(resp).await["error"].as_str().unwrap().to_string();
    assert!(err.contains("more than 3 sweep intervals"), "{err}");
    assert!(err.contains("Fly API unreachable"), "{err}");
    // The last report is still served, and the page says it is stale.
    assert_eq!(h.get("/api/v1/fleet").await.status(), StatusCode::OK);
    let page = text_of(h.get("/").await).await;
    assert!(page.contains("Stale:"), "{page}");
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn machine_detail_has_report_agent_rotation_and_drift_age() {
    let h = Harness::start(None).await;
    let marker = json!({"phase": "draining", "claimed_at": "2026-11-29T10:00:00Z"});
    assert!(
        h.sim
            .set_metadata("a-crit", MARKER_KEY, &marker.to_string())
    );
    // A marker of ours is shown as the sweep parsed it.
    let ours = Marker {
        tag: "a-behind-test".into(),
        target: fleet_reconciler::model::CommitId::parse(&h.overlay.tip()).expect("the tip"),
        phase: Phase::Restarting,
        mode: RotationMode::Grace,
        action: PolicyAction::Restart,
        severity: Severity::Medium,
        started_at: h.clock.now(),
        attempt_started_at: h.clock.now(),
        attempt: 0,
        owner: "test".into(),
        restart_at: None,
        retry_at: None,
        drain_requested: false,
        cordoned: None,
        ending: None,
        instance_id: None,
        pool: None,
        failed: None,
        approval: None,
    };
    assert!(
        h.sim
            .set_sealed_metadata("a-behind", MARKER_KEY, &ours.to_value())
    );
    h.sweep().await;
    let since = h.clock.now() - TimeDelta::minutes(42);
    h.state.view().set_extras(BTreeMap::from([(
        "a-behind".into(),
        MachineExtra {
            decision: Some(Decision::InRotation {
                phase: Phase::Restarting,
                deadline: None,
                verifying: true,
            }),
            history: two_steps(since),
            drift_since: Some(since),
        },
    )]));

    let resp = h.get("/api/v1/machines/a-behind").await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body = json_of(resp).await;
    assert_eq!(body["machine"]["machine_id"], "a-behind");
    assert_eq!(body["machine"]["status"], "drifted");
    assert_eq!(body["machine"]["commits_behind"], 3);
    assert_eq!(body["agent_report"]["overlay_ref"], h.overlay.behind(3));
    assert_eq!(body["decision"]["kind"], "in_rotation");
    assert_eq!(body["decision"]["phase"], "restarting");
    assert_eq!(body["rotation"]["phase"], "restarting");
    assert_eq!(
        body["history"],
        json!(two_steps_shown(since, "alpha/a-behind")),
        "typed entries rendered as the reporter's lines"
    );
    let got: chrono::DateTime<Utc> = serde_json::from_value(body["drift_since"].clone()).unwrap();
    assert_eq!(got, since);
    assert_eq!(body["tip"], h.overlay.tip());

    // Without extras: a marker that is not ours is shown as written; the
    // server keeps no drift clock of its own (the planner's is the only one).
    let body = json_of(h.get("/api/v1/machines/a-crit").await).await;
    assert_eq!(body["machine"]["severity"], "critical");
    assert_eq!(body["rotation"], marker);
    assert!(body["drift_since"].is_null(), "{body}");
    assert_eq!(body["history"], json!([]));

    // Its reason: the built-in Security rule, and the commit carrying it.
    let reason = &body["machine"]["reason"];
    assert_eq!(reason["rule"]["kind"], "matched");
    assert_eq!(reason["rule"]["index"], 1);
    assert_eq!(reason["evidence"][0]["kind"], "trailer");
    let fix = h.overlay.history.release[h.overlay.history.security_fix].to_string();
    assert_eq!(reason["evidence"][0]["commit"], fix.as_str());
    assert_eq!(reason["missing"].as_array().map(Vec::len), Some(20));

    // Its page names the unsealed marker (#33: an agent could have written it).
    let page = text_of(h.get("/machines/a-crit").await).await;
    assert!(
        page.contains("metadata_tampered") && page.contains(MARKER_KEY),
        "{page}"
    );

    // An unreachable machine has no agent report, and no reason.
    let body = json_of(h.get("/api/v1/machines/a-500").await).await;
    assert_eq!(body["machine"]["status"], "unreachable");
    assert!(body["agent_report"].is_null());
    assert!(body["machine"]["reason"].is_null());

    // Every machine document carries the version and validates against the
    // published schema (docs/machine.schema.json, what the types generate:
    // `UPDATE_SCHEMA=1` rewrites it).
    let validator = crate::common::published_schema(
        "machine.schema.json",
        &fleet_reconciler::report::server::machine_schema(),
    );
    for id in ["a-behind", "a-crit", "a-500"] {
        let body = json_of(h.get(&format!("/api/v1/machines/{id}")).await).await;
        assert_eq!(
            body["schema_version"],
            fleet_reconciler::report::wire::SCHEMA_VERSION
        );
        let errors = crate::common::schema_errors(&validator, &body);
        assert!(errors.is_empty(), "{id}: {errors:#?}");
    }

    let resp = h.get("/api/v1/machines/nope").await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let err = json_of(resp).await["error"].as_str().unwrap().to_string();
    assert!(err.contains("nope"), "{err}");
    let resp = h.get("/api/v1/machines/%3Cscript%3E").await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn admin_endpoints_refuse_missing_and_wrong_tokens() {
    // 20 refused attempts from one source: above the default limit of
    // failures (10 a minute), which has a test of its own below.
    let h = Harness::start_configured(Some(ADMIN), "admin_auth_failures = 100").await;
    h.sweep().await;
    let paths = [
        "/api/v1/machines/a-behind/approve",
        "/api/v1/machines/a-behind/hold",
        "/api/v1/machines/a-behind/release",
        "/api/v1/refresh",
    ];
    for path in paths {
        for token in [
            None,
            Some("wrong"),
            Some(""),
            Some("s3cret-admin-token-012345678"),
        ] {
            let resp = h.post(path, token, None).await;
            assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{path} {token:?}");
            assert!(resp.headers().contains_key("www-authenticate"));
            let body = json_of(resp).await;
            assert!(body["error"].is_string(), "{body}");
            assert!(!body.to_string().contains(ADMIN));
        }
        // Another scheme with the right secret is still refused.
        let resp = within(
            h.http
                .post(format!("{}{path}", h.base))
                .header("authorization", format!("Basic {ADMIN}"))
                .send(),
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{path}");
    }
    // Nothing was written by the refused requests.
    let m = h.sim.machine("a-behind").unwrap();
    assert!(!m.metadata.contains_key(HOLD_KEY) && !m.metadata.contains_key(APPROVE_KEY));

    // The right token (scheme in any case) is accepted.
    let resp = within(
        h.http
            .post(format!("{}/api/v1/refresh", h.base))
            .header("authorization", format!("bearer {ADMIN}"))
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    h.stop().await;

    // No token configured: the admin API is off, whatever is sent.
    let h = Harness::start(None).await;
    for token in [None, Some(ADMIN)] {
        let resp = h.post("/api/v1/machines/a1/hold", token, None).await;
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        let err = json_of(resp).await["error"].as_str().unwrap().to_string();
        assert_eq!(err, "admin API disabled: set FLEET_ADMIN_TOKEN");
    }
    assert!(!h.sim.machine("a1").unwrap().metadata.contains_key(HOLD_KEY));
    h.stop().await;
}

/// Before: a token set with a trailing newline (`echo token | fly secrets
/// set`) could never match, since the presented header is trimmed.
#[tokio::test(start_paused = true)]
async fn an_admin_token_with_surrounding_whitespace_still_matches() {
    let h = Harness::start(Some(&format!("  {ADMIN}\n"))).await;
    let resp = h.post("/api/v1/refresh", Some(ADMIN), None).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    h.stop().await;
    // Only whitespace is no token: the admin API stays off.
    let h = Harness::start(Some(" \n")).await;
    let resp = h.post("/api/v1/refresh", Some(ADMIN), None).await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn hold_release_and_approve_write_fly_metadata() {
    let h = Harness::start(Some(ADMIN)).await;
    h.sweep().await;

    // hold with a reason
    let resp = h
        .post(
            "/api/v1/machines/a-crit/hold",
            Some(ADMIN),
            Some(json!({"reason": "investigating INC-7", "by": "alice"})),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body = json_of(resp).await;
    assert_eq!(body["app"], "alpha");
    let value = h.sim.sealed_metadata("a-crit", HOLD_KEY).expect("sealed");
    let hold: Hold = serde_json::from_str(&value).unwrap();
    assert_eq!(
        (hold.by.as_str(), hold.reason.as_str()),
        ("alice", "investigating INC-7")
    );

    // release clears it
    let resp = h
        .post("/api/v1/machines/a-crit/release", Some(ADMIN), None)
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(
        !h.sim
            .machine("a-crit")
            .unwrap()
            .metadata
            .contains_key(HOLD_KEY)
    );

    // approve (no body): when idle (interrupting work is asked for, never a
    // default), for the current tip, by the API
    let resp = h
        .post("/api/v1/machines/a-crit/approve", Some(ADMIN), None)
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let value = h
        .sim
        .sealed_metadata("a-crit", APPROVE_KEY)
        .expect("sealed");
    let approval = Approval::parse(&value).expect("a valid approval");
    assert_eq!(approval.target, CommitId::parse(&h.overlay.tip()).unwrap());
    assert_eq!(approval.mode, ApprovalMode::WhenIdle);
    assert_eq!(approval.by, "admin-api");

    // revoke removes it, under the machine's lease, and says what it removed
    let resp = h
        .post("/api/v1/machines/a-crit/revoke", Some(ADMIN), None)
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body = json_of(resp).await;
    assert_eq!(
        (&body["revoked"], &body["fenced"], &body["approval"]["by"]),
        (&json!(true), &json!(true), &json!("admin-api"))
    );
    let meta = h.sim.machine("a-crit").unwrap().metadata;
    assert!(!meta.contains_key(APPROVE_KEY), "{meta:?}");
    let resp = h.post("/api/v1/machines/a-crit/revoke", None, None).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "an admin POST");

    // approve when idle, by bob, on the other app's machine
    let resp = h
        .post(
            "/api/v1/machines/b1/approve",
            Some(ADMIN),
            Some(json!({"mode": "when-idle", "by": "bob"})),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(json_of(resp).await["app"], "beta");
    let approval = Approval::parse(&h.sim.sealed_metadata("b1", APPROVE_KEY).unwrap()).unwrap();
    assert_eq!(
        (approval.mode, approval.by.as_str()),
        (ApprovalMode::WhenIdle, "bob")
    );

    // errors name the machine, bodies are checked
    let resp = h
        .post("/api/v1/machines/ghost/hold", Some(ADMIN), None)
        .await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let err = json_of(resp).await["error"].as_str().unwrap().to_string();
    assert!(err.contains("ghost"), "{err}");
    let resp = h
        .post(
            "/api/v1/machines/a1/approve",
            Some(ADMIN),
            Some(json!({"mode": "whenever"})),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let resp = h
        .post(
            "/api/v1/machines/a1/approve",
            Some(ADMIN),
            Some(json!({"target": "abc"})),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let err = json_of(resp).await["error"].as_str().unwrap().to_string();
    assert!(err.contains("a1"), "{err}");
    let resp = h
        .post(
            "/api/v1/machines/a1/hold",
            Some(ADMIN),
            Some(json!({"reasn": "typo"})),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert!(!h.sim.machine("a1").unwrap().metadata.contains_key(HOLD_KEY));

    // A machine leased by someone else past the operator's patience: Fly
    // accepts a metadata write from anyone, so the hold is written without
    // the lease rather than not at all, and the answer says so.
    h.sim
        .acquire_lease_as("a1", "other-reconciler", Duration::from_secs(600))
        .unwrap();
    let resp = h.post("/api/v1/machines/a1/hold", Some(ADMIN), None).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(json_of(resp).await["fenced"], false);
    assert!(h.sim.machine("a1").unwrap().metadata.contains_key(HOLD_KEY));
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn refresh_wakes_the_loop() {
    let h = Harness::start(Some(ADMIN)).await;
    let notify = h.state.refresh_requests();
    let waiter = tokio::spawn(async move { notify.notified().await });
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished());
    let resp = h.post("/api/v1/refresh", Some(ADMIN), None).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    within(waiter).await.unwrap();

    // A refresh while the loop is busy is kept for its next wait.
    let resp = h.post("/api/v1/refresh", Some(ADMIN), None).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    within(h.state.refresh_requests().notified()).await;
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn metrics_endpoint_serves_the_text_format() {
    let h = Harness::start(None).await;
    h.sweep().await;
    let resp = h.get("/metrics").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(content_type(&resp), "text/plain; version=0.0.4");
    let text = text_of(resp).await;
    assert!(
        text.contains("fleet_reconciler_fleet_overlay_coherence_ratio 0.3333333333333333"),
        "{text}"
    );
    assert!(
        text.contains("fleet_reconciler_overlay_coherence_ratio{fly_app=\"alpha\"} 0.2"),
        "{text}"
    );
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn status_page_shows_coherence_and_drift_and_escapes_agent_data() {
    let h = Harness::start(None).await;
    let resp = h.get("/").await;
    assert_eq!(resp.status(), StatusCode::OK);
    let page = text_of(resp).await;
    assert!(page.contains("Waiting for the first sweep"), "{page}");

    h.sweep().await;
    h.state.view().set_extras(BTreeMap::from([(
        "a-crit".into(),
        MachineExtra {
            decision: Some(Decision::AwaitingApproval {
                target: CommitId::parse(&h.overlay.tip()).unwrap(),
                severity: Severity::Critical,
            }),
            ..MachineExtra::default()
        },
    )]));
    let resp = h.get("/").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(content_type(&resp).starts_with("text/html"));
    let page = text_of(resp).await;
    assert!(page.contains("<meta http-equiv=\"refresh\" content=\"30\">"));
    // coherence per app and for the fleet
    assert!(page.contains(">alpha<") && page.contains(">beta<"));
    assert!(page.contains(">20%<"), "alpha: 1 of 5");
    assert!(page.contains(">100%<"), "beta: 1 of 1");
    assert!(page.contains(">33.3%<"), "fleet: 2 of 6");
    assert!(page.contains(&h.overlay.tip()[..12]));
    // drifted machines, most severe first, with phase and drift age
    let pos = |needle: &str| {
        page.find(needle)
            .unwrap_or_else(|| panic!("{needle} missing from the page"))
    };
    assert!(pos("alpha-critical") < pos("alpha-behind"));
    assert!(pos("alpha-behind") < pos("alpha-down"));
    assert!(page.contains("awaiting approval"));
    assert!(page.contains("Machines needing attention (4)"));
    assert!(!page.contains("Guardrails holding pools"), "none holds");
    assert!(
        !page.contains(">beta-ok<"),
        "on-tip machines are not listed"
    );
    // the hostile name is shown, escaped, never as markup
    assert!(!page.contains(HOSTILE), "raw agent data in the page");
    assert!(page.contains("&lt;script&gt;alert('pwned')&lt;/script&gt;"));
    assert!(!page.contains("<script"));
    h.stop().await;
}

/// The page sums the guardrails up per pool: which holds which pool, how
/// many machines, and until when; so do `status`'s and `plan`'s table.
#[tokio::test(start_paused = true)]
async fn the_status_page_says_which_guardrail_holds_which_pool_until_when() {
    use fleet_reconciler::decide::guardrail::Guard;
    let h = Harness::start(None).await;
    h.sweep().await;
    let closes = DateTime::<Utc>::from_timestamp(1_800_000_000, 0).unwrap();
    let window = Decision::Guarded {
        guard: Guard::Window {
            deny: true,
            until: Some(closes),
            time_zone: "UTC".into(),
        },
    };
    let extra = |d: &Decision| MachineExtra {
        decision: Some(d.clone()),
        ..MachineExtra::default()
    };
    h.state.view().set_extras(BTreeMap::from([
        ("a-crit".into(), extra(&window)),
        ("a-behind".into(), extra(&window)),
        ("a1".into(), extra(&Decision::OnTip)),
    ]));
    let page = text_of(h.get("/").await).await;
    assert!(page.contains("Guardrails holding pools (1)"), "{page}");
    let section = &page[page.find("Guardrails holding pools").unwrap()..];
    let section = &section[..section.find("</table>").unwrap()];
    for needle in [
        "alpha · default",
        ">window<",
        ">2<",
        "until it closes Fri 2027-01-15 08:00 UTC (2027-01-15 08:00:00 UTC, in ",
        ">inside a deny window<",
    ] {
        assert!(section.contains(needle), "{needle} missing: {section}");
    }
    // And in the API's fleet document.
    let v = json_of(h.get("/api/v1/fleet").await).await;
    assert_eq!(
        v["guardrails"],
        json!([{
            "app": "alpha",
            "pool": "default",
            "reason": "window",
            "held_by": "inside a deny window",
            "until": "2027-01-15T08:00:00Z",
            "lifts": "until it closes Fri 2027-01-15 08:00 UTC",
            "machines": 2,
        }])
    );
    // The same per pool in the table `status` prints (and `plan`: one
    // table), from the daemon's document.
    let doc = within(server::fetch_fleet(&h.base, Duration::from_secs(5)))
        .await
        .unwrap();
    let table = render::to_table(&doc);
    assert!(
        table.contains(
            "Guardrails (which pool is held, and until when):\n  alpha/default: inside a deny window (2 machine(s)); no new claim until it closes Fri 2027-01-15 08:00 UTC\n"
        ),
        "{table}"
    );
    h.stop().await;
}

/// `s` as maud escapes element text.
fn html_text(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A ref an agent reports with markup in it, and one with every character
/// HTML gives a meaning: both are bad reports whose detail quotes them.
const SCRIPT_REF: &str = "<script>alert(1)</script>";
const QUOTES_REF: &str = "\"'&<>";

/// alpha: critical (manual: waits for approval), one held machine behind,
/// two agents reporting markup, one on tip.
async fn page_harness() -> Harness {
    let o = Overlay::new();
    let h = &o.history;
    let fleet = SimFleet::new(FLY_TOKEN).release_tip(o.tip()).app(
        SimApp::new("alpha")
            .machine(SimMachine::new("a1").name("alpha-ok").loaded(o.tip()))
            .machine(
                SimMachine::new("a-crit")
                    .name("alpha-critical")
                    .region("fra")
                    .loaded(h.release[h.security_fix - 1].to_string()),
            )
            .machine(
                SimMachine::new("a-held")
                    .name("alpha-held")
                    .region("ams")
                    .loaded(o.behind(3)),
            )
            .machine(
                SimMachine::new("a-script")
                    .name("alpha-script")
                    .loaded(SCRIPT_REF),
            )
            .machine(
                SimMachine::new("a-quotes")
                    .name("alpha-quotes")
                    .loaded(QUOTES_REF),
            ),
    );
    let sim = Sim::start(fleet).await.unwrap();
    let hold = Hold {
        by: "alice".into(),
        reason: "INC-7: keep for <forensics>".into(),
        at: sim.now(),
    };
    assert!(sim.set_metadata("a-held", HOLD_KEY, &serde_json::to_string(&hold).unwrap()));
    Harness::start_with(o, sim, None).await
}

#[tokio::test(start_paused = true)]
async fn machine_pages_show_the_report_and_the_commands_that_apply() {
    let h = page_harness().await;
    let resp = h.get("/machines/a-crit").await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(content_type(&resp).starts_with("text/html"));
    assert!(text_of(resp).await.contains("No sweep has completed yet"));

    h.sweep().await;
    let at = Utc::now() - TimeDelta::minutes(5);
    h.state.view().set_extras(BTreeMap::from([(
        "a-held".into(),
        MachineExtra {
            decision: Some(Decision::Held {
                by: Some("alice".into()),
                since: None,
                reason: Some("INC-7: keep for <forensics>".into()),
                phase: None,
            }),
            history: two_steps(at),
            ..MachineExtra::default()
        },
    )]));

    // Every machine row of the front page links to its page.
    let front = text_of(h.get("/").await).await;
    for id in ["a-crit", "a-held", "a-script", "a-quotes"] {
        assert!(
            front.contains(&format!("href=\"/machines/{id}\"")),
            "{id}: {front}"
        );
    }

    // A manual (critical) drift: approve, now or when idle; not held: hold.
    let resp = h.get("/machines/a-crit").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(content_type(&resp).starts_with("text/html"));
    let page = text_of(resp).await;
    let security_parent = h.overlay.history.release[h.overlay.history.security_fix - 1].to_string();
    for field in [
        "<h1>alpha-critical</h1>",
        "<dd>alpha</dd>",
        "<dd>fra</dd>",
        "<dd>default</dd>",
        "<dd>started</dd>",
        "<dd>drifted</dd>",
        "<span class=\"sev critical\">critical</span>",
        "<dd>manual</dd>",
        &format!("<code>{security_parent}</code>"),
        "behind · 0 ahead",
        "<meta http-equiv=\"refresh\" content=\"30\">",
    ] {
        assert!(page.contains(field), "{field} missing: {page}");
    }
    assert!(
        page.contains("<code>fleet-reconciler approve a-crit</code>"),
        "{page}"
    );
    assert!(page.contains("<code>fleet-reconciler approve a-crit --now</code>"));
    assert!(page.contains("<code>fleet-reconciler hold a-crit --reason &quot;…&quot;</code>"));
    assert!(page.contains("<code>fleet-reconciler status a-crit</code>"));
    assert!(page.contains("<code>fleet-reconciler plan</code>"));
    // Why it is critical: the rule, the security commit it lacks, and the
    // newest missing commits, as the sweep's reason says.
    let reason = h
        .state
        .view()
        .snapshot()
        .report
        .unwrap()
        .machines
        .iter()
        .find(|m| m.seen.machine_id == MachineId::from("a-crit"))
        .and_then(|m| m.reason().cloned())
        .expect("a reason");
    assert!(
        page.contains("<section class=\"box\" id=\"reason\">"),
        "{page}"
    );
    assert!(
        page.contains(&format!("<dd>{}</dd>", html_text(&reason.rule.to_string()))),
        "{page}"
    );
    assert!(!reason.evidence.is_empty() && !reason.missing.is_empty());
    for e in &reason.evidence {
        assert!(
            page.contains(&format!(
                "<dt>Evidence</dt><dd>{}</dd>",
                html_text(&e.to_string())
            )),
            "{e}: {page}"
        );
    }
    for c in &reason.missing {
        assert!(
            page.contains(&html_text(&c.subject)),
            "{}: {page}",
            c.subject
        );
    }
    assert!(!page.contains("fleet-reconciler release a-crit"));
    // The agent's report, and no form or script: the page never acts.
    assert!(page.contains(&format!(
        "<dt>Overlay ref</dt><dd><code>{security_parent}</code>"
    )));
    assert!(!page.contains("<form") && !page.contains("<script"));

    // Held (low drift, alert-and-wait): release, not hold, no approve; the
    // hold, the decision and the history are shown.
    let page = text_of(h.get("/machines/a-held").await).await;
    assert!(
        page.contains("<code>fleet-reconciler release a-held</code>"),
        "{page}"
    );
    assert!(!page.contains("fleet-reconciler hold a-held"));
    assert!(!page.contains("fleet-reconciler approve a-held"));
    assert!(page.contains("held by alice"), "{page}");
    assert!(page.contains("INC-7: keep for &lt;forensics&gt;"), "{page}");
    // The planner's decision: its label, and its sentence (escaped).
    assert!(page.contains("<span class=\"tag\">held</span>"), "{page}");
    assert!(
        page.contains(
            "held by alice (INC-7: keep for &lt;forensics&gt;); nothing is done until `release`"
        ),
        "{page}"
    );
    let [drain, finish] = two_steps_shown(at, "alpha/a-held");
    assert!(
        page.contains(&format!("<li>{drain}</li><li>{finish}</li>")),
        "{page}"
    );
    assert!(page.contains("<dd>alert-and-wait</dd>"), "{page}");
    assert!(page.contains("3 behind · 0 ahead"), "{page}");

    // Unknown and invalid ids: small HTML pages, never the id as markup.
    let resp = h.get("/machines/nope").await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert!(content_type(&resp).starts_with("text/html"));
    assert!(
        text_of(resp)
            .await
            .contains("Machine nope is not in the last sweep")
    );
    let resp = h.get("/machines/%3Cscript%3E").await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert!(content_type(&resp).starts_with("text/html"));
    assert!(!text_of(resp).await.contains("<script"));
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn agent_markup_is_escaped_on_the_status_and_machine_pages() {
    let h = page_harness().await;
    h.sweep().await;
    let script = "&lt;script&gt;alert(1)&lt;/script&gt;";
    let quotes = "\\&quot;'&amp;&lt;&gt;";
    for path in ["/", "/machines/a-script", "/machines/a-quotes"] {
        let page = text_of(h.get(path).await).await;
        assert!(!page.contains("<script"), "{path}: {page}");
        assert!(!page.contains("'&<>"), "{path}: {page}");
        if path != "/machines/a-quotes" {
            assert!(page.contains(script), "{path}: {page}");
        }
        if path != "/machines/a-script" {
            assert!(page.contains(quotes), "{path}: {page}");
        }
    }
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_status_page_draws_coherence_over_the_last_sweeps() {
    let h = Harness::start(None).await;
    h.sweep().await;
    let page = text_of(h.get("/").await).await;
    assert!(page.contains("<svg class=\"spark\""), "{page}");
    assert!(
        page.contains("Coherence of alpha over the last sweep ("),
        "{page}"
    );
    for _ in 0..2 {
        h.sweep().await;
    }
    assert_eq!(h.state.view().snapshot().trend.len(), 3);
    let page = text_of(h.get("/").await).await;
    // One chart per card (the fleet, alpha, beta), each a line of 3 points.
    assert_eq!(page.matches("<svg class=\"spark\"").count(), 3, "{page}");
    assert!(page.contains("role=\"img\""));
    assert!(
        page.contains("<polyline points=\"0.0,3.0 120.0,3.0 240.0,3.0\""),
        "beta: 100% three times: {page}"
    );
    for label in [
        "Fleet coherence over the last 3 sweeps",
        "latest 33.3%, lowest 33.3%, highest 33.3%",
        "Coherence of alpha over the last 3 sweeps",
        "latest 20% (1 of 5 on tip), lowest 20%, highest 20%",
        "Coherence of beta over the last 3 sweeps",
        "latest 100% (1 of 1 on tip)",
    ] {
        assert!(page.contains(label), "{label} missing: {page}");
    }
    assert!(page.contains("trend: 3 sweeps · lowest 20%"), "{page}");
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn status_page_says_all_coherent() {
    let o = Overlay::new();
    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN)
            .release_tip(o.tip())
            .app(
                SimApp::new("alpha")
                    .machine(SimMachine::new("a1").loaded(o.tip()))
                    .machine(SimMachine::new("a2").loaded(o.tip())),
            )
            .app(SimApp::new("beta")),
    )
    .await
    .unwrap();
    let h = Harness::start_with(o, sim, None).await;
    h.sweep().await;
    let page = text_of(h.get("/").await).await;
    assert!(page.contains("All coherent"), "{page}");
    assert!(!page.contains("<table"));
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn status_client_prints_the_check_table() {
    let h = Harness::start(None).await;
    match within(server::fetch_fleet(&h.base, Duration::from_secs(5))).await {
        Err(StatusError::NotReady(msg)) => assert!(msg.contains("no sweep"), "{msg}"),
        other => panic!("expected NotReady, got {other:?}"),
    }
    let report = h.sweep().await;
    let fetched = within(server::fetch_fleet(
        &format!("{}/", h.base),
        Duration::from_secs(5),
    ))
    .await
    .unwrap();
    // The document read back is the one the daemon wrote, to the byte
    // (with how old its view is).
    assert!(fetched.view.as_ref().is_some_and(|v| !v.stale));
    let written = FleetDocument::of(&report).with_view(fetched.view.clone());
    assert_eq!(render::to_table(&fetched), render::to_table(&written));
    assert_eq!(render::to_json(&fetched), render::to_json(&written));
    assert_eq!(fetched.is_coherent(), report.is_coherent());

    let err = within(server::fetch_fleet("ftp://x", Duration::from_secs(1)))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "invalid_url");
    h.stop().await;

    // Nobody listening any more.
    let err = within(server::fetch_fleet(
        &h_base_closed().await,
        Duration::from_secs(2),
    ))
    .await
    .unwrap_err();
    assert_eq!(err.kind(), "transport", "{err}");
}

#[tokio::test(start_paused = true)]
async fn status_client_reads_one_machine_and_its_reason() {
    let h = Harness::start(None).await;
    match within(server::fetch_machine(
        &h.base,
        "a-crit",
        Duration::from_secs(5),
    ))
    .await
    {
        Err(StatusError::NotReady(msg)) => assert!(msg.contains("no sweep"), "{msg}"),
        other => panic!("expected NotReady, got {other:?}"),
    }
    let report = h.sweep().await;
    let (view, json) = within(server::fetch_machine(
        &h.base,
        "a-behind",
        Duration::from_secs(5),
    ))
    .await
    .unwrap();
    let row = report
        .machines
        .iter()
        .find(|m| m.seen.machine_id == MachineId::from("a-behind"))
        .unwrap();
    assert_eq!(view.machine.machine_id, MachineId::from("a-behind"));
    assert_eq!(view.machine.reason.as_ref(), row.reason());
    assert_eq!(json["machine"]["commits_behind"], 3);
    let text = view.render();
    for expected in [
        "machine:  a-behind (alpha-behind)",
        "status:   drifted",
        "behind:   3, ahead 0",
        "reason:",
        "  no rule matched: the default level, low",
        "  missing: 3 commit(s), newest 3 shown:",
    ] {
        assert!(text.contains(expected), "{expected:?} in\n{text}");
    }
    let reason = row.reason().unwrap();
    for c in &reason.missing {
        assert!(text.contains(&c.commit.as_str()[..12]), "{text}");
    }

    // The critical one: its rule and evidence.
    let (view, _) = within(server::fetch_machine(
        &h.base,
        "a-crit",
        Duration::from_secs(5),
    ))
    .await
    .unwrap();
    let text = view.render();
    assert!(
        text.contains(r#"  rule #1: level = "critical", trailers = ["security"]"#),
        "{text}"
    );
    assert!(text.contains("  evidence: trailer Security in "), "{text}");

    // An unknown machine is named.
    let err = within(server::fetch_machine(
        &h.base,
        "nope",
        Duration::from_secs(5),
    ))
    .await
    .unwrap_err();
    assert_eq!(err.kind(), "unknown_machine");
    assert!(err.to_string().contains("machine nope"), "{err}");
    let err = within(server::fetch_machine(
        &h.base,
        "../fleet",
        Duration::from_secs(5),
    ))
    .await
    .unwrap_err();
    assert_eq!(err.kind(), "unknown_machine", "{err}");
    h.stop().await;
}

/// A JSON value with its objects' keys in the order written (a `Value`
/// sorts them): what the bytes of a document say beyond its values.
enum Ordered {
    Scalar(Value),
    Array(Vec<Ordered>),
    Object(Vec<(String, Ordered)>),
}

impl<'de> serde::Deserialize<'de> for Ordered {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Ordered, D::Error> {
        use serde::de::{MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ordered;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_unit<E>(self) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(Value::Null))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(v.into()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(v.into()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(v.into()))
            }
            fn visit_str<E>(self, v: &str) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(v.into()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Ordered, A::Error> {
                let mut items = Vec::new();
                while let Some(x) = a.next_element()? {
                    items.push(x);
                }
                Ok(Ordered::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Ordered, A::Error> {
                let mut entries = Vec::new();
                while let Some(e) = m.next_entry()? {
                    entries.push(e);
                }
                Ok(Ordered::Object(entries))
            }
        }
        d.deserialize_any(V)
    }
}

impl serde::Serialize for Ordered {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self {
            Ordered::Scalar(v) => v.serialize(s),
            Ordered::Array(items) => s.collect_seq(items),
            Ordered::Object(entries) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

impl Ordered {
    fn get(&self, key: &str) -> &Ordered {
        match self {
            Ordered::Object(entries) => entries
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v)
                .unwrap_or_else(|| panic!("no {key}")),
            _ => panic!("not an object"),
        }
    }

    fn keys(&self) -> Vec<&str> {
        match self {
            Ordered::Object(entries) => entries.iter().map(|(k, _)| k.as_str()).collect(),
            _ => Vec::new(),
        }
    }

    fn compact(&self) -> String {
        serde_json::to_string(self).unwrap()
    }
}

/// #35: the machine detail on the wire, and as `status MACHINE` shows it,
/// pinned to the byte where its fields were untyped JSON: the keys in
/// their order, a control of ours and one not ours (JSON or not) each
/// written compact with its keys sorted, the agent's report in its own
/// field order; the client reads back the document as sent and shows each
/// control as the daemon wrote it.
#[tokio::test(start_paused = true)]
async fn machine_detail_bytes_and_status_text_are_pinned() {
    let h = Harness::start(None).await;
    let now = h.clock.now();
    let hold = Hold {
        by: "alice".into(),
        reason: "INC-7".into(),
        at: now,
    };
    let approval = Approval {
        target: CommitId::parse(&h.overlay.tip()).unwrap(),
        mode: ApprovalMode::Now,
        by: "bob".into(),
        at: now,
    };
    let hold_text = serde_json::to_string(&hold).unwrap();
    let approval_text = serde_json::to_string(&approval).unwrap();
    assert!(h.sim.set_sealed_metadata("a-behind", HOLD_KEY, &hold_text));
    assert!(
        h.sim
            .set_sealed_metadata("a-behind", APPROVE_KEY, &approval_text)
    );
    // Not ours: JSON (shown as JSON, keys sorted) and not JSON (a string).
    assert!(h.sim.set_metadata(
        "a-crit",
        MARKER_KEY,
        r#"{"phase":"draining","b":[1,{"z":2,"a":3}]}"#
    ));
    assert!(h.sim.set_metadata("a-crit", HOLD_KEY, "just a note"));
    assert!(
        h.sim
            .set_metadata("a-crit", APPROVE_KEY, r#"{"z":1,"a":"x"}"#)
    );
    let report = h.sweep().await;

    let head = [
        "schema_version",
        "machine",
        "agent_report",
        "hold",
        "approval",
        "rotation",
    ];
    let tail = [
        "decision",
        "history",
        "drift_since",
        "tip",
        "swept_at",
        "age_secs",
        "stale",
    ];
    let want_keys: Vec<&str> = head.iter().chain(&tail).copied().collect();
    for id in ["a-behind", "a-crit", "a-500"] {
        let body = text_of(h.get(&format!("/api/v1/machines/{id}")).await).await;
        let doc: Ordered = serde_json::from_str(&body).unwrap();
        // The bytes are the values and their keys' order, pretty-printed.
        assert_eq!(body, serde_json::to_string_pretty(&doc).unwrap() + "\n");
        assert_eq!(doc.keys(), want_keys, "{id}");
        let v: Value = serde_json::from_str(&body).unwrap();
        for key in ["hold", "approval", "rotation"] {
            // A `Value`'s text: keys sorted.
            assert_eq!(doc.get(key).compact(), v[key].to_string(), "{id} {key}");
        }
        let row = report
            .machines
            .iter()
            .find(|m| m.seen.machine_id == MachineId::from(id))
            .unwrap();
        let agent = serde_json::to_string(&row.seen.inputs.report).unwrap();
        assert_eq!(doc.get("agent_report").compact(), agent, "{id}");

        let (view, json) = within(server::fetch_machine(&h.base, id, Duration::from_secs(5)))
            .await
            .unwrap();
        assert_eq!(json, v);
        let text = view.render();
        for (key, label) in [
            ("hold", "hold:"),
            ("approval", "approval:"),
            ("rotation", "marker:"),
        ] {
            let line = format!("\n{label:<10}{}\n", v[key]);
            assert_eq!(
                text.contains(&line),
                !v[key].is_null(),
                "{id} {line:?} in\n{text}"
            );
        }
    }
    let crit: Value = json_of(h.get("/api/v1/machines/a-crit").await).await;
    assert_eq!(crit["hold"], "just a note");
    let body = text_of(h.get("/api/v1/machines/a-crit").await).await;
    let doc: Ordered = serde_json::from_str(&body).unwrap();
    assert_eq!(
        doc.get("rotation").compact(),
        r#"{"b":[1,{"a":3,"z":2}],"phase":"draining"}"#
    );
    assert_eq!(doc.get("approval").compact(), r#"{"a":"x","z":1}"#);
    let behind: Value = json_of(h.get("/api/v1/machines/a-behind").await).await;
    assert_eq!(behind["hold"]["by"], "alice");
    assert_eq!(behind["approval"]["by"], "bob");
    h.stop().await;
}

/// A daemon (or something posing as one) cannot make `status` read without
/// bound: past the cap the client stops reading and says so.
#[tokio::test(start_paused = true)]
async fn status_client_stops_reading_past_its_cap() {
    let huge = "x".repeat(server::MAX_MACHINE_BODY_BYTES + 1);
    let app = axum::Router::new().route(
        "/api/v1/machines/{id}",
        axum::routing::get(move || {
            let huge = huge.clone();
            async move { huge }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let serving = tokio::spawn(async move { axum::serve(listener, app).await });
    let err = within(server::fetch_machine(&base, "m1", Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "too_large", "{err}");
    serving.abort();
}

/// A loopback address where nothing listens.
async fn h_base_closed() -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    format!("http://{addr}")
}

#[tokio::test(start_paused = true)]
async fn shutdown_is_graceful() {
    let h = Harness::start(None).await;
    assert_eq!(h.get("/healthz").await.status(), StatusCode::OK);
    let base = h.base.clone();
    h.stop().await; // serve() returned Ok within the timeout
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    assert!(
        within(http.get(format!("{base}/healthz")).send())
            .await
            .is_err()
    );
}

/// Serves the status page over the demo's fleet and policy for a screenshot:
/// `STATUS_PAGE_ADDR=127.0.0.1:9099 STATUS_PAGE_SECS=120 cargo test --test
/// server screenshot -- --ignored --nocapture`, then point a browser at it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "serves the status page for a screenshot; run by hand"]
async fn screenshot_server_over_the_demo_fleet() {
    let addr = std::env::var("STATUS_PAGE_ADDR").unwrap_or_else(|_| "127.0.0.1:0".into());
    let secs: u64 = std::env::var("STATUS_PAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let o = Overlay::new();
    let h = &o.history;
    let n = h.release.len();
    let at = |back: usize| h.release[n - 1 - back].to_string();
    let tip = o.tip();
    let regions = ["iad", "ams", "sin", "syd", "gru", "fra", "ord"];
    // The demo's spread: most on the tip, a tail of drift of every kind.
    let spec = |app: usize| -> Vec<(String, Behaviour)> {
        let mut v: Vec<(String, Behaviour)> =
            (0..9).map(|_| (tip.clone(), Behaviour::Normal)).collect();
        v.push((at(1), Behaviour::Normal));
        v.push((at(6), Behaviour::Normal));
        v.push((h.release[h.security_fix - 1].to_string(), Behaviour::Normal));
        v.push((h.release[h.policy_change].to_string(), Behaviour::Normal));
        if app == 0 {
            v.push((h.canary.to_string(), Behaviour::Normal));
            v.push(("deadbeef".repeat(5), Behaviour::Normal));
            v.push((tip.clone(), Behaviour::HttpError(502)));
            v.push((tip.clone(), Behaviour::Garbage));
        } else {
            v.push((at(2), Behaviour::Normal));
            v.push((tip.clone(), Behaviour::NonHexRef));
        }
        v
    };
    let mut fleet = SimFleet::new(FLY_TOKEN).release_tip(tip.clone());
    for (i, (app, letter, pool)) in [
        ("agents-dispatch", "d", "dispatch"),
        ("agents-chat", "c", "conversation"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut machines: Vec<SimMachine> = spec(i)
            .into_iter()
            .enumerate()
            .map(|(j, (loaded, b))| {
                let mut m =
                    SimMachine::new(format!("{}{j:02}{:08x}", i + 1, 0x5e1f_0000u32 + j as u32))
                        .name(format!("agent-{letter}-{j:02}"))
                        .region(regions[(j + i) % regions.len()])
                        .loaded(loaded)
                        .report_ref_len(7)
                        .behaviour(b);
                if j % 3 != 2 {
                    m = m.metadata("pool", pool);
                }
                m
            })
            .collect();
        machines.push(
            SimMachine::new(format!("{}90ff00000", i + 1))
                .name(format!("agent-{letter}-stopped"))
                .loaded(at(8))
                .stopped(),
        );
        fleet = fleet.app(SimApp::new(app).machines(machines));
    }
    let sim = Sim::start(fleet).await.unwrap();
    // The demo's own policy, pointed at this sim and repository.
    let mut config = Config::parse(Path::new("config/demo.toml"), demo::DEMO_CONFIG).unwrap();
    config.fly.api_url = sim.api_url();
    config.overlay.repo =
        fleet_reconciler::config::NonEmpty::new(o.repo_path.display().to_string()).unwrap();
    config.overlay.mirror_dir = o.dir.path().join("mirror.git");
    let template = HealthUrlTemplate::parse(&sim.health_url_template()).unwrap();
    for app in &mut config.apps {
        app.health_url = template.clone();
    }
    config.sweep.interval = fleet_reconciler::config::NonZeroDuration::from_secs(30);
    let sweeper = connect(config).await;
    let hold = Hold {
        by: "alice".into(),
        reason: "INC-7: keep for forensics".into(),
        at: Utc::now(),
    };
    let held = format!("2{:02}{:08x}", 12, 0x5e1f_0000u32 + 12);
    assert!(sim.set_metadata(&held, HOLD_KEY, &serde_json::to_string(&hold).unwrap()));
    let report = within(daemon::check(&sweeper)).await.unwrap();
    let view = FleetView::new(Duration::from_secs(30), Utc::now());
    let now = Utc::now();
    // Drift ages and rotation phases as the planner would publish them.
    let mut extras = BTreeMap::new();
    for (k, m) in report
        .machines
        .iter()
        .filter(|m| m.severity().is_some())
        .enumerate()
    {
        let rotating = |phase| Decision::InRotation {
            phase,
            deadline: None,
            verifying: false,
        };
        let decision = match (m.action().map(|a| a.as_str()), k % 3) {
            (Some("manual"), _) => Some(Decision::AwaitingApproval {
                target: report.tip.commit.clone(),
                severity: m.severity().unwrap_or(Severity::High),
            }),
            (Some("restart"), 0) => Some(rotating(Phase::Restarting)),
            (Some("restart"), _) => Some(rotating(Phase::Draining)),
            (Some("alert-and-wait"), 1) => Some(rotating(Phase::Draining)),
            (Some("alert-and-wait"), _) => Some(Decision::LiveWork {
                since: now - TimeDelta::minutes(3),
                deadline: now + TimeDelta::minutes(57),
            }),
            _ => None,
        };
        extras.insert(
            m.seen.machine_id.clone(),
            MachineExtra {
                decision,
                drift_since: Some(now - TimeDelta::minutes(7 + 23 * k as i64)),
                ..MachineExtra::default()
            },
        );
    }
    view.record_sweep(report.clone(), now - TimeDelta::seconds(4));
    view.set_extras(extras);
    let metrics = Arc::new(Metrics::new(true).unwrap());
    metrics.record_sweep(&report, Duration::from_millis(900), now);
    let state = ServerState::new(metrics, view);
    let listener = TcpListener::bind(&addr).await.unwrap();
    println!("status page: http://{}/", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(server::serve(listener, state, shutdown.clone()));
    tokio::time::sleep(Duration::from_secs(secs)).await;
    shutdown.cancel();
    within(server).await.unwrap().unwrap();
    sim.shutdown().await;
}

// ---- limits: issue #10 item 5 --------------------------------------------------

/// A raw loopback connection to the harness's server, for what an HTTP
/// client will not do (send half a request, or nothing).
async fn raw(h: &Harness) -> tokio::net::TcpStream {
    let addr = h.base.trim_start_matches("http://");
    within(tokio::net::TcpStream::connect(addr)).await.unwrap()
}

/// Reads until the server closes the connection (EOF or reset): what it
/// sent and when it closed, or `None` if it was still open after `wait`.
async fn read_until_closed(
    s: &mut tokio::net::TcpStream,
    wait: Duration,
) -> Option<(String, Duration)> {
    use tokio::io::AsyncReadExt;
    let start = tokio::time::Instant::now();
    let mut got = Vec::new();
    let closed = tokio::time::timeout(wait, async {
        let mut chunk = [0u8; 4096];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    closed
        .ok()
        .map(|()| (String::from_utf8_lossy(&got).into_owned(), start.elapsed()))
}

/// One series' value in a scrape.
fn series(metrics: &str, name_and_labels: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        l.strip_prefix(name_and_labels)
            .and_then(|v| v.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// Before: a client that sent part of its headers and then nothing kept its
/// connection (and a task) for as long as it liked.
#[tokio::test(start_paused = true)]
async fn a_partial_header_is_cut_off_after_the_header_read_timeout() {
    use tokio::io::AsyncWriteExt;
    let h = Harness::start_configured(None, "header_read_timeout = \"1s\"").await;
    let mut slow = raw(&h).await;
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: fleet\r\nX-Slow: ")
        .await
        .unwrap();
    let (sent, after) = read_until_closed(&mut slow, Duration::from_secs(6))
        .await
        .expect("a partial header held for 6 s was still open (header_read_timeout = 1s)");
    assert!(
        after >= Duration::from_millis(800),
        "closed after {after:?}"
    );
    assert!(!sent.contains("200 OK"), "{sent}");

    // A whole request sent in time is served; the kept-alive connection is
    // then closed once it has been idle for the same timeout.
    let mut prompt = raw(&h).await;
    prompt
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: fleet\r\n\r\n")
        .await
        .unwrap();
    let (sent, after) = read_until_closed(&mut prompt, Duration::from_secs(6))
        .await
        .expect("an idle kept-alive connection is closed after header_read_timeout");
    assert!(sent.starts_with("HTTP/1.1 200 OK"), "{sent}");
    assert!(sent.ends_with("ok\n"), "{sent}");
    assert!(
        after >= Duration::from_millis(800),
        "closed after {after:?}"
    );
    h.stop().await;
}

/// A request that does not finish within `server.request_timeout` (here a
/// body that never arrives) gets a 503 that says why and that an admin
/// write may be sent again, and its connection is closed.
#[tokio::test(start_paused = true)]
async fn a_request_not_finished_within_the_request_timeout_gets_a_503() {
    use tokio::io::AsyncWriteExt;
    let h = Harness::start_configured(Some(ADMIN), "request_timeout = \"1s\"").await;
    let mut slow = raw(&h).await;
    let head = format!(
        "POST /api/v1/machines/a-crit/approve HTTP/1.1\r\nHost: fleet\r\n\
         Authorization: Bearer {ADMIN}\r\nContent-Type: application/json\r\n\
         Content-Length: 100\r\n\r\n{{\"mo"
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    let (sent, after) = read_until_closed(&mut slow, Duration::from_secs(6))
        .await
        .expect("a request whose body never came was still open after 6 s (request_timeout = 1s)");
    assert!(
        after >= Duration::from_millis(900),
        "closed after {after:?}"
    );
    assert!(
        sent.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
        "{sent:?}"
    );
    assert!(
        sent.to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{sent:?}"
    );
    let (_, body) = sent.split_once("\r\n\r\n").unwrap();
    let body: serde_json::Value = serde_json::from_str(body).unwrap();
    let error = body["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("server.request_timeout") && error.contains("can be sent again"),
        "{body}"
    );
    assert!(!sent.contains(ADMIN), "{sent}");
}

/// Before: connections were unlimited.
#[tokio::test(start_paused = true)]
async fn connections_beyond_the_limit_are_refused() {
    use tokio::io::AsyncWriteExt;
    let h =
        Harness::start_configured(None, "max_connections = 3\nheader_read_timeout = \"30s\"").await;
    // Three clients that never finish their headers hold every slot.
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = raw(&h).await;
        s.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
        held.push(s);
    }
    for _ in 0..2 {
        let mut extra = raw(&h).await;
        let (sent, _) = read_until_closed(&mut extra, Duration::from_secs(5))
            .await
            .expect("a fourth connection with max_connections = 3 was still open after 5 s");
        assert!(
            sent.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{sent:?}"
        );
        assert!(sent.contains("server.max_connections"), "{sent}");
    }
    // The held ones are still being served: they were not the ones closed.
    held.truncate(1);
    held[0].write_all(b"Host: fleet\r\n\r\n").await.unwrap();
    let mut buf = [0u8; 64];
    let n = within(tokio::io::AsyncReadExt::read(&mut held[0], &mut buf))
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200 OK"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    drop(held);

    // Once they are gone, new connections are served again, and the
    // refusals were counted.
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut served = None;
    for _ in 0..50 {
        if let Ok(r) = fresh.get(format!("{}/metrics", h.base)).send().await
            && r.status() == StatusCode::OK
        {
            served = Some(text_of(r).await);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = served.expect("served again once the held connections closed");
    assert_eq!(
        series(&metrics, "fleet_reconciler_http_connections_rejected_total"),
        Some(2.0),
        "{metrics}"
    );
    h.stop().await;
}

/// Before: a body over the limit was read up to 16 KiB by the routes that
/// read one, and accepted by the others.
#[tokio::test(start_paused = true)]
async fn an_oversized_body_to_an_admin_post_gets_413() {
    let h = Harness::start_configured(Some(ADMIN), "max_body_bytes = 1024").await;
    h.sweep().await;
    let post = |path: &str, body: reqwest::Body| {
        h.http
            .post(format!("{}{path}", h.base))
            .header("authorization", format!("Bearer {ADMIN}"))
            .header("content-type", "application/json")
            .body(body)
    };
    // Declared too large (Content-Length): refused on every admin route,
    // whether or not it reads a body.
    let reason = "r".repeat(2000);
    let big = json!({ "reason": reason }).to_string();
    for path in [
        "/api/v1/refresh",
        "/api/v1/machines/a-behind/hold",
        "/api/v1/machines/a-behind/release",
        "/api/v1/machines/a-behind/approve",
    ] {
        let resp = within(post(path, big.clone().into()).send()).await.unwrap();
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        let err = json_of(resp).await["error"].as_str().unwrap().to_string();
        assert!(
            err.contains("1024") && err.contains("server.max_body_bytes"),
            "{err}"
        );
    }
    // Streamed without a length: cut at the limit where a route reads it.
    let chunks: Vec<Result<String, std::io::Error>> = vec![Ok(big.clone())];
    let resp = within(
        post(
            "/api/v1/machines/a-behind/hold",
            reqwest::Body::wrap_stream(futures::stream::iter(chunks)),
        )
        .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        !h.sim
            .machine("a-behind")
            .unwrap()
            .metadata
            .contains_key(HOLD_KEY),
        "nothing was held by the refused requests"
    );
    // A body within the limit is served as before.
    let small = json!({ "reason": "r".repeat(900) }).to_string();
    let resp = within(post("/api/v1/machines/a-behind/hold", small.into()).send())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    h.stop().await;
}

/// A log capture for one current-thread test: everything the crate logs on
/// this thread (the server's tasks run on it), at every level.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Before: 2,000 wrong tokens in 0.7 s were all answered 401, and nothing
/// was logged or counted.
#[tokio::test(start_paused = true)]
async fn failed_admin_logins_are_limited_per_source_logged_and_counted() {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("fleet_reconciler=trace")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let h = Harness::start_configured(
        Some(ADMIN),
        "admin_auth_failures = 5\nadmin_auth_window = \"1m\"",
    )
    .await;
    const GUESS: &str = "guessed-admin-token-";
    let mut statuses = Vec::new();
    for i in 0..40 {
        let token = format!("{GUESS}{i:04}");
        let token = if i % 10 == 3 { None } else { Some(token) };
        let resp = h.post("/api/v1/refresh", token.as_deref(), None).await;
        let status = resp.status();
        if status == StatusCode::TOO_MANY_REQUESTS {
            let retry: u64 = resp.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!((1..=60).contains(&retry), "Retry-After: {retry}");
            let err = json_of(resp).await["error"].as_str().unwrap().to_string();
            assert!(
                err.contains("too many failed admin authentications"),
                "{err}"
            );
        }
        statuses.push(status);
    }
    let expected: Vec<StatusCode> = (0..40)
        .map(|i| {
            if i < 5 {
                StatusCode::UNAUTHORIZED
            } else {
                StatusCode::TOO_MANY_REQUESTS
            }
        })
        .collect();
    assert_eq!(statuses, expected);

    // While limited, the source is refused even with the right token …
    let resp = h.post("/api/v1/refresh", Some(ADMIN), None).await;
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    // … but another source with the right token is served.
    let other = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let resp = within(
        other
            .post(format!("{}/api/v1/refresh", h.base))
            .bearer_auth(ADMIN)
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    // Reads are never limited.
    assert_eq!(h.get("/healthz").await.status(), StatusCode::OK);

    // Counted …
    let metrics = text_of(h.get("/metrics").await).await;
    let count = |reason: &str| {
        series(
            &metrics,
            &format!("fleet_reconciler_admin_auth_failures_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(count("wrong_token"), Some(4.0), "{metrics}");
    assert_eq!(count("missing_token"), Some(1.0), "{metrics}");
    assert_eq!(count("rate_limited"), Some(36.0), "{metrics}");

    // … and logged: a line for the first failure of the window and one when
    // the source was limited, with source and path, never a token.
    let log = logs.text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("admin authentication"))
        .collect();
    assert_eq!(lines.len(), 2, "{log}");
    for l in &lines {
        assert!(l.contains("WARN"), "{l}");
        assert!(l.contains("127.0.0.1"), "{l}");
        assert!(l.contains("/api/v1/refresh"), "{l}");
    }
    assert!(
        lines[1].contains("429") || lines[1].contains("limited"),
        "{}",
        lines[1]
    );
    assert!(!log.contains(GUESS) && !log.contains("guessed"), "{log}");
    assert!(!log.contains(ADMIN) && !log.contains(&ADMIN[..8]), "{log}");
    drop(other);
    h.stop().await;
}

//! HTTP tests of the simulated Fly Machines API and agents, over loopback with reqwest.
//!
//! Every await is bounded by `within` (or a client timeout), so a broken
//! simulator fails a test instead of hanging the suite.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use fleet_reconciler::sim::{
    AuditConfig, Behaviour, Chaos, ChaosEvent, ChaosFault, CheckStatus, Credential, DEFAULT_CHECK,
    DEFAULT_LEASE_OWNER, HostDownMetadata, HostStatus, MetadataFencing, NON_HEX_REF,
    OperatorWriteRefused, OutsideLease, RateLimit, RateLimits, RequestTarget, RetryAfter, Sim,
    SimApp, SimFleet, SimMachine, WorldFault, WorldFaultKind,
};
use reqwest::{Method, StatusCode, header};
use serde_json::{Value, json};

use crate::common::within;

const TOKEN: &str = "test-fly-token";
const AGENT_TOKEN: &str = "agent-secret";
const TIP: &str = "1111111111111111111111111111111111111111";
const OLD: &str = "2222222222222222222222222222222222222222";
const NEW: &str = "3333333333333333333333333333333333333333";
const APP: &str = "agents";

fn fleet() -> SimFleet {
    SimFleet::new(TOKEN)
        .release_tip(TIP)
        .restart_delay(Duration::from_millis(100))
        .reload_delay(Duration::from_millis(50))
        .app(
            SimApp::new(APP)
                .machine(
                    SimMachine::new("m1")
                        .name("agent-one")
                        .region("ams")
                        .loaded(OLD)
                        .metadata("pool", "dispatch"),
                )
                .machine(SimMachine::new("m2"))
                .machine(SimMachine::new("m3").stopped()),
        )
        .app(SimApp::new("other").machine(SimMachine::new("o1")))
}

/// A started simulator and a client that talks to it.
struct Harness {
    sim: Sim,
    http: reqwest::Client,
}

/// Status, headers and body (JSON if it parses, else `Value::Null`) of a response.
struct Reply {
    status: StatusCode,
    headers: header::HeaderMap,
    body: Value,
}

impl Harness {
    async fn start(fleet: SimFleet) -> Harness {
        let sim = within(Sim::start(fleet)).await.expect("sim starts");
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client builds");
        Harness { sim, http }
    }

    fn machines_url(&self, app: &str, rest: &str) -> String {
        format!("{}/v1/apps/{app}/machines{rest}", self.sim.api_url())
    }

    fn agent_url(&self, id: &str, rest: &str) -> String {
        format!("{}/agents/{id}/{rest}", self.sim.api_url())
    }

    /// A Fly API request on app `agents` with the Bearer token and an optional nonce.
    async fn fly(
        &self,
        method: Method,
        rest: &str,
        nonce: Option<&str>,
        body: Option<Value>,
    ) -> Reply {
        self.fly_in(APP, method, rest, nonce, body).await
    }

    /// Like [`Harness::fly`], on any app.
    async fn fly_in(
        &self,
        app: &str,
        method: Method,
        rest: &str,
        nonce: Option<&str>,
        body: Option<Value>,
    ) -> Reply {
        let mut request = self
            .http
            .request(method, self.machines_url(app, rest))
            .bearer_auth(TOKEN);
        if let Some(nonce) = nonce {
            request = request.header("fly-machine-lease-nonce", nonce);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        reply(request).await
    }

    async fn get(&self, rest: &str) -> Reply {
        self.fly(Method::GET, rest, None, None).await
    }

    async fn post(&self, rest: &str, nonce: Option<&str>, body: Option<Value>) -> Reply {
        self.fly(Method::POST, rest, nonce, body).await
    }

    async fn health(&self, id: &str) -> Reply {
        reply(self.http.get(self.agent_url(id, "health"))).await
    }

    async fn agent_post(&self, id: &str, rest: &str, token: Option<&str>, body: Value) -> Reply {
        let mut request = self.http.post(self.agent_url(id, rest)).json(&body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        reply(request).await
    }

    async fn wait_for(&self, id: &str, state: &str, timeout_secs: u64) -> Reply {
        self.get(&format!("/{id}/wait?state={state}&timeout={timeout_secs}"))
            .await
    }
}

async fn reply(request: reqwest::RequestBuilder) -> Reply {
    let response = within(request.send()).await.expect("request is answered");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = within(response.bytes()).await.expect("body is read");
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Reply {
        status,
        headers,
        body,
    }
}

fn error_text(reply: &Reply) -> &str {
    reply.body["error"]
        .as_str()
        .unwrap_or_else(|| panic!("no JSON error in {:?}", reply.body))
}

fn parse_time(v: &Value) -> DateTime<Utc> {
    let s = v.as_str().unwrap_or_else(|| panic!("not a timestamp: {v}"));
    DateTime::parse_from_rfc3339(s)
        .unwrap_or_else(|e| panic!("not RFC 3339: {s}: {e}"))
        .with_timezone(&Utc)
}

#[tokio::test]
async fn fly_api_requires_the_fleet_token_in_either_form() {
    let h = Harness::start(fleet()).await;
    let url = h.machines_url(APP, "");

    let missing = reply(h.http.get(&url)).await;
    assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
    assert!(!error_text(&missing).is_empty());

    let wrong = reply(h.http.get(&url).bearer_auth("not-the-token")).await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);

    let bare = reply(h.http.get(&url).header(header::AUTHORIZATION, TOKEN)).await;
    assert_eq!(
        bare.status,
        StatusCode::UNAUTHORIZED,
        "a token without a scheme is refused"
    );

    let bearer = reply(h.http.get(&url).bearer_auth(TOKEN)).await;
    assert_eq!(bearer.status, StatusCode::OK);

    let flyv1 = reply(
        h.http
            .get(&url)
            .header(header::AUTHORIZATION, format!("FlyV1 {TOKEN}")),
    )
    .await;
    assert_eq!(flyv1.status, StatusCode::OK);

    // Health GETs never need a token.
    assert_eq!(h.health("m1").await.status, StatusCode::OK);

    let log = h.sim.requests();
    let fly: Vec<_> = log
        .iter()
        .filter(|r| r.target == RequestTarget::FlyApi)
        .collect();
    assert_eq!(fly.len(), 5);
    assert_eq!(
        fly.iter().map(|r| r.authorized).collect::<Vec<_>>(),
        vec![false, false, false, true, true]
    );
    assert_eq!(fly[0].credential, Credential::None);
    assert_eq!(fly[1].credential, Credential::Other);
    assert_eq!(fly[3].credential, Credential::FlyToken);
    assert_eq!(fly[0].status, Some(401));
    assert_eq!(fly[4].status, Some(200));
    let health = log
        .iter()
        .find(|r| r.target == RequestTarget::Agent)
        .expect("health recorded");
    assert!(health.authorized);
    assert_eq!(health.credential, Credential::None);
}

#[tokio::test]
async fn a_fleet_token_with_flyv1_prefix_is_matched_without_it() {
    let h = Harness::start(SimFleet::new("FlyV1 fm2_secret").app(SimApp::new(APP))).await;
    let url = h.machines_url(APP, "");
    let verbatim = reply(
        h.http
            .get(&url)
            .header(header::AUTHORIZATION, "FlyV1 fm2_secret"),
    )
    .await;
    assert_eq!(verbatim.status, StatusCode::OK);
    assert_eq!(verbatim.body, json!([]));
}

#[tokio::test]
async fn list_and_get_have_the_machine_schema_shape() {
    // Many lists back to back: Fly's per-app list limit is tested apart.
    let h = Harness::start(fleet().list_rate_limit(None)).await;

    let list = h.get("").await;
    assert_eq!(list.status, StatusCode::OK);
    let machines = list.body.as_array().expect("array of machines");
    let ids: Vec<&str> = machines.iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, vec!["m1", "m2", "m3"]);

    let m1 = &machines[0];
    for field in [
        "id",
        "name",
        "state",
        "region",
        "instance_id",
        "private_ip",
        "created_at",
        "updated_at",
    ] {
        assert!(m1[field].is_string(), "field {field} missing in {m1}");
    }
    assert_eq!(m1["name"], "agent-one");
    assert_eq!(m1["region"], "ams");
    assert_eq!(m1["state"], "started");
    assert_eq!(machines[2]["state"], "stopped");
    parse_time(&m1["created_at"]);
    parse_time(&m1["updated_at"]);
    assert_eq!(m1["config"]["metadata"]["pool"], "dispatch");
    assert!(m1["config"]["image"].is_string());

    let summary = h.get("?summary=true").await;
    let summarized = summary.body.as_array().expect("array");
    assert_eq!(summarized.len(), 3);
    assert!(
        summarized.iter().all(|m| m.get("config").is_none()),
        "summary drops config and metadata"
    );
    assert_eq!(summarized[0]["instance_id"], m1["instance_id"]);

    let stopped = h.get("?state=stopped").await;
    let stopped_ids: Vec<&str> = stopped
        .body
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(stopped_ids, vec!["m3"]);
    let both = h.get("?state=started,stopped").await;
    assert_eq!(both.body.as_array().map(Vec::len), Some(3));
    let by_region = h.get("?region=ams").await;
    assert_eq!(by_region.body.as_array().map(Vec::len), Some(1));

    let one = h.get("/m1").await;
    assert_eq!(one.status, StatusCode::OK);
    assert_eq!(&one.body, m1);

    let unknown_app = reply(h.http.get(h.machines_url("nope", "")).bearer_auth(TOKEN)).await;
    assert_eq!(unknown_app.status, StatusCode::NOT_FOUND);
    assert_eq!(error_text(&unknown_app), "app not found");

    let unknown_machine = h.get("/zz").await;
    assert_eq!(unknown_machine.status, StatusCode::NOT_FOUND);
    assert!(error_text(&unknown_machine).contains("zz"));

    // A machine of another app is not found under this one.
    assert_eq!(h.get("/o1").await.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn lease_acquire_conflict_refresh_and_release() {
    // Five lease POSTs on m1 in a row: past Fly's burst of 3, and this test
    // is about the lease protocol, not the limits.
    let h = Harness::start(fleet().unlimited()).await;
    let before = Utc::now().timestamp();

    let acquired = h
        .post(
            "/m1/lease",
            None,
            Some(json!({"ttl": 13, "description": "fleet-reconciler rotation"})),
        )
        .await;
    assert_eq!(acquired.status, StatusCode::CREATED);
    assert_eq!(acquired.body["status"], "success");
    let data = &acquired.body["data"];
    let nonce = data["nonce"].as_str().expect("nonce").to_string();
    assert!(!nonce.is_empty());
    assert_eq!(data["owner"], DEFAULT_LEASE_OWNER);
    assert_eq!(data["description"], "fleet-reconciler rotation");
    let instance_id = h.sim.machine("m1").expect("m1").instance_id;
    assert_eq!(data["version"], instance_id.as_str());
    let expires = data["expires_at"].as_i64().expect("unix seconds");
    assert!(
        (before + 12..=before + 15).contains(&expires),
        "expires_at {expires} not ~13 s after {before}"
    );

    let second = h.post("/m1/lease", None, Some(json!({"ttl": 13}))).await;
    assert_eq!(second.status, StatusCode::CONFLICT);
    let message = error_text(&second);
    assert!(message.contains("lease currently held by"), "{message}");
    assert!(message.contains(DEFAULT_LEASE_OWNER), "{message}");
    assert!(message.contains("machine ID m1"), "{message}");

    let wrong_nonce = h
        .post("/m1/lease", Some("not-the-nonce"), Some(json!({"ttl": 13})))
        .await;
    assert_eq!(wrong_nonce.status, StatusCode::CONFLICT);

    let refreshed = h
        .post("/m1/lease", Some(&nonce), Some(json!({"ttl": 60})))
        .await;
    assert_eq!(refreshed.status, StatusCode::CREATED);
    assert_eq!(refreshed.body["data"]["nonce"], nonce.as_str());
    let new_expiry = refreshed.body["data"]["expires_at"]
        .as_i64()
        .expect("unix seconds");
    assert!(
        new_expiry >= expires + 40,
        "refresh extends: {new_expiry} vs {expires}"
    );

    let shown = h.get("/m1/lease").await;
    assert_eq!(shown.status, StatusCode::OK);
    assert_eq!(shown.body["data"]["nonce"], nonce.as_str());
    assert_eq!(shown.body["data"]["expires_at"], new_expiry);

    let bad_release = h
        .fly(Method::DELETE, "/m1/lease", Some("not-the-nonce"), None)
        .await;
    assert_eq!(bad_release.status, StatusCode::CONFLICT);
    let no_header = h.fly(Method::DELETE, "/m1/lease", None, None).await;
    assert_eq!(no_header.status, StatusCode::CONFLICT);
    assert!(
        h.sim.machine("m1").expect("m1").lease.is_some(),
        "a refused release keeps the lease"
    );

    let released = h.fly(Method::DELETE, "/m1/lease", Some(&nonce), None).await;
    assert_eq!(released.status, StatusCode::OK);
    assert!(h.sim.machine("m1").expect("m1").lease.is_none());

    let gone = h.get("/m1/lease").await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
    let again = h.fly(Method::DELETE, "/m1/lease", Some(&nonce), None).await;
    assert_eq!(again.status, StatusCode::NOT_FOUND);
    assert_eq!(error_text(&again), "lease not found");

    // TTL from the query alone, with no body.
    let by_query = h.post("/m2/lease?ttl=20", None, None).await;
    assert_eq!(by_query.status, StatusCode::CREATED);
    let expires = by_query.body["data"]["expires_at"]
        .as_i64()
        .expect("unix seconds");
    let now = Utc::now().timestamp();
    assert!((now + 18..=now + 21).contains(&expires));

    let held = h.post("/m2/lease", None, None).await;
    assert_eq!(held.status, StatusCode::CONFLICT);
    let bad_body = reply(
        h.http
            .post(h.machines_url(APP, "/m3/lease"))
            .bearer_auth(TOKEN)
            .body("{not json"),
    )
    .await;
    assert_eq!(bad_body.status, StatusCode::BAD_REQUEST);
    assert!(!error_text(&bad_body).is_empty());
}

#[tokio::test]
async fn a_leased_machine_refuses_mutations_without_the_nonce() {
    let h = Harness::start(fleet()).await;
    // The old, idealized sim fenced metadata writes too; Fly does not
    // (see `metadata_writes_are_not_fenced_by_leases`).
    h.sim.set_metadata_fencing(MetadataFencing::FencedByLease);
    let nonce = h
        .sim
        .acquire_lease_as("m1", "operator@example.com", Duration::from_secs(60))
        .expect("m1 exists");

    let attempts: Vec<(Method, &str, Option<Value>)> = vec![
        (Method::POST, "/m1/restart?timeout=10s", None),
        (Method::POST, "/m1/stop", None),
        (Method::POST, "/m1/start", None),
        (Method::POST, "/m1/cordon", None),
        (Method::POST, "/m1/uncordon", None),
        (
            Method::POST,
            "/m1/metadata/fleet_reconciler_rotation",
            Some(json!({"value": "x"})),
        ),
        (Method::DELETE, "/m1/metadata/pool", None),
        (
            Method::PATCH,
            "/m1/metadata",
            Some(json!({"metadata": {"a": "b"}})),
        ),
        (Method::POST, "/m1", Some(json!({"config": {"image": "x"}}))),
        (Method::POST, "/m1/lease", Some(json!({"ttl": 13}))),
    ];
    for (method, path, body) in attempts {
        let refused = h.fly(method.clone(), path, None, body).await;
        assert_eq!(
            refused.status,
            StatusCode::CONFLICT,
            "{method} {path} without nonce"
        );
        let message = error_text(&refused);
        assert!(
            message.contains("lease currently held by operator@example.com"),
            "{message}"
        );
    }
    let m1 = h.sim.machine("m1").expect("m1");
    assert_eq!(m1.restart_count, 0);
    assert_eq!(m1.state, "started");
    assert!(!m1.cordoned);
    assert_eq!(
        m1.metadata.get("pool").map(String::as_str),
        Some("dispatch")
    );

    let cordoned = h.post("/m1/cordon", Some(&nonce), None).await;
    assert_eq!(cordoned.status, StatusCode::OK);
    assert!(h.sim.machine("m1").expect("m1").cordoned);
    let written = h
        .post(
            "/m1/metadata/note",
            Some(&nonce),
            Some(json!({"value": "hi"})),
        )
        .await;
    assert_eq!(written.status, StatusCode::NO_CONTENT);

    // Reads need no nonce, and unleased machines take mutations without one.
    assert_eq!(h.get("/m1").await.status, StatusCode::OK);
    assert_eq!(
        h.post("/m2/cordon", None, None).await.status,
        StatusCode::OK
    );

    // The log shows which mutating calls carried which nonce.
    let mutating: Vec<_> = h
        .sim
        .requests()
        .into_iter()
        .filter(|r| r.is_mutating())
        .collect();
    let accepted: Vec<_> = mutating
        .iter()
        .filter(|r| r.status.is_some_and(|s| s < 300))
        .collect();
    assert_eq!(accepted.len(), 3);
    assert!(
        accepted
            .iter()
            .filter(|r| r.machine_id.as_deref() == Some("m1"))
            .all(|r| r.lease_nonce.as_deref() == Some(nonce.as_str()))
    );
    assert!(
        mutating
            .iter()
            .filter(|r| r.status == Some(409))
            .all(|r| r.lease_nonce.is_none())
    );
}

#[tokio::test]
async fn an_expired_lease_counts_as_absent() {
    let h = Harness::start(fleet()).await;
    h.sim
        .acquire_lease_as("m2", "other@example.com", Duration::from_secs(5))
        .expect("m2 exists");
    assert_eq!(
        h.post("/m2/cordon", None, None).await.status,
        StatusCode::CONFLICT
    );

    h.sim.advance_clock(Duration::from_secs(6));
    assert!(h.sim.machine("m2").expect("m2").lease.is_none());
    assert_eq!(h.get("/m2/lease").await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        h.post("/m2/cordon", None, None).await.status,
        StatusCode::OK
    );
    let ours = h.post("/m2/lease", None, Some(json!({"ttl": 13}))).await;
    assert_eq!(ours.status, StatusCode::CREATED);
    assert_eq!(ours.body["data"]["owner"], DEFAULT_LEASE_OWNER);
}

#[tokio::test]
async fn metadata_set_get_delete_and_compare_and_set() {
    let h = Harness::start(fleet()).await;
    let v0 = h.sim.machine("m1").expect("m1").instance_id;

    let set = h
        .post("/m1/metadata/owner", None, Some(json!({"value": "team-a"})))
        .await;
    assert_eq!(set.status, StatusCode::NO_CONTENT);
    let got = h.get("/m1/metadata/owner").await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.body, json!({"value": "team-a"}));
    let all = h.get("/m1/metadata").await;
    assert_eq!(all.body["owner"], "team-a");
    assert_eq!(all.body["pool"], "dispatch");

    let v1 = h.sim.machine("m1").expect("m1").instance_id;
    // FLY-REALITY.md: metadata writes create no machine version, so the
    // version is no compare-and-set on metadata; only an update changes it.
    assert_eq!(v0, v1, "a metadata write creates no machine version");
    assert_eq!(h.get("/m1").await.body["instance_id"], v1.as_str());

    let stale = h
        .fly(
            Method::PATCH,
            "/m1/metadata",
            None,
            Some(json!({"metadata": {"owner": "team-b"}, "machine_version": "01STALEVERSION"})),
        )
        .await;
    assert_eq!(stale.status, StatusCode::PRECONDITION_FAILED);
    assert!(!error_text(&stale).is_empty());
    assert_eq!(
        h.get("/m1/metadata/owner").await.body["value"],
        "team-a",
        "a refused CAS writes nothing"
    );

    let fresh = h
        .fly(
            Method::PATCH,
            "/m1/metadata",
            None,
            Some(json!({"metadata": {"owner": "team-b", "pool": null, "fly_process_group": ""}, "machine_version": v1})),
        )
        .await;
    assert_eq!(fresh.status, StatusCode::NO_CONTENT);
    let after = h.sim.machine("m1").expect("m1");
    assert_eq!(
        after.metadata.get("owner").map(String::as_str),
        Some("team-b")
    );
    assert!(!after.metadata.contains_key("pool"), "null removes");
    assert!(
        !after.metadata.contains_key("fly_process_group"),
        "empty string removes"
    );
    assert_eq!(after.instance_id, v1, "still no new machine version");

    let put = h
        .fly(
            Method::PUT,
            "/m1/metadata",
            None,
            Some(json!({"metadata": {"x": "1"}})),
        )
        .await;
    assert_eq!(put.status, StatusCode::NO_CONTENT);
    assert_eq!(h.get("/m1/metadata/x").await.body["value"], "1");

    let deleted = h
        .fly(Method::DELETE, "/m1/metadata/owner", None, None)
        .await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT);
    let missing = h.get("/m1/metadata/owner").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert!(!error_text(&missing).is_empty());

    let no_value = h.post("/m1/metadata/owner", None, Some(json!({}))).await;
    assert_eq!(no_value.status, StatusCode::BAD_REQUEST);
    let not_json = reply(
        h.http
            .patch(h.machines_url(APP, "/m1/metadata"))
            .bearer_auth(TOKEN)
            .body("metadata=1"),
    )
    .await;
    assert_eq!(not_json.status, StatusCode::BAD_REQUEST);
    assert!(error_text(&not_json).contains("JSON"));
}

#[tokio::test]
async fn wait_times_out_with_408_and_rejects_bad_parameters() {
    let h = Harness::start(fleet()).await;
    let started = tokio::time::Instant::now();
    let timed_out = h.wait_for("m2", "stopped", 1).await;
    assert_eq!(timed_out.status, StatusCode::REQUEST_TIMEOUT);
    assert!(error_text(&timed_out).starts_with("deadline_exceeded"));
    assert!(started.elapsed() >= Duration::from_millis(900));

    let already = h.wait_for("m2", "started", 1).await;
    assert_eq!(already.status, StatusCode::OK);
    assert_eq!(already.body["ok"], true);
    assert_eq!(already.body["state"], "started");

    assert_eq!(
        h.wait_for("m2", "dancing", 1).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        h.get("/m2/wait?timeout=soon").await.status,
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test]
async fn restart_brings_the_agent_back_idle_on_the_current_tip() {
    let fleet = SimFleet::new(TOKEN)
        .release_tip(TIP)
        .restart_delay(Duration::from_millis(300))
        .app(
            SimApp::new(APP).machine(
                SimMachine::new("m1")
                    .loaded(OLD)
                    .cooperative()
                    .live_sessions(2)
                    .behaviour(Behaviour::BusyFor(Duration::from_secs(3600))),
            ),
        );
    let h = Harness::start(fleet).await;

    let before = h.health("m1").await;
    assert_eq!(before.body["overlay_ref"], OLD);
    assert_eq!(before.body["activity"], "busy");
    assert_eq!(before.body["live_sessions"], 2);
    h.agent_post("m1", "overlay/drain", None, json!({"rotation": "r1"}))
        .await;
    let instance_id = h.sim.machine("m1").expect("m1").instance_id;

    // The tip moves after the fixture was built: the restarted agent loads the new one.
    h.sim.set_release_tip(NEW);
    let restarted = h.post("/m1/restart?timeout=30s", None, None).await;
    assert_eq!(restarted.status, StatusCode::OK);
    assert_eq!(h.get("/m1").await.body["state"], "stopping");
    assert_eq!(h.health("m1").await.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(h.sim.machine("m1").expect("m1").restart_count, 1);

    // Restarting a machine that is not started is refused.
    assert_eq!(
        h.post("/m1/restart", None, None).await.status,
        StatusCode::PRECONDITION_FAILED
    );

    let waited = h.wait_for("m1", "started", 5).await;
    assert_eq!(waited.status, StatusCode::OK, "{:?}", waited.body);
    assert_eq!(waited.body["state"], "started");

    let after = h.health("m1").await;
    assert_eq!(after.status, StatusCode::OK);
    assert_eq!(after.body["overlay_ref"], NEW);
    assert_eq!(after.body["activity"], "idle");
    assert_eq!(after.body["live_sessions"], 0);
    assert_eq!(
        after.body["rotation"],
        json!({"fenced": false, "checkpoint": null})
    );
    let m1 = h.sim.machine("m1").expect("m1");
    assert_eq!(m1.behaviour, Behaviour::Normal);
    assert_eq!(m1.restart_count, 1);
    assert_eq!(m1.loaded_ref, NEW);
    assert_eq!(m1.instance_id, instance_id);
}

#[tokio::test]
async fn stop_makes_the_agent_unreachable_and_start_boots_it_on_the_tip() {
    let h = Harness::start(fleet()).await;
    assert_eq!(h.health("m1").await.body["overlay_ref"], OLD);

    assert_eq!(
        h.post("/m1/stop", None, Some(json!({"signal": "SIGTERM"})))
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(h.wait_for("m1", "stopped", 5).await.status, StatusCode::OK);
    let down = h.health("m1").await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!error_text(&down).is_empty());

    let started = h.post("/m1/start", None, None).await;
    assert_eq!(started.status, StatusCode::OK);
    assert_eq!(started.body["previous_state"], "stopped");
    assert_eq!(h.wait_for("m1", "started", 5).await.status, StatusCode::OK);
    let up = h.health("m1").await;
    assert_eq!(up.status, StatusCode::OK);
    assert_eq!(up.body["overlay_ref"], TIP);
    assert_eq!(h.sim.machine("m1").expect("m1").restart_count, 0);
}

#[tokio::test]
async fn update_replaces_config_and_machine() {
    let h = Harness::start(fleet()).await;
    let updated = h
        .post("/m1", None, Some(json!({"config": {"image": "registry.fly.io/agents:v2", "metadata": {"pool": "conv"}}})))
        .await;
    assert_eq!(updated.status, StatusCode::OK);
    assert_eq!(updated.body["config"]["image"], "registry.fly.io/agents:v2");
    assert_eq!(
        updated.body["config"]["metadata"],
        json!({"pool": "conv"}),
        "config is replaced wholesale"
    );
    assert_eq!(updated.body["state"], "replacing");
    assert_eq!(h.wait_for("m1", "started", 5).await.status, StatusCode::OK);
    assert_eq!(h.health("m1").await.body["overlay_ref"], TIP);
    assert_eq!(
        h.post("/m1", None, Some(json!({}))).await.status,
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test]
async fn normal_health_report_follows_the_agent_contract() {
    let input = DateTime::parse_from_rfc3339("2026-05-01T10:00:00Z")
        .expect("valid time")
        .with_timezone(&Utc);
    let fleet = SimFleet::new(TOKEN).release_tip(TIP).app(
        SimApp::new(APP)
            .machine(SimMachine::new("plain").loaded(OLD))
            .machine(
                SimMachine::new("short")
                    .loaded(OLD)
                    .report_ref_len(7)
                    .last_input_at(input),
            )
            .machine(SimMachine::new("coop").cooperative().live_sessions(1)),
    );
    let h = Harness::start(fleet).await;

    let plain = h.health("plain").await;
    assert_eq!(plain.status, StatusCode::OK);
    assert_eq!(plain.body["overlay_ref"], OLD);
    assert_eq!(plain.body["activity"], "idle");
    assert_eq!(plain.body["live_sessions"], 0);
    assert!(plain.body["last_input_at"].is_null());
    let heartbeat = parse_time(&plain.body["heartbeat_at"]);
    assert!((Utc::now() - heartbeat).num_seconds().abs() < 5);
    assert_eq!(plain.body["capabilities"], json!([]));
    assert!(
        plain.body.get("rotation").is_none(),
        "rotation only with the drain capability"
    );

    let short = h.health("short").await;
    assert_eq!(short.body["overlay_ref"], &OLD[..7]);
    assert_eq!(parse_time(&short.body["last_input_at"]), input);

    let coop = h.health("coop").await;
    assert_eq!(coop.body["overlay_ref"], TIP);
    assert_eq!(coop.body["capabilities"], json!(["drain", "reload"]));
    assert_eq!(coop.body["live_sessions"], 1);
    assert_eq!(
        coop.body["rotation"],
        json!({"fenced": false, "checkpoint": null})
    );

    let unknown = h.health("nope").await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);

    h.sim.set_loaded_ref("plain", NEW);
    assert_eq!(h.health("plain").await.body["overlay_ref"], NEW);
}

#[tokio::test]
async fn busy_agent_reports_live_work_until_it_is_done() {
    let h = Harness::start(fleet()).await;
    assert!(
        h.sim
            .set_behaviour("m2", Behaviour::BusyFor(Duration::from_secs(60)))
    );
    let busy = h.health("m2").await;
    assert_eq!(busy.body["activity"], "busy");
    assert!(busy.body["live_sessions"].as_u64() >= Some(1));

    h.sim.advance_clock(Duration::from_secs(61));
    let idle = h.health("m2").await;
    assert_eq!(idle.body["activity"], "idle");
    assert_eq!(idle.body["live_sessions"], 0);
    assert!(!h.sim.set_behaviour("nope", Behaviour::Normal));
}

#[tokio::test]
async fn a_hung_agent_never_answers_but_blocks_nobody() {
    let h = Harness::start(fleet()).await;
    h.sim.set_behaviour("m1", Behaviour::Hang);

    let hung = within(
        h.http
            .get(h.agent_url("m1", "health"))
            .timeout(Duration::from_millis(300))
            .send(),
    )
    .await;
    let err = hung.expect_err("a hung agent must not answer");
    assert!(err.is_timeout(), "{err}");

    // While one request hangs, others are served.
    let pending = h.http.get(h.agent_url("m1", "health")).send();
    let (still_hung, other) = tokio::join!(
        tokio::time::timeout(Duration::from_millis(300), pending),
        h.health("m2")
    );
    assert!(still_hung.is_err(), "hang persists");
    assert_eq!(other.status, StatusCode::OK);
    let unanswered = h
        .sim
        .requests()
        .into_iter()
        .filter(|r| r.machine_id.as_deref() == Some("m1") && r.status.is_none())
        .count();
    assert_eq!(unanswered, 2);
}

#[tokio::test]
async fn garbage_missing_and_non_hex_reports() {
    let h = Harness::start(fleet()).await;

    h.sim.set_behaviour("m1", Behaviour::Garbage);
    let response = within(h.http.get(h.agent_url("m1", "health")).send())
        .await
        .expect("answered");
    assert_eq!(response.status(), StatusCode::OK);
    let body = within(response.bytes()).await.expect("body");
    assert!(!body.is_empty());
    assert!(
        serde_json::from_slice::<Value>(&body).is_err(),
        "garbage must not parse as JSON"
    );

    h.sim.set_behaviour("m1", Behaviour::MissingRef);
    let missing = h.health("m1").await;
    assert_eq!(missing.status, StatusCode::OK);
    assert!(missing.body.is_object());
    assert!(missing.body.get("overlay_ref").is_none());
    assert_eq!(missing.body["activity"], "idle");

    h.sim.set_behaviour("m1", Behaviour::NonHexRef);
    let non_hex = h.health("m1").await;
    assert_eq!(non_hex.body["overlay_ref"], NON_HEX_REF);
    assert_eq!(NON_HEX_REF, "release-2026-11");

    h.sim.set_behaviour("m1", Behaviour::HttpError(500));
    let failing = h.health("m1").await;
    assert_eq!(failing.status, StatusCode::INTERNAL_SERVER_ERROR);
    h.sim.set_behaviour("m1", Behaviour::HttpError(429));
    assert_eq!(h.health("m1").await.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn oversized_report_is_streamed_past_one_mebibyte() {
    let h = Harness::start(fleet()).await;
    h.sim.set_behaviour("m1", Behaviour::Oversized);
    let response = within(h.http.get(h.agent_url("m1", "health")).send())
        .await
        .expect("answered");
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers().get(header::CONTENT_LENGTH).is_none(),
        "streamed without a length"
    );
    let body = within(response.bytes()).await.expect("body");
    assert!(
        body.len() > 1024 * 1024,
        "body is only {} bytes",
        body.len()
    );
    let report: Value = serde_json::from_slice(&body).expect("valid-looking JSON");
    assert_eq!(report["overlay_ref"], OLD);
}

#[tokio::test]
async fn drain_handshake_with_agent_token() {
    let fleet = SimFleet::new(TOKEN).release_tip(TIP).app(
        SimApp::new(APP)
            .machine(
                SimMachine::new("coop")
                    .loaded(OLD)
                    .cooperative()
                    .agent_token(AGENT_TOKEN)
                    .live_sessions(1)
                    .behaviour(Behaviour::BusyFor(Duration::from_secs(600))),
            )
            .machine(SimMachine::new("plain")),
    );
    let h = Harness::start(fleet).await;
    let tag = json!({"rotation": "rot-42"});

    let no_token = h
        .agent_post("coop", "overlay/drain", None, tag.clone())
        .await;
    assert_eq!(no_token.status, StatusCode::UNAUTHORIZED);
    let fly_token = h
        .agent_post("coop", "overlay/drain", Some(TOKEN), tag.clone())
        .await;
    assert_eq!(fly_token.status, StatusCode::UNAUTHORIZED);
    assert!(h.sim.machine("coop").expect("coop").fence.is_none());

    let bad_body = h
        .agent_post("coop", "overlay/drain", Some(AGENT_TOKEN), json!({}))
        .await;
    assert_eq!(bad_body.status, StatusCode::BAD_REQUEST);

    let drained = h
        .agent_post("coop", "overlay/drain", Some(AGENT_TOKEN), tag.clone())
        .await;
    assert_eq!(drained.status, StatusCode::OK);

    // Fenced, but the current work still runs: no checkpoint yet.
    let working = h.health("coop").await;
    assert_eq!(
        working.body["rotation"],
        json!({"fenced": true, "checkpoint": null})
    );
    assert_eq!(working.body["activity"], "busy");
    assert!(working.body["live_sessions"].as_u64() >= Some(1));

    // The work finishes: the agent checkpoints and reports idle with nothing to lose.
    h.sim.advance_clock(Duration::from_secs(601));
    let ready = h.health("coop").await;
    assert_eq!(
        ready.body["rotation"],
        json!({"fenced": true, "checkpoint": "rot-42"})
    );
    assert_eq!(ready.body["activity"], "idle");
    assert_eq!(ready.body["live_sessions"], 0);

    let wrong_tag = h
        .agent_post(
            "coop",
            "overlay/undrain",
            Some(AGENT_TOKEN),
            json!({"rotation": "rot-7"}),
        )
        .await;
    assert_eq!(wrong_tag.status, StatusCode::CONFLICT);
    let undrained = h
        .agent_post("coop", "overlay/undrain", Some(AGENT_TOKEN), tag.clone())
        .await;
    assert_eq!(undrained.status, StatusCode::OK);
    let released = h.health("coop").await;
    assert_eq!(
        released.body["rotation"],
        json!({"fenced": false, "checkpoint": null})
    );
    assert_eq!(
        released.body["live_sessions"], 1,
        "open sessions are back once unfenced"
    );

    // An agent without the capability does not serve the endpoint.
    let unsupported = h
        .agent_post("plain", "overlay/drain", None, tag.clone())
        .await;
    assert_eq!(unsupported.status, StatusCode::NOT_FOUND);

    let log = h.sim.requests();
    let agent_posts: Vec<_> = log
        .iter()
        .filter(|r| r.target == RequestTarget::Agent && r.method == "POST")
        .collect();
    assert_eq!(agent_posts.len(), 7);
    assert_eq!(agent_posts[1].credential, Credential::FlyToken);
    assert!(!agent_posts[1].authorized);
    assert_eq!(agent_posts[3].credential, Credential::AgentToken);
    assert_eq!(agent_posts[3].action.as_deref(), Some("overlay/drain"));
    assert!(agent_posts[3].body.contains("rot-42"));
}

#[tokio::test]
async fn reload_loads_the_ref_in_place_after_a_delay() {
    let fleet = SimFleet::new(TOKEN)
        .release_tip(TIP)
        .reload_delay(Duration::from_millis(50))
        .app(
            SimApp::new(APP)
                .machine(
                    SimMachine::new("coop")
                        .loaded(OLD)
                        .cooperative()
                        .agent_token(AGENT_TOKEN),
                )
                .machine(
                    SimMachine::new("drain-only")
                        .loaded(OLD)
                        .capability("drain"),
                ),
        );
    let h = Harness::start(fleet).await;

    let unauthorized = h
        .agent_post("coop", "overlay/reload", None, json!({"ref": NEW}))
        .await;
    assert_eq!(unauthorized.status, StatusCode::UNAUTHORIZED);
    let not_hex = h
        .agent_post(
            "coop",
            "overlay/reload",
            Some(AGENT_TOKEN),
            json!({"ref": "main"}),
        )
        .await;
    assert_eq!(not_hex.status, StatusCode::BAD_REQUEST);
    let unsupported = h
        .agent_post("drain-only", "overlay/reload", None, json!({"ref": NEW}))
        .await;
    assert_eq!(unsupported.status, StatusCode::NOT_FOUND);

    let accepted = h
        .agent_post(
            "coop",
            "overlay/reload",
            Some(AGENT_TOKEN),
            json!({"ref": NEW}),
        )
        .await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED);

    // Success shows only in a later report.
    within(async {
        loop {
            if h.health("coop").await.body["overlay_ref"] == NEW {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(h.sim.machine("coop").expect("coop").loaded_ref, NEW);
    assert_eq!(h.sim.machine("coop").expect("coop").restart_count, 0);
}

#[tokio::test]
async fn hung_and_failing_agents_misbehave_on_cooperative_endpoints_too() {
    let fleet =
        SimFleet::new(TOKEN).app(SimApp::new(APP).machine(SimMachine::new("coop").cooperative()));
    let h = Harness::start(fleet).await;
    h.sim.set_behaviour("coop", Behaviour::HttpError(503));
    let failing = h
        .agent_post("coop", "overlay/drain", None, json!({"rotation": "r"}))
        .await;
    assert_eq!(failing.status, StatusCode::SERVICE_UNAVAILABLE);

    h.sim.set_behaviour("coop", Behaviour::Hang);
    let hung = within(
        h.http
            .post(h.agent_url("coop", "overlay/drain"))
            .json(&json!({"rotation": "r"}))
            .timeout(Duration::from_millis(300))
            .send(),
    )
    .await;
    assert!(hung.expect_err("hangs").is_timeout());
    assert!(h.sim.machine("coop").expect("coop").fence.is_none());
}

#[tokio::test]
async fn fail_next_answers_the_injected_status_with_retry_after() {
    let h = Harness::start(fleet()).await;
    h.sim.fail_next(2, 429, Some(7));
    for _ in 0..2 {
        let throttled = h.get("/m1").await;
        assert_eq!(throttled.status, StatusCode::TOO_MANY_REQUESTS);
        let retry_after = throttled
            .headers
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok());
        assert_eq!(retry_after, Some("7"));
        assert!(!error_text(&throttled).is_empty());
    }
    assert_eq!(h.get("/m1").await.status, StatusCode::OK);

    // Without Retry-After; an unauthenticated request does not consume the fault.
    h.sim.fail_next(1, 503, None);
    let unauthenticated = reply(h.http.get(h.machines_url(APP, "/m1"))).await;
    assert_eq!(unauthenticated.status, StatusCode::UNAUTHORIZED);
    assert_eq!(h.sim.pending_failures(), 1);
    let unavailable = h.post("/m1/restart", None, None).await;
    assert_eq!(unavailable.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(unavailable.headers.get(header::RETRY_AFTER).is_none());
    assert_eq!(
        h.sim.machine("m1").expect("m1").restart_count,
        0,
        "an injected failure has no effect"
    );
    assert_eq!(h.get("/m1").await.status, StatusCode::OK);

    // Agents are not affected by Fly API faults.
    h.sim.fail_next(1, 500, None);
    assert_eq!(h.health("m1").await.status, StatusCode::OK);
    assert_eq!(h.sim.pending_failures(), 1);
}

#[tokio::test]
async fn optional_rate_limit_answers_429_per_machine_and_action() {
    let h = Harness::start(fleet().rate_limit(RateLimit {
        per_second: 0.01,
        burst: 2,
    }))
    .await;
    assert_eq!(
        h.post("/m1/cordon", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.post("/m1/cordon", None, None).await.status,
        StatusCode::OK
    );
    let limited = h.post("/m1/cordon", None, None).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    let secs: u64 = limited
        .headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("numeric Retry-After");
    assert!(secs >= 1);
    // Another action and another machine have their own budgets.
    assert_eq!(
        h.post("/m1/uncordon", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.post("/m2/cordon", None, None).await.status,
        StatusCode::OK
    );

    h.sim.set_rate_limit(None);
    assert_eq!(
        h.post("/m1/cordon", None, None).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn shutdown_releases_hung_requests_and_long_polls() {
    let h = Harness::start(fleet()).await;
    h.sim.set_behaviour("m1", Behaviour::Hang);
    let hung = tokio::spawn(h.http.get(h.agent_url("m1", "health")).send());
    let long_poll = tokio::spawn(
        h.http
            .get(h.machines_url(APP, "/m2/wait?state=stopped&timeout=60"))
            .bearer_auth(TOKEN)
            .send(),
    );
    // Let both requests reach the server before shutting it down.
    within(async {
        while h.sim.requests().len() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;

    let Harness { sim, http: _http } = h;
    within(sim.shutdown()).await;
    for task in [hung, long_poll] {
        let outcome = within(task).await.expect("request task did not panic");
        if let Ok(response) = outcome {
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        }
    }
}

#[tokio::test]
async fn duplicate_machine_ids_are_rejected_at_start() {
    let fleet = SimFleet::new(TOKEN)
        .app(SimApp::new("a").machine(SimMachine::new("m1")))
        .app(SimApp::new("b").machine(SimMachine::new("m1")));
    let err = within(Sim::start(fleet)).await.expect_err("duplicate ids");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

#[tokio::test]
async fn urls_point_at_the_loopback_server() {
    let h = Harness::start(fleet()).await;
    let addr = h.sim.addr();
    assert!(addr.ip().is_loopback());
    assert_eq!(h.sim.api_url(), format!("http://{addr}"));
    assert_eq!(
        h.sim.health_url_template(),
        format!("http://{addr}/agents/{{machine_id}}/health")
    );
    let url = h.sim.health_url_template().replace("{machine_id}", "m2");
    assert_eq!(reply(h.http.get(url)).await.status, StatusCode::OK);
    assert_eq!(h.sim.machine_ids(APP), vec!["m1", "m2", "m3"]);
    let not_found = reply(h.http.get(format!("{}/nothing", h.sim.api_url()))).await;
    assert_eq!(not_found.status, StatusCode::NOT_FOUND);
}

// ---------------------------------------------------------------------------
// Chaos faults, operator writes, the safety audit, a coordination machine.
// ---------------------------------------------------------------------------

const HOLD: &str = "fleet_reconciler_hold";
const MARKER: &str = "fleet_reconciler_rotation";

/// What a client saw of one request: a status, or no answer before its timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    Status(u16, Option<u64>),
    TimedOut,
}

async fn seen(request: reqwest::RequestBuilder) -> Seen {
    match within(request.send()).await {
        Ok(response) => {
            let retry_after = response
                .headers()
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            Seen::Status(response.status().as_u16(), retry_after)
        }
        Err(e) if e.is_timeout() => Seen::TimedOut,
        Err(e) => panic!("request failed: {e}"),
    }
}

#[tokio::test]
async fn chaos_injects_every_kind_and_lost_answers_still_take_effect() {
    // One cordon per machine, all at once, every one faulted: each machine
    // tells what its own request's fault did. Every machine is on hold, so
    // the audit must see exactly the cordons that took effect.
    let ids: Vec<String> = (0..90).map(|i| format!("c{i:02}")).collect();
    let fleet = SimFleet::new(TOKEN).app(
        SimApp::new(APP).machines(
            ids.iter()
                .map(|id| SimMachine::new(id.as_str()).metadata(HOLD, "incident-7")),
        ),
    );
    let h = Harness::start(fleet).await;
    h.sim.enable_audit(AuditConfig::new("pool"));
    h.sim.set_chaos(Some(
        Chaos::new(7, 1.0)
            .retry_after_secs(9)
            .hang(Duration::from_secs(10)),
    ));

    // Agents and unauthenticated requests are not subject to chaos.
    assert_eq!(h.health("c00").await.status, StatusCode::OK);
    let anonymous = reply(h.http.get(h.machines_url(APP, "/c00"))).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(h.sim.chaos_stats().eligible, 0);

    // Far above a loaded runner's latency, far below the hang.
    let client_timeout = Duration::from_millis(1500);
    let outcomes = futures::future::join_all(ids.iter().map(|id| {
        let request = h
            .http
            .post(h.machines_url(APP, &format!("/{id}/cordon")))
            .bearer_auth(TOKEN)
            .timeout(client_timeout);
        async move { (id.clone(), seen(request).await) }
    }))
    .await;
    let outcomes: BTreeMap<String, Seen> = outcomes.into_iter().collect();
    h.sim.set_chaos(None);

    let stats = h.sim.chaos_stats();
    assert_eq!(stats.eligible, 90);
    assert_eq!(stats.injected(), 90, "rate 1.0 faults every request");
    for kind in ChaosFault::ALL {
        assert!(stats.count(kind) > 0, "no {kind:?} injected: {stats:?}");
    }

    let events = h.sim.chaos_events();
    assert_eq!(events.len(), 90);
    let mut took_effect = BTreeSet::new();
    for event in &events {
        let id = event.machine_id.clone().expect("a machine route");
        let cordoned = h.sim.machine(&id).expect("machine").cordoned;
        let outcome = outcomes[&id];
        let expected = match event.fault {
            ChaosFault::TooManyRequests => Seen::Status(429, Some(9)),
            ChaosFault::ServerError | ChaosFault::LostAfter => Seen::Status(500, None),
            ChaosFault::Unavailable => Seen::Status(503, None),
            ChaosFault::HangBefore | ChaosFault::HangAfter => Seen::TimedOut,
            ChaosFault::TimedOutAfter => Seen::Status(408, None),
        };
        assert_eq!(outcome, expected, "{id}: {:?}", event.fault);
        assert_eq!(
            cordoned,
            event.fault.takes_effect(),
            "{id}: {:?} and cordoned={cordoned}",
            event.fault
        );
        if event.fault.takes_effect() {
            assert_eq!(event.effect_status, Some(200), "{id}");
            took_effect.insert(id);
        } else {
            assert_eq!(event.effect_status, None, "{id}");
        }
    }
    let lost: Vec<&ChaosEvent> = events
        .iter()
        .filter(|e| e.fault == ChaosFault::LostAfter)
        .collect();
    assert!(!lost.is_empty());

    // The audit counts a cordon that answered 500 (or timed out) but took effect.
    let held: BTreeSet<String> = h
        .sim
        .audit()
        .held_actions
        .iter()
        .map(|a| {
            assert_eq!(a.what, "POST cordon");
            a.machine_id.clone()
        })
        .collect();
    assert_eq!(held, took_effect);

    // With chaos off, requests are served again.
    assert_eq!(h.get("/c00").await.status, StatusCode::OK);
    assert_eq!(h.sim.chaos_stats().eligible, 90);
}

/// Runs the same sequence of requests, one at a time, under `chaos`, and
/// returns what the clients saw and which faults were injected.
async fn chaos_run(chaos: Chaos) -> (Vec<Seen>, Vec<ChaosEvent>, Vec<bool>) {
    let h = Harness::start(fleet()).await;
    h.sim.set_chaos(Some(chaos));
    let mut seen_by_client = Vec::new();
    for i in 0..40 {
        let (method, path) = match i % 4 {
            0 => (Method::GET, "/m1"),
            1 => (Method::POST, "/m2/cordon"),
            2 => (Method::POST, "/m2/uncordon"),
            _ => (Method::GET, ""),
        };
        let request = h
            .http
            .request(method, h.machines_url(APP, path))
            .bearer_auth(TOKEN);
        seen_by_client.push(seen(request).await);
    }
    let cordoned = ["m1", "m2", "m3"]
        .iter()
        .map(|id| h.sim.machine(id).expect("machine").cordoned)
        .collect();
    (seen_by_client, h.sim.chaos_events(), cordoned)
}

#[tokio::test]
async fn chaos_is_deterministic_for_a_seed() {
    // A short hang: the client waits it out and sees the 503.
    let chaos = |seed| {
        Chaos::new(seed, 0.5)
            .retry_after_secs(3)
            .hang(Duration::from_millis(20))
    };
    let first = chaos_run(chaos(42)).await;
    let second = chaos_run(chaos(42)).await;
    assert!(
        !first.1.is_empty(),
        "rate 0.5 over 40 requests injects something"
    );
    assert!(first.1.len() < 40, "and lets something through");
    assert_eq!(first, second, "same seed, same requests: same faults");

    let other = chaos_run(chaos(43)).await;
    assert_ne!(first.1, other.1, "another seed draws other faults");
}

#[tokio::test]
async fn a_hanging_fault_ends_promptly_on_shutdown() {
    // Twelve GETs of one machine at once: past get-machine's burst of 10,
    // and every one must draw from the chaos RNG.
    let h = Harness::start(fleet().unlimited()).await;
    h.sim
        .set_chaos(Some(Chaos::new(1, 1.0).hang(Duration::from_secs(600))));
    let tasks: Vec<_> = (0..12)
        .map(|_| {
            tokio::spawn(
                h.http
                    .get(h.machines_url(APP, "/m1"))
                    .bearer_auth(TOKEN)
                    .send(),
            )
        })
        .collect();
    within(async {
        loop {
            let stats = h.sim.chaos_stats();
            if stats.eligible == 12 {
                break stats;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let stats = h.sim.chaos_stats();
    assert!(
        stats.hang_before + stats.hang_after > 0,
        "twelve draws include a hang: {stats:?}"
    );
    let Harness { sim, http: _http } = h;
    let started = tokio::time::Instant::now();
    within(sim.shutdown()).await;
    for task in tasks {
        let outcome = within(task).await.expect("request task did not panic");
        if let Ok(response) = outcome {
            assert_ne!(response.status(), StatusCode::OK);
        }
    }
    assert!(
        // The hangs last 600 s.
        started.elapsed() < Duration::from_secs(20),
        "hangs end on shutdown"
    );
}

#[tokio::test]
async fn operator_writes_wait_for_the_lease_when_metadata_is_fenced() {
    let h = Harness::start(fleet().metadata_fencing(MetadataFencing::FencedByLease)).await;
    let acquired = h.post("/m1/lease", None, Some(json!({"ttl": 30}))).await;
    assert_eq!(acquired.status, StatusCode::CREATED);
    let nonce = acquired.body["data"]["nonce"]
        .as_str()
        .expect("nonce")
        .to_string();
    let v0 = h.sim.machine("m1").expect("m1").instance_id;

    let refused = h.sim.operator_set_metadata("m1", HOLD, "incident-9");
    match refused {
        Err(OperatorWriteRefused::Leased {
            ref machine_id,
            ref owner,
            ..
        }) => {
            assert_eq!(machine_id, "m1");
            assert_eq!(owner, DEFAULT_LEASE_OWNER);
        }
        other => panic!("expected a lease refusal, got {other:?}"),
    }
    assert!(refused.is_err_and(|e| e.to_string().contains("lease currently held by")));
    assert_eq!(
        h.sim.operator_delete_metadata("m1", "pool"),
        Err(OperatorWriteRefused::Leased {
            machine_id: "m1".to_string(),
            owner: DEFAULT_LEASE_OWNER.to_string(),
            expires_at: h
                .sim
                .machine("m1")
                .and_then(|m| m.lease)
                .expect("lease")
                .expires_at,
        })
    );
    let m1 = h.sim.machine("m1").expect("m1");
    assert!(
        !m1.metadata.contains_key(HOLD),
        "a refused write writes nothing"
    );
    assert_eq!(
        m1.metadata.get("pool").map(String::as_str),
        Some("dispatch")
    );
    assert_eq!(m1.instance_id, v0);

    // The out-of-band writes still ignore leases.
    assert!(h.sim.set_metadata("m1", "note", "x"));
    assert!(h.sim.delete_metadata("m1", "note"));
    assert!(
        !h.sim
            .machine("m1")
            .expect("m1")
            .metadata
            .contains_key("note")
    );
    assert!(!h.sim.delete_metadata("nope", "note"));

    // Once the daemon releases, the operator's retry goes through.
    let released = h.fly(Method::DELETE, "/m1/lease", Some(&nonce), None).await;
    assert_eq!(released.status, StatusCode::OK);
    let before = h.sim.machine("m1").expect("m1").instance_id;
    assert_eq!(
        h.sim.operator_set_metadata("m1", HOLD, "incident-9"),
        Ok(())
    );
    let m1 = h.sim.machine("m1").expect("m1");
    assert_eq!(
        m1.metadata.get(HOLD).map(String::as_str),
        Some("incident-9")
    );
    assert_eq!(
        m1.instance_id, before,
        "a metadata write creates no machine version"
    );
    assert_eq!(h.sim.operator_delete_metadata("m1", HOLD), Ok(()));
    assert!(!h.sim.machine("m1").expect("m1").metadata.contains_key(HOLD));

    // An expired lease counts as absent, as for API calls.
    h.sim
        .acquire_lease_as("m2", "other@example.com", Duration::from_secs(5))
        .expect("m2 exists");
    assert!(h.sim.operator_set_metadata("m2", HOLD, "x").is_err());
    h.sim.advance_clock(Duration::from_secs(6));
    assert_eq!(h.sim.operator_set_metadata("m2", HOLD, "x"), Ok(()));

    assert_eq!(
        h.sim.operator_set_metadata("nope", HOLD, "x"),
        Err(OperatorWriteRefused::UnknownMachine {
            machine_id: "nope".to_string()
        })
    );
}

fn pool_fleet() -> SimFleet {
    SimFleet::new(TOKEN)
        .restart_delay(Duration::from_millis(100))
        .app(
            SimApp::new(APP)
                .machine(
                    SimMachine::new("d1")
                        .metadata("pool", "dispatch")
                        .cooperative(),
                )
                .machine(
                    SimMachine::new("d2")
                        .metadata("pool", "dispatch")
                        .cooperative(),
                )
                .machine(SimMachine::new("x1")),
        )
}

fn dispatch() -> (String, String) {
    (APP.to_string(), "dispatch".to_string())
}

#[tokio::test]
async fn audit_detects_two_machines_out_of_a_cap_one_pool() {
    let h = Harness::start(pool_fleet()).await;
    assert!(!h.sim.audit().enabled);
    h.sim
        .enable_audit(AuditConfig::new("pool").cap(APP, "dispatch", 1));
    let start = h.sim.audit();
    assert!(start.enabled);
    assert_eq!(start.max_out.get(&dispatch()), Some(&0));
    assert_eq!(
        start.max_out.get(&(APP.to_string(), "default".to_string())),
        Some(&0)
    );

    assert_eq!(
        h.post("/d1/cordon", None, None).await.status,
        StatusCode::OK
    );
    let one = h.sim.audit();
    assert!(one.cap_breaches.is_empty(), "one out is within the cap");
    assert_eq!(one.max_out[&dispatch()], 1);
    assert_eq!(one.out_now[&dispatch()], vec!["d1"]);

    assert_eq!(
        h.post("/d2/cordon", None, None).await.status,
        StatusCode::OK
    );
    let two = h.sim.audit();
    assert_eq!(two.cap_breaches.len(), 1, "{:?}", two.cap_breaches);
    let breach = &two.cap_breaches[0];
    assert_eq!(
        (breach.app.as_str(), breach.pool.as_str()),
        (APP, "dispatch")
    );
    assert_eq!(breach.out, vec!["d1", "d2"]);
    assert_eq!(breach.cap, 1);
    assert_eq!(two.max_out[&dispatch()], 2);

    for id in ["d1", "d2"] {
        let path = format!("/{id}/uncordon");
        assert_eq!(h.post(&path, None, None).await.status, StatusCode::OK);
    }
    assert!(h.sim.audit().out_now.is_empty());

    // A fence and a restart in flight count as out too; the restart's
    // machine is back once it is started.
    let drained = h
        .agent_post("d1", "overlay/drain", None, json!({"rotation": "r1"}))
        .await;
    assert_eq!(drained.status, StatusCode::OK);
    assert_eq!(
        h.post("/d2/restart", None, None).await.status,
        StatusCode::OK
    );
    let during = h.sim.audit();
    assert_eq!(during.cap_breaches.len(), 2);
    assert_eq!(during.cap_breaches[1].out, vec!["d1", "d2"]);
    assert_eq!(h.wait_for("d2", "started", 5).await.status, StatusCode::OK);
    assert_eq!(h.sim.audit().out_now[&dispatch()], vec!["d1"]);
    let undrained = h
        .agent_post("d1", "overlay/undrain", None, json!({"rotation": "r1"}))
        .await;
    assert_eq!(undrained.status, StatusCode::OK);
    let end = h.sim.audit();
    assert!(end.out_now.is_empty());
    assert_eq!(end.cap_breaches.len(), 2);
    assert_eq!(end.max_out[&(APP.to_string(), "default".to_string())], 0);
    assert!(
        h.sim
            .machines()
            .iter()
            .all(|m| !m.cordoned && m.fence.is_none())
    );

    // A machine moved into the pool out of band brings its cordon with it.
    assert_eq!(
        h.post("/x1/cordon", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.post("/d1/cordon", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(h.sim.audit().cap_breaches.len(), 2);
    assert!(h.sim.set_metadata("x1", "pool", "dispatch"));
    let moved = h.sim.audit();
    assert_eq!(moved.cap_breaches.len(), 3);
    assert_eq!(moved.cap_breaches[2].out, vec!["d1", "x1"]);
    assert!(
        !moved
            .out_now
            .contains_key(&(APP.to_string(), "default".to_string()))
    );
}

#[tokio::test]
async fn audit_records_restarts_with_the_agent_state_at_that_instant() {
    let fleet = SimFleet::new(TOKEN)
        .restart_delay(Duration::from_millis(100))
        .app(
            SimApp::new(APP)
                .machine(
                    SimMachine::new("busy")
                        .cooperative()
                        .behaviour(Behaviour::BusyFor(Duration::from_secs(600))),
                )
                .machine(SimMachine::new("chatty").live_sessions(2))
                .machine(
                    SimMachine::new("ready")
                        .cooperative()
                        .live_sessions(2)
                        .metadata("pool", "dispatch")
                        .metadata(MARKER, r#"{"target":"abc"}"#),
                ),
        );
    let h = Harness::start(fleet).await;
    h.sim.enable_audit(AuditConfig::new("pool"));

    assert_eq!(
        h.post("/busy/restart", None, None).await.status,
        StatusCode::OK
    );
    // Refused (not started): not a restart.
    assert_eq!(
        h.post("/busy/restart", None, None).await.status,
        StatusCode::PRECONDITION_FAILED
    );
    assert_eq!(
        h.post("/chatty/stop", None, None).await.status,
        StatusCode::OK
    );

    let drained = h
        .agent_post("ready", "overlay/drain", None, json!({"rotation": "r9"}))
        .await;
    assert_eq!(drained.status, StatusCode::OK);
    let lease = h.post("/ready/lease", None, Some(json!({"ttl": 30}))).await;
    let nonce = lease.body["data"]["nonce"]
        .as_str()
        .expect("nonce")
        .to_string();
    assert_eq!(
        h.post("/ready/restart", Some(&nonce), None).await.status,
        StatusCode::OK
    );

    let report = h.sim.audit();
    assert_eq!(report.restarts.len(), 3, "{:?}", report.restarts);
    let busy = &report.restarts[0];
    assert_eq!(busy.machine_id, "busy");
    assert_eq!(busy.action, "restart");
    assert!(busy.busy, "a restart of a busy agent is recorded as busy");
    assert!(!busy.fenced);
    assert_eq!(busy.checkpoint, None);
    assert_eq!(busy.pool, "default");
    assert_eq!(busy.lease_owner, None);

    let chatty = &report.restarts[1];
    assert_eq!(
        (chatty.machine_id.as_str(), chatty.action.as_str()),
        ("chatty", "stop")
    );
    assert!(chatty.busy, "open sessions are live work");

    let ready = &report.restarts[2];
    assert_eq!(ready.machine_id, "ready");
    assert!(!ready.busy, "a checkpointed agent has nothing to lose");
    assert!(ready.fenced);
    assert_eq!(ready.checkpoint.as_deref(), Some("r9"));
    assert_eq!(ready.pool, "dispatch");
    assert_eq!(ready.marker.as_deref(), Some(r#"{"target":"abc"}"#));
    assert_eq!(ready.lease_owner.as_deref(), Some(DEFAULT_LEASE_OWNER));
    assert!(!ready.held);
    let request = h
        .sim
        .requests()
        .into_iter()
        .find(|r| r.seq == ready.seq)
        .expect("the restart request is in the log");
    assert_eq!(request.path, "/v1/apps/agents/machines/ready/restart");
    assert_eq!(report.marked_now, vec!["ready"]);
}

#[tokio::test]
async fn audit_records_actions_that_took_effect_on_held_machines() {
    let fleet = SimFleet::new(TOKEN).app(
        SimApp::new(APP)
            .machine(
                SimMachine::new("held")
                    .cooperative()
                    .metadata(HOLD, "incident-3"),
            )
            .machine(SimMachine::new("free")),
    );
    let h = Harness::start(fleet).await;
    h.sim.enable_audit(AuditConfig::new("pool"));

    // Reads, lease calls, refused and failed requests are not actions.
    assert_eq!(h.get("/held").await.status, StatusCode::OK);
    assert_eq!(h.get("/held/metadata").await.status, StatusCode::OK);
    let lease = h.post("/held/lease", None, Some(json!({"ttl": 30}))).await;
    let nonce = lease.body["data"]["nonce"]
        .as_str()
        .expect("nonce")
        .to_string();
    assert_eq!(
        h.post("/held/cordon", None, None).await.status,
        StatusCode::CONFLICT,
        "no nonce"
    );
    h.sim.fail_next(1, 500, None);
    assert_eq!(
        h.post("/held/cordon", Some(&nonce), None).await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    let released = h
        .fly(Method::DELETE, "/held/lease", Some(&nonce), None)
        .await;
    assert_eq!(released.status, StatusCode::OK);
    // Operator writes are not requests.
    assert_eq!(h.sim.operator_set_metadata("held", "note", "x"), Ok(()));
    assert!(h.sim.audit().held_actions.is_empty());

    assert_eq!(
        h.post("/held/cordon", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.post("/free/cordon", None, None).await.status,
        StatusCode::OK
    );
    let drained = h
        .agent_post("held", "overlay/drain", None, json!({"rotation": "r1"}))
        .await;
    assert_eq!(drained.status, StatusCode::OK);
    // Clearing the hold is itself an action on a held machine.
    let cleared = h
        .fly(
            Method::DELETE,
            &format!("/held/metadata/{HOLD}"),
            None,
            None,
        )
        .await;
    assert_eq!(cleared.status, StatusCode::NO_CONTENT);
    assert_eq!(
        h.post("/held/uncordon", None, None).await.status,
        StatusCode::OK
    );

    let actions = h.sim.audit().held_actions;
    let what: Vec<(&str, &str)> = actions
        .iter()
        .map(|a| (a.machine_id.as_str(), a.what.as_str()))
        .collect();
    assert_eq!(
        what,
        vec![
            ("held", "POST cordon"),
            ("held", "POST overlay/drain"),
            ("held", "DELETE metadata"),
        ]
    );
    let log = h.sim.requests();
    let cordon = log
        .iter()
        .find(|r| r.seq == actions[0].seq)
        .expect("logged");
    assert_eq!(cordon.status, Some(200));
    assert_eq!(cordon.action.as_deref(), Some("cordon"));
}

#[tokio::test]
async fn a_stopped_coordination_machine_takes_leases_and_metadata_writes() {
    const COORD: &str = "fleet-coord";
    // The 409s below are the old, idealized fencing of metadata writes; on
    // Fly they are accepted (`metadata_writes_are_not_fenced_by_leases`).
    let fleet = fleet()
        .metadata_fencing(MetadataFencing::FencedByLease)
        .app(SimApp::new(COORD).machine(SimMachine::new("coord").stopped()));
    let h = Harness::start(fleet).await;

    let acquired = h
        .fly_in(
            COORD,
            Method::POST,
            "/coord/lease",
            None,
            Some(json!({"ttl": 10})),
        )
        .await;
    assert_eq!(acquired.status, StatusCode::CREATED);
    let nonce = acquired.body["data"]["nonce"]
        .as_str()
        .expect("nonce")
        .to_string();
    let refreshed = h
        .fly_in(
            COORD,
            Method::POST,
            "/coord/lease",
            Some(nonce.as_str()),
            Some(json!({"ttl": 30})),
        )
        .await;
    assert_eq!(refreshed.status, StatusCode::CREATED);
    assert_eq!(refreshed.body["data"]["nonce"], nonce.as_str());
    let shown = h
        .fly_in(COORD, Method::GET, "/coord/lease", None, None)
        .await;
    assert_eq!(shown.status, StatusCode::OK);

    let slot = "/coord/metadata/fleet_reconciler_slot_0";
    let value = json!({"value": "d1@rot-1"});
    let without = h
        .fly_in(COORD, Method::POST, slot, None, Some(value.clone()))
        .await;
    assert_eq!(without.status, StatusCode::CONFLICT);
    assert!(error_text(&without).contains("lease currently held by"));
    let wrong = h
        .fly_in(
            COORD,
            Method::POST,
            slot,
            Some("not-the-nonce"),
            Some(value.clone()),
        )
        .await;
    assert_eq!(wrong.status, StatusCode::CONFLICT);
    let written = h
        .fly_in(COORD, Method::POST, slot, Some(nonce.as_str()), Some(value))
        .await;
    assert_eq!(written.status, StatusCode::NO_CONTENT);

    // Reads need no nonce.
    let read = h.fly_in(COORD, Method::GET, slot, None, None).await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(read.body, json!({"value": "d1@rot-1"}));
    let all = h
        .fly_in(COORD, Method::GET, "/coord/metadata", None, None)
        .await;
    assert_eq!(all.body["fleet_reconciler_slot_0"], "d1@rot-1");

    // Compare-and-set on the machine version works on a stopped machine too.
    let version = h.sim.machine("coord").expect("coord").instance_id;
    let cas = h.fly_in(COORD,
        Method::PATCH,
        "/coord/metadata",
        Some(nonce.as_str()),
        Some(json!({"metadata": {"fleet_reconciler_slot_1": "d2@rot-1"}, "machine_version": version})),
    )
    .await;
    assert_eq!(cas.status, StatusCode::NO_CONTENT);
    // The write created no machine version: the same version still matches
    // (no compare-and-set on metadata, as on Fly).
    let again = h
        .fly_in(
            COORD,
            Method::PATCH,
            "/coord/metadata",
            Some(nonce.as_str()),
            Some(json!({"metadata": {"fleet_reconciler_slot_1": "x"}, "machine_version": version})),
        )
        .await;
    assert_eq!(again.status, StatusCode::NO_CONTENT);

    assert_eq!(
        h.fly_in(COORD, Method::DELETE, slot, None, None)
            .await
            .status,
        StatusCode::CONFLICT
    );
    assert_eq!(
        h.fly_in(COORD, Method::DELETE, slot, Some(nonce.as_str()), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        h.fly_in(COORD, Method::GET, slot, None, None).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        h.fly_in(COORD, Method::DELETE, "/coord/lease", None, None)
            .await
            .status,
        StatusCode::CONFLICT
    );
    assert_eq!(
        h.fly_in(
            COORD,
            Method::DELETE,
            "/coord/lease",
            Some(nonce.as_str()),
            None
        )
        .await
        .status,
        StatusCode::OK
    );

    let coord = h.sim.machine("coord").expect("coord");
    assert_eq!(coord.state, "stopped", "none of this starts the machine");
    assert!(coord.lease.is_none());
    assert_eq!(
        coord
            .metadata
            .get("fleet_reconciler_slot_1")
            .map(String::as_str),
        Some("x")
    );
    // The coordination app is listed on its own.
    assert_eq!(h.sim.machine_ids(COORD), vec!["coord"]);
    assert_eq!(
        h.fly_in(COORD, Method::GET, "", None, None)
            .await
            .body
            .as_array()
            .map(Vec::len),
        Some(1)
    );
}

// ---- #19: the sim models Fly as it is (FLY-REALITY.md) ----

#[tokio::test]
async fn metadata_writes_are_not_fenced_by_leases() {
    const COORD: &str = "fleet-coord";
    let fleet = fleet().app(SimApp::new(COORD).machine(SimMachine::new("coord").stopped()));
    let h = Harness::start(fleet).await;
    let nonce = h
        .sim
        .acquire_lease_as("m1", "operator@example.com", Duration::from_secs(60))
        .expect("m1 exists");

    // fly-go's SetMetadata sends no nonce, and a stale one is no better: accepted.
    let hold = json!({"value": "ops: incident"});
    let no_nonce = h
        .post(&format!("/m1/metadata/{HOLD}"), None, Some(hold.clone()))
        .await;
    assert_eq!(no_nonce.status, StatusCode::NO_CONTENT);
    let stale = h
        .post(
            "/m1/metadata/note",
            Some("a-stale-nonce"),
            Some(json!({"value": "x"})),
        )
        .await;
    assert_eq!(stale.status, StatusCode::NO_CONTENT);
    let patched = h
        .fly(
            Method::PATCH,
            "/m1/metadata",
            None,
            Some(json!({"metadata": {"a": "b"}})),
        )
        .await;
    assert_eq!(patched.status, StatusCode::NO_CONTENT);
    let deleted = h.fly(Method::DELETE, "/m1/metadata/pool", None, None).await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT);
    let m1 = h.sim.machine("m1").expect("m1");
    assert_eq!(
        m1.metadata.get(HOLD).map(String::as_str),
        Some("ops: incident")
    );
    assert_eq!(m1.metadata.get("a").map(String::as_str), Some("b"));
    assert!(!m1.metadata.contains_key("pool"));
    assert_eq!(
        m1.lease.as_ref().map(|l| l.nonce.as_str()),
        Some(nonce.as_str())
    );

    // Every other mutating call stays fenced.
    for path in ["/m1/cordon", "/m1/restart", "/m1/stop"] {
        let refused = h.post(path, None, None).await;
        assert_eq!(refused.status, StatusCode::CONFLICT, "{path}");
    }
    let refresh = h.post("/m1/lease", Some("a-stale-nonce"), None).await;
    assert_eq!(refresh.status, StatusCode::CONFLICT);

    // An operator's `fly machine update --metadata` lands at any instant.
    assert_eq!(h.sim.operator_set_metadata("m1", "note", "y"), Ok(()));
    assert_eq!(h.sim.operator_delete_metadata("m1", HOLD), Ok(()));
    assert!(!h.sim.machine("m1").expect("m1").metadata.contains_key(HOLD));

    // So do writes onto a leased, stopped coordinator.
    let coord_nonce = h
        .sim
        .acquire_lease_as("coord", DEFAULT_LEASE_OWNER, Duration::from_secs(60))
        .expect("coord exists");
    let slot = h
        .fly_in(
            COORD,
            Method::POST,
            "/coord/metadata/fleet_reconciler_slot_0",
            None,
            Some(json!({"value": "intruder@rot-9"})),
        )
        .await;
    assert_eq!(slot.status, StatusCode::NO_CONTENT);
    let coord = h.sim.machine("coord").expect("coord");
    assert_eq!(
        coord
            .metadata
            .get("fleet_reconciler_slot_0")
            .map(String::as_str),
        Some("intruder@rot-9")
    );
    assert_eq!(coord.lease.map(|l| l.nonce), Some(coord_nonce));

    // The old fencing is a switch.
    h.sim.set_metadata_fencing(MetadataFencing::FencedByLease);
    let fenced = h
        .post("/m1/metadata/note", None, Some(json!({"value": "z"})))
        .await;
    assert_eq!(fenced.status, StatusCode::CONFLICT);
    assert!(h.sim.operator_set_metadata("m1", "note", "z").is_err());
    assert_eq!(
        h.sim
            .machine("m1")
            .expect("m1")
            .metadata
            .get("note")
            .map(String::as_str),
        Some("y")
    );
}

#[tokio::test]
async fn hooks_run_at_an_exact_point_of_a_call() {
    let h = Harness::start(fleet()).await;
    h.sim.enable_audit(AuditConfig::default());

    // Before: work starts just before the restart is served.
    let restarts_seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let seen_restarts = std::sync::Arc::clone(&restarts_seen);
    h.sim.before_next_call("m1", "POST", "restart", move |sim| {
        // Not served yet: no restart counted.
        *seen_restarts.lock().expect("lock") = sim.machine("m1").map(|m| m.restart_count);
        sim.set_live_sessions("m1", 2);
    });
    // A call on another machine or of another kind does not fire it.
    assert_eq!(
        h.post("/m2/restart", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.post("/m1/cordon", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(h.sim.pending_hooks(), 1);
    // A call refused at the front door does not reach its handler: no hook.
    h.sim.fail_next(1, 503, None);
    assert_eq!(
        h.post("/m1/restart", None, None).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(h.sim.pending_hooks(), 1);
    assert_eq!(
        h.post("/m1/restart", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(h.sim.pending_hooks(), 0);
    let audit = h.sim.audit();
    let m1_restart = audit
        .restarts
        .iter()
        .find(|r| r.machine_id == "m1")
        .expect("m1's restart is audited");
    assert!(
        m1_restart.busy,
        "the hook's sessions were there when it landed"
    );

    // After: the handler took effect, the answer is not sent yet.
    let saw = std::sync::Arc::new(std::sync::Mutex::new(None));
    let seen = std::sync::Arc::clone(&saw);
    h.sim.after_next_call("m2", "POST", "cordon", move |sim| {
        let cordoned = sim.machine("m2").map(|m| m.cordoned);
        // The answer is not sent yet: the log has no status for the call.
        let answered = sim
            .requests()
            .iter()
            .rev()
            .find(|r| r.action.as_deref() == Some("cordon"))
            .map(|r| r.status);
        *seen.lock().expect("lock") = cordoned.zip(answered);
        sim.set_metadata("m2", HOLD, "written mid-call");
    });
    let cordoned = h.post("/m2/cordon", None, None).await;
    assert_eq!(cordoned.status, StatusCode::OK);
    assert_eq!(*saw.lock().expect("lock"), Some((true, None)));
    let m2 = h.sim.machine("m2").expect("m2");
    assert_eq!(
        m2.metadata.get(HOLD).map(String::as_str),
        Some("written mid-call")
    );
}

#[tokio::test]
async fn rate_limits_are_fly_documented_ones_by_default() {
    let h = Harness::start(fleet()).await;
    // Actions: 1/s per action per machine, burst 3; the 429 has no Retry-After.
    for _ in 0..3 {
        assert_eq!(
            h.post("/m1/cordon", None, None).await.status,
            StatusCode::OK
        );
    }
    let limited = h.post("/m1/cordon", None, None).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(limited.headers.get(header::RETRY_AFTER).is_none());
    assert_eq!(
        h.post("/m1/uncordon", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.post("/m2/cordon", None, None).await.status,
        StatusCode::OK
    );

    // Get-machine: 5/s, burst 10.
    for _ in 0..10 {
        assert_eq!(h.get("/m2").await.status, StatusCode::OK);
    }
    assert_eq!(h.get("/m2").await.status, StatusCode::TOO_MANY_REQUESTS);
    // Listing: 1/s per app, burst 3 (#32 item 13 g; it was unlimited).
    for _ in 0..3 {
        assert_eq!(h.get("").await.status, StatusCode::OK);
    }
    assert_eq!(h.get("").await.status, StatusCode::TOO_MANY_REQUESTS);

    // Lease calls are actions: acquire and refresh share one bucket.
    let acquired = h.post("/m3/lease", None, None).await;
    assert_eq!(acquired.status, StatusCode::CREATED);
    let nonce = acquired.body["data"]["nonce"]
        .as_str()
        .expect("nonce")
        .to_string();
    for _ in 0..2 {
        let refreshed = h.post("/m3/lease", Some(&nonce), None).await;
        assert_eq!(refreshed.status, StatusCode::CREATED);
    }
    let throttled = h.post("/m3/lease", Some(&nonce), None).await;
    assert_eq!(throttled.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        h.fly(Method::DELETE, "/m3/lease", Some(&nonce), None)
            .await
            .status,
        StatusCode::OK
    );

    // The bucket refills at one a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        h.post("/m1/cordon", None, None).await.status,
        StatusCode::OK
    );

    // Mixed: every other 429 carries Retry-After.
    h.sim
        .set_rate_limits(Some(RateLimits::fly().retry_after(RetryAfter::Mixed)));
    for _ in 0..3 {
        assert_eq!(
            h.post("/m2/uncordon", None, None).await.status,
            StatusCode::OK
        );
    }
    let headers: Vec<bool> = {
        let mut seen = Vec::new();
        for _ in 0..4 {
            let r = h.post("/m2/uncordon", None, None).await;
            assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
            seen.push(r.headers.get(header::RETRY_AFTER).is_some());
        }
        seen
    };
    assert_eq!(headers, vec![false, true, false, true]);

    // A 429 storm: every bucket of the machine, used or not, is empty at once.
    h.sim.set_rate_limits(Some(RateLimits::fly()));
    h.sim.exhaust_rate_limits("m2");
    assert_eq!(
        h.post("/m2/stop", None, None).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(h.get("/m2").await.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn a_down_host_hides_the_config_and_refuses_calls() {
    const COORD: &str = "fleet-coord";
    let fleet = fleet().app(
        SimApp::new(COORD).machine(
            SimMachine::new("coord")
                .stopped()
                .metadata("fleet_reconciler_slot_0", "m1@rot-1"),
        ),
    );
    let h = Harness::start(fleet).await;
    assert!(h.sim.set_host_status("m1", HostStatus::Unreachable));
    assert!(h.sim.set_host_status("coord", HostStatus::Unknown));
    assert!(!h.sim.set_host_status("nope", HostStatus::Unreachable));

    let m1 = h.get("/m1").await;
    assert_eq!(m1.status, StatusCode::OK);
    assert_eq!(m1.body["host_status"], "unreachable");
    assert_eq!(
        m1.body["state"], "started",
        "Fly shows the last state it knew"
    );
    assert!(m1.body.get("config").is_none(), "{}", m1.body);
    assert!(m1.body["incomplete_config"].is_object());
    assert!(m1.body["incomplete_config"].get("metadata").is_none());
    let listed = h.get("").await;
    let row = listed.body.as_array().expect("list")[0].clone();
    assert_eq!(row["id"], "m1");
    assert!(row.get("config").is_none());

    // The coordinator too: its slots are invisible.
    let coord = h.fly_in(COORD, Method::GET, "/coord", None, None).await;
    assert_eq!(coord.body["host_status"], "unknown");
    assert!(coord.body.get("config").is_none());

    // Agent unreachable; metadata reads, leases and mutations answer 503 without effect.
    assert_eq!(h.health("m1").await.status, StatusCode::SERVICE_UNAVAILABLE);
    for (method, path) in [
        (Method::GET, "/m1/metadata"),
        (Method::POST, "/m1/lease"),
        (Method::POST, "/m1/cordon"),
        (Method::POST, "/m1/restart"),
    ] {
        let r = h.fly(method.clone(), path, None, None).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{method} {path}");
    }
    let write = h
        .fly_in(
            COORD,
            Method::POST,
            "/coord/metadata/fleet_reconciler_slot_1",
            None,
            Some(json!({"value": "x"})),
        )
        .await;
    assert_eq!(write.status, StatusCode::SERVICE_UNAVAILABLE);
    let m1 = h.sim.machine("m1").expect("m1");
    assert!(!m1.cordoned && m1.lease.is_none() && m1.restart_count == 0);
    assert_eq!(m1.host_status, HostStatus::Unreachable);

    // Partial: only Fly's own keys show.
    h.sim.set_host_down_metadata(HostDownMetadata::Partial);
    let coord = h.fly_in(COORD, Method::GET, "/coord", None, None).await;
    let shown = &coord.body["incomplete_config"]["metadata"];
    assert_eq!(shown["fly_platform_version"], "v2");
    assert!(shown.get("fleet_reconciler_slot_0").is_none(), "{shown}");

    // Back up: everything is there again.
    assert!(h.sim.set_host_status("coord", HostStatus::Ok));
    assert!(h.sim.set_host_status("m1", HostStatus::Ok));
    let coord = h.fly_in(COORD, Method::GET, "/coord", None, None).await;
    assert_eq!(coord.body["host_status"], "ok");
    assert_eq!(
        coord.body["config"]["metadata"]["fleet_reconciler_slot_0"],
        "m1@rot-1"
    );
    assert!(coord.body.get("incomplete_config").is_none());
    assert_eq!(h.health("m1").await.status, StatusCode::OK);
}

#[tokio::test]
async fn cordoned_is_shown_survives_a_restart_and_not_an_update() {
    let h = Harness::start(fleet()).await;
    assert_eq!(h.get("/m1").await.body["cordoned"], false);
    assert_eq!(
        h.post("/m1/cordon", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(h.get("/m1").await.body["cordoned"], true);
    let listed = h.get("").await;
    assert_eq!(listed.body[0]["cordoned"], true);
    assert_eq!(listed.body[1]["cordoned"], false);

    assert_eq!(
        h.post("/m1/restart", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(h.wait_for("m1", "started", 5).await.status, StatusCode::OK);
    assert!(
        h.sim.machine("m1").expect("m1").cordoned,
        "restart keeps it"
    );

    let updated = h
        .post(
            "/m1",
            None,
            Some(json!({"config": {"image": "img:2", "metadata": {}}})),
        )
        .await;
    assert_eq!(updated.status, StatusCode::OK);
    assert_eq!(updated.body["cordoned"], false, "an update clears it");

    // Switch: restarts clear it too.
    h.sim.set_restart_keeps_cordon(false);
    assert_eq!(
        h.post("/m2/cordon", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.post("/m2/restart", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(h.wait_for("m2", "started", 5).await.status, StatusCode::OK);
    assert_eq!(h.get("/m2").await.body["cordoned"], false);
}

#[tokio::test]
async fn an_outside_update_reverts_metadata_and_replaces_the_machine() {
    let h = Harness::start(fleet()).await;
    h.sim.enable_audit(AuditConfig::default());
    // `fly deploy` read the machine list here...
    let snapshot = h.sim.machine("m1").expect("m1").metadata;
    let before = h.sim.machine("m1").expect("m1");
    // ...then a hold was written and the daemon leased and cordoned the machine.
    h.sim.set_metadata("m1", HOLD, "ops");
    h.sim.set_live_sessions("m1", 3);
    let acquired = h.post("/m1/lease", None, Some(json!({"ttl": 60}))).await;
    let nonce = acquired.body["data"]["nonce"]
        .as_str()
        .expect("nonce")
        .to_string();
    assert_eq!(
        h.post("/m1/cordon", Some(&nonce), None).await.status,
        StatusCode::OK
    );

    assert!(matches!(
        h.sim.outside_update("m1", &snapshot, OutsideLease::Respect),
        Err(OperatorWriteRefused::Leased { .. })
    ));
    assert_eq!(
        h.sim
            .outside_update("m1", &snapshot, OutsideLease::ReuseFound),
        Ok(())
    );
    let m1 = h.sim.machine("m1").expect("m1");
    assert!(
        !m1.metadata.contains_key(HOLD),
        "the hold written since is reverted"
    );
    assert_eq!(m1.metadata, snapshot);
    assert_ne!(m1.instance_id, before.instance_id);
    assert!(!m1.cordoned, "the cordon does not survive");
    assert!(m1.lease.is_none(), "flyctl released the lease it reused");
    assert_eq!(m1.state, "replacing");
    // Our nonce is now worthless.
    assert_eq!(
        h.fly(Method::DELETE, "/m1/lease", Some(&nonce), None)
            .await
            .status,
        StatusCode::NOT_FOUND
    );

    assert_eq!(h.wait_for("m1", "started", 5).await.status, StatusCode::OK);
    let m1 = h.sim.machine("m1").expect("m1");
    assert_eq!(m1.loaded_ref, TIP, "the agent comes back on the tip");
    assert_eq!(m1.live_sessions, 0);
    assert_eq!(m1.activity, "idle");
    let events = h.get("/m1").await.body["events"].clone();
    assert!(
        events
            .as_array()
            .expect("events")
            .iter()
            .any(|e| e["type"] == "update"),
        "{events}"
    );
    // Not the daemon's restart.
    assert!(h.sim.audit().restarts.is_empty());

    assert!(matches!(
        h.sim
            .outside_update("nope", &snapshot, OutsideLease::ReuseFound),
        Err(OperatorWriteRefused::UnknownMachine { .. })
    ));
    h.sim.set_host_status("m2", HostStatus::Unreachable);
    assert!(matches!(
        h.sim
            .outside_update("m2", &snapshot, OutsideLease::ReuseFound),
        Err(OperatorWriteRefused::HostDown { .. })
    ));
}

#[tokio::test]
async fn restart_timeout_overrides_kill_timeout_and_can_kill_a_checkpoint() {
    let fleet = SimFleet::new(TOKEN)
        .release_tip(TIP)
        .restart_delay(Duration::from_millis(50))
        .app(
            SimApp::new(APP).machine(
                SimMachine::new("slow")
                    .kill_timeout(Duration::from_secs(300))
                    .checkpoint_on_stop(Duration::from_secs(60)),
            ),
        );
    let h = Harness::start(fleet).await;
    h.sim.enable_audit(AuditConfig::default());
    assert_eq!(
        h.post("/slow/restart?timeout=30s", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.wait_for("slow", "started", 5).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.post("/slow/restart", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.wait_for("slow", "started", 5).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.post("/slow/restart?timeout=soon", None, None)
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    let restarts = h.sim.audit().restarts;
    assert_eq!(restarts.len(), 2);
    assert_eq!(restarts[0].stop_timeout, Some(Duration::from_secs(30)));
    assert!(
        restarts[0].killed_before_checkpoint,
        "30 s < the 60 s it needs"
    );
    assert_eq!(restarts[1].stop_timeout, Some(Duration::from_secs(300)));
    assert!(
        !restarts[1].killed_before_checkpoint,
        "kill_timeout leaves it time"
    );
}

#[tokio::test]
async fn checks_and_events_follow_boots_and_crash_loops() {
    let h = Harness::start(fleet().checks_pass_after(Duration::from_millis(400))).await;
    let m2 = h.get("/m2").await.body;
    assert_eq!(m2["checks"][0]["name"], DEFAULT_CHECK);
    assert_eq!(m2["checks"][0]["status"], "passing");
    assert_eq!(m2["events"], json!([]));

    assert_eq!(
        h.post("/m2/restart", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(h.wait_for("m2", "started", 5).await.status, StatusCode::OK);
    let m2 = h.get("/m2").await.body;
    assert_eq!(m2["checks"][0]["status"], "critical", "fresh from boot");
    let kinds: Vec<&str> = m2["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["type"].as_str().expect("type"))
        .collect();
    // The restart's exit is one asked for (#32 item 13 c).
    assert_eq!(kinds, vec!["start", "exit", "restart"], "newest first");
    assert_eq!(m2["events"][1]["source"], "user");
    assert_eq!(
        m2["events"][1]["request"]["exit_event"]["requested_stop"],
        true
    );
    assert_eq!(m2["events"][2]["source"], "user");
    let newest = m2["events"][0]["timestamp"].as_i64().expect("ms");
    assert!(newest >= m2["events"][1]["timestamp"].as_i64().expect("ms"));
    assert!(newest > 1_600_000_000_000, "milliseconds: {newest}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(h.get("/m2").await.body["checks"][0]["status"], "passing");

    // A crash loop: started, exit events, checks critical, agent unreachable.
    assert!(h.sim.set_crash_loop("m1", true));
    let m1 = h.get("/m1").await.body;
    assert_eq!(m1["state"], "started");
    assert_eq!(m1["checks"][0]["status"], "critical");
    let exits = m1["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["type"] == "exit")
        .count();
    assert!(exits >= 2, "{m1}");
    assert_eq!(h.health("m1").await.status, StatusCode::SERVICE_UNAVAILABLE);
    for _ in 0..10 {
        h.sim.set_crash_loop("m1", true);
    }
    assert!(
        h.get("/m1").await.body["events"]
            .as_array()
            .expect("events")
            .len()
            <= 20
    );
    assert!(h.sim.machine("m1").expect("m1").crash_loop);
    assert!(h.sim.set_crash_loop("m1", false));
    assert_eq!(h.health("m1").await.status, StatusCode::OK);

    // A check set by hand.
    assert!(h.sim.set_check("m2", DEFAULT_CHECK, CheckStatus::Warning));
    assert!(h.sim.set_check("m2", "disk", CheckStatus::Critical));
    let checks = h.get("/m2").await.body["checks"].clone();
    assert_eq!(checks[0]["status"], "warning");
    assert_eq!(checks[1]["name"], "disk");
    assert_eq!(checks[1]["status"], "critical");
    assert_eq!(
        h.sim.machine("m2").expect("m2").checks,
        vec![
            (DEFAULT_CHECK.to_string(), CheckStatus::Warning),
            ("disk".to_string(), CheckStatus::Critical)
        ]
    );
}

#[tokio::test]
async fn chaos_takes_hosts_down_including_the_coordinator() {
    const COORD: &str = "fleet-coord";
    let fleet = fleet().app(SimApp::new(COORD).machine(SimMachine::new("coord").stopped()));
    let h = Harness::start(fleet).await;
    let outage = WorldFault::new(1.0, Duration::from_millis(300)).app(COORD);
    h.sim
        .set_chaos(Some(Chaos::new(5, 0.0).host_outages(outage)));
    assert_eq!(h.get("/m2").await.status, StatusCode::OK);
    let coord = h.fly_in(COORD, Method::GET, "/coord", None, None).await;
    assert_eq!(coord.body["host_status"], "unreachable");
    assert!(coord.body.get("config").is_none());
    let events = h.sim.chaos_world_events();
    assert!(!events.is_empty());
    assert!(
        events
            .iter()
            .all(|e| e.kind == WorldFaultKind::HostOutage && e.machine_id == "coord")
    );
    let stats = h.sim.chaos_stats();
    assert_eq!(stats.injected(), 0, "no request fault at rate 0");
    assert!(stats.host_outages >= 1);

    h.sim.set_chaos(None);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        h.sim.machine("coord").expect("coord").host_status,
        HostStatus::Ok
    );
}

#[tokio::test]
async fn chaos_writes_holds_without_a_nonce_and_removes_them() {
    let h = Harness::start(fleet()).await;
    h.sim
        .acquire_lease_as("m1", "daemon@example.com", Duration::from_secs(60))
        .expect("m1");
    h.sim
        .acquire_lease_as("m2", "daemon@example.com", Duration::from_secs(60))
        .expect("m2");
    let holds = WorldFault::new(1.0, Duration::from_millis(300)).app(APP);
    h.sim.set_chaos(Some(Chaos::new(9, 0.0).holds(HOLD, holds)));
    for _ in 0..3 {
        assert_eq!(h.get("").await.status, StatusCode::OK);
    }
    h.sim.set_chaos(None);
    let held: Vec<String> = h
        .sim
        .machines()
        .into_iter()
        .filter(|m| m.metadata.contains_key(HOLD))
        .map(|m| m.id)
        .collect();
    assert!(!held.is_empty());
    assert!(
        held.iter()
            .all(|id| ["m1", "m2", "m3"].contains(&id.as_str())),
        "{held:?}"
    );
    assert_eq!(h.sim.chaos_stats().holds, 3);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        h.sim
            .machines()
            .iter()
            .all(|m| !m.metadata.contains_key(HOLD))
    );
}

#[tokio::test]
async fn chaos_makes_outside_updates_from_an_earlier_snapshot() {
    let h = Harness::start(fleet()).await;
    let before = h.sim.machine("o1").expect("o1");
    let updates = WorldFault::new(1.0, Duration::ZERO).app("other");
    h.sim
        .set_chaos(Some(Chaos::new(3, 0.0).outside_updates(updates)));
    // Written after the "deploy" read the machines: reverted.
    h.sim.set_metadata("o1", "fleet_reconciler_rotation", "{}");
    h.sim
        .acquire_lease_as("o1", "daemon@example.com", Duration::from_secs(60));
    assert_eq!(h.get("/m1").await.status, StatusCode::OK);
    h.sim.set_chaos(None);
    let o1 = h.sim.machine("o1").expect("o1");
    assert_eq!(o1.metadata, before.metadata);
    assert_ne!(o1.instance_id, before.instance_id);
    assert!(o1.lease.is_none(), "the reused lease is released");
    assert_eq!(h.sim.chaos_stats().outside_updates, 1);
    assert_eq!(
        h.sim.chaos_world_events()[0].kind,
        WorldFaultKind::OutsideUpdate
    );
}

#[tokio::test]
async fn chaos_storms_throttle_a_machine_at_the_documented_limits() {
    let h = Harness::start(fleet()).await;
    h.sim.set_chaos(Some(Chaos::new(4, 0.0).rate_storms(1.0)));
    assert_eq!(
        h.post("/m1/cordon", None, None).await.status,
        StatusCode::OK
    );
    h.sim.set_chaos(None);
    // Every bucket of m1, even one not used yet, is empty; m2 is untouched.
    assert_eq!(h.get("/m1").await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        h.post("/m1/restart", None, None).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(h.get("/m2").await.status, StatusCode::OK);
    assert_eq!(h.sim.chaos_stats().rate_storms, 1);
    // Refilled at get-machine's 5/s.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.get("/m1").await.status, StatusCode::OK);
}

/// The wait endpoint takes every state Fly's specification lists, as the
/// client's `WaitState` sends them, comma-separated or repeated; `settled`
/// is any state a machine rests in. (Before, `failed` and `settled` were
/// refused with 400, and a list was read as one unknown state.)
#[tokio::test]
async fn wait_takes_every_state_the_client_sends() {
    use fleet_reconciler::fly::WaitState;
    use strum::VariantArray;
    let h = Harness::start(fleet()).await;
    // m3 is stopped; a zero timeout answers at once: 200 if reached, else 408.
    for state in WaitState::VARIANTS {
        let reply = h.wait_for("m3", &state.to_string(), 0).await;
        let reached = matches!(state, WaitState::Stopped | WaitState::Settled);
        let want = if reached {
            StatusCode::OK
        } else {
            StatusCode::REQUEST_TIMEOUT
        };
        assert_eq!(reply.status, want, "{state}: {:?}", reply.body);
    }
    for query in ["state=started,stopped", "state=started&state=stopped"] {
        let reply = h.get(&format!("/m3/wait?{query}&timeout=0")).await;
        assert_eq!(reply.status, StatusCode::OK, "{query}: {:?}", reply.body);
        assert_eq!(reply.body["state"], "stopped");
    }
    let refused = h.get("/m3/wait?state=stopped,dancing&timeout=0").await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert!(
        error_text(&refused).contains("\"dancing\""),
        "{:?}",
        refused.body
    );
    assert!(
        error_text(&refused).contains("settled"),
        "{:?}",
        refused.body
    );
}

/// A frozen fleet answers every list and health path with the live
/// simulator's answer (status, content type, body: the same bytes but for
/// the agents' `heartbeat_at`, which the live one renders anew), answers
/// nothing else, and changes nothing: the benchmarks' static reference
/// serves what the simulator would.
#[tokio::test]
async fn a_frozen_fleet_serves_the_live_answers_as_they_were() {
    /// A body with any top-level `heartbeat_at` taken out (raw bytes if not JSON).
    fn without_heartbeat(body: &[u8]) -> Result<Value, Vec<u8>> {
        let mut value: Value = serde_json::from_slice(body).map_err(|_| body.to_vec())?;
        if let Some(o) = value.as_object_mut() {
            o.remove("heartbeat_at");
        }
        Ok(value)
    }

    let fleet = fleet().app(
        SimApp::new("odd apps")
            .machine(SimMachine::new("g1").behaviour(Behaviour::Garbage))
            .machine(SimMachine::new("e1").behaviour(Behaviour::HttpError(500))),
    );
    let h = Harness::start(fleet).await;
    let frozen = within(h.sim.freeze()).await.expect("the fleet freezes");
    // 3 lists, 6 agents.
    assert_eq!(frozen.len(), 9);
    let server = within(frozen.clone().serve()).await.expect("it serves");
    let lists = ["agents", "other", "odd apps"].map(|app| {
        let app = app.replace(' ', "%20");
        (format!("/v1/apps/{app}/machines"), true)
    });
    let agents =
        ["m1", "m2", "m3", "o1", "g1", "e1"].map(|id| (format!("/agents/{id}/health"), false));
    for (path, fly) in lists.into_iter().chain(agents) {
        let get = |base: String| {
            let request = h.http.get(format!("{base}{path}"));
            if fly {
                request.bearer_auth(TOKEN)
            } else {
                request
            }
        };
        let live = within(get(h.sim.api_url()).send())
            .await
            .expect("live answers");
        let served = within(get(server.api_url()).send())
            .await
            .expect("frozen answers");
        assert_eq!(served.status(), live.status(), "{path}");
        assert_eq!(
            served.headers().get(header::CONTENT_TYPE),
            live.headers().get(header::CONTENT_TYPE),
            "{path}"
        );
        let live = within(live.bytes()).await.expect("live body");
        let served = within(served.bytes()).await.expect("frozen body");
        assert_eq!(
            without_heartbeat(&served),
            without_heartbeat(&live),
            "{path}"
        );
        if fly {
            assert_eq!(served, live, "{path}: a list is the same bytes");
        }
        assert_eq!(frozen.body(&path), Some(&served[..]), "{path}");
    }
    // m3 is stopped: its agent's 503 is served as it was.
    assert_eq!(
        within(h.http.get(server.health_url("m3")).send())
            .await
            .expect("answers")
            .status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    // Only what was rendered, and only reads.
    let unknown = within(h.http.get(server.health_url("nope")).send())
        .await
        .expect("answers");
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    let post = h
        .http
        .post(format!(
            "{}/v1/apps/agents/machines/m1/restart",
            server.api_url()
        ))
        .bearer_auth(TOKEN);
    let post = within(post.send()).await.expect("answers");
    assert_eq!(post.status(), StatusCode::METHOD_NOT_ALLOWED);
    let restart = h
        .http
        .post(format!("{}/agents/m1/health", server.api_url()));
    assert_eq!(
        within(restart.send()).await.expect("answers").status(),
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(h.sim.machine("m1").map(|m| m.restart_count), Some(0));
    within(server.shutdown()).await;

    // An agent that never answers cannot be rendered once.
    h.sim.set_behaviour("m2", Behaviour::Hang);
    let refused = within(h.sim.freeze()).await.err().map(|e| e.to_string());
    assert!(
        refused.as_deref().is_some_and(|e| e.contains("m2")),
        "{refused:?}"
    );
}

// ---- #32 item 13: Fly as its own clients read it ------------------------------

/// What a machine's config defines is listed as Fly lists it: a check per
/// reported result and the stop timeout; exits say whether they were asked
/// for (a restart's is, a crash loop's are not), as fly-go's types read them.
#[tokio::test]
async fn item13_configs_list_checks_and_stop_timeout_and_exits_say_who_asked() {
    let h = Harness::start(fleet()).await;
    let fly = fleet_reconciler::fly::FlyClient::new(
        fleet_reconciler::fly::FlyClientConfig::new(&h.sim.api_url()),
        TOKEN,
    )
    .expect("client");
    let get = |id: &'static str| {
        let fly = fly.clone();
        async move {
            within(fly.get_machine(&APP.into(), &id.into()))
                .await
                .expect("machine")
        }
    };
    let m1 = get("m1").await;
    let config = m1.config.clone().expect("config");
    assert_eq!(config.defined_checks(), 1, "{DEFAULT_CHECK} is defined");
    assert_eq!(config.stop_timeout, Some(Duration::from_secs(5)));
    assert_eq!(m1.checks.len(), 1);
    assert!(m1.checks[0].updated_at.is_some());

    // A restart's exit is requested; the checks are rewritten after it.
    let before = h.sim.now();
    let r = h.post("/m1/restart", None, None).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(h.wait_for("m1", "started", 5).await.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let m1 = get("m1").await;
    let exit = m1
        .events
        .first()
        .and_then(|e| e.exit)
        .expect("an exit with details");
    assert!(exit.requested_stop && exit.restarting, "{exit:?}");
    assert!(
        m1.checks
            .iter()
            .all(|c| c.passing() && c.updated_at > Some(before)),
        "{:?}",
        m1.checks
    );

    // A crash loop's exits are Fly's restarts of a failing process.
    assert!(h.sim.set_crash_loop("m2", true));
    let m2 = get("m2").await;
    let crashes: Vec<_> = m2.events.iter().filter_map(|e| e.exit).collect();
    assert_eq!(crashes.len(), 2, "{:?}", m2.events);
    assert!(
        crashes
            .iter()
            .all(|x| x.restarting && !x.requested_stop && x.exit_code != 0),
        "{crashes:?}"
    );
    h.sim.shutdown().await;
}

/// Fly documents 1 list request/s per app, burst 3: the fourth at once is
/// refused (429); another app's list is not.
#[tokio::test(start_paused = true)]
async fn item13_lists_are_limited_per_app() {
    let h = Harness::start(fleet()).await;
    for _ in 0..3 {
        assert_eq!(h.get("").await.status, StatusCode::OK);
    }
    assert_eq!(h.get("").await.status, StatusCode::TOO_MANY_REQUESTS);
    let other = h.fly_in("other", Method::GET, "", None, None).await;
    assert_eq!(other.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.get("").await.status, StatusCode::OK);
    // A machine's own calls are not counted against it.
    assert_eq!(h.get("/m1").await.status, StatusCode::OK);
    h.sim.shutdown().await;
}

/// A 408 aimed at a restart: the restart happens, the caller learns only
/// that Fly timed out.
#[tokio::test]
async fn item13_a_408_after_the_effect() {
    let h = Harness::start(fleet()).await;
    h.sim
        .fault_next_call("m1", "POST", "restart", ChaosFault::TimedOutAfter);
    let r = h.post("/m1/restart", None, None).await;
    assert_eq!(r.status, StatusCode::REQUEST_TIMEOUT);
    assert_eq!(h.sim.machine("m1").expect("m1").restart_count, 1);
    h.sim.shutdown().await;
}

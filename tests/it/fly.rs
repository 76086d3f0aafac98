//! The Fly Machines API client against the simulator over loopback: request
//! shapes, the auth header rule, leases and nonces, metadata CAS, wait, retries.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::{FutureExt, StreamExt};

use fleet_reconciler::fly::{FlyClient, FlyClientConfig, FlyError, WaitState};
use fleet_reconciler::model::{AppName, MachineId};
use fleet_reconciler::sim::{Credential, Sim, SimApp, SimFleet, SimMachine};
use secrecy::ExposeSecret;

use crate::common::within;

const TOKEN: &str = "fly-test-token";
const TIP: &str = "1111111111111111111111111111111111111111";
const OLD: &str = "2222222222222222222222222222222222222222";

async fn sim() -> Sim {
    Sim::start(
        SimFleet::new(TOKEN)
            .release_tip(TIP)
            .restart_delay(Duration::from_millis(200))
            .app(
                SimApp::new("agents")
                    .machine(
                        SimMachine::new("m1")
                            .name("one")
                            .region("iad")
                            .loaded(OLD)
                            .metadata("pool", "dispatch"),
                    )
                    .machine(SimMachine::new("m2").loaded(TIP).stopped()),
            ),
    )
    .await
    .unwrap()
}

fn client(sim: &Sim, token: &str) -> FlyClient {
    let mut config = FlyClientConfig::new(&sim.api_url());
    config.base_backoff = Duration::from_millis(20);
    config.max_backoff = Duration::from_millis(100);
    FlyClient::new(config, token).unwrap()
}

#[tokio::test]
async fn lists_and_gets_machines_with_metadata() {
    let sim = sim().await;
    let fly = client(&sim, TOKEN);
    let machines = within(fly.list_machines(&"agents".into())).await.unwrap();
    assert_eq!(machines.len(), 2);
    let m1 = machines.iter().find(|m| m.id == "m1").unwrap();
    assert_eq!(
        (m1.name.as_str(), m1.region.as_str(), m1.state.as_str()),
        ("one", "iad", "started")
    );
    assert_eq!(m1.metadata("pool"), Ok(Some("dispatch")));
    assert!(!m1.instance_id.is_empty());
    let m2 = within(fly.get_machine(&"agents".into(), &"m2".into()))
        .await
        .unwrap();
    assert!(!m2.is_started());
    // Never summary=true: it drops metadata.
    assert!(
        sim.requests()
            .iter()
            .all(|r| !r.query.as_deref().unwrap_or("").contains("summary"))
    );

    let err = within(fly.list_machines(&"nope".into())).await.unwrap_err();
    assert!(matches!(err, FlyError::NotFound { .. }), "{err}");
    let err = within(fly.get_machine(&"agents".into(), &"zz".into()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("zz"), "{err}");
    sim.shutdown().await;
}

#[tokio::test]
async fn auth_header_rule_and_rejection() {
    let sim = sim().await;
    within(client(&sim, TOKEN).list_machines(&"agents".into()))
        .await
        .unwrap();
    // A FlyV1 macaroon is sent verbatim (not as Bearer).
    within(client(&sim, &format!("FlyV1 {TOKEN}")).list_machines(&"agents".into()))
        .await
        .unwrap();
    assert!(
        sim.requests()
            .iter()
            .all(|r| r.credential == Credential::FlyToken)
    );
    let err = within(client(&sim, "wrong").list_machines(&"agents".into()))
        .await
        .unwrap_err();
    assert!(
        matches!(err, FlyError::Unauthorized { status: 401, .. }),
        "{err}"
    );
    assert!(!err.to_string().contains("wrong"));
    sim.shutdown().await;
}

#[tokio::test]
async fn leases_carry_nonces_and_are_never_stolen() {
    let sim = sim().await;
    let fly = client(&sim, TOKEN);
    let lease = within(fly.acquire_lease(
        &"agents".into(),
        &"m1".into(),
        Duration::from_secs(13),
        "rotation",
    ))
    .await
    .unwrap();
    assert!(!lease.nonce.expose_secret().is_empty());
    assert_eq!(
        sim.machine("m1").unwrap().lease.unwrap().nonce,
        lease.nonce.expose_secret()
    );
    let body = sim.requests().last().unwrap().body.clone();
    let sent: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(sent["ttl"], 13);
    assert_eq!(sent["description"], "rotation");
    assert!(
        sim.requests()
            .last()
            .unwrap()
            .query
            .as_deref()
            .unwrap()
            .contains("ttl=13")
    );

    // Someone else (another replica) cannot take it: 409, typed.
    let other = client(&sim, TOKEN);
    let err =
        within(other.acquire_lease(&"agents".into(), &"m1".into(), Duration::from_secs(13), "x"))
            .await
            .unwrap_err();
    assert!(matches!(err, FlyError::LeaseConflict { .. }), "{err}");
    // A 409 is not retried: exactly one more request.
    let acquires = sim
        .requests()
        .iter()
        .filter(|r| r.action.as_deref() == Some("lease") && r.method == "POST")
        .count();
    assert_eq!(acquires, 2);

    // Mutations without the nonce are refused; with it they pass.
    let err = within(fly.cordon(&"agents".into(), &"m1".into(), None))
        .await
        .unwrap_err();
    assert!(matches!(err, FlyError::LeaseConflict { .. }), "{err}");
    assert!(!sim.machine("m1").unwrap().cordoned);
    within(fly.cordon(&"agents".into(), &"m1".into(), Some(&lease.nonce)))
        .await
        .unwrap();
    assert!(sim.machine("m1").unwrap().cordoned);
    within(fly.set_metadata(&"agents".into(), &"m1".into(), "k", "v", Some(&lease.nonce)))
        .await
        .unwrap();

    let refreshed = within(fly.refresh_lease(
        &"agents".into(),
        &"m1".into(),
        &lease.nonce,
        Duration::from_secs(30),
        "rotation",
    ))
    .await
    .unwrap();
    assert_eq!(refreshed.nonce.expose_secret(), lease.nonce.expose_secret());
    assert!(refreshed.expires_at >= lease.expires_at);

    // Releasing with a wrong nonce fails and leaves the lease; the right one frees it.
    let err = within(fly.release_lease(&"agents".into(), &"m1".into(), &"not-the-nonce".into()))
        .await
        .unwrap_err();
    assert!(matches!(err, FlyError::LeaseConflict { .. }), "{err}");
    assert!(sim.machine("m1").unwrap().lease.is_some());
    within(fly.release_lease(&"agents".into(), &"m1".into(), &lease.nonce))
        .await
        .unwrap();
    assert!(sim.machine("m1").unwrap().lease.is_none());
    // Releasing an already-gone lease is fine.
    within(fly.release_lease(&"agents".into(), &"m1".into(), &lease.nonce))
        .await
        .unwrap();

    // Every mutating request that succeeded carried our nonce.
    for r in sim
        .requests()
        .iter()
        .filter(|r| r.is_mutating() && r.status.is_some_and(|s| s < 300))
    {
        assert_eq!(
            r.lease_nonce.as_deref(),
            Some(lease.nonce.expose_secret()),
            "{r:?}"
        );
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn metadata_set_and_delete() {
    let sim = sim().await;
    let fly = client(&sim, TOKEN);
    let (agents, m1, key) = (
        AppName::from("agents"),
        MachineId::from("m1"),
        "fleet_reconciler_hold",
    );
    within(fly.set_metadata(&agents, &m1, key, "ops: incident 42", None))
        .await
        .unwrap();
    assert_eq!(
        sim.machine("m1")
            .unwrap()
            .metadata
            .get("fleet_reconciler_hold")
            .map(String::as_str),
        Some("ops: incident 42")
    );
    within(fly.delete_metadata(&agents, &m1, key, None))
        .await
        .unwrap();
    assert!(
        !sim.machine("m1")
            .unwrap()
            .metadata
            .contains_key("fleet_reconciler_hold")
    );
    // Deleting an absent key is not an error (a retried delete that applied).
    within(fly.delete_metadata(&agents, &m1, key, None))
        .await
        .unwrap();
    sim.shutdown().await;
}

#[tokio::test]
async fn restart_then_wait_and_wait_timeout() {
    let sim = sim().await;
    let fly = client(&sim, TOKEN);
    within(fly.restart(
        &"agents".into(),
        &"m1".into(),
        Some(Duration::from_secs(10)),
        None,
    ))
    .await
    .unwrap();
    let r = sim
        .requests()
        .into_iter()
        .find(|r| r.action.as_deref() == Some("restart"))
        .unwrap();
    assert_eq!(r.query.as_deref(), Some("timeout=10s"));
    within(fly.wait(
        &"agents".into(),
        &"m1".into(),
        WaitState::Started,
        Duration::from_secs(5),
    ))
    .await
    .unwrap();
    let view = sim.machine("m1").unwrap();
    assert_eq!(
        (
            view.state.as_str(),
            view.loaded_ref.as_str(),
            view.restart_count
        ),
        ("started", TIP, 1)
    );

    // A stopped machine never becomes started: Fly's 408 becomes WaitTimeout, not retried.
    sim.clear_requests();
    let err = within(fly.wait(
        &"agents".into(),
        &"m2".into(),
        WaitState::Started,
        Duration::from_secs(1),
    ))
    .await
    .unwrap_err();
    assert!(matches!(err, FlyError::WaitTimeout { .. }), "{err}");
    assert!(err.to_string().contains("state started"), "{err}");
    assert_eq!(sim.requests().len(), 1);
    let wait = &sim.requests()[0];
    assert!(
        wait.query
            .as_deref()
            .is_some_and(|q| q.split('&').any(|p| p == "state=started")),
        "{:?}",
        wait.query
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn transient_errors_retry_but_unsafe_calls_do_not_repeat() {
    let sim = sim().await;
    // This counts retries, not their spacing: no client-side rate limits.
    let mut config = FlyClientConfig::new(&sim.api_url());
    config.base_backoff = Duration::from_millis(20);
    config.max_backoff = Duration::from_millis(100);
    config.rate_limits = None;
    let fly = FlyClient::new(config, TOKEN).unwrap();
    sim.fail_next(3, 503, None);
    within(fly.list_machines(&"agents".into())).await.unwrap();
    assert_eq!(sim.pending_failures(), 0);

    // Retries are bounded: more failures than retries is an error naming the status.
    sim.fail_next(10, 502, None);
    let err = within(fly.list_machines(&"agents".into()))
        .await
        .unwrap_err();
    assert!(matches!(err, FlyError::Status { status: 502, .. }), "{err}");
    assert_eq!(sim.pending_failures(), 10 - 5, "1 try + 4 retries");

    // A 5xx on restart may have restarted the machine: not repeated blindly.
    while sim.pending_failures() > 0 {
        let _ = fly.list_machines(&"agents".into()).await;
    }
    sim.fail_next(1, 500, None);
    let err = within(fly.restart(&"agents".into(), &"m1".into(), None, None))
        .await
        .unwrap_err();
    assert!(matches!(err, FlyError::Status { status: 500, .. }), "{err}");
    // …but a 429 (not processed) is.
    sim.fail_next(1, 429, Some(0));
    within(fly.restart(&"agents".into(), &"m1".into(), None, None))
        .await
        .unwrap();
    assert_eq!(sim.machine("m1").unwrap().restart_count, 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn unreachable_api_is_a_transport_error() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut config = FlyClientConfig::new(&format!("http://127.0.0.1:{port}"));
    config.base_backoff = Duration::from_millis(5);
    config.max_retries = 2;
    let fly = FlyClient::new(config, TOKEN).unwrap();
    let err = within(fly.list_machines(&"agents".into()))
        .await
        .unwrap_err();
    assert!(matches!(err, FlyError::Transport { .. }), "{err}");
    assert!(err.to_string().contains("unreachable"), "{err}");
    assert_eq!(err.kind(), "transport");
}

// ---- response size caps --------------------------------------------------------

const MIB: usize = 1 << 20;
const LIST_CAP: usize = fleet_reconciler::fly::MAX_LIST_BODY_BYTES;
const OBJECT_CAP: usize = fleet_reconciler::fly::MAX_BODY_BYTES;

/// A stand-in Fly API: every answer is `status`, its body the `chunks` one
/// call of `body` yields, streamed as they are made (with a
/// `content-length` when `length` says one); counts the bytes it handed to
/// the connection.
async fn streaming_api<I>(
    status: u16,
    length: Option<usize>,
    body: impl Fn() -> I + Clone + Send + Sync + 'static,
) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>)
where
    I: Iterator<Item = bytes::Bytes> + Send + 'static,
{
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    let handler = move || {
        let (counter, body) = (counter.clone(), body.clone());
        async move {
            let stream = futures::stream::iter(body()).map(move |c| {
                counter.fetch_add(c.len(), Ordering::SeqCst);
                Ok::<_, std::io::Error>(c)
            });
            let mut resp = axum::response::Response::builder()
                .status(status)
                .header("content-type", "application/json");
            if let Some(n) = length {
                resp = resp.header("content-length", n);
            }
            resp.body(axum::body::Body::from_stream(stream)).unwrap()
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().fallback(handler);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, sent, task)
}

/// Every answer is `status` with `size` bytes of JSON whitespace and then
/// `[]` (the length announced or not).
async fn bloated_api(
    size: usize,
    announce: bool,
    status: u16,
) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    streaming_api(status, announce.then_some(size + 2), move || {
        let chunk = bytes::Bytes::from(vec![b' '; MIB]);
        (0..size / MIB).map(move |_| chunk.clone()).chain([
            bytes::Bytes::from(vec![b' '; size % MIB]),
            bytes::Bytes::from_static(b"[]"),
        ])
    })
    .await
}

fn bloated_client(url: &str) -> FlyClient {
    let mut config = FlyClientConfig::new(url);
    config.max_retries = 0;
    FlyClient::new(config, TOKEN).unwrap()
}

/// A list answer of `[`, `count` machine objects of about `size` bytes
/// each (the one at `huge`, if any, of `huge_size`), `]`, without a length.
async fn listing_api(
    count: usize,
    size: usize,
    huge: Option<(usize, usize)>,
) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    streaming_api(200, None, move || {
        let machine = move |i: usize| {
            let pad = match huge {
                Some((at, big)) if at == i => big,
                _ => size,
            };
            let sep = if i == 0 { "[" } else { "," };
            bytes::Bytes::from(format!(
                r#"{sep}{{"id":"m{i}","name":"n{i}","state":"started","region":"iad","private_ip":"fdaa::{i:x}","instance_id":"i{i}","config":{{"metadata":{{"fly_process_group":"app"}},"env":{{"PAD":"{}"}}}}}}"#,
                "p".repeat(pad)
            ))
        };
        (0..count)
            .map(machine)
            .chain([bytes::Bytes::from_static(b"]")])
    })
    .await
}

/// #22. Before, a list answer was buffered whole and refused above 64 MiB:
/// an app of about 16,000 real machines (4 KiB of JSON each) could not be
/// listed at all. The list is decoded machine by machine as it arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_over_the_old_64_mib_cap_is_decoded_machine_by_machine() {
    let (url, sent, server) = listing_api(17_000, 4 << 10, None).await;
    let machines = within(bloated_client(&url).list_machines(&"agents".into()))
        .await
        .unwrap();
    assert!(sent.load(Ordering::SeqCst) > 64 * MIB);
    assert_eq!(machines.len(), 17_000);
    assert_eq!(machines[16_999].id, "m16999");
    assert_eq!(machines[16_999].private_ip, "fdaa::4267");
    server.abort();
}

/// One machine object over its cap (as for `get_machine`) is refused naming
/// the machine, and the rest of the answer is not read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_machine_in_a_list_is_refused_by_id_without_reading_on() {
    // Machine 10 carries 3 MiB; 30,000 more (about 120 MiB) follow it.
    let (url, sent, server) = listing_api(30_000, 4 << 10, Some((10, 3 * MIB))).await;
    let err = within(bloated_client(&url).list_machines(&"agents".into()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "too_large", "{err}");
    let text = err.to_string();
    assert!(
        text.contains("list_machines") && text.contains("agents") && text.contains("m10"),
        "{text}"
    );
    assert!(
        sent.load(Ordering::SeqCst) < 32 * MIB,
        "the server sent {} MiB",
        sent.load(Ordering::SeqCst) / MIB
    );
    server.abort();
}

/// A list that is not an array of machine objects is named as such.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_that_is_not_an_array_is_a_decode_error() {
    let (url, _, server) = listing_api(0, 0, None).await;
    // `]` alone: not an array.
    let err = within(bloated_client(&url).list_machines(&"agents".into()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "decode", "{err}");
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_answers_are_refused_by_their_announced_length_and_per_endpoint() {
    // An announced length over the cap fails before the body is read.
    let (url, sent, server) = bloated_api(3 * LIST_CAP, true, 200).await;
    let err = within(bloated_client(&url).list_machines(&"agents".into()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "too_large", "{err}");
    assert!(
        sent.load(Ordering::SeqCst) < 16 * MIB,
        "{} MiB",
        sent.load(Ordering::SeqCst) / MIB
    );
    server.abort();

    // A single machine has a smaller cap than the list.
    let (url, _, server) = bloated_api(2 * OBJECT_CAP, false, 200).await;
    let err = within(bloated_client(&url).get_machine(&"agents".into(), &"m1".into()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "too_large", "{err}");
    assert!(
        err.to_string().contains("get_machine") && err.to_string().contains("m1"),
        "{err}"
    );
    // …while a list of that size is fine.
    let machines = within(bloated_client(&url).list_machines(&"agents".into()))
        .await
        .unwrap();
    assert!(machines.is_empty());
    server.abort();

    // An error answer is read only as far as its message needs.
    let (url, sent, server) = bloated_api(3 * LIST_CAP, false, 404).await;
    let err = within(bloated_client(&url).get_machine(&"agents".into(), &"m1".into()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "not_found", "{err}");
    assert!(err.to_string().len() < 1024, "{err}");
    assert!(
        sent.load(Ordering::SeqCst) < 16 * MIB,
        "the server sent {} MiB of an error",
        sent.load(Ordering::SeqCst) / MIB
    );
    server.abort();
}

// ---- deadlines (a lease's validity) --------------------------------------------

/// How a stand-in Fly API answers one request.
#[derive(Clone)]
enum Answer {
    /// This status with this JSON body, and a `Retry-After` when given.
    Status(u16, Option<&'static str>, String),
    /// Never answers (a hung control plane).
    Hang,
}

/// One request as a stand-in received it, on tokio's (paused) clock.
#[derive(Clone, Debug)]
struct Arrival {
    at: tokio::time::Instant,
    method: String,
    path: String,
    query: String,
}

/// A stand-in Fly API on loopback: records every request on tokio's clock
/// and answers the n-th (from 0) as `answer(n, path)` says.
struct StandIn {
    url: String,
    arrivals: Arc<std::sync::Mutex<Vec<Arrival>>>,
    task: tokio::task::JoinHandle<()>,
}

impl StandIn {
    async fn start(answer: impl Fn(usize, &str) -> Answer + Send + Sync + 'static) -> StandIn {
        let arrivals: Arc<std::sync::Mutex<Vec<Arrival>>> = Arc::default();
        let answer = Arc::new(answer);
        let seen = arrivals.clone();
        let handler = move |req: axum::extract::Request| {
            let (seen, answer) = (seen.clone(), answer.clone());
            async move {
                let path = req.uri().path().to_string();
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(Arrival {
                        at: tokio::time::Instant::now(),
                        method: req.method().to_string(),
                        path: path.clone(),
                        query: req.uri().query().unwrap_or("").to_string(),
                    });
                    seen.len() - 1
                };
                match answer(n, &path) {
                    Answer::Hang => std::future::pending().await,
                    Answer::Status(status, retry_after, body) => {
                        let mut resp = axum::response::Response::builder()
                            .status(status)
                            .header("content-type", "application/json");
                        if let Some(ra) = retry_after {
                            resp = resp.header("retry-after", ra);
                        }
                        resp.body(axum::body::Body::from(body)).unwrap()
                    }
                }
            }
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, axum::Router::new().fallback(handler)).await;
        });
        StandIn {
            url,
            arrivals,
            task,
        }
    }

    fn arrivals(&self) -> Vec<Arrival> {
        self.arrivals.lock().unwrap().clone()
    }

    fn client(&self) -> FlyClient {
        FlyClient::new(FlyClientConfig::new(&self.url), TOKEN).unwrap()
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A hung Fly API: the one attempt is cut at the deadline (not after the
/// 30 s request timeout), nothing is retried, and a call made at or after
/// the deadline is never sent.
#[tokio::test(start_paused = true)]
async fn a_call_within_a_deadline_is_cut_at_it_and_never_retried_past_it() {
    let api = StandIn::start(|_, _| Answer::Hang).await;
    let fly = api.client();
    let start = tokio::time::Instant::now();
    let deadline = start + Duration::from_secs(5);
    let err = fly
        .within(deadline)
        .cordon(&"agents".into(), &"m1".into(), None)
        .await
        .unwrap_err();
    let ended = tokio::time::Instant::now();
    let late: Vec<_> = api
        .arrivals()
        .into_iter()
        .filter(|a| a.at >= deadline)
        .collect();
    assert!(
        late.is_empty(),
        "requests sent after the deadline: {late:?}"
    );
    let arrivals = api.arrivals();
    assert_eq!(arrivals.len(), 1, "one attempt, no retry");
    assert_eq!(
        (arrivals[0].method.as_str(), arrivals[0].path.as_str()),
        ("POST", "/v1/apps/agents/machines/m1/cordon")
    );
    assert!(
        ended <= deadline + Duration::from_millis(50),
        "the call returned {:?} after its deadline",
        ended - deadline
    );
    // The cordon may have landed: its outcome is unknown, not a plain failure.
    assert_eq!(err.kind(), "outcome_unknown", "{err}");
    assert!(err.to_string().contains("m1"), "{err}");

    // At or after the deadline nothing is sent at all.
    let err = fly
        .within(deadline)
        .get_machine(&"agents".into(), &"m1".into())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, FlyError::PastDeadline { op: "get_machine", machine: Some(m), .. } if m == "m1"),
        "{err}"
    );
    assert_eq!(err.kind(), "past_deadline");
    assert_eq!(api.arrivals().len(), 1);
    // A nested deadline keeps the earlier one.
    let err = fly
        .within(deadline)
        .within(deadline + Duration::from_secs(60))
        .list_machines(&"agents".into())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "past_deadline", "{err}");
    assert_eq!(api.arrivals().len(), 1);
}

/// A 429 whose `Retry-After` ends past the deadline ends the call at once,
/// typed, with the wait Fly asked for; nothing is sent again.
#[tokio::test(start_paused = true)]
async fn a_retry_after_beyond_the_deadline_ends_the_call_at_once() {
    let api = StandIn::start(|_, _| {
        Answer::Status(429, Some("10"), r#"{"error":"rate limit exceeded"}"#.into())
    })
    .await;
    let fly = api.client();
    let start = tokio::time::Instant::now();
    let deadline = start + Duration::from_secs(3);
    let err = fly
        .within(deadline)
        .restart(&"agents".into(), &"m1".into(), None, None)
        .await
        .unwrap_err();
    assert!(
        tokio::time::Instant::now() - start < Duration::from_secs(1),
        "slept {:?} before giving up",
        tokio::time::Instant::now() - start
    );
    let arrivals = api.arrivals();
    assert!(arrivals.iter().all(|a| a.at < deadline), "{arrivals:?}");
    assert_eq!(arrivals.len(), 1, "{arrivals:?}");
    // No `timeout` given: none sent, so Fly uses the app's kill_timeout.
    assert_eq!(arrivals[0].query, "");
    assert!(
        matches!(&err, FlyError::RateLimited { op: "restart", retry_after: Some(d), .. } if *d == Duration::from_secs(10)),
        "{err:?}"
    );
    assert_eq!(err.kind(), "rate_limited");
    assert!(err.to_string().contains("m1"), "{err}");
}

/// A 503 is retried while the backoff ends before the deadline, and the
/// retry that would cross it is not made: the error it got is returned.
#[tokio::test(start_paused = true)]
async fn a_retry_that_would_cross_the_deadline_is_not_made() {
    let api =
        StandIn::start(|_, _| Answer::Status(503, None, r#"{"error":"unavailable"}"#.into())).await;
    let mut config = FlyClientConfig::new(&api.url);
    // First retry after 1–2 s, the second 2–4 s later: always past 3 s.
    config.base_backoff = Duration::from_secs(2);
    config.max_backoff = Duration::from_secs(60);
    let fly = FlyClient::new(config, TOKEN).unwrap();
    let start = tokio::time::Instant::now();
    let deadline = start + Duration::from_secs(3);
    let err = fly
        .within(deadline)
        .list_machines(&"agents".into())
        .await
        .unwrap_err();
    assert!(
        tokio::time::Instant::now() < deadline,
        "returned at the deadline, not before"
    );
    let arrivals = api.arrivals();
    assert!(arrivals.iter().all(|a| a.at < deadline), "{arrivals:?}");
    assert_eq!(arrivals.len(), 2, "one try and one retry: {arrivals:?}");
    assert!(matches!(err, FlyError::Status { status: 503, .. }), "{err}");

    // Without a deadline, the same client retries as before.
    let err = fly.list_machines(&"agents".into()).await.unwrap_err();
    assert!(matches!(err, FlyError::Status { status: 503, .. }), "{err}");
    assert_eq!(api.arrivals().len(), 2 + 5, "1 try + 4 retries");
}

// ---- client-side rate limits ------------------------------------------------------

fn ok_json(body: &str) -> Answer {
    Answer::Status(200, None, body.to_string())
}

/// Answers any action with `{}` and a get with a started machine.
fn fly_ok(_: usize, path: &str) -> Answer {
    if path.ends_with("/cordon") || path.ends_with("/uncordon") {
        ok_json("{}")
    } else {
        let id = path.rsplit('/').next().unwrap_or("m");
        ok_json(&format!(
            r#"{{"id":"{id}","state":"started","config":{{"metadata":{{}}}}}}"#
        ))
    }
}

/// Seconds from `start` at which `path` was requested, in order.
fn offsets(api: &StandIn, start: tokio::time::Instant, path: &str) -> Vec<f64> {
    api.arrivals()
        .iter()
        .filter(|a| a.path == path)
        .map(|a| (a.at - start).as_secs_f64())
        .collect()
}

/// Ten cordons of one machine at once go out as Fly's limits allow (three
/// at once, then one a second); another machine, and another action on the
/// same machine, have their own buckets; gets have the 5/s, burst 10 limit.
#[tokio::test(start_paused = true)]
async fn a_burst_on_one_machine_is_spaced_as_flys_limits_say() {
    let api = StandIn::start(fly_ok).await;
    let fly = api.client();
    let start = tokio::time::Instant::now();
    let (agents, m1, m2) = (
        AppName::from("agents"),
        MachineId::from("m1"),
        MachineId::from("m2"),
    );
    let cordons = (0..10)
        .map(|_| fly.cordon(&agents, &m1, None).boxed())
        .chain((0..3).map(|_| fly.cordon(&agents, &m2, None).boxed()))
        .chain((0..3).map(|_| fly.uncordon(&agents, &m1, None).boxed()));
    for r in futures::future::join_all(cordons).await {
        r.unwrap();
    }
    let m1 = offsets(&api, start, "/v1/apps/agents/machines/m1/cordon");
    assert_eq!(m1.len(), 10);
    for (i, at) in m1.iter().enumerate() {
        // The i-th request (from 0) no sooner than i − 2 seconds in.
        let earliest = i.saturating_sub(2) as f64;
        assert!(
            *at >= earliest - 0.001 && *at < earliest + 0.1,
            "cordon {i} of m1 at {at:.3}s, expected {earliest}s: {m1:?}"
        );
    }
    for path in [
        "/v1/apps/agents/machines/m2/cordon",
        "/v1/apps/agents/machines/m1/uncordon",
    ] {
        let seen = offsets(&api, start, path);
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|at| *at < 0.1), "{path}: {seen:?}");
    }

    // Gets: ten at once, then one every 200 ms.
    let start = tokio::time::Instant::now();
    let m3 = MachineId::from("m3");
    let gets = (0..15).map(|_| fly.get_machine(&agents, &m3));
    for r in futures::future::join_all(gets).await {
        r.unwrap();
    }
    let gets = offsets(&api, start, "/v1/apps/agents/machines/m3");
    assert_eq!(gets.len(), 15);
    for (i, at) in gets.iter().enumerate() {
        let earliest = i.saturating_sub(9) as f64 * 0.2;
        assert!(
            *at >= earliest - 0.001 && *at < earliest + 0.1,
            "get {i} at {at:.3}s, expected {earliest}s: {gets:?}"
        );
    }

    // Switched off, nothing waits.
    let mut config = FlyClientConfig::new(&api.url);
    config.rate_limits = None;
    let free = FlyClient::new(config, TOKEN).unwrap();
    let start = tokio::time::Instant::now();
    let m4 = MachineId::from("m4");
    for r in futures::future::join_all((0..6).map(|_| free.cordon(&agents, &m4, None))).await {
        r.unwrap();
    }
    let m4 = offsets(&api, start, "/v1/apps/agents/machines/m4/cordon");
    assert!(m4.len() == 6 && m4.iter().all(|at| *at < 0.1), "{m4:?}");
}

/// A token that would come at or after the deadline is not waited for: the
/// call ends at once as rate limited, nothing sent; the buckets are shared
/// by every clone of the client.
#[tokio::test(start_paused = true)]
async fn a_token_past_the_deadline_ends_the_call_unsent() {
    let api = StandIn::start(fly_ok).await;
    let fly = api.client();
    let start = tokio::time::Instant::now();
    let deadline = start + Duration::from_millis(1500);
    let leased = fly.within(deadline);
    for _ in 0..4 {
        // Three at once and one at 1 s: all before the deadline.
        leased
            .cordon(&"agents".into(), &"m1".into(), None)
            .await
            .unwrap();
    }
    let before = tokio::time::Instant::now();
    let err = leased
        .cordon(&"agents".into(), &"m1".into(), None)
        .await
        .unwrap_err();
    assert_eq!(
        tokio::time::Instant::now(),
        before,
        "waited for a token it could not use"
    );
    assert!(
        matches!(&err, FlyError::RateLimited { op: "cordon", machine: Some(m), retry_after: Some(_), .. } if m == "m1"),
        "{err:?}"
    );
    let m1 = offsets(&api, start, "/v1/apps/agents/machines/m1/cordon");
    assert_eq!(m1.len(), 4, "{m1:?}");
    assert!(m1.iter().all(|at| *at < 1.5), "{m1:?}");
    // Another clone without a deadline shares the bucket: it waits its turn (2 s).
    fly.cordon(&"agents".into(), &"m1".into(), None)
        .await
        .unwrap();
    let m1 = offsets(&api, start, "/v1/apps/agents/machines/m1/cordon");
    assert!((m1[4] - 2.0).abs() < 0.1, "{m1:?}");
}

// ---- 429s and lease answers ------------------------------------------------------

/// A 429 that outlasts the retries ends the call as `RateLimited`, with
/// Fly's `Retry-After` when it sent one; an acquire answered 429 is one too
/// (the executor skips the step rather than failing it).
#[tokio::test(start_paused = true)]
async fn a_429_that_outlasts_the_retries_is_rate_limited() {
    for (retry_after, expected) in [(None, None), (Some("2"), Some(Duration::from_secs(2)))] {
        let api = StandIn::start(move |_, _| {
            Answer::Status(429, retry_after, r#"{"error":"rate limited"}"#.into())
        })
        .await;
        let mut config = FlyClientConfig::new(&api.url);
        config.max_retries = 2;
        let fly = FlyClient::new(config, TOKEN).unwrap();
        let err = fly
            .acquire_lease(
                &"agents".into(),
                &"m1".into(),
                Duration::from_secs(13),
                "rotation",
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, FlyError::RateLimited { op: "acquire_lease", machine: Some(m), retry_after, .. }
                if m == "m1" && *retry_after == expected),
            "{err:?}"
        );
        assert_eq!(err.kind(), "rate_limited");
        assert_eq!(api.arrivals().len(), 3, "1 try + 2 retries");
    }
}

/// flyctl's rule: a refresh answered with another nonce, or none, is a
/// lost lease; the same nonce is ours, extended.
#[tokio::test(start_paused = true)]
async fn a_refresh_answered_with_another_nonce_is_a_lost_lease() {
    let api = StandIn::start(|n, _| match n {
        0 => ok_json(r#"{"status":"success","data":{"nonce":"nonce-a","expires_at":100}}"#),
        1 => ok_json(r#"{"status":"success","data":{"nonce":"nonce-a","expires_at":200}}"#),
        2 => ok_json(r#"{"status":"success","data":{"expires_at":300}}"#),
        _ => ok_json(r#"{"status":"success","data":{"nonce":"nonce-b","expires_at":400}}"#),
    })
    .await;
    let fly = api.client();
    let ttl = Duration::from_secs(13);
    let lease = fly
        .acquire_lease(&"agents".into(), &"m1".into(), ttl, "r")
        .await
        .unwrap();
    assert_eq!(lease.nonce.expose_secret(), "nonce-a");
    let l = fly
        .refresh_lease(&"agents".into(), &"m1".into(), &lease.nonce, ttl, "r")
        .await
        .unwrap();
    assert_eq!((l.nonce.expose_secret(), l.expires_at), ("nonce-a", 200));
    // A success without our nonce (#32 item 13 f: flyctl compares the
    // answer's nonce with its own, so none is not ours), then another nonce.
    for _ in 0..2 {
        let err = fly
            .refresh_lease(&"agents".into(), &"m1".into(), &lease.nonce, ttl, "r")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, FlyError::LeaseNonceChanged { op: "refresh_lease", machine, .. } if machine == "m1"),
            "{err:?}"
        );
        assert_eq!(err.kind(), "lease_nonce_changed");
        assert!(
            !err.to_string().contains("nonce-"),
            "a nonce is never shown: {err}"
        );
    }
}

/// Restart's `timeout` overrides the app's `kill_timeout` at Fly: sent only
/// when the caller gives one, so `None` leaves the app's own stop timeout.
#[tokio::test(start_paused = true)]
async fn restart_sends_a_timeout_only_when_given() {
    let api = StandIn::start(|_, _| ok_json("{}")).await;
    let fly = api.client();
    fly.restart(&"agents".into(), &"m1".into(), None, None)
        .await
        .unwrap();
    fly.restart(
        &"agents".into(),
        &"m1".into(),
        Some(Duration::from_secs(300)),
        None,
    )
    .await
    .unwrap();
    let queries: Vec<(String, String)> = api
        .arrivals()
        .into_iter()
        .map(|a| (a.path, a.query))
        .collect();
    let path = "/v1/apps/agents/machines/m1/restart".to_string();
    assert_eq!(
        queries,
        [(path.clone(), String::new()), (path, "timeout=300s".into())]
    );
}

// ---- the sweep against a host outage ------------------------------------------------

/// A machine as Fly lists it, stopped (so it is not probed).
fn listed(id: &str, host: &str, metadata: &str) -> String {
    let config = if host == "ok" {
        "config"
    } else {
        "incomplete_config"
    };
    format!(
        r#"{{"id":"{id}","name":"{id}","state":"stopped","host_status":"{host}","{config}":{{"metadata":{metadata}}}}}"#
    )
}

/// Defect 11, observe side: a machine whose host Fly cannot reach is
/// reported as such, and never as "no hold, no marker, pool default": its
/// pool comes from the coordinator's slot set when a slot names it, else
/// its pool and restraining controls (hold, marker) are carried from its
/// last listing; an approval is never carried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_on_an_unreachable_host_keeps_its_pool_and_controls_unknown_not_empty() {
    use fleet_reconciler::daemon::{self, Secrets};
    use fleet_reconciler::decide::listings::LastListings;
    use fleet_reconciler::decide::planner::Tracker;
    use fleet_reconciler::decide::policy::Policy;
    use fleet_reconciler::decide::prepare;
    use fleet_reconciler::metadata::{APPROVE_KEY, HOLD_KEY, SLOTS_KEY};

    let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let outage = down.clone();
    let slots = serde_json::json!({
        "version": 1,
        "pools": {"agents/dispatch": [{"machine_id": "m3", "tag": "t3", "owner": "r1", "since": "2026-12-01T00:00:00Z"}]}
    })
    .to_string();
    let coordinator = listed(
        "c0",
        "ok",
        &serde_json::json!({ SLOTS_KEY: slots }).to_string(),
    );
    let api = StandIn::start(move |_, path| {
        if path == "/v1/apps/coord/machines/c0" {
            return ok_json(&coordinator);
        }
        let host = if outage.load(Ordering::SeqCst) { "unreachable" } else { "ok" };
        let m2 = serde_json::json!({"pool": "dispatch", HOLD_KEY: "ops: incident 7", APPROVE_KEY: "not an approval"});
        // m3's host is always down and it was never listed otherwise.
        ok_json(&format!(
            "[{},{},{}]",
            listed("m1", "ok", r#"{"pool":"dispatch"}"#),
            listed("m2", host, &m2.to_string()),
            listed("m3", "unreachable", "{}"),
        ))
    })
    .await;
    let overlay = crate::common::OverlayRepo::new();
    let text = overlay
        .config(&api.url, "mirror.git")
        .app("agents", None)
        .with("pool_key = \"pool\"\n[rotation]\ncoordinator = \"coord/c0\"")
        .text();
    let config = Arc::new(
        fleet_reconciler::config::Config::parse(std::path::Path::new("t.toml"), &text).unwrap(),
    );
    let secrets = Secrets {
        fly_token: TOKEN.into(),
        git_token: None,
        record_keys: Some(fleet_reconciler::sim::record_keys()),
    };
    let sweeper = within(daemon::connect(config, &secrets)).await.unwrap();
    // Swept and prepared as the loop does, with its memory of listings.
    let policy = Policy::from_config(&sweeper.config);
    let tip = within(sweeper.overlay.fetch()).await.unwrap();
    let (mut listings, mut tracker) = (LastListings::default(), Tracker::default());
    let first_at = chrono::Utc::now();
    let observed = within(sweeper.sweep(&tip)).await.unwrap();
    let first = prepare(&policy, observed, &mut listings, &mut tracker, first_at);
    let m2 = first
        .machines
        .iter()
        .find(|m| m.seen.machine_id == MachineId::from("m2"))
        .unwrap();
    assert!(m2.seen.inputs.metadata_unknown().is_none());
    assert!(m2.seen.inputs.controls.is_held());

    down.store(true, Ordering::SeqCst);
    let observed = within(sweeper.sweep(&tip)).await.unwrap();
    let second = prepare(
        &policy,
        observed,
        &mut listings,
        &mut tracker,
        chrono::Utc::now(),
    );
    let row = |id: &str| {
        let id = MachineId::from(id);
        second
            .machines
            .iter()
            .find(|m| m.seen.machine_id == id)
            .unwrap()
    };
    let m2 = row("m2");
    assert!(m2.seen.inputs.metadata_unknown().is_some());
    assert!(
        m2.seen.inputs.metadata.is_empty(),
        "unknown metadata is never read"
    );
    assert_eq!(
        m2.seen.pool.as_str(),
        "dispatch",
        "the pool as last listed, not default"
    );
    assert!(m2.seen.inputs.controls.is_held(), "the hold as last listed");
    assert!(
        m2.seen.inputs.controls.approval.is_none(),
        "an approval is never carried"
    );
    let detail = m2.seen.detail.clone().unwrap_or_default();
    assert!(
        detail.contains("host") && detail.contains("last listed"),
        "{detail}"
    );
    let m3 = row("m3");
    assert_eq!(
        m3.seen.pool.as_str(),
        "dispatch",
        "the pool its coordinator slot names"
    );
    let detail = m3.seen.detail.clone().unwrap_or_default();
    assert!(
        detail.contains("host") && detail.contains("slot"),
        "{detail}"
    );
    // The machine whose host is fine is unaffected.
    let m1 = row("m1");
    assert!(m1.seen.inputs.metadata_unknown().is_none() && m1.seen.detail.is_none());
}

/// #22 soak: a burst of calls (a release wave's steps) opens as many
/// connections as calls in flight; afterwards only a few stay open. Before,
/// every one stayed idle in the pool with its buffers for 90 s, so a daemon
/// sweeping more often than that kept them all.
#[tokio::test]
async fn a_burst_of_calls_leaves_only_a_few_connections_open() {
    // (open now, most open at once); each answer held back a moment so the
    // burst's calls overlap.
    let open = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let addr = crate::common::counting_server(
        r#"{"id":"m1","name":"n","state":"started","region":"iad"}"#,
        Duration::from_millis(200),
        open.clone(),
    )
    .await;
    let url = format!("http://{addr}");
    let mut config = FlyClientConfig::new(&url);
    config.rate_limits = None;
    let fly = FlyClient::new(config, TOKEN).unwrap();
    let app = AppName::from("agents");
    let calls = (0..32).map(|i| {
        let (fly, app) = (&fly, &app);
        async move {
            fly.get_machine(app, &MachineId::from(format!("m{i}")))
                .await
        }
    });
    let answers = within(futures::future::join_all(calls)).await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    assert!(
        open.1.load(Ordering::SeqCst) > 8,
        "the burst overlapped: {} connections at once",
        open.1.load(Ordering::SeqCst)
    );
    crate::common::eventually(
        "at most 8 connections left open",
        Duration::from_secs(10),
        async || open.0.load(Ordering::SeqCst) <= 8,
    )
    .await;
}

// ---- #32 item 13: where Fly answers differently from what was assumed -------

/// A 408 may have had its effect ("the side-effect may or may not have
/// happened", flyctl `internal/flapsutil/retry.go`): a write answered 408
/// is unanswered, and an unsafe one (restart, lease acquire) is not
/// repeated; a safe one is retried as after a timeout. `wait`'s 408 stays
/// "not yet", and is no unanswered write.
#[tokio::test(start_paused = true)]
async fn item13a_a_408_on_a_write_is_unanswered_and_an_unsafe_one_is_not_repeated() {
    let api =
        StandIn::start(|_, _| Answer::Status(408, None, r#"{"error":"request timed out"}"#.into()))
            .await;
    let (app, m1) = (AppName::from("agents"), MachineId::from("m1"));
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fly = api.client().noting_unanswered(flag.clone());
    let raised = || flag.swap(false, std::sync::atomic::Ordering::SeqCst);

    let err = fly.restart(&app, &m1, None, None).await.unwrap_err();
    assert!(
        matches!(&err, FlyError::OutcomeUnknown { op: "restart", .. }),
        "{err:?}"
    );
    assert!(raised(), "a restart answered 408 may have landed");
    assert_eq!(api.arrivals().len(), 1, "never repeated");

    let err = fly
        .acquire_lease(&app, &m1, Duration::from_secs(13), "r")
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            FlyError::OutcomeUnknown {
                op: "acquire_lease",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(raised());
    assert_eq!(api.arrivals().len(), 2, "never repeated");

    // A safe write is retried (1 try + 4 retries), and still unanswered.
    let err = fly.cordon(&app, &m1, None).await.unwrap_err();
    assert!(
        matches!(&err, FlyError::Status { status: 408, .. }),
        "{err:?}"
    );
    assert!(raised());
    assert_eq!(api.arrivals().len(), 2 + 5);

    // `wait` answered 408 is "not yet", not a write that may have landed.
    let err = fly
        .wait(&app, &m1, WaitState::Started, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(&err, FlyError::WaitTimeout { .. }), "{err:?}");
    assert!(!raised());
}

/// Fly documents 1 list request a second per app, burst 3: a client's
/// lists of one app are spaced so; another app has its own bucket.
#[tokio::test(start_paused = true)]
async fn item13g_lists_keep_to_flys_per_app_limit() {
    let api = StandIn::start(|_, _| ok_json("[]")).await;
    let fly = api.client();
    let start = tokio::time::Instant::now();
    let (agents, batch) = (AppName::from("agents"), AppName::from("batch"));
    let lists = (0..6)
        .map(|_| fly.list_machines(&agents))
        .chain((0..3).map(|_| fly.list_machines(&batch)));
    for r in futures::future::join_all(lists).await {
        r.unwrap();
    }
    let agents = offsets(&api, start, "/v1/apps/agents/machines");
    assert_eq!(agents.len(), 6);
    for (i, at) in agents.iter().enumerate() {
        let earliest = i.saturating_sub(2) as f64;
        assert!(
            *at >= earliest - 0.001 && *at < earliest + 0.1,
            "list {i} at {at:.3}s, expected {earliest}s: {agents:?}"
        );
    }
    let batch = offsets(&api, start, "/v1/apps/batch/machines");
    assert!(
        batch.len() == 3 && batch.iter().all(|at| *at < 0.1),
        "{batch:?}"
    );
}

/// A 409 says why (a lease held by someone): its `message`, its `error`,
/// or both, are kept in the error.
#[tokio::test(start_paused = true)]
async fn item13j_a_409_keeps_flys_message() {
    let api = StandIn::start(|n, _| {
        let body = match n {
            0 => r#"{"message":"lease currently held by deploy@example.com"}"#,
            1 => r#"{"error":"aborted","message":"lease currently held by ops"}"#,
            _ => r#"{"error":"aborted: lease held"}"#,
        };
        Answer::Status(409, None, body.into())
    })
    .await;
    let fly = api.client();
    for expected in [
        "lease currently held by deploy@example.com",
        "aborted: lease currently held by ops",
        "aborted: lease held",
    ] {
        let err = fly
            .acquire_lease(&"agents".into(), &"m1".into(), Duration::from_secs(13), "r")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, FlyError::LeaseConflict { message, .. } if message == expected),
            "{err:?}"
        );
        assert!(err.to_string().contains(expected), "{err}");
    }
}

/// fly-go tells the machines of one-off commands apart (`fly console`,
/// release commands): a listing leaves them out, they are no agents.
#[tokio::test]
async fn item13h_console_and_release_command_machines_are_not_listed() {
    let sim = Sim::start(
        SimFleet::new(TOKEN).release_tip(TIP).app(
            SimApp::new("agents")
                .machine(SimMachine::new("m1"))
                .machine(
                    SimMachine::new("console").metadata("fly_process_group", "fly_app_console"),
                )
                .machine(
                    SimMachine::new("release")
                        .metadata("fly_process_group", "fly_app_release_command"),
                )
                // Without the Apps platform's version it is not one of fly-go's.
                .machine(
                    SimMachine::new("legacy")
                        .metadata("fly_platform_version", "v1")
                        .metadata("fly_process_group", "fly_app_console"),
                ),
        ),
    )
    .await
    .unwrap();
    let fly = client(&sim, TOKEN);
    let listed = within(fly.list_machines(&"agents".into())).await.unwrap();
    let mut ids: Vec<&str> = listed.iter().map(|m| m.id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["legacy", "m1"], "{ids:?}");
    // A get names it still (it is the caller's to judge).
    within(fly.get_machine(&"agents".into(), &"console".into()))
        .await
        .unwrap();
    sim.shutdown().await;
}

/// A refresh sent after our lease lapsed: Fly (the sim, as its module says)
/// takes a new lease for the stale nonce and answers with another nonce,
/// which is not ours (flyctl's rule).
#[tokio::test]
async fn item13f_a_refresh_after_the_lease_lapsed_is_a_lost_lease() {
    let sim = sim().await;
    let fly = client(&sim, TOKEN);
    let (app, m1) = (AppName::from("agents"), MachineId::from("m1"));
    let lease = within(fly.acquire_lease(&app, &m1, Duration::from_secs(5), "r"))
        .await
        .unwrap();
    sim.advance_clock(Duration::from_secs(6));
    let err = within(fly.refresh_lease(&app, &m1, &lease.nonce, Duration::from_secs(5), "r"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            FlyError::LeaseNonceChanged {
                op: "refresh_lease",
                ..
            }
        ),
        "{err:?}"
    );
    sim.shutdown().await;
}

//! The prober against a purpose-built agent server on loopback: concurrency
//! bound, connection reuse, body cap without buffering, whole-exchange deadline.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Path, State};
use axum::routing::get;
use fleet_reconciler::config::ProbeConfig;
use fleet_reconciler::observe::probe::{ProbeOutcome, Prober};

use crate::common::within;

#[derive(Default)]
struct Stats {
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    peers: Mutex<HashSet<SocketAddr>>,
    streamed: AtomicUsize,
    auth_headers: AtomicUsize,
}

async fn agent(
    State(stats): State<Arc<Stats>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path((kind, _n)): Path<(String, String)>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    if headers.contains_key("authorization") {
        stats.auth_headers.fetch_add(1, Ordering::SeqCst);
    }
    stats.peers.lock().unwrap().insert(peer);
    match kind.as_str() {
        "slow" => {
            let now = stats.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            stats.max_in_flight.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(30)).await;
            stats.in_flight.fetch_sub(1, Ordering::SeqCst);
            axum::response::Response::new(Body::from(r#"{"overlay_ref":"abcd1234"}"#))
        }
        "endless" => {
            // Never ends: a client that buffers the rest would never return.
            let stats = stats.clone();
            let stream = futures::stream::unfold(0u64, move |n| {
                let stats = stats.clone();
                async move {
                    stats.streamed.fetch_add(4096, Ordering::SeqCst);
                    let chunk = if n == 0 {
                        format!(
                            "{{\"overlay_ref\":\"abcd1234\",\"pad\":\"{}",
                            "x".repeat(4000)
                        )
                    } else {
                        "x".repeat(4096)
                    };
                    Some((Ok::<_, std::io::Error>(chunk), n + 1))
                }
            });
            axum::response::Response::new(Body::from_stream(stream))
        }
        "trickle" => {
            // Headers at once, then one byte every 100 ms: only a whole-exchange deadline stops it.
            let stream = futures::stream::unfold(0u32, |n| async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Some((
                    Ok::<_, std::io::Error>(if n == 0 {
                        "{".to_string()
                    } else {
                        " ".to_string()
                    }),
                    n + 1,
                ))
            });
            axum::response::Response::new(Body::from_stream(stream))
        }
        "error" => axum::response::Response::builder()
            .status(503)
            .body(Body::from("draining"))
            .unwrap(),
        _ => axum::response::Response::new(Body::from(r#"{"overlay_ref":"abcd1234"}"#)),
    }
}

async fn server() -> (String, Arc<Stats>) {
    let stats = Arc::new(Stats::default());
    let app = Router::new()
        .route("/{kind}/{n}/health", get(agent))
        .with_state(stats.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    (format!("http://{addr}"), stats)
}

fn prober(concurrency: usize, timeout: Duration, max_body: usize) -> Prober {
    Prober::new(&ProbeConfig {
        timeout: fleet_reconciler::config::NonZeroDuration::new(timeout).unwrap(),
        concurrency: NonZeroUsize::new(concurrency).unwrap(),
        max_body_bytes: NonZeroUsize::new(max_body).unwrap(),
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_is_bounded_and_connections_reused() {
    let (base, stats) = server().await;
    let p = prober(4, Duration::from_secs(5), 65536);
    let urls: Vec<String> = (0..40).map(|i| format!("{base}/slow/{i}/health")).collect();
    let out = within(p.probe_all(urls)).await;
    assert_eq!(out.len(), 40);
    assert!(
        out.iter()
            .all(|o| matches!(o, ProbeOutcome::Report(r) if &*r.overlay_ref == "abcd1234"))
    );
    let max = stats.max_in_flight.load(Ordering::SeqCst);
    assert!(max <= 4, "at most 4 in flight, saw {max}");
    assert!(max >= 2, "probes actually ran concurrently, saw {max}");
    let connections = stats.peers.lock().unwrap().len();
    assert!(
        connections <= 8,
        "connections are pooled: {connections} for 40 probes"
    );
    // Health GETs never carry credentials.
    assert_eq!(stats.auth_headers.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_cap_stops_reading_an_endless_body() {
    let (base, stats) = server().await;
    let p = prober(1, Duration::from_secs(10), 16384);
    let outcome = within(p.probe(&format!("{base}/endless/0/health"))).await;
    match outcome {
        ProbeOutcome::BadReport(why) => assert!(why.contains("16384"), "{why}"),
        other => panic!("expected bad_report, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let streamed = stats.streamed.load(Ordering::SeqCst);
    assert!(
        streamed < 4 * 1024 * 1024,
        "stopped reading early, server produced {streamed} bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_covers_the_whole_exchange() {
    let (base, _) = server().await;
    let p = prober(1, Duration::from_millis(400), 65536);
    let started = std::time::Instant::now();
    let outcome = within(p.probe(&format!("{base}/trickle/0/health"))).await;
    assert!(
        matches!(outcome, ProbeOutcome::Unreachable(ref why) if why.contains("400ms")),
        "{outcome:?}"
    );
    // The trickle never ends: only the 400 ms deadline can stop it this soon.
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_errors_and_refused_connections_are_unreachable() {
    let (base, _) = server().await;
    let p = prober(2, Duration::from_secs(2), 65536);
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let out = within(p.probe_all(vec![
        format!("{base}/error/0/health"),
        format!("http://127.0.0.1:{port}/health"),
        format!("{base}/ok/1/health"),
    ]))
    .await;
    assert!(
        matches!(&out[0], ProbeOutcome::Unreachable(why) if why.contains("503")),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(&out[1], ProbeOutcome::Unreachable(why) if why.contains("connection")),
        "{:?}",
        out[1]
    );
    assert!(
        matches!(&out[2], ProbeOutcome::Report(_)),
        "order is kept: {:?}",
        out[2]
    );
}

/// `hosts` agents, each its own listener on loopback (a host of its own, as
/// each agent is on 6PN), speaking just enough HTTP/1.1 to answer a report
/// on a kept-alive connection. Counts the connections open now and at most.
async fn many_agents(hosts: usize) -> (Vec<String>, Arc<(AtomicUsize, AtomicUsize)>) {
    slow_agents(hosts, Duration::ZERO).await
}

/// [`many_agents`] answering each request `delay` after it came, so that
/// a sweep's requests overlap.
async fn slow_agents(
    hosts: usize,
    delay: Duration,
) -> (Vec<String>, Arc<(AtomicUsize, AtomicUsize)>) {
    let open = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let mut urls = Vec::new();
    for _ in 0..hosts {
        let addr =
            crate::common::counting_server(r#"{"overlay_ref":"abcd1234"}"#, delay, open.clone())
                .await;
        urls.push(format!("http://{addr}/health"));
    }
    (urls, open)
}

/// #22: `probe.concurrency` bounds the connections of a whole sweep, not
/// only the requests in flight. Before, every agent's connection stayed
/// open (idle in the pool) after the sweep: one socket per agent, over a
/// common 1,024 open-file limit at a few thousand agents.
#[tokio::test]
async fn a_sweep_of_more_hosts_than_the_budget_keeps_no_connection_open() {
    let (urls, open) = many_agents(120).await;
    let prober = Prober::new(&ProbeConfig {
        concurrency: NonZeroUsize::new(8).unwrap(),
        ..ProbeConfig::default()
    })
    .unwrap();
    let outcomes = within(prober.probe_all(urls)).await;
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, ProbeOutcome::Report(_))),
        "{:?}",
        outcomes
            .iter()
            .find(|o| !matches!(o, ProbeOutcome::Report(_)))
    );
    // The server sees a close a moment after the client made it, while the
    // next connection may already be open: its count lags by up to one
    // connection per slot.
    assert!(
        open.1.load(Ordering::SeqCst) <= 2 * 8,
        "{} connections open at once",
        open.1.load(Ordering::SeqCst)
    );
    crate::common::eventually(
        "every agent connection closed",
        Duration::from_secs(10),
        async || open.0.load(Ordering::SeqCst) == 0,
    )
    .await;
    // Hosts that fit the budget keep their connections for the next sweep.
    let (few, open) = many_agents(4).await;
    within(prober.probe_all(few.clone())).await;
    within(prober.probe_all(few)).await;
    assert_eq!(open.0.load(Ordering::SeqCst), 4, "reused, kept open");
}

/// #22: hosts that fit the budget share it: all of them together keep at
/// most `probe.concurrency` connections open after a sweep. Before, each
/// host could keep the whole budget idle: the first host's connections
/// stayed while the second opened its own, twice the budget kept for 90 s.
#[tokio::test]
async fn hosts_that_fit_the_budget_share_it_between_sweeps() {
    let (hosts, open) = slow_agents(2, Duration::from_millis(50)).await;
    let prober = Prober::new(&ProbeConfig {
        concurrency: NonZeroUsize::new(8).unwrap(),
        ..ProbeConfig::default()
    })
    .unwrap();
    // The first host's agents, then the second's: each has the whole
    // budget in flight in turn.
    let urls: Vec<String> = hosts
        .iter()
        .flat_map(|h| std::iter::repeat_n(h.clone(), 24))
        .collect();
    let outcomes = within(prober.probe_all(urls)).await;
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, ProbeOutcome::Report(_))),
        "{outcomes:?}"
    );
    assert!(
        open.1.load(Ordering::SeqCst) > 8,
        "each host had the budget in flight: {} connections at most",
        open.1.load(Ordering::SeqCst)
    );
    crate::common::eventually(
        "at most the budget (8) left open",
        Duration::from_secs(10),
        async || open.0.load(Ordering::SeqCst) <= 8,
    )
    .await;
    // The next sweep reuses what was kept.
    within(prober.probe_all(hosts.clone())).await;
    assert!(open.0.load(Ordering::SeqCst) <= 8);
}

/// #35 item 6: a process that sweeps once (`check`, `plan`) closes its
/// connections when the probes are done: kept idle, their buffers were a
/// third of `check`'s heap at its peak (the analysis and the judged rows
/// come after the probes), and no later sweep reuses them.
#[tokio::test]
async fn a_prober_for_one_sweep_keeps_no_connection_after_its_probes() {
    let (few, open) = many_agents(4).await;
    let prober = Prober::new(&ProbeConfig {
        concurrency: NonZeroUsize::new(8).unwrap(),
        ..ProbeConfig::default()
    })
    .unwrap();
    let once = prober.once();
    let outcomes = within(once.probe_all(few.clone())).await;
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, ProbeOutcome::Report(_))),
        "{outcomes:?}"
    );
    crate::common::eventually(
        "every agent connection closed after the sweep",
        Duration::from_secs(10),
        async || open.0.load(Ordering::SeqCst) == 0,
    )
    .await;
    // The prober it was made from still keeps its own for the next sweep.
    within(prober.probe_all(few.clone())).await;
    within(prober.probe_all(few)).await;
    assert_eq!(open.0.load(Ordering::SeqCst), 4, "reused, kept open");
}

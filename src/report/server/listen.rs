//! The accept loop: HTTP/1.1 connections served by hyper with the limits of
//! [`ServerLimits`], instead of `axum::serve`, which has no header-read
//! timeout and no connection limit.
//!
//! * `server.max_connections` is a semaphore taken per accepted connection
//!   and held until it closes. Over the limit a connection is not queued: it
//!   gets a short 503 (written without waiting, so best effort) and is closed
//!   at once, counted in `fleet_reconciler_http_connections_rejected_total` and logged
//!   at most once per [`REJECTION_LOG_EVERY`]. Waiting instead would let the
//!   clients that hold the slots also hold the ones queued behind them.
//! * `server.header_read_timeout` is hyper's: a request's headers (the first
//!   on a connection, or the next one on a kept-alive connection) must have
//!   arrived within it, else the connection is closed. That bounds both a
//!   client that sends half a header and an idle keep-alive connection.
//! * The request timeout and the body limit are middleware of the router.
//!
//! On shutdown the listener is closed, each connection finishes the request
//! it is serving (idle ones close at once), and connections still open
//! after the longest a request may take are dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower_service::Service;

use super::{ServerLimits, ServerState, router};

/// At most one "connection refused" warning per this long.
pub const REJECTION_LOG_EVERY: Duration = Duration::from_secs(10);

/// What a connection over the limit is sent before it is closed.
const OVER_CAPACITY: &str = concat!(
    "HTTP/1.1 503 Service Unavailable\r\n",
    "content-type: application/json\r\n",
    "retry-after: 1\r\n",
    "connection: close\r\n",
    "content-length: 69\r\n",
    "\r\n",
    "{\"error\":\"too many connections open (server.max_connections); retry\"}"
);

/// Serves until `shutdown`, then lets in-flight requests finish.
pub async fn serve(
    listener: TcpListener,
    state: ServerState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let limits = state.limits.clone();
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(
            %addr,
            max_connections = limits.max_connections,
            header_read_timeout = %humantime::format_duration(limits.header_read_timeout),
            request_timeout = %humantime::format_duration(limits.request_timeout),
            "HTTP server listening"
        );
    }
    let metrics = state.metrics.clone();
    let app = router(state);
    let slots = Arc::new(Semaphore::new(
        limits.max_connections.clamp(1, Semaphore::MAX_PERMITS),
    ));
    let mut last_rejection_log: Option<Instant> = None;
    let mut rejected_since_log = 0u64;
    let mut connections = JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of file descriptors, typically: wait rather than spin.
                    tracing::error!(error = %e, "cannot accept a connection; retrying in 1 s");
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.record_connection_rejected();
            rejected_since_log += 1;
            let now = Instant::now();
            if last_rejection_log.is_none_or(|t| now.duration_since(t) >= REJECTION_LOG_EVERY) {
                tracing::warn!(
                    source = %peer.ip(),
                    max_connections = limits.max_connections,
                    refused = rejected_since_log,
                    "HTTP connection refused: server.max_connections are open \
                     (further refusals in the next 10s are only counted)"
                );
                last_rejection_log = Some(now);
                rejected_since_log = 0;
            }
            // Never waits: a client that does not read cannot hold the loop.
            let _ = stream.try_write(OVER_CAPACITY.as_bytes());
            drop(stream);
            continue;
        };
        let (app, limits, stop) = (app.clone(), limits.clone(), shutdown.clone());
        connections.spawn(async move {
            connection(stream, peer, app, &limits, stop).await;
            drop(slot);
        });
    }
    drop(listener);

    let drain = limits.request_timeout.max(limits.header_read_timeout) + Duration::from_secs(1);
    let open = connections.len();
    let drained = tokio::time::timeout(drain, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open,
            left = connections.len(),
            "HTTP connections still open {} after shutdown; closing them",
            humantime::format_duration(drain)
        );
        connections.shutdown().await;
    }
    Ok(())
}

/// Serves one connection; on `shutdown`, finishes the request in flight.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: &ServerLimits,
    shutdown: CancellationToken,
) {
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        app.clone().call(req)
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        // A header-read timeout, a client gone mid-request, a bad request:
        // the client's problem, and hyper has answered what it could.
        tracing::debug!(source = %peer.ip(), error = %e, "HTTP connection closed");
    }
}

/// Errors of one connection that `accept` reports; the listener is fine.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_over_capacity_answer_is_well_formed() {
        let (head, body) = OVER_CAPACITY.split_once("\r\n\r\n").unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(len, body.len());
        assert!(serde_json::from_str::<serde_json::Value>(body).is_ok());
    }
}

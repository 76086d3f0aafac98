//! A fleet's read-only answers rendered once and served as bytes, as a web
//! server serves static files: the loopback reference for benchmarks.
//!
//! [`super::Sim::freeze`] asks the live simulator, through its own router
//! (front door included), for every app's machine list and every agent's
//! health report, and keeps each answer's status, content type and body;
//! [`FrozenFleet::serve`] then answers a `GET` of one of those paths with
//! those bytes and nothing else: no lock, no JSON written per request, no
//! token check. So what a client reads is what the live simulator answered
//! at that instant (heartbeats and busy periods included, frozen there).
//!
//! What it must never do: change state (it answers `GET` only, anything
//! else 405), answer a path it did not render (404), or stand in for the
//! simulator in a test of behaviour: it has no clock, faults or audit.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower_service::Service;

use super::fixture::Behaviour;
use super::http::router;
use super::state::Shared;
use super::wire::{api_url, health_url, health_url_template};

/// The largest answer kept (a list of 10,000 machines is a few MiB).
const MAX_FROZEN_ANSWER: usize = 512 * 1024 * 1024;

/// Why a fleet could not be frozen.
#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    #[error("machine {machine_id}'s agent hangs: its answer cannot be rendered once")]
    Hangs { machine_id: String },
    #[error("the simulator's answer to GET {path} could not be read: {message}")]
    Unreadable { path: String, message: String },
}

/// One rendered answer.
#[derive(Clone, Debug)]
struct Answer {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    body: Bytes,
}

/// Every list and health answer of a fleet, by request path.
#[derive(Clone, Debug)]
pub struct FrozenFleet {
    answers: Arc<HashMap<String, Answer>>,
}

impl FrozenFleet {
    /// Renders `/v1/apps/{app}/machines` for every app (with `token` as a
    /// Fly client sends it) and `/agents/{id}/health` for every machine.
    pub(crate) async fn render(shared: &Arc<Shared>) -> Result<FrozenFleet, FreezeError> {
        let (token, paths) = {
            let world = shared.lock();
            if let Some(m) = world
                .machines
                .values()
                .find(|m| matches!(m.agent.behaviour, Behaviour::Hang))
            {
                return Err(FreezeError::Hangs {
                    machine_id: m.id.clone(),
                });
            }
            let lists = world
                .apps
                .keys()
                .map(|app| path_of(&["v1", "apps", app, "machines"]));
            let agents = world
                .apps
                .values()
                .flatten()
                .map(|id| path_of(&["agents", id, "health"]));
            (world.token.clone(), lists.chain(agents).collect::<Vec<_>>())
        };
        let mut live = router(Arc::clone(shared));
        let mut answers = HashMap::with_capacity(paths.len());
        for path in paths {
            let unreadable = |message: String| FreezeError::Unreadable {
                path: path.clone(),
                message,
            };
            let request = Request::builder()
                .uri(path.as_str())
                .header(header::AUTHORIZATION, format!("Bearer {token}"))
                .body(Body::empty())
                .map_err(|e| unreadable(e.to_string()))?;
            let response = live
                .call(request)
                .await
                .map_err(|e| unreadable(e.to_string()))?;
            let status = response.status();
            let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
            let body = to_bytes(response.into_body(), MAX_FROZEN_ANSWER)
                .await
                .map_err(|e| unreadable(e.to_string()))?;
            answers.insert(
                path,
                Answer {
                    status,
                    content_type,
                    body,
                },
            );
        }
        Ok(FrozenFleet {
            answers: Arc::new(answers),
        })
    }

    /// Paths it answers.
    pub fn len(&self) -> usize {
        self.answers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.answers.is_empty()
    }

    /// Every path it answers with the status and body it answers with (for
    /// a bench that writes them out as files for a static-file server).
    pub fn answers(&self) -> impl Iterator<Item = (&str, u16, &[u8])> {
        self.answers
            .iter()
            .map(|(path, a)| (path.as_str(), a.status.as_u16(), &a.body[..]))
    }

    /// The body it answers to `GET path`, if it answers that path.
    pub fn body(&self, path: &str) -> Option<&[u8]> {
        self.answers.get(path).map(|a| &a.body[..])
    }

    /// Binds `127.0.0.1:0` and serves the answers until shutdown. Must run
    /// inside a tokio runtime.
    pub async fn serve(self) -> io::Result<FrozenServer> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let cancel = CancellationToken::new();
        let app = Router::new().fallback(answer).with_state(self);
        let stop = cancel.clone();
        let server = tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
            if let Err(error) = served {
                tracing::warn!(%error, "frozen fleet server stopped with an error");
            }
        });
        Ok(FrozenServer {
            addr,
            cancel,
            server: Some(server),
        })
    }
}

/// The path a client sends for these segments (each percent-encoded, as
/// the Fly client and the prober's URL template do).
fn path_of(segments: &[&str]) -> String {
    let mut url = url::Url::parse("http://127.0.0.1/").unwrap_or_else(|_| unreachable!());
    if let Ok(mut path) = url.path_segments_mut() {
        path.pop_if_empty().extend(segments);
    }
    url.path().to_string()
}

async fn answer(State(fleet): State<FrozenFleet>, request: Request) -> Response {
    let (status, content_type, body) = if request.method() != Method::GET {
        (StatusCode::METHOD_NOT_ALLOWED, None, Bytes::new())
    } else {
        match fleet.answers.get(request.uri().path()) {
            Some(a) => (a.status, a.content_type.clone(), a.body.clone()),
            None => (StatusCode::NOT_FOUND, None, Bytes::new()),
        }
    };
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    if let Some(t) = content_type {
        response.headers_mut().insert(header::CONTENT_TYPE, t);
    }
    response
}

/// A running [`FrozenFleet`]. Dropping it stops the server.
#[derive(Debug)]
pub struct FrozenServer {
    addr: SocketAddr,
    cancel: CancellationToken,
    server: Option<JoinHandle<()>>,
}

impl FrozenServer {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL of the Fly API lists, without `/v1` (clients append it).
    pub fn api_url(&self) -> String {
        api_url(self.addr)
    }

    /// Health URL template for the daemon's app config.
    pub fn health_url_template(&self) -> String {
        health_url_template(self.addr)
    }

    /// Health URL of one machine's agent.
    pub fn health_url(&self, machine_id: &str) -> String {
        health_url(self.addr, machine_id)
    }

    /// Stops accepting and lets requests in flight finish.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }
}

impl Drop for FrozenServer {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

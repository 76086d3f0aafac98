//! A reference agent: the smallest process that meets fleet-reconciler's agent contract.
//!
//! It serves what `docs/agent-contract.md` asks of an agent (docs/design.md §4):
//!
//! * `GET /health`: the overlay commit it loaded, whether a turn is in
//!   progress, its live work, its last input and a heartbeat, the optional
//!   endpoints it serves, and its drain state. Never behind a token.
//! * `POST /overlay/drain {"rotation": TAG}`: take a fence (refuse new work),
//!   write a checkpoint once the work in progress is done, then report
//!   `rotation.fenced = true, rotation.checkpoint = TAG` and `activity = idle`.
//! * `POST /overlay/undrain {"rotation": TAG}`: release that rotation's fence.
//! * `POST /overlay/reload {"ref": SHA}`: load that overlay commit in place at
//!   the next natural stop point (now, if idle); the next health report shows it.
//!
//! With `AGENT_CONTROL_TOKEN` set, the three cooperative endpoints require
//! `Authorization: Bearer <token>`; `/health` never does.
//!
//! The "work" is simulated: `POST /work?secs=N` starts a job that runs for N
//! seconds (a turn of a conversation, a dispatched task). A fenced agent
//! refuses it with 503, as a real agent refuses new sessions while draining.
//!
//! It listens on `[::]:8080` by default: on Fly the reconciler reaches agents
//! over the IPv6 private network (`<machine_id>.vm.<app>.internal`), which an
//! IPv4-only listener (`0.0.0.0`) never answers.
//!
//! ```sh
//! cargo run --example agent -- --overlay-ref "$(git -C ../overlay rev-parse HEAD)"
//! curl -s localhost:8080/health
//! curl -s -XPOST 'localhost:8080/work?secs=30'
//! curl -s -XPOST localhost:8080/overlay/drain -d '{"rotation":"r1"}'
//! ```
//!
//! On start it prints one line to stdout, `listening on http://ADDR`, so a
//! supervisor (or a test) that asked for port 0 learns the port.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use clap::Parser;
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq as _;

#[derive(Parser, Debug)]
#[command(
    name = "agent",
    about = "Reference agent for fleet-reconciler's agent contract"
)]
struct Args {
    /// Address to listen on. Keep `[::]` on Fly: 6PN is IPv6-only.
    #[arg(long, env = "AGENT_LISTEN", default_value = "[::]:8080")]
    listen: SocketAddr,
    /// The overlay commit this process loaded at start (hex, 4 to 40 digits).
    #[arg(long, env = "OVERLAY_REF")]
    overlay_ref: String,
    /// Bearer token required on drain/undrain/reload (never on /health).
    #[arg(long, env = "AGENT_CONTROL_TOKEN", hide_env_values = true)]
    control_token: Option<String>,
    /// Where checkpoints are written; without it they are kept in memory only.
    #[arg(long, env = "AGENT_CHECKPOINT_DIR")]
    checkpoint_dir: Option<PathBuf>,
}

/// What a `GET /health` answers (docs/design.md §4).
#[derive(Serialize)]
struct HealthReport {
    overlay_ref: String,
    activity: &'static str,
    live_sessions: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_input_at: Option<DateTime<Utc>>,
    heartbeat_at: DateTime<Utc>,
    capabilities: [&'static str; 2],
    rotation: RotationReport,
}

#[derive(Serialize)]
struct RotationReport {
    fenced: bool,
    checkpoint: Option<String>,
}

/// The agent's mutable state; one lock, never held across an `.await`.
#[derive(Debug)]
struct AgentState {
    /// The overlay commit in use.
    overlay_ref: String,
    /// A reload accepted while busy, applied when the last job ends.
    pending_reload: Option<String>,
    /// Jobs in progress: the work a restart would interrupt.
    jobs: u64,
    last_input_at: Option<DateTime<Utc>>,
    /// The rotation tag whose fence is up.
    fence: Option<String>,
    /// The rotation tag whose checkpoint has been written (only under its fence).
    checkpoint: Option<String>,
}

struct Agent {
    state: Mutex<AgentState>,
    control_token: Option<String>,
    checkpoint_dir: Option<PathBuf>,
}

impl Agent {
    fn lock(&self) -> MutexGuard<'_, AgentState> {
        // The state stays consistent under every early return; a panic in
        // another handler is no reason to stop answering health checks.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// At a natural stop point (no job in progress): apply a deferred reload,
    /// and write the checkpoint the fence is waiting for.
    fn at_stop_point(&self, state: &mut AgentState) {
        if state.jobs > 0 {
            return;
        }
        if let Some(commit) = state.pending_reload.take() {
            tracing::info!(%commit, "overlay reloaded in place");
            state.overlay_ref = commit;
        }
        if let Some(tag) = state.fence.clone()
            && state.checkpoint.as_deref() != Some(tag.as_str())
        {
            match self.write_checkpoint(&tag, state) {
                Ok(()) => {
                    tracing::info!(rotation = %tag, "checkpoint written");
                    state.checkpoint = Some(tag);
                }
                // Not reported: the reconciler keeps waiting, and yields at
                // its checkpoint deadline instead of restarting on a lie.
                Err(error) => tracing::error!(rotation = %tag, %error, "cannot write checkpoint"),
            }
        }
    }

    /// Persists what a restarted process needs to resume. A real agent saves
    /// its conversations here; this one saves its overlay ref and the tag.
    fn write_checkpoint(&self, tag: &str, state: &AgentState) -> std::io::Result<()> {
        let Some(dir) = &self.checkpoint_dir else {
            return Ok(());
        };
        let safe: String = tag
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let body = serde_json::json!({
            "rotation": tag,
            "overlay_ref": state.overlay_ref,
            "written_at": Utc::now(),
        });
        std::fs::create_dir_all(dir)?;
        // Small and rare: a blocking write under the lock keeps the fence and
        // the checkpoint consistent without an async filesystem.
        std::fs::write(
            dir.join(format!("checkpoint-{safe}.json")),
            body.to_string(),
        )
    }

    fn rotation(state: &AgentState) -> RotationReport {
        RotationReport {
            fenced: state.fence.is_some(),
            checkpoint: state.checkpoint.clone(),
        }
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(expected) = &self.control_token else {
            return true;
        };
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        presented.as_bytes().ct_eq(expected.as_bytes()).into()
    }
}

fn is_hex_ref(s: &str) -> bool {
    (4..=40).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

fn unauthorized() -> Response {
    let mut response = error(StatusCode::UNAUTHORIZED, "agent control token required");
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

async fn health(State(agent): State<Arc<Agent>>) -> Json<HealthReport> {
    let state = agent.lock();
    Json(HealthReport {
        overlay_ref: state.overlay_ref.clone(),
        activity: if state.jobs > 0 { "busy" } else { "idle" },
        live_sessions: state.jobs,
        last_input_at: state.last_input_at,
        heartbeat_at: Utc::now(),
        capabilities: ["drain", "reload"],
        rotation: Agent::rotation(&state),
    })
}

#[derive(Deserialize)]
struct WorkQuery {
    #[serde(default)]
    secs: f64,
}

/// The simulated workload: a job of `secs` seconds, refused while fenced.
async fn work(State(agent): State<Arc<Agent>>, Query(q): Query<WorkQuery>) -> Response {
    if !q.secs.is_finite() || !(0.0..=86_400.0).contains(&q.secs) {
        return error(StatusCode::BAD_REQUEST, "secs must be between 0 and 86400");
    }
    {
        let mut state = agent.lock();
        if let Some(tag) = &state.fence {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("draining for rotation {tag}: not accepting new work"),
            );
        }
        state.jobs += 1;
        state.last_input_at = Some(Utc::now());
    }
    let worker = Arc::clone(&agent);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs_f64(q.secs)).await;
        let mut state = worker.lock();
        state.jobs -= 1;
        worker.at_stop_point(&mut state);
    });
    (
        StatusCode::ACCEPTED,
        Json(serde_json::json!({ "accepted": true, "secs": q.secs })),
    )
        .into_response()
}

#[derive(Deserialize)]
struct RotationRequest {
    rotation: Option<String>,
}

/// The rotation tag of a drain/undrain body; the error is the 400 message.
fn rotation_tag(body: &[u8]) -> Result<String, String> {
    let request: RotationRequest =
        serde_json::from_slice(body).map_err(|e| format!("bad JSON body: {e}"))?;
    request
        .rotation
        .filter(|t| !t.is_empty())
        .ok_or_else(|| "`rotation` (the rotation tag) is required".to_string())
}

/// Takes the fence of rotation `tag`. A fence of another rotation is
/// replaced: the new rotation's checkpoint is written afresh.
async fn drain(State(agent): State<Arc<Agent>>, headers: HeaderMap, body: Bytes) -> Response {
    if !agent.authorized(&headers) {
        return unauthorized();
    }
    let tag = match rotation_tag(&body) {
        Ok(tag) => tag,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let mut state = agent.lock();
    if state.fence.as_deref() != Some(tag.as_str()) {
        tracing::info!(rotation = %tag, jobs = state.jobs, "fence up: refusing new work");
        state.fence = Some(tag);
        state.checkpoint = None;
    }
    agent.at_stop_point(&mut state);
    Json(serde_json::json!({ "ok": true, "rotation": Agent::rotation(&state) })).into_response()
}

/// Releases the fence of rotation `tag`; idempotent. Another rotation's
/// fence is not the caller's to release (409).
async fn undrain(State(agent): State<Arc<Agent>>, headers: HeaderMap, body: Bytes) -> Response {
    if !agent.authorized(&headers) {
        return unauthorized();
    }
    let tag = match rotation_tag(&body) {
        Ok(tag) => tag,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let mut state = agent.lock();
    if let Some(held) = state.fence.as_deref().filter(|held| *held != tag) {
        return error(
            StatusCode::CONFLICT,
            format!("fence held by rotation {held}"),
        );
    }
    if state.fence.take().is_some() {
        tracing::info!(rotation = %tag, "fence released: accepting work");
    }
    state.checkpoint = None;
    Json(serde_json::json!({ "ok": true, "rotation": Agent::rotation(&state) })).into_response()
}

#[derive(Deserialize)]
struct ReloadRequest {
    #[serde(rename = "ref")]
    commit: Option<String>,
}

/// Accepts (202) a reload; it happens at the next stop point, and only a
/// later health report of the new ref proves it.
async fn reload(State(agent): State<Arc<Agent>>, headers: HeaderMap, body: Bytes) -> Response {
    if !agent.authorized(&headers) {
        return unauthorized();
    }
    let request: ReloadRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad JSON body: {e}")),
    };
    let Some(commit) = request.commit.filter(|c| is_hex_ref(c)) else {
        return error(
            StatusCode::BAD_REQUEST,
            "`ref` must be a hex commit id (4 to 40 digits)",
        );
    };
    let commit = commit.to_ascii_lowercase();
    let mut state = agent.lock();
    state.pending_reload = Some(commit.clone());
    agent.at_stop_point(&mut state);
    (
        StatusCode::ACCEPTED,
        Json(serde_json::json!({ "ok": true, "ref": commit })),
    )
        .into_response()
}

fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/work", post(work))
        .route("/overlay/drain", post(drain))
        .route("/overlay/undrain", post(undrain))
        .route("/overlay/reload", post(reload))
        .with_state(agent)
}

async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {},
        () = terminate => {},
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if !is_hex_ref(&args.overlay_ref) {
        eprintln!(
            "error: --overlay-ref {:?} is not a hex commit id (4 to 40 digits)",
            args.overlay_ref
        );
        return std::process::ExitCode::from(2);
    }
    let agent = Arc::new(Agent {
        state: Mutex::new(AgentState {
            overlay_ref: args.overlay_ref.to_ascii_lowercase(),
            pending_reload: None,
            jobs: 0,
            last_input_at: None,
            fence: None,
            checkpoint: None,
        }),
        control_token: args.control_token.filter(|t| !t.is_empty()),
        checkpoint_dir: args.checkpoint_dir,
    });
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on {}: {e}", args.listen);
            return std::process::ExitCode::from(2);
        }
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "listening on http://{addr}");
    let _ = stdout.flush();
    tracing::info!(%addr, token = agent.control_token.is_some(), "agent serving");
    match axum::serve(listener, router(agent))
        .with_graceful_shutdown(shutdown_signal())
        .await
    {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

//! Handlers for the simulated agents: `GET /agents/{id}/health` and the
//! cooperative `POST /agents/{id}/overlay/{drain,undrain,reload}` (docs/design.md §4).
//!
//! An agent on a machine that is not `started` answers 503: on Fly its
//! `.vm.<app>.internal` name would not resolve, and 503 is the closest an
//! in-process server can come to "unreachable" while staying observable.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::fixture::{Behaviour, CAP_DRAIN, CAP_RELOAD};
use super::machine::{MachineState, RefField, RotationReport, STARTED};
use super::state::{Shared, Step, schedule};
use super::wire::{ApiError, RequestSeq, agent_token_matches, header_str, parse_json};

/// What a [`Behaviour::Garbage`] agent answers: an HTML error page under a JSON content type.
const GARBAGE_BODY: &str = "<html><body><h1>502 Bad Gateway</h1></body></html>";
const PADDING_CHUNK: usize = 64 * 1024;
/// 24 chunks of 64 KiB: 1.5 MiB of padding, well past any sane report limit.
const PADDING_CHUNKS: usize = 24;
static PADDING: [u8; PADDING_CHUNK] = [b'x'; PADDING_CHUNK];

/// A handler's decision, taken under the lock; hanging happens after it is released.
enum Outcome {
    Respond(Response),
    Hang,
}

impl From<ApiError> for Outcome {
    fn from(e: ApiError) -> Outcome {
        Outcome::Respond(e.into_response())
    }
}

async fn finish(shared: &Shared, outcome: Outcome) -> Response {
    match outcome {
        Outcome::Respond(response) => response,
        Outcome::Hang => {
            // Never answer while the simulator runs; let graceful shutdown complete.
            shared.cancel.cancelled().await;
            ApiError::unavailable("simulator shutting down").into_response()
        }
    }
}

fn json_body(body: String) -> Outcome {
    Outcome::Respond(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

pub(crate) async fn health(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let outcome = {
        let world = shared.lock();
        let now = world.now();
        match world.machines.get(&id) {
            None => ApiError::not_found(format!("no agent for machine {id}")).into(),
            Some(m) if !m.agent_reachable() => unreachable_agent(m).into(),
            Some(m) => health_outcome(m, now),
        }
    };
    finish(&shared, outcome).await
}

impl MachineState {
    /// The agent answers only on a started machine whose host is up and
    /// whose process is not crash-looping.
    fn agent_reachable(&self) -> bool {
        self.state == STARTED && self.host_ok() && !self.crash_loop
    }
}

fn unreachable_agent(m: &MachineState) -> ApiError {
    let why = if !m.host_ok() {
        format!("host {}", m.host_status.as_str())
    } else if m.crash_loop {
        "crash-looping".to_string()
    } else {
        m.state.clone()
    };
    ApiError::unavailable(format!("machine {} is {why}: agent unreachable", m.id))
}

fn health_outcome(m: &MachineState, now: DateTime<Utc>) -> Outcome {
    let agent = &m.agent;
    match &agent.behaviour {
        Behaviour::Hang => Outcome::Hang,
        Behaviour::HttpError(code) => ApiError::with_code(*code, "agent error").into(),
        Behaviour::Garbage => json_body(GARBAGE_BODY.to_string()),
        Behaviour::Oversized => Outcome::Respond(oversized(agent.reported_ref())),
        Behaviour::MissingRef => json_body(agent.report_json(now, RefField::Missing)),
        Behaviour::NonHexRef => json_body(agent.report_json(now, RefField::NonHex)),
        Behaviour::Normal | Behaviour::Busy { .. } | Behaviour::BusyFor(_) => {
            json_body(agent.report_json(now, RefField::Loaded))
        }
    }
}

/// A valid JSON report padded past 1 MiB and streamed without `Content-Length`,
/// so a client that trusts the header or buffers everything is caught.
fn oversized(reported_ref: &str) -> Response {
    let quoted = serde_json::to_string(reported_ref).unwrap_or_else(|_| "\"\"".to_string());
    let head =
        format!(r#"{{"overlay_ref":{quoted},"activity":"idle","live_sessions":0,"padding":""#);
    let chunks = std::iter::once(Bytes::from(head))
        .chain(std::iter::repeat_n(
            Bytes::from_static(&PADDING),
            PADDING_CHUNKS,
        ))
        .chain(std::iter::once(Bytes::from_static(b"\"}")));
    let stream = futures::stream::iter(chunks.map(Ok::<_, Infallible>));
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// What a cooperative handler's closure gets besides the machine.
struct AgentCtx {
    now: DateTime<Utc>,
    reload_delay: std::time::Duration,
}

/// The request a cooperative handler serves.
struct AgentCall<'a> {
    id: &'a str,
    headers: &'a HeaderMap,
    capability: &'a str,
    seq: RequestSeq,
    /// `POST overlay/drain`, ...: how the audit names the request.
    what: &'static str,
}

/// The checks every cooperative endpoint makes, in the order a real agent
/// would: machine exists, is running, is not hung or failing, serves the
/// endpoint (advertised capability), and the caller holds the agent token.
/// Then applies the endpoint and tells the audit (a fence takes the machine
/// out of its pool; any effect on a held machine is recorded).
fn cooperative(
    shared: &Shared,
    call: AgentCall<'_>,
    apply: impl FnOnce(&mut MachineState, &AgentCtx) -> Result<Response, ApiError>,
) -> Outcome {
    let AgentCall {
        id,
        headers,
        capability,
        seq: RequestSeq(seq),
        what,
    } = call;
    let mut guard = shared.lock();
    let world = &mut *guard;
    let ctx = AgentCtx {
        now: world.now(),
        reload_delay: world.reload_delay,
    };
    let Some(m) = world.machines.get_mut(id) else {
        return ApiError::not_found(format!("no agent for machine {id}")).into();
    };
    if !m.agent_reachable() {
        return unreachable_agent(m).into();
    }
    match m.agent.behaviour {
        Behaviour::Hang => return Outcome::Hang,
        Behaviour::HttpError(code) => return ApiError::with_code(code, "agent error").into(),
        _ => {}
    }
    if !m.agent.has(capability) {
        return ApiError::not_found("not found").into();
    }
    if let Some(i) = world.agent_failures.iter().position(|(m, endpoint, _)| {
        m == id && what.strip_prefix("POST overlay/") == Some(endpoint.as_str())
    }) {
        let (_, _, status) = world.agent_failures.remove(i);
        return ApiError::with_code(status, "injected agent failure").into();
    }
    if !agent_token_matches(
        m.agent.agent_token.as_deref(),
        header_str(headers, header::AUTHORIZATION.as_str()),
    ) {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized: agent token required",
        )
        .into();
    }
    let held = world.audit.as_ref().is_some_and(|a| a.held(m));
    let response = match apply(m, &ctx) {
        Ok(response) => response,
        Err(e) => return e.into(),
    };
    if let Some(audit) = world.audit.as_mut() {
        if held {
            audit.record_held_action(id, what, seq, ctx.now);
        }
        audit.observe(m, ctx.now);
    }
    Outcome::Respond(response)
}

#[derive(Deserialize)]
struct RotationRequest {
    rotation: Option<String>,
}

fn rotation_tag(body: &[u8]) -> Result<String, ApiError> {
    let request: RotationRequest = parse_json(body)?;
    request
        .rotation
        .filter(|t| !t.is_empty())
        .ok_or_else(|| ApiError::bad_request("rotation tag is required"))
}

#[derive(Serialize)]
struct FenceResponse<'a> {
    ok: bool,
    rotation: Option<RotationReport<'a>>,
}

fn fence_response(m: &MachineState, now: DateTime<Utc>) -> Response {
    Json(FenceResponse {
        ok: true,
        rotation: m.agent.rotation(now),
    })
    .into_response()
}

/// Takes the fence: the agent accepts no new work and reports the checkpoint
/// (and idle) once the work it already has is done.
pub(crate) async fn drain(
    State(shared): State<Arc<Shared>>,
    Extension(seq): Extension<RequestSeq>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = AgentCall {
        id: &id,
        headers: &headers,
        capability: CAP_DRAIN,
        seq,
        what: "POST overlay/drain",
    };
    let outcome = cooperative(&shared, call, |m, ctx| {
        m.agent.fence = Some(rotation_tag(&body)?);
        Ok(fence_response(m, ctx.now))
    });
    finish(&shared, outcome).await
}

/// Releases the fence of that rotation; idempotent, but a different rotation's
/// fence is not this caller's to release (409).
pub(crate) async fn undrain(
    State(shared): State<Arc<Shared>>,
    Extension(seq): Extension<RequestSeq>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = AgentCall {
        id: &id,
        headers: &headers,
        capability: CAP_DRAIN,
        seq,
        what: "POST overlay/undrain",
    };
    let outcome = cooperative(&shared, call, |m, ctx| {
        let tag = rotation_tag(&body)?;
        if let Some(held) = m.agent.fence.as_deref().filter(|held| *held != tag) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("fence held by rotation {held}"),
            ));
        }
        m.agent.fence = None;
        Ok(fence_response(m, ctx.now))
    });
    finish(&shared, outcome).await
}

#[derive(Deserialize)]
struct ReloadRequest {
    #[serde(rename = "ref")]
    commit: Option<String>,
}

/// Accepts (202) and loads the ref after the reload delay; success shows only
/// in a later health report, as the contract says.
pub(crate) async fn reload(
    State(shared): State<Arc<Shared>>,
    Extension(seq): Extension<RequestSeq>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = AgentCall {
        id: &id,
        headers: &headers,
        capability: CAP_RELOAD,
        seq,
        what: "POST overlay/reload",
    };
    let outcome = cooperative(&shared, call, |m, ctx| {
        let request: ReloadRequest = parse_json(&body)?;
        let commit = request
            .commit
            .filter(|c| !c.is_empty() && c.len() <= 40 && c.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| ApiError::bad_request("ref must be a hex commit id"))?;
        let steps = vec![(ctx.reload_delay, Step::Reload(commit.clone()))];
        schedule(&shared, m.id.clone(), m.generation, steps);
        let body = serde_json::json!({ "ok": true, "ref": commit });
        Ok((StatusCode::ACCEPTED, Json(body)).into_response())
    });
    finish(&shared, outcome).await
}

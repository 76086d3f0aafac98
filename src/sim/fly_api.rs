//! Handlers for the simulated Fly Machines API (`/v1/apps/{app}/machines/...`).
//!
//! Shapes follow the OpenAPI `Machine`, `WaitMachineResponse` and
//! `ErrorResponse` schemas; leases use the envelope the real API answers with
//! (docs/design.md §3), not the spec's flat `Lease`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::DateTime;
use chrono::Utc;
use serde::{Deserialize, Serialize};

use super::fixture::{HostDownMetadata, MetadataFencing};
use super::machine::{
    ExitEvent, Lease, MachineState, REPLACING, STARTED, STARTING, STOPPED, STOPPING, StopOutcome,
    add, new_nonce,
};
use super::state::{Shared, Step, World, schedule};
use super::wire::{ApiError, RequestSeq, lease_nonce, parse_json, parse_optional_json, rfc3339};
use crate::fly::WaitState;
use strum::VariantArray;

type SharedState = State<Arc<Shared>>;
type QueryMap = Query<HashMap<String, String>>;

/// TTL when the request names none; flyctl uses 13 s, Fly's own default is longer.
const DEFAULT_LEASE_TTL_SECS: u64 = 30;
/// `wait` timeout when the request names none (seconds), as on Fly.
const DEFAULT_WAIT_TIMEOUT_SECS: u64 = 60;
/// The states `wait?state=` accepts (Fly's specification lists them; the
/// client sends them as [`WaitState`]), comma-separated or repeated, and
/// whether a machine's state is one of them. `settled`: any state a
/// machine rests in, the others named and `failed`.
fn wait_states(q: &[(String, String)]) -> Result<Vec<WaitState>, ApiError> {
    let named: Vec<&str> = q
        .iter()
        .filter(|(k, _)| k == "state")
        .flat_map(|(_, v)| v.split(','))
        .collect();
    if named.is_empty() {
        return Ok(vec![WaitState::Started]);
    }
    named
        .into_iter()
        .map(|s| {
            s.parse::<WaitState>().map_err(|_| {
                let all: Vec<&str> = WaitState::VARIANTS.iter().map(|w| w.into()).collect();
                ApiError::bad_request(format!(
                    "invalid state {s:?}: expected one of {}",
                    all.join(", ")
                ))
            })
        })
        .collect()
}

fn reached(state: &str, wanted: &[WaitState]) -> bool {
    wanted.iter().any(|w| match w {
        WaitState::Settled => WaitState::VARIANTS
            .iter()
            .any(|r| *r != WaitState::Settled && state == <&str>::from(r)),
        w => state == <&str>::from(w),
    })
}

#[derive(Serialize)]
struct MachineJson<'a> {
    id: &'a str,
    name: &'a str,
    state: &'a str,
    region: &'a str,
    instance_id: &'a str,
    private_ip: &'a str,
    created_at: String,
    updated_at: String,
    host_status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    config: Option<ConfigJson<'a>>,
    /// Instead of `config` while the host is not `ok` (fly-go `GetConfig` falls back to it).
    #[serde(skip_serializing_if = "Option::is_none")]
    incomplete_config: Option<ConfigJson<'a>>,
    cordoned: bool,
    checks: Vec<CheckJson<'a>>,
    /// Newest first, as Fly lists them.
    events: Vec<EventJson>,
}

#[derive(Serialize)]
struct ConfigJson<'a> {
    image: &'a str,
    /// Absent from an `incomplete_config` under [`HostDownMetadata::Absent`].
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<BTreeMap<&'a str, &'a str>>,
    /// The checks the machine's config defines, by name (OpenAPI
    /// `fly.MachineConfig.checks`): one per check the machine reports.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    checks: BTreeMap<&'a str, CheckConfigJson>,
    /// The machine's stop timeout (`kill_timeout`), as Fly shows it.
    stop_config: StopConfigJson,
}

#[derive(Serialize)]
struct CheckConfigJson {
    #[serde(rename = "type")]
    kind: &'static str,
    port: u16,
    path: &'static str,
    interval: &'static str,
}

#[derive(Serialize)]
struct StopConfigJson {
    /// A Go duration, as the spec shows it (`"10s"`).
    timeout: String,
}

#[derive(Serialize)]
struct CheckJson<'a> {
    name: &'a str,
    status: &'static str,
    output: &'a str,
    updated_at: String,
}

#[derive(Serialize)]
struct EventJson {
    #[serde(rename = "type")]
    kind: &'static str,
    status: &'static str,
    source: &'static str,
    timestamp: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    request: Option<RequestJson>,
}

/// An event's `request` (fly-go `MachineRequest`): only its exit event.
#[derive(Serialize)]
struct RequestJson {
    exit_event: ExitEventJson,
}

#[derive(Serialize)]
struct ExitEventJson {
    exit_code: i64,
    restarting: bool,
    requested_stop: bool,
}

impl MachineState {
    /// `summary` drops `config` (and with it metadata), as the real API does.
    /// A host that is not `ok` shows `incomplete_config` with the metadata
    /// `shown` allows instead.
    fn json(&self, summary: bool, shown: HostDownMetadata) -> MachineJson<'_> {
        let all = || {
            self.metadata
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect()
        };
        let config_json = |metadata| ConfigJson {
            image: &self.image,
            metadata,
            checks: self
                .checks
                .iter()
                .map(|c| {
                    let check = CheckConfigJson {
                        kind: "http",
                        port: 8080,
                        path: "/health",
                        interval: "15s",
                    };
                    (c.name.as_str(), check)
                })
                .collect(),
            stop_config: StopConfigJson {
                timeout: format!("{}ms", self.kill_timeout.as_millis()),
            },
        };
        let (config, incomplete_config) = if summary {
            (None, None)
        } else if self.host_ok() {
            let config = config_json(Some(all()));
            (Some(config), None)
        } else {
            let metadata = match shown {
                HostDownMetadata::Absent => None,
                HostDownMetadata::Partial => Some(
                    self.metadata
                        .iter()
                        .filter(|(k, _)| k.starts_with("fly_"))
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect(),
                ),
            };
            (None, Some(config_json(metadata)))
        };
        MachineJson {
            id: &self.id,
            name: &self.name,
            state: &self.state,
            region: &self.region,
            instance_id: &self.instance_id,
            private_ip: &self.private_ip,
            created_at: rfc3339(self.created_at),
            updated_at: rfc3339(self.updated_at),
            host_status: self.host_status.as_str(),
            config,
            incomplete_config,
            cordoned: self.cordoned,
            checks: self
                .checks
                .iter()
                .map(|c| CheckJson {
                    name: &c.name,
                    status: c.status.as_str(),
                    output: &c.output,
                    // Fly's Go API writes RFC 3339 with fractions (Go's
                    // `time.Time` JSON): a result's freshness after a
                    // restart is judged to the millisecond.
                    updated_at: c
                        .updated_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                })
                .collect(),
            events: self
                .events
                .iter()
                .rev()
                .map(|e| EventJson {
                    kind: e.kind,
                    status: e.status,
                    source: e.source,
                    timestamp: e.timestamp,
                    request: e.exit.map(|x| RequestJson {
                        exit_event: ExitEventJson {
                            exit_code: x.exit_code,
                            restarting: x.restarting,
                            requested_stop: x.requested_stop,
                        },
                    }),
                })
                .collect(),
        }
    }

    /// A call that needs the machine's host answers 503 while it is down,
    /// without effect (see the module docs of `sim` for why that and not a hang).
    fn require_host(&self) -> Result<(), ApiError> {
        if self.host_ok() {
            Ok(())
        } else {
            Err(ApiError::unavailable(format!(
                "unavailable: host of machine {} is {}",
                self.id,
                self.host_status.as_str()
            )))
        }
    }
}

fn ok_json() -> Response {
    Json(serde_json::json!({ "ok": true })).into_response()
}

fn is_true(v: &str) -> bool {
    v.eq_ignore_ascii_case("true") || v == "1"
}

/// Splits a comma-separated filter; absent or empty means "no filter".
fn filter_list(q: &HashMap<String, String>, key: &str) -> Option<Vec<String>> {
    let values: Vec<String> = q
        .get(key)?
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    (!values.is_empty()).then_some(values)
}

pub(crate) async fn list_machines(
    State(shared): SharedState,
    Path(app): Path<String>,
    Query(q): QueryMap,
    Extension(RequestSeq(seq)): Extension<RequestSeq>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let summary = q.get("summary").is_some_and(|v| is_true(v));
    let states = filter_list(&q, "state");
    let regions = filter_list(&q, "region");
    let mut world = shared.lock();
    if !summary {
        let by = headers
            .get(axum::http::header::AUTHORIZATION)
            .map(|v| crate::metadata::value_fingerprint(&String::from_utf8_lossy(v.as_bytes())))
            .unwrap_or_default();
        let listing = super::socket_log::Listing { seq, by };
        let World {
            socket, machines, ..
        } = &mut *world;
        socket.observe_listing(&app, listing, machines);
    }
    let shown = world.host_down_metadata;
    let ids = world.apps.get(&app).ok_or_else(ApiError::app_not_found)?;
    let machines: Vec<MachineJson<'_>> = ids
        .iter()
        .filter_map(|id| world.machines.get(id))
        .filter(|m| states.as_ref().is_none_or(|s| s.contains(&m.state)))
        .filter(|m| regions.as_ref().is_none_or(|r| r.contains(&m.region)))
        .map(|m| m.json(summary, shown))
        .collect();
    Ok(Json(machines).into_response())
}

pub(crate) async fn get_machine(
    State(shared): SharedState,
    Path((app, id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let world = shared.lock();
    let m = world.machine(&app, &id)?;
    Ok(Json(m.json(false, world.host_down_metadata)).into_response())
}

/// What a mutating handler's closure gets besides the machine.
struct Ctx {
    now: DateTime<Utc>,
    restart_delay: Duration,
    /// Set by [`Ctx::take_down`]: the request takes the machine out of service.
    taken_down: Option<&'static str>,
    /// For a restart or stop: how long the machine waited after the signal
    /// before killing, and whether that cut the agent's checkpoint short.
    stop: Option<StopOutcome>,
    host_down_metadata: HostDownMetadata,
}

impl Ctx {
    /// Notes that `action` (restart, stop, update) takes the running machine
    /// down: it is out of its pool until it is `started` again, and the audit
    /// records the restart with the machine's state at this instant.
    fn take_down(&mut self, m: &mut MachineState, action: &'static str) {
        m.down_by_api = true;
        self.taken_down = Some(action);
    }
}

/// The request a mutating handler serves, for the lease check and the audit.
struct Call<'a> {
    app: &'a str,
    id: &'a str,
    headers: &'a HeaderMap,
    seq: RequestSeq,
    /// `POST cordon`, `DELETE metadata`, ...: how the audit names the request.
    what: &'static str,
    /// Metadata writes are lease-fenced only under [`MetadataFencing::FencedByLease`].
    metadata: bool,
}

/// Locks, finds the machine, enforces its lease, applies `f`, tells the audit
/// what happened, and wakes long-polls. Every mutating route goes through
/// here, so none can forget the lease check or escape the audit.
fn mutate<T>(
    shared: &Shared,
    call: Call<'_>,
    f: impl FnOnce(&mut MachineState, &mut Ctx) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    let result = {
        let mut world = shared.lock();
        let mut ctx = Ctx {
            now: world.now(),
            restart_delay: world.restart_delay,
            taken_down: None,
            stop: None,
            host_down_metadata: world.host_down_metadata,
        };
        let fenced = !call.metadata || world.metadata_fencing == MetadataFencing::FencedByLease;
        let (m, audit) = world.machine_and_audit(call.app, call.id)?;
        m.require_host()?;
        if fenced {
            m.check_lease(lease_nonce(call.headers), ctx.now)?;
        }
        // Taken before `f`: an update may replace the metadata, and the
        // audit wants the state the request acted on.
        let before = audit.as_deref().map(|a| a.snapshot(m, ctx.now));
        let result = f(m, &mut ctx)?;
        if let (Some(audit), Some(before)) = (audit, before) {
            let RequestSeq(seq) = call.seq;
            if before.held {
                audit.record_held_action(&m.id, call.what, seq, ctx.now);
            }
            if let Some(action) = ctx.taken_down {
                audit.record_restart(m, before, action, ctx.stop, seq, ctx.now);
            }
            audit.observe(m, ctx.now);
        }
        result
    };
    shared.notify();
    Ok(result)
}

#[derive(Deserialize, Default)]
struct UpdateMachineRequest {
    config: Option<UpdateConfig>,
    #[serde(default)]
    current_version: Option<String>,
}

#[derive(Deserialize)]
struct UpdateConfig {
    image: Option<String>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
}

/// `POST …/{id}`: replaces the config wholesale — as on Fly, metadata missing
/// from the new config is gone — and replaces a running machine, whose agent
/// comes back on the release tip.
pub(crate) async fn update_machine(
    State(shared): SharedState,
    Extension(seq): Extension<RequestSeq>,
    Path((app, id)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: UpdateMachineRequest = parse_json(&body)?;
    let config = request
        .config
        .ok_or_else(|| ApiError::bad_request("config is required"))?;
    let call = Call {
        app: &app,
        id: &id,
        headers: &headers,
        seq,
        what: "POST machine",
        metadata: false,
    };
    let (response, scheduled) = mutate(&shared, call, |m, ctx| {
        if let Some(version) = request.current_version.filter(|v| !v.is_empty())
            && version != m.instance_id
        {
            return Err(ApiError::precondition(format!(
                "machine version {version} is not the current version {}",
                m.instance_id
            )));
        }
        if let Some(image) = config.image {
            m.image = image;
        }
        m.metadata = config.metadata;
        m.bump_version(ctx.now);
        // Unknown on Fly whether a cordon survives an update: model that it does not.
        m.cordoned = false;
        m.event("update", "replacing", "user", ctx.now);
        let scheduled = if m.state == STARTED {
            ctx.take_down(m, "update");
            Some((m.transition(REPLACING, ctx.now), ctx.restart_delay))
        } else {
            None
        };
        Ok((
            Json(m.json(false, ctx.host_down_metadata)).into_response(),
            scheduled,
        ))
    })?;
    if let Some((generation, delay)) = scheduled {
        schedule(&shared, id, generation, vec![(delay, Step::Boot)]);
    }
    Ok(response)
}

/// `POST …/restart?timeout=&signal=`: `stopping` → `starting` → `started`
/// over the restart delay; the agent comes back on the release tip current at
/// that moment. The stop waits `timeout` (else the machine's `kill_timeout`)
/// after the signal before killing; an agent that needed longer to
/// checkpoint is recorded as killed before it could (the sim does not
/// stretch the delay by the wait: only the audit sees it).
pub(crate) async fn restart(
    State(shared): SharedState,
    Extension(seq): Extension<RequestSeq>,
    Path((app, id)): Path<(String, String)>,
    Query(q): QueryMap,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let timeout = q
        .get("timeout")
        .filter(|t| !t.is_empty())
        .map(|t| {
            parse_go_duration(t).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "invalid timeout {t:?}: expected a Go duration or seconds"
                ))
            })
        })
        .transpose()?;
    let call = Call {
        app: &app,
        id: &id,
        headers: &headers,
        seq,
        what: "POST restart",
        metadata: false,
    };
    let (generation, delay) = mutate(&shared, call, |m, ctx| {
        if m.state != STARTED {
            return Err(ApiError::precondition(format!(
                "failed_precondition: unable to restart machine {}: not currently started (state {})",
                m.id, m.state
            )));
        }
        m.restart_count += 1;
        ctx.stop = Some(stop_outcome(m, timeout));
        m.event("restart", "stopping", "user", ctx.now);
        // The process exits as asked; flyctl does not count it as a crash.
        m.exit_event("user", ExitEvent::RESTART, ctx.now);
        ctx.take_down(m, "restart");
        Ok((m.transition(STOPPING, ctx.now), ctx.restart_delay))
    })?;
    let half = delay / 2;
    let steps = vec![(half, Step::State(STARTING)), (delay - half, Step::Boot)];
    schedule(&shared, id, generation, steps);
    Ok(ok_json())
}

#[derive(Deserialize, Default)]
struct StopRequest {
    #[serde(default)]
    timeout: Option<serde_json::Value>,
}

/// The stop waits the request's timeout, else the machine's `kill_timeout`.
fn stop_outcome(m: &MachineState, timeout: Option<Duration>) -> StopOutcome {
    let timeout = timeout.unwrap_or(m.kill_timeout);
    StopOutcome {
        timeout,
        killed_before_checkpoint: timeout < m.checkpoint_on_stop,
    }
}

/// `"30s"`, `"1m30s"`, `"500ms"`, `"2h"` or plain seconds `"30"`, as Fly takes them.
pub(crate) fn parse_go_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit() && c != '.')?;
        let value: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            _ => return None,
        };
        total += Duration::try_from_secs_f64(value * scale).ok()?;
        rest = &rest[unit_len..];
    }
    Some(total)
}

/// `POST …/stop`: `stopping` → `stopped`. Stopping a stopped machine is a no-op.
pub(crate) async fn stop(
    State(shared): SharedState,
    Extension(seq): Extension<RequestSeq>,
    Path((app, id)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    // The signal does not matter to the sim; `timeout` (seconds or a Go
    // duration) bounds the agent's time to checkpoint, as on restart.
    let request: StopRequest = parse_optional_json(&body)?;
    let timeout = match request.timeout {
        None => None,
        Some(serde_json::Value::Number(n)) => n.as_u64().map(Duration::from_secs),
        Some(serde_json::Value::String(t)) => parse_go_duration(&t),
        Some(_) => None,
    };
    let call = Call {
        app: &app,
        id: &id,
        headers: &headers,
        seq,
        what: "POST stop",
        metadata: false,
    };
    let scheduled = mutate(&shared, call, |m, ctx| {
        if m.state == STOPPED {
            return Ok(None);
        }
        ctx.stop = Some(stop_outcome(m, timeout));
        m.event("stop", "stopping", "user", ctx.now);
        m.exit_event("user", ExitEvent::STOP, ctx.now);
        ctx.take_down(m, "stop");
        Ok(Some((
            m.transition(STOPPING, ctx.now),
            ctx.restart_delay / 2,
        )))
    })?;
    if let Some((generation, delay)) = scheduled {
        schedule(&shared, id, generation, vec![(delay, Step::State(STOPPED))]);
    }
    Ok(ok_json())
}

/// `POST …/start`: `starting` → `started` (the agent loads the release tip).
/// Starting a started or starting machine is a no-op; a machine on its way
/// down answers 412.
pub(crate) async fn start(
    State(shared): SharedState,
    Extension(seq): Extension<RequestSeq>,
    Path((app, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let call = Call {
        app: &app,
        id: &id,
        headers: &headers,
        seq,
        what: "POST start",
        metadata: false,
    };
    let (previous, scheduled) = mutate(&shared, call, |m, ctx| {
        let previous = m.state.clone();
        match previous.as_str() {
            STARTED | STARTING => Ok((previous, None)),
            STOPPED | "suspended" => Ok((
                previous,
                Some((m.transition(STARTING, ctx.now), ctx.restart_delay / 2)),
            )),
            other => Err(ApiError::precondition(format!(
                "failed_precondition: unable to start machine {} from state {other}",
                m.id
            ))),
        }
    })?;
    if let Some((generation, delay)) = scheduled {
        schedule(&shared, id, generation, vec![(delay, Step::Boot)]);
    }
    Ok(
        Json(serde_json::json!({ "previous_state": previous, "migrated": false, "new_host": "" }))
            .into_response(),
    )
}

/// `GET …/wait?state=&timeout=`: long-polls without holding the lock, woken
/// by every state change; 408 when the deadline passes first.
pub(crate) async fn wait(
    State(shared): SharedState,
    Path((app, id)): Path<(String, String)>,
    Query(q): Query<Vec<(String, String)>>,
) -> Result<Response, ApiError> {
    let wanted = wait_states(&q)?;
    let target = wanted
        .iter()
        .map(<&str>::from)
        .collect::<Vec<_>>()
        .join(", ");
    let timeout = q.iter().find(|(k, _)| k == "timeout").map(|(_, v)| v);
    let timeout_secs = match timeout {
        None => DEFAULT_WAIT_TIMEOUT_SECS,
        Some(t) => t.parse::<u64>().map_err(|_| {
            ApiError::bad_request(format!("invalid timeout {t:?}: expected seconds"))
        })?,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_secs);
    // Subscribe before checking, so a change between the check and the wait is not lost.
    let mut changes = shared.subscribe();
    loop {
        {
            let world = shared.lock();
            let m = world.machine(&app, &id)?;
            if reached(&m.state, &wanted) {
                let body =
                    serde_json::json!({ "ok": true, "state": m.state, "version": m.instance_id });
                return Ok(Json(body).into_response());
            }
        }
        tokio::select! {
            _ = shared.cancel.cancelled() => return Err(ApiError::unavailable("simulator shutting down")),
            changed = tokio::time::timeout_at(deadline, changes.changed()) => match changed {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => return Err(ApiError::unavailable("simulator shutting down")),
                Err(_) => {
                    return Err(ApiError::new(
                        StatusCode::REQUEST_TIMEOUT,
                        format!("deadline_exceeded: machine {id} did not reach state {target} within {timeout_secs}s"),
                    ));
                }
            },
        }
    }
}

pub(crate) async fn cordon(
    State(shared): SharedState,
    Extension(seq): Extension<RequestSeq>,
    Path((app, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let call = Call {
        app: &app,
        id: &id,
        headers: &headers,
        seq,
        what: "POST cordon",
        metadata: false,
    };
    mutate(&shared, call, |m, _| {
        m.cordoned = true;
        Ok(())
    })?;
    Ok(ok_json())
}

pub(crate) async fn uncordon(
    State(shared): SharedState,
    Extension(seq): Extension<RequestSeq>,
    Path((app, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let call = Call {
        app: &app,
        id: &id,
        headers: &headers,
        seq,
        what: "POST uncordon",
        metadata: false,
    };
    mutate(&shared, call, |m, _| {
        m.cordoned = false;
        Ok(())
    })?;
    Ok(ok_json())
}

#[derive(Deserialize, Default)]
struct LeaseRequest {
    ttl: Option<u64>,
    description: Option<String>,
}

#[derive(Serialize)]
struct LeaseEnvelope<'a> {
    status: &'static str,
    data: LeaseData<'a>,
}

#[derive(Serialize)]
struct LeaseData<'a> {
    nonce: &'a str,
    expires_at: i64,
    owner: &'a str,
    description: &'a str,
    version: &'a str,
}

fn lease_response(status: StatusCode, lease: &Lease) -> Response {
    let envelope = LeaseEnvelope {
        status: "success",
        data: LeaseData {
            nonce: &lease.nonce,
            expires_at: lease.expires_at.timestamp(),
            owner: &lease.owner,
            description: &lease.description,
            version: &lease.version,
        },
    };
    (status, Json(envelope)).into_response()
}

/// `POST …/lease`: acquire (201), refresh with the held nonce (201, same
/// nonce, later expiry), or 409 while someone else holds it.
pub(crate) async fn acquire_lease(
    State(shared): SharedState,
    Path((app, id)): Path<(String, String)>,
    Query(q): QueryMap,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: LeaseRequest = parse_optional_json(&body)?;
    let query_ttl = q
        .get("ttl")
        .map(|t| t.parse::<u64>())
        .transpose()
        .map_err(|_| ApiError::bad_request("invalid ttl: expected seconds"))?;
    let ttl = request
        .ttl
        .or(query_ttl)
        .filter(|t| *t > 0)
        .unwrap_or(DEFAULT_LEASE_TTL_SECS);
    let nonce = lease_nonce(&headers);

    let mut world = shared.lock();
    let now = world.now();
    let owner = world.lease_owner.clone();
    let m = world.machine_mut(&app, &id)?;
    m.require_host()?;
    let expires_at = add(now, Duration::from_secs(ttl));
    let refresh = match m.active_lease(now) {
        Some(lease) if nonce == Some(lease.nonce.as_str()) => true,
        Some(lease) => return Err(ApiError::lease_held(&m.id, &lease.owner, lease.expires_at)),
        None => false,
    };
    let version = m.instance_id.clone();
    let lease = match (&mut m.lease, refresh) {
        (Some(lease), true) => {
            lease.expires_at = expires_at;
            lease.version = version;
            if let Some(description) = request.description {
                lease.description = description;
            }
            lease
        }
        (slot, _) => slot.insert(Lease {
            nonce: new_nonce(),
            owner,
            description: request.description.unwrap_or_default(),
            expires_at,
            version,
        }),
    };
    Ok(lease_response(StatusCode::CREATED, lease))
}

pub(crate) async fn get_lease(
    State(shared): SharedState,
    Path((app, id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let world = shared.lock();
    let now = world.now();
    let m = world.machine(&app, &id)?;
    let lease = m
        .active_lease(now)
        .ok_or_else(|| ApiError::not_found("lease not found"))?;
    Ok(lease_response(StatusCode::OK, lease))
}

/// `DELETE …/lease`: only with the holder's nonce; never clears another's lease.
pub(crate) async fn release_lease(
    State(shared): SharedState,
    Path((app, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let mut world = shared.lock();
    let now = world.now();
    let m = world.machine_mut(&app, &id)?;
    m.require_host()?;
    let lease = m
        .active_lease(now)
        .ok_or_else(|| ApiError::not_found("lease not found"))?;
    if lease_nonce(&headers) != Some(lease.nonce.as_str()) {
        return Err(ApiError::lease_held(&m.id, &lease.owner, lease.expires_at));
    }
    m.lease = None;
    Ok(Json(serde_json::json!({ "status": "success" })).into_response())
}

pub(crate) async fn get_metadata(
    State(shared): SharedState,
    Path((app, id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let world = shared.lock();
    let m = world.machine(&app, &id)?;
    m.require_host()?;
    Ok(Json(&m.metadata).into_response())
}

pub(crate) async fn get_metadata_key(
    State(shared): SharedState,
    Path((app, id, key)): Path<(String, String, String)>,
) -> Result<Response, ApiError> {
    let world = shared.lock();
    let m = world.machine(&app, &id)?;
    m.require_host()?;
    let value = m
        .metadata
        .get(&key)
        .ok_or_else(|| ApiError::not_found(format!("metadata key not found: {key}")))?;
    Ok(Json(serde_json::json!({ "value": value })).into_response())
}

#[derive(Deserialize)]
struct UpsertValue {
    value: Option<String>,
}

pub(crate) async fn set_metadata_key(
    State(shared): SharedState,
    Extension(seq): Extension<RequestSeq>,
    Path((app, id, key)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: UpsertValue = parse_json(&body)?;
    let value = request
        .value
        .ok_or_else(|| ApiError::bad_request("value is required"))?;
    let call = Call {
        app: &app,
        id: &id,
        headers: &headers,
        seq,
        what: "POST metadata",
        metadata: true,
    };
    mutate(&shared, call, |m, ctx| {
        m.metadata.insert(key, value);
        m.touch(ctx.now);
        Ok(())
    })?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(crate) async fn delete_metadata_key(
    State(shared): SharedState,
    Extension(seq): Extension<RequestSeq>,
    Path((app, id, key)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let call = Call {
        app: &app,
        id: &id,
        headers: &headers,
        seq,
        what: "DELETE metadata",
        metadata: true,
    };
    mutate(&shared, call, |m, ctx| {
        m.metadata.remove(&key);
        m.touch(ctx.now);
        Ok(())
    })?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
struct UpdateMetadata {
    metadata: Option<BTreeMap<String, Option<String>>>,
    #[serde(default)]
    machine_version: Option<String>,
}

/// `PATCH`/`PUT …/metadata`: merge; `null` or `""` removes a key. With a
/// `machine_version` other than the current one: 412, nothing written.
pub(crate) async fn update_metadata(
    State(shared): SharedState,
    Extension(seq): Extension<RequestSeq>,
    method: Method,
    Path((app, id)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: UpdateMetadata = parse_json(&body)?;
    let changes = request
        .metadata
        .ok_or_else(|| ApiError::bad_request("metadata is required"))?;
    let call = Call {
        app: &app,
        id: &id,
        headers: &headers,
        seq,
        what: if method == Method::PUT {
            "PUT metadata"
        } else {
            "PATCH metadata"
        },
        metadata: true,
    };
    mutate(&shared, call, |m, ctx| {
        if let Some(version) = request.machine_version.filter(|v| !v.is_empty())
            && version != m.instance_id
        {
            return Err(ApiError::precondition(format!(
                "failed_precondition: machine_version {version} is stale; current version is {}",
                m.instance_id
            )));
        }
        for (key, value) in changes {
            match value.filter(|v| !v.is_empty()) {
                Some(value) => m.metadata.insert(key, value),
                None => m.metadata.remove(&key),
            };
        }
        m.touch(ctx.now);
        Ok(())
    })?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_and_plain_seconds_parse() {
        let secs = Duration::from_secs;
        assert_eq!(parse_go_duration("30"), Some(secs(30)));
        assert_eq!(parse_go_duration("30s"), Some(secs(30)));
        assert_eq!(parse_go_duration("1m30s"), Some(secs(90)));
        assert_eq!(parse_go_duration("2h"), Some(secs(7200)));
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("500ms"), Some(Duration::from_millis(500)));
        for bad in ["", "soon", "5d", "s", "-3s"] {
            assert_eq!(parse_go_duration(bad), None, "{bad:?}");
        }
    }
}

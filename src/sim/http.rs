//! The simulator's HTTP surface: the routes and the front door (recording,
//! auth, injected faults, rate limit, chaos, test hooks).
//!
//! The top of the HTTP side: it names the handlers (`fly_api`, `agent`) to
//! route to, and they never name it; what both need (the error shape, token
//! checks) is `wire`'s.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use super::chaos::{ChaosEvent, ChaosFault};
use super::handle::SimHandle;
use super::state::{
    HookWhen, InjectedFailure, MAX_RECORDED_REQUESTS, RateClass, Shared, World, WorldHook,
};
use super::view::{Credential, RecordedRequest, RequestTarget};
use super::wire::{
    ApiError, NONCE_HEADER, RequestSeq, agent_token_matches, fly_token_matches, header_str,
};
use super::{agent, fly_api, machine_api};

/// Request bodies beyond this are refused (413); nothing the daemon sends comes close.
const MAX_REQUEST_BODY: usize = 1024 * 1024;
/// How much of each request body the log keeps.
const RECORDED_BODY_BYTES: usize = 4096;

/// What a path addresses, for the log and the rate limit.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Route {
    pub(crate) target: Option<RequestTarget>,
    pub(crate) app: Option<String>,
    pub(crate) machine_id: Option<String>,
    pub(crate) action: Option<String>,
}

pub(crate) fn classify_path(path: &str) -> Route {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let owned = |s: &&str| s.to_string();
    match segments.as_slice() {
        ["v1", rest @ ..] => {
            let mut route = Route {
                target: Some(RequestTarget::FlyApi),
                ..Route::default()
            };
            if let ["apps", app, more @ ..] = rest {
                route.app = Some(app.to_string());
                if let ["machines", id, action @ ..] = more {
                    route.machine_id = Some(id.to_string());
                    route.action =
                        Some(action.first().map_or_else(|| "machine".to_string(), owned));
                }
            }
            route
        }
        // `/_machine/{caller}/v1/apps/{app}/machines/{id}/metadata…`: the
        // app and machine are the ones called about, as for `/v1`.
        ["_machine", _caller, "v1", rest @ ..] => {
            let mut route = classify_path(&format!("/v1/{}", rest.join("/")));
            route.target = Some(RequestTarget::MachineApi);
            route
        }
        ["agents", id, action @ ..] => Route {
            target: Some(RequestTarget::Agent),
            app: None,
            machine_id: Some(id.to_string()),
            action: (!action.is_empty()).then(|| action.join("/")),
        },
        _ => Route {
            target: Some(RequestTarget::Other),
            ..Route::default()
        },
    }
}

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let machine = "/v1/apps/{app}/machines/{id}";
    Router::new()
        .route("/v1/apps/{app}/machines", get(fly_api::list_machines))
        .route(
            machine,
            get(fly_api::get_machine).post(fly_api::update_machine),
        )
        .route(&format!("{machine}/restart"), post(fly_api::restart))
        .route(&format!("{machine}/stop"), post(fly_api::stop))
        .route(&format!("{machine}/start"), post(fly_api::start))
        .route(&format!("{machine}/wait"), get(fly_api::wait))
        .route(&format!("{machine}/cordon"), post(fly_api::cordon))
        .route(&format!("{machine}/uncordon"), post(fly_api::uncordon))
        .route(
            &format!("{machine}/lease"),
            get(fly_api::get_lease)
                .post(fly_api::acquire_lease)
                .delete(fly_api::release_lease),
        )
        .route(
            &format!("{machine}/metadata"),
            get(fly_api::get_metadata)
                .patch(fly_api::update_metadata)
                .put(fly_api::update_metadata),
        )
        .route(
            &format!("{machine}/metadata/{{key}}"),
            get(fly_api::get_metadata_key)
                .post(fly_api::set_metadata_key)
                .delete(fly_api::delete_metadata_key),
        )
        .route(
            &format!("{}/{{caller}}{machine}/metadata", machine_api::PREFIX),
            get(machine_api::get_metadata),
        )
        .route(
            &format!(
                "{}/{{caller}}{machine}/metadata/{{key}}",
                machine_api::PREFIX
            ),
            get(machine_api::get_metadata_key)
                .post(machine_api::set_metadata_key)
                .delete(machine_api::delete_metadata_key),
        )
        .route("/agents/{id}/health", get(agent::health))
        .route("/agents/{id}/overlay/drain", post(agent::drain))
        .route("/agents/{id}/overlay/undrain", post(agent::undrain))
        .route("/agents/{id}/overlay/reload", post(agent::reload))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            Arc::clone(&shared),
            front_door,
        ))
        .with_state(shared)
}

async fn not_found() -> ApiError {
    ApiError::not_found("not found")
}

/// What the front door decided for a Fly API request before serving it.
enum Gate {
    /// Serve it.
    Pass,
    /// Answer this instead; the request has no effect.
    Refuse(ApiError),
    /// Hold the connection for this long, then answer 503; no effect.
    HangThenRefuse(Duration),
    /// Serve it (its effect takes place), then wait `delay` and answer
    /// `status` instead of the real answer.
    ServeThenFail { delay: Duration, status: StatusCode },
}

/// Records every request, then, for the Fly API only: authenticates, serves
/// queued faults, applies the rate limit and draws a chaos fault, in that
/// order (a request with a bad token must not consume a fault a retry test
/// queued, and a throttled one gets no second fault on top).
async fn front_door(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let Ok(body) = to_bytes(body, MAX_REQUEST_BODY).await else {
        return ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "request body too large")
            .into_response();
    };
    let route = classify_path(parts.uri.path());
    let authorization = header_str(&parts.headers, header::AUTHORIZATION.as_str());

    let (seq, gate) = {
        let mut world = shared.lock();
        let (credential, authorized) =
            authenticate(&world, &route, parts.method.as_str(), authorization);
        let seq = world.next_seq;
        world.next_seq += 1;
        if world.record_requests {
            let record = recorded(
                seq,
                world.now(),
                &route,
                &parts,
                &body,
                credential,
                authorized,
            );
            if world.requests.len() >= MAX_RECORDED_REQUESTS {
                world.requests.pop_front();
            }
            world.requests.push_back(record);
        }
        let gate = if route.target == Some(RequestTarget::FlyApi) {
            fly_gate(&mut world, &route, &parts, seq, authorized)
        } else {
            Gate::Pass
        };
        (seq, gate)
    };

    let handle = SimHandle {
        shared: Arc::clone(&shared),
    };
    let acts = std::mem::take(&mut shared.lock().chaos.pending);
    for act in acts {
        handle.carry_out(act);
    }
    // Interventions fire only for a call that reaches its handler, and
    // only for the daemon's side: a tampering process's call is not one.
    let (before, after) = match gate {
        _ if route.target == Some(RequestTarget::MachineApi) => (None, None),
        Gate::Pass | Gate::ServeThenFail { .. } => {
            let mut world = shared.lock();
            let method = parts.method.as_str();
            (
                take_hook(&mut world, &route, method, HookWhen::Before),
                take_hook(&mut world, &route, method, HookWhen::After),
            )
        }
        _ => (None, None),
    };
    if let Some(hook) = before {
        hook(&shared);
    }
    parts.extensions.insert(RequestSeq(seq));
    let request = Request::from_parts(parts, Body::from(body));
    let response = match gate {
        Gate::Pass => {
            let real = next.run(request).await;
            if let Some(hook) = after {
                hook(&shared);
            }
            real
        }
        Gate::Refuse(error) => error.into_response(),
        Gate::HangThenRefuse(delay) => {
            hang(&shared, delay).await;
            ApiError::unavailable("injected fault: no answer in time").into_response()
        }
        Gate::ServeThenFail { delay, status } => {
            let real = next.run(request).await;
            if let Some(hook) = after {
                hook(&shared);
            }
            shared
                .lock()
                .chaos
                .record_effect(seq, real.status().as_u16());
            // Drop the real answer (and any long body) before waiting.
            drop(real);
            hang(&shared, delay).await;
            ApiError::new(status, "injected fault: the answer was lost").into_response()
        }
    };
    let status = response.status().as_u16();
    let mut world = shared.lock();
    if let Some(r) = world.requests.iter_mut().rev().find(|r| r.seq == seq) {
        r.status = Some(status);
    }
    response
}

/// The first pending hook for this call and moment, removed from the queue.
fn take_hook(world: &mut World, route: &Route, method: &str, when: HookWhen) -> Option<WorldHook> {
    let (id, action) = (route.machine_id.as_ref()?, route.action.as_ref()?);
    let i = world.hooks.iter().position(|h| {
        h.when == when && &h.machine_id == id && &h.action == action && h.method == method
    })?;
    Some(world.hooks.remove(i).hook)
}

/// Sleeps `delay`, cut short by simulator shutdown (so a hung fault cannot
/// hold up graceful shutdown).
async fn hang(shared: &Shared, delay: Duration) {
    if delay.is_zero() {
        return;
    }
    tokio::select! {
        _ = shared.cancel.cancelled() => {}
        _ = tokio::time::sleep(delay) => {}
    }
}

fn authenticate(
    world: &World,
    route: &Route,
    method: &str,
    authorization: Option<&str>,
) -> (Credential, bool) {
    let machine = route
        .machine_id
        .as_deref()
        .and_then(|id| world.machines.get(id));
    let credential = match authorization {
        None => Credential::None,
        Some(a) if fly_token_matches(&world.token, a) => Credential::FlyToken,
        Some(a)
            if route
                .app
                .as_ref()
                .and_then(|app| world.app_tokens.get(app))
                .is_some_and(|tokens| tokens.iter().any(|t| fly_token_matches(t, a))) =>
        {
            Credential::FlyToken
        }
        Some(a)
            if machine.is_some_and(|m| {
                m.agent.agent_token.is_some()
                    && agent_token_matches(m.agent.agent_token.as_deref(), Some(a))
            }) =>
        {
            Credential::AgentToken
        }
        Some(_) => Credential::Other,
    };
    let authorized = match route.target {
        Some(RequestTarget::FlyApi) => credential == Credential::FlyToken,
        // The in-machine socket is its own credential.
        Some(RequestTarget::MachineApi) => true,
        // Health GETs never need a token; cooperative POSTs need the agent's.
        Some(RequestTarget::Agent) => {
            method == "GET"
                || machine.is_none_or(|m| {
                    agent_token_matches(m.agent.agent_token.as_deref(), authorization)
                })
        }
        _ => true,
    };
    (credential, authorized)
}

fn fly_gate(
    world: &mut World,
    route: &Route,
    parts: &axum::http::request::Parts,
    seq: u64,
    authorized: bool,
) -> Gate {
    if !authorized {
        return Gate::Refuse(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized: missing or invalid Authorization token",
        ));
    }
    if let Some(status) = route.app.as_ref().and_then(|a| world.failing_apps.get(a)) {
        return Gate::Refuse(ApiError::with_code(
            *status,
            "injected failure: app unavailable",
        ));
    }
    if let Some(InjectedFailure {
        status,
        retry_after,
    }) = world.failures.pop_front()
    {
        return Gate::Refuse(
            ApiError::with_code(status, "injected failure").retry_after(retry_after),
        );
    }
    if let (Some(id), Some(action)) = (&route.machine_id, &route.action)
        && let Some(i) = world.targeted.iter().position(|t| {
            &t.machine_id == id && &t.action == action && t.method == parts.method.as_str()
        })
    {
        let targeted = world.targeted.remove(i);
        return gate_for(targeted.fault, 1, targeted.hang);
    }
    if let (Some(id), Some(action)) = (&route.machine_id, &route.action) {
        // Fly documents two limits: get-machine, and every other call as an
        // action; lease acquire and refresh share the `POST lease` bucket.
        let key = format!("{} {action}", parts.method);
        let class = if parts.method == axum::http::Method::GET {
            RateClass::Get
        } else {
            RateClass::Action
        };
        if let Err(retry_after) = world.take_rate_token(id, &key, class) {
            return Gate::Refuse(
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate limit exceeded")
                    .retry_after(retry_after),
            );
        }
    }
    // Fly documents 1 request/s per app, burst 3, for listing machines.
    if route.machine_id.is_none()
        && parts.method == axum::http::Method::GET
        && parts
            .uri
            .path()
            .trim_end_matches('/')
            .ends_with("/machines")
        && let Some(app) = &route.app
        && let Err(retry_after) =
            world.take_rate_token(&format!("app {app}"), "GET list", RateClass::List)
    {
        return Gate::Refuse(
            ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate limit exceeded")
                .retry_after(retry_after),
        );
    }
    let apps = &world.apps;
    world
        .chaos
        .draw_world(seq, route.machine_id.as_deref(), apps);
    let Some((fault, chaos)) = world.chaos.draw() else {
        return Gate::Pass;
    };
    let (retry_after, hang) = (chaos.retry_after_secs, chaos.hang);
    world.chaos.log(ChaosEvent {
        seq,
        fault,
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        machine_id: route.machine_id.clone(),
        effect_status: None,
    });
    gate_for(fault, retry_after, hang)
}

/// How a drawn or targeted fault is served.
fn gate_for(fault: ChaosFault, retry_after: u64, hang: Duration) -> Gate {
    match fault {
        ChaosFault::TooManyRequests => Gate::Refuse(
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "injected fault: rate limited",
            )
            .retry_after(Some(retry_after)),
        ),
        ChaosFault::ServerError => Gate::Refuse(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "injected fault: internal error",
        )),
        ChaosFault::Unavailable => {
            Gate::Refuse(ApiError::unavailable("injected fault: service unavailable"))
        }
        ChaosFault::HangBefore => Gate::HangThenRefuse(hang),
        ChaosFault::LostAfter => Gate::ServeThenFail {
            delay: Duration::ZERO,
            status: StatusCode::INTERNAL_SERVER_ERROR,
        },
        ChaosFault::HangAfter => Gate::ServeThenFail {
            delay: hang,
            status: StatusCode::SERVICE_UNAVAILABLE,
        },
        ChaosFault::TimedOutAfter => Gate::ServeThenFail {
            delay: Duration::ZERO,
            status: StatusCode::REQUEST_TIMEOUT,
        },
    }
}

/// The log entry of a request as it arrived (no answer yet).
fn recorded(
    seq: u64,
    at: chrono::DateTime<chrono::Utc>,
    route: &Route,
    parts: &axum::http::request::Parts,
    body: &Bytes,
    credential: Credential,
    authorized: bool,
) -> RecordedRequest {
    RecordedRequest {
        seq,
        at,
        target: route.target.unwrap_or(RequestTarget::Other),
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        app: route.app.clone(),
        machine_id: route.machine_id.clone(),
        action: route.action.clone(),
        credential,
        authorized,
        lease_nonce: header_str(&parts.headers, NONCE_HEADER).map(str::to_string),
        body: recorded_body(body),
        status: None,
    }
}

fn recorded_body(body: &Bytes) -> String {
    let end = body.len().min(RECORDED_BODY_BYTES);
    String::from_utf8_lossy(&body[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_classified() {
        let r = classify_path("/v1/apps/a/machines/m1/metadata/pool");
        assert_eq!(r.target, Some(RequestTarget::FlyApi));
        assert_eq!(r.app.as_deref(), Some("a"));
        assert_eq!(r.machine_id.as_deref(), Some("m1"));
        assert_eq!(r.action.as_deref(), Some("metadata"));

        let r = classify_path("/v1/apps/a/machines/m1");
        assert_eq!(r.action.as_deref(), Some("machine"));

        let r = classify_path("/v1/apps/a/machines");
        assert_eq!(r.machine_id, None);

        let r = classify_path("/agents/m1/overlay/drain");
        assert_eq!(r.target, Some(RequestTarget::Agent));
        assert_eq!(r.action.as_deref(), Some("overlay/drain"));

        let r = classify_path("/_machine/m2/v1/apps/a/machines/m1/metadata/hold");
        assert_eq!(r.target, Some(RequestTarget::MachineApi));
        assert_eq!(r.app.as_deref(), Some("a"));
        assert_eq!(r.machine_id.as_deref(), Some("m1"));
        assert_eq!(r.action.as_deref(), Some("metadata"));

        assert_eq!(classify_path("/metrics").target, Some(RequestTarget::Other));
    }
}

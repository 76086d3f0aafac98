//! The in-machine metadata API: what a process inside a machine reaches
//! through Fly's `/.fly/api` socket (FLY-REALITY.md, "Leases and metadata";
//! Fly's "Dynamic machine metadata", community.fly.io t/13115).
//!
//! On Fly a root process in machine X calls
//! `http://flaps/v1/apps/{app}/machines/{id}/metadata[/{key}]` over that
//! socket with no token, and "anything that's root in a machine can read and
//! write metadata for any machine in its app". Here the socket is the route
//! prefix `/_machine/{caller}`, naming the machine the call comes from, with
//! Fly's paths under it. It owns exactly those rules:
//!
//! - no token: the socket is the credential;
//! - scoped to the caller's app: another app's machine answers 403, an
//!   unknown caller 404 (there is no such socket), a caller that is not
//!   `started` 503 (nothing runs in it to make the call);
//! - never fenced by leases (whatever [`super::MetadataFencing`] says: that
//!   switch models the token API only) and never a new machine version;
//! - not the daemon's action: the audit re-evaluates the machine (its pool
//!   may have changed) but records no [`super::HeldAction`] — a test judges
//!   what the daemon did after the tampering, not the tampering itself.
//!
//! Each write through a socket is kept ([`super::SocketWrite`]) with the listings
//! of its app that showed it while it stood, so a test can tell a tampering
//! a sweep could have seen from one replaced before any listing.
//!
//! It must never reach anything but metadata, nor another app's machines.

use std::sync::Arc;

use axum::Extension;
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::machine::{MachineState, STARTED};
use super::state::{Shared, World};
use super::wire::{ApiError, RequestSeq, parse_json};

type SharedState = State<Arc<Shared>>;

/// The route prefix standing for one machine's `/.fly/api` socket.
pub(crate) const PREFIX: &str = "/_machine";

/// Refuses a caller that has no socket or is outside `app`.
fn check_caller(world: &World, caller: &str, app: &str) -> Result<(), ApiError> {
    let Some(m) = world.machines.get(caller) else {
        return Err(ApiError::not_found(format!(
            "no machine {caller}: no /.fly/api socket to call from"
        )));
    };
    if m.state != STARTED || !m.host_ok() {
        return Err(ApiError::unavailable(format!(
            "machine {caller} is {}: nothing runs in it to call /.fly/api",
            m.state
        )));
    }
    if m.app != app {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "forbidden: /.fly/api of machine {caller} (app {}) reaches only its own app, not {app}",
                m.app
            ),
        ));
    }
    Ok(())
}

fn require_host(m: &MachineState) -> Result<(), ApiError> {
    if m.host_ok() {
        Ok(())
    } else {
        Err(ApiError::unavailable(format!(
            "unavailable: host of machine {} is down",
            m.id
        )))
    }
}

/// Applies `f` to the metadata of `id` in `app` for `caller`: no lease
/// check, no new version; the audit re-evaluates the machine. The write is
/// kept in the socket log (request `seq`, `key` now holding `value`).
fn write(
    shared: &Shared,
    caller: &str,
    (app, id, seq): (&str, &str, u64),
    key: &str,
    value: Option<String>,
) -> Result<(), ApiError> {
    {
        let mut world = shared.lock();
        check_caller(&world, caller, app)?;
        let now = world.now();
        let m = world.machine_mut(app, id)?;
        require_host(m)?;
        let before = match &value {
            Some(v) => m.metadata.insert(key.to_string(), v.clone()),
            None => m.metadata.remove(key),
        };
        m.touch(now);
        world.observe(id);
        world
            .socket
            .record_write(seq, (app, id, key), before.as_deref(), value);
    }
    shared.notify();
    Ok(())
}

/// `GET /_machine/{caller}/v1/apps/{app}/machines/{id}/metadata`.
pub(crate) async fn get_metadata(
    State(shared): SharedState,
    Path((caller, app, id)): Path<(String, String, String)>,
) -> Result<Response, ApiError> {
    let world = shared.lock();
    check_caller(&world, &caller, &app)?;
    let m = world.machine(&app, &id)?;
    require_host(m)?;
    Ok(Json(&m.metadata).into_response())
}

/// `GET …/metadata/{key}`: `{"value": …}`, 404 if absent.
pub(crate) async fn get_metadata_key(
    State(shared): SharedState,
    Path((caller, app, id, key)): Path<(String, String, String, String)>,
) -> Result<Response, ApiError> {
    let world = shared.lock();
    check_caller(&world, &caller, &app)?;
    let m = world.machine(&app, &id)?;
    require_host(m)?;
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

/// `POST …/metadata/{key}` with `{"value": …}`.
pub(crate) async fn set_metadata_key(
    State(shared): SharedState,
    Path((caller, app, id, key)): Path<(String, String, String, String)>,
    Extension(RequestSeq(seq)): Extension<RequestSeq>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: UpsertValue = parse_json(&body)?;
    let value = request
        .value
        .ok_or_else(|| ApiError::bad_request("value is required"))?;
    write(&shared, &caller, (&app, &id, seq), &key, Some(value))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `DELETE …/metadata/{key}`.
pub(crate) async fn delete_metadata_key(
    State(shared): SharedState,
    Path((caller, app, id, key)): Path<(String, String, String, String)>,
    Extension(RequestSeq(seq)): Extension<RequestSeq>,
) -> Result<Response, ApiError> {
    write(&shared, &caller, (&app, &id, seq), &key, None)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

//! Fly Machines API client: typed requests and responses, retries, leases.
//!
//! Owns every byte the daemon sends to Fly's control plane (docs/design.md
//! §3, which names the OpenAPI spec it follows). It retries
//! transient failures (408, 429, 5xx, connection refused) with jittered
//! exponential backoff honouring `Retry-After`, but only where a retry cannot
//! do the action twice; a write answered 408 (Fly timed out talking to the
//! host, it may have landed) is treated as one that timed out. A client
//! made [`FlyClient::within`] a deadline (a
//! lease's validity) never sends nor retries a call at or after it: each
//! attempt's timeout is cut to the time left, and a retry whose wait would
//! end past it is not waited for ([`FlyError::PastDeadline`],
//! [`FlyError::RateLimited`], or the error the last attempt got). Every
//! attempt first waits for a token of its (app, machine, action) bucket
//! ([`RateLimits`], Fly's documented limits), shared by all clones; a token
//! that would come past the deadline ends the call unsent. It reads
//! answers only up to a size cap ([`MAX_LIST_BODY_BYTES`],
//! [`MAX_BODY_BYTES`]). A listing leaves out the machines of one-off
//! commands (`fly console`, release commands), as fly-go tells them apart.
//! It must never decide anything, never log or return
//! the token, and never steal or clear a lease it does not hold.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::model::{AppName, MachineId, MachineState};

/// Header carrying a lease nonce on every mutating call to a leased machine.
pub const LEASE_NONCE_HEADER: &str = "fly-machine-lease-nonce";

/// Largest `list_machines` answer read: 1 GiB, a runaway guard only. The
/// list is decoded as it arrives, one machine at a time
/// ([`crate::json_stream`]), so memory is bounded by [`MAX_MACHINE_BYTES`]
/// and the decoded machines, not by the answer: a Fly machine with its
/// config and recent events is 2 to 4 KiB of JSON, so this reads an app of
/// 250,000 machines.
pub const MAX_LIST_BODY_BYTES: usize = 1 << 30;
/// Largest JSON object of one machine in a list, as for `get_machine`.
pub const MAX_MACHINE_BYTES: usize = MAX_BODY_BYTES;
/// Largest answer read from any other call (one machine, its metadata, a
/// lease, an acknowledgement): 1 MiB.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Most of an error answer read: only its message is kept (200 characters).
pub const MAX_ERROR_BODY_BYTES: usize = 64 << 10;

/// A machine as the list and get endpoints return it (only what we use).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct Machine {
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub state: MachineState,
    #[serde(default)]
    pub region: String,
    #[serde(default)]
    pub private_ip: String,
    /// Unique per version of the machine: a restart keeps it, an update
    /// (`fly deploy`, `fly machine update`) changes it.
    #[serde(default)]
    pub instance_id: String,
    /// Whether Fly can reach the machine's host. Absent (an old or minimal
    /// answer) reads as `ok`.
    #[serde(default)]
    pub host_status: HostStatus,
    #[serde(default)]
    pub config: Option<MachineConfig>,
    /// What Fly shows instead of `config` while the host is unreachable
    /// (fly-go `Machine.GetConfig` falls back to it); its metadata may be
    /// missing keys that are set, so it is never read as the metadata.
    #[serde(default)]
    pub incomplete_config: Option<MachineConfig>,
    /// Whether Fly Proxy routes to the machine; `None` when Fly did not say.
    #[serde(default)]
    pub cordoned: Option<bool>,
    /// Fly's own health checks of the machine.
    #[serde(default, deserialize_with = "null_as_empty_vec")]
    pub checks: Vec<MachineCheck>,
    /// Recent exit events, newest first as Fly lists them: the only ones
    /// read (a crash loop's evidence). The others Fly lists are dropped as
    /// the machine is decoded (they are most of its events' bytes).
    #[serde(default, deserialize_with = "exit_events")]
    pub events: Vec<MachineEvent>,
}

/// `host_status` of a Machine.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum HostStatus {
    #[default]
    Ok,
    Unknown,
    Unreachable,
    /// A value this version does not know: treated as not `ok`.
    #[serde(other)]
    Other,
}

/// The parts of a machine's config that are read (OpenAPI
/// `fly.MachineConfig`); the rest is skipped as it is decoded.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MachineConfig {
    #[serde(default, deserialize_with = "null_as_empty")]
    pub metadata: BTreeMap<String, String>,
    /// How many top-level health checks the config defines (`checks`, a
    /// map by name). Fly reports one result per defined check.
    #[serde(default, deserialize_with = "count_entries", skip_serializing)]
    pub checks: usize,
    /// How many service checks the config defines (`services[].checks`).
    #[serde(
        default,
        rename = "services",
        deserialize_with = "count_service_checks",
        skip_serializing
    )]
    pub service_checks: usize,
    /// `stop_config.timeout`: how long a stop (a restart's too) waits after
    /// the signal before killing, at most [`MAX_STOP_TIMEOUT`]; `None`
    /// when the config sets none (Fly's default applies).
    #[serde(
        default,
        rename = "stop_config",
        deserialize_with = "stop_timeout",
        skip_serializing
    )]
    pub stop_timeout: Option<Duration>,
}

/// Fly's cap on a stop timeout (`stop_config.timeout`, `kill_timeout`).
pub const MAX_STOP_TIMEOUT: Duration = Duration::from_secs(300);

impl MachineConfig {
    /// Every health check the config defines, top-level and per service
    /// (as flyctl counts them, `WaitForHealthchecksToPass`).
    pub fn defined_checks(&self) -> usize {
        self.checks.saturating_add(self.service_checks)
    }
}

/// One of Fly's health checks of a machine (OpenAPI `CheckStatus`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MachineCheck {
    #[serde(default)]
    pub name: String,
    /// `passing`, `warning` or `critical`.
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub output: String,
    /// When Fly last wrote this result (Fly's clock); `None` when absent
    /// or unreadable (then the result is never taken as fresh).
    #[serde(default, deserialize_with = "lenient_time")]
    pub updated_at: Option<DateTime<Utc>>,
}

impl MachineEvent {
    /// The `type` of the only events a listing keeps.
    pub const EXIT: &'static str = "exit";
}

impl MachineCheck {
    pub fn passing(&self) -> bool {
        self.status == "passing"
    }

    /// Whether Fly itself calls the machine unhealthy: at least one of its
    /// checks is not passing (none listed: no). The one rule an unprobeable
    /// restart is planned and sent on (#32 item 3).
    pub fn any_failing(checks: &[MachineCheck]) -> bool {
        checks.iter().any(|c| !c.passing())
    }
}

/// One lifecycle event of a machine (OpenAPI `MachineEvent`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MachineEvent {
    /// `launch`, `start`, `stop`, `exit`, `restart`, `update`, …
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub source: String,
    /// Unix milliseconds.
    #[serde(default)]
    pub timestamp: i64,
    /// What an exit event's `request.exit_event` says (fly-go
    /// `MachineRequest`, `MachineExitEvent`); `None` on other events, or
    /// when Fly gave none.
    #[serde(
        default,
        rename = "request",
        deserialize_with = "exit_of_request",
        skip_serializing
    )]
    pub exit: Option<ExitDetail>,
}

/// The parts of an exit that tell a crash from a requested stop (fly-go
/// `MachineExitEvent`; flyctl's `isConstantlyRestarting` reads these).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExitDetail {
    /// The process's exit code.
    pub exit_code: i64,
    /// Fly restarts the machine after it (its restart policy).
    pub restarting: bool,
    /// The exit followed a stop someone asked for (a stop or restart call).
    pub requested_stop: bool,
}

/// The machine's metadata cannot be known from this answer: its host is not
/// `ok`, or Fly sent no `config`. Unknown is never read as empty.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the metadata of machine {machine} is not known (host status {host_status:?}, {what})")]
pub struct MetadataUnknown {
    pub machine: String,
    pub host_status: HostStatus,
    pub what: &'static str,
}

impl Machine {
    /// The machine's metadata as Fly shows it, or why it cannot be known.
    pub fn known_metadata(&self) -> Result<&BTreeMap<String, String>, MetadataUnknown> {
        let unknown = |what| MetadataUnknown {
            machine: self.id.clone(),
            host_status: self.host_status.clone(),
            what,
        };
        if !self.host_ok() {
            return Err(unknown("its host is not reachable"));
        }
        match &self.config {
            Some(c) => Ok(&c.metadata),
            None => Err(unknown("the answer carries no config")),
        }
    }

    /// One metadata key: `Ok(None)` only when the metadata is known and the
    /// key is absent.
    pub fn metadata(&self, key: &str) -> Result<Option<&str>, MetadataUnknown> {
        Ok(self.known_metadata()?.get(key).map(String::as_str))
    }

    pub fn host_ok(&self) -> bool {
        self.host_status == HostStatus::Ok
    }

    /// A machine flyctl makes for a one-off command, not one of the app's
    /// own: a `fly console` machine, a release-command or a test-machine
    /// command machine. fly-go's rule (`machine_types.go`:
    /// `IsFlyAppsConsole`, `IsFlyAppsReleaseCommand`): metadata
    /// `fly_platform_version` is `v2` and the process group
    /// (`fly_process_group`, else the older `process_group`) names such a
    /// command (`process_group` = `release_command` also marks a release
    /// command). A machine whose metadata cannot be read is not one.
    pub fn is_one_off_command(&self) -> bool {
        let Ok(metadata) = self.known_metadata() else {
            return false;
        };
        let get = |k: &str| metadata.get(k).map(String::as_str).unwrap_or("");
        if get("fly_platform_version") != "v2" {
            return false;
        }
        let group = match get("fly_process_group") {
            "" => get("process_group"),
            g => g,
        };
        matches!(
            group,
            "fly_app_console" | "fly_app_release_command" | "fly_app_test_machine_command"
        ) || get("process_group") == "release_command"
    }

    pub fn is_started(&self) -> bool {
        self.state.is_started()
    }
}

/// A lease we hold. The nonce is a capability: a `SecretString`, redacted in
/// `Debug` and exposed only into the lease header of a call.
#[derive(Clone, Debug, Deserialize)]
pub struct Lease {
    pub nonce: SecretString,
    /// Unix seconds.
    #[serde(default)]
    pub expires_at: i64,
    #[serde(default)]
    pub owner: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub version: String,
}

/// Fly answers lease calls with `{"status", "data": {…}}`; the spec shows the
/// lease flat. Accept both.
#[derive(Deserialize)]
#[serde(untagged)]
enum LeaseResponse<L = Lease> {
    Envelope { data: L },
    Flat(L),
}

impl<L> LeaseResponse<L> {
    fn lease(self) -> L {
        match self {
            LeaseResponse::Envelope { data } | LeaseResponse::Flat(data) => data,
        }
    }
}

/// A refresh's answer: the nonce may be absent (then the lease is not
/// shown to be ours: [`FlyError::LeaseNonceChanged`]).
#[derive(Deserialize)]
struct RefreshedLease {
    #[serde(default)]
    nonce: Option<SecretString>,
    #[serde(default)]
    expires_at: i64,
    #[serde(default)]
    owner: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    version: String,
}

/// A state Fly's wait endpoint (`GET …/machines/{id}/wait?state=`) accepts,
/// as its API specification lists them; it is sent as its snake-case name
/// (and read from it by the simulator).
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    strum::IntoStaticStr,
    strum::Display,
    strum::EnumString,
    strum::VariantArray,
)]
#[strum(serialize_all = "snake_case")]
pub enum WaitState {
    Started,
    Stopped,
    Suspended,
    Destroyed,
    Failed,
    /// Any state the machine rests in (not starting or stopping).
    Settled,
}

/// `FlyErrorKind`: which error, without its data; its snake-case name is
/// the bounded label metrics and logs carry ([`FlyError::kind`]).
#[derive(Debug, thiserror::Error, strum::EnumDiscriminants)]
#[strum_discriminants(
    name(FlyErrorKind),
    derive(strum::IntoStaticStr, strum::Display, strum::VariantArray, Hash),
    strum(serialize_all = "snake_case")
)]
pub enum FlyError {
    #[error(
        "Fly API rejected the token ({status}) on {op} for app {app}: check that the app's token (apps[].token_env, else fly.token_env) is valid for app {app} (`fly tokens create deploy -a {app}`)"
    )]
    Unauthorized {
        op: &'static str,
        app: String,
        status: u16,
    },
    /// No token is configured for the app: nothing was sent (a token made
    /// for one app is never sent with a call on another).
    #[error(
        "Fly API: {op} for app {app}: not sent, no Fly token is configured for this app (set apps[].token_env for it, or fly.token_env)"
    )]
    NoToken { op: &'static str, app: String },
    #[error("Fly API: {op} for app {app}{}: not found ({message})", machine_suffix(.machine))]
    NotFound {
        op: &'static str,
        app: String,
        machine: Option<String>,
        message: String,
    },
    #[error(
        "Fly API: {op} on machine {machine} of app {app}: lease held by someone else ({message})"
    )]
    LeaseConflict {
        op: &'static str,
        app: String,
        machine: String,
        message: String,
    },
    #[error(
        "Fly API: {op} on machine {machine} of app {app}: machine version changed (412), re-read and retry"
    )]
    StaleVersion {
        op: &'static str,
        app: String,
        machine: String,
    },
    #[error(
        "Fly API: {op} on machine {machine} of app {app}: the lease came back with another nonce or none: ours is lost, someone else may hold the machine"
    )]
    LeaseNonceChanged {
        op: &'static str,
        app: String,
        machine: String,
    },
    #[error("Fly API: machine {machine} of app {app} did not reach state {state} in time")]
    WaitTimeout {
        app: String,
        machine: String,
        state: WaitState,
    },
    #[error("Fly API: {op} for app {app}{} answered {status}: {message}", machine_suffix(.machine))]
    Status {
        op: &'static str,
        app: String,
        machine: Option<String>,
        status: u16,
        message: String,
    },
    #[error("Fly API unreachable: {op} for app {app}{}: {message}", machine_suffix(.machine))]
    Transport {
        op: &'static str,
        app: String,
        machine: Option<String>,
        message: String,
    },
    #[error("Fly API: {op} for app {app}{}: timed out after the request was sent; the outcome is unknown, re-read state before acting again", machine_suffix(.machine))]
    OutcomeUnknown {
        op: &'static str,
        app: String,
        machine: Option<String>,
    },
    #[error("Fly API: {op} for app {app}{}: answer larger than {} ({limit} bytes), refused without reading the rest", machine_suffix(.machine), human_bytes(*.limit))]
    TooLarge {
        op: &'static str,
        app: String,
        machine: Option<String>,
        limit: usize,
    },
    #[error("Fly API: {op} for app {app}{}: not sent, the caller's deadline (its lease) has passed", machine_suffix(.machine))]
    PastDeadline {
        op: &'static str,
        app: String,
        machine: Option<String>,
    },
    #[error("Fly API: {op} for app {app}{}: rate limited{}", machine_suffix(.machine), retry_after_suffix(.retry_after))]
    RateLimited {
        op: &'static str,
        app: String,
        machine: Option<String>,
        /// How long Fly (its `Retry-After`) or our own limiter asked to wait.
        retry_after: Option<Duration>,
    },
    #[error("Fly API: {op} for app {app}: unexpected response body: {message}")]
    Decode {
        op: &'static str,
        app: String,
        message: String,
    },
}

fn human_bytes(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

fn retry_after_suffix(retry_after: &Option<Duration>) -> String {
    retry_after
        .map(|d| format!(" (retry after {})", humantime::format_duration(d)))
        .unwrap_or_default()
}

fn machine_suffix(machine: &Option<String>) -> String {
    machine
        .as_deref()
        .map(|m| format!(", machine {m}"))
        .unwrap_or_default()
}

impl FlyError {
    /// Which error this is (a new variant gets its kind by construction).
    pub fn error_kind(&self) -> FlyErrorKind {
        self.into()
    }

    /// A bounded label for metrics and logs: the kind's snake-case name.
    pub fn kind(&self) -> &'static str {
        self.error_kind().into()
    }
}

// ---- client-side rate limits ------------------------------------------------------

/// One token bucket's shape: `burst` calls at once, then one per `interval`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub interval: Duration,
    pub burst: u32,
}

impl Rate {
    /// `per_second` calls a second, `burst` at once.
    pub const fn per_second(per_second: u32, burst: u32) -> Rate {
        Rate {
            interval: Duration::from_nanos(1_000_000_000 / per_second as u64),
            burst,
        }
    }
}

impl Rate {
    /// One call's turn on a bucket last `due` (GCRA): the instant it may be
    /// sent, and the bucket's next `due` once it is.
    fn turn(self, due: Option<Instant>, now: Instant) -> (Instant, Instant) {
        let tolerance = self.interval * self.burst.saturating_sub(1);
        let due = due.unwrap_or(now).max(now);
        let send_at = now.max(due.checked_sub(tolerance).unwrap_or(now));
        (send_at, due + self.interval)
    }
}

/// The turn of a `list_machines` of one app under the client's default
/// limits ([`RateLimits::FLY`], the bucket `reserve` draws from), time
/// passed in: for the model check (tests/it/protocol_model, #32 item 13g),
/// so that it spaces its sweeps by the real decision.
#[doc(hidden)]
pub fn list_turn(due: Option<Instant>, now: Instant) -> (Instant, Instant) {
    RateLimiter::new(RateLimits::FLY)
        .rate("list_machines")
        .turn(due, now)
}

/// The client's own limits, mirroring Fly's documented ones so that our
/// traffic is spaced before Fly answers 429 (FLY-REALITY.md, "Limits").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimits {
    /// Each action on one machine (restart, stop, start, wait, cordon,
    /// uncordon, lease POST (acquire and refresh), lease DELETE, metadata
    /// POST (any key), metadata DELETE): Fly documents 1/s, burst 3, per
    /// action per machine; an action is taken to be one endpoint and method.
    pub action: Rate,
    /// `get_machine` of one machine: Fly documents 5/s, burst 10.
    pub get_machine: Rate,
    /// `list_machines` of one app: Fly documents 1/s, burst 3, per app
    /// (FLY-REALITY.md, "Limits"). A sweep lists each app once.
    pub list: Rate,
}

impl RateLimits {
    /// Fly's documented limits.
    pub const FLY: RateLimits = RateLimits {
        action: Rate::per_second(1, 3),
        get_machine: Rate::per_second(5, 10),
        list: Rate::per_second(1, 3),
    };
}

impl Default for RateLimits {
    fn default() -> Self {
        RateLimits::FLY
    }
}

/// Which bucket a call draws from: one per app, machine and action.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct BucketKey {
    app: String,
    machine: Option<String>,
    action: &'static str,
}

/// Token buckets shared by every clone of a client (GCRA: each bucket is the
/// instant its next call would be due were the bucket never allowed to burst).
#[derive(Debug)]
struct RateLimiter {
    limits: RateLimits,
    buckets: std::sync::Mutex<Buckets>,
}

#[derive(Debug)]
struct Buckets {
    due: HashMap<BucketKey, Instant>,
    /// Size at which idle buckets are next dropped.
    prune_at: usize,
}

/// Buckets kept before idle ones are dropped (a bucket is idle once it is
/// full again, and then the same as no bucket at all).
const MIN_PRUNE_AT: usize = 1024;

impl RateLimiter {
    fn new(limits: RateLimits) -> RateLimiter {
        RateLimiter {
            limits,
            buckets: std::sync::Mutex::new(Buckets {
                due: HashMap::new(),
                prune_at: MIN_PRUNE_AT,
            }),
        }
    }

    fn rate(&self, action: &str) -> Rate {
        match action {
            "get_machine" => self.limits.get_machine,
            "list_machines" => self.limits.list,
            _ => self.limits.action,
        }
    }

    /// Takes the next token of `key`'s bucket: the instant the call may be
    /// sent. A token that would come at or after `deadline` is not taken:
    /// `Err` with how long it would have been.
    fn reserve(
        &self,
        key: BucketKey,
        now: Instant,
        deadline: Option<Instant>,
    ) -> Result<Instant, Duration> {
        let rate = self.rate(key.action);
        // A poisoned lock only means another call panicked mid-update of a
        // map of instants: still usable.
        let mut buckets = self
            .buckets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if buckets.due.len() >= buckets.prune_at {
            buckets.due.retain(|_, due| *due > now);
            buckets.prune_at = (buckets.due.len() * 2).max(MIN_PRUNE_AT);
        }
        let (send_at, next) = rate.turn(buckets.due.get(&key).copied(), now);
        if let Some(d) = deadline
            && send_at >= d
        {
            return Err(send_at - now);
        }
        buckets.due.insert(key, next);
        Ok(send_at)
    }

    #[cfg(test)]
    fn buckets(&self) -> usize {
        self.buckets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .due
            .len()
    }
}

/// The Fly tokens a client sends: one per app, and a fallback for apps
/// without their own. A call on an app sends that app's token, else the
/// fallback, else nothing at all ([`FlyError::NoToken`]): an app-scoped
/// token (`fly tokens create deploy -a APP`) never leaves for another app.
/// `Debug` shows app names only (secrecy redacts the tokens).
#[derive(Clone, Debug, Default)]
pub struct FlyTokens {
    /// For apps without their own (`fly.token_env`).
    pub fallback: Option<SecretString>,
    /// App name → its own token (`apps[].token_env`,
    /// `rotation.coordinator_token_env`).
    pub apps: BTreeMap<AppName, SecretString>,
}

impl FlyTokens {
    /// One token for every app.
    pub fn one(token: impl Into<SecretString>) -> FlyTokens {
        FlyTokens {
            fallback: Some(token.into()),
            apps: BTreeMap::new(),
        }
    }

    /// The token a call on `app` sends.
    pub fn for_app(&self, app: &AppName) -> Option<&SecretString> {
        self.apps.get(app).or(self.fallback.as_ref())
    }
}

impl From<&str> for FlyTokens {
    fn from(token: &str) -> FlyTokens {
        FlyTokens::one(token)
    }
}

impl From<String> for FlyTokens {
    fn from(token: String) -> FlyTokens {
        FlyTokens::one(token)
    }
}

/// The `Authorization` values of a [`FlyTokens`], built once.
#[derive(Clone, Default)]
struct AuthHeaders {
    fallback: Option<HeaderValue>,
    apps: HashMap<AppName, HeaderValue>,
}

impl AuthHeaders {
    fn new(tokens: &FlyTokens) -> Result<AuthHeaders, FlyClientBuildError> {
        if tokens.fallback.is_none() && tokens.apps.is_empty() {
            return Err(FlyClientBuildError::BadToken);
        }
        Ok(AuthHeaders {
            fallback: tokens
                .fallback
                .as_ref()
                .map(|t| auth_header(t.expose_secret()))
                .transpose()?,
            apps: tokens
                .apps
                .iter()
                .map(|(app, t)| Ok((app.clone(), auth_header(t.expose_secret())?)))
                .collect::<Result<_, FlyClientBuildError>>()?,
        })
    }

    fn for_app(&self, app: &AppName) -> Option<&HeaderValue> {
        self.apps.get(app).or(self.fallback.as_ref())
    }
}

/// docs/design.md §3: a `FlyV1 …` token goes verbatim; a bare macaroon
/// (`fm1r_`, `fm1a_`, `fm2_`, alone or among comma-separated tokens) goes
/// as `FlyV1` (fly-go `tokens/tokens.go`, `Parse` and `normalized`: the
/// scheme is `FlyV1` as soon as one macaroon is present); anything else as
/// Bearer. Marked sensitive, so no HTTP debug output shows it. Public
/// for the model check only (#32 item 13i).
#[doc(hidden)]
pub fn auth_header(token: &str) -> Result<HeaderValue, FlyClientBuildError> {
    let token = token.trim();
    if token.is_empty() {
        return Err(FlyClientBuildError::BadToken);
    }
    let macaroon = |t: &str| {
        matches!(
            t.trim().split_once('_').map(|(prefix, _)| prefix),
            Some("fm1r" | "fm1a" | "fm2")
        )
    };
    let value = if token.starts_with("FlyV1 ") {
        token.to_string()
    } else if token.split(',').any(macaroon) {
        format!("FlyV1 {token}")
    } else {
        format!("Bearer {token}")
    };
    let mut auth = HeaderValue::from_str(&value).map_err(|_| FlyClientBuildError::BadToken)?;
    auth.set_sensitive(true);
    Ok(auth)
}

/// Client settings; the token is passed separately so it never sits in config.
#[derive(Clone, Debug)]
pub struct FlyClientConfig {
    /// Base URL without `/v1`, e.g. `https://api.machines.dev`.
    pub api_url: String,
    pub request_timeout: Duration,
    pub max_retries: u32,
    /// First backoff step; doubles each retry, capped at `max_backoff`.
    pub base_backoff: Duration,
    pub max_backoff: Duration,
    /// The client's own per-machine, per-action rate limits ([`RateLimits`],
    /// Fly's documented ones by default); `None` switches them off.
    pub rate_limits: Option<RateLimits>,
}

impl FlyClientConfig {
    pub fn new(api_url: &str) -> FlyClientConfig {
        FlyClientConfig {
            api_url: api_url.trim_end_matches('/').to_string(),
            request_timeout: Duration::from_secs(30),
            max_retries: 4,
            base_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(10),
            rate_limits: Some(RateLimits::FLY),
        }
    }
}

/// Observes each HTTP exchange (op, status code or error kind, and the time
/// from sending to the response headers or the failure), for metrics.
pub type RequestObserver = std::sync::Arc<dyn Fn(&'static str, &str, Duration) + Send + Sync>;

#[derive(Clone)]
pub struct FlyClient {
    http: reqwest::Client,
    /// Per app; shared by clones.
    auth: Arc<AuthHeaders>,
    base: url::Url,
    config: FlyClientConfig,
    observer: Option<RequestObserver>,
    /// Set by [`FlyClient::within`]: no attempt is sent at or after it.
    deadline: Option<Instant>,
    /// Shared by every clone, so one machine's budget is one budget.
    limiter: Option<Arc<RateLimiter>>,
    /// Set by [`FlyClient::noting_unanswered`]: raised when a mutating
    /// attempt may have reached Fly and got no answer.
    unanswered: Option<Arc<AtomicBool>>,
}

impl fmt::Debug for FlyClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlyClient")
            .field("api_url", &self.config.api_url)
            .finish_non_exhaustive()
    }
}

/// Whether repeating a request whose fate is unknown could do the action twice.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Idempotence {
    Safe,
    /// Restart, stop, start, lease creation: retried only when Fly said it
    /// did not process the request (429) or it never left (connect error).
    Unsafe,
}

struct Call<'a> {
    op: &'static str,
    method: Method,
    app: &'a AppName,
    machine: Option<&'a str>,
    /// Path segments after `/v1/apps/{app}/machines`.
    segments: &'a [&'a str],
    query: &'a [(&'a str, String)],
    body: Option<serde_json::Value>,
    nonce: Option<&'a SecretString>,
    idempotence: Idempotence,
    /// Extra time on top of the request timeout (long-polls).
    extra_timeout: Duration,
    /// Largest success answer read ([`MAX_BODY_BYTES`] unless raised).
    max_body: usize,
    /// The rate-limit bucket's action: one per endpoint and method (the
    /// op, except that acquire and refresh are the same POST of the lease).
    bucket: &'static str,
}

impl<'a> Call<'a> {
    fn new(
        op: &'static str,
        method: Method,
        app: &'a AppName,
        machine: Option<&'a MachineId>,
    ) -> Self {
        Call {
            op,
            method,
            app,
            machine: machine.map(MachineId::as_str),
            segments: &[],
            query: &[],
            body: None,
            nonce: None,
            idempotence: Idempotence::Safe,
            extra_timeout: Duration::ZERO,
            max_body: MAX_BODY_BYTES,
            bucket: op,
        }
    }
}

impl Call<'_> {
    fn machine(&self) -> Option<String> {
        self.machine.map(str::to_string)
    }

    fn past_deadline(&self) -> FlyError {
        FlyError::PastDeadline {
            op: self.op,
            app: self.app.to_string(),
            machine: self.machine(),
        }
    }

    fn rate_limited(&self, retry_after: Option<Duration>) -> FlyError {
        FlyError::RateLimited {
            op: self.op,
            app: self.app.to_string(),
            machine: self.machine(),
            retry_after,
        }
    }

    fn outcome_unknown(&self) -> FlyError {
        FlyError::OutcomeUnknown {
            op: self.op,
            app: self.app.to_string(),
            machine: self.machine(),
        }
    }

    /// An attempt that timed out because the deadline came: a read simply
    /// did not happen in time; a write may have landed.
    fn cut_at_deadline(&self) -> FlyError {
        if self.method == Method::GET {
            self.past_deadline()
        } else {
            self.outcome_unknown()
        }
    }

    /// A success answer whose body could not be read whole.
    fn capped(&self, e: Capped, cut: bool) -> FlyError {
        match e {
            Capped::TooLarge => FlyError::TooLarge {
                op: self.op,
                app: self.app.to_string(),
                machine: self.machine(),
                limit: self.max_body,
            },
            Capped::Transport(e) if e.is_timeout() && cut => self.cut_at_deadline(),
            Capped::Transport(e) => self.transport(&e),
        }
    }

    fn transport(&self, e: &reqwest::Error) -> FlyError {
        FlyError::Transport {
            op: self.op,
            app: self.app.to_string(),
            machine: self.machine(),
            message: crate::http::describe(e),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FlyClientBuildError {
    #[error("invalid Fly API URL {url:?}: {message}")]
    BadUrl { url: String, message: String },
    #[error("the Fly API token is empty or contains characters not allowed in a header")]
    BadToken,
    #[error("cannot build the HTTP client: {0}")]
    Http(#[from] reqwest::Error),
}

/// Connections to the API kept open between calls. A sweep lists its apps
/// at once, but a release wave runs many steps' calls at once (up to the
/// executor's concurrency); each connection that stayed open afterwards kept
/// its buffers (sized by the largest listing it carried) until the 90-s idle
/// timeout, and a daemon sweeping more often than that kept them all: the
/// soak bench's heap grew by about 1 KiB a machine over the first wave (#22).
/// Calls beyond these few open their own connection and close it.
const IDLE_CONNECTIONS: usize = 8;

impl FlyClient {
    /// A client that sends `token` on calls for every app.
    pub fn new(config: FlyClientConfig, token: &str) -> Result<FlyClient, FlyClientBuildError> {
        FlyClient::with_tokens(config, &FlyTokens::one(token))
    }

    /// A client that sends each app's own token ([`FlyTokens`]).
    pub fn with_tokens(
        config: FlyClientConfig,
        tokens: &FlyTokens,
    ) -> Result<FlyClient, FlyClientBuildError> {
        let auth = Arc::new(AuthHeaders::new(tokens)?);
        let http = crate::http::client_builder()
            .connect_timeout(config.request_timeout.min(Duration::from_secs(10)))
            // Following a redirect could carry the token to another host.
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(IDLE_CONNECTIONS)
            .build()?;
        let base = url::Url::parse(&config.api_url).map_err(|e| FlyClientBuildError::BadUrl {
            url: config.api_url.clone(),
            message: e.to_string(),
        })?;
        if base.cannot_be_a_base() || !matches!(base.scheme(), "http" | "https") {
            return Err(FlyClientBuildError::BadUrl {
                url: config.api_url.clone(),
                message: "must be an http(s) URL".into(),
            });
        }
        Ok(FlyClient {
            http,
            auth,
            base,
            limiter: config.rate_limits.map(|l| Arc::new(RateLimiter::new(l))),
            config,
            observer: None,
            deadline: None,
            unanswered: None,
        })
    }

    pub fn with_observer(mut self, observer: RequestObserver) -> FlyClient {
        self.observer = Some(observer);
        self
    }

    /// A clone of this client whose every call ends by `deadline` (a
    /// lease's validity): never sent nor retried at or after it.
    pub fn within(&self, deadline: Instant) -> FlyClient {
        let mut c = self.clone();
        c.deadline = Some(self.deadline.map_or(deadline, |d| d.min(deadline)));
        c
    }

    /// A clone of this client that raises `flag` whenever a mutating attempt
    /// may have been sent and got no answer (a timeout, a connection lost
    /// after connecting, a 408 or a gateway's 502/504). Fly has no server-side deadline: such a call may be
    /// carried out later, after the caller's lease lapsed, and a retry that
    /// succeeded does not stop the first attempt landing late.
    pub fn noting_unanswered(&self, flag: Arc<AtomicBool>) -> FlyClient {
        let mut c = self.clone();
        c.unanswered = Some(flag);
        c
    }

    // ---- reads -------------------------------------------------------------

    /// Every machine of the app, with metadata (never `summary=true`, which
    /// drops it), decoded as the answer arrives: one machine object larger
    /// than [`MAX_MACHINE_BYTES`] is refused naming its id, and no more of
    /// the answer is read. Machines of one-off commands (`fly console`,
    /// release commands: [`Machine::is_one_off_command`]) are left out, as
    /// fly-go's helpers tell them apart: they are no agents of the app.
    pub async fn list_machines(&self, app: &AppName) -> Result<Vec<Machine>, FlyError> {
        self.list_machines_with(app, |m| m).await
    }

    /// [`FlyClient::list_machines`], keeping of each machine only what
    /// `keep` makes of it as it is decoded: a sweep's rows, not a listing of
    /// 10,000 machines beside them.
    pub async fn list_machines_with<T>(
        &self,
        app: &AppName,
        mut keep: impl FnMut(Machine) -> T,
    ) -> Result<Vec<T>, FlyError> {
        let mut call = Call::new("list_machines", Method::GET, app, None);
        call.max_body = MAX_LIST_BODY_BYTES;
        let (mut resp, cut) = self.send_response(&call).await?;
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_LIST_BODY_BYTES as u64)
        {
            return Err(call.capped(Capped::TooLarge, cut));
        }
        let mut machines = Vec::new();
        let mut splitter = crate::json_stream::ArraySplitter::new(MAX_MACHINE_BYTES);
        let mut read = 0usize;
        let list_error = |e: crate::json_stream::SplitError| match e {
            crate::json_stream::SplitError::TooLarge { id, limit, .. } => FlyError::TooLarge {
                op: call.op,
                app: app.to_string(),
                machine: Some(id.unwrap_or_else(|| "(no id)".into())),
                limit,
            },
            other => FlyError::Decode {
                op: call.op,
                app: app.to_string(),
                message: other.to_string(),
            },
        };
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| call.capped(Capped::Transport(e), cut))?
        {
            read = read.saturating_add(chunk.len());
            if read > MAX_LIST_BODY_BYTES {
                return Err(call.capped(Capped::TooLarge, cut));
            }
            splitter
                .push(&chunk, &mut |element: &[u8]| {
                    let index = machines.len();
                    let machine: Machine =
                        serde_json::from_slice(element).map_err(|e| FlyError::Decode {
                            op: call.op,
                            app: app.to_string(),
                            message: format!(
                                "machine {index}{} of the list: {}",
                                crate::json_stream::leading_id(element)
                                    .map(|id| format!(" ({id})"))
                                    .unwrap_or_default(),
                                crate::text::bounded(&e.to_string(), crate::text::MAX_DETAIL_CHARS)
                            ),
                        })?;
                    if !machine.is_one_off_command() {
                        machines.push(keep(machine));
                    }
                    Ok::<(), ListError>(())
                })
                .map_err(|e| match e {
                    ListError::Split(e) => list_error(e),
                    ListError::Fly(e) => e,
                })?;
        }
        splitter.finish().map_err(list_error)?;
        Ok(machines)
    }

    pub async fn get_machine(
        &self,
        app: &AppName,
        machine: &MachineId,
    ) -> Result<Machine, FlyError> {
        let body = self
            .send(Call::new("get_machine", Method::GET, app, Some(machine)))
            .await?;
        decode(&body, "get_machine", app)
    }

    // ---- machine lifecycle ---------------------------------------------------

    /// Restarts the machine; `timeout` is how long Fly waits for it to stop.
    pub async fn restart(
        &self,
        app: &AppName,
        machine: &MachineId,
        timeout: Option<Duration>,
        nonce: Option<&SecretString>,
    ) -> Result<(), FlyError> {
        let query = timeout
            .map(|t| vec![("timeout", format!("{}s", t.as_secs().max(1)))])
            .unwrap_or_default();
        let mut call = Call::new("restart", Method::POST, app, Some(machine));
        call.segments = &["restart"];
        call.query = &query;
        call.nonce = nonce;
        call.idempotence = Idempotence::Unsafe;
        self.send(call).await.map(drop)
    }

    pub async fn stop(
        &self,
        app: &AppName,
        machine: &MachineId,
        nonce: Option<&SecretString>,
    ) -> Result<(), FlyError> {
        let mut call = Call::new("stop", Method::POST, app, Some(machine));
        call.segments = &["stop"];
        call.body = Some(serde_json::json!({}));
        call.nonce = nonce;
        call.idempotence = Idempotence::Unsafe;
        self.send(call).await.map(drop)
    }

    pub async fn start(
        &self,
        app: &AppName,
        machine: &MachineId,
        nonce: Option<&SecretString>,
    ) -> Result<(), FlyError> {
        let mut call = Call::new("start", Method::POST, app, Some(machine));
        call.segments = &["start"];
        call.nonce = nonce;
        call.idempotence = Idempotence::Unsafe;
        self.send(call).await.map(drop)
    }

    /// Long-polls until the machine reaches `state` (Fly caps one poll at 60 s).
    /// A 408 from Fly becomes `FlyError::WaitTimeout`.
    pub async fn wait(
        &self,
        app: &AppName,
        machine: &MachineId,
        state: WaitState,
        timeout: Duration,
    ) -> Result<(), FlyError> {
        let mut secs = timeout.as_secs().clamp(1, 60);
        // Under a deadline Fly is asked to answer within the time left, so
        // the long-poll ends with Fly's 408 rather than cut by us.
        if let Some(d) = self.deadline {
            let left = d.saturating_duration_since(Instant::now()).as_secs();
            secs = secs.min(left.max(1));
        }
        let query = [("state", state.to_string()), ("timeout", secs.to_string())];
        let mut call = Call::new("wait", Method::GET, app, Some(machine));
        call.segments = &["wait"];
        call.query = &query;
        call.extra_timeout = Duration::from_secs(secs);
        match self.send(call).await {
            Err(FlyError::Status { status: 408, .. }) => Err(FlyError::WaitTimeout {
                app: app.to_string(),
                machine: machine.to_string(),
                state,
            }),
            other => other.map(drop),
        }
    }

    /// Stops fly-proxy routing new requests to the machine.
    pub async fn cordon(
        &self,
        app: &AppName,
        machine: &MachineId,
        nonce: Option<&SecretString>,
    ) -> Result<(), FlyError> {
        let mut call = Call::new("cordon", Method::POST, app, Some(machine));
        call.segments = &["cordon"];
        call.nonce = nonce;
        self.send(call).await.map(drop)
    }

    pub async fn uncordon(
        &self,
        app: &AppName,
        machine: &MachineId,
        nonce: Option<&SecretString>,
    ) -> Result<(), FlyError> {
        let mut call = Call::new("uncordon", Method::POST, app, Some(machine));
        call.segments = &["uncordon"];
        call.nonce = nonce;
        self.send(call).await.map(drop)
    }

    // ---- leases --------------------------------------------------------------

    /// Takes a new lease; `FlyError::LeaseConflict` when someone else holds
    /// one, `FlyError::RateLimited` when Fly (or our own limit) says not now.
    pub async fn acquire_lease(
        &self,
        app: &AppName,
        machine: &MachineId,
        ttl: Duration,
        description: &str,
    ) -> Result<Lease, FlyError> {
        let op = "acquire_lease";
        let body = self
            .lease_post(
                op,
                app,
                machine,
                ttl,
                description,
                None,
                Idempotence::Unsafe,
            )
            .await?;
        Ok(decode::<LeaseResponse>(&body, op, app)?.lease())
    }

    /// Extends a lease we hold. A success answer carrying another nonce, or
    /// none, does not show the lease is still ours (as flyctl judges it):
    /// `FlyError::LeaseNonceChanged`.
    pub async fn refresh_lease(
        &self,
        app: &AppName,
        machine: &MachineId,
        nonce: &SecretString,
        ttl: Duration,
        description: &str,
    ) -> Result<Lease, FlyError> {
        let op = "refresh_lease";
        let body = self
            .lease_post(
                op,
                app,
                machine,
                ttl,
                description,
                Some(nonce),
                Idempotence::Safe,
            )
            .await?;
        let answer = decode::<LeaseResponse<RefreshedLease>>(&body, op, app)?.lease();
        // Only an answer naming our nonce extends our lease: flyctl
        // compares the answer's nonce with its own, so a missing one fails
        // there too (`leasable_machine.go`, `refreshLeaseUntilCanceled`).
        if answer
            .nonce
            .as_ref()
            .is_none_or(|n| n.expose_secret() != nonce.expose_secret())
        {
            return Err(FlyError::LeaseNonceChanged {
                op,
                app: app.to_string(),
                machine: machine.to_string(),
            });
        }
        Ok(Lease {
            nonce: nonce.clone(),
            expires_at: answer.expires_at,
            owner: answer.owner,
            description: answer.description,
            version: answer.version,
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn lease_post(
        &self,
        op: &'static str,
        app: &AppName,
        machine: &MachineId,
        ttl: Duration,
        description: &str,
        nonce: Option<&SecretString>,
        idempotence: Idempotence,
    ) -> Result<bytes::Bytes, FlyError> {
        let ttl = ttl.as_secs().max(1);
        let query = [("ttl", ttl.to_string())];
        let mut call = Call::new(op, Method::POST, app, Some(machine));
        call.segments = &["lease"];
        call.bucket = "lease";
        call.query = &query;
        call.body = Some(serde_json::json!({ "ttl": ttl, "description": description }));
        call.nonce = nonce;
        call.idempotence = idempotence;
        self.send(call).await
    }

    /// Releases a lease we hold. A lease already gone (expired) is not an error.
    pub async fn release_lease(
        &self,
        app: &AppName,
        machine: &MachineId,
        nonce: &SecretString,
    ) -> Result<(), FlyError> {
        let mut call = Call::new("release_lease", Method::DELETE, app, Some(machine));
        call.segments = &["lease"];
        call.nonce = Some(nonce);
        match self.send(call).await {
            Ok(_) | Err(FlyError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    // ---- metadata writes ------------------------------------------------------

    pub async fn set_metadata(
        &self,
        app: &AppName,
        machine: &MachineId,
        key: &str,
        value: &str,
        nonce: Option<&SecretString>,
    ) -> Result<(), FlyError> {
        let segments = ["metadata", key];
        let mut call = Call::new("set_metadata", Method::POST, app, Some(machine));
        call.segments = &segments;
        // Every key's POST is one endpoint to Fly's limits, at worst.
        call.bucket = "set_metadata";
        call.body = Some(serde_json::json!({ "value": value }));
        call.nonce = nonce;
        self.send(call).await.map(drop)
    }

    pub async fn delete_metadata(
        &self,
        app: &AppName,
        machine: &MachineId,
        key: &str,
        nonce: Option<&SecretString>,
    ) -> Result<(), FlyError> {
        let segments = ["metadata", key];
        let mut call = Call::new("delete_metadata", Method::DELETE, app, Some(machine));
        call.segments = &segments;
        call.nonce = nonce;
        match self.send(call).await {
            Ok(_) | Err(FlyError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    // ---- transport -------------------------------------------------------------

    fn url(&self, call: &Call<'_>) -> url::Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            // Segments are percent-encoded, so an app or key cannot escape its slot.
            path.pop_if_empty()
                .extend(["v1", "apps", call.app.as_str(), "machines"]);
            if let Some(m) = call.machine {
                path.push(m);
            }
            path.extend(call.segments);
        }
        if !call.query.is_empty() {
            let mut q = url.query_pairs_mut();
            for (k, v) in call.query {
                q.append_pair(k, v);
            }
        }
        url
    }

    /// Sends `call` (with its retries) and reads the whole answer, up to
    /// `call.max_body`.
    async fn send(&self, call: Call<'_>) -> Result<bytes::Bytes, FlyError> {
        let max = call.max_body;
        let (resp, cut) = self.send_response(&call).await?;
        read_capped(resp, max)
            .await
            .map_err(|e| call.capped(e, cut))
    }

    /// Sends `call` with its retries; a success answer comes back unread,
    /// with whether the attempt's timeout was cut short by the deadline.
    async fn send_response(&self, call: &Call<'_>) -> Result<(reqwest::Response, bool), FlyError> {
        let Some(auth) = self.auth.for_app(call.app).cloned() else {
            return Err(FlyError::NoToken {
                op: call.op,
                app: call.app.to_string(),
            });
        };
        let url = self.url(call);
        let mut attempt = 0u32;
        loop {
            let (error, wait_hint) = match self.attempt(call, &url, &auth).await? {
                Attempted::Answered(resp, cut) => return Ok((resp, cut)),
                Attempted::Retryable { error, wait_hint } => (error, wait_hint),
            };
            let delay = self.retry_delay(call, attempt, error, wait_hint)?;
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// One attempt of `call`: its turn, its request, and what its answer
    /// (or its failure) means. An error is final: the call is not retried.
    async fn attempt(
        &self,
        call: &Call<'_>,
        url: &url::Url,
        auth: &HeaderValue,
    ) -> Result<Attempted, FlyError> {
        self.take_turn(call).await?;
        let now = Instant::now();
        let (req, cut) = self.request(call, url, auth, now)?;
        match req.send().await {
            Ok(resp) => self.classify_answer(call, resp, now, cut).await,
            Err(e) => self.classify_failure(call, &e, now, cut),
        }
    }

    /// Waits for the attempt's turn: never past the deadline, and every
    /// attempt (a retry too) spends a rate-limit token, as Fly counts it.
    async fn take_turn(&self, call: &Call<'_>) -> Result<(), FlyError> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(call.past_deadline());
        }
        if let Some(limiter) = &self.limiter {
            let key = BucketKey {
                app: call.app.to_string(),
                machine: call.machine(),
                action: call.bucket,
            };
            match limiter.reserve(key, Instant::now(), self.deadline) {
                Ok(at) => tokio::time::sleep_until(at).await,
                Err(wait) => return Err(call.rate_limited(Some(wait))),
            }
        }
        Ok(())
    }

    /// The attempt's request, its timeout bounded by the time left before
    /// the deadline, and whether that cut it short.
    fn request(
        &self,
        call: &Call<'_>,
        url: &url::Url,
        auth: &HeaderValue,
        now: Instant,
    ) -> Result<(reqwest::RequestBuilder, bool), FlyError> {
        // Nothing is sent at or after the deadline: past it the caller's
        // lease may be someone else's.
        let left = match self.deadline {
            Some(d) if now >= d => return Err(call.past_deadline()),
            Some(d) => Some(d - now),
            None => None,
        };
        let full_timeout = self.config.request_timeout + call.extra_timeout;
        let timeout = left.map_or(full_timeout, |left| full_timeout.min(left));
        let cut = timeout < full_timeout;
        let mut req = self
            .http
            .request(call.method.clone(), url.clone())
            .header(AUTHORIZATION, auth.clone())
            .timeout(timeout);
        if let Some(nonce) = call.nonce {
            match HeaderValue::from_str(nonce.expose_secret()) {
                Ok(mut v) => {
                    v.set_sensitive(true);
                    req = req.header(LEASE_NONCE_HEADER, v);
                }
                Err(_) => {
                    return Err(FlyError::Status {
                        op: call.op,
                        app: call.app.to_string(),
                        machine: call.machine.map(str::to_string),
                        status: 0,
                        message: "lease nonce is not a valid header value".into(),
                    });
                }
            }
        }
        if let Some(body) = &call.body {
            req = req.json(body);
        }
        Ok((req, cut))
    }

    /// What an answer means: a success, a refusal worth repeating (429, and
    /// a safe call's 408 or 5xx) or the call's final error.
    async fn classify_answer(
        &self,
        call: &Call<'_>,
        resp: reqwest::Response,
        sent: Instant,
        cut: bool,
    ) -> Result<Attempted, FlyError> {
        let status = resp.status();
        self.observe(call.op, status.as_str(), sent.elapsed());
        if status.is_success() {
            return Ok(Attempted::Answered(resp, cut));
        }
        // A gateway's 502/504 says Fly's proxy gave up waiting,
        // not that the machine's API did nothing.
        if matches!(
            status,
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT
        ) {
            self.note_unanswered(call);
        }
        // A 408 is Fly timing out talking to the machine's host: "the
        // side-effect may or may not have happened" (flyctl
        // `internal/flapsutil/retry.go`). A write answered so is treated
        // as one that timed out: unanswered, and an unsafe one is not
        // repeated. (A GET's 408, `wait`'s "not yet" among them, is not.)
        if status == StatusCode::REQUEST_TIMEOUT && call.method != Method::GET {
            self.note_unanswered(call);
            if call.idempotence == Idempotence::Unsafe {
                return Err(call.outcome_unknown());
            }
        }
        let retry_after = parse_retry_after(resp.headers());
        let transient = status == StatusCode::TOO_MANY_REQUESTS
            || (call.idempotence == Idempotence::Safe
                && (status == StatusCode::REQUEST_TIMEOUT && call.op != "wait"
                    || status.is_server_error()));
        let text = read_error_body(resp).await;
        let error = status_error(call, status, &text, retry_after);
        if !transient {
            return Err(error);
        }
        Ok(Attempted::Retryable {
            error,
            wait_hint: retry_after,
        })
    }

    /// What a request that got no answer means: repeatable when it never
    /// left or the call is safe to repeat; a timeout of an unsafe call, or
    /// one the deadline cut, is final (a write it carried may have landed).
    fn classify_failure(
        &self,
        call: &Call<'_>,
        e: &reqwest::Error,
        sent: Instant,
        cut: bool,
    ) -> Result<Attempted, FlyError> {
        let kind = if e.is_timeout() { "timeout" } else { "error" };
        self.observe(call.op, kind, sent.elapsed());
        // A connect error means the request never left: always safe to repeat.
        let never_sent = e.is_connect();
        if !never_sent {
            self.note_unanswered(call);
        }
        if e.is_timeout() && call.idempotence == Idempotence::Unsafe {
            return Err(call.outcome_unknown());
        }
        // An attempt the deadline cut: it is not repeated, and a
        // write it carried may have landed.
        if e.is_timeout() && cut {
            return Err(call.cut_at_deadline());
        }
        let error = call.transport(e);
        if !(never_sent || call.idempotence == Idempotence::Safe) {
            return Err(error);
        }
        Ok(Attempted::Retryable {
            error,
            wait_hint: None,
        })
    }

    /// How long to wait before retrying after `error`, or `error` itself
    /// when the retries are spent or the retry would fall past the deadline.
    fn retry_delay(
        &self,
        call: &Call<'_>,
        attempt: u32,
        error: FlyError,
        wait_hint: Option<Duration>,
    ) -> Result<Duration, FlyError> {
        if attempt >= self.config.max_retries {
            return Err(error);
        }
        let delay = backoff(
            attempt,
            self.config.base_backoff,
            self.config.max_backoff,
            wait_hint,
            fastrand::f64(),
        );
        // A retry that could only be sent at or past the deadline is not
        // waited for: the caller learns now, while its lease holds.
        if self.deadline.is_some_and(|d| Instant::now() + delay >= d) {
            return Err(error);
        }
        tracing::debug!(
            op = call.op,
            app = call.app.as_str(),
            machine_id = call.machine,
            attempt,
            delay_ms = delay.as_millis() as u64,
            "retrying Fly API request"
        );
        Ok(delay)
    }

    /// A mutating attempt that may have reached Fly got no answer of its
    /// own: raise the flag of [`FlyClient::noting_unanswered`].
    fn note_unanswered(&self, call: &Call<'_>) {
        if call.method != Method::GET
            && let Some(flag) = &self.unanswered
        {
            flag.store(true, Ordering::SeqCst);
        }
    }

    fn observe(&self, op: &'static str, code: &str, took: Duration) {
        if let Some(o) = &self.observer {
            o(op, code, took);
        }
    }
}

/// What one attempt of a call came to, short of a final error.
enum Attempted {
    /// A success answer, unread, and whether the deadline cut its timeout.
    Answered(reqwest::Response, bool),
    /// A failure worth repeating, with Fly's `Retry-After`, if any.
    Retryable {
        error: FlyError,
        wait_hint: Option<Duration>,
    },
}

enum Capped {
    TooLarge,
    Transport(reqwest::Error),
}

/// Why a listing stopped while its array was split.
enum ListError {
    Split(crate::json_stream::SplitError),
    Fly(FlyError),
}

impl From<crate::json_stream::SplitError> for ListError {
    fn from(e: crate::json_stream::SplitError) -> ListError {
        ListError::Split(e)
    }
}

impl From<FlyError> for ListError {
    fn from(e: FlyError) -> ListError {
        ListError::Fly(e)
    }
}

/// The body, read chunk by chunk up to `limit` bytes: a longer one (by its
/// announced length, or as it arrives) fails as soon as that is known, and
/// dropping the response closes the connection, so the rest is never read.
async fn read_capped(mut resp: reqwest::Response, limit: usize) -> Result<bytes::Bytes, Capped> {
    let announced = resp.content_length();
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(Capped::TooLarge);
    }
    let mut body = bytes::BytesMut::with_capacity(announced.map_or(0, |n| n as usize));
    while let Some(chunk) = resp.chunk().await.map_err(Capped::Transport)? {
        if body.len() + chunk.len() > limit {
            return Err(Capped::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// The start of an error answer ([`MAX_ERROR_BODY_BYTES`] at most), as text;
/// a body that cannot be read is an empty message.
async fn read_error_body(mut resp: reqwest::Response) -> String {
    let mut body = Vec::new();
    while body.len() < MAX_ERROR_BODY_BYTES {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                let room = MAX_ERROR_BODY_BYTES - body.len();
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    String::from_utf8_lossy(&body).into_owned()
}

/// Full-jitter exponential backoff; a server's `Retry-After` is a floor.
pub(crate) fn backoff(
    attempt: u32,
    base: Duration,
    cap: Duration,
    retry_after: Option<Duration>,
    jitter: f64,
) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.min(16)).min(cap);
    let jittered = exp.mul_f64(0.5 + jitter.clamp(0.0, 1.0) / 2.0);
    match retry_after {
        Some(ra) => ra.min(Duration::from_secs(60)).max(jittered),
        None => jittered,
    }
}

fn parse_retry_after(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate_to_system_time(v)?;
    when.duration_since(std::time::SystemTime::now()).ok()
}

fn httpdate_to_system_time(v: &str) -> Option<std::time::SystemTime> {
    chrono::DateTime::parse_from_rfc2822(v)
        .ok()
        .map(|d| std::time::SystemTime::from(d.with_timezone(&chrono::Utc)))
}

/// The error a Fly answer of `status` with `body` becomes for a call `op`
/// on `machine`, as the client reads it: for the model check only (#32
/// item 13j, a 409's text).
#[doc(hidden)]
pub fn answer_error(
    op: &'static str,
    app: &AppName,
    machine: Option<&MachineId>,
    status: u16,
    body: &str,
) -> FlyError {
    let call = Call::new(op, Method::POST, app, machine);
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    status_error(&call, status, body, None)
}

fn status_error(
    call: &Call<'_>,
    status: StatusCode,
    body: &str,
    retry_after: Option<Duration>,
) -> FlyError {
    // Fly's `ErrorResponse` carries `error`; some answers (a 409 on a
    // lease among them) say why in `message` instead, or in both.
    #[derive(Deserialize)]
    struct ErrorBody {
        #[serde(default)]
        error: Option<String>,
        #[serde(default)]
        message: Option<String>,
    }
    let said = serde_json::from_str::<ErrorBody>(body).ok().and_then(|b| {
        match (
            b.error.filter(|e| !e.is_empty()),
            b.message.filter(|m| !m.is_empty()),
        ) {
            (Some(e), Some(m)) if e != m => Some(format!("{e}: {m}")),
            (Some(e), _) => Some(e),
            (None, m) => m,
        }
    });
    let message = said
        .map(|m| crate::text::bounded(&m, 200))
        .unwrap_or_else(|| body.chars().take(200).collect());
    let app = call.app.to_string();
    let machine = call.machine.map(str::to_string);
    match status.as_u16() {
        401 | 403 => FlyError::Unauthorized {
            op: call.op,
            app,
            status: status.as_u16(),
        },
        404 => FlyError::NotFound {
            op: call.op,
            app,
            machine,
            message,
        },
        409 => FlyError::LeaseConflict {
            op: call.op,
            app,
            machine: machine.unwrap_or_default(),
            message,
        },
        412 => FlyError::StaleVersion {
            op: call.op,
            app,
            machine: machine.unwrap_or_default(),
        },
        429 => FlyError::RateLimited {
            op: call.op,
            app,
            machine,
            retry_after,
        },
        code => FlyError::Status {
            op: call.op,
            app,
            machine,
            status: code,
            message,
        },
    }
}

fn decode<T: serde::de::DeserializeOwned>(
    body: &[u8],
    op: &'static str,
    app: &AppName,
) -> Result<T, FlyError> {
    // serde quotes the offending value: bounded, whatever Fly sent.
    serde_json::from_slice(body).map_err(|e| FlyError::Decode {
        op,
        app: app.to_string(),
        message: crate::text::bounded(&e.to_string(), crate::text::MAX_DETAIL_CHARS),
    })
}

fn null_as_empty_vec<'de, D: serde::Deserializer<'de>, T: serde::Deserialize<'de>>(
    d: D,
) -> Result<Vec<T>, D::Error> {
    let mut items = Option::<Vec<T>>::deserialize(d)?.unwrap_or_default();
    // A decoded sequence grows by doubling from 4: one check would
    // otherwise hold the room of four for as long as its machine is kept.
    items.shrink_to_fit();
    Ok(items)
}

fn exit_events<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<MachineEvent>, D::Error> {
    let mut events: Vec<MachineEvent> = Option::deserialize(d)?.unwrap_or_default();
    events.retain(|e| e.kind == MachineEvent::EXIT);
    events.shrink_to_fit();
    Ok(events)
}

/// Anything, or the part of it that was understood: a field of an
/// unexpected shape is read as absent rather than failing the machine
/// (and with it the app's whole listing).
#[derive(Deserialize)]
#[serde(untagged)]
enum Lenient<T> {
    Read(T),
    Other(serde::de::IgnoredAny),
}

impl<T> Lenient<T> {
    fn read(self) -> Option<T> {
        match self {
            Lenient::Read(t) => Some(t),
            Lenient::Other(_) => None,
        }
    }
}

/// The number of entries of a map (the values are skipped).
fn count_entries<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    let map = Option::<Lenient<BTreeMap<String, serde::de::IgnoredAny>>>::deserialize(d)?;
    Ok(map.and_then(Lenient::read).map_or(0, |m| m.len()))
}

/// The number of checks over every service of a config.
fn count_service_checks<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    #[derive(Deserialize)]
    struct Service {
        #[serde(default)]
        checks: Option<Lenient<Vec<serde::de::IgnoredAny>>>,
    }
    let services = Option::<Lenient<Vec<Lenient<Service>>>>::deserialize(d)?;
    Ok(services
        .and_then(Lenient::read)
        .unwrap_or_default()
        .into_iter()
        .filter_map(Lenient::read)
        .filter_map(|s| s.checks.and_then(Lenient::read))
        .map(|c| c.len())
        .fold(0, usize::saturating_add))
}

/// `stop_config.timeout`: a Go duration (`"10s"`, `"1m30s"`), or a number
/// of nanoseconds (fly-go `Duration` accepts both). Capped at Fly's
/// [`MAX_STOP_TIMEOUT`]; a value that cannot be read is taken as the cap,
/// which only lengthens the waits it bounds.
fn stop_timeout<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum GoDuration {
        Nanos(u64),
        Text(String),
    }
    #[derive(Deserialize)]
    struct StopConfig {
        #[serde(default)]
        timeout: Option<Lenient<GoDuration>>,
    }
    let config = Option::<Lenient<StopConfig>>::deserialize(d)?;
    let Some(timeout) = config.and_then(Lenient::read).and_then(|c| c.timeout) else {
        return Ok(None);
    };
    let read = match timeout.read() {
        Some(GoDuration::Nanos(n)) => Some(Duration::from_nanos(n)),
        Some(GoDuration::Text(t)) => humantime::parse_duration(t.trim()).ok(),
        None => None,
    };
    Ok(Some(
        read.map_or(MAX_STOP_TIMEOUT, |t| t.min(MAX_STOP_TIMEOUT)),
    ))
}

/// An RFC 3339 instant, or `None` when absent or unreadable.
fn lenient_time<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
    let text = Option::<Lenient<String>>::deserialize(d)?;
    Ok(text
        .and_then(Lenient::read)
        .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
        .map(|t| t.with_timezone(&Utc)))
}

/// An event's `request.exit_event` (or, as fly-go's `GetExitCode` prefers,
/// `request.MonitorEvent.exit_event`).
fn exit_of_request<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<ExitDetail>, D::Error> {
    #[derive(Deserialize)]
    struct Exit {
        #[serde(default)]
        exit_code: i64,
        #[serde(default)]
        restarting: bool,
        #[serde(default)]
        requested_stop: bool,
    }
    #[derive(Deserialize)]
    struct Monitor {
        #[serde(default)]
        exit_event: Option<Lenient<Exit>>,
    }
    #[derive(Deserialize)]
    struct Request {
        #[serde(default)]
        exit_event: Option<Lenient<Exit>>,
        #[serde(default, rename = "MonitorEvent")]
        monitor_event: Option<Lenient<Monitor>>,
    }
    let request = Option::<Lenient<Request>>::deserialize(d)?.and_then(Lenient::read);
    let Some(request) = request else {
        return Ok(None);
    };
    let monitored = request
        .monitor_event
        .and_then(Lenient::read)
        .and_then(|m| m.exit_event)
        .and_then(Lenient::read);
    Ok(monitored
        .or_else(|| request.exit_event.and_then(Lenient::read))
        .map(|e| ExitDetail {
            exit_code: e.exit_code,
            restarting: e.restarting,
            requested_stop: e.requested_stop,
        }))
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    Ok(Option::<BTreeMap<String, String>>::deserialize(d)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The labels dashboards and alerts already use: derived from the
    /// variant names now, and pinned here so a rename is seen.
    #[test]
    fn error_kinds_keep_their_labels() {
        use strum::VariantArray;
        let labels: Vec<&str> = FlyErrorKind::VARIANTS.iter().map(|k| k.into()).collect();
        assert_eq!(
            labels,
            [
                "unauthorized",
                "no_token",
                "not_found",
                "lease_conflict",
                "stale_version",
                "lease_nonce_changed",
                "wait_timeout",
                "status",
                "transport",
                "outcome_unknown",
                "too_large",
                "past_deadline",
                "rate_limited",
                "decode",
            ]
        );
        let e = FlyError::WaitTimeout {
            app: "a".into(),
            machine: "m".into(),
            state: WaitState::Started,
        };
        assert_eq!(
            (e.error_kind(), e.kind()),
            (FlyErrorKind::WaitTimeout, "wait_timeout")
        );
    }

    /// The names sent are the `state` enum of Fly's OpenAPI specification
    /// (`GET /apps/{app_name}/machines/{machine_id}/wait`).
    #[test]
    fn wait_states_are_sent_as_the_api_names_them() {
        let names: Vec<&str> = [
            WaitState::Started,
            WaitState::Stopped,
            WaitState::Suspended,
            WaitState::Destroyed,
            WaitState::Failed,
            WaitState::Settled,
        ]
        .into_iter()
        .map(<&str>::from)
        .collect();
        assert_eq!(
            names,
            [
                "started",
                "stopped",
                "suspended",
                "destroyed",
                "failed",
                "settled"
            ]
        );
        assert_eq!(WaitState::Started.to_string(), "started");
    }

    #[test]
    fn backoff_grows_caps_and_honours_retry_after() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(2);
        assert_eq!(backoff(0, base, cap, None, 1.0), base);
        assert_eq!(backoff(3, base, cap, None, 1.0), Duration::from_millis(800));
        assert_eq!(backoff(10, base, cap, None, 1.0), cap);
        // Jitter only shortens, to at most half.
        assert_eq!(backoff(3, base, cap, None, 0.0), Duration::from_millis(400));
        assert_eq!(
            backoff(0, base, cap, Some(Duration::from_secs(5)), 0.5),
            Duration::from_secs(5)
        );
        // A hostile Retry-After cannot park us for an hour.
        assert_eq!(
            backoff(0, base, cap, Some(Duration::from_secs(3600)), 0.5),
            Duration::from_secs(60)
        );
    }

    fn key(machine: &str, action: &'static str) -> BucketKey {
        BucketKey {
            app: "a".into(),
            machine: Some(machine.into()),
            action,
        }
    }

    #[test]
    fn a_bucket_refills_and_idle_buckets_are_dropped() {
        let limiter = RateLimiter::new(RateLimits::FLY);
        let t0 = Instant::now();
        let secs = |n: u64| t0 + Duration::from_secs(n);
        let sends: Vec<Instant> = (0..5)
            .map(|_| limiter.reserve(key("m", "restart"), t0, None).unwrap())
            .collect();
        assert_eq!(sends, [t0, t0, t0, secs(1), secs(2)]);
        // Refused past a deadline: the token is not taken.
        assert_eq!(
            limiter.reserve(key("m", "restart"), t0, Some(secs(3))),
            Err(Duration::from_secs(3))
        );
        assert_eq!(
            limiter.reserve(key("m", "restart"), t0, Some(secs(4))),
            Ok(secs(3))
        );
        // Long idle: a full burst again.
        let later = secs(100);
        let sends: Vec<Instant> = (0..4)
            .map(|_| limiter.reserve(key("m", "restart"), later, None).unwrap())
            .collect();
        assert_eq!(sends, [later, later, later, later + Duration::from_secs(1)]);

        // Memory: thousands of machines each touched once, one second
        // apart, keep only the buckets not yet full again.
        for i in 0..10_000u64 {
            limiter
                .reserve(key(&format!("m{i}"), "cordon"), secs(200 + i), None)
                .unwrap();
        }
        assert!(
            limiter.buckets() <= 2 * MIN_PRUNE_AT,
            "{} buckets kept",
            limiter.buckets()
        );
    }

    #[test]
    fn machine_decodes_spec_shape_with_null_metadata() {
        let m: Machine = serde_json::from_str(
            r#"{"id":"148e","name":"n","state":"started","region":"iad","instance_id":"01H","private_ip":"fdaa::2","config":{"metadata":null,"image":"x"},"checks":[]}"#,
        )
        .unwrap();
        assert_eq!(m.metadata("pool"), Ok(None));
        assert!(m.is_started());
        let m: Machine = serde_json::from_str(
            r#"{"id":"1","state":"stopped","config":{"metadata":{"pool":"a"}}}"#,
        )
        .unwrap();
        assert_eq!(m.metadata("pool"), Ok(Some("a")));
    }

    /// A host Fly cannot reach shows `incomplete_config`: its metadata is
    /// unknown, never empty, even where the partial config carries keys.
    #[test]
    fn an_unreachable_host_hides_the_metadata_instead_of_emptying_it() {
        let m: Machine = serde_json::from_str(
            r#"{"id":"1","state":"started","host_status":"unreachable","incomplete_config":{"metadata":{"pool":"a"}},"cordoned":true,
                "checks":[{"name":"http","status":"critical"}],"events":[{"type":"exit","status":"stopped","timestamp":5}]}"#,
        )
        .unwrap();
        assert!(!m.host_ok());
        assert!(m.metadata("pool").is_err());
        assert!(m.known_metadata().is_err());
        assert_eq!(m.cordoned, Some(true));
        assert!(!m.checks[0].passing());
        assert_eq!(m.events[0].kind, "exit");
        // A host status this version does not know is not `ok` either.
        let m: Machine =
            serde_json::from_str(r#"{"id":"1","host_status":"degraded","config":{"metadata":{}}}"#)
                .unwrap();
        assert_eq!(m.host_status, HostStatus::Other);
        assert!(m.metadata("pool").is_err());
        // No config at all (a summary listing) is unknown too.
        let m: Machine = serde_json::from_str(r#"{"id":"1","host_status":"ok"}"#).unwrap();
        assert!(m.metadata("pool").is_err());
    }

    #[test]
    fn lease_accepts_envelope_and_flat_and_hides_nonce() {
        let l: LeaseResponse = serde_json::from_str(
            r#"{"status":"success","data":{"nonce":"n1","expires_at":5,"owner":"o"}}"#,
        )
        .unwrap();
        let LeaseResponse::<Lease>::Envelope { data } = l else {
            panic!("expected envelope")
        };
        assert_eq!(data.nonce.expose_secret(), "n1");
        assert!(!format!("{data:?}").contains("n1"));
        let l: LeaseResponse = serde_json::from_str(r#"{"nonce":"n2","expires_at":5}"#).unwrap();
        assert!(
            matches!(l, LeaseResponse::Flat(Lease { ref nonce, .. }) if nonce.expose_secret() == "n2")
        );
    }

    #[test]
    fn token_header_rule() {
        let cfg = FlyClientConfig::new("http://127.0.0.1:1");
        assert!(FlyClient::new(cfg.clone(), "  ").is_err());
        assert!(FlyClient::new(cfg.clone(), "bad\ntoken").is_err());
        let c = FlyClient::new(cfg, "secret-token").unwrap();
        assert!(!format!("{c:?}").contains("secret-token"));
    }

    #[test]
    fn urls_escape_path_segments() {
        let c = FlyClient::new(FlyClientConfig::new("http://h:1/"), "t").unwrap();
        let segments = ["metadata", "a/b"];
        let (app, machine) = (AppName::from("my app"), MachineId::from("m1"));
        let mut call = Call::new("x", Method::GET, &app, Some(&machine));
        call.segments = &segments;
        assert_eq!(
            c.url(&call).as_str(),
            "http://h:1/v1/apps/my%20app/machines/m1/metadata/a%2Fb"
        );
    }

    /// fly-go `tokens.go`: a bare macaroon (`fm1r_`, `fm1a_`, `fm2_`, alone
    /// or among comma-separated tokens) is sent as `FlyV1`, anything else
    /// as `Bearer`; a token already carrying `FlyV1 ` goes verbatim.
    #[test]
    fn item13i_a_bare_macaroon_is_sent_as_flyv1() {
        let header = |t: &str| auth_header(t).unwrap().to_str().unwrap().to_string();
        assert_eq!(header("fm2_abc"), "FlyV1 fm2_abc");
        assert_eq!(header(" fm1r_abc "), "FlyV1 fm1r_abc");
        assert_eq!(header("fm1a_abc,fm2_def"), "FlyV1 fm1a_abc,fm2_def");
        assert_eq!(header("oauth-token,fm2_def"), "FlyV1 oauth-token,fm2_def");
        assert_eq!(header("FlyV1 fm2_abc"), "FlyV1 fm2_abc");
        assert_eq!(header("fm3_abc"), "Bearer fm3_abc");
        assert_eq!(header("secret-token"), "Bearer secret-token");
    }

    /// What a machine's config says of its checks and stop timeout, and
    /// what an exit event's request says of the exit (fly-go shapes).
    #[test]
    fn item13_config_checks_stop_timeout_and_exit_details_are_read() {
        let m: Machine = serde_json::from_value(serde_json::json!({
            "id": "m1", "state": "started",
            "config": {
                "metadata": {},
                "checks": {"alive": {"type": "tcp", "port": 8080}, "db": {"type": "http"}},
                "services": [
                    {"internal_port": 8080, "checks": [{"type": "http"}, {"type": "tcp"}]},
                    {"internal_port": 9090},
                    {"internal_port": 9091, "checks": null}
                ],
                "stop_config": {"timeout": "1m30s", "signal": "SIGINT"}
            },
            "checks": [{"name": "alive", "status": "passing", "updated_at": "2026-08-21T10:00:00.250Z"},
                       {"name": "db", "status": "passing", "updated_at": "yesterday"}],
            "events": [
                {"type": "exit", "status": "stopped", "timestamp": 3,
                 "request": {"exit_event": {"exit_code": 1, "restarting": true, "requested_stop": false}, "restart_count": 2}},
                {"type": "exit", "status": "stopped", "timestamp": 2,
                 "request": {"MonitorEvent": {"exit_event": {"exit_code": 143, "requested_stop": true}},
                             "exit_event": {"exit_code": 0}}},
                {"type": "exit", "status": "stopped", "timestamp": 1}
            ]
        }))
        .unwrap();
        let config = m.config.as_ref().unwrap();
        assert_eq!((config.checks, config.service_checks), (2, 2));
        assert_eq!(config.defined_checks(), 4);
        assert_eq!(config.stop_timeout, Some(Duration::from_secs(90)));
        assert_eq!(
            m.checks[0].updated_at.map(|t| t.timestamp_millis()),
            Some(1_787_306_400_250)
        );
        assert_eq!(m.checks[1].updated_at, None, "unreadable: never fresh");
        let exits: Vec<Option<ExitDetail>> = m.events.iter().map(|e| e.exit).collect();
        assert_eq!(
            exits,
            [
                Some(ExitDetail {
                    exit_code: 1,
                    restarting: true,
                    requested_stop: false
                }),
                // fly-go's `GetExitCode` prefers the monitor's exit event.
                Some(ExitDetail {
                    exit_code: 143,
                    restarting: false,
                    requested_stop: true
                }),
                None,
            ]
        );
        // Stop timeouts: nanoseconds, capped at 300 s, unreadable as the cap.
        let stop = |v: serde_json::Value| -> Option<Duration> {
            serde_json::from_value::<MachineConfig>(serde_json::json!({ "stop_config": v }))
                .unwrap()
                .stop_timeout
        };
        assert_eq!(
            stop(serde_json::json!({"timeout": 5_000_000_000u64})),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            stop(serde_json::json!({"timeout": "10m"})),
            Some(MAX_STOP_TIMEOUT)
        );
        assert_eq!(
            stop(serde_json::json!({"timeout": "soon"})),
            Some(MAX_STOP_TIMEOUT)
        );
        assert_eq!(stop(serde_json::json!({"signal": "SIGTERM"})), None);
        assert_eq!(stop(serde_json::json!(null)), None);
        // A field of an unexpected shape is absent, not a failed listing.
        let odd: MachineConfig = serde_json::from_value(serde_json::json!({
            "checks": ["not", "a", "map"], "services": {"x": 1}, "stop_config": "10s"
        }))
        .unwrap();
        assert_eq!((odd.defined_checks(), odd.stop_timeout), (0, None));
    }

    /// fly-go `machine_types.go`: console, release-command and test-machine
    /// machines of the Apps platform are not the app's own.
    #[test]
    fn item13h_one_off_command_machines_are_told_apart() {
        let machine = |metadata: serde_json::Value, host: &str| -> Machine {
            serde_json::from_value(serde_json::json!({
                "id": "m1", "state": "started", "host_status": host,
                "config": {"metadata": metadata}
            }))
            .unwrap()
        };
        let v2 = |group: &str| serde_json::json!({"fly_platform_version": "v2", "fly_process_group": group});
        for group in [
            "fly_app_console",
            "fly_app_release_command",
            "fly_app_test_machine_command",
        ] {
            assert!(machine(v2(group), "ok").is_one_off_command(), "{group}");
        }
        assert!(
            machine(serde_json::json!({"fly_platform_version": "v2", "process_group": "release_command"}), "ok")
                .is_one_off_command()
        );
        assert!(!machine(v2("app"), "ok").is_one_off_command());
        assert!(
            !machine(
                serde_json::json!({"fly_process_group": "fly_app_console"}),
                "ok"
            )
            .is_one_off_command()
        );
        // Unknown metadata is not read as anything.
        assert!(!machine(v2("fly_app_console"), "unreachable").is_one_off_command());
    }
}

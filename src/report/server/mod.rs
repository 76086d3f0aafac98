//! The daemon's HTTP server (axum): metrics, health, the fleet API, operator
//! controls and the status page.
//!
//! Owns the routes of docs/design.md §8.4 and the shared [`FleetView`] the sweep loop
//! publishes into (the last sweep's `decide::Snapshot`: pages and
//! `/api/v1/machines/{id}` read its rows' controls and agent reports, and
//! `/api/v1/fleet` is written from it as a [`FleetDocument`]). Reads are
//! served from the last sweep, marked with its age on this daemon's clock
//! and `stale` past `alerts.stale_after` ([`Observed::view_age`]), and never
//! trigger one; the only ways it touches the world are the admin POSTs, which write
//! operator metadata through [`Operator`] (hold / release / approve / revoke) or wake
//! the loop ([`ServerState::refresh_requests`]), all behind the bearer admin
//! token compared in constant time. It must never run a sweep, act on a
//! machine beyond those metadata writes, echo a secret, or panic in a handler.
//!
//! It must also stay up for the fleet's reads while someone misbehaves:
//! connections, header time, request time and bodies are bounded, and failed
//! admin authentications are rate-limited per source, logged (never with a
//! token) and counted (`limits`, `listen`).
//!
//! Layout: this file (state, routes, handlers), `listen` (the accept loop),
//! `limits` (the limits and the admin-auth limiter), `page` (the HTML status
//! page and the per-machine pages), `trend` (the ring of recent sweeps'
//! coherence the status page draws), `detail` (one machine's document,
//! written here and read back by `status MACHINE`) and `client` (the typed
//! client the `status` command uses).

mod client;
mod detail;
mod limits;
mod listen;
mod page;
mod trend;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::error_handling::HandleErrorLayer;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::BoxError;
use tower::timeout::TimeoutLayer;

use crate::act::operator::{Operator, OperatorError};
use crate::clock::SharedClock;
use crate::decide::alerts::COORDINATOR_UNREADABLE_SWEEPS;
use crate::decide::coherence::CoherenceSample;
use crate::decide::decision::Decision;
use crate::decide::snapshot::Snapshot;
use crate::metadata::operator::{Approval, ApprovalMode, Hold};
use crate::metadata::{APPROVE_KEY, HOLD_KEY, MARKER_KEY};
use crate::model::{CommitId, MachineId};
use crate::observe::sweep::ObservedMachine;
use crate::report::history::{self, MachineHistory};
use crate::report::metrics::{self, Metrics};
use crate::report::wire::{FleetDocument, MachineRow, RowView, ViewAge};

pub use client::{
    MAX_FLEET_BODY_BYTES, MAX_MACHINE_BODY_BYTES, MachineView, StatusError, fetch_fleet,
    fetch_machine, parse_fleet,
};
pub use detail::{Control, MachineDetail};
pub use limits::{AuthLimiter, MAX_TRACKED_SOURCES, ServerLimits};
pub use listen::serve;

use limits::{AuthFailure, FailureLog};
pub use page::{render_machine_page, render_status_page};
pub use trend::{CoherenceTrend, TREND_SAMPLES};

/// Ready means a sweep succeeded within this many sweep intervals.
pub const READY_INTERVALS: u32 = 3;
/// `/healthz` fails when the loop has finished no turn (a sweep, or a sweep
/// that failed as a whole) for this many sweep intervals plus
/// [`Observed::turn_allowance`]: the loop itself is stuck.
pub const LIVE_INTERVALS: u32 = 5;
/// The longest path a log line carries.
const MAX_LOGGED_PATH: usize = 200;
/// The `by` recorded when an admin request does not say who it is.
const DEFAULT_ACTOR: &str = "admin-api";

/// What the sweep loop knows beyond the report, per machine (keyed by
/// machine id): the planner/executor fill it; every field is optional.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MachineExtra {
    /// What the planner decided for the machine in the last sweep.
    pub decision: Option<Decision>,
    /// Recent rotation history, oldest first, one entry per step (shared
    /// with the reporter's [`crate::report::history::History`]).
    pub history: MachineHistory,
    /// When the planner first saw the machine's current drift (its clock:
    /// the server keeps none of its own).
    pub drift_since: Option<DateTime<Utc>>,
}

impl MachineExtra {
    /// The history of machine `m` as shown (page, API and `status MACHINE`).
    pub fn history_lines(&self, m: &ObservedMachine) -> Vec<String> {
        history::lines(&self.history, m.app.as_str(), m.machine_id.as_str())
    }
}

/// The last failed sweep.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepFailure {
    pub at: DateTime<Utc>,
    pub error: String,
}

/// Everything the server shows, as of the last sweep.
#[derive(Clone, Debug)]
pub struct Observed {
    pub report: Option<Arc<Snapshot>>,
    /// When the last successful sweep finished.
    pub last_success: Option<DateTime<Utc>>,
    pub last_failure: Option<SweepFailure>,
    /// `sweep.interval`: readiness allows [`READY_INTERVALS`] of them; the
    /// status page refreshes once per interval.
    pub sweep_interval: Duration,
    pub extras: Arc<BTreeMap<MachineId, MachineExtra>>,
    /// The release tip most recently fetched (may be newer than the report's);
    /// approvals name it.
    pub tip: Option<CommitId>,
    /// `alerts.coherence_threshold`: the status page colours by it.
    pub coherence_threshold: f64,
    /// When the server's view was created (readiness reasons, tip age).
    pub started_at: DateTime<Utc>,
    /// When the loop last finished a turn, successful or not (liveness).
    pub last_turn: Option<DateTime<Utc>>,
    /// How long one turn may legitimately take beyond the interval (Fly
    /// calls with their retries); added to the liveness window.
    pub turn_allowance: Duration,
    /// The coherence figures of the last [`TREND_SAMPLES`] sweeps (the
    /// status page's chart); filled by [`FleetView::record_sweep`].
    pub trend: Arc<CoherenceTrend>,
    /// `alerts.stale_after`: a view older than this is marked stale.
    pub stale_after: Duration,
}

impl Observed {
    /// When the machine's current drift (or trouble) started, if known.
    pub fn drift_since(&self, machine_id: &MachineId) -> Option<DateTime<Utc>> {
        self.extras.get(machine_id).and_then(|e| e.drift_since)
    }

    /// The commit approvals target: the last fetched tip, else the report's.
    pub fn current_tip(&self) -> Option<&CommitId> {
        self.tip
            .as_ref()
            .or_else(|| self.report.as_ref().map(|r| &r.tip.commit))
    }

    /// `Ok` unless the loop has finished no turn for [`LIVE_INTERVALS`]
    /// sweep intervals plus the turn allowance (counted from start before
    /// the first turn).
    pub fn liveness(&self, now: DateTime<Utc>) -> Result<(), String> {
        let window = self.sweep_interval * LIVE_INTERVALS + self.turn_allowance;
        let last = self.last_turn.unwrap_or(self.started_at);
        if (now - last).to_std().unwrap_or_default() > window {
            return Err(format!(
                "the sweep loop has finished no sweep for {} (more than {})",
                age(now, last),
                humantime::format_duration(window)
            ));
        }
        Ok(())
    }

    /// How old the view is at `now` (this daemon's clock), stale when older
    /// than `stale_after`, with why; `None` before the first sweep.
    pub fn view_age(&self, now: DateTime<Utc>) -> Option<ViewAge> {
        let swept_at = self.last_success?;
        let age = (now - swept_at).to_std().unwrap_or_default();
        let stale = age > self.stale_after;
        let stale_reason = stale.then(|| {
            let why = match &self.last_failure {
                Some(f) if f.at > swept_at => format!("the sweeps since fail: {}", f.error),
                _ => "no sweep has finished since (the loop is waiting or stuck)".to_owned(),
            };
            format!(
                "data from {} ago, older than alerts.stale_after ({}); {why}",
                humantime::format_duration(Duration::from_secs(age.as_secs())),
                humantime::format_duration(self.stale_after)
            )
        });
        Some(ViewAge {
            swept_at,
            age_secs: age.as_secs(),
            stale,
            stale_reason,
        })
    }

    /// `Ok` when a sweep succeeded within [`READY_INTERVALS`] intervals of
    /// `now` and that sweep could read the coordinator's slot set (when one
    /// is configured): without it no rotation can start, drain or restart,
    /// whatever else works.
    pub fn readiness(&self, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
        let at = self.swept_recently(now)?;
        if let Some(why) = self.report.as_deref().and_then(|r| r.slots.unreadable()) {
            return Err(format!(
                "the coordinator's slot set cannot be read ({why}): no rotation can start, drain or restart; coordinator_unreadable fires after {COORDINATOR_UNREADABLE_SWEEPS} sweep intervals"
            ));
        }
        Ok(at)
    }

    /// `Ok` when a sweep succeeded within [`READY_INTERVALS`] intervals of `now`.
    fn swept_recently(&self, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
        let window = self.sweep_interval * READY_INTERVALS;
        let failure = self
            .last_failure
            .as_ref()
            .map(|f| format!("; last failure: {}", f.error))
            .unwrap_or_default();
        match self.last_success {
            None => Err(format!(
                "no successful sweep yet (up {}){failure}",
                age(now, self.started_at)
            )),
            Some(at) if (now - at).to_std().unwrap_or_default() > window => Err(format!(
                "last successful sweep {} ago, more than {READY_INTERVALS} sweep intervals ({}){failure}",
                age(now, at),
                humantime::format_duration(window)
            )),
            Some(at) => Ok(at),
        }
    }
}

/// The shared view the sweep loop publishes into and the server reads.
/// Cheap to clone; the lock is never held across an `.await`.
#[derive(Clone, Debug)]
pub struct FleetView {
    inner: Arc<RwLock<Observed>>,
}

impl FleetView {
    pub fn new(sweep_interval: Duration, now: DateTime<Utc>) -> FleetView {
        FleetView {
            inner: Arc::new(RwLock::new(Observed {
                report: None,
                last_success: None,
                last_failure: None,
                sweep_interval,
                extras: Arc::default(),
                tip: None,
                coherence_threshold: 1.0,
                started_at: now,
                last_turn: None,
                turn_allowance: Duration::ZERO,
                trend: Arc::default(),
                stale_after: sweep_interval * crate::config::ALERT_SWEEPS,
            })),
        }
    }

    /// A consistent copy of the view (the report and maps are shared, not copied).
    pub fn snapshot(&self) -> Observed {
        self.inner.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Applies `f` under the write lock.
    pub fn update<T>(&self, f: impl FnOnce(&mut Observed) -> T) -> T {
        let mut guard = self.inner.write().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }

    /// Publishes a successful sweep that finished at `at`.
    pub fn record_sweep(&self, report: Snapshot, at: DateTime<Utc>) {
        self.update(|o| {
            Arc::make_mut(&mut o.trend).push(CoherenceSample::of_listed(&report, at));
            o.report = Some(Arc::new(report));
            o.last_success = Some(at);
            o.last_turn = Some(at);
        });
    }

    /// Publishes a sweep's snapshot before its steps run (its `record_sweep`
    /// follows, with the same time): shown and counted as the last success,
    /// but no point of the coherence trend yet; the machines' decisions stay
    /// the sweep before's until then.
    pub fn record_observed(&self, report: Snapshot, at: DateTime<Utc>) {
        self.update(|o| {
            o.report = Some(Arc::new(report));
            o.last_success = Some(at);
            o.last_turn = Some(at);
        });
    }

    /// Records a sweep that failed as a whole; the last report stays shown.
    pub fn record_failure(&self, error: impl Into<String>, at: DateTime<Utc>) {
        let error = error.into();
        self.update(|o| {
            o.last_failure = Some(SweepFailure { at, error });
            o.last_turn = Some(at);
        });
    }

    /// Replaces the per-machine rotation data.
    pub fn set_extras(&self, extras: BTreeMap<MachineId, MachineExtra>) {
        self.update(|o| o.extras = Arc::new(extras));
    }

    /// The release tip just fetched (full commit id).
    pub fn set_tip(&self, commit: &CommitId) {
        self.update(|o| o.tip = Some(commit.clone()));
    }

    pub fn set_coherence_threshold(&self, threshold: f64) {
        self.update(|o| o.coherence_threshold = threshold);
    }
}

/// The admin token, kept only as a digest so it can be compared in constant
/// time whatever its length, and can never be printed.
#[derive(Clone)]
enum AdminAuth {
    Disabled { env: String },
    Enabled { digest: [u8; 32] },
}

fn limiter(limits: &ServerLimits) -> AuthLimiter {
    AuthLimiter::new(limits.admin_auth_failures, limits.admin_auth_window)
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

/// Everything a handler may use. Cheap to clone.
#[derive(Clone)]
pub struct ServerState {
    metrics: Arc<Metrics>,
    view: FleetView,
    operator: Option<Operator>,
    admin: AdminAuth,
    refresh: Arc<Notify>,
    limits: ServerLimits,
    auth_limiter: Arc<AuthLimiter>,
    /// The time every page, health answer and operator write is stamped
    /// with: the service's clock (a paused one in tests).
    clock: SharedClock,
}

impl std::fmt::Debug for ServerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerState")
            .field("operator", &self.operator.is_some())
            .field(
                "admin_api",
                &matches!(self.admin, AdminAuth::Enabled { .. }),
            )
            .finish_non_exhaustive()
    }
}

impl ServerState {
    /// A state with the admin API disabled and no operator.
    pub fn new(metrics: Arc<Metrics>, view: FleetView) -> ServerState {
        ServerState {
            metrics,
            view,
            operator: None,
            admin: AdminAuth::Disabled {
                env: "FLEET_ADMIN_TOKEN".into(),
            },
            refresh: Arc::new(Notify::new()),
            auth_limiter: Arc::new(limiter(&ServerLimits::default())),
            limits: ServerLimits::default(),
            clock: crate::clock::system(),
        }
    }

    /// The clock the handlers read (the system clock until this is called).
    pub fn with_clock(mut self, clock: SharedClock) -> ServerState {
        self.clock = clock;
        self
    }

    /// The connection, request and admin-authentication limits
    /// (`server.*`; the defaults until this is called).
    pub fn with_limits(mut self, limits: ServerLimits) -> ServerState {
        self.auth_limiter = Arc::new(limiter(&limits));
        self.limits = limits;
        self
    }

    pub fn limits(&self) -> &ServerLimits {
        &self.limits
    }

    /// Enables hold / release / approve.
    pub fn with_operator(mut self, operator: Operator) -> ServerState {
        self.operator = Some(operator);
        self
    }

    /// The admin bearer token read from `env` (`server.admin_token_env`);
    /// `None` or empty disables every admin POST (503 naming `env`).
    /// Surrounding whitespace (a secret set with `echo`) is not part of it:
    /// the presented header is trimmed too.
    pub fn with_admin_token(mut self, token: Option<String>, env: &str) -> ServerState {
        let token = token.map(|t| t.trim().to_string());
        self.admin = match token.filter(|t| !t.is_empty()) {
            Some(t) => AdminAuth::Enabled {
                digest: digest(t.as_bytes()),
            },
            None => AdminAuth::Disabled {
                env: env.to_string(),
            },
        };
        self
    }

    /// Notified once per `POST /api/v1/refresh`; the loop should fetch the
    /// overlay and sweep when it fires (a permit is stored if it is busy).
    pub fn refresh_requests(&self) -> Arc<Notify> {
        Arc::clone(&self.refresh)
    }

    pub fn view(&self) -> &FleetView {
        &self.view
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// The routes of docs/design.md §8.4 over `state`, with the request limits (timeout,
/// body size) on every route and the admin authentication on the POSTs.
pub fn router(state: ServerState) -> Router {
    let request_timeout = state.limits.request_timeout;
    let admin = Router::new()
        .route("/api/v1/machines/{id}/approve", post(approve))
        .route("/api/v1/machines/{id}/hold", post(hold))
        .route("/api/v1/machines/{id}/release", post(release))
        .route("/api/v1/machines/{id}/revoke", post(revoke))
        .route("/api/v1/refresh", post(refresh))
        .route_layer(middleware::from_fn_with_state(state.clone(), admin_auth));
    Router::new()
        .route("/", get(status_page))
        .route("/machines/{id}", get(machine_page))
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/api/v1/fleet", get(fleet))
        .route("/api/v1/machines/{id}", get(machine))
        .merge(admin)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.limits.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            declared_body_limit,
        ))
        .layer(
            tower::ServiceBuilder::new()
                .layer(HandleErrorLayer::new(
                    move |method: Method, uri: Uri, error: BoxError| async move {
                        request_failed(&method, uri.path(), request_timeout, &error)
                    },
                ))
                .layer(TimeoutLayer::new(request_timeout)),
        )
        .layer(trace_layer())
        .with_state(state)
}

/// One DEBUG span per request with its method and bounded path, and DEBUG
/// events for the answer and failures. Headers are never recorded (the
/// admin bearer token), nor the query; a timeout is already logged at WARN
/// by [`request_failed`], so failures stay at DEBUG.
fn trace_layer() -> tower_http::trace::TraceLayer<
    tower_http::classify::SharedClassifier<tower_http::classify::ServerErrorsAsFailures>,
    impl Fn(&Request) -> tracing::Span + Clone,
    (),
    tower_http::trace::DefaultOnResponse,
    (),
    (),
    tower_http::trace::DefaultOnFailure,
> {
    use tower_http::trace::{DefaultOnFailure, DefaultOnResponse, TraceLayer};
    TraceLayer::new_for_http()
        .make_span_with(|req: &Request| {
            // tower-http's target, so `tower_http=debug` shows span and events.
            tracing::debug_span!(
                target: "tower_http::trace",
                "http_request",
                method = %req.method(),
                path = %logged_path(req.uri().path()),
            )
        })
        .on_request(())
        .on_response(DefaultOnResponse::new().level(tracing::Level::DEBUG))
        .on_body_chunk(())
        .on_eos(())
        .on_failure(DefaultOnFailure::new().level(tracing::Level::DEBUG))
}

/// Every request: a declared body over `server.max_body_bytes` is refused
/// before anything reads it (413).
async fn declared_body_limit(
    State(state): State<ServerState>,
    req: Request,
    next: Next,
) -> Response {
    let max = state.limits.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return too_large(max).into_response();
    }
    next.run(req).await
}

/// The whole request, body and handler, must finish within
/// `server.request_timeout` (tower's `TimeoutLayer`, in [`router`]). Its
/// `Elapsed` becomes a 503 that says why (an admin write that was cut off
/// may or may not have happened, and sending it again is safe), closes the
/// connection and is logged at WARN. Not tower-http's `TimeoutLayer`: its
/// answer is a bare status with an empty body, without the reason, the
/// resend advice, the `Connection: close` or the log line.
fn request_failed(method: &Method, path: &str, limit: Duration, error: &BoxError) -> Response {
    if !error.is::<tower::timeout::error::Elapsed>() {
        // The router's own error type is `Infallible`: only the timeout fails.
        return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response();
    }
    let took = humantime::format_duration(limit);
    let path = logged_path(path);
    tracing::warn!(%method, path = %path, timeout = %took, "HTTP request cut off at server.request_timeout");
    let mut resp = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("request not completed within server.request_timeout ({took}); an admin request may or may not have taken effect and can be sent again"),
    )
    .into_response();
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request body larger than server.max_body_bytes ({max} bytes)"),
    )
}

/// The client address the accept loop recorded; the unspecified address
/// when the router is served some other way. IPv4 clients of a dual-stack
/// listener count as their IPv4 address.
fn source_of(req: &Request) -> IpAddr {
    req.extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| addr.ip().to_canonical())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
}

fn logged_path(path: &str) -> String {
    path.chars().take(MAX_LOGGED_PATH).collect()
}

// ---- errors ------------------------------------------------------------------

/// A JSON error answer: `{"error": "..."}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    /// Seconds, for a `Retry-After` header.
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            retry_after: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.message });
        let mut resp = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"fleet-reconciler admin\""),
            );
        }
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

fn operator_error(e: OperatorError) -> ApiError {
    let status = match &e {
        OperatorError::UnknownMachine { .. } => StatusCode::NOT_FOUND,
        OperatorError::Leased { .. } => StatusCode::CONFLICT,
        OperatorError::Fly(_) | OperatorError::Unsearched { .. } => StatusCode::BAD_GATEWAY,
        OperatorError::NoRecordKey(_) => StatusCode::SERVICE_UNAVAILABLE,
        // `resume` is a CLI command only.
        OperatorError::UnknownApp { .. } => StatusCode::NOT_FOUND,
        OperatorError::NoCoordinator
        | OperatorError::NotHalted { .. }
        | OperatorError::OtherTip { .. } => StatusCode::CONFLICT,
        OperatorError::CoordinatorUnreadable { .. } => StatusCode::BAD_GATEWAY,
    };
    ApiError::new(status, e.to_string())
}

/// A machine id from a URL path, typed at the edge. Machine ids are Fly's
/// lowercase hex; anything outside a conservative alphabet is refused
/// before it reaches a URL or a page.
fn checked_id(id: &str) -> Result<MachineId, ApiError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(MachineId::from(id))
    } else {
        Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "machine id must be 1 to 64 letters, digits, '-' or '_'",
        ))
    }
}

fn json_response(status: StatusCode, value: &impl Serialize) -> Response {
    match serde_json::to_string_pretty(value) {
        Ok(text) => (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            text + "\n",
        )
            .into_response(),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode the answer: {e}"),
        )
        .into_response(),
    }
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such route")
}

// ---- reads ---------------------------------------------------------------------

async fn status_page(State(state): State<ServerState>) -> Html<String> {
    Html(render_status_page(
        &state.view.snapshot(),
        state.clock.now(),
    ))
}

/// `GET /machines/{id}`: the machine's page (HTML), read-only. A bad id is
/// 400, no sweep yet 503, a machine not in the last sweep 404, each as a
/// small HTML page.
async fn machine_page(State(state): State<ServerState>, Path(id): Path<String>) -> Response {
    let observed = state.view.snapshot();
    let now = state.clock.now();
    let (status, page) = match checked_id(&id) {
        Err(e) => (
            e.status,
            page::render_message_page("Bad machine id", &e.message),
        ),
        Ok(id) => match render_machine_page(&observed, &id, now) {
            Some(page) => (StatusCode::OK, page),
            None if observed.report.is_none() => (
                StatusCode::SERVICE_UNAVAILABLE,
                page::render_message_page(
                    "No sweep yet",
                    "No sweep has completed yet; this page shows machines after the first sweep.",
                ),
            ),
            None => (
                StatusCode::NOT_FOUND,
                page::render_message_page(
                    "Unknown machine",
                    &format!("Machine {id} is not in the last sweep of any configured app."),
                ),
            ),
        },
    };
    (status, Html(page)).into_response()
}

async fn metrics_text(State(state): State<ServerState>) -> Response {
    match state.metrics.render() {
        Ok(text) => ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response(),
        Err(e) => {
            tracing::error!(error = %e, kind = e.kind(), "cannot render metrics");
            (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
        }
    }
}

async fn healthz(State(state): State<ServerState>) -> Response {
    match state.view.snapshot().liveness(state.clock.now()) {
        Ok(()) => "ok\n".into_response(),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")).into_response(),
    }
}

async fn readyz(State(state): State<ServerState>) -> Response {
    let observed = state.view.snapshot();
    match observed.readiness(state.clock.now()) {
        Ok(at) => json_response(
            StatusCode::OK,
            &serde_json::json!({ "status": "ready", "last_sweep_success": at }),
        ),
        Err(reason) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}"),
        )
        .into_response(),
    }
}

fn last_report(observed: &Observed) -> Result<Arc<Snapshot>, ApiError> {
    observed.report.clone().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no sweep has completed yet; try again after the first sweep",
        )
    })
}

async fn fleet(State(state): State<ServerState>) -> Result<Response, ApiError> {
    let observed = state.view.snapshot();
    let report = last_report(&observed)?;
    // The daemon's decisions of the same sweep: `status` shows them.
    let decisions = observed
        .extras
        .iter()
        .filter_map(|(id, e)| Some((id, e.decision.as_ref()?)));
    let doc = FleetDocument::of(&report)
        .with_decisions(decisions)
        .with_view(observed.view_age(state.clock.now()));
    let body = serde_json::to_string(&doc).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
    let mut resp = ([(header::CONTENT_TYPE, "application/json")], body + "\n").into_response();
    if let Some(at) = observed.last_success {
        let http_date = httpdate::fmt_http_date(at.into());
        if let Ok(v) = HeaderValue::from_str(&http_date) {
            resp.headers_mut().insert(header::LAST_MODIFIED, v);
        }
    }
    Ok(resp)
}

/// The JSON Schema of `GET /api/v1/machines/{id}`'s document, as committed
/// in docs/machine.schema.json.
pub fn machine_schema() -> String {
    let schema = schemars::schema_for!(MachineDetail);
    serde_json::to_string_pretty(&schema).unwrap_or_default() + "\n"
}

/// A metadata value that is not one of ours, shown as written: as JSON when
/// it parses, else as a string.
fn as_written(m: &ObservedMachine, key: &str) -> Option<serde_json::Value> {
    m.inputs
        .metadata
        .get(key)
        .map(|v| serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.clone())))
}

/// A control under `key`: `ours` (as the sweep parsed it,
/// [`crate::metadata::controls`]), else the value as written, else nothing.
fn control<T: Clone>(m: &ObservedMachine, key: &str, ours: Option<&T>) -> Option<Control<T>> {
    match ours {
        Some(value) => Some(Control::Ours(value.clone())),
        None => as_written(m, key).map(Control::Written),
    }
}

async fn machine(
    State(state): State<ServerState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = checked_id(&id)?;
    let observed = state.view.snapshot();
    let report = last_report(&observed)?;
    let Some(m) = report.machines.iter().find(|m| m.seen.machine_id == id) else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("machine {id} is not in the last sweep of any configured app"),
        ));
    };
    let extra = observed.extras.get(&m.seen.machine_id);
    let age = observed.view_age(state.clock.now());
    let detail = MachineDetail {
        schema_version: crate::report::wire::SCHEMA_VERSION,
        machine: MachineRow::from(RowView::from(m)),
        agent_report: m.seen.inputs.report.clone(),
        hold: control(&m.seen, HOLD_KEY, m.seen.inputs.controls.hold()),
        approval: control(&m.seen, APPROVE_KEY, m.seen.inputs.controls.approval()),
        rotation: control(&m.seen, MARKER_KEY, m.seen.inputs.controls.marker()),
        decision: extra.and_then(|e| e.decision.clone()),
        history: extra.map(|e| e.history_lines(&m.seen)).unwrap_or_default(),
        drift_since: observed.drift_since(&m.seen.machine_id),
        tip: report.tip.commit.to_string(),
        swept_at: observed.last_success,
        age_secs: age.as_ref().map(|a| a.age_secs),
        stale: age.as_ref().is_some_and(|a| a.stale),
        stale_reason: age.and_then(|a| a.stale_reason),
        app_stale: report
            .apps
            .iter()
            .find(|a| a.name == m.seen.app)
            .and_then(|a| a.stale.clone()),
    };
    Ok(json_response(StatusCode::OK, &detail))
}

// ---- admin -----------------------------------------------------------------------

/// The admin POSTs' gate: refuses a source that failed too often (429),
/// then checks `Authorization: Bearer <token>` against the admin token;
/// failures are counted, rate-limited and logged without any token.
async fn admin_auth(State(state): State<ServerState>, req: Request, next: Next) -> Response {
    let source = source_of(&req);
    match authorize(&state, &req, source, Instant::now()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

fn authorize(
    state: &ServerState,
    req: &Request,
    source: IpAddr,
    now: Instant,
) -> Result<(), ApiError> {
    let expected = match &state.admin {
        AdminAuth::Disabled { env } => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("admin API disabled: set {env}"),
            ));
        }
        AdminAuth::Enabled { digest } => digest,
    };
    if let Some(wait) = state.auth_limiter.check(source, now) {
        state.metrics.record_admin_auth_failure("rate_limited");
        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        return Err(ApiError {
            retry_after: Some(secs.max(1)),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "too many failed admin authentications from {source}; admin requests from it are refused for {}s",
                    secs.max(1)
                ),
            )
        });
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| token.trim_start())
        });
    let failure = match presented {
        None => AuthFailure::MissingToken,
        Some(token) if bool::from(digest(token.as_bytes()).ct_eq(expected)) => {
            state.auth_limiter.record_success(source);
            return Ok(());
        }
        Some(_) => AuthFailure::WrongToken,
    };
    state.metrics.record_admin_auth_failure(failure.as_str());
    let (method, path) = (req.method(), logged_path(req.uri().path()));
    let window = humantime::format_duration(state.limits.admin_auth_window);
    match state.auth_limiter.record_failure(source, now) {
        FailureLog::First => tracing::warn!(
            source = %source, %method, path = %path, reason = failure.as_str(),
            "admin authentication failed (further failures from this source in the next {window} are counted in fleet_reconciler_admin_auth_failures_total, not logged)"
        ),
        FailureLog::NowLimited {
            failures,
            retry_after,
        } => tracing::warn!(
            source = %source, %method, path = %path, reason = failure.as_str(), failures,
            retry_after_secs = retry_after.as_secs(),
            "admin authentication failed {failures} times within {window}: source limited, its admin requests are answered 429 until its window ends"
        ),
        FailureLog::Quiet => {}
    }
    Err(match failure {
        AuthFailure::MissingToken => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing admin token: send `Authorization: Bearer <token>`",
        ),
        AuthFailure::WrongToken => ApiError::new(StatusCode::UNAUTHORIZED, "wrong admin token"),
    })
}

fn operator(state: &ServerState) -> Result<&Operator, ApiError> {
    state.operator.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "operator controls are not available in this process",
        )
    })
}

/// An optional JSON body; empty means all defaults, unknown fields are refused.
fn body<T: for<'de> Deserialize<'de> + Default>(
    state: &ServerState,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = bytes.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => too_large(state.limits.max_body_bytes),
        status => ApiError::new(status, e.body_text()),
    })?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("request body is not valid: {e}"),
        )
    })
}

fn actor(by: Option<String>) -> String {
    by.map(|b| b.trim().chars().take(200).collect::<String>())
        .filter(|b| !b.is_empty())
        .unwrap_or_else(|| DEFAULT_ACTOR.to_string())
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ApproveBody {
    mode: Option<ApprovalMode>,
    by: Option<String>,
    /// Full commit id to approve; default: the current release tip.
    target: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct HoldBody {
    reason: Option<String>,
    by: Option<String>,
}

async fn approve(
    State(state): State<ServerState>,
    Path(id): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let id = checked_id(&id)?;
    let req: ApproveBody = body(&state, bytes)?;
    let operator = operator(&state)?;
    let target = match req.target {
        Some(t) => CommitId::parse(&t).ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("cannot approve machine {id}: target must be a full 40-hex commit id"),
            )
        })?,
        None => state
            .view
            .snapshot()
            .current_tip()
            .cloned()
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("cannot approve machine {id}: no release tip known yet"),
                )
            })?,
    };
    let approval = Approval {
        target,
        // Like the CLI: interrupting live work is asked for, never a default.
        mode: req.mode.unwrap_or(ApprovalMode::WhenIdle),
        by: actor(req.by),
        at: state.clock.now(),
    };
    let app = operator
        .approve(&id, &approval)
        .await
        .map_err(operator_error)?;
    tracing::info!(
        app = %app, machine_id = id.as_str(), commit = %approval.target, by = %approval.by,
        mode = ?approval.mode, "operator approved a manual rotation"
    );
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({ "app": app, "machine_id": id, "approval": approval }),
    ))
}

async fn hold(
    State(state): State<ServerState>,
    Path(id): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let id = checked_id(&id)?;
    let req: HoldBody = body(&state, bytes)?;
    let operator = operator(&state)?;
    let hold = Hold {
        by: actor(req.by),
        reason: req
            .reason
            .map(|r| r.chars().take(500).collect())
            .unwrap_or_else(|| "held via the admin API".into()),
        at: state.clock.now(),
    };
    let written = operator
        .hold(&id, &hold.by, &hold.reason, hold.at)
        .await
        .map_err(operator_error)?;
    let app = &written.app;
    tracing::info!(app = %app, machine_id = id.as_str(), by = %hold.by, reason = %hold.reason, fenced = written.fenced, "operator put a hold on a machine");
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({ "app": app, "machine_id": id, "hold": hold, "fenced": written.fenced }),
    ))
}

async fn release(
    State(state): State<ServerState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = checked_id(&id)?;
    let operator = operator(&state)?;
    let app = operator.release(&id).await.map_err(operator_error)?;
    tracing::info!(app = %app, machine_id = id.as_str(), "operator released a hold");
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({ "app": app, "machine_id": id, "released": true }),
    ))
}

async fn revoke(
    State(state): State<ServerState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = checked_id(&id)?;
    let operator = operator(&state)?;
    let revoked = operator.revoke(&id).await.map_err(operator_error)?;
    let approval = revoked.removed.as_deref().map(|v| {
        Approval::parse(v)
            .and_then(|a| serde_json::to_value(a).ok())
            .unwrap_or_else(|| v.into())
    });
    tracing::info!(app = %revoked.app, machine_id = id.as_str(), removed = approval.is_some(), fenced = revoked.fenced, "operator revoked an approval");
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({
            "app": revoked.app, "machine_id": id, "revoked": approval.is_some(),
            "approval": approval, "fenced": revoked.fenced,
        }),
    ))
}

async fn refresh(State(state): State<ServerState>) -> Result<Response, ApiError> {
    state.refresh.notify_one();
    tracing::info!("overlay refresh requested through the admin API");
    Ok(json_response(
        StatusCode::ACCEPTED,
        &serde_json::json!({ "status": "refresh requested" }),
    ))
}

/// "3m 12s"-style age of `then` at `now` (never negative).
pub(crate) fn age(now: DateTime<Utc>, then: DateTime<Utc>) -> String {
    let secs = (now - then).num_seconds().max(0) as u64;
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_naturally() {
        let t0 = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let at = |s: i64| t0 + chrono::TimeDelta::seconds(s);
        assert_eq!(age(at(42), t0), "42s");
        assert_eq!(age(at(192), t0), "3m 12s");
        assert_eq!(age(at(2 * 3600 + 300), t0), "2h 5m");
        assert_eq!(age(at(4 * 86_400 + 3 * 3600), t0), "4d 3h");
        assert_eq!(age(t0, at(10)), "0s");
    }

    #[test]
    fn a_view_older_than_stale_after_is_marked_stale_with_why() {
        let t0 = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let later = |s| t0 + chrono::TimeDelta::seconds(s);
        let view = FleetView::new(Duration::from_secs(30), t0);
        assert_eq!(view.snapshot().view_age(t0), None, "no sweep yet");
        view.update(|o| {
            o.last_success = Some(t0);
            o.stale_after = Duration::from_secs(15);
        });
        let fresh = view.snapshot().view_age(later(15)).unwrap();
        assert_eq!(
            (fresh.swept_at, fresh.age_secs, fresh.stale),
            (t0, 15, false)
        );
        assert_eq!(fresh.stale_reason, None);
        let waiting = view.snapshot().view_age(later(16)).unwrap();
        assert!(waiting.stale);
        let why = waiting.stale_reason.unwrap();
        assert!(
            why.starts_with("data from 16s ago, older than alerts.stale_after (15s)"),
            "{why}"
        );
        assert!(why.contains("no sweep has finished since"), "{why}");
        view.record_failure(
            "cannot list machines of app a: Fly API unreachable",
            later(20),
        );
        let why = view
            .snapshot()
            .view_age(later(24))
            .unwrap()
            .stale_reason
            .unwrap();
        assert!(
            why.ends_with(
                "the sweeps since fail: cannot list machines of app a: Fly API unreachable"
            ),
            "{why}"
        );
    }

    #[test]
    fn readiness_needs_a_recent_success() {
        let t0 = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let view = FleetView::new(Duration::from_secs(30), t0);
        let err = view.snapshot().readiness(t0).unwrap_err();
        assert!(err.contains("no successful sweep yet"), "{err}");
        view.record_failure("cannot list machines of app a", t0);
        view.update(|o| o.last_success = Some(t0));
        let later = |s| t0 + chrono::TimeDelta::seconds(s);
        assert!(view.snapshot().readiness(later(90)).is_ok());
        let err = view.snapshot().readiness(later(91)).unwrap_err();
        assert!(err.contains("1m 31s ago"), "{err}");
        assert!(err.contains("cannot list machines of app a"), "{err}");
    }

    #[test]
    fn liveness_needs_a_recent_turn_of_the_loop() {
        let t0 = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let view = FleetView::new(Duration::from_secs(30), t0);
        view.update(|o| o.turn_allowance = Duration::from_secs(60));
        let later = |s| t0 + chrono::TimeDelta::seconds(s);
        // 5 intervals + the allowance from start, before any turn.
        assert!(view.snapshot().liveness(later(210)).is_ok());
        let err = view.snapshot().liveness(later(211)).unwrap_err();
        assert!(err.contains("finished no sweep for 3m 31s"), "{err}");
        // A failed sweep is a turn too: the loop is alive, only not ready.
        view.record_failure("cannot list machines of app a", later(200));
        assert!(view.snapshot().liveness(later(400)).is_ok());
        assert!(view.snapshot().liveness(later(411)).is_err());
    }

    #[test]
    fn bad_machine_ids_are_refused() {
        assert_eq!(
            checked_id("148e1f0a").ok(),
            Some(MachineId::from("148e1f0a"))
        );
        assert!(checked_id("").is_err());
        assert!(checked_id("<script>").is_err());
        assert!(checked_id(&"a".repeat(65)).is_err());
    }

    /// The health answers read the state's clock: on paused tokio time, a
    /// loop that stops sweeping turns `/readyz` and then `/healthz` to 503
    /// exactly when their windows pass, with no real waiting.
    #[tokio::test(start_paused = true)]
    async fn health_answers_follow_the_injected_clock_on_paused_time() {
        let t0 = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let clock: SharedClock = Arc::new(crate::clock::TokioClock::starting_at(t0));
        let interval = Duration::from_secs(30);
        let view = FleetView::new(interval, clock.now());
        let metrics = Arc::new(Metrics::new(false).expect("metrics"));
        let state = ServerState::new(metrics, view.clone()).with_clock(clock.clone());
        let status = |r: Response| r.status();
        let config = crate::config::Config::parse(
            std::path::Path::new("t.toml"),
            "[overlay]\nrepo = \"/r\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n[[apps]]\nname = \"a\"\n",
        )
        .expect("config");
        let tip = crate::observe::overlay::Tip {
            branch: "release".into(),
            commit: CommitId::parse(&"a".repeat(40)).expect("commit"),
        };
        let observation = crate::observe::sweep::observation(&config, &tip, Vec::new());
        let report = Snapshot::judged(observation, |_| None);

        assert_eq!(
            status(readyz(State(state.clone())).await),
            StatusCode::SERVICE_UNAVAILABLE
        );
        view.record_sweep(report, clock.now());
        assert_eq!(status(readyz(State(state.clone())).await), StatusCode::OK);
        assert_eq!(status(healthz(State(state.clone())).await), StatusCode::OK);

        // Ready for READY_INTERVALS sweep intervals after the last success.
        tokio::time::advance(interval * READY_INTERVALS).await;
        assert_eq!(status(readyz(State(state.clone())).await), StatusCode::OK);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            status(readyz(State(state.clone())).await),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(status(healthz(State(state.clone())).await), StatusCode::OK);

        // Live for LIVE_INTERVALS after the last turn of the loop.
        tokio::time::advance(interval * (LIVE_INTERVALS - READY_INTERVALS)).await;
        assert_eq!(
            status(healthz(State(state.clone())).await),
            StatusCode::SERVICE_UNAVAILABLE
        );
        // A turn that fails still proves the loop alive.
        view.record_failure("cannot list machines of app a", clock.now());
        assert_eq!(status(healthz(State(state.clone())).await), StatusCode::OK);
        assert_eq!(
            status(readyz(State(state)).await),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}

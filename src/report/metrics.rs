//! Prometheus metrics: one [`Metrics`] struct owning its own registry.
//!
//! Owns every series of docs/design.md §7 (names as constants, help texts written for
//! an operator, label sets bounded by configuration and fixed vocabularies)
//! and their text rendering for `GET /metrics`. The daemon loop feeds it
//! results ([`Metrics::record_sweep`], [`Metrics::record_action`], …); it
//! never observes the fleet itself, never uses the global registry, and never
//! takes a label value from anything unbounded (error messages, URLs, refs
//! reported by agents). Every name is prefixed `fleet_reconciler_` (besides
//! the standard `process_*` series), and no series carries a label a scrape
//! sets itself (`app`, `region`, `instance`, `job`): the agents' app is
//! [`APP_LABEL`], a machine's region [`REGION_LABEL`], and the fleet-wide
//! coherence is its own series rather than a sentinel label value.
//!
//! # Series lifecycle
//!
//! * `fleet_reconciler_machines` and `fleet_reconciler_drift_severity_machines` export every status
//!   and every severity of every swept app, zeros included, so a series never
//!   appears or vanishes as the fleet changes.
//! * `fleet_reconciler_overlay_commits_behind` (only with `metrics.per_machine`) has one
//!   series per machine whose status is `drifted`, valued with its commits
//!   behind (0 for a machine only *ahead* of the tip, e.g. a canary). On-tip
//!   machines export nothing, so the cardinality follows the drift rather
//!   than the fleet size; a machine that returns to the tip, stops being
//!   drifted, changes region or disappears has its series removed at the
//!   next sweep, never left stale.
//! * `fleet_reconciler_rotations_in_progress` is replaced as a whole by
//!   [`Metrics::set_rotations_in_progress`]; pools not passed are removed.
//!   So is `fleet_reconciler_machine_decisions` by [`Metrics::set_decisions`],
//!   and `fleet_reconciler_guardrail_blocked` by [`Metrics::set_guardrails`]
//!   (every reason of every pool with machines, 1 where it holds claims),
//!   and `fleet_reconciler_guardrail_until_timestamp_seconds` by
//!   [`Metrics::set_guardrail_until`] (only where a time exists).
//! * `fleet_reconciler_actions_total` gets every action and result of each
//!   pool passed to [`Metrics::set_rotations_in_progress`] at 0, and keeps
//!   them: a counter born at its first increment shows no `increase()`.
//! * `fleet_reconciler_overlay_tip_age_seconds` is computed when scraped, so it keeps
//!   growing while fetches fail or the loop is stuck.
//! * `fleet_reconciler_app_data_age_seconds` has one series per configured app, also
//!   computed when scraped: seconds since the app was last listed. An app a
//!   sweep could not list keeps exporting the figures of its last listing
//!   (`fleet_reconciler_machines`, coherence, severities, per-machine drift, and in the
//!   fleet-wide coherence), marked by this age growing; an app never listed
//!   since start exports no figures at all, only its age.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::decide::decision::{Decision, HALTED};
use crate::decide::guardrail::Guard;
use crate::decide::snapshot::{Coherence, Snapshot};
use crate::fly::RequestObserver;
use crate::model::{AppName, MachineId, MachineStatus, PoolName, Severity};
use crate::observe::DurationObserver;

/// Content type of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

pub const COHERENCE_RATIO: &str = "fleet_reconciler_overlay_coherence_ratio";
pub const FLEET_COHERENCE_RATIO: &str = "fleet_reconciler_fleet_overlay_coherence_ratio";
pub const MACHINES: &str = "fleet_reconciler_machines";
pub const COMMITS_BEHIND: &str = "fleet_reconciler_overlay_commits_behind";
pub const DRIFT_SEVERITY_MACHINES: &str = "fleet_reconciler_drift_severity_machines";
pub const ROTATIONS_IN_PROGRESS: &str = "fleet_reconciler_rotations_in_progress";
pub const MACHINE_DECISIONS: &str = "fleet_reconciler_machine_decisions";
pub const GUARDRAIL_BLOCKED: &str = "fleet_reconciler_guardrail_blocked";
pub const GUARDRAIL_UNTIL: &str = "fleet_reconciler_guardrail_until_timestamp_seconds";

/// The `reason` label values of `fleet_reconciler_guardrail_blocked`: every
/// guard's, and a halted release's (decided per machine, not a guard).
pub fn guardrail_reasons() -> impl Iterator<Item = &'static str> + Clone {
    Guard::REASONS.iter().copied().chain([HALTED])
}
pub const ACTIONS_TOTAL: &str = "fleet_reconciler_actions_total";
pub const FLY_API_REQUESTS_TOTAL: &str = "fleet_reconciler_fly_api_requests_total";
pub const FLY_API_REQUEST_DURATION_SECONDS: &str =
    "fleet_reconciler_fly_api_request_duration_seconds";
pub const AGENT_PROBE_DURATION_SECONDS: &str = "fleet_reconciler_agent_probe_duration_seconds";
pub const GIT_FETCH_DURATION_SECONDS: &str = "fleet_reconciler_git_fetch_duration_seconds";
pub const SWEEP_DURATION_SECONDS: &str = "fleet_reconciler_sweep_duration_seconds";
pub const SWEEPS_TOTAL: &str = "fleet_reconciler_sweeps_total";
pub const LAST_SWEEP_SUCCESS_TIMESTAMP: &str =
    "fleet_reconciler_last_sweep_success_timestamp_seconds";
pub const TIP_AGE_SECONDS: &str = "fleet_reconciler_overlay_tip_age_seconds";
pub const APP_DATA_AGE_SECONDS: &str = "fleet_reconciler_app_data_age_seconds";
pub const TIP_INFO: &str = "fleet_reconciler_overlay_tip_info";
pub const WEBHOOK_DELIVERIES_TOTAL: &str = "fleet_reconciler_webhook_deliveries_total";
pub const WEBHOOK_DEAD_LETTERS: &str = "fleet_reconciler_webhook_dead_letters";
pub const WEBHOOK_SINK_FAILING: &str = "fleet_reconciler_webhook_sink_failing";
pub const ALERT_STATE_WRITE_FAILURES_TOTAL: &str =
    "fleet_reconciler_alert_state_write_failures_total";
pub const HEARTBEAT_PINGS_TOTAL: &str = "fleet_reconciler_heartbeat_pings_total";
pub const BUILD_INFO: &str = "fleet_reconciler_build_info";
pub const ADMIN_AUTH_FAILURES_TOTAL: &str = "fleet_reconciler_admin_auth_failures_total";
pub const HTTP_CONNECTIONS_REJECTED_TOTAL: &str =
    "fleet_reconciler_http_connections_rejected_total";

/// `reason` values of `fleet_reconciler_admin_auth_failures_total`.
pub const ADMIN_AUTH_FAILURE_REASONS: [&str; 3] = ["missing_token", "wrong_token", "rate_limited"];

/// The label naming an agents' app. Not `app`: Fly's managed Prometheus and
/// ordinary scrape configs set `app`, `region` and `instance` on every
/// series they scrape, which would overwrite ours (or rename it `exported_app`).
pub const APP_LABEL: &str = "fly_app";
/// The label naming a machine's region (not `region`, for the same reason).
pub const REGION_LABEL: &str = "fly_region";

/// Every `action` of `fleet_reconciler_actions_total` (`Step::kind`): each
/// pool's series are created at 0 for all of them and every
/// [`ACTION_RESULTS`], so that the first failure (or the first finished
/// rotation) is an increase Prometheus can see: a counter born at 1 shows
/// no `increase()`.
pub const ACTIONS: [&str; 11] = [
    "claim",
    "withdraw",
    "advance",
    "drain",
    "restart",
    "fail",
    "finish",
    "yield",
    "cancel",
    "record_unprobed",
    "clear_unprobed",
];
/// Every `result` of `fleet_reconciler_actions_total` (`Outcome::result`).
pub const ACTION_RESULTS: [&str; 3] = ["succeeded", "skipped", "failed"];

/// `result` label of a successful sweep in `fleet_reconciler_sweeps_total`.
pub const SWEEP_SUCCESS: &str = "success";

/// Sweep durations from a tiny fleet (tens of ms) to a slow 10k-machine
/// sweep against a struggling API (two minutes).
pub const SWEEP_DURATION_BUCKETS: [f64; 13] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 120.0,
];

/// One HTTP exchange (Fly API call, agent probe): a few ms on loopback or
/// 6PN, up to the request timeouts (seconds).
pub const REQUEST_DURATION_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A git fetch of the overlay: an up-to-date fetch (tens of ms) to a first
/// clone of a large repository (minutes, bounded by the fetch timeout).
pub const GIT_FETCH_DURATION_BUCKETS: [f64; 11] =
    [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// `MetricsErrorKind`: which error, without its data; its snake-case name
/// is the bounded label ([`MetricsError::kind`]).
#[derive(Debug, thiserror::Error, strum::EnumDiscriminants)]
#[strum_discriminants(
    name(MetricsErrorKind),
    derive(strum::IntoStaticStr, strum::VariantArray, Hash),
    strum(serialize_all = "snake_case")
)]
pub enum MetricsError {
    #[error("cannot register metric {name}: {source}")]
    Register {
        name: &'static str,
        #[source]
        source: prometheus::Error,
    },
    #[error("cannot encode metrics: {0}")]
    Encode(#[source] prometheus::Error),
}

impl MetricsError {
    pub fn error_kind(&self) -> MetricsErrorKind {
        self.into()
    }

    /// A bounded label: the kind's snake-case name.
    pub fn kind(&self) -> &'static str {
        self.error_kind().into()
    }
}

/// Label sets currently exported by the gauges that have per-sweep series,
/// so that series which are no longer true are removed instead of left stale.
#[derive(Default)]
struct Exported {
    apps: BTreeSet<AppName>,
    /// (app, machine_id, region)
    machines: BTreeSet<(AppName, MachineId, String)>,
    /// (app, pool)
    rotations: BTreeSet<(String, String)>,
    /// Apps with `fleet_reconciler_machine_decisions` series.
    decision_apps: BTreeSet<String>,
    /// (app, pool, reason) of `fleet_reconciler_guardrail_blocked`.
    guardrails: BTreeSet<(String, String, String)>,
    /// (app, pool, reason) of `fleet_reconciler_guardrail_until_timestamp_seconds`.
    guardrail_until: BTreeSet<(String, String, String)>,
    /// (branch, commit)
    tip: Option<(String, String)>,
    /// Last successful overlay fetch; before the first, process start.
    tip_fetched_at: Option<DateTime<Utc>>,
    /// Per app: its last successful listing (`None`: never, since start).
    app_listed_at: BTreeMap<AppName, Option<DateTime<Utc>>>,
}

/// Every series the daemon exports, in one registry.
pub struct Metrics {
    registry: Registry,
    per_machine: bool,
    created_at: DateTime<Utc>,
    coherence: GaugeVec,
    fleet_coherence: Gauge,
    machines: IntGaugeVec,
    commits_behind: IntGaugeVec,
    drift_severity: IntGaugeVec,
    rotations: IntGaugeVec,
    decisions: IntGaugeVec,
    guardrails: IntGaugeVec,
    guardrail_until: IntGaugeVec,
    actions: IntCounterVec,
    fly_requests: IntCounterVec,
    fly_request_duration: HistogramVec,
    probe_duration: HistogramVec,
    git_fetch_duration: HistogramVec,
    sweep_duration: Histogram,
    sweeps: IntCounterVec,
    last_success: Gauge,
    tip_age: Gauge,
    app_age: GaugeVec,
    tip_info: IntGaugeVec,
    webhook_deliveries: IntCounterVec,
    admin_auth_failures: IntCounterVec,
    connections_rejected: IntCounter,
    webhook_dead_letters: IntGaugeVec,
    webhook_sink_failing: IntGaugeVec,
    alert_state_write_failures: IntCounter,
    heartbeat_pings: IntCounterVec,
    exported: Mutex<Exported>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("per_machine", &self.per_machine)
            .finish_non_exhaustive()
    }
}

fn register<C: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    name: &'static str,
    collector: C,
) -> Result<C, MetricsError> {
    registry
        .register(Box::new(collector.clone()))
        .map_err(|source| MetricsError::Register { name, source })?;
    Ok(collector)
}

fn gauge_vec(
    registry: &Registry,
    name: &'static str,
    help: &str,
    labels: &[&str],
) -> Result<IntGaugeVec, MetricsError> {
    let vec = IntGaugeVec::new(Opts::new(name, help), labels)
        .map_err(|source| MetricsError::Register { name, source })?;
    register(registry, name, vec)
}

fn counter(
    registry: &Registry,
    name: &'static str,
    help: &str,
) -> Result<IntCounter, MetricsError> {
    let c = IntCounter::with_opts(Opts::new(name, help))
        .map_err(|source| MetricsError::Register { name, source })?;
    register(registry, name, c)
}

fn counter_vec(
    registry: &Registry,
    name: &'static str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, MetricsError> {
    let vec = IntCounterVec::new(Opts::new(name, help), labels)
        .map_err(|source| MetricsError::Register { name, source })?;
    register(registry, name, vec)
}

fn histogram_vec(
    registry: &Registry,
    name: &'static str,
    help: &str,
    buckets: &[f64],
    labels: &[&str],
) -> Result<HistogramVec, MetricsError> {
    let vec = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .map_err(|source| MetricsError::Register { name, source })?;
    register(registry, name, vec)
}

fn float_gauge(registry: &Registry, name: &'static str, help: &str) -> Result<Gauge, MetricsError> {
    let g = Gauge::with_opts(Opts::new(name, help))
        .map_err(|source| MetricsError::Register { name, source })?;
    register(registry, name, g)
}

/// What the last sweep saw of the fleet: coherence, machines per status and
/// severity, per-machine drift, the tip it measured against.
struct FleetSeries {
    coherence: GaugeVec,
    fleet_coherence: Gauge,
    machines: IntGaugeVec,
    commits_behind: IntGaugeVec,
    drift_severity: IntGaugeVec,
    tip_info: IntGaugeVec,
}

impl FleetSeries {
    fn register(r: &Registry) -> Result<FleetSeries, MetricsError> {
        let coherence = {
            let name = COHERENCE_RATIO;
            let vec = GaugeVec::new(
                Opts::new(
                    name,
                    "Share of the app's started machines whose agent reports the overlay \
                     release tip (0..1; 1 when no machine is started).",
                ),
                &[APP_LABEL],
            )
            .map_err(|source| MetricsError::Register { name, source })?;
            register(r, name, vec)?
        };
        let fleet_coherence = float_gauge(
            r,
            FLEET_COHERENCE_RATIO,
            "Share of the started machines of every configured app whose agent reports the \
             overlay release tip (0..1; 1 when no machine is started).",
        )?;
        let machines = gauge_vec(
            r,
            MACHINES,
            "Machines per app by overlay status of the last sweep: on_tip, drifted, unreachable, \
             bad_report, unknown_ref, ambiguous_ref, not_running (not started, not counted in coherence).",
            &[APP_LABEL, "status"],
        )?;
        let commits_behind = gauge_vec(
            r,
            COMMITS_BEHIND,
            "Commits of the release branch missing from the overlay a drifted machine runs; \
             one series per drifted machine (absent when on the tip).",
            &[APP_LABEL, "machine_id", REGION_LABEL],
        )?;
        let drift_severity = gauge_vec(
            r,
            DRIFT_SEVERITY_MACHINES,
            "Machines per app whose drift is classified at this severity (drifted, unknown_ref \
             and ambiguous_ref machines).",
            &[APP_LABEL, "severity"],
        )?;
        let tip_info = gauge_vec(
            r,
            TIP_INFO,
            "Always 1: the release branch and tip commit of the last successful sweep.",
            &["branch", "commit"],
        )?;
        Ok(FleetSeries {
            coherence,
            fleet_coherence,
            machines,
            commits_behind,
            drift_severity,
            tip_info,
        })
    }
}

/// What the planner decided and the executor did: rotations, decisions, actions.
struct PlanSeries {
    rotations: IntGaugeVec,
    decisions: IntGaugeVec,
    guardrails: IntGaugeVec,
    guardrail_until: IntGaugeVec,
    actions: IntCounterVec,
}

impl PlanSeries {
    fn register(r: &Registry) -> Result<PlanSeries, MetricsError> {
        let rotations = gauge_vec(
            r,
            ROTATIONS_IN_PROGRESS,
            "Rotations (drain, restart, verify) holding a slot of the pool's concurrency cap.",
            &[APP_LABEL, "pool"],
        )?;
        let decisions = gauge_vec(
            r,
            MACHINE_DECISIONS,
            "Machines per app by what the planner decided for them in the last sweep \
             (on_tip, drift_young, awaiting_approval, waiting_for_slot, live_work, held, ...).",
            &[APP_LABEL, "decision"],
        )?;
        let guardrails = gauge_vec(
            r,
            GUARDRAIL_BLOCKED,
            "1 while a guardrail holds new claims of the pool in the last sweep, else 0 \
             (reason: canary, window, alert_firing, gate_unreachable, halted; every reason of \
             every pool with machines).",
            &[APP_LABEL, "pool", "reason"],
        )?;
        let guardrail_until = gauge_vec(
            r,
            GUARDRAIL_UNTIL,
            "When the guardrail holding the pool's new claims lifts, in Unix seconds, where a \
             time exists (a window's closing or next opening, a canary soak's end); absent \
             otherwise (an alert, a ratio not yet met, a halt).",
            &[APP_LABEL, "pool", "reason"],
        )?;
        let actions = counter_vec(
            r,
            ACTIONS_TOTAL,
            "Remediation steps the daemon performed on machines, by pool, action and result \
             (every action and result of each pool starts at 0).",
            &[APP_LABEL, "pool", "action", "result"],
        )?;
        Ok(PlanSeries {
            rotations,
            decisions,
            guardrails,
            guardrail_until,
            actions,
        })
    }
}

/// Calls out of the process: the Fly API, agent probes, git fetches.
struct CallSeries {
    fly_requests: IntCounterVec,
    fly_request_duration: HistogramVec,
    probe_duration: HistogramVec,
    git_fetch_duration: HistogramVec,
}

impl CallSeries {
    fn register(r: &Registry) -> Result<CallSeries, MetricsError> {
        let fly_requests = counter_vec(
            r,
            FLY_API_REQUESTS_TOTAL,
            "HTTP exchanges with the Fly Machines API by operation and status code \
             (\"timeout\" or \"error\" when no response arrived); retries count separately.",
            &["op", "code"],
        )?;
        let fly_request_duration = histogram_vec(
            r,
            FLY_API_REQUEST_DURATION_SECONDS,
            "Time from sending a Fly Machines API request to its response headers (or its \
             failure), by operation and outcome: ok (2xx), client_error (4xx), server_error \
             (5xx), timeout, error; retries count separately.",
            &REQUEST_DURATION_BUCKETS,
            &["op", "outcome"],
        )?;
        let probe_duration = histogram_vec(
            r,
            AGENT_PROBE_DURATION_SECONDS,
            "Time to probe one agent's health endpoint, by outcome: report, unreachable \
             (refused, timed out, HTTP error), bad_report.",
            &REQUEST_DURATION_BUCKETS,
            &["outcome"],
        )?;
        let git_fetch_duration = histogram_vec(
            r,
            GIT_FETCH_DURATION_SECONDS,
            "Time to fetch the overlay repository, by outcome: ok or failed.",
            &GIT_FETCH_DURATION_BUCKETS,
            &["outcome"],
        )?;
        Ok(CallSeries {
            fly_requests,
            fly_request_duration,
            probe_duration,
            git_fetch_duration,
        })
    }
}

/// Whether sweeps succeed and how fresh their data is.
struct SweepSeries {
    sweep_duration: Histogram,
    sweeps: IntCounterVec,
    last_success: Gauge,
    tip_age: Gauge,
    app_age: GaugeVec,
}

impl SweepSeries {
    fn register(r: &Registry) -> Result<SweepSeries, MetricsError> {
        let sweep_duration = {
            let name = SWEEP_DURATION_SECONDS;
            let h = Histogram::with_opts(
                HistogramOpts::new(
                    name,
                    "Wall time of one successful sweep (overlay fetch, inventory, probes, git analysis).",
                )
                .buckets(SWEEP_DURATION_BUCKETS.to_vec()),
            )
            .map_err(|source| MetricsError::Register { name, source })?;
            register(r, name, h)?
        };
        let sweeps = counter_vec(
            r,
            SWEEPS_TOTAL,
            "Sweeps by result: \"success\", or the kind of failure that made the whole sweep \
             untrustworthy (e.g. no app could be listed, git failing). A sweep that could not \
             list some apps succeeds; see fleet_reconciler_app_data_age_seconds.",
            &["result"],
        )?;
        sweeps.with_label_values(&[SWEEP_SUCCESS]);
        let last_success = float_gauge(
            r,
            LAST_SWEEP_SUCCESS_TIMESTAMP,
            "Unix time of the last successful sweep (0 before the first); alert when it stops advancing.",
        )?;
        let tip_age = float_gauge(
            r,
            TIP_AGE_SECONDS,
            "Seconds since the overlay release branch was last fetched successfully \
             (since the daemon started, before the first fetch); grows while fetches fail.",
        )?;
        let app_age = {
            let name = APP_DATA_AGE_SECONDS;
            let vec = GaugeVec::new(
                Opts::new(
                    name,
                    "Seconds since the app's machines were last listed successfully (since the \
                     daemon started, before the first listing). Grows while the app cannot be \
                     listed; its other series then show its last listing, and nothing is done \
                     to its machines.",
                ),
                &[APP_LABEL],
            )
            .map_err(|source| MetricsError::Register { name, source })?;
            register(r, name, vec)?
        };
        Ok(SweepSeries {
            sweep_duration,
            sweeps,
            last_success,
            tip_age,
            app_age,
        })
    }
}

/// Alert deliveries: webhook attempts, dead letters, the alert state file.
struct DeliverySeries {
    webhook_deliveries: IntCounterVec,
    webhook_dead_letters: IntGaugeVec,
    webhook_sink_failing: IntGaugeVec,
    alert_state_write_failures: IntCounter,
    heartbeat_pings: IntCounterVec,
}

impl DeliverySeries {
    fn register(r: &Registry) -> Result<DeliverySeries, MetricsError> {
        let webhook_deliveries = counter_vec(
            r,
            WEBHOOK_DELIVERIES_TOTAL,
            "Alert webhook deliveries by sink format and result: delivered and dead_lettered \
             notifications, failed attempts (retried unless dead-lettered), dropped on a full queue.",
            &["format", "result"],
        )?;
        let webhook_dead_letters = gauge_vec(
            r,
            WEBHOOK_DEAD_LETTERS,
            "Notifications a webhook could not take, set aside in the alert state file.",
            &["sink", "format"],
        )?;
        let webhook_sink_failing = gauge_vec(
            r,
            WEBHOOK_SINK_FAILING,
            "1 while a webhook dead-letters what it is sent (permanent refusal or failing for long), else 0.",
            &["sink", "format"],
        )?;
        let alert_state_write_failures = counter(
            r,
            ALERT_STATE_WRITE_FAILURES_TOTAL,
            "Failed writes of the alert state file (alerts.state_file); a restart would forget what was sent.",
        )?;
        let heartbeat_pings = counter_vec(
            r,
            HEARTBEAT_PINGS_TOTAL,
            "Heartbeat pings (alerts.heartbeat, by index) after successful sweeps: ok, failed, or skipped while the previous one was in flight.",
            &["heartbeat", "result"],
        )?;
        Ok(DeliverySeries {
            webhook_deliveries,
            webhook_dead_letters,
            webhook_sink_failing,
            alert_state_write_failures,
            heartbeat_pings,
        })
    }
}

/// The HTTP server's refusals: admin authentication, connections over the cap.
struct ServerSeries {
    admin_auth_failures: IntCounterVec,
    connections_rejected: IntCounter,
}

impl ServerSeries {
    fn register(r: &Registry) -> Result<ServerSeries, MetricsError> {
        let admin_auth_failures = counter_vec(
            r,
            ADMIN_AUTH_FAILURES_TOTAL,
            "Admin API requests refused for authentication, by reason: missing_token, \
             wrong_token, or rate_limited (the source had too many failures in its window).",
            &["reason"],
        )?;
        for reason in ADMIN_AUTH_FAILURE_REASONS {
            admin_auth_failures.with_label_values(&[reason]);
        }
        let connections_rejected = counter(
            r,
            HTTP_CONNECTIONS_REJECTED_TOTAL,
            "HTTP connections closed at once because server.max_connections were open.",
        )?;
        Ok(ServerSeries {
            admin_auth_failures,
            connections_rejected,
        })
    }
}

/// The process itself: the build's version (always 1) and, on Linux, the
/// standard `process_*` series. Nothing in the process updates them.
fn register_process(r: &Registry) -> Result<(), MetricsError> {
    let build_info = gauge_vec(
        r,
        BUILD_INFO,
        "Always 1: the fleet-reconciler version serving these metrics.",
        &["version"],
    )?;
    build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    // process_cpu_seconds_total, process_resident_memory_bytes,
    // process_open_fds, process_start_time_seconds, … (Linux only: the
    // collector reads /proc).
    #[cfg(target_os = "linux")]
    r.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))
    .map_err(|source| MetricsError::Register {
        name: "process_*",
        source,
    })?;
    Ok(())
}

impl Metrics {
    /// A fresh registry with every series registered. `per_machine` is
    /// `metrics.per_machine`: whether `fleet_reconciler_overlay_commits_behind` is exported.
    pub fn new(per_machine: bool) -> Result<Metrics, MetricsError> {
        Metrics::new_at(per_machine, Utc::now())
    }

    /// Like [`Metrics::new`], with the process start time injected (tests).
    /// Registers every family, one group per concern; the exposition lists
    /// families by name whatever the order they are registered in.
    pub fn new_at(per_machine: bool, now: DateTime<Utc>) -> Result<Metrics, MetricsError> {
        let r = Registry::new();
        let FleetSeries {
            coherence,
            fleet_coherence,
            machines,
            commits_behind,
            drift_severity,
            tip_info,
        } = FleetSeries::register(&r)?;
        let PlanSeries {
            rotations,
            decisions,
            guardrails,
            guardrail_until,
            actions,
        } = PlanSeries::register(&r)?;
        let CallSeries {
            fly_requests,
            fly_request_duration,
            probe_duration,
            git_fetch_duration,
        } = CallSeries::register(&r)?;
        let SweepSeries {
            sweep_duration,
            sweeps,
            last_success,
            tip_age,
            app_age,
        } = SweepSeries::register(&r)?;
        let DeliverySeries {
            webhook_deliveries,
            webhook_dead_letters,
            webhook_sink_failing,
            alert_state_write_failures,
            heartbeat_pings,
        } = DeliverySeries::register(&r)?;
        let ServerSeries {
            admin_auth_failures,
            connections_rejected,
        } = ServerSeries::register(&r)?;
        register_process(&r)?;
        Ok(Metrics {
            registry: r,
            per_machine,
            created_at: now,
            coherence,
            fleet_coherence,
            machines,
            commits_behind,
            drift_severity,
            rotations,
            decisions,
            guardrails,
            guardrail_until,
            actions,
            fly_requests,
            fly_request_duration,
            probe_duration,
            git_fetch_duration,
            sweep_duration,
            sweeps,
            last_success,
            tip_age,
            app_age,
            tip_info,
            webhook_deliveries,
            admin_auth_failures,
            connections_rejected,
            webhook_dead_letters,
            webhook_sink_failing,
            alert_state_write_failures,
            heartbeat_pings,
            exported: Mutex::new(Exported::default()),
        })
    }

    pub fn per_machine(&self) -> bool {
        self.per_machine
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    fn exported(&self) -> MutexGuard<'_, Exported> {
        // The guarded data is only label bookkeeping; a panic elsewhere
        // cannot leave it inconsistent in a way worth refusing to scrape.
        self.exported.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes a successful sweep: coherence, status and severity counts,
    /// per-machine drift, duration, and the success timestamp.
    pub fn record_sweep(&self, report: &Snapshot, duration: Duration, now: DateTime<Utc>) {
        let mut exported = self.exported();
        self.record_listings(&mut exported, report, now);
        let apps = apps_with_figures(report);
        self.record_counts(report, &apps);
        self.record_coherence(report, &apps);
        self.remove_gone_apps(&mut exported, apps);
        self.record_commits_behind(&mut exported, report);
        self.record_tip(&mut exported, report);
        self.sweep_duration.observe(duration.as_secs_f64());
        self.sweeps.with_label_values(&[SWEEP_SUCCESS]).inc();
        self.last_success.set(unix_seconds(now));
    }

    /// When each app was last listed (now, or the last listing a stale app
    /// shows), for its data age; apps no longer configured lose their series.
    fn record_listings(&self, exported: &mut Exported, report: &Snapshot, now: DateTime<Utc>) {
        let listed_at: BTreeMap<AppName, Option<DateTime<Utc>>> = report
            .apps
            .iter()
            .map(|a| {
                let at = match &a.stale {
                    None => Some(now),
                    Some(s) => s.last_listed_at,
                };
                (a.name.clone(), at)
            })
            .collect();
        for gone in exported.app_listed_at.keys() {
            if !listed_at.contains_key(gone) {
                let _ = self.app_age.remove_label_values(&[gone.as_str()]);
            }
        }
        exported.app_listed_at = listed_at;
    }

    /// Machines per status and per severity, every status and severity of
    /// every app in `apps`, zeros included.
    fn record_counts(&self, report: &Snapshot, apps: &BTreeSet<AppName>) {
        let mut status_counts: BTreeMap<(&str, MachineStatus), i64> = BTreeMap::new();
        let mut severity_counts: BTreeMap<(&str, Severity), i64> = BTreeMap::new();
        for m in &report.machines {
            *status_counts
                .entry((m.seen.app.as_str(), m.seen.status))
                .or_default() += 1;
            if let Some(s) = m.severity() {
                *severity_counts.entry((m.seen.app.as_str(), s)).or_default() += 1;
            }
        }
        for app in apps {
            for status in MachineStatus::ALL {
                let n = status_counts
                    .get(&(app.as_str(), status))
                    .copied()
                    .unwrap_or(0);
                self.machines
                    .with_label_values(&[app.as_str(), status.as_str()])
                    .set(n);
            }
            for severity in Severity::ALL {
                let n = severity_counts
                    .get(&(app.as_str(), severity))
                    .copied()
                    .unwrap_or(0);
                self.drift_severity
                    .with_label_values(&[app.as_str(), severity.as_str()])
                    .set(n);
            }
        }
    }

    /// Per-app and fleet coherence, exactly as the report computed it
    /// (on_tip ÷ started).
    fn record_coherence(&self, report: &Snapshot, apps: &BTreeSet<AppName>) {
        for summary in report.apps.iter().filter(|a| apps.contains(&a.name)) {
            self.coherence
                .with_label_values(&[summary.name.as_str()])
                .set(summary.coherence.ratio);
        }
        for app in apps
            .iter()
            .filter(|a| !report.apps.iter().any(|s| &s.name == *a))
        {
            // An app with machines but no summary cannot happen with
            // `decide::prepare`; derive it the same way rather than omit it.
            let started = report
                .machines
                .iter()
                .filter(|m| &m.seen.app == app && m.seen.status != MachineStatus::NotRunning)
                .count();
            let on_tip = report.count(Some(app), MachineStatus::OnTip);
            let ratio = Coherence::of(on_tip, started).ratio;
            self.coherence.with_label_values(&[app.as_str()]).set(ratio);
        }
        self.fleet_coherence.set(report.coherence.ratio);
    }

    /// Removes the per-app series of apps that had figures and no longer
    /// do; `apps` become the exported set.
    fn remove_gone_apps(&self, exported: &mut Exported, apps: BTreeSet<AppName>) {
        for gone in exported.apps.difference(&apps) {
            let _ = self.coherence.remove_label_values(&[gone.as_str()]);
            for status in MachineStatus::ALL {
                let _ = self
                    .machines
                    .remove_label_values(&[gone.as_str(), status.as_str()]);
            }
            for severity in Severity::ALL {
                let _ = self
                    .drift_severity
                    .remove_label_values(&[gone.as_str(), severity.as_str()]);
            }
        }
        exported.apps = apps;
    }

    /// Per machine: exactly the drifted machines of this sweep (none
    /// without `metrics.per_machine`).
    fn record_commits_behind(&self, exported: &mut Exported, report: &Snapshot) {
        let mut current = BTreeSet::new();
        if self.per_machine {
            for m in &report.machines {
                if m.seen.status != MachineStatus::Drifted {
                    continue;
                }
                let behind = m.seen.commits_behind.unwrap_or(0);
                self.commits_behind
                    .with_label_values(&[
                        m.seen.app.as_str(),
                        m.seen.machine_id.as_str(),
                        &m.seen.region,
                    ])
                    .set(i64::try_from(behind).unwrap_or(i64::MAX));
                current.insert((
                    m.seen.app.clone(),
                    m.seen.machine_id.clone(),
                    m.seen.region.to_string(),
                ));
            }
        }
        for (app, id, region) in exported.machines.difference(&current) {
            let _ = self.commits_behind.remove_label_values(&[
                app.as_str(),
                id.as_str(),
                region.as_str(),
            ]);
        }
        exported.machines = current;
    }

    /// The tip the sweep measured against, replacing the one before.
    fn record_tip(&self, exported: &mut Exported, report: &Snapshot) {
        let tip = (report.tip.branch.clone(), report.tip.commit.to_string());
        if exported.tip.as_ref() != Some(&tip) {
            if let Some((branch, commit)) = exported.tip.take() {
                let _ = self
                    .tip_info
                    .remove_label_values(&[branch.as_str(), commit.as_str()]);
            }
            self.tip_info
                .with_label_values(&[tip.0.as_str(), tip.1.as_str()])
                .set(1);
            exported.tip = Some(tip);
        }
    }

    /// Counts a sweep that failed as a whole; `kind` is a bounded error kind
    /// such as `SweepError::kind()` (never a message).
    pub fn record_sweep_failure(&self, kind: &'static str) {
        self.sweeps.with_label_values(&[kind]).inc();
    }

    /// The overlay release branch was fetched successfully at `at`.
    pub fn record_tip_fetched(&self, at: DateTime<Utc>) {
        let mut exported = self.exported();
        if exported.tip_fetched_at.is_none_or(|t| t < at) {
            exported.tip_fetched_at = Some(at);
        }
    }

    /// Counts one remediation step on a machine of `pool`. `action` and
    /// `result` must come from a fixed vocabulary (e.g. `restart` /
    /// `succeeded`), never from a message.
    pub fn record_action(&self, app: &AppName, pool: &PoolName, action: &str, result: &str) {
        self.actions
            .with_label_values(&[app.as_str(), pool.as_str(), action, result])
            .inc();
    }

    /// Replaces the whole set of rotations in progress: `(app, pool, n)` for
    /// every pool the daemon knows (pass zeros to keep a series); pools not
    /// passed are removed. Each pool passed also gets its action series at 0
    /// ([`ACTIONS`] × [`ACTION_RESULTS`]), kept for the life of the process
    /// (a counter must not vanish).
    pub fn set_rotations_in_progress(&self, rotations: &[(&AppName, &PoolName, usize)]) {
        let mut exported = self.exported();
        let mut current = BTreeSet::new();
        for (app, pool, n) in rotations {
            self.rotations
                .with_label_values(&[app.as_str(), pool.as_str()])
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
            for action in ACTIONS {
                for result in ACTION_RESULTS {
                    self.actions
                        .with_label_values(&[app.as_str(), pool.as_str(), action, result]);
                }
            }
            current.insert((app.to_string(), pool.to_string()));
        }
        for (app, pool) in exported.rotations.difference(&current) {
            let _ = self
                .rotations
                .remove_label_values(&[app.as_str(), pool.as_str()]);
        }
        exported.rotations = current;
    }

    /// Replaces the machines-per-decision counts: for every app passed,
    /// every decision kind ([`Decision::KINDS`], zeros included); apps not
    /// passed are removed.
    pub fn set_decisions<'a>(&self, decisions: impl IntoIterator<Item = (&'a str, &'a Decision)>) {
        let mut counts: BTreeMap<&str, BTreeMap<&str, i64>> = BTreeMap::new();
        for (app, d) in decisions {
            *counts.entry(app).or_default().entry(d.kind()).or_default() += 1;
        }
        let mut exported = self.exported();
        for (app, per_kind) in &counts {
            for kind in Decision::KINDS {
                self.decisions
                    .with_label_values(&[*app, kind])
                    .set(per_kind.get(kind).copied().unwrap_or(0));
            }
        }
        let current: BTreeSet<String> = counts.keys().map(|a| a.to_string()).collect();
        for app in exported.decision_apps.difference(&current) {
            for kind in Decision::KINDS {
                let _ = self.decisions.remove_label_values(&[app.as_str(), kind]);
            }
        }
        exported.decision_apps = current;
    }

    /// Replaces `fleet_reconciler_guardrail_blocked`: for each (app, pool)
    /// in `pools`, every reason ([`guardrail_reasons`]), 1 where `held` names
    /// it and 0 elsewhere (so the series stay); pools not passed are removed.
    pub fn set_guardrails<'a>(
        &self,
        pools: impl IntoIterator<Item = (&'a str, &'a str)>,
        held: &BTreeSet<(&str, &str, &str)>,
    ) {
        let current: BTreeSet<(String, String, String)> = pools
            .into_iter()
            .flat_map(|(a, p)| {
                guardrail_reasons().map(move |r| (a.to_string(), p.to_string(), r.to_string()))
            })
            .collect();
        let mut exported = self.exported();
        for (app, pool, reason) in &current {
            let on = held.contains(&(app.as_str(), pool.as_str(), reason.as_str()));
            self.guardrails
                .with_label_values(&[app.as_str(), pool.as_str(), reason.as_str()])
                .set(i64::from(on));
        }
        for (app, pool, reason) in exported.guardrails.difference(&current) {
            let _ = self.guardrails.remove_label_values(&[
                app.as_str(),
                pool.as_str(),
                reason.as_str(),
            ]);
        }
        exported.guardrails = current;
    }

    /// Replaces `fleet_reconciler_guardrail_until_timestamp_seconds`: one
    /// series per (app, pool, reason) of `until`, valued with its Unix
    /// seconds; the others are removed (no time: no series).
    pub fn set_guardrail_until(&self, until: &BTreeMap<(&str, &str, &str), DateTime<Utc>>) {
        let mut exported = self.exported();
        let mut current = BTreeSet::new();
        for ((app, pool, reason), at) in until {
            self.guardrail_until
                .with_label_values(&[*app, *pool, *reason])
                .set(at.timestamp());
            current.insert((app.to_string(), pool.to_string(), reason.to_string()));
        }
        for (app, pool, reason) in exported.guardrail_until.difference(&current) {
            let _ = self.guardrail_until.remove_label_values(&[
                app.as_str(),
                pool.as_str(),
                reason.as_str(),
            ]);
        }
        exported.guardrail_until = current;
    }

    /// Counts one webhook delivery attempt; `format` is the sink format
    /// (`json`, `slack`, `pagerduty`), `result` e.g. `delivered` / `failed`.
    pub fn record_webhook_delivery(&self, format: &str, result: &str) {
        self.add_webhook_deliveries(format, result, 1);
    }

    /// Counts `n` webhook delivery attempts at once.
    pub fn add_webhook_deliveries(&self, format: &str, result: &str, n: u64) {
        self.webhook_deliveries
            .with_label_values(&[format, result])
            .inc_by(n);
    }

    /// Counts one admin request refused for authentication; `reason` is one
    /// of [`ADMIN_AUTH_FAILURE_REASONS`].
    pub fn record_admin_auth_failure(&self, reason: &str) {
        self.admin_auth_failures.with_label_values(&[reason]).inc();
    }

    /// Counts one connection refused over `server.max_connections`.
    pub fn record_connection_rejected(&self) {
        self.connections_rejected.inc();
    }

    /// A hook for `NotifierOptions::counter`: each delivery event counted in
    /// `fleet_reconciler_webhook_deliveries_total` (per sink kind and result),
    /// `fleet_reconciler_heartbeat_pings_total` (per heartbeat and result) or
    /// `fleet_reconciler_alert_state_write_failures_total`, as it happens.
    pub fn delivery_counter(&self) -> crate::report::notify::DeliveryCounter {
        use crate::report::notify::{DeliveryCounter, DeliveryEvent};
        let deliveries = self.webhook_deliveries.clone();
        let state_writes = self.alert_state_write_failures.clone();
        let pings = self.heartbeat_pings.clone();
        DeliveryCounter::new(move |event| match event {
            DeliveryEvent::Sink { sink, result } => {
                deliveries.with_label_values(&[sink, result.as_str()]).inc()
            }
            DeliveryEvent::Heartbeat { index, result } => pings
                .with_label_values(&[index.to_string().as_str(), result.as_str()])
                .inc(),
            DeliveryEvent::StateWriteFailed => state_writes.inc(),
        })
    }

    /// Publishes one webhook's dead letters kept and whether it is failing.
    pub fn set_webhook_sink(&self, index: usize, format: &str, dead_letters: usize, failing: bool) {
        let sink = index.to_string();
        self.webhook_dead_letters
            .with_label_values(&[sink.as_str(), format])
            .set(i64::try_from(dead_letters).unwrap_or(i64::MAX));
        self.webhook_sink_failing
            .with_label_values(&[sink.as_str(), format])
            .set(i64::from(failing));
    }

    /// Counts failed writes of the alert state file.
    pub fn add_alert_state_write_failures(&self, n: u64) {
        self.alert_state_write_failures.inc_by(n);
    }

    /// Exports every result of `count` heartbeats at 0, so `increase()`
    /// sees the first failure.
    pub fn init_heartbeats(&self, count: usize) {
        for index in 0..count {
            for result in crate::report::notify::PingResult::ALL {
                self.heartbeat_pings
                    .with_label_values(&[index.to_string().as_str(), result.as_str()]);
            }
        }
    }

    /// Counts one heartbeat ping of `alerts.heartbeat[index]`.
    pub fn record_heartbeat(&self, index: usize, result: crate::report::notify::PingResult) {
        self.heartbeat_pings
            .with_label_values(&[index.to_string().as_str(), result.as_str()])
            .inc();
    }

    /// Counts one Fly API exchange (`op` from the client, `code` an HTTP
    /// status or `timeout`/`error`).
    pub fn record_fly_request(&self, op: &str, code: &str) {
        self.fly_requests.with_label_values(&[op, code]).inc();
    }

    /// A hook for `FlyClient::with_observer` feeding
    /// `fleet_reconciler_fly_api_requests_total` and
    /// `fleet_reconciler_fly_api_request_duration_seconds`.
    pub fn fly_observer(&self) -> RequestObserver {
        let counter = self.fly_requests.clone();
        let latency = self.fly_request_duration.clone();
        std::sync::Arc::new(move |op: &'static str, code: &str, took: Duration| {
            counter.with_label_values(&[op, code]).inc();
            latency
                .with_label_values(&[op, fly_outcome(code)])
                .observe(took.as_secs_f64());
        })
    }

    /// A hook for `Prober::with_observer` feeding
    /// `fleet_reconciler_agent_probe_duration_seconds`.
    pub fn probe_observer(&self) -> DurationObserver {
        let latency = self.probe_duration.clone();
        std::sync::Arc::new(move |outcome: &'static str, took: Duration| {
            latency
                .with_label_values(&[outcome])
                .observe(took.as_secs_f64());
        })
    }

    /// A hook for `Overlay::with_observer` feeding
    /// `fleet_reconciler_git_fetch_duration_seconds`.
    pub fn git_fetch_observer(&self) -> DurationObserver {
        let latency = self.git_fetch_duration.clone();
        std::sync::Arc::new(move |outcome: &'static str, took: Duration| {
            latency
                .with_label_values(&[outcome])
                .observe(took.as_secs_f64());
        })
    }

    /// The registry in the Prometheus text format, with clock-derived gauges
    /// (tip age, app data ages) computed for `now`.
    pub fn render_at(&self, now: DateTime<Utc>) -> Result<String, MetricsError> {
        {
            let exported = self.exported();
            let age =
                |since: DateTime<Utc>| (now - since).num_milliseconds().max(0) as f64 / 1000.0;
            self.tip_age
                .set(age(exported.tip_fetched_at.unwrap_or(self.created_at)));
            for (app, at) in &exported.app_listed_at {
                self.app_age
                    .with_label_values(&[app.as_str()])
                    .set(age(at.unwrap_or(self.created_at)));
            }
        }
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .map_err(MetricsError::Encode)
    }

    /// [`Metrics::render_at`] the current wall clock (what `/metrics` serves).
    pub fn render(&self) -> Result<String, MetricsError> {
        self.render_at(Utc::now())
    }
}

/// The apps with per-app figures: those the report summarises, plus any a
/// machine names; not an app never listed (it has no figures, only its age).
fn apps_with_figures(report: &Snapshot) -> BTreeSet<AppName> {
    let mut apps: BTreeSet<AppName> = report
        .apps
        .iter()
        .filter(|a| a.stale.as_ref().is_none_or(|s| s.last_listed_at.is_some()))
        .map(|a| a.name.clone())
        .collect();
    apps.extend(report.machines.iter().map(|m| m.seen.app.clone()));
    apps
}

/// The bounded `outcome` of a Fly API exchange from its `code` label.
fn fly_outcome(code: &str) -> &'static str {
    match code.as_bytes().first() {
        Some(b'2') => "ok",
        Some(b'4') => "client_error",
        Some(b'5') => "server_error",
        _ if code == "timeout" => "timeout",
        _ => "error",
    }
}

fn unix_seconds(t: DateTime<Utc>) -> f64 {
    t.timestamp_millis() as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The labels logs carry, pinned so a rename is seen.
    #[test]
    fn metrics_error_kinds_keep_their_labels() {
        use strum::VariantArray;
        let labels: Vec<&str> = MetricsErrorKind::VARIANTS
            .iter()
            .map(|k| k.into())
            .collect();
        assert_eq!(labels, ["register", "encode"]);
        let e = MetricsError::Encode(prometheus::Error::Msg("x".into()));
        assert_eq!(
            (e.error_kind(), e.kind()),
            (MetricsErrorKind::Encode, "encode")
        );
    }
    use crate::decide::snapshot::{AppSummary, JudgedMachine, Verdict};
    use crate::model::PolicyAction;
    use crate::observe::sweep::{ObservedMachine, TipReport};

    fn machine(app: &str, id: &str, status: MachineStatus, behind: Option<u64>) -> JudgedMachine {
        let seen = ObservedMachine {
            region: "iad".into(),
            state: if status == MachineStatus::NotRunning {
                "stopped".into()
            } else {
                "started".into()
            },
            status,
            commits_behind: behind,
            commits_ahead: behind.map(|_| 0),
            ..ObservedMachine::listed(
                app,
                id,
                &format!("name-{id}"),
                crate::model::MachineState::Stopped,
            )
        };
        let verdict = status.is_classified().then(|| Verdict {
            severity: Severity::Medium,
            action: PolicyAction::AlertAndWait,
            reason: crate::decide::reason::SharedReason(std::sync::Arc::new(
                crate::decide::reason::Reason {
                    rule: crate::decide::reason::RuleMatch::NoMatch {
                        level: Severity::Medium,
                    },
                    evidence: Vec::new(),
                    behind,
                    missing: Vec::new(),
                    evidence_partial: false,
                },
            )),
        });
        JudgedMachine::new(seen, verdict)
    }

    fn report(machines: Vec<JudgedMachine>) -> Snapshot {
        let mut apps: Vec<AppName> = machines.iter().map(|m| m.seen.app.clone()).collect();
        apps.dedup();
        let summaries: Vec<AppSummary> = apps
            .iter()
            .map(|a| {
                let started = machines
                    .iter()
                    .filter(|m| &m.seen.app == a && m.seen.status != MachineStatus::NotRunning)
                    .count();
                let on_tip = machines
                    .iter()
                    .filter(|m| &m.seen.app == a && m.seen.status == MachineStatus::OnTip)
                    .count();
                AppSummary {
                    name: a.clone(),
                    coherence: Coherence::of(on_tip, started),
                    stale: None,
                }
            })
            .collect();
        Snapshot {
            tip: TipReport {
                branch: "release".into(),
                commit: crate::model::CommitId::parse(&"a".repeat(40)).unwrap(),
            },
            coherence: Coherence {
                ratio: 0.5,
                ..Coherence::of(0, 0)
            },
            apps: summaries,
            machines,
            slots: Default::default(),
            halts: Default::default(),
            gate: Default::default(),
        }
    }

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(secs, 0).unwrap_or_default()
    }

    #[test]
    fn per_machine_series_follow_the_drifted_set() {
        let m = Metrics::new_at(true, at(1_800_000_000)).unwrap();
        m.record_sweep(
            &report(vec![
                machine("a", "m1", MachineStatus::Drifted, Some(3)),
                machine("a", "m2", MachineStatus::OnTip, Some(0)),
            ]),
            Duration::from_millis(10),
            at(1_800_000_001),
        );
        assert_eq!(
            m.commits_behind
                .with_label_values(&["a", "m1", "iad"])
                .get(),
            3
        );
        let text = m.render_at(at(1_800_000_002)).unwrap();
        assert!(!text.contains("machine_id=\"m2\""), "{text}");

        m.record_sweep(
            &report(vec![machine("a", "m2", MachineStatus::OnTip, Some(0))]),
            Duration::from_millis(10),
            at(1_800_000_003),
        );
        let text = m.render_at(at(1_800_000_004)).unwrap();
        assert!(!text.contains("machine_id=\"m1\""), "{text}");
        assert!(!text.contains(COMMITS_BEHIND), "{text}");
    }

    #[test]
    fn tip_age_counts_from_start_then_from_the_last_fetch() {
        let m = Metrics::new_at(false, at(1_000)).unwrap();
        m.render_at(at(1_030)).unwrap();
        assert_eq!(m.tip_age.get(), 30.0);
        m.record_tip_fetched(at(1_100));
        m.record_tip_fetched(at(1_050)); // out of order: ignored
        m.render_at(at(1_112)).unwrap();
        assert_eq!(m.tip_age.get(), 12.0);
    }

    #[test]
    fn a_stale_app_keeps_its_figures_and_its_data_age_grows() {
        let m = Metrics::new_at(true, at(1_000)).unwrap();
        let listed = report(vec![
            machine("a", "a1", MachineStatus::OnTip, Some(0)),
            machine("b", "b1", MachineStatus::Drifted, Some(2)),
            machine("b", "b2", MachineStatus::OnTip, Some(0)),
        ]);
        m.record_sweep(&listed, Duration::from_millis(10), at(1_010));
        let text = m.render_at(at(1_012)).unwrap();
        assert!(
            text.contains("fleet_reconciler_app_data_age_seconds{fly_app=\"a\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("fleet_reconciler_app_data_age_seconds{fly_app=\"b\"} 2"),
            "{text}"
        );

        // b not listed, shown as of its listing at 1_010.
        let mut carried = listed.clone();
        carried.apps[1].stale = Some(crate::observe::sweep::StaleApp {
            error: "cannot list machines of app b: boom".into(),
            kind: "status".into(),
            last_listed_at: Some(at(1_010)),
        });
        m.record_sweep(&carried, Duration::from_millis(10), at(1_040));
        let text = m.render_at(at(1_045)).unwrap();
        assert!(
            text.contains("fleet_reconciler_app_data_age_seconds{fly_app=\"a\"} 5"),
            "{text}"
        );
        assert!(
            text.contains("fleet_reconciler_app_data_age_seconds{fly_app=\"b\"} 35"),
            "{text}"
        );
        assert!(
            text.contains("fleet_reconciler_overlay_coherence_ratio{fly_app=\"b\"} 0.5"),
            "{text}"
        );
        assert!(text.contains("machine_id=\"b1\""), "{text}");
        // Failed sweeps record nothing; the age keeps growing.
        let text = m.render_at(at(1_100)).unwrap();
        assert!(
            text.contains("fleet_reconciler_app_data_age_seconds{fly_app=\"b\"} 90"),
            "{text}"
        );
    }

    #[test]
    fn an_app_never_listed_exports_only_its_age() {
        let m = Metrics::new_at(true, at(1_000)).unwrap();
        let mut r = report(vec![machine("a", "a1", MachineStatus::OnTip, Some(0))]);
        r.apps.push(AppSummary {
            name: "b".into(),
            coherence: Coherence::of(0, 0),
            stale: Some(crate::observe::sweep::StaleApp {
                error: "cannot list machines of app b: boom".into(),
                kind: "not_found".into(),
                last_listed_at: None,
            }),
        });
        m.record_sweep(&r, Duration::from_millis(10), at(1_010));
        let text = m.render_at(at(1_030)).unwrap();
        assert!(
            text.contains("fleet_reconciler_app_data_age_seconds{fly_app=\"b\"} 30"),
            "{text}"
        );
        assert!(
            !text.contains("fleet_reconciler_overlay_coherence_ratio{fly_app=\"b\"}"),
            "{text}"
        );
        assert!(
            !text.contains("fleet_reconciler_machines{fly_app=\"b\""),
            "{text}"
        );
    }

    #[test]
    fn guardrails_are_one_series_per_held_pool_and_lifted_ones_go() {
        let m = Metrics::new(false).unwrap();
        let pools = [("a", "main"), ("b", "eu")];
        let held = BTreeSet::from([("a", "main", "canary"), ("b", "eu", "window")]);
        m.set_guardrails(pools, &held);
        let text = m.render().unwrap();
        let series = |app: &str, pool: &str, reason: &str, v: u8| {
            format!(
                "fleet_reconciler_guardrail_blocked{{fly_app=\"{app}\",pool=\"{pool}\",reason=\"{reason}\"}} {v}"
            )
        };
        for line in [
            series("a", "main", "canary", 1),
            series("a", "main", "window", 0),
            series("b", "eu", "window", 1),
            series("b", "eu", "canary", 0),
        ] {
            assert!(text.contains(&line), "{line}: {text}");
        }
        // The canary soaked; pool eu is gone.
        m.set_guardrails([("a", "main")], &BTreeSet::new());
        let text = m.render().unwrap();
        assert!(text.contains(&series("a", "main", "canary", 0)), "{text}");
        assert!(!text.contains("pool=\"eu\""), "{text}");
    }

    #[test]
    fn a_halt_is_a_guardrail_reason_of_every_pool() {
        let m = Metrics::new(false).unwrap();
        let held = BTreeSet::from([("a", "main", "halted")]);
        m.set_guardrails([("a", "main"), ("a", "eu")], &held);
        let text = m.render().unwrap();
        let series = |pool: &str, reason: &str, v: u8| {
            format!(
                "fleet_reconciler_guardrail_blocked{{fly_app=\"a\",pool=\"{pool}\",reason=\"{reason}\"}} {v}"
            )
        };
        for line in [
            series("main", "halted", 1),
            series("main", "canary", 0),
            series("eu", "halted", 0),
        ] {
            assert!(text.contains(&line), "{line}: {text}");
        }
        // Resumed: the series stays, at 0.
        m.set_guardrails([("a", "main")], &BTreeSet::new());
        let text = m.render().unwrap();
        assert!(text.contains(&series("main", "halted", 0)), "{text}");
    }

    #[test]
    fn a_guardrails_until_is_a_series_only_where_a_time_exists() {
        let m = Metrics::new(false).unwrap();
        let until = BTreeMap::from([(("b", "eu", "window"), at(1_800_000_000))]);
        m.set_guardrail_until(&until);
        let text = m.render().unwrap();
        assert!(
            text.contains(
                "fleet_reconciler_guardrail_until_timestamp_seconds{fly_app=\"b\",pool=\"eu\",reason=\"window\"} 1800000000"
            ),
            "{text}"
        );
        // The window closed: its series goes.
        m.set_guardrail_until(&BTreeMap::new());
        let text = m.render().unwrap();
        assert!(
            !text.contains("guardrail_until_timestamp_seconds{"),
            "{text}"
        );
    }

    #[test]
    fn decisions_are_counted_per_app_with_every_kind_and_replaced_as_a_set() {
        let m = Metrics::new(false).unwrap();
        let held = Decision::Held {
            by: None,
            since: None,
            reason: None,
            phase: None,
        };
        m.set_decisions([
            ("a", &Decision::OnTip),
            ("a", &Decision::OnTip),
            ("a", &held),
            ("b", &Decision::OnTip),
        ]);
        let text = m.render().unwrap();
        assert!(
            text.contains(
                "fleet_reconciler_machine_decisions{decision=\"on_tip\",fly_app=\"a\"} 2"
            ),
            "{text}"
        );
        assert!(
            text.contains("fleet_reconciler_machine_decisions{decision=\"held\",fly_app=\"a\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "fleet_reconciler_machine_decisions{decision=\"live_work\",fly_app=\"a\"} 0"
            ),
            "{text}"
        );
        let series = text
            .lines()
            .filter(|l| {
                l.starts_with("fleet_reconciler_machine_decisions{") && l.contains("fly_app=\"a\"")
            })
            .count();
        assert_eq!(series, Decision::KINDS.len());
        m.set_decisions([("a", &Decision::OnTip)]);
        let text = m.render().unwrap();
        assert!(!text.contains("fly_app=\"b\""), "{text}");
        assert!(
            text.contains("fleet_reconciler_machine_decisions{decision=\"held\",fly_app=\"a\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn fly_outcomes_are_a_fixed_vocabulary() {
        for (code, outcome) in [
            ("200", "ok"),
            ("201", "ok"),
            ("404", "client_error"),
            ("429", "client_error"),
            ("503", "server_error"),
            ("timeout", "timeout"),
            ("error", "error"),
            ("", "error"),
        ] {
            assert_eq!(fly_outcome(code), outcome, "{code}");
        }
    }

    #[test]
    fn rotations_are_replaced_as_a_set() {
        let m = Metrics::new(false).unwrap();
        let (a, p1, p2) = (
            AppName::from("a"),
            PoolName::from("p1"),
            PoolName::from("p2"),
        );
        m.set_rotations_in_progress(&[(&a, &p1, 2), (&a, &p2, 1)]);
        m.set_rotations_in_progress(&[(&a, &p1, 0)]);
        let text = m.render().unwrap();
        assert!(
            text.contains("fleet_reconciler_rotations_in_progress{fly_app=\"a\",pool=\"p1\"} 0")
        );
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with(ROTATIONS_IN_PROGRESS) && l.contains("pool=\"p2\"")),
            "{text}"
        );
    }
}

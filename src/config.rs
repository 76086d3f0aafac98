//! Configuration: the TOML file of docs/design.md §8.2, parsed and validated at load.
//!
//! Owns the shape of the config and every rule about what a valid one is, so
//! an invalid `Config` cannot exist past `Config::load`. Values are checked
//! while they are parsed (durations, levels, actions, globs, URL templates),
//! which lets errors carry the file, the key path and the line. It must never
//! read secrets: it stores the *names* of environment variables, and the edges
//! that need a secret read it themselves.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use globset::{Glob, GlobBuilder, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Deserializer};

use crate::model::{AppName, PolicyAction, PoolName, Severity};

mod matcher;
pub use matcher::{MatchOp, Matcher};

/// Where a config error was found: file, key path, and line when known.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {message}", location(path, key, *line))]
    Invalid {
        path: PathBuf,
        /// Dotted key path, e.g. `rotation.drain_ceiling` or `apps[1].name`.
        key: String,
        line: Option<usize>,
        message: String,
    },
}

/// Longest key path kept in a [`ConfigError::Invalid`] (an unknown key is
/// quoted as written).
pub const MAX_ERROR_KEY_CHARS: usize = 256;
/// Longest message kept in a [`ConfigError::Invalid`].
pub const MAX_ERROR_MESSAGE_CHARS: usize = 1024;

fn location(path: &Path, key: &str, line: Option<usize>) -> String {
    let mut s = path.display().to_string();
    if let Some(line) = line {
        s.push_str(&format!(":{line}"));
    }
    if !key.is_empty() {
        s.push_str(&format!(": key `{key}`"));
    }
    s
}

/// The whole, validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// The file this was loaded from (for messages).
    pub path: PathBuf,
    pub fly: FlyConfig,
    pub overlay: OverlayConfig,
    pub sweep: SweepConfig,
    pub probe: ProbeConfig,
    pub apps: Vec<AppConfig>,
    pub pools: BTreeMap<PoolName, PoolConfig>,
    pub severity: Vec<SeverityRule>,
    pub rotation: RotationConfig,
    pub alerts: AlertsConfig,
    pub metrics: MetricsConfig,
    pub server: ServerConfig,
    pub records: RecordsConfig,
    pub release: ReleaseConfig,
    pub gates: GatesConfig,
}

/// `[gates]`: what must be quiet before a pool claims (docs/design.md,
/// "Guardrails").
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatesConfig {
    /// `[gates.alertmanager]`: no new claim while a matching alert fires.
    pub alertmanager: Option<AlertGateConfig>,
}

/// `[gates.alertmanager]`: Alertmanager's firing alerts that hold claims.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertGateConfig {
    /// Environment variable holding Alertmanager's base URL (kept out of
    /// the file like the sinks').
    pub url_env: String,
    /// Alertmanager matchers (`severity="critical"`, `alertname=~"Agent.*"`):
    /// an alert closes the gate when it matches every one (at least one).
    pub matchers: Vec<Matcher>,
    /// An unreachable Alertmanager lets claims through instead of blocking
    /// them (and `gate_unreachable` is low, not high).
    #[serde(default)]
    pub fail_open: bool,
    /// How long one read of Alertmanager may take.
    #[serde(default = "default_gate_timeout")]
    pub timeout: NonZeroDuration,
}

fn default_gate_timeout() -> NonZeroDuration {
    NonZeroDuration::from_secs(10)
}

/// Longest `gates.alertmanager.timeout`: a read happens in every sweep.
pub const MAX_GATE_TIMEOUT: Duration = Duration::from_secs(60);

/// `[release]`: guardrails of a release as a whole (docs/design.md,
/// "Halted releases").
#[derive(Clone, Debug, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct ReleaseConfig {
    /// Rotations toward one tip that end failed (or crash-looping) within
    /// `halt_window` that halt the tip for their app: no new claim toward
    /// it until `fleet-reconciler resume`. 0: never halts.
    pub halt_after_failures: u32,
    /// How close together those failures must be, on this replica's clock
    /// (when it first saw each end).
    pub halt_window: NonZeroDuration,
}

impl Default for ReleaseConfig {
    fn default() -> Self {
        ReleaseConfig {
            halt_after_failures: 0,
            halt_window: NonZeroDuration::from_secs(30 * 60),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct FlyConfig {
    /// Machines API base (without `/v1`).
    #[serde(deserialize_with = "http_url")]
    pub api_url: String,
    /// Environment variable holding the Fly API token of every app that
    /// names none of its own (`apps[].token_env`,
    /// `rotation.coordinator_token_env`); see [`Config::fly_tokens`].
    pub token_env: String,
    /// Per-request timeout for Fly API calls (long-polls add their own wait).
    pub request_timeout: NonZeroDuration,
    /// Retries of a transient failure (408, 429, 5xx, connection error).
    pub max_retries: u32,
    /// Whether the client spaces its own calls at Fly's documented limits
    /// per machine and action (`fly::RateLimits::FLY`). Off only where
    /// nothing enforces them (the simulator-backed demo and tests).
    pub rate_limits: bool,
}

impl Default for FlyConfig {
    fn default() -> Self {
        FlyConfig {
            api_url: "https://api.machines.dev".into(),
            token_env: FLY_TOKEN_ENV.into(),
            request_timeout: NonZeroDuration::from_secs(30),
            max_retries: 4,
            rate_limits: true,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverlayConfig {
    /// URL or local path of the overlay repository.
    pub repo: NonEmpty,
    /// Release branch whose tip is the expected ref.
    pub branch: NonEmpty,
    #[serde(default = "secs::<60>", deserialize_with = "duration")]
    pub fetch_interval: Duration,
    /// Deadline for one whole fetch (connect, negotiate, download). A fetch
    /// past it is abandoned and counted as failed; sweeps go on meanwhile.
    #[serde(default = "default_fetch_timeout")]
    pub fetch_timeout: NonZeroDuration,
    /// Commits one sweep's analysis compares for `paths` rules, at most.
    #[serde(
        default = "default_max_path_comparisons",
        deserialize_with = "comparisons"
    )]
    pub max_path_comparisons: NonZeroUsize,
    /// Bare mirror kept by the daemon.
    pub mirror_dir: PathBuf,
    /// Environment variable holding an https token for the repository.
    #[serde(default = "default_git_token_env")]
    pub token_env: String,
}

#[derive(Clone, Debug, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct SweepConfig {
    pub interval: NonZeroDuration,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            interval: NonZeroDuration::from_secs(30),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct ProbeConfig {
    pub timeout: NonZeroDuration,
    pub concurrency: NonZeroUsize,
    pub max_body_bytes: NonZeroUsize,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            timeout: NonZeroDuration::from_secs(5),
            concurrency: NonZeroUsize::new(256).unwrap_or(NonZeroUsize::MIN),
            max_body_bytes: NonZeroUsize::new(65536).unwrap_or(NonZeroUsize::MIN),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppConfig {
    pub name: AppName,
    #[serde(default = "default_health_url")]
    pub health_url: HealthUrlTemplate,
    /// Machine metadata key naming the machine's pool; none = every machine in `default`.
    #[serde(default)]
    pub pool_key: Option<String>,
    /// Environment variable with the bearer token for drain/undrain/reload.
    #[serde(default)]
    pub agent_token_env: Option<String>,
    /// Environment variable with this app's own Fly token (an app-scoped
    /// deploy token, `fly tokens create deploy -a APP`); none: `fly.token_env`.
    #[serde(default)]
    pub token_env: Option<String>,
}

/// Per-pool policy: severity → action, the cap on concurrent rotations,
/// and the guardrails on its claims (docs/design.md, "Guardrails").
#[derive(Clone, Debug, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    pub max_concurrent_rotations: NonZeroU32,
    pub actions: ActionMap,
    /// A canary pool this pool waits for: no claim toward a tip until
    /// `after_ratio` of that pool's started machines have been on it for
    /// `soak`. Checked at load: a configured pool, no cycle.
    pub after: Option<PoolName>,
    /// How long the canary pool must have stayed at `after_ratio`, on this
    /// replica's clock from its first sight of it.
    #[serde(deserialize_with = "duration")]
    pub soak: Duration,
    /// The share of the canary pool's started machines that must be on the
    /// tip, in (0, 1].
    #[serde(deserialize_with = "ratio")]
    pub after_ratio: f64,
    /// Maintenance windows: a deny window that is open blocks new claims;
    /// with any allow window configured, claims only while one is open.
    pub windows: Vec<MaintenanceWindow>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_concurrent_rotations: NonZeroU32::MIN,
            actions: ActionMap::default(),
            after: None,
            soak: Duration::ZERO,
            after_ratio: 1.0,
            windows: Vec::new(),
        }
    }
}

/// Whether a maintenance window allows claims while open, or denies them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowKind {
    Allow,
    Deny,
}

/// One `windows` entry: `{ allow = "0 2 * * Mon-Fri", duration = "3h",
/// time_zone = "Europe/Berlin" }` (or `deny = ...`), as Argo CD's sync
/// windows: opens at each time the cron schedule names, in the zone (DST
/// included), and stays open for `duration` of elapsed time.
#[derive(Clone, Debug, Deserialize)]
#[serde(try_from = "RawWindow")]
pub struct MaintenanceWindow {
    pub kind: WindowKind,
    /// The schedule as written (for messages).
    pub schedule_text: String,
    pub schedule: croner::Cron,
    pub duration: NonZeroDuration,
    pub time_zone: chrono_tz::Tz,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWindow {
    allow: Option<String>,
    deny: Option<String>,
    duration: NonZeroDuration,
    #[serde(default)]
    time_zone: Option<String>,
}

impl TryFrom<RawWindow> for MaintenanceWindow {
    type Error = String;

    fn try_from(raw: RawWindow) -> Result<Self, String> {
        let (kind, text) = match (raw.allow, raw.deny) {
            (Some(a), None) => (WindowKind::Allow, a),
            (None, Some(d)) => (WindowKind::Deny, d),
            _ => {
                return Err(
                    "a window has exactly one of `allow` or `deny` (a cron schedule, e.g. \"0 2 * * Mon-Fri\")".into(),
                );
            }
        };
        let schedule = croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Disallowed)
            .build()
            .parse(&text)
            .map_err(|e| {
                format!("invalid cron schedule {text:?}: {e} (use e.g. \"0 2 * * Mon-Fri\")")
            })?;
        let zone = raw.time_zone.unwrap_or_else(|| "UTC".into());
        let time_zone = zone.parse::<chrono_tz::Tz>().map_err(|_| {
            format!("unknown time zone {zone:?} (an IANA name, e.g. \"Europe/Berlin\")")
        })?;
        Ok(MaintenanceWindow {
            kind,
            schedule_text: text,
            schedule,
            duration: raw.duration,
            time_zone,
        })
    }
}

/// Severity → action. Levels left out keep the safe defaults: wait for a
/// natural stop point, and ask an operator for critical drift.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct ActionMap {
    pub low: PolicyAction,
    pub medium: PolicyAction,
    pub high: PolicyAction,
    pub critical: PolicyAction,
}

impl Default for ActionMap {
    fn default() -> Self {
        ActionMap {
            low: PolicyAction::AlertAndWait,
            medium: PolicyAction::AlertAndWait,
            high: PolicyAction::AlertAndWait,
            critical: PolicyAction::Manual,
        }
    }
}

/// Actions for low, medium, high and critical, in that order.
impl From<[PolicyAction; 4]> for ActionMap {
    fn from([low, medium, high, critical]: [PolicyAction; 4]) -> ActionMap {
        ActionMap {
            low,
            medium,
            high,
            critical,
        }
    }
}

impl ActionMap {
    pub fn for_severity(&self, severity: Severity) -> PolicyAction {
        match severity {
            Severity::Low => self.low,
            Severity::Medium => self.medium,
            Severity::High => self.high,
            Severity::Critical => self.critical,
        }
    }
}

/// One `[[severity]]` rule; every condition present must hold.
#[derive(Clone, Debug)]
pub struct SeverityRule {
    pub level: Severity,
    /// Matches refs the repository cannot resolve (unknown or ambiguous).
    pub unknown_ref: bool,
    /// Trailer keys, lowercased; any one present in the range matches.
    pub trailers: Vec<String>,
    /// Glob patterns as written, and compiled; any changed path matching matches.
    pub paths: Vec<String>,
    pub path_set: Option<GlobSet>,
    pub min_commits_behind: Option<u64>,
}

#[derive(Clone, Debug, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct RotationConfig {
    #[serde(deserialize_with = "duration")]
    pub min_drift_age: Duration,
    #[serde(deserialize_with = "duration")]
    pub restart_grace: Duration,
    #[serde(deserialize_with = "duration")]
    pub drain_ceiling: Duration,
    #[serde(deserialize_with = "duration")]
    pub checkpoint_deadline: Duration,
    #[serde(deserialize_with = "duration")]
    pub retry_after: Duration,
    #[serde(deserialize_with = "duration")]
    pub probe_failure_ceiling: Duration,
    #[serde(deserialize_with = "duration")]
    pub verify_deadline: Duration,
    #[serde(deserialize_with = "duration")]
    pub recent_input_guard: Duration,
    #[serde(deserialize_with = "duration")]
    pub heartbeat_max_age: Duration,
    /// How long a `releasing` rotation keeps retrying the undrain of an agent
    /// that gives no usable report before it gives the undrain up (with an
    /// alert naming the machine) and frees its slot. The uncordon is never
    /// given up.
    pub release_ceiling: NonZeroDuration,
    /// Restarts one rotation makes toward one target before it ends as
    /// failed (uncordoned, slot released, `rotation_failed` alerted, no new
    /// attempt for that target until the tip moves or an operator approves).
    /// At least 1: the first restart is an attempt.
    #[serde(deserialize_with = "restarts")]
    pub max_attempts: NonZeroU32,
    /// The machine (`APP/MACHINE_ID`) whose metadata and lease keep every
    /// pool's rotation slots, so caps are exact across replicas (see
    /// [`crate::metadata::slots`]). Required for `run` to act.
    #[serde(deserialize_with = "coordinator")]
    pub coordinator: Option<crate::metadata::slots::Coordinator>,
    /// Environment variable with the Fly token for the coordinator's app;
    /// none: that app's `apps[].token_env` if it is listed there, else
    /// `fly.token_env` (see [`Config::fly_tokens`]).
    pub coordinator_token_env: Option<String>,
}

impl Default for RotationConfig {
    fn default() -> Self {
        RotationConfig {
            min_drift_age: Duration::from_secs(120),
            restart_grace: Duration::from_secs(60),
            drain_ceiling: Duration::from_secs(3600),
            checkpoint_deadline: Duration::from_secs(1200),
            retry_after: Duration::from_secs(3600),
            probe_failure_ceiling: Duration::from_secs(14400),
            verify_deadline: Duration::from_secs(300),
            recent_input_guard: Duration::from_secs(600),
            heartbeat_max_age: Duration::from_secs(30),
            release_ceiling: NonZeroDuration::from_secs(1800),
            max_attempts: NonZeroU32::MIN.saturating_add(2),
            coordinator: None,
            coordinator_token_env: None,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct AlertsConfig {
    #[serde(deserialize_with = "ratio")]
    pub coherence_threshold: f64,
    #[serde(deserialize_with = "duration")]
    pub coherence_for: Duration,
    /// Where the webhooks' alert state and delivery queues persist
    /// (`alerts.state_file`); `None`: beside `overlay.mirror_dir`, see
    /// [`Config::alert_state_file`].
    pub state_file: Option<PathBuf>,
    /// What one drift incident is (`alerts.group_by`): the fields whose
    /// values, together, name a group. Never empty, no duplicates.
    pub group_by: Vec<GroupField>,
    /// The runbook (docs/operations.md of your copy) that payloads link
    /// into, one anchor per alert kind (`alerts.runbook_url`).
    pub runbook_url: String,
    pub webhooks: Vec<WebhookConfig>,
    /// `[[alerts.alertmanager]]`: Alertmanagers the alerts are posted to.
    #[serde(rename = "alertmanager")]
    pub alertmanagers: Vec<AlertmanagerConfig>,
    /// `[[alerts.heartbeat]]`: dead-man's-switch URLs pinged after every
    /// successful sweep (the receiver pages when the pings stop).
    #[serde(rename = "heartbeat")]
    pub heartbeats: Vec<HeartbeatConfig>,
    /// How long a drift or approval incident must have been empty before it
    /// resolves (`alerts.resolve_after`; default 3 × `sweep.interval`, at
    /// least `alerts.stale_after`), on this replica's own clock.
    #[serde(skip)]
    pub resolve_after: Duration,
    /// How old this replica's view of an app may be before it says nothing
    /// about that app (`alerts.stale_after`; default 3 × `sweep.interval`);
    /// also how far ahead Alertmanager's `endsAt` is set.
    #[serde(skip)]
    pub stale_after: Duration,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        AlertsConfig {
            coherence_threshold: 1.0,
            coherence_for: Duration::from_secs(900),
            state_file: None,
            group_by: DEFAULT_GROUP_BY.to_vec(),
            runbook_url: DEFAULT_RUNBOOK_URL.to_owned(),
            webhooks: Vec::new(),
            alertmanagers: Vec::new(),
            heartbeats: Vec::new(),
            resolve_after: DEFAULT_SWEEP_INTERVAL * ALERT_SWEEPS,
            stale_after: DEFAULT_SWEEP_INTERVAL * ALERT_SWEEPS,
        }
    }
}

/// The default of `fly.token_env`: a name flyctl does not read, so an
/// operator who exports it on a workstation does not hand every later
/// `fly` command in that shell the reconciler's token.
pub const FLY_TOKEN_ENV: &str = "FLEET_RECONCILER_FLY_TOKEN";

/// Read instead of [`FLY_TOKEN_ENV`] on a Fly machine (`FLY_MACHINE_ID`
/// set) where that is unset and `fly.token_env` is left at its default:
/// the usual secret name there, and no flyctl runs beside the daemon.
pub const ON_FLY_TOKEN_ENV: &str = "FLY_API_TOKEN";
/// `sweep.interval`'s default.
const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(30);
/// `alerts.resolve_after` and `alerts.stale_after` default to this many sweep intervals.
pub const ALERT_SWEEPS: u32 = 3;

/// One Fly app and the token its calls carry ([`Config::fly_tokens`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppToken<'a> {
    pub app: &'a AppName,
    /// The environment variable holding the token.
    pub var: &'a str,
    /// The config key that names `var` (`apps[1].token_env`, `fly.token_env`, …).
    pub key: String,
}

impl AppToken<'_> {
    /// The variable read when `var` is unset: [`ON_FLY_TOKEN_ENV`] for
    /// `fly.token_env` at its default, else none.
    pub fn fallback(&self) -> Option<&'static str> {
        fly_token_fallback(&self.key, self.var)
    }

    /// The variable to read in `env` (a variable's value, blank = unset):
    /// `var`, or on a Fly machine where it is unset its [`Self::fallback`]
    /// when that is set.
    pub fn source(&self, env: &dyn Fn(&str) -> Option<String>) -> &str {
        fly_token_source(self.var, self.fallback(), env)
    }
}

/// The one rule for a secret in the environment, read by `main`,
/// `preflight` and the notifier: a variable holds one when it is set to
/// something other than blanks (unset, empty and blank are all "not set":
/// `fly secrets set X=""` or a stray newline is no token).
pub fn env_value(env: impl Fn(&str) -> Option<String>, var: &str) -> Option<String> {
    env(var).filter(|v| !v.trim().is_empty())
}

/// [`env_value`], held as a secret (never printed).
pub fn env_secret(
    env: impl Fn(&str) -> Option<String>,
    var: &str,
) -> Option<secrecy::SecretString> {
    env_value(env, var).map(secrecy::SecretString::from)
}

/// See [`AppToken::fallback`].
pub fn fly_token_fallback(key: &str, var: &str) -> Option<&'static str> {
    (key == "fly.token_env" && var == FLY_TOKEN_ENV).then_some(ON_FLY_TOKEN_ENV)
}

/// See [`AppToken::source`].
pub fn fly_token_source<'v>(
    var: &'v str,
    fallback: Option<&'static str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> &'v str {
    let set = |v: &str| env_value(env, v).is_some();
    match fallback {
        Some(fallback) if !set(var) && set("FLY_MACHINE_ID") && set(fallback) => fallback,
        _ => var,
    }
}

/// `*_env` names are variable names, and one app has one token.
fn check_token_envs(
    fly: &FlyConfig,
    apps: &[AppConfig],
    rotation: &RotationConfig,
) -> Result<(), (String, String)> {
    let mut named = vec![("fly.token_env".to_string(), fly.token_env.as_str())];
    for (i, app) in apps.iter().enumerate() {
        if let Some(var) = &app.token_env {
            named.push((format!("apps[{i}].token_env"), var));
        }
    }
    if let Some(var) = &rotation.coordinator_token_env {
        named.push(("rotation.coordinator_token_env".into(), var));
    }
    for (key, var) in &named {
        if !is_env_name(var) {
            return Err((
                key.clone(),
                format!(
                    "{:?} is not an environment variable name (letters, digits and _, not starting with a digit); the token itself never goes in the config",
                    crate::text::bounded(var, 64)
                ),
            ));
        }
    }
    let Some(var) = &rotation.coordinator_token_env else {
        return Ok(());
    };
    let Some(coordinator) = &rotation.coordinator else {
        return Err((
            "rotation.coordinator_token_env".into(),
            "set without rotation.coordinator: there is no coordinator app to use it for".into(),
        ));
    };
    if let Some((i, app)) = apps
        .iter()
        .enumerate()
        .find(|(_, a)| a.name == coordinator.app)
        && let Some(own) = &app.token_env
        && own != var
    {
        return Err((
            "rotation.coordinator_token_env".into(),
            format!(
                "the coordinator's app {:?} is apps[{i}], whose token_env is {own:?}: one app has one token, so leave coordinator_token_env out (the app's token is used) or make them the same",
                app.name.as_str()
            ),
        ));
    }
    Ok(())
}

/// An environment variable name as shells write them.
fn is_env_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `alerts.group_by`'s default: one drift incident per app, release tip and severity.
pub const DEFAULT_GROUP_BY: [GroupField; 3] =
    [GroupField::App, GroupField::Tip, GroupField::Severity];

/// `alerts.runbook_url`'s default: the placeholder the shipped Prometheus
/// rules use too (replace `your-org` with where your copy lives).
pub const DEFAULT_RUNBOOK_URL: &str =
    "https://github.com/your-org/fleet-reconciler/blob/main/docs/operations.md";

/// A field an alert group is keyed by (`alerts.group_by`); all are stable
/// identity, never message text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupField {
    /// The machine's Fly app.
    App,
    /// The machine's pool.
    Pool,
    /// The drift's severity.
    Severity,
    /// The release tip the machines should run.
    Tip,
    /// One incident per machine (and, as before grouping, per app and tip).
    Machine,
}

impl GroupField {
    pub fn as_str(self) -> &'static str {
        match self {
            GroupField::App => "app",
            GroupField::Pool => "pool",
            GroupField::Severity => "severity",
            GroupField::Tip => "tip",
            GroupField::Machine => "machine",
        }
    }
}

/// One `[[alerts.alertmanager]]`: alerts posted to `<URL>/api/v2/alerts`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertmanagerConfig {
    /// Environment variable holding Alertmanager's base URL (e.g.
    /// `http://alertmanager:9093`), kept out of the file like the webhooks'.
    pub url_env: String,
    /// Alerts below this level are not posted.
    #[serde(default = "low")]
    pub min_severity: Severity,
    /// Labels added to every alert posted (e.g. `team = "agent-platform"`,
    /// for a route that matches on it); never one the daemon sets itself.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// One `[[alerts.heartbeat]]`: a dead-man's switch (healthchecks.io,
/// Cronitor, a PagerDuty heartbeat, Alertmanager's Watchdog receiver) that
/// pages when the pings stop, i.e. when the daemon is gone or no sweep
/// succeeds.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatConfig {
    /// Environment variable holding the ping URL: such URLs embed the
    /// check's secret, so it is kept out of the file like the webhooks'.
    pub url_env: String,
    /// `get` (the default) or `post` (an empty body).
    #[serde(default)]
    pub method: HeartbeatMethod,
    /// Whole-request deadline of one ping; never more than
    /// [`MAX_HEARTBEAT_TIMEOUT`]. A ping runs beside the loop, never in it.
    #[serde(default = "secs::<10>", deserialize_with = "duration")]
    pub timeout: Duration,
}

/// The longest `alerts.heartbeat[].timeout`: a ping that takes longer is a
/// receiver that is down, and the next sweep's ping is what counts.
pub const MAX_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(60);

/// The HTTP method of a heartbeat ping (`alerts.heartbeat[].method`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeartbeatMethod {
    #[default]
    #[serde(alias = "GET")]
    Get,
    #[serde(alias = "POST")]
    Post,
}

impl HeartbeatMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            HeartbeatMethod::Get => "GET",
            HeartbeatMethod::Post => "POST",
        }
    }
}

/// The labels the daemon sets on the alerts it posts to Alertmanager
/// (`alerts.alertmanager[].labels` may not set them).
pub const ALERTMANAGER_LABELS: [&str; 8] = [
    "alertname",
    "severity",
    "service",
    "fly_app",
    "tip",
    "machine_id",
    "pool",
    "fly_region",
];

/// A Prometheus label name: `[a-zA-Z_][a-zA-Z0-9_]*`, not reserved (`__`).
fn label_name_ok(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with("__")
}

/// File name of the alert state when `alerts.state_file` is not set.
pub const DEFAULT_ALERT_STATE_FILE: &str = "alert-state.json";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    Json,
    Slack,
    Pagerduty,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// Environment variable holding the URL (the URL is a secret).
    pub url_env: String,
    pub format: WebhookFormat,
    #[serde(default)]
    pub routing_key_env: Option<String>,
    #[serde(default)]
    pub secret_env: Option<String>,
    #[serde(default = "low")]
    pub min_severity: Severity,
    #[serde(default = "secs::<1800>", deserialize_with = "duration")]
    pub repeat_interval: Duration,
}

#[derive(Clone, Debug, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    pub per_machine: bool,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig { per_machine: true }
    }
}

/// `[records]`: where the record key comes from (docs/safety.md, "Threat
/// model"). The daemon seals every record it relies on later (rotation
/// marker, unprobed record, slot set) and operators' holds and approvals
/// with it; agents, which can write their app's metadata, cannot.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecordsConfig {
    /// Environment variable holding the current record key (hex, at least
    /// 32 bytes): it seals and verifies. Required when any pool acts.
    pub key_env: String,
    /// Environment variable holding the previous key during a key rotation:
    /// it only verifies. Unset or empty: no previous key.
    pub previous_key_env: String,
}

impl Default for RecordsConfig {
    fn default() -> Self {
        RecordsConfig {
            key_env: "FLEET_RECONCILER_RECORD_KEY".into(),
            previous_key_env: "FLEET_RECONCILER_PREVIOUS_RECORD_KEY".into(),
        }
    }
}

/// Why the record keys could not be read from the environment.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordKeyError {
    #[error(
        "{var} (config key `records.key_env`) is not set: every pool that acts needs a record key; make one with `openssl rand -hex 32` and set it as a secret of the reconciler's app, and give the same key to operators' CLI"
    )]
    Missing { var: String },
    #[error("{var} (config key `{key}`) {source}")]
    Invalid {
        var: String,
        key: &'static str,
        source: crate::metadata::seal::KeyError,
    },
}

impl RecordsConfig {
    /// The record keys `env` holds: `Ok(None)` when the current one is not
    /// set (observe-only use); a set value that is no key is an error, naming
    /// the variable and the config key.
    pub fn keys(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<crate::metadata::seal::RecordKeys>, RecordKeyError> {
        use crate::metadata::seal::{RecordKey, RecordKeys};
        let read =
            |var: &str, key: &'static str| -> Result<Option<RecordKey>, RecordKeyError> {
                match env_value(&env, var) {
                    None => Ok(None),
                    Some(text) => RecordKey::from_hex(&text).map(Some).map_err(|source| {
                        RecordKeyError::Invalid {
                            var: var.to_string(),
                            key,
                            source,
                        }
                    }),
                }
            };
        let current = read(&self.key_env, "records.key_env")?;
        let previous = read(&self.previous_key_env, "records.previous_key_env")?;
        Ok(current.map(|current| RecordKeys { current, previous }))
    }

    /// [`RecordsConfig::keys`], required: a missing key is an error.
    pub fn required_keys(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<crate::metadata::seal::RecordKeys, RecordKeyError> {
        self.keys(env)?.ok_or_else(|| RecordKeyError::Missing {
            var: self.key_env.clone(),
        })
    }
}

#[derive(Clone, Debug, Deserialize)]
// Missing keys come from `Default`, the one place each default is written.
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_token_env: String,
    /// How long a client may take to send a request's headers, and how long
    /// an idle keep-alive connection stays open; then it is closed.
    pub header_read_timeout: NonZeroDuration,
    /// The most one request may take, body upload and handler included;
    /// then it is answered 503.
    pub request_timeout: NonZeroDuration,
    /// Connections served at once; further ones are answered 503 and closed.
    pub max_connections: NonZeroUsize,
    /// Largest request body; a larger one is answered 413.
    pub max_body_bytes: NonZeroUsize,
    /// Failed admin authentications one source (client IP) may make per
    /// `admin_auth_window`; past that its admin requests are answered 429.
    pub admin_auth_failures: NonZeroU32,
    pub admin_auth_window: NonZeroDuration,
    /// The address on-call reaches the status page at (`server.public_url`,
    /// e.g. `https://fleet.example.com/`): alert payloads link the status
    /// page and machine pages under it. `None`: no such links.
    #[serde(deserialize_with = "public_url")]
    pub public_url: Option<PublicUrl>,
}

/// `server.public_url`, checked at load: http(s), a host, no credentials,
/// no query or fragment; kept with one trailing slash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicUrl(String);

impl PublicUrl {
    pub fn parse(raw: &str) -> Result<PublicUrl, String> {
        let url = url::Url::parse(raw.trim()).map_err(|e| format!("not a URL ({e})"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err("must be an http:// or https:// URL".into());
        }
        if url.host().is_none() {
            return Err("has no host".into());
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err("must not carry credentials".into());
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err("must not have a query or fragment".into());
        }
        let mut s = url.to_string();
        if !s.ends_with('/') {
            s.push('/');
        }
        Ok(PublicUrl(s))
    }

    /// The status page.
    pub fn status_page(&self) -> String {
        self.0.clone()
    }

    /// A machine's page (`/machines/{id}`), the id percent-encoded.
    pub fn machine_page(&self, machine_id: &str) -> String {
        let Ok(mut url) = url::Url::parse(&self.0) else {
            return self.0.clone();
        };
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().push("machines").push(machine_id);
        }
        url.to_string()
    }
}

fn public_url<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PublicUrl>, D::Error> {
    let raw = String::deserialize(d)?;
    PublicUrl::parse(&raw)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// The most `server.max_connections` may be.
pub const MAX_SERVER_CONNECTIONS: usize = 65_536;
/// The most `server.max_body_bytes` may be (admin bodies are small JSON).
pub const MAX_SERVER_BODY_BYTES: usize = 1024 * 1024;

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 9090)),
            admin_token_env: "FLEET_ADMIN_TOKEN".into(),
            header_read_timeout: NonZeroDuration::from_secs(10),
            request_timeout: NonZeroDuration::from_secs(60),
            max_connections: NonZeroUsize::new(256).unwrap_or(NonZeroUsize::MIN),
            max_body_bytes: NonZeroUsize::new(16 * 1024).unwrap_or(NonZeroUsize::MIN),
            admin_auth_failures: NonZeroU32::new(10).unwrap_or(NonZeroU32::MIN),
            admin_auth_window: NonZeroDuration::from_secs(60),
            public_url: None,
        }
    }
}

/// A health URL with `{machine_id}`, `{app}`, `{private_ip}`, `{region}`,
/// `{name}` placeholders, checked at load to expand into a valid http(s) URL.
///
/// The values come from the Fly API (a machine's name is whatever its
/// creator chose), so each is percent-encoded into its slot (RFC 3986
/// unreserved characters are kept): `x@evil:1/` or `a/../../admin?` stays
/// one host label or one path segment and can move neither the host nor
/// the path the probe, and then the drain with the agent's bearer token,
/// go to. A `{private_ip}` that is an IP address goes in as the address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthUrlTemplate {
    text: String,
    /// Path segments of the URL the template expands to: values never add
    /// one (a `/` is encoded), and `.` or `..` would remove one.
    segments: usize,
    /// The Fly API's host (set by [`Config::parse`] from `fly.api_url`): a
    /// URL that expands to it is refused.
    fly_host: Option<url::Host>,
}

/// The values a health URL template is expanded with.
#[derive(Clone, Copy, Debug)]
pub struct UrlVars<'a> {
    pub machine_id: &'a str,
    pub app: &'a str,
    pub private_ip: &'a str,
    pub region: &'a str,
    pub name: &'a str,
}

/// Why a machine's values do not make a usable health URL.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HealthUrlError {
    #[error("health URL: this machine's values do not make a valid URL ({0})")]
    Invalid(String),
    #[error(
        "health URL: a `.` or `..` value would change the URL's path (`{{name}}` {name:?}, `{{region}}` {region:?})"
    )]
    PathChanged { name: String, region: String },
    #[error(
        "health URL: the host {0} is the Fly API's host (fly.api_url); an agent's token is never sent there"
    )]
    FlyHost(String),
}

/// What a placeholder value keeps as is: RFC 3986 unreserved characters.
const VALUE_ENCODE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// The values a template is checked with at load.
const SAMPLE_VARS: UrlVars<'static> = UrlVars {
    machine_id: "148e1234abcd56",
    app: "app",
    private_ip: "fdaa:0:1:a7b:1::2",
    region: "iad",
    name: "name",
};

impl HealthUrlTemplate {
    pub const PLACEHOLDERS: [&'static str; 5] =
        ["machine_id", "app", "private_ip", "region", "name"];

    pub fn parse(s: &str) -> Result<HealthUrlTemplate, String> {
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            let after = &rest[open + 1..];
            let close = after
                .find('}')
                .ok_or_else(|| format!("unclosed `{{` in health URL template {s:?}"))?;
            let name = &after[..close];
            if !Self::PLACEHOLDERS.contains(&name) {
                return Err(format!(
                    "unknown placeholder `{{{name}}}` in health URL template {s:?} (known: {})",
                    Self::PLACEHOLDERS.map(|p| format!("{{{p}}}")).join(", ")
                ));
            }
            rest = &after[close + 1..];
        }
        let url = url::Url::parse(&expand(s, &SAMPLE_VARS))
            .map_err(|e| format!("health URL template {s:?} does not expand to a valid URL ({e}); an IPv6 {{private_ip}} needs brackets: http://[{{private_ip}}]:8080/health"))?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(format!("health URL template {s:?} must be http or https"));
        }
        Ok(HealthUrlTemplate {
            text: s.to_string(),
            segments: path_segments(&url),
            fly_host: None,
        })
    }

    /// Refuses URLs on the Fly API's host: now, for a template whose host
    /// is written out, and at [`render`](Self::render) for one whose host
    /// is made of placeholders. A loopback Fly API (the simulator, a local
    /// proxy) is exempt: what goes there never leaves the machine.
    fn refuse_host(&mut self, fly: &url::Host) -> Result<(), String> {
        if crate::http::is_loopback(fly) {
            return Ok(());
        }
        if let Some(host) = url::Url::parse(&expand(&self.text, &SAMPLE_VARS))
            .ok()
            .and_then(|u| u.host().map(|h| h.to_owned()))
            && same_host(&host, fly)
        {
            return Err(format!(
                "health URL template {:?} points at {host}, the Fly API's host (fly.api_url): the agent token would be sent to Fly; use the agents' own addresses, e.g. http://{{machine_id}}.vm.{{app}}.internal:8080/health",
                self.text
            ));
        }
        self.fly_host = Some(fly.clone());
        Ok(())
    }

    /// Placeholders that tell one machine from another: a template needs
    /// one, or every machine of the app is probed at the same URL and the
    /// probe that authorizes a restart may judge another machine (the
    /// report carries no identity). `{name}` is not one: Fly does not
    /// document machine names as unique.
    pub const MACHINE_PLACEHOLDERS: [&'static str; 2] = ["machine_id", "private_ip"];

    /// Whether the URL differs per machine (see [`Self::MACHINE_PLACEHOLDERS`]).
    pub fn names_one_machine(&self) -> bool {
        Self::MACHINE_PLACEHOLDERS
            .iter()
            .any(|p| self.text.contains(&format!("{{{p}}}")))
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The health URL of one machine, each value percent-encoded into its
    /// slot. Refused when the values make no valid URL, change the path
    /// (a `.` or `..` segment), or land on the Fly API's host.
    pub fn render(&self, vars: &UrlVars<'_>) -> Result<String, HealthUrlError> {
        let mut expanded = expand(&self.text, vars);
        let url = url::Url::parse(&expanded).map_err(|e| HealthUrlError::Invalid(e.to_string()))?;
        if path_segments(&url) != self.segments {
            return Err(HealthUrlError::PathChanged {
                name: crate::text::bounded(vars.name, 64),
                region: crate::text::bounded(vars.region, 64),
            });
        }
        if let (Some(fly), Some(host)) = (&self.fly_host, url.host())
            && same_host(&host.to_owned(), fly)
        {
            return Err(HealthUrlError::FlyHost(host.to_string()));
        }
        // Every started machine's row keeps its URL through the sweep: no
        // slack (the expansion reserves 64 bytes for the values, about as
        // much again as a URL; #35 item 6).
        expanded.shrink_to_fit();
        Ok(expanded)
    }
}

/// One pass over the template (a value is never itself expanded), each
/// value percent-encoded.
fn expand(template: &str, vars: &UrlVars<'_>) -> String {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            rest = &rest[open..];
            break;
        };
        let value = match &after[..close] {
            "machine_id" => vars.machine_id,
            "app" => vars.app,
            "private_ip" => match vars.private_ip.parse::<std::net::IpAddr>() {
                // Hex, `:` and `.` only: an address is its own slot.
                Ok(ip) => {
                    out.push_str(&ip.to_string());
                    rest = &after[close + 1..];
                    continue;
                }
                Err(_) => vars.private_ip,
            },
            "region" => vars.region,
            "name" => vars.name,
            // `parse` admits no other placeholder.
            other => {
                out.push('{');
                out.push_str(other);
                out.push('}');
                rest = &after[close + 1..];
                continue;
            }
        };
        out.extend(percent_encoding::utf8_percent_encode(value, VALUE_ENCODE));
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    out
}

fn path_segments(url: &url::Url) -> usize {
    url.path_segments().map_or(0, Iterator::count)
}

/// Hosts as the URL parser normalized them (lowercase, canonical
/// addresses); a domain's trailing dot names the same host.
fn same_host(a: &url::Host, b: &url::Host) -> bool {
    match (a, b) {
        (url::Host::Domain(a), url::Host::Domain(b)) => a
            .trim_end_matches('.')
            .eq_ignore_ascii_case(b.trim_end_matches('.')),
        (a, b) => a == b,
    }
}

impl<'de> Deserialize<'de> for HealthUrlTemplate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HealthUrlTemplate::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for HealthUrlTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

// ---- the file as written -------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    fly: FlyConfig,
    overlay: OverlayConfig,
    #[serde(default)]
    sweep: SweepConfig,
    #[serde(default)]
    probe: ProbeConfig,
    apps: Vec<toml::Spanned<AppConfig>>,
    #[serde(default)]
    pools: BTreeMap<PoolName, PoolConfig>,
    #[serde(default)]
    severity: Option<Vec<toml::Spanned<RawSeverityRule>>>,
    #[serde(default)]
    rotation: RotationConfig,
    #[serde(default)]
    alerts: RawAlerts,
    #[serde(default)]
    metrics: MetricsConfig,
    #[serde(default)]
    server: ServerConfig,
    #[serde(default)]
    records: RecordsConfig,
    #[serde(default)]
    release: ReleaseConfig,
    #[serde(default)]
    gates: GatesConfig,
}

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawAlerts {
    #[serde(deserialize_with = "ratio")]
    coherence_threshold: f64,
    #[serde(deserialize_with = "duration")]
    coherence_for: Duration,
    state_file: Option<PathBuf>,
    group_by: Vec<GroupField>,
    runbook_url: String,
    webhooks: Vec<toml::Spanned<WebhookConfig>>,
    alertmanager: Vec<toml::Spanned<AlertmanagerConfig>>,
    heartbeat: Vec<toml::Spanned<HeartbeatConfig>>,
    resolve_after: Option<NonZeroDuration>,
    stale_after: Option<NonZeroDuration>,
}

// Not derived: missing keys (or a missing [alerts] section) get
// `AlertsConfig`'s defaults, not zeros.
impl Default for RawAlerts {
    fn default() -> Self {
        let d = AlertsConfig::default();
        RawAlerts {
            coherence_threshold: d.coherence_threshold,
            coherence_for: d.coherence_for,
            state_file: None,
            group_by: d.group_by,
            runbook_url: d.runbook_url,
            webhooks: Vec::new(),
            alertmanager: Vec::new(),
            heartbeat: Vec::new(),
            resolve_after: None,
            stale_after: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSeverityRule {
    level: Severity,
    #[serde(default)]
    unknown_ref: bool,
    #[serde(default)]
    trailers: Vec<String>,
    #[serde(default)]
    paths: Vec<PathGlob>,
    #[serde(default)]
    min_commits_behind: Option<u64>,
}

/// A `paths` glob, compiled at parse time so a bad pattern names its line.
struct PathGlob(String, Glob);

impl<'de> Deserialize<'de> for PathGlob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        // `*` stays within one path segment; `**` crosses segments.
        let glob = GlobBuilder::new(&s)
            .literal_separator(true)
            .build()
            .map_err(|e| serde::de::Error::custom(format!("invalid path glob {s:?}: {e}")))?;
        Ok(PathGlob(s, glob))
    }
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(path, &text)
    }

    /// Parses and validates config text; `path` is only used in messages.
    /// What a value's type cannot check alone (a section's keys together,
    /// one entry against the others) is checked here, section by section.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let src = Source { path, text };
        let de = toml::de::Deserializer::parse(text)
            .map_err(|e| src.invalid(String::new(), e.span(), e.message().to_string()))?;
        let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let inner = e.into_inner();
            // Spanned<T> shows up in the path as a private field; hide it.
            let key = key.replace("$__serde_spanned_private_value.", "");
            let key = if key == "." { String::new() } else { key };
            src.invalid(key, inner.span(), inner.message().to_string())
        })?;
        let apps = src.apps(raw.apps, &raw.fly.api_url)?;
        if raw.pools.keys().any(|name| name.as_str().trim().is_empty()) {
            return Err(src.invalid("pools".into(), None, "pool name is empty".into()));
        }
        check_canaries(&raw.pools).map_err(|(k, m)| src.invalid(k, None, m))?;
        let severity = match raw.severity {
            None => default_severity_rules(),
            Some(rules) => src.severity_rules(rules)?,
        };
        let alerts = src.alerts(raw.alerts, raw.sweep.interval.get())?;
        src.server(&raw.server)?;
        src.gates(&raw.gates)?;
        check_token_envs(&raw.fly, &apps, &raw.rotation)
            .map_err(|(k, m)| src.invalid(k, None, m))?;
        Ok(Config {
            path: path.to_path_buf(),
            fly: raw.fly,
            overlay: raw.overlay,
            sweep: raw.sweep,
            probe: raw.probe,
            apps,
            pools: raw.pools,
            severity,
            rotation: raw.rotation,
            alerts,
            metrics: raw.metrics,
            server: raw.server,
            records: raw.records,
            release: raw.release,
            gates: raw.gates,
        })
    }

    /// Every Fly app the daemon calls, each with the environment variable
    /// of the token its calls carry and the key that chose it: each of
    /// `apps[]` (its `token_env`, else `fly.token_env`), then the
    /// coordinator's app when it is not one of them
    /// (`rotation.coordinator_token_env`, else `fly.token_env`). A
    /// coordinator in a listed app uses that app's token.
    pub fn fly_tokens(&self) -> Vec<AppToken<'_>> {
        let mut out: Vec<AppToken<'_>> = self
            .apps
            .iter()
            .enumerate()
            .map(|(i, app)| match &app.token_env {
                Some(var) => AppToken {
                    app: &app.name,
                    var,
                    key: format!("apps[{i}].token_env"),
                },
                None => AppToken {
                    app: &app.name,
                    var: &self.fly.token_env,
                    key: "fly.token_env".into(),
                },
            })
            .collect();
        if let Some(c) = &self.rotation.coordinator {
            match out.iter_mut().find(|t| &c.app == t.app) {
                // Checked at load: the same variable as the app's, if set.
                Some(t) => {
                    if let Some(var) = &self.rotation.coordinator_token_env {
                        t.var = var;
                        t.key = "rotation.coordinator_token_env".into();
                    }
                }
                None => out.push(match &self.rotation.coordinator_token_env {
                    Some(var) => AppToken {
                        app: &c.app,
                        var,
                        key: "rotation.coordinator_token_env".into(),
                    },
                    None => AppToken {
                        app: &c.app,
                        var: &self.fly.token_env,
                        key: "fly.token_env".into(),
                    },
                }),
            }
        }
        out
    }

    /// Whether any pool can act on a machine (anything but `observe`);
    /// pools without a section use `default` or the built-in default, which acts.
    /// Whether the coordinator sits in one of the swept apps, where any
    /// agent can write its metadata (docs/deploy.md, "The coordination machine").
    pub fn coordinator_exposed(&self) -> bool {
        self.rotation
            .coordinator
            .as_ref()
            .is_some_and(|c| self.apps.iter().any(|a| a.name.as_str() == c.app.as_str()))
    }

    pub fn acts(&self) -> bool {
        let acts = |p: &PoolConfig| {
            Severity::ALL
                .iter()
                .any(|s| p.actions.for_severity(*s) != PolicyAction::Observe)
        };
        self.pools.values().any(acts)
            || (!self.pools.contains_key(&PoolName::from(DEFAULT_POOL))
                && acts(&PoolConfig::default()))
    }

    /// Where the webhooks' alert state persists: `alerts.state_file`, or
    /// `alert-state.json` in the directory that holds `overlay.mirror_dir`
    /// (on Fly, the volume: `/data/alert-state.json`).
    pub fn alert_state_file(&self) -> PathBuf {
        if let Some(path) = &self.alerts.state_file {
            return path.clone();
        }
        let dir = self
            .overlay
            .mirror_dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        dir.join(DEFAULT_ALERT_STATE_FILE)
    }

    pub fn app(&self, name: &AppName) -> Option<&AppConfig> {
        self.apps.iter().find(|a| &a.name == name)
    }
}

/// `pools.NAME.after`: a configured pool other than itself, at a ratio in
/// (0, 1], and no chain of `after` that comes back to where it started (it
/// would wait forever).
fn check_canaries(pools: &BTreeMap<PoolName, PoolConfig>) -> Result<(), (String, String)> {
    for (name, pool) in pools {
        if pool.after_ratio <= 0.0 {
            return Err((
                format!("pools.{name}.after_ratio"),
                "must be greater than 0 (at most 1.0)".into(),
            ));
        }
        let Some(first) = &pool.after else { continue };
        let key = format!("pools.{name}.after");
        if first == name {
            return Err((key, format!("pool {name} cannot wait for itself")));
        }
        let mut chain = vec![name.clone()];
        let mut next = Some(first);
        while let Some(canary) = next {
            let Some(c) = pools.get(canary) else {
                return Err((
                    key,
                    format!("names pool {canary:?}, which has no [pools.{canary}] section"),
                ));
            };
            chain.push(canary.clone());
            if canary == name {
                let chain: Vec<&str> = chain.iter().map(PoolName::as_str).collect();
                return Err((key, format!("`after` makes a cycle: {}", chain.join(" → "))));
            }
            // A cycle not through `name` is reported at its own pools.
            if chain[..chain.len() - 1].contains(canary) {
                break;
            }
            next = c.after.as_ref();
        }
    }
    Ok(())
}

/// The text being parsed, for errors that name the file, the key and the line.
struct Source<'t> {
    path: &'t Path,
    text: &'t str,
}

impl Source<'_> {
    /// Messages quote values and keys as written: bounded, so a
    /// megabyte-long value cannot make a megabyte-long error.
    fn invalid(&self, key: String, span: Option<Range<usize>>, message: String) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_path_buf(),
            key: crate::text::bounded(&key, MAX_ERROR_KEY_CHARS),
            line: span.map(|s| line_of(self.text, s.start)),
            message: crate::text::bounded(&message, MAX_ERROR_MESSAGE_CHARS),
        }
    }

    /// `[[apps]]`: at least one, each named once, each health URL naming one
    /// machine and not the Fly API's host.
    fn apps(
        &self,
        raw: Vec<toml::Spanned<AppConfig>>,
        fly_api_url: &str,
    ) -> Result<Vec<AppConfig>, ConfigError> {
        if raw.is_empty() {
            return Err(self.invalid(
                "apps".into(),
                None,
                "at least one [[apps]] entry is required".into(),
            ));
        }
        let fly_host = url::Url::parse(fly_api_url)
            .ok()
            .and_then(|u| u.host().map(|h| h.to_owned()));
        let mut apps = Vec::with_capacity(raw.len());
        for (i, app) in raw.into_iter().enumerate() {
            let span = app.span();
            let mut app = app.into_inner();
            if let Some(fly) = &fly_host {
                app.health_url.refuse_host(fly).map_err(|m| {
                    self.invalid(format!("apps[{i}].health_url"), Some(span.clone()), m)
                })?;
            }
            if !app.health_url.names_one_machine() {
                return Err(self.invalid(
                    format!("apps[{i}].health_url"),
                    Some(span),
                    format!(
                        "the health URL of app {:?} has no per-machine placeholder ({{machine_id}} or {{private_ip}}): every machine would be probed at the same URL, so one agent's report could authorize restarting another; e.g. http://{{machine_id}}.vm.{{app}}.internal:8080/health",
                        crate::text::bounded(app.name.as_str(), 64)
                    ),
                ));
            }
            if app.name.as_str().trim().is_empty() {
                return Err(self.invalid(
                    format!("apps[{i}].name"),
                    Some(span),
                    "app name is empty".into(),
                ));
            }
            if apps.iter().any(|a: &AppConfig| a.name == app.name) {
                return Err(self.invalid(
                    format!("apps[{i}].name"),
                    Some(span),
                    format!("app {:?} is listed twice", app.name.as_str()),
                ));
            }
            apps.push(app);
        }
        Ok(apps)
    }

    /// `[[severity]]`, each rule compiled (a bad one names its index and line).
    fn severity_rules(
        &self,
        rules: Vec<toml::Spanned<RawSeverityRule>>,
    ) -> Result<Vec<SeverityRule>, ConfigError> {
        rules
            .into_iter()
            .enumerate()
            .map(|(i, rule)| {
                let span = rule.span();
                compile_rule(rule.into_inner())
                    .map_err(|m| self.invalid(format!("severity[{i}]"), Some(span), m))
            })
            .collect()
    }

    /// `[alerts]`: webhooks and Alertmanagers fit their format, the grouping
    /// is a set, the runbook is an http(s) URL, the state file names a file.
    /// `alerts.stale_after` is at least a sweep interval, and
    /// `alerts.resolve_after` at least `alerts.stale_after`.
    fn alerts(&self, raw: RawAlerts, sweep: Duration) -> Result<AlertsConfig, ConfigError> {
        let (stale_after, resolve_after) = self.alert_holds(&raw, sweep)?;
        let webhooks = self.webhooks(raw.webhooks)?;
        let alertmanagers = self.alertmanagers(raw.alertmanager)?;
        let heartbeats = self.heartbeats(raw.heartbeat)?;
        check_group_by(&raw.group_by)
            .map_err(|m| self.invalid("alerts.group_by".into(), None, m))?;
        if !matches!(
            url::Url::parse(&raw.runbook_url)
                .map(|u| u.scheme().to_owned())
                .as_deref(),
            Ok("http" | "https")
        ) {
            return Err(self.invalid(
                "alerts.runbook_url".into(),
                None,
                "must be an http(s) URL of your copy of docs/operations.md".into(),
            ));
        }
        if raw
            .state_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty() || p.file_name().is_none())
        {
            return Err(self.invalid(
                "alerts.state_file".into(),
                None,
                "must name a file (e.g. \"/data/alert-state.json\"); leave it out for the default beside overlay.mirror_dir".into(),
            ));
        }
        Ok(AlertsConfig {
            resolve_after,
            stale_after,
            coherence_threshold: raw.coherence_threshold,
            coherence_for: raw.coherence_for,
            state_file: raw.state_file,
            group_by: raw.group_by,
            runbook_url: raw.runbook_url,
            webhooks,
            alertmanagers,
            heartbeats,
        })
    }

    /// `[[alerts.heartbeat]]`: a URL variable and a bounded timeout.
    fn heartbeats(
        &self,
        raw: Vec<toml::Spanned<HeartbeatConfig>>,
    ) -> Result<Vec<HeartbeatConfig>, ConfigError> {
        let mut heartbeats = Vec::with_capacity(raw.len());
        for (i, hb) in raw.into_iter().enumerate() {
            let span = hb.span();
            let hb = hb.into_inner();
            if !is_env_name(&hb.url_env) {
                return Err(self.invalid(
                    format!("alerts.heartbeat[{i}].url_env"),
                    Some(span),
                    "is not an environment variable name (set it to the variable holding the ping URL, e.g. \"HEARTBEAT_URL\"; the URL itself never goes in the config)".into(),
                ));
            }
            if hb.timeout.is_zero() || hb.timeout > MAX_HEARTBEAT_TIMEOUT {
                return Err(self.invalid(
                    format!("alerts.heartbeat[{i}].timeout"),
                    Some(span),
                    format!(
                        "must be greater than zero and at most {}",
                        humantime::format_duration(MAX_HEARTBEAT_TIMEOUT)
                    ),
                ));
            }
            heartbeats.push(hb);
        }
        Ok(heartbeats)
    }

    /// `(alerts.stale_after, alerts.resolve_after)`, defaulted and checked.
    fn alert_holds(
        &self,
        raw: &RawAlerts,
        sweep: Duration,
    ) -> Result<(Duration, Duration), ConfigError> {
        let sweeps = sweep.saturating_mul(ALERT_SWEEPS);
        let stale = raw.stale_after.map_or(sweeps, NonZeroDuration::get);
        if stale < sweep {
            return Err(self.invalid(
                "alerts.stale_after".into(),
                None,
                format!(
                    "{} is shorter than sweep.interval ({}): every view would be stale before the next sweep",
                    humantime::format_duration(stale),
                    humantime::format_duration(sweep)
                ),
            ));
        }
        let resolve = raw
            .resolve_after
            .map_or(sweeps.max(stale), NonZeroDuration::get);
        if resolve < stale {
            return Err(self.invalid(
                "alerts.resolve_after".into(),
                None,
                format!(
                    "{} is shorter than alerts.stale_after ({}): a replica whose view is not yet stale could re-fire an incident another replica has resolved",
                    humantime::format_duration(resolve),
                    humantime::format_duration(stale)
                ),
            ));
        }
        Ok((stale, resolve))
    }

    /// `[[alerts.webhooks]]`: the keys each format takes, and only those.
    fn webhooks(
        &self,
        raw: Vec<toml::Spanned<WebhookConfig>>,
    ) -> Result<Vec<WebhookConfig>, ConfigError> {
        let mut webhooks = Vec::with_capacity(raw.len());
        for (i, hook) in raw.into_iter().enumerate() {
            let span = hook.span();
            let hook = hook.into_inner();
            let key = format!("alerts.webhooks[{i}]");
            match hook.format {
                WebhookFormat::Pagerduty if hook.routing_key_env.is_none() => {
                    return Err(self.invalid(
                        format!("{key}.routing_key_env"),
                        Some(span),
                        "a pagerduty webhook needs routing_key_env (the env var holding the Events v2 routing key)".into(),
                    ));
                }
                WebhookFormat::Json | WebhookFormat::Slack if hook.routing_key_env.is_some() => {
                    return Err(self.invalid(
                        format!("{key}.routing_key_env"),
                        Some(span),
                        "routing_key_env only applies to format = \"pagerduty\"".into(),
                    ));
                }
                WebhookFormat::Slack | WebhookFormat::Pagerduty if hook.secret_env.is_some() => {
                    return Err(self.invalid(
                        format!("{key}.secret_env"),
                        Some(span),
                        "secret_env (HMAC signature) only applies to format = \"json\"".into(),
                    ));
                }
                _ => {}
            }
            webhooks.push(hook);
        }
        Ok(webhooks)
    }

    /// `[[alerts.alertmanager]]`: a URL variable, and labels the daemon does
    /// not set itself, each a label name with a value.
    fn alertmanagers(
        &self,
        raw: Vec<toml::Spanned<AlertmanagerConfig>>,
    ) -> Result<Vec<AlertmanagerConfig>, ConfigError> {
        let mut alertmanagers = Vec::with_capacity(raw.len());
        for (i, am) in raw.into_iter().enumerate() {
            let span = am.span();
            let am = am.into_inner();
            if am.url_env.trim().is_empty() {
                return Err(self.invalid(
                    format!("alerts.alertmanager[{i}].url_env"),
                    Some(span),
                    "names no environment variable (set it to the variable holding Alertmanager's URL, e.g. \"ALERTMANAGER_URL\")".into(),
                ));
            }
            for (name, value) in &am.labels {
                let problem = if !label_name_ok(name) {
                    "is not a label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)"
                } else if ALERTMANAGER_LABELS.contains(&name.as_str()) {
                    "is set by the daemon itself"
                } else if value.trim().is_empty() {
                    "has an empty value"
                } else {
                    continue;
                };
                return Err(self.invalid(
                    format!("alerts.alertmanager[{i}].labels.{name}"),
                    Some(span),
                    format!("label {name:?} {problem}"),
                ));
            }
            alertmanagers.push(am);
        }
        Ok(alertmanagers)
    }

    /// `[gates.alertmanager]`: a variable name, matchers, a bounded timeout.
    fn gates(&self, gates: &GatesConfig) -> Result<(), ConfigError> {
        let Some(am) = &gates.alertmanager else {
            return Ok(());
        };
        if !is_env_name(&am.url_env) {
            return Err(self.invalid(
                "gates.alertmanager.url_env".into(),
                None,
                "is not an environment variable name (set it to the variable holding Alertmanager's base URL, e.g. \"ALERTMANAGER_URL\"; the URL itself never goes in the config)".into(),
            ));
        }
        if am.matchers.is_empty() {
            // No matcher matches every alert, Watchdog's always-firing one
            // included: the gate would never open.
            return Err(self.invalid(
                "gates.alertmanager.matchers".into(),
                None,
                "is empty: give at least one matcher (e.g. ['severity=\"critical\"']); with none, every alert (Watchdog's too) would block every claim".into(),
            ));
        }
        if am.timeout.get() > MAX_GATE_TIMEOUT {
            return Err(self.invalid(
                "gates.alertmanager.timeout".into(),
                None,
                format!(
                    "must be at most {}",
                    humantime::format_duration(MAX_GATE_TIMEOUT)
                ),
            ));
        }
        Ok(())
    }

    /// `[server]`: the limits past which a setting is a mistake.
    fn server(&self, server: &ServerConfig) -> Result<(), ConfigError> {
        if server.max_connections.get() > MAX_SERVER_CONNECTIONS {
            return Err(self.invalid(
                "server.max_connections".into(),
                None,
                format!("must be at most {MAX_SERVER_CONNECTIONS}"),
            ));
        }
        if server.max_body_bytes.get() > MAX_SERVER_BODY_BYTES {
            return Err(self.invalid(
                "server.max_body_bytes".into(),
                None,
                format!("must be at most {MAX_SERVER_BODY_BYTES} (1 MiB)"),
            ));
        }
        Ok(())
    }
}

/// The pool of machines without a pool key.
pub const DEFAULT_POOL: &str = "default";

fn compile_rule(raw: RawSeverityRule) -> Result<SeverityRule, String> {
    let has_range_condition =
        !raw.trailers.is_empty() || !raw.paths.is_empty() || raw.min_commits_behind.is_some();
    if !raw.unknown_ref && !has_range_condition {
        return Err(
            "rule has no condition: set unknown_ref = true, trailers, paths or min_commits_behind"
                .into(),
        );
    }
    if raw.unknown_ref && has_range_condition {
        return Err("unknown_ref = true cannot be combined with trailers, paths or min_commits_behind: an unknown ref has no commit range".into());
    }
    let path_set = if raw.paths.is_empty() {
        None
    } else {
        let mut b = GlobSetBuilder::new();
        for p in &raw.paths {
            b.add(p.1.clone());
        }
        Some(b.build().map_err(|e| format!("invalid paths: {e}"))?)
    };
    Ok(SeverityRule {
        level: raw.level,
        unknown_ref: raw.unknown_ref,
        trailers: raw
            .trailers
            .iter()
            .map(|t| t.trim().to_ascii_lowercase())
            .collect(),
        paths: raw.paths.into_iter().map(|p| p.0).collect(),
        path_set,
        min_commits_behind: raw.min_commits_behind,
    })
}

/// The built-in rules of docs/design.md §5.2, used when the file has no `[[severity]]`.
pub fn default_severity_rules() -> Vec<SeverityRule> {
    let rule = |level, unknown_ref, trailers: &[&str], paths: &[&str], min: Option<u64>| {
        compile_rule(RawSeverityRule {
            level,
            unknown_ref,
            trailers: trailers.iter().map(|s| s.to_string()).collect(),
            paths: paths
                .iter()
                .map(|p| {
                    let glob = GlobBuilder::new(p).literal_separator(true).build();
                    PathGlob(
                        p.to_string(),
                        glob.unwrap_or_else(|_| unreachable!("built-in glob {p} is valid")),
                    )
                })
                .collect(),
            min_commits_behind: min,
        })
        .unwrap_or_else(|e| unreachable!("built-in severity rule is valid: {e}"))
    };
    vec![
        rule(Severity::Critical, true, &[], &[], None),
        rule(Severity::Critical, false, &["Security"], &[], None),
        rule(
            Severity::High,
            false,
            &[],
            &["policies/**", "guards/**"],
            None,
        ),
        rule(Severity::High, false, &[], &[], Some(20)),
        rule(Severity::Medium, false, &[], &[], Some(5)),
    ]
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())]
        .bytes()
        .filter(|&b| b == b'\n')
        .count()
        + 1
}

// ---- field parsers and defaults -------------------------------------------

/// The longest duration any key accepts. Longer ones are typos (a missing
/// unit, `"300000years"`) and would overflow the timestamp arithmetic that
/// deadlines are made of.
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    let parsed = humantime::parse_duration(&s).map_err(|e| {
        serde::de::Error::custom(format!(
            "invalid duration {s:?}: {e} (use e.g. \"30s\", \"5m\", \"1h 30m\")"
        ))
    })?;
    if parsed > MAX_DURATION {
        return Err(serde::de::Error::custom(format!(
            "duration {s:?} is longer than 30 days, the most any duration here may be"
        )));
    }
    Ok(parsed)
}

/// A duration greater than zero (and at most [`MAX_DURATION`]), for the keys
/// that pace or bound work (`sweep.interval`, timeouts, ceilings), where zero
/// would spin or give up at once. Parsed like every duration, so a bad value
/// names its key and line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NonZeroDuration(Duration);

impl NonZeroDuration {
    pub const fn new(d: Duration) -> Option<NonZeroDuration> {
        if d.is_zero() {
            None
        } else {
            Some(NonZeroDuration(d))
        }
    }

    /// For defaults written in the source; `secs` is never 0 there.
    pub const fn from_secs(secs: u64) -> NonZeroDuration {
        NonZeroDuration(Duration::from_secs(if secs == 0 { 1 } else { secs }))
    }

    pub const fn get(self) -> Duration {
        self.0
    }
}

impl From<NonZeroDuration> for Duration {
    fn from(d: NonZeroDuration) -> Duration {
        d.0
    }
}

impl fmt::Display for NonZeroDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for NonZeroDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        NonZeroDuration::new(duration(d)?)
            .ok_or_else(|| serde::de::Error::custom("must be greater than zero"))
    }
}

/// Text with something other than whitespace in it (`overlay.repo`,
/// `overlay.branch`): an empty one would only fail later, far from its key.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NonEmpty(String);

impl NonEmpty {
    pub fn new(s: impl Into<String>) -> Option<NonEmpty> {
        let s = s.into();
        (!s.trim().is_empty()).then_some(NonEmpty(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<NonEmpty> for String {
    fn from(s: NonEmpty) -> String {
        s.0
    }
}

impl fmt::Display for NonEmpty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for NonEmpty {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        NonEmpty::new(String::deserialize(d)?).ok_or_else(|| serde::de::Error::custom("is empty"))
    }
}

/// A count that must be at least 1, refused in the user's words (serde's
/// own message for a zero `NonZero*` is "expected a nonzero u32").
fn at_least_one<'de, D, T>(d: D, zero: &'static str) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<std::num::NonZeroU64>,
{
    let n = u64::deserialize(d)?;
    let n = std::num::NonZeroU64::new(n).ok_or_else(|| serde::de::Error::custom(zero))?;
    T::try_from(n).map_err(|_| serde::de::Error::custom(format!("{n} is too large")))
}

/// `rotation.max_attempts`.
fn restarts<'de, D: Deserializer<'de>>(d: D) -> Result<NonZeroU32, D::Error> {
    at_least_one(d, "must be at least 1 (the first restart is an attempt)")
}

/// `overlay.max_path_comparisons`.
fn comparisons<'de, D: Deserializer<'de>>(d: D) -> Result<NonZeroUsize, D::Error> {
    at_least_one(d, "must be at least 1")
}

fn coordinator<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<crate::metadata::slots::Coordinator>, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map(Some).map_err(serde::de::Error::custom)
}

fn ratio<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let v = f64::deserialize(d)?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(serde::de::Error::custom(format!(
            "{v} is not a ratio between 0.0 and 1.0"
        )))
    }
}

fn http_url<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let s = String::deserialize(d)?;
    let url = url::Url::parse(&s)
        .map_err(|e| serde::de::Error::custom(format!("invalid URL {s:?}: {e}")))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(serde::de::Error::custom(format!(
            "URL {s:?} must be http or https"
        )));
    }
    Ok(s.trim_end_matches('/').to_string())
}

/// Commits one analysis compares for path signals, at most (≈ 1 s at the
/// 35–47 µs a comparison takes): an agent reporting a commit far back in a
/// long history must not hold up the sweep of every other machine. Facts
/// are kept, so the next analyses go on where this one stopped.
pub const DEFAULT_DIFF_BUDGET: usize = 20_000;
/// `overlay.fetch_timeout`'s default: the deadline of
/// [`crate::observe::overlay::Overlay::fetch`].
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(120);

const fn secs<const N: u64>() -> Duration {
    Duration::from_secs(N)
}
fn default_fetch_timeout() -> NonZeroDuration {
    NonZeroDuration::from_secs(DEFAULT_FETCH_TIMEOUT.as_secs())
}
fn default_max_path_comparisons() -> NonZeroUsize {
    NonZeroUsize::new(DEFAULT_DIFF_BUDGET).unwrap_or(NonZeroUsize::MIN)
}

fn default_git_token_env() -> String {
    "OVERLAY_GIT_TOKEN".into()
}
fn default_health_url() -> HealthUrlTemplate {
    HealthUrlTemplate::parse("http://{machine_id}.vm.{app}.internal:8080/health")
        .unwrap_or_else(|e| unreachable!("the default health URL is valid: {e}"))
}
/// `alerts.group_by` is a non-empty set.
fn check_group_by(fields: &[GroupField]) -> Result<(), String> {
    if fields.is_empty() {
        return Err("is empty: list the fields one incident is keyed by, out of \"app\", \"pool\", \"severity\", \"tip\", \"machine\" (\"machine\" alone: one incident per machine)".into());
    }
    for (i, f) in fields.iter().enumerate() {
        if fields[..i].contains(f) {
            return Err(format!("lists \"{}\" twice", f.as_str()));
        }
    }
    Ok(())
}

fn low() -> Severity {
    Severity::Low
}

/// A valid config for the decide modules' tests: the required `[overlay]`
/// and one app, `app`, whose machines name their pool in metadata `pool`,
/// then `extra` (whole sections: pools, severity rules, rotation).
#[cfg(test)]
pub(crate) fn test_config(extra: &str) -> Config {
    let text = format!(
        r#"
[overlay]
repo = "/r"
branch = "release"
mirror_dir = "/m"
[[apps]]
name = "app"
pool_key = "pool"
{extra}
"#
    );
    Config::parse(Path::new("t.toml"), &text).expect("a test config")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The secrets rule: unset, empty and blank are one "not set"; anything
    /// else is the value as written.
    #[test]
    fn a_blank_variable_holds_no_secret() {
        use secrecy::ExposeSecret;
        let env = |k: &str| match k {
            "EMPTY" => Some(String::new()),
            "BLANK" => Some(" \n".into()),
            "SET" => Some(" tok ".into()),
            _ => None,
        };
        for var in ["UNSET", "EMPTY", "BLANK"] {
            assert!(env_secret(env, var).is_none(), "{var}");
        }
        assert_eq!(
            env_secret(env, "SET").map(|s| s.expose_secret().to_string()),
            Some(" tok ".into())
        );
    }

    const MINIMAL: &str = r#"
[overlay]
repo = "/srv/overlay"
branch = "release"
mirror_dir = "/data/overlay.git"

[[apps]]
name = "agents"
"#;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("test.toml"), text)
    }

    fn err(text: &str) -> String {
        match parse(text) {
            Ok(_) => panic!("config should have been rejected:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    /// Each default the configuration table (docs/reference.md) states,
    /// written into the minimal config, gives the same `Config` as leaving
    /// the key out: the docs cannot drift from the code's defaults.
    #[test]
    fn readme_defaults_are_the_parsed_defaults() {
        let readme = include_str!("../docs/reference.md");
        let defaults = format!("{:?}", parse(MINIMAL).unwrap());
        let mut checked = Vec::new();
        for row in readme.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = row.split(" | ").collect();
            let (Some(keys), Some(values)) = (cells.first(), cells.get(1)) else {
                continue;
            };
            let keys = keys.trim_start_matches("| ");
            let Some((section, _)) = keys.trim_matches('`').split_once('.') else {
                continue;
            };
            // Rows like `rotation.*`: "`name value`, …".
            let pairs: Vec<(String, String)> = if keys.ends_with(".*`") {
                values
                    .split(", ")
                    .filter_map(|v| v.trim_matches('`').split_once(' '))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            } else {
                // `a.b` / `c` with `x` / `y`: c is in a's section.
                let keys = keys.split(" / ").map(|k| k.trim_matches('`'));
                let values: Vec<&str> = values.split(" / ").collect();
                let plain = |v: &&str| {
                    v.len() > 2
                        && v.starts_with('`')
                        && v.ends_with('`')
                        && !v[1..v.len() - 1].contains('`')
                };
                if !values.iter().all(plain) {
                    continue; // required, none, prose
                }
                keys.zip(values)
                    .map(|(k, v)| {
                        let k = k.rsplit('.').next().unwrap_or(k);
                        (k.to_owned(), v.trim_matches('`').to_owned())
                    })
                    .collect()
            };
            if section.contains('[') || section == "pools" || pairs.is_empty() {
                continue;
            }
            for (key, value) in pairs {
                let literal = if value.parse::<f64>().is_ok() || value == "true" || value == "false"
                {
                    value.clone()
                } else {
                    format!("{value:?}")
                };
                let mut doc: toml::Table = MINIMAL.parse().unwrap();
                let value_doc: toml::Table = format!("v = {literal}").parse().unwrap();
                let table = doc
                    .entry(section)
                    .or_insert_with(|| toml::Table::new().into());
                if let Some(table) = table.as_table_mut() {
                    table.insert(key.clone(), value_doc["v"].clone());
                }
                let text = toml::to_string(&doc).unwrap();
                let stated = parse(&text)
                    .unwrap_or_else(|e| panic!("README default {section}.{key} = {value}: {e}"));
                assert_eq!(
                    format!("{stated:?}"),
                    defaults,
                    "README says {section}.{key} defaults to {value}"
                );
                checked.push(format!("{section}.{key}"));
            }
        }
        // The table's shape is what this test reads; make sure it still does.
        assert!(
            checked.len() >= 30,
            "only {checked:?} read from docs/reference.md"
        );
    }

    /// The record key comes from the variables `[records]` names: unset is
    /// none (observe-only), a value that is no key is an error naming the
    /// variable and the config key, and `required_keys` names what to set.
    #[test]
    fn record_keys_are_read_from_the_named_variables() {
        let c = parse(&format!("{MINIMAL}\n[records]\nkey_env = \"K\"\n")).unwrap();
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |var: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == var)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(c.records.keys(env(&[])).unwrap().is_none());
        let missing = c.records.required_keys(env(&[])).unwrap_err();
        assert!(
            missing
                .to_string()
                .starts_with("K (config key `records.key_env`)"),
            "{missing}"
        );
        let bad = c.records.keys(env(&[("K", "xyz")])).unwrap_err();
        assert!(
            bad.to_string().contains("records.key_env") && bad.to_string().contains("not hex"),
            "{bad}"
        );
        const KEY: &str = "0101010101010101010101010101010101010101010101010101010101010101";
        let keys = c.records.keys(env(&[("K", KEY)])).unwrap().expect("a key");
        assert!(keys.previous.is_none());
        assert!(!format!("{keys:?}").contains("0101"));
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.fly.api_url, "https://api.machines.dev");
        // Not flyctl's FLY_API_TOKEN (issue 34 item 4).
        assert_eq!(c.fly.token_env, "FLEET_RECONCILER_FLY_TOKEN");
        assert_eq!(c.sweep.interval.get(), Duration::from_secs(30));
        assert_eq!(c.probe.max_body_bytes.get(), 65536);
        assert_eq!(c.rotation.min_drift_age, Duration::from_secs(120));
        assert_eq!(c.rotation.heartbeat_max_age, Duration::from_secs(30));
        assert_eq!(
            c.apps[0].health_url.as_str(),
            "http://{machine_id}.vm.{app}.internal:8080/health"
        );
        assert_eq!(c.severity.len(), 5);
        assert!(c.pools.is_empty());
        assert_eq!(c.server.listen.port(), 9090);
        assert_eq!(c.server.header_read_timeout.get(), Duration::from_secs(10));
        assert_eq!(c.server.request_timeout.get(), Duration::from_secs(60));
        assert_eq!(c.server.max_connections.get(), 256);
        assert_eq!(c.server.max_body_bytes.get(), 16384);
        assert_eq!(c.server.admin_auth_failures.get(), 10);
        assert_eq!(c.server.admin_auth_window.get(), Duration::from_secs(60));
        assert_eq!(c.alerts.coherence_threshold, 1.0);
        assert_eq!(c.alerts.coherence_for, Duration::from_secs(900));
        assert_eq!(c.rotation.coordinator, None);
        assert!(c.metrics.per_machine);
    }

    #[test]
    fn unknown_key_names_the_key_and_line() {
        let text = format!("{MINIMAL}\n[rotation]\ndrain_ceilling = \"1h\"\n");
        let e = err(&text);
        assert!(e.contains("drain_ceilling"), "{e}");
        assert!(e.contains("test.toml:"), "{e}");
        let line = text
            .lines()
            .position(|l| l.starts_with("drain_ceilling"))
            .unwrap()
            + 1;
        assert!(
            e.contains(&format!(":{line}")),
            "expected line {line} in {e}"
        );
    }

    #[test]
    fn absurd_durations_are_refused_with_their_key_and_line() {
        for key in ["min_drift_age", "retry_after", "probe_failure_ceiling"] {
            let text = format!("{MINIMAL}\n[rotation]\n{key} = \"300000years\"\n");
            let e = err(&text);
            let line = text.lines().position(|l| l.starts_with(key)).unwrap() + 1;
            assert!(
                e.contains(&format!("rotation.{key}"))
                    && e.contains(&format!(":{line}"))
                    && e.contains("longer than 30 days"),
                "{e}"
            );
        }
        let ok = format!("{MINIMAL}\n[rotation]\nretry_after = \"30days\"\n");
        assert!(Config::parse(Path::new("test.toml"), &ok).is_ok());
    }

    #[test]
    fn rotation_attempts_and_release_ceiling_are_validated_with_their_key() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.rotation.max_attempts.get(), 3);
        assert_eq!(c.rotation.release_ceiling.get(), Duration::from_secs(1800));
        let e = err(&format!("{MINIMAL}\n[rotation]\nmax_attempts = 0\n"));
        assert!(
            e.contains("rotation.max_attempts") && e.contains("at least 1"),
            "{e}"
        );
        let e = err(&format!(
            "{MINIMAL}\n[rotation]\nrelease_ceiling = \"0s\"\n"
        ));
        assert!(e.contains("rotation.release_ceiling"), "{e}");
        let e = err(&format!("{MINIMAL}\n[rotation]\nmax_attempts = -1\n"));
        assert!(e.contains("rotation.max_attempts"), "{e}");
    }

    /// The keys that may not be zero or empty say so through their types
    /// (`NonZeroDuration`, `NonEmpty`, a count of at least 1): the key, the
    /// line and the same words as the checks they replace.
    #[test]
    fn release_halts_are_off_by_default_and_read_as_written() {
        let c = test_config("");
        assert_eq!(c.release.halt_after_failures, 0, "off unless configured");
        assert_eq!(c.release.halt_window.get(), Duration::from_secs(1800));
        let c = test_config("[release]\nhalt_after_failures = 3\nhalt_window = \"10m\"\n");
        assert_eq!(c.release.halt_after_failures, 3);
        assert_eq!(c.release.halt_window.get(), Duration::from_secs(600));
    }

    #[test]
    fn the_alert_gate_is_off_by_default_and_its_mistakes_name_key_and_matcher() {
        assert!(test_config("").gates.alertmanager.is_none());
        let gate = |body: &str| {
            format!(
                "[overlay]\nrepo = \"/r\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n[[apps]]\nname = \"a\"\n[gates.alertmanager]\n{body}\n"
            )
        };
        let c = parse(&gate(
            "url_env = \"AM_URL\"\nmatchers = ['severity=\"critical\"', 'alertname=~\"Agent.*\"']",
        ))
        .unwrap();
        let am = c.gates.alertmanager.as_ref().unwrap();
        assert_eq!(am.url_env, "AM_URL");
        let shown: Vec<String> = am.matchers.iter().map(|m| m.to_string()).collect();
        assert_eq!(shown, [r#"severity="critical""#, r#"alertname=~"Agent.*""#]);
        assert!(!am.fail_open, "fails closed unless told");
        assert_eq!(am.timeout.get(), Duration::from_secs(10));
        assert!(!crate::decide::policy::Policy::from_config(&c).gate_fail_open);
        for (body, key, says) in [
            (
                "url_env = \"AM_URL\"\nmatchers = ['severity=\"critical\"', 'alertname=~\"(\"']",
                "gates.alertmanager.matchers[1]",
                "alertname=~\\\"(\\\"",
            ),
            (
                "url_env = \"AM_URL\"\nmatchers = ['severity']",
                "gates.alertmanager.matchers[0]",
                "no operator",
            ),
            (
                "url_env = \"AM_URL\"\nmatchers = []",
                "gates.alertmanager.matchers",
                "at least one matcher",
            ),
            (
                "url_env = \"http://am:9093\"\nmatchers = ['a=\"b\"']",
                "gates.alertmanager.url_env",
                "environment variable name",
            ),
            (
                "url_env = \"AM_URL\"\nmatchers = ['a=\"b\"']\ntimeout = \"5m\"",
                "gates.alertmanager.timeout",
                "at most 1m",
            ),
        ] {
            let e = err(&gate(body));
            assert!(
                e.contains(&format!("key `{key}`")) && e.contains(says),
                "{body}: {e}"
            );
        }
    }

    #[test]
    fn zero_and_empty_values_are_refused_naming_key_and_line() {
        let overlay = |repo: &str, branch: &str| {
            format!(
                "[overlay]\nrepo = \"{repo}\"\nbranch = \"{branch}\"\nmirror_dir = \"/m\"\n[[apps]]\nname = \"a\"\n"
            )
        };
        let ok = overlay("/r", "release");
        let cases = [
            (overlay(" ", "release"), "overlay.repo", ":2:", "is empty"),
            (overlay("/r", ""), "overlay.branch", ":3:", "is empty"),
        ];
        for (text, key, line, says) in &cases {
            let e = err(text);
            assert!(
                e.contains(&format!("key `{key}`")) && e.contains(line) && e.contains(says),
                "{e}"
            );
        }
        for (section, key, value, says) in [
            (
                "rotation",
                "release_ceiling",
                "\"0s\"",
                "must be greater than zero",
            ),
            ("sweep", "interval", "\"0s\"", "must be greater than zero"),
            ("probe", "timeout", "\"0ms\"", "must be greater than zero"),
            (
                "fly",
                "request_timeout",
                "\"0s\"",
                "must be greater than zero",
            ),
            (
                "server",
                "header_read_timeout",
                "\"0s\"",
                "must be greater than zero",
            ),
            (
                "server",
                "request_timeout",
                "\"0s\"",
                "must be greater than zero",
            ),
            (
                "server",
                "admin_auth_window",
                "\"0s\"",
                "must be greater than zero",
            ),
            (
                "rotation",
                "max_attempts",
                "0",
                "must be at least 1 (the first restart is an attempt)",
            ),
            (
                "release",
                "halt_window",
                "\"0s\"",
                "must be greater than zero",
            ),
            ("release", "halt_after_failures", "-1", "invalid value"),
        ] {
            let text = format!("{ok}[{section}]\n{key} = {value}\n");
            let e = err(&text);
            assert!(
                e.contains(&format!("test.toml:8: key `{section}.{key}`: {says}")),
                "{e}"
            );
        }
        let with_overlay_key = |line: &str| {
            format!(
                "[overlay]\nrepo = \"/r\"\nbranch = \"b\"\nmirror_dir = \"/m\"\n{line}\n[[apps]]\nname = \"a\"\n"
            )
        };
        for (line, key, says) in [
            (
                "fetch_timeout = \"0s\"",
                "overlay.fetch_timeout",
                "must be greater than zero",
            ),
            (
                "max_path_comparisons = 0",
                "overlay.max_path_comparisons",
                "must be at least 1",
            ),
        ] {
            let e = err(&with_overlay_key(line));
            assert!(
                e.contains(&format!("test.toml:5: key `{key}`: {says}")),
                "{e}"
            );
        }
        let c = parse(&with_overlay_key("max_path_comparisons = 1")).unwrap();
        assert_eq!(c.overlay.max_path_comparisons.get(), 1);
        assert_eq!(c.overlay.repo.as_str(), "/r");
    }

    #[test]
    fn bad_duration_names_key_and_value() {
        let e = err(&format!("{MINIMAL}\n[sweep]\ninterval = \"30 parsecs\"\n"));
        assert!(e.contains("sweep.interval"), "{e}");
        assert!(e.contains("30 parsecs"), "{e}");
    }

    #[test]
    fn unknown_action_and_level_are_rejected() {
        let e = err(&format!(
            "{MINIMAL}\n[pools.default]\nactions = {{ low = \"reboot\" }}\n"
        ));
        assert!(e.contains("pools.default.actions.low"), "{e}");
        assert!(e.contains("reboot"), "{e}");
        let e = err(&format!(
            "{MINIMAL}\n[[severity]]\nlevel = \"urgent\"\nmin_commits_behind = 3\n"
        ));
        assert!(e.contains("severity[0].level"), "{e}");
        assert!(e.contains("urgent"), "{e}");
    }

    #[test]
    fn missing_required_keys_are_named() {
        let e = err("[[apps]]\nname = \"a\"\n");
        assert!(e.contains("overlay"), "{e}");
        let e = err(&MINIMAL.replace("branch = \"release\"\n", ""));
        assert!(e.contains("branch"), "{e}");
        let e = err(&MINIMAL.replace("[[apps]]\nname = \"agents\"\n", ""));
        assert!(e.contains("apps"), "{e}");
    }

    #[test]
    fn health_url_placeholders_are_checked() {
        let e = err(&format!(
            "{MINIMAL}\n[[apps]]\nname = \"b\"\nhealth_url = \"http://{{machine}}.internal/health\"\n"
        ));
        assert!(e.contains("{machine}"), "{e}");
        assert!(e.contains("apps[1].health_url"), "{e}");
        let e = err(&format!(
            "{MINIMAL}\n[[apps]]\nname = \"b\"\nhealth_url = \"http://{{private_ip}}:8080/health\"\n"
        ));
        assert!(e.contains("brackets"), "{e}");
        let ok = parse(&format!(
            "{MINIMAL}\n[[apps]]\nname = \"b\"\nhealth_url = \"http://[{{private_ip}}]:8080/{{app}}/{{region}}/{{name}}\"\n"
        ))
        .unwrap();
        let url = ok.apps[1].health_url.render(&UrlVars {
            machine_id: "m",
            app: "b",
            private_ip: "fdaa::3",
            region: "ams",
            name: "n1",
        });
        assert_eq!(url.as_deref(), Ok("http://[fdaa::3]:8080/b/ams/n1"));
    }

    /// A URL the same for every machine of the app would let one agent's
    /// report stand for another's (the fresh probe before a restart
    /// included): refused, naming the key and the app.
    #[test]
    fn a_health_url_must_name_one_machine() {
        for template in [
            "http://agents.internal:8080/health",
            "http://{app}.internal:8080/{region}/health",
            "http://{name}.{app}.internal:8080/health",
        ] {
            let e = err(&format!(
                "{MINIMAL}\n[[apps]]\nname = \"edge\"\nhealth_url = \"{template}\"\n"
            ));
            assert!(
                e.contains("apps[1].health_url")
                    && e.contains("\"edge\"")
                    && e.contains("{machine_id}"),
                "{template}: {e}"
            );
        }
        for template in [
            "http://{machine_id}.vm.{app}.internal:8080/health",
            "http://[{private_ip}]:8080/health",
        ] {
            parse(&format!(
                "{MINIMAL}\n[[apps]]\nname = \"edge\"\nhealth_url = \"{template}\"\n"
            ))
            .unwrap();
        }
    }

    fn vars<'a>(machine_id: &'a str, name: &'a str) -> UrlVars<'a> {
        UrlVars {
            machine_id,
            app: "agents",
            private_ip: "fdaa:0:1:a7b:1::2",
            region: "iad",
            name,
        }
    }

    #[test]
    fn health_url_values_are_percent_encoded_into_their_slot() {
        let host =
            HealthUrlTemplate::parse("http://{machine_id}.vm.{app}.internal:8080/health").unwrap();
        let path =
            HealthUrlTemplate::parse("http://127.0.0.1:9/agents/{name}/health?r={region}").unwrap();
        // Ordinary values are left as they are.
        assert_eq!(
            host.render(&vars("148e1234abcd56", "n")).as_deref(),
            Ok("http://148e1234abcd56.vm.agents.internal:8080/health")
        );
        // Before: `http://x@evil:1/.vm.agents.internal:8080/health`, host evil:1.
        let e = host.render(&vars("x@evil:1/", "n")).unwrap_err();
        assert!(matches!(e, HealthUrlError::Invalid(_)), "{e}");
        // Before: `/admin?/health`. Now one segment of its own slot.
        assert_eq!(
            path.render(&vars("m", "a/../../admin?")).as_deref(),
            Ok("http://127.0.0.1:9/agents/a%2F..%2F..%2Fadmin%3F/health?r=iad")
        );
        assert_eq!(
            path.render(&vars("m", "n#x&y=z @%")).as_deref(),
            Ok("http://127.0.0.1:9/agents/n%23x%26y%3Dz%20%40%25/health?r=iad")
        );
        // A value is never expanded itself.
        assert_eq!(
            path.render(&vars("m", "{region}")).as_deref(),
            Ok("http://127.0.0.1:9/agents/%7Bregion%7D/health?r=iad")
        );
        // `.` and `..` would drop a segment, however they are spelled.
        for dots in [".", "..", "%2e%2e"] {
            let r = path.render(&vars("m", dots));
            if dots.starts_with('%') {
                assert!(r.unwrap().contains("/agents/%252e%252e/"));
            } else {
                assert!(
                    matches!(r, Err(HealthUrlError::PathChanged { .. })),
                    "{dots}: {r:?}"
                );
            }
        }
        // An address goes in as an address; anything else in {private_ip} is encoded.
        let ip = HealthUrlTemplate::parse("http://[{private_ip}]:8080/health").unwrap();
        let mut v = vars("m", "n");
        v.private_ip = "fdaa::2";
        assert_eq!(ip.render(&v).as_deref(), Ok("http://[fdaa::2]:8080/health"));
        v.private_ip = "::1]:9/x?";
        assert!(ip.render(&v).is_err());
    }

    #[test]
    fn health_url_on_the_fly_api_host_is_refused() {
        for (api, template) in [
            (
                "https://api.machines.dev",
                "https://api.machines.dev/agents/{name}/health",
            ),
            (
                "https://api.machines.dev",
                "http://API.Machines.dev.:8080/{name}",
            ),
            ("http://[fdaa::1]:4280", "http://[fdaa:0::1]/{machine_id}"),
        ] {
            let e = err(&format!(
                "[fly]\napi_url = \"{api}\"\n{MINIMAL}\n[[apps]]\nname = \"b\"\nhealth_url = \"{template}\"\n"
            ));
            assert!(
                e.contains("apps[1].health_url") && e.contains("Fly API's host"),
                "{api} {template}: {e}"
            );
        }
        // A host made of placeholders is checked per machine.
        let c = parse(&format!(
            "[fly]\napi_url = \"https://api.machines.dev\"\n{MINIMAL}\n[[apps]]\nname = \"b\"\nhealth_url = \"https://{{name}}.machines.dev/{{machine_id}}/health\"\n"
        ))
        .unwrap();
        let t = &c.apps[1].health_url;
        assert!(t.render(&vars("m", "agent-1")).is_ok());
        let e = t.render(&vars("m", "api")).unwrap_err();
        assert_eq!(e, HealthUrlError::FlyHost("api.machines.dev".into()));
        // The default template, and a loopback Fly API (the simulator
        // serves agents beside it), are fine.
        assert!(parse(MINIMAL).is_ok());
        assert!(
            parse(&format!(
                "[fly]\napi_url = \"http://127.0.0.1:4280\"\n{MINIMAL}\n[[apps]]\nname = \"b\"\nhealth_url = \"http://127.0.0.1:4280/agents/{{machine_id}}/health\"\n"
            ))
            .is_ok()
        );
    }

    /// Each app's calls carry its own token: `apps[].token_env`, else
    /// `fly.token_env`; the coordinator's app its own key, else its app
    /// entry's, else `fly.token_env`.
    #[test]
    fn each_app_has_one_token_variable() {
        let vars = |c: &Config| {
            c.fly_tokens()
                .into_iter()
                .map(|t| format!("{}={} ({})", t.app, t.var, t.key))
                .collect::<Vec<_>>()
        };
        let two = format!("{MINIMAL}token_env = \"AGENTS_TOKEN\"\n[[apps]]\nname = \"batch\"\n");
        let c = parse(&two).unwrap();
        assert_eq!(
            vars(&c),
            [
                "agents=AGENTS_TOKEN (apps[0].token_env)",
                "batch=FLEET_RECONCILER_FLY_TOKEN (fly.token_env)"
            ]
        );
        let c = parse(&format!(
            "{two}[rotation]\ncoordinator = \"reconciler/c1\"\ncoordinator_token_env = \"COORD\"\n"
        ))
        .unwrap();
        assert_eq!(
            vars(&c)[2],
            "reconciler=COORD (rotation.coordinator_token_env)"
        );
        let c = parse(&format!(
            "{two}[rotation]\ncoordinator = \"reconciler/c1\"\n"
        ))
        .unwrap();
        assert_eq!(
            vars(&c)[2],
            "reconciler=FLEET_RECONCILER_FLY_TOKEN (fly.token_env)"
        );
        // A coordinator in a listed app: that app's token, listed once.
        let c = parse(&format!("{two}[rotation]\ncoordinator = \"agents/c1\"\n")).unwrap();
        assert_eq!(vars(&c).len(), 2);
        assert_eq!(vars(&c)[0], "agents=AGENTS_TOKEN (apps[0].token_env)");
        // … and a second, different token for it is refused.
        let e = err(&format!(
            "{two}[rotation]\ncoordinator = \"agents/c1\"\ncoordinator_token_env = \"OTHER\"\n"
        ));
        assert!(
            e.contains("rotation.coordinator_token_env") && e.contains("one app has one token"),
            "{e}"
        );
        let e = err(&format!(
            "{MINIMAL}[rotation]\ncoordinator_token_env = \"X\"\n"
        ));
        assert!(e.contains("without rotation.coordinator"), "{e}");
        // A name, not a token.
        let e = err(&format!("{MINIMAL}token_env = \"fo1 xyz\"\n"));
        assert!(
            e.contains("apps[0].token_env") && e.contains("not an environment variable name"),
            "{e}"
        );
    }

    /// flyctl's FLY_API_TOKEN is read only on a Fly machine, only for
    /// `fly.token_env` at its default, and only when that is unset.
    #[test]
    fn flyctl_token_is_read_only_on_a_fly_machine() {
        let c = parse(&format!(
            "{MINIMAL}[[apps]]\nname = \"own\"\ntoken_env = \"OWN\"\n"
        ))
        .unwrap();
        let tokens = c.fly_tokens();
        let (default, own) = (&tokens[0], &tokens[1]);
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let laptop = env(&[("FLY_API_TOKEN", "flyctl's")]);
        assert_eq!(default.source(&laptop), "FLEET_RECONCILER_FLY_TOKEN");
        let on_fly = env(&[("FLY_API_TOKEN", "t"), ("FLY_MACHINE_ID", "m1")]);
        assert_eq!(default.source(&on_fly), "FLY_API_TOKEN");
        assert_eq!(own.source(&on_fly), "OWN");
        let both = env(&[
            ("FLY_API_TOKEN", "t"),
            ("FLY_MACHINE_ID", "m1"),
            ("FLEET_RECONCILER_FLY_TOKEN", "mine"),
        ]);
        assert_eq!(default.source(&both), "FLEET_RECONCILER_FLY_TOKEN");
        let blank = env(&[("FLY_API_TOKEN", " "), ("FLY_MACHINE_ID", "m1")]);
        assert_eq!(default.source(&blank), "FLEET_RECONCILER_FLY_TOKEN");
    }

    #[test]
    fn duplicate_apps_and_empty_rules_are_rejected() {
        let e = err(&format!("{MINIMAL}\n[[apps]]\nname = \"agents\"\n"));
        assert!(e.contains("apps[1].name") && e.contains("twice"), "{e}");
        let e = err(&format!("{MINIMAL}\n[[severity]]\nlevel = \"low\"\n"));
        assert!(
            e.contains("severity[0]") && e.contains("no condition"),
            "{e}"
        );
        let e = err(&format!(
            "{MINIMAL}\n[[severity]]\nlevel = \"low\"\npaths = [\"a/[\"]\n"
        ));
        assert!(e.contains("invalid path glob"), "{e}");
    }

    #[test]
    fn alert_state_lives_beside_the_mirror_unless_configured() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.alerts.state_file, None);
        assert_eq!(
            c.alert_state_file(),
            PathBuf::from("/data/alert-state.json")
        );
        let c = parse(&MINIMAL.replace("\"/data/overlay.git\"", "\"overlay.git\"")).unwrap();
        assert_eq!(c.alert_state_file(), PathBuf::from("./alert-state.json"));
        let c = parse(&format!(
            "{MINIMAL}\n[alerts]\nstate_file = \"/var/lib/fr/alerts.json\"\n"
        ))
        .unwrap();
        assert_eq!(
            c.alert_state_file(),
            PathBuf::from("/var/lib/fr/alerts.json")
        );
        let e = err(&format!("{MINIMAL}\n[alerts]\nstate_file = \"\"\n"));
        assert!(e.contains("alerts.state_file"), "{e}");
    }

    #[test]
    fn webhook_keys_must_fit_the_format() {
        let e = err(&format!(
            "{MINIMAL}\n[[alerts.webhooks]]\nurl_env = \"U\"\nformat = \"pagerduty\"\n"
        ));
        assert!(e.contains("routing_key_env"), "{e}");
        let e = err(&format!(
            "{MINIMAL}\n[[alerts.webhooks]]\nurl_env = \"U\"\nformat = \"slack\"\nsecret_env = \"S\"\n"
        ));
        assert!(e.contains("secret_env"), "{e}");
        let e = err(&format!(
            "{MINIMAL}\n[[alerts.webhooks]]\nurl_env = \"U\"\nformat = \"teams\"\n"
        ));
        assert!(e.contains("teams"), "{e}");
    }

    #[test]
    fn heartbeats_name_their_url_variable_and_a_bounded_timeout() {
        let c = parse(&format!(
            "{MINIMAL}\n[[alerts.heartbeat]]\nurl_env = \"HB\"\n[[alerts.heartbeat]]\nurl_env = \"HB2\"\nmethod = \"POST\"\ntimeout = \"3s\"\n"
        ))
        .unwrap();
        assert_eq!(c.alerts.heartbeats.len(), 2);
        assert_eq!(c.alerts.heartbeats[0].method, HeartbeatMethod::Get);
        assert_eq!(c.alerts.heartbeats[0].timeout, Duration::from_secs(10));
        assert_eq!(c.alerts.heartbeats[1].method, HeartbeatMethod::Post);
        assert_eq!(c.alerts.heartbeats[1].timeout, Duration::from_secs(3));
        for (toml, key, says) in [
            (
                "[[alerts.heartbeat]]\nurl_env = \"https://hc-ping.com/x\"\n",
                "alerts.heartbeat[0].url_env",
                "environment variable",
            ),
            (
                "[[alerts.heartbeat]]\nurl = \"https://hc-ping.com/x\"\n",
                "alerts.heartbeat",
                "url",
            ),
            (
                "[[alerts.heartbeat]]\nurl_env = \"HB\"\ntimeout = \"0s\"\n",
                "alerts.heartbeat[0].timeout",
                "greater than zero",
            ),
            (
                "[[alerts.heartbeat]]\nurl_env = \"HB\"\ntimeout = \"5m\"\n",
                "alerts.heartbeat[0].timeout",
                "at most 1m",
            ),
            (
                "[[alerts.heartbeat]]\nurl_env = \"HB\"\nmethod = \"put\"\n",
                "alerts.heartbeat",
                "put",
            ),
        ] {
            let e = err(&format!("{MINIMAL}\n{toml}"));
            assert!(e.contains(key) && e.contains(says), "{toml}: {e}");
        }
    }

    #[test]
    fn alert_grouping_links_and_alertmanagers_are_checked_naming_the_key() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.alerts.group_by, DEFAULT_GROUP_BY);
        assert_eq!(c.server.public_url, None);
        for (toml, key, says) in [
            ("[alerts]\ngroup_by = []\n", "alerts.group_by", "is empty"),
            (
                "[alerts]\ngroup_by = [\"app\", \"app\"]\n",
                "alerts.group_by",
                "twice",
            ),
            (
                "[alerts]\ngroup_by = [\"region\"]\n",
                "alerts.group_by",
                "region",
            ),
            (
                "[alerts]\nrunbook_url = \"docs/operations.md\"\n",
                "alerts.runbook_url",
                "http(s)",
            ),
            (
                "[[alerts.alertmanager]]\nurl_env = \" \"\n",
                "alerts.alertmanager[0].url_env",
                "environment variable",
            ),
            (
                "[[alerts.alertmanager]]\nurl = \"http://am\"\n",
                "alerts.alertmanager",
                "url",
            ),
            (
                "[[alerts.alertmanager]]\nurl_env = \"AM\"\nlabels = { severity = \"x\" }\n",
                "alerts.alertmanager[0].labels.severity",
                "set by the daemon",
            ),
            (
                "[[alerts.alertmanager]]\nurl_env = \"AM\"\nlabels = { \"team-x\" = \"a\" }\n",
                "alerts.alertmanager[0].labels.team-x",
                "not a label name",
            ),
            (
                "[server]\npublic_url = \"fleet.example.com\"\n",
                "server.public_url",
                "not a URL",
            ),
            (
                "[server]\npublic_url = \"ftp://fleet.example.com/\"\n",
                "server.public_url",
                "http",
            ),
            (
                "[server]\npublic_url = \"https://u:p@fleet.example.com/\"\n",
                "server.public_url",
                "credentials",
            ),
        ] {
            let e = err(&format!("{MINIMAL}\n{toml}"));
            assert!(e.contains(key) && e.contains(says), "{toml}: {e}");
        }
        let c = parse(&format!(
            "{MINIMAL}\n[alerts]\ngroup_by = [\"machine\"]\n[[alerts.alertmanager]]\nurl_env = \"AM\"\nmin_severity = \"high\"\n[server]\npublic_url = \"https://fleet.example.com/x\"\n"
        ))
        .unwrap();
        assert_eq!(c.alerts.group_by, [GroupField::Machine]);
        assert_eq!(c.alerts.alertmanagers[0].url_env, "AM");
        assert_eq!(c.alerts.alertmanagers[0].min_severity, Severity::High);
        let public = c.server.public_url.unwrap();
        assert_eq!(public.status_page(), "https://fleet.example.com/x/");
        assert_eq!(
            public.machine_page("m 1"),
            "https://fleet.example.com/x/machines/m%201"
        );
    }

    #[test]
    fn alert_hold_downs_default_to_sweeps_and_are_ordered() {
        let c = parse(&format!("{MINIMAL}\n[sweep]\ninterval = \"10s\"\n")).unwrap();
        assert_eq!(c.alerts.stale_after, Duration::from_secs(30));
        assert_eq!(c.alerts.resolve_after, Duration::from_secs(30));
        let c = parse(&format!(
            "{MINIMAL}\n[alerts]\nstale_after = \"5m\"\n[sweep]\ninterval = \"10s\"\n"
        ))
        .unwrap();
        assert_eq!(
            c.alerts.resolve_after,
            Duration::from_secs(300),
            "raised to stale_after"
        );
        let e = err(&format!(
            "{MINIMAL}\n[alerts]\nstale_after = \"2m\"\nresolve_after = \"1m\"\n"
        ));
        assert!(e.contains("alerts.resolve_after"), "{e}");
        assert!(e.contains("alerts.stale_after (2m)"), "{e}");
        let e = err(&format!("{MINIMAL}\n[alerts]\nstale_after = \"10s\"\n"));
        assert!(e.contains("alerts.stale_after"), "{e}");
        assert!(e.contains("sweep.interval (30s)"), "{e}");
        let e = err(&format!("{MINIMAL}\n[alerts]\nresolve_after = \"0s\"\n"));
        assert!(e.contains("alerts.resolve_after"), "{e}");
    }

    #[test]
    fn canaries_and_windows_are_checked_and_name_their_key() {
        let ok = parse(&format!(
            "{MINIMAL}\n[pools.canary]\n[pools.main]\nafter = \"canary\"\nsoak = \"30m\"\nafter_ratio = 0.5\nwindows = [{{ allow = \"0 2 * * Mon-Fri\", duration = \"3h\", time_zone = \"Europe/Berlin\" }}]\n"
        ))
        .expect("a valid canary and window");
        let main = &ok.pools[&PoolName::from("main")];
        assert_eq!(main.after, Some(PoolName::from("canary")));
        assert_eq!(main.soak, Duration::from_secs(1800));
        assert_eq!(main.after_ratio, 0.5);
        assert_eq!(main.windows.len(), 1);
        assert_eq!(main.windows[0].kind, WindowKind::Allow);
        assert_eq!(main.windows[0].time_zone, chrono_tz::Europe::Berlin);
        let canary = &ok.pools[&PoolName::from("canary")];
        assert_eq!((canary.after.as_ref(), canary.after_ratio), (None, 1.0));

        for (pools, key, says) in [
            (
                "[pools.main]\nafter = \"nope\"\n",
                "pools.main.after",
                "no [pools.nope] section",
            ),
            (
                "[pools.main]\nafter = \"main\"\n",
                "pools.main.after",
                "cannot wait for itself",
            ),
            (
                "[pools.a]\nafter = \"b\"\n[pools.b]\nafter = \"c\"\n[pools.c]\nafter = \"a\"\n",
                "pools.a.after",
                "cycle: a → b → c → a",
            ),
            (
                "[pools.c]\n[pools.main]\nafter = \"c\"\nafter_ratio = 0.0\n",
                "pools.main.after_ratio",
                "greater than 0",
            ),
            (
                "[pools.c]\n[pools.main]\nafter = \"c\"\nafter_ratio = 1.5\n",
                "pools.main.after_ratio",
                "not a ratio",
            ),
            (
                "[pools.main]\nsoak = \"soon\"\n",
                "pools.main.soak",
                "invalid duration",
            ),
            (
                "[pools.main]\nwindows = [{ allow = \"0 2 * *\", duration = \"1h\" }]\n",
                "pools.main.windows",
                "invalid cron schedule",
            ),
            (
                "[pools.main]\nwindows = [{ allow = \"0 2 * * *\", duration = \"1h\", time_zone = \"Mars/Olympus\" }]\n",
                "pools.main.windows",
                "unknown time zone",
            ),
            (
                "[pools.main]\nwindows = [{ allow = \"0 2 * * *\", deny = \"0 3 * * *\", duration = \"1h\" }]\n",
                "pools.main.windows",
                "exactly one of `allow` or `deny`",
            ),
            (
                "[pools.main]\nwindows = [{ allow = \"0 2 * * *\" }]\n",
                "pools.main.windows",
                "duration",
            ),
        ] {
            let e = err(&format!("{MINIMAL}\n{pools}"));
            assert!(e.contains(key) && e.contains(says), "{pools}: {e}");
        }
    }

    #[test]
    fn ratios_and_counts_are_range_checked() {
        let e = err(&format!("{MINIMAL}\n[alerts]\ncoherence_threshold = 1.5\n"));
        assert!(e.contains("alerts.coherence_threshold"), "{e}");
        let e = err(&format!("{MINIMAL}\n[probe]\nconcurrency = 0\n"));
        assert!(e.contains("probe.concurrency"), "{e}");
        let e = err(&format!("{MINIMAL}\n[sweep]\ninterval = \"0s\"\n"));
        assert!(e.contains("sweep.interval"), "{e}");
        for (key, value) in [
            ("header_read_timeout", "\"0s\""),
            ("request_timeout", "\"0s\""),
            ("admin_auth_window", "\"0s\""),
            ("header_read_timeout", "\"31days\""),
            ("max_connections", "0"),
            ("max_connections", "65537"),
            ("max_body_bytes", "0"),
            ("max_body_bytes", "1048577"),
            ("admin_auth_failures", "0"),
        ] {
            let e = err(&format!("{MINIMAL}\n[server]\n{key} = {value}\n"));
            assert!(e.contains(&format!("server.{key}")), "{key} = {value}: {e}");
        }
        let ok = parse(&format!(
            "{MINIMAL}\n[server]\nheader_read_timeout = \"1s\"\nmax_connections = 65536\nmax_body_bytes = 1048576\nadmin_auth_failures = 1\n"
        ))
        .unwrap();
        assert_eq!(ok.server.max_connections.get(), 65536);
    }

    #[test]
    fn syntax_errors_carry_a_line() {
        let e = err("[overlay\nrepo = 1\n");
        assert!(e.contains("test.toml:1"), "{e}");
    }

    /// Which pool a machine without a section follows is the policy's
    /// (`decide::policy`); here, each section as parsed.
    #[test]
    fn pool_sections_keep_the_safe_defaults_for_what_they_leave_out() {
        let c = parse(&format!(
            "{MINIMAL}\n[pools.default]\nmax_concurrent_rotations = 3\nactions = {{ high = \"restart\" }}\n[pools.dispatch]\nactions = {{ low = \"observe\" }}\n"
        ))
        .unwrap();
        let pool = |name: &str| &c.pools[&PoolName::from(name)];
        assert_eq!(pool("default").max_concurrent_rotations.get(), 3);
        assert_eq!(pool("default").actions.high, PolicyAction::Restart);
        assert_eq!(pool("dispatch").max_concurrent_rotations.get(), 1);
        assert_eq!(pool("dispatch").actions.low, PolicyAction::Observe);
        // Levels not written in a pool keep the safe defaults.
        assert_eq!(pool("dispatch").actions.critical, PolicyAction::Manual);
    }
}

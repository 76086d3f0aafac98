//! The webhook notifier: alert state (dedupe, repeat, resolve), delivery to
//! sinks, and the state file that carries both across restarts.
//!
//! What a sink is told about are *incidents*: the planner's per-machine
//! drift and approval alerts grouped by `alerts.group_by` (`group`), each
//! with its links (`links`); every other alert is an incident of its own.
//! Webhooks get the per-sink state machine below, keyed by the incident's
//! key (a change of its machines is an *update*); Alertmanagers get every
//! firing incident each `update` (`alertmanager`); heartbeats get a ping
//! for each successful sweep (`swept`, `heartbeat`).
//!
//! Every sink is a `sink::Sink` (what it takes from a change, its next
//! request, what it does with the answer), one file each: the webhooks
//! (`webhook`), `alertmanager` and `heartbeat`; one delivery path
//! (`Shared::deliver`) drives them all, with the same retry pause,
//! shutdown flush and state-file writes, and a new sink is its file plus
//! its arm in `Notifier::with_kinds`. Owns what the sinks share: the
//! incidents each change offers them, the delivery facts the loop reads
//! each turn (`decide::alerts::DeliveryState`: which webhooks fail, since
//! when, why; `alert_sink_failing` is decided from them there), the HTTP
//! client, the delivery loop and the state file (what each webhook was
//! told, its queue and dead letters are `webhook`'s). What differs between webhook
//! formats (its id, the secret it needs, which action events it sends, its
//! body) is a `sink::SinkKind`, one file each (`json`, `slack`,
//! `pagerduty`); a new format is its file plus an arm in `kinds::kind`.
//! Each delivery event is counted where it happens
//! ([`DeliveryCounter`]). Which alerts hold is decided before it is
//! called (`decide::alerts`), and what of them this replica may say now by
//! `decide::voice` (hold-down, freshness), whose verdict it applies to
//! every sink alike; it must never judge an alert itself, and decides only
//! what each sink is told of them. The sweep hands it the *full* set of
//! conditions that hold now (`update`, level-triggered, never blocking); a
//! background task (`run`) delivers and writes the state file. It must never
//! block or fail a sweep, never follow a redirect, never send to a plain
//! `http://` URL that is not loopback (an Alertmanager, whose posts carry no
//! credential, may also be on Fly's private `*.internal` network), and
//! never write a webhook or Alertmanager URL, routing
//! key, HMAC secret or response body into a log line, an error, a payload or
//! the state file. It never reads the environment (secrets arrive as
//! `SinkSecrets`, see `sink_secrets_from_env`) and never reads the wall clock
//! for alert decisions (`now` is an argument; the clock only stamps delivery
//! attempts, signatures and dead letters).
//!
//! # Per-sink state machine (keyed by `Alert::dedup_key`)
//!
//! | condition at `update` | notification |
//! | --- | --- |
//! | key new to the sink, severity ≥ `min_severity` | trigger |
//! | key new, severity below `min_severity` | nothing (not tracked; a later escalation is a new trigger) |
//! | key known, severity rose | trigger again at the new severity (escalation) |
//! | key known, unchanged, `repeat_interval` since the last notification | one repeat (skipped while an earlier one for the key is still queued) |
//! | key known, its machines changed (not while one of its notifications is queued) | one update (a trigger, `update: true`) |
//! | key known to the sink, absent now | resolve, at once |
//!
//! Before the sinks see them, the incidents pass two rules that keep
//! replicas speaking with one voice (`decide::voice`): a drift or approval incident
//! that emptied stays in them, unchanged, until it has been empty for
//! `alerts.resolve_after` (the hold-down; so "absent now" above means
//! "empty that long"), and an incident drawn from a view of its app older
//! than `alerts.stale_after` (`Seen`, passed to `update_seen`) is *frozen*:
//! no trigger, update, repeat or resolve, to any sink (`sweep_failing`,
//! `app_unlistable`, `tip_stale` and `alert_sink_failing` are never frozen);
//! so is one gone whose data, when last drawn, is now that old. Both rules
//! are applied once per update, for every sink alike (`AlertChange::frozen`
//! and `until`); a sink applies their verdict and never judges staleness.
//!
//! A severity that falls is remembered silently; repeats are sent only while
//! the severity is ≥ `min_severity`. `ActionEvent`s go once to json and slack
//! sinks; a pagerduty sink (its `SinkKind::on_event`) gets only `action_failed` (as a trigger keyed by
//! app, machine and target commit), resolved by a later `action_succeeded` of
//! the same rotation — never `action_started` or successes as pages.
//!
//! # Delivery
//!
//! One FIFO queue per sink, delivered in order: a resolve never overtakes its
//! trigger. A failed attempt (connection error, timeout, 3xx, 5xx, 408, 429)
//! pauses that sink for `retry_interval` and retries the same notification.
//! A full queue refuses new alert transitions without recording them, so the
//! next sweep (level-triggered) offers them again; one-shot events are the
//! only thing an overflow can lose, and it says so in one ERROR line per
//! overflow episode.
//!
//! # Dead letters
//!
//! A permanent refusal (any other 4xx: 404 and 410 for a webhook that is
//! gone, 401/403 for bad credentials, 400/413/422 for a body it rejects), or
//! `dead_letter_after` failed attempts in a row, sets the notification aside
//! as a *dead letter* and marks the sink *failing*. A failing sink gives each
//! notification one attempt and dead-letters it if that fails, so nothing
//! sits at the head of its queue; the other sinks are never held up (each has
//! its own queue and loop) and receive one `alert_sink_failing` alert naming
//! the failing sinks. The first delivery that succeeds ends the episode: the
//! alert resolves, dead-lettered triggers of alerts still firing are sent
//! again at the next sweep, and dead-lettered resolves of alerts that are no
//! longer firing are queued again.
//!
//! # Restarts
//!
//! With a state file (`NotifierOptions::state_file`), `run` writes the state
//! after changes (at most every `save_interval`) and when it ends; the next
//! notifier reads it: what each sink was told, its queue, its dead letters.
//! Alerts that still fire are therefore not paged again, undelivered
//! notifications are delivered, and alerts that cleared while the daemon
//! was down are resolved by the first `update`. `update` stays
//! level-triggered: whoever calls it must pass the alerts that hold, also
//! right after a restart when the planner's clocks start over;
//! `restored_alerts` says what held before (see `decide::alerts::AlertMemory`).

mod alertmanager;
mod counter;
mod format;
mod heartbeat;
mod json;
mod kinds;
mod links;
mod pagerduty;
mod sink;
mod slack;
mod store;
mod webhook;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::clock::SharedClock;
use crate::config::{AlertsConfig, GroupField, PublicUrl, WebhookConfig};
use crate::decide::incidents::{self as group, Grouped};
use crate::decide::voice::Voice;
use crate::events::{ActionEvent, DedupKey, EventKind};
use crate::model::{AppName, CommitId, MachineId, Severity};
use alertmanager::AmSink;
use heartbeat::Heartbeat;
use links::Links;
use sink::{AlertChange, Attempt, Change, Driven, OnEvent, Sink, SinkKind, Then};
use store::{DeadLetter, Failing, SavedSink, SavedTracked, StateFile, Store};

pub use crate::decide::alerts::Seen;
use crate::decide::alerts::{Alert, DeliveryState, FailingSink};
pub use crate::decide::incidents::{DETAIL_MACHINES, SUMMARY_MACHINES};
pub use alertmanager::{ALERTMANAGER_PATH, AlertmanagerStats};
pub use counter::{DeliveryCounter, DeliveryEvent, DeliveryResult, PingResult};
pub use heartbeat::heartbeat_urls_from_env;
pub use json::{JSON_SCHEMA_VERSION, SIGNATURE_HEADER, SIGNATURE_MAX_AGE, TIMESTAMP_HEADER, sign};
pub use kinds::format_name;
pub use links::{MACHINE_URL, RUNBOOK_URL, SEVERITY_RULE, STATUS_URL, TIP, runbook_anchor};
pub use pagerduty::{
    PAGERDUTY_DEDUP_KEY_MAX, PAGERDUTY_SUMMARY_MAX, pagerduty_dedup_key, pagerduty_severity,
};
pub use store::{STATE_KIND, STATE_VERSION};
use webhook::{Webhook, restore_sinks};

pub use crate::decide::alerts::SINK_FAILING_SEVERITY;

/// Dead letters kept per sink (the oldest are dropped beyond this; all are counted).
pub const DEAD_LETTERS_KEPT: usize = 1000;

/// The secrets of one webhook, resolved from the environment at the edge.
/// Each is a `SecretString`: redacted in `Debug`, zeroed on drop, exposed
/// only where a delivery sends it.
#[derive(Clone, Debug, Default)]
pub struct SinkSecrets {
    /// The webhook URL (a secret: Slack and many receivers authenticate by it).
    pub url: SecretString,
    /// PagerDuty Events v2 routing key (pagerduty only).
    pub routing_key: Option<SecretString>,
    /// Key of the `X-Fleet-Signature` HMAC (json only).
    pub hmac_secret: Option<SecretString>,
}

/// Why the notifier could not be set up. Names environment variables and
/// webhook positions, never their values.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error("alerts.webhooks[{index}]: environment variable {var} ({what}) is not set or empty")]
    MissingEnv {
        index: usize,
        var: String,
        what: &'static str,
    },
    #[error("{got} sets of webhook secrets for {expected} configured webhooks")]
    SecretsMismatch { expected: usize, got: usize },
    #[error("alerts.webhooks[{index}]: {what} missing for format {format}")]
    MissingSecret {
        index: usize,
        format: &'static str,
        what: &'static str,
    },
    #[error("alerts.webhooks[{index}]: the URL in {url_env} {problem}")]
    InvalidUrl {
        index: usize,
        url_env: String,
        problem: &'static str,
    },
    #[error("cannot build the webhook HTTP client: {0}")]
    Client(String),
    #[error(
        "alerts.alertmanager[{index}]: environment variable {var} (Alertmanager URL) is not set or empty"
    )]
    AlertmanagerMissingEnv { index: usize, var: String },
    #[error("alerts.alertmanager[{index}]: the URL in {url_env} {problem}")]
    AlertmanagerInvalidUrl {
        index: usize,
        url_env: String,
        problem: &'static str,
    },
    #[error("{got} Alertmanager URLs for {expected} configured [[alerts.alertmanager]]")]
    AlertmanagerMismatch { expected: usize, got: usize },
    #[error(
        "alerts.heartbeat[{index}]: environment variable {var} (heartbeat ping URL) is not set or empty"
    )]
    HeartbeatMissingEnv { index: usize, var: String },
    #[error("alerts.heartbeat[{index}]: the URL in {url_env} {problem}")]
    HeartbeatInvalidUrl {
        index: usize,
        url_env: String,
        problem: &'static str,
    },
}

/// Which [`NotifyError`] this is, without its data; its snake-case name is
/// the bounded label. A webhook's and an Alertmanager's same problem share
/// one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum NotifyErrorKind {
    MissingEnv,
    SecretsMismatch,
    MissingSecret,
    InvalidUrl,
    Client,
}

impl NotifyError {
    pub fn error_kind(&self) -> NotifyErrorKind {
        match self {
            NotifyError::MissingEnv { .. }
            | NotifyError::AlertmanagerMissingEnv { .. }
            | NotifyError::HeartbeatMissingEnv { .. } => NotifyErrorKind::MissingEnv,
            NotifyError::SecretsMismatch { .. } | NotifyError::AlertmanagerMismatch { .. } => {
                NotifyErrorKind::SecretsMismatch
            }
            NotifyError::MissingSecret { .. } => NotifyErrorKind::MissingSecret,
            NotifyError::InvalidUrl { .. }
            | NotifyError::AlertmanagerInvalidUrl { .. }
            | NotifyError::HeartbeatInvalidUrl { .. } => NotifyErrorKind::InvalidUrl,
            NotifyError::Client(_) => NotifyErrorKind::Client,
        }
    }

    /// A bounded label for metrics: the kind's snake-case name.
    pub fn kind(&self) -> &'static str {
        self.error_kind().into()
    }
}

/// Reads each webhook's `url_env`, `routing_key_env` and `secret_env` through
/// `lookup` (e.g. `|k| std::env::var(k).ok()`), in the order of
/// `config.webhooks`. An unset or empty variable is an error naming it.
pub fn sink_secrets_from_env(
    config: &AlertsConfig,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Vec<SinkSecrets>, NotifyError> {
    let read = |index: usize, var: &str, what: &'static str| {
        crate::config::env_secret(&lookup, var).ok_or_else(|| NotifyError::MissingEnv {
            index,
            var: var.to_owned(),
            what,
        })
    };
    config
        .webhooks
        .iter()
        .enumerate()
        .map(|(index, hook)| {
            Ok(SinkSecrets {
                url: read(index, &hook.url_env, "webhook URL")?,
                routing_key: hook
                    .routing_key_env
                    .as_deref()
                    .map(|var| read(index, var, "PagerDuty routing key"))
                    .transpose()?,
                hmac_secret: hook
                    .secret_env
                    .as_deref()
                    .map(|var| read(index, var, "HMAC secret"))
                    .transpose()?,
            })
        })
        .collect()
}

/// Reads each `[[alerts.alertmanager]]`'s `url_env` through `lookup`, in
/// order. An unset or empty variable is an error naming it.
pub fn alertmanager_urls_from_env(
    config: &AlertsConfig,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Vec<SecretString>, NotifyError> {
    config
        .alertmanagers
        .iter()
        .enumerate()
        .map(|(index, am)| {
            crate::config::env_secret(&lookup, &am.url_env).ok_or_else(|| {
                NotifyError::AlertmanagerMissingEnv {
                    index,
                    var: am.url_env.clone(),
                }
            })
        })
        .collect()
}

/// Delivery tuning; the defaults are the production values.
#[derive(Clone, Debug)]
pub struct NotifierOptions {
    /// Pause of a sink after a failed attempt (docs/design.md §7: retried a minute later).
    pub retry_interval: Duration,
    /// Whole-request deadline of one delivery attempt.
    pub request_timeout: Duration,
    /// Notifications a sink may hold undelivered.
    pub queue_capacity: usize,
    /// How long `run` keeps delivering after shutdown is requested.
    pub flush_deadline: Duration,
    /// Where the state persists across restarts; `None` keeps it in memory
    /// (`run` uses `Config::alert_state_file`).
    pub state_file: Option<PathBuf>,
    /// Failed attempts in a row (of one sink, whatever the notification)
    /// after which a sink that keeps failing transiently (5xx, timeouts,
    /// redirects, connection errors) is declared failing and its notification
    /// dead-lettered; 0: only permanent refusals dead-letter. The default, 60,
    /// is about an hour of retries a minute apart.
    pub dead_letter_after: u32,
    /// The state file is written at most this often (and when `run` ends).
    pub save_interval: Duration,
    /// What stamps dead letters, the state file and signatures (the
    /// system's clock; the alerts' own times come with each `update`).
    pub clock: SharedClock,
    /// `server.public_url`: payloads link the status and machine pages under it.
    pub public_url: Option<PublicUrl>,
    /// Counts each delivery event where it happens (the metrics' hook).
    pub counter: DeliveryCounter,
}

impl Default for NotifierOptions {
    fn default() -> Self {
        NotifierOptions {
            retry_interval: Duration::from_secs(60),
            request_timeout: Duration::from_secs(10),
            queue_capacity: 10_000,
            // Inside the service's shutdown budget (Fly kills 5 s after
            // SIGTERM); what is not flushed stays in the state file.
            flush_deadline: Duration::from_millis(800),
            state_file: None,
            dead_letter_after: 60,
            save_interval: Duration::from_secs(1),
            clock: crate::clock::system(),
            public_url: None,
            counter: DeliveryCounter::default(),
        }
    }
}

/// What a notification says about its condition.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub(crate) enum Status {
    Firing,
    Resolved,
    Event,
}

impl Status {
    pub(crate) fn as_str(self) -> &'static str {
        self.into()
    }
}

/// One message for one sink, format-independent.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Notification {
    pub(crate) status: Status,
    pub(crate) event: String,
    pub(crate) repeat: bool,
    /// A firing group whose machines changed (joined or converged).
    #[serde(default)]
    pub(crate) update: bool,
    pub(crate) dedup_key: DedupKey,
    pub(crate) app: Option<AppName>,
    pub(crate) machine_id: Option<MachineId>,
    /// Read back from the state file, the `""` that older versions wrote for
    /// an event of no rotation is no commit.
    #[serde(default, deserialize_with = "empty_as_no_commit")]
    pub(crate) commit: Option<CommitId>,
    pub(crate) severity: Severity,
    pub(crate) summary: String,
    pub(crate) details: BTreeMap<String, String>,
    pub(crate) at: DateTime<Utc>,
}

impl Notification {
    fn trigger(alert: &Alert, key: &DedupKey, repeat: bool, now: DateTime<Utc>) -> Notification {
        Notification {
            status: Status::Firing,
            event: alert.kind.trigger_name().to_owned(),
            repeat,
            update: false,
            dedup_key: key.clone(),
            app: alert.app.clone(),
            machine_id: alert.machine_id.clone(),
            commit: alert.commit.clone(),
            severity: alert.severity,
            summary: alert.summary.clone(),
            details: alert.details.clone(),
            at: now,
        }
    }

    fn resolve(last: &Alert, key: &DedupKey, now: DateTime<Utc>) -> Notification {
        Notification {
            status: Status::Resolved,
            event: last.kind.resolve_name().to_owned(),
            repeat: false,
            summary: format!("Resolved: {}", last.summary),
            ..Notification::trigger(last, key, false, now)
        }
    }

    fn event(e: &ActionEvent, links: &Links) -> Notification {
        let mut details = BTreeMap::new();
        if let Some(r) = &e.rotation {
            details.insert("action".to_owned(), r.action.as_str().to_owned());
        }
        links.annotate(
            &mut details,
            links::ACTION_ANCHOR,
            Some(&e.machine_id),
            e.commit(),
        );
        Notification {
            status: Status::Event,
            event: e.kind.name().to_owned(),
            repeat: false,
            update: false,
            dedup_key: event_key(e.kind, e),
            app: Some(e.app.clone()),
            machine_id: Some(e.machine_id.clone()),
            commit: e.commit().cloned(),
            severity: e.severity,
            summary: e.summary.clone(),
            details,
            at: e.at,
        }
    }

    fn field(v: Option<&str>) -> &str {
        v.unwrap_or("*")
    }
}

fn log_alert(alert: &Alert, event: &str, message: &str) {
    tracing::info!(
        event,
        app = Notification::field(alert.app.as_ref().map(AppName::as_str)),
        machine_id = Notification::field(alert.machine_id.as_ref().map(MachineId::as_str)),
        commit = Notification::field(alert.commit.as_ref().map(CommitId::as_str)),
        severity = %alert.severity,
        summary = %alert.summary,
        "{message}"
    );
}

/// Identity of a one-shot event: its kind and the rotation (app, machine, target).
fn event_key(kind: EventKind, e: &ActionEvent) -> DedupKey {
    DedupKey::new(format!(
        "fleet-reconciler/{}/{}/{}/{}",
        kind.name(),
        e.app,
        e.machine_id,
        e.commit().map_or("*", CommitId::as_str)
    ))
}

/// `commit` of a stored notification: a commit id, `null`, or the `""` an
/// event of no rotation was stored with before it had none.
fn empty_as_no_commit<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<CommitId>, D::Error> {
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(text) if text.is_empty() => Ok(None),
        Some(text) => {
            CommitId::deserialize(serde::de::value::StringDeserializer::<D::Error>::new(text))
                .map(Some)
        }
    }
}

/// Counters and queue depth of one sink, for metrics and readiness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SinkStats {
    pub index: usize,
    pub format: &'static str,
    /// Notifications waiting (including one in flight).
    pub queued: usize,
    pub delivered: u64,
    pub failed_attempts: u64,
    /// Notifications refused because the queue was full.
    pub dropped: u64,
    /// Alert keys this sink has been sent a trigger for and not yet a resolve.
    pub firing: usize,
    /// Notifications dead-lettered by this process.
    pub dead_lettered: u64,
    /// Dead letters kept (in the state file; at most `DEAD_LETTERS_KEPT`).
    pub dead_letters: usize,
    /// The sink is dead-lettering what it is sent.
    pub failing: bool,
}

/// Sends alerts and action events to the configured webhooks. Cheap to clone
/// (shared state); `update` from the sweep, `run` in a background task.
#[derive(Clone)]
pub struct Notifier {
    shared: Arc<Shared>,
}

struct Shared {
    sinks: Vec<Arc<Webhook>>,
    alertmanagers: Vec<Arc<AmSink>>,
    /// Every sink (webhooks, Alertmanagers, heartbeats), as the one
    /// delivery path drives them.
    driven: Vec<Arc<dyn Driven>>,
    http: reqwest::Client,
    options: NotifierOptions,
    /// Every alert firing at the last `update`, for one log line per transition.
    fired: Mutex<BTreeMap<DedupKey, Alert>>,
    /// The alerts the state file said were firing, as read.
    restored: Vec<Alert>,
    /// `alerts.group_by`.
    group_by: Vec<GroupField>,
    links: Links,
    store: Option<Store>,
    running: AtomicBool,
    /// One voice across replicas: the hold-down (`alerts.resolve_after`)
    /// and no word from a view older than `alerts.stale_after`, applied
    /// once for every sink.
    voice: Mutex<Voice<Grouped>>,
}

impl fmt::Debug for Notifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sinks: Vec<&str> = self.shared.driven.iter().map(|s| s.id()).collect();
        f.debug_struct("Notifier")
            .field("sinks", &sinks)
            .field("options", &self.shared.options)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not silence on-call: the state stays usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// The key of `alert_sink_failing` (one alert for all failing sinks).
fn sink_failing_key() -> DedupKey {
    crate::decide::alerts::sink_failing_key()
}

/// The notifier's delivery facts, read by the loop each turn: which
/// webhooks are failing, since when, why, and what they set aside.
impl DeliveryState for Notifier {
    fn failing_sinks(&self) -> Vec<FailingSink> {
        self.shared
            .sinks
            .iter()
            .filter_map(|sink| {
                let st = lock(&sink.state);
                let f = st.failing.as_ref()?;
                Some(FailingSink {
                    index: sink.index,
                    format: sink.kind.id(),
                    url_env: sink.url_env.clone(),
                    since: f.since,
                    reason: f.reason.clone(),
                    dead_letters: st.dead_letters.len(),
                })
            })
            .collect()
    }
}

impl Notifier {
    /// A notifier for `config.webhooks`, with `sinks[i]` the secrets of webhook `i`.
    pub fn new(config: &AlertsConfig, sinks: Vec<SinkSecrets>) -> Result<Notifier, NotifyError> {
        Notifier::with_options(config, sinks, NotifierOptions::default())
    }

    /// As `new`; with `options.state_file` set, reads the state a previous
    /// notifier left there (a missing file is a first start; an unusable one
    /// is moved aside with a WARN and the notifier starts empty).
    pub fn with_options(
        config: &AlertsConfig,
        sinks: Vec<SinkSecrets>,
        options: NotifierOptions,
    ) -> Result<Notifier, NotifyError> {
        Notifier::with_sinks(config, sinks, Vec::new(), options)
    }

    /// As `with_options`, with `alertmanagers[i]` the URL of
    /// `[[alerts.alertmanager]]` `i` (see `alertmanager_urls_from_env`).
    pub fn with_sinks(
        config: &AlertsConfig,
        sinks: Vec<SinkSecrets>,
        alertmanagers: Vec<SecretString>,
        options: NotifierOptions,
    ) -> Result<Notifier, NotifyError> {
        Notifier::with_kinds(config, sinks, alertmanagers, None, options, kinds::kind)
    }

    /// As `with_sinks`, and with `heartbeats[i]` the ping URL of
    /// `[[alerts.heartbeat]]` `i` (see `heartbeat_urls_from_env`), pinged
    /// at each [`Notifier::swept`]. `with_sinks` builds no heartbeats.
    pub fn with_heartbeats(
        config: &AlertsConfig,
        sinks: Vec<SinkSecrets>,
        alertmanagers: Vec<SecretString>,
        heartbeats: Vec<SecretString>,
        options: NotifierOptions,
    ) -> Result<Notifier, NotifyError> {
        Notifier::with_kinds(
            config,
            sinks,
            alertmanagers,
            Some(heartbeats),
            options,
            kinds::kind,
        )
    }

    /// As `with_heartbeats`, with `kind_of` saying which kind of sink each
    /// webhook's format is (a test adds its own kind this way). Each
    /// configured sink is built here, one arm per config table.
    fn with_kinds(
        config: &AlertsConfig,
        sinks: Vec<SinkSecrets>,
        alertmanagers: Vec<SecretString>,
        heartbeats: Option<Vec<SecretString>>,
        options: NotifierOptions,
        kind_of: fn(crate::config::WebhookFormat) -> &'static dyn SinkKind,
    ) -> Result<Notifier, NotifyError> {
        let (expected, got) = (config.alertmanagers.len(), alertmanagers.len());
        if got != expected {
            return Err(NotifyError::AlertmanagerMismatch { expected, got });
        }
        let (expected, got) = (config.webhooks.len(), sinks.len());
        if got != expected {
            return Err(NotifyError::SecretsMismatch { expected, got });
        }
        let alertmanagers = config
            .alertmanagers
            .iter()
            .zip(alertmanagers)
            .enumerate()
            .map(|(index, (am, url))| {
                AmSink::new(index, am, url.expose_secret(), options.counter.clone())
                    .map(Arc::new)
                    .map_err(|problem| NotifyError::AlertmanagerInvalidUrl {
                        index,
                        url_env: am.url_env.clone(),
                        problem,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let heartbeats = match heartbeats {
            None => Vec::new(),
            Some(urls) if urls.len() != config.heartbeats.len() => {
                return Err(NotifyError::SecretsMismatch {
                    expected: config.heartbeats.len(),
                    got: urls.len(),
                });
            }
            Some(urls) => config
                .heartbeats
                .iter()
                .zip(urls)
                .enumerate()
                .map(|(index, (hb, url))| {
                    Heartbeat::new(index, hb, url, options.counter.clone()).map(Arc::new)
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        let sinks = config
            .webhooks
            .iter()
            .zip(sinks)
            .enumerate()
            .map(|(index, (hook, secrets))| {
                let kind = kind_of(hook.format);
                Webhook::new(index, hook, kind, secrets, &options).map(Arc::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let http = crate::http::client_builder()
            // A redirect could carry a signed body or routing key elsewhere,
            // and a receiver that moved should be reconfigured, not followed.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(options.request_timeout)
            .connect_timeout(options.request_timeout.min(Duration::from_secs(5)))
            .build()
            .map_err(|e| NotifyError::Client(crate::http::describe(&e)))?;
        // Without sinks there is nothing to deliver or resolve: no file.
        let store = options
            .state_file
            .clone()
            .filter(|_| !sinks.is_empty() || !alertmanagers.is_empty())
            .map(Store::new);
        let saved = store.as_ref().and_then(Store::load);
        let mut restored = Vec::new();
        if let Some(saved) = saved {
            restored = saved.alerts;
            restore_sinks(&sinks, saved.sinks);
            restore_alertmanagers(&alertmanagers, saved.alertmanagers);
        }
        let fired: BTreeMap<DedupKey, Alert> = restored
            .iter()
            .map(|a| (a.dedup_key(), a.clone()))
            .collect();
        let links = Links::new(config, options.public_url.clone());
        let mut driven: Vec<Arc<dyn Driven>> = Vec::new();
        driven.extend(sinks.iter().map(|s| s.clone() as Arc<dyn Driven>));
        driven.extend(alertmanagers.iter().map(|s| s.clone() as Arc<dyn Driven>));
        driven.extend(heartbeats.into_iter().map(|s| s as Arc<dyn Driven>));
        Ok(Notifier {
            shared: Arc::new(Shared {
                sinks,
                alertmanagers,
                driven,
                http,
                options,
                fired: Mutex::new(fired),
                restored,
                group_by: config.group_by.clone(),
                links,
                store,
                running: AtomicBool::new(false),
                voice: Mutex::new(Voice::new(config.resolve_after, config.stale_after)),
            }),
        })
    }

    /// This notifier with `sink` driven too: what a config arm in
    /// `with_kinds` does for a sink it builds (a test adds its own this way).
    #[cfg(test)]
    fn adding(mut self, sink: Arc<dyn Driven>) -> Notifier {
        let shared = Arc::get_mut(&mut self.shared).expect("a notifier not yet shared");
        shared.driven.push(sink);
        self
    }

    /// The alerts that were firing when the state file was written (empty
    /// without one). `run` seeds the fleet-alert clocks with them and carries
    /// the machine alerts until the planner has caught up.
    pub fn restored_alerts(&self) -> &[Alert] {
        &self.shared.restored
    }

    /// Takes the full set of conditions that hold at `now` and the events of
    /// this sweep, and queues what each sink must be told. Never waits on the
    /// network or the disk: it only takes short, uncontended locks and wakes `run`.
    ///
    /// For a caller without the loop (whose `decide::alerts::evaluate`
    /// reads this notifier's [`DeliveryState`]): `firing` is taken with
    /// `alert_sink_failing` as [`crate::decide::alerts::sink_failing`]
    /// judges the sinks' delivery state now.
    pub fn update(&self, firing: &[Alert], events: &[ActionEvent], now: DateTime<Utc>) {
        let own = crate::decide::alerts::sink_failing(&self.failing_sinks());
        let firing: Vec<Alert> = firing.iter().cloned().chain(own).collect();
        self.update_seen(&firing, events, now, &Seen::fresh(now));
    }

    /// As `update`, with `seen` saying how old this replica's view of each
    /// app is: incidents of an app seen longer than `alerts.stale_after`
    /// ago are neither triggered, updated, repeated nor resolved (its own
    /// `sweep_failing`, `app_unlistable` and `tip_stale` always speak); and
    /// a drift or approval incident resolves only once it has been empty for
    /// `alerts.resolve_after` (sooner when the release tip moved on).
    pub fn update_seen(
        &self,
        firing: &[Alert],
        events: &[ActionEvent],
        now: DateTime<Utc>,
        seen: &Seen,
    ) {
        // One alert per key; if the planner sent a key twice, the more severe wins.
        let mut raw: BTreeMap<DedupKey, &Alert> = BTreeMap::new();
        for alert in firing {
            raw.entry(alert.dedup_key())
                .and_modify(|a| {
                    if alert.severity > a.severity {
                        *a = alert;
                    }
                })
                .or_insert(alert);
        }
        // Logs (and the state file's `alerts`) stay per machine: a restart
        // carries machine alerts, which group again into the same incidents.
        self.log_transitions(&raw);
        let mut current = self.incidents(raw.values().copied());
        let spoken = {
            let mut voice = lock(&self.shared.voice);
            let told = if voice.wants_told() {
                self.told()
            } else {
                Vec::new()
            };
            voice.apply(&mut current, told, seen, now)
        };
        let change = AlertChange {
            current: &current,
            frozen: &spoken.frozen,
            until: &spoken.until,
            events,
            links: &self.shared.links,
            now,
            capacity: self.shared.options.queue_capacity,
        };
        self.shared.offer(&Change::Alerts(&change));
        self.shared.touch();
    }

    /// Says a sweep succeeded (listed machines): each heartbeat pings. Call
    /// it after such a sweep only; never waits on the network.
    pub fn swept(&self) {
        self.shared.offer(&Change::Swept);
    }

    /// The incidents `alerts` make: grouped by `alerts.group_by`, each
    /// alert with its links.
    fn incidents<'a>(
        &self,
        alerts: impl Iterator<Item = &'a Alert>,
    ) -> BTreeMap<DedupKey, Grouped> {
        let alerts: Vec<Alert> = alerts.cloned().collect();
        let mut groups = group::group(&alerts, &self.shared.group_by);
        for g in groups.values_mut() {
            let a = &mut g.alert;
            let machine = a.machine_id.clone();
            let commit = a.commit.clone();
            self.shared.links.annotate_alert(
                &mut a.details,
                a.kind,
                a.severity,
                machine.as_ref(),
                commit.as_ref(),
            );
        }
        groups
    }

    /// The incidents some sink was told of and has not been told are over
    /// (the hold-down starts their clock at the first update that lacks them).
    fn told(&self) -> Vec<Grouped> {
        let mut told = Vec::new();
        for sink in &self.shared.sinks {
            let st = lock(&sink.state);
            told.extend(st.firing.iter().map(|(key, t)| Grouped {
                key: key.clone(),
                alert: t.alert.clone(),
                members: t.members.clone(),
            }));
        }
        // An Alertmanager's are the same incidents; what it alone was told
        // comes back through the restored alerts.
        told.extend(self.incidents(self.shared.restored.iter()).into_values());
        told
    }

    /// One line per alert that started, changed severity or cleared.
    fn log_transitions(&self, current: &BTreeMap<DedupKey, &Alert>) {
        let mut fired = lock(&self.shared.fired);
        for (key, alert) in current {
            let previous = fired.get(key).map(|a| a.severity);
            if previous == Some(alert.severity) {
                fired.insert(key.clone(), (*alert).clone());
                continue;
            }
            let message = match previous {
                None => "alert firing",
                Some(_) => "alert severity changed",
            };
            log_alert(alert, alert.kind.trigger_name(), message);
            fired.insert(key.clone(), (*alert).clone());
        }
        fired.retain(|key, alert| {
            let holds = current.contains_key(key);
            if !holds {
                log_alert(alert, alert.kind.resolve_name(), "alert resolved");
            }
            holds
        });
    }

    /// Delivers queued notifications until `shutdown`, then tries to flush
    /// what is left within `flush_deadline`; with a state file, writes the
    /// state after changes and once more at the end (what could not be
    /// flushed is delivered by the next notifier). Run exactly one per
    /// notifier (a second concurrent call returns at once), usually spawned:
    /// `tokio::spawn({ let n = notifier.clone(); async move { n.run(token).await } })`.
    /// Webhooks are delivered concurrently, each in its own order.
    pub async fn run(&self, shutdown: CancellationToken) {
        if self.shared.running.swap(true, Ordering::SeqCst) {
            tracing::error!("webhook delivery is already running for this notifier");
            return;
        }
        let shared = &self.shared;
        let saver_stop = CancellationToken::new();
        let deliveries = async {
            futures::future::join_all(
                shared
                    .driven
                    .iter()
                    .map(|sink| sink.deliver(shared, shutdown.clone())),
            )
            .await;
            saver_stop.cancel();
        };
        tokio::join!(deliveries, shared.save_loop(saver_stop.clone()));
        shared.save_in_background().await;
        self.shared.running.store(false, Ordering::SeqCst);
    }

    /// Writes the state file now (if there is one and anything changed).
    pub fn save(&self) -> std::io::Result<()> {
        self.shared.save()
    }

    /// Per-sink counters and queue depth.
    pub fn stats(&self) -> Vec<SinkStats> {
        self.shared
            .sinks
            .iter()
            .map(|sink| {
                let state = lock(&sink.state);
                SinkStats {
                    index: sink.index,
                    format: sink.kind.id(),
                    queued: state.queue.len(),
                    delivered: state.delivered,
                    failed_attempts: state.failed_attempts,
                    dropped: state.dropped,
                    firing: state.firing.len(),
                    dead_lettered: state.dead_lettered,
                    dead_letters: state.dead_letters.len(),
                    failing: state.failing.is_some(),
                }
            })
            .collect()
    }

    /// Per `[[alerts.alertmanager]]`: what it was told and the posts made.
    pub fn alertmanager_stats(&self) -> Vec<AlertmanagerStats> {
        self.shared
            .alertmanagers
            .iter()
            .map(|am| am.stats())
            .collect()
    }

    /// Writes of the state file that failed since start.
    pub fn state_write_failures(&self) -> u64 {
        self.shared
            .store
            .as_ref()
            .map_or(0, |s| s.write_failures.load(Ordering::Relaxed))
    }

    /// Notifications not yet delivered, over all sinks.
    pub fn queued(&self) -> usize {
        self.shared
            .sinks
            .iter()
            .map(|s| lock(&s.state).queue.len())
            .sum()
    }
}

/// Gives each configured Alertmanager the saved state of the same `url_env`.
fn restore_alertmanagers(ams: &[Arc<AmSink>], saved: Vec<alertmanager::SavedAm>) {
    let mut saved: Vec<Option<alertmanager::SavedAm>> = saved.into_iter().map(Some).collect();
    for am in ams {
        let slot = saved
            .iter_mut()
            .find(|s| s.as_ref().is_some_and(|s| s.url_env == am.url_env));
        if let Some(s) = slot.and_then(Option::take) {
            am.restore(s);
        }
    }
    for s in saved.into_iter().flatten() {
        tracing::warn!(
            url_env = %s.url_env,
            firing = s.firing.len(),
            resolving = s.resolving.len(),
            "alert state of an Alertmanager that is no longer configured is dropped"
        );
    }
}

/// Why a URL cannot be a webhook (never echoing it).
/// An optional secret's text, for the one place that sends or checks it.
fn exposed(secret: &Option<SecretString>) -> Option<&str> {
    secret.as_ref().map(ExposeSecret::expose_secret)
}

fn check_url(raw: &str) -> Result<(), &'static str> {
    let url = url::Url::parse(raw).map_err(|_| "is not a valid URL")?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("is not an http(s) URL");
    }
    let Some(host) = url.host() else {
        return Err("has no host");
    };
    // Routing keys, signed bodies and Slack's URL-as-credential in clear text:
    // only a receiver on this host may be plain http.
    if url.scheme() == "http" && !crate::http::is_loopback(&host) {
        return Err(
            "is http:// to a host that is not loopback: use https:// (plain http is only accepted for 127.0.0.0/8, ::1 and localhost)",
        );
    }
    // Credentials in the authority would reach the HTTP client's debug logs.
    if !url.username().is_empty() || url.password().is_some() {
        return Err("carries user credentials, which are not supported");
    }
    Ok(())
}

impl Shared {
    /// Marks the state changed and wakes the writer.
    fn touch(&self) {
        if let Some(store) = &self.store {
            store.dirty.store(true, Ordering::SeqCst);
            store.wake.notify_one();
        }
    }

    fn snapshot(&self, now: DateTime<Utc>) -> StateFile {
        let alerts = lock(&self.fired).values().cloned().collect();
        StateFile {
            kind: STATE_KIND.to_owned(),
            version: STATE_VERSION,
            saved_at: now,
            alerts,
            sinks: self.sinks.iter().map(|s| s.saved()).collect(),
            alertmanagers: self.alertmanagers.iter().map(|s| s.saved()).collect(),
        }
    }

    /// Writes the state file if it changed since the last write; logs one
    /// ERROR per episode of failing writes (and a WARN when they work again).
    fn save(&self) -> std::io::Result<()> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let _serial = lock(&store.save_lock);
        if !store.dirty.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let file = self.snapshot(self.options.clock.now());
        match store.write(&file) {
            Ok(()) => {
                if store.failing.swap(false, Ordering::SeqCst) {
                    tracing::warn!(path = %store.path.display(), "alert state file written again");
                }
                Ok(())
            }
            Err(e) => {
                store.dirty.store(true, Ordering::SeqCst);
                store.write_failures.fetch_add(1, Ordering::Relaxed);
                self.options.counter.count(DeliveryEvent::StateWriteFailed);
                if !store.failing.swap(true, Ordering::SeqCst) {
                    tracing::error!(
                        path = %store.path.display(),
                        error = %e,
                        "cannot write the alert state file: alerts keep being delivered, but a restart now would forget what was sent"
                    );
                }
                Err(e)
            }
        }
    }

    async fn save_in_background(self: &Arc<Self>) {
        if self.store.is_none() {
            return;
        }
        let shared = self.clone();
        let _ = tokio::task::spawn_blocking(move || shared.save()).await;
    }

    /// Writes the state file after changes, at most every `save_interval`,
    /// until `stop`.
    async fn save_loop(self: &Arc<Self>, stop: CancellationToken) {
        let Some(store) = &self.store else {
            return;
        };
        loop {
            tokio::select! {
                _ = store.wake.notified() => {}
                _ = stop.cancelled() => return,
            }
            tokio::select! {
                _ = tokio::time::sleep(self.options.save_interval) => {}
                _ = stop.cancelled() => return,
            }
            self.save_in_background().await;
        }
    }

    /// Offers `change` to every sink and wakes those it made due.
    fn offer(&self, change: &Change<'_>) {
        for sink in &self.driven {
            if sink.take(change) {
                sink.notify();
            }
        }
    }

    /// The delivery loop of one sink, the same for every kind: deliver
    /// what is due in order, pause `retry_interval` when the sink asks to
    /// retry, and once shutdown is requested keep going only until
    /// `flush_deadline`.
    async fn deliver<S: Sink>(&self, sink: &S, shutdown: CancellationToken) {
        // Set once shutdown is requested: the end of the final flush.
        let mut deadline: Option<Instant> = None;
        loop {
            let mut paused = false;
            while let Some(r) = sink.next() {
                let attempt = self.attempt(sink, &r, &shutdown, &mut deadline).await;
                let interrupted = matches!(attempt, Attempt::Interrupted);
                let then = sink.settle(&r, attempt, self.options.clock.now());
                if sink.keeps_state() {
                    self.touch();
                }
                if interrupted || then == Then::Retry {
                    paused = true;
                    break;
                }
            }
            if deadline.is_some() {
                break;
            }
            if paused {
                tokio::select! {
                    _ = tokio::time::sleep(self.options.retry_interval) => {}
                    _ = shutdown.cancelled() => {
                        deadline = Some(Instant::now() + self.options.flush_deadline);
                    }
                }
            } else {
                tokio::select! {
                    _ = sink.wake().notified() => {}
                    _ = shutdown.cancelled() => {
                        deadline = Some(Instant::now() + self.options.flush_deadline);
                    }
                }
            }
        }
        sink.stopped(self.store.is_some());
    }

    /// One attempt of `r`; the sink logs and counts how it ended.
    async fn attempt<S: Sink>(
        &self,
        sink: &S,
        r: &S::Request,
        shutdown: &CancellationToken,
        deadline: &mut Option<Instant>,
    ) -> Attempt {
        let send = sink
            .request(&self.http, r, self.options.clock.now().timestamp())
            .send();
        tokio::pin!(send);
        let flush = self.options.flush_deadline;
        let result = match *deadline {
            Some(d) => tokio::time::timeout_at(d, &mut send).await.ok(),
            None => tokio::select! {
                r = &mut send => Some(r),
                _ = shutdown.cancelled() => {
                    // Let the request in flight finish, within the flush deadline.
                    let d = Instant::now() + flush;
                    *deadline = Some(d);
                    tokio::time::timeout_at(d, &mut send).await.ok()
                }
            },
        };
        // The response body is never read: it may echo what we sent.
        match result {
            None => Attempt::Interrupted,
            Some(Err(e)) => Attempt::Failed {
                error: crate::http::describe(&e),
                status: None,
            },
            Some(Ok(resp)) if resp.status().is_success() => Attempt::Delivered {
                status: resp.status().as_u16(),
            },
            Some(Ok(resp)) => {
                let code = resp.status().as_u16();
                Attempt::Failed {
                    error: format!("HTTP {code}"),
                    status: Some(code),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;
    use crate::config::WebhookFormat;
    use crate::decide::alerts::AlertKind;
    use crate::events::EventRotation;
    use crate::model::{CommitId, PolicyAction};

    fn hook(format: WebhookFormat, min: Severity, repeat_mins: u64) -> WebhookConfig {
        WebhookConfig {
            url_env: "URL".into(),
            format,
            routing_key_env: (format == WebhookFormat::Pagerduty).then(|| "RK".into()),
            secret_env: None,
            min_severity: min,
            repeat_interval: Duration::from_secs(repeat_mins * 60),
        }
    }

    fn secrets() -> SinkSecrets {
        SinkSecrets {
            url: "http://127.0.0.1:9/hook".into(),
            routing_key: Some("rk".into()),
            hmac_secret: None,
        }
    }

    fn notifier(hooks: Vec<WebhookConfig>, capacity: usize) -> Notifier {
        let n = hooks.len();
        let config = AlertsConfig {
            webhooks: hooks,
            // Per machine, no hold-down: these tests are about the per-sink state machine.
            group_by: vec![GroupField::Machine],
            resolve_after: Duration::ZERO,
            ..AlertsConfig::default()
        };
        let options = NotifierOptions {
            queue_capacity: capacity,
            ..NotifierOptions::default()
        };
        Notifier::with_options(&config, vec![secrets(); n], options).unwrap()
    }

    fn alert(machine: &str, severity: Severity) -> Alert {
        Alert {
            kind: crate::decide::alerts::AlertKind::Drift,
            app: Some("agents".into()),
            machine_id: Some(machine.into()),
            commit: CommitId::parse(&"c0ffee".repeat(7)[..40]),
            severity,
            summary: format!("{machine} is behind"),
            details: BTreeMap::new(),
        }
    }

    fn t(mins: i64) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 5, 1, 12, 0, 0).unwrap() + chrono::Duration::minutes(mins)
    }

    /// (event, status, repeat, severity) of every queued notification of sink `i`.
    fn queue(n: &Notifier, i: usize) -> Vec<(String, &'static str, bool, Severity)> {
        lock(&n.shared.sinks[i].state)
            .queue
            .iter()
            .map(|q| (q.event.to_owned(), q.status.as_str(), q.repeat, q.severity))
            .collect()
    }

    #[test]
    fn escalation_renotifies_and_a_fall_is_silent() {
        let n = notifier(vec![hook(WebhookFormat::Json, Severity::Low, 30)], 100);
        n.update(&[alert("m1", Severity::Medium)], &[], t(0));
        n.update(&[alert("m1", Severity::High)], &[], t(1));
        n.update(&[alert("m1", Severity::Medium)], &[], t(2));
        n.update(&[alert("m1", Severity::High)], &[], t(3));
        let q = queue(&n, 0);
        let sevs: Vec<Severity> = q.iter().map(|e| e.3).collect();
        assert_eq!(
            sevs,
            [Severity::Medium, Severity::High, Severity::High],
            "{q:?}"
        );
        assert!(q.iter().all(|e| e.1 == "firing" && !e.2));
    }

    #[test]
    fn repeats_do_not_stack_behind_an_undelivered_notification() {
        let n = notifier(vec![hook(WebhookFormat::Json, Severity::Low, 30)], 100);
        for m in [0, 31, 62, 93] {
            n.update(&[alert("m1", Severity::Low)], &[], t(m));
        }
        // The trigger was never delivered (no `run`), so no repeat queued behind it.
        assert_eq!(queue(&n, 0).len(), 1);
    }

    #[test]
    fn zero_repeat_interval_disables_repeats() {
        let n = notifier(vec![hook(WebhookFormat::Json, Severity::Low, 0)], 100);
        n.update(&[alert("m1", Severity::Low)], &[], t(0));
        let head = n.shared.sinks[0].front().unwrap();
        n.shared.sinks[0].delivered(&head);
        n.update(&[alert("m1", Severity::Low)], &[], t(600));
        assert!(queue(&n, 0).is_empty());
    }

    fn grouped_notifier(resolve_after: Duration) -> Notifier {
        let config = AlertsConfig {
            webhooks: vec![hook(WebhookFormat::Pagerduty, Severity::Low, 0)],
            resolve_after,
            stale_after: Duration::from_secs(90),
            ..AlertsConfig::default()
        };
        Notifier::with_options(&config, vec![secrets()], NotifierOptions::default()).unwrap()
    }

    fn secs(s: i64) -> DateTime<Utc> {
        t(0) + chrono::Duration::seconds(s)
    }

    #[test]
    fn a_group_empty_for_less_than_resolve_after_is_held_and_rejoined_not_reopened() {
        let n = grouped_notifier(Duration::from_secs(90));
        n.update(&[alert("m1", Severity::Low)], &[], secs(0));
        let head = n.shared.sinks[0].front().unwrap();
        n.shared.sinks[0].delivered(&head);
        // m1 enters rotation (no drift alert); m2's drift matures 60 s later.
        n.update(&[], &[], secs(30));
        n.update(&[alert("m2", Severity::Low)], &[], secs(90));
        n.update(&[], &[], secs(120));
        n.update(&[], &[], secs(209));
        let q = queue(&n, 0);
        assert_eq!(
            q.iter()
                .map(|(e, s, _, _)| (e.as_str(), *s))
                .collect::<Vec<_>>(),
            [("drift_detected", "firing")],
            "after the delivered trigger, one update; no resolve yet"
        );
        n.update(&[], &[], secs(210));
        assert_eq!(
            queue(&n, 0).last().map(|(e, s, _, _)| (e.clone(), *s)),
            Some(("drift_resolved".to_owned(), "resolved")),
            "empty for resolve_after: resolved"
        );
    }

    #[test]
    fn a_replica_with_a_stale_view_of_an_app_says_nothing_of_it() {
        let n = grouped_notifier(Duration::from_secs(90));
        n.update(&[alert("m1", Severity::Low)], &[], secs(0));
        assert_eq!(queue(&n, 0).len(), 1);
        // Sweeps fail from here: the carried alert is from the view of 0 s.
        let seen = Seen::fresh(secs(0));
        for s in [30, 60, 90] {
            n.update_seen(&[alert("m1", Severity::Low)], &[], secs(s), &seen);
        }
        // Older than stale_after: no trigger of a new group, no resolve of the old.
        n.update_seen(&[alert("m2", Severity::High)], &[], secs(91), &seen);
        n.update_seen(&[], &[], secs(500), &seen);
        let own = Alert {
            kind: AlertKind::SweepFailing,
            app: None,
            machine_id: None,
            commit: None,
            severity: Severity::Critical,
            summary: "sweeps fail".into(),
            details: BTreeMap::new(),
        };
        n.update_seen(&[own], &[], secs(501), &seen);
        let q = queue(&n, 0);
        assert_eq!(
            q.iter()
                .map(|(e, s, _, _)| (e.as_str(), *s))
                .collect::<Vec<_>>(),
            [("drift_detected", "firing"), ("sweep_failing", "firing")],
            "only its own sweep_failing speaks"
        );
    }

    #[test]
    fn a_full_queue_defers_transitions_to_a_later_sweep() {
        let n = notifier(vec![hook(WebhookFormat::Json, Severity::Low, 30)], 1);
        n.update(
            &[alert("m1", Severity::Low), alert("m2", Severity::Low)],
            &[],
            t(0),
        );
        assert_eq!(queue(&n, 0).len(), 1);
        assert_eq!(n.stats()[0].dropped, 1);
        // m1's trigger goes out; the next sweep queues m2's (never recorded as sent).
        let head = n.shared.sinks[0].front().unwrap();
        n.shared.sinks[0].delivered(&head);
        n.update(
            &[alert("m1", Severity::Low), alert("m2", Severity::Low)],
            &[],
            t(1),
        );
        assert_eq!(queue(&n, 0).len(), 1);
        assert_eq!(n.stats()[0].firing, 2);
        // Both clear while the queue is full: the resolves wait their turn.
        n.update(&[], &[], t(2));
        assert_eq!(n.stats()[0].firing, 2, "nothing fits behind m2's trigger");
        let head = n.shared.sinks[0].front().unwrap();
        n.shared.sinks[0].delivered(&head);
        n.update(&[], &[], t(3));
        let head = n.shared.sinks[0].front().unwrap();
        n.shared.sinks[0].delivered(&head);
        n.update(&[], &[], t(4));
        assert_eq!(n.stats()[0].firing, 0);
        assert_eq!(n.stats()[0].delivered, 3);
        assert_eq!(
            queue(&n, 0),
            [("drift_resolved".into(), "resolved", false, Severity::Low)]
        );
    }

    #[test]
    fn pagerduty_pages_failures_and_unfenced_calls_and_resolves_failures_on_success() {
        let n = notifier(
            vec![
                hook(WebhookFormat::Pagerduty, Severity::Low, 30),
                hook(WebhookFormat::Slack, Severity::Low, 30),
            ],
            100,
        );
        let event = |kind| ActionEvent {
            kind,
            app: "agents".into(),
            machine_id: "m1".into(),
            rotation: Some(EventRotation {
                commit: CommitId::parse(&"c0ffee".repeat(7)[..40]).unwrap(),
                action: PolicyAction::Restart,
            }),
            severity: Severity::High,
            summary: "restart".into(),
            at: t(0),
        };
        let all = [
            event(EventKind::ActionStarted),
            event(EventKind::ActionSucceeded),
            event(EventKind::ActionFailed),
        ];
        n.update(&[], &all, t(0));
        n.update(&[], &[event(EventKind::ActionSucceeded)], t(1));
        n.update(&[], &[event(EventKind::ActionSucceeded)], t(2));
        let pd = queue(&n, 0);
        assert_eq!(
            pd.iter().map(|e| (e.0.as_str(), e.1)).collect::<Vec<_>>(),
            [("action_failed", "event"), ("action_succeeded", "resolved")]
        );
        let pd_keys: Vec<DedupKey> = lock(&n.shared.sinks[0].state)
            .queue
            .iter()
            .map(|q| q.dedup_key.clone())
            .collect();
        assert_eq!(pd_keys[0], pd_keys[1]);
        assert_eq!(queue(&n, 1).len(), 5, "slack gets every event once");
        // A call that may have gone unfenced pages, and nothing of ours resolves it.
        n.update(&[], &[event(EventKind::ActionUnfenced)], t(3));
        n.update(&[], &[event(EventKind::ActionSucceeded)], t(4));
        let pd = queue(&n, 0);
        assert_eq!(
            pd.iter().map(|e| (e.0.as_str(), e.1)).collect::<Vec<_>>(),
            [
                ("action_failed", "event"),
                ("action_succeeded", "resolved"),
                ("action_unfenced", "event")
            ]
        );
    }

    /// A step of no rotation (a probe-failure record written unfenced)
    /// names no commit and no action: `"commit": null`, no `tip` or
    /// `action` detail, `*` in the key (before: `""` and a made-up
    /// `manual`). A stored notification with the old `""` still reads back.
    #[test]
    fn an_event_of_no_rotation_names_no_commit_or_action() {
        let n = notifier(vec![hook(WebhookFormat::Json, Severity::Low, 30)], 100);
        let event = ActionEvent {
            kind: EventKind::ActionUnfenced,
            app: "agents".into(),
            machine_id: "m1".into(),
            rotation: None,
            severity: Severity::High,
            summary: "record the probe failures on m1: no answer".into(),
            at: t(0),
        };
        n.update(&[], &[event], t(0));
        let sent = Notification::clone(&lock(&n.shared.sinks[0].state).queue[0]);
        assert_eq!(sent.commit, None);
        assert_eq!(
            sent.dedup_key.as_str(),
            "fleet-reconciler/action_unfenced/agents/m1/*"
        );
        assert!(
            !sent.details.contains_key("action") && !sent.details.contains_key(TIP),
            "{:?}",
            sent.details
        );
        let body: serde_json::Value = serde_json::from_slice(
            &format::tests::render(WebhookFormat::Json, &sent, None, None, 0).body,
        )
        .unwrap();
        assert_eq!(body["commit"], serde_json::Value::Null);

        let mut stored = serde_json::to_value(&sent).unwrap();
        stored["commit"] = "".into();
        let read: Notification = serde_json::from_value(stored.clone()).unwrap();
        assert_eq!(read.commit, None);
        stored["commit"] = "AB".repeat(20).into();
        let read: Notification = serde_json::from_value(stored.clone()).unwrap();
        assert_eq!(read.commit, CommitId::parse(&"ab".repeat(20)));
        stored["commit"] = "c0ffee".into();
        let why = serde_json::from_value::<Notification>(stored)
            .unwrap_err()
            .to_string();
        assert!(why.contains("not a commit id"), "{why}");
    }

    /// The labels metrics carry, pinned so a rename is seen; an
    /// Alertmanager's problem has the label of the webhook's same problem.
    #[test]
    fn notify_error_kinds_keep_their_labels() {
        use strum::VariantArray;
        let labels: Vec<&str> = NotifyErrorKind::VARIANTS.iter().map(|k| k.into()).collect();
        assert_eq!(
            labels,
            [
                "missing_env",
                "secrets_mismatch",
                "missing_secret",
                "invalid_url",
                "client"
            ]
        );
        let am = [
            NotifyError::AlertmanagerMissingEnv {
                index: 0,
                var: "V".into(),
            },
            NotifyError::AlertmanagerInvalidUrl {
                index: 0,
                url_env: "V".into(),
                problem: "p",
            },
            NotifyError::AlertmanagerMismatch {
                expected: 1,
                got: 0,
            },
        ];
        let kinds: Vec<&str> = am.iter().map(NotifyError::kind).collect();
        assert_eq!(kinds, ["missing_env", "invalid_url", "secrets_mismatch"]);
    }

    #[test]
    fn urls_are_checked_without_echoing_them() {
        let config = AlertsConfig {
            webhooks: vec![hook(WebhookFormat::Json, Severity::Low, 30)],
            // Per machine: these tests are about the per-sink state machine.
            group_by: vec![GroupField::Machine],
            ..AlertsConfig::default()
        };
        for (url, problem) in [
            ("ftp://host/secret-path", "http(s)"),
            ("not a url secret-path", "valid URL"),
            ("https://user:secret-path@host/", "credentials"),
        ] {
            let s = SinkSecrets {
                url: url.into(),
                ..SinkSecrets::default()
            };
            let e = Notifier::new(&config, vec![s]).unwrap_err().to_string();
            assert!(e.contains(problem) && e.contains("URL"), "{e}");
            assert!(!e.contains("secret-path"), "{e}");
        }
        let e = Notifier::new(&config, vec![]).unwrap_err();
        assert_eq!(e.kind(), "secrets_mismatch");
    }
}

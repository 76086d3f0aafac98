//! The webhook notifier: alert state (dedupe, repeat, resolve) and delivery to sinks.
//!
//! Owns, per configured webhook, which alerts that sink has been told about,
//! the queue of notifications not yet delivered, and the HTTP delivery with
//! retries. The sweep hands it the *full* set of conditions that hold now
//! (`update`, level-triggered, never blocking); a background task (`run`)
//! delivers. It must never block or fail a sweep, never follow a redirect,
//! and never write a webhook URL, routing key, HMAC secret or response body
//! into a log line, an error or a payload. It never reads the environment
//! (secrets arrive as `SinkSecrets`, see `sink_secrets_from_env`) and never
//! reads the wall clock for alert decisions (`now` is an argument).
//!
//! # Per-sink state machine (keyed by `Alert::dedup_key`)
//!
//! | condition at `update` | notification |
//! | --- | --- |
//! | key new to the sink, severity ≥ `min_severity` | trigger |
//! | key new, severity below `min_severity` | nothing (not tracked; a later escalation is a new trigger) |
//! | key known, severity rose | trigger again at the new severity (escalation) |
//! | key known, unchanged, `repeat_interval` since the last notification | one repeat (skipped while an earlier one for the key is still queued) |
//! | key known to the sink, absent now | resolve, at once |
//!
//! A severity that falls is remembered silently; repeats are sent only while
//! the severity is ≥ `min_severity`. `ActionEvent`s go once to json and slack
//! sinks; a pagerduty sink gets only `action_failed` (as a trigger keyed by
//! app, machine and target commit), resolved by a later `action_succeeded` of
//! the same rotation — never `action_started` or successes as pages.
//!
//! # Delivery
//!
//! One FIFO queue per sink, delivered in order: a resolve never overtakes its
//! trigger. A failed attempt (connection error, timeout, 3xx, any non-2xx)
//! pauses that sink for `retry_interval` and retries the same notification;
//! nothing is dropped. A full queue refuses new alert transitions without
//! recording them, so the next sweep (level-triggered) offers them again;
//! one-shot events are the only thing an overflow can lose, and it says so in
//! one ERROR line per overflow episode.

mod fleet;
mod format;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{AlertsConfig, WebhookConfig, WebhookFormat};
use crate::events::{ActionEvent, Alert, EventKind};
use crate::model::Severity;

pub use fleet::{
    APP_UNLISTABLE_SEVERITY, COHERENCE_SEVERITY, Coherence, CoherenceSample, FleetAlertInput,
    FleetAlertRules, FleetAlertTracker, SWEEP_FAILING_SEVERITY, TIP_STALE_SEVERITY,
};
pub use format::{
    JSON_SCHEMA_VERSION, PAGERDUTY_DEDUP_KEY_MAX, PAGERDUTY_SUMMARY_MAX, SIGNATURE_HEADER,
    format_name, pagerduty_dedup_key, pagerduty_severity, sign,
};

/// The secrets of one webhook, resolved from the environment at the edge.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SinkSecrets {
    /// The webhook URL (a secret: Slack and many receivers authenticate by it).
    pub url: String,
    /// PagerDuty Events v2 routing key (pagerduty only).
    pub routing_key: Option<String>,
    /// Key of the `X-Fleet-Signature` HMAC (json only).
    pub hmac_secret: Option<String>,
}

impl fmt::Debug for SinkSecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let redacted = |o: &Option<String>| o.as_ref().map(|_| "<redacted>");
        f.debug_struct("SinkSecrets")
            .field("url", &"<redacted>")
            .field("routing_key", &redacted(&self.routing_key))
            .field("hmac_secret", &redacted(&self.hmac_secret))
            .finish()
    }
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
}

impl NotifyError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            NotifyError::MissingEnv { .. } => "missing_env",
            NotifyError::SecretsMismatch { .. } => "secrets_mismatch",
            NotifyError::MissingSecret { .. } => "missing_secret",
            NotifyError::InvalidUrl { .. } => "invalid_url",
            NotifyError::Client(_) => "client",
        }
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
        lookup(var)
            .filter(|v| !v.trim().is_empty())
            .ok_or_else(|| NotifyError::MissingEnv {
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

/// Delivery tuning; the defaults are the production values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotifierOptions {
    /// Pause of a sink after a failed attempt (DESIGN §7: "the next minute").
    pub retry_interval: Duration,
    /// Whole-request deadline of one delivery attempt.
    pub request_timeout: Duration,
    /// Notifications a sink may hold undelivered.
    pub queue_capacity: usize,
    /// How long `run` keeps delivering after shutdown is requested.
    pub flush_deadline: Duration,
}

impl Default for NotifierOptions {
    fn default() -> Self {
        NotifierOptions {
            retry_interval: Duration::from_secs(60),
            request_timeout: Duration::from_secs(10),
            queue_capacity: 10_000,
            flush_deadline: Duration::from_secs(5),
        }
    }
}

/// What a notification says about its condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Firing,
    Resolved,
    Event,
}

impl Status {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Status::Firing => "firing",
            Status::Resolved => "resolved",
            Status::Event => "event",
        }
    }
}

/// One message for one sink, format-independent.
#[derive(Clone, Debug)]
pub(crate) struct Notification {
    pub(crate) status: Status,
    pub(crate) event: &'static str,
    pub(crate) repeat: bool,
    pub(crate) dedup_key: String,
    pub(crate) app: Option<String>,
    pub(crate) machine_id: Option<String>,
    pub(crate) commit: Option<String>,
    pub(crate) severity: Severity,
    pub(crate) summary: String,
    pub(crate) details: BTreeMap<String, String>,
    pub(crate) at: DateTime<Utc>,
}

impl Notification {
    fn trigger(alert: &Alert, key: &str, repeat: bool, now: DateTime<Utc>) -> Notification {
        Notification {
            status: Status::Firing,
            event: alert.kind.trigger_name(),
            repeat,
            dedup_key: key.to_owned(),
            app: alert.app.clone(),
            machine_id: alert.machine_id.clone(),
            commit: alert.commit.clone(),
            severity: alert.severity,
            summary: alert.summary.clone(),
            details: alert.details.clone(),
            at: now,
        }
    }

    fn resolve(last: &Alert, key: &str, now: DateTime<Utc>) -> Notification {
        Notification {
            status: Status::Resolved,
            event: last.kind.resolve_name(),
            repeat: false,
            summary: format!("Resolved: {}", last.summary),
            ..Notification::trigger(last, key, false, now)
        }
    }

    fn event(e: &ActionEvent) -> Notification {
        Notification {
            status: Status::Event,
            event: e.kind.name(),
            repeat: false,
            dedup_key: event_key(e.kind, e),
            app: Some(e.app.clone()),
            machine_id: Some(e.machine_id.clone()),
            commit: Some(e.commit.clone()),
            severity: e.severity,
            summary: e.summary.clone(),
            details: BTreeMap::from([("action".to_owned(), e.action.as_str().to_owned())]),
            at: e.at,
        }
    }

    fn field(v: &Option<String>) -> &str {
        v.as_deref().unwrap_or("*")
    }
}

fn log_alert(alert: &Alert, event: &str, message: &str) {
    tracing::info!(
        event,
        app = Notification::field(&alert.app),
        machine_id = Notification::field(&alert.machine_id),
        commit = Notification::field(&alert.commit),
        severity = %alert.severity,
        summary = %alert.summary,
        "{message}"
    );
}

/// Identity of a one-shot event: its kind and the rotation (app, machine, target).
fn event_key(kind: EventKind, e: &ActionEvent) -> String {
    format!(
        "fleet-reconciler/{}/{}/{}/{}",
        kind.name(),
        e.app,
        e.machine_id,
        e.commit
    )
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
}

/// Sends alerts and action events to the configured webhooks. Cheap to clone
/// (shared state); `update` from the sweep, `run` in a background task.
#[derive(Clone)]
pub struct Notifier {
    shared: Arc<Shared>,
}

struct Shared {
    sinks: Vec<Sink>,
    http: reqwest::Client,
    options: NotifierOptions,
    /// Every alert firing at the last `update`, for one log line per transition.
    fired: Mutex<BTreeMap<String, Alert>>,
    running: AtomicBool,
}

struct Sink {
    index: usize,
    format: WebhookFormat,
    min_severity: Severity,
    /// Zero disables repeats.
    repeat_interval: Duration,
    secrets: SinkSecrets,
    state: Mutex<SinkState>,
    wake: tokio::sync::Notify,
}

#[derive(Default)]
struct SinkState {
    /// Keys this sink has been sent (or has queued) a trigger for.
    firing: BTreeMap<String, Tracked>,
    /// PagerDuty only: `action_failed` keys triggered and not yet resolved.
    open_failures: HashSet<String>,
    queue: VecDeque<Arc<Notification>>,
    /// Queued notifications per dedup key (repeats are not stacked behind them).
    pending: HashMap<String, usize>,
    /// Refusals in the current overflow episode (`None`: not overflowing).
    overflow: Option<u64>,
    delivered: u64,
    failed_attempts: u64,
    dropped: u64,
}

struct Tracked {
    /// The latest version of the alert (for the resolve's summary and fields).
    alert: Alert,
    /// The highest severity this sink was notified at since the last resolve.
    notified_severity: Severity,
    last_notified: DateTime<Utc>,
}

impl fmt::Debug for Notifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sinks: Vec<&str> = self
            .shared
            .sinks
            .iter()
            .map(|s| format_name(s.format))
            .collect();
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

impl Notifier {
    /// A notifier for `config.webhooks`, with `sinks[i]` the secrets of webhook `i`.
    pub fn new(config: &AlertsConfig, sinks: Vec<SinkSecrets>) -> Result<Notifier, NotifyError> {
        Notifier::with_options(config, sinks, NotifierOptions::default())
    }

    pub fn with_options(
        config: &AlertsConfig,
        sinks: Vec<SinkSecrets>,
        options: NotifierOptions,
    ) -> Result<Notifier, NotifyError> {
        if sinks.len() != config.webhooks.len() {
            return Err(NotifyError::SecretsMismatch {
                expected: config.webhooks.len(),
                got: sinks.len(),
            });
        }
        let sinks = config
            .webhooks
            .iter()
            .zip(sinks)
            .enumerate()
            .map(|(index, (hook, secrets))| Sink::new(index, hook, secrets))
            .collect::<Result<Vec<_>, _>>()?;
        let http = crate::http::client_builder()
            // A redirect could carry a signed body or routing key elsewhere,
            // and a receiver that moved should be reconfigured, not followed.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(options.request_timeout)
            .connect_timeout(options.request_timeout.min(Duration::from_secs(5)))
            .build()
            .map_err(|e| NotifyError::Client(crate::http::describe(&e)))?;
        Ok(Notifier {
            shared: Arc::new(Shared {
                sinks,
                http,
                options,
                fired: Mutex::new(BTreeMap::new()),
                running: AtomicBool::new(false),
            }),
        })
    }

    /// Takes the full set of conditions that hold at `now` and the events of
    /// this sweep, and queues what each sink must be told. Never waits on the
    /// network: it only takes short, uncontended locks and wakes `run`.
    pub fn update(&self, firing: &[Alert], events: &[ActionEvent], now: DateTime<Utc>) {
        // One alert per key; if the planner sent a key twice, the more severe wins.
        let mut current: BTreeMap<String, &Alert> = BTreeMap::new();
        for alert in firing {
            current
                .entry(alert.dedup_key())
                .and_modify(|a| {
                    if alert.severity > a.severity {
                        *a = alert;
                    }
                })
                .or_insert(alert);
        }
        self.log_transitions(&current);
        let capacity = self.shared.options.queue_capacity;
        for sink in &self.shared.sinks {
            let queued = {
                let mut state = lock(&sink.state);
                sink.plan(&mut state, &current, events, now, capacity)
            };
            if queued > 0 {
                sink.wake.notify_one();
            }
        }
    }

    /// One line per alert that started, changed severity or cleared.
    fn log_transitions(&self, current: &BTreeMap<String, &Alert>) {
        let mut fired = lock(&self.shared.fired);
        for (key, alert) in current {
            let previous = fired.get(key).map(|a| a.severity);
            if previous == Some(alert.severity) {
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
    /// what is left within `flush_deadline`. Run exactly one per notifier
    /// (a second concurrent call returns at once), usually spawned:
    /// `tokio::spawn({ let n = notifier.clone(); async move { n.run(token).await } })`.
    /// Webhooks are delivered concurrently, each in its own order.
    pub async fn run(&self, shutdown: CancellationToken) {
        if self.shared.running.swap(true, Ordering::SeqCst) {
            tracing::error!("webhook delivery is already running for this notifier");
            return;
        }
        let shared = &self.shared;
        futures::future::join_all(
            shared
                .sinks
                .iter()
                .map(|sink| shared.deliver(sink, shutdown.clone())),
        )
        .await;
        self.shared.running.store(false, Ordering::SeqCst);
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
                    format: format_name(sink.format),
                    queued: state.queue.len(),
                    delivered: state.delivered,
                    failed_attempts: state.failed_attempts,
                    dropped: state.dropped,
                    firing: state.firing.len(),
                }
            })
            .collect()
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

impl Sink {
    fn new(index: usize, hook: &WebhookConfig, secrets: SinkSecrets) -> Result<Sink, NotifyError> {
        check_url(&secrets.url).map_err(|problem| NotifyError::InvalidUrl {
            index,
            url_env: hook.url_env.clone(),
            problem,
        })?;
        let missing = |what| NotifyError::MissingSecret {
            index,
            format: format_name(hook.format),
            what,
        };
        if hook.format == WebhookFormat::Pagerduty
            && secrets.routing_key.as_deref().is_none_or(str::is_empty)
        {
            return Err(missing("routing key"));
        }
        // Unsigned bodies to a receiver configured to verify them would all be rejected.
        if hook.secret_env.is_some() && secrets.hmac_secret.as_deref().is_none_or(str::is_empty) {
            return Err(missing("HMAC secret"));
        }
        Ok(Sink {
            index,
            format: hook.format,
            min_severity: hook.min_severity,
            repeat_interval: hook.repeat_interval,
            secrets,
            state: Mutex::new(SinkState::default()),
            wake: tokio::sync::Notify::new(),
        })
    }

    /// Turns the alerts holding now and this sweep's events into this sink's
    /// notifications; returns how many were queued.
    fn plan(
        &self,
        st: &mut SinkState,
        current: &BTreeMap<String, &Alert>,
        events: &[ActionEvent],
        now: DateTime<Utc>,
        capacity: usize,
    ) -> usize {
        let mut queued = 0;
        let refused_before = st.dropped;
        // Resolves first: after a release, the old target's alerts clear
        // before the new target's fire.
        let cleared: Vec<String> = st
            .firing
            .keys()
            .filter(|k| !current.contains_key(*k))
            .cloned()
            .collect();
        for key in cleared {
            let n = Notification::resolve(&st.firing[&key].alert, &key, now);
            if self.push(st, n, capacity) {
                st.firing.remove(&key);
                queued += 1;
            } // else: still tracked, so the next sweep offers the resolve again.
        }
        let repeat = chrono::Duration::from_std(self.repeat_interval).ok();
        for (key, alert) in current {
            match st.firing.get(key) {
                None if alert.severity < self.min_severity => {}
                None => {
                    if self.push(st, Notification::trigger(alert, key, false, now), capacity) {
                        queued += 1;
                        st.firing.insert(
                            key.clone(),
                            Tracked {
                                alert: (*alert).clone(),
                                notified_severity: alert.severity,
                                last_notified: now,
                            },
                        );
                    }
                }
                Some(t) => {
                    let escalated =
                        alert.severity > t.notified_severity && alert.severity >= self.min_severity;
                    let repeat_due = alert.severity >= self.min_severity
                        && repeat.is_some_and(|r| !r.is_zero() && now - t.last_notified >= r)
                        && !st.pending.contains_key(key);
                    let sent = (escalated || repeat_due)
                        && self.push(
                            st,
                            Notification::trigger(alert, key, !escalated, now),
                            capacity,
                        );
                    if sent {
                        queued += 1;
                    }
                    let t = st.firing.get_mut(key).expect("checked above");
                    if sent {
                        t.last_notified = now;
                        t.notified_severity = t.notified_severity.max(alert.severity);
                    }
                    if alert.severity < t.notified_severity && !escalated {
                        // Fell: remember, so that rising again re-notifies.
                        t.notified_severity = alert.severity;
                    }
                    t.alert = (*alert).clone();
                }
            }
        }
        for e in events {
            let wanted = e.severity >= self.min_severity;
            if self.format != WebhookFormat::Pagerduty {
                if wanted {
                    queued += usize::from(self.push(st, Notification::event(e), capacity));
                }
                continue;
            }
            // PagerDuty pages: only failures, resolved by the rotation's success
            // (whatever its severity: the resolve follows the trigger).
            let failure_key = event_key(EventKind::ActionFailed, e);
            match e.kind {
                EventKind::ActionFailed if wanted => {
                    if self.push(st, Notification::event(e), capacity) {
                        st.open_failures.insert(failure_key);
                        queued += 1;
                    }
                }
                EventKind::ActionSucceeded if st.open_failures.contains(&failure_key) => {
                    let n = Notification {
                        status: Status::Resolved,
                        dedup_key: failure_key.clone(),
                        ..Notification::event(e)
                    };
                    if self.push(st, n, capacity) {
                        st.open_failures.remove(&failure_key);
                        queued += 1;
                    }
                }
                EventKind::ActionFailed | EventKind::ActionSucceeded | EventKind::ActionStarted => {
                }
            }
        }
        if st.dropped == refused_before && st.queue.len() < capacity {
            self.end_overflow(st);
        }
        queued
    }

    /// Appends to the queue, or counts a refusal when it is full.
    fn push(&self, st: &mut SinkState, n: Notification, capacity: usize) -> bool {
        if st.queue.len() >= capacity {
            st.dropped += 1;
            let episode = st.overflow.get_or_insert(0);
            *episode += 1;
            if *episode == 1 {
                tracing::error!(
                    sink_format = format_name(self.format),
                    sink_index = self.index,
                    capacity,
                    event = n.event,
                    "webhook queue full (receiver failing for long?): alert changes wait for a later sweep and one-shot events are dropped until it drains"
                );
            }
            return false;
        }
        *st.pending.entry(n.dedup_key.clone()).or_default() += 1;
        st.queue.push_back(Arc::new(n));
        true
    }

    /// Ends an overflow episode once a whole `plan` went by without a refusal.
    fn end_overflow(&self, st: &mut SinkState) {
        if let Some(refused) = st.overflow.take() {
            tracing::warn!(
                sink_format = format_name(self.format),
                sink_index = self.index,
                refused,
                "webhook queue has room again"
            );
        }
    }

    fn front(&self) -> Option<Arc<Notification>> {
        lock(&self.state).queue.front().cloned()
    }

    /// Removes the delivered head of the queue.
    fn delivered(&self, n: &Arc<Notification>) {
        let mut st = lock(&self.state);
        if st.queue.front().is_some_and(|f| Arc::ptr_eq(f, n)) {
            st.queue.pop_front();
            if let Some(count) = st.pending.get_mut(&n.dedup_key) {
                *count -= 1;
                if *count == 0 {
                    st.pending.remove(&n.dedup_key);
                }
            }
        }
        st.delivered += 1;
    }
}

/// Why a URL cannot be a webhook (never echoing it).
fn check_url(raw: &str) -> Result<(), &'static str> {
    let url = url::Url::parse(raw).map_err(|_| "is not a valid URL")?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("is not an http(s) URL");
    }
    if url.host().is_none() {
        return Err("has no host");
    }
    // Credentials in the authority would reach the HTTP client's debug logs.
    if !url.username().is_empty() || url.password().is_some() {
        return Err("carries user credentials, which are not supported");
    }
    Ok(())
}

/// How one attempt ended.
enum Outcome {
    Delivered(u16),
    Failed(String),
}

impl Shared {
    /// The delivery loop of one sink.
    async fn deliver(&self, sink: &Sink, shutdown: CancellationToken) {
        // Set once shutdown is requested: the end of the final flush.
        let mut deadline: Option<Instant> = None;
        loop {
            let mut failed = false;
            while let Some(n) = sink.front() {
                match self.attempt(sink, &n, &shutdown, &mut deadline).await {
                    Outcome::Delivered(_) => sink.delivered(&n),
                    Outcome::Failed(_) => {
                        failed = true;
                        break;
                    }
                }
            }
            if deadline.is_some() {
                break;
            }
            if failed {
                tokio::select! {
                    _ = tokio::time::sleep(self.options.retry_interval) => {}
                    _ = shutdown.cancelled() => {
                        deadline = Some(Instant::now() + self.options.flush_deadline);
                    }
                }
            } else {
                tokio::select! {
                    _ = sink.wake.notified() => {}
                    _ = shutdown.cancelled() => {
                        deadline = Some(Instant::now() + self.options.flush_deadline);
                    }
                }
            }
        }
        let left = lock(&sink.state).queue.len();
        if left > 0 {
            tracing::warn!(
                sink_format = format_name(sink.format),
                sink_index = sink.index,
                undelivered = left,
                "webhook notifications left undelivered at shutdown"
            );
        }
    }

    /// One delivery attempt of `n`, logged as one line.
    async fn attempt(
        &self,
        sink: &Sink,
        n: &Notification,
        shutdown: &CancellationToken,
        deadline: &mut Option<Instant>,
    ) -> Outcome {
        let rendered = format::render(
            sink.format,
            n,
            sink.secrets.routing_key.as_deref(),
            sink.secrets.hmac_secret.as_deref(),
        );
        let mut request = self
            .http
            .post(&sink.secrets.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(rendered.body);
        if let Some(signature) = rendered.signature {
            request = request.header(SIGNATURE_HEADER, signature);
        }
        let send = request.send();
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
        let outcome = match result {
            None => Outcome::Failed("shutdown flush deadline passed".to_owned()),
            Some(Ok(resp)) if resp.status().is_success() => {
                Outcome::Delivered(resp.status().as_u16())
            }
            Some(Ok(resp)) if resp.status().is_redirection() => Outcome::Failed(format!(
                "HTTP {}: redirect refused (update the webhook URL)",
                resp.status().as_u16()
            )),
            Some(Ok(resp)) => Outcome::Failed(format!("HTTP {}", resp.status().as_u16())),
            Some(Err(e)) => Outcome::Failed(crate::http::describe(&e)),
        };
        let queued = {
            let mut st = lock(&sink.state);
            if matches!(outcome, Outcome::Failed(_)) {
                st.failed_attempts += 1;
            }
            st.queue.len()
        };
        match &outcome {
            Outcome::Delivered(code) => tracing::info!(
                event = n.event,
                status = n.status.as_str(),
                repeat = n.repeat,
                app = Notification::field(&n.app),
                machine_id = Notification::field(&n.machine_id),
                commit = Notification::field(&n.commit),
                severity = %n.severity,
                sink_format = format_name(sink.format),
                sink_index = sink.index,
                http_status = code,
                "webhook delivered"
            ),
            Outcome::Failed(error) => tracing::warn!(
                event = n.event,
                status = n.status.as_str(),
                repeat = n.repeat,
                app = Notification::field(&n.app),
                machine_id = Notification::field(&n.machine_id),
                commit = Notification::field(&n.commit),
                severity = %n.severity,
                sink_format = format_name(sink.format),
                sink_index = sink.index,
                error = %error,
                queued,
                retry_in = %humantime::format_duration(self.options.retry_interval),
                "webhook delivery failed; will retry"
            ),
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;
    use crate::model::PolicyAction;

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
            kind: crate::events::AlertKind::Drift,
            app: Some("agents".into()),
            machine_id: Some(machine.into()),
            commit: Some("c0ffee".into()),
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
    fn pagerduty_pages_only_failures_and_resolves_them_on_success() {
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
            commit: "c0ffee".into(),
            severity: Severity::High,
            action: PolicyAction::Restart,
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
        let pd_keys: Vec<String> = lock(&n.shared.sinks[0].state)
            .queue
            .iter()
            .map(|q| q.dedup_key.clone())
            .collect();
        assert_eq!(pd_keys[0], pd_keys[1]);
        assert_eq!(queue(&n, 1).len(), 5, "slack gets every event once");
    }

    #[test]
    fn urls_are_checked_without_echoing_them() {
        let config = AlertsConfig {
            webhooks: vec![hook(WebhookFormat::Json, Severity::Low, 30)],
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

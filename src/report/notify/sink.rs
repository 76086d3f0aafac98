//! What a sink is: the one trait the notifier's delivery path drives, and
//! which kind of webhook each configured format is.
//!
//! Owns the [`Sink`] trait: what a sink takes from a [`Change`] (the
//! incidents and events of an update, or a successful sweep), the request
//! it makes next, and what it does with how that attempt ended. Every sink
//! is one file: `webhook` (with its queue, retries, dead letters and
//! state per the notifier's docs), `alertmanager`, `heartbeat`. The notifier drives them all the same way
//! (`Shared::deliver`: one loop per sink, the same retry pause, shutdown
//! flush and state-file writes), so a new sink is its file plus the arm
//! that builds it from its config in `Notifier::with_kinds`.
//!
//! Owns too the [`SinkKind`] trait: a webhook's format (its id, the secrets
//! it cannot deliver without, what it sends for an action event, and its
//! body), one file each (`json`, `slack`, `pagerduty`); a new format is its
//! file plus one arm in `kinds::kind` (and its `WebhookFormat` variant in
//! the config). This file names none of its implementors (no import of a
//! sink's or kind's file: they import it). A sink or kind must never write
//! a URL or secret into a log, never read the clock for alert times (`now`
//! comes with the change) and never block an update.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use super::format::Rendered;
use super::links::Links;
use super::{Notification, Shared, SinkSecrets};
use crate::config::WebhookConfig;
use crate::decide::incidents::Grouped;
use crate::events::{ActionEvent, DedupKey, EventKind};

/// What the notifier hands every sink.
pub(super) enum Change<'a> {
    /// An update: the incidents that hold and this turn's action events.
    Alerts(&'a AlertChange<'a>),
    /// A sweep succeeded (the heartbeats' one signal).
    Swept,
}

/// The incidents holding at `now` and this turn's events, with what the
/// notifier judged of them before any sink sees them.
pub(super) struct AlertChange<'a> {
    pub(super) current: &'a BTreeMap<DedupKey, Grouped>,
    /// Incidents no sink may trigger, update, repeat or resolve now (the
    /// freshness rule, `decide::voice::Spoken::frozen`): holding or gone, drawn
    /// from a view older than `alerts.stale_after`.
    pub(super) frozen: &'a BTreeSet<DedupKey>,
    /// Until when each holding incident may be asserted (absent: not at all).
    pub(super) until: &'a BTreeMap<DedupKey, DateTime<Utc>>,
    pub(super) events: &'a [ActionEvent],
    pub(super) links: &'a Links,
    pub(super) now: DateTime<Utc>,
    /// Notifications a queue may hold.
    pub(super) capacity: usize,
}

/// How one attempt of a sink's request ended.
#[derive(Debug)]
pub(super) enum Attempt {
    /// A 2xx answer.
    Delivered { status: u16 },
    /// A transport error or timeout (`status: None`), or any other answer.
    Failed { error: String, status: Option<u16> },
    /// The shutdown flush deadline passed first: not the receiver's fault.
    Interrupted,
}

/// What the delivery path does after an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Then {
    /// Go on with whatever is due next.
    Next,
    /// Pause `retry_interval`, then ask again (the same request, usually).
    Retry,
}

/// One configured sink, as the notifier's one delivery path drives it.
pub(super) trait Sink: Send + Sync {
    /// What it asks to be delivered: a queued notification, a batch, a ping.
    type Request: Send + Sync;

    /// Its kind's name in the logs and metrics.
    fn id(&self) -> &'static str;

    /// Woken when something is due.
    fn wake(&self) -> &tokio::sync::Notify;

    /// Takes a change and decides what this sink is owed for it; true when
    /// a request is now due. Never waits on the network or the disk.
    fn take(&self, change: &Change<'_>) -> bool;

    /// The request due next, if any.
    fn next(&self) -> Option<Self::Request>;

    /// The HTTP request for `r`; `unix_now` is this attempt's time.
    fn request(
        &self,
        http: &reqwest::Client,
        r: &Self::Request,
        unix_now: i64,
    ) -> reqwest::RequestBuilder;

    /// Records how the attempt of `r` ended, at `now` (the delivery clock).
    fn settle(&self, r: &Self::Request, attempt: Attempt, now: DateTime<Utc>) -> Then;

    /// Whether what it settles belongs in the alert state file.
    fn keeps_state(&self) -> bool {
        true
    }

    /// Called once its loop ended (after the shutdown flush); `kept` when
    /// there is a state file to keep what is left.
    fn stopped(&self, _kept: bool) {}
}

/// A [`Sink`] of any request type, as the notifier holds them all.
pub(super) trait Driven: Send + Sync {
    fn id(&self) -> &'static str;
    fn take(&self, change: &Change<'_>) -> bool;
    fn notify(&self);
    fn deliver<'a>(&'a self, shared: &'a Shared, shutdown: CancellationToken) -> BoxFuture<'a, ()>;
}

impl<S: Sink> Driven for S {
    fn id(&self) -> &'static str {
        Sink::id(self)
    }

    fn take(&self, change: &Change<'_>) -> bool {
        Sink::take(self, change)
    }

    fn notify(&self) {
        self.wake().notify_one();
    }

    fn deliver<'a>(&'a self, shared: &'a Shared, shutdown: CancellationToken) -> BoxFuture<'a, ()> {
        Box::pin(shared.deliver(self, shutdown))
    }
}

/// What a webhook sends for one action event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnEvent {
    Skip,
    Send,
    /// Send it, and remember the failure until a success resolves it.
    OpenFailure,
    /// Send a resolve of the failure opened before.
    ResolveFailure,
}

/// One kind (format) of webhook sink.
pub(crate) trait SinkKind: Sync {
    /// Its name in the config, the logs, the metrics and the state file.
    fn id(&self) -> &'static str;

    /// The secret (besides the URL) it cannot deliver without, if missing.
    fn missing_secret(
        &self,
        _hook: &WebhookConfig,
        _secrets: &SinkSecrets,
    ) -> Option<&'static str> {
        None
    }

    /// What it sends for an action event of `kind`: `wanted` when at or
    /// above its `min_severity`, `failure_open` when this rotation's failure
    /// was sent and not yet resolved. By default every wanted event.
    fn on_event(&self, _kind: EventKind, wanted: bool, _failure_open: bool) -> OnEvent {
        if wanted { OnEvent::Send } else { OnEvent::Skip }
    }

    /// The request for `n`; `timestamp` (Unix seconds) is this attempt's time.
    fn render(&self, n: &Notification, secrets: &SinkSecrets, timestamp: i64) -> Rendered;
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use axum::body::Bytes;
    use axum::http::HeaderMap;
    use chrono::{TimeZone, Utc};
    use tokio_util::sync::CancellationToken;

    use super::super::format::Rendered;
    use super::super::{Notifier, NotifierOptions};
    use super::*;
    use crate::config::{AlertsConfig, GroupField, WebhookFormat};
    use crate::decide::alerts::{Alert, AlertKind};
    use crate::model::Severity;

    /// A kind added by this test alone: its file would hold just this. It
    /// needs a secret the config names, sends only failures of the action
    /// events, and its body is the summary.
    struct Echo;

    impl SinkKind for Echo {
        fn id(&self) -> &'static str {
            "echo"
        }

        fn missing_secret(&self, _: &WebhookConfig, s: &SinkSecrets) -> Option<&'static str> {
            s.hmac_secret.is_none().then_some("echo token")
        }

        fn render(&self, n: &Notification, _: &SinkSecrets, timestamp: i64) -> Rendered {
            Rendered {
                body: format!("{} {}", n.status.as_str(), n.summary).into_bytes(),
                headers: vec![("X-Echo-At", timestamp.to_string())],
            }
        }
    }

    /// The notifier's delivery loop in a task, and what stops it.
    fn running(notifier: &Notifier) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (notifier, stop) = (notifier.clone(), stop.clone());
            async move { notifier.run(stop).await }
        });
        (stop, task)
    }

    fn t0() -> chrono::DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 5, 1, 12, 0, 0).unwrap()
    }

    /// The alert both tests send: m1 of agents drifted, high.
    fn drift_m1() -> Alert {
        Alert {
            kind: AlertKind::Drift,
            app: Some("agents".into()),
            machine_id: Some("m1".into()),
            commit: None,
            severity: Severity::High,
            summary: "m1 is behind".into(),
            details: Default::default(),
        }
    }

    fn echo(_: WebhookFormat) -> &'static dyn SinkKind {
        &Echo
    }

    /// A new kind of sink rides the notifier's one queue, retry and state
    /// path with nothing but its `SinkKind`: triggered, then resolved, over
    /// real HTTP on loopback; and its own secret is checked at start.
    #[tokio::test]
    async fn a_sink_kind_added_by_a_test_alone_is_delivered_to() {
        let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let app = axum::Router::new().fallback({
            let seen = seen.clone();
            move |headers: HeaderMap, body: Bytes| async move {
                let at = headers
                    .get("X-Echo-At")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let body = String::from_utf8_lossy(&body).into_owned();
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((at, body));
                "ok"
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/echo", listener.local_addr().unwrap());
        let server = tokio::spawn(async move { axum::serve(listener, app).await });

        let hook = WebhookConfig {
            url_env: "ECHO_URL".into(),
            format: WebhookFormat::Json,
            routing_key_env: None,
            secret_env: None,
            min_severity: Severity::Low,
            repeat_interval: Duration::ZERO,
        };
        let config = AlertsConfig {
            webhooks: vec![hook],
            group_by: vec![GroupField::Machine],
            resolve_after: Duration::ZERO,
            ..AlertsConfig::default()
        };
        let secrets = |token: Option<&str>| SinkSecrets {
            url: url.clone().into(),
            routing_key: None,
            hmac_secret: token.map(Into::into),
        };
        let options = || NotifierOptions::default();
        let refused =
            Notifier::with_kinds(&config, vec![secrets(None)], vec![], None, options(), echo)
                .unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("echo token missing for format echo"),
            "{refused}"
        );

        let notifier = Notifier::with_kinds(
            &config,
            vec![secrets(Some("t"))],
            vec![],
            None,
            options(),
            echo,
        )
        .unwrap();
        let (stop, task) = running(&notifier);
        let (t0, alert) = (t0(), drift_m1());
        notifier.update(std::slice::from_ref(&alert), &[], t0);
        notifier.update(&[], &[], t0 + chrono::Duration::minutes(1));
        stop.cancel();
        task.await.unwrap();
        server.abort();

        let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let bodies: Vec<&str> = seen.iter().map(|(_, b)| b.as_str()).collect();
        assert_eq!(
            bodies,
            ["firing m1 is behind", "resolved Resolved: m1 is behind"]
        );
        assert!(
            seen.iter().all(|(at, _)| at.parse::<i64>().is_ok()),
            "{seen:?}"
        );
        assert_eq!(notifier.stats()[0].format, "echo");
        assert_eq!(notifier.stats()[0].delivered, 2);
    }

    /// A sink added by this test alone: its file would hold just this (and
    /// its config table an arm in `Notifier::with_kinds`, here
    /// `Notifier::adding`). It posts one line per change it is offered
    /// (the incidents and events of an update, or a successful sweep), in
    /// order, and asks for a retry when the receiver fails.
    struct Recorder {
        url: String,
        due: Mutex<std::collections::VecDeque<String>>,
        wake: tokio::sync::Notify,
    }

    impl Sink for Recorder {
        type Request = String;

        fn id(&self) -> &'static str {
            "recorder"
        }

        fn wake(&self) -> &tokio::sync::Notify {
            &self.wake
        }

        fn take(&self, change: &Change<'_>) -> bool {
            let line = match change {
                Change::Swept => "swept".to_owned(),
                Change::Alerts(c) => {
                    let kinds: Vec<&str> = c
                        .current
                        .values()
                        .map(|g| g.alert.kind.trigger_name())
                        .collect();
                    let events: Vec<&str> = c.events.iter().map(|e| e.kind.name()).collect();
                    format!("[{}] [{}]", kinds.join(","), events.join(","))
                }
            };
            self.due
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back(line);
            true
        }

        fn next(&self) -> Option<String> {
            self.due
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .front()
                .cloned()
        }

        fn request(&self, http: &reqwest::Client, r: &String, _: i64) -> reqwest::RequestBuilder {
            http.post(&self.url).body(r.clone())
        }

        fn settle(&self, _: &String, attempt: Attempt, _: chrono::DateTime<Utc>) -> Then {
            match attempt {
                Attempt::Delivered { .. } => {
                    self.due
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .pop_front();
                    Then::Next
                }
                Attempt::Failed { .. } => Then::Retry,
                Attempt::Interrupted => Then::Next,
            }
        }

        fn keeps_state(&self) -> bool {
            false
        }
    }

    /// A new sink rides the notifier's one delivery path with nothing but
    /// its `Sink` impl: it is offered every update and every successful
    /// sweep, its requests go out in order over real HTTP on loopback, and
    /// a failed attempt is retried after `retry_interval`.
    #[tokio::test]
    async fn a_sink_added_by_a_test_alone_is_offered_every_change_and_retried() {
        let got: Arc<Mutex<Vec<(u16, String)>>> = Arc::default();
        let app = axum::Router::new().fallback({
            let got = got.clone();
            move |body: Bytes| async move {
                let mut got = got.lock().unwrap_or_else(|e| e.into_inner());
                // The receiver's first answer is an outage.
                let status = if got.is_empty() { 503 } else { 200 };
                got.push((status, String::from_utf8_lossy(&body).into_owned()));
                axum::http::StatusCode::from_u16(status).unwrap()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/rec", listener.local_addr().unwrap());
        let server = tokio::spawn(async move { axum::serve(listener, app).await });

        let config = AlertsConfig {
            group_by: vec![GroupField::Machine],
            resolve_after: Duration::ZERO,
            ..AlertsConfig::default()
        };
        let options = NotifierOptions {
            retry_interval: Duration::from_millis(50),
            ..NotifierOptions::default()
        };
        let recorder = Arc::new(Recorder {
            url,
            due: Mutex::default(),
            wake: tokio::sync::Notify::new(),
        });
        let notifier = Notifier::with_sinks(&config, vec![], vec![], options)
            .unwrap()
            .adding(recorder.clone());
        let (stop, task) = running(&notifier);
        let (t0, alert) = (t0(), drift_m1());
        notifier.update(std::slice::from_ref(&alert), &[], t0);
        notifier.swept();
        notifier.update(&[], &[], t0 + chrono::Duration::minutes(1));
        for _ in 0..200 {
            if recorder.next().is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.cancel();
        task.await.unwrap();
        server.abort();

        let got = got.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let first = "[drift_detected] []".to_owned();
        assert_eq!(
            got,
            [
                (503, first.clone()),
                (200, first),
                (200, "swept".to_owned()),
                (200, "[] []".to_owned()),
            ]
        );
        assert!(format!("{notifier:?}").contains("recorder"), "{notifier:?}");
    }
}

//! What a kind of webhook sink is, and which kind each configured format is.
//!
//! Owns the [`SinkKind`] trait: a sink's id, the secrets it cannot deliver
//! without, what it sends for an action event, and its request. Each kind is
//! one file (`json`, `slack`, `pagerduty`); the queue, retries, dead letters
//! and the state file are the notifier's, one path for every kind. A new
//! kind is its file plus one arm in [`kind`] (and its `WebhookFormat`
//! variant in the config). A kind must never see the URL or do I/O.

use super::format::Rendered;
use super::json::Json;
use super::pagerduty::Pagerduty;
use super::slack::Slack;
use super::{Notification, SinkSecrets};
use crate::config::{WebhookConfig, WebhookFormat};
use crate::events::EventKind;

/// What a sink sends for one action event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnEvent {
    Skip,
    Send,
    /// Send it, and remember the failure until a success resolves it.
    OpenFailure,
    /// Send a resolve of the failure opened before.
    ResolveFailure,
}

/// One kind of webhook sink.
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

/// The kind of sink a configured format is.
pub(crate) fn kind(format: WebhookFormat) -> &'static dyn SinkKind {
    match format {
        WebhookFormat::Json => &Json,
        WebhookFormat::Slack => &Slack,
        WebhookFormat::Pagerduty => &Pagerduty,
    }
}

/// The name a format has in the config and in logs.
pub fn format_name(format: WebhookFormat) -> &'static str {
    kind(format).id()
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
    use crate::config::{AlertsConfig, GroupField};
    use crate::events::{Alert, AlertKind};
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
        let refused = Notifier::with_kinds(&config, vec![secrets(None)], vec![], options(), echo)
            .unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("echo token missing for format echo"),
            "{refused}"
        );

        let notifier =
            Notifier::with_kinds(&config, vec![secrets(Some("t"))], vec![], options(), echo)
                .unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (notifier, stop) = (notifier.clone(), stop.clone());
            async move { notifier.run(stop).await }
        });
        let t0 = Utc.with_ymd_and_hms(2026, 5, 1, 12, 0, 0).unwrap();
        let alert = Alert {
            kind: AlertKind::Drift,
            app: Some("agents".into()),
            machine_id: Some("m1".into()),
            commit: None,
            severity: Severity::High,
            summary: "m1 is behind".into(),
            details: Default::default(),
        };
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
}

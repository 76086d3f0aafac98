//! What every webhook sink's request is made of: the rendered request and
//! the helpers the sinks' bodies share (truncation, times, links).
//!
//! Each sink's own wire shape is in its file (`json`, `slack`,
//! `pagerduty`, documented in `docs/alerts.md`). Nothing here sees a webhook
//! URL or a secret, or does I/O.

use chrono::SecondsFormat;
use serde::Serialize;

use super::Notification;
use super::links::{MACHINE_URL, RUNBOOK_URL, STATUS_URL};

/// A rendered request: the exact body bytes and the sink's own headers.
pub(crate) struct Rendered {
    pub body: Vec<u8>,
    /// Headers beyond `Content-Type: application/json`, in order.
    pub headers: Vec<(&'static str, String)>,
}

pub(super) fn to_vec<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain structs (strings, maps with string keys) cannot fail.
    serde_json::to_vec(value).expect("webhook bodies are plain JSON")
}

pub(super) fn rfc3339(n: &Notification) -> String {
    n.at.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// Cuts `s` to at most `max` characters, marking the cut with `…`.
pub(super) fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// The links of a notification, as `(text, URL)`, in the order shown.
pub(super) fn links(n: &Notification) -> Vec<(&'static str, &str)> {
    [
        ("Runbook", RUNBOOK_URL),
        ("Status page", STATUS_URL),
        ("Machine page", MACHINE_URL),
    ]
    .into_iter()
    .filter_map(|(text, key)| n.details.get(key).map(|url| (text, url.as_str())))
    .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;

    use chrono::TimeZone;
    use hmac::{Hmac, Mac};
    use sha2::Sha256;

    use super::super::pagerduty::{
        PAGERDUTY_DEDUP_KEY_MAX, PAGERDUTY_SUMMARY_MAX, pagerduty_dedup_key,
    };
    use super::super::{SinkSecrets, Status, json::sign, kinds};
    use super::*;
    use crate::config::WebhookFormat;
    use crate::events::DedupKey;
    use crate::model::Severity;

    /// `n` as a sink of `format` with these secrets renders it.
    pub(crate) fn render(
        format: WebhookFormat,
        n: &Notification,
        routing_key: Option<&str>,
        hmac_secret: Option<&str>,
        timestamp: i64,
    ) -> Rendered {
        let secrets = SinkSecrets {
            url: "http://127.0.0.1/".into(),
            routing_key: routing_key.map(Into::into),
            hmac_secret: hmac_secret.map(Into::into),
        };
        kinds::kind(format).render(n, &secrets, timestamp)
    }

    /// The signature's `(timestamp, signature)` headers, if signed.
    fn signature(r: &Rendered) -> Option<(String, String)> {
        match r.headers.as_slice() {
            [] => None,
            [
                (super::super::TIMESTAMP_HEADER, ts),
                (super::super::SIGNATURE_HEADER, sig),
            ] => Some((ts.clone(), sig.clone())),
            other => panic!("unexpected headers {other:?}"),
        }
    }

    fn notification(status: Status) -> Notification {
        Notification {
            status,
            event: "drift_detected".into(),
            repeat: false,
            update: false,
            dedup_key: DedupKey::new("fleet-reconciler/drift_detected/agents/m1/abc".into()),
            app: Some("agents".into()),
            machine_id: Some("m1".into()),
            commit: crate::model::CommitId::parse("0123456789abcdef0123456789abcdef01234567"),
            severity: Severity::High,
            summary: "m1 is <3> commits & behind".into(),
            details: BTreeMap::from([("commits_behind".into(), "3".into())]),
            at: chrono::Utc.with_ymd_and_hms(2026, 5, 1, 12, 0, 0).unwrap(),
        }
    }

    fn json(bytes: &[u8]) -> serde_json::Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn truncation_counts_characters_not_bytes() {
        assert_eq!(truncate("héllo", 5), "héllo");
        assert_eq!(truncate("héllo wörld", 5), "héll…");
        assert_eq!(truncate(&"é".repeat(2000), 1024).chars().count(), 1024);
    }

    #[test]
    fn long_pagerduty_keys_are_digested_stably() {
        let short = "fleet-reconciler/tip_stale/*/*/*";
        assert_eq!(pagerduty_dedup_key(short), short);
        let long = format!("fleet-reconciler/drift_detected/{}/m/c", "a".repeat(300));
        let k = pagerduty_dedup_key(&long);
        assert!(k.len() <= PAGERDUTY_DEDUP_KEY_MAX);
        assert_eq!(k, pagerduty_dedup_key(&long));
        assert_ne!(k, pagerduty_dedup_key(&format!("{long}x")));
    }

    #[test]
    fn slack_escapes_control_characters() {
        let r = render(
            WebhookFormat::Slack,
            &notification(Status::Firing),
            None,
            None,
            0,
        );
        let v = json(&r.body);
        let text = v["text"].as_str().unwrap();
        assert!(text.contains("&lt;3&gt; commits &amp; behind"), "{text}");
        assert!(!text.contains('<'));
        assert_eq!(v["blocks"][1]["fields"][3]["text"], "*Commit*\n`0123456`");
        assert!(signature(&r).is_none());
    }

    #[test]
    fn pagerduty_summary_is_capped() {
        let mut n = notification(Status::Firing);
        n.summary = "x".repeat(5000);
        let v = json(&render(WebhookFormat::Pagerduty, &n, Some("rk"), None, 0).body);
        let summary = v["payload"]["summary"].as_str().unwrap();
        assert_eq!(summary.chars().count(), PAGERDUTY_SUMMARY_MAX);
    }

    #[test]
    fn fleet_wide_alerts_have_no_component_or_group() {
        let mut n = notification(Status::Firing);
        n.app = None;
        n.machine_id = None;
        let v = json(&render(WebhookFormat::Pagerduty, &n, Some("rk"), None, 0).body);
        assert_eq!(v["payload"]["source"], "fleet-reconciler");
        assert!(v["payload"].get("component").is_none());
        assert!(v["payload"].get("group").is_none());
    }

    #[test]
    fn signature_covers_the_timestamp_and_the_exact_body() {
        let n = notification(Status::Firing);
        let r = render(WebhookFormat::Json, &n, None, Some("s3cret"), 1_777_000_000);
        let (ts, sig) = signature(&r).unwrap();
        assert_eq!(ts, "1777000000");
        assert_eq!(sig, sign(b"s3cret", 1_777_000_000, &r.body));
        assert!(sig.starts_with("sha256=") && sig.len() == 7 + 64);
        // The signed message is `<timestamp>.<body>`.
        let mut mac = Hmac::<Sha256>::new_from_slice(b"s3cret").unwrap();
        mac.update(format!("{ts}.").as_bytes());
        mac.update(&r.body);
        assert_eq!(
            sig,
            format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
        );
        let mut tampered = r.body.clone();
        tampered.push(b' ');
        assert_ne!(sign(b"s3cret", 1_777_000_000, &tampered), sig);
        assert_ne!(
            sign(b"s3cret", 1_777_000_001, &r.body),
            sig,
            "a replay with a new timestamp"
        );
        // Slack and PagerDuty are never signed.
        assert!(signature(&render(WebhookFormat::Slack, &n, None, Some("s3cret"), 0)).is_none());
    }
}

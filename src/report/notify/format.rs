//! Request bodies of the three webhook formats: generic JSON, Slack, PagerDuty Events v2.
//!
//! Owns the wire shapes (documented in `docs/alerts.md`) and the JSON
//! signature. It must never see a webhook URL: the only secrets it touches are
//! the PagerDuty routing key (a required body field) and the HMAC secret
//! (used, never written), and it never does I/O.

use std::collections::BTreeMap;

use chrono::SecondsFormat;
use hmac::{Hmac, Mac};
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::links::{MACHINE_URL, RUNBOOK_URL, STATUS_URL};
use super::{Notification, Status};
use crate::config::WebhookFormat;
use crate::model::{AppName, CommitId, MachineId, Severity};

/// Version of the generic JSON schema; bumped on an incompatible change.
pub const JSON_SCHEMA_VERSION: u32 = 1;

/// Header carrying `sha256=<hex HMAC-SHA256 of "<timestamp>.<body>">` on
/// signed JSON deliveries.
pub const SIGNATURE_HEADER: &str = "X-Fleet-Signature";

/// Header carrying the signed timestamp (Unix seconds of the attempt) on
/// signed JSON deliveries; receivers refuse a signature older than
/// [`SIGNATURE_MAX_AGE`], so a captured request cannot be replayed later.
pub const TIMESTAMP_HEADER: &str = "X-Fleet-Timestamp";

/// The age (either way) past which receivers should refuse a signed request.
pub const SIGNATURE_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(300);

/// PagerDuty rejects a `payload.summary` longer than this (characters).
pub const PAGERDUTY_SUMMARY_MAX: usize = 1024;

/// PagerDuty rejects a `dedup_key` longer than this.
pub const PAGERDUTY_DEDUP_KEY_MAX: usize = 255;

/// Slack's limit on a header block's text.
const SLACK_HEADER_MAX: usize = 150;
/// Slack's limit on a section's text (we stay well under its 3000).
const SLACK_SECTION_MAX: usize = 2900;

/// A rendered request: the exact body bytes and, when signed, the values of
/// the timestamp and signature headers.
pub(super) struct Rendered {
    pub body: Vec<u8>,
    pub signature: Option<(String, String)>,
}

/// Renders `n` for a sink of `format`; `routing_key` (pagerduty) and
/// `hmac_secret` (json) come from the sink's secrets, `timestamp` (Unix
/// seconds) is the time of this attempt.
pub(super) fn render(
    format: WebhookFormat,
    n: &Notification,
    routing_key: Option<&str>,
    hmac_secret: Option<&str>,
    timestamp: i64,
) -> Rendered {
    let body = match format {
        WebhookFormat::Json => to_vec(&json_body(n)),
        WebhookFormat::Slack => to_vec(&slack_body(n)),
        WebhookFormat::Pagerduty => pagerduty_body(n, routing_key.unwrap_or_default()),
    };
    let signature = match (format, hmac_secret) {
        (WebhookFormat::Json, Some(secret)) => Some((
            timestamp.to_string(),
            sign(secret.as_bytes(), timestamp, &body),
        )),
        _ => None,
    };
    Rendered { body, signature }
}

fn to_vec<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain structs (strings, maps with string keys) cannot fail.
    serde_json::to_vec(value).expect("webhook bodies are plain JSON")
}

/// `sha256=<lowercase hex HMAC-SHA256(secret, "<timestamp>.<body>")>`: the
/// decimal timestamp, a dot, then the exact body bytes.
pub fn sign(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

/// The name a format has in the config and in logs.
pub fn format_name(format: WebhookFormat) -> &'static str {
    match format {
        WebhookFormat::Json => "json",
        WebhookFormat::Slack => "slack",
        WebhookFormat::Pagerduty => "pagerduty",
    }
}

fn rfc3339(n: &Notification) -> String {
    n.at.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// Cuts `s` to at most `max` characters, marking the cut with `…`.
fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

// ---------------------------------------------------------------- json

#[derive(Serialize)]
struct JsonBody<'a> {
    version: u32,
    event: &'a str,
    status: &'a str,
    repeat: bool,
    update: bool,
    dedup_key: &'a str,
    app: Option<&'a str>,
    machine_id: Option<&'a str>,
    commit: Option<&'a str>,
    severity: Severity,
    summary: &'a str,
    details: &'a BTreeMap<String, String>,
    at: String,
}

fn json_body(n: &Notification) -> JsonBody<'_> {
    JsonBody {
        version: JSON_SCHEMA_VERSION,
        event: &n.event,
        status: n.status.as_str(),
        repeat: n.repeat,
        update: n.update,
        dedup_key: n.dedup_key.as_str(),
        app: n.app.as_ref().map(AppName::as_str),
        machine_id: n.machine_id.as_ref().map(MachineId::as_str),
        commit: n.commit.as_ref().map(CommitId::as_str),
        severity: n.severity,
        summary: &n.summary,
        details: &n.details,
        at: rfc3339(n),
    }
}

// ---------------------------------------------------------------- slack

#[derive(Serialize)]
struct SlackBody {
    /// Fallback for notifications and clients that do not render blocks.
    text: String,
    blocks: Vec<SlackBlock>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum SlackBlock {
    Header {
        text: SlackText,
    },
    Section {
        text: SlackText,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        fields: Vec<SlackText>,
    },
    Context {
        elements: Vec<SlackText>,
    },
}

#[derive(Serialize)]
#[serde(tag = "type")]
enum SlackText {
    #[serde(rename = "plain_text")]
    Plain { text: String },
    #[serde(rename = "mrkdwn")]
    Mrkdwn { text: String },
}

/// Slack's mrkdwn treats `&`, `<` and `>` as control characters.
fn slack_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn status_label(status: Status) -> &'static str {
    match status {
        Status::Firing => "FIRING",
        Status::Resolved => "RESOLVED",
        Status::Event => "EVENT",
    }
}

/// The first 7 characters of a commit id (the whole value if shorter).
fn short_commit(commit: &str) -> &str {
    commit.get(..7).unwrap_or(commit)
}

fn slack_body(n: &Notification) -> SlackBody {
    let label = status_label(n.status);
    let repeat = match (n.repeat, n.update) {
        (true, _) => " (repeat)",
        (_, true) => " (updated)",
        _ => "",
    };
    let target = match (&n.app, &n.machine_id) {
        (Some(app), Some(m)) => format!(" [{app}/{m}]"),
        (Some(app), None) => format!(" [{app}]"),
        _ => String::new(),
    };
    let text = slack_escape(&truncate(
        &format!(
            "{label} {} {}{repeat}{target}: {}",
            n.severity, n.event, n.summary
        ),
        SLACK_SECTION_MAX,
    ));
    let dash = || "—".to_owned();
    let field = |name: &str, value: String| SlackText::Mrkdwn {
        text: format!("*{name}*\n{}", slack_escape(&value)),
    };
    let commit = n
        .commit
        .as_ref()
        .map(|c| format!("`{}`", short_commit(c.as_str())))
        .unwrap_or_else(dash);
    SlackBody {
        text,
        blocks: vec![
            SlackBlock::Header {
                text: SlackText::Plain {
                    text: truncate(&format!("{label}: {}{repeat}", n.event), SLACK_HEADER_MAX),
                },
            },
            SlackBlock::Section {
                text: SlackText::Mrkdwn {
                    text: slack_escape(&truncate(&n.summary, SLACK_SECTION_MAX)),
                },
                fields: vec![
                    field("App", n.app.as_ref().map_or_else(dash, AppName::to_string)),
                    field(
                        "Machine",
                        n.machine_id
                            .as_ref()
                            .map_or_else(dash, MachineId::to_string),
                    ),
                    field("Severity", n.severity.to_string()),
                    // Backticks are not escaped: the value is a hex commit id.
                    SlackText::Mrkdwn {
                        text: format!("*Commit*\n{commit}"),
                    },
                ],
            },
            SlackBlock::Context {
                elements: slack_links(n)
                    .into_iter()
                    .chain([SlackText::Mrkdwn {
                        text: slack_escape(&format!("{} · {}", n.dedup_key, rfc3339(n))),
                    }])
                    .collect(),
            },
        ],
    }
}

/// The links of a notification, as `(text, URL)`, in the order shown.
fn links(n: &Notification) -> Vec<(&'static str, &str)> {
    [
        ("Runbook", RUNBOOK_URL),
        ("Status page", STATUS_URL),
        ("Machine page", MACHINE_URL),
    ]
    .into_iter()
    .filter_map(|(text, key)| n.details.get(key).map(|url| (text, url.as_str())))
    .collect()
}

/// Slack links `<url|text>`; a URL with `|`, `<` or `>` (never from our
/// config checks, but be safe) is shown as text instead.
fn slack_links(n: &Notification) -> Vec<SlackText> {
    let shown: Vec<String> = links(n)
        .into_iter()
        .map(|(text, url)| {
            if url.contains(['|', '<', '>']) {
                format!("{text}: {}", slack_escape(url))
            } else {
                format!("<{}|{text}>", url.replace('&', "&amp;"))
            }
        })
        .collect();
    if shown.is_empty() {
        return Vec::new();
    }
    vec![SlackText::Mrkdwn {
        text: shown.join(" · "),
    }]
}

// ---------------------------------------------------------------- pagerduty

#[derive(Serialize)]
struct PagerdutyTrigger<'a> {
    routing_key: &'a str,
    event_action: &'static str,
    dedup_key: String,
    client: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    client_url: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    links: Vec<PagerdutyLink<'a>>,
    payload: PagerdutyPayload<'a>,
}

#[derive(Serialize)]
struct PagerdutyLink<'a> {
    href: &'a str,
    text: &'static str,
}

#[derive(Serialize)]
struct PagerdutyPayload<'a> {
    summary: String,
    severity: &'static str,
    source: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    component: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    group: Option<&'a str>,
    class: &'a str,
    timestamp: String,
    custom_details: BTreeMap<String, String>,
}

#[derive(Serialize)]
struct PagerdutyResolve<'a> {
    routing_key: &'a str,
    event_action: &'static str,
    dedup_key: String,
}

/// Our levels in PagerDuty's vocabulary.
pub fn pagerduty_severity(severity: Severity) -> &'static str {
    match severity {
        Severity::Critical => "critical",
        Severity::High => "error",
        Severity::Medium => "warning",
        Severity::Low => "info",
    }
}

/// The dedup key as PagerDuty gets it: ours, or a digest of it when it would
/// exceed PagerDuty's limit (still stable, still identity-only).
pub fn pagerduty_dedup_key(key: &str) -> String {
    if key.len() <= PAGERDUTY_DEDUP_KEY_MAX {
        key.to_owned()
    } else {
        format!(
            "fleet-reconciler/sha256/{}",
            hex::encode(Sha256::digest(key))
        )
    }
}

fn pagerduty_body(n: &Notification, routing_key: &str) -> Vec<u8> {
    let dedup_key = pagerduty_dedup_key(n.dedup_key.as_str());
    if n.status == Status::Resolved {
        return to_vec(&PagerdutyResolve {
            routing_key,
            event_action: "resolve",
            dedup_key,
        });
    }
    let mut custom_details = n.details.clone();
    let identity = [
        ("event", Some(n.event.as_str())),
        ("status", Some(n.status.as_str())),
        ("app", n.app.as_ref().map(AppName::as_str)),
        ("machine_id", n.machine_id.as_ref().map(MachineId::as_str)),
        ("commit", n.commit.as_ref().map(CommitId::as_str)),
        ("severity", Some(n.severity.as_str())),
    ];
    for (k, v) in identity {
        if let Some(v) = v {
            custom_details.insert(k.to_owned(), v.to_owned());
        }
    }
    if n.repeat {
        custom_details.insert("repeat".to_owned(), "true".to_owned());
    }
    if n.update {
        custom_details.insert("update".to_owned(), "true".to_owned());
    }
    to_vec(&PagerdutyTrigger {
        routing_key,
        event_action: "trigger",
        dedup_key,
        client: "fleet-reconciler",
        client_url: n.details.get(STATUS_URL).map(String::as_str),
        links: links(n)
            .into_iter()
            .map(|(text, href)| PagerdutyLink { href, text })
            .collect(),
        payload: PagerdutyPayload {
            summary: truncate(&n.summary, PAGERDUTY_SUMMARY_MAX),
            severity: pagerduty_severity(n.severity),
            source: match &n.app {
                Some(app) => format!("fleet-reconciler/{app}"),
                None => "fleet-reconciler".to_owned(),
            },
            component: n.machine_id.as_ref().map(MachineId::as_str),
            group: n.app.as_ref().map(AppName::as_str),
            class: &n.event,
            timestamp: rfc3339(n),
            custom_details,
        },
    })
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;
    use crate::events::DedupKey;

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
        assert!(r.signature.is_none());
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
        let (ts, sig) = r.signature.unwrap();
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
        assert!(
            render(WebhookFormat::Slack, &n, None, Some("s3cret"), 0)
                .signature
                .is_none()
        );
    }
}

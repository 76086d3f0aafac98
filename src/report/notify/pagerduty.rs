//! The PagerDuty Events v2 sink: what pages (alerts, and of the action
//! events only failures, resolved by the rotation's success, and calls that
//! may have gone unfenced), and its trigger and resolve bodies.
//!
//! Owns the PagerDuty wire shape (documented in `docs/alerts.md`). The only
//! secret it touches is the routing key (a required body field); it never
//! sees the URL and never does I/O.

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

use serde::Serialize;

use super::format::{Rendered, links, rfc3339, to_vec, truncate};
use super::links::STATUS_URL;
use super::sink::OnEvent;
use super::sink::SinkKind;
use super::{Notification, SinkSecrets, Status, exposed};
use crate::config::WebhookConfig;
use crate::events::EventKind;
use crate::model::{AppName, CommitId, MachineId, Severity};

/// PagerDuty rejects a `payload.summary` longer than this (characters).
pub const PAGERDUTY_SUMMARY_MAX: usize = 1024;

/// PagerDuty rejects a `dedup_key` longer than this.
pub const PAGERDUTY_DEDUP_KEY_MAX: usize = 255;

/// The `pagerduty` format.
pub(super) struct Pagerduty;

impl SinkKind for Pagerduty {
    fn id(&self) -> &'static str {
        "pagerduty"
    }

    fn missing_secret(&self, _: &WebhookConfig, secrets: &SinkSecrets) -> Option<&'static str> {
        exposed(&secrets.routing_key)
            .is_none_or(str::is_empty)
            .then_some("routing key")
    }

    fn on_event(&self, kind: EventKind, wanted: bool, failure_open: bool) -> OnEvent {
        // PagerDuty pages: only failures, resolved by the rotation's success
        // (whatever its severity: the resolve follows the trigger), and
        // calls that may have gone unfenced.
        match kind {
            EventKind::ActionFailed if wanted => OnEvent::OpenFailure,
            EventKind::ActionSucceeded if failure_open => OnEvent::ResolveFailure,
            // Nothing of ours resolves it: a human looks, then resolves.
            EventKind::ActionUnfenced if wanted => OnEvent::Send,
            EventKind::ActionFailed
            | EventKind::ActionSucceeded
            | EventKind::ActionStarted
            | EventKind::ActionUnfenced => OnEvent::Skip,
        }
    }

    fn render(&self, n: &Notification, secrets: &SinkSecrets, _: i64) -> Rendered {
        Rendered {
            body: pagerduty_body(n, exposed(&secrets.routing_key).unwrap_or_default()),
            headers: Vec::new(),
        }
    }
}

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

pub(super) fn pagerduty_body(n: &Notification, routing_key: &str) -> Vec<u8> {
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

//! The generic JSON webhook sink: its body (schema version
//! [`JSON_SCHEMA_VERSION`]) and its timestamped HMAC signature.
//!
//! Owns the JSON wire shape (documented in `docs/alerts.md`). The only secret
//! it touches is the HMAC secret (used, never written); it never sees the URL
//! and never does I/O.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::collections::BTreeMap;

use serde::Serialize;

use super::format::{Rendered, rfc3339, to_vec};
use super::sink::SinkKind;
use super::{Notification, SinkSecrets, exposed};
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

/// The `json` format.
pub(super) struct Json;

impl SinkKind for Json {
    fn id(&self) -> &'static str {
        "json"
    }

    fn render(&self, n: &Notification, secrets: &SinkSecrets, timestamp: i64) -> Rendered {
        let body = to_vec(&json_body(n));
        let headers = match exposed(&secrets.hmac_secret) {
            Some(secret) => vec![
                (TIMESTAMP_HEADER, timestamp.to_string()),
                (SIGNATURE_HEADER, sign(secret.as_bytes(), timestamp, &body)),
            ],
            None => Vec::new(),
        };
        Rendered { body, headers }
    }
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

#[derive(Serialize)]
pub(super) struct JsonBody<'a> {
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

pub(super) fn json_body(n: &Notification) -> JsonBody<'_> {
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

//! The probe-failure record: when a machine's agent stopped giving usable
//! reports, and the drift it last showed, kept in its metadata under
//! [`UNPROBED_KEY`](super::UNPROBED_KEY).
//!
//! Owns the record's format and parse. The planner plans writing and
//! clearing it and `act::executor` writes it. It is the only evidence the
//! probe-failure ceiling counts, shared by every replica: one that gets a
//! usable report clears it, so a replica cut off from the agents cannot
//! restart work another one sees. Its `since` is its writer's clock: a
//! reader counts from the later of it and its own first sight of the
//! record. A replica clears it by writing a [`Cleared`] naming it, so a
//! record deleted by anyone else is told apart (and still counts). It must
//! never do I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::model::{PolicyAction, Severity};

/// Probe-failure evidence, persisted under [`UNPROBED_KEY`](super::UNPROBED_KEY).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unprobed {
    /// First sweep without a usable report (unreachable or bad report), on
    /// its writer's clock.
    pub since: DateTime<Utc>,
    /// What the pool's policy said about the drift last seen.
    pub action: PolicyAction,
    pub severity: Severity,
}

impl Unprobed {
    pub fn parse(value: &str) -> Option<Unprobed> {
        serde_json::from_str(value).ok()
    }

    pub fn to_value(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Which record this is (the first 8 bytes of the SHA-256 of its value,
    /// in hex): a [`Cleared`] names the record it clears.
    pub fn fingerprint(&self) -> String {
        super::value_fingerprint(&self.to_value())
    }
}

/// What a replica that gets a usable report writes in place of the record
/// (sealed, like the record): which record it cleared. A record that
/// vanishes without one naming it was deleted by someone else (an agent can
/// write its app's metadata), and still counts (docs/safety.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cleared {
    /// The [`Unprobed::fingerprint`] of the record cleared.
    pub cleared: String,
}

impl Cleared {
    pub fn parse(value: &str) -> Option<Cleared> {
        serde_json::from_str(value).ok()
    }

    pub fn to_value(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

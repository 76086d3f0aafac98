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
//! record. It must never do I/O.

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
}

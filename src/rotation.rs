//! The rotation marker: a rotation's state, persisted in Fly machine metadata.
//!
//! Owns the marker's format (JSON under `fleet_reconciler_rotation`) and the
//! claim ranking. Because the marker lives on the machine, a restarted
//! reconciler (or another replica) resumes each rotation where it stood, and
//! its clocks continue from the recorded timestamps. It must never do I/O.
//!
//! # Claims and pool caps across replicas
//!
//! A claim is "write the marker, then re-read the pool's markers": of any two
//! claimants, the later writer always sees the earlier one. Claims are ranked
//! by `(started_at, machine_id)` and only the first `cap` proceed. Ranking
//! alone is not enough when a claimant's timestamp is older than a write it
//! did not see, so the executor adds two rules: a claim whose write took
//! longer than half the settle window backs off, and the re-read happens a
//! full settle window after the claim's timestamp. Then every claim ranked
//! before ours had landed before our re-read, and all claimants agree.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::model::{PolicyAction, Severity};

/// Where a rotation stands (DESIGN §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Slot claimed, machine cordoned (and drain requested): waiting for a
    /// natural stop point, or for `restart_grace` under `restart`.
    Draining,
    /// Asked a `reload`-capable agent to load the tip in place.
    Reloading,
    /// Restart requested; waiting for the machine to start and report the
    /// tip within `verify_deadline` (shown as `verifying` once started).
    Restarting,
    /// Verify failed: the machine stays cordoned until `retry_at`.
    Backoff,
    /// Hit a ceiling: uncordoned, slot released, retried after `retry_at`.
    Yielded,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Draining => "draining",
            Phase::Reloading => "reloading",
            Phase::Restarting => "restarting",
            Phase::Backoff => "backoff",
            Phase::Yielded => "yielded",
        }
    }

    /// Whether the rotation holds one of its pool's slots.
    pub fn holds_slot(self) -> bool {
        !matches!(self, Phase::Yielded)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the restart of this rotation is authorized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RotationMode {
    /// Only at a fresh report with no live work (`alert-and-wait`, `approve --when-idle`).
    Wait,
    /// Like `Wait`, but after `restart_grace` restart anyway (`restart`).
    Grace,
    /// Restart at once (`approve`, or an agent unreachable past the ceiling).
    Now,
    /// Ask the agent to reload in place; fall back to `Wait`.
    Reload,
}

impl RotationMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RotationMode::Wait => "wait",
            RotationMode::Grace => "grace",
            RotationMode::Now => "now",
            RotationMode::Reload => "reload",
        }
    }
}

/// The persisted state of one rotation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// Identifies this rotation to a cooperating agent (drain/undrain).
    pub tag: String,
    /// The commit the machine is being rotated to (the tip when claimed).
    pub target: String,
    pub phase: Phase,
    pub mode: RotationMode,
    /// The pool policy's action that started it (for reports and events).
    pub action: PolicyAction,
    pub severity: Severity,
    /// When the slot was claimed; ranks claims.
    pub started_at: DateTime<Utc>,
    /// When the current attempt (drain, reload, restart) began; deadlines count from here.
    pub attempt_started_at: DateTime<Utc>,
    /// Verify failures so far (drives the capped backoff).
    #[serde(default)]
    pub attempt: u32,
    /// The reconciler instance that claimed it.
    pub owner: String,
    /// When the restart was requested (phase `restarting`).
    #[serde(default)]
    pub restart_at: Option<DateTime<Utc>>,
    /// When a yielded or backed-off rotation may try again.
    #[serde(default)]
    pub retry_at: Option<DateTime<Utc>>,
    /// Whether a drain was requested from a cooperating agent.
    #[serde(default)]
    pub drain_requested: bool,
}

impl Marker {
    /// Parses a metadata value. `None` for anything malformed; callers treat a
    /// malformed marker as "someone's rotation we do not understand".
    pub fn parse(value: &str) -> Option<Marker> {
        serde_json::from_str(value).ok()
    }

    pub fn to_value(&self) -> String {
        // A struct of strings, enums and timestamps always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A tag unique to this machine, target and moment.
    pub fn new_tag(machine_id: &str, target: &str, now: DateTime<Utc>) -> String {
        format!(
            "{machine_id}-{}-{}",
            &target[..target.len().min(7)],
            now.timestamp()
        )
    }
}

/// Ranks active claims of one pool: `(started_at, machine_id)`, oldest first.
/// Returns the machine ids allowed to proceed under `cap`.
pub fn admitted<'a>(claims: &mut [(DateTime<Utc>, &'a str)], cap: usize) -> Vec<&'a str> {
    claims.sort();
    claims.iter().take(cap).map(|(_, id)| *id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    #[test]
    fn marker_round_trips_and_rejects_garbage() {
        let m = Marker {
            tag: Marker::new_tag("m1", &"ab".repeat(20), at(0)),
            target: "ab".repeat(20),
            phase: Phase::Draining,
            mode: RotationMode::Grace,
            action: PolicyAction::Restart,
            severity: Severity::High,
            started_at: at(0),
            attempt_started_at: at(5),
            attempt: 0,
            owner: "r1".into(),
            restart_at: None,
            retry_at: None,
            drain_requested: true,
        };
        assert_eq!(m.tag, "m1-abababa-1800000000");
        let v = m.to_value();
        assert!(
            v.contains("\"phase\":\"draining\"") && v.contains("\"mode\":\"grace\""),
            "{v}"
        );
        assert_eq!(Marker::parse(&v), Some(m));
        assert_eq!(Marker::parse("{}"), None);
        assert_eq!(Marker::parse("rotating"), None);
    }

    #[test]
    fn ranking_is_by_time_then_id_and_identical_everywhere() {
        let mut a = vec![(at(2), "b"), (at(1), "z"), (at(2), "a")];
        let mut b = vec![(at(2), "a"), (at(2), "b"), (at(1), "z")];
        assert_eq!(admitted(&mut a, 2), vec!["z", "a"]);
        assert_eq!(admitted(&mut b, 2), vec!["z", "a"]);
        assert_eq!(admitted(&mut a, 0), Vec::<&str>::new());
    }
}

//! What the daemon tells on-call: firing alerts (conditions) and one-shot events.
//!
//! Owns the vocabulary shared by the planner (which produces them), the
//! notifier (which delivers them) and the logs. An `Alert` is a condition
//! that holds *now*: the planner recomputes the full set every sweep, and the
//! notifier turns changes of that set into triggers, repeats and resolves.
//! An `ActionEvent` happened once. Neither ever carries a secret or a URL.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::model::{AppName, MachineId, PolicyAction, Severity};

/// Conditions that fire while they hold and resolve when they clear.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlertKind {
    /// A machine has trailed the tip for longer than `min_drift_age`
    /// (fires as `drift_detected`, clears as `drift_resolved`).
    Drift,
    /// A `manual` rotation waits for an operator's `approve`.
    ManualApprovalRequired,
    /// A rotation hit a ceiling (drain, checkpoint, verify) and yielded.
    RotationStuck,
    /// Fleet or app coherence stayed below the threshold for `coherence_for`.
    CoherenceBelowThreshold,
    /// The overlay tip has not been fetched for 3 fetch intervals.
    TipStale,
    /// Sweeps keep failing.
    SweepFailing,
    /// One app's machines could not be listed for 3 sweep intervals: its
    /// last listing is shown and nothing is done to its machines.
    AppUnlistable,
    /// A rotation ended as failed after `rotation.max_attempts` restarts that
    /// did not verify (or crash-looped): uncordoned, slot released, no new
    /// attempt for its target until the tip moves or an operator approves.
    RotationFailed,
    /// The coordinator's slot set could not be read for 3 sweep intervals:
    /// no rotation that needs a slot proceeds (undos still run).
    CoordinatorUnreadable,
    /// A webhook is dead-lettering what it is sent (raised by the notifier
    /// itself, delivered to the other webhooks).
    SinkFailing,
}

impl AlertKind {
    /// The event name sent when the alert starts firing (docs/design.md §7, docs/alerts.md).
    pub fn trigger_name(self) -> &'static str {
        match self {
            AlertKind::Drift => "drift_detected",
            AlertKind::ManualApprovalRequired => "manual_approval_required",
            AlertKind::RotationStuck => "rotation_stuck",
            AlertKind::CoherenceBelowThreshold => "coherence_below_threshold",
            AlertKind::TipStale => "tip_stale",
            AlertKind::SweepFailing => "sweep_failing",
            AlertKind::AppUnlistable => "app_unlistable",
            AlertKind::RotationFailed => "rotation_failed",
            AlertKind::CoordinatorUnreadable => "coordinator_unreadable",
            AlertKind::SinkFailing => "alert_sink_failing",
        }
    }

    /// The event name sent when it clears.
    pub fn resolve_name(self) -> &'static str {
        match self {
            AlertKind::Drift => "drift_resolved",
            AlertKind::ManualApprovalRequired => "manual_approval_resolved",
            AlertKind::RotationStuck => "rotation_stuck_resolved",
            AlertKind::CoherenceBelowThreshold => "coherence_restored",
            AlertKind::TipStale => "tip_fresh",
            AlertKind::SweepFailing => "sweep_recovered",
            AlertKind::AppUnlistable => "app_listing_recovered",
            AlertKind::RotationFailed => "rotation_failed_resolved",
            AlertKind::CoordinatorUnreadable => "coordinator_readable",
            AlertKind::SinkFailing => "alert_sink_recovered",
        }
    }
}

impl fmt::Display for AlertKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.trigger_name())
    }
}

/// A condition that holds now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alert {
    pub kind: AlertKind,
    pub app: Option<AppName>,
    pub machine_id: Option<MachineId>,
    /// The commit the alert is about (the release tip a machine should run).
    pub commit: Option<String>,
    pub severity: Severity,
    /// One plain sentence for a human.
    pub summary: String,
    /// Small, bounded facts (commits behind, phase, pool…); never secrets.
    pub details: BTreeMap<String, String>,
}

impl Alert {
    /// Stable identity: the same condition always has the same key, whatever
    /// its message says, so dedupe, repeat and resolve line up.
    pub fn dedup_key(&self) -> String {
        format!(
            "fleet-reconciler/{}/{}/{}/{}",
            self.kind.trigger_name(),
            self.app.as_deref().unwrap_or("*"),
            self.machine_id.as_deref().unwrap_or("*"),
            self.commit.as_deref().unwrap_or("*"),
        )
    }
}

/// Things that happened once.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, strum::IntoStaticStr, strum::VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum EventKind {
    ActionStarted,
    ActionSucceeded,
    ActionFailed,
    /// A call of a step may have taken effect where nothing fenced it: a
    /// hold landed within its round trip, or it went unanswered and Fly may
    /// carry it out after the lease lapsed (docs/safety.md, "What is not
    /// covered"). Sent to every sink; a page on PagerDuty that a human resolves.
    ActionUnfenced,
}

impl EventKind {
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// One step of a rotation, reported once.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ActionEvent {
    pub kind: EventKind,
    pub app: AppName,
    pub machine_id: MachineId,
    /// The target commit of the rotation.
    pub commit: String,
    pub severity: Severity,
    pub action: PolicyAction,
    pub summary: String,
    pub at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedup_key_ignores_the_message() {
        let mut a = Alert {
            kind: AlertKind::Drift,
            app: Some("agents".into()),
            machine_id: Some("m1".into()),
            commit: Some("abc".into()),
            severity: Severity::High,
            summary: "m1 is 3 commits behind".into(),
            details: BTreeMap::new(),
        };
        let key = a.dedup_key();
        a.summary = "m1 is 4 commits behind".into();
        a.severity = Severity::Critical;
        assert_eq!(a.dedup_key(), key);
        a.commit = Some("def".into());
        assert_ne!(a.dedup_key(), key, "a new target is a new alert");
        assert_eq!(key, "fleet-reconciler/drift_detected/agents/m1/abc");
    }
}

//! What the daemon tells on-call: firing alerts (conditions) and one-shot events.
//!
//! Owns the vocabulary shared by `decide` (the planner and
//! `decide::alerts`, which produce them), the notifier (which delivers
//! them) and the logs. An `Alert` is a condition that holds *now*: the
//! full set is recomputed every turn, and the notifier turns changes of
//! that set into triggers, repeats and resolves. Each `AlertKind` and its
//! two event names are one entry of the `alert_kinds!` table. An
//! `ActionEvent` happened once. Neither ever carries a secret or a URL.
//! It must never hold an alert rule (those are `decide::alerts`') nor
//! import anything above `model`.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::model::{AppName, CommitId, MachineId, PolicyAction, Severity};

/// Declares [`AlertKind`] from one table: each condition once, as
/// `Variant => "trigger_name", "resolve_name";` under its doc. Its two
/// event names are written nowhere else; `trigger_name`, `resolve_name`
/// and `AlertKind::ALL` are generated from the entry, and the rule that
/// raises the condition is `decide::alerts`' (its module doc says what
/// else a new condition touches).
macro_rules! alert_kinds {
    ($(
        $(#[doc = $doc:literal])*
        $(#[cfg($cfg:meta)])?
        $kind:ident => $trigger:literal, $resolve:literal;
    )*) => {
        /// Conditions that fire while they hold and resolve when they clear.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum AlertKind {
            $( $(#[doc = $doc])* $(#[cfg($cfg)])? $kind, )*
        }

        impl AlertKind {
            /// Every kind, in the table's order.
            pub const ALL: &'static [AlertKind] = &[$( $(#[cfg($cfg)])? AlertKind::$kind, )*];

            /// The event name sent when the alert starts firing (docs/design.md §7, docs/alerts.md).
            pub fn trigger_name(self) -> &'static str {
                match self {
                    $( $(#[cfg($cfg)])? AlertKind::$kind => $trigger, )*
                }
            }

            /// The event name sent when it clears.
            pub fn resolve_name(self) -> &'static str {
                match self {
                    $( $(#[cfg($cfg)])? AlertKind::$kind => $resolve, )*
                }
            }
        }
    };
}

alert_kinds! {
    /// A machine has trailed the tip for longer than `min_drift_age`
    /// (fires as `drift_detected`, clears as `drift_resolved`).
    Drift => "drift_detected", "drift_resolved";
    /// A `manual` rotation waits for an operator's `approve`.
    ManualApprovalRequired => "manual_approval_required", "manual_approval_resolved";
    /// A rotation hit a ceiling (drain, checkpoint, verify) and yielded.
    RotationStuck => "rotation_stuck", "rotation_stuck_resolved";
    /// Fleet or app coherence stayed below the threshold for `coherence_for`.
    CoherenceBelowThreshold => "coherence_below_threshold", "coherence_restored";
    /// The overlay tip has not been fetched for 3 fetch intervals.
    TipStale => "tip_stale", "tip_fresh";
    /// Sweeps keep failing.
    SweepFailing => "sweep_failing", "sweep_recovered";
    /// One app's machines could not be listed for 3 sweep intervals: its
    /// last listing is shown and nothing is done to its machines.
    AppUnlistable => "app_unlistable", "app_listing_recovered";
    /// A rotation ended as failed after `rotation.max_attempts` restarts that
    /// did not verify (or crash-looped): uncordoned, slot released, no new
    /// attempt for its target until the tip moves or an operator approves.
    RotationFailed => "rotation_failed", "rotation_failed_resolved";
    /// The coordinator's slot set could not be read for 3 sweep intervals:
    /// no rotation that needs a slot proceeds (undos still run).
    CoordinatorUnreadable => "coordinator_unreadable", "coordinator_readable";
    /// A record the daemon or an operator relies on (marker, unprobed
    /// record, approval, hold, slot set) is not the one sealed with the
    /// record key: written by an agent (or a reconciler before sealing),
    /// altered, or moved. Nothing is done on its strength (docs/safety.md,
    /// "Threat model"); names the machine, the metadata key and what was found.
    MetadataTampered => "metadata_tampered", "metadata_tampered_resolved";
    /// `[release] halt_after_failures` rotations toward the tip ended failed
    /// within `halt_window` (or the coordinator says so): the tip is halted
    /// for the app, no new rotation toward it starts until `resume`. Names
    /// the tip, the failed rotations and their evidence.
    ReleaseHalted => "release_halted", "release_resumed";
    /// The alert gate's Alertmanager (`[gates.alertmanager]`) cannot be
    /// read: no new rotation starts (fail closed) unless `fail_open`.
    GateUnreachable => "gate_unreachable", "gate_reachable";
    /// A webhook is dead-lettering what it is sent (decided by
    /// `decide::alerts` from the notifier's delivery state, delivered to
    /// the other webhooks).
    SinkFailing => "alert_sink_failing", "alert_sink_recovered";
    /// A condition that exists only in this crate's unit tests: it shows
    /// that a new condition is this entry plus its rule
    /// (`decide::alerts`' tests raise it), with no other arm to write.
    #[cfg(test)]
    ExampleCondition => "example_condition", "example_condition_resolved";
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
    pub commit: Option<CommitId>,
    pub severity: Severity,
    /// One plain sentence for a human.
    pub summary: String,
    /// Small, bounded facts (commits behind, phase, pool…); never secrets.
    pub details: BTreeMap<String, String>,
}

impl Alert {
    /// Stable identity: the same condition always has the same key, whatever
    /// its message says, so dedupe, repeat and resolve line up.
    pub fn dedup_key(&self) -> DedupKey {
        DedupKey(format!(
            "fleet-reconciler/{}/{}/{}/{}",
            self.kind.trigger_name(),
            self.app.as_ref().map(AppName::as_str).unwrap_or("*"),
            self.machine_id
                .as_ref()
                .map(MachineId::as_str)
                .unwrap_or("*"),
            self.commit.as_ref().map(CommitId::as_str).unwrap_or("*"),
        ))
    }
}

/// The identity of an alert, an incident or an event as the notifier and
/// its receivers know it (`fleet-reconciler/<event>/<app>/<machine>/<commit>`,
/// a group's with its segments): dedupe, repeat and resolve line up on it.
/// Built only here and by the notifier's grouping, never from message text.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DedupKey(String);

impl DedupKey {
    /// A key of the notifier's own (a group's, an event's): its parts as
    /// that key's builder joins them.
    pub(crate) fn new(key: String) -> DedupKey {
        DedupKey(key)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DedupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
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
    /// The rotation the step belongs to; `None` for a step of no rotation
    /// (keeping the probe-failure record), which has no target or action.
    pub rotation: Option<EventRotation>,
    pub severity: Severity,
    pub summary: String,
    pub at: DateTime<Utc>,
}

/// What an event's rotation is about, from its marker.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EventRotation {
    /// The target commit of the rotation.
    pub commit: CommitId,
    pub action: PolicyAction,
}

impl ActionEvent {
    /// The target commit of the event's rotation, if it has one.
    pub fn commit(&self) -> Option<&CommitId> {
        self.rotation.as_ref().map(|r| &r.commit)
    }
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
            commit: CommitId::parse(&"a".repeat(40)),
            severity: Severity::High,
            summary: "m1 is 3 commits behind".into(),
            details: BTreeMap::new(),
        };
        let key = a.dedup_key();
        a.summary = "m1 is 4 commits behind".into();
        a.severity = Severity::Critical;
        assert_eq!(a.dedup_key(), key);
        a.commit = CommitId::parse(&"d".repeat(40));
        assert_ne!(a.dedup_key(), key, "a new target is a new alert");
        assert_eq!(
            key.as_str(),
            format!(
                "fleet-reconciler/drift_detected/agents/m1/{}",
                "a".repeat(40)
            )
        );
        // Stored and sent as the plain text it always was.
        assert_eq!(serde_json::to_string(&key).ok(), Some(format!("\"{key}\"")));
    }

    /// An alert read back (the notifier's state file) has a commit id: in
    /// another case it is the same alert; text that is no commit is refused.
    /// (Before, `commit` was any text, and an upper-case one another key.)
    #[test]
    fn an_alert_read_back_has_a_commit_id() {
        let read = |commit: &str| {
            serde_json::from_str::<Alert>(&format!(
                r#"{{"kind":"drift","app":"agents","machine_id":"m1","commit":"{commit}","severity":"high","summary":"s","details":{{}}}}"#
            ))
        };
        let lower = read(&"ab".repeat(20)).expect("a commit id");
        let upper = read(&"AB".repeat(20)).expect("an upper-case commit id");
        assert_eq!(upper.dedup_key(), lower.dedup_key());
        let why = read("abc").expect_err("no commit id").to_string();
        assert!(why.contains("not a commit id"), "{why}");
    }
}

//! The alert vocabulary: every condition the daemon can raise, as one
//! table ([`AlertKind`], from the `alert_kinds!` entries), and the
//! [`Alert`] that says a condition holds now.
//!
//! Owns each kind's two event names (trigger and resolve), its serialized
//! name (the state file, payloads) and its properties: whether it is about
//! this replica itself (`own`: never frozen as stale) and whether it is
//! grouped into incidents and held open (`grouped`). No other file lists
//! kinds; a new condition is one entry here plus its rule and test in
//! [`crate::decide::alerts`] (whose module doc lists the steps).
//!
//! It is a file of its own, below the rules, so that the planner and the
//! guardrails, which raise machine alerts and which `decide::alerts` reads
//! (`Plan`), can name these types without a circle. It must never hold an
//! alert rule, read the clock, or import anything of `decide` but this.
//! An alert never carries a secret or a URL.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::events::DedupKey;
use crate::model::{AppName, CommitId, MachineId, Severity};

/// Declares [`AlertKind`] from one table: each condition once, as
/// `Variant => "trigger_name", "resolve_name", own: bool, grouped: bool;`
/// under its doc. Its two event names and its two properties are written
/// nowhere else: `trigger_name`, `resolve_name`, `is_own`, `is_grouped` and
/// `AlertKind::ALL` are generated from the entry.
macro_rules! alert_kinds {
    ($(
        $(#[doc = $doc:literal])*
        $(#[cfg($cfg:meta)])?
        $kind:ident => $trigger:literal, $resolve:literal, own: $own:literal, grouped: $grouped:literal;
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

            /// Whether the condition is about this replica itself, not
            /// about what it sees: always spoken, never frozen as stale
            /// (`decide::voice`).
            pub fn is_own(self) -> bool {
                match self {
                    $( $(#[cfg($cfg)])? AlertKind::$kind => $own, )*
                }
            }

            /// Whether its per-machine alerts are folded into one incident
            /// per group (`alerts.group_by`, `decide::incidents`) and
            /// such an incident is held open while briefly empty
            /// (`decide::voice`): the conditions one release raises on
            /// many machines at once.
            pub fn is_grouped(self) -> bool {
                match self {
                    $( $(#[cfg($cfg)])? AlertKind::$kind => $grouped, )*
                }
            }
        }
    };
}

alert_kinds! {
    /// A machine has trailed the tip for longer than `min_drift_age`
    /// (fires as `drift_detected`, clears as `drift_resolved`).
    Drift => "drift_detected", "drift_resolved",
        own: false, grouped: true;
    /// A `manual` rotation waits for an operator's `approve`.
    ManualApprovalRequired => "manual_approval_required", "manual_approval_resolved",
        own: false, grouped: true;
    /// A rotation hit a ceiling (drain, checkpoint, verify) and yielded.
    RotationStuck => "rotation_stuck", "rotation_stuck_resolved",
        own: false, grouped: false;
    /// Fleet or app coherence stayed below the threshold for `coherence_for`.
    CoherenceBelowThreshold => "coherence_below_threshold", "coherence_restored",
        own: false, grouped: false;
    /// The overlay tip has not been fetched for 3 fetch intervals.
    TipStale => "tip_stale", "tip_fresh",
        own: true, grouped: false;
    /// Sweeps keep failing.
    SweepFailing => "sweep_failing", "sweep_recovered",
        own: true, grouped: false;
    /// One app's machines could not be listed for 3 sweep intervals: its
    /// last listing is shown and nothing is done to its machines.
    AppUnlistable => "app_unlistable", "app_listing_recovered",
        own: true, grouped: false;
    /// A rotation ended as failed after `rotation.max_attempts` restarts that
    /// did not verify (or crash-looped): uncordoned, slot released, no new
    /// attempt for its target until the tip moves or an operator approves.
    RotationFailed => "rotation_failed", "rotation_failed_resolved",
        own: false, grouped: false;
    /// The coordinator's slot set could not be read for 3 sweep intervals:
    /// no rotation that needs a slot proceeds (undos still run).
    CoordinatorUnreadable => "coordinator_unreadable", "coordinator_readable",
        own: false, grouped: false;
    /// A record the daemon or an operator relies on (marker, unprobed
    /// record, approval, hold, slot set) is not the one sealed with the
    /// record key: written by an agent (or a reconciler before sealing),
    /// altered, or moved. Nothing is done on its strength (docs/safety.md,
    /// "Threat model"); names the machine, the metadata key and what was found.
    MetadataTampered => "metadata_tampered", "metadata_tampered_resolved",
        own: false, grouped: false;
    /// `[release] halt_after_failures` rotations toward the tip ended failed
    /// within `halt_window` (or the coordinator says so): the tip is halted
    /// for the app, no new rotation toward it starts until `resume`. Names
    /// the tip, the failed rotations and their evidence.
    ReleaseHalted => "release_halted", "release_resumed",
        own: false, grouped: false;
    /// The alert gate's Alertmanager (`[gates.alertmanager]`) cannot be
    /// read: no new rotation starts (fail closed) unless `fail_open`.
    GateUnreachable => "gate_unreachable", "gate_reachable",
        own: true, grouped: false;
    /// A webhook is dead-lettering what it is sent (decided by
    /// `decide::alerts` from the notifier's delivery state, delivered to
    /// the other webhooks).
    SinkFailing => "alert_sink_failing", "alert_sink_recovered",
        own: true, grouped: false;
    /// A condition that exists only in this crate's unit tests: it shows
    /// that a new condition is this entry plus its rule
    /// (`decide::alerts`' tests raise it), with no other arm to write.
    #[cfg(test)]
    ExampleCondition => "example_condition", "example_condition_resolved",
        own: false, grouped: false;
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
        DedupKey::new(format!(
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

    /// Each kind's properties come from its entry: the kinds about this
    /// replica itself (always spoken) and the grouped ones (held open), as
    /// `decide::voice` and `decide::incidents` listed them before.
    #[test]
    fn the_table_says_which_kinds_are_own_and_which_are_grouped() {
        let named = |keep: fn(AlertKind) -> bool| -> Vec<&str> {
            AlertKind::ALL
                .iter()
                .copied()
                .filter(|k| keep(*k))
                .map(AlertKind::trigger_name)
                .collect()
        };
        assert_eq!(
            named(AlertKind::is_own),
            [
                "tip_stale",
                "sweep_failing",
                "app_unlistable",
                "gate_unreachable",
                "alert_sink_failing"
            ]
        );
        assert_eq!(
            named(AlertKind::is_grouped),
            ["drift_detected", "manual_approval_required"]
        );
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

//! What the daemon tells on-call besides its alerts: one-shot events, and
//! the key every alert, incident and event is known by.
//!
//! Owns [`ActionEvent`] (a step of a rotation that happened once, told to
//! every sink) and [`DedupKey`], shared by `decide` (the alerts' keys, the
//! voice rules), the notifier (which delivers) and its state file. The
//! alert vocabulary (`AlertKind`, its `alert_kinds!` table, `Alert`) is
//! `decide::alerts`', beside the rules that raise it. Nothing here ever
//! carries a secret or a URL. It must never name an alert kind or hold an
//! alert rule, nor import anything above `model`.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::model::{AppName, CommitId, MachineId, PolicyAction, Severity};

/// The identity of an alert, an incident or an event as the notifier and
/// its receivers know it (`fleet-reconciler/<event>/<app>/<machine>/<commit>`,
/// a group's with its segments): dedupe, repeat and resolve line up on it.
/// Built only by `decide::alerts::Alert::dedup_key` and by the notifier's
/// grouping and event keys, never from message text.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DedupKey(String);

impl DedupKey {
    /// A key from its parts as its builder joins them: an alert's
    /// (`Alert::dedup_key`) or one of the notifier's own (a group's, an
    /// event's).
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

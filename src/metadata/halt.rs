//! A halted release: the record on the coordinator that stops new claims
//! toward one tip of one app (`[release] halt_after_failures`), and the
//! operator's `resume` that lifts it (docs/design.md, "Halted releases").
//!
//! Owns the value kept under [`coordinator_halt_key`] (one per app, sealed
//! with the record key like the holds kept there) and how a read of it is
//! judged: a record that is not one we sealed halts the app's current tip
//! all the same (fail closed) and is reported as tampered. It never compares
//! its `at` with any clock (it is shown, nothing more), and must never do I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::controls::{Found, Trust};
use crate::model::{AppName, CommitId, MachineId};

/// Prefix of the coordinator's metadata key that keeps an app's halt record.
pub const COORDINATOR_HALT_PREFIX: &str = "fleet_reconciler_halt.";

/// The coordinator's metadata key of `app`'s halt record.
pub fn coordinator_halt_key(app: &str) -> String {
    format!("{COORDINATOR_HALT_PREFIX}{app}")
}

/// Each app's halt key as the sweep read it from the coordinator (apps
/// without one are absent; empty when the coordinator could not be read).
pub type Halts = std::collections::BTreeMap<AppName, HaltView>;

/// Most rotations a record names as lifted.
pub const MAX_LIFTED: usize = 256;

/// Most failures a record names (the evidence of the first ones is enough).
pub const MAX_HALT_FAILURES: usize = 32;

/// How a failed rotation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum HaltOutcome {
    /// Past `rotation.max_attempts` restarts that did not verify.
    Failed,
    /// Its last attempt ended in a crash loop.
    CrashLooping,
}

impl HaltOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            HaltOutcome::Failed => "failed",
            HaltOutcome::CrashLooping => "crash-looping",
        }
    }
}

/// One failed rotation toward the halted tip: the evidence of the halt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaltFailure {
    pub machine_id: MachineId,
    /// The rotation's marker tag: a `resume` lifts these rotations, and
    /// only new ones count toward a new halt.
    pub tag: String,
    pub outcome: HaltOutcome,
    /// What its last attempt showed (bounded).
    pub evidence: String,
}

/// The value kept under an app's halt key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum HaltRecord {
    /// No new claim toward `tip` in this app until `resume`.
    Halted {
        tip: CommitId,
        failures: Vec<HaltFailure>,
        /// Who halted it (a replica's owner name), and when by its clock
        /// (shown only).
        by: String,
        at: DateTime<Utc>,
        /// Rotations an earlier `resume` of this tip lifted (carried over,
        /// so the next `resume` keeps them lifted).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        lifted: Vec<String>,
    },
    /// An operator lifted the halt of `tip`: the rotations it named (by
    /// tag) never count toward a halt again.
    Resumed {
        tip: CommitId,
        lifted: Vec<String>,
        by: String,
        at: DateTime<Utc>,
    },
}

impl HaltRecord {
    /// The tip halted, if this record halts one.
    pub fn halted_tip(&self) -> Option<&CommitId> {
        match self {
            HaltRecord::Halted { tip, .. } => Some(tip),
            HaltRecord::Resumed { .. } => None,
        }
    }

    /// Tags of rotations an operator's `resume` of `tip` lifted.
    pub fn lifted(&self, tip: &CommitId) -> &[String] {
        match self {
            HaltRecord::Resumed { tip: t, lifted, .. }
            | HaltRecord::Halted { tip: t, lifted, .. }
                if t == tip =>
            {
                lifted
            }
            _ => &[],
        }
    }

    /// What a `resume` of this record lifts: every failure it names and
    /// what earlier resumes of its tip lifted, at most [`MAX_LIFTED`] (the
    /// oldest go first: a rotation that old is long out of any window).
    pub fn to_lift(&self) -> Vec<String> {
        let HaltRecord::Halted {
            failures, lifted, ..
        } = self
        else {
            return Vec::new();
        };
        let mut all: Vec<String> = lifted.clone();
        for f in failures {
            if !all.contains(&f.tag) {
                all.push(f.tag.clone());
            }
        }
        let excess = all.len().saturating_sub(MAX_LIFTED);
        all.drain(..excess);
        all
    }

    pub fn to_value(&self) -> String {
        // Strings, ids and a timestamp always serialize.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// An app's halt key as read from the coordinator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HaltView {
    /// A record we sealed.
    Record(HaltRecord),
    /// Not a record we sealed, or not a record at all: it halts the app's
    /// current tip (fail closed) and is alerted as `metadata_tampered`.
    Unverified(Found),
}

impl HaltView {
    /// `value` of `key` on the coordinator `coordinator_id`, judged as `trust` says.
    pub fn open(trust: Trust<'_>, coordinator_id: &str, key: &str, value: &str) -> HaltView {
        match trust.open(coordinator_id, key, value) {
            Ok(body) => match crate::text::decode_json::<HaltRecord>(&body) {
                Ok(record) => HaltView::Record(record),
                Err(_) => HaltView::Unverified(Found::Unsigned),
            },
            Err(found) => HaltView::Unverified(found),
        }
    }

    /// Whether `tip` is halted by this view.
    pub fn halts(&self, tip: &CommitId) -> bool {
        match self {
            HaltView::Record(r) => r.halted_tip() == Some(tip),
            HaltView::Unverified(_) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::seal::{RecordKey, RecordKeys};

    fn keys(byte: &str) -> RecordKeys {
        RecordKeys::new(RecordKey::from_hex(&byte.repeat(32)).unwrap())
    }

    fn tip(c: char) -> CommitId {
        CommitId::parse(&c.to_string().repeat(40)).unwrap()
    }

    fn halted() -> HaltRecord {
        HaltRecord::Halted {
            tip: tip('a'),
            failures: vec![HaltFailure {
                machine_id: MachineId::from("m1"),
                tag: "t1".into(),
                outcome: HaltOutcome::CrashLooping,
                evidence: "crash loop".into(),
            }],
            by: "replica-1".into(),
            at: DateTime::<Utc>::UNIX_EPOCH,
            lifted: Vec::new(),
        }
    }

    #[test]
    fn a_sealed_record_halts_its_tip_only_and_anything_else_halts_all() {
        let k = keys("5e");
        let key = coordinator_halt_key("app");
        let sealed = k.seal("coord", &key, &halted().to_value());
        let view = HaltView::open(Trust::Verify(&k), "coord", &key, &sealed);
        assert_eq!(view, HaltView::Record(halted()));
        assert!(view.halts(&tip('a')));
        assert!(!view.halts(&tip('b')), "a newer tip is not halted");
        // Moved to another coordinator key, unsigned, or sealed by another
        // key: not ours, and it halts whatever the tip (fail closed).
        for (value, at) in [
            (sealed.clone(), coordinator_halt_key("other")),
            (halted().to_value(), key.clone()),
            (
                keys("6f").seal("coord", &key, &halted().to_value()),
                key.clone(),
            ),
        ] {
            let view = HaltView::open(Trust::Verify(&k), "coord", &at, &value);
            assert!(matches!(view, HaltView::Unverified(_)), "{view:?}");
            assert!(view.halts(&tip('b')));
        }
        // A sealed `resumed` record halts nothing and names what it lifted.
        let resumed = HaltRecord::Resumed {
            tip: tip('a'),
            lifted: vec!["t1".into()],
            by: "op".into(),
            at: DateTime::<Utc>::UNIX_EPOCH,
        };
        let view = HaltView::open(
            Trust::Verify(&k),
            "coord",
            &key,
            &k.seal("coord", &key, &resumed.to_value()),
        );
        assert!(!view.halts(&tip('a')));
        assert_eq!(resumed.lifted(&tip('a')), ["t1".to_string()]);
        assert!(resumed.lifted(&tip('b')).is_empty());
    }
}

//! Shared vocabulary: identifiers, statuses, severities and actions.
//!
//! Owns the small types every other module speaks in. It must never do I/O
//! or hold policy: it only names things and says how they order and print.

use std::fmt;

use serde::{Deserialize, Serialize};
use strum::EnumCount;

/// A full, lowercase, 40-hex git commit id.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CommitId(String);

/// The first 12 digits of a commit id, as every view shows one (the whole
/// text when it is shorter, or not cut at a character boundary).
pub fn short_commit(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

impl CommitId {
    /// Accepts exactly 40 hex digits (any case) and normalises to lowercase.
    pub fn parse(s: &str) -> Option<CommitId> {
        (s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| CommitId(s.to_ascii_lowercase()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for CommitId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the overlay says about one reported ref, relative to the release tip.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::Display,
    strum::EnumCount,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum MachineStatus {
    /// Started, probed, and reporting the release tip.
    OnTip,
    /// Started, probed, reporting a known commit other than the tip.
    Drifted,
    /// Started but its health endpoint could not be read (refused, timeout, HTTP error).
    Unreachable,
    /// Answered, but not with a usable report (not JSON, no ref, non-hex ref, too big).
    BadReport,
    /// Reported a ref the overlay repository does not contain (or not a commit).
    UnknownRef,
    /// Reported an abbreviated ref that matches more than one object.
    AmbiguousRef,
    /// Not in state `started`: not probed, not counted in coherence.
    NotRunning,
}

impl MachineStatus {
    // Sized by strum's count, so a new variant cannot be left out.
    pub const ALL: [MachineStatus; MachineStatus::COUNT] = [
        MachineStatus::OnTip,
        MachineStatus::Drifted,
        MachineStatus::Unreachable,
        MachineStatus::BadReport,
        MachineStatus::UnknownRef,
        MachineStatus::AmbiguousRef,
        MachineStatus::NotRunning,
    ];

    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Statuses for which a severity and an action are computed (docs/design.md §5.2).
    pub fn is_classified(self) -> bool {
        matches!(
            self,
            MachineStatus::Drifted | MachineStatus::UnknownRef | MachineStatus::AmbiguousRef
        )
    }
}

/// Drift severity, ordered from least to most urgent.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::Display,
    strum::EnumCount,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Severity {
    Low,
    Medium,
    High,
    Critical,
}

impl Severity {
    pub const ALL: [Severity; Severity::COUNT] = [
        Severity::Low,
        Severity::Medium,
        Severity::High,
        Severity::Critical,
    ];

    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What a pool's policy does about a drifted machine (docs/design.md §5.3).
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantArray,
    strum::Display,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum PolicyAction {
    Observe,
    AlertAndWait,
    Restart,
    Manual,
    Reload,
}

impl PolicyAction {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_id_accepts_only_full_hex_and_lowercases() {
        let upper = "A".repeat(40);
        assert_eq!(CommitId::parse(&upper).unwrap().as_str(), "a".repeat(40));
        assert!(CommitId::parse(&"a".repeat(39)).is_none());
        assert!(CommitId::parse(&"g".repeat(40)).is_none());
    }

    #[test]
    fn severities_order_by_urgency() {
        assert!(Severity::Low < Severity::Medium);
        assert!(Severity::High < Severity::Critical);
    }

    #[test]
    fn names_match_the_design_vocabulary() {
        let s = serde_json::to_string(&PolicyAction::AlertAndWait).unwrap();
        assert_eq!(s, "\"alert-and-wait\"");
        let s = serde_json::to_string(&MachineStatus::AmbiguousRef).unwrap();
        assert_eq!(s, "\"ambiguous_ref\"");
        for st in MachineStatus::ALL {
            assert_eq!(
                serde_json::to_string(&st).unwrap(),
                format!("\"{}\"", st.as_str())
            );
        }
    }

    /// The strum-derived names (metric labels, tables, logs) are the serde
    /// names (JSON, config, markers), for every enum that has both.
    #[test]
    fn strum_names_are_the_serde_names() {
        use crate::decide::rotation::{Ending, Phase, RotationMode};
        use crate::events::EventKind;
        use crate::report::notify::Status;
        use strum::VariantArray;

        fn same<T: Serialize>(values: &[T], name: impl Fn(&T) -> String) {
            for v in values {
                assert_eq!(serde_json::to_value(v).unwrap(), name(v).as_str());
            }
        }
        same(&MachineStatus::ALL, |v| v.as_str().to_owned());
        same(&MachineStatus::ALL, |v| v.to_string());
        same(&Severity::ALL, |v| v.as_str().to_owned());
        same(&Severity::ALL, |v| v.to_string());
        same(PolicyAction::VARIANTS, |v| v.as_str().to_owned());
        same(PolicyAction::VARIANTS, |v| v.to_string());
        same(Phase::VARIANTS, |v| v.as_str().to_owned());
        same(Phase::VARIANTS, |v| v.to_string());
        same(Ending::VARIANTS, |v| v.as_str().to_owned());
        same(RotationMode::VARIANTS, |v| v.as_str().to_owned());
        same(EventKind::VARIANTS, |v| v.name().to_owned());
        same(Status::VARIANTS, |v| v.as_str().to_owned());
    }
}

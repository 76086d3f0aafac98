//! The operator's formats: a hold and an approval, as they are kept in
//! machine metadata under [`HOLD_KEY`](super::HOLD_KEY) and
//! [`APPROVE_KEY`](super::APPROVE_KEY) (docs/design.md §6.6).
//!
//! Owns what each value is and its parse, so the CLI, the admin API, the
//! sweep and any number of reconciler replicas agree. `act::operator` writes
//! them; the daemon reads a hold and never clears it. It must never do I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::model::CommitId;

/// How an approved `manual` rotation proceeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ApprovalMode {
    /// Restart now, like `restart` with no grace.
    Now,
    /// Proceed like `alert-and-wait`: restart at the first report with no live work.
    WhenIdle,
}

/// One approval of one rotation: valid only for the commit it names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    /// The target commit the operator approved rotating to. Read as any
    /// commit id is (see [`CommitId`]): written by hand in another case it is
    /// the same commit; any other text (a short id, a SHA-256 id, garbage)
    /// makes the approval unreadable, naming the field `target`, so it
    /// authorizes nothing.
    pub target: CommitId,
    pub mode: ApprovalMode,
    pub by: String,
    pub at: DateTime<Utc>,
}

/// Which approval: an approval has no id of its own, so it is named by a
/// fingerprint of its metadata value as written (the first 8 bytes of its
/// SHA-256, in hex). Each `approve` writes a new value (its `at` at least
/// differs), hence a new id. Only ever compared for equality: it says
/// whether the approval on a machine is the one a rotation used, never
/// which of two is newer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ApprovalId(String);

/// Longest [`ApprovalId`] a marker may carry (ours are 16 characters).
pub const MAX_APPROVAL_ID_CHARS: usize = 64;

impl ApprovalId {
    /// The id of the approval whose metadata value is `value`.
    pub fn of(value: &str) -> ApprovalId {
        let digest = Sha256::digest(value.as_bytes());
        ApprovalId(hex::encode(digest.get(..8).unwrap_or_default()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Longest `by` kept from an approval; a longer one is cut (it is shown,
/// never compared).
pub const MAX_APPROVAL_BY_CHARS: usize = 256;

impl Approval {
    /// Parses a metadata value; a malformed approval authorizes nothing.
    pub fn parse(value: &str) -> Option<Approval> {
        Approval::decode(value).ok()
    }

    /// [`Approval::parse`], saying why a value is not an approval (the field
    /// at fault, in at most [`crate::text::MAX_DETAIL_CHARS`] characters).
    pub fn decode(value: &str) -> Result<Approval, String> {
        let mut approval: Approval = crate::text::decode_json(value)?;
        if approval.by.chars().count() > MAX_APPROVAL_BY_CHARS {
            approval.by = crate::text::bounded(&approval.by, MAX_APPROVAL_BY_CHARS);
        }
        Ok(approval)
    }

    /// Whether this approval authorizes a rotation to `commit` (and only it).
    pub fn approves(&self, commit: &CommitId) -> bool {
        self.target == *commit
    }
}

/// The hold value written by `hold`: who and why, for the next operator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    pub by: String,
    pub reason: String,
    pub at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn approval_round_trips_and_garbage_authorizes_nothing() {
        let a = Approval {
            target: CommitId::parse(&"a".repeat(40)).expect("a commit id"),
            mode: ApprovalMode::WhenIdle,
            by: "alice".into(),
            at: DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
        };
        let text = serde_json::to_string(&a).unwrap();
        assert!(text.contains("\"when-idle\""), "{text}");
        assert_eq!(Approval::parse(&text), Some(a));
        assert_eq!(Approval::parse("yes"), None);
        assert_eq!(Approval::parse("{\"target\":\"x\"}"), None);
    }

    /// An approval is named by its value: the same value, the same id; any
    /// other value (a new `approve`), another.
    #[test]
    fn an_approval_id_names_one_value() {
        let v = r#"{"target":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","mode":"now","by":"ops","at":"2026-01-01T00:00:00Z"}"#;
        let id = ApprovalId::of(v);
        assert_eq!(id, ApprovalId::of(v));
        assert_eq!(id.as_str().len(), 16);
        assert!(id.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(id, ApprovalId::of(&v.replace(":00Z", ":01Z")));
    }

    /// An approval's target is read as a commit id: another case is the same
    /// commit (and is written back lowercase), anything else is refused,
    /// naming the field. Before, `target` was any text up to 64 characters,
    /// read as given and compared ignoring case: a short or SHA-256 id read
    /// as an approval that approved nothing.
    #[test]
    fn an_approval_target_reads_as_its_commit_or_is_refused() {
        let value = |target: &str| {
            format!(
                r#"{{"target":"{target}","mode":"now","by":"ops","at":"2026-01-01T00:00:00Z"}}"#
            )
        };
        let upper = "ABCDEF0123".repeat(4);
        let a = Approval::decode(&value(&upper)).expect("an upper-case commit id reads");
        assert_eq!(a.target.as_str(), upper.to_ascii_lowercase());
        let lower = value(&upper.to_ascii_lowercase());
        assert_eq!(
            serde_json::to_string(&a).ok().as_deref(),
            Some(lower.as_str())
        );
        let tip = CommitId::parse(&upper).expect("a commit id");
        assert!(a.approves(&tip));
        assert!(!a.approves(&CommitId::parse(&"b".repeat(40)).expect("a commit id")));
        for odd in [
            "abcdef0",
            &"a".repeat(64),
            &"z".repeat(40),
            "",
            &format!("{} ", "a".repeat(40)),
        ] {
            let why = Approval::decode(&value(odd)).expect_err(odd);
            assert!(
                why.contains("`target`") && why.contains("not a commit id"),
                "{why}"
            );
        }
    }
}

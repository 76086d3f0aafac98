//! The operator's formats: a hold and an approval, as they are kept in
//! machine metadata under [`HOLD_KEY`](super::HOLD_KEY) and
//! [`APPROVE_KEY`](super::APPROVE_KEY) (docs/design.md §6.6).
//!
//! Owns what each value is and its parse, so the CLI, the admin API, the
//! sweep and any number of reconciler replicas agree. `act::operator` writes
//! them; the daemon reads a hold and never clears it. It must never do I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

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
    /// The target commit (full hex) the operator approved rotating to.
    pub target: String,
    pub mode: ApprovalMode,
    pub by: String,
    pub at: DateTime<Utc>,
}

/// Longest `target` an approval may name: a commit id (40 hex digits; 64
/// for SHA-256 repositories). A longer one could approve no commit.
pub const MAX_APPROVAL_TARGET_CHARS: usize = 64;
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
        if approval.target.chars().count() > MAX_APPROVAL_TARGET_CHARS {
            return Err(format!(
                "field `target`: longer than {MAX_APPROVAL_TARGET_CHARS} characters"
            ));
        }
        if approval.by.chars().count() > MAX_APPROVAL_BY_CHARS {
            approval.by = crate::text::bounded(&approval.by, MAX_APPROVAL_BY_CHARS);
        }
        Ok(approval)
    }

    /// Whether this approval authorizes a rotation to `commit` (and only it).
    pub fn approves(&self, commit: &str) -> bool {
        self.target.eq_ignore_ascii_case(commit)
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
            target: "a".repeat(40),
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
}

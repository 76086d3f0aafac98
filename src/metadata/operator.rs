//! The operator's formats: a hold and an approval, as they are kept in
//! machine metadata under [`HOLD_KEY`](super::HOLD_KEY) and
//! [`APPROVE_KEY`](super::APPROVE_KEY) (docs/design.md §6.6).
//!
//! Owns what each value is and its parse, so the CLI, the admin API, the
//! sweep and any number of reconciler replicas agree. `act::operator` writes
//! them, sealed with the record key; the daemon reads a hold and never clears
//! it. Any hold value holds; only a sealed approval approves. It must never
//! do I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

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
        ApprovalId(super::value_fingerprint(value))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The approvals rotations consumed (or operators revoked or replaced) on
/// one machine, newest last, kept on the coordinator under
/// [`coordinator_spent_key`](super::coordinator_spent_key). A sealed
/// approval can be written back by an agent after it was spent (its seal
/// still verifies on its own machine and key); one listed here approves
/// nothing. Bounded: the oldest ids drop out past [`MAX_SPENT_APPROVALS`],
/// so the list also counts every approval ever spent (`consumed`), and an
/// approval older than its memory approves nothing ([`SpentApprovals::outlived`];
/// docs/safety.md, "Threat model").
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpentApprovals {
    pub ids: Vec<ApprovalId>,
    /// How many approvals were ever spent on the machine (lists written
    /// before the count: as many as they hold).
    #[serde(default)]
    pub consumed: u64,
}

/// How many consumed approvals of one machine the coordinator remembers.
pub const MAX_SPENT_APPROVALS: usize = 64;

impl SpentApprovals {
    /// Parses the coordinator's value; ids longer than ours are dropped.
    pub fn parse(value: &str) -> Option<SpentApprovals> {
        let mut spent: SpentApprovals = crate::text::decode_json(value).ok()?;
        spent
            .ids
            .retain(|id| id.as_str().chars().count() <= MAX_APPROVAL_ID_CHARS);
        Some(spent)
    }

    pub fn contains(&self, id: &ApprovalId) -> bool {
        self.ids.contains(id)
    }

    /// How many approvals were ever spent on the machine: the epoch an
    /// approval issued now carries ([`approval_epoch`]).
    pub fn count(&self) -> u64 {
        self.consumed
            .max(u64::try_from(self.ids.len()).unwrap_or(u64::MAX))
    }

    /// Whether an approval issued at `epoch` (`None`: issued without one,
    /// by an older version or with the coordinator unreadable) is older
    /// than this list's memory, so that its id may have dropped out. Each
    /// approval issued after it replaced it on the machine, spending it, so
    /// one still standing has seen at most one spend since its epoch (a
    /// rotation ending under the approval it replaced, as it was issued);
    /// two mean it was spent. Without an epoch: once any id dropped out.
    pub fn outlived(&self, epoch: Option<u64>) -> bool {
        match epoch {
            Some(e) => self.count() > e.saturating_add(1),
            None => self.count() > u64::try_from(self.ids.len()).unwrap_or(u64::MAX),
        }
    }

    /// These ids and `id`, at most [`MAX_SPENT_APPROVALS`] (the oldest go),
    /// counted.
    pub fn with(mut self, id: ApprovalId) -> SpentApprovals {
        if !self.contains(&id) {
            self.consumed = self.count().saturating_add(1);
            self.ids.push(id);
        }
        let excess = self.ids.len().saturating_sub(MAX_SPENT_APPROVALS);
        self.ids.drain(..excess);
        self
    }

    pub fn to_value(&self) -> String {
        // Strings only: always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The epoch an approval's record carries (`"epoch"` beside the
/// [`Approval`]'s fields, written by `approve`): how many approvals were
/// spent on the machine when it was issued. `None` when absent.
pub fn approval_epoch(text: &str) -> Option<u64> {
    #[derive(Deserialize)]
    struct Epoch {
        epoch: Option<u64>,
    }
    serde_json::from_str::<Epoch>(text).ok()?.epoch
}

/// `approval`'s record as `approve` seals it: its fields and, when known,
/// the epoch ([`approval_epoch`]).
pub fn approval_record(approval: &Approval, epoch: Option<u64>) -> String {
    let Some(e) = epoch else {
        // As before epochs: the approval's own serialization.
        return serde_json::to_string(approval).unwrap_or_default();
    };
    let mut value = serde_json::to_value(approval).unwrap_or_default();
    if let Some(object) = value.as_object_mut() {
        object.insert("epoch".into(), e.into());
    }
    value.to_string()
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

    /// The spent list counts every approval ever spent, past the ids it
    /// keeps; a list written before the count counts what it holds; an id
    /// listed again is not counted twice. An approval's epoch is read back
    /// from its record, which still parses as the approval.
    #[test]
    fn the_spent_list_counts_past_what_it_keeps() {
        let old = SpentApprovals::parse(r#"{"ids":["a","b"]}"#).unwrap();
        assert_eq!((old.count(), old.consumed), (2, 0));
        let mut list = old.with(ApprovalId::of("c"));
        assert_eq!(list.count(), 3);
        list = list.with(ApprovalId::of("c"));
        assert_eq!(list.count(), 3);
        for i in 0..100 {
            list = list.with(ApprovalId::of(&i.to_string()));
        }
        assert_eq!((list.count(), list.ids.len()), (103, MAX_SPENT_APPROVALS));
        let parsed = SpentApprovals::parse(&list.to_value()).unwrap();
        assert_eq!(parsed, list);
        let a = Approval {
            target: CommitId::parse(&"a".repeat(40)).expect("a commit id"),
            mode: ApprovalMode::Now,
            by: "alice".into(),
            at: DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
        };
        let record = approval_record(&a, Some(7));
        assert_eq!(approval_epoch(&record), Some(7));
        assert_eq!(Approval::parse(&record), Some(a.clone()));
        let plain = approval_record(&a, None);
        assert_eq!(approval_epoch(&plain), None);
        assert_eq!(plain, serde_json::to_string(&a).unwrap());
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

//! What one machine's metadata says to the planner: the operator's hold and
//! approval, the rotation marker and the probe-failure record, parsed once
//! when the sweep folds the machine into its report, and which approval is
//! there ([`ApprovalId`], a fingerprint of its value: a rotation names the
//! approval it used, and consumes only that one).
//!
//! Owns reading those four keys (their formats are [`super::operator`],
//! [`super::marker`] and [`super::unprobed`]) and judging whether each value
//! is one we sealed ([`super::seal`]): with the record keys ([`Trust::Verify`]),
//! a marker, unprobed record or approval that is unsigned or does not verify
//! is not ours — the marker is foreign (unreadable: left alone), the other
//! two count as absent — and each is listed in [`Controls::tampered`] for the
//! `metadata_tampered` alert. A hold holds whatever its value (fail closed).
//! An approval the coordinator lists as consumed
//! ([`Controls::with_spent_approvals`]) approves nothing.
//! Without keys ([`Trust::AsWritten`]: observe-only, nothing acts) values are
//! read as written. The planner, the status pages and
//! the API read these values rather than parsing metadata again, so they
//! cannot disagree about what a value means. It must never do I/O, and it
//! never judges a value against the clock (the planner's `plausible` does).

use std::collections::BTreeMap;

use super::marker::Marker;
use super::operator::{Approval, ApprovalId, Hold, SpentApprovals};
use super::seal::{Forgery, Opened, RecordKeys};
use super::unprobed::Unprobed;
use super::{APPROVE_KEY, HOLD_KEY, MARKER_KEY, UNPROBED_KEY};
use crate::model::CommitId;

/// How a reader takes the values it finds.
#[derive(Clone, Copy, Debug)]
pub enum Trust<'k> {
    /// Only values sealed by these keys for this machine and key count.
    Verify(&'k RecordKeys),
    /// No record key (observe-only: nothing acts): values as written, a
    /// sealed one's body unverified.
    AsWritten,
}

impl<'k> Trust<'k> {
    pub fn of(keys: Option<&'k RecordKeys>) -> Trust<'k> {
        keys.map_or(Trust::AsWritten, Trust::Verify)
    }

    /// The record text of `key_name`'s `value` on `machine_id`, or what was
    /// found instead.
    pub fn open(self, machine_id: &str, key_name: &str, value: &str) -> Result<String, Found> {
        match self {
            Trust::Verify(keys) => match keys.open(machine_id, key_name, value) {
                Opened::Sealed { body, .. } => Ok(body),
                Opened::Unsigned(_) => Err(Found::Unsigned),
                Opened::Forged(f) => Err(Found::Forged(f)),
            },
            Trust::AsWritten => {
                Ok(super::seal::body_unverified(value).unwrap_or_else(|| value.to_string()))
            }
        }
    }

    /// Whether the value verifies only with the previous key (a key
    /// rotation in progress: it is re-sealed with the current key when
    /// rewritten).
    pub fn by_previous(self, machine_id: &str, key_name: &str, value: &str) -> bool {
        match self {
            Trust::Verify(keys) => matches!(
                keys.open(machine_id, key_name, value),
                Opened::Sealed {
                    by_previous: true,
                    ..
                }
            ),
            Trust::AsWritten => false,
        }
    }

    /// `body` as the value to write under `key_name` on `machine_id`:
    /// sealed with the current key (as written without keys, where nothing acts).
    pub fn seal(self, machine_id: &str, key_name: &str, body: &str) -> String {
        match self {
            Trust::Verify(keys) => keys.seal(machine_id, key_name, body),
            Trust::AsWritten => body.to_string(),
        }
    }
}

/// What was found in place of one of our sealed records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// A value without a seal: written by a version before sealing, or by anyone.
    Unsigned,
    /// A seal that does not verify.
    Forged(Forgery),
    /// Gone without our release or clear: a hold whose coordinator copy
    /// stands, or a probe-failure record this replica saw (either still counts).
    Removed,
    /// A sealed approval a rotation already consumed, written back: the
    /// coordinator lists it as spent.
    Replayed,
}

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Found::Unsigned => f.write_str(
                "an unsigned value (written by an agent, or by a reconciler before record sealing)",
            ),
            Found::Forged(why) => write!(f, "{why}"),
            Found::Removed => f.write_str(
                "deleted without an authenticated release or clear; what it recorded still counts",
            ),
            Found::Replayed => f.write_str(
                "an approval a rotation already consumed, written back (replayed); it approves nothing",
            ),
        }
    }
}

/// One metadata key whose value is not the record we sealed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tampered {
    pub key: &'static str,
    pub found: Found,
}

/// One machine's controls, as its metadata held them when it was listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Controls {
    /// The hold, when the machine has one. Any value holds.
    pub hold: Option<HoldValue>,
    /// The approval key's value: an approval, or why it is not one.
    pub approval: Option<Result<Approval, String>>,
    /// Which approval that is (a fingerprint of its value), when it is one.
    pub approval_id: Option<ApprovalId>,
    /// The epoch its record carries ([`super::operator::approval_epoch`]).
    pub approval_epoch: Option<u64>,
    /// The rotation marker, or why it is not one of ours (the field at fault).
    pub marker: Option<Result<Marker, String>>,
    /// The persisted probe-failure record (an unreadable one counts as none:
    /// it only ever delays the probe-failure ceiling).
    pub unprobed: Option<Unprobed>,
    /// The fingerprint of the probe-failure record a replica cleared, when
    /// the key holds our [`Cleared`](super::unprobed::Cleared) instead of a record.
    pub unprobed_cleared: Option<String>,
    /// Keys whose value is not one we sealed (with [`Trust::Verify`] only).
    pub tampered: Vec<Tampered>,
    /// Keys whose value verifies only with the previous record key: to be
    /// re-sealed before `previous_key_env` is dropped (docs/operations.md).
    pub by_previous_key: Vec<&'static str>,
}

/// A hold's value: one written by `fleet-reconciler hold`, or any other text
/// (which holds just the same).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HoldValue {
    Ours(Hold),
    Other(String),
}

impl Controls {
    /// Values as written (no verification): see [`Trust::AsWritten`].
    pub fn parse(metadata: &BTreeMap<String, String>) -> Controls {
        Controls::open(metadata, "", Trust::AsWritten)
    }

    /// `machine_id`'s metadata, each sealed record verified as `trust` says.
    pub fn open(
        metadata: &BTreeMap<String, String>,
        machine_id: &str,
        trust: Trust<'_>,
    ) -> Controls {
        let mut tampered = Vec::new();
        let mut open = |key: &'static str| -> Option<Result<String, Found>> {
            let opened = trust.open(machine_id, key, metadata.get(key)?);
            if let Err(found) = &opened {
                tampered.push(Tampered {
                    key,
                    found: found.clone(),
                });
            }
            Some(opened)
        };
        let by_previous_key = [HOLD_KEY, APPROVE_KEY, MARKER_KEY, UNPROBED_KEY]
            .into_iter()
            .filter(|key| {
                metadata
                    .get(*key)
                    .is_some_and(|v| trust.by_previous(machine_id, key, v))
            })
            .collect();
        let approval_text = open(APPROVE_KEY);
        let marker_text = open(MARKER_KEY);
        let unprobed_text = open(UNPROBED_KEY);
        let approval = approval_text.as_ref().map(|opened| match opened {
            Ok(text) => Approval::decode(text),
            Err(found) => Err(format!("not an approval of this fleet: {found}")),
        });
        Controls {
            // Any value holds, sealed or not: a hold is never dropped for
            // failing to verify (fail closed).
            hold: metadata.get(HOLD_KEY).map(|v| {
                let text = Trust::AsWritten
                    .open(machine_id, HOLD_KEY, v)
                    .unwrap_or_default();
                match serde_json::from_str(&text) {
                    Ok(hold) => HoldValue::Ours(hold),
                    Err(_) => HoldValue::Other(v.clone()),
                }
            }),
            approval_id: match (&approval, &approval_text) {
                (Some(Ok(_)), Some(Ok(text))) => Some(ApprovalId::of(text)),
                _ => None,
            },
            approval_epoch: match (&approval, &approval_text) {
                (Some(Ok(_)), Some(Ok(text))) => super::operator::approval_epoch(text),
                _ => None,
            },
            approval,
            marker: marker_text.map(|opened| match opened {
                Ok(text) => Marker::decode(&text),
                Err(found) => Err(format!("not a marker of this fleet: {found}")),
            }),
            unprobed_cleared: unprobed_text
                .as_ref()
                .and_then(|opened| super::unprobed::Cleared::parse(opened.as_ref().ok()?))
                .map(|c| c.cleared),
            unprobed: unprobed_text.and_then(|opened| Unprobed::parse(&opened.ok()?)),
            tampered,
            by_previous_key,
        }
    }

    /// These controls with the coordinator's copy of the machine's hold
    /// (`value`, any text holds): where the machine's own hold is missing,
    /// it holds all the same, and the deletion is listed as tampering.
    pub fn with_coordinator_hold(mut self, value: &str) -> Controls {
        if self.hold.is_none() {
            let text = Trust::AsWritten
                .open("", HOLD_KEY, value)
                .unwrap_or_default();
            self.hold = Some(match serde_json::from_str(&text) {
                Ok(hold) => HoldValue::Ours(hold),
                Err(_) => HoldValue::Other(value.to_string()),
            });
            self.tampered.push(Tampered {
                key: HOLD_KEY,
                found: Found::Removed,
            });
        }
        self
    }

    /// These controls with the approvals spent on this machine (the
    /// coordinator's list): the approval on the machine, if listed or older
    /// than the list's memory ([`SpentApprovals::outlived`]), approves
    /// nothing. It is tampering unless the machine's own marker names it —
    /// the rotation that consumed it, between recording it spent and
    /// deleting it.
    pub fn with_spent_approvals(mut self, spent: &SpentApprovals) -> Controls {
        let Some(id) = self.approval_id.clone() else {
            return self;
        };
        if !spent.contains(&id) && !spent.outlived(self.approval_epoch) {
            return self;
        }
        self.approval = Some(Err(Found::Replayed.to_string()));
        let consuming = self
            .marker()
            .is_some_and(|m| m.approval.as_ref() == Some(&id));
        if !consuming {
            self.tampered.push(Tampered {
                key: APPROVE_KEY,
                found: Found::Replayed,
            });
        }
        self
    }

    pub fn is_held(&self) -> bool {
        self.hold.is_some()
    }

    /// The hold, when it is one of ours.
    pub fn hold(&self) -> Option<&Hold> {
        match &self.hold {
            Some(HoldValue::Ours(h)) => Some(h),
            _ => None,
        }
    }

    /// The marker, when it is one of ours.
    pub fn marker(&self) -> Option<&Marker> {
        self.marker.as_ref().and_then(|m| m.as_ref().ok())
    }

    /// The approval on the machine, whatever commit it names.
    pub fn approval(&self) -> Option<&Approval> {
        self.approval.as_ref().and_then(|a| a.as_ref().ok())
    }

    /// An approval authorizes a rotation to the commit it names, only.
    pub fn approval_for(&self, commit: &CommitId) -> Option<&Approval> {
        self.approval().filter(|a| a.approves(commit))
    }

    /// Which approval is on the machine, when it is one.
    pub fn approval_id(&self) -> Option<&ApprovalId> {
        self.approval_id.as_ref()
    }

    pub fn has_approval_key(&self) -> bool {
        self.approval.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::operator::ApprovalMode;
    use chrono::DateTime;

    fn meta(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn each_key_is_read_as_what_it_is_or_why_not() {
        let at = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let hold = serde_json::to_string(&Hold {
            by: "ops".into(),
            reason: "incident".into(),
            at,
        })
        .unwrap();
        let target = CommitId::parse(&"a".repeat(40)).expect("a commit id");
        let approval = serde_json::to_string(&Approval {
            target: target.clone(),
            mode: ApprovalMode::Now,
            by: "ops".into(),
            at,
        })
        .unwrap();
        let c = Controls::parse(&meta(&[(HOLD_KEY, &hold), (APPROVE_KEY, &approval)]));
        assert_eq!(c.hold().map(|h| h.by.as_str()), Some("ops"));
        assert!(c.approval_for(&target).is_some());
        let other = CommitId::parse(&"b".repeat(40)).expect("a commit id");
        assert!(c.approval_for(&other).is_none());
        assert_eq!((c.marker.clone(), c.unprobed.clone()), (None, None));

        let c = Controls::parse(&meta(&[
            (HOLD_KEY, "ops says wait"),
            (APPROVE_KEY, "yes"),
            (MARKER_KEY, "{garbage"),
            (UNPROBED_KEY, "nope"),
        ]));
        assert!(c.is_held());
        assert_eq!(c.hold, Some(HoldValue::Other("ops says wait".into())));
        assert!(c.has_approval_key() && c.approval().is_none());
        assert!(matches!(c.marker, Some(Err(_))));
        assert_eq!(c.unprobed, None);

        let c = Controls::parse(&BTreeMap::new());
        assert_eq!(c, Controls::default());
        assert!(!c.is_held() && !c.has_approval_key());
    }

    /// During a key rotation a record sealed with the previous key is ours
    /// (not tampered) and is listed as still to be re-sealed; one sealed
    /// with a key no longer held is tampered.
    #[test]
    fn a_record_sealed_with_the_previous_key_counts_and_is_listed() {
        use crate::metadata::seal::{RecordKey, RecordKeys};
        let key = |b: u8| RecordKey::from_hex(&hex::encode([b; 32])).unwrap();
        let old = RecordKeys::new(key(1));
        let marker = r#"{"tag":"t","target":"abababababababababababababababababababab","phase":"draining","mode":"wait","action":"restart","severity":"high","started_at":"2026-01-01T00:00:00Z","attempt_started_at":"2026-01-01T00:00:00Z","owner":"r"}"#;
        let value = old.seal("m1", MARKER_KEY, marker);
        let rotating = RecordKeys {
            current: key(2),
            previous: Some(key(1)),
        };
        let c = Controls::open(
            &meta(&[(MARKER_KEY, &value)]),
            "m1",
            Trust::Verify(&rotating),
        );
        assert!(c.marker().is_some() && c.tampered.is_empty());
        assert_eq!(c.by_previous_key, [MARKER_KEY]);
        let rotated = RecordKeys::new(key(2));
        let c = Controls::open(
            &meta(&[(MARKER_KEY, &value)]),
            "m1",
            Trust::Verify(&rotated),
        );
        assert!(c.marker().is_none() && c.by_previous_key.is_empty());
        assert_eq!(c.tampered.len(), 1);
    }

    /// The coordinator's copy holds where the machine's was deleted, and the
    /// deletion is listed; where the machine's stands, nothing changes.
    #[test]
    fn the_coordinators_hold_stands_in_for_a_deleted_one() {
        let c = Controls::parse(&BTreeMap::new()).with_coordinator_hold("ops");
        assert!(c.is_held());
        assert_eq!(
            c.tampered,
            [Tampered {
                key: HOLD_KEY,
                found: Found::Removed
            }]
        );
        let c = Controls::parse(&meta(&[(HOLD_KEY, "ops")])).with_coordinator_hold("ops");
        assert!(c.is_held() && c.tampered.is_empty());
    }

    /// The list keeps the last 64 ids only (#33, what remained, item 3).
    /// Before: once 64 more approvals were spent on a machine, the first
    /// one's id fell off and written back it approved again. An approval
    /// older than the list's memory approves nothing: one without an epoch
    /// once the list has dropped any id, one with an epoch (the count of
    /// spent approvals when it was issued) once two more were spent since.
    #[test]
    fn an_approval_older_than_the_spent_lists_memory_approves_nothing() {
        let at = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let target = CommitId::parse(&"ab".repeat(20)).unwrap();
        let approval = serde_json::to_string(&Approval {
            target: target.clone(),
            mode: ApprovalMode::Now,
            by: "alice".into(),
            at,
        })
        .unwrap();
        let c = Controls::parse(&meta(&[(APPROVE_KEY, &approval)]));
        let mut spent = SpentApprovals::default().with(c.approval_id().cloned().unwrap());
        for i in 0..crate::metadata::operator::MAX_SPENT_APPROVALS {
            spent = spent.with(ApprovalId::of(&format!("later {i}")));
        }
        assert!(!spent.contains(c.approval_id().unwrap()), "fell off");
        let replayed = c.clone().with_spent_approvals(&spent);
        assert!(
            replayed.approval_for(&target).is_none(),
            "an approval whose id fell off the spent list approved again"
        );
        assert_eq!(
            replayed.tampered,
            [Tampered {
                key: APPROVE_KEY,
                found: Found::Replayed,
            }]
        );
        // With the epoch `approve` writes: issued when `e` were spent, it
        // stands through one more spend (the rotation its issue raced) and
        // no further, whatever the ids still listed.
        let issued_at = |e: u64| {
            let record = crate::metadata::operator::approval_record(
                &Approval {
                    target: target.clone(),
                    mode: ApprovalMode::Now,
                    by: "alice".into(),
                    at,
                },
                Some(e),
            );
            Controls::parse(&meta(&[(APPROVE_KEY, &record)]))
        };
        let counted = |n: u64| SpentApprovals {
            ids: Vec::new(),
            consumed: n,
        };
        assert_eq!(issued_at(64).approval_epoch, Some(64));
        assert!(issued_at(64).approval_for(&target).is_some());
        for (spent, stands) in [(64, true), (65, true), (66, false), (200, false)] {
            let c = issued_at(64).with_spent_approvals(&counted(spent));
            assert_eq!(c.approval_for(&target).is_some(), stands, "{spent}");
        }
        // Without an epoch: it stands while the list has forgotten nothing.
        let legacy = Controls::parse(&meta(&[(APPROVE_KEY, &approval)]));
        let remembers_all = SpentApprovals::default().with(ApprovalId::of("other"));
        assert!(
            legacy
                .with_spent_approvals(&remembers_all)
                .approval_for(&target)
                .is_some()
        );
    }

    /// An approval the coordinator lists as consumed approves nothing; it is
    /// tampering unless the machine's marker names it (the rotation that
    /// consumed it, before its delete); one not listed is untouched.
    #[test]
    fn a_spent_approval_approves_nothing_and_a_replay_is_alerted() {
        let at = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let target = CommitId::parse(&"ab".repeat(20)).unwrap();
        let approval = serde_json::to_string(&Approval {
            target: target.clone(),
            mode: ApprovalMode::Now,
            by: "alice".into(),
            at,
        })
        .unwrap();
        let c = Controls::parse(&meta(&[(APPROVE_KEY, &approval)]));
        let id = c.approval_id().cloned().unwrap();
        assert!(c.approval_for(&target).is_some());
        let other = SpentApprovals::default().with(ApprovalId::of("another"));
        assert_eq!(c.clone().with_spent_approvals(&other), c);

        let spent = other.with(id.clone());
        let replayed = c.clone().with_spent_approvals(&spent);
        assert!(replayed.approval_for(&target).is_none());
        assert_eq!(replayed.approval_id(), Some(&id), "still named, to consume");
        assert_eq!(
            replayed.tampered,
            [Tampered {
                key: APPROVE_KEY,
                found: Found::Replayed,
            }]
        );

        let marker = format!(
            r#"{{"tag":"t","target":"{target}","phase":"releasing","mode":"wait","action":"manual","severity":"high","started_at":"2026-01-01T00:00:00Z","attempt_started_at":"2026-01-01T00:00:00Z","owner":"r","approval":"{}"}}"#,
            id.as_str()
        );
        let c = Controls::parse(&meta(&[(APPROVE_KEY, &approval), (MARKER_KEY, &marker)]));
        assert!(c.marker().is_some(), "{:?}", c.marker);
        let consuming = c.with_spent_approvals(&spent);
        assert!(consuming.approval_for(&target).is_none());
        assert!(consuming.tampered.is_empty(), "{:?}", consuming.tampered);
    }
}

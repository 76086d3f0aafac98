//! What one machine's metadata says to the planner: the operator's hold and
//! approval, the rotation marker and the probe-failure record, parsed once
//! when the sweep folds the machine into its report, and which approval is
//! there ([`ApprovalId`], a fingerprint of its value: a rotation names the
//! approval it used, and consumes only that one).
//!
//! Owns reading those four keys (their formats are [`super::operator`],
//! [`super::marker`] and [`super::unprobed`]). The planner, the status pages and
//! the API read these values rather than parsing metadata again, so they
//! cannot disagree about what a value means. It must never do I/O, and it
//! never judges a value against the clock (the planner's `plausible` does).

use std::collections::BTreeMap;

use super::marker::Marker;
use super::operator::{Approval, ApprovalId, Hold};
use super::unprobed::Unprobed;
use super::{APPROVE_KEY, HOLD_KEY, MARKER_KEY, UNPROBED_KEY};
use crate::model::CommitId;

/// One machine's controls, as its metadata held them when it was listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Controls {
    /// The hold, when the machine has one. Any value holds.
    pub hold: Option<HoldValue>,
    /// The approval key's value: an approval, or why it is not one.
    pub approval: Option<Result<Approval, String>>,
    /// Which approval that is (a fingerprint of its value), when it is one.
    pub approval_id: Option<ApprovalId>,
    /// The rotation marker, or why it is not one of ours (the field at fault).
    pub marker: Option<Result<Marker, String>>,
    /// The persisted probe-failure record (an unreadable one counts as none:
    /// it only ever delays the probe-failure ceiling).
    pub unprobed: Option<Unprobed>,
}

/// A hold's value: one written by `fleet-reconciler hold`, or any other text
/// (which holds just the same).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HoldValue {
    Ours(Hold),
    Other(String),
}

impl Controls {
    pub fn parse(metadata: &BTreeMap<String, String>) -> Controls {
        Controls {
            hold: metadata
                .get(HOLD_KEY)
                .map(|v| match serde_json::from_str(v) {
                    Ok(hold) => HoldValue::Ours(hold),
                    Err(_) => HoldValue::Other(v.clone()),
                }),
            approval: metadata.get(APPROVE_KEY).map(|v| Approval::decode(v)),
            approval_id: metadata
                .get(APPROVE_KEY)
                .filter(|v| Approval::parse(v).is_some())
                .map(|v| ApprovalId::of(v)),
            marker: metadata.get(MARKER_KEY).map(|v| Marker::decode(v)),
            unprobed: metadata.get(UNPROBED_KEY).and_then(|v| Unprobed::parse(v)),
        }
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
}

//! The rotation marker: a rotation's state, persisted in Fly machine metadata.
//!
//! Owns the marker's format (JSON under [`MARKER_KEY`](super::MARKER_KEY))
//! and its parse, with the bounds on its texts; the planner decides its
//! phases (and judges its timestamps against `now`), `act::executor` writes
//! it. Because the marker lives on the machine, a restarted reconciler (or
//! another replica) resumes each rotation where it stood, and its clocks
//! continue from the recorded timestamps. It must never do I/O.
//!
//! A marker is written *before* each disruptive call it describes (the claim
//! before the slot is taken, `cordoned` before the cordon, `restarting` before
//! the restart), so a crash or a lost answer between any two calls leaves a
//! marker that says what may have happened, and the next sweep can finish or
//! undo it. Pool caps are kept by [`super::slots`], not by the markers.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::operator::{ApprovalId, MAX_APPROVAL_ID_CHARS};
use crate::model::{CommitId, PolicyAction, PoolName, Severity};

/// Where a rotation stands (docs/design.md §6.2).
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantArray,
    strum::Display,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Phase {
    /// Intent written; the pool slot is not won yet. Permits no cordon, no
    /// drain, no restart, and holds no slot: it either wins a slot in the
    /// coordinator and moves on, or is withdrawn.
    Claiming,
    /// Slot won, machine cordoned (and drain requested): waiting for a
    /// natural stop point, or for `restart_grace` under `restart`.
    Draining,
    /// Asked a `reload`-capable agent to load the tip in place.
    Reloading,
    /// Restart requested; waiting for the machine to start and report the
    /// tip within `verify_deadline` (shown as `verifying` once started).
    Restarting,
    /// Verify failed: the machine stays cordoned until `retry_at`.
    Backoff,
    /// Undoing what the rotation did (uncordon, undrain), retried every sweep
    /// until both succeeded; then the rotation ends as `ending` says.
    Releasing,
    /// Hit a ceiling: uncordoned, undrained, slot released, retried after `retry_at`.
    Yielded,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Whether the rotation holds one of its pool's slots: its machine's
    /// capacity may be out of the pool (cordoned, fenced or restarting).
    pub fn holds_slot(self) -> bool {
        !matches!(self, Phase::Claiming | Phase::Yielded)
    }
}

/// How a `releasing` rotation ends once its undo succeeded.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Ending {
    /// The machine runs the target: marker (and approval) cleared.
    Finished,
    /// A ceiling was reached: the marker stays as `yielded` until `retry_at`.
    Yielded,
    /// The rotation cannot go on (approval revoked, tip moved past the
    /// approved commit, machine stopped, no slot): marker cleared.
    Cancelled,
}

impl Ending {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// How the restart of this rotation is authorized.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantArray,
    schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum RotationMode {
    /// Only at a fresh report with no live work (`alert-and-wait`, `approve --when-idle`).
    Wait,
    /// Like `Wait`, but after `restart_grace` restart anyway (`restart`).
    Grace,
    /// Restart at once: only an operator's `approve` (a ceiling never does).
    Now,
    /// Ask the agent to reload in place; fall back to `Wait`.
    Reload,
}

impl RotationMode {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// The persisted state of one rotation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// Identifies this rotation to a cooperating agent (drain/undrain).
    pub tag: String,
    /// The commit the machine is being rotated to (the tip when claimed).
    /// Read as any commit id is (see [`CommitId`]): a marker written by an
    /// older reconciler with an upper-case target reads as its lowercase
    /// commit; any other text makes the marker unreadable (field `target`).
    pub target: CommitId,
    pub phase: Phase,
    pub mode: RotationMode,
    /// The pool policy's action that started it (for reports and events).
    pub action: PolicyAction,
    pub severity: Severity,
    /// When the rotation was claimed (reports and the rotation history).
    pub started_at: DateTime<Utc>,
    /// When the current attempt (drain, reload, restart) began; deadlines count from here.
    pub attempt_started_at: DateTime<Utc>,
    /// Restarts of `target` that did not verify (drives the capped backoff
    /// and `rotation.max_attempts`). A claim that replaces a `yielded`
    /// marker of the same target carries it on; a cancelled rotation's
    /// marker is deleted, and its count with it.
    #[serde(default)]
    pub attempt: u32,
    /// The reconciler instance that claimed it.
    pub owner: String,
    /// When the restart was requested (phase `restarting`).
    #[serde(default)]
    pub restart_at: Option<DateTime<Utc>>,
    /// When a yielded or backed-off rotation may try again.
    #[serde(default)]
    pub retry_at: Option<DateTime<Utc>>,
    /// Whether a drain was requested from a cooperating agent. Once set it
    /// stays set: the restart then needs the agent's checkpoint, whatever
    /// capabilities later reports advertise.
    #[serde(default)]
    pub drain_requested: bool,
    /// Whether this rotation may have cordoned the machine: written before
    /// the cordon call, so a cordon whose answer was lost is undone too.
    /// `None` (markers of older versions): implied by the phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cordoned: Option<bool>,
    /// Phase `releasing`: how the rotation ends once undone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ending: Option<Ending>,
    /// The machine's Fly `instance_id` when the rotation claimed it and when
    /// it restarted it (a restart keeps it). Another value later means the
    /// machine was updated from outside (`fly deploy`): the plan this marker
    /// describes is stale. `None`: markers of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// The pool whose slot the rotation won. A pool label edited mid-rotation
    /// does not move the rotation: it ends in this pool. `None`: markers of
    /// older versions (the machine's current pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolName>,
    /// The rotation gave up after `rotation.max_attempts` restarts that did
    /// not verify (or crash-looped). Kept on the `yielded` marker it ends as,
    /// so no new attempt starts for `target` until the tip moves or an
    /// operator approves again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<Failure>,
    /// The approval this rotation uses: a `manual` claim's, or the one that
    /// re-armed a failed target. An approval authorizes one rotation: once
    /// this one has restarted, its ending (whatever it is) deletes that
    /// approval, if it is still the one on the machine (a newer one stays).
    /// `None`: an automatic rotation, or markers of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalId>,
}

/// Why a rotation ended as failed, with the evidence (for the alert and views).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub at: DateTime<Utc>,
    /// Restarts made for this target.
    pub attempts: u32,
    /// What the last attempt showed (bounded like any detail text).
    pub evidence: String,
    /// The approval that stood when it failed: only another one re-arms the
    /// target (no timestamps of two clocks compared). `None`: none stood,
    /// or a failure recorded by an older version; then any approval of the
    /// target re-arms it, and the rotation it re-arms consumes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalId>,
}

/// Longest `owner` a marker may carry (ours are a host name and a pid).
pub const MAX_MARKER_OWNER_CHARS: usize = 512;

impl Marker {
    /// Parses a metadata value. `None` for anything malformed; callers treat a
    /// malformed marker as "someone's rotation we do not understand".
    pub fn parse(value: &str) -> Option<Marker> {
        Marker::decode(value).ok()
    }

    /// [`Marker::parse`], saying why a value is not a marker: the field at
    /// fault and what is wrong with it, in at most
    /// [`MAX_DETAIL_CHARS`](crate::text::MAX_DETAIL_CHARS) characters.
    /// Texts are bounded: a tag longer than
    /// [`MAX_TAG_CHARS`](crate::text::MAX_TAG_CHARS) (the longest checkpoint
    /// an agent may report, so such a rotation could never be checkpointed),
    /// a target or an owner longer than ours can be, make it malformed.
    pub fn decode(value: &str) -> Result<Marker, String> {
        let marker: Marker = crate::text::decode_json(value)?;
        let too_long =
            |field: &str, max: usize| Err(format!("field `{field}`: longer than {max} characters"));
        if marker.tag.chars().count() > crate::text::MAX_TAG_CHARS {
            return too_long("tag", crate::text::MAX_TAG_CHARS);
        }
        if marker.owner.chars().count() > MAX_MARKER_OWNER_CHARS {
            return too_long("owner", MAX_MARKER_OWNER_CHARS);
        }
        let detail = crate::text::MAX_DETAIL_CHARS;
        if marker
            .instance_id
            .as_ref()
            .is_some_and(|v| v.chars().count() > detail)
        {
            return too_long("instance_id", detail);
        }
        if marker
            .pool
            .as_ref()
            .is_some_and(|v| v.as_str().chars().count() > detail)
        {
            return too_long("pool", detail);
        }
        if marker
            .failed
            .as_ref()
            .is_some_and(|f| f.evidence.chars().count() > detail)
        {
            return too_long("failed.evidence", detail);
        }
        let long_id = |id: &Option<ApprovalId>| {
            id.as_ref()
                .is_some_and(|id| id.as_str().chars().count() > MAX_APPROVAL_ID_CHARS)
        };
        if long_id(&marker.approval) {
            return too_long("approval", MAX_APPROVAL_ID_CHARS);
        }
        if marker.failed.as_ref().is_some_and(|f| long_id(&f.approval)) {
            return too_long("failed.approval", MAX_APPROVAL_ID_CHARS);
        }
        Ok(marker)
    }

    pub fn to_value(&self) -> String {
        // A struct of strings, enums and timestamps always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A tag unique to this machine, target and moment. `nonce` tells apart
    /// two claims of one machine within a second (tags name slots, and a slot
    /// is reclaimed only once no marker carries its tag).
    pub fn new_tag(machine_id: &str, target: &CommitId, now: DateTime<Utc>, nonce: u32) -> String {
        let target = target.as_str();
        format!(
            "{machine_id}-{}-{}-{nonce:08x}",
            target.get(..7).unwrap_or(target),
            now.timestamp()
        )
    }

    /// The pool the rotation's slot is in: the one recorded at the claim, else
    /// (older markers) the machine's current pool.
    pub fn pool_or<'a>(&'a self, current: &'a PoolName) -> &'a PoolName {
        self.pool.as_ref().unwrap_or(current)
    }

    /// Whether the machine may be cordoned by this rotation (so undo uncordons).
    pub fn may_have_cordoned(&self) -> bool {
        self.cordoned.unwrap_or(matches!(
            self.phase,
            Phase::Draining | Phase::Restarting | Phase::Backoff | Phase::Releasing
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    #[test]
    fn marker_round_trips_and_rejects_garbage() {
        let target = CommitId::parse(&"ab".repeat(20)).expect("a commit id");
        let m = Marker {
            tag: Marker::new_tag("m1", &target, at(0), 0xbeef),
            target: target.clone(),
            phase: Phase::Draining,
            mode: RotationMode::Grace,
            action: PolicyAction::Restart,
            severity: Severity::High,
            started_at: at(0),
            attempt_started_at: at(5),
            attempt: 0,
            owner: "r1".into(),
            restart_at: None,
            retry_at: None,
            drain_requested: true,
            cordoned: Some(true),
            ending: None,
            instance_id: Some("01H".into()),
            pool: Some("default".into()),
            failed: None,
            approval: Some(ApprovalId::of("{}")),
        };
        assert_eq!(m.tag, "m1-abababa-1800000000-0000beef");
        let v = m.to_value();
        assert!(
            v.contains("\"phase\":\"draining\"") && v.contains("\"mode\":\"grace\""),
            "{v}"
        );
        assert_eq!(Marker::parse(&v), Some(m.clone()));
        assert_eq!(Marker::parse("{}"), None);
        // An approval id is bounded like any text of ours.
        let long = v.replace(
            &format!("\"approval\":\"{}\"", ApprovalId::of("{}").as_str()),
            &format!("\"approval\":\"{}\"", "a".repeat(65)),
        );
        assert_ne!(long, v);
        let why = Marker::decode(&long).expect_err("too long");
        assert!(why.contains("`approval`"), "{why}");
        assert_eq!(Marker::parse("rotating"), None);
    }

    /// Older reconcilers wrote `target` as text: in another case it is the
    /// same commit (and is written back lowercase); anything else is no
    /// commit id, and the marker is unreadable, naming the field.
    #[test]
    fn an_older_target_reads_as_its_commit_or_is_refused() {
        let value = |target: &str| {
            format!(
                r#"{{"tag":"t","target":"{target}","phase":"draining","mode":"wait","action":"restart","severity":"high","started_at":"2026-01-01T00:00:00Z","attempt_started_at":"2026-01-01T00:00:00Z","owner":"r"}}"#
            )
        };
        let upper = "ABCDEF0123".repeat(4);
        let m = Marker::decode(&value(&upper)).expect("an upper-case commit id reads");
        assert_eq!(m.target.as_str(), upper.to_ascii_lowercase());
        assert_eq!(
            m.to_value(),
            serde_json::to_string(&Marker::parse(&value(&upper.to_ascii_lowercase())))
                .unwrap_or_default()
        );
        for odd in [
            "ab",
            &"a".repeat(64),
            &"z".repeat(40),
            " ",
            &format!(" {}", "a".repeat(40)),
        ] {
            let why = Marker::decode(&value(odd)).expect_err(odd);
            assert!(
                why.contains("`target`") && why.contains("not a commit id"),
                "{why}"
            );
        }
        let why = Marker::decode(&value(&"x".repeat(5000))).expect_err("long");
        assert!(
            why.chars().count() <= crate::text::MAX_DETAIL_CHARS + 1,
            "{why}"
        );
    }

    #[test]
    fn older_markers_imply_the_cordon_from_their_phase() {
        let v = r#"{"tag":"t","target":"abababababababababababababababababababab","phase":"draining","mode":"wait","action":"restart","severity":"high","started_at":"2026-01-01T00:00:00Z","attempt_started_at":"2026-01-01T00:00:00Z","owner":"r"}"#;
        let m = Marker::parse(v).unwrap();
        assert_eq!(m.cordoned, None);
        // Nor did they name an approval, or a count beyond their own.
        assert_eq!((m.approval.clone(), m.attempt), (None, 0));
        assert!(m.may_have_cordoned());
        let claiming = Marker {
            phase: Phase::Claiming,
            ..m.clone()
        };
        assert!(!claiming.may_have_cordoned());
        assert!(!Phase::Claiming.holds_slot() && !Phase::Yielded.holds_slot());
        assert!(Phase::Releasing.holds_slot());
    }
}

//! Steps: what the executor is asked to do for one machine, and why.
//!
//! Owns the shape of a step (its target, the marker it was planned from, its
//! kind), the reasons a step gives, as enums whose text is the step's
//! description, and that description ([`StepText`]: the step's `Display`
//! and its history line both write it). It must never decide a step (that is [`super::planner`]'s)
//! nor perform one (that is [`crate::act::executor`]'s).

use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::metadata::marker::{Ending, Marker, Phase, RotationMode};
use crate::metadata::unprobed::Unprobed;
use crate::model::{AppName, MachineId, PoolName};

/// Which machine a step is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub app: AppName,
    pub machine_id: MachineId,
    pub pool: PoolName,
    /// The agent's health URL; cooperative endpoints resolve against it.
    pub health_url: Option<String>,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.app, self.machine_id)
    }
}

/// One thing the executor must do, for one machine. Every step holds the
/// machine's lease, first checks that there is no hold and that the marker
/// is still `expected` (another replica may have acted since the snapshot),
/// and writes its marker before acting.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub target: Target,
    /// The marker this step was planned from (`None`: no rotation yet).
    pub expected: Option<Marker>,
    pub kind: StepKind,
}

/// What may interrupt live work at a restart, re-checked by the executor on a
/// fresh probe made under the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartGuard {
    /// The policy allows interrupting live work: `restart` past its grace, or
    /// an operator's `approve` (whose approval must still stand).
    MayInterrupt,
    /// Only if a fresh report shows no live work (and, after a drain request,
    /// the agent's own checkpoint with a fresh heartbeat).
    Idle,
    /// The agent gave no usable report past the probe-failure ceiling: only if
    /// it still gives none; an agent that answers again is judged as `Idle`.
    Unprobeable,
}

/// Whether a release asks the agent to lift its fence (`overlay/undrain`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Undrain {
    /// A drain was asked of an agent that still runs and does not report
    /// itself unfenced.
    Needed,
    /// The snapshot shows no fence to lift; the executor still undrains when
    /// the marker says a drain may have been asked since (judged under the
    /// lease: a lost answer, another replica's retry).
    NotNeeded,
    /// Never asked, whatever the marker says: the planner gave it up (an
    /// agent unreachable past `rotation.release_ceiling`, alerted), or an
    /// outside update restarted the agent, which lifted its fence. Asking
    /// anyway would fail every sweep and keep the slot forever.
    GivenUp,
}

#[derive(Clone, Debug, PartialEq)]
pub enum StepKind {
    /// Write the `claiming` marker (unless it is already there), win a slot in
    /// the coordinator's slot set, then write the first phase and cordon
    /// (unless reloading) and ask a cooperating agent to drain, or to reload.
    Claim {
        marker: Marker,
        drain: bool,
        reload: bool,
    },
    /// Delete a `claiming` marker that cannot go on (nothing was cordoned).
    Withdraw { why: WithdrawWhy },
    /// Write the changed marker; with `cordon`, cordon the machine and (when
    /// the marker says so) ask the agent to drain.
    Advance {
        marker: Marker,
        cordon: bool,
        why: AdvanceWhy,
    },
    /// Ask the agent to drain again: its report shows no fence.
    Drain,
    /// Write the marker (phase `restarting`), restart, wait for `started`.
    Restart {
        marker: Marker,
        guard: RestartGuard,
        why: RestartWhy,
    },
    /// Undo what the rotation did: write the `releasing` marker, uncordon (if
    /// it may have cordoned, or Fly shows it cordoned), undrain (as `undrain`
    /// says), then end as `marker.ending` says; the slot is released last.
    Release {
        marker: Marker,
        undrain: Undrain,
        clear_approval: bool,
        why: ReleaseWhy,
    },
    /// Persist when the agent stopped giving usable reports, and the drift it
    /// last showed, so the probe-failure ceiling survives daemon restarts.
    RecordUnprobed { record: Unprobed },
    /// The agent answers again: the record goes.
    ClearUnprobed,
}

impl Step {
    /// The marker the step writes, if any.
    pub fn new_marker(&self) -> Option<&Marker> {
        match &self.kind {
            StepKind::Claim { marker, .. }
            | StepKind::Advance { marker, .. }
            | StepKind::Restart { marker, .. }
            | StepKind::Release { marker, .. } => Some(marker),
            StepKind::Withdraw { .. }
            | StepKind::Drain
            | StepKind::RecordUnprobed { .. }
            | StepKind::ClearUnprobed => None,
        }
    }

    /// Steps that may only be taken while the rotation's slot is in the set:
    /// the disruptive ones (the executor re-checks them as such).
    pub fn needs_slot(&self) -> bool {
        matches!(
            self.kind,
            StepKind::Claim { .. }
                | StepKind::Drain
                | StepKind::Restart { .. }
                | StepKind::Advance { cordon: true, .. }
        )
    }

    /// Keeping the probe-failure record, not a rotation step.
    pub fn is_bookkeeping(&self) -> bool {
        matches!(
            self.kind,
            StepKind::RecordUnprobed { .. } | StepKind::ClearUnprobed
        )
    }

    /// What a dashboard calls this step.
    pub fn label(&self) -> StepLabel {
        match &self.kind {
            StepKind::Claim { .. } => StepLabel::Claim,
            StepKind::Withdraw { .. } => StepLabel::Withdraw,
            StepKind::Advance { .. } => StepLabel::Advance,
            StepKind::Drain => StepLabel::Drain,
            StepKind::Restart { .. } => StepLabel::Restart,
            // The undo is labelled by how the rotation ends (stable labels
            // for dashboards: `finish` and `yield` predate `releasing`).
            StepKind::Release { marker, .. } if marker.failed.is_some() => StepLabel::Fail,
            StepKind::Release { marker, .. } => match marker.ending {
                Some(Ending::Finished) => StepLabel::Finish,
                Some(Ending::Yielded) => StepLabel::Yield,
                Some(Ending::Cancelled) | None => StepLabel::Cancel,
            },
            StepKind::RecordUnprobed { .. } => StepLabel::RecordUnprobed,
            StepKind::ClearUnprobed => StepLabel::ClearUnprobed,
        }
    }

    /// Bounded label for metrics: the [`StepLabel`]'s snake-case name.
    pub fn kind(&self) -> &'static str {
        self.label().into()
    }
}

/// A step's metric label: what it does, a release named by how the rotation
/// ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::IntoStaticStr, strum::Display)]
#[strum(serialize_all = "snake_case")]
pub enum StepLabel {
    Claim,
    Withdraw,
    Advance,
    Drain,
    Restart,
    Finish,
    Yield,
    Cancel,
    Fail,
    RecordUnprobed,
    ClearUnprobed,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        StepText::of(self).write(f, &self.target)
    }
}

/// What a step's text says, less its markers and its target: the one
/// source of a step's description. [`Step`]'s `Display` writes it with the
/// step's own target, and a machine's history keeps it (small and shared,
/// `report::history`) and writes it with the machine it is filed under.
#[derive(Clone, Debug, PartialEq)]
pub enum StepText {
    Claim {
        pool: Arc<str>,
        mode: RotationMode,
        drain: bool,
        reload: bool,
    },
    Withdraw {
        why: WithdrawWhy,
    },
    Advance {
        phase: Phase,
        why: AdvanceWhy,
    },
    Drain,
    Restart {
        guard: RestartGuard,
        why: RestartWhy,
    },
    /// The rotation failed: it is undone, and not tried again for `target`.
    Fail {
        why: ReleaseWhy,
        target: Box<str>,
    },
    Yield {
        why: ReleaseWhy,
        retry_at: Option<DateTime<Utc>>,
    },
    Finish,
    Cancel {
        why: ReleaseWhy,
    },
    RecordUnprobed {
        since: DateTime<Utc>,
    },
    ClearUnprobed,
}

impl StepText {
    pub fn of(step: &Step) -> StepText {
        match &step.kind {
            StepKind::Claim {
                marker,
                drain,
                reload,
            } => StepText::Claim {
                pool: Arc::from(step.target.pool.as_str()),
                mode: marker.mode,
                drain: *drain,
                reload: *reload,
            },
            StepKind::Withdraw { why } => StepText::Withdraw { why: *why },
            StepKind::Advance { marker, why, .. } => StepText::Advance {
                phase: marker.phase,
                why: *why,
            },
            StepKind::Drain => StepText::Drain,
            StepKind::Restart { guard, why, .. } => StepText::Restart {
                guard: *guard,
                why: *why,
            },
            StepKind::Release { marker, why, .. } if marker.failed.is_some() => StepText::Fail {
                why: *why,
                target: crate::model::short_commit(marker.target.as_str()).into(),
            },
            StepKind::Release { marker, why, .. } => match marker.ending {
                Some(Ending::Yielded) => StepText::Yield {
                    why: *why,
                    retry_at: marker.retry_at,
                },
                Some(Ending::Finished) => StepText::Finish,
                Some(Ending::Cancelled) | None => StepText::Cancel { why: *why },
            },
            StepKind::RecordUnprobed { record } => StepText::RecordUnprobed {
                since: record.since,
            },
            StepKind::ClearUnprobed => StepText::ClearUnprobed,
        }
    }

    /// The text for the machine `target` names (`app/machine_id`).
    pub fn write(&self, f: &mut fmt::Formatter<'_>, target: &dyn fmt::Display) -> fmt::Result {
        match self {
            StepText::Claim {
                pool,
                mode,
                drain,
                reload,
            } => write!(
                f,
                "claim a rotation slot for {target} (pool {pool}, {} mode{}{})",
                mode.as_str(),
                if *drain { ", drain requested" } else { "" },
                if *reload { ", reload requested" } else { "" }
            ),
            StepText::Withdraw { why } => write!(f, "{target}: withdraw the claim ({why})"),
            StepText::Advance { phase, why } => write!(f, "{target}: {phase} ({why})"),
            StepText::Drain => write!(f, "{target}: ask the agent to drain again"),
            StepText::Restart { guard, why } => write!(
                f,
                "restart {target} ({why}{})",
                match guard {
                    RestartGuard::MayInterrupt => "; live work may be interrupted",
                    RestartGuard::Idle => "",
                    RestartGuard::Unprobeable => "; only if still unprobeable",
                }
            ),
            StepText::Fail {
                why,
                target: commit,
            } => write!(
                f,
                "{target}: the rotation failed ({why}); undo it and release its slot, no new attempt for {commit}"
            ),
            StepText::Yield { why, retry_at } => write!(
                f,
                "{target} yields its slot ({why}); retry at {}",
                retry_at.map(|t| t.to_rfc3339()).unwrap_or_default()
            ),
            StepText::Finish => write!(f, "{target} reports the target: uncordon and finish"),
            StepText::Cancel { why } => {
                write!(f, "{target}: rotation cancelled ({why}); undo it")
            }
            StepText::RecordUnprobed { since } => write!(
                f,
                "{target}: record that the agent gives no usable report since {}",
                since.to_rfc3339()
            ),
            StepText::ClearUnprobed => write!(f, "{target}: the agent answers again"),
        }
    }
}

/// Declares a reason enum whose `Display` is the fixed text the step's
/// description has always carried (logs, history and `plan` output keep it).
macro_rules! reasons {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal,)+ }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vdoc])* $variant,)+
        }

        impl $name {
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

reasons! {
    /// Why a `claiming` marker is withdrawn.
    WithdrawWhy {
        NoLongerQualifies => "the machine no longer qualifies for a rotation",
        PoolAtCap => "its pool is at its cap",
        ReleaseHalted => "the release is halted",
        Guarded => "a guardrail holds its pool (canary, window, alert gate)",
    }
}

reasons! {
    /// Why a rotation's marker changes phase (or its cordon is asserted again).
    AdvanceWhy {
        ReloadNotProven => "reload not proven within the verify deadline; falling back to alert-and-wait",
        VerifyFailed => "verify failed; backing off",
        BackoffElapsed => "backoff elapsed; draining again",
        CordonLostAtRestart => "the cordon was lost at the restart; asserting it again",
        CordonLostInBackoff => "the cordon was lost during the backoff; asserting it again",
    }
}

reasons! {
    /// Why a machine is restarted.
    RestartWhy {
        NoLiveWork => "no live work",
        ApprovedNow => "approved by an operator",
        GraceElapsed => "restart grace elapsed",
        UnprobeablePastCeiling => "agent unprobeable past the probe-failure ceiling",
        FencedAndUnprobeable => "the fenced agent is unprobeable past the probe-failure ceiling; a restart lifts its fence",
    }
}

reasons! {
    /// Why a rotation is undone (finished, yielded, cancelled or failed).
    ReleaseWhy {
        OnTip => "on the tip",
        OnTarget => "on the target",
        NoSlot => "the rotation holds no slot in the coordinator",
        UpdatedFromOutside => "updated from outside mid-rotation (instance_id changed)",
        ApprovalRevoked => "the approval was revoked",
        TipMovedPastApproval => "the tip moved past the approved commit; approve the new tip",
        LeftStarted => "the machine left `started`",
        DidNotComeBack => "the machine did not come back after its restart",
        DrainCeiling => "drain ceiling reached",
        CheckpointDeadline => "checkpoint deadline reached",
        BackoffStuck => "the backoff could not move on after its retry fell due",
        MaxAttempts => "failed: rotation.max_attempts restarts did not verify",
        UndoUnfinished => "undo not finished yet",
        AuthorityChanged => "the current policy gives the machine's current drift another action than the rotation was claimed with; claimed afresh",
        OverCap => "the pool's rotations exceed its current max_concurrent_rotations",
    }
}

#[cfg(test)]
mod tests {
    use super::StepLabel;

    /// The labels dashboards already use, pinned now that they are derived.
    #[test]
    fn step_labels_keep_their_names() {
        let labels: Vec<&str> = [
            StepLabel::Claim,
            StepLabel::Withdraw,
            StepLabel::Advance,
            StepLabel::Drain,
            StepLabel::Restart,
            StepLabel::Finish,
            StepLabel::Yield,
            StepLabel::Cancel,
            StepLabel::Fail,
            StepLabel::RecordUnprobed,
            StepLabel::ClearUnprobed,
        ]
        .into_iter()
        .map(<&str>::from)
        .collect();
        assert_eq!(
            labels,
            [
                "claim",
                "withdraw",
                "advance",
                "drain",
                "restart",
                "finish",
                "yield",
                "cancel",
                "fail",
                "record_unprobed",
                "clear_unprobed"
            ]
        );
    }
}

//! What the planner decided for one machine this sweep, and why: one typed
//! value per machine that every view renders (the tables of `check`, `run`,
//! `plan` and `demo`, the status page, the API, the logs, the metrics).
//!
//! Owns the vocabulary of decisions and their renderings (a short label, a
//! sentence, a metric label). It must never decide anything itself: the
//! planner ([`crate::decide::planner::plan`]) builds every value; views only show
//! it, so they cannot disagree with the planner (no second drift clock, no
//! free-text phase).

use std::fmt;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};

use crate::decide::guardrail::Guard;
use crate::metadata::marker::{Phase, RotationMode};
use crate::model::{AppName, CommitId, MachineState, PoolName, Severity, short_commit};

/// One machine's decision. Times are absolute (UTC), so a rendering made
/// later still says when something happens, and the planner's `now` is the
/// only clock behind them.
#[derive(
    Clone,
    Debug,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantNames,
    schemars::JsonSchema,
)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Decision {
    /// Runs the release tip: nothing to do.
    OnTip,
    /// Not `started` on Fly: not probed, not rotated; its drift clock starts
    /// over when it runs.
    NotRunning { state: MachineState },
    /// Drifted, but the drift is younger than `rotation.min_drift_age`:
    /// nothing is done (and no alert fires) before `until`.
    DriftYoung {
        since: DateTime<Utc>,
        until: DateTime<Utc>,
    },
    /// The pool's policy for this severity is `observe`: reported, never acted on.
    ObserveOnly { severity: Severity },
    /// An operator hold: no reconciler acts on the machine until `release`.
    /// `phase` is the rotation it holds mid-way, if any. `by`/`since`/`reason`
    /// are absent when the hold's value is not one of ours.
    Held {
        by: Option<String>,
        since: Option<DateTime<Utc>>,
        reason: Option<String>,
        phase: Option<Phase>,
    },
    /// The pool's policy is `manual`: the rotation waits for
    /// `fleet-reconciler approve` of `target` (the release tip).
    AwaitingApproval {
        target: CommitId,
        severity: Severity,
    },
    /// Qualifies for a rotation, but the pool's rotations are at its cap.
    WaitingForSlot {
        pool: PoolName,
        in_use: usize,
        cap: usize,
    },
    /// The agent saw input within `rotation.recent_input_guard`: no rotation
    /// starts (or restart happens) before `until`.
    RecentInput { until: DateTime<Utc> },
    /// Draining: the agent has live work (open sessions or a turn in
    /// progress) since the drain began; restarted only when idle, and the
    /// rotation yields at `deadline` instead of interrupting it.
    LiveWork {
        since: DateTime<Utc>,
        deadline: DateTime<Utc>,
    },
    /// This sweep claims a pool slot to start a rotation.
    Claiming { mode: RotationMode },
    /// A rotation holds a slot and is in `phase`; `deadline` is when the
    /// phase's next ceiling (drain, checkpoint, verify, backoff) falls due.
    /// `verifying`: restarted and back up, waiting for a report of the target.
    InRotation {
        phase: Phase,
        deadline: Option<DateTime<Utc>>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        verifying: bool,
    },
    /// A rotation gave up without interrupting work; it retries at `retry_at`.
    Yielded { retry_at: Option<DateTime<Utc>> },
    /// No usable health report since `since` (the shared record, counted
    /// from this run's first sight of it, else this run's memory).
    /// `ceiling_at`: when `rotation.probe_failure_ceiling` lets an automatic
    /// policy restart it (none for observe/manual pools, when no record
    /// shows a drift, or while none of Fly's checks fails).
    Unprobeable {
        since: Option<DateTime<Utc>>,
        ceiling_at: Option<DateTime<Utc>>,
    },
    /// The last overlay fetch failed: the tip may be stale, so drift measured
    /// against it starts no rotation. `fetched_at`: the last good fetch.
    TipUncertain { fetched_at: Option<DateTime<Utc>> },
    /// The reported ref does not resolve in the mirror (seen since `since`):
    /// it may be newer than the tip, so nothing is done until a later fetch
    /// still cannot resolve it.
    UnconfirmedRef { since: Option<DateTime<Utc>> },
    /// A rotation marker this reconciler cannot read (the field at fault):
    /// someone else's, left alone, and its slot counted as taken.
    UnreadableMarker { why: String },
    /// The rotation toward `target` ended as failed after `attempts` restarts
    /// (at `at`; `evidence`: what the last one showed). Uncordoned, its slot
    /// released; no new attempt for `target` until the tip moves or an
    /// operator runs `approve` again.
    RotationFailed {
        target: CommitId,
        attempts: u32,
        at: DateTime<Utc>,
        evidence: String,
    },
    /// Fly does not show the machine's metadata (`why`: its host is not `ok`,
    /// or the listing carried no config): its hold, approval and marker are
    /// unknown, so nothing is done to it, and a slot the coordinator holds
    /// for it stays taken.
    MetadataUnknown { why: String },
    /// Qualifies for a rotation, but the coordinator's slot set is unknown
    /// (`why`): unknown is not empty, so no claim is made.
    SlotsUnknown { why: String },
    /// Qualifies for a rotation, but the release tip `tip` is halted for its
    /// app `app` (`[release] halt_after_failures`): no claim toward it until
    /// `fleet-reconciler resume APP`. `failures`: the failed rotations that
    /// halted it; `verified: false`: the coordinator's halt record is not one
    /// this fleet sealed, and counts as a halt (fail closed).
    Halted {
        /// The app whose release is halted (absent from a daemon that did
        /// not name it yet).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        app: Option<AppName>,
        tip: CommitId,
        failures: usize,
        verified: bool,
    },
    /// Qualifies for a rotation, but a guardrail holds its pool
    /// ([`Guard`]: a canary pool not yet soaked on the tip, a maintenance
    /// window, a firing alert, an unreadable alert gate): no new claim until
    /// it lifts (`guard.until`, where known). Rotations under way are not held.
    Guarded { guard: Guard },
    /// The last sweep could not list the machine's app: its data is an older
    /// listing and nothing is done to it. `held`/`phase` are as last listed.
    AppNotListed { held: bool, phase: Option<Phase> },
}

impl Decision {
    /// Every kind, in declaration order (the metric's label values).
    pub const KINDS: &'static [&'static str] = <Self as strum::VariantNames>::VARIANTS;

    /// The kind as a stable snake_case word: the JSON `kind` and the metric label.
    pub fn kind(&self) -> &'static str {
        self.into()
    }

    /// A short label for a table column (`draining`, `held`, `awaiting approval`).
    pub fn label(&self) -> String {
        match self {
            Decision::OnTip => "on tip".into(),
            Decision::NotRunning { state } => format!("not running ({state})"),
            Decision::DriftYoung { .. } => "drift settling".into(),
            Decision::ObserveOnly { .. } => "observe only".into(),
            Decision::Held { .. } => "held".into(),
            Decision::AwaitingApproval { .. } => "awaiting approval".into(),
            Decision::WaitingForSlot { .. } => "waiting for a slot".into(),
            Decision::RecentInput { .. } => "recent input".into(),
            Decision::LiveWork { .. } => "draining: live work".into(),
            Decision::Claiming { .. } => "claiming".into(),
            Decision::InRotation {
                verifying: true, ..
            } => "verifying".into(),
            Decision::InRotation { phase, .. } => phase.as_str().into(),
            Decision::Yielded { .. } => "yielded".into(),
            Decision::Unprobeable { .. } => "unprobeable".into(),
            Decision::TipUncertain { .. } => "tip uncertain".into(),
            Decision::UnconfirmedRef { .. } => "unknown ref: unconfirmed".into(),
            Decision::UnreadableMarker { .. } => "unreadable marker".into(),
            Decision::RotationFailed { .. } => "rotation failed".into(),
            Decision::MetadataUnknown { .. } => "metadata unknown".into(),
            Decision::SlotsUnknown { .. } => "slots unknown".into(),
            Decision::Halted { .. } => "halted".into(),
            Decision::Guarded { guard } => format!("guardrail: {}", guard.reason()),
            Decision::AppNotListed {
                held: true,
                phase: _,
            } => "held; paused: app not listed".into(),
            Decision::AppNotListed { phase: Some(p), .. } => {
                format!("{p}; paused: app not listed")
            }
            Decision::AppNotListed { .. } => "paused: app not listed".into(),
        }
    }

    /// Whether a person should look (or will have to act) soon: shown first.
    pub fn needs_operator(&self) -> bool {
        matches!(
            self,
            Decision::Held { .. }
                | Decision::AwaitingApproval { .. }
                | Decision::UnreadableMarker { .. }
                | Decision::Yielded { .. }
                | Decision::RotationFailed { .. }
                | Decision::MetadataUnknown { .. }
                | Decision::SlotsUnknown { .. }
                | Decision::Halted { .. }
                | Decision::Guarded {
                    guard: Guard::GateUnreachable { .. }
                }
        )
    }
}

fn at(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn opt_at(t: &Option<DateTime<Utc>>) -> String {
    t.as_ref()
        .map(at)
        .unwrap_or_else(|| "an unknown time".into())
}

/// The `reason` of a pool held by a halted release, beside the guards'
/// ([`Guard::REASONS`]): the per-pool summary's and the metric's. A halt
/// is decided per machine (`halted`), not a pool guard, and has no time.
pub const HALTED: &str = "halted";

/// What holds one pool of one app from new claims (the per-pool views:
/// `plan`, `status`, the status page): the guardrail or halt its held
/// machines are decided, and until when.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct PoolHold {
    pub app: AppName,
    pub pool: PoolName,
    /// The guard's reason (`canary`, `window`, `alert_firing`,
    /// `gate_unreachable`), or `halted`.
    pub reason: &'static str,
    /// What holds it (the guard's sentence, or the halt's).
    pub held_by: String,
    /// When it lifts, where a time exists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until: Option<DateTime<Utc>>,
    /// `until …`: the time, or what lifts it.
    pub lifts: String,
    /// How many of its machines it holds now.
    pub machines: usize,
}

/// Each (app, pool) some machine of which is decided `guarded` or
/// `halted`, in (app, pool) order: the first such machine's guard (one
/// plan judges a pool once, so they agree), and how many it holds.
pub fn pool_holds<'a>(
    machines: impl IntoIterator<Item = (&'a AppName, &'a PoolName, Option<&'a Decision>)>,
) -> Vec<PoolHold> {
    let mut holds: std::collections::BTreeMap<(&AppName, &PoolName), PoolHold> =
        std::collections::BTreeMap::new();
    for (app, pool, decision) in machines {
        let hold = match decision {
            Some(Decision::Guarded { guard }) => (
                guard.reason(),
                guard.to_string(),
                guard.until(),
                guard.lifts(),
            ),
            Some(Decision::Halted { tip, failures, .. }) => (
                HALTED,
                format!(
                    "the release {} is halted after {failures} failed rotation(s)",
                    short_commit(tip.as_str())
                ),
                None,
                resume(Some(app)),
            ),
            _ => continue,
        };
        let (reason, held_by, until, lifts) = hold;
        holds
            .entry((app, pool))
            .or_insert_with(|| PoolHold {
                app: app.clone(),
                pool: pool.clone(),
                reason,
                held_by,
                until,
                lifts,
                machines: 0,
            })
            .machines += 1;
    }
    holds.into_values().collect()
}

impl fmt::Display for PoolHold {
    /// `app/pool: WHAT (N machine(s)); no new claim UNTIL`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}: {} ({} machine(s)); no new claim {}",
            self.app, self.pool, self.held_by, self.machines, self.lifts
        )
    }
}

/// What lifts a halt: `until `fleet-reconciler resume APP``.
pub fn resume(app: Option<&AppName>) -> String {
    let app = app.map_or("APP", AppName::as_str);
    format!("until `fleet-reconciler resume {app}`")
}

/// The full sentence: the label and the data it carries.
impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::OnTip => f.write_str("on the release tip"),
            Decision::NotRunning { state } => {
                write!(f, "not running (Fly state {state}); not probed or rotated")
            }
            Decision::DriftYoung { since, until } => write!(
                f,
                "drifted since {}; younger than rotation.min_drift_age, nothing is done before {}",
                at(since),
                at(until)
            ),
            Decision::ObserveOnly { severity } => write!(
                f,
                "{severity} drift; the pool's policy is observe: reported, never acted on"
            ),
            Decision::Held {
                by,
                since,
                reason,
                phase,
            } => held(f, by.as_deref(), since.as_ref(), reason.as_deref(), *phase),
            Decision::AwaitingApproval { target, severity } => write!(
                f,
                "{severity} drift in a manual pool: awaiting approval of {}",
                short_commit(target.as_str())
            ),
            Decision::WaitingForSlot { pool, in_use, cap } => write!(
                f,
                "waiting for a slot: pool {pool} has {in_use} of {cap} rotation(s) in progress"
            ),
            Decision::RecentInput { until } => write!(
                f,
                "recent input: the agent is left alone until {}",
                at(until)
            ),
            Decision::LiveWork { since, deadline } => write!(
                f,
                "draining since {}: live work, restarted only when idle; yields at {} rather than interrupt it",
                at(since),
                at(deadline)
            ),
            Decision::Claiming { mode } => write!(
                f,
                "claiming a pool slot for a rotation (mode {})",
                mode.as_str()
            ),
            Decision::InRotation {
                phase,
                deadline,
                verifying,
            } => in_rotation(f, *phase, deadline.as_ref(), *verifying),
            Decision::Yielded { retry_at } => write!(
                f,
                "the rotation yielded without interrupting work; it retries at {}",
                opt_at(retry_at)
            ),
            Decision::Unprobeable { since, ceiling_at } => {
                unprobeable(f, since, ceiling_at.as_ref())
            }
            Decision::TipUncertain { fetched_at } => write!(
                f,
                "the overlay fetch is failing (last good fetch {}): no rotation starts toward a tip that may be stale",
                opt_at(fetched_at)
            ),
            Decision::UnconfirmedRef { since } => write!(
                f,
                "reports a ref the mirror cannot resolve (since {}); waiting for a later fetch to confirm",
                opt_at(since)
            ),
            Decision::UnreadableMarker { why } => write!(
                f,
                "a rotation marker this reconciler cannot read ({why}); not touching it"
            ),
            Decision::RotationFailed {
                target,
                attempts,
                at: when,
                evidence,
            } => rotation_failed(f, target, *attempts, when, evidence),
            Decision::MetadataUnknown { why } => write!(
                f,
                "Fly does not show its metadata ({why}): its hold, approval and rotation are unknown; nothing is done to it and a slot it holds stays taken"
            ),
            Decision::SlotsUnknown { why } => write!(
                f,
                "qualifies for a rotation, but the coordinator's slot set is unknown ({why}); no claim until it can be read"
            ),
            Decision::Halted {
                app,
                tip,
                failures,
                verified: true,
            } => write!(
                f,
                "halted: the release {} of its app is halted after {failures} failed rotation(s); no claim {}",
                short_commit(tip.as_str()),
                resume(app.as_ref())
            ),
            Decision::Halted { app, tip, .. } => write!(
                f,
                "halted: the coordinator's halt record is not one this fleet sealed, so the release {} counts as halted; no claim {}",
                short_commit(tip.as_str()),
                resume(app.as_ref())
            ),
            Decision::Guarded { guard } => write!(f, "{guard}; no new claim {}", guard.lifts()),
            Decision::AppNotListed { .. } => write!(
                f,
                "{}; the last sweep could not list its app, nothing is done to it",
                self.label()
            ),
        }
    }
}

/// `Held`: who, since when and why, as far as the hold says.
fn held(
    f: &mut fmt::Formatter<'_>,
    by: Option<&str>,
    since: Option<&DateTime<Utc>>,
    reason: Option<&str>,
    phase: Option<Phase>,
) -> fmt::Result {
    f.write_str("held")?;
    if let Some(by) = by {
        write!(f, " by {by}")?;
    }
    if let Some(since) = since {
        write!(f, " since {}", at(since))?;
    }
    if let Some(reason) = reason {
        write!(f, " ({reason})")?;
    }
    if let Some(p) = phase {
        write!(f, "; its rotation waits in phase {p}")?;
    }
    f.write_str("; nothing is done until `release`")
}

/// `InRotation`: the phase (or verifying) and the next deadline.
fn in_rotation(
    f: &mut fmt::Formatter<'_>,
    phase: Phase,
    deadline: Option<&DateTime<Utc>>,
    verifying: bool,
) -> fmt::Result {
    if verifying {
        f.write_str("restarted; verifying it reports the target")?;
    } else {
        write!(f, "rotation in phase {phase}")?;
    }
    if let Some(d) = deadline {
        write!(f, "; next deadline {}", at(d))?;
    }
    Ok(())
}

/// `Unprobeable`: since when, and whether the ceiling will restart it.
fn unprobeable(
    f: &mut fmt::Formatter<'_>,
    since: &Option<DateTime<Utc>>,
    ceiling_at: Option<&DateTime<Utc>>,
) -> fmt::Result {
    write!(f, "no usable health report since {}", opt_at(since))?;
    match ceiling_at {
        Some(c) => write!(f, "; the probe-failure ceiling falls at {}", at(c)),
        None => f.write_str(
            "; no restart for it (its policy does not act by itself, no drift was seen, or none of Fly's checks fails: it stays alerted)",
        ),
    }
}

/// `RotationFailed`: toward what, after how many restarts, and what now.
fn rotation_failed(
    f: &mut fmt::Formatter<'_>,
    target: &CommitId,
    attempts: u32,
    when: &DateTime<Utc>,
    evidence: &str,
) -> fmt::Result {
    write!(
        f,
        "the rotation to {} failed after {attempts} restart(s) at {} ({evidence}); uncordoned, slot released; no new attempt until the tip moves or `fleet-reconciler approve` is run again",
        short_commit(target.as_str()),
        at(when)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One decision of every kind.
    fn one_of_each() -> Vec<Decision> {
        let t = DateTime::<Utc>::from_timestamp(1_800_000_000, 0).expect("time");
        vec![
            Decision::OnTip,
            Decision::NotRunning {
                state: "stopped".into(),
            },
            Decision::DriftYoung { since: t, until: t },
            Decision::ObserveOnly {
                severity: Severity::Low,
            },
            Decision::Held {
                by: None,
                since: None,
                reason: None,
                phase: None,
            },
            Decision::AwaitingApproval {
                target: CommitId::parse(&"ab".repeat(20)).expect("a commit id"),
                severity: Severity::High,
            },
            Decision::WaitingForSlot {
                pool: "default".into(),
                in_use: 1,
                cap: 1,
            },
            Decision::RecentInput { until: t },
            Decision::LiveWork {
                since: t,
                deadline: t,
            },
            Decision::Claiming {
                mode: RotationMode::Wait,
            },
            Decision::InRotation {
                phase: Phase::Draining,
                deadline: None,
                verifying: false,
            },
            Decision::Yielded { retry_at: None },
            Decision::Unprobeable {
                since: None,
                ceiling_at: None,
            },
            Decision::TipUncertain { fetched_at: None },
            Decision::UnconfirmedRef { since: None },
            Decision::UnreadableMarker { why: "x".into() },
            Decision::RotationFailed {
                target: CommitId::parse(&"ab".repeat(20)).expect("a commit id"),
                attempts: 3,
                at: t,
                evidence: "still on 22".into(),
            },
            Decision::MetadataUnknown { why: "x".into() },
            Decision::SlotsUnknown { why: "x".into() },
            Decision::Halted {
                app: Some("app".into()),
                tip: CommitId::parse(&"ab".repeat(20)).expect("a commit id"),
                failures: 3,
                verified: true,
            },
            Decision::Guarded {
                guard: Guard::Window {
                    deny: false,
                    until: Some(t),
                    time_zone: "Europe/Berlin".into(),
                },
            },
            Decision::AppNotListed {
                held: false,
                phase: None,
            },
        ]
    }

    #[test]
    fn kinds_match_the_json_tag() {
        let all = one_of_each();
        assert_eq!(all.len(), Decision::KINDS.len());
        for d in all {
            let json = serde_json::to_value(&d).expect("json");
            assert_eq!(json["kind"], d.kind(), "{d:?}");
            let back: Decision = serde_json::from_value(json).expect("round trip");
            assert_eq!(back, d);
        }
    }

    /// One line per held pool: its guard (or halt), until when, and how
    /// many machines it holds; pools with none held are absent.
    #[test]
    fn pool_holds_name_each_held_pool_once_with_until_when() {
        let t = DateTime::<Utc>::from_timestamp(1_800_000_000, 0).expect("time");
        let (a, b) = (AppName::from("a"), AppName::from("b"));
        let (main, eu) = (PoolName::from("main"), PoolName::from("eu"));
        let window = Decision::Guarded {
            guard: Guard::Window {
                deny: true,
                until: Some(t),
                time_zone: "UTC".into(),
            },
        };
        let halted = Decision::Halted {
            app: Some(b.clone()),
            tip: CommitId::parse(&"ab".repeat(20)).expect("a commit id"),
            failures: 2,
            verified: true,
        };
        let holds = pool_holds([
            (&a, &main, Some(&window)),
            (&a, &main, Some(&Decision::OnTip)),
            (&a, &main, Some(&window)),
            (&a, &eu, Some(&Decision::OnTip)),
            (&b, &eu, Some(&halted)),
            (&b, &main, None),
        ]);
        let text: Vec<String> = holds.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "a/main: inside a deny window (2 machine(s)); no new claim until it closes Fri 2027-01-15 08:00 UTC",
                "b/eu: the release abababababab is halted after 2 failed rotation(s) (1 machine(s)); no new claim until `fleet-reconciler resume b`",
            ]
        );
        assert_eq!(holds[0].until, Some(t));
        assert_eq!(holds[1].until, None);
    }

    /// The sentence of each kind, as every view shows it (and with the
    /// optional parts a kind has).
    #[test]
    fn every_kind_reads_as_before() {
        let t = DateTime::<Utc>::from_timestamp(1_800_000_000, 0).expect("time");
        let mut all = one_of_each();
        all.extend([
            Decision::Held {
                by: Some("ops".into()),
                since: Some(t),
                reason: Some("incident".into()),
                phase: Some(Phase::Draining),
            },
            Decision::InRotation {
                phase: Phase::Restarting,
                deadline: Some(t),
                verifying: true,
            },
            Decision::Unprobeable {
                since: Some(t),
                ceiling_at: Some(t),
            },
            Decision::AppNotListed {
                held: true,
                phase: None,
            },
            Decision::AppNotListed {
                held: false,
                phase: Some(Phase::Draining),
            },
            Decision::Guarded {
                guard: Guard::Canary {
                    pool: "canary".into(),
                    on_tip: 2,
                    started: 3,
                    needed: 2,
                    soaked_secs: Some(12 * 60 + 5),
                    soak_secs: 30 * 60,
                    until: Some(t),
                    halted: false,
                },
            },
            Decision::Guarded {
                guard: Guard::Window {
                    deny: true,
                    until: Some(t),
                    time_zone: "UTC".into(),
                },
            },
            Decision::Guarded {
                guard: Guard::AlertFiring {
                    alert: r#"AgentErrorRate{app="x"}"#.into(),
                },
            },
            Decision::Guarded {
                guard: Guard::GateUnreachable {
                    error: "GET /api/v2/alerts answered HTTP 503 Service Unavailable".into(),
                },
            },
        ]);
        let text: Vec<String> = all.iter().map(Decision::to_string).collect();
        assert_eq!(
            text,
            [
                "on the release tip",
                "not running (Fly state stopped); not probed or rotated",
                "drifted since 2027-01-15T08:00:00Z; younger than rotation.min_drift_age, nothing is done before 2027-01-15T08:00:00Z",
                "low drift; the pool's policy is observe: reported, never acted on",
                "held; nothing is done until `release`",
                "high drift in a manual pool: awaiting approval of abababababab",
                "waiting for a slot: pool default has 1 of 1 rotation(s) in progress",
                "recent input: the agent is left alone until 2027-01-15T08:00:00Z",
                "draining since 2027-01-15T08:00:00Z: live work, restarted only when idle; yields at 2027-01-15T08:00:00Z rather than interrupt it",
                "claiming a pool slot for a rotation (mode wait)",
                "rotation in phase draining",
                "the rotation yielded without interrupting work; it retries at an unknown time",
                "no usable health report since an unknown time; no restart for it (its policy does not act by itself, no drift was seen, or none of Fly's checks fails: it stays alerted)",
                "the overlay fetch is failing (last good fetch an unknown time): no rotation starts toward a tip that may be stale",
                "reports a ref the mirror cannot resolve (since an unknown time); waiting for a later fetch to confirm",
                "a rotation marker this reconciler cannot read (x); not touching it",
                "the rotation to abababababab failed after 3 restart(s) at 2027-01-15T08:00:00Z (still on 22); uncordoned, slot released; no new attempt until the tip moves or `fleet-reconciler approve` is run again",
                "Fly does not show its metadata (x): its hold, approval and rotation are unknown; nothing is done to it and a slot it holds stays taken",
                "qualifies for a rotation, but the coordinator's slot set is unknown (x); no claim until it can be read",
                "halted: the release abababababab of its app is halted after 3 failed rotation(s); no claim until `fleet-reconciler resume app`",
                "outside maintenance window; no new claim until a window opens Fri 2027-01-15 09:00 Europe/Berlin",
                "paused: app not listed; the last sweep could not list its app, nothing is done to it",
                "held by ops since 2027-01-15T08:00:00Z (incident); its rotation waits in phase draining; nothing is done until `release`",
                "restarted; verifying it reports the target; next deadline 2027-01-15T08:00:00Z",
                "no usable health report since 2027-01-15T08:00:00Z; the probe-failure ceiling falls at 2027-01-15T08:00:00Z",
                "held; paused: app not listed; the last sweep could not list its app, nothing is done to it",
                "draining; paused: app not listed; the last sweep could not list its app, nothing is done to it",
                "waiting for canary pool canary: 2/3 on tip, soak 12m of 30m; no new claim until 2027-01-15T08:00:00Z if the ratio holds",
                "inside a deny window; no new claim until it closes Fri 2027-01-15 08:00 UTC",
                r#"blocked by alert AgentErrorRate{app="x"}; no new claim until the alert resolves"#,
                "blocked: the alert gate's Alertmanager cannot be read (GET /api/v2/alerts answered HTTP 503 Service Unavailable), so claims are held (fail closed); no new claim until Alertmanager can be read",
            ]
        );
    }
}

//! The planner: snapshot + markers + operator state + `now` → steps and alerts.
//!
//! Owns every policy decision of DESIGN §5 and §6: the drift grace period,
//! holds, approvals, pool caps, the live-work and recent-input guards, the
//! cooperative handshake, and every ceiling and deadline of the rotation
//! state machine. It is a pure function: no clients, no clock, no randomness;
//! markers and operator state come from the machines' metadata in the
//! snapshot, and the only memory between sweeps is the `Tracker` (when drift
//! and unreachability began), which the caller passes in. It must never
//! perform a step itself.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::config::Config;
use crate::events::{Alert, AlertKind};
use crate::model::{MachineStatus, PolicyAction, Severity};
use crate::operator::{APPROVE_KEY, Approval, ApprovalMode, HOLD_KEY, MARKER_KEY};
use crate::probe::{AgentReport, Capability};
use crate::rotation::{Marker, Phase, RotationMode};
use crate::sweep::{FleetReport, MachineReport};

/// Which machine a step is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub app: String,
    pub machine_id: String,
    pub pool: String,
    /// The agent's health URL; cooperative endpoints resolve against it.
    pub health_url: Option<String>,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.app, self.machine_id)
    }
}

/// One thing the executor must do, for one machine. Every step that changes
/// a machine holds its lease, first checks that the marker is still
/// `expected` (another replica may have acted since the snapshot), and
/// writes its marker before acting.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub target: Target,
    /// The marker this step was planned from (`None`: no rotation yet).
    pub expected: Option<Marker>,
    pub kind: StepKind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum StepKind {
    /// Write the marker, verify the pool cap across replicas, then cordon
    /// (unless reloading) and ask a cooperating agent to drain, or to reload.
    Claim {
        marker: Marker,
        drain: bool,
        reload: bool,
    },
    /// Write the changed marker; with `cordon`, cordon the machine and
    /// (when the marker says so) ask the agent to drain.
    Advance {
        marker: Marker,
        cordon: bool,
        why: &'static str,
    },
    /// Write the marker (phase `restarting`), restart, wait for `started`.
    Restart {
        marker: Marker,
        /// Live work may be interrupted (restart past its grace, or `approve`).
        interrupts: bool,
        why: &'static str,
    },
    /// The machine reports the tip: uncordon, undrain, clear marker and approval.
    Finish { clear_approval: bool, undrain: bool },
    /// A ceiling was reached: undrain, uncordon, release the slot until `retry_at`.
    Yield {
        marker: Marker,
        undrain: bool,
        why: &'static str,
    },
}

impl Step {
    /// The marker the step writes, if any.
    pub fn new_marker(&self) -> Option<&Marker> {
        match &self.kind {
            StepKind::Claim { marker, .. }
            | StepKind::Advance { marker, .. }
            | StepKind::Restart { marker, .. }
            | StepKind::Yield { marker, .. } => Some(marker),
            StepKind::Finish { .. } => None,
        }
    }

    /// The rotation's tag (for the agent's drain/undrain).
    pub fn tag(&self) -> Option<&str> {
        self.new_marker()
            .or(self.expected.as_ref())
            .map(|m| m.tag.as_str())
    }

    /// Bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self.kind {
            StepKind::Claim { .. } => "claim",
            StepKind::Advance { .. } => "advance",
            StepKind::Restart { .. } => "restart",
            StepKind::Finish { .. } => "finish",
            StepKind::Yield { .. } => "yield",
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = &self.target;
        match &self.kind {
            StepKind::Claim {
                marker,
                drain,
                reload,
            } => write!(
                f,
                "claim a rotation slot for {target} (pool {}, {} mode{}{})",
                target.pool,
                marker.mode.as_str(),
                if *drain { ", drain requested" } else { "" },
                if *reload { ", reload requested" } else { "" }
            ),
            StepKind::Advance { marker, why, .. } => {
                write!(f, "{target}: {} ({why})", marker.phase)
            }
            StepKind::Restart {
                interrupts, why, ..
            } => write!(
                f,
                "restart {target} ({why}{})",
                if *interrupts {
                    "; live work may be interrupted"
                } else {
                    ""
                }
            ),
            StepKind::Finish { .. } => write!(f, "{target} reports the tip: uncordon and finish"),
            StepKind::Yield { marker, why, .. } => write!(
                f,
                "{target} yields its slot ({why}); retry at {}",
                marker.retry_at.map(|t| t.to_rfc3339()).unwrap_or_default()
            ),
        }
    }
}

/// What the planner decided for one sweep.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// Machine-level conditions that hold now (drift, approval needed, stuck).
    pub alerts: Vec<Alert>,
    /// Per machine: the phase to show (`draining`, `verifying`, `held`, …).
    pub phases: BTreeMap<String, String>,
    /// Rotations holding a slot, per (app, pool).
    pub rotations_in_progress: BTreeMap<(String, String), usize>,
}

/// Memory between sweeps: when each machine's drift and unreachability began.
/// Lost on restart, which only delays alerts and actions, never hastens them.
#[derive(Clone, Debug, Default)]
pub struct Tracker {
    machines: HashMap<String, Seen>,
}

#[derive(Clone, Debug, Default)]
struct Seen {
    drift_since: Option<DateTime<Utc>>,
    unreachable_since: Option<DateTime<Utc>>,
    /// The last report we could read was not on the tip.
    last_known_drifted: bool,
    /// What the pool's policy said about that drift, and at which severity.
    last_known_action: Option<PolicyAction>,
    last_known_severity: Option<Severity>,
}

impl Tracker {
    /// Folds one sweep in. Machines absent from the report are forgotten.
    pub fn observe(&mut self, report: &FleetReport, now: DateTime<Utc>) {
        let mut next = HashMap::with_capacity(report.machines.len());
        for m in &report.machines {
            let mut seen = self.machines.remove(&m.machine_id).unwrap_or_default();
            match m.status {
                s if s.is_classified() => {
                    seen.drift_since = seen.drift_since.or(Some(now));
                    seen.unreachable_since = None;
                    seen.last_known_drifted = true;
                    seen.last_known_action = m.action;
                    seen.last_known_severity = m.severity;
                }
                MachineStatus::OnTip => seen = Seen::default(),
                // Stopped: not counted; its drift clock starts over when it runs.
                MachineStatus::NotRunning => {
                    seen.drift_since = None;
                    seen.unreachable_since = None;
                }
                // No usable report: nothing is known now, so what was known
                // stands (a missed probe neither clears nor restarts a drift).
                MachineStatus::Unreachable => {
                    seen.unreachable_since = seen.unreachable_since.or(Some(now));
                }
                _ => seen.unreachable_since = None,
            }
            next.insert(m.machine_id.clone(), seen);
        }
        self.machines = next;
    }

    /// Whether the last usable report of the machine showed drift.
    fn carried_drift(&self, machine_id: &str) -> Option<&Seen> {
        self.machines
            .get(machine_id)
            .filter(|s| s.last_known_drifted && s.drift_since.is_some())
    }

    pub fn drift_since(&self, machine_id: &str) -> Option<DateTime<Utc>> {
        self.machines.get(machine_id)?.drift_since
    }

    pub fn unreachable_since(&self, machine_id: &str) -> Option<DateTime<Utc>> {
        self.machines.get(machine_id)?.unreachable_since
    }
}

/// A machine that may start a rotation this sweep, if its pool has room.
struct Candidate<'a> {
    severity: Severity,
    since: DateTime<Utc>,
    m: &'a MachineReport,
    mode: RotationMode,
    action: PolicyAction,
    /// The yielded marker a retry replaces (`None` for a first claim).
    expected: Option<Marker>,
}

/// Everything `plan` reads.
pub struct PlanInput<'a> {
    pub config: &'a Config,
    pub report: &'a FleetReport,
    pub tracker: &'a Tracker,
    /// This reconciler's identity, written into markers it creates.
    pub owner: &'a str,
    pub now: DateTime<Utc>,
}

fn after(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    t + chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

/// Capped exponential backoff after failed verifies: retry_after/8 doubling,
/// capped at retry_after.
fn verify_backoff(config: &Config, attempt: u32) -> Duration {
    let base = config.rotation.retry_after / 8;
    base.saturating_mul(1u32 << attempt.min(8))
        .min(config.rotation.retry_after)
}

struct OperatorState<'a> {
    held: bool,
    marker: Option<Result<Marker, &'a str>>,
    approval: Option<Approval>,
}

fn operator_state<'a>(m: &'a MachineReport, tip: &str) -> OperatorState<'a> {
    OperatorState {
        held: m.metadata.contains_key(HOLD_KEY),
        marker: m
            .metadata
            .get(MARKER_KEY)
            .map(|v| Marker::parse(v).ok_or(v.as_str())),
        // An approval authorizes a rotation to the commit it names, only.
        approval: m
            .metadata
            .get(APPROVE_KEY)
            .and_then(|v| Approval::parse(v))
            .filter(|a| a.target.eq_ignore_ascii_case(tip)),
    }
}

/// Why the latest report does or does not allow a restart without interrupting work.
fn idle_for_restart(
    config: &Config,
    m: &MachineReport,
    marker: &Marker,
    now: DateTime<Utc>,
) -> Result<(), &'static str> {
    let Some(r) = m.report.as_ref().filter(|_| m.state == "started") else {
        return Err("no fresh report");
    };
    let fresh_heartbeat = |r: &AgentReport| {
        r.heartbeat_at.is_some_and(|h| {
            now.signed_duration_since(h).to_std().unwrap_or_default()
                <= config.rotation.heartbeat_max_age
        })
    };
    if r.heartbeat_at.is_some() && !fresh_heartbeat(r) {
        return Err("stale heartbeat");
    }
    if r.has_live_work() {
        return Err("live work");
    }
    if recent_input(config, r, now) {
        return Err("recent input");
    }
    if marker.drain_requested && r.can(Capability::Drain) {
        // A cooperating agent is authorized only by its own checkpoint.
        let checkpointed = r.rotation.as_ref().is_some_and(|rot| {
            rot.fenced && rot.checkpoint.as_deref() == Some(marker.tag.as_str())
        });
        if !checkpointed {
            return Err("waiting for the agent's checkpoint");
        }
        if !fresh_heartbeat(r) {
            return Err("checkpoint without a fresh heartbeat");
        }
    }
    Ok(())
}

fn recent_input(config: &Config, r: &AgentReport, now: DateTime<Utc>) -> bool {
    r.last_input_at.is_some_and(|t| {
        now.signed_duration_since(t)
            .to_std()
            .map(|age| age < config.rotation.recent_input_guard)
            // Input "from the future" (clock skew) counts as recent.
            .unwrap_or(true)
    })
}

/// Plans one sweep.
pub fn plan(input: &PlanInput<'_>) -> Plan {
    let PlanInput {
        config,
        report,
        tracker,
        owner,
        now,
    } = *input;
    let tip = report.tip.commit.as_str();
    let mut plan = Plan::default();

    // Markers, holds and approvals, read once per machine.
    let ops: Vec<OperatorState<'_>> = report
        .machines
        .iter()
        .map(|m| operator_state(m, tip))
        .collect();

    // Slots in use per (app, pool), from the markers on the machines.
    let mut in_use: BTreeMap<(String, String), usize> = BTreeMap::new();
    for (m, op) in report.machines.iter().zip(&ops) {
        let holds = match &op.marker {
            Some(Ok(marker)) => marker.phase.holds_slot(),
            // A marker we cannot read still holds a slot: fail closed.
            Some(Err(_)) => true,
            None => false,
        };
        if holds {
            *in_use.entry((m.app.clone(), m.pool.clone())).or_default() += 1;
        }
    }
    plan.rotations_in_progress = in_use.clone();

    // New claims are ranked: most severe first, then oldest drift.
    let mut candidates: Vec<Candidate<'_>> = Vec::new();

    for (m, op) in report.machines.iter().zip(&ops) {
        let target = target_of(m);
        let drift_since = tracker.drift_since(&m.machine_id);
        let drift_aged =
            drift_since.is_some_and(|t| after(t, config.rotation.min_drift_age) <= now);
        let severity = m.severity;
        // Unreachable or a bad report now, drifted before: still drifting as
        // far as anyone knows, so its alert keeps firing (no flapping).
        let alert_severity = severity.or_else(|| {
            matches!(
                m.status,
                MachineStatus::Unreachable | MachineStatus::BadReport
            )
            .then(|| tracker.carried_drift(&m.machine_id))
            .flatten()
            .and_then(|s| s.last_known_severity)
        });

        if let (Some(sev), true) = (alert_severity, drift_aged) {
            plan.alerts.push(machine_alert(
                AlertKind::Drift,
                m,
                tip,
                sev,
                drift_summary(m),
            ));
        }
        if op.held {
            plan.phases.insert(m.machine_id.clone(), "held".into());
            continue; // never act on a held machine, never clear its hold
        }

        // A yielded rotation whose retry time has come is a candidate again.
        let retry = match &op.marker {
            Some(Ok(mk))
                if mk.phase == Phase::Yielded
                    && mk.retry_at.is_some_and(|t| t <= now)
                    && m.status != MachineStatus::OnTip =>
            {
                Some(mk.clone())
            }
            _ => None,
        };
        match op.marker.as_ref().filter(|_| retry.is_none()) {
            Some(Err(_)) => {
                plan.phases
                    .insert(m.machine_id.clone(), "unreadable marker".into());
                plan.alerts.push(machine_alert(
                    AlertKind::RotationStuck,
                    m,
                    tip,
                    Severity::High,
                    format!(
                        "{} has a rotation marker this reconciler cannot read; not touching it",
                        m.machine_id
                    ),
                ));
            }
            Some(Ok(marker)) => {
                plan.phases
                    .insert(m.machine_id.clone(), phase_label(marker, m));
                if let Some(step) = advance(
                    config,
                    m,
                    marker,
                    &target,
                    op,
                    tracker,
                    now,
                    &mut plan.alerts,
                    tip,
                ) {
                    plan.steps.push(step);
                }
            }
            None => {
                // Unreachable past the ceiling after being seen drifted: serving nothing we can see.
                if m.status == MachineStatus::Unreachable {
                    if unreachable_past_ceiling(config, tracker, m, now) {
                        candidates.push(Candidate {
                            severity: Severity::High,
                            since: now,
                            m,
                            mode: RotationMode::Now,
                            action: tracker
                                .machines
                                .get(&m.machine_id)
                                .and_then(|s| s.last_known_action)
                                .unwrap_or(PolicyAction::Restart),
                            expected: None,
                        });
                    }
                    continue;
                }
                if !drift_aged {
                    continue;
                }
                let Some(sev) = severity else { continue };
                let action = m.action.unwrap_or(PolicyAction::Observe);
                let mode = match action {
                    PolicyAction::Observe => continue,
                    PolicyAction::AlertAndWait => RotationMode::Wait,
                    PolicyAction::Restart => RotationMode::Grace,
                    PolicyAction::Reload => {
                        if m.report.as_ref().is_some_and(|r| r.can(Capability::Reload)) {
                            RotationMode::Reload
                        } else {
                            RotationMode::Wait
                        }
                    }
                    PolicyAction::Manual => match &op.approval {
                        None => {
                            plan.alerts.push(machine_alert(
                                AlertKind::ManualApprovalRequired,
                                m,
                                tip,
                                sev,
                                format!(
                                    "{} needs an operator: `fleet-reconciler approve {}` (or --when-idle)",
                                    m.machine_id, m.machine_id
                                ),
                            ));
                            plan.phases
                                .insert(m.machine_id.clone(), "awaiting approval".into());
                            continue;
                        }
                        Some(a) if a.mode == ApprovalMode::Now => RotationMode::Now,
                        Some(_) => RotationMode::Wait,
                    },
                };
                // Input newer than the guard keeps a machine out of rotation,
                // unless an operator said "now".
                if mode != RotationMode::Now
                    && m.report
                        .as_ref()
                        .is_some_and(|r| recent_input(config, r, now))
                {
                    plan.phases
                        .insert(m.machine_id.clone(), "recent input".into());
                    continue;
                }
                candidates.push(Candidate {
                    severity: sev,
                    since: drift_since.unwrap_or(now),
                    m,
                    mode,
                    action,
                    expected: retry.clone(),
                });
            }
        }
    }

    candidates.sort_by(|a, b| {
        b.severity
            .cmp(&a.severity)
            .then(a.since.cmp(&b.since))
            .then(a.m.machine_id.cmp(&b.m.machine_id))
    });
    for Candidate {
        severity: sev,
        m,
        mode,
        action,
        expected,
        ..
    } in candidates
    {
        let key = (m.app.clone(), m.pool.clone());
        let cap = config.pool(&m.pool).max_concurrent_rotations.get() as usize;
        let used = in_use.entry(key).or_default();
        if *used >= cap {
            plan.phases
                .insert(m.machine_id.clone(), "waiting for a slot".into());
            continue;
        }
        *used += 1;
        let cooperative = m.report.as_ref().is_some_and(|r| r.can(Capability::Drain));
        let reload = mode == RotationMode::Reload;
        let marker = Marker {
            tag: Marker::new_tag(&m.machine_id, tip, now),
            target: tip.to_string(),
            phase: if reload {
                Phase::Reloading
            } else {
                Phase::Draining
            },
            mode,
            action,
            severity: sev,
            started_at: now,
            attempt_started_at: now,
            attempt: 0,
            owner: owner.to_string(),
            restart_at: None,
            retry_at: None,
            drain_requested: cooperative && !reload,
        };
        plan.phases.insert(m.machine_id.clone(), "claiming".into());
        plan.steps.push(Step {
            target: target_of(m),
            expected,
            kind: StepKind::Claim {
                drain: marker.drain_requested,
                reload,
                marker,
            },
        });
    }
    plan
}

fn target_of(m: &MachineReport) -> Target {
    Target {
        app: m.app.clone(),
        machine_id: m.machine_id.clone(),
        pool: m.pool.clone(),
        health_url: m.health_url.clone(),
    }
}

/// Seen drifted under a policy that acts by itself, then unreachable past
/// the probe-failure ceiling. `observe` and `manual` pools are never touched
/// this way: the first never acts, the second only on an approval.
fn unreachable_past_ceiling(
    config: &Config,
    tracker: &Tracker,
    m: &MachineReport,
    now: DateTime<Utc>,
) -> bool {
    let known_drifted = tracker.machines.get(&m.machine_id).is_some_and(|s| {
        s.last_known_drifted
            && matches!(
                s.last_known_action,
                Some(PolicyAction::AlertAndWait | PolicyAction::Restart | PolicyAction::Reload)
            )
    });
    known_drifted
        && tracker
            .unreachable_since(&m.machine_id)
            .is_some_and(|t| after(t, config.rotation.probe_failure_ceiling) <= now)
}

/// The next step of a rotation in progress, if any.
#[allow(clippy::too_many_arguments)]
fn advance(
    config: &Config,
    m: &MachineReport,
    marker: &Marker,
    target: &Target,
    op: &OperatorState<'_>,
    tracker: &Tracker,
    now: DateTime<Utc>,
    alerts: &mut Vec<Alert>,
    tip: &str,
) -> Option<Step> {
    let rot = &config.rotation;
    let step = |kind: StepKind| Step {
        target: target.clone(),
        expected: Some(marker.clone()),
        kind,
    };
    let finish = || {
        step(StepKind::Finish {
            clear_approval: op.approval.is_some() || m.metadata.contains_key(APPROVE_KEY),
            undrain: marker.drain_requested,
        })
    };
    // Whatever the phase: a machine on the tip is done (maybe someone else restarted it).
    if m.status == MachineStatus::OnTip {
        return Some(finish());
    }
    let restart = |why: &'static str, interrupts: bool| {
        let mut next = marker.clone();
        next.phase = Phase::Restarting;
        next.restart_at = Some(now);
        next.attempt_started_at = now;
        next.target = tip.to_string();
        step(StepKind::Restart {
            marker: next,
            interrupts,
            why,
        })
    };
    let yield_ = |why: &'static str| {
        let mut next = marker.clone();
        next.phase = Phase::Yielded;
        next.retry_at = Some(after(now, rot.retry_after));
        step(StepKind::Yield {
            marker: next,
            undrain: marker.drain_requested,
            why,
        })
    };
    match marker.phase {
        Phase::Draining => {
            let since = marker.attempt_started_at;
            // Mid-rotation the machine is known drifted; unreachable this
            // long, it serves nothing we can see.
            if m.status == MachineStatus::Unreachable
                && tracker
                    .unreachable_since(&m.machine_id)
                    .is_some_and(|t| after(t, rot.probe_failure_ceiling) <= now)
            {
                return Some(restart(
                    "agent unreachable past the probe-failure ceiling",
                    false,
                ));
            }
            match marker.mode {
                RotationMode::Now => return Some(restart("approved by an operator", true)),
                RotationMode::Grace if after(since, rot.restart_grace) <= now => {
                    let interrupts = idle_for_restart(config, m, marker, now).is_err();
                    return Some(restart("restart grace elapsed", interrupts));
                }
                _ => {}
            }
            if idle_for_restart(config, m, marker, now).is_ok() {
                return Some(restart("no live work", false));
            }
            // Ceilings never kill work: the rotation yields and retries later.
            if after(since, rot.drain_ceiling) <= now {
                return Some(yield_("drain ceiling reached"));
            }
            let checkpointed = m
                .report
                .as_ref()
                .and_then(|r| r.rotation.as_ref())
                .is_some_and(|r| r.checkpoint.as_deref() == Some(marker.tag.as_str()));
            if marker.drain_requested
                && !checkpointed
                && after(since, rot.checkpoint_deadline) <= now
            {
                return Some(yield_("checkpoint deadline reached"));
            }
            None
        }
        Phase::Reloading => {
            if after(marker.attempt_started_at, rot.verify_deadline) <= now {
                // Not proven by a report of the tip: fall back to alert-and-wait.
                let mut next = marker.clone();
                next.phase = Phase::Draining;
                next.mode = RotationMode::Wait;
                next.attempt_started_at = now;
                let cooperative = m.report.as_ref().is_some_and(|r| r.can(Capability::Drain));
                next.drain_requested = cooperative;
                return Some(step(StepKind::Advance {
                    marker: next,
                    cordon: true,
                    why: "reload not proven within the verify deadline; falling back to alert-and-wait",
                }));
            }
            None
        }
        Phase::Restarting => {
            let since = marker.restart_at.unwrap_or(marker.attempt_started_at);
            if after(since, rot.verify_deadline) <= now {
                // Still not on the tip: stay cordoned, alert, retry with backoff.
                let mut next = marker.clone();
                next.phase = Phase::Backoff;
                next.attempt = marker.attempt + 1;
                next.retry_at = Some(after(now, verify_backoff(config, marker.attempt)));
                alerts.push(machine_alert(
                    AlertKind::RotationStuck,
                    m,
                    tip,
                    marker.severity.max(Severity::High),
                    format!(
                        "{} did not report the tip within {} of its restart; kept cordoned",
                        m.machine_id,
                        humantime::format_duration(rot.verify_deadline)
                    ),
                ));
                return Some(step(StepKind::Advance {
                    marker: next,
                    cordon: false,
                    why: "verify failed; backing off",
                }));
            }
            None
        }
        Phase::Backoff => {
            alerts.push(machine_alert(
                AlertKind::RotationStuck,
                m,
                tip,
                marker.severity.max(Severity::High),
                format!(
                    "{} failed verification {} time(s); kept cordoned",
                    m.machine_id, marker.attempt
                ),
            ));
            if marker.retry_at.is_some_and(|t| t <= now) {
                let mut next = marker.clone();
                next.phase = Phase::Draining;
                next.attempt_started_at = now;
                next.retry_at = None;
                next.target = tip.to_string();
                return Some(step(StepKind::Advance {
                    marker: next,
                    cordon: true,
                    why: "backoff elapsed; draining again",
                }));
            }
            None
        }
        Phase::Yielded => {
            // Once `retry_at` passes, `plan` treats the machine as a fresh
            // candidate (policy, cap and guards apply again).
            alerts.push(machine_alert(
                AlertKind::RotationStuck,
                m,
                tip,
                marker.severity,
                format!(
                    "rotation of {} yielded without interrupting work; retrying at {}",
                    m.machine_id,
                    marker.retry_at.map(|t| t.to_rfc3339()).unwrap_or_default()
                ),
            ));
            None
        }
    }
}

fn phase_label(marker: &Marker, m: &MachineReport) -> String {
    match marker.phase {
        Phase::Restarting if m.state == "started" => "verifying".into(),
        p => p.as_str().into(),
    }
}

fn drift_summary(m: &MachineReport) -> String {
    match (m.status, m.commits_behind) {
        (MachineStatus::Drifted, Some(n)) => format!(
            "{} in {} runs an overlay {n} commit(s) behind the release tip",
            m.machine_id, m.app
        ),
        (status, _) => format!("{} in {} reports {status}", m.machine_id, m.app),
    }
}

fn machine_alert(
    kind: AlertKind,
    m: &MachineReport,
    tip: &str,
    severity: Severity,
    summary: String,
) -> Alert {
    let mut details = BTreeMap::new();
    details.insert("status".to_string(), m.status.to_string());
    details.insert("pool".to_string(), m.pool.clone());
    details.insert("region".to_string(), m.region.clone());
    if let Some(n) = m.commits_behind {
        details.insert("commits_behind".to_string(), n.to_string());
    }
    if let Some(r) = &m.reported_ref {
        details.insert("reported_ref".to_string(), r.clone());
    }
    if let Some(a) = m.action {
        details.insert("action".to_string(), a.to_string());
    }
    Alert {
        kind,
        app: Some(m.app.clone()),
        machine_id: Some(m.machine_id.clone()),
        commit: Some(tip.to_string()),
        severity,
        summary,
        details,
    }
}

#[cfg(test)]
#[path = "reconcile_tests.rs"]
mod tests;

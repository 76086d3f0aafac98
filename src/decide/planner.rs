//! The planner: a [`Snapshot`] (markers and operator state in it) + `now` →
//! a [`Plan`]: one decision and at most one step per machine, and alerts.
//!
//! Owns every policy decision of docs/design.md §5 and §6: the drift grace period,
//! holds, approvals, pool caps, the live-work and recent-input guards, the
//! cooperative handshake, and every ceiling and deadline of the rotation
//! state machine. It is a pure function: no clients, no clock, no randomness;
//! markers, slots and operator state come from the snapshot, and the only
//! memory between sweeps is the `Tracker` (when drift and unprobeability
//! began, when each marker and probe-failure record was first seen, and
//! which rotations toward the tip ended failed: [`crate::decide::halt`]),
//! which the caller passes in. No claim is planned toward a halted release
//! tip (`[release]`), nor one a guardrail holds (a canary pool not soaked on
//! the tip, a maintenance window: [`crate::decide::guardrail`]); rotations
//! under way go on. It never compares a time another clock wrote (a
//! marker's, a record's) with `now` except through this run's first sight
//! of it, and never lets its own memory of a failed probe count toward the
//! probe-failure ceiling (only the shared record does). It must never perform a step itself,
//! nor plan one for a machine of an app the sweep could not list (its data is
//! a past listing's; a rotation in progress there waits until the app lists).
//!
//! A snapshot can be tens of seconds old when its steps run, so every step
//! that disrupts (cordon, drain, reload, restart) states the preconditions the
//! executor re-checks under the machine's lease at the moment of action
//! ([`RestartGuard`], the expected marker, the slot), and the pure checks the
//! executor applies to a fresh probe live here too ([`restart_allowed`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::decide::decision::Decision;
pub use crate::decide::guardrail::Guard;
use crate::decide::halt::HaltSource;
pub use crate::decide::halt::Halted;
use crate::decide::policy::Policy;
use crate::decide::snapshot::{JudgedMachine, Snapshot};
pub use crate::decide::step::{
    AdvanceWhy, ReleaseWhy, RestartGuard, RestartWhy, Step, StepKind, Target, Undrain, WithdrawWhy,
};
pub use crate::decide::tracker::{MarkerSeen, Tracker};
// From `alerts::kinds`, not `alerts`: `decide::alerts` reads the `Plan`.
use crate::decide::alerts::kinds::{Alert, AlertKind};
use crate::metadata::MARKER_KEY;
use crate::metadata::controls::Controls;
use crate::metadata::marker::{Ending, Failure, Marker, Phase, RotationMode};
use crate::metadata::operator::ApprovalMode;
use crate::metadata::unprobed::Unprobed;
use crate::model::{AppName, CommitId, MachineId, MachineStatus, PolicyAction, PoolName, Severity};
use crate::observe::probe::{AgentReport, Capability};
use crate::observe::sweep::{FlyChecks, ObservedMachine, SlotsView};

/// How far in the future a heartbeat may be (clock skew) and still count as fresh.
pub const HEARTBEAT_FUTURE_TOLERANCE: Duration = Duration::from_secs(5);

/// Crashes since a restart, within the verify window, that make a crash
/// loop (flyctl's `isConstantlyRestarting` judges the same way).
pub const CRASH_LOOP_EXITS: usize = 2;

/// What the planner decided for one sweep: one entry per machine of the
/// report (its decision, its one step if any, its drift clock), and what
/// holds across machines.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub machines: BTreeMap<MachineId, MachinePlan>,
    /// The machines with a step, in the order the executor starts them:
    /// rotations in progress and bookkeeping in report order, then new claims
    /// most severe and oldest first (the first started wins a contended slot).
    start_order: Vec<MachineId>,
    /// Machine-level conditions that hold now (drift, approval needed, stuck).
    pub alerts: Vec<Alert>,
    /// Rotations holding a slot, per (app, pool).
    pub rotations_in_progress: BTreeMap<(AppName, PoolName), usize>,
    /// Apps whose release tip is halted: no new claim toward it. Those this
    /// run detected ([`Halted::record`]) are for the executor to record.
    pub halts: BTreeMap<AppName, Halted>,
    /// The guardrails that held a claim this sweep, per (app, pool)
    /// ([`Guard`]): for the metric and the views.
    pub guards: BTreeMap<(AppName, PoolName), Guard>,
}

/// What is decided for one machine in one sweep. At most one step: steps
/// of one machine would contend for its lease, and a rotation step goes
/// before the probe-failure record's bookkeeping.
#[derive(Clone, Debug, PartialEq)]
pub struct MachinePlan {
    pub decision: Decision,
    pub step: Option<Step>,
    /// When this run first saw the machine's current drift (the one drift
    /// clock; every view shows this one).
    pub drift_since: Option<DateTime<Utc>>,
}

impl Plan {
    /// The steps, in the order the executor starts them.
    pub fn steps(&self) -> Vec<&Step> {
        self.start_order
            .iter()
            .filter_map(|id| self.machines.get(id)?.step.as_ref())
            .collect()
    }

    /// Whether there is nothing to do.
    pub fn has_steps(&self) -> bool {
        !self.start_order.is_empty()
    }

    pub fn decision(&self, machine_id: &MachineId) -> Option<&Decision> {
        self.machines.get(machine_id).map(|m| &m.decision)
    }

    /// Every machine's decision.
    pub fn decisions(&self) -> BTreeMap<MachineId, Decision> {
        self.machines
            .iter()
            .map(|(id, m)| (id.clone(), m.decision.clone()))
            .collect()
    }

    pub fn drift_since(&self, machine_id: &MachineId) -> Option<DateTime<Utc>> {
        self.machines.get(machine_id)?.drift_since
    }
}

/// No usable report: unreachable, or an answer that is not a report.
fn unprobeable(status: MachineStatus) -> bool {
    matches!(
        status,
        MachineStatus::Unreachable | MachineStatus::BadReport
    )
}

/// What the daemon knows of its own view of the overlay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FetchState {
    /// When the release tip was last fetched successfully.
    pub fetched_at: Option<DateTime<Utc>>,
    /// The latest fetch failed: the tip may be stale.
    pub failing: bool,
}

/// Everything `plan` reads.
pub struct PlanInput<'a> {
    pub policy: &'a Policy,
    pub snapshot: &'a Snapshot,
    pub tracker: &'a Tracker,
    /// This reconciler's identity, written into markers it creates.
    pub owner: &'a str,
    pub fetch: FetchState,
    pub now: DateTime<Utc>,
}

/// `t + d`, saturating: durations and timestamps may come from outside.
fn after(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| t.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// Capped exponential backoff after failed verifies: retry_after/8 doubling,
/// capped at retry_after.
fn verify_backoff(policy: &Policy, attempt: u32) -> Duration {
    let base = policy.rotation.retry_after / 8;
    base.saturating_mul(1u32 << attempt.min(8))
        .min(policy.rotation.retry_after)
}

/// A machine's controls ([`crate::metadata::controls`]) as this plan reads
/// them: the sweep's parse, and the marker judged against `now`.
struct OperatorState<'a> {
    controls: &'a Controls,
    /// The marker, or why it cannot be one of ours (the field at fault, or
    /// timestamps implausibly far from `now`).
    marker: Option<Result<Marker, String>>,
}

/// How far from `now` a marker's timestamps may be before the marker is
/// treated as unreadable: anyone who can write metadata can write one, and
/// no rotation of ours spans more than a few ceilings.
const MARKER_TIME_SPAN: chrono::TimeDelta = chrono::TimeDelta::days(366);

/// A marker whose timestamps are far from `now` (year +262142, say) is not one
/// of ours: left alone and reported like an unreadable one.
fn plausible(marker: Marker, now: DateTime<Utc>) -> Result<Marker, String> {
    let near = |t: DateTime<Utc>| t.signed_duration_since(now).abs() <= MARKER_TIME_SPAN;
    let times = [
        ("started_at", Some(marker.started_at)),
        ("attempt_started_at", Some(marker.attempt_started_at)),
        ("restart_at", marker.restart_at),
        ("retry_at", marker.retry_at),
    ];
    match times.into_iter().find(|(_, t)| t.is_some_and(|t| !near(t))) {
        Some((field, _)) => Err(format!("field `{field}`: more than a year away from now")),
        None => Ok(marker),
    }
}

fn operator_state(m: &ObservedMachine, now: DateTime<Utc>) -> OperatorState<'_> {
    OperatorState {
        controls: &m.inputs.controls,
        marker: m
            .inputs
            .controls
            .marker
            .clone()
            .map(|r| r.and_then(|mk| plausible(mk, now))),
    }
}

/// What keeps an agent's report from allowing a restart that interrupts no work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotIdle {
    StaleHeartbeat,
    LiveWork,
    RecentInput,
    /// A drain was requested and the agent has not checkpointed this rotation.
    NoCheckpoint,
    CheckpointWithoutHeartbeat,
}

impl NotIdle {
    pub fn as_str(self) -> &'static str {
        match self {
            NotIdle::StaleHeartbeat => "stale heartbeat",
            NotIdle::LiveWork => "live work",
            NotIdle::RecentInput => "recent input",
            NotIdle::NoCheckpoint => "waiting for the agent's checkpoint",
            NotIdle::CheckpointWithoutHeartbeat => "checkpoint without a fresh heartbeat",
        }
    }
}

impl fmt::Display for NotIdle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a report allows a restart without interrupting work, and if not why.
/// The executor applies it again to a fresh probe made under the lease.
pub fn restart_allowed(
    policy: &Policy,
    r: &AgentReport,
    marker: &Marker,
    now: DateTime<Utc>,
) -> Result<(), NotIdle> {
    let fresh_heartbeat = |r: &AgentReport| r.heartbeat_at.is_some_and(|h| fresh(policy, h, now));
    if r.heartbeat_at.is_some() && !fresh_heartbeat(r) {
        return Err(NotIdle::StaleHeartbeat);
    }
    if r.has_live_work() {
        return Err(NotIdle::LiveWork);
    }
    if recent_input(policy, r, now) {
        return Err(NotIdle::RecentInput);
    }
    if marker.drain_requested {
        // A drain was requested: only the agent's own checkpoint authorizes the
        // restart, even if a later report stops advertising `drain`.
        let checkpointed = r.rotation.as_ref().is_some_and(|rot| {
            rot.fenced && rot.checkpoint.as_deref() == Some(marker.tag.as_str())
        });
        if !checkpointed {
            return Err(NotIdle::NoCheckpoint);
        }
        if !fresh_heartbeat(r) {
            return Err(NotIdle::CheckpointWithoutHeartbeat);
        }
    }
    Ok(())
}

/// A heartbeat is fresh when it is at most `heartbeat_max_age` old and not
/// more than a small tolerance in the future (a skewed clock is not fresh).
fn fresh(policy: &Policy, heartbeat: DateTime<Utc>, now: DateTime<Utc>) -> bool {
    match now.signed_duration_since(heartbeat).to_std() {
        Ok(age) => age <= policy.rotation.heartbeat_max_age,
        Err(_) => heartbeat
            .signed_duration_since(now)
            .to_std()
            .is_ok_and(|ahead| ahead <= HEARTBEAT_FUTURE_TOLERANCE),
    }
}

fn recent_input(policy: &Policy, r: &AgentReport, now: DateTime<Utc>) -> bool {
    r.last_input_at.is_some_and(|t| {
        now.signed_duration_since(t)
            .to_std()
            .map(|age| age < policy.rotation.recent_input_guard)
            // Input "from the future" (clock skew) counts as recent.
            .unwrap_or(true)
    })
}

/// Until when recent input keeps the agent out of a rotation, if it does now.
fn recent_input_until(
    policy: &Policy,
    r: &AgentReport,
    now: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    let t = r.last_input_at?;
    recent_input(policy, r, now).then(|| after(t, policy.rotation.recent_input_guard).max(now))
}

/// The report of a started machine, if this sweep has one.
fn usable_report(m: &ObservedMachine) -> Option<&AgentReport> {
    m.inputs.report.as_ref().filter(|_| m.state.is_started())
}

/// Policies that act by themselves; only these may use the probe-failure ceiling.
fn automatic(action: PolicyAction) -> bool {
    matches!(
        action,
        PolicyAction::AlertAndWait | PolicyAction::Restart | PolicyAction::Reload
    )
}

/// The probe-failure evidence the ceiling counts, for a machine without a
/// usable report: only the shared record, which any replica that gets a
/// usable report clears (this run's memory would restart work another
/// replica sees). Its `since` is on its writer's clock: it counts from the
/// later of it and this run's first sight of the record (`now` if unseen).
fn unprobed_evidence(
    tracker: &Tracker,
    m: &ObservedMachine,
    op: &OperatorState,
    now: DateTime<Utc>,
) -> Option<Unprobed> {
    // A record someone deleted still counts, from its first sight.
    let (record, seen) = match (&op.controls.unprobed, tracker.lost_record(&m.machine_id)) {
        (Some(record), _) => (
            record,
            tracker.record_seen(&m.machine_id, record).unwrap_or(now),
        ),
        (None, Some((record, at))) => (record, at),
        (None, None) => return None,
    };
    Some(Unprobed {
        since: record.since.max(seen),
        ..record.clone()
    })
}

/// This run's own memory of an unprobeable machine's drift: it feeds the
/// drift alert's severity and the shared record when there is none, never
/// the ceiling.
fn remembered_evidence(
    tracker: &Tracker,
    m: &ObservedMachine,
    op: &OperatorState,
) -> Option<Unprobed> {
    // Last seen drifted in this run, or mid-rotation (the marker says it was).
    let since = tracker.unprobed_since(&m.machine_id);
    tracker
        .carried_drift(&m.machine_id)
        .and_then(|s| {
            Some(Unprobed {
                since: since?,
                action: s.last_known_action?,
                severity: s.last_known_severity?,
            })
        })
        .or_else(|| match &op.marker {
            Some(Ok(marker)) if marker.phase.holds_slot() => Some(Unprobed {
                since: since?,
                action: marker.action,
                severity: marker.severity,
            }),
            _ => None,
        })
}

/// Whether Fly itself calls the machine unhealthy: at least one of its
/// checks is not passing. Without that, a machine we cannot probe may be
/// serving (we may be the one cut off), so the ceiling never restarts it.
fn fly_check_failing(m: &ObservedMachine) -> bool {
    crate::fly::MachineCheck::any_failing(m.inputs.checks())
}

/// Unprobeable past the ceiling after being seen drifted under a policy that
/// acts by itself, then and now. `observe` and `manual` pools are never
/// touched this way.
fn past_probe_ceiling(
    policy: &Policy,
    pool: &PoolName,
    evidence: Option<&Unprobed>,
    now: DateTime<Utc>,
) -> bool {
    evidence.is_some_and(|e| {
        automatic(e.action)
            && automatic(policy.action(pool, e.severity))
            && after(e.since, policy.rotation.probe_failure_ceiling) <= now
    })
}

/// A machine that may start (or complete) a claim this sweep, if its pool has room.
struct Candidate<'a> {
    severity: Severity,
    since: DateTime<Utc>,
    m: &'a ObservedMachine,
    mode: RotationMode,
    action: PolicyAction,
    /// The marker the claim replaces: a due `yielded` one, or our own
    /// `claiming` one (`None` for a first claim).
    expected: Option<Marker>,
}

/// Plans one sweep, in named steps over one `Planning` context:
/// `Planning::machine` for each machine (its decision, its alerts, the step
/// of a rotation in progress, or its candidacy for a claim), then
/// `Planning::claim_in_rank_order` (new claims, within each pool's cap),
/// then the alerts of what the sweep read on the coordinator (a tampered slot
/// set, halts) and the alert gate's. An unknown slot set refuses every
/// step that needs a slot here; how long it has been unknown, and
/// `coordinator_unreadable`, are `decide::alerts`'.
pub fn plan(input: &PlanInput<'_>) -> Plan {
    // Markers, holds and approvals as this plan reads them, once per machine.
    let ops: Vec<OperatorState> = input
        .snapshot
        .machines
        .iter()
        .map(|m| operator_state(&m.seen, input.now))
        .collect();
    let mut planning = Planning::new(input, &ops);
    for (m, op) in input.snapshot.machines.iter().zip(&ops) {
        planning.machine(m, op);
    }
    planning.yield_over_cap();
    planning.claim_in_rank_order();
    planning.slots_tampered_alert();
    planning.halt_alerts();
    planning.alerts.extend(crate::decide::guardrail::gate_alert(
        input.policy,
        input.snapshot,
    ));
    planning.finish()
}

/// The one context of a plan's steps: what they read, and the plan they build.
struct Planning<'a> {
    policy: &'a Policy,
    report: &'a Snapshot,
    tracker: &'a Tracker,
    owner: &'a str,
    fetch: FetchState,
    now: DateTime<Utc>,
    tip: &'a CommitId,
    stale: HashSet<&'a str>,
    /// Slots taken per (app, pool), claims of this plan included.
    in_use: BTreeMap<(AppName, PoolName), usize>,
    /// Machines that may claim a slot this sweep, ranked once all are known.
    candidates: Vec<Candidate<'a>>,
    /// Per machine: its decision once made, its step, its drift clock.
    machines: BTreeMap<MachineId, Draft>,
    /// Machines with a step, in the order their steps were planned.
    start_order: Vec<MachineId>,
    alerts: Vec<Alert>,
    rotations_in_progress: BTreeMap<(AppName, PoolName), usize>,
    /// Per (app, pool): the rotations that may yield if the pool is over
    /// its current cap, and how many of its rotations end this sweep anyway.
    over_cap: BTreeMap<(AppName, PoolName), OverCap>,
    /// Apps whose release tip is halted.
    halts: BTreeMap<AppName, Halted>,
    /// Apps the alert gate holds: no new claim (`decide::guardrail`).
    alert_gates: BTreeMap<AppName, Guard>,
    /// Each pool's guardrail this sweep, judged once per pool.
    pool_guards: BTreeMap<PoolName, Option<Guard>>,
    /// The guardrails that held a claim, per (app, pool).
    guards: BTreeMap<(AppName, PoolName), Guard>,
}

/// A pool's rotations in progress, as far as its current cap is concerned.
#[derive(Default)]
struct OverCap {
    /// Rotations that have not restarted (`draining`, `reloading`) and go
    /// on this sweep, each with the yield that would end it.
    yieldable: Vec<(DateTime<Utc>, MachineId, Step)>,
    /// Rotations this plan undoes (or goes on undoing): their slots are on
    /// their way out.
    ending: usize,
}

/// A machine's entry while the plan is made: every machine is decided by
/// the end (its candidacy's decision comes with the claims).
#[derive(Default)]
struct Draft {
    decision: Option<Decision>,
    step: Option<Step>,
    drift_since: Option<DateTime<Utc>>,
}

impl<'a> Planning<'a> {
    fn new(input: &PlanInput<'a>, ops: &[OperatorState]) -> Planning<'a> {
        let report = input.snapshot;
        let in_use = slots_in_use(report, ops);
        Planning {
            policy: input.policy,
            report,
            tracker: input.tracker,
            owner: input.owner,
            fetch: input.fetch,
            now: input.now,
            tip: &report.tip.commit,
            stale: report.stale_app_names(),
            rotations_in_progress: in_use.clone(),
            in_use,
            candidates: Vec::new(),
            machines: BTreeMap::new(),
            start_order: Vec::new(),
            alerts: Vec::new(),
            over_cap: BTreeMap::new(),
            halts: crate::decide::halt::halts(
                input.policy,
                report,
                &input.tracker.failures,
                input.now,
            ),
            alert_gates: crate::decide::guardrail::alert_gate(input.policy, report),
            pool_guards: BTreeMap::new(),
            guards: BTreeMap::new(),
        }
    }

    /// The plan: every machine decided, each with at most one step.
    fn finish(self) -> Plan {
        let machines: BTreeMap<MachineId, MachinePlan> = self
            .machines
            .into_iter()
            .filter_map(|(id, d)| {
                // Every path of `machine` and `claim` decides; a machine left
                // undecided would be a planner bug, and gets no step.
                debug_assert!(d.decision.is_some(), "{id} was not decided");
                let plan = MachinePlan {
                    decision: d.decision?,
                    step: d.step,
                    drift_since: d.drift_since,
                };
                Some((id, plan))
            })
            .collect();
        let start_order = self
            .start_order
            .into_iter()
            .filter(|id| machines.get(id).is_some_and(|m| m.step.is_some()))
            .collect();
        Plan {
            machines,
            start_order,
            alerts: self.alerts,
            rotations_in_progress: self.rotations_in_progress,
            halts: self.halts,
            guards: self.guards,
        }
    }

    fn decide(&mut self, m: &ObservedMachine, decision: Decision) {
        self.draft(m).decision = Some(decision);
    }

    fn draft(&mut self, m: &ObservedMachine) -> &mut Draft {
        self.machines.entry(m.machine_id.clone()).or_default()
    }

    /// The machine's one step. A rotation step replaces the bookkeeping of
    /// the probe-failure record (which waits for a sweep without one) and
    /// starts after the steps planned before it; bookkeeping never replaces
    /// a rotation step.
    fn step(&mut self, step: Step) {
        let id = step.target.machine_id.clone();
        let draft = self.machines.entry(id.clone()).or_default();
        match &draft.step {
            Some(planned) if !planned.is_bookkeeping() => {
                debug_assert!(step.is_bookkeeping(), "two rotation steps for {id}");
                return;
            }
            Some(_) if step.is_bookkeeping() => return,
            Some(_) => self.start_order.retain(|m| *m != id),
            None => {}
        }
        draft.step = Some(step);
        self.start_order.push(id);
    }

    fn alert(&mut self, kind: AlertKind, m: &JudgedMachine, severity: Severity, summary: String) {
        let alert = machine_alert(kind, m, self.tip, severity, summary);
        self.alerts.push(alert);
    }

    /// One machine: skipped while its app is not listed; its drift alert;
    /// nothing more while it is held; else the step its marker calls for,
    /// or its candidacy for a claim; then the probe-failure bookkeeping.
    fn machine(&mut self, m: &'a JudgedMachine, op: &'a OperatorState) {
        self.draft(&m.seen).drift_since = self.tracker.drift_since(&m.seen.machine_id);
        if self.app_not_listed(&m.seen, op) {
            return;
        }
        // Unprobeable now, drifted before: still drifting as far as anyone
        // knows, so its alert keeps firing (no flapping).
        let evidence = unprobeable(m.seen.status)
            .then(|| unprobed_evidence(self.tracker, &m.seen, op, self.now))
            .flatten();
        let remembered = unprobeable(m.seen.status)
            .then(|| remembered_evidence(self.tracker, &m.seen, op))
            .flatten();
        self.drift_alert(m, evidence.as_ref().or(remembered.as_ref()));
        self.tampered_alert(m, op);
        let mut target = target_of(&m.seen);
        // A rotation ends in the pool whose slot it won, whatever the label says now.
        let pool = match &op.marker {
            Some(Ok(marker)) => marker.pool_or(&m.seen.pool),
            _ => &m.seen.pool,
        };
        target.pool = pool.clone();
        let ctx = Ctx {
            policy: self.policy,
            m,
            op,
            target: &target,
            pool,
            evidence: evidence.as_ref(),
            marker_seen: match &op.marker {
                Some(Ok(marker)) => self.tracker.marker_seen(&m.seen.machine_id, marker),
                _ => None,
            },
            drift_since: self.tracker.drift_since(&m.seen.machine_id),
            unprobed_since: self.tracker.unprobed_since(&m.seen.machine_id),
            fetch: self.fetch,
            now: self.now,
            tip: self.tip,
        };
        // Unknown is not empty: no hold, marker or approval can be seen, so
        // nothing at all is planned (not even an undo or bookkeeping).
        if let Some(why) = m.seen.inputs.metadata_unknown() {
            self.metadata_unknown(&ctx, why);
            return;
        }
        if self.held(m, op) {
            return; // never act on a held machine, never clear its hold
        }
        let step = match &op.marker {
            Some(Err(why)) => self.unreadable_marker(m, why),
            Some(Ok(marker)) if marker.phase.holds_slot() => {
                self.rotation_in_progress(&ctx, marker)
            }
            Some(Ok(marker)) => self.unfinished_claim_or_yielded(&ctx, m, marker),
            None => {
                self.cordoned_without_marker(&ctx);
                self.candidacy(&ctx, m, None);
                None
            }
        };
        let step = step.or_else(|| unprobed_bookkeeping(&m.seen, op, &target, remembered.as_ref()));
        // Unknown is not empty: a step that needs its slot waits until the
        // coordinator can be read (the undo needs none and goes on).
        let step = step.filter(|s| !(s.needs_slot() && self.slots_unknown().is_some()));
        if let Some(step) = step {
            self.step(step);
        }
    }

    /// A machine whose metadata Fly cannot show: nothing is planned for it.
    /// A rotation its last listing knew (`decide::prepare` carries the
    /// marker) whose ceiling passed on this replica's clock, or a cordon Fly
    /// shows with no marker known, would wait unseen for as long as the host
    /// is out: each is alerted, naming the outage.
    fn metadata_unknown(&mut self, ctx: &Ctx<'_>, why: &str) {
        let m = ctx.m;
        self.decide(
            &m.seen,
            Decision::MetadataUnknown {
                why: why.to_string(),
            },
        );
        let id = &m.seen.machine_id;
        let (severity, summary) = match &ctx.op.marker {
            Some(Ok(marker)) if marker.phase.holds_slot() => {
                let deadline = match rotation_decision(ctx, marker) {
                    Decision::LiveWork { deadline, .. }
                    | Decision::InRotation {
                        deadline: Some(deadline),
                        ..
                    } => deadline,
                    _ => return,
                };
                if deadline > ctx.now {
                    return;
                }
                (
                    marker.severity.max(Severity::High),
                    format!(
                        "{id} is mid-rotation (phase {phase}{cordon}) past its deadline {deadline}, and Fly cannot show its metadata ({why}): nothing can be done to it until its host is back; pool {pool} of {app} waits on its slot",
                        phase = marker.phase,
                        cordon = if marker.may_have_cordoned() {
                            ", may be cordoned"
                        } else {
                            ""
                        },
                        deadline = deadline.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                        pool = ctx.pool,
                        app = m.seen.app,
                    ),
                )
            }
            None if m.seen.inputs.cordoned == Some(true) => (
                Severity::High,
                format!(
                    "{id} is cordoned, no rotation marker of it is known, and Fly cannot show its metadata ({why}): nothing can be done to it until its host is back; `fly machine uncordon {id} -a {app}` if no rotation is under way",
                    app = m.seen.app,
                ),
            ),
            _ => return,
        };
        self.alert(AlertKind::RotationStuck, m, severity, summary);
    }

    /// An app the sweep could not list is known only from an older listing:
    /// no step for its machines, not even an undo, and no alert of its own
    /// (the caller keeps those that were firing). A rotation in progress
    /// there waits, marker and slot as they are, until it lists.
    fn app_not_listed(&mut self, m: &ObservedMachine, op: &OperatorState) -> bool {
        if !self.stale.contains(m.app.as_str()) {
            return false;
        }
        let decision = Decision::AppNotListed {
            held: op.controls.is_held(),
            phase: rotating(op),
        };
        self.decide(m, decision);
        true
    }

    /// The drift alert, once the drift (or, unprobeable now, the last drift
    /// seen) is older than `min_drift_age`.
    fn drift_alert(&mut self, m: &JudgedMachine, evidence: Option<&Unprobed>) {
        let aged = self
            .tracker
            .drift_since(&m.seen.machine_id)
            .is_some_and(|t| after(t, self.policy.rotation.min_drift_age) <= self.now);
        if let (Some(severity), true) = (m.severity().or(evidence.map(|e| e.severity)), aged) {
            let mut summary = drift_summary(&m.seen);
            if evidence.is_some() && !fly_check_failing(&m.seen) {
                summary.push_str(
                    "; Fly's checks do not fail (or it has none): the probe-failure ceiling will not restart it",
                );
            }
            self.alert(AlertKind::Drift, m, severity, summary);
        }
    }

    /// Each record on the machine that is not the one we sealed (an agent
    /// can write its app's metadata): one alert per machine while it lasts,
    /// naming every such key and what was found there. Nothing is done on
    /// the strength of those records (see `metadata::controls`).
    fn tampered_alert(&mut self, m: &JudgedMachine, op: &OperatorState) {
        let mut tampered = op.controls.tampered.clone();
        if op.controls.unprobed.is_none() && self.tracker.lost_record(&m.seen.machine_id).is_some()
        {
            tampered.push(crate::metadata::controls::Tampered {
                key: crate::metadata::UNPROBED_KEY,
                found: crate::metadata::controls::Found::Removed,
            });
        }
        if tampered.is_empty() {
            return;
        }
        let found = tampered
            .iter()
            .map(|t| format!("metadata key {}: {}", t.key, t.found))
            .collect::<Vec<_>>()
            .join("; ");
        let mut alert = machine_alert(
            AlertKind::MetadataTampered,
            m,
            self.tip,
            Severity::High,
            format!(
                "{id} of {app} carries records not sealed by this fleet's record key ({found}); nothing is done on their strength: see the metadata_tampered runbook (docs/operations.md)",
                id = m.seen.machine_id,
                app = m.seen.app,
            ),
        );
        // One condition per machine, whatever the tip: a new tip does not re-page it.
        alert.commit = None;
        alert.details.insert(
            "keys".to_string(),
            tampered.iter().map(|t| t.key).collect::<Vec<_>>().join(","),
        );
        self.alerts.push(alert);
    }

    /// A held machine: decided `held`, and a rotation it holds a slot for
    /// is reported stuck. True when held.
    fn held(&mut self, m: &JudgedMachine, op: &OperatorState) -> bool {
        if !op.controls.is_held() {
            return false;
        }
        let hold = op.controls.hold();
        let decision = Decision::Held {
            by: hold.map(|h| h.by.clone()),
            since: hold.map(|h| h.at),
            reason: hold.map(|h| h.reason.clone()),
            phase: rotating(op),
        };
        self.decide(&m.seen, decision);
        if let Some(Ok(marker)) = &op.marker
            && marker.phase.holds_slot()
        {
            self.alert(
                AlertKind::RotationStuck,
                m,
                marker.severity.max(Severity::High),
                format!(
                    "{id} is held mid-rotation (phase {phase}{cordon}{fence}); pool {pool} of {app} waits on its slot; `fleet-reconciler release {id}` lets the rotation continue from phase {phase}",
                    id = m.seen.machine_id,
                    phase = marker.phase,
                    pool = m.seen.pool,
                    app = m.seen.app,
                    cordon = if marker.may_have_cordoned() { ", cordoned" } else { "" },
                    fence = if marker.drain_requested { ", drain requested" } else { "" },
                ),
            );
        }
        true
    }

    /// A marker this reconciler cannot read is left alone, and reported.
    fn unreadable_marker(&mut self, m: &JudgedMachine, why: &str) -> Option<Step> {
        self.decide(
            &m.seen,
            Decision::UnreadableMarker {
                why: why.to_string(),
            },
        );
        self.alert(
            AlertKind::RotationStuck,
            m,
            Severity::High,
            format!(
                "{} has a rotation marker (metadata key {MARKER_KEY}) this reconciler cannot read ({why}); not touching it",
                m.seen.machine_id
            ),
        );
        None
    }

    /// A machine Fly says is cordoned and that no marker claims: our cordon
    /// landed after an outside update reverted the marker (to none, or to
    /// our `claiming` one, which was then withdrawn), and the executor's
    /// immediate uncordon failed. Its capacity is out whether or not it
    /// still holds a slot, so it always counts (see [`slots_in_use`]) and is
    /// alerted; a human uncordons it, or a new rotation of the machine ends
    /// with an uncordon. A machine whose metadata is unknown may carry a
    /// marker: not alerted as one without.
    fn cordoned_without_marker(&mut self, ctx: &Ctx<'_>) {
        let m = ctx.m;
        if m.seen.inputs.cordoned != Some(true) || m.seen.inputs.metadata_unknown().is_some() {
            return;
        }
        let slot = match &self.report.slots {
            SlotsView::Known(set) => set
                .slots(&m.seen.app, ctx.pool)
                .iter()
                .any(|s| s.machine_id == m.seen.machine_id),
            SlotsView::Unknown(_) | SlotsView::Tampered(_) | SlotsView::NotConfigured => false,
        };
        let (id, app) = (&m.seen.machine_id, &m.seen.app);
        let summary = if slot {
            format!(
                "{id} is cordoned and holds a rotation slot of pool {} but carries no rotation marker (an outside update such as `fly deploy` reverted it): `fly machine uncordon {id} -a {app}`; the slot is freed once it is uncordoned",
                ctx.pool
            )
        } else {
            format!(
                "{id} is cordoned but carries no rotation marker (an outside update such as `fly deploy` may have reverted it around our cordon): it counts against pool {}'s cap until `fly machine uncordon {id} -a {app}`",
                ctx.pool
            )
        };
        self.alerts.push(machine_alert(
            AlertKind::RotationStuck,
            m,
            ctx.tip,
            Severity::High,
            summary,
        ));
    }

    /// A rotation that holds a slot: cancelled when the coordinator has no
    /// slot for it, else its next step.
    fn rotation_in_progress(&mut self, ctx: &Ctx<'_>, marker: &Marker) -> Option<Step> {
        let m = ctx.m;
        self.decide(&m.seen, rotation_decision(ctx, marker));
        let orphan = matches!(&self.report.slots, SlotsView::Known(set)
            if !set.holds(&m.seen.app, ctx.pool, &m.seen.machine_id, &marker.tag));
        if orphan
            && marker.phase == Phase::Releasing
            && !m.seen.state.is_started()
            && marker.may_have_cordoned()
        {
            // The executor let the slot go because the machine stopped
            // (autostop) and its uncordon failed: while cordoned, Fly Proxy
            // will not start it again on demand. A human should know.
            self.alerts.push(machine_alert(
                AlertKind::RotationStuck,
                m,
                ctx.tip,
                marker.severity.max(Severity::High),
                format!(
                    "{} is {} and may still be cordoned (its uncordon failed); Fly Proxy will not start it on demand until it is uncordoned: `fly machine uncordon {} -a {}` (retried every sweep)",
                    m.seen.machine_id, m.seen.state, m.seen.machine_id, m.seen.app
                ),
            ));
        }
        let step = if orphan && marker.phase != Phase::Releasing {
            Some(release(
                ctx.target,
                marker,
                &m.seen,
                ctx.op,
                Ending::Cancelled,
                ReleaseWhy::NoSlot,
                ctx.now,
            ))
        } else {
            advance(ctx, marker, &mut self.alerts)
        };
        self.note_for_cap(ctx, marker, step.as_ref());
        step
    }

    /// Notes what the pool's current cap may ask of this rotation: one
    /// that has not restarted and goes on may yield; one being undone frees
    /// its slot anyway.
    fn note_for_cap(&mut self, ctx: &Ctx<'_>, marker: &Marker, step: Option<&Step>) {
        let key = (ctx.m.seen.app.clone(), ctx.pool.clone());
        let ends = matches!(step, Some(s) if matches!(s.kind, StepKind::Release { .. }));
        if ends {
            self.over_cap.entry(key).or_default().ending += 1;
        } else if matches!(marker.phase, Phase::Draining | Phase::Reloading) {
            let yield_ = Rotation::new(ctx, marker).yield_(ReleaseWhy::OverCap);
            self.over_cap.entry(key).or_default().yieldable.push((
                marker.started_at,
                ctx.m.seen.machine_id.clone(),
                yield_,
            ));
        }
    }

    /// A pool whose rotations exceed its current cap (lowered since they
    /// were claimed) yields the excess that has not restarted, through the
    /// ordinary yield (undone, retried after `retry_after`). Newest first:
    /// `started_at` of markers written by different replicas' clocks, which
    /// only chooses which rotations yield, never whether or how many.
    fn yield_over_cap(&mut self) {
        for ((app, pool), mut over) in std::mem::take(&mut self.over_cap) {
            let cap = self.policy.pool(&pool).max_concurrent_rotations.get() as usize;
            let in_use = self.in_use.get(&(app, pool)).copied().unwrap_or(0);
            let excess = in_use.saturating_sub(cap).saturating_sub(over.ending);
            over.yieldable
                .sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
            for (_, id, step) in over.yieldable.into_iter().take(excess) {
                let draft = self.machines.entry(id.clone()).or_default();
                draft.step = Some(step);
                if !self.start_order.contains(&id) {
                    self.start_order.push(id);
                }
            }
        }
    }

    /// A marker that holds no slot: our own unfinished `claiming`, or
    /// `yielded` (finished on the tip, waiting for its retry, or due).
    fn unfinished_claim_or_yielded(
        &mut self,
        ctx: &Ctx<'_>,
        m: &'a JudgedMachine,
        marker: &Marker,
    ) -> Option<Step> {
        let yielded = marker.phase == Phase::Yielded;
        let retry_at = marker.retry_at.map(|t| ctx.retry_due(marker, t));
        if yielded && m.seen.status == MachineStatus::OnTip {
            self.decide(&m.seen, Decision::OnTip);
            return Some(release(
                ctx.target,
                marker,
                &m.seen,
                ctx.op,
                Ending::Finished,
                ReleaseWhy::OnTip,
                ctx.now,
            ));
        }
        if yielded && let Some(failed) = &marker.failed {
            // No new attempt for the failed target until the tip moves or an
            // operator approves it anew: an approval other than the one that
            // stood when it failed (never by comparing the operator's clock
            // with ours). The rotation it re-arms consumes it.
            let controls = &ctx.op.controls;
            let rearmed = marker.target != *self.tip
                || (controls.approval_for(self.tip).is_some()
                    && controls.approval_id() != failed.approval.as_ref());
            if !rearmed {
                self.decide(
                    &m.seen,
                    Decision::RotationFailed {
                        target: marker.target.clone(),
                        attempts: failed.attempts,
                        at: failed.at,
                        evidence: failed.evidence.clone(),
                    },
                );
                self.alert(
                    AlertKind::RotationFailed,
                    m,
                    marker.severity.max(Severity::High),
                    format!(
                        "the rotation of {id} to {} failed after {} restart(s) at {} ({}); no new attempt until the tip moves or `fleet-reconciler approve {id}`",
                        crate::model::short_commit(marker.target.as_str()),
                        failed.attempts,
                        failed.at.to_rfc3339(),
                        failed.evidence,
                        id = m.seen.machine_id,
                    ),
                );
                return None;
            }
        } else if yielded && retry_at.is_none_or(|t| t > self.now) {
            self.decide(&m.seen, Decision::Yielded { retry_at });
            self.alert(
                AlertKind::RotationStuck,
                m,
                marker.severity,
                format!(
                    "rotation of {} yielded without interrupting work; retrying at {}",
                    m.seen.machine_id,
                    retry_at.map(|t| t.to_rfc3339()).unwrap_or_default()
                ),
            );
            return None;
        }
        if self.candidacy(ctx, m, Some(marker)) || yielded {
            return None;
        }
        // A claim that cannot go on is withdrawn; a yielded marker simply
        // waits (it holds nothing).
        Some(Step {
            target: ctx.target.clone(),
            expected: Some(marker.clone()),
            kind: StepKind::Withdraw {
                why: WithdrawWhy::NoLongerQualifies,
            },
        })
    }

    /// Whether the machine may claim a slot this sweep: a candidate (true),
    /// or decided why not (false). `expected` is the marker the claim replaces.
    fn candidacy(
        &mut self,
        ctx: &Ctx<'_>,
        m: &'a JudgedMachine,
        expected: Option<&Marker>,
    ) -> bool {
        match candidate(ctx, m, &mut self.alerts) {
            Ok(mut c) => {
                c.expected = expected.cloned();
                self.candidates.push(c);
                true
            }
            Err(decision) => {
                self.decide(&m.seen, decision);
                false
            }
        }
    }

    /// New claims, most severe first, then oldest drift, each within its
    /// pool's cap; the others wait for a slot (and our unfinished claim
    /// among them is withdrawn).
    fn claim_in_rank_order(&mut self) {
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.sort_by(|a, b| {
            b.severity
                .cmp(&a.severity)
                .then(a.since.cmp(&b.since))
                .then(a.m.machine_id.cmp(&b.m.machine_id))
        });
        for c in candidates {
            self.claim(c);
        }
    }

    fn claim(&mut self, c: Candidate<'a>) {
        let Candidate {
            severity,
            m,
            mode,
            action,
            expected,
            ..
        } = c;
        if self.halted_claim(m, expected.as_ref()) || self.guarded_claim(m, expected.as_ref()) {
            return;
        }
        if let Some(why) = self.slots_unknown() {
            // Unknown is not empty: no claim. Our unfinished claim permits
            // nothing and stays until the set can be read.
            let why = why.to_string();
            self.decide(m, Decision::SlotsUnknown { why });
            return;
        }
        let cap = self.policy.pool(&m.pool).max_concurrent_rotations.get() as usize;
        let used = self
            .in_use
            .entry((m.app.clone(), m.pool.clone()))
            .or_default();
        let claiming = expected.as_ref().filter(|e| e.phase == Phase::Claiming);
        // Our unfinished claim whose slot is already won (its answer lost,
        // or its daemon gone right after) is counted in `used` by that
        // slot: it completes under its tag, taking nothing more.
        let won = claiming.is_some_and(|c| {
            matches!(&self.report.slots, SlotsView::Known(set)
                if set.holds(&m.app, &m.pool, &m.machine_id, &c.tag))
        });
        if *used >= cap && !won {
            let in_use = *used;
            self.decide(
                m,
                Decision::WaitingForSlot {
                    pool: m.pool.clone(),
                    in_use,
                    cap,
                },
            );
            // Our unfinished claim must not linger as if it could go on.
            if let Some(mine) = claiming {
                self.step(Step {
                    target: target_of(m),
                    expected: Some(mine.clone()),
                    kind: StepKind::Withdraw {
                        why: WithdrawWhy::PoolAtCap,
                    },
                });
            }
            return;
        }
        if !won {
            *used += 1;
        }
        let cooperative = usable_report(m).is_some_and(|r| r.can(Capability::Drain));
        let reload = mode == RotationMode::Reload;
        let now = self.now;
        // An unfinished claim keeps its tag: its slot may already be won.
        let tag = claiming.map(|c| c.tag.clone()).unwrap_or_else(|| {
            let owner_hash = self
                .owner
                .bytes()
                .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
            Marker::new_tag(
                m.machine_id.as_str(),
                self.tip,
                now,
                now.timestamp_subsec_nanos() ^ owner_hash,
            )
        });
        // A retry of the same target carries its count of restarts on (a
        // yield must not reset `rotation.max_attempts`); a failed target
        // that is re-armed starts over.
        let attempt = expected
            .as_ref()
            .filter(|e| e.target == *self.tip && e.failed.is_none())
            .map_or(0, |e| e.attempt);
        // The approval this rotation uses, consumed once it has restarted: a
        // `manual` claim's, or the one that re-armed its failed target.
        let rearmed = expected
            .as_ref()
            .is_some_and(|e| e.failed.is_some() && e.target == *self.tip);
        let approval = (action == PolicyAction::Manual || rearmed)
            .then(|| m.inputs.controls.approval_id().cloned())
            .flatten();
        let marker = Marker {
            tag,
            target: self.tip.clone(),
            phase: Phase::Claiming,
            mode,
            action,
            severity,
            started_at: now,
            attempt_started_at: now,
            attempt,
            owner: self.owner.to_string(),
            restart_at: None,
            retry_at: None,
            drain_requested: cooperative && !reload,
            cordoned: Some(false),
            ending: None,
            // Recorded by the executor from the machine it reads under the
            // lease, not from this (older) snapshot.
            instance_id: None,
            pool: Some(m.pool.clone()),
            failed: None,
            approval,
        };
        self.decide(m, Decision::Claiming { mode });
        self.step(Step {
            target: target_of(m),
            expected,
            kind: StepKind::Claim {
                drain: marker.drain_requested,
                reload,
                marker,
            },
        });
    }

    /// A claim toward a halted tip is not made (`[release]`): the machine
    /// is decided `halted`, and our unfinished claim is withdrawn. Rotations
    /// already holding a slot are not candidates and go on (their undo too).
    fn halted_claim(&mut self, m: &ObservedMachine, expected: Option<&Marker>) -> bool {
        let Some(halted) = self.halts.get(&m.app) else {
            return false;
        };
        self.decide(
            m,
            Decision::Halted {
                app: Some(m.app.clone()),
                tip: halted.tip.clone(),
                failures: halted.failures.len(),
                verified: !matches!(halted.source, HaltSource::Unverified(_)),
            },
        );
        if let Some(mine) = expected.filter(|e| e.phase == Phase::Claiming) {
            self.step(Step {
                target: target_of(m),
                expected: Some(mine.clone()),
                kind: StepKind::Withdraw {
                    why: WithdrawWhy::ReleaseHalted,
                },
            });
        }
        true
    }

    /// A claim a guardrail holds is not made (a firing alert or an
    /// unreadable alert gate for its app, a canary pool not soaked on the
    /// tip, a maintenance window): the machine is decided `guarded`, and our
    /// unfinished claim is withdrawn (its slot may be won: the withdraw
    /// gives it back). `approve --now` of the tip overrides a window (not a
    /// canary, not the alert gate). Rotations already holding a slot are not
    /// candidates and go on.
    fn guarded_claim(&mut self, m: &ObservedMachine, expected: Option<&Marker>) -> bool {
        let guard = match self.alert_gates.get(&m.app) {
            Some(gate) => gate.clone(),
            None => {
                let Some(guard) = self.pool_guard(&m.pool) else {
                    return false;
                };
                let now_approved = m
                    .inputs
                    .controls
                    .approval_for(self.tip)
                    .is_some_and(|a| a.mode == ApprovalMode::Now);
                if now_approved && guard.overridden_by_approval() {
                    return false;
                }
                guard
            }
        };
        self.guards
            .entry((m.app.clone(), m.pool.clone()))
            .or_insert_with(|| guard.clone());
        self.decide(m, Decision::Guarded { guard });
        if let Some(mine) = expected.filter(|e| e.phase == Phase::Claiming) {
            self.step(Step {
                target: target_of(m),
                expected: Some(mine.clone()),
                kind: StepKind::Withdraw {
                    why: WithdrawWhy::Guarded,
                },
            });
        }
        true
    }

    /// The guardrail holding `pool` now, judged once per pool per plan: its
    /// maintenance windows first (they say until when), then its canary.
    fn pool_guard(&mut self, pool: &PoolName) -> Option<Guard> {
        if let Some(g) = self.pool_guards.get(pool) {
            return g.clone();
        }
        let config = self.policy.pool(pool);
        let halted_apps: HashSet<&AppName> = self.halts.keys().collect();
        let report = self.report;
        let halted = |canary: &PoolName| {
            report
                .machines
                .iter()
                .any(|m| m.seen.pool == *canary && halted_apps.contains(&m.seen.app))
        };
        let guard =
            crate::decide::guardrail::window_guard(&config.windows, self.now).or_else(|| {
                crate::decide::guardrail::canary_guard(
                    self.policy,
                    report,
                    &self.tracker.canaries,
                    pool,
                    halted,
                    self.now,
                )
            });
        self.pool_guards.insert(pool.clone(), guard.clone());
        guard
    }

    /// `release_halted` once per halted app and tip, naming the failures
    /// and their evidence; an unverifiable halt record is also
    /// `metadata_tampered` (it halts all the same: fail closed).
    fn halt_alerts(&mut self) {
        for (app, h) in &self.halts {
            let failures = h
                .failures
                .iter()
                .map(|f| format!("{} {}", f.machine_id, f.outcome.as_str()))
                .collect::<Vec<_>>()
                .join(", ");
            let why = match &h.source {
                HaltSource::Detected => format!(
                    "{} rotation(s) toward it ended failed within {}: {failures}",
                    h.failures.len(),
                    humantime::format_duration(self.policy.release.halt_window.get()),
                ),
                HaltSource::Recorded { by, at } => format!(
                    "halted by {by} at {} after {} failed rotation(s): {failures}",
                    at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    h.failures.len(),
                ),
                HaltSource::Unverified(found) => format!(
                    "the coordinator's halt record is not one this fleet sealed ({found}), so the release counts as halted"
                ),
            };
            let mut details = BTreeMap::new();
            details.insert("tip".to_string(), h.tip.to_string());
            details.insert("failures".to_string(), failures);
            if let Some(first) = h.failures.first() {
                details.insert("evidence".to_string(), first.evidence.clone());
            }
            self.alerts.push(Alert {
                kind: AlertKind::ReleaseHalted,
                app: Some(app.clone()),
                machine_id: None,
                commit: Some(h.tip.clone()),
                severity: Severity::Critical,
                summary: format!(
                    "the release {} of {app} is halted: {why}; no new rotation toward it starts (those under way finish); `fleet-reconciler resume {app}` lifts it (see the release_halted runbook, docs/operations.md)",
                    crate::model::short_commit(h.tip.as_str()),
                ),
                details,
            });
            if let HaltSource::Unverified(found) = &h.source {
                // Halt records are only read from a configured coordinator.
                let c = self.policy.rotation.coordinator.as_ref();
                let key = crate::metadata::halt::coordinator_halt_key(app.as_str());
                let mut details = BTreeMap::new();
                details.insert("keys".to_string(), key.clone());
                self.alerts.push(Alert {
                    kind: AlertKind::MetadataTampered,
                    app: c.map(|c| c.app.clone()),
                    machine_id: c.map(|c| c.machine_id.clone()),
                    commit: None,
                    severity: Severity::High,
                    summary: format!(
                        "the coordinator's metadata key {key} is not a halt record this fleet sealed ({found}): {app}'s release counts as halted until `fleet-reconciler resume {app}`; see the metadata_tampered runbook (docs/operations.md)"
                    ),
                    details,
                });
            }
        }
    }

    /// Why the coordinator's slot set is unknown, if it is.
    fn slots_unknown(&self) -> Option<&'a str> {
        match &self.report.slots {
            SlotsView::Unknown(why) | SlotsView::Tampered(why) => Some(why.as_str()),
            SlotsView::Known(_) | SlotsView::NotConfigured => None,
        }
    }

    /// A slot set on a coordinator agents can write that is not the one we
    /// sealed: alerted at once (the set is unknown meanwhile, as unreadable).
    fn slots_tampered_alert(&mut self) {
        let (SlotsView::Tampered(why), Some(c)) =
            (&self.report.slots, &self.policy.rotation.coordinator)
        else {
            return;
        };
        let mut details = BTreeMap::new();
        details.insert("keys".to_string(), crate::metadata::SLOTS_KEY.to_string());
        self.alerts.push(Alert {
            kind: AlertKind::MetadataTampered,
            app: Some(c.app.clone()),
            machine_id: Some(c.machine_id.clone()),
            commit: None,
            severity: Severity::High,
            summary: format!(
                "the coordinator {c} sits in a swept app, where agents can write its metadata, and its slot set is not the one this fleet sealed ({why}): no rotation starts, drains or restarts until it is; see the metadata_tampered runbook (docs/operations.md)"
            ),
            details,
        });
    }
}

/// Capacity out of each (app, pool). Where the coordinator's set is known it
/// is the count of its live slots, judged as the executor reclaims them: a
/// slot is left behind (and reclaimed by the next claim that needs it) only
/// when its machine is gone from a listed app or carries no marker with the
/// slot's tag that needs it; a machine whose metadata is unknown, or whose
/// marker is unreadable, or which is cordoned with no marker at all, keeps
/// its slot (fail closed), and an unreadable marker counts only for a slot
/// it holds. Readable markers holding capacity
/// without a slot (being undone, maybe still cordoned) count too, and so
/// does a machine Fly shows cordoned with no marker and no slot (its
/// capacity is out all the same). Without a known set, every marker that
/// may hold a slot counts, unreadable and unknown ones included, and every
/// machine cordoned with no marker.
fn slots_in_use(report: &Snapshot, ops: &[OperatorState]) -> BTreeMap<(AppName, PoolName), usize> {
    let mut in_use: BTreeMap<(AppName, PoolName), usize> = BTreeMap::new();
    let set = match &report.slots {
        SlotsView::Known(set) => Some(set),
        SlotsView::Unknown(_) | SlotsView::Tampered(_) | SlotsView::NotConfigured => None,
    };
    if let Some(set) = set {
        let stale = report.stale_app_names();
        let machines: HashMap<(&str, &str), (&ObservedMachine, &OperatorState)> = report
            .machines
            .iter()
            .map(|m| &m.seen)
            .zip(ops)
            .map(|(m, op)| ((m.app.as_str(), m.machine_id.as_str()), (m, op)))
            .collect();
        for (key, slots) in &set.pools {
            let Some((app, pool)) = key.split_once('/') else {
                continue;
            };
            let live = slots
                .iter()
                .filter(
                    |slot| match machines.get(&(app, slot.machine_id.as_str())) {
                        None => stale.contains(app),
                        Some((m, _)) if m.inputs.metadata_unknown().is_some() => true,
                        Some((m, op)) => match &op.marker {
                            // Cordoned with its marker gone (an outside
                            // update reverted it around our cordon): its
                            // capacity is out, so its slot stays (fail closed).
                            None => m.inputs.cordoned == Some(true),
                            Some(Err(_)) => true,
                            Some(Ok(marker)) => {
                                marker.tag == slot.tag
                                    && (marker.phase.holds_slot()
                                        || marker.phase == Phase::Claiming)
                            }
                        },
                    },
                )
                .count();
            if live > 0 {
                *in_use
                    .entry((AppName::from(app), PoolName::from(pool)))
                    .or_default() += live;
            }
        }
    }
    for (m, op) in report.machines.iter().map(|m| &m.seen).zip(ops) {
        let pool = match &op.marker {
            Some(Ok(marker)) => marker.pool_or(&m.pool),
            _ => &m.pool,
        };
        let holds = match (&op.marker, set) {
            (_, None) if m.inputs.metadata_unknown().is_some() => true,
            // A rotation without its slot still has capacity out, unless
            // the machine stopped (autostop): then it serves nothing either
            // way, and its slot was let go so the pool is not starved.
            (Some(Ok(marker)), Some(set)) => {
                marker.phase.holds_slot()
                    && !set.holds(&m.app, pool, &m.machine_id, &marker.tag)
                    && (marker.phase != Phase::Releasing || m.state.is_started())
            }
            (Some(Ok(marker)), None) => marker.phase.holds_slot(),
            (Some(Err(_)), None) => true,
            (Some(Err(_)), Some(_)) => false,
            // Cordoned with no marker: counted above if it holds a slot.
            (None, Some(set)) => {
                m.inputs.cordoned == Some(true)
                    && !set
                        .slots(&m.app, pool)
                        .iter()
                        .any(|s| s.machine_id == m.machine_id)
            }
            (None, None) => m.inputs.cordoned == Some(true),
        };
        if holds {
            *in_use.entry((m.app.clone(), pool.clone())).or_default() += 1;
        }
    }
    in_use
}

/// The phase of a rotation that holds a slot, if the machine has one.
fn rotating(op: &OperatorState) -> Option<Phase> {
    match &op.marker {
        Some(Ok(marker)) if marker.phase.holds_slot() => Some(marker.phase),
        _ => None,
    }
}

/// What a machine that is neither drifted nor unprobeable is doing.
fn resting(m: &ObservedMachine) -> Decision {
    if !m.state.is_started() || m.status == MachineStatus::NotRunning {
        Decision::NotRunning {
            state: m.state.clone(),
        }
    } else {
        Decision::OnTip
    }
}

/// Whether a machine with no rotation in progress qualifies for a claim, and
/// if not, what is decided for it instead.
fn candidate<'a>(
    ctx: &Ctx<'_>,
    m: &'a JudgedMachine,
    alerts: &mut Vec<Alert>,
) -> Result<Candidate<'a>, Decision> {
    let Ctx {
        policy,
        op,
        drift_since,
        fetch,
        now,
        tip,
        ..
    } = *ctx;
    if !(m.seen.status.is_classified() || unprobeable(m.seen.status)) || !m.seen.state.is_started()
    {
        return Err(resting(&m.seen));
    }
    // The tip may be stale: drift measured against it is no evidence to act on.
    if fetch.failing {
        return Err(Decision::TipUncertain {
            fetched_at: fetch.fetched_at,
        });
    }
    if unprobeable(m.seen.status) {
        return unprobeable_candidate(ctx, &m.seen);
    }
    let Some(sev) = m.severity() else {
        // A classified machine always has a severity; nothing to act on without one.
        return Err(resting(&m.seen));
    };
    let min_age = policy.rotation.min_drift_age;
    let Some(since) = drift_since.filter(|t| after(*t, min_age) <= now) else {
        let since = drift_since.unwrap_or(now);
        return Err(Decision::DriftYoung {
            since,
            until: after(since, min_age),
        });
    };
    // A ref the mirror cannot resolve may be newer than our tip: act on it
    // only once a fetch after we first saw it still cannot resolve it.
    if matches!(
        m.seen.status,
        MachineStatus::UnknownRef | MachineStatus::AmbiguousRef
    ) && !matches!((fetch.fetched_at, drift_since), (Some(f), Some(d)) if f > d)
    {
        return Err(Decision::UnconfirmedRef { since: drift_since });
    }
    let action = m.action().unwrap_or(PolicyAction::Observe);
    let report = usable_report(&m.seen);
    let mode = match action {
        PolicyAction::Observe => return Err(Decision::ObserveOnly { severity: sev }),
        PolicyAction::Manual => match op.controls.approval_for(tip) {
            None => {
                alerts.push(machine_alert(
                    AlertKind::ManualApprovalRequired,
                    m,
                    tip,
                    sev,
                    format!(
                        "{} needs an operator: `fleet-reconciler approve {}` (or --when-idle)",
                        m.seen.machine_id, m.seen.machine_id
                    ),
                ));
                return Err(Decision::AwaitingApproval {
                    target: tip.clone(),
                    severity: sev,
                });
            }
            Some(a) if a.mode == ApprovalMode::Now => RotationMode::Now,
            Some(_) => RotationMode::Wait,
        },
        other => automatic_mode(other, report).unwrap_or(RotationMode::Wait),
    };
    // Input newer than the guard keeps a machine out of rotation, unless an
    // operator said "now".
    if mode != RotationMode::Now
        && let Some(until) = report.and_then(|r| recent_input_until(policy, r, now))
    {
        return Err(Decision::RecentInput { until });
    }
    Ok(Candidate {
        severity: sev,
        since,
        m: &m.seen,
        mode,
        action,
        expected: None,
    })
}

/// The mode a policy that acts by itself rotates in (`None`: it does not).
fn automatic_mode(action: PolicyAction, report: Option<&AgentReport>) -> Option<RotationMode> {
    match action {
        PolicyAction::AlertAndWait => Some(RotationMode::Wait),
        PolicyAction::Restart => Some(RotationMode::Grace),
        PolicyAction::Reload if report.is_some_and(|r| r.can(Capability::Reload)) => {
            Some(RotationMode::Reload)
        }
        PolicyAction::Reload => Some(RotationMode::Wait),
        PolicyAction::Observe | PolicyAction::Manual => None,
    }
}

/// A machine without a usable report: a candidate once unprobeable past the
/// ceiling after being seen drifted (it serves nothing we can see). The
/// claim follows the pool's own policy; the restart happens only while the
/// agent still cannot be probed.
fn unprobeable_candidate<'a>(
    ctx: &Ctx<'_>,
    m: &'a ObservedMachine,
) -> Result<Candidate<'a>, Decision> {
    let Ctx {
        policy,
        evidence,
        unprobed_since,
        now,
        ..
    } = *ctx;
    let failing = fly_check_failing(m);
    if failing
        && past_probe_ceiling(policy, &m.pool, evidence, now)
        && let Some(e) = evidence
        && let action = policy.action(&m.pool, e.severity)
        && let Some(mode) = automatic_mode(action, None)
    {
        return Ok(Candidate {
            severity: e.severity,
            since: e.since,
            m,
            mode,
            action,
            expected: None,
        });
    }
    Err(Decision::Unprobeable {
        since: evidence.map(|e| e.since).or(unprobed_since),
        // Fly calls it healthy (or has no checks): no ceiling applies.
        ceiling_at: probe_ceiling_at(policy, &m.pool, evidence).filter(|_| failing),
    })
}

/// When the probe-failure ceiling lets the pool's own policy restart an
/// unprobeable machine: only for evidence of a drift under a policy that acts
/// by itself, then and now.
fn probe_ceiling_at(
    policy: &Policy,
    pool: &PoolName,
    evidence: Option<&Unprobed>,
) -> Option<DateTime<Utc>> {
    evidence
        .filter(|e| automatic(e.action) && automatic(policy.action(pool, e.severity)))
        .map(|e| after(e.since, policy.rotation.probe_failure_ceiling))
}

/// The agent has reported this rotation's checkpoint.
fn checkpointed(report: Option<&AgentReport>, marker: &Marker) -> bool {
    report
        .and_then(|r| r.rotation.as_ref())
        .is_some_and(|r| r.checkpoint.as_deref() == Some(marker.tag.as_str()))
}

/// What a rotation that holds a slot is waiting for, and until when.
fn rotation_decision(ctx: &Ctx<'_>, marker: &Marker) -> Decision {
    let Ctx { policy, m, now, .. } = *ctx;
    let rot = &policy.rotation;
    let report = usable_report(&m.seen);
    let in_rotation = |deadline| Decision::InRotation {
        phase: marker.phase,
        deadline,
        verifying: false,
    };
    match marker.phase {
        Phase::Draining => {
            let since = ctx.on_our_clock(marker.attempt_started_at);
            let mut deadline = after(since, rot.drain_ceiling);
            if marker.drain_requested && !checkpointed(report, marker) {
                deadline = deadline.min(after(since, rot.checkpoint_deadline));
            }
            match report.map(|r| (r, restart_allowed(policy, r, marker, now))) {
                Some((_, Err(NotIdle::LiveWork))) => Decision::LiveWork { since, deadline },
                Some((r, Err(NotIdle::RecentInput))) => match recent_input_until(policy, r, now) {
                    Some(until) => Decision::RecentInput { until },
                    None => in_rotation(Some(deadline)),
                },
                _ => in_rotation(Some(deadline)),
            }
        }
        Phase::Reloading => in_rotation(Some(after(
            ctx.on_our_clock(marker.attempt_started_at),
            rot.verify_deadline,
        ))),
        Phase::Restarting => Decision::InRotation {
            phase: marker.phase,
            deadline: Some(restart_verified_by(
                &m.seen,
                ctx.on_our_clock(marker.restart_at.unwrap_or(marker.attempt_started_at)),
                rot.verify_deadline,
            )),
            verifying: m.seen.state.is_started(),
        },
        Phase::Backoff => in_rotation(marker.retry_at.map(|t| ctx.retry_due(marker, t))),
        // Past it the undo is alerted (`rotation_stuck`) and an unreachable
        // agent's undrain is given up.
        Phase::Releasing => in_rotation(Some(after(
            ctx.on_our_clock(marker.attempt_started_at),
            rot.release_ceiling.get(),
        ))),
        Phase::Claiming | Phase::Yielded => in_rotation(None),
    }
}

/// Keeps the persisted probe-failure record in step with what is seen.
fn unprobed_bookkeeping(
    m: &ObservedMachine,
    op: &OperatorState,
    target: &Target,
    evidence: Option<&Unprobed>,
) -> Option<Step> {
    let step = |kind| Step {
        target: target.clone(),
        expected: op.marker.as_ref().and_then(|r| r.as_ref().ok()).cloned(),
        kind,
    };
    // An unreadable marker is someone else's: touch nothing.
    if matches!(op.marker, Some(Err(_))) {
        return None;
    }
    if unprobeable(m.status) {
        match (evidence, &op.controls.unprobed) {
            (Some(e), None) if automatic(e.action) => {
                Some(step(StepKind::RecordUnprobed { record: e.clone() }))
            }
            _ => None,
        }
    } else if op.controls.unprobed.is_some() {
        Some(step(StepKind::ClearUnprobed))
    } else {
        None
    }
}

fn target_of(m: &ObservedMachine) -> Target {
    Target {
        app: m.app.clone(),
        machine_id: m.machine_id.clone(),
        pool: m.pool.clone(),
        health_url: m.inputs.health_url.clone(),
    }
}

/// The undo step: `releasing` first (so a failed undo is retried), then the ending.
fn release(
    target: &Target,
    marker: &Marker,
    m: &ObservedMachine,
    op: &OperatorState,
    ending: Ending,
    why: ReleaseWhy,
    now: DateTime<Utc>,
) -> Step {
    let mut next = marker.clone();
    if next.phase != Phase::Releasing {
        // A yielded marker is already undone: only its ending is left.
        if next.phase == Phase::Yielded {
            next.cordoned = Some(false);
        }
        next.phase = Phase::Releasing;
        next.ending = Some(ending);
        // `rotation.release_ceiling` counts from here.
        next.attempt_started_at = now;
    }
    // A fence needs lifting only while the agent that was asked still runs
    // and does not report itself unfenced.
    let proven_unfenced = !m.state.is_started()
        || usable_report(m).is_some_and(|r| r.rotation.as_ref().is_none_or(|rot| !rot.fenced));
    let ending = next.ending.unwrap_or(ending);
    // An approval authorizes one rotation: the one that used it consumes it
    // once it has restarted, whatever its ending — listed as spent on the
    // coordinator even when another approval has replaced it on the machine
    // since (written back by an agent, it must approve nothing), and
    // deleted only if it is still the approval there (a newer one stays;
    // the executor checks which it is). Without one (automatic rotations,
    // markers of older versions) a finished rotation spends the approval of
    // its commit.
    let clear_approval = match &marker.approval {
        Some(_) => marker.restart_at.is_some() || ending == Ending::Finished,
        None => ending == Ending::Finished && op.controls.has_approval_key(),
    };
    Step {
        target: target.clone(),
        expected: Some(marker.clone()),
        kind: StepKind::Release {
            undrain: if marker.drain_requested && marker.phase != Phase::Yielded && !proven_unfenced
            {
                Undrain::Needed
            } else {
                Undrain::NotNeeded
            },
            clear_approval,
            marker: next,
            why,
        },
    }
}

/// What `advance` reads about one machine.
struct Ctx<'a> {
    policy: &'a Policy,
    m: &'a JudgedMachine,
    op: &'a OperatorState<'a>,
    target: &'a Target,
    /// The pool the rotation's slot is in (the marker's), else the machine's.
    pool: &'a PoolName,
    /// The shared probe-failure record, on this replica's clock.
    evidence: Option<&'a Unprobed>,
    /// When this run first saw the machine's marker as it is now.
    marker_seen: Option<MarkerSeen>,
    /// When this run first saw the machine's current drift.
    drift_since: Option<DateTime<Utc>>,
    /// When this run first saw it without a usable report.
    unprobed_since: Option<DateTime<Utc>>,
    fetch: FetchState,
    now: DateTime<Utc>,
    tip: &'a CommitId,
}

impl Ctx<'_> {
    /// `t`, a time the machine's marker states (its writer's clock), on
    /// this replica's clock: the later of `t` and this run's first sight of
    /// the marker as it is now, or `now` if this run has not seen it (a
    /// daemon restart delays, never hastens). Every comparison of a marker
    /// time with `now` goes through here.
    fn on_our_clock(&self, t: DateTime<Utc>) -> DateTime<Utc> {
        t.max(self.marker_seen.map_or(self.now, |s| s.at))
    }

    /// When `restart_grace` began: the later of the attempt's start and this
    /// run's first sight of the marker while Fly said cordoned (the grace
    /// counts from the cordon, not from the intent); `None` until then.
    fn grace_since(&self, marker: &Marker) -> Option<DateTime<Utc>> {
        let cordoned = self.marker_seen?.cordoned_at?;
        Some(self.on_our_clock(marker.attempt_started_at).max(cordoned))
    }

    /// When a marker's `retry_at` falls due on this replica's clock: the
    /// wait its writer meant (from the attempt's start to `retry_at`, at most
    /// `rotation.retry_after`, the longest any of ours is) counted from
    /// [`Ctx::on_our_clock`], and never before `retry_at` itself.
    fn retry_due(&self, marker: &Marker, retry_at: DateTime<Utc>) -> DateTime<Utc> {
        let wait = retry_at
            .signed_duration_since(marker.attempt_started_at)
            .to_std()
            .unwrap_or_default()
            .min(self.policy.rotation.retry_after);
        retry_at.max(after(self.on_our_clock(marker.attempt_started_at), wait))
    }
}

/// The next step of a rotation that holds a slot, if any: the undo of one
/// being released; else the end of one that is done or may not go on
/// ([`Rotation::ended`]); else its phase's own step.
fn advance(ctx: &Ctx<'_>, marker: &Marker, alerts: &mut Vec<Alert>) -> Option<Step> {
    if marker.phase == Phase::Releasing {
        return Some(releasing(ctx, marker, alerts));
    }
    let r = Rotation::new(ctx, marker);
    if let Some(step) = r.ended(alerts) {
        return Some(step);
    }
    match marker.phase {
        Phase::Draining | Phase::Backoff | Phase::Reloading
            if ctx.m.seen.state.is_settled_down() =>
        {
            Some(r.release(Ending::Cancelled, ReleaseWhy::LeftStarted))
        }
        Phase::Draining => r.draining(alerts),
        Phase::Reloading => r.reloading(),
        Phase::Restarting => r.restarting(alerts),
        Phase::Backoff => r.backoff(alerts),
        Phase::Claiming | Phase::Yielded | Phase::Releasing => None,
    }
}

/// One rotation that holds a slot, and what every phase reads of it.
struct Rotation<'c, 'a> {
    ctx: &'c Ctx<'a>,
    marker: &'c Marker,
    report: Option<&'a AgentReport>,
    /// When the last restart was made (or the attempt began).
    restarted_at: DateTime<Utc>,
    /// Exit events since that restart, within the verify window.
    exits: usize,
    crash_loop: bool,
    /// The agent reports the rotation's target (or the tip).
    reports_target: bool,
    /// The approval of an operator started it.
    manual: bool,
    /// A commit the mirror lacks while the mirror is stale proves nothing
    /// (it may be newer than our tip): no restart, cordon or drain on it;
    /// an undo still goes.
    unproven: bool,
    /// The rotation keeps its cordon; a restart or an update may drop it.
    cordon_lost: bool,
}

impl<'c, 'a> Rotation<'c, 'a> {
    fn new(ctx: &'c Ctx<'a>, marker: &'c Marker) -> Rotation<'c, 'a> {
        let m = ctx.m;
        let restarted_at = marker.restart_at.unwrap_or(marker.attempt_started_at);
        let verified_by =
            restart_verified_by(&m.seen, restarted_at, ctx.policy.rotation.verify_deadline);
        let exits = exits_since(&m.seen, restarted_at, verified_by);
        let reports_target = m.seen.status == MachineStatus::OnTip
            || (m.seen.status == MachineStatus::Drifted
                && m.seen.commit.as_ref() == Some(&marker.target));
        let unproven = ctx.fetch.failing
            && matches!(
                m.seen.status,
                MachineStatus::UnknownRef | MachineStatus::AmbiguousRef
            );
        Rotation {
            ctx,
            marker,
            report: usable_report(&m.seen),
            restarted_at,
            exits,
            crash_loop: marker.phase == Phase::Restarting && exits >= CRASH_LOOP_EXITS,
            reports_target,
            manual: marker.action == PolicyAction::Manual,
            unproven,
            cordon_lost: !unproven
                && m.seen.state.is_started()
                && marker.may_have_cordoned()
                && m.seen.inputs.cordoned == Some(false),
        }
    }

    fn step(&self, kind: StepKind) -> Step {
        Step {
            target: self.ctx.target.clone(),
            expected: Some(self.marker.clone()),
            kind,
        }
    }

    fn release(&self, ending: Ending, why: ReleaseWhy) -> Step {
        let ctx = self.ctx;
        release(
            ctx.target,
            self.marker,
            &ctx.m.seen,
            ctx.op,
            ending,
            why,
            ctx.now,
        )
    }

    fn restart(&self, why: RestartWhy, guard: RestartGuard) -> Step {
        self.step(StepKind::Restart {
            marker: restarting(self.ctx, self.marker),
            guard,
            why,
        })
    }

    /// Ceilings never kill work: the rotation yields and retries later.
    fn yield_(&self, why: ReleaseWhy) -> Step {
        let mut s = self.release(Ending::Yielded, why);
        if let StepKind::Release { marker: r, .. } = &mut s.kind {
            r.retry_at = Some(after(self.ctx.now, self.ctx.policy.rotation.retry_after));
        }
        s
    }

    fn recordon(&self, why: AdvanceWhy) -> Step {
        self.step(StepKind::Advance {
            marker: self.marker.clone(),
            cordon: true,
            why,
        })
    }

    /// Whatever the phase: a machine on the target is done; one updated
    /// from outside is undone; a manual rotation whose approval is revoked
    /// or overtaken stops before anything else is done.
    fn ended(&self, alerts: &mut Vec<Alert>) -> Option<Step> {
        let Ctx { m, op, tip, .. } = *self.ctx;
        let marker = self.marker;
        // Maybe someone else restarted it, or the tip came to it. After our
        // restart, the agent's word counts only once Fly agrees: started,
        // every check its config defines passing with a result written
        // after the restart, not crash-looping (as flyctl waits after a
        // restart for fresh results: an empty or older list is not passing).
        // Clocks: `updated_at` is Fly's, the restart time ours, taken when
        // the restart was planned, before it was sent. They are compared
        // as they are, with no allowance: a Fly clock behind ours only
        // makes fresh results look old (verification waits, at worst until
        // the deadline fails the attempt); one ahead of ours by more than
        // the time from plan to boot could pass a result from before the
        // restart, a risk accepted because the agent must also report the
        // target, which it loads only by booting.
        let checks_fresh = match m.seen.inputs.fly_checks() {
            FlyChecks::NoneDefined => true,
            FlyChecks::NotAllPassing => false,
            FlyChecks::AllPassingSince(oldest) => oldest > self.restarted_at.timestamp_millis(),
        };
        let fly_healthy = m.seen.state.is_started()
            && m.seen
                .inputs
                .checks()
                .iter()
                .all(crate::fly::MachineCheck::passing)
            && checks_fresh
            && !self.crash_loop;
        if self.reports_target && (marker.phase != Phase::Restarting || fly_healthy) {
            alerts.extend(loaded_past_its_target(self.ctx, marker));
            return Some(self.release(Ending::Finished, ReleaseWhy::OnTarget));
        }
        // Updated from outside (`fly deploy`, `fly machine update`): the plan
        // this marker describes is stale (its cordon, fence and checkpoint
        // may be gone), so it is undone, never continued; the next sweep
        // judges afresh.
        if updated_from_outside(&m.seen, marker)
            && let Some(ours) = marker.instance_id.as_deref()
        {
            alerts.push(machine_alert(
                AlertKind::RotationStuck,
                m,
                tip,
                marker.severity.max(Severity::High),
                format!(
                    "{} was updated from outside mid-rotation (instance {ours} is now {}); the rotation is undone, not continued",
                    m.seen.machine_id, m.seen.inputs.instance_id
                ),
            ));
            return Some(self.release(Ending::Cancelled, ReleaseWhy::UpdatedFromOutside));
        }
        // An approval binds one rotation to one commit.
        if self.manual && marker.phase != Phase::Restarting {
            if op.controls.approval_for(&marker.target).is_none() {
                return Some(self.release(Ending::Cancelled, ReleaseWhy::ApprovalRevoked));
            }
            // And one approval to one rotation: the executor acts only under
            // the approval the marker names (a consumed one written back by
            // an agent must not pass). An operator's new approval (another
            // mode, or the same again) replaces it: the rotation is undone
            // like a revoke, and the next sweep claims afresh under the new
            // one, in its mode.
            if marker
                .approval
                .as_ref()
                .is_some_and(|id| op.controls.approval_id() != Some(id))
            {
                return Some(self.release(Ending::Cancelled, ReleaseWhy::ApprovalRevoked));
            }
            if marker.target != *tip {
                return Some(self.release(Ending::Cancelled, ReleaseWhy::TipMovedPastApproval));
            }
        }
        // A rotation keeps no authority it was claimed with: once the current
        // policy gives the current drift another action (the tip moved to a
        // more severe commit, the pool's policy changed), it stops before any
        // further restart and the next sweep claims it under that action.
        // The restart already sent is verified first (a failed verify goes
        // to `backoff`, judged here again).
        if marker.phase != Phase::Restarting && self.current_action() != marker.action {
            return Some(self.release(Ending::Cancelled, ReleaseWhy::AuthorityChanged));
        }
        None
    }

    /// The machine's drift now: the verdict's severity, else (no usable
    /// report) the marker's.
    fn current_severity(&self) -> Severity {
        self.ctx.m.severity().unwrap_or(self.marker.severity)
    }

    /// What the current policy of the rotation's pool says about the current drift.
    fn current_action(&self) -> PolicyAction {
        self.ctx
            .policy
            .action(self.ctx.pool, self.current_severity())
    }

    /// The end of a rotation that has used up `rotation.max_attempts`
    /// restarts (counted per machine and target, across yields), if it has.
    fn out_of_attempts(&self, alerts: &mut Vec<Alert>) -> Option<Step> {
        let marker = self.marker;
        (marker.attempt >= self.ctx.policy.rotation.max_attempts.get()).then(|| {
            let evidence = "rotation.max_attempts reached".to_string();
            end_attempt(self.ctx, marker, marker.attempt, evidence, alerts)
        })
    }

    /// Draining: a restart once the policy or the agent allows it, else a
    /// yield at a ceiling, else the drain asked again if it never arrived.
    fn draining(&self, alerts: &mut Vec<Alert>) -> Option<Step> {
        let Ctx { policy, now, .. } = *self.ctx;
        let (marker, report) = (self.marker, self.report);
        let rot = &policy.rotation;
        let since = self.ctx.on_our_clock(marker.attempt_started_at);
        if !self.unproven
            && let Some(step) = self.restart_when_allowed()
        {
            // Judged before every restart: the count is carried across
            // yields, so a retry may have none left.
            return Some(self.out_of_attempts(alerts).unwrap_or(step));
        }
        if after(since, rot.drain_ceiling) <= now {
            return Some(self.yield_(ReleaseWhy::DrainCeiling));
        }
        if marker.drain_requested
            && !checkpointed(report, marker)
            && after(since, rot.checkpoint_deadline) <= now
        {
            return Some(self.yield_(ReleaseWhy::CheckpointDeadline));
        }
        // A drain the agent never got (its POST failed) is asked again.
        let fenced = report
            .and_then(|r| r.rotation.as_ref())
            .is_some_and(|r| r.fenced);
        (marker.drain_requested && report.is_some() && !fenced && !self.unproven)
            .then(|| self.step(StepKind::Drain))
    }

    /// The restart a draining rotation may make now, if any.
    fn restart_when_allowed(&self) -> Option<Step> {
        let Ctx {
            policy,
            m,
            op,
            pool,
            evidence,
            now,
            ..
        } = *self.ctx;
        let marker = self.marker;
        if unprobeable(m.seen.status)
            && automatic(marker.action)
            && fly_check_failing(&m.seen)
            && past_probe_ceiling(policy, pool, evidence, now)
        {
            return Some(self.restart(
                RestartWhy::UnprobeablePastCeiling,
                RestartGuard::Unprobeable,
            ));
        }
        // Interrupting live work needs the policy to say so now, not only
        // the marker: an operator's standing "now" approval of this commit,
        // or a pool whose policy is still `restart`.
        let approved_now = self.manual
            && op
                .controls
                .approval_for(&marker.target)
                .is_some_and(|a| a.mode == ApprovalMode::Now);
        let pool_restarts = marker.action == PolicyAction::Restart
            && self.current_action() == PolicyAction::Restart;
        match marker.mode {
            RotationMode::Now if approved_now => {
                return Some(self.restart(RestartWhy::ApprovedNow, RestartGuard::MayInterrupt));
            }
            RotationMode::Grace
                if pool_restarts
                    && self
                        .ctx
                        .grace_since(marker)
                        .is_some_and(|t| after(t, policy.rotation.restart_grace) <= now) =>
            {
                return Some(self.restart(RestartWhy::GraceElapsed, RestartGuard::MayInterrupt));
            }
            _ => {}
        }
        self.report
            .is_some_and(|r| restart_allowed(policy, r, marker, now).is_ok())
            .then(|| self.restart(RestartWhy::NoLiveWork, RestartGuard::Idle))
    }

    /// Reloading: not proven by a report of the target within the verify
    /// deadline, it falls back to alert-and-wait.
    fn reloading(&self) -> Option<Step> {
        let Ctx { policy, now, .. } = *self.ctx;
        let marker = self.marker;
        if after(
            self.ctx.on_our_clock(marker.attempt_started_at),
            policy.rotation.verify_deadline,
        ) > now
            || self.unproven
        {
            return None;
        }
        let mut next = marker.clone();
        next.phase = Phase::Draining;
        next.mode = RotationMode::Wait;
        next.attempt_started_at = now;
        next.drain_requested =
            marker.drain_requested || self.report.is_some_and(|r| r.can(Capability::Drain));
        next.cordoned = Some(true);
        Some(self.step(StepKind::Advance {
            marker: next,
            cordon: true,
            why: AdvanceWhy::ReloadNotProven,
        }))
    }

    /// Restarting: verified by `ended`, else a failed attempt once it crash
    /// loops or the verify deadline passes; meanwhile its cordon is kept.
    fn restarting(&self, alerts: &mut Vec<Alert>) -> Option<Step> {
        let Ctx { policy, m, now, .. } = *self.ctx;
        let marker = self.marker;
        let rot = &policy.rotation;
        if self.crash_loop {
            let evidence = format!(
                "{}: {} exit events since the restart",
                crate::decide::halt::CRASH_LOOP_EVIDENCE,
                self.exits
            );
            let attempts = marker.attempt.saturating_add(1);
            return Some(end_attempt(self.ctx, marker, attempts, evidence, alerts));
        }
        if restart_verified_by(
            &m.seen,
            self.ctx.on_our_clock(self.restarted_at),
            rot.verify_deadline,
        ) > now
        {
            return self
                .cordon_lost
                .then(|| self.recordon(AdvanceWhy::CordonLostAtRestart));
        }
        if self.unproven {
            return None;
        }
        if m.seen.state.is_settled_down() {
            return Some(self.release(Ending::Cancelled, ReleaseWhy::DidNotComeBack));
        }
        let evidence = if self.reports_target {
            "reports the target, but Fly's checks are not all passing".to_string()
        } else {
            format!(
                "{} within {} of its restart",
                match &m.seen.reported_ref {
                    Some(r) => format!("reports {}", crate::model::short_commit(r)),
                    None => format!("gave no usable report ({})", m.seen.status),
                },
                humantime::format_duration(rot.verify_deadline)
            )
        };
        let attempts = marker.attempt.saturating_add(1);
        Some(end_attempt(self.ctx, marker, attempts, evidence, alerts))
    }

    /// Backoff: kept cordoned and alerted until its retry falls due, then
    /// drained again (or ended as failed past `rotation.max_attempts`); a
    /// backoff that cannot move on for `verify_deadline` after that yields.
    fn backoff(&self, alerts: &mut Vec<Alert>) -> Option<Step> {
        let Ctx {
            policy,
            m,
            now,
            tip,
            ..
        } = *self.ctx;
        let marker = self.marker;
        let rot = &policy.rotation;
        // Due and still not moved on (the coordinator unreadable, every step
        // declined): it yields rather than stay cordoned.
        let due = match marker.retry_at {
            Some(t) => self.ctx.retry_due(marker, t),
            None => self.ctx.on_our_clock(marker.attempt_started_at),
        };
        if after(due, rot.verify_deadline) <= now {
            return Some(self.yield_(ReleaseWhy::BackoffStuck));
        }
        if due <= now
            && let Some(failed) = self.out_of_attempts(alerts)
        {
            return Some(failed);
        }
        alerts.push(machine_alert(
            AlertKind::RotationStuck,
            m,
            tip,
            marker.severity.max(Severity::High),
            format!(
                "{} failed verification {} time(s) of at most {}; kept cordoned",
                m.seen.machine_id,
                marker.attempt,
                rot.max_attempts.get()
            ),
        ));
        if due <= now && !self.unproven {
            let mut next = marker.clone();
            next.phase = Phase::Draining;
            next.attempt_started_at = now;
            next.retry_at = None;
            if !self.manual {
                next.target = tip.clone();
            }
            next.cordoned = Some(true);
            return Some(self.step(StepKind::Advance {
                marker: next,
                cordon: true,
                why: AdvanceWhy::BackoffElapsed,
            }));
        }
        self.cordon_lost
            .then(|| self.recordon(AdvanceWhy::CordonLostInBackoff))
    }
}

/// The marker a restart writes: phase `restarting`, its clock and, for
/// automatic rotations, the current tip. Its `instance_id` is the claim's
/// until the executor records the one it reads under the lease (a restart
/// keeps it).
fn restarting(ctx: &Ctx<'_>, marker: &Marker) -> Marker {
    let mut next = marker.clone();
    next.phase = Phase::Restarting;
    next.ending = None;
    next.retry_at = None;
    next.restart_at = Some(ctx.now);
    next.attempt_started_at = ctx.now;
    // Automatic rotations follow the tip; an approved one keeps its commit.
    if marker.action != PolicyAction::Manual {
        next.target = ctx.tip.clone();
    }
    next
}

/// A restart planned on one tip that came back on a newer one (the tip
/// moved between the sweep and the restart: an agent loads the release tip
/// when it boots). No plan judged that commit for this machine, and the
/// executor cannot see a tip move within its step, so the verify says so
/// where the pool might not have allowed the restart: a manual rotation
/// with no approval of the loaded commit, or an automatic one whose pool
/// gives a more severe drift another action (the loaded commit's severity
/// is unknown here, at least the marker's). `None` when it loaded its target.
fn loaded_past_its_target(ctx: &Ctx<'_>, marker: &Marker) -> Option<Alert> {
    let Ctx {
        policy,
        m,
        op,
        pool,
        tip,
        ..
    } = *ctx;
    if marker.phase != Phase::Restarting
        || m.seen.status != MachineStatus::OnTip
        || marker.target == *tip
    {
        return None;
    }
    let why = if marker.action == PolicyAction::Manual {
        if op.controls.approval_for(tip).is_some() {
            return None;
        }
        format!(
            "no approval of {} (the rotation's approval was of {})",
            crate::model::short_commit(tip.as_str()),
            crate::model::short_commit(marker.target.as_str())
        )
    } else {
        let (severity, action) = Severity::ALL
            .into_iter()
            .filter(|s| *s >= marker.severity)
            .map(|s| (s, policy.action(pool, s)))
            .find(|(_, a)| *a != marker.action)?;
        format!(
            "its pool leaves {severity} drift to {action}, and the loaded commit's severity was never judged for it (the restart was judged on {} drift, {})",
            marker.severity, marker.action
        )
    };
    Some(machine_alert(
        AlertKind::RotationStuck,
        m,
        tip,
        marker.severity.max(Severity::High),
        format!(
            "{} came back on {}, not on {} its restart was planned for (the release tip moved within the step): {why}",
            m.seen.machine_id,
            crate::model::short_commit(tip.as_str()),
            crate::model::short_commit(marker.target.as_str())
        ),
    ))
}

/// Whether the machine's instance differs from the one the marker recorded:
/// `fly deploy` / `fly machine update` replaced it (a restart keeps it).
fn updated_from_outside(m: &ObservedMachine, marker: &Marker) -> bool {
    marker
        .instance_id
        .as_deref()
        .is_some_and(|ours| !m.inputs.instance_id.is_empty() && ours != m.inputs.instance_id)
}

/// When a restart made at `restarted_at` must have verified: Fly waits up
/// to the machine's stop timeout (`stop_config.timeout`, at most 300 s)
/// for it to stop before it boots, then `verify` covers boot and checks.
/// The one place the restarting deadline is computed.
fn restart_verified_by(
    m: &ObservedMachine,
    restarted_at: DateTime<Utc>,
    verify: Duration,
) -> DateTime<Utc> {
    let stop = Duration::from_secs(u64::from(m.inputs.stop_timeout_secs));
    after(after(restarted_at, stop), verify)
}

/// Crashes from `since` to `until` (a crash loop's evidence): as flyctl's
/// `isConstantlyRestarting` counts them, exits Fly restarted, with a
/// non-zero code, not requested (our own restart's exit is requested). An
/// exit Fly gave no details of is not counted (the verify deadline still
/// ends an attempt that does not come back).
fn exits_since(m: &ObservedMachine, since: DateTime<Utc>, until: DateTime<Utc>) -> usize {
    let (from, to) = (since.timestamp_millis(), until.timestamp_millis());
    m.inputs
        .events()
        .iter()
        .filter(|e| e.kind == crate::fly::MachineEvent::EXIT && (from..=to).contains(&e.timestamp))
        .filter(|e| {
            e.exit
                .is_some_and(|x| x.restarting && !x.requested_stop && x.exit_code != 0)
        })
        .count()
}

/// A restart that did not verify (`attempts` restarts so far): back off and
/// retry, kept cordoned, or past `rotation.max_attempts` end as failed:
/// undone (uncordon, undrain), slot released, the failure kept on the
/// `yielded` marker so no new attempt starts for its target until the tip
/// moves or an operator approves again.
fn end_attempt(
    ctx: &Ctx<'_>,
    marker: &Marker,
    attempts: u32,
    evidence: String,
    alerts: &mut Vec<Alert>,
) -> Step {
    let Ctx {
        policy,
        m,
        op,
        target,
        now,
        tip,
        ..
    } = *ctx;
    let rot = &policy.rotation;
    // `bounded` may add an ellipsis: one char of room keeps the marker parseable.
    let evidence = crate::text::bounded(&evidence, crate::text::MAX_DETAIL_CHARS - 1);
    let severity = marker.severity.max(Severity::High);
    if attempts >= rot.max_attempts.get() {
        let mut alert = machine_alert(
            AlertKind::RotationFailed,
            m,
            tip,
            severity,
            format!(
                "the rotation of {id} to {} failed after {attempts} restart(s) ({evidence}); uncordoned and its slot released; no new attempt until the tip moves or `fleet-reconciler approve {id}`",
                crate::model::short_commit(marker.target.as_str()),
                id = m.seen.machine_id,
            ),
        );
        alert
            .details
            .insert("attempts".to_string(), attempts.to_string());
        alert
            .details
            .insert("evidence".to_string(), evidence.clone());
        alert
            .details
            .insert("target".to_string(), marker.target.to_string());
        alerts.push(alert);
        let mut s = release(
            target,
            marker,
            &m.seen,
            op,
            Ending::Yielded,
            ReleaseWhy::MaxAttempts,
            now,
        );
        if let StepKind::Release { marker: r, .. } = &mut s.kind {
            r.retry_at = None;
            r.failed = Some(Failure {
                at: now,
                attempts,
                evidence,
                approval: op.controls.approval_id().cloned(),
            });
        }
        return s;
    }
    // Still not on the target: stay cordoned, alert, retry with backoff.
    let mut next = marker.clone();
    next.phase = Phase::Backoff;
    next.attempt = attempts;
    next.retry_at = Some(after(now, verify_backoff(policy, marker.attempt)));
    alerts.push(machine_alert(
        AlertKind::RotationStuck,
        m,
        tip,
        severity,
        format!(
            "{} did not verify after restart {attempts} of at most {} ({evidence}); kept cordoned",
            m.seen.machine_id,
            rot.max_attempts.get()
        ),
    ));
    Step {
        target: target.clone(),
        expected: Some(marker.clone()),
        kind: StepKind::Advance {
            marker: next,
            cordon: false,
            why: AdvanceWhy::VerifyFailed,
        },
    }
}

/// An unfinished undo, retried every sweep. Past `rotation.release_ceiling`
/// an undrain that cannot be delivered stops holding the pool: an agent
/// unprobeable past the probe-failure ceiling under an automatic policy is
/// restarted (which clears its fence); any other unreachable agent's undrain
/// is given up, with an alert naming the machine. The uncordon is never
/// given up. An agent that answers and still reports its fence keeps the
/// slot (its capacity is out) and is alerted.
fn releasing(ctx: &Ctx<'_>, marker: &Marker, alerts: &mut Vec<Alert>) -> Step {
    let Ctx {
        policy,
        m,
        op,
        target,
        pool,
        evidence,
        now,
        tip,
        ..
    } = *ctx;
    let rot = &policy.rotation;
    let mut step = release(
        target,
        marker,
        &m.seen,
        op,
        Ending::Cancelled,
        ReleaseWhy::UndoUnfinished,
        now,
    );
    let undrain = matches!(
        step.kind,
        StepKind::Release {
            undrain: Undrain::Needed,
            ..
        }
    );
    if undrain && updated_from_outside(&m.seen, marker) {
        // The update restarted the agent, which lifted its fence: only the
        // uncordon is left (and no restart of ours follows a stale plan).
        if let StepKind::Release { undrain, .. } = &mut step.kind {
            *undrain = Undrain::GivenUp;
        }
        return step;
    }
    if !undrain
        || after(
            ctx.on_our_clock(marker.attempt_started_at),
            rot.release_ceiling.get(),
        ) > now
    {
        return step;
    }
    let ceiling = humantime::format_duration(rot.release_ceiling.get());
    let severity = marker.severity.max(Severity::High);
    if usable_report(&m.seen).is_some() {
        alerts.push(machine_alert(
            AlertKind::RotationStuck,
            m,
            tip,
            severity,
            format!(
                "{} still reports itself fenced {ceiling} after its undo began; the undrain is retried and its slot stays taken",
                m.seen.machine_id
            ),
        ));
        return step;
    }
    if automatic(marker.action)
        && fly_check_failing(&m.seen)
        && past_probe_ceiling(policy, pool, evidence, now)
    {
        return Step {
            target: target.clone(),
            expected: Some(marker.clone()),
            kind: StepKind::Restart {
                marker: restarting(ctx, marker),
                guard: RestartGuard::Unprobeable,
                why: RestartWhy::FencedAndUnprobeable,
            },
        };
    }
    alerts.push(machine_alert(
        AlertKind::RotationStuck,
        m,
        tip,
        severity,
        format!(
            "{} gave no usable report for {ceiling} of its undo: its undrain is given up (the agent may still be fenced), it is uncordoned and its slot released",
            m.seen.machine_id
        ),
    ));
    // Given up in the step itself, so the executor's late-drain rule does
    // not ask it again.
    if let StepKind::Release { undrain, .. } = &mut step.kind {
        *undrain = Undrain::GivenUp;
    }
    step
}

fn drift_summary(m: &ObservedMachine) -> String {
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
    m: &JudgedMachine,
    tip: &CommitId,
    severity: Severity,
    summary: String,
) -> Alert {
    let mut details = BTreeMap::new();
    details.insert("status".to_string(), m.seen.status.to_string());
    details.insert("pool".to_string(), m.seen.pool.to_string());
    details.insert("region".to_string(), m.seen.region.to_string());
    if let Some(n) = m.seen.commits_behind {
        details.insert("commits_behind".to_string(), n.to_string());
    }
    if let Some(r) = &m.seen.reported_ref {
        details.insert("reported_ref".to_string(), r.to_string());
    }
    if let Some(a) = m.action() {
        details.insert("action".to_string(), a.to_string());
    }
    // The rule that decided the severity, for the payload (a stable text per rule).
    if let Some(r) = m.reason() {
        details.insert("severity_rule".to_string(), r.rule.to_string());
    }
    Alert {
        kind,
        app: Some(m.seen.app.clone()),
        machine_id: Some(m.seen.machine_id.clone()),
        commit: Some(tip.clone()),
        severity,
        summary,
        details,
    }
}

#[cfg(test)]
#[path = "planner_tests.rs"]
mod tests;

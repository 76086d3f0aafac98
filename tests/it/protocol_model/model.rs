//! The stateright `Model`: replica actions (sweep and plan; the next call
//! of the step in progress, with Fly's possible answers), environment
//! actions (switchable per scenario), and the invariants of docs/safety.md
//! evaluated on the abstract state.

use fleet_reconciler::decide::planner::restart_allowed;
use fleet_reconciler::metadata::marker::{Marker, Phase};
use fleet_reconciler::metadata::operator::{Approval, ApprovalId, ApprovalMode, Hold};
use fleet_reconciler::metadata::slots::Slot;
use fleet_reconciler::metadata::unprobed::Unprobed;
use fleet_reconciler::metadata::{APPROVE_KEY, HOLD_KEY, MARKER_KEY, UNPROBED_KEY};
use fleet_reconciler::model::PolicyAction;
use stateright::{Model, Property};

use super::sweep::{commit, commit_index, reclaim_stale, report, sweep_and_plan};
use super::world::{
    APP, CORDON_WAIT_BOUND, Cond, Conf, Exec, Guard, HoldMarker, Known, LastCall, Machine,
    MarkerWrite, Mem, Need, Op, POOL, PROBE_CEILING, RESTART_GRACE, Record, Refused, Replica,
    World, at, machine_id,
};

/// What the world may do besides the replicas, per scenario.
#[derive(Clone, Copy, Debug, Default)]
pub struct Env {
    pub hold: bool,
    pub approve_now: bool,
    pub approve_when_idle: bool,
    pub revoke: bool,
    pub busy_toggle: bool,
    pub tip_moves: bool,
    pub outside_update: bool,
    pub host_outage: bool,
    /// A replica restarts with this configuration.
    pub replica_restart: Option<Conf>,
    /// Mutating calls may take effect and lose their answer.
    pub lost_answers: bool,
    /// Calls may be refused with 429 (no effect).
    pub rate_limits: bool,
    /// A restarted agent comes back on the commit it ran (its image pins
    /// it): the verify fails, and the rotation backs off and tries again.
    pub stuck_agents: bool,
    /// `undo_raced`'s uncordon (a cordon that landed on another instance)
    /// may be refused: the read is answered, the undo has no effect.
    pub failing_undo: bool,
    /// The agents advertise `drain`, and an agent may stop answering
    /// (its probes and drain calls fail; Fly still reaches the machine).
    pub agent_outage: bool,
    /// A replica is cut off from the private network (its probes fail;
    /// Fly's API still answers it).
    pub cut_off: bool,
    /// Machines define a Fly health check, which may flap.
    pub check_flaps: bool,
    /// A restart may be answered 408 after Fly carried it out (#32 item
    /// 13a). Only the restart: an idempotent write retried after a 408
    /// ends as `Ok` or `Lost`, which `lost_answers` explores.
    pub timeouts_408: bool,
    /// A step's lease may lapse at Fly (its refresh processed late); any
    /// replica may then take it (#32 item 13f).
    pub lease_lapse: bool,
    /// A restarted agent may crash once on its own (Fly restarts it;
    /// #32 item 13c).
    pub crash_once: bool,
    /// The replicas' Fly token, a bare macaroon (`fm2_…`); `None`: a
    /// token Fly takes under any scheme. Fly refuses (401) a call whose
    /// `Authorization`, as `fly::auth_header` builds it, is not `FlyV1 `
    /// and the token (#32 item 13i).
    pub bare_macaroon: Option<&'static str>,
    /// Fly answers 429 to a List of the app past its documented limit
    /// (1/s, burst 3, per app), and each replica lists through its
    /// client's limiter (`fly::list_turn`): a sweep waits for its turn
    /// (#32 item 13g).
    pub list_limit: bool,
}

/// One bounded model: a world to start from and what may happen to it.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    /// Each machine's agent: busy at the start.
    pub busy: Vec<bool>,
    pub confs: Vec<Conf>,
    /// Each replica's clock minus true time, seconds.
    pub skews: Vec<i64>,
    pub env: Env,
    pub ticks: &'static [i64],
    pub horizon: i64,
    /// Environment events (not ticks) at most.
    pub budget: u8,
    /// Check only this property (the search for a shortest counterexample).
    pub only: Option<&'static str>,
    /// The tip at the start (the machines run commit 0).
    pub tip: u8,
    /// Whether the replicas' steps interleave call by call; otherwise a
    /// replica sweeps or calls only while no other is inside a step (the
    /// environment still acts between any two calls).
    pub interleave: bool,
    /// Whether the bounded run of `cargo test` must reach a restart (the
    /// coverage property); see each scenario that says no.
    pub covers_restart: bool,
    /// Where the world starts, if not at rest (`starts`: mid-protocol, so
    /// the part a fix guards lies within the bound).
    pub start: Option<fn(&mut World)>,
    /// The bounded depth and state count of `cargo test` when they differ
    /// from the default (a scenario with little branching that needs two
    /// restarts).
    pub depth: Option<(usize, usize)>,
}

impl Scenario {
    /// A scenario named `name`: one machine per entry of `busy` (whether
    /// its agent starts busy), one replica per entry of `confs`, at rest on
    /// commit 0 with the tip one ahead, clocks true, nothing else
    /// happening, no ticks, replicas' steps not interleaved, checking every
    /// property; its bounded run must reach a restart. The methods below
    /// change one of these each.
    pub fn new(name: &'static str, busy: &[bool], confs: &[Conf]) -> Scenario {
        Scenario {
            name,
            busy: busy.to_vec(),
            confs: confs.to_vec(),
            skews: vec![0; confs.len()],
            env: Env::default(),
            ticks: &[],
            horizon: 0,
            budget: 0,
            only: None,
            tip: 1,
            interleave: false,
            covers_restart: true,
            start: None,
            depth: None,
        }
    }

    /// Each replica's clock minus true time, seconds.
    pub fn skews(mut self, skews: &[i64]) -> Scenario {
        self.skews = skews.to_vec();
        self
    }

    /// What the environment may do.
    pub fn env(mut self, env: Env) -> Scenario {
        self.env = env;
        self
    }

    /// The clock steps time may take, up to `horizon` seconds in all.
    pub fn ticks(mut self, ticks: &'static [i64], horizon: i64) -> Scenario {
        self.ticks = ticks;
        self.horizon = horizon;
        self
    }

    /// Environment events (not ticks) at most.
    pub fn budget(mut self, budget: u8) -> Scenario {
        self.budget = budget;
        self
    }

    /// The tip at the start.
    pub fn tip(mut self, tip: u8) -> Scenario {
        self.tip = tip;
        self
    }

    /// The replicas' steps interleave call by call.
    pub fn interleaved(mut self) -> Scenario {
        self.interleave = true;
        self
    }

    /// The bounded run need not reach a restart (the scenario says why).
    pub fn no_restart_reachable(mut self) -> Scenario {
        self.covers_restart = false;
        self
    }

    /// Where the world starts (`starts`).
    pub fn start(mut self, start: fn(&mut World)) -> Scenario {
        self.start = Some(start);
        self
    }

    /// The bounded depth and state count of `cargo test`.
    pub fn depth(mut self, depth: usize, states: usize) -> Scenario {
        self.depth = Some((depth, states));
        self
    }
}

/// How Fly answered one call.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Answer {
    Ok,
    /// 429: no effect.
    RateLimited,
    /// Took effect, but the answer was lost (timeout, broken connection).
    Lost,
    /// A read answered, after which `undo_raced`'s uncordon is refused
    /// (`Env::failing_undo`).
    UndoFailed,
    /// 408: Fly timed out talking to the host; the call may have been
    /// carried out (here it was).
    Timeout408,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Action {
    Sweep(usize),
    Call(usize, Answer),
    Tick(i64),
    Hold(usize),
    Unhold(usize),
    Approve(usize, bool),
    Revoke(usize),
    ToggleBusy(usize),
    MoveTip,
    OutsideUpdate(usize),
    Outage(usize),
    AgentOutage(usize),
    CutOff(usize),
    CheckFlap(usize),
    RestartReplica(usize),
    LeaseLapse(usize),
    Crash(usize),
}

/// How a call left its step.
enum Next {
    Go,
    /// Failed: the step stops; the read after its last call and the lease
    /// release still run.
    Fail,
    /// Stopped with no lease to release.
    Drop,
    /// Go on with these calls instead.
    Then(Vec<Op>),
}

impl Model for Scenario {
    type State = World;
    type Action = Action;

    fn init_states(&self) -> Vec<World> {
        let mut machines: Vec<Machine> = self.busy.iter().map(|b| Machine::new(*b)).collect();
        for m in &mut machines {
            m.loaded = 0;
        }
        let empty = fleet_reconciler::metadata::slots::SlotSet::parse(None)
            .map(|s| s.to_value())
            .unwrap_or_default();
        let mut w = World {
            time: 0,
            tip: self.tip,
            machines,
            slots: empty,
            replicas: self
                .confs
                .iter()
                .zip(&self.skews)
                .map(|(conf, skew)| Replica {
                    conf: *conf,
                    skew: *skew,
                    mem: Mem::default(),
                    queue: Vec::new(),
                    last_plan: None,
                    known: vec![Known::Never; self.busy.len()],
                    cordon_seen: vec![None; self.busy.len()],
                    cut_off: false,
                    list_due: None,
                })
                .collect(),
            approvals: 0,
            budget: self.budget,
            record: Record::default(),
            fly_list_due: 0,
        };
        if let Some(start) = self.start {
            start(&mut w);
        }
        vec![w]
    }

    fn actions(&self, w: &World, actions: &mut Vec<Action>) {
        // A broken promise ends its path: stateright keeps the last path it
        // visits to a violating state, so the first one must be the last.
        if w.record.violated()
            || self.properties().iter().any(|p| {
                p.expectation == stateright::Expectation::Always && !(p.condition)(self, w)
            })
        {
            return;
        }
        let busy = w.replicas.iter().position(|r| !r.queue.is_empty());
        for (r, replica) in w.replicas.iter().enumerate() {
            if !self.interleave && busy.is_some_and(|b| b != r) {
                continue;
            }
            match replica.queue.first().and_then(|e| e.ops.first()) {
                None if self.env.list_limit && list_turn(w, r).0 > w.time * 1000 => {}
                None => actions.push(Action::Sweep(r)),
                Some(op) => {
                    actions.push(Action::Call(r, Answer::Ok));
                    let (may_429, may_lose) = answers(op);
                    if may_429 && self.env.rate_limits {
                        actions.push(Action::Call(r, Answer::RateLimited));
                    }
                    if may_lose && self.env.lost_answers {
                        actions.push(Action::Call(r, Answer::Lost));
                    }
                    if self.env.timeouts_408 && matches!(op, Op::Restart { .. }) {
                        actions.push(Action::Call(r, Answer::Timeout408));
                    }
                    let undo_owed = replica.queue.first().and_then(|e| e.last_call.as_ref());
                    if self.env.failing_undo
                        && matches!(op, Op::Check(_) | Op::ReadAfterAndRelease)
                        && undo_owed.is_some_and(|l| l.undo_uncordon)
                    {
                        actions.push(Action::Call(r, Answer::UndoFailed));
                    }
                }
            }
        }
        for q in self.ticks {
            if w.time + q <= self.horizon {
                actions.push(Action::Tick(*q));
            }
        }
        if w.budget == 0 {
            return;
        }
        let e = &self.env;
        for (i, m) in w.machines.iter().enumerate() {
            let held = m.metadata.contains_key(HOLD_KEY);
            if e.hold && m.host_ok {
                actions.push(if held {
                    Action::Unhold(i)
                } else {
                    Action::Hold(i)
                });
            }
            if m.host_ok {
                if e.approve_now {
                    actions.push(Action::Approve(i, true));
                }
                if e.approve_when_idle {
                    actions.push(Action::Approve(i, false));
                }
                if e.revoke && m.metadata.contains_key(APPROVE_KEY) {
                    actions.push(Action::Revoke(i));
                }
            }
            if e.busy_toggle {
                actions.push(Action::ToggleBusy(i));
            }
            if e.outside_update {
                actions.push(Action::OutsideUpdate(i));
            }
            if e.host_outage {
                actions.push(Action::Outage(i));
            }
            if e.check_flaps && m.check_failing.is_some() {
                actions.push(Action::CheckFlap(i));
            }
            if e.agent_outage && m.agent_ok {
                actions.push(Action::AgentOutage(i));
            }
            if e.lease_lapse && m.lease.is_some() {
                actions.push(Action::LeaseLapse(i));
            }
            // Once, after our restart landed.
            if e.crash_once && m.started && m.host_ok && m.exits.len() == 1 {
                actions.push(Action::Crash(i));
            }
        }
        if e.cut_off {
            for (r, replica) in w.replicas.iter().enumerate() {
                if !replica.cut_off {
                    actions.push(Action::CutOff(r));
                }
            }
        }
        if e.tip_moves && usize::from(w.tip) + 1 < super::world::COMMITS.len() {
            actions.push(Action::MoveTip);
        }
        if let Some(conf) = e.replica_restart {
            for (r, replica) in w.replicas.iter().enumerate() {
                if replica.conf != conf {
                    actions.push(Action::RestartReplica(r));
                }
            }
        }
    }

    fn next_state(&self, last: &World, action: Action) -> Option<World> {
        let mut w = last.clone();
        let env_event = !matches!(
            action,
            Action::Sweep(_) | Action::Call(..) | Action::Tick(_)
        );
        if env_event {
            w.budget = w.budget.saturating_sub(1);
        }
        let before: Vec<HoldMarker> = if self.env.host_outage {
            w.machines.iter().map(Machine::hold_marker).collect()
        } else {
            Vec::new()
        };
        if let Action::Sweep(r) | Action::Call(r, _) = action
            && let Some(token) = self.env.bare_macaroon
            && !fly_takes(token, r, &mut w)
        {
            return Some(w);
        }
        match action {
            Action::Sweep(r) if self.env.list_limit && !list_taken(&mut w, r) => {}
            Action::Sweep(r) => sweep_and_plan(&mut w, r, self.env.host_outage),
            Action::Call(r, answer) => call(&mut w, r, answer, self.env.stuck_agents),
            Action::Tick(q) => {
                w.time += q;
                // Fly runs a machine's checks on their interval: each tick
                // brings a new result (#32 item 13b needs one newer than a
                // restart).
                let (time, tip) = (w.time, w.tip);
                for m in &mut w.machines {
                    if m.check_failing.is_some() && m.started && m.host_ok {
                        m.checks_at = time;
                    }
                    // A restart that used its whole stop timeout: the
                    // machine stops and boots the tip (#32 item 13e).
                    if m.back_at.is_some_and(|b| b <= time) {
                        m.back_at = None;
                        m.loaded = tip;
                        m.busy = false;
                        m.fenced = None;
                    }
                }
            }
            Action::Hold(i) => {
                let hold = Hold {
                    by: "ops".into(),
                    reason: "model".into(),
                    at: at(w.time),
                };
                let value = serde_json::to_string(&hold).ok()?;
                w.machines[i].metadata.insert(HOLD_KEY.into(), value);
                for replica in &mut w.replicas {
                    if let Some(ex) = replica.queue.first_mut().filter(|e| e.machine == i) {
                        ex.hold_at = Some(ex.calls);
                    }
                }
            }
            Action::Unhold(i) => {
                w.machines[i].metadata.remove(HOLD_KEY);
            }
            Action::Approve(i, now) => {
                let approval = Approval {
                    target: commit(w.tip),
                    mode: if now {
                        ApprovalMode::Now
                    } else {
                        ApprovalMode::WhenIdle
                    },
                    by: format!("op{}", w.approvals),
                    at: at(w.time),
                };
                w.approvals += 1;
                let value = serde_json::to_string(&approval).ok()?;
                w.machines[i].metadata.insert(APPROVE_KEY.into(), value);
            }
            Action::Revoke(i) => {
                w.machines[i].metadata.remove(APPROVE_KEY);
            }
            Action::ToggleBusy(i) => {
                let m = &mut w.machines[i];
                if !m.started || !m.host_ok {
                    return None;
                }
                m.busy = !m.busy;
            }
            Action::MoveTip => w.tip += 1,
            Action::OutsideUpdate(i) => {
                // `fly deploy` from an old snapshot: new instance, metadata
                // reverted, cordon gone (FLY-REALITY's model), agent restarted
                // on the tip.
                let tip = w.tip;
                let m = &mut w.machines[i];
                m.instance += 1;
                m.metadata = m.older.clone();
                m.cordoned = false;
                m.cordoned_at = None;
                m.loaded = tip;
                m.busy = false;
                m.fenced = None;
            }
            Action::Outage(i) => {
                let m = &mut w.machines[i];
                m.host_ok = !m.host_ok;
            }
            Action::AgentOutage(i) => w.machines[i].agent_ok = false,
            // Fly's side of the TTL: the holder's refresh came too late.
            Action::LeaseLapse(i) => w.machines[i].lease = None,
            Action::Crash(i) => {
                let m = &mut w.machines[i];
                m.exits.push(super::world::Exit::Crash);
                m.busy = false;
                m.fenced = None;
            }
            Action::CutOff(r) => w.replicas[r].cut_off = true,
            Action::CheckFlap(i) => {
                let m = &mut w.machines[i];
                m.check_failing = m.check_failing.map(|f| !f);
                m.checks_at = w.time;
            }
            Action::RestartReplica(r) => {
                let conf = self.env.replica_restart?;
                let live = live(&w);
                w.record.allowance = w.record.allowance.max(live);
                let replica = &mut w.replicas[r];
                replica.conf = conf;
                replica.mem = Mem::default();
                replica.queue.clear();
                replica.last_plan = None;
                replica.known.iter_mut().for_each(|k| *k = Known::Never);
                replica.cordon_seen.iter_mut().for_each(|c| *c = None);
                // A new process, a new client: its limiter starts empty.
                replica.list_due = None;
                // Its leases lapse with their TTL (folded into this step).
                for m in &mut w.machines {
                    if m.lease == Some(r as u8) {
                        m.lease = None;
                    }
                }
            }
        }
        // What a replica's last sweep knew stays as it was then.
        for (i, was) in before.into_iter().enumerate() {
            if w.machines[i].hold_marker() != was {
                for replica in &mut w.replicas {
                    if replica.known[i] == Known::Same {
                        replica.known[i] = Known::Was(was.clone());
                    }
                }
            }
        }
        let live = live(&w);
        w.record.allowance = w.record.allowance.min(live);
        Some(w)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut all = vec![
            Property::always(BUSY_RESTART, |_, w: &World| w.record.busy_restart.is_none()),
            Property::always(SLOTS_WITHIN_CAP, |_, w: &World| {
                slots_in_use(w) <= cap_bound(w)
            }),
            Property::always(CORDONS_WITHIN_CAP, |_, w: &World| {
                cordoned(w) <= cap_bound(w)
            }),
            Property::always(HOLD_REPORTED, |_, w: &World| {
                w.record.hold_unreported.is_none()
            }),
            Property::always(HOLD_ONE_ROUND_TRIP, |_, w: &World| {
                w.record.hold_acted_through.is_none()
            }),
            Property::always(ONE_APPROVAL_ONE_ROTATION, |_, w: &World| {
                w.record
                    .approval_rotations
                    .values()
                    .all(|tags| tags.len() <= 1)
            }),
            Property::always(UNDO_RECORDED, |_, w: &World| undo_recorded(w)),
            Property::always(MANUAL_APPROVED, |_, w: &World| {
                w.record.manual_restart.is_none()
            }),
            Property::always(RESTARTS_WITHIN_ATTEMPTS, |_, w: &World| {
                w.record.restarts.values().all(|n| *n <= 2)
            }),
            Property::always(WAITS_END_OR_ALERT, |_, w: &World| waits_end_or_alert(w)),
            Property::always(LOWERED_CAP_YIELDS, |_, w: &World| {
                w.record.over_cap_kept.is_none()
            }),
            Property::always(GIVEN_UP_FREES_SLOT, |_, w: &World| {
                w.record.given_up_kept.is_none()
            }),
            Property::always(NO_SERVING_UNPROBEABLE_RESTART, |_, w: &World| {
                w.record.serving_restarted.is_none()
            }),
            Property::always(FINISHED_AFTER_A_CHECK, |_, w: &World| {
                w.record.finished_unchecked.is_none()
            }),
            Property::always(TIP_MOVE_ALERTED, |_, w: &World| {
                w.record.tip_move_unalerted.is_none()
            }),
            Property::always(FAILURE_COUNTS_LANDED, |_, w: &World| {
                failure_counts_landed(w)
            }),
            Property::always(ONE_STEP_AT_ONCE, |_, w: &World| {
                w.record.two_at_once.is_none()
            }),
            Property::always(NOT_FAILED_ON_OWN_EXIT, |_, w: &World| {
                w.record.failed_on_own_exit.is_none()
            }),
            Property::always(NOT_FAILED_WHILE_STOPPING, |_, w: &World| {
                w.record.failed_while_stopping.is_none()
            }),
            Property::always(ONE_OFF_UNTOUCHED, |_, w: &World| {
                w.record.one_off_touched.is_none()
            }),
            Property::always(CREDENTIALS_TAKEN, |_, w: &World| {
                w.record.credentials_refused.is_none()
            }),
            Property::always(LISTS_WITHIN_LIMIT, |_, w: &World| {
                w.record.list_refused.is_none()
            }),
            Property::always(CONFLICT_EXPLAINED, |_, w: &World| {
                w.record.conflict_unexplained.is_none()
            }),
            // Coverage: the bounded run reaches a restart at all.
            Property::sometimes(A_RESTART_LANDS, |_, w: &World| {
                !w.record.restarts.is_empty()
            }),
        ];
        if let Some(only) = self.only {
            all.retain(|p| p.name == only);
        }
        all
    }
}

pub const BUSY_RESTART: &str =
    "no busy restart unless the policy allows it and the grace passed on one clock";
pub const SLOTS_WITHIN_CAP: &str = "live slots within the cap";
pub const CORDONS_WITHIN_CAP: &str = "cordoned machines within the cap";
pub const HOLD_REPORTED: &str = "a disruptive call after a hold is reported";
pub const HOLD_ONE_ROUND_TRIP: &str =
    "no disruptive call more than one round trip after a hold was written";
pub const ONE_APPROVAL_ONE_ROTATION: &str = "one approval, one rotation";
pub const UNDO_RECORDED: &str = "nothing cordoned or fenced without a record that undoes it";
pub const MANUAL_APPROVED: &str = "no restart in a manual pool without an approval of that commit";
pub const RESTARTS_WITHIN_ATTEMPTS: &str = "restarts per machine and target within max_attempts";
pub const WAITS_END_OR_ALERT: &str = "every wait ends within its ceiling, or its alert fires";
pub const LOWERED_CAP_YIELDS: &str =
    "a plan over its pool's cap ends the excess that has not restarted";
pub const GIVEN_UP_FREES_SLOT: &str = "a release whose undrain was given up frees its slot";
pub const NO_SERVING_UNPROBEABLE_RESTART: &str =
    "no agent restarted as unprobeable unless Fly's checks fail";
pub const FAILURE_COUNTS_LANDED: &str = "a failed rotation counts only restarts that landed";
pub const FINISHED_AFTER_A_CHECK: &str =
    "a restart is verified only on a Fly check result newer than it";
pub const TIP_MOVE_ALERTED: &str =
    "a restart that loaded a tip the pool would not have restarted it for is alerted";
pub const ONE_STEP_AT_ONCE: &str = "no two replicas act on one machine at once";
pub const NOT_FAILED_ON_OWN_EXIT: &str =
    "a rotation is not failed by our own restart's exit (crash loops count only crashes)";
pub const NOT_FAILED_WHILE_STOPPING: &str =
    "an attempt is not failed while Fly may still be stopping the machine (its stop timeout)";
pub const ONE_OFF_UNTOUCHED: &str =
    "a machine that is not the app's own (console, release command) is never acted on";
pub const CREDENTIALS_TAKEN: &str = "no call of ours is refused for its credentials";
pub const LISTS_WITHIN_LIMIT: &str =
    "no List of ours is refused by Fly's per-app limit (one client's own lists)";
pub const CONFLICT_EXPLAINED: &str =
    "a step skipped for a lease held by someone else reports Fly's message";
pub const A_RESTART_LANDS: &str = "a restart lands (coverage)";

/// Which answers a call may get: (429, lost answer). Reads are never
/// "lost" (a lost read is a failed one); acquiring a lease whose answer is
/// lost would leave it to its TTL, which the model does not time.
fn answers(op: &Op) -> (bool, bool) {
    match op {
        Op::Acquire | Op::Check(_) | Op::VerifySlot { .. } | Op::WinSlot { .. } => (true, false),
        Op::ReleaseSlot { .. } | Op::ReadAfterAndRelease => (true, false),
        Op::Probe { .. } | Op::If(..) | Op::FlyChecksPass { .. } => (false, false),
        Op::Drain { .. } | Op::Undrain { .. } => (false, true),
        Op::WriteMarker(_)
        | Op::Cordon
        | Op::Uncordon
        | Op::Restart { .. }
        | Op::DeleteMarker
        | Op::DeleteApproval
        | Op::SetUnprobed(_) => (true, true),
    }
}

fn slots_in_use(w: &World) -> u8 {
    w.slot_set()
        .map(|s| s.slots(&APP.into(), &POOL.into()).len())
        .and_then(|n| u8::try_from(n).ok())
        .unwrap_or(u8::MAX)
}

fn cordoned(w: &World) -> u8 {
    w.machines.iter().filter(|m| m.cordoned).count() as u8
}

fn live(w: &World) -> u8 {
    slots_in_use(w).max(cordoned(w))
}

/// The largest cap any replica runs with, or what was live when a cap was
/// lowered (that excess yields; no new claim may use it).
fn cap_bound(w: &World) -> u8 {
    let cap = w.replicas.iter().map(|r| r.conf.cap()).max().unwrap_or(0);
    cap.max(w.record.allowance)
}

/// Every machine no step is working on: cordoned only with a marker that
/// says it may have cordoned, fenced only with a marker whose drain it is.
fn undo_recorded(w: &World) -> bool {
    w.machines
        .iter()
        .enumerate()
        .filter(|(_, m)| m.lease.is_none() && m.host_ok)
        .all(|(i, m)| {
            let marker = m.metadata.get(MARKER_KEY).and_then(|v| Marker::parse(v));
            // A cordon whose marker an outside update reverted is shown by
            // the planner's `cordoned_without_marker` alert while its slot
            // stands: that alert is its record.
            let alerted = marker.is_none() && slot_holder(w, i);
            let cordon_ok = !m.cordoned
                || alerted
                || m.undo_refused != Refused::No
                || marker.as_ref().is_some_and(|mk| mk.may_have_cordoned());
            // An agent no probe reaches: its fence was given up with a
            // `rotation_stuck` alert past `release_ceiling` (#32 item 4).
            let fence_ok = !m.agent_ok
                || m.fenced.as_ref().is_none_or(|tag| {
                    marker
                        .as_ref()
                        .is_some_and(|mk| mk.drain_requested && &mk.tag == tag)
                });
            cordon_ok && fence_ok
        })
}

/// A machine cordoned past the longest ceiling: every plan made since
/// then alerts about it or acts on it (its undo). Counted per replica from
/// its first sweep that could see the cordon (host up): a replica's
/// deadlines run from its own first sight of a marker, never from a time
/// another clock wrote (the one-clock rule); a daemon sweeping on its
/// interval sees it within one interval.
pub fn waits_end_or_alert(w: &World) -> bool {
    w.machines.iter().enumerate().all(|(i, m)| {
        if m.cordoned_at.is_none() || !m.cordoned {
            return true;
        }
        w.replicas.iter().all(|r| {
            let Some(since) = r.cordon_seen.get(i).copied().flatten() else {
                return true;
            };
            match &r.last_plan {
                Some((t, answered)) if *t >= since + CORDON_WAIT_BOUND => {
                    answered.get(i).copied().unwrap_or(true)
                }
                _ => true,
            }
        })
    })
}

/// Every `failed` marker in force counts no more restarts of its target
/// than landed on its machine (a refused restart is no attempt, #32 item
/// 13d).
fn failure_counts_landed(w: &World) -> bool {
    w.machines.iter().enumerate().all(|(i, m)| {
        let Some(mk) = m.metadata.get(MARKER_KEY).and_then(|v| Marker::parse(v)) else {
            return true;
        };
        let Some(f) = &mk.failed else {
            return true;
        };
        let key = (i as u8, commit_index(&mk.target));
        let landed = w.record.restarts.get(&key).copied().unwrap_or(0);
        // Known gap: a put-back refused too leaves a `restarting` marker
        // that the verify deadline takes for a failed attempt.
        f.attempts <= u32::from(landed) || w.record.put_back_refused.contains(&key.0)
    })
}

/// Whether a slot of the pool names machine `i`.
fn slot_holder(w: &World, i: usize) -> bool {
    w.slot_set().is_some_and(|s| {
        s.slots(&APP.into(), &POOL.into())
            .iter()
            .any(|slot| slot.machine_id == machine_id(i))
    })
}

/// The approval on a machine, if it parses.
fn approval_of(m: &Machine) -> Option<Approval> {
    m.metadata.get(APPROVE_KEY).and_then(|v| Approval::parse(v))
}

/// Replica `r` makes the next call of its step, and Fly answers `answer`.
fn call(w: &mut World, r: usize, answer: Answer, stuck: bool) {
    let Some(mut ex) = w.replicas[r].queue.first().cloned() else {
        return;
    };
    if ex.ops.is_empty() {
        w.replicas[r].queue.remove(0);
        return;
    }
    let op = ex.ops.remove(0);
    let call_of_its_own = !matches!(op, Op::If(..) | Op::FlyChecksPass { .. });
    // The lease refresher runs between calls: a lease that lapsed at Fly
    // is refreshed late, and Fly answers with another holder's 409 or,
    // nobody holding it, a new lease with another nonce (#32 item 13f).
    let mut lost = false;
    if call_of_its_own && ex.leased && w.machines[ex.machine].lease != Some(r as u8) {
        let m = &mut w.machines[ex.machine];
        if m.lease.is_none() && refresh_counts(false) {
            m.lease = Some(r as u8);
        } else {
            lost = true;
        }
    }
    if !lost && ex.overtaken && answers(&op).1 && w.record.two_at_once.is_none() {
        w.record.two_at_once = Some(format!(
            "m{}: r{r}'s {op:?} landed after another replica took the machine's lease within its step",
            ex.machine
        ));
    }
    let next = if lost {
        // `validity.lost`: the step stops before its next call; there is
        // no lease left to release.
        ex.leased = false;
        Next::Drop
    } else {
        one_call(w, r, &mut ex, &op, answer, stuck)
    };
    // A mutating call of this step landed: any other step on the machine
    // that believes it holds the lease has been acted across.
    if !lost && answers(&op).1 && answer != Answer::RateLimited && w.machines[ex.machine].host_ok {
        for (q, other) in w.replicas.iter_mut().enumerate() {
            if let Some(theirs) = other.queue.first_mut().filter(|e| e.machine == ex.machine)
                && q != r
                && theirs.leased
            {
                theirs.overtaken = true;
            }
        }
    }
    if call_of_its_own {
        ex.calls = ex.calls.saturating_add(1);
    }
    let ended = match next {
        Next::Go => {
            resolve_ifs(&mut ex);
            ex.ops.is_empty()
        }
        Next::Then(ops) => {
            ex.putting_back = ops
                .iter()
                .any(|o| matches!(o, Op::WriteMarker(MarkerWrite::Exact(_))));
            ex.ops = ops;
            resolve_ifs(&mut ex);
            false
        }
        // `restart`: the check after the probe failed; nothing restarted,
        // the plan's marker goes back (`put_marker_back`).
        Next::Fail if ex.leased && matches!(op, Op::Check(_)) && ex.put_back.is_some() => {
            let expected = ex.put_back.take().unwrap_or_default();
            ex.putting_back = true;
            ex.ops = vec![
                Op::Check(Need::Write),
                Op::WriteMarker(MarkerWrite::Exact(expected)),
                Op::ReadAfterAndRelease,
            ];
            false
        }
        Next::Fail if ex.leased => {
            if ex.putting_back {
                w.record.put_back_refused.insert(ex.machine as u8);
            }
            ex.ops = vec![Op::ReadAfterAndRelease];
            false
        }
        Next::Fail | Next::Drop => true,
    };
    if ended {
        if let Some(tag) = &ex.given_up
            && w.record.given_up_kept.is_none()
            && w.slot_set()
                .is_some_and(|s| s.holds(&APP.into(), &POOL.into(), &machine_id(ex.machine), tag))
        {
            w.record.given_up_kept = Some(format!(
                "m{}: the release that gave its undrain up ended with slot {tag} held",
                ex.machine
            ));
        }
        let m = &mut w.machines[ex.machine];
        if m.undo_refused == Refused::Acting {
            m.undo_refused = Refused::No;
        }
        // A hold lifted before the read after the call cannot be seen by
        // any read: only a hold still standing must have been reported.
        if ex.hold_unreported && w.machines[ex.machine].metadata.contains_key(HOLD_KEY) {
            w.record.hold_unreported = Some(format!(
                "m{}: a disruptive call landed on a held machine and the step ended without reporting it",
                ex.machine
            ));
        }
        if ex.leased && w.machines[ex.machine].lease == Some(r as u8) {
            w.machines[ex.machine].lease = None;
        }
        w.replicas[r].queue.remove(0);
    } else {
        w.replicas[r].queue[0] = ex;
    }
}

/// The `If`s next in line, decided on the first read (`under_lease`):
/// their calls spliced in, or dropped.
fn resolve_ifs(ex: &mut Exec) {
    while let Some(Op::If(cond, _)) = ex.ops.first() {
        let holds = match cond {
            Cond::Cordoned => ex.first_cordoned,
            Cond::ApprovalToClear { named, target } => {
                ex.first_approval.as_deref().is_some_and(|v| match named {
                    Some(id) => ApprovalId::of(v).as_str() == id,
                    None => Approval::parse(v).is_some_and(|a| a.approves(&commit(*target))),
                })
            }
        };
        let Op::If(_, then) = ex.ops.remove(0) else {
            return;
        };
        if holds {
            ex.ops.splice(0..0, then);
        }
    }
}

/// `Executor::read_back`: every read under the lease, against the
/// disruptive call before it; `undo_fails`: its undo's uncordon is refused.
fn read_back(w: &mut World, ex: &mut Exec, undo_fails: bool) {
    let m = &mut w.machines[ex.machine];
    ex.seen_instance = Some(m.instance);
    let Some(last) = ex.last_call.take() else {
        return;
    };
    // `known_metadata`: a hold found is `Unfenced::HoldLanded`; a host Fly
    // cannot reach shows none, and that is `Unfenced::ReadBackFailed`
    // (#32 item 10): reported either way.
    if !m.host_ok || m.metadata.contains_key(HOLD_KEY) {
        ex.hold_unreported = false;
    }
    if last.instance.is_some_and(|before| before != m.instance) {
        // `undo_raced`: the uncordon, best effort (host ok, same lease).
        if last.undo_uncordon && m.host_ok && !undo_fails {
            m.cordoned = false;
            m.cordoned_at = None;
        }
        if last.undo_uncordon && m.host_ok && undo_fails {
            m.undo_refused = Refused::Logged;
        }
    }
}

/// Fly's side of a call's credentials (#32 item 13i): a macaroon is taken
/// only under the `FlyV1` scheme; the header is the real client's
/// (`fly::auth_header`). A refused call has no effect.
fn fly_takes(token: &str, r: usize, w: &mut World) -> bool {
    let header = fleet_reconciler::fly::auth_header(token)
        .ok()
        .and_then(|h| h.to_str().ok().map(str::to_string));
    if header.as_deref() == Some(format!("FlyV1 {}", token.trim()).as_str()) {
        return true;
    }
    if w.record.credentials_refused.is_none() {
        w.record.credentials_refused = Some(format!(
            "r{r}: Fly answered 401 to a call sent with Authorization {:?} for the macaroon {token}",
            header.map(|h| h.split(' ').next().unwrap_or_default().to_string())
        ));
    }
    false
}

/// Replica `r`'s next List turn and its limiter's next `due`, in ms of true
/// time, as the real client decides it (`fly::list_turn`; its monotonic
/// clock has no skew).
fn list_turn(w: &World, r: usize) -> (i64, i64) {
    let base = tokio::time::Instant::now();
    let ms = |t: i64| std::time::Duration::from_millis(u64::try_from(t).unwrap_or(0));
    let since = |i: tokio::time::Instant| i64::try_from((i - base).as_millis()).unwrap_or(i64::MAX);
    let due = w.replicas[r].list_due.map(|d| base + ms(d));
    let (send_at, next) = fleet_reconciler::fly::list_turn(due, base + ms(w.time * 1000));
    (since(send_at), since(next))
}

/// Replica `r` lists the app at its turn; Fly takes it within its limit
/// of 1/s, burst 3, per app (GCRA on its own clock, FLY-REALITY F7), or
/// answers 429 and the sweep fails (#32 item 13g).
fn list_taken(w: &mut World, r: usize) -> bool {
    let (_, next) = list_turn(w, r);
    w.replicas[r].list_due = Some(next);
    let now = w.time * 1000;
    let tat = w.fly_list_due.max(now);
    if now < tat - 2000 {
        if w.record.list_refused.is_none() {
            w.record.list_refused = Some(format!(
                "r{r}: a List of {APP} at {}s answered 429: past Fly's 1/s, burst 3, per app",
                w.time
            ));
        }
        return false;
    }
    w.fly_list_due = tat + 1000;
    true
}

/// `FlyClient::refresh_lease`'s rule (#32 item 13f): a refresh counts only
/// when Fly answers with our nonce.
fn refresh_counts(same_nonce: bool) -> bool {
    same_nonce
}

/// `FlyClient`'s retry of a 408 (`fly.rs`, #32 item 13a): the call may
/// have been carried out, so an unsafe one (restart, lease acquire) is
/// `OutcomeUnknown`, never repeated; an idempotent write is retried.
fn repeated_after_408(op: &Op) -> bool {
    !matches!(op, Op::Restart { .. } | Op::Acquire)
}

/// Fly answers 409 to replica `r`'s acquire, `holder` holding the lease,
/// saying who in `message` (FLY-REALITY F15); the step is skipped and its
/// report is the real client's error of that answer (`fly::answer_error`),
/// which must name it (#32 item 13j).
fn lease_conflict(w: &mut World, r: usize, i: usize, holder: u8) {
    let who = if usize::from(holder) < w.replicas.len() {
        format!("fleet-reconciler r{holder}")
    } else {
        "deploy@example.com".to_string()
    };
    let said = format!("lease currently held by {who}");
    let body = serde_json::json!({"error": "aborted", "message": said}).to_string();
    let err = fleet_reconciler::fly::answer_error(
        "acquire_lease",
        &APP.into(),
        Some(&machine_id(i)),
        409,
        &body,
    );
    let report = err.to_string();
    if !report.contains(&said) && w.record.conflict_unexplained.is_none() {
        w.record.conflict_unexplained = Some(format!(
            "m{i}: r{r}'s acquire refused with 409 ({said:?}) reported as {report:?}"
        ));
    }
}

/// A mutating Fly call on the machine lands: host reachable and not 429.
fn lands(w: &World, ex: &Exec, answer: Answer) -> bool {
    answer != Answer::RateLimited && w.machines[ex.machine].host_ok
}

fn answered(answer: Answer, w: &World, ex: &Exec) -> Next {
    if answer == Answer::Ok && w.machines[ex.machine].host_ok {
        Next::Go
    } else {
        Next::Fail
    }
}

fn one_call(w: &mut World, r: usize, ex: &mut Exec, op: &Op, answer: Answer, stuck: bool) -> Next {
    let now = at(w.time + w.replicas[r].skew);
    let i = ex.machine;
    match op {
        // `Executor::acquire`: someone else's lease means skip.
        Op::Acquire => {
            if answer == Answer::Ok
                && w.machines[i].host_ok
                && let Some(holder) = w.machines[i].lease
            {
                lease_conflict(w, r, i, holder);
            }
            let m = &mut w.machines[i];
            if answer != Answer::Ok || m.lease.is_some() || !m.host_ok {
                return Next::Drop;
            }
            m.lease = Some(r as u8);
            ex.leased = true;
            Next::Go
        }
        // `Executor::check`.
        Op::Check(need) => {
            if !matches!(answer, Answer::Ok | Answer::UndoFailed) {
                return Next::Fail;
            }
            read_back(w, ex, answer == Answer::UndoFailed);
            let m = &w.machines[i];
            if ex.first_instance.is_none() {
                ex.first_instance = Some(m.instance);
                ex.first_cordoned = m.host_ok && m.cordoned;
                ex.first_approval = m.metadata.get(APPROVE_KEY).cloned();
            }
            if !m.host_ok || m.metadata.contains_key(HOLD_KEY) {
                return Next::Fail;
            }
            ex.seen_approval = m.metadata.get(APPROVE_KEY).cloned();
            ex.checks_seen = Some(m.check_failing);
            let expected = ex.watch.as_deref().map(Marker::parse);
            let current = m.metadata.get(MARKER_KEY).map(|v| Marker::parse(v));
            let unchanged = match (&expected, &current) {
                (None, None) => true,
                (Some(Some(e)), Some(Some(n))) => e == n,
                _ => false,
            };
            if !unchanged {
                return Next::Fail;
            }
            if *need != Need::Write {
                let ours = expected.flatten().and_then(|e| e.instance_id);
                if ours.is_some_and(|ours| ours != format!("i{}", m.instance)) {
                    return Next::Fail;
                }
                if !m.started {
                    return Next::Fail;
                }
                if let Some((target, named)) = &ex.approval {
                    // `approved`: the very approval the marker names (if it
                    // names one), naming the commit, and `now` to interrupt.
                    let value = m.metadata.get(APPROVE_KEY);
                    let ours = named
                        .as_ref()
                        .is_none_or(|id| value.is_some_and(|v| ApprovalId::of(v).as_str() == id));
                    let ok = ours
                        && approval_of(m).is_some_and(|a| {
                            a.approves(&commit(*target))
                                && (*need != Need::Interrupting || a.mode == ApprovalMode::Now)
                        });
                    if !ok {
                        return Next::Fail;
                    }
                }
            }
            Next::Go
        }
        // `Executor::write_marker` (the marker as the call site fills it).
        Op::WriteMarker(write) => {
            let instance = ex.first_instance.map(|n| format!("i{n}"));
            let value = match write {
                MarkerWrite::Exact(v) => Some(v.clone()),
                MarkerWrite::ClaimIntent(v) => Marker::parse(v).map(|mut m| {
                    m.phase = Phase::Claiming;
                    m.started_at = now;
                    m.attempt_started_at = now;
                    m.cordoned = Some(false);
                    m.instance_id = instance;
                    m.to_value()
                }),
                MarkerWrite::FirstPhase { reload } => {
                    ex.watch.as_deref().and_then(Marker::parse).map(|mut m| {
                        m.phase = if *reload {
                            Phase::Reloading
                        } else {
                            Phase::Draining
                        };
                        m.started_at = now;
                        m.attempt_started_at = now;
                        m.cordoned = Some(!reload);
                        m.to_value()
                    })
                }
                MarkerWrite::Restarting(v) => Marker::parse(v).map(|mut m| {
                    m.restart_at = Some(now);
                    m.attempt_started_at = now;
                    m.instance_id = instance;
                    m.to_value()
                }),
            };
            let Some(value) = value else {
                return Next::Fail;
            };
            if lands(w, ex, answer) {
                if matches!(write, MarkerWrite::Restarting(_)) {
                    w.machines[i].restart_marked = Some(w.time);
                }
                w.machines[i]
                    .metadata
                    .insert(MARKER_KEY.into(), value.clone());
            }
            let next = answered(answer, w, ex);
            if matches!(next, Next::Go) {
                ex.watch = Some(value);
            }
            next
        }
        // `win_slot` → `apply_slot_changes`: a write whose answer is lost is
        // read again and kept when the set proves it, so only 429 fails.
        Op::WinSlot { tag } => {
            if answer != Answer::Ok {
                return Next::Fail;
            }
            let Some(mut set) = w.slot_set() else {
                return Next::Fail;
            };
            let cap = usize::from(w.replicas[r].conf.cap());
            let slot = Slot {
                machine_id: machine_id(i),
                tag: tag.clone(),
                owner: format!("r{r}"),
                since: now,
            };
            let (app, pool) = (APP.into(), POOL.into());
            let mut won = set.try_add(&app, &pool, slot.clone(), cap);
            if !won {
                reclaim_stale(w, &mut set);
                won = set.try_add(&app, &pool, slot, cap);
            }
            if won {
                w.slots = set.to_value();
                Next::Go
            } else {
                // Pool full: the intent goes, nothing was cordoned.
                Next::Then(vec![
                    Op::Check(Need::Write),
                    Op::DeleteMarker,
                    Op::ReadAfterAndRelease,
                ])
            }
        }
        // `verify_slot`.
        Op::VerifySlot { tag } => {
            let holds = w
                .slot_set()
                .is_some_and(|s| s.holds(&APP.into(), &POOL.into(), &machine_id(i), tag));
            if answer == Answer::Ok && holds {
                Next::Go
            } else {
                Next::Fail
            }
        }
        // `cordon` after `lease.calling("cordon", Some(Undo::Uncordon))`.
        Op::Cordon => {
            ex.last_call = Some(LastCall {
                instance: ex.seen_instance,
                undo_uncordon: true,
            });
            if lands(w, ex, answer) {
                let time = w.time;
                landed_on_hold(w, ex, "cordon");
                let m = &mut w.machines[i];
                if !m.cordoned {
                    m.cordoned_at = Some(time);
                }
                m.cordoned = true;
            }
            answered(answer, w, ex)
        }
        // `release_rotation`'s uncordon.
        Op::Uncordon => {
            if lands(w, ex, answer) {
                let m = &mut w.machines[i];
                m.cordoned = false;
                m.cordoned_at = None;
            }
            answered(answer, w, ex)
        }
        // `Executor::drain`'s POST (`calling` first).
        Op::Drain { tag, tolerant } => {
            ex.last_call = Some(LastCall {
                instance: ex.seen_instance,
                undo_uncordon: false,
            });
            if !w.machines[i].agent_ok {
                return if *tolerant { Next::Go } else { Next::Fail };
            }
            if w.machines[i].host_ok && w.machines[i].started {
                landed_on_hold(w, ex, "drain");
                w.machines[i].fenced = Some(tag.clone());
            }
            match answered(answer, w, ex) {
                Next::Fail if *tolerant => Next::Go,
                n => n,
            }
        }
        // `release_rotation`'s undrain POST.
        Op::Undrain { tag } => {
            let m = &mut w.machines[i];
            if !m.agent_ok {
                return Next::Fail;
            }
            if m.host_ok && m.fenced.as_ref() == Some(tag) {
                m.fenced = None;
            }
            answered(answer, w, ex)
        }
        // `Executor::fresh_probe`.
        Op::Probe {
            guard,
            expected,
            target,
        } => {
            let Some(expected_marker) = Marker::parse(expected) else {
                return Next::Fail;
            };
            let policy = w.replicas[r].conf.policy();
            ex.busy_at_probe = Some(w.machines[i].busy);
            ex.unprobeable = *guard == Guard::Unprobeable;
            let allowed = match report(w, r, i) {
                Some(rep) if commit(*target).as_str().starts_with(&*rep.overlay_ref) => false,
                Some(rep) => match guard {
                    Guard::MayInterrupt => true,
                    Guard::Idle | Guard::Unprobeable => {
                        restart_allowed(&policy, &rep, &expected_marker, now).is_ok()
                    }
                },
                None => *guard != Guard::Idle,
            };
            if allowed {
                ex.put_back = Some(expected.clone());
                Next::Go
            } else {
                // Nothing restarted: the plan's marker goes back.
                Next::Then(vec![
                    Op::Check(Need::Write),
                    Op::WriteMarker(MarkerWrite::Exact(expected.clone())),
                    Op::ReadAfterAndRelease,
                ])
            }
        }
        // Judged on the check just before (one read here).
        Op::FlyChecksPass { expected } => {
            // `MachineCheck::any_failing` on that read: none failing (or
            // none defined) declines.
            if ex.checks_seen != Some(Some(true)) {
                Next::Then(vec![
                    Op::Check(Need::Write),
                    Op::WriteMarker(MarkerWrite::Exact(expected.clone())),
                    Op::ReadAfterAndRelease,
                ])
            } else {
                Next::Go
            }
        }
        // `FlyClient::restart` after `lease.calling("restart", None)`.
        Op::Restart { expected } => {
            ex.put_back = None;
            ex.last_call = Some(LastCall {
                instance: ex.seen_instance,
                undo_uncordon: false,
            });
            // `restart`'s 429 arm (#32 item 13d): nothing restarted, no read
            // after it owed, the plan's marker put back (`put_marker_back`).
            if answer == Answer::RateLimited {
                ex.last_call = None;
                return Next::Then(vec![
                    Op::Check(Need::Write),
                    Op::WriteMarker(MarkerWrite::Exact(expected.clone())),
                    Op::ReadAfterAndRelease,
                ]);
            }
            if !lands(w, ex, answer) {
                return answered(answer, w, ex);
            }
            restart_lands(w, r, ex, stuck);
            // A 408 (#32 item 13a): carried out, and repeated only where
            // the client repeats it (the second is answered).
            if answer == Answer::Timeout408 && repeated_after_408(op) {
                restart_lands(w, r, ex, stuck);
                return answered(Answer::Ok, w, ex);
            }
            answered(answer, w, ex)
        }
        Op::DeleteMarker => {
            if lands(w, ex, answer) {
                w.machines[i].metadata.remove(MARKER_KEY);
            }
            answered(answer, w, ex)
        }
        // Decided on the first read (`Cond::ApprovalToClear`); the key is
        // deleted whatever it holds now.
        Op::DeleteApproval => {
            if lands(w, ex, answer) {
                w.machines[i].metadata.remove(APPROVE_KEY);
            }
            answered(answer, w, ex)
        }
        Op::SetUnprobed(value) => {
            if lands(w, ex, answer) {
                let skew = w.replicas[r].skew;
                let m = &mut w.machines[i];
                match value {
                    Some(v) => {
                        if m.unprobed_since.as_ref().is_none_or(|(was, _)| was != v)
                            && let Some(record) = Unprobed::parse(v)
                        {
                            let since = (record.since - at(0)).num_seconds() - skew;
                            m.unprobed_since = Some((v.clone(), since));
                        }
                        m.metadata.insert(UNPROBED_KEY.into(), v.clone())
                    }
                    None => m.metadata.remove(UNPROBED_KEY),
                };
            }
            answered(answer, w, ex)
        }
        // Best effort: a slot left behind is reclaimed by the next claim.
        Op::ReleaseSlot { tag } => {
            if answer == Answer::Ok
                && let Some(mut set) = w.slot_set()
            {
                set.remove(&APP.into(), &POOL.into(), &machine_id(i), tag);
                w.slots = set.to_value();
            }
            Next::Go
        }
        // `run`: `read_after_last_call`, then `release`. A GET that fails
        // is `Unfenced::ReadBackFailed` (#32 item 10): reported.
        Op::ReadAfterAndRelease => {
            if ex.last_call.is_some() {
                if matches!(answer, Answer::Ok | Answer::UndoFailed) {
                    read_back(w, ex, answer == Answer::UndoFailed);
                } else {
                    ex.last_call = None;
                    ex.hold_unreported = false;
                }
            }
            Next::Go
        }
        // Resolved as soon as it is next (`resolve_ifs`); never a call.
        Op::If(..) => Next::Go,
    }
}

/// Our restart lands on the step's machine: the invariants judged at that
/// instant, then Fly's effect.
fn restart_lands(w: &mut World, r: usize, ex: &mut Exec, stuck: bool) {
    judge_restart(w, r, ex);
    landed_on_hold(w, ex, "restart");
    let (tip, time) = (w.tip, w.time);
    let m = &mut w.machines[ex.machine];
    // Restart keeps the instance; the agent loads the tip (after the
    // stop timeout, if the config sets one); the cordon does not survive
    // (FLY-REALITY's model). Fly records the exit we asked for.
    if m.stop_timeout > 0 {
        m.back_at = Some(time + i64::from(m.stop_timeout));
    } else {
        if !stuck {
            m.loaded = tip;
        }
        m.busy = false;
        m.fenced = None;
    }
    m.exits = vec![super::world::Exit::Requested];
    m.cordoned = false;
    m.cordoned_at = None;
}

/// A disruptive call (the step's call number `ex.calls`) landed on its
/// machine: a hold there is owed a report (the read after the call), and
/// one written before the step's previous call was acted through (no read
/// stood between it and the call: more than one round trip, #32 item 11).
fn landed_on_hold(w: &mut World, ex: &mut Exec, call: &str) {
    if !w.machines[ex.machine].metadata.contains_key(HOLD_KEY) {
        return;
    }
    ex.hold_unreported = true;
    let written = ex.hold_at.unwrap_or(0);
    if written < ex.calls && w.record.hold_acted_through.is_none() {
        w.record.hold_acted_through = Some(format!(
            "m{}: {call} (call {} of its step) landed on a hold written before call {written}",
            ex.machine, ex.calls
        ));
    }
}

/// The invariants judged at the instant a restart lands on the step's
/// machine: on the marker in force, the approval the last check read, the
/// agent's work at the fresh probe, and true time since the cordon landed.
fn judge_restart(w: &mut World, r: usize, ex: &Exec) {
    let i = ex.machine;
    let m = &w.machines[i];
    let Some(marker) = m.metadata.get(MARKER_KEY).and_then(|v| Marker::parse(v)) else {
        return;
    };
    let target = commit_index(&marker.target);
    // The tip the acting replica's plan saw: a move to a commit of another
    // action between its last check and the restart's landing cannot be
    // seen within the step (the plan's tip is from the sweep's fetch); the
    // window is one step long, closed by the next sweep.
    let action = w.replicas[r].conf.action(ex.plan_tip);
    let approval = ex
        .seen_approval
        .as_deref()
        .and_then(Approval::parse)
        .filter(|a| a.approves(&marker.target));
    // An agent no probe reaches while Fly's checks fail is taken for dead
    // past the probe-failure ceiling (docs/safety.md): its work is unknown.
    // Only past the probe-failure ceiling on one clock: counted from the
    // true time the shared record's `since` stands for (#32 item 8).
    let failing = ex.checks_seen.unwrap_or(m.check_failing) == Some(true);
    let past_ceiling = m
        .unprobed_since
        .as_ref()
        .is_some_and(|(_, t)| w.time - t >= PROBE_CEILING);
    let dead = ex.unprobeable && failing && past_ceiling;
    let busy = ex.busy_at_probe.unwrap_or(m.busy) && !dead;
    let approved_now = approval
        .as_ref()
        .is_some_and(|a| a.mode == ApprovalMode::Now);
    let grace = action == PolicyAction::Restart
        && m.cordoned_at.is_some_and(|c| w.time - c >= RESTART_GRACE);
    if busy && !approved_now && !grace && w.record.busy_restart.is_none() {
        w.record.busy_restart = Some(format!(
            "m{i} busy, restarted by r{r} at t={} (policy {action}, cordon since {:?}, marker action {}, unprobeable {}, unprobed since {:?})",
            w.time,
            m.cordoned_at,
            marker.action,
            ex.unprobeable,
            m.unprobed_since.as_ref().map(|(_, t)| t)
        ));
    }
    // The agent loads the tip in force now: if it moved since the plan,
    // would the pool have restarted the machine for it? If not, the verify
    // must say so (docs/safety.md, "A tip that moves within a step").
    if w.tip != ex.plan_tip {
        let now_action = w.replicas[r].conf.action(w.tip);
        let approved_loaded = ex
            .seen_approval
            .as_deref()
            .and_then(Approval::parse)
            .is_some_and(|a| a.approves(&commit(w.tip)));
        w.machines[i].loaded_unauthorized = now_action != marker.action
            || (marker.action == PolicyAction::Manual && !approved_loaded);
    }
    let m = &w.machines[i];
    let manual = action == PolicyAction::Manual || marker.action == PolicyAction::Manual;
    if manual && approval.is_none() && w.record.manual_restart.is_none() {
        w.record.manual_restart = Some(format!(
            "m{i} restarted by r{r} toward {target} without an approval of it"
        ));
    }
    if manual && let Some(a) = approval {
        w.record
            .approval_rotations
            .entry(a.by)
            .or_default()
            .insert(marker.tag.clone());
    }
    // The model's machines define no Fly checks: none fails, so no
    // probe-failure ceiling applies (#32 item 3).
    if ex.unprobeable && m.agent_ok && m.host_ok && !failing && w.record.serving_restarted.is_none()
    {
        w.record.serving_restarted = Some(format!(
            "m{i} restarted as unprobeable by r{r} at t={} while its agent answers (r{r} cut off: {})",
            w.time, w.replicas[r].cut_off
        ));
    }
    *w.record.restarts.entry((i as u8, target)).or_default() += 1;
}

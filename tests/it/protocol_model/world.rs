//! The abstract world: Fly (machines, metadata, leases, cordons), the agents,
//! the coordinator's slot set, the release tip, true time, and the replicas.
//! Metadata values are the real formats (`Marker`, `Approval`, `Hold`,
//! `SlotSet` serialized by their own code), so the real sweep parse and the
//! real planner read them.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::num::NonZeroU32;
use std::time::Duration;

use chrono::{DateTime, Utc};
use fleet_reconciler::config::{ActionMap, PoolConfig};
use fleet_reconciler::decide::planner::Tracker;
use fleet_reconciler::decide::policy::Policy;
use fleet_reconciler::metadata::slots::SlotSet;
use fleet_reconciler::model::{MachineId, PolicyAction, Severity};

pub const APP: &str = "app";
pub const POOL: &str = "default";
/// The pool label key of the app (`apps[].pool_key`).
pub const POOL_KEY: &str = "pool";
/// Commits the release tip moves through; the last one is critical.
pub const COMMITS: [&str; 3] = [
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
    "cccccccccccccccccccccccccccccccccccccccc",
];
pub const CRITICAL: u8 = 2;

/// The model's rotation durations: tiny, so the tick quanta cross them
/// within the depth.
pub const RESTART_GRACE: i64 = 10;
/// `rotation.probe_failure_ceiling` of the model's policy.
pub const PROBE_CEILING: i64 = 120;
/// The longest wait a cordoned machine may be left in (the drain and
/// checkpoint ceilings, 60 s) plus one sweep's slack.
pub const CORDON_WAIT_BOUND: i64 = 90;

pub fn t0() -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default()
}

pub fn at(secs: i64) -> DateTime<Utc> {
    t0() + chrono::Duration::seconds(secs)
}

pub fn machine_id(i: usize) -> MachineId {
    MachineId::from(format!("m{i}").as_str())
}

/// A replica's configuration: the pool's cap and actions.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Conf {
    /// `restart` at every severity.
    Restart { cap: u8 },
    /// `manual` at every severity.
    Manual { cap: u8 },
    /// `manual`, but `restart` for a critical drift.
    ManualCriticalRestart { cap: u8 },
    /// `restart`, but `manual` for a critical drift.
    RestartCriticalManual { cap: u8 },
}

impl Conf {
    pub fn cap(self) -> u8 {
        match self {
            Conf::Restart { cap }
            | Conf::Manual { cap }
            | Conf::ManualCriticalRestart { cap }
            | Conf::RestartCriticalManual { cap } => cap,
        }
    }

    pub fn policy(self) -> Policy {
        use PolicyAction::{Manual, Restart};
        let actions = match self {
            Conf::Restart { .. } => [Restart; 4],
            Conf::Manual { .. } => [Manual; 4],
            Conf::ManualCriticalRestart { .. } => [Manual, Manual, Manual, Restart],
            Conf::RestartCriticalManual { .. } => [Restart, Restart, Restart, Manual],
        };
        let pool = PoolConfig {
            max_concurrent_rotations: NonZeroU32::new(u32::from(self.cap()))
                .unwrap_or(NonZeroU32::MIN),
            actions: ActionMap::from(actions),
            ..PoolConfig::default()
        };
        let mut policy = Policy::default().with_pool(POOL, pool);
        let r = &mut policy.rotation;
        r.min_drift_age = Duration::ZERO;
        r.restart_grace = Duration::from_secs(RESTART_GRACE as u64);
        r.drain_ceiling = Duration::from_secs(60);
        r.checkpoint_deadline = Duration::from_secs(60);
        r.retry_after = Duration::from_secs(60);
        r.probe_failure_ceiling = Duration::from_secs(PROBE_CEILING as u64);
        r.verify_deadline = Duration::from_secs(30);
        r.recent_input_guard = Duration::ZERO;
        r.max_attempts = NonZeroU32::new(2).unwrap_or(NonZeroU32::MIN);
        r.release_ceiling = fleet_reconciler::config::NonZeroDuration::from_secs(60);
        policy
    }

    /// What this configuration does about drift toward the commit `tip`.
    pub fn action(self, tip: u8) -> PolicyAction {
        self.policy().action(&POOL.into(), severity(tip))
    }
}

/// The fixed verdict: a critical commit is critical, any other drift medium.
pub fn severity(tip: u8) -> Severity {
    if tip == CRITICAL {
        Severity::Critical
    } else {
        Severity::Medium
    }
}

/// One Fly machine and the agent on it.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Machine {
    pub started: bool,
    pub host_ok: bool,
    pub instance: u8,
    pub cordoned: bool,
    pub metadata: BTreeMap<String, String>,
    /// The metadata an outside update (`fly deploy` from an old snapshot)
    /// writes back.
    pub older: BTreeMap<String, String>,
    /// The replica holding the machine's Fly lease.
    pub lease: Option<u8>,
    pub busy: bool,
    /// The agent's fence: the rotation tag it drained for.
    pub fenced: Option<String>,
    /// The commit index the agent loaded.
    pub loaded: u8,
    /// True time the cordon in force landed (for the one-clock grace).
    pub cordoned_at: Option<i64>,
    /// `undo_raced`'s uncordon was refused, logged as an error: that log
    /// is the cordon's record until the next plan has acted on it.
    pub undo_refused: Refused,
    /// Whether the agent answers its probes and drain calls (Fly still
    /// reaches the machine; `host_ok` is Fly's side).
    pub agent_ok: bool,
    /// Fly's health checks: `None` when the config defines none, else
    /// whether one fails.
    pub check_failing: Option<bool>,
    /// The shared probe-failure record's value and the true time its
    /// `since` stands for (its writer's clock taken off): the
    /// probe-failure ceiling on one clock counts from there.
    pub unprobed_since: Option<(String, i64)>,
    /// True time of Fly's latest result of the machine's checks (Fly runs
    /// them at every tick; Fly's clock is true time).
    pub checks_at: i64,
    /// True time our `restarting` marker (its `restart_at`) was written.
    pub restart_marked: Option<i64>,
    /// Our restart loaded a newer tip than its step was planned on, one
    /// the pool would not have restarted it for: the verify owes an alert.
    pub loaded_unauthorized: bool,
    /// Fly's exit events since our last restart landed (#32 item 13c).
    pub exits: Vec<Exit>,
    /// The config's stop timeout (`kill_timeout`), seconds: a restart
    /// waits up to it before the machine stops (#32 item 13e).
    pub stop_timeout: u16,
    /// True time a restart that is still stopping the machine brings it
    /// back on the tip (the whole stop timeout used; boot takes no time).
    pub back_at: Option<i64>,
    /// A machine flyctl made for a one-off command (`fly console`): its
    /// metadata names the process group; never the app's own (#32 item 13h).
    pub one_off: bool,
}

/// One of Fly's exit events (`request.exit_event`). Untimed, so that
/// paths that differ only in when an exit came stay one state: the sweep
/// stamps them just after our `restarting` marker, within the verify
/// window.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Exit {
    /// Our restart's: requested, exit code 143, Fly starts it again.
    Requested,
    /// The process crashed on its own (code 1) and Fly restarted it.
    Crash,
}

/// Where a refused undo stands (`Machine::undo_refused`).
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub enum Refused {
    #[default]
    No,
    /// Logged; no plan since.
    Logged,
    /// The next plan stepped on the machine; its step is not over.
    Acting,
}

impl Machine {
    pub fn new(busy: bool) -> Machine {
        let metadata = BTreeMap::from([(POOL_KEY.to_string(), POOL.to_string())]);
        Machine {
            started: true,
            host_ok: true,
            instance: 1,
            cordoned: false,
            older: metadata.clone(),
            metadata,
            lease: None,
            busy,
            fenced: None,
            loaded: 0,
            cordoned_at: None,
            undo_refused: Refused::No,
            agent_ok: true,
            check_failing: None,
            unprobed_since: None,
            checks_at: -1000,
            restart_marked: None,
            loaded_unauthorized: false,
            exits: Vec::new(),
            stop_timeout: 0,
            back_at: None,
            one_off: false,
        }
    }
}

/// The planner's memory between sweeps, compared by what it exposes (the
/// drift and unprobed clocks of each model machine): `Tracker` has no `Eq`.
#[derive(Clone, Debug, Default)]
pub struct Mem(pub Tracker);

/// One machine's clocks as the tracker exposes them: drift, unprobed.
type Clocks = (Option<DateTime<Utc>>, Option<DateTime<Utc>>);

impl Mem {
    fn key(&self) -> Vec<Clocks> {
        (0..3)
            .map(|i| {
                let id = machine_id(i);
                (self.0.drift_since(&id), self.0.unprobed_since(&id))
            })
            .collect()
    }
}

impl PartialEq for Mem {
    fn eq(&self, other: &Mem) -> bool {
        self.key() == other.key()
    }
}
impl Eq for Mem {}
impl Hash for Mem {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

/// A call's need, mirroring the executor's private `Call`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Need {
    Write,
    Disruptive,
    Interrupting,
}

/// A guard of a restart (the planner's `RestartGuard`, which has no `Hash`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Guard {
    MayInterrupt,
    Idle,
    Unprobeable,
}

/// A marker the executor writes, some fields filled at the call.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum MarkerWrite {
    /// As planned (advance, release, a restored marker).
    Exact(String),
    /// `claim`: the plan's marker as `claiming`, times now, our instance.
    ClaimIntent(String),
    /// `claim` after the slot: the first phase, times now, `cordoned`.
    FirstPhase { reload: bool },
    /// `restart`: the plan's marker, `restart_at` and attempt now, our instance.
    Restarting(String),
}

/// One Fly (or agent) call of a step, as the executor makes it.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Op {
    /// `Executor::acquire`: the machine's lease.
    Acquire,
    /// `Executor::check`: GET, `read_back`, then the preconditions.
    Check(Need),
    /// `Executor::write_marker`.
    WriteMarker(MarkerWrite),
    /// `Executor::win_slot` → `apply_slot_changes`: one coordinator lease,
    /// read, stale reclaim, write (atomic here).
    WinSlot { tag: String },
    /// `Executor::verify_slot`: a read of the coordinator.
    VerifySlot { tag: String },
    /// `FlyClient::cordon` (claim, advance, restart).
    Cordon,
    /// `FlyClient::uncordon` (release_rotation).
    Uncordon,
    /// `Executor::drain`'s POST (after its check).
    Drain { tag: String, tolerant: bool },
    /// `release_rotation`'s undrain POST.
    Undrain { tag: String },
    /// `Executor::fresh_probe`: declined → the plan's marker is put back.
    Probe {
        guard: Guard,
        expected: String,
        target: u8,
    },
    /// `restart`'s `Declined::FlyChecksPass`, judged on the check just
    /// before (no call of its own): puts `expected` back.
    FlyChecksPass { expected: String },
    /// `FlyClient::restart`; a 429 puts `expected` (the plan's marker)
    /// back (`Executor::put_marker_back`, #32 item 13d).
    Restart { expected: String },
    /// `delete_metadata` of our marker (withdraw, claim at cap, release).
    DeleteMarker,
    /// `release_rotation`'s `delete_metadata(APPROVE_KEY)`: decided on the
    /// first read (`If(Cond::ApprovalToClear ..)`), then deleted whatever
    /// the key holds by then.
    DeleteApproval,
    /// `write_unprobed`.
    SetUnprobed(Option<String>),
    /// `Executor::release_slot` (best effort).
    ReleaseSlot { tag: String },
    /// `run`'s `read_after_last_call`, then the lease release.
    ReadAfterAndRelease,
    /// Calls made only when `Cond` held at the step's first read (the
    /// decisions `under_lease` makes on it); no call of its own, resolved
    /// as soon as it is next.
    If(Cond, Vec<Op>),
}

/// What `under_lease` decides on the step's first read.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Cond {
    /// Fly shows the machine cordoned (`machine.cordoned == Some(true)`).
    Cordoned,
    /// The approval this rotation used is there: the one the marker names
    /// (its `ApprovalId`), or for a marker naming none one approving
    /// `target` (`under_lease`'s `clear_approval`).
    ApprovalToClear { named: Option<String>, target: u8 },
}

/// The disruptive call not yet followed by a read (`Held::last_call`).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct LastCall {
    pub instance: Option<u8>,
    pub undo_uncordon: bool,
}

/// One step being carried out by a replica.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Exec {
    /// The step as the planner describes it (for traces).
    pub label: String,
    pub machine: usize,
    pub ops: Vec<Op>,
    /// The marker the machine must carry (`Watch::marker`).
    pub watch: Option<String>,
    /// A manual rotation's commit, and the approval its marker names
    /// (`Watch::approval`).
    pub approval: Option<(u8, Option<String>)>,
    /// The first check's read: instance, Fly's cordon, the approval's value.
    pub first_instance: Option<u8>,
    pub first_cordoned: bool,
    pub first_approval: Option<String>,
    /// The tip of the snapshot the step was planned on: the acting
    /// replica cannot see a later move within its step.
    pub plan_tip: u8,
    pub seen_instance: Option<u8>,
    pub last_call: Option<LastCall>,
    /// A disruptive call landed on a held machine and no read has reported it.
    pub hold_unreported: bool,
    /// Whether the lease was taken (a declined acquire holds nothing).
    pub leased: bool,
    /// The approval the last check read, and the agent's work at the
    /// fresh probe: a revoke or new work landing after them, within the
    /// restart's round trip, is the gap no read can close (docs/safety.md).
    pub seen_approval: Option<String>,
    pub busy_at_probe: Option<bool>,
    /// A release whose undrain the plan gave up: its tag.
    pub given_up: Option<String>,
    /// The restart's guard is `Unprobeable` (set at the fresh probe).
    pub unprobeable: bool,
    /// Between the fresh probe and the restart: the plan's marker, put
    /// back if the check before the restart fails (`authorized`'s error
    /// arm, `put_marker_back`).
    pub put_back: Option<String>,
    /// The calls left put the plan's marker back (nothing restarted).
    pub putting_back: bool,
    /// Fly's checks as the last check read them (a flap within the
    /// restart's round trip is the same gap as a revoke).
    pub checks_seen: Option<Option<bool>>,
    /// Calls of this step made so far (a probe is one; `If` and
    /// `FlyChecksPass` are none).
    pub calls: u8,
    /// How many of its calls the step had made when the last hold was
    /// written on its machine (`None`: before the step began).
    pub hold_at: Option<u8>,
    /// Another replica's mutating call landed on the machine within this
    /// step (possible only after this step's lease lapsed at Fly).
    pub overtaken: bool,
}

/// A machine's hold and marker values.
pub type HoldMarker = (Option<String>, Option<String>);

/// What a replica's last sweep that knew a machine's metadata saw of it;
/// `Same` while nothing changed since (fewer states than a copy).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub enum Known {
    #[default]
    Never,
    Same,
    Was(HoldMarker),
}

impl Machine {
    pub fn hold_marker(&self) -> HoldMarker {
        let value = |k: &str| self.metadata.get(k).cloned();
        (
            value(fleet_reconciler::metadata::HOLD_KEY),
            value(fleet_reconciler::metadata::MARKER_KEY),
        )
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Replica {
    pub conf: Conf,
    pub skew: i64,
    pub mem: Mem,
    /// Steps of the last plan still to run, first one in progress.
    pub queue: Vec<Exec>,
    /// The last plan: its true time, and per machine whether it alerted
    /// (`rotation_stuck`, `rotation_failed`) or planned a step.
    pub last_plan: Option<(i64, Vec<bool>)>,
    /// Per machine, the hold and marker of the last sweep that knew its
    /// metadata (`LastListings`, which `decide::prepare` carries into a
    /// sweep where the host is out); kept only where hosts can go out.
    pub known: Vec<Known>,
    /// Per machine, the true time of this replica's first sweep that could
    /// see its cordon in force (host up): its deadlines count from its own
    /// first sight (the one-clock rule), never from before.
    pub cordon_seen: Vec<Option<i64>>,
    /// Cut off from the private network: its probes of every agent fail
    /// (Fly's API still answers it).
    pub cut_off: bool,
    /// The `due` of its client's List bucket, ms of true time
    /// (`Env::list_limit`).
    pub list_due: Option<i64>,
}

/// What the invariants need of the past.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Record {
    /// Busy agents restarted without the policy's leave (text for the trace).
    pub busy_restart: Option<String>,
    pub manual_restart: Option<String>,
    pub hold_unreported: Option<String>,
    /// A disruptive call landed on a machine held since before the step's
    /// previous call: more than one round trip after the hold was written.
    pub hold_acted_through: Option<String>,
    /// Per approval (its `by`): the rotation tags restarted under it.
    pub approval_rotations: BTreeMap<String, BTreeSet<String>>,
    /// Restarts per (machine, target).
    pub restarts: BTreeMap<(u8, u8), u8>,
    /// Live slots allowed past the cap right after a cap was lowered (the
    /// excess yields; only new claims are bounded by the new cap).
    pub allowance: u8,
    /// A plan that saw its pool's live slots above its cap and left the
    /// excess that had not restarted going on (#32 item 9).
    pub over_cap_kept: Option<String>,
    /// A release whose undrain the plan gave up ended with its slot held
    /// (#32 item 4): asked again every sweep, it would hold it forever.
    pub given_up_kept: Option<String>,
    /// A rotation whose restart loaded a tip the pool would not have
    /// restarted it for was finished with no alert saying so.
    pub tip_move_unalerted: Option<String>,
    /// A rotation planned to finish as verified after our restart while
    /// Fly had not checked the machine since (#32 item 13b).
    pub finished_unchecked: Option<String>,
    /// An agent that answers (only the acting replica's probes fail) was
    /// restarted as unprobeable while Fly's checks did not fail (#32 item 3).
    pub serving_restarted: Option<String>,
    /// Machines where a put-back of the plan's marker after a restart that
    /// was not made failed (the known gap of `put_marker_back`).
    pub put_back_refused: BTreeSet<u8>,
    /// A call of one step landed after another replica took the machine's
    /// lease since the step took it (#32 item 13f).
    pub two_at_once: Option<String>,
    /// An attempt ended as failed on exits we asked for: the machine came
    /// back on its target with fewer crashes than a crash loop (#32 item 13c).
    pub failed_on_own_exit: Option<String>,
    /// An attempt ended as failed while Fly was still stopping the machine
    /// within its stop timeout (#32 item 13e).
    pub failed_while_stopping: Option<String>,
    /// A step planned for a machine that is not the app's own (#32 item 13h).
    pub one_off_touched: Option<String>,
    /// A call Fly refused for its credentials (#32 item 13i).
    pub credentials_refused: Option<String>,
    /// A List Fly refused past its per-app limit (#32 item 13g).
    pub list_refused: Option<String>,
    /// A 409 on an acquire reported without Fly's message (#32 item 13j).
    pub conflict_unexplained: Option<String>,
}

impl Record {
    /// A promise judged at a transition was broken.
    pub fn violated(&self) -> bool {
        self.busy_restart.is_some()
            || self.manual_restart.is_some()
            || self.hold_unreported.is_some()
            || self.hold_acted_through.is_some()
            || self.approval_rotations.values().any(|t| t.len() > 1)
            || self.restarts.values().any(|n| *n > 2)
            || self.over_cap_kept.is_some()
            || self.given_up_kept.is_some()
            || self.serving_restarted.is_some()
            || self.finished_unchecked.is_some()
            || self.tip_move_unalerted.is_some()
            || self.two_at_once.is_some()
            || self.failed_on_own_exit.is_some()
            || self.failed_while_stopping.is_some()
            || self.one_off_touched.is_some()
            || self.credentials_refused.is_some()
            || self.list_refused.is_some()
            || self.conflict_unexplained.is_some()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct World {
    pub time: i64,
    pub tip: u8,
    pub machines: Vec<Machine>,
    pub slots: String,
    pub replicas: Vec<Replica>,
    pub approvals: u8,
    /// Environment events left (bounds the space).
    pub budget: u8,
    pub record: Record,
    /// Fly's List bucket of the app: its next due, ms of true time
    /// (`Env::list_limit`).
    pub fly_list_due: i64,
}

impl World {
    pub fn slot_set(&self) -> Option<SlotSet> {
        SlotSet::parse(Some(&self.slots)).ok()
    }
}

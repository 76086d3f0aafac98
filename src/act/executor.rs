//! The executor: carries out planned steps through the Fly API and the agents.
//!
//! Owns leases, markers and the slot protocol of [`crate::metadata::slots`]. Every step
//! holds the machine's Fly lease (short TTL, refreshed while held, released on
//! every exit path); a lease held by someone else means "skip this machine
//! this sweep", never "take it". Under the lease it re-reads the machine and
//! checks the step's preconditions at the moment of action — no hold, the
//! marker the plan saw, for `manual` the very approval the rotation was
//! claimed with (its marker names it) still naming its commit, the rotation's slot, and before a restart that must not
//! interrupt work a fresh probe of the agent — then writes the new marker, and
//! only then acts. The read a disruptive call is judged on is the last thing
//! before it (a restart's comes after its probe), and every such call is read
//! back after it; what that read finds, or cannot find, is reported as
//! [`Unfenced`]. A failed precondition is a typed [`Declined`], never an
//! error retried blindly. Once a lease refresh failed, the step makes no
//! further mutating call.
//!
//! Agents can write their app's metadata (docs/safety.md, "Threat model"):
//! every marker, probe-failure record (and its clear) and slot set is written
//! sealed with the record key ([`crate::metadata::seal`]), and on every
//! re-read only sealed markers, approvals and slot sets count — anything
//! else is foreign, and the step stops. An approval a rotation consumes is
//! first listed as spent on the coordinator (even when another replaced it
//! on the machine since), then deleted from the machine if still there, so
//! that writing it back approves nothing. A halt the planner detected
//! (`[release]`) is written sealed on the coordinator
//! ([`Executor::record_halt`]). Without the key it refuses to
//! be built when a pool acts.
//!
//! It is the only code that calls mutating Fly endpoints or an agent's
//! cooperative endpoints. It must never decide: when the world differs from
//! the plan it stops and lets the next sweep replan.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use secrecy::{ExposeSecret, SecretString};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::clock::SharedClock;
use crate::config::Config;
use crate::decide::planner::{self, RestartGuard, Step, StepKind, Target, Undrain};
use crate::decide::policy::Policy;
use crate::events::{ActionEvent, EventKind, EventRotation};
use crate::fly::{FlyClient, FlyError, Lease, Machine, WaitState};
use crate::metadata::controls::Trust;
use crate::metadata::marker::{Ending, Marker, Phase};
use crate::metadata::operator::{Approval, ApprovalId, ApprovalMode, SpentApprovals};
use crate::metadata::seal::RecordKeys;
use crate::metadata::slots::{Coordinator, Slot, SlotSet};
use crate::metadata::unprobed::{Cleared, Unprobed};
use crate::metadata::{
    APPROVE_KEY, COORDINATOR_HOLD_PREFIX, HOLD_KEY, MARKER_KEY, SLOTS_KEY, UNPROBED_KEY,
    coordinator_spent_key,
};
use crate::model::{AppName, CommitId, MachineId, MachineState, PolicyAction, PoolName, Severity};
use crate::observe::probe::{ProbeBuildError, ProbeOutcome, Prober};

/// Tuning of the executor; defaults follow flyctl (13 s lease, refreshed ~4 s).
#[derive(Clone, Debug)]
pub struct ExecutorConfig {
    pub lease_ttl: Duration,
    pub lease_refresh: Duration,
    /// How long a step keeps trying for the coordinator's lease (other
    /// claims, ours or another replica's, hold it for a few calls each).
    pub coordinator_patience: Duration,
    /// How long a restart step waits for `started` before leaving the rest
    /// to the verify deadline.
    pub start_wait: Duration,
    /// Steps carried out at once.
    pub concurrency: usize,
    /// This reconciler's identity (lease description, marker owner).
    pub owner: String,
    /// Where steps read the time (markers, events, deadlines re-checked).
    pub clock: SharedClock,
    /// The record keys: every marker and unprobed record is written sealed
    /// with them, and only sealed ones (and sealed approvals) are trusted on
    /// the re-reads before each call. Required when any pool acts.
    pub record_keys: Option<RecordKeys>,
}

impl ExecutorConfig {
    pub fn new(owner: &str) -> ExecutorConfig {
        ExecutorConfig {
            lease_ttl: Duration::from_secs(13),
            lease_refresh: Duration::from_secs(4),
            coordinator_patience: Duration::from_secs(10),
            start_wait: Duration::from_secs(30),
            concurrency: 16,
            owner: owner.to_string(),
            clock: crate::clock::system(),
            record_keys: None,
        }
    }
}

/// Why a step was not carried out, harmlessly: the world is not what the
/// plan assumed, and the next sweep replans from what it sees.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Declined {
    /// Fly's 409 says who holds it and until when.
    #[error("lease held by another actor: {message}")]
    Leased { message: String },
    #[error("Fly's rate limit refused a call; tried again next sweep")]
    RateLimited,
    #[error("marker changed since the plan (another reconciler acted)")]
    MarkerMoved,
    #[error("an operator put the machine on hold")]
    Held,
    #[error("no current approval names commit {target}{}", if *.interrupting { " with --now" } else { "" })]
    NotApproved {
        target: CommitId,
        interrupting: bool,
    },
    /// The approval on the machine is not the one the rotation was
    /// claimed with (replaced, revoked, or a consumed one written back).
    #[error(
        "the approval on the machine is not {}, the one the rotation was claimed with",
        .claimed.as_str()
    )]
    ApprovalReplaced { claimed: ApprovalId },
    #[error("the machine is {state}, not started")]
    NotStarted { state: MachineState },
    #[error("pool {pool} of {app} is at its cap of {cap}")]
    PoolFull {
        app: AppName,
        pool: PoolName,
        cap: usize,
    },
    #[error("the rotation holds no slot in the coordinator")]
    NoSlot,
    #[error("the coordinator {0} is leased by another actor")]
    CoordinatorBusy(String),
    #[error("no coordinator configured (rotation.coordinator)")]
    NoCoordinator,
    #[error("{0}")]
    SlotsUnreadable(String),
    #[error("{0}")]
    HostUnavailable(String),
    #[error("our lease could not be refreshed; stopped before the next call")]
    LeaseLost,
    #[error("fresh probe: {0}")]
    NotIdle(planner::NotIdle),
    /// A restart that must not interrupt work, and the fresh probe got no
    /// usable report to show the agent idle.
    #[error("fresh probe: no usable report")]
    NoUsableReport,
    #[error("fresh probe: the agent answers again ({0})")]
    AgentAnswers(planner::NotIdle),
    #[error("fresh probe: the agent already runs the target")]
    OnTarget,
    /// An unprobeable agent's restart, and Fly shows no failing health
    /// check: the machine serves as far as Fly can tell.
    #[error(
        "the agent gives no usable report but none of Fly's health checks fails; not restarted"
    )]
    FlyChecksPass,
    #[error("shutting down")]
    ShuttingDown,
    #[error(
        "the machine was updated from outside since the rotation recorded it (instance {recorded}, now {now})"
    )]
    UpdatedFromOutside { recorded: String, now: String },
    #[error(
        "the machine is {state} and its uncordon failed ({error}); its slot is released and the uncordon retried every sweep"
    )]
    UncordonRefused { state: MachineState, error: String },
}

/// How one step ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done as planned.
    Done,
    /// Not done, harmlessly (see [`Declined`]).
    Skipped(Declined),
    /// Tried and failed; the marker says where the rotation stands.
    Failed(Failure),
}

/// A call of a step that may have taken effect where nothing fenced it: the
/// two gaps of docs/safety.md that no check before a call can close. Each
/// is reported as an `action_unfenced` event, so that a human looks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unfenced {
    /// A hold was found on the machine after a disruptive call that the read
    /// before it had cleared: it landed within that round trip, so Fly may
    /// have carried out the call after the hold was written.
    HoldLanded { call: &'static str },
    /// The machine had another `instance_id` after a disruptive call than
    /// before it: an outside update (`fly deploy`) landed around the call,
    /// which may have acted on the new instance (a cordon or drain is
    /// undone at once).
    UpdatedAround { call: &'static str },
    /// A mutating call under a lease got no answer (timed out, or the
    /// connection broke after it was sent). Fly has no server-side deadline:
    /// it may carry the call out later, after the lease lapsed.
    Unanswered { lease: LeaseOf },
    /// The read after a disruptive call could not be made (the GET failed,
    /// or the host was unreachable and the metadata unknown): a hold that
    /// landed around the call cannot be ruled out. Unknown is never "none".
    ReadBackFailed { call: &'static str, why: String },
}

/// Whose lease fenced a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseOf {
    /// The machine's own (markers, cordon, restart).
    Machine,
    /// The coordinator's (the slot set).
    Coordinator,
}

impl std::fmt::Display for Unfenced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unfenced::HoldLanded { call } => write!(
                f,
                "a hold appeared on the machine around our {call} call: Fly may have carried it out after the hold was written; check the machine and the agent's work"
            ),
            Unfenced::UpdatedAround { call } => write!(
                f,
                "the machine was updated from outside (fly deploy?) around our {call} call, which may have landed on the new instance; a cordon or drain is undone at once, check the machine"
            ),
            Unfenced::ReadBackFailed { call, why } => write!(
                f,
                "the machine could not be read after our {call} call ({why}): a hold that landed around it would go unseen; check the machine's metadata and the agent's work"
            ),
            Unfenced::Unanswered {
                lease: LeaseOf::Machine,
            } => f.write_str(
                "a call under the machine's lease got no answer: Fly may carry it out after the lease lapsed; check the machine's metadata and state",
            ),
            Unfenced::Unanswered {
                lease: LeaseOf::Coordinator,
            } => f.write_str(
                "a slot-set write under the coordinator's lease got no answer: Fly may carry it out after the lease lapsed, over another replica's write; check the slots (`fleet-reconciler status`)",
            ),
        }
    }
}

/// What failed in a step that was tried: the Fly API or an agent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// A Fly API call: its bounded kind (`status`, `transport`, …) and the
    /// error, which names the app and machine.
    #[error("{error}")]
    Fly { kind: &'static str, error: String },
    /// A cooperative call to the agent.
    #[error(transparent)]
    Agent(AgentFailure),
}

/// A cooperative call to the agent that failed: the one text of it, for
/// the step's error, its outcome, log and event alike.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("agent {endpoint}: {why}")]
pub struct AgentFailure {
    pub endpoint: &'static str,
    pub why: String,
}

impl Outcome {
    /// Bounded label for metrics (`fleet_reconciler_actions_total{result}`).
    pub fn result(&self) -> &'static str {
        match self {
            Outcome::Done => "succeeded",
            Outcome::Skipped(_) => "skipped",
            Outcome::Failed(_) => "failed",
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Done => f.write_str("done"),
            Outcome::Skipped(why) => write!(f, "skipped: {why}"),
            Outcome::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

/// What happened to a step, for logs, metrics and notifications.
#[derive(Clone, Debug)]
pub struct StepReport {
    pub step: Step,
    pub outcome: Outcome,
    pub events: Vec<ActionEvent>,
}

#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Declined(#[from] Declined),
    #[error(transparent)]
    Fly(FlyError),
    #[error(transparent)]
    Agent(#[from] AgentFailure),
    /// A Fly call on the coordinator, answered for a whole batch of slot changes.
    #[error("{error}")]
    Coordinator { kind: &'static str, error: String },
}

impl From<FlyError> for StepError {
    /// A call the lease's validity stopped (it was not sent, or its retry
    /// would have gone past it) and one Fly's rate limit refused are not
    /// failures: nothing more was done, and the next sweep replans.
    fn from(e: FlyError) -> StepError {
        match e {
            FlyError::PastDeadline { .. } | FlyError::LeaseNonceChanged { .. } => {
                StepError::Declined(Declined::LeaseLost)
            }
            FlyError::RateLimited { .. } => StepError::Declined(Declined::RateLimited),
            e => StepError::Fly(e),
        }
    }
}

/// One change to the coordinator's slot set, queued for the next batch.
#[derive(Debug)]
enum SlotChange {
    Claim {
        app: AppName,
        pool: PoolName,
        slot: Slot,
        cap: usize,
        /// The claiming machine's lease: no slot is won for a step that can
        /// no longer act.
        lease: Validity,
    },
    Release {
        app: AppName,
        pool: PoolName,
        machine_id: MachineId,
        tag: String,
    },
}

/// Where a queued slot change gets its answer, and whether the batch's
/// slot-set write went unanswered.
type SlotReply = tokio::sync::oneshot::Sender<(SlotAnswer, bool)>;

/// How one queued slot change ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum SlotAnswer {
    Done,
    /// The pool is at its cap, after reclaiming what was stale.
    Full,
    Declined(Declined),
    Failed {
        kind: &'static str,
        error: String,
    },
}

impl From<StepError> for SlotAnswer {
    fn from(e: StepError) -> SlotAnswer {
        match e {
            StepError::Declined(d) => SlotAnswer::Declined(d),
            StepError::Fly(e) => SlotAnswer::Failed {
                kind: e.kind(),
                error: e.to_string(),
            },
            StepError::Coordinator { kind, error } => SlotAnswer::Failed { kind, error },
            StepError::Agent(a) => SlotAnswer::Failed {
                kind: "agent",
                error: a.to_string(),
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExecutorBuildError {
    #[error("cannot build the agent HTTP client: {0}")]
    Agents(#[from] reqwest::Error),
    #[error(transparent)]
    Probe(#[from] ProbeBuildError),
    #[error(
        "rotation.coordinator is not set: some pool acts on machines, and `run` needs the machine (APP/MACHINE_ID) whose lease and metadata keep the pools' rotation slots"
    )]
    NoCoordinator,
    #[error(transparent)]
    NoRecordKey(#[from] crate::config::RecordKeyError),
}

pub struct Executor {
    fly: FlyClient,
    agents: reqwest::Client,
    agent_timeout: Duration,
    prober: Prober,
    /// What the re-checks under a lease apply: the planner's own rules, the
    /// one policy of the config the daemon runs.
    policy: Arc<Policy>,
    /// `None` only when no pool acts (observe-only fleets need no slots).
    coordinator: Option<Coordinator>,
    /// The coordinator is in a swept app: only a sealed slot set is read.
    coordinator_exposed: bool,
    agent_tokens: HashMap<String, SecretString>,
    tuning: ExecutorConfig,
    /// Steps of this process take the coordinator's lease one at a time:
    /// they queue here instead of spending Fly API calls on 409s.
    coordinator_gate: tokio::sync::Mutex<()>,
    /// The latest read of the slot set and when it was sent, shared by the
    /// slot checks of concurrent steps.
    slots_read: tokio::sync::Mutex<Option<(Instant, CoordinatorRead)>>,
    /// Slot changes waiting for the next batch under the coordinator's lease.
    slot_queue: Mutex<Vec<(SlotChange, SlotReply)>>,
}

/// Whether a lease is still certainly ours; shared with its refresher.
#[derive(Clone, Debug)]
struct Validity {
    lost: CancellationToken,
    valid_until: Arc<Mutex<Instant>>,
}

impl Validity {
    fn valid(&self) -> bool {
        !self.lost.is_cancelled() && Instant::now() < self.until()
    }

    /// Until when a call may be sent under the lease.
    fn until(&self) -> Instant {
        *self
            .valid_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A lease we hold, kept alive by a refresher until released.
struct Held {
    app: AppName,
    machine_id: MachineId,
    nonce: SecretString,
    /// Lost once a refresh failed or the lease outlived its last refresh.
    validity: Validity,
    stop: CancellationToken,
    refresher: JoinHandle<()>,
    /// Raised by the client when a mutating call under this lease went unanswered.
    unanswered: Arc<AtomicBool>,
    /// The disruptive call made since the last read of the machine, if any.
    last_call: Mutex<Option<LastCall>>,
    /// The machine's `instance_id` on the last read of it.
    seen_instance: Mutex<Option<String>>,
    /// What this step may have done unfenced.
    unfenced: Mutex<Vec<Unfenced>>,
}

/// A disruptive call not yet followed by a read of the machine.
struct LastCall {
    call: &'static str,
    /// The instance the read before the call saw.
    instance: Option<String>,
    /// How to take the call back if it landed on a machine updated from
    /// outside meanwhile (whose marker may be gone, so nothing else would).
    undo: Option<Undo>,
}

enum Undo {
    Uncordon,
    Undrain { tag: String },
}

impl Held {
    /// Just before a disruptive call: until the next read of the machine, a
    /// hold or another instance found there may have come before the call
    /// took effect.
    fn calling(&self, call: &'static str, undo: Option<Undo>) {
        let instance = lock(&self.seen_instance).clone();
        *lock(&self.last_call) = Some(LastCall {
            call,
            instance,
            undo,
        });
    }

    fn note(&self, u: Unfenced) {
        let mut all = lock(&self.unfenced);
        if !all.contains(&u) {
            all.push(u);
        }
    }

    /// Everything noted, with an unanswered call under this lease.
    fn take_unfenced(&self, of: LeaseOf) -> Vec<Unfenced> {
        if self.unanswered.load(Ordering::SeqCst) {
            self.note(Unfenced::Unanswered { lease: of });
        }
        std::mem::take(&mut *lock(&self.unfenced))
    }

    /// Before every mutating call: is the lease still certainly ours?
    fn ensure(&self) -> Result<(), Declined> {
        if self.validity.valid() {
            Ok(())
        } else {
            Err(Declined::LeaseLost)
        }
    }

    fn nonce(&self) -> Option<&SecretString> {
        Some(&self.nonce)
    }

    fn validity(&self) -> Validity {
        self.validity.clone()
    }

    /// Until when a call may be sent under this lease.
    fn until(&self) -> Instant {
        self.validity.until()
    }
}

impl Executor {
    /// `policy`: the one built from `config` ([`Policy::from_config`]),
    /// shared with the planner. `agent_tokens`: app name → bearer token for
    /// its agents' cooperative endpoints.
    pub fn new(
        fly: FlyClient,
        config: Arc<Config>,
        policy: Arc<Policy>,
        agent_tokens: HashMap<String, SecretString>,
        tuning: ExecutorConfig,
    ) -> Result<Executor, ExecutorBuildError> {
        let coordinator = config.rotation.coordinator.clone();
        let coordinator_exposed = config.coordinator_exposed();
        if coordinator.is_none() && config.acts() {
            return Err(ExecutorBuildError::NoCoordinator);
        }
        if tuning.record_keys.is_none() && config.acts() {
            return Err(crate::config::RecordKeyError::Missing {
                var: config.records.key_env.clone(),
            }
            .into());
        }
        let agent_timeout = config.probe.timeout.get().max(Duration::from_secs(5));
        let agents = crate::http::client_builder()
            .timeout(agent_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let prober = Prober::new(&config.probe)?;
        Ok(Executor {
            fly,
            agents,
            agent_timeout,
            prober,
            policy,
            coordinator,
            coordinator_exposed,
            agent_tokens,
            tuning,
            coordinator_gate: tokio::sync::Mutex::new(()),
            slots_read: tokio::sync::Mutex::new(None),
            slot_queue: Mutex::new(Vec::new()),
        })
    }

    /// The policy this executor acts under: the loop that feeds it plans
    /// plans with the same one.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// How records are read and written: with the record keys (always, where a pool acts).
    fn trust(&self) -> Trust<'_> {
        Trust::of(self.tuning.record_keys.as_ref())
    }

    /// Writes `app`'s halt record on the coordinator, sealed: the planner
    /// detected the halt ([`crate::decide::halt`]). One key of its own, not
    /// under the coordinator's lease (behind this process's slot steps); a
    /// write that fails is tried again by the next sweep's plan, which
    /// keeps halting meanwhile.
    pub async fn record_halt(
        &self,
        app: &crate::model::AppName,
        record: &crate::metadata::halt::HaltRecord,
    ) -> Result<(), FlyError> {
        let Some(c) = &self.coordinator else {
            return Ok(());
        };
        let key = crate::metadata::halt::coordinator_halt_key(app.as_str());
        let value = self
            .trust()
            .seal(c.machine_id.as_str(), &key, &record.to_value());
        let _gate = self.coordinator_gate.lock().await;
        self.fly
            .set_metadata(&c.app, &c.machine_id, &key, &value, None)
            .await
    }

    /// The Fly client for a call under `lease`: nothing is sent, and nothing
    /// retried, past the lease's validity (a call that outlived its lease
    /// could land after someone else acted on the machine).
    fn bounded(&self, lease: &Held) -> FlyClient {
        self.fly
            .within(lease.until())
            .noting_unanswered(lease.unanswered.clone())
    }

    /// Carries out the steps (different machines concurrently) and reports each.
    pub async fn execute(&self, steps: Vec<Step>, shutdown: &CancellationToken) -> Vec<StepReport> {
        use futures::StreamExt;
        futures::stream::iter(steps)
            .map(|step| async move {
                let mut unfenced = Vec::new();
                let outcome = if shutdown.is_cancelled() {
                    Outcome::Skipped(Declined::ShuttingDown)
                } else {
                    match self.run(&step, shutdown, &mut unfenced).await {
                        Ok(()) => Outcome::Done,
                        Err(StepError::Declined(why)) => Outcome::Skipped(why),
                        Err(StepError::Fly(e)) => Outcome::Failed(Failure::Fly {
                            kind: e.kind(),
                            error: e.to_string(),
                        }),
                        Err(StepError::Agent(a)) => Outcome::Failed(Failure::Agent(a)),
                        Err(StepError::Coordinator { kind, error }) => {
                            Outcome::Failed(Failure::Fly { kind, error })
                        }
                    }
                };
                let now = self.tuning.clock.now();
                let mut events = events_for(&step, &outcome, now);
                log_step(&step, &outcome);
                for u in &unfenced {
                    let t = &step.target;
                    tracing::error!(app = %t.app, machine_id = %t.machine_id, step = step.kind(), "{step}: {u}");
                }
                events.extend(unfenced_events(&step, &unfenced, now));
                StepReport {
                    step,
                    outcome,
                    events,
                }
            })
            .buffer_unordered(self.tuning.concurrency.max(1))
            .collect()
            .await
    }

    async fn run(
        &self,
        step: &Step,
        shutdown: &CancellationToken,
        unfenced: &mut Vec<Unfenced>,
    ) -> Result<(), StepError> {
        let t = &step.target;
        let lease = self.acquire(&t.app, &t.machine_id).await?;
        let result = self.under_lease(step, &lease, shutdown).await;
        // The step's last disruptive call had no read after it; this is
        // its last chance.
        if let Some(why) = self.read_after_last_call(t, &lease).await
            && let Some(last) = lock(&lease.last_call).take()
        {
            lease.note(Unfenced::ReadBackFailed {
                call: last.call,
                why,
            });
        }
        unfenced.extend(lease.take_unfenced(LeaseOf::Machine));
        self.release(lease).await;
        result
    }

    /// One read after a disruptive call that no check followed (see
    /// [`Executor::read_back`]). When the GET fails, the call stays for a
    /// later read, and why is returned.
    async fn read_after_last_call(&self, t: &Target, lease: &Held) -> Option<String> {
        if lock(&lease.last_call).is_none() {
            return None;
        }
        match self.fly.get_machine(&t.app, &t.machine_id).await {
            Ok(m) => {
                self.read_back(t, lease, &m).await;
                None
            }
            Err(e) => Some(e.to_string()),
        }
    }

    /// Every read of the machine under a step's lease, against the
    /// disruptive call before it, if any. A hold found now landed around
    /// that call (holds written through `fleet-reconciler hold` take the
    /// lease, so they wait for our release and never show here). Another
    /// instance means an outside update (`fly deploy`) landed around it:
    /// the update restarted the machine, lifting our cordon and fence, and
    /// may have reverted our marker, so a cordon or drain that landed after
    /// it would be left with nothing to undo it; it is undone here, at once.
    async fn read_back(&self, t: &Target, lease: &Held, machine: &Machine) {
        *lock(&lease.seen_instance) = Some(machine.instance_id.clone());
        let Some(last) = lock(&lease.last_call).take() else {
            return;
        };
        match machine.known_metadata() {
            Ok(metadata) if metadata.contains_key(HOLD_KEY) => {
                lease.note(Unfenced::HoldLanded { call: last.call });
            }
            Ok(_) => {}
            // A host Fly cannot reach hides a hold that raced the call.
            Err(e) => lease.note(Unfenced::ReadBackFailed {
                call: last.call,
                why: e.to_string(),
            }),
        }
        if last
            .instance
            .as_deref()
            .is_some_and(|before| before != machine.instance_id)
        {
            lease.note(Unfenced::UpdatedAround { call: last.call });
            if let Some(undo) = last.undo {
                self.undo_raced(t, lease, undo).await;
            }
        }
    }

    /// Best effort: if it fails, the planner's undo of a rotation updated
    /// from outside (or the `action_unfenced` page) covers it.
    async fn undo_raced(&self, t: &Target, lease: &Held, undo: Undo) {
        let (what, result) = match undo {
            Undo::Uncordon => (
                "uncordon",
                self.bounded(lease)
                    .uncordon(&t.app, &t.machine_id, lease.nonce())
                    .await
                    .map_err(|e| e.to_string()),
            ),
            Undo::Undrain { tag } => (
                "undrain",
                self.agent_call(
                    t,
                    lease,
                    "overlay/undrain",
                    serde_json::json!({ "rotation": tag }),
                )
                .await
                .map_err(|e| e.to_string()),
            ),
        };
        match result {
            Ok(()) => {
                tracing::warn!(app = %t.app, machine_id = %t.machine_id, undo = what, "the machine was updated from outside around our call; undone")
            }
            Err(error) => {
                tracing::error!(app = %t.app, machine_id = %t.machine_id, undo = what, %error, "the machine was updated from outside around our call and the undo failed")
            }
        }
    }

    async fn under_lease(
        &self,
        step: &Step,
        lease: &Held,
        shutdown: &CancellationToken,
    ) -> Result<(), StepError> {
        let t = &step.target;
        let started = Instant::now();
        let mut w = Watch::of(step, lease);
        // The plan was made from a snapshot: act only on what is true now.
        let call = if step.needs_slot() {
            Call::Disruptive
        } else {
            Call::Write
        };
        let machine = self.check(&w, call).await?;
        self.not_held_on_coordinator(step, started).await?;
        match &step.kind {
            StepKind::Claim {
                marker,
                drain,
                reload,
            } => {
                self.claim(&mut w, step, marker, &machine, *drain, *reload)
                    .await
            }
            StepKind::Withdraw { .. } => self.withdraw(&w, step, &machine).await,
            StepKind::Advance { marker, cordon, .. } => {
                self.advance(&mut w, step, marker, *cordon).await
            }
            StepKind::Drain => {
                let Some(marker) = &step.expected else {
                    return Err(Declined::MarkerMoved.into());
                };
                self.verify_slot(t, &marker.tag).await?;
                self.drain(&w, marker).await
            }
            StepKind::Restart { marker, guard, .. } => {
                self.restart(&mut w, step, marker, *guard, &machine, shutdown)
                    .await
            }
            StepKind::Release {
                marker,
                undrain,
                clear_approval,
                ..
            } => {
                // Only the approval this rotation used is consumed: spent
                // on the coordinator whether or not it is still on the
                // machine, deleted only if it is (a newer one stays for the
                // next rotation).
                let consumed = clear_approval.then(|| consumption(self.trust(), &machine, marker));
                let undrain = match undrain {
                    Undrain::Needed => true,
                    Undrain::NotNeeded => undrain_anyway(step, &machine),
                    // The planner gave it up (alerted): asking again would
                    // fail every sweep and keep the slot forever.
                    Undrain::GivenUp => false,
                };
                // A cordon Fly shows is lifted even where the marker says none
                // was made (one that landed after an outside update).
                let uncordon = marker.may_have_cordoned() || machine.cordoned == Some(true);
                self.release_rotation(&mut w, step, marker, uncordon, undrain, consumed)
                    .await
            }
            StepKind::RecordUnprobed { record } => {
                let sealed =
                    self.trust()
                        .seal(t.machine_id.as_str(), UNPROBED_KEY, &record.to_value());
                self.write_unprobed(t, lease, Some(&sealed)).await
            }
            StepKind::ClearUnprobed => {
                // Ours is replaced by a sealed note naming it, so every
                // replica tells our clear from a deletion; anything else goes.
                let ours = machine
                    .metadata(UNPROBED_KEY)
                    .ok()
                    .flatten()
                    .and_then(|v| {
                        self.trust()
                            .open(t.machine_id.as_str(), UNPROBED_KEY, v)
                            .ok()
                    })
                    .and_then(|text| Unprobed::parse(&text));
                let cleared = ours.map(|record| {
                    let note = Cleared {
                        cleared: record.fingerprint(),
                    };
                    self.trust()
                        .seal(t.machine_id.as_str(), UNPROBED_KEY, &note.to_value())
                });
                self.write_unprobed(t, lease, cleared.as_deref()).await
            }
        }
    }

    /// The claim goes, and its slot if it won one. Our own cordon is never
    /// under a `claiming` marker, but one that landed after an outside update
    /// reverted the marker to the claim is (when its immediate undo failed):
    /// whenever Fly shows the machine cordoned it is uncordoned first, so
    /// the marker and the slot never go while a cordon stays.
    async fn withdraw(
        &self,
        w: &Watch<'_>,
        step: &Step,
        machine: &Machine,
    ) -> Result<(), StepError> {
        let (t, lease) = (w.t, w.lease);
        if machine.cordoned == Some(true) {
            lease.ensure()?;
            self.bounded(lease)
                .uncordon(&t.app, &t.machine_id, lease.nonce())
                .await?;
            self.check(w, Call::Write).await?;
        }
        lease.ensure()?;
        self.bounded(lease)
            .delete_metadata(&t.app, &t.machine_id, MARKER_KEY, lease.nonce())
            .await?;
        if let Some(m) = &step.expected {
            self.release_slot(t, &m.tag, lease).await;
        }
        Ok(())
    }

    /// Writes the probe-failure record (`value`), or deletes it (`None`).
    async fn write_unprobed(
        &self,
        t: &Target,
        lease: &Held,
        value: Option<&str>,
    ) -> Result<(), StepError> {
        lease.ensure()?;
        let fly = self.bounded(lease);
        let (app, id, nonce) = (&t.app, &t.machine_id, lease.nonce());
        match value {
            Some(v) => fly.set_metadata(app, id, UNPROBED_KEY, v, nonce).await?,
            None => fly.delete_metadata(app, id, UNPROBED_KEY, nonce).await?,
        }
        Ok(())
    }

    /// A marker's phase changes (with `cordon`, the machine is cordoned and,
    /// entering `draining`, asked to drain).
    async fn advance(
        &self,
        w: &mut Watch<'_>,
        step: &Step,
        marker: &Marker,
        cordon: bool,
    ) -> Result<(), StepError> {
        let (t, lease) = (w.t, w.lease);
        let (app, id, nonce) = (&t.app, &t.machine_id, lease.nonce());
        if cordon {
            self.verify_slot(t, &marker.tag).await?;
        }
        // A cordon re-asserted after a restart (Fly dropped it) leaves
        // the marker as it is.
        if step.expected.as_ref() != Some(marker) {
            self.write_marker(w, marker).await?;
        }
        if cordon {
            self.check(w, Call::Disruptive).await?;
            lease.ensure()?;
            lease.calling("cordon", Some(Undo::Uncordon));
            self.bounded(lease).cordon(app, id, nonce).await?;
            // Only a rotation entering `draining` asks for a drain: a
            // drain after the restart would fence the fresh agent.
            if marker.drain_requested && marker.phase == Phase::Draining {
                self.drain(w, marker).await?;
            }
        }
        Ok(())
    }

    /// The restart: cordoned, the marker written first, then the probe, then
    /// the read it is judged on as the last call before it (the marker is
    /// put back when it is declined, or when Fly's rate limit refuses it),
    /// then the wait for `started`.
    async fn restart(
        &self,
        w: &mut Watch<'_>,
        step: &Step,
        marker: &Marker,
        guard: RestartGuard,
        machine: &Machine,
        shutdown: &CancellationToken,
    ) -> Result<(), StepError> {
        let (t, lease) = (w.t, w.lease);
        let (app, id, nonce) = (&t.app, &t.machine_id, lease.nonce());
        let Some(expected) = &step.expected else {
            return Err(Declined::MarkerMoved.into());
        };
        self.verify_slot(t, &marker.tag).await?;
        // Cordoned first, so no new work arrives between the probe and the restart.
        if expected.may_have_cordoned() {
            self.check(w, Call::Disruptive).await?;
            lease.ensure()?;
            lease.calling("cordon", Some(Undo::Uncordon));
            self.bounded(lease).cordon(app, id, nonce).await?;
        }
        let mut marker = marker.clone();
        let now = self.tuning.clock.now();
        marker.restart_at = Some(now);
        marker.attempt_started_at = now;
        // A restart keeps the instance id; an update from outside
        // during the verify changes it.
        marker.instance_id = Some(machine.instance_id.clone());
        // Marker first: if we die between here and the restart, the next
        // reconciler waits out the verify deadline instead of restarting twice.
        self.check(w, Call::Write).await?;
        self.write_marker(w, &marker).await?;
        // The probe (seconds) comes first, then the read the restart is
        // judged on (the hold, the approval, Fly's checks): a hold can slip
        // in only within that one round trip, which the read after the
        // restart reports.
        let authorized = async {
            self.fresh_probe(t, expected, &marker.target, guard).await?;
            let need = if guard == RestartGuard::MayInterrupt {
                Call::Interrupting
            } else {
                Call::Disruptive
            };
            let now = self.check(w, need).await?;
            // The planner's rule, on this read: a failing Fly check.
            if guard == RestartGuard::Unprobeable
                && !crate::fly::MachineCheck::any_failing(&now.checks)
            {
                return Err(Declined::FlyChecksPass.into());
            }
            Ok::<(), StepError>(())
        }
        .await;
        if let Err(declined) = authorized {
            self.put_marker_back(w, expected).await;
            return Err(declined);
        }
        lease.ensure()?;
        // No timeout: Fly then waits the app's own kill_timeout (up to
        // 300 s) for the agent to checkpoint on its stop signal.
        lease.calling("restart", None);
        match self.bounded(lease).restart(app, id, None, nonce).await {
            Ok(()) => {}
            // Fly's rate limit refused it (every retry too): nothing
            // restarted, so neither the marker nor the read after it may
            // say one did.
            Err(FlyError::RateLimited { .. } | FlyError::Status { status: 429, .. }) => {
                lock(&lease.last_call).take();
                self.put_marker_back(w, expected).await;
                return Err(Declined::RateLimited.into());
            }
            Err(e) => return Err(e.into()),
        }
        // Read back at once, not after the wait for `started`: a hold
        // written later did not race the restart. If this read fails, the
        // step's last read tries again (and reports it if that fails too).
        let _ = self.read_after_last_call(t, lease).await;
        tokio::select! {
            _ = shutdown.cancelled() => Ok(()),
            r = self.fly.wait(app, id, WaitState::Started, self.tuning.start_wait) => match r {
                // Not started yet: the verify deadline covers it.
                Ok(()) | Err(FlyError::WaitTimeout { .. }) => Ok(()),
                Err(e) => Err(e.into()),
            },
        }
    }

    /// Nothing was restarted: puts the plan's marker back so the rotation is
    /// not taken for one that restarted. Best effort, judged like any call
    /// (not on a held machine): if it fails, the verify deadline only delays it.
    async fn put_marker_back(&self, w: &mut Watch<'_>, expected: &Marker) {
        let restored = async {
            self.check(w, Call::Write).await?;
            self.write_marker(w, expected).await
        }
        .await;
        if let Err(e) = restored {
            tracing::info!(app = %w.t.app, machine_id = %w.t.machine_id, error = %e, "could not restore the marker after a restart not carried out; the verify deadline covers it");
        }
    }

    /// Re-reads the machine just before a call and checks what the call
    /// needs. Fly does not fence metadata writes with leases: a hold, an
    /// approval change or another marker can land at any instant, so each
    /// call of a step is judged on a read made right before it, not on the
    /// read at the step's start.
    async fn check(&self, w: &Watch<'_>, call: Call) -> Result<Machine, StepError> {
        w.lease.ensure()?;
        let machine = self
            .bounded(w.lease)
            .get_machine(&w.t.app, &w.t.machine_id)
            .await?;
        self.read_back(w.t, w.lease, &machine).await;
        // A host Fly cannot reach hides the hold and the marker: unknown is
        // never read as "none".
        let metadata = machine
            .known_metadata()
            .map_err(|e| Declined::HostUnavailable(e.to_string()))?;
        if metadata.contains_key(HOLD_KEY) {
            return Err(Declined::Held.into());
        }
        let current = metadata
            .get(MARKER_KEY)
            .map(|v| open_marker(self.trust(), &w.t.machine_id, v));
        let unchanged = match (&w.marker, &current) {
            (None, None) => true,
            (Some(expected), Some(Some(now))) => expected == now,
            _ => false,
        };
        if !unchanged {
            return Err(Declined::MarkerMoved.into());
        }
        if call != Call::Write {
            // An outside update (`fly deploy`, `fly machine update`) since the
            // rotation recorded the machine: the plan is stale; the next
            // sweep judges the machine afresh. Undo calls still go on.
            if let Some(ours) = w.marker.as_ref().and_then(|m| m.instance_id.as_deref())
                && ours != machine.instance_id
            {
                return Err(Declined::UpdatedFromOutside {
                    recorded: ours.to_string(),
                    now: machine.instance_id.clone(),
                }
                .into());
            }
            if !machine.is_started() {
                return Err(Declined::NotStarted {
                    state: machine.state.clone(),
                }
                .into());
            }
            if let Some(authority) = &w.approval {
                approved(
                    self.trust(),
                    &machine,
                    authority,
                    call == Call::Interrupting,
                )?;
            }
            // The hold's authoritative copy too: an agent can delete the
            // machine's copy of a hold written while this step runs.
            if let Some(c) = self.coordinator.as_ref() {
                let read = self.coordinator_read_since(Instant::now()).await?;
                match read.held {
                    Some(held) if held.contains(w.t.machine_id.as_str()) => {
                        return Err(Declined::Held.into());
                    }
                    Some(_) => {}
                    None => {
                        return Err(Declined::SlotsUnreadable(format!(
                            "coordinator {c}: its host hides its metadata (its holds)"
                        ))
                        .into());
                    }
                }
            }
        }
        Ok(machine)
    }

    /// Intent (`claiming`), then the slot, then the first phase and the cordon.
    async fn claim(
        &self,
        w: &mut Watch<'_>,
        step: &Step,
        planned: &Marker,
        machine: &Machine,
        drain: bool,
        reload: bool,
    ) -> Result<(), StepError> {
        let (t, lease) = (w.t, w.lease);
        let now = self.tuning.clock.now();
        let mut marker = match &step.expected {
            // Our unfinished claim: its slot may already be won under its tag.
            Some(m) if m.phase == Phase::Claiming && m.tag == planned.tag => m.clone(),
            _ => {
                let mut m = planned.clone();
                m.phase = Phase::Claiming;
                m.started_at = now;
                m.attempt_started_at = now;
                m.cordoned = Some(false);
                // Read under the lease: a later update from outside shows
                // as another instance id.
                m.instance_id = Some(machine.instance_id.clone());
                self.write_marker(w, &m).await?;
                m
            }
        };
        match self.win_slot(t, &marker, lease).await {
            Ok(()) => {}
            Err(StepError::Declined(full @ Declined::PoolFull { .. })) => {
                // Nothing was cordoned: the intent simply goes (or, if that
                // fails, the next sweep withdraws it; it permits nothing).
                let withdrawn = async {
                    self.check(w, Call::Write).await?;
                    lease.ensure()?;
                    self.bounded(lease)
                        .delete_metadata(&t.app, &t.machine_id, MARKER_KEY, lease.nonce())
                        .await?;
                    Ok::<(), StepError>(())
                }
                .await;
                if let Err(e) = withdrawn {
                    tracing::warn!(app = %t.app, machine_id = %t.machine_id, error = %e, "could not withdraw a claim; the next sweep withdraws it");
                }
                return Err(full.into());
            }
            Err(e) => return Err(e),
        }
        let now = self.tuning.clock.now();
        marker.phase = if reload {
            Phase::Reloading
        } else {
            Phase::Draining
        };
        marker.started_at = now;
        marker.attempt_started_at = now;
        // Recorded before the cordon, so a cordon whose answer is lost is undone.
        marker.cordoned = Some(!reload);
        self.check(w, Call::Write).await?;
        self.write_marker(w, &marker).await?;
        self.check(w, Call::Disruptive).await?;
        if reload {
            lease.ensure()?;
            lease.calling("overlay/reload", None);
            self.agent_call(
                t,
                lease,
                "overlay/reload",
                serde_json::json!({ "ref": marker.target }),
            )
            .await
            .unwrap_or_else(|e| tracing::warn!(app = %t.app, machine_id = %t.machine_id, error = %e, "reload request failed; the verify deadline decides"));
            return Ok(());
        }
        lease.ensure()?;
        lease.calling("cordon", Some(Undo::Uncordon));
        self.bounded(w.lease)
            .cordon(&t.app, &t.machine_id, lease.nonce())
            .await?;
        if drain {
            // A failed drain POST is asked again by the next sweep.
            if let Err(e) = self.drain(w, &marker).await {
                tracing::warn!(app = %t.app, machine_id = %t.machine_id, error = %e, "drain request failed; asked again next sweep");
            }
        }
        Ok(())
    }

    /// Undo first (uncordon, undrain), recorded as `releasing`; then the
    /// ending; the slot goes last. A hold that lands meanwhile stops the
    /// undo where it stands (the marker says what is left).
    async fn release_rotation(
        &self,
        w: &mut Watch<'_>,
        step: &Step,
        marker: &Marker,
        uncordon: bool,
        undrain: bool,
        consumed: Option<Consumption>,
    ) -> Result<(), StepError> {
        let (t, lease) = (w.t, w.lease);
        let (app, id, nonce) = (&t.app, &t.machine_id, lease.nonce());
        if step.expected.as_ref() != Some(marker) {
            self.write_marker(w, marker).await?;
        }
        if uncordon {
            self.check(w, Call::Write).await?;
            lease.ensure()?;
            if let Err(e) = self.bounded(lease).uncordon(app, id, nonce).await {
                // A machine that stopped (autostop) while cordoned: whether
                // Fly uncordons a stopped machine is unknown. Its agent is
                // gone with its fence and it serves nothing, so the slot goes
                // now rather than starving the pool; the marker stays
                // `releasing` so the uncordon is retried every sweep, and the
                // planner alerts while it is cordoned without a slot.
                let now = self.check(w, Call::Write).await?;
                if !now.is_started() {
                    self.release_slot(t, &marker.tag, lease).await;
                    return Err(Declined::UncordonRefused {
                        state: now.state.clone(),
                        error: e.to_string(),
                    }
                    .into());
                }
                return Err(e.into());
            }
        }
        if undrain {
            self.check(w, Call::Write).await?;
            lease.ensure()?;
            self.agent_call(
                t,
                lease,
                "overlay/undrain",
                serde_json::json!({ "rotation": marker.tag }),
            )
            .await?;
        }
        if let Some(Consumption { spend, delete }) = consumed {
            // Spent on the coordinator first: a sealed approval written back
            // onto the machine later (its seal still verifies there) must
            // approve nothing, and a crash between the two leaves it spent.
            if let Some(approval) = spend {
                self.spend_approval(t, &approval).await?;
            }
            if delete {
                self.check(w, Call::Write).await?;
                lease.ensure()?;
                self.bounded(lease)
                    .delete_metadata(app, id, APPROVE_KEY, nonce)
                    .await?;
            }
        }
        match marker.ending.unwrap_or(Ending::Cancelled) {
            Ending::Yielded => {
                let mut yielded = marker.clone();
                yielded.phase = Phase::Yielded;
                yielded.ending = None;
                yielded.cordoned = Some(false);
                yielded.drain_requested = false;
                self.check(w, Call::Write).await?;
                self.write_marker(w, &yielded).await?;
            }
            Ending::Finished | Ending::Cancelled => {
                self.check(w, Call::Write).await?;
                lease.ensure()?;
                self.bounded(lease)
                    .delete_metadata(app, id, MARKER_KEY, nonce)
                    .await?;
            }
        }
        self.release_slot(t, &marker.tag, lease).await;
        Ok(())
    }

    /// A restart that must not interrupt work needs a fresh probe, made now.
    async fn fresh_probe(
        &self,
        t: &Target,
        marker: &Marker,
        target: &CommitId,
        guard: RestartGuard,
    ) -> Result<(), StepError> {
        let outcome = match t.health_url.as_deref() {
            Some(url) => self.prober.probe(url).await,
            None => ProbeOutcome::Unreachable("no health URL".into()),
        };
        let now = self.tuning.clock.now();
        match outcome {
            ProbeOutcome::Report(r) => {
                // The report may abbreviate the commit; a target is lowercase.
                let reported = r.overlay_ref.to_ascii_lowercase();
                if target.as_str().starts_with(&reported) {
                    return Err(Declined::OnTarget.into());
                }
                match guard {
                    RestartGuard::MayInterrupt => Ok(()),
                    RestartGuard::Idle => planner::restart_allowed(&self.policy, &r, marker, now)
                        .map_err(|why| Declined::NotIdle(why).into()),
                    RestartGuard::Unprobeable => {
                        planner::restart_allowed(&self.policy, &r, marker, now)
                            .map_err(|why| Declined::AgentAnswers(why).into())
                    }
                }
            }
            _ => match guard {
                RestartGuard::MayInterrupt | RestartGuard::Unprobeable => Ok(()),
                RestartGuard::Idle => Err(Declined::NoUsableReport.into()),
            },
        }
    }

    /// Asks the agent to drain: disruptive, so judged on a fresh read.
    async fn drain(&self, w: &Watch<'_>, marker: &Marker) -> Result<(), StepError> {
        self.check(w, Call::Disruptive).await?;
        w.lease.ensure()?;
        w.lease.calling(
            "overlay/drain",
            Some(Undo::Undrain {
                tag: marker.tag.clone(),
            }),
        );
        self.agent_call(
            w.t,
            w.lease,
            "overlay/drain",
            serde_json::json!({ "rotation": marker.tag }),
        )
        .await
    }

    /// Writes the marker; the watch then expects it on the machine.
    async fn write_marker(&self, w: &mut Watch<'_>, marker: &Marker) -> Result<(), StepError> {
        w.lease.ensure()?;
        let written = self
            .bounded(w.lease)
            .set_metadata(
                &w.t.app,
                &w.t.machine_id,
                MARKER_KEY,
                &self
                    .trust()
                    .seal(w.t.machine_id.as_str(), MARKER_KEY, &marker.to_value()),
                w.lease.nonce(),
            )
            .await;
        if written.is_ok() {
            w.marker = Some(marker.clone());
        }
        written.map_err(Into::into)
    }

    // ---- slots ---------------------------------------------------------------

    fn coordinator(&self) -> Result<&Coordinator, StepError> {
        self.coordinator
            .as_ref()
            .ok_or(StepError::Declined(Declined::NoCoordinator))
    }

    async fn read_slots(&self) -> Result<SlotSet, StepError> {
        let c = self.coordinator()?;
        let m = self.fly.get_machine(&c.app, &c.machine_id).await?;
        let unreadable = |e: String| Declined::SlotsUnreadable(format!("coordinator {c}: {e}"));
        // Unknown is not empty: an unreachable coordinator's set is unreadable.
        let value = m
            .metadata(SLOTS_KEY)
            .map_err(|e| unreadable(e.to_string()))?;
        SlotSet::open(self.trust(), c, value, self.coordinator_exposed)
            .map_err(|e| unreadable(e.to_string()).into())
    }

    /// The coordinator as read by a `GET` sent at or after `asked`: its
    /// slot set (or why it is unreadable) and the machines its holds name.
    /// Concurrent steps share reads: one read serves every step that asked
    /// before it was sent (Fly allows about 5 reads a second of one machine,
    /// and every step of a sweep checks the one coordinator).
    async fn coordinator_read_since(&self, asked: Instant) -> Result<CoordinatorRead, StepError> {
        let mut last = self.slots_read.lock().await;
        if let Some((sent, read)) = last.as_ref()
            && *sent >= asked
        {
            return Ok(read.clone());
        }
        let sent = Instant::now();
        let c = self.coordinator()?;
        let m = self.fly.get_machine(&c.app, &c.machine_id).await?;
        let unreadable = |e: String| Declined::SlotsUnreadable(format!("coordinator {c}: {e}"));
        let read = CoordinatorRead {
            slots: m
                .metadata(SLOTS_KEY)
                .map_err(|e| unreadable(e.to_string()))
                .and_then(|value| {
                    SlotSet::open(self.trust(), c, value, self.coordinator_exposed)
                        .map_err(|e| unreadable(e.to_string()))
                }),
            held: m.known_metadata().ok().map(|metadata| {
                metadata
                    .keys()
                    .filter_map(|k| k.strip_prefix(COORDINATOR_HOLD_PREFIX))
                    .map(str::to_string)
                    .collect()
            }),
        };
        *last = Some((sent, read.clone()));
        Ok(read)
    }

    /// The slot set as read by a `GET` sent at or after `asked` (shared: see
    /// [`Executor::coordinator_read_since`]).
    async fn slots_read_since(&self, asked: Instant) -> Result<SlotSet, StepError> {
        Ok(self.coordinator_read_since(asked).await?.slots?)
    }

    /// The hold's authoritative copy, read from the coordinator after the
    /// step took the machine's lease: an agent can delete the machine's copy
    /// between the plan and the step's first read of the machine, which
    /// alone would let a stale step act on a held machine. A coordinator
    /// that cannot be read stops a step that needs a slot (it could not
    /// verify its slot either); an undo or bookkeeping step goes on, judged
    /// on the machine's copy (docs/safety.md, "Threat model").
    async fn not_held_on_coordinator(&self, step: &Step, asked: Instant) -> Result<(), StepError> {
        if self.coordinator.is_none() {
            return Ok(());
        }
        match self.coordinator_read_since(asked).await {
            Ok(read) => match read.held {
                Some(held) if held.contains(step.target.machine_id.as_str()) => {
                    Err(Declined::Held.into())
                }
                Some(_) => Ok(()),
                None if step.needs_slot() => Err(Declined::SlotsUnreadable(
                    "the coordinator's host hides its metadata (its holds)".into(),
                )
                .into()),
                None => Ok(()),
            },
            Err(e) if step.needs_slot() => Err(e),
            Err(e) => {
                tracing::info!(app = %step.target.app, machine_id = %step.target.machine_id, error = %e, "the coordinator's holds could not be read; an undo step goes on, judged on the machine's hold");
                Ok(())
            }
        }
    }

    /// Before a disruptive call: the rotation's slot is still in the set.
    async fn verify_slot(&self, t: &Target, tag: &str) -> Result<(), StepError> {
        if self
            .slots_read_since(Instant::now())
            .await?
            .holds(&t.app, &t.pool, &t.machine_id, tag)
        {
            Ok(())
        } else {
            Err(Declined::NoSlot.into())
        }
    }

    /// Under the coordinator's lease: our slot, if the pool has room after
    /// reclaiming slots whose rotation is over. Batched with the other slot
    /// changes waiting at this instant (`change_slots`).
    async fn win_slot(&self, t: &Target, marker: &Marker, lease: &Held) -> Result<(), StepError> {
        let cap = self.policy.pool(&t.pool).max_concurrent_rotations.get() as usize;
        let slot = Slot {
            machine_id: t.machine_id.clone(),
            tag: marker.tag.clone(),
            owner: self.tuning.owner.clone(),
            since: self.tuning.clock.now(),
        };
        let change = SlotChange::Claim {
            app: t.app.clone(),
            pool: t.pool.clone(),
            slot,
            cap,
            lease: lease.validity(),
        };
        match self.change_slots(change, lease).await {
            SlotAnswer::Done => Ok(()),
            SlotAnswer::Full => Err(Declined::PoolFull {
                app: t.app.clone(),
                pool: t.pool.clone(),
                cap,
            }
            .into()),
            SlotAnswer::Declined(d) => Err(d.into()),
            SlotAnswer::Failed { kind, error } => Err(StepError::Coordinator { kind, error }),
        }
    }

    /// [`Executor::batched_slot_change`], noting on the step's `lease` a
    /// slot-set write that went unanswered.
    async fn change_slots(&self, change: SlotChange, lease: &Held) -> SlotAnswer {
        let (answer, unanswered) = self.batched_slot_change(change).await;
        if unanswered {
            lease.note(Unfenced::Unanswered {
                lease: LeaseOf::Coordinator,
            });
        }
        answer
    }

    /// Queues one slot change and waits for its answer. The first waiter
    /// takes the coordinator's lease and applies every queued change in one
    /// read-modify-write; the others get their answers from it. Fly allows
    /// about one lease call a second per machine, so one lease per batch,
    /// not per claim, is what lets a sweep claim more than a slot a second.
    /// Also says whether the batch's slot-set write went unanswered.
    async fn batched_slot_change(&self, change: SlotChange) -> (SlotAnswer, bool) {
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        self.slot_queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((change, tx));
        let _turn = self.coordinator_gate.lock().await;
        // A batch that ran while we waited for the turn may have answered us.
        if let Ok(answer) = rx.try_recv() {
            return answer;
        }
        let batch = std::mem::take(
            &mut *self
                .slot_queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let (changes, answers): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        let (results, unanswered) = self.apply_slot_changes(&changes).await;
        // Our own change makes any earlier shared read of the coordinator
        // stale (two instants of a paused test clock can be equal).
        *self.slots_read.lock().await = None;
        for (answer, result) in answers.into_iter().zip(results) {
            // A waiter that went away (shutdown) needs no answer.
            let _ = answer.send((result, unanswered));
        }
        rx.try_recv()
            .unwrap_or((SlotAnswer::Declined(Declined::ShuttingDown), false))
    }

    /// One coordinator lease, one read, one write for all `changes`; and
    /// whether that write went unanswered.
    async fn apply_slot_changes(&self, changes: &[SlotChange]) -> (Vec<SlotAnswer>, bool) {
        let all = |answer: SlotAnswer| vec![answer; changes.len()];
        let coordinator = match self.acquire_coordinator().await {
            Ok(held) => held,
            Err(e) => return (all(SlotAnswer::from(e)), false),
        };
        let answers = async {
            let mut set = match self.read_slots().await {
                Ok(set) => set,
                Err(e) => return all(SlotAnswer::from(e)),
            };
            let before = set.clone();
            let mut answers = Vec::with_capacity(changes.len());
            let mut reclaimed: HashSet<(AppName, PoolName)> = HashSet::new();
            for change in changes {
                answers.push(match change {
                    SlotChange::Release {
                        app,
                        pool,
                        machine_id,
                        tag,
                    } => {
                        set.remove(app, pool, machine_id, tag);
                        SlotAnswer::Done
                    }
                    // A claim whose machine lease lapsed while it waited makes
                    // no change: its step stops before its next call anyway.
                    SlotChange::Claim { lease, .. } if !lease.valid() => {
                        SlotAnswer::Declined(Declined::LeaseLost)
                    }
                    SlotChange::Claim {
                        app,
                        pool,
                        slot,
                        cap,
                        ..
                    } => {
                        let mut won = set.try_add(app, pool, slot.clone(), *cap);
                        if !won && reclaimed.insert((app.clone(), pool.clone())) {
                            for stale in self.stale_slots(app, set.slots(app, pool)).await {
                                set.remove(app, pool, &stale.machine_id, &stale.tag);
                            }
                            won = set.try_add(app, pool, slot.clone(), *cap);
                        }
                        if won {
                            SlotAnswer::Done
                        } else {
                            SlotAnswer::Full
                        }
                    }
                });
            }
            if set == before {
                return answers;
            }
            if let Err(e) = coordinator.ensure() {
                return all(SlotAnswer::Declined(e));
            }
            if let Err(e) = self.write_slots(&set, &coordinator).await {
                // The answer may be lost after the write took effect: look,
                // and keep only the answers the set now proves.
                let now = match self.read_slots().await {
                    Ok(now) => now,
                    Err(_) => return all(SlotAnswer::from(e)),
                };
                let failed = SlotAnswer::from(e);
                for (answer, change) in answers.iter_mut().zip(changes) {
                    let proven = match change {
                        SlotChange::Claim {
                            app, pool, slot, ..
                        } => now.holds(app, pool, &slot.machine_id, &slot.tag),
                        SlotChange::Release {
                            app,
                            pool,
                            machine_id,
                            tag,
                        } => !now.holds(app, pool, machine_id, tag),
                    };
                    if *answer == SlotAnswer::Done && !proven {
                        *answer = failed.clone();
                    }
                }
            }
            answers
        }
        .await;
        let unanswered = coordinator.unanswered.load(Ordering::SeqCst);
        self.release(coordinator).await;
        (answers, unanswered)
    }

    /// Slots whose machine carries no marker with the slot's tag that still
    /// needs it. Anything unreadable counts as live (fail closed).
    async fn stale_slots(&self, app: &AppName, slots: &[Slot]) -> Vec<Slot> {
        let mut stale = Vec::new();
        for slot in slots {
            let live = match self.fly.get_machine(app, &slot.machine_id).await {
                Err(FlyError::NotFound { .. }) => false,
                Err(_) => true,
                Ok(m) => match m
                    .metadata(MARKER_KEY)
                    .map(|v| v.map(|v| open_marker(self.trust(), &slot.machine_id, v)))
                {
                    // Its host is unreachable: the marker may be there.
                    Err(_) => true,
                    // Cordoned with its marker gone (an outside update
                    // reverted it around our cordon): capacity is out.
                    Ok(None) => m.cordoned == Some(true),
                    Ok(Some(None)) => true,
                    Ok(Some(Some(marker))) => {
                        marker.tag == slot.tag
                            && (marker.phase.holds_slot() || marker.phase == Phase::Claiming)
                    }
                },
            };
            if !live {
                stale.push(slot.clone());
            }
        }
        stale
    }

    /// Adds `approval` to the coordinator's list of approvals consumed on
    /// `t`'s machine, under the coordinator's lease (docs/safety.md,
    /// "Threat model": a consumed approval cannot be reused).
    async fn spend_approval(&self, t: &Target, approval: &ApprovalId) -> Result<(), StepError> {
        // No coordinator (configured away mid-rotation): nowhere out of the
        // agents' reach to keep the list, and no rotation can claim a slot
        // to use the approval again either.
        let Some(c) = self.coordinator.as_ref() else {
            return Ok(());
        };
        let key = coordinator_spent_key(t.machine_id.as_str());
        // One coordinator lease per process at a time (slot batches take it too).
        let _turn = self.coordinator_gate.lock().await;
        let coordinator = self.acquire_coordinator().await?;
        let result = async {
            let m = self.fly.get_machine(&c.app, &c.machine_id).await?;
            let value = m.metadata(&key).map_err(|e| {
                Declined::SlotsUnreadable(format!("coordinator {c}: key {key}: {e}"))
            })?;
            let spent = value
                .and_then(|v| SpentApprovals::parse(&Trust::AsWritten.open("", "", v).ok()?))
                .unwrap_or_default();
            if spent.contains(approval) {
                return Ok(());
            }
            let sealed = self.trust().seal(
                c.machine_id.as_str(),
                &key,
                &spent.with(approval.clone()).to_value(),
            );
            coordinator.ensure()?;
            self.bounded(&coordinator)
                .set_metadata(&c.app, &c.machine_id, &key, &sealed, coordinator.nonce())
                .await?;
            Ok(())
        }
        .await;
        self.release(coordinator).await;
        result
    }

    /// Best effort: a slot left behind is reclaimed by the next claim that needs it.
    async fn release_slot(&self, t: &Target, tag: &str, lease: &Held) {
        let change = SlotChange::Release {
            app: t.app.clone(),
            pool: t.pool.clone(),
            machine_id: t.machine_id.clone(),
            tag: tag.to_string(),
        };
        match self.change_slots(change, lease).await {
            SlotAnswer::Done => {}
            other => {
                tracing::info!(app = %t.app, machine_id = %t.machine_id, error = ?other, "slot not released now; the next claim that needs it reclaims it")
            }
        }
    }

    async fn write_slots(&self, set: &SlotSet, coordinator: &Held) -> Result<(), StepError> {
        let c = self.coordinator()?;
        self.bounded(coordinator)
            .set_metadata(
                &c.app,
                &c.machine_id,
                SLOTS_KEY,
                &set.to_sealed_value(self.trust(), c),
                coordinator.nonce(),
            )
            .await
            .map_err(Into::into)
    }

    async fn acquire_coordinator(&self) -> Result<Held, StepError> {
        let c = self.coordinator()?;
        let give_up = Instant::now() + self.tuning.coordinator_patience;
        loop {
            match self.acquire(&c.app, &c.machine_id).await {
                Ok(held) => return Ok(held),
                Err(StepError::Declined(Declined::Leased { .. })) if Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(50..300))).await;
                }
                Err(StepError::Declined(Declined::Leased { .. })) => {
                    return Err(Declined::CoordinatorBusy(c.to_string()).into());
                }
                Err(e) => return Err(e),
            }
        }
    }

    // ---- leases --------------------------------------------------------------

    async fn acquire(&self, app: &AppName, machine_id: &MachineId) -> Result<Held, StepError> {
        let description = format!("fleet-reconciler {}", self.tuning.owner);
        let started = Instant::now();
        let lease: Lease = match self
            .fly
            .acquire_lease(app, machine_id, self.tuning.lease_ttl, &description)
            .await
        {
            Ok(lease) => lease,
            Err(FlyError::LeaseConflict { message, .. }) => {
                return Err(Declined::Leased { message }.into());
            }
            // Fly's per-machine limit: nothing was done, the next sweep tries again.
            Err(FlyError::RateLimited { .. } | FlyError::Status { status: 429, .. }) => {
                return Err(Declined::RateLimited.into());
            }
            Err(e) => return Err(e.into()),
        };
        // Counted from before the request: the TTL may have started then.
        let margin = self.tuning.lease_ttl / 4;
        let validity = Validity {
            lost: CancellationToken::new(),
            valid_until: Arc::new(Mutex::new(started + self.tuning.lease_ttl - margin)),
        };
        let stop = CancellationToken::new();
        let refresher = {
            let (fly, app, id, nonce) = (
                self.fly.clone(),
                app.clone(),
                machine_id.clone(),
                lease.nonce.clone(),
            );
            let (ttl, every) = (self.tuning.lease_ttl, self.tuning.lease_refresh);
            let (stop, validity) = (stop.clone(), validity.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(every) => {}
                    }
                    // Checked again: a refresh must never start after release began.
                    if stop.is_cancelled() {
                        return;
                    }
                    let sent = Instant::now();
                    // Not sent, nor retried, once the lease may have lapsed:
                    // on a machine nobody leases, a refresh may take a new
                    // lease, hiding that someone else held it in between.
                    match fly
                        .within(validity.until())
                        .refresh_lease(&app, &id, &nonce, ttl, &description)
                        .await
                    {
                        Ok(_) => {
                            *validity
                                .valid_until
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                                sent + ttl - margin;
                        }
                        Err(e) => {
                            tracing::warn!(app = %app, machine_id = %id, error = %e, "lease refresh failed; the step stops before its next call");
                            validity.lost.cancel();
                            return;
                        }
                    }
                }
            })
        };
        Ok(Held {
            app: app.clone(),
            machine_id: machine_id.clone(),
            nonce: lease.nonce,
            validity,
            stop,
            refresher,
            unanswered: Arc::new(AtomicBool::new(false)),
            last_call: Mutex::new(None),
            seen_instance: Mutex::new(None),
            unfenced: Mutex::new(Vec::new()),
        })
    }

    /// Stops the refresher and waits for it, so no refresh can land after the
    /// release (a refresh of a released lease would take a new one), then releases.
    async fn release(&self, held: Held) {
        held.stop.cancel();
        let _ = held.refresher.await;
        // Released on every path; a failure here only means it expires by itself.
        if let Err(e) = self
            .fly
            .release_lease(&held.app, &held.machine_id, &held.nonce)
            .await
        {
            tracing::warn!(app = %held.app, machine_id = %held.machine_id, error = %e, "lease release failed; it expires with its TTL");
        }
    }

    /// POSTs to an agent's cooperative endpoint.
    async fn agent_call(
        &self,
        t: &Target,
        lease: &Held,
        endpoint: &'static str,
        body: serde_json::Value,
    ) -> Result<(), StepError> {
        let fail = |why: String| StepError::Agent(AgentFailure { endpoint, why });
        let url = t
            .health_url
            .as_deref()
            .and_then(|h| url::Url::parse(h).ok())
            // RFC 3986: relative to the health URL, so /x/health → /x/overlay/drain.
            .and_then(|h| h.join(endpoint).ok())
            .ok_or_else(|| fail("no health URL to reach the agent".into()))?;
        // Bounded by the lease like every call of a step: a drain or a
        // reload sent after it lapsed could race whoever acts next.
        let left = lease.until().saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(StepError::Declined(Declined::LeaseLost));
        }
        let mut req = self
            .agents
            .post(url)
            .json(&body)
            .timeout(left.min(self.agent_timeout));
        if let Some(token) = self.agent_tokens.get(t.app.as_str()) {
            req = req.bearer_auth(token.expose_secret());
        }
        match req.send().await {
            Ok(r) if r.status().is_success() => {
                tracing::info!(app = %t.app, machine_id = %t.machine_id, endpoint, "agent accepted");
                Ok(())
            }
            Ok(r) => Err(fail(format!("refused with HTTP {}", r.status().as_u16()))),
            Err(e) => Err(fail(crate::http::describe(&e))),
        }
    }
}

/// The machine's approval text, when it is one we trust (sealed for it).
fn open_approval(trust: Trust<'_>, machine: &Machine) -> Option<String> {
    let value = machine.metadata(APPROVE_KEY).ok().flatten()?;
    trust.open(&machine.id, APPROVE_KEY, value).ok()
}

/// The machine's marker, when it is one of ours: readable and sealed for it.
/// Anything else is foreign (`None`).
fn open_marker(trust: Trust<'_>, machine_id: &MachineId, value: &str) -> Option<Marker> {
    Marker::parse(&trust.open(machine_id.as_str(), MARKER_KEY, value).ok()?)
}

/// For `manual` rotations: the approval must still stand and name the
/// commit, and say `now` where the call may interrupt live work. Where the
/// rotation names the approval it was claimed with (`claimed`), it must be
/// that very one: another sealed approval of the same commit — a consumed
/// one an agent wrote back, or one an operator issued since — authorizes
/// nothing for this rotation (the planner cancels it, and the next claim is
/// judged on the approval then standing).
fn approved(
    trust: Trust<'_>,
    machine: &Machine,
    authority: &Authority,
    interrupting: bool,
) -> Result<(), Declined> {
    let text = open_approval(trust, machine);
    if let Some(claimed) = &authority.approval
        && text.as_deref().map(ApprovalId::of).as_ref() != Some(claimed)
    {
        return Err(Declined::ApprovalReplaced {
            claimed: claimed.clone(),
        });
    }
    text.and_then(|text| Approval::parse(&text))
        .filter(|a| a.approves(&authority.target))
        .filter(|a| !interrupting || a.mode == ApprovalMode::Now)
        .map(drop)
        .ok_or_else(|| Declined::NotApproved {
            target: authority.target.clone(),
            interrupting,
        })
}

/// Whether the approval on the machine is the one `marker`'s rotation used
/// (its fingerprint), so that consuming it leaves a newer one alone.
/// Markers naming none (older versions): an approval of their commit.
fn stands_approval_of(trust: Trust<'_>, machine: &Machine, marker: &Marker) -> bool {
    match &marker.approval {
        Some(id) => open_approval(trust, machine).is_some_and(|v| ApprovalId::of(&v) == *id),
        None => approved(
            trust,
            machine,
            &Authority {
                target: marker.target.clone(),
                approval: None,
            },
            false,
        )
        .is_ok(),
    }
}

/// One read of the coordinator, shared by the steps that need it.
#[derive(Clone, Debug)]
struct CoordinatorRead {
    slots: Result<SlotSet, Declined>,
    /// The machines whose hold's authoritative copy it carries; `None`
    /// when its host hides its metadata.
    held: Option<std::collections::BTreeSet<String>>,
}

/// What a rotation's end does with the approval it used.
#[derive(Debug, PartialEq, Eq)]
struct Consumption {
    /// Listed as spent on the coordinator.
    spend: Option<ApprovalId>,
    /// Deleted from the machine: it is still the approval there.
    delete: bool,
}

/// The approval `marker`'s rotation used, as the machine read under the
/// lease shows it: the one the marker names is spent even if another has
/// replaced it; a marker naming none (older versions) spends the approval
/// of its commit on the machine, if any.
fn consumption(trust: Trust<'_>, machine: &Machine, marker: &Marker) -> Consumption {
    let delete = stands_approval_of(trust, machine, marker);
    let spend = match &marker.approval {
        Some(id) => Some(id.clone()),
        None if delete => open_approval(trust, machine).map(|v| ApprovalId::of(&v)),
        None => None,
    };
    Consumption { spend, delete }
}

/// What each call of one step re-checks on a fresh read of the machine.
struct Watch<'a> {
    t: &'a Target,
    lease: &'a Held,
    /// The marker the machine must carry: the plan's, then each one we wrote.
    marker: Option<Marker>,
    /// A `manual` rotation's commit and approval, which must stand.
    approval: Option<Authority>,
}

/// What authorizes a `manual` rotation: an approval of its commit, and
/// where its marker names one, exactly that approval.
struct Authority {
    target: CommitId,
    /// `None` for markers of versions that named none.
    approval: Option<ApprovalId>,
}

impl<'a> Watch<'a> {
    /// What `step` expects of its machine at first: the plan's marker, and
    /// for a `manual` rotation the approval it was claimed with.
    fn of(step: &'a Step, lease: &'a Held) -> Watch<'a> {
        Watch {
            t: &step.target,
            lease,
            marker: step.expected.clone(),
            approval: step
                .new_marker()
                .or(step.expected.as_ref())
                .filter(|m| m.action == PolicyAction::Manual)
                .map(|m| Authority {
                    target: m.target.clone(),
                    approval: m.approval.clone(),
                }),
        }
    }
}

/// A drain may have been requested after the snapshot the plan saw (a lost
/// answer, another replica's retry): judged here, under the lease, undrain
/// whenever the marker says one may have been asked of an agent that still
/// runs. Never applied to an undrain the planner gave up ([`Undrain::GivenUp`]).
fn undrain_anyway(step: &Step, machine: &Machine) -> bool {
    step.expected
        .as_ref()
        .is_some_and(|e| e.drain_requested && e.phase != Phase::Yielded && machine.is_started())
}

/// What the next call of a step needs of the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// A marker or metadata write, an uncordon, an undrain: no hold and the
    /// marker we expect.
    Write,
    /// A cordon, a drain, a restart of an idle agent: also `started`, and
    /// for a `manual` rotation an approval of its commit.
    Disruptive,
    /// A restart that may interrupt live work: for a `manual` rotation the
    /// approval must say `now`.
    Interrupting,
}

fn log_step(step: &Step, outcome: &Outcome) {
    let t = &step.target;
    let marker = step.new_marker().or(step.expected.as_ref());
    let commit = marker.map(|m| m.target.as_str()).unwrap_or("");
    let severity = marker.map(|m| m.severity.as_str()).unwrap_or("");
    match outcome {
        Outcome::Done => {
            tracing::info!(app = %t.app, machine_id = %t.machine_id, pool = %t.pool, commit, severity, step = step.kind(), "{step}")
        }
        Outcome::Skipped(why) => {
            tracing::info!(app = %t.app, machine_id = %t.machine_id, pool = %t.pool, commit, severity, step = step.kind(), reason = %why, "skipped: {step}")
        }
        Outcome::Failed(why) => {
            tracing::warn!(app = %t.app, machine_id = %t.machine_id, pool = %t.pool, commit, severity, step = step.kind(), error = %why, "failed: {step}")
        }
    }
}

/// An `action_unfenced` event for each thing a step may have done unfenced,
/// at least at `high`: it asks a human to look, whatever the drift's
/// severity. A step of no rotation (the probe-failure record) names none:
/// no target, no action.
fn unfenced_events(step: &Step, unfenced: &[Unfenced], at: DateTime<Utc>) -> Vec<ActionEvent> {
    let t = &step.target;
    let marker = step.new_marker().or(step.expected.as_ref());
    unfenced
        .iter()
        .map(|u| ActionEvent {
            kind: EventKind::ActionUnfenced,
            app: t.app.clone(),
            machine_id: t.machine_id.clone(),
            rotation: marker.map(rotation_of),
            severity: marker.map_or(Severity::High, |m| m.severity.max(Severity::High)),
            summary: format!("{step} on {}: {u}", t.machine_id),
            at,
        })
        .collect()
}

fn rotation_of(marker: &Marker) -> EventRotation {
    EventRotation {
        commit: marker.target.clone(),
        action: marker.action,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One-shot events: a claim starts an action, a finish ends it, a failure fails it.
fn events_for(step: &Step, outcome: &Outcome, at: DateTime<Utc>) -> Vec<ActionEvent> {
    let Some(marker) = step.new_marker().or(step.expected.as_ref()) else {
        return Vec::new();
    };
    let t = &step.target;
    let event = |kind, summary: String| ActionEvent {
        kind,
        app: t.app.clone(),
        machine_id: t.machine_id.clone(),
        rotation: Some(rotation_of(marker)),
        severity: marker.severity,
        summary,
        at,
    };
    match (outcome, &step.kind) {
        (Outcome::Failed(why), _) => vec![event(
            EventKind::ActionFailed,
            format!("{step} failed: {why}"),
        )],
        (Outcome::Done, StepKind::Claim { .. } | StepKind::Restart { .. }) => {
            vec![event(EventKind::ActionStarted, step.to_string())]
        }
        (Outcome::Done, StepKind::Release { marker, .. })
            if marker.ending == Some(Ending::Finished) =>
        {
            vec![event(
                EventKind::ActionSucceeded,
                format!(
                    "{} now runs the release tip; rotation finished",
                    t.machine_id
                ),
            )]
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The re-read before each call of a `manual` rotation trusts only an
    /// approval sealed for this machine: one an agent swapped in (unsigned,
    /// or another machine's sealed one) approves nothing, so the restart is
    /// declined even if the plan was made on a real approval.
    #[test]
    fn only_a_sealed_approval_of_this_machine_stands_under_the_lease() {
        use crate::metadata::seal::{RecordKey, RecordKeys};
        let keys = RecordKeys::new(RecordKey::from_hex(&"42".repeat(32)).unwrap());
        let target = CommitId::parse(&"a".repeat(40)).unwrap();
        let approval = serde_json::to_string(&Approval {
            target: target.clone(),
            mode: ApprovalMode::Now,
            by: "ops".into(),
            at: chrono::DateTime::UNIX_EPOCH,
        })
        .unwrap();
        let machine = |value: &str| -> Machine {
            serde_json::from_value(serde_json::json!({
                "id": "m1",
                "instance_id": "i1",
                "config": { "metadata": { APPROVE_KEY: value } },
            }))
            .unwrap()
        };
        let trust = Trust::Verify(&keys);
        let sealed = keys.seal("m1", APPROVE_KEY, &approval);
        let of_commit = Authority {
            target: target.clone(),
            approval: None,
        };
        assert_eq!(approved(trust, &machine(&sealed), &of_commit, true), Ok(()));
        for forged in [approval.clone(), keys.seal("m2", APPROVE_KEY, &approval)] {
            assert!(
                approved(trust, &machine(&forged), &of_commit, true).is_err(),
                "{forged}"
            );
        }
    }

    /// The record keys, target and `now` approvals of the approval tests.
    fn test_keys() -> crate::metadata::seal::RecordKeys {
        use crate::metadata::seal::{RecordKey, RecordKeys};
        RecordKeys::new(RecordKey::from_hex(&"42".repeat(32)).unwrap())
    }

    fn test_target() -> CommitId {
        CommitId::parse(&"a".repeat(40)).unwrap()
    }

    /// An operator's `now` approval of `target`, issued at `secs`.
    fn now_approval(target: &CommitId, secs: i64) -> String {
        serde_json::to_string(&Approval {
            target: target.clone(),
            mode: ApprovalMode::Now,
            by: "ops".into(),
            at: chrono::DateTime::from_timestamp(secs, 0).unwrap_or_default(),
        })
        .unwrap()
    }

    /// A rotation that names its approval is authorized by that one only:
    /// another sealed approval of the same commit and mode on the machine (a
    /// consumed one written back, a newer one) is declined, naming the one
    /// claimed with; the claimed one passes.
    #[test]
    fn only_the_approval_a_rotation_was_claimed_with_authorizes_its_calls() {
        let (keys, target) = (test_keys(), test_target());
        let approval = |secs: i64| now_approval(&target, secs);
        let machine = |value: &str| -> Machine {
            serde_json::from_value(serde_json::json!({
                "id": "m1",
                "instance_id": "i1",
                "config": { "metadata": { APPROVE_KEY: keys.seal("m1", APPROVE_KEY, value) } },
            }))
            .unwrap()
        };
        let (claimed, other) = (approval(1), approval(2));
        let authority = Authority {
            target: target.clone(),
            approval: Some(ApprovalId::of(&claimed)),
        };
        let trust = Trust::Verify(&keys);
        assert_eq!(
            approved(trust, &machine(&claimed), &authority, true),
            Ok(())
        );
        assert_eq!(
            approved(trust, &machine(&other), &authority, false),
            Err(Declined::ApprovalReplaced {
                claimed: ApprovalId::of(&claimed)
            })
        );
    }

    /// A rotation's end spends the approval its marker names whether or not
    /// it is still on the machine, and deletes it only if it is (a newer one
    /// stays); a marker naming none spends and deletes an approval of its
    /// commit, and nothing else.
    #[test]
    fn consumption_spends_the_named_approval_and_deletes_only_it() {
        let (keys, target) = (test_keys(), test_target());
        let approval = |secs: i64| now_approval(&target, secs);
        let machine = |value: Option<&str>| -> Machine {
            let metadata = match value {
                Some(v) => serde_json::json!({ APPROVE_KEY: keys.seal("m1", APPROVE_KEY, v) }),
                None => serde_json::json!({}),
            };
            serde_json::from_value(serde_json::json!({
                "id": "m1",
                "instance_id": "i1",
                "config": { "metadata": metadata },
            }))
            .unwrap()
        };
        let (used, newer) = (approval(1), approval(2));
        let marker = |named: Option<&str>| {
            Marker {
            approval: named.map(ApprovalId::of),
            ..Marker::parse(&format!(
                r#"{{"tag":"t","target":"{target}","phase":"releasing","mode":"now","action":"manual","severity":"high","started_at":"2026-01-01T00:00:00Z","attempt_started_at":"2026-01-01T00:00:00Z","owner":"r"}}"#
            ))
            .unwrap()
        }
        };
        let trust = Trust::Verify(&keys);
        let spent = |v: &str| Some(ApprovalId::of(v));
        let named = marker(Some(&used));
        assert_eq!(
            consumption(trust, &machine(Some(&used)), &named),
            Consumption {
                spend: spent(&used),
                delete: true
            }
        );
        for other in [machine(Some(&newer)), machine(None)] {
            assert_eq!(
                consumption(trust, &other, &named),
                Consumption {
                    spend: spent(&used),
                    delete: false
                }
            );
        }
        let legacy = marker(None);
        assert_eq!(
            consumption(trust, &machine(Some(&newer)), &legacy),
            Consumption {
                spend: spent(&newer),
                delete: true
            }
        );
        assert_eq!(
            consumption(trust, &machine(None), &legacy),
            Consumption {
                spend: None,
                delete: false
            }
        );
    }

    /// A step of no rotation that may have landed unfenced pages at `high`
    /// and names no rotation (before: commit `""` and action `manual`).
    #[test]
    fn an_unfenced_step_of_no_rotation_names_none() {
        let step = Step {
            target: Target {
                app: "agents".into(),
                machine_id: "m1".into(),
                pool: "default".into(),
                health_url: None,
            },
            expected: None,
            kind: StepKind::ClearUnprobed,
        };
        let at = chrono::DateTime::UNIX_EPOCH;
        let unanswered = Unfenced::Unanswered {
            lease: LeaseOf::Machine,
        };
        let events = unfenced_events(&step, &[unanswered], at);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].kind, EventKind::ActionUnfenced);
        assert_eq!(events[0].rotation, None);
        assert_eq!(events[0].severity, Severity::High);
    }

    /// The step's error and the outcome it becomes say the same thing.
    #[test]
    fn an_agent_failure_reads_the_same_as_error_and_outcome() {
        let a = AgentFailure {
            endpoint: "overlay/drain",
            why: "503 Service Unavailable".into(),
        };
        let text = "agent overlay/drain: 503 Service Unavailable";
        assert_eq!(StepError::from(a.clone()).to_string(), text);
        assert_eq!(Failure::Agent(a.clone()).to_string(), text);
        assert_eq!(
            Outcome::Failed(Failure::Agent(a)).to_string(),
            format!("failed: {text}")
        );
    }
}

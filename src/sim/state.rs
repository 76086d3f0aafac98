//! The simulator's mutable world: machines, leases, agents, injected faults and the request log.
//!
//! Everything lives behind one `std::sync::Mutex` that is never held across an
//! `.await`: handlers lock, decide, unlock, and only then wait or stream.
//! State changes that take time (restart, stop, start, reload) are spawned
//! tasks that re-lock when their delay is over; a per-machine `generation`
//! makes a superseded task (a stop during a restart) a no-op.
//!
//! Chaos draws and the safety audit live here too, so that a fault decision
//! and an audit entry are taken under the same lock as the change they
//! concern: the audit can never see a state the handlers did not produce.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::clock::SharedClock;

use super::audit::AuditState;
use super::chaos::ChaosState;
use super::fixture::{
    Behaviour, CAP_DRAIN, CheckStatus, HostDownMetadata, HostStatus, MetadataFencing, NON_HEX_REF,
    RateLimit, RateLimits, RetryAfter, SimFleet,
};
use super::http::ApiError;
use super::view::{LeaseView, RecordedRequest, SimMachineView};

pub(crate) const STARTED: &str = "started";
pub(crate) const STOPPED: &str = "stopped";
pub(crate) const STOPPING: &str = "stopping";
pub(crate) const STARTING: &str = "starting";
pub(crate) const REPLACING: &str = "replacing";
/// Bound on the request log, so a long `demo` run does not grow without limit.
pub(crate) const MAX_RECORDED_REQUESTS: usize = 50_000;
/// Events a Machine object lists (newest first); Fly lists a handful too.
pub(crate) const MAX_MACHINE_EVENTS: usize = 20;

/// State shared by the server, its handlers, transition tasks and the [`super::Sim`] handle.
pub(crate) struct Shared {
    world: Mutex<World>,
    /// Bumped after every machine state change; long-polls (`wait`) watch it.
    changed: watch::Sender<u64>,
    /// Cancelled on shutdown: ends hung handlers, long-polls and transition tasks.
    pub(crate) cancel: CancellationToken,
}

impl Shared {
    pub(crate) fn new(world: World) -> Shared {
        Shared {
            world: Mutex::new(world),
            changed: watch::Sender::new(0),
            cancel: CancellationToken::new(),
        }
    }

    /// A panic in one handler must not wedge the whole simulator, so a
    /// poisoned lock is taken over rather than propagated.
    pub(crate) fn lock(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

/// A queued fault from [`super::SimHandle::fail_next`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct InjectedFailure {
    pub(crate) status: u16,
    pub(crate) retry_after: Option<u64>,
}

/// A fault for the next call of `method action` on one machine.
#[derive(Clone, Debug)]
pub(crate) struct TargetedFault {
    pub(crate) machine_id: String,
    pub(crate) method: String,
    pub(crate) action: String,
    pub(crate) fault: super::chaos::ChaosFault,
    /// How long a hanging fault holds the answer.
    pub(crate) hang: std::time::Duration,
}

/// When a [`super::SimHandle::before_next_call`] / [`super::SimHandle::after_next_call`] hook runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HookWhen {
    /// After the front door let the call through, before its handler runs.
    Before,
    /// After the handler took effect, before the answer is sent.
    After,
}

/// A test's intervention at an exact point of the next matching call.
pub(crate) struct PendingHook {
    pub(crate) machine_id: String,
    pub(crate) method: String,
    pub(crate) action: String,
    pub(crate) when: HookWhen,
    pub(crate) hook: super::Hook,
}

/// Which limit a call is counted against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RateClass {
    Get,
    Action,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Bucket {
    tokens: f64,
    refilled_at: tokio::time::Instant,
}

pub(crate) struct World {
    pub(crate) token: String,
    /// App-scoped tokens ([`super::SimHandle::add_app_token`]): app → its tokens.
    pub(crate) app_tokens: BTreeMap<String, Vec<String>>,
    pub(crate) lease_owner: String,
    pub(crate) release_tip: String,
    pub(crate) restart_delay: Duration,
    pub(crate) reload_delay: Duration,
    /// The wall clock ([`SimFleet::clock`]).
    pub(crate) clock: SharedClock,
    /// Added to the wall clock: lets tests expire leases and end busy periods without sleeping.
    pub(crate) clock_offset: TimeDelta,
    /// App name → machine ids in fixture order.
    pub(crate) apps: BTreeMap<String, Vec<String>>,
    pub(crate) machines: HashMap<String, MachineState>,
    pub(crate) record_requests: bool,
    /// Newest last; the oldest are dropped beyond [`MAX_RECORDED_REQUESTS`].
    pub(crate) requests: VecDeque<RecordedRequest>,
    pub(crate) next_seq: u64,
    pub(crate) failures: VecDeque<InjectedFailure>,
    /// Faults aimed at one kind of call of one machine ([`super::SimHandle::fault_next_call`]).
    pub(crate) targeted: Vec<TargetedFault>,
    /// App name → the status every Fly API call naming the app answers ([`super::SimHandle::fail_app`]).
    pub(crate) failing_apps: HashMap<String, u16>,
    /// Statuses the next cooperative calls of one agent answer ([`super::SimHandle::fail_next_agent_call`]).
    pub(crate) agent_failures: Vec<(String, String, u16)>,
    pub(crate) rate_limits: Option<RateLimits>,
    pub(crate) buckets: HashMap<(String, String), Bucket>,
    /// 429s the rate limit answered so far (drives [`RetryAfter::Mixed`]).
    pub(crate) throttled: u64,
    /// Machines whose buckets a storm emptied, and when: a bucket first
    /// used after that starts empty too.
    pub(crate) storms: HashMap<String, tokio::time::Instant>,
    pub(crate) metadata_fencing: MetadataFencing,
    pub(crate) host_down_metadata: HostDownMetadata,
    pub(crate) restart_keeps_cordon: bool,
    pub(crate) checks_pass_after: Duration,
    /// Interventions waiting for their call ([`super::SimHandle::before_next_call`]).
    pub(crate) hooks: Vec<PendingHook>,
    pub(crate) chaos: ChaosState,
    /// `None` until [`super::SimHandle::enable_audit`].
    pub(crate) audit: Option<AuditState>,
}

impl World {
    pub(crate) fn from_fleet(fleet: SimFleet) -> io::Result<World> {
        let now = fleet.clock.now();
        let mut apps = BTreeMap::new();
        let mut machines = HashMap::new();
        let mut seen = HashSet::new();
        for (app_index, app) in fleet.apps.into_iter().enumerate() {
            if apps.contains_key(&app.name) {
                return Err(invalid(format!("duplicate app {:?}", app.name)));
            }
            let mut ids = Vec::with_capacity(app.machines.len());
            for (machine_index, m) in app.machines.into_iter().enumerate() {
                if !seen.insert(m.id.clone()) {
                    return Err(invalid(format!("duplicate machine id {:?}", m.id)));
                }
                let private_ip = m.private_ip.unwrap_or_else(|| {
                    format!(
                        "fdaa:0:1:a7b:{:x}:{:x}:0:2",
                        app_index + 1,
                        machine_index + 1
                    )
                });
                let agent = AgentState {
                    loaded_ref: m.loaded_ref.unwrap_or_else(|| fleet.release_tip.clone()),
                    report_ref_len: m.report_ref_len,
                    behaviour: resolve_behaviour(m.behaviour, now),
                    capabilities: m.capabilities,
                    live_sessions: m.live_sessions,
                    last_input_at: m.last_input_at,
                    agent_token: m.agent_token,
                    fence: None,
                };
                ids.push(m.id.clone());
                machines.insert(
                    m.id.clone(),
                    MachineState {
                        app: app.name.clone(),
                        id: m.id,
                        name: m.name,
                        region: m.region,
                        state: m.state,
                        instance_id: new_instance_id(),
                        private_ip,
                        image: m.image,
                        created_at: now,
                        updated_at: now,
                        metadata: m.metadata,
                        cordoned: m.cordoned,
                        host_status: HostStatus::Ok,
                        kill_timeout: m.kill_timeout,
                        checkpoint_on_stop: m.checkpoint_on_stop,
                        checks: m
                            .checks
                            .into_iter()
                            .map(|name| Check {
                                name,
                                status: CheckStatus::Passing,
                                output: String::new(),
                                updated_at: now,
                            })
                            .collect(),
                        events: VecDeque::new(),
                        crash_loop: false,
                        lease: None,
                        restart_count: 0,
                        generation: 0,
                        down_by_api: false,
                        agent,
                    },
                );
            }
            apps.insert(app.name, ids);
        }
        Ok(World {
            token: fleet.token,
            app_tokens: BTreeMap::new(),
            lease_owner: fleet.lease_owner,
            release_tip: fleet.release_tip,
            restart_delay: fleet.restart_delay,
            reload_delay: fleet.reload_delay,
            clock: fleet.clock,
            clock_offset: TimeDelta::zero(),
            apps,
            machines,
            record_requests: fleet.record_requests,
            requests: VecDeque::new(),
            next_seq: 0,
            failures: VecDeque::new(),
            targeted: Vec::new(),
            failing_apps: HashMap::new(),
            agent_failures: Vec::new(),
            rate_limits: fleet.rate_limits,
            buckets: HashMap::new(),
            throttled: 0,
            storms: HashMap::new(),
            metadata_fencing: fleet.metadata_fencing,
            host_down_metadata: fleet.host_down_metadata,
            restart_keeps_cordon: fleet.restart_keeps_cordon,
            checks_pass_after: fleet.checks_pass_after,
            hooks: Vec::new(),
            chaos: ChaosState::default(),
            audit: None,
        })
    }

    /// The sim clock: wall clock plus the offset tests advanced it by.
    pub(crate) fn now(&self) -> DateTime<Utc> {
        let now = self.clock.now();
        now.checked_add_signed(self.clock_offset)
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }

    pub(crate) fn machine(&self, app: &str, id: &str) -> Result<&MachineState, ApiError> {
        if !self.apps.contains_key(app) {
            return Err(ApiError::app_not_found());
        }
        match self.machines.get(id) {
            Some(m) if m.app == app => Ok(m),
            _ => Err(ApiError::machine_not_found(id)),
        }
    }

    pub(crate) fn machine_mut(
        &mut self,
        app: &str,
        id: &str,
    ) -> Result<&mut MachineState, ApiError> {
        self.machine_and_audit(app, id).map(|(m, _)| m)
    }

    /// The machine and the audit at once (disjoint borrows), so a handler can
    /// record what it does to the machine under the same lock.
    pub(crate) fn machine_and_audit(
        &mut self,
        app: &str,
        id: &str,
    ) -> Result<(&mut MachineState, Option<&mut AuditState>), ApiError> {
        if !self.apps.contains_key(app) {
            return Err(ApiError::app_not_found());
        }
        match self.machines.get_mut(id) {
            Some(m) if m.app == app => Ok((m, self.audit.as_mut())),
            _ => Err(ApiError::machine_not_found(id)),
        }
    }

    /// Lets the audit re-evaluate a machine after a change (no-op when the audit is off).
    pub(crate) fn observe(&mut self, id: &str) {
        let now = self.now();
        if let (Some(audit), Some(m)) = (self.audit.as_mut(), self.machines.get(id)) {
            audit.observe(m, now);
        }
    }

    /// Takes one token from the bucket of (machine, `key`) at the limit of
    /// `class`; `Err(retry_after)` when it is empty, with the seconds until
    /// a token if this 429 carries `Retry-After` ([`RetryAfter`]).
    pub(crate) fn take_rate_token(
        &mut self,
        machine_id: &str,
        key: &str,
        class: RateClass,
    ) -> Result<(), Option<u64>> {
        let Some(limits) = self.rate_limits else {
            return Ok(());
        };
        let limit = match class {
            RateClass::Get => limits.get,
            RateClass::Action => limits.action,
        };
        let storm = self.storms.get(machine_id).copied();
        match take_token(&mut self.buckets, machine_id, key, limit, storm) {
            Ok(()) => Ok(()),
            Err(secs) => {
                self.throttled += 1;
                let with_header = match limits.retry_after {
                    RetryAfter::Never => false,
                    RetryAfter::Always => true,
                    RetryAfter::Mixed => self.throttled.is_multiple_of(2),
                };
                Err(with_header.then_some(secs))
            }
        }
    }

    /// Empties every bucket of one machine (a 429 storm): its calls are
    /// throttled until the documented refill gives them tokens again.
    pub(crate) fn drain_buckets(&mut self, machine_id: &str) {
        let now = tokio::time::Instant::now();
        self.storms.insert(machine_id.to_string(), now);
        for ((id, _), bucket) in self.buckets.iter_mut() {
            if id == machine_id {
                bucket.tokens = 0.0;
                bucket.refilled_at = now;
            }
        }
    }
}

/// Token bucket arithmetic; `Err(seconds until a token)` when empty.
fn take_token(
    buckets: &mut HashMap<(String, String), Bucket>,
    machine_id: &str,
    key: &str,
    limit: RateLimit,
    storm: Option<tokio::time::Instant>,
) -> Result<(), u64> {
    let now = tokio::time::Instant::now();
    let burst = f64::from(limit.burst.max(1));
    let rate = limit.per_second.max(f64::MIN_POSITIVE);
    let bucket = buckets
        .entry((machine_id.to_string(), key.to_string()))
        .or_insert(match storm {
            Some(at) => Bucket {
                tokens: 0.0,
                refilled_at: at,
            },
            None => Bucket {
                tokens: burst,
                refilled_at: now,
            },
        });
    let elapsed = now.duration_since(bucket.refilled_at).as_secs_f64();
    bucket.tokens = (bucket.tokens + elapsed * rate).min(burst);
    bucket.refilled_at = now;
    if bucket.tokens >= 1.0 {
        bucket.tokens -= 1.0;
        Ok(())
    } else {
        let wait = ((1.0 - bucket.tokens) / rate).ceil();
        // Saturating float-to-int conversion; at least one second, as Fly sends.
        Err((wait as u64).max(1))
    }
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

/// One simulated machine: Fly's view plus the agent process on it.
pub(crate) struct MachineState {
    pub(crate) app: String,
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) region: String,
    pub(crate) state: String,
    pub(crate) instance_id: String,
    pub(crate) private_ip: String,
    pub(crate) image: String,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) updated_at: DateTime<Utc>,
    pub(crate) metadata: BTreeMap<String, String>,
    pub(crate) cordoned: bool,
    pub(crate) host_status: HostStatus,
    pub(crate) kill_timeout: Duration,
    /// What the agent needs after its stop signal to checkpoint.
    pub(crate) checkpoint_on_stop: Duration,
    pub(crate) checks: Vec<Check>,
    /// Newest last here; the JSON lists them newest first.
    pub(crate) events: VecDeque<MachineEvent>,
    /// Comes back `started` but keeps exiting ([`super::SimHandle::set_crash_loop`]).
    pub(crate) crash_loop: bool,
    pub(crate) lease: Option<Lease>,
    pub(crate) restart_count: u32,
    /// Bumped by every state transition; pending transition tasks carry the
    /// generation they were scheduled in and give up if it moved on.
    pub(crate) generation: u64,
    /// A restart, stop or replacing update was accepted through the API and
    /// the machine has not been `started` since: out of its pool for the audit.
    pub(crate) down_by_api: bool,
    pub(crate) agent: AgentState,
}

impl MachineState {
    /// The lease, unless it has expired (expired leases count as absent, as on Fly).
    pub(crate) fn active_lease(&self, now: DateTime<Utc>) -> Option<&Lease> {
        self.lease.as_ref().filter(|l| l.expires_at > now)
    }

    /// Fly's rule for mutating calls: with an unexpired lease, the request must
    /// carry its nonce; without one, anyone may act.
    pub(crate) fn check_lease(
        &self,
        nonce: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<(), ApiError> {
        match self.active_lease(now) {
            Some(lease) if nonce != Some(lease.nonce.as_str()) => {
                Err(ApiError::lease_held(&self.id, lease))
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn host_ok(&self) -> bool {
        self.host_status == HostStatus::Ok
    }

    /// Appends a lifecycle event (Fly's `events`), dropping the oldest beyond the bound.
    pub(crate) fn event(
        &mut self,
        kind: &'static str,
        status: &'static str,
        source: &'static str,
        now: DateTime<Utc>,
    ) {
        if self.events.len() >= MAX_MACHINE_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(MachineEvent {
            kind,
            status,
            source,
            timestamp: now.timestamp_millis(),
        });
    }

    pub(crate) fn set_checks(&mut self, status: CheckStatus, output: &str, now: DateTime<Utc>) {
        for check in &mut self.checks {
            check.status = status;
            check.output = output.to_string();
            check.updated_at = now;
        }
    }

    /// Sim assumption: the instance id doubles as the machine version, so a
    /// metadata write gives the machine a new one (see the module docs).
    /// A metadata write: Fly creates no machine version for it.
    pub(crate) fn touch(&mut self, now: DateTime<Utc>) {
        self.updated_at = now;
    }

    pub(crate) fn bump_version(&mut self, now: DateTime<Utc>) {
        self.instance_id = new_instance_id();
        self.updated_at = now;
    }

    /// Enters `state` and invalidates pending transitions; returns the new generation.
    pub(crate) fn transition(&mut self, state: &str, now: DateTime<Utc>) -> u64 {
        if state == STARTED {
            self.down_by_api = false;
        }
        self.state = state.to_string();
        self.updated_at = now;
        self.generation += 1;
        self.generation
    }

    /// The agent process starts: it loads the release tip once (docs/design.md §1) and
    /// has no work, no sessions, no fence. Cordon, metadata and lease are Fly's
    /// and survive.
    pub(crate) fn boot(&mut self, release_tip: &str, now: DateTime<Utc>) {
        self.state = STARTED.to_string();
        self.updated_at = now;
        self.down_by_api = false;
        self.event("start", "started", "flyd", now);
        // A fresh process fails its checks until it has come up (or forever
        // while crash-looping, when it keeps exiting).
        self.set_checks(CheckStatus::Critical, "booting", now);
        if self.crash_loop {
            self.crash_events(now);
        }
        let agent = &mut self.agent;
        agent.loaded_ref = release_tip.to_string();
        agent.behaviour = Behaviour::Normal;
        agent.live_sessions = 0;
        agent.last_input_at = None;
        agent.fence = None;
    }

    /// A crash-looping process exits right after each start; Fly restarts it.
    pub(crate) fn crash_events(&mut self, now: DateTime<Utc>) {
        for _ in 0..2 {
            self.event("exit", "stopped", "flyd", now);
            self.event("start", "started", "flyd", now);
        }
        self.set_checks(CheckStatus::Critical, "process exited (code 1)", now);
    }

    pub(crate) fn view(&self, now: DateTime<Utc>) -> SimMachineView {
        SimMachineView {
            id: self.id.clone(),
            app: self.app.clone(),
            name: self.name.clone(),
            region: self.region.clone(),
            state: self.state.clone(),
            instance_id: self.instance_id.clone(),
            private_ip: self.private_ip.clone(),
            image: self.image.clone(),
            metadata: self.metadata.clone(),
            cordoned: self.cordoned,
            host_status: self.host_status,
            checks: self
                .checks
                .iter()
                .map(|c| (c.name.clone(), c.status))
                .collect(),
            crash_loop: self.crash_loop,
            lease: self.active_lease(now).map(Lease::view),
            restart_count: self.restart_count,
            loaded_ref: self.agent.loaded_ref.clone(),
            behaviour: self.agent.behaviour.clone(),
            capabilities: self.agent.capabilities.clone(),
            activity: self.agent.activity(now).to_string(),
            live_sessions: self.agent.reported_sessions(now),
            last_input_at: self.agent.last_input_at,
            fence: self.agent.fence.clone(),
            checkpoint: self.agent.checkpoint(now).map(str::to_string),
        }
    }
}

/// One of Fly's health checks of a machine.
#[derive(Clone, Debug)]
pub(crate) struct Check {
    pub(crate) name: String,
    pub(crate) status: CheckStatus,
    pub(crate) output: String,
    pub(crate) updated_at: DateTime<Utc>,
}

/// One of Fly's lifecycle events of a machine.
#[derive(Clone, Debug)]
pub(crate) struct MachineEvent {
    /// `start`, `exit`, `restart`, `stop`, `update`, ...
    pub(crate) kind: &'static str,
    pub(crate) status: &'static str,
    /// `user` (an API call) or `flyd` (Fly itself).
    pub(crate) source: &'static str,
    /// Milliseconds since the epoch, as Fly lists them.
    pub(crate) timestamp: i64,
}

#[derive(Clone, Debug)]
pub(crate) struct Lease {
    pub(crate) nonce: String,
    pub(crate) owner: String,
    pub(crate) description: String,
    pub(crate) expires_at: DateTime<Utc>,
    pub(crate) version: String,
}

impl Lease {
    fn view(&self) -> LeaseView {
        LeaseView {
            nonce: self.nonce.clone(),
            owner: self.owner.clone(),
            description: self.description.clone(),
            expires_at: self.expires_at,
            version: self.version.clone(),
        }
    }
}

/// The agent process on a machine.
pub(crate) struct AgentState {
    pub(crate) loaded_ref: String,
    pub(crate) report_ref_len: Option<usize>,
    /// Never `BusyFor`: resolved to `Busy { until }` when installed.
    pub(crate) behaviour: Behaviour,
    pub(crate) capabilities: Vec<String>,
    pub(crate) live_sessions: u32,
    pub(crate) last_input_at: Option<DateTime<Utc>>,
    pub(crate) agent_token: Option<String>,
    /// Rotation tag of the drain fence.
    pub(crate) fence: Option<String>,
}

/// Which `overlay_ref` a report carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RefField {
    Loaded,
    Missing,
    NonHex,
}

#[derive(Serialize)]
struct HealthReport<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    overlay_ref: Option<&'a str>,
    activity: &'static str,
    live_sessions: u32,
    last_input_at: Option<String>,
    heartbeat_at: String,
    capabilities: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    rotation: Option<RotationReport<'a>>,
}

#[derive(Serialize)]
pub(crate) struct RotationReport<'a> {
    pub(crate) fenced: bool,
    pub(crate) checkpoint: Option<&'a str>,
}

impl AgentState {
    pub(crate) fn has(&self, capability: &str) -> bool {
        self.capabilities.iter().any(|c| c == capability)
    }

    /// A turn or job is in progress.
    pub(crate) fn busy(&self, now: DateTime<Utc>) -> bool {
        matches!(self.behaviour, Behaviour::Busy { until } if now < until)
    }

    pub(crate) fn activity(&self, now: DateTime<Utc>) -> &'static str {
        if self.busy(now) { "busy" } else { "idle" }
    }

    /// The cooperative agent checkpoints once the work it had when fenced is
    /// done; the fence keeps new work away, so that is the point it can be
    /// restarted without loss.
    pub(crate) fn checkpoint(&self, now: DateTime<Utc>) -> Option<&str> {
        self.fence.as_deref().filter(|_| !self.busy(now))
    }

    /// Busy work counts as a live session; a checkpointed agent has none left
    /// to lose; otherwise the fixture's open sessions.
    pub(crate) fn reported_sessions(&self, now: DateTime<Utc>) -> u32 {
        if self.busy(now) {
            self.live_sessions.max(1)
        } else if self.checkpoint(now).is_some() {
            0
        } else {
            self.live_sessions
        }
    }

    /// The ref as reported: abbreviated to `report_ref_len` characters if set.
    pub(crate) fn reported_ref(&self) -> &str {
        match self.report_ref_len {
            Some(len) => self.loaded_ref.get(..len).unwrap_or(&self.loaded_ref),
            None => &self.loaded_ref,
        }
    }

    pub(crate) fn rotation(&self, now: DateTime<Utc>) -> Option<RotationReport<'_>> {
        self.has(CAP_DRAIN).then(|| RotationReport {
            fenced: self.fence.is_some(),
            checkpoint: self.checkpoint(now),
        })
    }

    /// The agent's health report (docs/design.md §4) as JSON.
    pub(crate) fn report_json(&self, now: DateTime<Utc>, ref_field: RefField) -> String {
        let report = HealthReport {
            overlay_ref: match ref_field {
                RefField::Loaded => Some(self.reported_ref()),
                RefField::Missing => None,
                RefField::NonHex => Some(NON_HEX_REF),
            },
            activity: self.activity(now),
            live_sessions: self.reported_sessions(now),
            last_input_at: self.last_input_at.map(rfc3339),
            heartbeat_at: now.to_rfc3339_opts(SecondsFormat::Millis, true),
            capabilities: &self.capabilities,
            rotation: self.rotation(now),
        };
        // Serializing plain strings and numbers cannot fail; fall back to an
        // empty object rather than panic inside a handler.
        serde_json::to_string(&report).unwrap_or_else(|_| "{}".to_string())
    }
}

/// `BusyFor(d)` becomes `Busy { until: now + d }` when installed.
pub(crate) fn resolve_behaviour(behaviour: Behaviour, now: DateTime<Utc>) -> Behaviour {
    match behaviour {
        Behaviour::BusyFor(d) => Behaviour::Busy { until: add(now, d) },
        other => other,
    }
}

/// `now + d`, saturating instead of panicking on absurd durations.
pub(crate) fn add(now: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|delta| now.checked_add_signed(delta))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// RFC 3339 at second precision with `Z`, as the Fly API prints timestamps.
pub(crate) fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// A ULID-shaped id (26 Crockford base-32 characters), like Fly instance ids.
pub(crate) fn new_instance_id() -> String {
    const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    let mut v: u128 = fastrand::u128(..);
    let mut id = String::with_capacity(26);
    for _ in 0..26 {
        id.push(char::from(ALPHABET[(v & 31) as usize]));
        v >>= 5;
    }
    id
}

pub(crate) fn new_nonce() -> String {
    format!("{:032x}", fastrand::u128(..))
}

/// A step of a delayed transition.
#[derive(Clone, Debug)]
pub(crate) enum Step {
    /// Enter this (transitional or final) state.
    State(&'static str),
    /// The machine is `started` and its agent has freshly loaded the release tip.
    Boot,
    /// The agent has loaded this ref in place.
    Reload(String),
    /// The fresh process passes its checks (unless it crash-loops).
    ChecksPass,
}

/// Runs `steps` one after another, each after its delay, as long as the
/// machine stays in `generation` and the simulator is running.
pub(crate) fn schedule(
    shared: &Arc<Shared>,
    machine_id: String,
    generation: u64,
    steps: Vec<(Duration, Step)>,
) {
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        let mut steps = VecDeque::from(steps);
        while let Some((delay, step)) = steps.pop_front() {
            tokio::select! {
                _ = shared.cancel.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            {
                let mut world = shared.lock();
                let now = world.now();
                let tip = world.release_tip.clone();
                let keeps_cordon = world.restart_keeps_cordon;
                let checks_pass_after = world.checks_pass_after;
                let Some(m) = world.machines.get_mut(&machine_id) else {
                    return;
                };
                if m.generation != generation {
                    return;
                }
                match step {
                    Step::State(state) => {
                        m.state = state.to_string();
                        m.updated_at = now;
                    }
                    Step::Boot => {
                        m.boot(&tip, now);
                        if !keeps_cordon {
                            m.cordoned = false;
                        }
                        steps.push_back((checks_pass_after, Step::ChecksPass));
                    }
                    Step::Reload(commit) => m.agent.loaded_ref = commit,
                    Step::ChecksPass => {
                        if !m.crash_loop {
                            m.set_checks(CheckStatus::Passing, "", now);
                        }
                    }
                }
                world.observe(&machine_id);
            }
            shared.notify();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent() -> AgentState {
        AgentState {
            loaded_ref: "0123456789abcdef0123456789abcdef01234567".to_string(),
            report_ref_len: None,
            behaviour: Behaviour::Normal,
            capabilities: vec![CAP_DRAIN.to_string()],
            live_sessions: 0,
            last_input_at: None,
            agent_token: None,
            fence: None,
        }
    }

    fn report(a: &AgentState, now: DateTime<Utc>) -> serde_json::Value {
        serde_json::from_str(&a.report_json(now, RefField::Loaded)).expect("report is JSON")
    }

    #[test]
    fn abbreviates_ref_and_tolerates_short_refs() {
        let mut a = agent();
        a.report_ref_len = Some(7);
        assert_eq!(a.reported_ref(), "0123456");
        a.loaded_ref = "abc".to_string();
        assert_eq!(a.reported_ref(), "abc");
    }

    #[test]
    fn busy_agent_reports_live_work_until_its_deadline() {
        let now = Utc::now();
        let mut a = agent();
        a.behaviour = resolve_behaviour(Behaviour::BusyFor(Duration::from_secs(60)), now);
        let r = report(&a, now);
        assert_eq!(r["activity"], "busy");
        assert_eq!(r["live_sessions"], 1);
        let later = now + TimeDelta::seconds(61);
        let r = report(&a, later);
        assert_eq!(r["activity"], "idle");
        assert_eq!(r["live_sessions"], 0);
    }

    #[test]
    fn fenced_agent_checkpoints_only_after_current_work() {
        let now = Utc::now();
        let mut a = agent();
        a.live_sessions = 2;
        a.behaviour = resolve_behaviour(Behaviour::BusyFor(Duration::from_secs(10)), now);
        a.fence = Some("rot-1".to_string());
        let r = report(&a, now);
        assert_eq!(r["rotation"]["fenced"], true);
        assert!(r["rotation"]["checkpoint"].is_null());
        assert_eq!(r["live_sessions"], 2);
        let r = report(&a, now + TimeDelta::seconds(11));
        assert_eq!(r["rotation"]["checkpoint"], "rot-1");
        assert_eq!(r["activity"], "idle");
        assert_eq!(r["live_sessions"], 0);
    }

    #[test]
    fn unfenced_agent_keeps_open_sessions_and_rotation_needs_drain() {
        let now = Utc::now();
        let mut a = agent();
        a.live_sessions = 3;
        assert_eq!(report(&a, now)["live_sessions"], 3);
        a.capabilities.clear();
        assert!(report(&a, now).get("rotation").is_none());
    }

    #[test]
    fn missing_and_non_hex_ref_variants() {
        let a = agent();
        let now = Utc::now();
        let missing: serde_json::Value =
            serde_json::from_str(&a.report_json(now, RefField::Missing)).expect("json");
        assert!(missing.get("overlay_ref").is_none());
        let non_hex: serde_json::Value =
            serde_json::from_str(&a.report_json(now, RefField::NonHex)).expect("json");
        assert_eq!(non_hex["overlay_ref"], NON_HEX_REF);
    }

    #[test]
    fn ids_have_the_expected_shape() {
        let id = new_instance_id();
        assert_eq!(id.len(), 26);
        assert_ne!(id, new_instance_id());
        let nonce = new_nonce();
        assert_eq!(nonce.len(), 32);
        assert!(nonce.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn add_saturates() {
        let now = Utc::now();
        assert_eq!(add(now, Duration::MAX), DateTime::<Utc>::MAX_UTC);
    }

    #[test]
    fn duplicate_machine_ids_are_rejected() {
        use super::super::fixture::{SimApp, SimMachine};
        let fleet = SimFleet::default()
            .app(SimApp::new("a").machine(SimMachine::new("m1")))
            .app(SimApp::new("b").machine(SimMachine::new("m1")));
        assert!(World::from_fleet(fleet).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limit_allows_a_burst_then_refills() {
        let mut world = World::from_fleet(SimFleet::default()).expect("valid fleet");
        let action = RateClass::Action;
        for _ in 0..3 {
            assert!(world.take_rate_token("m1", "POST restart", action).is_ok());
        }
        // Fly's default: no Retry-After.
        assert_eq!(
            world.take_rate_token("m1", "POST restart", action),
            Err(None)
        );
        // Other actions and machines have their own buckets.
        assert!(world.take_rate_token("m1", "POST cordon", action).is_ok());
        assert!(world.take_rate_token("m2", "POST restart", action).is_ok());
        tokio::time::advance(Duration::from_millis(1100)).await;
        assert!(world.take_rate_token("m1", "POST restart", action).is_ok());
        // Gets have the larger budget.
        for _ in 0..10 {
            assert!(
                world
                    .take_rate_token("m1", "GET machine", RateClass::Get)
                    .is_ok()
            );
        }
        assert!(
            world
                .take_rate_token("m1", "GET machine", RateClass::Get)
                .is_err()
        );
        world.rate_limits = Some(RateLimits::fly().retry_after(RetryAfter::Always));
        assert_eq!(
            world.take_rate_token("m1", "GET machine", RateClass::Get),
            Err(Some(1))
        );
    }
}

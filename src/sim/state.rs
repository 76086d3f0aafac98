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

use chrono::{DateTime, TimeDelta, Utc};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::clock::SharedClock;

use super::audit::AuditState;
use super::chaos::ChaosState;
use super::fixture::{
    CheckStatus, HostDownMetadata, MetadataFencing, RateLimit, RateLimits, RetryAfter, SimFleet,
};
use super::machine::MachineState;
use super::view::RecordedRequest;
use super::wire::ApiError;

/// Bound on the request log, so a long `demo` run does not grow without limit.
pub(crate) const MAX_RECORDED_REQUESTS: usize = 50_000;

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

/// A pending intervention as the world keeps it: run with the shared state,
/// from which `handle` makes the [`super::SimHandle`] a test's hook is given
/// (the world names nothing above it).
pub(crate) type WorldHook = Box<dyn FnOnce(&Arc<Shared>) + Send>;

/// A test's intervention at an exact point of the next matching call.
pub(crate) struct PendingHook {
    pub(crate) machine_id: String,
    pub(crate) method: String,
    pub(crate) action: String,
    pub(crate) when: HookWhen,
    pub(crate) hook: WorldHook,
}

/// Which limit a call is counted against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RateClass {
    Get,
    Action,
    /// Listing an app's machines: one bucket per app.
    List,
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
    /// Listing an app's machines, per app, while `rate_limits` are on.
    pub(crate) list_rate_limit: Option<RateLimit>,
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
    /// Every metadata write made through a machine's socket, which
    /// listings showed it, and who listed last ([`super::SocketWrite`]).
    pub(crate) socket: super::socket_log::SocketLog,
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
                ids.push(m.id.clone());
                let fallback_ip = || {
                    format!(
                        "fdaa:0:1:a7b:{:x}:{:x}:0:2",
                        app_index + 1,
                        machine_index + 1
                    )
                };
                let machine =
                    MachineState::from_fixture(&app.name, m, fallback_ip, &fleet.release_tip, now);
                machines.insert(machine.id.clone(), machine);
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
            list_rate_limit: fleet.list_rate_limit,
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
            socket: Default::default(),
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
            RateClass::List => match self.list_rate_limit {
                Some(limit) => limit,
                None => return Ok(()),
            },
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

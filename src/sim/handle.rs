//! [`SimHandle`]: what tests (and the chaos of the world) do to a running
//! simulator from outside the HTTP surface: out-of-band writes, faults,
//! switches, hooks, the audit.
//!
//! It works on the world (`state`) and its machines (`machine`) directly and
//! names no handler and not the router: the front door (`http`) sits above
//! it and calls [`SimHandle::carry_out`] for the world's chaos.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::clock::SharedClock;

use super::audit::{AuditConfig, AuditReport, AuditState};
use super::chaos::{Chaos, ChaosEvent, ChaosFault, ChaosStats, ChaosWorldEvent, WorldAct};
use super::fixture::{
    Behaviour, CheckStatus, HostDownMetadata, HostStatus, MetadataFencing, RateLimit, RateLimits,
};
use super::machine::Lease;
use super::machine::{self, add, new_nonce, resolve_behaviour};
use super::state::{self, HookWhen, InjectedFailure, PendingHook, Shared, WorldHook};
use super::view::{OperatorWriteRefused, OutsideLease, RecordedRequest, SimMachineView};

/// How long a targeted hanging fault ([`SimHandle::fault_next_call`]) holds its answer.
const TARGETED_HANG: Duration = Duration::from_secs(3);

/// What tests do to a running simulator from outside (out-of-band writes,
/// faults, switches, the audit), without the server itself: cheap to clone,
/// and what an interleaving hook ([`SimHandle::before_next_call`]) is given.
/// A [`super::Sim`] dereferences to its handle.
#[derive(Clone)]
pub struct SimHandle {
    pub(super) shared: Arc<Shared>,
}

impl std::fmt::Debug for SimHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHandle").finish_non_exhaustive()
    }
}

/// An intervention run at an exact point of a daemon's call (see
/// [`SimHandle::before_next_call`]); it may do anything a test does from outside.
pub type Hook = Box<dyn FnOnce(&SimHandle) + Send>;

impl SimHandle {
    /// The Fly token the simulator accepts.
    pub fn token(&self) -> String {
        self.shared.lock().token.clone()
    }

    /// Accepts `token` for the Fly API routes of `app` only, as Fly accepts
    /// a deploy token made with `fly tokens create deploy -a APP`; other
    /// apps answer it 401.
    pub fn add_app_token(&self, app: &str, token: &str) {
        self.shared
            .lock()
            .app_tokens
            .entry(app.to_string())
            .or_default()
            .push(token.to_string());
    }

    /// The commit agents load when their machine next boots.
    pub fn release_tip(&self) -> String {
        self.shared.lock().release_tip.clone()
    }

    pub fn set_release_tip(&self, commit: &str) {
        self.shared.lock().release_tip = commit.to_string();
    }

    /// The wall clock the sim reads ([`SimFleet::clock`]), to share with a
    /// daemon under test.
    pub fn clock(&self) -> SharedClock {
        self.shared.lock().clock.clone()
    }

    /// The sim clock (wall clock plus any [`SimHandle::advance_clock`]).
    pub fn now(&self) -> DateTime<Utc> {
        self.shared.lock().now()
    }

    /// Moves the sim clock forward: leases expire and busy periods end without
    /// sleeping. Does not fire delayed transitions (those run on tokio time).
    pub fn advance_clock(&self, by: Duration) {
        let mut world = self.shared.lock();
        let by = TimeDelta::from_std(by).unwrap_or(TimeDelta::MAX);
        world.clock_offset = world
            .clock_offset
            .checked_add(&by)
            .unwrap_or(TimeDelta::MAX);
    }

    /// Machine ids of `app` in fixture order (empty for an unknown app).
    pub fn machine_ids(&self, app: &str) -> Vec<String> {
        self.shared
            .lock()
            .apps
            .get(app)
            .cloned()
            .unwrap_or_default()
    }

    pub fn machine(&self, machine_id: &str) -> Option<SimMachineView> {
        let world = self.shared.lock();
        let now = world.now();
        world.machines.get(machine_id).map(|m| m.view(now))
    }

    /// Every machine, app by app (in name order), each in fixture order: lets
    /// a test check at the end that nothing is left cordoned, fenced or marked.
    pub fn machines(&self) -> Vec<SimMachineView> {
        let world = self.shared.lock();
        let now = world.now();
        world
            .apps
            .values()
            .flatten()
            .filter_map(|id| world.machines.get(id))
            .map(|m| m.view(now))
            .collect()
    }

    /// Applies `f` to a machine's state; `false` if the machine is unknown.
    fn with_machine(
        &self,
        machine_id: &str,
        f: impl FnOnce(&mut machine::MachineState, DateTime<Utc>),
    ) -> bool {
        let found = {
            let mut world = self.shared.lock();
            let now = world.now();
            let found = world
                .machines
                .get_mut(machine_id)
                .map(|m| f(m, now))
                .is_some();
            // Out-of-band changes (a new pool, a forced state) move machines
            // between the audit's out sets too.
            world.observe(machine_id);
            found
        };
        self.shared.notify();
        found
    }

    /// Changes how the agent answers; `BusyFor` is measured from now.
    pub fn set_behaviour(&self, machine_id: &str, behaviour: Behaviour) -> bool {
        self.with_machine(machine_id, |m, now| {
            m.agent.behaviour = resolve_behaviour(behaviour, now);
        })
    }

    /// Changes the ref the agent has loaded (as if it had been reloaded out of band).
    pub fn set_loaded_ref(&self, machine_id: &str, commit: &str) -> bool {
        self.with_machine(machine_id, |m, _| m.agent.loaded_ref = commit.to_string())
    }

    /// Sessions the agent reports while not busy.
    pub fn set_live_sessions(&self, machine_id: &str, sessions: u32) -> bool {
        self.with_machine(machine_id, |m, _| m.agent.live_sessions = sessions)
    }

    pub fn set_last_input_at(&self, machine_id: &str, at: Option<DateTime<Utc>>) -> bool {
        self.with_machine(machine_id, |m, _| m.agent.last_input_at = at)
    }

    pub fn set_capabilities(&self, machine_id: &str, capabilities: &[&str]) -> bool {
        self.with_machine(machine_id, |m, _| {
            m.agent.capabilities = capabilities.iter().map(|c| c.to_string()).collect();
        })
    }

    /// Forces a Fly state (e.g. `stopped` after a crash) without booting the
    /// agent, and cancels any transition in progress.
    pub fn set_state(&self, machine_id: &str, state: &str) -> bool {
        self.with_machine(machine_id, |m, now| {
            m.transition(state, now);
        })
    }

    /// Writes a metadata key out of band (as an operator's `fly` command would);
    /// no lease needed, no new machine version.
    pub fn set_metadata(&self, machine_id: &str, key: &str, value: &str) -> bool {
        self.with_machine(machine_id, |m, now| {
            m.metadata.insert(key.to_string(), value.to_string());
            m.touch(now);
        })
    }

    /// Deletes a metadata key out of band; no lease needed, no new machine version.
    pub fn delete_metadata(&self, machine_id: &str, key: &str) -> bool {
        self.with_machine(machine_id, |m, now| {
            m.metadata.remove(key);
            m.touch(now);
        })
    }

    /// Writes a metadata key as an operator's CLI does through the API
    /// (fly-go `SetMetadata`, no nonce): accepted at any instant, as on Fly.
    /// Only under [`MetadataFencing::FencedByLease`] is it refused while
    /// someone holds an unexpired lease (the caller retries). Unlike
    /// [`SimHandle::set_metadata`], it is refused for an unknown machine.
    pub fn operator_set_metadata(
        &self,
        machine_id: &str,
        key: &str,
        value: &str,
    ) -> Result<(), OperatorWriteRefused> {
        self.operator_write(machine_id, |metadata| {
            metadata.insert(key.to_string(), value.to_string());
        })
    }

    /// Deletes a metadata key under the same rule as [`SimHandle::operator_set_metadata`].
    pub fn operator_delete_metadata(
        &self,
        machine_id: &str,
        key: &str,
    ) -> Result<(), OperatorWriteRefused> {
        self.operator_write(machine_id, |metadata| {
            metadata.remove(key);
        })
    }

    /// `fly machine uncordon` by an operator (the `metadata_tampered`
    /// runbook, for a machine a foreign marker left cordoned): refused while
    /// anyone holds an unexpired lease on it, as flyctl takes one.
    pub fn operator_uncordon(&self, machine_id: &str) -> Result<(), OperatorWriteRefused> {
        {
            let mut world = self.shared.lock();
            let now = world.now();
            let Some(m) = world.machines.get_mut(machine_id) else {
                return Err(OperatorWriteRefused::UnknownMachine {
                    machine_id: machine_id.to_string(),
                });
            };
            if let Some(lease) = m.active_lease(now) {
                return Err(OperatorWriteRefused::Leased {
                    machine_id: machine_id.to_string(),
                    owner: lease.owner.clone(),
                    expires_at: lease.expires_at,
                });
            }
            m.cordoned = false;
            m.touch(now);
            world.observe(machine_id);
        }
        self.shared.notify();
        Ok(())
    }

    fn operator_write(
        &self,
        machine_id: &str,
        write: impl FnOnce(&mut std::collections::BTreeMap<String, String>),
    ) -> Result<(), OperatorWriteRefused> {
        {
            let mut world = self.shared.lock();
            let now = world.now();
            let fenced = world.metadata_fencing == MetadataFencing::FencedByLease;
            let Some(m) = world.machines.get_mut(machine_id) else {
                return Err(OperatorWriteRefused::UnknownMachine {
                    machine_id: machine_id.to_string(),
                });
            };
            if let Some(lease) = m.active_lease(now).filter(|_| fenced) {
                return Err(OperatorWriteRefused::Leased {
                    machine_id: machine_id.to_string(),
                    owner: lease.owner.clone(),
                    expires_at: lease.expires_at,
                });
            }
            write(&mut m.metadata);
            m.touch(now);
            world.observe(machine_id);
        }
        self.shared.notify();
        Ok(())
    }

    /// Every request received so far, in arrival order (the newest 50 000).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.lock().requests.iter().cloned().collect()
    }

    pub fn clear_requests(&self) {
        self.shared.lock().requests.clear();
    }

    /// The next `n` authenticated Fly API requests answer `status` (with
    /// `Retry-After: <secs>` if given) without taking effect. Queues behind
    /// faults already pending.
    pub fn fail_next(&self, n: usize, status: u16, retry_after: Option<u64>) {
        let mut world = self.shared.lock();
        let failure = InjectedFailure {
            status,
            retry_after,
        };
        world.failures.extend(std::iter::repeat_n(failure, n));
    }

    /// Until called again with `None`, every authenticated Fly API request
    /// naming `app` (listing its machines, or any call on one of them) answers
    /// `status` without taking effect: a deleted app (404), a token without
    /// access to it (403), a partial outage (500, 503). Other apps answer as usual.
    pub fn fail_app(&self, app: &str, status: Option<u16>) {
        let mut world = self.shared.lock();
        match status {
            Some(s) => world.failing_apps.insert(app.to_string(), s),
            None => world.failing_apps.remove(app),
        };
    }

    /// The next `method action` call on `machine_id` (e.g. `"POST"`,
    /// `"cordon"`; actions as in [`RecordedRequest::action`]) gets `fault`;
    /// `LostAfter` lets the call take effect and loses its answer.
    pub fn fault_next_call(&self, machine_id: &str, method: &str, action: &str, fault: ChaosFault) {
        self.shared.lock().targeted.push(state::TargetedFault {
            machine_id: machine_id.to_string(),
            method: method.to_string(),
            action: action.to_string(),
            fault,
            hang: TARGETED_HANG,
        });
    }

    /// The next `method action` call on `machine_id` takes no effect and is
    /// answered (503) only after `hang`: a Fly call stuck in flight.
    pub fn hang_next_call(&self, machine_id: &str, method: &str, action: &str, hang: Duration) {
        self.shared.lock().targeted.push(state::TargetedFault {
            machine_id: machine_id.to_string(),
            method: method.to_string(),
            action: action.to_string(),
            fault: ChaosFault::HangBefore,
            hang,
        });
    }

    /// The next call of the agent's cooperative `endpoint` (`"drain"`,
    /// `"undrain"`, `"reload"`) answers `status` without taking effect.
    pub fn fail_next_agent_call(&self, machine_id: &str, endpoint: &str, status: u16) {
        self.shared.lock().agent_failures.push((
            machine_id.to_string(),
            endpoint.to_string(),
            status,
        ));
    }

    /// Injected faults not yet served.
    pub fn pending_failures(&self) -> usize {
        self.shared.lock().failures.len()
    }

    /// Turns random faults on authenticated Fly API requests on (re-seeding
    /// the fault RNG from `chaos.seed`) or off. Queued [`SimHandle::fail_next`]
    /// faults and the rate limit are served first; see [`Chaos`].
    pub fn set_chaos(&self, chaos: Option<Chaos>) {
        let mut world = self.shared.lock();
        let snapshots = world
            .machines
            .iter()
            .map(|(id, m)| (id.clone(), m.metadata.clone()))
            .collect();
        world.chaos.snapshots = snapshots;
        world.chaos.set(chaos);
    }

    /// The faults of the world chaos caused so far (the newest 10 000).
    pub fn chaos_world_events(&self) -> Vec<ChaosWorldEvent> {
        self.shared
            .lock()
            .chaos
            .world_events
            .iter()
            .cloned()
            .collect()
    }

    /// Carries out a fault of the world drawn by chaos, and schedules its end.
    pub(crate) fn carry_out(&self, act: WorldAct) {
        let undo: Option<(Duration, Hook)> = match act {
            WorldAct::HostDown { machine_id, lasts } => {
                self.set_host_status(&machine_id, HostStatus::Unreachable);
                Some((
                    lasts,
                    Box::new(move |h: &SimHandle| {
                        h.set_host_status(&machine_id, HostStatus::Ok);
                    }),
                ))
            }
            WorldAct::Storm { machine_id } => {
                self.exhaust_rate_limits(&machine_id);
                None
            }
            WorldAct::Hold {
                machine_id,
                key,
                value,
                lasts,
            } => {
                self.set_metadata(&machine_id, &key, &value);
                Some((
                    lasts,
                    Box::new(move |h: &SimHandle| {
                        h.delete_metadata(&machine_id, &key);
                    }),
                ))
            }
            WorldAct::OutsideUpdate {
                machine_id,
                metadata,
            } => {
                // A host that is down refuses it: nothing happens, as for `fly deploy`.
                let _ = self.outside_update(&machine_id, &metadata, OutsideLease::ReuseFound);
                None
            }
        };
        if let Some((lasts, undo)) = undo {
            let handle = self.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = handle.shared.cancel.cancelled() => {}
                    _ = tokio::time::sleep(lasts) => undo(&handle),
                }
            });
        }
    }

    /// Faults injected so far (cumulative across [`SimHandle::set_chaos`] calls).
    pub fn chaos_stats(&self) -> ChaosStats {
        self.shared.lock().chaos.stats
    }

    /// The faults injected, in arrival order (the newest 10 000).
    pub fn chaos_events(&self) -> Vec<ChaosEvent> {
        self.shared.lock().chaos.events.iter().cloned().collect()
    }

    /// Starts (or restarts, discarding what was recorded) the safety audit,
    /// from the fleet as it is now; see [`AuditReport`].
    pub fn enable_audit(&self, config: AuditConfig) {
        let mut world = self.shared.lock();
        let now = world.now();
        // Fixture order, so breaches already present at the start list the same way every run.
        let machines = world
            .apps
            .values()
            .flatten()
            .filter_map(|id| world.machines.get(id));
        let audit = AuditState::new(config, machines, now);
        world.audit = Some(audit);
    }

    /// What the audit has recorded so far (an empty report, `enabled: false`,
    /// if it was never enabled).
    pub fn audit(&self) -> AuditReport {
        let world = self.shared.lock();
        match &world.audit {
            Some(audit) => audit.report(world.machines.values()),
            None => AuditReport::default(),
        }
    }

    /// `limit` for every call with `Retry-After` ([`RateLimits::uniform`]), or no limit.
    pub fn set_rate_limit(&self, limit: Option<RateLimit>) {
        self.set_rate_limits(limit.map(RateLimits::uniform));
    }

    /// Replaces the rate limits (`None`: unlimited) and refills every bucket.
    pub fn set_rate_limits(&self, limits: Option<RateLimits>) {
        let mut world = self.shared.lock();
        world.rate_limits = limits;
        world.buckets.clear();
        world.storms.clear();
        world.throttled = 0;
    }

    /// Switches whether metadata writes need the lease nonce (see [`MetadataFencing`]).
    pub fn set_metadata_fencing(&self, fencing: MetadataFencing) {
        self.shared.lock().metadata_fencing = fencing;
    }

    /// Switches what `incomplete_config` shows of a down host's metadata.
    pub fn set_host_down_metadata(&self, shown: HostDownMetadata) {
        self.shared.lock().host_down_metadata = shown;
    }

    /// Switches whether a restart keeps the cordon.
    pub fn set_restart_keeps_cordon(&self, keeps: bool) {
        self.shared.lock().restart_keeps_cordon = keeps;
    }

    /// Runs `hook` when the next `method action` call on `machine_id` (as in
    /// [`SimHandle::fault_next_call`]) has passed the front door (token,
    /// faults, rate limit, chaos), just before its handler runs. A call
    /// refused at the door does not fire it. The hook runs outside the world
    /// lock and may do anything a test does from outside.
    pub fn before_next_call(
        &self,
        machine_id: &str,
        method: &str,
        action: &str,
        hook: impl FnOnce(&SimHandle) + Send + 'static,
    ) {
        self.push_hook(machine_id, method, action, HookWhen::Before, Box::new(hook));
    }

    /// Like [`SimHandle::before_next_call`], but after the handler took
    /// effect, before its answer is sent (whatever the handler answered).
    pub fn after_next_call(
        &self,
        machine_id: &str,
        method: &str,
        action: &str,
        hook: impl FnOnce(&SimHandle) + Send + 'static,
    ) {
        self.push_hook(machine_id, method, action, HookWhen::After, Box::new(hook));
    }

    fn push_hook(&self, machine_id: &str, method: &str, action: &str, when: HookWhen, hook: Hook) {
        // The world holds hooks without naming this handle (it sits below
        // it); the handle is made again when the hook fires.
        let hook: WorldHook = Box::new(move |shared: &Arc<Shared>| {
            hook(&SimHandle {
                shared: Arc::clone(shared),
            })
        });
        self.shared.lock().hooks.push(PendingHook {
            machine_id: machine_id.to_string(),
            method: method.to_string(),
            action: action.to_string(),
            when,
            hook,
        });
    }

    /// Hooks not yet fired.
    pub fn pending_hooks(&self) -> usize {
        self.shared.lock().hooks.len()
    }

    /// Takes a machine's host down ([`HostStatus::Unreachable`],
    /// [`HostStatus::Unknown`]) or back up ([`HostStatus::Ok`]). While it is
    /// down the Machine JSON shows `incomplete_config` instead of `config`,
    /// its agent is unreachable, and metadata reads, lease calls and
    /// mutating calls answer 503 without effect. `false` for an unknown machine.
    pub fn set_host_status(&self, machine_id: &str, status: HostStatus) -> bool {
        self.with_machine(machine_id, |m, _| m.host_status = status)
    }

    /// Makes a machine crash-loop (it comes back `started` but keeps exiting:
    /// exit events, checks critical, its agent never answers) or stop doing so.
    pub fn set_crash_loop(&self, machine_id: &str, on: bool) -> bool {
        self.with_machine(machine_id, |m, now| {
            m.crash_loop = on;
            if on && m.state == machine::STARTED {
                m.crash_events(now);
            } else if !on {
                m.set_checks(CheckStatus::Passing, "", now);
            }
        })
    }

    /// Sets the status of one of the machine's checks (added if the machine
    /// had no check of that name); `false` for an unknown machine.
    pub fn set_check(&self, machine_id: &str, name: &str, status: CheckStatus) -> bool {
        self.with_machine(machine_id, |m, now| {
            let output = format!("set by the test: {}", status.as_str());
            match m.checks.iter_mut().find(|c| c.name == name) {
                Some(check) => {
                    check.status = status;
                    check.output = output;
                    check.updated_at = now;
                }
                None => m.checks.push(machine::Check {
                    name: name.to_string(),
                    status,
                    output,
                    updated_at: now,
                }),
            }
        })
    }

    /// `fly deploy` / `fly machine update` from outside: replaces the whole
    /// config with `metadata` (a snapshot the caller took earlier, so keys
    /// written since are reverted), gives the machine a new `instance_id`,
    /// clears the cordon and replaces a started machine (its agent comes
    /// back on the release tip, idle). With [`OutsideLease::Respect`] it is
    /// refused while someone holds an unexpired lease; with
    /// [`OutsideLease::ReuseFound`] it acts under a lease it finds (as
    /// flyctl reuses a nonce from the machine list) and then releases it.
    /// Refused while the host is down. Not a request: not logged or faulted,
    /// and not audited as the daemon's restart.
    pub fn outside_update(
        &self,
        machine_id: &str,
        metadata: &std::collections::BTreeMap<String, String>,
        lease: OutsideLease,
    ) -> Result<(), OperatorWriteRefused> {
        let scheduled = {
            let mut world = self.shared.lock();
            let now = world.now();
            let delay = world.restart_delay;
            let Some(m) = world.machines.get_mut(machine_id) else {
                return Err(OperatorWriteRefused::UnknownMachine {
                    machine_id: machine_id.to_string(),
                });
            };
            if !m.host_ok() {
                return Err(OperatorWriteRefused::HostDown {
                    machine_id: machine_id.to_string(),
                });
            }
            if let Some(held) = m.active_lease(now) {
                if lease == OutsideLease::Respect {
                    return Err(OperatorWriteRefused::Leased {
                        machine_id: machine_id.to_string(),
                        owner: held.owner.clone(),
                        expires_at: held.expires_at,
                    });
                }
                // flyctl releases the lease it reused when it is done.
                m.lease = None;
            }
            m.metadata = metadata.clone();
            m.bump_version(now);
            m.cordoned = false;
            m.event("update", "replacing", "user", now);
            let scheduled = (m.state == machine::STARTED)
                .then(|| (m.transition(machine::REPLACING, now), delay));
            world.observe(machine_id);
            scheduled
        };
        self.shared.notify();
        if let Some((generation, delay)) = scheduled {
            state::schedule(
                &self.shared,
                machine_id.to_string(),
                generation,
                vec![(delay, state::Step::Boot)],
            );
        }
        Ok(())
    }

    /// Empties every rate-limit bucket of one machine: its calls answer 429
    /// until the documented refill gives them tokens again (a 429 storm).
    pub fn exhaust_rate_limits(&self, machine_id: &str) {
        self.shared.lock().drain_buckets(machine_id);
    }

    /// Plants a lease held by another actor, replacing any lease; returns its
    /// nonce, or `None` for an unknown machine.
    pub fn acquire_lease_as(&self, machine_id: &str, owner: &str, ttl: Duration) -> Option<String> {
        let mut world = self.shared.lock();
        let now = world.now();
        let m = world.machines.get_mut(machine_id)?;
        let nonce = new_nonce();
        m.lease = Some(Lease {
            nonce: nonce.clone(),
            owner: owner.to_string(),
            description: format!("held by {owner}"),
            expires_at: add(now, ttl),
            version: m.instance_id.clone(),
        });
        Some(nonce)
    }

    /// Removes any lease on the machine (as if its holder released it).
    pub fn clear_lease(&self, machine_id: &str) -> bool {
        self.with_machine(machine_id, |m, _| m.lease = None)
    }
}

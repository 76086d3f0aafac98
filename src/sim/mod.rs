//! Simulated Fly Machines API and agent fleet, for `demo`, tests and benchmarks.
//!
//! [`Sim::start`] serves, on `127.0.0.1:0`, real HTTP that stands in for two
//! things the daemon talks to:
//!
//! - the Fly Machines API under `/v1` (list, get, update, restart, stop,
//!   start, wait, cordon, uncordon, leases, metadata), with the shapes of the
//!   official OpenAPI spec and the real lease envelope of docs/design.md §3;
//! - one agent per machine under `/agents/{machine_id}/` (`health`, and
//!   `overlay/drain|undrain|reload` for agents that advertise them), per the
//!   agent contract of docs/design.md §4, including the misbehaviours in [`Behaviour`].
//!
//! The daemon's safety (never restart live work, never act without its lease,
//! never steal a lease, fail closed on bad reports) is tested against this
//! server — with random faults ([`SimHandle::set_chaos`]) and a record of every
//! unsafe instant ([`SimHandle::enable_audit`]) if a test asks — so it must be
//! faithful where the daemon depends on Fly's semantics, and by default it
//! models Fly as it really behaves (issue #19; sources in
//! `FLY-REALITY.md`, read from fly-go, flyctl and Fly's docs): every
//! mutating call on a leased machine needs the lease nonce *except metadata
//! writes*, which anyone may make at any instant; calls meet Fly's documented
//! rate limits; a host can go down and hide the config; `fly deploy` can
//! revert metadata and replace a machine from outside; an expired lease
//! counts as absent, `summary=true` drops metadata, `wait` answers 408, a
//! restarted agent comes back on the release tip with no work and no fence.
//! Where Fly's behaviour is unknown the sim takes the worse case for the
//! daemon. [`SimFleet::idealized_fly`] (and one switch per behaviour) brings
//! back the old, kinder sim for tests that wait for a daemon fix.
//!
//! What it must never do: be used by a production code path (only tests,
//! benchmarks and the `demo` command start it), listen anywhere but loopback,
//! or reach the network. It holds no real credentials; the token is whatever
//! the fixture says.
//!
//! # Semantics the sim had to choose
//!
//! - **Machine version.** The instance id is the machine version: an update
//!   (`POST …/{id}`, [`SimHandle::outside_update`]) gives the machine a new one;
//!   restart, start and metadata writes keep it, as on Fly ("metadata writes
//!   create no machine version", FLY-REALITY.md). So `PATCH …/metadata` with
//!   `machine_version` is no compare-and-set on metadata, here as there.
//! - **Unreachable agents.** The health endpoint of a machine that is not
//!   `started` answers 503 (on Fly its private DNS name would not resolve).
//!   Unknown machine ids answer 404.
//! - **Restart** of a machine that is not `started` answers 412. It takes
//!   `restart_delay` (`stopping`, then `starting`, then `started`); stop and
//!   start take half of it. `restart_count` counts restarts when accepted.
//!   On every boot the agent loads the release tip current at that moment, is
//!   idle with no sessions, no fence, no last input, behaviour `Normal`;
//!   cordon, metadata and lease are Fly's and survive.
//! - **Leases.** The owner is the fleet's `lease_owner` for every token
//!   request; TTL from the body, else `?ttl=`, else 30 s. `GET …/lease` shows
//!   the nonce (as flyctl's `leases view` does): a daemon must never use a
//!   nonce it did not acquire, which tests can check in [`SimHandle::requests`].
//!   Re-acquiring with a stale nonce when no lease is held takes a new lease.
//!   A nonce header on an unleased machine is ignored.
//! - **Injected faults** ([`SimHandle::fail_next`]) and the optional rate limit apply
//!   to authenticated Fly API requests only, after the token check. A failing
//!   app ([`SimHandle::fail_app`]) refuses every such request naming it before
//!   either (it consumes no queued fault).
//! - **Chaos** ([`SimHandle::set_chaos`]) applies to the same requests (long-polls
//!   and lease calls included), after queued faults and the rate limit: a
//!   request refused by either never reaches the RNG. Each remaining request
//!   draws once from an RNG seeded by [`Chaos::seed`]; with probability
//!   [`Chaos::rate`] it gets one [`ChaosFault`], chosen uniformly. 429, 500,
//!   503 and `HangBefore` (503 after [`Chaos::hang`]) have no effect.
//!   `LostAfter` and `HangAfter` run the real handler — the effect takes place
//!   if the handler succeeds — and replace its answer with a 500, or a 503
//!   after the hang; [`ChaosEvent::effect_status`] shows what the handler
//!   answered. Hangs end at once on shutdown. Same seed and same arrival
//!   order give the same faults; concurrent clients vary the order.
//!   Opt-in faults of the world ([`Chaos::host_outages`],
//!   [`Chaos::rate_storms`], [`Chaos::holds`], [`Chaos::outside_updates`])
//!   draw from the same RNG, once per eligible request and only for the
//!   kinds turned on (old seeds keep their faults), and happen at the
//!   request's arrival, before it is served: a host (the coordinator's too)
//!   down for a while, every rate-limit bucket of the request's machine
//!   emptied, a hold written without a nonce and removed later, a deploy
//!   from the metadata machines had when chaos was turned on, reusing any
//!   lease. [`SimHandle::chaos_world_events`] lists them.
//! - **Metadata writes are not fenced** ([`MetadataFencing`], default
//!   `Unfenced`). fly-go's `SetMetadata`/`DeleteMetadata` send no nonce and
//!   flyctl's blue-green deploy writes metadata without one onto machines it
//!   holds leases on (FLY-REALITY.md, "Leases and metadata"), so
//!   `POST`/`DELETE …/metadata/{key}` and `PATCH`/`PUT …/metadata` are
//!   accepted from anyone at any instant. What Fly does with a stale nonce is
//!   unknown: the worse case, accepted, whatever nonce (or none) is sent.
//!   Every other mutating call (update, restart, stop, start, cordon,
//!   uncordon) and lease refresh/release stay fenced. `FencedByLease` brings
//!   back the old refusal (409) for tests that still rely on it.
//! - **Operator writes.** [`SimHandle::set_metadata`] and
//!   [`SimHandle::delete_metadata`] write out of band (a test's hand). The
//!   `operator_*_metadata` calls behave like fly-go's `SetMetadata`: accepted
//!   at any instant, no nonce; only under `FencedByLease` are they refused
//!   while anyone holds an unexpired lease. None of them is a request: they
//!   are not logged, not faulted, and not audited as actions.
//! - **Rate limits** ([`RateLimits`], default [`RateLimits::fly`]), Fly's
//!   documented ones (FLY-REALITY.md, "Limits"): per machine, every non-GET
//!   call is an action with its own bucket per method and route (1/s, burst
//!   3); every GET of a machine route (the machine, its metadata, its lease,
//!   `wait`) a bucket per route at get-machine's 5/s, burst 10. Lease calls
//!   count as actions: acquire and refresh are the same `POST …/lease` and
//!   share a bucket, release (`DELETE`) has its own. Listing an app is not
//!   limited (no documented limit). Whether a 429 carries `Retry-After` is
//!   unknown ([`RetryAfter`]): by default it does not (the worse case: a
//!   client must pace itself); `Always` and `Mixed` (every other 429) are
//!   switches. The limit is taken at the front door (after auth, failing
//!   apps, queued and targeted faults), so a call its handler then refuses
//!   (409, 412, a down host's 503) has still used its token.
//! - **Host outages** ([`SimHandle::set_host_status`]). While a machine's
//!   `host_status` is not `ok` its JSON carries `incomplete_config` instead
//!   of `config` (fly-go `GetConfig` falls back to it), without metadata by
//!   default or with only Fly's own `fly_*` keys ([`HostDownMetadata`]); its
//!   agent is unreachable (503); metadata reads, lease acquire/refresh/release
//!   and every mutating call answer 503 *without effect*. What Fly does then
//!   is unknown; a 503 is the answer fly-go retries, and the case of a call
//!   that took effect although its answer was lost is the chaos `LostAfter`
//!   fault. `state` stays what Fly last knew. Works for any machine, the
//!   stopped coordinator included.
//! - **Cordon** is the Machine JSON's `cordoned`. A restart (and stop/start)
//!   keeps it (undocumented; switch [`SimHandle::set_restart_keeps_cordon`]);
//!   an update (through the API or from outside) clears it (unknown on Fly:
//!   the worse case, it does not survive).
//! - **Outside updates** ([`SimHandle::outside_update`]): `fly deploy` /
//!   `fly machine update` replace the whole config from the caller's earlier
//!   snapshot (metadata written since is reverted), give a new
//!   `instance_id`, clear the cordon and replace a started machine (agent on
//!   the tip, idle). [`OutsideLease::ReuseFound`] acts under a lease it
//!   finds and releases it, as flyctl reuses a nonce from the machine list.
//!   It is not the daemon's restart: no [`RestartEvent`], not `down_by_api`.
//! - **Stop timeout.** A restart's `timeout` query (a Go duration or
//!   seconds) overrides the machine's `kill_timeout`
//!   ([`SimMachine::kill_timeout`], Fly's 5 s by default); a stop's body
//!   `timeout` likewise. If it is shorter than what the agent needs to
//!   checkpoint ([`SimMachine::checkpoint_on_stop`]), the audit's
//!   [`RestartEvent::killed_before_checkpoint`] says so. The transition
//!   delay is `restart_delay` either way.
//! - **Checks and events.** The Machine JSON carries `checks` (each fixture
//!   machine has [`DEFAULT_CHECK`]) and `events` (newest first, at most 20,
//!   timestamps in ms). Restart, stop and update append a `user` event; each
//!   boot a `flyd` `start` event, after which checks are `critical` for
//!   [`SimFleet::checks_pass_after`] (tokio time), then `passing`.
//!   [`SimHandle::set_crash_loop`] makes a machine come back `started` but
//!   keep exiting: exit/start event pairs, checks critical, its agent
//!   unreachable (503) until switched off. [`SimHandle::set_check`] sets one
//!   check. flyctl waits for all checks passing and treats repeated exit
//!   events as a crash loop (FLY-REALITY.md, "Health").
//! - **Interleaving hooks** ([`SimHandle::before_next_call`],
//!   [`SimHandle::after_next_call`]), matched like targeted faults (machine,
//!   method, action), fire only for a call that passed the front door:
//!   before its handler runs, or after it took effect and before its answer
//!   is sent. They run outside the world lock, in the request's task, with a
//!   [`SimHandle`].
//! - **Audit** ([`SimHandle::enable_audit`]). A machine is *out* of its pool while
//!   it is cordoned, its agent is fenced, or a restart, stop or replacing
//!   update accepted through the API has not yet brought it back to
//!   `started` (a machine stopped by the fixture or by [`SimHandle::set_state`] is
//!   not out; forcing it `started` ends a take-down). The pool is the trimmed
//!   value of [`AuditConfig::pool_key`], `default` if missing or blank. The
//!   audit is updated under the world lock by every change that can move a
//!   machine (API mutations, agent drain/undrain/reload, transitions
//!   completing, out-of-band setters), so no short-lived state escapes it. A
//!   [`CapBreach`] is recorded each time a pool's out set grows beyond its
//!   cap. A [`RestartEvent`] is recorded when a restart, a stop of a machine
//!   not already stopped, or an update of a started machine is accepted, with
//!   the state just before it. A [`HeldAction`] is recorded for every
//!   mutating Fly API call (not GET, not the lease endpoints) and every
//!   cooperative agent POST that took effect — whatever the client was
//!   answered — on a machine that carried [`AuditConfig::hold_key`] just
//!   before, including the call that deletes the hold.
//! - **Coordination machines.** Leases and metadata do not depend on the
//!   machine state: a `stopped` machine (in any app) takes lease acquire,
//!   refresh and release and `…/metadata` reads and writes, under the same
//!   lease rule as any machine, and stays stopped.
//! - **Hang** and **HttpError** agents misbehave on the cooperative endpoints
//!   too; the other behaviours affect only the health report. Undrain with a
//!   different rotation tag than the fence's answers 409.
//! - **Clock.** Lease expiry, busy periods and report timestamps use the sim
//!   clock ([`SimFleet::clock`], the system's by default, plus
//!   [`SimHandle::advance_clock`]); delays (restart, reload,
//!   `wait` deadlines, rate-limit refill) use tokio time, so paused-time tests
//!   drive them with `tokio::time::advance`.
//!
//! Layout: `fixture` (what a test describes), `state` (the world behind one
//! mutex, never held across `.await`), `http` (routes, the recording/auth/
//! fault front door, errors), `fly_api` and `agent` (handlers), `chaos`
//! (random faults), `audit` (safety invariants), `view` (snapshots).

mod agent;
mod audit;
mod chaos;
mod fixture;
mod fly_api;
mod http;
mod state;
mod view;

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::SharedClock;
use chrono::{DateTime, TimeDelta, Utc};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

pub use audit::{AuditConfig, AuditReport, CapBreach, HeldAction, RestartEvent};
pub use chaos::{
    Chaos, ChaosEvent, ChaosFault, ChaosHolds, ChaosStats, ChaosWorldEvent, WorldFault,
    WorldFaultKind,
};
pub use fixture::{
    Behaviour, CAP_DRAIN, CAP_RELOAD, CheckStatus, DEFAULT_CHECK, DEFAULT_KILL_TIMEOUT,
    DEFAULT_LEASE_OWNER, DEFAULT_RELEASE_TIP, DEFAULT_TOKEN, HostDownMetadata, HostStatus,
    MetadataFencing, NON_HEX_REF, RateLimit, RateLimits, RetryAfter, SimApp, SimFleet, SimMachine,
};
pub use view::{
    Credential, LeaseView, OperatorWriteRefused, OutsideLease, RecordedRequest, RequestTarget,
    SimMachineView,
};

use audit::AuditState;
use state::{HookWhen, InjectedFailure, Lease, Shared, World, add, new_nonce, resolve_behaviour};

/// How long [`Sim::shutdown`] lets in-flight requests finish before cutting them off.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A running simulator. Dropping it stops the server (abruptly);
/// [`Sim::shutdown`] stops it gracefully.
/// How long a targeted hanging fault ([`SimHandle::fault_next_call`]) holds its answer.
const TARGETED_HANG: Duration = Duration::from_secs(3);

pub struct Sim {
    addr: SocketAddr,
    handle: SimHandle,
    server: Option<JoinHandle<()>>,
}

/// What tests do to a running simulator from outside (out-of-band writes,
/// faults, switches, the audit), without the server itself: cheap to clone,
/// and what an interleaving hook ([`SimHandle::before_next_call`]) is given.
/// A [`Sim`] dereferences to its handle.
#[derive(Clone)]
pub struct SimHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SimHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHandle").finish_non_exhaustive()
    }
}

/// An intervention run at an exact point of a daemon's call (see
/// [`SimHandle::before_next_call`]); it may do anything a test does from outside.
pub type Hook = Box<dyn FnOnce(&SimHandle) + Send>;

impl std::ops::Deref for Sim {
    type Target = SimHandle;

    fn deref(&self) -> &SimHandle {
        &self.handle
    }
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Sim {
    /// Binds `127.0.0.1:0` and serves `fleet` until shutdown. Must run inside
    /// a tokio runtime. Fails on duplicate app names or machine ids.
    pub async fn start(fleet: SimFleet) -> io::Result<Sim> {
        let world = World::from_fleet(fleet)?;
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(world));
        let app = http::router(Arc::clone(&shared));
        let cancel = shared.cancel.clone();
        let server = tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(cancel.cancelled_owned())
                .await;
            if let Err(error) = served {
                tracing::warn!(%error, "simulated fleet server stopped with an error");
            }
        });
        tracing::debug!(%addr, "simulated fleet listening");
        Ok(Sim {
            addr,
            handle: SimHandle { shared },
            server: Some(server),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL of the Fly API stand-in, without `/v1` (clients append it).
    pub fn api_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Health URL template for the daemon's app config.
    pub fn health_url_template(&self) -> String {
        format!("http://{}/agents/{{machine_id}}/health", self.addr)
    }

    /// Health URL of one machine's agent.
    pub fn health_url(&self, machine_id: &str) -> String {
        format!("http://{}/agents/{machine_id}/health", self.addr)
    }

    /// A handle on the simulator, for tasks and hooks.
    pub fn handle(&self) -> SimHandle {
        self.handle.clone()
    }

    /// Stops the server: hung agents and long-polls are released, in-flight
    /// requests get a few seconds to finish, pending transitions are dropped.
    pub async fn shutdown(mut self) {
        self.handle.shared.cancel.cancel();
        if let Some(server) = self.server.take() {
            let abort = server.abort_handle();
            if tokio::time::timeout(SHUTDOWN_GRACE, server).await.is_err() {
                tracing::warn!("simulated fleet did not stop in time; aborting it");
                abort.abort();
            }
        }
    }
}

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
        f: impl FnOnce(&mut state::MachineState, DateTime<Utc>),
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
    fn carry_out(&self, act: chaos::WorldAct) {
        let undo: Option<(Duration, Hook)> = match act {
            chaos::WorldAct::HostDown { machine_id, lasts } => {
                self.set_host_status(&machine_id, HostStatus::Unreachable);
                Some((
                    lasts,
                    Box::new(move |h: &SimHandle| {
                        h.set_host_status(&machine_id, HostStatus::Ok);
                    }),
                ))
            }
            chaos::WorldAct::Storm { machine_id } => {
                self.exhaust_rate_limits(&machine_id);
                None
            }
            chaos::WorldAct::Hold {
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
            chaos::WorldAct::OutsideUpdate {
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
        self.shared.lock().hooks.push(state::PendingHook {
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
            if on && m.state == state::STARTED {
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
                None => m.checks.push(state::Check {
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
            let scheduled =
                (m.state == state::STARTED).then(|| (m.transition(state::REPLACING, now), delay));
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

impl Drop for Sim {
    fn drop(&mut self) {
        self.handle.shared.cancel.cancel();
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

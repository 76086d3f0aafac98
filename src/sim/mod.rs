//! Simulated Fly Machines API and agent fleet, for `demo`, tests and benchmarks.
//!
//! [`Sim::start`] serves, on `127.0.0.1:0`, real HTTP that stands in for two
//! things the daemon talks to:
//!
//! - the Fly Machines API under `/v1` (list, get, update, restart, stop,
//!   start, wait, cordon, uncordon, leases, metadata), with the shapes of the
//!   official OpenAPI spec and the real lease envelope of docs/design.md §3;
//! - each machine's in-machine `/.fly/api` socket under
//!   `/_machine/{caller_id}/v1/…` (`machine_api`): metadata of any machine of
//!   the caller's app, no token, no lease — what a rogue agent ([`RogueAgent`])
//!   uses;
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
//! - **The in-machine socket** (`machine_api`, issue #33). Fly gives every
//!   machine `/.fly/api`, through which anything root in it reads and
//!   writes the metadata of any machine of its app with no token
//!   (FLY-REALITY.md). Here it is `/_machine/{caller}/v1/apps/{app}/machines/
//!   {id}/metadata[/{key}]` (GET, and POST/DELETE of one key): no token, never
//!   fenced by a lease (whatever [`MetadataFencing`] says), no new version;
//!   another app answers 403, an unknown caller 404, a caller not `started`
//!   503. Its calls are logged as [`RequestTarget::MachineApi`], take no
//!   fault, rate limit or hook, and are not the daemon's actions for the
//!   audit (no [`HeldAction`]). [`Sim::rogue`] gives a [`RogueAgent`] there.
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
//!   share a bucket, release (`DELETE`) has its own. Listing an app's
//!   machines has a bucket per app at Fly's documented 1/s, burst 3
//!   ([`SimFleet::list_rate_limit`], on while the others are). Whether a 429 carries `Retry-After` is
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
//!   fault (a 408 after the effect, Fly timing out talking to the host, is
//!   the targeted-only `TimedOutAfter`). `state` stays what Fly last knew. Works for any machine, the
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
//!   machine has [`DEFAULT_CHECK`]; `updated_at` with milliseconds, as Go
//!   writes it) and `events` (newest first, at most 20, timestamps in ms);
//!   its `config` defines one check per name it reports (`checks`) and its
//!   `stop_config.timeout` (the `kill_timeout`). Restart and stop also
//!   append a requested `exit` (its `request.exit_event` says
//!   `requested_stop`), a crash loop's exits are not requested, non-zero,
//!   and restarted (fly-go `MachineExitEvent`). Restart, stop and update append a `user` event; each
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
//! Layout, bottom up: each module imports only modules listed before it
//! (tests aside), so there is no circle between the router and its handlers.
//!
//! 1. `fixture` (what a test describes), `view` (snapshots tests assert on),
//!    `chaos` (random faults, drawn under the world lock), `wire` (the HTTP
//!    vocabulary: the JSON error shape, body parsing, token checks);
//! 2. `machine` (one machine and its agent, and the rules on it alone);
//! 3. `audit` (safety invariants over machines);
//! 4. `state` (the world behind one mutex, never held across `.await`, and
//!    delayed transitions);
//! 5. `handle` ([`SimHandle`]: out-of-band operations, hooks, the audit);
//! 6. `fly_api`, `agent` and `machine_api` (the handlers);
//! 7. `http` (the routes and the recording/auth/fault front door);
//! 8. `frozen` (read-only answers rendered once through `http` and served
//!    as static bytes: the benchmarks' loopback reference);
//! 9. `rogue` (a client of `machine_api` over HTTP, naming no sibling);
//! 10. this module: [`Sim`] (serve, shut down) and the public names.

mod agent;
mod audit;
mod chaos;
mod fixture;
mod fly_api;
mod frozen;
mod handle;
mod http;
mod machine;
mod machine_api;
mod records;
mod rogue;
mod socket_log;
mod state;
mod view;
mod wire;

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

pub use audit::{AuditConfig, AuditReport, CapBreach, HeldAction, RestartEvent};
pub use chaos::{
    Chaos, ChaosEvent, ChaosFault, ChaosHolds, ChaosStats, ChaosWorldEvent, WorldFault,
    WorldFaultKind,
};
pub use fixture::{
    Behaviour, CAP_DRAIN, CAP_RELOAD, CheckStatus, DEFAULT_CHECK, DEFAULT_KILL_TIMEOUT,
    DEFAULT_LEASE_OWNER, DEFAULT_RECORD_KEY, DEFAULT_RELEASE_TIP, DEFAULT_TOKEN, HostDownMetadata,
    HostStatus, MetadataFencing, NON_HEX_REF, RateLimit, RateLimits, RetryAfter, SimApp, SimFleet,
    SimMachine, record_keys,
};
pub use frozen::{FreezeError, FrozenFleet, FrozenServer};
pub use handle::{Hook, SimHandle};
pub use records::open_record;
pub use rogue::{MarkerField, RogueAgent, RogueError};
pub use socket_log::{Listing, SocketWrite};
pub use view::{
    Credential, LeaseView, OperatorWriteRefused, OutsideLease, RecordedRequest, RequestTarget,
    SimMachineView,
};

use state::{Shared, World};

/// How long [`Sim::shutdown`] lets in-flight requests finish before cutting them off.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A running simulator. Dropping it stops the server (abruptly);
/// [`Sim::shutdown`] stops it gracefully.
pub struct Sim {
    addr: SocketAddr,
    handle: SimHandle,
    server: Option<JoinHandle<()>>,
}

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
        wire::api_url(self.addr)
    }

    /// Health URL template for the daemon's app config.
    pub fn health_url_template(&self) -> String {
        wire::health_url_template(self.addr)
    }

    /// Health URL of one machine's agent.
    pub fn health_url(&self, machine_id: &str) -> String {
        wire::health_url(self.addr, machine_id)
    }

    /// Every app's machine list and every agent's health answer as this
    /// simulator gives them now, rendered once to be served as static
    /// bytes ([`FrozenFleet::serve`]): the loopback reference of the
    /// benchmarks. Refused when an agent hangs (its answer never ends).
    pub async fn freeze(&self) -> Result<FrozenFleet, FreezeError> {
        FrozenFleet::render(&self.handle.shared).await
    }

    /// A rogue agent inside machine `caller` (of whatever app it is in),
    /// calling this simulator's in-machine metadata socket; `None` if no
    /// such machine.
    pub fn rogue(&self, caller: &str) -> Option<RogueAgent> {
        let app = self.handle.shared.lock().machines.get(caller)?.app.clone();
        Some(RogueAgent::new(self.addr, caller, &app))
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

impl Drop for Sim {
    fn drop(&mut self) {
        self.handle.shared.cancel.cancel();
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    /// The modules in the layout's order (module docs), with their source.
    const LAYERS: [(&str, &str); 15] = [
        ("fixture", include_str!("fixture.rs")),
        ("view", include_str!("view.rs")),
        ("chaos", include_str!("chaos.rs")),
        ("wire", include_str!("wire.rs")),
        ("machine", include_str!("machine.rs")),
        ("audit", include_str!("audit.rs")),
        ("socket_log", include_str!("socket_log.rs")),
        ("state", include_str!("state.rs")),
        ("handle", include_str!("handle.rs")),
        ("fly_api", include_str!("fly_api.rs")),
        ("agent", include_str!("agent.rs")),
        ("machine_api", include_str!("machine_api.rs")),
        ("http", include_str!("http.rs")),
        ("frozen", include_str!("frozen.rs")),
        ("rogue", include_str!("rogue.rs")),
    ];

    /// The sibling modules a source names as `super::name` (also inside
    /// `super::{..}`), outside comments and its tests.
    fn named_siblings(source: &str) -> Vec<String> {
        let code = source.split("#[cfg(test)]").next().unwrap_or(source);
        let mut names = Vec::new();
        for line in code.lines().map(str::trim) {
            if line.starts_with("//") {
                continue;
            }
            for (at, _) in line.match_indices("super::") {
                let rest = &line[at + "super::".len()..];
                // `super::{a, b}` names each; `super::a::…` names `a`.
                let items: Vec<&str> = match rest.strip_prefix('{') {
                    Some(inner) => inner
                        .split('}')
                        .next()
                        .unwrap_or(inner)
                        .split(',')
                        .collect(),
                    None => vec![rest],
                };
                for item in items {
                    let name: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        names.push(name);
                    }
                }
            }
        }
        names
    }

    /// No circle inside the simulator: each module names only the modules
    /// before it in the layout (what `mod.rs` re-exports, such as
    /// `super::SimHandle`, counts as naming `mod.rs` itself, the top).
    #[test]
    fn modules_import_only_the_ones_below_them() {
        let rank = |name: &str| LAYERS.iter().position(|(n, _)| *n == name);
        let mut upward = Vec::new();
        for (at, (module, source)) in LAYERS.iter().enumerate() {
            for name in named_siblings(source) {
                if rank(&name).is_none_or(|r| r >= at) {
                    upward.push(format!("{module} names super::{name}"));
                }
            }
        }
        assert!(upward.is_empty(), "{upward:#?}");
    }
}

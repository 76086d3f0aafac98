//! Fixtures that describe a simulated fleet before it starts: apps, machines, agent behaviours.
//!
//! Plain data with public fields and chainable builders, so a test reads like
//! the fleet it sets up:
//! `SimApp::new("agents").machine(SimMachine::new("m1").loaded(OLD).behaviour(Behaviour::Hang))`.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::clock::SharedClock;

/// Fly token the simulator accepts when the fixture does not name one.
pub const DEFAULT_TOKEN: &str = "sim-fly-token";
/// Lease owner the simulator derives from the fleet token (Fly names the token's user).
pub const DEFAULT_LEASE_OWNER: &str = "reconciler@tokens.fly.io";
/// The record key (hex) the simulated fleet's reconciler and operators hold
/// (`[records] key_env`): what they write is sealed with it. Raw
/// [`super::SimHandle::set_metadata`] is what an agent does: never sealed.
pub const DEFAULT_RECORD_KEY: &str =
    "5eedc0de5eedc0de5eedc0de5eedc0de5eedc0de5eedc0de5eedc0de5eedc0de";

/// [`DEFAULT_RECORD_KEY`] as the keys a reconciler holds.
pub fn record_keys() -> crate::metadata::seal::RecordKeys {
    crate::metadata::seal::RecordKeys::new(
        crate::metadata::seal::RecordKey::from_hex(DEFAULT_RECORD_KEY)
            .expect("the simulator's record key is 32 bytes of hex"),
    )
}

/// Release tip when the fixture does not name one (40 hex digits).
pub const DEFAULT_RELEASE_TIP: &str = "c0ffee0000000000000000000000000000000001";
/// Capability advertising `POST overlay/drain` and `overlay/undrain` (docs/design.md §4).
pub const CAP_DRAIN: &str = "drain";
/// Capability advertising `POST overlay/reload` (docs/design.md §4).
pub const CAP_RELOAD: &str = "reload";
/// The ref a [`Behaviour::NonHexRef`] agent reports: a branch-like name, not a commit.
pub const NON_HEX_REF: &str = "release-2026-11";

/// How a simulated agent answers its health endpoint.
///
/// A restart (or start) of the machine resets the behaviour to [`Behaviour::Normal`]:
/// a fresh process is a well-behaved one until a test says otherwise.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Behaviour {
    /// A well-formed report of the loaded ref.
    #[default]
    Normal,
    /// Working until `until` (sim clock): `activity="busy"` and at least one live
    /// session; afterwards the agent behaves as [`Behaviour::Normal`].
    Busy { until: DateTime<Utc> },
    /// Like `Busy`, measured from the moment the behaviour is installed (fleet
    /// start or [`super::SimHandle::set_behaviour`]); stored as `Busy { until }`.
    BusyFor(Duration),
    /// Accepts the connection and never answers (until the simulator shuts
    /// down). Applies to the cooperative endpoints too.
    Hang,
    /// `200` with a body that is not JSON (although labelled `application/json`).
    Garbage,
    /// `200` with a valid-looking JSON report padded past 1 MiB, streamed in
    /// chunks without a `Content-Length`, so only a byte limit catches it.
    Oversized,
    /// `200` with a JSON report that has no `overlay_ref`.
    MissingRef,
    /// `200` with a JSON report whose `overlay_ref` is [`NON_HEX_REF`].
    NonHexRef,
    /// Answers every agent endpoint with this HTTP status (500 if not a valid status).
    HttpError(u16),
}

/// One token bucket: `per_second` refill, `burst` requests back to back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimit {
    /// Tokens added per second.
    pub per_second: f64,
    /// Bucket size: requests allowed back to back.
    pub burst: u32,
}

impl RateLimit {
    /// The limit Fly documents for machine actions: 1 request/s per action
    /// per machine, burst 3.
    pub fn fly() -> RateLimit {
        RateLimit {
            per_second: 1.0,
            burst: 3,
        }
    }

    /// The limit Fly documents for get-machine: 5 requests/s, burst 10.
    pub fn fly_get() -> RateLimit {
        RateLimit {
            per_second: 5.0,
            burst: 10,
        }
    }
}

/// Whether a 429 carries `Retry-After`: Fly's 429 shape is unknown
/// (FLY-REALITY.md, "Limits"), so a client must cope with both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RetryAfter {
    /// No header: the worse case, the client must pace itself.
    #[default]
    Never,
    /// `Retry-After: <seconds until a token>` on every 429.
    Always,
    /// Every other 429 carries it (the first does not).
    Mixed,
}

/// Fly's rate limits, per machine: every non-GET call is an *action* with a
/// bucket per (machine, method, route) at [`RateLimits::action`]; every GET
/// of a machine route (the machine, its metadata, its lease, `wait`) has a
/// bucket per (machine, route) at [`RateLimits::get`]. Listing an app's
/// machines has its own limit per app ([`SimFleet::list_rate_limit`]),
/// applied while these are on. On by default at Fly's documented limits
/// ([`RateLimits::fly`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimits {
    pub action: RateLimit,
    pub get: RateLimit,
    pub retry_after: RetryAfter,
}

impl RateLimits {
    /// Fly's documented limits, 429s without `Retry-After`.
    pub fn fly() -> RateLimits {
        RateLimits {
            action: RateLimit::fly(),
            get: RateLimit::fly_get(),
            retry_after: RetryAfter::Never,
        }
    }

    /// `limit` for every call (GETs included), 429s with `Retry-After`.
    pub fn uniform(limit: RateLimit) -> RateLimits {
        RateLimits {
            action: limit,
            get: limit,
            retry_after: RetryAfter::Always,
        }
    }

    pub fn retry_after(mut self, retry_after: RetryAfter) -> RateLimits {
        self.retry_after = retry_after;
        self
    }
}

/// Whether the sim refuses a metadata write (`POST`/`DELETE …/metadata/{key}`,
/// `PATCH`/`PUT …/metadata`) without the nonce of an unexpired lease.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MetadataFencing {
    /// As on Fly (FLY-REALITY.md, "Leases and metadata"): anyone may write
    /// metadata at any instant, with or without a nonce, stale or not.
    #[default]
    Unfenced,
    /// The old, idealized sim: a metadata write on a leased machine needs the nonce.
    FencedByLease,
}

/// What a machine whose host is down shows of its metadata in `incomplete_config`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostDownMetadata {
    /// No metadata at all (the worse case: holds, markers and slots vanish).
    #[default]
    Absent,
    /// Only the keys Fly itself sets (`fly_*`): the caller's own keys vanish
    /// while the map looks present.
    Partial,
}

/// Fly's `host_status` of a machine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostStatus {
    #[default]
    Ok,
    Unreachable,
    Unknown,
}

impl HostStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            HostStatus::Ok => "ok",
            HostStatus::Unreachable => "unreachable",
            HostStatus::Unknown => "unknown",
        }
    }
}

/// Status of one of Fly's health checks of a machine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CheckStatus {
    #[default]
    Passing,
    Warning,
    Critical,
}

impl CheckStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            CheckStatus::Passing => "passing",
            CheckStatus::Warning => "warning",
            CheckStatus::Critical => "critical",
        }
    }
}

/// Name of the health check every fixture machine has unless told otherwise.
pub const DEFAULT_CHECK: &str = "servicecheck-00-http-8080";
/// Fly's default `kill_timeout`.
pub const DEFAULT_KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// A whole simulated fleet: the Fly token, the apps and their machines, the release tip.
#[derive(Clone, Debug)]
pub struct SimFleet {
    /// Token every `/v1` request must present (`Bearer <token>` or `FlyV1 <token>`).
    /// A token that itself starts with `FlyV1 ` is compared without that prefix.
    pub token: String,
    /// Owner reported on leases taken with [`SimFleet::token`].
    pub lease_owner: String,
    pub apps: Vec<SimApp>,
    /// Commit an agent loads when its machine (re)starts.
    pub release_tip: String,
    /// Time from an accepted restart to state `started` (half `stopping`, half `starting`);
    /// stop and start take half of it.
    pub restart_delay: Duration,
    /// Time from an accepted `overlay/reload` to the agent reporting the new ref.
    pub reload_delay: Duration,
    /// Fly's rate limits ([`RateLimits::fly`] by default; `None`: unlimited).
    pub rate_limits: Option<RateLimits>,
    /// Listing an app's machines, per app, while `rate_limits` are on: Fly
    /// documents 1 request/s, burst 3 ([`RateLimit::fly`], the default;
    /// `None`: lists unlimited).
    pub list_rate_limit: Option<RateLimit>,
    /// Whether metadata writes need the lease nonce (not on Fly; see [`MetadataFencing`]).
    pub metadata_fencing: MetadataFencing,
    /// What `incomplete_config` shows of the metadata while a host is down.
    pub host_down_metadata: HostDownMetadata,
    /// Whether a restart (or stop/start) keeps the cordon (true by default;
    /// an update never does).
    pub restart_keeps_cordon: bool,
    /// After a boot, checks stay `critical` this long, then pass (tokio time).
    pub checks_pass_after: Duration,
    /// Record every request for [`super::SimHandle::requests`]; benchmarks may turn it off.
    pub record_requests: bool,
    /// The wall clock the sim reads (lease expiry, busy periods, report and
    /// request timestamps): the system's by default; a test on paused tokio
    /// time hands the daemon and the sim one [`crate::clock::TokioClock`].
    pub clock: SharedClock,
}

impl Default for SimFleet {
    fn default() -> Self {
        SimFleet {
            token: DEFAULT_TOKEN.to_string(),
            lease_owner: DEFAULT_LEASE_OWNER.to_string(),
            apps: Vec::new(),
            release_tip: DEFAULT_RELEASE_TIP.to_string(),
            restart_delay: Duration::from_millis(200),
            reload_delay: Duration::from_millis(100),
            rate_limits: Some(RateLimits::fly()),
            list_rate_limit: Some(RateLimit::fly()),
            metadata_fencing: MetadataFencing::Unfenced,
            host_down_metadata: HostDownMetadata::Absent,
            restart_keeps_cordon: true,
            checks_pass_after: Duration::from_millis(100),
            record_requests: true,
            clock: crate::clock::system(),
        }
    }
}

impl SimFleet {
    /// An empty fleet accepting `token`; everything else at its default.
    pub fn new(token: impl Into<String>) -> SimFleet {
        SimFleet {
            token: token.into(),
            ..SimFleet::default()
        }
    }

    pub fn release_tip(mut self, commit: impl Into<String>) -> SimFleet {
        self.release_tip = commit.into();
        self
    }

    pub fn restart_delay(mut self, delay: Duration) -> SimFleet {
        self.restart_delay = delay;
        self
    }

    pub fn reload_delay(mut self, delay: Duration) -> SimFleet {
        self.reload_delay = delay;
        self
    }

    pub fn lease_owner(mut self, owner: impl Into<String>) -> SimFleet {
        self.lease_owner = owner.into();
        self
    }

    /// `limit` for every call, 429s with `Retry-After` ([`RateLimits::uniform`]).
    pub fn rate_limit(mut self, limit: RateLimit) -> SimFleet {
        self.rate_limits = Some(RateLimits::uniform(limit));
        self
    }

    pub fn rate_limits(mut self, limits: Option<RateLimits>) -> SimFleet {
        self.rate_limits = limits;
        self
    }

    pub fn list_rate_limit(mut self, limit: Option<RateLimit>) -> SimFleet {
        self.list_rate_limit = limit;
        self
    }

    /// No rate limits at all (not Fly; for tests of something else).
    pub fn unlimited(mut self) -> SimFleet {
        self.rate_limits = None;
        self
    }

    pub fn metadata_fencing(mut self, fencing: MetadataFencing) -> SimFleet {
        self.metadata_fencing = fencing;
        self
    }

    pub fn host_down_metadata(mut self, shown: HostDownMetadata) -> SimFleet {
        self.host_down_metadata = shown;
        self
    }

    pub fn restart_keeps_cordon(mut self, keeps: bool) -> SimFleet {
        self.restart_keeps_cordon = keeps;
        self
    }

    pub fn checks_pass_after(mut self, delay: Duration) -> SimFleet {
        self.checks_pass_after = delay;
        self
    }

    /// The sim as it was before #19: metadata writes fenced by leases, no
    /// rate limits. Only for tests that rely on a guard Fly does not give;
    /// each says which daemon defect it waits for.
    pub fn idealized_fly(self) -> SimFleet {
        self.metadata_fencing(MetadataFencing::FencedByLease)
            .unlimited()
    }

    pub fn record_requests(mut self, on: bool) -> SimFleet {
        self.record_requests = on;
        self
    }

    /// Reads `clock` instead of the system's (see [`SimFleet::clock`]).
    pub fn clock(mut self, clock: SharedClock) -> SimFleet {
        self.clock = clock;
        self
    }

    pub fn app(mut self, app: SimApp) -> SimFleet {
        self.apps.push(app);
        self
    }
}

/// One Fly app and its machines.
#[derive(Clone, Debug, Default)]
pub struct SimApp {
    pub name: String,
    pub machines: Vec<SimMachine>,
}

impl SimApp {
    pub fn new(name: impl Into<String>) -> SimApp {
        SimApp {
            name: name.into(),
            machines: Vec::new(),
        }
    }

    pub fn machine(mut self, machine: SimMachine) -> SimApp {
        self.machines.push(machine);
        self
    }

    pub fn machines(mut self, machines: impl IntoIterator<Item = SimMachine>) -> SimApp {
        self.machines.extend(machines);
        self
    }
}

/// One machine and the agent running on it. Machine ids must be unique across
/// the whole fleet, because agent URLs are keyed by machine id alone.
#[derive(Clone, Debug)]
pub struct SimMachine {
    pub id: String,
    pub name: String,
    pub region: String,
    /// Fly machine state: `started`, `stopped`, ...
    pub state: String,
    /// `None`: assigned at start (`fdaa:0:1:a7b:<app>:<machine>:0:2`).
    pub private_ip: Option<String>,
    pub image: String,
    /// Machine metadata (`config.metadata`). Starts with the keys Fly itself sets.
    pub metadata: BTreeMap<String, String>,
    /// Commit the agent loaded; `None`: the fleet's release tip.
    pub loaded_ref: Option<String>,
    /// Report only the first `n` characters of the ref (abbreviated hex).
    pub report_ref_len: Option<usize>,
    pub behaviour: Behaviour,
    /// `"drain"`, `"reload"` (see [`CAP_DRAIN`], [`CAP_RELOAD`]).
    pub capabilities: Vec<String>,
    /// Sessions the agent reports while not busy (e.g. an open conversation).
    pub live_sessions: u32,
    pub last_input_at: Option<DateTime<Utc>>,
    /// Bearer token the cooperative endpoints require; health GETs never need it.
    pub agent_token: Option<String>,
    pub cordoned: bool,
    /// The app's `kill_timeout`: how long a stop or restart without its own
    /// `timeout` waits after the signal before killing.
    pub kill_timeout: Duration,
    /// How long the agent needs after its stop signal to checkpoint its work
    /// (zero: it needs nothing).
    pub checkpoint_on_stop: Duration,
    /// Names of Fly's health checks of the machine (each passing at start).
    pub checks: Vec<String>,
}

impl SimMachine {
    /// A started machine named after its id, in `iad`, whose agent loaded the
    /// release tip, is idle and advertises no capabilities. Its metadata holds
    /// the keys real Fly machines carry (`fly_platform_version`,
    /// `fly_process_group`), so consumers learn to ignore keys they don't own.
    pub fn new(id: impl Into<String>) -> SimMachine {
        let id = id.into();
        let metadata = BTreeMap::from([
            ("fly_platform_version".to_string(), "v2".to_string()),
            ("fly_process_group".to_string(), "app".to_string()),
        ]);
        SimMachine {
            name: id.clone(),
            id,
            region: "iad".to_string(),
            state: "started".to_string(),
            private_ip: None,
            image: "registry.fly.io/agents:deployment-01".to_string(),
            metadata,
            loaded_ref: None,
            report_ref_len: None,
            behaviour: Behaviour::Normal,
            capabilities: Vec::new(),
            live_sessions: 0,
            last_input_at: None,
            agent_token: None,
            cordoned: false,
            kill_timeout: DEFAULT_KILL_TIMEOUT,
            checkpoint_on_stop: Duration::ZERO,
            checks: vec![DEFAULT_CHECK.to_string()],
        }
    }

    pub fn name(mut self, name: impl Into<String>) -> SimMachine {
        self.name = name.into();
        self
    }

    pub fn region(mut self, region: impl Into<String>) -> SimMachine {
        self.region = region.into();
        self
    }

    pub fn state(mut self, state: impl Into<String>) -> SimMachine {
        self.state = state.into();
        self
    }

    pub fn stopped(self) -> SimMachine {
        self.state("stopped")
    }

    pub fn private_ip(mut self, ip: impl Into<String>) -> SimMachine {
        self.private_ip = Some(ip.into());
        self
    }

    pub fn image(mut self, image: impl Into<String>) -> SimMachine {
        self.image = image.into();
        self
    }

    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> SimMachine {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// The commit the agent loaded (full or any string; the sim does not validate it).
    pub fn loaded(mut self, commit: impl Into<String>) -> SimMachine {
        self.loaded_ref = Some(commit.into());
        self
    }

    pub fn report_ref_len(mut self, len: usize) -> SimMachine {
        self.report_ref_len = Some(len);
        self
    }

    pub fn behaviour(mut self, behaviour: Behaviour) -> SimMachine {
        self.behaviour = behaviour;
        self
    }

    pub fn capability(mut self, capability: impl Into<String>) -> SimMachine {
        let capability = capability.into();
        if !self.capabilities.contains(&capability) {
            self.capabilities.push(capability);
        }
        self
    }

    /// Advertises both `drain` and `reload`.
    pub fn cooperative(self) -> SimMachine {
        self.capability(CAP_DRAIN).capability(CAP_RELOAD)
    }

    pub fn live_sessions(mut self, sessions: u32) -> SimMachine {
        self.live_sessions = sessions;
        self
    }

    pub fn last_input_at(mut self, at: DateTime<Utc>) -> SimMachine {
        self.last_input_at = Some(at);
        self
    }

    pub fn agent_token(mut self, token: impl Into<String>) -> SimMachine {
        self.agent_token = Some(token.into());
        self
    }

    pub fn cordoned(mut self, cordoned: bool) -> SimMachine {
        self.cordoned = cordoned;
        self
    }

    pub fn kill_timeout(mut self, timeout: Duration) -> SimMachine {
        self.kill_timeout = timeout;
        self
    }

    /// The agent needs `needs` after its stop signal to checkpoint.
    pub fn checkpoint_on_stop(mut self, needs: Duration) -> SimMachine {
        self.checkpoint_on_stop = needs;
        self
    }

    /// Replaces the machine's health checks (none: an empty list).
    pub fn checks<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> SimMachine {
        self.checks = names.into_iter().map(Into::into).collect();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_tip_is_a_full_commit_id() {
        assert_eq!(DEFAULT_RELEASE_TIP.len(), 40);
        assert!(DEFAULT_RELEASE_TIP.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn builder_sets_fields_and_dedupes_capabilities() {
        let m = SimMachine::new("m1")
            .region("ams")
            .loaded("abc")
            .metadata("pool", "dispatch")
            .cooperative()
            .capability(CAP_DRAIN)
            .stopped();
        assert_eq!(m.name, "m1");
        assert_eq!(m.region, "ams");
        assert_eq!(m.loaded_ref.as_deref(), Some("abc"));
        assert_eq!(m.metadata.get("pool").map(String::as_str), Some("dispatch"));
        assert_eq!(m.capabilities, vec![CAP_DRAIN, CAP_RELOAD]);
        assert_eq!(m.state, "stopped");
    }
}

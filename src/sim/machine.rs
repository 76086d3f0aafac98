//! One simulated machine: Fly's view of it (state, metadata, lease, checks,
//! events) and the agent process on it (loaded ref, behaviour, sessions,
//! fence), with the rules that touch only that machine.
//!
//! Below the world (`state`) and the audit: it names only the fixtures, the
//! views and the HTTP vocabulary (`wire`), never the world, the handlers or
//! the router.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use serde::Serialize;

use super::fixture::{Behaviour, CAP_DRAIN, CheckStatus, HostStatus, NON_HEX_REF, SimMachine};
use super::view::{LeaseView, SimMachineView};
use super::wire::{ApiError, rfc3339};

pub(crate) const STARTED: &str = "started";
pub(crate) const STOPPED: &str = "stopped";
pub(crate) const STOPPING: &str = "stopping";
pub(crate) const STARTING: &str = "starting";
pub(crate) const REPLACING: &str = "replacing";
/// Events a Machine object lists (newest first); Fly lists a handful too.
pub(crate) const MAX_MACHINE_EVENTS: usize = 20;

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
    /// A machine as its fixture describes it, created at `now`; its agent
    /// has loaded `release_tip` unless the fixture says otherwise.
    pub(crate) fn from_fixture(
        app: &str,
        m: SimMachine,
        fallback_ip: impl FnOnce() -> String,
        release_tip: &str,
        now: DateTime<Utc>,
    ) -> MachineState {
        let agent = AgentState {
            loaded_ref: m.loaded_ref.unwrap_or_else(|| release_tip.to_string()),
            report_ref_len: m.report_ref_len,
            behaviour: resolve_behaviour(m.behaviour, now),
            capabilities: m.capabilities,
            live_sessions: m.live_sessions,
            last_input_at: m.last_input_at,
            agent_token: m.agent_token,
            fence: None,
        };
        MachineState {
            app: app.to_string(),
            id: m.id,
            name: m.name,
            region: m.region,
            state: m.state,
            instance_id: new_instance_id(),
            private_ip: m.private_ip.unwrap_or_else(fallback_ip),
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
        }
    }

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
            Some(lease) if nonce != Some(lease.nonce.as_str()) => Err(ApiError::lease_held(
                &self.id,
                &lease.owner,
                lease.expires_at,
            )),
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
            exit: None,
        });
    }

    /// Appends an exit event with what Fly says of the exit in its
    /// `request.exit_event` (fly-go `MachineExitEvent`).
    pub(crate) fn exit_event(&mut self, source: &'static str, exit: ExitEvent, now: DateTime<Utc>) {
        self.event("exit", "stopped", source, now);
        if let Some(e) = self.events.back_mut() {
            e.exit = Some(exit);
        }
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
            self.exit_event("flyd", ExitEvent::CRASH, now);
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
    /// An exit's `request.exit_event`.
    pub(crate) exit: Option<ExitEvent>,
}

/// What Fly says of an exit (fly-go `MachineExitEvent`): flyctl counts
/// toward a crash loop only exits Fly restarted, non-zero, not requested.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExitEvent {
    pub(crate) exit_code: i64,
    pub(crate) restarting: bool,
    pub(crate) requested_stop: bool,
}

impl ExitEvent {
    /// A process that died on its own; Fly restarts it.
    pub(crate) const CRASH: ExitEvent = ExitEvent {
        exit_code: 1,
        restarting: true,
        requested_stop: false,
    };
    /// The exit a restart call asks for (SIGTERM, then boot again).
    pub(crate) const RESTART: ExitEvent = ExitEvent {
        exit_code: 143,
        restarting: true,
        requested_stop: true,
    };
    /// The exit a stop call asks for.
    pub(crate) const STOP: ExitEvent = ExitEvent {
        exit_code: 143,
        restarting: false,
        requested_stop: true,
    };
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
    pub(crate) fn view(&self) -> LeaseView {
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

/// How a stop signal ended for the agent.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StopOutcome {
    pub(crate) timeout: Duration,
    pub(crate) killed_before_checkpoint: bool,
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
}

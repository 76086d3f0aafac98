//! Safety audit ([`super::SimHandle::enable_audit`]): what the simulator saw happen
//! to the fleet, recorded at the instant it happened.
//!
//! Polling the sim from a test would miss short-lived states (two machines
//! out for 50 ms); so the world updates the audit under its own lock after
//! every change that can matter, and the test reads the verdict at the end.
//!
//! Cost: a change touches one machine, so the audit keeps each machine's last
//! (app, pool, out) and the set of out machines per pool, and updates both in
//! O(log n) per change; only a breach copies the (small) out set.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::machine::{MachineState, StopOutcome};

/// Bound on each event list of the report; beyond it events are counted, not kept.
pub(crate) const MAX_AUDIT_EVENTS: usize = 10_000;
/// Pool of a machine without the pool key (the daemon's `severity::DEFAULT_POOL`).
const DEFAULT_POOL: &str = "default";
/// The daemon's operator-hold key (docs/design.md §6.6, `operator::HOLD_KEY`).
const HOLD_KEY: &str = "fleet_reconciler_hold";
/// The daemon's rotation-marker key (`operator::MARKER_KEY`).
const MARKER_KEY: &str = "fleet_reconciler_rotation";

/// What the audit checks against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditConfig {
    /// Metadata key naming a machine's pool; missing or blank means `default`.
    pub pool_key: String,
    /// Most machines of (app, pool) allowed out at once; pools not listed have no cap.
    pub caps: HashMap<(String, String), usize>,
    /// Metadata key whose presence (any value) puts a machine on operator hold.
    pub hold_key: String,
    /// Metadata key of the rotation marker, reported raw in [`RestartEvent::marker`].
    pub marker_key: String,
}

impl AuditConfig {
    /// No caps, this project's hold and marker keys.
    pub fn new(pool_key: impl Into<String>) -> AuditConfig {
        AuditConfig {
            pool_key: pool_key.into(),
            caps: HashMap::new(),
            hold_key: HOLD_KEY.to_string(),
            marker_key: MARKER_KEY.to_string(),
        }
    }

    /// Caps (app, pool) at `cap` machines out at once.
    pub fn cap(
        mut self,
        app: impl Into<String>,
        pool: impl Into<String>,
        cap: usize,
    ) -> AuditConfig {
        self.caps.insert((app.into(), pool.into()), cap);
        self
    }

    fn pool_of(&self, m: &MachineState) -> String {
        m.metadata
            .get(&self.pool_key)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
            .unwrap_or(DEFAULT_POOL)
            .to_string()
    }
}

impl Default for AuditConfig {
    /// Pool key `pool`, as the example configs use.
    fn default() -> AuditConfig {
        AuditConfig::new("pool")
    }
}

/// An instant at which more machines of a pool were out than its cap allows:
/// recorded each time the pool's out set grows beyond the cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapBreach {
    /// Sim clock.
    pub at: DateTime<Utc>,
    pub app: String,
    pub pool: String,
    /// The machines out at that instant, sorted.
    pub out: Vec<String>,
    pub cap: usize,
}

/// A restart, stop or replacing update accepted through the API, with the
/// machine's state at that instant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartEvent {
    /// Sim clock.
    pub at: DateTime<Utc>,
    pub app: String,
    pub machine_id: String,
    pub pool: String,
    /// `restart`, `stop`, or `update` (an update replaces a started machine).
    pub action: String,
    /// The agent had live work: busy, or live sessions in its report.
    pub busy: bool,
    /// The agent was fenced (drained).
    pub fenced: bool,
    /// The checkpoint the agent reported at that instant.
    pub checkpoint: Option<String>,
    /// The machine was on operator hold.
    pub held: bool,
    /// Raw value of the marker key.
    pub marker: Option<String>,
    /// Owner of the unexpired lease, if any.
    pub lease_owner: Option<String>,
    /// Restart and stop: how long the machine waited after the stop signal
    /// before killing (the request's `timeout`, else the `kill_timeout`).
    pub stop_timeout: Option<Duration>,
    /// Restart and stop: the agent needed longer than that to checkpoint
    /// ([`super::SimMachine::checkpoint_on_stop`]) and was killed first.
    pub killed_before_checkpoint: bool,
    /// The request's [`super::RecordedRequest::seq`].
    pub seq: u64,
}

/// A mutating Fly API request or cooperative agent POST that took effect on
/// a machine on operator hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldAction {
    /// Sim clock.
    pub at: DateTime<Utc>,
    pub machine_id: String,
    /// Method and action: `POST cordon`, `DELETE metadata`, `POST overlay/drain`, ...
    pub what: String,
    /// The request's [`super::RecordedRequest::seq`].
    pub seq: u64,
    /// When the audit first saw the hold this action met (sim clock): Fly
    /// does not fence metadata writes, so a call already on its way when the
    /// hold landed can meet it; a daemon that read the machine after this
    /// instant and still acted did not honour it.
    pub held_since: Option<DateTime<Utc>>,
}

/// What the audit recorded since it was enabled. The event lists keep the
/// first 10 000 events of each kind (the earliest evidence is the useful
/// one); the `dropped_*` counters say how many more there were.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// Whether [`super::SimHandle::enable_audit`] was called; an empty report otherwise.
    pub enabled: bool,
    pub cap_breaches: Vec<CapBreach>,
    /// Most machines out at once, per (app, pool); every pool seen is listed.
    pub max_out: BTreeMap<(String, String), usize>,
    pub restarts: Vec<RestartEvent>,
    pub held_actions: Vec<HeldAction>,
    pub dropped_cap_breaches: u64,
    pub dropped_restarts: u64,
    pub dropped_held_actions: u64,
    /// Machines out right now, per (app, pool) with any out, sorted.
    pub out_now: BTreeMap<(String, String), Vec<String>>,
    /// Machines whose metadata has the marker key right now, sorted.
    pub marked_now: Vec<String>,
}

/// Where a machine was last seen by the audit.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Placement {
    app: String,
    pool: String,
    out: bool,
}

/// A machine's audit-relevant state just before a request acts on it.
pub(crate) struct Snapshot {
    pool: String,
    busy: bool,
    fenced: bool,
    checkpoint: Option<String>,
    pub(crate) held: bool,
    marker: Option<String>,
    lease_owner: Option<String>,
}

/// The audit's running state, inside the world.
pub(crate) struct AuditState {
    config: AuditConfig,
    placements: HashMap<String, Placement>,
    out: HashMap<(String, String), BTreeSet<String>>,
    /// Since when each held machine has carried its hold, as observed.
    held_since: HashMap<String, DateTime<Utc>>,
    report: AuditReport,
}

/// Out of the pool: cordoned, fenced, or taken down through the API and not started again.
pub(crate) fn is_out(m: &MachineState) -> bool {
    m.cordoned || m.agent.fence.is_some() || m.down_by_api
}

fn push_bounded<T>(list: &mut Vec<T>, dropped: &mut u64, item: T) {
    if list.len() < MAX_AUDIT_EVENTS {
        list.push(item);
    } else {
        *dropped += 1;
    }
}

impl AuditState {
    /// Starts auditing from the fleet as it is: machines already out count
    /// (and may already breach a cap).
    pub(crate) fn new<'a>(
        config: AuditConfig,
        machines: impl IntoIterator<Item = &'a MachineState>,
        now: DateTime<Utc>,
    ) -> AuditState {
        let mut audit = AuditState {
            config,
            placements: HashMap::new(),
            out: HashMap::new(),
            held_since: HashMap::new(),
            report: AuditReport {
                enabled: true,
                ..AuditReport::default()
            },
        };
        for m in machines {
            audit.observe(m, now);
        }
        audit
    }

    pub(crate) fn held(&self, m: &MachineState) -> bool {
        m.metadata.contains_key(&self.config.hold_key)
    }

    pub(crate) fn snapshot(&self, m: &MachineState, now: DateTime<Utc>) -> Snapshot {
        let agent = &m.agent;
        Snapshot {
            pool: self.config.pool_of(m),
            busy: agent.busy(now) || agent.reported_sessions(now) > 0,
            fenced: agent.fence.is_some(),
            checkpoint: agent.checkpoint(now).map(str::to_string),
            held: self.held(m),
            marker: m.metadata.get(&self.config.marker_key).cloned(),
            lease_owner: m.active_lease(now).map(|l| l.owner.clone()),
        }
    }

    /// Re-evaluates one machine after a change: moves it between out sets,
    /// and records a new maximum or a breach if its pool's out set grew.
    pub(crate) fn observe(&mut self, m: &MachineState, now: DateTime<Utc>) {
        if self.held(m) {
            self.held_since.entry(m.id.clone()).or_insert(now);
        } else {
            self.held_since.remove(&m.id);
        }
        let placement = Placement {
            app: m.app.clone(),
            pool: self.config.pool_of(m),
            out: is_out(m),
        };
        let previous = self.placements.get(&m.id);
        if previous == Some(&placement) {
            return;
        }
        if let Some(previous) = previous.filter(|p| p.out) {
            let key = (previous.app.clone(), previous.pool.clone());
            if let Some(set) = self.out.get_mut(&key) {
                set.remove(&m.id);
            }
        }
        let key = (placement.app.clone(), placement.pool.clone());
        let max = self.report.max_out.entry(key.clone()).or_insert(0);
        if placement.out {
            let set = self.out.entry(key.clone()).or_default();
            if set.insert(m.id.clone()) {
                *max = (*max).max(set.len());
                if let Some(&cap) = self.config.caps.get(&key)
                    && set.len() > cap
                {
                    let breach = CapBreach {
                        at: now,
                        app: key.0,
                        pool: key.1,
                        out: set.iter().cloned().collect(),
                        cap,
                    };
                    let report = &mut self.report;
                    push_bounded(
                        &mut report.cap_breaches,
                        &mut report.dropped_cap_breaches,
                        breach,
                    );
                }
            }
        }
        self.placements.insert(m.id.clone(), placement);
    }

    pub(crate) fn record_restart(
        &mut self,
        m: &MachineState,
        before: Snapshot,
        action: &str,
        stop: Option<StopOutcome>,
        seq: u64,
        now: DateTime<Utc>,
    ) {
        let event = RestartEvent {
            at: now,
            app: m.app.clone(),
            machine_id: m.id.clone(),
            pool: before.pool,
            action: action.to_string(),
            busy: before.busy,
            fenced: before.fenced,
            checkpoint: before.checkpoint,
            held: before.held,
            marker: before.marker,
            lease_owner: before.lease_owner,
            stop_timeout: stop.map(|s| s.timeout),
            killed_before_checkpoint: stop.is_some_and(|s| s.killed_before_checkpoint),
            seq,
        };
        let report = &mut self.report;
        push_bounded(&mut report.restarts, &mut report.dropped_restarts, event);
    }

    pub(crate) fn record_held_action(
        &mut self,
        machine_id: &str,
        what: &str,
        seq: u64,
        now: DateTime<Utc>,
    ) {
        let action = HeldAction {
            at: now,
            machine_id: machine_id.to_string(),
            what: what.to_string(),
            seq,
            held_since: self.held_since.get(machine_id).copied(),
        };
        let report = &mut self.report;
        push_bounded(
            &mut report.held_actions,
            &mut report.dropped_held_actions,
            action,
        );
    }

    /// The report so far, with the current out sets and markers of `machines`.
    pub(crate) fn report<'a>(
        &self,
        machines: impl IntoIterator<Item = &'a MachineState>,
    ) -> AuditReport {
        let mut report = self.report.clone();
        report.out_now = self
            .out
            .iter()
            .filter(|(_, set)| !set.is_empty())
            .map(|(key, set)| (key.clone(), set.iter().cloned().collect()))
            .collect();
        let mut marked: Vec<String> = machines
            .into_iter()
            .filter(|m| m.metadata.contains_key(&self.config.marker_key))
            .map(|m| m.id.clone())
            .collect();
        marked.sort();
        report.marked_now = marked;
        report
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixture::{SimApp, SimFleet, SimMachine};
    use super::super::state::World;
    use super::*;

    fn world() -> World {
        let fleet = SimFleet::default().app(
            SimApp::new("a")
                .machine(SimMachine::new("p1").metadata("pool", "p"))
                .machine(SimMachine::new("p2").metadata("pool", " p "))
                .machine(SimMachine::new("blank").metadata("pool", "")),
        );
        World::from_fleet(fleet).expect("valid fleet")
    }

    fn audit(world: &World, cap: usize) -> AuditState {
        let config = AuditConfig::new("pool").cap("a", "p", cap);
        AuditState::new(config, world.machines.values(), Utc::now())
    }

    fn machine<'a>(world: &'a mut World, id: &str) -> &'a mut MachineState {
        world.machines.get_mut(id).expect("machine in fixture")
    }

    #[test]
    fn pools_are_trimmed_and_blank_means_default() {
        let w = world();
        let a = audit(&w, 1);
        let pools: BTreeSet<_> = a.report.max_out.keys().map(|(_, p)| p.as_str()).collect();
        assert_eq!(pools, BTreeSet::from(["default", "p"]));
    }

    #[test]
    fn a_breach_is_recorded_when_the_out_set_grows_past_the_cap() {
        let mut w = world();
        let mut a = audit(&w, 1);
        let now = Utc::now();
        machine(&mut w, "p1").cordoned = true;
        a.observe(&w.machines["p1"], now);
        // Observing an unchanged machine again records nothing.
        a.observe(&w.machines["p1"], now);
        assert!(a.report.cap_breaches.is_empty());
        machine(&mut w, "p2").agent.fence = Some("r".to_string());
        a.observe(&w.machines["p2"], now);
        assert_eq!(a.report.cap_breaches.len(), 1);
        assert_eq!(a.report.cap_breaches[0].out, vec!["p1", "p2"]);
        // Shrinking while still over the cap is not a new breach.
        machine(&mut w, "p1").cordoned = false;
        a.observe(&w.machines["p1"], now);
        assert_eq!(a.report.cap_breaches.len(), 1);
        assert_eq!(a.report.max_out[&("a".to_string(), "p".to_string())], 2);
    }

    #[test]
    fn machines_already_out_at_start_count() {
        let mut w = world();
        machine(&mut w, "p1").cordoned = true;
        machine(&mut w, "p2").down_by_api = true;
        let a = audit(&w, 1);
        assert_eq!(a.report.cap_breaches.len(), 1);
        let report = a.report(w.machines.values());
        assert_eq!(
            report.out_now[&("a".to_string(), "p".to_string())],
            vec!["p1", "p2"]
        );
    }

    #[test]
    fn event_lists_are_bounded_and_count_what_they_drop() {
        let w = world();
        let mut a = audit(&w, 1);
        let now = Utc::now();
        for seq in 0..(MAX_AUDIT_EVENTS as u64 + 5) {
            a.record_held_action("p1", "POST cordon", seq, now);
        }
        assert_eq!(a.report.held_actions.len(), MAX_AUDIT_EVENTS);
        assert_eq!(a.report.dropped_held_actions, 5);
        assert_eq!(a.report.held_actions[0].seq, 0, "the earliest are kept");
    }
}

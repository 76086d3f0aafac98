//! Issue #33: agents are untrusted. A rogue agent — a process that is root
//! in one machine — uses Fly's in-machine metadata socket (`/.fly/api`, no
//! token, any machine of its app; the simulator's `/_machine/{caller}/…`)
//! to steer the daemon: approve `now`, delete a hold, forge or alter a
//! marker, clear the probe-failure record, replay an approval, free the
//! slots of a coordinator misplaced into its app.
//!
//! Each test sets up a realistic situation with the real loop (sweep →
//! plan → execute) over loopback, makes legitimate operator writes through
//! `act::operator` (as the CLI and the admin API do), lets the rogue attack,
//! runs several sweeps, then asserts (a) nothing the promises of
//! docs/safety.md forbid happened and (b) `metadata_tampered` fired naming
//! the machine and the key. The alert is matched by its event name and the
//! alert's JSON, not by a Rust variant, so this file compiles whatever the
//! defence names it.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use fleet_reconciler::act::executor::ExecutorConfig;
use fleet_reconciler::act::operator::Operator;
use fleet_reconciler::clock::{SharedClock, TokioClock};
use fleet_reconciler::config::Config;
use fleet_reconciler::metadata::operator::{Approval, ApprovalMode};
use fleet_reconciler::metadata::{APPROVE_KEY, HOLD_KEY, MARKER_KEY, SLOTS_KEY, UNPROBED_KEY};
use fleet_reconciler::model::CommitId;
use fleet_reconciler::sim::{
    AuditConfig, Behaviour, CheckStatus, DEFAULT_CHECK, MarkerField, MetadataFencing,
    RequestTarget, RogueAgent, Sim, SimApp, SimFleet, SimMachine,
};

use crate::common::daemon::Daemon;
use crate::common::{OverlayRepo, eventually};
use crate::rotation::{Hand, claimed_then_restart};

const TOKEN: &str = "rogue-test-token";
const APP: &str = "app";
const COORD_APP: &str = "coord";
const COORD: &str = "c0";
/// The alert the defence raises (issue #33, "Fail closed and page").
const TAMPERED: &str = "metadata_tampered";

struct World {
    clock: SharedClock,
    overlay: OverlayRepo,
    tip: String,
    old: String,
}

fn world() -> World {
    let overlay = OverlayRepo::new();
    World {
        clock: Arc::new(TokioClock::starting_at(Utc::now())),
        tip: overlay.tip(),
        old: overlay.behind(1),
        overlay,
    }
}

/// A config with fast clocks, one pool `default` of cap `cap` whose every
/// severity takes `action`; `coordinator` is `APP/ID`.
fn config(
    sim: &Sim,
    w: &World,
    action: &str,
    cap: u32,
    rotation: &str,
    coordinator: &str,
) -> Arc<Config> {
    let text = w
        .overlay
        .config(&sim.api_url(), "m")
        .fly(r#"request_timeout = "5s""#)
        .overlay(r#"fetch_interval = "1h""#)
        .with(&format!(
            r#"
[sweep]
interval = "150ms"
[probe]
timeout = "500ms"
[[apps]]
name = "{APP}"
health_url = "{health}"
pool_key = "pool"
[pools.default]
max_concurrent_rotations = {cap}
actions = {{ low = "{action}", medium = "{action}", high = "{action}", critical = "{action}" }}
[rotation]
min_drift_age = "0s"
coordinator = "{coordinator}"
{rotation}
"#,
            health = sim.health_url_template(),
        ))
        .text();
    Arc::new(Config::parse(Path::new("rogue.toml"), &text).unwrap())
}

/// An attack's set-up: the agents' app (its machines in the order given)
/// with one pool of cap `cap` whose every severity takes `action`, and a
/// dedicated coordinator app (the right placement) unless it is misplaced.
/// Built by [`scenario`], started by [`Setup::start`].
struct Setup {
    w: World,
    machines: Vec<SimMachine>,
    action: &'static str,
    cap: u32,
    rotation: &'static str,
    audited: bool,
    misplaced_coordinator: bool,
}

fn scenario(action: &'static str, cap: u32) -> Setup {
    Setup {
        w: world(),
        machines: Vec::new(),
        action,
        cap,
        rotation: "",
        audited: false,
        misplaced_coordinator: false,
    }
}

/// The rogue in m1; busy m2 and m3 wait (`alert-and-wait`) for the one
/// slot of their pool, whose cap the simulator audits.
fn busy_pair_waiting_for_one_slot() -> Setup {
    scenario("alert-and-wait", 1)
        .rogue_host("m1")
        .busy(&["m2", "m3"])
        .audited()
}

impl Setup {
    /// The rogue's own machine: on the tip, idle, nothing to rotate.
    fn rogue_host(mut self, id: &str) -> Setup {
        self.machines
            .push(SimMachine::new(id).loaded(self.w.tip.clone()));
        self
    }

    /// Drifted machines whose agents are busy for the whole test.
    fn busy(mut self, ids: &[&str]) -> Setup {
        for id in ids {
            let m = SimMachine::new(*id)
                .loaded(self.w.old.clone())
                .behaviour(Behaviour::BusyFor(Duration::from_secs(3600)));
            self.machines.push(m);
        }
        self
    }

    /// A drifted, idle machine.
    fn drifted(mut self, id: &str) -> Setup {
        self.machines
            .push(SimMachine::new(id).loaded(self.w.old.clone()));
        self
    }

    /// More keys of `[rotation]`.
    fn rotation(mut self, keys: &'static str) -> Setup {
        self.rotation = keys;
        self
    }

    /// The simulator audits the pool's cap and every restart.
    fn audited(mut self) -> Setup {
        self.audited = true;
        self
    }

    /// The coordinator `COORD` is a stopped machine of the agents' own app
    /// (where a rogue can reach its slots), not of its own app.
    fn misplaced_coordinator(mut self) -> Setup {
        self.misplaced_coordinator = true;
        self
    }

    async fn start(self) -> Scene {
        let w = self.w;
        let mut fleet = SimFleet::new(TOKEN)
            .clock(w.clock.clone())
            .release_tip(w.tip.clone())
            .restart_delay(Duration::from_millis(200));
        let coordinator = if self.misplaced_coordinator {
            let coord = SimMachine::new(COORD).loaded(w.tip.clone()).stopped();
            fleet = fleet.app(SimApp::new(APP).machines(self.machines).machine(coord));
            format!("{APP}/{COORD}")
        } else {
            fleet = fleet
                .app(SimApp::new(APP).machines(self.machines))
                .app(SimApp::new(COORD_APP).machine(SimMachine::new(COORD).stopped()));
            format!("{COORD_APP}/{COORD}")
        };
        let sim = Sim::start(fleet).await.unwrap();
        if self.audited {
            sim.enable_audit(AuditConfig::new("pool").cap(APP, "default", self.cap as usize));
        }
        let cfg = config(&sim, &w, self.action, self.cap, self.rotation, &coordinator);
        Scene { w, sim, cfg }
    }
}

/// A started [`Setup`]: the simulator and the daemon's config.
struct Scene {
    w: World,
    sim: Sim,
    cfg: Arc<Config>,
}

impl Scene {
    /// The operator's CLI (what the admin API writes with too).
    fn operator(&self) -> Operator {
        crate::common::daemon::operator(&self.cfg, TOKEN)
            .with_lease_patience(Duration::from_secs(10))
    }

    /// alice's approval of the tip.
    fn approval(&self, mode: ApprovalMode) -> Approval {
        Approval {
            target: CommitId::parse(&self.w.tip).expect("a commit id"),
            mode,
            by: "alice".into(),
            at: self.sim.now(),
        }
    }

    /// An operator approves `id` (see [`Scene::approval`]).
    async fn approve(&self, id: &str, mode: ApprovalMode) {
        self.operator()
            .approve(&id.into(), &self.approval(mode))
            .await
            .unwrap();
    }

    /// An operator holds `id`; returns the last request's number before
    /// the daemon can act on it.
    async fn hold(&self, id: &str, by: &str, reason: &str) -> u64 {
        self.operator()
            .hold(&id.into(), by, reason, self.sim.now())
            .await
            .unwrap();
        last_seq(&self.sim)
    }

    /// The rogue: an agent root in m1.
    fn rogue(&self) -> RogueAgent {
        self.sim.rogue("m1").unwrap()
    }

    async fn daemon(&self) -> Daemon {
        Daemon::build("replica", TOKEN)
            .start(&self.sim, self.cfg.clone())
            .await
    }

    /// Plans and runs steps by hand, as `hand`.
    async fn hand(&self) -> Hand {
        Hand::with_token(
            &self.sim,
            self.cfg.clone(),
            TOKEN,
            ExecutorConfig::new("hand"),
        )
        .await
    }

    /// Waits until `id` runs the tip with its rotation ended and its
    /// approval consumed.
    async fn rotated_with_its_approval(&self, id: &str) {
        eventually(
            &format!("{id} rotated with its approval"),
            Duration::from_secs(20),
            async || {
                self.sim.machine(id).is_some_and(|m| {
                    m.loaded_ref == self.w.tip
                        && !m.metadata.contains_key(MARKER_KEY)
                        && !m.metadata.contains_key(APPROVE_KEY)
                })
            },
        )
        .await;
    }

    /// `id` runs the old ref again (reloaded out of band), its agent busy.
    fn busy_again(&self, id: &str) {
        self.sim.set_loaded_ref(id, &self.w.old);
        self.sim
            .set_behaviour(id, Behaviour::BusyFor(Duration::from_secs(3600)));
    }

    async fn finish(self, d: Daemon) {
        d.stop().await;
        self.sim.shutdown().await;
    }
}

/// Whether an alert named `event` fired for `machine`.
fn alerted(d: &Daemon, event: &str, machine: &str) -> bool {
    d.alerts()
        .iter()
        .any(|a| a.kind.trigger_name() == event && a.machine == machine)
}

/// Whether `metadata_tampered` fired for `machine` naming `key` (the
/// metadata key, or its short name after `fleet_reconciler_`).
fn tampered(d: &Daemon, machine: &str, key: &str) -> bool {
    let short = format!("\"{}\"", key.trim_start_matches("fleet_reconciler_"));
    d.alerts().iter().any(|a| {
        a.kind.trigger_name() == TAMPERED
            && a.machine == machine
            && (a.json.contains(key) || a.json.contains(&short))
    })
}

/// Every alert seen (event and machine), for failure messages.
fn alerts(d: &Daemon) -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> = d
        .alerts()
        .into_iter()
        .map(|a| (a.kind.trigger_name().to_string(), a.machine))
        .collect();
    all.sort();
    all.dedup();
    all
}

fn assert_tampered(d: &Daemon, machine: &str, key: &str) {
    assert!(
        tampered(d, machine, key),
        "no {TAMPERED} for {machine} naming {key}: {:?}",
        alerts(d)
    );
}

/// Restarts of `id` Fly accepted through its API.
fn restarts(sim: &Sim, id: &str) -> usize {
    sim.requests()
        .iter()
        .filter(|r| {
            r.target == RequestTarget::FlyApi
                && r.machine_id.as_deref() == Some(id)
                && r.action.as_deref() == Some("restart")
                && r.status == Some(200)
        })
        .count()
}

/// Mutating Fly API calls on `id` (the daemon's: not leases, not reads, not
/// the rogue's socket) numbered after `after`. Putting the hold itself back
/// is no action on the machine: a defence may restore a deleted hold.
fn mutations_after(sim: &Sim, id: &str, after: u64) -> Vec<String> {
    let hold_path = format!("/metadata/{HOLD_KEY}");
    sim.requests()
        .iter()
        .filter(|r| {
            r.seq > after
                && r.machine_id.as_deref() == Some(id)
                && r.is_mutating()
                && !r.path.ends_with(&hold_path)
        })
        .map(|r| format!("{} {} -> {:?}", r.method, r.path, r.status))
        .collect()
}

/// The audit found no pool over its cap and no busy machine restarted.
fn assert_no_cap_breach_nor_busy_restart(sim: &Sim) {
    let audit = sim.audit();
    assert!(audit.cap_breaches.is_empty(), "{:?}", audit.cap_breaches);
    assert!(
        audit.restarts.iter().all(|r| !r.busy),
        "{:?}",
        audit.restarts
    );
}

fn last_seq(sim: &Sim) -> u64 {
    sim.requests().last().map_or(0, |r| r.seq)
}

// ---- the socket -------------------------------------------------------------------------

/// The simulator's `/.fly/api`: any machine of the caller's app, no token,
/// not fenced by a lease even where the token API is, no new version;
/// another app's machines are out of reach.
#[tokio::test]
async fn the_in_machine_socket_reaches_every_machine_of_its_app_and_no_other() {
    let w = world();
    let fleet = SimFleet::new(TOKEN)
        .clock(w.clock.clone())
        .metadata_fencing(MetadataFencing::FencedByLease)
        .app(SimApp::new(APP).machines(vec![
            SimMachine::new("m1"),
            SimMachine::new("m2"),
            SimMachine::new("m3").stopped(),
        ]))
        .app(SimApp::new("other").machine(SimMachine::new("o1").metadata("k", "v")));
    let sim = Sim::start(fleet).await.unwrap();
    let rogue = sim.rogue("m1").unwrap();
    let version = sim.machine("m2").unwrap().instance_id;
    sim.acquire_lease_as("m2", "daemon", Duration::from_secs(60))
        .expect("leased");

    rogue.write("m2", "k", "forged").await.unwrap();
    assert_eq!(
        sim.machine("m2")
            .unwrap()
            .metadata
            .get("k")
            .map(String::as_str),
        Some("forged")
    );
    assert_eq!(
        rogue.read("m2", "k").await.unwrap().as_deref(),
        Some("forged")
    );
    assert_eq!(
        sim.machine("m2").unwrap().instance_id,
        version,
        "a metadata write made a new version"
    );
    rogue.delete("m2", "k").await.unwrap();
    assert!(!sim.machine("m2").unwrap().metadata.contains_key("k"));
    // Its own machine too.
    rogue.write("m1", "k", "mine").await.unwrap();
    assert_eq!(
        sim.machine("m1")
            .unwrap()
            .metadata
            .get("k")
            .map(String::as_str),
        Some("mine")
    );

    // Another app: refused, nothing read or written.
    let other = fleet_reconciler::sim::RogueAgent::new(sim.addr(), "m1", "other");
    let refused = other.write("o1", "k", "forged").await.unwrap_err();
    assert!(refused.to_string().contains("403"), "{refused}");
    assert!(
        other
            .read_all("o1")
            .await
            .unwrap_err()
            .to_string()
            .contains("403")
    );
    assert_eq!(
        sim.machine("o1")
            .unwrap()
            .metadata
            .get("k")
            .map(String::as_str),
        Some("v")
    );
    // No such machine, no socket.
    let nobody = fleet_reconciler::sim::RogueAgent::new(sim.addr(), "ghost", APP);
    assert!(
        nobody
            .read_all("m2")
            .await
            .unwrap_err()
            .to_string()
            .contains("404")
    );
    // Nothing runs in a stopped machine to call its socket.
    let stopped = sim.rogue("m3").unwrap();
    assert!(
        stopped
            .write("m2", "k", "x")
            .await
            .unwrap_err()
            .to_string()
            .contains("503")
    );
    assert!(!sim.machine("m2").unwrap().metadata.contains_key("k"));
    // The token API is still fenced under `FencedByLease`: the socket is not.
    assert!(sim.operator_set_metadata("m2", "k", "x").is_err());
    sim.shutdown().await;
}

/// The simulator keeps each socket write with the listings of its app that
/// showed it (what a sweep could have seen): a write listed while it stood
/// names that listing; once a listing finds the key changed no later one
/// counts, even one that finds the value again; a write replaced before any
/// listing names none; a `summary` listing (no metadata) and another app's
/// listing show nothing.
#[tokio::test]
async fn the_sim_records_which_listings_showed_each_socket_write() {
    let w = world();
    let fleet = SimFleet::new(TOKEN)
        .clock(w.clock.clone())
        .unlimited()
        .app(SimApp::new(APP).machines(vec![SimMachine::new("m1"), SimMachine::new("m2")]))
        .app(SimApp::new("other").machine(SimMachine::new("o1")));
    let sim = Sim::start(fleet).await.unwrap();
    let http = reqwest::Client::new();
    let list = async |app: &str, query: &str| {
        let answer = http
            .get(format!("{}/v1/apps/{app}/machines{query}", sim.api_url()))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert!(answer.status().is_success(), "{answer:?}");
        last_seq(&sim)
    };
    let rogue = sim.rogue("m1").unwrap();
    rogue.write("m2", "k", "forged").await.unwrap();
    list("other", "").await;
    list(APP, "?summary=true").await;
    let first = list(APP, "").await;
    let second = list(APP, "").await;
    sim.set_metadata("m2", "k", "daemon");
    list(APP, "").await;
    sim.set_metadata("m2", "k", "forged");
    list(APP, "").await;
    // Replaced before any listing: never shown.
    rogue.delete("m1", "k2").await.unwrap();
    sim.set_metadata("m1", "k2", "ours");
    list(APP, "").await;
    let writes = sim.socket_writes();
    assert_eq!(writes.len(), 2, "{writes:?}");
    let (forged, deleted) = (&writes[0], &writes[1]);
    assert_eq!(
        (
            forged.machine_id.as_str(),
            forged.key.as_str(),
            forged.value.as_deref()
        ),
        ("m2", "k", Some("forged"))
    );
    let seqs: Vec<u64> = forged.listed_in.iter().map(|l| l.seq).collect();
    assert_eq!(seqs, [first, second]);
    assert!(
        forged
            .listed_in
            .iter()
            .all(|l| l.by == forged.listed_in[0].by && !l.by.is_empty()),
        "{forged:?}"
    );
    assert!(forged.replaced);
    assert_eq!(
        (deleted.machine_id.as_str(), deleted.value.as_deref()),
        ("m1", None)
    );
    assert!(
        deleted.listed_in.is_empty() && deleted.replaced,
        "{deleted:?}"
    );
    // Who could know what a write replaced: the listers of the value before.
    assert!(forged.prior_seen_by.is_empty(), "{forged:?}");
    sim.set_metadata("m2", "k3", "record");
    list(APP, "").await;
    rogue.delete("m2", "k3").await.unwrap();
    let gone = sim.socket_writes().pop().unwrap();
    assert_eq!(gone.prior_seen_by, [forged.listed_in[0].by.clone()]);
    sim.shutdown().await;
}

// ---- the attacks ------------------------------------------------------------------------

/// In a `manual` pool every machine is busy; an operator approved m3 `when-idle`.
/// The rogue in m1 approves `now` for itself (forged in today's format) and
/// for its busy neighbour m2 (m3's approval copied, mode changed).
#[tokio::test(start_paused = true)]
async fn a_rogue_approving_now_for_itself_and_a_busy_neighbour_restarts_nothing() {
    let s = scenario("manual", 3)
        .busy(&["m1", "m2", "m3"])
        .start()
        .await;
    s.approve("m3", ApprovalMode::WhenIdle).await;
    let d = s.daemon().await;
    eventually(
        "approval asked for m2",
        Duration::from_secs(10),
        async || alerted(&d, "manual_approval_required", "m2"),
    )
    .await;
    let rogue = s.rogue();
    rogue
        .forge_approval_now("m1", &s.w.tip, "alice", s.sim.now())
        .await
        .unwrap();
    rogue.copy_approval_as_now("m3", "m2").await.unwrap();
    d.more_sweeps(8).await;
    assert_eq!(
        restarts(&s.sim, "m1"),
        0,
        "the rogue's forged approval restarted its own live work"
    );
    assert_eq!(
        restarts(&s.sim, "m2"),
        0,
        "a copied approval restarted a busy neighbour"
    );
    assert_eq!(
        restarts(&s.sim, "m3"),
        0,
        "when-idle restarted a busy machine"
    );
    assert_tampered(&d, "m1", APPROVE_KEY);
    assert_tampered(&d, "m2", APPROVE_KEY);
    s.finish(d).await;
}

/// An operator held drifted m2 (`restart` pool); the rogue in m1 deletes the hold.
#[tokio::test(start_paused = true)]
async fn a_hold_a_rogue_deleted_is_still_honoured() {
    let s = scenario("restart", 1)
        .rogue_host("m1")
        .drifted("m2")
        .rotation("restart_grace = \"0s\"")
        .start()
        .await;
    let held_at = s.hold("m2", "oncall", "incident 51").await;
    let d = s.daemon().await;
    d.more_sweeps(3).await;
    let deleted = s.rogue().delete_hold("m2").await.unwrap();
    assert!(deleted.is_some(), "there was a hold to delete");
    d.more_sweeps(8).await;
    let acted = mutations_after(&s.sim, "m2", held_at);
    assert!(
        acted.is_empty(),
        "acted on a held machine after its hold was deleted by a rogue: {acted:?}"
    );
    assert_eq!(restarts(&s.sim, "m2"), 0);
    assert_tampered(&d, "m2", HOLD_KEY);
    s.finish(d).await;
}

/// Cap 1, `alert-and-wait`: m3's rotation holds the slot, waiting for it to
/// go idle; m2 (busy) waits for the slot. The rogue copies m3's marker onto
/// m2 in phase `restarting`.
#[tokio::test(start_paused = true)]
async fn a_forged_restarting_marker_is_never_acted_on() {
    let s = busy_pair_waiting_for_one_slot().start().await;
    let d = s.daemon().await;
    let model = in_flight(&s.sim, &d, &["m2", "m3"]).await;
    let victim = if model == "m2" { "m3" } else { "m2" };
    d.more_sweeps(2).await;
    let forged_at = last_seq(&s.sim);
    s.rogue()
        .forge_restarting_marker_from(&model, victim, s.sim.now())
        .await
        .unwrap();
    d.more_sweeps(8).await;
    let acted = mutations_after(&s.sim, victim, forged_at);
    assert!(
        acted.is_empty(),
        "acted on {victim} after a forged marker: {acted:?}"
    );
    assert_eq!(restarts(&s.sim, victim), 0, "restarted busy {victim}");
    assert_no_cap_breach_nor_busy_restart(&s.sim);
    assert_tampered(&d, victim, MARKER_KEY);
    s.finish(d).await;
}

/// Waits for a rotation to hold the slot on one of `ids`; returns which.
async fn in_flight(sim: &Sim, d: &Daemon, ids: &[&str]) -> String {
    let mut found = String::new();
    eventually(
        "a rotation in flight",
        Duration::from_secs(15),
        async || match ids.iter().find(|id| {
            sim.machine(id)
                .is_some_and(|m| m.metadata.contains_key(MARKER_KEY) && m.cordoned)
        }) {
            Some(id) => {
                found = id.to_string();
                true
            }
            None => false,
        },
    )
    .await;
    d.more_sweeps(1).await;
    found
}

/// A rotation in flight (cap 1, busy machines, `alert-and-wait`); the rogue
/// rewrites one field of its marker.
async fn marker_rewritten(field: MarkerField) {
    let s = busy_pair_waiting_for_one_slot().start().await;
    let d = s.daemon().await;
    let victim = in_flight(&s.sim, &d, &["m2", "m3"]).await;
    let other = if victim == "m2" { "m3" } else { "m2" };
    let before = s.sim.machine(&victim).unwrap().metadata[MARKER_KEY].clone();
    let written = s
        .rogue()
        .rewrite_marker(&victim, field, &s.w.old)
        .await
        .unwrap();
    assert_ne!(before, written, "the rewrite changed nothing");
    d.more_sweeps(8).await;
    assert_eq!(restarts(&s.sim, &victim), 0, "restarted busy {victim}");
    assert_eq!(restarts(&s.sim, other), 0, "restarted busy {other}");
    let audit = s.sim.audit();
    assert!(
        audit.cap_breaches.is_empty(),
        "cap exceeded after a rewritten {field:?}: {:?}",
        audit.cap_breaches
    );
    assert!(
        tampered(&d, &victim, MARKER_KEY),
        "no {TAMPERED} for {victim} ({field:?}): {:?}",
        alerts(&d)
    );
    s.finish(d).await;
}

#[tokio::test(start_paused = true)]
async fn a_markers_target_rewritten_by_a_rogue_is_alerted() {
    marker_rewritten(MarkerField::Target).await;
}

#[tokio::test(start_paused = true)]
async fn a_markers_tag_rewritten_by_a_rogue_is_alerted() {
    marker_rewritten(MarkerField::Tag).await;
}

#[tokio::test(start_paused = true)]
async fn a_markers_attempt_rewritten_by_a_rogue_is_alerted() {
    marker_rewritten(MarkerField::Attempt(99)).await;
}

/// m2's agent stopped answering and Fly's check fails: the daemon records
/// the probe failure. The rogue in m1 keeps deleting the record.
#[tokio::test(start_paused = true)]
async fn a_probe_failure_record_a_rogue_deleted_is_alerted() {
    let s = scenario("alert-and-wait", 1)
        .rogue_host("m1")
        .busy(&["m2"])
        .rotation("probe_failure_ceiling = \"1h\"\nrecent_input_guard = \"1h\"")
        .start()
        .await;
    s.sim.set_last_input_at("m2", Some(s.sim.now()));
    let d = s.daemon().await;
    d.more_sweeps(2).await;
    s.sim.set_behaviour("m2", Behaviour::HttpError(503));
    s.sim.set_check("m2", DEFAULT_CHECK, CheckStatus::Critical);
    eventually("evidence recorded", Duration::from_secs(10), async || {
        s.sim
            .machine("m2")
            .is_some_and(|m| m.metadata.contains_key(UNPROBED_KEY))
    })
    .await;
    let rogue = s.rogue();
    for _ in 0..3 {
        rogue.delete_unprobed("m2").await.unwrap();
        d.more_sweeps(2).await;
    }
    assert_tampered(&d, "m2", UNPROBED_KEY);
    s.finish(d).await;
}

/// As above, but the rogue deletes each probe-failure record the moment
/// the daemon's write of it lands, before any sweep lists it: the replica
/// that wrote it knows it was there.
#[tokio::test(start_paused = true)]
async fn a_probe_failure_record_deleted_before_any_sweep_saw_it_is_alerted() {
    let s = scenario("alert-and-wait", 1)
        .rogue_host("m1")
        .busy(&["m2"])
        .rotation("probe_failure_ceiling = \"1h\"\nrecent_input_guard = \"1h\"")
        .start()
        .await;
    s.sim.set_last_input_at("m2", Some(s.sim.now()));
    let deleted = Arc::new(Mutex::new(0usize));
    delete_each_unprobed_record_as_written(&s.sim.handle(), "m2", deleted.clone());
    let d = s.daemon().await;
    d.more_sweeps(2).await;
    s.sim.set_behaviour("m2", Behaviour::HttpError(503));
    s.sim.set_check("m2", DEFAULT_CHECK, CheckStatus::Critical);
    eventually("a record deleted", Duration::from_secs(10), async || {
        *deleted.lock().unwrap() > 0
    })
    .await;
    d.more_sweeps(4).await;
    assert_tampered(&d, "m2", UNPROBED_KEY);
    s.finish(d).await;
}

/// After every metadata write on `id`, deletes the probe-failure record if
/// that write put one there (what the rogue's socket can do, at the worst
/// moment: before the daemon's next listing).
fn delete_each_unprobed_record_as_written(
    sim: &fleet_reconciler::sim::SimHandle,
    id: &'static str,
    deleted: Arc<Mutex<usize>>,
) {
    sim.after_next_call(id, "POST", "metadata", move |h| {
        if h.machine(id)
            .is_some_and(|m| m.metadata.contains_key(UNPROBED_KEY))
        {
            h.delete_metadata(id, UNPROBED_KEY);
            *deleted.lock().unwrap() += 1;
        }
        delete_each_unprobed_record_as_written(h, id, deleted);
    });
}

/// An operator approved busy m3 `now`; the rogue in m1 read the value. Once
/// m3 rotated (its approval consumed) the rogue replays it onto busy m2.
#[tokio::test(start_paused = true)]
async fn an_approval_replayed_onto_another_machine_restarts_nothing() {
    let s = scenario("manual", 2)
        .rogue_host("m1")
        .busy(&["m2", "m3"])
        .start()
        .await;
    s.approve("m3", ApprovalMode::Now).await;
    let rogue = s.rogue();
    let stolen = rogue.steal_approval("m3").await.unwrap();
    let d = s.daemon().await;
    s.rotated_with_its_approval("m3").await;
    rogue.replay_approval(&stolen, "m2").await.unwrap();
    d.more_sweeps(8).await;
    assert_eq!(
        restarts(&s.sim, "m2"),
        0,
        "a replayed approval restarted busy m2"
    );
    assert_tampered(&d, "m2", APPROVE_KEY);
    s.finish(d).await;
}

/// An operator approved busy m3 `now`; the rogue in m1 read the sealed
/// value. m3 rotated (the approval consumed); later m3 runs an old ref again
/// (reloaded out of band) and is busy. The rogue writes the consumed
/// approval back onto m3, its own machine and key, so its seal verifies: a
/// consumed approval must not approve again (issue #33 item 2).
#[tokio::test(start_paused = true)]
async fn a_consumed_approval_replayed_onto_its_own_machine_restarts_nothing() {
    let s = scenario("manual", 2)
        .rogue_host("m1")
        .busy(&["m3"])
        .start()
        .await;
    s.approve("m3", ApprovalMode::Now).await;
    let rogue = s.rogue();
    let stolen = rogue.steal_approval("m3").await.unwrap();
    let d = s.daemon().await;
    s.rotated_with_its_approval("m3").await;
    assert_eq!(restarts(&s.sim, "m3"), 1, "the approval restarted m3 once");
    s.busy_again("m3");
    eventually(
        "m3 waits for an approval again",
        Duration::from_secs(10),
        async || alerted(&d, "manual_approval_required", "m3"),
    )
    .await;
    rogue.replay_approval(&stolen, "m3").await.unwrap();
    d.more_sweeps(8).await;
    assert_eq!(
        restarts(&s.sim, "m3"),
        1,
        "a consumed approval, replayed, restarted busy m3 again"
    );
    assert_tampered(&d, "m3", APPROVE_KEY);
    s.finish(d).await;
}

/// Cap 1, `alert-and-wait`: busy m2's rotation holds the slot, cordoned,
/// waiting for it to go idle; the rogue in m1 reads its sealed marker. m2
/// goes idle, rotates and finishes; later it runs an old ref again and is
/// busy. The rogue writes the old marker back onto m2 (same machine and
/// key: its seal verifies). Its slot is gone: it must restart nothing, take
/// no capacity past the cap, and leave m2 uncordoned.
#[tokio::test(start_paused = true)]
async fn an_older_sealed_marker_replayed_onto_its_machine_restarts_nothing() {
    let s = busy_pair_waiting_for_one_slot().start().await;
    let d = s.daemon().await;
    let first = in_flight(&s.sim, &d, &["m2", "m3"]).await;
    let rogue = s.rogue();
    let old_marker = rogue
        .read(&first, MARKER_KEY)
        .await
        .unwrap()
        .expect("a marker");
    s.sim.set_behaviour(&first, Behaviour::Normal);
    eventually(
        "the first rotation finished",
        Duration::from_secs(20),
        async || {
            s.sim.machine(&first).is_some_and(|m| {
                m.loaded_ref == s.w.tip && !m.metadata.contains_key(MARKER_KEY) && !m.cordoned
            })
        },
    )
    .await;
    assert_eq!(restarts(&s.sim, &first), 1);
    s.busy_again(&first);
    d.more_sweeps(2).await;
    rogue.write(&first, MARKER_KEY, &old_marker).await.unwrap();
    d.more_sweeps(10).await;
    assert_eq!(
        restarts(&s.sim, &first),
        1,
        "a replayed marker restarted busy {first}"
    );
    assert_no_cap_breach_nor_busy_restart(&s.sim);
    eventually(
        "the replayed marker is ended or its rotation holds the slot again",
        Duration::from_secs(20),
        async || {
            s.sim
                .machine(&first)
                .is_some_and(|m| m.metadata.get(MARKER_KEY) != Some(&old_marker))
        },
    )
    .await;
    s.finish(d).await;
}

/// An operator held drifted m2 (`restart` pool). In one go the rogue in m1
/// deletes the machine's mirror of the hold (the coordinator's copy is out
/// of its reach) and writes an unsealed `now` approval on m2.
#[tokio::test(start_paused = true)]
async fn a_deleted_hold_mirror_and_a_forged_approval_together_move_nothing() {
    let s = scenario("manual", 1)
        .rogue_host("m1")
        .busy(&["m2"])
        .start()
        .await;
    let held_at = s.hold("m2", "oncall", "incident 52").await;
    let d = s.daemon().await;
    d.more_sweeps(2).await;
    let rogue = s.rogue();
    assert!(rogue.delete_hold("m2").await.unwrap().is_some());
    rogue
        .forge_approval_now("m2", &s.w.tip, "oncall", s.sim.now())
        .await
        .unwrap();
    d.more_sweeps(8).await;
    let acted = mutations_after(&s.sim, "m2", held_at);
    assert!(acted.is_empty(), "acted on held m2: {acted:?}");
    assert_eq!(restarts(&s.sim, "m2"), 0);
    for key in [HOLD_KEY, APPROVE_KEY] {
        assert_tampered(&d, "m2", key);
    }
    s.finish(d).await;
}

/// The coordinator misplaced into the agents' app (cap 1, busy machines
/// waiting under `alert-and-wait`, cordoned while they hold the slot). The
/// rogue keeps emptying the slot set.
#[tokio::test(start_paused = true)]
async fn a_slot_set_a_rogue_emptied_never_lets_a_pool_exceed_its_cap() {
    let s = scenario("alert-and-wait", 1)
        .rogue_host("m1")
        .busy(&["m2", "m3", "m4"])
        .misplaced_coordinator()
        .audited()
        .start()
        .await;
    let d = s.daemon().await;
    in_flight(&s.sim, &d, &["m2", "m3", "m4"]).await;
    let rogue = s.rogue();
    for _ in 0..4 {
        rogue.free_all_slots(COORD).await.unwrap();
        d.more_sweeps(2).await;
    }
    let audit = s.sim.audit();
    assert!(
        audit.cap_breaches.is_empty(),
        "cap 1 exceeded after the rogue freed the slots: {:?}",
        audit.cap_breaches
    );
    for id in ["m2", "m3", "m4"] {
        assert_eq!(restarts(&s.sim, id), 0, "restarted busy {id}");
    }
    assert_tampered(&d, COORD, SLOTS_KEY);
    s.finish(d).await;
}

/// A rogue that only reads (every key of every machine, every sweep)
/// changes nothing: the operator's approval of m2 is carried out once and
/// nothing is reported as tampered.
#[tokio::test(start_paused = true)]
async fn a_rogue_that_only_reads_changes_nothing() {
    let s = scenario("manual", 1)
        .rogue_host("m1")
        .busy(&["m2", "m3"])
        .audited()
        .start()
        .await;
    let d = s.daemon().await;
    s.approve("m2", ApprovalMode::Now).await;
    let rogue = s.rogue();
    let mut read = 0;
    eventually("m2 rotated", Duration::from_secs(20), async || {
        for id in ["m1", "m2", "m3"] {
            if rogue.read_all(id).await.is_ok() {
                read += 1;
            }
        }
        s.sim
            .machine("m2")
            .is_some_and(|m| m.loaded_ref == s.w.tip && !m.metadata.contains_key(MARKER_KEY))
    })
    .await;
    d.more_sweeps(3).await;
    assert!(read > 0, "the rogue read nothing");
    assert_eq!(restarts(&s.sim, "m2"), 1);
    assert_eq!(restarts(&s.sim, "m3"), 0, "m3 was not approved");
    assert!(s.sim.audit().cap_breaches.is_empty());
    let tampered: Vec<_> = alerts(&d)
        .into_iter()
        .filter(|(e, _)| e == TAMPERED)
        .collect();
    assert!(
        tampered.is_empty(),
        "reading is not tampering: {tampered:?}"
    );
    s.finish(d).await;
}

// ---- one step, by hand ------------------------------------------------------------------

/// Busy m3 rotated once under an operator's `now` approval, which the rogue
/// in m1 read; the approval is spent. m3 drifts again (busy) and an operator
/// approves it `now` afresh: a rotation claims it, and its interrupting
/// restart is planned. After that plan the operator narrows the approval to
/// `when-idle`, and the rogue writes the spent `now` approval back over it
/// (same machine, same commit: its seal verifies). Before: the executor's
/// last read checked only the approval's commit and mode, so the replayed
/// `now` passed it and the busy machine was restarted. The rotation's
/// marker names the approval it was claimed with; any other one stops it.
#[tokio::test(start_paused = true)]
async fn a_spent_now_approval_replayed_over_a_when_idle_one_interrupts_nothing() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    let s = scenario("manual", 2)
        .rogue_host("m1")
        .busy(&["m3"])
        .start()
        .await;
    let op = s.operator();
    op.approve(&"m3".into(), &s.approval(ApprovalMode::Now))
        .await
        .unwrap();
    let rogue = s.rogue();
    let spent = rogue.steal_approval("m3").await.unwrap();
    let d = s.daemon().await;
    s.rotated_with_its_approval("m3").await;
    d.stop().await;
    assert_eq!(restarts(&s.sim, "m3"), 1, "the approval restarted m3 once");
    s.busy_again("m3");
    tokio::time::sleep(Duration::from_secs(1)).await;
    op.approve(&"m3".into(), &s.approval(ApprovalMode::Now))
        .await
        .unwrap();
    let mut hand = s.hand().await;
    let restart = claimed_then_restart(&mut hand).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    op.approve(&"m3".into(), &s.approval(ApprovalMode::WhenIdle))
        .await
        .unwrap();
    rogue.replay_approval(&spent, "m3").await.unwrap();
    let done = hand.run(&restart).await;
    assert_eq!(
        restarts(&s.sim, "m3"),
        1,
        "the replayed spent `now` approval restarted busy m3: {:?}",
        done[0].outcome
    );
    assert!(
        matches!(
            done[0].outcome,
            Outcome::Skipped(Declined::ApprovalReplaced { .. })
        ),
        "{:?}",
        done[0].outcome
    );
    s.sim.shutdown().await;
}

/// Runs planned steps by hand until `done` holds (at most 12 sweeps, the
/// simulated clock moving 2 s between them).
async fn by_hand_until(hand: &mut Hand, what: &str, done: impl Fn() -> bool) {
    for _ in 0..12 {
        if done() {
            return;
        }
        let plan = hand.plan().await;
        hand.run(&plan).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert!(done(), "not reached by hand: {what}");
}

/// Busy m3 is restarted under an operator's `now` approval, which the rogue
/// in m1 read. While the rotation verifies, the operator approves m3 again
/// (`when-idle`: a new approval replaces it), and later revokes that one.
/// m3 drifts again, busy; the rogue writes the first approval back. It
/// authorized the rotation that restarted under it: it must authorize no
/// other. Before: a rotation consumed its approval only if it was still on
/// the machine when the rotation ended, so a replaced one was never listed
/// as spent, and written back it restarted busy m3 a second time.
#[tokio::test(start_paused = true)]
async fn an_approval_replaced_after_its_restart_is_spent_and_its_replay_restarts_nothing() {
    use fleet_reconciler::act::executor::Outcome;
    let s = scenario("manual", 2)
        .rogue_host("m1")
        .busy(&["m3"])
        .start()
        .await;
    let op = s.operator();
    op.approve(&"m3".into(), &s.approval(ApprovalMode::Now))
        .await
        .unwrap();
    let rogue = s.rogue();
    let used = rogue.steal_approval("m3").await.unwrap();
    let mut hand = s.hand().await;
    let claim = hand.plan().await;
    assert_eq!(hand.run(&claim).await[0].outcome, Outcome::Done);
    let restart = hand.plan().await;
    assert_eq!(hand.run(&restart).await[0].outcome, Outcome::Done);
    assert_eq!(restarts(&s.sim, "m3"), 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    op.approve(&"m3".into(), &s.approval(ApprovalMode::WhenIdle))
        .await
        .unwrap();
    by_hand_until(&mut hand, "m3's rotation finished", || {
        s.sim
            .machine("m3")
            .is_some_and(|m| m.loaded_ref == s.w.tip && !m.metadata.contains_key(MARKER_KEY))
    })
    .await;
    op.revoke(&"m3".into()).await.unwrap();
    s.busy_again("m3");
    rogue.replay_approval(&used, "m3").await.unwrap();
    for _ in 0..6 {
        let plan = hand.plan().await;
        hand.run(&plan).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert_eq!(
        restarts(&s.sim, "m3"),
        1,
        "the approval replaced after its restart, written back, restarted busy m3 again"
    );
    s.sim.shutdown().await;
}

/// Drifted m2 (`restart` pool, no grace) is claimed and its restart planned.
/// After that plan an operator holds m2 (the coordinator's copy first, then
/// the machine's), and the rogue in m1 deletes the machine's copy before the
/// step runs. Before: the executor's reads before each call looked at the
/// machine's copy only, so the stale step restarted the held machine (found
/// by the chaos run with a rogue, seed 20261201: an undo on a machine whose
/// hold the rogue had deleted in the window after a 429). The step now
/// also reads the coordinator's holds, which no agent reaches.
#[tokio::test(start_paused = true)]
async fn a_hold_a_rogue_deletes_after_the_plan_stops_the_planned_step() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    let s = scenario("restart", 1)
        .rogue_host("m1")
        .drifted("m2")
        .rotation("restart_grace = \"0s\"")
        .start()
        .await;
    let mut hand = s.hand().await;
    let restart = claimed_then_restart(&mut hand).await;
    s.hold("m2", "ops", "incident 33").await;
    let rogue = s.rogue();
    assert!(rogue.delete_hold("m2").await.unwrap().is_some());
    let done = hand.run(&restart).await;
    assert_eq!(
        restarts(&s.sim, "m2"),
        0,
        "restarted held m2: {:?}",
        done[0].outcome
    );
    assert_eq!(done[0].outcome, Outcome::Skipped(Declined::Held));
    s.sim.shutdown().await;
}

/// An operator approved busy m3 `now`, then revoked it before any sweep
/// acted (a second operator approves m2 `when-idle` and then approves it
/// again `now`: the first approval is replaced). The rogue in m1 read both
/// first approvals and writes them back. Before: `revoke` and `approve`
/// only removed or overwrote the machine's value, which still verifies
/// there, so the written-back approvals restarted busy m3 and m2 as if
/// never revoked or replaced. Now each is listed as spent on the
/// coordinator first: written back, it approves nothing and is alerted.
#[tokio::test(start_paused = true)]
async fn a_revoked_or_replaced_approval_written_back_approves_nothing() {
    let s = scenario("manual", 2)
        .rogue_host("m1")
        .busy(&["m2", "m3"])
        .start()
        .await;
    let op = s.operator();
    let rogue = s.rogue();
    op.approve(&"m3".into(), &s.approval(ApprovalMode::Now))
        .await
        .unwrap();
    let revoked = rogue.steal_approval("m3").await.unwrap();
    op.revoke(&"m3".into()).await.unwrap();
    op.approve(&"m2".into(), &s.approval(ApprovalMode::Now))
        .await
        .unwrap();
    let replaced = rogue.steal_approval("m2").await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    op.approve(&"m2".into(), &s.approval(ApprovalMode::WhenIdle))
        .await
        .unwrap();
    let d = s.daemon().await;
    d.more_sweeps(2).await;
    rogue.replay_approval(&revoked, "m3").await.unwrap();
    rogue.replay_approval(&replaced, "m2").await.unwrap();
    d.more_sweeps(8).await;
    assert_eq!(
        restarts(&s.sim, "m3"),
        0,
        "a revoked approval, written back, restarted busy m3"
    );
    assert_eq!(
        restarts(&s.sim, "m2"),
        0,
        "a replaced `now` approval, written back, restarted busy m2"
    );
    for id in ["m2", "m3"] {
        assert_tampered(&d, id, APPROVE_KEY);
    }
    s.finish(d).await;
}

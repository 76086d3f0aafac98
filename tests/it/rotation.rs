//! Remediation against the simulated fleet: the safety properties of
//! docs/design.md §5 and §6 that need the real loop (sweep → plan → execute)
//! over loopback HTTP, with real git underneath: two replicas and a cap,
//! leases and nonces, claims withdrawn or undone, answers lost, daemons
//! stopped mid-rotation, holds and revocations that stop the next action.
//! What the planner decides from one snapshot (graces, ceilings, recent
//! input, approvals, checkpoints) is tested in `src/decide/planner_tests.rs`
//! and `tests/planner_props.rs`; `tests/chaos.rs` checks it all again
//! against the real binary under faults.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use fleet_reconciler::act::executor::{Executor, ExecutorConfig};
use fleet_reconciler::clock::{SharedClock, TokioClock};
use fleet_reconciler::config::Config;

use fleet_reconciler::decide::alerts::AlertKind;
use fleet_reconciler::metadata::marker::{Marker, Phase, RotationMode};
use fleet_reconciler::metadata::operator::{Approval, ApprovalMode};
use fleet_reconciler::metadata::unprobed::Cleared;
use fleet_reconciler::metadata::{APPROVE_KEY, HOLD_KEY, MARKER_KEY, UNPROBED_KEY};
use fleet_reconciler::model::{CommitId, PolicyAction, Severity};
use fleet_reconciler::sim::{Behaviour, RequestTarget, Sim, SimApp, SimFleet, SimMachine};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::common::{OverlayRepo, eventually};

pub(crate) const TOKEN: &str = "rotation-test-token";
/// The machine whose lease and metadata keep the pools' slots (stopped, as a
/// dedicated coordination machine would be).
pub(crate) const COORD_APP: &str = "coord";
pub(crate) const COORD: &str = "c0";

pub(crate) struct World {
    /// The one wall clock of the sim and the daemons: tokio's paused time.
    pub(crate) clock: SharedClock,
    pub(crate) overlay: OverlayRepo,
    pub(crate) repo: String,
    pub(crate) tip: String,
    pub(crate) old: String,
}

pub(crate) fn world() -> World {
    let overlay = OverlayRepo::new();
    World {
        clock: Arc::new(TokioClock::starting_at(Utc::now())),
        repo: overlay.repo_path.display().to_string(),
        tip: overlay.tip(),
        // One commit behind, touching only skills/: severity low.
        old: overlay.behind(1),
        overlay,
    }
}

/// A config with fast clocks; `rotation` extends `[rotation]`.
pub(crate) fn config(
    sim: &Sim,
    w: &World,
    mirror: &str,
    actions: &str,
    cap: u32,
    rotation: &str,
) -> Arc<Config> {
    let text = w
        .overlay
        .config(&sim.api_url(), mirror)
        .fly(r#"request_timeout = "5s""#)
        .overlay(r#"fetch_interval = "1h""#)
        .with(&format!(
            r#"
[sweep]
interval = "150ms"
[probe]
timeout = "500ms"
[[apps]]
name = "app"
health_url = "{health}"
pool_key = "pool"
[pools.default]
max_concurrent_rotations = {cap}
actions = {actions}
[rotation]
min_drift_age = "0s"
coordinator = "{COORD_APP}/{COORD}"
{rotation}
"#,
            health = sim.health_url_template(),
        ))
        .text();
    Arc::new(Config::parse(Path::new("rotation.toml"), &text).unwrap())
}

pub(crate) fn all(action: &str) -> String {
    format!(
        "{{ low = \"{action}\", medium = \"{action}\", high = \"{action}\", critical = \"{action}\" }}"
    )
}

/// The daemon these tests run (and gate, guardrails and halt): the common
/// one, authenticated with this file's token.
pub(crate) use crate::common::daemon::Daemon;

impl Daemon {
    pub(crate) async fn start(sim: &Sim, config: Arc<Config>, owner: &str) -> Daemon {
        Daemon::build(owner, TOKEN).start(sim, config).await
    }

    /// A daemon whose sweeps read the alert gate `gate`.
    pub(crate) async fn start_gated(
        sim: &Sim,
        config: Arc<Config>,
        owner: &str,
        gate: fleet_reconciler::observe::gate::AlertGate,
    ) -> Daemon {
        Daemon::build(owner, TOKEN)
            .gate(gate)
            .start(sim, config)
            .await
    }
}

/// Waits until `id` runs `tip`, uncordoned, with no rotation marker left.
pub(crate) async fn converged(sim: &Sim, id: &str, tip: &str, deadline: Duration) {
    eventually(&format!("{id} converges"), deadline, async || {
        marker_of(sim, id).is_none()
            && sim
                .machine(id)
                .is_some_and(|m| m.loaded_ref == tip && !m.cordoned)
    })
    .await;
}

pub(crate) fn marker_of(sim: &Sim, id: &str) -> Option<Marker> {
    sim.sealed_metadata(id, MARKER_KEY)
        .and_then(|v| Marker::parse(&v))
}

/// Sim-clock times at which restarts of `id` were accepted.
pub(crate) fn restarts(sim: &Sim, id: &str) -> Vec<chrono::DateTime<Utc>> {
    sim.requests()
        .into_iter()
        .filter(|r| {
            r.machine_id.as_deref() == Some(id)
                && r.action.as_deref() == Some("restart")
                && r.status == Some(200)
        })
        .map(|r| r.at)
        .collect()
}

/// Drifted machines, their agents idle.
fn drifted(w: &World, ids: &[&str]) -> Vec<SimMachine> {
    ids.iter()
        .map(|id| SimMachine::new(*id).loaded(w.old.clone()))
        .collect()
}

/// A drifted machine whose agent is busy for the whole test.
fn busy_for_an_hour(w: &World, id: &str) -> SimMachine {
    SimMachine::new(id)
        .loaded(w.old.clone())
        .behaviour(Behaviour::BusyFor(Duration::from_secs(3600)))
}

pub(crate) fn fleet(w: &World, machines: Vec<SimMachine>) -> SimFleet {
    SimFleet::new(TOKEN)
        .clock(w.clock.clone())
        .release_tip(w.tip.clone())
        .restart_delay(Duration::from_millis(200))
        .app(SimApp::new("app").machines(machines))
        .app(SimApp::new(COORD_APP).machine(SimMachine::new(COORD).stopped()))
}

// ---- caps across replicas -----------------------------------------------------

#[tokio::test(start_paused = true)]
async fn two_daemons_never_exceed_a_pools_cap() {
    let w = world();
    let machines = (0..6)
        .map(|i| {
            SimMachine::new(format!("m{i}"))
                .loaded(w.old.clone())
                .behaviour(Behaviour::BusyFor(Duration::from_millis(600 + 150 * i)))
        })
        .chain([SimMachine::new("other")
            .loaded(w.old.clone())
            .metadata("pool", "separate")])
        .collect();
    let sim = Sim::start(fleet(&w, machines)).await.unwrap();
    let a = Daemon::start(
        &sim,
        config(&sim, &w, "a", &all("alert-and-wait"), 2, ""),
        "replica-a",
    )
    .await;
    let b = Daemon::start(
        &sim,
        config(&sim, &w, "b", &all("alert-and-wait"), 2, ""),
        "replica-b",
    )
    .await;
    let ids: Vec<String> = (0..6).map(|i| format!("m{i}")).collect();
    let mut peak = 0;
    let start = tokio::time::Instant::now();
    loop {
        // Out of service = cordoned or not started: at most the cap at any moment.
        let out: usize = ids
            .iter()
            .filter(|id| {
                sim.machine(id)
                    .is_some_and(|m| m.cordoned || m.state != "started")
            })
            .count();
        peak = peak.max(out);
        assert!(
            out <= 2,
            "{out} machines of a pool with cap 2 out of service at once"
        );
        if ids.iter().chain(["other".to_string()].iter()).all(|id| {
            sim.machine(id)
                .is_some_and(|m| m.loaded_ref == w.tip && !m.cordoned)
        }) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "fleet did not converge"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(peak, 2, "both slots were used");
    for id in &ids {
        assert_eq!(restarts(&sim, id).len(), 1, "{id} restarted exactly once");
    }
    // The separate pool has its own cap, so "other" rotated too.
    assert_eq!(restarts(&sim, "other").len(), 1);
    a.stop().await;
    b.stop().await;
    sim.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_claim_that_cannot_be_verified_is_withdrawn() {
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    let cfg = config(&sim, &w, "m", &all("alert-and-wait"), 1, "");
    let d = Daemon::start(&sim, cfg, "r1").await;
    eventually("marker written", Duration::from_secs(10), async || {
        marker_of(&sim, "m1").is_some()
    })
    .await;
    // The re-read of the pool fails (1 try + 4 retries), so the claim cannot
    // be verified: it must be withdrawn, not left holding a slot uncordoned.
    sim.fail_next(5, 500, None);
    eventually(
        "claim withdrawn or kept",
        Duration::from_secs(15),
        async || sim.pending_failures() == 0,
    )
    .await;
    eventually("marker withdrawn", Duration::from_secs(5), async || {
        marker_of(&sim, "m1").is_none() || sim.machine("m1").is_some_and(|m| m.cordoned)
    })
    .await;
    let view = sim.machine("m1").unwrap();
    // Only a rotation that won its slot cordons; a `claiming` marker permits nothing.
    assert!(
        marker_of(&sim, "m1").is_some_and(|m| m.phase.holds_slot()) == view.cordoned,
        "a won rotation without a cordon (or the reverse): marker {:?}, cordoned {}",
        marker_of(&sim, "m1"),
        view.cordoned
    );
    // Later sweeps claim again, normally: claimed and cordoned together.
    eventually("claimed again", Duration::from_secs(15), async || {
        sim.machine("m1").is_some_and(|m| m.cordoned)
    })
    .await;
    assert!(marker_of(&sim, "m1").is_some_and(|m| m.phase == Phase::Draining));
    d.stop().await;
    sim.shutdown().await;
}

// ---- resume after a crash -----------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_rotation_killed_after_its_restart_is_not_restarted_again() {
    let w = world();
    // The sim restarts slowly; the first daemon dies right after requesting it.
    let sim = Sim::start(
        fleet(&w, vec![SimMachine::new("m1").loaded(w.old.clone())])
            .restart_delay(Duration::from_secs(2)),
    )
    .await
    .unwrap();
    let cfg = config(&sim, &w, "m", &all("alert-and-wait"), 1, "");
    let first = Daemon::start(&sim, cfg.clone(), "first").await;
    eventually("restart requested", Duration::from_secs(10), async || {
        !restarts(&sim, "m1").is_empty()
    })
    .await;
    first.stop().await;
    let second = Daemon::start(&sim, cfg, "second").await;
    converged(&sim, "m1", &w.tip, Duration::from_secs(20)).await;
    assert_eq!(restarts(&sim, "m1").len(), 1);
    second.stop().await;
    sim.shutdown().await;
}

// ---- cooperating agents ------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_cooperating_agent_is_restarted_only_after_its_checkpoint() {
    let w = world();
    // Busy until 3 s from now: the agent reaches its checkpoint then.
    let checkpoint = w.clock.now() + chrono::Duration::seconds(3);
    let sim = Sim::start(fleet(
        &w,
        vec![
            SimMachine::new("m1")
                .loaded(w.old.clone())
                .cooperative()
                .agent_token("agent-secret")
                .behaviour(Behaviour::BusyFor(Duration::from_secs(3))),
        ],
    ))
    .await
    .unwrap();
    let tokens = HashMap::from([("app".to_string(), "agent-secret".into())]);
    let d = Daemon::build("r1", TOKEN)
        .agent_tokens(tokens)
        .start(&sim, config(&sim, &w, "m", &all("alert-and-wait"), 1, ""))
        .await;
    converged(&sim, "m1", &w.tip, Duration::from_secs(20)).await;
    let reqs = sim.requests();
    let drain = reqs
        .iter()
        .find(|r| r.target == RequestTarget::Agent && r.action.as_deref() == Some("overlay/drain"))
        .expect("drain requested");
    assert!(drain.authorized, "drain carried the agent token");
    assert!(drain.body.contains("\"rotation\""), "{}", drain.body);
    assert!(
        drain.at < checkpoint,
        "the drain came after the busy period: nothing was tested"
    );
    let restart = restarts(&sim, "m1")[0];
    assert!(restart >= checkpoint, "restart before checkpoint");
    d.stop().await;
    sim.shutdown().await;
}

// ---- operators ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_manual_machine_is_touched_only_after_approve() {
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    let d = Daemon::start(&sim, config(&sim, &w, "m", &all("manual"), 1, ""), "r1").await;
    eventually("approval requested", Duration::from_secs(10), async || {
        d.alerted(AlertKind::ManualApprovalRequired, "m1")
    })
    .await;
    more_sweeps(&d, 3).await;
    assert!(
        sim.requests()
            .iter()
            .all(|r| !(r.machine_id.as_deref() == Some("m1") && r.is_mutating())),
        "touched before approval"
    );
    // An operator approves "now": restarted despite live work, once.
    let approval = Approval {
        target: CommitId::parse(&w.tip).expect("a commit id"),
        mode: ApprovalMode::Now,
        by: "alice".into(),
        at: sim.now(),
    };
    sim.set_sealed_metadata(
        "m1",
        APPROVE_KEY,
        &serde_json::to_string(&approval).unwrap(),
    );
    converged(&sim, "m1", &w.tip, Duration::from_secs(20)).await;
    assert_eq!(restarts(&sim, "m1").len(), 1);
    eventually("approval consumed", Duration::from_secs(5), async || {
        !sim.machine("m1")
            .unwrap()
            .metadata
            .contains_key(APPROVE_KEY)
    })
    .await;
    d.stop().await;
    sim.shutdown().await;
}

// ---- leases ------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn every_mutation_carries_our_nonce_and_a_foreign_lease_is_never_overridden() {
    let w = world();
    let sim = Sim::start(fleet(&w, drifted(&w, &["m1", "m2"])))
        .await
        .unwrap();
    let foreign = sim
        .acquire_lease_as("m2", "deployer@example.com", Duration::from_secs(3600))
        .unwrap();
    let d = Daemon::start(
        &sim,
        config(&sim, &w, "m", &all("restart"), 2, "restart_grace = \"0s\""),
        "r1",
    )
    .await;
    converged(&sim, "m1", &w.tip, Duration::from_secs(20)).await;
    more_sweeps(&d, 3).await;
    let m2 = sim.machine("m2").unwrap();
    assert_eq!(
        m2.lease.as_ref().map(|l| l.nonce.as_str()),
        Some(foreign.as_str()),
        "foreign lease intact"
    );
    assert_eq!(
        m2.loaded_ref, w.old,
        "m2 untouched while leased by someone else"
    );
    let reqs = sim.requests();
    assert!(!reqs.iter().any(|r| r.machine_id.as_deref() == Some("m2")
        && r.is_mutating()
        && r.status.is_some_and(|s| s < 300)));
    assert!(
        !reqs.iter().any(|r| r.machine_id.as_deref() == Some("m2")
            && r.method == "DELETE"
            && r.action.as_deref() == Some("lease")),
        "never released someone else's lease"
    );
    // Every successful mutation of m1 carried the nonce of a lease we held.
    let nonces: Vec<String> = reqs
        .iter()
        .filter(|r| {
            r.machine_id.as_deref() == Some("m1")
                && r.is_mutating()
                && r.status.is_some_and(|s| s < 300)
        })
        .map(|r| r.lease_nonce.clone().expect("mutation without nonce"))
        .collect();
    assert!(
        nonces.len() >= 4,
        "claim, cordon, restart, finish: {nonces:?}"
    );
    // Once the other actor lets go, m2 rotates too.
    sim.clear_lease("m2");
    converged(&sim, "m2", &w.tip, Duration::from_secs(20)).await;
    // Our leases were all released (the last step may still be releasing its slot).
    eventually("our leases released", Duration::from_secs(5), async || {
        sim.machine("m1").is_some_and(|m| m.lease.is_none())
            && sim.machine("m2").is_some_and(|m| m.lease.is_none())
    })
    .await;
    d.stop().await;
    sim.shutdown().await;
}

// ---- safety under races and faults (issue 8) ---------------------------------------
//
// Each test below reproduces one way the daemon used to break a promise; the
// comment above it says what the code before the fix did.

/// A config changed in place (for what `config` takes no parameter for).
fn tuned(config: Arc<Config>, f: impl FnOnce(&mut Config)) -> Arc<Config> {
    let mut c = (*config).clone();
    f(&mut c);
    Arc::new(c)
}

pub(crate) fn sweeps(d: &Daemon) -> usize {
    d.sweeps()
}

/// Lets `n` more sweeps (each planned and carried out) run: a wait that
/// counts the daemon's chances to act, not wall-clock time.
pub(crate) async fn more_sweeps(d: &Daemon, n: usize) {
    d.more_sweeps(n).await;
}

/// Sweeps, plans and carries out one cycle by hand (also the rogue tests').
pub(crate) struct Hand {
    sweeper: fleet_reconciler::observe::sweep::Sweeper,
    executor: Executor,
    tracker: fleet_reconciler::decide::planner::Tracker,
    tip: fleet_reconciler::observe::overlay::Tip,
    clock: SharedClock,
}

impl Hand {
    async fn new(sim: &Sim, config: Arc<Config>) -> Hand {
        Hand::with_tuning(sim, config, ExecutorConfig::new("hand")).await
    }

    async fn with_tuning(sim: &Sim, config: Arc<Config>, tuning: ExecutorConfig) -> Hand {
        Hand::with_token(sim, config, TOKEN, tuning).await
    }

    /// With the Fly token the sim of the calling test was started with.
    pub(crate) async fn with_token(
        sim: &Sim,
        config: Arc<Config>,
        token: &str,
        tuning: ExecutorConfig,
    ) -> Hand {
        let keys = fleet_reconciler::sim::record_keys();
        let sweeper = crate::common::daemon::connect(&config, token, keys).await;
        let executor = crate::common::daemon::executor(sim, &sweeper, tuning, HashMap::new());
        let tip = sweeper.overlay.fetch().await.unwrap();
        Hand {
            sweeper,
            executor,
            tracker: Default::default(),
            tip,
            clock: sim.clock(),
        }
    }

    pub(crate) async fn plan(&mut self) -> fleet_reconciler::decide::planner::Plan {
        use fleet_reconciler::decide::planner::{FetchState, PlanInput, plan};
        let report = fleet_reconciler::daemon::sweep(&self.sweeper, &self.tip)
            .await
            .unwrap();
        let now = self.clock.now();
        self.tracker.observe(&report, now);
        plan(&PlanInput {
            policy: &fleet_reconciler::decide::policy::Policy::from_config(&self.sweeper.config),
            snapshot: &report,
            tracker: &self.tracker,
            owner: "hand",
            fetch: FetchState {
                fetched_at: Some(now),
                failing: false,
            },
            now,
        })
    }

    pub(crate) async fn run(
        &self,
        plan: &fleet_reconciler::decide::planner::Plan,
    ) -> Vec<fleet_reconciler::act::executor::StepReport> {
        self.executor
            .execute(
                plan.steps().into_iter().cloned().collect(),
                &CancellationToken::new(),
            )
            .await
    }
}

/// Before: the executor re-checked only its own marker, so a hold written
/// between the snapshot and the action was ignored and m1 restarted.
#[tokio::test(start_paused = true)]
async fn scenario_1_a_hold_written_after_the_snapshot_stops_the_next_action() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let claim = hand.plan().await;
    assert_eq!(claim.steps().len(), 1, "{:?}", claim.steps());
    assert_eq!(hand.run(&claim).await[0].outcome, Outcome::Done);
    let restart = hand.plan().await;
    assert_eq!(restart.steps()[0].kind(), "restart");
    // The operator's hold lands after the snapshot, before the action (no lease is held).
    sim.operator_set_metadata("m1", HOLD_KEY, "ops: incident 42")
        .unwrap();
    let done = hand.run(&restart).await;
    assert_eq!(done[0].outcome, Outcome::Skipped(Declined::Held));
    assert!(restarts(&sim, "m1").is_empty(), "restarted a held machine");
    assert!(sim.machine("m1").unwrap().metadata.contains_key(HOLD_KEY));
    sim.shutdown().await;
}

/// Before: any marker counted as a won slot and `draining` never re-checked
/// the cap, so a claim left unverified on m1 (its re-read and its withdrawal
/// both failed) and m2's real rotation were restarted together under cap 1.
#[tokio::test(start_paused = true)]
async fn scenario_2_a_claim_that_never_won_its_slot_is_undone_not_restarted() {
    use fleet_reconciler::metadata::SLOTS_KEY;
    use fleet_reconciler::metadata::slots::{Slot, SlotSet};
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![
            SimMachine::new("m1").loaded(w.old.clone()),
            SimMachine::new("m2").loaded(w.old.clone()).cordoned(true),
        ],
    ))
    .await
    .unwrap();
    let now = sim.now();
    let drain = |id: &str| Marker {
        tag: format!("{id}-legacy"),
        target: fleet_reconciler::model::CommitId::parse(&w.tip).expect("the tip"),
        phase: Phase::Draining,
        mode: fleet_reconciler::metadata::marker::RotationMode::Wait,
        action: fleet_reconciler::model::PolicyAction::AlertAndWait,
        severity: fleet_reconciler::model::Severity::Low,
        started_at: now,
        attempt_started_at: now,
        attempt: 0,
        owner: "replica-b".into(),
        restart_at: None,
        retry_at: None,
        drain_requested: false,
        cordoned: None,
        ending: None,
        instance_id: None,
        pool: None,
        failed: None,
        approval: None,
    };
    // m2 won the pool's only slot; m1's claim never did.
    let mut slots = SlotSet::parse(None).unwrap();
    slots.try_add(
        &"app".into(),
        &"default".into(),
        Slot {
            machine_id: "m2".into(),
            tag: "m2-legacy".into(),
            owner: "replica-b".into(),
            since: now,
        },
        1,
    );
    sim.set_metadata(COORD, SLOTS_KEY, &slots.to_value());
    sim.set_sealed_metadata("m1", MARKER_KEY, &drain("m1").to_value());
    sim.set_sealed_metadata("m2", MARKER_KEY, &drain("m2").to_value());
    let d = Daemon::start(
        &sim,
        config(&sim, &w, "m", &all("alert-and-wait"), 1, ""),
        "replica-a",
    )
    .await;
    let start = tokio::time::Instant::now();
    let mut both_out = false;
    while !(["m1", "m2"].iter().all(|id| {
        marker_of(&sim, id).is_none()
            && sim
                .machine(id)
                .is_some_and(|m| m.loaded_ref == w.tip && !m.cordoned)
    })) {
        let out = ["m1", "m2"]
            .iter()
            .filter(|id| sim.machine(id).is_some_and(|m| m.state != "started"))
            .count();
        both_out |= out > 1;
        assert!(start.elapsed() < Duration::from_secs(30), "no convergence");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!both_out, "two machines of a cap-1 pool restarting at once");
    assert_eq!(restarts(&sim, "m1").len(), 1);
    assert_eq!(restarts(&sim, "m2").len(), 1);
    d.stop().await;
    sim.shutdown().await;
}

/// Before: finish uncordoned and deleted the marker, then called undrain
/// once; one failed undrain left the agent fenced with nothing to retry from.
#[tokio::test(start_paused = true)]
async fn scenario_5_a_failed_undrain_is_retried_before_the_marker_goes() {
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![
            SimMachine::new("m1")
                .loaded(w.old.clone())
                .cooperative()
                .behaviour(Behaviour::BusyFor(Duration::from_secs(3600))),
        ],
    ))
    .await
    .unwrap();
    let d = Daemon::start(
        &sim,
        config(&sim, &w, "m", &all("alert-and-wait"), 1, ""),
        "r1",
    )
    .await;
    eventually("fenced", Duration::from_secs(10), async || {
        sim.machine("m1").is_some_and(|m| m.fence.is_some())
    })
    .await;
    // The agent reaches the tip by itself (a reload out of band); the first
    // undrain fails.
    sim.fail_next_agent_call("m1", "undrain", 503);
    sim.set_loaded_ref("m1", &w.tip);
    eventually(
        "unfenced and finished",
        Duration::from_secs(15),
        async || {
            sim.machine("m1")
                .is_some_and(|m| m.fence.is_none() && !m.cordoned)
                && marker_of(&sim, "m1").is_none()
        },
    )
    .await;
    // Reaching the tip by itself is enough: nothing was restarted.
    assert!(restarts(&sim, "m1").is_empty());
    d.stop().await;
    sim.shutdown().await;
}

/// Before: with the overlay fetch failing, machines that came back on the
/// new release (a commit the mirror lacks) were `unknown_ref`, critical, and
/// restarted again and again.
#[tokio::test(start_paused = true)]
async fn scenario_6_a_stale_mirror_starts_no_rotation() {
    let w = world();
    let sim = Sim::start(fleet(&w, vec![SimMachine::new("m1").loaded(w.tip.clone())]))
        .await
        .unwrap();
    let cfg = tuned(
        config(&sim, &w, "m", &all("restart"), 1, "restart_grace = \"0s\""),
        |c| c.overlay.fetch_interval = Duration::from_millis(100),
    );
    let d = Daemon::start(&sim, cfg, "r1").await;
    eventually("first sweep", Duration::from_secs(10), async || {
        sweeps(&d) >= 1
    })
    .await;
    // The git host goes away; a release the mirror never saw ships.
    let moved = std::path::Path::new(&w.repo).with_extension("away");
    std::fs::rename(&w.repo, &moved).unwrap();
    let newer = "abcdef0123456789abcdef0123456789abcdef01";
    sim.set_release_tip(newer);
    sim.set_loaded_ref("m1", newer);
    more_sweeps(&d, 10).await;
    let restarted = restarts(&sim, "m1").len();
    std::fs::rename(&moved, &w.repo).unwrap();
    assert_eq!(restarted, 0, "restarted on evidence from a stale mirror");
    d.stop().await;
    sim.shutdown().await;
}

/// Before: the approval was checked only at claim; a `when-idle` rotation
/// restarted after the operator revoked it.
#[tokio::test(start_paused = true)]
async fn scenario_7_a_revoked_approval_stops_the_rotation_before_the_restart() {
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    let approval = Approval {
        target: CommitId::parse(&w.tip).expect("a commit id"),
        mode: ApprovalMode::WhenIdle,
        by: "alice".into(),
        at: sim.now(),
    };
    sim.operator_set_sealed_metadata(
        "m1",
        APPROVE_KEY,
        &serde_json::to_string(&approval).unwrap(),
    )
    .unwrap();
    let d = Daemon::start(&sim, config(&sim, &w, "m", &all("manual"), 1, ""), "r1").await;
    eventually("claimed", Duration::from_secs(10), async || {
        marker_of(&sim, "m1").is_some_and(|m| m.phase == Phase::Draining)
    })
    .await;
    // The operator revokes; then the agent goes idle.
    eventually("revoked", Duration::from_secs(10), async || {
        sim.operator_delete_metadata("m1", APPROVE_KEY).is_ok()
    })
    .await;
    sim.set_behaviour("m1", Behaviour::Normal);
    eventually("rotation undone", Duration::from_secs(10), async || {
        marker_of(&sim, "m1").is_none() && sim.machine("m1").is_some_and(|m| !m.cordoned)
    })
    .await;
    more_sweeps(&d, 4).await;
    assert!(
        restarts(&sim, "m1").is_empty(),
        "restarted without approval"
    );
    assert!(d.alerted(AlertKind::ManualApprovalRequired, "m1"));
    d.stop().await;
    sim.shutdown().await;
}

/// Before: the "last seen drifted" evidence lived in memory, so a daemon
/// restarted while the agent was unreachable never applied the ceiling.
#[tokio::test(start_paused = true)]
async fn the_probe_failure_ceiling_survives_a_daemon_restart() {
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    let cfg = config(
        &sim,
        &w,
        "m",
        &all("alert-and-wait"),
        1,
        "probe_failure_ceiling = \"3s\"\nrecent_input_guard = \"1h\"",
    );
    // Recent input keeps it out of rotation while it answers.
    sim.set_last_input_at("m1", Some(sim.now()));
    let first = Daemon::start(&sim, cfg.clone(), "first").await;
    eventually("seen drifted", Duration::from_secs(10), async || {
        sweeps(&first) >= 1
    })
    .await;
    sim.set_behaviour("m1", Behaviour::HttpError(503));
    // Fly's own check fails too: the ceiling restarts only what Fly calls unhealthy.
    use fleet_reconciler::sim::{CheckStatus, DEFAULT_CHECK};
    sim.set_check("m1", DEFAULT_CHECK, CheckStatus::Critical);
    eventually("evidence recorded", Duration::from_secs(10), async || {
        sim.machine("m1")
            .is_some_and(|m| m.metadata.contains_key(UNPROBED_KEY))
    })
    .await;
    first.stop().await;
    let second = Daemon::start(&sim, cfg, "second").await;
    converged(&sim, "m1", &w.tip, Duration::from_secs(20)).await;
    eventually(
        "the record goes once the agent answers",
        Duration::from_secs(5),
        async || {
            // Cleared: replaced by our sealed note naming it (#33).
            sim.sealed_metadata("m1", UNPROBED_KEY)
                .is_some_and(|v| Cleared::parse(&v).is_some())
        },
    )
    .await;
    second.stop().await;
    sim.shutdown().await;
}

/// Before: a cordon whose answer was lost failed the claim, which was then
/// withdrawn: a cordon stayed with no marker to undo it.
#[tokio::test(start_paused = true)]
async fn a_cordon_whose_answer_was_lost_is_undone() {
    use fleet_reconciler::sim::ChaosFault;
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    // The cordon takes effect, and its answer is lost on every retry.
    for _ in 0..8 {
        sim.fault_next_call("m1", "POST", "cordon", ChaosFault::LostAfter);
    }
    let d = Daemon::start(
        &sim,
        config(
            &sim,
            &w,
            "m",
            &all("alert-and-wait"),
            1,
            "drain_ceiling = \"2s\"\nretry_after = \"1h\"",
        ),
        "r1",
    )
    .await;
    // At no moment is the machine cordoned without a marker that says so,
    // until the drain ceiling yields and the cordon is undone.
    let start = tokio::time::Instant::now();
    let mut was_cordoned = false;
    loop {
        // One read of the machine: the cordon and the marker as of the same
        // instant (two reads could straddle the uncordon and its marker).
        let machine = sim.machine("m1");
        let cordoned = machine.as_ref().is_some_and(|m| m.cordoned);
        let marker = machine
            .as_ref()
            .and_then(|m| m.metadata.get(MARKER_KEY))
            .and_then(|v| fleet_reconciler::sim::open_record("m1", MARKER_KEY, v))
            .and_then(|v| Marker::parse(&v));
        assert!(
            !cordoned || marker.as_ref().is_some_and(|m| m.may_have_cordoned()),
            "cordoned with no marker recording it: {marker:?}"
        );
        was_cordoned |= cordoned;
        if was_cordoned && !cordoned && marker.is_some_and(|m| m.phase == Phase::Yielded) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "never yielded");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    d.stop().await;
    sim.shutdown().await;
}

/// Before: a failed drain POST was never asked again, so the rotation
/// waited for a checkpoint that could not come until its deadline.
#[tokio::test(start_paused = true)]
async fn a_failed_drain_request_is_asked_again() {
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![
            SimMachine::new("m1")
                .loaded(w.old.clone())
                .cooperative()
                .behaviour(Behaviour::BusyFor(Duration::from_secs(1))),
        ],
    ))
    .await
    .unwrap();
    sim.fail_next_agent_call("m1", "drain", 503);
    let d = Daemon::start(
        &sim,
        config(&sim, &w, "m", &all("alert-and-wait"), 1, ""),
        "r1",
    )
    .await;
    converged(&sim, "m1", &w.tip, Duration::from_secs(15)).await;
    let drains = sim
        .requests()
        .iter()
        .filter(|r| {
            r.machine_id.as_deref() == Some("m1") && r.action.as_deref() == Some("overlay/drain")
        })
        .count();
    assert!(drains >= 2, "drain asked again ({drains} requests)");
    d.stop().await;
    sim.shutdown().await;
}

/// Before: releasing a lease did not wait for a refresh in flight; a refresh
/// retried after a 429 landed after the release and took the lease again,
/// locking operators out for a TTL.
#[tokio::test(start_paused = true)]
async fn a_released_lease_is_never_taken_again_by_its_refresher() {
    use fleet_reconciler::sim::ChaosFault;
    let w = world();
    let sim = Sim::start(
        fleet(&w, vec![SimMachine::new("m1").loaded(w.old.clone())])
            .restart_delay(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let cfg = config(&sim, &w, "m", &all("restart"), 1, "restart_grace = \"0s\"");
    let mut tuning = ExecutorConfig::new("hand");
    tuning.lease_refresh = Duration::from_millis(100);
    let mut hand = Hand::with_tuning(&sim, cfg, tuning).await;
    let claim = hand.plan().await;
    hand.run(&claim).await;
    let restart = hand.plan().await;
    assert_eq!(restart.steps()[0].kind(), "restart");
    let step = async { hand.run(&restart).await };
    let inject = async {
        // Once the step holds the lease, its first refresh is throttled
        // (429, Retry-After 1 s): the retry comes after the step is done.
        eventually("lease taken", Duration::from_secs(5), async || {
            sim.machine("m1").is_some_and(|m| m.lease.is_some())
        })
        .await;
        sim.fault_next_call("m1", "POST", "lease", ChaosFault::TooManyRequests);
    };
    let (done, ()) = tokio::join!(step, inject);
    assert_eq!(
        done[0].outcome,
        fleet_reconciler::act::executor::Outcome::Done,
        "{done:?}"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        sim.machine("m1").unwrap().lease,
        None,
        "a lease left behind after the step"
    );
    sim.shutdown().await;
}

/// Before: a step whose lease refresh failed went on acting on the machine.
#[tokio::test(start_paused = true)]
async fn a_step_stops_before_its_next_call_once_a_refresh_failed() {
    use fleet_reconciler::sim::ChaosFault;
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let cfg = tuned(config(&sim, &w, "m", &all("alert-and-wait"), 1, ""), |c| {
        c.fly.max_retries = 0
    });
    let mut tuning = ExecutorConfig::new("hand");
    tuning.lease_refresh = Duration::from_millis(100);
    let mut hand = Hand::with_tuning(&sim, cfg, tuning).await;
    let claim = hand.plan().await;
    assert_eq!(claim.steps()[0].kind(), "claim");
    // The coordinator is busy for a moment (another replica's claim), so the
    // step is still running when its lease refresh fails.
    sim.acquire_lease_as(COORD, "replica-b", Duration::from_millis(1500));
    let finished = std::sync::atomic::AtomicBool::new(false);
    let step = async {
        let done = hand.run(&claim).await;
        finished.store(true, std::sync::atomic::Ordering::SeqCst);
        done
    };
    let inject = async {
        eventually("lease taken", Duration::from_secs(5), async || {
            sim.machine("m1").is_some_and(|m| m.lease.is_some())
        })
        .await;
        sim.fault_next_call("m1", "POST", "lease", ChaosFault::ServerError);
    };
    // Watched for as long as the step runs (nothing else acts on m1), and once after.
    let cordoned = async {
        let mut seen = false;
        while !finished.load(std::sync::atomic::Ordering::SeqCst) {
            seen |= sim.machine("m1").is_some_and(|m| m.cordoned);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen || sim.machine("m1").is_some_and(|m| m.cordoned)
    };
    let (done, (), cordoned) = tokio::join!(step, inject, cordoned);
    eprintln!("outcome: {}", done[0].outcome);
    assert!(!cordoned, "cordoned after the lease refresh failed");
    assert!(
        !marker_of(&sim, "m1").is_some_and(|m| m.phase.holds_slot()),
        "no rotation may stand on a lost lease: {:?}",
        marker_of(&sim, "m1")
    );
    sim.shutdown().await;
}

/// Finishing a rotation consumes its own approval only: one an operator
/// already gave for another commit stays for the rotation that needs it.
#[tokio::test(start_paused = true)]
async fn finishing_consumes_only_the_approval_of_its_own_commit() {
    use fleet_reconciler::metadata::SLOTS_KEY;
    use fleet_reconciler::metadata::slots::{Slot, SlotSet};
    let w = world();
    let sim = Sim::start(fleet(&w, vec![SimMachine::new("m1").loaded(w.tip.clone())]))
        .await
        .unwrap();
    let now = sim.now();
    let restarting = Marker {
        tag: "m1-done".into(),
        target: fleet_reconciler::model::CommitId::parse(&w.tip).expect("the tip"),
        phase: Phase::Restarting,
        mode: fleet_reconciler::metadata::marker::RotationMode::Now,
        action: fleet_reconciler::model::PolicyAction::Manual,
        severity: fleet_reconciler::model::Severity::High,
        started_at: now,
        attempt_started_at: now,
        attempt: 0,
        owner: "r0".into(),
        // Before its checks' results were written (the sim's start): fresh
        // results are what verifies a restart (#32 item 13 b).
        restart_at: Some(now - chrono::TimeDelta::seconds(1)),
        retry_at: None,
        drain_requested: false,
        cordoned: Some(true),
        ending: None,
        instance_id: None,
        pool: None,
        failed: None,
        approval: None,
    };
    let mut slots = SlotSet::parse(None).unwrap();
    slots.try_add(
        &"app".into(),
        &"default".into(),
        Slot {
            machine_id: "m1".into(),
            tag: "m1-done".into(),
            owner: "r0".into(),
            since: now,
        },
        1,
    );
    sim.set_metadata(COORD, SLOTS_KEY, &slots.to_value());
    sim.set_sealed_metadata("m1", MARKER_KEY, &restarting.to_value());
    let other = Approval {
        target: CommitId::parse(&w.old).expect("a commit id"),
        mode: ApprovalMode::Now,
        by: "alice".into(),
        at: now,
    };
    let other = serde_json::to_string(&other).unwrap();
    sim.set_sealed_metadata("m1", APPROVE_KEY, &other);
    let d = Daemon::start(&sim, config(&sim, &w, "m", &all("manual"), 1, ""), "r1").await;
    converged(&sim, "m1", &w.tip, Duration::from_secs(10)).await;
    assert_eq!(
        sim.sealed_metadata("m1", APPROVE_KEY),
        Some(other),
        "another commit's approval was consumed"
    );
    eventually("slot released", Duration::from_secs(5), async || {
        slots_of(&sim)
            .slots(&"app".into(), &"default".into())
            .is_empty()
    })
    .await;
    d.stop().await;
    sim.shutdown().await;
}

/// Before: a hold placed mid-rotation froze the cordon, the fence and the
/// pool's slot with no alert.
#[tokio::test(start_paused = true)]
async fn a_hold_mid_rotation_is_alerted_and_keeps_its_slot() {
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![
            busy_for_an_hour(&w, "m1"),
            SimMachine::new("m2").loaded(w.old.clone()),
        ],
    ))
    .await
    .unwrap();
    sim.set_metadata("m2", "pool", "default");
    let d = Daemon::start(
        &sim,
        config(&sim, &w, "m", &all("alert-and-wait"), 1, ""),
        "r1",
    )
    .await;
    eventually("one rotation", Duration::from_secs(10), async || {
        ["m1", "m2"]
            .iter()
            .any(|id| marker_of(&sim, id).is_some_and(|m| m.phase == Phase::Draining))
    })
    .await;
    let (held, other) = if marker_of(&sim, "m1").is_some_and(|m| m.phase == Phase::Draining) {
        ("m1", "m2")
    } else {
        ("m2", "m1")
    };
    eventually("held", Duration::from_secs(10), async || {
        sim.operator_set_metadata(held, HOLD_KEY, "ops: look")
            .is_ok()
    })
    .await;
    let frozen = marker_of(&sim, held);
    eventually("alerted", Duration::from_secs(10), async || {
        d.alerted(AlertKind::RotationStuck, held)
    })
    .await;
    more_sweeps(&d, 4).await;
    assert_eq!(marker_of(&sim, held), frozen, "a held rotation was touched");
    assert!(sim.machine(held).is_some_and(|m| m.cordoned));
    assert!(
        marker_of(&sim, other).is_none_or(|m| !m.phase.holds_slot()),
        "the held rotation's slot was given away"
    );
    d.stop().await;
    sim.shutdown().await;
}

/// Before: a marker with a timestamp at the end of chrono's range (anyone
/// who can write metadata can write one) made the planner panic on every
/// sweep: a crash loop that stopped remediation fleet-wide.
#[tokio::test(start_paused = true)]
async fn a_marker_with_impossible_times_is_reported_and_left_alone() {
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![
            SimMachine::new("m1").loaded(w.old.clone()),
            SimMachine::new("m2")
                .metadata("pool", "other")
                .loaded(w.old.clone()),
        ],
    ))
    .await
    .unwrap();
    let planted = format!(
        r#"{{"tag":"x","target":"{}","phase":"draining","mode":"grace","action":"restart","severity":"high","started_at":"2026-01-01T00:00:00Z","attempt_started_at":"+262142-12-31T23:59:59Z","owner":"mallory"}}"#,
        w.tip
    );
    assert!(Marker::parse(&planted).is_some(), "a marker serde accepts");
    sim.set_metadata("m1", MARKER_KEY, &planted);
    let d = Daemon::start(&sim, config(&sim, &w, "m", &all("restart"), 1, ""), "r1").await;
    eventually("several sweeps", Duration::from_secs(10), async || {
        sweeps(&d) >= 3
    })
    .await;
    assert!(!d.finished(), "the loop died");
    eventually("reported", Duration::from_secs(5), async || {
        d.alerted(AlertKind::RotationStuck, "m1")
    })
    .await;
    // Other machines are still remediated.
    converged(&sim, "m2", &w.tip, Duration::from_secs(15)).await;
    assert!(restarts(&sim, "m1").is_empty());
    assert_eq!(
        sim.machine("m1").unwrap().metadata.get(MARKER_KEY),
        Some(&planted),
        "the daemon never rewrites a marker it cannot trust"
    );
    d.stop().await;
    sim.shutdown().await;
}

// ---- agents are untrusted (#33) ------------------------------------------------
// `sim.set_metadata` is what an agent can do through `/.fly/api`: any key of
// any machine of its app, no token, no record key.

/// An agent writes `approve now` on itself and on a busy neighbour: nothing
/// is restarted, and `metadata_tampered` names each machine. Then a sealed
/// approval of m1, copied by the agent onto m2, approves nothing on m2.
#[tokio::test(start_paused = true)]
async fn an_approval_an_agent_writes_or_copies_approves_nothing() {
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![busy_for_an_hour(&w, "m1"), busy_for_an_hour(&w, "m2")],
    ))
    .await
    .unwrap();
    let forged = serde_json::to_string(&Approval {
        target: CommitId::parse(&w.tip).expect("a commit id"),
        mode: ApprovalMode::Now,
        by: "agent".into(),
        at: sim.now(),
    })
    .unwrap();
    sim.set_metadata("m1", APPROVE_KEY, &forged);
    sim.set_metadata("m2", APPROVE_KEY, &forged);
    let d = Daemon::start(&sim, config(&sim, &w, "m", &all("manual"), 2, ""), "r1").await;
    more_sweeps(&d, 5).await;
    let touched = |id: &str| {
        sim.requests()
            .iter()
            .any(|r| r.machine_id.as_deref() == Some(id) && r.is_mutating())
    };
    assert!(!touched("m1") && !touched("m2"), "a forged approval acted");
    eventually("tampering alerted", Duration::from_secs(10), async || {
        d.alerted(AlertKind::MetadataTampered, "m1") && d.alerted(AlertKind::MetadataTampered, "m2")
    })
    .await;
    assert!(d.alerted(AlertKind::ManualApprovalRequired, "m1"));
    // The operator approves m1 (sealed for m1); the agent copies it to m2.
    sim.set_sealed_metadata("m1", APPROVE_KEY, &forged.replace("agent", "alice"));
    let copied = sim.machine("m1").unwrap().metadata[APPROVE_KEY].clone();
    sim.set_metadata("m2", APPROVE_KEY, &copied);
    converged(&sim, "m1", &w.tip, Duration::from_secs(20)).await;
    more_sweeps(&d, 5).await;
    assert!(restarts(&sim, "m2").is_empty(), "a copied approval acted");
    assert!(!touched("m2"));
    d.stop().await;
    sim.shutdown().await;
}

/// An agent forges a `restarting` marker on a neighbour, and rewrites the
/// phase of a sealed marker on another: neither is acted on (no restart, no
/// uncordon, no marker rewritten), and both are alerted.
#[tokio::test(start_paused = true)]
async fn a_marker_an_agent_forges_or_alters_is_left_alone_and_alerted() {
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![
            SimMachine::new("m1").loaded(w.old.clone()),
            SimMachine::new("m2").loaded(w.old.clone()),
            SimMachine::new("m3")
                .metadata("pool", "other")
                .loaded(w.old.clone()),
        ],
    ))
    .await
    .unwrap();
    let now = sim.now();
    let marker = |id: &str, phase: Phase| Marker {
        tag: format!("{id}-forged"),
        target: CommitId::parse(&w.tip).expect("the tip"),
        phase,
        mode: RotationMode::Now,
        action: PolicyAction::Restart,
        severity: Severity::High,
        started_at: now,
        attempt_started_at: now,
        attempt: 0,
        owner: "r1".into(),
        restart_at: (phase == Phase::Restarting).then_some(now),
        retry_at: None,
        drain_requested: false,
        cordoned: Some(true),
        ending: None,
        instance_id: None,
        pool: None,
        failed: None,
        approval: None,
    };
    let forged = marker("m1", Phase::Restarting).to_value();
    sim.set_metadata("m1", MARKER_KEY, &forged);
    sim.set_sealed_metadata("m2", MARKER_KEY, &marker("m2", Phase::Yielded).to_value());
    let altered = sim.machine("m2").unwrap().metadata[MARKER_KEY].replace("yielded", "restarting");
    sim.set_metadata("m2", MARKER_KEY, &altered);
    let d = Daemon::start(&sim, config(&sim, &w, "m", &all("restart"), 1, ""), "r1").await;
    // Another pool is still remediated meanwhile.
    converged(&sim, "m3", &w.tip, Duration::from_secs(15)).await;
    more_sweeps(&d, 5).await;
    assert_eq!(
        restarts(&sim, "m1").len(),
        0,
        "a forged marker was acted on"
    );
    assert_eq!(
        restarts(&sim, "m2").len(),
        0,
        "an altered marker was acted on"
    );
    assert_eq!(sim.machine("m1").unwrap().metadata[MARKER_KEY], forged);
    assert_eq!(sim.machine("m2").unwrap().metadata[MARKER_KEY], altered);
    eventually("tampering alerted", Duration::from_secs(10), async || {
        d.alerted(AlertKind::MetadataTampered, "m1") && d.alerted(AlertKind::MetadataTampered, "m2")
    })
    .await;
    d.stop().await;
    sim.shutdown().await;
}

/// An agent deletes a neighbour's hold: the coordinator's copy still holds
/// it (no restart), `metadata_tampered` names it, and the operator's release
/// lets the rotation go on.
#[tokio::test(start_paused = true)]
async fn a_hold_an_agent_deletes_still_holds() {
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![
            SimMachine::new("m1").loaded(w.old.clone()),
            SimMachine::new("m2")
                .metadata("pool", "other")
                .loaded(w.old.clone()),
        ],
    ))
    .await
    .unwrap();
    let cfg = config(&sim, &w, "m", &all("restart"), 1, "");
    let operator = crate::common::daemon::operator(&cfg, TOKEN);
    operator
        .hold(&"m1".into(), "oncall", "incident 51", sim.now())
        .await
        .unwrap();
    assert!(sim.delete_metadata("m1", HOLD_KEY), "the agent deletes it");
    let d = Daemon::start(&sim, cfg, "r1").await;
    converged(&sim, "m2", &w.tip, Duration::from_secs(15)).await;
    more_sweeps(&d, 5).await;
    assert_eq!(
        restarts(&sim, "m1").len(),
        0,
        "a deleted hold was not honoured"
    );
    eventually("tampering alerted", Duration::from_secs(10), async || {
        d.alerted(AlertKind::MetadataTampered, "m1")
    })
    .await;
    operator.release(&"m1".into()).await.unwrap();
    converged(&sim, "m1", &w.tip, Duration::from_secs(20)).await;
    d.stop().await;
    sim.shutdown().await;
}

/// A fleet upgraded from a version without sealing keeps working: a hold it
/// wrote (unsigned) still holds, and the coordinator's unsigned slot set
/// (out of agents' reach) is read, then sealed by the next change.
#[tokio::test(start_paused = true)]
async fn records_of_the_previous_version_keep_the_fleet_working() {
    use fleet_reconciler::metadata::SLOTS_KEY;
    use fleet_reconciler::metadata::slots::{Slot, SlotSet};
    let w = world();
    let sim = Sim::start(fleet(&w, drifted(&w, &["m1", "m2"])))
        .await
        .unwrap();
    // As the previous version wrote them: a hold (no coordinator copy) and
    // a slot set with a slot its machine no longer needs.
    let old_hold = r#"{"by":"oncall","reason":"before the upgrade","at":"2026-01-01T00:00:00Z"}"#;
    sim.set_metadata("m1", HOLD_KEY, old_hold);
    let mut slots = SlotSet::parse(None).unwrap();
    slots.try_add(
        &"app".into(),
        &"default".into(),
        Slot {
            machine_id: "m9".into(),
            tag: "m9-gone".into(),
            owner: "old".into(),
            since: sim.now(),
        },
        1,
    );
    sim.set_metadata(COORD, SLOTS_KEY, &slots.to_value());
    let d = Daemon::start(&sim, config(&sim, &w, "m", &all("restart"), 1, ""), "r1").await;
    converged(&sim, "m2", &w.tip, Duration::from_secs(20)).await;
    more_sweeps(&d, 3).await;
    assert_eq!(
        restarts(&sim, "m1").len(),
        0,
        "an unsigned hold was not honoured"
    );
    assert!(
        sim.sealed_metadata(COORD, SLOTS_KEY).is_some(),
        "the slot set is sealed by the first change"
    );
    assert!(
        !d.alerted(AlertKind::MetadataTampered, "m1"),
        "a hold of ours is no tampering"
    );
    d.stop().await;
    sim.shutdown().await;
}

/// The record key rotates as docs/operations.md says ("Rotating the record
/// key", #33): two rotations are in flight under key A (both agents busy);
/// a daemon holding the new key B and A as the previous key finishes m1's
/// (its marker, sealed with A, still verifies, and is re-sealed with B at its
/// next phase) with no tampering alert. Once A is dropped, m2's marker, still
/// sealed with A, is foreign: m2 is not restarted and `metadata_tampered`
/// names it.
#[tokio::test(start_paused = true)]
async fn the_record_key_rotates_as_the_runbook_says() {
    use fleet_reconciler::metadata::seal::{RecordKey, RecordKeys};
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![
            SimMachine::new("m1").loaded(w.old.clone()).live_sessions(1),
            SimMachine::new("m2").loaded(w.old.clone()).live_sessions(1),
        ],
    ))
    .await
    .unwrap();
    let key_a = fleet_reconciler::sim::record_keys().current;
    let key_b = RecordKey::from_hex(&"b0".repeat(32)).unwrap();
    // Which key sealed `id`'s marker (read off the envelope, not verified).
    let kid = |id: &str| -> Option<String> {
        let value = sim.machine(id)?.metadata.get(MARKER_KEY)?.clone();
        serde_json::from_str::<serde_json::Value>(&value).ok()?["kid"]
            .as_str()
            .map(str::to_string)
    };
    let both = RecordKeys {
        current: key_b.clone(),
        previous: Some(key_a.clone()),
    };
    // Busy agents and a long grace: the rotations wait in `draining`.
    let cfg = || config(&sim, &w, "m", &all("restart"), 2, "restart_grace = \"1h\"");
    let d = Daemon::start(&sim, cfg(), "r1").await;
    eventually(
        "both claimed under key A",
        Duration::from_secs(20),
        async || {
            ["m1", "m2"]
                .iter()
                .all(|id| kid(id).as_deref() == Some(key_a.id().as_str()))
        },
    )
    .await;
    d.stop().await;

    // Step 1 of the runbook: B seals, A still verifies.
    let d = Daemon::build("r1", TOKEN)
        .keys(both.clone())
        .start(&sim, cfg())
        .await;
    more_sweeps(&d, 3).await;
    sim.set_live_sessions("m1", 0);
    eventually("m1 converges", Duration::from_secs(30), async || {
        sim.machine("m1").is_some_and(|m| {
            m.loaded_ref == w.tip && !m.cordoned && !m.metadata.contains_key(MARKER_KEY)
        })
    })
    .await;
    assert!(
        !d.alerted(AlertKind::MetadataTampered, "m1")
            && !d.alerted(AlertKind::MetadataTampered, "m2"),
        "a record sealed with the previous key is no tampering"
    );
    assert_eq!(
        kid("m2").as_deref(),
        Some(key_a.id().as_str()),
        "m2's marker had no phase change: still sealed with A"
    );
    d.stop().await;

    // Step 3: A dropped. m2's marker is foreign now: never acted on.
    let only_b = RecordKeys::new(key_b);
    let before = restarts(&sim, "m2").len();
    let d = Daemon::build("r1", TOKEN)
        .keys(only_b)
        .start(&sim, cfg())
        .await;
    sim.set_live_sessions("m2", 0);
    more_sweeps(&d, 6).await;
    assert!(
        d.alerted(AlertKind::MetadataTampered, "m2"),
        "a marker sealed by a dropped key is alerted"
    );
    assert_eq!(
        restarts(&sim, "m2").len(),
        before,
        "acted on a foreign marker"
    );
    assert_eq!(
        restarts(&sim, "m1").len(),
        1,
        "m1 was restarted once, under the new key"
    );
    d.stop().await;
    sim.shutdown().await;
}

// ---- Fly as it really behaves (#19) -------------------------------------------

/// The sim with one idle machine, m1, one commit behind the tip.
async fn one_drifted_machine(w: &World) -> Sim {
    Sim::start(fleet(w, vec![SimMachine::new("m1").loaded(w.old.clone())]))
        .await
        .unwrap()
}

/// A hand whose pool restarts at once (`restart`, no grace), cap 1.
async fn restart_at_once(sim: &Sim, w: &World) -> Hand {
    let cfg = config(sim, w, "m", &all("restart"), 1, "restart_grace = \"0s\"");
    Hand::new(sim, cfg).await
}

/// Claims the only drifted machine, then plans its restart (also the
/// rogue tests').
pub(crate) async fn claimed_then_restart(
    hand: &mut Hand,
) -> fleet_reconciler::decide::planner::Plan {
    use fleet_reconciler::act::executor::Outcome;
    let claim = hand.plan().await;
    assert_eq!(claim.steps()[0].kind(), "claim", "{:?}", claim.steps());
    assert_eq!(hand.run(&claim).await[0].outcome, Outcome::Done);
    let restart = hand.plan().await;
    assert_eq!(
        restart.steps()[0].kind(),
        "restart",
        "{:?}",
        restart.steps()
    );
    restart
}

/// Runs `plan` in its own task, so the test can act while its steps are in flight.
fn in_flight(
    hand: &Arc<Hand>,
    plan: &fleet_reconciler::decide::planner::Plan,
) -> JoinHandle<Vec<fleet_reconciler::act::executor::StepReport>> {
    let (hand, plan) = (hand.clone(), plan.clone());
    tokio::spawn(async move { hand.run(&plan).await })
}

/// The operator's `now` approval of the tip on `id`, or a `when-idle` one.
fn approve(sim: &Sim, w: &World, id: &str, mode: ApprovalMode) {
    let approval = Approval {
        target: CommitId::parse(&w.tip).expect("a commit id"),
        mode,
        by: "alice".into(),
        at: sim.now(),
    };
    // Out of band, as `fly machine update --metadata` or fly-go write it: no lease.
    sim.set_sealed_metadata(id, APPROVE_KEY, &serde_json::to_string(&approval).unwrap());
}

/// #19 defect 1. Before: the executor checked only that an approval named
/// the commit, so a `now` approval narrowed to `when-idle` after the plan
/// still let the stale step restart the busy machine.
#[tokio::test(start_paused = true)]
async fn a_now_approval_narrowed_to_when_idle_stops_the_interrupting_restart() {
    use fleet_reconciler::act::executor::Outcome;
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    approve(&sim, &w, "m1", ApprovalMode::Now);
    let mut hand = Hand::new(&sim, config(&sim, &w, "m", &all("manual"), 1, "")).await;
    let restart = claimed_then_restart(&mut hand).await;
    // The operator narrows the approval after the snapshot.
    approve(&sim, &w, "m1", ApprovalMode::WhenIdle);
    let done = hand.run(&restart).await;
    assert!(
        matches!(done[0].outcome, Outcome::Skipped(_)),
        "{:?}",
        done[0].outcome
    );
    assert!(restarts(&sim, "m1").is_empty(), "interrupted live work");
    sim.shutdown().await;
}

/// #19 defect 3. Before: the hold was read once at the start of the step;
/// one written (without a nonce, as Fly allows) while the step's marker
/// write was in flight did not stop the restart that followed.
#[tokio::test(start_paused = true)]
async fn a_hold_written_mid_step_stops_the_restart() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let restart = claimed_then_restart(&mut hand).await;
    // The `restarting` marker write hangs; the hold lands meanwhile.
    sim.hang_next_call("m1", "POST", "metadata", Duration::from_secs(3));
    let hand = Arc::new(hand);
    let run = in_flight(&hand, &restart);
    tokio::time::sleep(Duration::from_secs(1)).await;
    sim.set_metadata("m1", HOLD_KEY, "ops: incident 43");
    let done = run.await.unwrap();
    assert_eq!(done[0].outcome, Outcome::Skipped(Declined::Held));
    assert!(restarts(&sim, "m1").is_empty(), "restarted a held machine");
    sim.shutdown().await;
}

/// #19 defect 4. Before: the yield decided `undrain` from the snapshot, so a
/// drain that landed after it (a lost answer, another replica's retry) left
/// the agent fenced with no marker and no slot: invisible to every sweep.
#[tokio::test(start_paused = true)]
async fn a_drain_that_lands_after_the_snapshot_is_undone_by_the_yield() {
    use fleet_reconciler::act::executor::Outcome;
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1").cooperative()]))
        .await
        .unwrap();
    let mut hand = Hand::new(
        &sim,
        config(
            &sim,
            &w,
            "m",
            &all("alert-and-wait"),
            1,
            "checkpoint_deadline = \"1m\"",
        ),
    )
    .await;
    // The claim's drain request fails: the marker says it was requested.
    sim.fail_next_agent_call("m1", "drain", 503);
    let claim = hand.plan().await;
    assert_eq!(hand.run(&claim).await[0].outcome, Outcome::Done);
    let marker = marker_of(&sim, "m1").unwrap();
    assert!(marker.drain_requested && sim.machine("m1").unwrap().fence.is_none());
    // The sweep that first sees the draining marker: deadlines count from it.
    hand.plan().await;
    tokio::time::advance(Duration::from_secs(120)).await;
    let yield_ = hand.plan().await;
    assert_eq!(yield_.steps()[0].kind(), "yield", "{:?}", yield_.steps());
    // Another replica's retry of the drain lands after the snapshot.
    let drained = reqwest::Client::new()
        .post(format!("{}/agents/m1/overlay/drain", sim.api_url()))
        .json(&serde_json::json!({ "rotation": marker.tag }))
        .send()
        .await
        .unwrap();
    assert!(drained.status().is_success());
    assert!(sim.machine("m1").unwrap().fence.is_some());
    assert_eq!(hand.run(&yield_).await[0].outcome, Outcome::Done);
    let m = sim.machine("m1").unwrap();
    assert!(
        m.fence.is_none() && !m.cordoned,
        "left fenced or cordoned: {:?} {}",
        m.fence,
        m.cordoned
    );
    sim.shutdown().await;
}

/// #19 defect 5. Before: the fresh probe came before the `restarting`
/// marker write, which can retry for seconds; work that started in between
/// was killed by the restart.
#[tokio::test(start_paused = true)]
async fn work_that_starts_during_the_marker_write_is_not_killed() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = Hand::new(&sim, config(&sim, &w, "m", &all("alert-and-wait"), 1, "")).await;
    let restart = claimed_then_restart(&mut hand).await;
    sim.hang_next_call("m1", "POST", "metadata", Duration::from_secs(3));
    let hand = Arc::new(hand);
    let run = in_flight(&hand, &restart);
    tokio::time::sleep(Duration::from_secs(1)).await;
    sim.set_live_sessions("m1", 1);
    let done = run.await.unwrap();
    assert!(
        matches!(
            done[0].outcome,
            Outcome::Skipped(Declined::NotIdle(
                fleet_reconciler::decide::planner::NotIdle::LiveWork
            ))
        ),
        "{:?}",
        done[0].outcome
    );
    assert!(
        restarts(&sim, "m1").is_empty(),
        "killed work that had started"
    );
    sim.shutdown().await;
}

/// #19 defect 13. Before: restart sent `timeout=30s`, which Fly honours over
/// the app's `kill_timeout` (up to 300 s): an agent that checkpoints on its
/// stop signal was SIGKILLed.
#[tokio::test(start_paused = true)]
async fn a_restart_leaves_the_stop_timeout_to_the_apps_kill_timeout() {
    use fleet_reconciler::act::executor::Outcome;
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    for _ in 0..2 {
        let plan = hand.plan().await;
        assert_eq!(hand.run(&plan).await[0].outcome, Outcome::Done);
    }
    let sent: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| r.machine_id.as_deref() == Some("m1") && r.action.as_deref() == Some("restart"))
        .collect();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(
        !sent[0].query.as_deref().unwrap_or("").contains("timeout"),
        "restart overrides kill_timeout: {:?}",
        sent[0].query
    );
    sim.shutdown().await;
}

/// #19 defect 3, the CLI's side. Before: `hold` wrote without a nonce, so it
/// could land between two calls of a step in flight. Now it takes the
/// machine's lease, waiting ours out, and carries its own nonce; its
/// coordinator copy, written first, already stops the step before its
/// restart (#33).
#[tokio::test(start_paused = true)]
async fn the_hold_command_waits_out_a_step_in_flight_and_is_fenced() {
    use fleet_reconciler::act::executor::Outcome;
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let cfg = config(&sim, &w, "m", &all("restart"), 1, "restart_grace = \"0s\"");
    let mut hand = Hand::new(&sim, cfg.clone()).await;
    let restart = claimed_then_restart(&mut hand).await;
    sim.hang_next_call("m1", "POST", "metadata", Duration::from_secs(3));
    let hand = Arc::new(hand);
    let run = in_flight(&hand, &restart);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let operator = crate::common::daemon::operator(&cfg, TOKEN);
    let written = operator
        .hold(&"m1".into(), "oncall", "incident 44", sim.now())
        .await
        .unwrap();
    assert!(written.fenced);
    let done = run.await.unwrap();
    // The hold's authoritative copy, on the coordinator, is written before
    // the command waits for the machine's lease; the step reads it before
    // its restart (#33: an agent could delete the machine's copy), so it
    // stops there instead of restarting a machine an operator just held.
    assert_eq!(
        done[0].outcome,
        Outcome::Skipped(fleet_reconciler::act::executor::Declined::Held),
        "the step in flight ignored the hold's coordinator copy"
    );
    let calls: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| r.machine_id.as_deref() == Some("m1") && r.method != "GET")
        .collect();
    let hold_at = calls
        .iter()
        .position(|r| r.body.contains("incident 44"))
        .expect("the hold was written");
    assert!(
        calls.iter().all(|r| r.action.as_deref() != Some("restart")),
        "restarted a held machine"
    );
    assert!(
        calls[hold_at].lease_nonce.is_some(),
        "the hold was written without the lease"
    );
    sim.shutdown().await;
}

/// #19 defect 12. Before: a 429 on the lease acquire (Fly allows about one
/// lease call a second per machine) was a failed step and an ActionFailed
/// page; it is a skip: nothing was done, the next sweep tries again.
#[tokio::test(start_paused = true)]
async fn a_rate_limited_lease_is_a_skip_not_a_failure() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let claim = hand.plan().await;
    // Every retry of the acquire is refused too.
    sim.fail_next(10, 429, None);
    let done = hand.run(&claim).await;
    assert_eq!(done[0].outcome, Outcome::Skipped(Declined::RateLimited));
    assert!(done[0].events.is_empty(), "paged: {:?}", done[0].events);
    sim.shutdown().await;
}

/// #19 defect 12. Before: every claim took the coordinator's lease for
/// itself (lease, get, write, release), so at Fly's limit of about one lease
/// call a second per machine a sweep could change about one slot a second
/// fleet-wide. Claims that wait at the same instant share one lease.
#[tokio::test(start_paused = true)]
async fn one_sweeps_claims_share_one_coordinator_lease() {
    use fleet_reconciler::act::executor::Outcome;
    let w = world();
    let ids = ["m1", "m2", "m3", "m4", "m5", "m6"];
    let sim = Sim::start(fleet(
        &w,
        ids.iter()
            .map(|id| SimMachine::new(*id).loaded(w.old.clone()))
            .collect(),
    ))
    .await
    .unwrap();
    let mut hand = Hand::new(
        &sim,
        config(&sim, &w, "m", &all("restart"), 6, "restart_grace = \"1h\""),
    )
    .await;
    let claims = hand.plan().await;
    assert_eq!(claims.steps().len(), ids.len(), "{:?}", claims.steps());
    sim.clear_requests();
    let done = hand.run(&claims).await;
    assert!(done.iter().all(|r| r.outcome == Outcome::Done), "{done:?}");
    let coordinator_leases = sim
        .requests()
        .into_iter()
        .filter(|r| {
            r.machine_id.as_deref() == Some(COORD)
                && r.method == "POST"
                && r.action.as_deref() == Some("lease")
        })
        .count();
    assert!(
        coordinator_leases <= 2,
        "{coordinator_leases} coordinator leases for {} claims",
        ids.len()
    );
    sim.shutdown().await;
}

/// #19 defect 15. Before: a machine that stopped (autostop) mid-rotation
/// and whose uncordon then failed kept its slot: the undo failed every
/// sweep, and the pool (cap 1) never rotated anything else.
#[tokio::test(start_paused = true)]
async fn a_failed_uncordon_on_a_stopped_machine_frees_its_slot() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    use fleet_reconciler::sim::ChaosFault;
    let w = world();
    let sim = Sim::start(fleet(
        &w,
        vec![busy_for_an_hour(&w, "m1"), busy_for_an_hour(&w, "m2")],
    ))
    .await
    .unwrap();
    let mut hand = Hand::new(&sim, config(&sim, &w, "m", &all("alert-and-wait"), 1, "")).await;
    let claim = hand.plan().await;
    assert_eq!(claim.steps().len(), 1, "cap 1: {:?}", claim.steps());
    assert_eq!(hand.run(&claim).await[0].outcome, Outcome::Done);
    let first = claim.steps()[0].target.machine_id.to_string();
    let other = if first == "m1" { "m2" } else { "m1" };
    // Autostop stops it, cordoned; then every uncordon fails.
    sim.set_state(&first, "stopped");
    for _ in 0..6 {
        sim.fault_next_call(&first, "POST", "uncordon", ChaosFault::ServerError);
    }
    let release = hand.plan().await;
    let done = hand.run(&release).await;
    assert!(
        matches!(
            done.iter()
                .find(|r| r.step.target.machine_id.as_str() == first)
                .map(|r| &r.outcome),
            Some(Outcome::Skipped(Declined::UncordonRefused { .. }))
        ),
        "{done:?}"
    );
    // The pool is free: the other machine claims.
    let next = hand.plan().await;
    let claimed = next
        .steps()
        .into_iter()
        .any(|s| s.kind() == "claim" && s.target.machine_id.as_str() == other);
    assert!(claimed, "the pool stayed starved: {:?}", next.steps());
    assert!(
        next.alerts
            .iter()
            .any(|a| a.kind == AlertKind::RotationStuck
                && a.machine_id.as_ref().is_some_and(|id| id.as_str() == first)),
        "nobody is told the stopped machine may still be cordoned: {:?}",
        next.alerts
    );
    sim.shutdown().await;
}

/// #19 defect 16. Before: nothing told an outside update (`fly deploy`)
/// mid-rotation: a restart planned before it restarted the freshly deployed
/// machine (here its image pins the old overlay), interrupting its work on
/// a stale plan. The marker records the instance id the claim saw; another
/// one at the moment of action declines the step.
#[tokio::test(start_paused = true)]
async fn a_step_planned_before_an_outside_update_is_not_carried_out() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    use fleet_reconciler::sim::OutsideLease;
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    let mut hand = restart_at_once(&sim, &w).await;
    let claim = hand.plan().await;
    assert_eq!(hand.run(&claim).await[0].outcome, Outcome::Done);
    let recorded = marker_of(&sim, "m1").unwrap().instance_id;
    assert_eq!(recorded, Some(sim.machine("m1").unwrap().instance_id));
    let restart = hand.plan().await;
    assert_eq!(
        restart.steps()[0].kind(),
        "restart",
        "{:?}",
        restart.steps()
    );
    // `fly deploy` from a snapshot taken after the claim: the marker stays,
    // the instance changes, the machine comes back (on the old overlay).
    let snapshot = sim.machine("m1").unwrap().metadata;
    sim.outside_update("m1", &snapshot, OutsideLease::ReuseFound)
        .unwrap();
    tokio::time::advance(Duration::from_secs(5)).await;
    sim.set_loaded_ref("m1", &w.old);
    sim.set_live_sessions("m1", 1);
    let done = hand.run(&restart).await;
    assert!(
        matches!(
            done[0].outcome,
            Outcome::Skipped(Declined::UpdatedFromOutside { .. })
        ),
        "{:?}",
        done[0].outcome
    );
    assert!(restarts(&sim, "m1").is_empty(), "acted on a stale plan");
    sim.shutdown().await;
}

/// After `id`'s `nth` marker write from now, a 429 storm on its actions:
/// every bucket emptied, an action's token every 20 s, each 429 saying
/// `Retry-After` (the lease refreshes are actions too, so the lease lapses).
fn storm_after_marker_write(sim: &Sim, id: &str, nth: usize) {
    use fleet_reconciler::sim::{RateLimit, RateLimits, RetryAfter, SimHandle};
    fn arm(h: &SimHandle, id: String, left: usize) {
        let again = id.clone();
        h.after_next_call(&id, "POST", "metadata", move |h| {
            if left <= 1 {
                h.set_rate_limits(Some(RateLimits {
                    action: RateLimit {
                        per_second: 0.05,
                        burst: 1,
                    },
                    get: RateLimit::fly_get(),
                    retry_after: RetryAfter::Always,
                }));
                h.exhaust_rate_limits(&again);
            } else {
                arm(h, again, left - 1);
            }
        });
    }
    arm(&sim.handle(), id.to_string(), nth);
}

/// #19 defect 2 (c). Before: a call checked the lease once, then the client
/// retried it on 429, honouring `Retry-After`, long after the lease had
/// lapsed (its refreshes were throttled too): a restart landed after an
/// operator's hold. No call is sent or retried past the lease's validity.
#[tokio::test(start_paused = true)]
async fn a_throttled_restart_is_not_sent_after_its_lease_lapsed() {
    use fleet_reconciler::act::executor::Outcome;
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let restart = claimed_then_restart(&mut hand).await;
    storm_after_marker_write(&sim, "m1", 1);
    let hand = Arc::new(hand);
    let run = in_flight(&hand, &restart);
    // Past the lease's TTL (13 s): an operator holds the machine.
    tokio::time::sleep(Duration::from_secs(14)).await;
    sim.set_metadata("m1", HOLD_KEY, "ops: incident 45");
    let held_at = sim.now();
    let done = run.await.unwrap();
    assert!(
        matches!(done[0].outcome, Outcome::Skipped(_)),
        "{:?}",
        done[0].outcome
    );
    let late: Vec<_> = restarts(&sim, "m1")
        .into_iter()
        .filter(|at| *at >= held_at)
        .collect();
    assert!(late.is_empty(), "a restart landed after the hold: {late:?}");
    sim.shutdown().await;
}

/// #19 defect 2 (b). Before: a cordon retried on 429 past the machine's
/// lease landed on a machine held meanwhile.
#[tokio::test(start_paused = true)]
async fn a_throttled_cordon_is_not_sent_after_its_lease_lapsed() {
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = Hand::new(
        &sim,
        config(&sim, &w, "m", &all("restart"), 1, "restart_grace = \"1h\""),
    )
    .await;
    let claim = hand.plan().await;
    assert_eq!(claim.steps()[0].kind(), "claim");
    // Claiming, then draining: the storm starts after the second write.
    storm_after_marker_write(&sim, "m1", 2);
    let hand = Arc::new(hand);
    let run = in_flight(&hand, &claim);
    tokio::time::sleep(Duration::from_secs(14)).await;
    sim.set_metadata("m1", HOLD_KEY, "ops: incident 46");
    let held_at = sim.now();
    let _ = run.await.unwrap();
    let late: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| {
            r.machine_id.as_deref() == Some("m1")
                && r.action.as_deref() == Some("cordon")
                && r.status == Some(200)
                && r.at >= held_at
        })
        .collect();
    assert!(late.is_empty(), "a cordon landed after the hold: {late:?}");
    assert!(
        !sim.machine("m1").unwrap().cordoned,
        "cordoned a held machine"
    );
    sim.shutdown().await;
}

/// #19 defect 2 (a). Before: the coordinator's slot-set write that hung was
/// retried after the coordinator lease had lapsed (its refreshes failed),
/// after a second replica had taken the lease and written its own slot:
/// the late write erased that slot, and both machines were cordoned in a
/// cap-1 pool. Now no attempt is sent past the coordinator lease's validity.
#[tokio::test(start_paused = true)]
async fn a_hung_slot_write_is_not_retried_after_the_coordinator_lease_lapsed() {
    use fleet_reconciler::sim::{AuditConfig, ChaosFault};
    let w = world();
    let sim = Sim::start(fleet(&w, drifted(&w, &["m1", "m2"])))
        .await
        .unwrap();
    sim.enable_audit(AuditConfig::new("pool").cap("app", "default", 1));
    let cfg = config(&sim, &w, "m", &all("restart"), 1, "restart_grace = \"1h\"");
    let mut r1 = Hand::with_tuning(&sim, cfg.clone(), ExecutorConfig::new("r1")).await;
    let mut r2 = Hand::with_tuning(&sim, cfg, ExecutorConfig::new("r2")).await;
    let only = |plan: fleet_reconciler::decide::planner::Plan, id: &str| {
        let mut plan = plan;
        let decisions = format!("{:?}", plan.decisions());
        plan.machines.retain(|m, _| m.as_str() == id);
        assert_eq!(plan.steps().len(), 1, "{decisions}");
        plan
    };
    let claim1 = only(r1.plan().await, "m1");
    // r2 plans m2's claim from the same empty set (m1 briefly held, so
    // its plan picks the other machine).
    sim.set_metadata("m1", HOLD_KEY, "ops");
    let claim2 = only(r2.plan().await, "m2");
    sim.delete_metadata("m1", HOLD_KEY);
    // r1's slot write hangs attempt after attempt, and its coordinator
    // lease's refreshes fail: the lease lapses while the write is retried.
    for _ in 0..3 {
        sim.hang_next_call(COORD, "POST", "metadata", Duration::from_secs(30));
    }
    sim.handle().after_next_call(COORD, "POST", "lease", |h| {
        for _ in 0..5 {
            h.fault_next_call(COORD, "POST", "lease", ChaosFault::ServerError);
        }
    });
    let r1 = Arc::new(r1);
    let run1 = in_flight(&r1, &claim1);
    // Past the coordinator lease's TTL (13 s), r2 claims m2.
    tokio::time::sleep(Duration::from_secs(14)).await;
    let done2 = r2.run(&claim2).await;
    let _ = run1.await.unwrap();
    let audit = sim.audit();
    assert!(
        audit.cap_breaches.is_empty(),
        "cap 1 breached: {:?}",
        audit.cap_breaches
    );
    let cordoned: Vec<_> = ["m1", "m2"]
        .into_iter()
        .filter(|id| sim.machine(id).unwrap().cordoned)
        .collect();
    assert!(cordoned.len() <= 1, "{cordoned:?} cordoned; r2: {done2:?}");
    sim.shutdown().await;
}

/// #19 defect 2, the marker write. A `restarting` marker write that hangs
/// attempt after attempt, while the lease's refreshes fail, is not retried
/// after the lease lapsed: it could land over whatever someone else wrote.
#[tokio::test(start_paused = true)]
async fn a_hung_marker_write_is_not_retried_after_the_lease_lapsed() {
    use fleet_reconciler::sim::ChaosFault;
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let restart = claimed_then_restart(&mut hand).await;
    for _ in 0..3 {
        sim.hang_next_call("m1", "POST", "metadata", Duration::from_secs(30));
    }
    // After the step's acquire, every refresh fails: the lease lapses.
    sim.handle().after_next_call("m1", "POST", "lease", |h| {
        for _ in 0..5 {
            h.fault_next_call("m1", "POST", "lease", ChaosFault::ServerError);
        }
    });
    let acquired = sim.now();
    let _ = hand.run(&restart).await;
    let late: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| {
            r.machine_id.as_deref() == Some("m1")
                && r.action.as_deref() == Some("metadata")
                && r.method == "POST"
                && r.at >= acquired + chrono::Duration::seconds(13)
        })
        .collect();
    assert!(
        late.is_empty(),
        "a marker write sent after the lease lapsed: {late:?}"
    );
    assert!(restarts(&sim, "m1").is_empty());
    sim.shutdown().await;
}

/// The `action_unfenced` events of a run, and their summaries.
fn unfenced(done: &[fleet_reconciler::act::executor::StepReport]) -> Vec<String> {
    use fleet_reconciler::events::EventKind;
    done.iter()
        .flat_map(|r| &r.events)
        .filter(|e| e.kind == EventKind::ActionUnfenced)
        .map(|e| e.summary.clone())
        .collect()
}

/// #19, docs/safety.md "not covered" (1). A hold written within the one
/// round trip between the executor's re-read and the restart it cleared
/// cannot stop that restart (Fly fences no metadata write), but it must not
/// pass unseen: the read after the call finds it and the step reports an
/// `action_unfenced` event naming the call. A restart no hold raced reports
/// nothing.
#[tokio::test(start_paused = true)]
async fn a_hold_landing_within_the_restarts_round_trip_is_reported() {
    use fleet_reconciler::act::executor::Outcome;
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let restart = claimed_then_restart(&mut hand).await;
    // Served after the executor's last read, before Fly carries it out.
    sim.handle().before_next_call("m1", "POST", "restart", |h| {
        h.set_metadata("m1", HOLD_KEY, "ops: incident 47");
    });
    let done = hand.run(&restart).await;
    assert_eq!(done[0].outcome, Outcome::Done, "{:?}", done[0].outcome);
    assert_eq!(restarts(&sim, "m1").len(), 1);
    let reported = unfenced(&done);
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!(
        reported[0].contains("hold") && reported[0].contains("restart"),
        "{reported:?}"
    );
    let event = done[0]
        .events
        .iter()
        .find(|e| e.kind == fleet_reconciler::events::EventKind::ActionUnfenced);
    assert!(
        event.is_some_and(|e| e.severity >= fleet_reconciler::model::Severity::High),
        "an unfenced call pages at high at least: {event:?}"
    );

    // The control: the same rotation on a second machine, no hold.
    let w2 = world();
    let sim2 = one_drifted_machine(&w2).await;
    let mut hand2 = restart_at_once(&sim2, &w2).await;
    let restart2 = claimed_then_restart(&mut hand2).await;
    let done2 = hand2.run(&restart2).await;
    assert_eq!(done2[0].outcome, Outcome::Done);
    assert!(unfenced(&done2).is_empty(), "{:?}", unfenced(&done2));
    sim.shutdown().await;
    sim2.shutdown().await;
}

/// A busy cooperative machine in an `alert-and-wait` pool, and the plan
/// that claims it (a cordon, and a drain, follow); the world holds the
/// repository the config points at.
async fn busy_machine_to_claim() -> (World, Sim, Hand, fleet_reconciler::decide::planner::Plan) {
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1").cooperative()]))
        .await
        .unwrap();
    let mut hand = Hand::new(&sim, config(&sim, &w, "m", &all("alert-and-wait"), 1, "")).await;
    let claim = hand.plan().await;
    assert_eq!(claim.steps()[0].kind(), "claim", "{:?}", claim.steps());
    (w, sim, hand, claim)
}

/// #19, docs/safety.md "not covered" (1), the claim: a hold that lands
/// while the claim's cordon is in flight is found by the read after it and
/// reported; from then on nothing more is done to the machine.
#[tokio::test(start_paused = true)]
async fn a_hold_landing_around_a_cordon_is_reported_and_nothing_follows() {
    use fleet_reconciler::act::executor::Outcome;
    let (_world, sim, mut hand, claim) = busy_machine_to_claim().await;
    sim.handle().before_next_call("m1", "POST", "cordon", |h| {
        h.set_metadata("m1", HOLD_KEY, "ops: incident 48");
    });
    let done = hand.run(&claim).await;
    assert_eq!(done[0].outcome, Outcome::Done, "{:?}", done[0].outcome);
    let reported = unfenced(&done);
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!(reported[0].contains("cordon"), "{reported:?}");
    let next = hand.plan().await;
    assert!(
        next.steps().is_empty(),
        "acted on a held machine: {:?}",
        next.steps()
    );
    sim.shutdown().await;
}

/// #19, docs/safety.md "not covered" (2). A restart sent under the lease
/// whose answer never comes before the lease lapses may be carried out by
/// Fly at any later time: the step reports it (`action_unfenced`).
#[tokio::test(start_paused = true)]
async fn a_restart_left_unanswered_by_its_lease_is_reported() {
    use fleet_reconciler::act::executor::Outcome;
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let restart = claimed_then_restart(&mut hand).await;
    // Longer than the lease's TTL (13 s): the attempt is cut at its deadline.
    sim.hang_next_call("m1", "POST", "restart", Duration::from_secs(60));
    let done = hand.run(&restart).await;
    assert!(
        matches!(done[0].outcome, Outcome::Failed(_)),
        "{:?}",
        done[0].outcome
    );
    let reported = unfenced(&done);
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!(
        reported[0].contains("no answer") && reported[0].contains("lease lapsed"),
        "{reported:?}"
    );
    sim.shutdown().await;
}

/// #19, docs/safety.md "not covered" (2), the coordinator's side: a slot
/// write left unanswered may land after the coordinator's lease lapsed,
/// over another replica's; the claim that waited on it reports it.
#[tokio::test(start_paused = true)]
async fn a_slot_write_left_unanswered_is_reported() {
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = Hand::new(
        &sim,
        config(&sim, &w, "m", &all("restart"), 1, "restart_grace = \"1h\""),
    )
    .await;
    let claim = hand.plan().await;
    assert_eq!(claim.steps()[0].kind(), "claim", "{:?}", claim.steps());
    sim.hang_next_call(COORD, "POST", "metadata", Duration::from_secs(60));
    let done = hand.run(&claim).await;
    let reported = unfenced(&done);
    assert!(
        reported.iter().any(|s| s.contains("slot-set write")),
        "{reported:?} ({:?})",
        done[0].outcome
    );
    sim.shutdown().await;
}

/// #19, found by the chaos test (seed 20261201, under load): `fly deploy`
/// landed between the executor's read and its cordon. The update reverted
/// the marker, restarted the machine (lifting any cordon) and ended our
/// lease; the cordon then landed on the new instance, with no marker to
/// undo it. A claim on another machine then reclaimed the slot (no marker
/// with its tag): the machine stayed cordoned forever, outside the cap.
/// The read after the cordon sees another instance: the cordon is undone
/// at once and reported.
#[tokio::test(start_paused = true)]
async fn a_cordon_that_lands_after_an_outside_update_is_undone_at_once() {
    use fleet_reconciler::sim::OutsideLease;
    let (_world, sim, hand, claim) = busy_machine_to_claim().await;
    // `fly deploy` from a snapshot taken before the claim.
    let snapshot = sim.machine("m1").unwrap().metadata;
    sim.handle()
        .before_next_call("m1", "POST", "cordon", move |h| {
            h.outside_update("m1", &snapshot, OutsideLease::ReuseFound)
                .expect("the deploy lands");
        });
    let done = hand.run(&claim).await;
    let m1 = sim.machine("m1").unwrap();
    assert!(
        !m1.cordoned,
        "left cordoned with no marker: {:?}",
        m1.metadata
    );
    let reported = unfenced(&done);
    assert!(
        reported
            .iter()
            .any(|s| s.contains("updated from outside") && s.contains("cordon")),
        "{reported:?}"
    );
    sim.shutdown().await;
}

/// #32 item 2. Before: `approve --now`, the busy machine restarted as
/// approved, then `fly deploy` replaced it during verify: the rotation
/// ended cancelled (updated from outside), the approval stayed, and the
/// next sweep restarted the busy machine again. An approval authorizes one
/// rotation: the one that used it consumes it once it has restarted,
/// whatever its ending.
#[tokio::test(start_paused = true)]
async fn item2_an_approval_is_consumed_by_the_rotation_that_restarted() {
    use fleet_reconciler::act::executor::Outcome;
    use fleet_reconciler::decide::planner::{ReleaseWhy, StepKind};
    use fleet_reconciler::sim::OutsideLease;
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    let cfg = config(&sim, &w, "m", &all("manual"), 1, "");
    let mut hand = Hand::new(&sim, cfg).await;
    approve(&sim, &w, "m1", ApprovalMode::Now);
    let restart = claimed_then_restart(&mut hand).await;
    assert_eq!(hand.run(&restart).await[0].outcome, Outcome::Done);
    assert_eq!(restarts(&sim, "m1").len(), 1);
    // `fly deploy` during verify: a new instance, on the old overlay, busy.
    let snapshot = sim.machine("m1").unwrap().metadata;
    sim.outside_update("m1", &snapshot, OutsideLease::ReuseFound)
        .unwrap();
    tokio::time::advance(Duration::from_secs(5)).await;
    sim.set_loaded_ref("m1", &w.old);
    sim.set_live_sessions("m1", 1);
    let cancel = hand.plan().await;
    assert!(
        matches!(
            &cancel.steps()[0].kind,
            StepKind::Release {
                why: ReleaseWhy::UpdatedFromOutside,
                ..
            }
        ),
        "{:?}",
        cancel.steps()
    );
    assert_eq!(hand.run(&cancel).await[0].outcome, Outcome::Done);
    assert!(marker_of(&sim, "m1").is_none());
    assert!(
        !sim.machine("m1")
            .unwrap()
            .metadata
            .contains_key(APPROVE_KEY),
        "the approval outlived the rotation it authorized"
    );
    // The next sweeps ask an operator again; the busy machine is not restarted.
    for _ in 0..3 {
        let next = hand.plan().await;
        hand.run(&next).await;
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    assert_eq!(restarts(&sim, "m1").len(), 1, "restarted again");
    sim.shutdown().await;
}

/// #32 item 2: a newer approval, written after the rotation claimed with
/// another, stays when the rotation ends: it is the next rotation's.
#[tokio::test(start_paused = true)]
async fn item2_a_newer_approval_outlives_the_rotation_that_used_another() {
    use fleet_reconciler::act::executor::Outcome;
    use fleet_reconciler::sim::OutsideLease;
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    let cfg = config(&sim, &w, "m", &all("manual"), 1, "");
    let mut hand = Hand::new(&sim, cfg).await;
    approve(&sim, &w, "m1", ApprovalMode::Now);
    let claim = hand.plan().await;
    assert_eq!(hand.run(&claim).await[0].outcome, Outcome::Done);
    let restart = hand.plan().await;
    assert_eq!(hand.run(&restart).await[0].outcome, Outcome::Done);
    tokio::time::advance(Duration::from_secs(5)).await;
    // The operator approves again (a new value), then `fly deploy`.
    approve(&sim, &w, "m1", ApprovalMode::WhenIdle);
    let newer = sim.machine("m1").unwrap().metadata[APPROVE_KEY].clone();
    let snapshot = sim.machine("m1").unwrap().metadata;
    sim.outside_update("m1", &snapshot, OutsideLease::ReuseFound)
        .unwrap();
    tokio::time::advance(Duration::from_secs(5)).await;
    sim.set_loaded_ref("m1", &w.old);
    let cancel = hand.plan().await;
    assert_eq!(cancel.steps()[0].kind(), "cancel", "{:?}", cancel.steps());
    assert_eq!(hand.run(&cancel).await[0].outcome, Outcome::Done);
    assert!(marker_of(&sim, "m1").is_none());
    assert_eq!(
        sim.machine("m1").unwrap().metadata.get(APPROVE_KEY),
        Some(&newer)
    );
    sim.shutdown().await;
}

/// Sim-clock times at which `action` calls on `id` were accepted.
fn accepted(sim: &Sim, id: &str, action: &str) -> Vec<chrono::DateTime<Utc>> {
    sim.requests()
        .into_iter()
        .filter(|r| {
            r.machine_id.as_deref() == Some(id)
                && r.action.as_deref() == Some(action)
                && r.status == Some(200)
        })
        .map(|r| r.at)
        .collect()
}

/// #32 item 12. Before: `restart_grace` counted from the marker's write, so
/// a cordon that landed seconds later (after a 429 and a 500) let a busy
/// machine be restarted less than the grace after Fly cordoned it.
#[tokio::test(start_paused = true)]
async fn the_restart_grace_counts_from_the_cordon_fly_accepted() {
    use fleet_reconciler::sim::ChaosFault;
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    sim.fault_next_call("m1", "POST", "cordon", ChaosFault::TooManyRequests);
    sim.fault_next_call("m1", "POST", "cordon", ChaosFault::ServerError);
    let grace = chrono::Duration::seconds(5);
    let d = Daemon::start(
        &sim,
        config(&sim, &w, "m", &all("restart"), 1, "restart_grace = \"5s\""),
        "r1",
    )
    .await;
    eventually(
        "the busy machine restarted",
        Duration::from_secs(30),
        async || !restarts(&sim, "m1").is_empty(),
    )
    .await;
    let cordoned = *accepted(&sim, "m1", "cordon")
        .first()
        .expect("the cordon was accepted");
    let restarted = restarts(&sim, "m1")[0];
    assert!(
        restarted - cordoned >= grace,
        "restarted {} ms after the cordon landed, against a {} s grace",
        (restarted - cordoned).num_milliseconds(),
        grace.num_seconds()
    );
    converged(&sim, "m1", &w.tip, Duration::from_secs(10)).await;
    d.stop().await;
    sim.shutdown().await;
}

// ---- #32: the executor's defects ------------------------------------------------

/// The coordinator's slot set, as the sim holds it.
fn slots_of(sim: &Sim) -> fleet_reconciler::metadata::slots::SlotSet {
    use fleet_reconciler::metadata::SLOTS_KEY;
    use fleet_reconciler::metadata::slots::SlotSet;
    // Sealed by the daemon (or, written by the test, as an older version did).
    let value = sim
        .sealed_metadata(COORD, SLOTS_KEY)
        .or_else(|| sim.machine(COORD).unwrap().metadata.get(SLOTS_KEY).cloned());
    SlotSet::parse(value.as_deref()).unwrap()
}

/// #32 item 4. Before: past `rotation.release_ceiling` the planner gave up
/// the undrain of an unreachable agent, and the executor's late-drain rule
/// put it back: the undrain failed every sweep, the slot was never freed and
/// the (here `manual`) pool starved.
#[tokio::test(start_paused = true)]
async fn a_release_past_its_ceiling_gives_up_an_unreachable_agents_undrain_and_frees_its_slot() {
    use fleet_reconciler::act::executor::Outcome;
    use fleet_reconciler::metadata::SLOTS_KEY;
    use fleet_reconciler::metadata::marker::{Ending, RotationMode};
    use fleet_reconciler::metadata::slots::Slot;
    let w = world();
    // Started and cordoned; its agent gives no usable report.
    let sim = Sim::start(fleet(
        &w,
        vec![
            SimMachine::new("m1")
                .loaded(w.old.clone())
                .cooperative()
                .cordoned(true)
                .behaviour(Behaviour::HttpError(503)),
        ],
    ))
    .await
    .unwrap();
    let begun = sim.now() - chrono::Duration::hours(1);
    let releasing = Marker {
        tag: "m1-t32".into(),
        target: CommitId::parse(&w.tip).expect("the tip"),
        phase: Phase::Releasing,
        mode: RotationMode::Wait,
        action: fleet_reconciler::model::PolicyAction::Manual,
        severity: fleet_reconciler::model::Severity::Low,
        started_at: begun,
        attempt_started_at: begun,
        attempt: 0,
        owner: "hand".into(),
        restart_at: None,
        retry_at: None,
        drain_requested: true,
        cordoned: Some(true),
        ending: Some(Ending::Cancelled),
        instance_id: Some(sim.machine("m1").unwrap().instance_id),
        pool: None,
        failed: None,
        approval: None,
    };
    let mut slots = slots_of(&sim);
    slots.try_add(
        &"app".into(),
        &"default".into(),
        Slot {
            machine_id: "m1".into(),
            tag: releasing.tag.clone(),
            owner: "hand".into(),
            since: begun,
        },
        1,
    );
    sim.set_metadata(COORD, SLOTS_KEY, &slots.to_value());
    sim.set_sealed_metadata("m1", MARKER_KEY, &releasing.to_value());
    // Its undrain cannot be delivered.
    for _ in 0..3 {
        sim.fail_next_agent_call("m1", "undrain", 503);
    }
    let mut hand = Hand::new(&sim, config(&sim, &w, "m", &all("manual"), 1, "")).await;
    // The release ceiling counts on this replica's clock, from its first
    // sight of the marker (#32 item 8): seen now, past it half an hour on.
    let seen = hand.plan().await;
    assert_eq!(seen.steps()[0].kind(), "cancel", "{:?}", seen.steps());
    tokio::time::advance(Duration::from_secs(1801)).await;
    let plan = hand.plan().await;
    assert_eq!(plan.steps()[0].kind(), "cancel", "{:?}", plan.steps());
    let done = hand.run(&plan).await;
    assert_eq!(done[0].outcome, Outcome::Done, "{:?}", done[0].outcome);
    assert!(
        !slots_of(&sim).holds(&"app".into(), &"default".into(), &"m1".into(), "m1-t32"),
        "the slot of a given-up undrain is never freed"
    );
    let m1 = sim.machine("m1").unwrap();
    assert!(!m1.cordoned && marker_of(&sim, "m1").is_none(), "{m1:?}");
    sim.shutdown().await;
}

/// #32 item 7. Before: `fly deploy` landed between our read and our cordon
/// from a snapshot that held our `claiming` marker; the immediate uncordon
/// failed (the host went down); the planner then withdrew the claim, which
/// deleted the marker and the slot but not the cordon: a machine cordoned
/// with no marker, no slot and no alert.
#[tokio::test(start_paused = true)]
async fn a_cordon_after_a_deploy_that_reverted_to_our_claim_is_undone_by_the_withdraw() {
    use fleet_reconciler::act::executor::Outcome;
    use fleet_reconciler::sim::{HostStatus, OutsideLease};
    let (_world, sim, mut hand, claim) = busy_machine_to_claim().await;
    // The deploy's snapshot is taken just after our `claiming` marker write.
    sim.handle().after_next_call("m1", "POST", "metadata", |h| {
        let snapshot = h.machine("m1").expect("m1").metadata;
        h.before_next_call("m1", "POST", "cordon", move |h| {
            h.outside_update("m1", &snapshot, OutsideLease::ReuseFound)
                .expect("the deploy lands");
            // The undo of the cordon finds the host gone.
            h.before_next_call("m1", "POST", "uncordon", |h| {
                h.set_host_status("m1", HostStatus::Unreachable);
            });
        });
    });
    hand.run(&claim).await;
    sim.set_host_status("m1", HostStatus::Ok);
    let m1 = sim.machine("m1").unwrap();
    assert!(m1.cordoned, "the setup: the undo failed");
    assert_eq!(
        marker_of(&sim, "m1").map(|m| m.phase),
        Some(Phase::Claiming),
        "the setup: the deploy reverted to our claim"
    );
    let withdraw = hand.plan().await;
    assert_eq!(
        withdraw.steps()[0].kind(),
        "withdraw",
        "{:?}",
        withdraw.steps()
    );
    let done = hand.run(&withdraw).await;
    assert_eq!(done[0].outcome, Outcome::Done, "{:?}", done[0].outcome);
    let m1 = sim.machine("m1").unwrap();
    assert!(
        !m1.cordoned,
        "left cordoned with no marker and no slot: {:?}",
        m1.metadata
    );
    sim.shutdown().await;
}

/// #32 item 10. Before: when the read after a restart found the host
/// unreachable (its metadata unknown), the call was dropped: a hold that
/// raced the restart passed unseen, with no `action_unfenced`.
#[tokio::test(start_paused = true)]
async fn a_read_after_the_restart_that_cannot_be_made_is_reported() {
    use fleet_reconciler::sim::HostStatus;
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let restart = claimed_then_restart(&mut hand).await;
    sim.handle().after_next_call("m1", "POST", "restart", |h| {
        h.set_metadata("m1", HOLD_KEY, "ops: incident 49");
        h.set_host_status("m1", HostStatus::Unreachable);
    });
    let done = hand.run(&restart).await;
    assert_eq!(restarts(&sim, "m1").len(), 1);
    let reported = unfenced(&done);
    assert!(
        reported
            .iter()
            .any(|s| s.contains("restart") && s.contains("could not be read")),
        "{reported:?} ({:?})",
        done[0].outcome
    );
    sim.shutdown().await;
}

/// #32 item 11. Before: the machine was read before the fresh probe, and
/// the restart followed the probe with no read between: a hold written
/// while the probe was in flight did not stop it.
#[tokio::test(start_paused = true)]
async fn a_hold_written_while_the_probe_is_in_flight_stops_the_restart() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let restart = claimed_then_restart(&mut hand).await;
    // The executor's fresh probe is the agent's next health call.
    sim.handle().before_next_call("m1", "GET", "health", |h| {
        h.set_metadata("m1", HOLD_KEY, "ops: incident 50");
    });
    let done = hand.run(&restart).await;
    assert_eq!(sim.handle().pending_hooks(), 0, "the probe was made");
    assert_eq!(done[0].outcome, Outcome::Skipped(Declined::Held));
    assert!(restarts(&sim, "m1").is_empty(), "restarted a held machine");
    sim.shutdown().await;
}

/// #32 item 13d. Before: a restart refused by Fly's rate limit ended as a
/// skip, but its marker already said `restarting`: the rotation was taken
/// for one that restarted and waited out the verify deadline.
#[tokio::test(start_paused = true)]
async fn a_rate_limited_restart_puts_the_marker_back() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    use fleet_reconciler::sim::ChaosFault;
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let restart = claimed_then_restart(&mut hand).await;
    let before = marker_of(&sim, "m1").unwrap();
    // Every attempt of the restart (first and retries) answers 429.
    for _ in 0..5 {
        sim.fault_next_call("m1", "POST", "restart", ChaosFault::TooManyRequests);
    }
    let done = hand.run(&restart).await;
    assert_eq!(done[0].outcome, Outcome::Skipped(Declined::RateLimited));
    assert!(restarts(&sim, "m1").is_empty());
    assert_eq!(
        marker_of(&sim, "m1"),
        Some(before),
        "the marker says a restart happened"
    );
    sim.shutdown().await;
}

/// A step that finds the machine leased by someone else is skipped with
/// Fly's own 409 message (who holds it, until when), not a bare "leased".
#[tokio::test(start_paused = true)]
async fn a_step_skipped_for_a_foreign_lease_keeps_flys_message() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    let w = world();
    let sim = one_drifted_machine(&w).await;
    let mut hand = restart_at_once(&sim, &w).await;
    let claim = hand.plan().await;
    assert_eq!(claim.steps()[0].kind(), "claim", "{:?}", claim.steps());
    sim.acquire_lease_as("m1", "deployer@example.com", Duration::from_secs(3600))
        .unwrap();
    let done = hand.run(&claim).await;
    assert!(
        matches!(&done[0].outcome, Outcome::Skipped(Declined::Leased { .. })),
        "{:?}",
        done[0].outcome
    );
    let said = format!(
        "{:?} / {}",
        done[0].outcome,
        match &done[0].outcome {
            Outcome::Skipped(d) => d.to_string(),
            other => format!("{other:?}"),
        }
    );
    assert!(said.contains("deployer@example.com"), "{said}");
    sim.shutdown().await;
}

/// #32 item 3, the executor's part. Before: an unprobeable agent's restart
/// went ahead whatever Fly showed; when Fly's health checks all pass at the
/// moment of the restart, the machine serves as far as Fly can tell, and
/// the restart is declined.
#[tokio::test(start_paused = true)]
async fn an_unprobeable_restart_is_declined_when_flys_checks_all_pass() {
    use fleet_reconciler::act::executor::{Declined, Outcome};
    use fleet_reconciler::decide::planner::{RestartGuard, StepKind};
    use fleet_reconciler::sim::{CheckStatus, DEFAULT_CHECK};
    let w = world();
    let sim = Sim::start(fleet(&w, vec![busy_for_an_hour(&w, "m1")]))
        .await
        .unwrap();
    let mut hand = Hand::new(
        &sim,
        config(
            &sim,
            &w,
            "m",
            &all("alert-and-wait"),
            1,
            "probe_failure_ceiling = \"3s\"",
        ),
    )
    .await;
    let claim = hand.plan().await;
    assert_eq!(claim.steps()[0].kind(), "claim", "{:?}", claim.steps());
    assert_eq!(hand.run(&claim).await[0].outcome, Outcome::Done);
    // The agent stops answering, and Fly's check fails with it.
    sim.set_behaviour("m1", Behaviour::HttpError(503));
    sim.set_check("m1", DEFAULT_CHECK, CheckStatus::Critical);
    let record = hand.plan().await;
    hand.run(&record).await;
    // The ceiling counts from this replica's first sight of the record (#32 item 3).
    let _ = hand.plan().await;
    tokio::time::advance(Duration::from_secs(5)).await;
    let restart = hand.plan().await;
    assert!(
        matches!(
            restart.steps()[0].kind,
            StepKind::Restart {
                guard: RestartGuard::Unprobeable,
                ..
            }
        ),
        "{:?}",
        restart.steps()
    );
    // After the snapshot, Fly's check passes again.
    sim.set_check("m1", DEFAULT_CHECK, CheckStatus::Passing);
    let done = hand.run(&restart).await;
    assert_eq!(done[0].outcome, Outcome::Skipped(Declined::FlyChecksPass));
    assert!(
        restarts(&sim, "m1").is_empty(),
        "restarted a serving machine"
    );
    sim.shutdown().await;
}

//! Chaos: the real `fleet-reconciler run` binary keeps every safety promise
//! while the Fly API misbehaves, daemons are SIGKILLed at random moments, a
//! second replica races the first, and operators hold, approve and revoke.
//!
//! The world is a real overlay repository (the demo history), a simulated
//! fleet of 100 agents in three pools with different policies (`dispatch`:
//! restart after a grace; `conversation`: alert-and-wait; `review`: manual
//! for high and critical drift), and a stopped coordination machine whose
//! metadata keeps the pools' rotation slots. The simulator's audit records,
//! at the instant it happens, every cap breach, every restart (with the
//! agent's work and the rotation marker at that instant) and every action on
//! a held machine, so nothing short-lived escapes the verdict.
//!
//! What a pass proves, for the seed it prints:
//! - no pool ever had more machines out (cordoned, fenced, restarting) than its cap;
//! - no restart interrupted live work outside the policy (`restart` past its
//!   grace, or an operator's `approve` in mode `now` standing at that moment);
//! - every change to a machine was made under a lease (it carried a nonce);
//! - every restart belonged to a rotation (its marker said `restarting`), was
//!   made under the machine's lease, and no rotation restarted its machine
//!   twice in one attempt; no `manual` restart happened without a standing
//!   approval;
//! - nothing was done to a machine on operator hold;
//! - once the faults stop, the fleet converges on the tip and nothing is left
//!   cordoned, fenced, marked, or holding a slot;
//! - and the run was not vacuous: every kind of fault was injected and the
//!   daemon was SIGKILLed at least five times.
//!
//! `chaos_with_a_rogue_agent_keeps_every_promise_and_alerts_every_tampering`
//! runs the same world with a rogue agent (issue #33) in one machine on the
//! tip: at random instants it attacks random machines of its app through
//! the in-machine metadata socket (forged, copied and replayed approvals,
//! deleted operator holds, forged and rewritten markers, deleted
//! probe-failure records, and a try at the coordinator's slots, which sits
//! in another app). On top of every promise above it asserts that no restart
//! ran under a marker the rogue wrote, no disruptive call (cordon, restart,
//! …) reached a machine whose operator hold the rogue deleted before the
//! operator released it, the
//! coordinator stayed out of its reach, and every machine it tampered with
//! got a `metadata_tampered` alert (the daemons' "alert firing" log lines)
//! — every tampering a sweep saw: one that some listing of its app showed
//! while it stood (the simulator keeps, for each socket write, the listings
//! that showed it and who made them; each daemon process has a Fly token of
//! its own) by a process that then finished that sweep (it listed again),
//! unless the operator's release or the agent answering again ended it
//! first. A tampering the daemon's own next write replaced before any
//! listing, or seen only by a sweep SIGKILLed before it could page, needs
//! no alert (both counted).
//! At settle the operator clears what the rogue left (as the runbook
//! would). The rogue's draws come from their own RNG: the default run's
//! schedule is unchanged.
//!
//! Everything the test chooses (fleet, refs, busy periods, kills, holds,
//! approvals, revocations, outages, faults) is drawn from the seed; the
//! daemons' timing against them is not, so a failure prints the seed, the
//! violations (machine, pool, time), each violating machine's request history
//! and the tails of the daemons' logs. `CHAOS_SEED=<n>` reruns another seed;
//! `CHAOS_RUST_LOG` overrides the daemons' `RUST_LOG` (default `warn`), and
//! `CHAOS_KEEP=1` keeps the temp dir (configs, daemon logs, the applied
//! events and every request the sim kept); a failing run always keeps it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use fastrand::Rng;
use fleet_reconciler::metadata::marker::{Marker, Phase, RotationMode};
use fleet_reconciler::metadata::operator::{Approval, ApprovalMode, Hold};
use fleet_reconciler::metadata::slots::SlotSet;
use fleet_reconciler::metadata::{
    APPROVE_KEY, HOLD_KEY, MARKER_KEY, SLOTS_KEY, UNPROBED_KEY, coordinator_hold_key,
};
use fleet_reconciler::model::{CommitId, PolicyAction, Severity};
use fleet_reconciler::sim::{
    AuditConfig, AuditReport, Behaviour, Chaos, ChaosFault, ChaosStats, MarkerField,
    OperatorWriteRefused, RecordedRequest, RequestTarget, RogueAgent, Sim, SimApp, SimFleet,
    SimMachine, SimMachineView, SocketWrite, WorldFault, WorldFaultKind,
};

use crate::common::{OverlayRepo, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
const FLY_TOKEN: &str = "chaos-fly-token";
const ADMIN_TOKEN_ENV: &str = "CHAOS_ADMIN_TOKEN";
const APP: &str = "agents";
const COORD_APP: &str = "fleet-reconciler";
const COORD: &str = "coord0";
/// CI runs this seed; `CHAOS_SEED` overrides it.
const DEFAULT_SEED: u64 = 20_261_201;
const CHAOS_RATE: f64 = 0.2;
/// Longer than `fly.request_timeout`, so the client gives up first.
const CHAOS_HANG: Duration = Duration::from_secs(3);
const CHAOS_PHASE: Duration = Duration::from_secs(50);
/// At Fly's rate limits (on, as on Fly) a rotation takes a few seconds, a
/// pool rotates `cap` machines at a time, and `wait`-mode rotations wait for
/// their agents' sessions to end. Measured on a loaded 2-core host (8 runs
/// of the default seed, the code before and after #37 item 4 side by
/// side): settled after 42–70 s, twice after more than 75 s (the fleet still
/// rotating, one pool slot at a time).
const SETTLE_DEADLINE: Duration = Duration::from_secs(120);
/// SIGKILLs planned during the chaotic phase (at least 5 must happen).
const PLANNED_KILLS: usize = 6;
const MIN_KILLS: usize = 5;
/// How long an operator keeps retrying a write refused by a lease, mid-run.
const OPERATOR_PATIENCE: Duration = Duration::from_secs(1);
/// The same, when the test settles the fleet and must get through.
const SETTLE_PATIENCE: Duration = Duration::from_secs(20);
/// `rotation.restart_grace` of the config: a busy `restart` may come only after it.
const RESTART_GRACE: Duration = Duration::from_secs(2);
/// Clock slack when comparing the daemon's timestamps with the sim's (one host clock).
const CLOCK_SLACK_MS: i64 = 50;

// ---- the fleet ---------------------------------------------------------------

/// One pool: its size, cap and severity → action policy.
struct PoolSpec {
    name: &'static str,
    cap: usize,
    machines: usize,
    actions: [PolicyAction; 4],
}

impl PoolSpec {
    fn action(&self, severity: Severity) -> PolicyAction {
        self.actions[severity as usize]
    }

    fn actions_toml(&self) -> String {
        let [low, medium, high, critical] = self.actions.map(PolicyAction::as_str);
        format!(
            "{{ low = \"{low}\", medium = \"{medium}\", high = \"{high}\", critical = \"{critical}\" }}"
        )
    }
}

const POOLS: [PoolSpec; 3] = [
    PoolSpec {
        name: "dispatch",
        cap: 3,
        machines: 52,
        actions: [PolicyAction::Restart; 4],
    },
    PoolSpec {
        name: "conversation",
        cap: 2,
        machines: 32,
        actions: [PolicyAction::AlertAndWait; 4],
    },
    PoolSpec {
        name: "review",
        cap: 1,
        machines: 16,
        actions: [
            PolicyAction::AlertAndWait,
            PolicyAction::AlertAndWait,
            PolicyAction::Manual,
            PolicyAction::Manual,
        ],
    },
];

fn pool_spec(name: &str) -> &'static PoolSpec {
    POOLS.iter().find(|p| p.name == name).unwrap()
}

/// True with probability `p` (fastrand has no weighted coin).
fn chance(rng: &mut Rng, p: f64) -> bool {
    rng.f64() < p
}

/// Uniform in `range` (fastrand draws floats only from [0, 1)).
fn uniform(rng: &mut Rng, range: std::ops::Range<f64>) -> f64 {
    range.start + rng.f64() * (range.end - range.start)
}

/// How far behind the tip a machine starts, per severity under the default
/// rules and the demo history: < 5 commits of skills is low, 5–19 medium,
/// 20–22 high (20+ commits), 23+ critical (the range has the `Security:` trailer).
fn commits_behind_for(severity: Severity, rng: &mut Rng) -> usize {
    let choices: &[usize] = match severity {
        Severity::Low => &[1, 2, 3, 4],
        Severity::Medium => &[5, 9, 14, 19],
        Severity::High => &[20, 21, 22],
        Severity::Critical => &[23, 26, 30],
    };
    choices[rng.usize(0..choices.len())]
}

/// What the test decided about one agent before the fleet starts.
#[derive(Clone, Debug)]
struct PlannedMachine {
    id: String,
    pool: &'static str,
    /// `None`: loaded the tip.
    severity: Option<Severity>,
    loaded: String,
    busy_for: Option<Duration>,
    cooperative: bool,
    /// Reports a 12-character abbreviation of its ref.
    abbreviated: bool,
}

impl PlannedMachine {
    fn action(&self) -> Option<PolicyAction> {
        self.severity.map(|s| pool_spec(self.pool).action(s))
    }

    fn manual(&self) -> bool {
        self.action() == Some(PolicyAction::Manual)
    }
}

/// Half the busy agents work a few seconds; the other half for most of the
/// chaotic phase, because under 20% faults a sweep takes seconds and the
/// rotations that meet live work would otherwise all come after it ended.
/// Every busy period ends before the faults stop (and none starts later).
fn busy_period(rng: &mut Rng) -> Duration {
    let ms = if chance(rng, 0.5) {
        rng.u64(1_000..8_000)
    } else {
        rng.u64(10_000..CHAOS_PHASE.as_millis() as u64 * 4 / 5)
    };
    Duration::from_millis(ms)
}

fn plan_fleet(rng: &mut Rng, overlay: &OverlayRepo) -> Vec<PlannedMachine> {
    let mut machines = Vec::new();
    for pool in &POOLS {
        for i in 0..pool.machines {
            let severity = chance(rng, 0.6).then(|| {
                if pool.name == "review" {
                    Severity::ALL[rng.usize(0..4)]
                } else {
                    match rng.u32(0..100) {
                        0..35 => Severity::Low,
                        35..65 => Severity::Medium,
                        65..85 => Severity::High,
                        _ => Severity::Critical,
                    }
                }
            });
            let loaded = match severity {
                Some(s) => overlay.behind(commits_behind_for(s, rng)),
                None => overlay.tip(),
            };
            machines.push(PlannedMachine {
                id: format!("{}{i:02}", &pool.name[..1]),
                pool: pool.name,
                severity,
                loaded,
                busy_for: chance(rng, 0.3).then(|| busy_period(rng)),
                cooperative: chance(rng, 0.15),
                abbreviated: chance(rng, 0.1),
            });
        }
    }
    machines
}

fn sim_fleet(plan: &[PlannedMachine], tip: &str, restart_delay: Duration) -> SimFleet {
    let agents = plan.iter().map(|p| {
        let mut m = SimMachine::new(&p.id)
            .metadata("pool", p.pool)
            .loaded(p.loaded.clone());
        if let Some(d) = p.busy_for {
            m = m.behaviour(Behaviour::BusyFor(d));
        }
        if p.cooperative {
            m = m.cooperative();
        }
        if p.abbreviated {
            m = m.report_ref_len(12);
        }
        m
    });
    SimFleet::new(FLY_TOKEN)
        .release_tip(tip)
        .restart_delay(restart_delay)
        .app(SimApp::new(APP).machines(agents))
        .app(SimApp::new(COORD_APP).machine(SimMachine::new(COORD).stopped()))
}

/// Request faults at `CHAOS_RATE`, and Fly as it really behaves around
/// them (#19): hosts that go down (the coordinator's included), 429 storms
/// at the documented limits, holds written without a nonce at random
/// instants, and outside updates (`fly deploy` from an earlier snapshot).
fn realistic_chaos(seed: u64) -> Chaos {
    Chaos::new(seed, CHAOS_RATE)
        .hang(CHAOS_HANG)
        .host_outages(WorldFault::new(0.02, Duration::from_secs(3)))
        .rate_storms(0.01)
        .holds(
            HOLD_KEY,
            WorldFault::new(0.02, Duration::from_secs(2)).app(APP),
        )
        .outside_updates(WorldFault::new(0.01, Duration::ZERO).app(APP))
}

fn audit_config() -> AuditConfig {
    POOLS.iter().fold(
        AuditConfig {
            hold_key: HOLD_KEY.to_string(),
            marker_key: MARKER_KEY.to_string(),
            ..AuditConfig::new("pool")
        },
        |audit, p| audit.cap(APP, p.name, p.cap),
    )
}

// ---- configs -------------------------------------------------------------------

/// What every daemon's config shares.
struct ConfigWorld {
    dir: PathBuf,
    api_url: String,
    health_template: String,
    repo: PathBuf,
}

impl ConfigWorld {
    fn text(&self, mirror: &Path, port: u16) -> String {
        let pools: String = POOLS
            .iter()
            .map(|p| {
                format!(
                    "[pools.{}]\nmax_concurrent_rotations = {}\nactions = {}\n",
                    p.name,
                    p.cap,
                    p.actions_toml()
                )
            })
            .collect();
        format!(
            r#"
[fly]
api_url = "{api}"
request_timeout = "2s"
[overlay]
repo = "{repo}"
branch = "release"
fetch_interval = "2s"
mirror_dir = "{mirror}"
[sweep]
interval = "300ms"
[probe]
timeout = "1s"
[[apps]]
name = "{APP}"
health_url = "{health}"
pool_key = "pool"
{pools}
[rotation]
min_drift_age = "0s"
restart_grace = "{grace}s"
drain_ceiling = "8s"
checkpoint_deadline = "5s"
retry_after = "3s"
probe_failure_ceiling = "3s"
verify_deadline = "4s"
coordinator = "{COORD_APP}/{COORD}"
[server]
listen = "127.0.0.1:{port}"
admin_token_env = "{ADMIN_TOKEN_ENV}"
"#,
            api = self.api_url,
            repo = self.repo.display(),
            mirror = mirror.display(),
            health = self.health_template,
            grace = RESTART_GRACE.as_secs(),
        )
    }

    fn write(&self, name: &str, mirror: &str) -> PathBuf {
        let path = self.dir.join(format!("{name}.toml"));
        std::fs::write(&path, self.text(&self.dir.join(mirror), free_port())).unwrap();
        path
    }
}

fn rust_log() -> String {
    std::env::var("CHAOS_RUST_LOG").unwrap_or_else(|_| "warn".into())
}

/// Precondition: `check` (one read-only sweep of the real binary) classifies
/// every machine as the test planned, so the policy checks below mean what
/// they say.
async fn assert_classification_as_planned(world: &ConfigWorld, plan: &[PlannedMachine]) {
    let config = world.write("check", "mirror-check.git");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BIN)
            .args(["check", "--output", "json", "--config"])
            .arg(&config)
            .env("FLEET_RECONCILER_FLY_TOKEN", FLY_TOKEN)
            .env(
                "FLEET_RECONCILER_RECORD_KEY",
                fleet_reconciler::sim::DEFAULT_RECORD_KEY,
            )
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "check did not print a fleet report ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let seen: HashMap<&str, (&str, &str)> = report["machines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["machine_id"].as_str().unwrap(),
                (
                    m["severity"].as_str().unwrap_or("-"),
                    m["action"].as_str().unwrap_or("-"),
                ),
            )
        })
        .collect();
    for p in plan {
        let expected = (
            p.severity.map(|s| s.as_str()).unwrap_or("-"),
            p.action().map(PolicyAction::as_str).unwrap_or("-"),
        );
        assert_eq!(
            seen.get(p.id.as_str()).copied(),
            Some(expected),
            "machine {} (pool {}) is classified other than planned",
            p.id,
            p.pool
        );
    }
}

// ---- the daemons ---------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Replica {
    /// Runs from start to end (restarted after each kill).
    A,
    /// Runs concurrently for the middle third of the chaotic phase.
    B,
}

impl Replica {
    fn name(self) -> &'static str {
        match self {
            Replica::A => "a",
            Replica::B => "b",
        }
    }
}

struct Running {
    child: Child,
    log: PathBuf,
}

/// The daemon processes; every child still running is SIGKILLed on drop, so
/// a failing test leaves none behind.
struct Daemons {
    world: ConfigWorld,
    /// Where each process gets a Fly token of its own (the rogue run: the
    /// simulator then tells which process listed what); else all share one.
    own_tokens: Option<fleet_reconciler::sim::SimHandle>,
    /// The daemons' `RUST_LOG`.
    rust_log: String,
    running: BTreeMap<Replica, Running>,
    spawned: usize,
    kills: BTreeMap<Replica, usize>,
    logs: Vec<PathBuf>,
}

impl Daemons {
    fn new(world: ConfigWorld, rust_log: String) -> Daemons {
        std::fs::create_dir_all(world.dir.join("logs")).unwrap();
        Daemons {
            world,
            own_tokens: None,
            rust_log,
            running: BTreeMap::new(),
            spawned: 0,
            kills: BTreeMap::new(),
            logs: Vec::new(),
        }
    }

    fn is_running(&self, r: Replica) -> bool {
        self.running.contains_key(&r)
    }

    /// Starts `fleet-reconciler run` for the replica (its own mirror, a fresh port).
    fn spawn(&mut self, r: Replica) {
        assert!(!self.is_running(r), "replica {} already runs", r.name());
        self.spawned += 1;
        let name = format!("{}-{:02}", r.name(), self.spawned);
        let config = self.world.write(&name, &format!("mirror-{}.git", r.name()));
        let log = self.world.dir.join("logs").join(format!("{name}.log"));
        let out = File::create(&log).unwrap();
        let token = match &self.own_tokens {
            Some(sim) => {
                let token = format!("{FLY_TOKEN}-{name}");
                sim.add_app_token(APP, &token);
                sim.add_app_token(COORD_APP, &token);
                token
            }
            None => FLY_TOKEN.to_string(),
        };
        let child = Command::new(BIN)
            .arg("run")
            .arg("--config")
            .arg(&config)
            .env("FLEET_RECONCILER_FLY_TOKEN", &token)
            .env(
                "FLEET_RECONCILER_RECORD_KEY",
                fleet_reconciler::sim::DEFAULT_RECORD_KEY,
            )
            .env(ADMIN_TOKEN_ENV, "chaos-admin-token")
            .env("HOSTNAME", format!("chaos-{}", r.name()))
            .env("RUST_LOG", &self.rust_log)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        self.logs.push(log.clone());
        self.running.insert(r, Running { child, log });
    }

    /// SIGKILL (std's `Child::kill` on unix); `false` if it was not running.
    fn kill(&mut self, r: Replica) -> bool {
        let Some(mut d) = self.running.remove(&r) else {
            return false;
        };
        let _ = d.child.kill();
        let _ = d.child.wait();
        *self.kills.entry(r).or_default() += 1;
        true
    }

    fn kills(&self) -> usize {
        self.kills.values().sum()
    }

    /// Daemons that exited by themselves since the last look (a crash is a finding).
    fn reap(&mut self) -> Vec<(Replica, ExitStatus, PathBuf)> {
        let mut exited = Vec::new();
        for (r, d) in self.running.iter_mut() {
            if let Ok(Some(status)) = d.child.try_wait() {
                exited.push((*r, status, d.log.clone()));
            }
        }
        for (r, _, _) in &exited {
            self.running.remove(r);
        }
        exited
    }

    /// SIGTERM, then waits for the exit.
    async fn terminate(&mut self, r: Replica, patience: Duration) -> Result<ExitStatus, String> {
        let Some(mut d) = self.running.remove(&r) else {
            return Err(format!("replica {} was not running", r.name()));
        };
        let pid = d.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        if !sent.is_ok_and(|s| s.success()) {
            let _ = d.child.kill();
            let _ = d.child.wait();
            return Err(format!("could not send SIGTERM to {pid}"));
        }
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = d.child.try_wait() {
                return Ok(status);
            }
            if start.elapsed() > patience {
                let _ = d.child.kill();
                let _ = d.child.wait();
                return Err(format!(
                    "replica {} did not stop within {patience:?} of SIGTERM",
                    r.name()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every daemon's log, concatenated.
    fn all_logs(&self) -> String {
        self.logs
            .iter()
            .map(|log| std::fs::read_to_string(log).unwrap_or_default())
            .collect()
    }

    fn print_log_tails(&self, lines: usize) {
        for log in &self.logs {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            let tail = &all[all.len().saturating_sub(lines)..];
            println!(
                "---- {} ({} lines, last {}) ----",
                log.display(),
                all.len(),
                tail.len()
            );
            for line in tail {
                println!("{line}");
            }
        }
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        for d in self.running.values_mut() {
            let _ = d.child.kill();
            let _ = d.child.wait();
        }
    }
}

// ---- operators -----------------------------------------------------------------

/// One operator write of an approval: when (sim clock) and the mode it left
/// standing (`None`: revoked).
type ApprovalWrite = (DateTime<Utc>, Option<ApprovalMode>);

/// What operators did, so restarts can be judged against the approval that
/// stood at their instant.
#[derive(Default)]
struct Operators {
    /// Holds we placed and have not released.
    held: BTreeSet<String>,
    /// Per machine, in order: what each approval write left standing.
    approvals: HashMap<String, Vec<ApprovalWrite>>,
    holds: usize,
    releases: usize,
    approvals_now: usize,
    approvals_when_idle: usize,
    revokes: usize,
    /// Writes refused because a lease was held (then retried).
    refused: usize,
    /// Writes given up after their patience ran out.
    gave_up: usize,
    /// When each hold we placed was released (sim clock).
    released: Vec<(String, DateTime<Utc>)>,
}

impl Operators {
    /// Retries a write that a held lease refuses, for up to `patience`.
    async fn write(
        &mut self,
        patience: Duration,
        mut write: impl FnMut() -> Result<(), OperatorWriteRefused>,
    ) -> bool {
        let start = Instant::now();
        loop {
            match write() {
                Ok(()) => return true,
                Err(OperatorWriteRefused::Leased { .. }) => {
                    self.refused += 1;
                    if start.elapsed() >= patience {
                        self.gave_up += 1;
                        return false;
                    }
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
                Err(e) => panic!("operator write failed: {e}"),
            }
        }
    }

    async fn hold(&mut self, sim: &Sim, id: &str, patience: Duration) {
        if self.held.contains(id) {
            return;
        }
        let hold = serde_json::to_string(&Hold {
            by: "chaos-operator".into(),
            reason: "chaos test hold".into(),
            at: sim.now(),
        })
        .unwrap();
        // As `fleet-reconciler hold` does: the authoritative copy on the
        // coordinator first (out of every agent's reach), then the machine's
        // mirror; both sealed, neither under a lease.
        let on_coordinator = coordinator_hold_key(id);
        // The coordinator's copy alone holds the machine.
        if self
            .write(patience, || {
                sim.operator_set_sealed_metadata(COORD, &on_coordinator, &hold)
            })
            .await
        {
            self.held.insert(id.to_string());
            self.holds += 1;
            self.write(patience, || {
                sim.operator_set_sealed_metadata(id, HOLD_KEY, &hold)
            })
            .await;
        }
    }

    async fn release(&mut self, sim: &Sim, id: &str, patience: Duration) {
        if !self.held.contains(id) {
            return;
        }
        // As `fleet-reconciler release` does: the authoritative copy first.
        let on_coordinator = coordinator_hold_key(id);
        if self
            .write(patience, || {
                sim.operator_delete_metadata(COORD, &on_coordinator)
            })
            .await
            && self
                .write(patience, || sim.operator_delete_metadata(id, HOLD_KEY))
                .await
        {
            self.held.remove(id);
            self.releases += 1;
            self.released.push((id.to_string(), sim.now()));
        }
    }

    async fn approve(
        &mut self,
        sim: &Sim,
        id: &str,
        tip: &str,
        mode: ApprovalMode,
        patience: Duration,
    ) {
        let approval = serde_json::to_string(&Approval {
            target: CommitId::parse(tip).expect("a commit id"),
            mode,
            by: "chaos-operator".into(),
            at: sim.now(),
        })
        .unwrap();
        if self
            .write(patience, || {
                sim.operator_set_sealed_metadata(id, APPROVE_KEY, &approval)
            })
            .await
        {
            let log = self.approvals.entry(id.to_string()).or_default();
            log.push((sim.now(), Some(mode)));
            match mode {
                ApprovalMode::Now => self.approvals_now += 1,
                ApprovalMode::WhenIdle => self.approvals_when_idle += 1,
            }
        }
    }

    async fn revoke(&mut self, sim: &Sim, id: &str, patience: Duration) {
        if self
            .write(patience, || sim.operator_delete_metadata(id, APPROVE_KEY))
            .await
        {
            let log = self.approvals.entry(id.to_string()).or_default();
            log.push((sim.now(), None));
            self.revokes += 1;
        }
    }

    /// The approval mode an operator left standing on the machine at `at`.
    /// (The daemon itself clears an approval only after its rotation finished,
    /// i.e. after the restart it authorized.)
    fn approval_at(&self, id: &str, at: DateTime<Utc>) -> Option<ApprovalMode> {
        self.approvals
            .get(id)?
            .iter()
            .rev()
            .find(|(t, _)| *t <= at)
            .and_then(|(_, mode)| *mode)
    }
}

// ---- the schedule of the chaotic phase ---------------------------------------

#[derive(Clone, Debug)]
enum Event {
    Kill(Replica),
    Respawn(Replica),
    StartSecond,
    StopSecond,
    Hold(String),
    Release(String),
    Approve(String, ApprovalMode),
    Revoke(String),
    /// The agent stops answering: it hangs (`true`) or answers HTTP 503.
    Unreachable(String, bool),
    Reachable(String),
    /// The rogue agent attacks (only in the rogue run).
    Rogue(Attack),
}

/// Everything the chaotic phase does, at offsets from its start, drawn from the seed.
fn plan_events(rng: &mut Rng, plan: &[PlannedMachine]) -> Vec<(Duration, Event)> {
    let len = CHAOS_PHASE.as_secs_f64();
    let (second_from, second_to) = (len / 3.0, 2.0 * len / 3.0);
    let mut events = vec![
        (Duration::from_secs_f64(second_from), Event::StartSecond),
        (Duration::from_secs_f64(second_to), Event::StopSecond),
    ];
    // Kills, spread over the phase with jitter; in the second replica's
    // window some hit it instead of the first.
    for i in 0..PLANNED_KILLS {
        let base = len * (i as f64 + 0.5) / PLANNED_KILLS as f64;
        let at = (base + uniform(rng, -1.2..1.2)).clamp(0.5, len - 0.5);
        let in_window = at > second_from + 1.0 && at < second_to - 1.0;
        let who = if in_window && chance(rng, 0.4) {
            Replica::B
        } else {
            Replica::A
        };
        events.push((Duration::from_secs_f64(at), Event::Kill(who)));
        let back = (at + uniform(rng, 0.0..0.7)).min(len - 0.05);
        events.push((Duration::from_secs_f64(back), Event::Respawn(who)));
    }
    // Holds on random machines, released a few seconds later (or at settle).
    let mut picked = BTreeSet::new();
    for _ in 0..8 {
        let m = &plan[rng.usize(0..plan.len())];
        if !picked.insert(m.id.clone()) {
            continue;
        }
        let at = uniform(rng, 0.5..0.75 * len);
        events.push((Duration::from_secs_f64(at), Event::Hold(m.id.clone())));
        let until = at + uniform(rng, 2.0..10.0);
        if until < len {
            events.push((Duration::from_secs_f64(until), Event::Release(m.id.clone())));
        }
    }
    // Approvals of most manual machines, some revoked again. An approval is
    // never replaced by another mode mid-run, so the mode a rotation was
    // claimed under is the mode that stands until it is revoked.
    for m in plan.iter().filter(|m| m.manual()) {
        if !chance(rng, 0.7) {
            continue;
        }
        let at = uniform(rng, 0.5..0.8 * len);
        let mode = if chance(rng, 0.5) {
            ApprovalMode::Now
        } else {
            ApprovalMode::WhenIdle
        };
        events.push((
            Duration::from_secs_f64(at),
            Event::Approve(m.id.clone(), mode),
        ));
        if chance(rng, 0.4) {
            let revoke = at + uniform(rng, 0.5..6.0);
            if revoke < len {
                events.push((Duration::from_secs_f64(revoke), Event::Revoke(m.id.clone())));
            }
        }
    }
    // Outages of a few idle, automatically rotated agents, some running on
    // past the faults (only outages do: the settling applies them too).
    let idle_automatic: Vec<&PlannedMachine> = plan
        .iter()
        .filter(|m| m.busy_for.is_none() && m.action().is_some() && !m.manual())
        .collect();
    let mut out = BTreeSet::new();
    // (A seed may leave none: then there are no outages, not a panic.)
    for i in (0..3).take_while(|_| !idle_automatic.is_empty()) {
        let m = idle_automatic[rng.usize(0..idle_automatic.len())];
        if !out.insert(m.id.clone()) {
            continue;
        }
        let at = uniform(rng, 1.0..0.9 * len);
        events.push((
            Duration::from_secs_f64(at),
            Event::Unreachable(m.id.clone(), i % 2 == 0),
        ));
        let until = at + uniform(rng, 5.0..12.0);
        events.push((
            Duration::from_secs_f64(until),
            Event::Reachable(m.id.clone()),
        ));
    }
    events.sort_by_key(|(at, _)| *at);
    events
}

/// Carries out the schedule against the sim and the daemons.
struct Runner<'a> {
    sim: &'a Sim,
    tip: &'a str,
    daemons: Daemons,
    ops: Operators,
    second_wanted: bool,
    /// Daemons that exited without being asked.
    crashes: Vec<String>,
    started_at: DateTime<Utc>,
    /// Each event as it was applied (printed on failure).
    journal: Vec<String>,
    rogue: Option<Rogue>,
}

impl Runner<'_> {
    async fn apply(&mut self, event: &Event) {
        let sim = self.sim;
        let refused = self.ops.gave_up;
        self.apply_now(event).await;
        let outcome = if self.ops.gave_up > refused {
            " (gave up: leased)".to_string()
        } else {
            self.rogue
                .as_mut()
                .and_then(|r| r.last.take())
                .map(|o| format!(": {o}"))
                .unwrap_or_default()
        };
        self.journal.push(format!(
            "{} {event:?}{outcome}",
            when(sim.now(), self.started_at)
        ));
    }

    async fn apply_now(&mut self, event: &Event) {
        let sim = self.sim;
        match event {
            Event::Kill(r) => {
                self.daemons.kill(*r);
            }
            Event::Respawn(r) => {
                let wanted = *r == Replica::A || self.second_wanted;
                if wanted && !self.daemons.is_running(*r) {
                    self.daemons.spawn(*r);
                }
            }
            Event::StartSecond => {
                self.second_wanted = true;
                if !self.daemons.is_running(Replica::B) {
                    self.daemons.spawn(Replica::B);
                }
            }
            Event::StopSecond => {
                self.second_wanted = false;
                self.daemons.kill(Replica::B);
            }
            Event::Hold(id) => self.ops.hold(sim, id, OPERATOR_PATIENCE).await,
            Event::Release(id) => self.ops.release(sim, id, OPERATOR_PATIENCE).await,
            Event::Approve(id, mode) => {
                self.ops
                    .approve(sim, id, self.tip, *mode, OPERATOR_PATIENCE)
                    .await
            }
            Event::Revoke(id) => self.ops.revoke(sim, id, OPERATOR_PATIENCE).await,
            Event::Unreachable(id, hang) => {
                let behaviour = if *hang {
                    Behaviour::Hang
                } else {
                    Behaviour::HttpError(503)
                };
                sim.set_behaviour(id, behaviour);
            }
            Event::Reachable(id) => {
                // A restart meanwhile already brought back a normal agent.
                let view = sim.machine(id).unwrap();
                if matches!(view.behaviour, Behaviour::Hang | Behaviour::HttpError(_)) {
                    sim.set_behaviour(id, Behaviour::Normal);
                }
                if let Some(rogue) = self.rogue.as_mut() {
                    rogue.recovered.push((id.clone(), sim.now()));
                }
            }
            Event::Rogue(attack) => {
                if let Some(rogue) = self.rogue.as_mut() {
                    rogue.attack(sim, &self.ops, *attack).await;
                }
            }
        }
    }

    /// Notes daemons that died by themselves and starts them again.
    fn keep_daemons_up(&mut self) {
        for (r, status, log) in self.daemons.reap() {
            self.crashes.push(format!(
                "daemon {} exited by itself at {} with {status} (log {})",
                r.name(),
                when(self.sim.now(), self.started_at),
                log.display()
            ));
            if r == Replica::A || self.second_wanted {
                self.daemons.spawn(r);
            }
        }
    }
}

// ---- the rogue agent (opt-in) ------------------------------------------------

/// Salt of the rogue's RNG, so its draws never shift the default run's.
const ROGUE_SALT: u64 = 0x726f_6775_6561_6765;
/// Attacks during the chaotic phase.
const ROGUE_ATTACKS: usize = 30;

/// One attack of issue #33's list; its victim is drawn when it happens,
/// among the machines it fits then.
#[derive(Clone, Copy, Debug)]
enum Attack {
    /// Approve `now` from scratch, on itself or any machine of its app.
    ApproveNow,
    /// Copy an approval it reads onto another machine, as `now`.
    CopyApprovalAsNow,
    /// Read an approval to replay later.
    StealApproval,
    /// Write the stolen approval, verbatim, onto another machine.
    ReplayApproval,
    /// Delete an operator's hold.
    DeleteHold,
    /// Copy a neighbour's marker onto a machine without one, as `restarting`.
    ForgeMarker,
    /// Rewrite one field of a rotation in flight.
    RewriteMarker(MarkerField),
    /// Delete a probe-failure record.
    DeleteUnprobed,
    /// Empty the coordinator's slot set (in another app: must be refused).
    FreeSlots,
}

const ATTACKS: [Attack; 11] = [
    Attack::ApproveNow,
    Attack::CopyApprovalAsNow,
    Attack::StealApproval,
    Attack::ReplayApproval,
    Attack::DeleteHold,
    Attack::ForgeMarker,
    Attack::RewriteMarker(MarkerField::Target),
    Attack::RewriteMarker(MarkerField::Tag),
    Attack::RewriteMarker(MarkerField::Attempt(99)),
    Attack::DeleteUnprobed,
    Attack::FreeSlots,
];

/// The rogue's schedule: every kind once, then random kinds, at random
/// instants; and a hold deletion soon after each operator hold and a record
/// deletion soon after each agent outage of `events`, when there is
/// something to delete.
fn plan_rogue(rng: &mut Rng, events: &[(Duration, Event)]) -> Vec<(Duration, Event)> {
    let len = CHAOS_PHASE.as_secs_f64();
    let follow_ups: Vec<(Duration, Event)> = events
        .iter()
        .filter_map(|(at, e)| {
            let (after, attack) = match e {
                Event::Hold(_) => (uniform(rng, 0.3..1.5), Attack::DeleteHold),
                Event::Unreachable(..) => (uniform(rng, 2.0..5.0), Attack::DeleteUnprobed),
                _ => return None,
            };
            Some((*at + Duration::from_secs_f64(after), Event::Rogue(attack)))
        })
        .collect();
    (0..ROGUE_ATTACKS)
        .map(|i| {
            let attack = ATTACKS
                .get(i)
                .copied()
                .unwrap_or_else(|| ATTACKS[rng.usize(0..ATTACKS.len())]);
            let at = uniform(rng, 1.0..0.9 * len);
            (Duration::from_secs_f64(at), Event::Rogue(attack))
        })
        .chain(follow_ups)
        .collect()
}

/// What one attack did.
enum Outcome {
    Tampered(Tampering),
    /// It only read (a value to replay later).
    Read(String),
    /// No machine fitted, or the socket refused (said why).
    Nothing(String),
}

/// What the simulator saw of the socket: each write, the listings that
/// showed it, and each lister's latest listing.
struct Sightings {
    writes: Vec<SocketWrite>,
    last_listings: BTreeMap<String, u64>,
}

/// One write of the rogue that took effect.
#[derive(Clone, Debug)]
struct Tampering {
    at: DateTime<Utc>,
    /// The last request the sim had numbered when it took effect.
    seq: u64,
    machine: String,
    key: &'static str,
    /// The value written; `None` for a delete.
    written: Option<String>,
    what: String,
}

/// A rogue agent in one machine on the tip (never rotated, so always there).
struct Rogue {
    agent: RogueAgent,
    host: String,
    rng: Rng,
    tip: String,
    /// A commit other than the tip, for rewritten targets.
    old: String,
    stolen: Option<String>,
    tamperings: Vec<Tampering>,
    /// Attacks that found no victim, or that the socket refused (its own
    /// machine not started, a host down).
    idle: usize,
    /// What the coordinator's socket call got (it must be refused).
    coordinator_answers: Vec<Result<(), String>>,
    /// The outcome of the last attack, for the journal.
    last: Option<String>,
    /// When each agent made unreachable by the chaos answered again (or
    /// was found answering when the rogue deleted its probe-failure record).
    recovered: Vec<(String, DateTime<Utc>)>,
}

impl Rogue {
    fn new(sim: &Sim, plan: &[PlannedMachine], seed: u64, tip: &str, old: String) -> Rogue {
        let host = plan
            .iter()
            .find(|m| m.severity.is_none())
            .unwrap_or(&plan[0])
            .id
            .clone();
        Rogue {
            agent: sim.rogue(&host).expect("the rogue's machine exists"),
            host,
            rng: Rng::with_seed(seed ^ ROGUE_SALT),
            tip: tip.to_string(),
            old,
            stolen: None,
            tamperings: Vec::new(),
            idle: 0,
            coordinator_answers: Vec::new(),
            last: None,
            recovered: Vec::new(),
        }
    }

    /// A random machine of the app (`any`: itself included) that `fits`.
    fn pick(
        &mut self,
        sim: &Sim,
        any: bool,
        fits: impl Fn(&SimMachineView) -> bool,
    ) -> Option<String> {
        let found: Vec<String> = sim
            .machines()
            .into_iter()
            .filter(|m| m.app == APP && (any || m.id != self.host) && fits(m))
            .map(|m| m.id)
            .collect();
        (!found.is_empty()).then(|| found[self.rng.usize(0..found.len())].clone())
    }

    fn has(key: &'static str) -> impl Fn(&SimMachineView) -> bool {
        move |m| m.metadata.contains_key(key)
    }

    async fn attack(&mut self, sim: &Sim, ops: &Operators, attack: Attack) {
        let outcome = self.attempt(sim, ops, attack).await;
        self.last = Some(match outcome {
            Ok(Outcome::Tampered(t)) => {
                let line = format!("{} on {} ({})", t.what, t.machine, t.key);
                self.tamperings.push(t);
                line
            }
            Ok(Outcome::Read(what)) => what,
            Ok(Outcome::Nothing(why)) => {
                self.idle += 1;
                why
            }
            Err(e) => {
                self.idle += 1;
                format!("failed: {e}")
            }
        });
    }

    async fn attempt(
        &mut self,
        sim: &Sim,
        ops: &Operators,
        attack: Attack,
    ) -> Result<Outcome, fleet_reconciler::sim::RogueError> {
        let seq = sim.requests().last().map_or(0, |r| r.seq);
        let tampering = |machine: &str, key, written: Option<String>, what: &str| Tampering {
            at: sim.now(),
            seq,
            machine: machine.to_string(),
            key,
            written,
            what: what.to_string(),
        };
        let agent = self.agent.clone();
        Ok(Outcome::Tampered(match attack {
            Attack::ApproveNow => {
                let Some(victim) = self.pick(sim, true, |_| true) else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                let v = agent
                    .forge_approval_now(&victim, &self.tip, "chaos-operator", sim.now())
                    .await?;
                tampering(&victim, APPROVE_KEY, Some(v), "forged a `now` approval")
            }
            Attack::CopyApprovalAsNow => {
                let Some(source) = self.pick(sim, true, Self::has(APPROVE_KEY)) else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                let Some(victim) = self.pick(sim, true, |m| m.id != source) else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                let v = agent.copy_approval_as_now(&source, &victim).await?;
                tampering(
                    &victim,
                    APPROVE_KEY,
                    Some(v),
                    &format!("copied {source}'s approval as `now`"),
                )
            }
            Attack::StealApproval => {
                let Some(source) = self.pick(sim, true, Self::has(APPROVE_KEY)) else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                self.stolen = Some(agent.steal_approval(&source).await?);
                return Ok(Outcome::Read(format!("read {source}'s approval")));
            }
            Attack::ReplayApproval => {
                let Some(stolen) = self.stolen.clone() else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                let Some(victim) =
                    self.pick(sim, true, |m| m.metadata.get(APPROVE_KEY) != Some(&stolen))
                else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                agent.replay_approval(&stolen, &victim).await?;
                tampering(
                    &victim,
                    APPROVE_KEY,
                    Some(stolen),
                    "replayed a stolen approval",
                )
            }
            Attack::DeleteHold => {
                let held = ops.held.clone();
                let Some(victim) = self.pick(sim, false, |m| {
                    held.contains(&m.id) && m.metadata.contains_key(HOLD_KEY)
                }) else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                agent.delete_hold(&victim).await?;
                tampering(&victim, HOLD_KEY, None, "deleted the operator's hold")
            }
            Attack::ForgeMarker => {
                let Some(model) = self.pick(sim, false, Self::has(MARKER_KEY)) else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                let Some(victim) = self.pick(sim, false, |m| !m.metadata.contains_key(MARKER_KEY))
                else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                let v = agent
                    .forge_restarting_marker_from(&model, &victim, sim.now())
                    .await?;
                tampering(
                    &victim,
                    MARKER_KEY,
                    Some(v),
                    &format!("forged a `restarting` marker from {model}'s"),
                )
            }
            Attack::RewriteMarker(field) => {
                let Some(victim) = self.pick(sim, false, Self::has(MARKER_KEY)) else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                let v = agent.rewrite_marker(&victim, field, &self.old).await?;
                tampering(
                    &victim,
                    MARKER_KEY,
                    Some(v),
                    &format!("rewrote the marker's {field:?}"),
                )
            }
            Attack::DeleteUnprobed => {
                let Some(victim) = self.pick(sim, false, Self::has(UNPROBED_KEY)) else {
                    return Ok(Outcome::Nothing("nothing to attack".into()));
                };
                if agent.delete_unprobed(&victim).await?.is_none() {
                    return Ok(Outcome::Nothing("the record was gone".into()));
                }
                // An agent that answers again makes the record moot: a usable
                // report forgets it (docs/safety.md), deleted or not.
                let answering = sim.machine(&victim).is_some_and(|m| {
                    !matches!(m.behaviour, Behaviour::Hang | Behaviour::HttpError(_))
                });
                if answering {
                    self.recovered.push((victim.clone(), sim.now()));
                }
                tampering(
                    &victim,
                    UNPROBED_KEY,
                    None,
                    "deleted the probe-failure record",
                )
            }
            Attack::FreeSlots => {
                let across = RogueAgent::new(sim.addr(), &self.host, COORD_APP);
                let answer = across.free_all_slots(COORD).await;
                self.coordinator_answers
                    .push(answer.as_ref().map(|_| ()).map_err(|e| e.to_string()));
                match answer {
                    Ok(v) => tampering(COORD, SLOTS_KEY, Some(v), "emptied the slot set"),
                    Err(e) => return Ok(Outcome::Nothing(format!("refused: {e}"))),
                }
            }
        }))
    }

    /// What the rogue left that still stands, cleared as an operator
    /// following the `metadata_tampered` runbook would.
    async fn clean_up(&self, sim: &Sim, ops: &mut Operators, journal: &mut Vec<String>) {
        for t in &self.tamperings {
            let Some(written) = &t.written else { continue };
            let stands = sim
                .machine(&t.machine)
                .is_some_and(|m| m.metadata.get(t.key) == Some(written));
            // The runbook: a machine a foreign marker left cordoned is
            // uncordoned first, then the marker deleted.
            let cordoned = sim.machine(&t.machine).is_some_and(|m| m.cordoned);
            if stands
                && t.key == MARKER_KEY
                && cordoned
                && ops
                    .write(SETTLE_PATIENCE, || sim.operator_uncordon(&t.machine))
                    .await
            {
                journal.push(format!(
                    "operator uncordoned {} (a foreign marker)",
                    t.machine
                ));
            }
            if stands
                && ops
                    .write(SETTLE_PATIENCE, || {
                        sim.operator_delete_metadata(&t.machine, t.key)
                    })
                    .await
            {
                journal.push(format!(
                    "operator cleared the rogue's {} on {}",
                    t.key, t.machine
                ));
            }
        }
    }

    /// The promises a rogue must not break, and its tamperings left unalerted.
    fn violations(
        &self,
        audit: &AuditReport,
        requests: &[RecordedRequest],
        ops: &Operators,
        logs: &str,
        sightings: &Sightings,
        start: DateTime<Utc>,
    ) -> (Vec<String>, BTreeSet<String>) {
        let mut violations = Vec::new();
        let mut machines = BTreeSet::new();
        let written: BTreeSet<&str> = self
            .tamperings
            .iter()
            .filter(|t| t.key == MARKER_KEY)
            .filter_map(|t| t.written.as_deref())
            .collect();
        for e in &audit.restarts {
            if e.marker.as_deref().is_some_and(|m| written.contains(m)) {
                violations.push(format!(
                    "machine {} at {}: restarted under a marker the rogue wrote (busy={})",
                    e.machine_id,
                    when(e.at, start),
                    e.busy
                ));
                machines.insert(e.machine_id.clone());
            }
        }
        for t in self.tamperings.iter().filter(|t| t.key == HOLD_KEY) {
            let released = ops
                .released
                .iter()
                .filter(|(id, at)| *id == t.machine && *at >= t.at)
                .map(|(_, at)| *at)
                .min();
            // Putting the hold back is no action on the machine; nor is
            // bookkeeping or an undo (a marker write, an uncordon) of a step
            // already running when the hold was written: the executor reads
            // the coordinator's holds before each disruptive call only
            // (docs/safety.md, "Threat model").
            for r in requests.iter().filter(|r| {
                r.is_mutating()
                    && !matches!(r.action.as_deref(), Some("metadata" | "uncordon"))
                    && r.machine_id.as_deref() == Some(t.machine.as_str())
                    && r.at > t.at
                    && released.is_none_or(|rel| r.at < rel)
            }) {
                violations.push(format!(
                    "machine {} at {}: {} {} while its operator hold, deleted by the rogue at {}, was not released (request #{})",
                    t.machine,
                    when(r.at, start),
                    r.method,
                    r.action.as_deref().unwrap_or(&r.path),
                    when(t.at, start),
                    r.seq
                ));
                machines.insert(t.machine.clone());
            }
        }
        for answer in &self.coordinator_answers {
            let refused = matches!(answer, Err(e) if e.contains("403"));
            if !refused {
                violations.push(format!(
                    "the rogue's call on the coordinator (another app) was not refused with 403: {answer:?}"
                ));
            }
        }
        let alerted = |id: &str| {
            logs.lines().any(|l| {
                l.contains("alert firing")
                    && l.contains("metadata_tampered")
                    && l.split_whitespace().any(|field| {
                        field
                            .strip_prefix("machine_id=")
                            .is_some_and(|v| v.trim_matches('"') == id)
                    })
            })
        };
        // A tampering is owed an alert only if a sweep saw it: a listing of
        // its app, answered to the daemon, showed it while it stood (the
        // simulator's record of the socket's writes). One replaced
        // before any listing — by the daemon's own next write (it lands
        // within the round trip after the executor's read), by a `fly
        // deploy` from an earlier snapshot, or a record deleted after a
        // write whose answer was lost (no replica knew it was there) — was
        // seen by no sweep and needs none (counted). A write or a listing
        // the logs no longer hold counts as seen.
        let status: BTreeMap<u64, Option<u16>> =
            requests.iter().map(|r| (r.seq, r.status)).collect();
        let Sightings {
            writes: socket_writes,
            last_listings,
        } = sightings;
        let write_of = |t: &Tampering| {
            socket_writes.iter().find(|w| {
                w.seq > t.seq && w.machine_id == t.machine && w.key == t.key && w.value == t.written
            })
        };
        // (For a deleted probe-failure record, by a process that had listed
        // the record before: a deletion is told from "never written" only by
        // a replica that saw the record.)
        // And the sweep that listed it must have ended, as a sweep pages at
        // its end: its process (each has its own token) listed again after
        // it. One SIGKILLed in between could not page (the other replica
        // pages only if it listed the tampering too).
        let seen_in = |t: &Tampering| -> Option<Vec<u64>> {
            let w = write_of(t)?;
            Some(
                w.listed_in
                    .iter()
                    .filter(|l| status.get(&l.seq).is_none_or(|s| *s == Some(200)))
                    .filter(|l| last_listings.get(&l.by).is_some_and(|n| *n > l.seq))
                    // A deleted probe-failure record shows as nothing: only
                    // a process that had listed the record knows it is gone.
                    .filter(|l| {
                        t.key != UNPROBED_KEY
                            || t.written.is_some()
                            || w.prior_seen_by.contains(&l.by)
                    })
                    .map(|l| l.seq)
                    .collect(),
            )
        };
        let unseen = |t: &Tampering| seen_in(t).is_some_and(|l| l.is_empty());
        // The operator's release of the hold, or the agent answering again
        // (its probe-failure record is then forgotten; it may answer already
        // when the record is deleted), may end a tampering
        // before a replica's cycle reports it: a cycle pages after its steps,
        // and under chaos a step can hang to its lease's end or a replica be
        // killed. Those need no alert either (counted).
        let ended = |t: &Tampering| {
            let after = |list: &[(String, DateTime<Utc>)]| {
                list.iter().any(|(id, at)| *id == t.machine && *at >= t.at)
            };
            // A restart of the machine (its rotation's) also ends it: the
            // agent that boots reports again, and a usable report forgets
            // the record.
            let restarted = audit
                .restarts
                .iter()
                .any(|e| e.machine_id == t.machine && e.at >= t.at);
            match t.key {
                HOLD_KEY => after(&ops.released),
                UNPROBED_KEY => after(&self.recovered) || restarted,
                _ => false,
            }
        };
        let mut unalerted: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let (mut exempt, mut ended_by_owner) = (0, 0);
        for t in &self.tamperings {
            if unseen(t) {
                exempt += 1;
            } else if !alerted(&t.machine) {
                if ended(t) {
                    ended_by_owner += 1;
                } else {
                    unalerted
                        .entry(t.machine.as_str())
                        .or_default()
                        .push(format!(
                            "{} ({}) at {}, shown by listings {:?}",
                            t.what,
                            t.key,
                            when(t.at, start),
                            seen_in(t)
                                .unwrap_or_default()
                                .iter()
                                .map(|l| format!(
                                    "#{l} at {}",
                                    requests
                                        .iter()
                                        .find(|r| r.seq == *l)
                                        .map_or("?".into(), |r| when(r.at, start))
                                ))
                                .collect::<Vec<_>>()
                        ));
                }
            }
        }
        if exempt > 0 {
            println!(
                "{exempt} tamperings were replaced before a sweep that listed them could page: no alert required"
            );
        }
        if ended_by_owner > 0 {
            println!(
                "{ended_by_owner} unalerted tamperings were ended by the operator's release or the agent answering again: no alert required"
            );
        }
        for (id, what) in unalerted {
            violations.push(format!(
                "machine {id}: tampered with and no metadata_tampered alert fired: {}",
                what.join("; ")
            ));
        }
        (violations, machines)
    }
}

// ---- the verdict ---------------------------------------------------------------

fn when(at: DateTime<Utc>, start: DateTime<Utc>) -> String {
    let offset = (at - start).num_milliseconds() as f64 / 1000.0;
    format!(
        "{} (t{offset:+.3}s)",
        at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    )
}

/// Why a machine is not settled yet, if it is not.
fn unsettled_reason(m: &SimMachineView, tip: &str) -> Option<String> {
    let mut why = Vec::new();
    if m.state != "started" {
        why.push(format!("state {}", m.state));
    }
    if m.loaded_ref != tip {
        why.push(format!(
            "runs {}",
            &m.loaded_ref[..m.loaded_ref.len().min(12)]
        ));
    }
    if m.cordoned {
        why.push("cordoned".into());
    }
    if let Some(f) = &m.fence {
        why.push(format!("fenced by {f}"));
    }
    if let Some(marker) = m.metadata.get(MARKER_KEY) {
        why.push(format!("marker {marker}"));
    }
    (!why.is_empty()).then(|| why.join(", "))
}

/// The coordinator's slots whose machine still carries a marker with the slot's tag.
fn slots_of(sim: &Sim) -> (usize, Vec<String>) {
    let coord = sim.machine(COORD).unwrap();
    let value = coord.metadata.get(SLOTS_KEY).map(|v| {
        fleet_reconciler::sim::open_record(COORD, SLOTS_KEY, v).unwrap_or_else(|| v.clone())
    });
    let set = SlotSet::parse(value.as_deref())
        .unwrap_or_else(|e| panic!("coordinator slot set unreadable: {e}"));
    let mut total = 0;
    let mut live = Vec::new();
    for (pool, slots) in &set.pools {
        for slot in slots {
            total += 1;
            let marker_tag = sim
                .machine(slot.machine_id.as_str())
                .and_then(|m| m.metadata.get(MARKER_KEY).cloned())
                .and_then(|v| {
                    fleet_reconciler::sim::open_record(slot.machine_id.as_str(), MARKER_KEY, &v)
                })
                .and_then(|v| Marker::parse(&v))
                .map(|m| m.tag);
            if marker_tag.as_deref() == Some(slot.tag.as_str()) {
                live.push(format!(
                    "{pool}: {} (tag {}, owner {})",
                    slot.machine_id, slot.tag, slot.owner
                ));
            }
        }
    }
    (total, live)
}

/// Every restart judged against the policy, the rotation it belonged to and
/// the approvals that stood; returns the violations and the machines involved.
fn restart_violations(
    audit: &AuditReport,
    ops: &Operators,
    start: DateTime<Utc>,
) -> (Vec<String>, BTreeSet<String>) {
    let mut violations = Vec::new();
    let mut machines = BTreeSet::new();
    // (tag, attempt) → the restarts of that attempt: (machine, description).
    let mut rotations: BTreeMap<(String, u32), Vec<(String, String)>> = BTreeMap::new();
    for e in &audit.restarts {
        let at = when(e.at, start);
        let who = format!("machine {} (pool {}) at {at}", e.machine_id, e.pool);
        let mut flag = |v: String| {
            violations.push(v);
            machines.insert(e.machine_id.clone());
        };
        if e.action != "restart" {
            flag(format!("{who}: unexpected `{}` of the machine", e.action));
        }
        let Some(raw) = &e.marker else {
            flag(format!(
                "{who}: restarted with no rotation marker (busy={})",
                e.busy
            ));
            continue;
        };
        let opened = fleet_reconciler::sim::open_record(e.machine_id.as_str(), MARKER_KEY, raw);
        let Some(marker) = opened.and_then(|v| Marker::parse(&v)) else {
            flag(format!("{who}: restarted under an unreadable marker {raw}"));
            continue;
        };
        if marker.phase != Phase::Restarting || marker.restart_at.is_none() {
            flag(format!(
                "{who}: restarted while its marker said phase {} (restart_at {:?}), not `restarting`",
                marker.phase, marker.restart_at
            ));
        }
        if e.lease_owner.is_none() {
            flag(format!(
                "{who}: restarted with no unexpired lease on the machine"
            ));
        }
        rotations
            .entry((marker.tag.clone(), marker.attempt))
            .or_default()
            .push((e.machine_id.clone(), who.clone()));
        let approval = ops.approval_at(&e.machine_id, e.at);
        if marker.action == PolicyAction::Manual && approval.is_none() {
            flag(format!(
                "{who}: manual rotation {} restarted with no approval standing",
                marker.tag
            ));
        }
        if e.busy {
            let grace_over = e.at
                >= marker.started_at + chrono::Duration::from_std(RESTART_GRACE).unwrap()
                    - chrono::Duration::milliseconds(CLOCK_SLACK_MS);
            let allowed = match e.pool.as_str() {
                "dispatch" => {
                    marker.action == PolicyAction::Restart
                        && marker.mode == RotationMode::Grace
                        && (marker.attempt > 0 || grace_over)
                }
                "review" => {
                    marker.action == PolicyAction::Manual
                        && marker.mode == RotationMode::Now
                        && approval == Some(ApprovalMode::Now)
                }
                _ => false,
            };
            if !allowed {
                flag(format!(
                    "{who}: restart interrupted live work outside the policy (marker mode {}, action {}, attempt {}, draining since {}, approval standing {:?}, fenced {}, checkpoint {:?}); marker {raw}",
                    marker.mode.as_str(),
                    marker.action,
                    marker.attempt,
                    when(marker.started_at, start),
                    approval,
                    e.fenced,
                    e.checkpoint,
                ));
            }
        }
    }
    for ((tag, attempt), restarts) in rotations {
        if restarts.len() > 1 {
            machines.extend(restarts.iter().map(|(id, _)| id.clone()));
            let each: Vec<&str> = restarts.iter().map(|(_, who)| who.as_str()).collect();
            violations.push(format!(
                "rotation {tag} attempt {attempt} restarted its machine {} times: {}",
                restarts.len(),
                each.join("; ")
            ));
        }
    }
    (violations, machines)
}

/// Mutating Fly API calls (not the lease endpoints) that carried no lease
/// nonce: every change the daemon makes must be made under a lease it holds.
fn unleased_mutations(sim: &Sim, plan: &[PlannedMachine]) -> Vec<(RecordedRequest, &'static str)> {
    sim.requests()
        .into_iter()
        .filter(|r| r.is_mutating() && r.lease_nonce.is_none())
        .map(|r| {
            let pool = plan
                .iter()
                .find(|m| Some(m.id.as_str()) == r.machine_id.as_deref())
                .map(|m| m.pool)
                .unwrap_or(COORD_APP);
            (r, pool)
        })
        .collect()
}

/// One machine's requests (everything but health probes), with the faults injected.
fn print_request_history(sim: &Sim, id: &str, start: DateTime<Utc>, limit: usize) {
    let faults: HashMap<u64, ChaosFault> = sim
        .chaos_events()
        .into_iter()
        .map(|e| (e.seq, e.fault))
        .collect();
    let requests: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| {
            r.machine_id.as_deref() == Some(id)
                && !(r.target == RequestTarget::Agent && r.method == "GET")
        })
        .collect();
    println!(
        "---- requests to {id} ({} kept, last {limit}) ----",
        requests.len()
    );
    for r in requests.iter().skip(requests.len().saturating_sub(limit)) {
        let fault = faults
            .get(&r.seq)
            .map(|f| format!(" FAULT {f:?}"))
            .unwrap_or_default();
        let body = if r.path.contains("metadata") && !r.body.is_empty() {
            format!(" body {}", r.body)
        } else {
            String::new()
        };
        println!(
            "  #{} {} {} {} -> {:?} nonce={}{fault}{body}",
            r.seq,
            when(r.at, start),
            r.method,
            r.action.as_deref().unwrap_or(&r.path),
            r.status,
            r.lease_nonce.is_some(),
        );
    }
}

/// Everything the summary reports on.
struct Evidence<'a> {
    seed: u64,
    plan: &'a [PlannedMachine],
    audit: &'a AuditReport,
    machines: &'a [SimMachineView],
    tip: &'a str,
    stats: &'a ChaosStats,
    facts: &'a RunFacts,
    ops: &'a Operators,
    daemons: &'a Daemons,
}

/// Every request the sim kept, one per line, with the fault it got (`CHAOS_KEEP`).
fn write_request_log(sim: &Sim, path: &Path, start: DateTime<Utc>) {
    use std::fmt::Write as _;
    let faults: HashMap<u64, ChaosFault> = sim
        .chaos_events()
        .into_iter()
        .map(|e| (e.seq, e.fault))
        .collect();
    let mut out = String::new();
    for r in sim.requests() {
        let fault = faults
            .get(&r.seq)
            .map(|f| format!("{f:?}"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{}\t{:.3}\t{}\t{}\t{}\t{}\t{:?}\t{}\t{}",
            r.seq,
            (r.at - start).num_milliseconds() as f64 / 1000.0,
            r.method,
            r.machine_id.as_deref().unwrap_or("-"),
            r.action.as_deref().unwrap_or(&r.path),
            r.lease_nonce.is_some(),
            r.status,
            fault,
            r.body
                .chars()
                .take(300)
                .collect::<String>()
                .replace(['\n', '\t'], " "),
        );
    }
    std::fs::write(path, out).unwrap();
}

fn print_summary(evidence: &Evidence<'_>) {
    let Evidence {
        seed,
        plan,
        audit,
        machines,
        tip,
        stats,
        facts,
        ops,
        daemons,
    } = *evidence;
    println!();
    println!("==== chaos summary (seed {seed}; CHAOS_SEED=<n> to rerun another) ====");
    println!(
        "{:<13} {:>4} {:>8} {:>8} {:>7} {:>6} {:>10} {:>9} {:>8} {:>13} {:>8}",
        "pool",
        "cap",
        "max_out",
        "machines",
        "drifted",
        "manual",
        "busy@start",
        "converged",
        "restarts",
        "busy_restarts",
        "breaches"
    );
    for pool in &POOLS {
        let in_pool: Vec<&PlannedMachine> = plan.iter().filter(|m| m.pool == pool.name).collect();
        let converged = machines
            .iter()
            .filter(|m| {
                m.app == APP && m.metadata.get("pool").map(String::as_str) == Some(pool.name)
            })
            .filter(|m| unsettled_reason(m, tip).is_none())
            .count();
        let restarts: Vec<_> = audit
            .restarts
            .iter()
            .filter(|e| e.pool == pool.name)
            .collect();
        println!(
            "{:<13} {:>4} {:>8} {:>8} {:>7} {:>6} {:>10} {:>9} {:>8} {:>13} {:>8}",
            pool.name,
            pool.cap,
            audit
                .max_out
                .get(&(APP.to_string(), pool.name.to_string()))
                .copied()
                .unwrap_or(0),
            in_pool.len(),
            in_pool.iter().filter(|m| m.severity.is_some()).count(),
            in_pool.iter().filter(|m| m.manual()).count(),
            in_pool.iter().filter(|m| m.busy_for.is_some()).count(),
            converged,
            restarts.len(),
            restarts.iter().filter(|e| e.busy).count(),
            audit
                .cap_breaches
                .iter()
                .filter(|b| b.pool == pool.name)
                .count(),
        );
    }
    println!(
        "faults: {} of {} Fly API requests: 429 {}, 500 {}, 503 {}, hang-before {}, lost-after {}, hang-after {}",
        stats.injected(),
        stats.eligible,
        stats.too_many_requests,
        stats.server_error,
        stats.unavailable,
        stats.hang_before,
        stats.lost_after,
        stats.hang_after
    );
    println!(
        "daemons: {} spawned, {} SIGKILLed (a {}, b {}), {} crashed by themselves; final SIGTERM: {}",
        daemons.spawned,
        daemons.kills(),
        daemons.kills.get(&Replica::A).copied().unwrap_or(0),
        daemons.kills.get(&Replica::B).copied().unwrap_or(0),
        facts.crashes,
        facts.sigterm
    );
    println!(
        "operators: holds {} (released {}), approvals now {} / when-idle {}, revokes {}, writes refused by a lease {} (given up {})",
        ops.holds,
        ops.releases,
        ops.approvals_now,
        ops.approvals_when_idle,
        ops.revokes,
        ops.refused,
        ops.gave_up
    );
    let chaos_end = facts.chaos_end;
    let in_chaos = audit.restarts.iter().filter(|e| e.at < chaos_end);
    let (in_chaos, busy_in_chaos) =
        in_chaos.fold((0, 0), |(n, b), e| (n + 1, b + usize::from(e.busy)));
    println!(
        "audit: {} restarts ({in_chaos} in the chaotic phase, {busy_in_chaos} of them busy; dropped {}), {} cap breaches, {} held actions",
        audit.restarts.len(),
        audit.dropped_restarts,
        audit.cap_breaches.len() as u64 + audit.dropped_cap_breaches,
        audit.held_actions.len() as u64 + audit.dropped_held_actions
    );
    println!(
        "end: {} cordoned, {} fenced, {} marked, {} leases left; slots {} ({} live)",
        machines.iter().filter(|m| m.cordoned).count(),
        machines.iter().filter(|m| m.fence.is_some()).count(),
        machines
            .iter()
            .filter(|m| m.metadata.contains_key(MARKER_KEY))
            .count(),
        machines.iter().filter(|m| m.lease.is_some()).count(),
        facts.slots_total,
        facts.slots_live.len()
    );
    println!(
        "time: chaos {:.1}s, settled after {} (deadline {}s), total {:.1}s",
        facts.chaos.as_secs_f64(),
        facts
            .settled_after
            .map(|d| format!("{:.1}s", d.as_secs_f64()))
            .unwrap_or_else(|| "NEVER".into()),
        SETTLE_DEADLINE.as_secs(),
        facts.total.as_secs_f64()
    );
}

/// What the run measured besides the audit.
struct RunFacts {
    chaos: Duration,
    /// Sim time when the faults stopped.
    chaos_end: DateTime<Utc>,
    settled_after: Option<Duration>,
    total: Duration,
    sigterm: String,
    crashes: usize,
    slots_total: usize,
    slots_live: Vec<String>,
}

fn seed() -> u64 {
    match std::env::var("CHAOS_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("CHAOS_SEED={s:?} is not a u64")),
        Err(_) => DEFAULT_SEED,
    }
}

// ---- the test ------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_rotations_keep_every_promise() {
    chaos_run(false).await;
}

/// The same run with a rogue agent in one machine (issue #33; module docs).
///
/// Its alert check requires an alert only for a tampering some listing
/// showed (the simulator's record of which listings showed each socket
/// write): before, a clean CI run (seed 20261201) flagged a marker the
/// daemon's own write replaced and a probe-failure record deleted after a
/// write whose answer was lost, neither ever listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_with_a_rogue_agent_keeps_every_promise_and_alerts_every_tampering() {
    chaos_run(true).await;
}

async fn chaos_run(with_rogue: bool) {
    let begun = Instant::now();
    let seed = seed();
    println!("chaos seed {seed} (CHAOS_SEED=<n> reruns another)");
    let mut rng = Rng::with_seed(seed);

    // World.
    let overlay = OverlayRepo::new();
    let tip = overlay.tip();
    let plan = plan_fleet(&mut rng, &overlay);
    let restart_delay = Duration::from_millis(rng.u64(200..=500));
    let mut events = plan_events(&mut rng, &plan);
    if with_rogue {
        let rogue = plan_rogue(&mut Rng::with_seed(seed ^ ROGUE_SALT), &events);
        events.extend(rogue);
        events.sort_by_key(|(at, _)| *at);
    }
    let sim = Sim::start(sim_fleet(&plan, &tip, restart_delay))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let world = ConfigWorld {
        dir: dir.path().to_path_buf(),
        api_url: sim.api_url(),
        health_template: sim.health_url_template(),
        repo: overlay.repo_path.clone(),
    };
    println!(
        "fleet: {} agents, restart delay {restart_delay:?}, {} scheduled events; files in {}",
        plan.len(),
        events.len(),
        world.dir.display()
    );
    assert_classification_as_planned(&world, &plan).await;

    // Audit from here on; then faults and the first daemon.
    sim.enable_audit(audit_config());
    sim.set_chaos(Some(realistic_chaos(seed)));
    let started_at = sim.now();
    // The rogue run reads the daemons' "alert firing" lines.
    let log = if with_rogue {
        format!("{},fleet_reconciler::report::notify=info", rust_log())
    } else {
        rust_log()
    };
    let rogue = with_rogue.then(|| Rogue::new(&sim, &plan, seed, &tip, overlay.behind(1)));
    if let Some(r) = &rogue {
        println!("a rogue agent runs in {}", r.host);
    }
    let mut daemons = Daemons::new(world, log);
    daemons.own_tokens = with_rogue.then(|| sim.handle());
    let mut runner = Runner {
        sim: &sim,
        tip: &tip,
        daemons,
        ops: Operators::default(),
        second_wanted: false,
        crashes: Vec::new(),
        started_at,
        journal: Vec::new(),
        rogue,
    };
    runner.daemons.spawn(Replica::A);

    // Chaotic phase.
    let chaos_start = Instant::now();
    let mut pending = events.iter().peekable();
    while chaos_start.elapsed() < CHAOS_PHASE {
        while let Some((_, event)) = pending.next_if(|(at, _)| *at <= chaos_start.elapsed()) {
            runner.apply(event).await;
        }
        runner.keep_daemons_up();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let chaos = chaos_start.elapsed();
    let chaos_end = sim.now();

    // Settle: no faults, one daemon, no holds, every manual drift approved.
    sim.set_chaos(None);
    runner.second_wanted = false;
    runner.daemons.kill(Replica::B);
    runner.keep_daemons_up();
    if !runner.daemons.is_running(Replica::A) {
        runner.daemons.spawn(Replica::A);
    }
    let settle_start = Instant::now();
    if let Some(rogue) = runner.rogue.take() {
        rogue
            .clean_up(&sim, &mut runner.ops, &mut runner.journal)
            .await;
        runner.rogue = Some(rogue);
    }
    for id in runner.ops.held.clone() {
        runner.ops.release(&sim, &id, SETTLE_PATIENCE).await;
    }
    for m in plan.iter().filter(|m| m.manual()) {
        if sim.machine(&m.id).unwrap().loaded_ref != tip {
            runner
                .ops
                .approve(&sim, &m.id, &tip, ApprovalMode::Now, SETTLE_PATIENCE)
                .await;
        }
    }
    let mut settled_after = None;
    while settle_start.elapsed() < SETTLE_DEADLINE {
        // Only outages are still scheduled (see `plan_events`).
        while let Some((_, event)) = pending.next_if(|(at, _)| *at <= chaos_start.elapsed()) {
            runner.apply(event).await;
        }
        runner.keep_daemons_up();
        let machines_settled = sim
            .machines()
            .iter()
            .filter(|m| m.app == APP)
            .all(|m| unsettled_reason(m, &tip).is_none());
        if machines_settled && slots_of(&sim).1.is_empty() {
            settled_after = Some(settle_start.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let sigterm = match runner
        .daemons
        .terminate(Replica::A, Duration::from_secs(20))
        .await
    {
        Ok(status) if status.success() => Ok(status.to_string()),
        Ok(status) => Err(format!("daemon a exited with {status} after SIGTERM")),
        Err(e) => Err(e),
    };

    // Verdict.
    let audit = sim.audit();
    let stats = sim.chaos_stats();
    let machines = sim.machines();
    let (slots_total, slots_live) = slots_of(&sim);
    let facts = RunFacts {
        chaos,
        chaos_end,
        settled_after,
        total: begun.elapsed(),
        sigterm: match &sigterm {
            Ok(s) => s.clone(),
            Err(e) => format!("FAILED: {e}"),
        },
        crashes: runner.crashes.len(),
        slots_total,
        slots_live: slots_live.clone(),
    };
    let Runner {
        daemons,
        ops,
        crashes,
        journal,
        rogue,
        ..
    } = runner;
    std::fs::write(dir.path().join("events.txt"), journal.join("\n")).unwrap();
    print_summary(&Evidence {
        seed,
        plan: &plan,
        audit: &audit,
        machines: &machines,
        tip: &tip,
        stats: &stats,
        facts: &facts,
        ops: &ops,
        daemons: &daemons,
    });

    let (mut violations, mut suspects) = restart_violations(&audit, &ops, started_at);
    if let Some(rogue) = &rogue {
        let (v, m) = rogue.violations(
            &audit,
            &sim.requests(),
            &ops,
            &daemons.all_logs(),
            &Sightings {
                writes: sim.socket_writes(),
                last_listings: sim.last_listings(),
            },
            started_at,
        );
        println!(
            "rogue agent in {}: {} tamperings on {} machines, {} attacks found nothing or were refused",
            rogue.host,
            rogue.tamperings.len(),
            rogue
                .tamperings
                .iter()
                .map(|t| t.machine.as_str())
                .collect::<BTreeSet<_>>()
                .len(),
            rogue.idle
        );
        violations.extend(v);
        suspects.extend(m);
    }
    for b in &audit.cap_breaches {
        violations.push(format!(
            "cap breach in pool {} at {}: {} machines out {:?} (cap {})",
            b.pool,
            when(b.at, started_at),
            b.out.len(),
            b.out,
            b.cap
        ));
        suspects.extend(b.out.iter().cloned());
    }
    // Fly does not fence metadata writes: a hold can land while one of the
    // daemon's calls is already on its way. That call is no violation; a
    // call made after the daemon had read the machine again is one (the
    // executor re-reads the machine before every call).
    let requests = sim.requests();
    let read_since = |machine: &str, since: DateTime<Utc>, before_seq: u64| {
        requests.iter().any(|r| {
            r.target == RequestTarget::FlyApi
                && r.method == "GET"
                && r.machine_id.as_deref() == Some(machine)
                && r.action.as_deref() == Some("machine")
                && r.at > since
                && r.seq < before_seq
        })
    };
    let mut in_flight_held = 0usize;
    // Each such call should have been reported (`action_unfenced`, logged
    // at ERROR): counted, not asserted, since a daemon killed right after
    // its call, or a read that failed, reports nothing.
    let logs = daemons.all_logs();
    let mut reported_held = 0usize;
    let world_faults = {
        let s = sim.chaos_stats();
        format!(
            "{} host outages, {} 429 storms, {} holds without a nonce, {} outside updates",
            s.host_outages, s.rate_storms, s.holds, s.outside_updates
        )
    };
    for h in &audit.held_actions {
        if let Some(since) = h.held_since
            && !read_since(&h.machine_id, since, h.seq)
        {
            in_flight_held += 1;
            let id = format!("machine_id={}", h.machine_id);
            if logs
                .lines()
                .any(|l| l.contains(&id) && l.contains("a hold appeared"))
            {
                reported_held += 1;
            }
            continue;
        }
        let pool = plan
            .iter()
            .find(|m| m.id == h.machine_id)
            .map(|m| m.pool)
            .unwrap_or("?");
        violations.push(format!(
            "machine {} (pool {pool}) at {}: `{}` while on operator hold (request #{})",
            h.machine_id,
            when(h.at, started_at),
            h.what,
            h.seq
        ));
        suspects.insert(h.machine_id.clone());
    }
    println!(
        "held actions already on their way when the hold landed (no read in between): {in_flight_held}, {reported_held} of them reported as action_unfenced; faults of the world: {world_faults}"
    );
    let now = sim.now();
    for m in machines.iter().filter(|m| m.app == APP) {
        if let Some(why) = unsettled_reason(m, &tip) {
            let pool = m.metadata.get("pool").map(String::as_str).unwrap_or("?");
            violations.push(format!(
                "machine {} (pool {pool}) at {}: not settled at the end: {why}",
                m.id,
                when(now, started_at)
            ));
            suspects.insert(m.id.clone());
        }
    }
    for (r, pool) in unleased_mutations(&sim, &plan) {
        violations.push(format!(
            "machine {} (pool {pool}) at {}: {} {} sent without a lease nonce (request #{}, answered {:?})",
            r.machine_id.as_deref().unwrap_or("?"),
            when(r.at, started_at),
            r.method,
            r.action.as_deref().unwrap_or(&r.path),
            r.seq,
            r.status
        ));
        suspects.extend(r.machine_id.clone());
    }
    for live in &slots_live {
        violations.push(format!(
            "coordinator at {}: slot still live at the end: {live}",
            when(now, started_at)
        ));
    }
    if settled_after.is_none() {
        violations.push(format!(
            "the fleet did not settle within {SETTLE_DEADLINE:?} after the faults stopped"
        ));
    }
    if let Err(e) = &sigterm {
        violations.push(e.clone());
    }
    violations.extend(crashes);
    for fault in ChaosFault::ALL {
        if stats.count(fault) == 0 {
            violations.push(format!(
                "fault {fault:?} was never injected: the run proves nothing about it"
            ));
        }
    }
    let world = sim.chaos_world_events();
    for kind in [
        WorldFaultKind::HostOutage,
        WorldFaultKind::RateStorm,
        WorldFaultKind::Hold,
        WorldFaultKind::OutsideUpdate,
    ] {
        let n = world.iter().filter(|e| e.kind == kind).count();
        if n == 0 {
            violations.push(format!(
                "{kind:?} never happened: the run proves nothing about it"
            ));
        }
    }
    if world
        .iter()
        .any(|e| e.kind == WorldFaultKind::HostOutage && e.machine_id == COORD)
    {
        println!("the coordinator's host went down during the run");
    }
    if daemons.kills() < MIN_KILLS {
        violations.push(format!(
            "only {} SIGKILLs happened (at least {MIN_KILLS} needed)",
            daemons.kills()
        ));
    }

    if !violations.is_empty() {
        println!();
        println!("==== {} violation(s), seed {seed} ====", violations.len());
        for v in &violations {
            println!("- {v}");
        }
        for id in suspects.iter().take(6) {
            for e in audit.restarts.iter().filter(|e| &e.machine_id == id) {
                println!(
                    "restart of {id} at {}: busy {} fenced {} checkpoint {:?} lease {:?} marker {:?}",
                    when(e.at, started_at),
                    e.busy,
                    e.fenced,
                    e.checkpoint,
                    e.lease_owner,
                    e.marker
                );
            }
            print_request_history(&sim, id, started_at, 80);
        }
        println!("---- events as applied ----");
        for line in &journal {
            println!("{line}");
        }
        daemons.print_log_tails(25);
    }
    drop(daemons);
    if std::env::var_os("CHAOS_KEEP").is_some() || !violations.is_empty() {
        write_request_log(&sim, &dir.path().join("requests.tsv"), started_at);
    }
    sim.shutdown().await;
    if std::env::var_os("CHAOS_KEEP").is_some() || !violations.is_empty() {
        println!(
            "kept {} (configs, daemon logs, events)",
            dir.keep().display()
        );
    }
    assert!(
        violations.is_empty(),
        "seed {seed}: {} violation(s) of the rotation promises:\n{}",
        violations.len(),
        violations.join("\n")
    );
}

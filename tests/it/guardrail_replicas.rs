//! With two replicas, the guardrails agree (#36, "With two replicas: the
//! halt and the gates agree"): two daemons (`service::run`, in-process, on
//! tokio's paused clock shared with the sim, each with its own API) watch
//! one fleet through one coordinator, both reading one Alertmanager
//! stand-in (`gate::FakeAlertmanager`) as their alert gate. Asserted:
//! - while a matching alert fires, neither replica claims or restarts
//!   anything, and both APIs give every machine the same guard (and both
//!   export `fleet_reconciler_guardrail_blocked` for it);
//! - once it resolves, the pool rotates, never more machines out of service
//!   than its cap, each machine restarted once;
//! - a pool in a deny window is held by both replicas (the same guard, the
//!   same closing time, the same per-pool summary), and never restarted.
//!
//! - a bad release halts for both at once: whichever replica saw the
//!   failures raises the halt, and from then on neither claims or restarts
//!   anything toward that tip, both decide the rest `halted` (and export
//!   `guardrail_blocked{reason="halted"}`, with no until series), until
//!   `resume`, after which both go on.
//!
//! (`halt::a_bad_release_halts_itself_for_replicas_and_restarts_until_
//! resumed` covers a replica started after the one that halted stopped.)

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DurationRound, Timelike};
use fleet_reconciler::config::Config;
use fleet_reconciler::metadata::halt::HaltRecord;
use fleet_reconciler::model::AppName;
use fleet_reconciler::service::{self, ServiceSecrets};
use fleet_reconciler::sim::{Sim, SimMachine};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::daemon::{Service, service_secrets};
use crate::common::eventually;
use crate::gate::{Answer, FakeAlertmanager, agent_error_rate, alert};
use crate::halt::{bad_fleet, halt_record, halting, restarted};
use crate::rotation::{TOKEN, World, all, config, fleet, marker_of, restarts, world};

const BAD: [&str; 4] = ["m0", "m1", "m2", "m3"];

/// One replica: the whole service, its API on a loopback port.
struct Replica {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), service::ServiceError>>,
    api: String,
}

impl Replica {
    fn start(name: &str, config: Arc<Config>, sim: &Sim, gate_url: Option<&str>) -> Replica {
        let secrets = ServiceSecrets {
            gate_url: gate_url.map(|u| u.to_owned().into()),
            ..service_secrets(TOKEN)
        };
        let Service { stop, task, api } = Service::start(name, config, secrets, sim);
        Replica { stop, task, api }
    }

    async fn text(&self, path: &str) -> String {
        reqwest::get(format!("{}{path}", self.api))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Each machine's decision in its last sweep (`GET /api/v1/fleet`).
    async fn decisions(&self) -> BTreeMap<String, Value> {
        let fleet: Value = serde_json::from_str(&self.text("/api/v1/fleet").await).unwrap();
        fleet["decisions"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(id, d)| (id.clone(), d.clone()))
            .collect()
    }

    /// Its per-pool summary (`guardrails` of `GET /api/v1/fleet`).
    async fn guardrails(&self) -> Value {
        let fleet: Value = serde_json::from_str(&self.text("/api/v1/fleet").await).unwrap();
        fleet["guardrails"].clone()
    }

    /// Whether its /metrics says `pool` of `app` is held for `reason`.
    async fn blocked(&self, pool: &str, reason: &str) -> bool {
        let series = format!(
            "fleet_reconciler_guardrail_blocked{{fly_app=\"app\",pool=\"{pool}\",reason=\"{reason}\"}} 1"
        );
        self.text("/metrics").await.lines().any(|l| l == series)
    }

    /// Whether its /metrics has a `fleet_reconciler_guardrail_until_
    /// timestamp_seconds` series for `reason`.
    async fn until_for(&self, reason: &str) -> bool {
        let label = format!("reason=\"{reason}\"");
        self.text("/metrics").await.lines().any(|l| {
            l.starts_with("fleet_reconciler_guardrail_until_timestamp_seconds{")
                && l.contains(&label)
        })
    }

    /// `fleet_reconciler_sweeps_total{result="success"}`.
    async fn sweeps(&self) -> u64 {
        let prefix = "fleet_reconciler_sweeps_total{result=\"success\"} ";
        self.text("/metrics")
            .await
            .lines()
            .find_map(|l| l.strip_prefix(prefix)?.parse().ok())
            .unwrap_or(0)
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("replica stops")
            .unwrap()
            .unwrap();
    }
}

const MAIN: [&str; 3] = ["m1", "m2", "m3"];

/// The guard of `decision`, if it is `guarded`.
fn guard(decision: Option<&Value>) -> Option<&Value> {
    decision
        .filter(|d| d["kind"] == "guarded")
        .map(|d| &d["guard"])
}

/// A replica's config: pool `main` (cap 1) and pool `frozen` inside a deny
/// window for the whole test, both restarting at every severity, and the
/// alert gate.
fn replica_config(sim: &Sim, w: &World, mirror: &str) -> Arc<Config> {
    // Opened at the start of this minute, for a day.
    let opened = w
        .clock
        .now()
        .duration_trunc(chrono::Duration::minutes(1))
        .expect("a minute");
    let restart = all("restart");
    let extra = format!(
        r#"max_attempts = 1
verify_deadline = "5s"
restart_grace = "0s"
[gates.alertmanager]
url_env = "AM_GATE_URL"
matchers = ['severity="critical"', 'alertname=~"Agent.*"']
timeout = "2s"
[pools.main]
max_concurrent_rotations = 1
actions = {restart}
[pools.frozen]
max_concurrent_rotations = 1
actions = {restart}
windows = [{{ deny = "{} {} * * *", duration = "24h" }}]
"#,
        opened.minute(),
        opened.hour()
    );
    config(sim, w, mirror, &restart, 1, &extra)
}

#[tokio::test(start_paused = true)]
async fn two_replicas_hold_the_same_pools_for_the_same_guards() {
    let w = world();
    let in_pool = |id: &str, pool: &str| {
        SimMachine::new(id)
            .loaded(w.old.clone())
            .metadata("pool", pool)
    };
    let mut machines: Vec<SimMachine> = MAIN.iter().map(|id| in_pool(id, "main")).collect();
    machines.push(in_pool("f1", "frozen"));
    // Two replicas sweeping every 150ms on one token would share Fly's
    // List budget (1/s per app) and sweep less often: not the subject here.
    let sim = Sim::start(fleet(&w, machines).list_rate_limit(None))
        .await
        .unwrap();
    let am = FakeAlertmanager::start(Answer::Alerts(vec![agent_error_rate()])).await;
    let a = Replica::start(
        "replica-a",
        replica_config(&sim, &w, "a"),
        &sim,
        Some(&am.url),
    );
    let b = Replica::start(
        "replica-b",
        replica_config(&sim, &w, "b"),
        &sim,
        Some(&am.url),
    );
    let replicas = [&a, &b];

    // (a) The alert fires: both decide every machine.
    for r in replicas {
        eventually(
            "a decision for every machine",
            Duration::from_secs(20),
            async || r.decisions().await.len() == 4,
        )
        .await;
    }
    // Several sweeps of each while it fires: chances to claim.
    let before = [a.sweeps().await, b.sweeps().await];
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = [a.sweeps().await, b.sweeps().await];
    assert!(
        after[0] >= before[0] + 5 && after[1] >= before[1] + 5,
        "the replicas did not sweep while the alert fired: {before:?} → {after:?}"
    );
    let (da, db) = (a.decisions().await, b.decisions().await);
    for id in ["m1", "m2", "m3", "f1"] {
        assert!(
            restarts(&sim, id).is_empty() && marker_of(&sim, id).is_none(),
            "{id} was claimed or restarted while a matching alert fired: {:?}",
            marker_of(&sim, id)
        );
        assert!(
            guard(da.get(id)).is_some_and(|g| g["reason"] == "alert_firing"
                && g["alert"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("AgentErrorRate"))),
            "{id} is not held by the alert: {:?}",
            da.get(id)
        );
        assert_eq!(
            guard(da.get(id)),
            guard(db.get(id)),
            "the replicas disagree on {id}'s guard"
        );
    }
    for r in replicas {
        for pool in ["main", "frozen"] {
            assert!(
                r.blocked(pool, "alert_firing").await,
                "{} does not export {pool} held by alert_firing",
                r.api
            );
        }
    }

    // It resolves (only one that matches no matcher fires): main rotates,
    // one machine out of service at a time across both replicas.
    am.set(Answer::Alerts(vec![alert(
        json!({"alertname": "AgentSlow", "severity": "warning"}),
    )]));
    let start = tokio::time::Instant::now();
    loop {
        let out = MAIN
            .iter()
            .filter(|id| {
                sim.machine(id)
                    .is_some_and(|m| m.cordoned || m.state != "started")
            })
            .count();
        assert!(out <= 1, "{out} machines of pool main (cap 1) out at once");
        assert!(
            restarts(&sim, "f1").is_empty() && marker_of(&sim, "f1").is_none(),
            "f1 was claimed inside its deny window: {:?}",
            marker_of(&sim, "f1")
        );
        let done = MAIN.iter().all(|id| {
            marker_of(&sim, id).is_none()
                && sim
                    .machine(id)
                    .is_some_and(|m| m.loaded_ref == w.tip && !m.cordoned)
        });
        if done {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "pool main did not rotate once the alert resolved"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for id in MAIN {
        assert_eq!(restarts(&sim, id).len(), 1, "{id} restarted exactly once");
    }

    // (b) The deny window holds frozen on both, for the same guard.
    for r in replicas {
        eventually("held by the window", Duration::from_secs(20), async || {
            guard(r.decisions().await.get("f1")).is_some_and(|g| g["reason"] == "window")
        })
        .await;
    }
    let (da, db) = (a.decisions().await, b.decisions().await);
    let held = guard(da.get("f1")).cloned();
    assert!(
        held.as_ref().is_some_and(|g| g["reason"] == "window"
            && g["deny"] == true
            && g["until"].is_string()),
        "f1 is not held by its deny window: {:?}",
        da.get("f1")
    );
    assert_eq!(
        held.as_ref(),
        guard(db.get("f1")),
        "the replicas disagree on f1's window"
    );
    // Both sum it up per pool the same way: frozen only, until it closes.
    let (ga, gb) = (a.guardrails().await, b.guardrails().await);
    assert_eq!(ga, gb, "the replicas disagree on which pool is held");
    assert_eq!(
        ga.as_array().map(|g| g.len()),
        Some(1),
        "one pool held: {ga}"
    );
    assert_eq!(
        (&ga[0]["pool"], &ga[0]["reason"], &ga[0]["until"]),
        (
            &json!("frozen"),
            &json!("window"),
            &held.as_ref().unwrap()["until"]
        ),
    );
    for r in replicas {
        assert!(r.blocked("frozen", "window").await, "{}", r.api);
        assert!(!r.blocked("main", "alert_firing").await, "{}", r.api);
    }
    assert!(
        restarts(&sim, "f1").is_empty() && marker_of(&sim, "f1").is_none(),
        "f1 was claimed inside its deny window"
    );
    a.stop().await;
    b.stop().await;
    sim.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn two_replicas_at_once_stop_at_a_halt_until_resumed() {
    let w = world();
    // Both replicas sweep every 150ms on one token: Fly's List budget is
    // not the subject here.
    let sim = Sim::start(bad_fleet(&w).list_rate_limit(None))
        .await
        .unwrap();
    let cfg = |mirror: &str| config(&sim, &w, mirror, &all("restart"), 1, &halting(2));
    let a = Replica::start("replica-a", cfg("a"), &sim, None);
    let b = Replica::start("replica-b", cfg("b"), &sim, None);
    let replicas = [&a, &b];

    // Whichever replica saw the two failures raises the halt.
    eventually("the release halts", Duration::from_secs(60), async || {
        matches!(halt_record(&sim), Some(HaltRecord::Halted { .. }))
    })
    .await;
    let failed = restarted(&sim);
    assert_eq!(failed.len(), 2, "restarted before the halt: {failed:?}");
    let untouched: Vec<&str> = BAD
        .into_iter()
        .filter(|id| !failed.iter().any(|f| f == id))
        .collect();
    // Both decide the untouched machines `halted`, sum the pool up as
    // halted, and export it (no time: no until series).
    for r in replicas {
        eventually("both see the halt", Duration::from_secs(20), async || {
            let d = r.decisions().await;
            untouched
                .iter()
                .all(|id| d.get(*id).is_some_and(|d| d["kind"] == "halted"))
        })
        .await;
    }
    // Several sweeps of each while halted: chances to claim.
    let before = [a.sweeps().await, b.sweeps().await];
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = [a.sweeps().await, b.sweeps().await];
    assert!(
        after[0] >= before[0] + 5 && after[1] >= before[1] + 5,
        "the replicas did not sweep while halted: {before:?} → {after:?}"
    );
    assert_eq!(restarted(&sim), failed, "a halted release went on");
    for id in &untouched {
        let m = sim.machine(id).unwrap();
        assert!(
            marker_of(&sim, id).is_none() && !m.cordoned && m.loaded_ref == w.old,
            "{id} was touched while halted: {:?}, cordoned {}",
            marker_of(&sim, id),
            m.cordoned
        );
    }
    let (da, db) = (a.decisions().await, b.decisions().await);
    for id in &untouched {
        assert_eq!(da.get(*id), db.get(*id), "the replicas disagree on {id}");
    }
    let (ga, gb) = (a.guardrails().await, b.guardrails().await);
    assert_eq!(ga, gb, "the replicas disagree on which pool is held");
    assert_eq!(
        (&ga[0]["pool"], &ga[0]["reason"], ga[0].get("until")),
        (&json!("default"), &json!("halted"), None),
        "{ga}"
    );
    for r in replicas {
        assert!(
            r.blocked("default", "halted").await,
            "{} does not export default held by halted",
            r.api
        );
        assert!(
            !r.until_for("halted").await,
            "{}: a halt has no time",
            r.api
        );
    }

    // The agents are fixed and an operator resumes: both go on, and the
    // untouched machines rotate (the failed two keep their failed rotation
    // for an operator: not the halt's business).
    sim.set_release_tip(&w.tip);
    let op = crate::common::daemon::operator(&cfg("op"), TOKEN);
    op.resume(&AppName::from("app"), None, "op", sim.now())
        .await
        .unwrap();
    let start = tokio::time::Instant::now();
    loop {
        let done = untouched.iter().all(|id| {
            marker_of(&sim, id).is_none()
                && sim
                    .machine(id)
                    .is_some_and(|m| m.loaded_ref == w.tip && !m.cordoned)
        });
        if done {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the fleet did not rotate once resumed: {:?}",
            untouched
                .iter()
                .map(|id| sim.machine(id))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for r in replicas {
        eventually("the halt is lifted", Duration::from_secs(20), async || {
            !r.blocked("default", "halted").await
                && r.guardrails().await.as_array().is_none_or(|g| g.is_empty())
                && {
                    let d = r.decisions().await;
                    untouched
                        .iter()
                        .all(|id| d.get(*id).is_some_and(|d| d["kind"] == "on_tip"))
                }
        })
        .await;
    }
    a.stop().await;
    b.stop().await;
    sim.shutdown().await;
}

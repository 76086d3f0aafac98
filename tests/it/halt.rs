//! A release that halts itself (`[release] halt_after_failures`, #36 item
//! 1), against the simulated fleet: the real loop (sweep → plan → execute)
//! and the halt record on the coordinator, shared by replicas and restarts.
//! The claim gating itself is tested in `src/decide/halt_tests.rs`.

use std::time::Duration;

use fleet_reconciler::act::operator::Operator;
use fleet_reconciler::daemon::{self, Secrets};
use fleet_reconciler::decide::alerts::AlertKind;
use fleet_reconciler::metadata::halt::{HaltRecord, coordinator_halt_key};
use fleet_reconciler::model::AppName;
use fleet_reconciler::sim::{Sim, SimFleet, SimMachine};

use crate::common::eventually;
use crate::rotation::{
    COORD, Daemon, TOKEN, World, all, config, fleet, marker_of, more_sweeps, restarts, world,
};

/// Fast ceilings: one restart per rotation, verified within a second.
const FAST: &str = r#"
max_attempts = 1
verify_deadline = "1s"
restart_grace = "0s"
"#;

pub(crate) fn halting(n: u32) -> String {
    format!("{FAST}\n[release]\nhalt_after_failures = {n}\nhalt_window = \"30m\"\n")
}

/// Four drifted machines of one pool (cap 1) whose restarts never load
/// the tip: the sim boots them on the old commit, a release that is bad.
pub(crate) fn bad_fleet(w: &World) -> SimFleet {
    let machines = (0..4).map(|i| SimMachine::new(format!("m{i}")).loaded(w.old.clone()));
    fleet(w, machines.collect()).release_tip(w.old.clone())
}

async fn bad_release(w: &World) -> Sim {
    Sim::start(bad_fleet(w)).await.unwrap()
}

pub(crate) fn halt_record(sim: &Sim) -> Option<HaltRecord> {
    let body = sim.sealed_metadata(COORD, &coordinator_halt_key("app"))?;
    serde_json::from_str(&body).ok()
}

/// The machines of [`bad_fleet`] restarted so far.
pub(crate) fn restarted(sim: &Sim) -> Vec<String> {
    (0..4)
        .map(|i| format!("m{i}"))
        .filter(|id| !restarts(sim, id).is_empty())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_bad_release_halts_itself_for_replicas_and_restarts_until_resumed() {
    let w = world();
    let sim = bad_release(&w).await;
    let a = Daemon::start(
        &sim,
        config(&sim, &w, "a", &all("restart"), 1, &halting(2)),
        "replica-a",
    )
    .await;
    eventually("the release halts", Duration::from_secs(60), async || {
        a.alerted(AlertKind::ReleaseHalted, "")
    })
    .await;
    more_sweeps(&a, 6).await;
    // Two rotations failed; the other machines were never touched.
    assert_eq!(restarted(&sim).len(), 2, "restarted: {:?}", restarted(&sim));
    let Some(HaltRecord::Halted {
        tip, failures, by, ..
    }) = halt_record(&sim)
    else {
        panic!(
            "no sealed halt record on the coordinator: {:?}",
            halt_record(&sim)
        );
    };
    assert_eq!(tip.as_str(), w.tip);
    assert_eq!(by, "replica-a");
    let mut named: Vec<String> = failures.iter().map(|f| f.machine_id.to_string()).collect();
    named.sort();
    assert_eq!(
        named,
        restarted(&sim),
        "the evidence names the failed rotations"
    );
    // Their undo finished: uncordoned, no rotation holding a slot.
    for id in &named {
        assert!(!sim.machine(id).unwrap().cordoned, "{id} left cordoned");
        assert!(marker_of(&sim, id).is_none_or(|m| !m.phase.holds_slot()));
    }
    a.stop().await;

    // Another replica (or this one restarted), which would never halt by
    // itself: it reads the halt the first wrote, and starts nothing.
    let b = Daemon::start(
        &sim,
        config(&sim, &w, "b", &all("restart"), 1, FAST),
        "replica-b",
    )
    .await;
    more_sweeps(&b, 6).await;
    assert!(b.alerted(AlertKind::ReleaseHalted, ""));
    assert_eq!(restarted(&sim).len(), 2, "a halted release went on");

    // `resume` lifts it: claims start again.
    let cfg = config(&sim, &w, "op", &all("restart"), 1, FAST);
    let secrets = Secrets {
        fly_token: TOKEN.into(),
        git_token: None,
        record_keys: Some(fleet_reconciler::sim::record_keys()),
    };
    let operator = Operator::new(
        daemon::fly_client(&cfg, &secrets).unwrap(),
        &cfg,
        secrets.record_keys.clone(),
    );
    let app = AppName::from("app");
    let other = fleet_reconciler::model::CommitId::parse(&w.old).unwrap();
    assert!(
        operator
            .resume(&app, Some(&other), "op", sim.now())
            .await
            .is_err(),
        "--tip of another commit resumes nothing"
    );
    let resumed = operator.resume(&app, None, "op", sim.now()).await.unwrap();
    assert!(matches!(resumed.written, Some(HaltRecord::Resumed { .. })));
    eventually("claims resume", Duration::from_secs(60), async || {
        restarted(&sim).len() > 2
    })
    .await;
    b.stop().await;
    sim.shutdown().await;
}

/// An agent (which can write its app's metadata, and the coordinator may
/// sit in a swept app) cannot lift a halt by writing a record of its own:
/// an unsealed one halts (fail closed) and is alerted as tampered.
#[tokio::test(start_paused = true)]
async fn an_unsealed_halt_record_halts_and_is_alerted() {
    let w = world();
    let sim = bad_release(&w).await;
    sim.set_metadata(
        COORD,
        &coordinator_halt_key("app"),
        r#"{"state":"resumed","tip":"x","lifted":[],"by":"agent","at":"2026-01-01T00:00:00Z"}"#,
    );
    let d = Daemon::start(&sim, config(&sim, &w, "m", &all("restart"), 1, FAST), "r1").await;
    eventually("halted and alerted", Duration::from_secs(20), async || {
        d.alerted(AlertKind::ReleaseHalted, "") && d.alerted(AlertKind::MetadataTampered, COORD)
    })
    .await;
    more_sweeps(&d, 4).await;
    assert!(
        restarted(&sim).is_empty(),
        "an unverifiable halt record let claims through"
    );
    d.stop().await;
    sim.shutdown().await;
}

/// `fleet-reconciler resume APP` as an operator runs it (the real binary):
/// one JSON object saying what it lifted, the sealed `resumed` record on
/// the coordinator, and typed errors for another tip or nothing halted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resume_command_prints_what_it_lifted_as_json() {
    let w = world();
    let sim = Sim::start(fleet(&w, vec![SimMachine::new("m0").loaded(w.old.clone())]))
        .await
        .unwrap();
    let key = coordinator_halt_key("app");
    let halted = format!(
        r#"{{"state":"halted","tip":"{}","failures":[{{"machine_id":"m0","tag":"t0","outcome":"crash-looping","evidence":"crash loop: 3 exit events"}}],"by":"replica-a","at":"2026-12-01T16:00:00Z"}}"#,
        w.tip
    );
    assert!(sim.set_sealed_metadata(COORD, &key, &halted));
    let config = w
        .overlay
        .config(&sim.api_url(), "mirror.git")
        .with(&format!(
            "[[apps]]\nname = \"app\"\n[rotation]\ncoordinator = \"{}/{COORD}\"\n",
            crate::rotation::COORD_APP
        ))
        .write(w.overlay.dir.path().join("resume.toml"));
    let resume = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fleet-reconciler"))
            .arg("resume")
            .args(args)
            .args(["--by", "alice", "-o", "json", "--config"])
            .arg(&config)
            .stdin(std::process::Stdio::null())
            .env_remove("RUST_LOG")
            .env("FLEET_RECONCILER_FLY_TOKEN", TOKEN)
            .env(
                "FLEET_RECONCILER_RECORD_KEY",
                fleet_reconciler::sim::DEFAULT_RECORD_KEY,
            )
            .output()
            .unwrap();
        let json: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
        (out.status.code(), json)
    };
    let (code, v) = resume(&["app", "--tip", &w.old]);
    assert_eq!((code, &v["kind"]), (Some(2), &"other_tip".into()), "{v}");
    let (code, v) = resume(&["app"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["command"], "resume");
    assert_eq!(v["app"], "app");
    assert_eq!(v["resumed"], true);
    assert_eq!(v["halt"]["state"], "halted");
    assert_eq!(v["halt"]["failures"][0]["machine_id"], "m0");
    assert_eq!(v["record"]["state"], "resumed");
    assert_eq!(v["record"]["lifted"], serde_json::json!(["t0"]));
    assert_eq!(v["record"]["by"], "alice");
    // What is printed is what was written, sealed.
    let written: serde_json::Value =
        serde_json::from_str(&sim.sealed_metadata(COORD, &key).unwrap()).unwrap();
    assert_eq!(written, v["record"]);
    let (code, v) = resume(&["app"]);
    assert_eq!((code, &v["kind"]), (Some(2), &"not_halted".into()), "{v}");
    sim.shutdown().await;
}

/// The release branch moved on past a halted tip: the halt record of the
/// older tip stops nothing toward the newer one.
#[tokio::test(start_paused = true)]
async fn a_newer_tip_is_not_halted_by_an_older_tips_halt() {
    let w = world();
    let sim = Sim::start(fleet(&w, vec![SimMachine::new("m0").loaded(w.old.clone())]))
        .await
        .unwrap();
    let older = format!(
        r#"{{"state":"halted","tip":"{}","failures":[],"by":"replica-a","at":"2026-12-01T16:00:00Z"}}"#,
        w.old
    );
    assert!(sim.set_sealed_metadata(COORD, &coordinator_halt_key("app"), &older));
    let d = Daemon::start(
        &sim,
        config(&sim, &w, "m", &all("restart"), 1, &halting(2)),
        "r1",
    )
    .await;
    crate::rotation::converged(&sim, "m0", &w.tip, Duration::from_secs(30)).await;
    assert!(!d.alerted(AlertKind::ReleaseHalted, ""));
    d.stop().await;
    sim.shutdown().await;
}

//! Guardrails on new claims (#36 items 2 and 3) against the simulated
//! fleet: the real loop (sweep → plan → execute). A pool after a canary
//! starts only once the canary soaked on the tip; a maintenance window
//! holds claims until it closes. The judgement itself is tested in
//! `src/decide/guard_tests.rs` and `src/decide/guardrail_tests.rs` (window
//! edges, DST).

use std::time::Duration;

use chrono::{DurationRound, Timelike};
use fleet_reconciler::sim::{Sim, SimMachine};

use crate::rotation::{Daemon, all, config, converged, fleet, restarts, world};

fn in_pool(id: &str, pool: &str, old: &str) -> SimMachine {
    SimMachine::new(id)
        .loaded(old.to_string())
        .metadata("pool", pool)
}

#[tokio::test(start_paused = true)]
async fn the_pool_after_a_canary_starts_only_once_the_canary_soaked() {
    let w = world();
    let machines = vec![
        in_pool("c1", "canary", &w.old),
        in_pool("c2", "canary", &w.old),
        in_pool("m1", "main", &w.old),
        in_pool("m2", "main", &w.old),
    ];
    let sim = Sim::start(fleet(&w, machines)).await.unwrap();
    let restart = all("restart");
    let pools = format!(
        r#"restart_grace = "0s"
[pools.canary]
max_concurrent_rotations = 2
actions = {restart}
[pools.main]
max_concurrent_rotations = 2
actions = {restart}
after = "canary"
soak = "5s"
"#
    );
    let d = Daemon::start(&sim, config(&sim, &w, "a", &restart, 1, &pools), "a").await;
    for id in ["m1", "m2", "c1", "c2"] {
        converged(&sim, id, &w.tip, Duration::from_secs(60)).await;
    }
    d.stop().await;
    let last_canary = ["c1", "c2"]
        .iter()
        .flat_map(|id| restarts(&sim, id))
        .max()
        .expect("the canaries restarted");
    let first_main = ["m1", "m2"]
        .iter()
        .flat_map(|id| restarts(&sim, id))
        .min()
        .expect("main restarted");
    assert!(
        first_main >= last_canary + chrono::Duration::seconds(5),
        "main restarted at {first_main}, the last canary at {last_canary}: not soaked"
    );
}

#[tokio::test(start_paused = true)]
async fn a_deny_window_holds_claims_until_it_closes() {
    let w = world();
    let sim = Sim::start(fleet(&w, vec![in_pool("m1", "main", &w.old)]))
        .await
        .unwrap();
    // A deny window that opened at the start of this minute, for 2 minutes.
    let now = w.clock.now();
    let opened = now
        .duration_trunc(chrono::Duration::minutes(1))
        .expect("a minute");
    let closes = opened + chrono::Duration::minutes(2);
    let restart = all("restart");
    let pools = format!(
        r#"restart_grace = "0s"
[pools.main]
max_concurrent_rotations = 1
actions = {restart}
windows = [{{ deny = "{} {} * * *", duration = "2m" }}]
"#,
        opened.minute(),
        opened.hour()
    );
    let d = Daemon::start(&sim, config(&sim, &w, "a", &restart, 1, &pools), "a").await;
    converged(&sim, "m1", &w.tip, Duration::from_secs(300)).await;
    d.stop().await;
    let first = restarts(&sim, "m1")
        .into_iter()
        .min()
        .expect("m1 restarted");
    assert!(
        first >= closes,
        "m1 restarted at {first}, inside the deny window closing at {closes}"
    );
    assert!(
        first < closes + chrono::Duration::seconds(5),
        "m1 restarted at {first}, long after the window closed at {closes}"
    );
}

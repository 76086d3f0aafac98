//! The planner's claim gating by guardrails: a canary pool's soak
//! (`pools.NAME.after`) and maintenance windows (`pools.NAME.windows`).

use super::*;
use crate::decide::guardrail::Guard;

const POOLS: &str = r#"
[pools.canary]
max_concurrent_rotations = 5
actions = { low = "restart", medium = "restart", high = "restart", critical = "restart" }
[pools.main]
max_concurrent_rotations = 5
actions = { low = "restart", medium = "restart", high = "restart", critical = "restart" }
after = "canary"
soak = "30m"
"#;

/// The canary pool's machines (`on` of `n` on the tip) and one drifted
/// `main` machine, `d1`.
fn fleet(on: usize, n: usize) -> Vec<M> {
    let mut ms: Vec<M> = (0..n)
        .map(|i| {
            let id = format!("c{i}");
            let m = if i < on {
                M::on_tip(&id)
            } else {
                M::drifted(&id, Severity::Medium)
            };
            m.pool("canary", PolicyAction::Restart)
        })
        .collect();
    ms.push(M::drifted("d1", Severity::Medium).pool("main", PolicyAction::Restart));
    ms
}

/// Plans sweeps of the same tracker, one per `(fleet, at)`, the drift of
/// every machine first seen an hour before the first; the last plan.
fn sweeps(extra: &str, fleets: Vec<(Vec<M>, DateTime<Utc>)>) -> Plan {
    sweeps_with(Tracker::default(), extra, fleets)
}

fn sweeps_with(mut tracker: Tracker, extra: &str, fleets: Vec<(Vec<M>, DateTime<Utc>)>) -> Plan {
    let config = config(&format!("{POOLS}{extra}"));
    let policy = Policy::from_config(&config);
    let mut last = None;
    for (i, (ms, at)) in fleets.into_iter().enumerate() {
        let report = snapshot(&config, ms);
        if i == 0 {
            tracker.observe(&report, at - Cd::hours(1));
        }
        tracker.observe(&report, at);
        tracker.observe_canaries(&policy, &report, at);
        last = Some(plan(&PlanInput {
            policy: &policy,
            snapshot: &report,
            tracker: &tracker,
            owner: "r1",
            fetch: fetched(),
            now: at,
        }));
    }
    last.expect("one sweep at least")
}

fn guard_of(p: &Plan, id: &str) -> Option<Guard> {
    match p.decision(&mid(id)) {
        Some(Decision::Guarded { guard }) => Some(guard.clone()),
        _ => None,
    }
}

#[test]
fn a_pool_after_a_canary_claims_only_once_the_canary_soaked_on_the_tip() {
    // The canary is 1/2 on the tip: main waits, the canary rotates.
    let p = sweeps("", vec![(fleet(1, 2), t0())]);
    assert!(kinds(&p).contains(&("c1", "claim")), "{:?}", kinds(&p));
    assert!(!kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    assert_eq!(
        guard_of(&p, "d1"),
        Some(Guard::Canary {
            pool: "canary".into(),
            on_tip: 1,
            started: 2,
            needed: 2,
            soaked_secs: Some(0),
            soak_secs: 1800,
            until: None,
            halted: false,
        })
    );
    let key = (AppName::from("app"), PoolName::from("main"));
    assert_eq!(p.guards.get(&key).map(Guard::reason), Some("canary"));

    // 2/2 from t0+1m: the soak runs on this clock from that first sight.
    let t1 = t0() + Cd::minutes(1);
    let at = |m: i64| t1 + Cd::minutes(m);
    let p = sweeps(
        "",
        vec![
            (fleet(1, 2), t0()),
            (fleet(2, 2), t1),
            (fleet(2, 2), at(12)),
        ],
    );
    let Some(g) = guard_of(&p, "d1") else {
        panic!("d1 waits: {:?}", p.decision(&mid("d1")));
    };
    assert_eq!(g.until(), Some(at(30)));
    assert_eq!(
        Decision::Guarded { guard: g.clone() }.to_string(),
        format!(
            "waiting for canary pool canary: 2/2 on tip, soak 12m of 30m; no new claim until {} if the ratio holds",
            at(30).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        )
    );
    // A second short of the soak: still waiting.
    let p = sweeps(
        "",
        vec![
            (fleet(1, 2), t0()),
            (fleet(2, 2), t1),
            (fleet(2, 2), at(30) - Cd::seconds(1)),
        ],
    );
    assert!(guard_of(&p, "d1").is_some());
    // Soaked: main claims.
    let p = sweeps(
        "",
        vec![
            (fleet(1, 2), t0()),
            (fleet(2, 2), t1),
            (fleet(2, 2), at(30)),
        ],
    );
    assert!(kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    assert!(p.guards.is_empty());

    // A canary that falls back below the ratio starts its soak over.
    let p = sweeps(
        "",
        vec![
            (fleet(2, 2), t0()),
            (fleet(1, 2), at(10)),
            (fleet(2, 2), at(20)),
            (fleet(2, 2), at(40)),
        ],
    );
    assert_eq!(guard_of(&p, "d1").and_then(|g| g.until()), Some(at(50)));
}

/// A one-shot `plan` never saw the soak begin: it does not claim one of
/// 0s (nor an end 30m away), it says the running daemon times it; a ratio
/// not met says how many must be verified first.
#[test]
fn a_one_shot_plan_says_the_daemon_times_the_soak() {
    let p = sweeps_with(Tracker::for_one_plan(), "", vec![(fleet(2, 2), t0())]);
    let Some(g) = guard_of(&p, "d1") else {
        panic!("d1 waits: {:?}", p.decision(&mid("d1")));
    };
    assert_eq!(g.until(), None);
    assert_eq!(
        Decision::Guarded { guard: g }.to_string(),
        "waiting for canary pool canary: 2/2 on tip, soak of 30m timed by the running daemon; no new claim until the running daemon's soak ends (`status` shows when)"
    );
    let p = sweeps_with(Tracker::for_one_plan(), "", vec![(fleet(1, 2), t0())]);
    assert_eq!(
        p.decision(&mid("d1")).map(ToString::to_string).as_deref(),
        Some(
            "waiting for canary pool canary: 1/2 on tip, soak 0s of 30m; no new claim until 2/2 are verified on tip, then for a soak of 30m"
        )
    );
}

#[test]
fn after_ratio_counts_a_share_of_started_canaries_and_none_started_holds() {
    let half = "after_ratio = 0.5\n";
    // `after_ratio` belongs to [pools.main]: append it there.
    let p = sweeps(
        half,
        vec![(fleet(1, 2), t0()), (fleet(1, 2), t0() + Cd::minutes(30))],
    );
    assert!(kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    let p = sweeps(
        half,
        vec![(fleet(1, 3), t0()), (fleet(1, 3), t0() + Cd::minutes(30))],
    );
    assert!(guard_of(&p, "d1").is_some(), "1/3 < 0.5");
    // No started canary at all: nothing proves the tip, main waits.
    let p = sweeps("", vec![(fleet(0, 0), t0())]);
    assert!(matches!(
        guard_of(&p, "d1"),
        Some(Guard::Canary { started: 0, .. })
    ));
}

#[test]
fn an_unfinished_claim_of_a_guarded_pool_is_withdrawn_and_rotations_go_on() {
    let claiming = marker("d1", Phase::Claiming, RotationMode::Grace, t0());
    let draining = marker("d2", Phase::Draining, RotationMode::Grace, t0());
    let mut ms = fleet(0, 1);
    ms.pop();
    ms.push(
        M::drifted("d1", Severity::Medium)
            .pool("main", PolicyAction::Restart)
            .marker(&claiming),
    );
    ms.push(
        M::drifted("d2", Severity::Medium)
            .pool("main", PolicyAction::Restart)
            .marker(&draining),
    );
    let p = sweeps("", vec![(ms, t0())]);
    assert!(kinds(&p).contains(&("d1", "withdraw")), "{:?}", kinds(&p));
    assert!(guard_of(&p, "d1").is_some());
    assert!(guard_of(&p, "d2").is_none(), "{:?}", p.decision(&mid("d2")));
}

/// `main` with no canary and a window; `d1` drifted in it.
fn windowed(window: &str, d1: M) -> Plan {
    let config = config(&format!(
        "[pools.main]\nmax_concurrent_rotations = 5\nactions = {{ medium = \"restart\" }}\nwindows = [{window}]\n"
    ));
    let policy = Policy::from_config(&config);
    let mut tracker = Tracker::default();
    let report = snapshot(&config, vec![d1]);
    // t0 is Friday 2027-01-15 08:00 UTC.
    tracker.observe(&report, t0() - Cd::hours(1));
    tracker.observe(&report, t0());
    plan(&PlanInput {
        policy: &policy,
        snapshot: &report,
        tracker: &tracker,
        owner: "r1",
        fetch: fetched(),
        now: t0(),
    })
}

fn d1() -> M {
    M::drifted("d1", Severity::Medium).pool("main", PolicyAction::Restart)
}

#[test]
fn a_window_holds_new_claims_and_approve_now_overrides_it() {
    // Opens at 08:00 UTC: claims on its first second.
    let p = windowed(r#"{ allow = "0 8 * * *", duration = "1h" }"#, d1());
    assert!(kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    // Closed at 08:00 (07:00 + 1h): held until tomorrow 07:00.
    let p = windowed(r#"{ allow = "0 7 * * *", duration = "1h" }"#, d1());
    assert_eq!(
        guard_of(&p, "d1"),
        Some(Guard::Window {
            deny: false,
            until: Some(t0() + Cd::hours(23)),
            time_zone: "UTC".into()
        })
    );
    // A deny window open now holds it.
    let p = windowed(r#"{ deny = "0 8 * * Fri", duration = "1h" }"#, d1());
    assert!(matches!(
        guard_of(&p, "d1"),
        Some(Guard::Window { deny: true, .. })
    ));
    // `approve --now` of the tip overrides the window, and says so in its
    // decision no more than any claim: it claims.
    let p = windowed(
        r#"{ deny = "0 8 * * Fri", duration = "1h" }"#,
        d1().approved(TIP, ApprovalMode::Now),
    );
    assert!(kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    // `--when-idle` does not.
    let p = windowed(
        r#"{ deny = "0 8 * * Fri", duration = "1h" }"#,
        d1().approved(TIP, ApprovalMode::WhenIdle),
    );
    assert!(guard_of(&p, "d1").is_some());
}

#[test]
fn pools_waiting_for_one_canary_at_two_ratios_soak_from_their_own_first_sight() {
    // `half` waits for half the canary, `main` for all of it.
    let half = "[pools.half]\nactions = { medium = \"restart\" }\nafter = \"canary\"\nsoak = \"30m\"\nafter_ratio = 0.5\n";
    let with_half = |on: usize| {
        let mut ms = fleet(on, 2);
        ms.push(M::drifted("h1", Severity::Medium).pool("half", PolicyAction::Restart));
        ms
    };
    let at = |m: i64| t0() + Cd::minutes(m);
    let p = sweeps(
        half,
        vec![
            (with_half(1), at(0)),
            (with_half(2), at(20)),
            (with_half(2), at(31)),
        ],
    );
    // Half the canary since t0: `half` soaked at 30m.
    assert!(kinds(&p).contains(&("h1", "claim")), "{:?}", kinds(&p));
    // All of it only since 20m: `main` waits until 50m.
    assert_eq!(guard_of(&p, "d1").and_then(|g| g.until()), Some(at(50)));
}

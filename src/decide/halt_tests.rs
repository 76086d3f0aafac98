//! The planner's claim gating by a halted release (`[release]`).

use super::*;
use crate::metadata::controls::Found;
use crate::metadata::halt::{HaltFailure, HaltOutcome, HaltRecord, HaltView};
use crate::metadata::marker::Failure;

fn halting(n: u32) -> Policy {
    let mut p = policy();
    p.release.halt_after_failures = n;
    p
}

/// A machine whose rotation toward the tip ended failed (as `end_attempt`
/// leaves it: `yielded`, the failure kept).
fn failed(id: &str, evidence: &str) -> M {
    let mut mk = marker(id, Phase::Yielded, RotationMode::Grace, t0());
    mk.failed = Some(Failure {
        at: t0(),
        attempts: 1,
        evidence: evidence.into(),
        approval: None,
    });
    M::drifted(id, Severity::Medium).marker(&mk)
}

/// `d1` would claim (restart pool, aged drift). The tracker's first sweep
/// sees `before`, the second (`at`) sees `after`; planned at `now`.
fn planned(
    policy: &Policy,
    before: Vec<M>,
    after: Vec<M>,
    at: DateTime<Utc>,
    now: DateTime<Utc>,
    halt: Option<HaltView>,
) -> Plan {
    let config = config("");
    let mut tracker = Tracker::default();
    tracker.observe(&snapshot(&config, before), t0() - Cd::hours(1));
    let mut report = snapshot(&config, after);
    if let Some(view) = halt {
        report.halts.insert(AppName::from("app"), view);
    }
    tracker.observe(&report, at);
    plan(&PlanInput {
        policy,
        snapshot: &report,
        tracker: &tracker,
        owner: "r1",
        fetch: fetched(),
        now,
    })
}

fn d1() -> M {
    M::drifted("d1", Severity::Medium)
}

fn halted_alerts(plan: &Plan) -> Vec<&Alert> {
    plan.alerts
        .iter()
        .filter(|a| a.kind == AlertKind::ReleaseHalted)
        .collect()
}

#[test]
fn n_failures_within_the_window_halt_the_tip_and_stop_new_claims() {
    let after = || {
        vec![
            d1(),
            failed("f1", "crash loop: 3 exit events since the restart"),
            failed("f2", "still on 2222"),
        ]
    };
    // One failure short: d1 claims.
    let p = planned(&halting(3), vec![d1()], after(), t0(), t0(), None);
    assert!(kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    assert!(halted_alerts(&p).is_empty());

    let p = planned(&halting(2), vec![d1()], after(), t0(), t0(), None);
    assert!(!kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    assert_eq!(
        p.decision(&mid("d1")),
        Some(&Decision::Halted {
            app: Some("app".into()),
            tip: commit(TIP),
            failures: 2,
            verified: true
        })
    );
    let [alert] = halted_alerts(&p)[..] else {
        panic!("one release_halted alert: {:?}", p.alerts);
    };
    assert_eq!(alert.app, Some(AppName::from("app")));
    assert_eq!(alert.commit, Some(commit(TIP)));
    assert_eq!(alert.machine_id, None);
    assert_eq!(alert.details["failures"], "f1 crash-looping, f2 failed");
    // Detected here: the executor is to record it on the coordinator.
    let halted = &p.halts[&AppName::from("app")];
    let Some(HaltRecord::Halted { tip, failures, .. }) = halted.record("r1", t0()) else {
        panic!("a record to write: {halted:?}");
    };
    assert_eq!(tip, commit(TIP));
    assert_eq!(failures.len(), 2);
}

#[test]
fn failures_before_this_run_or_outside_the_window_do_not_halt() {
    let failures = || vec![failed("f1", "x"), failed("f2", "y")];
    let mut all = failures();
    all.push(d1());
    // Already failed at this run's first sweep: when they ended is unknown.
    let p = planned(&halting(2), all.clone(), all.clone(), t0(), t0(), None);
    assert!(kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    // First seen 31 minutes ago, the window is 30: they no longer count.
    let p = planned(
        &halting(2),
        vec![d1()],
        all,
        t0(),
        t0() + Cd::minutes(31),
        None,
    );
    assert!(kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
}

fn record(tip: &str, tags: &[&str]) -> HaltRecord {
    HaltRecord::Halted {
        tip: commit(tip),
        failures: tags
            .iter()
            .map(|t| HaltFailure {
                machine_id: mid(t),
                tag: (*t).into(),
                outcome: HaltOutcome::Failed,
                evidence: "e".into(),
            })
            .collect(),
        by: "r2".into(),
        at: t0(),
        lifted: Vec::new(),
    }
}

#[test]
fn the_coordinators_record_halts_its_tip_only_and_an_unverified_one_halts_all() {
    // Another replica's record halts claims here, whatever this run saw
    // (and `halt_after_failures` is off on this one).
    let recorded = HaltView::Record(record(TIP, &["x1", "x2"]));
    let p = planned(
        &halting(0),
        vec![d1()],
        vec![d1()],
        t0(),
        t0(),
        Some(recorded),
    );
    assert!(!kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    assert_eq!(halted_alerts(&p).len(), 1);
    assert!(
        p.halts[&AppName::from("app")].record("r1", t0()).is_none(),
        "already recorded"
    );
    // A record of an older tip: the newer tip is not halted.
    let older = HaltView::Record(record(OLD, &["x1", "x2"]));
    let p = planned(&halting(0), vec![d1()], vec![d1()], t0(), t0(), Some(older));
    assert!(kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    // Not one we sealed: halted (fail closed), and alerted as tampered.
    let forged = HaltView::Unverified(Found::Unsigned);
    let p = planned(
        &halting(0),
        vec![d1()],
        vec![d1()],
        t0(),
        t0(),
        Some(forged),
    );
    assert!(!kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    assert!(matches!(
        p.decision(&mid("d1")),
        Some(Decision::Halted {
            verified: false,
            ..
        })
    ));
    assert_eq!(halted_alerts(&p).len(), 1);
    assert!(
        p.alerts
            .iter()
            .any(|a| a.kind == AlertKind::MetadataTampered)
    );
}

#[test]
fn a_resume_lifts_the_failures_it_names_and_new_ones_count_again() {
    let all = || vec![d1(), failed("f1", "x"), failed("f2", "y")];
    let tag = |id| marker(id, Phase::Yielded, RotationMode::Grace, t0()).tag;
    let resumed = |lifted: Vec<String>| {
        Some(HaltView::Record(HaltRecord::Resumed {
            tip: commit(TIP),
            lifted,
            by: "op".into(),
            at: t0(),
        }))
    };
    let p = planned(
        &halting(2),
        vec![d1()],
        all(),
        t0(),
        t0(),
        resumed(vec![tag("f1"), tag("f2")]),
    );
    assert!(kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    // Only f1 lifted: f2 and a new failure halt again.
    let mut more = all();
    more.push(failed("f3", "z"));
    let p = planned(
        &halting(2),
        vec![d1()],
        more,
        t0(),
        t0(),
        resumed(vec![tag("f1")]),
    );
    assert!(!kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    // The new halt's record keeps f1 lifted, and resuming it lifts all
    // three: none of them counts again.
    let record = p.halts[&AppName::from("app")]
        .record("r1", t0())
        .expect("a record to write");
    assert_eq!(record.lifted(&commit(TIP)), [tag("f1")]);
    let mut lifted = record.to_lift();
    lifted.sort();
    let mut all3 = vec![tag("f1"), tag("f2"), tag("f3")];
    all3.sort();
    assert_eq!(lifted, all3);
}

#[test]
fn rotations_under_way_go_on_while_halted() {
    let restarting = marker("r1", Phase::Restarting, RotationMode::Grace, t0());
    let busy = M::drifted("r1", Severity::Medium).marker(&restarting);
    let halt = Some(HaltView::Record(record(TIP, &["x1"])));
    let p = planned(
        &halting(0),
        vec![busy.clone(), d1()],
        vec![busy, d1()],
        t0(),
        t0() + Cd::hours(2),
        halt,
    );
    assert!(!kinds(&p).contains(&("d1", "claim")), "{:?}", kinds(&p));
    assert!(
        kinds(&p).iter().any(|(id, _)| *id == "r1"),
        "the rotation under way goes on: {:?}",
        kinds(&p)
    );
}

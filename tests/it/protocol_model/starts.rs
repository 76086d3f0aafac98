//! Worlds that start mid-protocol, so the part a Part 1 fix guards lies
//! within the bounded depth: each builds its markers, approvals and slots
//! with the real types (`Marker`, `Approval`, `ApprovalId`, `SlotSet`) and
//! records the restarts the past it stands for already made (the
//! invariants count across that past).

use fleet_reconciler::metadata::marker::{Ending, Failure, Marker, Phase, RotationMode};
use fleet_reconciler::metadata::operator::{Approval, ApprovalId, ApprovalMode};
use fleet_reconciler::metadata::slots::{Slot, SlotSet};
use fleet_reconciler::metadata::{APPROVE_KEY, MARKER_KEY};
use fleet_reconciler::model::PolicyAction;

use super::sweep::commit;
use super::world::{APP, POOL, World, at, machine_id, severity};

/// The tag of the rotation the start stands in.
const TAG: &str = "m0-past";

/// A marker of m0's past rotation toward the tip, claimed by replica 0.
fn past(w: &World, phase: Phase, mode: RotationMode, action: PolicyAction) -> Marker {
    Marker {
        tag: TAG.into(),
        target: commit(w.tip),
        phase,
        mode,
        action,
        severity: severity(w.tip),
        started_at: at(-600),
        attempt_started_at: at(-120),
        attempt: 1,
        owner: "r0".into(),
        restart_at: Some(at(-300)),
        retry_at: None,
        drain_requested: false,
        cordoned: Some(false),
        ending: None,
        instance_id: Some("i1".into()),
        pool: Some(POOL.into()),
        failed: None,
        approval: None,
    }
}

/// Operator `op0`'s approval of the tip, written at true time `written`
/// on the operator's own clock; its metadata value.
fn approve(w: &mut World, mode: ApprovalMode, written: i64) -> Option<String> {
    let value = serde_json::to_string(&Approval {
        target: commit(w.tip),
        mode,
        by: "op0".into(),
        at: at(written),
    })
    .ok()?;
    w.machines[0]
        .metadata
        .insert(APPROVE_KEY.into(), value.clone());
    w.approvals = 1;
    Some(value)
}

/// #32 item 6: one restart of the tip did not verify, its retry yielded
/// (the agent was busy past the drain ceiling). The next claim carries
/// the count on: one restart left of `max_attempts = 2`.
pub fn yielded_after_one_restart(w: &mut World) {
    let mut y = past(
        w,
        Phase::Yielded,
        RotationMode::Grace,
        PolicyAction::Restart,
    );
    y.retry_at = Some(at(-60));
    w.machines[0]
        .metadata
        .insert(MARKER_KEY.into(), y.to_value());
    w.record.restarts.insert((0, w.tip), 1);
}

/// #32 item 2: a manual rotation restarted under `op0`'s when-idle
/// approval, did not verify, and its retry drains a busy agent, cordoned,
/// its slot held: at the drain ceiling it yields, and that ending must
/// consume the approval it restarted with.
pub fn retry_draining_under_an_approval(w: &mut World) {
    let Some(value) = approve(w, ApprovalMode::WhenIdle, -700) else {
        return;
    };
    let mut d = past(w, Phase::Draining, RotationMode::Wait, PolicyAction::Manual);
    d.retry_at = Some(at(-120));
    d.cordoned = Some(true);
    d.approval = Some(ApprovalId::of(&value));
    let m = &mut w.machines[0];
    m.metadata.insert(MARKER_KEY.into(), d.to_value());
    m.cordoned = true;
    m.cordoned_at = Some(-120);
    if let Ok(mut set) = SlotSet::parse(None) {
        let slot = Slot {
            machine_id: machine_id(0),
            tag: TAG.into(),
            owner: "r0".into(),
            since: at(-600),
        };
        set.try_add(&APP.into(), &POOL.into(), slot, 1);
        w.slots = set.to_value();
    }
    w.record
        .approval_rotations
        .insert("op0".into(), [TAG.to_string()].into());
    w.record.restarts.insert((0, w.tip), 1);
}

/// #32 item 5: a manual rotation restarted twice under `op0`'s approval
/// and failed; the approval stands again (an outside update from a
/// snapshot that held it). It was written on the operator's clock,
/// 2 minutes ahead of the replica's that recorded the failure: only its
/// fingerprint tells it is the one that stood, never the two times.
pub fn failed_with_its_approval_standing(w: &mut World) {
    let Some(value) = approve(w, ApprovalMode::Now, 60) else {
        return;
    };
    let mut y = past(w, Phase::Yielded, RotationMode::Now, PolicyAction::Manual);
    y.attempt = 2;
    y.approval = Some(ApprovalId::of(&value));
    y.failed = Some(Failure {
        at: at(0),
        attempts: 2,
        evidence: "the agent came back on the old commit".into(),
        approval: Some(ApprovalId::of(&value)),
    });
    w.machines[0]
        .metadata
        .insert(MARKER_KEY.into(), y.to_value());
    w.record
        .approval_rotations
        .insert("op0".into(), [TAG.to_string()].into());
    w.record.restarts.insert((0, w.tip), 2);
}

/// #32 item 9: two rotations claimed under cap 2, both draining busy
/// agents, cordoned, their slots held; the replica's pool now has cap 1
/// (its configuration was lowered and it restarted).
pub fn two_draining_under_a_lowered_cap(w: &mut World) {
    let Ok(mut set) = SlotSet::parse(None) else {
        return;
    };
    for i in 0..2 {
        let tag = format!("m{i}-past");
        let mut d = past(
            w,
            Phase::Draining,
            RotationMode::Grace,
            PolicyAction::Restart,
        );
        d.tag = tag.clone();
        d.attempt = 0;
        d.restart_at = None;
        d.attempt_started_at = at(-5);
        d.started_at = at(-5 - i as i64);
        d.cordoned = Some(true);
        let m = &mut w.machines[i];
        m.metadata.insert(MARKER_KEY.into(), d.to_value());
        m.cordoned = true;
        m.cordoned_at = Some(-5);
        let slot = Slot {
            machine_id: machine_id(i),
            tag,
            owner: "r0".into(),
            since: at(-5),
        };
        set.try_add(&APP.into(), &POOL.into(), slot, 2);
    }
    w.slots = set.to_value();
    // The excess was live when the cap was lowered: it yields, and no
    // new claim may use it.
    w.record.allowance = 2;
}

/// #32 item 7: replica 0's own `claiming` marker on m0 (the step that
/// wrote it ended before its slot), and a deploy snapshot taken since (an outside update writes that marker
/// back): an update landing between the check and the cordon leaves the
/// cordon on a new instance under a `claiming` marker, and the agent on
/// the tip, if the immediate undo is refused.
pub fn claiming_with_a_deploy_snapshot(w: &mut World) {
    let mut c = past(
        w,
        Phase::Claiming,
        RotationMode::Grace,
        PolicyAction::Restart,
    );
    c.attempt = 0;
    c.restart_at = None;
    c.started_at = at(0);
    c.attempt_started_at = at(0);
    let m = &mut w.machines[0];
    m.metadata.insert(MARKER_KEY.into(), c.to_value());
    m.older = m.metadata.clone();
}

/// #32 item 4: a cancelled rotation whose agent advertised `drain` and was
/// fenced; its undo began (`releasing`, uncordon and undrain owed), its
/// slot held, and its agent answers no probe and no undrain since.
pub fn releasing_with_an_unreachable_agent(w: &mut World) {
    let mut r = past(
        w,
        Phase::Releasing,
        RotationMode::Grace,
        PolicyAction::Restart,
    );
    r.attempt = 0;
    r.restart_at = None;
    r.drain_requested = true;
    r.cordoned = Some(true);
    r.ending = Some(Ending::Cancelled);
    r.attempt_started_at = at(0);
    let m = &mut w.machines[0];
    m.metadata.insert(MARKER_KEY.into(), r.to_value());
    m.cordoned = true;
    m.cordoned_at = Some(-600);
    m.fenced = Some(TAG.into());
    m.agent_ok = false;
    if let Ok(mut set) = SlotSet::parse(None) {
        let slot = Slot {
            machine_id: machine_id(0),
            tag: TAG.into(),
            owner: "r0".into(),
            since: at(-600),
        };
        set.try_add(&APP.into(), &POOL.into(), slot, 1);
        w.slots = set.to_value();
    }
}

/// #32 item 3: the replica swept once and saw m0 drifted (the steps of
/// that plan did not run: say its pool was at its cap then), and is cut
/// off from the private network since: every probe it makes fails, while
/// the agent answers and Fly (which defines no health checks here) says
/// nothing against it.
pub fn cut_off_after_seeing_the_drift(w: &mut World) {
    super::sweep::sweep_and_plan(w, 0, false);
    if let Some(r) = w.replicas.first_mut() {
        r.queue.clear();
        r.cut_off = true;
    }
}

/// #32 item 3, executor part: as `cut_off_after_seeing_the_drift`, and
/// m0's config defines a Fly health check, failing now (it may flap).
pub fn cut_off_with_a_failing_check(w: &mut World) {
    w.machines[0].check_failing = Some(true);
    cut_off_after_seeing_the_drift(w);
}

/// #32 item 8, the probe-failure ceiling: both replicas swept once and saw
/// m0 drifted (their steps did not run: say the pool was at its cap then);
/// since, its agent answers nobody (busy all the same) and its Fly check
/// fails. Whichever replica sweeps first writes the shared record, stamped
/// on its own clock.
pub fn unprobeable_after_both_saw_the_drift(w: &mut World) {
    for r in 0..w.replicas.len() {
        super::sweep::sweep_and_plan(w, r, false);
        w.replicas[r].queue.clear();
    }
    let m = &mut w.machines[0];
    m.agent_ok = false;
    m.check_failing = Some(true);
}

/// #32 item 11: m0's rotation drains an idle agent, cordoned, its slot
/// held: the next sweep plans its restart (no live work), whose probe
/// takes a call of its own.
pub fn draining_an_idle_agent(w: &mut World) {
    let mut d = past(
        w,
        Phase::Draining,
        RotationMode::Grace,
        PolicyAction::Restart,
    );
    d.attempt = 0;
    d.restart_at = None;
    d.attempt_started_at = at(-60);
    d.cordoned = Some(true);
    let m = &mut w.machines[0];
    m.metadata.insert(MARKER_KEY.into(), d.to_value());
    m.cordoned = true;
    m.cordoned_at = Some(-60);
    if let Ok(mut set) = SlotSet::parse(None) {
        let slot = Slot {
            machine_id: machine_id(0),
            tag: TAG.into(),
            owner: "r0".into(),
            since: at(-60),
        };
        set.try_add(&APP.into(), &POOL.into(), slot, 1);
        w.slots = set.to_value();
    }
}

/// #32 item 13b: as `draining_an_idle_agent`, and m0's config defines a
/// Fly health check, passing (last run a minute ago).
pub fn draining_an_idle_agent_with_a_check(w: &mut World) {
    draining_an_idle_agent(w);
    let m = &mut w.machines[0];
    m.check_failing = Some(false);
    m.checks_at = -60;
}

/// #32 item 13a: as `draining_an_idle_agent`, but the retry after one
/// restart of the tip that did not verify: one restart left of
/// `max_attempts = 2`.
pub fn retry_draining_an_idle_agent(w: &mut World) {
    draining_an_idle_agent(w);
    let m = &mut w.machines[0];
    if let Some(mut d) = m.metadata.get(MARKER_KEY).and_then(|v| Marker::parse(v)) {
        d.attempt = 1;
        m.metadata.insert(MARKER_KEY.into(), d.to_value());
    }
    w.record.restarts.insert((0, w.tip), 1);
}

/// #32 item 13e: as `draining_an_idle_agent`, and m0's config sets a stop
/// timeout (`kill_timeout`) of 60 s, twice the verify deadline: its agent
/// takes all of it to stop.
pub fn draining_an_idle_agent_with_a_stop_timeout(w: &mut World) {
    draining_an_idle_agent(w);
    w.machines[0].stop_timeout = 60;
}

/// #32 item 13h: m1 is a `fly console` machine flyctl made from m0's
/// config (so it carries the pool label) with its own process group; it
/// runs the old commit and is idle.
pub fn a_console_beside_the_app(w: &mut World) {
    let m = &mut w.machines[1];
    m.one_off = true;
    for (k, v) in [
        ("fly_platform_version", "v2"),
        ("fly_process_group", "fly_app_console"),
    ] {
        m.metadata.insert(k.into(), v.into());
    }
    m.older = m.metadata.clone();
}

/// #32 item 13j: an operator's `fly deploy` holds m0's lease (a holder
/// that is no replica), and keeps it within the bound.
pub fn a_foreign_lease(w: &mut World) {
    w.machines[0].lease = Some(9);
}

//! Guardrails on new claims: why a pool may not start a rotation toward the
//! release tip now ([`Guard`]), beside a halted release ([`crate::decide::halt`]).
//!
//! Owns the judgement of each guardrail and its words: a canary pool not yet
//! soaked on the tip (`pools.NAME.after`, `soak`, `after_ratio`), and the
//! maintenance windows (`pools.NAME.windows`, Argo CD's semantics: an open
//! deny window blocks; with allow windows configured, claims only while one
//! is open). The planner decides a machine so held
//! [`crate::decide::decision::Decision::Guarded`]; a rotation already under
//! way is never stopped by a guardrail (its undo, and a restart already
//! sent, go on). The soak is timed by this replica's first sight of the
//! canary ratio being met ([`CanaryMemory`]), never by a time another clock
//! wrote; a one-shot `plan` ([`CanaryMemory::untimed`]) times no soak and
//! says the running daemon does. Every guard says until when
//! ([`Guard::lifts`]): a time where one exists ([`Guard::until`]), else
//! what lifts it. The alert gate (`[gates.alertmanager]`, item 4): a matching alert
//! that fires holds new claims, and an Alertmanager that cannot be read holds
//! them too (fail closed) and pages, unless `fail_open`. Its scope: an alert
//! whose `fly_app` (else `app`) label names a configured app holds that app
//! only; any other matching alert holds the whole fleet. It must never do I/O
//! nor read the clock: `now` is an argument, and the gate is read by
//! `observe::gate` and passed in the snapshot.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};

use crate::config::{MaintenanceWindow, WindowKind};
use crate::decide::policy::Policy;
use crate::decide::snapshot::Snapshot;
// From `alerts::kinds`, not `alerts`: `decide::alerts` reads the `Plan`.
use crate::decide::alerts::kinds::{Alert, AlertKind};
use crate::metadata::marker::Phase;
use crate::model::{AppName, CommitId, MachineStatus, PoolName, Severity};
use crate::observe::gate::GateView;

/// Why a pool may not claim toward the tip now.
#[derive(
    Clone,
    Debug,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantNames,
    schemars::JsonSchema,
)]
#[serde(tag = "reason", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Guard {
    /// The pool waits for its canary pool `pool` (`after`): `on_tip` of its
    /// `started` machines are on the tip, of `needed` (`after_ratio`); the
    /// ratio has held for `soaked_secs` of `soak_secs` (0 while it is not
    /// met; absent where this process does not time the soak: a one-shot
    /// `plan` has no memory of it, the running daemon times it). `until`:
    /// when the soak ends if the ratio keeps holding (unknown while it is
    /// not met, and in a one-shot `plan`). `halted`: the tip is halted for
    /// an app of the canary pool.
    Canary {
        pool: PoolName,
        on_tip: usize,
        started: usize,
        #[serde(default)]
        needed: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        soaked_secs: Option<u64>,
        soak_secs: u64,
        until: Option<DateTime<Utc>>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        halted: bool,
    },
    /// A maintenance window holds the pool: `deny`, an open deny window
    /// (closing at `until`); else outside every allow window (the next
    /// opening at `until`). `time_zone`: the window's zone, for the text.
    Window {
        deny: bool,
        until: Option<DateTime<Utc>>,
        time_zone: String,
    },
    /// An Alertmanager alert matching `gates.alertmanager.matchers` fires:
    /// `alert` names it (`AgentErrorRate{app="x"}`).
    AlertFiring { alert: String },
    /// Alertmanager could not be read (`error`, without its URL): claims
    /// are held (fail closed) until it can.
    GateUnreachable { error: String },
}

impl Guard {
    /// Every reason, in declaration order (the metric's label values).
    pub const REASONS: &'static [&'static str] = <Self as strum::VariantNames>::VARIANTS;

    /// The reason as a stable snake_case word: the JSON `reason` and the
    /// metric's `reason` label.
    pub fn reason(&self) -> &'static str {
        self.into()
    }

    /// When the guardrail lifts, where known.
    pub fn until(&self) -> Option<DateTime<Utc>> {
        match self {
            // A halted canary's soak end lifts nothing.
            Guard::Canary { halted: true, .. } => None,
            Guard::Canary { until, .. } | Guard::Window { until, .. } => *until,
            // An alert has no known end.
            Guard::AlertFiring { .. } | Guard::GateUnreachable { .. } => None,
        }
    }

    /// Whether `approve --now` of the machine overrides it: a window only
    /// (Argo CD's manual sync override); a canary's soak is not skipped.
    pub fn overridden_by_approval(&self) -> bool {
        matches!(self, Guard::Window { .. })
    }
}

fn short(d: Duration) -> String {
    // Whole minutes read best beside a soak of minutes or hours.
    let d = if d >= Duration::from_secs(60) {
        Duration::from_secs(d.as_secs() / 60 * 60)
    } else {
        d
    };
    humantime::format_duration(d).to_string()
}

/// `Mon 02:00 Europe/Berlin`: a time in the window's own zone.
fn local(t: &DateTime<Utc>, zone: &str) -> String {
    match zone.parse::<chrono_tz::Tz>() {
        Ok(tz) => format!(
            "{} {zone}",
            t.with_timezone(&tz).format("%a %Y-%m-%d %H:%M")
        ),
        Err(_) => t.to_rfc3339_opts(SecondsFormat::Secs, true),
    }
}

impl Guard {
    /// Until when it holds, as the end of a sentence (`until …`): a time
    /// where one exists (a window's closing or opening, a soak's end), else
    /// what lifts it.
    pub fn lifts(&self) -> String {
        match self {
            Guard::AlertFiring { .. } => "until the alert resolves".into(),
            Guard::GateUnreachable { .. } => "until Alertmanager can be read".into(),
            Guard::Canary { halted: true, .. } => {
                "until the canary pool's release is resumed (`fleet-reconciler resume APP`)".into()
            }
            Guard::Canary {
                started: 0,
                soak_secs,
                ..
            } => format!(
                "until a started machine of the canary pool is verified on tip, then for a soak of {}",
                short(Duration::from_secs(*soak_secs))
            ),
            Guard::Canary {
                on_tip,
                started,
                needed,
                soak_secs,
                ..
            } if on_tip < needed => format!(
                "until {needed}/{started} are verified on tip, then for a soak of {}",
                short(Duration::from_secs(*soak_secs))
            ),
            Guard::Canary { until: Some(u), .. } => format!(
                "until {} if the ratio holds",
                u.to_rfc3339_opts(SecondsFormat::Secs, true)
            ),
            Guard::Canary { .. } => {
                "until the running daemon's soak ends (`status` shows when)".into()
            }
            Guard::Window {
                deny: true,
                until: Some(u),
                time_zone,
            } => format!("until it closes {}", local(u, time_zone)),
            Guard::Window {
                deny: true,
                until: None,
                ..
            } => "until it closes".into(),
            Guard::Window {
                until: Some(u),
                time_zone,
                ..
            } => format!("until a window opens {}", local(u, time_zone)),
            Guard::Window { until: None, .. } => {
                "until a window opens (none found in the schedules)".into()
            }
        }
    }
}

/// What holds the pool; [`Guard::lifts`] says until when.
impl fmt::Display for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Guard::AlertFiring { alert } => write!(f, "blocked by alert {alert}"),
            Guard::GateUnreachable { error } => write!(
                f,
                "blocked: the alert gate's Alertmanager cannot be read ({error}), so claims are held (fail closed)"
            ),
            Guard::Canary {
                pool, halted: true, ..
            } => write!(
                f,
                "waiting for canary pool {pool}: the release is halted for an app of that pool"
            ),
            Guard::Canary {
                pool,
                on_tip,
                started,
                soaked_secs,
                soak_secs,
                ..
            } => {
                write!(
                    f,
                    "waiting for canary pool {pool}: {on_tip}/{started} on tip, "
                )?;
                let soak = short(Duration::from_secs(*soak_secs));
                match soaked_secs {
                    Some(s) => write!(f, "soak {} of {soak}", short(Duration::from_secs(*s))),
                    // A one-shot plan has no memory of the soak: claiming
                    // one of 0s would be false.
                    None => write!(f, "soak of {soak} timed by the running daemon"),
                }
            }
            Guard::Window { deny: true, .. } => f.write_str("inside a deny window"),
            Guard::Window { .. } => f.write_str("outside maintenance window"),
        }
    }
}

/// How many of `pool`'s started machines run the tip with no rotation of
/// theirs in flight, and how many are started, across every app.
pub fn canary_count(snapshot: &Snapshot, pool: &PoolName) -> (usize, usize) {
    let stale = snapshot.stale_app_names();
    let mut on_tip = 0;
    let mut started = 0;
    for m in &snapshot.machines {
        let m = &m.seen;
        if m.pool != *pool || !m.state.is_started() {
            continue;
        }
        started += 1;
        // A past listing proves nothing now; a rotation in flight is not
        // verified yet; an unreadable marker may be one.
        let settled = match m.inputs.controls.marker.as_ref() {
            None => true,
            Some(Ok(mk)) => mk.phase == Phase::Yielded,
            Some(Err(_)) => false,
        };
        if m.status == MachineStatus::OnTip
            && settled
            && !stale.contains(m.app.as_str())
            && m.inputs.metadata_unknown().is_none()
        {
            on_tip += 1;
        }
    }
    (on_tip, started)
}

/// Whether `on_tip` of `started` meets `ratio` (none started: not met).
fn ratio_met(on_tip: usize, started: usize, ratio: f64) -> bool {
    started > 0 && on_tip as f64 >= ratio * started as f64
}

/// The fewest of `started` machines on the tip that meet `ratio`.
fn needed(started: usize, ratio: f64) -> usize {
    (0..=started)
        .find(|n| ratio_met(*n, started, ratio))
        .unwrap_or(started)
}

/// This run's first sight of each canary pool's ratio being met on the tip
/// (kept in the `Tracker`): the soak is timed from it, on this clock. Kept
/// per canary and ratio (its bits): pools waiting for one canary at two
/// ratios each soak from their own first sight.
#[derive(Clone, Debug, Default)]
pub struct CanaryMemory {
    met: BTreeMap<(PoolName, u64), (CommitId, DateTime<Utc>)>,
    /// A one-shot `plan`'s: it never saw the soak begin, so it times none
    /// (the running daemon does).
    untimed: bool,
}

impl CanaryMemory {
    /// The memory of a process that plans once (`plan`): it says the soak
    /// is the running daemon's to time rather than claim one of 0s.
    pub fn untimed() -> CanaryMemory {
        CanaryMemory {
            untimed: true,
            ..CanaryMemory::default()
        }
    }

    /// Folds one sweep in: each canary pool (one some pool waits for) whose
    /// ratio is met on the tip keeps its first sight, or gets one now; one
    /// whose ratio is not met forgets it (the soak starts over).
    pub fn observe(&mut self, policy: &Policy, snapshot: &Snapshot, now: DateTime<Utc>) {
        let tip = &snapshot.tip.commit;
        let mut next = BTreeMap::new();
        for (waiter, canary) in policy.canaries() {
            let ratio = policy.pool(waiter).after_ratio;
            let key = (canary.clone(), ratio.to_bits());
            if next.contains_key(&key) {
                continue;
            }
            let (on_tip, started) = canary_count(snapshot, canary);
            if !ratio_met(on_tip, started, ratio) {
                continue;
            }
            let since = match self.met.get(&key) {
                Some((t, since)) if t == tip => *since,
                _ => now,
            };
            next.insert(key, (tip.clone(), since));
        }
        self.met = next;
    }

    fn met_since(&self, pool: &PoolName, ratio: f64, tip: &CommitId) -> Option<DateTime<Utc>> {
        self.met
            .get(&(pool.clone(), ratio.to_bits()))
            .filter(|(t, _)| t == tip)
            .map(|(_, since)| *since)
    }
}

/// The canary guard of `pool`, if it has a canary that has not soaked on
/// the tip. `halted`: whether the tip is halted for an app with machines in
/// the canary pool.
pub fn canary_guard(
    policy: &Policy,
    snapshot: &Snapshot,
    memory: &CanaryMemory,
    pool: &PoolName,
    halted: impl Fn(&PoolName) -> bool,
    now: DateTime<Utc>,
) -> Option<Guard> {
    let config = policy.pool(pool);
    let canary = config.after.as_ref()?;
    let (on_tip, started) = canary_count(snapshot, canary);
    let soak = config.soak;
    let met = ratio_met(on_tip, started, config.after_ratio);
    let is_halted = halted(canary);
    let needed = needed(started, config.after_ratio);
    if memory.untimed {
        // Nothing here saw the soak begin: held while the soak lasts, as
        // far as this process can tell (the daemon's may have ended).
        if met && soak.is_zero() && !is_halted {
            return None;
        }
        return Some(Guard::Canary {
            pool: canary.clone(),
            on_tip,
            started,
            needed,
            soaked_secs: (!met).then_some(0),
            soak_secs: soak.as_secs(),
            until: None,
            halted: is_halted,
        });
    }
    let since = met
        .then(|| memory.met_since(canary, config.after_ratio, &snapshot.tip.commit))
        .flatten()
        // Met now, never seen before: the soak starts now.
        .or(met.then_some(now));
    let soaked = since
        .and_then(|s| (now - s).to_std().ok())
        .unwrap_or(Duration::ZERO);
    if met && soaked >= soak && !is_halted {
        return None;
    }
    let until = since.and_then(|s| {
        chrono::Duration::from_std(soak)
            .ok()
            .and_then(|d| s.checked_add_signed(d))
    });
    Some(Guard::Canary {
        pool: canary.clone(),
        on_tip,
        started,
        needed,
        soaked_secs: Some(soaked.min(soak).as_secs()),
        soak_secs: soak.as_secs(),
        until,
        halted: is_halted,
    })
}

/// When the occurrence of `w` open at `now` closes, if one is open: an
/// occurrence opens at a time the schedule names in the window's zone and
/// is open for `duration`, its opening included and its closing not.
pub fn open_until(w: &MaintenanceWindow, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
    let d = chrono::Duration::from_std(w.duration.get()).ok()?;
    let from = now.checked_sub_signed(d)?.with_timezone(&w.time_zone);
    // The first opening after `now - duration` (exclusive): open now if it
    // is not after `now`.
    let start = w.schedule.find_next_occurrence(&from, false).ok()?;
    let start = start.with_timezone(&Utc);
    (start <= now)
        .then(|| start.checked_add_signed(d))
        .flatten()
}

/// The next opening of `w` after `now`.
pub fn next_open(w: &MaintenanceWindow, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
    let from = now.with_timezone(&w.time_zone);
    w.schedule
        .find_next_occurrence(&from, false)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// The window guard of a pool's `windows` at `now`: an open deny window
/// wins (until the last open one closes); else, with allow windows, none
/// open (until the next opening of any).
pub fn window_guard(windows: &[MaintenanceWindow], now: DateTime<Utc>) -> Option<Guard> {
    let denying: Vec<(&MaintenanceWindow, DateTime<Utc>)> = windows
        .iter()
        .filter(|w| w.kind == WindowKind::Deny)
        .filter_map(|w| open_until(w, now).map(|u| (w, u)))
        .collect();
    if let Some((w, until)) = denying.iter().max_by_key(|(_, u)| *u) {
        return Some(Guard::Window {
            deny: true,
            until: Some(*until),
            time_zone: w.time_zone.name().to_string(),
        });
    }
    let allows: Vec<&MaintenanceWindow> = windows
        .iter()
        .filter(|w| w.kind == WindowKind::Allow)
        .collect();
    if allows.is_empty() || allows.iter().any(|w| open_until(w, now).is_some()) {
        return None;
    }
    let next = allows
        .iter()
        .filter_map(|w| next_open(w, now).map(|t| (*w, t)))
        .min_by_key(|(_, t)| *t);
    Some(Guard::Window {
        deny: false,
        until: next.map(|(_, t)| t),
        time_zone: next
            .map(|(w, _)| w.time_zone)
            .unwrap_or(allows[0].time_zone)
            .name()
            .to_string(),
    })
}

/// The apps the alert gate holds now, each with its guard.
pub fn alert_gate(policy: &Policy, snapshot: &Snapshot) -> BTreeMap<AppName, Guard> {
    let apps = snapshot.apps.iter().map(|a| &a.name);
    match &snapshot.gate {
        GateView::NotConfigured => BTreeMap::new(),
        GateView::Unreachable(_) if policy.gate_fail_open => BTreeMap::new(),
        GateView::Unreachable(error) => apps
            .map(|a| {
                let error = error.clone();
                (a.clone(), Guard::GateUnreachable { error })
            })
            .collect(),
        GateView::Read { firing, .. } => {
            let configured = |name: &str| snapshot.apps.iter().any(|a| a.name.as_str() == name);
            apps.filter_map(|app| {
                firing
                    .iter()
                    .find(|f| f.app().is_none_or(|n| !configured(n) || n == app.as_str()))
                    .map(|f| {
                        let alert = f.to_string();
                        (app.clone(), Guard::AlertFiring { alert })
                    })
            })
            .collect()
        }
    }
}

/// `gate_unreachable` while Alertmanager cannot be read: high while it
/// holds claims (fail closed), low with `fail_open` (nothing is held, but
/// the gate is blind).
pub fn gate_alert(policy: &Policy, snapshot: &Snapshot) -> Option<Alert> {
    let GateView::Unreachable(error) = &snapshot.gate else {
        return None;
    };
    let (severity, effect) = if policy.gate_fail_open {
        (
            Severity::Low,
            "gates.alertmanager.fail_open is set, so rotations start as if no alert fired",
        )
    } else {
        (
            Severity::High,
            "no new rotation starts until it can be read (fail closed); those under way finish",
        )
    };
    Some(Alert {
        kind: AlertKind::GateUnreachable,
        app: None,
        machine_id: None,
        commit: None,
        severity,
        summary: format!(
            "the alert gate's Alertmanager (gates.alertmanager) cannot be read: {error}; {effect} (see the gate_unreachable runbook, docs/operations.md)"
        ),
        details: BTreeMap::from([("error".to_string(), error.clone())]),
    })
}

#[cfg(test)]
#[path = "guardrail_tests.rs"]
mod tests;

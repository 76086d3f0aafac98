//! Alerts: which conditions hold after each turn of the loop.
//!
//! Owns every rule that turns what a turn saw into `Alert`s, beside the
//! planner's machine alerts ([`crate::decide::planner`] raises drift,
//! unreachable and rotation alerts into `Plan::alerts`): the fleet rules
//! (coherence below threshold, sweeps failing, tip stale, an app that
//! cannot be listed, the coordinator's slot set unknown for
//! [`COORDINATOR_UNREADABLE_SWEEPS`] sweep intervals), the little state those
//! rules need ([`AlertMemory`]: since when coherence has been below the
//! threshold, since when the slot set has been unknown, which apps the
//! last sweep could not list, the machine alerts
//! carried over a failed sweep or an unlistable app, and the alerts known
//! before a restart until the evidence of this run confirms or clears them,
//! [`FleetAlertTracker::restore`], [`RestoredMachineAlerts`], and when this
//! replica last saw the fleet and each app, [`Seen`], what the notifier
//! judges staleness by), and [`evaluate`], which turns one [`Turn`] into its
//! complete [`AlertSet`]. The loop (`daemon`) keeps the memory and puts
//! each turn's set in its outcome; the reporter only forwards it.
//!
//! It must never read the clock, deliver, or do I/O: `now` and every
//! timestamp are arguments (the notifier's delivery state comes in the
//! [`Turn`] as [`FailingSink`] facts), so the rules are tested by driving
//! time forward; delivering is `report::notify`'s.
//!
//! # How to add an alert condition
//!
//! 1. Its entry in the `alert_kinds!` table of [`kinds`] (`alerts/kinds.rs`),
//!    under its doc:
//!    `NewCondition => "new_condition", "new_condition_resolved",`
//!    `own: false, grouped: false;`. That entry is the variant, both event
//!    names, and its properties: `own` if it is about this replica itself
//!    (never frozen as stale by `decide::voice`), `grouped` if its
//!    per-machine alerts fold into incidents held open while briefly empty
//!    (`decide::incidents`, `decide::voice`). No other file lists kinds
//!    a new one must join: others name a kind only for that kind's own
//!    behaviour, and their matches on kinds end in `_`. The table is a file of its own
//!    only because the planner, which this module reads, raises alerts too:
//!    declared here, it would be a circle.
//! 2. Its rule, here: a function of what the [`Turn`] says (and, if it
//!    needs a clock, a field of [`AlertMemory`]), called from [`evaluate`]
//!    so that its alert is in each turn's [`AlertSet`]; its severity a
//!    `const` beside the others.
//! 3. Its test, here, driving [`evaluate`] through turns with `now` given.
//! 4. Its row in docs/alerts.md and its runbook section in
//!    docs/operations.md (the section's anchor is the trigger name).
//!
//! The test `a_new_condition_is_its_table_entry_and_its_rule` shows it with
//! the test-only kind `ExampleCondition`.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};

use crate::config::Config;
pub use crate::decide::coherence::{Coherence, CoherenceSample};
use crate::decide::planner::Plan;
use crate::decide::snapshot::Snapshot;
use crate::events::DedupKey;
use crate::metadata::slots::Coordinator;
use crate::model::{AppName, CommitId, MachineStatus, Severity};
use crate::observe::sweep::{SlotsView, StaleApp};

pub mod kinds;
pub use kinds::{Alert, AlertKind};

/// Severity of the coherence alert.
pub const COHERENCE_SEVERITY: Severity = Severity::High;
/// Severity of the sweep-failing alert: nothing else the daemon says can be trusted.
pub const SWEEP_FAILING_SEVERITY: Severity = Severity::Critical;
/// Severity of the tip-stale alert.
pub const TIP_STALE_SEVERITY: Severity = Severity::High;
/// Severity of the app-unlistable alert: that app's machines are unmanaged.
pub const APP_UNLISTABLE_SEVERITY: Severity = Severity::High;
/// Severity of the coordinator-unreadable alert.
pub const COORDINATOR_UNREADABLE_SEVERITY: Severity = Severity::High;
/// Sweep intervals the coordinator's slot set may stay unknown before
/// `coordinator_unreadable` fires.
pub const COORDINATOR_UNREADABLE_SWEEPS: u32 = 3;
/// Severity of `alert_sink_failing`: high enough for a PagerDuty sink with
/// `min_severity = "high"` to hear that Slack is gone, and the reverse.
pub const SINK_FAILING_SEVERITY: Severity = Severity::High;
/// Longest error text an alert carries (the Fly error naming the app).
const ERROR_MAX_CHARS: usize = 300;

/// The thresholds of the fleet-level alerts.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetAlertRules {
    /// Coherence strictly below this ratio starts the clock (`alerts.coherence_threshold`).
    pub coherence_threshold: f64,
    /// …and the alert fires once it has stayed below for this long (`alerts.coherence_for`).
    pub coherence_for: Duration,
    /// `sweep.interval`.
    pub sweep_interval: Duration,
    /// `overlay.fetch_interval`.
    pub fetch_interval: Duration,
    /// Sweeps fail when this many in a row failed…
    pub max_consecutive_sweep_failures: u32,
    /// …or none succeeded for this many sweep intervals; the tip is stale when
    /// it was not fetched for this many fetch intervals.
    pub stale_intervals: u32,
    /// `overlay.fetch_timeout`: how long the first fetch (a full clone on a
    /// cold start) may take. Until one sweep or one fetch has succeeded,
    /// the daemon is *starting*, and neither `sweep_failing` nor
    /// `tip_stale` fires before this plus their own bound has passed.
    pub first_fetch_timeout: Duration,
}

impl FleetAlertRules {
    pub fn from_config(config: &Config) -> FleetAlertRules {
        FleetAlertRules {
            coherence_threshold: config.alerts.coherence_threshold,
            coherence_for: config.alerts.coherence_for,
            sweep_interval: config.sweep.interval.get(),
            fetch_interval: config.overlay.fetch_interval,
            max_consecutive_sweep_failures: 3,
            stale_intervals: 3,
            first_fetch_timeout: config.overlay.fetch_timeout.get(),
        }
    }

    /// Whether a daemon that has not yet fetched the tip nor swept, `since`
    /// its start, may still be waiting for its first fetch (bounded by
    /// `first_fetch_timeout`) before `bound` applies.
    fn starting(&self, input: &FleetAlertInput<'_>, since: Duration, bound: Duration) -> bool {
        input.last_sweep_success.is_none()
            && input.last_tip_fetch.is_none()
            && since <= self.first_fetch_timeout + bound
    }

    /// No successful sweep for longer than this fires `sweep_failing`.
    pub fn sweep_stale_after(&self) -> Duration {
        self.sweep_interval * self.stale_intervals
    }

    /// No successful fetch for longer than this fires `tip_stale`. Fetches
    /// happen on sweep ticks, so a fetch interval shorter than the sweep
    /// interval is effectively the sweep interval.
    pub fn tip_stale_after(&self) -> Duration {
        self.fetch_interval.max(self.sweep_interval) * self.stale_intervals
    }

    /// An app not listed successfully for longer than this fires `app_unlistable`.
    pub fn app_stale_after(&self) -> Duration {
        self.sweep_interval * self.stale_intervals
    }
}

/// What the daemon loop knows after a sweep (or a failed one).
#[derive(Clone, Debug, Default)]
pub struct FleetAlertInput<'a> {
    /// `None` when this sweep failed: the coherence clocks neither start nor
    /// stop (nothing was measured), and a firing coherence alert keeps firing.
    pub coherence: Option<&'a CoherenceSample>,
    /// When a sweep last succeeded; `None` if none has since start.
    pub last_sweep_success: Option<DateTime<Utc>>,
    /// Failed sweeps since the last success.
    pub consecutive_sweep_failures: u32,
    /// When the overlay was last fetched successfully; `None` if never.
    pub last_tip_fetch: Option<DateTime<Utc>>,
    /// The release tip in use, for the alerts' details.
    pub tip_commit: Option<&'a str>,
}

#[derive(Clone, Copy, Debug)]
struct Below {
    since: DateTime<Utc>,
    last: Coherence,
}

/// Remembers since when coherence has been below the threshold (fleet-wide
/// and per app) and evaluates the fleet-level alerts each sweep.
#[derive(Clone, Debug)]
pub struct FleetAlertTracker {
    rules: FleetAlertRules,
    /// The first `now` seen: "never succeeded" is measured from here.
    started: Option<DateTime<Utc>>,
    fleet_below: Option<Below>,
    apps_below: BTreeMap<AppName, Below>,
    /// Number of apps in the last sample (the fleet-wide alert is redundant for one).
    app_count: usize,
    /// The apps the last successful sweep could not list, and how many of
    /// their machines it shows from their last listing.
    unlisted: BTreeMap<AppName, (StaleApp, usize)>,
    /// `sweep_failing` fired before a restart: it holds until a sweep succeeds.
    sweep_failing_carried: bool,
    /// `tip_stale` fired before a restart: it holds until a fetch succeeds.
    tip_stale_carried: bool,
}

impl FleetAlertTracker {
    pub fn new(rules: FleetAlertRules) -> FleetAlertTracker {
        FleetAlertTracker {
            rules,
            started: None,
            fleet_below: None,
            apps_below: BTreeMap::new(),
            app_count: 0,
            unlisted: BTreeMap::new(),
            sweep_failing_carried: false,
            tip_stale_carried: false,
        }
    }

    pub fn rules(&self) -> &FleetAlertRules {
        &self.rules
    }

    /// Records which apps a successful sweep could not list; call before
    /// [`FleetAlertTracker::evaluate`]. A failed sweep lists nothing: without
    /// this call the last known set stands (and keeps ageing).
    pub fn observe_listings(&mut self, report: &Snapshot) {
        self.unlisted = report
            .stale_apps()
            .map(|(name, stale)| {
                let shown = report
                    .machines
                    .iter()
                    .filter(|m| &m.seen.app == name)
                    .count();
                (name.clone(), (stale.clone(), shown))
            })
            .collect();
    }

    /// Seeds the coherence clocks from the alerts that were firing before a
    /// restart (`Notifier::restored_alerts`): a coherence alert that still
    /// holds keeps firing from its original `below_since` instead of waiting
    /// `coherence_for` again (which would resolve it, then page anew). The
    /// first sweep that measures coherence stops or continues the clock as
    /// usual.
    ///
    /// A `sweep_failing` from before keeps firing until a sweep succeeds, and
    /// a `tip_stale` until a fetch succeeds, instead of resolving at the first
    /// failed sweep of this run and firing again a few sweeps later.
    pub fn restore(&mut self, alerts: &[Alert]) {
        for alert in alerts {
            match alert.kind {
                AlertKind::SweepFailing => self.sweep_failing_carried = true,
                AlertKind::TipStale => self.tip_stale_carried = true,
                _ => {}
            }
            if alert.kind != AlertKind::CoherenceBelowThreshold {
                continue;
            }
            let get = |k: &str| alert.details.get(k);
            let since = get("below_since")
                .and_then(|v| DateTime::parse_from_rfc3339(v).ok())
                .map(|t| t.with_timezone(&Utc));
            let ratio = get("coherence").and_then(|v| v.parse::<f64>().ok());
            let count = |k: &str| get(k).and_then(|v| v.parse::<usize>().ok());
            let (Some(since), Some(ratio), Some(on_tip), Some(machines)) =
                (since, ratio, count("on_tip"), count("machines"))
            else {
                continue;
            };
            let below = Below {
                since,
                last: Coherence {
                    ratio,
                    on_tip,
                    machines,
                },
            };
            match &alert.app {
                Some(app) => {
                    self.apps_below.insert(app.clone(), below);
                }
                None => self.fleet_below = Some(below),
            }
        }
    }

    /// The fleet-level alerts that hold at `now`. Call once per sweep (also
    /// after a failed one) and pass the result, with the planner's alerts, to
    /// `Notifier::update`.
    pub fn evaluate(&mut self, input: &FleetAlertInput<'_>, now: DateTime<Utc>) -> Vec<Alert> {
        let started = *self.started.get_or_insert(now);
        if let Some(sample) = input.coherence {
            self.observe(sample, now);
            self.sweep_failing_carried = false;
        }
        if input.last_tip_fetch.is_some() {
            self.tip_stale_carried = false;
        }
        let mut alerts = Vec::new();
        // With one app the fleet-wide condition is the app's: send it once.
        if let (true, Some(below)) = (self.app_count != 1, self.fleet_below) {
            alerts.extend(self.coherence_alert(None, below, input.tip_commit, now));
        }
        for (app, below) in &self.apps_below {
            alerts.extend(self.coherence_alert(Some(app), *below, input.tip_commit, now));
        }
        alerts.extend(self.sweep_failing(input, started, now));
        alerts.extend(self.tip_stale(input, started, now));
        alerts.extend(self.apps_unlistable(started, now));
        alerts
    }

    /// One alert per app not listed for longer than
    /// [`FleetAlertRules::app_stale_after`] (measured from its last listing,
    /// or from the first evaluation when it never was).
    fn apps_unlistable(&self, started: DateTime<Utc>, now: DateTime<Utc>) -> Vec<Alert> {
        self.unlisted
            .iter()
            .filter_map(|(app, (stale, shown))| {
                let since = elapsed(stale.last_listed_at.unwrap_or(started), now);
                if since <= self.rules.app_stale_after() {
                    return None;
                }
                let error: String = stale.error.chars().take(ERROR_MAX_CHARS).collect();
                let shown = match stale.last_listed_at {
                    Some(at) => format!(
                        "its {shown} machine(s) are shown as last listed ({})",
                        rfc3339(at)
                    ),
                    None => "its machines are unknown".to_owned(),
                };
                Some(Alert {
                    kind: AlertKind::AppUnlistable,
                    app: Some(app.clone()),
                    machine_id: None,
                    commit: None,
                    severity: APP_UNLISTABLE_SEVERITY,
                    summary: format!(
                        "App {app} has not been listed for {}: {error}; {shown}, and nothing is done to them until it lists again",
                        human(since),
                    ),
                    details: BTreeMap::from([
                        ("error".to_owned(), error),
                        ("kind".to_owned(), stale.kind.clone()),
                        (
                            "last_listed".to_owned(),
                            stale.last_listed_at.map_or("never".to_owned(), rfc3339),
                        ),
                    ]),
                })
            })
            .collect()
    }

    fn observe(&mut self, sample: &CoherenceSample, now: DateTime<Utc>) {
        let threshold = self.rules.coherence_threshold;
        let track = |prev: Option<Below>, c: Coherence| {
            (c.ratio < threshold).then(|| Below {
                since: prev.map_or(now, |b| b.since),
                last: c,
            })
        };
        self.fleet_below = track(self.fleet_below, sample.fleet);
        self.apps_below = sample
            .apps
            .iter()
            .filter_map(|(app, c)| {
                let prev = self.apps_below.get(app).copied();
                track(prev, *c).map(|b| (app.clone(), b))
            })
            .collect();
        self.app_count = sample.apps.len();
    }

    fn coherence_alert(
        &self,
        app: Option<&AppName>,
        below: Below,
        tip: Option<&str>,
        now: DateTime<Utc>,
    ) -> Option<Alert> {
        let lasted = elapsed(below.since, now);
        if lasted < self.rules.coherence_for {
            return None;
        }
        let c = below.last;
        let scope = match app {
            Some(app) => format!("App {app} coherence"),
            None => "Fleet coherence".to_owned(),
        };
        let mut details = BTreeMap::from([
            ("coherence".to_owned(), format!("{:.4}", c.ratio)),
            ("on_tip".to_owned(), c.on_tip.to_string()),
            ("machines".to_owned(), c.machines.to_string()),
            (
                "threshold".to_owned(),
                format!("{}", self.rules.coherence_threshold),
            ),
            ("below_since".to_owned(), rfc3339(below.since)),
        ]);
        if let Some(tip) = tip {
            details.insert("tip".to_owned(), tip.to_owned());
        }
        Some(Alert {
            kind: AlertKind::CoherenceBelowThreshold,
            app: app.cloned(),
            machine_id: None,
            // Not keyed by the tip: a release during the incident is the same incident.
            commit: None,
            severity: COHERENCE_SEVERITY,
            summary: format!(
                "{scope} is {} ({} of {} started machines on the release tip), below {} for {}",
                percent(c.ratio),
                c.on_tip,
                c.machines,
                percent(self.rules.coherence_threshold),
                human(lasted),
            ),
            details,
        })
    }

    fn sweep_failing(
        &self,
        input: &FleetAlertInput<'_>,
        started: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Option<Alert> {
        let since = elapsed(input.last_sweep_success.unwrap_or(started), now);
        // The first sweeps of a cold start fail for want of a tip while the
        // first clone runs: a daemon that is starting is not failing.
        let starting = self
            .rules
            .starting(input, since, self.rules.sweep_stale_after());
        let failing = !starting
            && (input.consecutive_sweep_failures >= self.rules.max_consecutive_sweep_failures
                || since > self.rules.sweep_stale_after())
            || self.sweep_failing_carried;
        if !failing {
            return None;
        }
        let last = match input.last_sweep_success {
            Some(_) => format!("the last success was {} ago", human(since)),
            None => format!("none has succeeded in the {} since start", human(since)),
        };
        Some(fleet_alert(
            AlertKind::SweepFailing,
            SWEEP_FAILING_SEVERITY,
            format!(
                "Sweeps are failing ({} in a row); {last}: drift, coherence and rotations are not being checked",
                input.consecutive_sweep_failures
            ),
            BTreeMap::from([
                (
                    "consecutive_failures".to_owned(),
                    input.consecutive_sweep_failures.to_string(),
                ),
                (
                    "last_success".to_owned(),
                    input.last_sweep_success.map_or("never".to_owned(), rfc3339),
                ),
            ]),
        ))
    }

    fn tip_stale(
        &self,
        input: &FleetAlertInput<'_>,
        started: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Option<Alert> {
        let since = elapsed(input.last_tip_fetch.unwrap_or(started), now);
        let starting = self
            .rules
            .starting(input, since, self.rules.tip_stale_after());
        if (since <= self.rules.tip_stale_after() || starting) && !self.tip_stale_carried {
            return None;
        }
        let mut details = BTreeMap::from([(
            "last_fetch".to_owned(),
            input.last_tip_fetch.map_or("never".to_owned(), rfc3339),
        )]);
        if let Some(tip) = input.tip_commit {
            details.insert("tip".to_owned(), tip.to_owned());
        }
        Some(fleet_alert(
            AlertKind::TipStale,
            TIP_STALE_SEVERITY,
            format!(
                "The overlay release branch has not been fetched for {}: drift is measured against a possibly outdated tip",
                human(since)
            ),
            details,
        ))
    }
}

/// The machine alerts that were firing before a restart, carried over until
/// this run's planner has caught up: its drift clocks start over, so a
/// machine still drifting has no drift alert for `rotation.min_drift_age`,
/// which without this would resolve the alert and page it again.
///
/// At each successful sweep, a restored alert is
/// - dropped once the planner raises it itself, or when the sweep shows it
///   cleared: the machine is gone, on the tip or stopped, or the release tip
///   moved on (a new tip is a new alert);
/// - carried while the machine gives no usable report (as the planner does
///   for a drift it saw before);
/// - carried for `grace` from the first sweep that saw the machine drifted
///   again, then dropped (resolved) if the planner has not raised it.
///
/// Failed sweeps know nothing new: every restored alert still carried is.
#[derive(Clone, Debug, Default)]
pub struct RestoredMachineAlerts {
    grace: Duration,
    /// The alert, and when this run first saw its machine drifted.
    alerts: BTreeMap<DedupKey, (Alert, Option<DateTime<Utc>>)>,
}

impl RestoredMachineAlerts {
    /// The machine alerts among `restored` (those with a machine id);
    /// `grace` is `rotation.min_drift_age` plus a margin of sweeps.
    pub fn new(restored: &[Alert], grace: Duration) -> RestoredMachineAlerts {
        RestoredMachineAlerts {
            grace,
            alerts: restored
                .iter()
                .filter(|a| a.machine_id.is_some())
                .map(|a| (a.dedup_key(), (a.clone(), None)))
                .collect(),
        }
    }

    /// The restored alerts still carried (for a failed sweep).
    pub fn carried(&self) -> Vec<Alert> {
        self.alerts.values().map(|(a, _)| a.clone()).collect()
    }

    /// After a successful sweep: the restored alerts to add to the planner's
    /// `planned` ones.
    pub fn after_sweep(
        &mut self,
        report: &Snapshot,
        planned: &[Alert],
        now: DateTime<Utc>,
    ) -> Vec<Alert> {
        if self.alerts.is_empty() {
            return Vec::new();
        }
        let live: std::collections::HashSet<DedupKey> =
            planned.iter().map(Alert::dedup_key).collect();
        let grace = chrono::Duration::from_std(self.grace).unwrap_or(chrono::Duration::MAX);
        let tip = &report.tip.commit;
        self.alerts.retain(|key, (alert, drifted_since)| {
            if live.contains(key) || alert.commit.as_ref().is_some_and(|c| c != tip) {
                return false;
            }
            let machine = alert.machine_id.as_ref();
            let Some(m) = report.machines.iter().find(|m| {
                Some(&m.seen.machine_id) == machine && alert.app.as_ref() == Some(&m.seen.app)
            }) else {
                return false; // gone
            };
            match m.seen.status {
                MachineStatus::OnTip | MachineStatus::NotRunning => false,
                MachineStatus::Unreachable | MachineStatus::BadReport => true,
                MachineStatus::Drifted
                | MachineStatus::UnknownRef
                | MachineStatus::AmbiguousRef => {
                    let since = *drifted_since.get_or_insert(now);
                    now - since < grace
                }
            }
        });
        self.carried()
    }
}

/// When this replica last saw the fleet and each app, by its own clock: what
/// an alert's data is as old as.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// The last successful sweep (`None`: none yet in this run).
    pub sweep: Option<DateTime<Utc>>,
    /// Apps the last successful sweep could not list, with their last
    /// listing (`None`: never in this run); the others were seen at `sweep`.
    pub unlisted: BTreeMap<AppName, Option<DateTime<Utc>>>,
    /// The release tip of the last successful sweep: an incident of another
    /// tip is over (a new release is a new incident), hold-down or not.
    pub tip: Option<CommitId>,
}

impl Seen {
    /// Everything seen at `now` (a test's or a caller's without sweeps).
    pub fn fresh(now: DateTime<Utc>) -> Seen {
        Seen {
            sweep: Some(now),
            ..Seen::default()
        }
    }

    /// When the data `alert` was drawn from was seen (`None`: never).
    pub(crate) fn of(&self, alert: &Alert) -> Option<DateTime<Utc>> {
        match alert.app.as_ref().and_then(|app| self.unlisted.get(app)) {
            Some(listed) => *listed,
            None => self.sweep,
        }
    }
}

/// The alert rules of a config: the fleet rules' thresholds, how long a
/// restored machine alert waits for the planner to raise it again, and the
/// coordinator whose slot set `coordinator_unreadable` is about.
#[derive(Clone, Debug, PartialEq)]
pub struct AlertRules {
    pub fleet: FleetAlertRules,
    /// `rotation.min_drift_age` plus two sweeps: the planner's drift clocks
    /// start over at a restart, so it raises a drift alert only after that.
    pub restored_grace: Duration,
    /// `rotation.coordinator`, named in `coordinator_unreadable`'s details.
    pub coordinator: Option<Coordinator>,
}

impl AlertRules {
    pub fn from_config(config: &Config) -> AlertRules {
        AlertRules {
            fleet: FleetAlertRules::from_config(config),
            restored_grace: config.rotation.min_drift_age + config.sweep.interval.get() * 2,
            coordinator: config.rotation.coordinator.clone(),
        }
    }
}

/// Since when the coordinator's slot set has been unknown (unreadable, or
/// not the one this fleet sealed), and the rule that makes that
/// `coordinator_unreadable`. The planner refuses every step that needs a
/// slot while the set is unknown, from the first sweep on; the alert
/// waits [`COORDINATOR_UNREADABLE_SWEEPS`] sweep intervals, so a blip is
/// silent.
#[derive(Clone, Debug)]
struct CoordinatorClock {
    /// Unknown this long fires the alert.
    after: Duration,
    /// `rotation.coordinator`, for the details.
    coordinator: Option<Coordinator>,
    /// First sweep of the current run that could not read the slot set.
    unknown_since: Option<DateTime<Utc>>,
}

impl CoordinatorClock {
    fn new(rules: &AlertRules) -> CoordinatorClock {
        CoordinatorClock {
            after: rules
                .fleet
                .sweep_interval
                .saturating_mul(COORDINATOR_UNREADABLE_SWEEPS),
            coordinator: rules.coordinator.clone(),
            unknown_since: None,
        }
    }

    /// Folds in what a successful sweep saw of the slots, and says
    /// `coordinator_unreadable` if the set has been unknown long enough.
    fn observe(&mut self, slots: &SlotsView, now: DateTime<Utc>) -> Option<Alert> {
        let Some(why) = slots.unreadable() else {
            self.unknown_since = None;
            return None;
        };
        let since = *self.unknown_since.get_or_insert(now);
        // `since + after > now`, saturating: not yet.
        if now < since || elapsed(since, now) < self.after {
            return None;
        }
        let mut details = BTreeMap::new();
        details.insert("since".to_string(), since.to_rfc3339());
        if let Some(c) = &self.coordinator {
            details.insert("coordinator".to_string(), c.to_string());
        }
        Some(Alert {
            kind: AlertKind::CoordinatorUnreadable,
            app: None,
            machine_id: None,
            commit: None,
            severity: COORDINATOR_UNREADABLE_SEVERITY,
            summary: format!(
                "the rotation slots cannot be read since {} ({why}): no rotation starts, drains or restarts; undos go on",
                since.to_rfc3339()
            ),
            details,
        })
    }
}

/// A webhook that is dead-lettering what it is sent, as the notifier's
/// delivery path reports it: a plain fact of the turn ([`DeliveryState`]),
/// which [`sink_failing`] judges. Never carries the URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailingSink {
    /// Its index in `[[alerts.webhooks]]`.
    pub index: usize,
    /// Its format's id (`json`, `slack`, `pagerduty`).
    pub format: &'static str,
    /// The variable its URL is read from (the URL itself is a secret).
    pub url_env: String,
    /// When its failing episode began…
    pub since: DateTime<Utc>,
    /// …and why (the first refusal or the last failed attempt).
    pub reason: String,
    /// The notifications it holds set aside.
    pub dead_letters: usize,
}

/// Where the loop reads, each turn, which sinks are failing: the
/// notifier, which reports its delivery state and decides nothing of it.
pub trait DeliveryState: Send + Sync {
    /// The webhooks failing now, in config order.
    fn failing_sinks(&self) -> Vec<FailingSink>;
}

/// One turn of the loop, as the alert rules read it.
#[derive(Clone, Copy, Debug)]
pub enum Turn<'a> {
    /// A sweep that succeeded, planned on.
    Swept {
        report: &'a Snapshot,
        plan: &'a Plan,
        /// When the overlay was last fetched successfully.
        tip_fetched_at: Option<DateTime<Utc>>,
        /// The webhooks failing as the turn ends ([`DeliveryState`]).
        failing_sinks: &'a [FailingSink],
    },
    /// A sweep that failed: nothing new is known of the machines.
    Failed {
        tip_fetched_at: Option<DateTime<Utc>>,
        failing_sinks: &'a [FailingSink],
    },
}

/// Every alert that holds after a turn: the machine alerts known last (the
/// plan's, those carried for apps this sweep could not list, restored ones
/// not yet settled), then the fleet's. What the notifier is given, whole:
/// an alert missing from it is resolved. With it, how old the view each
/// alert was drawn from is (`seen`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AlertSet {
    pub alerts: Vec<Alert>,
    /// When this replica last saw the fleet and each app, as of this turn.
    pub seen: Seen,
}

/// What the alert rules remember from one turn to the next; kept by the
/// loop beside `LastListings` and the `Tracker` (`daemon`'s turns) and
/// changed only by [`evaluate`].
#[derive(Clone, Debug)]
pub struct AlertMemory {
    fleet: FleetAlertTracker,
    /// When a sweep last succeeded.
    last_success: Option<DateTime<Utc>>,
    /// Failed sweeps since the last success.
    failures: u32,
    /// The planner's machine alerts of the last successful sweep. A failed
    /// sweep knows nothing new about machines, so they are carried over:
    /// sending only the fleet alerts would resolve every drift alert, and
    /// page again once sweeps recover. Likewise, per app, for the apps a
    /// successful sweep could not list.
    machine_alerts: Vec<Alert>,
    /// Machine alerts from before a restart, until the planner has caught up.
    restored: RestoredMachineAlerts,
    /// When the last successful sweep saw the fleet and each app.
    seen: Seen,
    /// Since when the coordinator's slot set has been unknown.
    coordinator: CoordinatorClock,
}

impl AlertMemory {
    /// The memory of a run that starts now: alerts firing before a restart
    /// (`restored`, the notifier's saved state) keep firing until this run's
    /// evidence confirms or clears them, since the planner's drift clocks
    /// start over.
    pub fn new(rules: &AlertRules, restored: &[Alert]) -> AlertMemory {
        let mut fleet = FleetAlertTracker::new(rules.fleet.clone());
        fleet.restore(restored);
        let restored = RestoredMachineAlerts::new(restored, rules.restored_grace);
        AlertMemory {
            fleet,
            last_success: None,
            failures: 0,
            // Until the first good sweep, what was known before the restart.
            machine_alerts: restored.carried(),
            restored,
            seen: Seen::default(),
            coordinator: CoordinatorClock::new(rules),
        }
    }
}

/// The alerts that hold after `turn`, at `now` (the loop's time of the
/// turn). Pure but for `memory`, which it brings up to date; the rules are
/// those `memory` was made with ([`AlertMemory::new`]), so one memory is
/// never judged by two sets of thresholds.
pub fn evaluate(turn: Turn<'_>, memory: &mut AlertMemory, now: DateTime<Utc>) -> AlertSet {
    let mut fleet = match turn {
        Turn::Failed { tip_fetched_at, .. } => {
            memory.failures += 1;
            memory.fleet.evaluate(
                &FleetAlertInput {
                    coherence: None,
                    last_sweep_success: memory.last_success,
                    consecutive_sweep_failures: memory.failures,
                    last_tip_fetch: tip_fetched_at,
                    tip_commit: None,
                },
                now,
            )
        }
        Turn::Swept {
            report,
            plan,
            tip_fetched_at,
            ..
        } => {
            memory.failures = 0;
            memory.last_success = Some(now);
            let sample = CoherenceSample::of(report, now);
            memory.fleet.observe_listings(report);
            let fleet = memory.fleet.evaluate(
                &FleetAlertInput {
                    coherence: Some(&sample),
                    last_sweep_success: Some(now),
                    consecutive_sweep_failures: 0,
                    last_tip_fetch: tip_fetched_at,
                    tip_commit: Some(report.tip.commit.as_str()),
                },
                now,
            );
            // Nothing new is known of the machines of an app this sweep could not
            // list (the planner says nothing of them): their alerts stand.
            let stale = report.stale_app_names();
            let mut alerts: Vec<Alert> = plan.alerts.clone();
            // Carried over a failed sweep like the plan's: nothing new is
            // known of the slots then.
            alerts.extend(memory.coordinator.observe(&report.slots, now));
            alerts.extend(
                memory
                    .machine_alerts
                    .iter()
                    .filter(|a| {
                        a.app
                            .as_ref()
                            .is_some_and(|app| stale.contains(app.as_str()))
                    })
                    .cloned(),
            );
            // Alerts from before a restart, until this run's evidence settles them.
            let restored = memory.restored.after_sweep(report, &alerts, now);
            alerts.extend(restored);
            memory.machine_alerts = alerts;
            memory.seen = Seen {
                sweep: Some(now),
                unlisted: report
                    .apps
                    .iter()
                    .filter_map(|a| a.stale.as_ref().map(|s| (a.name.clone(), s.last_listed_at)))
                    .collect(),
                tip: Some(report.tip.commit.clone()),
            };
            fleet
        }
    };
    let (Turn::Swept { failing_sinks, .. } | Turn::Failed { failing_sinks, .. }) = turn;
    fleet.extend(sink_failing(failing_sinks));
    AlertSet {
        alerts: with_machine_alerts(&memory.machine_alerts, fleet),
        seen: memory.seen.clone(),
    }
}

/// `alert_sink_failing`, one alert for all the webhooks failing, while any
/// is: what the notifier's other sinks are told (the failing ones are not,
/// they would only dead-letter it too).
pub fn sink_failing(failing: &[FailingSink]) -> Option<Alert> {
    if failing.is_empty() {
        return None;
    }
    let lines: Vec<String> = failing
        .iter()
        .map(|f| {
            format!(
                "webhook {} ({}, URL in {}) has failed since {}: {}; {} notification(s) dead-lettered",
                f.index,
                f.format,
                f.url_env,
                rfc3339(f.since),
                f.reason,
                f.dead_letters
            )
        })
        .collect();
    let names: Vec<String> = failing
        .iter()
        .map(|f| format!("{}:{}:{}", f.index, f.format, f.url_env))
        .collect();
    let dead = failing
        .iter()
        .fold(0usize, |n, f| n.saturating_add(f.dead_letters));
    let summary = format!(
        "Alerts are not reaching every webhook: {}. The other webhooks still get everything; fix the receiver or its URL (then restart)",
        lines.join("; ")
    );
    Some(sink_failing_alert(
        summary,
        BTreeMap::from([
            ("sinks".to_owned(), names.join(",")),
            ("dead_letters".to_owned(), dead.to_string()),
        ]),
    ))
}

/// The key of `alert_sink_failing` (one alert for all failing sinks).
pub fn sink_failing_key() -> DedupKey {
    sink_failing_alert(String::new(), BTreeMap::new()).dedup_key()
}

fn sink_failing_alert(summary: String, details: BTreeMap<String, String>) -> Alert {
    fleet_alert(
        AlertKind::SinkFailing,
        SINK_FAILING_SEVERITY,
        summary,
        details,
    )
}

/// All alerts of a cycle: the machine alerts known last, then the fleet's.
/// (The notifier logs each alert as it starts firing and as it clears.)
fn with_machine_alerts(machine: &[Alert], fleet: Vec<Alert>) -> Vec<Alert> {
    machine.iter().cloned().chain(fleet).collect()
}

fn fleet_alert(
    kind: AlertKind,
    severity: Severity,
    summary: String,
    details: BTreeMap<String, String>,
) -> Alert {
    Alert {
        kind,
        app: None,
        machine_id: None,
        commit: None,
        severity,
        summary,
        details,
    }
}

/// `now - since`, zero when the clock went backwards.
fn elapsed(since: DateTime<Utc>, now: DateTime<Utc>) -> Duration {
    (now - since).to_std().unwrap_or_default()
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn human(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_secs(d.as_secs()))
}

fn percent(ratio: f64) -> String {
    format!("{:.1}%", ratio * 100.0).replace(".0%", "%")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::snapshot::AppSummary;
    use crate::observe::sweep::TipReport;

    fn t(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap_or_default()
    }

    fn rules() -> FleetAlertRules {
        FleetAlertRules {
            coherence_threshold: 0.0,
            coherence_for: Duration::from_secs(900),
            sweep_interval: Duration::from_secs(30),
            fetch_interval: Duration::from_secs(30),
            max_consecutive_sweep_failures: 3,
            stale_intervals: 3,
            first_fetch_timeout: Duration::from_secs(120),
        }
    }

    /// A report of apps `a` and `b`, `b` not listed since `b_listed` (`Some(None)`: never).
    fn report(b_unlisted: Option<Option<DateTime<Utc>>>) -> Snapshot {
        let app = |name: &str, stale: Option<StaleApp>| AppSummary {
            name: name.into(),
            coherence: Coherence::of(0, 0),
            stale,
        };
        Snapshot {
            tip: TipReport {
                branch: "release".into(),
                commit: crate::model::CommitId::parse(&"a".repeat(40)).unwrap(),
            },
            coherence: Coherence::of(0, 0),
            apps: vec![
                app("a", None),
                app(
                    "b",
                    b_unlisted.map(|last_listed_at| StaleApp {
                        error: "cannot list machines of app b: Fly API: list_machines for app b answered 503: down".into(),
                        kind: "status".into(),
                        last_listed_at,
                    }),
                ),
            ],
            machines: Vec::new(),
            slots: Default::default(),
            halts: Default::default(),
            gate: Default::default(),
        }
    }

    fn input(now: DateTime<Utc>) -> FleetAlertInput<'static> {
        FleetAlertInput {
            coherence: None,
            last_sweep_success: Some(now),
            consecutive_sweep_failures: 0,
            last_tip_fetch: Some(now),
            tip_commit: None,
        }
    }

    fn unlistable(alerts: &[Alert]) -> Vec<String> {
        alerts
            .iter()
            .filter(|a| a.kind == AlertKind::AppUnlistable)
            .map(|a| a.dedup_key().to_string())
            .collect()
    }

    #[test]
    fn app_unlistable_fires_after_three_intervals_and_resolves_when_listed() {
        let mut tracker = FleetAlertTracker::new(rules());
        tracker.observe_listings(&report(None));
        assert!(unlistable(&tracker.evaluate(&input(t(0)), t(0))).is_empty());
        // b's last listing was at t(0); it fails from the next sweep on.
        for s in [30, 60, 90] {
            tracker.observe_listings(&report(Some(Some(t(0)))));
            assert!(
                unlistable(&tracker.evaluate(&input(t(s)), t(s))).is_empty(),
                "{s}"
            );
        }
        tracker.observe_listings(&report(Some(Some(t(0)))));
        let firing = tracker.evaluate(&input(t(120)), t(120));
        assert_eq!(
            unlistable(&firing),
            ["fleet-reconciler/app_unlistable/b/*/*"]
        );
        let alert = firing
            .iter()
            .find(|a| a.kind == AlertKind::AppUnlistable)
            .unwrap();
        assert_eq!(alert.severity, APP_UNLISTABLE_SEVERITY);
        assert!(
            alert.summary.contains("App b has not been listed for 2m"),
            "{}",
            alert.summary
        );
        assert!(alert.summary.contains("503"), "{}", alert.summary);
        assert_eq!(alert.details["last_listed"], "2027-01-15T08:00:00Z");
        assert_eq!(alert.details["kind"], "status");
        // A failed sweep lists nothing: the alert holds.
        assert_eq!(
            unlistable(&tracker.evaluate(&input(t(150)), t(150))),
            ["fleet-reconciler/app_unlistable/b/*/*"]
        );
        // Listed again: resolved at once.
        tracker.observe_listings(&report(None));
        assert!(unlistable(&tracker.evaluate(&input(t(180)), t(180))).is_empty());
    }

    #[test]
    fn an_app_never_listed_counts_from_the_start() {
        let mut tracker = FleetAlertTracker::new(rules());
        tracker.observe_listings(&report(Some(None)));
        assert!(unlistable(&tracker.evaluate(&input(t(0)), t(0))).is_empty());
        assert!(unlistable(&tracker.evaluate(&input(t(90)), t(90))).is_empty());
        let firing = tracker.evaluate(&input(t(91)), t(91));
        assert_eq!(unlistable(&firing).len(), 1);
        let alert = &firing[0];
        assert_eq!(alert.details["last_listed"], "never");
        assert!(
            alert.summary.contains("its machines are unknown"),
            "{}",
            alert.summary
        );
    }

    fn alert_rules() -> AlertRules {
        AlertRules {
            fleet: rules(),
            restored_grace: Duration::from_secs(150),
            coordinator: "coord/c1".parse().ok(),
        }
    }

    fn swept<'a>(report: &'a Snapshot, plan: &'a Plan) -> Turn<'a> {
        Turn::Swept {
            report,
            plan,
            tip_fetched_at: Some(t(0)),
            failing_sinks: &[],
        }
    }

    fn of_kind(set: &AlertSet, kind: AlertKind) -> Vec<&Alert> {
        set.alerts.iter().filter(|a| a.kind == kind).collect()
    }

    /// The slot set unknown for 3 sweep intervals (unreadable or tampered
    /// alike) fires `coordinator_unreadable`, as the planner raised it
    /// before (#35): dated from the first sweep that could not read it,
    /// naming the coordinator; carried over a failed sweep (nothing new is
    /// known of the slots), resolved by the first sweep that reads them.
    #[test]
    fn coordinator_unreadable_fires_after_three_sweep_intervals_of_an_unknown_slot_set() {
        let mut memory = AlertMemory::new(&alert_rules(), &[]);
        let plan = Plan::default();
        let mut unknown = report(None);
        unknown.slots = SlotsView::Unknown("coordinator host unreachable".into());
        let mut tampered = report(None);
        tampered.slots = SlotsView::Tampered("not sealed".into());
        let mut known = report(None);
        known.slots = SlotsView::Known(Default::default());
        let coordinator = |set: &AlertSet| of_kind(set, AlertKind::CoordinatorUnreadable).len();

        assert_eq!(
            coordinator(&evaluate(swept(&known, &plan), &mut memory, t(0))),
            0
        );
        for s in [30, 60, 90] {
            let set = evaluate(swept(&unknown, &plan), &mut memory, t(s));
            assert_eq!(coordinator(&set), 0, "{s}");
        }
        // Tampered counts as unknown: the clock goes on from t(30).
        let set = evaluate(swept(&tampered, &plan), &mut memory, t(120));
        let fired = of_kind(&set, AlertKind::CoordinatorUnreadable);
        assert_eq!(fired.len(), 1, "{set:?}");
        let alert = fired[0];
        assert_eq!(alert.severity, COORDINATOR_UNREADABLE_SEVERITY);
        assert_eq!(
            alert.dedup_key().as_str(),
            "fleet-reconciler/coordinator_unreadable/*/*/*"
        );
        assert_eq!(
            alert.summary,
            "the rotation slots cannot be read since 2027-01-15T08:00:30+00:00 (not sealed): no rotation starts, drains or restarts; undos go on"
        );
        assert_eq!(
            alert.details,
            BTreeMap::from([
                ("coordinator".to_owned(), "coord/c1".to_owned()),
                ("since".to_owned(), "2027-01-15T08:00:30+00:00".to_owned()),
            ])
        );
        let failed = Turn::Failed {
            tip_fetched_at: Some(t(0)),
            failing_sinks: &[],
        };
        assert_eq!(coordinator(&evaluate(failed, &mut memory, t(150))), 1);
        assert_eq!(
            coordinator(&evaluate(swept(&known, &plan), &mut memory, t(180))),
            0
        );
        // Known again: a new episode counts afresh.
        let set = evaluate(swept(&unknown, &plan), &mut memory, t(210));
        assert_eq!(coordinator(&set), 0);
        let set = evaluate(swept(&unknown, &plan), &mut memory, t(299));
        assert_eq!(coordinator(&set), 0);
        let set = evaluate(swept(&unknown, &plan), &mut memory, t(300));
        assert_eq!(coordinator(&set), 1);
    }

    /// Which webhooks fail is the notifier's fact; `alert_sink_failing`
    /// is decided here, one alert naming them all, in each turn's set
    /// (swept or failed) while any fails, with the text the notifier used
    /// to write itself (#35 item 2).
    #[test]
    fn alert_sink_failing_is_raised_from_the_turns_delivery_state() {
        let mut memory = AlertMemory::new(&alert_rules(), &[]);
        let failing = [
            FailingSink {
                index: 0,
                format: "slack",
                url_env: "GONE_URL".into(),
                since: t(5),
                reason: "HTTP 410".into(),
                dead_letters: 1,
            },
            FailingSink {
                index: 2,
                format: "json",
                url_env: "HOOK_URL".into(),
                since: t(7),
                reason: "HTTP 404".into(),
                dead_letters: 2,
            },
        ];
        let failed = |failing_sinks| Turn::Failed {
            tip_fetched_at: Some(t(0)),
            failing_sinks,
        };
        let set = evaluate(failed(&failing[..]), &mut memory, t(10));
        let fired = of_kind(&set, AlertKind::SinkFailing);
        assert_eq!(fired.len(), 1, "{set:?}");
        let alert = fired[0];
        assert_eq!(
            alert.dedup_key().as_str(),
            "fleet-reconciler/alert_sink_failing/*/*/*"
        );
        assert_eq!(alert.dedup_key(), sink_failing_key());
        assert_eq!(alert.severity, SINK_FAILING_SEVERITY);
        assert_eq!(
            alert.summary,
            "Alerts are not reaching every webhook: webhook 0 (slack, URL in GONE_URL) has failed since 2027-01-15T08:00:05Z: HTTP 410; 1 notification(s) dead-lettered; webhook 2 (json, URL in HOOK_URL) has failed since 2027-01-15T08:00:07Z: HTTP 404; 2 notification(s) dead-lettered. The other webhooks still get everything; fix the receiver or its URL (then restart)"
        );
        assert_eq!(
            alert.details,
            BTreeMap::from([
                ("dead_letters".to_owned(), "3".to_owned()),
                (
                    "sinks".to_owned(),
                    "0:slack:GONE_URL,2:json:HOOK_URL".to_owned()
                ),
            ])
        );
        let plan = Plan::default();
        let listed = report(None);
        let swept_failing = Turn::Swept {
            report: &listed,
            plan: &plan,
            tip_fetched_at: Some(t(0)),
            failing_sinks: &failing[1..],
        };
        let set = evaluate(swept_failing, &mut memory, t(40));
        assert_eq!(of_kind(&set, AlertKind::SinkFailing).len(), 1);
        // Delivered again: resolved.
        let set = evaluate(swept(&listed, &plan), &mut memory, t(70));
        assert!(of_kind(&set, AlertKind::SinkFailing).is_empty(), "{set:?}");
    }

    /// A new condition: the test-only `AlertKind::ExampleCondition`, one
    /// entry in the table of `alerts/kinds.rs`, and its rule, written here
    /// as a new one would be. Nothing else was written for it: its event
    /// names, key, state-file name and properties all come from the entry.
    #[test]
    fn a_new_condition_is_its_table_entry_and_its_rule() {
        fn example_rule(holds: bool) -> Option<Alert> {
            holds.then(|| {
                fleet_alert(
                    AlertKind::ExampleCondition,
                    Severity::High,
                    "the example holds".to_owned(),
                    BTreeMap::new(),
                )
            })
        }
        assert!(example_rule(false).is_none());
        let alert = example_rule(true).expect("it holds");
        assert_eq!(
            alert.dedup_key().as_str(),
            "fleet-reconciler/example_condition/*/*/*"
        );
        assert_eq!(alert.kind.to_string(), "example_condition");
        assert_eq!(alert.kind.resolve_name(), "example_condition_resolved");
        let saved = serde_json::to_string(&alert).expect("an alert serializes");
        let read: Alert = serde_json::from_str(&saved).expect("and reads back");
        assert_eq!(read, alert);
        assert!(AlertKind::ALL.contains(&AlertKind::ExampleCondition));
        // Its properties are its entry's: about what this replica sees, not
        // grouped, like most fleet conditions.
        assert!(!alert.kind.is_own() && !alert.kind.is_grouped());
        // Every kind's two names are its own: no key or event is shared.
        let mut names = std::collections::BTreeSet::new();
        for kind in AlertKind::ALL {
            for name in [kind.trigger_name(), kind.resolve_name()] {
                assert!(names.insert(name), "{name} named twice");
                assert!(
                    name.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                    "{name}"
                );
            }
        }
    }

    fn machine_alert(app: &str, machine: &str) -> Alert {
        Alert {
            kind: AlertKind::Drift,
            app: Some(app.into()),
            machine_id: Some(machine.into()),
            commit: None,
            severity: Severity::High,
            summary: format!("{machine} drifted"),
            details: BTreeMap::new(),
        }
    }

    fn machines(set: &AlertSet) -> Vec<String> {
        set.alerts
            .iter()
            .filter_map(|a| a.machine_id.as_ref().map(ToString::to_string))
            .collect()
    }

    /// A failed sweep carries every machine alert known last; a sweep that
    /// cannot list an app carries that app's, and only those.
    #[test]
    fn machine_alerts_are_carried_over_failed_sweeps_and_unlisted_apps() {
        let mut memory = AlertMemory::new(&alert_rules(), &[]);
        let mut both = Plan::default();
        both.alerts = vec![machine_alert("a", "m-a"), machine_alert("b", "m-b")];
        let none = Plan::default();
        let listed = report(None);
        let set = evaluate(swept(&listed, &both), &mut memory, t(0));
        assert_eq!(machines(&set), ["m-a", "m-b"]);
        let failed = Turn::Failed {
            tip_fetched_at: Some(t(0)),
            failing_sinks: &[],
        };
        assert_eq!(
            machines(&evaluate(failed, &mut memory, t(30))),
            ["m-a", "m-b"]
        );
        // b cannot be listed: the planner says nothing of its machines.
        let b_unlisted = report(Some(Some(t(0))));
        let set = evaluate(swept(&b_unlisted, &none), &mut memory, t(60));
        assert_eq!(machines(&set), ["m-b"]);
        let set = evaluate(swept(&listed, &none), &mut memory, t(90));
        assert!(set.alerts.is_empty(), "{set:?}");
    }
}

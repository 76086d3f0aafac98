//! The reporter: turns each cycle's outcome into everything that reports it.
//!
//! Owns what is carried from one sweep to the next for reporting only: the
//! machines' rotation history ([`History`]), the machine alerts carried over
//! a failed sweep or an unlistable app, the restored alerts until this run's
//! evidence settles them, the fleet alert clocks, the delivery counts already
//! moved into metrics, and each machine's last kind of decision (a change is
//! logged). It feeds the Prometheus series, the server's view and the
//! notifier. It must never decide anything the planner decides nor act on a
//! machine, and never read the clock: every time comes with the outcome.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};

use crate::act::executor::StepReport;
use crate::config::Config;
use crate::daemon::{Cycle, SweepOutcome};
use crate::decide::decision::Decision;
use crate::decide::planner::Plan;
use crate::decide::snapshot::Snapshot;
use crate::events::{ActionEvent, Alert};
use crate::model::{AppName, MachineId, PoolName};
use crate::report::history::History;
use crate::report::metrics::Metrics;
use crate::report::notify::{
    CoherenceSample, FleetAlertInput, FleetAlertRules, FleetAlertTracker, Notifier,
    RestoredMachineAlerts,
};
use crate::report::server::{FleetView, MachineExtra};

/// All alerts of a cycle: the machine alerts known last, then the fleet's.
/// (The notifier logs each alert as it starts firing and as it clears.)
fn with_machine_alerts(machine: &[Alert], fleet: Vec<Alert>) -> Vec<Alert> {
    machine.iter().cloned().chain(fleet).collect()
}

/// Turns cycle outcomes into metrics, the server's view and notifications.
pub struct Reporter<'a> {
    metrics: &'a Metrics,
    view: &'a FleetView,
    notifier: &'a Notifier,
    fleet_alerts: FleetAlertTracker,
    last_success: Option<DateTime<Utc>>,
    failures: u32,
    history: History,
    /// Each machine's decision kind in the last sweep: a change is logged.
    decision_kinds: HashMap<MachineId, &'static str>,
    /// The planner's machine alerts of the last successful sweep. A failed
    /// sweep knows nothing new about machines, so they are carried over:
    /// sending only the fleet alerts would resolve every drift alert, and
    /// page again once sweeps recover. Likewise, per app, for the apps a
    /// successful sweep could not list.
    machine_alerts: Vec<Alert>,
    /// Machine alerts from before a restart, until the planner has caught up.
    restored: RestoredMachineAlerts,
    /// Per webhook: (delivered, failed attempts, dropped, dead-lettered) already counted.
    counted: HashMap<usize, (u64, u64, u64, u64)>,
    /// Per Alertmanager: (posts accepted, failed posts) already counted.
    counted_alertmanagers: HashMap<usize, (u64, u64)>,
    /// Failed writes of the alert state file already counted.
    state_write_failures: u64,
}

impl<'a> Reporter<'a> {
    /// A reporter for a run of `config` that starts now: alerts firing
    /// before a restart (the notifier's saved state) keep firing until this
    /// run's evidence confirms or clears them, since the planner's drift
    /// clocks start over.
    pub fn new(
        config: &Config,
        metrics: &'a Metrics,
        view: &'a FleetView,
        notifier: &'a Notifier,
    ) -> Reporter<'a> {
        let mut fleet_alerts = FleetAlertTracker::new(FleetAlertRules::from_config(config));
        fleet_alerts.restore(notifier.restored_alerts());
        let restored = RestoredMachineAlerts::new(
            notifier.restored_alerts(),
            config.rotation.min_drift_age + config.sweep.interval.get() * 2,
        );
        Reporter {
            metrics,
            view,
            notifier,
            fleet_alerts,
            last_success: None,
            failures: 0,
            history: History::default(),
            decision_kinds: HashMap::new(),
            // Until the first good sweep, what was known before the restart.
            machine_alerts: restored.carried(),
            restored,
            counted: HashMap::new(),
            counted_alertmanagers: HashMap::new(),
            state_write_failures: 0,
        }
    }

    /// Reports one turn of the loop.
    pub fn report(&mut self, outcome: &SweepOutcome) {
        self.count_deliveries();
        match outcome {
            SweepOutcome::Swept(cycle) => self.swept(cycle),
            SweepOutcome::Failed {
                error,
                kind,
                tip_fetched_at,
                at,
            } => {
                let now = *at;
                self.failures += 1;
                self.metrics.record_sweep_failure(kind);
                self.view.record_failure(error.clone(), now);
                let alerts = self.fleet_alerts.evaluate(
                    &FleetAlertInput {
                        coherence: None,
                        last_sweep_success: self.last_success,
                        consecutive_sweep_failures: self.failures,
                        last_tip_fetch: *tip_fetched_at,
                        tip_commit: None,
                    },
                    now,
                );
                self.notifier
                    .update(&with_machine_alerts(&self.machine_alerts, alerts), &[], now);
            }
        }
    }

    /// Moves the notifier's delivery counts into `fleet_reconciler_webhook_deliveries_total`,
    /// and its dead letters and state-file health into their series.
    fn count_deliveries(&mut self) {
        for sink in self.notifier.stats() {
            let seen = self.counted.entry(sink.index).or_default();
            let now = (
                sink.delivered,
                sink.failed_attempts,
                sink.dropped,
                sink.dead_lettered,
            );
            for (result, new, old) in [
                ("delivered", now.0, seen.0),
                ("failed", now.1, seen.1),
                ("dropped", now.2, seen.2),
                ("dead_lettered", now.3, seen.3),
            ] {
                if new > old {
                    self.metrics
                        .add_webhook_deliveries(sink.format, result, new - old);
                }
            }
            *seen = now;
            self.metrics
                .set_webhook_sink(sink.index, sink.format, sink.dead_letters, sink.failing);
        }
        // Alertmanager posts count as deliveries of format "alertmanager".
        for am in self.notifier.alertmanager_stats() {
            let seen = self.counted_alertmanagers.entry(am.index).or_default();
            let now = (am.delivered, am.failed_attempts);
            for (result, new, old) in [("delivered", now.0, seen.0), ("failed", now.1, seen.1)] {
                if new > old {
                    self.metrics
                        .add_webhook_deliveries("alertmanager", result, new - old);
                }
            }
            *seen = now;
        }
        let failures = self.notifier.state_write_failures();
        if failures > self.state_write_failures {
            self.metrics
                .add_alert_state_write_failures(failures - self.state_write_failures);
            self.state_write_failures = failures;
        }
    }

    /// One INFO line per sweep summarizing the machines whose kind of
    /// decision changed (a machine first seen on the tip is not news): how
    /// many now have each kind. Each changed machine is a DEBUG line, so a
    /// log search for a machine id still tells its story at debug, and a
    /// release reaching 10,000 machines is one line at info, not 10,000.
    fn log_decisions(&mut self, plan: &Plan) {
        let mut next = HashMap::with_capacity(plan.machines.len());
        let mut changed: BTreeMap<&'static str, usize> = BTreeMap::new();
        for (id, d) in plan.machines.iter().map(|(id, m)| (id, &m.decision)) {
            let kind = d.kind();
            let before = self.decision_kinds.get(id).copied();
            if before != Some(kind) && !(before.is_none() && *d == Decision::OnTip) {
                tracing::debug!(machine = %id, decision = kind, was = before.unwrap_or("-"), "{d}");
                *changed.entry(kind).or_default() += 1;
            }
            next.insert(id.clone(), kind);
        }
        self.decision_kinds = next;
        if !changed.is_empty() {
            let total: usize = changed.values().sum();
            let counts = changed
                .iter()
                .map(|(kind, n)| format!("{kind}={n}"))
                .collect::<Vec<_>>()
                .join(" ");
            tracing::info!(changed = total, decisions = %counts, "decisions changed this sweep (each machine at DEBUG)");
        }
    }

    /// Reports a successful sweep, one phase each: its metrics, its steps
    /// (counted, kept in the history), the machines' extras, its alerts,
    /// then the server's view.
    fn swept(&mut self, cycle: &Cycle) {
        let Cycle {
            report, steps, now, ..
        } = cycle;
        self.failures = 0;
        self.last_success = Some(*now);
        self.record_sweep_metrics(cycle);
        let events = self.record_steps(report, steps, *now);
        let extras = self.extras(report, &cycle.plan);
        self.alert(cycle, &events);
        self.view.set_tip(&report.tip.commit);
        self.view.set_extras(extras);
        self.view.record_sweep(report.clone(), *now);
    }

    /// The sweep's series: its figures, the tip's fetch, the rotations in
    /// progress and the decisions (each decision change logged).
    fn record_sweep_metrics(&mut self, cycle: &Cycle) {
        let Cycle {
            report,
            plan,
            duration,
            tip_fetched_at,
            now,
            ..
        } = cycle;
        self.metrics.record_sweep(report, *duration, *now);
        if let Some(at) = *tip_fetched_at {
            self.metrics.record_tip_fetched(at);
        }
        // Every pool that has machines, zeros included, so the series stay.
        let mut pools: BTreeMap<(&AppName, &PoolName), usize> = report
            .machines
            .iter()
            .map(|m| ((&m.seen.app, &m.seen.pool), 0))
            .collect();
        for ((app, pool), n) in &plan.rotations_in_progress {
            pools.insert((app, pool), *n);
        }
        let rotations: Vec<(&AppName, &PoolName, usize)> =
            pools.into_iter().map(|((a, p), n)| (a, p, n)).collect();
        self.metrics.set_rotations_in_progress(&rotations);
        self.log_decisions(plan);
        self.metrics
            .set_decisions(report.machines.iter().filter_map(|m| {
                plan.decision(&m.seen.machine_id)
                    .map(|d| (m.seen.app.as_str(), d))
            }));
    }

    /// Counts each step taken and records it in the history (machines gone
    /// from `report` are forgotten); the steps' events, for the notifier.
    fn record_steps(
        &mut self,
        report: &Snapshot,
        steps: &[StepReport],
        now: DateTime<Utc>,
    ) -> Vec<ActionEvent> {
        let mut events = Vec::new();
        for s in steps {
            self.metrics.record_action(
                &s.step.target.app,
                &s.step.target.pool,
                s.step.kind(),
                s.outcome.result(),
            );
            events.extend(s.events.iter().cloned());
        }
        self.history.record(steps, now);
        // Forget machines that are gone.
        let listed: HashSet<&MachineId> =
            report.machines.iter().map(|m| &m.seen.machine_id).collect();
        self.history.retain(|id| listed.contains(id));
        events
    }

    /// What the server shows of each machine beyond its row: its decision,
    /// its history, its drift clock (none for a machine with none of them).
    fn extras(&self, report: &Snapshot, plan: &Plan) -> BTreeMap<MachineId, MachineExtra> {
        let mut extras = BTreeMap::new();
        for m in &report.machines {
            let extra = MachineExtra {
                decision: plan.decision(&m.seen.machine_id).cloned(),
                history: self
                    .history
                    .of(&m.seen.machine_id)
                    .cloned()
                    .unwrap_or_default(),
                drift_since: plan.drift_since(&m.seen.machine_id),
            };
            if extra != MachineExtra::default() {
                extras.insert(m.seen.machine_id.clone(), extra);
            }
        }
        extras
    }

    /// The fleet's alerts and the machines' (the plan's, those carried for
    /// apps this sweep could not list, restored ones not yet settled), sent
    /// to the notifier with the steps' events.
    fn alert(&mut self, cycle: &Cycle, events: &[ActionEvent]) {
        let Cycle {
            report,
            plan,
            tip_fetched_at,
            now,
            ..
        } = cycle;
        let now = *now;
        let sample = CoherenceSample::of(report, now);
        self.fleet_alerts.observe_listings(report);
        let fleet = self.fleet_alerts.evaluate(
            &FleetAlertInput {
                coherence: Some(&sample),
                last_sweep_success: Some(now),
                consecutive_sweep_failures: 0,
                last_tip_fetch: *tip_fetched_at,
                tip_commit: Some(report.tip.commit.as_str()),
            },
            now,
        );
        // Nothing new is known of the machines of an app this sweep could not
        // list (the planner says nothing of them): their alerts stand.
        let stale = report.stale_app_names();
        let mut alerts: Vec<Alert> = plan.alerts.clone();
        alerts.extend(
            self.machine_alerts
                .iter()
                .filter(|a| {
                    a.app
                        .as_ref()
                        .is_some_and(|app| stale.contains(app.as_str()))
                })
                .cloned(),
        );
        // Alerts from before a restart, until this run's evidence settles them.
        let restored = self.restored.after_sweep(report, &alerts, now);
        alerts.extend(restored);
        self.machine_alerts = alerts;
        self.notifier.update(
            &with_machine_alerts(&self.machine_alerts, fleet),
            events,
            now,
        );
    }
}

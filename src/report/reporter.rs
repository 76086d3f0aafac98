//! The reporter: turns each cycle's outcome into everything that reports it.
//!
//! Owns what is carried from one sweep to the next for reporting only: the
//! machines' rotation history ([`History`]), each machine's last kind of
//! decision (a change is logged), and whether the coordinator was readable
//! (a change is logged). It feeds the Prometheus series, the server's view
//! and the notifier (which counts its deliveries itself) with each turn's
//! `AlertSet` as the loop evaluated it ([`crate::decide::alerts`]: which
//! alerts hold, carried and restored ones included, and how old the view
//! they were drawn from is). It must never decide an alert or anything the
//! planner decides, nor act on a machine, and never read the clock: every
//! time comes with the outcome.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use chrono::{DateTime, Utc};

use crate::act::executor::StepReport;
use crate::daemon::{Cycle, SweepOutcome};
use crate::decide::decision::{Decision, HALTED};
use crate::decide::planner::Plan;
use crate::decide::snapshot::Snapshot;
use crate::events::ActionEvent;
use crate::model::{AppName, MachineId, PoolName};
use crate::report::history::History;
use crate::report::metrics::Metrics;
use crate::report::notify::Notifier;
use crate::report::server::{FleetView, MachineExtra};

/// Turns cycle outcomes into metrics, the server's view and notifications.
pub struct Reporter<'a> {
    metrics: &'a Metrics,
    view: &'a FleetView,
    notifier: &'a Notifier,
    history: History,
    /// Each machine's decision kind in the last sweep: a change is logged.
    decision_kinds: HashMap<MachineId, &'static str>,
    /// Whether the last successful sweep could not read the coordinator's
    /// slot set: the change is logged once, not every sweep.
    coordinator_unreadable: bool,
}

impl<'a> Reporter<'a> {
    /// A reporter for a run that starts now.
    pub fn new(metrics: &'a Metrics, view: &'a FleetView, notifier: &'a Notifier) -> Reporter<'a> {
        Reporter {
            metrics,
            view,
            notifier,
            history: History::default(),
            decision_kinds: HashMap::new(),
            coordinator_unreadable: false,
        }
    }

    /// Reports one turn of the loop.
    pub fn report(&mut self, outcome: &SweepOutcome) {
        self.publish_sinks();
        match outcome {
            // Only the view: the sweep is counted and alerted on with its steps.
            SweepOutcome::Observed { report, at } => {
                self.view.set_tip(&report.tip.commit);
                self.view.record_observed((**report).clone(), *at);
            }
            SweepOutcome::Swept(cycle) => self.swept(cycle),
            // Steps whose turn was overtaken by newer sweeps: counted and
            // kept in the history, their events sent with the alerts as
            // the newest sweep left them.
            SweepOutcome::Acted { steps, at, alerts } => {
                let events = self.record_steps(steps, *at);
                self.notifier
                    .update_seen(&alerts.alerts, &events, *at, &alerts.seen);
            }
            SweepOutcome::Failed {
                error,
                kind,
                at,
                alerts,
                ..
            } => {
                let now = *at;
                self.metrics.record_sweep_failure(kind);
                self.view.record_failure(error.clone(), now);
                self.notifier
                    .update_seen(&alerts.alerts, &[], now, &alerts.seen);
            }
        }
    }

    /// Publishes each webhook's dead letters kept and whether it is
    /// failing (the notifier counts deliveries itself, as they happen).
    fn publish_sinks(&self) {
        for sink in self.notifier.stats() {
            self.metrics
                .set_webhook_sink(sink.index, sink.format, sink.dead_letters, sink.failing);
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
        self.record_sweep_metrics(cycle);
        let events = self.record_steps(steps, *now);
        self.forget_gone(report);
        let extras = self.extras(report, &cycle.plan);
        // The cycle's alerts, as the loop evaluated them, with its events.
        let alerts = &cycle.alerts;
        self.notifier
            .update_seen(&alerts.alerts, &events, *now, &alerts.seen);
        self.log_coordinator(report);
        self.view.set_tip(&report.tip.commit);
        self.view.set_extras(extras);
        self.view.record_sweep(report.clone(), *now);
    }

    /// One WARN line when the coordinator's slot set becomes unreadable
    /// (then `/readyz` is not ready and `coordinator_unreadable` follows),
    /// one INFO line when it is read again.
    fn log_coordinator(&mut self, report: &Snapshot) {
        let unreadable = report.slots.unreadable();
        match (unreadable, self.coordinator_unreadable) {
            (Some(why), false) => tracing::warn!(
                reason = why,
                "the coordinator's slot set cannot be read: no rotation starts, drains or restarts (undos go on); /readyz is not ready until it can"
            ),
            (None, true) => tracing::info!("the coordinator's slot set is readable again"),
            _ => {}
        }
        self.coordinator_unreadable = unreadable.is_some();
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
        let mut held: BTreeSet<(&str, &str, &str)> = plan
            .guards
            .iter()
            .map(|((app, pool), g)| (app.as_str(), pool.as_str(), g.reason()))
            .collect();
        // A halt is decided per machine, not a pool guard: a pool with a
        // machine it holds is held (as the per-pool summary counts it). It
        // has no time, so no `until` series below.
        held.extend(
            report
                .machines
                .iter()
                .filter(|m| {
                    matches!(
                        plan.decision(&m.seen.machine_id),
                        Some(Decision::Halted { .. })
                    )
                })
                .map(|m| (m.seen.app.as_str(), m.seen.pool.as_str(), HALTED)),
        );
        self.metrics.set_guardrails(
            rotations.iter().map(|(a, p, _)| (a.as_str(), p.as_str())),
            &held,
        );
        let until: BTreeMap<(&str, &str, &str), DateTime<Utc>> = plan
            .guards
            .iter()
            .filter_map(|((app, pool), g)| {
                g.until()
                    .map(|t| ((app.as_str(), pool.as_str(), g.reason()), t))
            })
            .collect();
        self.metrics.set_guardrail_until(&until);
    }

    /// Counts each step taken and records it in the history; the steps'
    /// events, for the notifier.
    fn record_steps(&mut self, steps: &[StepReport], now: DateTime<Utc>) -> Vec<ActionEvent> {
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
        events
    }

    /// Forgets the history of machines gone from `report`.
    fn forget_gone(&mut self, report: &Snapshot) {
        let listed: HashSet<&MachineId> =
            report.machines.iter().map(|m| &m.seen.machine_id).collect();
        self.history.retain(|id| listed.contains(id));
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
}

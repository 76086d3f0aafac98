//! The `run` command: the reconcile loop wired to metrics, the HTTP server
//! and the notifier, with graceful shutdown.
//!
//! Owns the glue between one cycle's outcome and everything that reports it:
//! Prometheus series, the status page and API, webhook alerts (the planner's
//! machine alerts plus the fleet-level ones), and one structured log line per
//! action. It must never decide anything the planner decides, and never read
//! the environment: secrets arrive in `ServiceSecrets`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use secrecy::{ExposeSecret, SecretString};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::act::executor::{Executor, ExecutorConfig};
use crate::act::operator::Operator;
use crate::clock::SharedClock;
use crate::config::Config;
use crate::daemon::{self, Cycle, LoopOptions, Secrets, SetupError, SweepOutcome};
use crate::decide::decision::Decision;
use crate::events::Alert;
use crate::model::MachineId;
use crate::report::metrics::{Metrics, MetricsError};
use crate::report::notify::{
    CoherenceSample, FleetAlertInput, FleetAlertRules, FleetAlertTracker, Notifier,
    NotifierOptions, NotifyError, RestoredMachineAlerts, SinkSecrets,
};
use crate::report::server::{self, FleetView, MachineExtra, ServerLimits, ServerState};

/// Secrets for `run`, read from the environment by `main`; `Debug` shows
/// none of them (secrecy, and `SinkSecrets`' own redaction).
#[derive(Clone, Debug, Default)]
pub struct ServiceSecrets {
    pub core: Secrets,
    /// App name → bearer token for its agents' cooperative endpoints.
    pub agent_tokens: HashMap<String, SecretString>,
    pub admin_token: Option<SecretString>,
    /// One per `[[alerts.webhooks]]`, in order.
    pub webhooks: Vec<SinkSecrets>,
    /// The URL of each `[[alerts.alertmanager]]`, in order.
    pub alertmanagers: Vec<SecretString>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("cannot set up metrics: {0}")]
    Metrics(#[from] MetricsError),
    #[error("cannot set up webhooks: {0}")]
    Notify(#[from] NotifyError),
    #[error(transparent)]
    Executor(#[from] crate::act::executor::ExecutorBuildError),
    #[error("HTTP server failed: {0}")]
    Server(#[source] std::io::Error),
}

/// Lines of rotation history kept per machine for the API.
const HISTORY_LINES: usize = 20;

/// Runs the daemon until `shutdown`; serves HTTP on `listener`. `observe`
/// sees every cycle after it has been reported (the demo prints it).
pub async fn run(
    config: Arc<Config>,
    secrets: ServiceSecrets,
    listener: TcpListener,
    owner: String,
    shutdown: CancellationToken,
    observe: impl FnMut(&SweepOutcome),
) -> Result<(), ServiceError> {
    run_with_clock(
        config,
        secrets,
        listener,
        owner,
        shutdown,
        crate::clock::system(),
        observe,
    )
    .await
}

/// [`run`] with the loop, executor and service reading `clock` (a test's
/// [`crate::clock::TokioClock`] on paused time).
pub async fn run_with_clock(
    config: Arc<Config>,
    secrets: ServiceSecrets,
    listener: TcpListener,
    owner: String,
    shutdown: CancellationToken,
    clock: SharedClock,
    mut observe: impl FnMut(&SweepOutcome),
) -> Result<(), ServiceError> {
    let metrics = Arc::new(Metrics::new_at(config.metrics.per_machine, clock.now())?);
    let mut sweeper = daemon::connect(config.clone(), &secrets.core).await?;
    sweeper.fly = sweeper.fly.clone().with_observer(metrics.fly_observer());
    sweeper.prober = sweeper
        .prober
        .clone()
        .with_observer(metrics.probe_observer());
    sweeper.overlay = sweeper
        .overlay
        .clone()
        .with_observer(metrics.git_fetch_observer());
    let executor = Executor::new(
        sweeper.fly.clone(),
        config.clone(),
        secrets.agent_tokens.clone(),
        ExecutorConfig {
            clock: clock.clone(),
            ..ExecutorConfig::new(&owner)
        },
    )?;
    // Alert state on the data volume: a restart neither re-pages what still
    // fires nor forgets to resolve what cleared, nor loses what was queued.
    let notifier = Notifier::with_sinks(
        &config.alerts,
        secrets.webhooks.clone(),
        secrets.alertmanagers.clone(),
        NotifierOptions {
            state_file: Some(config.alert_state_file()),
            clock: clock.clone(),
            public_url: config.server.public_url.clone(),
            ..NotifierOptions::default()
        },
    )?;
    let view = FleetView::new(config.sweep.interval.get(), clock.now());
    view.set_coherence_threshold(config.alerts.coherence_threshold);
    // A turn may wait out Fly calls and their retries (a slow API is not a
    // stuck loop).
    let fly_calls = config.fly.request_timeout.get() * (config.fly.max_retries + 1);
    view.update(|o| o.turn_allowance = fly_calls * 2 + config.probe.timeout.get());
    let state = ServerState::new(metrics.clone(), view.clone())
        .with_operator(Operator::new(sweeper.fly.clone(), &config))
        .with_admin_token(
            secrets
                .admin_token
                .as_ref()
                .map(|t| t.expose_secret().to_string()),
            &config.server.admin_token_env,
        )
        .with_limits(ServerLimits::from_config(&config.server))
        .with_clock(clock.clone());
    let refresh = state.refresh_requests();

    // The server and the notifier outlive the loop a little: the server stops
    // with it, the notifier flushes what the last cycle queued.
    let server_stop = CancellationToken::new();
    let server = tokio::spawn(server::serve(listener, state, server_stop.clone()));
    let notifier_stop = CancellationToken::new();
    let delivery = {
        let (n, stop) = (notifier.clone(), notifier_stop.clone());
        tokio::spawn(async move { n.run(stop).await })
    };

    tracing::info!(owner = %owner, apps = config.apps.len(), "fleet-reconciler running");
    // Alerts firing before a restart keep firing until this run's evidence
    // confirms or clears them (the planner's drift clocks start over).
    let mut fleet_alerts = FleetAlertTracker::new(FleetAlertRules::from_config(&config));
    fleet_alerts.restore(notifier.restored_alerts());
    let restored = RestoredMachineAlerts::new(
        notifier.restored_alerts(),
        config.rotation.min_drift_age + config.sweep.interval.get() * 2,
    );
    let mut reporter = Reporter {
        metrics: &metrics,
        view: &view,
        notifier: &notifier,
        fleet_alerts,
        last_success: None,
        failures: 0,
        history: HashMap::new(),
        decision_kinds: HashMap::new(),
        // Until the first good sweep, what was known before the restart.
        machine_alerts: restored.carried(),
        restored,
        counted: HashMap::new(),
        counted_alertmanagers: HashMap::new(),
        state_write_failures: 0,
    };
    let reconciling = daemon::reconcile_loop(
        &sweeper,
        LoopOptions {
            executor: Some(&executor),
            refresh: Some(refresh),
            owner: owner.clone(),
            clock,
        },
        shutdown.clone(),
        |outcome| {
            reporter.report(&outcome);
            observe(&outcome);
        },
    );
    // Fly kills a machine 5 s after SIGTERM by default: steps in flight get
    // a moment to finish their short calls and release their leases, then
    // are dropped. That is as safe as a crash, which the protocol is built
    // for: every marker was written before its action, and a lease not
    // released expires with its TTL.
    let steps_grace = async {
        shutdown.cancelled().await;
        tokio::time::sleep(SHUTDOWN_STEPS_GRACE).await;
    };
    tokio::select! {
        () = reconciling => {
            tracing::info!("shutting down: leases released, markers consistent");
        }
        () = steps_grace => tracing::warn!(
            grace = ?SHUTDOWN_STEPS_GRACE,
            "shutting down with steps still in flight: their markers are written and their leases expire with their TTL"
        ),
    }
    notifier_stop.cancel();
    if tokio::time::timeout(SHUTDOWN_FLUSH_GRACE, delivery)
        .await
        .is_err()
    {
        tracing::warn!("webhook deliveries still in flight at shutdown were cut short");
        // What was not delivered is kept for the next start.
        if let Err(e) = notifier.save() {
            tracing::warn!(error = %e, "cannot write the alert state file at shutdown");
        }
    }
    server_stop.cancel();
    match tokio::time::timeout(SHUTDOWN_SERVER_GRACE, server).await {
        Ok(Ok(result)) => result.map_err(ServiceError::Server),
        Ok(Err(_)) | Err(_) => Ok(()),
    }
}

/// How long, after shutdown is asked for, steps in flight may take, then
/// the webhook deliveries, then open HTTP requests: 4 s in all, inside the
/// 5 s Fly waits between SIGTERM and SIGKILL.
const SHUTDOWN_STEPS_GRACE: std::time::Duration = std::time::Duration::from_millis(2500);
const SHUTDOWN_FLUSH_GRACE: std::time::Duration = std::time::Duration::from_millis(1000);
const SHUTDOWN_SERVER_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// All alerts of a cycle: the machine alerts known last, then the fleet's.
/// (The notifier logs each alert as it starts firing and as it clears.)
fn with_machine_alerts(machine: &[Alert], fleet: Vec<Alert>) -> Vec<Alert> {
    machine.iter().cloned().chain(fleet).collect()
}

/// Turns cycle outcomes into metrics, the server's view and notifications.
struct Reporter<'a> {
    metrics: &'a Metrics,
    view: &'a FleetView,
    notifier: &'a Notifier,
    fleet_alerts: FleetAlertTracker,
    last_success: Option<DateTime<Utc>>,
    failures: u32,
    history: HashMap<MachineId, VecDeque<String>>,
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

impl Reporter<'_> {
    fn report(&mut self, outcome: &SweepOutcome) {
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
    fn log_decisions(&mut self, plan: &crate::decide::planner::Plan) {
        let mut next = HashMap::with_capacity(plan.machines.len());
        let mut changed: std::collections::BTreeMap<&'static str, usize> = Default::default();
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

    fn swept(&mut self, cycle: &Cycle) {
        let Cycle {
            report,
            plan,
            steps,
            duration,
            tip_fetched_at,
            now,
            ..
        } = cycle;
        let (duration, tip_fetched_at, now) = (*duration, *tip_fetched_at, *now);
        self.failures = 0;
        self.last_success = Some(now);

        self.metrics.record_sweep(report, duration, now);
        if let Some(at) = tip_fetched_at {
            self.metrics.record_tip_fetched(at);
        }
        // Every pool that has machines, zeros included, so the series stay.
        let mut pools: BTreeMap<(&str, &str), usize> = report
            .machines
            .iter()
            .map(|m| ((m.app.as_str(), m.pool.as_str()), 0))
            .collect();
        for ((app, pool), n) in &plan.rotations_in_progress {
            pools.insert((app.as_str(), pool.as_str()), *n);
        }
        let rotations: Vec<(&str, &str, usize)> =
            pools.into_iter().map(|((a, p), n)| (a, p, n)).collect();
        self.metrics.set_rotations_in_progress(&rotations);
        self.log_decisions(plan);
        self.metrics.set_decisions(
            report
                .machines
                .iter()
                .filter_map(|m| plan.decision(&m.machine_id).map(|d| (m.app.as_str(), d))),
        );

        let mut events = Vec::new();
        for s in steps {
            self.metrics.record_action(
                &s.step.target.app,
                &s.step.target.pool,
                s.step.kind(),
                s.outcome.result(),
            );
            let line = format!(
                "{} {} → {}",
                now.format("%Y-%m-%dT%H:%M:%SZ"),
                s.step,
                s.outcome
            );
            let h = self
                .history
                .entry(s.step.target.machine_id.clone())
                .or_default();
            h.push_back(line);
            while h.len() > HISTORY_LINES {
                h.pop_front();
            }
            events.extend(s.events.iter().cloned());
        }
        // Forget machines that are gone.
        self.history
            .retain(|id, _| report.machines.iter().any(|m| &m.machine_id == id));

        let mut extras = BTreeMap::new();
        for m in &report.machines {
            let extra = MachineExtra {
                decision: plan.decision(&m.machine_id).cloned(),
                history: self
                    .history
                    .get(&m.machine_id)
                    .map(|h| h.iter().cloned().collect())
                    .unwrap_or_default(),
                drift_since: plan.drift_since(&m.machine_id),
            };
            if extra != MachineExtra::default() {
                extras.insert(m.machine_id.clone(), extra);
            }
        }

        let sample = CoherenceSample::from_report(report);
        self.fleet_alerts.observe_listings(report);
        let fleet = self.fleet_alerts.evaluate(
            &FleetAlertInput {
                coherence: Some(&sample),
                last_sweep_success: Some(now),
                consecutive_sweep_failures: 0,
                last_tip_fetch: tip_fetched_at,
                tip_commit: Some(&report.tip.commit),
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
                .filter(|a| a.app.as_deref().is_some_and(|app| stale.contains(app)))
                .cloned(),
        );
        // Alerts from before a restart, until this run's evidence settles them.
        let restored = self.restored.after_sweep(report, &alerts, now);
        alerts.extend(restored);
        self.machine_alerts = alerts;
        self.notifier.update(
            &with_machine_alerts(&self.machine_alerts, fleet),
            &events,
            now,
        );

        self.view.set_tip(&report.tip.commit);
        self.view.set_extras(extras);
        self.view.record_sweep(report.clone(), now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_of_the_run_secrets_shows_none_of_them() {
        let secrets = ServiceSecrets {
            core: Secrets {
                fly_token: "fly-s3cret".into(),
                git_token: Some("git-s3cret".into()),
            },
            agent_tokens: HashMap::from([("app".to_string(), "agent-s3cret".into())]),
            admin_token: Some("admin-s3cret".into()),
            webhooks: vec![SinkSecrets {
                url: "https://hooks.example/url-s3cret".into(),
                routing_key: Some("routing-s3cret".into()),
                hmac_secret: Some("hmac-s3cret".into()),
            }],
            alertmanagers: vec!["https://am.example/am-s3cret".into()],
        };
        let shown = format!("{secrets:?} {secrets:#?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        // What is not secret still shows: which app has a token.
        assert!(shown.contains("app"), "{shown}");
    }
}

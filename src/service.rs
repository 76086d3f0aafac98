//! The `run` command: the reconcile loop wired to metrics, the HTTP server
//! and the notifier, with graceful shutdown.
//!
//! Owns the wiring and the lifecycle: it builds the sweeper, executor,
//! metrics, notifier (with its heartbeats) and server from one [`RunArgs`], hands each
//! cycle to [`Reporter`] (report/reporter.rs: what a cycle's outcome
//! becomes), tells the notifier of each successful sweep (its heartbeats
//! ping), and
//! shuts down in order within Fly's kill timeout. It must never decide
//! anything the planner decides nor turn an outcome into a report itself,
//! and never read the environment: secrets arrive in `ServiceSecrets`.

use std::collections::HashMap;
use std::sync::Arc;

use secrecy::{ExposeSecret, SecretString};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::act::executor::{Executor, ExecutorConfig};
use crate::act::operator::Operator;
use crate::clock::SharedClock;
use crate::config::Config;
use crate::daemon::{self, LoopOptions, Secrets, SetupError, SweepOutcome};
use crate::decide::policy::Policy;
use crate::observe::sweep::Sweeper;
use crate::report::metrics::{Metrics, MetricsError};
use crate::report::notify::{Notifier, NotifierOptions, NotifyError, SinkSecrets};
use crate::report::reporter::Reporter;
use crate::report::server::{self, FleetView, ServerLimits, ServerState};

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
    /// The ping URL of each `[[alerts.heartbeat]]`, in order.
    pub heartbeats: Vec<SecretString>,
    /// Alertmanager's URL for the alert gate (`gates.alertmanager.url_env`).
    pub gate_url: Option<SecretString>,
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

/// What [`run`] runs: the config, its secrets, where to serve HTTP, who this
/// reconciler is, when to stop, and the clock everything reads.
pub struct RunArgs {
    pub config: Arc<Config>,
    pub secrets: ServiceSecrets,
    pub listener: TcpListener,
    /// This reconciler's identity, written into markers.
    pub owner: String,
    pub shutdown: CancellationToken,
    /// The system clock, or a test's [`crate::clock::TokioClock`] on paused
    /// time; the loop, executor, notifier and server all read it.
    pub clock: SharedClock,
}

impl RunArgs {
    /// Arguments on the system clock.
    pub fn new(
        config: Arc<Config>,
        secrets: ServiceSecrets,
        listener: TcpListener,
        owner: String,
        shutdown: CancellationToken,
    ) -> RunArgs {
        RunArgs {
            config,
            secrets,
            listener,
            owner,
            shutdown,
            clock: crate::clock::system(),
        }
    }

    /// The same on `clock`.
    pub fn with_clock(self, clock: SharedClock) -> RunArgs {
        RunArgs { clock, ..self }
    }
}

/// Runs the daemon until `args.shutdown`; serves HTTP on `args.listener`.
/// `observe` sees every cycle after it has been reported (the demo prints it).
pub async fn run(
    args: RunArgs,
    mut observe: impl FnMut(&SweepOutcome),
) -> Result<(), ServiceError> {
    let RunArgs {
        config,
        secrets,
        listener,
        owner,
        shutdown,
        clock,
    } = args;
    let metrics = Arc::new(Metrics::new_at(config.metrics.per_machine, clock.now())?);
    let sweeper = connect_observed(&config, &secrets, &metrics).await?;
    // One policy for this config, shared by whoever decides on it.
    let policy = Arc::new(Policy::from_config(&config));
    let executor = Executor::new(
        sweeper.fly.clone(),
        config.clone(),
        policy.clone(),
        secrets.agent_tokens.clone(),
        ExecutorConfig {
            clock: clock.clone(),
            record_keys: secrets.core.record_keys.clone(),
            ..ExecutorConfig::new(&owner)
        },
    )?;
    let notifier = notifier(&config, &secrets, &clock, &metrics)?;
    let view = fleet_view(&config, &clock);
    let state = server_state(&config, &secrets, &metrics, &view, &sweeper, &clock);
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
    let mut reporter = Reporter::new(&metrics, &view, &notifier);
    let reconciling = daemon::reconcile_loop(
        &sweeper,
        LoopOptions {
            executor: Some(&executor),
            refresh: Some(refresh),
            owner: owner.clone(),
            clock,
            restored_alerts: notifier.restored_alerts().to_vec(),
            delivery: Some(&notifier),
        },
        shutdown.clone(),
        |outcome| {
            reporter.report(&outcome);
            // The dead-man's switch: only a sweep that listed machines
            // pings (one where no app could be listed is a failed sweep),
            // so the receiver pages when the daemon is gone or cannot sweep.
            if matches!(outcome, SweepOutcome::Swept(_)) {
                notifier.swept();
            }
            observe(&outcome);
            // The cycle (its report, plan and steps) is most of what a
            // sweep allocated: free it first, then hand the pages back.
            drop(outcome);
            crate::heap::return_freed_memory();
        },
    );
    reconcile_until_shutdown(reconciling, &shutdown).await;
    notifier_stop.cancel();
    flush_notifier(&notifier, delivery).await;
    server_stop.cancel();
    match tokio::time::timeout(SHUTDOWN_SERVER_GRACE, server).await {
        Ok(Ok(result)) => result.map_err(ServiceError::Server),
        Ok(Err(_)) | Err(_) => Ok(()),
    }
}

/// The sweeper, its Fly client, prober and overlay reporting to `metrics`.
async fn connect_observed(
    config: &Arc<Config>,
    secrets: &ServiceSecrets,
    metrics: &Metrics,
) -> Result<Sweeper, SetupError> {
    let mut sweeper = daemon::connect(config.clone(), &secrets.core).await?;
    sweeper.gate = daemon::alert_gate(config, secrets.gate_url.as_ref())?;
    sweeper.fly = sweeper.fly.clone().with_observer(metrics.fly_observer());
    sweeper.prober = sweeper
        .prober
        .clone()
        .with_observer(metrics.probe_observer());
    sweeper.overlay = sweeper
        .overlay
        .clone()
        .with_observer(metrics.git_fetch_observer());
    Ok(sweeper)
}

/// The notifier of `config.alerts`, its state kept on the data volume.
fn notifier(
    config: &Config,
    secrets: &ServiceSecrets,
    clock: &SharedClock,
    metrics: &Metrics,
) -> Result<Notifier, NotifyError> {
    // Alert state on the data volume: a restart neither re-pages what still
    // fires nor forgets to resolve what cleared, nor loses what was queued.
    metrics.init_heartbeats(config.alerts.heartbeats.len());
    Notifier::with_heartbeats(
        &config.alerts,
        secrets.webhooks.clone(),
        secrets.alertmanagers.clone(),
        secrets.heartbeats.clone(),
        NotifierOptions {
            state_file: Some(config.alert_state_file()),
            clock: clock.clone(),
            public_url: config.server.public_url.clone(),
            counter: metrics.delivery_counter(),
            ..NotifierOptions::default()
        },
    )
}

/// The view the server shows, with the thresholds it judges the loop by.
fn fleet_view(config: &Config, clock: &SharedClock) -> FleetView {
    let view = FleetView::new(config.sweep.interval.get(), clock.now());
    view.set_coherence_threshold(config.alerts.coherence_threshold);
    // A turn may wait out Fly calls and their retries (a slow API is not a
    // stuck loop).
    let fly_calls = config.fly.request_timeout.get() * (config.fly.max_retries + 1);
    view.update(|o| {
        o.turn_allowance = fly_calls * 2 + config.probe.timeout.get();
        o.stale_after = config.alerts.stale_after;
    });
    view
}

/// What the HTTP server serves: metrics, the view, the operator's commands
/// behind the admin token, within the configured limits.
fn server_state(
    config: &Config,
    secrets: &ServiceSecrets,
    metrics: &Arc<Metrics>,
    view: &FleetView,
    sweeper: &Sweeper,
    clock: &SharedClock,
) -> ServerState {
    ServerState::new(metrics.clone(), view.clone())
        .with_operator(Operator::new(
            sweeper.fly.clone(),
            config,
            secrets.core.record_keys.clone(),
        ))
        .with_admin_token(
            secrets
                .admin_token
                .as_ref()
                .map(|t| t.expose_secret().to_string()),
            &config.server.admin_token_env,
        )
        .with_limits(ServerLimits::from_config(&config.server))
        .with_clock(clock.clone())
}

/// Runs `reconciling` until it stops after `shutdown`, or until the steps'
/// grace is over.
async fn reconcile_until_shutdown(
    reconciling: impl std::future::Future<Output = ()>,
    shutdown: &CancellationToken,
) {
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
}

/// Waits a moment for the (stopped) notifier's deliveries; what they did
/// not deliver is saved for the next start.
async fn flush_notifier(notifier: &Notifier, delivery: tokio::task::JoinHandle<()>) {
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
}

/// How long, after shutdown is asked for, steps in flight may take, then
/// the webhook deliveries, then open HTTP requests: 4 s in all, inside the
/// 5 s Fly waits between SIGTERM and SIGKILL.
const SHUTDOWN_STEPS_GRACE: std::time::Duration = std::time::Duration::from_millis(2500);
const SHUTDOWN_FLUSH_GRACE: std::time::Duration = std::time::Duration::from_millis(1000);
const SHUTDOWN_SERVER_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_of_the_run_secrets_shows_none_of_them() {
        let secrets = ServiceSecrets {
            core: Secrets {
                fly_token: "fly-s3cret".into(),
                git_token: Some("git-s3cret".into()),
                record_keys: None,
            },
            agent_tokens: HashMap::from([("app".to_string(), "agent-s3cret".into())]),
            admin_token: Some("admin-s3cret".into()),
            webhooks: vec![SinkSecrets {
                url: "https://hooks.example/url-s3cret".into(),
                routing_key: Some("routing-s3cret".into()),
                hmac_secret: Some("hmac-s3cret".into()),
            }],
            alertmanagers: vec!["https://am.example/am-s3cret".into()],
            heartbeats: vec!["https://hc-ping.example/hb-s3cret".into()],
            gate_url: Some("https://am.example/gate-s3cret".into()),
        };
        let shown = format!("{secrets:?} {secrets:#?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        // What is not secret still shows: which app has a token.
        assert!(shown.contains("app"), "{shown}");
    }
}

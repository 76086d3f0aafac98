//! Wiring and the sweep loop: builds the observers from a config and secrets,
//! and runs sweeps on an interval until shutdown.
//!
//! Owns the lifecycle of a sweep (when to fetch the overlay, when to sweep,
//! what to keep when a fetch fails) and the memory a loop keeps across
//! sweeps (`LastListings`, the `Tracker`, which each turn passes to
//! `decide::prepare`, and the alert rules' `AlertMemory`): observe →
//! prepare → plan → act, and each turn's complete `AlertSet` from
//! `decide::alerts::evaluate`. It must never read the environment or the
//! clock for decisions beyond scheduling: secrets come in as `Secrets`, and
//! shutdown as a `CancellationToken`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use secrecy::SecretString;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::act::executor::{Executor, Outcome, StepReport};
use crate::clock::{Clock, SharedClock};
use crate::decide::alerts::{AlertMemory, AlertRules, AlertSet, DeliveryState, evaluate};
use crate::decide::listings::LastListings;
use crate::decide::planner::{self, FetchState, Plan, PlanInput, Tracker};
use crate::decide::policy::Policy;
use crate::decide::step::StepKind;
use crate::decide::{Snapshot, prepare, severity};

use crate::config::Config;
use crate::fly::{FlyClient, FlyClientBuildError, FlyClientConfig, FlyTokens};
use crate::observe::overlay::{Overlay, OverlayError, OverlaySource, Tip};
use crate::observe::probe::{ProbeBuildError, Prober};
use crate::observe::sweep::{Observation, SweepError, Sweeper};

/// Secrets read from the environment at the binary's edge; `Debug` shows
/// neither (secrecy), and they are exposed only where sent.
#[derive(Clone, Debug, Default)]
pub struct Secrets {
    /// The Fly token of each app ([`Config::fly_tokens`]); `"token".into()`
    /// is one token for every app.
    pub fly_token: FlyTokens,
    pub git_token: Option<SecretString>,
    /// The record keys (`[records] key_env`, `previous_key_env`): sealed
    /// records are verified with them, and written only with them.
    pub record_keys: Option<crate::metadata::seal::RecordKeys>,
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Fly(#[from] FlyClientBuildError),
    #[error(transparent)]
    Probe(#[from] ProbeBuildError),
    #[error(transparent)]
    Overlay(#[from] OverlayError),
    #[error(transparent)]
    Gate(#[from] crate::observe::gate::GateError),
    #[error(
        "{var} is not set (gates.alertmanager.url_env): the alert gate needs Alertmanager's base URL"
    )]
    GateUrlMissing { var: String },
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("cannot fetch the overlay: {0}")]
    Fetch(#[source] OverlayError),
    #[error(transparent)]
    Sweep(#[from] SweepError),
}

/// The Fly API client the config describes, sending each app its own token.
pub fn fly_client(config: &Config, secrets: &Secrets) -> Result<FlyClient, FlyClientBuildError> {
    FlyClient::with_tokens(
        FlyClientConfig {
            request_timeout: config.fly.request_timeout.get(),
            max_retries: config.fly.max_retries,
            rate_limits: config
                .fly
                .rate_limits
                .then_some(crate::fly::RateLimits::FLY),
            ..FlyClientConfig::new(&config.fly.api_url)
        },
        &secrets.fly_token,
    )
}

/// Builds the Fly client, prober and overlay mirror (opening or creating it).
pub async fn connect(config: Arc<Config>, secrets: &Secrets) -> Result<Sweeper, SetupError> {
    // Before any socket: a sweep holds up to `probe.concurrency` of them.
    let steps = crate::act::executor::ExecutorConfig::new("").concurrency;
    crate::fds::at_start(crate::fds::FdBudget::from_config(&config, steps));
    let fly = fly_client(&config, secrets)?;
    let prober = Prober::new(&config.probe)?;
    let overlay = Overlay::open(OverlaySource {
        repo: config.overlay.repo.to_string(),
        branch: config.overlay.branch.to_string(),
        mirror_dir: config.overlay.mirror_dir.clone(),
        token: secrets.git_token.clone(),
    })
    .await?;
    overlay.set_diff_budget(config.overlay.max_path_comparisons.get());
    Ok(Sweeper {
        signals: severity::signals(&config.severity),
        config,
        fly,
        prober,
        overlay,
        record_keys: secrets.record_keys.clone(),
        // Set by the commands that plan ([`alert_gate`]): its URL is theirs.
        gate: None,
    })
}

/// The alert gate `[gates.alertmanager]` describes, reading Alertmanager at
/// `url` (the value of its `url_env`); none when not configured. A gate
/// configured without its URL is an error: it would hold every claim.
pub fn alert_gate(
    config: &Config,
    url: Option<&SecretString>,
) -> Result<Option<crate::observe::gate::AlertGate>, SetupError> {
    let Some(gate) = &config.gates.alertmanager else {
        return Ok(None);
    };
    let url = url.ok_or_else(|| SetupError::GateUrlMissing {
        var: gate.url_env.clone(),
    })?;
    Ok(Some(crate::observe::gate::AlertGate::new(gate, url)?))
}

/// One fetch and one read-only sweep: the `check` command.
pub async fn check(sweeper: &Sweeper) -> Result<Snapshot, CheckError> {
    let tip = sweeper
        .overlay
        .fetch_within(sweeper.config.overlay.fetch_timeout.get())
        .await
        .map_err(CheckError::Fetch)?;
    Ok(sweep(sweeper, &tip).await?)
}

/// One sweep, prepared by a process with no memory of earlier ones:
/// observe the fleet against `tip` (read-only), then [`prepare`] it with a
/// one-shot listings memory and tracker (nothing carried, copied or kept:
/// each drift's severity, reason and action decided). `check`
/// starts here.
pub async fn sweep(sweeper: &Sweeper, tip: &Tip) -> Result<Snapshot, SweepError> {
    let policy = Policy::from_config(&sweeper.config);
    let observation = sweeper.sweep(tip).await?;
    // The memory is new and thrown away, so the time it is prepared at is
    // never read back: no stale app has a last listing to date, and no
    // drift clock outlives this call. The epoch stands in for it.
    Ok(prepare(
        &policy,
        observation,
        &mut LastListings::one_shot(),
        &mut Tracker::one_shot(),
        DateTime::UNIX_EPOCH,
    ))
}

/// One fetch, one read-only sweep and the plan a daemon would make from it:
/// the `plan` command. Nothing is written anywhere.
///
/// A one-shot process has no memory of earlier sweeps, so it plans as a
/// daemon that has seen every drift and every unanswered probe for
/// `rotation.min_drift_age` already (the persisted probe-failure records
/// still count from their own time); the fetch it just made confirms any
/// unknown ref. A running daemon's own decisions are at
/// `/api/v1/machines/{id}` (`status MACHINE`).
pub async fn plan_once(
    sweeper: &Sweeper,
    owner: &str,
    clock: &dyn Clock,
) -> Result<(Snapshot, Plan), CheckError> {
    let tip = sweeper
        .overlay
        .fetch_within(sweeper.config.overlay.fetch_timeout.get())
        .await
        .map_err(CheckError::Fetch)?;
    let policy = Policy::from_config(&sweeper.config);
    let observation = sweeper.sweep(&tip).await?;
    Ok(plan_as_seen_before(
        &policy,
        observation,
        owner,
        clock.now(),
    ))
}

/// The snapshot of `observation` and its plan at `now`, as a daemon makes
/// them that first saw it `rotation.min_drift_age` ago and fetched the
/// overlay just now. A canary's soak is not timed: no daemon memory says
/// when it began, and a soak of 0s would be false.
pub fn plan_as_seen_before(
    policy: &Policy,
    observation: Observation,
    owner: &str,
    now: DateTime<Utc>,
) -> (Snapshot, Plan) {
    let mut tracker = Tracker::for_one_plan();
    let first_seen = chrono::Duration::from_std(policy.rotation.min_drift_age)
        .ok()
        .and_then(|age| now.checked_sub_signed(age))
        .unwrap_or(now);
    // Prepared as first seen then, and seen again now.
    let snapshot = prepare(
        policy,
        observation,
        &mut LastListings::one_shot(),
        &mut tracker,
        first_seen,
    );
    tracker.observe(&snapshot, now);
    let plan = planner::plan(&PlanInput {
        policy,
        snapshot: &snapshot,
        tracker: &tracker,
        owner,
        fetch: FetchState {
            fetched_at: Some(now),
            failing: false,
        },
        now,
    });
    (snapshot, plan)
}

/// What one turn of the loop produced.
#[derive(Debug)]
pub enum SweepOutcome {
    /// A sweep's snapshot, sent before its steps run (a restart can wait
    /// minutes for the machine to start): the view is published from it at
    /// once. The same sweep's `Swept` follows, with its steps.
    Observed {
        report: Box<Snapshot>,
        /// The sweep's time (the loop's clock), as in its `Cycle`.
        at: DateTime<Utc>,
    },
    Swept(Box<Cycle>),
    /// Steps a turn carried out while newer sweeps were published beside
    /// them (a restart waits up to a minute): reported on their own as they
    /// end, since their turn's view is no longer the newest.
    Acted {
        steps: Vec<StepReport>,
        /// When they ended (the loop's clock).
        at: DateTime<Utc>,
        /// The alerts of the newest turn, sent again with these steps' events.
        alerts: Arc<AlertSet>,
    },
    Failed {
        error: String,
        kind: &'static str,
        /// When the overlay was last fetched successfully.
        tip_fetched_at: Option<DateTime<Utc>>,
        /// When the turn failed (the loop's clock).
        at: DateTime<Utc>,
        /// Every alert that holds after this failed turn.
        alerts: Arc<AlertSet>,
    },
}

/// One successful sweep, its plan, and the steps the executor finished.
#[derive(Debug)]
pub struct Cycle {
    /// The sweep's snapshot, as planned on.
    pub report: Snapshot,
    pub plan: Plan,
    /// This sweep's steps, as the executor carried them out (none when
    /// sweeps were published beside them: then they come as `Acted`).
    pub steps: Vec<StepReport>,
    /// Observe + plan + act.
    pub duration: Duration,
    /// When the overlay was last fetched successfully.
    pub tip_fetched_at: Option<DateTime<Utc>>,
    /// Set while the latest fetch failed or has not returned: the tip this
    /// sweep used may be stale.
    pub fetch_error: Option<String>,
    pub now: DateTime<Utc>,
    /// Every alert that holds after this sweep ([`evaluate`]): the plan's,
    /// the carried and restored ones, and the fleet's.
    pub alerts: Arc<AlertSet>,
}

/// Loop settings beyond the config.
pub struct LoopOptions<'a> {
    /// Carries out plans; `None` observes and plans only (no Fly writes).
    pub executor: Option<&'a Executor>,
    /// Woken by `POST /api/v1/refresh`: fetch the overlay and sweep now.
    pub refresh: Option<Arc<Notify>>,
    /// This reconciler's identity, written into markers.
    pub owner: String,
    /// Where the loop reads the time (sweeps, fetches, failures).
    pub clock: SharedClock,
    /// The alerts firing before a restart (the notifier's saved state):
    /// they keep firing until this run's evidence confirms or clears them.
    pub restored_alerts: Vec<crate::decide::alerts::Alert>,
    /// Which sinks are failing (the notifier), read at each turn for
    /// `alert_sink_failing`; `None`: no sinks.
    pub delivery: Option<&'a dyn DeliveryState>,
}

/// What the fetcher last learned about the release tip; the sweeps read it.
#[derive(Clone, Debug, Default)]
struct FetchStatus {
    /// The last known tip: from the last good fetch, or at start the one
    /// the mirror already had.
    tip: Option<Tip>,
    /// When a fetch last succeeded (in this process).
    fetched_at: Option<DateTime<Utc>>,
    /// Why the latest attempt failed; `Some` while the tip may be stale,
    /// including before the first attempt has returned.
    error: Option<String>,
}

/// Sweeps every `sweep.interval` until `shutdown`, and beside them fetches
/// the overlay every `overlay.fetch_interval` (each fetch bounded by
/// `overlay.fetch_timeout`). Sweeps never wait for a fetch: they use the
/// last known tip, and while fetches fail (or stall) the planner is told,
/// so nothing starts rotating towards a tip that may be stale. Each sweep
/// plans and (with an executor) acts; `on_cycle` sees every outcome. On
/// shutdown, steps in flight finish their short Fly calls and release their
/// leases; markers were written before acting, so they stay consistent. A
/// fetch in flight is abandoned, never waited for.
pub async fn reconcile_loop(
    sweeper: &Sweeper,
    options: LoopOptions<'_>,
    shutdown: CancellationToken,
    on_cycle: impl FnMut(SweepOutcome),
) {
    let initial = FetchStatus {
        // A tip the mirror already has lets sweeps report the fleet even
        // when the git server is down at start; it counts as unconfirmed.
        tip: sweeper.overlay.tip().await.ok(),
        fetched_at: None,
        error: Some("the first fetch has not finished yet".into()),
    };
    let (status_tx, status_rx) = tokio::sync::watch::channel(initial);
    let sweep_now = Notify::new();
    let refresh = options.refresh.clone().unwrap_or_default();
    tokio::join!(
        fetch_loop(
            sweeper,
            &*options.clock,
            &refresh,
            &status_tx,
            &sweep_now,
            &shutdown
        ),
        sweep_loop(
            sweeper, &options, status_rx, &sweep_now, &shutdown, on_cycle
        ),
    );
}

/// Fetches on `fetch_interval` and on refresh requests, publishing each
/// result. Asks for a sweep at once when the tip changed or a refresh asked.
async fn fetch_loop(
    sweeper: &Sweeper,
    clock: &dyn Clock,
    refresh: &Notify,
    status: &tokio::sync::watch::Sender<FetchStatus>,
    sweep_now: &Notify,
    shutdown: &CancellationToken,
) {
    let config = &sweeper.config.overlay;
    let mut ticker = tokio::time::interval(config.fetch_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let forced = tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => false,
            _ = refresh.notified() => true,
        };
        let fetched = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = sweeper.overlay.fetch_within(config.fetch_timeout.get()) => r,
        };
        let mut changed = false;
        status.send_modify(|s| match fetched {
            Ok(tip) => {
                if s.tip.as_ref() != Some(&tip) {
                    tracing::info!(branch = %tip.branch, commit = %tip.commit, "overlay release tip");
                    changed = true;
                }
                s.tip = Some(tip);
                s.fetched_at = Some(clock.now());
                s.error = None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "overlay fetch failed; keeping the last known tip");
                s.error = Some(e.to_string());
            }
        });
        if forced || changed {
            sweep_now.notify_one();
        }
    }
}

/// Sweeps on `sweep.interval` (and when the fetcher asks), with the last
/// known tip. While the executor carries out a plan (a restart waits up to
/// a minute for its machine to start), sweeps go on beside it every other
/// interval, observing and planning only: the view and the alerts never
/// fall more than a couple of sweeps behind (#37 item 4). What they plan is
/// not carried out; the next turn after the steps plans afresh, and the
/// steps are reported as they end (`Acted`).
async fn sweep_loop(
    sweeper: &Sweeper,
    options: &LoopOptions<'_>,
    mut status: tokio::sync::watch::Receiver<FetchStatus>,
    sweep_now: &Notify,
    shutdown: &CancellationToken,
    mut on_cycle: impl FnMut(SweepOutcome),
) {
    // The first sweep waits a little for the first fetch, so that a daemon
    // with a reachable git server starts on the current tip.
    tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = status.changed() => {}
        _ = tokio::time::sleep(sweeper.config.sweep.interval.get()) => {}
    }
    let interval = sweeper.config.sweep.interval.get();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut turns = Turns {
        sweeper,
        options,
        status,
        // The executor's own, when there is one: one policy for the run.
        policy: options.executor.map_or_else(
            || Arc::new(Policy::from_config(&sweeper.config)),
            |e| e.policy().clone(),
        ),
        tracker: Tracker::default(),
        listings: LastListings::default(),
        alerts: AlertMemory::new(
            &AlertRules::from_config(&sweeper.config),
            &options.restored_alerts,
        ),
        last_alerts: Arc::default(),
    };
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
            _ = sweep_now.notified() => {}
        }
        let turn = tokio::select! {
            _ = shutdown.cancelled() => return,
            t = turns.observe() => t,
        };
        let turn = match turn {
            Ok(turn) => turn,
            Err(failed) => {
                on_cycle(failed);
                continue;
            }
        };
        if let Some(executor) = options.executor
            && !shutdown.is_cancelled()
        {
            record_halts(executor, &turn.plan, &options.owner, turn.now).await;
        }
        let executor = match options.executor {
            Some(executor) if turn.plan.has_steps() && !shutdown.is_cancelled() => executor,
            _ => {
                on_cycle(turns.swept(turn, Vec::new()));
                continue;
            }
        };
        // Published before the steps' waits: other replicas and readers see
        // this sweep, not the one before (#37 item 4).
        on_cycle(SweepOutcome::Observed {
            report: Box::new(turn.report.clone()),
            at: turn.now,
        });
        let acting = executor.execute(turn.plan.steps().into_iter().cloned().collect(), shutdown);
        let mut observed_beside = false;
        let observing = async {
            // Every other interval: the steps' own calls share Fly's rate
            // limits (the coordinator's above all) with these sweeps.
            let mut beside =
                tokio::time::interval_at(tokio::time::Instant::now() + interval * 2, interval * 2);
            beside.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = beside.tick() => {}
                    _ = sweep_now.notified() => {}
                }
                let outcome = match turns.observe().await {
                    Ok(beside) => turns.swept(beside, Vec::new()),
                    Err(failed) => failed,
                };
                observed_beside = true;
                on_cycle(outcome);
            }
        };
        let steps = tokio::select! {
            steps = acting => steps,
            never = observing => match never {},
        };
        turns.remember_writes(&steps, turn.now);
        if observed_beside {
            // This turn's view is older than what was published meanwhile:
            // only its steps are news.
            on_cycle(SweepOutcome::Acted {
                steps,
                at: options.clock.now(),
                alerts: turns.last_alerts.clone(),
            });
        } else {
            on_cycle(turns.swept(turn, steps));
        }
    }
}

/// Writes on the coordinator each halt this plan detected (`[release]`):
/// from then on every replica, and this one after a restart, reads it.
async fn record_halts(executor: &Executor, plan: &Plan, owner: &str, now: DateTime<Utc>) {
    for (app, halted) in &plan.halts {
        let Some(record) = halted.record(owner, now) else {
            continue;
        };
        match executor.record_halt(app, &record).await {
            Ok(()) => {
                tracing::warn!(%app, tip = %halted.tip, failures = halted.failures.len(), "release halted: no new rotation toward its tip until `fleet-reconciler resume`")
            }
            Err(e) => {
                tracing::warn!(%app, tip = %halted.tip, error = %e, "the halt record could not be written on the coordinator; halted meanwhile, tried again next sweep")
            }
        }
    }
}

/// One sweep and its plan, not yet acted on.
struct Turn {
    report: Snapshot,
    plan: Plan,
    fetch: FetchStatus,
    started: Instant,
    now: DateTime<Utc>,
}

/// What the sweep loop keeps across turns, and how one turn observes and
/// plans.
struct Turns<'s, 'o> {
    sweeper: &'s Sweeper,
    options: &'s LoopOptions<'o>,
    status: tokio::sync::watch::Receiver<FetchStatus>,
    policy: Arc<Policy>,
    tracker: Tracker,
    listings: LastListings,
    /// What the alert rules remember between turns.
    alerts: AlertMemory,
    /// The alerts of the last turn reported.
    last_alerts: Arc<AlertSet>,
}

impl Turns<'_, '_> {
    /// Sweeps with the last known tip, then prepares and plans; a failed
    /// turn is its `Failed` outcome.
    async fn observe(&mut self) -> Result<Turn, SweepOutcome> {
        let started = Instant::now();
        let fetch = self.status.borrow_and_update().clone();
        let Some(current) = fetch.tip.clone() else {
            let error = format!(
                "no overlay tip yet: {}",
                fetch.error.as_deref().unwrap_or("fetch pending")
            );
            return Err(self.failed(error, "overlay", &fetch));
        };
        let observation = match self.sweeper.sweep(&current).await {
            Ok(observation) => observation,
            Err(e) => {
                // Nothing was observed or done this turn: an ERROR, not a warning.
                tracing::error!(error = %e, kind = e.kind(), "sweep failed");
                return Err(self.failed(e.to_string(), e.kind(), &fetch));
            }
        };
        let now = self.options.clock.now();
        let report = prepare(
            &self.policy,
            observation,
            &mut self.listings,
            &mut self.tracker,
            now,
        );
        let plan = planner::plan(&PlanInput {
            policy: &self.policy,
            snapshot: &report,
            tracker: &self.tracker,
            owner: &self.options.owner,
            fetch: FetchState {
                fetched_at: fetch.fetched_at,
                failing: fetch.error.is_some(),
            },
            now,
        });
        Ok(Turn {
            report,
            plan,
            fetch,
            started,
            now,
        })
    }

    /// A failed turn, with the alerts that hold after it.
    fn failed(&mut self, error: String, kind: &'static str, fetch: &FetchStatus) -> SweepOutcome {
        let at = self.options.clock.now();
        let failing_sinks = self.failing_sinks();
        let turn = crate::decide::alerts::Turn::Failed {
            tip_fetched_at: fetch.fetched_at,
            failing_sinks: &failing_sinks,
        };
        self.last_alerts = Arc::new(evaluate(turn, &mut self.alerts, at));
        SweepOutcome::Failed {
            error,
            kind,
            tip_fetched_at: fetch.fetched_at,
            at,
            alerts: self.last_alerts.clone(),
        }
    }

    /// The turn as reported, with the steps it carried out and the alerts
    /// that hold after it.
    fn swept(&mut self, turn: Turn, steps: Vec<StepReport>) -> SweepOutcome {
        let failing_sinks = self.failing_sinks();
        let evaluated = crate::decide::alerts::Turn::Swept {
            report: &turn.report,
            plan: &turn.plan,
            tip_fetched_at: turn.fetch.fetched_at,
            failing_sinks: &failing_sinks,
        };
        self.last_alerts = Arc::new(evaluate(evaluated, &mut self.alerts, turn.now));
        SweepOutcome::Swept(Box::new(Cycle {
            report: turn.report,
            plan: turn.plan,
            steps,
            duration: turn.started.elapsed(),
            tip_fetched_at: turn.fetch.fetched_at,
            fetch_error: turn.fetch.error,
            now: turn.now,
            alerts: self.last_alerts.clone(),
        }))
    }

    /// The sinks failing now, as the notifier reports them.
    fn failing_sinks(&self) -> Vec<crate::decide::alerts::FailingSink> {
        self.options
            .delivery
            .map(DeliveryState::failing_sinks)
            .unwrap_or_default()
    }

    /// What the steps wrote that the next sweeps must know was ours.
    fn remember_writes(&mut self, steps: &[StepReport], now: DateTime<Utc>) {
        for r in steps {
            if let (Outcome::Done, StepKind::RecordUnprobed { record }) = (&r.outcome, &r.step.kind)
            {
                self.tracker
                    .wrote_record(&r.step.target.machine_id, record, now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_of_secrets_shows_no_token() {
        let secrets = Secrets {
            fly_token: "fly-sekrit".into(),
            git_token: Some("git-sekrit".into()),
            record_keys: Some(crate::metadata::seal::RecordKeys::new(
                crate::metadata::seal::RecordKey::from_hex(&"5e".repeat(32)).unwrap(),
            )),
        };
        let shown = format!("{secrets:?}");
        assert!(
            !shown.contains("sekrit") && !shown.contains("5e5e"),
            "{shown}"
        );
    }
}

//! Wiring and the sweep loop: builds the observers from a config and secrets,
//! and runs sweeps on an interval until shutdown.
//!
//! Owns the lifecycle of a sweep (when to fetch the overlay, when to sweep,
//! what to keep when a fetch fails). It must never read the environment or the
//! clock for decisions beyond scheduling: secrets come in as `Secrets`, and
//! shutdown as a `CancellationToken`.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::executor::{Executor, StepReport};
use crate::reconcile::{self, FetchState, Plan, PlanInput, Tracker};

use crate::config::Config;
use crate::fly::{FlyClient, FlyClientBuildError, FlyClientConfig};
use crate::overlay::{Overlay, OverlayError, OverlaySource, Tip};
use crate::probe::{ProbeBuildError, Prober};
use crate::sweep::{FleetReport, LastListings, SweepError, Sweeper};

/// Secrets read from the environment at the binary's edge.
#[derive(Clone, Default)]
pub struct Secrets {
    pub fly_token: String,
    pub git_token: Option<String>,
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secrets { <redacted> }")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Fly(#[from] FlyClientBuildError),
    #[error(transparent)]
    Probe(#[from] ProbeBuildError),
    #[error(transparent)]
    Overlay(#[from] OverlayError),
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("cannot fetch the overlay: {0}")]
    Fetch(#[source] OverlayError),
    #[error(transparent)]
    Sweep(#[from] SweepError),
}

/// The Fly API client the config describes.
pub fn fly_client(config: &Config, secrets: &Secrets) -> Result<FlyClient, FlyClientBuildError> {
    FlyClient::new(
        FlyClientConfig {
            request_timeout: config.fly.request_timeout,
            max_retries: config.fly.max_retries,
            ..FlyClientConfig::new(&config.fly.api_url)
        },
        &secrets.fly_token,
    )
}

/// Builds the Fly client, prober and overlay mirror (opening or creating it).
pub async fn connect(config: Arc<Config>, secrets: &Secrets) -> Result<Sweeper, SetupError> {
    let fly = fly_client(&config, secrets)?;
    let prober = Prober::new(&config.probe)?;
    let overlay = Overlay::open(OverlaySource {
        repo: config.overlay.repo.clone(),
        branch: config.overlay.branch.clone(),
        mirror_dir: config.overlay.mirror_dir.clone(),
        token: secrets.git_token.clone(),
    })
    .await?;
    Ok(Sweeper {
        config,
        fly,
        prober,
        overlay,
    })
}

/// One fetch and one read-only sweep: the `check` command.
pub async fn check(sweeper: &Sweeper) -> Result<FleetReport, CheckError> {
    let tip = sweeper.overlay.fetch().await.map_err(CheckError::Fetch)?;
    Ok(sweeper.sweep(&tip).await?)
}

/// What one turn of the loop produced.
#[derive(Debug)]
pub enum SweepOutcome {
    Swept(Box<Cycle>),
    Failed {
        error: String,
        kind: &'static str,
        /// When the overlay was last fetched successfully.
        tip_fetched_at: Option<DateTime<Utc>>,
    },
}

/// One successful sweep, its plan, and what the executor did.
#[derive(Debug)]
pub struct Cycle {
    pub report: FleetReport,
    pub plan: Plan,
    pub steps: Vec<StepReport>,
    /// Observe + plan + act.
    pub duration: Duration,
    /// When the overlay was last fetched successfully.
    pub tip_fetched_at: Option<DateTime<Utc>>,
    /// Set when this sweep used a tip older than the last fetch attempt.
    pub fetch_error: Option<String>,
    pub now: DateTime<Utc>,
}

/// Loop settings beyond the config.
pub struct LoopOptions<'a> {
    /// Carries out plans; `None` observes and plans only (no Fly writes).
    pub executor: Option<&'a Executor>,
    /// Woken by `POST /api/v1/refresh`: fetch the overlay and sweep now.
    pub refresh: Option<Arc<Notify>>,
    /// This reconciler's identity, written into markers.
    pub owner: String,
}

/// Sweeps every `sweep.interval` until `shutdown`: fetch the overlay when
/// `fetch_interval` has passed (a failed fetch keeps the last known tip),
/// sweep, plan, and (with an executor) act. `on_cycle` sees every outcome.
/// On shutdown, steps in flight finish their short Fly calls and release
/// their leases; markers were written before acting, so they stay consistent.
pub async fn reconcile_loop(
    sweeper: &Sweeper,
    options: LoopOptions<'_>,
    shutdown: CancellationToken,
    mut on_cycle: impl FnMut(SweepOutcome),
) {
    let mut ticker = tokio::time::interval(sweeper.config.sweep.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tip: Option<Tip> = None;
    let mut last_fetch: Option<Instant> = None;
    let mut tip_fetched_at: Option<DateTime<Utc>> = None;
    let mut tracker = Tracker::default();
    let mut listings = LastListings::default();
    // Whether the latest fetch attempt failed (the tip may be stale).
    let mut fetch_failing = false;
    let refresh = options.refresh.clone().unwrap_or_default();
    loop {
        let mut force_fetch = false;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
            _ = refresh.notified() => force_fetch = true,
        }
        let started = Instant::now();
        let mut fetch_error = None;
        if force_fetch
            || last_fetch.is_none_or(|t| t.elapsed() >= sweeper.config.overlay.fetch_interval)
        {
            last_fetch = Some(Instant::now());
            match sweeper.overlay.fetch().await {
                Ok(t) => {
                    if tip.as_ref() != Some(&t) {
                        tracing::info!(branch = %t.branch, commit = %t.commit, "overlay release tip");
                    }
                    tip = Some(t);
                    tip_fetched_at = Some(Utc::now());
                    fetch_failing = false;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "overlay fetch failed; keeping the last known tip");
                    fetch_error = Some(e.to_string());
                    fetch_failing = true;
                }
            }
        }
        let Some(current) = tip.clone() else {
            on_cycle(SweepOutcome::Failed {
                error: format!(
                    "no overlay tip yet: {}",
                    fetch_error.unwrap_or_else(|| "fetch pending".into())
                ),
                kind: "overlay",
                tip_fetched_at,
            });
            continue;
        };
        let swept = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = sweeper.sweep(&current) => r,
        };
        let mut report = match swept {
            Ok(report) => report,
            Err(e) => {
                tracing::warn!(error = %e, kind = e.kind(), "sweep failed");
                on_cycle(SweepOutcome::Failed {
                    error: e.to_string(),
                    kind: e.kind(),
                    tip_fetched_at,
                });
                continue;
            }
        };
        let now = Utc::now();
        // An app this sweep could not list keeps its last listing, as stale.
        listings.carry(&mut report, now);
        tracker.observe(&report, now);
        let plan = reconcile::plan(&PlanInput {
            config: &sweeper.config,
            report: &report,
            tracker: &tracker,
            owner: &options.owner,
            fetch: FetchState {
                fetched_at: tip_fetched_at,
                failing: fetch_failing,
            },
            now,
        });
        let steps = match options.executor {
            Some(executor) if !plan.steps.is_empty() && !shutdown.is_cancelled() => {
                executor.execute(plan.steps.clone(), &shutdown).await
            }
            _ => Vec::new(),
        };
        on_cycle(SweepOutcome::Swept(Box::new(Cycle {
            report,
            plan,
            steps,
            duration: started.elapsed(),
            tip_fetched_at,
            fetch_error,
            now,
        })));
    }
}

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

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::fly::{FlyClient, FlyClientBuildError, FlyClientConfig};
use crate::overlay::{Overlay, OverlayError, OverlaySource, Tip};
use crate::probe::{ProbeBuildError, Prober};
use crate::sweep::{FleetReport, SweepError, Sweeper};

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

/// Builds the Fly client, prober and overlay mirror (opening or creating it).
pub async fn connect(config: Arc<Config>, secrets: &Secrets) -> Result<Sweeper, SetupError> {
    let fly = FlyClient::new(
        FlyClientConfig {
            request_timeout: config.fly.request_timeout,
            max_retries: config.fly.max_retries,
            ..FlyClientConfig::new(&config.fly.api_url)
        },
        &secrets.fly_token,
    )?;
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
    Swept {
        report: Box<FleetReport>,
        duration: Duration,
        /// Set when this sweep used a tip older than the last fetch attempt.
        fetch_error: Option<String>,
    },
    Failed {
        error: String,
    },
}

/// Sweeps every `sweep.interval` until `shutdown`, fetching the overlay when
/// `fetch_interval` has passed. A failed fetch keeps the last known tip (and
/// says so); without any tip yet, the sweep fails. `on_sweep` sees every outcome.
pub async fn sweep_loop(
    sweeper: &Sweeper,
    shutdown: CancellationToken,
    mut on_sweep: impl FnMut(SweepOutcome),
) {
    let mut ticker = tokio::time::interval(sweeper.config.sweep.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tip: Option<Tip> = None;
    let mut last_fetch: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let started = Instant::now();
        let mut fetch_error = None;
        if last_fetch.is_none_or(|t| t.elapsed() >= sweeper.config.overlay.fetch_interval) {
            last_fetch = Some(Instant::now());
            match sweeper.overlay.fetch().await {
                Ok(t) => {
                    if tip.as_ref() != Some(&t) {
                        tracing::info!(branch = %t.branch, commit = %t.commit, "overlay release tip");
                    }
                    tip = Some(t);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "overlay fetch failed; keeping the last known tip");
                    fetch_error = Some(e.to_string());
                }
            }
        }
        let Some(current) = tip.clone() else {
            on_sweep(SweepOutcome::Failed {
                error: format!(
                    "no overlay tip yet: {}",
                    fetch_error.unwrap_or_else(|| "fetch pending".into())
                ),
            });
            continue;
        };
        let outcome = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = sweeper.sweep(&current) => r,
        };
        match outcome {
            Ok(report) => on_sweep(SweepOutcome::Swept {
                report: Box::new(report),
                duration: started.elapsed(),
                fetch_error,
            }),
            Err(e) => {
                tracing::warn!(error = %e, kind = e.kind(), "sweep failed");
                on_sweep(SweepOutcome::Failed {
                    error: e.to_string(),
                })
            }
        }
    }
}

//! The executor: carries out planned steps through the Fly API and the agents.
//!
//! Owns leases and markers. Every mutating sequence holds the machine's Fly
//! lease (short TTL, refreshed while held, released on every exit path); a
//! lease held by someone else means "skip this machine this sweep", never
//! "take it". Under the lease it first checks that the marker is still what
//! the plan saw (another replica may have moved on), then writes the new
//! marker, and only then acts. It is the only code that calls mutating Fly
//! endpoints or an agent's cooperative endpoints. It must never decide: when
//! the world differs from the plan it stops and lets the next sweep replan.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::events::{ActionEvent, EventKind};
use crate::fly::{FlyClient, FlyError, Lease};
use crate::operator::{APPROVE_KEY, MARKER_KEY};
use crate::reconcile::{Step, StepKind, Target};
use crate::rotation::{self, Marker};

/// Tuning of the executor; defaults follow flyctl (13 s lease, refreshed ~4 s).
#[derive(Clone, Debug)]
pub struct ExecutorConfig {
    pub lease_ttl: Duration,
    pub lease_refresh: Duration,
    /// Claim settle window (see `rotation` module docs).
    pub claim_settle: Duration,
    /// How long a restart step waits for `started` before leaving the rest
    /// to the verify deadline.
    pub start_wait: Duration,
    /// Steps carried out at once.
    pub concurrency: usize,
    /// This reconciler's identity (lease description, marker owner).
    pub owner: String,
}

impl ExecutorConfig {
    pub fn new(owner: &str, claim_settle: Duration) -> ExecutorConfig {
        ExecutorConfig {
            lease_ttl: Duration::from_secs(13),
            lease_refresh: Duration::from_secs(4),
            claim_settle,
            start_wait: Duration::from_secs(30),
            concurrency: 16,
            owner: owner.to_string(),
        }
    }
}

/// How one step ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done as planned.
    Done,
    /// Not done, harmlessly: the lease is held elsewhere, the marker moved,
    /// the pool is full after all. The next sweep replans.
    Skipped(String),
    /// Tried and failed; the marker says where the rotation stands.
    Failed(String),
}

impl Outcome {
    /// Bounded label for metrics (`fleet_actions_total{result}`).
    pub fn result(&self) -> &'static str {
        match self {
            Outcome::Done => "succeeded",
            Outcome::Skipped(_) => "skipped",
            Outcome::Failed(_) => "failed",
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Done => f.write_str("done"),
            Outcome::Skipped(why) => write!(f, "skipped: {why}"),
            Outcome::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

/// What happened to a step, for logs, metrics and notifications.
#[derive(Clone, Debug)]
pub struct StepReport {
    pub step: Step,
    pub outcome: Outcome,
    pub events: Vec<ActionEvent>,
}

#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error("lease held by another actor")]
    Leased,
    #[error("marker changed since the plan (another reconciler acted)")]
    MarkerMoved,
    #[error("{0}")]
    Backoff(String),
    #[error(transparent)]
    Fly(#[from] FlyError),
    #[error("shutting down")]
    Cancelled,
}

pub struct Executor {
    fly: FlyClient,
    agents: reqwest::Client,
    config: Arc<Config>,
    agent_tokens: HashMap<String, String>,
    tuning: ExecutorConfig,
}

impl Executor {
    /// `agent_tokens`: app name → bearer token for its agents' cooperative endpoints.
    pub fn new(
        fly: FlyClient,
        config: Arc<Config>,
        agent_tokens: HashMap<String, String>,
        tuning: ExecutorConfig,
    ) -> Result<Executor, reqwest::Error> {
        let agents = reqwest::Client::builder()
            .user_agent(crate::http::USER_AGENT)
            .timeout(config.probe.timeout.max(Duration::from_secs(5)))
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Executor {
            fly,
            agents,
            config,
            agent_tokens,
            tuning,
        })
    }

    /// Carries out the steps (different machines concurrently) and reports each.
    pub async fn execute(&self, steps: Vec<Step>, shutdown: &CancellationToken) -> Vec<StepReport> {
        use futures::StreamExt;
        futures::stream::iter(steps)
            .map(|step| async move {
                let outcome = match self.run(&step, shutdown).await {
                    Ok(()) => Outcome::Done,
                    Err(StepError::Leased) => {
                        Outcome::Skipped("lease held by another actor".into())
                    }
                    Err(StepError::MarkerMoved) => {
                        Outcome::Skipped("marker changed since the plan".into())
                    }
                    Err(StepError::Backoff(why)) => Outcome::Skipped(why),
                    Err(StepError::Cancelled) => Outcome::Skipped("shutting down".into()),
                    Err(StepError::Fly(e)) => Outcome::Failed(e.to_string()),
                };
                let events = events_for(&step, &outcome, Utc::now());
                log_step(&step, &outcome);
                StepReport {
                    step,
                    outcome,
                    events,
                }
            })
            .buffer_unordered(self.tuning.concurrency.max(1))
            .collect()
            .await
    }

    async fn run(&self, step: &Step, shutdown: &CancellationToken) -> Result<(), StepError> {
        let t = &step.target;
        let lease = self.acquire(t).await?;
        let refresher = self.refresher(t, &lease);
        let result = self.under_lease(step, &lease.nonce, shutdown).await;
        refresher.cancel();
        // Released on every path; a failure here only means it expires by itself.
        if let Err(e) = self
            .fly
            .release_lease(&t.app, &t.machine_id, &lease.nonce)
            .await
        {
            tracing::warn!(app = %t.app, machine_id = %t.machine_id, error = %e, "lease release failed; it expires with its TTL");
        }
        result?;
        // Agent calls need no lease: they do not change the machine in Fly.
        match &step.kind {
            StepKind::Claim {
                marker,
                drain: true,
                ..
            }
            | StepKind::Advance {
                marker,
                cordon: true,
                ..
            } if marker.drain_requested => {
                self.agent_call(
                    t,
                    "overlay/drain",
                    serde_json::json!({ "rotation": marker.tag }),
                )
                .await;
            }
            StepKind::Claim {
                marker,
                reload: true,
                ..
            } => {
                self.agent_call(
                    t,
                    "overlay/reload",
                    serde_json::json!({ "ref": marker.target }),
                )
                .await;
            }
            // On the tip without a restart (a reload, or someone else's
            // restart): a fence we asked for may still stand.
            StepKind::Finish { undrain: true, .. } => {
                if let Some(tag) = step.tag() {
                    self.agent_call(t, "overlay/undrain", serde_json::json!({ "rotation": tag }))
                        .await;
                }
            }
            _ => {}
        }
        Ok(())
    }

    async fn under_lease(
        &self,
        step: &Step,
        nonce: &str,
        shutdown: &CancellationToken,
    ) -> Result<(), StepError> {
        let t = &step.target;
        let (app, id) = (t.app.as_str(), t.machine_id.as_str());
        // The plan was made from a snapshot: act only if the marker is still that.
        let current = self.fly.get_metadata_key(app, id, MARKER_KEY).await?;
        let current = current.as_deref().map(Marker::parse);
        let unchanged = match (&step.expected, current) {
            (None, None) => true,
            (Some(expected), Some(Some(now))) => *expected == now,
            _ => false,
        };
        if !unchanged {
            return Err(StepError::MarkerMoved);
        }
        match &step.kind {
            StepKind::Claim { marker, reload, .. } => self.claim(t, marker, *reload, nonce).await,
            StepKind::Advance { marker, cordon, .. } => {
                self.write_marker(t, marker, nonce).await?;
                if *cordon {
                    self.fly.cordon(app, id, Some(nonce)).await?;
                }
                Ok(())
            }
            StepKind::Restart { marker, .. } => {
                // Marker first: if we die between here and the restart, the next
                // reconciler waits out the verify deadline instead of restarting twice.
                self.write_marker(t, marker, nonce).await?;
                self.fly
                    .restart(app, id, Some(Duration::from_secs(30)), Some(nonce))
                    .await?;
                tokio::select! {
                    _ = shutdown.cancelled() => Err(StepError::Cancelled),
                    r = self.fly.wait(app, id, "started", self.tuning.start_wait) => match r {
                        // Not started yet: the verify deadline covers it.
                        Ok(()) | Err(FlyError::WaitTimeout { .. }) => Ok(()),
                        Err(e) => Err(e.into()),
                    },
                }
            }
            StepKind::Finish { clear_approval, .. } => {
                self.fly.uncordon(app, id, Some(nonce)).await?;
                if *clear_approval {
                    self.fly
                        .delete_metadata(app, id, APPROVE_KEY, Some(nonce))
                        .await?;
                }
                self.fly
                    .delete_metadata(app, id, MARKER_KEY, Some(nonce))
                    .await?;
                Ok(())
            }
            StepKind::Yield {
                marker, undrain, ..
            } => {
                if *undrain {
                    self.agent_call(
                        t,
                        "overlay/undrain",
                        serde_json::json!({ "rotation": marker.tag }),
                    )
                    .await;
                }
                self.fly.uncordon(app, id, Some(nonce)).await?;
                self.write_marker(t, marker, nonce).await
            }
        }
    }

    /// Claim-then-verify (see `rotation`): write, settle, re-read, rank.
    /// A claim that cannot be verified and completed is withdrawn, so no
    /// marker ever holds a slot it did not win or sits on an uncordoned machine.
    async fn claim(
        &self,
        t: &Target,
        planned: &Marker,
        reload: bool,
        nonce: &str,
    ) -> Result<(), StepError> {
        let mut marker = planned.clone();
        let stamped = Utc::now();
        marker.started_at = stamped;
        marker.attempt_started_at = stamped;
        let began = tokio::time::Instant::now();
        self.write_marker(t, &marker, nonce).await?;
        let result = self.verify_claim(t, stamped, began, reload, nonce).await;
        if result.is_err() {
            if let Err(e) = self
                .fly
                .delete_metadata(&t.app, &t.machine_id, MARKER_KEY, Some(nonce))
                .await
            {
                tracing::warn!(app = %t.app, machine_id = %t.machine_id, error = %e, "could not withdraw a claim; the next sweep sees it as a rotation in progress");
            }
        }
        result
    }

    async fn verify_claim(
        &self,
        t: &Target,
        stamped: DateTime<Utc>,
        began: tokio::time::Instant,
        reload: bool,
        nonce: &str,
    ) -> Result<(), StepError> {
        let settle = self.tuning.claim_settle;
        if began.elapsed() > settle / 2 {
            return Err(StepError::Backoff(
                "claim write was too slow to rank safely; retrying next sweep".into(),
            ));
        }
        let read_at = stamped + chrono::Duration::from_std(settle).unwrap_or_default();
        if let Ok(wait) = (read_at - Utc::now()).to_std() {
            tokio::time::sleep(wait).await;
        }
        let cap = self.config.pool(&t.pool).max_concurrent_rotations.get() as usize;
        let pool_key = self.config.app(&t.app).and_then(|a| a.pool_key.clone());
        let machines = self.fly.list_machines(&t.app).await?;
        let mut claims: Vec<(DateTime<Utc>, &str)> = Vec::new();
        for m in &machines {
            let pool = crate::severity::pool_of(pool_key.as_deref(), |k| m.metadata(k));
            if pool != t.pool {
                continue;
            }
            match m.metadata(MARKER_KEY).map(Marker::parse) {
                Some(Some(other)) if other.phase.holds_slot() => {
                    claims.push((other.started_at, m.id.as_str()))
                }
                // Unreadable markers rank first: fail closed.
                Some(None) => claims.push((DateTime::<Utc>::MIN_UTC, m.id.as_str())),
                _ => {}
            }
        }
        if !rotation::admitted(&mut claims, cap).contains(&t.machine_id.as_str()) {
            return Err(StepError::Backoff(format!(
                "pool {} of {} is at its cap of {cap} after all (another reconciler claimed first)",
                t.pool, t.app
            )));
        }
        if !reload {
            self.fly.cordon(&t.app, &t.machine_id, Some(nonce)).await?;
        }
        Ok(())
    }

    async fn write_marker(
        &self,
        t: &Target,
        marker: &Marker,
        nonce: &str,
    ) -> Result<(), StepError> {
        self.fly
            .set_metadata(
                &t.app,
                &t.machine_id,
                MARKER_KEY,
                &marker.to_value(),
                Some(nonce),
            )
            .await
            .map_err(Into::into)
    }

    async fn acquire(&self, t: &Target) -> Result<Lease, StepError> {
        let description = format!("fleet-reconciler {}", self.tuning.owner);
        match self
            .fly
            .acquire_lease(&t.app, &t.machine_id, self.tuning.lease_ttl, &description)
            .await
        {
            Ok(lease) => Ok(lease),
            Err(FlyError::LeaseConflict { .. }) => Err(StepError::Leased),
            Err(e) => Err(e.into()),
        }
    }

    /// Keeps the lease alive while a step runs; cancelled when it ends.
    fn refresher(&self, t: &Target, lease: &Lease) -> CancellationToken {
        let stop = CancellationToken::new();
        let (fly, app, id, nonce) = (
            self.fly.clone(),
            t.app.clone(),
            t.machine_id.clone(),
            lease.nonce.clone(),
        );
        let (ttl, every, owner) = (
            self.tuning.lease_ttl,
            self.tuning.lease_refresh,
            self.tuning.owner.clone(),
        );
        let token = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                let description = format!("fleet-reconciler {owner}");
                if let Err(e) = fly
                    .refresh_lease(&app, &id, &nonce, ttl, &description)
                    .await
                {
                    tracing::warn!(app = %app, machine_id = %id, error = %e, "lease refresh failed");
                }
            }
        });
        stop
    }

    /// POSTs to an agent's cooperative endpoint; failures are logged, and the
    /// planner's deadlines decide what they mean.
    async fn agent_call(&self, t: &Target, path: &str, body: serde_json::Value) {
        let Some(url) = t
            .health_url
            .as_deref()
            .and_then(|h| url::Url::parse(h).ok())
            .and_then(|h| {
                // RFC 3986: relative to the health URL, so /x/health → /x/overlay/drain.
                h.join(path).ok()
            })
        else {
            tracing::warn!(app = %t.app, machine_id = %t.machine_id, endpoint = path, "no health URL to reach the agent");
            return;
        };
        let mut req = self.agents.post(url).json(&body);
        if let Some(token) = self.agent_tokens.get(&t.app) {
            req = req.bearer_auth(token);
        }
        match req.send().await {
            Ok(r) if r.status().is_success() => {
                tracing::info!(app = %t.app, machine_id = %t.machine_id, endpoint = path, "agent accepted");
            }
            Ok(r) => {
                tracing::warn!(app = %t.app, machine_id = %t.machine_id, endpoint = path, status = r.status().as_u16(), "agent refused")
            }
            Err(e) => {
                tracing::warn!(app = %t.app, machine_id = %t.machine_id, endpoint = path, error = %crate::http::describe(&e), "agent call failed")
            }
        }
    }
}

fn log_step(step: &Step, outcome: &Outcome) {
    let t = &step.target;
    let marker = step.new_marker().or(step.expected.as_ref());
    let commit = marker.map(|m| m.target.as_str()).unwrap_or("");
    let severity = marker.map(|m| m.severity.as_str()).unwrap_or("");
    match outcome {
        Outcome::Done => {
            tracing::info!(app = %t.app, machine_id = %t.machine_id, pool = %t.pool, commit, severity, step = step.kind(), "{step}")
        }
        Outcome::Skipped(why) => {
            tracing::info!(app = %t.app, machine_id = %t.machine_id, pool = %t.pool, commit, severity, step = step.kind(), reason = %why, "skipped: {step}")
        }
        Outcome::Failed(why) => {
            tracing::warn!(app = %t.app, machine_id = %t.machine_id, pool = %t.pool, commit, severity, step = step.kind(), error = %why, "failed: {step}")
        }
    }
}

/// One-shot events: a claim starts an action, a finish ends it, a failure fails it.
fn events_for(step: &Step, outcome: &Outcome, at: DateTime<Utc>) -> Vec<ActionEvent> {
    let Some(marker) = step.new_marker().or(step.expected.as_ref()) else {
        return Vec::new();
    };
    let t = &step.target;
    let event = |kind, summary: String| ActionEvent {
        kind,
        app: t.app.clone(),
        machine_id: t.machine_id.clone(),
        commit: marker.target.clone(),
        severity: marker.severity,
        action: marker.action,
        summary,
        at,
    };
    match (outcome, &step.kind) {
        (Outcome::Failed(why), _) => vec![event(
            EventKind::ActionFailed,
            format!("{step} failed: {why}"),
        )],
        (Outcome::Done, StepKind::Claim { .. }) => {
            vec![event(EventKind::ActionStarted, step.to_string())]
        }
        (Outcome::Done, StepKind::Restart { .. }) => {
            vec![event(EventKind::ActionStarted, step.to_string())]
        }
        (Outcome::Done, StepKind::Finish { .. }) => vec![event(
            EventKind::ActionSucceeded,
            format!(
                "{} now runs the release tip; rotation finished",
                t.machine_id
            ),
        )],
        _ => Vec::new(),
    }
}

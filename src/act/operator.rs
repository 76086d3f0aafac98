//! Operator controls: hold, release, approve and revoke, as Fly metadata writes.
//!
//! Owns writing what operators write (docs/design.md §6.6); the keys and the
//! values' formats are [`crate::metadata`]'s ([`crate::metadata::operator`]),
//! so the CLI, the admin API and any number of reconciler replicas agree. A
//! hold is only ever written and cleared here, by an operator; the daemon
//! reads it and never clears it. It must never touch the rotation marker.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::config::Config;
use crate::fly::{FlyClient, FlyError, Lease, Machine};
use crate::metadata::operator::{Approval, Hold};
use crate::metadata::{APPROVE_KEY, HOLD_KEY};
use crate::model::{AppName, MachineId};

#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("machine {machine_id} is not in any configured app ({apps})")]
    UnknownMachine { machine_id: String, apps: String },
    #[error(
        "machine {machine_id} is leased by another actor; retried for {waited:?}, try again shortly"
    )]
    Leased {
        machine_id: String,
        waited: Duration,
    },
    #[error(
        "machine {machine_id} is in no app that could be searched; {unsearched} could not be: {first_error}"
    )]
    Unsearched {
        machine_id: String,
        /// The apps whose lookup failed (comma-separated).
        unsearched: String,
        first_error: FlyError,
    },
    #[error(transparent)]
    Fly(#[from] FlyError),
}

/// How long the `hold` and `revoke` commands' own lease lives: one metadata write.
const HOLD_LEASE_TTL: Duration = Duration::from_secs(10);

/// A hold as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HoldWritten {
    pub app: AppName,
    /// Written under the machine's lease (no step of ours that began before
    /// it makes a further call), or without it: the lease stayed taken.
    pub fenced: bool,
}

/// An approval as revoked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revoked {
    pub app: AppName,
    /// The approval's value as it stood just before (`None`: there was none,
    /// and nothing was written).
    pub removed: Option<String>,
    /// Removed under the machine's lease, as a hold is written ([`HoldWritten::fenced`]).
    pub fenced: bool,
}

/// Performs operator commands through the Fly API.
#[derive(Clone, Debug)]
pub struct Operator {
    fly: FlyClient,
    apps: Vec<AppName>,
    /// How long to keep retrying while a reconciler holds the machine's lease.
    lease_patience: Duration,
}

impl Operator {
    pub fn new(fly: FlyClient, config: &Config) -> Operator {
        Operator {
            fly,
            apps: config
                .apps
                .iter()
                .map(|a| AppName::from(a.name.as_str()))
                .collect(),
            lease_patience: Duration::from_secs(30),
        }
    }

    pub fn with_lease_patience(mut self, patience: Duration) -> Operator {
        self.lease_patience = patience;
        self
    }

    /// Finds the machine in the configured apps.
    pub async fn locate(
        &self,
        machine_id: &MachineId,
    ) -> Result<(AppName, Machine), OperatorError> {
        // One app that cannot be read (deleted, no access, an outage) must
        // not stop a hold on a machine of another.
        let mut failed: Vec<(&str, FlyError)> = Vec::new();
        for app in &self.apps {
            match self.fly.get_machine(app, machine_id).await {
                Ok(m) => return Ok((app.clone(), m)),
                Err(FlyError::NotFound { .. }) => continue,
                Err(e) => failed.push((app.as_str(), e)),
            }
        }
        let unsearched = failed
            .iter()
            .map(|(app, _)| *app)
            .collect::<Vec<_>>()
            .join(", ");
        match failed.into_iter().next() {
            None => Err(OperatorError::UnknownMachine {
                machine_id: machine_id.to_string(),
                apps: self
                    .apps
                    .iter()
                    .map(AppName::as_str)
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
            Some((_, first_error)) => Err(OperatorError::Unsearched {
                machine_id: machine_id.to_string(),
                unsearched,
                first_error,
            }),
        }
    }

    /// Puts a hold on the machine: no reconciler acts on it until `release`.
    ///
    /// Written under the machine's lease, waited for (a reconciler keeps it
    /// for seconds at a time), so the hold is fenced: no step of ours that
    /// began before it can make a further call. Fly does not fence metadata
    /// writes, so when the lease stays taken past the patience (someone
    /// else's long operation) the hold is written without it rather than not
    /// at all: a reconciler honours it from its next call on.
    pub async fn hold(
        &self,
        machine_id: &MachineId,
        by: &str,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<HoldWritten, OperatorError> {
        let (app, _) = self.locate(machine_id).await?;
        let value = serde_json::to_string(&Hold {
            by: by.to_string(),
            reason: reason.to_string(),
            at: now,
        })
        .unwrap_or_default();
        let fenced = self
            .under_lease(
                &app,
                machine_id,
                "fleet-reconciler hold",
                HOLD_KEY,
                Some(&value),
            )
            .await?;
        Ok(HoldWritten { app, fenced })
    }

    /// Removes a pending approval (the `revoke` command), under the
    /// machine's lease as [`Operator::hold`] writes, so no step of ours that
    /// read it makes a further call: a rotation bound to it stops before its
    /// restart (README, "Operator commands") and no sweep starts one from it.
    /// A machine with no approval is left untouched (`removed: None`).
    pub async fn revoke(&self, machine_id: &MachineId) -> Result<Revoked, OperatorError> {
        let (app, machine) = self.locate(machine_id).await?;
        // Metadata Fly does not show (an unhealthy host) is tried anyway: the
        // delete is what was asked for.
        let removed = match machine.metadata(APPROVE_KEY) {
            Ok(None) => {
                return Ok(Revoked {
                    app,
                    removed: None,
                    fenced: false,
                });
            }
            Ok(Some(v)) => Some(v.to_string()),
            Err(_) => None,
        };
        let fenced = self
            .under_lease(
                &app,
                machine_id,
                "fleet-reconciler revoke",
                APPROVE_KEY,
                None,
            )
            .await?;
        Ok(Revoked {
            app,
            removed,
            fenced,
        })
    }

    /// Sets `key` to `value` (`None`: deletes it) under the machine's lease,
    /// waited for up to the patience, and releases the lease; when it stays
    /// taken the write is made without it (Fly does not fence metadata
    /// writes) rather than not at all. Whether it was fenced.
    async fn under_lease(
        &self,
        app: &AppName,
        machine_id: &MachineId,
        purpose: &str,
        key: &str,
        value: Option<&str>,
    ) -> Result<bool, OperatorError> {
        let lease = self.lease(app, machine_id, purpose).await?;
        let nonce = lease.as_ref().map(|l| &l.nonce);
        let written = self
            .patiently(machine_id, || async move {
                match value {
                    Some(value) => {
                        self.fly
                            .set_metadata(app, machine_id, key, value, nonce)
                            .await
                    }
                    None => self.fly.delete_metadata(app, machine_id, key, nonce).await,
                }
            })
            .await;
        if let Some(lease) = &lease
            && let Err(e) = self.fly.release_lease(app, machine_id, &lease.nonce).await
        {
            tracing::warn!(%app, %machine_id, error = %e, "lease release failed; it expires with its TTL");
        }
        written?;
        Ok(lease.is_some())
    }

    /// The machine's lease, waited for up to the patience; `None` if it
    /// stayed taken.
    async fn lease(
        &self,
        app: &AppName,
        machine_id: &MachineId,
        purpose: &str,
    ) -> Result<Option<Lease>, OperatorError> {
        let started = tokio::time::Instant::now();
        let mut delay = Duration::from_millis(250);
        loop {
            match self
                .fly
                .acquire_lease(app, machine_id, HOLD_LEASE_TTL, purpose)
                .await
            {
                Ok(lease) => return Ok(Some(lease)),
                Err(FlyError::LeaseConflict { .. }) if started.elapsed() < self.lease_patience => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(FlyError::LeaseConflict { .. }) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Clears an operator hold.
    pub async fn release(&self, machine_id: &MachineId) -> Result<AppName, OperatorError> {
        let (app, _) = self.locate(machine_id).await?;
        self.patiently(machine_id, || {
            self.fly.delete_metadata(&app, machine_id, HOLD_KEY, None)
        })
        .await?;
        Ok(app)
    }

    /// Authorizes one `manual` rotation of the machine to `target`.
    pub async fn approve(
        &self,
        machine_id: &MachineId,
        approval: &Approval,
    ) -> Result<AppName, OperatorError> {
        let (app, _) = self.locate(machine_id).await?;
        let value = serde_json::to_string(approval).unwrap_or_default();
        self.patiently(machine_id, || {
            self.fly
                .set_metadata(&app, machine_id, APPROVE_KEY, &value, None)
        })
        .await?;
        Ok(app)
    }

    /// Metadata writes on a machine a reconciler is rotating are refused
    /// (409) while it holds the lease, which it keeps only for seconds at a
    /// time: wait for it rather than fail, and never take the lease away.
    async fn patiently<F, Fut>(
        &self,
        machine_id: &MachineId,
        mut write: F,
    ) -> Result<(), OperatorError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), FlyError>>,
    {
        let started = tokio::time::Instant::now();
        let mut delay = Duration::from_millis(250);
        loop {
            match write().await {
                Err(FlyError::LeaseConflict { .. }) if started.elapsed() < self.lease_patience => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(4));
                }
                Err(FlyError::LeaseConflict { .. }) => {
                    return Err(OperatorError::Leased {
                        machine_id: machine_id.to_string(),
                        waited: started.elapsed(),
                    });
                }
                other => return other.map_err(Into::into),
            }
        }
    }
}

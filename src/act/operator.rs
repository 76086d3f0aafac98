//! Operator controls: hold, release, approve, revoke and resume (a halted
//! release), as Fly metadata writes.
//!
//! Owns writing what operators write (docs/design.md §6.6); the keys and the
//! values' formats are [`crate::metadata`]'s ([`crate::metadata::operator`]),
//! so the CLI, the admin API and any number of reconciler replicas agree. A
//! hold is only ever written and cleared here, by an operator; the daemon
//! reads it and never clears it. It must never touch the rotation marker.
//!
//! Agents can write their app's metadata (docs/safety.md, "Threat model"):
//! a hold is written first on the coordinator (`fleet_reconciler_hold.<id>`,
//! the authoritative copy, out of agents' reach) and then on the machine (a
//! mirror for `fly machine status`), and released in the same order;
//! holds and approvals are sealed with the record key, and an approval is
//! refused without one. An approval `revoke` removes or `approve` replaces
//! is first listed as spent on the coordinator (under its lease, as the
//! executor lists consumed ones), so that written back it approves nothing.
//! `resume` writes a sealed `resumed` record over an app's halt record on
//! the coordinator ([`crate::metadata::halt`]); it too is refused without
//! the key (an unsealed one would halt, fail closed).

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::config::Config;
use crate::fly::{FlyClient, FlyError, Lease, Machine};
use crate::metadata::controls::Trust;
use crate::metadata::halt::{HaltRecord, HaltView, coordinator_halt_key};
use crate::metadata::operator::{Approval, ApprovalId, Hold, SpentApprovals, approval_record};
use crate::metadata::seal::RecordKeys;
use crate::metadata::slots::Coordinator;
use crate::metadata::{APPROVE_KEY, HOLD_KEY, coordinator_hold_key, coordinator_spent_key};
use crate::model::{AppName, CommitId, MachineId};

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
    /// An approval is sealed with the record key: without it, it would be
    /// ignored as forged (docs/safety.md, "Threat model").
    #[error(transparent)]
    NoRecordKey(#[from] crate::config::RecordKeyError),
    #[error("app {app} is not a configured app ({apps})")]
    UnknownApp { app: String, apps: String },
    /// A halt lives on the coordinator: without one nothing is halted.
    #[error("no `rotation.coordinator` is configured: no release is halted without one")]
    NoCoordinator,
    #[error("the coordinator {coordinator} does not show its metadata: {why}")]
    CoordinatorUnreadable { coordinator: String, why: String },
    #[error("the release of {app} is not halted (coordinator {coordinator})")]
    NotHalted { app: AppName, coordinator: String },
    #[error("the release of {app} is halted at {halted}, not at {asked} (--tip)")]
    OtherTip {
        app: AppName,
        halted: CommitId,
        asked: CommitId,
    },
}

/// A halted release as resumed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resumed {
    /// The record as it stood just before (`None`: it was not one this
    /// fleet sealed, and was deleted).
    pub halt: Option<HaltRecord>,
    /// The record written (`None`: the unverifiable one was deleted).
    pub written: Option<HaltRecord>,
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
    /// Why the coordinator's authoritative copy could not be written, if it
    /// could not: the hold holds, but an agent could delete it.
    pub coordinator_error: Option<String>,
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
    /// The record keys: holds and approvals are written sealed with them.
    record_keys: Option<RecordKeys>,
    /// `records.key_env` (named when an approval needs the missing key).
    key_env: String,
    /// Where the authoritative copy of each hold is kept (`rotation.coordinator`).
    coordinator: Option<Coordinator>,
}

impl Operator {
    /// `record_keys`: what the daemon holds (`[records] key_env`); an
    /// operator without them can hold and release, not approve.
    pub fn new(fly: FlyClient, config: &Config, record_keys: Option<RecordKeys>) -> Operator {
        Operator {
            fly,
            apps: config
                .apps
                .iter()
                .map(|a| AppName::from(a.name.as_str()))
                .collect(),
            lease_patience: Duration::from_secs(30),
            record_keys,
            key_env: config.records.key_env.clone(),
            coordinator: config.rotation.coordinator.clone(),
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
        // The authoritative copy first, on the coordinator (agents cannot
        // reach it): from then on the hold holds, whatever an agent does to
        // the machine's own copy.
        // A coordinator that cannot be written does not stop the hold: the
        // machine's copy holds too (only an agent could delete it).
        let mut coordinator_error = None;
        if let Some(c) = &self.coordinator {
            let key = coordinator_hold_key(machine_id.as_str());
            let sealed = self.trust().seal(c.machine_id.as_str(), &key, &value);
            let written = self
                .patiently(machine_id, || {
                    self.fly
                        .set_metadata(&c.app, &c.machine_id, &key, &sealed, None)
                })
                .await;
            if let Err(e) = written {
                tracing::warn!(coordinator = %c, %machine_id, error = %e, "the hold's authoritative copy could not be written on the coordinator; the machine's own copy holds");
                coordinator_error = Some(format!("coordinator {c}: {e}"));
            }
        }
        let value = self.trust().seal(machine_id.as_str(), HOLD_KEY, &value);
        let fenced = self
            .under_lease(
                &app,
                machine_id,
                "fleet-reconciler hold",
                HOLD_KEY,
                Some(&value),
            )
            .await?;
        Ok(HoldWritten {
            app,
            fenced,
            coordinator_error,
        })
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
            // Shown as the record it is (unverified: it goes either way).
            Ok(Some(v)) => Some(
                Trust::AsWritten
                    .open(machine_id.as_str(), APPROVE_KEY, v)
                    .unwrap_or_else(|_| v.to_string()),
            ),
            Err(_) => None,
        };
        // Spent first: the value still verifies on this machine, and an
        // agent that read it could write it back.
        if let Ok(Some(v)) = machine.metadata(APPROVE_KEY) {
            self.spend(machine_id, v).await;
        }
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
        // The authoritative copy first: should the machine's own delete
        // fail, its copy still holds (any value holds) until tried again.
        if let Some(c) = &self.coordinator {
            let key = coordinator_hold_key(machine_id.as_str());
            let deleted = self
                .patiently(machine_id, || {
                    self.fly.delete_metadata(&c.app, &c.machine_id, &key, None)
                })
                .await;
            match deleted {
                // No coordinator, no copy on it: nothing holds there.
                Err(OperatorError::Fly(FlyError::NotFound { .. })) | Ok(()) => {}
                Err(e) => return Err(e),
            }
        }
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
        let keys = self.keys()?;
        let (app, machine) = self.locate(machine_id).await?;
        // The count of approvals spent on the machine so far: once the
        // coordinator's list has forgotten this one's id, its epoch still
        // tells it spent (SpentApprovals::outlived).
        let epoch = self.spent_count(machine_id).await;
        let value = approval_record(approval, epoch);
        let value = keys.seal(machine_id.as_str(), APPROVE_KEY, &value);
        // The approval this one replaces is spent: written back by an agent
        // it must not authorize what the operator has just changed.
        if let Ok(Some(old)) = machine.metadata(APPROVE_KEY)
            && old != value
        {
            self.spend(machine_id, old).await;
        }
        self.patiently(machine_id, || {
            self.fly
                .set_metadata(&app, machine_id, APPROVE_KEY, &value, None)
        })
        .await?;
        Ok(app)
    }

    /// How many approvals were ever spent on the machine, from the
    /// coordinator's list; `None` without a coordinator or when it cannot
    /// be read (the approval then carries no epoch).
    async fn spent_count(&self, machine_id: &MachineId) -> Option<u64> {
        let c = self.coordinator.as_ref()?;
        let key = coordinator_spent_key(machine_id.as_str());
        let m = self.fly.get_machine(&c.app, &c.machine_id).await.ok()?;
        let list = match m.metadata(&key).ok()? {
            None => SpentApprovals::default(),
            Some(v) => SpentApprovals::parse(&Trust::AsWritten.open("", "", v).ok()?)?,
        };
        Some(list.count())
    }

    /// Lists the approval `value` (the machine's, as read) as spent on the
    /// coordinator, under the coordinator's lease as the executor writes
    /// that list, so that written back it approves nothing (docs/safety.md,
    /// "Threat model"). Best effort: without a coordinator, or when it
    /// cannot be read or leased, the operator's own write still goes ahead
    /// The record keys, which every sealed write needs; their absence names
    /// the variable that should hold them.
    fn keys(&self) -> Result<&RecordKeys, crate::config::RecordKeyError> {
        self.record_keys
            .as_ref()
            .ok_or_else(|| crate::config::RecordKeyError::Missing {
                var: self.key_env.clone(),
            })
    }

    /// (a warning says the old approval could be replayed).
    async fn spend(&self, machine_id: &MachineId, value: &str) {
        let Some(c) = &self.coordinator else { return };
        let Ok(body) = self.trust().open(machine_id.as_str(), APPROVE_KEY, value) else {
            // Not one of ours: it approves nothing anyway.
            return;
        };
        let id = ApprovalId::of(&body);
        let key = coordinator_spent_key(machine_id.as_str());
        let spent = async {
            let lease = self
                .lease(&c.app, &c.machine_id, "fleet-reconciler approval spent")
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "its lease stayed taken".to_string())?;
            let written = async {
                let m = self
                    .fly
                    .get_machine(&c.app, &c.machine_id)
                    .await
                    .map_err(|e| e.to_string())?;
                // Unknown is not empty: never overwrite a list we cannot read.
                let list = m.metadata(&key).map_err(|e| e.to_string())?;
                let list = list
                    .and_then(|v| SpentApprovals::parse(&Trust::AsWritten.open("", "", v).ok()?))
                    .unwrap_or_default();
                if list.contains(&id) {
                    return Ok(());
                }
                let sealed =
                    self.trust()
                        .seal(c.machine_id.as_str(), &key, &list.with(id.clone()).to_value());
                self.fly
                    .set_metadata(&c.app, &c.machine_id, &key, &sealed, Some(&lease.nonce))
                    .await
                    .map_err(|e| e.to_string())
            }
            .await;
            if let Err(e) = self.fly.release_lease(&c.app, &c.machine_id, &lease.nonce).await {
                tracing::warn!(coordinator = %c, error = %e, "lease release failed; it expires with its TTL");
            }
            written
        }
        .await;
        if let Err(e) = spent {
            tracing::warn!(coordinator = %c, %machine_id, error = %e, "the approval removed could not be listed as spent on the coordinator; an agent that read it could write it back");
        }
    }

    fn trust(&self) -> Trust<'_> {
        Trust::of(self.record_keys.as_ref())
    }

    /// Lifts `app`'s halted release (`fleet-reconciler resume`): the halt
    /// record on the coordinator becomes a sealed `resumed` one naming the
    /// rotations it lifts (they never count toward a halt again; new
    /// failures do). A record that is not one we sealed (it halts, fail
    /// closed) is deleted. `tip`: resume only if that tip is the one halted.
    pub async fn resume(
        &self,
        app: &AppName,
        tip: Option<&CommitId>,
        by: &str,
        now: DateTime<Utc>,
    ) -> Result<Resumed, OperatorError> {
        let keys = self.keys()?;
        if !self.apps.contains(app) {
            return Err(OperatorError::UnknownApp {
                app: app.to_string(),
                apps: self
                    .apps
                    .iter()
                    .map(AppName::as_str)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let c = self
            .coordinator
            .as_ref()
            .ok_or(OperatorError::NoCoordinator)?;
        let key = coordinator_halt_key(app.as_str());
        let machine = self.fly.get_machine(&c.app, &c.machine_id).await?;
        let not_halted = || OperatorError::NotHalted {
            app: app.clone(),
            coordinator: c.to_string(),
        };
        let value = machine
            .metadata(&key)
            .map_err(|e| OperatorError::CoordinatorUnreadable {
                coordinator: c.to_string(),
                why: e.to_string(),
            })?
            .ok_or_else(not_halted)?;
        let halt = match HaltView::open(Trust::Verify(keys), c.machine_id.as_str(), &key, value) {
            HaltView::Record(record) => record,
            HaltView::Unverified(found) => {
                tracing::warn!(coordinator = %c, key, %found, "deleting a halt record this fleet did not seal");
                self.patiently(&c.machine_id, || {
                    self.fly.delete_metadata(&c.app, &c.machine_id, &key, None)
                })
                .await?;
                return Ok(Resumed {
                    halt: None,
                    written: None,
                });
            }
        };
        let HaltRecord::Halted { tip: halted, .. } = &halt else {
            return Err(not_halted());
        };
        if let Some(asked) = tip.filter(|t| *t != halted) {
            return Err(OperatorError::OtherTip {
                app: app.clone(),
                halted: halted.clone(),
                asked: asked.clone(),
            });
        }
        let resumed = HaltRecord::Resumed {
            tip: halted.clone(),
            lifted: halt.to_lift(),
            by: by.to_string(),
            at: now,
        };
        let sealed = keys.seal(c.machine_id.as_str(), &key, &resumed.to_value());
        self.patiently(&c.machine_id, || {
            self.fly
                .set_metadata(&c.app, &c.machine_id, &key, &sealed, None)
        })
        .await?;
        Ok(Resumed {
            halt: Some(halt),
            written: Some(resumed),
        })
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

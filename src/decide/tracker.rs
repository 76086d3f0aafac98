//! The planner's memory between sweeps ([`Tracker`]): when each machine's
//! drift and unprobeability began, and when this run first saw each
//! machine's current marker and probe-failure record, which rotations
//! ended failed ([`crate::decide::halt`]) and since when each canary pool
//! met its ratio on the tip ([`crate::decide::guardrail`]).
//!
//! Owns those first-sight clocks, on this replica's clock only. `prepare`
//! folds each snapshot in; `plan` reads it. It must never read the clock
//! (`now` is an argument) nor compare a time another replica wrote with its
//! own.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use crate::decide::guardrail::CanaryMemory;
use crate::decide::halt::FailureMemory;
use crate::decide::policy::Policy;
use crate::decide::snapshot::Snapshot;
use crate::metadata::marker::{Marker, Phase};
use crate::metadata::unprobed::Unprobed;
use crate::model::{MachineId, MachineStatus, PolicyAction, Severity};
use crate::observe::sweep::ObservedMachine;

/// Memory between sweeps: when each machine's drift and unprobeability
/// began, and when this run first saw each machine's current marker and
/// probe-failure record. Every ceiling and deadline is measured on this
/// replica's clock: a time another replica wrote counts from the later of
/// itself and this run's first sight of what carries it
/// ([`Tracker::marker_seen`], [`Tracker::record_seen`]). Lost on restart,
/// which only delays alerts and actions (the first sight is then later),
/// never hastens them.
#[derive(Clone, Debug, Default)]
pub struct Tracker {
    pub(super) machines: HashMap<MachineId, Seen>,
    /// A one-shot process's tracker ([`Tracker::one_shot`]): it folds
    /// nothing in, as nothing plans from it afterwards.
    forgets: bool,
    /// Rotations toward the tip this run saw end failed (`[release]` halts).
    pub(super) failures: FailureMemory,
    /// First sight of each canary pool's ratio met on the tip (`after`).
    pub(super) canaries: CanaryMemory,
}

#[derive(Clone, Debug, Default)]
pub(super) struct Seen {
    drift_since: Option<DateTime<Utc>>,
    /// First sweep of the current run without a usable report.
    unprobed_since: Option<DateTime<Utc>>,
    /// The last report we could read was not on the tip.
    last_known_drifted: bool,
    /// What the pool's policy said about that drift, and at which severity.
    pub(super) last_known_action: Option<PolicyAction>,
    pub(super) last_known_severity: Option<Severity>,
    /// First sight of the machine's current marker.
    marker: Option<MarkerSight>,
    /// First sight of the machine's current probe-failure record.
    record: Option<RecordSight>,
    /// A record this run saw that vanished with no sealed clear naming it
    /// (an agent deleted it) while no usable report came: it still counts,
    /// from its first sight, until a usable report or a clear of ours.
    lost_record: Option<RecordSight>,
}

/// What makes a marker the same one for its first-sight clock: the fields
/// its ceilings and deadlines are measured from. A new phase, attempt,
/// restart or retry is a new marker, first seen afresh.
#[derive(Clone, Debug, PartialEq, Eq)]
struct MarkerKey {
    tag: String,
    phase: Phase,
    attempt: u32,
    attempt_started_at: DateTime<Utc>,
    restart_at: Option<DateTime<Utc>>,
    retry_at: Option<DateTime<Utc>>,
}

impl MarkerKey {
    fn of(m: &Marker) -> MarkerKey {
        MarkerKey {
            tag: m.tag.clone(),
            phase: m.phase,
            attempt: m.attempt,
            attempt_started_at: m.attempt_started_at,
            restart_at: m.restart_at,
            retry_at: m.retry_at,
        }
    }
}

#[derive(Clone, Debug)]
struct MarkerSight {
    key: MarkerKey,
    seen: MarkerSeen,
}

/// When this run first saw a marker as it is now, on this replica's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MarkerSeen {
    pub at: DateTime<Utc>,
    /// First sight of it while Fly said the machine was cordoned.
    pub cordoned_at: Option<DateTime<Utc>>,
}

#[derive(Clone, Debug)]
struct RecordSight {
    record: Unprobed,
    at: DateTime<Utc>,
}

impl Seen {
    /// Folds in the marker and the probe-failure record of this sweep. Unknown
    /// metadata shows neither: what was seen stands.
    fn sight(&mut self, m: &ObservedMachine, now: DateTime<Utc>) {
        if m.inputs.metadata_unknown().is_some() {
            return;
        }
        let marker = m
            .inputs
            .controls
            .marker
            .as_ref()
            .and_then(|r| r.as_ref().ok());
        self.marker = marker.map(|marker| {
            let key = MarkerKey::of(marker);
            let mut sight = self
                .marker
                .take()
                .filter(|s| s.key == key)
                .unwrap_or(MarkerSight {
                    key,
                    seen: MarkerSeen {
                        at: now,
                        cordoned_at: None,
                    },
                });
            if m.inputs.cordoned == Some(true) {
                sight.seen.cordoned_at = sight.seen.cordoned_at.or(Some(now));
            }
            sight
        });
        let controls = &m.inputs.controls;
        let previous = self.record.take();
        if let (Some(prev), None) = (&previous, &controls.unprobed) {
            // Ours, cleared by a replica (it names the record): gone. Else
            // deleted by someone else: remembered, the earliest sight kept.
            if controls.unprobed_cleared.as_deref() == Some(prev.record.fingerprint().as_str()) {
                self.lost_record = None;
            } else if self.lost_record.is_none() {
                self.lost_record = Some(prev.clone());
            }
        }
        // A record cleared and written again is a new one: its clock starts
        // over; one written after a deletion keeps the lost one's first sight.
        let lost_at = self.lost_record.as_ref().map(|l| l.at);
        self.record = controls.unprobed.as_ref().map(|record| {
            previous
                .filter(|s| s.record == *record)
                .unwrap_or(RecordSight {
                    record: record.clone(),
                    at: lost_at.map_or(now, |at| at.min(now)),
                })
        });
        if self.record.is_some() {
            self.lost_record = None;
        }
    }
}

impl Tracker {
    /// The memory of a process that sweeps once and plans nothing (`check`):
    /// it keeps nothing, so a 10,000-machine `check` does not build a
    /// 10,000-entry map (≈ 1.5 MiB at its peak) that nothing reads.
    pub fn one_shot() -> Tracker {
        Tracker {
            forgets: true,
            ..Tracker::default()
        }
    }

    /// The memory of a process that plans once (`plan`): it remembers as
    /// [`Tracker::default`] does, but never saw a canary's soak begin, so it
    /// times none ([`CanaryMemory::untimed`]).
    pub fn for_one_plan() -> Tracker {
        Tracker {
            canaries: CanaryMemory::untimed(),
            ..Tracker::default()
        }
    }

    /// Folds one sweep in. Machines absent from the report are forgotten;
    /// machines of an app the sweep could not list are kept as they were
    /// (nothing new is known of them).
    pub fn observe(&mut self, snapshot: &Snapshot, now: DateTime<Utc>) {
        if self.forgets {
            return;
        }
        let stale = snapshot.stale_app_names();
        let mut next = HashMap::with_capacity(snapshot.machines.len());
        for m in &snapshot.machines {
            let mut seen = self.machines.remove(&m.seen.machine_id).unwrap_or_default();
            if stale.contains(m.seen.app.as_str()) {
                next.insert(m.seen.machine_id.clone(), seen);
                continue;
            }
            // Markers and records keep their first sight whatever the status.
            seen.sight(&m.seen, now);
            let (marker, record) = (seen.marker.take(), seen.record.take());
            match m.seen.status {
                s if s.is_classified() => {
                    seen.drift_since = seen.drift_since.or(Some(now));
                    seen.unprobed_since = None;
                    seen.lost_record = None;
                    seen.last_known_drifted = true;
                    seen.last_known_action = m.action();
                    seen.last_known_severity = m.severity();
                }
                MachineStatus::OnTip => seen = Seen::default(),
                // Stopped: not counted; its drift clock starts over when it runs.
                MachineStatus::NotRunning => {
                    seen.drift_since = None;
                    seen.unprobed_since = None;
                    seen.lost_record = None;
                }
                // No usable report (unreachable or garbage alike): nothing is
                // known now, so what was known stands (a missed probe neither
                // clears nor restarts a drift) and the probe-failure clock runs.
                _ => {
                    seen.unprobed_since = seen.unprobed_since.or(Some(now));
                }
            }
            (seen.marker, seen.record) = (marker, record);
            next.insert(m.seen.machine_id.clone(), seen);
        }
        self.machines = next;
        self.failures.observe(snapshot, now);
    }

    /// Folds one sweep into the canary soak clocks (`pools.NAME.after`),
    /// which need the policy to know which pools are canaries and at what
    /// ratio.
    pub fn observe_canaries(&mut self, policy: &Policy, snapshot: &Snapshot, now: DateTime<Utc>) {
        if self.forgets {
            return;
        }
        self.canaries.observe(policy, snapshot, now);
    }

    /// Whether the last usable report of the machine showed drift.
    pub(super) fn carried_drift(&self, machine_id: &MachineId) -> Option<&Seen> {
        self.machines
            .get(machine_id)
            .filter(|s| s.last_known_drifted && s.drift_since.is_some())
    }

    pub fn drift_since(&self, machine_id: &MachineId) -> Option<DateTime<Utc>> {
        self.machines.get(machine_id)?.drift_since
    }

    /// Since when the machine has given no usable report, in this run.
    pub fn unprobed_since(&self, machine_id: &MachineId) -> Option<DateTime<Utc>> {
        self.machines.get(machine_id)?.unprobed_since
    }

    /// When this run first saw `marker` on the machine as it is now (same
    /// tag, phase, attempt and times); `None` if it has not.
    pub fn marker_seen(&self, machine_id: &MachineId, marker: &Marker) -> Option<MarkerSeen> {
        let sight = self.machines.get(machine_id)?.marker.as_ref()?;
        (sight.key == MarkerKey::of(marker)).then_some(sight.seen)
    }

    /// A probe-failure record this run saw that someone deleted (not our
    /// clear) while the machine gave no usable report, and its first sight.
    pub fn lost_record(&self, machine_id: &MachineId) -> Option<(&Unprobed, DateTime<Utc>)> {
        let lost = self.machines.get(machine_id)?.lost_record.as_ref()?;
        Some((&lost.record, lost.at))
    }

    /// When this run first saw `record` on the machine (since it was last
    /// absent or different); `None` if it has not.
    pub fn record_seen(&self, machine_id: &MachineId, record: &Unprobed) -> Option<DateTime<Utc>> {
        let sight = self.machines.get(machine_id)?.record.as_ref()?;
        (sight.record == *record).then_some(sight.at)
    }

    /// This run wrote `record` on the machine (its step was done): it counts
    /// as seen at `now`, so that a deletion before the next listing is caught
    /// like one after it — an agent can delete it the moment it lands.
    /// Only for a write Fly answered: one that got no answer may never have
    /// landed, and its absence at the next listing would read as a deletion
    /// (a false `metadata_tampered`, and evidence no other replica shares).
    pub fn wrote_record(&mut self, machine_id: &MachineId, record: &Unprobed, now: DateTime<Utc>) {
        let Some(seen) = self.machines.get_mut(machine_id) else {
            return;
        };
        if seen.record.as_ref().is_some_and(|s| s.record == *record) {
            return;
        }
        let at = seen.lost_record.as_ref().map_or(now, |l| l.at.min(now));
        seen.record = Some(RecordSight {
            record: record.clone(),
            at,
        });
    }
}

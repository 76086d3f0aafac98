//! Pool slots: the exact, cross-replica record of which rotations hold a
//! pool's capacity, kept in the metadata of one coordination machine.
//!
//! Owns the slot set's format (JSON under [`SLOTS_KEY`] on the machine named
//! by `rotation.coordinator`, sealed with the record key: [`SlotSet::open`])
//! and the pure rules for changing it. The
//! executor (`act::executor`) changes it only while holding that machine's
//! Fly lease, and the sweep reads it; this module must never do I/O.
//!
//! # Why the cap holds
//!
//! A Fly lease is exclusive: while one actor holds the coordinator's lease,
//! every other acquire answers 409. So slot-set changes are serialized across
//! any number of replicas, each one a read-modify-write of the whole set under
//! the lease, and a change adds a slot only while the pool has fewer than
//! `cap`. No timestamp ranks anything, so clock skew cannot break it.
//!
//! The markers on the agents stay the truth about rotations; a slot is only a
//! reservation. The invariants that make a reservation sufficient:
//!
//! 1. A rotation writes its marker (phase `claiming`, with a fresh tag)
//!    *before* it adds its slot, and cordons, drains or restarts only after
//!    its slot is in the set. Every disruptive call re-reads the set first.
//! 2. A rotation's marker goes only after its undo (uncordon, undrain)
//!    succeeded; its slot goes after its marker.
//! 3. A slot is reclaimed by someone else only under the coordinator's lease
//!    and only once the slot's machine carries no marker with the slot's tag
//!    that holds capacity. Tags are never reused, so a marker that is gone
//!    cannot come back for that slot.
//!
//! Hence every machine whose capacity is out of its pool (cordoned, fenced,
//! restarting) owns a slot, and there are never more than `cap` slots. A lost
//! answer or a crash between any two writes leaves either a `claiming` marker
//! (which permits nothing and is completed or withdrawn next sweep) or a slot
//! without its marker (reclaimed), never a disruption without a slot.
//!
//! Assumed of Fly (not documented either way): a machine's metadata read
//! (`GET …/machines/{id}`) reflects writes acknowledged before it was sent.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::SLOTS_KEY;
use super::controls::{Found, Trust};
use crate::model::{AppName, MachineId, PoolName};

/// The slot-set format this version writes and reads.
pub const SLOTS_VERSION: u32 = 1;

/// The machine whose metadata and lease keep the slots (`rotation.coordinator`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coordinator {
    pub app: AppName,
    pub machine_id: MachineId,
}

impl fmt::Display for Coordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.app, self.machine_id)
    }
}

impl std::str::FromStr for Coordinator {
    type Err = String;

    fn from_str(s: &str) -> Result<Coordinator, String> {
        let valid = |part: &str| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        };
        match s.split_once('/') {
            Some((app, machine)) if valid(app) && valid(machine) => Ok(Coordinator {
                app: AppName::from(app),
                machine_id: MachineId::from(machine),
            }),
            _ => Err(format!(
                "{s:?} is not APP/MACHINE_ID (the Fly app and id of the machine that keeps rotation slots)"
            )),
        }
    }
}

/// One rotation's reservation of one pool slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
    pub machine_id: MachineId,
    /// The tag of the rotation's marker.
    pub tag: String,
    /// The reconciler that took it (for operators reading the metadata).
    pub owner: String,
    pub since: DateTime<Utc>,
}

/// Every pool's slots, keyed `app/pool` (the metadata's text; read and
/// changed through an app's [`AppName`] and a [`PoolName`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotSet {
    pub version: u32,
    #[serde(default)]
    pub pools: BTreeMap<String, Vec<Slot>>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlotsError {
    #[error("slot set in metadata key {SLOTS_KEY} is not readable: {0}")]
    Unreadable(String),
    #[error(
        "slot set in metadata key {SLOTS_KEY} has version {0}; this reconciler reads {SLOTS_VERSION}"
    )]
    Version(u32),
    /// Not the set we sealed, on a coordinator agents can write (one in a
    /// swept app): unknown, so no slot is taken (fail closed).
    #[error("slot set in metadata key {SLOTS_KEY} is not sealed by this fleet's record key: {0}")]
    Tampered(Found),
}

fn pool_key(app: &AppName, pool: &PoolName) -> String {
    format!("{app}/{pool}")
}

impl SlotSet {
    /// Parses the metadata value; absent means no slot is taken. Anything
    /// unreadable is an error: callers then take no slot (fail closed).
    pub fn parse(value: Option<&str>) -> Result<SlotSet, SlotsError> {
        let Some(value) = value else {
            return Ok(SlotSet {
                version: SLOTS_VERSION,
                pools: BTreeMap::new(),
            });
        };
        let set: SlotSet =
            serde_json::from_str(value).map_err(|e| SlotsError::Unreadable(e.to_string()))?;
        if set.version != SLOTS_VERSION {
            return Err(SlotsError::Version(set.version));
        }
        Ok(set)
    }

    pub fn to_value(&self) -> String {
        // Strings and timestamps always serialize.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The coordinator's value, opened as `trust` says. An unsealed set is
    /// read as written only where agents cannot write it (`exposed` false:
    /// the coordinator is in none of the swept apps) — a set from before
    /// sealing, sealed by the next change; on an exposed coordinator it is
    /// [`SlotsError::Tampered`], as is any seal that does not verify.
    pub fn open(
        trust: Trust<'_>,
        coordinator: &Coordinator,
        value: Option<&str>,
        exposed: bool,
    ) -> Result<SlotSet, SlotsError> {
        let Some(value) = value else {
            return SlotSet::parse(None);
        };
        match trust.open(coordinator.machine_id.as_str(), SLOTS_KEY, value) {
            Ok(body) => SlotSet::parse(Some(&body)),
            Err(Found::Unsigned) if !exposed => SlotSet::parse(Some(value)),
            Err(found) => Err(SlotsError::Tampered(found)),
        }
    }

    /// The value to write on `coordinator`: sealed as `trust` says.
    pub fn to_sealed_value(&self, trust: Trust<'_>, coordinator: &Coordinator) -> String {
        trust.seal(coordinator.machine_id.as_str(), SLOTS_KEY, &self.to_value())
    }

    /// The slots of one pool.
    pub fn slots(&self, app: &AppName, pool: &PoolName) -> &[Slot] {
        self.pools
            .get(&pool_key(app, pool))
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// Whether the rotation `tag` of `machine_id` holds a slot of the pool.
    pub fn holds(&self, app: &AppName, pool: &PoolName, machine_id: &MachineId, tag: &str) -> bool {
        self.slots(app, pool)
            .iter()
            .any(|s| s.machine_id == *machine_id && s.tag == tag)
    }

    /// Adds the slot if the pool has room (or already holds it); `false` when full.
    pub fn try_add(&mut self, app: &AppName, pool: &PoolName, slot: Slot, cap: usize) -> bool {
        if self.holds(app, pool, &slot.machine_id, &slot.tag) {
            return true;
        }
        let slots = self.pools.entry(pool_key(app, pool)).or_default();
        if slots.len() >= cap {
            return false;
        }
        slots.push(slot);
        true
    }

    /// Removes one rotation's slot; `true` if it was there.
    pub fn remove(
        &mut self,
        app: &AppName,
        pool: &PoolName,
        machine_id: &MachineId,
        tag: &str,
    ) -> bool {
        let key = pool_key(app, pool);
        let Some(slots) = self.pools.get_mut(&key) else {
            return false;
        };
        let before = slots.len();
        slots.retain(|s| !(s.machine_id == *machine_id && s.tag == tag));
        let removed = slots.len() != before;
        if slots.is_empty() {
            self.pools.remove(&key);
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(id: &str, tag: &str) -> Slot {
        Slot {
            machine_id: id.into(),
            tag: tag.into(),
            owner: "r1".into(),
            since: DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
        }
    }

    #[test]
    fn a_pool_never_gets_more_slots_than_its_cap() {
        let (a, b) = (AppName::from("a"), AppName::from("b"));
        let (p, other) = (PoolName::from("p"), PoolName::from("other"));
        let m2 = MachineId::from("m2");
        let mut set = SlotSet::parse(None).unwrap();
        assert!(set.try_add(&a, &p, slot("m1", "t1"), 2));
        assert!(set.try_add(&a, &p, slot("m1", "t1"), 2), "idempotent");
        assert!(set.try_add(&a, &p, slot("m2", "t2"), 2));
        assert!(!set.try_add(&a, &p, slot("m3", "t3"), 2));
        assert!(
            set.try_add(&a, &other, slot("m3", "t3"), 1),
            "caps are per pool"
        );
        assert!(set.try_add(&b, &p, slot("m4", "t4"), 1), "and per app");
        assert_eq!(set.slots(&a, &p).len(), 2);
        assert!(set.holds(&a, &p, &m2, "t2") && !set.holds(&a, &p, &m2, "old"));
        assert!(!set.remove(&a, &p, &m2, "old"), "another rotation's tag");
        assert!(set.remove(&a, &p, &m2, "t2"));
        assert!(set.try_add(&a, &p, slot("m3", "t3"), 2));
    }

    /// The metadata text is `app/pool` keys, as every version wrote it.
    #[test]
    fn the_set_is_written_as_it_always_was() {
        let mut set = SlotSet::parse(None).unwrap();
        set.try_add(&"a".into(), &"p".into(), slot("m1", "t1"), 1);
        assert_eq!(
            set.to_value(),
            r#"{"version":1,"pools":{"a/p":[{"machine_id":"m1","tag":"t1","owner":"r1","since":"2027-01-15T08:00:00Z"}]}}"#
        );
    }

    #[test]
    fn the_set_round_trips_and_garbage_fails_closed() {
        let mut set = SlotSet::parse(None).unwrap();
        set.try_add(&"a".into(), &"p".into(), slot("m1", "t1"), 1);
        assert_eq!(SlotSet::parse(Some(&set.to_value())), Ok(set));
        assert!(matches!(
            SlotSet::parse(Some("{")),
            Err(SlotsError::Unreadable(_))
        ));
        assert_eq!(
            SlotSet::parse(Some(r#"{"version":2,"pools":{}}"#)),
            Err(SlotsError::Version(2))
        );
    }

    /// Sealed: read wherever it is. Unsealed (a set from before sealing):
    /// read where agents cannot write it, refused where they can. A seal
    /// that does not verify (altered, or another coordinator's): refused.
    #[test]
    fn a_set_is_read_only_when_sealed_or_out_of_agents_reach() {
        use crate::metadata::seal::{RecordKey, RecordKeys};
        let keys = RecordKeys::new(RecordKey::from_hex(&"11".repeat(32)).unwrap());
        let trust = Trust::Verify(&keys);
        let c: Coordinator = "reconciler/c1".parse().unwrap();
        let mut set = SlotSet::parse(None).unwrap();
        set.try_add(&"a".into(), &"p".into(), slot("m1", "t1"), 1);
        let sealed = set.to_sealed_value(trust, &c);
        for exposed in [false, true] {
            assert_eq!(
                SlotSet::open(trust, &c, Some(&sealed), exposed),
                Ok(set.clone())
            );
            assert_eq!(
                SlotSet::open(trust, &c, None, exposed),
                SlotSet::parse(None)
            );
        }
        let plain = set.to_value();
        assert_eq!(
            SlotSet::open(trust, &c, Some(&plain), false),
            Ok(set.clone())
        );
        assert_eq!(
            SlotSet::open(trust, &c, Some(&plain), true),
            Err(SlotsError::Tampered(Found::Unsigned))
        );
        // An agent empties the set by editing the sealed value.
        let emptied = sealed.replace("m1", "m9");
        assert!(matches!(
            SlotSet::open(trust, &c, Some(&emptied), false),
            Err(SlotsError::Tampered(Found::Forged(_)))
        ));
        let other: Coordinator = "reconciler/c2".parse().unwrap();
        assert!(matches!(
            SlotSet::open(trust, &other, Some(&sealed), false),
            Err(SlotsError::Tampered(Found::Forged(_)))
        ));
    }

    #[test]
    fn coordinators_are_app_slash_machine() {
        let c: Coordinator = "fleet-reconciler/3d8d9e5b".parse().unwrap();
        assert_eq!(c.app, AppName::from("fleet-reconciler"));
        assert_eq!(c.machine_id, MachineId::from("3d8d9e5b"));
        for bad in ["", "app", "/m", "a/", "a/b/c", "a b/c"] {
            assert!(bad.parse::<Coordinator>().is_err(), "{bad}");
        }
    }
}

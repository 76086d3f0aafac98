//! What the in-machine socket did, kept for tests: each metadata write an
//! agent made through it ([`SocketWrite`]) and the Fly API listings of its
//! app that showed it while it stood ([`Listing`]), so a test can tell a
//! tampering a sweep saw from one replaced before any listing.
//!
//! Owns only that record: `machine_api` adds writes, `fly_api`'s listing
//! adds sightings. It must never change what either answers.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::machine::MachineState;

/// One metadata write made through a machine's socket (a tampering, when
/// the caller is a rogue agent), and the Fly API listings of its app that
/// showed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketWrite {
    /// The socket request's number (as in [`super::RecordedRequest::seq`]).
    pub seq: u64,
    pub app: String,
    pub machine_id: String,
    pub key: String,
    /// The value written; `None` for a delete.
    pub value: Option<String>,
    /// The listings that showed the machine's metadata with this value at
    /// `key` (for a delete: without the key) before any listing found it
    /// changed. Whether each answer reached its client is the request's
    /// recorded status.
    pub listed_in: Vec<Listing>,
    /// A listing found the key changed since: no later listing counts
    /// (even one that finds the same value again).
    pub replaced: bool,
    /// Who had listed the value this write replaced (or deleted), since it
    /// was last changed: the listers that could know it was there.
    pub prior_seen_by: Vec<String>,
}

/// One full listing of an app's machines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listing {
    /// Its request number.
    pub seq: u64,
    /// Who listed: a fingerprint of the request's `Authorization` value
    /// (processes given distinct tokens are told apart; never the token).
    pub by: String,
}

/// The record itself, in the simulator's state.
#[derive(Debug, Default)]
pub(crate) struct SocketLog {
    pub(crate) writes: Vec<SocketWrite>,
    /// Per lister ([`Listing::by`]): its latest listing's request number.
    pub(crate) last_listing: BTreeMap<String, u64>,
    /// Per (machine, key): the value last listed and who listed it since
    /// it last changed.
    seen: HashMap<(String, String), (String, BTreeSet<String>)>,
}

impl SocketLog {
    /// An agent's write through its socket, request `seq`: `key` of
    /// `machine_id` now holds `value` (`None`: deleted).
    pub(crate) fn record_write(
        &mut self,
        seq: u64,
        (app, machine_id, key): (&str, &str, &str),
        before: Option<&str>,
        value: Option<String>,
    ) {
        let prior_seen_by = before
            .and_then(|b| {
                let (listed, by) = self.seen.get(&(machine_id.to_string(), key.to_string()))?;
                (listed == b).then(|| by.iter().cloned().collect())
            })
            .unwrap_or_default();
        self.writes.push(SocketWrite {
            seq,
            app: app.to_string(),
            machine_id: machine_id.to_string(),
            key: key.to_string(),
            value,
            listed_in: Vec::new(),
            replaced: false,
            prior_seen_by,
        });
    }

    /// A full (not `summary`) listing of `app` is being served: each write
    /// of that app still open is shown if its value stands, else closed. A
    /// machine whose host hides its metadata shows nothing.
    pub(crate) fn observe_listing(
        &mut self,
        app: &str,
        listing: Listing,
        machines: &HashMap<String, MachineState>,
    ) {
        self.last_listing.insert(listing.by.clone(), listing.seq);
        for m in machines.values().filter(|m| m.app == app && m.host_ok()) {
            for (key, value) in &m.metadata {
                let entry = self
                    .seen
                    .entry((m.id.clone(), key.clone()))
                    .or_insert_with(|| (value.clone(), BTreeSet::new()));
                if entry.0 != *value {
                    *entry = (value.clone(), BTreeSet::new());
                }
                entry.1.insert(listing.by.clone());
            }
        }
        for w in self
            .writes
            .iter_mut()
            .filter(|w| w.app == app && !w.replaced)
        {
            let Some(m) = machines.get(&w.machine_id).filter(|m| m.host_ok()) else {
                continue;
            };
            if m.metadata.get(&w.key) == w.value.as_ref() {
                w.listed_in.push(listing.clone());
            } else {
                w.replaced = true;
            }
        }
    }
}

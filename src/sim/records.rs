//! Writing and reading records as the reconciler and its operators do:
//! sealed with the simulated fleet's record key ([`super::record_keys`]).
//!
//! [`SimHandle::set_metadata`] is what an agent can do (root in its machine:
//! any key of any machine of its app, no token, no key): never sealed. Tests
//! that stand in for the daemon or an operator write through these instead.

use super::handle::SimHandle;
use super::view::OperatorWriteRefused;

impl SimHandle {
    /// Writes `body` under `key`, sealed for the machine as the reconciler
    /// (or an operator) writes it; out of band like [`SimHandle::set_metadata`].
    pub fn set_sealed_metadata(&self, machine_id: &str, key: &str, body: &str) -> bool {
        let value = super::record_keys().seal(machine_id, key, body);
        self.set_metadata(machine_id, key, &value)
    }

    /// [`SimHandle::operator_set_metadata`] of `body`, sealed as the CLI writes it.
    pub fn operator_set_sealed_metadata(
        &self,
        machine_id: &str,
        key: &str,
        body: &str,
    ) -> Result<(), OperatorWriteRefused> {
        let value = super::record_keys().seal(machine_id, key, body);
        self.operator_set_metadata(machine_id, key, &value)
    }

    /// Every metadata write made through a machine's socket so far, in
    /// order, with the listings that showed it ([`super::SocketWrite`]).
    pub fn socket_writes(&self) -> Vec<super::SocketWrite> {
        self.shared.lock().socket.writes.clone()
    }

    /// Per lister ([`super::Listing::by`]), the request number of its latest
    /// full listing of any app: a process that listed again after a listing
    /// had finished the sweep that listing began (its loop is sequential).
    pub fn last_listings(&self) -> std::collections::BTreeMap<String, u64> {
        self.shared.lock().socket.last_listing.clone()
    }

    /// The record under `key` as the reconciler reads it: the body when the
    /// value is sealed for this machine and key; `None` when absent or not.
    pub fn sealed_metadata(&self, machine_id: &str, key: &str) -> Option<String> {
        let value = self.machine(machine_id)?.metadata.get(key)?.clone();
        open_record(machine_id, key, &value)
    }
}

/// `value` (the metadata value of `key` on `machine_id`) opened with the
/// simulated fleet's record key: the body when sealed for that machine and key.
pub fn open_record(machine_id: &str, key: &str, value: &str) -> Option<String> {
    match super::record_keys().open(machine_id, key, value) {
        crate::metadata::seal::Opened::Sealed { body, .. } => Some(body),
        _ => None,
    }
}

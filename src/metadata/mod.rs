//! Metadata: every key the daemon and its operators keep in Fly machine
//! metadata, each value's format and its parse.
//!
//! The state that must outlive this process lives on the machines (the
//! design's "state lives on the machines"): the rotation marker
//! ([`marker`]), an operator's hold and approval ([`operator`]), the
//! probe-failure record ([`unprobed`]) and, on the coordination machine, the
//! pool slot set ([`slots`]) and each app's halt record ([`halt`]). [`controls`] parses one machine's keys once,
//! when the sweep folds it into its report. The formats live here, beside
//! the flow rather than in it, so the code that writes a value
//! (`act::operator`, `act::executor`) and the code that reads it
//! (`observe::sweep`, then the planner and every view) name one definition
//! and cannot disagree. Every record the daemon or an operator relies on is
//! sealed with the record key ([`seal`]): agents can write their app's
//! metadata (docs/safety.md, "Threat model"). This module must never read or
//! write Fly, nor do any other I/O: it only says what a value is and how it
//! is spelled.

pub mod controls;
pub mod halt;
pub mod marker;
pub mod operator;
pub mod seal;
pub mod slots;
pub mod unprobed;

/// Metadata key of the rotation marker (JSON [`marker::Marker`], written
/// by the executor).
pub const MARKER_KEY: &str = "fleet_reconciler_rotation";
/// Metadata key of an operator hold (any value; `fleet-reconciler hold`
/// writes a JSON [`operator::Hold`]).
pub const HOLD_KEY: &str = "fleet_reconciler_hold";
/// Metadata key of an operator approval (JSON [`operator::Approval`]).
pub const APPROVE_KEY: &str = "fleet_reconciler_approve";
/// Metadata key of the probe-failure evidence (JSON [`unprobed::Unprobed`],
/// planned by the planner): when the agent stopped giving usable reports.
pub const UNPROBED_KEY: &str = "fleet_reconciler_unprobed";
/// Prefix of the coordinator's metadata key that keeps a machine's hold:
/// the authoritative copy, where agents cannot delete it (the machine's
/// [`HOLD_KEY`] is its mirror, for `fly machine status`).
pub const COORDINATOR_HOLD_PREFIX: &str = "fleet_reconciler_hold.";

/// The coordinator's metadata key of `machine_id`'s hold.
pub fn coordinator_hold_key(machine_id: &str) -> String {
    format!("{COORDINATOR_HOLD_PREFIX}{machine_id}")
}

/// Prefix of the coordinator's metadata key that lists the approvals
/// rotations consumed on a machine ([`operator::SpentApprovals`]): kept
/// where agents cannot delete it, so a consumed approval an agent writes
/// back onto its machine approves nothing.
pub const COORDINATOR_SPENT_PREFIX: &str = "fleet_reconciler_approval_spent.";

/// The coordinator's metadata key of `machine_id`'s consumed approvals.
pub fn coordinator_spent_key(machine_id: &str) -> String {
    format!("{COORDINATOR_SPENT_PREFIX}{machine_id}")
}

/// Metadata key of the slot set (JSON [`slots::SlotSet`]) on the
/// coordination machine.
pub const SLOTS_KEY: &str = "fleet_reconciler_slots";

/// Which value a metadata value is: the first 8 bytes of its SHA-256, in
/// hex. Only ever compared for equality (an approval's id, the record a
/// `cleared` note names).
pub fn value_fingerprint(value: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(value.as_bytes());
    hex::encode(digest.get(..8).unwrap_or_default())
}

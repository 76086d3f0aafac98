//! Metadata: every key the daemon and its operators keep in Fly machine
//! metadata, each value's format and its parse.
//!
//! The state that must outlive this process lives on the machines (the
//! design's "state lives on the machines"): the rotation marker
//! ([`marker`]), an operator's hold and approval ([`operator`]), the
//! probe-failure record ([`unprobed`]) and, on the coordination machine, the
//! pool slot set ([`slots`]). [`controls`] parses one machine's keys once,
//! when the sweep folds it into its report. The formats live here, beside
//! the flow rather than in it, so the code that writes a value
//! (`act::operator`, `act::executor`) and the code that reads it
//! (`observe::sweep`, then the planner and every view) name one definition
//! and cannot disagree. This module must never read or write Fly, nor do
//! any other I/O: it only says what a value is and how it is spelled.

pub mod controls;
pub mod marker;
pub mod operator;
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
/// Metadata key of the slot set (JSON [`slots::SlotSet`]) on the
/// coordination machine.
pub const SLOTS_KEY: &str = "fleet_reconciler_slots";

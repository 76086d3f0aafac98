//! Decide: snapshot + persisted markers + `now` → steps, alerts and a
//! decision per machine. Pure: no clients, no clock, no randomness.
//!
//! [`severity`] turns measured drift into a level and the pool's action (and
//! says why); [`rotation`] is the rotation state machine's marker, as it is
//! persisted in machine metadata; [`planner::plan`] applies holds, approvals,
//! pool caps, the live-work guards and every ceiling of the rotation, and
//! names a [`decision::Decision`] for each machine. Nothing under `decide`
//! performs a step or reads the world itself.

pub mod controls;
pub mod decision;
pub mod planner;
pub mod rotation;
pub mod severity;

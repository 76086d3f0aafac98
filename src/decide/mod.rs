//! Decide: snapshot + persisted markers + `now` → steps, alerts and a
//! decision per machine. Pure: no clients, no clock, no randomness.
//!
//! [`severity`] turns measured drift into a level and the pool's action (and
//! says why); [`planner::plan`] applies holds, approvals, pool caps, the
//! live-work guards and every ceiling of the rotation state machine (whose
//! marker, like every value kept in machine metadata, is
//! [`crate::metadata`]'s), and names a [`decision::Decision`] for each
//! machine. Nothing under `decide` performs a step or reads the world itself.

pub mod decision;
pub mod planner;
pub mod policy;
pub mod severity;
pub mod step;

//! Act: the only code that changes the world.
//!
//! [`executor`] carries out the planner's steps under Fly leases, re-checking
//! each step's preconditions at the moment of action, writing the marker
//! before each disruptive call and keeping the pool slot set (whose format
//! and rules are [`crate::metadata::slots`]) that keeps caps exact across
//! replicas; [`operator`] writes an operator's holds, releases and
//! approvals. Nothing under `act` decides what should happen: it refuses (a
//! typed `Declined`) when the world no longer matches the plan.

pub mod executor;
pub mod operator;

//! Decide: a [`policy::Policy`], the judged snapshot, persisted markers and
//! `now` → a [`planner::Plan`]: one [`planner::MachinePlan`] per machine (its
//! decision, at most one step, its drift clock) and the alerts that hold.
//! Pure: no clients, no clock, no randomness.
//!
//! [`policy`] is the narrow view of the config that deciding reads, built
//! once; [`severity`] turns measured drift into a level and the pool's action
//! (and says why); [`planner::plan`] applies holds, approvals, pool caps, the
//! live-work guards and every ceiling of the rotation state machine (whose
//! marker, like every value kept in machine metadata, is
//! [`crate::metadata`]'s), and names a [`decision::Decision`] for each
//! machine; [`step`] is the shape of what it asks the executor to do, and
//! why. Nothing under `decide` performs a step or reads the world itself.

pub mod decision;
pub mod planner;
pub mod policy;
pub mod severity;
pub mod step;

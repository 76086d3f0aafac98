//! Decide: `Observation → prepare → Snapshot → plan → Plan`. Pure: no
//! clients, no clock, no randomness.
//!
//! [`prepare()`] turns what one sweep saw ([`crate::observe::sweep::Observation`])
//! into the [`Snapshot`] everything downstream reads: each drifted row judged
//! ([`severity`]: measured drift → a level, the pool's action, and why),
//! stale apps' last listings carried ([`listings`]), coherence computed, and
//! the planner's memory ([`tracker::Tracker`]) brought up to date.
//! [`plan`] then applies holds, approvals, pool caps, the live-work guards
//! and every ceiling of the rotation state machine to the snapshot, under a
//! [`policy::Policy`] built once, and returns a [`Plan`]: one
//! [`planner::MachinePlan`] per machine (its [`decision::Decision`], at most
//! one [`step`], its drift clock) and the machine alerts that hold.
//! [`alerts::evaluate`] then turns each turn (swept or failed) into its
//! complete [`alerts::AlertSet`]: the plan's alerts, those carried over, and
//! the fleet's (coherence, sweeps, tip, unlistable apps), judged on the
//! sweep's [`coherence::CoherenceSample`]. [`incidents`] folds that set
//! into incidents (`alerts.group_by`) and [`voice`] decides what of that set
//! this replica may say now (the hold-down of `alerts.resolve_after`, and no
//! word from a view older than `alerts.stale_after`); the notifier only
//! applies its verdict. Nothing under
//! `decide` performs a step or reads the world itself.

pub mod alerts;
pub mod coherence;
pub mod decision;
pub mod guardrail;
pub mod halt;
pub mod incidents;
pub mod listings;
pub mod planner;
pub mod policy;
pub mod prepare;
pub mod reason;
pub mod severity;
pub mod snapshot;
pub mod step;
pub mod tracker;
pub mod voice;

pub use planner::{Plan, plan};
pub use prepare::prepare;
pub use snapshot::Snapshot;

//! Report: what the daemon tells people and programs about the fleet.
//!
//! [`render`] turns a `FleetReport` and a plan into tables and JSON (the
//! CLI); [`metrics`] owns the Prometheus registry; [`server`] serves
//! `/metrics`, health, the fleet API, the admin POSTs and the status pages;
//! [`notify`] pages on-call through webhooks; [`wire`] owns the fleet
//! document's JSON shape. Nothing under `report`
//! computes a status, a severity or a decision: it shows the sweep's and the
//! planner's.

pub mod metrics;
pub mod notify;
pub mod render;
pub mod server;
pub mod wire;

//! Report: what the daemon tells people and programs about the fleet.
//!
//! [`reporter`] turns each cycle of `run` into metrics, the server's view
//! and notifications, keeping each machine's [`history`] and each sweep's
//! [`coherence`] figures; [`render`] turns a
//! `FleetReport` and a plan into tables and JSON (the CLI); [`metrics`] owns
//! the Prometheus registry; [`server`] serves `/metrics`, health, the fleet
//! API, the admin POSTs and the status pages; [`notify`] pages on-call
//! through webhooks; [`wire`] owns the fleet document's JSON shape. Nothing
//! under `report` computes a status, a severity or a decision: it shows the
//! sweep's and the planner's.

pub mod coherence;
pub mod history;
pub mod metrics;
pub mod notify;
pub mod render;
pub mod reporter;
pub mod server;
pub mod wire;

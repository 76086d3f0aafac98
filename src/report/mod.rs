//! Report: what the daemon tells people and programs about the fleet.
//!
//! [`reporter`] turns each cycle of `run` into metrics, the server's view
//! and notifications, keeping each machine's [`history`] and the alert
//! rules' memory; [`wire`] owns the fleet document
//! ([`wire::FleetDocument`]: built at the edge from a `decide::Snapshot`,
//! written by `check --output json` and `GET /api/v1/fleet`, and read back
//! by `status` as the same type); [`render`] turns that document, or a
//! snapshot and its plan, into tables and JSON (the CLI); [`metrics`] owns
//! the Prometheus registry; [`server`] serves `/metrics`, health, the fleet
//! API, the admin POSTs and the status pages; [`notify`] pages on-call
//! through webhooks. Nothing under `report` computes a status, a severity,
//! a coherence figure, an alert or a decision: it shows and delivers the
//! snapshot's, the planner's and `decide::alerts`'.

pub mod history;
pub mod metrics;
pub mod notify;
pub mod render;
pub mod reporter;
pub mod server;
pub mod wire;

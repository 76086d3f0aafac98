//! The integration tests, in one binary: one build and link instead of one
//! per file, and one harness that runs every test of every file side by
//! side (most of them wait on loopback HTTP, child processes and sweep
//! intervals, not on the CPU). Each module is one former `tests/*.rs` file;
//! `common` is their shared world (repositories, configs, polling, child
//! guards).
//!
//! They drive the simulated fleet, so they build only with the `sim` feature
//! (on by default; Cargo.toml).
#![cfg(feature = "sim")]

mod common;

mod agent_example;
mod alertmanager_sink;
mod chaos;
mod check;
mod demo;
mod deploy;
mod docs;
mod fly;
mod gate;
mod grouped_alerts;
mod guardrail_replicas;
mod guardrails;
mod halt;
mod hardening;
mod health_urls;
mod heartbeat;
mod metrics;
mod notify;
mod one_voice;
mod operator_cli;
mod overlay;
mod parsers_props;
mod pilot;
mod planner_props;
mod preflight;
mod probe;
mod protocol_model;
mod readyz;
mod release_check;
mod rogue;
mod rotation;
mod run;
mod server;
mod service;
mod sim;
mod unlistable_app;

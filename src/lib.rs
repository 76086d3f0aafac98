//! fleet-reconciler: keeps long-running agents on Fly Machines on the released overlay.
//!
//! Agents load an overlay commit (skills, connectors, security policies) at
//! start and run for days; this daemon finds the ones that trail the release
//! branch and reports (and, per policy, remediates) the drift. See
//! `docs/design.md` for the design (architecture, contracts, the rotation
//! state machine).
//!
//! # Layout: observe → decide → act
//!
//! | module | concern |
//! | --- | --- |
//! | [`clock`] | the wall clock of the loop, executor and service (a tokio-driven one for tests) |
//! | [`config`] | the TOML config, validated while parsed |
//! | [`model`] | shared vocabulary: `CommitId`, `MachineStatus`, `Severity`, `PolicyAction` |
//! | [`fly`] | Fly Machines API client: typed calls, retries, leases, metadata |
//! | [`http`] | shared outbound HTTP helpers (user agent, URL-free error text) |
//! | [`logging`] | the log writer: one event per line, control characters escaped |
//! | [`probe`] | concurrent, size- and time-bounded agent health polling |
//! | [`overlay`] | the git mirror: tip, ref resolution, one graph walk for every drift range, per-commit facts |
//! | [`severity`] | drift → severity (ordered rules) → the pool's action (pure), and the reason: rule, evidence, missing commits |
//! | [`rotation`] | the rotation marker persisted in machine metadata |
//! | [`slots`] | pool slots on the coordination machine: exact caps across replicas |
//! | [`reconcile`] | the pure planner: snapshot + markers + now → steps, alerts and a decision per machine |
//! | [`decision`] | the planner's typed decision per machine, which every view renders |
//! | [`executor`] | carries out steps under Fly leases; writes markers before acting |
//! | [`sweep`] | one read-only pass over the fleet → `FleetReport` |
//! | [`daemon`] | wiring from config + secrets, and the reconcile loop (fetch, sweep, plan, act) |
//! | [`events`] | alerts (conditions) and one-shot action events for on-call |
//! | [`operator`] | hold / release / approve as Fly metadata writes |
//! | [`notify`] | webhook alerts: dedupe, repeat, resolve; json/slack/pagerduty delivery with retries and dead letters; the alert state file that carries them over restarts |
//! | [`metrics`] | the Prometheus registry: every series of docs/design.md §7, one struct |
//! | [`report`] | the table and JSON renderings of a `FleetReport` |
//! | [`server`] | axum: `/metrics`, health, `/api/v1/...`, admin POSTs, status page |
//! | [`service`] | the `run` command: loop + metrics + server + notifier, graceful shutdown |
//! | [`sim`] | a simulated Fly API and agent fleet (demo, tests, benchmarks) |
//! | [`demo`] | the `demo` command's scenario |
//!
//! # Design notes
//!
//! * **Level-triggered.** Every sweep recomputes from the world (machines,
//!   reports, the repository) rather than reacting to events, so a missed
//!   event or a restart of the daemon loses nothing.
//! * **Per-machine trouble is data.** An agent that hangs, lies or answers
//!   garbage gets a status in the report, and an app that cannot be listed
//!   is reported stale (its last listing, the error, its age) while the
//!   others are swept and reconciled as usual, and nothing is done to its
//!   machines; only failures that make the whole picture untrustworthy (no
//!   app can be listed, git failing) fail a sweep.
//! * **State lives on the machines.** A rotation's marker, an operator's hold
//!   and an approval are Fly machine metadata, not files of this process: a
//!   restarted reconciler, or a second replica, reads the same truth and
//!   resumes each rotation with its original deadlines. Fly leases fence every
//!   mutating sequence, and a slot set changed only under one coordination
//!   machine's lease keeps pool caps exact across replicas (see [`slots`]).
//! * **Pure planning.** [`reconcile::plan`] takes the snapshot, the markers
//!   in it, a small in-memory tracker and `now`, and returns steps; no clock,
//!   no network. The executor is the only code that writes to Fly or agents.
//! * **Secrets stay at the edge.** The config names environment variables;
//!   `main` reads them and hands them to the clients, which never log them.

pub mod clock;
pub mod config;
pub mod daemon;
pub mod decision;
pub mod demo;
pub mod events;
pub mod executor;
pub mod fly;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod notify;
pub mod operator;
pub mod overlay;
pub mod probe;
pub mod reconcile;
pub mod report;
pub mod rotation;
pub mod server;
pub mod service;
pub mod severity;
pub mod sim;
pub mod slots;
pub mod sweep;

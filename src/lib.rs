//! fleet-reconciler: keeps long-running agents on Fly Machines on the released overlay.
//!
//! Agents load an overlay commit (skills, connectors, security policies) at
//! start and run for days; this daemon finds the ones that trail the release
//! branch and reports (and, per policy, remediates) the drift. See
//! `docs/design.md` for the design (architecture, contracts, the rotation
//! state machine).
//!
//! # Layout: observe → decide → act → report
//!
//! One sweep, from `main`: [`service::run`] (or `check`/`plan` in
//! [`daemon`]) drives [`daemon::reconcile_loop`], whose every turn fetches the
//! overlay, calls [`observe`] for an observation (what was seen, no
//! verdict), [`decide`] to prepare it into a snapshot (verdicts, stale
//! apps' last listings, coherence) and plan on it, and [`act`] for the
//! steps; [`report`] shows the result (and builds the wire document from
//! the snapshot at the edge). Calls go only
//! downstream, and so do types: a stage names its own types, those of the
//! stages before it, and the shared vocabulary beside the flow ([`model`],
//! [`metadata`], [`events`], [`config`], ...), never a later stage's. So
//! what is kept in machine metadata is [`metadata`]'s, not the writer's
//! (`act`) nor the planner's (`decide`), though the sweep reads it first.
//!
//! | module | concern |
//! | --- | --- |
//! | [`observe`] | read-only: [`observe::sweep`] (one pass → `Observation`: what was seen, no verdict), [`observe::probe`] (bounded health polling), [`observe::overlay`] (the git mirror: tip, ref resolution, one graph walk for every drift range) |
//! | [`decide`] | pure: `Observation → prepare → Snapshot → plan → Plan`. [`decide::snapshot`] ([`decide::prepare`]: judge, carry stale apps' last listings ([`decide::listings`]), coherence, tracker → `Snapshot`), [`decide::severity`] (drift → level → the pool's action) and [`decide::reason`] (why: the typed `Reason`), [`decide::planner`] (snapshot + markers + now → one `MachinePlan` per machine, alerts), [`decide::decision`] (the typed decision every view renders), [`decide::alerts`] (the alert kinds' table, [`decide::alerts::kinds`], and the rules: each turn → its complete `AlertSet`), [`decide::incidents`] (the alert set folded into incidents by `alerts.group_by`), [`decide::voice`] (which incidents this replica may speak of now: hold-down, freshness) |
//! | [`act`] | writes: [`act::executor`] (steps under Fly leases, markers before acting, pool slots under the coordinator's lease), [`act::operator`] (hold / release / approve / revoke) |
//! | [`report`] | views: [`report::wire`] (the fleet document: written from a `Snapshot`, read back by `status` as the same type), [`report::render`] (tables, JSON), [`report::metrics`] (the Prometheus registry), [`report::server`] (axum: `/metrics`, health, `/api/v1/...`, admin POSTs, status pages), [`report::notify`] (alert delivery to every sink: dedupe, repeat, resolve, delivery, dead letters; no alert decisions) |
//! | [`cli`] | the command line: its grammar (clap: what `main` parses and the doc check reads) and each command's workflow, one file a command (`main` only dispatches) |
//! | [`daemon`] | wiring from config + secrets, and the loop (fetch, sweep, plan, act) |
//! | [`service`] | the `run` command: loop + metrics + server + notifier, graceful shutdown |
//! | [`preflight`] | the `preflight` command's checks (secrets, apps with their own tokens, coordinator, overlay, webhooks, health sample), typed findings |
//! | [`fly`] | the Fly Machines API client: typed calls, retries, leases, metadata |
//! | [`heap`] | the allocator's settings: one malloc arena, freed pages handed back after each sweep |
//! | [`config`] | the TOML config, validated while parsed |
//! | [`metadata`] | what is kept in Fly machine metadata, each key's format and parse (no I/O): [`metadata::marker`] (the rotation marker), [`metadata::operator`] (hold, approval), [`metadata::unprobed`] (the probe-failure record), [`metadata::slots`] (exact pool caps across replicas), [`metadata::controls`] (one machine's keys, parsed once) |
//! | [`model`] | shared vocabulary: ids (`MachineId`, `AppName`, `CommitId`), `MachineState`, `MachineStatus`, `Severity`, `PolicyAction`, `MissingCommit` |
//! | [`events`] | one-shot action events for on-call, and the `DedupKey` of alerts, incidents and events (the alert kinds are [`decide::alerts`]') |
//! | [`clock`] | the wall clock of the loop, executor and service (a tokio-driven one for tests) |
//! | [`http`] | shared outbound HTTP helpers (user agent, URL-free error text) |
//! | [`text`] | bounds on text from outside (reports, metadata, Fly errors) and the decoder of a JSON value someone else wrote |
//! | [`logging`] | the log writer (one event per line, control characters escaped) and the `RUST_LOG` filter |
//! | [`signal`] | SIGTERM / ctrl-c as a cancellation (`run`, `demo`) |
//! | `sim` | a simulated Fly API and agent fleet (demo, tests, benchmarks); only with the `sim` feature |
//! | `demo` | the `demo` command's scenario; only with the `sim` feature |
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
//!   machine's lease keeps pool caps exact across replicas (see [`metadata::slots`]).
//! * **Pure planning.** [`decide::planner::plan`] takes the snapshot, the markers
//!   in it, a small in-memory tracker and `now`, and returns steps; no clock,
//!   no network. The executor is the only code that writes to Fly or agents.
//! * **Secrets stay at the edge.** The config names environment variables;
//!   the command line ([`cli`]) reads them and hands them to the clients,
//!   which never log them.
//! * **The simulator is not production code.** `sim` and `demo` exist only
//!   with the `sim` cargo feature (on by default, for `demo`, the tests and
//!   the benches); `.ci/run` builds the library and the binary without it,
//!   so no production module can come to depend on them.

pub mod act;
pub mod decide;
pub mod observe;
pub mod report;

pub mod cli;
pub mod clock;
pub mod config;
pub mod daemon;
#[cfg(feature = "sim")]
pub mod demo;
pub mod events;
pub mod fds;
pub mod fly;
pub mod heap;
pub mod http;
pub mod json_stream;
pub mod logging;
pub mod metadata;
pub mod model;
pub mod preflight;
pub mod service;
pub mod signal;
#[cfg(feature = "sim")]
pub mod sim;
pub mod text;

/// Properties of the vocabulary as a whole, across the modules that name it.
#[cfg(test)]
mod tests {
    use serde::Serialize;

    /// The strum-derived names (metric labels, tables, logs) are the serde
    /// names (JSON, config, markers), for every enum that has both.
    #[test]
    fn strum_names_are_the_serde_names() {
        use crate::events::EventKind;
        use crate::metadata::marker::{Ending, Phase, RotationMode};
        use crate::model::{MachineStatus, PolicyAction, Severity};
        use crate::report::notify::Status;
        use strum::VariantArray;

        fn same<T: Serialize>(values: &[T], name: impl Fn(&T) -> String) {
            for v in values {
                assert_eq!(serde_json::to_value(v).unwrap(), name(v).as_str());
            }
        }
        same(&MachineStatus::ALL, |v| v.as_str().to_owned());
        same(&MachineStatus::ALL, |v| v.to_string());
        same(&Severity::ALL, |v| v.as_str().to_owned());
        same(&Severity::ALL, |v| v.to_string());
        same(PolicyAction::VARIANTS, |v| v.as_str().to_owned());
        same(PolicyAction::VARIANTS, |v| v.to_string());
        same(Phase::VARIANTS, |v| v.as_str().to_owned());
        same(Phase::VARIANTS, |v| v.to_string());
        same(Ending::VARIANTS, |v| v.as_str().to_owned());
        same(RotationMode::VARIANTS, |v| v.as_str().to_owned());
        same(EventKind::VARIANTS, |v| v.name().to_owned());
        same(Status::VARIANTS, |v| v.as_str().to_owned());
    }
}

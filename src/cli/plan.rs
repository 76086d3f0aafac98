//! `plan`: one read-only sweep and the plan a daemon would make of it.

use std::process::ExitCode;
use std::sync::Arc;

use super::output::{exit_code_of, print_document};
use super::{ConfigPath, owner_id, secrets_from_env};
use crate::cli::Output;
use crate::clock::SystemClock;
use crate::daemon;
use crate::report::render;
use crate::report::wire::FleetDocument;

/// `plan`: one read-only sweep, then each machine's decision and the steps.
pub async fn plan(config_path: &ConfigPath, output: Output) -> anyhow::Result<ExitCode> {
    let config = Arc::new(config_path.load()?);
    let secrets = secrets_from_env(&config)?;
    let mut sweeper = daemon::connect(config.clone(), &secrets).await?;
    sweeper.gate = daemon::alert_gate(&config, super::gate_url_from_env(&config).as_ref())?;
    // One sweep: no connection is kept for a next one.
    sweeper.prober = sweeper.prober.once();
    let (fleet, plan) = daemon::plan_once(&sweeper, &owner_id(), &SystemClock).await?;
    match output {
        Output::Json => print_document(&render::plan_to_json(&fleet, &plan)),
        Output::Text => {
            eprintln!(
                "(a one-shot plan: drift is taken as seen for rotation.min_drift_age; nothing is written)"
            );
            print!("{}", render::plan_to_table(&fleet, &plan));
        }
    }
    Ok(exit_code_of(&FleetDocument::of(&fleet)))
}

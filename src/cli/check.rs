//! `check`: one read-only sweep, reported.

use std::process::ExitCode;
use std::sync::Arc;

use super::output::print_fleet;
use super::{ConfigPath, owner_id, secrets_from_env};
use crate::cli::Output;
use crate::clock::SystemClock;
use crate::daemon;
use crate::report::wire::FleetDocument;

/// `check`: one read-only sweep, reported.
pub async fn check(config_path: &ConfigPath, output: Output) -> anyhow::Result<ExitCode> {
    let config = Arc::new(config_path.load()?);
    let secrets = secrets_from_env(&config)?;
    let mut sweeper = daemon::connect(config, &secrets).await?;
    // One sweep: no connection is kept for a next one.
    sweeper.prober = sweeper.prober.once();
    match output {
        // The document for programs stays the sweep's alone: no
        // planner time or memory at 10,000 machines, no bytes per
        // machine (`plan --output json` has the decisions).
        Output::Json => {
            let fleet = daemon::check(&sweeper).await?;
            Ok(print_fleet(&FleetDocument::of(&fleet), output))
        }
        // The table's DECISION column: the planner's, as `plan` makes it.
        Output::Text => {
            let (fleet, plan) = daemon::plan_once(&sweeper, &owner_id(), &SystemClock).await?;
            Ok(print_fleet(&FleetDocument::planned(&fleet, &plan), output))
        }
    }
}

//! `hold`: an operator hold written.

use super::output::Done;
use super::{ConfigPath, operator, secrets_from_env};
use crate::metadata::operator::Hold;

pub async fn hold(
    config_path: &ConfigPath,
    machine: &str,
    by: String,
    reason: String,
) -> anyhow::Result<Done> {
    // Typed once: the operator takes a `MachineId`.
    let machine = &crate::model::MachineId::from(machine);
    let config = config_path.load()?;
    let secrets = secrets_from_env(&config)?;
    let hold = Hold {
        by,
        reason,
        at: chrono::Utc::now(),
    };
    let written = operator(&config, &secrets)?
        .hold(machine, &hold.by, &hold.reason, hold.at)
        .await?;
    let app = &written.app;
    let mut text = format!(
        "held: {app}/{machine}; no reconciler acts on it until `fleet-reconciler release {machine}`"
    );
    if !written.fenced {
        text.push_str(" (the machine's lease stayed taken, so the hold was written without it: reconcilers honour it from their next call)");
    }
    let json = serde_json::json!({ "app": app, "machine_id": machine, "hold": hold, "fenced": written.fenced });
    Ok(Done::new("hold", text, json))
}

//! `release`: an operator hold cleared.

use super::output::Done;
use super::{ConfigPath, operator, secrets_from_env};
use crate::metadata::HOLD_KEY;
use crate::metadata::operator::Hold;

pub async fn release(config_path: &ConfigPath, machine: &str) -> anyhow::Result<Done> {
    // Typed once: the operator takes a `MachineId`.
    let machine = &crate::model::MachineId::from(machine);
    let config = config_path.load()?;
    let secrets = secrets_from_env(&config)?;
    let operator = operator(&config, &secrets)?;
    // The hold as it stands just before it is cleared, to say what was
    // removed (a hold written by `hold` or the admin API is a JSON
    // object; any other value is shown as the string it is).
    let (_, found) = operator.locate(machine).await?;
    let removed = found.metadata(HOLD_KEY)?.map(|v| {
        // A sealed hold is shown as its record.
        let text = crate::metadata::seal::body_unverified(v);
        serde_json::from_str::<Hold>(text.as_deref().unwrap_or(v))
            .ok()
            .and_then(|h| serde_json::to_value(h).ok())
            .unwrap_or_else(|| v.into())
    });
    let app = operator.release(machine).await?;
    let text = format!("released: {app}/{machine} is managed again");
    let json = serde_json::json!({
        "app": app,
        "machine_id": machine,
        "released": true,
        "hold": removed,
    });
    Ok(Done::new("release", text, json))
}

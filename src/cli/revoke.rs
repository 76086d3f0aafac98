//! `revoke`: a pending approval removed.

use super::output::Done;
use super::{ConfigPath, operator, secrets_from_env};
use crate::metadata::operator::Approval;

pub async fn revoke(config_path: &ConfigPath, machine: &str) -> anyhow::Result<Done> {
    // Typed once: the operator takes a `MachineId`.
    let machine = &crate::model::MachineId::from(machine);
    let config = config_path.load()?;
    let secrets = secrets_from_env(&config)?;
    let revoked = operator(&config, &secrets)?.revoke(machine).await?;
    let app = &revoked.app;
    // The approval removed, as written (an approval not written by
    // `approve` or the admin API is shown as the string it is).
    let approval = revoked.removed.as_deref().map(|v| {
        Approval::parse(v)
            .and_then(|a| serde_json::to_value(a).ok())
            .unwrap_or_else(|| v.into())
    });
    let text = match &approval {
        None => format!("revoked: {app}/{machine} had no approval; nothing changed"),
        Some(_) => format!(
            "revoked: {app}/{machine} no longer has an approval; a manual rotation waits for `fleet-reconciler approve {machine}`"
        ),
    };
    let json = serde_json::json!({
        "app": app,
        "machine_id": machine,
        "revoked": approval.is_some(),
        "approval": approval,
        "fenced": revoked.fenced,
    });
    Ok(Done::new("revoke", text, json))
}

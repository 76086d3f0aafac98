//! `resume`: a halted release lifted (`[release] halt_after_failures`).

use super::output::Done;
use super::{ConfigPath, operator, secrets_from_env};
use crate::model::{AppName, CommitId};

pub async fn resume(
    config_path: &ConfigPath,
    app: &str,
    tip: Option<&str>,
    by: String,
) -> anyhow::Result<Done> {
    let app = AppName::from(app);
    let tip = tip
        .map(|t| {
            CommitId::parse(t).ok_or_else(|| {
                anyhow::anyhow!("--tip {t:?} is not a full commit id (40 hex digits)")
            })
        })
        .transpose()?;
    let config = config_path.load()?;
    let secrets = secrets_from_env(&config)?;
    let resumed = operator(&config, &secrets)?
        .resume(&app, tip.as_ref(), &by, chrono::Utc::now())
        .await?;
    let text = match &resumed.written {
        Some(crate::metadata::halt::HaltRecord::Resumed { tip, lifted, .. }) => format!(
            "resumed: the release {} of {app} is no longer halted ({} failed rotation(s) lifted); new failures count toward a new halt",
            crate::model::short_commit(tip.as_str()),
            lifted.len()
        ),
        _ => format!(
            "resumed: {app}'s halt record was not one this fleet sealed and was deleted; its release is no longer halted"
        ),
    };
    let json = serde_json::json!({
        "app": app,
        "resumed": true,
        "halt": resumed.halt,
        "record": resumed.written,
    });
    Ok(Done::new("resume", text, json))
}

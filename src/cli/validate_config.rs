//! `validate-config`: the config's offline checks.

use super::ConfigPath;
use super::error::CliError;
use super::output::Done;
use crate::preflight;

pub fn validate_config(config_path: &ConfigPath, check_env: bool) -> anyhow::Result<Done> {
    let config = config_path.load()?;
    let path = &config_path.path;
    let lookup = |var: &str| std::env::var(var).ok();
    let findings = preflight::offline(&config, &lookup, check_env);
    let problems: Vec<String> = findings
        .failures()
        .map(|f| match &f.fix {
            Some(fix) => format!("{} {} (fix: {fix})", f.subject, f.detail),
            None => format!("{} {}", f.subject, f.detail),
        })
        .collect();
    if !problems.is_empty() {
        return Err(CliError::NotReady { problems }.into());
    }
    let text = format!(
        "{}: ok ({} app(s), {} pool(s), {} severity rule(s), {} webhook(s){})",
        path.display(),
        config.apps.len(),
        config.pools.len(),
        config.severity.len(),
        config.alerts.webhooks.len(),
        if check_env {
            "; every variable it names is set"
        } else {
            ""
        }
    );
    let json = serde_json::json!({
        "valid": true,
        "config": path.display().to_string(),
        "apps": config.apps.len(),
        "pools": config.pools.keys().collect::<Vec<_>>(),
        "severity_rules": config.severity.len(),
        "webhooks": config.alerts.webhooks.len(),
        "env_checked": check_env,
    });
    Ok(Done::new("validate-config", text, json))
}

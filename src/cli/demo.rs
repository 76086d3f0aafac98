//! `demo`: the simulated fleet (only with the `sim` feature).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;

use crate::demo;

/// `demo`: the simulated fleet, on the built-in config or `demo_config`.
pub async fn run_demo(
    sweeps: u32,
    demo_config: Option<PathBuf>,
    keep_running: bool,
    alertmanager: Option<String>,
    verbose: bool,
) -> anyhow::Result<ExitCode> {
    let text = match &demo_config {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?,
        None => demo::DEMO_CONFIG.to_string(),
    };
    let path = demo_config.unwrap_or_else(|| PathBuf::from("config/demo.toml"));
    demo::run(demo::DemoOptions {
        config_path: path,
        config_text: text,
        sweeps,
        keep_running,
        alertmanager,
        verbose,
    })
    .await?;
    Ok(ExitCode::SUCCESS)
}

//! `run`: the daemon, from the config and the environment's secrets.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use super::{ConfigPath, owner_id, service_secrets_from_env};
use crate::service;

/// `run`: the daemon, until SIGTERM or ctrl-c.
pub async fn run_daemon(config_path: &ConfigPath) -> anyhow::Result<ExitCode> {
    let config = Arc::new(config_path.load()?);
    let secrets = service_secrets_from_env(&config)?;
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .with_context(|| format!("cannot listen on {} (server.listen)", config.server.listen))?;
    let owner = owner_id();
    let shutdown = CancellationToken::new();
    tokio::spawn(crate::signal::cancel_on_signal(shutdown.clone()));
    service::run(
        service::RunArgs::new(config, secrets, listener, owner, shutdown),
        |_| {},
    )
    .await?;
    Ok(ExitCode::SUCCESS)
}

//! The command line: its grammar (`grammar`, clap) and each command's
//! workflow, one file a command, with what they share here (the config
//! file chosen, the secrets read from the environment, this process's
//! owner id) and in [`output`] and [`error`]. `main` parses and dispatches
//! to them; nothing else calls them.
//!
//! This is the edge of the program, like `main`: it reads the environment
//! and the terminal, prints, and its errors are `anyhow` errors whose
//! causes [`error::error_object`] types into a stable `kind`. The library
//! below it takes its secrets and config as arguments and never reads them.

mod grammar;

pub mod approve;
pub mod check;
#[cfg(feature = "sim")]
pub mod demo;
pub mod error;
pub mod hold;
pub mod output;
pub mod plan;
pub mod preflight;
pub mod release;
pub mod resume;
pub mod revoke;
pub mod run;
pub mod status;
pub mod validate_config;

pub use grammar::*;

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Context as _;
use secrecy::SecretString;

use crate::act::operator::Operator;
use crate::config::{Config, ConfigError};
use crate::daemon::{self, Secrets};
use crate::fly::FlyTokens;
use crate::report::notify;
use crate::service::ServiceSecrets;

use error::CliError;

/// The environment variable naming the config file when `--config` is not given.
pub const CONFIG_ENV: &str = "FLEET_RECONCILER_CONFIG";

/// The config file when neither `--config` nor [`CONFIG_ENV`] names one: the
/// image's path, the same from any working directory.
pub const DEFAULT_CONFIG: &str = "/etc/fleet-reconciler/fleet-reconciler.toml";

/// The config file and what chose it: `--config` wins over
/// `FLEET_RECONCILER_CONFIG`, which wins over the default.
pub struct ConfigPath {
    pub path: PathBuf,
    pub from: &'static str,
}

impl ConfigPath {
    pub fn choose(flag: Option<PathBuf>) -> ConfigPath {
        match flag {
            Some(path) => ConfigPath {
                path,
                from: "--config",
            },
            None => match std::env::var_os(CONFIG_ENV).filter(|v| !v.is_empty()) {
                Some(path) => ConfigPath {
                    path: path.into(),
                    from: CONFIG_ENV,
                },
                None => ConfigPath {
                    path: DEFAULT_CONFIG.into(),
                    from: "the default",
                },
            },
        }
    }

    pub fn load(&self) -> anyhow::Result<Config> {
        Config::load(&self.path).map_err(|e| match e {
            ConfigError::Read { .. } => {
                // The path as tried, so a relative one says where from.
                let tried = std::path::absolute(&self.path).unwrap_or(self.path.clone());
                let hint = format!(
                    "config file {} (from {}) cannot be read; name another with --config PATH or {CONFIG_ENV}",
                    tried.display(),
                    self.from
                );
                anyhow::Error::new(e).context(hint)
            }
            // Already names the file, the key and the line.
            ConfigError::Invalid { .. } => e.into(),
        })
    }
}

/// The daemon's address from `server.listen` of the config (loopback when
/// it listens on every address).
pub fn daemon_url(config: &Config) -> String {
    let addr = config.server.listen;
    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        addr.ip().to_string()
    };
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    format!("http://{host}:{}", addr.port())
}

pub fn operator(config: &Config, secrets: &Secrets) -> anyhow::Result<Operator> {
    Ok(Operator::new(
        daemon::fly_client(config, secrets)?,
        config,
        secrets.record_keys.clone(),
    ))
}

/// Identifies this reconciler in markers and leases: the Fly machine id when
/// running on Fly, else the host name, plus the process id.
pub fn owner_id() -> String {
    let host = std::env::var("FLY_MACHINE_ID")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "local".into());
    format!("{host}-{}", std::process::id())
}

pub fn service_secrets_from_env(config: &Config) -> anyhow::Result<ServiceSecrets> {
    let core = secrets_from_env(config)?;
    let mut agent_tokens = HashMap::new();
    for app in &config.apps {
        if let Some(var) = &app.agent_token_env {
            let token = env_secret(var).with_context(|| {
                format!(
                    "{var} is not set (apps.agent_token_env of app {})",
                    app.name
                )
            })?;
            agent_tokens.insert(app.name.to_string(), token);
        }
    }
    let admin_token = env_secret(&config.server.admin_token_env);
    if admin_token.is_none() {
        tracing::warn!(env = %config.server.admin_token_env, "admin API disabled: the variable is not set");
    }
    let webhooks = notify::sink_secrets_from_env(&config.alerts, |k| std::env::var(k).ok())?;
    let alertmanagers =
        notify::alertmanager_urls_from_env(&config.alerts, |k| std::env::var(k).ok())?;
    let heartbeats = notify::heartbeat_urls_from_env(&config.alerts, |k| std::env::var(k).ok())?;
    let gate_url = gate_url_from_env(config);
    Ok(ServiceSecrets {
        core,
        agent_tokens,
        admin_token,
        webhooks,
        alertmanagers,
        heartbeats,
        gate_url,
    })
}

/// Alertmanager's URL for the alert gate (`gates.alertmanager.url_env`),
/// if configured and set ([`daemon::alert_gate`] refuses a configured gate
/// without it).
pub fn gate_url_from_env(config: &Config) -> Option<SecretString> {
    env_secret(&config.gates.alertmanager.as_ref()?.url_env)
}

/// The Fly token of every app (each one's own, [`Config::fly_tokens`]) and
/// the overlay token. Every missing Fly token is named in one error.
pub fn secrets_from_env(config: &Config) -> anyhow::Result<Secrets> {
    let mut apps = std::collections::BTreeMap::new();
    let mut missing: Vec<(String, Vec<String>)> = Vec::new();
    let env = |k: &str| std::env::var(k).ok();
    for t in config.fly_tokens() {
        match env_secret(t.source(&env)) {
            Some(token) => {
                apps.insert(t.app.clone(), token);
            }
            None => match missing.iter_mut().find(|(var, _)| var == t.var) {
                Some((_, names)) => names.push(t.app.to_string()),
                None => missing.push((t.var.to_string(), vec![t.app.to_string()])),
            },
        }
    }
    if !missing.is_empty() {
        return Err(CliError::FlyTokenMissing { missing }.into());
    }
    Ok(Secrets {
        // No fallback: a call on an app the config does not name has no token.
        fly_token: FlyTokens {
            fallback: None,
            apps,
        },
        git_token: env_secret(&config.overlay.token_env),
        record_keys: config.records.keys(|k| std::env::var(k).ok())?,
    })
}

/// A variable's value as a secret, by the one rule
/// ([`crate::config::env_secret`]).
pub fn env_secret(var: &str) -> Option<SecretString> {
    crate::config::env_secret(|k| std::env::var(k).ok(), var)
}

/// The log subscriber: `RUST_LOG`'s filter (a malformed one is an error,
/// not the default), lines in `format` on stderr, one event per line.
pub fn init_logging(format: LogFormat) -> Result<(), crate::logging::FilterError> {
    let rust_log = std::env::var("RUST_LOG").ok();
    let filter = crate::logging::filter(rust_log.as_deref())?;
    // Colour codes only for a terminal: a log file or Fly's log shipper
    // gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(crate::logging::EscapedStderr { keep_ansi: ansi });
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    Ok(())
}

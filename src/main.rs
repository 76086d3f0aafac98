//! The `fleet-reconciler` command line: parses arguments, reads secrets from
//! the environment, and calls into the library. Nothing else lives here.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::{self, Secrets};
use fleet_reconciler::{demo, report};

#[derive(Parser)]
#[command(
    name = "fleet-reconciler",
    version,
    about = "Keeps long-running agents on Fly Machines on the released overlay"
)]
struct Cli {
    /// Config file (TOML).
    #[arg(long, global = true, default_value = "config/fleet-reconciler.toml")]
    config: PathBuf,
    /// Log line format (logs go to stderr; filter with RUST_LOG).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// One read-only sweep: report drift. Exit 0 coherent, 1 drift or unprobeable machines, 2 error.
    Check {
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Parse and validate the config file, then exit.
    ValidateConfig,
    /// Run against a built-in simulated fleet (no credentials, loopback only).
    Demo {
        /// Sweeps to run before exiting (0 = until the fleet settles, or ctrl-c).
        #[arg(long, default_value_t = 0)]
        sweeps: u32,
        /// Use this config instead of the built-in demo config.
        #[arg(long)]
        demo_config: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::ValidateConfig => {
            let config = Config::load(&cli.config)?;
            println!(
                "{}: ok ({} app(s), {} pool(s), {} severity rule(s), {} webhook(s))",
                cli.config.display(),
                config.apps.len(),
                config.pools.len(),
                config.severity.len(),
                config.alerts.webhooks.len()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { output } => {
            let config = Arc::new(Config::load(&cli.config)?);
            let secrets = secrets_from_env(&config)?;
            let sweeper = daemon::connect(config, &secrets).await?;
            let fleet = daemon::check(&sweeper).await?;
            match output {
                Output::Json => println!("{}", report::to_json(&fleet)),
                Output::Table => print!("{}", report::to_table(&fleet)),
            }
            Ok(if fleet.is_coherent() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::Demo {
            sweeps,
            demo_config,
        } => {
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
            })
            .await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn secrets_from_env(config: &Config) -> anyhow::Result<Secrets> {
    let fly_token = std::env::var(&config.fly.token_env)
        .ok()
        .filter(|t| !t.trim().is_empty())
        .with_context(|| {
            format!(
                "{} is not set: export an org-scoped Fly token (`fly tokens create org`)",
                config.fly.token_env
            )
        })?;
    let git_token = std::env::var(&config.overlay.token_env)
        .ok()
        .filter(|t| !t.trim().is_empty());
    Ok(Secrets {
        fly_token,
        git_token,
    })
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,fleet_reconciler=info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

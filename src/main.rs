//! The `fleet-reconciler` command line: parses arguments and dispatches to
//! the command's workflow in [`fleet_reconciler::cli`]. Nothing else lives
//! here.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser as _;
#[cfg(feature = "sim")]
use fleet_reconciler::cli::demo;
#[cfg(feature = "sim")]
use fleet_reconciler::cli::error::CliError;
use fleet_reconciler::cli::error::Fatal;
use fleet_reconciler::cli::output::finish;
use fleet_reconciler::cli::{
    self, Cli, Command, ConfigPath, approve, check, hold, plan, preflight, release, resume, revoke,
    run, status, validate_config,
};
use fleet_reconciler::metadata::operator::ApprovalMode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (command, output) = cli.command.name_and_output();
    let fatal = Fatal {
        command,
        output,
        log_format: cli.log_format,
    };
    if let Err(e) = cli::init_logging(cli.log_format) {
        return fatal.report(&e.into());
    }
    fleet_reconciler::heap::one_arena();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return fatal.report(&anyhow::Error::new(e).context("cannot start the async runtime"));
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => fatal.report(&e),
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    #[cfg(feature = "sim")]
    let explicit_config = cli.config_path().is_some();
    let config_path = ConfigPath::choose(cli.config_path().map(PathBuf::from));
    match cli.command {
        Command::ValidateConfig { check_env, out, .. } => finish(
            out.output,
            validate_config::validate_config(&config_path, check_env)?,
        ),
        Command::Preflight { out, .. } => preflight::preflight(&config_path, out.output).await,
        Command::Run { .. } => run::run_daemon(&config_path).await,
        Command::Status {
            machine, url, out, ..
        } => status::status(&config_path, machine, url, out.output).await,
        Command::Approve {
            machine,
            now,
            when_idle: _,
            yes,
            url,
            commit,
            by,
            out,
            ..
        } => {
            let mode = if now {
                ApprovalMode::Now
            } else {
                ApprovalMode::WhenIdle
            };
            let confirm = approve::Confirm { yes, url };
            let done = approve::approve(&config_path, &machine, mode, &confirm, commit, by).await?;
            finish(out.output, done)
        }
        Command::Revoke { machine, out, .. } => {
            finish(out.output, revoke::revoke(&config_path, &machine).await?)
        }
        Command::Hold {
            machine,
            reason,
            by,
            out,
            ..
        } => finish(
            out.output,
            hold::hold(&config_path, &machine, by, reason).await?,
        ),
        Command::Release { machine, out, .. } => {
            finish(out.output, release::release(&config_path, &machine).await?)
        }
        Command::Resume {
            app, tip, by, out, ..
        } => finish(
            out.output,
            resume::resume(&config_path, &app, tip.as_deref(), by).await?,
        ),
        Command::Check { out, .. } => check::check(&config_path, out.output).await,
        Command::Plan { out, .. } => plan::plan(&config_path, out.output).await,
        #[cfg(feature = "sim")]
        Command::Demo {
            sweeps,
            demo_config,
            keep_running,
            alertmanager,
            verbose,
            ..
        } => {
            if explicit_config {
                return Err(CliError::DemoConfig.into());
            }
            demo::run_demo(sweeps, demo_config, keep_running, alertmanager, verbose).await
        }
    }
}

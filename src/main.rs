//! The `fleet-reconciler` command line: parses arguments, reads secrets from
//! the environment, and calls into the library. Nothing else lives here.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use fleet_reconciler::act::operator::{Operator, OperatorError};
use fleet_reconciler::clock::SystemClock;
use fleet_reconciler::config::{Config, ConfigError};
use fleet_reconciler::daemon::{self, Secrets, SetupError};
use fleet_reconciler::demo;
use fleet_reconciler::fly::{FlyClientBuildError, FlyTokens};
use fleet_reconciler::metadata::HOLD_KEY;
use fleet_reconciler::metadata::operator::{Approval, ApprovalMode, Hold};
use fleet_reconciler::observe::overlay::OverlayError;
use fleet_reconciler::observe::sweep::FleetReport;
use fleet_reconciler::preflight;
use fleet_reconciler::report::{notify, render, server};
use fleet_reconciler::service::{self, ServiceSecrets};
use secrecy::SecretString;
use std::collections::HashMap;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "fleet-reconciler",
    version,
    about = "Keeps long-running agents on Fly Machines on the released overlay"
)]
struct Cli {
    /// Config file (TOML). Default: $FLEET_RECONCILER_CONFIG, else
    /// /etc/fleet-reconciler/fleet-reconciler.toml (the image's path). A
    /// relative path is taken from the working directory.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
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

/// How `approve`, `hold`, `release` and `validate-config` report: a line of
/// text, or one JSON object on stdout (success or failure; see README
/// "Commands").
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ActionOutput {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// One read-only sweep: report drift. Exit 0 coherent, 1 drift or unprobeable machines, 2 error (an app that cannot be listed included).
    Check {
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Read-only: one sweep, then each machine's decision and the steps a daemon would take now. Exit codes like `check`.
    Plan {
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Parse and validate the config file, then exit (0 valid, 2 not). Offline; also refuses a config `run` would refuse (no rotation.coordinator while a pool acts).
    ValidateConfig {
        /// Also check that every environment variable a `*_env` key names is set (each missing one reported).
        #[arg(long)]
        check_env: bool,
        #[arg(long, short, value_enum, default_value_t = ActionOutput::Text)]
        output: ActionOutput,
    },
    /// Before `run` or a deploy: every check `run` makes at start, then live ones (each app listed with its own token, the coordinator, the overlay remote, a dry request to each webhook, a sample of health URLs). One line per check; exit 0 all ok, 1 a check failed, 2 the config is unusable.
    Preflight {
        #[arg(long, short, value_enum, default_value_t = ActionOutput::Text)]
        output: ActionOutput,
    },
    /// The daemon: sweep, remediate per policy, serve metrics, the API and the status page.
    Run,
    /// Ask a running daemon for the fleet (the `check` table, from its last sweep), or with MACHINE for one machine's detail and the reason for its severity.
    Status {
        /// A machine id: show its detail (`GET /api/v1/machines/{id}`) instead of the fleet.
        machine: Option<String>,
        /// The daemon's HTTP address (default: server.listen of --config).
        #[arg(long)]
        url: Option<String>,
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Authorize one `manual` rotation of a machine (a metadata write).
    Approve {
        machine: String,
        /// Proceed like alert-and-wait (restart at the first report with no
        /// live work) instead of restarting now.
        #[arg(long)]
        when_idle: bool,
        /// The commit to approve; default: the release branch tip, fetched now.
        #[arg(long)]
        commit: Option<String>,
        /// Who approves (recorded in the approval).
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
        #[arg(long, short, value_enum, default_value_t = ActionOutput::Text)]
        output: ActionOutput,
    },
    /// Put an operator hold on a machine: no reconciler acts on it until `release`.
    Hold {
        machine: String,
        #[arg(long, default_value = "operator hold")]
        reason: String,
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
        #[arg(long, short, value_enum, default_value_t = ActionOutput::Text)]
        output: ActionOutput,
    },
    /// Clear an operator hold.
    Release {
        machine: String,
        #[arg(long, short, value_enum, default_value_t = ActionOutput::Text)]
        output: ActionOutput,
    },
    /// Run against a built-in simulated fleet (no credentials, loopback only).
    Demo {
        /// Sweeps to run before exiting (0 = until the fleet settles, or ctrl-c).
        #[arg(long, default_value_t = 0)]
        sweeps: u32,
        /// Use this config instead of the built-in demo config.
        #[arg(long)]
        demo_config: Option<PathBuf>,
        /// Keep serving after the fleet settles, until ctrl-c (to run `preflight` or `check` against it).
        #[arg(long)]
        keep_running: bool,
        /// Also post the demo's alerts to this Alertmanager (base URL, e.g.
        /// http://127.0.0.1:9093), as `[[alerts.alertmanager]]` would.
        #[arg(long)]
        alertmanager: Option<String>,
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
            // The error may quote outside text (a Fly or git server's message).
            eprintln!("error: {}", render::printable(&format!("{e:#}")));
            ExitCode::from(2)
        }
    }
}

/// The environment variable naming the config file when `--config` is not given.
const CONFIG_ENV: &str = "FLEET_RECONCILER_CONFIG";
/// The config file when neither `--config` nor [`CONFIG_ENV`] names one: the
/// image's path, the same from any working directory.
const DEFAULT_CONFIG: &str = "/etc/fleet-reconciler/fleet-reconciler.toml";

/// The config file and what chose it: `--config` wins over
/// `FLEET_RECONCILER_CONFIG`, which wins over the default.
struct ConfigPath {
    path: PathBuf,
    from: &'static str,
}

impl ConfigPath {
    fn choose(flag: Option<PathBuf>) -> ConfigPath {
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

    fn load(&self) -> anyhow::Result<Config> {
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

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let config_path = ConfigPath::choose(cli.config);
    match cli.command {
        Command::ValidateConfig { check_env, output } => {
            finish(output, validate_config(&config_path, check_env))
        }
        Command::Preflight { output } => preflight(&config_path, output).await,
        Command::Run => {
            let config = Arc::new(config_path.load()?);
            let secrets = service_secrets_from_env(&config)?;
            let listener = tokio::net::TcpListener::bind(config.server.listen)
                .await
                .with_context(|| {
                    format!("cannot listen on {} (server.listen)", config.server.listen)
                })?;
            let owner = owner_id();
            let shutdown = CancellationToken::new();
            tokio::spawn(stop_on_signal(shutdown.clone()));
            service::run(config, secrets, listener, owner, shutdown, |_| {}).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Status {
            machine,
            url,
            output,
        } => {
            let url = match url {
                Some(u) => u,
                None => {
                    let config = config_path.load()?;
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
            };
            let timeout = std::time::Duration::from_secs(10);
            if let Some(machine) = machine {
                let (view, json) = server::fetch_machine(&url, &machine, timeout).await?;
                return Ok(print_machine(&view, &json, output));
            }
            let fleet = server::fetch_fleet(&url, timeout).await?;
            Ok(print_fleet(&fleet, output))
        }
        Command::Approve {
            machine,
            when_idle,
            commit,
            by,
            output,
        } => {
            let mode = if when_idle {
                ApprovalMode::WhenIdle
            } else {
                ApprovalMode::Now
            };
            let done = approve(&config_path, &machine, mode, commit, by).await;
            finish(output, done)
        }
        Command::Hold {
            machine,
            reason,
            by,
            output,
        } => finish(output, hold(&config_path, &machine, by, reason).await),
        Command::Release { machine, output } => {
            finish(output, release(&config_path, &machine).await)
        }
        Command::Check { output } => {
            let config = Arc::new(config_path.load()?);
            let secrets = secrets_from_env(&config)?;
            let sweeper = daemon::connect(config, &secrets).await?;
            let fleet = daemon::check(&sweeper).await?;
            Ok(print_fleet(&fleet, output))
        }
        Command::Plan { output } => {
            let config = Arc::new(config_path.load()?);
            let secrets = secrets_from_env(&config)?;
            let sweeper = daemon::connect(config, &secrets).await?;
            let (fleet, plan) = daemon::plan_once(&sweeper, &owner_id(), &SystemClock).await?;
            match output {
                Output::Json => print_document(&render::plan_to_json(&fleet, &plan)),
                Output::Table => {
                    eprintln!(
                        "(a one-shot plan: drift is taken as seen for rotation.min_drift_age; nothing is written)"
                    );
                    print!("{}", render::plan_to_table(&fleet, &plan));
                }
            }
            Ok(exit_code_of(&fleet))
        }
        Command::Demo {
            sweeps,
            demo_config,
            keep_running,
            alertmanager,
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
                keep_running,
                alertmanager,
            })
            .await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// What `approve`, `hold`, `release` or `validate-config` did: the human
/// line and the JSON object of `--output json`.
struct Done {
    text: String,
    json: serde_json::Map<String, serde_json::Value>,
}

impl Done {
    fn new(command: &'static str, text: String, json: serde_json::Value) -> Done {
        let mut object = serde_json::Map::new();
        object.insert("command".into(), command.into());
        if let serde_json::Value::Object(fields) = json {
            object.extend(fields);
        }
        Done { text, json: object }
    }
}

/// A failed `approve`, `hold`, `release` or `validate-config`: the command
/// it was, for the JSON error object.
struct Failed {
    command: &'static str,
    source: anyhow::Error,
}

/// Failures of the command line itself (not of the library).
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("{}", missing_tokens(missing))]
    FlyTokenMissing {
        /// Each unset variable and the apps whose Fly token it holds.
        missing: Vec<(String, Vec<String>)>,
    },
    #[error("{} problem(s) for `run`: {}", problems.len(), problems.join("; "))]
    NotReady { problems: Vec<String> },
    #[error("--commit {0:?} is not a full 40-hex commit id")]
    BadCommit(String),
}

fn missing_tokens(missing: &[(String, Vec<String>)]) -> String {
    missing
        .iter()
        .map(|(var, apps)| {
            format!(
                "{var} is not set: the Fly token of app {} (mint one per app: `fly tokens create deploy -a {}`)",
                apps.join(", "),
                apps.first().map_or("APP", String::as_str)
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Prints what a command did. The convention for all four commands: with
/// `--output json`, stdout carries exactly one JSON object, on success what
/// was done, on failure `{"command", "error", "kind", …}`; the human error
/// line still goes to stderr and the exit code is the same as with text
/// (0 done, 2 not).
fn finish(output: ActionOutput, done: Result<Done, Failed>) -> anyhow::Result<ExitCode> {
    match done {
        Ok(done) => {
            match output {
                ActionOutput::Text => println!("{}", done.text),
                ActionOutput::Json => print_json(&done.json),
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(failed) => {
            if output == ActionOutput::Json {
                print_json(&error_object(&failed));
            }
            Err(failed.source)
        }
    }
}

fn print_json(object: &serde_json::Map<String, serde_json::Value>) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (`| head`) is the reader's choice, not our error.
    let _ = serde_json::to_writer(&mut out, object)
        .map_err(std::io::Error::from)
        .and_then(|()| writeln!(out))
        .and_then(|()| out.flush());
}

/// The JSON error object: the message of the human line, a stable `kind`,
/// and for a config error the file, key and line it names (`validate-config`
/// adds `"valid": false`).
fn error_object(failed: &Failed) -> serde_json::Map<String, serde_json::Value> {
    use serde_json::{Value, json};
    let mut object = serde_json::Map::new();
    object.insert("command".into(), failed.command.into());
    if failed.command == "validate-config" {
        object.insert("valid".into(), false.into());
    }
    object.insert(
        "error".into(),
        render::printable(&format!("{:#}", failed.source)).into(),
    );
    let mut kind: String = "error".into();
    for cause in failed.source.chain() {
        if let Some(e) = cause.downcast_ref::<ConfigError>() {
            let (k, path, key, line) = match e {
                ConfigError::Read { path, .. } => ("config_unreadable", path, None, None),
                ConfigError::Invalid {
                    path, key, line, ..
                } => (
                    "config_invalid",
                    path,
                    Some(key.as_str()).filter(|k| !k.is_empty()),
                    *line,
                ),
            };
            kind = k.into();
            object.insert("config".into(), json!(path.display().to_string()));
            object.insert("key".into(), json!(key));
            object.insert("line".into(), json!(line));
        } else if let Some(e) = cause.downcast_ref::<OperatorError>() {
            kind = match e {
                OperatorError::UnknownMachine { .. } => "unknown_machine".into(),
                OperatorError::Leased { .. } => "leased".into(),
                OperatorError::Unsearched { .. } => "unsearched".into(),
                OperatorError::Fly(e) => format!("fly_{}", e.kind()),
            };
            if let OperatorError::UnknownMachine { machine_id, .. }
            | OperatorError::Leased { machine_id, .. }
            | OperatorError::Unsearched { machine_id, .. } = e
            {
                object.insert("machine_id".into(), Value::from(machine_id.as_str()));
            }
        } else if let Some(e) = cause.downcast_ref::<SetupError>() {
            kind = match e {
                SetupError::Overlay(e) => format!("overlay_{}", e.kind()),
                SetupError::Fly(_) | SetupError::Probe(_) => "setup".into(),
            };
        } else if let Some(e) = cause.downcast_ref::<OverlayError>() {
            kind = format!("overlay_{}", e.kind());
        } else if cause.is::<FlyClientBuildError>() {
            kind = "setup".into();
        } else if let Some(e) = cause.downcast_ref::<CliError>() {
            kind = match e {
                CliError::FlyTokenMissing { .. } => "fly_token_missing".into(),
                CliError::NotReady { .. } => "not_ready".into(),
                CliError::BadCommit(_) => "bad_commit".into(),
            };
        } else {
            continue;
        }
        break;
    }
    object.insert("kind".into(), kind.into());
    object
}

fn validate_config(config_path: &ConfigPath, check_env: bool) -> Result<Done, Failed> {
    let failed = |source: anyhow::Error| Failed {
        command: "validate-config",
        source,
    };
    let config = config_path.load().map_err(failed)?;
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
        return Err(failed(CliError::NotReady { problems }.into()));
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

/// `preflight`: one line per check (`ok`, `FAIL` with its fix, `skip`),
/// or with `--output json` one object with every finding. Exit 0 when
/// nothing failed, 1 when a check failed, 2 when the config is unusable.
async fn preflight(config_path: &ConfigPath, output: ActionOutput) -> anyhow::Result<ExitCode> {
    let config = match config_path.load() {
        Ok(c) => c,
        Err(source) => {
            return finish(
                output,
                Err(Failed {
                    command: "preflight",
                    source,
                }),
            );
        }
    };
    let lookup = |var: &str| std::env::var(var).ok();
    let report = preflight::run(&config, &lookup).await;
    let failures = report.failures().count();
    match output {
        ActionOutput::Json => {
            let v = serde_json::json!({
                "command": "preflight",
                "config": config_path.path.display().to_string(),
                "ok": failures == 0,
                "failures": failures,
                "checks": report.findings,
            });
            if let serde_json::Value::Object(object) = v {
                print_json(&object);
            }
        }
        ActionOutput::Text => {
            let mut lines = Vec::new();
            for f in &report.findings {
                let status = match f.status {
                    preflight::Status::Ok => "ok  ",
                    preflight::Status::Fail => "FAIL",
                    preflight::Status::Skipped => "skip",
                };
                let check: &'static str = f.check.into();
                lines.push(format!("{status} {check} {}: {}", f.subject, f.detail));
                if let Some(fix) = &f.fix {
                    lines.push(format!("     fix: {fix}"));
                }
            }
            lines.push(if failures == 0 {
                format!(
                    "preflight: {} passed, ready for `run`",
                    config_path.path.display()
                )
            } else {
                format!(
                    "preflight: {failures} check(s) failed for {}",
                    config_path.path.display()
                )
            });
            let mut out = std::io::stdout().lock();
            for line in lines {
                // Details quote outside text (Fly, git, agents): one line each.
                let _ = writeln!(out, "{}", render::printable(&line));
            }
        }
    }
    Ok(if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn approve(
    config_path: &ConfigPath,
    machine: &str,
    mode: ApprovalMode,
    commit: Option<String>,
    by: String,
) -> Result<Done, Failed> {
    let run = async {
        let config = Arc::new(config_path.load()?);
        let secrets = secrets_from_env(&config)?;
        let target = match commit {
            Some(c) => fleet_reconciler::model::CommitId::parse(&c)
                .ok_or(CliError::BadCommit(c))?
                .to_string(),
            None => {
                let sweeper = daemon::connect(config.clone(), &secrets).await?;
                sweeper
                    .overlay
                    .fetch()
                    .await
                    .context("cannot fetch the release tip to approve (or pass --commit)")?
                    .commit
                    .to_string()
            }
        };
        let approval = Approval {
            target,
            mode,
            by,
            at: chrono::Utc::now(),
        };
        let app = operator(&config, &secrets)?
            .approve(machine, &approval)
            .await?;
        let text = format!(
            "approved: {app}/{machine} may rotate to {} ({})",
            &approval.target[..12],
            match mode {
                ApprovalMode::WhenIdle => "when idle",
                ApprovalMode::Now => "now",
            }
        );
        let json = serde_json::json!({ "app": app, "machine_id": machine, "approval": approval });
        anyhow::Ok(Done::new("approve", text, json))
    };
    run.await.map_err(|source| Failed {
        command: "approve",
        source,
    })
}

async fn hold(
    config_path: &ConfigPath,
    machine: &str,
    by: String,
    reason: String,
) -> Result<Done, Failed> {
    let run = async {
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
        anyhow::Ok(Done::new("hold", text, json))
    };
    run.await.map_err(|source| Failed {
        command: "hold",
        source,
    })
}

async fn release(config_path: &ConfigPath, machine: &str) -> Result<Done, Failed> {
    let run = async {
        let config = config_path.load()?;
        let secrets = secrets_from_env(&config)?;
        let operator = operator(&config, &secrets)?;
        // The hold as it stands just before it is cleared, to say what was
        // removed (a hold written by `hold` or the admin API is a JSON
        // object; any other value is shown as the string it is).
        let (_, found) = operator.locate(machine).await?;
        let removed = found.metadata(HOLD_KEY)?.map(|v| {
            serde_json::from_str::<Hold>(v)
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
        anyhow::Ok(Done::new("release", text, json))
    };
    run.await.map_err(|source| Failed {
        command: "release",
        source,
    })
}

fn operator(config: &Config, secrets: &Secrets) -> anyhow::Result<Operator> {
    Ok(Operator::new(daemon::fly_client(config, secrets)?, config))
}

/// Prints a fleet report; exit 0 when coherent, 1 when anything drifts or
/// cannot be probed, 2 when an app could not be listed (its error on stderr,
/// one line per app, after the report of the apps that could).
/// `status MACHINE`: the daemon's JSON, or the detail for people; exit as
/// `check` would for that one machine (0 on the tip or not running, 1
/// otherwise, 2 when its app could not be listed).
fn print_machine(view: &server::MachineView, json: &serde_json::Value, output: Output) -> ExitCode {
    match output {
        Output::Json => {
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            // A closed stdout (`| head`) is the reader's choice, not our error.
            let _ = serde_json::to_writer_pretty(&mut out, json)
                .map_err(std::io::Error::from)
                .and_then(|()| writeln!(out))
                .and_then(|()| out.flush());
        }
        Output::Table => print!("{}", view.render()),
    }
    if let Some(stale) = &view.app_stale {
        eprintln!("error: {}", render::printable(&stale.error));
        return ExitCode::from(2);
    }
    use fleet_reconciler::model::MachineStatus;
    match view.machine.status {
        MachineStatus::OnTip | MachineStatus::NotRunning => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    }
}

/// A JSON document (`check`, `plan`) on stdout, pretty and streamed; the
/// operator commands' one-line objects are [`print_json`]'s. A closed stdout
/// (`| head`) is the reader's choice, not our error.
fn print_document(doc: &impl serde::Serialize) {
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let _ = render::write_json(&mut out, doc).and_then(|()| out.flush());
}

fn print_fleet(fleet: &FleetReport, output: Output) -> ExitCode {
    match output {
        Output::Json => print_document(fleet),
        Output::Table => print!("{}", render::to_table(fleet)),
    }
    exit_code_of(fleet)
}

/// `check`'s exit code: 2 when an app could not be listed (said on stderr),
/// else 0 coherent, 1 drift or unprobeable machines.
fn exit_code_of(fleet: &FleetReport) -> ExitCode {
    let mut unlisted = false;
    for (_, stale) in fleet.stale_apps() {
        unlisted = true;
        let shown = match stale.last_listed_at {
            None => "its machines are not in the report".to_string(),
            Some(at) => format!("showing its listing of {}", at.to_rfc3339()),
        };
        eprintln!("error: {}; {shown}", render::printable(&stale.error));
    }
    if unlisted {
        ExitCode::from(2)
    } else if fleet.is_coherent() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Identifies this reconciler in markers and leases: the Fly machine id when
/// running on Fly, else the host name, plus the process id.
fn owner_id() -> String {
    let host = std::env::var("FLY_MACHINE_ID")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "local".into());
    format!("{host}-{}", std::process::id())
}

async fn stop_on_signal(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM; ctrl-c still stops");
                    let _ = tokio::signal::ctrl_c().await;
                    shutdown.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("signal received: finishing the current step, then stopping");
    shutdown.cancel();
}

fn service_secrets_from_env(config: &Config) -> anyhow::Result<ServiceSecrets> {
    let core = secrets_from_env(config)?;
    let mut agent_tokens = HashMap::new();
    for app in &config.apps {
        if let Some(var) = &app.agent_token_env {
            let token = std::env::var(var)
                .ok()
                .filter(|t| !t.trim().is_empty())
                .with_context(|| {
                    format!(
                        "{var} is not set (apps.agent_token_env of app {})",
                        app.name
                    )
                })?;
            agent_tokens.insert(app.name.clone(), SecretString::from(token));
        }
    }
    let admin_token = std::env::var(&config.server.admin_token_env)
        .ok()
        .filter(|t| !t.trim().is_empty())
        .map(SecretString::from);
    if admin_token.is_none() {
        tracing::warn!(env = %config.server.admin_token_env, "admin API disabled: the variable is not set");
    }
    let webhooks = notify::sink_secrets_from_env(&config.alerts, |k| std::env::var(k).ok())?;
    let alertmanagers =
        notify::alertmanager_urls_from_env(&config.alerts, |k| std::env::var(k).ok())?;
    Ok(ServiceSecrets {
        core,
        agent_tokens,
        admin_token,
        webhooks,
        alertmanagers,
    })
}

/// The Fly token of every app (each one's own, [`Config::fly_tokens`]) and
/// the overlay token. Every missing Fly token is named in one error.
fn secrets_from_env(config: &Config) -> anyhow::Result<Secrets> {
    let mut apps = std::collections::BTreeMap::new();
    let mut missing: Vec<(String, Vec<String>)> = Vec::new();
    for t in config.fly_tokens() {
        match env_secret(t.var) {
            Some(token) => {
                apps.insert(t.app.to_string(), token);
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
    })
}

/// A variable's value as a secret; unset, empty or blank is `None`.
fn env_secret(var: &str) -> Option<SecretString> {
    std::env::var(var)
        .ok()
        .filter(|t| !t.trim().is_empty())
        .map(SecretString::from)
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,fleet_reconciler=info"));
    // Colour codes only for a terminal: a log file or Fly's log shipper
    // gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(fleet_reconciler::logging::EscapedStderr { keep_ansi: ansi });
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

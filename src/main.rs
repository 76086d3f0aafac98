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
use fleet_reconciler::daemon::{self, CheckError, Secrets, SetupError};
#[cfg(feature = "sim")]
use fleet_reconciler::demo;
use fleet_reconciler::fly::{FlyClientBuildError, FlyTokens};
use fleet_reconciler::metadata::HOLD_KEY;
use fleet_reconciler::metadata::operator::{Approval, ApprovalMode, Hold};
use fleet_reconciler::observe::overlay::OverlayError;
use fleet_reconciler::preflight;
use fleet_reconciler::report::wire::FleetDocument;
use fleet_reconciler::report::{notify, render, server};
use fleet_reconciler::service::{self, ServiceSecrets};
use secrecy::SecretString;
use std::collections::HashMap;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "fleet-reconciler",
    version = VERSION,
    about = "Keeps long-running agents on Fly Machines on the released overlay"
)]
struct Cli {
    /// Config file (TOML). Default: $FLEET_RECONCILER_CONFIG, else
    /// /etc/fleet-reconciler/fleet-reconciler.toml (the image's path). A
    /// relative path is taken from the working directory.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Log line format (logs go to stderr; filter with RUST_LOG). A fatal
    /// error follows it too.
    #[arg(
        long,
        global = true,
        value_enum,
        env = "FLEET_RECONCILER_LOG_FORMAT",
        default_value_t = LogFormat::Text
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// The crate version and the commit it was built from (build.rs).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("FLEET_RECONCILER_COMMIT"),
    ")"
);

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    /// One line of text per event.
    Text,
    /// One JSON object per event (for a log shipper).
    Json,
}

/// How a command prints: one vocabulary for every command.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    /// Lines and tables for people (`table` is accepted too).
    #[value(alias = "table")]
    Text,
    /// One JSON document on stdout; on failure a JSON error object there
    /// (README "Commands").
    Json,
}

#[derive(Clone, Copy, clap::Args)]
struct OutputArg {
    /// How to print: `text` for people, `json` for programs (on failure, a
    /// JSON error object on stdout; the exit code is the same).
    #[arg(long, short, value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Subcommand)]
enum Command {
    /// One read-only sweep: report drift, with each machine's decision as `plan` makes it. Exit 0 coherent, 1 drift or unprobeable machines, 2 error (an app that cannot be listed included).
    Check {
        #[command(flatten)]
        out: OutputArg,
    },
    /// Read-only: one sweep, then each machine's decision and the steps a daemon would take now. Exit codes like `check`.
    Plan {
        #[command(flatten)]
        out: OutputArg,
    },
    /// Parse and validate the config file, then exit (0 valid, 2 not). Offline; also refuses a config `run` would refuse (no rotation.coordinator while a pool acts).
    ValidateConfig {
        /// Also check that every environment variable a `*_env` key names is set (each missing one reported).
        #[arg(long)]
        check_env: bool,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Before `run` or a deploy: every check `run` makes at start, then live ones (each app listed with its own token, the coordinator, the overlay remote, a dry request to each webhook, a sample of health URLs). One line per check; exit 0 all ok, 1 a check failed, 2 the config is unusable.
    Preflight {
        #[command(flatten)]
        out: OutputArg,
    },
    /// The daemon: sweep, remediate per policy, serve metrics, the API and the status page.
    Run,
    /// Ask a running daemon for the fleet (the `check` table with the daemon's decisions, from its last sweep), or with MACHINE for one machine's detail and the reason for its severity.
    Status {
        /// A machine id: show its detail (`GET /api/v1/machines/{id}`) instead of the fleet.
        machine: Option<String>,
        /// The daemon's HTTP address (default: server.listen of --config).
        #[arg(long)]
        url: Option<String>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Authorize one `manual` rotation of a machine (a metadata write). By default it waits for the agent to be idle; `--now` may end live work.
    Approve {
        /// The machine id (any configured app).
        machine: String,
        /// Restart even with live work (open sessions, a turn in progress):
        /// they end. First names the live work the daemon last saw on the
        /// machine and asks to confirm (`--yes` confirms in advance).
        #[arg(long, conflicts_with = "when_idle")]
        now: bool,
        /// Restart only at a report with no live work, like alert-and-wait
        /// (the default; accepted so scripts can say it).
        #[arg(long)]
        when_idle: bool,
        /// With --now: confirm ending the live work without a prompt (needed
        /// when stdin is not a terminal and the machine has or may have live work).
        #[arg(long, short = 'y', requires = "now")]
        yes: bool,
        /// With --now: the daemon whose last report of the machine shows its
        /// live work (default: server.listen of --config).
        #[arg(long, requires = "now")]
        url: Option<String>,
        /// The commit to approve; default: the release branch tip, fetched now.
        #[arg(long)]
        commit: Option<String>,
        /// Who approves (recorded in the approval).
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Remove a pending approval (written under the machine's lease, like `hold`); a machine without one is left as it is.
    Revoke {
        /// The machine id (any configured app).
        machine: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Put an operator hold on a machine: no reconciler acts on it until `release`.
    Hold {
        /// The machine id (any configured app).
        machine: String,
        /// Why (recorded in the hold, shown on the status page).
        #[arg(long, default_value = "operator hold")]
        reason: String,
        /// Who holds it (recorded in the hold).
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Clear an operator hold.
    Release {
        /// The machine id (any configured app).
        machine: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Run against a built-in simulated fleet (no credentials, loopback only). It reads no --config: see --demo-config.
    #[cfg(feature = "sim")]
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

impl Command {
    /// The command's name (the JSON objects' `command`) and how it prints.
    fn name_and_output(&self) -> (&'static str, Output) {
        let text = Output::Text;
        match self {
            Command::Check { out } => ("check", out.output),
            Command::Plan { out } => ("plan", out.output),
            Command::ValidateConfig { out, .. } => ("validate-config", out.output),
            Command::Preflight { out } => ("preflight", out.output),
            Command::Run => ("run", text),
            Command::Status { out, .. } => ("status", out.output),
            Command::Approve { out, .. } => ("approve", out.output),
            Command::Revoke { out, .. } => ("revoke", out.output),
            Command::Hold { out, .. } => ("hold", out.output),
            Command::Release { out, .. } => ("release", out.output),
            #[cfg(feature = "sim")]
            Command::Demo { .. } => ("demo", text),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (command, output) = cli.command.name_and_output();
    let fatal = Fatal {
        command,
        output,
        log_format: cli.log_format,
    };
    if let Err(e) = init_logging(cli.log_format) {
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

/// How a failed command reports: the JSON error object on stdout with
/// `--output json`, and the error on stderr as a log line of `--log-format`.
struct Fatal {
    command: &'static str,
    output: Output,
    log_format: LogFormat,
}

impl Fatal {
    /// Reports `e`; exit 2.
    fn report(&self, e: &anyhow::Error) -> ExitCode {
        let object = error_object(self.command, e);
        if self.output == Output::Json {
            print_json(&object);
        }
        let message = object
            .get("error")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default();
        match self.log_format {
            LogFormat::Text => {
                eprintln!("error: {message}");
                if let Some(hint) = object.get("hint").and_then(serde_json::Value::as_str) {
                    eprintln!("hint: {hint}");
                }
            }
            LogFormat::Json => {
                // The shape of the subscriber's JSON lines, written here so a
                // RUST_LOG that filters everything still shows why it ended.
                let line = serde_json::json!({
                    "timestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    "level": "ERROR",
                    "fields": {
                        "message": message,
                        "command": self.command,
                        "kind": object.get("kind"),
                        "hint": object.get("hint"),
                    },
                    "target": "fleet_reconciler",
                });
                eprintln!("{line}");
            }
        }
        ExitCode::from(2)
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
    #[cfg(feature = "sim")]
    let explicit_config = cli.config.is_some();
    let config_path = ConfigPath::choose(cli.config);
    match cli.command {
        Command::ValidateConfig { check_env, out } => {
            finish(out.output, validate_config(&config_path, check_env)?)
        }
        Command::Preflight { out } => preflight(&config_path, out.output).await,
        Command::Run => run_daemon(&config_path).await,
        Command::Status { machine, url, out } => {
            status(&config_path, machine, url, out.output).await
        }
        Command::Approve {
            machine,
            now,
            when_idle: _,
            yes,
            url,
            commit,
            by,
            out,
        } => {
            let mode = if now {
                ApprovalMode::Now
            } else {
                ApprovalMode::WhenIdle
            };
            let confirm = Confirm { yes, url };
            let done = approve(&config_path, &machine, mode, &confirm, commit, by).await?;
            finish(out.output, done)
        }
        Command::Revoke { machine, out } => {
            finish(out.output, revoke(&config_path, &machine).await?)
        }
        Command::Hold {
            machine,
            reason,
            by,
            out,
        } => finish(out.output, hold(&config_path, &machine, by, reason).await?),
        Command::Release { machine, out } => {
            finish(out.output, release(&config_path, &machine).await?)
        }
        Command::Check { out } => check(&config_path, out.output).await,
        Command::Plan { out } => plan(&config_path, out.output).await,
        #[cfg(feature = "sim")]
        Command::Demo {
            sweeps,
            demo_config,
            keep_running,
            alertmanager,
        } => {
            if explicit_config {
                return Err(CliError::DemoConfig.into());
            }
            run_demo(sweeps, demo_config, keep_running, alertmanager).await
        }
    }
}

/// `run`: the daemon, until SIGTERM or ctrl-c.
async fn run_daemon(config_path: &ConfigPath) -> anyhow::Result<ExitCode> {
    let config = Arc::new(config_path.load()?);
    let secrets = service_secrets_from_env(&config)?;
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .with_context(|| format!("cannot listen on {} (server.listen)", config.server.listen))?;
    let owner = owner_id();
    let shutdown = CancellationToken::new();
    tokio::spawn(fleet_reconciler::signal::cancel_on_signal(shutdown.clone()));
    service::run(
        service::RunArgs::new(config, secrets, listener, owner, shutdown),
        |_| {},
    )
    .await?;
    Ok(ExitCode::SUCCESS)
}

/// `status`: a running daemon's fleet, or one machine's detail.
async fn status(
    config_path: &ConfigPath,
    machine: Option<String>,
    url: Option<String>,
    output: Output,
) -> anyhow::Result<ExitCode> {
    let url = match url {
        Some(u) => u,
        None => daemon_url(&config_path.load()?),
    };
    let timeout = std::time::Duration::from_secs(10);
    if let Some(machine) = machine {
        let (view, json) = server::fetch_machine(&url, &machine, timeout).await?;
        return Ok(print_machine(&view, &json, output));
    }
    let doc = server::fetch_fleet(&url, timeout).await?;
    Ok(print_fleet(&doc, output))
}

/// `check`: one read-only sweep, reported.
async fn check(config_path: &ConfigPath, output: Output) -> anyhow::Result<ExitCode> {
    let config = Arc::new(config_path.load()?);
    let secrets = secrets_from_env(&config)?;
    let sweeper = daemon::connect(config, &secrets).await?;
    match output {
        // The document for programs stays the sweep's alone: no
        // planner time or memory at 10,000 machines, no bytes per
        // machine (`plan --output json` has the decisions).
        Output::Json => {
            let fleet = daemon::check(&sweeper).await?;
            Ok(print_fleet(&FleetDocument::of(&fleet), output))
        }
        // The table's DECISION column: the planner's, as `plan` makes it.
        Output::Text => {
            let (fleet, plan) = daemon::plan_once(&sweeper, &owner_id(), &SystemClock).await?;
            Ok(print_fleet(&FleetDocument::planned(&fleet, &plan), output))
        }
    }
}

/// `plan`: one read-only sweep, then each machine's decision and the steps.
async fn plan(config_path: &ConfigPath, output: Output) -> anyhow::Result<ExitCode> {
    let config = Arc::new(config_path.load()?);
    let secrets = secrets_from_env(&config)?;
    let sweeper = daemon::connect(config, &secrets).await?;
    let (fleet, plan) = daemon::plan_once(&sweeper, &owner_id(), &SystemClock).await?;
    match output {
        Output::Json => print_document(&render::plan_to_json(&fleet, &plan)),
        Output::Text => {
            eprintln!(
                "(a one-shot plan: drift is taken as seen for rotation.min_drift_age; nothing is written)"
            );
            print!("{}", render::plan_to_table(&fleet, &plan));
        }
    }
    Ok(exit_code_of(&FleetDocument::of(&fleet)))
}

/// `demo`: the simulated fleet, on the built-in config or `demo_config`.
#[cfg(feature = "sim")]
async fn run_demo(
    sweeps: u32,
    demo_config: Option<PathBuf>,
    keep_running: bool,
    alertmanager: Option<String>,
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
    })
    .await?;
    Ok(ExitCode::SUCCESS)
}

/// The daemon's address from `server.listen` of the config (loopback when
/// it listens on every address).
fn daemon_url(config: &Config) -> String {
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

/// What `approve`, `revoke`, `hold`, `release` or `validate-config` did: the human
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

/// Failures of the command line itself (not of the library). Its kind (the
/// `kind` of the error object) is its variant's snake-case name.
#[derive(Debug, thiserror::Error, strum::EnumDiscriminants)]
#[strum_discriminants(
    name(CliErrorKind),
    derive(strum::IntoStaticStr, strum::VariantArray),
    strum(serialize_all = "snake_case")
)]
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
    #[error("approve --now {machine}: {live}; not confirmed")]
    NotConfirmed { machine: String, live: String },
    #[cfg(feature = "sim")]
    #[error("`demo` reads no --config: it runs its built-in config against a simulated fleet")]
    DemoConfig,
}

impl CliError {
    fn kind(&self) -> &'static str {
        CliErrorKind::from(self).into()
    }

    /// What to do about it, when the message does not already say.
    fn hint(&self) -> Option<&'static str> {
        match self {
            CliError::NotConfirmed { .. } => Some(
                "confirm with --yes (or at the prompt on a terminal), or approve without --now to restart it once it is idle",
            ),
            #[cfg(feature = "sim")]
            CliError::DemoConfig => Some(
                "give the demo another config with --demo-config FILE; to check a real fleet use `check --config FILE`",
            ),
            _ => None,
        }
    }
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

/// Prints what a command did: one line of text, or with `--output json`
/// exactly one JSON object on stdout. A failure is `main`'s to print
/// ([`Fatal`]): with `--output json` an error object instead, the same
/// shape for every command ([`error_object`]).
fn finish(output: Output, done: Done) -> anyhow::Result<ExitCode> {
    match output {
        Output::Text => println!("{}", done.text),
        Output::Json => print_json(&done.json),
    }
    Ok(ExitCode::SUCCESS)
}

fn print_json(object: &serde_json::Map<String, serde_json::Value>) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (`| head`) is the reader's choice, not our error.
    let _ = serde_json::to_writer(&mut out, object)
        .map_err(std::io::Error::from)
        .and_then(|()| writeln!(out))
        .and_then(|()| out.flush());
}

/// The error's message with each cause once: `{:#}` of an error whose text
/// already quotes its source (`cannot read …: No such file`) would print
/// the source again after it.
fn message_of(e: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || message.contains(&text) {
            continue;
        }
        if !message.is_empty() {
            message.push_str(": ");
        }
        message.push_str(&text);
    }
    // The error may quote outside text (a Fly or git server's message).
    render::printable(&message)
}

/// The JSON error object of a failed command, one shape for every command:
/// `command`, `error` (the message of the `error:` line), a stable `kind`,
/// `hint` when there is one, and for a config error the file, key and line
/// it names, for a machine error `machine_id` (`validate-config` adds
/// `"valid": false`).
fn error_object(command: &str, e: &anyhow::Error) -> serde_json::Map<String, serde_json::Value> {
    use serde_json::{Value, json};
    let mut object = serde_json::Map::new();
    object.insert("command".into(), command.into());
    if command == "validate-config" {
        object.insert("valid".into(), false.into());
    }
    object.insert("error".into(), message_of(e).into());
    let mut kind: String = "error".into();
    let mut hint: Option<String> = None;
    for cause in e.chain() {
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
        } else if let Some(e) = cause.downcast_ref::<CheckError>() {
            kind = match e {
                CheckError::Fetch(e) => format!("overlay_{}", e.kind()),
                CheckError::Sweep(e) => format!("sweep_{}", e.kind()),
            };
        } else if let Some(e) = cause.downcast_ref::<OverlayError>() {
            kind = format!("overlay_{}", e.kind());
        } else if let Some(e) = cause.downcast_ref::<server::StatusError>() {
            kind = format!("daemon_{}", e.kind());
            if let server::StatusError::UnknownMachine { machine_id, .. } = e {
                object.insert("machine_id".into(), Value::from(machine_id.as_str()));
            }
        } else if cause.is::<FlyClientBuildError>() {
            kind = "setup".into();
        } else if cause.is::<fleet_reconciler::logging::FilterError>() {
            kind = "log_filter".into();
        } else if let Some(e) = cause.downcast_ref::<CliError>() {
            kind = e.kind().into();
            hint = e.hint().map(str::to_string);
            if let CliError::NotConfirmed { machine, .. } = e {
                object.insert("machine_id".into(), Value::from(machine.as_str()));
            }
        } else {
            continue;
        }
        break;
    }
    object.insert("kind".into(), kind.into());
    if let Some(hint) = hint {
        object.insert("hint".into(), hint.into());
    }
    object
}

fn validate_config(config_path: &ConfigPath, check_env: bool) -> anyhow::Result<Done> {
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

/// `preflight`: one line per check (`ok`, `FAIL` with its fix, `skip`),
/// or with `--output json` one object with every finding. Exit 0 when
/// nothing failed, 1 when a check failed, 2 when the config is unusable.
async fn preflight(config_path: &ConfigPath, output: Output) -> anyhow::Result<ExitCode> {
    let config = config_path.load()?;
    let lookup = |var: &str| std::env::var(var).ok();
    let report = preflight::run(&config, &lookup).await;
    let failures = report.failures().count();
    match output {
        Output::Json => {
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
        Output::Text => {
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

/// How `approve --now` confirms ending live work.
struct Confirm {
    /// Confirmed in advance (`--yes`).
    yes: bool,
    /// The daemon to ask for the machine's last report (`--url`).
    url: Option<String>,
}

/// The live work a running daemon last saw on a machine: what `approve
/// --now` would end.
#[derive(serde::Serialize)]
struct LiveWork {
    /// Whether the daemon's report could be read at all.
    known: bool,
    live_sessions: Option<u64>,
    /// A turn or job in progress.
    busy: bool,
    /// When the daemon swept it.
    as_of: Option<chrono::DateTime<chrono::Utc>>,
    /// Why it is not known.
    #[serde(skip_serializing_if = "Option::is_none")]
    unknown: Option<String>,
}

impl LiveWork {
    fn any(&self) -> bool {
        !self.known || self.busy || self.live_sessions.unwrap_or(0) > 0
    }

    /// The sentence the confirmation shows.
    fn describe(&self, app_machine: &str) -> String {
        if let Some(why) = &self.unknown {
            return format!(
                "its live work is unknown ({why}): open sessions and a turn in progress on it would end"
            );
        }
        let as_of = self
            .as_of
            .map(|t| {
                format!(
                    " (the daemon's sweep of {})",
                    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                )
            })
            .unwrap_or_default();
        let mut work = Vec::new();
        match self.live_sessions {
            Some(n) if n > 0 => work.push(format!("{n} live session(s)")),
            _ => {}
        }
        if self.busy {
            work.push("a turn in progress".to_string());
        }
        if work.is_empty() {
            format!("{app_machine} has no live work{as_of}")
        } else {
            format!(
                "{app_machine} has {}{as_of}: restarting it now ends them",
                work.join(" and ")
            )
        }
    }
}

/// Reads the machine's last agent report from the daemon, as `status
/// MACHINE` does.
async fn live_work(url: &str, machine: &str) -> LiveWork {
    let unknown = |why: String| LiveWork {
        known: false,
        live_sessions: None,
        busy: false,
        as_of: None,
        unknown: Some(why),
    };
    let view = match server::fetch_machine(url, machine, std::time::Duration::from_secs(10)).await {
        Ok((view, _)) => view,
        Err(e) => return unknown(format!("the daemon at {url}: {e}")),
    };
    let Some(report) = view.agent_report else {
        return unknown(format!(
            "the daemon at {url} has no usable report from its agent ({})",
            view.machine.status
        ));
    };
    LiveWork {
        known: true,
        live_sessions: report
            .get("live_sessions")
            .and_then(serde_json::Value::as_u64),
        busy: report.get("activity").and_then(serde_json::Value::as_str) == Some("busy"),
        as_of: view.swept_at,
        unknown: None,
    }
}

/// Asks on the terminal; `false` unless the answer is yes.
fn ask(question: &str) -> bool {
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    if std::io::stdin().read_line(&mut answer).is_err() {
        return false;
    }
    matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes")
}

async fn approve(
    config_path: &ConfigPath,
    machine: &str,
    mode: ApprovalMode,
    confirm: &Confirm,
    commit: Option<String>,
    by: String,
) -> anyhow::Result<Done> {
    // Typed once: the operator takes a `MachineId`.
    let machine = &fleet_reconciler::model::MachineId::from(machine);
    let config = Arc::new(config_path.load()?);
    let secrets = secrets_from_env(&config)?;
    let operator = operator(&config, &secrets)?;
    // Interrupting work is confirmed before anything is fetched or written,
    // naming what it would end.
    let live = match mode {
        ApprovalMode::WhenIdle => None,
        ApprovalMode::Now => {
            let (app, _) = operator.locate(machine).await?;
            let url = confirm.url.clone().unwrap_or_else(|| daemon_url(&config));
            let live = live_work(&url, machine.as_str()).await;
            let said = live.describe(&format!("{app}/{machine}"));
            if live.any() {
                let confirmed = confirm.yes
                    || (std::io::IsTerminal::is_terminal(&std::io::stdin())
                        && ask(&format!("approve --now: {said}. Approve a restart now?")));
                if !confirmed {
                    return Err(CliError::NotConfirmed {
                        machine: machine.to_string(),
                        live: said,
                    }
                    .into());
                }
            }
            eprintln!("approve --now: {}", render::printable(&said));
            Some(live)
        }
    };
    let target = match commit {
        Some(c) => fleet_reconciler::model::CommitId::parse(&c).ok_or(CliError::BadCommit(c))?,
        None => {
            let sweeper = daemon::connect(config.clone(), &secrets).await?;
            sweeper
                .overlay
                .fetch()
                .await
                .context("cannot fetch the release tip to approve (or pass --commit)")?
                .commit
        }
    };
    let approval = Approval {
        target,
        mode,
        by,
        at: chrono::Utc::now(),
    };
    let app = operator.approve(machine, &approval).await?;
    let text = format!(
        "approved: {app}/{machine} may rotate to {} ({})",
        fleet_reconciler::model::short_commit(approval.target.as_str()),
        match mode {
            ApprovalMode::WhenIdle => "when idle",
            ApprovalMode::Now => "now",
        }
    );
    let mut json = serde_json::json!({ "app": app, "machine_id": machine, "approval": approval });
    if let (Some(live), Some(object)) = (live, json.as_object_mut()) {
        object.insert("live_work".into(), serde_json::to_value(live)?);
    }
    Ok(Done::new("approve", text, json))
}

async fn revoke(config_path: &ConfigPath, machine: &str) -> anyhow::Result<Done> {
    // Typed once: the operator takes a `MachineId`.
    let machine = &fleet_reconciler::model::MachineId::from(machine);
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

async fn hold(
    config_path: &ConfigPath,
    machine: &str,
    by: String,
    reason: String,
) -> anyhow::Result<Done> {
    // Typed once: the operator takes a `MachineId`.
    let machine = &fleet_reconciler::model::MachineId::from(machine);
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
    Ok(Done::new("hold", text, json))
}

async fn release(config_path: &ConfigPath, machine: &str) -> anyhow::Result<Done> {
    // Typed once: the operator takes a `MachineId`.
    let machine = &fleet_reconciler::model::MachineId::from(machine);
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
    Ok(Done::new("release", text, json))
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
        Output::Text => print!("{}", view.render()),
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

/// A JSON document (`check`, `plan`) on stdout, streamed: indented on a
/// terminal, compact when a program reads it (`| jq .` indents it again);
/// the operator commands' one-line objects are [`print_json`]'s. A closed
/// stdout (`| head`) is the reader's choice, not our error.
fn print_document(doc: &impl serde::Serialize) {
    use std::io::IsTerminal;
    let pretty = std::io::stdout().is_terminal();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let _ = render::write_json(&mut out, doc, pretty).and_then(|()| out.flush());
}

fn print_fleet(fleet: &FleetDocument<'_>, output: Output) -> ExitCode {
    match output {
        Output::Json => print_document(fleet),
        Output::Text => print!("{}", render::to_table(fleet)),
    }
    exit_code_of(fleet)
}

/// `check`'s exit code: 2 when an app could not be listed (said on stderr),
/// else 0 coherent, 1 drift or unprobeable machines.
fn exit_code_of(fleet: &FleetDocument<'_>) -> ExitCode {
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
            agent_tokens.insert(app.name.to_string(), SecretString::from(token));
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
    })
}

/// A variable's value as a secret; unset, empty or blank is `None`.
fn env_secret(var: &str) -> Option<SecretString> {
    std::env::var(var)
        .ok()
        .filter(|t| !t.trim().is_empty())
        .map(SecretString::from)
}

/// The log subscriber: `RUST_LOG`'s filter (a malformed one is an error,
/// not the default), lines in `format` on stderr, one event per line.
fn init_logging(format: LogFormat) -> Result<(), fleet_reconciler::logging::FilterError> {
    let rust_log = std::env::var("RUST_LOG").ok();
    let filter = fleet_reconciler::logging::filter(rust_log.as_deref())?;
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `kind` labels scripts already match on, pinned so a rename is seen.
    #[test]
    fn cli_error_kinds_keep_their_labels() {
        use strum::VariantArray;
        let labels: Vec<&str> = CliErrorKind::VARIANTS.iter().map(|k| k.into()).collect();
        let mut want = vec![
            "fly_token_missing",
            "not_ready",
            "bad_commit",
            "not_confirmed",
        ];
        if cfg!(feature = "sim") {
            want.push("demo_config");
        }
        assert_eq!(labels, want);
        assert_eq!(CliError::BadCommit("x".into()).kind(), "bad_commit");
    }
}

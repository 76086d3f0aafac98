//! The command line's grammar: the clap definition of every command, its
//! arguments and its `--help` text. `main.rs` parses with it and the
//! command modules beside it do the work; the doc check (tests/it/docs.rs)
//! parses every `fleet-reconciler …` command the README and docs show with
//! it, so text and binary cannot disagree. It must never do anything but describe: no I/O, no behaviour.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "fleet-reconciler",
    version = VERSION,
    about = "Keeps long-running agents on Fly Machines on the released overlay"
)]
pub struct Cli {
    /// Config file, before the command (`fleet-reconciler --config F
    /// check`); each command but `demo` takes it after too, and shows it
    /// there ([`ConfigArg`]).
    #[arg(long, hide = true)]
    pub config: Option<PathBuf>,
    /// Log line format (logs go to stderr; filter with RUST_LOG). A fatal
    /// error follows it too.
    #[arg(
        long,
        global = true,
        value_enum,
        env = "FLEET_RECONCILER_LOG_FORMAT",
        default_value_t = LogFormat::Text
    )]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

/// The crate version and the commit it was built from (build.rs).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("FLEET_RECONCILER_COMMIT"),
    ")"
);

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One line of text per event.
    Text,
    /// One JSON object per event (for a log shipper).
    Json,
}

/// How a command prints: one vocabulary for every command.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Lines and tables for people (`table` is accepted too).
    #[value(alias = "table")]
    Text,
    /// One JSON document on stdout; on failure a JSON error object there
    /// (docs/reference.md, "Commands").
    Json,
}

/// `--config` of every command that reads one (all but `demo`).
#[derive(Clone, Default, clap::Args)]
pub struct ConfigArg {
    /// Config file (TOML). Default: $FLEET_RECONCILER_CONFIG, else
    /// /etc/fleet-reconciler/fleet-reconciler.toml (the image's path). A
    /// relative path is taken from the working directory.
    #[arg(long)]
    pub config: Option<PathBuf>,
}

impl Cli {
    /// The `--config` given, after the command or before it (after wins).
    pub fn config_path(&self) -> Option<&std::path::Path> {
        self.command.config().or(self.config.as_deref())
    }
}

#[derive(Clone, Copy, clap::Args)]
pub struct OutputArg {
    /// How to print: `text` for people, `json` for programs (on failure, a
    /// JSON error object on stdout; the exit code is the same).
    #[arg(long, short, value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

#[derive(Subcommand)]
pub enum Command {
    /// One read-only sweep: report drift, with each machine's decision as `plan` makes it. Exit 0 coherent, 1 drift or unprobeable machines, 2 error (an app that cannot be listed included).
    Check {
        #[command(flatten)]
        cfg: ConfigArg,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Read-only: one sweep, then each machine's decision and the steps a daemon would take now. Exit 0 coherent, 1 drift or unprobeable machines, 2 error (as `check`).
    Plan {
        #[command(flatten)]
        cfg: ConfigArg,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Parse and validate the config file, then exit. Exit 0 valid, 2 not (every problem named). Offline; also refuses a config `run` would refuse (no rotation.coordinator while a pool acts).
    ValidateConfig {
        #[command(flatten)]
        cfg: ConfigArg,
        /// Also check that every environment variable a `*_env` key names is set (each missing one reported).
        #[arg(long)]
        check_env: bool,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Before `run` or a deploy: every check `run` makes at start, then live ones (each app listed with its own token, the coordinator, the overlay remote, a dry request to each webhook, a sample of health URLs). One line per check; exit 0 all ok, 1 a check failed, 2 the config is unusable.
    Preflight {
        #[command(flatten)]
        cfg: ConfigArg,
        #[command(flatten)]
        out: OutputArg,
    },
    /// The daemon: sweep, remediate per policy, serve metrics, the API and the status page. Exit 0 after SIGTERM or ctrl-c (a graceful shutdown), 2 when it cannot start (config, a secret, the listen address) or stops on an error.
    Run {
        #[command(flatten)]
        cfg: ConfigArg,
    },
    /// Ask a running daemon for the fleet (the `check` table with the daemon's decisions, from its last sweep), or with MACHINE for one machine's detail and the reason for its severity. Exit 0 coherent (with MACHINE: it is on the tip or not running), 1 drift or unprobeable machines, 2 error (the daemon cannot be reached or answers no document, an app it cannot list).
    Status {
        #[command(flatten)]
        cfg: ConfigArg,
        /// A machine id: show its detail (`GET /api/v1/machines/{id}`) instead of the fleet.
        machine: Option<String>,
        /// The daemon's HTTP address (default: server.listen of --config).
        #[arg(long)]
        url: Option<String>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Authorize one `manual` rotation of a machine (a metadata write). By default it waits for the agent to be idle; `--now` may end live work. Exit 0 approved, 2 error or not confirmed (nothing written).
    Approve {
        #[command(flatten)]
        cfg: ConfigArg,
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
    /// Remove a pending approval (written under the machine's lease, like `hold`); a machine without one is left as it is. Exit 0 removed or none pending, 2 error (nothing written).
    Revoke {
        #[command(flatten)]
        cfg: ConfigArg,
        /// The machine id (any configured app).
        machine: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Put an operator hold on a machine: no reconciler acts on it until `release`. Exit 0 held, 2 error (nothing written).
    Hold {
        #[command(flatten)]
        cfg: ConfigArg,
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
    /// Clear an operator hold. Exit 0 released, 2 error (nothing written).
    Release {
        #[command(flatten)]
        cfg: ConfigArg,
        /// The machine id (any configured app).
        machine: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Lift a halted release (`[release] halt_after_failures`): its failed rotations no longer count, and claims toward its tip start again. Exit 0 resumed, 2 error (nothing written).
    Resume {
        #[command(flatten)]
        cfg: ConfigArg,
        /// The app whose release is halted.
        app: String,
        /// Resume only if this tip (a full commit id) is the one halted.
        #[arg(long)]
        tip: Option<String>,
        /// Who resumes it (recorded on the coordinator).
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Run against a built-in simulated fleet (no credentials, loopback only), with its own config (another with --demo-config).
    #[cfg(feature = "sim")]
    Demo {
        /// Sweeps to run before exiting (0 = until the fleet settles, or ctrl-c).
        #[arg(long, default_value_t = 0)]
        sweeps: u32,
        /// Use this config instead of the built-in demo config.
        #[arg(long)]
        demo_config: Option<PathBuf>,
        /// Refused (the demo runs its own config): accepted only to say so.
        #[arg(long, hide = true)]
        config: Option<PathBuf>,
        /// Keep serving after the fleet settles, until ctrl-c (to run `preflight` or `check` against it).
        #[arg(long)]
        keep_running: bool,
        /// Print the full table each sweep (default: one line a sweep, and the steps).
        #[arg(long, short)]
        verbose: bool,
        /// Also post the demo's alerts to this Alertmanager (base URL, e.g.
        /// http://127.0.0.1:9093), as `[[alerts.alertmanager]]` would.
        #[arg(long)]
        alertmanager: Option<String>,
    },
}

impl Command {
    /// The `--config` given after the command.
    pub fn config(&self) -> Option<&std::path::Path> {
        match self {
            Command::Check { cfg, .. }
            | Command::Plan { cfg, .. }
            | Command::ValidateConfig { cfg, .. }
            | Command::Preflight { cfg, .. }
            | Command::Run { cfg }
            | Command::Status { cfg, .. }
            | Command::Approve { cfg, .. }
            | Command::Revoke { cfg, .. }
            | Command::Hold { cfg, .. }
            | Command::Release { cfg, .. }
            | Command::Resume { cfg, .. } => cfg.config.as_deref(),
            #[cfg(feature = "sim")]
            Command::Demo { config, .. } => config.as_deref(),
        }
    }

    /// The command's name (the JSON objects' `command`) and how it prints.
    pub fn name_and_output(&self) -> (&'static str, Output) {
        let text = Output::Text;
        match self {
            Command::Check { out, .. } => ("check", out.output),
            Command::Plan { out, .. } => ("plan", out.output),
            Command::ValidateConfig { out, .. } => ("validate-config", out.output),
            Command::Preflight { out, .. } => ("preflight", out.output),
            Command::Run { .. } => ("run", text),
            Command::Status { out, .. } => ("status", out.output),
            Command::Approve { out, .. } => ("approve", out.output),
            Command::Revoke { out, .. } => ("revoke", out.output),
            Command::Hold { out, .. } => ("hold", out.output),
            Command::Release { out, .. } => ("release", out.output),
            Command::Resume { out, .. } => ("resume", out.output),
            #[cfg(feature = "sim")]
            Command::Demo { .. } => ("demo", text),
        }
    }
}

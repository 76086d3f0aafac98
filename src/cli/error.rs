//! How a failed command reports: the error object of `--output json` (one
//! shape for every command, a stable `kind`), the `error:` line on stderr,
//! and the command line's own failures ([`CliError`]). It must never retry
//! or hide a failure: every error ends the command with exit 2.

use std::process::ExitCode;

use super::output::print_json;
use crate::act::operator::OperatorError;
use crate::cli::{LogFormat, Output};
use crate::config::ConfigError;
use crate::daemon::{CheckError, SetupError};
use crate::fly::FlyClientBuildError;
use crate::observe::overlay::OverlayError;
use crate::report::{render, server};

/// How a failed command reports: the JSON error object on stdout with
/// `--output json`, and the error on stderr as a log line of `--log-format`.
pub struct Fatal {
    pub command: &'static str,
    pub output: Output,
    pub log_format: LogFormat,
}

impl Fatal {
    /// Reports `e`; exit 2.
    pub fn report(&self, e: &anyhow::Error) -> ExitCode {
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
                match object.get("problems").and_then(serde_json::Value::as_array) {
                    // One problem a line: seven packed into one cannot be read.
                    Some(problems) => {
                        eprintln!("error: {} problem(s) for `run`:", problems.len());
                        for p in problems {
                            eprintln!("  {}", render::printable(p.as_str().unwrap_or_default()));
                        }
                    }
                    None => eprintln!("error: {message}"),
                }
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

/// Failures of the command line itself (not of the library). Its kind (the
/// `kind` of the error object) is its variant's snake-case name.
#[derive(Debug, thiserror::Error, strum::EnumDiscriminants)]
#[strum_discriminants(
    name(CliErrorKind),
    derive(strum::IntoStaticStr, strum::VariantArray),
    strum(serialize_all = "snake_case")
)]
pub enum CliError {
    #[error("{}", missing_tokens(missing))]
    FlyTokenMissing {
        /// Each unset variable and the apps whose Fly token it holds.
        missing: Vec<(String, Vec<String>)>,
    },
    // The `error:` line prints them one a line ([`Fatal::report`]).
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

pub fn missing_tokens(missing: &[(String, Vec<String>)]) -> String {
    missing
        .iter()
        .map(|(var, apps)| {
            let on_fly = if var == crate::config::FLY_TOKEN_ENV {
                // Whoever still exports flyctl's variable learns why it is not read.
                " (FLY_API_TOKEN is read instead only on a Fly machine, where flyctl does not run)"
            } else {
                ""
            };
            format!(
                "{var} is not set: the Fly token of app {} (mint one per app: `fly tokens create deploy -a {}`){on_fly}",
                apps.join(", "),
                apps.first().map_or("APP", String::as_str)
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The error's message with each cause once: `{:#}` of an error whose text
/// already quotes its source (`cannot read …: No such file`) would print
/// the source again after it.
pub fn message_of(e: &anyhow::Error) -> String {
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
pub fn error_object(
    command: &str,
    e: &anyhow::Error,
) -> serde_json::Map<String, serde_json::Value> {
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
                OperatorError::NoRecordKey(_) => "record_key_missing".into(),
                OperatorError::UnknownApp { .. } => "unknown_app".into(),
                OperatorError::NoCoordinator => "no_coordinator".into(),
                OperatorError::CoordinatorUnreadable { .. } => "coordinator_unreadable".into(),
                OperatorError::NotHalted { .. } => "not_halted".into(),
                OperatorError::OtherTip { .. } => "other_tip".into(),
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
                SetupError::Gate(_) | SetupError::GateUrlMissing { .. } => "gate_setup".into(),
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
        } else if cause.is::<crate::logging::FilterError>() {
            kind = "log_filter".into();
        } else if let Some(e) = cause.downcast_ref::<CliError>() {
            kind = e.kind().into();
            hint = e.hint().map(str::to_string);
            match e {
                CliError::NotConfirmed { machine, .. } => {
                    object.insert("machine_id".into(), Value::from(machine.as_str()));
                }
                CliError::NotReady { problems } => {
                    object.insert("problems".into(), json!(problems));
                }
                _ => {}
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

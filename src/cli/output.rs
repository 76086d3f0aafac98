//! How a command prints: what an operator command did ([`Done`], one line or
//! one JSON object), the `check`/`plan` documents and their exit codes.
//! Printing only: it must never fetch, decide or write.

use std::io::Write as _;
use std::process::ExitCode;

use crate::cli::Output;
use crate::report::render;
use crate::report::wire::FleetDocument;

/// What `approve`, `revoke`, `hold`, `release` or `validate-config` did: the human
/// line and the JSON object of `--output json`.
pub struct Done {
    pub text: String,
    pub json: serde_json::Map<String, serde_json::Value>,
}

impl Done {
    pub fn new(command: &'static str, text: String, json: serde_json::Value) -> Done {
        let mut object = serde_json::Map::new();
        object.insert("command".into(), command.into());
        if let serde_json::Value::Object(fields) = json {
            object.extend(fields);
        }
        Done { text, json: object }
    }
}

/// Prints what a command did: one line of text, or with `--output json`
/// exactly one JSON object on stdout. A failure is `main`'s to print
/// ([`super::error::Fatal`]): with `--output json` an error object instead, the same
/// shape for every command ([`super::error::error_object`]).
pub fn finish(output: Output, done: Done) -> anyhow::Result<ExitCode> {
    match output {
        Output::Text => println!("{}", done.text),
        Output::Json => print_json(&done.json),
    }
    Ok(ExitCode::SUCCESS)
}

pub fn print_json(object: &serde_json::Map<String, serde_json::Value>) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (`| head`) is the reader's choice, not our error.
    let _ = serde_json::to_writer(&mut out, object)
        .map_err(std::io::Error::from)
        .and_then(|()| writeln!(out))
        .and_then(|()| out.flush());
}

/// A JSON document (`check`, `plan`) on stdout, streamed: indented on a
/// terminal, compact when a program reads it (`| jq .` indents it again);
/// the operator commands' one-line objects are [`print_json`]'s. A closed
/// stdout (`| head`) is the reader's choice, not our error.
pub fn print_document(doc: &impl serde::Serialize) {
    use std::io::IsTerminal;
    let pretty = std::io::stdout().is_terminal();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let _ = render::write_json(&mut out, doc, pretty).and_then(|()| out.flush());
}

/// Prints a fleet report; exit 0 when coherent, 1 when anything drifts or
/// cannot be probed, 2 when an app could not be listed (its error on stderr,
/// one line per app, after the report of the apps that could).
pub fn print_fleet(fleet: &FleetDocument<'_>, output: Output) -> ExitCode {
    match output {
        Output::Json => print_document(fleet),
        Output::Text => print!("{}", render::to_table(fleet)),
    }
    exit_code_of(fleet)
}

/// `check`'s exit code: 2 when an app could not be listed (said on stderr),
/// else 0 coherent, 1 drift or unprobeable machines.
pub fn exit_code_of(fleet: &FleetDocument<'_>) -> ExitCode {
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

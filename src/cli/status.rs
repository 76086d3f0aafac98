//! `status`: a running daemon's fleet, or one machine's detail, read over
//! its HTTP API. Read-only.

use std::io::Write as _;
use std::process::ExitCode;

use super::output::print_fleet;
use super::{ConfigPath, daemon_url};
use crate::cli::Output;
use crate::report::{render, server};

/// `status`: a running daemon's fleet, or one machine's detail.
pub async fn status(
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
    // Stale data is said before it is shown (on stderr: the JSON stays the daemon's).
    if let Some(why) = doc.view.as_ref().and_then(|v| v.stale_reason.as_deref()) {
        eprintln!("STALE: {}", render::printable(why));
    }
    Ok(print_fleet(&doc, output))
}

/// `status MACHINE`: the daemon's JSON, or the detail for people; exit as
/// `check` would for that one machine (0 on the tip or not running, 1
/// otherwise, 2 when its app could not be listed).
pub fn print_machine(
    view: &server::MachineView,
    json: &serde_json::Value,
    output: Output,
) -> ExitCode {
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
    use crate::model::MachineStatus;
    match view.machine.status {
        MachineStatus::OnTip | MachineStatus::NotRunning => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    }
}

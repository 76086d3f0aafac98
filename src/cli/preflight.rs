//! `preflight`: every check `run` makes at start, then the live ones,
//! printed one a line.

use std::io::Write as _;
use std::process::ExitCode;

use super::ConfigPath;
use super::output::print_json;
use crate::cli::Output;
use crate::preflight;
use crate::report::render;

/// `preflight`: one line per check (`ok`, `FAIL` with its fix, `skip`),
/// or with `--output json` one object with every finding. Exit 0 when
/// nothing failed, 1 when a check failed, 2 when the config is unusable.
pub async fn preflight(config_path: &ConfigPath, output: Output) -> anyhow::Result<ExitCode> {
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
                    preflight::Status::Warn => "warn",
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

//! `approve`: one approval written, after `--now` has named the live work
//! it would end (the daemon's last report of the machine, judged by the
//! probe's own rule) and been confirmed.

use std::io::Write as _;
use std::sync::Arc;

use anyhow::Context as _;

use super::error::CliError;
use super::output::Done;
use super::{ConfigPath, daemon_url, operator, secrets_from_env};
use crate::daemon;
use crate::decide::decision::Decision;
use crate::metadata::operator::{Approval, ApprovalMode};
use crate::observe::probe::{Activity, AgentReport};
use crate::report::{render, server};

/// How `approve --now` confirms ending live work.
pub struct Confirm {
    /// Confirmed in advance (`--yes`).
    pub yes: bool,
    /// The daemon to ask for the machine's last report (`--url`).
    pub url: Option<String>,
}

/// The live work a running daemon last saw on a machine: what `approve
/// --now` would end.
#[derive(serde::Serialize)]
pub struct LiveWork {
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
    /// The report shows live work, by the probe's own rule
    /// ([`AgentReport::has_live_work`]): what the executor re-checks.
    #[serde(skip)]
    live: bool,
}

impl LiveWork {
    /// The live work of the daemon's report of the machine, swept `as_of`.
    fn seen(report: &AgentReport, as_of: Option<chrono::DateTime<chrono::Utc>>) -> LiveWork {
        LiveWork {
            known: true,
            live_sessions: report.live_sessions,
            busy: report.activity == Some(Activity::Busy),
            as_of,
            unknown: None,
            live: report.has_live_work(),
        }
    }

    /// Unknown live work is taken for some, never for none.
    fn any(&self) -> bool {
        !self.known || self.live
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
/// MACHINE` does, and the daemon's last decision for it.
pub async fn live_work(url: &str, machine: &str) -> (LiveWork, Option<Decision>) {
    let unknown = |why: String| LiveWork {
        known: false,
        live_sessions: None,
        busy: false,
        as_of: None,
        unknown: Some(why),
        live: false,
    };
    let view = match server::fetch_machine(url, machine, std::time::Duration::from_secs(10)).await {
        Ok((view, _)) => view,
        Err(e) => return (unknown(format!("the daemon at {url}: {e}")), None),
    };
    let Some(report) = view.agent_report else {
        let why = format!(
            "the daemon at {url} has no usable report from its agent ({})",
            view.machine.status
        );
        return (unknown(why), view.decision);
    };
    (LiveWork::seen(&report, view.swept_at), view.decision)
}

/// What `approve --now` says of a guardrail it overrides: a maintenance
/// window holding the machine's pool (Argo CD's manual sync override).
pub fn overrides(decision: Option<&Decision>) -> Option<String> {
    match decision {
        Some(Decision::Guarded { guard }) if guard.overridden_by_approval() => Some(format!(
            "this overrides the maintenance window that holds its pool ({guard}, {})",
            guard.lifts()
        )),
        _ => None,
    }
}

/// Asks on the terminal; `false` unless the answer is yes.
pub fn ask(question: &str) -> bool {
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    if std::io::stdin().read_line(&mut answer).is_err() {
        return false;
    }
    matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes")
}

pub async fn approve(
    config_path: &ConfigPath,
    machine: &str,
    mode: ApprovalMode,
    confirm: &Confirm,
    commit: Option<String>,
    by: String,
) -> anyhow::Result<Done> {
    // Typed once: the operator takes a `MachineId`.
    let machine = &crate::model::MachineId::from(machine);
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
            let (live, decision) = live_work(&url, machine.as_str()).await;
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
            if let Some(o) = overrides(decision.as_ref()) {
                eprintln!("approve --now: {}", render::printable(&o));
            }
            Some(live)
        }
    };
    let target = match commit {
        Some(c) => crate::model::CommitId::parse(&c).ok_or(CliError::BadCommit(c))?,
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
        crate::model::short_commit(approval.target.as_str()),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `approve --now` asks the probe's rule of the typed report: a turn in
    /// progress is live work without a session, and a report with neither
    /// is none.
    #[test]
    fn approve_now_says_it_overrides_a_window_and_nothing_else() {
        use crate::decide::guardrail::Guard;
        let window = Decision::Guarded {
            guard: Guard::Window {
                deny: true,
                until: None,
                time_zone: "UTC".into(),
            },
        };
        assert_eq!(
            overrides(Some(&window)).as_deref(),
            Some(
                "this overrides the maintenance window that holds its pool (inside a deny window, until it closes)"
            )
        );
        let canary = Decision::Guarded {
            guard: Guard::Canary {
                pool: "canary".into(),
                on_tip: 0,
                started: 1,
                needed: 1,
                soaked_secs: Some(0),
                soak_secs: 60,
                until: None,
                halted: false,
            },
        };
        assert_eq!(overrides(Some(&canary)), None);
        assert_eq!(overrides(Some(&Decision::OnTip)), None);
        assert_eq!(overrides(None), None);
    }

    #[test]
    fn live_work_is_the_probes_rule_of_the_typed_report() {
        let report = |body: &str| match crate::observe::probe::parse_report(body.as_bytes()) {
            crate::observe::probe::ProbeOutcome::Report(r) => r,
            other => panic!("not a report: {other:?}"),
        };
        let busy = report(r#"{"overlay_ref":"a4f9d2b","activity":"busy","live_sessions":0}"#);
        let live = LiveWork::seen(&busy, None);
        assert!(live.any());
        assert_eq!(
            live.describe("a/m1"),
            "a/m1 has a turn in progress: restarting it now ends them"
        );
        let idle = report(r#"{"overlay_ref":"a4f9d2b","activity":"idle"}"#);
        let live = LiveWork::seen(&idle, None);
        assert!(!live.any());
        assert_eq!(live.describe("a/m1"), "a/m1 has no live work");
        let sessions = report(r#"{"overlay_ref":"a4f9d2b","live_sessions":2}"#);
        assert!(LiveWork::seen(&sessions, None).any());
    }
}

//! Rendering a fleet document for people (a table) and programs (JSON),
//! and a snapshot with its plan (`plan`).
//!
//! Owns presentation only; it must never compute a status or a count that the
//! sweep and `decide::prepare` did not already make. What the JSON document
//! is, and how it reads back, is [`crate::report::wire`]'s.

use std::fmt::Write as _;

use serde::Serialize;

use crate::decide::decision::Decision;
use crate::decide::planner::Plan;
use crate::decide::snapshot::AppSummary;
use crate::decide::snapshot::Snapshot;
use crate::model::{MachineStatus, PolicyAction, Severity};
use crate::report::wire::{FleetDocument, RowView};

/// The `check --output json` document of `doc`, pretty.
pub fn to_json(doc: &FleetDocument<'_>) -> String {
    // Serializing plain structs of strings and numbers cannot fail.
    serde_json::to_string_pretty(doc).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

/// A document (the [`to_json`] report, [`plan_to_json`]'s) written to `out`
/// as it is serialized, followed by a newline: a 10,000-machine document is
/// megabytes that need not sit in memory. Indented for a person (`pretty`,
/// a terminal), compact for a program (half the bytes at 100,000 machines).
pub fn write_json(
    out: &mut impl std::io::Write,
    doc: &impl Serialize,
    pretty: bool,
) -> std::io::Result<()> {
    if pretty {
        serde_json::to_writer_pretty(&mut *out, doc)?;
    } else {
        serde_json::to_writer(&mut *out, doc)?;
    }
    out.write_all(b"\n")
}

/// `s` with every control character escaped (`\u{1b}`).
pub fn printable(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A readable table: one row per machine, with the DECISION of each that
/// the document has (`-` without), then one coherence line per app. An app
/// the sweep could not list says so, with the error, on its line; its rows
/// (if any) are its last listing, marked `stale` in DETAIL.
pub fn to_table(report: &FleetDocument<'_>) -> String {
    let headers = [
        "APP", "MACHINE", "NAME", "REGION", "POOL", "REF", "BEHIND", "AHEAD", "SEVERITY", "ACTION",
        "STATUS", "DECISION", "DETAIL",
    ];
    let stale = report.stale_app_names();
    let rows: Vec<[String; 13]> = report
        .rows()
        .map(|m| cells(report, m, stale.contains(m.app.as_str())))
        .collect();
    // Names, regions and details come from Fly and the agents: a control
    // character (ESC, BEL, CR) is shown escaped, never sent to the terminal.
    let rows: Vec<[String; 13]> = rows.into_iter().map(|r| r.map(|c| printable(&c))).collect();
    let mut widths = headers.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row.iter()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "release tip: {} @ {}",
        report.tip.branch, report.tip.commit
    );
    let line = |out: &mut String, cells: &[&str]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths.iter()).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                let _ = write!(s, "{cell:<w$}  ");
            }
        }
        let _ = writeln!(out, "{}", s.trim_end());
    };
    line(&mut out, &headers);
    for row in &rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        line(&mut out, &cells);
    }
    out.push('\n');
    let holds = report.pool_holds();
    if !holds.is_empty() {
        out.push_str("Guardrails (which pool is held, and until when):\n");
        for h in &holds {
            let _ = writeln!(out, "  {}", printable(&h.to_string()));
        }
        out.push('\n');
    }
    for app in report.apps.iter() {
        let _ = writeln!(out, "{}", printable(&app_line(report, app)));
    }
    let started: usize = report.apps.iter().map(|a| a.coherence.machines).sum();
    let on_tip: usize = report.apps.iter().map(|a| a.coherence.on_tip).sum();
    let mut unlisted: Vec<&str> = stale.into_iter().collect();
    unlisted.sort_unstable();
    let _ = writeln!(
        out,
        "fleet: {on_tip}/{started} started machines on tip, coherence {:.1}%{}",
        report.coherence * 100.0,
        if unlisted.is_empty() {
            String::new()
        } else {
            format!(
                "; {} app(s) not listed: {}",
                unlisted.len(),
                unlisted.join(", ")
            )
        }
    );
    out
}

/// The fleet in one line (the demo's per-sweep line): machines on the tip
/// and coherence, the other statuses, and the decisions other than
/// `on tip` and `not running`, each with its count, most frequent first.
pub fn summary_line(report: &FleetDocument<'_>) -> String {
    let started: usize = report.apps.iter().map(|a| a.coherence.machines).sum();
    let on_tip: usize = report.apps.iter().map(|a| a.coherence.on_tip).sum();
    let mut out = format!(
        "{on_tip}/{started} started machines on tip, coherence {:.1}%",
        report.coherence * 100.0
    );
    let statuses: Vec<String> = MachineStatus::ALL
        .iter()
        .filter(|s| !matches!(s, MachineStatus::OnTip | MachineStatus::NotRunning))
        .filter_map(|&s| {
            let n = report.count(None, s);
            (n > 0).then(|| format!("{n} {s}"))
        })
        .collect();
    if !statuses.is_empty() {
        let _ = write!(out, " ({})", statuses.join(", "));
    }
    let mut decisions: Vec<(String, usize)> = Vec::new();
    for m in report.rows() {
        let Some(d) = report.decision(m.machine_id) else {
            continue;
        };
        if matches!(d, Decision::OnTip | Decision::NotRunning { .. }) {
            continue;
        }
        let label = d.label();
        match decisions.iter_mut().find(|(l, _)| *l == label) {
            Some((_, n)) => *n += 1,
            None => decisions.push((label, 1)),
        }
    }
    decisions.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    if !decisions.is_empty() {
        let listed: Vec<String> = decisions.iter().map(|(l, n)| format!("{n} {l}")).collect();
        let _ = write!(out, " · {}", listed.join(", "));
    }
    let stale = report.stale_app_names();
    if !stale.is_empty() {
        let mut names: Vec<&str> = stale.into_iter().collect();
        names.sort_unstable();
        let _ = write!(out, " · not listed: {}", names.join(", "));
    }
    printable(&out)
}

/// One machine's cells, in the table's column order (`stale`: its app was
/// not listed by the sweep).
fn cells(report: &FleetDocument<'_>, m: RowView<'_>, stale: bool) -> [String; 13] {
    let dash = || "-".to_string();
    [
        m.app.to_string(),
        m.machine_id.to_string(),
        m.name.to_owned(),
        m.region.to_owned(),
        m.pool.to_string(),
        m.reported_ref
            .map(|r| r.chars().take(12).collect())
            .unwrap_or_else(dash),
        m.commits_behind.map(|n| n.to_string()).unwrap_or_else(dash),
        m.commits_ahead.map(|n| n.to_string()).unwrap_or_else(dash),
        m.severity.map(|s| s.to_string()).unwrap_or_else(dash),
        m.action.map(|a| a.to_string()).unwrap_or_else(dash),
        if m.status == MachineStatus::NotRunning {
            format!("not_running ({})", m.state)
        } else {
            m.status.to_string()
        },
        report
            .decision(m.machine_id)
            .map(Decision::label)
            .unwrap_or_else(dash),
        match (stale, m.detail) {
            (false, detail) => detail.unwrap_or_default().to_owned(),
            (true, None) => "stale (app not listed)".to_string(),
            (true, Some(d)) => format!("stale (app not listed); {d}"),
        },
    ]
}

/// One app's coherence line, or why it was not listed.
fn app_line(report: &FleetDocument<'_>, app: &AppSummary) -> String {
    let mut problems = Vec::new();
    for status in MachineStatus::ALL {
        if matches!(status, MachineStatus::OnTip) {
            continue;
        }
        let n = report.count(Some(&app.name), status);
        if n > 0 {
            problems.push(format!("{n} {status}"));
        }
    }
    let figures = format!(
        "{}/{} started machines on tip, coherence {:.1}%{}",
        app.coherence.on_tip,
        app.coherence.machines,
        app.coherence.ratio * 100.0,
        if problems.is_empty() {
            String::new()
        } else {
            format!(" ({})", problems.join(", "))
        }
    );
    match &app.stale {
        None => format!("{}: {figures}", app.name),
        Some(s) => match s.last_listed_at {
            None => format!("{}: not listed: {}", app.name, s.error),
            Some(at) => format!(
                "{}: not listed, showing its listing of {}: {figures}; {}",
                app.name,
                at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                s.error
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The snapshot of `machines`, none judged.
    fn snapshot(
        config: &crate::config::Config,
        tip: &crate::observe::overlay::Tip,
        machines: Vec<crate::observe::sweep::ObservedMachine>,
    ) -> Snapshot {
        let observation = crate::observe::sweep::observation(config, tip, machines);
        Snapshot::judged(observation, |_| None)
    }

    #[test]
    fn control_characters_from_outside_never_reach_the_terminal() {
        assert_eq!(printable("agent-1"), "agent-1");
        assert_eq!(printable("a\u{1b}[2Jb\u{7}\r"), "a\\u{1b}[2Jb\\u{7}\\u{d}");
        let config = crate::config::Config::parse(
            std::path::Path::new("t.toml"),
            "[overlay]\nrepo = \"/r\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n[[apps]]\nname = \"app\"\n",
        )
        .unwrap();
        let machine = crate::observe::sweep::ObservedMachine {
            name: "evil\u{1b}]0;pwned\u{7}".into(),
            region: "iad\r".into(),
            status: MachineStatus::BadReport,
            detail: Some("bad \u{1b}[31mred".into()),
            ..crate::observe::sweep::ObservedMachine::listed(
                "app",
                "m1",
                "",
                crate::model::MachineState::Started,
            )
        };
        let tip = crate::observe::overlay::Tip {
            branch: "release".into(),
            commit: crate::model::CommitId::parse(&"a".repeat(40)).unwrap(),
        };
        let table = to_table(&FleetDocument::of(&snapshot(&config, &tip, vec![machine])));
        assert!(
            !table.chars().any(|c| c.is_control() && c != '\n'),
            "{table:?}"
        );
        assert!(table.contains("evil\\u{1b}]0;pwned\\u{7}"), "{table}");
    }

    #[test]
    fn an_app_not_listed_says_so_with_the_error() {
        let config = crate::config::Config::parse(
            std::path::Path::new("t.toml"),
            "[overlay]\nrepo = \"/r\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n\
             [[apps]]\nname = \"a\"\n[[apps]]\nname = \"b\"\n[[apps]]\nname = \"c\"\n",
        )
        .unwrap();
        let machine = |app: &str, id: &str| crate::observe::sweep::ObservedMachine {
            region: "iad".into(),
            status: MachineStatus::OnTip,
            ..crate::observe::sweep::ObservedMachine::listed(
                app,
                id,
                id,
                crate::model::MachineState::Started,
            )
        };
        let tip = crate::observe::overlay::Tip {
            branch: "release".into(),
            commit: crate::model::CommitId::parse(&"a".repeat(40)).unwrap(),
        };
        let mut report = snapshot(&config, &tip, vec![machine("a", "a1"), machine("b", "b1")]);
        let stale = |app: &str, at| crate::observe::sweep::StaleApp {
            error: format!("cannot list machines of app {app}: answered 503"),
            kind: "status".into(),
            last_listed_at: at,
        };
        report.apps[1].stale = Some(stale(
            "b",
            chrono::DateTime::from_timestamp(1_800_000_000, 0),
        ));
        report.apps[2].stale = Some(stale("c", None));
        let table = to_table(&FleetDocument::of(&report));
        let line = |prefix: &str| {
            table
                .lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("{prefix} in {table}"))
                .to_string()
        };
        assert_eq!(
            line("a:"),
            "a: 1/1 started machines on tip, coherence 100.0%"
        );
        assert_eq!(
            line("b:"),
            "b: not listed, showing its listing of 2027-01-15T08:00:00Z: 1/1 started machines on tip, coherence 100.0%; cannot list machines of app b: answered 503"
        );
        assert_eq!(
            line("c:"),
            "c: not listed: cannot list machines of app c: answered 503"
        );
        assert!(
            line("fleet:").ends_with("; 2 app(s) not listed: b, c"),
            "{table}"
        );
        assert!(line("a ").trim_end().ends_with("on_tip  -"), "{table}");
        assert!(line("b ").ends_with("stale (app not listed)"), "{table}");
    }
}

/// The version of `plan --output json` (docs/plan.schema.json), raised
/// when a field is removed or changes meaning, as the fleet document's.
pub const PLAN_SCHEMA_VERSION: u32 = 1;

// `plan --output json`: the tip, each machine's decision (typed, with its
// sentence) and the steps a daemon would take now. It speaks the fleet
// document's vocabulary (`tip` as `{branch, commit}`, `coherence`, a row
// leaves out what would be null). A `//` comment: a doc comment would
// become the schema's description.
#[derive(Serialize, schemars::JsonSchema)]
pub struct PlanJson<'a> {
    pub schema_version: u32,
    pub tip: &'a crate::observe::sweep::TipReport,
    /// Every started machine reports the tip.
    pub coherent: bool,
    /// On-tip ÷ started machines, over the whole fleet, as `check`'s.
    pub coherence: f64,
    pub machines: Vec<PlannedMachine<'a>>,
    /// Each pool a guardrail or a halted release holds from new claims, and
    /// until when (from its machines' decisions); absent when none holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guardrails: Vec<crate::decide::decision::PoolHold>,
    pub steps: Vec<PlannedStep>,
}

#[derive(Serialize, schemars::JsonSchema)]
pub struct PlannedMachine<'a> {
    pub app: &'a str,
    pub machine_id: &'a str,
    pub name: &'a str,
    pub pool: &'a str,
    pub status: MachineStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub severity: Option<Severity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<PolicyAction>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<&'a Decision>,
    /// The decision as a sentence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
}

#[derive(Serialize, schemars::JsonSchema)]
pub struct PlannedStep {
    pub app: String,
    pub machine_id: String,
    /// `claim`, `restart`, `finish`, … (the `action` label of `fleet_reconciler_actions_total`).
    pub kind: &'static str,
    pub description: String,
}

/// The JSON Schema of [`PlanJson`] (docs/plan.schema.json), pretty.
pub fn plan_schema() -> String {
    let schema = schemars::schema_for!(PlanJson<'static>);
    serde_json::to_string_pretty(&schema).unwrap_or_default() + "\n"
}

pub fn plan_to_json<'a>(report: &'a Snapshot, plan: &'a Plan) -> PlanJson<'a> {
    PlanJson {
        schema_version: PLAN_SCHEMA_VERSION,
        tip: &report.tip,
        coherent: report.is_coherent(),
        coherence: report.coherence.ratio,
        machines: report
            .machines
            .iter()
            .map(|m| {
                let decision = plan.decision(&m.seen.machine_id);
                PlannedMachine {
                    app: m.seen.app.as_str(),
                    machine_id: m.seen.machine_id.as_str(),
                    name: &m.seen.name,
                    pool: m.seen.pool.as_str(),
                    status: m.seen.status,
                    severity: m.severity(),
                    action: m.action(),
                    decision,
                    summary: decision.map(ToString::to_string),
                }
            })
            .collect(),
        guardrails: crate::decide::decision::pool_holds(
            report
                .machines
                .iter()
                .map(|m| (&m.seen.app, &m.seen.pool, plan.decision(&m.seen.machine_id))),
        ),
        steps: plan
            .steps()
            .iter()
            .map(|s| PlannedStep {
                app: s.target.app.to_string(),
                machine_id: s.target.machine_id.to_string(),
                kind: s.kind(),
                description: s.to_string(),
            })
            .collect(),
    }
}

/// `plan`'s table: the fleet with each machine's decision, then why for every
/// machine that is not on the tip, then the steps a daemon would take now.
pub fn plan_to_table(report: &Snapshot, plan: &Plan) -> String {
    let mut out = to_table(&FleetDocument::planned(report, plan));
    let why: Vec<String> = report
        .machines
        .iter()
        .filter_map(|m| {
            let d = plan.decision(&m.seen.machine_id)?;
            (*d != Decision::OnTip)
                .then(|| printable(&format!("  {}/{}: {d}", m.seen.app, m.seen.machine_id)))
        })
        .collect();
    if !why.is_empty() {
        out.push_str("\nDecisions:\n");
        for line in why {
            let _ = writeln!(out, "{line}");
        }
    }
    // A record key rotation: what is still sealed with the previous key.
    let previous: Vec<String> = report
        .machines
        .iter()
        .filter(|m| !m.seen.inputs.controls.by_previous_key.is_empty())
        .map(|m| {
            printable(&format!(
                "  {}/{}: {}",
                m.seen.app,
                m.seen.machine_id,
                m.seen.inputs.controls.by_previous_key.join(", ")
            ))
        })
        .collect();
    if !previous.is_empty() {
        out.push_str("\nSealed with the previous record key (re-seal before dropping it):\n");
        for line in previous {
            let _ = writeln!(out, "{line}");
        }
    }
    // Records an agent may have forged or deleted (docs/safety.md, "Threat model").
    let tampered: Vec<String> = plan
        .alerts
        .iter()
        .filter(|a| a.kind == crate::decide::alerts::AlertKind::MetadataTampered)
        .map(|a| printable(&format!("  {}", a.summary)))
        .collect();
    if !tampered.is_empty() {
        out.push_str("\nmetadata_tampered:\n");
        for line in tampered {
            let _ = writeln!(out, "{line}");
        }
    }
    let steps = plan.steps();
    if steps.is_empty() {
        out.push_str("\nNo steps: a daemon would do nothing now.\n");
    } else {
        let _ = writeln!(out, "\nSteps a daemon would take now ({}):", steps.len());
        for s in &steps {
            let _ = writeln!(out, "  {}", printable(&s.to_string()));
        }
    }
    out
}

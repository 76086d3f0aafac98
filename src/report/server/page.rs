//! The status page at `GET /` and a page per machine at `GET /machines/{id}`:
//! server-rendered HTML documents.
//!
//! Owns presentation of the last sweep for a person at a laptop: coherence
//! per app at a glance with its trend over the last sweeps (inline SVG), then
//! the machines that need attention, most severe first, each linking to its
//! page (its report, the agent's, its rotation, and the CLI commands for the
//! operator actions that apply; read-only: a browser never acts). No
//! scripts, no external assets, no build step; pages reload themselves once
//! per sweep interval. Built with `maud`: every interpolated string (from
//! an agent, Fly or the config) is HTML-escaped by the template itself, and
//! markup is only ever what the templates here spell out. It must never
//! compute a status, severity or action the snapshot does not already carry.

use std::cmp::Reverse;
use std::time::Duration;

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, PreEscaped, html};

use crate::decide::decision::{Decision, pool_holds};
use crate::decide::snapshot::{JudgedMachine, Snapshot};
use crate::metadata::controls::HoldValue;
use crate::metadata::operator::ApprovalMode;
use crate::metadata::{APPROVE_KEY, MARKER_KEY};
use crate::model::short_commit as short;
use crate::model::{AppName, CommitId, MachineId, MachineStatus, PolicyAction, Severity};
use crate::observe::probe::{Activity, AgentReport};
use crate::observe::sweep::ObservedMachine;

use super::trend::CoherenceTrend;
use super::{Observed, age, checked_id, control};

/// Beyond this many rows the page points at the JSON API instead.
const MAX_ROWS: usize = 500;

/// Colour class of a coherence value: at or above the alert threshold is
/// fine; within three quarters of it is a warning; below that is bad.
fn level(coherence: f64, threshold: f64) -> &'static str {
    if coherence >= threshold {
        "ok"
    } else if coherence >= threshold * 0.75 {
        "warn"
    } else {
        "bad"
    }
}

fn percent(ratio: f64) -> String {
    let p = ratio * 100.0;
    if (p - p.round()).abs() < 0.05 {
        format!("{p:.0}%")
    } else {
        format!("{p:.1}%")
    }
}

/// Seconds between reloads: once per sweep, but not more than every 5 s.
fn refresh_seconds(interval: Duration) -> u64 {
    interval.as_secs().clamp(5, 300)
}

const STYLE: &str = r#"
:root { --fg:#1c2430; --muted:#5b6675; --line:#e3e7ed; --bg:#f5f7fa; --card:#fff;
  --ok:#1f8a4c; --ok-bg:#e3f5ea; --warn:#b26b00; --warn-bg:#fff2d9; --bad:#c62828; --bad-bg:#fde7e7;
  --crit:#b71c1c; --high:#e65100; --med:#a86b00; --low:#3d5a80; --probe:#6a3fa0; }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
  color:var(--fg); background:var(--bg); }
main { max-width:1360px; margin:0 auto; padding:20px 28px 32px; }
header { display:flex; flex-wrap:wrap; align-items:baseline; gap:6px 22px; margin-bottom:14px; }
h1 { font-size:21px; margin:0; letter-spacing:-.01em; }
h2 { font-size:17px; margin:26px 0 10px; }
.meta { color:var(--muted); }
.meta b { color:var(--fg); font-weight:600; }
code, .mono { font-family:ui-monospace,"SFMono-Regular",Menlo,Consolas,"Liberation Mono",monospace; font-size:13px; }
.banner { padding:10px 14px; border-radius:8px; margin:10px 0; font-weight:500; }
.banner.bad { background:var(--bad-bg); color:var(--bad); border:1px solid #f3b9b9; }
.banner.warn { background:var(--warn-bg); color:var(--warn); border:1px solid #f1d39a; }
.cards { display:grid; grid-template-columns:repeat(auto-fit,minmax(280px,1fr)); gap:14px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:14px 16px 13px; }
.card.fleet { border-width:2px; }
.card .name { font-weight:600; color:var(--muted); font-size:13px; text-transform:uppercase; letter-spacing:.05em; }
.card .big { font-size:40px; font-weight:700; line-height:1.1; margin:4px 0 2px; }
.card .sub { color:var(--muted); font-size:14px; }
.ok .big { color:var(--ok); } .warn .big { color:var(--warn); } .bad .big { color:var(--bad); }
.bar { height:8px; background:#e8ebf0; border-radius:4px; overflow:hidden; margin:8px 0 9px; }
.bar i { display:block; height:100%; border-radius:4px; }
.ok .bar i { background:var(--ok); } .warn .bar i { background:var(--warn); } .bad .bar i { background:var(--bad); }
.chips { display:flex; flex-wrap:wrap; gap:5px; }
.chip { font-size:12px; padding:1px 8px; border-radius:10px; background:#eef1f5; color:var(--muted); white-space:nowrap; }
.chip.n { background:var(--bad-bg); color:var(--bad); }
table { width:100%; border-collapse:collapse; background:var(--card); border:1px solid var(--line); border-radius:10px; overflow:hidden; }
th { text-align:left; font-size:12px; text-transform:uppercase; letter-spacing:.04em; color:var(--muted);
  background:#fafbfc; padding:8px 10px; border-bottom:1px solid var(--line); white-space:nowrap; }
td { padding:7px 10px; border-bottom:1px solid var(--line); vertical-align:top; white-space:nowrap; }
tr:last-child td { border-bottom:0; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
td.detail { color:var(--muted); font-size:13px; min-width:220px; white-space:normal; overflow-wrap:anywhere; }
td.rot { white-space:normal; min-width:120px; }
.sev { display:inline-block; min-width:64px; text-align:center; font-size:12px; font-weight:700; color:#fff;
  padding:2px 8px; border-radius:4px; text-transform:uppercase; letter-spacing:.03em; }
.sev.critical { background:var(--crit); } .sev.high { background:var(--high); }
.sev.medium { background:var(--med); } .sev.low { background:var(--low); }
.sev.probe { background:var(--probe); }
.id { color:var(--muted); font-size:12px; }
.tag { font-size:12px; padding:1px 6px; border-radius:4px; background:#eef1f5; white-space:nowrap; }
.tag.hold { background:#e8eaf6; color:#283593; } .tag.approved { background:var(--ok-bg); color:var(--ok); }
.allgood { background:var(--ok-bg); color:var(--ok); border:1px solid #b7e1c6; border-radius:10px;
  padding:22px; font-size:19px; font-weight:600; text-align:center; }
footer { margin-top:22px; color:var(--muted); font-size:13px; }
footer a { color:var(--low); }
.spark { display:block; width:100%; height:36px; margin:2px 0 4px; color:var(--muted); }
.ok .spark { color:var(--ok); } .warn .spark { color:var(--warn); } .bad .spark { color:var(--bad); }
.spark polyline { fill:none; stroke:currentColor; stroke-width:2; stroke-linecap:round; stroke-linejoin:round; }
.spark line { stroke:#c3cad4; stroke-width:1; stroke-dasharray:3 3; }
.trend { color:var(--muted); font-size:12px; margin-bottom:6px; }
a.m { color:inherit; text-decoration:none; border-bottom:1px dotted var(--muted); }
a.m:hover { color:var(--low); border-bottom-color:var(--low); }
.meta a { color:var(--low); }
.grid { display:grid; grid-template-columns:repeat(auto-fit,minmax(420px,1fr)); gap:14px; }
.box { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:12px 16px 14px; }
.box h2 { margin:0 0 10px; font-size:15px; }
.box h3 { margin:12px 0 6px; font-size:13px; color:var(--muted); text-transform:uppercase; letter-spacing:.04em; }
dl.kv { display:grid; grid-template-columns:max-content 1fr; gap:5px 16px; margin:0; }
dl.kv dt { color:var(--muted); font-size:13px; padding-top:1px; }
dl.kv dd { margin:0; overflow-wrap:anywhere; }
pre { background:#f3f5f8; border:1px solid var(--line); border-radius:6px; padding:8px 10px; margin:4px 0 0;
  overflow-x:auto; font-family:ui-monospace,"SFMono-Regular",Menlo,Consolas,"Liberation Mono",monospace; font-size:13px; }
ol.history { margin:0; padding-left:22px; font-size:13px; }
.cmd p { margin:10px 0 3px; color:var(--muted); font-size:13px; }
.cmd p:first-of-type { margin-top:0; }
.box.cmd { grid-column:1 / -1; }
"#;

/// Renders the page for `observed` as of `now`.
pub fn render_status_page(observed: &Observed, now: DateTime<Utc>) -> String {
    let title = match &observed.report {
        Some(r) => format!("{} coherent · fleet-reconciler", percent(r.coherence.ratio)),
        None => "fleet-reconciler".to_string(),
    };
    let body = html! {
        (header(observed, now))
        (banners(observed, now))
        (unlisted_banners(observed, now))
        @match &observed.report {
            None => div.banner.warn { "Waiting for the first sweep; this page reloads by itself." }
            Some(report) => {
                (cards(report, &observed.trend, observed.coherence_threshold))
                (guardrails(report, observed, now))
                (attention(report, observed, now))
            }
        }
        (footer(observed, now))
    };
    document(&title, Some(refresh_seconds(observed.sweep_interval)), body)
}

/// The HTML document around `body`: styles inline, no scripts; `refresh`
/// makes it reload itself every so many seconds.
fn document(title: &str, refresh: Option<u64>, body: Markup) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if let Some(secs) = refresh {
                    meta http-equiv="refresh" content=(secs);
                }
                title { (title) }
                style { (PreEscaped(STYLE)) }
            }
            body { main { (body) } }
        }
    }
    .into_string()
}

fn header(observed: &Observed, now: DateTime<Utc>) -> Markup {
    html! {
        header {
            h1 { "fleet-reconciler" }
            div.meta {
                @if let Some(r) = &observed.report {
                    "release tip " b { (r.tip.branch) } " @ "
                    code title=(r.tip.commit) { (short(r.tip.commit.as_str())) }
                    @if let Some(fetched) = observed.tip.as_ref().filter(|t| r.tip.commit != **t) {
                        " (fetched " code title=(fetched) { (short(fetched.as_str())) } ", not swept yet)"
                    }
                }
                @if let Some(at) = observed.last_success {
                    " · last sweep " b { (age(now, at)) " ago" }
                    " (" (at.format("%Y-%m-%d %H:%M:%S UTC")) ")"
                }
                " · sweeps every " (humantime::format_duration(observed.sweep_interval))
            }
        }
    }
}

fn banners(observed: &Observed, now: DateTime<Utc>) -> Markup {
    if observed.report.is_some()
        && let Err(reason) = observed.readiness(now)
    {
        return html! {
            div.banner.bad { "Stale: " (reason) ". The figures below may no longer be true." }
        };
    }
    html! {
        @if let Some(f) = &observed.last_failure {
            @if observed.last_success.is_none_or(|s| f.at > s) {
                div.banner.warn { "Last sweep failed " (age(now, f.at)) " ago: " (f.error) }
            }
        }
    }
}

/// One banner per app the last sweep could not list: the error, and what is
/// shown of it instead.
fn unlisted_banners(observed: &Observed, now: DateTime<Utc>) -> Markup {
    let Some(report) = &observed.report else {
        return html! {};
    };
    html! {
        @for (app, stale) in report.stale_apps() {
            div.banner.warn {
                "App " b { (app) } " could not be listed: " (stale.error) ". Shown stale: "
                @match stale.last_listed_at {
                    Some(at) => { "its machines and figures below are from its last listing, " (age(now, at)) " ago" }
                    None => "its machines are unknown and not shown",
                }
                "; nothing is done to its machines until it lists again."
            }
        }
    }
}

fn card(
    class: &str,
    name: &str,
    coherence: f64,
    sub: &str,
    trend: Markup,
    chips: Markup,
) -> Markup {
    html! {
        div class={ "card " (class) } {
            div.name { (name) }
            div.big { (percent(coherence)) }
            div.bar { i style={ "width:" (format!("{:.1}", (coherence * 100.0).clamp(0.0, 100.0))) "%" } {} }
            div.sub { (sub) }
            (trend)
            (chips)
        }
    }
}

fn cards(report: &Snapshot, trend: &CoherenceTrend, threshold: f64) -> Markup {
    let fleet = report.coherence;
    html! {
        section.cards {
            (card(
                &format!("fleet {}", level(fleet.ratio, threshold)),
                "Fleet coherence",
                fleet.ratio,
                &format!(
                    "{} of {} started machines on the release tip · {} apps",
                    fleet.on_tip,
                    fleet.machines,
                    report.apps.len()
                ),
                trend_chart(trend, None, threshold),
                html! {},
            ))
            @for app in &report.apps {
                @let (class, sub) = match &app.stale {
                    None => (
                        level(app.coherence.ratio, threshold),
                        format!("{} of {} started machines on tip", app.coherence.on_tip, app.coherence.machines),
                    ),
                    Some(s) if s.last_listed_at.is_some() => (
                        "warn",
                        format!(
                            "{} of {} started machines on tip · stale: not listed",
                            app.coherence.on_tip, app.coherence.machines
                        ),
                    ),
                    Some(_) => ("warn", "not listed: machines unknown".to_string()),
                };
                (card(
                    class,
                    app.name.as_str(),
                    app.coherence.ratio,
                    &sub,
                    trend_chart(trend, Some(&app.name), threshold),
                    status_chips(report, &app.name),
                ))
            }
        }
    }
}

/// Counts of an app's machines per status other than on the tip.
fn status_chips(report: &Snapshot, app: &AppName) -> Markup {
    let counts: Vec<(MachineStatus, usize)> = MachineStatus::ALL
        .into_iter()
        .filter(|s| *s != MachineStatus::OnTip)
        .map(|s| (s, report.count(Some(app), s)))
        .filter(|(_, n)| *n > 0)
        .collect();
    html! {
        @if !counts.is_empty() {
            div.chips {
                @for (status, n) in counts {
                    span.chip.n[status != MachineStatus::NotRunning] {
                        (n) " " (status.as_str().replace('_', " "))
                    }
                }
            }
        }
    }
}

/// Most urgent first: critical → low, then machines that could not be
/// classified (unreachable, bad report); then the furthest behind.
fn urgency(m: &JudgedMachine) -> (Reverse<u8>, Reverse<u64>) {
    let rank = match (m.severity(), m.seen.status) {
        (Some(Severity::Critical), _) => 6,
        (Some(Severity::High), _) => 5,
        (Some(Severity::Medium), _) => 4,
        (Some(Severity::Low), _) => 3,
        (None, MachineStatus::Unreachable) => 2,
        (None, _) => 1,
    };
    (Reverse(rank), Reverse(m.seen.commits_behind.unwrap_or(0)))
}

fn attention(report: &Snapshot, observed: &Observed, now: DateTime<Utc>) -> Markup {
    let mut rows: Vec<&JudgedMachine> = report
        .machines
        .iter()
        .filter(|m| {
            !matches!(
                m.seen.status,
                MachineStatus::OnTip | MachineStatus::NotRunning
            )
        })
        .collect();
    if rows.is_empty() {
        let started = report.coherence.machines;
        return html! {
            h2 { "Machines needing attention" }
            div.allgood {
                "✓ All coherent: every started machine (" (started) ") runs the release tip."
            }
        };
    }
    rows.sort_by(|a, b| {
        urgency(a)
            .cmp(&urgency(b))
            .then_with(|| a.seen.app.cmp(&b.seen.app))
            .then_with(|| a.seen.name.cmp(&b.seen.name))
    });
    html! {
        h2 { "Machines needing attention (" (rows.len()) ")" }
        table {
            thead {
                tr {
                    th { "Severity" } th { "Machine" } th { "App · pool" } th { "Status" } th { "Ref" }
                    th { "Behind" } th { "Drifting for" } th { "Action" } th { "Rotation" } th { "Detail" }
                }
            }
            tbody {
                @for m in rows.iter().take(MAX_ROWS) {
                    (row(m, observed, now))
                }
            }
        }
        @if rows.len() > MAX_ROWS {
            p.meta {
                "… and " (rows.len() - MAX_ROWS) " more; see "
                a href="/api/v1/fleet" { "/api/v1/fleet" } "."
            }
        }
    }
}

/// Which pool a guardrail (or a halted release) holds from new claims, and
/// until when: one row per held pool, by its machines' decisions in the
/// last sweep; nothing when none is held.
fn guardrails(report: &Snapshot, observed: &Observed, now: DateTime<Utc>) -> Markup {
    let holds = pool_holds(report.machines.iter().map(|m| {
        let d = observed
            .extras
            .get(&m.seen.machine_id)
            .and_then(|e| e.decision.as_ref());
        (&m.seen.app, &m.seen.pool, d)
    }));
    if holds.is_empty() {
        return html! {};
    }
    html! {
        h2 { "Guardrails holding pools (" (holds.len()) ")" }
        table {
            thead {
                tr {
                    th { "App · pool" } th { "Guardrail" } th { "Machines held" } th { "Until" } th { "Held by" }
                }
            }
            tbody {
                @for h in &holds {
                    tr {
                        td { (h.app) " · " (h.pool) }
                        td { span.tag { (h.reason) } }
                        td.num { (h.machines) }
                        td.detail {
                            (h.lifts)
                            @if let Some(t) = h.until { " (" (until(t, now)) ")" }
                        }
                        td.detail { (h.held_by) }
                    }
                }
            }
        }
    }
}

/// A time to come: `2026-12-07 02:00:00 UTC, in 3h 20m` (whole minutes
/// past the first).
fn until(t: DateTime<Utc>, now: DateTime<Utc>) -> Markup {
    let left = (t - now).to_std().unwrap_or_default();
    let left = if left >= Duration::from_secs(60) {
        Duration::from_secs(left.as_secs() / 60 * 60)
    } else {
        Duration::from_secs(left.as_secs())
    };
    html! { (t.format("%Y-%m-%d %H:%M:%S UTC")) ", in " (humantime::format_duration(left)) }
}

fn dash() -> Markup {
    html! { "–" }
}

fn severity_badge(severity: Option<Severity>) -> Markup {
    html! {
        @match severity {
            Some(s) => span class={ "sev " (s) } { (s) },
            None => span.sev.probe title="no usable report: the overlay it runs is not known" { "unverified" },
        }
    }
}

/// How far behind (and ahead) the report says the machine is.
fn behind_ahead(m: &ObservedMachine) -> Markup {
    html! {
        @match (m.commits_behind, m.commits_ahead) {
            (Some(b), Some(a)) if a > 0 => { (b) div.id { "+" (a) " ahead" } }
            (Some(b), _) => (b),
            (None, _) => (dash()),
        }
    }
}

/// "Drift since", as both pages show it: the age, the instant in its title.
fn drift_since(observed: &Observed, machine_id: &MachineId, now: DateTime<Utc>) -> Markup {
    match observed.drift_since(machine_id) {
        Some(t) => html! {
            span title={ "since " (t.format("%Y-%m-%d %H:%M:%S UTC")) } { (age(now, t)) }
        },
        None => dash(),
    }
}

/// The planner's decision for the machine in the last sweep, as a tag (its
/// short label; the full sentence in the title); nothing for a machine on
/// the tip or without one.
fn decision(observed: &Observed, machine_id: &MachineId) -> Option<Markup> {
    let d = observed.extras.get(machine_id)?.decision.as_ref()?;
    (*d != Decision::OnTip).then(|| html! { span.tag title=(d) { (d.label()) } })
}

/// The decision as the machine page shows it: the tag and the sentence.
fn decision_detail(observed: &Observed, machine_id: &MachineId) -> Markup {
    match observed
        .extras
        .get(machine_id)
        .and_then(|e| e.decision.as_ref())
    {
        Some(d) => html! { span.tag { (d.label()) } " " (d) },
        None => dash(),
    }
}

/// The operator hold and a pending approval, as tags.
fn operator_tags(m: &ObservedMachine) -> Markup {
    html! {
        @if let Some(hold) = &m.inputs.controls.hold {
            @let (label, why) = match hold {
                HoldValue::Ours(h) => (format!("held by {}", h.by), h.reason.clone()),
                HoldValue::Other(v) => ("held".to_string(), v.clone()),
            };
            span.tag.hold title=(why) { (label) } " "
        }
        @if let Some(a) = m.inputs.controls.approval() {
            span.tag.approved title={ "approved by " (a.by) " for " (short(a.target.as_str())) } { "approved" } " "
        }
    }
}

fn row(m: &JudgedMachine, observed: &Observed, now: DateTime<Utc>) -> Markup {
    let decided = decision(observed, &m.seen.machine_id);
    let tagged = m.seen.inputs.controls.is_held() || m.seen.inputs.controls.approval().is_some();
    html! {
        tr {
            td { (severity_badge(m.severity())) }
            td {
                (machine_link(&m.seen))
                div.id { span.mono { (m.seen.machine_id) } " · " (m.seen.region) }
            }
            td { (m.seen.app) div.id { (m.seen.pool) } }
            td { (m.seen.status.as_str().replace('_', " ")) }
            td {
                @match m.seen.reported_ref.as_deref() {
                    Some(r) => code { (short(r)) },
                    None => (dash()),
                }
            }
            td.num { (behind_ahead(&m.seen)) }
            td { (drift_since(observed, &m.seen.machine_id, now)) }
            td {
                @match m.action() {
                    Some(a) => (a),
                    None => (dash()),
                }
            }
            td.rot {
                @if decided.is_none() && !tagged {
                    (dash())
                } @else {
                    @if let Some(d) = decided { (d) " " }
                    (operator_tags(&m.seen))
                }
            }
            td.detail { (m.seen.detail.as_deref().unwrap_or("")) }
        }
    }
}

/// The machine's name, linking to its page when its id is one the page
/// route accepts.
fn machine_link(m: &ObservedMachine) -> Markup {
    html! {
        @if checked_id(m.machine_id.as_str()).is_ok() {
            a.m href={ "/machines/" (m.machine_id) } { (m.name) }
        } @else {
            (m.name)
        }
    }
}

fn footer(observed: &Observed, now: DateTime<Utc>) -> Markup {
    let not_running = observed
        .report
        .as_ref()
        .map(|r| r.count(None, MachineStatus::NotRunning))
        .unwrap_or(0);
    html! {
        footer {
            (not_running) " machines not running (not counted) · "
            a href="/api/v1/fleet" { "fleet JSON" } " · "
            a href="/metrics" { "metrics" } " · "
            a href="/readyz" { "readiness" }
            " · rendered " (now.format("%H:%M:%S UTC"))
            " · reloads every " (refresh_seconds(observed.sweep_interval)) "s"
        }
    }
}

// ---- coherence over time -------------------------------------------------------

/// The chart's viewBox: width and height, and the margin above 100% and
/// below 0%.
const CHART_W: f64 = 240.0;
const CHART_H: f64 = 36.0;
const CHART_PAD: f64 = 3.0;

/// The height of a coherence value in the chart (100% at the top).
fn chart_y(coherence: f64) -> f64 {
    CHART_PAD + (1.0 - coherence.clamp(0.0, 1.0)) * (CHART_H - 2.0 * CHART_PAD)
}

/// The points of `series` (one value per sample, oldest first) in the
/// chart's viewBox: samples spread over the width, oldest at the left, a
/// lone sample at the right edge; a missing value splits the line.
fn chart_segments(series: &[Option<f64>]) -> Vec<Vec<(f64, f64)>> {
    let n = series.len();
    let x = |i: usize| {
        if n <= 1 {
            CHART_W
        } else {
            i as f64 * CHART_W / (n - 1) as f64
        }
    };
    let mut segments: Vec<Vec<(f64, f64)>> = Vec::new();
    let mut current = Vec::new();
    for (i, value) in series.iter().enumerate() {
        match value {
            Some(c) => current.push((x(i), chart_y(*c))),
            None if !current.is_empty() => segments.push(std::mem::take(&mut current)),
            None => {}
        }
    }
    if !current.is_empty() {
        segments.push(current);
    }
    segments
}

fn svg_points(segment: &[(f64, f64)]) -> String {
    let mut points: Vec<String> = segment
        .iter()
        .map(|(x, y)| format!("{x:.1},{y:.1}"))
        .collect();
    if let [only] = segment {
        // A lone point: a zero-length line, drawn as a dot by its round cap.
        points.push(format!("{:.1},{:.1}", only.0, only.1));
    }
    points.join(" ")
}

fn sweeps(n: usize) -> String {
    if n == 1 {
        "sweep".to_string()
    } else {
        format!("{n} sweeps")
    }
}

/// What the chart shows, in words: its accessible name and tooltip.
fn trend_label(trend: &CoherenceTrend, app: Option<&AppName>) -> String {
    let what = match app {
        Some(name) => format!("Coherence of {name}"),
        None => "Fleet coherence".to_string(),
    };
    let (Some(first), Some(latest)) = (trend.first(), trend.latest()) else {
        return format!("{what}: no sweep recorded yet");
    };
    let values: Vec<f64> = trend.series(app).into_iter().flatten().collect();
    let lowest = values.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let now = match app {
        None => percent(latest.fleet.ratio),
        Some(name) => match latest.apps.get(name) {
            Some(p) => format!(
                "{} ({} of {} on tip)",
                percent(p.ratio),
                p.on_tip,
                p.machines
            ),
            None => "not in the latest sweep".to_string(),
        },
    };
    let range = if values.is_empty() {
        String::new()
    } else {
        format!(", lowest {}, highest {}", percent(lowest), percent(highest))
    };
    format!(
        "{what} over the last {} ({} – {}): latest {now}{range}",
        sweeps(trend.len()),
        first.at.format("%H:%M:%S"),
        latest.at.format("%H:%M:%S UTC"),
    )
}

/// Coherence over the ring's sweeps as an inline SVG line (the fleet's, or
/// `app`'s), with the alert threshold dashed; its text alternative is its
/// `title` and `aria-label`, and a caption repeats the range.
fn trend_chart(trend: &CoherenceTrend, app: Option<&AppName>, threshold: f64) -> Markup {
    let label = trend_label(trend, app);
    let series = trend.series(app);
    let values: Vec<f64> = series.iter().copied().flatten().collect();
    let lowest = values.iter().copied().fold(f64::INFINITY, f64::min);
    let y = format!("{:.1}", chart_y(threshold));
    html! {
        svg.spark viewBox={ "0 0 " (CHART_W) " " (CHART_H) } preserveAspectRatio="none"
            role="img" aria-label=(label) {
            title { (label) }
            line x1="0" x2=(CHART_W) y1=(y) y2=(y) vector-effect="non-scaling-stroke" {}
            @for segment in chart_segments(&series) {
                polyline points=(svg_points(&segment)) vector-effect="non-scaling-stroke" {}
            }
        }
        div.trend {
            @if values.is_empty() {
                "trend: no sweep recorded yet"
            } @else {
                "trend: " (sweeps(trend.len())) " · lowest " (percent(lowest))
            }
        }
    }
}

// ---- the machine page ---------------------------------------------------------

/// A short page saying `message` (an unknown machine, no sweep yet).
pub(crate) fn render_message_page(title: &str, message: &str) -> String {
    let body = html! {
        header { h1 { "fleet-reconciler" } div.meta { a href="/" { "← fleet status" } } }
        div.banner.warn { (message) }
    };
    document(&format!("{title} · fleet-reconciler"), None, body)
}

/// The page of machine `id` as of the last sweep; `None` when there is no
/// sweep yet or the machine is not in it.
pub fn render_machine_page(
    observed: &Observed,
    id: &MachineId,
    now: DateTime<Utc>,
) -> Option<String> {
    let report = observed.report.as_ref()?;
    let m = report.machines.iter().find(|m| &m.seen.machine_id == id)?;
    let stale = report
        .apps
        .iter()
        .find(|a| a.name == m.seen.app)
        .and_then(|a| a.stale.as_ref());
    let body = html! {
        header {
            h1 { (m.seen.name) }
            div.meta {
                a href="/" { "← fleet" } " · "
                span.mono { (m.seen.machine_id) } " · app " b { (m.seen.app) } " · pool " b { (m.seen.pool) }
                " · " (m.seen.region)
                @if let Some(at) = observed.last_success {
                    " · swept " b { (age(now, at)) " ago" }
                }
                " · release tip " code title=(report.tip.commit) { (short(report.tip.commit.as_str())) }
            }
        }
        (banners(observed, now))
        @if let Some(s) = stale {
            div.banner.warn {
                "App " b { (m.seen.app) } " could not be listed in the last sweep: " (s.error)
                ". This is the machine as last listed; nothing is done to it until the app lists again."
            }
        }
        div.grid {
            (report_section(m))
            (rotation_section(&m.seen, observed, now))
            (reason_section(m))
            (agent_section(&m.seen, now))
            (commands_section(m))
        }
        footer {
            a href={ "/api/v1/machines/" (m.seen.machine_id) } { "this machine as JSON" } " · "
            a href="/" { "fleet status" }
            " · rendered " (now.format("%H:%M:%S UTC"))
            " · reloads every " (refresh_seconds(observed.sweep_interval)) "s"
        }
    };
    let title = format!("{} · {} · fleet-reconciler", m.seen.name, m.seen.app);
    Some(document(
        &title,
        Some(refresh_seconds(observed.sweep_interval)),
        body,
    ))
}

fn code_or_dash(value: Option<&str>) -> Markup {
    html! {
        @match value {
            Some(v) => code { (v) },
            None => (dash()),
        }
    }
}

fn instant(t: DateTime<Utc>, now: DateTime<Utc>) -> Markup {
    html! { (t.format("%Y-%m-%d %H:%M:%S UTC")) " (" (age(now, t)) " ago)" }
}

/// The machine's row of the sweep, every field.
fn report_section(m: &JudgedMachine) -> Markup {
    html! {
        section.box #report {
            h2 { "Report" }
            dl.kv {
                dt { "App" } dd { (m.seen.app) }
                dt { "Name" } dd { (m.seen.name) }
                dt { "Machine" } dd { span.mono { (m.seen.machine_id) } }
                dt { "Region" } dd { (m.seen.region) }
                dt { "Pool" } dd { (m.seen.pool) }
                dt { "State" } dd { (m.seen.state) }
                dt { "Status" } dd { (m.seen.status.as_str().replace('_', " ")) }
                dt { "Ref" } dd { (code_or_dash(m.seen.reported_ref.as_deref())) }
                dt { "Commit" } dd { (code_or_dash(m.seen.commit.as_ref().map(CommitId::as_str))) }
                dt { "Behind / ahead" } dd {
                    @match (m.seen.commits_behind, m.seen.commits_ahead) {
                        (None, None) => (dash()),
                        (b, a) => {
                            (b.map_or("–".to_string(), |b| b.to_string())) " behind · "
                            (a.map_or("–".to_string(), |a| a.to_string())) " ahead"
                        }
                    }
                }
                dt { "Severity" } dd {
                    // "unverified" only where a report was wanted and not usable.
                    @if m.severity().is_none() && matches!(m.seen.status, MachineStatus::OnTip | MachineStatus::NotRunning) {
                        (dash())
                    } @else {
                        (severity_badge(m.severity()))
                    }
                }
                dt { "Action" } dd {
                    @match m.action() {
                        Some(a) => (a),
                        None => (dash()),
                    }
                }
                dt { "Detail" } dd { (m.seen.detail.as_deref().unwrap_or("–")) }
            }
        }
    }
}

/// The rotation: the decision, hold, approval, marker and history.
fn rotation_section(m: &ObservedMachine, observed: &Observed, now: DateTime<Utc>) -> Markup {
    let extra = observed.extras.get(&m.machine_id);
    let marker = control(m, MARKER_KEY, m.inputs.controls.marker())
        .and_then(|c| c.to_json().ok())
        .and_then(|v| serde_json::to_string_pretty(&v).ok());
    let history = extra.map(|e| e.history_lines(m)).unwrap_or_default();
    html! {
        section.box #rotation {
            h2 { "Rotation" }
            dl.kv {
                dt { "Decision" } dd { (decision_detail(observed, &m.machine_id)) }
                dt { "Drifting for" } dd { (drift_since(observed, &m.machine_id, now)) }
                dt { "Hold" } dd {
                    @match &m.inputs.controls.hold {
                        None => "none",
                        Some(HoldValue::Ours(h)) => { span.tag.hold { "held by " (h.by) } " " (h.reason) " · since " (instant(h.at, now)) }
                        Some(HoldValue::Other(v)) => { span.tag.hold { "held" } " " code { (v) } }
                    }
                }
                dt { "Approval" } dd {
                    @match &m.inputs.controls.approval {
                        None => "none",
                        Some(parsed) => @match parsed {
                            Ok(a) => {
                                span.tag.approved { "approved" } " by " (a.by) " for "
                                code title=(a.target) { (short(a.target.as_str())) }
                                @match a.mode {
                                    ApprovalMode::Now => " (now)",
                                    ApprovalMode::WhenIdle => " (when idle)",
                                }
                                " · " (instant(a.at, now))
                            }
                            Err(why) => { "unreadable (" (why) "): " code { (m.inputs.metadata.get(APPROVE_KEY).map(String::as_str).unwrap_or_default()) } }
                        },
                    }
                }
            }
            @if !m.inputs.controls.tampered.is_empty() {
                h3 { "Not sealed by this fleet (metadata_tampered)" }
                ul {
                    @for t in &m.inputs.controls.tampered {
                        li { code { (t.key) } ": " (t.found.to_string()) }
                    }
                }
            }
            h3 { "Marker" }
            @match marker {
                Some(text) => pre { (text) },
                None => p.meta { "No rotation marker." },
            }
            h3 { "History" }
            @if history.is_empty() {
                p.meta { "No rotation steps recorded." }
            } @else {
                ol.history { @for line in history { li { (line) } } }
            }
        }
    }
}

/// Why the machine has its severity, as the sweep explained it: the
/// matched rule, its evidence, the newest missing commits. Nothing for a
/// machine without drift.
fn reason_section(m: &JudgedMachine) -> Markup {
    let Some(reason) = m.reason().map(|r| &**r) else {
        return html! {};
    };
    html! {
        section.box #reason {
            h2 { "Why " (severity_badge(m.severity())) }
            dl.kv {
                dt { "Rule" } dd { (reason.rule) }
                @for e in &reason.evidence {
                    dt { "Evidence" } dd { (e) }
                }
            }
            @if reason.evidence_partial {
                p.meta { "Path rules are not yet checked on every missing commit (overlay.max_path_comparisons): a path rule may still match." }
            }
            @if let Some(behind) = reason.behind {
                h3 { "Missing commits (" (behind) ", newest " (reason.missing.len()) " shown)" }
                ol.history {
                    @for c in &reason.missing {
                        li { code title=(c.commit) { (short(c.commit.as_str())) } " " (c.subject) }
                    }
                }
            }
        }
    }
}

fn activity(a: Option<Activity>) -> &'static str {
    match a {
        Some(Activity::Idle) => "idle",
        Some(Activity::Busy) => "busy",
        None => "not reported",
    }
}

/// The agent's last parsed health report.
fn agent_section(m: &ObservedMachine, now: DateTime<Utc>) -> Markup {
    html! {
        section.box #agent {
            h2 { "Agent report" }
            @match &m.inputs.report {
                None => p.meta {
                    "No usable report (" (m.status.as_str().replace('_', " ")) ")"
                    @if let Some(d) = &m.detail { ": " (d) }
                    "."
                },
                Some(r) => (agent_report(r, now)),
            }
        }
    }
}

fn agent_report(r: &AgentReport, now: DateTime<Utc>) -> Markup {
    html! {
        dl.kv {
            dt { "Overlay ref" } dd { code { (r.overlay_ref) } }
            dt { "Activity" } dd { (activity(r.activity)) }
            dt { "Live sessions" } dd {
                @match r.live_sessions {
                    Some(n) => (n),
                    None => "not reported",
                }
            }
            dt { "Last input" } dd {
                @match r.last_input_at {
                    Some(t) => (instant(t, now)),
                    None => "not reported",
                }
            }
            dt { "Heartbeat" } dd {
                @match r.heartbeat_at {
                    Some(t) => (instant(t, now)),
                    None => "not reported",
                }
            }
            dt { "Capabilities" } dd {
                @if r.capabilities.is_empty() {
                    "none"
                } @else {
                    @for (i, c) in r.capabilities.iter().enumerate() {
                        @if i > 0 { ", " }
                        (serde_json::to_value(c).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default())
                    }
                }
            }
            dt { "Rotation" } dd {
                @match &r.rotation {
                    None => "not reported",
                    Some(rot) => {
                        (if rot.fenced { "fenced" } else { "not fenced" })
                        @if let Some(c) = &rot.checkpoint { " · checkpoint " code { (c) } }
                    }
                }
            }
        }
    }
}

/// The operator commands that apply to `m` now, each with why: approve
/// when its drift waits for one (the sweep's action is `manual`), release
/// when held, else hold; and the fleet's table.
pub(crate) fn operator_commands(m: &JudgedMachine) -> Vec<(&'static str, String)> {
    let id = &m.seen.machine_id;
    let mut out = Vec::new();
    if m.action() == Some(PolicyAction::Manual) {
        out.push((
            "Approve the rotation to the release tip, for the first moment it has no live work:",
            format!("fleet-reconciler approve {id}"),
        ));
        out.push((
            "Or now, ending its live work (it names what it would end and asks first):",
            format!("fleet-reconciler approve {id} --now"),
        ));
    }
    if m.seen.inputs.controls.is_held() {
        out.push((
            "Release the hold (reconcilers may act on it again):",
            format!("fleet-reconciler release {id}"),
        ));
    } else {
        out.push((
            "Hold it (no reconciler acts on it until released):",
            format!("fleet-reconciler hold {id} --reason \"…\""),
        ));
    }
    out.push((
        "This machine as the daemon sees it (decision, reason, marker):",
        format!("fleet-reconciler status {id}"),
    ));
    out.push((
        "What a daemon would do now, for the whole fleet (writes nothing):",
        "fleet-reconciler plan".to_string(),
    ));
    out
}

fn commands_section(m: &JudgedMachine) -> Markup {
    html! {
        section.box.cmd #actions {
            h2 { "Operator actions" }
            @for (why, command) in operator_commands(m) {
                p { (why) }
                pre { code { (command) } }
            }
            p { "Run them where the daemon's config is (add " code { "--config PATH" } " otherwise); this page never acts." }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::decide::coherence::{Coherence, CoherenceSample};

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap_or_default()
    }

    fn ring(points: &[(f64, Option<f64>)]) -> CoherenceTrend {
        let mut ring = CoherenceTrend::default();
        for (i, (fleet, app)) in points.iter().enumerate() {
            let apps = app
                .map(|c| {
                    let point = Coherence {
                        ratio: c,
                        on_tip: (c * 4.0) as usize,
                        machines: 4,
                    };
                    (AppName::from("<b>app</b>"), point)
                })
                .into_iter()
                .collect();
            ring.push(CoherenceSample {
                at: t(30 * i as i64),
                fleet: Coherence {
                    ratio: *fleet,
                    on_tip: 0,
                    machines: 0,
                },
                apps,
            });
        }
        ring
    }

    #[test]
    fn chart_values_map_to_coordinates() {
        // 100% at the top (the margin), 0% at the bottom, oldest at the left.
        assert_eq!(
            chart_segments(&[Some(1.0), Some(0.0), Some(0.5)]),
            [vec![(0.0, 3.0), (120.0, 33.0), (240.0, 18.0)]]
        );
        // Out-of-range values stay inside the chart.
        assert_eq!(
            chart_segments(&[Some(1.5), Some(-1.0)]),
            [vec![(0.0, 3.0), (240.0, 33.0)]]
        );
        // A gap splits the line; a lone sample sits at the right edge.
        assert_eq!(
            chart_segments(&[Some(1.0), None, None, Some(0.5), Some(0.5)]),
            [vec![(0.0, 3.0)], vec![(180.0, 18.0), (240.0, 18.0)]]
        );
        assert_eq!(chart_segments(&[Some(0.0)]), [vec![(240.0, 33.0)]]);
        assert!(chart_segments(&[]).is_empty());
        assert!(chart_segments(&[None, None]).is_empty());
        assert_eq!(svg_points(&[(240.0, 33.0)]), "240.0,33.0 240.0,33.0");
        assert_eq!(
            svg_points(&[(0.0, 3.0), (120.0, 18.0)]),
            "0.0,3.0 120.0,18.0"
        );
    }

    #[test]
    fn an_empty_ring_draws_an_empty_chart_that_says_so() {
        let svg = trend_chart(&CoherenceTrend::default(), None, 1.0).into_string();
        assert!(svg.starts_with("<svg class=\"spark\""), "{svg}");
        assert!(
            svg.contains("aria-label=\"Fleet coherence: no sweep recorded yet\""),
            "{svg}"
        );
        assert!(svg.contains("<title>Fleet coherence: no sweep recorded yet</title>"));
        assert!(!svg.contains("<polyline"), "{svg}");
        assert!(svg.contains("no sweep recorded yet</div>"), "{svg}");
    }

    #[test]
    fn the_chart_draws_the_ring_and_names_its_figures() {
        let ring = ring(&[(1.0, Some(1.0)), (0.5, None), (0.75, Some(0.5))]);
        let fleet = trend_chart(&ring, None, 0.9).into_string();
        assert!(
            fleet.contains("<polyline points=\"0.0,3.0 120.0,18.0 240.0,10.5\""),
            "{fleet}"
        );
        assert!(
            fleet.contains(
                "Fleet coherence over the last 3 sweeps (08:00:00 – 08:01:00 UTC): \
                 latest 75%, lowest 50%, highest 100%"
            ),
            "{fleet}"
        );
        // The threshold, dashed: 90% is 3 px below the top margin.
        assert!(fleet.contains("y1=\"6.0\" y2=\"6.0\""), "{fleet}");
        // The app is missing from the middle sweep: two pieces; its name is
        // escaped in the label.
        let app = trend_chart(&ring, Some(&AppName::from("<b>app</b>")), 0.9).into_string();
        assert_eq!(app.matches("<polyline").count(), 2, "{app}");
        assert!(app.contains("points=\"0.0,3.0 0.0,3.0\""), "{app}");
        assert!(app.contains("points=\"240.0,18.0 240.0,18.0\""), "{app}");
        assert!(
            app.contains("Coherence of &lt;b&gt;app&lt;/b&gt; over the last 3 sweeps"),
            "{app}"
        );
        assert!(app.contains("latest 50% (2 of 4 on tip)"), "{app}");
        assert!(!app.contains("<b>"), "{app}");
        let one = trend_chart(&ring_of_one(), None, 1.0).into_string();
        assert!(one.contains("over the last sweep ("), "{one}");
    }

    fn ring_of_one() -> CoherenceTrend {
        ring(&[(1.0, None)])
    }

    #[test]
    fn colours_follow_the_threshold() {
        assert_eq!(level(1.0, 1.0), "ok");
        assert_eq!(level(0.8, 1.0), "warn");
        assert_eq!(level(0.4, 1.0), "bad");
        assert_eq!(level(0.95, 0.9), "ok");
    }

    #[test]
    fn percentages_drop_needless_decimals() {
        assert_eq!(percent(1.0), "100%");
        assert_eq!(percent(7.0 / 17.0), "41.2%");
    }
}

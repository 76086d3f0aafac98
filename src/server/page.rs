//! The status page at `GET /`: one server-rendered HTML document.
//!
//! Owns presentation of the last sweep for a person at a laptop: coherence
//! per app at a glance, then the machines that need attention, most severe
//! first. No scripts, no external assets, no build step; it reloads itself
//! once per sweep interval. Built with `maud`: every interpolated string (from
//! an agent, Fly or the config) is HTML-escaped by the template itself, and
//! markup is only ever what the templates here spell out. It must never
//! compute a status, severity or action the sweep did not already decide.

use std::cmp::Reverse;
use std::time::Duration;

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, PreEscaped, html};

use crate::model::{MachineStatus, Severity};
use crate::operator::{APPROVE_KEY, Approval, HOLD_KEY, Hold};
use crate::sweep::{FleetReport, MachineReport};

use super::{Observed, age};

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

fn short(commit: &str) -> &str {
    commit.get(..12).unwrap_or(commit)
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
"#;

/// Renders the page for `observed` as of `now`.
pub fn render_status_page(observed: &Observed, now: DateTime<Utc>) -> String {
    let title = match &observed.report {
        Some(r) => format!("{} coherent · fleet-reconciler", percent(r.coherence)),
        None => "fleet-reconciler".to_string(),
    };
    let body = html! {
        (header(observed, now))
        (banners(observed, now))
        (unlisted_banners(observed, now))
        @match &observed.report {
            None => div.banner.warn { "Waiting for the first sweep; this page reloads by itself." }
            Some(report) => {
                (cards(report, observed.coherence_threshold))
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
                    code title=(r.tip.commit) { (short(&r.tip.commit)) }
                    @if let Some(fetched) = observed.tip.as_deref().filter(|t| *t != r.tip.commit) {
                        " (fetched " code title=(fetched) { (short(fetched)) } ", not swept yet)"
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
    if observed.report.is_some() {
        if let Err(reason) = observed.readiness(now) {
            return html! {
                div.banner.bad { "Stale: " (reason) ". The figures below may no longer be true." }
            };
        }
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

fn card(class: &str, name: &str, coherence: f64, sub: &str, chips: Markup) -> Markup {
    html! {
        div class={ "card " (class) } {
            div.name { (name) }
            div.big { (percent(coherence)) }
            div.bar { i style={ "width:" (format!("{:.1}", (coherence * 100.0).clamp(0.0, 100.0))) "%" } {} }
            div.sub { (sub) }
            (chips)
        }
    }
}

fn cards(report: &FleetReport, threshold: f64) -> Markup {
    let started: usize = report.apps.iter().map(|a| a.machines).sum();
    let on_tip: usize = report.apps.iter().map(|a| a.on_tip).sum();
    html! {
        section.cards {
            (card(
                &format!("fleet {}", level(report.coherence, threshold)),
                "Fleet coherence",
                report.coherence,
                &format!(
                    "{on_tip} of {started} started machines on the release tip · {} apps",
                    report.apps.len()
                ),
                html! {},
            ))
            @for app in &report.apps {
                @let (class, sub) = match &app.stale {
                    None => (
                        level(app.coherence, threshold),
                        format!("{} of {} started machines on tip", app.on_tip, app.machines),
                    ),
                    Some(s) if s.last_listed_at.is_some() => (
                        "warn",
                        format!(
                            "{} of {} started machines on tip · stale: not listed",
                            app.on_tip, app.machines
                        ),
                    ),
                    Some(_) => ("warn", "not listed: machines unknown".to_string()),
                };
                (card(class, &app.name, app.coherence, &sub, status_chips(report, &app.name)))
            }
        }
    }
}

/// Counts of an app's machines per status other than on the tip.
fn status_chips(report: &FleetReport, app: &str) -> Markup {
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
fn urgency(m: &MachineReport) -> (Reverse<u8>, Reverse<u64>) {
    let rank = match (m.severity, m.status) {
        (Some(Severity::Critical), _) => 6,
        (Some(Severity::High), _) => 5,
        (Some(Severity::Medium), _) => 4,
        (Some(Severity::Low), _) => 3,
        (None, MachineStatus::Unreachable) => 2,
        (None, _) => 1,
    };
    (Reverse(rank), Reverse(m.commits_behind.unwrap_or(0)))
}

fn attention(report: &FleetReport, observed: &Observed, now: DateTime<Utc>) -> Markup {
    let mut rows: Vec<&MachineReport> = report
        .machines
        .iter()
        .filter(|m| !matches!(m.status, MachineStatus::OnTip | MachineStatus::NotRunning))
        .collect();
    if rows.is_empty() {
        let started: usize = report.apps.iter().map(|a| a.machines).sum();
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
            .then_with(|| a.app.cmp(&b.app))
            .then_with(|| a.name.cmp(&b.name))
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
fn behind_ahead(m: &MachineReport) -> Markup {
    html! {
        @match (m.commits_behind, m.commits_ahead) {
            (Some(b), Some(a)) if a > 0 => { (b) div.id { "+" (a) " ahead" } }
            (Some(b), _) => (b),
            (None, _) => (dash()),
        }
    }
}

/// "Drift since", as both pages show it: the age, the instant in its title.
fn drift_since(observed: &Observed, machine_id: &str, now: DateTime<Utc>) -> Markup {
    match observed.drift_since(machine_id) {
        Some(t) => html! {
            span title={ "since " (t.format("%Y-%m-%d %H:%M:%S UTC")) } { (age(now, t)) }
        },
        None => dash(),
    }
}

/// The machine's decision for this sweep, as the loop published it (today
/// its rotation phase in words); nothing when there is none.
fn decision(observed: &Observed, machine_id: &str) -> Option<Markup> {
    let phase = observed.extras.get(machine_id)?.phase.as_deref()?;
    Some(html! { span.tag { (phase) } })
}

/// The operator hold and a pending approval, as tags.
fn operator_tags(m: &MachineReport) -> Markup {
    html! {
        @if let Some(v) = m.metadata.get(HOLD_KEY) {
            @let (label, why) = match serde_json::from_str::<Hold>(v) {
                Ok(h) => (format!("held by {}", h.by), h.reason),
                Err(_) => ("held".to_string(), v.clone()),
            };
            span.tag.hold title=(why) { (label) } " "
        }
        @if let Some(a) = m.metadata.get(APPROVE_KEY).and_then(|v| Approval::parse(v)) {
            span.tag.approved title={ "approved by " (a.by) " for " (short(&a.target)) } { "approved" } " "
        }
    }
}

fn row(m: &MachineReport, observed: &Observed, now: DateTime<Utc>) -> Markup {
    let decided = decision(observed, &m.machine_id);
    let tagged = m.metadata.contains_key(HOLD_KEY)
        || m.metadata
            .get(APPROVE_KEY)
            .and_then(|v| Approval::parse(v))
            .is_some();
    html! {
        tr {
            td { (severity_badge(m.severity)) }
            td {
                (m.name)
                div.id { span.mono { (m.machine_id) } " · " (m.region) }
            }
            td { (m.app) div.id { (m.pool) } }
            td { (m.status.as_str().replace('_', " ")) }
            td {
                @match m.reported_ref.as_deref() {
                    Some(r) => code { (short(r)) },
                    None => (dash()),
                }
            }
            td.num { (behind_ahead(m)) }
            td { (drift_since(observed, &m.machine_id, now)) }
            td {
                @match m.action {
                    Some(a) => (a),
                    None => (dash()),
                }
            }
            td.rot {
                @if decided.is_none() && !tagged {
                    (dash())
                } @else {
                    @if let Some(d) = decided { (d) " " }
                    (operator_tags(m))
                }
            }
            td.detail { (m.detail.as_deref().unwrap_or("")) }
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

#[cfg(test)]
mod tests {
    use super::*;

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

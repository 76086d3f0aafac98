//! The status page at `GET /`: one server-rendered HTML document.
//!
//! Owns presentation of the last sweep for a person at a laptop: coherence
//! per app at a glance, then the machines that need attention, most severe
//! first. No scripts, no external assets, no build step; it reloads itself
//! once per sweep interval. Every string that came from an agent, Fly or the
//! config is HTML-escaped here. It must never compute a status, severity or
//! action the sweep did not already decide.

use std::cmp::Reverse;
use std::fmt::Write as _;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::model::{MachineStatus, Severity};
use crate::operator::{APPROVE_KEY, Approval, HOLD_KEY, Hold};
use crate::sweep::{FleetReport, MachineReport};

use super::{Observed, age};

/// Beyond this many rows the page points at the JSON API instead.
const MAX_ROWS: usize = 500;

/// Escapes text for HTML element content and quoted attribute values.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

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
    let mut out = String::with_capacity(16 * 1024);
    let title = match &observed.report {
        Some(r) => format!("{} coherent · fleet-reconciler", percent(r.coherence)),
        None => "fleet-reconciler".to_string(),
    };
    let _ = write!(
        out,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta http-equiv=\"refresh\" content=\"{}\">\
         <title>{}</title><style>{STYLE}</style></head><body><main>\n",
        refresh_seconds(observed.sweep_interval),
        esc(&title),
    );
    header(&mut out, observed, now);
    banners(&mut out, observed, now);
    unlisted_banners(&mut out, observed, now);
    match &observed.report {
        None => {
            out.push_str(
                "<div class=\"banner warn\">Waiting for the first sweep; this page reloads by itself.</div>\n",
            );
        }
        Some(report) => {
            cards(&mut out, report, observed.coherence_threshold);
            attention(&mut out, report, observed, now);
        }
    }
    footer(&mut out, observed, now);
    out.push_str("</main></body></html>\n");
    out
}

fn header(out: &mut String, observed: &Observed, now: DateTime<Utc>) {
    out.push_str("<header><h1>fleet-reconciler</h1><div class=\"meta\">");
    if let Some(r) = &observed.report {
        let _ = write!(
            out,
            "release tip <b>{}</b> @ <code title=\"{}\">{}</code>",
            esc(&r.tip.branch),
            esc(&r.tip.commit),
            esc(short(&r.tip.commit)),
        );
        if let Some(fetched) = observed.tip.as_deref().filter(|t| *t != r.tip.commit) {
            let _ = write!(
                out,
                " (fetched <code title=\"{}\">{}</code>, not swept yet)",
                esc(fetched),
                esc(short(fetched)),
            );
        }
    }
    if let Some(at) = observed.last_success {
        let _ = write!(
            out,
            " · last sweep <b>{} ago</b> ({})",
            age(now, at),
            at.format("%Y-%m-%d %H:%M:%S UTC"),
        );
    }
    let _ = writeln!(
        out,
        " · sweeps every {}</div></header>",
        humantime::format_duration(observed.sweep_interval),
    );
}

fn banners(out: &mut String, observed: &Observed, now: DateTime<Utc>) {
    if observed.report.is_some() {
        if let Err(reason) = observed.readiness(now) {
            let _ = writeln!(
                out,
                "<div class=\"banner bad\">Stale: {}. The figures below may no longer be true.</div>",
                esc(&reason)
            );
            return;
        }
    }
    if let Some(f) = &observed.last_failure {
        if observed.last_success.is_none_or(|s| f.at > s) {
            let _ = writeln!(
                out,
                "<div class=\"banner warn\">Last sweep failed {} ago: {}</div>",
                age(now, f.at),
                esc(&f.error)
            );
        }
    }
}

/// One banner per app the last sweep could not list: the error, and what is
/// shown of it instead.
fn unlisted_banners(out: &mut String, observed: &Observed, now: DateTime<Utc>) {
    let Some(report) = &observed.report else {
        return;
    };
    for (app, stale) in report.stale_apps() {
        let shown = match stale.last_listed_at {
            Some(at) => format!(
                "its machines and figures below are from its last listing, {} ago",
                age(now, at)
            ),
            None => "its machines are unknown and not shown".to_string(),
        };
        let _ = writeln!(
            out,
            "<div class=\"banner warn\">App <b>{}</b> could not be listed: {}. Shown stale: {shown}; \
             nothing is done to its machines until it lists again.</div>",
            esc(app),
            esc(&stale.error),
        );
    }
}

fn card(out: &mut String, class: &str, name: &str, coherence: f64, sub: &str, chips: &str) {
    let _ = writeln!(
        out,
        "<div class=\"card {class}\"><div class=\"name\">{}</div>\
         <div class=\"big\">{}</div>\
         <div class=\"bar\"><i style=\"width:{:.1}%\"></i></div>\
         <div class=\"sub\">{sub}</div>{chips}</div>",
        esc(name),
        percent(coherence),
        (coherence * 100.0).clamp(0.0, 100.0),
    );
}

fn cards(out: &mut String, report: &FleetReport, threshold: f64) {
    out.push_str("<section class=\"cards\">\n");
    let started: usize = report.apps.iter().map(|a| a.machines).sum();
    let on_tip: usize = report.apps.iter().map(|a| a.on_tip).sum();
    card(
        out,
        &format!("fleet {}", level(report.coherence, threshold)),
        "Fleet coherence",
        report.coherence,
        &format!(
            "{on_tip} of {started} started machines on the release tip · {} apps",
            report.apps.len()
        ),
        "",
    );
    for app in &report.apps {
        let mut chips = String::new();
        for status in MachineStatus::ALL {
            if status == MachineStatus::OnTip {
                continue;
            }
            let n = report.count(Some(&app.name), status);
            if n > 0 {
                let class = if status == MachineStatus::NotRunning {
                    "chip"
                } else {
                    "chip n"
                };
                let _ = write!(
                    chips,
                    "<span class=\"{class}\">{n} {}</span>",
                    status.as_str().replace('_', " ")
                );
            }
        }
        if !chips.is_empty() {
            chips = format!("<div class=\"chips\">{chips}</div>");
        }
        let (class, sub) = match &app.stale {
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
        card(out, class, &app.name, app.coherence, &sub, &chips);
    }
    out.push_str("</section>\n");
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

fn attention(out: &mut String, report: &FleetReport, observed: &Observed, now: DateTime<Utc>) {
    let mut rows: Vec<&MachineReport> = report
        .machines
        .iter()
        .filter(|m| !matches!(m.status, MachineStatus::OnTip | MachineStatus::NotRunning))
        .collect();
    if rows.is_empty() {
        let started: usize = report.apps.iter().map(|a| a.machines).sum();
        let _ = writeln!(
            out,
            "<h2>Machines needing attention</h2><div class=\"allgood\">✓ All coherent: \
             every started machine ({started}) runs the release tip.</div>"
        );
        return;
    }
    rows.sort_by(|a, b| {
        urgency(a)
            .cmp(&urgency(b))
            .then_with(|| a.app.cmp(&b.app))
            .then_with(|| a.name.cmp(&b.name))
    });
    let _ = writeln!(
        out,
        "<h2>Machines needing attention ({})</h2>\n<table><thead><tr>\
         <th>Severity</th><th>Machine</th><th>App · pool</th><th>Status</th><th>Ref</th>\
         <th>Behind</th><th>Drifting for</th><th>Action</th><th>Rotation</th><th>Detail</th>\
         </tr></thead><tbody>",
        rows.len()
    );
    for m in rows.iter().take(MAX_ROWS) {
        row(out, m, observed, now);
    }
    out.push_str("</tbody></table>\n");
    if rows.len() > MAX_ROWS {
        let _ = writeln!(
            out,
            "<p class=\"meta\">… and {} more; see <a href=\"/api/v1/fleet\">/api/v1/fleet</a>.</p>",
            rows.len() - MAX_ROWS
        );
    }
}

fn row(out: &mut String, m: &MachineReport, observed: &Observed, now: DateTime<Utc>) {
    let dash = || "–".to_string();
    let severity = match m.severity {
        Some(s) => format!("<span class=\"sev {s}\">{s}</span>"),
        None => "<span class=\"sev probe\" title=\"no usable report: the overlay it runs is not known\">unverified</span>".to_string(),
    };
    let reported = m
        .reported_ref
        .as_deref()
        .map(|r| format!("<code>{}</code>", esc(short(r))))
        .unwrap_or_else(dash);
    let behind = match (m.commits_behind, m.commits_ahead) {
        (Some(b), Some(a)) if a > 0 => format!("{b}<div class=\"id\">+{a} ahead</div>"),
        (Some(b), _) => b.to_string(),
        (None, _) => dash(),
    };
    let since = observed
        .drift_since(&m.machine_id)
        .map(|t| {
            format!(
                "<span title=\"since {}\">{}</span>",
                t.format("%Y-%m-%d %H:%M:%S UTC"),
                age(now, t)
            )
        })
        .unwrap_or_else(dash);
    let action = m.action.map(|a| a.to_string()).unwrap_or_else(dash);

    let mut rotation = String::new();
    if let Some(phase) = observed
        .extras
        .get(&m.machine_id)
        .and_then(|e| e.decision.as_ref())
    {
        let _ = write!(
            rotation,
            "<span class=\"tag\">{}</span> ",
            esc(&phase.label())
        );
    }
    if let Some(v) = m.metadata.get(HOLD_KEY) {
        let (label, why) = match serde_json::from_str::<Hold>(v) {
            Ok(h) => (format!("held by {}", h.by), h.reason),
            Err(_) => ("held".to_string(), v.clone()),
        };
        let _ = write!(
            rotation,
            "<span class=\"tag hold\" title=\"{}\">{}</span> ",
            esc(&why),
            esc(&label),
        );
    }
    if let Some(a) = m.metadata.get(APPROVE_KEY).and_then(|v| Approval::parse(v)) {
        let _ = write!(
            rotation,
            "<span class=\"tag approved\" title=\"approved by {} for {}\">approved</span> ",
            esc(&a.by),
            esc(short(&a.target)),
        );
    }
    if rotation.is_empty() {
        rotation = dash();
    }
    let status = m.status.as_str().replace('_', " ");
    let _ = writeln!(
        out,
        "<tr><td>{severity}</td><td>{}<div class=\"id\"><span class=\"mono\">{}</span> · {}</div></td>\
         <td>{}<div class=\"id\">{}</div></td><td>{status}</td><td>{reported}</td><td class=\"num\">{behind}</td>\
         <td>{since}</td><td>{action}</td><td class=\"rot\">{rotation}</td><td class=\"detail\">{}</td></tr>",
        esc(&m.name),
        esc(&m.machine_id),
        esc(&m.region),
        esc(&m.app),
        esc(&m.pool),
        esc(m.detail.as_deref().unwrap_or("")),
    );
}

fn footer(out: &mut String, observed: &Observed, now: DateTime<Utc>) {
    let not_running = observed
        .report
        .as_ref()
        .map(|r| r.count(None, MachineStatus::NotRunning))
        .unwrap_or(0);
    let _ = writeln!(
        out,
        "<footer>{not_running} machines not running (not counted) · \
         <a href=\"/api/v1/fleet\">fleet JSON</a> · <a href=\"/metrics\">metrics</a> · \
         <a href=\"/readyz\">readiness</a> · rendered {} · reloads every {}s</footer>",
        now.format("%H:%M:%S UTC"),
        refresh_seconds(observed.sweep_interval),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(
            esc("<script>alert('x') & \"y\"</script>"),
            "&lt;script&gt;alert(&#39;x&#39;) &amp; &quot;y&quot;&lt;/script&gt;"
        );
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

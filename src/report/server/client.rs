//! The typed client of `GET /api/v1/fleet` and `GET /api/v1/machines/{id}`,
//! for the `status` command.
//!
//! Owns reading a running daemon's last sweep back into the
//! [`FleetDocument`] it wrote, so `status` prints exactly the table `check`
//! prints (`render::to_table`),
//! and one machine's detail into a [`MachineView`] (`status MACHINE`). It
//! must never follow a redirect, send credentials, read an answer past its
//! bound ([`MAX_FLEET_BODY_BYTES`], [`MAX_MACHINE_BODY_BYTES`]), or put the
//! URL of the daemon into an error's text twice over (reqwest errors print
//! URLs).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;

use crate::decide::decision::Decision;
use crate::model::short_commit as short;
use crate::observe::sweep::StaleApp;
use crate::report::wire::{FleetDocument, MachineRow};

/// The largest fleet document read: a 10,000-machine fleet with reasons is
/// tens of MiB of pretty JSON.
pub const MAX_FLEET_BODY_BYTES: usize = 256 << 20;
/// The largest machine detail read (a row, a report, a marker, a history).
pub const MAX_MACHINE_BODY_BYTES: usize = 4 << 20;

/// Parses a `check --output json` / `GET /api/v1/fleet` document.
pub fn parse_fleet(json: &str) -> Result<FleetDocument<'static>, serde_json::Error> {
    serde_json::from_str(json)
}

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("invalid daemon URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("cannot reach the daemon: {0}")]
    Transport(String),
    #[error("the daemon has no sweep to show yet: {0}")]
    NotReady(String),
    #[error("the daemon answered {status}: {message}")]
    Status { status: u16, message: String },
    #[error("the daemon's answer is not a fleet report: {0}")]
    Decode(String),
    #[error("machine {machine_id} is not known to the daemon: {message}")]
    UnknownMachine { machine_id: String, message: String },
    #[error("the daemon's answer is not a machine detail: {0}")]
    DecodeMachine(String),
    #[error("the daemon's answer is larger than {limit} bytes; not read further")]
    TooLarge { limit: usize },
}

/// Which [`StatusError`] this is, without its data; its snake-case name is
/// the `kind` the CLI's error object carries (`daemon_<kind>`). The two
/// answers that do not decode share one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum StatusErrorKind {
    InvalidUrl,
    Transport,
    NotReady,
    Status,
    Decode,
    UnknownMachine,
    TooLarge,
}

impl StatusError {
    pub fn error_kind(&self) -> StatusErrorKind {
        match self {
            StatusError::InvalidUrl { .. } => StatusErrorKind::InvalidUrl,
            StatusError::Transport(_) => StatusErrorKind::Transport,
            StatusError::NotReady(_) => StatusErrorKind::NotReady,
            StatusError::Status { .. } => StatusErrorKind::Status,
            StatusError::Decode(_) | StatusError::DecodeMachine(_) => StatusErrorKind::Decode,
            StatusError::UnknownMachine { .. } => StatusErrorKind::UnknownMachine,
            StatusError::TooLarge { .. } => StatusErrorKind::TooLarge,
        }
    }

    /// A bounded label: the kind's snake-case name.
    pub fn kind(&self) -> &'static str {
        self.error_kind().into()
    }
}

/// `GET /api/v1/machines/{id}`, as `status MACHINE` reads it. Fields the
/// client only shows (the agent's report, hold, approval, marker) stay JSON.
#[derive(Clone, Debug, Deserialize)]
pub struct MachineView {
    /// The machine's row of the fleet report, `reason` included.
    pub machine: MachineRow,
    #[serde(default)]
    pub agent_report: Option<serde_json::Value>,
    #[serde(default)]
    pub hold: Option<serde_json::Value>,
    #[serde(default)]
    pub approval: Option<serde_json::Value>,
    #[serde(default)]
    pub rotation: Option<serde_json::Value>,
    /// The planner's decision in the daemon's last sweep.
    #[serde(default)]
    pub decision: Option<Decision>,
    #[serde(default)]
    pub history: Vec<String>,
    #[serde(default)]
    pub drift_since: Option<DateTime<Utc>>,
    pub tip: String,
    #[serde(default)]
    pub swept_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub app_stale: Option<StaleApp>,
}

/// Reads the last sweep, with the daemon's decisions of it, from a running
/// daemon at `base_url` (e.g. `http://127.0.0.1:9090`), the whole exchange
/// bounded by `timeout`.
pub async fn fetch_fleet(
    base_url: &str,
    timeout: Duration,
) -> Result<FleetDocument<'static>, StatusError> {
    let url = api_url(base_url, &["fleet"])?;
    let text = get_text(url, timeout, MAX_FLEET_BODY_BYTES).await?;
    serde_json::from_str(&text).map_err(|e| StatusError::Decode(e.to_string()))
}

/// Reads one machine's detail from a running daemon: the typed view and
/// the document as the daemon sent it (for `--output json`). A machine the
/// daemon does not know is [`StatusError::UnknownMachine`], naming it.
pub async fn fetch_machine(
    base_url: &str,
    machine_id: &str,
    timeout: Duration,
) -> Result<(MachineView, serde_json::Value), StatusError> {
    let url = api_url(base_url, &["machines", machine_id])?;
    let text = match get_text(url, timeout, MAX_MACHINE_BODY_BYTES).await {
        Err(StatusError::Status { status, message }) if status == 404 || status == 400 => {
            return Err(StatusError::UnknownMachine {
                machine_id: machine_id.to_string(),
                message,
            });
        }
        other => other?,
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| StatusError::DecodeMachine(e.to_string()))?;
    let view =
        MachineView::deserialize(&value).map_err(|e| StatusError::DecodeMachine(e.to_string()))?;
    Ok((view, value))
}

/// `base_url` + `api/v1/` + `segments`, each segment percent-encoded.
fn api_url(base_url: &str, segments: &[&str]) -> Result<url::Url, StatusError> {
    let invalid = |reason: String| StatusError::InvalidUrl {
        url: base_url.to_string(),
        reason,
    };
    let mut url = url::Url::parse(base_url).map_err(|e| invalid(e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid("the scheme must be http or https".into()));
    }
    {
        let mut path = url
            .path_segments_mut()
            .map_err(|()| invalid("the URL cannot have a path".into()))?;
        path.pop_if_empty().extend(["api", "v1"]).extend(segments);
    }
    Ok(url)
}

/// One GET, the body read up to `limit` bytes; a non-2xx answer is an error
/// carrying the daemon's `error` text (bounded).
async fn get_text(url: url::Url, timeout: Duration, limit: usize) -> Result<String, StatusError> {
    let http = crate::http::client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .build()
        .map_err(|e| StatusError::Transport(crate::http::describe(&e)))?;
    let mut resp = http
        .get(url)
        .header(reqwest::header::ACCEPT, "application/json")
        .send()
        .await
        .map_err(|e| StatusError::Transport(crate::http::describe(&e)))?;
    let status = resp.status();
    let mut body: Vec<u8> = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| StatusError::Transport(crate::http::describe(&e)))?
    {
        if body.len() + chunk.len() > limit {
            return Err(StatusError::TooLarge { limit });
        }
        body.extend_from_slice(&chunk);
    }
    let text = String::from_utf8_lossy(&body).into_owned();
    if !status.is_success() {
        #[derive(Deserialize)]
        struct ErrorBody {
            error: String,
        }
        let message = serde_json::from_str::<ErrorBody>(&text)
            .map(|b| b.error)
            .unwrap_or_else(|_| text.clone());
        let message: String = message.chars().take(200).collect();
        return Err(if status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            StatusError::NotReady(message)
        } else {
            StatusError::Status {
                status: status.as_u16(),
                message,
            }
        });
    }
    Ok(text)
}

impl MachineView {
    /// The detail for people: one `key: value` line each, then the reason
    /// (rule, evidence, missing commits), then the rotation's state. Every
    /// outside string is escaped ([`crate::report::render::printable`]).
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let p = |s: &str| crate::report::render::printable(s);
        let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".to_string());
        let m = &self.machine;
        let mut out = String::new();
        let mut line = |key: &str, value: String| {
            let _ = writeln!(out, "{:<10}{}", format!("{key}:"), value);
        };
        line(
            "machine",
            format!("{} ({})", p(m.machine_id.as_str()), p(&m.name)),
        );
        line("app", p(m.app.as_str()));
        line("region", p(&m.region));
        line("pool", p(m.pool.as_str()));
        line("state", p(m.state.as_str()));
        line("status", m.status.to_string());
        line("ref", or_dash(m.reported_ref.as_deref().map(p)));
        line(
            "commit",
            or_dash(m.commit.as_ref().map(ToString::to_string)),
        );
        line("tip", p(&self.tip));
        line(
            "behind",
            format!(
                "{}, ahead {}",
                or_dash(m.commits_behind.map(|n| n.to_string())),
                or_dash(m.commits_ahead.map(|n| n.to_string()))
            ),
        );
        line("severity", or_dash(m.severity.map(|s| s.to_string())));
        line("action", or_dash(m.action.map(|a| a.to_string())));
        if let Some(detail) = &m.detail {
            line("detail", p(detail));
        }
        line(
            "decision",
            or_dash(self.decision.as_ref().map(|d| p(&d.to_string()))),
        );
        if let Some(at) = self.drift_since {
            line(
                "drifting",
                format!(
                    "since {}",
                    at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                ),
            );
        }
        let json = |v: &serde_json::Value| p(&v.to_string());
        if let Some(hold) = &self.hold {
            line("hold", json(hold));
        }
        if let Some(approval) = &self.approval {
            line("approval", json(approval));
        }
        if let Some(marker) = &self.rotation {
            line("marker", json(marker));
        }
        if let Some(stale) = &self.app_stale {
            line("stale", p(&stale.error));
        }
        if let Some(at) = self.swept_at {
            line(
                "swept",
                at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            );
        }
        if let Some(reason) = &m.reason {
            let _ = writeln!(out, "reason:");
            let _ = writeln!(out, "  {}", p(&reason.rule.to_string()));
            for evidence in &reason.evidence {
                let _ = writeln!(out, "  evidence: {}", p(&evidence.to_string()));
            }
            if reason.evidence_partial {
                let _ = writeln!(
                    out,
                    "  (path rules not yet checked on every missing commit: evidence may be partial)"
                );
            }
            if let Some(behind) = reason.behind {
                let _ = writeln!(
                    out,
                    "  missing: {behind} commit(s), newest {} shown:",
                    reason.missing.len()
                );
                for c in &reason.missing {
                    let _ = writeln!(out, "    {} {}", short(c.commit.as_str()), p(&c.subject));
                }
            }
        }
        if !self.history.is_empty() {
            let _ = writeln!(out, "history:");
            for h in &self.history {
                let _ = writeln!(out, "  {}", p(h));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The labels the CLI's error object carries (`daemon_<kind>`), pinned
    /// so a rename is seen; both undecodable answers are `decode`.
    #[test]
    fn status_error_kinds_keep_their_labels() {
        use strum::VariantArray;
        let labels: Vec<&str> = StatusErrorKind::VARIANTS.iter().map(|k| k.into()).collect();
        assert_eq!(
            labels,
            [
                "invalid_url",
                "transport",
                "not_ready",
                "status",
                "decode",
                "unknown_machine",
                "too_large"
            ]
        );
        assert_eq!(StatusError::DecodeMachine("x".into()).kind(), "decode");
        assert_eq!(StatusError::Decode("x".into()).kind(), "decode");
    }
}

//! The typed client of `GET /api/v1/fleet`, for the `status` command.
//!
//! Owns reading a running daemon's last sweep back into a [`FleetReport`], so
//! `status` prints exactly the table `check` prints (`report::to_table`). It
//! must never follow a redirect, send credentials, or put the URL of the
//! daemon into an error's text twice over (reqwest errors print URLs).

use std::time::Duration;

use serde::Deserialize;

use crate::sweep::FleetReport;

/// Parses a `check --output json` / `GET /api/v1/fleet` document.
pub fn parse_fleet(json: &str) -> Result<FleetReport, serde_json::Error> {
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
}

impl StatusError {
    pub fn kind(&self) -> &'static str {
        match self {
            StatusError::InvalidUrl { .. } => "invalid_url",
            StatusError::Transport(_) => "transport",
            StatusError::NotReady(_) => "not_ready",
            StatusError::Status { .. } => "status",
            StatusError::Decode(_) => "decode",
        }
    }
}

/// Reads the last sweep from a running daemon at `base_url` (e.g.
/// `http://127.0.0.1:9090`), the whole exchange bounded by `timeout`.
pub async fn fetch_fleet(base_url: &str, timeout: Duration) -> Result<FleetReport, StatusError> {
    let invalid = |reason: String| StatusError::InvalidUrl {
        url: base_url.to_string(),
        reason,
    };
    let mut base = url::Url::parse(base_url).map_err(|e| invalid(e.to_string()))?;
    if !matches!(base.scheme(), "http" | "https") {
        return Err(invalid("the scheme must be http or https".into()));
    }
    if !base.path().ends_with('/') {
        let path = format!("{}/", base.path());
        base.set_path(&path);
    }
    let url = base
        .join("api/v1/fleet")
        .map_err(|e| invalid(e.to_string()))?;
    let http = crate::http::client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .build()
        .map_err(|e| StatusError::Transport(crate::http::describe(&e)))?;
    let resp = http
        .get(url)
        .header(reqwest::header::ACCEPT, "application/json")
        .send()
        .await
        .map_err(|e| StatusError::Transport(crate::http::describe(&e)))?;
    let status = resp.status();
    let text = resp
        .text()
        .await
        .map_err(|e| StatusError::Transport(crate::http::describe(&e)))?;
    if !status.is_success() {
        #[derive(Deserialize)]
        struct ErrorBody {
            error: String,
        }
        let message = serde_json::from_str::<ErrorBody>(&text)
            .map(|b| b.error)
            .unwrap_or_else(|_| text.chars().take(200).collect());
        return Err(if status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            StatusError::NotReady(message)
        } else {
            StatusError::Status {
                status: status.as_u16(),
                message,
            }
        });
    }
    parse_fleet(&text).map_err(|e| StatusError::Decode(e.to_string()))
}

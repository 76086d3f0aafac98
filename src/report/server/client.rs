//! The typed client of `GET /api/v1/fleet` and `GET /api/v1/machines/{id}`,
//! for the `status` command.
//!
//! Owns reading a running daemon's last sweep back into the
//! [`FleetDocument`] it wrote, so `status` prints exactly the table `check`
//! prints (`render::to_table`),
//! and one machine's detail into the [`MachineDetail`] it wrote (`status
//! MACHINE`). It
//! must never follow a redirect, send credentials, read an answer past its
//! bound ([`MAX_FLEET_BODY_BYTES`], [`MAX_MACHINE_BODY_BYTES`]), or put the
//! URL of the daemon into an error's text twice over (reqwest errors print
//! URLs).

use std::time::Duration;

use serde::Deserialize;

use super::detail::MachineDetail;
use crate::report::wire::FleetDocument;

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

/// `GET /api/v1/machines/{id}` as `status MACHINE` reads it: the detail
/// the server writes.
pub type MachineView = MachineDetail;

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

//! The HTTP vocabulary the simulator's handlers and its front door share:
//! the Fly API's JSON error shape, body parsing, headers, token checks and
//! Fly's timestamp format.
//!
//! The bottom of the HTTP side: it names no other simulator module, so the
//! handlers (`fly_api`, `agent`) and the router (`http`) both import it and
//! neither imports the other's way up.

use std::net::SocketAddr;

use axum::Json;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Header carrying the lease nonce on Fly API calls.
pub(crate) const NONCE_HEADER: &str = "fly-machine-lease-nonce";

/// The arrival number the front door gave a request (its
/// [`super::RecordedRequest::seq`]), for handlers that record audit events.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RequestSeq(pub(crate) u64);

/// An error answered as `{"error": "..."}`, the Fly API's `ErrorResponse` shape.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
    retry_after: Option<u64>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    /// An arbitrary numeric status (injected faults, agent `HttpError`); 500 if invalid.
    pub(crate) fn with_code(code: u16, message: impl Into<String>) -> ApiError {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        ApiError::new(status, message)
    }

    pub(crate) fn retry_after(mut self, secs: Option<u64>) -> ApiError {
        self.retry_after = secs;
        self
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    pub(crate) fn app_not_found() -> ApiError {
        ApiError::not_found("app not found")
    }

    pub(crate) fn machine_not_found(id: &str) -> ApiError {
        ApiError::not_found(format!("machine not found: {id}"))
    }

    pub(crate) fn precondition(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::PRECONDITION_FAILED, message)
    }

    pub(crate) fn lease_held(machine_id: &str, owner: &str, expires_at: DateTime<Utc>) -> ApiError {
        ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "aborted: machine ID {machine_id} lease currently held by {owner}, expires at {}",
                rfc3339(expires_at)
            ),
        )
    }

    pub(crate) fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(ErrorBody {
                error: &self.message,
            }),
        )
            .into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// Parses a required JSON body, answering 400 (not axum's plain-text rejection) when it is bad.
pub(crate) fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// Like [`parse_json`], but an empty body means `T::default()`.
pub(crate) fn parse_optional_json<T: DeserializeOwned + Default>(
    body: &[u8],
) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        Ok(T::default())
    } else {
        parse_json(body)
    }
}

pub(crate) fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

pub(crate) fn lease_nonce(headers: &HeaderMap) -> Option<&str> {
    header_str(headers, NONCE_HEADER).filter(|n| !n.is_empty())
}

/// Splits `Scheme credentials`, matching the scheme case-insensitively.
fn credentials<'a>(authorization: &'a str, scheme: &str) -> Option<&'a str> {
    let (s, rest) = authorization.trim().split_once(' ')?;
    s.eq_ignore_ascii_case(scheme).then(|| rest.trim())
}

/// `Bearer <token>` or `FlyV1 <token>` with the fleet token. A configured
/// token that itself starts with `FlyV1 ` (how `fly tokens create` prints
/// macaroons) is compared without that prefix.
pub(crate) fn fly_token_matches(configured: &str, authorization: &str) -> bool {
    let configured = credentials(configured, "FlyV1").unwrap_or(configured.trim());
    let presented =
        credentials(authorization, "Bearer").or_else(|| credentials(authorization, "FlyV1"));
    !configured.is_empty() && presented == Some(configured)
}

/// The agent's cooperative endpoints take `Bearer <agent_token>` when one
/// (`configured`) is set.
pub(crate) fn agent_token_matches(configured: Option<&str>, authorization: Option<&str>) -> bool {
    match configured {
        None => true,
        Some(token) => authorization.and_then(|a| credentials(a, "Bearer")) == Some(token),
    }
}

/// Base URL of the Fly API stand-in served at `addr`, without `/v1`.
pub(crate) fn api_url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// Health URL template (the daemon's app config) of agents served at `addr`.
pub(crate) fn health_url_template(addr: SocketAddr) -> String {
    format!("http://{addr}/agents/{{machine_id}}/health")
}

/// Health URL of one machine's agent served at `addr`.
pub(crate) fn health_url(addr: SocketAddr, machine_id: &str) -> String {
    format!("http://{addr}/agents/{machine_id}/health")
}

/// RFC 3339 at second precision with `Z`, as the Fly API prints timestamps.
pub(crate) fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_matching_accepts_both_schemes() {
        assert!(fly_token_matches("tok", "Bearer tok"));
        assert!(fly_token_matches("tok", "FlyV1 tok"));
        assert!(fly_token_matches("tok", "bearer tok"));
        assert!(fly_token_matches("FlyV1 fm2_abc", "FlyV1 fm2_abc"));
        assert!(fly_token_matches("FlyV1 fm2_abc", "Bearer fm2_abc"));
        assert!(!fly_token_matches("tok", "Bearer other"));
        assert!(!fly_token_matches("tok", "tok"));
        assert!(!fly_token_matches("tok", "Basic tok"));
        assert!(!fly_token_matches("", "Bearer "));
    }

    #[test]
    fn optional_json_accepts_empty_and_rejects_garbage() {
        #[derive(serde::Deserialize, Default)]
        struct T {
            ttl: Option<u64>,
        }
        assert_eq!(
            parse_optional_json::<T>(b"").ok().map(|t| t.ttl),
            Some(None)
        );
        assert_eq!(
            parse_optional_json::<T>(b" \n").ok().map(|t| t.ttl),
            Some(None)
        );
        let parsed = parse_optional_json::<T>(b"{\"ttl\": 5}")
            .ok()
            .map(|t| t.ttl);
        assert_eq!(parsed, Some(Some(5)));
        let err = parse_optional_json::<T>(b"{nope").err().map(|e| e.status);
        assert_eq!(err, Some(StatusCode::BAD_REQUEST));
    }
}

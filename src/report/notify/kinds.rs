//! Which kind of webhook each configured format is: the one place that
//! names every [`SinkKind`] (`json`, `slack`, `pagerduty`).
//!
//! Owns the map from a `WebhookFormat` to its kind, and the name each has
//! in the config and the logs. A new format is its file plus one arm here
//! (and its `WebhookFormat` variant in the config). It must never hold a
//! kind's behaviour (each kind's file does) and is imported by no kind, so
//! the trait file (`sink`) never names its implementors.

use super::json::Json;
use super::pagerduty::Pagerduty;
use super::sink::SinkKind;
use super::slack::Slack;
use crate::config::WebhookFormat;

/// The kind of sink a configured format is.
pub(crate) fn kind(format: WebhookFormat) -> &'static dyn SinkKind {
    match format {
        WebhookFormat::Json => &Json,
        WebhookFormat::Slack => &Slack,
        WebhookFormat::Pagerduty => &Pagerduty,
    }
}

/// The name a format has in the config and in logs.
pub fn format_name(format: WebhookFormat) -> &'static str {
    kind(format).id()
}

//! The Slack webhook sink: a text fallback and blocks (header, summary
//! with fields, links).
//!
//! Owns the Slack wire shape (documented in `docs/alerts.md`). It needs no
//! secret but the URL, never sees it, and never does I/O.

use serde::Serialize;

use super::format::{Rendered, links, rfc3339, to_vec, truncate};
use super::sink::SinkKind;
use super::{Notification, SinkSecrets, Status};
use crate::model::{AppName, MachineId};

/// Slack's limit on a header block's text.
const SLACK_HEADER_MAX: usize = 150;
/// Slack's limit on a section's text (we stay well under its 3000).
const SLACK_SECTION_MAX: usize = 2900;

/// The `slack` format.
pub(super) struct Slack;

impl SinkKind for Slack {
    fn id(&self) -> &'static str {
        "slack"
    }

    fn render(&self, n: &Notification, _: &SinkSecrets, _: i64) -> Rendered {
        Rendered {
            body: to_vec(&slack_body(n)),
            headers: Vec::new(),
        }
    }
}

#[derive(Serialize)]
pub(super) struct SlackBody {
    /// Fallback for notifications and clients that do not render blocks.
    text: String,
    blocks: Vec<SlackBlock>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum SlackBlock {
    Header {
        text: SlackText,
    },
    Section {
        text: SlackText,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        fields: Vec<SlackText>,
    },
    Context {
        elements: Vec<SlackText>,
    },
}

#[derive(Serialize)]
#[serde(tag = "type")]
enum SlackText {
    #[serde(rename = "plain_text")]
    Plain { text: String },
    #[serde(rename = "mrkdwn")]
    Mrkdwn { text: String },
}

/// Slack's mrkdwn treats `&`, `<` and `>` as control characters.
pub(super) fn slack_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn status_label(status: Status) -> &'static str {
    match status {
        Status::Firing => "FIRING",
        Status::Resolved => "RESOLVED",
        Status::Event => "EVENT",
    }
}

/// The first 7 characters of a commit id (the whole value if shorter).
fn short_commit(commit: &str) -> &str {
    commit.get(..7).unwrap_or(commit)
}

pub(super) fn slack_body(n: &Notification) -> SlackBody {
    let label = status_label(n.status);
    let repeat = match (n.repeat, n.update) {
        (true, _) => " (repeat)",
        (_, true) => " (updated)",
        _ => "",
    };
    let target = match (&n.app, &n.machine_id) {
        (Some(app), Some(m)) => format!(" [{app}/{m}]"),
        (Some(app), None) => format!(" [{app}]"),
        _ => String::new(),
    };
    let text = slack_escape(&truncate(
        &format!(
            "{label} {} {}{repeat}{target}: {}",
            n.severity, n.event, n.summary
        ),
        SLACK_SECTION_MAX,
    ));
    let dash = || "—".to_owned();
    let field = |name: &str, value: String| SlackText::Mrkdwn {
        text: format!("*{name}*\n{}", slack_escape(&value)),
    };
    let commit = n
        .commit
        .as_ref()
        .map(|c| format!("`{}`", short_commit(c.as_str())))
        .unwrap_or_else(dash);
    SlackBody {
        text,
        blocks: vec![
            SlackBlock::Header {
                text: SlackText::Plain {
                    text: truncate(&format!("{label}: {}{repeat}", n.event), SLACK_HEADER_MAX),
                },
            },
            SlackBlock::Section {
                text: SlackText::Mrkdwn {
                    text: slack_escape(&truncate(&n.summary, SLACK_SECTION_MAX)),
                },
                fields: vec![
                    field("App", n.app.as_ref().map_or_else(dash, AppName::to_string)),
                    field(
                        "Machine",
                        n.machine_id
                            .as_ref()
                            .map_or_else(dash, MachineId::to_string),
                    ),
                    field("Severity", n.severity.to_string()),
                    // Backticks are not escaped: the value is a hex commit id.
                    SlackText::Mrkdwn {
                        text: format!("*Commit*\n{commit}"),
                    },
                ],
            },
            SlackBlock::Context {
                elements: slack_links(n)
                    .into_iter()
                    .chain([SlackText::Mrkdwn {
                        text: slack_escape(&format!("{} · {}", n.dedup_key, rfc3339(n))),
                    }])
                    .collect(),
            },
        ],
    }
}

/// Slack links `<url|text>`; a URL with `|`, `<` or `>` (never from our
/// config checks, but be safe) is shown as text instead.
fn slack_links(n: &Notification) -> Vec<SlackText> {
    let shown: Vec<String> = links(n)
        .into_iter()
        .map(|(text, url)| {
            if url.contains(['|', '<', '>']) {
                format!("{text}: {}", slack_escape(url))
            } else {
                format!("<{}|{text}>", url.replace('&', "&amp;"))
            }
        })
        .collect();
    if shown.is_empty() {
        return Vec::new();
    }
    vec![SlackText::Mrkdwn {
        text: shown.join(" · "),
    }]
}

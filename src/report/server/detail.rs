//! One machine's detail: the document of `GET /api/v1/machines/{id}`,
//! written by the server from the last sweep and read back by `status
//! MACHINE` as the same type, and its text for people.
//!
//! Owns the document's shape (docs/machine.schema.json is what it
//! generates) and how each field is written, so the bytes on the wire stay
//! what they have been: a control key's value with its keys sorted
//! ([`Control`]). It must never fetch or decide anything.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::decide::decision::Decision;
use crate::metadata::marker::Marker;
use crate::metadata::operator::{Approval, Hold};
use crate::model::short_commit as short;
use crate::observe::probe::AgentReport;
use crate::observe::sweep::StaleApp;
use crate::report::wire::MachineRow;

/// `GET /api/v1/machines/{id}`: what an operator needs to decide an
/// intervention: the server writes it (copied from the last sweep, a few
/// hundred bytes a request) and `status` reads it back. Its schema is
/// docs/machine.schema.json (`machine_schema`).
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema)]
pub struct MachineDetail {
    /// The fleet document's version ([`crate::report::wire::SCHEMA_VERSION`]):
    /// this document moves with it.
    pub schema_version: u32,
    /// The machine's row of the `check` JSON, with its `reason` inline.
    pub machine: MachineRow,
    /// The agent's last parsed health report (null when it gave none).
    pub agent_report: Option<AgentReport>,
    /// The operator hold, if any (parsed; the raw value if it is not ours).
    #[schemars(with = "Option<serde_json::Value>")]
    pub hold: Option<Control<Hold>>,
    /// A pending approval, if any.
    #[schemars(with = "Option<serde_json::Value>")]
    pub approval: Option<Control<Approval>>,
    /// The rotation marker (parsed; the raw value if it is not ours).
    #[schemars(with = "Option<serde_json::Value>")]
    pub rotation: Option<Control<Marker>>,
    /// What the planner decided for it in the last sweep (docs/design.md §6.2).
    pub decision: Option<Decision>,
    pub history: Vec<String>,
    pub drift_since: Option<DateTime<Utc>>,
    /// The release tip the report measured against.
    pub tip: String,
    pub swept_at: Option<DateTime<Utc>>,
    /// Whole seconds since `swept_at`, on the daemon's clock.
    pub age_secs: Option<u64>,
    /// The view is older than `alerts.stale_after`: the machine may have
    /// changed since.
    pub stale: bool,
    /// Why it is stale; absent when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale_reason: Option<String>,
    /// Set when the last sweep could not list the machine's app: this is
    /// its last listing, and nothing is done to it meanwhile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub app_stale: Option<StaleApp>,
}

/// A control key's value (hold, approval, marker) as the detail shows it.
#[derive(Clone, Debug, PartialEq)]
pub enum Control<T> {
    /// Ours, as the sweep parsed it.
    Ours(T),
    /// Not ours: shown as written, as JSON when it parses, else as the
    /// string it is.
    Written(serde_json::Value),
}

impl<T: Serialize> Control<T> {
    /// As JSON. Ours goes through a `Value`, so its keys are sorted like
    /// those of a value as written: the detail has always written both so.
    pub fn to_json(&self) -> Result<serde_json::Value, serde_json::Error> {
        match self {
            Control::Ours(t) => serde_json::to_value(t),
            Control::Written(v) => Ok(v.clone()),
        }
    }
}

/// The compact JSON the detail's text shows.
impl<T: Serialize> fmt::Display for Control<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Ours always serializes (strings, enums, times); were it not to,
        // null is what the server would have had to write.
        match self.to_json() {
            Ok(v) => write!(f, "{v}"),
            Err(_) => f.write_str("null"),
        }
    }
}

impl<T: Serialize> Serialize for Control<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json()
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

impl<'de, T: Serialize + DeserializeOwned> Deserialize<'de> for Control<T> {
    /// The document does not say which it was: a value that reads as ours
    /// and writes back the same is taken as ours, any other as written (so
    /// it is shown exactly as the daemon sent it).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Control<T>, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        Ok(match serde_json::from_value::<T>(v.clone()) {
            Ok(t) if serde_json::to_value(&t).is_ok_and(|back| back == v) => Control::Ours(t),
            _ => Control::Written(v),
        })
    }
}

impl MachineDetail {
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
        if let Some(hold) = &self.hold {
            line("hold", p(&hold.to_string()));
        }
        if let Some(approval) = &self.approval {
            line("approval", p(&approval.to_string()));
        }
        if let Some(marker) = &self.rotation {
            line("marker", p(&marker.to_string()));
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
        if let Some(why) = &self.stale_reason {
            line("STALE", p(why));
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

    /// Read back, a value is ours only when it is what ours writes: a hold
    /// of someone else's with a field of its own stays as written, so the
    /// text shows every field the daemon sent.
    #[test]
    fn a_control_reads_back_as_written_unless_it_is_exactly_ours() {
        let hold = r#"{"at":"2026-05-01T12:00:00Z","by":"alice","reason":"INC-7"}"#;
        let read: Control<Hold> = serde_json::from_str(hold).expect("JSON");
        assert!(matches!(read, Control::Ours(_)), "{read:?}");
        assert_eq!(read.to_string(), hold);
        assert_eq!(serde_json::to_string(&read).ok().as_deref(), Some(hold));

        let extra = r#"{"at":"2026-05-01T12:00:00Z","by":"alice","reason":"INC-7","ticket":7}"#;
        let read: Control<Hold> = serde_json::from_str(extra).expect("JSON");
        assert!(matches!(read, Control::Written(_)), "{read:?}");
        assert_eq!(read.to_string(), extra);

        let note: Control<Hold> = serde_json::from_str(r#""just a note""#).expect("JSON");
        assert_eq!(note, Control::Written("just a note".into()));
    }
}

//! Where each payload points on-call to act: the runbook section of its kind,
//! the status page and the machine's page, the release tip, and the rule
//! that decided the severity.
//!
//! Owns the link vocabulary every format shares (`details.runbook_url`,
//! `status_url`, `machine_url`, `tip`, `severity_rule`) and the anchor of
//! each kind in docs/operations.md. It must never link to anything but the
//! configured runbook and `server.public_url` (no secret, no webhook URL).

use std::collections::BTreeMap;

use crate::config::{AlertsConfig, PublicUrl};
use crate::decide::alerts::AlertKind;
use crate::model::{CommitId, MachineId, Severity};

/// The `details` keys the links are carried in.
pub const RUNBOOK_URL: &str = "runbook_url";
pub const STATUS_URL: &str = "status_url";
pub const MACHINE_URL: &str = "machine_url";
pub const TIP: &str = "tip";
pub const SEVERITY_RULE: &str = "severity_rule";

/// The anchor of an alert kind's runbook in docs/operations.md (its
/// section is titled with the event name, so the anchor is that name).
pub fn runbook_anchor(kind: AlertKind) -> &'static str {
    kind.trigger_name()
}

/// The anchor of the action events' runbook.
pub const ACTION_ANCHOR: &str = "action_failed";

/// The severity of alert kinds whose level is fixed, not judged: the rule
/// that "decided" it is that fixed level.
fn fixed_rule(kind: AlertKind, severity: Severity) -> Option<String> {
    match kind {
        AlertKind::Drift | AlertKind::ManualApprovalRequired => None,
        AlertKind::RotationStuck | AlertKind::RotationFailed => Some(format!(
            "{}: the drift's severity, at least high ({severity})",
            kind.trigger_name()
        )),
        _ => Some(format!(
            "{} is always {severity} (docs/alerts.md)",
            kind.trigger_name()
        )),
    }
}

/// The configured link targets.
#[derive(Clone, Debug)]
pub struct Links {
    runbook: String,
    public: Option<PublicUrl>,
}

impl Links {
    pub fn new(config: &AlertsConfig, public: Option<PublicUrl>) -> Links {
        Links {
            runbook: config.runbook_url.trim_end_matches('#').to_owned(),
            public,
        }
    }

    /// The runbook section at `anchor`.
    pub fn runbook(&self, anchor: &str) -> String {
        format!("{}#{anchor}", self.runbook)
    }

    /// The status page, when `server.public_url` is set.
    pub fn status_page(&self) -> Option<String> {
        self.public.as_ref().map(PublicUrl::status_page)
    }

    /// A machine's page, when `server.public_url` is set.
    pub fn machine_page(&self, machine_id: &str) -> Option<String> {
        self.public.as_ref().map(|p| p.machine_page(machine_id))
    }

    /// Adds the links of an alert or event to its `details` (keeping what
    /// the alert already says, e.g. the planner's `severity_rule`).
    pub fn annotate(
        &self,
        details: &mut BTreeMap<String, String>,
        anchor: &str,
        machine_id: Option<&MachineId>,
        commit: Option<&CommitId>,
    ) {
        details.insert(RUNBOOK_URL.to_owned(), self.runbook(anchor));
        if let Some(url) = self.status_page() {
            details.insert(STATUS_URL.to_owned(), url);
        }
        if let Some(url) = machine_id.and_then(|m| self.machine_page(m.as_str())) {
            details.insert(MACHINE_URL.to_owned(), url);
        }
        if let Some(c) = commit {
            details
                .entry(TIP.to_owned())
                .or_insert_with(|| c.to_string());
        }
    }

    /// As `annotate`, for an alert of `kind` at `severity`.
    pub fn annotate_alert(
        &self,
        details: &mut BTreeMap<String, String>,
        kind: AlertKind,
        severity: Severity,
        machine_id: Option<&MachineId>,
        commit: Option<&CommitId>,
    ) {
        self.annotate(details, runbook_anchor(kind), machine_id, commit);
        if let Some(rule) = fixed_rule(kind, severity) {
            details.entry(SEVERITY_RULE.to_owned()).or_insert(rule);
        }
    }
}

//! Guardrails: why a pool may not claim now, though a machine qualifies
//! (#36). This module judges the alert gate (`[gates.alertmanager]`, item
//! 4): a matching alert that fires holds new claims, and an Alertmanager
//! that cannot be read holds them too (fail closed) and pages, unless
//! `fail_open`.
//!
//! Owns the vocabulary of guards ([`Guard`], carried by
//! `Decision::Guarded` and named by the metric's `reason` label) and the
//! judgement of which apps a gate holds. Scope: an alert whose `fly_app`
//! (else `app`) label names a configured app holds that app only; any other
//! matching alert holds the whole fleet. A guard never touches a rotation
//! that already holds its slot (it finishes, its undo too). It must never
//! do I/O: the gate is read by `observe::gate` and passed in the snapshot.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::decide::policy::Policy;
use crate::decide::snapshot::Snapshot;
use crate::events::{Alert, AlertKind};
use crate::model::{AppName, Severity};
use crate::observe::gate::GateView;

/// Why a pool may not claim now.
#[derive(
    Clone,
    Debug,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
    strum::IntoStaticStr,
    strum::VariantNames,
)]
#[serde(tag = "reason", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Guard {
    /// An Alertmanager alert matching `gates.alertmanager.matchers` fires:
    /// `alert` names it (`AgentErrorRate{app="x"}`).
    AlertFiring { alert: String },
    /// Alertmanager could not be read (`error`, without its URL): claims
    /// are held (fail closed) until it can.
    GateUnreachable { error: String },
}

impl Guard {
    /// Every reason, in declaration order (the metric's label values).
    pub const REASONS: &'static [&'static str] = <Self as strum::VariantNames>::VARIANTS;

    /// A stable snake_case word: the JSON `reason` and the metric label.
    pub fn reason(&self) -> &'static str {
        self.into()
    }
}

impl fmt::Display for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Guard::AlertFiring { alert } => write!(f, "blocked by alert {alert}"),
            Guard::GateUnreachable { .. } => f.write_str("blocked: alert gate unreachable"),
        }
    }
}

/// The apps the alert gate holds now, each with its guard.
pub fn alert_gate(policy: &Policy, snapshot: &Snapshot) -> BTreeMap<AppName, Guard> {
    let apps = snapshot.apps.iter().map(|a| &a.name);
    match &snapshot.gate {
        GateView::NotConfigured => BTreeMap::new(),
        GateView::Unreachable(_) if policy.gate_fail_open => BTreeMap::new(),
        GateView::Unreachable(error) => apps
            .map(|a| {
                let error = error.clone();
                (a.clone(), Guard::GateUnreachable { error })
            })
            .collect(),
        GateView::Read { firing, .. } => {
            let configured = |name: &str| snapshot.apps.iter().any(|a| a.name.as_str() == name);
            apps.filter_map(|app| {
                firing
                    .iter()
                    .find(|f| f.app().is_none_or(|n| !configured(n) || n == app.as_str()))
                    .map(|f| {
                        let alert = f.to_string();
                        (app.clone(), Guard::AlertFiring { alert })
                    })
            })
            .collect()
        }
    }
}

/// `gate_unreachable` while Alertmanager cannot be read: high while it
/// holds claims (fail closed), low with `fail_open` (nothing is held, but
/// the gate is blind).
pub fn gate_alert(policy: &Policy, snapshot: &Snapshot) -> Option<Alert> {
    let GateView::Unreachable(error) = &snapshot.gate else {
        return None;
    };
    let (severity, effect) = if policy.gate_fail_open {
        (
            Severity::Low,
            "gates.alertmanager.fail_open is set, so rotations start as if no alert fired",
        )
    } else {
        (
            Severity::High,
            "no new rotation starts until it can be read (fail closed); those under way finish",
        )
    };
    Some(Alert {
        kind: AlertKind::GateUnreachable,
        app: None,
        machine_id: None,
        commit: None,
        severity,
        summary: format!(
            "the alert gate's Alertmanager (gates.alertmanager) cannot be read: {error}; {effect} (see the gate_unreachable runbook, docs/operations.md)"
        ),
        details: BTreeMap::from([("error".to_string(), error.clone())]),
    })
}

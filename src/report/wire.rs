//! The fleet document on the wire: `check --output json` and
//! `GET /api/v1/fleet` write it, `status` reads it back.
//!
//! Owns the shape of that document ([`SCHEMA_VERSION`]): the reason for a
//! drift is carried once per reported ref, in a `refs` table keyed by the
//! ref's commit (its reported text when it did not resolve), and each
//! machine row names its entry (`reason_ref`). Machines on the same ref
//! share one reason in memory already; the document no longer repeats it
//! per machine (at 100,000 machines, 3 KB each). It must never compute
//! anything: it writes what the sweep and `judge` decided, and reads back
//! exactly that.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::model::{
    AppName, CommitId, MachineId, MachineState, MachineStatus, PolicyAction, Reason, Severity,
    SharedReason,
};
use crate::observe::sweep::{AppSummary, FleetReport, MachineReport, SlotsView, TipReport};

/// The document's version. 2: reasons moved from each machine row to the
/// `refs` table (`reason_ref` names the entry); 1 (no `schema_version`):
/// a `reason` on every row.
pub const SCHEMA_VERSION: u32 = 2;

#[derive(Serialize)]
struct DocOut<'a> {
    schema_version: u32,
    tip: &'a TipReport,
    coherence: f64,
    apps: &'a [AppSummary],
    /// Each reported ref's reason, once.
    refs: BTreeMap<&'a str, &'a Reason>,
    machines: Vec<RowOut<'a>>,
}

#[derive(Serialize)]
struct RowOut<'a> {
    app: &'a AppName,
    machine_id: &'a MachineId,
    name: &'a str,
    region: &'a str,
    pool: &'a str,
    state: &'a MachineState,
    status: MachineStatus,
    reported_ref: Option<&'a str>,
    commit: Option<&'a CommitId>,
    commits_behind: Option<u64>,
    commits_ahead: Option<u64>,
    severity: Option<Severity>,
    action: Option<PolicyAction>,
    detail: Option<&'a str>,
    /// The key of this machine's reason in `refs`; null without a reason.
    reason_ref: Option<&'a str>,
}

/// The `refs` key of a machine's reason: its commit, or the text it
/// reported when that did not resolve.
fn ref_key(m: &MachineReport) -> Option<&str> {
    m.commit
        .as_ref()
        .map(CommitId::as_str)
        .or(m.reported_ref.as_deref())
}

impl Serialize for FleetReport {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut refs: BTreeMap<&str, &Reason> = BTreeMap::new();
        let mut machines = Vec::with_capacity(self.machines.len());
        for m in &self.machines {
            let reason_ref = match (&m.reason, ref_key(m)) {
                (Some(reason), Some(key)) => {
                    match refs.get(key) {
                        Some(known) if *known != &**reason => {
                            // Never expected (one ref, one analysis): a
                            // document that loses a reason is worse than one
                            // that says it cannot be written.
                            return Err(serde::ser::Error::custom(format!(
                                "machines on ref {key} have different reasons"
                            )));
                        }
                        Some(_) => {}
                        None => {
                            refs.insert(key, reason);
                        }
                    }
                    Some(key)
                }
                (Some(_), None) => {
                    return Err(serde::ser::Error::custom(format!(
                        "machine {} has a reason but no reported ref",
                        m.machine_id
                    )));
                }
                (None, _) => None,
            };
            machines.push(RowOut {
                app: &m.app,
                machine_id: &m.machine_id,
                name: &m.name,
                region: &m.region,
                pool: &m.pool,
                state: &m.state,
                status: m.status,
                reported_ref: m.reported_ref.as_deref(),
                commit: m.commit.as_ref(),
                commits_behind: m.commits_behind,
                commits_ahead: m.commits_ahead,
                severity: m.severity,
                action: m.action,
                detail: m.detail.as_deref(),
                reason_ref,
            });
        }
        DocOut {
            schema_version: SCHEMA_VERSION,
            tip: &self.tip,
            coherence: self.coherence,
            apps: &self.apps,
            refs,
            machines,
        }
        .serialize(s)
    }
}

/// The document as read; its JSON Schema is the published one
/// (docs/fleet.schema.json, through `render::FleetDocument`).
#[derive(Deserialize, schemars::JsonSchema)]
struct DocIn {
    schema_version: u32,
    tip: TipReport,
    coherence: f64,
    apps: Vec<AppSummary>,
    #[serde(default)]
    refs: BTreeMap<String, Reason>,
    machines: Vec<RowIn>,
}

#[derive(Deserialize, schemars::JsonSchema)]
struct RowIn {
    app: AppName,
    machine_id: MachineId,
    name: String,
    region: String,
    pool: String,
    state: MachineState,
    status: MachineStatus,
    reported_ref: Option<String>,
    commit: Option<CommitId>,
    commits_behind: Option<u64>,
    commits_ahead: Option<u64>,
    severity: Option<Severity>,
    action: Option<PolicyAction>,
    #[serde(default)]
    detail: Option<String>,
    #[serde(default)]
    reason_ref: Option<String>,
}

/// The schema of the document [`FleetReport`] reads: the wire form's.
impl schemars::JsonSchema for FleetReport {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "FleetReport".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        DocIn::json_schema(generator)
    }
}

impl<'de> Deserialize<'de> for FleetReport {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<FleetReport, D::Error> {
        use serde::de::Error;
        let doc = DocIn::deserialize(d)?;
        if doc.schema_version != SCHEMA_VERSION {
            return Err(D::Error::custom(format!(
                "fleet document schema_version {} is not {SCHEMA_VERSION}, the one this fleet-reconciler reads (use the same version for the daemon and the CLI)",
                doc.schema_version
            )));
        }
        // One shared reason per entry, as the sweep had it.
        let refs: BTreeMap<String, SharedReason> = doc
            .refs
            .into_iter()
            .map(|(k, r)| (k, SharedReason(std::sync::Arc::new(r))))
            .collect();
        let mut machines = Vec::with_capacity(doc.machines.len());
        for row in doc.machines {
            let reason = match &row.reason_ref {
                Some(key) => Some(refs.get(key).cloned().ok_or_else(|| {
                    D::Error::custom(format!(
                        "machine {} names reason_ref {key:?}, which refs does not hold",
                        row.machine_id
                    ))
                })?),
                None => None,
            };
            let mut m = MachineReport::listed(
                row.app.as_str(),
                row.machine_id.as_str(),
                &row.name,
                row.state,
            );
            m.region = row.region;
            m.pool = row.pool;
            m.status = row.status;
            m.reported_ref = row.reported_ref;
            m.commit = row.commit;
            m.commits_behind = row.commits_behind;
            m.commits_ahead = row.commits_ahead;
            m.severity = row.severity;
            m.action = row.action;
            m.detail = row.detail;
            m.reason = reason;
            machines.push(m);
        }
        Ok(FleetReport {
            tip: doc.tip,
            coherence: doc.coherence,
            apps: doc.apps,
            machines,
            slots: SlotsView::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::{MissingCommit, RuleMatch};

    fn commit(c: char) -> CommitId {
        CommitId::parse(&c.to_string().repeat(40)).unwrap()
    }

    /// `n` machines drifted on one ref, one on another, one stopped.
    fn report(n: usize) -> FleetReport {
        let reason = |behind: u64| {
            SharedReason(Arc::new(Reason {
                rule: RuleMatch::NoMatch {
                    level: Severity::Low,
                },
                evidence: Vec::new(),
                behind: Some(behind),
                missing: (0..20)
                    .map(|i| {
                        Arc::new(MissingCommit {
                            commit: commit('c'),
                            subject: format!("commit subject number {i}"),
                        })
                    })
                    .collect(),
                evidence_partial: false,
            }))
        };
        let (shared, other) = (reason(20), reason(3));
        let drifted = |id: String, on: char, r: &SharedReason| {
            let mut m = MachineReport::listed("agents", &id, &id, MachineState::Started);
            m.status = MachineStatus::Drifted;
            m.commit = Some(commit(on));
            m.reported_ref = Some(on.to_string().repeat(12));
            m.severity = Some(Severity::Low);
            m.reason = Some(r.clone());
            m
        };
        let mut machines: Vec<MachineReport> = (0..n)
            .map(|i| drifted(format!("m{i}"), 'a', &shared))
            .collect();
        machines.push(drifted("x".into(), 'b', &other));
        machines.push(MachineReport::listed(
            "agents",
            "stopped",
            "stopped",
            MachineState::Stopped,
        ));
        FleetReport {
            tip: TipReport {
                branch: "release".into(),
                commit: commit('f'),
            },
            coherence: 0.0,
            apps: Vec::new(),
            machines,
            slots: SlotsView::default(),
        }
    }

    #[test]
    fn a_reason_is_written_once_per_ref_and_reads_back_shared() {
        let text = serde_json::to_string(&report(500)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["schema_version"], SCHEMA_VERSION);
        assert_eq!(v["refs"].as_object().unwrap().len(), 2);
        assert_eq!(v["machines"][0]["reason_ref"], "a".repeat(40));
        assert!(v["machines"][501]["reason_ref"].is_null());
        // Once, not 500 times: the subjects appear in the document once each.
        assert_eq!(text.matches("commit subject number 7\"").count(), 2);
        let back: FleetReport = serde_json::from_str(&text).unwrap();
        let (a, b) = (&back.machines[0], &back.machines[499]);
        assert!(Arc::ptr_eq(
            &a.reason.as_ref().unwrap().0,
            &b.reason.as_ref().unwrap().0
        ));
        assert_eq!(a.reason, report(1).machines[0].reason);
        assert_eq!(back.machines[500].reason.as_ref().unwrap().behind, Some(3));
        assert!(back.machines[501].reason.is_none());
    }

    #[test]
    fn a_document_of_another_version_or_naming_a_missing_ref_is_refused() {
        let mut v = serde_json::to_value(report(2)).unwrap();
        v["schema_version"] = 1.into();
        let e = serde_json::from_value::<FleetReport>(v.clone()).unwrap_err();
        assert!(e.to_string().contains("schema_version 1"), "{e}");
        v["schema_version"] = SCHEMA_VERSION.into();
        v["refs"] = serde_json::json!({});
        let e = serde_json::from_value::<FleetReport>(v).unwrap_err();
        assert!(e.to_string().contains("machine m0 names reason_ref"), "{e}");
    }
}

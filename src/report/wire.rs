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

/// The document's version. 3: a row leaves out what it would repeat or
/// what is null (`reason_ref` when the entry is its `commit`'s,
/// `reported_ref` when it is the whole `commit`, every null field): 30 MB
/// at 100,000 machines instead of 38. 2: reasons moved from each machine
/// row to the `refs` table (`reason_ref` names the entry); 1 (no
/// `schema_version`): a `reason` on every row.
pub const SCHEMA_VERSION: u32 = 3;

/// The versions `status` reads: a version 2 document is a version 3 one
/// with every field written, so it reads the same way.
pub const READABLE_VERSIONS: [u32; 2] = [2, 3];

#[derive(Serialize)]
struct DocOut<'a> {
    schema_version: u32,
    tip: &'a TipReport,
    coherence: f64,
    apps: &'a [AppSummary],
    /// Each reported ref's reason, once.
    refs: BTreeMap<&'a str, &'a Reason>,
    machines: Rows<'a>,
}

/// The machine rows, each made as it is written: a 100,000-machine
/// document never holds its rows twice.
struct Rows<'a>(&'a [MachineReport]);

impl Serialize for Rows<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(row_out))
    }
}

/// One machine row as written: a field that would be null is left out.
#[derive(Serialize)]
struct RowOut<'a> {
    app: &'a AppName,
    machine_id: &'a MachineId,
    name: &'a str,
    region: &'a str,
    pool: &'a str,
    state: &'a MachineState,
    status: MachineStatus,
    /// Left out when it is the whole `commit` (most agents report that).
    #[serde(skip_serializing_if = "Option::is_none")]
    reported_ref: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    commit: Option<&'a CommitId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    commits_behind: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    commits_ahead: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    severity: Option<Severity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    action: Option<PolicyAction>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
    /// The key of this machine's reason in `refs` when it is not the row's
    /// `commit` (a ref that did not resolve); left out without a reason.
    #[serde(skip_serializing_if = "Option::is_none")]
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

/// The row of `m` as written: `reported_ref` only when it is not the whole
/// commit, `reason_ref` only when the entry is not the commit's (a judged
/// row, one with a `severity`, finds its reason under its `commit`).
fn row_out(m: &MachineReport) -> RowOut<'_> {
    let commit = m.commit.as_ref().map(CommitId::as_str);
    let reported_ref = m.reported_ref.as_deref().filter(|r| Some(*r) != commit);
    let reason_ref = match (&m.reason, ref_key(m)) {
        (Some(_), Some(key)) if !(m.severity.is_some() && Some(key) == commit) => Some(key),
        _ => None,
    };
    RowOut {
        app: &m.app,
        machine_id: &m.machine_id,
        name: &m.name,
        region: &m.region,
        pool: &m.pool,
        state: &m.state,
        status: m.status,
        reported_ref,
        commit: m.commit.as_ref(),
        commits_behind: m.commits_behind,
        commits_ahead: m.commits_ahead,
        severity: m.severity,
        action: m.action,
        detail: m.detail.as_deref(),
        reason_ref,
    }
}

impl Serialize for FleetReport {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut refs: BTreeMap<&str, &Reason> = BTreeMap::new();
        for m in &self.machines {
            match (&m.reason, ref_key(m)) {
                (Some(reason), Some(key)) => match refs.get(key) {
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
                },
                (Some(_), None) => {
                    return Err(serde::ser::Error::custom(format!(
                        "machine {} has a reason but no reported ref",
                        m.machine_id
                    )));
                }
                (None, _) => {}
            }
        }
        DocOut {
            schema_version: SCHEMA_VERSION,
            tip: &self.tip,
            coherence: self.coherence,
            apps: &self.apps,
            refs,
            machines: Rows(&self.machines),
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
    /// What the agent reported; absent with a `commit`: the whole commit
    /// (version 3), absent without one: nothing reported.
    #[serde(default)]
    reported_ref: Option<String>,
    #[serde(default)]
    commit: Option<CommitId>,
    #[serde(default)]
    commits_behind: Option<u64>,
    #[serde(default)]
    commits_ahead: Option<u64>,
    /// Present on a drifted row (`drifted`, `unknown_ref`,
    /// `ambiguous_ref`), which has a reason in `refs`.
    #[serde(default)]
    severity: Option<Severity>,
    #[serde(default)]
    action: Option<PolicyAction>,
    #[serde(default)]
    detail: Option<String>,
    /// The key of the row's reason in `refs` when it is not its `commit`
    /// (a ref that did not resolve). Absent on a row with a `severity`:
    /// the entry under its `commit`.
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
        if !READABLE_VERSIONS.contains(&doc.schema_version) {
            return Err(D::Error::custom(format!(
                "fleet document schema_version {} is not one this fleet-reconciler reads ({READABLE_VERSIONS:?}; use the same version for the daemon and the CLI)",
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
            let reason = match (&row.reason_ref, &row.severity, &row.commit) {
                (Some(key), _, _) => Some(refs.get(key).cloned().ok_or_else(|| {
                    D::Error::custom(format!(
                        "machine {} names reason_ref {key:?}, which refs does not hold",
                        row.machine_id
                    ))
                })?),
                // Version 3 leaves out a reason_ref that is the commit.
                (None, Some(_), Some(commit)) => refs.get(commit.as_str()).cloned(),
                (None, _, _) => None,
            };
            // Version 3 leaves out a reported_ref that is the whole commit.
            let reported_ref = row
                .reported_ref
                .or_else(|| row.commit.as_ref().map(|c| c.as_str().to_owned()));
            let mut m = MachineReport::listed(
                row.app.as_str(),
                row.machine_id.as_str(),
                &row.name,
                row.state,
            );
            m.region = row.region;
            m.pool = row.pool;
            m.status = row.status;
            m.reported_ref = reported_ref;
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
        assert!(v["refs"].get("a".repeat(40)).is_some());
        // Version 3: the entry is the row's commit's, so it is not named.
        assert!(v["machines"][0].get("reason_ref").is_none());
        assert!(v["machines"][501].get("reason_ref").is_none());
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
    fn a_row_leaves_out_nulls_and_what_repeats_its_commit_and_reads_back_the_same() {
        let mut r = report(1);
        // One agent reported the whole commit, one an abbreviation, and one
        // a ref that did not resolve (its reason is under what it reported).
        r.machines[0].reported_ref = Some("a".repeat(40));
        let mut unknown = MachineReport::listed("agents", "u", "u", MachineState::Started);
        unknown.status = MachineStatus::UnknownRef;
        unknown.reported_ref = Some("0123abcd".into());
        unknown.severity = Some(Severity::Critical);
        unknown.reason = r.machines[1].reason.clone();
        unknown.detail = Some("ref is not a commit of the overlay repository".into());
        r.machines.push(unknown);
        let v = serde_json::to_value(&r).unwrap();
        let rows = v["machines"].as_array().unwrap();
        let keys = |i: usize| -> Vec<&str> {
            rows[i]
                .as_object()
                .unwrap()
                .keys()
                .map(String::as_str)
                .collect()
        };
        assert!(!keys(0).contains(&"reported_ref"), "{:?}", rows[0]);
        assert_eq!(rows[1]["reported_ref"], "b".repeat(12));
        assert!(
            !keys(2).iter().any(|k| rows[2][k].is_null()),
            "{:?}",
            rows[2]
        );
        assert!(!keys(2).contains(&"commit") && !keys(2).contains(&"detail"));
        assert_eq!(rows[3]["reason_ref"], "0123abcd");
        assert!(v["refs"].get("0123abcd").is_some());
        let back: FleetReport = serde_json::from_value(v).unwrap();
        for (a, b) in back.machines.iter().zip(&r.machines) {
            assert_eq!(a.reported_ref, b.reported_ref, "{}", a.machine_id);
            assert_eq!(a.reason, b.reason, "{}", a.machine_id);
            assert_eq!(a.detail, b.detail, "{}", a.machine_id);
        }
    }

    #[test]
    fn a_version_2_document_with_every_field_written_reads_the_same() {
        let r = report(2);
        let mut v = serde_json::to_value(&r).unwrap();
        v["schema_version"] = 2.into();
        for row in v["machines"].as_array_mut().unwrap() {
            let row = row.as_object_mut().unwrap();
            let key = row
                .get("commit")
                .cloned()
                .unwrap_or(serde_json::Value::Null);
            let judged = row.contains_key("severity");
            row.insert(
                "reason_ref".into(),
                if judged { key } else { serde_json::Value::Null },
            );
            for field in ["reported_ref", "commit", "severity", "action", "detail"] {
                row.entry(field).or_insert(serde_json::Value::Null);
            }
        }
        let back: FleetReport = serde_json::from_value(v).unwrap();
        assert_eq!(back.machines.len(), r.machines.len());
        for (a, b) in back.machines.iter().zip(&r.machines) {
            assert_eq!(a.reason, b.reason, "{}", a.machine_id);
            assert_eq!(a.reported_ref, b.reported_ref, "{}", a.machine_id);
        }
    }

    #[test]
    fn a_document_of_another_version_or_naming_a_missing_ref_is_refused() {
        let mut v = serde_json::to_value(report(2)).unwrap();
        v["schema_version"] = 1.into();
        let e = serde_json::from_value::<FleetReport>(v.clone()).unwrap_err();
        assert!(e.to_string().contains("schema_version 1"), "{e}");
        v["schema_version"] = SCHEMA_VERSION.into();
        v["refs"] = serde_json::json!({});
        v["machines"][0]["reason_ref"] = "a".repeat(40).into();
        let e = serde_json::from_value::<FleetReport>(v).unwrap_err();
        assert!(e.to_string().contains("machine m0 names reason_ref"), "{e}");
    }
}

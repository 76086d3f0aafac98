//! The fleet document on the wire: `check --output json` and
//! `GET /api/v1/fleet` write it, `status` reads it back, as one type
//! ([`FleetDocument`]).
//!
//! Owns the shape of that document ([`SCHEMA_VERSION`]) and of one machine's
//! row ([`MachineRow`], also `GET /api/v1/machines/{id}`'s): the reason for a
//! drift is carried once per reported ref, in a `refs` table keyed by the
//! ref's commit (its reported text when it did not resolve), and each
//! machine row names its entry (`reason_ref`). Machines on the same ref
//! share one reason in memory already; the document no longer repeats it
//! per machine (at 100,000 machines, 3 KB each). A document is built at the
//! edge from a [`Snapshot`] (borrowing its rows, each written as it is
//! serialized: a 100,000-machine document is never held twice) or read
//! back (its rows owned); either way it shows the same thing. It must never
//! compute anything: it writes what the sweep and `decide::prepare` made,
//! and reads back exactly that, with nothing left out.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::decide::decision::{Decision, PoolHold};
use crate::decide::planner::Plan;
use crate::decide::reason::{Reason, SharedReason};
use crate::decide::snapshot::{AppSummary, JudgedMachine, Snapshot, stale_apps};
use crate::model::{
    AppName, CommitId, MachineId, MachineState, MachineStatus, PolicyAction, PoolName, Severity,
};
use crate::observe::sweep::{StaleApp, TipReport};

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

/// The `check --output json` and `GET /api/v1/fleet` document: a sweep's
/// snapshot in its wire form and each machine's decision (`status` shows
/// them). Written from a [`Snapshot`] ([`FleetDocument::of`]) and read back
/// ([`Deserialize`]) as this same type; its JSON Schema is
/// docs/fleet.schema.json ([`fleet_schema`]).
#[derive(Clone, Debug)]
pub struct FleetDocument<'a> {
    pub tip: Cow<'a, TipReport>,
    /// on-tip ÷ started, over the whole fleet (1.0 with no started machine).
    pub coherence: f64,
    pub apps: Cow<'a, [AppSummary]>,
    pub machines: Rows<'a>,
    /// Each machine's decision in the daemon's last sweep, by machine id (a
    /// machine without one is absent; `check --output json` has none).
    pub decisions: BTreeMap<Cow<'a, MachineId>, Cow<'a, Decision>>,
    /// How old the daemon's view is (`GET /api/v1/fleet`; `check` has none).
    pub view: Option<ViewAge>,
}

/// How old a daemon's view is, judged on that daemon's own clock: when the
/// sweep it shows finished, and whether that is older than
/// `alerts.stale_after` (then the daemon says nothing about it to its
/// alert sinks either).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ViewAge {
    /// When the sweep shown finished (the daemon's clock).
    pub swept_at: chrono::DateTime<chrono::Utc>,
    /// Whole seconds from `swept_at` to the answer, on the daemon's clock
    /// (a reader's own clock may differ).
    pub age_secs: u64,
    /// The view is older than `alerts.stale_after`: the fleet may have
    /// changed since.
    pub stale: bool,
    /// Why it is stale (the last sweep's failure, or no sweep finishing);
    /// absent when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_reason: Option<String>,
}

/// A document's machine rows.
#[derive(Clone, Debug)]
pub enum Rows<'a> {
    /// A snapshot's rows, borrowed: each is made into its written form as
    /// it is serialized.
    Snapshot(&'a [JudgedMachine]),
    /// The rows of a document read back.
    Read(Vec<MachineRow>),
}

// One machine's row as the fleet document shows it (read back from one, or
// `GET /api/v1/machines/{id}`'s `machine`, with its reason inline). Its
// schema keeps the name the published machine schema gives it. (A `//`
// comment: a doc comment would become the schema's description.)
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[schemars(rename = "MachineReport")]
pub struct MachineRow {
    pub app: AppName,
    pub machine_id: MachineId,
    pub name: String,
    pub region: String,
    // Plain text in the published schema, as it was when it was a `String`.
    #[schemars(with = "String")]
    pub pool: PoolName,
    pub state: MachineState,
    pub status: MachineStatus,
    pub reported_ref: Option<String>,
    pub commit: Option<CommitId>,
    pub commits_behind: Option<u64>,
    pub commits_ahead: Option<u64>,
    pub severity: Option<Severity>,
    pub action: Option<PolicyAction>,
    /// Why a machine is unreachable or its report bad, and whether its
    /// metadata is unknown (its host is not `ok`) and where its pool and
    /// controls come from then; null otherwise.
    #[serde(default)]
    pub detail: Option<String>,
    /// Why a drifted machine (`drifted`, `unknown_ref`, `ambiguous_ref`)
    /// has its severity: the rule, its evidence, the newest missing
    /// commits. Null otherwise. Shared by every machine on the same ref.
    #[serde(default)]
    pub reason: Option<SharedReason>,
}

/// One row of a document, whichever way it was made: what every view of
/// the document reads.
#[derive(Clone, Copy, Debug)]
pub struct RowView<'a> {
    pub app: &'a AppName,
    pub machine_id: &'a MachineId,
    pub name: &'a str,
    pub region: &'a str,
    pub pool: &'a PoolName,
    pub state: &'a MachineState,
    pub status: MachineStatus,
    pub reported_ref: Option<&'a str>,
    pub commit: Option<&'a CommitId>,
    pub commits_behind: Option<u64>,
    pub commits_ahead: Option<u64>,
    pub severity: Option<Severity>,
    pub action: Option<PolicyAction>,
    pub detail: Option<&'a str>,
    pub reason: Option<&'a SharedReason>,
}

impl<'a> From<&'a JudgedMachine> for RowView<'a> {
    fn from(m: &'a JudgedMachine) -> RowView<'a> {
        RowView {
            app: &m.seen.app,
            machine_id: &m.seen.machine_id,
            name: &m.seen.name,
            region: &m.seen.region,
            pool: &m.seen.pool,
            state: &m.seen.state,
            status: m.seen.status,
            reported_ref: m.seen.reported_ref.as_deref(),
            commit: m.seen.commit.as_ref(),
            commits_behind: m.seen.commits_behind,
            commits_ahead: m.seen.commits_ahead,
            severity: m.severity(),
            action: m.action(),
            detail: m.seen.detail.as_deref(),
            reason: m.reason(),
        }
    }
}

impl<'a> From<&'a MachineRow> for RowView<'a> {
    fn from(m: &'a MachineRow) -> RowView<'a> {
        RowView {
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
            reason: m.reason.as_ref(),
        }
    }
}

impl From<RowView<'_>> for MachineRow {
    fn from(m: RowView<'_>) -> MachineRow {
        MachineRow {
            app: m.app.clone(),
            machine_id: m.machine_id.clone(),
            name: m.name.to_owned(),
            region: m.region.to_owned(),
            pool: m.pool.clone(),
            state: m.state.clone(),
            status: m.status,
            reported_ref: m.reported_ref.map(str::to_owned),
            commit: m.commit.cloned(),
            commits_behind: m.commits_behind,
            commits_ahead: m.commits_ahead,
            severity: m.severity,
            action: m.action,
            detail: m.detail.map(str::to_owned),
            reason: m.reason.cloned(),
        }
    }
}

impl Rows<'_> {
    pub fn iter(&self) -> impl Iterator<Item = RowView<'_>> {
        let (judged, read) = match self {
            Rows::Snapshot(rows) => (*rows, &[][..]),
            Rows::Read(rows) => (&[][..], rows.as_slice()),
        };
        judged
            .iter()
            .map(RowView::from)
            .chain(read.iter().map(RowView::from))
    }

    pub fn len(&self) -> usize {
        match self {
            Rows::Snapshot(rows) => rows.len(),
            Rows::Read(rows) => rows.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> FleetDocument<'a> {
    /// The document of `snapshot`, without decisions (`check`).
    pub fn of(snapshot: &'a Snapshot) -> FleetDocument<'a> {
        FleetDocument {
            tip: Cow::Borrowed(&snapshot.tip),
            coherence: snapshot.coherence.ratio,
            apps: Cow::Borrowed(&snapshot.apps),
            machines: Rows::Snapshot(&snapshot.machines),
            decisions: BTreeMap::new(),
            view: None,
        }
    }

    /// With how old the view is (the daemon's `GET /api/v1/fleet`).
    pub fn with_view(mut self, view: Option<ViewAge>) -> FleetDocument<'a> {
        self.view = view;
        self
    }

    /// With each machine's decision (the daemon's, or `plan`'s).
    pub fn with_decisions(
        mut self,
        decisions: impl IntoIterator<Item = (&'a MachineId, &'a Decision)>,
    ) -> FleetDocument<'a> {
        self.decisions = decisions
            .into_iter()
            .map(|(id, d)| (Cow::Borrowed(id), Cow::Borrowed(d)))
            .collect();
        self
    }

    /// The document of `snapshot` with `plan`'s decisions (`plan`, `demo`).
    pub fn planned(snapshot: &'a Snapshot, plan: &'a Plan) -> FleetDocument<'a> {
        FleetDocument::of(snapshot)
            .with_decisions(plan.machines.iter().map(|(id, m)| (id, &m.decision)))
    }

    pub fn rows(&self) -> impl Iterator<Item = RowView<'_>> {
        self.machines.iter()
    }

    pub fn decision(&self, machine_id: &MachineId) -> Option<&Decision> {
        self.decisions.get(machine_id).map(|d| &**d)
    }

    /// Each pool a guardrail or halt holds, by its machines' decisions.
    pub fn pool_holds(&self) -> Vec<PoolHold> {
        crate::decide::decision::pool_holds(
            self.rows()
                .map(|m| (m.app, m.pool, self.decision(m.machine_id))),
        )
    }

    /// True when every started machine reports the tip.
    pub fn is_coherent(&self) -> bool {
        self.rows()
            .all(|m| matches!(m.status, MachineStatus::OnTip | MachineStatus::NotRunning))
    }

    pub fn count(&self, app: Option<&AppName>, status: MachineStatus) -> usize {
        self.rows()
            .filter(|m| app.is_none_or(|a| m.app == a) && m.status == status)
            .count()
    }

    /// The apps the sweep could not list, with why.
    pub fn stale_apps(&self) -> impl Iterator<Item = (&AppName, &StaleApp)> {
        stale_apps(&self.apps)
    }

    /// Names of the apps the sweep could not list.
    pub fn stale_app_names(&self) -> HashSet<&str> {
        self.stale_apps().map(|(name, _)| name.as_str()).collect()
    }
}

/// The JSON Schema of [`FleetDocument`] (docs/fleet.schema.json), pretty.
pub fn fleet_schema() -> String {
    let schema = schemars::schema_for!(FleetDocument<'static>);
    serde_json::to_string_pretty(&schema).unwrap_or_default() + "\n"
}

#[derive(Serialize)]
struct DocOut<'a> {
    schema_version: u32,
    tip: &'a TipReport,
    coherence: f64,
    apps: &'a [AppSummary],
    /// Each reported ref's reason, once.
    refs: BTreeMap<&'a str, &'a Reason>,
    machines: RowsOut<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decisions: Option<&'a BTreeMap<Cow<'a, MachineId>, Cow<'a, Decision>>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    guardrails: Vec<PoolHold>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    view: Option<&'a ViewAge>,
}

/// The machine rows, each made as it is written: a 100,000-machine
/// document never holds its rows twice.
struct RowsOut<'a>(&'a Rows<'a>);

impl Serialize for RowsOut<'_> {
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
    pool: &'a PoolName,
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
fn ref_key<'a>(m: &RowView<'a>) -> Option<&'a str> {
    m.commit.map(CommitId::as_str).or(m.reported_ref)
}

/// The row of `m` as written: `reported_ref` only when it is not the whole
/// commit, `reason_ref` only when the entry is not the commit's (a judged
/// row, one with a `severity`, finds its reason under its `commit`).
fn row_out(m: RowView<'_>) -> RowOut<'_> {
    let commit = m.commit.map(CommitId::as_str);
    let reported_ref = m.reported_ref.filter(|r| Some(*r) != commit);
    let reason_ref = match (m.reason, ref_key(&m)) {
        (Some(_), Some(key)) if !(m.severity.is_some() && Some(key) == commit) => Some(key),
        _ => None,
    };
    RowOut {
        app: m.app,
        machine_id: m.machine_id,
        name: m.name,
        region: m.region,
        pool: m.pool,
        state: m.state,
        status: m.status,
        reported_ref,
        commit: m.commit,
        commits_behind: m.commits_behind,
        commits_ahead: m.commits_ahead,
        severity: m.severity,
        action: m.action,
        detail: m.detail,
        reason_ref,
    }
}

impl Serialize for FleetDocument<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut refs: BTreeMap<&str, &Reason> = BTreeMap::new();
        for m in self.rows() {
            match (m.reason, ref_key(&m)) {
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
            machines: RowsOut(&self.machines),
            decisions: (!self.decisions.is_empty()).then_some(&self.decisions),
            guardrails: self.pool_holds(),
            view: self.view.as_ref(),
        }
        .serialize(s)
    }
}

// The document as read. Its doc comment below is the published schema's
// description (docs/fleet.schema.json), kept word for word.
/// The `check --output json` and `GET /api/v1/fleet` document: the report
/// in its wire form ([`crate::report::wire`], which owns `schema_version`)
/// and each machine's decision. docs/fleet.schema.json is generated from
/// this type (a test keeps the file up to date and validates real output
/// against it); `status` reads it back.
#[derive(Deserialize, schemars::JsonSchema)]
#[schemars(title = "fleet-reconciler fleet document")]
struct DocIn {
    schema_version: u32,
    tip: TipReport,
    coherence: f64,
    apps: Vec<AppSummary>,
    #[serde(default)]
    refs: BTreeMap<String, Reason>,
    machines: Vec<RowIn>,
    /// Each machine's decision in the daemon's last sweep, by machine id
    /// (`GET /api/v1/fleet`; a machine without one is absent). `check
    /// --output json` has none: `plan --output json` gives them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    decisions: BTreeMap<MachineId, Decision>,
    /// Each pool a guardrail or a halted release holds from new claims, and
    /// until when: a summary of `decisions` (absent when none holds), so
    /// read back from them rather than from here.
    #[serde(default, rename = "guardrails")]
    #[schemars(with = "Vec<PoolHold>")]
    _guardrails: serde::de::IgnoredAny,
    /// How old the daemon's view is: `swept_at`, `age_secs`, `stale` and,
    /// when stale, `stale_reason` (`GET /api/v1/fleet`; `check` has none).
    #[serde(flatten, default)]
    view: Option<ViewAge>,
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

/// The schema of the document [`FleetDocument`] reads and writes.
impl schemars::JsonSchema for FleetDocument<'_> {
    fn schema_name() -> Cow<'static, str> {
        "FleetDocument".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        DocIn::json_schema(generator)
    }
}

impl<'de> Deserialize<'de> for FleetDocument<'_> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
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
            machines.push(MachineRow {
                app: row.app,
                machine_id: row.machine_id,
                name: row.name,
                region: row.region,
                pool: row.pool.into(),
                state: row.state,
                status: row.status,
                reported_ref,
                commit: row.commit,
                commits_behind: row.commits_behind,
                commits_ahead: row.commits_ahead,
                severity: row.severity,
                action: row.action,
                detail: row.detail,
                reason,
            });
        }
        Ok(FleetDocument {
            tip: Cow::Owned(doc.tip),
            coherence: doc.coherence,
            apps: Cow::Owned(doc.apps),
            machines: Rows::Read(machines),
            decisions: doc
                .decisions
                .into_iter()
                .map(|(id, d)| (Cow::Owned(id), Cow::Owned(d)))
                .collect(),
            view: doc.view,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::decide::reason::RuleMatch;
    use crate::decide::snapshot::{Coherence, Verdict};
    use crate::model::MissingCommit;
    use crate::observe::sweep::{ObservedMachine, SlotsView};

    fn commit(c: char) -> CommitId {
        CommitId::parse(&c.to_string().repeat(40)).unwrap()
    }

    fn verdict(severity: Severity, reason: &SharedReason) -> Verdict {
        Verdict {
            severity,
            action: PolicyAction::Observe,
            reason: reason.clone(),
        }
    }

    fn write(snapshot: &Snapshot) -> String {
        serde_json::to_string(&FleetDocument::of(snapshot)).unwrap()
    }

    fn read(text: &str) -> Vec<MachineRow> {
        let doc: FleetDocument = serde_json::from_str(text).unwrap();
        match doc.machines {
            Rows::Read(rows) => rows,
            Rows::Snapshot(_) => panic!("a document read back owns its rows"),
        }
    }

    /// `n` machines drifted on one ref, one on another, one stopped.
    fn report(n: usize) -> Snapshot {
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
            let mut m = ObservedMachine::listed("agents", &id, &id, MachineState::Started);
            m.status = MachineStatus::Drifted;
            m.commit = Some(commit(on));
            m.reported_ref = Some(on.to_string().repeat(12).into());
            JudgedMachine::new(m, Some(verdict(Severity::Low, r)))
        };
        let mut machines: Vec<JudgedMachine> = (0..n)
            .map(|i| drifted(format!("m{i}"), 'a', &shared))
            .collect();
        machines.push(drifted("x".into(), 'b', &other));
        machines.push(JudgedMachine::new(
            ObservedMachine::listed("agents", "stopped", "stopped", MachineState::Stopped),
            None,
        ));
        Snapshot {
            tip: TipReport {
                branch: "release".into(),
                commit: commit('f'),
            },
            coherence: Coherence {
                ratio: 0.0,
                ..Coherence::of(0, 0)
            },
            apps: Vec::new(),
            machines,
            slots: SlotsView::default(),
            halts: Default::default(),
            gate: Default::default(),
        }
    }

    #[test]
    fn a_reason_is_written_once_per_ref_and_reads_back_shared() {
        let text = write(&report(500));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["schema_version"], SCHEMA_VERSION);
        assert_eq!(v["refs"].as_object().unwrap().len(), 2);
        assert!(v["refs"].get("a".repeat(40)).is_some());
        // Version 3: the entry is the row's commit's, so it is not named.
        assert!(v["machines"][0].get("reason_ref").is_none());
        assert!(v["machines"][501].get("reason_ref").is_none());
        // Once, not 500 times: the subjects appear in the document once each.
        assert_eq!(text.matches("commit subject number 7\"").count(), 2);
        let back = read(&text);
        let (a, b) = (&back[0], &back[499]);
        assert!(Arc::ptr_eq(
            &a.reason.as_ref().unwrap().0,
            &b.reason.as_ref().unwrap().0
        ));
        assert_eq!(a.reason.as_ref(), report(1).machines[0].reason());
        assert_eq!(back[500].reason.as_ref().unwrap().behind, Some(3));
        assert!(back[501].reason.is_none());
    }

    #[test]
    fn a_row_leaves_out_nulls_and_what_repeats_its_commit_and_reads_back_the_same() {
        let mut r = report(1);
        // One agent reported the whole commit, one an abbreviation, and one
        // a ref that did not resolve (its reason is under what it reported).
        r.machines[0].seen.reported_ref = Some("a".repeat(40).into());
        let mut unknown = ObservedMachine::listed("agents", "u", "u", MachineState::Started);
        unknown.status = MachineStatus::UnknownRef;
        unknown.reported_ref = Some("0123abcd".into());
        unknown.detail = Some("ref is not a commit of the overlay repository".into());
        let reason = r.machines[1].reason().cloned().unwrap();
        r.machines.push(JudgedMachine::new(
            unknown,
            Some(verdict(Severity::Critical, &reason)),
        ));
        let v = serde_json::to_value(FleetDocument::of(&r)).unwrap();
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
        let back = read(&v.to_string());
        assert_eq!(back.len(), r.machines.len());
        for (a, b) in back.iter().zip(&r.machines) {
            // Read back, a row is the row that was written, field by field.
            assert_eq!(*a, MachineRow::from(RowView::from(b)), "{}", a.machine_id);
        }
    }

    #[test]
    fn a_version_2_document_with_every_field_written_reads_the_same() {
        let r = report(2);
        let mut v = serde_json::to_value(FleetDocument::of(&r)).unwrap();
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
        let back = read(&v.to_string());
        assert_eq!(back.len(), r.machines.len());
        for (a, b) in back.iter().zip(&r.machines) {
            assert_eq!(*a, MachineRow::from(RowView::from(b)), "{}", a.machine_id);
        }
    }

    #[test]
    fn a_document_of_another_version_or_naming_a_missing_ref_is_refused() {
        let mut v = serde_json::to_value(FleetDocument::of(&report(2))).unwrap();
        v["schema_version"] = 1.into();
        let e = serde_json::from_value::<FleetDocument>(v.clone()).unwrap_err();
        assert!(e.to_string().contains("schema_version 1"), "{e}");
        v["schema_version"] = SCHEMA_VERSION.into();
        v["refs"] = serde_json::json!({});
        v["machines"][0]["reason_ref"] = "a".repeat(40).into();
        let e = serde_json::from_value::<FleetDocument>(v).unwrap_err();
        assert!(e.to_string().contains("machine m0 names reason_ref"), "{e}");
    }

    /// An app's row carries its coherence figures inline, in the order the
    /// fleet document has always written them (name, machines, on_tip,
    /// coherence unless never listed, then stale), and the fleet's figure is the bare ratio:
    /// the bytes, not only the keys, read back the same.
    #[test]
    fn app_rows_write_their_figures_inline_in_the_published_order() {
        let mut r = report(0);
        r.coherence = Coherence::of(1, 4);
        r.apps = vec![
            AppSummary {
                name: "agents".into(),
                coherence: Coherence::of(1, 2),
                stale: None,
            },
            AppSummary {
                name: "b".into(),
                coherence: Coherence::of(0, 2),
                stale: Some(StaleApp {
                    error: "boom".into(),
                    kind: "status".into(),
                    last_listed_at: None,
                }),
            },
        ];
        let text = serde_json::to_string(&FleetDocument::of(&r)).unwrap();
        let apps = concat!(
            r#""coherence":0.25,"apps":["#,
            r#"{"name":"agents","machines":2,"on_tip":1,"coherence":0.5},"#,
            // Never listed: no coherence (issue 34 item 7), `stale` says why.
            r#"{"name":"b","machines":2,"on_tip":0,"#,
            r#""stale":{"error":"boom","kind":"status","last_listed_at":null}}],"#,
        );
        assert!(text.contains(apps), "{text}");
        let back: FleetDocument = serde_json::from_str(&text).unwrap();
        assert_eq!(back.apps[0].coherence, Coherence::of(1, 2));
        assert_eq!(back.coherence, 0.25);
        assert_eq!(serde_json::to_string(&back).unwrap(), text);
    }

    /// An app the sweep could not list: its entry names it and says why, a
    /// listed app's has no `stale`, and both read back as written; the
    /// decisions, present, read back too.
    #[test]
    fn stale_apps_and_decisions_read_back_as_written() {
        let mut r = report(1);
        let app = |name: &str, stale: Option<StaleApp>| AppSummary {
            name: name.into(),
            coherence: Coherence::of(0, 0),
            stale,
        };
        let stale = StaleApp {
            error: "cannot list machines of app b: boom".into(),
            kind: "status".into(),
            last_listed_at: None,
        };
        r.apps = vec![app("agents", None), app("b", Some(stale.clone()))];
        let decision = Decision::OnTip;
        let id = MachineId::from("m0");
        let doc = FleetDocument::of(&r).with_decisions([(&id, &decision)]);
        let v = serde_json::to_value(&doc).unwrap();
        assert!(v["apps"][0].get("stale").is_none());
        assert_eq!(v["apps"][1]["stale"]["kind"], "status");
        assert!(v["apps"][1]["stale"]["last_listed_at"].is_null());
        let back: FleetDocument = serde_json::from_value(v).unwrap();
        assert_eq!(back.apps[1].stale.as_ref(), Some(&stale));
        assert!(back.apps[0].stale.is_none());
        assert_eq!(back.stale_app_names(), HashSet::from(["b"]));
        assert_eq!(back.decision(&id), Some(&decision));
        // Written again, the document read back is the same bytes.
        assert_eq!(
            serde_json::to_string(&back).unwrap(),
            serde_json::to_string(&doc).unwrap()
        );
    }
}

//! Incidents: the alert set folded into what the sinks are told, the
//! planner's per-machine drift and approval alerts one incident per group
//! (`alerts.group_by`). An incident is an alert decision (its key, its
//! severity, its words), so it is made here, beside [`super::voice`] which
//! holds and freezes incidents; `report::notify` only delivers them.
//!
//! Owns what a group is (its key, built only from stable identity: app, pool,
//! severity, release tip, machine; never from message text), and the group's
//! alert: the highest severity of its members, a summary that counts and
//! names them (a bounded list, the rest counted), and details listing them.
//! Every kind not `grouped` in the kinds' table (`AlertKind::is_grouped`)
//! is passed through as a group of its own. It must
//! never read the clock, do I/O, or decide what a sink is told (that is the
//! per-sink state machine in `report::notify`, which sees only incidents).

use std::collections::{BTreeMap, BTreeSet};

use super::alerts::{Alert, AlertKind};
use super::voice::Incident;
use crate::config::GroupField;
use crate::events::DedupKey;
use crate::model::{AppName, CommitId, MachineId, Severity};

/// Machines named in a group's summary; the rest are counted.
pub const SUMMARY_MACHINES: usize = 10;
/// Machines listed in a group's `details.machine_ids`; the rest are counted.
pub const DETAIL_MACHINES: usize = 50;

/// One incident: its key, its alert (what the sinks are told) and the
/// machines in it (a change of them is news to the sinks).
#[derive(Clone, Debug, PartialEq)]
pub struct Grouped {
    pub key: DedupKey,
    pub alert: Alert,
    pub members: BTreeSet<String>,
}

/// A group is what the voice rules (`decide::voice`) hold and freeze.
impl Incident for Grouped {
    fn key(&self) -> &DedupKey {
        &self.key
    }

    fn alert(&self) -> &Alert {
        &self.alert
    }
}

/// The fields that key a group of `kind`: approvals wait for a tip, not for
/// a severity or a pool, so they are keyed by app and tip only (one incident
/// per app and tip: "N machines await approval for <tip>").
fn fields(kind: AlertKind, by: &[GroupField]) -> BTreeSet<GroupField> {
    by.iter()
        .copied()
        .filter(|f| {
            kind != AlertKind::ManualApprovalRequired
                || matches!(f, GroupField::App | GroupField::Tip | GroupField::Machine)
        })
        .collect()
}

/// The pool of a machine alert (the planner's `details.pool`).
fn pool(alert: &Alert) -> &str {
    alert.details.get("pool").map_or("*", String::as_str)
}

/// The key of the group `alert` belongs to. With `machine`, today's
/// per-machine key (app, machine, tip), so a state file written before
/// grouping lines up; `pool` and `severity` add a segment each when listed.
fn group_key(alert: &Alert, fields: &BTreeSet<GroupField>) -> DedupKey {
    let has = |f| fields.contains(&f);
    let mut key = if has(GroupField::Machine) {
        alert.dedup_key().as_str().to_owned()
    } else {
        format!(
            "fleet-reconciler/{}/{}/*/{}",
            alert.kind.trigger_name(),
            alert
                .app
                .as_ref()
                .map(AppName::as_str)
                .filter(|_| has(GroupField::App))
                .unwrap_or("*"),
            alert
                .commit
                .as_ref()
                .map(CommitId::as_str)
                .filter(|_| has(GroupField::Tip))
                .unwrap_or("*"),
        )
    };
    if has(GroupField::Pool) {
        key.push_str(&format!("/pool={}", pool(alert)));
    }
    if has(GroupField::Severity) {
        key.push_str(&format!("/severity={}", alert.severity));
    }
    DedupKey::new(key)
}

/// Groups `alerts` by `by`. One alert per key (the more severe wins when a
/// key comes twice); the result is keyed by group key.
pub fn group(alerts: &[Alert], by: &[GroupField]) -> BTreeMap<DedupKey, Grouped> {
    let mut single: BTreeMap<DedupKey, &Alert> = BTreeMap::new();
    let mut groups: BTreeMap<DedupKey, Vec<&Alert>> = BTreeMap::new();
    for alert in alerts {
        if !alert.kind.is_grouped() || alert.machine_id.is_none() {
            single
                .entry(alert.dedup_key())
                .and_modify(|a| {
                    if alert.severity > a.severity {
                        *a = alert;
                    }
                })
                .or_insert(alert);
            continue;
        }
        let key = group_key(alert, &fields(alert.kind, by));
        groups.entry(key).or_default().push(alert);
    }
    let mut out: BTreeMap<DedupKey, Grouped> = single
        .into_iter()
        .map(|(key, alert)| {
            let members = alert.machine_id.iter().map(|m| m.to_string()).collect();
            let g = Grouped {
                key: key.clone(),
                alert: alert.clone(),
                members,
            };
            (key, g)
        })
        .collect();
    for (key, members) in groups {
        let keyed_by = fields(members[0].kind, by);
        out.insert(key.clone(), group_alert(key, &members, &keyed_by));
    }
    out
}

/// The alert of one group of machine alerts (`members` is never empty).
fn group_alert(key: DedupKey, members: &[&Alert], fields: &BTreeSet<GroupField>) -> Grouped {
    let by_machine = worst_per_machine(members);
    let first = by_machine.values().next().copied().unwrap_or(members[0]);
    if fields.contains(&GroupField::Machine) {
        // A group of one machine: the alert as the planner wrote it.
        return Grouped {
            key,
            alert: first.clone(),
            members: by_machine.keys().map(|m| (*m).to_owned()).collect(),
        };
    }
    let shared = Shared::of(&by_machine);
    let summary = group_summary(first.kind, &shared, fields);
    let details = group_details(&shared, fields);
    Grouped {
        key,
        alert: Alert {
            kind: first.kind,
            app: shared.app.map(Into::into),
            machine_id: None,
            commit: shared.tip,
            severity: shared.severity,
            summary,
            details,
        },
        members: shared.ids.iter().map(|m| (*m).to_owned()).collect(),
    }
}

/// One entry per machine, its most severe alert.
fn worst_per_machine<'a>(members: &[&'a Alert]) -> BTreeMap<&'a str, &'a Alert> {
    let mut by_machine: BTreeMap<&str, &Alert> = BTreeMap::new();
    for a in members {
        let id = a.machine_id.as_ref().map_or("", MachineId::as_str);
        by_machine
            .entry(id)
            .and_modify(|b| {
                if a.severity > b.severity {
                    *b = a;
                }
            })
            .or_insert(a);
    }
    by_machine
}

/// What a group's machines (their worst alerts) have in common, and where
/// they differ, for its summary and details.
struct Shared<'a> {
    /// The machines, in order.
    ids: Vec<&'a str>,
    severity: Severity,
    apps: BTreeSet<String>,
    /// The app, when all are of one.
    app: Option<String>,
    /// The release tip, when all trail one.
    tip: Option<CommitId>,
    pools: BTreeSet<String>,
    rules: BTreeSet<String>,
}

impl<'a> Shared<'a> {
    fn of(by_machine: &BTreeMap<&'a str, &Alert>) -> Shared<'a> {
        let alerts: Vec<&Alert> = by_machine.values().copied().collect();
        let severity = alerts
            .iter()
            .map(|a| a.severity)
            .max()
            .unwrap_or(Severity::Low);
        let distinct = |get: &dyn Fn(&Alert) -> Option<String>| -> BTreeSet<String> {
            alerts.iter().filter_map(|a| get(a)).collect()
        };
        let apps = distinct(&|a| a.app.as_ref().map(AppName::to_string));
        let tips: BTreeSet<&CommitId> = alerts.iter().filter_map(|a| a.commit.as_ref()).collect();
        let pools = distinct(&|a| a.details.get("pool").cloned());
        let rules = distinct(&|a| a.details.get("severity_rule").cloned());
        let ids: Vec<&str> = by_machine.keys().copied().collect();
        let app = only(&apps);
        let tip = (tips.len() == 1)
            .then(|| tips.first().map(|t| (*t).clone()))
            .flatten();
        Shared {
            ids,
            severity,
            apps,
            app,
            tip,
            pools,
            rules,
        }
    }
}

/// The one value of `set`, when it has exactly one.
fn only(set: &BTreeSet<String>) -> Option<String> {
    (set.len() == 1)
        .then(|| set.iter().next().cloned())
        .flatten()
}

/// A group's summary: how many machines, where, and what they trail or await.
fn group_summary(kind: AlertKind, shared: &Shared, fields: &BTreeSet<GroupField>) -> String {
    let Shared {
        ids,
        severity,
        apps,
        app,
        tip,
        pools,
        ..
    } = shared;
    let n = ids.len();
    let listed = bounded(ids, SUMMARY_MACHINES);
    let (machines, trail, wait) = if n == 1 {
        ("machine", "trails", "awaits")
    } else {
        ("machines", "trail", "await")
    };
    let scope = match app {
        Some(app) => format!(" of {app}"),
        None => format!(" in {} apps", apps.len()),
    };
    let pool_scope = match only(pools) {
        Some(p) if fields.contains(&GroupField::Pool) => format!(" (pool {p})"),
        _ => String::new(),
    };
    let target = match tip {
        Some(t) => format!("release tip {}", short(t.as_str())),
        None => "the release tip".to_owned(),
    };
    match kind {
        AlertKind::ManualApprovalRequired => format!(
            "{n} {machines}{scope}{pool_scope} {wait} approval for {target}: {listed}. `fleet-reconciler approve <machine>` (or --when-idle) each"
        ),
        _ => format!(
            "{n} {machines}{scope}{pool_scope} {trail} {target} (severity {severity}): {listed}"
        ),
    }
}

/// A group's details: its machines, how it is grouped, and the pools,
/// severity rules and apps of its members.
fn group_details(shared: &Shared, fields: &BTreeSet<GroupField>) -> BTreeMap<String, String> {
    let mut details = BTreeMap::from([
        ("machines".to_owned(), shared.ids.len().to_string()),
        (
            "machine_ids".to_owned(),
            bounded(&shared.ids, DETAIL_MACHINES),
        ),
        (
            "group_by".to_owned(),
            fields
                .iter()
                .map(|f| f.as_str())
                .collect::<Vec<_>>()
                .join(","),
        ),
    ]);
    let join = |set: &BTreeSet<String>| set.iter().cloned().collect::<Vec<_>>().join(", ");
    if !shared.pools.is_empty() {
        details.insert("pool".to_owned(), join(&shared.pools));
    }
    if !shared.rules.is_empty() {
        details.insert("severity_rule".to_owned(), join(&shared.rules));
    }
    if shared.apps.len() > 1 {
        details.insert("apps".to_owned(), join(&shared.apps));
    }
    details
}

/// `a, b, c and 7 more` (at most `max` named).
fn bounded(ids: &[&str], max: usize) -> String {
    let shown = ids.iter().take(max).copied().collect::<Vec<_>>().join(", ");
    match ids.len().saturating_sub(max) {
        0 => shown,
        rest => format!("{shown} and {rest} more"),
    }
}

/// The first 7 characters of a commit id.
fn short(commit: &str) -> &str {
    commit.get(..7).unwrap_or(commit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drift(app: &str, machine: &str, pool: &str, sev: Severity) -> Alert {
        Alert {
            kind: AlertKind::Drift,
            app: Some(app.into()),
            machine_id: Some(machine.into()),
            commit: crate::model::CommitId::parse(&"0123456789abcdef".repeat(3)[..40]),
            severity: sev,
            summary: format!("{machine} is behind"),
            details: BTreeMap::from([("pool".to_owned(), pool.to_owned())]),
        }
    }

    #[test]
    fn keys_are_built_from_the_listed_fields_only() {
        let a = drift("agents", "m1", "p", Severity::High);
        let by = [GroupField::App, GroupField::Tip, GroupField::Severity];
        assert_eq!(
            group_key(&a, &fields(a.kind, &by)).as_str(),
            "fleet-reconciler/drift_detected/agents/*/0123456789abcdef0123456789abcdef01234567/severity=high"
        );
        assert_eq!(
            group_key(&a, &fields(a.kind, &[GroupField::Machine])),
            a.dedup_key(),
            "per machine: today's key"
        );
        let mut b = a.clone();
        b.summary = "changed text".into();
        b.details.insert("commits_behind".into(), "9".into());
        assert_eq!(
            group_key(&a, &fields(a.kind, &by)),
            group_key(&b, &fields(b.kind, &by))
        );
        let mut approval = a.clone();
        approval.kind = AlertKind::ManualApprovalRequired;
        assert_eq!(
            group_key(
                &approval,
                &fields(
                    approval.kind,
                    &[
                        GroupField::App,
                        GroupField::Pool,
                        GroupField::Severity,
                        GroupField::Tip
                    ]
                )
            )
            .as_str(),
            "fleet-reconciler/manual_approval_required/agents/*/0123456789abcdef0123456789abcdef01234567"
        );
    }

    #[test]
    fn a_group_counts_and_names_a_bounded_list() {
        let alerts: Vec<Alert> = (0..13)
            .map(|i| drift("agents", &format!("m{i:02}"), "p", Severity::Medium))
            .collect();
        let groups = group(&alerts, &[GroupField::App, GroupField::Tip]);
        assert_eq!(groups.len(), 1);
        let g = groups.values().next().unwrap();
        assert_eq!(g.members.len(), 13);
        assert!(
            g.alert.summary.starts_with(
                "13 machines of agents trail release tip 0123456 (severity medium): m00, m01"
            ),
            "{}",
            g.alert.summary
        );
        assert!(
            g.alert.summary.ends_with("m09 and 3 more"),
            "{}",
            g.alert.summary
        );
        assert_eq!(g.alert.details["machines"], "13");
        assert_eq!(g.alert.machine_id, None);
    }
}

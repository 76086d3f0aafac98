//! Severity and policy: drift → severity (ordered rules) → the pool's action.
//!
//! Pure functions over the config's rules (docs/design.md §5.2): the first rule whose
//! conditions all hold gives the level. It must never do I/O; it sees only
//! what the overlay module measured. It tells the overlay what to look for
//! ([`signals`]: one signal per rule's trailer list and per rule's path
//! globs) and reads the answers back by the same numbering. It also says
//! why ([`explain`]): the rule that matched, by its index and text, its
//! evidence and the newest missing commits, as a typed [`Reason`] the
//! report carries on every drifted row (docs/design.md §5.2).
//!
//! [`judge`] is where a sweep's observation gets its verdicts (the first
//! part of `decide::prepare`): the sweep measures drift and decides
//! nothing; each drifted row's severity, reason and action are given here.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::SeverityRule;
use crate::decide::policy::Policy;
use crate::decide::reason::{Evidence, Reason, RuleMatch, SharedReason, Unresolved};
use crate::decide::snapshot::{Snapshot, Verdict};
use crate::model::{CommitId, PolicyAction, PoolName, Severity};
use crate::observe::overlay::{DriftRange, RefAnalysis, SignalId, Signals};
use crate::observe::sweep::{Observation, ObservedMachine};

/// What is known about a drift when it is classified.
#[derive(Clone, Copy, Debug)]
pub enum Drift<'a> {
    /// The reported ref did not resolve to one commit.
    Unresolved(Unresolved),
    /// The reported commit and what `tip ^commit` contains.
    Range(&'a DriftRange),
}

/// The level a drift gets, and which rule gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Classification {
    pub severity: Severity,
    /// The matching rule's index in the configured list; `None` when no
    /// rule matched and the default level applies (`low` for a resolved
    /// range, `critical` for an unresolved ref).
    pub rule: Option<usize>,
}

/// The signals a rule's range conditions are answered by: its trailer keys
/// and its path globs, each `None` when the rule has no such condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RuleSignals {
    trailers: Option<SignalId>,
    paths: Option<SignalId>,
}

/// Numbers the rules' conditions in rule order, trailers before paths: the
/// one numbering both [`signals`] and [`classify`] use.
fn rule_signals(rules: &[SeverityRule]) -> impl Iterator<Item = (&SeverityRule, RuleSignals)> {
    let mut next = 0;
    let mut take = move |present: bool| {
        present.then(|| {
            next += 1;
            SignalId(next - 1)
        })
    };
    rules.iter().map(move |rule| {
        let trailers = take(!rule.trailers.is_empty());
        let paths = take(rule.path_set.is_some());
        (rule, RuleSignals { trailers, paths })
    })
}

/// What the overlay must report for each drift range so that [`classify`]
/// can evaluate `rules`. No path signal, hence no tree diff, unless some
/// rule has `paths`.
pub fn signals(rules: &[SeverityRule]) -> Signals {
    let mut out = Signals::new();
    for (rule, ids) in rule_signals(rules) {
        if ids.trailers.is_some() {
            let id = out.trailers(&rule.trailers);
            debug_assert_eq!(Some(id), ids.trailers);
        }
        if let (Some(set), Some(_)) = (&rule.path_set, ids.paths) {
            let id = out.paths(&rule.paths, set.clone());
            debug_assert_eq!(Some(id), ids.paths);
        }
    }
    out
}

/// First matching rule wins. With no match, a resolved drift is `low`; an
/// unresolved ref is `critical`, because we cannot tell what it is missing.
/// A range must come from an analysis with [`signals`]`(rules)`.
pub fn classify(rules: &[SeverityRule], drift: Drift<'_>) -> Classification {
    match rule_signals(rules)
        .enumerate()
        .find(|(_, (rule, ids))| matches(rule, *ids, drift))
    {
        Some((index, (rule, _))) => Classification {
            severity: rule.level,
            rule: Some(index),
        },
        None => Classification {
            severity: default_level(drift),
            rule: None,
        },
    }
}

fn default_level(drift: Drift<'_>) -> Severity {
    match drift {
        Drift::Unresolved(_) => Severity::Critical,
        Drift::Range(_) => Severity::Low,
    }
}

/// The reason for `classification` (which [`classify`]`(rules, drift)`
/// returned): the rule, its evidence from the range, the newest missing
/// commits. Pure; everything it shows the overlay measured.
pub fn explain(rules: &[SeverityRule], drift: Drift<'_>, classification: Classification) -> Reason {
    let matched = classification.rule.and_then(|index| {
        rule_signals(rules)
            .nth(index)
            .map(|(rule, ids)| (index, rule, ids))
    });
    let rule = match matched {
        Some((index, rule, _)) => RuleMatch::Matched {
            index,
            text: rule_text(rule),
        },
        None => RuleMatch::NoMatch {
            level: default_level(drift),
        },
    };
    let mut evidence = Vec::new();
    match drift {
        Drift::Unresolved(resolution) => {
            evidence.push(Evidence::UnresolvedRef { resolution });
            Reason {
                rule,
                evidence,
                behind: None,
                missing: Vec::new(),
                evidence_partial: false,
            }
        }
        Drift::Range(range) => {
            if let Some((_, rule, ids)) = matched {
                if let Some(id) = ids.trailers
                    && let Some((commit, subject, matched)) = carrier(range, id)
                {
                    evidence.push(Evidence::Trailer {
                        commit,
                        subject,
                        trailer: matched,
                    });
                }
                if let Some(id) = ids.paths
                    && let Some((commit, subject, matched)) = carrier(range, id)
                {
                    evidence.push(Evidence::Path {
                        commit,
                        subject,
                        path: matched,
                    });
                }
                if let Some(min) = rule.min_commits_behind {
                    evidence.push(Evidence::CommitsBehind {
                        behind: range.behind,
                        min_commits_behind: min,
                    });
                }
            }
            Reason {
                rule,
                evidence,
                behind: Some(range.behind),
                missing: range.newest.clone(),
                evidence_partial: range.paths_incomplete,
            }
        }
    }
}

/// The evidence commit of `signal` in `range`, its subject and what matched.
fn carrier(range: &DriftRange, signal: SignalId) -> Option<(CommitId, String, Option<String>)> {
    let commit = range.evidence.get(&signal)?;
    let detail = range.evidence_detail.get(&signal);
    Some((
        commit.clone(),
        detail.map(|d| d.subject.clone()).unwrap_or_default(),
        detail.and_then(|d| d.matched.clone()),
    ))
}

/// A rule as its `[[severity]]` table would write it, keys in the order
/// the README documents them: `level = "critical", trailers = ["security"]`.
/// Trailer keys appear normalised (lowercase), as they are compared.
pub fn rule_text(rule: &SeverityRule) -> String {
    let quote = |s: &str| toml::Value::String(s.to_owned()).to_string();
    let list = |items: &[String]| {
        let quoted: Vec<String> = items.iter().map(|s| quote(s)).collect();
        format!("[{}]", quoted.join(", "))
    };
    let mut parts = vec![format!("level = {}", quote(rule.level.as_str()))];
    if rule.unknown_ref {
        parts.push("unknown_ref = true".to_owned());
    }
    if !rule.trailers.is_empty() {
        parts.push(format!("trailers = {}", list(&rule.trailers)));
    }
    if !rule.paths.is_empty() {
        parts.push(format!("paths = {}", list(&rule.paths)));
    }
    if let Some(n) = rule.min_commits_behind {
        parts.push(format!("min_commits_behind = {n}"));
    }
    parts.join(", ")
}

fn matches(rule: &SeverityRule, ids: RuleSignals, drift: Drift<'_>) -> bool {
    match drift {
        Drift::Unresolved(_) => rule.unknown_ref,
        Drift::Range(range) => {
            if rule.unknown_ref {
                return false;
            }
            // Some commit in the range has one of the rule's trailer keys;
            // some commit's own change touches a path the rule's globs match.
            let trailers_ok = ids.trailers.is_none_or(|id| range.carries(id));
            let paths_ok = ids.paths.is_none_or(|id| range.carries(id));
            let behind_ok = rule.min_commits_behind.is_none_or(|n| range.behind >= n);
            trailers_ok && paths_ok && behind_ok
        }
    }
}

/// Decides, for each machine of a sweep's observation whose ref is not the
/// tip, its [`Verdict`]: its severity (the first matching rule), why (the
/// [`Reason`], shared by every machine on the same ref) and its pool's
/// action. A drift whose path rules are not yet checked on every missing
/// commit is only observed: nothing acts on a partial answer, later sweeps
/// finish it. The rows come back in the same order, with coherence figures.
pub fn judge(policy: &Policy, observation: Observation) -> Snapshot {
    let mut verdicts = Verdicts::default();
    Snapshot::judged(observation, |m| verdicts.of(policy, m))
}

/// Verdicts of one sweep: classified and explained once per distinct
/// reported ref, and one shared verdict per ref and pool, so a fleet on a
/// few refs holds a few of each.
#[derive(Default)]
struct Verdicts {
    by_ref: HashMap<String, ByRef>,
}

struct ByRef {
    class: Classification,
    reason: SharedReason,
    by_pool: HashMap<PoolName, Arc<Verdict>>,
}

impl Verdicts {
    fn of(&mut self, policy: &Policy, m: &ObservedMachine) -> Option<Arc<Verdict>> {
        let (drift, partial) = match &m.inputs.analysis {
            Some(RefAnalysis::Drifted { range, .. }) => {
                (Drift::Range(range), range.paths_incomplete)
            }
            Some(RefAnalysis::Ambiguous) => (Drift::Unresolved(Unresolved::Ambiguous), false),
            Some(RefAnalysis::Unknown) => (Drift::Unresolved(Unresolved::Unknown), false),
            Some(RefAnalysis::OnTip { .. }) | None => return None,
        };
        let reported_ref = m.reported_ref.as_deref().unwrap_or_default();
        let rules = &policy.severity;
        // Looked up before inserting: no key is copied for a known ref.
        if !self.by_ref.contains_key(reported_ref) {
            let class = classify(rules, drift);
            let by_ref = ByRef {
                class,
                reason: SharedReason(Arc::new(explain(rules, drift, class))),
                by_pool: HashMap::new(),
            };
            self.by_ref.insert(reported_ref.to_owned(), by_ref);
        }
        let entry = self.by_ref.get_mut(reported_ref)?;
        if let Some(verdict) = entry.by_pool.get(&m.pool) {
            return Some(Arc::clone(verdict));
        }
        let severity = entry.class.severity;
        let verdict = Arc::new(Verdict {
            severity,
            action: if partial {
                PolicyAction::Observe
            } else {
                policy.action(&m.pool, severity)
            },
            reason: entry.reason.clone(),
        });
        entry.by_pool.insert(m.pool.clone(), Arc::clone(&verdict));
        Some(verdict)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::config::default_severity_rules;
    use crate::model::{CommitId, MachineId};

    /// The range the overlay reports for commits that touched `paths` and
    /// carry `trailers`: each rule's signal is raised exactly when the rule's
    /// condition holds on those paths and keys.
    fn range(rules: &[SeverityRule], behind: u64, paths: &[&str], trailers: &[&str]) -> DriftRange {
        let evidence = CommitId::parse(&"e".repeat(40)).expect("commit id");
        let mut range = DriftRange {
            behind,
            ..DriftRange::default()
        };
        for (rule, ids) in rule_signals(rules) {
            if let Some(id) = ids.trailers {
                let normalized = trailers.iter().map(|t| t.trim().to_ascii_lowercase());
                if normalized.into_iter().any(|t| rule.trailers.contains(&t)) {
                    range.evidence.insert(id, evidence.clone());
                }
            }
            if let (Some(id), Some(set)) = (ids.paths, &rule.path_set)
                && paths.iter().any(|p| set.is_match(p))
            {
                range.evidence.insert(id, evidence.clone());
            }
        }
        range
    }

    #[test]
    fn signals_are_numbered_as_classify_reads_them() {
        let rules = default_severity_rules();
        let signals = signals(&rules);
        let ids: Vec<RuleSignals> = rule_signals(&rules).map(|(_, ids)| ids).collect();
        let used = ids
            .iter()
            .flat_map(|ids| [ids.trailers, ids.paths])
            .flatten()
            .count();
        assert_eq!(signals.len(), used);
        assert!(signals.has_paths());
        // Count rules alone ask nothing of the commits: no diffs, no trailers.
        let counts: Vec<SeverityRule> = rules
            .iter()
            .filter(|r| r.trailers.is_empty() && r.path_set.is_none())
            .cloned()
            .collect();
        assert!(!counts.is_empty());
        assert!(super::signals(&counts).is_empty());
    }

    #[test]
    fn default_rules_follow_the_design_table() {
        let rules = default_severity_rules();
        let c = |r: &DriftRange| classify(&rules, Drift::Range(r)).severity;
        let range =
            |behind, paths: &[&str], trailers: &[&str]| range(&rules, behind, paths, trailers);
        assert_eq!(
            classify(&rules, Drift::Unresolved(Unresolved::Unknown)).severity,
            Severity::Critical
        );
        assert_eq!(
            c(&range(1, &["skills/a.md"], &["Security"])),
            Severity::Critical
        );
        assert_eq!(
            c(&range(1, &["skills/a.md"], &["security"])),
            Severity::Critical
        );
        assert_eq!(
            c(&range(1, &["policies/tools/deny.yaml"], &[])),
            Severity::High
        );
        assert_eq!(c(&range(1, &["guards/x"], &[])), Severity::High);
        assert_eq!(c(&range(20, &["skills/a.md"], &[])), Severity::High);
        assert_eq!(c(&range(19, &["skills/a.md"], &[])), Severity::Medium);
        assert_eq!(c(&range(5, &[], &[])), Severity::Medium);
        assert_eq!(
            c(&range(4, &["skills/a.md"], &["Signed-off-by"])),
            Severity::Low
        );
        // `policies/**` is anchored: a nested `policies` dir elsewhere is not it.
        assert_eq!(
            c(&range(1, &["docs/policies/readme.md"], &[])),
            Severity::Low
        );
    }

    #[test]
    fn first_match_wins_and_conditions_combine() {
        let cfg = crate::config::test_config(
            r#"
[[severity]]
level = "medium"
paths = ["skills/*.md"]
min_commits_behind = 3
[[severity]]
level = "high"
paths = ["skills/**"]
"#,
        );
        let c = |r: &DriftRange| classify(&cfg.severity, Drift::Range(r)).severity;
        let range = |behind, paths: &[&str], trailers: &[&str]| {
            range(&cfg.severity, behind, paths, trailers)
        };
        assert_eq!(c(&range(3, &["skills/a.md"], &[])), Severity::Medium);
        // Both conditions of the first rule must hold.
        assert_eq!(c(&range(2, &["skills/a.md"], &[])), Severity::High);
        // `*` does not cross a directory; `**` does.
        assert_eq!(c(&range(3, &["skills/deep/a.md"], &[])), Severity::High);
        assert_eq!(c(&range(9, &["other"], &[])), Severity::Low);
        // No rule for unknown refs: fail closed.
        assert_eq!(
            classify(&cfg.severity, Drift::Unresolved(Unresolved::Ambiguous)),
            Classification {
                severity: Severity::Critical,
                rule: None
            }
        );
    }

    /// The classification of `r` under `rules`, and its reason.
    fn explained(rules: &[SeverityRule], r: &DriftRange) -> (Classification, Reason) {
        let class = classify(rules, Drift::Range(r));
        (class, explain(rules, Drift::Range(r), class))
    }

    /// The commit [`with_detail`] names as the newest missing one.
    fn detail_commit() -> CommitId {
        CommitId::parse(&"e".repeat(40)).expect("commit id")
    }

    /// `r` with every signal's evidence matching `matched` in a commit
    /// "Fix it", the newest missing one being [`detail_commit`].
    fn with_detail(mut r: DriftRange, matched: &str) -> DriftRange {
        use crate::model::MissingCommit;
        use crate::observe::overlay::EvidenceDetail;
        for id in r.evidence.keys().copied().collect::<Vec<_>>() {
            r.evidence_detail.insert(
                id,
                EvidenceDetail {
                    subject: "Fix it".into(),
                    matched: Some(matched.into()),
                },
            );
        }
        r.newest = vec![Arc::new(MissingCommit {
            commit: detail_commit(),
            subject: "Fix it".into(),
        })];
        r
    }

    #[test]
    fn reasons_name_the_rule_and_the_evidence_of_a_trailer() {
        let rules = default_severity_rules();
        let (class, reason) = explained(
            &rules,
            &with_detail(range(&rules, 30, &[], &["Security"]), "Security"),
        );
        assert_eq!(class.rule, Some(1));
        assert_eq!(
            reason.rule,
            RuleMatch::Matched {
                index: 1,
                text: r#"level = "critical", trailers = ["security"]"#.into()
            }
        );
        assert_eq!(
            reason.evidence,
            [Evidence::Trailer {
                commit: detail_commit(),
                subject: "Fix it".into(),
                trailer: Some("Security".into())
            }]
        );
        assert_eq!((reason.behind, reason.missing.len()), (Some(30), 1));
    }

    #[test]
    fn reasons_name_the_rule_and_the_evidence_of_a_path() {
        let rules = default_severity_rules();
        let (_, reason) = explained(
            &rules,
            &with_detail(range(&rules, 2, &["guards/x.yaml"], &[]), "guards/x.yaml"),
        );
        assert_eq!(
            reason.rule,
            RuleMatch::Matched {
                index: 2,
                text: r#"level = "high", paths = ["policies/**", "guards/**"]"#.into()
            }
        );
        assert!(matches!(
            &reason.evidence[..],
            [Evidence::Path { path: Some(p), .. }] if p == "guards/x.yaml"
        ));
    }

    #[test]
    fn reasons_name_the_rule_and_the_evidence_of_commits_behind() {
        let rules = default_severity_rules();
        let (class, reason) = explained(&rules, &range(&rules, 20, &[], &[]));
        assert_eq!(
            class,
            Classification {
                severity: Severity::High,
                rule: Some(3)
            }
        );
        assert_eq!(
            reason.evidence,
            [Evidence::CommitsBehind {
                behind: 20,
                min_commits_behind: 20
            }]
        );
    }

    #[test]
    fn reasons_name_no_rule_and_no_evidence_when_none_matches() {
        let rules = default_severity_rules();
        let (class, reason) = explained(&rules, &range(&rules, 4, &["skills/a.md"], &[]));
        assert_eq!(
            class,
            Classification {
                severity: Severity::Low,
                rule: None
            }
        );
        assert_eq!(
            reason.rule,
            RuleMatch::NoMatch {
                level: Severity::Low
            }
        );
        assert!(reason.evidence.is_empty());

        // A partial answer says so.
        let mut partial = range(&rules, 4, &[], &[]);
        partial.paths_incomplete = true;
        assert!(explained(&rules, &partial).1.evidence_partial);
    }

    #[test]
    fn reasons_name_the_rule_and_the_evidence_of_an_unresolved_ref() {
        let rules = default_severity_rules();
        let drift = Drift::Unresolved(Unresolved::Ambiguous);
        let class = classify(&rules, drift);
        let reason = explain(&rules, drift, class);
        assert_eq!(class.rule, Some(0));
        assert_eq!(
            reason.evidence,
            [Evidence::UnresolvedRef {
                resolution: Unresolved::Ambiguous
            }]
        );
        assert_eq!((reason.behind, reason.missing.len()), (None, 0));
        // The JSON is tagged and reads back.
        let json = serde_json::to_value(&reason).expect("json");
        assert_eq!(json["rule"]["kind"], "matched");
        assert_eq!(json["evidence"][0]["kind"], "unresolved_ref");
        assert_eq!(json["evidence"][0]["resolution"], "ambiguous");
        let back: Reason = serde_json::from_value(json).expect("reads back");
        assert_eq!(back, reason);
    }

    #[test]
    fn rule_text_writes_every_condition_as_toml() {
        let cfg = crate::config::test_config(
            r#"
[[severity]]
level = "medium"
trailers = ["Reviewed-By", "Security"]
paths = ["skills/*.md"]
min_commits_behind = 3
"#,
        );
        assert_eq!(
            rule_text(&cfg.severity[0]),
            r#"level = "medium", trailers = ["reviewed-by", "security"], paths = ["skills/*.md"], min_commits_behind = 3"#
        );
    }

    /// `judge` gives a drifted row the first matching rule's level, one
    /// reason shared by every row on the same ref, and the pool's action;
    /// a range whose path rules are unfinished is only observed; on-tip and
    /// unprobed rows get nothing.
    #[test]
    fn judge_decides_severity_reason_and_action_per_ref() {
        use crate::model::{MachineState, MachineStatus};
        use crate::observe::sweep::{MachineInputs, ObservedMachine, observation};
        let config = Config::parse(
            std::path::Path::new("t.toml"),
            "[overlay]\nrepo = \"/r\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n\
             [[apps]]\nname = \"a\"\n[pools.default.actions]\nlow = \"restart\"\n",
        )
        .expect("config");
        let commit = CommitId::parse(&"c".repeat(40)).expect("commit id");
        let analysed = |analysis: RefAnalysis| MachineInputs {
            analysis: Some(analysis),
            ..MachineInputs::default()
        };
        let drifted = |id: &str, r: &str, range: DriftRange| ObservedMachine {
            status: MachineStatus::Drifted,
            reported_ref: Some(r.into()),
            inputs: analysed(RefAnalysis::Drifted {
                commit: commit.clone(),
                range: Arc::new(range),
            }),
            ..ObservedMachine::listed("a", id, id, MachineState::Started)
        };
        let small = range(&config.severity, 1, &[], &[]);
        let partial = DriftRange {
            paths_incomplete: true,
            ..small.clone()
        };
        let machines = vec![
            drifted("m1", "r1", small.clone()),
            drifted("m2", "r1", small),
            drifted("m3", "r2", partial),
            ObservedMachine {
                status: MachineStatus::UnknownRef,
                reported_ref: Some("nope".into()),
                inputs: analysed(RefAnalysis::Unknown),
                ..ObservedMachine::listed("a", "m4", "m4", MachineState::Started)
            },
            ObservedMachine {
                status: MachineStatus::OnTip,
                inputs: analysed(RefAnalysis::OnTip {
                    commit: commit.clone(),
                }),
                ..ObservedMachine::listed("a", "m5", "m5", MachineState::Started)
            },
            ObservedMachine::listed("a", "m6", "m6", MachineState::Started),
        ];
        let tip = crate::observe::overlay::Tip {
            branch: "release".into(),
            commit: commit.clone(),
        };
        let policy = Policy::from_config(&config);
        let report = judge(&policy, observation(&config, &tip, machines));
        let m = |id: &str| {
            report
                .machines
                .iter()
                .find(|m| m.seen.machine_id == MachineId::from(id))
                .expect("machine")
        };
        let low = classify(
            &config.severity,
            Drift::Range(&range(&config.severity, 1, &[], &[])),
        );
        assert_eq!(m("m1").severity(), Some(low.severity));
        assert_eq!(
            m("m1").action(),
            Some(policy.action(&"default".into(), low.severity))
        );
        assert_ne!(m("m1").action(), Some(PolicyAction::Observe));
        let (r1, r2) = (m("m1").reason(), m("m2").reason());
        assert!(Arc::ptr_eq(&r1.expect("reason").0, &r2.expect("reason").0));
        assert_eq!(m("m3").severity(), Some(low.severity));
        assert_eq!(m("m3").action(), Some(PolicyAction::Observe));
        let unknown = classify(&config.severity, Drift::Unresolved(Unresolved::Unknown));
        assert_eq!(m("m4").severity(), Some(unknown.severity));
        assert!(m("m4").reason().is_some());
        // One verdict per ref and pool, shared.
        let (v1, v2) = (m("m1").verdict.as_ref(), m("m2").verdict.as_ref());
        assert!(Arc::ptr_eq(v1.expect("verdict"), v2.expect("verdict")));
        for id in ["m5", "m6"] {
            assert_eq!((m(id).severity(), m(id).action()), (None, None), "{id}");
            assert!(m(id).reason().is_none(), "{id}");
        }
    }
}

//! Severity and policy: drift → severity (ordered rules) → the pool's action.
//!
//! Pure functions over the config's rules (docs/design.md §5.2): the first rule whose
//! conditions all hold gives the level. It must never do I/O; it sees only
//! what the overlay module measured. It tells the overlay what to look for
//! ([`signals`]: one signal per rule's trailer list and per rule's path
//! globs) and reads the answers back by the same numbering.

use crate::config::{Config, DEFAULT_POOL, SeverityRule};
use crate::model::{PolicyAction, Severity};
use crate::overlay::{DriftRange, SignalId, Signals};

/// What is known about a drift when it is classified.
#[derive(Clone, Copy, Debug)]
pub enum Drift<'a> {
    /// The reported ref did not resolve to one commit (unknown or ambiguous).
    Unresolved,
    /// The reported commit and what `tip ^commit` contains.
    Range(&'a DriftRange),
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
pub fn classify(rules: &[SeverityRule], drift: Drift<'_>) -> Severity {
    rule_signals(rules)
        .find(|(rule, ids)| matches(rule, *ids, drift))
        .map(|(rule, _)| rule.level)
        .unwrap_or(match drift {
            Drift::Unresolved => Severity::Critical,
            Drift::Range(_) => Severity::Low,
        })
}

fn matches(rule: &SeverityRule, ids: RuleSignals, drift: Drift<'_>) -> bool {
    match drift {
        Drift::Unresolved => rule.unknown_ref,
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

/// The pool a machine belongs to: the value of the app's pool key, or `default`.
pub fn pool_of<'a>(pool_key: Option<&str>, metadata: impl Fn(&str) -> Option<&'a str>) -> String {
    pool_key
        .and_then(metadata)
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .unwrap_or(DEFAULT_POOL)
        .to_string()
}

/// The action the pool's policy maps a severity to.
pub fn action_for(config: &Config, pool: &str, severity: Severity) -> PolicyAction {
    config.pool(pool).actions.for_severity(severity)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::default_severity_rules;
    use crate::model::CommitId;

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
            if let (Some(id), Some(set)) = (ids.paths, &rule.path_set) {
                if paths.iter().any(|p| set.is_match(p)) {
                    range.evidence.insert(id, evidence.clone());
                }
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
        let c = |r: &DriftRange| classify(&rules, Drift::Range(r));
        let range =
            |behind, paths: &[&str], trailers: &[&str]| range(&rules, behind, paths, trailers);
        assert_eq!(classify(&rules, Drift::Unresolved), Severity::Critical);
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
        let text = r#"
[overlay]
repo = "/r"
branch = "release"
mirror_dir = "/m"
[[apps]]
name = "a"
[[severity]]
level = "medium"
paths = ["skills/*.md"]
min_commits_behind = 3
[[severity]]
level = "high"
paths = ["skills/**"]
"#;
        let cfg = Config::parse(std::path::Path::new("t.toml"), text).unwrap();
        let c = |r: &DriftRange| classify(&cfg.severity, Drift::Range(r));
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
            classify(&cfg.severity, Drift::Unresolved),
            Severity::Critical
        );
    }

    #[test]
    fn pools_come_from_metadata_or_default() {
        let md = |k: &str| {
            if k == "pool" {
                Some("dispatch")
            } else {
                Some(" ")
            }
        };
        assert_eq!(pool_of(Some("pool"), md), "dispatch");
        assert_eq!(pool_of(Some("other"), md), "default");
        assert_eq!(pool_of(None, md), "default");
    }
}

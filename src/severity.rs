//! Severity and policy: drift → severity (ordered rules) → the pool's action.
//!
//! Pure functions over the config's rules (DESIGN §5): the first rule whose
//! conditions all hold gives the level. It must never do I/O; it sees only
//! what the overlay module measured.

use crate::config::{Config, DEFAULT_POOL, SeverityRule};
use crate::model::{PolicyAction, Severity};
use crate::overlay::DriftRange;

/// What is known about a drift when it is classified.
#[derive(Clone, Copy, Debug)]
pub enum Drift<'a> {
    /// The reported ref did not resolve to one commit (unknown or ambiguous).
    Unresolved,
    /// The reported commit and what `tip ^commit` contains.
    Range(&'a DriftRange),
}

/// First matching rule wins. With no match, a resolved drift is `low`; an
/// unresolved ref is `critical`, because we cannot tell what it is missing.
pub fn classify(rules: &[SeverityRule], drift: Drift<'_>) -> Severity {
    rules
        .iter()
        .find(|rule| matches(rule, drift))
        .map(|rule| rule.level)
        .unwrap_or(match drift {
            Drift::Unresolved => Severity::Critical,
            Drift::Range(_) => Severity::Low,
        })
}

fn matches(rule: &SeverityRule, drift: Drift<'_>) -> bool {
    match drift {
        Drift::Unresolved => rule.unknown_ref,
        Drift::Range(range) => {
            if rule.unknown_ref {
                return false;
            }
            let trailers_ok = rule.trailers.is_empty()
                || range
                    .trailers
                    .iter()
                    .any(|t| rule.trailers.contains(&t.trim().to_ascii_lowercase()));
            let paths_ok = match &rule.path_set {
                None => true,
                Some(set) => range.paths.iter().any(|p| set.is_match(p)),
            };
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
    use std::collections::BTreeSet;

    fn range(behind: u64, paths: &[&str], trailers: &[&str]) -> DriftRange {
        DriftRange {
            behind,
            ahead: 0,
            paths: paths.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>(),
            trailers: trailers.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn default_rules_follow_the_design_table() {
        let rules = default_severity_rules();
        let c = |r: &DriftRange| classify(&rules, Drift::Range(r));
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

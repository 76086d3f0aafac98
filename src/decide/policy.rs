//! The policy the decide layer applies: the rotation's ceilings and
//! deadlines, each pool's actions and cap, and the severity rules.
//!
//! Owns the narrow view of the configuration that judging and planning read,
//! built once from a [`Config`] (or directly, by tests) and borrowed by the
//! planner, severity and the executor. It must never hold what deciding does
//! not read (the overlay's repository, tokens, servers, alert sinks).

use std::collections::BTreeMap;

use crate::config::{
    Config, DEFAULT_POOL, PoolConfig, ReleaseConfig, RotationConfig, SeverityRule,
    default_severity_rules,
};
use crate::model::{PolicyAction, PoolName, Severity};

/// What deciding reads of the configuration.
#[derive(Clone, Debug)]
pub struct Policy {
    /// `[rotation]`: ceilings, deadlines, guards, the coordinator.
    pub rotation: RotationConfig,
    /// `[pools.NAME]` as configured.
    pools: BTreeMap<PoolName, PoolConfig>,
    /// The policy of a pool without its own section: `[pools.default]`, or
    /// the built-in safe default.
    fallback: PoolConfig,
    /// `[[severity]]`, or the built-in rules.
    pub severity: Vec<SeverityRule>,
    /// `[release]`: when a release halts itself.
    pub release: ReleaseConfig,
    /// `gates.alertmanager.fail_open`: an unreadable alert gate holds nothing.
    pub gate_fail_open: bool,
}

impl Default for Policy {
    /// The built-in policy: default rotation, default pool, default rules.
    fn default() -> Policy {
        Policy {
            rotation: RotationConfig::default(),
            pools: BTreeMap::new(),
            fallback: PoolConfig::default(),
            severity: default_severity_rules(),
            release: ReleaseConfig::default(),
            gate_fail_open: false,
        }
    }
}

impl Policy {
    pub fn from_config(config: &Config) -> Policy {
        Policy {
            rotation: config.rotation.clone(),
            pools: config.pools.clone(),
            fallback: config
                .pools
                .get(&PoolName::from(DEFAULT_POOL))
                .cloned()
                .unwrap_or_default(),
            severity: config.severity.clone(),
            release: config.release.clone(),
            gate_fail_open: config
                .gates
                .alertmanager
                .as_ref()
                .is_some_and(|g| g.fail_open),
        }
    }

    /// Sets the policy of pool `name` (`default` also becomes the fallback).
    pub fn with_pool(mut self, name: &str, pool: PoolConfig) -> Policy {
        if name == DEFAULT_POOL {
            self.fallback = pool.clone();
        }
        self.pools.insert(PoolName::from(name), pool);
        self
    }

    /// The policy of a pool; pools without their own section use `default`.
    pub fn pool(&self, name: &PoolName) -> &PoolConfig {
        self.pools.get(name).unwrap_or(&self.fallback)
    }

    /// Each configured pool that waits for a canary pool, with that pool
    /// (`pools.NAME.after`).
    pub fn canaries(&self) -> impl Iterator<Item = (&PoolName, &PoolName)> {
        self.pools
            .iter()
            .filter_map(|(name, p)| Some((name, p.after.as_ref()?)))
    }

    /// What pool `name` does about drift of `severity`.
    pub fn action(&self, pool: &PoolName, severity: Severity) -> PolicyAction {
        self.pool(pool).actions.for_severity(severity)
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::config::ActionMap;

    #[test]
    fn a_pool_without_a_section_follows_default_and_config_agrees() {
        let pools = r#"
[pools.default]
max_concurrent_rotations = 3
actions = { low = "observe", medium = "observe", high = "restart", critical = "manual" }
[pools.canary]
actions = { low = "restart", medium = "restart", high = "restart", critical = "restart" }
"#;
        let config = crate::config::test_config(pools);
        let policy = Policy::from_config(&config);
        let [default, canary, unlisted] = ["default", "canary", "unlisted"].map(PoolName::from);
        for (pool, cap) in [(&default, 3), (&canary, 1), (&unlisted, 3)] {
            let configured = config.pools.get(pool).unwrap_or(&config.pools[&default]);
            assert_eq!(policy.pool(pool).actions, configured.actions, "{pool}");
            assert_eq!(
                policy.pool(pool).max_concurrent_rotations.get(),
                cap,
                "{pool}"
            );
        }
        // Without `[pools.default]`, the built-in safe default.
        let bare = Policy::from_config(&crate::config::test_config(
            &pools.replace("[pools.default]", "[pools.x]"),
        ));
        assert_eq!(bare.pool(&unlisted).actions, ActionMap::default());
        assert_eq!(
            policy.action(&unlisted, Severity::Low),
            PolicyAction::Observe
        );
        assert_eq!(policy.action(&canary, Severity::Low), PolicyAction::Restart);

        let direct = Policy::default().with_pool(
            "default",
            PoolConfig {
                max_concurrent_rotations: NonZeroU32::MIN.saturating_add(2),
                actions: ActionMap::from([
                    PolicyAction::Observe,
                    PolicyAction::Observe,
                    PolicyAction::Restart,
                    PolicyAction::Manual,
                ]),
                ..PoolConfig::default()
            },
        );
        assert_eq!(
            direct.pool(&unlisted).actions,
            policy.pool(&unlisted).actions
        );
        assert_eq!(
            direct.pool(&unlisted).max_concurrent_rotations.get(),
            3,
            "with_pool(\"default\") is the fallback too"
        );
    }
}

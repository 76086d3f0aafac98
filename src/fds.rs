//! The open-file budget: how many descriptors a configuration needs at
//! once (agent probes, HTTP clients, the server, the mirror and logs),
//! checked at start against the process's limit, whose soft value is raised
//! towards the hard one when it is too low (as Go's runtime and most servers
//! do). It reads and sets `RLIMIT_NOFILE` and nothing else; it never fails
//! a start: a limit it cannot raise enough is a WARN naming the config keys
//! to lower, a raised one an INFO line, one that was enough a debug line.

use crate::config::Config;

/// Descriptors kept for what no setting bounds: the overlay mirror's pack
/// files, the alert state file, log and stdio, the Fly and git clients'
/// own connections.
pub const RESERVE: u64 = 128;

/// What a configuration may hold open at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdBudget {
    /// `probe.concurrency`: the sweep's agent connections, in flight or idle.
    pub probes: u64,
    /// `server.max_connections`.
    pub server: u64,
    /// The executor's steps at once, each with a Fly and an agent connection
    /// and a fresh probe.
    pub steps: u64,
}

impl FdBudget {
    pub fn from_config(config: &Config, steps: usize) -> FdBudget {
        FdBudget {
            probes: config.probe.concurrency.get() as u64,
            server: config.server.max_connections.get() as u64,
            steps: steps as u64,
        }
    }

    pub fn needed(&self) -> u64 {
        self.probes
            .saturating_add(self.server)
            .saturating_add(self.steps.saturating_mul(3))
            .saturating_add(RESERVE)
    }
}

/// What to do with the limit, given what is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FdPlan {
    /// The soft limit covers it.
    Enough { soft: u64 },
    /// Raise the soft limit to `to` (twice what is needed, or the hard limit).
    Raise { from: u64, to: u64 },
    /// Even the hard limit is below what is needed.
    TooLow { soft: u64, hard: u64 },
}

/// The pure rule, for a limit `(soft, hard)`.
pub fn plan(needed: u64, soft: u64, hard: u64) -> FdPlan {
    if soft >= needed {
        FdPlan::Enough { soft }
    } else if hard >= needed {
        FdPlan::Raise {
            from: soft,
            to: needed.saturating_mul(2).min(hard),
        }
    } else if hard > soft {
        FdPlan::Raise {
            from: soft,
            to: hard,
        }
    } else {
        FdPlan::TooLow { soft, hard }
    }
}

/// Reads the limit, raises it where needed and possible, and logs what it
/// found: one INFO line, or a WARN when the budget does not fit. Returns
/// the soft limit in force afterwards (`None` where it cannot be read).
pub fn at_start(budget: FdBudget) -> Option<u64> {
    let needed = budget.needed();
    let (soft, hard) = match rlimit::getrlimit(rlimit::Resource::NOFILE) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, needed, "cannot read the open-file limit");
            return None;
        }
    };
    let mut in_force = soft;
    match plan(needed, soft, hard) {
        FdPlan::Enough { .. } => {}
        FdPlan::Raise { from, to } => match rlimit::setrlimit(rlimit::Resource::NOFILE, to, hard) {
            Ok(()) => in_force = to,
            Err(e) => tracing::warn!(error = %e, from, to, "cannot raise the open-file limit"),
        },
        FdPlan::TooLow { .. } => {}
    }
    if in_force >= needed && in_force != soft {
        tracing::info!(
            soft = in_force,
            was = soft,
            hard,
            needed,
            probes = budget.probes,
            server = budget.server,
            "open-file limit"
        );
    } else if in_force >= needed {
        // Nothing changed: every one-shot command would print it otherwise.
        tracing::debug!(
            soft = in_force,
            hard,
            needed,
            probes = budget.probes,
            server = budget.server,
            "open-file limit"
        );
    } else {
        tracing::warn!(
            soft = in_force,
            hard,
            needed,
            "the open-file limit is below what this config may hold open at once (probe.concurrency {} + server.max_connections {} + {} steps x3 + {RESERVE}): lower probe.concurrency or server.max_connections, or raise the limit (`ulimit -n`, systemd LimitNOFILE=)",
            budget.probes,
            budget.server,
            budget.steps
        );
    }
    Some(in_force)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_only_when_needed_and_never_past_the_hard_one() {
        assert_eq!(plan(700, 1024, 4096), FdPlan::Enough { soft: 1024 });
        assert_eq!(
            plan(700, 256, 524_288),
            FdPlan::Raise {
                from: 256,
                to: 1400
            }
        );
        assert_eq!(
            plan(700, 256, 1000),
            FdPlan::Raise {
                from: 256,
                to: 1000
            }
        );
        // Not enough even so: raised as far as it goes, and warned.
        assert_eq!(plan(700, 256, 512), FdPlan::Raise { from: 256, to: 512 });
        assert_eq!(
            plan(700, 512, 512),
            FdPlan::TooLow {
                soft: 512,
                hard: 512
            }
        );
        assert_eq!(
            plan(u64::MAX, 1, u64::MAX),
            FdPlan::Raise {
                from: 1,
                to: u64::MAX
            }
        );
    }

    #[test]
    fn the_budget_adds_what_each_setting_may_hold_open() {
        let b = FdBudget {
            probes: 256,
            server: 256,
            steps: 16,
        };
        assert_eq!(b.needed(), 256 + 256 + 48 + RESERVE);
        let huge = FdBudget {
            probes: u64::MAX,
            server: 1,
            steps: u64::MAX,
        };
        assert_eq!(huge.needed(), u64::MAX, "saturates, never overflows");
    }
}

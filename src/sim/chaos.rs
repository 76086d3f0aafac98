//! Random faults on Fly API calls ([`super::SimHandle::set_chaos`]).
//!
//! The faults are the ones a client of the real API meets: throttling, 5xx,
//! a connection that hangs before the request is served, and — the ones that
//! matter for safety — a request that *did* take effect although the client
//! saw an error or a timeout. A daemon that retries a "failed" restart, or
//! assumes a cordon that answered 500 did not happen, is caught by those.
//!
//! Opt-in faults of the world (issue #19) are what Fly and its operators do
//! meanwhile: a host down (the coordinator's included), a 429 storm at the
//! documented limits, a hold written without a nonce, a `fly deploy` that
//! reverts metadata and replaces a machine ([`WorldFault`], [`ChaosHolds`]).
//!
//! Draws come from a seeded RNG held in the world, one draw per eligible
//! request in arrival order, so a run with the same seed and the same order
//! of requests gets the same faults. (Concurrent clients make the arrival
//! order, and so the faults, vary between runs; the seed still fixes the
//! sequence of draws.)

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

/// Bound on the fault log, so a long `demo` run does not grow without limit.
pub(crate) const MAX_CHAOS_EVENTS: usize = 10_000;

/// Random fault injection on authenticated Fly API requests.
#[derive(Clone, Debug, PartialEq)]
pub struct Chaos {
    /// Seeds the fault RNG; the same seed and request order give the same faults.
    pub seed: u64,
    /// Probability (0.0 to 1.0) that a request gets a fault; out-of-range
    /// values act as the nearest bound, NaN as 0.
    pub rate: f64,
    /// `Retry-After` seconds on injected 429s.
    pub retry_after_secs: u64,
    /// How long the hanging faults hold the response: meant to be longer than
    /// the client's timeout, so the client gives up first.
    pub hang: Duration,
    /// Opt-in: a random machine's host goes down (coordinator included).
    pub host_outages: Option<WorldFault>,
    /// Opt-in: probability that a request's machine has every rate-limit
    /// bucket emptied (a 429 storm at the documented limits, which must be on).
    pub rate_storms: Option<f64>,
    /// Opt-in: a hold written without a nonce on a random machine.
    pub holds: Option<ChaosHolds>,
    /// Opt-in: an outside update (`fly deploy`) of a random machine, from the
    /// metadata it had when chaos was turned on, reusing any lease it finds.
    pub outside_updates: Option<WorldFault>,
}

/// How often a fault of the world (not of one request) happens, for how
/// long, and to which machines.
#[derive(Clone, Debug, PartialEq)]
pub struct WorldFault {
    /// Probability per eligible request.
    pub rate: f64,
    /// How long it lasts before it is undone (a host comes back, a hold is
    /// removed); unused for outside updates.
    pub lasts: Duration,
    /// Only machines of this app; `None`: every machine of every app.
    pub app: Option<String>,
}

impl WorldFault {
    pub fn new(rate: f64, lasts: Duration) -> WorldFault {
        WorldFault {
            rate,
            lasts,
            app: None,
        }
    }

    pub fn app(mut self, app: impl Into<String>) -> WorldFault {
        self.app = Some(app.into());
        self
    }
}

/// Holds an operator writes without a nonce at random instants.
#[derive(Clone, Debug, PartialEq)]
pub struct ChaosHolds {
    pub fault: WorldFault,
    /// The metadata key written (as [`super::AuditConfig::hold_key`]).
    pub key: String,
    pub value: String,
}

impl Chaos {
    /// `rate` of faults from `seed`, with `Retry-After: 1` and a two-minute
    /// hang (longer than the daemon's default request timeout plus the
    /// longest `wait` it asks for).
    pub fn new(seed: u64, rate: f64) -> Chaos {
        Chaos {
            seed,
            rate,
            retry_after_secs: 1,
            hang: Duration::from_secs(120),
            host_outages: None,
            rate_storms: None,
            holds: None,
            outside_updates: None,
        }
    }

    pub fn host_outages(mut self, fault: WorldFault) -> Chaos {
        self.host_outages = Some(fault);
        self
    }

    pub fn rate_storms(mut self, rate: f64) -> Chaos {
        self.rate_storms = Some(rate);
        self
    }

    /// Holds under `key` on random machines, each removed after `fault.lasts`.
    pub fn holds(mut self, key: impl Into<String>, fault: WorldFault) -> Chaos {
        self.holds = Some(ChaosHolds {
            fault,
            key: key.into(),
            value: "chaos: operator hold".to_string(),
        });
        self
    }

    pub fn outside_updates(mut self, fault: WorldFault) -> Chaos {
        self.outside_updates = Some(fault);
        self
    }

    pub fn retry_after_secs(mut self, secs: u64) -> Chaos {
        self.retry_after_secs = secs;
        self
    }

    pub fn hang(mut self, hang: Duration) -> Chaos {
        self.hang = hang;
        self
    }
}

impl Default for Chaos {
    /// One request in ten, seed 0.
    fn default() -> Chaos {
        Chaos::new(0, 0.1)
    }
}

/// The kinds of fault [`Chaos`] chooses from, uniformly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ChaosFault {
    /// 429 with `Retry-After: retry_after_secs`; no effect.
    TooManyRequests,
    /// 500; no effect.
    ServerError,
    /// 503; no effect.
    Unavailable,
    /// No effect; the answer (503) comes only after [`Chaos::hang`].
    HangBefore,
    /// The request takes effect, but the client gets a 500 instead of the answer.
    LostAfter,
    /// The request takes effect, then the answer is held for [`Chaos::hang`]
    /// and replaced by a 503.
    HangAfter,
    /// The request takes effect, and the client gets a 408: Fly timed out
    /// talking to the host, "the side-effect may or may not have happened"
    /// (flyctl `internal/flapsutil/retry.go`). Only aimed
    /// ([`super::SimHandle::fault_next_call`]), never drawn: not in
    /// [`ChaosFault::ALL`], so old seeds keep their faults.
    TimedOutAfter,
}

impl ChaosFault {
    /// Every kind, in the order the RNG indexes them.
    pub const ALL: [ChaosFault; 6] = [
        ChaosFault::TooManyRequests,
        ChaosFault::ServerError,
        ChaosFault::Unavailable,
        ChaosFault::HangBefore,
        ChaosFault::LostAfter,
        ChaosFault::HangAfter,
    ];

    /// Whether the real handler runs (and its effect takes place) despite the fault.
    pub fn takes_effect(self) -> bool {
        matches!(
            self,
            ChaosFault::LostAfter | ChaosFault::HangAfter | ChaosFault::TimedOutAfter
        )
    }
}

/// How many requests [`Chaos`] looked at and how many faults of each kind it injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChaosStats {
    /// Requests that drew from the RNG (authenticated, not refused earlier).
    pub eligible: u64,
    /// Faults of the world ([`ChaosWorldEvent`]), by kind.
    pub host_outages: u64,
    pub rate_storms: u64,
    pub holds: u64,
    pub outside_updates: u64,
    pub too_many_requests: u64,
    pub server_error: u64,
    pub unavailable: u64,
    pub hang_before: u64,
    pub lost_after: u64,
    pub hang_after: u64,
    pub timed_out_after: u64,
}

impl ChaosStats {
    pub fn count(&self, fault: ChaosFault) -> u64 {
        match fault {
            ChaosFault::TooManyRequests => self.too_many_requests,
            ChaosFault::ServerError => self.server_error,
            ChaosFault::Unavailable => self.unavailable,
            ChaosFault::HangBefore => self.hang_before,
            ChaosFault::LostAfter => self.lost_after,
            ChaosFault::HangAfter => self.hang_after,
            ChaosFault::TimedOutAfter => self.timed_out_after,
        }
    }

    /// Request faults injected, all kinds together (faults of the world are
    /// counted apart, in `host_outages`, `rate_storms`, `holds`, `outside_updates`).
    pub fn injected(&self) -> u64 {
        ChaosFault::ALL.iter().map(|f| self.count(*f)).sum::<u64>() + self.timed_out_after
    }

    fn bump(&mut self, fault: ChaosFault) {
        let counter = match fault {
            ChaosFault::TooManyRequests => &mut self.too_many_requests,
            ChaosFault::ServerError => &mut self.server_error,
            ChaosFault::Unavailable => &mut self.unavailable,
            ChaosFault::HangBefore => &mut self.hang_before,
            ChaosFault::LostAfter => &mut self.lost_after,
            ChaosFault::HangAfter => &mut self.hang_after,
            ChaosFault::TimedOutAfter => &mut self.timed_out_after,
        };
        *counter += 1;
    }
}

/// One fault [`Chaos`] injected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChaosEvent {
    /// The request's [`super::RecordedRequest::seq`].
    pub seq: u64,
    pub fault: ChaosFault,
    pub method: String,
    pub path: String,
    pub machine_id: Option<String>,
    /// For faults that let the request through: the status the real handler
    /// answered (2xx: the effect took place), once it has. `None` otherwise.
    pub effect_status: Option<u16>,
}

/// A fault of the world that [`Chaos`] caused, at the arrival of request `seq`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChaosWorldEvent {
    pub seq: u64,
    pub kind: WorldFaultKind,
    pub machine_id: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorldFaultKind {
    HostOutage,
    RateStorm,
    Hold,
    OutsideUpdate,
}

/// What the front door does, outside the lock, for a drawn fault of the world.
pub(crate) enum WorldAct {
    HostDown {
        machine_id: String,
        lasts: Duration,
    },
    Storm {
        machine_id: String,
    },
    Hold {
        machine_id: String,
        key: String,
        value: String,
        lasts: Duration,
    },
    OutsideUpdate {
        machine_id: String,
        metadata: BTreeMap<String, String>,
    },
}

/// The chaos configuration, its RNG, and what it has done so far.
#[derive(Default)]
pub(crate) struct ChaosState {
    /// Config and RNG while chaos is on.
    active: Option<(Chaos, fastrand::Rng)>,
    /// Cumulative over the simulator's life, across [`super::SimHandle::set_chaos`] calls.
    pub(crate) stats: ChaosStats,
    /// Newest last; the oldest are dropped beyond [`MAX_CHAOS_EVENTS`].
    pub(crate) events: VecDeque<ChaosEvent>,
    /// Newest last, bounded like `events`.
    pub(crate) world_events: VecDeque<ChaosWorldEvent>,
    /// Drawn under the lock, carried out by the front door after it.
    pub(crate) pending: Vec<WorldAct>,
    /// Each machine's metadata when chaos was turned on: what an outside
    /// update (a deploy that read the machines then) writes back.
    pub(crate) snapshots: HashMap<String, BTreeMap<String, String>>,
}

impl ChaosState {
    /// Turns chaos on (re-seeding the RNG) or off; stats and events are kept.
    pub(crate) fn set(&mut self, chaos: Option<Chaos>) {
        self.active = chaos.map(|c| {
            let rng = fastrand::Rng::with_seed(c.seed);
            (c, rng)
        });
    }

    /// Draws for one request: `None` (no fault) or the fault and the config it came from.
    pub(crate) fn draw(&mut self) -> Option<(ChaosFault, &Chaos)> {
        let (chaos, rng) = self.active.as_mut()?;
        self.stats.eligible += 1;
        // `f64()` is in [0, 1): rate 1.0 always faults, 0.0 never,
        // and NaN never (every comparison with NaN is false).
        let hit = rng.f64() < chaos.rate;
        if !hit {
            return None;
        }
        let fault = ChaosFault::ALL[rng.usize(0..ChaosFault::ALL.len())];
        self.stats.bump(fault);
        Some((fault, chaos))
    }

    pub(crate) fn log(&mut self, event: ChaosEvent) {
        if self.events.len() >= MAX_CHAOS_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(event);
    }

    /// Draws the opted-in faults of the world for one eligible request
    /// (no draw at all for a kind that is off, so old seeds keep their faults).
    pub(crate) fn draw_world(
        &mut self,
        seq: u64,
        request_machine: Option<&str>,
        apps: &BTreeMap<String, Vec<String>>,
    ) {
        let Some((chaos, rng)) = self.active.as_mut() else {
            return;
        };
        let mut acts = Vec::new();
        let pick = |rng: &mut fastrand::Rng, fault: &WorldFault| -> Option<String> {
            if rng.f64() >= fault.rate {
                return None;
            }
            let ids: Vec<&String> = match &fault.app {
                Some(app) => apps.get(app).into_iter().flatten().collect(),
                None => apps.values().flatten().collect(),
            };
            (!ids.is_empty()).then(|| ids[rng.usize(0..ids.len())].clone())
        };
        if let Some(fault) = &chaos.host_outages
            && let Some(machine_id) = pick(rng, fault)
        {
            acts.push(WorldAct::HostDown {
                machine_id,
                lasts: fault.lasts,
            });
        }
        if let Some(rate) = chaos.rate_storms
            && rng.f64() < rate
            && let Some(id) = request_machine
        {
            acts.push(WorldAct::Storm {
                machine_id: id.to_string(),
            });
        }
        if let Some(holds) = &chaos.holds
            && let Some(machine_id) = pick(rng, &holds.fault)
        {
            acts.push(WorldAct::Hold {
                machine_id,
                key: holds.key.clone(),
                value: holds.value.clone(),
                lasts: holds.fault.lasts,
            });
        }
        if let Some(fault) = &chaos.outside_updates
            && let Some(machine_id) = pick(rng, fault)
        {
            let metadata = self.snapshots.get(&machine_id).cloned().unwrap_or_default();
            acts.push(WorldAct::OutsideUpdate {
                machine_id,
                metadata,
            });
        }
        for act in &acts {
            let (kind, machine_id) = match act {
                WorldAct::HostDown { machine_id, .. } => (WorldFaultKind::HostOutage, machine_id),
                WorldAct::Storm { machine_id } => (WorldFaultKind::RateStorm, machine_id),
                WorldAct::Hold { machine_id, .. } => (WorldFaultKind::Hold, machine_id),
                WorldAct::OutsideUpdate { machine_id, .. } => {
                    (WorldFaultKind::OutsideUpdate, machine_id)
                }
            };
            let counter = match kind {
                WorldFaultKind::HostOutage => &mut self.stats.host_outages,
                WorldFaultKind::RateStorm => &mut self.stats.rate_storms,
                WorldFaultKind::Hold => &mut self.stats.holds,
                WorldFaultKind::OutsideUpdate => &mut self.stats.outside_updates,
            };
            *counter += 1;
            if self.world_events.len() >= MAX_CHAOS_EVENTS {
                self.world_events.pop_front();
            }
            self.world_events.push_back(ChaosWorldEvent {
                seq,
                kind,
                machine_id: machine_id.clone(),
            });
        }
        self.pending.extend(acts);
    }

    /// Notes what the real handler answered a request that a fault let through.
    pub(crate) fn record_effect(&mut self, seq: u64, status: u16) {
        if let Some(e) = self.events.iter_mut().rev().find(|e| e.seq == seq) {
            e.effect_status = Some(status);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn faults(seed: u64, rate: f64, n: usize) -> Vec<Option<ChaosFault>> {
        let mut state = ChaosState::default();
        state.set(Some(Chaos::new(seed, rate)));
        (0..n).map(|_| state.draw().map(|(f, _)| f)).collect()
    }

    #[test]
    fn the_same_seed_draws_the_same_faults() {
        assert_eq!(faults(7, 0.5, 200), faults(7, 0.5, 200));
        assert_ne!(faults(7, 0.5, 200), faults(8, 0.5, 200));
    }

    #[test]
    fn rate_bounds_and_uniform_kinds() {
        assert!(faults(1, 0.0, 500).iter().all(Option::is_none));
        assert!(faults(1, f64::NAN, 500).iter().all(Option::is_none));
        let all = faults(1, 1.0, 600);
        assert!(all.iter().all(Option::is_some));
        for kind in ChaosFault::ALL {
            let n = all.iter().filter(|f| **f == Some(kind)).count();
            // 100 expected; uniform choice stays well inside this band.
            assert!((50..=150).contains(&n), "{kind:?}: {n}");
        }
    }

    #[test]
    fn stats_count_draws_and_survive_turning_chaos_off() {
        let mut state = ChaosState::default();
        assert!(state.draw().is_none(), "off by default");
        assert_eq!(state.stats.eligible, 0);
        state.set(Some(Chaos::new(3, 1.0)));
        for _ in 0..10 {
            state.draw();
        }
        state.set(None);
        assert!(state.draw().is_none());
        assert_eq!(state.stats.eligible, 10);
        assert_eq!(state.stats.injected(), 10);
    }
}

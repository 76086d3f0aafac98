//! Random faults on Fly API calls ([`super::Sim::set_chaos`]).
//!
//! The faults are the ones a client of the real API meets: throttling, 5xx,
//! a connection that hangs before the request is served, and — the ones that
//! matter for safety — a request that *did* take effect although the client
//! saw an error or a timeout. A daemon that retries a "failed" restart, or
//! assumes a cordon that answered 500 did not happen, is caught by those.
//!
//! Draws come from a seeded RNG held in the world, one draw per eligible
//! request in arrival order, so a run with the same seed and the same order
//! of requests gets the same faults. (Concurrent clients make the arrival
//! order, and so the faults, vary between runs; the seed still fixes the
//! sequence of draws.)

use std::collections::VecDeque;
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
        }
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
        matches!(self, ChaosFault::LostAfter | ChaosFault::HangAfter)
    }
}

/// How many requests [`Chaos`] looked at and how many faults of each kind it injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChaosStats {
    /// Requests that drew from the RNG (authenticated, not refused earlier).
    pub eligible: u64,
    pub too_many_requests: u64,
    pub server_error: u64,
    pub unavailable: u64,
    pub hang_before: u64,
    pub lost_after: u64,
    pub hang_after: u64,
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
        }
    }

    /// Faults injected, all kinds together.
    pub fn injected(&self) -> u64 {
        ChaosFault::ALL.iter().map(|f| self.count(*f)).sum()
    }

    fn bump(&mut self, fault: ChaosFault) {
        let counter = match fault {
            ChaosFault::TooManyRequests => &mut self.too_many_requests,
            ChaosFault::ServerError => &mut self.server_error,
            ChaosFault::Unavailable => &mut self.unavailable,
            ChaosFault::HangBefore => &mut self.hang_before,
            ChaosFault::LostAfter => &mut self.lost_after,
            ChaosFault::HangAfter => &mut self.hang_after,
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

/// The chaos configuration, its RNG, and what it has done so far.
#[derive(Default)]
pub(crate) struct ChaosState {
    /// Config and RNG while chaos is on.
    active: Option<(Chaos, fastrand::Rng)>,
    /// Cumulative over the simulator's life, across [`super::Sim::set_chaos`] calls.
    pub(crate) stats: ChaosStats,
    /// Newest last; the oldest are dropped beyond [`MAX_CHAOS_EVENTS`].
    pub(crate) events: VecDeque<ChaosEvent>,
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

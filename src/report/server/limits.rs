//! What keeps the HTTP server from being tied up or brute-forced: the
//! connection and request limits (`server.*` in the config) and the per-source
//! limiter of failed admin authentications.
//!
//! The limiter is a fixed window per source IP, opened by its first failure:
//! the `admin_auth_failures`-th failure within `admin_auth_window` makes the
//! source *limited* until that window ends, and while limited every admin
//! request from it is refused with 429 before its token is even looked at (a
//! correct token included: a brute-forcer that guesses right must not learn
//! it then).
//! A success from a source that is not limited forgets its failures. The
//! map of sources is bounded ([`MAX_TRACKED_SOURCES`]): when full, expired
//! windows are dropped first, then the oldest window that is not limited,
//! so a spray of addresses costs bounded memory and cannot free a limited
//! source before it would free itself unless every tracked one is limited.
//!
//! Logging is rate-limited too, per source and window: the first failure of
//! a window is logged at warn (source, method, path, why), and so is the
//! moment the source becomes limited (with the count and for how long);
//! everything in between is only counted, in `fleet_reconciler_admin_auth_failures_total`.
//! No line ever carries the presented or the configured token, nor any part
//! of the `Authorization` header.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::ServerConfig;

/// Sources the admin-auth limiter remembers at once.
pub const MAX_TRACKED_SOURCES: usize = 4096;

/// The server's limits; [`ServerLimits::default`] is the config's defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// `server.header_read_timeout`: the headers of a request (the first, or
    /// the next on a kept-alive connection) must arrive within this.
    pub header_read_timeout: Duration,
    /// `server.request_timeout`: a whole request, body and handler included.
    pub request_timeout: Duration,
    /// `server.max_connections`: connections served at once.
    pub max_connections: usize,
    /// `server.max_body_bytes`: the largest request body.
    pub max_body_bytes: usize,
    /// `server.admin_auth_failures`: failed admin authentications allowed
    /// per source and window.
    pub admin_auth_failures: u32,
    /// `server.admin_auth_window`.
    pub admin_auth_window: Duration,
}

impl ServerLimits {
    pub fn from_config(c: &ServerConfig) -> ServerLimits {
        ServerLimits {
            header_read_timeout: c.header_read_timeout.get(),
            request_timeout: c.request_timeout.get(),
            max_connections: c.max_connections.get(),
            max_body_bytes: c.max_body_bytes.get(),
            admin_auth_failures: c.admin_auth_failures.get(),
            admin_auth_window: c.admin_auth_window.get(),
        }
    }
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits::from_config(&ServerConfig::default())
    }
}

/// Why an admin request was not authenticated (a label of
/// `fleet_reconciler_admin_auth_failures_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum AuthFailure {
    /// No `Authorization: Bearer …` header.
    MissingToken,
    /// A bearer token that is not the admin token.
    WrongToken,
}

impl AuthFailure {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What the caller should log after [`AuthLimiter::record_failure`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureLog {
    /// The first failure of the source's window: log it.
    First,
    /// Counted, not logged.
    Quiet,
    /// This failure made the source limited for `retry_after`: log that.
    NowLimited {
        failures: u32,
        retry_after: Duration,
    },
}

#[derive(Clone, Copy, Debug)]
struct Window {
    started: Instant,
    failures: u32,
    /// Set once the source went over the limit: refused until the window ends.
    limited: bool,
}

/// Failed admin authentications per source, in fixed windows. Time is passed
/// in, so the rules can be tested without waiting.
#[derive(Debug)]
pub struct AuthLimiter {
    max_failures: u32,
    window: Duration,
    capacity: usize,
    sources: Mutex<HashMap<IpAddr, Window>>,
}

impl AuthLimiter {
    pub fn new(max_failures: u32, window: Duration) -> AuthLimiter {
        AuthLimiter::with_capacity(max_failures, window, MAX_TRACKED_SOURCES)
    }

    pub fn with_capacity(max_failures: u32, window: Duration, capacity: usize) -> AuthLimiter {
        AuthLimiter {
            max_failures: max_failures.max(1),
            window,
            capacity: capacity.max(1),
            sources: Mutex::new(HashMap::new()),
        }
    }

    fn sources(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Window>> {
        // Counters only: a panic elsewhere cannot leave them worth refusing on.
        self.sources.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `Some(retry_after)` when `source` is limited at `now`: refuse its
    /// admin request without looking at the token.
    pub fn check(&self, source: IpAddr, now: Instant) -> Option<Duration> {
        let sources = self.sources();
        let w = sources.get(&source)?;
        let ends = w.started + self.window;
        if w.limited && now < ends {
            Some(ends - now)
        } else {
            None
        }
    }

    /// A failed authentication from `source` at `now`.
    pub fn record_failure(&self, source: IpAddr, now: Instant) -> FailureLog {
        let mut sources = self.sources();
        if !sources.contains_key(&source) && sources.len() >= self.capacity {
            self.make_room(&mut sources, now);
        }
        let fresh = Window {
            started: now,
            failures: 0,
            limited: false,
        };
        let w = sources.entry(source).or_insert(fresh);
        if now >= w.started + self.window {
            *w = fresh;
        }
        w.failures += 1;
        if w.failures >= self.max_failures && !w.limited {
            w.limited = true;
            FailureLog::NowLimited {
                failures: w.failures,
                retry_after: (w.started + self.window).saturating_duration_since(now),
            }
        } else if w.failures == 1 {
            FailureLog::First
        } else {
            FailureLog::Quiet
        }
    }

    /// A successful authentication: the source's failures are forgotten.
    pub fn record_success(&self, source: IpAddr) {
        self.sources().remove(&source);
    }

    /// Sources currently tracked.
    pub fn tracked(&self) -> usize {
        self.sources().len()
    }

    fn make_room(&self, sources: &mut HashMap<IpAddr, Window>, now: Instant) {
        let window = self.window;
        sources.retain(|_, w| now < w.started + window);
        if sources.len() < self.capacity {
            return;
        }
        // Still full of live windows: forget the oldest, limited ones last.
        let victim = sources
            .iter()
            .min_by_key(|(_, w)| (w.limited, w.started))
            .map(|(ip, _)| *ip);
        if let Some(ip) = victim {
            sources.remove(&ip);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_source_is_limited_after_its_failures_until_the_window_ends() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let l = AuthLimiter::new(3, Duration::from_secs(60));
        assert_eq!(l.record_failure(ip(1), at(0)), FailureLog::First);
        assert_eq!(l.record_failure(ip(1), at(1)), FailureLog::Quiet);
        assert_eq!(l.check(ip(1), at(3)), None, "2 failures: not yet");
        assert_eq!(
            l.record_failure(ip(1), at(10_000)),
            FailureLog::NowLimited {
                failures: 3,
                retry_after: Duration::from_secs(50)
            }
        );
        assert_eq!(l.check(ip(1), at(20_000)), Some(Duration::from_secs(40)));
        assert_eq!(l.check(ip(2), at(20_000)), None, "other sources are not");
        // A success while limited is never recorded (check refuses first);
        // at the end of the window the source is free again.
        assert_eq!(l.check(ip(1), at(60_000)), None);
        assert_eq!(l.record_failure(ip(1), at(60_000)), FailureLog::First);
    }

    #[test]
    fn a_success_forgets_the_failures() {
        let t0 = Instant::now();
        let l = AuthLimiter::new(3, Duration::from_secs(60));
        l.record_failure(ip(1), t0);
        l.record_failure(ip(1), t0);
        l.record_success(ip(1));
        assert_eq!(l.record_failure(ip(1), t0), FailureLog::First);
        assert_eq!(l.tracked(), 1);
    }

    #[test]
    fn the_map_of_sources_stays_bounded_and_keeps_the_limited() {
        let t0 = Instant::now();
        let l = AuthLimiter::with_capacity(2, Duration::from_secs(60), 4);
        l.record_failure(ip(0), t0);
        l.record_failure(ip(0), t0);
        assert!(l.check(ip(0), t0).is_some());
        // With one allowed failure, the first one limits (and is what is logged).
        let one = AuthLimiter::new(1, Duration::from_secs(60));
        assert!(matches!(
            one.record_failure(ip(9), t0),
            FailureLog::NowLimited { failures: 1, .. }
        ));
        for i in 1..=200u8 {
            l.record_failure(ip(i), t0 + Duration::from_millis(u64::from(i)));
            assert!(l.tracked() <= 4);
        }
        assert!(
            l.check(ip(0), t0 + Duration::from_secs(1)).is_some(),
            "a spray of new sources did not free the limited one"
        );
        // Expired windows are dropped first.
        let later = t0 + Duration::from_secs(120);
        l.record_failure(ip(250), later);
        assert_eq!(l.tracked(), 1);
    }
}

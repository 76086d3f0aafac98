//! The heartbeat sink (`[[alerts.heartbeat]]`): a dead-man's switch. Each
//! configured URL is pinged after every successful sweep; the receiver
//! (healthchecks.io, Cronitor, a PagerDuty heartbeat, an Alertmanager
//! Watchdog receiver) pages when the pings stop, which is the one page a
//! daemon that is dead, wedged or unable to sweep cannot send itself.
//!
//! Owns what one heartbeat sends for a change (a ping for
//! [`Change::Swept`], nothing for alerts), its request, and its outcome
//! counts (`DeliveryEvent::Heartbeat`). It is a [`Sink`] like the webhooks
//! and Alertmanagers, delivered by the notifier's one path; unlike them a
//! failed ping is not retried (the next sweep pings again) and it keeps
//! nothing in the state file. It must never block or delay a sweep (a ping
//! due or still in flight makes the next one of that URL a skip), never
//! follow a redirect, never write a ping URL (it embeds the check's
//! secret) into a log line or an error, and never read the environment
//! (the URLs arrive as `SecretString`s, see [`heartbeat_urls_from_env`]).
//! Whether a sweep counted as successful is the caller's to say: it calls
//! `Notifier::swept` only then.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use secrecy::{ExposeSecret, SecretString};

use super::counter::{DeliveryCounter, DeliveryEvent, PingResult};
use super::sink::{Attempt, Change, Sink, Then};
use super::{NotifyError, check_url};
use crate::config::{AlertsConfig, HeartbeatConfig, HeartbeatMethod};

/// One configured heartbeat.
pub(super) struct Heartbeat {
    index: usize,
    /// The variable the URL came from: what logs name instead of the URL.
    url_env: String,
    url: SecretString,
    method: HeartbeatMethod,
    timeout: Duration,
    /// A ping is owed (a successful sweep since the last one was sent).
    due: AtomicBool,
    in_flight: AtomicBool,
    wake: tokio::sync::Notify,
    counter: DeliveryCounter,
}

/// The ping URL of each `[[alerts.heartbeat]]`, in order, from `lookup`
/// (the environment, at the binary's edge).
pub fn heartbeat_urls_from_env(
    config: &AlertsConfig,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Vec<SecretString>, NotifyError> {
    config
        .heartbeats
        .iter()
        .enumerate()
        .map(|(index, hb)| {
            crate::config::env_secret(&lookup, &hb.url_env).ok_or_else(|| {
                NotifyError::HeartbeatMissingEnv {
                    index,
                    var: hb.url_env.clone(),
                }
            })
        })
        .collect()
}

impl Heartbeat {
    /// Heartbeat `index` of the config, pinging `url`, which must be https
    /// (plain http only to loopback).
    pub(super) fn new(
        index: usize,
        config: &HeartbeatConfig,
        url: SecretString,
        counter: DeliveryCounter,
    ) -> Result<Heartbeat, NotifyError> {
        check_url(url.expose_secret()).map_err(|problem| NotifyError::HeartbeatInvalidUrl {
            index,
            url_env: config.url_env.clone(),
            problem,
        })?;
        Ok(Heartbeat {
            index,
            url_env: config.url_env.clone(),
            url,
            method: config.method,
            timeout: config.timeout,
            due: AtomicBool::new(false),
            in_flight: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
            counter,
        })
    }

    fn count(&self, result: PingResult) {
        self.counter.count(DeliveryEvent::Heartbeat {
            index: self.index,
            result,
        });
    }
}

impl Sink for Heartbeat {
    type Request = ();

    fn id(&self) -> &'static str {
        "heartbeat"
    }

    fn wake(&self) -> &tokio::sync::Notify {
        &self.wake
    }

    /// A successful sweep owes one ping. One per URL at a time: a receiver
    /// slower than the sweep interval gets skips, not a pile of requests.
    fn take(&self, change: &Change<'_>) -> bool {
        if !matches!(change, Change::Swept) {
            return false;
        }
        if self.in_flight.load(Ordering::Acquire) || self.due.swap(true, Ordering::AcqRel) {
            tracing::debug!(heartbeat = self.index, url_env = %self.url_env, "heartbeat ping skipped: the previous one is still in flight");
            self.count(PingResult::Skipped);
            return false;
        }
        true
    }

    fn next(&self) -> Option<()> {
        if !self.due.swap(false, Ordering::AcqRel) {
            return None;
        }
        self.in_flight.store(true, Ordering::Release);
        Some(())
    }

    fn request(&self, http: &reqwest::Client, _: &(), _: i64) -> reqwest::RequestBuilder {
        let request = match self.method {
            HeartbeatMethod::Get => http.get(self.url.expose_secret()),
            HeartbeatMethod::Post => http.post(self.url.expose_secret()),
        };
        request.timeout(self.timeout)
    }

    /// Counted and logged without the URL; never retried (the next
    /// successful sweep pings again).
    fn settle(&self, _: &(), attempt: Attempt, _: DateTime<Utc>) -> Then {
        self.in_flight.store(false, Ordering::Release);
        match attempt {
            Attempt::Delivered { .. } => {
                tracing::debug!(heartbeat = self.index, url_env = %self.url_env, "heartbeat ping sent");
                self.count(PingResult::Ok);
            }
            Attempt::Failed { error, .. } => {
                tracing::warn!(
                    heartbeat = self.index,
                    url_env = %self.url_env,
                    method = self.method.as_str(),
                    error = %error,
                    "heartbeat ping failed; the receiver pages if they keep failing"
                );
                self.count(PingResult::Failed);
            }
            Attempt::Interrupted => {}
        }
        Then::Next
    }

    fn keeps_state(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(n: usize) -> AlertsConfig {
        let mut c = AlertsConfig::default();
        for i in 0..n {
            c.heartbeats.push(crate::config::HeartbeatConfig {
                url_env: format!("HB{i}"),
                method: HeartbeatMethod::Get,
                timeout: Duration::from_secs(1),
            });
        }
        c
    }

    #[test]
    fn a_missing_or_unsafe_url_is_refused_naming_the_variable_not_the_url() {
        let c = config(1);
        let e = heartbeat_urls_from_env(&c, |_| None).unwrap_err();
        assert!(e.to_string().contains("alerts.heartbeat[0]") && e.to_string().contains("HB0"));
        let Err(e) = Heartbeat::new(
            0,
            &c.heartbeats[0],
            "http://hc.example/ping/s3cret-uuid".into(),
            DeliveryCounter::default(),
        ) else {
            panic!("plain http to a remote host was accepted");
        };
        let shown = e.to_string();
        assert!(shown.contains("HB0") && shown.contains("https"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
    }

    /// A sweep while a ping is owed or in flight is a skip, counted.
    #[test]
    fn a_ping_owed_or_in_flight_makes_the_next_sweep_a_skip() {
        let c = config(1);
        let counted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let counter = DeliveryCounter::new({
            let counted = counted.clone();
            move |e| counted.lock().unwrap().push(e)
        });
        let hb =
            Heartbeat::new(0, &c.heartbeats[0], "http://127.0.0.1:9/hb".into(), counter).unwrap();
        assert!(hb.take(&Change::Swept));
        assert!(!hb.take(&Change::Swept), "owed: skipped");
        assert_eq!(hb.next(), Some(()));
        assert!(!hb.take(&Change::Swept), "in flight: skipped");
        assert_eq!(hb.next(), None);
        let failed = Attempt::Failed {
            error: "HTTP 503".into(),
            status: Some(503),
        };
        assert_eq!(hb.settle(&(), failed, Utc::now()), Then::Next);
        assert!(hb.take(&Change::Swept), "settled: the next sweep pings");
        let skip = DeliveryEvent::Heartbeat {
            index: 0,
            result: PingResult::Skipped,
        };
        let fail = DeliveryEvent::Heartbeat {
            index: 0,
            result: PingResult::Failed,
        };
        assert_eq!(*counted.lock().unwrap(), [skip, skip, fail]);
    }
}

//! Heartbeat pings (`[[alerts.heartbeat]]`): a dead-man's switch. Each
//! configured URL is pinged after every successful sweep; the receiver
//! (healthchecks.io, Cronitor, a PagerDuty heartbeat, an Alertmanager
//! Watchdog receiver) pages when the pings stop, which is the one page a
//! daemon that is dead, wedged or unable to sweep cannot send itself.
//!
//! Owns the ping requests and their outcome counts. It must never block or
//! delay a sweep (each ping is a task of its own, bounded by its timeout; a
//! ping still in flight makes the next one of that URL a skip), never
//! follow a redirect, never write a ping URL (it embeds the check's secret)
//! into a log line or an error, and never read the environment (the URLs
//! arrive as `SecretString`s, see [`heartbeat_urls_from_env`]). Whether a
//! sweep counted as successful is the caller's to say: it calls [`Heartbeats::ping`]
//! only then.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};

use super::{NotifyError, check_url};
use crate::config::{AlertsConfig, HeartbeatMethod};
use crate::report::metrics::Metrics;

/// How a ping ended (`result` of `fleet_reconciler_heartbeat_pings_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PingResult {
    /// The receiver answered 2xx.
    Ok,
    /// A transport error, a timeout or any other status.
    Failed,
    /// The previous ping of the URL was still in flight: none was sent.
    Skipped,
}

impl PingResult {
    pub const ALL: [PingResult; 3] = [PingResult::Ok, PingResult::Failed, PingResult::Skipped];

    pub fn as_str(self) -> &'static str {
        match self {
            PingResult::Ok => "ok",
            PingResult::Failed => "failed",
            PingResult::Skipped => "skipped",
        }
    }
}

/// One configured heartbeat.
struct Target {
    index: usize,
    /// The variable the URL came from: what logs name instead of the URL.
    url_env: String,
    url: SecretString,
    method: HeartbeatMethod,
    timeout: Duration,
    in_flight: AtomicBool,
}

/// The heartbeats of `alerts.heartbeat`; cheap to clone.
#[derive(Clone)]
pub struct Heartbeats {
    targets: Arc<Vec<Target>>,
    http: reqwest::Client,
    metrics: Option<Arc<Metrics>>,
}

impl std::fmt::Debug for Heartbeats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeats")
            .field("count", &self.targets.len())
            .finish_non_exhaustive()
    }
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

impl Heartbeats {
    /// The heartbeats of `config`, pinging `urls` (one per entry, in
    /// order); each URL must be https (plain http only to loopback).
    /// Outcomes are counted in `metrics`, when given.
    pub fn new(
        config: &AlertsConfig,
        urls: Vec<SecretString>,
        metrics: Option<Arc<Metrics>>,
    ) -> Result<Heartbeats, NotifyError> {
        if urls.len() != config.heartbeats.len() {
            return Err(NotifyError::SecretsMismatch {
                expected: config.heartbeats.len(),
                got: urls.len(),
            });
        }
        let mut targets = Vec::with_capacity(urls.len());
        for (index, (hb, url)) in config.heartbeats.iter().zip(urls).enumerate() {
            check_url(url.expose_secret()).map_err(|problem| NotifyError::HeartbeatInvalidUrl {
                index,
                url_env: hb.url_env.clone(),
                problem,
            })?;
            targets.push(Target {
                index,
                url_env: hb.url_env.clone(),
                url,
                method: hb.method,
                timeout: hb.timeout,
                in_flight: AtomicBool::new(false),
            });
        }
        let http = crate::http::client_builder()
            // A ping URL is a credential: never sent on to another host.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| NotifyError::Client(crate::http::describe(&e)))?;
        if let Some(m) = &metrics {
            m.init_heartbeats(targets.len());
        }
        Ok(Heartbeats {
            targets: Arc::new(targets),
            http,
            metrics,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Pings every heartbeat in the background and returns at once. Call
    /// it after a successful sweep only. Must be called inside a Tokio
    /// runtime.
    pub fn ping(&self) {
        for i in 0..self.targets.len() {
            let Some(target) = self.targets.get(i) else {
                continue;
            };
            // One ping per URL at a time: a receiver slower than the sweep
            // interval gets skips, not a pile of requests.
            if target.in_flight.swap(true, Ordering::AcqRel) {
                tracing::debug!(heartbeat = target.index, url_env = %target.url_env, "heartbeat ping skipped: the previous one is still in flight");
                self.count(target.index, PingResult::Skipped);
                continue;
            }
            let this = self.clone();
            tokio::spawn(async move {
                let Some(target) = this.targets.get(i) else {
                    return;
                };
                let result = this.send(target).await;
                target.in_flight.store(false, Ordering::Release);
                this.count(target.index, result);
            });
        }
    }

    /// One request, bounded by the target's timeout; failures logged
    /// without the URL.
    async fn send(&self, target: &Target) -> PingResult {
        let request = match target.method {
            HeartbeatMethod::Get => self.http.get(target.url.expose_secret()),
            HeartbeatMethod::Post => self.http.post(target.url.expose_secret()),
        };
        let answer = tokio::time::timeout(target.timeout, request.timeout(target.timeout).send())
            .await
            .map_err(|_| "request timed out".to_string())
            .and_then(|r| r.map_err(|e| crate::http::describe(&e)));
        let problem = match answer {
            Ok(response) if response.status().is_success() => {
                tracing::debug!(heartbeat = target.index, url_env = %target.url_env, "heartbeat ping sent");
                return PingResult::Ok;
            }
            Ok(response) => format!("HTTP {}", response.status().as_u16()),
            Err(e) => e,
        };
        tracing::warn!(
            heartbeat = target.index,
            url_env = %target.url_env,
            method = target.method.as_str(),
            error = %problem,
            "heartbeat ping failed; the receiver pages if they keep failing"
        );
        PingResult::Failed
    }

    fn count(&self, index: usize, result: PingResult) {
        if let Some(m) = &self.metrics {
            m.record_heartbeat(index, result);
        }
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
        let e = heartbeat_urls_from_env(&config(1), |_| None).unwrap_err();
        assert!(e.to_string().contains("alerts.heartbeat[0]") && e.to_string().contains("HB0"));
        let e = Heartbeats::new(
            &config(1),
            vec!["http://hc.example/ping/s3cret-uuid".into()],
            None,
        )
        .unwrap_err();
        let shown = e.to_string();
        assert!(shown.contains("HB0") && shown.contains("https"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
    }
}

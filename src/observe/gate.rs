//! The alert gate (`[gates.alertmanager]`, #36 item 4): which of
//! Alertmanager's firing alerts match the configured matchers, read once
//! per sweep before planning.
//!
//! Owns the read of `GET <URL>/api/v2/alerts` (active, neither silenced
//! nor inhibited), which of its alerts the configured matchers (their
//! syntax is the config's, [`crate::config::Matcher`]) select, and the
//! [`GateView`] the planner judges. The
//! daemon's own alerts (label `service="fleet-reconciler"`, as
//! `report::notify::alertmanager` posts them) never close the gate: a gate
//! closed by `gate_unreachable` or `release_halted` would hold itself shut.
//! It must never decide what a firing alert blocks (that is the planner's,
//! [`crate::decide::guardrail`]), never write to Alertmanager, and never put
//! the URL in a log, an error or a view: it is a secret like the sinks'.

use std::collections::BTreeMap;
use std::fmt;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::config::{AlertGateConfig, Matcher};

/// The label every alert the daemon posts carries (`service`), and its value.
pub const OWN_ALERT_LABEL: (&str, &str) = ("service", "fleet-reconciler");

/// Alertmanager's path and query for the alerts that fire now.
pub const ALERTS_QUERY: &str = "api/v2/alerts?active=true&silenced=false&inhibited=false";

/// Labels naming an agent app, most specific first: a matching alert with
/// one of them naming a configured app blocks only that app.
pub const APP_LABELS: [&str; 2] = ["fly_app", "app"];

/// Longest list of firing alerts kept in a view (the rest are counted).
pub const MAX_FIRING_KEPT: usize = 20;

/// One alert that closes the gate: its name and labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FiringAlert {
    pub labels: BTreeMap<String, String>,
}

impl FiringAlert {
    /// The agent app it names (`fly_app`, else `app`), if any.
    pub fn app(&self) -> Option<&str> {
        APP_LABELS
            .iter()
            .find_map(|l| self.labels.get(*l))
            .map(String::as_str)
    }
}

/// `AgentErrorRate{app="x"}`: the name and the app label it names, the way
/// `plan` shows what blocks a pool (other labels are Alertmanager's to show).
impl fmt::Display for FiringAlert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // An alert without a name is still shown as one.
        f.write_str(
            self.labels
                .get("alertname")
                .map_or("(unnamed alert)", String::as_str),
        )?;
        if let Some((k, v)) = APP_LABELS
            .iter()
            .find_map(|l| self.labels.get(*l).map(|v| (*l, v)))
        {
            write!(f, "{{{k}={v:?}}}")?;
        }
        Ok(())
    }
}

/// What the sweep saw of the gate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum GateView {
    /// No `[gates.alertmanager]`.
    #[default]
    NotConfigured,
    /// Read: these alerts match every matcher (none: the gate is open).
    /// `more`: matching alerts beyond [`MAX_FIRING_KEPT`].
    Read {
        firing: Vec<FiringAlert>,
        more: usize,
    },
    /// Alertmanager could not be read (why, without the URL).
    Unreachable(String),
}

#[derive(Debug, thiserror::Error)]
pub enum GateError {
    /// The URL in `var` is not one the gate reads (never quoted).
    #[error("the URL in {var} (gates.alertmanager.url_env) {why}")]
    Url { var: String, why: &'static str },
    #[error("cannot build the HTTP client of gates.alertmanager: {0}")]
    Client(#[source] reqwest::Error),
}

/// Reads the gate: one GET per sweep.
#[derive(Clone)]
pub struct AlertGate {
    http: reqwest::Client,
    /// `<base>/api/v2/alerts?…` (a secret).
    endpoint: SecretString,
    matchers: Vec<Matcher>,
}

impl fmt::Debug for AlertGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlertGate")
            .field("matchers", &self.matchers)
            .finish_non_exhaustive()
    }
}

/// The base URL as a gate or sink may use it: http(s), a host, no
/// credentials, query or fragment; plain http only on loopback or Fly's
/// private network (`*.internal`).
pub fn alertmanager_base(url: &str) -> Result<url::Url, &'static str> {
    let parsed = url::Url::parse(url.trim()).map_err(|_| "is not a valid URL")?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err("is not an http(s) URL");
    }
    let Some(host) = parsed.host() else {
        return Err("has no host");
    };
    let private = crate::http::is_loopback(&host)
        || matches!(&host, url::Host::Domain(d) if d.to_ascii_lowercase().ends_with(".internal"));
    if parsed.scheme() == "http" && !private {
        return Err(
            "is http:// to a host that is neither loopback nor on Fly's private network (*.internal): use https://",
        );
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err("carries user credentials, which are not supported");
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err("has a query or fragment (give Alertmanager's base URL)");
    }
    Ok(parsed)
}

/// One alert as `GET /api/v2/alerts` returns it (`gettableAlert`), only
/// what the gate reads.
#[derive(Deserialize)]
struct GettableAlert {
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    status: Option<AlertStatus>,
}

#[derive(Deserialize)]
struct AlertStatus {
    #[serde(default)]
    state: String,
}

impl AlertGate {
    pub fn new(config: &AlertGateConfig, url: &SecretString) -> Result<AlertGate, GateError> {
        let base = alertmanager_base(url.expose_secret()).map_err(|why| GateError::Url {
            var: config.url_env.clone(),
            why,
        })?;
        let endpoint = format!("{}/{ALERTS_QUERY}", base.as_str().trim_end_matches('/'));
        let http = crate::http::client_builder()
            .timeout(config.timeout.get())
            .build()
            .map_err(GateError::Client)?;
        Ok(AlertGate {
            http,
            endpoint: endpoint.into(),
            matchers: config.matchers.clone(),
        })
    }

    /// The alerts that close the gate now, or why Alertmanager could not be
    /// read. One request: a failure is for the next sweep to retry.
    pub async fn read(&self) -> GateView {
        let resp = match self.http.get(self.endpoint.expose_secret()).send().await {
            Ok(r) => r,
            Err(e) => {
                return GateView::Unreachable(format!(
                    "GET /api/v2/alerts: {}",
                    crate::http::describe(&e)
                ));
            }
        };
        if !resp.status().is_success() {
            return GateView::Unreachable(format!(
                "GET /api/v2/alerts answered HTTP {}",
                resp.status()
            ));
        }
        match resp.json::<Vec<GettableAlert>>().await {
            Ok(alerts) => self.judge(alerts),
            Err(e) => GateView::Unreachable(format!(
                "GET /api/v2/alerts: not a list of alerts ({})",
                crate::http::describe(&e)
            )),
        }
    }

    fn judge(&self, alerts: Vec<GettableAlert>) -> GateView {
        let mut firing: Vec<FiringAlert> = alerts
            .into_iter()
            // The query asks for active alerts only; a `suppressed` one
            // answered anyway (an older Alertmanager) does not count.
            .filter(|a| a.status.as_ref().is_none_or(|s| s.state != "suppressed"))
            .filter(|a| !is_own(&a.labels))
            .filter(|a| self.matchers.iter().all(|m| m.matches(&a.labels)))
            .map(|a| FiringAlert { labels: a.labels })
            .collect();
        firing.sort_by_key(|a| a.to_string());
        firing.dedup();
        let more = firing.len().saturating_sub(MAX_FIRING_KEPT);
        firing.truncate(MAX_FIRING_KEPT);
        GateView::Read { firing, more }
    }
}

/// Whether an alert is one the daemon posted itself.
fn is_own(labels: &BTreeMap<String, String>) -> bool {
    let (k, v) = OWN_ALERT_LABEL;
    labels.get(k).is_some_and(|s| s == v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn gate(matchers: &[&str]) -> AlertGate {
        let config = AlertGateConfig {
            url_env: "AM".into(),
            matchers: matchers
                .iter()
                .map(|m| Matcher::parse(m).unwrap())
                .collect(),
            fail_open: false,
            timeout: crate::config::NonZeroDuration::from_secs(10),
        };
        AlertGate::new(&config, &SecretString::from("http://127.0.0.1:9093")).unwrap()
    }

    fn alert(pairs: &[(&str, &str)], state: &str) -> GettableAlert {
        GettableAlert {
            labels: labels(pairs),
            status: Some(AlertStatus {
                state: state.into(),
            }),
        }
    }

    #[test]
    fn only_alerts_matching_every_matcher_and_not_our_own_close_the_gate() {
        let g = gate(&[r#"severity="critical""#, r#"alertname=~"Agent.*""#]);
        let view = g.judge(vec![
            alert(
                &[
                    ("alertname", "AgentErrorRate"),
                    ("severity", "critical"),
                    ("app", "x"),
                ],
                "active",
            ),
            alert(
                &[("alertname", "AgentErrorRate"), ("severity", "warning")],
                "active",
            ),
            alert(
                &[("alertname", "DiskFull"), ("severity", "critical")],
                "active",
            ),
            alert(
                &[("alertname", "AgentSlow"), ("severity", "critical")],
                "suppressed",
            ),
            alert(
                &[
                    ("alertname", "Agent_own"),
                    ("severity", "critical"),
                    ("service", "fleet-reconciler"),
                ],
                "active",
            ),
        ]);
        let GateView::Read { firing, more } = view else {
            panic!("{view:?}");
        };
        assert_eq!(more, 0);
        let shown: Vec<String> = firing.iter().map(|a| a.to_string()).collect();
        assert_eq!(shown, [r#"AgentErrorRate{app="x"}"#]);
        assert_eq!(firing[0].app(), Some("x"));
    }

    #[test]
    fn a_bad_url_is_refused_without_quoting_it() {
        let config = AlertGateConfig {
            url_env: "AM_URL".into(),
            matchers: vec![Matcher::parse("a=b").unwrap()],
            fail_open: false,
            timeout: crate::config::NonZeroDuration::from_secs(10),
        };
        for url in [
            "http://am.example.com:9093/secret-path",
            "ftp://127.0.0.1/",
            "https://u:p@am.example.com/",
        ] {
            let e = AlertGate::new(&config, &SecretString::from(url)).unwrap_err();
            let text = e.to_string();
            assert!(text.contains("AM_URL"), "{text}");
            assert!(
                !text.contains("example") && !text.contains("127.0.0.1"),
                "{text}"
            );
        }
        let ok =
            AlertGate::new(&config, &SecretString::from("https://am.example.com/base/")).unwrap();
        assert_eq!(
            ok.endpoint.expose_secret(),
            "https://am.example.com/base/api/v2/alerts?active=true&silenced=false&inhibited=false"
        );
        assert!(!format!("{ok:?}").contains("example"));
    }
}

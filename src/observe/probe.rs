//! Health probes: concurrent, bounded polling of agents' health endpoints.
//!
//! Owns the agent side of docs/design.md §4: one GET per started machine, bounded
//! concurrency over one connection budget (`probe.concurrency` open
//! connections at most, for the whole sweep: idle connections are kept only
//! when every host of a sweep fits the budget, and then each host keeps its
//! share of it, so a fleet of 10,000 agents does not hold 10,000 sockets
//! between sweeps, nor two hosts twice the budget), a per-request deadline covering the
//! whole exchange, a body cap enforced while reading (the rest is never
//! buffered), and strict parsing of the report. A bad agent yields a
//! per-machine outcome, never an error for the sweep. It must never send the
//! Fly token or the agent control token on a health GET, and never decide
//! anything from a report.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::config::ProbeConfig;
use crate::observe::DurationObserver;
use crate::text::{MAX_DETAIL_CHARS, MAX_TAG_CHARS, bounded, json_error};

/// Whether the agent is in the middle of a turn or job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Activity {
    Idle,
    Busy,
}

/// Optional cooperative endpoints an agent serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Capability {
    Drain,
    Reload,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct RotationState {
    #[serde(default)]
    pub fenced: bool,
    #[serde(default)]
    pub checkpoint: Option<String>,
}

/// A parsed, validated health report.
// Read from an agent only through its validated wire form (`WireReport`);
// `Deserialize` reads back what this daemon wrote of it (the machine
// detail `status` reads).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct AgentReport {
    /// Lowercase hex, 4 to 40 digits.
    // Shared: a sweep gives every report of the same text one copy
    // (`observe::sweep::Texts`), which its row's `reported_ref` names too.
    #[serde(serialize_with = "shared_text", deserialize_with = "owned_text")]
    #[schemars(with = "String")]
    pub overlay_ref: Arc<str>,
    pub activity: Option<Activity>,
    pub live_sessions: Option<u64>,
    pub last_input_at: Option<DateTime<Utc>>,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub capabilities: Vec<Capability>,
    pub rotation: Option<RotationState>,
}

/// A shared text, written as the text.
fn shared_text<S: serde::Serializer>(text: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(text)
}

/// A text read back, shared from then on.
fn owned_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Arc<str>, D::Error> {
    String::deserialize(d).map(Arc::from)
}

impl AgentReport {
    /// docs/design.md §4: live work is open sessions or a turn in progress.
    pub fn has_live_work(&self) -> bool {
        self.live_sessions.unwrap_or(0) > 0 || self.activity == Some(Activity::Busy)
    }

    pub fn can(&self, capability: Capability) -> bool {
        self.capabilities.contains(&capability)
    }
}

/// The report as sent; unknown fields are ignored so agents can add their own.
#[derive(Deserialize)]
struct WireReport {
    overlay_ref: Option<String>,
    #[serde(default)]
    activity: Option<Activity>,
    #[serde(default)]
    live_sessions: Option<u64>,
    #[serde(default)]
    last_input_at: Option<DateTime<Utc>>,
    #[serde(default)]
    heartbeat_at: Option<DateTime<Utc>>,
    #[serde(default)]
    capabilities: Option<Vec<WireCapability>>,
    #[serde(default)]
    rotation: Option<RotationState>,
}

/// Capabilities this daemon does not know are ignored, not an error.
#[derive(Deserialize)]
#[serde(untagged)]
enum WireCapability {
    Known(Capability),
    Other(#[allow(dead_code)] String),
}

/// What probing one machine produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    Report(AgentReport),
    /// No answer: refused, timed out, or an HTTP error status.
    Unreachable(String),
    /// An answer that is not a usable report.
    BadReport(String),
}

#[derive(Debug, thiserror::Error)]
#[error("cannot build the probe HTTP client: {0}")]
pub struct ProbeBuildError(#[from] reqwest::Error);

/// Polls agents' health endpoints.
#[derive(Clone)]
pub struct Prober {
    /// Keeps idle connections, for sweeps whose hosts fit the budget: at
    /// most the budget over the hosts per host (the share it was built
    /// with), so all of them together keep at most the budget. hyper's pool
    /// caps idle connections per host only, and the host that goes first
    /// would otherwise keep the whole budget idle while the next opens its
    /// own. Rebuilt (its pool dropped) when a sweep's share differs.
    pooled: Arc<Mutex<Option<(usize, reqwest::Client)>>>,
    /// Closes each connection after its answer: for sweeps with more hosts
    /// than the budget (each agent is a host of its own on 6PN), where idle
    /// connections would pile up to one per agent, and for single probes
    /// (the executor's after a restart), which have nothing to reuse.
    one_shot: reqwest::Client,
    /// Whether the pooled connections are kept after a sweep's probes, for
    /// the next sweep: not in a process that sweeps once ([`Prober::once`]),
    /// where they would only hold their buffers (about 32 KiB each) through
    /// the analysis and the report that follow.
    keep_idle: bool,
    connect_timeout: Duration,
    timeout: Duration,
    max_body: usize,
    concurrency: usize,
    observer: Option<DurationObserver>,
}

impl std::fmt::Debug for Prober {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prober")
            .field("timeout", &self.timeout)
            .field("max_body", &self.max_body)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl Prober {
    pub fn new(config: &ProbeConfig) -> Result<Prober, ProbeBuildError> {
        let connect_timeout = config.timeout.get();
        Ok(Prober {
            pooled: Arc::default(),
            one_shot: client(connect_timeout, 0)?,
            keep_idle: true,
            connect_timeout,
            timeout: config.timeout.get(),
            max_body: config.max_body_bytes.get(),
            concurrency: config.concurrency.get(),
            observer: None,
        })
    }

    /// This prober for a process that sweeps once (`check`, `plan`): its
    /// connections are closed when a sweep's probes are done, not kept
    /// for a next sweep that never comes. It shares no pool with `self`.
    pub fn once(&self) -> Prober {
        Prober {
            pooled: Arc::default(),
            keep_idle: false,
            ..self.clone()
        }
    }

    /// Tells `observer` how long each probe took and how it ended
    /// (`report`, `unreachable`, `bad_report`).
    pub fn with_observer(mut self, observer: DurationObserver) -> Prober {
        self.observer = Some(observer);
        self
    }

    /// Probes every URL with at most `concurrency` in flight, and at most
    /// `concurrency` connections open during and after the sweep; outcomes
    /// come back in the order of `urls`. Apps take turns (`urls` is in app
    /// order; each app's `n`-th machine goes before any app's `n+1`-th), so
    /// one huge app does not make a small one wait for all of it.
    pub async fn probe_all(&self, urls: Vec<String>) -> Vec<ProbeOutcome> {
        let mut out: Vec<Option<ProbeOutcome>> = vec![None; urls.len()];
        self.probe_each(urls.into_iter().enumerate().collect(), |i, _, outcome| {
            if let Some(slot) = out.get_mut(i) {
                *slot = Some(outcome);
            }
        })
        .await;
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| ProbeOutcome::Unreachable("not probed".into())))
            .collect()
    }

    /// Probes each `(key, url)` and hands `each` the key, the URL back and
    /// the outcome as it is read, in the order the answers come: a sweep
    /// puts each outcome on its row at once instead of holding them all.
    pub async fn probe_each<K>(
        &self,
        urls: Vec<(K, String)>,
        mut each: impl FnMut(K, String, ProbeOutcome),
    ) {
        let hosts = distinct_hosts(urls.iter().map(|(_, u)| u.as_str()), self.concurrency);
        let http = if (1..=self.concurrency).contains(&hosts) {
            self.pooled(self.concurrency / hosts)
        } else {
            self.one_shot.clone()
        };
        let http = &http;
        let mut results = futures::stream::iter(urls)
            .map(|(key, url)| async move {
                let outcome = self.probe_with(http, &url).await;
                (key, url, outcome)
            })
            .buffer_unordered(self.concurrency);
        while let Some((key, url, outcome)) = results.next().await {
            each(key, url, outcome);
        }
        if !self.keep_idle {
            // The pool goes with the last handle on it (`http`, just after).
            drop(
                self.pooled
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take(),
            );
        }
    }

    /// Probes one health URL, on a connection of its own.
    pub async fn probe(&self, url: &str) -> ProbeOutcome {
        self.probe_with(&self.one_shot, url).await
    }

    /// The client keeping at most `per_host` idle connections per host.
    fn pooled(&self, per_host: usize) -> reqwest::Client {
        let mut pooled = self.pooled.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((share, http)) = pooled.as_ref()
            && *share == per_host
        {
            return http.clone();
        }
        match client(self.connect_timeout, per_host) {
            Ok(http) => {
                *pooled = Some((per_host, http.clone()));
                http
            }
            // The same settings built at start; should they not now,
            // connections are not kept.
            Err(_) => self.one_shot.clone(),
        }
    }

    /// One probe with `http` (pooled or one-shot), timed for the observer.
    async fn probe_with(&self, http: &reqwest::Client, url: &str) -> ProbeOutcome {
        let started = tokio::time::Instant::now();
        let outcome = self.probe_unobserved(http, url).await;
        if let Some(o) = &self.observer {
            let kind = match &outcome {
                ProbeOutcome::Report(_) => "report",
                ProbeOutcome::Unreachable(_) => "unreachable",
                ProbeOutcome::BadReport(_) => "bad_report",
            };
            o(kind, started.elapsed());
        }
        outcome
    }

    async fn probe_unobserved(&self, http: &reqwest::Client, url: &str) -> ProbeOutcome {
        match tokio::time::timeout(self.timeout, self.fetch(http, url)).await {
            Err(_) => ProbeOutcome::Unreachable(format!(
                "no complete answer within {}",
                humantime::format_duration(self.timeout)
            )),
            Ok(Err(outcome)) => outcome.bounded(),
            Ok(Ok(body)) => parse_report(&body),
        }
    }

    async fn fetch(&self, http: &reqwest::Client, url: &str) -> Result<Vec<u8>, ProbeOutcome> {
        let mut resp = http
            .get(url)
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(|e| ProbeOutcome::Unreachable(crate::http::describe(&e)))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(ProbeOutcome::Unreachable(format!(
                "health endpoint answered HTTP {status}"
            )));
        }
        let too_big =
            || ProbeOutcome::BadReport(format!("report larger than {} bytes", self.max_body));
        if resp
            .content_length()
            .is_some_and(|n| n > self.max_body as u64)
        {
            return Err(too_big());
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| ProbeOutcome::Unreachable(crate::http::describe(&e)))?
        {
            if body.len() + chunk.len() > self.max_body {
                // Dropping the response closes the connection: the rest is never read.
                return Err(too_big());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }
}

/// A client for health GETs keeping at most `idle_per_host` idle
/// connections per host (none: each closed after its answer).
fn client(
    connect_timeout: Duration,
    idle_per_host: usize,
) -> Result<reqwest::Client, reqwest::Error> {
    crate::http::client_builder()
        .connect_timeout(connect_timeout)
        .redirect(reqwest::redirect::Policy::none())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(idle_per_host)
        .build()
}

/// How many distinct hosts (scheme, host, port) `urls` name, counted up
/// to just past `limit`.
fn distinct_hosts<'a>(urls: impl Iterator<Item = &'a str>, limit: usize) -> usize {
    let mut hosts = std::collections::HashSet::new();
    for u in urls {
        // What precedes the path: `http://host:port`.
        let origin = u
            .find("://")
            .map(|s| s + 3)
            .and_then(|start| u[start..].find('/').map(|end| &u[..start + end]))
            .unwrap_or(u);
        hosts.insert(origin);
        if hosts.len() > limit {
            break;
        }
    }
    hosts.len()
}

impl ProbeOutcome {
    /// Every text that came from outside, bounded.
    fn bounded(self) -> ProbeOutcome {
        match self {
            ProbeOutcome::Unreachable(why) => {
                ProbeOutcome::Unreachable(bounded(&why, MAX_DETAIL_CHARS))
            }
            ProbeOutcome::BadReport(why) => {
                ProbeOutcome::BadReport(bounded(&why, MAX_DETAIL_CHARS))
            }
            report => report,
        }
    }
}

/// Parses and validates a report body (docs/design.md §4). Texts are bounded
/// ([`MAX_DETAIL_CHARS`], [`MAX_TAG_CHARS`]).
pub fn parse_report(body: &[u8]) -> ProbeOutcome {
    parse_unbounded(body).bounded()
}

/// Why a JSON text is not a `T`: the field at fault (dotted path) and what
/// is wrong with it.
fn parse_unbounded(body: &[u8]) -> ProbeOutcome {
    let mut de = serde_json::Deserializer::from_slice(body);
    let wire: WireReport = match serde_path_to_error::deserialize(&mut de) {
        Ok(w) => w,
        Err(e) => return ProbeOutcome::BadReport(json_error(e, "report")),
    };
    if de.end().is_err() {
        return ProbeOutcome::BadReport("trailing data after the JSON report".into());
    }
    let Some(r) = wire.overlay_ref else {
        return ProbeOutcome::BadReport("missing required field `overlay_ref`".into());
    };
    let r = r.trim();
    // docs/agent-contract.md: 4 to 40 hex digits. Shorter is no usable
    // abbreviation: it is a bad report, not an ambiguous ref.
    if !(4..=40).contains(&r.len()) || !r.bytes().all(|b| b.is_ascii_hexdigit()) {
        let shown: String = r.chars().take(64).collect();
        return ProbeOutcome::BadReport(format!(
            "`overlay_ref` {shown:?} is not a hex commit id (4 to 40 hex digits)"
        ));
    }
    if let Some(tag) = wire.rotation.as_ref().and_then(|r| r.checkpoint.as_deref())
        && tag.chars().count() > MAX_TAG_CHARS
    {
        return ProbeOutcome::BadReport(format!(
            "`rotation.checkpoint` is longer than {MAX_TAG_CHARS} characters"
        ));
    }
    ProbeOutcome::Report(AgentReport {
        overlay_ref: r.to_ascii_lowercase().into(),
        activity: wire.activity,
        live_sessions: wire.live_sessions,
        last_input_at: wire.last_input_at,
        heartbeat_at: wire.heartbeat_at,
        capabilities: known_capabilities(wire.capabilities.unwrap_or_default()),
        rotation: wire.rotation,
    })
}

/// The capabilities this daemon knows, each once, in the order first
/// listed: a report repeating one thousands of times stores it once.
fn known_capabilities(listed: Vec<WireCapability>) -> Vec<Capability> {
    let mut out = Vec::new();
    for c in listed {
        if let WireCapability::Known(c) = c
            && !out.contains(&c)
        {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_counted_by_origin_up_to_just_past_the_limit() {
        let urls: Vec<String> = [
            "http://10.0.0.1:8080/health",
            "http://10.0.0.1:8080/other",
            "http://10.0.0.1:8081/health",
            "http://[fdaa::1]:8080/health",
            "https://10.0.0.2/health",
            "no-scheme",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(distinct_hosts(urls.iter().map(String::as_str), 100), 5);
        assert_eq!(
            distinct_hosts(urls.iter().map(String::as_str), 2),
            3,
            "stops once past the limit"
        );
    }

    fn bad(body: &str) -> String {
        match parse_report(body.as_bytes()) {
            ProbeOutcome::BadReport(m) => m,
            other => panic!("expected bad_report for {body}, got {other:?}"),
        }
    }

    #[test]
    fn minimal_and_full_reports_parse() {
        let ProbeOutcome::Report(r) = parse_report(br#"{"overlay_ref":"A4F9D2B"}"#) else {
            panic!("minimal report rejected")
        };
        assert_eq!(&*r.overlay_ref, "a4f9d2b");
        assert!(!r.has_live_work());
        let ProbeOutcome::Report(r) = parse_report(
            br#"{"overlay_ref":"a4f9d2b","activity":"busy","live_sessions":0,
                "last_input_at":"2026-11-29T10:00:00+01:00","heartbeat_at":"2026-11-29T09:00:01Z",
                "capabilities":["drain","teleport"],"rotation":{"fenced":true,"checkpoint":"t1"},
                "model":"x"}"#,
        ) else {
            panic!("full report rejected")
        };
        assert!(r.has_live_work());
        assert_eq!(r.capabilities, vec![Capability::Drain]);
        assert_eq!(
            r.last_input_at.unwrap().to_rfc3339(),
            "2026-11-29T09:00:00+00:00"
        );
        assert_eq!(r.rotation.unwrap().checkpoint.as_deref(), Some("t1"));
    }

    #[test]
    fn bad_reports_name_the_problem() {
        assert!(bad("<html>oops</html>").contains("not a JSON report"));
        assert!(bad(r#"{"activity":"idle"}"#).contains("overlay_ref"));
        assert!(bad(r#"{"overlay_ref":"release-2026-11"}"#).contains("not a hex commit id"));
        assert!(bad(r#"{"overlay_ref":""}"#).contains("not a hex"));
        // The contract says 4 to 40 digits: a shorter ref names no commit
        // reliably (and would pass for "on target" by prefix).
        for short in ["a", "ab", "abc"] {
            let why = bad(&format!(r#"{{"overlay_ref":"{short}"}}"#));
            assert!(why.contains("4 to 40 hex digits"), "{why}");
        }
        assert!(matches!(
            parse_report(br#"{"overlay_ref":"abcd"}"#),
            ProbeOutcome::Report(_)
        ));
        assert!(bad(&format!(r#"{{"overlay_ref":"{}"}}"#, "a".repeat(41))).contains("not a hex"));
        assert!(bad(r#"{"overlay_ref":7}"#).contains("overlay_ref"));
        assert!(bad(r#"{"overlay_ref":"abcd","activity":"sleeping"}"#).contains("activity"));
        assert!(bad(r#"{"overlay_ref":"abcd","live_sessions":-1}"#).contains("live_sessions"));
        assert!(
            bad(r#"{"overlay_ref":"abcd","heartbeat_at":"yesterday"}"#).contains("heartbeat_at")
        );
        assert!(bad(r#"{"overlay_ref":"abcd"} trailing"#).contains("trailing"));
    }

    #[test]
    fn agent_text_is_bounded() {
        // A parse error quoting a 60 KB value keeps 256 characters of it.
        let huge = "x".repeat(60_000);
        let why = bad(&format!(r#"{{"overlay_ref":"abcd","activity":"{huge}"}}"#));
        assert!(why.contains("activity"), "{why}");
        assert_eq!(why.chars().count(), MAX_DETAIL_CHARS + 1, "{why}");
        assert!(why.ends_with('…'));
        let why = bad(&format!(
            r#"{{"overlay_ref":"abcd","rotation":{{"fenced":true,"checkpoint":"{huge}"}}}}"#
        ));
        assert!(why.contains("rotation.checkpoint"), "{why}");
        // Multi-byte text is cut on a character boundary.
        assert_eq!(bounded("héllo", 2), "hé…");
        assert_eq!(bounded("hé", 2), "hé");
    }
}

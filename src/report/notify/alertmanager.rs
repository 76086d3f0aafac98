//! The Alertmanager sink (`[[alerts.alertmanager]]`): the daemon's incidents
//! posted to Alertmanager's `POST /api/v2/alerts`, the way Prometheus does.
//!
//! Owns the wire shape (labels, annotations, `startsAt`, `endsAt`,
//! `generatorURL`), which alerts one Alertmanager has been told are firing
//! (with their `startsAt`, kept across restarts in the alert state file),
//! the resolves it is owed, and its request; it is a `sink::Sink`, delivered
//! by the notifier's one path (a failed post is retried after
//! `retry_interval`). Every update re-sends
//! every firing alert with `endsAt` its data's time plus
//! `alerts.stale_after` (so a live one stays open, and one from a replica
//! that went quiet or stale expires by itself); an alert that cleared is
//! sent once more with `endsAt` now, until Alertmanager has accepted that.
//! An incident the notifier's freshness rule froze (`AlertChange::frozen`:
//! drawn from a view older than `alerts.stale_after`) is neither re-posted
//! nor resolved; this file applies that verdict and never judges staleness
//! itself. It must never block an `update` (it only takes a short lock),
//! never write the URL into a log, an error or the state file, and never
//! read the clock for alert times (`now` is passed in).

use std::collections::BTreeMap;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use super::counter::{DeliveryCounter, DeliveryResult};
use super::links::{MACHINE_URL, RUNBOOK_URL, STATUS_URL};
use super::lock;
use super::sink::{AlertChange, Attempt, Change, Sink, Then};
use crate::config::AlertmanagerConfig;
use crate::decide::incidents::Grouped;
use crate::events::DedupKey;
use crate::model::{AppName, CommitId, MachineId, Severity};
use crate::observe::gate::OWN_ALERT_LABEL;

/// Alertmanager's endpoint for posting alerts, under the configured base URL.
pub const ALERTMANAGER_PATH: &str = "api/v2/alerts";

/// Details that are links or identity (shown as labels or annotations of
/// their own), left out of the description.
const NOT_DESCRIBED: [&str; 3] = [RUNBOOK_URL, STATUS_URL, MACHINE_URL];

/// One alert as Alertmanager's API v2 takes it (`postableAlert`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct AmAlert {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    #[serde(rename = "startsAt")]
    pub starts_at: DateTime<Utc>,
    /// On a resolve, when it cleared; on a firing alert, until when the
    /// data it was drawn from may be asserted (its view's time plus
    /// `alerts.stale_after`, as Prometheus sets it a few intervals ahead):
    /// an alert of a replica that stops speaking expires by itself.
    #[serde(rename = "endsAt", default, skip_serializing_if = "Option::is_none")]
    pub ends_at: Option<DateTime<Utc>>,
    #[serde(
        rename = "generatorURL",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub generator_url: String,
}

impl AmAlert {
    /// Alertmanager's identity of an alert: its label set.
    fn fingerprint(&self) -> String {
        self.labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// One Alertmanager's part of the alert state file, matched to the config
/// by `url_env`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct SavedAm {
    pub url_env: String,
    /// Group key → the alert last posted as firing.
    #[serde(default)]
    pub firing: BTreeMap<DedupKey, AmAlert>,
    /// Fingerprint → a resolve (with `endsAt`) not yet accepted.
    #[serde(default)]
    pub resolving: BTreeMap<String, AmAlert>,
}

#[derive(Default)]
struct AmState {
    firing: BTreeMap<DedupKey, AmAlert>,
    /// Firing alerts of data too old to speak from: neither re-posted nor
    /// resolved (their last `endsAt` ends them in Alertmanager); kept for
    /// their `startsAt` should the data come back.
    quiet: std::collections::BTreeSet<DedupKey>,
    resolving: BTreeMap<String, AmAlert>,
    /// A post is due (set by every `update` that has anything to say).
    due: bool,
    delivered: u64,
    failed_attempts: u64,
    /// The last post failed (one WARN per episode, an INFO when it works again).
    failing: bool,
}

/// Counters of one Alertmanager sink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlertmanagerStats {
    pub index: usize,
    /// Alerts posted as firing now.
    pub firing: usize,
    /// Resolves not yet accepted.
    pub resolving: usize,
    /// Posts accepted.
    pub delivered: u64,
    pub failed_attempts: u64,
}

pub(super) struct AmSink {
    pub index: usize,
    pub url_env: String,
    min_severity: Severity,
    /// `alerts.alertmanager[].labels`, added to every alert.
    extra_labels: BTreeMap<String, String>,
    /// `<base>/api/v2/alerts` (a secret like the webhooks' URLs).
    endpoint: SecretString,
    state: Mutex<AmState>,
    pub wake: tokio::sync::Notify,
    /// Counts each post, where it is made.
    counter: DeliveryCounter,
}

/// The labels of an incident: its identity only (never message text), so
/// that one incident is one Alertmanager alert. `fly_app` (not `app`, which
/// a scrape sets to the reconciler's own app) names the agents' app.
fn labels(g: &Grouped) -> BTreeMap<String, String> {
    let a = &g.alert;
    let mut labels = BTreeMap::from([
        ("alertname".to_owned(), a.kind.trigger_name().to_owned()),
        ("severity".to_owned(), a.severity.as_str().to_owned()),
        // The alert gate knows our own alerts by this label and never
        // blocks on them.
        (OWN_ALERT_LABEL.0.to_owned(), OWN_ALERT_LABEL.1.to_owned()),
    ]);
    let mut put = |k: &str, v: Option<&str>| {
        if let Some(v) = v {
            labels.insert(k.to_owned(), v.to_owned());
        }
    };
    put("fly_app", a.app.as_ref().map(AppName::as_str));
    put("tip", a.commit.as_ref().map(CommitId::as_str));
    put("machine_id", a.machine_id.as_ref().map(MachineId::as_str));
    // A pool and region are identity of a machine alert, and of a group
    // keyed by pool; a group spanning pools has no pool label.
    let per_machine = a.machine_id.is_some();
    if per_machine || g.key.as_str().contains("/pool=") {
        put("pool", a.details.get("pool").map(String::as_str));
    }
    if per_machine {
        put("fly_region", a.details.get("region").map(String::as_str));
    }
    labels
}

fn annotations(g: &Grouped) -> BTreeMap<String, String> {
    let a = &g.alert;
    let description: Vec<String> = a
        .details
        .iter()
        .filter(|(k, _)| !NOT_DESCRIBED.contains(&k.as_str()))
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    let mut out = BTreeMap::from([
        ("summary".to_owned(), a.summary.clone()),
        ("description".to_owned(), description.join("\n")),
    ]);
    for key in NOT_DESCRIBED {
        if let Some(url) = a.details.get(key) {
            out.insert(key.to_owned(), url.clone());
        }
    }
    out
}

impl AmSink {
    pub fn new(
        index: usize,
        config: &AlertmanagerConfig,
        url: &str,
        counter: DeliveryCounter,
    ) -> Result<AmSink, &'static str> {
        // The same rules as the alert gate's reads of Alertmanager.
        let mut parsed = crate::observe::gate::alertmanager_base(url)?;
        if let Ok(mut path) = parsed.path_segments_mut() {
            path.pop_if_empty().extend(ALERTMANAGER_PATH.split('/'));
        }
        Ok(AmSink {
            index,
            url_env: config.url_env.clone(),
            min_severity: config.min_severity,
            extra_labels: config.labels.clone(),
            endpoint: parsed.to_string().into(),
            state: Mutex::new(AmState::default()),
            wake: tokio::sync::Notify::new(),
            counter,
        })
    }

    /// Takes the incidents holding at `now`: keeps `startsAt` of those
    /// already firing, owes a resolve for those gone, and makes a post due.
    /// Incidents `frozen` (the freshness rule's verdict), and those whose
    /// `until` (each alert's `endsAt`) is not ahead of `now`, are left alone
    /// (not posted, not resolved).
    fn update(&self, change: &AlertChange<'_>) -> bool {
        let AlertChange {
            current,
            frozen,
            until,
            now,
            ..
        } = *change;
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.quiet.clear();
        let wanted: BTreeMap<&DedupKey, &Grouped> = current
            .iter()
            .filter(|(_, g)| g.alert.severity >= self.min_severity)
            .filter(|(key, _)| {
                // An `endsAt` not ahead of now would end the alert: to
                // Alertmanager the youngest post wins, so from this replica
                // it would resolve what a fresher one still asserts.
                let quiet = frozen.contains(*key) || until.get(*key).is_none_or(|u| *u <= now);
                if quiet {
                    st.quiet.insert((*key).clone());
                }
                !quiet
            })
            .collect();
        // Gone, but frozen (last drawn from a view now stale: its hold-down
        // ended while this replica could not see): not this replica's to
        // resolve.
        for key in st.firing.keys() {
            if !wanted.contains_key(key) && frozen.contains(key) {
                st.quiet.insert(key.clone());
            }
        }
        let gone: Vec<DedupKey> = st
            .firing
            .keys()
            .filter(|k| !wanted.contains_key(k) && !st.quiet.contains(*k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(mut a) = st.firing.remove(&key) {
                a.ends_at = Some(now);
                st.resolving.insert(a.fingerprint(), a);
            }
        }
        for (key, g) in wanted {
            let mut labels = labels(g);
            for (k, v) in &self.extra_labels {
                labels.entry(k.clone()).or_insert_with(|| v.clone());
            }
            let annotations = annotations(g);
            let starts_at = match st.firing.get(key) {
                Some(old) if old.labels == labels => old.starts_at,
                Some(old) => {
                    // New identity (its severity changed): the old alert ends.
                    let mut old = old.clone();
                    old.ends_at = Some(now);
                    st.resolving.insert(old.fingerprint(), old);
                    now
                }
                None => now,
            };
            let alert = AmAlert {
                generator_url: annotations
                    .get(MACHINE_URL)
                    .or_else(|| annotations.get(STATUS_URL))
                    .cloned()
                    .unwrap_or_default(),
                labels,
                annotations,
                starts_at,
                ends_at: until.get(key).copied(),
            };
            // Firing again before its resolve went out: the resolve is moot.
            st.resolving.remove(&alert.fingerprint());
            st.firing.insert(key.clone(), alert);
        }
        st.due = st.firing.keys().any(|k| !st.quiet.contains(k)) || !st.resolving.is_empty();
        st.due
    }

    pub fn stats(&self) -> AlertmanagerStats {
        let st = lock(&self.state);
        AlertmanagerStats {
            index: self.index,
            firing: st.firing.len(),
            resolving: st.resolving.len(),
            delivered: st.delivered,
            failed_attempts: st.failed_attempts,
        }
    }

    pub fn saved(&self) -> SavedAm {
        let st = lock(&self.state);
        SavedAm {
            url_env: self.url_env.clone(),
            firing: st.firing.clone(),
            resolving: st.resolving.clone(),
        }
    }

    pub fn restore(&self, saved: SavedAm) {
        let mut st = lock(&self.state);
        st.firing = saved.firing;
        st.resolving = saved.resolving;
        // Owed resolves go out at once; firing alerts with the first update.
        st.due = !st.resolving.is_empty();
    }
}

impl Sink for AmSink {
    /// Every firing alert and owed resolve, in one post.
    type Request = Vec<AmAlert>;

    fn id(&self) -> &'static str {
        "alertmanager"
    }

    fn wake(&self) -> &tokio::sync::Notify {
        &self.wake
    }

    fn take(&self, change: &Change<'_>) -> bool {
        match change {
            Change::Alerts(alerts) => self.update(alerts),
            Change::Swept => false,
        }
    }

    fn next(&self) -> Option<Vec<AmAlert>> {
        let mut st = lock(&self.state);
        if !st.due {
            return None;
        }
        st.due = false;
        Some(
            st.firing
                .iter()
                .filter(|(key, _)| !st.quiet.contains(*key))
                .map(|(_, a)| a)
                .chain(st.resolving.values())
                .cloned()
                .collect(),
        )
    }

    fn request(
        &self,
        http: &reqwest::Client,
        batch: &Vec<AmAlert>,
        _: i64,
    ) -> reqwest::RequestBuilder {
        http.post(self.endpoint.expose_secret()).json(batch)
    }

    /// An accepted post ends the resolves it carried; a failed one is
    /// retried (firing alerts are re-sent with every update anyway).
    fn settle(&self, batch: &Vec<AmAlert>, attempt: Attempt, _: DateTime<Utc>) -> Then {
        let mut st = lock(&self.state);
        match attempt {
            Attempt::Delivered { .. } => {
                st.delivered += 1;
                self.counter.sink("alertmanager", DeliveryResult::Delivered);
                // Resolves that went out (and did not change since) are done.
                for a in batch {
                    if st.resolving.get(&a.fingerprint()) == Some(a) {
                        st.resolving.remove(&a.fingerprint());
                    }
                }
                if std::mem::take(&mut st.failing) {
                    tracing::info!(alertmanager_index = self.index, url_env = %self.url_env, "Alertmanager accepts alerts again");
                }
                tracing::debug!(
                    alertmanager_index = self.index,
                    alerts = batch.len(),
                    "alerts posted to Alertmanager"
                );
                Then::Next
            }
            Attempt::Failed { error, .. } => {
                st.failed_attempts += 1;
                self.counter.sink("alertmanager", DeliveryResult::Failed);
                st.due = true;
                if !std::mem::replace(&mut st.failing, true) {
                    tracing::warn!(
                        alertmanager_index = self.index,
                        url_env = %self.url_env,
                        error,
                        alerts = batch.len(),
                        "cannot post alerts to Alertmanager; retrying (firing alerts are re-sent with every sweep)"
                    );
                }
                Then::Retry
            }
            // Cut off by the shutdown flush: still owed (and in the state file).
            Attempt::Interrupted => {
                st.due = true;
                Then::Next
            }
        }
    }
}

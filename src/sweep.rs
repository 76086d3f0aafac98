//! One sweep: inventory, probes and git, folded into a `FleetReport`.
//!
//! Owns the observe half of observe → decide → act: list every configured
//! app's machines, probe the started ones, ask the overlay about each
//! reported ref, classify drift, and compute coherence. Per-machine trouble
//! becomes a per-machine status; only failures that make the whole picture
//! untrustworthy (an app that cannot be listed, git failing) fail the sweep.
//! It must never mutate anything: no Fly writes, no agent POSTs.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::{Config, UrlVars};
use crate::fly::{FlyClient, FlyError, Machine};
use crate::model::{MachineStatus, PolicyAction, Severity};
use crate::overlay::{Overlay, OverlayError, RefAnalysis, Tip};
use crate::probe::{AgentReport, ProbeOutcome, Prober};
use crate::severity::{self, Drift};
use crate::slots::{SLOTS_KEY, SlotSet};

/// The result of one sweep; serializes as the `check --output json` document
/// (and reads back from it: `status` parses a daemon's `/api/v1/fleet`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FleetReport {
    pub tip: TipReport,
    /// on-tip ÷ started, over the whole fleet (1.0 with no started machine).
    pub coherence: f64,
    pub apps: Vec<AppSummary>,
    pub machines: Vec<MachineReport>,
    /// The coordinator's slot set, read after the machines were listed (so
    /// every slot of a marker in the listing is in it). Not part of the JSON.
    #[serde(skip)]
    pub slots: SlotsView,
}

/// What the sweep saw of the rotation slots.
#[derive(Clone, Debug, Default)]
pub enum SlotsView {
    /// No `rotation.coordinator` configured (observe-only use).
    #[default]
    NotConfigured,
    Known(SlotSet),
    /// The coordinator could not be read, or its slot set is unreadable.
    Unknown(String),
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TipReport {
    pub branch: String,
    pub commit: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AppSummary {
    pub name: String,
    /// Machines in state `started` (the coherence denominator).
    pub machines: usize,
    pub on_tip: usize,
    pub coherence: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MachineReport {
    pub app: String,
    pub machine_id: String,
    pub name: String,
    pub region: String,
    pub pool: String,
    pub state: String,
    pub status: MachineStatus,
    pub reported_ref: Option<String>,
    pub commit: Option<String>,
    pub commits_behind: Option<u64>,
    pub commits_ahead: Option<u64>,
    pub severity: Option<Severity>,
    pub action: Option<PolicyAction>,
    /// Why a machine is unreachable or its report bad; null otherwise.
    #[serde(default)]
    pub detail: Option<String>,
    /// The agent's parsed report, for the planner (not part of the JSON).
    #[serde(skip)]
    pub report: Option<AgentReport>,
    /// The machine's Fly metadata, for the planner (not part of the JSON).
    #[serde(skip)]
    pub metadata: BTreeMap<String, String>,
    /// The machine version (`instance_id`), for metadata compare-and-set.
    #[serde(skip)]
    pub version: String,
    /// The rendered health URL (started machines), for cooperative calls.
    #[serde(skip)]
    pub health_url: Option<String>,
}

impl FleetReport {
    /// True when every started machine reports the tip.
    pub fn is_coherent(&self) -> bool {
        self.machines
            .iter()
            .all(|m| matches!(m.status, MachineStatus::OnTip | MachineStatus::NotRunning))
    }

    pub fn count(&self, app: Option<&str>, status: MachineStatus) -> usize {
        self.machines
            .iter()
            .filter(|m| app.is_none_or(|a| m.app == a) && m.status == status)
            .count()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("cannot list machines of app {app}: {source}")]
    Inventory {
        app: String,
        #[source]
        source: FlyError,
    },
    #[error(transparent)]
    Overlay(#[from] OverlayError),
}

impl SweepError {
    pub fn kind(&self) -> &'static str {
        match self {
            SweepError::Inventory { source, .. } => source.kind(),
            SweepError::Overlay(_) => "overlay",
        }
    }
}

/// Everything a sweep reads from; built once in `main` and reused.
#[derive(Clone)]
pub struct Sweeper {
    pub config: Arc<Config>,
    pub fly: FlyClient,
    pub prober: Prober,
    pub overlay: Overlay,
}

impl Sweeper {
    /// Observes the fleet against `tip`. Read-only.
    pub async fn sweep(&self, tip: &Tip) -> Result<FleetReport, SweepError> {
        // Inventory: every app concurrently; one unlistable app fails the sweep,
        // since a partial inventory would overstate coherence.
        let listings = futures::future::join_all(
            self.config
                .apps
                .iter()
                .map(|app| async move { (app, self.fly.list_machines(&app.name).await) }),
        )
        .await;
        let mut machines: Vec<(usize, Machine)> = Vec::new();
        for (app_index, (app, listing)) in listings.into_iter().enumerate() {
            let listed = listing.map_err(|source| SweepError::Inventory {
                app: app.name.clone(),
                source,
            })?;
            machines.extend(listed.into_iter().map(|m| (app_index, m)));
        }
        let slots = self.read_slots().await;
        machines.sort_by(|(a, ma), (b, mb)| {
            a.cmp(b).then(ma.name.cmp(&mb.name)).then(ma.id.cmp(&mb.id))
        });

        // Probes: only started machines have a reachable agent.
        let started: Vec<usize> = (0..machines.len())
            .filter(|&i| machines[i].1.is_started())
            .collect();
        // A machine whose values make no safe URL is not probed (nor drained).
        let mut url_of: HashMap<usize, String> = HashMap::new();
        let mut probe_of: HashMap<usize, ProbeOutcome> = HashMap::new();
        for &i in &started {
            let (app_index, m) = &machines[i];
            let app = &self.config.apps[*app_index];
            let rendered = app.health_url.render(&UrlVars {
                machine_id: &m.id,
                app: &app.name,
                private_ip: &m.private_ip,
                region: &m.region,
                name: &m.name,
            });
            match rendered {
                Ok(url) => {
                    url_of.insert(i, url);
                }
                Err(e) => {
                    let why = crate::probe::bounded(&e.to_string(), crate::probe::MAX_DETAIL_CHARS);
                    probe_of.insert(i, ProbeOutcome::Unreachable(why));
                }
            }
        }
        let probed: Vec<usize> = started
            .into_iter()
            .filter(|i| url_of.contains_key(i))
            .collect();
        let urls: Vec<String> = probed.iter().map(|i| url_of[i].clone()).collect();
        let outcomes = self.prober.probe_all(urls).await;
        probe_of.extend(probed.into_iter().zip(outcomes));

        // Git: one batch for every distinct reported ref.
        let refs: Vec<String> = {
            let mut refs: Vec<String> = probe_of
                .values()
                .filter_map(|o| match o {
                    ProbeOutcome::Report(r) => Some(r.overlay_ref.clone()),
                    _ => None,
                })
                .collect();
            refs.sort();
            refs.dedup();
            refs
        };
        let signals = severity::signals(&self.config.severity);
        let analysis = self.overlay.analyze(&tip.commit, refs, &signals).await?;

        let reports = machines
            .into_iter()
            .enumerate()
            .map(|(i, (app_index, m))| {
                let app = &self.config.apps[app_index];
                let mut r = self.machine_report(
                    &app.name,
                    app.pool_key.as_deref(),
                    m,
                    probe_of.remove(&i),
                    &analysis,
                );
                r.health_url = url_of.remove(&i);
                r
            })
            .collect();
        let mut report = build_report(&self.config, tip, reports);
        report.slots = slots;
        Ok(report)
    }

    /// The coordinator's slot set; trouble reading it is data, not a failed sweep.
    async fn read_slots(&self) -> SlotsView {
        let Some(c) = &self.config.rotation.coordinator else {
            return SlotsView::NotConfigured;
        };
        match self.fly.get_machine(&c.app, &c.machine_id).await {
            Ok(m) => match SlotSet::parse(m.metadata(SLOTS_KEY)) {
                Ok(set) => SlotsView::Known(set),
                Err(e) => SlotsView::Unknown(format!("coordinator {c}: {e}")),
            },
            Err(e) => SlotsView::Unknown(format!("coordinator {c}: {e}")),
        }
    }

    fn machine_report(
        &self,
        app: &str,
        pool_key: Option<&str>,
        m: Machine,
        probe: Option<ProbeOutcome>,
        analysis: &HashMap<String, RefAnalysis>,
    ) -> MachineReport {
        let metadata = m.config.map(|c| c.metadata).unwrap_or_default();
        let pool = severity::pool_of(pool_key, |k| metadata.get(k).map(String::as_str));
        let mut r = MachineReport {
            app: app.to_string(),
            machine_id: m.id,
            name: m.name,
            region: m.region,
            pool,
            state: m.state,
            status: MachineStatus::NotRunning,
            reported_ref: None,
            commit: None,
            commits_behind: None,
            commits_ahead: None,
            severity: None,
            action: None,
            detail: None,
            report: None,
            metadata,
            version: m.instance_id,
            health_url: None,
        };
        let drift = match probe {
            None => return r,
            Some(ProbeOutcome::Unreachable(why)) => {
                r.status = MachineStatus::Unreachable;
                r.detail = Some(why);
                return r;
            }
            Some(ProbeOutcome::BadReport(why)) => {
                r.status = MachineStatus::BadReport;
                r.detail = Some(why);
                return r;
            }
            Some(ProbeOutcome::Report(report)) => {
                r.reported_ref = Some(report.overlay_ref.clone());
                let verdict = analysis.get(&report.overlay_ref).cloned();
                r.report = Some(report);
                match verdict {
                    Some(RefAnalysis::OnTip { commit }) => {
                        r.status = MachineStatus::OnTip;
                        r.commit = Some(commit.to_string());
                        r.commits_behind = Some(0);
                        r.commits_ahead = Some(0);
                        return r;
                    }
                    Some(RefAnalysis::Drifted { commit, range }) => {
                        r.status = MachineStatus::Drifted;
                        r.commit = Some(commit.to_string());
                        r.commits_behind = Some(range.behind);
                        r.commits_ahead = Some(range.ahead);
                        let drift = severity::classify(&self.config.severity, Drift::Range(&range));
                        if range.paths_incomplete {
                            // Its severity may still rise: nothing acts on a
                            // partial answer, later sweeps finish it.
                            r.detail = Some(PATHS_INCOMPLETE.into());
                            r.severity = Some(drift);
                            r.action = Some(PolicyAction::Observe);
                            return r;
                        }
                        drift
                    }
                    Some(RefAnalysis::Ambiguous) => {
                        r.status = MachineStatus::AmbiguousRef;
                        r.detail = Some("abbreviated ref matches more than one object".into());
                        severity::classify(&self.config.severity, Drift::Unresolved)
                    }
                    Some(RefAnalysis::Unknown) | None => {
                        r.status = MachineStatus::UnknownRef;
                        r.detail = Some("ref is not a commit of the overlay repository".into());
                        severity::classify(&self.config.severity, Drift::Unresolved)
                    }
                }
            }
        };
        r.severity = Some(drift);
        r.action = Some(severity::action_for(&self.config, &r.pool, drift));
        r
    }
}

/// The detail of a drifted machine whose range the path rules have not
/// fully checked yet.
pub const PATHS_INCOMPLETE: &str = "path rules not yet checked on every missing commit (git work per sweep is bounded); observed only until later sweeps finish";

/// Folds machine reports into the fleet report: per-app and fleet coherence.
pub fn build_report(config: &Config, tip: &Tip, machines: Vec<MachineReport>) -> FleetReport {
    let ratio = |on_tip: usize, started: usize| {
        if started == 0 {
            1.0
        } else {
            on_tip as f64 / started as f64
        }
    };
    let apps: Vec<AppSummary> = config
        .apps
        .iter()
        .map(|app| {
            let started = machines
                .iter()
                .filter(|m| m.app == app.name && m.status != MachineStatus::NotRunning)
                .count();
            let on_tip = machines
                .iter()
                .filter(|m| m.app == app.name && m.status == MachineStatus::OnTip)
                .count();
            AppSummary {
                name: app.name.clone(),
                machines: started,
                on_tip,
                coherence: ratio(on_tip, started),
            }
        })
        .collect();
    let started: usize = apps.iter().map(|a| a.machines).sum();
    let on_tip: usize = apps.iter().map(|a| a.on_tip).sum();
    FleetReport {
        tip: TipReport {
            branch: tip.branch.clone(),
            commit: tip.commit.to_string(),
        },
        coherence: ratio(on_tip, started),
        apps,
        machines,
        slots: SlotsView::NotConfigured,
    }
}

//! One sweep: inventory, probes and git, folded into an [`Observation`].
//!
//! Owns the observe half of observe → decide → act: list every configured
//! app's machines, probe the started ones, ask the overlay about each
//! reported ref, and read the coordinator's slots. Per-machine trouble
//! becomes a per-machine status, and per-app trouble a per-app one: an app
//! whose machines cannot be listed (deleted, a token without access to it, a
//! partial Fly outage) is reported *stale* with the error, and never
//! invalidates what the other apps' listings say. Only failures that make the
//! whole picture untrustworthy (no app can be listed, git failing) fail the
//! sweep (`decide::prepare` shows a stale app's last listing).
//! A machine whose metadata is unknown (its host is not `ok`) is never
//! shown as "no hold, no marker, pool default": its row says its metadata is
//! unknown, its pool comes from its coordinator slot or its last known
//! listing, and its hold and marker from that listing.
//! Every machine's records are opened with the record key
//! ([`Trust`]: unsealed or forged ones are listed as tampered, never taken
//! for ours), the slot set too, and the coordinator's copy of each hold is
//! folded in: a hold an agent deleted from its machine still holds. Each
//! configured app's halt record is read there too ([`HaltView`]).
//! It must never mutate anything (no Fly writes, no agent POSTs) nor judge
//! what it saw: no severity, action, reason or coherence figure is made
//! here, and nothing here is written on the wire.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::config::{AppConfig, Config, UrlVars};
use crate::fly::{FlyClient, FlyError, Machine, MachineCheck, MachineEvent};
use crate::metadata::SLOTS_KEY;
use crate::metadata::controls::{Controls, Trust};
use crate::metadata::halt::{COORDINATOR_HALT_PREFIX, HaltView, Halts, coordinator_halt_key};
use crate::metadata::operator::SpentApprovals;
use crate::metadata::seal::RecordKeys;
use crate::metadata::slots::{Coordinator, SlotSet, SlotsError};
use crate::model::{AppName, CommitId, MachineId, MachineState, MachineStatus, PoolName};
use crate::observe::gate::{AlertGate, GateView};
use crate::observe::overlay::{Overlay, OverlayError, RefAnalysis, Signals, Tip};
use crate::observe::probe::{AgentReport, ProbeOutcome, Prober};

/// What one sweep saw, before any policy: the tip it measured against,
/// each configured app's listing status, every machine's row and the
/// coordinator's slots. It carries no verdict (severity, action, reason)
/// and no coherence figure: `decide::prepare` makes the snapshot the planner
/// and every view read from it. Not serializable: what goes on the wire is
/// `report::wire`'s document, built from that snapshot.
#[derive(Debug)]
#[must_use = "an observation is prepared into a decide::Snapshot"]
pub struct Observation {
    pub tip: TipReport,
    /// One entry per configured app, in config order.
    pub apps: Vec<AppListing>,
    /// Rows in config order of their apps, by name (then id) in each.
    pub machines: Vec<ObservedMachine>,
    /// The coordinator's slot set, read after the machines were listed (so
    /// every slot of a marker in the listing is in it).
    pub slots: SlotsView,
    /// Each app's halt record on the coordinator, read with the slot set.
    pub halts: Halts,
    /// The alert gate's firing alerts (`[gates.alertmanager]`), read in
    /// the same sweep.
    pub gate: GateView,
}

/// Whether this sweep could list one configured app.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppListing {
    pub name: AppName,
    /// Set when this sweep could not list the app's machines: none of its
    /// machines are in the observation.
    pub stale: Option<StaleApp>,
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
    /// The slot set on a coordinator agents can write is not the one we
    /// sealed: unknown (fail closed), and alerted as `metadata_tampered`.
    Tampered(String),
}

impl SlotsView {
    /// Why the slot set is not known, when it is not (unreadable or not the
    /// one we sealed): then nothing that needs a slot proceeds.
    pub fn unreadable(&self) -> Option<&str> {
        match self {
            SlotsView::Unknown(why) | SlotsView::Tampered(why) => Some(why.as_str()),
            SlotsView::Known(_) | SlotsView::NotConfigured => None,
        }
    }

    /// The pool whose coordinator slot names `machine_id` of `app`, if one
    /// does: read in the same sweep, so it stands in for the pool label of
    /// a machine whose metadata is unknown.
    pub fn pool_of(&self, app: &AppName, machine_id: &MachineId) -> Option<PoolName> {
        let SlotsView::Known(set) = self else {
            return None;
        };
        let prefix = format!("{app}/");
        set.pools.iter().find_map(|(key, slots)| {
            let pool = key.strip_prefix(&prefix)?;
            slots
                .iter()
                .any(|s| &s.machine_id == machine_id)
                .then(|| PoolName::from(pool))
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct TipReport {
    pub branch: String,
    pub commit: CommitId,
}

/// Why an app's entry is not from this sweep.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct StaleApp {
    /// The error, naming the app (`cannot list machines of app beta: …`).
    pub error: String,
    /// Its bounded kind: `not_found`, `unauthorized`, `status`, `transport`, …
    pub kind: String,
    /// When the app was last listed successfully (by this daemon): its
    /// machines and figures in the report are from then, measured against
    /// the tip of that sweep. `None` when it never was (`check`, or since the
    /// daemon started): its machines are unknown and absent from the report.
    pub last_listed_at: Option<DateTime<Utc>>,
}

/// One machine as the sweep saw it: the row every view shows (without
/// the verdict `decide` adds to a drifted one) and, in [`MachineInputs`],
/// what deciding and acting read beyond it.
#[derive(Clone, Debug)]
pub struct ObservedMachine {
    pub app: AppName,
    pub machine_id: MachineId,
    pub name: String,
    /// Shared by every row of the sweep in the same region ([`Texts`]).
    pub region: Arc<str>,
    /// Shared by every row of the sweep in the same pool ([`Texts`]).
    pub pool: PoolName,
    pub state: MachineState,
    pub status: MachineStatus,
    /// The text of `inputs.report`'s `overlay_ref` (one allocation, shared
    /// by every row reporting the same text in the sweep), or `None`.
    pub reported_ref: Option<Arc<str>>,
    pub commit: Option<CommitId>,
    pub commits_behind: Option<u64>,
    pub commits_ahead: Option<u64>,
    /// Why a machine is unreachable or its report bad, and whether its
    /// metadata is unknown (its host is not `ok`) and where its pool and
    /// controls come from then; `None` otherwise.
    pub detail: Option<String>,
    /// What decide and act read of this machine beyond the row above.
    pub inputs: MachineInputs,
}

/// What the sweep read of one machine that its shown row does not carry.
#[derive(Clone, Debug)]
pub struct MachineInputs {
    /// What the overlay said about the reported ref, for
    /// `decide::prepare`'s judgement.
    pub analysis: Option<RefAnalysis>,
    /// The agent's parsed report, for the planner.
    pub report: Option<AgentReport>,
    /// The hold, approval, marker and probe-failure record in `metadata`,
    /// parsed once by [`observation`]. While `metadata_unknown`: the hold
    /// and marker of the machine's last listing that knew them (filled in
    /// by `decide::prepare`), never an approval; empty when none did.
    /// Shared: most machines have none, and those share one empty value
    /// ([`shared_controls`]) instead of holding 368 bytes each.
    pub controls: Arc<Controls>,
    /// The machine's Fly metadata, as listed. Empty, and not to be read,
    /// while `metadata_unknown()` says why it cannot be known.
    pub metadata: BTreeMap<String, String>,
    /// The machine's version as listed: a restart keeps it, an outside
    /// update (`fly deploy`, `fly machine update`) changes it.
    pub instance_id: String,
    /// Whether Fly Proxy routes to it, as listed (`None`: Fly did not say).
    pub cordoned: Option<bool>,
    /// What Fly's health checks say as a whole: whether every check the
    /// config defines has a passing result, and since when
    /// ([`MachineInputs::fly_checks`]).
    pub fly_checks: PackedChecks,
    /// `stop_config.timeout` of its config in whole seconds (rounded up,
    /// at most Fly's 300), as listed: how long a restart may wait for it
    /// to stop before it boots; 0 when not set or the config is unknown.
    /// Two bytes where a `Duration` would take sixteen.
    pub stop_timeout_secs: u16,
    /// What most machines lack, boxed so that they pay one pointer for it
    /// ([`Unusual`]); `None` when every part of it is empty.
    pub unusual: Option<Box<Unusual>>,
    /// The rendered health URL (started machines), for cooperative calls.
    pub health_url: Option<String>,
}

/// Fly's health checks of a machine, summed up as the listing is read
/// (the results themselves are not kept, [`Unusual::checks`] aside).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlyChecks {
    /// Its config defines no check: Fly's checks say nothing of it.
    #[default]
    NoneDefined,
    /// Some defined check has no result, or one that is not passing; or
    /// the config is unknown (its host is not `ok`).
    NotAllPassing,
    /// Every defined check has a passing result; the oldest was written
    /// at or after this instant (Unix milliseconds, Fly's clock, rounded
    /// down; an unreadable time counts as the oldest there is).
    AllPassingSince(i64),
}

impl FlyChecks {
    /// What `m`'s checks say: every check its config defines against the
    /// results Fly lists (flyctl waits for the same after a restart:
    /// `WaitForHealthchecksToPass` counts the configured checks, and an
    /// empty result list is not passing).
    pub fn of(m: &Machine) -> FlyChecks {
        let defined = match (m.host_ok(), &m.config) {
            (true, Some(config)) => config.defined_checks(),
            _ => return FlyChecks::NotAllPassing,
        };
        if defined == 0 {
            return FlyChecks::NoneDefined;
        }
        if m.checks.len() < defined || !m.checks.iter().all(MachineCheck::passing) {
            return FlyChecks::NotAllPassing;
        }
        let oldest = m
            .checks
            .iter()
            .map(|c| c.updated_at.map_or(0, |t| t.timestamp_millis()))
            .min()
            .unwrap_or(0);
        FlyChecks::AllPassingSince(oldest)
    }
}

/// [`FlyChecks`] in five bytes, so that a row keeps it in what was its
/// padding (100,000 rows are held at once): whole seconds as a `u32` and
/// the rest in 4-ms steps, rounded down (a result looks at most 4 ms
/// older than it is, which can only delay a verification); the last
/// byte's values past those steps say which other case it is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PackedChecks([u8; 5]);

impl PackedChecks {
    const STEPS: u8 = 250;
    const NONE_DEFINED: u8 = 250;
    const NOT_ALL_PASSING: u8 = 251;

    pub fn get(self) -> FlyChecks {
        let [a, b, c, d, tail] = self.0;
        match tail {
            PackedChecks::NONE_DEFINED => FlyChecks::NoneDefined,
            PackedChecks::NOT_ALL_PASSING => FlyChecks::NotAllPassing,
            steps => {
                let secs = i64::from(u32::from_le_bytes([a, b, c, d]));
                FlyChecks::AllPassingSince(
                    secs * 1000 + i64::from(steps.min(PackedChecks::STEPS - 1)) * 4,
                )
            }
        }
    }
}

impl From<FlyChecks> for PackedChecks {
    fn from(checks: FlyChecks) -> PackedChecks {
        let since = match checks {
            FlyChecks::NoneDefined => {
                return PackedChecks([0, 0, 0, 0, PackedChecks::NONE_DEFINED]);
            }
            FlyChecks::NotAllPassing => {
                return PackedChecks([0, 0, 0, 0, PackedChecks::NOT_ALL_PASSING]);
            }
            FlyChecks::AllPassingSince(ms) => ms,
        };
        // Out of range (before 1970, after 2106): the oldest there is,
        // never taken as fresh.
        let secs = u32::try_from(since.div_euclid(1000)).ok();
        let (secs, steps) = match secs {
            Some(secs) => (secs, (since.rem_euclid(1000) / 4) as u8),
            None => (0, 0),
        };
        let [a, b, c, d] = secs.to_le_bytes();
        PackedChecks([a, b, c, d, steps])
    }
}

impl Default for PackedChecks {
    fn default() -> PackedChecks {
        FlyChecks::default().into()
    }
}

impl std::fmt::Debug for PackedChecks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

/// The parts of a machine's inputs most machines lack: kept behind one
/// pointer on the row (8 bytes instead of 72 for every machine).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unusual {
    /// Why the metadata (and with it the hold, approval, marker and pool
    /// label) is unknown: the host is not `ok` (Fly shows only
    /// `incomplete_config`) or the listing carried no config. `None`: known.
    /// Unknown is never empty: nothing may be planned from `metadata` then;
    /// the row's `pool` is then the one its coordinator slot names, else
    /// its last known one, else `default` (the row's `detail` says which).
    pub metadata_unknown: Option<String>,
    /// Fly's own health checks that are not passing, as listed: only
    /// whether every check passes is read, and a passing check's output is
    /// most of its size, so passing ones are not kept.
    pub checks: Vec<MachineCheck>,
    /// Recent lifecycle events as listed (exit events show crash loops).
    pub events: Vec<MachineEvent>,
}

impl MachineInputs {
    /// Why the machine's metadata is unknown ([`Unusual::metadata_unknown`]).
    pub fn metadata_unknown(&self) -> Option<&str> {
        self.unusual.as_ref()?.metadata_unknown.as_deref()
    }

    /// What Fly's health checks say as a whole ([`FlyChecks`]).
    pub fn fly_checks(&self) -> FlyChecks {
        self.fly_checks.get()
    }

    /// Fly's failing health checks ([`Unusual::checks`]).
    pub fn checks(&self) -> &[MachineCheck] {
        self.unusual.as_ref().map_or(&[], |u| &u.checks)
    }

    /// Recent lifecycle events as listed ([`Unusual::events`]).
    pub fn events(&self) -> &[MachineEvent] {
        self.unusual.as_ref().map_or(&[], |u| &u.events)
    }

    /// The unusual parts, to be changed (made when there were none).
    pub fn unusual_mut(&mut self) -> &mut Unusual {
        self.unusual.get_or_insert_with(Box::default)
    }

    /// `unusual`, kept only when some part of it is not empty.
    fn set_unusual(&mut self, unusual: Unusual) {
        self.unusual = (unusual != Unusual::default()).then(|| Box::new(unusual));
    }
}

impl Default for MachineInputs {
    fn default() -> MachineInputs {
        MachineInputs {
            analysis: None,
            report: None,
            controls: shared_controls(Controls::default()),
            metadata: BTreeMap::new(),
            instance_id: String::new(),
            cordoned: None,
            fly_checks: PackedChecks::default(),
            stop_timeout_secs: 0,
            unusual: None,
            health_url: None,
        }
    }
}

/// `controls` behind an `Arc`: the one shared empty value when there are
/// none (a fleet's usual case), else its own.
pub fn shared_controls(controls: Controls) -> Arc<Controls> {
    static NONE: std::sync::LazyLock<Arc<Controls>> =
        std::sync::LazyLock::new(|| Arc::new(Controls::default()));
    if controls == Controls::default() {
        Arc::clone(&NONE)
    } else {
        Arc::new(controls)
    }
}

/// Texts many rows of a sweep share (regions, pools, reported refs), one
/// allocation each: at 10,000 machines a row's own copies were about 160
/// bytes of its heap.
#[derive(Debug, Default)]
pub struct Texts(HashSet<Arc<str>>);

impl Texts {
    /// The shared copy of `text`, made on its first use.
    pub fn get(&mut self, text: &str) -> Arc<str> {
        if let Some(shared) = self.0.get(text) {
            return Arc::clone(shared);
        }
        let shared: Arc<str> = Arc::from(text);
        self.0.insert(Arc::clone(&shared));
        shared
    }

    /// Every distinct text, sorted, as owned strings (the set is dropped).
    pub fn into_sorted(self) -> Vec<String> {
        let mut texts: Vec<String> = self.0.iter().map(|t| t.to_string()).collect();
        texts.sort_unstable();
        texts
    }
}

/// The empty region and the default pool, one copy each for the process:
/// rows made without a [`Texts`] allocate neither.
static NO_REGION: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(""));
static DEFAULT_POOL: std::sync::LazyLock<PoolName> =
    std::sync::LazyLock::new(|| PoolName::from(crate::config::DEFAULT_POOL));

impl ObservedMachine {
    /// A machine as listed, before any probe or analysis: `not_running`,
    /// region empty, pool `default`, nothing reported.
    pub fn listed(app: &str, machine_id: &str, name: &str, state: MachineState) -> ObservedMachine {
        ObservedMachine {
            app: app.into(),
            machine_id: machine_id.into(),
            name: name.to_string(),
            region: Arc::clone(&NO_REGION),
            pool: DEFAULT_POOL.clone(),
            state,
            status: MachineStatus::NotRunning,
            reported_ref: None,
            commit: None,
            commits_behind: None,
            commits_ahead: None,
            detail: None,
            inputs: MachineInputs::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("cannot list machines of app {app}: {source}")]
    Inventory {
        app: AppName,
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

/// The apps a sweep could not list: each one's index in the config, and why.
type Unlisted = Vec<(usize, SweepError)>;

/// Everything a sweep reads from; built once in `main` and reused.
#[derive(Clone)]
pub struct Sweeper {
    pub config: Arc<Config>,
    pub fly: FlyClient,
    pub prober: Prober,
    pub overlay: Overlay,
    /// What the severity rules need measured on each drift range
    /// (`decide::severity::signals`): the sweep collects this
    /// evidence and judges none of it.
    pub signals: Signals,
    /// The record keys, when this process holds them: each machine's sealed
    /// records are verified with them ([`Trust`]); `None` (observe-only)
    /// reads values as written.
    pub record_keys: Option<RecordKeys>,
    /// The alert gate (`[gates.alertmanager]`), read in every sweep.
    pub gate: Option<AlertGate>,
}

impl Sweeper {
    /// Observes the fleet against `tip`. Read-only, and decides nothing:
    /// `decide::prepare` gives the drifted rows their severity, action
    /// and reason.
    pub async fn sweep(&self, tip: &Tip) -> Result<Observation, SweepError> {
        // The gate is read beside the inventory: one more request, no
        // longer sweep.
        let gate = async {
            match &self.gate {
                Some(g) => g.read().await,
                None => GateView::NotConfigured,
            }
        };
        let (listed, gate) = tokio::join!(self.inventory(), gate);
        let (mut rows, unlisted) = listed?;
        rows.shrink_to_fit();
        let (slots, coordinator_holds, spent, halts) = self.read_coordinator().await;
        let app_index: HashMap<&AppName, usize> = self
            .config
            .apps
            .iter()
            .enumerate()
            .map(|(i, app)| (&app.name, i))
            .collect();
        let index_of = |m: &ObservedMachine| app_index.get(&m.app).copied().unwrap_or(0);

        // Probes: only started machines with a safe URL have a reachable
        // agent; each outcome goes on its row as it is read.
        let probed: Vec<usize> = taking_turns(
            rows.iter()
                .enumerate()
                .filter(|(_, m)| m.inputs.health_url.is_some())
                .map(|(i, m)| (index_of(m), i)),
        );
        // Each URL is lent to the probe and put back with its outcome: no
        // second copy of every URL, nor of every outcome, at once.
        let urls: Vec<(usize, String)> = probed
            .into_iter()
            .filter_map(|i| rows.get_mut(i)?.inputs.health_url.take().map(|u| (i, u)))
            .collect();
        let mut refs = Texts::default();
        self.prober
            .probe_each(urls, |i, url, outcome| {
                if let Some(row) = rows.get_mut(i) {
                    row.inputs.health_url = Some(url);
                    probed_row(row, outcome, &mut refs);
                }
            })
            .await;

        // Git: one batch for every distinct reported ref: the texts the
        // probes' rows share are exactly those (copied once each, in order).
        let refs = refs.into_sorted();
        let analysis = self
            .overlay
            .analyze(&tip.commit, refs, &self.signals)
            .await?;

        for m in &mut rows {
            analysed_row(m, &analysis);
        }
        let trust = Trust::of(self.record_keys.as_ref());
        let mut observation = observation_with(&self.config, trust, tip, rows);
        for (app_index, e) in unlisted {
            if let Some(app) = observation.apps.get_mut(app_index) {
                app.stale = Some(StaleApp {
                    error: e.to_string(),
                    kind: e.kind().to_string(),
                    last_listed_at: None,
                });
            }
        }
        observation.slots = slots;
        observation.halts = halts;
        observation.gate = gate;
        add_coordinator_holds(&mut observation, &coordinator_holds);
        add_spent_approvals(&mut observation, &spent);
        pools_from_slots(&mut observation);
        Ok(observation)
    }

    /// Every app's machines, listed concurrently, as rows in config order
    /// of their apps (by name, then id, in each), and the apps that could
    /// not be listed (by config index). An error only when none could be.
    async fn inventory(&self) -> Result<(Vec<ObservedMachine>, Unlisted), SweepError> {
        // Inventory: every app concurrently. An app that cannot be listed is
        // reported stale (and counts for nothing); the others are swept as
        // usual. With no app listed there is nothing to report. Each machine
        // becomes its row as it is decoded: the listing is not kept.
        let listings = futures::future::join_all(self.config.apps.iter().map(|app| async move {
            let mut texts = Texts::default();
            let listed = self
                .fly
                .list_machines_with(&app.name, |m| listed_row(app, m, &mut texts))
                .await;
            (app, listed)
        }))
        .await;
        // The rows are made once and completed in place: at 100,000 machines
        // a second vector of them would be tens of MiB more at the peak.
        let mut rows: Vec<ObservedMachine> = Vec::new();
        let mut unlisted: Unlisted = Vec::new();
        for (app_index, (app, listing)) in listings.into_iter().enumerate() {
            // Rows in config order of their apps, by name (then id) in each.
            let listing = listing.map(|mut listed| {
                listed.sort_by(|a, b| a.name.cmp(&b.name).then(a.machine_id.cmp(&b.machine_id)));
                listed
            });
            match listing {
                // The first app's rows are taken as they are, not copied.
                Ok(listed) if rows.is_empty() => rows = listed,
                Ok(listed) => rows.extend(listed),
                Err(source) => unlisted.push((
                    app_index,
                    SweepError::Inventory {
                        app: app.name.clone(),
                        source,
                    },
                )),
            }
        }
        if unlisted.len() == self.config.apps.len()
            && let Some((_, first)) = unlisted.drain(..).next()
        {
            return Err(first);
        }
        Ok((rows, unlisted))
    }

    /// The coordinator's slot set and the holds it keeps (machine id → hold
    /// value; empty when it cannot be read: then each machine's own hold is
    /// all that is known, and no slot-needing step runs, see
    /// docs/safety.md); trouble reading it is data, not a failed sweep.
    async fn read_coordinator(&self) -> (SlotsView, BTreeMap<String, String>, Spent, Halts) {
        let Some(c) = &self.config.rotation.coordinator else {
            return (
                SlotsView::NotConfigured,
                BTreeMap::new(),
                Spent::new(),
                Halts::new(),
            );
        };
        let machine = self.fly.get_machine(&c.app, &c.machine_id).await;
        let meta = match &machine {
            Ok(m) => m.known_metadata().ok(),
            Err(_) => None,
        };
        let with_prefix = |prefix: &str| -> BTreeMap<String, String> {
            meta.iter()
                .flat_map(|meta| meta.iter())
                .filter_map(|(k, v)| Some((k.strip_prefix(prefix)?.to_string(), v.clone())))
                .collect()
        };
        let holds = with_prefix(crate::metadata::COORDINATOR_HOLD_PREFIX);
        // Any readable list counts, sealed or not: it only ever withholds
        // approvals (fails closed).
        let spent = with_prefix(crate::metadata::COORDINATOR_SPENT_PREFIX)
            .into_iter()
            .filter_map(|(id, v)| {
                let text = Trust::AsWritten.open("", "", &v).ok()?;
                Some((id, SpentApprovals::parse(&text)?))
            })
            .collect();
        // Only configured apps' records: a key naming any other app is
        // nobody's halt.
        let trust = Trust::of(self.record_keys.as_ref());
        let halts = with_prefix(COORDINATOR_HALT_PREFIX)
            .into_iter()
            .filter_map(|(app, v)| {
                let app = self.config.apps.iter().find(|a| a.name.as_str() == app)?;
                let key = coordinator_halt_key(app.name.as_str());
                let view = HaltView::open(trust, c.machine_id.as_str(), &key, &v);
                Some((app.name.clone(), view))
            })
            .collect();
        (self.slots_of(c, machine), holds, spent, halts)
    }

    fn slots_of(&self, c: &Coordinator, machine: Result<Machine, FlyError>) -> SlotsView {
        match machine {
            // Unknown is not empty: an unreachable coordinator's set is unknown.
            Ok(m) => match m.metadata(SLOTS_KEY) {
                Err(e) => SlotsView::Unknown(format!("coordinator {c}: {e}")),
                Ok(value) => {
                    let trust = Trust::of(self.record_keys.as_ref());
                    match SlotSet::open(trust, c, value, self.config.coordinator_exposed()) {
                        Ok(set) => SlotsView::Known(set),
                        Err(e @ SlotsError::Tampered(_)) => {
                            SlotsView::Tampered(format!("coordinator {c}: {e}"))
                        }
                        Err(e) => SlotsView::Unknown(format!("coordinator {c}: {e}")),
                    }
                }
            },
            Err(e) => SlotsView::Unknown(format!("coordinator {c}: {e}")),
        }
    }
}

/// `text` after what the row's `detail` already says (its note that the
/// metadata is unknown, put there as it was listed).
fn add_detail(r: &mut ObservedMachine, text: String) {
    r.detail = Some(match r.detail.take() {
        Some(note) => format!("{note}; {text}"),
        None => text,
    });
}

/// The row of `m` as listed: only what later steps read is kept, and its
/// health URL when it is started.
fn listed_row(app: &AppConfig, m: Machine, texts: &mut Texts) -> ObservedMachine {
    // Unknown is never empty: a host Fly cannot reach keeps its metadata
    // out of `metadata`, and says why.
    let unknown = m.known_metadata().err();
    let metadata_unknown = unknown.as_ref().map(|e| e.to_string());
    let pool_key = app.pool_key.as_deref();
    // Only the keys the daemon reads are kept past the listing (its own
    // and the pool key): Fly's own (`fly_platform_version`, …) are most
    // of a machine's metadata and nothing here reads them.
    let metadata: BTreeMap<String, String> = match (&metadata_unknown, &m.config) {
        (None, Some(c)) => c
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with(OWN_KEY_PREFIX) || Some(k.as_str()) == pool_key)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        _ => BTreeMap::new(),
    };
    let pool = pool_of(pool_key, |k| metadata.get(k).map(String::as_str));
    // A machine whose values make no safe URL is not probed (nor drained).
    let mut url_error = None;
    let health_url = if m.is_started() {
        let rendered = app.health_url.render(&UrlVars {
            machine_id: &m.id,
            app: app.name.as_str(),
            private_ip: &m.private_ip,
            region: &m.region,
            name: &m.name,
        });
        match rendered {
            Ok(url) => Some(url),
            Err(e) => {
                url_error = Some(crate::text::bounded(
                    &e.to_string(),
                    crate::text::MAX_DETAIL_CHARS,
                ));
                None
            }
        }
    } else {
        None
    };
    let fly_checks = FlyChecks::of(&m);
    let stop_timeout_secs = match (&metadata_unknown, &m.config) {
        (None, Some(c)) => c.stop_timeout.map_or(0, |t| {
            let secs = t.as_secs().saturating_add(u64::from(t.subsec_nanos() > 0));
            u16::try_from(secs).unwrap_or(u16::MAX)
        }),
        _ => 0,
    };
    let mut row = ObservedMachine {
        region: texts.get(&m.region),
        pool: PoolName::from(texts.get(pool)),
        ..ObservedMachine::listed(app.name.as_str(), &m.id, &m.name, m.state)
    };
    row.inputs.fly_checks = fly_checks.into();
    row.inputs.stop_timeout_secs = stop_timeout_secs;
    row.inputs.metadata = metadata;
    row.inputs.instance_id = m.instance_id;
    row.inputs.cordoned = m.cordoned;
    row.inputs.set_unusual(Unusual {
        metadata_unknown,
        checks: m.checks.into_iter().filter(|c| !c.passing()).collect(),
        events: m.events,
    });
    row.inputs.health_url = health_url;
    // The row says so: its pool, hold and marker are not what it shows.
    if let Some(e) = unknown {
        row.detail = Some(format!(
            "metadata unknown ({}, host status {:?}): its hold, approval, rotation marker and pool label are not known",
            e.what, e.host_status
        ));
    }
    if let Some(why) = url_error {
        probed_row(&mut row, ProbeOutcome::Unreachable(why), texts);
    }
    row
}

/// What the probe of its agent said; the reported ref's text is the one
/// copy in `refs`, held by the row and its report alike.
fn probed_row(r: &mut ObservedMachine, probe: ProbeOutcome, refs: &mut Texts) {
    match probe {
        ProbeOutcome::Unreachable(why) => {
            r.status = MachineStatus::Unreachable;
            add_detail(r, why);
        }
        ProbeOutcome::BadReport(why) => {
            r.status = MachineStatus::BadReport;
            add_detail(r, why);
        }
        ProbeOutcome::Report(mut report) => {
            let reported = refs.get(&report.overlay_ref);
            report.overlay_ref = Arc::clone(&reported);
            r.reported_ref = Some(reported);
            r.inputs.report = Some(report);
        }
    }
}

/// The row completed: what the overlay said of its reported ref.
fn analysed_row(r: &mut ObservedMachine, analysis: &HashMap<String, RefAnalysis>) {
    let Some(reported) = &r.reported_ref else {
        return;
    };
    let verdict = analysis
        .get(&**reported)
        .cloned()
        .unwrap_or(RefAnalysis::Unknown);
    match &verdict {
        RefAnalysis::OnTip { commit } => {
            r.status = MachineStatus::OnTip;
            r.commit = Some(commit.clone());
            r.commits_behind = Some(0);
            r.commits_ahead = Some(0);
        }
        RefAnalysis::Drifted { commit, range } => {
            r.status = MachineStatus::Drifted;
            r.commit = Some(commit.clone());
            r.commits_behind = Some(range.behind);
            r.commits_ahead = Some(range.ahead);
            if range.paths_incomplete {
                add_detail(r, PATHS_INCOMPLETE.into());
            }
        }
        RefAnalysis::Ambiguous => {
            r.status = MachineStatus::AmbiguousRef;
            add_detail(r, "abbreviated ref matches more than one object".into());
        }
        RefAnalysis::Unknown => {
            r.status = MachineStatus::UnknownRef;
            add_detail(r, "ref is not a commit of the overlay repository".into());
        }
    }
    r.inputs.analysis = Some(verdict);
}

/// Items keyed by their app, reordered so that apps take turns: every
/// app's first item, then every app's second, and so on (each app's items
/// keep their order). One huge app then shares the probe budget with a
/// small one instead of going first in full.
fn taking_turns(items: impl Iterator<Item = (usize, usize)>) -> Vec<usize> {
    let mut per_app: BTreeMap<usize, std::collections::VecDeque<usize>> = BTreeMap::new();
    for (app, item) in items {
        per_app.entry(app).or_default().push_back(item);
    }
    let mut out = Vec::with_capacity(per_app.values().map(|q| q.len()).sum());
    while !per_app.is_empty() {
        per_app.retain(|_, q| {
            if let Some(item) = q.pop_front() {
                out.push(item);
            }
            !q.is_empty()
        });
    }
    out
}

/// Gives each machine whose metadata is unknown the pool its coordinator
/// slot names, when one does.
fn pools_from_slots(observation: &mut Observation) {
    for m in &mut observation.machines {
        if m.inputs.metadata_unknown().is_none() {
            continue;
        }
        if let Some(pool) = observation.slots.pool_of(&m.app, &m.machine_id) {
            let note = format!("pool {pool} per its slot in the coordinator's slot set");
            m.detail = Some(match m.detail.take() {
                Some(d) => format!("{d}; {note}"),
                None => note,
            });
            m.pool = pool;
        }
    }
}

/// Each machine whose hold the coordinator keeps is held, whatever its own
/// metadata says now (an agent can delete its machine's hold).
fn add_coordinator_holds(observation: &mut Observation, holds: &BTreeMap<String, String>) {
    for m in &mut observation.machines {
        if m.inputs.metadata_unknown().is_some() {
            continue;
        }
        if let Some(value) = holds.get(m.machine_id.as_str()) {
            let controls = Controls::clone(&m.inputs.controls).with_coordinator_hold(value);
            m.inputs.controls = shared_controls(controls);
        }
    }
}

/// The approvals rotations consumed, by machine id (the coordinator's lists).
type Spent = BTreeMap<String, SpentApprovals>;

/// A consumed approval written back onto its machine approves nothing
/// (its seal still verifies there: only the coordinator knows it was spent).
fn add_spent_approvals(observation: &mut Observation, spent: &Spent) {
    for m in &mut observation.machines {
        if let Some(list) = spent.get(m.machine_id.as_str())
            && m.inputs
                .controls
                .approval_id()
                .is_some_and(|id| list.contains(id))
        {
            let controls = Controls::clone(&m.inputs.controls).with_spent_approvals(list);
            m.inputs.controls = shared_controls(controls);
        }
    }
}

/// The prefix of every metadata key this daemon reads or writes
/// ([`crate::metadata`]'s keys).
const OWN_KEY_PREFIX: &str = "fleet_reconciler_";

/// The pool a machine belongs to: the value of the app's pool key, or `default`.
pub fn pool_of<'a>(pool_key: Option<&str>, metadata: impl Fn(&str) -> Option<&'a str>) -> &'a str {
    pool_key
        .and_then(metadata)
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .unwrap_or(crate::config::DEFAULT_POOL)
}

/// The detail of a drifted machine whose range the path rules have not
/// fully checked yet.
pub const PATHS_INCOMPLETE: &str = "path rules not yet checked on every missing commit (git work per sweep is bounded); observed only until later sweeps finish";

/// The observation of `machines` against `tip`: every configured app
/// listed (none stale), no slots read, and each machine's [`Controls`]
/// parsed from its metadata.
pub fn observation(config: &Config, tip: &Tip, machines: Vec<ObservedMachine>) -> Observation {
    observation_with(config, Trust::AsWritten, tip, machines)
}

/// [`observation`], each machine's sealed records judged as `trust` says.
pub fn observation_with(
    config: &Config,
    trust: Trust<'_>,
    tip: &Tip,
    mut machines: Vec<ObservedMachine>,
) -> Observation {
    for m in &mut machines {
        let controls = Controls::open(&m.inputs.metadata, m.machine_id.as_str(), trust);
        m.inputs.controls = shared_controls(controls);
    }
    Observation {
        tip: TipReport {
            branch: tip.branch.clone(),
            commit: tip.commit.clone(),
        },
        apps: config
            .apps
            .iter()
            .map(|app| AppListing {
                name: app.name.clone(),
                stale: None,
            })
            .collect(),
        machines,
        slots: SlotsView::NotConfigured,
        halts: Default::default(),
        gate: GateView::NotConfigured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apps_take_turns_for_probes() {
        let items = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 10), (2, 20), (2, 21)];
        assert_eq!(
            taking_turns(items.into_iter()),
            [1, 10, 20, 2, 21, 3, 4],
            "each app's first, then each app's second, …; order within an app kept"
        );
        assert!(taking_turns(std::iter::empty()).is_empty());
    }

    #[test]
    fn a_listed_row_keeps_only_the_metadata_keys_events_and_checks_it_reads() {
        let config = Config::parse(
            std::path::Path::new("t.toml"),
            "[overlay]\nrepo = \"/r\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n\
             [[apps]]\nname = \"a\"\npool_key = \"fly_process_group\"\n",
        )
        .unwrap();
        let m: Machine = serde_json::from_str(
            r#"{"id":"m1","name":"n","state":"started","region":"iad","private_ip":"fdaa::2",
                "config":{"metadata":{"fly_platform_version":"v2","fly_process_group":"web","fleet_reconciler_hold":"ops"}},
                "events":[{"type":"launch","timestamp":1},{"type":"exit","timestamp":2},{"type":"start","timestamp":3}],
                "checks":[{"name":"up","status":"passing","output":"HTTP 200 OK after 3 ms"},{"name":"db","status":"critical","output":"refused"}]}"#,
        )
        .unwrap();
        let mut r = listed_row(&config.apps[0], m, &mut Texts::default());
        analysed_row(&mut r, &HashMap::new());
        assert_eq!(r.pool.as_str(), "web");
        assert_eq!(
            r.inputs.metadata.keys().collect::<Vec<_>>(),
            ["fleet_reconciler_hold", "fly_process_group"]
        );
        assert_eq!(r.inputs.events().len(), 1);
        assert_eq!(r.inputs.events()[0].timestamp, 2);
        // Only whether every check passes is read: the failing one is kept.
        assert_eq!(r.inputs.checks().len(), 1);
        assert_eq!(r.inputs.checks()[0].name, "db");
        assert!(r.inputs.health_url.is_some());
        // Every key the daemon reads is one it keeps.
        for key in [
            crate::metadata::MARKER_KEY,
            crate::metadata::HOLD_KEY,
            crate::metadata::APPROVE_KEY,
            crate::metadata::UNPROBED_KEY,
            SLOTS_KEY,
        ] {
            assert!(key.starts_with(OWN_KEY_PREFIX), "{key}");
        }
        // Machines without controls share one empty record.
        let (a, b) = (MachineInputs::default(), MachineInputs::default());
        assert!(Arc::ptr_eq(&a.controls, &b.controls));
    }

    #[test]
    fn rows_of_a_sweep_share_region_pool_and_ref_texts() {
        let config = crate::config::test_config("");
        let machine = |id: &str| -> Machine {
            serde_json::from_value(serde_json::json!({
                "id": id, "name": id, "state": "started", "region": "iad",
                "private_ip": "fdaa::2", "config": {"metadata": {}}
            }))
            .expect("machine")
        };
        let mut texts = Texts::default();
        let mut a = listed_row(&config.apps[0], machine("m1"), &mut texts);
        let mut b = listed_row(&config.apps[0], machine("m2"), &mut texts);
        assert!(Arc::ptr_eq(&a.region, &b.region) && &*a.region == "iad");
        // One allocation of the pool's text, which both rows' names hold.
        assert!(std::ptr::eq(a.pool.as_str(), b.pool.as_str()) && a.pool.as_str() == "default");
        // Each parse makes its own text; the sweep keeps one, which the
        // row and its report both hold.
        let report = || crate::observe::probe::parse_report(br#"{"overlay_ref":"ABCD1234"}"#);
        probed_row(&mut a, report(), &mut texts);
        probed_row(&mut b, report(), &mut texts);
        let (Some(ra), Some(rb)) = (&a.reported_ref, &b.reported_ref) else {
            panic!("no reported ref: {a:?}")
        };
        assert!(Arc::ptr_eq(ra, rb) && &**ra == "abcd1234");
        let overlay_ref = a.inputs.report.as_ref().map(|r| Arc::clone(&r.overlay_ref));
        assert!(overlay_ref.is_some_and(|r| Arc::ptr_eq(&r, ra)));
        // Nothing unusual about these machines: no box is made for it.
        assert!(a.inputs.unusual.is_none());
    }

    #[test]
    fn pools_come_from_metadata_or_default() {
        let md = |k: &str| {
            if k == "pool" {
                Some("dispatch")
            } else {
                Some(" ")
            }
        };
        assert_eq!(pool_of(Some("pool"), md), "dispatch");
        assert_eq!(pool_of(Some("other"), md), "default");
        assert_eq!(pool_of(None, md), "default");
    }

    /// #32 item 13 b/e: the row keeps whether every check the config
    /// defines has a passing result and since when, and the stop timeout,
    /// in what was padding.
    #[test]
    fn item13_a_listed_row_keeps_its_checks_freshness_and_stop_timeout() {
        let config = crate::config::test_config("");
        let row = |v: serde_json::Value| {
            let m: Machine = serde_json::from_value(v).expect("machine");
            listed_row(&config.apps[0], m, &mut Texts::default())
        };
        let with = |checks: serde_json::Value, results: serde_json::Value| {
            row(serde_json::json!({
                "id": "m1", "state": "started",
                "config": {"metadata": {}, "checks": checks, "stop_config": {"timeout": "12.5s"}},
                "checks": results
            }))
        };
        let defined = serde_json::json!({"a": {}, "b": {}});
        let passing = |at: &str| serde_json::json!({"status": "passing", "updated_at": at});
        let r = with(
            defined.clone(),
            serde_json::json!([
                passing("2026-08-21T10:00:05.123Z"),
                passing("2026-08-21T10:00:01.009Z")
            ]),
        );
        assert_eq!(
            r.inputs.fly_checks(),
            FlyChecks::AllPassingSince(1_787_306_401_008),
            "the oldest, rounded down to 4 ms"
        );
        assert_eq!(r.inputs.stop_timeout_secs, 13, "rounded up");
        // One defined check has no result yet: not all passing.
        let r = with(
            defined.clone(),
            serde_json::json!([passing("2026-08-21T10:00:05Z")]),
        );
        assert_eq!(r.inputs.fly_checks(), FlyChecks::NotAllPassing);
        let r = with(defined, serde_json::json!([]));
        assert_eq!(r.inputs.fly_checks(), FlyChecks::NotAllPassing);
        // None defined: results say nothing (failing ones are still kept).
        let r = with(
            serde_json::json!({}),
            serde_json::json!([{"status": "critical"}]),
        );
        assert_eq!(r.inputs.fly_checks(), FlyChecks::NoneDefined);
        assert_eq!(r.inputs.checks().len(), 1);
        // An unreadable time is the oldest there is.
        let r = with(
            serde_json::json!({"a": {}}),
            serde_json::json!([{"status": "passing"}]),
        );
        assert_eq!(r.inputs.fly_checks(), FlyChecks::AllPassingSince(0));
        // Unknown config: not all passing, no stop timeout.
        let r = row(
            serde_json::json!({"id": "m1", "state": "started", "host_status": "unreachable",
            "incomplete_config": {"metadata": {}, "stop_config": {"timeout": "10s"}}}),
        );
        assert_eq!(
            (r.inputs.fly_checks(), r.inputs.stop_timeout_secs),
            (FlyChecks::NotAllPassing, 0)
        );
        // Packing keeps every case; out of range is the oldest.
        for c in [
            FlyChecks::NoneDefined,
            FlyChecks::NotAllPassing,
            FlyChecks::AllPassingSince(0),
            FlyChecks::AllPassingSince(1_787_306_401_996),
        ] {
            assert_eq!(PackedChecks::from(c).get(), c);
        }
        assert_eq!(
            PackedChecks::from(FlyChecks::AllPassingSince(-5)).get(),
            FlyChecks::AllPassingSince(0)
        );
        assert_eq!(
            PackedChecks::from(FlyChecks::AllPassingSince(i64::MAX)).get(),
            FlyChecks::AllPassingSince(0)
        );
    }
}

//! The daemon's memory of each app's last listing, which deciding reads.
//!
//! Owns [`LastListings`]: an app a sweep cannot list is shown (and planned
//! on, as stale: nothing is done to its machines) with its last listing,
//! and a machine whose host cannot give its metadata keeps the pool, hold
//! and marker of its last listing that knew them. It must never read the
//! world or the clock (`now` is passed in), and never invent what no
//! listing said: an approval, which authorizes, is never carried.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use crate::decide::snapshot::{JudgedMachine, Snapshot};
use crate::metadata::controls::Controls;
use crate::model::{AppName, MachineId};
use crate::observe::sweep::{SlotsView, shared_controls};

/// Each app's last successful listing, kept by the daemon across sweeps: an
/// app a sweep cannot list keeps its last known machines and figures in the
/// report (marked stale, with when they were listed) rather than vanishing
/// from the report, the metrics and the planner's memory. A provider error in
/// one app never invalidates the data of the others, and never makes its own
/// machines look gone.
#[derive(Debug, Default)]
pub struct LastListings {
    apps: HashMap<AppName, Listing>,
    /// Apps whose last listing failed, with the error logged.
    failing: HashMap<AppName, String>,
    /// Set for a process that sweeps once ([`LastListings::one_shot`]).
    one_shot: bool,
}

#[derive(Debug)]
struct Listing {
    at: DateTime<Utc>,
    machines: Vec<JudgedMachine>,
    /// When each machine's metadata was last known (listed with it).
    known_at: HashMap<MachineId, DateTime<Utc>>,
}

impl Listing {
    /// Fills each machine of a fresh listing whose metadata is unknown from
    /// this earlier listing: its pool (unless its coordinator slot named
    /// one this sweep) and the controls that restrain (hold, marker), never
    /// the approval, which authorizes. Returns when each machine's metadata
    /// was last known.
    fn fill_unknown(
        &self,
        machines: &mut [JudgedMachine],
        slots: &SlotsView,
        now: DateTime<Utc>,
    ) -> HashMap<MachineId, DateTime<Utc>> {
        let mut known_at = HashMap::new();
        for m in machines {
            if m.seen.inputs.metadata_unknown().is_none() {
                known_at.insert(m.seen.machine_id.clone(), now);
                continue;
            }
            let (Some(last), Some(at)) = (
                self.machines
                    .iter()
                    .find(|l| l.seen.machine_id == m.seen.machine_id),
                self.known_at.get(&m.seen.machine_id),
            ) else {
                continue;
            };
            known_at.insert(m.seen.machine_id.clone(), *at);
            let from_slot = slots.pool_of(&m.seen.app, &m.seen.machine_id).is_some();
            let m = &mut m.seen;
            if !from_slot {
                m.pool = last.seen.pool.clone();
            }
            m.inputs.controls = shared_controls(Controls {
                hold: last.seen.inputs.controls.hold.clone(),
                marker: last.seen.inputs.controls.marker.clone(),
                approval: None,
                approval_id: None,
                approval_epoch: None,
                unprobed: None,
                unprobed_cleared: None,
                tampered: last.seen.inputs.controls.tampered.clone(),
                by_previous_key: Vec::new(),
            });
            let note = format!(
                "{}hold and marker as last listed at {}",
                if from_slot { "" } else { "pool, " },
                at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            );
            m.detail = Some(match m.detail.take() {
                Some(d) => format!("{d}; {note}"),
                None => note,
            });
        }
        known_at
    }
}

impl LastListings {
    /// The memory of a process that sweeps once (`check`, `plan`): it has
    /// no earlier listing to show and keeps none, so preparing with it
    /// neither copies the listing (at 100,000 machines, tens of MiB) nor
    /// logs what `check` says itself: a stale app stays as the sweep saw it.
    pub fn one_shot() -> LastListings {
        LastListings {
            one_shot: true,
            ..LastListings::default()
        }
    }

    /// Folds the sweep that ended at `now` in: remembers every listed app's
    /// machines, and gives every stale app its last listing (its machines,
    /// as judged then, and `last_listed_at`). Logs when an app stops and
    /// starts being listable. True when some app's last listing was carried
    /// (its figures are then to be recomputed).
    pub fn carry(&mut self, snapshot: &mut Snapshot, now: DateTime<Utc>) -> bool {
        if self.one_shot {
            return false;
        }
        let mut by_app: HashMap<AppName, Vec<JudgedMachine>> = HashMap::new();
        let mut order: Vec<AppName> = Vec::new();
        for m in std::mem::take(&mut snapshot.machines) {
            if !by_app.contains_key(&m.seen.app) {
                order.push(m.seen.app.clone());
            }
            by_app.entry(m.seen.app.clone()).or_default().push(m);
        }
        let mut machines = Vec::new();
        let mut carried = false;
        for app in &mut snapshot.apps {
            let listed = by_app.remove(&app.name).unwrap_or_default();
            match &mut app.stale {
                None => {
                    if self.failing.remove(&app.name).is_some() {
                        tracing::info!(app = %app.name, "app listed again: its machines are managed again");
                    }
                    let mut listed = listed;
                    // Unknown is never empty: a machine whose host is down
                    // keeps what its last listing said of it.
                    let known_at = match self.apps.get(&app.name) {
                        Some(last) => last.fill_unknown(&mut listed, &snapshot.slots, now),
                        None => listed
                            .iter()
                            .filter(|m| m.seen.inputs.metadata_unknown().is_none())
                            .map(|m| (m.seen.machine_id.clone(), now))
                            .collect(),
                    };
                    self.apps.insert(
                        app.name.clone(),
                        Listing {
                            at: now,
                            machines: listed.clone(),
                            known_at,
                        },
                    );
                    machines.extend(listed);
                }
                Some(stale) => {
                    if self.failing.get(&app.name) != Some(&stale.error) {
                        tracing::warn!(
                            app = %app.name, error = %stale.error, kind = %stale.kind,
                            "cannot list the app's machines: its last listing is shown as stale and nothing is done to its machines until it lists again"
                        );
                        self.failing.insert(app.name.clone(), stale.error.clone());
                    }
                    machines.extend(listed);
                    if let Some(last) = self.apps.get(&app.name) {
                        stale.last_listed_at = Some(last.at);
                        machines.extend(last.machines.iter().cloned());
                        carried = true;
                    }
                }
            }
        }
        // Machines of an app without a summary cannot come from `sweep`; keep them.
        for app in order {
            machines.extend(by_app.remove(&app).unwrap_or_default());
        }
        snapshot.machines = machines;
        carried
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashSet};

    use super::*;
    use crate::config::Config;
    use crate::decide::policy::Policy;
    use crate::decide::prepare::prepare;
    use crate::decide::snapshot::Coherence;
    use crate::model::{MachineState, MachineStatus};
    use crate::observe::overlay::Tip;
    use crate::observe::sweep::{Observation, ObservedMachine, StaleApp};

    fn config() -> Config {
        Config::parse(
            std::path::Path::new("t.toml"),
            "[overlay]\nrepo = \"/r\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n\
             [[apps]]\nname = \"a\"\n[[apps]]\nname = \"b\"\n",
        )
        .unwrap()
    }

    fn machine(app: &str, id: &str, status: MachineStatus) -> ObservedMachine {
        ObservedMachine {
            region: "iad".into(),
            status,
            ..ObservedMachine::listed(app, id, id, MachineState::Started)
        }
    }

    fn observed(machines: Vec<ObservedMachine>, unlisted: &[&str]) -> Observation {
        let tip = Tip {
            branch: "release".into(),
            commit: crate::model::CommitId::parse(&"a".repeat(40)).unwrap(),
        };
        let mut r = crate::observe::sweep::observation(&config(), &tip, machines);
        for app in r
            .apps
            .iter_mut()
            .filter(|a| unlisted.contains(&a.name.as_str()))
        {
            app.stale = Some(StaleApp {
                error: format!("cannot list machines of app {}: boom", app.name),
                kind: "status".into(),
                last_listed_at: None,
            });
        }
        r
    }

    /// The sweep of `machines` (apps `unlisted` not listed) prepared at
    /// `now` with `listings`, as the loop prepares each sweep.
    fn prepared(
        listings: &mut LastListings,
        machines: Vec<ObservedMachine>,
        unlisted: &[&str],
        now: DateTime<Utc>,
    ) -> Snapshot {
        let observation = observed(machines, unlisted);
        let mut tracker = crate::decide::planner::Tracker::default();
        prepare(&Policy::default(), observation, listings, &mut tracker, now)
    }

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap_or_default()
    }

    #[test]
    fn a_stale_app_keeps_its_last_listing_and_the_others_are_fresh() {
        let mut listings = LastListings::default();
        let first = prepared(
            &mut listings,
            vec![
                machine("a", "a1", MachineStatus::OnTip),
                machine("b", "b1", MachineStatus::Drifted),
                machine("b", "b2", MachineStatus::OnTip),
            ],
            &[],
            at(0),
        );
        assert_eq!(first.machines.len(), 3);

        // b cannot be listed; a changed meanwhile.
        let second = prepared(
            &mut listings,
            vec![machine("a", "a1", MachineStatus::Drifted)],
            &["b"],
            at(30),
        );
        let ids: Vec<&str> = second
            .machines
            .iter()
            .map(|m| m.seen.machine_id.as_str())
            .collect();
        assert_eq!(ids, ["a1", "b1", "b2"]);
        assert_eq!(
            second.machines[0].seen.status,
            MachineStatus::Drifted,
            "a is fresh"
        );
        let b = &second.apps[1];
        assert_eq!(b.coherence, Coherence::of(1, 2));
        assert_eq!(b.coherence.ratio, 0.5);
        let s = b.stale.as_ref().unwrap();
        assert_eq!(s.last_listed_at, Some(at(0)));
        assert!(s.error.contains("app b"));
        assert!(second.apps[0].stale.is_none());
        // Fleet figures: a now, b as last listed.
        assert!((second.coherence.ratio - 1.0 / 3.0).abs() < 1e-9);
        assert_eq!(second.stale_app_names(), HashSet::from(["b"]));

        // Still not listed: still the first listing, still dated then.
        let third = prepared(
            &mut listings,
            vec![machine("a", "a1", MachineStatus::OnTip)],
            &["b"],
            at(60),
        );
        assert_eq!(
            third.apps[1].stale.as_ref().unwrap().last_listed_at,
            Some(at(0))
        );
        assert_eq!(third.machines.len(), 3);

        // Listed again: its new listing, nothing stale.
        let fourth = prepared(
            &mut listings,
            vec![
                machine("a", "a1", MachineStatus::OnTip),
                machine("b", "b2", MachineStatus::OnTip),
            ],
            &[],
            at(90),
        );
        assert_eq!(fourth.machines.len(), 2);
        assert_eq!(fourth.stale_apps().count(), 0);
        assert_eq!(fourth.coherence.ratio, 1.0);
    }

    #[test]
    fn an_app_never_listed_has_no_machines_and_no_date() {
        let mut listings = LastListings::default();
        let r = prepared(
            &mut listings,
            vec![machine("a", "a1", MachineStatus::OnTip)],
            &["b"],
            at(0),
        );
        assert_eq!(r.machines.len(), 1);
        let b = &r.apps[1];
        assert_eq!((b.coherence.machines, b.coherence.on_tip), (0, 0));
        assert_eq!(b.stale.as_ref().unwrap().last_listed_at, None);
        // (The fleet document's entry for it: `report::wire`'s tests.)
    }

    /// A process that sweeps once keeps no listing: an app it cannot list
    /// has no machines and no date, however often it sweeps, and nothing
    /// of a listed app is copied into the memory.
    #[test]
    fn a_one_shot_memory_carries_and_keeps_nothing() {
        let mut listings = LastListings::one_shot();
        let machines = || {
            vec![
                machine("a", "a1", MachineStatus::OnTip),
                machine("b", "b1", MachineStatus::OnTip),
            ]
        };
        let first = prepared(&mut listings, machines(), &[], at(0));
        assert_eq!(first.machines.len(), 2);
        assert!(listings.apps.is_empty() && listings.failing.is_empty());
        let second = prepared(&mut listings, vec![machines().remove(0)], &["b"], at(30));
        assert_eq!(second.machines.len(), 1);
        assert_eq!(second.apps[1].stale.as_ref().unwrap().last_listed_at, None);
        assert_eq!(
            (second.apps[1].coherence.machines, second.coherence.ratio),
            (0, 1.0)
        );
        assert!(listings.apps.is_empty() && listings.failing.is_empty());
    }

    /// A host down for several sweeps: each keeps the pool and hold of the
    /// last listing that knew them, dated from then; the host back, the
    /// fresh metadata wins.
    #[test]
    fn unknown_metadata_keeps_the_last_known_pool_and_hold_across_sweeps() {
        let known = || {
            let mut m = machine("a", "a1", MachineStatus::OnTip);
            m.pool = "p".into();
            m.inputs.metadata =
                BTreeMap::from([(crate::metadata::HOLD_KEY.to_string(), "ops".to_string())]);
            m
        };
        let unknown = || {
            let mut m = machine("a", "a1", MachineStatus::Unreachable);
            m.inputs.unusual_mut().metadata_unknown = Some("host down".into());
            m.detail = Some("metadata unknown".into());
            m
        };
        let mut listings = LastListings::default();
        prepared(&mut listings, vec![known()], &[], at(0));
        for later in [30, 60] {
            let r = prepared(&mut listings, vec![unknown()], &[], at(later));
            let m = &r.machines[0];
            assert_eq!(m.seen.pool.as_str(), "p");
            assert!(m.seen.inputs.controls.is_held());
            assert!(m.seen.inputs.metadata.is_empty());
            let detail = m.seen.detail.as_deref().unwrap_or_default();
            assert!(
                detail.starts_with(
                    "metadata unknown; pool, hold and marker as last listed at 2027-01-15T08:00:00Z"
                ),
                "{detail}"
            );
        }
        let r = prepared(
            &mut listings,
            vec![machine("a", "a1", MachineStatus::OnTip)],
            &[],
            at(90),
        );
        assert_eq!(r.machines[0].seen.pool.as_str(), "default");
        assert!(!r.machines[0].seen.inputs.controls.is_held());
        // Never known at all: nothing to carry, the row says it is unknown.
        let mut listings = LastListings::default();
        let r = prepared(&mut listings, vec![unknown()], &[], at(0));
        assert_eq!(
            r.machines[0].seen.detail.as_deref(),
            Some("metadata unknown")
        );
    }
}

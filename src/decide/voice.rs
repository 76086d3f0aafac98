//! One voice from many replicas, decided: the hold-down that keeps a drift
//! or approval incident open while it is briefly empty
//! (`alerts.resolve_after`), and the freshness rule that keeps a replica
//! with an old view of an app quiet about that app (`alerts.stale_after`).
//!
//! Owns which incidents are held open (those of grouped kinds, and since
//! when they have been empty), what counts as stale (never an alert of a
//! kind about this replica itself, which is always spoken: the kinds' table
//! says which, `AlertKind::is_own` and `is_grouped`), and which incidents are frozen for every
//! sink (holding from a stale view, or gone while the alert each was last
//! drawn from is stale), with until when each holding incident may be
//! asserted ([`Spoken`]). Every time is this replica's own: the sweep's
//! `now` and the times this replica last listed each app ([`Seen`]), never a
//! time written by another replica, an operator's host or an agent. It
//! works on any [`Incident`] (the notifier's groups). It must never read the
//! clock, do I/O, import `report`, or decide what one sink is told: the
//! notifier applies [`Spoken`] to every sink alike.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::decide::alerts::{Alert, Seen};
use crate::events::DedupKey;

/// What the voice rules need of an incident: its key and the alert it is
/// told as (the notifier's groups are incidents).
pub trait Incident: Clone {
    fn key(&self) -> &DedupKey;
    fn alert(&self) -> &Alert;
}

/// What `alerts.stale_after` allows: the age beyond which a view is stale.
#[derive(Clone, Copy, Debug)]
pub struct Freshness {
    pub stale_after: Duration,
}

impl Freshness {
    /// Until when `alert` may be asserted: its data's time plus
    /// `stale_after` (`None`: its data was never seen). Its own alerts are
    /// always of `now`.
    pub fn valid_until(
        &self,
        alert: &Alert,
        seen: &Seen,
        now: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        let at = if alert.kind.is_own() {
            Some(now)
        } else {
            seen.of(alert)
        }?;
        let ahead = chrono::Duration::from_std(self.stale_after).unwrap_or(chrono::Duration::MAX);
        Some(
            at.checked_add_signed(ahead)
                .unwrap_or(DateTime::<Utc>::MAX_UTC),
        )
    }

    /// Whether this replica must say nothing about `alert` at `now`: its
    /// data is older than `stale_after`, or was never seen.
    pub fn stale(&self, alert: &Alert, seen: &Seen, now: DateTime<Utc>) -> bool {
        self.valid_until(alert, seen, now)
            .is_none_or(|until| until < now)
    }
}

/// What the voice rules say of one update, for every sink alike.
#[derive(Debug, Default, PartialEq)]
pub struct Spoken {
    /// Incidents no sink may trigger, update, repeat or resolve now: those
    /// (holding, or gone and last drawn) from a view older than
    /// `alerts.stale_after`.
    pub frozen: BTreeSet<DedupKey>,
    /// Until when each holding incident may be asserted (absent: not at
    /// all): a held one from its last sighting, any other from its data's
    /// time ([`Freshness::valid_until`]).
    pub until: BTreeMap<DedupKey, DateTime<Utc>>,
}

/// The two rules of one voice, with the little they remember: the
/// hold-down, and the alert each incident some sink may hold was last drawn
/// from (what "gone, from a view now stale" is judged by).
#[derive(Debug)]
pub struct Voice<I> {
    hold: HoldDown<I>,
    freshness: Freshness,
    /// The alert each incident was last drawn from while fresh; kept while
    /// it holds, or is gone but frozen (a sink may still hold it). Seeded
    /// with what sinks were told before this run.
    drawn: BTreeMap<DedupKey, Alert>,
}

impl<I: Incident> Voice<I> {
    pub fn new(resolve_after: Duration, stale_after: Duration) -> Voice<I> {
        Voice {
            hold: HoldDown::new(resolve_after),
            freshness: Freshness { stale_after },
            drawn: BTreeMap::new(),
        }
    }

    /// Whether the next `apply` takes the incidents told before this run.
    pub fn wants_told(&self) -> bool {
        self.hold.wants_told()
    }

    /// Applies the hold-down to `current` (see [`HoldDown::apply`]; `told`
    /// is read at the first call only) and says which incidents are frozen
    /// and until when each may be asserted.
    pub fn apply(
        &mut self,
        current: &mut BTreeMap<DedupKey, I>,
        told: Vec<I>,
        seen: &Seen,
        now: DateTime<Utc>,
    ) -> Spoken {
        for g in &told {
            self.drawn
                .entry(g.key().clone())
                .or_insert_with(|| g.alert().clone());
        }
        let held = self.hold.apply(current, told, seen, now);
        let fresh = self.freshness;
        let stale = |a: &Alert| fresh.stale(a, seen, now);
        // A holding incident is judged by its data now; a gone one by the
        // data it was last drawn from: old data never resolves it.
        let mut frozen: BTreeSet<DedupKey> = current
            .iter()
            .filter(|(_, g)| stale(g.alert()))
            .map(|(k, _)| k.clone())
            .collect();
        frozen.extend(
            self.drawn
                .iter()
                .filter(|(k, a)| !current.contains_key(*k) && stale(a))
                .map(|(k, _)| k.clone()),
        );
        // Gone and not frozen: every sink is told it is over now.
        self.drawn
            .retain(|k, _| current.contains_key(k) || frozen.contains(k));
        for (key, g) in current.iter() {
            if !frozen.contains(key) {
                self.drawn.insert(key.clone(), g.alert().clone());
            }
        }
        // A held incident is asserted from its last sighting, not refreshed.
        let until = current
            .iter()
            .filter_map(|(key, g)| {
                let t = match held.get(key) {
                    Some(t) => Some(*t),
                    None => fresh.valid_until(g.alert(), seen, now),
                };
                t.map(|t| (key.clone(), t))
            })
            .collect();
        Spoken { frozen, until }
    }
}

/// The hold-down of `alerts.resolve_after`: grouped incidents that emptied
/// stay in what the sinks see, with their last members, until they have been
/// empty that long.
#[derive(Debug)]
pub struct HoldDown<I> {
    after: Duration,
    /// Held-kind incidents seen in this run (or told before it), with since
    /// when each has been empty.
    known: BTreeMap<DedupKey, Held<I>>,
    /// The incidents told before this run were taken in (at the first
    /// `apply`): once over, they are not held again.
    seeded: bool,
}

#[derive(Debug)]
struct Held<I> {
    last: I,
    empty_since: Option<DateTime<Utc>>,
    /// When the data of its last non-empty sighting was seen (`None`: only
    /// told before this run): what a held incident is asserted from.
    seen_at: Option<DateTime<Utc>>,
}

impl<I: Incident> HoldDown<I> {
    pub fn new(after: Duration) -> HoldDown<I> {
        HoldDown {
            after,
            known: BTreeMap::new(),
            seeded: false,
        }
    }

    /// Whether the next `apply` takes the incidents told before this run.
    pub fn wants_told(&self) -> bool {
        !self.seeded
    }

    /// Adds to `current` the held incidents: those that emptied less than
    /// `resolve_after` ago (`told` is read at the first call only); returns, for each, until when it may be asserted
    /// (its last sighting's data time plus `resolve_after`; now for one only
    /// told before this run, which old data must not re-assert). `told` are the incidents some sink was told of
    /// (before a restart too): one this run has not seen yet counts as
    /// empty from now, so a replica whose first sweeps are not done sends
    /// no resolve. An incident of another tip than `seen.tip` is not held.
    pub fn apply(
        &mut self,
        current: &mut BTreeMap<DedupKey, I>,
        told: impl IntoIterator<Item = I>,
        seen: &Seen,
        now: DateTime<Utc>,
    ) -> BTreeMap<DedupKey, DateTime<Utc>> {
        let told = if self.seeded { None } else { Some(told) };
        self.seeded = true;
        for g in told.into_iter().flatten() {
            if g.alert().kind.is_grouped() && !self.known.contains_key(g.key()) {
                let key = g.key().clone();
                self.known.insert(
                    key,
                    Held {
                        last: g,
                        empty_since: None,
                        seen_at: None,
                    },
                );
            }
        }
        for (key, g) in current.iter() {
            if g.alert().kind.is_grouped() {
                self.known.insert(
                    key.clone(),
                    Held {
                        last: g.clone(),
                        empty_since: None,
                        seen_at: seen.of(g.alert()),
                    },
                );
            }
        }
        let after = chrono::Duration::from_std(self.after).unwrap_or(chrono::Duration::MAX);
        let mut held_until = BTreeMap::new();
        self.known.retain(|key, held| {
            if current.contains_key(key) {
                return true;
            }
            let released =
                matches!((&held.last.alert().commit, &seen.tip), (Some(a), Some(b)) if a != b);
            let since = *held.empty_since.get_or_insert(now);
            let holding = !released && now.signed_duration_since(since) < after;
            if holding {
                current.insert(key.clone(), held.last.clone());
                let until = held.seen_at.map_or(now, |t| {
                    t.checked_add_signed(after)
                        .unwrap_or(DateTime::<Utc>::MAX_UTC)
                });
                held_until.insert(key.clone(), until);
            }
            holding
        });
        held_until
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::alerts::AlertKind;
    use crate::model::{CommitId, Severity};

    fn t(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap_or_default()
    }

    /// An incident as the notifier's groups are: key, alert, machines.
    #[derive(Clone, Debug)]
    struct Grouped {
        key: DedupKey,
        alert: Alert,
        members: BTreeSet<String>,
    }

    impl Incident for Grouped {
        fn key(&self) -> &DedupKey {
            &self.key
        }
        fn alert(&self) -> &Alert {
            &self.alert
        }
    }

    fn incident(machines: &[&str]) -> Grouped {
        Grouped {
            key: DedupKey::new("fleet-reconciler/drift_detected/a/*/t".to_owned()),
            alert: Alert {
                kind: AlertKind::Drift,
                app: Some("a".into()),
                machine_id: None,
                commit: CommitId::parse(&"a".repeat(40)),
                severity: Severity::High,
                summary: String::new(),
                details: BTreeMap::new(),
            },
            members: machines
                .iter()
                .map(|m| (*m).to_owned())
                .collect::<BTreeSet<_>>(),
        }
    }

    fn held(h: &mut HoldDown<Grouped>, now: i64, machines: &[&str]) -> Option<BTreeSet<String>> {
        let mut current = BTreeMap::new();
        if !machines.is_empty() {
            let g = incident(machines);
            current.insert(g.key.clone(), g);
        }
        let seen = Seen {
            tip: CommitId::parse(&"a".repeat(40)),
            ..Seen::fresh(t(now))
        };
        h.apply(&mut current, Vec::new(), &seen, t(now));
        current.into_values().next().map(|g| g.members)
    }

    #[test]
    fn an_incident_is_held_with_its_last_members_until_empty_for_the_hold_down() {
        let mut h = HoldDown::<Grouped>::new(Duration::from_secs(90));
        assert!(held(&mut h, 0, &["m1"]).is_some());
        assert_eq!(
            held(&mut h, 30, &[]),
            Some(BTreeSet::from(["m1".to_owned()]))
        );
        assert_eq!(
            held(&mut h, 60, &["m2"]),
            Some(BTreeSet::from(["m2".to_owned()]))
        );
        assert!(held(&mut h, 90, &[]).is_some());
        assert!(held(&mut h, 179, &[]).is_some());
        assert_eq!(held(&mut h, 180, &[]), None, "empty for 90 s");
    }

    #[test]
    fn an_incident_told_before_is_held_from_the_first_update() {
        let mut h = HoldDown::<Grouped>::new(Duration::from_secs(90));
        let mut current = BTreeMap::new();
        h.apply(&mut current, [incident(&["m1"])], &Seen::fresh(t(0)), t(0));
        assert_eq!(current.len(), 1, "not resolved by a first sweep");
        let mut current = BTreeMap::new();
        h.apply(
            &mut current,
            [incident(&["m1"])],
            &Seen::fresh(t(90)),
            t(90),
        );
        assert!(current.is_empty());
    }

    #[test]
    fn a_held_incident_is_asserted_from_its_last_sighting_only() {
        let mut h = HoldDown::<Grouped>::new(Duration::from_secs(90));
        let mut current = BTreeMap::new();
        let g = incident(&["m1"]);
        current.insert(g.key.clone(), g.clone());
        h.apply(&mut current, Vec::new(), &Seen::fresh(t(0)), t(0));
        let mut current = BTreeMap::new();
        let until = h.apply(&mut current, Vec::new(), &Seen::fresh(t(30)), t(30));
        assert_eq!(
            until.get(&g.key),
            Some(&t(90)),
            "not moved ahead by later sweeps"
        );
        // Told before this run only: asserted no further than now.
        let mut h = HoldDown::<Grouped>::new(Duration::from_secs(90));
        let mut current = BTreeMap::new();
        let until = h.apply(&mut current, [g.clone()], &Seen::fresh(t(500)), t(500));
        assert_eq!(until.get(&g.key), Some(&t(500)));
    }

    #[test]
    fn a_new_release_ends_the_old_incident_at_once() {
        let mut h = HoldDown::<Grouped>::new(Duration::from_secs(90));
        assert!(held(&mut h, 0, &["m1"]).is_some());
        let mut current = BTreeMap::new();
        let seen = Seen {
            tip: CommitId::parse(&"b".repeat(40)),
            ..Seen::fresh(t(30))
        };
        h.apply(&mut current, Vec::new(), &seen, t(30));
        assert!(current.is_empty());
    }

    #[test]
    fn stale_is_the_age_of_the_apps_own_view() {
        let f = Freshness {
            stale_after: Duration::from_secs(90),
        };
        let a = incident(&["m1"]).alert;
        let mut seen = Seen::fresh(t(100));
        assert!(!f.stale(&a, &seen, t(190)));
        assert!(f.stale(&a, &seen, t(191)));
        seen.unlisted.insert("a".into(), Some(t(0)));
        assert!(f.stale(&a, &seen, t(100)), "a was last listed at 0");
        seen.unlisted.insert("a".into(), None);
        assert!(f.stale(&a, &seen, t(100)), "never listed");
        let own = Alert {
            kind: AlertKind::AppUnlistable,
            ..a
        };
        assert!(!f.stale(&own, &seen, t(1000)));
        assert!(
            f.stale(&incident(&[]).alert, &Seen::default(), t(0)),
            "no sweep yet"
        );
    }

    /// One rule for every sink: an incident holding from stale data, or
    /// gone while the data it was last drawn from is stale, is frozen; once
    /// the view is fresh again the gone one is released (told over).
    #[test]
    fn a_gone_incident_last_drawn_from_a_stale_view_is_frozen_until_fresh() {
        let mut v = Voice::<Grouped>::new(Duration::ZERO, Duration::from_secs(90));
        let g = incident(&["m1"]);
        let spoken = |v: &mut Voice<Grouped>, machines: &[&str], seen: &Seen, now| {
            let mut current = BTreeMap::new();
            if !machines.is_empty() {
                let g = incident(machines);
                current.insert(g.key.clone(), g);
            }
            v.apply(&mut current, Vec::new(), seen, t(now))
        };
        let s = spoken(&mut v, &["m1"], &Seen::fresh(t(0)), 0);
        assert!(s.frozen.is_empty());
        assert_eq!(s.until.get(&g.key), Some(&t(90)));
        // Sweeps fail: the view of 0 s is stale at 91 s, holding or gone.
        let old = Seen::fresh(t(0));
        let s = spoken(&mut v, &["m1"], &old, 91);
        assert!(s.frozen.contains(&g.key), "holding, stale");
        let s = spoken(&mut v, &[], &old, 92);
        assert!(s.frozen.contains(&g.key), "gone, last drawn at 0 s");
        let s = spoken(&mut v, &[], &old, 500);
        assert!(s.frozen.contains(&g.key), "still not ours to resolve");
        // Fresh again and gone: no longer frozen (every sink resolves it),
        // and forgotten.
        let s = spoken(&mut v, &[], &Seen::fresh(t(600)), 600);
        assert!(s.frozen.is_empty());
        assert!(v.drawn.is_empty());
        // Told before this run, gone, its app never seen in this run: frozen.
        let mut v = Voice::<Grouped>::new(Duration::ZERO, Duration::from_secs(90));
        let mut current = BTreeMap::new();
        let never = Seen {
            unlisted: BTreeMap::from([("a".into(), None)]),
            ..Seen::fresh(t(0))
        };
        let s = v.apply(&mut current, vec![g.clone()], &never, t(0));
        assert!(s.frozen.contains(&g.key), "{s:?}");
    }
}

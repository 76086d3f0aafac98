//! The analysis: reported refs → their drift from the tip, in one pass per
//! batch.
//!
//! Each distinct ref is resolved once (cached until the refs change); the
//! ranges already measured come from the cache (per tip, commit and
//! signals); the rest are measured in one walk of the commit graph per
//! [`MAX_WALK_TARGETS`]: the commits the graph lacks are read, every commit
//! some target lacks gets its signal mask (trailer keys from the graph, paths
//! from a diff within the budget, kept for good), the walk is tallied per
//! target, and each range is described (its newest commits, its evidence).
//!
//! It reads the mirror and never fetches or writes it (only the saved graph).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use git2::{ErrorCode, ObjectType, Odb, Oid, Repository};

use super::graph::{FastMap, Graph, Node, Tally, Walk};
use super::signals::{self, SignalId, Signals};
use super::{
    Counters, DriftRange, EvidenceDetail, Inner, MAX_SHOWN_MISSING, OverlayError, RefAnalysis,
    commit_id, facts,
};
use crate::model::{CommitId, MissingCommit};

/// libgit2's minimum prefix length (`GIT_OID_MINPREFIXLEN`); a shorter
/// prefix cannot name one object, so it fails closed as ambiguous.
const MIN_PREFIX_LEN: usize = 4;

const FULL_ID_LEN: usize = 40;

/// Cache bounds: when a cache grows past its bound it is dropped whole. The
/// fleet's distinct refs are far fewer than this, so steady state never hits
/// it; it only caps memory when refs churn (e.g. agents reporting garbage).
const MAX_CACHED_RANGES: usize = 10_000;

const MAX_CACHED_RESOLUTIONS: usize = 20_000;

/// Commit texts (subject ≤ 200 characters, trailer keys) kept for reasons.
const MAX_CACHED_TEXTS: usize = 10_000;

/// Targets per walk: each walked commit carries one bit per target, so this
/// bounds a walk's memory (128 bytes per commit) however many distinct refs
/// the fleet reports; more targets take more walks.
const MAX_WALK_TARGETS: usize = 1023;

/// Commits whose path facts are read through one handle on the mirror
/// before it is closed, freeing the delta bases libgit2 kept ([`Measure`]).
/// At 256, a first analysis of cargo's history under a `paths` rule peaked
/// at 22.4 MB of heap instead of 25.8 (user CPU within the runs' spread;
/// each reopen maps the pack index again, about 0.05 s of system time in
/// all).
const REOPEN_EVERY: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Resolution {
    Commit(Oid),
    Unknown,
    Ambiguous,
}

impl Inner {
    /// The pass for one batch: the tip, each distinct ref resolved, the
    /// drift range of each resolved commit (cached or measured), and one
    /// answer per ref.
    pub(super) fn analyze_blocking(
        &self,
        tip: &CommitId,
        refs: Vec<String>,
        signals: &Signals,
    ) -> Result<HashMap<String, RefAnalysis>, OverlayError> {
        // This handle is closed before the ranges are measured: libgit2
        // frees a pack's caches only when no handle on the mirror is open
        // ([`Measure`]).
        let (tip, resolved) = {
            let repo = self.open_repo()?;
            let tip = self.tip_in(&repo, tip)?;
            self.note_refs(&repo)?;
            (tip, self.resolve_all(&repo, refs)?)
        };
        let ranges = self.ranges(tip, &resolved, signals)?;
        answers(tip, resolved, &ranges)
    }

    /// The tip's id; it must be a commit the mirror has.
    fn tip_in(&self, repo: &Repository, tip: &CommitId) -> Result<Oid, OverlayError> {
        let tip_missing = || OverlayError::TipMissing {
            tip: tip.clone(),
            path: self.mirror_dir.clone(),
        };
        let oid = Oid::from_str(tip.as_str()).map_err(|_| tip_missing())?;
        repo.find_commit(oid).map_err(|_| tip_missing())?;
        Ok(oid)
    }

    /// Each distinct ref, resolved once, in the order first seen.
    fn resolve_all(
        &self,
        repo: &Repository,
        refs: Vec<String>,
    ) -> Result<Vec<(String, Resolution)>, OverlayError> {
        let generation = self.caches().generation;
        let mut resolved: Vec<(String, Resolution)> = Vec::with_capacity(refs.len());
        let mut seen: HashSet<String> = HashSet::with_capacity(refs.len());
        let mut state = self.graph_state();
        self.load_saved_graph(&mut state);
        for reference in refs {
            if seen.contains(&reference) {
                continue;
            }
            let resolution = self.resolve(repo, &state.graph, &reference, generation)?;
            seen.insert(reference.clone());
            resolved.push((reference, resolution));
        }
        Ok(resolved)
    }

    /// The drift range of every resolved commit but the tip: from the cache,
    /// and the rest measured in one walk, then cached unless incomplete.
    fn ranges(
        &self,
        tip: Oid,
        resolved: &[(String, Resolution)],
        signals: &Signals,
    ) -> Result<HashMap<Oid, Arc<DriftRange>>, OverlayError> {
        let fingerprint = signals.fingerprint();
        let mut ranges: HashMap<Oid, Arc<DriftRange>> = HashMap::new();
        let mut uncached: Vec<Oid> = Vec::new();
        {
            let mut caches = self.caches();
            if caches.ranges_signals != fingerprint {
                caches.ranges.clear();
                caches.ranges_signals = fingerprint;
            }
            for (_, resolution) in resolved {
                let Resolution::Commit(oid) = *resolution else {
                    continue;
                };
                if oid == tip || ranges.contains_key(&oid) || uncached.contains(&oid) {
                    continue;
                }
                match caches.ranges.get(&(tip, oid)) {
                    Some(hit) => {
                        ranges.insert(oid, Arc::clone(hit));
                    }
                    None => uncached.push(oid),
                }
            }
        }
        Counters::add(&self.counters.range_cache_hits, ranges.len());
        if !uncached.is_empty() {
            Counters::add(&self.counters.range_computations, uncached.len());
            let measured = self.measure(tip, &uncached, signals)?;
            let mut caches = self.caches();
            // A concurrent analysis under other signals owns the cache now.
            if caches.ranges_signals == fingerprint {
                if caches.ranges.len() + measured.len() > MAX_CACHED_RANGES {
                    caches.ranges.clear();
                }
                // An incomplete range is measured again (and finished) later.
                for (oid, range) in measured.iter().filter(|(_, r)| !r.paths_incomplete) {
                    caches.ranges.insert((tip, *oid), Arc::clone(range));
                }
            }
            ranges.extend(measured);
        }
        Ok(ranges)
    }

    fn resolve(
        &self,
        repo: &Repository,
        graph: &Graph,
        reference: &str,
        generation: u64,
    ) -> Result<Resolution, OverlayError> {
        if let Some(hit) = self.caches().resolutions.get(reference).copied() {
            self.counters.ref_cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(hit);
        }
        self.counters.ref_lookups.fetch_add(1, Ordering::Relaxed);
        let known = |oid: &Oid| graph.node(oid).is_some();
        let resolution =
            resolve_in(repo, &known, reference).map_err(|e| OverlayError::Resolve {
                reference: reference.to_owned(),
                path: self.mirror_dir.clone(),
                source: self.redactor.cause(&e),
            })?;
        let mut caches = self.caches();
        // A fetch that ran meanwhile may have made this answer stale.
        if caches.generation == generation {
            keep(
                &mut caches.resolutions,
                MAX_CACHED_RESOLUTIONS,
                reference.to_owned(),
                resolution,
            );
        }
        Ok(resolution)
    }

    /// Measures `targets` (distinct, none the tip) against `tip` in one walk
    /// per [`MAX_WALK_TARGETS`], reading into the graph only the commits it
    /// does not have yet and diffing only commits never diffed before.
    fn measure(
        &self,
        tip: Oid,
        targets: &[Oid],
        signals: &Signals,
    ) -> Result<Vec<(Oid, Arc<DriftRange>)>, OverlayError> {
        let mut state = self.graph_state();
        self.load_saved_graph(&mut state);
        let graph = &mut state.graph;
        if signals.has_paths() {
            graph.use_path_signals(signals.path_fingerprint(), signals.words());
        }
        // Each step opens the mirror for itself and closes it when done
        // (see [`Measure`]).
        let (tip_node, nodes) = {
            let repo = self.open_repo()?;
            let odb = repo.odb().map_err(|e| self.read_err(tip, &e))?;
            self.read_commits(graph, &odb, tip, targets)?
        };
        let mut pass = Measure::new(self, graph, signals);
        let mut out = Vec::with_capacity(targets.len());
        for (oids, nodes) in targets
            .chunks(MAX_WALK_TARGETS)
            .zip(nodes.chunks(MAX_WALK_TARGETS))
        {
            let walk = graph.walk(tip_node, nodes);
            Counters::add(&self.counters.walks, 1);
            Counters::add(&self.counters.commits_walked, walk.visited);
            let masks = pass.masks(graph, &walk)?;
            let tallies = graph.tally(&walk, masks.words, MAX_SHOWN_MISSING, |node| masks.of(node));
            let repo = self.open_repo()?;
            let odb = repo.odb().map_err(|e| self.read_err(tip, &e))?;
            for (oid, tally) in oids.iter().zip(tallies) {
                out.push((*oid, Arc::new(pass.range(&repo, &odb, graph, &tally)?)));
            }
        }
        self.save_graph(graph);
        Ok(out)
    }

    /// Reads into the graph `tip`, `targets` and whatever history of theirs
    /// it lacks; their nodes.
    fn read_commits(
        &self,
        graph: &mut Graph,
        odb: &Odb<'_>,
        tip: Oid,
        targets: &[Oid],
    ) -> Result<(Node, Vec<Node>), OverlayError> {
        let before = graph.len();
        let mut read = |oid: Oid| facts::read_commit(odb, oid).map_err(|e| (oid, e));
        let tip_node = self.ensure_node(graph, tip, &mut read)?;
        let nodes = targets
            .iter()
            .map(|t| self.ensure_node(graph, *t, &mut read))
            .collect::<Result<Vec<Node>, OverlayError>>()?;
        Counters::add(&self.counters.commits_read, graph.len() - before);
        Ok((tip_node, nodes))
    }

    /// A commit's subject and trailer keys, read once and kept (bounded):
    /// the reasons of many ranges show the same commits near the tip.
    fn commit_text(
        &self,
        odb: &git2::Odb<'_>,
        oid: Oid,
    ) -> Result<Arc<facts::CommitText>, OverlayError> {
        if let Some(hit) = self.caches().texts.get(&oid) {
            return Ok(Arc::clone(hit));
        }
        let text = facts::read_text(odb, oid).map_err(|e| match e {
            facts::ReadError::Git(e) => self.read_err(oid, &e),
            facts::ReadError::Malformed => OverlayError::MalformedCommit {
                commit: oid.to_string(),
                path: self.mirror_dir.clone(),
            },
        })?;
        let text = Arc::new(text);
        let mut caches = self.caches();
        keep(&mut caches.texts, MAX_CACHED_TEXTS, oid, Arc::clone(&text));
        Ok(text)
    }

    /// A missing commit as ranges list it, built once per commit (bounded).
    fn shown_commit(
        &self,
        odb: &git2::Odb<'_>,
        oid: Oid,
    ) -> Result<Arc<MissingCommit>, OverlayError> {
        if let Some(hit) = self.caches().shown.get(&oid) {
            return Ok(Arc::clone(hit));
        }
        let shown = Arc::new(MissingCommit {
            commit: commit_id(oid)?,
            subject: self.commit_text(odb, oid)?.subject.clone(),
        });
        let mut caches = self.caches();
        keep(&mut caches.shown, MAX_CACHED_TEXTS, oid, Arc::clone(&shown));
        Ok(shown)
    }

    /// What `commit` carries that raised `signal`: the trailer key as the
    /// message writes it, or the first touched path the globs match (one
    /// tree comparison, for an evidence commit only).
    fn evidence_detail(
        &self,
        repo: &Repository,
        odb: &git2::Odb<'_>,
        commit: Oid,
        signal: SignalId,
        signals: &Signals,
    ) -> Result<EvidenceDetail, OverlayError> {
        let text = self.commit_text(odb, commit)?;
        let matched = match signals.get(signal) {
            Some(signals::Signal::Trailers(keys)) => text
                .trailer_keys
                .iter()
                .find(|k| keys.contains(&signals::normalize_trailer_key(k)))
                .cloned(),
            Some(signals::Signal::Paths(p)) => {
                let prefixes: Vec<String> =
                    p.globs.iter().map(|g| signals::literal_prefix(g)).collect();
                facts::first_matching_path(repo, commit, &prefixes, |path| p.set.is_match(path))
                    .map_err(|e| OverlayError::Diff {
                        commit: commit.to_string(),
                        path: self.mirror_dir.clone(),
                        source: self.redactor.cause(&e),
                    })?
            }
            None => None,
        };
        Ok(EvidenceDetail {
            subject: text.subject.clone(),
            matched,
        })
    }
}

/// Inserts into a cache that is dropped whole when it reaches `bound`.
fn keep<K: Hash + Eq, V>(cache: &mut HashMap<K, V>, bound: usize, key: K, value: V) {
    if cache.len() >= bound {
        cache.clear();
    }
    cache.insert(key, value);
}

/// One answer per distinct ref, from its resolution and the ranges.
fn answers(
    tip: Oid,
    resolved: Vec<(String, Resolution)>,
    ranges: &HashMap<Oid, Arc<DriftRange>>,
) -> Result<HashMap<String, RefAnalysis>, OverlayError> {
    let mut out = HashMap::with_capacity(resolved.len());
    for (reference, resolution) in resolved {
        let analysis = match resolution {
            Resolution::Unknown => RefAnalysis::Unknown,
            Resolution::Ambiguous => RefAnalysis::Ambiguous,
            Resolution::Commit(oid) if oid == tip => RefAnalysis::OnTip {
                commit: commit_id(oid)?,
            },
            Resolution::Commit(oid) => match ranges.get(&oid) {
                Some(range) => RefAnalysis::Drifted {
                    commit: commit_id(oid)?,
                    range: Arc::clone(range),
                },
                // `measure` answers every commit it is given.
                None => RefAnalysis::Unknown,
            },
        };
        out.insert(reference, analysis);
    }
    Ok(out)
}

/// One measurement's view of the signals, worked out once: which bits a
/// commit's trailer keys raise, the globs' literal prefixes, the mask layout,
/// and what is left of the diff budget; and the evidence details found so
/// far (many ranges name the same evidence commit).
///
/// The path facts read trees, which in a pack are deltas: libgit2 keeps the
/// bases it rebuilt in a cache per open pack (up to 16 MiB, a limit compiled
/// into it, with no option to lower it), and a pack is shared by every
/// handle on the mirror in the process, so the cache is freed only when all
/// of them are closed. The path reads therefore get a handle of their own,
/// closed every [`REOPEN_EVERY`] commits and when the masks are done, and no
/// other handle is open meanwhile: a first analysis under a `paths` rule
/// otherwise kept about 7 MB of bases live at `check`'s peak (#35 item 6).
struct Measure<'a> {
    inner: &'a Inner,
    signals: &'a Signals,
    /// Words of signal bits.
    words: usize,
    /// Words of a commit's mask: the signals' and, with path signals, the
    /// incomplete bit.
    mask_words: usize,
    /// One bit past the signals marks a commit whose path facts are not
    /// known yet (the budget ran out): a range carrying it is incomplete.
    incomplete_bit: usize,
    /// Per trailer key of the graph, the signal bits it raises.
    table: Vec<u64>,
    /// The path facts read in this analysis, under the globs' prefixes.
    paths: facts::PathFacts,
    /// The handle the path facts read through, while open.
    paths_repo: Option<Repository>,
    /// Commits compared through `paths_repo` since it was opened.
    compared: usize,
    diffs_left: usize,
    details: HashMap<(Oid, SignalId), EvidenceDetail>,
}

/// The signal masks of the commits some target lacks: only those carrying
/// a bit are stored.
struct Masks {
    words: usize,
    offsets: FastMap<Node, usize>,
    masks: Vec<u64>,
    none: Vec<u64>,
}

impl Masks {
    fn of(&self, node: Node) -> &[u64] {
        match self.offsets.get(&node) {
            Some(at) => &self.masks[*at..*at + self.words],
            None => &self.none,
        }
    }
}

impl<'a> Measure<'a> {
    fn new(inner: &'a Inner, graph: &Graph, signals: &'a Signals) -> Measure<'a> {
        let words = signals.words();
        let table = graph.trailer_table(words, |key| {
            signals
                .iter()
                .filter_map(|(id, signal)| match signal {
                    signals::Signal::Trailers(keys) if keys.contains(key) => Some(id.0),
                    _ => None,
                })
                .collect()
        });
        let incomplete_bit = signals.len();
        Measure {
            inner,
            signals,
            words,
            mask_words: if signals.has_paths() {
                (incomplete_bit + 1).div_ceil(64)
            } else {
                words
            },
            incomplete_bit,
            table,
            paths: facts::PathFacts::new(signals.prefixes()),
            paths_repo: None,
            compared: 0,
            diffs_left: inner.diff_budget.load(Ordering::Relaxed),
            details: HashMap::new(),
        }
    }

    /// The mask of every commit `walk` found some target lacking; path
    /// facts are computed once per commit, ever, and kept in the graph.
    fn masks(&mut self, graph: &mut Graph, walk: &Walk) -> Result<Masks, OverlayError> {
        let mut out = Masks {
            words: self.mask_words,
            offsets: FastMap::default(),
            masks: Vec::new(),
            none: vec![0u64; self.mask_words],
        };
        if self.words == 0 {
            return Ok(out);
        }
        // Newest first: the commits most machines lack get their facts
        // before a budget runs out.
        let behind: Vec<Node> = walk.behind_nodes().collect();
        let mut mask = vec![0u64; self.mask_words];
        for node in behind {
            mask.fill(0);
            graph.trailer_mask(node, &self.table, self.words, &mut mask[..self.words]);
            if self.signals.has_paths() {
                match self.path_mask(graph, node)? {
                    Some(paths) => {
                        for (m, p) in mask.iter_mut().zip(&paths) {
                            *m |= p;
                        }
                    }
                    None => mask[self.incomplete_bit / 64] |= 1 << (self.incomplete_bit % 64),
                }
            }
            if mask.iter().any(|w| *w != 0) {
                out.offsets.insert(node, out.masks.len());
                out.masks.extend_from_slice(&mask);
            }
        }
        self.paths_repo = None;
        Ok(out)
    }

    /// The path signals `node` raises: kept from before, or from one diff
    /// while the budget lasts; `None` once it has run out.
    fn path_mask(
        &mut self,
        graph: &mut Graph,
        node: Node,
    ) -> Result<Option<Vec<u64>>, OverlayError> {
        if let Some(known) = graph.path_mask(node) {
            return Ok(Some(known.to_vec()));
        }
        if self.diffs_left == 0 {
            return Ok(None);
        }
        self.diffs_left -= 1;
        let oid = graph.oid(node);
        let repo = match &mut self.paths_repo {
            Some(repo) => repo,
            None => self.paths_repo.insert(self.inner.open_repo()?),
        };
        let computed =
            self.paths
                .mask(repo, oid, self.signals)
                .map_err(|e| OverlayError::Diff {
                    commit: oid.to_string(),
                    path: self.inner.mirror_dir.clone(),
                    source: self.inner.redactor.cause(&e),
                })?;
        self.compared += 1;
        if self.compared >= REOPEN_EVERY {
            self.paths_repo = None;
            self.compared = 0;
        }
        graph.set_path_mask(node, &computed);
        Counters::add(&self.inner.counters.commits_diffed, 1);
        Ok(Some(computed))
    }

    /// One target's range from its tally: counts, evidence with its detail,
    /// the newest missing commits.
    fn range(
        &mut self,
        repo: &Repository,
        odb: &Odb<'_>,
        graph: &Graph,
        tally: &Tally,
    ) -> Result<DriftRange, OverlayError> {
        let mut evidence = BTreeMap::new();
        let mut evidence_detail = BTreeMap::new();
        let mut paths_incomplete = false;
        for (signal, carrier) in tally.evidence.iter().enumerate() {
            match carrier {
                Some(_) if signal == self.incomplete_bit && self.signals.has_paths() => {
                    paths_incomplete = true;
                }
                Some(node) => {
                    let carrier = graph.oid(*node);
                    let id = SignalId(signal);
                    evidence.insert(id, commit_id(carrier)?);
                    evidence_detail.insert(id, self.detail(repo, odb, carrier, id)?);
                }
                None => {}
            }
        }
        let newest = tally
            .newest
            .iter()
            .map(|node| self.inner.shown_commit(odb, graph.oid(*node)))
            .collect::<Result<Vec<_>, OverlayError>>()?;
        Ok(DriftRange {
            behind: tally.behind,
            ahead: tally.ahead,
            evidence,
            paths_incomplete,
            newest,
            evidence_detail,
        })
    }

    /// What `carrier` carries that raised `signal`, found once per
    /// measurement.
    fn detail(
        &mut self,
        repo: &Repository,
        odb: &Odb<'_>,
        carrier: Oid,
        signal: SignalId,
    ) -> Result<EvidenceDetail, OverlayError> {
        if let Some(known) = self.details.get(&(carrier, signal)) {
            return Ok(known.clone());
        }
        let found = self
            .inner
            .evidence_detail(repo, odb, carrier, signal, self.signals)?;
        self.details.insert((carrier, signal), found.clone());
        Ok(found)
    }
}

/// Resolves one reported ref against the object database. `Err` only for a
/// repository failure; anything the agent could have got wrong is a
/// `Resolution`. `known` says which ids are commits already read into the
/// graph: those need no object read at all, which for a fleet of full ids
/// keeps most of the pack index and every pack window out of memory.
fn resolve_in(
    repo: &Repository,
    known: &dyn Fn(&Oid) -> bool,
    reference: &str,
) -> Result<Resolution, git2::Error> {
    let name = reference.to_ascii_lowercase();
    if name.is_empty() || name.len() > FULL_ID_LEN || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Ok(Resolution::Unknown);
    }
    if name.len() < MIN_PREFIX_LEN {
        return Ok(Resolution::Ambiguous);
    }
    // A full id names itself; a prefix must name exactly one object, of
    // any kind (a blob sharing it makes it ambiguous, as it is for git).
    let oid = if name.len() == FULL_ID_LEN {
        Oid::from_str(&name)?
    } else {
        match repo.odb()?.exists_prefix(Oid::from_str(&name)?, name.len()) {
            Ok(oid) => oid,
            Err(e) if e.code() == ErrorCode::Ambiguous => return Ok(Resolution::Ambiguous),
            Err(e) if e.code() == ErrorCode::NotFound => return Ok(Resolution::Unknown),
            Err(e) => return Err(e),
        }
    };
    if known(&oid) {
        return Ok(Resolution::Commit(oid));
    }
    let object = match repo.find_object(oid, None) {
        Ok(object) => object,
        Err(e) if e.code() == ErrorCode::Ambiguous => return Ok(Resolution::Ambiguous),
        Err(e) if e.code() == ErrorCode::NotFound => return Ok(Resolution::Unknown),
        Err(e) => return Err(e),
    };
    match object.kind() {
        Some(ObjectType::Commit) => Ok(Resolution::Commit(object.id())),
        // An annotated tag names the commit it points at; a tag of a tree or
        // blob (or of an object the mirror lacks) names no commit.
        Some(ObjectType::Tag) => match object.peel(ObjectType::Commit) {
            Ok(commit) => Ok(Resolution::Commit(commit.id())),
            Err(e)
                if matches!(
                    e.code(),
                    ErrorCode::InvalidSpec | ErrorCode::NotFound | ErrorCode::Peel
                ) =>
            {
                Ok(Resolution::Unknown)
            }
            Err(e) => Err(e),
        },
        _ => Ok(Resolution::Unknown),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_and_short_refs_resolve_without_lookup() {
        let dir = tempfile::tempdir().expect("tempdir");
        let repo = Repository::init_bare(dir.path()).expect("init");
        let cases = [
            ("", Resolution::Unknown),
            ("xyz1234", Resolution::Unknown),
            (&"a".repeat(41), Resolution::Unknown),
            ("a", Resolution::Ambiguous),
            ("abc", Resolution::Ambiguous),
            ("abcd", Resolution::Unknown),
            (&"ab".repeat(20), Resolution::Unknown),
        ];
        for (reference, expected) in cases {
            assert_eq!(
                resolve_in(&repo, &|_| false, reference).expect("resolve"),
                expected,
                "{reference:?}"
            );
        }
    }
}

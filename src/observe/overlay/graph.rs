//! The commit graph as the overlay has read it, and the one walk that
//! measures every reported commit against the release tip at once.
//!
//! Owns the in-memory record of every commit read so far, numbered
//! parents-first (a commit gets its number only after all its parents have
//! theirs), so descending numbers are a topological order; each commit's
//! parents, committer time and normalised trailer keys; and, for one set of
//! path signals, which of them the commit's own change carries. Commit
//! objects are immutable, so nothing here goes stale: the graph only grows,
//! by the commits new since it was last extended.
//!
//! It must never open the repository itself (commits come through a closure
//! the overlay passes in, tree diffs are done by the overlay), hold git2
//! handles, or give a signal any meaning: it only counts and collects.
//!
//! # The walk
//!
//! Bit 0 stands for the tip, bit `1 + j` for target `j`. Every start gets its
//! bit, and nodes are taken in descending number, each OR-ing its bits into
//! its parents, so when a node is taken its bits are final: exactly the
//! starts it is reachable from. A node reachable from every start ("full")
//! counts for nobody, and neither does any ancestor of it; the walk stops as
//! soon as no node waiting is short of full. Then a node with the tip bit and
//! without target `j`'s is in `tip ^j` (behind), one with `j`'s and without
//! the tip's is in `j ^tip` (ahead): the sets `git rev-list --left-right
//! --count tip...j` counts, merges and all, whatever the commit dates say.

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use git2::Oid;

/// A commit's number in the graph.
pub(crate) type Node = u32;

/// One commit as read from the object database.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RawCommit {
    pub parents: Vec<Oid>,
    /// Committer time (seconds since the epoch); only orders evidence.
    pub time: i64,
    /// Trailer keys, normalised (trimmed, lowercase).
    pub trailers: Vec<String>,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum LoadError<E> {
    /// The closure could not read this commit.
    Read(E),
    /// The object database contradicts itself (a commit among its own
    /// ancestors); only a corrupt repository can do that.
    Inconsistent { commit: Oid },
    /// More commits than a node number can hold.
    TooLarge,
}

/// SHA-1 ids are uniformly distributed: their first eight bytes are a
/// perfectly good hash, with no need for SipHash over twenty.
#[derive(Default)]
pub(crate) struct OidHasher(u64);

impl Hasher for OidHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(word);
        }
    }

    fn write_u32(&mut self, n: u32) {
        // Node numbers as keys: spread them over the whole word.
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_usize(&mut self, _len: usize) {
        // The length prefix of a byte slice; the same (20) for every id.
    }
}

pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<OidHasher>>;

/// An id's first eight bytes: SHA-1 is uniform, so they are a good key.
fn key(oid: &Oid) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&oid.as_bytes()[..8]);
    u64::from_le_bytes(bytes)
}

/// Per-commit path facts for one list of path signals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PathFacts {
    /// `Signals::path_fingerprint` of the signals these were computed for.
    pub fingerprint: u64,
    /// Mask words per commit.
    pub words: usize,
    /// `words` per node, in node order.
    pub masks: Vec<u64>,
    /// Whether a node's mask has been computed.
    pub known: Vec<bool>,
}

/// Every commit read so far; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Graph {
    /// Node by the first eight bytes of its id (half the memory of keying
    /// by the whole id); the rare id whose key is taken is in `collisions`.
    index: FastMap<u64, Node>,
    collisions: FastMap<Oid, Node>,
    oids: Vec<Oid>,
    times: Vec<i64>,
    /// Node `n`'s parents are `parents[parent_start[n]..parent_start[n + 1]]`.
    parent_start: Vec<u32>,
    parents: Vec<Node>,
    /// Node `n`'s trailer keys, as indices into `keys`, likewise.
    trailer_start: Vec<u32>,
    trailers: Vec<u32>,
    keys: Vec<String>,
    key_index: HashMap<String, u32>,
    paths: PathFacts,
    /// Changed since last saved.
    dirty: bool,
}

impl Default for Graph {
    fn default() -> Graph {
        Graph {
            index: FastMap::default(),
            collisions: FastMap::default(),
            oids: Vec::new(),
            times: Vec::new(),
            parent_start: vec![0],
            parents: Vec::new(),
            trailer_start: vec![0],
            trailers: Vec::new(),
            keys: Vec::new(),
            key_index: HashMap::new(),
            paths: PathFacts::default(),
            dirty: false,
        }
    }
}

/// The flat arrays of a graph, for saving and loading.
#[derive(Debug, Default)]
pub(crate) struct GraphParts {
    pub oids: Vec<Oid>,
    pub times: Vec<i64>,
    pub parent_start: Vec<u32>,
    pub parents: Vec<Node>,
    pub trailer_start: Vec<u32>,
    pub trailers: Vec<u32>,
    pub keys: Vec<String>,
    pub paths: PathFacts,
}

/// [`GraphParts`], borrowed.
pub(crate) struct GraphView<'a> {
    pub oids: &'a [Oid],
    pub times: &'a [i64],
    pub parent_start: &'a [u32],
    pub parents: &'a [Node],
    pub trailer_start: &'a [u32],
    pub trailers: &'a [u32],
    pub keys: &'a [String],
    pub paths: &'a PathFacts,
}

impl Graph {
    pub fn len(&self) -> usize {
        self.oids.len()
    }

    pub fn node(&self, oid: &Oid) -> Option<Node> {
        match self.index.get(&key(oid)) {
            Some(&node) if self.oids[node as usize] == *oid => Some(node),
            _ => self.collisions.get(oid).copied(),
        }
    }

    fn insert_index(&mut self, oid: Oid, node: Node) {
        match self.index.entry(key(&oid)) {
            Entry::Vacant(e) => {
                e.insert(node);
            }
            Entry::Occupied(_) => {
                self.collisions.insert(oid, node);
            }
        }
    }

    pub fn oid(&self, node: Node) -> Oid {
        self.oids[node as usize]
    }

    pub fn parents(&self, node: Node) -> &[Node] {
        let n = node as usize;
        &self.parents[self.parent_start[n] as usize..self.parent_start[n + 1] as usize]
    }

    fn trailer_keys(&self, node: Node) -> &[u32] {
        let n = node as usize;
        &self.trailers[self.trailer_start[n] as usize..self.trailer_start[n + 1] as usize]
    }

    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    pub fn mark_clean(&mut self) {
        self.dirty = false;
    }

    /// Approximate heap bytes held, for the benchmark and the docs.
    pub fn heap_bytes(&self) -> usize {
        self.index.capacity() * (std::mem::size_of::<(u64, Node)>() + 1)
            + self.collisions.capacity() * (std::mem::size_of::<(Oid, Node)>() + 1)
            + self.oids.capacity() * std::mem::size_of::<Oid>()
            + self.times.capacity() * 8
            + (self.parent_start.capacity() + self.parents.capacity()) * 4
            + (self.trailer_start.capacity() + self.trailers.capacity()) * 4
            + self.paths.masks.capacity() * 8
            + self.paths.known.capacity()
    }

    /// Adds `oid` and every ancestor not yet in the graph, reading each
    /// commit once with `read`, and returns its node.
    pub fn ensure<E>(
        &mut self,
        oid: Oid,
        read: &mut impl FnMut(Oid) -> Result<RawCommit, E>,
    ) -> Result<Node, LoadError<E>> {
        if let Some(node) = self.node(&oid) {
            return Ok(node);
        }
        // Depth-first, parents before children, without recursion: a linear
        // history is as deep as it is long, so a stack entry is kept small
        // (the commit's parents and trailer keys go to arenas that shrink as
        // entries are numbered: the last entry opened is the first done).
        #[derive(Clone, Copy)]
        struct Opened {
            time: i64,
            parents: (u32, u32),
            trailers: (u32, u32),
        }
        struct Pending {
            oid: Oid,
            opened: Option<Opened>,
        }
        let span = |start: usize, len: usize| -> Result<(u32, u32), LoadError<E>> {
            let start = u32::try_from(start).map_err(|_| LoadError::TooLarge)?;
            let len = u32::try_from(len).map_err(|_| LoadError::TooLarge)?;
            Ok((start, len))
        };
        let slice = |(start, len): (u32, u32)| start as usize..(start + len) as usize;
        let mut parent_arena: Vec<Oid> = Vec::new();
        let mut trailer_arena: Vec<String> = Vec::new();
        // Opened (read, not yet numbered) commits by key: a parent among them
        // would make a commit its own ancestor.
        let mut opened_keys: FastMap<u64, u32> = FastMap::default();
        let mut stack = vec![Pending { oid, opened: None }];
        while let Some(top) = stack.last() {
            let (id, opened) = (top.oid, top.opened);
            if self.node(&id).is_some() {
                stack.pop();
                continue;
            }
            match opened {
                None => {
                    let commit = read(id).map_err(LoadError::Read)?;
                    let parents = span(parent_arena.len(), commit.parents.len())?;
                    let trailers = span(trailer_arena.len(), commit.trailers.len())?;
                    parent_arena.extend_from_slice(&commit.parents);
                    trailer_arena.extend(commit.trailers);
                    if let Some(top) = stack.last_mut() {
                        top.opened = Some(Opened {
                            time: commit.time,
                            parents,
                            trailers,
                        });
                    }
                    *opened_keys.entry(key(&id)).or_default() += 1;
                    for &parent in commit.parents.iter().rev() {
                        if self.node(&parent).is_some() {
                            continue;
                        }
                        let suspect = opened_keys.get(&key(&parent)).is_some_and(|n| *n > 0);
                        if suspect && stack.iter().any(|p| p.oid == parent && p.opened.is_some()) {
                            return Err(LoadError::Inconsistent { commit: parent });
                        }
                        stack.push(Pending {
                            oid: parent,
                            opened: None,
                        });
                    }
                }
                Some(done) => {
                    stack.pop();
                    let parents = parent_arena[slice(done.parents)]
                        .iter()
                        .map(|p| self.node(p))
                        .collect::<Option<Vec<Node>>>()
                        .ok_or(LoadError::Inconsistent { commit: id })?;
                    self.push(
                        id,
                        &parents,
                        done.time,
                        &trailer_arena[slice(done.trailers)],
                    )?;
                    parent_arena.truncate(done.parents.0 as usize);
                    trailer_arena.truncate(done.trailers.0 as usize);
                    if let Entry::Occupied(mut e) = opened_keys.entry(key(&id)) {
                        *e.get_mut() -= 1;
                        if *e.get() == 0 {
                            e.remove();
                        }
                    }
                }
            }
        }
        self.node(&oid)
            .ok_or(LoadError::Inconsistent { commit: oid })
    }

    fn push<E>(
        &mut self,
        oid: Oid,
        parents: &[Node],
        time: i64,
        trailers: &[String],
    ) -> Result<Node, LoadError<E>> {
        let node = Node::try_from(self.oids.len()).map_err(|_| LoadError::TooLarge)?;
        let end = |len: usize| u32::try_from(len).map_err(|_| LoadError::TooLarge);
        self.oids.push(oid);
        self.times.push(time);
        self.parents.extend_from_slice(parents);
        self.parent_start.push(end(self.parents.len())?);
        let first = self.trailers.len();
        for key in trailers {
            let id = match self.key_index.get(key) {
                Some(id) => *id,
                None => {
                    let id = end(self.keys.len())?;
                    self.keys.push(key.clone());
                    self.key_index.insert(key.clone(), id);
                    id
                }
            };
            if !self.trailers[first..].contains(&id) {
                self.trailers.push(id);
            }
        }
        self.trailer_start.push(end(self.trailers.len())?);
        self.insert_index(oid, node);
        self.paths
            .masks
            .resize(self.oids.len() * self.paths.words, 0);
        self.paths.known.push(false);
        self.dirty = true;
        Ok(node)
    }

    /// Keeps the path facts if they were computed for `fingerprint` (and
    /// `words` per commit), else forgets them all.
    pub fn use_path_signals(&mut self, fingerprint: u64, words: usize) {
        if self.paths.fingerprint == fingerprint && self.paths.words == words {
            return;
        }
        self.paths = PathFacts {
            fingerprint,
            words,
            masks: vec![0; self.oids.len() * words],
            known: vec![false; self.oids.len()],
        };
        self.dirty = true;
    }

    pub fn path_mask(&self, node: Node) -> Option<&[u64]> {
        let n = node as usize;
        let words = self.paths.words;
        self.paths.known[n].then(|| &self.paths.masks[n * words..(n + 1) * words])
    }

    pub fn set_path_mask(&mut self, node: Node, mask: &[u64]) {
        let n = node as usize;
        let words = self.paths.words;
        self.paths.masks[n * words..(n + 1) * words].copy_from_slice(&mask[..words]);
        self.paths.known[n] = true;
        self.dirty = true;
    }

    /// For each interned trailer key, the mask of signals it raises.
    pub fn trailer_table(&self, words: usize, raises: impl Fn(&str) -> Vec<usize>) -> Vec<u64> {
        let mut table = vec![0u64; self.keys.len() * words];
        for (k, key) in self.keys.iter().enumerate() {
            for bit in raises(key) {
                table[k * words + bit / 64] |= 1 << (bit % 64);
            }
        }
        table
    }

    /// Measures every target against `tip` in one walk. Targets must be
    /// distinct and differ from `tip`.
    pub fn walk(&self, tip: Node, targets: &[Node]) -> Walk {
        let nbits = targets.len() + 1;
        let words = nbits.div_ceil(64);
        let mut full = vec![u64::MAX; words];
        if !nbits.is_multiple_of(64) {
            full[words - 1] = (1u64 << (nbits % 64)) - 1;
        }
        let mut walk = Walk {
            words,
            targets: targets.len(),
            slot_of: FastMap::default(),
            bits: Vec::new(),
            region: Vec::new(),
            visited: 0,
        };
        let mut heap: BinaryHeap<Node> = BinaryHeap::new();
        // Nodes waiting in the heap whose bits are not (yet) full.
        let mut short = 0usize;
        let is_full = |bits: &[u64]| bits == full.as_slice();

        let mut starts: Vec<(Node, usize)> = vec![(tip, 0)];
        starts.extend(targets.iter().enumerate().map(|(j, t)| (*t, j + 1)));
        for (node, bit) in starts {
            let slot = walk.slot(node, &mut heap, &mut short);
            walk.bits[slot * words + bit / 64] |= 1 << (bit % 64);
        }
        let mut carried = vec![0u64; words];
        while short > 0 {
            let Some(node) = heap.pop() else { break };
            walk.visited += 1;
            let slot = walk.slot_of[&node];
            carried.copy_from_slice(&walk.bits[slot * words..(slot + 1) * words]);
            if !is_full(&carried) {
                short -= 1;
                walk.region.push((node, slot as u32));
            }
            // Full nodes pass "full" on too: an ancestor reached first
            // through a shorter path must not be counted as missing.
            for &parent in self.parents(node) {
                let p = walk.slot(parent, &mut heap, &mut short);
                let bits = &mut walk.bits[p * words..(p + 1) * words];
                let was_full = is_full(bits);
                for (b, c) in bits.iter_mut().zip(&carried) {
                    *b |= c;
                }
                if !was_full && is_full(bits) {
                    short -= 1;
                }
            }
        }
        walk
    }

    /// Counts and collects a walk's results. `masks` gives the signal mask
    /// (`words` long) of a node in `tip ^target` for some target. Each
    /// tally also lists the `newest` newest commits of its `tip ^target`
    /// (by committer time, ties: lowest id), from one sort of the walk's
    /// region: at most `newest` entries per target however long the range.
    pub fn tally<'m>(
        &self,
        walk: &Walk,
        signal_words: usize,
        newest: usize,
        mut masks: impl FnMut(Node) -> &'m [u64],
    ) -> Vec<Tally> {
        let mut out: Vec<Tally> = (0..walk.targets)
            .map(|_| Tally {
                behind: 0,
                ahead: 0,
                evidence: vec![None; signal_words * 64],
                newest: Vec::new(),
            })
            .collect();
        let words = walk.words;
        for &(node, slot) in &walk.region {
            let bits = &walk.bits[slot as usize * words..(slot as usize + 1) * words];
            let on_tip_side = bits[0] & 1 == 1;
            let mask = if on_tip_side && signal_words > 0 {
                masks(node)
            } else {
                &[]
            };
            let has_signals = mask.iter().any(|w| *w != 0);
            for (w, word) in bits.iter().enumerate() {
                // Bit 0 is the tip; targets start at bit 1.
                let mut members = if on_tip_side { !word } else { *word };
                if w == 0 {
                    members &= !1;
                }
                while members != 0 {
                    let bit = w * 64 + members.trailing_zeros() as usize;
                    members &= members - 1;
                    if bit > walk.targets {
                        break;
                    }
                    let tally = &mut out[bit - 1];
                    if on_tip_side {
                        tally.behind += 1;
                        if has_signals {
                            self.offer_evidence(&mut tally.evidence, mask, node);
                        }
                    } else {
                        tally.ahead += 1;
                    }
                }
            }
        }
        if newest > 0 {
            // The tip side of the region, newest first, once; then each
            // target takes the first of them it lacks, and stops when it has
            // `newest` (or all it lacks). A target's missing commits are
            // its descendants' side of the history, so they are mostly the
            // newest: the scan is short however long the range (a range of
            // 100,000 commits costs 20 steps, not 100,000).
            let mut order: Vec<(Recency, u32)> = walk
                .region
                .iter()
                .filter(|(_, slot)| walk.bits[*slot as usize * words] & 1 == 1)
                .map(|(node, slot)| (self.recency(*node), *slot))
                .collect();
            order.sort_unstable_by_key(|(recency, _)| Reverse(*recency));
            for (j, tally) in out.iter_mut().enumerate() {
                let bit = j + 1;
                let (word, mask) = (bit / 64, 1u64 << (bit % 64));
                let wanted = usize::try_from(tally.behind).map_or(newest, |b| b.min(newest));
                tally.newest = order
                    .iter()
                    .filter(|(_, slot)| walk.bits[*slot as usize * words + word] & mask == 0)
                    .take(wanted)
                    .map(|(r, _)| r.node)
                    .collect();
            }
        }
        out
    }

    /// How recent a commit is, for [`Graph::tally`]'s newest commits: later
    /// committer time first, then the lowest id (as evidence is chosen), so
    /// the order does not depend on how commits were numbered.
    fn recency(&self, node: Node) -> Recency {
        Recency {
            time: self.times[node as usize],
            id: Reverse(self.oid(node)),
            node,
        }
    }

    /// Keeps, per signal, the newest commit carrying it (ties: lowest id),
    /// so the evidence does not depend on the order commits were numbered.
    fn offer_evidence(&self, evidence: &mut [Option<Node>], mask: &[u64], node: Node) {
        for (w, word) in mask.iter().enumerate() {
            let mut bits = *word;
            while bits != 0 {
                let s = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let better = match evidence[s] {
                    None => true,
                    Some(held) => {
                        let (t, h) = (self.times[node as usize], self.times[held as usize]);
                        t > h || (t == h && self.oid(node) < self.oid(held))
                    }
                };
                if better {
                    evidence[s] = Some(node);
                }
            }
        }
    }

    /// The signal mask raised by a node's trailer keys, from `table`.
    pub fn trailer_mask(&self, node: Node, table: &[u64], words: usize, out: &mut [u64]) {
        for &key in self.trailer_keys(node) {
            let row = &table[key as usize * words..(key as usize + 1) * words];
            for (o, r) in out.iter_mut().zip(row) {
                *o |= r;
            }
        }
    }

    #[cfg(test)]
    pub fn into_parts(self) -> GraphParts {
        GraphParts {
            oids: self.oids,
            times: self.times,
            parent_start: self.parent_start,
            parents: self.parents,
            trailer_start: self.trailer_start,
            trailers: self.trailers,
            keys: self.keys,
            paths: self.paths,
        }
    }

    /// The flat arrays, borrowed (for saving without a copy).
    pub fn view(&self) -> GraphView<'_> {
        GraphView {
            oids: &self.oids,
            times: &self.times,
            parent_start: &self.parent_start,
            parents: &self.parents,
            trailer_start: &self.trailer_start,
            trailers: &self.trailers,
            keys: &self.keys,
            paths: &self.paths,
        }
    }

    #[cfg(test)]
    pub fn parts(&self) -> GraphParts {
        self.clone().into_parts()
    }

    /// Rebuilds a graph from saved arrays, checking every invariant the
    /// walk relies on (parents numbered before children, ranges in bounds),
    /// so a damaged file can only be refused, never misread.
    pub fn from_parts(parts: GraphParts) -> Option<Graph> {
        let n = parts.oids.len();
        let csr_ok = |start: &[u32], items: usize| {
            start.len() == n + 1
                && start.first() == Some(&0)
                && start.last().map(|l| *l as usize) == Some(items)
                && start.windows(2).all(|w| w[0] <= w[1])
        };
        if parts.times.len() != n
            || !csr_ok(&parts.parent_start, parts.parents.len())
            || !csr_ok(&parts.trailer_start, parts.trailers.len())
            || parts.paths.known.len() != n
            || parts.paths.masks.len() != n * parts.paths.words
        {
            return None;
        }
        for node in 0..n {
            let range = parts.parent_start[node] as usize..parts.parent_start[node + 1] as usize;
            if parts.parents[range].iter().any(|p| *p as usize >= node) {
                return None;
            }
        }
        if parts
            .trailers
            .iter()
            .any(|k| *k as usize >= parts.keys.len())
        {
            return None;
        }
        let key_index = parts
            .keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.clone(), i as u32))
            .collect();
        let mut graph = Graph {
            index: FastMap::default(),
            collisions: FastMap::default(),
            oids: Vec::with_capacity(n),
            times: parts.times,
            parent_start: parts.parent_start,
            parents: parts.parents,
            trailer_start: parts.trailer_start,
            trailers: parts.trailers,
            keys: parts.keys,
            key_index,
            paths: parts.paths,
            dirty: false,
        };
        graph.index.reserve(n);
        for (node, oid) in parts.oids.iter().enumerate() {
            if graph.node(oid).is_some() {
                return None;
            }
            // `node` needs `oids[node]` to check a key's owner.
            graph.oids.push(*oid);
            graph.insert_index(*oid, node as Node);
        }
        Some(graph)
    }
}

/// One walk's state: see [`Graph::walk`].
pub(crate) struct Walk {
    words: usize,
    targets: usize,
    slot_of: FastMap<Node, usize>,
    bits: Vec<u64>,
    /// Nodes reachable from some starts but not all, in descending number,
    /// with their slot in `bits`.
    region: Vec<(Node, u32)>,
    /// Nodes taken from the heap (the walk's cost).
    pub visited: usize,
}

impl Walk {
    fn slot(&mut self, node: Node, heap: &mut BinaryHeap<Node>, short: &mut usize) -> usize {
        match self.slot_of.entry(node) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => {
                let slot = self.bits.len() / self.words;
                self.bits.resize(self.bits.len() + self.words, 0);
                e.insert(slot);
                heap.push(node);
                // A node gets its first bits from one start or one child:
                // never all of them unless there is only the tip.
                *short += 1;
                slot
            }
        }
    }

    /// Nodes in `tip ^target` for some target: the commits whose facts
    /// [`Graph::tally`] will ask for.
    pub fn behind_nodes(&self) -> impl Iterator<Item = Node> + '_ {
        self.region
            .iter()
            .filter(|(_, slot)| self.bits[*slot as usize * self.words] & 1 == 1)
            .map(|(node, _)| *node)
    }
}

/// One target's counts and, per signal, one commit carrying it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tally {
    pub behind: u64,
    pub ahead: u64,
    pub evidence: Vec<Option<Node>>,
    /// The newest commits of `tip ^target`, newest first (at most the
    /// `newest` asked of [`Graph::tally`]).
    pub newest: Vec<Node>,
}

/// A node ranked by [`Graph::recency`]: greater is newer (the node breaks
/// no tie: ids are unique).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Recency {
    time: i64,
    id: Reverse<Oid>,
    node: Node,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashSet, VecDeque};

    fn oid(i: usize) -> Oid {
        let mut bytes = [0u8; 20];
        bytes[..8].copy_from_slice(&(i as u64 + 1).to_be_bytes());
        bytes[19] = 0xAB;
        Oid::from_bytes(&bytes).expect("20 bytes")
    }

    /// A DAG given as parent lists by position (parents before children).
    fn load(parents: &[Vec<usize>], start: usize) -> Graph {
        let mut graph = Graph::default();
        let mut read = |id: Oid| -> Result<RawCommit, ()> {
            let i = (0..parents.len()).find(|i| oid(*i) == id).ok_or(())?;
            Ok(RawCommit {
                parents: parents[i].iter().map(|p| oid(*p)).collect(),
                time: i as i64,
                trailers: Vec::new(),
            })
        };
        for i in (0..parents.len()).rev().skip(parents.len() - 1 - start) {
            graph.ensure(oid(i), &mut read).expect("load");
        }
        graph
    }

    fn ancestors(parents: &[Vec<usize>], of: usize) -> HashSet<usize> {
        let mut seen = HashSet::from([of]);
        let mut queue = VecDeque::from([of]);
        while let Some(n) = queue.pop_front() {
            for p in &parents[n] {
                if seen.insert(*p) {
                    queue.push_back(*p);
                }
            }
        }
        seen
    }

    fn dag() -> impl Strategy<Value = Vec<Vec<usize>>> {
        (2usize..60).prop_flat_map(|n| {
            proptest::collection::vec(
                (
                    any::<bool>(),
                    proptest::collection::vec(any::<prop::sample::Index>(), 0..3),
                ),
                n,
            )
            .prop_map(|spec| {
                spec.iter()
                    .enumerate()
                    .map(|(i, (root, picks))| {
                        if i == 0 || (*root && i % 17 == 0) {
                            return Vec::new();
                        }
                        let mut ps = vec![i - 1 - picks.first().map_or(0, |p| p.index(i.min(4)))];
                        for p in picks.iter().skip(1) {
                            let q = p.index(i);
                            if !ps.contains(&q) {
                                ps.push(q);
                            }
                        }
                        ps
                    })
                    .collect()
            })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn one_walk_counts_what_breadth_first_search_counts(
            parents in dag(),
            tip_pick in any::<prop::sample::Index>(),
            picks in proptest::collection::vec(any::<prop::sample::Index>(), 1..12),
            newest in 0usize..6,
        ) {
            let n = parents.len();
            let tip = tip_pick.index(n);
            let mut targets: Vec<usize> = picks.iter().map(|p| p.index(n)).filter(|t| *t != tip).collect();
            targets.sort();
            targets.dedup();
            prop_assume!(!targets.is_empty());
            let graph = load(&parents, n - 1);
            let node = |i: usize| graph.node(&oid(i)).expect("loaded");
            let nodes: Vec<Node> = targets.iter().map(|t| node(*t)).collect();
            let walk = graph.walk(node(tip), &nodes);
            let tallies = graph.tally(&walk, 0, newest, |_| &[]);
            let tip_set = ancestors(&parents, tip);
            for (t, tally) in targets.iter().zip(&tallies) {
                let set = ancestors(&parents, *t);
                prop_assert_eq!(tally.behind, tip_set.difference(&set).count() as u64, "behind {}", t);
                prop_assert_eq!(tally.ahead, set.difference(&tip_set).count() as u64, "ahead {}", t);
                // `load` gives commit i the time i: the newest are the highest.
                let mut missing: Vec<usize> = tip_set.difference(&set).copied().collect();
                missing.sort_by(|a, b| b.cmp(a));
                missing.truncate(newest);
                let shown: Vec<usize> = tally
                    .newest
                    .iter()
                    .map(|node| (0..n).find(|i| oid(*i) == graph.oid(*node)).expect("known"))
                    .collect();
                prop_assert_eq!(shown, missing, "newest of {}", t);
            }
        }
    }

    #[test]
    fn numbers_put_parents_first_and_loading_reads_each_commit_once() {
        //  0 - 1 - 3 - 4
        //   \- 2 -/
        let parents = [vec![], vec![0], vec![0], vec![1, 2], vec![3]];
        let mut reads = 0;
        let mut graph = Graph::default();
        let mut read = |id: Oid| -> Result<RawCommit, ()> {
            reads += 1;
            let i = (0..5).find(|i| oid(*i) == id).ok_or(())?;
            Ok(RawCommit {
                parents: parents[i].iter().map(|p| oid(*p)).collect(),
                time: 0,
                trailers: vec!["security".into(), "security".into()],
            })
        };
        graph.ensure(oid(4), &mut read).expect("load");
        graph.ensure(oid(3), &mut read).expect("again");
        assert_eq!(reads, 5);
        for n in 0..graph.len() as Node {
            assert!(graph.parents(n).iter().all(|p| *p < n));
        }
        assert_eq!(graph.trailer_keys(0), &[0], "a key once per commit");
        let copy = Graph::from_parts(graph.parts()).expect("valid parts");
        assert_eq!(copy.node(&oid(2)), graph.node(&oid(2)));
    }

    #[test]
    fn a_commit_among_its_own_ancestors_is_refused_not_looped_on() {
        let mut graph = Graph::default();
        // 1's parent is 0 and 0's parent is 1: impossible in a real repository.
        let mut read = |id: Oid| -> Result<RawCommit, ()> {
            let other = if id == oid(0) { oid(1) } else { oid(0) };
            Ok(RawCommit {
                parents: vec![other],
                ..RawCommit::default()
            })
        };
        assert!(matches!(
            graph.ensure(oid(1), &mut read),
            Err(LoadError::Inconsistent { .. })
        ));
    }

    #[test]
    fn ids_sharing_their_first_eight_bytes_are_both_found() {
        let twin = |last: u8| {
            let mut bytes = [7u8; 20];
            bytes[19] = last;
            Oid::from_bytes(&bytes).expect("20 bytes")
        };
        let (a, b) = (twin(1), twin(2));
        let mut graph = Graph::default();
        let mut read = |id: Oid| -> Result<RawCommit, ()> {
            Ok(RawCommit {
                parents: if id == b { vec![a] } else { vec![] },
                ..RawCommit::default()
            })
        };
        graph.ensure(b, &mut read).expect("load");
        assert_eq!(graph.node(&a), Some(0));
        assert_eq!(graph.node(&b), Some(1));
        assert_eq!(graph.node(&twin(3)), None);
        let copy = Graph::from_parts(graph.parts()).expect("valid parts");
        assert_eq!((copy.node(&a), copy.node(&b)), (Some(0), Some(1)));
        let mut twice = graph.parts();
        twice.oids[1] = a;
        assert!(Graph::from_parts(twice).is_none(), "an id numbered twice");
    }

    #[test]
    fn damaged_parts_are_refused() {
        let parents = vec![vec![], vec![0], vec![1]];
        let graph = load(&parents, 2);
        let mut parts = graph.parts();
        parts.parents[0] = 2; // node 1's parent numbered after it
        assert!(Graph::from_parts(parts).is_none());
        let mut parts = graph.parts();
        parts.times.pop();
        assert!(Graph::from_parts(parts).is_none());
    }

    #[test]
    fn newest_missing_commits_are_bounded_and_break_time_ties_by_id() {
        // A line 0 - 1 - … - 29 (tip); every commit has the same time, but
        // 25..29 are an hour later. Target 0 lacks 1..=29.
        let parents: Vec<Vec<usize>> = (0..30)
            .map(|i| if i == 0 { vec![] } else { vec![i - 1] })
            .collect();
        let mut graph = Graph::default();
        let mut read = |id: Oid| -> Result<RawCommit, ()> {
            let i = (0..parents.len()).find(|i| oid(*i) == id).ok_or(())?;
            Ok(RawCommit {
                parents: parents[i].iter().map(|p| oid(*p)).collect(),
                time: if i >= 25 { 3600 } else { 0 },
                trailers: Vec::new(),
            })
        };
        graph.ensure(oid(29), &mut read).expect("load");
        let node = |i: usize| graph.node(&oid(i)).expect("loaded");
        let walk = graph.walk(node(29), &[node(0)]);
        let tally = &graph.tally(&walk, 0, 7, |_| &[])[0];
        assert_eq!(tally.behind, 29);
        let shown: Vec<Oid> = tally.newest.iter().map(|n| graph.oid(*n)).collect();
        // The five late ones by id (ids grow with i here), then the lowest
        // ids of the rest: 1 and 2.
        let expected: Vec<Oid> = [25, 26, 27, 28, 29, 1, 2].iter().map(|i| oid(*i)).collect();
        assert_eq!(shown, expected);
        assert!(graph.tally(&walk, 0, 0, |_| &[])[0].newest.is_empty());
    }

    #[test]
    fn evidence_is_the_newest_commit_carrying_the_signal() {
        // 0 - 1 - 2 - 3 (tip); target 0; commits 1 and 2 carry signal 0.
        let parents = vec![vec![], vec![0], vec![1], vec![2]];
        let graph = load(&parents, 3);
        let node = |i: usize| graph.node(&oid(i)).expect("loaded");
        let walk = graph.walk(node(3), &[node(0)]);
        let carries = [0u64, 1, 1, 0];
        let masks: Vec<[u64; 1]> = (0..4).map(|i| [carries[i]]).collect();
        let tally = graph.tally(&walk, 1, 0, |n| &masks[n as usize][..]);
        assert_eq!(tally[0].behind, 3);
        assert_eq!(tally[0].evidence[0], Some(node(2)));
        assert_eq!(tally[0].evidence[1], None);
    }
}

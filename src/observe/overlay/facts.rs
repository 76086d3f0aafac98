//! Per-commit facts read from the mirror: parents, committer time and
//! trailer keys from the raw commit, and the path signals a commit's own
//! change carries, from tree comparisons limited to the signals' literal
//! prefixes.
//!
//! Owns the only reads of commit and tree objects that the drift analysis
//! does, so their cost is in one place: one object read per commit (never a
//! full parse into a libgit2 commit), and no tree diff at all when no signal
//! asks about paths. It must never write to the repository, decide anything
//! from a fact, or keep git2 handles beyond the call that was given them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use git2::{Odb, Oid, Repository, Tree};

use super::graph::RawCommit;
use super::signals::{Signals, normalize_trailer_key};

/// Why a commit could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    Git(git2::Error),
    /// The object is not a commit, or its header is not one git writes.
    Malformed,
}

/// Reads one commit's parents, committer time and trailer keys.
pub(crate) fn read_commit(odb: &Odb<'_>, oid: Oid) -> Result<RawCommit, ReadError> {
    let object = odb.read(oid).map_err(ReadError::Git)?;
    if object.kind() != git2::ObjectType::Commit {
        return Err(ReadError::Malformed);
    }
    parse_commit(object.data()).ok_or(ReadError::Malformed)
}

/// Parses a raw commit object: `tree`, `parent`… and `committer` headers,
/// a blank line, the message.
pub(crate) fn parse_commit(data: &[u8]) -> Option<RawCommit> {
    let (header, message) = match find(data, b"\n\n") {
        Some(at) => (&data[..at], &data[at + 2..]),
        None => (data, &[][..]),
    };
    let mut commit = RawCommit::default();
    for line in header.split(|b| *b == b'\n') {
        if let Some(hex) = line.strip_prefix(b"parent ") {
            let hex = std::str::from_utf8(hex).ok()?;
            if hex.len() != 40 {
                return None;
            }
            commit.parents.push(Oid::from_str(hex).ok()?);
        } else if let Some(who) = line.strip_prefix(b"committer ") {
            // `Name <email> 1700000000 +0000`: the time is the second-to-last
            // field; a commit with a garbled date still has its parents.
            let mut fields = who.rsplit(|b| *b == b' ');
            let _zone = fields.next();
            commit.time = fields
                .next()
                .and_then(|t| std::str::from_utf8(t).ok())
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
        }
    }
    commit.trailers = trailer_keys(message);
    Some(commit)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Normalised trailer keys of a message, as libgit2 finds them (the text
/// up to a NUL byte, as C reads it).
fn trailer_keys(message: &[u8]) -> Vec<String> {
    let message = match message.iter().position(|b| *b == 0) {
        Some(nul) => &message[..nul],
        None => message,
    };
    // Every trailer has a `:`; most messages have none worth parsing.
    if !message.contains(&b':') {
        return Vec::new();
    }
    match git2::message_trailers_bytes(message) {
        Ok(trailers) => trailers
            .iter()
            .map(|(key, _)| normalize_trailer_key(&String::from_utf8_lossy(key)))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The first path (in byte order) under `prefixes` that one commit's own
/// change touches and `matches` accepts, as [`PathFacts::mask`] judges it: the
/// path that raised a path signal, for the few commits shown as evidence.
pub(crate) fn first_matching_path(
    repo: &Repository,
    oid: Oid,
    prefixes: &[String],
    matches: impl Fn(&str) -> bool,
) -> Result<Option<String>, git2::Error> {
    Ok(PathFacts::new(prefixes.to_vec())
        .own_changes(repo, oid)?
        .into_iter()
        .find(|p| matches(p)))
}

/// The path facts of many commits, for one analysis: what a commit has at
/// the prefixes is read once, not once as a parent and again as a commit
/// (the analysis compares newest first, so a commit's parent is met as a
/// parent just before it is compared itself), and what a directory above a
/// prefix names is kept for the next commits, which mostly share it. A
/// commit then costs its commit and root tree reads plus the subtrees that
/// differ: each tree read applies pack deltas, and reading each twice was
/// about a fifth of `check`'s CPU time with a `paths` rule (#35 item 6).
/// Both maps are bounded ([`MAX_KEPT`]): what they keep only saves reads.
/// They hold ids only, so the repository each read is given may be another
/// handle on the same mirror (the analysis reopens it to free libgit2's
/// caches).
pub(crate) struct PathFacts {
    prefixes: Vec<String>,
    /// Entries at `prefixes` (in their order) of commits met as a parent
    /// and not yet compared themselves.
    at_prefixes: HashMap<Oid, Box<[Option<Entry>]>>,
    /// `(tree, prefix index, depth)`: the entry a directory under the root
    /// names by that prefix's segment at that depth (a root tree is read
    /// once per commit, so its lookups are not kept).
    named: HashMap<(Oid, usize, usize), Option<Entry>>,
}

/// The most entries either map of [`PathFacts`] keeps: emptied when full.
/// Consecutive commits share most directories, so a few thousand keep
/// nearly every hit at a few hundred KiB.
const MAX_KEPT: usize = 4096;

impl PathFacts {
    pub(crate) fn new(prefixes: Vec<String>) -> PathFacts {
        PathFacts {
            prefixes,
            at_prefixes: HashMap::new(),
            named: HashMap::new(),
        }
    }

    /// Which path signals (as a mask of `signals.words()` words) one
    /// commit's own change carries. For a merge, only what differs from
    /// every parent (its conflict resolutions and "evil" edits): the side
    /// branch's changes are blamed on the side branch's commits, which the
    /// machine may already have.
    pub(crate) fn mask(
        &mut self,
        repo: &Repository,
        oid: Oid,
        signals: &Signals,
    ) -> Result<Vec<u64>, git2::Error> {
        let mut mask = vec![0u64; signals.words()];
        let changed = self.own_changes(repo, oid)?;
        for (id, signal) in signals.path_signals() {
            if changed.iter().any(|p| signal.set.is_match(p)) {
                mask[id.0 / 64] |= 1 << (id.0 % 64);
            }
        }
        Ok(mask)
    }

    /// What a commit itself changed under the prefixes: against its only
    /// parent (or the empty tree), or for a merge what differs from every
    /// parent.
    fn own_changes(
        &mut self,
        repo: &Repository,
        oid: Oid,
    ) -> Result<BTreeSet<String>, git2::Error> {
        let commit = repo.find_commit(oid)?;
        let parents: Vec<Oid> = commit.parent_ids().collect();
        let new = self.entries(repo, oid, commit.tree_id())?;
        drop(commit);
        let Some((first, rest)) = parents.split_first() else {
            return self.changed(repo, None, &new);
        };
        let old = self.entries_of(repo, *first)?;
        let mut common = self.changed(repo, Some(&old), &new)?;
        for parent in rest {
            if common.is_empty() {
                break;
            }
            let old = self.entries_of(repo, *parent)?;
            let changed = self.changed(repo, Some(&old), &new)?;
            common = common.intersection(&changed).cloned().collect();
        }
        Ok(common)
    }

    /// Paths under the prefixes where `old`'s and `new`'s entries differ.
    fn changed(
        &self,
        repo: &Repository,
        old: Option<&[Option<Entry>]>,
        new: &[Option<Entry>],
    ) -> Result<BTreeSet<String>, git2::Error> {
        let mut changed = BTreeSet::new();
        for (i, prefix) in self.prefixes.iter().enumerate() {
            let was = old.and_then(|old| old.get(i).copied().flatten());
            let is = new.get(i).copied().flatten();
            compare(repo, prefix, was, is, &mut changed)?;
        }
        Ok(changed)
    }

    /// The entries at the prefixes of a commit met as a parent, kept for
    /// when it is compared itself.
    fn entries_of(
        &mut self,
        repo: &Repository,
        commit: Oid,
    ) -> Result<Box<[Option<Entry>]>, git2::Error> {
        if let Some(known) = self.at_prefixes.get(&commit) {
            return Ok(known.clone());
        }
        let root = repo.find_commit(commit)?.tree_id();
        let entries = self.read_entries(repo, root)?;
        if self.at_prefixes.len() >= MAX_KEPT {
            self.at_prefixes.clear();
        }
        self.at_prefixes.insert(commit, entries.clone());
        Ok(entries)
    }

    /// The entries at the prefixes of `commit`, whose tree is `root`, as
    /// it is compared: taken from what was kept (its children were
    /// compared before it), else read.
    fn entries(
        &mut self,
        repo: &Repository,
        commit: Oid,
        root: Oid,
    ) -> Result<Box<[Option<Entry>]>, git2::Error> {
        match self.at_prefixes.remove(&commit) {
            Some(known) => Ok(known),
            None => self.read_entries(repo, root),
        }
    }

    fn read_entries(
        &mut self,
        repo: &Repository,
        root: Oid,
    ) -> Result<Box<[Option<Entry>]>, git2::Error> {
        let mut tree = None;
        let mut entries = Vec::with_capacity(self.prefixes.len());
        for index in 0..self.prefixes.len() {
            entries.push(self.entry_at(repo, root, &mut tree, index)?);
        }
        Ok(entries.into_boxed_slice())
    }

    /// The entry at prefix `index` in the tree `root` (its id and mode),
    /// `None` if there is none: as `Tree::get_path` finds it (a segment
    /// naming a file before the last is not found), one segment at a time.
    /// `tree` is the root tree once read, for the next prefix.
    fn entry_at<'r>(
        &mut self,
        repo: &'r Repository,
        root: Oid,
        tree: &mut Option<Tree<'r>>,
        index: usize,
    ) -> Result<Option<Entry>, git2::Error> {
        let Some(prefix) = self.prefixes.get(index) else {
            return Ok(None);
        };
        let mut at: Entry = (root, TREE_MODE);
        if prefix.is_empty() {
            return Ok(Some(at));
        }
        for (depth, segment) in prefix.split('/').enumerate() {
            if at.1 != TREE_MODE {
                return Ok(None);
            }
            let next = if depth == 0 {
                let root_tree = match tree {
                    Some(t) => t,
                    None => tree.insert(repo.find_tree(root)?),
                };
                root_tree.get_name(segment).map(|e| (e.id(), e.filemode()))
            } else {
                let key = (at.0, index, depth);
                match self.named.get(&key) {
                    Some(known) => *known,
                    None => {
                        let found = repo
                            .find_tree(at.0)?
                            .get_name(segment)
                            .map(|e| (e.id(), e.filemode()));
                        if self.named.len() >= MAX_KEPT {
                            self.named.clear();
                        }
                        self.named.insert(key, found);
                        found
                    }
                }
            };
            match next {
                Some(entry) => at = entry,
                None => return Ok(None),
            }
        }
        Ok(Some(at))
    }
}

/// What a commit says about itself, for the few commits a drift's reason
/// shows: its subject and its trailers' keys as written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CommitText {
    /// The message's first line, at most [`MAX_SUBJECT_CHARS`] characters
    /// (cut ones end in `…`). Outside text: shown escaped, never trusted.
    pub subject: String,
    /// Trailer keys, trimmed but in their own case.
    pub trailer_keys: Vec<String>,
}

/// The longest subject kept: one hostile commit message must not bloat
/// every report that shows it.
pub(crate) const MAX_SUBJECT_CHARS: usize = 200;

pub(crate) fn read_text(odb: &Odb<'_>, oid: Oid) -> Result<CommitText, ReadError> {
    let object = odb.read(oid).map_err(ReadError::Git)?;
    if object.kind() != git2::ObjectType::Commit {
        return Err(ReadError::Malformed);
    }
    Ok(parse_text(object.data()))
}

pub(crate) fn parse_text(data: &[u8]) -> CommitText {
    let message = match find(data, b"\n\n") {
        Some(at) => &data[at + 2..],
        None => &[][..],
    };
    // As C reads it (and as the trailer keys were read): up to a NUL.
    let message = match message.iter().position(|b| *b == 0) {
        Some(nul) => &message[..nul],
        None => message,
    };
    let first = message.split(|b| *b == b'\n').next().unwrap_or_default();
    let first = String::from_utf8_lossy(first);
    let first = first.trim_end();
    let mut subject: String = first.chars().take(MAX_SUBJECT_CHARS).collect();
    if first.chars().nth(MAX_SUBJECT_CHARS).is_some() {
        subject.pop();
        subject.push('…');
    }
    let trailer_keys = if message.contains(&b':') {
        git2::message_trailers_bytes(message)
            .map(|t| {
                t.iter()
                    .map(|(key, _)| String::from_utf8_lossy(key).trim().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    CommitText {
        subject,
        trailer_keys,
    }
}

/// A tree entry as a diff sees it: what it names and how.
type Entry = (Oid, i32);

const TREE_MODE: i32 = 0o040000;

/// Adds to `out` every path at or under `path` where `old` and `new` differ.
fn compare(
    repo: &Repository,
    path: &str,
    old: Option<Entry>,
    new: Option<Entry>,
    out: &mut BTreeSet<String>,
) -> Result<(), git2::Error> {
    if old == new {
        return Ok(());
    }
    let is_tree = |e: Option<Entry>| e.is_some_and(|(_, mode)| mode == TREE_MODE);
    // A file (blob, link or submodule) on either side: that path changed.
    if old.is_some_and(|_| !is_tree(old)) || new.is_some_and(|_| !is_tree(new)) {
        out.insert(path.to_owned());
    }
    if !is_tree(old) && !is_tree(new) {
        return Ok(());
    }
    // Trees (a missing or non-tree side counts as empty): entry by entry.
    let mut entries: BTreeMap<Vec<u8>, (Option<Entry>, Option<Entry>)> = BTreeMap::new();
    for (side, entry) in [(0, old), (1, new)] {
        let Some((id, _)) = entry.filter(|_| is_tree(entry)) else {
            continue;
        };
        for e in repo.find_tree(id)?.iter() {
            let slot = entries.entry(e.name_bytes().to_vec()).or_default();
            let value = Some((e.id(), e.filemode()));
            if side == 0 {
                slot.0 = value;
            } else {
                slot.1 = value;
            }
        }
    }
    for (name, (was, is)) in entries {
        if was != is {
            let name = String::from_utf8_lossy(&name);
            let child = if path.is_empty() {
                name.into_owned()
            } else {
                format!("{path}/{name}")
            };
            compare(repo, &child, was, is, out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_commits_parse_parents_time_and_trailers() {
        let raw = b"tree 4b825dc642cb6eb9a060e54bf8d69288fbee4904\n\
parent 0123456789abcdef0123456789abcdef01234567\n\
parent 89abcdef0123456789abcdef0123456789abcdef\n\
author A <a@x> 1700000000 +0000\n\
committer C <c@x> 1700000123 -0700\n\
gpgsig -----BEGIN PGP SIGNATURE-----\n \n -----END PGP SIGNATURE-----\n\
\n\
Fix the sandbox\n\nSecurity: CVE-1\nSigned-off-by: Dev <dev@x>\n";
        let commit = parse_commit(raw).expect("parses");
        assert_eq!(commit.parents.len(), 2);
        assert_eq!(
            commit.parents[0].to_string(),
            "0123456789abcdef0123456789abcdef01234567"
        );
        assert_eq!(commit.time, 1_700_000_123);
        assert_eq!(commit.trailers, vec!["security", "signed-off-by"]);
    }

    /// A random tree of depth ≤ 3 from a few names, files with one of two
    /// contents and modes, now and then a symlink or a submodule.
    fn next(seed: &mut u64, n: u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed % n
    }

    fn random_tree(repo: &Repository, seed: &mut u64, depth: u32) -> Oid {
        let mut builder = repo.treebuilder(None).expect("treebuilder");
        for name in ["a", "b", "c.md", "d"] {
            let roll = next(seed, 10);
            if roll < 2 {
                continue;
            }
            let (id, mode) = match roll {
                8 | 9 if depth > 0 => (random_tree(repo, seed, depth - 1), 0o040000),
                6 => (repo.blob(b"target").expect("blob"), 0o120000),
                7 => (Oid::from_str(&"c0".repeat(20)).expect("oid"), 0o160000),
                _ => {
                    let content = if next(seed, 2) == 0 { "x" } else { "y" };
                    let mode = if next(seed, 4) == 0 {
                        0o100755
                    } else {
                        0o100644
                    };
                    (repo.blob(content.as_bytes()).expect("blob"), mode)
                }
            };
            builder.insert(name, id, mode).expect("insert");
        }
        builder.write().expect("write tree")
    }

    /// A commit of `tree` on `parents`.
    fn commit(repo: &Repository, tree: Oid, parents: &[Oid]) -> Oid {
        let sig = git2::Signature::new("t", "t@x", &git2::Time::new(1_700_000_000, 0))
            .expect("signature");
        let tree = repo.find_tree(tree).expect("tree");
        let parents: Vec<git2::Commit<'_>> = parents
            .iter()
            .map(|p| repo.find_commit(*p).expect("parent"))
            .collect();
        let parents: Vec<&git2::Commit<'_>> = parents.iter().collect();
        repo.commit(None, &sig, &sig, "c", &tree, &parents)
            .expect("commit")
    }

    /// Each path the libgit2 diff of `old` and `new` names (no renames).
    fn diffed(repo: &Repository, old: Option<Oid>, new: Oid) -> BTreeSet<String> {
        let old = old.map(|t| repo.find_tree(t).expect("old"));
        let new = repo.find_tree(new).expect("new");
        let diff = repo
            .diff_tree_to_tree(old.as_ref(), Some(&new), None)
            .expect("diff");
        let mut paths = BTreeSet::new();
        for delta in diff.deltas() {
            for file in [delta.old_file(), delta.new_file()] {
                if let Some(path) = file.path_bytes() {
                    paths.insert(String::from_utf8_lossy(path).into_owned());
                }
            }
        }
        paths
    }

    #[test]
    fn tree_comparison_reports_what_a_libgit2_diff_reports() {
        let dir = tempfile::tempdir().expect("tempdir");
        let repo = Repository::init_bare(dir.path()).expect("init");
        let mut seed = 0x2545_F491_4F6C_DD1D;
        // One reader per prefix set for every case, as an analysis keeps
        // one for all its commits: what it kept must never answer wrongly,
        // also when it reads through another handle on the repository (the
        // analysis reopens the mirror every so many commits).
        let prefix_sets = [
            vec![String::new()],
            vec!["d".to_owned()],
            vec!["a".to_owned(), "d/a".to_owned(), "d/d/b".to_owned()],
        ];
        let mut readers: Vec<PathFacts> = prefix_sets
            .iter()
            .map(|p| PathFacts::new(p.clone()))
            .collect();
        let mut previous: Option<Oid> = None;
        for case in 0..300 {
            let old = random_tree(&repo, &mut seed, 3);
            let new = random_tree(&repo, &mut seed, 3);
            // Every seventh case a root commit (against the empty tree);
            // every fifth a child of the previous case's commit, whose
            // entries the readers already hold.
            let (old, parent) = match (case % 7, case % 5, previous) {
                (0, _, _) => (None, None),
                (_, 0, Some(previous)) => {
                    let tree = repo.find_commit(previous).expect("previous").tree_id();
                    (Some(tree), Some(previous))
                }
                _ => (Some(old), Some(commit(&repo, old, &[]))),
            };
            let child = commit(&repo, new, parent.as_slice());
            previous = Some(child);
            let expected = diffed(&repo, old, new);
            for (prefixes, reader) in prefix_sets.iter().zip(&mut readers) {
                let under: BTreeSet<String> = expected
                    .iter()
                    .filter(|p| {
                        prefixes.iter().any(|prefix| {
                            prefix.is_empty()
                                || *p == prefix
                                || p.starts_with(&format!("{prefix}/"))
                        })
                    })
                    .cloned()
                    .collect();
                let handle = if case % 2 == 0 {
                    &repo
                } else {
                    &Repository::open_bare(dir.path()).expect("reopen")
                };
                let changed = reader.own_changes(handle, child).expect("compare");
                assert_eq!(changed, under, "case {case} under {prefixes:?}");
            }
        }
    }

    #[test]
    fn a_merge_carries_only_what_differs_from_every_parent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let repo = Repository::init_bare(dir.path()).expect("init");
        let tree = |files: &[(&str, &str)]| {
            let mut b = repo.treebuilder(None).expect("treebuilder");
            for (name, content) in files {
                let blob = repo.blob(content.as_bytes()).expect("blob");
                b.insert(name, blob, 0o100644).expect("insert");
            }
            b.write().expect("tree")
        };
        let base = commit(&repo, tree(&[("a", "0"), ("b", "0"), ("c", "0")]), &[]);
        let left = commit(&repo, tree(&[("a", "1"), ("b", "0"), ("c", "0")]), &[base]);
        let right = commit(&repo, tree(&[("a", "0"), ("b", "1"), ("c", "0")]), &[base]);
        // The merge takes both sides and changes `c` itself.
        let merge = commit(
            &repo,
            tree(&[("a", "1"), ("b", "1"), ("c", "1")]),
            &[left, right],
        );
        let mut reader = PathFacts::new(vec![String::new()]);
        let own = reader.own_changes(&repo, merge).expect("merge");
        assert_eq!(own, BTreeSet::from(["c".to_owned()]));
        assert_eq!(
            reader.own_changes(&repo, left).expect("left"),
            BTreeSet::from(["a".to_owned()])
        );
    }

    #[test]
    fn subjects_are_the_first_line_bounded_and_keys_keep_their_case() {
        let text = parse_text(
            b"tree x\ncommitter C <c@x> 1 +0000\n\nFix the sandbox\r\nmore\n\nSecurity-Fix: CVE-1\n",
        );
        assert_eq!(text.subject, "Fix the sandbox");
        assert_eq!(text.trailer_keys, vec!["Security-Fix"]);
        let long = format!("tree x\n\n{}\n", "é".repeat(5000));
        let text = parse_text(long.as_bytes());
        assert_eq!(text.subject.chars().count(), MAX_SUBJECT_CHARS);
        assert!(text.subject.ends_with('…'));
        let exact = format!("tree x\n\n{}", "a".repeat(MAX_SUBJECT_CHARS));
        assert_eq!(
            parse_text(exact.as_bytes()).subject.len(),
            MAX_SUBJECT_CHARS
        );
        assert_eq!(parse_text(b"tree x\n").subject, "");
        assert_eq!(parse_text(b"tree x\n\nhalf\0hidden\n").subject, "half");
    }

    #[test]
    fn garbled_headers_fail_closed_or_degrade() {
        assert_eq!(parse_commit(b"tree x\nparent nothex\n\nmsg"), None);
        assert_eq!(parse_commit(b"tree x\nparent 0123\n\nmsg"), None);
        let no_date = parse_commit(b"tree x\ncommitter C <c@x> soon\n\nmsg").expect("parses");
        assert_eq!(no_date.time, 0);
        let nul =
            parse_commit(b"tree x\n\nsubject\n\nKey: v\0\n\nSecurity: hidden\n").expect("parses");
        assert_eq!(nul.trailers, vec!["key"]);
    }
}

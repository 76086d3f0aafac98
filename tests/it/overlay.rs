//! Integration tests of the overlay mirror against real git repositories.
//!
//! Each test builds an "upstream" repository with git2 in a temp dir, opens
//! an `Overlay` whose mirror lives in another temp dir, and checks what the
//! overlay reports against facts computed independently here (ancestor sets
//! by breadth-first search over parent ids, never git2's revwalk).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex};

use fleet_reconciler::model::CommitId;
use fleet_reconciler::observe::overlay::{
    DriftRange, Overlay, OverlayError, OverlaySource, RefAnalysis, SignalId, Signals, Tip,
};
use git2::{Oid, Repository, Signature, Time};
use globset::{GlobBuilder, GlobSetBuilder};
use tempfile::TempDir;

use crate::common::within;

const RELEASE: &str = "release";

// ---------------------------------------------------------------- fixtures

/// A bare upstream repository whose commits are built from file snapshots.
struct Upstream {
    dir: TempDir,
    repo: Repository,
    snapshots: HashMap<Oid, BTreeMap<String, String>>,
    /// Blob ids by content: writing a blob libgit2 already has still costs
    /// a filesystem round trip, and big fixtures repeat contents a lot.
    blobs: HashMap<String, Oid>,
    clock: i64,
}

type Change<'a> = (&'a str, Option<&'a str>);

impl Upstream {
    fn new() -> Upstream {
        let dir = tempfile::tempdir().expect("tempdir");
        let repo = Repository::init_bare(dir.path()).expect("init upstream");
        Upstream {
            dir,
            repo,
            snapshots: HashMap::new(),
            blobs: HashMap::new(),
            clock: 0,
        }
    }

    fn path(&self) -> String {
        self.dir
            .path()
            .to_str()
            .expect("utf-8 temp path")
            .to_owned()
    }

    /// A commit whose tree is its first parent's (or, for a merge, the clean
    /// three-way merge of its parents) with `changes` applied. Conflicting
    /// paths must be resolved by `changes`.
    fn commit(&mut self, parents: &[Oid], changes: &[Change<'_>], message: &str) -> Oid {
        self.clock += 60;
        let when = 1_760_000_000 + self.clock;
        self.commit_at(parents, changes, message, when)
    }

    /// [`Upstream::commit`] with the committer time given: clocks lie.
    fn commit_at(
        &mut self,
        parents: &[Oid],
        changes: &[Change<'_>],
        message: &str,
        time: i64,
    ) -> Oid {
        let resolved: HashSet<&str> = changes.iter().map(|(path, _)| *path).collect();
        let mut files = match parents {
            [] => BTreeMap::new(),
            [first, rest @ ..] => {
                let mut files = self.snapshots[first].clone();
                for other in rest {
                    files = self.merged(*first, &files, *other, &resolved);
                }
                files
            }
        };
        for (path, content) in changes {
            match content {
                Some(content) => files.insert((*path).to_owned(), (*content).to_owned()),
                None => files.remove(*path),
            };
        }
        let tree_id = write_tree(&self.repo, &mut self.blobs, &files);
        let tree = self.repo.find_tree(tree_id).expect("tree");
        let when = Time::new(time, 0);
        let sig = Signature::new("Dev", "dev@example.com", &when).expect("signature");
        let parent_commits: Vec<_> = parents
            .iter()
            .map(|p| self.repo.find_commit(*p).expect("parent"))
            .collect();
        let parent_refs: Vec<_> = parent_commits.iter().collect();
        let oid = self
            .repo
            .commit(None, &sig, &sig, message, &tree, &parent_refs)
            .expect("commit");
        self.snapshots.insert(oid, files);
        oid
    }

    fn merged(
        &self,
        first: Oid,
        ours: &BTreeMap<String, String>,
        other: Oid,
        resolved: &HashSet<&str>,
    ) -> BTreeMap<String, String> {
        let theirs = &self.snapshots[&other];
        let base = self
            .repo
            .merge_base(first, other)
            .map(|b| self.snapshots[&b].clone())
            .unwrap_or_default();
        let paths: BTreeSet<&String> = ours.keys().chain(theirs.keys()).collect();
        let mut out = BTreeMap::new();
        for path in paths {
            let (o, t, b) = (ours.get(path), theirs.get(path), base.get(path));
            let value = if o == t || t == b {
                o
            } else if o == b {
                t
            } else {
                assert!(
                    resolved.contains(path.as_str()),
                    "unresolved conflict on {path}"
                );
                o
            };
            if let Some(value) = value {
                out.insert(path.clone(), value.clone());
            }
        }
        out
    }

    fn linear(&mut self, n: usize) -> Vec<Oid> {
        let mut commits: Vec<Oid> = Vec::new();
        for i in 0..n {
            let parents: Vec<Oid> = commits.last().copied().into_iter().collect();
            let path = format!("{i}.txt");
            let content = format!("content {i}");
            let c = self.commit(&parents, &[(&path, Some(&content))], &format!("c{i}"));
            commits.push(c);
        }
        commits
    }

    fn branch(&self, name: &str, oid: Oid) {
        self.repo
            .reference(&format!("refs/heads/{name}"), oid, true, "test")
            .expect("set branch");
    }

    fn delete_branch(&self, name: &str) {
        self.repo
            .find_reference(&format!("refs/heads/{name}"))
            .expect("branch")
            .delete()
            .expect("delete branch");
    }
}

fn write_tree(
    repo: &Repository,
    blob_ids: &mut HashMap<String, Oid>,
    files: &BTreeMap<String, String>,
) -> Oid {
    let mut blobs = BTreeMap::new();
    let mut dirs: BTreeMap<&str, BTreeMap<String, String>> = BTreeMap::new();
    for (path, content) in files {
        match path.split_once('/') {
            Some((dir, rest)) => {
                dirs.entry(dir)
                    .or_default()
                    .insert(rest.to_owned(), content.clone());
            }
            None => {
                blobs.insert(path.as_str(), content.as_str());
            }
        }
    }
    let mut builder = repo.treebuilder(None).expect("treebuilder");
    for (name, content) in blobs {
        let blob = *blob_ids
            .entry(content.to_owned())
            .or_insert_with(|| repo.blob(content.as_bytes()).expect("blob"));
        builder.insert(name, blob, 0o100644).expect("insert blob");
    }
    for (name, sub) in dirs {
        let tree = write_tree(repo, blob_ids, &sub);
        builder.insert(name, tree, 0o040000).expect("insert tree");
    }
    builder.write().expect("write tree")
}

fn source(repo: String, mirror: &Path) -> OverlaySource {
    OverlaySource {
        repo,
        branch: RELEASE.to_owned(),
        mirror_dir: mirror.join("overlay.git"),
        token: None,
    }
}

async fn open_mirror(up: &Upstream) -> (TempDir, Overlay) {
    let mirror = tempfile::tempdir().expect("tempdir");
    let overlay = within(Overlay::open(source(up.path(), mirror.path())))
        .await
        .expect("open");
    (mirror, overlay)
}

fn id(oid: Oid) -> CommitId {
    CommitId::parse(&oid.to_string()).expect("40-hex oid")
}

fn hex(oid: Oid) -> String {
    oid.to_string()
}

fn short(oid: Oid, len: usize) -> String {
    oid.to_string()[..len].to_owned()
}

async fn analyze(overlay: &Overlay, tip: Oid, refs: &[String]) -> HashMap<String, RefAnalysis> {
    analyze_for(overlay, tip, refs, &Signals::new()).await
}

async fn analyze_for(
    overlay: &Overlay,
    tip: Oid,
    refs: &[String],
    signals: &Signals,
) -> HashMap<String, RefAnalysis> {
    within(overlay.analyze(&id(tip), refs.to_vec(), signals))
        .await
        .expect("analyze")
}

/// Named signals, so a range's evidence reads back as the names raised.
struct Probe {
    signals: Signals,
    names: Vec<(SignalId, String)>,
}

impl Probe {
    fn new() -> Probe {
        Probe {
            signals: Signals::new(),
            names: Vec::new(),
        }
    }

    /// A path signal for these globs (compiled as the config compiles them).
    fn globs(mut self, name: &str, globs: &[&str]) -> Probe {
        let mut set = GlobSetBuilder::new();
        for g in globs {
            set.add(
                GlobBuilder::new(g)
                    .literal_separator(true)
                    .build()
                    .expect("glob"),
            );
        }
        let globs: Vec<String> = globs.iter().map(|g| (*g).to_owned()).collect();
        let id = self.signals.paths(&globs, set.build().expect("glob set"));
        self.names.push((id, name.to_owned()));
        self
    }

    /// One path signal per literal path: the evidence then says exactly
    /// which of these paths the missing commits changed.
    fn paths(self, paths: &[&str]) -> Probe {
        paths.iter().fold(self, |probe, p| probe.globs(p, &[p]))
    }

    fn trailer(mut self, key: &str) -> Probe {
        let id = self.signals.trailers([key]);
        self.names.push((id, key.to_owned()));
        self
    }

    fn raised(&self, range: &DriftRange) -> BTreeSet<String> {
        self.names
            .iter()
            .filter(|(id, _)| range.carries(*id))
            .map(|(_, name)| name.clone())
            .collect()
    }
}

/// The drift range of `reported`, failing unless it is `Drifted` to it.
fn drifted(results: &HashMap<String, RefAnalysis>, reported: &str, commit: Oid) -> Arc<DriftRange> {
    match &results[reported] {
        RefAnalysis::Drifted { commit: c, range } => {
            assert_eq!(*c, id(commit), "{reported} resolved to the wrong commit");
            Arc::clone(range)
        }
        other => panic!("{reported}: expected Drifted, got {other:?}"),
    }
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// Ancestors of `oid` including itself, by breadth-first search over parent
/// ids: the independent oracle for behind/ahead.
fn ancestors(repo: &Repository, oid: Oid) -> HashSet<Oid> {
    let mut seen = HashSet::from([oid]);
    let mut queue = VecDeque::from([oid]);
    while let Some(next) = queue.pop_front() {
        for parent in repo.find_commit(next).expect("commit").parent_ids() {
            if seen.insert(parent) {
                queue.push_back(parent);
            }
        }
    }
    seen
}

fn expected_counts(repo: &Repository, tip: Oid, commit: Oid) -> (u64, u64) {
    let (t, c) = (ancestors(repo, tip), ancestors(repo, commit));
    (
        t.difference(&c).count() as u64,
        c.difference(&t).count() as u64,
    )
}

/// The newest commits of `tip ^commit` (at most `n`), newest first by
/// committer time, ties by lowest id, with their subjects (the message's
/// first line): computed with libgit2's revwalk, independent of the graph.
fn expected_newest(repo: &Repository, tip: Oid, commit: Oid, n: usize) -> Vec<(CommitId, String)> {
    let mut walk = repo.revwalk().expect("revwalk");
    walk.push(tip).expect("push");
    walk.hide(commit).expect("hide");
    let mut all: Vec<(i64, Oid)> = walk
        .map(|o| {
            let o = o.expect("walk");
            (repo.find_commit(o).expect("commit").time().seconds(), o)
        })
        .collect();
    all.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    all.into_iter()
        .take(n)
        .map(|(_, o)| {
            let c = repo.find_commit(o).expect("commit");
            let subject = c
                .message()
                .unwrap_or("")
                .lines()
                .next()
                .unwrap_or("")
                .to_owned();
            (id(o), subject)
        })
        .collect()
}

fn shown_newest(range: &DriftRange) -> Vec<(CommitId, String)> {
    range
        .newest
        .iter()
        .map(|m| (m.commit.clone(), m.subject.clone()))
        .collect()
}

fn error_chain(err: &OverlayError) -> String {
    let mut text = format!("{err} | {err:?}");
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(&format!(" | {cause}"));
        source = cause.source();
    }
    text
}

// ------------------------------------------------------------------ tests

#[test]
fn overlay_is_cheap_to_share() {
    fn assert_shareable<T: Clone + Send + Sync + 'static>() {}
    assert_shareable::<Overlay>();
}

/// A fetch runs on its own thread, out of tokio's sight. On paused time (the
/// rotation and server tests) the idle runtime would jump to the fetch's
/// deadline at once and time it out, unless the fetch holds auto-advance back.
#[tokio::test(start_paused = true)]
async fn a_fetch_on_paused_time_is_not_timed_out_by_auto_advance() {
    let mut up = Upstream::new();
    let c = up.linear(3);
    up.branch(RELEASE, c[2]);
    let (_mirror, overlay) = open_mirror(&up).await;
    for _ in 0..3 {
        let tip = overlay
            .fetch_within(std::time::Duration::from_millis(50))
            .await
            .expect("a fetch on paused time ends before its deadline");
        assert_eq!(tip.commit, id(c[2]));
    }
}

#[tokio::test]
async fn linear_history_counts_behind_and_resolves_abbreviations() {
    let mut up = Upstream::new();
    let c = up.linear(5);
    up.branch(RELEASE, c[4]);
    let (_mirror, overlay) = open_mirror(&up).await;

    let tip = within(overlay.fetch()).await.expect("fetch");
    assert_eq!(
        tip,
        Tip {
            branch: RELEASE.to_owned(),
            commit: id(c[4])
        }
    );

    let refs = vec![
        hex(c[4]),
        short(c[4], 7),
        hex(c[3]),
        short(c[2], 7),
        short(c[1], 12),
        short(c[0], 4),
        hex(c[3]),
    ];
    let probe = Probe::new().paths(&["0.txt", "1.txt", "2.txt", "3.txt", "4.txt"]);
    let results = analyze_for(&overlay, c[4], &refs, &probe.signals).await;
    assert_eq!(results.len(), 6, "one entry per distinct ref");
    for on_tip in [hex(c[4]), short(c[4], 7)] {
        assert_eq!(results[&on_tip], RefAnalysis::OnTip { commit: id(c[4]) });
    }
    for (reported, commit, behind) in [
        (hex(c[3]), c[3], 1),
        (short(c[2], 7), c[2], 2),
        (short(c[1], 12), c[1], 3),
        (short(c[0], 4), c[0], 4),
    ] {
        let range = drifted(&results, &reported, commit);
        assert_eq!((range.behind, range.ahead), (behind, 0), "{reported}");
    }
    assert_eq!(
        probe.raised(&drifted(&results, &short(c[2], 7), c[2])),
        set(&["3.txt", "4.txt"])
    );
}

#[tokio::test]
async fn colliding_prefix_is_ambiguous_and_longer_prefix_resolves() {
    let mut up = Upstream::new();
    let root = up.commit(&[], &[("a.txt", Some("a"))], "root");
    let tree = up
        .repo
        .find_commit(root)
        .expect("root")
        .tree()
        .expect("tree");
    let sig =
        Signature::new("Dev", "dev@example.com", &Time::new(1_760_000_000, 0)).expect("signature");
    // Commits that share one tree differ only by message: cheap to make.
    // By the birthday bound two of ~300 share a 4-hex prefix half the time;
    // 5000 makes a miss practically impossible.
    let mut by_prefix: HashMap<String, Oid> = HashMap::new();
    let mut parent = up.repo.find_commit(root).expect("root");
    let mut pair = None;
    for i in 0..5000 {
        let oid = up
            .repo
            .commit(None, &sig, &sig, &format!("n{i}"), &tree, &[&parent])
            .expect("commit");
        if let Some(first) = by_prefix.insert(short(oid, 4), oid) {
            pair = Some((first, oid));
            break;
        }
        parent = up.repo.find_commit(oid).expect("commit");
    }
    let (first, second) = pair.expect("no 4-hex collision in 5000 commits");
    let head = parent.id();
    // `second` was never made a parent; put it on its own branch.
    up.branch(RELEASE, head);
    up.branch("collision", second);
    assert_ne!(short(first, 12), short(second, 12));

    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let refs = vec![short(first, 4), short(first, 12), short(second, 12)];
    let results = analyze(&overlay, head, &refs).await;
    assert_eq!(results[&short(first, 4)], RefAnalysis::Ambiguous);
    let commit_of = |r: &str| match &results[r] {
        RefAnalysis::OnTip { commit } | RefAnalysis::Drifted { commit, .. } => commit.clone(),
        other => panic!("{r}: expected a commit, got {other:?}"),
    };
    assert_eq!(commit_of(&short(first, 12)), id(first));
    assert_eq!(commit_of(&short(second, 12)), id(second));
}

#[tokio::test]
async fn unknown_non_commit_and_short_refs_fail_closed() {
    let mut up = Upstream::new();
    let c = up.linear(3);
    up.branch(RELEASE, c[2]);
    let tip_tree = up
        .repo
        .find_commit(c[2])
        .expect("tip")
        .tree()
        .expect("tree");
    let blob = tip_tree.get_path(Path::new("0.txt")).expect("blob").id();
    let tree = tip_tree.id();
    let sig =
        Signature::new("Dev", "dev@example.com", &Time::new(1_760_000_000, 0)).expect("signature");
    let commit_obj = up.repo.find_object(c[1], None).expect("object");
    let tag = up
        .repo
        .tag("v1", &commit_obj, &sig, "release v1", false)
        .expect("tag");
    let blob_obj = up.repo.find_object(blob, None).expect("blob object");
    let blob_tag = up
        .repo
        .tag("blob-tag", &blob_obj, &sig, "a blob", false)
        .expect("blob tag");

    // A prefix that names nothing upstream (so nothing in the mirror).
    let mut all = Vec::new();
    up.repo
        .odb()
        .expect("odb")
        .foreach(|oid| {
            all.push(oid.to_string());
            true
        })
        .expect("foreach");
    let missing_prefix = (0..16u8)
        .map(|d| format!("{d:x}").repeat(7))
        .find(|p| !all.iter().any(|o| o.starts_with(p)))
        .expect("a free prefix");
    let missing_full = "0123456789abcdef0123456789abcdef01234567".to_owned();
    assert!(!all.contains(&missing_full));

    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let refs = vec![
        missing_full.clone(),
        missing_prefix.clone(),
        hex(blob),
        short(blob, 10),
        hex(tree),
        short(c[2], 3),
        short(c[2], 1),
        hex(tag),
        hex(blob_tag),
    ];
    let results = analyze(&overlay, c[2], &refs).await;
    for unknown in [
        &missing_full,
        &missing_prefix,
        &hex(blob),
        &short(blob, 10),
        &hex(tree),
    ] {
        assert_eq!(results[unknown], RefAnalysis::Unknown, "{unknown}");
    }
    for ambiguous in [short(c[2], 3), short(c[2], 1)] {
        assert_eq!(results[&ambiguous], RefAnalysis::Ambiguous, "{ambiguous}");
    }
    // An annotated tag names the commit it points at; a tag of a blob does not.
    assert_eq!(drifted(&results, &hex(tag), c[1]).behind, 1);
    assert_eq!(results[&hex(blob_tag)], RefAnalysis::Unknown);
}

#[tokio::test]
async fn merge_history_counts_match_breadth_first_ancestor_sets() {
    // a - b - c ------ m1 - d - m2 - e        release
    //      \          /         /
    //       f1 --- f2          /
    //   a ------------------ s1
    //   c - k1 - k2                           canary (diverged)
    let mut up = Upstream::new();
    let a = up.commit(&[], &[("a", Some("a"))], "a");
    let b = up.commit(&[a], &[("b", Some("b"))], "b");
    let c = up.commit(&[b], &[("c", Some("c"))], "c");
    let f1 = up.commit(&[b], &[("f1", Some("f1"))], "f1");
    let f2 = up.commit(&[f1], &[("f2", Some("f2"))], "f2");
    let m1 = up.commit(&[c, f2], &[], "merge f");
    let d = up.commit(&[m1], &[("d", Some("d"))], "d");
    let s1 = up.commit(&[a], &[("s1", Some("s1"))], "s1");
    let m2 = up.commit(&[d, s1], &[], "merge s");
    let e = up.commit(&[m2], &[("e", Some("e"))], "e");
    let k1 = up.commit(&[c], &[("k1", Some("k1"))], "k1");
    let k2 = up.commit(&[k1], &[("k2", Some("k2"))], "k2");
    up.branch(RELEASE, e);
    up.branch("feature", f2);
    up.branch("side", s1);
    up.branch("canary", k2);

    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let reported = [a, b, c, f1, f2, m1, d, s1, m2, k1, k2];
    let refs: Vec<String> = reported.iter().map(|o| hex(*o)).collect();
    let probe = Probe::new().paths(&["a", "b", "c", "f1", "f2", "d", "s1", "e", "k1", "k2"]);
    let results = analyze_for(&overlay, e, &refs, &probe.signals).await;
    for commit in reported {
        let range = drifted(&results, &hex(commit), commit);
        assert_eq!(
            (range.behind, range.ahead),
            expected_counts(&up.repo, e, commit),
            "{commit}"
        );
    }
    // Hand-counted, so the oracle itself is checked too.
    let counts = |o: Oid| {
        let r = drifted(&results, &hex(o), o);
        (r.behind, r.ahead)
    };
    assert_eq!(counts(f1), (7, 0));
    assert_eq!(counts(s1), (8, 0));
    assert_eq!(counts(k2), (7, 2));
    assert_eq!(counts(m2), (1, 0));
    // Merges add nothing of their own here, so the paths are exactly the
    // files of the non-merge commits the machine lacks.
    assert_eq!(
        probe.raised(&drifted(&results, &hex(k2), k2)),
        set(&["d", "e", "f1", "f2", "s1"])
    );
    // The newest missing commits, from the same walk, match a revwalk; each
    // evidence commit is the newest carrier and names the path it touched.
    let file_of: HashMap<Oid, &str> = [
        (a, "a"),
        (b, "b"),
        (c, "c"),
        (f1, "f1"),
        (f2, "f2"),
        (d, "d"),
        (s1, "s1"),
        (e, "e"),
        (k1, "k1"),
        (k2, "k2"),
    ]
    .into_iter()
    .collect();
    for commit in reported {
        let range = drifted(&results, &hex(commit), commit);
        assert_eq!(
            shown_newest(&range),
            expected_newest(
                &up.repo,
                e,
                commit,
                fleet_reconciler::observe::overlay::MAX_SHOWN_MISSING
            ),
            "{commit}"
        );
        assert_eq!(range.evidence.len(), range.evidence_detail.len());
        for (signal, name) in &probe.names {
            let Some(carrier) = range.evidence.get(signal) else {
                continue;
            };
            let oid = Oid::from_str(carrier.as_str()).expect("oid");
            assert_eq!(file_of.get(&oid), Some(&name.as_str()), "{commit} {name}");
            let detail = &range.evidence_detail[signal];
            assert_eq!(detail.matched.as_deref(), Some(name.as_str()));
            assert_eq!(detail.subject, name.as_str(), "subjects are the file names");
        }
    }
    assert_eq!(
        shown_newest(&drifted(&results, &hex(m2), m2)),
        vec![(id(e), "e".to_owned())]
    );
}

/// A tiny deterministic generator, so the random DAG is the same every run.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

#[tokio::test]
async fn random_merge_dag_matches_independent_counts_and_paths() {
    let mut up = Upstream::new();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut commits = vec![up.commit(&[], &[("f0", Some("0"))], "root")];
    let mut merges = 0;
    for i in 1..90 {
        let recent = commits.len() - 1 - rng.below(commits.len().min(5));
        let mut parents = vec![commits[recent]];
        let extra = match rng.below(10) {
            0..=2 => 1,
            3 => 2,
            _ => 0,
        };
        for _ in 0..extra {
            let other = commits[rng.below(commits.len())];
            if !parents.contains(&other) {
                parents.push(other);
            }
        }
        if parents.len() > 1 {
            merges += 1;
        }
        // Every commit (merges too) adds its own file, so no merge conflicts
        // and each commit's own change is known.
        let path = format!("f{i}");
        let oid = up.commit(&parents, &[(&path, Some("x"))], &format!("c{i}"));
        commits.push(oid);
    }
    let tip = commits[commits.len() - 1];
    up.branch(RELEASE, tip);
    for (i, oid) in commits.iter().enumerate() {
        up.branch(&format!("b{i}"), *oid);
    }
    let file_of: HashMap<Oid, String> = commits
        .iter()
        .enumerate()
        .map(|(i, o)| (*o, format!("f{i}")))
        .collect();

    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let refs: Vec<String> = commits.iter().map(|o| hex(*o)).collect();
    let files: Vec<String> = (0..commits.len()).map(|i| format!("f{i}")).collect();
    let files: Vec<&str> = files.iter().map(String::as_str).collect();
    let probe = Probe::new().paths(&files);
    let results = analyze_for(&overlay, tip, &refs, &probe.signals).await;

    let mut diverged = 0;
    let tip_ancestors = ancestors(&up.repo, tip);
    for commit in &commits[..commits.len() - 1] {
        let range = drifted(&results, &hex(*commit), *commit);
        let (behind, ahead) = expected_counts(&up.repo, tip, *commit);
        assert_eq!((range.behind, range.ahead), (behind, ahead), "{commit}");
        if ahead > 0 && behind > 0 {
            diverged += 1;
        }
        let has = ancestors(&up.repo, *commit);
        let expected: BTreeSet<String> = tip_ancestors
            .difference(&has)
            .map(|o| file_of[o].clone())
            .collect();
        assert_eq!(probe.raised(&range), expected, "{commit}");
        // At most 20 newest, as a revwalk over the same range finds them.
        assert!(range.newest.len() <= 20);
        assert_eq!(
            range.newest.len() as u64,
            behind.min(20),
            "{commit}: bounded, never short"
        );
        assert_eq!(
            shown_newest(&range),
            expected_newest(&up.repo, tip, *commit, 20),
            "{commit}"
        );
    }
    assert!(merges >= 10, "the DAG should have merges, has {merges}");
    assert!(
        diverged >= 10,
        "the DAG should have diverged refs, has {diverged}"
    );
}

#[tokio::test]
async fn paths_cover_the_range_renames_deletions_and_root_commits() {
    let mut up = Upstream::new();
    let c0 = up.commit(
        &[],
        &[
            ("README", Some("r")),
            ("LICENSE", Some("l")),
            ("policies/old.yaml", Some("p")),
            ("guards/x.yaml", Some("g")),
            ("old/y.txt", Some("y0")),
        ],
        "root",
    );
    let c1 = up.commit(
        &[c0],
        &[("old/y.txt", Some("y1"))],
        "before the reported ref",
    );
    let c2 = up.commit(&[c1], &[("README", Some("r2"))], "the reported ref");
    let c3 = up.commit(&[c2], &[("policies/x.yaml", Some("x"))], "add a policy");
    let c4 = up.commit(
        &[c3],
        &[
            ("policies/old.yaml", None),
            ("policies/new.yaml", Some("p")),
            ("guards/x.yaml", None),
        ],
        "rename a policy, drop a guard",
    );
    let orphan = up.commit(&[], &[("orphan.txt", Some("o"))], "unrelated history");
    up.branch(RELEASE, c4);
    up.branch("orphan", orphan);

    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let probe = Probe::new().paths(&[
        "README",
        "LICENSE",
        "policies/old.yaml",
        "policies/new.yaml",
        "policies/x.yaml",
        "guards/x.yaml",
        "old/y.txt",
        "orphan.txt",
    ]);
    let results = analyze_for(&overlay, c4, &[hex(c2), hex(orphan)], &probe.signals).await;
    assert_eq!(
        probe.raised(&drifted(&results, &hex(c2), c2)),
        set(&[
            "guards/x.yaml",
            "policies/new.yaml",
            "policies/old.yaml",
            "policies/x.yaml"
        ])
    );
    // Unrelated history: everything is missing, the root diffed against the
    // empty tree.
    let range = drifted(&results, &hex(orphan), orphan);
    assert_eq!((range.behind, range.ahead), (5, 1));
    let paths = probe.raised(&range);
    assert!(paths.contains("LICENSE"), "{paths:?}");
    assert!(paths.contains("README"), "{paths:?}");
    assert!(paths.contains("old/y.txt"), "{paths:?}");
    assert!(!paths.contains("orphan.txt"), "{paths:?}");
}

/// Issue 10 (an agent can make git analysis expensive): an agent on the root
/// commit of a long history made one sweep compare every commit for the
/// path rules. Now one analysis compares at most the budget, newest first:
/// a recent ref is answered in full at once, the root's range is reported
/// incomplete (exact counts, partial evidence) and finished by later
/// analyses without comparing any commit twice.
#[tokio::test]
async fn path_comparisons_per_analysis_are_bounded_and_resumed() {
    let mut up = Upstream::new();
    let mut chain = vec![up.commit(&[], &[("policies/p0.yaml", Some("0"))], "root")];
    for i in 1..40 {
        let path = format!("policies/p{i}.yaml");
        let parent = chain[i - 1];
        chain.push(up.commit(&[parent], &[(path.as_str(), Some("x"))], "policy"));
    }
    let (root, tip) = (chain[0], chain[39]);
    let recent = chain[36];
    up.branch(RELEASE, tip);
    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    overlay.set_diff_budget(10);
    let probe = Probe::new().paths(&["policies/p1.yaml", "policies/p38.yaml"]);
    let refs = [hex(root), hex(recent)];

    let first = analyze_for(&overlay, tip, &refs, &probe.signals).await;
    let recent_range = drifted(&first, &hex(recent), recent);
    assert!(!recent_range.paths_incomplete, "3 commits fit the budget");
    assert_eq!(probe.raised(&recent_range), set(&["policies/p38.yaml"]));
    let root_range = drifted(&first, &hex(root), root);
    assert!(root_range.paths_incomplete, "39 commits do not fit in 10");
    assert_eq!(
        root_range.behind, 39,
        "counts are exact whatever the budget"
    );
    assert_eq!(probe.raised(&root_range), set(&["policies/p38.yaml"]));
    assert_eq!(overlay.stats().commits_diffed, 10);

    // Later analyses go on where the first stopped: 39 comparisons in all.
    let mut analyses = 1;
    let done = loop {
        let next = analyze_for(&overlay, tip, &refs, &probe.signals).await;
        analyses += 1;
        let range = drifted(&next, &hex(root), root);
        if !range.paths_incomplete {
            break range;
        }
        assert!(analyses < 10, "the analysis never completes");
    };
    assert_eq!(analyses, 4);
    assert_eq!(overlay.stats().commits_diffed, 39);
    assert_eq!(
        probe.raised(&done),
        set(&["policies/p1.yaml", "policies/p38.yaml"])
    );
}

#[tokio::test]
async fn merges_are_blamed_only_for_what_they_introduce() {
    //  base - m1 ------- merge (release)    merge' = same + an evil edit (evil)
    //     \            /
    //      s1 --------
    let mut up = Upstream::new();
    let base = up.commit(
        &[],
        &[
            ("main.txt", Some("m0")),
            ("skills/a.md", Some("a0")),
            ("guards/g.yaml", Some("g0")),
        ],
        "base",
    );
    let m1 = up.commit(&[base], &[("main.txt", Some("m1"))], "main work");
    let s1 = up.commit(&[base], &[("skills/a.md", Some("a1"))], "side work");
    let merge = up.commit(&[m1, s1], &[], "merge side");
    let evil = up.commit(&[m1, s1], &[("guards/g.yaml", Some("evil"))], "evil merge");
    up.branch(RELEASE, merge);
    up.branch("side", s1);
    up.branch("evil", evil);

    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");

    // The machine on s1 already has the side change; only m1 is missing.
    let probe = Probe::new().paths(&["main.txt", "skills/a.md", "guards/g.yaml"]);
    let results = analyze_for(&overlay, merge, &[hex(s1), hex(m1)], &probe.signals).await;
    let on_side = drifted(&results, &hex(s1), s1);
    assert_eq!((on_side.behind, on_side.ahead), (2, 0));
    assert_eq!(probe.raised(&on_side), set(&["main.txt"]));
    // The machine on m1 lacks the side change, which comes with s1.
    assert_eq!(
        probe.raised(&drifted(&results, &hex(m1), m1)),
        set(&["skills/a.md"])
    );

    // An evil merge's own edit is its own.
    let results = analyze_for(&overlay, evil, &[hex(s1)], &probe.signals).await;
    assert_eq!(
        probe.raised(&drifted(&results, &hex(s1), s1)),
        set(&["guards/g.yaml", "main.txt"])
    );
}

#[tokio::test]
async fn trailers_come_only_from_commits_in_the_range() {
    let mut up = Upstream::new();
    let t0 = up.commit(&[], &[("a", Some("0"))], "root");
    let t1 = up.commit(
        &[t0],
        &[("a", Some("1"))],
        "Old fix\n\nOld-Key: already deployed\n",
    );
    let t2 = up.commit(&[t1], &[("a", Some("2"))], "The reported commit\n");
    let t3 = up.commit(
        &[t2],
        &[("a", Some("3"))],
        "Patch the sandbox\n\nSecurity: CVE-2026-1 fix\nSigned-off-by: Dev <dev@example.com>\n",
    );
    let t4 = up.commit(&[t3], &[("a", Some("4"))], "Plain commit\n");
    up.branch(RELEASE, t4);

    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let probe = Probe::new()
        .trailer("Security")
        .trailer("Signed-off-by")
        .trailer("Old-Key");
    let results = analyze_for(&overlay, t4, &[hex(t2), hex(t3), hex(t0)], &probe.signals).await;
    assert_eq!(
        probe.raised(&drifted(&results, &hex(t2), t2)),
        set(&["Security", "Signed-off-by"])
    );
    // t3 already has the security fix: nothing in t4 ^t3 carries a trailer.
    assert_eq!(probe.raised(&drifted(&results, &hex(t3), t3)), set(&[]));
    assert_eq!(
        probe.raised(&drifted(&results, &hex(t0), t0)),
        set(&["Old-Key", "Security", "Signed-off-by"])
    );
    // The evidence names its commit, subject and the key as written.
    let range = drifted(&results, &hex(t0), t0);
    let security = probe.names[0].0;
    assert_eq!(range.evidence[&security], id(t3));
    let detail = &range.evidence_detail[&security];
    assert_eq!(detail.subject, "Patch the sandbox");
    assert_eq!(detail.matched.as_deref(), Some("Security"));
    let old_key = probe.names[2].0;
    assert_eq!(range.evidence[&old_key], id(t1));
    assert_eq!(
        range.evidence_detail[&old_key].matched.as_deref(),
        Some("Old-Key")
    );
}

#[tokio::test]
async fn fetch_moves_the_tip_mirrors_branches_and_prunes_deleted_ones() {
    let mut up = Upstream::new();
    let c1 = up.commit(&[], &[("a", Some("1"))], "c1");
    up.branch(RELEASE, c1);
    let k1 = up.commit(&[c1], &[("canary", Some("k"))], "canary work");
    up.branch("canary", k1);
    let (mirror, overlay) = open_mirror(&up).await;
    assert_eq!(within(overlay.fetch()).await.expect("fetch").commit, id(c1));
    let mirror_repo = || Repository::open_bare(mirror.path().join("overlay.git")).expect("mirror");
    assert!(mirror_repo().find_reference("refs/heads/canary").is_ok());

    // Pushed upstream but not fetched: unknown to the mirror, and that
    // answer is cached...
    let c2 = up.commit(&[c1], &[("a", Some("2"))], "c2");
    up.branch(RELEASE, c2);
    let prefix = short(c2, 9);
    let results = analyze(&overlay, c1, std::slice::from_ref(&prefix)).await;
    assert_eq!(results[&prefix], RefAnalysis::Unknown);

    // ...until a fetch changes the refs.
    up.delete_branch("canary");
    let tip = within(overlay.fetch()).await.expect("fetch");
    assert_eq!(tip.commit, id(c2));
    assert_eq!(within(overlay.tip()).await.expect("tip").commit, id(c2));
    let results = analyze(&overlay, c2, &[prefix.clone(), hex(k1)]).await;
    assert_eq!(results[&prefix], RefAnalysis::OnTip { commit: id(c2) });
    // The canary commit was mirrored while its branch existed: diverged.
    let canary = drifted(&results, &hex(k1), k1);
    assert_eq!((canary.behind, canary.ahead), (1, 1));
    assert!(
        mirror_repo().find_reference("refs/heads/canary").is_err(),
        "branch deleted upstream must be pruned"
    );
    assert!(mirror_repo().find_reference("refs/heads/release").is_ok());
}

#[tokio::test]
async fn unchanged_fleet_costs_no_range_work_on_the_next_sweep() {
    let mut up = Upstream::new();
    let c = up.linear(5);
    up.branch(RELEASE, c[4]);
    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let refs = vec![hex(c[0]), short(c[1], 7), hex(c[2]), hex(c[0]), hex(c[4])];
    let probe = Probe::new().globs("any", &["*.txt"]);

    let first = analyze_for(&overlay, c[4], &refs, &probe.signals).await;
    let after_first = overlay.stats();
    assert_eq!(after_first.range_computations, 3);
    assert_eq!(after_first.walks, 1, "one walk for every distinct commit");
    assert_eq!(after_first.commits_read, 5, "c0..c4, each once");
    assert_eq!(after_first.ref_lookups, 4);
    assert_eq!(after_first.commits_diffed, 4, "c1..c4, each once");

    let second = analyze_for(&overlay, c[4], &refs, &probe.signals).await;
    let after_second = overlay.stats();
    assert_eq!(first, second);
    assert_eq!(after_second.range_computations, 3, "no range recomputed");
    assert_eq!(after_second.walks, 1, "no walk");
    assert_eq!(after_second.ref_lookups, 4, "no ref looked up again");
    assert_eq!(
        after_second.range_cache_hits,
        after_first.range_cache_hits + 3
    );
    assert_eq!(after_second.ref_cache_hits, after_first.ref_cache_hits + 4);

    // A new tip recomputes the ranges but reads and diffs only the new commit.
    let c5 = up.commit(&[c[4]], &[("5.txt", Some("5"))], "c5");
    up.branch(RELEASE, c5);
    within(overlay.fetch()).await.expect("fetch");
    let third = analyze_for(&overlay, c5, &refs, &probe.signals).await;
    let after_third = overlay.stats();
    assert_eq!(after_third.range_computations, 3 + 4);
    assert_eq!(after_third.walks, 2);
    assert_eq!(after_third.commits_read, 5 + 1);
    assert_eq!(after_third.commits_diffed, 4 + 1);
    assert_eq!(drifted(&third, &hex(c[0]), c[0]).behind, 5);
}

#[tokio::test]
async fn reopening_a_mirror_keeps_it_and_follows_a_changed_repo() {
    let mut up = Upstream::new();
    let c = up.linear(2);
    up.branch(RELEASE, c[1]);
    up.branch("only-in-first", c[0]);
    let mirror = tempfile::tempdir().expect("tempdir");
    let first = within(Overlay::open(source(up.path(), mirror.path())))
        .await
        .expect("open");
    within(first.fetch()).await.expect("fetch");
    drop(first);

    let reopened = within(Overlay::open(source(up.path(), mirror.path())))
        .await
        .expect("reopen");
    let tip = within(reopened.tip()).await.expect("tip without fetch");
    assert_eq!(tip.commit, id(c[1]));

    // The config now names another repository: origin follows it, and the
    // old repository's branches are pruned on the next fetch.
    let mut other = Upstream::new();
    let o = other.linear(3);
    other.branch(RELEASE, o[2]);
    let moved = within(Overlay::open(source(other.path(), mirror.path())))
        .await
        .expect("open with changed repo");
    let mirror_repo = Repository::open_bare(mirror.path().join("overlay.git")).expect("mirror");
    let origin = mirror_repo.find_remote("origin").expect("origin");
    assert_eq!(origin.url().ok(), Some(other.path().as_str()));
    assert_eq!(within(moved.fetch()).await.expect("fetch").commit, id(o[2]));
    assert!(
        mirror_repo
            .find_reference("refs/heads/only-in-first")
            .is_err()
    );
}

#[tokio::test]
async fn file_urls_are_fetched_like_paths() {
    let mut up = Upstream::new();
    let c = up.linear(2);
    up.branch(RELEASE, c[1]);
    let mirror = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}", up.path());
    let overlay = within(Overlay::open(source(url, mirror.path())))
        .await
        .expect("open");
    assert_eq!(
        within(overlay.fetch()).await.expect("fetch").commit,
        id(c[1])
    );
}

#[tokio::test]
async fn a_missing_release_branch_is_a_typed_error_naming_it() {
    let mut up = Upstream::new();
    let c = up.linear(1);
    up.branch("main", c[0]);
    let (_mirror, overlay) = open_mirror(&up).await;

    let before_fetch = within(overlay.tip()).await.expect_err("never fetched");
    assert!(matches!(before_fetch, OverlayError::BranchMissing { .. }));

    let err = within(overlay.fetch())
        .await
        .expect_err("no release branch");
    match &err {
        OverlayError::BranchMissing { branch, repo } => {
            assert_eq!(branch, RELEASE);
            assert_eq!(repo, &up.path());
        }
        other => panic!("expected BranchMissing, got {other:?}"),
    }
    assert_eq!(err.kind(), "branch_missing");
    let text = err.to_string();
    assert!(
        text.contains(RELEASE) && text.contains(&up.path()),
        "{text}"
    );
}

#[tokio::test]
async fn a_nonexistent_repository_path_is_a_clear_error() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let missing = scratch.path().join("no-such-overlay");
    let missing = missing.to_str().expect("utf-8").to_owned();
    let overlay = within(Overlay::open(source(missing.clone(), scratch.path())))
        .await
        .expect("open does not touch the source");
    let err = within(overlay.fetch()).await.expect_err("missing repo");
    assert!(matches!(err, OverlayError::SourceMissing { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!("overlay repository {missing} does not exist")
    );
}

#[tokio::test]
async fn a_tip_outside_the_mirror_is_an_error() {
    let mut up = Upstream::new();
    let c = up.linear(1);
    up.branch(RELEASE, c[0]);
    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let stranger = CommitId::parse(&"ab".repeat(20)).expect("commit id");
    let err = within(overlay.analyze(&stranger, vec![hex(c[0])], &Signals::new()))
        .await
        .expect_err("tip not in mirror");
    match &err {
        OverlayError::TipMissing { tip, .. } => assert_eq!(tip, &stranger),
        other => panic!("expected TipMissing, got {other:?}"),
    }
}

#[tokio::test]
async fn a_directory_that_is_not_a_mirror_is_not_reused() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let dir = scratch.path().join("overlay.git");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("notes.txt"), "someone's data").expect("write");
    let err = within(Overlay::open(source("/srv/overlay".into(), scratch.path())))
        .await
        .expect_err("non-empty non-repo dir");
    assert!(matches!(err, OverlayError::OpenMirror { .. }), "{err:?}");
    assert!(dir.join("notes.txt").exists());
}

#[tokio::test]
async fn errors_never_carry_the_token_or_url_credentials() {
    let scratch = tempfile::tempdir().expect("tempdir");
    // Port 1 on loopback refuses at once.
    let repo = "https://x-access-token:URL-SECRET-123@127.0.0.1:1/acme/overlay.git";
    let mut src = source(repo.into(), scratch.path());
    src.token = Some("ENV-SECRET-456".into());
    assert!(!format!("{src:?}").contains("SECRET"));
    let overlay = within(Overlay::open(src)).await.expect("open");
    let err = within(overlay.fetch()).await.expect_err("nothing listens");
    assert!(matches!(err, OverlayError::Fetch { .. }), "{err:?}");
    let text = error_chain(&err);
    assert!(!text.contains("SECRET"), "{text}");
    assert!(!text.contains("x-access-token"), "{text}");
    assert!(text.contains("127.0.0.1:1/acme/overlay.git"), "{text}");
    assert!(!format!("{overlay:?}").contains("SECRET"));

    // A URL libgit2 cannot parse is quoted in its message.
    for repo in [
        "https://x-access-token:URL-SECRET-789@127.0.0.1:99999/acme/overlay.git",
        "unknown-scheme://x:URL-SECRET-000@host/acme/overlay.git",
    ] {
        let scratch = tempfile::tempdir().expect("tempdir");
        let overlay = within(Overlay::open(source(repo.into(), scratch.path())))
            .await
            .expect("open");
        let err = within(overlay.fetch()).await.expect_err("bad url");
        let text = error_chain(&err);
        assert!(!text.contains("SECRET"), "{text}");
    }
}

/// A loopback HTTP server that refuses every request with 401 and records
/// what it was sent.
fn unauthorized_server() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&requests);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            seen.lock()
                .expect("lock")
                .push(String::from_utf8_lossy(&request).into_owned());
            let _ = stream.write_all(
                b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"overlay\"\r\n\
                  Content-Length: 0\r\nConnection: close\r\n\r\n",
            );
        }
    });
    (port, requests)
}

fn base64(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test]
async fn a_rejected_token_is_tried_once_and_never_echoed() {
    let (port, requests) = unauthorized_server();
    let scratch = tempfile::tempdir().expect("tempdir");
    let token = "ghp_REJECTED_TOKEN_789";
    let mut src = source(
        format!("http://127.0.0.1:{port}/acme/overlay.git"),
        scratch.path(),
    );
    src.token = Some(token.into());
    let overlay = within(Overlay::open(src)).await.expect("open");
    let err = within(overlay.fetch()).await.expect_err("401");
    let text = error_chain(&err);
    assert!(!text.contains(token), "{text}");

    let requests = requests.lock().expect("lock").clone();
    let expected = format!(
        "authorization: basic {}",
        base64(format!("x-access-token:{token}").as_bytes())
    )
    .to_ascii_lowercase();
    let with_token = requests
        .iter()
        .filter(|r| r.to_ascii_lowercase().contains(&expected))
        .count();
    assert_eq!(with_token, 1, "token sent exactly once: {requests:#?}");
    assert!(requests.len() <= 3, "no credential loop: {requests:#?}");
}

#[test]
fn base64_helper_matches_rfc_4648_vectors() {
    for (plain, encoded) in [
        ("", ""),
        ("f", "Zg=="),
        ("fo", "Zm8="),
        ("foo", "Zm9v"),
        ("foobar", "Zm9vYmFy"),
    ] {
        assert_eq!(base64(plain.as_bytes()), encoded);
    }
}

// ------------------------------------------------- graph walk at scale

/// A random DAG as parent positions (parents before children) with random
/// committer times, some far in the past: clocks on real machines lie.
fn random_dag() -> impl proptest::strategy::Strategy<Value = Vec<(Vec<usize>, i64)>> {
    use proptest::prelude::*;
    (2usize..36).prop_flat_map(|n| {
        proptest::collection::vec(
            (
                proptest::collection::vec(any::<proptest::sample::Index>(), 1..4),
                0u8..10,
                -100_000i64..100_000,
            ),
            n,
        )
        .prop_map(|spec| {
            spec.iter()
                .enumerate()
                .map(|(i, (picks, kind, skew))| {
                    let mut parents = Vec::new();
                    // Mostly a chain with side branches; now and then a new
                    // root (unrelated history) or an octopus merge.
                    if i > 0 && *kind != 0 {
                        parents.push(i - 1 - picks[0].index(i.min(4)));
                        let extra = match kind {
                            1..=3 => 1,
                            4 => 2,
                            _ => 0,
                        };
                        for p in picks.iter().skip(1).take(extra) {
                            let q = p.index(i);
                            if !parents.contains(&q) {
                                parents.push(q);
                            }
                        }
                    }
                    let time =
                        1_760_000_000 + i as i64 * 60 + if kind % 3 == 0 { *skew } else { 0 };
                    (parents, time)
                })
                .collect()
        })
    })
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config::with_cases(24))]

    /// Every behind/ahead, for every commit against several tips in turn on
    /// one overlay (so the graph is extended and reused, never rebuilt), is
    /// what breadth-first search over parent ids counts.
    #[test]
    fn counts_match_breadth_first_search_on_random_dags_and_tips(
        dag in random_dag(),
        first_tip in proptest::prelude::any::<proptest::sample::Index>(),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let mut up = Upstream::new();
            let mut commits: Vec<Oid> = Vec::new();
            for (i, (parents, time)) in dag.iter().enumerate() {
                let parents: Vec<Oid> = parents.iter().map(|p| commits[*p]).collect();
                let path = format!("f{i}");
                commits.push(up.commit_at(&parents, &[(&path, Some("x"))], &format!("c{i}"), *time));
            }
            for (i, oid) in commits.iter().enumerate() {
                up.branch(&format!("b{i}"), *oid);
            }
            let last = commits.len() - 1;
            let tips = [commits[first_tip.index(commits.len())], commits[last], commits[0]];
            up.branch(RELEASE, tips[0]);
            let (_mirror, overlay) = open_mirror(&up).await;
            within(overlay.fetch()).await.expect("fetch");
            let refs: Vec<String> = commits.iter().map(|o| hex(*o)).collect();
            for tip in tips {
                let results = analyze(&overlay, tip, &refs).await;
                for commit in &commits {
                    match &results[&hex(*commit)] {
                        RefAnalysis::OnTip { .. } => assert_eq!(*commit, tip),
                        RefAnalysis::Drifted { range, .. } => assert_eq!(
                            (range.behind, range.ahead),
                            expected_counts(&up.repo, tip, *commit),
                            "{commit} against {tip}"
                        ),
                        other => panic!("{commit}: {other:?}"),
                    }
                }
            }
            let stats = overlay.stats();
            assert!(
                stats.commits_read <= commits.len() as u64,
                "each commit read once: {stats:?}"
            );
        });
    }
}

#[tokio::test]
async fn commit_dates_that_lie_do_not_change_the_counts() {
    //  O - M - T                      release   (honest clocks)
    //       \
    //        X10 - X9 - … - X1 - R    canary    (X dated 1970, R today)
    //
    // A walk ordered by date hides R, reaches X1 and then, with nothing
    // interesting left in its queue, stops a few commits later, before it
    // learns that M and O are R's too; it would count them behind.
    let mut up = Upstream::new();
    let o = up.commit_at(&[], &[("o", Some("o"))], "o", 1_760_000_400);
    let m = up.commit_at(&[o], &[("m", Some("m"))], "m", 1_760_000_500);
    let t = up.commit_at(&[m], &[("t", Some("t"))], "t", 1_760_000_900);
    let mut x = m;
    for i in (1..=10).rev() {
        let path = format!("x{i}");
        x = up.commit_at(&[x], &[(&path, Some("x"))], &path, i);
    }
    let r = up.commit_at(&[x], &[("r", Some("r"))], "r", 1_760_001_000);
    up.branch(RELEASE, t);
    up.branch("canary", r);

    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let results = analyze(&overlay, t, &[hex(r)]).await;
    let range = drifted(&results, &hex(r), r);
    assert_eq!(expected_counts(&up.repo, t, r), (1, 11));
    assert_eq!((range.behind, range.ahead), (1, 11));
}

#[tokio::test]
async fn a_new_process_starts_from_the_saved_graph_and_diffs_nothing() {
    let mut up = Upstream::new();
    let c = up.linear(6);
    up.branch(RELEASE, c[5]);
    let mirror = tempfile::tempdir().expect("tempdir");
    let refs = vec![hex(c[0]), hex(c[2]), short(c[3], 8)];
    let probe = Probe::new().paths(&["1.txt", "4.txt"]).trailer("Security");

    let first = within(Overlay::open(source(up.path(), mirror.path())))
        .await
        .expect("open");
    within(first.fetch()).await.expect("fetch");
    let before = analyze_for(&first, c[5], &refs, &probe.signals).await;
    assert_eq!(first.stats().commits_read, 6);
    assert_eq!(first.stats().commits_diffed, 5, "c1..c5");
    drop(first);

    let second = within(Overlay::open(source(up.path(), mirror.path())))
        .await
        .expect("reopen");
    let after = analyze_for(&second, c[5], &refs, &probe.signals).await;
    assert_eq!(after, before);
    let stats = second.stats();
    assert_eq!(stats.commits_loaded, 6);
    assert_eq!(stats.commits_read, 0, "no commit read again");
    assert_eq!(stats.commits_diffed, 0, "no tree diffed again");

    // Other path signals: the saved path facts no longer apply, the graph does.
    let other = Probe::new().paths(&["2.txt"]);
    let changed = analyze_for(&second, c[5], &refs, &other.signals).await;
    assert_eq!(
        other.raised(&drifted(&changed, &hex(c[0]), c[0])),
        set(&["2.txt"])
    );
    assert_eq!(second.stats().commits_read, 0);
    assert_eq!(second.stats().commits_diffed, 5);

    // A damaged file is ignored: the history is read again.
    let file = mirror
        .path()
        .join("overlay.git")
        .join("fleet-reconciler-graph");
    std::fs::write(&file, b"not a graph").expect("damage the saved graph");
    let third = within(Overlay::open(source(up.path(), mirror.path())))
        .await
        .expect("reopen");
    assert_eq!(
        analyze_for(&third, c[5], &refs, &probe.signals).await,
        before
    );
    assert_eq!(third.stats().commits_loaded, 0);
    assert_eq!(third.stats().commits_read, 6);
}

#[tokio::test]
async fn without_path_signals_no_tree_is_diffed() {
    let mut up = Upstream::new();
    let t0 = up.commit(&[], &[("a", Some("0"))], "root");
    let t1 = up.commit(&[t0], &[("a", Some("1"))], "fix\n\nSecurity: yes\n");
    let t2 = up.commit(&[t1], &[("b", Some("2"))], "more");
    up.branch(RELEASE, t2);
    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");

    let counts_only = analyze(&overlay, t2, &[hex(t0)]).await;
    assert_eq!(drifted(&counts_only, &hex(t0), t0).behind, 2);
    let probe = Probe::new().trailer("security");
    let trailers = analyze_for(&overlay, t2, &[hex(t0)], &probe.signals).await;
    assert_eq!(
        probe.raised(&drifted(&trailers, &hex(t0), t0)),
        set(&["security"])
    );
    assert_eq!(overlay.stats().commits_diffed, 0);
}

#[tokio::test]
async fn path_signals_look_only_under_their_prefixes_and_match_like_the_config() {
    let mut up = Upstream::new();
    let base = up.commit(&[], &[("README", Some("r"))], "base");
    let mut tip = base;
    let mut commit_of = HashMap::new();
    for path in [
        "skills/a.md",
        "skills/deep/b.md",
        "skillsX/c.md",
        "policies/deep/x.yaml",
        "top.md",
        "docs/policies/readme.md",
    ] {
        tip = up.commit(&[tip], &[(path, Some("v"))], path);
        commit_of.insert(path, tip);
    }
    up.branch(RELEASE, tip);
    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");

    // Each commit alone: measured against its parent with itself as the tip.
    async fn raised_by_each(
        up: &Upstream,
        overlay: &Overlay,
        commit_of: &HashMap<&str, Oid>,
        probe: &Probe,
    ) -> HashMap<String, BTreeSet<String>> {
        let mut raised = HashMap::new();
        for (path, commit) in commit_of {
            let parent = up
                .repo
                .find_commit(*commit)
                .expect("commit")
                .parent_id(0)
                .expect("parent");
            let results = analyze_for(overlay, *commit, &[hex(parent)], &probe.signals).await;
            let range = drifted(&results, &hex(parent), parent);
            assert_eq!(range.behind, 1);
            raised.insert((*path).to_owned(), probe.raised(&range));
        }
        raised
    }

    // Literal prefixes `skills` and `policies`: only those subtrees are diffed.
    let limited = Probe::new()
        .globs("skills-md", &["skills/*.md"])
        .globs("skills-any", &["skills/**"])
        .globs("policies", &["policies/**"]);
    let raised = raised_by_each(&up, &overlay, &commit_of, &limited).await;
    assert_eq!(raised["skills/a.md"], set(&["skills-md", "skills-any"]));
    assert_eq!(
        raised["skills/deep/b.md"],
        set(&["skills-any"]),
        "`*` stays in one directory"
    );
    assert_eq!(
        raised["skillsX/c.md"],
        set(&[]),
        "a sibling is not under `skills`"
    );
    assert_eq!(raised["policies/deep/x.yaml"], set(&["policies"]));
    assert_eq!(raised["top.md"], set(&[]));
    assert_eq!(
        raised["docs/policies/readme.md"],
        set(&[]),
        "anchored at the root"
    );

    // Globs without a literal prefix look at the whole tree.
    let whole = Probe::new()
        .globs("root-md", &["*.md"])
        .globs("any-md", &["**/*.md"]);
    let raised = raised_by_each(&up, &overlay, &commit_of, &whole).await;
    assert_eq!(raised["skills/a.md"], set(&["any-md"]));
    assert_eq!(raised["skillsX/c.md"], set(&["any-md"]));
    assert_eq!(raised["policies/deep/x.yaml"], set(&[]));
    assert_eq!(raised["top.md"], set(&["root-md", "any-md"]));
}

#[tokio::test]
async fn evidence_names_the_newest_missing_commit_that_carries_the_signal() {
    let mut up = Upstream::new();
    let c0 = up.commit(&[], &[("a", Some("0"))], "root");
    let c1 = up.commit(
        &[c0],
        &[("policies/p", Some("1"))],
        "first policy\n\nSecurity: a\n",
    );
    let c2 = up.commit(
        &[c1],
        &[("policies/p", Some("2"))],
        "second policy\n\nSecurity: b\n",
    );
    let c3 = up.commit(&[c2], &[("other", Some("3"))], "unrelated");
    up.branch(RELEASE, c3);
    let (_mirror, overlay) = open_mirror(&up).await;
    within(overlay.fetch()).await.expect("fetch");
    let probe = Probe::new()
        .globs("policies", &["policies/**"])
        .trailer("security");
    let results = analyze_for(&overlay, c3, &[hex(c0), hex(c1), hex(c2)], &probe.signals).await;
    for (machine, evidence) in [(c0, Some(c2)), (c1, Some(c2)), (c2, None)] {
        let range = drifted(&results, &hex(machine), machine);
        for (signal, _) in &probe.names {
            assert_eq!(
                range.evidence.get(signal),
                evidence.map(id).as_ref(),
                "{machine}"
            );
        }
    }
}

#[tokio::test]
async fn a_new_mirror_of_a_local_repository_takes_its_packs_not_each_object() {
    let mut up = Upstream::new();
    let c = up.linear(30);
    up.branch(RELEASE, c[29]);
    // Pack the history, as a repository that has been pushed to or gc'd is.
    {
        let mut walk = up.repo.revwalk().expect("revwalk");
        walk.push(c[29]).expect("push");
        let mut pack = up.repo.packbuilder().expect("packbuilder");
        pack.insert_walk(&mut walk).expect("insert");
        pack.write(&up.dir.path().join("objects").join("pack"), 0o444)
            .expect("write pack");
    }

    let (_mirror, overlay) = open_mirror(&up).await;
    assert_eq!(
        within(overlay.fetch()).await.expect("fetch").commit,
        id(c[29])
    );
    let stats = overlay.stats();
    assert_eq!(stats.packs_seeded, 1);
    assert_eq!(stats.objects_received, 0, "every object came with the pack");
    let results = analyze(&overlay, c[29], &[hex(c[0])]).await;
    assert_eq!(drifted(&results, &hex(c[0]), c[0]).behind, 29);

    // Later fetches are ordinary: only what is new, no seeding.
    let next = up.commit(&[c[29]], &[("new.txt", Some("n"))], "new");
    up.branch(RELEASE, next);
    assert_eq!(
        within(overlay.fetch()).await.expect("fetch").commit,
        id(next)
    );
    let stats = overlay.stats();
    assert_eq!(stats.packs_seeded, 1);
    assert!(stats.objects_received > 0);
    let results = analyze(&overlay, next, &[hex(c[0])]).await;
    assert_eq!(drifted(&results, &hex(c[0]), c[0]).behind, 30);
}

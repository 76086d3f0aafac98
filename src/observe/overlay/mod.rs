//! The overlay git mirror: fetch, release tip, ref resolution, drift ranges.
//!
//! Owns a bare mirror of the overlay repository (every `refs/heads/*`) and
//! answers "how far does this reported ref trail the tip, and which of the
//! caller's [`Signals`] do the missing commits carry". All git2 work runs in
//! `spawn_blocking` and returns owned values; no git2 handle crosses an
//! `.await`. It must never decide severity or policy (a signal is a
//! question the severity module asks), and never talk to Fly or agents.
//!
//! It must also never leak the overlay token: errors carry the repository
//! with its userinfo stripped and libgit2 messages with every secret
//! replaced, and [`OverlaySource`]'s `Debug` hides the token. It never
//! writes to the source repository; it writes only the mirror and, inside
//! it, the saved commit graph (`store`).
//!
//! Costs are shaped for a 10,000-machine sweep and a long history:
//!
//! - one blocking task per batch, each distinct ref resolved once;
//! - one walk of the commit graph per batch of distinct commits
//!   (`graph`), not one revwalk per ref, over commits kept in memory
//!   numbered parents-first, so the walk is exact whatever the commit dates;
//! - per-commit facts (trailer keys; path signals, only when a signal asks
//!   about paths, from diffs limited to the globs' literal prefixes) computed
//!   once per commit and kept across tips: a new tip reads and diffs only the
//!   commits new since the last one;
//! - results cached per (tip, commit, signals). Commit graphs are immutable,
//!   so neither the graph nor a range goes stale; prefix resolutions can (a
//!   fetch may bring an object that makes a prefix known or ambiguous), so
//!   that cache is dropped whenever the refs change.

mod facts;
mod graph;
mod seed;
mod signals;
mod store;

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use git2::{
    AutotagOption, Cred, CredentialType, ErrorCode, FetchOptions, FetchPrune, ObjectType, Oid,
    RemoteCallbacks, RemoteRedirect, Repository,
};
use secrecy::{ExposeSecret, SecretString};

use crate::config::{DEFAULT_DIFF_BUDGET, DEFAULT_FETCH_TIMEOUT};
use crate::model::{CommitId, MissingCommit};
use crate::observe::DurationObserver;
use graph::{FastMap, Graph, LoadError, Node};
pub use signals::{SignalId, Signals};

/// The remote the mirror fetches from.
const REMOTE: &str = "origin";
/// Mirror every branch under its own name, so a ref from a canary or feature
/// branch resolves (and is reported as diverged) instead of being unknown.
const HEADS_REFSPEC: &str = "+refs/heads/*:refs/heads/*";
/// libgit2's minimum prefix length (`GIT_OID_MINPREFIXLEN`); a shorter
/// prefix cannot name one object, so it fails closed as ambiguous.
const MIN_PREFIX_LEN: usize = 4;
const FULL_ID_LEN: usize = 40;
/// Username GitHub-style token auth expects alongside the token.
const TOKEN_USERNAME: &str = "x-access-token";
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
/// libgit2 maps pack files in windows (up to 8 GiB by default, every touched
/// page resident); reading a long history once would otherwise keep most of
/// the pack in memory. This bounds it, for the whole process. (libgit2's
/// object cache is switched off altogether: the graph reads each commit
/// once and each diff its few trees once, and measured on a 100k-commit
/// history the cache made reading slower — evicting cost more than reading,
/// 0.8 s per 100,000 commits — and held several times its nominal bound:
/// a 32 MiB cache, 170 MiB resident.)
const GIT_MWINDOW_BYTES: usize = 1 << 20;
const GIT_MWINDOW_MAPPED_LIMIT_BYTES: usize = 8 << 20;
const REDACTED: &str = "[redacted]";
/// libgit2 waits forever on a stalled https server by default; a hung fetch
/// would hold the fetch lock and a blocking thread for good.
const GIT_CONNECT_TIMEOUT_MS: i32 = 10_000;
const GIT_IO_TIMEOUT_MS: i32 = 60_000;

/// Sets libgit2's process-wide network timeouts and memory bounds, once,
/// before any fetch or read.
// git2 marks its global option setters unsafe (see the SAFETY note).
#[allow(unsafe_code)]
fn set_libgit2_options() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: libgit2 requires these globals be set while no other thread
        // is using its network layer or object database. Every git2 call in
        // this process goes through an `Overlay`, and every `Overlay` is
        // created by `open`, which runs this `Once` to completion before its
        // first repository is opened.
        unsafe {
            let connect =
                git2::opts::set_server_connect_timeout_in_milliseconds(GIT_CONNECT_TIMEOUT_MS);
            let io = git2::opts::set_server_timeout_in_milliseconds(GIT_IO_TIMEOUT_MS);
            if connect.is_err() || io.is_err() {
                tracing::warn!(
                    "cannot set libgit2 network timeouts; a stalled git server may hang fetches"
                );
            }
            git2::opts::enable_caching(false);
            let memory = [
                git2::opts::set_mwindow_size(GIT_MWINDOW_BYTES),
                git2::opts::set_mwindow_mapped_limit(GIT_MWINDOW_MAPPED_LIMIT_BYTES),
            ];
            if memory.iter().any(Result::is_err) {
                tracing::warn!("cannot bound libgit2 memory; reading a long history may use more");
            }
        }
    });
}

/// Where the overlay comes from and where the mirror lives.
#[derive(Clone)]
pub struct OverlaySource {
    /// A URL (`https://…`, `file://…`) or a local filesystem path.
    pub repo: String,
    /// The release branch whose tip is the expected ref.
    pub branch: String,
    /// The bare mirror kept by the daemon.
    pub mirror_dir: PathBuf,
    /// Token for https remotes (from `OVERLAY_GIT_TOKEN`); never logged.
    pub token: Option<SecretString>,
}

// Hand-written so that `{:?}` of a config never prints the token or a
// password embedded in the URL.
impl fmt::Debug for OverlaySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OverlaySource")
            .field("repo", &display_repo(&self.repo))
            .field("branch", &self.branch)
            .field("mirror_dir", &self.mirror_dir)
            .field("token", &self.token)
            .finish()
    }
}

/// The release branch tip after a fetch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tip {
    pub branch: String,
    pub commit: CommitId,
}

/// How far a reported commit is from the tip, and what the commits it lacks
/// (`tip ^commit`) carry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriftRange {
    /// Commits reachable from the tip but not from the reported commit.
    pub behind: u64,
    /// Commits reachable from the reported commit but not from the tip.
    pub ahead: u64,
    /// Each signal some commit in `tip ^commit` carries, with one such
    /// commit as evidence: the newest by committer time (ties: lowest id),
    /// so the same range always names the same commit.
    pub evidence: BTreeMap<SignalId, CommitId>,
    /// Some commit in `tip ^commit` has not been compared for the path
    /// signals yet: the git work of one analysis is bounded
    /// ([`Overlay::set_diff_budget`]), and later analyses go on where this
    /// one stopped. `evidence` then holds only what was found so far.
    pub paths_incomplete: bool,
    /// The newest commits of `tip ^commit`, newest first by committer time
    /// (ties: lowest id), at most [`MAX_SHOWN_MISSING`]; `behind` says how
    /// many there are in all. Collected by the same walk that counts them.
    /// Shared: the same commits near the tip are the newest of most ranges.
    pub newest: Vec<Arc<MissingCommit>>,
    /// What each evidence commit carries that raised its signal, by the same
    /// signal ids as `evidence`.
    pub evidence_detail: BTreeMap<SignalId, EvidenceDetail>,
}

/// The newest missing commits a drift range lists, at most.
pub const MAX_SHOWN_MISSING: usize = 20;

/// The longest commit subject the overlay reports (characters; a longer
/// one is cut and ends in `…`).
pub const MAX_SUBJECT_CHARS: usize = facts::MAX_SUBJECT_CHARS;

/// Why an evidence commit carries its signal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvidenceDetail {
    /// The commit's subject, bounded ([`MAX_SUBJECT_CHARS`]).
    pub subject: String,
    /// What raised the signal: for a trailer signal the commit's trailer
    /// key as written (`Security`), for a path signal the first path (in
    /// byte order) its own change touches that the globs match. `None`
    /// only if the commit no longer shows it, which a consistent
    /// repository cannot do.
    pub matched: Option<String>,
}

impl DriftRange {
    /// Whether some commit the machine lacks carries `signal`.
    pub fn carries(&self, signal: SignalId) -> bool {
        self.evidence.contains_key(&signal)
    }
}

/// The overlay's verdict on one reported ref.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefAnalysis {
    OnTip {
        commit: CommitId,
    },
    Drifted {
        commit: CommitId,
        range: Arc<DriftRange>,
    },
    Unknown,
    Ambiguous,
}

/// Work counters, so callers and tests can see what a sweep cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverlayStats {
    /// Drift ranges computed by a graph walk (cache misses).
    pub range_computations: u64,
    /// Drift ranges served from the cache.
    pub range_cache_hits: u64,
    /// Reported refs looked up in the object database.
    pub ref_lookups: u64,
    /// Reported refs answered from the resolution cache.
    pub ref_cache_hits: u64,
    /// Graph walks (one per batch of up to 1,023 uncached commits).
    pub walks: u64,
    /// Commits the walks took (their cost).
    pub commits_walked: u64,
    /// Commits read from the object database into the graph.
    pub commits_read: u64,
    /// Commits loaded from the saved graph instead.
    pub commits_loaded: u64,
    /// Commits whose path signals were computed (tree diffs).
    pub commits_diffed: u64,
    /// Pack files a new mirror took from a local source (linked or copied).
    pub packs_seeded: u64,
    /// Objects fetches received through libgit2.
    pub objects_received: u64,
}

/// A libgit2 failure with every secret removed from its message.
///
/// `git2::Error` is never kept as a source: its message may quote the remote
/// URL, and an error chain printed with `{:#}` would then carry the token.
#[derive(Debug)]
pub struct GitCause {
    pub code: ErrorCode,
    pub class: git2::ErrorClass,
    message: String,
}

impl GitCause {
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for GitCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GitCause {}

#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error("cannot prepare overlay mirror directory {path}: {source}")]
    MirrorDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot initialise overlay mirror at {path}: {source}")]
    InitMirror {
        path: PathBuf,
        #[source]
        source: GitCause,
    },
    #[error("cannot open overlay mirror at {path} (not a bare git repository?): {source}")]
    OpenMirror {
        path: PathBuf,
        #[source]
        source: GitCause,
    },
    #[error("cannot point remote {REMOTE} of overlay mirror {path} at {repo}: {source}")]
    ConfigureRemote {
        path: PathBuf,
        repo: String,
        #[source]
        source: GitCause,
    },
    #[error("overlay repository {repo} does not exist")]
    SourceMissing { repo: String },
    #[error("fetching overlay from {repo} failed: {source}")]
    Fetch {
        repo: String,
        #[source]
        source: GitCause,
    },
    #[error("branch {branch} not found in overlay repository {repo}")]
    BranchMissing { branch: String, repo: String },
    #[error("cannot read branch {branch} of overlay mirror {path}: {source}")]
    ReadBranch {
        branch: String,
        path: PathBuf,
        #[source]
        source: GitCause,
    },
    #[error("cannot list the refs of overlay mirror {path}: {source}")]
    ReadRefs {
        path: PathBuf,
        #[source]
        source: GitCause,
    },
    #[error("release tip {tip} is not in the overlay mirror {path}")]
    TipMissing { tip: CommitId, path: PathBuf },
    #[error("cannot resolve reported ref {reference} in overlay mirror {path}: {source}")]
    Resolve {
        reference: String,
        path: PathBuf,
        #[source]
        source: GitCause,
    },
    #[error("cannot read commit {commit} in overlay mirror {path}: {source}")]
    ReadCommit {
        commit: String,
        path: PathBuf,
        #[source]
        source: GitCause,
    },
    #[error("commit {commit} in overlay mirror {path} is malformed or contradicts its history")]
    MalformedCommit { commit: String, path: PathBuf },
    #[error("overlay mirror {path} has more commits than one graph can number")]
    HistoryTooLarge { path: PathBuf },
    #[error("cannot diff commit {commit} in overlay mirror {path}: {source}")]
    Diff {
        commit: String,
        path: PathBuf,
        #[source]
        source: GitCause,
    },
    #[error("object id {id} in overlay mirror is not a 40-hex SHA-1 commit id")]
    ObjectFormat { id: String },
    #[error(
        "fetching overlay from {repo} did not finish within {} (overlay.fetch_timeout); abandoned",
        humantime::format_duration(*after)
    )]
    FetchTimedOut { repo: String, after: Duration },
    #[error(
        "a fetch from {repo} abandoned earlier has still not returned (the server keeps the connection open); not starting another"
    )]
    FetchBusy { repo: String },
    #[error("cannot start the overlay fetch thread: {source}")]
    FetchThread {
        #[source]
        source: std::io::Error,
    },
    #[error("the overlay fetch thread stopped without an answer")]
    FetchLost,
    #[error("overlay worker task failed: {source}")]
    Task {
        #[source]
        source: tokio::task::JoinError,
    },
}

impl OverlayError {
    /// A bounded label for metrics (`kind="fetch"`), never a `Debug` string.
    pub fn kind(&self) -> &'static str {
        match self {
            OverlayError::MirrorDir { .. } => "mirror_dir",
            OverlayError::InitMirror { .. } => "init_mirror",
            OverlayError::OpenMirror { .. } => "open_mirror",
            OverlayError::ConfigureRemote { .. } => "configure_remote",
            OverlayError::SourceMissing { .. } => "source_missing",
            OverlayError::Fetch { .. } => "fetch",
            OverlayError::BranchMissing { .. } => "branch_missing",
            OverlayError::ReadBranch { .. } => "read_branch",
            OverlayError::ReadRefs { .. } => "read_refs",
            OverlayError::TipMissing { .. } => "tip_missing",
            OverlayError::Resolve { .. } => "resolve",
            OverlayError::ReadCommit { .. } => "read_commit",
            OverlayError::MalformedCommit { .. } => "malformed_commit",
            OverlayError::HistoryTooLarge { .. } => "history_too_large",
            OverlayError::Diff { .. } => "diff",
            OverlayError::ObjectFormat { .. } => "object_format",
            OverlayError::FetchTimedOut { .. }
            | OverlayError::FetchBusy { .. }
            | OverlayError::FetchThread { .. }
            | OverlayError::FetchLost => "fetch",
            OverlayError::Task { .. } => "task",
        }
    }
}

/// Handle to the mirror; cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub struct Overlay {
    inner: Arc<Inner>,
    /// Told how long each fetch took ([`Overlay::with_observer`]).
    observer: Option<DurationObserver>,
}

impl fmt::Debug for Overlay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Overlay")
            .field("repo", &self.inner.shown_repo)
            .field("branch", &self.inner.branch)
            .field("mirror_dir", &self.inner.mirror_dir)
            .finish_non_exhaustive()
    }
}

struct Inner {
    /// The remote as libgit2 sees it (relative paths made absolute).
    url: String,
    /// The remote for messages: userinfo and query stripped.
    shown_repo: String,
    branch: String,
    mirror_dir: PathBuf,
    token: Option<SecretString>,
    redactor: Redactor,
    /// Two fetches into one mirror would race on ref lock files.
    fetch_lock: Mutex<()>,
    /// Path comparisons one analysis may make ([`Overlay::set_diff_budget`]).
    diff_budget: AtomicUsize,
    caches: Mutex<Caches>,
    /// Held for a whole walk: analyses of one mirror run one at a time.
    graph: Mutex<GraphState>,
    counters: Counters,
}

#[derive(Default)]
struct GraphState {
    graph: Graph,
    /// Whether the saved graph has been read (once per process).
    loaded: bool,
}

#[derive(Default)]
struct Caches {
    /// Bumped whenever the refs changed; a resolution computed under an
    /// older generation is not cached.
    generation: u64,
    /// Fingerprint of every ref in the mirror when the resolutions were made.
    refs_fingerprint: Option<u64>,
    resolutions: HashMap<String, Resolution>,
    /// Ranges per (tip, commit), for the signals with this fingerprint.
    ranges: HashMap<(Oid, Oid), Arc<DriftRange>>,
    ranges_signals: u64,
    /// Subjects and trailer keys of the commits reasons have shown: the
    /// newest commits of most ranges are the same few near the tip.
    texts: HashMap<Oid, Arc<facts::CommitText>>,
    /// The same commits as ranges list them, one allocation each however
    /// many ranges (and reasons) list them.
    shown: HashMap<Oid, Arc<MissingCommit>>,
}

impl Caches {
    fn invalidate_resolutions(&mut self, fingerprint: Option<u64>) {
        self.generation += 1;
        self.resolutions.clear();
        self.refs_fingerprint = fingerprint;
    }
}

#[derive(Default)]
struct Counters {
    range_computations: AtomicU64,
    range_cache_hits: AtomicU64,
    ref_lookups: AtomicU64,
    ref_cache_hits: AtomicU64,
    walks: AtomicU64,
    commits_walked: AtomicU64,
    commits_read: AtomicU64,
    commits_loaded: AtomicU64,
    commits_diffed: AtomicU64,
    packs_seeded: AtomicU64,
    objects_received: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resolution {
    Commit(Oid),
    Unknown,
    Ambiguous,
}

impl Overlay {
    /// Opens the mirror at `mirror_dir`, creating a bare one if the directory
    /// is missing or empty, and points its `origin` at `source.repo`. Does not
    /// fetch.
    pub async fn open(source: OverlaySource) -> Result<Overlay, OverlayError> {
        set_libgit2_options();
        let inner = spawn(move || open_blocking(source)).await?;
        Ok(Overlay {
            inner: Arc::new(inner),
            observer: None,
        })
    }

    /// Tells `observer` how long each fetch took and how it ended (`ok`,
    /// `failed`).
    pub fn with_observer(mut self, observer: DurationObserver) -> Overlay {
        self.observer = Some(observer);
        self
    }

    /// Fetches every branch from origin (pruning deleted ones) and returns
    /// the release branch tip, within [`DEFAULT_FETCH_TIMEOUT`].
    pub async fn fetch(&self) -> Result<Tip, OverlayError> {
        self.fetch_within(DEFAULT_FETCH_TIMEOUT).await
    }

    /// [`Overlay::fetch`] with an overall deadline. libgit2's own timeouts
    /// are per read, so a server that trickles a byte at a time would hold
    /// a fetch for ever; past `limit` (or when this future is dropped) the
    /// fetch is told to stop at libgit2's next callback and abandoned. It
    /// runs on its own thread, not a runtime's blocking pool: the runtime
    /// waits for its blocking tasks when it shuts down, and an abandoned
    /// fetch must not hold up the process's exit. While it has not
    /// returned, later fetches fail at once with [`OverlayError::FetchBusy`]
    /// rather than pile up threads behind it.
    ///
    /// A blocking-pool task idles beside the fetch until this future ends,
    /// however it ends: tokio's paused clock (tests on paused time) does not
    /// auto-advance while blocking work runs, so it cannot jump to `limit`
    /// past a fetch it does not otherwise see. It ends with this future, so
    /// it never holds up a shutdown.
    pub async fn fetch_within(&self, limit: Duration) -> Result<Tip, OverlayError> {
        let started = tokio::time::Instant::now();
        let result = self.fetch_unobserved(limit).await;
        if let Some(o) = &self.observer {
            o(
                if result.is_ok() { "ok" } else { "failed" },
                started.elapsed(),
            );
        }
        result
    }

    async fn fetch_unobserved(&self, limit: Duration) -> Result<Tip, OverlayError> {
        let (_release, released) = std::sync::mpsc::channel::<()>();
        drop(tokio::task::spawn_blocking(move || {
            let _ = released.recv();
        }));
        let inner = Arc::clone(&self.inner);
        let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
        let flag = Arc::clone(&stop.0);
        let (answer, answered) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("overlay-fetch".into())
            .spawn(move || {
                let _ = answer.send(inner.fetch_blocking(&flag));
            })
            .map_err(|source| OverlayError::FetchThread { source })?;
        match tokio::time::timeout(limit, answered).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(OverlayError::FetchLost),
            Err(_) => Err(OverlayError::FetchTimedOut {
                repo: self.inner.shown_repo.clone(),
                after: limit,
            }),
        }
    }

    /// The release branch tip as the mirror has it now, without fetching.
    pub async fn tip(&self) -> Result<Tip, OverlayError> {
        let inner = Arc::clone(&self.inner);
        spawn(move || {
            let repo = inner.open_repo()?;
            inner.branch_tip(&repo)
        })
        .await
    }

    /// Resolves each distinct reported ref (lowercase hex, full or
    /// abbreviated) and measures its drift from `tip`, reporting which of
    /// `signals` the missing commits carry. One blocking task and one graph
    /// walk for the whole batch; repeated refs and ranges come from the
    /// caches.
    pub async fn analyze(
        &self,
        tip: &CommitId,
        refs: Vec<String>,
        signals: &Signals,
    ) -> Result<HashMap<String, RefAnalysis>, OverlayError> {
        let inner = Arc::clone(&self.inner);
        let tip = tip.clone();
        let signals = signals.clone();
        spawn(move || inner.analyze_blocking(&tip, refs, &signals)).await
    }

    /// Sets how many commits one analysis compares for path signals, at
    /// most ([`DEFAULT_DIFF_BUDGET`]); ranges past it are reported with
    /// [`DriftRange::paths_incomplete`] and finished by later analyses.
    pub fn set_diff_budget(&self, commits: usize) {
        self.inner.diff_budget.store(commits, Ordering::Relaxed);
    }

    /// Work done so far (cumulative since `open`).
    pub fn stats(&self) -> OverlayStats {
        let c = &self.inner.counters;
        OverlayStats {
            range_computations: c.range_computations.load(Ordering::Relaxed),
            range_cache_hits: c.range_cache_hits.load(Ordering::Relaxed),
            ref_lookups: c.ref_lookups.load(Ordering::Relaxed),
            ref_cache_hits: c.ref_cache_hits.load(Ordering::Relaxed),
            walks: c.walks.load(Ordering::Relaxed),
            commits_walked: c.commits_walked.load(Ordering::Relaxed),
            commits_read: c.commits_read.load(Ordering::Relaxed),
            commits_loaded: c.commits_loaded.load(Ordering::Relaxed),
            commits_diffed: c.commits_diffed.load(Ordering::Relaxed),
            packs_seeded: c.packs_seeded.load(Ordering::Relaxed),
            objects_received: c.objects_received.load(Ordering::Relaxed),
        }
    }

    /// Commits in the in-memory graph and the bytes it holds (approximate).
    pub async fn graph_size(&self) -> (usize, usize) {
        let inner = Arc::clone(&self.inner);
        spawn(move || {
            let state = inner.graph_state();
            Ok((state.graph.len(), state.graph.heap_bytes()))
        })
        .await
        .unwrap_or((0, 0))
    }

    /// The overlay repository, safe to log (no userinfo, no query).
    pub fn repo_display(&self) -> &str {
        &self.inner.shown_repo
    }

    /// The release branch.
    pub fn branch(&self) -> &str {
        &self.inner.branch
    }

    pub fn mirror_dir(&self) -> &Path {
        &self.inner.mirror_dir
    }
}

/// Tells an abandoned fetch to stop when its future goes away, whether it
/// finished, timed out or was cancelled by shutdown.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

async fn spawn<T, F>(work: F) -> Result<T, OverlayError>
where
    F: FnOnce() -> Result<T, OverlayError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|source| OverlayError::Task { source })?
}

fn open_blocking(source: OverlaySource) -> Result<Inner, OverlayError> {
    let url = normalize_repo(&source.repo);
    let shown_repo = display_repo(&url);
    let redactor = Redactor::new(
        &[&source.repo, &url],
        source.token.as_ref().map(ExposeSecret::expose_secret),
    );
    let path = source.mirror_dir;

    let repo = match Repository::open_bare(&path) {
        Ok(repo) => repo,
        Err(open_err) => {
            // Only an absent or empty directory becomes a new mirror: anything
            // else may be someone's data, and is reported rather than reused.
            let fresh = is_absent_or_empty(&path).map_err(|source| OverlayError::MirrorDir {
                path: path.clone(),
                source,
            })?;
            if !fresh {
                return Err(OverlayError::OpenMirror {
                    path,
                    source: redactor.cause(&open_err),
                });
            }
            create_private_dir(&path).map_err(|source| OverlayError::MirrorDir {
                path: path.clone(),
                source,
            })?;
            Repository::init_bare(&path).map_err(|e| OverlayError::InitMirror {
                path: path.clone(),
                source: redactor.cause(&e),
            })?
        }
    };
    ensure_origin(&repo, &url).map_err(|e| OverlayError::ConfigureRemote {
        path: path.clone(),
        repo: shown_repo.clone(),
        source: redactor.cause(&e),
    })?;
    tracing::debug!(repo = %shown_repo, mirror = %path.display(), "Opened overlay mirror.");

    Ok(Inner {
        url,
        shown_repo,
        branch: source.branch,
        mirror_dir: path,
        token: source.token,
        redactor,
        fetch_lock: Mutex::new(()),
        diff_budget: AtomicUsize::new(DEFAULT_DIFF_BUDGET),
        caches: Mutex::new(Caches::default()),
        graph: Mutex::new(GraphState::default()),
        counters: Counters::default(),
    })
}

/// The mirror is this process's alone (its config holds the remote's URL,
/// which may carry userinfo): created 0700, and an existing empty directory
/// made so.
fn create_private_dir(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
}

fn is_absent_or_empty(path: &Path) -> std::io::Result<bool> {
    match std::fs::read_dir(path) {
        Ok(mut entries) => Ok(entries.next().is_none()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(e),
    }
}

/// Makes `origin` point at `url`, so a changed `overlay.repo` takes effect on
/// an existing mirror.
fn ensure_origin(repo: &Repository, url: &str) -> Result<(), git2::Error> {
    match repo.find_remote(REMOTE) {
        Ok(remote) => {
            if remote.url_bytes() != url.as_bytes() {
                repo.remote_set_url(REMOTE, url)?;
            }
            Ok(())
        }
        Err(e) if e.code() == ErrorCode::NotFound => {
            repo.remote_with_fetch(REMOTE, url, HEADS_REFSPEC)?;
            Ok(())
        }
        Err(e) => Err(e),
    }
}

impl Inner {
    fn open_repo(&self) -> Result<Repository, OverlayError> {
        Repository::open_bare(&self.mirror_dir).map_err(|e| OverlayError::OpenMirror {
            path: self.mirror_dir.clone(),
            source: self.redactor.cause(&e),
        })
    }

    fn caches(&self) -> MutexGuard<'_, Caches> {
        // The caches hold only derived data that is valid at every step, so a
        // panic elsewhere while holding the lock leaves nothing half-written.
        self.caches.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn graph_state(&self) -> MutexGuard<'_, GraphState> {
        // Likewise: a node is pushed whole or not at all, and a path mask is
        // written before it is marked known.
        self.graph.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fetch_blocking(&self, stop: &Arc<AtomicBool>) -> Result<Tip, OverlayError> {
        let _fetching = match self.fetch_lock.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                return Err(OverlayError::FetchBusy {
                    repo: self.shown_repo.clone(),
                });
            }
        };
        let local = local_path(&self.url);
        if local.as_ref().is_some_and(|local| !local.exists()) {
            return Err(OverlayError::SourceMissing {
                repo: self.shown_repo.clone(),
            });
        }
        let mut repo = self.open_repo()?;
        if let Some(local) = &local
            && has_no_refs(&repo)
        {
            match seed::seed_packs(local, &self.mirror_dir) {
                Ok(0) => {}
                Ok(packs) => {
                    Counters::add(&self.counters.packs_seeded, packs);
                    tracing::info!(
                        packs,
                        mirror = %self.mirror_dir.display(),
                        "Seeded the new overlay mirror with the source's pack files."
                    );
                    // Opened again so the object database sees them.
                    repo = self.open_repo()?;
                }
                Err(e) => tracing::warn!(
                    error = %e,
                    "cannot seed the overlay mirror from the local source; fetching every object instead"
                ),
            }
        }
        let fetch_err = |e: git2::Error| OverlayError::Fetch {
            repo: self.shown_repo.clone(),
            source: self.redactor.cause(&e),
        };
        let mut remote = repo.find_remote(REMOTE).map_err(fetch_err)?;

        let mut callbacks = RemoteCallbacks::new();
        // Every callback is a chance to stop an abandoned fetch.
        let (stop_transfer, stop_sideband) = (Arc::clone(stop), Arc::clone(stop));
        callbacks.transfer_progress(move |_| !stop_transfer.load(Ordering::Relaxed));
        callbacks.sideband_progress(move |_| !stop_sideband.load(Ordering::Relaxed));
        let token = self.token.clone();
        let configured = self.url.clone();
        let mut attempts = 0u32;
        let stop_auth = Arc::clone(stop);
        callbacks.credentials(move |url, _username, allowed| {
            if stop_auth.load(Ordering::Relaxed) {
                return Err(git2::Error::from_str("the fetch was abandoned"));
            }
            // libgit2 calls this again after every rejected credential, for
            // ever; a second call means the token was refused.
            attempts += 1;
            if attempts > 1 {
                return Err(git2::Error::from_str(
                    "the overlay remote rejected the configured token",
                ));
            }
            if token.is_some()
                && let Err(refusal) = token_may_go_to(&configured, url)
            {
                return Err(git2::Error::from_str(&refusal.to_string()));
            }
            match token.as_ref().map(ExposeSecret::expose_secret) {
                Some(token) if allowed.contains(CredentialType::USER_PASS_PLAINTEXT) => {
                    Cred::userpass_plaintext(TOKEN_USERNAME, token)
                }
                Some(_) => Err(git2::Error::from_str(
                    "the overlay remote asks for an authentication method other than a token",
                )),
                None => Err(git2::Error::from_str(
                    "the overlay remote requires authentication and no token is configured",
                )),
            }
        });
        let mut options = FetchOptions::new();
        options
            .remote_callbacks(callbacks)
            .prune(FetchPrune::On)
            // Tags that point into the fetched history come along, so an
            // annotated tag id reported by an agent resolves to its commit.
            .download_tags(AutotagOption::Auto)
            .update_fetchhead(false)
            // No redirect to another host. libgit2 still follows one to
            // another port or path of the same host, so the credentials
            // callback checks the exact origin as well.
            .follow_redirects(RemoteRedirect::None);

        // The refspec is passed explicitly so a mirror whose config was
        // created by hand (or by `git clone --mirror`) still mirrors heads.
        let fetched = remote.fetch(
            &[HEADS_REFSPEC],
            Some(&mut options),
            Some("fleet-reconciler: fetch"),
        );
        let received = remote.stats().received_objects();
        Counters::add(&self.counters.objects_received, received);
        drop(remote);
        // Objects may have landed even when the fetch failed part-way; any
        // new object can change what a prefix resolves to.
        if fetched.is_err() || received > 0 {
            self.caches().invalidate_resolutions(None);
        }
        fetched.map_err(fetch_err)?;
        self.note_refs(&repo)?;

        let tip = self.branch_tip(&repo)?;
        self.extend_graph(&repo, &tip);
        tracing::debug!(
            repo = %self.shown_repo,
            branch = %tip.branch,
            tip = %tip.commit,
            received_objects = received,
            "Fetched overlay."
        );
        Ok(tip)
    }

    fn branch_tip(&self, repo: &Repository) -> Result<Tip, OverlayError> {
        let refname = format!("refs/heads/{}", self.branch);
        let reference = match repo.find_reference(&refname) {
            Ok(reference) => reference,
            // An invalid branch name cannot exist either.
            Err(e) if matches!(e.code(), ErrorCode::NotFound | ErrorCode::InvalidSpec) => {
                return Err(OverlayError::BranchMissing {
                    branch: self.branch.clone(),
                    repo: self.shown_repo.clone(),
                });
            }
            Err(e) => return Err(self.read_branch_err(&e)),
        };
        let commit = reference
            .peel_to_commit()
            .map_err(|e| self.read_branch_err(&e))?;
        Ok(Tip {
            branch: self.branch.clone(),
            commit: commit_id(commit.id())?,
        })
    }

    fn read_branch_err(&self, e: &git2::Error) -> OverlayError {
        OverlayError::ReadBranch {
            branch: self.branch.clone(),
            path: self.mirror_dir.clone(),
            source: self.redactor.cause(e),
        }
    }

    /// Drops cached resolutions if the refs differ from those they were
    /// made under. Refs are checked rather than trusting our own fetches
    /// alone, because another process (a `check` run) may share the mirror.
    fn note_refs(&self, repo: &Repository) -> Result<(), OverlayError> {
        let fingerprint = refs_fingerprint(repo).map_err(|e| OverlayError::ReadRefs {
            path: self.mirror_dir.clone(),
            source: self.redactor.cause(&e),
        })?;
        let mut caches = self.caches();
        if caches.refs_fingerprint != Some(fingerprint) {
            caches.invalidate_resolutions(Some(fingerprint));
        }
        Ok(())
    }

    fn analyze_blocking(
        &self,
        tip: &CommitId,
        refs: Vec<String>,
        signals: &Signals,
    ) -> Result<HashMap<String, RefAnalysis>, OverlayError> {
        let repo = self.open_repo()?;
        let tip_missing = || OverlayError::TipMissing {
            tip: tip.clone(),
            path: self.mirror_dir.clone(),
        };
        let tip_oid = Oid::from_str(tip.as_str()).map_err(|_| tip_missing())?;
        repo.find_commit(tip_oid).map_err(|_| tip_missing())?;
        self.note_refs(&repo)?;
        let generation = self.caches().generation;

        let mut resolved: Vec<(String, Resolution)> = Vec::with_capacity(refs.len());
        let mut seen: HashSet<String> = HashSet::with_capacity(refs.len());
        {
            let mut state = self.graph_state();
            self.load_saved_graph(&mut state);
            for reference in refs {
                if seen.contains(&reference) {
                    continue;
                }
                let resolution = self.resolve(&repo, &state.graph, &reference, generation)?;
                seen.insert(reference.clone());
                resolved.push((reference, resolution));
            }
        }

        // Ranges from the cache; every other distinct commit in one walk.
        let fingerprint = signals.fingerprint();
        let mut ranges: HashMap<Oid, Arc<DriftRange>> = HashMap::new();
        let mut uncached: Vec<Oid> = Vec::new();
        {
            let mut caches = self.caches();
            if caches.ranges_signals != fingerprint {
                caches.ranges.clear();
                caches.ranges_signals = fingerprint;
            }
            for (_, resolution) in &resolved {
                let Resolution::Commit(oid) = *resolution else {
                    continue;
                };
                if oid == tip_oid || ranges.contains_key(&oid) || uncached.contains(&oid) {
                    continue;
                }
                match caches.ranges.get(&(tip_oid, oid)) {
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
            let measured = self.measure(&repo, tip_oid, &uncached, signals)?;
            let mut caches = self.caches();
            // A concurrent analysis under other signals owns the cache now.
            if caches.ranges_signals == fingerprint {
                if caches.ranges.len() + measured.len() > MAX_CACHED_RANGES {
                    caches.ranges.clear();
                }
                // An incomplete range is measured again (and finished) later.
                for (oid, range) in measured.iter().filter(|(_, r)| !r.paths_incomplete) {
                    caches.ranges.insert((tip_oid, *oid), Arc::clone(range));
                }
            }
            ranges.extend(measured);
        }

        let mut out = HashMap::with_capacity(resolved.len());
        for (reference, resolution) in resolved {
            let analysis = match resolution {
                Resolution::Unknown => RefAnalysis::Unknown,
                Resolution::Ambiguous => RefAnalysis::Ambiguous,
                Resolution::Commit(oid) if oid == tip_oid => RefAnalysis::OnTip {
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
            if caches.resolutions.len() >= MAX_CACHED_RESOLUTIONS {
                caches.resolutions.clear();
            }
            caches.resolutions.insert(reference.to_owned(), resolution);
        }
        Ok(resolution)
    }

    /// Measures `targets` (distinct, none the tip) against `tip` in one walk
    /// per [`MAX_WALK_TARGETS`], reading into the graph only the commits it
    /// does not have yet and diffing only commits never diffed before.
    fn measure(
        &self,
        repo: &Repository,
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

        let odb = repo.odb().map_err(|e| self.read_err(tip, &e))?;
        let before = graph.len();
        let mut read = |oid: Oid| facts::read_commit(&odb, oid).map_err(|e| (oid, e));
        let tip_node = self.ensure_node(graph, tip, &mut read)?;
        let nodes = targets
            .iter()
            .map(|t| self.ensure_node(graph, *t, &mut read))
            .collect::<Result<Vec<Node>, OverlayError>>()?;
        Counters::add(&self.counters.commits_read, graph.len() - before);

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
        let prefixes = signals.prefixes();
        let mut diffs_left = self.diff_budget.load(Ordering::Relaxed);
        // One bit past the signals marks a commit whose path facts are not
        // known yet (the budget ran out): a range carrying it is incomplete.
        let incomplete_bit = signals.len();
        let mask_words = if signals.has_paths() {
            (incomplete_bit + 1).div_ceil(64)
        } else {
            words
        };
        let mut out = Vec::with_capacity(targets.len());
        // Evidence details once per (commit, signal) in this analysis: many
        // ranges name the same evidence commit.
        let mut details: HashMap<(Oid, SignalId), EvidenceDetail> = HashMap::new();
        for (oids, nodes) in targets
            .chunks(MAX_WALK_TARGETS)
            .zip(nodes.chunks(MAX_WALK_TARGETS))
        {
            let walk = graph.walk(tip_node, nodes);
            Counters::add(&self.counters.walks, 1);
            Counters::add(&self.counters.commits_walked, walk.visited);

            // The signal masks of the commits some target lacks; path facts
            // are computed once per commit, ever, and kept in the graph.
            let mut offsets: FastMap<Node, usize> = FastMap::default();
            let mut masks: Vec<u64> = Vec::new();
            if words > 0 {
                // Newest first: the commits most machines lack get their
                // facts before a budget runs out.
                let behind: Vec<Node> = walk.behind_nodes().collect();
                let mut mask = vec![0u64; mask_words];
                for node in behind {
                    mask.fill(0);
                    graph.trailer_mask(node, &table, words, &mut mask[..words]);
                    if signals.has_paths() {
                        let paths = match graph.path_mask(node) {
                            Some(known) => known.to_vec(),
                            None if diffs_left == 0 => {
                                mask[incomplete_bit / 64] |= 1 << (incomplete_bit % 64);
                                Vec::new()
                            }
                            None => {
                                diffs_left -= 1;
                                let oid = graph.oid(node);
                                let computed = facts::path_mask(repo, oid, signals, &prefixes)
                                    .map_err(|e| OverlayError::Diff {
                                        commit: oid.to_string(),
                                        path: self.mirror_dir.clone(),
                                        source: self.redactor.cause(&e),
                                    })?;
                                graph.set_path_mask(node, &computed);
                                Counters::add(&self.counters.commits_diffed, 1);
                                computed
                            }
                        };
                        for (m, p) in mask.iter_mut().zip(&paths) {
                            *m |= p;
                        }
                    }
                    if mask.iter().any(|w| *w != 0) {
                        offsets.insert(node, masks.len());
                        masks.extend_from_slice(&mask);
                    }
                }
            }
            let none = vec![0u64; mask_words];
            let tallies = graph.tally(&walk, mask_words, MAX_SHOWN_MISSING, |node| {
                match offsets.get(&node) {
                    Some(at) => &masks[*at..*at + mask_words],
                    None => &none,
                }
            });
            for (oid, tally) in oids.iter().zip(tallies) {
                let mut evidence = BTreeMap::new();
                let mut evidence_detail = BTreeMap::new();
                let mut paths_incomplete = false;
                for (signal, carrier) in tally.evidence.iter().enumerate() {
                    match carrier {
                        Some(_) if signal == incomplete_bit && signals.has_paths() => {
                            paths_incomplete = true;
                        }
                        Some(node) => {
                            let carrier = graph.oid(*node);
                            let id = SignalId(signal);
                            evidence.insert(id, commit_id(carrier)?);
                            let detail = match details.get(&(carrier, id)) {
                                Some(known) => known.clone(),
                                None => {
                                    let found =
                                        self.evidence_detail(repo, &odb, carrier, id, signals)?;
                                    details.insert((carrier, id), found.clone());
                                    found
                                }
                            };
                            evidence_detail.insert(id, detail);
                        }
                        None => {}
                    }
                }
                let newest = tally
                    .newest
                    .iter()
                    .map(|node| self.shown_commit(&odb, graph.oid(*node)))
                    .collect::<Result<Vec<_>, OverlayError>>()?;
                let range = DriftRange {
                    behind: tally.behind,
                    ahead: tally.ahead,
                    evidence,
                    paths_incomplete,
                    newest,
                    evidence_detail,
                };
                out.push((*oid, Arc::new(range)));
            }
        }
        self.save_graph(graph);
        Ok(out)
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
        if caches.texts.len() >= MAX_CACHED_TEXTS {
            caches.texts.clear();
        }
        caches.texts.insert(oid, Arc::clone(&text));
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
        if caches.shown.len() >= MAX_CACHED_TEXTS {
            caches.shown.clear();
        }
        caches.shown.insert(oid, Arc::clone(&shown));
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

    /// Reads into the graph the commits a fetch brought (and saves it), so
    /// the next analysis starts with them — a new mirror's first fetch pays
    /// for reading the history, not the first sweep. Best effort: a commit
    /// that cannot be read fails the analysis that needs it, with its error.
    fn extend_graph(&self, repo: &Repository, tip: &Tip) {
        let Ok(oid) = Oid::from_str(tip.commit.as_str()) else {
            return;
        };
        let mut state = self.graph_state();
        self.load_saved_graph(&mut state);
        let graph = &mut state.graph;
        if graph.node(&oid).is_some() {
            return;
        }
        let Ok(odb) = repo.odb() else { return };
        let before = graph.len();
        let mut read = |oid: Oid| facts::read_commit(&odb, oid).map_err(|e| (oid, e));
        if let Err(e) = self.ensure_node(graph, oid, &mut read) {
            tracing::debug!(error = %e, "cannot read the fetched history yet");
        }
        Counters::add(&self.counters.commits_read, graph.len() - before);
        self.save_graph(graph);
    }

    fn ensure_node(
        &self,
        graph: &mut Graph,
        oid: Oid,
        read: &mut impl FnMut(Oid) -> Result<graph::RawCommit, (Oid, facts::ReadError)>,
    ) -> Result<Node, OverlayError> {
        graph.ensure(oid, read).map_err(|e| match e {
            LoadError::Read((oid, facts::ReadError::Git(e))) => self.read_err(oid, &e),
            LoadError::Read((oid, facts::ReadError::Malformed))
            | LoadError::Inconsistent { commit: oid } => OverlayError::MalformedCommit {
                commit: oid.to_string(),
                path: self.mirror_dir.clone(),
            },
            LoadError::TooLarge => OverlayError::HistoryTooLarge {
                path: self.mirror_dir.clone(),
            },
        })
    }

    fn read_err(&self, oid: Oid, e: &git2::Error) -> OverlayError {
        OverlayError::ReadCommit {
            commit: oid.to_string(),
            path: self.mirror_dir.clone(),
            source: self.redactor.cause(e),
        }
    }

    /// Starts from the graph a previous process saved, once; a missing or
    /// damaged file only means reading the history again.
    fn load_saved_graph(&self, state: &mut GraphState) {
        if state.loaded {
            return;
        }
        state.loaded = true;
        let path = store::path_in(&self.mirror_dir);
        match store::load(&path) {
            Ok(graph) => {
                Counters::add(&self.counters.commits_loaded, graph.len());
                tracing::debug!(commits = graph.len(), file = %path.display(), "Loaded saved commit graph.");
                state.graph = graph;
            }
            Err(store::LoadFailure::Missing) => {}
            Err(store::LoadFailure::Io(e)) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot read the saved commit graph; reading the history instead");
            }
            Err(store::LoadFailure::Damaged) => {
                tracing::warn!(file = %path.display(), "saved commit graph is damaged; reading the history instead");
            }
        }
    }

    /// Saves the graph if it changed; failing to is only a slower next start.
    fn save_graph(&self, graph: &mut Graph) {
        if !graph.is_dirty() {
            return;
        }
        let path = store::path_in(&self.mirror_dir);
        match store::save(&path, graph) {
            Ok(()) => graph.mark_clean(),
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot save the commit graph; the next start reads the history again");
            }
        }
    }
}

fn commit_id(oid: Oid) -> Result<CommitId, OverlayError> {
    let id = oid.to_string();
    CommitId::parse(&id).ok_or(OverlayError::ObjectFormat { id })
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

/// A mirror that has never been fetched into (or was emptied).
fn has_no_refs(repo: &Repository) -> bool {
    repo.references()
        .map(|mut refs| refs.next().is_none())
        .unwrap_or(false)
}

fn refs_fingerprint(repo: &Repository) -> Result<u64, git2::Error> {
    let mut hasher = DefaultHasher::new();
    let mut count = 0u64;
    for reference in repo.references()? {
        let reference = reference?;
        reference.name_bytes().hash(&mut hasher);
        reference.target().hash(&mut hasher);
        reference.symbolic_target_bytes().hash(&mut hasher);
        count += 1;
    }
    count.hash(&mut hasher);
    Ok(hasher.finish())
}

/// Why the token is not sent where libgit2 asks for credentials.
#[derive(Debug, PartialEq, Eq)]
enum TokenRefusal {
    /// The request goes to another scheme, host or port than configured.
    OtherServer { asked: String, configured: String },
    /// Plain `http` to a host off this machine would carry it in clear text.
    PlainHttp { host: String },
}

impl fmt::Display for TokenRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenRefusal::OtherServer { asked, configured } => write!(
                f,
                "the overlay remote redirected to {asked}, which asks for credentials; the token goes only to the configured remote {configured}"
            ),
            TokenRefusal::PlainHttp { host } => write!(
                f,
                "the overlay remote {host} asks for the token over plain http; use https (plain http is allowed only to loopback)"
            ),
        }
    }
}

/// The token goes only to the configured remote's own scheme, host and
/// port, and only over https (or plain http to loopback, for a local git
/// server). `asked` is the URL libgit2 is about to authenticate to.
fn token_may_go_to(configured: &str, asked: &str) -> Result<(), TokenRefusal> {
    let origin = |u: &str| {
        url::Url::parse(u).ok().and_then(|u| {
            let host = u.host()?.to_owned();
            Some((u.scheme().to_owned(), host, u.port_or_known_default()))
        })
    };
    let shown = |o: &Option<(String, url::Host, Option<u16>)>, raw: &str| match o {
        Some((scheme, host, Some(port))) => format!("{scheme}://{host}:{port}"),
        Some((scheme, host, None)) => format!("{scheme}://{host}"),
        None => display_repo(raw),
    };
    let (want, got) = (origin(configured), origin(asked));
    if want.is_none() || want != got {
        return Err(TokenRefusal::OtherServer {
            asked: shown(&got, asked),
            configured: shown(&want, configured),
        });
    }
    match got {
        Some((scheme, host, _)) if scheme == "http" && !crate::http::is_loopback(&host) => {
            Err(TokenRefusal::PlainHttp {
                host: host.to_string(),
            })
        }
        _ => Ok(()),
    }
}

fn is_url(repo: &str) -> bool {
    repo.contains("://")
}

/// `user@host:path` (scp-like ssh syntax): a colon before any slash.
fn is_scp_like(repo: &str) -> bool {
    match (repo.find(':'), repo.find('/')) {
        (Some(colon), Some(slash)) => colon < slash && colon > 0,
        (Some(colon), None) => colon > 0,
        _ => false,
    }
}

/// A relative local path is made absolute, so the mirror's `origin` does not
/// depend on the daemon's working directory; URLs are kept as written.
fn normalize_repo(repo: &str) -> String {
    if is_url(repo) || is_scp_like(repo) {
        return repo.to_owned();
    }
    match std::path::absolute(repo) {
        Ok(path) => path.to_str().map_or_else(|| repo.to_owned(), str::to_owned),
        Err(_) => repo.to_owned(),
    }
}

/// The filesystem path behind a local remote, if it is one.
fn local_path(url: &str) -> Option<PathBuf> {
    if url.starts_with("file://") {
        return url::Url::parse(url).ok()?.to_file_path().ok();
    }
    (!is_url(url) && !is_scp_like(url)).then(|| PathBuf::from(url))
}

/// The repository as it may appear in logs and errors: no userinfo (which
/// may be a token), no query or fragment.
fn display_repo(repo: &str) -> String {
    if is_url(repo) {
        if let Some(mut url) = url::Url::parse(repo).ok().filter(|u| !u.cannot_be_a_base()) {
            // Both setters only fail for URLs without a host, and those
            // (`file:///…`) carry no userinfo to hide.
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url.set_query(None);
            url.set_fragment(None);
            return url.to_string();
        }
        // Unparseable: hide whatever sits between the scheme and an `@`.
        return match (repo.find("://"), repo.rfind('@')) {
            (Some(scheme_end), Some(at)) if at > scheme_end => {
                format!("{}{REDACTED}{}", &repo[..scheme_end + 3], &repo[at..])
            }
            _ => repo.to_owned(),
        };
    }
    match repo.find('@') {
        // `user:password@host:path`
        Some(at) if is_scp_like(repo) && repo[..at].contains(':') => {
            format!("{REDACTED}{}", &repo[at..])
        }
        _ => repo.to_owned(),
    }
}

/// The (username, password) written into a URL or scp-like remote, found
/// by hand so that a URL the `url` crate rejects still has its secrets known.
fn userinfo(repo: &str) -> Option<(&str, Option<&str>)> {
    let userinfo = match repo.find("://") {
        Some(scheme_end) => {
            let rest = &repo[scheme_end + 3..];
            let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
            &authority[..authority.rfind('@')?]
        }
        None if is_scp_like(repo) => &repo[..repo.find('@')?],
        None => return None,
    };
    Some(match userinfo.split_once(':') {
        Some((username, password)) => (username, Some(password)),
        None => (userinfo, None),
    })
}

/// Removes secrets from text that libgit2 produced (it may quote the URL).
struct Redactor {
    /// (needle, replacement), longest needle first so a URL is replaced
    /// before the password inside it.
    replacements: Vec<(String, String)>,
}

impl Redactor {
    fn new(repos: &[&str], token: Option<&str>) -> Redactor {
        let mut replacements: Vec<(String, String)> = Vec::new();
        let mut secret = |s: &str| {
            if !s.is_empty() {
                replacements.push((s.to_owned(), REDACTED.to_owned()));
                let decoded = percent_decode(s);
                if decoded != s {
                    replacements.push((decoded, REDACTED.to_owned()));
                }
            }
        };
        if let Some(token) = token {
            secret(token);
        }
        for repo in repos {
            if let Some((username, password)) = userinfo(repo) {
                if let Some(password) = password {
                    secret(password);
                }
                // A token is often given as the username alone
                // (`https://TOKEN@host/…`); short names like `git` are not.
                if username.len() >= 8 {
                    secret(username);
                }
            }
        }
        for repo in repos {
            let shown = display_repo(repo);
            if shown != *repo {
                replacements.push(((*repo).to_owned(), shown));
            }
        }
        replacements.sort_by_key(|(needle, _)| std::cmp::Reverse(needle.len()));
        Redactor { replacements }
    }

    fn redact(&self, text: &str) -> String {
        let mut text = text.to_owned();
        for (needle, replacement) in &self.replacements {
            if text.contains(needle.as_str()) {
                text = text.replace(needle.as_str(), replacement);
            }
        }
        text
    }

    fn cause(&self, e: &git2::Error) -> GitCause {
        GitCause {
            code: e.code(),
            class: e.class(),
            message: self.redact(e.message()),
        }
    }
}

/// `%40` → `@`: libgit2 may print the decoded form of a URL's password.
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_of_source_hides_token_and_password() {
        let source = OverlaySource {
            repo: "https://user:hunter2pw@example.com/acme/overlay.git".into(),
            branch: "release".into(),
            mirror_dir: PathBuf::from("/data/overlay.git"),
            token: Some("ghp_secret_token".into()),
        };
        let shown = format!("{source:?}");
        assert!(!shown.contains("ghp_secret_token"), "{shown}");
        assert!(!shown.contains("hunter2pw"), "{shown}");
        assert!(shown.contains("example.com/acme/overlay.git"), "{shown}");
    }

    #[test]
    fn the_token_goes_only_to_the_configured_origin_over_https() {
        let ok = |configured: &str, asked: &str| token_may_go_to(configured, asked).is_ok();
        assert!(ok(
            "https://git.example.com/org/overlay.git",
            "https://git.example.com/org/overlay.git/info/refs?service=git-upload-pack"
        ));
        assert!(ok(
            "https://git.example.com/o.git",
            "https://GIT.example.com:443/o.git"
        ));
        assert!(ok("http://127.0.0.1:9418/o.git", "http://127.0.0.1:9418/o"));
        assert!(ok("http://localhost:80/o.git", "http://localhost/o.git"));
        assert!(ok("http://[::1]:8080/o.git", "http://[::1]:8080/x"));
        // Another host, port or scheme: a redirect.
        assert!(!ok(
            "https://git.example.com/o.git",
            "https://evil.example/o.git"
        ));
        assert!(!ok(
            "https://git.example.com/o.git",
            "https://git.example.com:8443/o.git"
        ));
        assert!(!ok(
            "https://git.example.com/o.git",
            "http://git.example.com/o.git"
        ));
        assert!(!ok("http://127.0.0.1:1/o.git", "http://127.0.0.1:2/o.git"));
        assert!(!ok("https://git.example.com/o.git", "not a url"));
        // Plain http off this machine: never, even to the configured host.
        assert_eq!(
            token_may_go_to(
                "http://git.example.com/o.git",
                "http://git.example.com/o.git"
            ),
            Err(TokenRefusal::PlainHttp {
                host: "git.example.com".into()
            })
        );
    }

    #[test]
    fn display_repo_strips_userinfo_and_query() {
        assert_eq!(
            display_repo("https://x-access-token:abc123@github.com/acme/o.git?t=1"),
            "https://github.com/acme/o.git"
        );
        assert_eq!(
            display_repo("https://ghp_abcdefgh@github.com/acme/o.git"),
            "https://github.com/acme/o.git"
        );
        assert_eq!(
            display_repo("user:pw@host:acme/o.git"),
            "[redacted]@host:acme/o.git"
        );
        assert_eq!(display_repo("git@host:acme/o.git"), "git@host:acme/o.git");
        assert_eq!(display_repo("/srv/overlay"), "/srv/overlay");
        assert_eq!(display_repo("file:///srv/overlay"), "file:///srv/overlay");
    }

    #[test]
    fn redactor_removes_token_password_and_raw_url() {
        let raw = "https://bob:p%40ss%2Fword@example.com/o.git";
        let redactor = Redactor::new(&[raw], Some("tok-123456"));
        let text = format!("failed {raw} with p@ss/word and tok-123456 and p%40ss%2Fword");
        let clean = redactor.redact(&text);
        assert!(!clean.contains("p@ss/word"), "{clean}");
        assert!(!clean.contains("p%40ss%2Fword"), "{clean}");
        assert!(!clean.contains("tok-123456"), "{clean}");
        assert!(clean.contains("https://example.com/o.git"), "{clean}");
    }

    #[test]
    fn redactor_finds_secrets_in_urls_the_url_crate_rejects() {
        let raw = "https://bob:SECRET-pw@127.0.0.1:99999/o.git";
        let redactor = Redactor::new(&[raw], None);
        let clean = redactor.redact("malformed URL 'bob:SECRET-pw@127.0.0.1:99999'");
        assert!(!clean.contains("SECRET"), "{clean}");
        let scp = Redactor::new(&["deploy:SECRET-pw@host:acme/o.git"], None);
        assert!(!scp.redact("auth SECRET-pw failed").contains("SECRET"));
        let user_token = Redactor::new(&["https://ghp_SECRETTOKEN@github.com/o.git"], None);
        assert!(!user_token.redact("user ghp_SECRETTOKEN").contains("SECRET"));
        assert_eq!(userinfo("https://github.com/a@b/o.git"), None);
        assert_eq!(userinfo("/srv/o"), None);
    }

    #[test]
    fn normalize_repo_makes_relative_paths_absolute_and_keeps_urls() {
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(
            normalize_repo("fixtures/overlay"),
            cwd.join("fixtures/overlay").to_str().expect("utf-8 cwd")
        );
        assert_eq!(normalize_repo("/srv/overlay"), "/srv/overlay");
        for url in [
            "https://github.com/acme/o.git",
            "file:///srv/overlay",
            "git@github.com:acme/o.git",
        ] {
            assert_eq!(normalize_repo(url), url);
        }
    }

    #[test]
    fn local_path_recognises_paths_and_file_urls_only() {
        assert_eq!(local_path("/srv/o"), Some(PathBuf::from("/srv/o")));
        assert_eq!(local_path("file:///srv/o"), Some(PathBuf::from("/srv/o")));
        assert_eq!(local_path("https://h/o.git"), None);
        assert_eq!(local_path("git@h:o.git"), None);
    }

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

    #[test]
    fn error_kinds_are_bounded_labels() {
        let e = OverlayError::BranchMissing {
            branch: "release".into(),
            repo: "/srv/o".into(),
        };
        assert_eq!(e.kind(), "branch_missing");
        assert_eq!(
            e.to_string(),
            "branch release not found in overlay repository /srv/o"
        );
    }
}

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
//!
//! Layout: this file holds the handle ([`Overlay`]: open, tip, the mirror's
//! caches, counters and saved graph) and the public types; `remote` the
//! source's URL and token rules (pure text); `fetch` the fetch (network,
//! credentials, deadline); `analysis` the pass from reported refs to drift
//! ranges, over `graph` (the commit graph and its walk), `facts` (what one
//! commit carries), `signals` (what the caller asks about) and `store` (the
//! saved graph); `seed` fills a new mirror from a local source's packs.

mod analysis;
mod facts;
mod fetch;
mod graph;
mod remote;
mod seed;
mod signals;
mod store;

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use git2::{ErrorCode, Oid, Repository};
use secrecy::{ExposeSecret, SecretString};

use crate::config::DEFAULT_DIFF_BUDGET;
use crate::model::{CommitId, MissingCommit};
use crate::observe::DurationObserver;
use analysis::Resolution;
use fetch::{REMOTE, ensure_origin};
use graph::{Graph, LoadError, Node};
pub use remote::OverlaySource;
use remote::{Redactor, display_repo, normalize_repo};
pub use signals::{SignalId, Signals};

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

/// What kind of overlay failure an [`OverlayError`] is: its snake-case name
/// is the bounded label metrics and the CLI's error object carry. Every way
/// a fetch fails (timed out, busy, its thread lost) is `fetch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::IntoStaticStr, strum::Display)]
#[strum(serialize_all = "snake_case")]
pub enum OverlayErrorKind {
    MirrorDir,
    InitMirror,
    OpenMirror,
    ConfigureRemote,
    SourceMissing,
    Fetch,
    BranchMissing,
    ReadBranch,
    ReadRefs,
    TipMissing,
    Resolve,
    ReadCommit,
    MalformedCommit,
    HistoryTooLarge,
    Diff,
    ObjectFormat,
    Task,
}

impl OverlayError {
    /// Which kind of failure this is.
    pub fn error_kind(&self) -> OverlayErrorKind {
        use OverlayErrorKind as K;
        match self {
            OverlayError::MirrorDir { .. } => K::MirrorDir,
            OverlayError::InitMirror { .. } => K::InitMirror,
            OverlayError::OpenMirror { .. } => K::OpenMirror,
            OverlayError::ConfigureRemote { .. } => K::ConfigureRemote,
            OverlayError::SourceMissing { .. } => K::SourceMissing,
            OverlayError::Fetch { .. } => K::Fetch,
            OverlayError::BranchMissing { .. } => K::BranchMissing,
            OverlayError::ReadBranch { .. } => K::ReadBranch,
            OverlayError::ReadRefs { .. } => K::ReadRefs,
            OverlayError::TipMissing { .. } => K::TipMissing,
            OverlayError::Resolve { .. } => K::Resolve,
            OverlayError::ReadCommit { .. } => K::ReadCommit,
            OverlayError::MalformedCommit { .. } => K::MalformedCommit,
            OverlayError::HistoryTooLarge { .. } => K::HistoryTooLarge,
            OverlayError::Diff { .. } => K::Diff,
            OverlayError::ObjectFormat { .. } => K::ObjectFormat,
            OverlayError::FetchTimedOut { .. }
            | OverlayError::FetchBusy { .. }
            | OverlayError::FetchThread { .. }
            | OverlayError::FetchLost => K::Fetch,
            OverlayError::Task { .. } => K::Task,
        }
    }

    /// A bounded label for metrics (`kind="fetch"`), never a `Debug` string.
    pub fn kind(&self) -> &'static str {
        self.error_kind().into()
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // Every way a fetch fails is labelled `fetch`, as before the kinds were typed.
        assert_eq!(
            OverlayError::FetchLost.error_kind(),
            OverlayErrorKind::Fetch
        );
        assert_eq!(OverlayError::FetchLost.kind(), "fetch");
        assert_eq!(
            OverlayErrorKind::HistoryTooLarge.to_string(),
            "history_too_large"
        );
    }
}

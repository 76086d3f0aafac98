//! The fetch: brings the remote's branches into the mirror, with the token
//! sent only where [`super::remote`]'s rules allow, within a deadline, and
//! never two at once.
//!
//! It writes only the mirror (refs and objects; a new mirror from a local
//! source is first seeded with its pack files) and leaves the analysis to
//! `analysis`: what a fetch changes there is only which cached resolutions
//! still hold, and the commits read into the graph ahead of the next sweep.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use git2::{
    AutotagOption, Cred, CredentialType, ErrorCode, FetchOptions, FetchPrune, RemoteCallbacks,
    RemoteRedirect, Repository,
};
use secrecy::ExposeSecret;

use super::remote::{local_path, token_may_go_to};
use super::{Counters, Inner, Overlay, OverlayError, Tip, seed};
use crate::config::DEFAULT_FETCH_TIMEOUT;

/// The remote the mirror fetches from.
pub(super) const REMOTE: &str = "origin";

/// Mirror every branch under its own name, so a ref from a canary or feature
/// branch resolves (and is reported as diverged) instead of being unknown.
pub(super) const HEADS_REFSPEC: &str = "+refs/heads/*:refs/heads/*";

/// Username GitHub-style token auth expects alongside the token.
const TOKEN_USERNAME: &str = "x-access-token";

impl Overlay {
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
}

/// Tells an abandoned fetch to stop when its future goes away, whether it
/// finished, timed out or was cancelled by shutdown.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Makes `origin` point at `url`, so a changed `overlay.repo` takes effect on
/// an existing mirror.
pub(super) fn ensure_origin(repo: &Repository, url: &str) -> Result<(), git2::Error> {
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
    pub(super) fn fetch_blocking(&self, stop: &Arc<AtomicBool>) -> Result<Tip, OverlayError> {
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

        let mut options = self.fetch_options(stop);

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

    /// How the fetch runs: it stops when `stop` is set, sends the token only
    /// where [`token_may_go_to`] allows and only once, prunes deleted
    /// branches, brings tags along and follows no redirect to another host.
    fn fetch_options(&self, stop: &Arc<AtomicBool>) -> FetchOptions<'static> {
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
        options
    }
}

/// A mirror that has never been fetched into (or was emptied).
fn has_no_refs(repo: &Repository) -> bool {
    repo.references()
        .map(|mut refs| refs.next().is_none())
        .unwrap_or(false)
}

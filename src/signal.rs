//! Stopping on a signal: SIGTERM (what `docker stop`, systemd and Fly's
//! default send) or ctrl-c (SIGINT, fly.toml's `kill_signal`) cancels a
//! token, so the process winds down and runs its destructors (the demo's
//! temporary directory is removed). It must never exit the process itself.

use tokio_util::sync::CancellationToken;

/// Waits for SIGTERM or ctrl-c, then cancels `shutdown`. Meant to be
/// spawned; returns once it has cancelled.
pub async fn cancel_on_signal(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; ctrl-c still stops");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("signal received: finishing the current step, then stopping");
    shutdown.cancel();
}

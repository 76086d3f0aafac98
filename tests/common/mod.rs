//! Helpers shared by the integration tests: a real overlay repository with
//! the demo's history, and polling with a deadline.
//!
//! Each test crate includes this module and uses only part of it, hence the
//! `dead_code` allowance (scoped to this module, not the crates).
#![allow(dead_code)]

pub mod exposition;

use std::path::PathBuf;
use std::time::Duration;

use fleet_reconciler::demo::{DemoHistory, DemoRepo};

/// A bare overlay repository in a temp dir, holding the demo history.
pub struct OverlayRepo {
    pub dir: tempfile::TempDir,
    pub repo_path: PathBuf,
    pub history: DemoHistory,
}

impl OverlayRepo {
    pub fn new() -> OverlayRepo {
        let dir = tempfile::tempdir().unwrap();
        let repo_path = dir.path().join("overlay.git");
        let history = DemoRepo::create(&repo_path)
            .unwrap()
            .build_history()
            .unwrap();
        OverlayRepo {
            dir,
            repo_path,
            history,
        }
    }

    /// The release tip (full hex).
    pub fn tip(&self) -> String {
        self.history.release.last().unwrap().to_string()
    }

    /// The release commit `n` commits behind the tip.
    pub fn behind(&self, n: usize) -> String {
        let r = &self.history.release;
        r[r.len() - 1 - n].to_string()
    }
}

/// Polls `f` every 25 ms until it holds; fails the test after `deadline`.
pub async fn until(what: &str, deadline: Duration, mut f: impl FnMut() -> bool) {
    let start = tokio::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

//! Names the commit the binary is built from, for `fleet-reconciler --version`.
//!
//! `FLEET_RECONCILER_COMMIT` wins (the release workflow and the Dockerfile
//! pass it: a Docker build context has no `.git`); else `git rev-parse HEAD`
//! of the checkout; else `unknown` (a source tarball, no git). It must never fail the build.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    Some(text.trim().to_string()).filter(|t| !t.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=FLEET_RECONCILER_COMMIT");
    let commit = match std::env::var("FLEET_RECONCILER_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => from_git().unwrap_or_else(|| "unknown".to_string()),
    };
    println!("cargo:rustc-env=FLEET_RECONCILER_COMMIT={commit}");
}

fn from_git() -> Option<String> {
    let head = git(&["rev-parse", "HEAD"])?;
    // Rebuild when HEAD moves: HEAD itself (a checkout), the branch it
    // names (a commit) and packed-refs (a gc). Worktrees keep HEAD apart
    // from the refs; --git-path resolves both.
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&["rev-parse", "--git-path", &branch]));
    }
    watched.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    for path in watched.into_iter().flatten() {
        let path = PathBuf::from(path);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    Some(head)
}

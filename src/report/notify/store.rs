//! The alert state file: what each webhook was told, what it has not been
//! delivered yet, and what was dead-lettered, persisted across restarts.
//!
//! Owns the on-disk format (versioned JSON), the atomic write (temp file in
//! the same directory, fsync, rename, fsync of the directory) and what to do
//! with a file that cannot be used (move it aside, warn naming both paths,
//! start empty). It must never hold a secret: webhooks are identified by
//! format and the *name* of their URL variable, and notifications carry no
//! URL, routing key or HMAC secret (see `format`).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::Notification;
use crate::decide::alerts::Alert;
use crate::events::DedupKey;
use crate::model::Severity;

/// `kind` of the file: refuses to read some other JSON document as state.
pub const STATE_KIND: &str = "fleet-reconciler/alert-state";
/// Version of the state file; a file of another version is moved aside.
pub const STATE_VERSION: u32 = 1;

/// The whole file.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct StateFile {
    pub kind: String,
    pub version: u32,
    pub saved_at: DateTime<Utc>,
    /// Every alert that held at the last `update`.
    pub alerts: Vec<Alert>,
    pub sinks: Vec<SavedSink>,
    /// `[[alerts.alertmanager]]` (none in files from before that sink).
    #[serde(default)]
    pub alertmanagers: Vec<super::alertmanager::SavedAm>,
}

/// One webhook's state, matched to the config by `format` and `url_env`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct SavedSink {
    pub format: String,
    pub url_env: String,
    pub firing: BTreeMap<DedupKey, SavedTracked>,
    #[serde(default)]
    pub open_failures: BTreeSet<DedupKey>,
    #[serde(default)]
    pub queue: Vec<Notification>,
    #[serde(default)]
    pub dead_letters: Vec<DeadLetter>,
    #[serde(default)]
    pub failing: Option<Failing>,
    #[serde(default)]
    pub consecutive_failures: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct SavedTracked {
    pub alert: Alert,
    pub notified_severity: Severity,
    /// The group's machines as last notified (none in files from before grouping).
    #[serde(default)]
    pub members: BTreeSet<String>,
    pub last_notified: DateTime<Utc>,
    #[serde(default)]
    pub dead_lettered: bool,
}

/// A notification set aside because its webhook could not take it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct DeadLetter {
    pub notification: Notification,
    /// Why the last attempt failed (`HTTP 404`, `connection failed: …`; never a URL).
    pub error: String,
    pub at: DateTime<Utc>,
}

/// Why and since when a webhook dead-letters what it is sent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Failing {
    pub since: DateTime<Utc>,
    pub reason: String,
}

/// Where the state goes, and whether it has changed since the last write.
pub(super) struct Store {
    pub path: PathBuf,
    pub dirty: AtomicBool,
    pub wake: tokio::sync::Notify,
    /// Serializes snapshot + write, so files are written in snapshot order.
    pub save_lock: Mutex<()>,
    /// Writes that failed since start.
    pub write_failures: AtomicU64,
    /// The last write failed (one ERROR per episode).
    pub failing: AtomicBool,
}

impl Store {
    pub fn new(path: PathBuf) -> Store {
        Store {
            path,
            dirty: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
            save_lock: Mutex::new(()),
            write_failures: AtomicU64::new(0),
            failing: AtomicBool::new(false),
        }
    }

    /// Reads the state file. A missing file is a first start; a file that
    /// cannot be read, parsed or is of another version is moved aside (with
    /// a WARN naming both paths) and the notifier starts with empty state.
    pub fn load(&self) -> Option<StateFile> {
        let path = &self.path;
        let text = match fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                tracing::info!(path = %path.display(), "no alert state file yet: starting with empty alert state");
                return None;
            }
            Err(e) => {
                self.move_aside(&format!("cannot be read: {e}"));
                return None;
            }
        };
        match parse(&text) {
            Ok(file) => {
                tracing::info!(
                    path = %path.display(),
                    saved_at = %file.saved_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    alerts = file.alerts.len(),
                    queued = file.sinks.iter().map(|s| s.queue.len()).sum::<usize>(),
                    dead_letters = file.sinks.iter().map(|s| s.dead_letters.len()).sum::<usize>(),
                    "alert state restored"
                );
                Some(file)
            }
            Err(problem) => {
                self.move_aside(&problem);
                None
            }
        }
    }

    /// Renames the unusable file to `<name>.corrupt-<UTC time>` beside it.
    fn move_aside(&self, problem: &str) {
        let path = &self.path;
        let stamp = Utc::now().format("%Y%m%dT%H%M%SZ");
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| crate::config::DEFAULT_ALERT_STATE_FILE.to_owned());
        let mut aside = path.with_file_name(format!("{name}.corrupt-{stamp}"));
        for n in 1.. {
            if !aside.exists() {
                break;
            }
            aside = path.with_file_name(format!("{name}.corrupt-{stamp}-{n}"));
        }
        match fs::rename(path, &aside) {
            Ok(()) => tracing::warn!(
                path = %path.display(),
                moved_to = %aside.display(),
                problem,
                "alert state file unusable: moved aside; starting with empty alert state (alerts still firing are sent again as new, cleared ones get no resolve)"
            ),
            Err(e) => tracing::error!(
                path = %path.display(),
                problem,
                error = %e,
                "alert state file unusable and cannot be moved aside; starting with empty alert state, and the next write replaces it"
            ),
        }
    }

    /// Writes `file` atomically: a 0600 temp file in the same directory,
    /// fsync, rename over the state file, fsync of the directory. Creates
    /// missing directories 0700.
    pub fn write(&self, file: &StateFile) -> io::Result<()> {
        let bytes = serde_json::to_vec(file).map_err(io::Error::other)?;
        write_atomic(&self.path, &bytes)
    }
}

/// Checks `kind` and `version` before reading the rest, so an unknown
/// version is named as such.
fn parse(text: &str) -> Result<StateFile, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let kind = value.get("kind").and_then(|v| v.as_str());
    if kind != Some(STATE_KIND) {
        return Err(format!("not an alert state file (kind {kind:?})"));
    }
    let version = value.get("version").and_then(|v| v.as_u64());
    if version != Some(u64::from(STATE_VERSION)) {
        return Err(format!(
            "unknown version {version:?} (this build reads version {STATE_VERSION})"
        ));
    }
    serde_json::from_value(value).map_err(|e| format!("invalid: {e}"))
}

pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    create_private_dir(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // tempfile creates it 0600 and unique; removed if anything below fails.
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    // The rename itself is durable once the directory is.
    fs::File::open(dir)?.sync_all()
}

#[cfg(unix)]
fn create_private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

#[cfg(not(unix))]
fn create_private_dir(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty() -> StateFile {
        StateFile {
            kind: STATE_KIND.into(),
            version: STATE_VERSION,
            saved_at: Utc::now(),
            alerts: Vec::new(),
            sinks: Vec::new(),
            alertmanagers: Vec::new(),
        }
    }

    #[test]
    fn a_written_file_reads_back_and_no_temp_file_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path().join("new/sub/state.json"));
        store.write(&empty()).unwrap();
        let read = store.load().expect("reads back");
        assert_eq!(
            (read.kind.as_str(), read.version),
            (STATE_KIND, STATE_VERSION)
        );
        let names: Vec<_> = fs::read_dir(dir.path().join("new/sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&store.path), 0o600);
            assert_eq!(mode(&dir.path().join("new/sub")), 0o700);
            assert_eq!(mode(&dir.path().join("new")), 0o700);
        }
    }

    #[test]
    fn unknown_versions_and_other_documents_are_refused() {
        let e = parse(r#"{"kind":"fleet-reconciler/alert-state","version":2}"#).unwrap_err();
        assert!(e.contains("unknown version Some(2)"), "{e}");
        let e = parse(r#"{"version":1}"#).unwrap_err();
        assert!(e.contains("not an alert state file"), "{e}");
        let e = parse("{\"kind\": tru").unwrap_err();
        assert!(e.starts_with("not JSON"), "{e}");
        let e = parse(r#"{"kind":"fleet-reconciler/alert-state","version":1,"alerts":[]}"#)
            .unwrap_err();
        assert!(e.starts_with("invalid"), "{e}");
    }
}

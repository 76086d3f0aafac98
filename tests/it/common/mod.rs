//! Helpers shared by the integration tests: a real overlay repository with
//! the demo's history, a config for it, a guard for child processes, a free
//! loopback port, one way each to bound and to poll with a deadline, and a
//! daemon run in-process against the simulator ([`daemon`]).
//!
//! Each test crate includes this module and uses only part of it, hence the
//! `dead_code` allowance (scoped to this module, not the crates).
#![allow(dead_code)]

pub mod daemon;
pub mod exposition;

use std::future::Future;
use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;

use fleet_reconciler::demo::{DemoHistory, DemoRepo};

/// How long [`within`] lets one operation run before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

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

    /// A config for this repository: `[fly]` at `api_url`, `[overlay]` on
    /// the release branch with its mirror in `mirror` (under the temp dir).
    pub fn config(&self, api_url: &str, mirror: &str) -> ConfigToml {
        ConfigToml::new(api_url, &self.repo_path, self.dir.path().join(mirror))
    }
}

/// A config file's text, built section by section: `[fly]` and `[overlay]`
/// (the parts every daemon needs), then whatever the test adds verbatim.
pub struct ConfigToml {
    fly: String,
    overlay: String,
    rest: String,
}

impl ConfigToml {
    pub fn new(api_url: &str, repo: &std::path::Path, mirror: PathBuf) -> ConfigToml {
        ConfigToml {
            fly: format!("api_url = \"{api_url}\"\n"),
            overlay: format!(
                "repo = \"{}\"\nbranch = \"release\"\nmirror_dir = \"{}\"\n",
                repo.display(),
                mirror.display()
            ),
            rest: String::new(),
        }
    }

    /// More keys of `[fly]` (one `key = value` a line).
    pub fn fly(mut self, keys: &str) -> ConfigToml {
        self.fly.push_str(keys.trim());
        self.fly.push('\n');
        self
    }

    /// More keys of `[overlay]`.
    pub fn overlay(mut self, keys: &str) -> ConfigToml {
        self.overlay.push_str(keys.trim());
        self.overlay.push('\n');
        self
    }

    /// An `[[apps]]` entry; `health_url` `None` leaves the default.
    pub fn app(mut self, name: &str, health_url: Option<&str>) -> ConfigToml {
        self.rest
            .push_str(&format!("[[apps]]\nname = \"{name}\"\n"));
        if let Some(url) = health_url {
            self.rest.push_str(&format!("health_url = \"{url}\"\n"));
        }
        self
    }

    /// Any further sections, verbatim.
    pub fn with(mut self, toml: &str) -> ConfigToml {
        self.rest.push_str(toml.trim());
        self.rest.push('\n');
        self
    }

    pub fn text(&self) -> String {
        format!(
            "[fly]\n{}[overlay]\n{}{}",
            self.fly, self.overlay, self.rest
        )
    }

    /// Writes the text to `path` and returns the path.
    pub fn write(&self, path: impl Into<PathBuf>) -> PathBuf {
        let path = path.into();
        std::fs::write(&path, self.text()).unwrap();
        path
    }
}

/// The secrets every process of the binary a test starts is given: its
/// Fly token and the fleet's record key (what an operator's CLI and the
/// daemon both hold).
pub trait WithSecrets {
    fn with_secrets(&mut self, fly_token: &str) -> &mut Self;
}

impl WithSecrets for std::process::Command {
    fn with_secrets(&mut self, fly_token: &str) -> &mut Self {
        self.env("FLEET_RECONCILER_FLY_TOKEN", fly_token).env(
            "FLEET_RECONCILER_RECORD_KEY",
            fleet_reconciler::sim::DEFAULT_RECORD_KEY,
        )
    }
}

/// Kills and reaps a child process on every path out of a test.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Reads the child's stderr (piped) to its end on a thread, so that it
    /// never blocks on a full pipe; the thread returns what it read.
    pub fn drain_stderr(&mut self) -> std::thread::JoinHandle<String> {
        use std::io::Read as _;
        let mut stderr = self.0.stderr.take().expect("stderr piped");
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        })
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port nothing listens on (a moment ago).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Runs `f`, failing the test if it takes longer than [`DEADLINE`].
pub async fn within<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(DEADLINE, f)
        .await
        .unwrap_or_else(|_| panic!("did not finish within {DEADLINE:?}"))
}

/// Polls `f` every 25 ms until it holds; fails the test after `deadline`.
/// `f` is async so that it can ask a server; a plain condition is `async || …`.
pub async fn eventually(what: &str, deadline: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = tokio::time::Instant::now();
    while !f().await {
        assert!(start.elapsed() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A published JSON Schema under docs/: the committed file must be what the
/// types generate (`UPDATE_SCHEMA=1` rewrites it), and is returned as a
/// validator.
pub fn published_schema(file: &str, generated: &str) -> jsonschema::Validator {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("docs")
        .join(file);
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::write(&path, generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/{file} is not what the types generate: run `UPDATE_SCHEMA=1 cargo test --test it` and commit it"
    );
    let schema: serde_json::Value = serde_json::from_str(&committed).unwrap();
    jsonschema::validator_for(&schema).unwrap()
}

/// Where `doc` breaks the schema, one line each (empty: it validates).
pub fn schema_errors(validator: &jsonschema::Validator, doc: &serde_json::Value) -> Vec<String> {
    validator
        .iter_errors(doc)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect()
}

/// Connections a [`counting_server`] has open now (`.0`) and had open at
/// most at once (`.1`).
pub type OpenConnections = std::sync::Arc<(
    std::sync::atomic::AtomicUsize,
    std::sync::atomic::AtomicUsize,
)>;

/// A loopback HTTP/1.1 server speaking just enough to answer every request
/// on a kept-alive connection with `body` (JSON), `delay` after it came, so
/// that a burst's requests overlap; counts its connections in `open`
/// (several servers may share one count). Returns its address.
pub async fn counting_server(
    body: &'static str,
    delay: Duration,
    open: OpenConnections,
) -> std::net::SocketAddr {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let now = open.0.fetch_add(1, Ordering::SeqCst) + 1;
            open.1.fetch_max(now, Ordering::SeqCst);
            let open = open.clone();
            tokio::spawn(async move {
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let mut buf = [0u8; 4096];
                // One answer per request (a GET: no body) until the client closes.
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    tokio::time::sleep(delay).await;
                    if conn.write_all(answer.as_bytes()).await.is_err() {
                        break;
                    }
                }
                open.0.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    addr
}

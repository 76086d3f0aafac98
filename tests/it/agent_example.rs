//! The reference agent (`examples/agent.rs`) end to end: the agent as a real
//! process, the real `fleet-reconciler check` binary, the simulated Fly API
//! and a real overlay repository. Proves that the example meets the contract
//! the daemon parses, and that the handshake behaves as docs/agent-contract.md
//! says.

use std::collections::{HashSet, VecDeque};
use std::io::{BufRead as _, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fleet_reconciler::demo::{DemoHistory, DemoRepo};
use fleet_reconciler::observe::probe::{Activity, Capability, ProbeOutcome, parse_report};
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};
use git2::{Oid, Repository};
use serde_json::{Value, json};

use crate::common::{ChildGuard, WithSecrets, eventually};

const FLY_TOKEN: &str = "agent-example-fly-token";
const AGENT_TOKEN: &str = "agent-example-control-token";
const RECONCILER: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
/// Building the example may wait for the shared target directory's lock.
const BUILD_TIMEOUT: Duration = Duration::from_secs(900);
const PROCESS_TIMEOUT: Duration = Duration::from_secs(60);
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);
const POLL_TIMEOUT: Duration = Duration::from_secs(15);

/// Runs a command to completion with a deadline; the child is killed if it
/// overruns (or if the test panics meanwhile). Returns (exit code, stdout, stderr).
fn run_with_timeout(mut cmd: Command, timeout: Duration) -> (i32, String, String) {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot spawn {cmd:?}: {e}"));
    let mut guard = ChildGuard(child);
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut buf);
            }
            buf
        })
    };
    let out = drain(guard.0.stdout.take().map(|p| Box::new(p) as _));
    let err = drain(guard.0.stderr.take().map(|p| Box::new(p) as _));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = guard.0.try_wait().expect("wait for child") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "{cmd:?} did not finish within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.code().unwrap_or(-1),
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    )
}

/// The example's executable. `cargo test` builds and uplifts examples next to
/// the test binaries (`<target>/<profile>/examples/agent`), so a copy newer
/// than its source is used as is; otherwise (`cargo test --test
/// agent_example` after editing the example) it is built here, once.
fn agent_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = uplifted_agent().filter(|b| is_fresh(b)) {
            return bin;
        }
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--example", "agent", "--message-format=json"])
            .arg("--manifest-path")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
        if !cfg!(debug_assertions) {
            cmd.arg("--release");
        }
        let (code, stdout, stderr) = run_with_timeout(cmd, BUILD_TIMEOUT);
        assert_eq!(code, 0, "cargo build --example agent failed:\n{stderr}");
        stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "agent")
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .unwrap_or_else(|| panic!("no executable for example `agent` in:\n{stdout}"))
    })
}

/// `<target>/<profile>/examples/agent`, beside this test's `deps/` directory.
fn uplifted_agent() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let bin = profile_dir
        .join("examples")
        .join(format!("agent{}", std::env::consts::EXE_SUFFIX));
    bin.is_file().then_some(bin)
}

/// Newer than everything it is built from (the example uses no library code).
fn is_fresh(bin: &Path) -> bool {
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let Some(built) = mtime(bin) else {
        return false;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ["examples/agent.rs", "Cargo.toml", "Cargo.lock"]
        .iter()
        .all(|src| mtime(&root.join(src)).is_some_and(|m| m <= built))
}

/// A running reference agent; killed when dropped.
struct Agent {
    _process: ChildGuard,
    base: String,
}

impl Agent {
    fn spawn(listen: &str, overlay_ref: &str, extra_env: &[(&str, &str)]) -> Agent {
        let mut cmd = Command::new(agent_binary());
        cmd.args(["--listen", listen, "--overlay-ref", overlay_ref])
            .env_remove("AGENT_CONTROL_TOKEN")
            .env_remove("AGENT_CHECKPOINT_DIR")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let mut process = ChildGuard(cmd.spawn().expect("spawn the example agent"));
        let stdout = process.0.stdout.take().expect("agent stdout");
        let (tx, rx) = mpsc::channel();
        // Forward the first line (the bound address), then keep draining.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            for _ in lines {}
        });
        let line = rx
            .recv_timeout(PROCESS_TIMEOUT)
            .expect("the agent printed its address in time");
        let base = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from the agent: {line}"))
            .to_string();
        Agent {
            _process: process,
            base,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(HTTP_TIMEOUT)
        .build()
        .unwrap()
}

async fn post(url: &str, token: Option<&str>, body: Option<Value>) -> (u16, Value) {
    let mut req = http().post(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.expect("agent answered");
    let status = resp.status().as_u16();
    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
    (status, body)
}

async fn health_body(agent: &Agent) -> Vec<u8> {
    let resp = http()
        .get(agent.url("/health"))
        .send()
        .await
        .expect("health answered");
    assert_eq!(resp.status(), 200, "health is never behind a token");
    resp.bytes().await.unwrap().to_vec()
}

/// The agent's report as the daemon's own parser reads it.
async fn report(agent: &Agent) -> fleet_reconciler::observe::probe::AgentReport {
    let body = health_body(agent).await;
    match parse_report(&body) {
        ProbeOutcome::Report(r) => r,
        other => panic!(
            "the daemon rejects the reference agent's report: {other:?}\n{}",
            String::from_utf8_lossy(&body)
        ),
    }
}

/// Polls the health report until `done` holds.
async fn wait_for(
    agent: &Agent,
    what: &str,
    done: impl Fn(&fleet_reconciler::observe::probe::AgentReport) -> bool,
) -> fleet_reconciler::observe::probe::AgentReport {
    let mut last = None;
    eventually(what, POLL_TIMEOUT, async || {
        let r = report(agent).await;
        let held = done(&r);
        last = Some(r);
        held
    })
    .await;
    last.unwrap()
}

/// Commits reachable from `from` and not from `not`, by BFS over parents:
/// an independent count, not libgit2's revwalk.
fn independent_count(repo: &Repository, from: Oid, not: Oid) -> u64 {
    let ancestors = |start: Oid| {
        let mut seen = HashSet::new();
        let mut queue = VecDeque::from([start]);
        while let Some(oid) = queue.pop_front() {
            if seen.insert(oid) {
                queue.extend(repo.find_commit(oid).unwrap().parent_ids());
            }
        }
        seen
    };
    ancestors(from).difference(&ancestors(not)).count() as u64
}

struct Overlay {
    dir: tempfile::TempDir,
    repo: PathBuf,
    history: DemoHistory,
}

fn overlay() -> Overlay {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("overlay.git");
    let history = DemoRepo::create(&repo).unwrap().build_history().unwrap();
    Overlay { dir, repo, history }
}

fn tip(h: &DemoHistory) -> Oid {
    *h.release.last().unwrap()
}

async fn run_check(config: &Path) -> (i32, Value, String) {
    let mut cmd = Command::new(RECONCILER);
    cmd.arg("check")
        .arg("--config")
        .arg(config)
        .args(["--output", "json"])
        .with_secrets(FLY_TOKEN)
        .env_remove("OVERLAY_GIT_TOKEN")
        .env("RUST_LOG", "warn");
    let (code, stdout, stderr) =
        tokio::task::spawn_blocking(move || run_with_timeout(cmd, PROCESS_TIMEOUT))
            .await
            .unwrap();
    let json = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!("check printed no JSON ({e}), exit {code}:\n{stdout}\n{stderr}")
    });
    (code, json, stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reads_the_reference_agent_and_follows_its_reloads() {
    let ov = overlay();
    let h = &ov.history;
    let tip_s = tip(h).to_string();
    // Older than the tip by a few commits, reported abbreviated as agents often do.
    let old = h.release[h.release.len() - 4];
    let old_short = &old.to_string()[..10];
    let expected_behind = independent_count(&Repository::open_bare(&ov.repo).unwrap(), tip(h), old);
    assert!(expected_behind >= 3);

    // One started machine whose agent is the example process, not the sim's.
    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN)
            .release_tip(tip_s.clone())
            .app(SimApp::new("agents").machine(SimMachine::new("agent-1").loaded(tip_s.clone()))),
    )
    .await
    .unwrap();
    let agent = Agent::spawn("127.0.0.1:0", &tip_s, &[]);
    // One agent stands for the machine: the id only identifies it.
    let health = format!("{}?machine={{machine_id}}", agent.url("/health"));
    let config = ov.dir.path().join("fleet-reconciler.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[fly]
api_url = "{api}"
request_timeout = "5s"

[overlay]
repo = "{repo}"
branch = "release"
mirror_dir = "{mirror}"

[probe]
timeout = "2s"

[[apps]]
name = "agents"
health_url = "{health}"
"#,
            api = sim.api_url(),
            repo = ov.repo.display(),
            mirror = ov.dir.path().join("mirror.git").display(),
            health = health,
        ),
    )
    .unwrap();

    let (code, v, stderr) = run_check(&config).await;
    assert_eq!(code, 0, "agent on the tip: {v}\n{stderr}");
    let m = &v["machines"][0];
    assert_eq!(
        (m["machine_id"].as_str(), m["status"].as_str()),
        (Some("agent-1"), Some("on_tip"))
    );
    // The fleet document leaves out a reported_ref that is the whole commit.
    assert_eq!(
        m.get("reported_ref").unwrap_or(&m["commit"]),
        tip_s.as_str()
    );
    assert_eq!(v["coherence"], 1.0);

    // Reload the agent to an older commit: the next sweep sees the drift.
    let (status, body) = post(
        &agent.url("/overlay/reload"),
        None,
        Some(json!({ "ref": old_short })),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    wait_for(&agent, "the reload", |r| *r.overlay_ref == *old_short).await;
    let (code, v, stderr) = run_check(&config).await;
    assert_eq!(code, 1, "agent behind the tip: {v}\n{stderr}");
    let m = &v["machines"][0];
    assert_eq!(m["status"], "drifted", "{m}");
    assert_eq!(m["reported_ref"], old_short);
    assert_eq!(m["commit"], old.to_string().as_str());
    assert_eq!(m["commits_behind"], expected_behind, "{m}");
    assert_eq!(m["commits_ahead"], 0);
    assert!(m["severity"].is_string() && m["action"].is_string(), "{m}");
    assert_eq!(v["coherence"], 0.0);

    // And back to the tip.
    let (status, _) = post(
        &agent.url("/overlay/reload"),
        None,
        Some(json!({ "ref": tip_s })),
    )
    .await;
    assert_eq!(status, 202);
    wait_for(&agent, "the reload to the tip", |r| {
        *r.overlay_ref == *tip_s
    })
    .await;
    let (code, v, _) = run_check(&config).await;
    assert_eq!(code, 0, "{v}");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_undrain_and_reload_follow_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoints = dir.path().join("checkpoints");
    let agent = Agent::spawn(
        "127.0.0.1:0",
        "a4f9d2b",
        &[
            ("AGENT_CONTROL_TOKEN", AGENT_TOKEN),
            ("AGENT_CHECKPOINT_DIR", checkpoints.to_str().unwrap()),
        ],
    );

    // Health: the full report, parsed by the daemon's parser, with no token.
    let r = report(&agent).await;
    assert_eq!(&*r.overlay_ref, "a4f9d2b");
    assert_eq!(r.activity, Some(Activity::Idle));
    assert_eq!(r.live_sessions, Some(0));
    assert!(r.can(Capability::Drain) && r.can(Capability::Reload));
    let rotation = r.rotation.clone().expect("rotation state");
    assert!(!rotation.fenced && rotation.checkpoint.is_none());
    let heartbeat = r.heartbeat_at.expect("heartbeat");
    assert!((chrono::Utc::now() - heartbeat).num_seconds().abs() < 30);
    assert!(r.last_input_at.is_none());

    // Cooperative endpoints need the bearer token.
    let drain = agent.url("/overlay/drain");
    let rot1 = || Some(json!({ "rotation": "rot-1" }));
    assert_eq!(post(&drain, None, rot1()).await.0, 401);
    assert_eq!(post(&drain, Some("wrong"), rot1()).await.0, 401);
    let resp = http()
        .post(&drain)
        .basic_auth("x", Some(AGENT_TOKEN))
        .json(&json!({ "rotation": "rot-1" }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "only a bearer token counts");
    assert_eq!(
        post(&agent.url("/overlay/undrain"), None, rot1()).await.0,
        401
    );
    assert_eq!(
        post(
            &agent.url("/overlay/reload"),
            None,
            Some(json!({ "ref": "abcd" }))
        )
        .await
        .0,
        401
    );
    assert!(
        !report(&agent).await.rotation.unwrap().fenced,
        "a refused drain changes nothing"
    );

    // Work in progress: busy, one live session, recent input.
    let (status, _) = post(&agent.url("/work?secs=5"), None, None).await;
    assert_eq!(status, 202);
    let r = report(&agent).await;
    assert_eq!(
        (r.activity, r.live_sessions),
        (Some(Activity::Busy), Some(1))
    );
    assert!(r.has_live_work() && r.last_input_at.is_some());

    // Drain while busy: the fence goes up at once, the checkpoint waits for the work.
    assert_eq!(
        post(&drain, Some(AGENT_TOKEN), Some(json!({}))).await.0,
        400,
        "tag required"
    );
    let (status, body) = post(&drain, Some(AGENT_TOKEN), rot1()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["rotation"],
        json!({ "fenced": true, "checkpoint": null })
    );
    let (status, body) = post(&agent.url("/work?secs=0"), None, None).await;
    assert_eq!(status, 503, "a fenced agent takes no new work: {body}");
    let r = report(&agent).await;
    assert!(r.rotation.as_ref().unwrap().fenced && r.has_live_work());

    // When the work ends: checkpoint written and reported, idle.
    let r = wait_for(&agent, "the checkpoint", |r| {
        r.rotation.as_ref().and_then(|x| x.checkpoint.as_deref()) == Some("rot-1")
    })
    .await;
    assert_eq!(
        (r.activity, r.live_sessions),
        (Some(Activity::Idle), Some(0))
    );
    assert!(r.rotation.unwrap().fenced);
    let saved: Value = serde_json::from_slice(
        &std::fs::read(checkpoints.join("checkpoint-rot-1.json")).expect("checkpoint file"),
    )
    .unwrap();
    assert_eq!(
        (&saved["rotation"], &saved["overlay_ref"]),
        (&json!("rot-1"), &json!("a4f9d2b"))
    );

    // Draining again with the same tag is idempotent.
    let (status, body) = post(&drain, Some(AGENT_TOKEN), rot1()).await;
    assert_eq!(status, 200);
    assert_eq!(
        body["rotation"],
        json!({ "fenced": true, "checkpoint": "rot-1" })
    );

    // Undrain: another rotation's tag is refused; the right one releases the fence.
    let undrain = agent.url("/overlay/undrain");
    let (status, body) = post(
        &undrain,
        Some(AGENT_TOKEN),
        Some(json!({ "rotation": "rot-2" })),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = post(&undrain, Some(AGENT_TOKEN), rot1()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["rotation"],
        json!({ "fenced": false, "checkpoint": null })
    );
    let (status, _) = post(&undrain, Some(AGENT_TOKEN), rot1()).await;
    assert_eq!(status, 200, "undrain is idempotent");
    assert_eq!(
        post(&agent.url("/work?secs=0"), None, None).await.0,
        202,
        "work accepted again"
    );

    // Reload: refused unless the ref is hex; deferred to the end of the work in progress.
    let reload = agent.url("/overlay/reload");
    for bad in [
        json!({ "ref": "release-1" }),
        json!({ "ref": "abc" }),
        json!({}),
    ] {
        assert_eq!(post(&reload, Some(AGENT_TOKEN), Some(bad)).await.0, 400);
    }
    wait_for(&agent, "idle", |r| !r.has_live_work()).await;
    assert_eq!(post(&agent.url("/work?secs=3"), None, None).await.0, 202);
    let (status, body) = post(
        &reload,
        Some(AGENT_TOKEN),
        Some(json!({ "ref": "BEEF1234" })),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["ref"], "beef1234");
    assert_eq!(
        &*report(&agent).await.overlay_ref,
        "a4f9d2b",
        "not in the middle of a job"
    );
    let r = wait_for(&agent, "the deferred reload", |r| {
        &*r.overlay_ref == "beef1234"
    })
    .await;
    assert!(!r.has_live_work());
}

/// The default listen address `[::]` answers over IPv6 (as 6PN needs) and,
/// on a dual-stack host, over IPv4 too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listening_on_the_ipv6_wildcard_serves_both_families() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("skipped: no IPv6 loopback on this host");
        return;
    }
    let agent = Agent::spawn("[::]:0", "abcd1234", &[]);
    let port = agent.base.rsplit(':').next().unwrap().to_string();
    for host in ["[::1]", "127.0.0.1"] {
        let resp = http()
            .get(format!("http://{host}:{port}/health"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("health over {host}: {e}"));
        assert_eq!(resp.status(), 200, "{host}");
    }
}

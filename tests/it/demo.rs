//! `fleet-reconciler demo` end to end: the real binary, its simulated fleet and
//! overlay repository, and the release that ships while it runs. The tests
//! read what the demo shows through its own HTTP API (`/api/v1/fleet`,
//! `/api/v1/machines/{id}`) on a free loopback port, not its tables.

use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use fleet_reconciler::decide::decision::Decision;
use fleet_reconciler::model::{MachineStatus, PolicyAction, Severity};
use fleet_reconciler::report::server::{MachineView, StatusError, fetch_fleet, fetch_machine};
use fleet_reconciler::report::wire::{FleetDocument, RowView};

use crate::common::{ChildGuard, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");

/// The built-in demo config with `edits` applied (each must change it), and
/// its status page on a free loopback port.
fn demo_config(edits: &[(&str, &str)]) -> (String, u16) {
    let mut config = fleet_reconciler::demo::DEMO_CONFIG.to_string();
    let port = free_port();
    let listen = format!("listen = \"127.0.0.1:{port}\"");
    for (from, to) in edits
        .iter()
        .chain([&("listen = \"127.0.0.1:8080\"", listen.as_str())])
    {
        assert!(config.contains(from), "the demo config has no {from:?}");
        config = config.replace(from, to);
    }
    (config, port)
}

/// A running `demo`, its output in files (a pipe nobody reads would fill
/// and stall it).
struct Demo {
    child: ChildGuard,
    dir: tempfile::TempDir,
    base: String,
}

impl Demo {
    fn start(config: &str, port: u16, sweeps: u32) -> Demo {
        Demo::start_with(config, port, &["--sweeps", &sweeps.to_string()])
    }

    fn start_with(config: &str, port: u16, args: &[&str]) -> Demo {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("demo.toml");
        std::fs::write(&path, config).unwrap();
        let child = Command::new(BIN)
            .arg("demo")
            .args(args)
            .arg("--demo-config")
            .arg(&path)
            .stdout(std::fs::File::create(dir.path().join("stdout.txt")).unwrap())
            .stderr(std::fs::File::create(dir.path().join("stderr.txt")).unwrap())
            .spawn()
            .unwrap();
        Demo {
            child: ChildGuard(child),
            dir,
            base: format!("http://127.0.0.1:{port}"),
        }
    }

    fn output(&self, name: &str) -> String {
        let path: PathBuf = self.dir.path().join(name);
        std::fs::read_to_string(path).unwrap()
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.0.try_wait().unwrap()
    }

    /// The last sweep's report, once the demo serves one.
    async fn fleet(&self) -> Option<FleetDocument<'static>> {
        not_yet(fetch_fleet(&self.base, Duration::from_secs(5)).await)
    }

    async fn machine(&self, id: &str) -> Option<MachineView> {
        not_yet(fetch_machine(&self.base, id, Duration::from_secs(5)).await).map(|(view, _)| view)
    }

    /// Waits for the demo to exit by itself, then checks it succeeded without a panic.
    async fn finished(&mut self) -> String {
        crate::common::eventually("the demo exits", Duration::from_secs(120), async || {
            self.exited().is_some()
        })
        .await;
        let status = self.exited().unwrap();
        let (stdout, stderr) = (self.output("stdout.txt"), self.output("stderr.txt"));
        assert!(status.success(), "{status}\n{stdout}\n{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        stdout
    }
}

/// An answer of the demo's API; `None` while it does not serve one yet (or
/// no longer); any other failure fails the test.
fn not_yet<T>(answer: Result<T, StatusError>) -> Option<T> {
    match answer {
        Ok(t) => Some(t),
        Err(StatusError::Transport(_) | StatusError::NotReady(_)) => None,
        Err(e) => panic!("the demo's API: {e}"),
    }
}

fn row<'a>(report: &'a FleetDocument<'_>, name: &str) -> RowView<'a> {
    report
        .rows()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("{name} missing in {:?}", report.machines))
}

/// behind, ahead, severity, action, status: what a drifted row says.
type Drift = (
    Option<u64>,
    Option<u64>,
    Option<Severity>,
    Option<PolicyAction>,
    MachineStatus,
);

fn drift(m: RowView<'_>) -> Drift {
    (
        m.commits_behind,
        m.commits_ahead,
        m.severity,
        m.action,
        m.status,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_detects_drift_and_the_release_it_ships() {
    let (config, port) = demo_config(&[
        ("interval = \"2s\"", "interval = \"500ms\""),
        ("fetch_interval = \"1s\"", "fetch_interval = \"10ms\""),
        // Every sweep waits this long for the demo's hanging agent.
        ("timeout = \"1s\"", "timeout = \"300ms\""),
        // Detection only: drift never gets old enough to act on.
        ("min_drift_age = \"4s\"", "min_drift_age = \"1h\""),
    ]);
    // The release ships after the second sweep; six show it and then some.
    let mut demo = Demo::start(&config, port, 6);
    let mut before: Option<FleetDocument<'static>> = None;
    let mut after: Option<FleetDocument<'static>> = None;
    crate::common::eventually(
        "a report before and one after the release",
        Duration::from_secs(60),
        async || {
            assert!(
                demo.exited().is_none() || after.is_some(),
                "{}",
                demo.output("stdout.txt")
            );
            if let Some(r) = demo.fleet().await {
                match &before {
                    None => before = Some(r),
                    Some(b) if b.tip.commit != r.tip.commit => after = Some(r),
                    Some(_) => {}
                }
            }
            after.is_some()
        },
    )
    .await;
    let (before, after) = (before.unwrap(), after.unwrap());
    let stdout = demo.finished().await;
    assert_eq!(stdout.matches("── sweep ").count(), 6, "{stdout}");
    assert!(
        stdout.contains(&format!(
            ">>> release branch advanced to {}",
            after.tip.commit
        )),
        "{stdout}"
    );

    // Before the release: agent-d-00 is on the tip, agent-d-07 one behind (low).
    assert_eq!(row(&before, "agent-d-00").status, MachineStatus::OnTip);
    assert_eq!(
        drift(row(&before, "agent-d-07")),
        (
            Some(1),
            Some(0),
            Some(Severity::Low),
            Some(PolicyAction::AlertAndWait),
            MachineStatus::Drifted
        ),
    );
    // After it (a guards/ change): the old tip is one behind at high severity,
    // and the one-behind machine is now two behind.
    assert_eq!(
        drift(row(&after, "agent-d-00")),
        (
            Some(1),
            Some(0),
            Some(Severity::High),
            Some(PolicyAction::Restart),
            MachineStatus::Drifted
        ),
    );
    let behind = row(&after, "agent-d-07");
    assert_eq!(
        (behind.commits_behind, behind.commits_ahead, behind.severity),
        (Some(2), Some(0), Some(Severity::High))
    );
    // Every per-machine status shows up.
    for status in [
        MachineStatus::OnTip,
        MachineStatus::Drifted,
        MachineStatus::UnknownRef,
        MachineStatus::Unreachable,
        MachineStatus::BadReport,
        MachineStatus::NotRunning,
    ] {
        assert!(
            before.rows().any(|m| m.status == status),
            "{status:?} in {:?}",
            before.machines
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_converges_waits_for_busy_agents_and_for_approval() {
    // The demo's busy-for-a-while agent works for three restart graces. The
    // grace leaves room for the client keeping to Fly's List limit (1/s per
    // app, burst 3), which slows sweeps 300 ms apart to about one a second:
    // with less, that agent may be idle again before its slot comes free.
    let (config, port) = demo_config(&[
        ("interval = \"2s\"", "interval = \"300ms\""),
        ("timeout = \"1s\"", "timeout = \"300ms\""),
        ("min_drift_age = \"4s\"", "min_drift_age = \"1s\""),
        ("restart_grace = \"10s\"", "restart_grace = \"8s\""),
    ]);
    let mut demo = Demo::start(&config, port, 0);
    // Watch the fleet until the demo stops by itself once settled; remember
    // the last report and the decision for agent-c-12 at that moment.
    let mut last: Option<FleetDocument<'static>> = None;
    let mut waiting: Option<Decision> = None;
    let mut d05_drained_live_work = false;
    crate::common::eventually(
        "the demo settles and exits",
        Duration::from_secs(120),
        async || {
            if demo.exited().is_some() {
                return true;
            }
            if let Some(r) = demo.fleet().await {
                let c12 = row(&r, "agent-c-12").machine_id.clone();
                if let Some(view) = demo.machine(c12.as_str()).await {
                    waiting = view.decision;
                }
                let d05 = row(&r, "agent-d-05").machine_id.clone();
                if let Some(view) = demo.machine(d05.as_str()).await {
                    d05_drained_live_work |=
                        matches!(view.decision, Some(Decision::LiveWork { .. }));
                }
                last = Some(r);
            }
            false
        },
    )
    .await;
    let stdout = demo.finished().await;
    assert!(stdout.contains("the fleet has settled"), "{stdout}");
    let last = last.expect("the demo served its fleet");

    // Every dispatch agent that policy lets rotate runs the new tip, and so
    // does the approved manual machine (agent-d-11: critical in the default pool).
    for i in 0..=13 {
        let m = row(&last, &format!("agent-d-{i:02}"));
        assert_eq!(m.status, MachineStatus::OnTip, "agent-d-{i:02}: {m:?}");
    }
    assert!(
        stdout.contains(&format!(
            ">>> an operator approves {}",
            row(&last, "agent-d-11").machine_id
        )),
        "{stdout}"
    );
    // Unapproved manual machines still wait (agent-c-12: critical in `conversation`).
    let c12 = row(&last, "agent-c-12");
    assert_eq!(c12.status, MachineStatus::Drifted);
    assert_eq!(c12.action, Some(PolicyAction::Manual));
    assert!(
        matches!(waiting, Some(Decision::AwaitingApproval { .. })),
        "{waiting:?}"
    );
    // The hour-busy agent in `dispatch` (restart) was interrupted only after its
    // grace; the busy one in `default` (alert-and-wait, agent-d-05) was
    // claimed while it worked and restarted only once it was idle.
    assert!(stdout.contains("restart agents-dispatch/1035e1f0003 (restart grace elapsed; live work may be interrupted)"), "{stdout}");
    assert!(
        d05_drained_live_work,
        "agent-d-05 was never seen draining while busy: nothing was waited for"
    );
    assert!(
        stdout.contains("restart agents-dispatch/1055e1f0005 (no live work)"),
        "{stdout}"
    );
    assert!(!stdout.contains("→ failed"), "a step failed: {stdout}");
    conversation_follows_its_canary(&stdout, &last);
}

/// Issue 36: `conversation` waits for its canary pool `dispatch`. The intro
/// says so; sweep lines show the wait; no step touches a conversation
/// machine until the wait has lifted, and none touches a dispatch machine
/// after (dispatch was done: on the tip, soaked); then conversation rotates.
fn conversation_follows_its_canary(stdout: &str, last: &FleetDocument<'_>) {
    assert!(
        stdout.contains("pool conversation waits for its canary pool dispatch"),
        "{stdout}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let pool_steps = |pool: &str| -> Vec<usize> {
        let ids: Vec<String> = last
            .rows()
            .filter(|m| m.pool.as_str() == pool)
            .map(|m| format!("{}/{}", m.app, m.machine_id))
            .collect();
        lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.starts_with("  ") && ids.iter().any(|id| l.contains(id.as_str())))
            .map(|(i, _)| i)
            .collect()
    };
    let waits: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with("── sweep ") && l.contains("guardrail: canary"))
        .map(|(i, _)| i)
        .collect();
    let (conversation, dispatch) = (pool_steps("conversation"), pool_steps("dispatch"));
    let first_conversation = *conversation
        .first()
        .unwrap_or_else(|| panic!("no step on a conversation machine:\n{stdout}"));
    let last_wait = *waits
        .last()
        .unwrap_or_else(|| panic!("no sweep line shows the canary wait:\n{stdout}"));
    assert!(last_wait < first_conversation, "{stdout}");
    let last_dispatch = *dispatch.last().expect("dispatch rotated");
    assert!(last_dispatch < first_conversation, "{stdout}");
    // After the wait, conversation machines high drift restarts reach the tip.
    let c00 = row(last, "agent-c-00");
    assert_eq!(c00.status, MachineStatus::OnTip, "{c00:?}");
}

/// Issue 21 item 7: `demo` leaves Prometheus' port alone, refuses a
/// `--config` it would ignore, and SIGTERM (what `docker stop`, systemd or
/// a CI runner sends) stops it cleanly with its temporary directory gone.
/// Item 6 rides along: its logs are JSON lines when asked, and decision
/// changes are one summary line per sweep, not one line per machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_stops_on_sigterm_and_removes_its_temporary_directory() {
    let builtin = fleet_reconciler::config::Config::parse(
        std::path::Path::new("config/demo.toml"),
        fleet_reconciler::demo::DEMO_CONFIG,
    )
    .unwrap();
    assert_ne!(
        builtin.server.listen.port(),
        9090,
        "9090 is Prometheus' port"
    );

    let out = Command::new(BIN)
        .args(["demo", "--sweeps", "1", "--config", "config/demo.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: `demo` reads no --config") && stderr.contains("--demo-config"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "nothing ran");

    let (config, port) = self::demo_config(&[("interval = \"2s\"", "interval = \"300ms\"")]);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("demo.toml");
    std::fs::write(&path, &config).unwrap();
    let stderr_path = dir.path().join("stderr.txt");
    let mut child = ChildGuard(
        Command::new(BIN)
            .args(["demo", "--keep-running", "--demo-config"])
            .arg(&path)
            // Where its temporary directory goes (tempfile reads TMPDIR).
            .env("TMPDIR", tmp.path())
            .env("FLEET_RECONCILER_LOG_FORMAT", "json")
            .env_remove("RUST_LOG")
            .stdout(std::fs::File::create(dir.path().join("stdout.txt")).unwrap())
            .stderr(std::fs::File::create(&stderr_path).unwrap())
            .spawn()
            .unwrap(),
    );
    let work = || -> Vec<PathBuf> {
        std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("fleet-reconciler-demo-")
            })
            .collect()
    };
    let base = format!("http://127.0.0.1:{port}");
    crate::common::eventually(
        "the demo swept twice",
        Duration::from_secs(60),
        async || {
            assert!(
                child.0.try_wait().unwrap().is_none(),
                "the demo exited early"
            );
            let stdout = std::fs::read_to_string(dir.path().join("stdout.txt")).unwrap_or_default();
            stdout.contains("── sweep 2 ")
                && not_yet(fetch_fleet(&base, Duration::from_secs(5)).await).is_some()
        },
    )
    .await;
    assert_eq!(
        work().len(),
        1,
        "the demo's temporary directory exists while it runs"
    );

    let pid = libc::pid_t::try_from(child.0.id()).unwrap();
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    #[allow(unsafe_code)]
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(sent, 0);
    crate::common::eventually(
        "the demo exits on SIGTERM",
        Duration::from_secs(30),
        async || child.0.try_wait().unwrap().is_some(),
    )
    .await;
    let status = child.0.try_wait().unwrap().unwrap();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(status.success(), "{status}: {stderr}");
    assert_eq!(
        work(),
        Vec::<PathBuf>::new(),
        "the temporary directory is removed"
    );

    // JSON log lines only; decision changes summarized per sweep.
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    let summaries: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| {
            l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("decisions changed this sweep"))
        })
        .collect();
    assert!(!summaries.is_empty(), "{stderr}");
    // The first sweep sees every machine not on the tip for the first time:
    // many changes, one line, counts per decision kind that add up.
    let first = &summaries[0]["fields"];
    let counts: u64 = first["decisions"]
        .as_str()
        .unwrap()
        .split(' ')
        .map(|kv| {
            let (kind, n) = kv.split_once('=').unwrap_or_else(|| panic!("{first}"));
            assert!(Decision::KINDS.contains(&kind), "{kind}: {first}");
            n.parse::<u64>().unwrap()
        })
        .sum();
    assert!(counts > 10, "{first}");
    assert_eq!(first["changed"].as_u64(), Some(counts), "{first}");
    assert!(
        !lines
            .iter()
            .any(|l| l["fields"].get("machine").is_some() && l["level"] == "INFO"),
        "no per-machine INFO line: {stderr}"
    );
}

/// Issue 34 item 7: `demo | head -1`: the reader goes away after one line,
/// and the demo ends quietly (as `ls` does), not with a panic and exit 101.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_goes_away_ends_the_demo_quietly() {
    use std::io::BufRead as _;
    let (config, _) = demo_config(&[("interval = \"2s\"", "interval = \"300ms\"")]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("demo.toml");
    std::fs::write(&path, config).unwrap();
    let stderr_path = dir.path().join("stderr.txt");
    let mut child = Command::new(BIN)
        .args(["demo", "--sweeps", "50", "--demo-config"])
        .arg(&path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut child = ChildGuard(child);
    let first = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .unwrap();
        line // the reader, and the pipe's read end, are dropped here
    })
    .await
    .unwrap();
    assert!(first.starts_with("fleet-reconciler demo"), "{first}");
    crate::common::eventually("the demo exits", Duration::from_secs(60), async || {
        child.0.try_wait().unwrap().is_some()
    })
    .await;
    let status = child.0.try_wait().unwrap().unwrap();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(status.code(), Some(0), "{status}: {stderr}");
}

/// Issue 34 item 7: by default one line per sweep (its figures) and the
/// steps, the full table with `--verbose`; the end repeats how to try
/// `preflight`, which scrolled away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_prints_a_line_per_sweep_and_the_table_only_when_verbose() {
    let (config, port) = demo_config(&[("interval = \"2s\"", "interval = \"300ms\"")]);
    let stdout = Demo::start(&config, port, 3).finished().await;
    assert_eq!(stdout.matches("── sweep ").count(), 3, "{stdout}");
    assert!(
        !stdout.contains("release tip:"),
        "no table by default: {stdout}"
    );
    assert!(!stdout.lines().any(|l| l.starts_with("APP ")), "{stdout}");
    for line in stdout.lines().filter(|l| l.starts_with("── sweep ")) {
        assert!(
            line.contains("on tip") && line.contains("coherence"),
            "{line}"
        );
    }
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap();
    assert!(
        last.contains("preflight") && last.contains("--keep-running"),
        "{stdout}"
    );
    // Short: the intro, a line a sweep, the steps, the end.
    assert!(
        stdout.lines().count() < 80,
        "{} lines:\n{stdout}",
        stdout.lines().count()
    );

    let (config, port) = demo_config(&[("interval = \"2s\"", "interval = \"300ms\"")]);
    let mut demo = Demo::start_with(&config, port, &["--sweeps", "1", "--verbose"]);
    let stdout = demo.finished().await;
    assert!(stdout.contains("release tip:"), "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("APP ")), "{stdout}");
}

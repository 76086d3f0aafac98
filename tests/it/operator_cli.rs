//! The operator commands (`approve`, `revoke`, `hold`, `release`,
//! `validate-config`) and the CLI's failure conventions end to end: the real
//! binary against the simulated Fly API over loopback, a real overlay
//! repository and, where a command reads a running daemon, the real HTTP
//! server over one real sweep. With `--output json` every command prints
//! exactly one JSON object on stdout, on success and on failure (one error
//! shape for all); `approve` waits for idle unless told `--now`, and `--now`
//! names the live work it would end before anything is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use fleet_reconciler::clock::SystemClock;
use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::{self, Secrets};
use fleet_reconciler::metadata::operator::Approval;
use fleet_reconciler::metadata::{APPROVE_KEY, HOLD_KEY};
use fleet_reconciler::model::CommitId;
use fleet_reconciler::report::metrics::Metrics;
use fleet_reconciler::report::server::{self, FleetView, MachineExtra, ServerState};
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::common::{OverlayRepo, WithSecrets};

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
const FLY_TOKEN: &str = "fly-token-operator-cli";

/// One run of the binary: exit code, stdout, stderr.
struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Out {
    /// Stdout as exactly one JSON object (one line, nothing else).
    fn json(&self) -> Value {
        let lines: Vec<&str> = self.stdout.lines().collect();
        assert_eq!(lines.len(), 1, "one line on stdout: {:?}", self.stdout);
        let v: Value = serde_json::from_str(lines[0])
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", self.stdout));
        assert!(v.is_object(), "{v}");
        v
    }
}

fn cli(config: &Path, args: &[&str]) -> Out {
    cli_with(config, args, &[("FLEET_RECONCILER_FLY_TOKEN", FLY_TOKEN)])
}

fn cli_with(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut cmd = Command::new(BIN);
    // stdin is not a terminal: nothing is ever asked interactively.
    cmd.args(args)
        .arg("--config")
        .arg(config)
        .stdin(Stdio::null())
        .env_remove("FLEET_RECONCILER_FLY_TOKEN")
        .env_remove("FLY_MACHINE_ID")
        .env_remove("RUST_LOG")
        .env_remove("FLEET_RECONCILER_LOG_FORMAT")
        .env("USER", "env-user")
        // The operator holds the fleet's record key, as the daemon does.
        .env(
            "FLEET_RECONCILER_RECORD_KEY",
            fleet_reconciler::sim::DEFAULT_RECORD_KEY,
        );
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    Out {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

struct Fixture {
    overlay: OverlayRepo,
    sim: Sim,
    config: PathBuf,
}

async fn fixture() -> Fixture {
    let overlay = OverlayRepo::new();
    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN)
            .release_tip(overlay.tip())
            .app(
                SimApp::new("agents")
                    .machine(
                        SimMachine::new("m1")
                            .loaded(overlay.behind(1))
                            .live_sessions(2),
                    )
                    .machine(SimMachine::new("m2").loaded(overlay.tip())),
            )
            .app(SimApp::new("chat").machine(SimMachine::new("c1").loaded(overlay.behind(2)))),
    )
    .await
    .unwrap();
    let config = overlay.dir.path().join("fleet-reconciler.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[fly]
api_url = "{api}"
max_retries = 0
[overlay]
repo = "{repo}"
branch = "release"
mirror_dir = "{mirror}"
[[apps]]
name = "agents"
health_url = "{health}"
[[apps]]
name = "chat"
health_url = "{health}"
[pools.default]
actions = {{ low = "observe", medium = "observe", high = "manual", critical = "manual" }}
[pools.gpu]
max_concurrent_rotations = 2
[rotation]
coordinator = "fleet-reconciler/coord0"
"#,
            api = sim.api_url(),
            repo = overlay.repo_path.display(),
            mirror = overlay.dir.path().join("mirror.git").display(),
            health = sim.health_url_template(),
        ),
    )
    .unwrap();
    Fixture {
        overlay,
        sim,
        config,
    }
}

fn metadata(sim: &Sim, machine: &str, key: &str) -> Option<String> {
    sim.machine(machine).unwrap().metadata.get(key).cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_and_release_print_what_they_did_as_json() {
    let fx = fixture().await;

    let out = cli(
        &fx.config,
        &[
            "hold", "c1", "--reason", "INC-4521", "--by", "alice", "--output", "json",
        ],
    );
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let v = out.json();
    assert_eq!(v["command"], "hold");
    assert_eq!(v["app"], "chat", "found in the second app");
    assert_eq!(v["machine_id"], "c1");
    assert_eq!(v["hold"]["by"], "alice");
    assert_eq!(v["hold"]["reason"], "INC-4521");
    let at = v["hold"]["at"].as_str().unwrap();
    chrono::DateTime::parse_from_rfc3339(at).unwrap();
    // What is printed is what was written.
    let written: Value =
        serde_json::from_str(&fx.sim.sealed_metadata("c1", HOLD_KEY).unwrap()).unwrap();
    assert_eq!(written, v["hold"]);

    let out = cli(&fx.config, &["release", "c1", "-o", "json"]);
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let r = out.json();
    assert_eq!(r["command"], "release");
    assert_eq!(r["app"], "chat");
    assert_eq!(r["machine_id"], "c1");
    assert_eq!(r["released"], true);
    assert_eq!(r["hold"], v["hold"], "the hold removed is reported");
    assert_eq!(metadata(&fx.sim, "c1", HOLD_KEY), None);

    // Releasing a machine with no hold succeeds and says there was none.
    let out = cli(&fx.config, &["release", "m2", "--output", "json"]);
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let r = out.json();
    assert_eq!(r["app"], "agents");
    assert_eq!(r["hold"], Value::Null);

    // A hold value not written by `hold` is shown as the string it is.
    fx.sim.set_metadata("m2", HOLD_KEY, "set by hand");
    let r = cli(&fx.config, &["release", "m2", "--output", "json"]).json();
    assert_eq!(r["hold"], "set by hand");
    assert_eq!(metadata(&fx.sim, "m2", HOLD_KEY), None);
    fx.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_prints_the_approval_it_wrote_as_json() {
    let fx = fixture().await;

    // Default target: the release tip, fetched now.
    let out = cli(
        &fx.config,
        &[
            "approve",
            "m1",
            "--when-idle",
            "--by",
            "bob",
            "--output",
            "json",
        ],
    );
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let v = out.json();
    assert_eq!(v["command"], "approve");
    assert_eq!(v["app"], "agents");
    assert_eq!(v["machine_id"], "m1");
    assert_eq!(v["approval"]["target"], fx.overlay.tip().as_str());
    assert_eq!(v["approval"]["mode"], "when-idle");
    assert_eq!(v["approval"]["by"], "bob");
    let written = Approval::parse(&fx.sim.sealed_metadata("m1", APPROVE_KEY).unwrap()).unwrap();
    assert_eq!(serde_json::to_value(&written).unwrap(), v["approval"]);

    // An explicit commit (upper case is normalised), no mode: when idle
    // (interrupting work is never a default), `by` from $USER.
    let commit = fx.overlay.behind(1);
    let out = cli(
        &fx.config,
        &[
            "approve",
            "c1",
            "--commit",
            &commit.to_ascii_uppercase(),
            "-o",
            "json",
        ],
    );
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let v = out.json();
    assert_eq!(v["app"], "chat");
    assert_eq!(v["approval"]["target"], commit.as_str());
    assert_eq!(v["approval"]["mode"], "when-idle");
    assert_eq!(v["approval"]["by"], "env-user");
    let written = Approval::parse(&fx.sim.sealed_metadata("c1", APPROVE_KEY).unwrap()).unwrap();
    assert_eq!(written.target, CommitId::parse(&commit).unwrap());
    fx.sim.shutdown().await;
}

/// Every failure with `--output json`: exit 2 as with text, one JSON error
/// object on stdout, the human line still on stderr, nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_fail_with_one_json_error_object() {
    let fx = fixture().await;
    let tip = fx.overlay.tip();
    for args in [
        vec!["hold", "nope", "--output", "json"],
        vec!["release", "nope", "--output", "json"],
        vec!["approve", "nope", "--commit", &tip, "--output", "json"],
    ] {
        let out = cli(&fx.config, &args);
        assert_eq!(out.code, Some(2), "{args:?}: {}{}", out.stdout, out.stderr);
        let v = out.json();
        assert_eq!(v["command"], args[0]);
        assert_eq!(v["kind"], "unknown_machine", "{v}");
        assert_eq!(v["machine_id"], "nope");
        let error = v["error"].as_str().unwrap();
        assert_eq!(
            error, "machine nope is not in any configured app (agents, chat)",
            "{v}"
        );
        assert_eq!(out.stderr.trim_end(), format!("error: {error}"));
    }

    let out = cli(
        &fx.config,
        &["approve", "m1", "--commit", "abc123", "--output", "json"],
    );
    assert_eq!(out.code, Some(2));
    let v = out.json();
    assert_eq!(v["kind"], "bad_commit");
    assert_eq!(
        v["error"],
        "--commit \"abc123\" is not a full 40-hex commit id"
    );

    let out = cli_with(&fx.config, &["hold", "m1", "--output", "json"], &[]);
    assert_eq!(out.code, Some(2));
    let v = out.json();
    assert_eq!(v["kind"], "fly_token_missing");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .starts_with("FLEET_RECONCILER_FLY_TOKEN is not set"),
        "{v}"
    );

    // Fly refuses the token in every app: no app could be searched.
    let out = cli_with(
        &fx.config,
        &["release", "m1", "--output", "json"],
        &[("FLEET_RECONCILER_FLY_TOKEN", "wrong-token")],
    );
    assert_eq!(out.code, Some(2));
    let v = out.json();
    assert_eq!(v["kind"], "unsearched");
    assert_eq!(v["machine_id"], "m1");
    assert!(
        v["error"].as_str().unwrap().contains("rejected the token"),
        "{v}"
    );

    // A config that does not load: the same key and line as validate-config.
    let bad = fx.overlay.dir.path().join("bad.toml");
    std::fs::write(&bad, "[[apps]]\nname = \"a\"\n\n[sweep]\ninterval = 30\n").unwrap();
    let out = cli(&bad, &["hold", "m1", "--output", "json"]);
    assert_eq!(out.code, Some(2));
    let v = out.json();
    assert_eq!(v["command"], "hold");
    assert_eq!(v["kind"], "config_invalid");
    assert_eq!(v["config"], bad.display().to_string());
    assert_eq!(v["line"], 5);
    assert!(v.get("valid").is_none(), "{v}");

    for m in ["m1", "m2", "c1"] {
        let meta = fx.sim.machine(m).unwrap().metadata;
        assert!(
            !meta.contains_key(HOLD_KEY) && !meta.contains_key(APPROVE_KEY),
            "{m}: {meta:?}"
        );
    }
    fx.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_config_json_summarises_a_valid_file() {
    let fx = fixture().await;
    let out = cli_with(&fx.config, &["validate-config", "--output", "json"], &[]);
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let v = out.json();
    assert_eq!(v["command"], "validate-config");
    assert_eq!(v["valid"], true);
    assert_eq!(v["config"], fx.config.display().to_string());
    assert_eq!(v["apps"], 2);
    assert_eq!(v["pools"], serde_json::json!(["default", "gpu"]));
    let config = Config::load(&fx.config).unwrap();
    assert_eq!(v["severity_rules"], config.severity.len());
    assert_eq!(v["webhooks"], 0);
    fx.sim.shutdown().await;
}

#[tokio::test]
async fn validate_config_json_names_the_key_and_line_of_an_invalid_file() {
    let dir = tempfile::tempdir().unwrap();
    let validate = |name: &str, text: Option<&str>| {
        let path = dir.path().join(name);
        if let Some(text) = text {
            std::fs::write(&path, text).unwrap();
        }
        let out = cli_with(&path, &["validate-config", "--output", "json"], &[]);
        assert_eq!(out.code, Some(2), "{}{}", out.stdout, out.stderr);
        let v = out.json();
        assert_eq!(v["command"], "validate-config");
        assert_eq!(v["valid"], false);
        assert_eq!(v["config"], path.display().to_string());
        let error = v["error"].as_str().unwrap().to_string();
        assert_eq!(out.stderr.trim_end(), format!("error: {error}"));
        v
    };

    // A bad value: the key path and the line of the value.
    let v = validate(
        "bad-value.toml",
        Some(
            "[overlay]\nrepo = \"x\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n\n[[apps]]\nname = \"a\"\n\n[rotation]\ndrain_ceiling = \"forever\"\n",
        ),
    );
    assert_eq!(v["kind"], "config_invalid");
    assert_eq!(v["key"], "rotation.drain_ceiling");
    assert_eq!(v["line"], 10);
    assert!(v["error"].as_str().unwrap().contains("forever"), "{v}");

    // A misspelt key in the second app.
    let v = validate(
        "unknown-key.toml",
        Some(
            "[overlay]\nrepo = \"x\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n[[apps]]\nname = \"a\"\n[[apps]]\nname = \"b\"\npool_kee = \"pool\"\n",
        ),
    );
    assert_eq!(v["kind"], "config_invalid");
    assert_eq!(v["key"], "apps[1].pool_kee");
    assert_eq!(v["line"], 9);

    // A rule checked after parsing: the key, and the line of its table.
    let v = validate(
        "duplicate-app.toml",
        Some(
            "[overlay]\nrepo = \"x\"\nbranch = \"release\"\nmirror_dir = \"/m\"\n[[apps]]\nname = \"a\"\n[[apps]]\nname = \"a\"\n",
        ),
    );
    assert_eq!(v["key"], "apps[1].name");
    assert!(v["line"].is_u64(), "{v}");
    assert!(v["error"].as_str().unwrap().contains("listed twice"), "{v}");

    // Not TOML: no key, but the line.
    let v = validate("syntax.toml", Some("[overlay]\nrepo = \n"));
    assert_eq!(v["kind"], "config_invalid");
    assert_eq!(v["key"], Value::Null);
    assert_eq!(v["line"], 2);

    // No file: neither key nor line.
    let v = validate("missing.toml", None);
    assert_eq!(v["kind"], "config_unreadable");
    assert_eq!(v["key"], Value::Null);
    assert_eq!(v["line"], Value::Null);
}

/// Without `--output` the four commands print the lines they always have,
/// and a failure prints nothing on stdout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_text_output_is_unchanged() {
    let fx = fixture().await;
    let tip = fx.overlay.tip();

    let out = cli(&fx.config, &["hold", "m1", "--reason", "why"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        out.stdout,
        "held: agents/m1; no reconciler acts on it until `fleet-reconciler release m1`\n"
    );
    let out = cli(&fx.config, &["release", "m1"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(out.stdout, "released: agents/m1 is managed again\n");
    let out = cli(
        &fx.config,
        &["approve", "m1", "--commit", &tip, "--when-idle"],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        out.stdout,
        format!(
            "approved: agents/m1 may rotate to {} (when idle)\n",
            &tip[..12]
        )
    );
    let out = cli(&fx.config, &["validate-config"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        out.stdout,
        format!(
            "{}: ok (2 app(s), 2 pool(s), {} severity rule(s), 0 webhook(s))\n",
            fx.config.display(),
            Config::load(&fx.config).unwrap().severity.len()
        )
    );

    let out = cli(&fx.config, &["hold", "nope"]);
    assert_eq!(out.code, Some(2));
    assert_eq!(out.stdout, "");
    assert_eq!(
        out.stderr,
        "error: machine nope is not in any configured app (agents, chat)\n"
    );
    fx.sim.shutdown().await;
}

/// A daemon's HTTP server over one real sweep of the fixture's fleet, with
/// the decisions a daemon would publish: what `status` and `approve --now`
/// read. Its base URL; it stops when the token is cancelled.
async fn serve_daemon(fx: &Fixture, shutdown: &CancellationToken) -> String {
    serve_daemon_with(fx, shutdown, |_| {}).await
}

/// As [`serve_daemon`], with `prepare` applied to the view before it is served.
async fn serve_daemon_with(
    fx: &Fixture,
    shutdown: &CancellationToken,
    prepare: impl FnOnce(&FleetView),
) -> String {
    let config = Arc::new(Config::load(&fx.config).unwrap());
    let secrets = Secrets {
        fly_token: FLY_TOKEN.into(),
        git_token: None,
        record_keys: Some(fleet_reconciler::sim::record_keys()),
    };
    let sweeper = daemon::connect(config, &secrets).await.unwrap();
    let (report, plan) = daemon::plan_once(&sweeper, "test-daemon", &SystemClock)
        .await
        .unwrap();
    let view = FleetView::new(Duration::from_secs(30), Utc::now());
    view.record_sweep(report, Utc::now());
    view.set_extras(
        plan.machines
            .into_iter()
            .map(|(id, m)| (id, m.decision))
            .map(|(id, d)| {
                let extra = MachineExtra {
                    decision: Some(d),
                    ..MachineExtra::default()
                };
                (id, extra)
            })
            .collect::<BTreeMap<_, _>>(),
    );
    prepare(&view);
    let state = ServerState::new(Arc::new(Metrics::new(true).unwrap()), view);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server::serve(listener, state, shutdown.clone()));
    base
}

/// Issue 21 item 4: `--now` interrupts work, so it names the live sessions
/// the daemon last saw and is refused unless confirmed; nothing is written
/// before that. Without a daemon to ask, the live work is unknown, which is
/// refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_now_names_the_live_work_and_needs_confirmation() {
    let fx = fixture().await;
    let shutdown = CancellationToken::new();
    let base = serve_daemon(&fx, &shutdown).await;
    let tip = fx.overlay.tip();

    let out = cli(
        &fx.config,
        &["approve", "m1", "--now", "--commit", &tip, "--url", &base],
    );
    assert_eq!(out.code, Some(2), "{}{}", out.stdout, out.stderr);
    assert_eq!(out.stdout, "");
    assert!(
        out.stderr.starts_with(
            "error: approve --now m1: agents/m1 has 2 live session(s) (the daemon's sweep of "
        ),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("restarting it now ends them; not confirmed"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("\nhint: confirm with --yes"),
        "{}",
        out.stderr
    );
    assert_eq!(
        metadata(&fx.sim, "m1", APPROVE_KEY),
        None,
        "nothing written"
    );

    let out = cli(
        &fx.config,
        &[
            "approve", "m1", "--now", "--commit", &tip, "--url", &base, "-o", "json",
        ],
    );
    assert_eq!(out.code, Some(2));
    let v = out.json();
    assert_eq!(v["command"], "approve");
    assert_eq!(v["kind"], "not_confirmed");
    assert_eq!(v["machine_id"], "m1");
    assert!(
        v["error"].as_str().unwrap().contains("2 live session(s)"),
        "{v}"
    );
    assert!(v["hint"].as_str().unwrap().contains("--yes"), "{v}");

    // Confirmed: written with mode now, and what it ends is on record.
    let out = cli(
        &fx.config,
        &[
            "approve", "m1", "--now", "--yes", "--commit", &tip, "--url", &base, "-o", "json",
        ],
    );
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let v = out.json();
    assert_eq!(v["approval"]["mode"], "now");
    assert_eq!(v["live_work"]["known"], true);
    assert_eq!(v["live_work"]["live_sessions"], 2);
    assert!(
        out.stderr.contains("agents/m1 has 2 live session(s)"),
        "{}",
        out.stderr
    );
    let written = Approval::parse(&fx.sim.sealed_metadata("m1", APPROVE_KEY).unwrap()).unwrap();
    assert_eq!(serde_json::to_value(&written).unwrap(), v["approval"]);

    // An idle machine needs no confirmation.
    let out = cli(
        &fx.config,
        &["approve", "m2", "--now", "--commit", &tip, "--url", &base],
    );
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("agents/m2 has no live work"),
        "{}",
        out.stderr
    );

    // No daemon to ask: unknown live work is not taken for none.
    shutdown.cancel();
    let dead = format!("http://127.0.0.1:{}", crate::common::free_port());
    let out = cli(
        &fx.config,
        &[
            "approve", "c1", "--now", "--commit", &tip, "--url", &dead, "-o", "json",
        ],
    );
    assert_eq!(out.code, Some(2), "{}{}", out.stdout, out.stderr);
    let v = out.json();
    assert_eq!(v["kind"], "not_confirmed");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("live work is unknown"),
        "{v}"
    );
    assert_eq!(metadata(&fx.sim, "c1", APPROVE_KEY), None);
    fx.sim.shutdown().await;
}

/// Issue 21 item 4: `revoke` removes a pending approval under the
/// machine's lease and says what it removed; a machine without one is left
/// as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_removes_a_pending_approval() {
    let fx = fixture().await;
    let tip = fx.overlay.tip();
    let out = cli(
        &fx.config,
        &["approve", "c1", "--commit", &tip, "-o", "json"],
    );
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let approval = out.json()["approval"].clone();
    assert!(metadata(&fx.sim, "c1", APPROVE_KEY).is_some());

    let out = cli(&fx.config, &["revoke", "c1", "-o", "json"]);
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let v = out.json();
    assert_eq!(v["command"], "revoke");
    assert_eq!(v["app"], "chat");
    assert_eq!(v["revoked"], true);
    assert_eq!(v["approval"], approval, "the approval removed is reported");
    assert_eq!(v["fenced"], true, "removed under the machine's lease");
    assert_eq!(metadata(&fx.sim, "c1", APPROVE_KEY), None);

    let out = cli(&fx.config, &["revoke", "c1"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        out.stdout,
        "revoked: chat/c1 had no approval; nothing changed\n"
    );

    let out = cli(&fx.config, &["revoke", "nope", "-o", "json"]);
    assert_eq!(out.code, Some(2));
    assert_eq!(out.json()["kind"], "unknown_machine");
    fx.sim.shutdown().await;
}

/// Issue 21 item 4: every command that takes `--output json` prints one
/// JSON error object of the same shape when it fails, `--log-format json`
/// makes the fatal error a JSON log line, and an error's cause is printed
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_fails_with_one_json_error_object() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let dead = format!("http://127.0.0.1:{}", crate::common::free_port());
    for args in [
        vec!["check"],
        vec!["plan"],
        vec!["validate-config"],
        vec!["preflight"],
        vec!["status"],
        vec!["approve", "m1"],
        vec!["revoke", "m1"],
        vec!["hold", "m1"],
        vec!["release", "m1"],
    ] {
        let mut with_json = args.clone();
        with_json.extend(["--output", "json"]);
        let out = cli(&missing, &with_json);
        assert_eq!(out.code, Some(2), "{args:?}: {}{}", out.stdout, out.stderr);
        let v = out.json();
        assert_eq!(v["command"], args[0], "{v}");
        assert_eq!(v["kind"], "config_unreadable", "{v}");
        assert_eq!(v["config"], missing.display().to_string());
        let error = v["error"].as_str().unwrap();
        assert_eq!(
            error.matches("No such file or directory").count(),
            1,
            "the cause once: {error}"
        );
        assert_eq!(out.stderr.trim_end(), format!("error: {error}"));

        // The fatal error as a JSON log line, like every other log line.
        let out = cli_with(&missing, &args, &[("FLEET_RECONCILER_LOG_FORMAT", "json")]);
        assert_eq!(out.code, Some(2));
        assert_eq!(out.stdout, "");
        let line: Value = serde_json::from_str(out.stderr.trim_end()).unwrap_or_else(|e| {
            panic!(
                "{args:?}: stderr is not one JSON line ({e}): {}",
                out.stderr
            )
        });
        assert_eq!(line["level"], "ERROR");
        assert_eq!(line["fields"]["message"], error);
        assert_eq!(line["fields"]["kind"], "config_unreadable");
    }

    // A failure after the config: the daemon `status` asks is not there.
    let out = cli(&missing, &["status", "--url", &dead, "-o", "json"]);
    assert_eq!(out.code, Some(2));
    let v = out.json();
    assert_eq!(v["command"], "status");
    assert_eq!(v["kind"], "daemon_transport", "{v}");

    // A malformed RUST_LOG is an error, not a silent fallback.
    let out = cli_with(
        &missing,
        &["check", "-o", "json"],
        &[("RUST_LOG", "fleet_reconciler=loud")],
    );
    assert_eq!(out.code, Some(2));
    let v = out.json();
    assert_eq!(v["kind"], "log_filter");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .starts_with("RUST_LOG=\"fleet_reconciler=loud\" is not a valid log filter"),
        "{v}"
    );
}

/// One `--output` vocabulary with help text on every command that prints;
/// `table`, the old word of three of them, still works.
#[test]
fn every_command_has_the_same_output_vocabulary_with_help() {
    for command in [
        "check",
        "plan",
        "status",
        "validate-config",
        "preflight",
        "approve",
        "revoke",
        "hold",
        "release",
    ] {
        let out = Command::new(BIN)
            .args([command, "--help"])
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{command}: {help}");
        assert!(
            help.contains("-o, --output <OUTPUT>")
                && help.contains("text: ")
                && help.contains("json: "),
            "{command} --help:\n{help}"
        );
        assert!(!help.contains("table:"), "{command} --help:\n{help}");
    }
    let out = Command::new(BIN)
        .args([
            "check",
            "--output",
            "table",
            "--config",
            "/nonexistent/x.toml",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: config file"),
        "table is text: {stderr}"
    );
}

/// `--version` names the commit the binary was built from.
#[test]
fn version_names_the_commit() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    let expected = match std::env::var("FLEET_RECONCILER_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "unknown".into()),
    };
    assert_eq!(
        version.trim_end(),
        format!(
            "fleet-reconciler {} (commit {expected})",
            env!("CARGO_PKG_VERSION")
        )
    );
}

/// Issue 21 item 4: the DECISION column of `status` shows what the daemon
/// decided for each machine (it was `-` on every row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_each_machines_decision() {
    let fx = fixture().await;
    let shutdown = CancellationToken::new();
    let base = serve_daemon(&fx, &shutdown).await;
    let out = cli(&fx.config, &["status", "--url", &base]);
    assert_eq!(out.code, Some(1), "drift: {}{}", out.stdout, out.stderr);
    assert!(
        !out.stderr.contains("STALE"),
        "a fresh view is not stale: {}",
        out.stderr
    );
    let rows = decision_column(&out.stdout);
    assert_eq!(
        rows.get("m2").map(String::as_str),
        Some("on tip"),
        "{}",
        out.stdout
    );
    // m1 is one behind: low, observed in the default pool.
    assert_eq!(
        rows.get("m1").map(String::as_str),
        Some("observe only"),
        "{}",
        out.stdout
    );
    assert_eq!(rows.len(), 3, "{}", out.stdout);

    // The API's document, decisions included, is the published schema's.
    let out = cli(&fx.config, &["status", "--url", &base, "-o", "json"]);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    let validator = crate::common::published_schema(
        "fleet.schema.json",
        &fleet_reconciler::report::wire::fleet_schema(),
    );
    let errors = crate::common::schema_errors(&validator, &v);
    assert!(errors.is_empty(), "{errors:#?}");
    assert_eq!(v["decisions"].as_object().unwrap().len(), 3, "{v}");
    let mut bad = v.clone();
    bad["decisions"]["m2"]["kind"] = "fine".into();
    assert!(
        !validator.is_valid(&bad),
        "a decision no program writes is refused"
    );
    assert_eq!(
        v["schema_version"],
        fleet_reconciler::report::wire::SCHEMA_VERSION
    );
    assert_eq!(v["decisions"]["m2"]["kind"], "on_tip");
    shutdown.cancel();
    fx.sim.shutdown().await;
}

/// #37 item 3: `status` says when the daemon's view is stale, and why,
/// before the table (on stderr: the JSON stays the daemon's document), and
/// a machine's detail carries a `STALE:` line. A fresh view says nothing of
/// the kind (`status_shows_each_machines_decision`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_the_daemons_view_is_stale_and_why() {
    let fx = fixture().await;
    let shutdown = CancellationToken::new();
    // The last sweep 2 minutes ago (stale_after: 3 × 30 s), those since failing.
    let base = serve_daemon_with(&fx, &shutdown, |view| {
        view.update(|o| o.last_success = Some(Utc::now() - chrono::TimeDelta::seconds(120)));
        view.record_failure(
            "cannot list machines of app agents: the Machines API is unreachable",
            Utc::now(),
        );
    })
    .await;
    // Both checked before either fails: each is its own promise.
    let mut problems = Vec::new();
    let out = cli(&fx.config, &["status", "--url", &base]);
    match out.stderr.lines().find(|l| l.starts_with("STALE: ")) {
        Some(l)
            if l.contains("older than alerts.stale_after (1m 30s)")
                && l.ends_with("the Machines API is unreachable") => {}
        other => problems.push(format!("status: {other:?} in {}", out.stderr)),
    }
    if !out.stdout.contains("m1") {
        problems.push(format!("the last view is not shown: {}", out.stdout));
    }
    let out = cli(&fx.config, &["status", "m1", "--url", &base]);
    if !out
        .stdout
        .lines()
        .any(|l| l.starts_with("STALE:") && l.contains("older than alerts.stale_after"))
    {
        problems.push(format!("status m1: no STALE line in {}", out.stdout));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    shutdown.cancel();
    fx.sim.shutdown().await;
}

/// Machine id → its DECISION cell, from a `check`/`status` table.
pub fn decision_column(table: &str) -> BTreeMap<String, String> {
    let mut lines = table.lines().skip_while(|l| !l.starts_with("APP "));
    let header = lines.next().unwrap_or_default();
    let (start, end) = (
        header.find("DECISION").unwrap(),
        header.find("DETAIL").unwrap(),
    );
    lines
        .take_while(|l| !l.is_empty())
        .map(|l| {
            let id = l.split_whitespace().nth(1).unwrap_or_default().to_string();
            let cell = l.get(start..end.min(l.len())).unwrap_or_default().trim();
            (id, cell.to_string())
        })
        .collect()
}

/// Issue 21 item 6: a sweep that fails as a whole (here: Fly refuses the
/// token for every app, so nothing can be listed) is an ERROR in the log,
/// not a warning, in the JSON lines fly.toml turns on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_logs_a_failing_sweep_as_an_error() {
    let overlay = crate::common::OverlayRepo::new();
    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN)
            .release_tip(overlay.tip())
            .app(SimApp::new("agents").machine(SimMachine::new("m1").loaded(overlay.tip()))),
    )
    .await
    .unwrap();
    let port = crate::common::free_port();
    let config = crate::common::ConfigToml::new(
        &sim.api_url(),
        &overlay.repo_path,
        overlay.dir.path().join("mirror.git"),
    )
    .app("agents", Some(&sim.health_url_template()))
    .with(&format!(
        "[sweep]\ninterval = \"200ms\"\n[pools.default]\nactions = {{ low = \"observe\", medium = \"observe\", high = \"observe\", critical = \"observe\" }}\n[server]\nlisten = \"127.0.0.1:{port}\"\n"
    ))
    .write(overlay.dir.path().join("run.toml"));
    let stderr_path = overlay.dir.path().join("stderr.txt");
    let mut child = crate::common::ChildGuard(
        Command::new(BIN)
            .arg("run")
            .arg("--config")
            .arg(&config)
            .with_secrets("a-token-fly-refuses")
            .env("FLEET_RECONCILER_LOG_FORMAT", "json")
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr_path).unwrap())
            .spawn()
            .unwrap(),
    );
    let failed = |log: &str| -> Option<Value> {
        log.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|l| l["fields"]["message"] == "sweep failed")
    };
    crate::common::eventually("a sweep fails", Duration::from_secs(60), async || {
        assert!(
            child.0.try_wait().unwrap().is_none(),
            "run exited: {}",
            std::fs::read_to_string(&stderr_path).unwrap_or_default()
        );
        failed(&std::fs::read_to_string(&stderr_path).unwrap_or_default()).is_some()
    })
    .await;
    let log = std::fs::read_to_string(&stderr_path).unwrap();
    let line = failed(&log).unwrap();
    assert_eq!(line["level"], "ERROR", "{line}");
    assert!(
        line["fields"]["error"].as_str().unwrap().contains("agents"),
        "{line}"
    );
    for l in log.lines() {
        serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"));
    }
    let _ = child.0.kill();
    sim.shutdown().await;
}

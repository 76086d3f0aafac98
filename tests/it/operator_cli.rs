//! The operator commands (`approve`, `hold`, `release`, `validate-config`)
//! end to end: the real binary against the simulated Fly API over loopback
//! and a real overlay repository. With `--output json` each prints exactly
//! one JSON object on stdout, on success and on failure; the text output and
//! the exit codes are those of before.

use std::path::{Path, PathBuf};
use std::process::Command;

use fleet_reconciler::config::Config;
use fleet_reconciler::metadata::operator::Approval;
use fleet_reconciler::metadata::{APPROVE_KEY, HOLD_KEY};
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};
use serde_json::Value;

use crate::common::OverlayRepo;

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
    cli_with(config, args, &[("FLY_API_TOKEN", FLY_TOKEN)])
}

fn cli_with(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .arg("--config")
        .arg(config)
        .env_remove("FLY_API_TOKEN")
        .env("USER", "env-user");
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
                    .machine(SimMachine::new("m1").loaded(overlay.behind(1)))
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
    let written: Value = serde_json::from_str(&metadata(&fx.sim, "c1", HOLD_KEY).unwrap()).unwrap();
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
    let written = Approval::parse(&metadata(&fx.sim, "m1", APPROVE_KEY).unwrap()).unwrap();
    assert_eq!(serde_json::to_value(&written).unwrap(), v["approval"]);

    // An explicit commit (upper case is normalised), mode now, `by` from $USER.
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
    assert_eq!(v["approval"]["mode"], "now");
    assert_eq!(v["approval"]["by"], "env-user");
    let written = Approval::parse(&metadata(&fx.sim, "c1", APPROVE_KEY).unwrap()).unwrap();
    assert_eq!(written.target, commit);
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
            .starts_with("FLY_API_TOKEN is not set"),
        "{v}"
    );

    // Fly refuses the token in every app: no app could be searched.
    let out = cli_with(
        &fx.config,
        &["release", "m1", "--output", "json"],
        &[("FLY_API_TOKEN", "wrong-token")],
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

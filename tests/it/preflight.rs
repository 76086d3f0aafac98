//! `preflight`, `validate-config --check-env`, the config path rule and the
//! per-app Fly tokens, end to end: the real binary against the simulated Fly
//! API (with app-scoped tokens, as `fly tokens create deploy -a APP` makes
//! them), a real overlay repository and real webhook receivers on loopback.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::{Method, StatusCode};
use fleet_reconciler::fly::{FlyClient, FlyClientConfig, FlyError, FlyTokens};
use fleet_reconciler::metadata::SLOTS_KEY;
use fleet_reconciler::sim::SimHandle;
use fleet_reconciler::sim::{Credential, RequestTarget, Sim, SimApp, SimFleet, SimMachine};
use serde_json::Value;

use crate::common::OverlayRepo;

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
/// The sim's fleet-wide token: given to no process here, so every call
/// that succeeds carried its app's own token.
const ORG_TOKEN: &str = "org-token-never-handed-out";
const AGENTS_TOKEN: &str = "agents-deploy-token-s3cret";
const BATCH_TOKEN: &str = "batch-deploy-token-s3cret";
const COORD_TOKEN: &str = "coordinator-deploy-token-s3cret";

/// One run of the binary: exit code, stdout, stderr.
struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Out {
    /// The text line of a check (`ok   app agents: …`), and its fix line.
    fn line(&self, status: &str, check: &str, subject: &str) -> (String, String) {
        let prefix = format!("{status} {check} {subject}");
        let mut lines = self.stdout.lines();
        while let Some(l) = lines.next() {
            if l.starts_with(&prefix) {
                let fix = match lines.clone().next() {
                    Some(f) if f.trim_start().starts_with("fix:") => f.to_string(),
                    _ => String::new(),
                };
                return (l.to_string(), fix);
            }
        }
        panic!("no line `{prefix}…` in:\n{}\n{}", self.stdout, self.stderr);
    }
}

/// Runs the binary with exactly `env` (nothing inherited but `TMPDIR`).
fn cli(args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env_clear();
    if let Some(tmp) = std::env::var_os("TMPDIR") {
        cmd.env("TMPDIR", tmp);
    }
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

async fn cli_async(args: Vec<String>, env: Vec<(String, String)>) -> Out {
    crate::common::within(tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        cli(&args, &env)
    }))
    .await
    .unwrap()
}

/// What a webhook receiver was sent: method, path, body.
type Seen = Arc<Mutex<Vec<(String, String, String)>>>;

/// Receivers that answer as Slack and PagerDuty answer an empty object
/// (400: nothing posted, nothing triggered), and a revoked hook (404).
async fn receivers() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let app = Router::new().fallback(move |method: Method, uri: axum::http::Uri, body: String| {
        let record = record.clone();
        async move {
            record
                .lock()
                .unwrap()
                .push((method.to_string(), uri.path().to_string(), body));
            match uri.path() {
                "/slack" => (StatusCode::BAD_REQUEST, "no_text"),
                "/pagerduty" => (StatusCode::BAD_REQUEST, "Event object is invalid"),
                // A signed receiver: an unsigned request is refused.
                "/json" => (StatusCode::UNAUTHORIZED, "bad signature"),
                _ => (StatusCode::NOT_FOUND, "no_service"),
            }
        }
    });
    (serve(app).await, seen)
}

/// A loopback HTTP server answering with `app`; returns its base URL.
async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Two agents' apps and the reconciler's own app with the coordinator, each
/// app accepting only its own token.
async fn fleet(overlay: &OverlayRepo, coordinator: SimMachine) -> Sim {
    let tip = overlay.tip();
    let sim = Sim::start(
        SimFleet::new(ORG_TOKEN)
            .release_tip(tip.clone())
            .app(
                SimApp::new("agents")
                    .machine(SimMachine::new("a1").loaded(tip.clone()))
                    .machine(SimMachine::new("a2").loaded(tip.clone())),
            )
            .app(SimApp::new("batch").machine(SimMachine::new("b1").loaded(tip.clone())))
            .app(SimApp::new("fleet-reconciler").machine(coordinator)),
    )
    .await
    .unwrap();
    sim.add_app_token("agents", AGENTS_TOKEN);
    sim.add_app_token("batch", BATCH_TOKEN);
    sim.add_app_token("fleet-reconciler", COORD_TOKEN);
    sim
}

/// The config every test starts from: a token per app, the coordinator in
/// the reconciler's app with its own token, a Slack and a PagerDuty hook.
fn config(overlay: &OverlayRepo, sim: &Sim) -> String {
    let template = sim.health_url_template();
    overlay
        .config(&sim.api_url(), "mirror.git")
        .app("agents", Some(&template))
        .with(
            r#"token_env = "AGENTS_FLY_TOKEN"
agent_token_env = "AGENT_TOKEN""#,
        )
        .app("batch", Some(&template))
        .with(
            r#"token_env = "BATCH_FLY_TOKEN"

[rotation]
coordinator = "fleet-reconciler/coord0"
coordinator_token_env = "COORD_FLY_TOKEN"

[[alerts.webhooks]]
url_env = "SLACK_URL"
format = "slack"

[[alerts.webhooks]]
url_env = "PD_URL"
format = "pagerduty"
routing_key_env = "PD_KEY"

[[alerts.webhooks]]
url_env = "JSON_URL"
format = "json"
secret_env = "JSON_SECRET""#,
        )
        .text()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn good_env(hooks: &str) -> Vec<(String, String)> {
    [
        ("AGENTS_FLY_TOKEN", AGENTS_TOKEN.to_string()),
        ("BATCH_FLY_TOKEN", BATCH_TOKEN.to_string()),
        ("COORD_FLY_TOKEN", COORD_TOKEN.to_string()),
        ("AGENT_TOKEN", "agent-bearer".to_string()),
        (
            "FLEET_RECONCILER_RECORD_KEY",
            fleet_reconciler::sim::DEFAULT_RECORD_KEY.to_string(),
        ),
        ("SLACK_URL", format!("{hooks}/slack")),
        ("PD_URL", format!("{hooks}/pagerduty")),
        ("PD_KEY", "pd-routing-key-s3cret".to_string()),
        ("JSON_URL", format!("{hooks}/json")),
        ("JSON_SECRET", "hmac-s3cret".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Serves `app` on loopback, and writes the usual [`config`] with
/// `section` after it as `file`; returns the server's URL and the path.
async fn served_beside_the_config(
    app: Router,
    overlay: &OverlayRepo,
    sim: &Sim,
    file: &str,
    section: &str,
) -> (String, PathBuf) {
    let url = serve(app).await;
    let text = format!("{}\n\n{section}", config(overlay, sim));
    (url, write(overlay.dir.path(), file, &text))
}

/// [`good_env`], and `var` set to `value` if given.
fn env_with(hooks: &str, var: &str, value: Option<String>) -> Vec<(String, String)> {
    let mut env = good_env(hooks);
    env.extend(value.map(|v| (var.to_string(), v)));
    env
}

fn args(config: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = vec![
        "preflight".to_string(),
        "--config".into(),
        config.display().to_string(),
    ];
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_check_passes_against_a_ready_fleet_and_nothing_is_disturbed() {
    let overlay = OverlayRepo::new();
    let sim = fleet(&overlay, SimMachine::new("coord0").stopped()).await;
    let (hooks, seen) = receivers().await;
    let path = write(overlay.dir.path(), "ok.toml", &config(&overlay, &sim));

    let out = cli_async(args(&path, &[]), good_env(&hooks)).await;
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    assert!(!out.stdout.contains("FAIL"), "{}", out.stdout);
    out.line(
        "ok  ",
        "app",
        "agents: listed with the token in AGENTS_FLY_TOKEN",
    );
    out.line(
        "ok  ",
        "app",
        "batch: listed with the token in BATCH_FLY_TOKEN",
    );
    out.line(
        "ok  ",
        "coordinator",
        "fleet-reconciler/coord0 state: exists and is stopped",
    );
    out.line("ok  ", "coordinator", "fleet-reconciler/coord0 slots");
    out.line(
        "ok  ",
        "coordinator",
        "fleet-reconciler/coord0 lease: leasable: taken and released",
    );
    out.line("ok  ", "overlay", "branch release: remote reachable");
    out.line(
        "ok  ",
        "webhook",
        "alerts.webhooks[0] dry request: POST {} answered HTTP 400",
    );
    out.line(
        "ok  ",
        "webhook",
        "alerts.webhooks[1] dry request: POST {} answered HTTP 400",
    );
    // A signed receiver refuses the unsigned HEAD: it is there.
    out.line(
        "ok  ",
        "webhook",
        "alerts.webhooks[2] dry request: HEAD answered HTTP 401",
    );
    out.line(
        "ok  ",
        "health",
        "agents: 2 of 2 sampled machine(s) answered a report",
    );
    out.line("ok  ", "health", "batch: 1 of 1");
    assert!(
        out.stdout.lines().last().unwrap().contains("passed"),
        "{}",
        out.stdout
    );
    // No secret in what it printed.
    for secret in [
        AGENTS_TOKEN,
        BATCH_TOKEN,
        COORD_TOKEN,
        "pd-routing-key",
        "agent-bearer",
        "hmac-s3cret",
    ] {
        assert!(
            !out.stdout.contains(secret) && !out.stderr.contains(secret),
            "{secret}"
        );
    }

    // Each token went to its own app only: the sim accepts an app's token
    // for that app alone, and every Fly call was authorized.
    let fly: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| r.target == RequestTarget::FlyApi)
        .collect();
    assert!(!fly.is_empty());
    assert!(
        fly.iter()
            .all(|r| r.authorized && r.credential == Credential::FlyToken),
        "{fly:#?}"
    );
    // The coordinator's lease was released, its slots untouched.
    assert!(sim.machine("coord0").unwrap().lease.is_none());
    assert!(
        fly.iter()
            .all(|r| !(r.method == "POST" && r.action.as_deref() == Some("metadata")))
    );
    // The webhooks got `{}` and nothing else: no routing key, no event.
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        [
            ("POST".to_string(), "/slack".to_string(), "{}".to_string()),
            (
                "POST".to_string(),
                "/pagerduty".to_string(),
                "{}".to_string()
            ),
            ("HEAD".to_string(), "/json".to_string(), String::new()),
        ]
    );

    // --output json: one object, every check, ok.
    let out = cli_async(args(&path, &["--output", "json"]), good_env(&hooks)).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(v["command"], "preflight");
    assert_eq!(v["ok"], true);
    let checks = v["checks"].as_array().unwrap();
    assert!(checks.iter().all(|c| c["status"] != "fail"), "{v}");
    assert!(
        checks
            .iter()
            .any(|c| c["check"] == "app" && c["subject"] == "batch")
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_defect_is_reported_in_one_run_with_its_fix() {
    let overlay = OverlayRepo::new();
    // The coordinator runs, and its slot key holds what no version reads.
    let sim = fleet(
        &overlay,
        SimMachine::new("coord0").metadata(SLOTS_KEY, "{not json"),
    )
    .await;
    let (hooks, seen) = receivers().await;
    let closed = crate::common::free_port();
    let text = config(&overlay, &sim)
        // The branch is not on the remote.
        .replace("branch = \"release\"", "branch = \"no-such-branch\"")
        // The mirror cannot be created where it is configured.
        .replace(
            &format!("{}", overlay.dir.path().join("mirror.git").display()),
            "/proc/fleet-reconciler-preflight/overlay.git",
        )
        // The agents answer nowhere.
        .replacen(
            &sim.health_url_template(),
            &format!("http://127.0.0.1:{closed}/agents/{{machine_id}}/health"),
            1,
        );
    let path = write(overlay.dir.path(), "defects.toml", &text);
    let mut env = good_env(&hooks);
    env.retain(|(k, _)| k != "AGENT_TOKEN" && k != "PD_KEY");
    for (k, v) in env.iter_mut() {
        match k.as_str() {
            // Another app's token: refused for this one.
            "BATCH_FLY_TOKEN" => *v = AGENTS_TOKEN.into(),
            // A revoked Slack hook.
            "SLACK_URL" => *v = format!("{hooks}/revoked"),
            _ => {}
        }
    }

    let out = cli_async(args(&path, &[]), env.clone()).await;
    assert_eq!(out.code, Some(1), "{}\n{}", out.stdout, out.stderr);
    let (l, fix) = out.line("FAIL", "secret", "AGENT_TOKEN");
    assert!(l.contains("apps[0].agent_token_env"), "{l}");
    assert!(fix.contains("fly secrets set AGENT_TOKEN="), "{fix}");
    let (_, fix) = out.line("FAIL", "secret", "PD_KEY");
    assert!(fix.contains("fly secrets set PD_KEY="), "{fix}");
    out.line(
        "skip",
        "webhook",
        "alerts.webhooks[1]: its variables are not all set",
    );
    let (l, fix) = out.line("FAIL", "mirror", "overlay.mirror_dir");
    assert!(l.contains("/proc"), "{l}");
    assert!(fix.contains("/data/overlay.git"), "{fix}");
    out.line("ok  ", "app", "agents");
    let (l, fix) = out.line("FAIL", "app", "batch");
    assert!(l.contains("BATCH_FLY_TOKEN") && l.contains("401"), "{l}");
    assert!(fix.contains("fly tokens create deploy -a batch"), "{fix}");
    let (l, fix) = out.line("FAIL", "coordinator", "fleet-reconciler/coord0 state");
    assert!(l.contains("is started, not stopped"), "{l}");
    assert!(
        fix.contains("fly machine stop coord0 --app fleet-reconciler"),
        "{fix}"
    );
    let (l, _) = out.line("FAIL", "coordinator", "fleet-reconciler/coord0 slots");
    assert!(l.contains("not readable"), "{l}");
    out.line("ok  ", "coordinator", "fleet-reconciler/coord0 lease");
    let (l, fix) = out.line("FAIL", "overlay", "branch no-such-branch");
    assert!(fix.contains("overlay.branch"), "{l} {fix}");
    let (l, fix) = out.line("FAIL", "webhook", "alerts.webhooks[0] dry request");
    assert!(l.contains("HTTP 404"), "{l}");
    assert!(fix.contains("SLACK_URL"), "{fix}");
    let (l, fix) = out.line("FAIL", "health", "agents");
    assert!(l.contains("2 of 2") && l.contains("unreachable"), "{l}");
    assert!(fix.contains("apps[0].health_url"), "{fix}");
    // batch could not be listed: its sample is skipped, not failed twice.
    out.line("skip", "health", "batch: not sampled");
    assert!(
        out.stdout
            .lines()
            .last()
            .unwrap()
            .contains("9 check(s) failed"),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains(AGENTS_TOKEN) && !out.stderr.contains(AGENTS_TOKEN));
    // The PagerDuty hook, missing its key, was sent nothing.
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|(_, p, _)| p != "/pagerduty")
    );

    // The same in JSON: every failure, by check and subject.
    let out = cli_async(args(&path, &["-o", "json"]), env).await;
    assert_eq!(out.code, Some(1));
    let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["failures"], 9);
    let failed: Vec<String> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "fail")
        .map(|c| {
            format!(
                "{} {}",
                c["check"].as_str().unwrap(),
                c["subject"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        failed,
        [
            "secret AGENT_TOKEN",
            "secret PD_KEY",
            "mirror overlay.mirror_dir",
            "app batch",
            "coordinator fleet-reconciler/coord0 state",
            "coordinator fleet-reconciler/coord0 slots",
            "overlay branch no-such-branch",
            "webhook alerts.webhooks[0] dry request",
            "health agents",
        ]
    );
    assert!(
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["status"] != "fail" || c["fix"].is_string())
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_config_exits_2_and_a_missing_coordinator_is_known_offline() {
    let overlay = OverlayRepo::new();
    let dir = overlay.dir.path();
    // Unparseable: exit 2, the key named, in text and in JSON.
    let bad = write(dir, "bad.toml", "[overlay]\nrepo = 1\n");
    let out = cli(&["preflight", "--config", bad.to_str().unwrap()], &[]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("bad.toml") && out.stderr.contains("overlay.repo"),
        "{}",
        out.stderr
    );
    let out = cli(
        &["preflight", "-o", "json", "--config", bad.to_str().unwrap()],
        &[],
    );
    assert_eq!(out.code, Some(2));
    let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(
        (v["command"].as_str(), v["kind"].as_str()),
        (Some("preflight"), Some("config_invalid"))
    );

    // A pool acts and there is no coordinator; the record key and two
    // variables are unset.
    let text = overlay
        .config("http://127.0.0.1:9", "mirror.git")
        .app("agents", None)
        .with("token_env = \"AGENTS_FLY_TOKEN\"\nagent_token_env = \"AGENT_TOKEN\"")
        .text();
    let path = write(dir, "nocoord.toml", &text);
    let p = path.to_str().unwrap();
    // validate-config knows it offline (before: it said ok, and `run` failed).
    let out = cli(&["validate-config", "--config", p], &[]);
    assert_eq!(out.code, Some(2), "{}", out.stdout);
    assert!(
        out.stderr
            .contains("rotation.coordinator is not set: some pool acts"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("AGENT_TOKEN"),
        "no env check without --check-env"
    );
    // --check-env names every unset variable, in one run.
    let out = cli(
        &[
            "validate-config",
            "--check-env",
            "-o",
            "json",
            "--config",
            p,
        ],
        &[],
    );
    assert_eq!(out.code, Some(2));
    let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(v["kind"], "not_ready");
    let error = v["error"].as_str().unwrap();
    for named in [
        "4 problem(s)",
        "rotation.coordinator",
        "FLEET_RECONCILER_RECORD_KEY",
        "AGENTS_FLY_TOKEN",
        "AGENT_TOKEN",
    ] {
        assert!(error.contains(named), "{named}: {error}");
    }
    let out = cli(
        &["validate-config", "--check-env", "--config", p],
        &[
            ("AGENTS_FLY_TOKEN", "t"),
            ("AGENT_TOKEN", "a"),
            (
                "FLEET_RECONCILER_RECORD_KEY",
                fleet_reconciler::sim::DEFAULT_RECORD_KEY,
            ),
        ],
    );
    assert_eq!(out.code, Some(2));
    assert!(out.stderr.contains("1 problem(s)"), "{}", out.stderr);
    // preflight says the same, among its own lines, and exits 1.
    let out = cli(&["preflight", "--config", p], &[("AGENTS_FLY_TOKEN", "t")]);
    assert_eq!(out.code, Some(1), "{}", out.stdout);
    let (_, fix) = out.line("FAIL", "coordinator", "rotation.coordinator: is not set");
    assert!(fix.contains("The coordination machine"), "{fix}");
    out.line("FAIL", "secret", "AGENT_TOKEN");
    out.line("FAIL", "app", "agents");
    // An observe-only config needs no coordinator.
    let observe = format!(
        "{text}\n[pools.default]\nactions = {{ low = \"observe\", medium = \"observe\", high = \"observe\", critical = \"observe\" }}\n"
    );
    let path = write(dir, "observe.toml", &observe);
    let out = cli(
        &["validate-config", "--config", path.to_str().unwrap()],
        &[],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
}

/// `--config` wins over `FLEET_RECONCILER_CONFIG`, which wins over the
/// default; a file that cannot be read is named with where its path came
/// from and how to name another.
#[test]
fn the_config_path_comes_from_the_flag_the_env_or_the_default() {
    let overlay = OverlayRepo::new();
    let dir = overlay.dir.path();
    let good = overlay.config("http://127.0.0.1:9", "mirror.git").app("agents", None).with(
        "[pools.default]\nactions = { low = \"observe\", medium = \"observe\", high = \"observe\", critical = \"observe\" }",
    );
    let good = good.write(dir.join("good.toml"));
    let missing = dir.join("missing.toml");
    let env = [("FLEET_RECONCILER_CONFIG", good.to_str().unwrap())];

    let out = cli(&["validate-config"], &env);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("good.toml: ok"), "{}", out.stdout);

    let out = cli(
        &["validate-config", "--config", missing.to_str().unwrap()],
        &env,
    );
    assert_eq!(out.code, Some(2));
    assert!(
        out.stderr.contains(&format!(
            "config file {} (from --config) cannot be read",
            missing.display()
        )) && out
            .stderr
            .contains("--config PATH or FLEET_RECONCILER_CONFIG"),
        "{}",
        out.stderr
    );

    let out = cli(
        &["validate-config"],
        &[("FLEET_RECONCILER_CONFIG", missing.to_str().unwrap())],
    );
    assert_eq!(out.code, Some(2));
    assert!(
        out.stderr.contains("(from FLEET_RECONCILER_CONFIG)"),
        "{}",
        out.stderr
    );

    // Neither: the image's path, whatever the working directory (a clone's
    // config/ is not picked up silently from the right directory only).
    let mut cmd = Command::new(BIN);
    let out = cmd
        .arg("validate-config")
        .env_remove("FLEET_RECONCILER_CONFIG")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !Path::new("/etc/fleet-reconciler/fleet-reconciler.toml").exists() {
        assert_eq!(out.status.code(), Some(2));
        assert!(
            stderr.contains("config file /etc/fleet-reconciler/fleet-reconciler.toml (from the default) cannot be read"),
            "{stderr}"
        );
    }
    // A relative path is shown as the absolute path tried.
    let out = Command::new(BIN)
        .args(["validate-config", "--config", "nope.toml"])
        .current_dir(dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{}", dir.join("nope.toml").display())),
        "{stderr}"
    );
}

/// Every Fly call carries its own app's token and no other: a call on an app
/// with no token of its own (and no fallback) is not sent at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sends_each_app_its_own_token_and_nothing_to_others() {
    let overlay = OverlayRepo::new();
    let sim = fleet(&overlay, SimMachine::new("coord0").stopped()).await;
    let tokens = FlyTokens {
        fallback: None,
        apps: [("agents", AGENTS_TOKEN), ("batch", BATCH_TOKEN)]
            .into_iter()
            .map(|(a, t)| (a.into(), t.into()))
            .collect(),
    };
    let fly = FlyClient::with_tokens(FlyClientConfig::new(&sim.api_url()), &tokens).unwrap();
    assert_eq!(fly.list_machines(&"agents".into()).await.unwrap().len(), 2);
    assert_eq!(fly.list_machines(&"batch".into()).await.unwrap().len(), 1);
    sim.clear_requests();
    let e = fly
        .list_machines(&"fleet-reconciler".into())
        .await
        .unwrap_err();
    assert!(matches!(e, FlyError::NoToken { .. }), "{e}");
    assert!(sim.requests().is_empty(), "nothing sent without a token");
    // With a fallback, the other apps get it (and only they).
    let fly = FlyClient::with_tokens(
        FlyClientConfig::new(&sim.api_url()),
        &FlyTokens {
            fallback: Some(COORD_TOKEN.into()),
            ..tokens
        },
    )
    .unwrap();
    fly.get_machine(&"fleet-reconciler".into(), &"coord0".into())
        .await
        .unwrap();
    fly.list_machines(&"agents".into()).await.unwrap();
    assert!(
        sim.requests().iter().all(|r| r.authorized),
        "{:#?}",
        sim.requests()
    );
    assert!(!format!("{fly:?}").contains("s3cret"));
    sim.shutdown().await;
}

/// `check` at trace level with a token per app: no token in its output, and
/// every Fly call authorized by its own app's token (the sim takes each for
/// its app only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_app_tokens_never_reach_logs_or_other_apps() {
    let overlay = OverlayRepo::new();
    let sim = fleet(&overlay, SimMachine::new("coord0").stopped()).await;
    let path = write(overlay.dir.path(), "c.toml", &config(&overlay, &sim));
    let mut env = good_env("http://127.0.0.1:9");
    env.push(("RUST_LOG".into(), "trace".into()));
    let out = cli_async(
        vec![
            "check".into(),
            "--config".into(),
            path.display().to_string(),
        ],
        env,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("list_machines") || out.stderr.contains("TRACE"),
        "trace logs were on"
    );
    for t in [AGENTS_TOKEN, BATCH_TOKEN, COORD_TOKEN] {
        assert!(
            !out.stdout.contains(t) && !out.stderr.contains(t),
            "{t} leaked"
        );
    }
    let apps = |handle: &SimHandle| {
        let mut seen: Vec<String> = handle
            .requests()
            .into_iter()
            .filter(|r| r.target == RequestTarget::FlyApi)
            .inspect(|r| {
                assert!(
                    r.authorized && r.credential == Credential::FlyToken,
                    "{r:?}"
                )
            })
            .filter_map(|r| r.app)
            .collect();
        seen.sort();
        seen.dedup();
        seen
    };
    // The coordinator's app too: a sweep reads its slots.
    assert_eq!(apps(&sim), ["agents", "batch", "fleet-reconciler"]);
    sim.shutdown().await;
}

/// The README's path, as a new user takes it: `demo --keep-running`, then
/// the `preflight` line it prints, run as printed: every check passes
/// against the simulated fleet while the demo's daemon works on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_passes_against_the_demo_as_the_readme_says() {
    let dir = tempfile::tempdir().unwrap();
    let stdout = dir.path().join("stdout.txt");
    // The built-in config, but not on port 9090: other tests' daemons
    // listen there by default.
    let demo_config = dir.path().join("demo.toml");
    let port = crate::common::free_port();
    let text = fleet_reconciler::demo::DEMO_CONFIG.replace(
        "listen = \"127.0.0.1:8080\"",
        &format!("listen = \"127.0.0.1:{port}\""),
    );
    assert_ne!(text, fleet_reconciler::demo::DEMO_CONFIG);
    std::fs::write(&demo_config, text).unwrap();
    let child = Command::new(BIN)
        .args(["demo", "--keep-running", "--demo-config"])
        .arg(&demo_config)
        .env_remove("FLEET_RECONCILER_CONFIG")
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let demo = crate::common::ChildGuard(child);
    let mut printed = String::new();
    crate::common::eventually(
        "the demo prints its preflight line",
        std::time::Duration::from_secs(60),
        async || {
            let text = std::fs::read_to_string(&stdout).unwrap_or_default();
            match text.lines().find(|l| l.contains(" preflight --config ")) {
                Some(line) => {
                    printed = line.trim().to_string();
                    true
                }
                None => false,
            }
        },
    )
    .await;
    // `VAR=value… fleet-reconciler preflight --config PATH`
    let all: Vec<&str> = printed.split_whitespace().collect();
    let vars: Vec<(String, String)> = all
        .iter()
        .map_while(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(vars.len(), 2, "the Fly token and the record key: {printed}");
    let words = &all[vars.len() - 1..];
    assert_eq!(
        &words[1..4],
        ["fleet-reconciler", "preflight", "--config"],
        "{printed}"
    );
    let config = words[4].to_string();
    assert!(Path::new(&config).is_file(), "{printed}");

    let out = cli_async(
        vec!["preflight".into(), "--config".into(), config.clone()],
        vars,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    for check in [
        "app agents-dispatch",
        "app agents-chat",
        "overlay branch release",
        "health agents-dispatch",
    ] {
        let (status, name) = check.split_once(' ').unwrap();
        out.line("ok  ", status, name);
    }
    out.line("ok  ", "coordinator", "fleet-reconciler/c00rd1na7e0 lease");

    // ctrl-c ends it cleanly, as the README says.
    let pid = demo.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let mut demo = demo;
    let status = tokio::task::spawn_blocking(move || demo.0.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// `[[alerts.alertmanager]]` (added with #20) is checked too: its variable,
/// its URL as `run` judges it, and a read of `/api/v2/status` (nothing is
/// posted). Before, a config with an Alertmanager failed every webhook line
/// ("cannot be set up": the notifier was built without the Alertmanager's
/// URL) and never checked the Alertmanager itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alertmanager_sink_is_checked_with_a_read_of_its_status() {
    let overlay = OverlayRepo::new();
    let sim = fleet(&overlay, SimMachine::new("coord0").stopped()).await;
    let (hooks, _) = receivers().await;
    // An Alertmanager at /am, and something else (404) at /gone.
    let posted = Arc::new(Mutex::new(0usize));
    let count = posted.clone();
    let app = Router::new().fallback(move |method: Method, uri: axum::http::Uri| {
        let count = count.clone();
        async move {
            if method == Method::POST {
                *count.lock().unwrap() += 1;
            }
            match (method.as_str(), uri.path()) {
                ("GET", "/am/api/v2/status") => (StatusCode::OK, r#"{"cluster":{}}"#),
                _ => (StatusCode::NOT_FOUND, "not found"),
            }
        }
    });
    let (am, path) = served_beside_the_config(
        app,
        &overlay,
        &sim,
        "am.toml",
        "[[alerts.alertmanager]]\nurl_env = \"AM_URL\"\n",
    )
    .await;
    let with = |url: Option<String>| env_with(&hooks, "AM_URL", url);

    let out = cli_async(args(&path, &[]), with(Some(format!("{am}/am/")))).await;
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    out.line("ok  ", "secret", "AM_URL");
    out.line(
        "ok  ",
        "alertmanager",
        "alerts.alertmanager[0]: the URL in AM_URL is usable",
    );
    out.line(
        "ok  ",
        "alertmanager",
        "alerts.alertmanager[0] status: GET /api/v2/status answered HTTP 200",
    );
    out.line(
        "ok  ",
        "webhook",
        "alerts.webhooks[0]: the URL in SLACK_URL",
    );
    assert_eq!(*posted.lock().unwrap(), 0, "preflight posted an alert");

    let out = cli_async(args(&path, &[]), with(Some(format!("{am}/gone")))).await;
    assert_eq!(out.code, Some(1), "{}", out.stdout);
    let (_, fix) = out.line(
        "FAIL",
        "alertmanager",
        "alerts.alertmanager[0] status: GET /api/v2/status answered HTTP 404",
    );
    assert!(fix.contains("AM_URL"), "{fix}");

    let out = cli_async(args(&path, &[]), with(None)).await;
    assert_eq!(out.code, Some(1), "{}", out.stdout);
    out.line("FAIL", "secret", "AM_URL");
    out.line("skip", "alertmanager", "alerts.alertmanager[0]");
    sim.shutdown().await;
}

/// The alert gate (`[gates.alertmanager]`, #36 item 4) is checked too: its
/// variable, its URL as `run` judges it, and one read of the alerts it
/// would hold claims on; an Alertmanager that does not answer fails, and
/// says every claim would be held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_alert_gate_is_checked_with_one_read_of_its_alerts() {
    let overlay = OverlayRepo::new();
    let sim = fleet(&overlay, SimMachine::new("coord0").stopped()).await;
    let (hooks, _) = receivers().await;
    let app = Router::new().fallback(move |method: Method, uri: axum::http::Uri| async move {
        match (method.as_str(), uri.path()) {
            ("GET", "/am/api/v2/alerts") => (
                StatusCode::OK,
                r#"[{"labels":{"alertname":"AgentErrorRate","severity":"critical","app":"agents"},"status":{"state":"active"}}]"#,
            ),
            _ => (StatusCode::NOT_FOUND, "not found"),
        }
    });
    let (am, path) = served_beside_the_config(
        app,
        &overlay,
        &sim,
        "gate.toml",
        "[gates.alertmanager]\nurl_env = \"AM_GATE_URL\"\nmatchers = ['severity=\"critical\"']\n",
    )
    .await;
    let with = |url: Option<String>| env_with(&hooks, "AM_GATE_URL", url);

    let out = cli_async(args(&path, &[]), with(Some(format!("{am}/am/")))).await;
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    out.line("ok  ", "secret", "AM_GATE_URL");
    out.line(
        "ok  ",
        "gate",
        "gates.alertmanager: the URL in AM_GATE_URL is usable",
    );
    out.line(
        "ok  ",
        "gate",
        r#"gates.alertmanager read: GET /api/v2/alerts answered: AgentErrorRate{app="agents"} fire(s) and would hold claims now"#,
    );

    let out = cli_async(args(&path, &[]), with(Some(format!("{am}/gone")))).await;
    assert_eq!(out.code, Some(1), "{}", out.stdout);
    let (line, fix) = out.line("FAIL", "gate", "gates.alertmanager read");
    assert!(
        line.contains("HTTP 404") && line.contains("fails closed"),
        "{line}"
    );
    assert!(fix.contains("AM_GATE_URL"), "{fix}");

    let out = cli_async(args(&path, &[]), with(None)).await;
    assert_eq!(out.code, Some(1), "{}", out.stdout);
    out.line("FAIL", "secret", "AM_GATE_URL");
    out.line("skip", "gate", "gates.alertmanager");
    sim.shutdown().await;
}

/// Issue 34 item 4: the CLI does not read flyctl's `FLY_API_TOKEN` (an
/// operator who exports it hands every later `fly` command the reconciler's
/// token); a Fly machine still may. A token that one variable holds for
/// several apps, refused for one of them, gets a fix that does not lock the
/// others out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flyctls_token_is_not_taken_and_a_shared_token_gets_a_fix_a_person_can_follow() {
    let overlay = OverlayRepo::new();
    let sim = fleet(&overlay, SimMachine::new("coord0").stopped()).await;
    let (hooks, _) = receivers().await;
    // agents and batch share fly.token_env, left at its default.
    let text = config(&overlay, &sim)
        .replace("token_env = \"AGENTS_FLY_TOKEN\"\n", "")
        .replace("token_env = \"BATCH_FLY_TOKEN\"\n", "");
    assert!(!text.contains("_FLY_TOKEN\"\nagent"), "{text}");
    let path = write(overlay.dir.path(), "shared.toml", &text);
    let base: Vec<(String, String)> = good_env(&hooks)
        .into_iter()
        .filter(|(k, _)| k != "AGENTS_FLY_TOKEN" && k != "BATCH_FLY_TOKEN")
        .collect();
    let with = |extra: &[(&str, &str)]| {
        let mut env = base.clone();
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env
    };

    // A workstation where flyctl's variable is set: not read.
    let out = cli_async(args(&path, &[]), with(&[("FLY_API_TOKEN", AGENTS_TOKEN)])).await;
    let (l, _) = out.line("FAIL", "secret", "FLEET_RECONCILER_FLY_TOKEN");
    assert!(
        l.contains("agents, batch") && l.contains("fly.token_env"),
        "{l}"
    );
    out.line(
        "skip",
        "app",
        "agents: not listed: no token in FLEET_RECONCILER_FLY_TOKEN",
    );

    // On a Fly machine, where flyctl does not run, it is.
    let out = cli_async(
        args(&path, &[]),
        with(&[
            ("FLY_API_TOKEN", AGENTS_TOKEN),
            ("FLY_MACHINE_ID", "e286065f969386"),
        ]),
    )
    .await;
    out.line(
        "ok  ",
        "secret",
        "FLEET_RECONCILER_FLY_TOKEN: not set, FLY_API_TOKEN is read instead",
    );
    out.line(
        "ok  ",
        "app",
        "agents: listed with the token in FLY_API_TOKEN",
    );

    // The shared variable holds agents' deploy token: refused for batch.
    let out = cli_async(
        args(&path, &[]),
        with(&[("FLEET_RECONCILER_FLY_TOKEN", AGENTS_TOKEN)]),
    )
    .await;
    assert_eq!(out.code, Some(1), "{}\n{}", out.stdout, out.stderr);
    out.line(
        "ok  ",
        "app",
        "agents: listed with the token in FLEET_RECONCILER_FLY_TOKEN",
    );
    let (l, fix) = out.line("FAIL", "app", "batch");
    assert!(
        l.contains("FLEET_RECONCILER_FLY_TOKEN") && l.contains("401"),
        "{l}"
    );
    for part in [
        // The variable, its key, and who else it serves.
        "the token in FLEET_RECONCILER_FLY_TOKEN (fly.token_env) is not accepted for app batch",
        "also holds the token of agents",
        // The command, and a variable for batch alone, named in the config.
        "`fly tokens create deploy -a batch`",
        "FLY_TOKEN_BATCH",
        "`fly secrets set FLY_TOKEN_BATCH=…`",
        "`export FLY_TOKEN_BATCH=…`",
        "token_env = \"FLY_TOKEN_BATCH\" under the [[apps]] entry of batch (apps[1].token_env)",
        "fly tokens create org",
    ] {
        assert!(fix.contains(part), "{part:?} not in {fix}");
    }
    sim.shutdown().await;
}

/// Issue 34 item 5: Fly answering 429 during preflight (here the
/// coordinator's lease, the check that failed two of six back-to-back runs)
/// is retried at Fly's pace, and when it does not stop it is reported as
/// rate limiting with its own fix, never as an unreachable API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_lease_check_is_retried_and_then_reported_as_rate_limiting() {
    use fleet_reconciler::sim::ChaosFault;
    let overlay = OverlayRepo::new();
    let sim = fleet(&overlay, SimMachine::new("coord0").stopped()).await;
    let (hooks, _) = receivers().await;
    let path = write(overlay.dir.path(), "ok.toml", &config(&overlay, &sim));

    // Two 429s (Retry-After: 1) in a row: the third attempt takes it.
    for _ in 0..2 {
        sim.fault_next_call("coord0", "POST", "lease", ChaosFault::TooManyRequests);
    }
    let out = cli_async(args(&path, &[]), good_env(&hooks)).await;
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout, out.stderr);
    out.line(
        "ok  ",
        "coordinator",
        "fleet-reconciler/coord0 lease: leasable: taken and released",
    );

    // Throttled for good: a bounded number of attempts, then rate limiting.
    for _ in 0..30 {
        sim.fault_next_call("coord0", "POST", "lease", ChaosFault::TooManyRequests);
    }
    let out = cli_async(args(&path, &[]), good_env(&hooks)).await;
    assert_eq!(out.code, Some(1), "{}\n{}", out.stdout, out.stderr);
    let (l, fix) = out.line("FAIL", "coordinator", "fleet-reconciler/coord0 lease");
    assert!(l.contains("rate limited"), "{l}");
    assert!(
        fix.contains("Fly is rate-limiting") && fix.contains("COORD_FLY_TOKEN"),
        "{fix}"
    );
    assert!(fix.contains("re-run"), "{fix}");
    assert!(!fix.contains("fly.api_url"), "{fix}");
    let attempts = sim
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.action.as_deref() == Some("lease"))
        .count();
    // 3 in the first run; in the second a bounded number, not 30.
    assert!((4..=11).contains(&attempts), "{attempts} lease attempts");
    sim.shutdown().await;
}

/// Issue 34 item 7: `validate-config --check-env` names one problem per
/// line, and under `--output json` gives them as an array.
#[test]
fn check_env_problems_are_one_per_line_and_a_json_array() {
    let overlay = OverlayRepo::new();
    let dir = overlay.dir.path();
    // A pool acts and there is no coordinator; the record key and two
    // variables are unset.
    let text = overlay
        .config("http://127.0.0.1:9", "mirror.git")
        .app("agents", None)
        .with("token_env = \"AGENTS_FLY_TOKEN\"\nagent_token_env = \"AGENT_TOKEN\"")
        .text();
    let path = write(dir, "problems.toml", &text);
    let p = path.to_str().unwrap();
    let out = cli(&["validate-config", "--check-env", "--config", p], &[]);
    assert_eq!(out.code, Some(2));
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert_eq!(
        lines.first().copied(),
        Some("error: 4 problem(s) for `run`:"),
        "{}",
        out.stderr
    );
    for (line, named) in lines[1..].iter().zip([
        "rotation.coordinator",
        "FLEET_RECONCILER_RECORD_KEY",
        "AGENTS_FLY_TOKEN",
        "AGENT_TOKEN",
    ]) {
        assert!(
            line.starts_with("  ") && line.contains(named),
            "{named}: {line}"
        );
    }
    assert_eq!(lines.len(), 5, "{}", out.stderr);

    let out = cli(
        &[
            "validate-config",
            "--check-env",
            "-o",
            "json",
            "--config",
            p,
        ],
        &[],
    );
    assert_eq!(out.code, Some(2));
    let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    let problems = v["problems"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(problems.len(), 4, "{v}");
    assert!(
        problems[2].as_str().unwrap().contains("AGENTS_FLY_TOKEN"),
        "{v}"
    );
}

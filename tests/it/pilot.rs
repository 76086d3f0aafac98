//! docs/pilot.md followed end to end (issue 34 item 3): the `fleet-reconciler`
//! commands of its "Week 1" and "Week 2" sections, taken from the page's
//! code blocks (so page and test cannot drift), run against the simulator
//! with `config/pilot-observe.toml` and the page's TOML edits. Week 1
//! touches nothing (no Fly write, no restart, no cordon) while `plan` shows
//! each drift; week 2 rotates the canary pool and only it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use axum::Router;
use axum::routing::any;
use fleet_reconciler::metadata::MARKER_KEY;
use fleet_reconciler::sim::{RequestTarget, Sim, SimApp, SimFleet, SimHandle, SimMachine};

use crate::common::{ChildGuard, OverlayRepo, eventually, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");
const FLY_TOKEN: &str = "fly-token-pilot";
/// The path the page writes for your copy of the config.
const DOC_CONFIG: &str = "config/production.toml";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The text of the `## Week N` section of docs/pilot.md.
fn section(doc: &str, heading: &str) -> String {
    let start = doc
        .find(&format!("\n## {heading}"))
        .unwrap_or_else(|| panic!("docs/pilot.md has no section `## {heading}`"));
    let rest = &doc[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3);
    rest[..end].to_string()
}

/// The bodies of the fenced code blocks of `lang` in `text`.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match &mut current {
            None if line.trim_start() == format!("```{lang}") => current = Some(String::new()),
            None => {}
            Some(_) if line.trim_start().starts_with("```") => out.extend(current.take()),
            Some(body) => {
                body.push_str(line);
                body.push('\n');
            }
        }
    }
    out
}

/// The `fleet-reconciler …` command lines of a section's `sh` blocks, as
/// argument lists (comments dropped).
fn commands(section: &str) -> Vec<Vec<String>> {
    blocks(section, "sh")
        .iter()
        .flat_map(|b| b.lines().map(str::to_owned).collect::<Vec<_>>())
        .filter_map(|l| {
            let l = l.split(" #").next().unwrap_or("").trim().to_string();
            let words: Vec<String> = l.split_whitespace().map(str::to_owned).collect();
            (words.first().map(String::as_str) == Some("fleet-reconciler"))
                .then(|| words[1..].to_vec())
        })
        .collect()
}

/// The section's TOML edits: blocks whose first line is
/// `# config/production.toml, [TABLE]`, as (table path, keys).
fn edits(section: &str) -> Vec<(Vec<String>, toml::Table)> {
    blocks(section, "toml")
        .iter()
        .map(|b| {
            let first = b.lines().next().unwrap_or("");
            let table = first
                .strip_prefix(&format!("# {DOC_CONFIG}, ["))
                .and_then(|t| t.strip_suffix(']'))
                .unwrap_or_else(|| panic!("a TOML block of docs/pilot.md does not say which table of {DOC_CONFIG} it edits: {first:?}"));
            let keys: toml::Table = b.parse().unwrap();
            (table.split('.').map(str::to_owned).collect(), keys)
        })
        .collect()
}

fn table<'a>(t: &'a mut toml::Table, path: &[&str]) -> &'a mut toml::Table {
    let mut t = t;
    for key in path {
        t = t
            .entry(key.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .unwrap();
    }
    t
}

/// config/pilot-observe.toml pointed at the simulator, the test's overlay
/// repository and loopback receivers, sweeping fast; nothing else changed.
fn observe_config(sim: &Sim, overlay: &OverlayRepo, port: u16) -> toml::Table {
    let text = std::fs::read_to_string(root().join("config/pilot-observe.toml")).unwrap();
    let mut c: toml::Table = text.parse().unwrap();
    table(&mut c, &["fly"]).insert("api_url".into(), sim.api_url().into());
    let o = table(&mut c, &["overlay"]);
    o.insert(
        "repo".into(),
        overlay.repo_path.display().to_string().into(),
    );
    o.insert(
        "mirror_dir".into(),
        overlay
            .dir
            .path()
            .join("mirror.git")
            .display()
            .to_string()
            .into(),
    );
    o.insert("fetch_interval".into(), "1s".into());
    o.remove("token_env");
    for app in c["apps"].as_array_mut().unwrap() {
        let app = app.as_table_mut().unwrap();
        app.insert("health_url".into(), sim.health_url_template().into());
        // Every app on fly.token_env: the simulator has one token.
        app.remove("token_env");
    }
    table(&mut c, &["sweep"]).insert("interval".into(), "300ms".into());
    table(&mut c, &["probe"]).insert("timeout".into(), "1s".into());
    table(&mut c, &["rotation"]).insert("min_drift_age".into(), "0s".into());
    table(&mut c, &["server"]).insert("listen".into(), format!("127.0.0.1:{port}").into());
    c
}

/// A receiver that accepts anything (the webhook and heartbeat URLs).
async fn receiver() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, Router::new().fallback(any(|| async { "ok" })))
            .await
            .unwrap()
    });
    format!("http://{addr}")
}

struct Env {
    vars: Vec<(String, String)>,
}

impl Env {
    /// Every variable the config names, as `validate-config --check-env` wants them.
    fn for_config(c: &toml::Table, receiver: &str) -> Env {
        let token_var = c["fly"]["token_env"].as_str().unwrap().to_string();
        let mut vars = vec![(token_var, FLY_TOKEN.to_string())];
        for (i, w) in c["alerts"]["webhooks"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            vars.push((
                w["url_env"].as_str().unwrap().to_string(),
                format!("{receiver}/hook{i}"),
            ));
        }
        for h in c["alerts"]["heartbeat"].as_array().unwrap() {
            vars.push((
                h["url_env"].as_str().unwrap().to_string(),
                format!("{receiver}/heartbeat"),
            ));
        }
        Env { vars }
    }

    fn command(&self, args: &[String], config: &Path) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args.iter().map(|a| {
            if a == DOC_CONFIG {
                config.display().to_string()
            } else {
                a.clone()
            }
        }));
        cmd.env_remove("FLY_API_TOKEN");
        cmd.envs(self.vars.iter().map(|(k, v)| (k, v)));
        cmd
    }

    fn output(&self, args: &[String], config: &Path) -> Output {
        self.command(args, config)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }
}

fn write(c: &toml::Table, path: &Path) -> PathBuf {
    std::fs::write(path, toml::to_string(c).unwrap()).unwrap();
    path.to_path_buf()
}

/// The one-shot commands of a week (all but `run`), each checked by its kind.
fn run_one_shots(env: &Env, cmds: &[Vec<String>], config: &Path) -> Vec<(String, Output)> {
    let mut outputs = Vec::new();
    for args in cmds.iter().filter(|a| a[0] != "run") {
        let out = env.output(args, config);
        let code = out.status.code();
        let shown = format!(
            "fleet-reconciler {}: {:?}\n{}{}",
            args.join(" "),
            code,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        match args[0].as_str() {
            // Drift is exit 1: the fleet is behind, as it should be here.
            "check" | "plan" => assert!(matches!(code, Some(0 | 1)), "{shown}"),
            // preflight's health sample and mirror lines depend on the place.
            "preflight" => assert!(matches!(code, Some(0 | 1)), "{shown}"),
            _ => assert_eq!(code, Some(0), "{shown}"),
        }
        outputs.push((args[0].clone(), out));
    }
    outputs
}

/// Runs the page's `run` line until `done` holds, then stops it (SIGTERM).
async fn run_daemon(
    env: &Env,
    cmds: &[Vec<String>],
    config: &Path,
    port: u16,
    done: impl AsyncFnMut() -> bool,
) {
    let args = cmds
        .iter()
        .find(|a| a[0] == "run")
        .expect("docs/pilot.md shows `fleet-reconciler run`");
    let mut child = ChildGuard(
        env.command(args, config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let ready = format!("http://127.0.0.1:{port}/readyz");
    eventually("the daemon is ready", Duration::from_secs(60), async || {
        reqwest::get(&ready).await.is_ok_and(|r| r.status() == 200)
    })
    .await;
    eventually("the week's outcome", Duration::from_secs(120), done).await;
    let pid = child.0.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let _ = child.0.wait();
}

fn successful_sweeps(text: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with("fleet_reconciler_sweeps_total{result=\"success\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// The table row of machine `id` in `plan`'s text output.
fn row<'a>(plan: &'a str, id: &str) -> &'a str {
    plan.lines()
        .find(|l| l.split_whitespace().nth(1) == Some(id))
        .unwrap_or_else(|| panic!("plan shows {id}:\n{plan}"))
}

fn untouched(sim: &SimHandle, id: &str, old: &str) {
    let m = sim.machine(id).unwrap();
    assert_eq!(m.restart_count, 0, "{id} restarted");
    assert!(!m.cordoned, "{id} cordoned");
    assert!(!m.metadata.contains_key(MARKER_KEY), "{id} has a marker");
    assert_eq!(m.loaded_ref, old, "{id} changed ref");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docs_pilot_md_week_1_observes_and_week_2_rotates_only_the_canary_pool() {
    let doc = std::fs::read_to_string(root().join("docs/pilot.md")).unwrap();
    let (week1, week2) = (section(&doc, "Week 1"), section(&doc, "Week 2"));
    let (cmds1, cmds2) = (commands(&week1), commands(&week2));
    assert!(
        cmds1.iter().any(|a| a[0] == "plan") && cmds1.iter().any(|a| a[0] == "check"),
        "week 1 shows check and plan: {cmds1:?}"
    );
    assert!(
        blocks(&week1, "sh")
            .iter()
            .any(|b| b.contains("cp config/pilot-observe.toml config/production.toml")),
        "week 1 starts from the observe config"
    );

    let overlay = OverlayRepo::new();
    let (tip, old) = (overlay.tip(), overlay.behind(1));
    let machine = |id: &str| SimMachine::new(id).loaded(old.clone());
    let sim = Sim::start(
        SimFleet::new(FLY_TOKEN)
            .release_tip(tip.clone())
            .restart_delay(Duration::from_millis(100))
            .record_requests(true)
            .app(
                SimApp::new("agents-prod")
                    .machine(machine("c1").metadata("pool", "canary"))
                    .machine(machine("c2").metadata("pool", "canary"))
                    .machine(machine("p1"))
                    .machine(machine("p2").metadata("pool", "dispatch")),
            )
            .app(SimApp::new("agents-batch").machine(machine("b1")))
            .app(SimApp::new("fleet-reconciler").machine(SimMachine::new("coord0").stopped())),
    )
    .await
    .unwrap();
    let receiver = receiver().await;
    let port = free_port();
    let dir = overlay.dir.path();

    // Week 1: the observe config as shipped.
    let week1_config = observe_config(&sim, &overlay, port);
    let env = Env::for_config(&week1_config, &receiver);
    let config = write(&week1_config, &dir.join("production.toml"));
    let outputs = run_one_shots(&env, &cmds1, &config);
    let plan = outputs
        .iter()
        .find(|(c, _)| c == "plan")
        .map(|(_, o)| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap();
    for id in ["c1", "c2", "p1", "p2", "b1"] {
        let line = row(&plan, id);
        assert!(line.contains("observe"), "{id} observed:\n{plan}");
    }
    sim.clear_requests();
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    run_daemon(&env, &cmds1, &config, port, async || {
        match reqwest::get(&metrics).await {
            Ok(r) => successful_sweeps(&r.text().await.unwrap_or_default()) >= 8,
            Err(_) => false,
        }
    })
    .await;
    for id in ["c1", "c2", "p1", "p2", "b1"] {
        untouched(&sim, id, &old);
    }
    let writes: Vec<String> = sim
        .requests()
        .into_iter()
        .filter(|r| r.target == RequestTarget::FlyApi && r.method != "GET")
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(writes.is_empty(), "week 1 wrote to Fly: {writes:?}");
    let agent_posts: Vec<String> = sim
        .requests()
        .into_iter()
        .filter(|r| r.target == RequestTarget::Agent && r.method != "GET")
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(
        agent_posts.is_empty(),
        "week 1 drained an agent: {agent_posts:?}"
    );

    // Week 2: the page's edits to the same file; the coordinator is the
    // simulator's.
    let mut week2_config = week1_config.clone();
    let edits2 = edits(&week2);
    assert!(!edits2.is_empty(), "week 2 shows its config edits");
    for (path, keys) in edits2 {
        let path: Vec<&str> = path.iter().map(String::as_str).collect();
        let t = table(&mut week2_config, &path);
        for (k, v) in keys {
            t.insert(k, v);
        }
    }
    let coordinator = table(&mut week2_config, &["rotation"])
        .get_mut("coordinator")
        .expect("week 2 names the coordination machine");
    assert!(coordinator.as_str().unwrap().contains("<its id>"));
    *coordinator = "fleet-reconciler/coord0".into();
    let config = write(&week2_config, &dir.join("production.toml"));
    // Week 2 acts, so it needs the record key the doc has the operator make.
    let key_env = "FLEET_RECONCILER_RECORD_KEY";
    assert!(
        blocks(&week2, "sh")
            .iter()
            .any(|b| b.contains(&format!("export {key_env}="))),
        "week 2 makes the record key"
    );
    let mut env = env;
    env.vars.push((
        key_env.into(),
        fleet_reconciler::sim::DEFAULT_RECORD_KEY.into(),
    ));
    let outputs = run_one_shots(&env, &cmds2, &config);
    let plan = outputs
        .iter()
        .find(|(c, _)| c == "plan")
        .map(|(_, o)| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap();
    for id in ["p1", "p2", "b1"] {
        let line = row(&plan, id);
        assert!(line.contains("observe"), "{id} still observed:\n{plan}");
    }
    for id in ["c1", "c2"] {
        let line = row(&plan, id);
        assert!(!line.contains("observe"), "{id} acts in week 2:\n{plan}");
    }
    run_daemon(&env, &cmds1, &config, port, async || {
        ["c1", "c2"].iter().all(|id| {
            sim.machine(id).is_some_and(|m| {
                m.loaded_ref == tip && !m.cordoned && !m.metadata.contains_key(MARKER_KEY)
            })
        })
    })
    .await;
    for id in ["p1", "p2", "b1"] {
        untouched(&sim, id, &old);
    }
    sim.shutdown().await;
}

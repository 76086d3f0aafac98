//! `fleet-reconciler demo`: the daemon's sweep loop against a simulated fleet.
//!
//! Owns the demo scenario: a temporary overlay repository with a real history
//! (a merged feature branch, a `policies/` change, a `Security:` trailer, a
//! canary branch), a simulated Fly API with a few dozen agents in two apps and
//! three pools, and a release that ships while the demo runs. It must never
//! reach beyond loopback or need a credential.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use git2::{FileMode, Oid, Repository, Signature, Time};
use tokio_util::sync::CancellationToken;

use crate::act::operator::Operator;
use crate::config::{Config, HealthUrlTemplate};
use crate::daemon::{self, Secrets, SweepOutcome};
use crate::decide::decision::Decision;
use crate::metadata::operator::{Approval, ApprovalMode};
use crate::report::render;
use crate::report::wire::FleetDocument;
use crate::service::{self, ServiceSecrets};
use crate::sim::{Behaviour, Sim, SimApp, SimFleet, SimMachine};

/// The built-in demo config (`config/demo.toml`).
pub const DEMO_CONFIG: &str = include_str!("../config/demo.toml");

/// The variable `--alertmanager` stands for (the URL is passed, not read).
pub const DEMO_ALERTMANAGER_ENV: &str = "DEMO_ALERTMANAGER_URL";

/// What one demo agent reports as its overlay ref: not a commit id, and
/// markup (a bad report whose detail quotes it; the status and machine pages
/// must show it escaped).
pub const DEMO_MARKUP_REF: &str = "<script>alert(1)</script>";

pub struct DemoOptions {
    pub config_path: PathBuf,
    pub config_text: String,
    /// Sweeps before exiting; 0 runs until the fleet settles (or ctrl-c).
    pub sweeps: u32,
    /// With `sweeps` 0: keep serving after the fleet settles, until ctrl-c
    /// (for `preflight` or `check` against the simulated fleet).
    pub keep_running: bool,
    /// `--alertmanager`: also post the alerts to this Alertmanager.
    pub alertmanager: Option<String>,
    /// `--verbose`: the full table each sweep, not one line.
    pub verbose: bool,
}

/// The demo's stdout. A reader that goes away (`demo | head`) ends the
/// demo quietly, as `ls` ends, instead of a panic in `println!`: the
/// first write that fails stops the demo (its temporary directory is
/// removed as on ctrl-c) and nothing more is written.
#[derive(Clone)]
struct Say {
    stop: CancellationToken,
    closed: Arc<std::sync::atomic::AtomicBool>,
}

impl Say {
    fn new(stop: CancellationToken) -> Say {
        Say {
            stop,
            closed: Arc::default(),
        }
    }

    /// Writes `text` and a newline.
    fn line(&self, text: impl std::fmt::Display) {
        self.text(format_args!("{text}\n"));
    }

    /// Writes `text` as it is.
    fn text(&self, text: impl std::fmt::Display) {
        use std::io::Write as _;
        use std::sync::atomic::Ordering;
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        let mut out = std::io::stdout().lock();
        if write!(out, "{text}").and_then(|()| out.flush()).is_err() {
            self.closed.store(true, Ordering::Relaxed);
            self.stop.cancel();
        }
    }
}

/// The variable holding the simulated fleet's Fly token in the config the
/// demo writes for `preflight` (not `FLY_API_TOKEN`: a real one may be set).
pub const DEMO_TOKEN_ENV: &str = "DEMO_FLY_TOKEN";
/// The token the simulated Fly API accepts.
pub const DEMO_TOKEN: &str = "demo-token";
/// The config the demo writes into its temporary directory: the demo's own,
/// pointed at the simulated fleet.
pub const DEMO_TARGET_CONFIG: &str = "fleet-reconciler.toml";

/// The demo config as `run`, `check` or `preflight` can use it against the
/// simulated fleet: `text` with the addresses the demo chose.
fn target_config(text: &str, config: &Config) -> anyhow::Result<String> {
    let mut doc: toml::Table = toml::from_str(text).context("the demo config is not TOML")?;
    let table = |doc: &mut toml::Table, key: &str| -> anyhow::Result<toml::Table> {
        match doc.remove(key) {
            None => Ok(toml::Table::new()),
            Some(toml::Value::Table(t)) => Ok(t),
            Some(_) => anyhow::bail!("the demo config's `{key}` is not a table"),
        }
    };
    let mut fly = table(&mut doc, "fly")?;
    fly.insert("api_url".into(), config.fly.api_url.clone().into());
    fly.insert("token_env".into(), DEMO_TOKEN_ENV.into());
    doc.insert("fly".into(), fly.into());
    let mut overlay = table(&mut doc, "overlay")?;
    overlay.insert("repo".into(), config.overlay.repo.to_string().into());
    overlay.insert(
        "mirror_dir".into(),
        config.overlay.mirror_dir.display().to_string().into(),
    );
    doc.insert("overlay".into(), overlay.into());
    if let Some(toml::Value::Array(apps)) = doc.get_mut("apps") {
        for (app, configured) in apps.iter_mut().zip(&config.apps) {
            if let toml::Value::Table(app) = app {
                app.insert(
                    "health_url".into(),
                    configured.health_url.as_str().to_string().into(),
                );
            }
        }
    }
    let mut rotation = table(&mut doc, "rotation")?;
    if let Some(c) = &config.rotation.coordinator {
        rotation.insert("coordinator".into(), c.to_string().into());
    }
    doc.insert("rotation".into(), rotation.into());
    Ok(format!(
        "# Written by `fleet-reconciler demo`: its config, pointed at the simulated\n# fleet of this run (gone when the demo stops). The token is in {DEMO_TOKEN_ENV}.\n\n{}",
        toml::to_string(&doc)?
    ))
}

/// A bare repository that stands in for the overlay's git host.
pub struct DemoRepo {
    repo: Repository,
    clock: i64,
}

/// Commits of the demo history that machines are pinned to.
pub struct DemoHistory {
    /// Linear-ish history of `release`, oldest first (merge commit included).
    pub release: Vec<Oid>,
    /// Index in `release` of the `policies/` change and the `Security:` commit.
    pub policy_change: usize,
    pub security_fix: usize,
    /// Tip of the `canary` branch (two commits not on `release`).
    pub canary: Oid,
}

impl DemoRepo {
    pub fn create(path: &Path) -> Result<DemoRepo, git2::Error> {
        Ok(DemoRepo {
            repo: Repository::init_bare(path)?,
            clock: 1_793_000_000,
        })
    }

    /// Commits `files` (path, content) on top of `parents` and moves `branch`.
    pub fn commit(
        &mut self,
        branch: &str,
        parents: &[Oid],
        files: &[(&str, &str)],
        message: &str,
    ) -> Result<Oid, git2::Error> {
        let base = match parents.first() {
            Some(p) => Some(self.repo.find_commit(*p)?.tree()?),
            None => None,
        };
        let mut update = git2::build::TreeUpdateBuilder::new();
        for (path, content) in files {
            let blob = self.repo.blob(content.as_bytes())?;
            update.upsert(*path, blob, FileMode::Blob);
        }
        let tree_id = match &base {
            Some(tree) => update.create_updated(&self.repo, tree)?,
            None => {
                let empty = self.repo.treebuilder(None)?.write()?;
                update.create_updated(&self.repo, &self.repo.find_tree(empty)?)?
            }
        };
        let tree = self.repo.find_tree(tree_id)?;
        // Fixed clock: the same history (and commit ids) on every run.
        self.clock += 3600;
        let sig = Signature::new(
            "Overlay Bot",
            "overlay@example.com",
            &Time::new(self.clock, 0),
        )?;
        let parents: Vec<git2::Commit<'_>> = parents
            .iter()
            .map(|p| self.repo.find_commit(*p))
            .collect::<Result<_, _>>()?;
        let parent_refs: Vec<&git2::Commit<'_>> = parents.iter().collect();
        let oid = self
            .repo
            .commit(None, &sig, &sig, message, &tree, &parent_refs)?;
        self.repo
            .reference(&format!("refs/heads/{branch}"), oid, true, message)?;
        Ok(oid)
    }

    /// The history the demo fleet is spread over (commits made in a fixed
    /// order: the same ids on every run).
    pub fn build_history(&mut self) -> Result<DemoHistory, git2::Error> {
        let mut release = Vec::new();
        self.on_release(
            &mut release,
            &[
                ("README.md", "# agent overlay\n"),
                ("skills/search.md", "search v1\n"),
                ("connectors/github.yaml", "scopes: [repo]\n"),
                ("policies/tools.yaml", "allow: [search, shell]\n"),
                ("guards/pii.yaml", "redact: [email]\n"),
            ],
            "Initial overlay",
        )?;
        for i in 1..=4 {
            self.on_release(
                &mut release,
                &[("skills/search.md", &format!("search v1.{i}\n"))],
                &format!("Tune search skill prompt ({i})"),
            )?;
        }
        self.merge_feature_branch(&mut release)?;
        let policy_change = release.len();
        self.on_release(
            &mut release,
            &[("policies/tools.yaml", "allow: [search]\ndeny: [shell]\n")],
            "Deny the shell tool in untrusted sessions",
        )?;
        for i in 1..=3 {
            self.on_release(
                &mut release,
                &[("skills/summarize.md", &format!("summarize v2.{i}\n"))],
                &format!("Summarize: wording ({i})"),
            )?;
        }
        let security_fix = release.len();
        self.on_release(
            &mut release,
            &[("connectors/github.yaml", "scopes: [repo, read:org]\ntoken_ref: vault://gh\n")],
            "GitHub connector: load token from vault\n\nThe token was readable from the skill sandbox.\n\nSecurity: CVE-2026-4242\nReviewed-by: sec-team",
        )?;
        for i in 1..=22 {
            self.on_release(
                &mut release,
                &[(
                    &format!("skills/notes/{i:02}.md") as &str,
                    &format!("note {i}\n") as &str,
                )],
                &format!("Add skill note {i}"),
            )?;
        }
        let canary = self.canary_branch(release[release.len() - 3])?;
        Ok(DemoHistory {
            release,
            policy_change,
            security_fix,
            canary,
        })
    }

    /// Commits `files` on `release` on top of its last commit (none: a root
    /// commit) and appends it.
    fn on_release(
        &mut self,
        release: &mut Vec<Oid>,
        files: &[(&str, &str)],
        message: &str,
    ) -> Result<Oid, git2::Error> {
        let parents: Vec<Oid> = release.last().copied().into_iter().collect();
        let oid = self.commit("release", &parents, files, message)?;
        release.push(oid);
        Ok(oid)
    }

    /// A feature branch merged back (a merge commit in the range), with a
    /// release commit made while it was open.
    fn merge_feature_branch(&mut self, release: &mut Vec<Oid>) -> Result<(), git2::Error> {
        let base: Vec<Oid> = release.last().copied().into_iter().collect();
        let f1 = self.commit(
            "feat/summarize",
            &base,
            &[("skills/summarize.md", "summarize v1\n")],
            "Add summarize skill",
        )?;
        let f2 = self.commit(
            "feat/summarize",
            &[f1],
            &[("skills/summarize.md", "summarize v2\n")],
            "Summarize: cap output length",
        )?;
        let meanwhile = self.on_release(
            release,
            &[("connectors/github.yaml", "scopes: [repo, read:org]\n")],
            "GitHub connector: read org membership",
        )?;
        let merge = self.commit(
            "release",
            &[meanwhile, f2],
            &[],
            "Merge branch 'feat/summarize' into release",
        )?;
        release.push(merge);
        Ok(())
    }

    /// The `canary` branch: two commits on `base`, not on `release`; its tip.
    fn canary_branch(&mut self, base: Oid) -> Result<Oid, git2::Error> {
        let c1 = self.commit(
            "canary",
            &[base],
            &[("skills/search.md", "search v2 (canary)\n")],
            "Canary: new search ranking",
        )?;
        self.commit(
            "canary",
            &[c1],
            &[("skills/search.md", "search v2.1 (canary)\n")],
            "Canary: ranking fix",
        )
    }
}

/// Machines of one demo app, spread over the history and every agent behaviour.
/// `busy_while` is how long the agent that alert-and-wait waits for works.
fn demo_machines(
    app_index: usize,
    pool: &str,
    h: &DemoHistory,
    busy_while: std::time::Duration,
) -> Vec<SimMachine> {
    let n = h.release.len();
    let tip = h.release[n - 1];
    let regions = ["iad", "ams", "sin", "syd", "gru"];
    let at = |back: usize| h.release[n - 1 - back].to_string();
    let mut specs: Vec<(String, Option<usize>, Behaviour)> = vec![
        (tip.to_string(), None, Behaviour::Normal),
        (tip.to_string(), Some(7), Behaviour::Normal),
        (tip.to_string(), Some(12), Behaviour::Normal),
        // Busy for an hour: in `dispatch`, restart interrupts it after its grace.
        (
            tip.to_string(),
            None,
            Behaviour::BusyFor(std::time::Duration::from_secs(3600)),
        ),
        (tip.to_string(), Some(7), Behaviour::Normal),
        // Busy for a while: in `default`, alert-and-wait waits for it.
        (tip.to_string(), None, Behaviour::BusyFor(busy_while)),
        (tip.to_string(), Some(7), Behaviour::Normal),
        (at(1), Some(7), Behaviour::Normal),
        (at(2), None, Behaviour::Normal),
        (at(6), Some(9), Behaviour::Normal),
        (
            h.release[h.security_fix + 1].to_string(),
            Some(7),
            Behaviour::Normal,
        ),
        (
            h.release[h.policy_change].to_string(),
            Some(7),
            Behaviour::Normal,
        ),
        (h.release[2].to_string(), Some(7), Behaviour::Normal),
    ];
    if app_index == 0 {
        specs.push((h.canary.to_string(), Some(7), Behaviour::Normal));
        specs.push((
            "deadbeefdeadbeefdeadbeefdeadbeefdeadbeef".into(),
            None,
            Behaviour::Normal,
        ));
        specs.push((tip.to_string(), None, Behaviour::Hang));
        specs.push((tip.to_string(), None, Behaviour::Garbage));
    } else {
        // A ref that is not hex, and is markup: the pages must show it as text.
        specs.push((DEMO_MARKUP_REF.to_string(), None, Behaviour::Normal));
        specs.push((tip.to_string(), None, Behaviour::MissingRef));
        specs.push((at(3), Some(7), Behaviour::Normal));
        specs.push((tip.to_string(), None, Behaviour::Oversized));
    }
    let mut machines: Vec<SimMachine> = specs
        .into_iter()
        .enumerate()
        .map(|(i, (loaded, abbrev, behaviour))| {
            let mut m = SimMachine::new(format!(
                "{}{:02}{:08x}",
                app_index + 1,
                i,
                0x5e1f_0000u32 + i as u32
            ))
            .name(format!("agent-{}-{i:02}", ["d", "c"][app_index % 2]))
            .region(regions[i % regions.len()])
            .loaded(loaded)
            .behaviour(behaviour);
            if let Some(len) = abbrev {
                m = m.report_ref_len(len);
            }
            // One agent per app takes part in the drain handshake.
            if i == 8 {
                m = m.cooperative();
            }
            // Every third machine has no pool key: it falls in the default pool.
            if i % 3 != 2 {
                m = m.metadata("pool", pool);
            }
            m
        })
        .collect();
    for j in 0..2 {
        machines.push(
            SimMachine::new(format!("{}9{j}{:08x}", app_index + 1, 0x0ff0_0000u32 + j))
                .name(format!("agent-{}-stopped-{j}", ["d", "c"][app_index % 2]))
                .region(regions[j as usize])
                .loaded(at(8))
                .stopped(),
        );
    }
    machines
}

/// The simulated world one demo run acts on: its temporary directory (gone
/// when dropped), the overlay repository and its tip, the simulated fleet.
struct DemoWorld {
    work: tempfile::TempDir,
    repo: DemoRepo,
    repo_path: PathBuf,
    /// The release tip before the demo advances it.
    tip: Oid,
    sim: Sim,
}

/// Runs the demo until `sweeps` sweeps have been shown or ctrl-c.
pub async fn run(options: DemoOptions) -> anyhow::Result<()> {
    let mut config = Config::parse(&options.config_path, &options.config_text)?;
    let DemoWorld {
        work,
        repo,
        repo_path,
        tip,
        sim,
    } = start_world(&mut config).await?;
    let alertmanager_urls = add_alertmanager(&mut config, options.alertmanager.as_deref());
    let target = work.path().join(DEMO_TARGET_CONFIG);
    std::fs::write(&target, target_config(&options.config_text, &config)?)
        .with_context(|| format!("cannot write {}", target.display()))?;
    let secrets = Secrets {
        fly_token: DEMO_TOKEN.into(),
        git_token: None,
        record_keys: Some(crate::sim::record_keys()),
    };
    let owner = format!("demo-{}", std::process::id());
    let (listener, page) = bind_status_page(&mut config).await?;
    let config = Arc::new(config);
    let operator = Operator::new(
        daemon::fly_client(&config, &secrets)?,
        &config,
        secrets.record_keys.clone(),
    );
    let shutdown = CancellationToken::new();
    let say = Say::new(shutdown.clone());
    print_intro(&say, &config, &options, &sim, &repo_path, &target, &page);

    // SIGTERM as well as ctrl-c: either winds the demo down, so `work` (the
    // temporary directory) is dropped and removed.
    tokio::spawn(crate::signal::cancel_on_signal(shutdown.clone()));

    let mut progress = DemoProgress {
        say: say.clone(),
        sweeps: options.sweeps,
        keep_running: options.keep_running,
        verbose: options.verbose,
        target: target.clone(),
        stop: shutdown.clone(),
        operator,
        repo,
        tip,
        sim: &sim,
        shown: 0,
        released_at: None,
        approved: false,
        quiet: 0,
        settled_said: false,
    };
    let service_secrets = ServiceSecrets {
        core: secrets,
        alertmanagers: alertmanager_urls,
        ..ServiceSecrets::default()
    };
    let args = service::RunArgs::new(config.clone(), service_secrets, listener, owner, shutdown);
    service::run(args, |outcome| progress.on_sweep(outcome)).await?;
    if !options.keep_running {
        // The command printed at the start has scrolled away, and the
        // fleet it names is gone with this process.
        say.line(
            "to try `preflight` against this fleet: `fleet-reconciler demo --keep-running`, then the command it prints under `this fleet as a config:`",
        );
    }
    sim.shutdown().await;
    drop(work);
    Ok(())
}

/// The temporary directory, the overlay repository with its history, and
/// the simulated fleet spread over it; `config` is pointed at them.
async fn start_world(config: &mut Config) -> anyhow::Result<DemoWorld> {
    let work = tempfile::Builder::new()
        .prefix("fleet-reconciler-demo-")
        .tempdir()
        .context("cannot create the demo's temporary directory")?;
    let repo_path = work.path().join("overlay.git");
    let mut repo =
        DemoRepo::create(&repo_path).context("cannot create the demo overlay repository")?;
    let history = repo
        .build_history()
        .context("cannot build the demo overlay history")?;
    let tip = *history.release.last().context("empty demo history")?;
    // The machine whose lease and metadata keep the rotation slots: a
    // stopped machine of the daemon's own app, as in a real deployment.
    let coordinator = crate::metadata::slots::Coordinator {
        app: "fleet-reconciler".into(),
        machine_id: "c00rd1na7e0".into(),
    };
    let sim = Sim::start(demo_fleet(config, &history, tip, &coordinator))
        .await
        .context("cannot start the simulated fleet")?;
    config.rotation.coordinator = Some(coordinator);

    config.fly.api_url = sim.api_url();
    config.overlay.repo = crate::config::NonEmpty::new(repo_path.display().to_string())
        .ok_or_else(|| anyhow::anyhow!("the demo overlay has no path"))?;
    config.overlay.mirror_dir = work.path().join("mirror.git");
    let template = HealthUrlTemplate::parse(&sim.health_url_template())
        .map_err(|e| anyhow::anyhow!("simulator health URL: {e}"))?;
    for app in &mut config.apps {
        app.health_url = template.clone();
    }
    Ok(DemoWorld {
        work,
        repo,
        repo_path,
        tip,
        sim,
    })
}

/// The configured apps' machines over `history` in two pools, and the
/// coordinator's stopped machine.
fn demo_fleet(
    config: &Config,
    history: &DemoHistory,
    tip: Oid,
    coordinator: &crate::metadata::slots::Coordinator,
) -> SimFleet {
    let pools = ["dispatch", "conversation"];
    let mut fleet = SimFleet::new(DEMO_TOKEN)
        .release_tip(tip.to_string())
        .restart_delay(std::time::Duration::from_secs(1));
    // The agent alert-and-wait waits for works three restart graces (30 s
    // with the demo's own config), so it is still busy when it is claimed.
    let busy_while = config.rotation.restart_grace.saturating_mul(3);
    for (i, app) in config.apps.iter().enumerate() {
        fleet = fleet.app(SimApp::new(app.name.clone()).machines(demo_machines(
            i,
            pools[i % 2],
            history,
            busy_while,
        )));
    }
    fleet.app(
        SimApp::new(coordinator.app.clone())
            .machine(SimMachine::new(coordinator.machine_id.clone()).stopped()),
    )
}

/// `--alertmanager URL`: one `[[alerts.alertmanager]]`, its URL handed
/// over as `run` reads it from the environment.
fn add_alertmanager(config: &mut Config, url: Option<&str>) -> Vec<secrecy::SecretString> {
    let Some(url) = url else {
        return Vec::new();
    };
    config
        .alerts
        .alertmanagers
        .push(crate::config::AlertmanagerConfig {
            url_env: DEMO_ALERTMANAGER_ENV.into(),
            min_severity: crate::model::Severity::Low,
            // A team label, as the shipped Prometheus rules carry.
            labels: [("team".to_owned(), "agent-platform".to_owned())].into(),
        });
    vec![url.to_owned().into()]
}

/// The listener of the status page, API and metrics (served like `run`
/// does; if the configured port is taken, any free one will do) and its URL.
async fn bind_status_page(
    config: &mut Config,
) -> anyhow::Result<(tokio::net::TcpListener, String)> {
    let listener = match tokio::net::TcpListener::bind(config.server.listen).await {
        Ok(l) => l,
        Err(_) => tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .context("cannot bind a port for the demo's status page")?,
    };
    let page = listener
        .local_addr()
        .map(|a| format!("http://{a}/"))
        .unwrap_or_default();
    // Payloads link the demo's own status page unless the config says otherwise.
    if config.server.public_url.is_none() {
        config.server.public_url = crate::config::PublicUrl::parse(&page).ok();
    }
    Ok((listener, page))
}

/// Where everything is, and what is about to happen.
fn print_intro(
    say: &Say,
    config: &Config,
    options: &DemoOptions,
    sim: &Sim,
    repo_path: &Path,
    target: &Path,
    page: &str,
) {
    say.line(format_args!(
        "fleet-reconciler demo: simulated Fly API at {}, overlay repository at {}",
        sim.api_url(),
        repo_path.display()
    ));
    say.line(format_args!(
        "status page: {page}  (also {page}metrics and {page}api/v1/fleet)"
    ));
    say.line(format_args!(
        "this fleet as a config: {}\n  {}{}",
        target.display(),
        preflight_command(target),
        if options.keep_running || options.sweeps != 0 {
            ""
        } else {
            "   (while the demo runs: `demo --keep-running` serves until ctrl-c)"
        }
    ));
    for (pool, p) in &config.pools {
        if let Some(canary) = &p.after {
            say.line(format_args!(
                "pool {pool} waits for its canary pool {canary}: no claim toward a tip until {:.0}% of {canary}'s started machines run it and have for {} (\"guardrail: canary\" in a sweep's line).",
                p.after_ratio * 100.0,
                humantime::format_duration(p.soak),
            ));
        }
    }
    say.line(format_args!(
        "sweeping every {}; drift older than {} is remediated per pool policy. The release branch advances after the second sweep. One line a sweep (--verbose: the full table). ctrl-c to stop.\n",
        humantime::format_duration(config.sweep.interval.get()),
        humantime::format_duration(config.rotation.min_drift_age),
    ));
}

/// The command that runs `preflight` against the simulated fleet.
fn preflight_command(target: &Path) -> String {
    // The simulated fleet's record key: not a secret of any real fleet. The
    // demo's config keeps the default `records.key_env`.
    let key_env = crate::config::RecordsConfig::default().key_env;
    let key = crate::sim::DEFAULT_RECORD_KEY;
    format!(
        "{DEMO_TOKEN_ENV}={DEMO_TOKEN} {key_env}={key} fleet-reconciler preflight --config {}",
        target.display()
    )
}

/// The demo's script, sweep by sweep: show each sweep, ship a release
/// after the second, play the operator once, stop when told or settled.
struct DemoProgress<'a> {
    say: Say,
    /// Sweeps before stopping; 0 runs until settled.
    sweeps: u32,
    keep_running: bool,
    verbose: bool,
    /// The config file for `preflight` (repeated once settled).
    target: PathBuf,
    stop: CancellationToken,
    operator: Operator,
    repo: DemoRepo,
    tip: Oid,
    sim: &'a Sim,
    shown: u32,
    released_at: Option<u32>,
    approved: bool,
    /// Sweeps since the release with nothing in progress or planned.
    quiet: u32,
    settled_said: bool,
}

impl DemoProgress<'_> {
    fn on_sweep(&mut self, outcome: &SweepOutcome) {
        // Shown once, with its steps.
        if matches!(outcome, SweepOutcome::Observed { .. }) {
            return;
        }
        self.shown += 1;
        let header = format!(
            "── sweep {} · {} ──",
            self.shown,
            chrono::Utc::now().format("%H:%M:%S")
        );
        match outcome {
            SweepOutcome::Swept(cycle) => {
                show_cycle(&self.say, &header, cycle, self.verbose);
                // Settled: after the release, nothing in progress or planned for 3 sweeps,
                // and no pool still soaking behind its canary (that lifts by itself).
                let busy = !cycle.steps.is_empty()
                    || cycle.plan.rotations_in_progress.values().any(|n| *n > 0)
                    || cycle.plan.machines.values().any(|m| {
                        matches!(
                            m.decision,
                            Decision::Guarded {
                                guard: crate::decide::guardrail::Guard::Canary { .. }
                            }
                        )
                    });
                self.quiet = if busy || self.released_at.is_none() {
                    0
                } else {
                    self.quiet + 1
                };
                self.play_operator(cycle);
            }
            SweepOutcome::Failed { error, .. } => {
                self.say
                    .line(format_args!("{header} sweep failed: {error}"));
            }
            SweepOutcome::Acted { steps, .. } => {
                self.say
                    .line(format_args!("{header} steps that ran beside newer sweeps:"));
                for s in steps {
                    self.say.line(format_args!("  {} → {}", s.step, s.outcome));
                }
            }
            SweepOutcome::Observed { .. } => {}
        }
        if self.verbose {
            self.say.line("");
        }
        if self.shown == 2 && self.released_at.is_none() {
            self.released_at = Some(self.shown);
            self.release();
        }
        self.stop_when_done();
    }

    /// Plays the operator once, from the third sweep after the release on:
    /// approves one machine that waits for it.
    fn play_operator(&mut self, cycle: &daemon::Cycle) {
        if self.approved || self.released_at.is_none_or(|r| self.shown < r + 3) {
            return;
        }
        let Some((id, _)) = cycle
            .plan
            .machines
            .iter()
            .find(|(_, m)| matches!(m.decision, Decision::AwaitingApproval { .. }))
        else {
            return;
        };
        self.approved = true;
        let approval = Approval {
            target: cycle.report.tip.commit.clone(),
            mode: ApprovalMode::WhenIdle,
            by: "demo-operator".into(),
            at: cycle.now,
        };
        self.say.line(format_args!(
            ">>> an operator approves {id}: fleet-reconciler approve {id} --when-idle"
        ));
        let (operator, id, say) = (self.operator.clone(), id.clone(), self.say.clone());
        tokio::spawn(async move {
            if let Err(e) = operator.approve(&id, &approval).await {
                say.line(format_args!("demo: approval failed: {e}"));
            }
        });
    }

    /// Ships a release: the machines on the old tip drift.
    fn release(&mut self) {
        match self.repo.commit(
            "release",
            &[self.tip],
            &[("guards/pii.yaml", "redact: [email, phone, iban]\n")],
            "PII guard: redact phone numbers and IBANs",
        ) {
            Ok(new_tip) => {
                self.say.line(format_args!(
                    ">>> release branch advanced to {new_tip} (a guards/ change): machines on the old tip now drift"
                ));
                self.sim.set_release_tip(&new_tip.to_string());
            }
            Err(e) => self
                .say
                .line(format_args!("demo: cannot advance the release branch: {e}")),
        }
    }

    /// Stops after `sweeps` sweeps, or once settled unless `keep_running`.
    fn stop_when_done(&mut self) {
        let limit_reached = self.sweeps != 0 && self.shown >= self.sweeps;
        let settled = self.sweeps == 0 && self.quiet >= 3;
        if settled && !self.settled_said {
            self.settled_said = true;
            self.say.line(
                "the fleet has settled: every machine that policy allows to rotate runs the release tip.",
            );
            if self.keep_running {
                // The command printed at the start has scrolled away.
                self.say.line(format_args!(
                    "still serving (--keep-running): ctrl-c to stop. Check this fleet from another terminal:\n  {}",
                    preflight_command(&self.target)
                ));
            }
        }
        if limit_reached || (settled && !self.keep_running) {
            self.stop.cancel();
        }
    }
}

/// One sweep: its line (with `verbose`, its table and timing), its steps.
fn show_cycle(say: &Say, header: &str, cycle: &daemon::Cycle, verbose: bool) {
    let doc = FleetDocument::planned(&cycle.report, &cycle.plan);
    if verbose {
        say.line(header);
        say.text(render::to_table(&doc));
    } else {
        say.line(format_args!("{header} {}", render::summary_line(&doc)));
    }
    for s in &cycle.steps {
        say.line(format_args!("  {} → {}", s.step, s.outcome));
    }
    if verbose {
        say.line(format_args!(
            "(cycle took {} ms)",
            cycle.duration.as_millis()
        ));
    }
    if let Some(e) = &cycle.fetch_error {
        say.line(format_args!(
            "warning: overlay not fetched, using the last known tip: {e}"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The history is the same on every run (the demo's pinned machines,
    /// `check`'s and the deploy tests' fixtures rely on its ids).
    #[test]
    fn the_history_is_the_same_on_every_run() {
        let dir = tempfile::tempdir().unwrap();
        let h = DemoRepo::create(&dir.path().join("o.git"))
            .unwrap()
            .build_history()
            .unwrap();
        let ids = format!(
            "{} {} {} {} {} {}",
            h.release.len(),
            h.release[0],
            h.release[h.policy_change],
            h.release[h.security_fix],
            h.release[h.release.len() - 1],
            h.canary
        );
        assert_eq!(
            ids,
            "34 fda531b5ad2e9420604857896cfbb992d30a7822 d6064176facef314152d50842fdaafcf403dbfc0 d99434db766bc21541c6f0f8de20fb5bdcf1c752 ffeb6bacf1c46ad41ebf64d49b1abe75c5fff612 d436e36852e61184061cf9701994617ecb8b4080"
        );
    }
}

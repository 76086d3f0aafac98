//! Soak benchmark (#22): the whole daemon (`service::run`: sweeps, planner,
//! executor, notifier, metrics, HTTP server) against a simulated fleet for
//! a day's worth of sweeps, with a release every few hours whose rotations
//! restart machines; prints the process's resident memory every hour and
//! the growth from the first hour to the end, beside the target (no growth:
//! within 10 %).
//!
//! Run with `cargo bench --bench soak` (options after `--`: `--machines N`
//! (10000), `--hours H` (24), `--every D` (30s: the nominal sweep interval
//! the hours are counted in), `--release-every H` (4), `--sim-in-process`
//! (serve the fleet from this process, as the first runs did), `--exit-at-end`
//! (for a heap profiler: exit without dropping anything, so what is live
//! shows as leaked)). The sweeps run back to back (the configured
//! `sweep.interval` is 1 ms): "24 h" is 24 × 3600 / 30 = 2,880 sweeps,
//! however long they take here.
//!
//! The simulated fleet runs in a child process (this executable with
//! `--sim-child`), with its request log off, so the memory measured is the
//! daemon's alone. Each hour's line splits RSS into anonymous pages and
//! file-backed ones (`/proc/self/smaps_rollup`: the binary's code, libgit2's
//! mapped pack windows), and gives glibc's view of the heap (`mallinfo2`:
//! bytes live, bytes free inside the arena) and the thread count; the end
//! line says which of them grew.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::{Secrets, SweepOutcome};
use fleet_reconciler::demo::DemoRepo;
use fleet_reconciler::service::{self, ServiceSecrets};
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};
use tokio_util::sync::CancellationToken;

type Error = Box<dyn std::error::Error>;

const APPS: usize = 4;

struct Args {
    machines: usize,
    hours: u64,
    every: Duration,
    release_every_hours: u64,
    /// Exit at once after the end's figures, dropping nothing: under a heap
    /// profiler (heaptrack) everything live then shows as leaked, so two
    /// runs of different lengths diff into what grew.
    exit_at_end: bool,
    /// Serve the simulated fleet from this process, as before, instead of
    /// a child: its state and server side then count in the RSS measured.
    sim_in_process: bool,
    /// This process is the child serving the fleet (`--sim-child TIP`).
    sim_child: Option<String>,
}

fn args() -> Result<Args, Error> {
    let mut out = Args {
        machines: 10_000,
        hours: 24,
        every: Duration::from_secs(30),
        release_every_hours: 4,
        exit_at_end: false,
        sim_in_process: false,
        sim_child: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--machines" => out.machines = value()?.parse()?,
            "--hours" => out.hours = value()?.parse()?,
            "--every" => out.every = humantime::parse_duration(value()?)?,
            "--release-every" => out.release_every_hours = value()?.parse()?,
            "--exit-at-end" => out.exit_at_end = true,
            "--sim-in-process" => out.sim_in_process = true,
            "--sim-child" => out.sim_child = Some(value()?.clone()),
            // cargo bench passes `--bench`.
            _ => {}
        }
    }
    Ok(out)
}

/// What the process holds, split by where it lives, to explain RSS growth.
#[derive(Clone, Copy, Default)]
struct Memory {
    /// Resident set (`VmRSS`).
    rss: f64,
    /// Resident anonymous pages (heap, stacks) and file-backed ones (the
    /// binary's code as it is first run, libgit2's mapped pack windows),
    /// from `/proc/self/smaps_rollup`.
    anon: f64,
    file: f64,
    /// glibc `mallinfo2`: bytes in use (`uordblks` + mmapped `hblkhd`), free
    /// inside the arena (`fordblks`: freed, kept), and of that the top chunk
    /// `malloc_trim` could give back (`keepcost`).
    live: f64,
    free: f64,
    top: f64,
    threads: u64,
}

fn status_field(text: &str, key: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

impl Memory {
    // mallinfo2(3) has no safe std wrapper.
    #[allow(unsafe_code)]
    fn now() -> Memory {
        const MIB: f64 = 1024.0 * 1024.0;
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let smaps = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
        let kib = |text: &str, key: &str| status_field(text, key).unwrap_or(0.0) / 1024.0;
        let rss = kib(&status, "VmRSS:");
        let anon = kib(&smaps, "Anonymous:");
        // SAFETY: mallinfo2 takes nothing and returns a plain struct by value.
        let info = unsafe { libc::mallinfo2() };
        Memory {
            rss,
            anon,
            file: (kib(&smaps, "Rss:") - anon).max(0.0),
            live: (info.uordblks + info.hblkhd) as f64 / MIB,
            free: info.fordblks as f64 / MIB,
            top: info.keepcost as f64 / MIB,
            threads: status_field(&status, "Threads:").unwrap_or(0.0) as u64,
        }
    }
}

impl std::fmt::Display for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RSS {:.1} MiB (anon {:.1}, file {:.1}); heap live {:.1}, free in arena {:.1} (top {:.1}); {} threads",
            self.rss, self.anon, self.file, self.live, self.free, self.top, self.threads
        )
    }
}

fn main() -> Result<(), Error> {
    let args = args()?;
    // As the daemon's `main` does.
    fleet_reconciler::heap::one_arena();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match args.sim_child.clone() {
        Some(tip) => rt.block_on(sim_child(args.machines, &tip)),
        None => rt.block_on(soak(args)),
    }
}

/// The simulated fleet: `machines` agents in [`APPS`] apps, all loaded on
/// `tip`, and the coordinator.
fn fleet(machines: usize, tip: &str) -> SimFleet {
    let mut fleet = SimFleet::new("soak").release_tip(tip);
    for a in 0..APPS {
        let mut app = SimApp::new(format!("app-{a}"));
        for i in (a..machines).step_by(APPS) {
            app = app.machine(
                SimMachine::new(format!("m{i:06}"))
                    .region(["iad", "ams", "sin"][i % 3])
                    .loaded(tip),
            );
        }
        fleet = fleet.app(app);
    }
    fleet
        .app(SimApp::new("coord").machine(SimMachine::new("c0").stopped()))
        .record_requests(false)
        .unlimited()
}

/// The child's side: serves the fleet, prints its two URLs on one line,
/// then takes `tip COMMIT` lines (a release) from stdin until it closes.
async fn sim_child(machines: usize, tip: &str) -> Result<(), Error> {
    use std::io::BufRead;
    let sim = Sim::start(fleet(machines, tip)).await?;
    println!("{} {}", sim.api_url(), sim.health_url_template());
    let handle = sim.handle();
    tokio::task::spawn_blocking(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if let Some(tip) = line.strip_prefix("tip ") {
                handle.set_release_tip(tip.trim());
            }
        }
    })
    .await?;
    sim.shutdown().await;
    Ok(())
}

/// Where the simulated fleet runs. By default a child process, so that
/// the RSS measured is the daemon's alone: in the same process the
/// simulator's machine state, event lists and the server side of every
/// connection (200 at once in a release wave) counted too.
enum Fleet {
    InProcess(Sim),
    Child {
        child: std::process::Child,
        /// Taken by the release-tip setter; its closing stops the child.
        stdin: Option<std::process::ChildStdin>,
        api_url: String,
        health_url_template: String,
    },
}

impl Fleet {
    async fn start(machines: usize, tip: &str, in_process: bool) -> Result<Fleet, Error> {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        if in_process {
            return Ok(Fleet::InProcess(Sim::start(fleet(machines, tip)).await?));
        }
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--machines", &machines.to_string(), "--sim-child", tip])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let (stdin, stdout) = match (child.stdin.take(), child.stdout.take()) {
            (Some(i), Some(o)) => (i, o),
            _ => return Err("the simulator child has no stdin/stdout".into()),
        };
        let mut first = String::new();
        std::io::BufReader::new(stdout).read_line(&mut first)?;
        let mut urls = first.split_whitespace();
        let (Some(api_url), Some(health)) = (urls.next(), urls.next()) else {
            return Err(format!("the simulator child printed {first:?}, not its URLs").into());
        };
        Ok(Fleet::Child {
            api_url: api_url.to_string(),
            health_url_template: health.to_string(),
            child,
            stdin: Some(stdin),
        })
    }

    fn api_url(&self) -> String {
        match self {
            Fleet::InProcess(sim) => sim.api_url(),
            Fleet::Child { api_url, .. } => api_url.clone(),
        }
    }

    fn health_url_template(&self) -> String {
        match self {
            Fleet::InProcess(sim) => sim.health_url_template(),
            Fleet::Child {
                health_url_template,
                ..
            } => health_url_template.clone(),
        }
    }

    /// A handle that moves a release's tip, for the observer.
    fn release_tip_setter(&mut self) -> Box<dyn FnMut(&str) + Send> {
        use std::io::Write;
        match self {
            Fleet::InProcess(sim) => {
                let handle = sim.handle();
                Box::new(move |tip| handle.set_release_tip(tip))
            }
            Fleet::Child { stdin, .. } => match stdin.take() {
                Some(mut out) => Box::new(move |tip| {
                    if writeln!(out, "tip {tip}").is_err() {
                        println!("  cannot tell the simulator child the release tip");
                    }
                }),
                None => Box::new(|_| println!("  cannot tell the simulator child the release tip")),
            },
        }
    }

    async fn shutdown(self) {
        match self {
            Fleet::InProcess(sim) => sim.shutdown().await,
            Fleet::Child {
                mut child, stdin, ..
            } => {
                // Its stdin closing is its signal to stop.
                drop(stdin);
                let _ = child.wait();
            }
        }
    }
}

async fn soak(args: Args) -> Result<(), Error> {
    let sweeps_per_hour = (3600 / args.every.as_secs().max(1)).max(1);
    let total = sweeps_per_hour * args.hours;
    let release_every = sweeps_per_hour * args.release_every_hours.max(1);
    let dir = tempfile::tempdir()?;
    let repo_path = dir.path().join("overlay.git");
    let mut repo = DemoRepo::create(&repo_path)?;
    let history = repo.build_history()?;
    let mut tip = *history.release.last().ok_or("empty history")?;

    let mut sim = Fleet::start(args.machines, &tip.to_string(), args.sim_in_process).await?;
    let mut set_release_tip = sim.release_tip_setter();

    let mut text = format!(
        "[fly]\napi_url = \"{}\"\nrate_limits = false\n[overlay]\nrepo = \"{}\"\nbranch = \"release\"\nmirror_dir = \"{}\"\nfetch_interval = \"1ms\"\n\
         [probe]\nconcurrency = 256\n[sweep]\ninterval = \"1ms\"\n\
         [rotation]\nmin_drift_age = \"0s\"\nrestart_grace = \"0s\"\ncoordinator = \"coord/c0\"\n\
         [pools.default]\nmax_concurrent_rotations = 200\n\
         actions = {{ low = \"restart\", medium = \"restart\", high = \"restart\", critical = \"restart\" }}\n",
        sim.api_url(),
        repo_path.display(),
        dir.path().join("mirror.git").display()
    );
    for a in 0..APPS {
        text.push_str(&format!(
            "[[apps]]\nname = \"app-{a}\"\nhealth_url = \"{}\"\n",
            sim.health_url_template()
        ));
    }
    let config = Arc::new(Config::parse(Path::new("soak.toml"), &text)?);
    let secrets = ServiceSecrets {
        core: Secrets {
            fly_token: "soak".into(),
            git_token: None,
            record_keys: Some(fleet_reconciler::sim::record_keys()),
        },
        ..ServiceSecrets::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let stop = CancellationToken::new();
    println!(
        "soak: {} machines in {APPS} apps, {} h of {}-s sweeps = {total} sweeps, a release every {} h; fleet simulated {}",
        args.machines,
        args.hours,
        args.every.as_secs(),
        args.release_every_hours,
        if args.sim_in_process {
            "in this process"
        } else {
            "by a child process"
        }
    );

    let started = Instant::now();
    let mut sweeps = 0u64;
    let mut failed = 0u64;
    let mut restarts = 0usize;
    let mut coherence = 0.0;
    let mut first_hour: Option<Memory> = None;
    let mut peak: f64 = 0.0;
    let stopper = stop.clone();
    let exit_at_end = args.exit_at_end;
    let observe = move |outcome: &SweepOutcome| {
        let events = match outcome {
            SweepOutcome::Swept(cycle) => {
                sweeps += 1;
                restarts += cycle
                    .steps
                    .iter()
                    .filter(|s| s.step.kind() == "restart" && s.outcome.result() == "succeeded")
                    .count();
                coherence.clone_from(&cycle.report.coherence.ratio);
                // Fly's recent events per machine, as listed: each restart
                // adds some, up to Fly's (the sim's) cap of 20.
                let machines = cycle.report.machines.len().max(1);
                let listed: usize = cycle
                    .report
                    .machines
                    .iter()
                    .map(|m| m.seen.inputs.events().len())
                    .sum();
                listed as f64 / machines as f64
            }
            // Counted with its steps, in the `Swept` that follows.
            SweepOutcome::Observed { .. } => return,
            // Steps that ran beside newer sweeps.
            SweepOutcome::Acted { steps, .. } => {
                restarts += steps
                    .iter()
                    .filter(|s| s.step.kind() == "restart" && s.outcome.result() == "succeeded")
                    .count();
                return;
            }
            SweepOutcome::Failed { error, .. } => {
                failed += 1;
                if failed == 1 {
                    println!("  first failed sweep: {error}");
                }
                return;
            }
        };
        // The daemon hands freed pages back right after this call (once
        // the cycle is dropped); doing it first here measures what the
        // sweep's end holds, not its garbage still in the arena's top (up
        // to 16 MiB at 10,000 machines, from sweep to sweep).
        fleet_reconciler::heap::return_freed_memory();
        let mem = Memory::now();
        let rss = mem.rss;
        peak = peak.max(rss);
        if sweeps.is_multiple_of(sweeps_per_hour) {
            println!(
                "  hour {:>2} ({:.0} s): {mem}, {events:.1} events listed per machine",
                sweeps / sweeps_per_hour,
                started.elapsed().as_secs_f64(),
            );
        }
        if sweeps == sweeps_per_hour {
            first_hour = Some(mem);
        }
        if sweeps.is_multiple_of(release_every) && sweeps < total {
            // A release: one commit on top of the tip; restarted machines
            // come back on it.
            let note = format!("skills/soak-{sweeps}.md");
            match repo.commit("release", &[tip], &[(&note, "soak")], "Soak release") {
                Ok(next) => {
                    tip = next;
                    set_release_tip(&tip.to_string());
                    println!(
                        "  hour {:>2}: release {}",
                        sweeps / sweeps_per_hour,
                        &tip.to_string()[..12],
                    );
                }
                Err(e) => println!("  release failed: {e}"),
            }
        }
        if sweeps >= total {
            let start = first_hour.unwrap_or(mem);
            let growth = (rss - start.rss) / start.rss.max(1.0) * 100.0;
            println!(
                "  end ({sweeps} sweeps, {failed} failed, {restarts} restarts, coherence {coherence:.3}, {:.0} s): RSS {rss:.1} MiB, peak {peak:.1} MiB",
                started.elapsed().as_secs_f64(),
            );
            println!(
                "  from hour 1 to the end: RSS {:+.1} MiB = anon {:+.1} + file {:+.1}; heap live {:+.1}, free in arena {:+.1}; threads {:+}",
                rss - start.rss,
                mem.anon - start.anon,
                mem.file - start.file,
                mem.live - start.live,
                mem.free - start.free,
                mem.threads as i64 - start.threads as i64,
            );
            println!(
                "  RSS growth from hour 1 to the end: {:.1} -> {rss:.1} MiB, {growth:+.1} %   target within ±10 %   {}",
                start.rss,
                if growth.abs() <= 10.0 {
                    "met"
                } else {
                    "MISSED"
                }
            );
            if exit_at_end {
                std::process::exit(0);
            }
            stopper.cancel();
        }
    };
    service::run(
        service::RunArgs::new(config, secrets, listener, "soak".into(), stop),
        observe,
    )
    .await?;
    sim.shutdown().await;
    Ok(())
}

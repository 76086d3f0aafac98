//! Soak benchmark (#22): the whole daemon (`service::run`: sweeps, planner,
//! executor, notifier, metrics, HTTP server) against a simulated fleet for
//! a day's worth of sweeps, with a release every few hours whose rotations
//! restart machines; prints the process's resident memory after the first
//! hour's sweeps and at the end, beside the target (no growth: within 10 %).
//!
//! Run with `cargo bench --bench soak` (options after `--`: `--machines N`
//! (10000), `--hours H` (24), `--every D` (30s: the nominal sweep interval
//! the hours are counted in), `--release-every H` (4), `--exit-at-end` (for
//! a heap profiler: exit without dropping anything, so what is live shows
//! as leaked)). The sweeps run back
//! to back (the configured `sweep.interval` is 1 ms): "24 h" is 24 × 3600 /
//! 30 = 2,880 sweeps, however long they take here. The simulated fleet is in
//! the same process, with its request log off; its own state grows only
//! with each machine's recent events (capped at 20, as Fly's list). Beside
//! RSS it prints the live heap (glibc's `mallinfo2`: the main arena) and the
//! events listed per machine: the daemon holds those too, in its rows.

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
}

fn args() -> Result<Args, Error> {
    let mut out = Args {
        machines: 10_000,
        hours: 24,
        every: Duration::from_secs(30),
        release_every_hours: 4,
        exit_at_end: false,
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
            // cargo bench passes `--bench`.
            _ => {}
        }
    }
    Ok(out)
}

fn rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Bytes the allocator has handed out and not had back (glibc's
/// `mallinfo2`): the live heap, beside RSS, which also counts what was freed
/// but not returned to the system.
// mallinfo2(3) has no safe std wrapper.
#[allow(unsafe_code)]
fn heap_mib() -> f64 {
    // SAFETY: mallinfo2 takes nothing and returns a plain struct by value.
    let info = unsafe { libc::mallinfo2() };
    (info.uordblks + info.hblkhd) as f64 / 1024.0 / 1024.0
}

fn main() -> Result<(), Error> {
    let args = args()?;
    // As the daemon's `main` does.
    fleet_reconciler::heap::one_arena();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(soak(args))
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

    let mut fleet = SimFleet::new("soak").release_tip(tip.to_string());
    for a in 0..APPS {
        let mut app = SimApp::new(format!("app-{a}"));
        for i in (a..args.machines).step_by(APPS) {
            app = app.machine(
                SimMachine::new(format!("m{i:06}"))
                    .region(["iad", "ams", "sin"][i % 3])
                    .loaded(tip.to_string()),
            );
        }
        fleet = fleet.app(app);
    }
    fleet = fleet.app(SimApp::new("coord").machine(SimMachine::new("c0").stopped()));
    let sim = Sim::start(fleet.record_requests(false).unlimited()).await?;

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
        },
        ..ServiceSecrets::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let stop = CancellationToken::new();
    println!(
        "soak: {} machines in {APPS} apps, {} h of {}-s sweeps = {total} sweeps, a release every {} h",
        args.machines,
        args.hours,
        args.every.as_secs(),
        args.release_every_hours
    );

    let started = Instant::now();
    let mut sweeps = 0u64;
    let mut failed = 0u64;
    let mut restarts = 0usize;
    let mut coherence = 0.0;
    let mut first_hour: Option<f64> = None;
    let mut peak: f64 = 0.0;
    let stopper = stop.clone();
    let exit_at_end = args.exit_at_end;
    let sim_handle = sim.handle();
    let observe = move |outcome: &SweepOutcome| {
        let events = match outcome {
            SweepOutcome::Swept(cycle) => {
                sweeps += 1;
                restarts += cycle
                    .steps
                    .iter()
                    .filter(|s| s.step.kind() == "restart" && s.outcome.result() == "succeeded")
                    .count();
                coherence.clone_from(&cycle.report.coherence);
                // Fly's recent events per machine, as listed: each restart
                // adds some, up to Fly's (the sim's) cap of 20.
                let machines = cycle.report.machines.len().max(1);
                let listed: usize = cycle
                    .report
                    .machines
                    .iter()
                    .map(|m| m.inputs.events().len())
                    .sum();
                listed as f64 / machines as f64
            }
            SweepOutcome::Failed { error, .. } => {
                failed += 1;
                if failed == 1 {
                    println!("  first failed sweep: {error}");
                }
                return;
            }
        };
        let rss = rss_mib().unwrap_or(0.0);
        peak = peak.max(rss);
        if sweeps == sweeps_per_hour {
            first_hour = Some(rss);
            println!(
                "  after hour 1 ({sweeps} sweeps, {:.0} s): RSS {rss:.1} MiB, heap {:.1} MiB, {events:.1} events listed per machine",
                started.elapsed().as_secs_f64(),
                heap_mib()
            );
        }
        if sweeps.is_multiple_of(release_every) && sweeps < total {
            // A release: one commit on top of the tip; restarted machines
            // come back on it.
            let note = format!("skills/soak-{sweeps}.md");
            match repo.commit("release", &[tip], &[(&note, "soak")], "Soak release") {
                Ok(next) => {
                    tip = next;
                    sim_handle.set_release_tip(&tip.to_string());
                    println!(
                        "  hour {}: release {} (RSS {rss:.1} MiB, heap {:.1} MiB)",
                        sweeps / sweeps_per_hour,
                        &tip.to_string()[..12],
                        heap_mib()
                    );
                }
                Err(e) => println!("  release failed: {e}"),
            }
        }
        if sweeps >= total {
            let start = first_hour.unwrap_or(rss);
            let growth = (rss - start) / start.max(1.0) * 100.0;
            println!(
                "  end ({sweeps} sweeps, {failed} failed, {restarts} restarts, coherence {coherence:.3}, {:.0} s): RSS {rss:.1} MiB, peak {peak:.1} MiB, heap {:.1} MiB, {events:.1} events listed per machine",
                started.elapsed().as_secs_f64(),
                heap_mib()
            );
            println!(
                "  RSS growth from hour 1 to the end: {growth:+.1} %   target within ±10 %   {}",
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

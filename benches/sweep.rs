//! Sweep benchmark: one process sweeping 10,000 machines (docs/design.md §9).
//!
//! Run with `cargo bench --bench sweep` (optionally `-- 20000` for another
//! fleet size). Prints wall time per sweep (cold: first git analysis; warm:
//! cached), machines per second, and the process's peak resident memory.
//! The simulated fleet runs in the same process, so memory includes it.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::{self, Secrets};
use fleet_reconciler::demo::DemoRepo;
use fleet_reconciler::sim::{Sim, SimApp, SimFleet, SimMachine};

fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let machines: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let dir = tempfile::tempdir()?;
        let repo_path = dir.path().join("overlay.git");
        let mut repo = DemoRepo::create(&repo_path)?;
        let history = repo.build_history()?;
        let tip = *history.release.last().ok_or("empty history")?;
        let apps = 4;
        let mut fleet = SimFleet::new("bench").release_tip(tip.to_string());
        for a in 0..apps {
            let mut app = SimApp::new(format!("app-{a}"));
            for i in (a..machines).step_by(apps) {
                // Most machines on the tip, the rest spread over the history.
                let commit = if i % 4 == 0 {
                    history.release[i % history.release.len()]
                } else {
                    tip
                };
                app = app.machine(
                    SimMachine::new(format!("m{i:06}"))
                        .region(["iad", "ams", "sin"][i % 3])
                        .loaded(commit.to_string())
                        .report_ref_len(if i % 2 == 0 { 40 } else { 8 }),
                );
            }
            fleet = fleet.app(app);
        }
        let sim = Sim::start(fleet.record_requests(false)).await?;
        let mut text = format!(
            "[fly]\napi_url = \"{}\"\n[overlay]\nrepo = \"{}\"\nbranch = \"release\"\nmirror_dir = \"{}\"\n[probe]\nconcurrency = 256\n",
            sim.api_url(),
            repo_path.display(),
            dir.path().join("mirror.git").display()
        );
        for a in 0..apps {
            text.push_str(&format!(
                "[[apps]]\nname = \"app-{a}\"\nhealth_url = \"{}\"\n",
                sim.health_url_template()
            ));
        }
        let config = Config::parse(Path::new("bench.toml"), &text)?;
        let sweeper = daemon::connect(
            Arc::new(config),
            &Secrets {
                fly_token: "bench".into(),
                git_token: None,
                record_keys: Some(fleet_reconciler::sim::record_keys()),
            },
        )
        .await?;
        let tip = sweeper.overlay.fetch().await?;
        println!("sweep benchmark: {machines} machines in {apps} apps, probe concurrency 256");
        for round in 0..4 {
            let started = Instant::now();
            let report = fleet_reconciler::daemon::sweep(&sweeper, &tip).await?;
            let took = started.elapsed();
            println!(
                "  sweep {} ({}): {:>8.1} ms  {:>9.0} machines/s  coherence {:.3}  ({} machines)",
                round + 1,
                if round == 0 { "cold git cache" } else { "warm" },
                took.as_secs_f64() * 1000.0,
                machines as f64 / took.as_secs_f64(),
                report.coherence.ratio,
                report.machines.len()
            );
        }
        // The planner over the same 10k-machine snapshot (pure, no I/O).
        let report = fleet_reconciler::daemon::sweep(&sweeper, &tip).await?;
        let mut tracker = fleet_reconciler::decide::planner::Tracker::default();
        let now = chrono::Utc::now();
        tracker.observe(&report, now - chrono::Duration::hours(1));
        tracker.observe(&report, now);
        let policy = fleet_reconciler::decide::policy::Policy::from_config(&sweeper.config);
        let started = Instant::now();
        let rounds = 20;
        let mut steps = 0;
        for _ in 0..rounds {
            let plan = fleet_reconciler::decide::planner::plan(&fleet_reconciler::decide::planner::PlanInput {
                policy: &policy,
                snapshot: &report,
                tracker: &tracker,
                owner: "bench",
                fetch: fleet_reconciler::decide::planner::FetchState {
                    fetched_at: Some(now),
                    failing: false,
                },
                now,
            });
            steps = plan.steps().len();
        }
        println!(
            "  plan: {:>8.2} ms per plan over {} machines ({steps} steps, {} drifted)",
            started.elapsed().as_secs_f64() * 1000.0 / rounds as f64,
            report.machines.len(),
            report.machines.iter().filter(|m| m.severity().is_some()).count(),
        );
        if let Some(mib) = peak_rss_mib() {
            println!("  peak RSS (daemon + simulated fleet): {mib:.1} MiB");
        }
        sim.shutdown().await;
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}

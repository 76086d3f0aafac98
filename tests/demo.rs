//! `fleet-reconciler demo` end to end: the real binary, its simulated fleet and
//! overlay repository, and the release that ships while it runs.

use std::process::Command;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_fleet-reconciler");

#[test]
fn demo_detects_drift_and_the_release_it_ships() {
    let dir = tempfile::tempdir().unwrap();
    // The built-in demo config with a short interval, so the test is quick.
    let config = fleet_reconciler::demo::DEMO_CONFIG
        .replace("interval = \"3s\"", "interval = \"400ms\"")
        .replace("fetch_interval = \"1s\"", "fetch_interval = \"10ms\"")
        // Detection only: drift never gets old enough to act on.
        .replace("min_drift_age = \"4s\"", "min_drift_age = \"1h\"");
    assert_ne!(
        config,
        fleet_reconciler::demo::DEMO_CONFIG,
        "demo config has a 3s sweep interval"
    );
    let path = dir.path().join("demo.toml");
    std::fs::write(&path, config).unwrap();

    let started = Instant::now();
    let out = Command::new(BIN)
        .args(["demo", "--sweeps", "4", "--demo-config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let sweeps: Vec<&str> = stdout.split("── sweep ").skip(1).collect();
    assert_eq!(sweeps.len(), 4, "{stdout}");
    assert!(
        stdout.contains(">>> release branch advanced to"),
        "{stdout}"
    );

    let machine_row = |sweep: &str, name: &str| -> Vec<String> {
        sweep
            .lines()
            .find(|l| l.split_whitespace().nth(2) == Some(name))
            .unwrap_or_else(|| panic!("{name} missing in {sweep}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    // Before the release: agent-d-00 is on the tip, agent-d-07 one behind (low).
    let before = machine_row(sweeps[0], "agent-d-00");
    assert_eq!(before[10], "on_tip", "{before:?}");
    let behind = machine_row(sweeps[0], "agent-d-07");
    assert_eq!(
        &behind[6..11],
        ["1", "0", "low", "alert-and-wait", "drifted"],
        "{behind:?}"
    );
    // After it (a guards/ change): the old tip is one behind at high severity,
    // and the one-behind machine is now two behind.
    let after = machine_row(sweeps[3], "agent-d-00");
    assert_eq!(
        &after[6..11],
        ["1", "0", "high", "restart", "drifted"],
        "{after:?}"
    );
    let behind = machine_row(sweeps[3], "agent-d-07");
    assert_eq!(&behind[6..9], ["2", "0", "high"], "{behind:?}");
    // Every per-machine status shows up, and nothing panicked.
    for status in [
        "on_tip",
        "drifted",
        "unknown_ref",
        "unreachable",
        "bad_report",
        "not_running",
    ] {
        assert!(sweeps[0].contains(status), "{status} in\n{}", sweeps[0]);
    }
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

#[test]
fn demo_converges_waits_for_busy_agents_and_for_approval() {
    let dir = tempfile::tempdir().unwrap();
    let config = fleet_reconciler::demo::DEMO_CONFIG
        .replace("interval = \"2s\"", "interval = \"500ms\"")
        .replace("min_drift_age = \"4s\"", "min_drift_age = \"1s\"")
        .replace("restart_grace = \"10s\"", "restart_grace = \"3s\"");
    let path = dir.path().join("demo.toml");
    std::fs::write(&path, config).unwrap();
    // Output goes to files: a pipe nobody reads would fill and stall the demo.
    let out_path = dir.path().join("stdout.txt");
    let err_path = dir.path().join("stderr.txt");
    let mut child = Command::new(BIN)
        .args(["demo", "--sweeps", "0", "--demo-config"])
        .arg(&path)
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    // The demo stops by itself once settled; never let a regression hang CI.
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            panic!("demo did not settle within 180 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let status = child.wait().unwrap();
    let stdout = std::fs::read_to_string(&out_path).unwrap();
    let stderr = std::fs::read_to_string(&err_path).unwrap();
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("the fleet has settled"), "{stdout}");
    let last = stdout.rsplit("── sweep ").next().unwrap();
    let row = |name: &str| -> Vec<String> {
        last.lines()
            .find(|l| l.split_whitespace().nth(2) == Some(name))
            .unwrap_or_else(|| panic!("{name} missing in {last}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    // Every dispatch agent that policy lets rotate runs the new tip.
    for i in 0..=13 {
        let r = row(&format!("agent-d-{i:02}"));
        if i == 11 {
            continue; // critical in the default pool: manual, approved below
        }
        assert_eq!(r[10], "on_tip", "agent-d-{i:02}: {r:?}");
    }
    // The approved manual machine converged; unapproved ones still wait.
    assert!(
        stdout.contains(">>> an operator approves 1115e1f000b"),
        "{stdout}"
    );
    assert_eq!(row("agent-d-11")[10], "on_tip");
    let waiting = row("agent-c-00");
    assert_eq!(
        &waiting[10..],
        ["drifted", "awaiting", "approval"],
        "{waiting:?}"
    );
    // The hour-busy agent in `dispatch` (restart) was interrupted only after its
    // grace; the one in `default` (alert-and-wait) was waited for.
    assert!(stdout.contains("restart agents-dispatch/1035e1f0003 (restart grace elapsed; live work may be interrupted)"), "{stdout}");
    assert!(
        stdout.contains("restart agents-dispatch/1055e1f0005 (no live work)"),
        "{stdout}"
    );
    assert!(!stdout.contains("→ failed"), "a step failed: {stdout}");
}

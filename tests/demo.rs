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
        .replace("fetch_interval = \"1s\"", "fetch_interval = \"10ms\"");
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

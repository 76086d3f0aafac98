//! Metrics against real sweeps: a git overlay built with git2, the simulated
//! Fly API and agents over loopback, and a strict exposition-format checker
//! judging the scrape (CI runs `promtool check metrics` on the saved scrapes).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::{self, Secrets};
use fleet_reconciler::decide::Snapshot;
use fleet_reconciler::fly::{FlyClient, FlyClientConfig};
use fleet_reconciler::model::{MachineId, MachineStatus};
use fleet_reconciler::observe::sweep::Sweeper;
use fleet_reconciler::report::metrics::{self, Metrics};
use fleet_reconciler::sim::{Behaviour, Sim, SimApp, SimFleet, SimMachine};

use crate::common::{OverlayRepo as Fixture, within};

const TOKEN: &str = "metrics-test-token";

// ---- a parsed scrape -----------------------------------------------------------

#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the sample lines of the text format (label values here never
/// contain quotes, commas or braces).
fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("a sample line has a value");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let inner = rest.strip_suffix('}').expect("closing brace");
                    let labels = inner
                        .split(',')
                        .filter(|kv| !kv.is_empty())
                        .map(|kv| {
                            let (k, v) = kv.split_once('=').expect("k=v");
                            (k.to_string(), v.trim_matches('"').to_string())
                        })
                        .collect();
                    (name.to_string(), labels)
                }
                None => (series.to_string(), BTreeMap::new()),
            };
            Sample {
                name,
                labels,
                value: value.parse().expect("numeric value"),
            }
        })
        .collect()
}

fn find<'a>(samples: &'a [Sample], name: &str, labels: &[(&str, &str)]) -> Vec<&'a Sample> {
    samples
        .iter()
        .filter(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .collect()
}

fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let found = find(samples, name, labels);
    assert_eq!(
        found.len(),
        1,
        "expected exactly one {name}{labels:?}, found {found:?}"
    );
    found[0].value
}

// ---- a swept simulated fleet ----------------------------------------------------

impl Fixture {
    async fn sweeper(&self, sim: &Sim, apps: &[&str]) -> Sweeper {
        let mut text = format!(
            r#"
[fly]
api_url = "{api}"
request_timeout = "5s"
max_retries = 2

[overlay]
repo = "{repo}"
branch = "release"
mirror_dir = "{mirror}"

[probe]
timeout = "2s"
concurrency = 8
"#,
            api = sim.api_url(),
            repo = self.repo_path.display(),
            mirror = self.dir.path().join("mirror.git").display(),
        );
        for app in apps {
            text.push_str(&format!(
                "\n[[apps]]\nname = \"{app}\"\nhealth_url = \"{}\"\n",
                sim.health_url_template()
            ));
        }
        let config = Config::parse(Path::new("metrics-test.toml"), &text).unwrap();
        within(daemon::connect(
            Arc::new(config),
            &Secrets {
                fly_token: TOKEN.into(),
                git_token: None,
                record_keys: Some(fleet_reconciler::sim::record_keys()),
            },
        ))
        .await
        .unwrap()
    }
}

async fn sweep(sweeper: &Sweeper) -> Snapshot {
    within(daemon::check(sweeper)).await.unwrap()
}

/// alpha: 3 on tip, 1 drifted (2 behind), 1 unreachable (HTTP 500), 1 stopped;
/// beta: 1 on tip, 1 unknown ref; empty: no machines at all.
fn mixed(fx: &Fixture) -> SimFleet {
    SimFleet::new(TOKEN)
        .release_tip(fx.tip())
        .app(
            SimApp::new("alpha")
                .machine(SimMachine::new("a1").loaded(fx.tip()).region("iad"))
                .machine(SimMachine::new("a2").loaded(fx.tip()).region("ams"))
                .machine(SimMachine::new("a3").loaded(fx.tip()).report_ref_len(7))
                .machine(
                    SimMachine::new("a-behind")
                        .loaded(fx.behind(2))
                        .region("sin"),
                )
                .machine(
                    SimMachine::new("a-500")
                        .loaded(fx.tip())
                        .behaviour(Behaviour::HttpError(500)),
                )
                .machine(SimMachine::new("a-stopped").loaded(fx.behind(5)).stopped()),
        )
        .app(
            SimApp::new("beta")
                .machine(SimMachine::new("b1").loaded(fx.tip()))
                .machine(SimMachine::new("b-unknown").loaded("deadbeef".repeat(5))),
        )
        .app(SimApp::new("empty"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coherence_and_status_counts_match_the_sweep() {
    let fx = Fixture::new();
    let sim = Sim::start(mixed(&fx)).await.unwrap();
    let sweeper = fx.sweeper(&sim, &["alpha", "beta", "empty"]).await;
    let report = sweep(&sweeper).await;
    let m = Metrics::new(true).unwrap();
    let now = Utc::now();
    m.record_sweep(&report, Duration::from_millis(1500), now);
    let s = parse(&m.render().unwrap());

    // Independently known from the fixture: on-tip ÷ started.
    let expected = [("alpha", 3.0 / 5.0), ("beta", 1.0 / 2.0), ("empty", 1.0)];
    for (app, ratio) in expected {
        let got = value(&s, metrics::COHERENCE_RATIO, &[("fly_app", app)]);
        assert!((got - ratio).abs() < 1e-12, "{app}: {got} != {ratio}");
    }
    // …and exactly what the report says.
    for app in &report.apps {
        assert_eq!(
            value(
                &s,
                metrics::COHERENCE_RATIO,
                &[("fly_app", app.name.as_str())]
            ),
            app.coherence.ratio
        );
    }
    // The fleet: its own series, not a sentinel app label value.
    assert!((value(&s, metrics::FLEET_COHERENCE_RATIO, &[]) - 4.0 / 7.0).abs() < 1e-12);
    assert_eq!(
        value(&s, metrics::FLEET_COHERENCE_RATIO, &[]),
        report.coherence.ratio
    );
    assert!(
        find(&s, metrics::COHERENCE_RATIO, &[])
            .iter()
            .all(|x| x.labels.get("fly_app").is_some_and(|a| a != "*")),
        "no sentinel app"
    );

    // Every status of every app, zeros included.
    let counts = [
        ("alpha", "on_tip", 3.0),
        ("alpha", "drifted", 1.0),
        ("alpha", "unreachable", 1.0),
        ("alpha", "not_running", 1.0),
        ("alpha", "bad_report", 0.0),
        ("beta", "on_tip", 1.0),
        ("beta", "unknown_ref", 1.0),
        ("beta", "drifted", 0.0),
        ("empty", "on_tip", 0.0),
    ];
    for (app, status, n) in counts {
        assert_eq!(
            value(
                &s,
                metrics::MACHINES,
                &[("fly_app", app), ("status", status)]
            ),
            n,
            "{app}/{status}"
        );
    }
    for app in ["alpha", "beta", "empty"] {
        assert_eq!(
            find(&s, metrics::MACHINES, &[("fly_app", app)]).len(),
            MachineStatus::ALL.len(),
            "{app}: one series per status"
        );
        assert_eq!(
            find(&s, metrics::DRIFT_SEVERITY_MACHINES, &[("fly_app", app)]).len(),
            4
        );
    }
    // Severities: the drifted and the unknown machine are classified.
    let classified = |app: &str| -> f64 {
        find(&s, metrics::DRIFT_SEVERITY_MACHINES, &[("fly_app", app)])
            .iter()
            .map(|x| x.value)
            .sum()
    };
    assert_eq!(classified("alpha"), 1.0);
    assert_eq!(classified("beta"), 1.0);
    assert_eq!(
        value(
            &s,
            metrics::DRIFT_SEVERITY_MACHINES,
            &[("fly_app", "beta"), ("severity", "critical")]
        ),
        1.0,
        "an unknown ref is critical by default"
    );

    // Per machine: only the drifted one, with its commits behind.
    let behind = find(&s, metrics::COMMITS_BEHIND, &[]);
    assert_eq!(behind.len(), 1, "{behind:?}");
    assert_eq!(behind[0].labels["machine_id"], "a-behind");
    assert_eq!(behind[0].labels["fly_region"], "sin");
    assert_eq!(behind[0].labels["fly_app"], "alpha");
    assert_eq!(behind[0].value, 2.0);

    // Sweep bookkeeping.
    assert_eq!(
        value(
            &s,
            metrics::SWEEPS_TOTAL,
            &[("result", metrics::SWEEP_SUCCESS)]
        ),
        1.0
    );
    assert_eq!(
        value(&s, "fleet_reconciler_sweep_duration_seconds_count", &[]),
        1.0
    );
    assert_eq!(
        value(
            &s,
            "fleet_reconciler_sweep_duration_seconds_bucket",
            &[("le", "1")]
        ),
        0.0
    );
    assert_eq!(
        value(
            &s,
            "fleet_reconciler_sweep_duration_seconds_bucket",
            &[("le", "2.5")]
        ),
        1.0
    );
    let ts = value(&s, metrics::LAST_SWEEP_SUCCESS_TIMESTAMP, &[]);
    assert!((ts - now.timestamp_millis() as f64 / 1000.0).abs() < 0.002);
    assert_eq!(
        value(
            &s,
            metrics::TIP_INFO,
            &[("branch", "release"), ("commit", &fx.tip())]
        ),
        1.0
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_machine_series_are_removed_when_back_on_tip_or_gone() {
    let fx = Fixture::new();
    let sim = Sim::start(
        SimFleet::new(TOKEN).release_tip(fx.tip()).app(
            SimApp::new("alpha")
                .machine(SimMachine::new("d1").loaded(fx.behind(1)))
                .machine(SimMachine::new("d2").loaded(fx.behind(3)).region("ams"))
                .machine(SimMachine::new("ok").loaded(fx.tip())),
        ),
    )
    .await
    .unwrap();
    let sweeper = fx.sweeper(&sim, &["alpha"]).await;
    let m = Metrics::new(true).unwrap();
    let ids = |m: &Metrics| -> Vec<String> {
        let s = parse(&m.render().unwrap());
        let mut ids: Vec<String> = find(&s, metrics::COMMITS_BEHIND, &[])
            .iter()
            .map(|x| format!("{}={}", x.labels["machine_id"], x.value))
            .collect();
        ids.sort();
        ids
    };

    let report = sweep(&sweeper).await;
    m.record_sweep(&report, Duration::from_millis(200), Utc::now());
    assert_eq!(ids(&m), ["d1=1", "d2=3"]);

    // d1 is reloaded onto the tip: its series goes.
    assert!(sim.set_loaded_ref("d1", &fx.tip()));
    let report = sweep(&sweeper).await;
    m.record_sweep(&report, Duration::from_millis(200), Utc::now());
    assert_eq!(ids(&m), ["d2=3"]);

    // d2 vanishes from the inventory (destroyed): its series goes too.
    let mut without = report.clone();
    without
        .machines
        .retain(|x| x.seen.machine_id != MachineId::from("d2"));
    m.record_sweep(&without, Duration::from_millis(200), Utc::now());
    assert!(ids(&m).is_empty(), "{:?}", ids(&m));
    let text = m.render().unwrap();
    assert!(
        !text.contains("machine_id="),
        "stale per-machine series:\n{text}"
    );

    // Stopping a drifted machine removes its series as well.
    assert!(sim.set_loaded_ref("ok", &fx.behind(4)));
    let report = sweep(&sweeper).await;
    m.record_sweep(&report, Duration::from_millis(200), Utc::now());
    assert_eq!(ids(&m), ["d2=3", "ok=4"]);
    assert!(sim.set_state("d2", "stopped"));
    let report = sweep(&sweeper).await;
    m.record_sweep(&report, Duration::from_millis(200), Utc::now());
    assert_eq!(ids(&m), ["ok=4"]);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_machine_off_exports_no_machine_series() {
    let fx = Fixture::new();
    let sim = Sim::start(mixed(&fx)).await.unwrap();
    let sweeper = fx.sweeper(&sim, &["alpha", "beta", "empty"]).await;
    let report = sweep(&sweeper).await;
    let m = Metrics::new(false).unwrap();
    m.record_sweep(&report, Duration::from_millis(10), Utc::now());
    let text = m.render().unwrap();
    assert!(!text.contains(metrics::COMMITS_BEHIND), "{text}");
    assert!(!text.contains("machine_id"), "{text}");
    // The aggregate series are still there.
    let s = parse(&text);
    assert_eq!(
        value(
            &s,
            metrics::MACHINES,
            &[("fly_app", "alpha"), ("status", "drifted")]
        ),
        1.0
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fly_observer_counts_requests_by_op_and_code() {
    let fx = Fixture::new();
    let sim = Sim::start(mixed(&fx)).await.unwrap();
    let m = Metrics::new(true).unwrap();
    let mut config = FlyClientConfig::new(&sim.api_url());
    config.base_backoff = Duration::from_millis(10);
    config.max_backoff = Duration::from_millis(50);
    let fly = FlyClient::new(config, TOKEN)
        .unwrap()
        .with_observer(m.fly_observer());

    within(fly.list_machines(&"alpha".into())).await.unwrap();
    within(fly.list_machines(&"beta".into())).await.unwrap();
    within(fly.get_machine(&"alpha".into(), &"nope".into()))
        .await
        .unwrap_err();
    sim.fail_next(1, 503, None);
    within(fly.list_machines(&"alpha".into())).await.unwrap(); // 503, then retried: 200

    let s = parse(&m.render().unwrap());
    let count = |op: &str, code: &str| {
        value(
            &s,
            metrics::FLY_API_REQUESTS_TOTAL,
            &[("op", op), ("code", code)],
        )
    };
    assert_eq!(count("list_machines", "200"), 3.0);
    assert_eq!(count("list_machines", "503"), 1.0);
    assert_eq!(count("get_machine", "404"), 1.0);
    assert_eq!(find(&s, metrics::FLY_API_REQUESTS_TOTAL, &[]).len(), 3);

    // A daemon-wide sweep through an observed client counts too.
    let sweeper = fx.sweeper(&sim, &["alpha", "beta", "empty"]).await;
    let sweeper = Sweeper {
        fly: sweeper.fly.clone().with_observer(m.fly_observer()),
        ..sweeper
    };
    sweep(&sweeper).await;
    let s = parse(&m.render().unwrap());
    assert_eq!(
        value(
            &s,
            metrics::FLY_API_REQUESTS_TOTAL,
            &[("op", "list_machines"), ("code", "200")]
        ),
        6.0
    );
    sim.shutdown().await;
}

/// Checks `text` with the strict in-test parser, and saves it as
/// `<target>/tmp/scrapes/NAME.prom` for CI, which runs
/// `promtool check metrics` on every saved scrape.
fn exposition_check(name: &str, text: &str) {
    if let Err(e) = crate::common::exposition::check(text) {
        panic!("the scrape is not valid exposition format: {e}\n--- scrape ---\n{text}");
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("scrapes");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("{name}.prom")), text).unwrap();
}

/// The checker itself: each kind of mistake Prometheus or promtool would
/// reject is rejected.
#[test]
fn the_exposition_checker_rejects_what_prometheus_would() {
    let good = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"q\\\"\\\\\\n\"} 1\n\
# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 3.5\nh_count 2\n";
    let samples = crate::common::exposition::check(good).unwrap();
    assert_eq!(samples[0].labels["x"], "q\"\\\n");
    for (bad, why) in [
        (
            "# HELP a_total A.\n# TYPE a_total counter\na_total 1",
            "newline",
        ),
        ("# TYPE a_total counter\na_total 1\n", "no HELP"),
        ("# HELP a A.\n# TYPE a counter\na 1\n", "_total"),
        ("# HELP a A.\n# TYPE a gauge\na 1\na 2\n", "twice"),
        (
            "# HELP a A.\n# TYPE a gauge\na{x=\"1\"} 1\n# HELP b B.\n# TYPE b gauge\nb 1\na{x=\"2\"} 1\n",
            "split up",
        ),
        (
            "# HELP a A.\n# TYPE a gauge\na 1\n# HELP a again\n",
            "after the samples",
        ),
        ("# HELP a A.\n# TYPE a gauge\na{x=\"\\t\"} 1\n", "escape"),
        (
            "# HELP a A.\n# TYPE a gauge\na{__x=\"1\"} 1\n",
            "label name",
        ),
        ("# HELP 1a A.\n# TYPE 1a gauge\n1a 1\n", "metric name"),
        ("# HELP a A.\n# TYPE a gauge\na one\n", "not a number"),
        (
            "# HELP a A.\n# TYPE a gauge\na{x=\"1\" y=\"2\"} 1\n",
            "commas",
        ),
        (
            "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",
            "+Inf",
        ),
        (
            "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
            "decrease",
        ),
        (
            "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 2\n",
            "differs",
        ),
        (
            "# HELP a A.\n# TYPE a gauge\n# TYPE a gauge\na 1\n",
            "second TYPE",
        ),
    ] {
        let err = crate::common::exposition::check(bad).expect_err(why);
        assert!(err.contains(why), "{why}: {err}");
    }
}

/// A registry fed by every recorder: a sweep of `mixed` through observed
/// clients (Fly API, probes, git fetch), actions, rotations, webhooks.
/// Returns it and the scrape rendered 5 s after the sweep.
async fn full_scrape(fx: &Fixture, sim: &Sim) -> (Metrics, String) {
    let sweeper = fx.sweeper(sim, &["alpha", "beta", "empty"]).await;
    let m = Metrics::new(true).unwrap();
    let sweeper = Sweeper {
        fly: sweeper.fly.clone().with_observer(m.fly_observer()),
        prober: sweeper.prober.clone().with_observer(m.probe_observer()),
        overlay: sweeper
            .overlay
            .clone()
            .with_observer(m.git_fetch_observer()),
        ..sweeper
    };
    let report = sweep(&sweeper).await;
    let now = Utc::now();
    m.record_tip_fetched(now);
    m.record_sweep(&report, Duration::from_millis(830), now);
    m.record_sweep_failure("transport");
    m.record_action(&"alpha".into(), &"default".into(), "restart", "succeeded");
    m.record_action(&"alpha".into(), &"default".into(), "drain", "failed");
    m.set_rotations_in_progress(&[
        (&"alpha".into(), &"default".into(), 1),
        (&"beta".into(), &"default".into(), 0),
    ]);
    m.record_webhook_delivery("pagerduty", "delivered");
    m.set_webhook_sink(0, "pagerduty", 0, false);
    m.init_heartbeats(1);
    m.record_heartbeat(0, fleet_reconciler::report::notify::PingResult::Ok);
    m.set_decisions([(
        "alpha",
        &fleet_reconciler::decide::decision::Decision::OnTip,
    )]);
    m.set_guardrails(
        [("alpha", "default")],
        &std::collections::BTreeSet::from([("alpha", "default", "canary")]),
    );
    m.set_guardrail_until(&std::collections::BTreeMap::from([(
        ("alpha", "default", "canary"),
        now + TimeDelta::minutes(30),
    )]));
    let text = m.render_at(now + TimeDelta::seconds(5)).unwrap();
    (m, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_scrape_is_valid_exposition_format() {
    let fx = Fixture::new();
    let sim = Sim::start(mixed(&fx)).await.unwrap();
    let (_m, text) = full_scrape(&fx, &sim).await;
    exposition_check("full", &text);

    // Every series of docs/design.md §7 is present, with help and type.
    for name in [
        metrics::COHERENCE_RATIO,
        metrics::FLEET_COHERENCE_RATIO,
        metrics::MACHINES,
        metrics::COMMITS_BEHIND,
        metrics::DRIFT_SEVERITY_MACHINES,
        metrics::ROTATIONS_IN_PROGRESS,
        metrics::ACTIONS_TOTAL,
        metrics::FLY_API_REQUESTS_TOTAL,
        metrics::FLY_API_REQUEST_DURATION_SECONDS,
        metrics::AGENT_PROBE_DURATION_SECONDS,
        metrics::GIT_FETCH_DURATION_SECONDS,
        metrics::SWEEP_DURATION_SECONDS,
        metrics::LAST_SWEEP_SUCCESS_TIMESTAMP,
        metrics::TIP_AGE_SECONDS,
        metrics::SWEEPS_TOTAL,
    ] {
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "no help for {name}"
        );
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "no type for {name}"
        );
    }
    let s = parse(&text);
    assert_eq!(value(&s, metrics::TIP_AGE_SECONDS, &[]), 5.0);
    assert_eq!(
        value(
            &s,
            metrics::ACTIONS_TOTAL,
            &[
                ("fly_app", "alpha"),
                ("action", "restart"),
                ("result", "succeeded")
            ]
        ),
        1.0
    );
    assert_eq!(
        value(&s, metrics::SWEEPS_TOTAL, &[("result", "transport")]),
        1.0
    );
    assert!(text.contains("# TYPE fleet_reconciler_sweep_duration_seconds histogram"));
    assert!(text.contains("fleet_reconciler_sweep_duration_seconds_bucket{le=\"0.05\"}"));
    assert!(text.contains("fleet_reconciler_sweep_duration_seconds_bucket{le=\"120\"}"));

    // Latency: the listings (by call and outcome), each probe (by outcome)
    // and the fetch `check` made.
    assert_eq!(
        value(
            &s,
            "fleet_reconciler_fly_api_request_duration_seconds_count",
            &[("op", "list_machines"), ("outcome", "ok")]
        ),
        3.0
    );
    // alpha: 3 on tip + 1 drifted report, 1 HTTP 500; beta: 2 reports.
    let probes = |outcome: &str| {
        value(
            &s,
            "fleet_reconciler_agent_probe_duration_seconds_count",
            &[("outcome", outcome)],
        )
    };
    assert_eq!(probes("report"), 6.0);
    assert_eq!(probes("unreachable"), 1.0);
    assert_eq!(
        value(
            &s,
            "fleet_reconciler_git_fetch_duration_seconds_count",
            &[("outcome", "ok")]
        ),
        1.0
    );
    // Process metrics, as Prometheus client libraries name them.
    if cfg!(target_os = "linux") {
        assert!(value(&s, "process_resident_memory_bytes", &[]) > 0.0);
        assert!(value(&s, "process_start_time_seconds", &[]) > 0.0);
    }
    // Every name is ours (or a process_ standard name), and no label is one
    // a scrape sets itself and would overwrite.
    for sample in &s {
        assert!(
            sample.name.starts_with("fleet_reconciler_") || sample.name.starts_with("process_"),
            "{} lacks the fleet_reconciler_ prefix",
            sample.name
        );
        for label in ["app", "region", "instance", "job"] {
            assert!(
                !sample.labels.contains_key(label),
                "{} has a `{label}` label, which a scrape overwrites",
                sample.name
            );
        }
    }

    // A fresh registry (nothing recorded yet) is valid too.
    let fresh = Metrics::new(true).unwrap();
    exposition_check("fresh", &fresh.render().unwrap());
    sim.shutdown().await;
}

/// Every metric name the README, the docs, the config examples, the alert
/// rules, their tests, the route example and the dashboard mention is one
/// the daemon exports (histograms with their `_bucket`/`_sum`/`_count`), and
/// none uses a name from before the `fleet_reconciler_` prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_name_in_the_docs_and_deploy_files_is_exported() {
    let fx = Fixture::new();
    let sim = Sim::start(mixed(&fx)).await.unwrap();
    let (_m, text) = full_scrape(&fx, &sim).await;
    sim.shutdown().await;
    let mut exported = std::collections::BTreeSet::new();
    for line in text.lines() {
        let mut words = line.strip_prefix("# TYPE ").unwrap_or("").split(' ');
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        exported.insert(name.to_string());
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                exported.insert(format!("{name}{suffix}"));
            }
        }
    }
    // Names of the `fleet_reconciler_` family that are not metrics: Fly
    // machine metadata keys, and the volume and role names of docs/deploy.md.
    use fleet_reconciler::metadata;
    let not_metrics = [
        metadata::MARKER_KEY,
        metadata::HOLD_KEY,
        metadata::APPROVE_KEY,
        metadata::UNPROBED_KEY,
        metadata::SLOTS_KEY,
        metadata::COORDINATOR_SPENT_PREFIX.trim_end_matches('.'),
        metadata::halt::COORDINATOR_HALT_PREFIX.trim_end_matches('.'),
        "fleet_reconciler_data",
        "fleet_reconciler_role",
    ];
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    for dir in [
        "docs",
        "config",
        "deploy",
        "deploy/prometheus",
        "deploy/alertmanager",
        "deploy/grafana",
    ] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if ["md", "toml", "yml", "json"].contains(&ext) {
                files.push(path);
            }
        }
    }
    let is_name = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
    let mut wrong = Vec::new();
    let mut seen = 0;
    for file in &files {
        let body = std::fs::read_to_string(file).unwrap();
        let rel = file.strip_prefix(root).unwrap().display().to_string();
        for (at, _) in body
            .match_indices("fleet_")
            .chain(body.match_indices("process_"))
        {
            if body[..at].chars().next_back().is_some_and(is_name) {
                continue; // inside a longer word
            }
            let end = body[at..]
                .find(|c: char| !is_name(c))
                .map_or(body.len(), |n| at + n);
            let word = &body[at..end];
            if let Some(rest) = word.strip_prefix("fleet_reconciler_") {
                if rest.is_empty() || not_metrics.contains(&word) {
                    continue;
                }
                seen += 1;
                if !exported.contains(word) {
                    wrong.push(format!("{rel}: {word} is not exported"));
                }
            } else if word.len() > "process_".len() && word.starts_with("process_") {
                if exported.iter().any(|e| e.starts_with("process_")) && !exported.contains(word) {
                    wrong.push(format!("{rel}: {word} is not exported"));
                }
            } else if let Some(rest) = word.strip_prefix("fleet_") {
                let renamed = format!("fleet_reconciler_{rest}");
                if exported.contains(&renamed) {
                    wrong.push(format!("{rel}: {word} was renamed {renamed}"));
                }
            }
        }
    }
    assert!(
        seen > 50,
        "only {seen} metric names found: is the scan broken?"
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// `FleetActionsFailing` reads `increase()` of the failed series: a series
/// born at its first failure (value 1) shows no increase, so that failure
/// would never alert. Every pool's failed series exist at 0 first.
#[test]
fn failed_action_series_exist_at_zero_before_the_first_failure() {
    let m = Metrics::new(false).unwrap();
    m.set_rotations_in_progress(&[
        (&"alpha".into(), &"default".into(), 0),
        (&"alpha".into(), &"canary".into(), 1),
    ]);
    let s = parse(&m.render().unwrap());
    for pool in ["default", "canary"] {
        for action in metrics::ACTIONS {
            for result in metrics::ACTION_RESULTS {
                assert_eq!(
                    value(
                        &s,
                        metrics::ACTIONS_TOTAL,
                        &[
                            ("fly_app", "alpha"),
                            ("pool", pool),
                            ("action", action),
                            ("result", result)
                        ]
                    ),
                    0.0,
                    "{pool}/{action}/{result}"
                );
            }
        }
    }
    m.record_action(&"alpha".into(), &"canary".into(), "restart", "failed");
    // A pool no longer passed keeps its counters (a counter never vanishes).
    m.set_rotations_in_progress(&[(&"alpha".into(), &"default".into(), 0)]);
    let s = parse(&m.render().unwrap());
    assert_eq!(
        value(
            &s,
            metrics::ACTIONS_TOTAL,
            &[
                ("fly_app", "alpha"),
                ("pool", "canary"),
                ("action", "restart"),
                ("result", "failed")
            ]
        ),
        1.0
    );
}

#[test]
fn tip_age_is_measured_from_start_until_the_first_fetch() {
    let start = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
    let m = Metrics::new_at(true, start).unwrap();
    let at = |s: i64| start + TimeDelta::seconds(s);
    let age = |m: &Metrics, now| {
        value(
            &parse(&m.render_at(now).unwrap()),
            metrics::TIP_AGE_SECONDS,
            &[],
        )
    };
    assert_eq!(age(&m, at(90)), 90.0);
    m.record_tip_fetched(at(100));
    assert_eq!(age(&m, at(160)), 60.0);
    // Before the first sweep the success timestamp is 0, so "stopped
    // advancing" alerts fire for a daemon that never swept.
    let s = parse(&m.render_at(at(160)).unwrap());
    assert_eq!(value(&s, metrics::LAST_SWEEP_SUCCESS_TIMESTAMP, &[]), 0.0);
}

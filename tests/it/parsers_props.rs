//! Property tests of every parser that reads text from outside (issue #10):
//! the config loader, the agent health-report parser, the rotation marker,
//! approval, slot set and probe-evidence parsers, the health-URL template,
//! and the resolution of reported refs against a real git repository.
//!
//! Each gets thousands of inputs, arbitrary and structured-but-hostile (random
//! bytes, huge numbers, extreme timestamps, deep nesting, huge strings,
//! control characters, unicode), and must: not panic; when it refuses, name
//! the field or key it refused; and keep what it stores and what it says
//! bounded (see `text::bounded`).

use std::collections::HashSet;
use std::path::Path;
use std::sync::OnceLock;

use chrono::{DateTime, Utc};
use fleet_reconciler::config::{Config, ConfigError, HealthUrlTemplate, UrlVars};
use fleet_reconciler::metadata::marker::{MAX_MARKER_OWNER_CHARS, Marker, Phase, RotationMode};
use fleet_reconciler::metadata::operator::{Approval, ApprovalMode, MAX_APPROVAL_BY_CHARS};
use fleet_reconciler::metadata::slots::{Coordinator, SlotSet};
use fleet_reconciler::metadata::unprobed::Unprobed;
use fleet_reconciler::model::{CommitId, PolicyAction, Severity};
use fleet_reconciler::observe::overlay::{Overlay, OverlaySource, RefAnalysis, Signals};
use fleet_reconciler::observe::probe::{ProbeOutcome, parse_report};
use fleet_reconciler::text::{MAX_DETAIL_CHARS, MAX_TAG_CHARS};
use git2::{ObjectType, Oid, Repository, Signature, Time};
use proptest::prelude::*;

/// Longest error text any parser may produce (config errors carry a file
/// path and a key on top of a bounded message).
const MAX_ERROR_CHARS: usize = 2048;

fn cases(n: u32) -> ProptestConfig {
    // Failures are saved beside this file (parsers_props.proptest-regressions)
    // and replayed first.
    ProptestConfig {
        cases: n,
        ..ProptestConfig::default()
    }
}

// ---- hostile building blocks ----------------------------------------------

/// Timestamps at and past the edges of what chrono and RFC 3339 can hold.
const EXTREME_TIMES: &[&str] = &[
    "+262142-12-31T23:59:59Z",
    "+262143-01-01T00:00:00Z",
    "-262143-01-01T00:00:00Z",
    "-262144-12-31T23:59:59Z",
    "+262142-12-31T23:59:59.999999999Z",
    "9999-12-31T23:59:59-23:59",
    "9999-12-31T23:59:59.999999999+23:59",
    "0000-01-01T00:00:00+23:59",
    "0000-01-01T00:00:00Z",
    "1969-12-31T23:59:59Z",
    "2026-02-30T00:00:00Z",
    "2026-13-01T00:00:00Z",
    "2026-11-29T24:00:00Z",
    "2026-11-29T23:59:60Z",
    "2026-11-29T10:00:00.99999999999999999999Z",
    "2026-11-29T10:00:00+99:99",
    "2026-11-29 10:00:00Z",
    "2026-11-29T10:00:00",
    "2026-11-29",
    "99999999999-01-01T00:00:00Z",
    "",
];

/// Strings an attacker (or a bug) might put anywhere.
fn hostile_string() -> BoxedStrategy<String> {
    prop_oneof![
        4 => any::<String>(),
        2 => "\\PC{0,40}",
        2 => "[\\x00-\\x1f\\x7f\u{80}-\u{9f}\u{200b}\u{feff}\u{202e}]{0,12}",
        2 => prop::sample::select(EXTREME_TIMES).prop_map(str::to_string),
        1 => "[0-9]{15,400}",
        1 => "[0-9]{1,30}(ns|s|m|h|d|w|years|parsecs|)",
        1 => Just("1e400".to_string()),
        1 => Just("-0".to_string()),
        1 => Just("{name}{machine_id}{{app}}{".to_string()),
        1 => Just("http://x@evil:1/a/../../admin?#".to_string()),
        1 => (1usize..40_000, prop::sample::select(vec!["x", "é", "\u{1F980}", "\0", "\\", "\""]))
            .prop_map(|(n, c)| c.repeat(n)),
        1 => "[0-9a-fA-F]{0,45}",
        1 => "\\s{0,5}[0-9a-f]{1,40}\\s{0,5}",
    ]
    .boxed()
}

/// A JSON value as raw text, including what `serde_json::Value` cannot hold
/// (numbers past u64 and f64, nesting past the recursion limit).
fn raw_json(depth: u32) -> BoxedStrategy<String> {
    let leaf = prop_oneof![
        4 => hostile_string().prop_map(|s| serde_json::to_string(&s).unwrap()),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| serde_json::to_string(&f).unwrap()),
        1 => prop::sample::select(vec![
            "1e400", "-1e400", "18446744073709551616", "-9223372036854775809", "-0", "0.0",
            "1.5", "-1", "4e-400", "123456789012345678901234567890", "null", "true", "false",
            "[]", "{}", "\"\"",
        ])
        .prop_map(str::to_string),
        1 => "-?[0-9]{20,300}(\\.[0-9]{1,50})?(e-?[0-9]{1,5})?",
        1 => (100usize..4000).prop_map(|d| format!("{}{}", "[".repeat(d), "]".repeat(d))),
        1 => (100usize..4000).prop_map(|d| format!("{}1{}", "{\"a\":".repeat(d), "}".repeat(d))),
        1 => (100usize..4000).prop_map(|d| "[".repeat(d)),
    ];
    if depth == 0 {
        return leaf.boxed();
    }
    prop_oneof![
        4 => leaf,
        1 => prop::collection::vec(raw_json(depth - 1), 0..4)
            .prop_map(|v| format!("[{}]", v.join(","))),
        1 => prop::collection::vec((hostile_string(), raw_json(depth - 1)), 0..4).prop_map(|v| {
            let fields: Vec<String> = v
                .into_iter()
                .map(|(k, v)| format!("{}:{v}", serde_json::to_string(&k).unwrap()))
                .collect();
            format!("{{{}}}", fields.join(","))
        }),
    ]
    .boxed()
}

fn bytes() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        3 => prop::collection::vec(any::<u8>(), 0..512),
        // Byte soup made of JSON punctuation and keys: gets past the first byte.
        3 => prop::collection::vec(
            prop::sample::select(vec![
                "{", "}", "[", "]", ":", ",", "\"", "\\", "\\u", "d800", " ", "\n", "0", "-",
                "1e999", "null", "true", "\"overlay_ref\"", "\"rotation\"", "\"checkpoint\"",
                "\"capabilities\"", "\"heartbeat_at\"", "\"abcd\"", "\"tag\"", "\"target\"",
                "\"phase\"", "\"started_at\"", "\u{0}", "\u{FFFD}", "\u{1F980}",
            ]),
            0..64,
        )
        .prop_map(|v| v.concat().into_bytes()),
        1 => raw_json(2).prop_map(String::into_bytes),
    ]
    .boxed()
}

fn chars(s: &str) -> usize {
    s.chars().count()
}

fn in_range_time() -> impl Strategy<Value = String> {
    (0i64..253_402_300_799, 0u32..1_000_000_000, -1439i32..1439).prop_map(|(s, ns, off)| {
        let t = DateTime::from_timestamp(s, ns).unwrap();
        let off = chrono::FixedOffset::east_opt(off * 60).unwrap();
        t.with_timezone(&off).to_rfc3339()
    })
}

// ---- the health report ------------------------------------------------------

const REPORT_FIELDS: [&str; 7] = [
    "overlay_ref",
    "activity",
    "live_sessions",
    "last_input_at",
    "heartbeat_at",
    "capabilities",
    "rotation",
];

fn valid_report_field(i: usize) -> BoxedStrategy<String> {
    let q = |s: String| serde_json::to_string(&s).unwrap();
    match i {
        0 => "\\s{0,2}[0-9a-fA-F]{4,40}\\s{0,2}".prop_map(q).boxed(),
        1 => prop::sample::select(vec!["\"idle\"", "\"busy\""])
            .prop_map(str::to_string)
            .boxed(),
        2 => any::<u64>().prop_map(|n| n.to_string()).boxed(),
        3 | 4 => in_range_time().prop_map(q).boxed(),
        5 => prop::collection::vec(
            prop::sample::select(vec!["\"drain\"", "\"reload\"", "\"teleport\"", "\"\""]),
            0..40,
        )
        .prop_map(|v| format!("[{}]", v.join(",")))
        .boxed(),
        _ => (any::<bool>(), prop::option::of("\\PC{0,128}"))
            .prop_map(|(f, c)| serde_json::json!({ "fenced": f, "checkpoint": c }).to_string())
            .boxed(),
    }
}

/// A report with every field valid or absent, then one field (a known one,
/// an unknown one, or none) given a hostile value.
fn report_body() -> impl Strategy<Value = (String, Option<&'static str>)> {
    let fields: Vec<BoxedStrategy<Option<String>>> = (0..REPORT_FIELDS.len())
        .map(|i| {
            if i == 0 {
                valid_report_field(i).prop_map(Some).boxed()
            } else {
                prop::option::of(valid_report_field(i)).boxed()
            }
        })
        .collect();
    (
        fields,
        prop::option::of(0..REPORT_FIELDS.len() + 1),
        raw_json(2),
    )
        .prop_map(|(mut values, hostile, value)| {
            let mut named = None;
            let mut extra = None;
            match hostile {
                Some(i) if i < REPORT_FIELDS.len() => {
                    values[i] = Some(value);
                    named = Some(REPORT_FIELDS[i]);
                }
                Some(_) => extra = Some(value),
                None => {}
            }
            let mut parts: Vec<String> = REPORT_FIELDS
                .iter()
                .zip(values)
                .filter_map(|(k, v)| v.map(|v| format!("\"{k}\":{v}")))
                .collect();
            if let Some(v) = extra {
                parts.push(format!("\"model\":{v}"));
            }
            (format!("{{{}}}", parts.join(",")), named)
        })
}

fn check_outcome(outcome: &ProbeOutcome) -> Result<(), TestCaseError> {
    match outcome {
        ProbeOutcome::Report(r) => {
            prop_assert!(
                (4..=40).contains(&r.overlay_ref.len()),
                "{:?}",
                r.overlay_ref
            );
            prop_assert!(
                r.overlay_ref
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "{:?}",
                r.overlay_ref
            );
            if let Some(tag) = r.rotation.as_ref().and_then(|r| r.checkpoint.as_deref()) {
                prop_assert!(
                    chars(tag) <= MAX_TAG_CHARS,
                    "checkpoint of {} chars",
                    chars(tag)
                );
            }
            // Two capabilities exist: a report repeating one is not stored N times.
            let distinct: HashSet<String> =
                r.capabilities.iter().map(|c| format!("{c:?}")).collect();
            prop_assert_eq!(distinct.len(), r.capabilities.len(), "{:?}", r.capabilities);
        }
        ProbeOutcome::BadReport(why) => {
            prop_assert!(
                chars(why) <= MAX_DETAIL_CHARS + 1,
                "detail of {} chars",
                chars(why)
            );
        }
        ProbeOutcome::Unreachable(why) => prop_assert!(false, "a parse said unreachable: {why}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(4000))]

    #[test]
    fn health_reports_from_arbitrary_bytes(body in bytes()) {
        check_outcome(&parse_report(&body))?;
    }

    #[test]
    fn hostile_report_fields_are_named_or_accepted((body, field) in report_body()) {
        let outcome = parse_report(body.as_bytes());
        check_outcome(&outcome)?;
        match (&outcome, field) {
            (ProbeOutcome::BadReport(why), Some(field)) => {
                prop_assert!(why.contains(field), "{field} not named in {why:?}\n{body}");
            }
            (ProbeOutcome::BadReport(why), None) => {
                // Only the one hostile value (unknown, so ignored) may have made it bad,
                // and then only by exceeding the nesting limit.
                prop_assert!(why.contains("model") || why.contains("recursion"), "{why}\n{body}");
            }
            (ProbeOutcome::Report(_), _) | (ProbeOutcome::Unreachable(_), _) => {}
        }
    }
}

// ---- markers, approvals, slot sets, probe evidence ---------------------------

fn extreme_time() -> impl Strategy<Value = DateTime<Utc>> {
    prop_oneof![
        6 => (-62_135_596_800i64..253_402_300_799).prop_map(|s| DateTime::from_timestamp(s, 0).unwrap()),
        1 => Just(DateTime::<Utc>::MAX_UTC),
        1 => Just(DateTime::<Utc>::MIN_UTC),
    ]
}

const MARKER_FIELDS: [&str; 16] = [
    "tag",
    "target",
    "phase",
    "mode",
    "action",
    "severity",
    "started_at",
    "attempt_started_at",
    "attempt",
    "owner",
    "restart_at",
    "retry_at",
    "drain_requested",
    "cordoned",
    "ending",
    "garbage",
];

fn marker() -> impl Strategy<Value = Marker> {
    (
        (
            "\\PC{1,40}",
            "[0-9a-f]{40}",
            0usize..7,
            0usize..4,
            0usize..5,
            0usize..4,
        ),
        (extreme_time(), extreme_time(), any::<u32>(), "\\PC{1,60}"),
        (
            prop::option::of(extreme_time()),
            prop::option::of(extreme_time()),
            any::<bool>(),
            prop::option::of(any::<bool>()),
        ),
    )
        .prop_map(
            |(
                (tag, target, phase, mode, action, severity),
                (started_at, attempt_started_at, attempt, owner),
                (restart_at, retry_at, drain_requested, cordoned),
            )| Marker {
                tag,
                target: CommitId::parse(&target).expect("40 hex digits"),
                phase: [
                    Phase::Claiming,
                    Phase::Draining,
                    Phase::Reloading,
                    Phase::Restarting,
                    Phase::Backoff,
                    Phase::Releasing,
                    Phase::Yielded,
                ][phase],
                mode: [
                    RotationMode::Wait,
                    RotationMode::Grace,
                    RotationMode::Now,
                    RotationMode::Reload,
                ][mode],
                action: [
                    PolicyAction::Observe,
                    PolicyAction::AlertAndWait,
                    PolicyAction::Restart,
                    PolicyAction::Reload,
                    PolicyAction::Manual,
                ][action],
                severity: Severity::ALL[severity],
                started_at,
                attempt_started_at,
                attempt,
                owner,
                restart_at,
                retry_at,
                drain_requested,
                cordoned,
                ending: None,
                instance_id: None,
                pool: None,
                failed: None,
                approval: None,
            },
        )
}

fn arbitrary_text() -> BoxedStrategy<String> {
    prop_oneof![
        2 => bytes().prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        1 => hostile_string(),
    ]
    .boxed()
}

proptest! {
    #![proptest_config(cases(3000))]

    #[test]
    fn metadata_values_from_arbitrary_text(text in arbitrary_text()) {
        if let Some(m) = Marker::parse(&text) {
            prop_assert!(chars(&m.tag) <= MAX_TAG_CHARS, "marker tag of {} chars", chars(&m.tag));
        }
        let _ = Approval::parse(&text);
        let _ = Unprobed::parse(&text);
        let _ = SlotSet::parse(Some(&text));
        let _ = text.parse::<Coordinator>();
    }

    /// A marker we wrote reads back as written, whatever its timestamps.
    #[test]
    fn markers_round_trip(m in marker()) {
        let value = m.to_value();
        prop_assert_eq!(Marker::parse(&value), Some(m), "{}", value);
    }

    /// A marker with one field replaced by a hostile value is refused or
    /// read, never a panic, and a long tag is never stored.
    #[test]
    fn hostile_marker_fields(m in marker(), field in 0..MARKER_FIELDS.len(), value in raw_json(1)) {
        let mut obj: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&m.to_value()).unwrap();
        let key = MARKER_FIELDS[field];
        obj.remove(key);
        let mut text = serde_json::to_string(&obj).unwrap();
        text.pop();
        let text = format!("{text},\"{key}\":{value}}}");
        match Marker::decode(&text) {
            Ok(m) => {
                prop_assert!(chars(&m.tag) <= MAX_TAG_CHARS, "marker tag of {} chars", chars(&m.tag));
                prop_assert!(chars(&m.owner) <= MAX_MARKER_OWNER_CHARS);
                prop_assert_eq!(Marker::parse(&text), Some(m));
            }
            Err(why) => {
                prop_assert!(chars(&why) <= MAX_DETAIL_CHARS + 1, "error of {} chars", chars(&why));
                // An unknown field is ignored: only its nesting can make the marker bad.
                let named = if key == "garbage" { why.contains(key) || why.contains("recursion") } else { why.contains(key) };
                prop_assert!(named, "{key} not named in {why:?}\n{text}");
                prop_assert_eq!(Marker::parse(&text), None);
            }
        }
    }

    #[test]
    fn hostile_approvals(
        target in prop_oneof![2 => "[0-9a-fA-F]{40}", 1 => hostile_string()], mode in any::<bool>(),
        by in hostile_string(), at in extreme_time(), field in 0usize..4, value in raw_json(1),
    ) {
        let mode = if mode { ApprovalMode::Now } else { ApprovalMode::WhenIdle };
        let text = serde_json::json!({ "target": &target, "mode": mode, "by": &by, "at": at }).to_string();
        // What an operator wrote reads back, whatever the timestamp, its
        // target as the commit it names in any case; a target no commit can
        // have makes it unreadable (it authorizes nothing), a long `by` is cut.
        match (CommitId::parse(&target), Approval::decode(&text)) {
            (None, read) => {
                let why = read.expect_err("a target that is no commit id");
                prop_assert!(why.contains("`target`"), "target not named in {why:?}");
            }
            (Some(commit), read) => {
                let read = read.unwrap();
                prop_assert_eq!(&read.target, &commit);
                prop_assert_eq!(read.mode, mode);
                prop_assert_eq!(read.at, at);
                if chars(&by) > MAX_APPROVAL_BY_CHARS {
                    prop_assert!(by.starts_with(read.by.trim_end_matches('…')));
                } else {
                    prop_assert_eq!(&read.by, &by);
                }
            }
        }
        // Then one field of a valid approval made hostile.
        let key = ["target", "mode", "by", "at"][field];
        let valid = Approval {
            target: CommitId::parse(&"a".repeat(40)).unwrap(),
            mode,
            by: by.chars().take(40).collect(),
            at,
        };
        let mut obj: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&serde_json::to_string(&valid).unwrap()).unwrap();
        obj.remove(key);
        let mut text = serde_json::to_string(&obj).unwrap();
        text.pop();
        let text = format!("{text},\"{key}\":{value}}}");
        match Approval::decode(&text) {
            Ok(a) => {
                prop_assert_eq!(a.target.as_str().len(), 40);
                prop_assert!(chars(&a.by) <= MAX_APPROVAL_BY_CHARS + 1);
            }
            Err(why) => {
                prop_assert!(chars(&why) <= MAX_DETAIL_CHARS + 1, "error of {} chars", chars(&why));
                prop_assert!(why.contains(key), "{key} not named in {why:?}\n{text}");
            }
        }
    }
}

// ---- the config loader --------------------------------------------------------

const MINIMAL_OVERLAY: &str = r#"
[overlay]
repo = "/srv/overlay"
branch = "release"
mirror_dir = "/data/overlay.git"
"#;
const ONE_APP: &str = "\n[[apps]]\nname = \"agents\"\n";

/// Where a hostile value goes (`{v}`) and the key an error about it must name.
const CONFIG_SLOTS: &[(&str, &str)] = &[
    ("[fly]\napi_url = {v}\n", "fly.api_url"),
    ("[fly]\ntoken_env = {v}\n", "fly.token_env"),
    ("[fly]\nrequest_timeout = {v}\n", "fly.request_timeout"),
    ("[fly]\nmax_retries = {v}\n", "fly.max_retries"),
    ("[sweep]\ninterval = {v}\n", "sweep.interval"),
    ("[probe]\ntimeout = {v}\n", "probe.timeout"),
    ("[probe]\nconcurrency = {v}\n", "probe.concurrency"),
    ("[probe]\nmax_body_bytes = {v}\n", "probe.max_body_bytes"),
    (
        "[rotation]\nmin_drift_age = {v}\n",
        "rotation.min_drift_age",
    ),
    (
        "[rotation]\ndrain_ceiling = {v}\n",
        "rotation.drain_ceiling",
    ),
    ("[rotation]\nretry_after = {v}\n", "rotation.retry_after"),
    (
        "[rotation]\nheartbeat_max_age = {v}\n",
        "rotation.heartbeat_max_age",
    ),
    ("[rotation]\ncoordinator = {v}\n", "rotation.coordinator"),
    (
        "[alerts]\ncoherence_threshold = {v}\n",
        "alerts.coherence_threshold",
    ),
    ("[alerts]\ncoherence_for = {v}\n", "alerts.coherence_for"),
    ("[metrics]\nper_machine = {v}\n", "metrics.per_machine"),
    ("[server]\nlisten = {v}\n", "server.listen"),
    (
        "[server]\nadmin_token_env = {v}\n",
        "server.admin_token_env",
    ),
    (
        "[pools.default]\nmax_concurrent_rotations = {v}\n",
        "pools.default.max_concurrent_rotations",
    ),
    (
        "[pools.default.actions]\nlow = {v}\n",
        "pools.default.actions.low",
    ),
    (
        "[pools.default.actions]\ncritical = {v}\n",
        "pools.default.actions.critical",
    ),
    (
        "[[severity]]\nlevel = {v}\nmin_commits_behind = 3\n",
        "severity[0].level",
    ),
    (
        "[[severity]]\nlevel = \"low\"\nmin_commits_behind = {v}\n",
        "severity[0].min_commits_behind",
    ),
    (
        "[[severity]]\nlevel = \"low\"\npaths = {v}\n",
        "severity[0].paths",
    ),
    (
        "[[severity]]\nlevel = \"low\"\ntrailers = {v}\n",
        "severity[0].trailers",
    ),
    (
        "[[severity]]\nlevel = \"low\"\nunknown_ref = {v}\n",
        "severity[0]",
    ),
    (
        "[[alerts.webhooks]]\nurl_env = \"U\"\nformat = {v}\n",
        "alerts.webhooks[0].format",
    ),
    (
        "[[alerts.webhooks]]\nurl_env = {v}\nformat = \"json\"\n",
        "alerts.webhooks[0].url_env",
    ),
    (
        "[[alerts.webhooks]]\nurl_env = \"U\"\nformat = \"json\"\nmin_severity = {v}\n",
        "alerts.webhooks[0].min_severity",
    ),
    (
        "[[alerts.webhooks]]\nurl_env = \"U\"\nformat = \"json\"\nrepeat_interval = {v}\n",
        "alerts.webhooks[0].repeat_interval",
    ),
];
/// Slots inside the app list (which then replaces the minimal one).
const APP_SLOTS: &[(&str, &str)] = &[
    ("[[apps]]\nname = {v}\n", "apps[0].name"),
    (
        "[[apps]]\nname = \"a\"\nhealth_url = {v}\n",
        "apps[0].health_url",
    ),
    (
        "[[apps]]\nname = \"a\"\npool_key = {v}\n",
        "apps[0].pool_key",
    ),
    (
        "[[apps]]\nname = \"a\"\nagent_token_env = {v}\n",
        "apps[0].agent_token_env",
    ),
    (
        "[[apps]]\nname = \"a\"\n[[apps]]\nname = \"b\"\nhealth_url = {v}\n",
        "apps[1].health_url",
    ),
];
const OVERLAY_SLOTS: &[(&str, &str)] = &[
    (
        "[overlay]\nrepo = {v}\nbranch = \"r\"\nmirror_dir = \"/m\"\n",
        "overlay.repo",
    ),
    (
        "[overlay]\nrepo = \"/r\"\nbranch = {v}\nmirror_dir = \"/m\"\n",
        "overlay.branch",
    ),
    (
        "[overlay]\nrepo = \"/r\"\nbranch = \"r\"\nmirror_dir = \"/m\"\nfetch_interval = {v}\n",
        "overlay.fetch_interval",
    ),
];

/// A TOML basic string: JSON's escapes are TOML's, bar DEL.
fn toml_string(s: &str) -> String {
    serde_json::to_string(s)
        .unwrap()
        .replace('\u{7f}', "\\u007f")
}

/// A TOML value as text, valid or (sometimes) not.
fn toml_value(depth: u32) -> BoxedStrategy<String> {
    let leaf = prop_oneof![
        6 => hostile_string().prop_map(|s| toml_string(&s)),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => any::<f64>().prop_map(|f| {
            if f.is_nan() { "nan".to_string() }
            else if f.is_infinite() { if f > 0.0 { "inf".into() } else { "-inf".into() } }
            else { format!("{f:e}") }
        }),
        1 => any::<bool>().prop_map(|b| b.to_string()),
        1 => prop::sample::select(vec![
            "1979-05-27T07:32:00Z", "9999-12-31T23:59:59.999999999-23:59", "0000-01-01T00:00:00Z",
            "1979-05-27", "07:32:00", "1979-05-27T07:32:00", "+262142-12-31T23:59:59Z",
            "99999999999999999999", "-9223372036854775808", "0x7fffffffffffffff", "1_000",
            "1e400", "\"30s\"", "\"0s\"", "\"30days 1s\"", "\"584942417355y\"", "\"1ns\"",
            "\"0.0.0.0:0\"", "\"[::1]:65536\"", "\"app/\"", "\"/m\"", "\"a/b/c\"", "'lit'",
            "'''multi\nline'''", "\"\"\"\n\"\"\"", "-0.0", "2.0", "1.000000001",
        ])
        .prop_map(str::to_string),
        1 => (100usize..2000).prop_map(|d| format!("{}{}", "[".repeat(d), "]".repeat(d))),
        1 => (100usize..2000).prop_map(|d| format!("{}1{}", "{a=".repeat(d), "}".repeat(d))),
    ];
    if depth == 0 {
        return leaf.boxed();
    }
    prop_oneof![
        5 => leaf,
        1 => prop::collection::vec(toml_value(depth - 1), 0..4).prop_map(|v| format!("[{}]", v.join(", "))),
        1 => prop::collection::vec((hostile_string(), toml_value(depth - 1)), 0..3).prop_map(|v| {
            let fields: Vec<String> =
                v.into_iter().map(|(k, v)| format!("{} = {v}", toml_string(&k))).collect();
            format!("{{ {} }}", fields.join(", "))
        }),
    ]
    .boxed()
}

fn config_text() -> impl Strategy<Value = (String, &'static str, String)> {
    let slot = prop_oneof![
        4 => prop::sample::select(CONFIG_SLOTS).prop_map(|s| (0, s)),
        2 => prop::sample::select(APP_SLOTS).prop_map(|s| (1, s)),
        1 => prop::sample::select(OVERLAY_SLOTS).prop_map(|s| (2, s)),
    ];
    (slot, toml_value(2)).prop_map(|((kind, (template, key)), value)| {
        let section = template.replace("{v}", &value);
        let text = match kind {
            0 => format!("{MINIMAL_OVERLAY}{ONE_APP}\n{section}"),
            1 => format!("{MINIMAL_OVERLAY}\n{section}"),
            _ => format!("{section}{ONE_APP}"),
        };
        (text, key, value)
    })
}

fn check_error(e: &ConfigError) -> Result<(), TestCaseError> {
    let shown = e.to_string();
    prop_assert!(
        chars(&shown) <= MAX_ERROR_CHARS,
        "error of {} chars: {}…",
        chars(&shown),
        shown.chars().take(300).collect::<String>()
    );
    Ok(())
}

proptest! {
    #![proptest_config(cases(3000))]

    #[test]
    fn config_from_arbitrary_text(text in prop_oneof![
        2 => arbitrary_text(),
        // Fragments of real configs shuffled together, with hostile values.
        2 => prop::collection::vec(
            prop_oneof![
                prop::sample::select(CONFIG_SLOTS).prop_map(|s| s.0.to_string()),
                prop::sample::select(APP_SLOTS).prop_map(|s| s.0.to_string()),
                prop::sample::select(OVERLAY_SLOTS).prop_map(|s| s.0.to_string()),
                toml_value(1),
                Just("\n".to_string()), Just("[".to_string()), Just("=".to_string()),
            ],
            0..12,
        )
        .prop_map(|parts| parts.concat().replace("{v}", "\"\u{e9}\\u0000\"")),
    ]) {
        if let Err(e) = Config::parse(Path::new("props.toml"), &text) {
            check_error(&e)?;
        }
    }

    #[test]
    fn hostile_config_values_are_refused_by_key((text, key, value) in config_text()) {
        let Err(e) = Config::parse(Path::new("props.toml"), &text) else { return Ok(()) };
        check_error(&e)?;
        // Only a value TOML itself accepts can be blamed on a key: a syntax
        // error has a line instead.
        let syntactic = format!("v = {value}").parse::<toml::Table>().is_ok();
        match &e {
            ConfigError::Invalid { key: got, line, .. } => {
                if syntactic {
                    // The key itself, a key inside its value, or (for a rule
                    // judged as a whole) the table holding it.
                    let named = got.starts_with(key) || (!got.is_empty() && key.starts_with(got.as_str()));
                    prop_assert!(named, "expected key {key}, got {got:?}: {e}");
                } else {
                    prop_assert!(line.is_some(), "a syntax error without a line: {e}");
                }
            }
            ConfigError::Read { .. } => prop_assert!(false, "parse cannot fail to read"),
        }
    }
}

// ---- health URL templates --------------------------------------------------------

fn url_vars() -> impl Strategy<Value = [String; 5]> {
    let value = prop_oneof![
        3 => "[a-z0-9-]{1,20}",
        3 => hostile_string(),
        1 => prop::sample::select(vec![
            "x@evil:1/", "a/../../admin?", "..", ".", "%2e%2e", "evil.com#", "[::1]", "a b",
            "127.0.0.1:1/x?", "fdaa:0:1:a7b:1::2", "\\..\\", "a\r\nHost: evil",
        ])
        .prop_map(str::to_string),
    ];
    [
        value.clone(),
        value.clone(),
        value.clone(),
        value.clone(),
        value,
    ]
}

const TEMPLATES: &[&str] = &[
    "http://{machine_id}.vm.{app}.internal:8080/health",
    "http://[{private_ip}]:8080/{app}/{region}/{name}/health",
    "https://agents.example.com/{app}/{name}/health?region={region}",
    "http://{region}.{app}.internal/m/{machine_id}/health#{name}",
];

proptest! {
    #![proptest_config(cases(3000))]

    /// Whatever a machine is called, its health URL keeps the template's
    /// scheme, host and path shape: a value never adds a path segment, a
    /// query, a fragment or userinfo, nor moves the host to another.
    #[test]
    fn health_url_values_stay_in_their_slot(t in prop::sample::select(TEMPLATES), v in url_vars()) {
        let template = HealthUrlTemplate::parse(t).unwrap();
        let vars = UrlVars { machine_id: &v[0], app: &v[1], private_ip: &v[2], region: &v[3], name: &v[4] };
        let Ok(rendered) = template.render(&vars) else { return Ok(()) };
        let url = url::Url::parse(&rendered);
        let Ok(url) = url else { return Ok(()) };
        let sample = url::Url::parse(&template.render(&UrlVars {
            machine_id: "m", app: "a", private_ip: "fdaa::2", region: "r", name: "n",
        }).unwrap()).unwrap();
        prop_assert_eq!(url.scheme(), sample.scheme());
        prop_assert_eq!(url.username(), "");
        prop_assert_eq!(url.password(), None);
        prop_assert_eq!(url.port(), sample.port(), "{}", rendered);
        prop_assert_eq!(url.query().is_some(), sample.query().is_some(), "{}", rendered);
        prop_assert_eq!(url.fragment().is_some(), sample.fragment().is_some(), "{}", rendered);
        let segs = |u: &url::Url| u.path_segments().map(|s| s.count()).unwrap_or(0);
        prop_assert_eq!(segs(&url), segs(&sample), "{}", rendered);
        // A literal host stays itself; a host made of values keeps the
        // template's literal labels; an address stays an address.
        if !t.starts_with("http://{") && !t.starts_with("http://[{") {
            prop_assert_eq!(url.host_str(), sample.host_str(), "{}", rendered);
        }
        if t.contains(".internal") {
            prop_assert!(url.host_str().is_some_and(|h| h.ends_with(".internal")), "{}", rendered);
        }
        if t.starts_with("http://[{") {
            prop_assert!(matches!(url.host(), Some(url::Host::Ipv6(_))), "{}", rendered);
        }
    }
}

// ---- ref resolution against a real repository --------------------------------------

struct Repo {
    _upstream: tempfile::TempDir,
    _mirror: tempfile::TempDir,
    overlay: Overlay,
    tip: fleet_reconciler::model::CommitId,
    /// Every object in the mirror: id → kind, and for tags the commit they name.
    objects: Vec<(String, ObjectType, Option<Oid>)>,
    /// 4- and 5-digit prefixes that several objects share.
    shared_prefixes: Vec<String>,
    runtime: tokio::runtime::Runtime,
}

/// A release branch of 30 commits over 1,500 files, so that 4-digit
/// prefixes collide (≈ 3,000 objects in 65,536 prefixes), plus annotated
/// tags of a commit and of a blob.
fn repo() -> &'static Repo {
    static REPO: OnceLock<Repo> = OnceLock::new();
    REPO.get_or_init(|| {
        let upstream = tempfile::tempdir().unwrap();
        let repo = Repository::init_bare(upstream.path()).unwrap();
        let mut parent: Option<Oid> = None;
        let mut last_blob = None;
        for c in 0..30 {
            let mut tb = repo.treebuilder(None).unwrap();
            if let Some(p) = parent {
                let prev = repo.find_commit(p).unwrap().tree().unwrap();
                for e in prev.iter() {
                    tb.insert(e.name().unwrap(), e.id(), e.filemode()).unwrap();
                }
            }
            for f in 0..50 {
                let blob = repo.blob(format!("file {c}/{f}\n").as_bytes()).unwrap();
                tb.insert(format!("f{c}-{f}"), blob, 0o100644).unwrap();
                last_blob = Some(blob);
            }
            let tree = repo.find_tree(tb.write().unwrap()).unwrap();
            let sig = Signature::new("t", "t@example.com", &Time::new(1_760_000_000 + c * 60, 0))
                .unwrap();
            let parents: Vec<git2::Commit> = parent
                .iter()
                .map(|p| repo.find_commit(*p).unwrap())
                .collect();
            let parents: Vec<&git2::Commit> = parents.iter().collect();
            let id = repo
                .commit(
                    Some("refs/heads/release"),
                    &sig,
                    &sig,
                    &format!("c{c}"),
                    &tree,
                    &parents,
                )
                .unwrap();
            parent = Some(id);
        }
        let sig = Signature::new("t", "t@example.com", &Time::new(1_760_000_000, 0)).unwrap();
        let head = repo.find_object(parent.unwrap(), None).unwrap();
        repo.tag("v1", &head, &sig, "release", false).unwrap();
        let blob = repo.find_object(last_blob.unwrap(), None).unwrap();
        repo.tag("blobtag", &blob, &sig, "a blob", false).unwrap();

        let mirror = tempfile::tempdir().unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let source = OverlaySource {
            repo: upstream.path().display().to_string(),
            branch: "release".into(),
            mirror_dir: mirror.path().join("overlay.git"),
            token: None,
        };
        let (overlay, tip) = runtime.block_on(async {
            let overlay = Overlay::open(source).await.unwrap();
            let tip = overlay.fetch().await.unwrap();
            (overlay, tip)
        });
        let m = Repository::open_bare(mirror.path().join("overlay.git")).unwrap();
        let mut ids = Vec::new();
        m.odb()
            .unwrap()
            .foreach(|id| {
                ids.push(*id);
                true
            })
            .unwrap();
        let objects: Vec<(String, ObjectType, Option<Oid>)> = ids
            .into_iter()
            .map(|id| {
                let o = m.find_object(id, None).unwrap();
                let kind = o.kind().unwrap();
                let peeled = (kind == ObjectType::Tag)
                    .then(|| o.peel(ObjectType::Commit).ok().map(|c| c.id()))
                    .flatten();
                (id.to_string(), kind, peeled)
            })
            .collect();
        let mut counts = std::collections::HashMap::<&str, usize>::new();
        for (id, ..) in &objects {
            *counts.entry(&id[..4]).or_default() += 1;
            *counts.entry(&id[..5]).or_default() += 1;
        }
        let mut shared_prefixes: Vec<String> = counts
            .into_iter()
            .filter(|(_, n)| *n > 1)
            .map(|(p, _)| p.to_string())
            .collect();
        shared_prefixes.sort();
        assert!(
            objects.iter().any(|(_, k, _)| *k == ObjectType::Tag) && shared_prefixes.len() > 5,
            "the fixture has annotated tags and shared prefixes"
        );
        Repo {
            _upstream: upstream,
            _mirror: mirror,
            overlay,
            tip: tip.commit,
            objects,
            shared_prefixes,
            runtime,
        }
    })
}

/// What resolving `reference` must give, from the object list alone.
fn expected(repo: &Repo, reference: &str) -> RefAnalysis {
    let name = reference.to_ascii_lowercase();
    if name.is_empty() || name.len() > 40 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
        return RefAnalysis::Unknown;
    }
    if name.len() < 4 {
        return RefAnalysis::Ambiguous;
    }
    let hits: Vec<_> = repo
        .objects
        .iter()
        .filter(|(id, ..)| id.starts_with(&name))
        .collect();
    let commit = match hits.as_slice() {
        [] => return RefAnalysis::Unknown,
        [(id, ObjectType::Commit, _)] => id.clone(),
        [(_, ObjectType::Tag, Some(c))] => c.to_string(),
        [_] => return RefAnalysis::Unknown,
        _ => return RefAnalysis::Ambiguous,
    };
    let commit = fleet_reconciler::model::CommitId::parse(&commit).unwrap();
    if commit == repo.tip {
        RefAnalysis::OnTip { commit }
    } else {
        // Stands for any drift range: compared by commit only.
        RefAnalysis::Drifted {
            commit,
            range: Default::default(),
        }
    }
}

fn reference() -> impl Strategy<Value = String> {
    let repo = repo();
    let ids: Vec<String> = repo.objects.iter().map(|(id, ..)| id.clone()).collect();
    prop_oneof![
        // Prefixes of real ids, any length, any case.
        6 => (prop::sample::select(ids), prop_oneof![4usize..=6, 0usize..=41], any::<u64>()).prop_map(|(id, n, case)| {
            let mut s: String = id.chars().take(n).collect();
            if n > 40 { s.push('0'); }
            s.chars().enumerate().map(|(i, c)| if case >> (i % 64) & 1 == 1 { c.to_ascii_uppercase() } else { c }).collect()
        }),
        2 => prop::sample::select(repo.shared_prefixes.clone()),
        2 => "[0-9a-fA-F]{0,44}",
        1 => "[0-9a-f]{4,6}",
        1 => hostile_string(),
        1 => "[g-zG-Z \t\n\u{e9}\u{1F980}0-9]{0,41}",
    ]
}

proptest! {
    #![proptest_config(cases(1000))]

    #[test]
    fn refs_resolve_as_git_would(refs in prop::collection::vec(reference(), 1..12)) {
        let repo = repo();
        let got = repo
            .runtime
            .block_on(repo.overlay.analyze(&repo.tip, refs.clone(), &Signals::new()))
            .unwrap();
        for r in &refs {
            let want = expected(repo, r);
            let have = got.get(r).unwrap_or_else(|| panic!("no answer for {r:?}"));
            match (have, &want) {
                (RefAnalysis::Drifted { commit: a, .. }, RefAnalysis::Drifted { commit: b, .. }) => {
                    prop_assert_eq!(a, b, "{:?}", r);
                }
                (have, want) => prop_assert_eq!(have, want, "{:?}", r),
            }
        }
    }
}

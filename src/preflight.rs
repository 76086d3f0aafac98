//! `preflight`: is this config, with these secrets, ready for `run`?
//!
//! Owns the checks and their typed results ([`Finding`]): first every check
//! `run` makes at start (each secret a `*_env` key names, the coordinator
//! when a pool acts, each webhook's URL, the mirror directory), then the live
//! ones (each app listed with its own token, the coordinator machine, the
//! overlay remote and branch, a dry request to each webhook, a sample of
//! health URLs). Every check runs, whatever failed before it: one run reports
//! every problem. A Fly 429 is waited out within bounds ([`RATE_LIMIT_ROUNDS`],
//! [`RATE_LIMIT_PATIENCE`]) and, if it persists, reported as rate limiting,
//! not as an unreachable API. `validate-config --check-env` runs the offline part.
//!
//! What it must never do: change anything a running daemon relies on. It
//! writes nothing to Fly but one lease on the coordinator, taken and released
//! at once (see [`LEASE_TTL`]); it fetches the overlay into a temporary
//! directory, not the mirror; it sends no webhook anything that could page or
//! post (see [`WebhookProbe`]). It never reads the environment itself (the
//! caller passes a lookup) and never puts a secret in a finding.

use std::collections::BTreeMap;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Serialize;

use crate::act::executor::ExecutorBuildError;
use crate::config::{Config, HealthUrlTemplate, UrlVars, WebhookFormat};
use crate::fly::{FlyClient, FlyClientConfig, FlyError, FlyTokens, Machine};
use crate::metadata::SLOTS_KEY;
use crate::metadata::slots::{Coordinator, SlotSet};
use crate::model::AppName;
use crate::observe::gate::{AlertGate, GateView};
use crate::observe::overlay::{Overlay, OverlaySource};
use crate::observe::probe::{ProbeOutcome, Prober};
use crate::report::notify::{self, Notifier, NotifierOptions, NotifyError, SinkSecrets};

/// How long the coordinator's lease is taken for: it is released at once,
/// and if the release is lost it lapses after this, within the patience a
/// daemon's slot change has for the lease (10 s).
pub const LEASE_TTL: Duration = Duration::from_secs(5);
/// Started machines probed per app.
pub const HEALTH_SAMPLE: usize = 3;
/// Deadline of one webhook request.
const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(10);
/// Rounds of waiting after Fly keeps answering 429 to one call (each round
/// is the client's attempt and its one retry): throttling is transient, and
/// reporting it as a failed check sends people looking for a broken API.
const RATE_LIMIT_ROUNDS: u32 = 3;
/// The shortest wait between rounds: Fly refills a machine's bucket of an
/// action at 1 request/s (FLY-REALITY.md, "Limits"), its `Retry-After` when
/// it sends one is longer. Doubles each round.
const RATE_LIMIT_WAIT: Duration = Duration::from_secs(1);
/// All the waiting for 429s one call may do: a `Retry-After` past it is
/// not waited for.
const RATE_LIMIT_PATIENCE: Duration = Duration::from_secs(20);

/// What a check is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, strum::IntoStaticStr)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum CheckKind {
    /// An environment variable a `*_env` key names.
    Secret,
    /// `rotation.coordinator`, as configured and as the machine is.
    Coordinator,
    /// `overlay.mirror_dir` can be created or written.
    Mirror,
    /// An app listed with its own token.
    App,
    /// The overlay remote answers and has the branch.
    Overlay,
    /// A webhook's URL and a dry request to it.
    Webhook,
    /// An `[[alerts.alertmanager]]`'s URL and a read of its status.
    Alertmanager,
    /// The alert gate (`[gates.alertmanager]`): its URL and a read of the
    /// alerts it would hold claims on.
    Gate,
    /// A sample of an app's health URLs answering a report.
    Health,
    /// The record key (`records.key_env`, `records.previous_key_env`).
    RecordKey,
}

/// How a check ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    Fail,
    /// Not checked because of another failure (named in `detail`), or
    /// nothing to check.
    Skipped,
    /// Works, but weaker than it should be (the detail says why); not a failure.
    Warn,
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub check: CheckKind,
    /// What was checked: a variable, an app, a machine, a webhook key.
    pub subject: String,
    pub status: Status,
    /// What was found (never a secret).
    pub detail: String,
    /// How to fix it, for a failure.
    pub fix: Option<String>,
}

impl Finding {
    fn ok(check: CheckKind, subject: impl Into<String>, detail: impl Into<String>) -> Finding {
        Finding {
            check,
            subject: subject.into(),
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    fn fail(
        check: CheckKind,
        subject: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Finding {
        Finding::with_fix(Status::Fail, check, subject, detail, fix)
    }

    fn warn(
        check: CheckKind,
        subject: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Finding {
        Finding::with_fix(Status::Warn, check, subject, detail, fix)
    }

    /// A finding that is not `ok`, with what to do about it.
    fn with_fix(
        status: Status,
        check: CheckKind,
        subject: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Finding {
        Finding {
            check,
            subject: subject.into(),
            status,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    fn skipped(check: CheckKind, subject: impl Into<String>, detail: impl Into<String>) -> Finding {
        Finding {
            check,
            subject: subject.into(),
            status: Status::Skipped,
            detail: detail.into(),
            fix: None,
        }
    }
}

/// Every finding of one run, in the order checked.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub findings: Vec<Finding>,
}

impl Report {
    /// No check failed.
    pub fn passed(&self) -> bool {
        self.failures().next().is_none()
    }

    pub fn failures(&self) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(|f| f.status == Status::Fail)
    }
}

/// Reads an environment variable (`std::env::var` at the edge, a map in
/// tests); empty or blank counts as unset, as `run` counts it.
pub type Lookup<'a> = &'a (dyn Fn(&str) -> Option<String> + Sync);

fn read(env: Lookup<'_>, var: &str) -> Option<SecretString> {
    crate::config::env_secret(env, var)
}

/// The checks that need no network: the coordinator when a pool acts, and
/// with `check_env` every variable a `*_env` key names (and each webhook's
/// URL as `run` would judge it).
pub fn offline(config: &Config, env: Lookup<'_>, check_env: bool) -> Report {
    let mut findings = vec![coordinator_configured(config)];
    if check_env {
        findings.push(record_key(config, env));
        findings.extend(secrets(config, env));
        findings.extend(webhook_urls(config, env));
        findings.extend(alertmanager_urls(config, env));
        findings.extend(gate_checked(config, env).0);
    }
    Report { findings }
}

/// [`offline`] with every variable checked, then the live checks.
pub async fn run(config: &Config, env: Lookup<'_>) -> Report {
    let mut report = offline(config, env, true);
    report.findings.push(mirror_dir(config));
    let mut listed = BTreeMap::new();
    for token in config.fly_tokens() {
        if config.apps.iter().all(|a| &a.name != token.app) {
            continue; // the coordinator's own app: checked below
        }
        let (finding, machines) = list_app(config, env, token.app, token.source(env)).await;
        report.findings.push(finding);
        if let Some(machines) = machines {
            listed.insert(token.app.clone(), machines);
        }
    }
    if let Some(c) = &config.rotation.coordinator {
        report
            .findings
            .extend(coordinator_machine(config, env, c).await);
    }
    report.findings.push(overlay(config, env).await);
    report.findings.extend(webhooks(config, env).await);
    report.findings.extend(alertmanagers(config, env).await);
    report.findings.extend(gate(config, env).await);
    report.findings.extend(health_sample(config, &listed).await);
    report
}

/// The record key as `run` reads it: required when a pool acts, and every
/// variable set must hold a key. Only key ids are shown, never a key.
fn record_key(config: &Config, env: Lookup<'_>) -> Finding {
    let r = &config.records;
    const FIX: &str = "make a key with `openssl rand -hex 32`, store it as a secret of the reconciler's app (docs/deploy.md, \"The record key\"), and give operators' CLI the same one";
    match r.keys(|var| env(var)) {
        Err(e) => Finding::fail(CheckKind::RecordKey, "records.key_env", e.to_string(), FIX),
        Ok(None) if config.acts() => Finding::fail(
            CheckKind::RecordKey,
            &r.key_env,
            "not set (config key `records.key_env`): every pool that acts needs a record key",
            FIX,
        ),
        Ok(None) => Finding::ok(
            CheckKind::RecordKey,
            &r.key_env,
            "not set; not needed: every pool only observes (records are read as written)",
        ),
        Ok(Some(keys)) => Finding::ok(
            CheckKind::RecordKey,
            &r.key_env,
            match &keys.previous {
                Some(p) => format!(
                    "set: key id {} seals; key id {} ({}) still verifies (a key rotation in progress)",
                    keys.current.id(),
                    p.id(),
                    r.previous_key_env
                ),
                None => format!("set: key id {} seals and verifies", keys.current.id()),
            },
        ),
    }
}

fn coordinator_configured(config: &Config) -> Finding {
    const SUBJECT: &str = "rotation.coordinator";
    match &config.rotation.coordinator {
        Some(c) if config.coordinator_exposed() => Finding::warn(
            CheckKind::Coordinator,
            SUBJECT,
            format!(
                "set to {c}, in a swept app: its agents can write its metadata; the slot set and holds are sealed, so they cannot forge one, but they can delete them (rotations then wait, alerted as metadata_tampered)"
            ),
            "move the coordinator to a stopped machine in the reconciler's own app (docs/deploy.md, \"The coordination machine\")",
        ),
        Some(c) => Finding::ok(CheckKind::Coordinator, SUBJECT, format!("set to {c}")),
        // `run`'s own refusal, word for word.
        None if config.acts() => Finding::fail(
            CheckKind::Coordinator,
            SUBJECT,
            ExecutorBuildError::NoCoordinator
                .to_string()
                .trim_start_matches("rotation.coordinator ")
                .to_string(),
            "create a stopped machine in the reconciler's app (docs/deploy.md, \"The coordination machine\") and set rotation.coordinator = \"APP/MACHINE_ID\"; or make every pool `observe`",
        ),
        None => Finding::ok(
            CheckKind::Coordinator,
            SUBJECT,
            "not set; not needed: every pool only observes",
        ),
    }
}

/// One variable: who uses it, whether `run` needs it, and the fix.
struct Wanted {
    var: String,
    /// The keys naming it and what for.
    uses: Vec<String>,
    /// `run` fails without it (else it only turns something off).
    required: bool,
    /// What happens without it, for an optional one.
    without: &'static str,
    fix: String,
    /// Read instead on a Fly machine when `var` is unset
    /// ([`crate::config::AppToken::fallback`]).
    fallback: Option<&'static str>,
}

/// Every variable the config names, once each, in the order of the config.
fn wanted(config: &Config) -> Vec<Wanted> {
    let mut out = Wants::default();
    want_fly_tokens(config, &mut out);
    want_service_tokens(config, &mut out);
    want_alert_secrets(config, &mut out);
    out.0
}

/// The variables wanted so far, once each, in the order first named.
#[derive(Default)]
struct Wants(Vec<Wanted>);

impl Wants {
    /// Names `var` for one more use; a variable named again keeps its first
    /// fix and is required when any of its uses requires it.
    fn add(&mut self, var: &str, used: String, required: bool, without: &'static str, fix: String) {
        match self.0.iter_mut().find(|w| w.var == var) {
            Some(w) => {
                w.uses.push(used);
                w.required |= required;
            }
            None => self.0.push(Wanted {
                var: var.to_string(),
                uses: vec![used],
                required,
                without,
                fix,
                fallback: None,
            }),
        }
    }
}

/// The Fly tokens of the apps and the coordinator.
fn want_fly_tokens(config: &Config, out: &mut Wants) {
    // One line per variable and key: `fly.token_env` may serve many apps.
    let mut by_key: Vec<(&str, String, Vec<&str>)> = Vec::new();
    for t in config.fly_tokens() {
        match by_key
            .iter_mut()
            .find(|(v, k, _)| *v == t.var && *k == t.key)
        {
            Some((_, _, apps)) => apps.push(t.app.as_str()),
            None => by_key.push((t.var, t.key, vec![t.app.as_str()])),
        }
    }
    for (var, key, apps) in by_key {
        let fix = match apps.as_slice() {
            [app] => format!(
                "fly secrets set {var}=\"$(fly tokens create deploy -a {app})\" (and export it where you run preflight)"
            ),
            _ => format!(
                "set {var} to a token that can reach apps {} (an org token), or give each app its own: apps[].token_env with `fly tokens create deploy -a APP`",
                apps.join(", ")
            ),
        };
        let fallback = crate::config::fly_token_fallback(&key, var);
        out.add(
            var,
            format!("Fly token of app {} ({key})", apps.join(", ")),
            true,
            "",
            fix,
        );
        if let Some(w) = out.0.iter_mut().find(|w| w.var == var) {
            w.fallback = w.fallback.or(fallback);
        }
    }
}

/// The overlay's token, the agents' tokens and the admin API's token.
fn want_service_tokens(config: &Config, out: &mut Wants) {
    out.add(
        &config.overlay.token_env,
        "overlay token (overlay.token_env)".into(),
        false,
        "the overlay is fetched without a token (fine for a public or local repository)",
        String::new(),
    );
    for (i, app) in config.apps.iter().enumerate() {
        if let Some(var) = &app.agent_token_env {
            out.add(
                var,
                format!(
                    "agents' bearer token of app {} (apps[{i}].agent_token_env)",
                    app.name
                ),
                true,
                "",
                format!(
                    "fly secrets set {var}=… (the value your agents expect on drain/undrain/reload)"
                ),
            );
        }
    }
    out.add(
        &config.server.admin_token_env,
        "admin API token (server.admin_token_env)".into(),
        false,
        "the admin API is disabled",
        String::new(),
    );
}

/// The webhooks' URLs, routing keys and HMAC secrets, and the
/// Alertmanagers' URLs.
fn want_alert_secrets(config: &Config, out: &mut Wants) {
    for (i, hook) in config.alerts.webhooks.iter().enumerate() {
        let fix = |var: &str, what: &str| format!("fly secrets set {var}=… ({what})");
        out.add(
            &hook.url_env,
            format!("URL of alerts.webhooks[{i}] (url_env)"),
            true,
            "",
            fix(&hook.url_env, "the webhook's URL"),
        );
        if let Some(var) = &hook.routing_key_env {
            out.add(
                var,
                format!("PagerDuty routing key of alerts.webhooks[{i}] (routing_key_env)"),
                true,
                "",
                fix(var, "the Events v2 integration's routing key"),
            );
        }
        if let Some(var) = &hook.secret_env {
            out.add(
                var,
                format!("HMAC secret of alerts.webhooks[{i}] (secret_env)"),
                true,
                "",
                fix(var, "the key your receiver verifies X-Fleet-Signature with"),
            );
        }
    }
    for (i, am) in config.alerts.alertmanagers.iter().enumerate() {
        out.add(
            &am.url_env,
            format!("URL of alerts.alertmanager[{i}] (url_env)"),
            true,
            "",
            format!(
                "fly secrets set {}=https://… (Alertmanager's base URL, without /api/v2)",
                am.url_env
            ),
        );
    }
    if let Some(gate) = &config.gates.alertmanager {
        out.add(
            &gate.url_env,
            "URL of the alert gate (gates.alertmanager.url_env)".to_string(),
            true,
            "",
            format!(
                "fly secrets set {}=https://… (Alertmanager's base URL, without /api/v2)",
                gate.url_env
            ),
        );
    }
    for (i, hb) in config.alerts.heartbeats.iter().enumerate() {
        out.add(
            &hb.url_env,
            format!("ping URL of alerts.heartbeat[{i}] (url_env)"),
            true,
            "",
            format!(
                "fly secrets set {}=https://… (the check's ping URL from your heartbeat service)",
                hb.url_env
            ),
        );
    }
}

fn secrets(config: &Config, env: Lookup<'_>) -> Vec<Finding> {
    wanted(config)
        .into_iter()
        .map(|w| {
            let uses = w.uses.join("; ");
            let source = crate::config::fly_token_source(&w.var, w.fallback, env);
            if source != w.var {
                return Finding::ok(
                    CheckKind::Secret,
                    &w.var,
                    format!("not set, {source} is read instead on this Fly machine: {uses}"),
                );
            }
            match (read(env, &w.var).is_some(), w.required) {
                (true, _) => Finding::ok(CheckKind::Secret, &w.var, format!("set: {uses}")),
                (false, true) => {
                    Finding::fail(CheckKind::Secret, &w.var, format!("not set: {uses}"), w.fix)
                }
                (false, false) => Finding::ok(
                    CheckKind::Secret,
                    &w.var,
                    format!("not set: {uses}; {}", w.without),
                ),
            }
        })
        .collect()
}

/// The sink secrets of one webhook, when its variables are set.
fn sink_secrets(config: &Config, env: Lookup<'_>, index: usize) -> Option<SinkSecrets> {
    let one = crate::config::AlertsConfig {
        webhooks: vec![config.alerts.webhooks.get(index)?.clone()],
        alertmanagers: Vec::new(),
        ..config.alerts.clone()
    };
    notify::sink_secrets_from_env(&one, |var| env(var))
        .ok()?
        .pop()
}

/// Each webhook's URL as `run` judges it (the notifier built as `run`
/// builds it, one webhook at a time so each is reported).
fn webhook_urls(config: &Config, env: Lookup<'_>) -> Vec<Finding> {
    let mut out = Vec::new();
    for (i, hook) in config.alerts.webhooks.iter().enumerate() {
        let subject = format!("alerts.webhooks[{i}]");
        let Some(secrets) = sink_secrets(config, env, i) else {
            out.push(Finding::skipped(
                CheckKind::Webhook,
                subject,
                "its variables are not all set (see the secret lines)",
            ));
            continue;
        };
        let one = crate::config::AlertsConfig {
            webhooks: vec![hook.clone()],
            alertmanagers: Vec::new(),
            ..config.alerts.clone()
        };
        match Notifier::with_options(&one, vec![secrets], NotifierOptions::default()) {
            Ok(_) => out.push(Finding::ok(
                CheckKind::Webhook,
                subject,
                format!("the URL in {} is usable", hook.url_env),
            )),
            Err(NotifyError::InvalidUrl { problem, .. }) => out.push(Finding::fail(
                CheckKind::Webhook,
                subject,
                format!("the URL in {} {problem}", hook.url_env),
                format!("fly secrets set {}=https://…", hook.url_env),
            )),
            Err(e) => out.push(Finding::fail(
                CheckKind::Webhook,
                subject,
                format!("cannot be set up: {e}"),
                "check the webhook's keys and variables",
            )),
        }
    }
    out
}

/// `run` creates the mirror, or opens it: its directory (or the nearest
/// existing parent) must be writable here.
fn mirror_dir(config: &Config) -> Finding {
    let dir = &config.overlay.mirror_dir;
    let subject = "overlay.mirror_dir";
    let mut probe = dir.as_path();
    while !probe.exists() {
        match probe.parent() {
            Some(p) if !p.as_os_str().is_empty() => probe = p,
            _ => {
                probe = std::path::Path::new(".");
                break;
            }
        }
    }
    match tempfile::tempfile_in(probe) {
        Ok(_) => Finding::ok(
            CheckKind::Mirror,
            subject,
            format!("{} can be written", probe.display()),
        ),
        Err(e) => Finding::fail(
            CheckKind::Mirror,
            subject,
            format!(
                "cannot write in {} (for {}): {e}",
                probe.display(),
                dir.display()
            ),
            "keep overlay.mirror_dir on the volume (/data/overlay.git) and run preflight where the daemon runs, as its user; on a workstation, point it at a writable directory",
        ),
    }
}

/// A client that holds one app's token and nothing else: a token is only
/// ever tried against its own app.
fn client_for(config: &Config, app: &AppName, token: SecretString) -> Result<FlyClient, String> {
    let tokens = FlyTokens {
        fallback: None,
        apps: BTreeMap::from([(app.clone(), token)]),
    };
    FlyClient::with_tokens(
        FlyClientConfig {
            request_timeout: config.fly.request_timeout.get(),
            // One answer is enough to know; a retry storm is not.
            max_retries: config.fly.max_retries.min(1),
            rate_limits: config
                .fly
                .rate_limits
                .then_some(crate::fly::RateLimits::FLY),
            ..FlyClientConfig::new(&config.fly.api_url)
        },
        &tokens,
    )
    .map_err(|e| e.to_string())
}

/// `call` again while Fly answers 429, within [`RATE_LIMIT_ROUNDS`] and
/// [`RATE_LIMIT_PATIENCE`], honouring its `Retry-After`; then its last
/// error, which [`fly_fix`] reports as rate limiting.
async fn patiently<T, F, Fut>(mut call: F) -> Result<T, FlyError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, FlyError>>,
{
    let mut waited = Duration::ZERO;
    let mut round = 0;
    loop {
        match call().await {
            Err(FlyError::RateLimited { retry_after, .. }) if round < RATE_LIMIT_ROUNDS => {
                let wait = RATE_LIMIT_WAIT
                    .saturating_mul(1 << round)
                    .max(retry_after.unwrap_or_default());
                if waited.saturating_add(wait) > RATE_LIMIT_PATIENCE {
                    return call().await;
                }
                tokio::time::sleep(wait).await;
                waited += wait;
                round += 1;
            }
            other => return other,
        }
    }
}

/// The fix for a Fly error on `app` whose token is in `var`.
fn fly_fix(e: &FlyError, app: &AppName, var: &str, config: &Config) -> String {
    match e {
        FlyError::Unauthorized { .. } => unauthorized_fix(config, app, var),
        FlyError::NotFound { .. } => {
            format!(
                "Fly knows no app or machine by that name: check the config (`fly apps list`, `fly machine list -a {app}`)"
            )
        }
        // Retried already ([`patiently`]): a person's wait is what is left.
        FlyError::RateLimited { .. } => format!(
            "Fly is rate-limiting the token in {var} on app {app} (it allows about 1 request/s per action per machine): wait a minute and re-run preflight; another process may be using the same token or machines (a running reconciler, another preflight, a deploy)"
        ),
        _ => format!(
            "check that fly.api_url ({}) is reachable from here and answers",
            config.fly.api_url
        ),
    }
}

/// The fix for a token Fly refused for `app`: a person can follow it when
/// `var` also holds the token of other apps (replacing it with a token of
/// `app` alone would lock those out), so it names the variable, the app,
/// the command, and where to set a variable of the app's own.
fn unauthorized_fix(config: &Config, app: &AppName, var: &str) -> String {
    let tokens = config.fly_tokens();
    let shares = |t: &crate::config::AppToken<'_>| t.var == var || t.fallback() == Some(var);
    let key = tokens
        .iter()
        .find(|t| t.app == app)
        .map_or("fly.token_env", |t| t.key.as_str());
    let others: Vec<&str> = tokens
        .iter()
        .filter(|t| t.app != app && shares(t))
        .map(|t| t.app.as_str())
        .collect();
    let set = |v: &str| {
        format!(
            "`fly secrets set {v}=…` on the reconciler's app, `export {v}=…` where you run the CLI"
        )
    };
    if others.is_empty() {
        return format!(
            "the token in {var} ({key}) is not accepted for app {app}: mint one, `fly tokens create deploy -a {app}`, and set {var} to it ({})",
            set(var)
        );
    }
    let own: String = format!("FLY_TOKEN_{}", app.as_str())
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    let own_key = match config.apps.iter().position(|a| &a.name == app) {
        Some(i) => {
            format!("token_env = \"{own}\" under the [[apps]] entry of {app} (apps[{i}].token_env)")
        }
        None => format!("coordinator_token_env = \"{own}\" under [rotation]"),
    };
    format!(
        "the token in {var} ({key}) is not accepted for app {app}; {var} also holds the token of {}, so do not overwrite it with one for {app} alone. Give {app} its own variable: `fly tokens create deploy -a {app}`, set it as {own} ({}), and add {own_key}. Or set {var} to an org token that reaches every one of them (`fly tokens create org`)",
        others.join(", "),
        set(&own)
    )
}

async fn list_app(
    config: &Config,
    env: Lookup<'_>,
    app: &AppName,
    var: &str,
) -> (Finding, Option<Vec<Machine>>) {
    let subject = app.to_string();
    let Some(token) = read(env, var) else {
        return (
            Finding::skipped(
                CheckKind::App,
                subject,
                format!("not listed: no token in {var}"),
            ),
            None,
        );
    };
    let fly = match client_for(config, app, token) {
        Ok(f) => f,
        Err(e) => {
            return (
                Finding::fail(
                    CheckKind::App,
                    subject,
                    e,
                    format!("set {var} to the token as `fly tokens create` prints it"),
                ),
                None,
            );
        }
    };
    match patiently(|| fly.list_machines(app)).await {
        Ok(machines) => {
            let started = machines.iter().filter(|m| m.is_started()).count();
            (
                Finding::ok(
                    CheckKind::App,
                    subject,
                    format!(
                        "listed with the token in {var}: {} machine(s), {started} started",
                        machines.len()
                    ),
                ),
                Some(machines),
            )
        }
        Err(e) => (
            Finding::fail(
                CheckKind::App,
                subject,
                format!("cannot be listed with the token in {var}: {e}"),
                fly_fix(&e, app, var, config),
            ),
            None,
        ),
    }
}

/// The coordinator exists, is stopped, its slot key reads, and its lease
/// can be taken: taken for [`LEASE_TTL`] and released at once. A lease
/// someone holds (a running daemon changing slots) is not waited for: Fly
/// answering 409 proves the token may lease it, and nothing is disturbed.
async fn coordinator_machine(config: &Config, env: Lookup<'_>, c: &Coordinator) -> Vec<Finding> {
    let subject = c.to_string();
    let Some(token) = config.fly_tokens().into_iter().find(|t| &c.app == t.app) else {
        return Vec::new();
    };
    let var = token.source(env);
    let Some(secret) = read(env, var) else {
        return vec![Finding::skipped(
            CheckKind::Coordinator,
            subject,
            format!("not checked: no token in {var}"),
        )];
    };
    let fly = match client_for(config, &c.app, secret) {
        Ok(f) => f,
        Err(e) => {
            return vec![Finding::fail(
                CheckKind::Coordinator,
                subject,
                e,
                format!("set {var} to the token as `fly tokens create` prints it"),
            )];
        }
    };
    let machine = match coordinator_read(config, c, &fly, var, &subject).await {
        Ok(m) => m,
        Err(finding) => return vec![finding],
    };
    vec![
        coordinator_state(c, &machine, &subject),
        coordinator_slots(c, &machine, &subject),
        coordinator_lease(config, c, &fly, var, &subject).await,
    ]
}

/// The coordinator machine, or why it cannot be read with the token in `var`.
async fn coordinator_read(
    config: &Config,
    c: &Coordinator,
    fly: &FlyClient,
    var: &str,
    subject: &str,
) -> Result<Machine, Finding> {
    match patiently(|| fly.get_machine(&c.app, &c.machine_id)).await {
        Ok(m) => Ok(m),
        Err(e) => {
            let fix = match e {
                FlyError::NotFound { .. } => format!(
                    "create it (docs/deploy.md, \"The coordination machine\") and set rotation.coordinator to its APP/MACHINE_ID; `fly machine list -a {}` shows the ids",
                    c.app
                ),
                _ => fly_fix(&e, &c.app, var, config),
            };
            Err(Finding::fail(
                CheckKind::Coordinator,
                subject,
                format!("cannot be read with the token in {}: {e}", var),
                fix,
            ))
        }
    }
}

/// Whether the coordinator is stopped, as it must be.
fn coordinator_state(c: &Coordinator, machine: &Machine, subject: &str) -> Finding {
    if !machine_is_stopped(machine) {
        Finding::fail(
            CheckKind::Coordinator,
            format!("{subject} state"),
            format!(
                "is {}, not stopped: the coordinator runs nothing and only keeps slots",
                machine.state.as_str()
            ),
            format!("fly machine stop {} --app {}", c.machine_id, c.app),
        )
    } else {
        Finding::ok(
            CheckKind::Coordinator,
            format!("{subject} state"),
            "exists and is stopped",
        )
    }
}

/// Whether the coordinator's slot key reads.
fn coordinator_slots(c: &Coordinator, machine: &Machine, subject: &str) -> Finding {
    match machine.metadata(SLOTS_KEY) {
        Ok(value) => match SlotSet::parse(value) {
            Ok(set) => Finding::ok(
                CheckKind::Coordinator,
                format!("{subject} slots"),
                format!(
                    "metadata key {SLOTS_KEY} readable: {} slot(s) held",
                    set.pools.values().map(Vec::len).sum::<usize>()
                ),
            ),
            Err(e) => Finding::fail(
                CheckKind::Coordinator,
                format!("{subject} slots"),
                e.to_string(),
                format!(
                    "a reconciler of another version wrote it, or it was edited by hand: upgrade every replica to one version, or (with no rotation in progress) clear the metadata key {SLOTS_KEY} of {c}"
                ),
            ),
        },
        Err(e) => Finding::fail(
            CheckKind::Coordinator,
            format!("{subject} slots"),
            e.to_string(),
            "wait for Fly to reach the machine's host again (`fly machine status`)",
        ),
    }
}

/// Whether the coordinator's lease can be taken (and is released at once).
async fn coordinator_lease(
    config: &Config,
    c: &Coordinator,
    fly: &FlyClient,
    var: &str,
    subject: &str,
) -> Finding {
    let acquired = patiently(|| {
        fly.acquire_lease(
            &c.app,
            &c.machine_id,
            LEASE_TTL,
            "fleet-reconciler preflight: taken and released at once",
        )
    })
    .await;
    match acquired {
        Ok(lease) => {
            match patiently(|| fly.release_lease(&c.app, &c.machine_id, &lease.nonce)).await {
                Ok(()) => Finding::ok(
                    CheckKind::Coordinator,
                    format!("{subject} lease"),
                    "leasable: taken and released",
                ),
                Err(e) => Finding::ok(
                    CheckKind::Coordinator,
                    format!("{subject} lease"),
                    format!(
                        "leasable: taken, but not released ({e}); it lapses in {}",
                        humantime::format_duration(LEASE_TTL)
                    ),
                ),
            }
        }
        Err(FlyError::LeaseConflict { .. }) => Finding::ok(
            CheckKind::Coordinator,
            format!("{subject} lease"),
            "leasable: held by another actor right now (a running reconciler changing slots), so not taken",
        ),
        Err(e) => Finding::fail(
            CheckKind::Coordinator,
            format!("{subject} lease"),
            format!("cannot be leased with the token in {}: {e}", var),
            fly_fix(&e, &c.app, var, config),
        ),
    }
}

/// Down and staying down: what a coordinator is.
fn machine_is_stopped(m: &Machine) -> bool {
    use crate::model::MachineState;
    matches!(
        m.state,
        MachineState::Stopped | MachineState::Suspended | MachineState::Created
    )
}

/// Fetches the release branch into a temporary mirror, removed after: the
/// fetch `run` makes, with its token, without touching the real mirror.
async fn overlay(config: &Config, env: Lookup<'_>) -> Finding {
    let subject = format!("branch {}", config.overlay.branch);
    let temp = match tempfile::Builder::new()
        .prefix("fleet-reconciler-preflight-")
        .tempdir()
    {
        Ok(t) => t,
        Err(e) => {
            return Finding::fail(
                CheckKind::Overlay,
                subject,
                format!("cannot create a temporary directory to fetch into: {e}"),
                "set TMPDIR to a writable directory",
            );
        }
    };
    let token = read(env, &config.overlay.token_env);
    let with_token = token.is_some();
    let opened = Overlay::open(OverlaySource {
        repo: config.overlay.repo.to_string(),
        branch: config.overlay.branch.to_string(),
        mirror_dir: temp.path().join("mirror.git"),
        token,
    })
    .await;
    let fetched = match opened {
        Ok(overlay) => {
            overlay
                .fetch_within(config.overlay.fetch_timeout.get())
                .await
        }
        Err(e) => Err(e),
    };
    match fetched {
        Ok(tip) => Finding::ok(
            CheckKind::Overlay,
            subject,
            format!("remote reachable; branch {} at {}", tip.branch, tip.commit),
        ),
        Err(e) => {
            let fix = match e.kind() {
                "branch_missing" | "tip_missing" => "push the release branch, or set overlay.branch to one the remote has (`git ls-remote --heads` on overlay.repo lists them)".to_string(),
                _ if with_token => format!(
                    "check overlay.repo, and that the token in {} can read it",
                    config.overlay.token_env
                ),
                _ => format!(
                    "check overlay.repo; a private repository needs a read token in {}",
                    config.overlay.token_env
                ),
            };
            Finding::fail(CheckKind::Overlay, subject, e.to_string(), fix)
        }
    }
}

/// What preflight sends a webhook of each format: nothing any receiver acts
/// on (docs/deploy.md, "Preflight").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WebhookProbe {
    /// `format = "json"`: a `HEAD` of the URL. No body; a receiver that
    /// takes only POST answers 405, which proves it is there.
    Head,
    /// `slack` and `pagerduty`: a `POST` of `{}`. Slack answers 400
    /// (`no_text`) and posts nothing; PagerDuty answers 400 (an event with
    /// no `event_action` and no routing key is invalid) and triggers
    /// nothing. The routing key is not sent, so it is not verified.
    EmptyObject,
}

impl WebhookProbe {
    pub fn for_format(format: WebhookFormat) -> WebhookProbe {
        match format {
            WebhookFormat::Json => WebhookProbe::Head,
            WebhookFormat::Slack | WebhookFormat::Pagerduty => WebhookProbe::EmptyObject,
        }
    }

    /// Whether an answer says the URL is wrong or dead. A redirect (not
    /// followed by the notifier either) and a 5xx always do. A receiver of
    /// a `HEAD` may refuse it unsigned (401/403) or unsupported (405) and
    /// still be there; Slack answers 403/404/410 for a revoked hook or an
    /// archived channel, and both it and PagerDuty answer a good URL 400.
    pub fn refused(self, status: reqwest::StatusCode) -> bool {
        let gone = match self {
            WebhookProbe::Head => matches!(status.as_u16(), 404 | 410),
            WebhookProbe::EmptyObject => matches!(status.as_u16(), 401 | 403 | 404 | 410),
        };
        gone || status.is_server_error() || status.is_redirection()
    }
}

/// The client of the dry requests to alert sinks: no redirect followed
/// (the notifier follows none either), [`WEBHOOK_TIMEOUT`].
fn dry_client(check: CheckKind, subject: &str) -> Result<reqwest::Client, Vec<Finding>> {
    crate::http::client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(WEBHOOK_TIMEOUT)
        .build()
        .map_err(|e| {
            vec![Finding::fail(
                check,
                subject,
                format!("cannot build an HTTP client: {e}"),
                "report this as a bug",
            )]
        })
}

async fn webhooks(config: &Config, env: Lookup<'_>) -> Vec<Finding> {
    let http = match dry_client(CheckKind::Webhook, "alerts.webhooks") {
        Ok(h) => h,
        Err(f) => return f,
    };
    let mut out = Vec::new();
    for (i, hook) in config.alerts.webhooks.iter().enumerate() {
        let subject = format!("alerts.webhooks[{i}] dry request");
        let Some(secrets) = sink_secrets(config, env, i) else {
            continue; // said by the URL check
        };
        let probe = WebhookProbe::for_format(hook.format);
        let url = secrets.url.expose_secret();
        let request = match probe {
            WebhookProbe::Head => http.head(url),
            WebhookProbe::EmptyObject => http
                .post(url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body("{}"),
        };
        let sent = match probe {
            WebhookProbe::Head => "HEAD",
            WebhookProbe::EmptyObject => "POST {}",
        };
        out.push(match request.send().await {
            Err(e) => Finding::fail(
                CheckKind::Webhook,
                subject,
                format!("{sent}: {}", crate::http::describe(&e)),
                format!(
                    "check the URL in {} and that this host can reach it",
                    hook.url_env
                ),
            ),
            Ok(resp) => {
                let status = resp.status();
                if probe.refused(status) {
                    Finding::fail(
                        CheckKind::Webhook,
                        subject,
                        format!("{sent} answered HTTP {status}"),
                        format!(
                            "the URL in {} is wrong, revoked or moved: set the current one",
                            hook.url_env
                        ),
                    )
                } else {
                    Finding::ok(
                        CheckKind::Webhook,
                        subject,
                        format!("{sent} answered HTTP {status} (nothing delivered)"),
                    )
                }
            }
        });
    }
    out
}

/// Each `[[alerts.alertmanager]]`'s URL (set, and usable as `run` judges
/// it): `Some(url)` for those that are, with the findings.
fn alertmanager_checked(config: &Config, env: Lookup<'_>) -> Vec<(Finding, Option<SecretString>)> {
    config
        .alerts
        .alertmanagers
        .iter()
        .enumerate()
        .map(|(i, am)| {
            let subject = format!("alerts.alertmanager[{i}]");
            let Some(url) = read(env, &am.url_env) else {
                let f = Finding::skipped(
                    CheckKind::Alertmanager,
                    subject,
                    format!("{} is not set (see its secret line)", am.url_env),
                );
                return (f, None);
            };
            let one = crate::config::AlertsConfig {
                webhooks: Vec::new(),
                alertmanagers: vec![am.clone()],
                ..config.alerts.clone()
            };
            match Notifier::with_sinks(&one, Vec::new(), vec![url.clone()], NotifierOptions::default()) {
                Ok(_) => (
                    Finding::ok(
                        CheckKind::Alertmanager,
                        subject,
                        format!("the URL in {} is usable", am.url_env),
                    ),
                    Some(url),
                ),
                Err(e) => (
                    Finding::fail(
                        CheckKind::Alertmanager,
                        subject,
                        e.to_string(),
                        format!(
                            "fly secrets set {}=https://… (or http:// on loopback or a *.internal host)",
                            am.url_env
                        ),
                    ),
                    None,
                ),
            }
        })
        .collect()
}

fn alertmanager_urls(config: &Config, env: Lookup<'_>) -> Vec<Finding> {
    alertmanager_checked(config, env)
        .into_iter()
        .map(|(f, _)| f)
        .collect()
}

/// A read of each usable Alertmanager's `/api/v2/status` (it changes
/// nothing there): the sink's URL reaches an Alertmanager.
async fn alertmanagers(config: &Config, env: Lookup<'_>) -> Vec<Finding> {
    let http = match dry_client(CheckKind::Alertmanager, "alerts.alertmanager") {
        Ok(h) => h,
        Err(f) => return f,
    };
    let mut out = Vec::new();
    for ((_, url), (i, am)) in alertmanager_checked(config, env)
        .into_iter()
        .zip(config.alerts.alertmanagers.iter().enumerate())
    {
        let Some(url) = url else {
            continue; // said by the URL check
        };
        let subject = format!("alerts.alertmanager[{i}] status");
        let status_url = format!(
            "{}/api/v2/status",
            url.expose_secret().trim_end_matches('/')
        );
        let fix = format!(
            "set {} to Alertmanager's base URL (the daemon posts to <URL>/api/v2/alerts) and let this host reach it",
            am.url_env
        );
        out.push(match http.get(&status_url).send().await {
            Err(e) => Finding::fail(
                CheckKind::Alertmanager,
                subject,
                format!("GET /api/v2/status: {}", crate::http::describe(&e)),
                fix,
            ),
            Ok(resp) if resp.status().is_success() => Finding::ok(
                CheckKind::Alertmanager,
                subject,
                format!("GET /api/v2/status answered HTTP {}", resp.status()),
            ),
            Ok(resp) => Finding::fail(
                CheckKind::Alertmanager,
                subject,
                format!("GET /api/v2/status answered HTTP {}", resp.status()),
                fix,
            ),
        });
    }
    out
}

/// The alert gate's URL (set, and usable as `run` judges it): the finding,
/// and the gate when it is. Nothing when no gate is configured.
fn gate_checked(config: &Config, env: Lookup<'_>) -> (Option<Finding>, Option<AlertGate>) {
    let Some(gate) = &config.gates.alertmanager else {
        return (None, None);
    };
    let subject = "gates.alertmanager";
    let Some(url) = read(env, &gate.url_env) else {
        let f = Finding::skipped(
            CheckKind::Gate,
            subject,
            format!("{} is not set (see its secret line)", gate.url_env),
        );
        return (Some(f), None);
    };
    match AlertGate::new(gate, &url) {
        Ok(g) => (
            Some(Finding::ok(
                CheckKind::Gate,
                subject,
                format!("the URL in {} is usable", gate.url_env),
            )),
            Some(g),
        ),
        Err(e) => (
            Some(Finding::fail(
                CheckKind::Gate,
                subject,
                e.to_string(),
                format!(
                    "fly secrets set {}=https://… (or http:// on loopback or a *.internal host)",
                    gate.url_env
                ),
            )),
            None,
        ),
    }
}

/// One read of the alert gate, as a sweep reads it (nothing is posted):
/// Alertmanager answers, and what fires now that would hold claims.
async fn gate(config: &Config, env: Lookup<'_>) -> Vec<Finding> {
    let (Some(cfg), (_, Some(gate))) = (&config.gates.alertmanager, gate_checked(config, env))
    else {
        return Vec::new(); // said by the URL check
    };
    let subject = "gates.alertmanager read";
    let finding = match gate.read().await {
        GateView::Read { firing, .. } if firing.is_empty() => Finding::ok(
            CheckKind::Gate,
            subject,
            "GET /api/v2/alerts answered: no matching alert fires, claims are not held",
        ),
        GateView::Read { firing, more } => {
            let names: Vec<String> = firing.iter().map(ToString::to_string).collect();
            let more = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            Finding::ok(
                CheckKind::Gate,
                subject,
                format!(
                    "GET /api/v2/alerts answered: {}{more} fire(s) and would hold claims now",
                    names.join(", ")
                ),
            )
        }
        GateView::Unreachable(why) => Finding::fail(
            CheckKind::Gate,
            subject,
            if cfg.fail_open {
                format!("{why} (fail_open: claims would go ahead unguarded)")
            } else {
                format!("{why} (every claim would be held: the gate fails closed)")
            },
            format!(
                "set {} to Alertmanager's base URL (the gate reads <URL>/api/v2/alerts) and let this host reach it",
                cfg.url_env
            ),
        ),
        GateView::NotConfigured => return Vec::new(),
    };
    vec![finding]
}

/// Up to [`HEALTH_SAMPLE`] started machines of each listed app: each must
/// answer its health URL with a usable report.
async fn health_sample(config: &Config, listed: &BTreeMap<AppName, Vec<Machine>>) -> Vec<Finding> {
    let prober = match Prober::new(&config.probe) {
        Ok(p) => p,
        Err(e) => {
            return vec![Finding::fail(
                CheckKind::Health,
                "probe",
                e.to_string(),
                "report this as a bug",
            )];
        }
    };
    let mut out = Vec::new();
    for (i, app) in config.apps.iter().enumerate() {
        let subject = app.name.clone();
        let Some(machines) = listed.get(&app.name) else {
            out.push(Finding::skipped(
                CheckKind::Health,
                subject,
                "not sampled: the app could not be listed",
            ));
            continue;
        };
        let sample: Vec<&Machine> = machines
            .iter()
            .filter(|m| m.is_started())
            .take(HEALTH_SAMPLE)
            .collect();
        if sample.is_empty() {
            out.push(Finding::skipped(
                CheckKind::Health,
                subject,
                "no started machine to sample",
            ));
            continue;
        }
        let mut problems = Vec::new();
        for m in &sample {
            match probe_one(&prober, &app.health_url, app.name.as_str(), m).await {
                Ok(()) => {}
                Err(why) => problems.push(format!("{}: {why}", m.id)),
            }
        }
        out.push(if problems.is_empty() {
            Finding::ok(
                CheckKind::Health,
                subject,
                format!("{} of {} sampled machine(s) answered a report", sample.len(), sample.len()),
            )
        } else {
            Finding::fail(
                CheckKind::Health,
                subject,
                format!(
                    "{} of {} sampled machine(s) gave no usable report: {}",
                    problems.len(),
                    sample.len(),
                    problems.join("; ")
                ),
                format!(
                    "check apps[{i}].health_url ({}) and the agent contract (docs/agent-contract.md); .internal names resolve only inside the organization's private network: run preflight there (`fly ssh console`, or `fly wireguard`)",
                    app.health_url
                ),
            )
        });
    }
    out
}

async fn probe_one(
    prober: &Prober,
    template: &HealthUrlTemplate,
    app: &str,
    m: &Machine,
) -> Result<(), String> {
    let url = template
        .render(&UrlVars {
            machine_id: &m.id,
            app,
            private_ip: &m.private_ip,
            region: &m.region,
            name: &m.name,
        })
        .map_err(|e| e.to_string())?;
    match prober.probe(&url).await {
        ProbeOutcome::Report(_) => Ok(()),
        ProbeOutcome::Unreachable(why) => Err(format!("unreachable ({why})")),
        ProbeOutcome::BadReport(why) => Err(format!("bad report ({why})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::path::Path;

    const CONFIG: &str = r#"
[overlay]
repo = "/srv/overlay"
branch = "release"
mirror_dir = "/data/overlay.git"

[[apps]]
name = "agents"
token_env = "AGENTS_FLY_TOKEN"
agent_token_env = "AGENT_TOKEN"

[[apps]]
name = "batch"

[[alerts.webhooks]]
url_env = "PD_URL"
format = "pagerduty"
routing_key_env = "PD_KEY"
"#;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + Sync {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn failing(report: &Report) -> Vec<String> {
        report.failures().map(|f| f.subject.clone()).collect()
    }

    #[test]
    fn offline_reports_every_missing_variable_and_the_coordinator_at_once() {
        let config = Config::parse(Path::new("t.toml"), CONFIG).unwrap();
        let env = lookup(&[("AGENTS_FLY_TOKEN", "a"), ("PD_KEY", "  ")]);
        let report = offline(&config, &env, true);
        assert_eq!(
            failing(&report),
            [
                "rotation.coordinator",
                "FLEET_RECONCILER_RECORD_KEY",
                "FLEET_RECONCILER_FLY_TOKEN",
                "AGENT_TOKEN",
                "PD_URL",
                "PD_KEY"
            ]
        );
        // Optional ones are reported, not failed.
        let admin = report
            .findings
            .iter()
            .find(|f| f.subject == "FLEET_ADMIN_TOKEN")
            .unwrap();
        assert_eq!(admin.status, Status::Ok);
        assert!(admin.detail.contains("admin API is disabled"), "{admin:?}");
        // Without --check-env only the coordinator.
        assert_eq!(
            failing(&offline(&config, &env, false)),
            ["rotation.coordinator"]
        );
    }

    /// The record key: required where a pool acts, a set value must be a
    /// key, only key ids are shown; a coordinator in a swept app is a warning.
    #[test]
    fn the_record_key_and_the_coordinators_placement_are_checked() {
        let config = Config::parse(Path::new("t.toml"), CONFIG).unwrap();
        let finding = |env: &[(&str, &str)]| record_key(&config, &lookup(env));
        let missing = finding(&[]);
        assert_eq!(missing.status, Status::Fail);
        assert!(missing.detail.contains("records.key_env"), "{missing:?}");
        assert!(
            missing
                .fix
                .as_deref()
                .unwrap_or_default()
                .contains("openssl rand -hex 32")
        );
        let short = finding(&[("FLEET_RECONCILER_RECORD_KEY", "abcd")]);
        assert_eq!(short.status, Status::Fail);
        assert!(short.detail.contains("2 bytes"), "{short:?}");
        let key = "ab".repeat(32);
        let bad_previous = finding(&[
            ("FLEET_RECONCILER_RECORD_KEY", &key),
            ("FLEET_RECONCILER_PREVIOUS_RECORD_KEY", "not hex"),
        ]);
        assert_eq!(bad_previous.status, Status::Fail);
        assert!(
            bad_previous.detail.contains("records.previous_key_env"),
            "{bad_previous:?}"
        );
        let previous = "cd".repeat(32);
        let ok = finding(&[
            ("FLEET_RECONCILER_RECORD_KEY", &key),
            ("FLEET_RECONCILER_PREVIOUS_RECORD_KEY", &previous),
        ]);
        assert_eq!(ok.status, Status::Ok);
        assert!(
            ok.detail.contains("still verifies") && !ok.detail.contains(&key),
            "{ok:?}"
        );

        let placed = |coordinator: &str| {
            let text = format!("{CONFIG}\n[rotation]\ncoordinator = \"{coordinator}\"\n");
            coordinator_configured(&Config::parse(Path::new("t.toml"), &text).unwrap())
        };
        assert_eq!(placed("reconciler/c1").status, Status::Ok);
        let exposed = placed("agents/c1");
        assert_eq!(exposed.status, Status::Warn, "{exposed:?}");
        assert!(exposed.detail.contains("swept app"), "{exposed:?}");
    }

    #[test]
    fn findings_never_carry_a_secret_value() {
        let config = Config::parse(Path::new("t.toml"), CONFIG).unwrap();
        let env = lookup(&[
            ("AGENTS_FLY_TOKEN", "s3cret-agents"),
            ("FLEET_RECONCILER_FLY_TOKEN", "s3cret-org"),
            ("PD_URL", "http://hooks.example.com/s3cret-path"),
            ("PD_KEY", "s3cret-key"),
        ]);
        let shown = serde_json::to_string(&offline(&config, &env, true)).unwrap();
        assert!(!shown.contains("s3cret"), "{shown}");
        // The plain-http URL is refused as run refuses it.
        assert!(
            shown.contains("http:// to a host that is not loopback"),
            "{shown}"
        );
    }
}

//! A daemon run inside a test: the real loop (sweep → plan → execute)
//! against the simulator over loopback, and what the test can see of its
//! sweeps (alerts, decision labels, how many ran). One builder for every
//! variant the tests need (owner, Fly token, record keys, alert gate, agent
//! tokens), the connect and executor set-up that by-hand drivers share, and
//! the whole service (`service::run`) for tests that run it as `run` does.
//!
//! It never decides anything itself and asserts nothing: the tests do.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_reconciler::act::executor::{Executor, ExecutorConfig};
use fleet_reconciler::act::operator::Operator;
use fleet_reconciler::config::Config;
use fleet_reconciler::daemon::{self, LoopOptions, Secrets, SweepOutcome};
use fleet_reconciler::decide::alerts::AlertKind;
use fleet_reconciler::metadata::seal::RecordKeys;
use fleet_reconciler::observe::gate::AlertGate;
use fleet_reconciler::observe::sweep::Sweeper;
use fleet_reconciler::service::{self, ServiceError, ServiceSecrets};
use fleet_reconciler::sim::Sim;
use secrecy::SecretString;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{DEADLINE, eventually};

/// A sweeper authenticated with `fly_token`, holding `keys`.
pub async fn connect(config: &Arc<Config>, fly_token: &str, keys: RecordKeys) -> Sweeper {
    let secrets = Secrets {
        fly_token: fly_token.into(),
        git_token: None,
        record_keys: Some(keys),
    };
    daemon::connect(config.clone(), &secrets).await.unwrap()
}

/// A service's secrets with `fly_token` and the simulator's record keys,
/// and nothing else (sinks and the gate added by the caller).
pub fn service_secrets(fly_token: &str) -> ServiceSecrets {
    ServiceSecrets {
        core: Secrets {
            fly_token: fly_token.into(),
            git_token: None,
            record_keys: Some(fleet_reconciler::sim::record_keys()),
        },
        ..ServiceSecrets::default()
    }
}

/// The whole service (`service::run`, as `run` starts it) in a task on the
/// simulator's clock, owner `owner`, its API on a loopback port.
pub struct Service {
    pub stop: CancellationToken,
    pub task: JoinHandle<Result<(), ServiceError>>,
    /// `http://127.0.0.1:PORT`.
    pub api: String,
}

impl Service {
    pub fn start(owner: &str, config: Arc<Config>, secrets: ServiceSecrets, sim: &Sim) -> Service {
        let stop = CancellationToken::new();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let api = format!("http://{}", listener.local_addr().unwrap());
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let task = tokio::spawn(service::run(
            service::RunArgs::new(config, secrets, listener, owner.into(), stop.clone())
                .with_clock(sim.clock()),
            |_| {},
        ));
        Service { stop, task, api }
    }
}

/// What the CLI and the admin API write with: an operator authenticated
/// with `fly_token`, holding the simulator's record keys.
pub fn operator(config: &Config, fly_token: &str) -> Operator {
    let secrets = Secrets {
        fly_token: fly_token.into(),
        git_token: None,
        record_keys: Some(fleet_reconciler::sim::record_keys()),
    };
    Operator::new(
        daemon::fly_client(config, &secrets).unwrap(),
        config,
        secrets.record_keys.clone(),
    )
}

/// An executor over `sweeper`'s Fly client and keys, on the sim's clock.
pub fn executor(
    sim: &Sim,
    sweeper: &Sweeper,
    mut tuning: ExecutorConfig,
    agent_tokens: HashMap<String, SecretString>,
) -> Executor {
    tuning.clock = sim.clock();
    tuning.record_keys = sweeper.record_keys.clone();
    let config = sweeper.config.clone();
    Executor::new(
        sweeper.fly.clone(),
        config.clone(),
        Arc::new(fleet_reconciler::decide::policy::Policy::from_config(
            &config,
        )),
        agent_tokens,
        tuning,
    )
    .unwrap()
}

/// One alert a sweep planned.
#[derive(Clone, Debug)]
pub struct SeenAlert {
    pub kind: AlertKind,
    /// The machine it names ("" for a fleet alert).
    pub machine: String,
    /// The alert as JSON (what a sink is sent).
    pub json: String,
}

/// What the test can see of a running daemon.
#[derive(Default)]
struct Seen {
    alerts: Vec<SeenAlert>,
    sweeps: usize,
    /// Each machine's decision label in the latest plan.
    labels: HashMap<String, String>,
}

/// How a [`Daemon`] is started: [`Daemon::build`], the options, then
/// [`DaemonBuilder::start`].
pub struct DaemonBuilder {
    owner: String,
    fly_token: String,
    keys: RecordKeys,
    gate: Option<AlertGate>,
    agent_tokens: HashMap<String, SecretString>,
}

impl DaemonBuilder {
    /// The record keys it holds (the simulator's own by default).
    pub fn keys(mut self, keys: RecordKeys) -> DaemonBuilder {
        self.keys = keys;
        self
    }

    /// The alert gate its sweeps read (none by default).
    pub fn gate(mut self, gate: AlertGate) -> DaemonBuilder {
        self.gate = Some(gate);
        self
    }

    /// The agents' tokens its executor sends (none by default).
    pub fn agent_tokens(mut self, tokens: HashMap<String, SecretString>) -> DaemonBuilder {
        self.agent_tokens = tokens;
        self
    }

    /// Connects and runs the loop on a task until [`Daemon::stop`].
    pub async fn start(self, sim: &Sim, config: Arc<Config>) -> Daemon {
        let mut sweeper = connect(&config, &self.fly_token, self.keys).await;
        sweeper.gate = self.gate;
        let mut tuning = ExecutorConfig::new(&self.owner);
        tuning.start_wait = Duration::from_secs(5);
        let executor = executor(sim, &sweeper, tuning, self.agent_tokens);
        let stop = CancellationToken::new();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (token, record, owner) = (stop.clone(), seen.clone(), self.owner);
        let clock = sim.clock();
        let task = tokio::spawn(async move {
            let options = LoopOptions {
                executor: Some(&executor),
                refresh: None,
                owner,
                clock,
                restored_alerts: Vec::new(),
                delivery: None,
            };
            daemon::reconcile_loop(&sweeper, options, token, |outcome| {
                let mut seen = record.lock().unwrap();
                seen.sweeps += 1;
                if let SweepOutcome::Swept(cycle) = outcome {
                    seen.labels = cycle
                        .plan
                        .decisions()
                        .into_iter()
                        .map(|(id, d)| (id.to_string(), d.label()))
                        .collect();
                    for a in &cycle.plan.alerts {
                        seen.alerts.push(SeenAlert {
                            kind: a.kind,
                            machine: a.machine_id.clone().map(String::from).unwrap_or_default(),
                            json: serde_json::to_string(a).unwrap_or_default(),
                        });
                    }
                }
            })
            .await;
        });
        Daemon { stop, task, seen }
    }
}

/// A running daemon (see the module doc).
pub struct Daemon {
    stop: CancellationToken,
    task: JoinHandle<()>,
    seen: Arc<Mutex<Seen>>,
}

impl Daemon {
    /// A daemon named `owner` (in markers and leases) that authenticates
    /// with `fly_token`; see [`DaemonBuilder`] for the rest.
    pub fn build(owner: &str, fly_token: &str) -> DaemonBuilder {
        DaemonBuilder {
            owner: owner.to_string(),
            fly_token: fly_token.to_string(),
            keys: fleet_reconciler::sim::record_keys(),
            gate: None,
            agent_tokens: HashMap::new(),
        }
    }

    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("daemon stops")
            .unwrap();
    }

    /// Whether the loop's task ended (it runs until stopped).
    pub fn finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Sweeps run so far.
    pub fn sweeps(&self) -> usize {
        self.seen.lock().unwrap().sweeps
    }

    /// Lets `n` more sweeps (each planned and carried out) run: a wait that
    /// counts the daemon's chances to act, not wall-clock time.
    pub async fn more_sweeps(&self, n: usize) {
        let target = self.sweeps() + n;
        eventually(&format!("{n} more sweeps"), DEADLINE, async || {
            self.sweeps() >= target
        })
        .await;
    }

    /// `id`'s decision label in the latest plan.
    pub fn label(&self, id: &str) -> Option<String> {
        self.seen.lock().unwrap().labels.get(id).cloned()
    }

    /// Whether an alert of `kind` naming `machine` was planned.
    pub fn alerted(&self, kind: AlertKind, machine: &str) -> bool {
        self.seen
            .lock()
            .unwrap()
            .alerts
            .iter()
            .any(|a| a.kind == kind && a.machine == machine)
    }

    /// Every alert planned so far, in order.
    pub fn alerts(&self) -> Vec<SeenAlert> {
        self.seen.lock().unwrap().alerts.clone()
    }
}

//! Read-only snapshots of simulator state that tests assert on.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use super::fixture::{Behaviour, CheckStatus, HostStatus};

/// A machine as the simulator sees it, Fly side and agent side together.
#[derive(Clone, Debug, PartialEq)]
pub struct SimMachineView {
    pub id: String,
    pub app: String,
    pub name: String,
    pub region: String,
    pub state: String,
    /// Also the machine version compared by `PATCH …/metadata` (see module docs).
    pub instance_id: String,
    pub private_ip: String,
    pub image: String,
    pub metadata: BTreeMap<String, String>,
    pub cordoned: bool,
    pub host_status: HostStatus,
    /// Fly's health checks: name and status.
    pub checks: Vec<(String, CheckStatus)>,
    /// Whether the machine keeps exiting after each start ([`super::SimHandle::set_crash_loop`]).
    pub crash_loop: bool,
    /// The unexpired lease, if any.
    pub lease: Option<LeaseView>,
    /// Restarts accepted through the API (counted when the request is accepted).
    pub restart_count: u32,
    /// Full ref the agent has loaded (reports may abbreviate it).
    pub loaded_ref: String,
    pub behaviour: Behaviour,
    pub capabilities: Vec<String>,
    /// What a health report would say right now.
    pub activity: String,
    /// What a health report would say right now.
    pub live_sessions: u32,
    pub last_input_at: Option<DateTime<Utc>>,
    /// Rotation tag of the drain fence, if the agent is fenced.
    pub fence: Option<String>,
    /// Checkpoint a health report would show right now.
    pub checkpoint: Option<String>,
}

/// A lease held on a machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    pub nonce: String,
    pub owner: String,
    pub description: String,
    pub expires_at: DateTime<Utc>,
    /// Machine version (instance id) when the lease was taken or last refreshed.
    pub version: String,
}

/// Which half of the simulator a request reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestTarget {
    /// `/v1/...`: the Fly Machines API.
    FlyApi,
    /// `/agents/{machine_id}/...`: an agent's health or cooperative endpoint.
    Agent,
    /// `/_machine/{caller}/v1/...`: a process inside machine `caller`
    /// calling Fly's in-machine `/.fly/api` socket (no token; metadata of
    /// its own app only). `machine_id` is the machine called about.
    MachineApi,
    /// Anything else (answered 404).
    Other,
}

/// What the `Authorization` header carried, classified without keeping the secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Credential {
    /// No `Authorization` header.
    None,
    /// The fleet's Fly token (either scheme).
    FlyToken,
    /// The addressed machine's agent token, as a bearer token.
    AgentToken,
    /// Something else.
    Other,
}

/// One request the simulator received, in arrival order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedRequest {
    /// Arrival number, from 0, never reused (also after [`super::SimHandle::clear_requests`]).
    pub seq: u64,
    /// Arrival time on the sim clock.
    pub at: DateTime<Utc>,
    pub target: RequestTarget,
    pub method: String,
    pub path: String,
    /// Raw query string without `?`.
    pub query: Option<String>,
    pub app: Option<String>,
    pub machine_id: Option<String>,
    /// Route after the machine id: `machine` (the machine itself), `restart`,
    /// `lease`, `metadata`, `health`, `overlay/drain`, ...
    pub action: Option<String>,
    pub credential: Credential,
    /// Fly API: the token matched. Agent: the endpoint needs no token, or the
    /// agent token matched.
    pub authorized: bool,
    /// Value of the `fly-machine-lease-nonce` header.
    pub lease_nonce: Option<String>,
    /// Request body (lossy UTF-8, first 4 KiB).
    pub body: String,
    /// Response status; `None` while no response has started (e.g. a hung agent).
    pub status: Option<u16>,
}

impl RecordedRequest {
    /// A Fly API call that changes a machine: everything but reads and the
    /// lease endpoints themselves (which carry the nonce by their own rules).
    pub fn is_mutating(&self) -> bool {
        self.target == RequestTarget::FlyApi
            && self.machine_id.is_some()
            && self.method != "GET"
            && self.method != "HEAD"
            && self.action.as_deref() != Some("lease")
    }
}

/// Why [`super::SimHandle::operator_set_metadata`] or
/// [`super::SimHandle::operator_delete_metadata`] wrote nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OperatorWriteRefused {
    UnknownMachine {
        machine_id: String,
    },
    /// Someone holds an unexpired lease on the machine, as `fly` would be told
    /// (409): the operator retries later. Only under
    /// [`super::MetadataFencing::FencedByLease`] for metadata writes, or an
    /// [`OutsideLease::Respect`] update.
    Leased {
        machine_id: String,
        owner: String,
        expires_at: DateTime<Utc>,
    },
    /// The machine's host is down: an outside update cannot reach it.
    HostDown {
        machine_id: String,
    },
}

/// What [`super::SimHandle::outside_update`] does about a lease it finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutsideLease {
    /// Refused while someone holds an unexpired lease (as a `fly` command
    /// that acquires its own lease would get 409).
    Respect,
    /// Acts under the lease it finds and releases it when done, as
    /// `fly deploy` reuses a nonce it finds in the machine list.
    ReuseFound,
}

impl std::fmt::Display for OperatorWriteRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OperatorWriteRefused::UnknownMachine { machine_id } => {
                write!(f, "machine not found: {machine_id}")
            }
            OperatorWriteRefused::Leased {
                machine_id,
                owner,
                expires_at,
            } => write!(
                f,
                "machine {machine_id} lease currently held by {owner}, expires at {expires_at}"
            ),
            OperatorWriteRefused::HostDown { machine_id } => {
                write!(f, "host of machine {machine_id} is unreachable")
            }
        }
    }
}

impl std::error::Error for OperatorWriteRefused {}

//! A rogue agent: a process that is root inside one machine and turns Fly's
//! in-machine metadata socket (`/.fly/api`, [`super::machine_api`]) against
//! the daemon (issue #33). One method per attack of the "Tests".
//!
//! It works as a real one would: it reads the records it can see (its own
//! and its neighbours' metadata, the slot set if the coordinator shares its
//! app) and replays or alters them, keeping every field it does not mean to
//! change — so a record with a signature is replayed with it. It edits
//! values as JSON and never names the daemon's Rust types, so it keeps
//! attacking whatever the records' format becomes.
//!
//! It owns only the attacker's side: it must never use a Fly token, never
//! call anything but the in-machine socket of its own machine, and never
//! decide whether an attack succeeded (tests do).

use std::collections::BTreeMap;
use std::net::SocketAddr;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::metadata::{APPROVE_KEY, HOLD_KEY, MARKER_KEY, SLOTS_KEY, UNPROBED_KEY};

/// Why an attack could not be carried out (not whether it worked).
#[derive(Debug, thiserror::Error)]
pub enum RogueError {
    #[error("rogue in {caller}: calling /.fly/api about machine {machine} failed: {reason}")]
    Transport {
        caller: String,
        machine: String,
        reason: String,
    },
    #[error("rogue in {caller}: /.fly/api answered {status} for key {key} of machine {machine}")]
    Refused {
        caller: String,
        machine: String,
        key: String,
        status: u16,
    },
    #[error("rogue in {caller}: machine {machine} has no {key} to replay or alter")]
    Missing {
        caller: String,
        machine: String,
        key: String,
    },
    #[error("rogue in {caller}: key {key} of machine {machine} is not a JSON object")]
    NotJson {
        caller: String,
        machine: String,
        key: String,
    },
}

/// A marker field the rogue rewrites on a rotation in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MarkerField {
    /// The commit the rotation goes to: set to another commit.
    Target,
    /// The rotation's tag (its slot and the agent's fence): set to a new one.
    Tag,
    /// Restarts that did not verify: set to this count (0 to escape
    /// `max_attempts`, a large one to make a rotation give up).
    Attempt(u32),
}

/// One process, root inside machine `caller` of `app`.
#[derive(Clone, Debug)]
pub struct RogueAgent {
    client: reqwest::Client,
    /// `http://{sim}/_machine/{caller}/v1/apps/{app}/machines`.
    base: String,
    caller: String,
}

impl RogueAgent {
    /// The rogue inside `caller` (of `app`), reaching the simulator at `addr`.
    pub fn new(addr: SocketAddr, caller: &str, app: &str) -> RogueAgent {
        RogueAgent {
            client: crate::http::client_builder()
                .build()
                .unwrap_or_else(|_| reqwest::Client::new()),
            base: format!("http://{addr}/_machine/{caller}/v1/apps/{app}/machines"),
            caller: caller.to_string(),
        }
    }

    pub fn caller(&self) -> &str {
        &self.caller
    }

    fn transport(&self, machine: &str, e: &reqwest::Error) -> RogueError {
        RogueError::Transport {
            caller: self.caller.clone(),
            machine: machine.to_string(),
            reason: crate::http::describe(e),
        }
    }

    fn refused(&self, machine: &str, key: &str, status: reqwest::StatusCode) -> RogueError {
        RogueError::Refused {
            caller: self.caller.clone(),
            machine: machine.to_string(),
            key: key.to_string(),
            status: status.as_u16(),
        }
    }

    /// Every metadata key of `machine`.
    pub async fn read_all(&self, machine: &str) -> Result<BTreeMap<String, String>, RogueError> {
        let url = format!("{}/{machine}/metadata", self.base);
        let answer = self
            .client
            .get(url)
            .send()
            .await
            .map_err(|e| self.transport(machine, &e))?;
        if !answer.status().is_success() {
            return Err(self.refused(machine, "*", answer.status()));
        }
        answer.json().await.map_err(|e| self.transport(machine, &e))
    }

    /// One key of `machine`, `None` if absent.
    pub async fn read(&self, machine: &str, key: &str) -> Result<Option<String>, RogueError> {
        Ok(self.read_all(machine).await?.remove(key))
    }

    /// One key of `machine`, which must be there.
    async fn read_present(&self, machine: &str, key: &str) -> Result<String, RogueError> {
        self.read(machine, key)
            .await?
            .ok_or_else(|| RogueError::Missing {
                caller: self.caller.clone(),
                machine: machine.to_string(),
                key: key.to_string(),
            })
    }

    /// Writes `value` under `key` on `machine` (no token, no lease).
    pub async fn write(&self, machine: &str, key: &str, value: &str) -> Result<(), RogueError> {
        let url = format!("{}/{machine}/metadata/{key}", self.base);
        let answer = self
            .client
            .post(url)
            .json(&json!({ "value": value }))
            .send()
            .await
            .map_err(|e| self.transport(machine, &e))?;
        if !answer.status().is_success() {
            return Err(self.refused(machine, key, answer.status()));
        }
        Ok(())
    }

    /// Deletes `key` on `machine`.
    pub async fn delete(&self, machine: &str, key: &str) -> Result<(), RogueError> {
        let url = format!("{}/{machine}/metadata/{key}", self.base);
        let answer = self
            .client
            .delete(url)
            .send()
            .await
            .map_err(|e| self.transport(machine, &e))?;
        if !answer.status().is_success() {
            return Err(self.refused(machine, key, answer.status()));
        }
        Ok(())
    }

    /// Reads `key` of `machine` as a JSON object, lets `edit` change it and
    /// writes it back onto `onto`; every other field is kept as read. A
    /// sealed value (`{"sealed",…,"body":"<record>"}`) has its record edited
    /// inside `body`, its seal kept: what an attacker without the key can
    /// best do. Returns the value written.
    async fn alter(
        &self,
        machine: &str,
        key: &str,
        onto: &str,
        edit: impl FnOnce(&mut serde_json::Map<String, Value>),
    ) -> Result<String, RogueError> {
        let not_json = || RogueError::NotJson {
            caller: self.caller.clone(),
            machine: machine.to_string(),
            key: key.to_string(),
        };
        let read = self.read_present(machine, key).await?;
        let mut value: Value = serde_json::from_str(&read).map_err(|_| not_json())?;
        let object = value.as_object_mut().ok_or_else(not_json)?;
        let sealed_body = object
            .get("body")
            .and_then(Value::as_str)
            .filter(|_| object.contains_key("sealed"))
            .and_then(|b| serde_json::from_str::<Value>(b).ok());
        match sealed_body {
            Some(mut body) => {
                let record = body.as_object_mut().ok_or_else(not_json)?;
                edit(record);
                object.insert("body".into(), Value::String(body.to_string()));
            }
            None => edit(object),
        }
        let written = value.to_string();
        self.write(onto, key, &written).await?;
        Ok(written)
    }

    // ---- the attacks --------------------------------------------------------------------

    /// Approves `now` on `victim` (itself or a neighbour) from scratch, in
    /// the approval's format as `fleet-reconciler approve` writes it
    /// (`{"target","mode","by","at"}`), naming an operator it has seen.
    pub async fn forge_approval_now(
        &self,
        victim: &str,
        target: &str,
        by: &str,
        at: DateTime<Utc>,
    ) -> Result<String, RogueError> {
        let value = json!({ "target": target, "mode": "now", "by": by, "at": at }).to_string();
        self.write(victim, APPROVE_KEY, &value).await?;
        Ok(value)
    }

    /// Copies the approval it reads on `source` onto `victim`, turned into
    /// mode `now` (whatever else it carries, a signature too, is kept).
    pub async fn copy_approval_as_now(
        &self,
        source: &str,
        victim: &str,
    ) -> Result<String, RogueError> {
        self.alter(source, APPROVE_KEY, victim, |a| {
            a.insert("mode".into(), json!("now"));
        })
        .await
    }

    /// Reads the approval on `source` as it is (to replay it later).
    pub async fn steal_approval(&self, source: &str) -> Result<String, RogueError> {
        self.read_present(source, APPROVE_KEY).await
    }

    /// Writes an approval value read earlier, verbatim, onto `victim`.
    pub async fn replay_approval(&self, stolen: &str, victim: &str) -> Result<(), RogueError> {
        self.write(victim, APPROVE_KEY, stolen).await
    }

    /// Deletes the hold on `victim` (returns what it was).
    pub async fn delete_hold(&self, victim: &str) -> Result<Option<String>, RogueError> {
        let hold = self.read(victim, HOLD_KEY).await?;
        self.delete(victim, HOLD_KEY).await?;
        Ok(hold)
    }

    /// Forges a marker in phase `restarting` on `victim`, copied from a
    /// real marker it read on `model` (a neighbour's rotation) with the
    /// victim's instance left out and its restart time `at`.
    pub async fn forge_restarting_marker_from(
        &self,
        model: &str,
        victim: &str,
        at: DateTime<Utc>,
    ) -> Result<String, RogueError> {
        self.alter(model, MARKER_KEY, victim, |m| {
            m.insert("phase".into(), json!("restarting"));
            m.insert("restart_at".into(), json!(at));
            m.insert("attempt_started_at".into(), json!(at));
            m.insert("cordoned".into(), json!(false));
            m.remove("instance_id");
        })
        .await
    }

    /// Rewrites one field of the marker of a rotation in flight on `victim`.
    pub async fn rewrite_marker(
        &self,
        victim: &str,
        field: MarkerField,
        other_commit: &str,
    ) -> Result<String, RogueError> {
        self.alter(victim, MARKER_KEY, victim, |m| match field {
            MarkerField::Target => {
                m.insert("target".into(), json!(other_commit));
            }
            MarkerField::Tag => {
                let tag = m.get("tag").and_then(Value::as_str).unwrap_or("x");
                m.insert("tag".into(), json!(format!("{tag}-rogue")));
            }
            MarkerField::Attempt(n) => {
                m.insert("attempt".into(), json!(n));
            }
        })
        .await
    }

    /// Deletes the probe-failure record on `victim` (returns what it was).
    pub async fn delete_unprobed(&self, victim: &str) -> Result<Option<String>, RogueError> {
        let record = self.read(victim, UNPROBED_KEY).await?;
        if record.is_some() {
            self.delete(victim, UNPROBED_KEY).await?;
        }
        Ok(record)
    }

    /// Empties every pool of the slot set kept on `coordinator` (reachable
    /// only when the coordinator was misplaced into the rogue's app),
    /// keeping the rest of the record as read. Returns the value written.
    pub async fn free_all_slots(&self, coordinator: &str) -> Result<String, RogueError> {
        self.alter(coordinator, SLOTS_KEY, coordinator, |s| {
            if let Some(Value::Object(pools)) = s.get_mut("pools") {
                for slots in pools.values_mut() {
                    *slots = json!([]);
                }
            }
        })
        .await
    }
}

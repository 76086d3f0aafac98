//! Shared vocabulary: identifiers, statuses, severities and actions, and
//! the commits a machine lacks ([`MissingCommit`], which the overlay
//! measures and a drift's reason shows).
//!
//! Owns the small types every other module speaks in. It must never do I/O
//! or hold policy, nor carry a stage's verdict (why a drift has its
//! severity is `decide::reason`'s): it only names things and says how they
//! order and print.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use strum::EnumCount;

/// The text behaviour of a string newtype: compared, hashed, printed and
/// serialized as its text. No `Deref` to `str` (nor `AsRef`/`Borrow`): an id
/// does not silently become a string; `as_str()` says where text is meant.
macro_rules! text_newtype {
    ($name:ident) => {
        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

/// Declares a string newtype for an identifier that comes from outside
/// (Fly, the config), taken as it is written ([`CommitId`], which is
/// checked, has its own constructor).
macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
        #[serde(transparent)]
        pub struct $name(String);

        text_newtype!($name);

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> $name {
                $name(s)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> $name {
                $name(s.to_string())
            }
        }
    };
}

/// A full, lowercase, 40-hex git commit id.
// Its text is shared: every machine on one ref holds the same one (a clone
// is a reference count, not 40 bytes per machine).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, schemars::JsonSchema)]
#[schemars(transparent, extend("pattern" = "^[0-9a-f]{40}$"))]
pub struct CommitId(Arc<str>);

impl Serialize for CommitId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// Reads a commit id the way [`CommitId::parse`] does (40 hex digits, any
/// case, normalised to lowercase), so a value written by hand or by an older
/// reconciler compares with the tip as the same type and never by text;
/// anything else is an error quoting what was found (bounded). Every read
/// of one checks it: metadata, documents read back, request bodies.
impl<'de> Deserialize<'de> for CommitId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<CommitId, D::Error> {
        let text = String::deserialize(d)?;
        CommitId::parse(&text).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "not a commit id (40 hex digits): {:?}",
                crate::text::bounded(&text, 64)
            ))
        })
    }
}

/// The first 12 digits of a commit id, as every view shows one (the whole
/// text when it is shorter, or not cut at a character boundary).
pub fn short_commit(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

impl CommitId {
    /// Accepts exactly 40 hex digits (any case) and normalises to lowercase.
    pub fn parse(s: &str) -> Option<CommitId> {
        (s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| CommitId(Arc::from(s.to_ascii_lowercase())))
    }
}

text_newtype!(CommitId);

impl From<CommitId> for String {
    fn from(id: CommitId) -> String {
        id.0.to_string()
    }
}

/// What the overlay says about one reported ref, relative to the release tip.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::Display,
    strum::EnumCount,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum MachineStatus {
    /// Started, probed, and reporting the release tip.
    OnTip,
    /// Started, probed, reporting a known commit other than the tip.
    Drifted,
    /// Started but its health endpoint could not be read (refused, timeout, HTTP error).
    Unreachable,
    /// Answered, but not with a usable report (not JSON, no ref, non-hex ref, too big).
    BadReport,
    /// Reported a ref the overlay repository does not contain (or not a commit).
    UnknownRef,
    /// Reported an abbreviated ref that matches more than one object.
    AmbiguousRef,
    /// Not in state `started`: not probed, not counted in coherence.
    NotRunning,
}

impl MachineStatus {
    // Sized by strum's count, so a new variant cannot be left out.
    pub const ALL: [MachineStatus; MachineStatus::COUNT] = [
        MachineStatus::OnTip,
        MachineStatus::Drifted,
        MachineStatus::Unreachable,
        MachineStatus::BadReport,
        MachineStatus::UnknownRef,
        MachineStatus::AmbiguousRef,
        MachineStatus::NotRunning,
    ];

    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Statuses for which a severity and an action are computed (docs/design.md §5.2).
    pub fn is_classified(self) -> bool {
        matches!(
            self,
            MachineStatus::Drifted | MachineStatus::UnknownRef | MachineStatus::AmbiguousRef
        )
    }
}

/// Drift severity, ordered from least to most urgent.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::Display,
    strum::EnumCount,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Severity {
    Low,
    Medium,
    High,
    Critical,
}

impl Severity {
    pub const ALL: [Severity; Severity::COUNT] = [
        Severity::Low,
        Severity::Medium,
        Severity::High,
        Severity::Critical,
    ];

    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What a pool's policy does about a drifted machine (docs/design.md §5.3).
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    strum::VariantArray,
    strum::Display,
    schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum PolicyAction {
    Observe,
    AlertAndWait,
    Restart,
    Manual,
    Reload,
}

impl PolicyAction {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

string_id! {
    /// A Fly machine id (`148e...`), as Fly lists it.
    MachineId
}

string_id! {
    /// A Fly app name, as configured under `[[apps]]`.
    AppName
}

/// A pool's name: a machine's `pool` metadata label, a `[pools.NAME]` section.
// Its text is shared: every row of a sweep in one pool holds the same one
// (a clone is a reference count, not a copy per machine).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, schemars::JsonSchema)]
#[schemars(transparent)]
pub struct PoolName(Arc<str>);

impl Serialize for PoolName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for PoolName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<PoolName, D::Error> {
        String::deserialize(d).map(PoolName::from)
    }
}

text_newtype!(PoolName);

impl From<PoolName> for String {
    fn from(name: PoolName) -> String {
        name.0.to_string()
    }
}

impl From<String> for PoolName {
    fn from(s: String) -> PoolName {
        PoolName(Arc::from(s))
    }
}

impl From<&str> for PoolName {
    fn from(s: &str) -> PoolName {
        PoolName(Arc::from(s))
    }
}

/// Takes the shared text as it is: no copy.
impl From<Arc<str>> for PoolName {
    fn from(s: Arc<str>) -> PoolName {
        PoolName(s)
    }
}

/// A Fly machine's state, as the Machines API names it. States this version
/// does not know are kept by name (`Other`), so a new Fly state is shown as
/// Fly wrote it and treated as "not started", never as an error.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(from = "String", into = "String")]
pub enum MachineState {
    Created,
    Starting,
    Started,
    Stopping,
    Stopped,
    Suspending,
    Suspended,
    Replacing,
    Destroying,
    Destroyed,
    Failed,
    /// Not reported (an empty `state` field).
    #[default]
    Unknown,
    Other(String),
}

impl MachineState {
    const NAMED: [(MachineState, &'static str); 12] = [
        (MachineState::Created, "created"),
        (MachineState::Starting, "starting"),
        (MachineState::Started, "started"),
        (MachineState::Stopping, "stopping"),
        (MachineState::Stopped, "stopped"),
        (MachineState::Suspending, "suspending"),
        (MachineState::Suspended, "suspended"),
        (MachineState::Replacing, "replacing"),
        (MachineState::Destroying, "destroying"),
        (MachineState::Destroyed, "destroyed"),
        (MachineState::Failed, "failed"),
        (MachineState::Unknown, ""),
    ];

    pub fn as_str(&self) -> &str {
        match self {
            MachineState::Other(s) => s,
            known => Self::NAMED
                .iter()
                .find(|(s, _)| s == known)
                .map_or("", |(_, name)| name),
        }
    }

    pub fn is_started(&self) -> bool {
        *self == MachineState::Started
    }

    /// States a machine settles in when it is not coming back by itself.
    pub fn is_settled_down(&self) -> bool {
        matches!(
            self,
            MachineState::Stopped
                | MachineState::Suspended
                | MachineState::Failed
                | MachineState::Destroyed
                | MachineState::Destroying
        )
    }
}

impl From<String> for MachineState {
    fn from(s: String) -> MachineState {
        MachineState::from(s.as_str())
    }
}

impl From<&str> for MachineState {
    fn from(s: &str) -> MachineState {
        Self::NAMED
            .iter()
            .find(|(_, name)| *name == s)
            .map_or_else(|| MachineState::Other(s.to_string()), |(st, _)| st.clone())
    }
}

impl From<MachineState> for String {
    fn from(s: MachineState) -> String {
        s.as_str().to_string()
    }
}

impl fmt::Display for MachineState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One commit a machine lacks, as a drift's reason shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct MissingCommit {
    pub commit: CommitId,
    /// The first line of its message, bounded by the overlay
    /// ([`MAX_SUBJECT_CHARS`](crate::observe::overlay::MAX_SUBJECT_CHARS)).
    /// Outside text: escape it before printing it to a terminal.
    pub subject: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_id_accepts_only_full_hex_and_lowercases() {
        let upper = "A".repeat(40);
        assert_eq!(CommitId::parse(&upper).unwrap().as_str(), "a".repeat(40));
        assert!(CommitId::parse(&"a".repeat(39)).is_none());
        assert!(CommitId::parse(&"g".repeat(40)).is_none());
    }

    /// The schema says what a commit id is: what `parse` writes passes, an
    /// abbreviation or an upper-case id does not.
    #[test]
    fn commit_id_schema_has_its_pattern() {
        let schema = serde_json::to_value(schemars::schema_for!(CommitId)).unwrap();
        assert_eq!(schema["pattern"], "^[0-9a-f]{40}$");
        let validator = jsonschema::validator_for(&schema).unwrap();
        let id = CommitId::parse(&"AB12".repeat(10)).unwrap();
        assert!(validator.is_valid(&serde_json::to_value(&id).unwrap()));
        for odd in ["abc1234".to_owned(), "AB12".repeat(10), "ab12".repeat(11)] {
            assert!(!validator.is_valid(&odd.clone().into()), "{odd}");
        }
    }

    /// A JSON read of a commit id checks it as `parse` does (before, any
    /// text was taken as a commit id): in a document read back, a missing
    /// commit with a short id is refused, naming the field.
    #[test]
    fn every_json_read_of_a_commit_id_checks_it() {
        let read = |text: &str| serde_json::from_str::<CommitId>(text);
        let upper = "ABCDEF0123".repeat(4);
        let id = read(&format!("\"{upper}\"")).expect("an upper-case commit id");
        assert_eq!(id.as_str(), upper.to_ascii_lowercase());
        assert_eq!(
            serde_json::to_string(&id).ok(),
            Some(format!("\"{}\"", upper.to_ascii_lowercase()))
        );
        for odd in [
            "\"abc1234\"",
            "\"\"",
            &format!("\"{}\"", "f".repeat(64)),
            "7",
        ] {
            assert!(read(odd).is_err(), "{odd}");
        }
        let why =
            crate::text::decode_json::<MissingCommit>(r#"{"commit":"abc1234","subject":"s"}"#)
                .expect_err("a short id");
        assert!(
            why.contains("commit") && why.contains("not a commit id") && why.contains("abc1234"),
            "{why}"
        );
        let long = format!("\"{}\"", "x".repeat(5000));
        let why = read(&long).expect_err("long").to_string();
        assert!(why.chars().count() < 200, "{why}");
    }

    /// A pool's name is shared text: a clone (every row of a sweep in the
    /// pool holds one) is a reference count, not a copy; on the wire and in
    /// the schema it is plain text, as when it was a `String`.
    #[test]
    fn a_pool_name_is_shared_text_written_as_a_string() {
        let web = PoolName::from("web");
        let row = web.clone();
        assert!(
            std::ptr::eq(web.as_str(), row.as_str()),
            "a clone copied the text"
        );
        let text: Arc<str> = Arc::from("web");
        assert!(std::ptr::eq(
            PoolName::from(Arc::clone(&text)).as_str(),
            &*text
        ));
        assert_eq!(serde_json::to_string(&web).ok().as_deref(), Some("\"web\""));
        let read: PoolName = serde_json::from_str("\"web\"").unwrap();
        assert_eq!((read.clone(), String::from(read)), (web, "web".to_owned()));
        let schema = serde_json::to_value(schemars::schema_for!(PoolName)).unwrap();
        assert_eq!(schema["type"], "string");
        // A pool table keyed by name reads back from TOML.
        let pools: std::collections::BTreeMap<PoolName, u32> = toml::from_str("web = 1").unwrap();
        assert_eq!(pools.get(&PoolName::from("web")), Some(&1));
    }

    #[test]
    fn severities_order_by_urgency() {
        assert!(Severity::Low < Severity::Medium);
        assert!(Severity::High < Severity::Critical);
    }

    #[test]
    fn names_match_the_design_vocabulary() {
        let s = serde_json::to_string(&PolicyAction::AlertAndWait).unwrap();
        assert_eq!(s, "\"alert-and-wait\"");
        let s = serde_json::to_string(&MachineStatus::AmbiguousRef).unwrap();
        assert_eq!(s, "\"ambiguous_ref\"");
        for st in MachineStatus::ALL {
            assert_eq!(
                serde_json::to_string(&st).unwrap(),
                format!("\"{}\"", st.as_str())
            );
        }
    }

    #[test]
    fn machine_states_round_trip_by_fly_name_and_keep_unknown_ones() {
        for name in [
            "started",
            "stopped",
            "suspended",
            "failed",
            "",
            "hibernating",
        ] {
            let st: MachineState = serde_json::from_value(serde_json::json!(name)).unwrap();
            assert_eq!(st.as_str(), name);
            assert_eq!(serde_json::to_value(&st).unwrap(), serde_json::json!(name));
        }
        assert!(MachineState::from("started").is_started());
        assert_eq!(
            MachineState::from("hibernating"),
            MachineState::Other("hibernating".into())
        );
        assert!(!MachineState::from("hibernating").is_started());
        assert!(!MachineState::from("hibernating").is_settled_down());
        assert!(MachineState::from("destroying").is_settled_down());
        assert_eq!(MachineState::from(""), MachineState::Unknown);
    }
}

//! Why a drifted machine has its severity: the typed [`Reason`] that
//! `decide::severity::explain` gives (the rule that matched or that none
//! did, its evidence, the newest missing commits), shared by every machine
//! on the same ref ([`SharedReason`]).
//!
//! Owns those types and how they print and serialize (the fleet document
//! carries them in its `refs` table, `report::wire`). It must never decide
//! anything: [`crate::decide::severity`] makes a reason, views show it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::model::{CommitId, MissingCommit, Severity, short_commit};

/// How a reported ref failed to resolve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Unresolved {
    /// Not a commit of any branch (or a non-commit object).
    Unknown,
    /// The abbreviation matches several objects, or is too short.
    Ambiguous,
}

/// Why a drifted machine has its severity: the rule that matched (or that
/// none did), what made its conditions hold, and the newest commits the
/// machine lacks. Shown on every drifted row of the report (`reason`).
///
/// Commit subjects are outside text (agents and repository authors choose
/// them): bounded by the overlay (200 characters), escaped when printed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Reason {
    pub rule: RuleMatch,
    /// One entry per condition of the matching rule, in the order the
    /// rule's keys are documented (`unknown_ref`, `trailers`, `paths`,
    /// `min_commits_behind`); for a ref that did not resolve, that it did
    /// not, whether a rule matched or not. Empty when no rule matched a
    /// resolved range.
    pub evidence: Vec<Evidence>,
    /// Commits in `tip ^commit` in all; `None` for a ref that did not resolve.
    pub behind: Option<u64>,
    /// The newest of them, newest first by committer time (ties: lowest
    /// id), at most [`crate::observe::overlay::MAX_SHOWN_MISSING`]. Shared with the
    /// overlay's cached range: a list costs a pointer per commit.
    #[serde(with = "shared_list")]
    #[schemars(with = "Vec<MissingCommit>")]
    pub missing: Vec<Arc<MissingCommit>>,
    /// Path rules have not been checked on every missing commit yet (git
    /// work per sweep is bounded): a `paths` rule may still match, and
    /// path evidence may be missing. Later sweeps finish it.
    pub evidence_partial: bool,
}

/// A [`Reason`] shared by every machine on the same ref (cloning a report
/// copies a pointer); serializes as the reason itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedReason(pub Arc<Reason>);

impl std::ops::Deref for SharedReason {
    type Target = Reason;
    fn deref(&self) -> &Reason {
        &self.0
    }
}

impl Serialize for SharedReason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl schemars::JsonSchema for SharedReason {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        Reason::schema_name()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        Reason::json_schema(generator)
    }
}

impl<'de> Deserialize<'de> for SharedReason {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Reason::deserialize(d).map(|r| SharedReason(Arc::new(r)))
    }
}

/// The rule that gave the level.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RuleMatch {
    /// The configured rule at `index` (0-based, `[[severity]]` order or
    /// the built-in list's), written as its TOML keys (`decide::severity::rule_text`).
    Matched { index: usize, text: String },
    /// No rule matched: the default level.
    NoMatch { level: Severity },
}

/// What made one condition of the matching rule hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Evidence {
    /// A missing commit with one of the rule's trailer keys (the newest
    /// such commit): its trailer key as the commit writes it.
    Trailer {
        commit: CommitId,
        subject: String,
        trailer: Option<String>,
    },
    /// A missing commit whose own change touches a path the rule's globs
    /// match (the newest such commit), and the first such path.
    Path {
        commit: CommitId,
        subject: String,
        path: Option<String>,
    },
    /// The count that reached `min_commits_behind`.
    CommitsBehind {
        behind: u64,
        min_commits_behind: u64,
    },
    /// The reported ref did not resolve.
    UnresolvedRef { resolution: Unresolved },
}

impl std::fmt::Display for RuleMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuleMatch::Matched { index, text } => write!(f, "rule #{index}: {text}"),
            RuleMatch::NoMatch { level } => {
                write!(f, "no rule matched: the default level, {level}")
            }
        }
    }
}

/// One line per piece of evidence, as `status MACHINE` and the machine
/// page show it (outside text unescaped: each view escapes for its medium).
impl std::fmt::Display for Evidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Evidence::Trailer {
                commit,
                subject,
                trailer,
            } => write!(
                f,
                "trailer {} in {} {subject}",
                trailer.as_deref().unwrap_or("-"),
                short_commit(commit.as_str())
            ),
            Evidence::Path {
                commit,
                subject,
                path,
            } => write!(
                f,
                "path {} changed by {} {subject}",
                path.as_deref().unwrap_or("-"),
                short_commit(commit.as_str())
            ),
            Evidence::CommitsBehind {
                behind,
                min_commits_behind,
            } => write!(
                f,
                "{behind} commits behind (rule: at least {min_commits_behind})"
            ),
            Evidence::UnresolvedRef {
                resolution: Unresolved::Unknown,
            } => f.write_str(
                "the reported ref did not resolve: not a commit of the overlay repository",
            ),
            Evidence::UnresolvedRef {
                resolution: Unresolved::Ambiguous,
            } => f.write_str("the reported ref did not resolve: it matches more than one object"),
        }
    }
}

/// `Vec<Arc<T>>` (de)serialized as a plain list of `T`, without serde's
/// `rc` feature.
mod shared_list {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<T: Serialize, S: Serializer>(
        list: &[Arc<T>],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(list.iter().map(|item| &**item))
    }

    pub fn deserialize<'de, T: Deserialize<'de>, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<Arc<T>>, D::Error> {
        Ok(Vec::<T>::deserialize(d)?
            .into_iter()
            .map(Arc::new)
            .collect())
    }
}

//! What the overlay looks for in the commits a machine is missing.
//!
//! Owns [`Signals`]: the list of per-commit facts a caller wants reported
//! for each drift range — "a commit whose message has one of these trailer
//! keys", "a commit whose own change touches a path matching these globs" —
//! and, for path signals, the literal directory prefixes that limit the tree
//! diffs. A signal is a question, not a verdict: this module must never know
//! severities, levels or policy (the severity module builds the list from its
//! rules and interprets the answers), and it does no I/O.

use std::collections::BTreeSet;

use globset::GlobSet;
use sha2::{Digest, Sha256};

/// A signal's position in its [`Signals`]; stable for a given list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SignalId(pub usize);

/// The questions asked of every commit in a drift range.
#[derive(Clone, Debug, Default)]
pub struct Signals {
    list: Vec<Signal>,
}

#[derive(Clone, Debug)]
pub(crate) enum Signal {
    /// Any of these trailer keys (trimmed, lowercase).
    Trailers(BTreeSet<String>),
    /// Any changed path matching `set`, compiled from `globs`.
    Paths(PathSignal),
}

#[derive(Clone, Debug)]
pub(crate) struct PathSignal {
    pub globs: Vec<String>,
    pub set: GlobSet,
}

impl Signals {
    pub fn new() -> Signals {
        Signals::default()
    }

    /// A commit carries this signal when its message has a trailer whose
    /// key, trimmed and lowercased, is one of `keys`.
    pub fn trailers<S: AsRef<str>>(&mut self, keys: impl IntoIterator<Item = S>) -> SignalId {
        let keys = keys
            .into_iter()
            .map(|k| normalize_trailer_key(k.as_ref()))
            .collect();
        self.push(Signal::Trailers(keys))
    }

    /// A commit carries this signal when its own change (for a merge: what
    /// differs from every parent) touches a path `set` matches. `set` must be
    /// compiled from `globs`, case-sensitively: the globs' literal prefixes
    /// decide which subtrees are diffed at all.
    pub fn paths(&mut self, globs: &[String], set: GlobSet) -> SignalId {
        self.push(Signal::Paths(PathSignal {
            globs: globs.to_vec(),
            set,
        }))
    }

    fn push(&mut self, signal: Signal) -> SignalId {
        self.list.push(signal);
        SignalId(self.list.len() - 1)
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Whether any signal needs tree diffs.
    pub fn has_paths(&self) -> bool {
        self.list.iter().any(|s| matches!(s, Signal::Paths(_)))
    }

    /// 64-bit words in a per-commit mask of these signals.
    pub(crate) fn words(&self) -> usize {
        self.list.len().div_ceil(64)
    }

    pub(crate) fn get(&self, id: SignalId) -> Option<&Signal> {
        self.list.get(id.0)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (SignalId, &Signal)> {
        self.list.iter().enumerate().map(|(i, s)| (SignalId(i), s))
    }

    pub(crate) fn path_signals(&self) -> impl Iterator<Item = (SignalId, &PathSignal)> {
        self.iter().filter_map(|(id, s)| match s {
            Signal::Paths(p) => Some((id, p)),
            Signal::Trailers(_) => None,
        })
    }

    /// Identifies everything a cached answer depends on.
    pub(crate) fn fingerprint(&self) -> u64 {
        let mut hash = Sha256::new();
        for (id, signal) in self.iter() {
            hash.update(id.0.to_le_bytes());
            match signal {
                Signal::Trailers(keys) => {
                    hash.update(b"t");
                    for key in keys {
                        hash.update(key.as_bytes());
                        hash.update([0]);
                    }
                }
                Signal::Paths(p) => {
                    hash.update(b"p");
                    for glob in &p.globs {
                        hash.update(glob.as_bytes());
                        hash.update([0]);
                    }
                }
            }
        }
        fold(&hash.finalize())
    }

    /// Identifies what the per-commit path facts depend on (the path
    /// signals and their positions), so changing a trailer rule keeps them.
    pub(crate) fn path_fingerprint(&self) -> u64 {
        let mut hash = Sha256::new();
        hash.update(self.words().to_le_bytes());
        for (id, p) in self.path_signals() {
            hash.update(id.0.to_le_bytes());
            for glob in &p.globs {
                hash.update(glob.as_bytes());
                hash.update([0]);
            }
            hash.update([1]);
        }
        fold(&hash.finalize())
    }

    /// The smallest set of repository paths under which every path signal's
    /// matches lie; `""` (the whole tree) when some glob has no literal
    /// prefix. Sorted, with no entry under another.
    pub(crate) fn prefixes(&self) -> Vec<String> {
        let mut all: Vec<String> = self
            .path_signals()
            .flat_map(|(_, p)| p.globs.iter().map(|g| literal_prefix(g)))
            .collect();
        all.sort();
        all.dedup();
        let mut out: Vec<String> = Vec::new();
        for prefix in all {
            let covered = out.iter().any(|kept| is_under(&prefix, kept));
            if !covered {
                out.push(prefix);
            }
        }
        out
    }
}

/// How trailer keys are compared: `Security`, ` security ` and `SECURITY`
/// are one key.
pub(crate) fn normalize_trailer_key(key: &str) -> String {
    key.trim().to_ascii_lowercase()
}

fn fold(digest: &[u8]) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(bytes)
}

/// `path` is `dir` or inside it (`""` contains everything).
fn is_under(path: &str, dir: &str) -> bool {
    dir.is_empty()
        || path == dir
        || (path.len() > dir.len() && path.starts_with(dir) && path.as_bytes()[dir.len()] == b'/')
}

/// The leading whole path segments of `glob` that contain no glob syntax:
/// every path the glob can match lies under it. `policies/**` → `policies`,
/// `skills/*.md` → `skills`, `guards/x` → `guards/x`, `**/*.md` → `""`.
/// Any character globset may treat specially ends the literal part, so the
/// prefix is never narrower than the glob.
pub(crate) fn literal_prefix(glob: &str) -> String {
    const SPECIAL: &[char] = &['*', '?', '[', ']', '{', '}', '\\', '!'];
    // A wholly literal glob keeps every segment: it names exactly one path.
    glob.split('/')
        .take_while(|segment| !segment.is_empty() && !segment.contains(SPECIAL))
        .collect::<Vec<_>>()
        .join("/")
}

#[cfg(test)]
mod tests {
    use super::*;
    use globset::{GlobBuilder, GlobSetBuilder};

    fn set(globs: &[&str]) -> GlobSet {
        let mut b = GlobSetBuilder::new();
        for g in globs {
            b.add(
                GlobBuilder::new(g)
                    .literal_separator(true)
                    .build()
                    .expect("glob"),
            );
        }
        b.build().expect("set")
    }

    fn owned(globs: &[&str]) -> Vec<String> {
        globs.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn literal_prefixes_stop_at_the_first_glob_syntax() {
        for (glob, prefix) in [
            ("policies/**", "policies"),
            ("skills/*.md", "skills"),
            ("guards/x", "guards/x"),
            ("a/b/c/*", "a/b/c"),
            ("**/*.md", ""),
            ("*.md", ""),
            ("{a,b}/x", ""),
            ("a/[bc]/x", "a"),
            ("a\\*/x", ""),
            ("a//b", "a"),
            ("/abs", ""),
        ] {
            assert_eq!(literal_prefix(glob), prefix, "{glob}");
        }
    }

    #[test]
    fn every_path_a_glob_matches_lies_under_its_prefix() {
        let paths = [
            "policies/x.yaml",
            "policies",
            "policiesX/y",
            "skills/a.md",
            "skills/deep/a.md",
            "guards/x",
            "guards/x/y",
            "docs/policies/readme.md",
            "a.md",
        ];
        for glob in ["policies/**", "skills/*.md", "guards/x", "**/*.md", "*.md"] {
            let s = set(&[glob]);
            let prefix = literal_prefix(glob);
            for path in paths {
                if s.is_match(path) {
                    assert!(
                        is_under(path, &prefix),
                        "{glob} matched {path}, prefix {prefix}"
                    );
                }
            }
        }
    }

    #[test]
    fn prefixes_are_minimal_and_whole_tree_wins() {
        let mut s = Signals::new();
        s.paths(
            &owned(&["skills/**", "skills/deep/*.md"]),
            set(&["skills/**"]),
        );
        s.trailers(["Security"]);
        s.paths(
            &owned(&["policies/**", "policiesX/*"]),
            set(&["policies/**"]),
        );
        assert_eq!(s.prefixes(), vec!["policies", "policiesX", "skills"]);
        s.paths(&owned(&["**/*.md"]), set(&["**/*.md"]));
        assert_eq!(s.prefixes(), vec![""]);
    }

    #[test]
    fn ids_are_positions_and_fingerprints_follow_content() {
        let mut a = Signals::new();
        assert_eq!(a.trailers([" Security "]), SignalId(0));
        assert_eq!(a.paths(&owned(&["p/**"]), set(&["p/**"])), SignalId(1));
        let mut b = Signals::new();
        b.trailers(["security"]);
        b.paths(&owned(&["p/**"]), set(&["p/**"]));
        assert_eq!(a.fingerprint(), b.fingerprint(), "keys are normalised");
        let mut c = Signals::new();
        c.trailers(["signed-off-by"]);
        c.paths(&owned(&["p/**"]), set(&["p/**"]));
        assert_ne!(a.fingerprint(), c.fingerprint());
        assert_eq!(
            a.path_fingerprint(),
            c.path_fingerprint(),
            "same path signals"
        );
        assert!(a.has_paths() && !Signals::new().has_paths());
    }
}

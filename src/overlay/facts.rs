//! Per-commit facts read from the mirror: parents, committer time and
//! trailer keys from the raw commit, and the path signals a commit's own
//! change carries, from tree diffs limited to the signals' literal prefixes.
//!
//! Owns the only reads of commit and tree objects that the drift analysis
//! does, so their cost is in one place: one object read per commit (never a
//! full parse into a libgit2 commit), and no tree diff at all when no signal
//! asks about paths. It must never write to the repository, decide anything
//! from a fact, or keep git2 handles beyond the call that was given them.

use std::collections::BTreeSet;

use git2::{DiffOptions, ErrorCode, Odb, Oid, Repository, Tree};

use super::graph::RawCommit;
use super::signals::{Signals, normalize_trailer_key};

/// Why a commit could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    Git(git2::Error),
    /// The object is not a commit, or its header is not one git writes.
    Malformed,
}

/// Reads one commit's parents, committer time and trailer keys.
pub(crate) fn read_commit(odb: &Odb<'_>, oid: Oid) -> Result<RawCommit, ReadError> {
    let object = odb.read(oid).map_err(ReadError::Git)?;
    if object.kind() != git2::ObjectType::Commit {
        return Err(ReadError::Malformed);
    }
    parse_commit(object.data()).ok_or(ReadError::Malformed)
}

/// Parses a raw commit object: `tree`, `parent`… and `committer` headers,
/// a blank line, the message.
pub(crate) fn parse_commit(data: &[u8]) -> Option<RawCommit> {
    let (header, message) = match find(data, b"\n\n") {
        Some(at) => (&data[..at], &data[at + 2..]),
        None => (data, &[][..]),
    };
    let mut commit = RawCommit::default();
    for line in header.split(|b| *b == b'\n') {
        if let Some(hex) = line.strip_prefix(b"parent ") {
            let hex = std::str::from_utf8(hex).ok()?;
            if hex.len() != 40 {
                return None;
            }
            commit.parents.push(Oid::from_str(hex).ok()?);
        } else if let Some(who) = line.strip_prefix(b"committer ") {
            // `Name <email> 1700000000 +0000`: the time is the second-to-last
            // field; a commit with a garbled date still has its parents.
            let mut fields = who.rsplit(|b| *b == b' ');
            let _zone = fields.next();
            commit.time = fields
                .next()
                .and_then(|t| std::str::from_utf8(t).ok())
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
        }
    }
    commit.trailers = trailer_keys(message);
    Some(commit)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Normalised trailer keys of a message, as libgit2 finds them (the text
/// up to a NUL byte, as C reads it).
fn trailer_keys(message: &[u8]) -> Vec<String> {
    let message = match message.iter().position(|b| *b == 0) {
        Some(nul) => &message[..nul],
        None => message,
    };
    // Every trailer has a `:`; most messages have none worth parsing.
    if !message.contains(&b':') {
        return Vec::new();
    }
    match git2::message_trailers_bytes(message) {
        Ok(trailers) => trailers
            .iter()
            .map(|(key, _)| normalize_trailer_key(&String::from_utf8_lossy(key)))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Which path signals (as a mask of `signals.words()` words) one commit's
/// own change carries. For a merge, only what differs from every parent (its
/// conflict resolutions and "evil" edits): the side branch's changes are
/// blamed on the side branch's commits, which the machine may already have.
pub(crate) fn path_mask(
    repo: &Repository,
    oid: Oid,
    signals: &Signals,
    prefixes: &[String],
) -> Result<Vec<u64>, git2::Error> {
    let mut mask = vec![0u64; signals.words()];
    let commit = repo.find_commit(oid)?;
    let tree = commit.tree()?;
    let changed = if commit.parent_count() == 0 {
        changed_under(repo, None, &tree, prefixes)?
    } else {
        let mut common: Option<BTreeSet<String>> = None;
        for index in 0..commit.parent_count() {
            let parent_tree = commit.parent(index)?.tree()?;
            let changed = changed_under(repo, Some(&parent_tree), &tree, prefixes)?;
            let narrowed = match common {
                None => changed,
                Some(common) => common.intersection(&changed).cloned().collect(),
            };
            let empty = narrowed.is_empty();
            common = Some(narrowed);
            if empty {
                break;
            }
        }
        common.unwrap_or_default()
    };
    for (id, signal) in signals.path_signals() {
        if changed.iter().any(|p| signal.set.is_match(p)) {
            mask[id.0 / 64] |= 1 << (id.0 % 64);
        }
    }
    Ok(mask)
}

/// Paths under `prefixes` that differ between two trees. A prefix whose
/// subtree (or blob) id is the same on both sides is skipped without a diff:
/// for most commits that is every prefix. Without rename detection a rename
/// is a deletion plus an addition, so both paths are reported.
fn changed_under(
    repo: &Repository,
    old: Option<&Tree<'_>>,
    new: &Tree<'_>,
    prefixes: &[String],
) -> Result<BTreeSet<String>, git2::Error> {
    let mut changed = BTreeSet::new();
    if old.is_some_and(|old| old.id() == new.id()) {
        return Ok(changed);
    }
    let mut options = DiffOptions::new();
    let mut limited = false;
    let whole_tree = prefixes.iter().any(String::is_empty);
    if !whole_tree {
        for prefix in prefixes {
            if entry_id(old, prefix)? == entry_id(Some(new), prefix)? {
                continue;
            }
            options.pathspec(prefix.as_str());
            limited = true;
        }
        if !limited {
            return Ok(changed);
        }
        // Literal paths (a directory covers what is under it), so libgit2
        // skips every other subtree instead of matching each entry.
        options.disable_pathspec_match(true);
    }
    let diff = repo.diff_tree_to_tree(old, Some(new), Some(&mut options))?;
    for delta in diff.deltas() {
        for file in [delta.old_file(), delta.new_file()] {
            if let Some(path) = file.path_bytes() {
                changed.insert(String::from_utf8_lossy(path).into_owned());
            }
        }
    }
    Ok(changed)
}

/// The id of the tree entry at `path`, `None` if there is none.
fn entry_id(tree: Option<&Tree<'_>>, path: &str) -> Result<Option<Oid>, git2::Error> {
    let Some(tree) = tree else { return Ok(None) };
    match tree.get_path(std::path::Path::new(path)) {
        Ok(entry) => Ok(Some(entry.id())),
        Err(e) if e.code() == ErrorCode::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_commits_parse_parents_time_and_trailers() {
        let raw = b"tree 4b825dc642cb6eb9a060e54bf8d69288fbee4904\n\
parent 0123456789abcdef0123456789abcdef01234567\n\
parent 89abcdef0123456789abcdef0123456789abcdef\n\
author A <a@x> 1700000000 +0000\n\
committer C <c@x> 1700000123 -0700\n\
gpgsig -----BEGIN PGP SIGNATURE-----\n \n -----END PGP SIGNATURE-----\n\
\n\
Fix the sandbox\n\nSecurity: CVE-1\nSigned-off-by: Dev <dev@x>\n";
        let commit = parse_commit(raw).expect("parses");
        assert_eq!(commit.parents.len(), 2);
        assert_eq!(
            commit.parents[0].to_string(),
            "0123456789abcdef0123456789abcdef01234567"
        );
        assert_eq!(commit.time, 1_700_000_123);
        assert_eq!(commit.trailers, vec!["security", "signed-off-by"]);
    }

    #[test]
    fn garbled_headers_fail_closed_or_degrade() {
        assert_eq!(parse_commit(b"tree x\nparent nothex\n\nmsg"), None);
        assert_eq!(parse_commit(b"tree x\nparent 0123\n\nmsg"), None);
        let no_date = parse_commit(b"tree x\ncommitter C <c@x> soon\n\nmsg").expect("parses");
        assert_eq!(no_date.time, 0);
        let nul =
            parse_commit(b"tree x\n\nsubject\n\nKey: v\0\n\nSecurity: hidden\n").expect("parses");
        assert_eq!(nul.trailers, vec!["key"]);
    }
}

//! The commit graph and its per-commit facts, saved beside the mirror.
//!
//! Owns one file inside the mirror directory, so a new process (a one-shot
//! `check`, a restarted daemon) starts from every commit already read and
//! every tree diff already done instead of reading the history again. The
//! file is a cache: written whole to a temporary file and renamed into
//! place (a reader sees the old file or the new one, never half of one),
//! checked with a SHA-256 digest and every structural invariant on load,
//! and ignored — rebuilt from the repository — whenever it is missing,
//! damaged, or from another format version. It must never hold anything
//! that cannot be recomputed from the mirror, and never be trusted past
//! those checks.

use std::io::Write;
use std::path::{Path, PathBuf};

use git2::Oid;
use sha2::{Digest, Sha256};

use super::graph::{Graph, GraphParts, PathFacts};

/// File name inside the mirror directory (git ignores unknown files there).
pub(crate) const FILE_NAME: &str = "fleet-reconciler-graph";
const MAGIC: &[u8; 8] = b"FRGRAPH1";
const DIGEST_LEN: usize = 32;

pub(crate) fn path_in(mirror_dir: &Path) -> PathBuf {
    mirror_dir.join(FILE_NAME)
}

/// Why a saved graph was not used.
#[derive(Debug)]
pub(crate) enum LoadFailure {
    Missing,
    Io(std::io::Error),
    /// Wrong magic, wrong digest, or arrays that break an invariant.
    Damaged,
}

pub(crate) fn load(path: &Path) -> Result<Graph, LoadFailure> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(LoadFailure::Missing),
        Err(e) => return Err(LoadFailure::Io(e)),
    };
    decode(&bytes).ok_or(LoadFailure::Damaged)
}

/// Writes `graph` to `path` atomically (temporary file, then rename).
pub(crate) fn save(path: &Path, graph: &Graph) -> std::io::Result<()> {
    let bytes = encode(graph);
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn encode(graph: &Graph) -> Vec<u8> {
    let parts = graph.view();
    let n = parts.oids.len();
    let mut out = Vec::with_capacity(64 + n * 48 + parts.paths.masks.len() * 8);
    out.extend_from_slice(MAGIC);
    put_u64(&mut out, n as u64);
    for oid in parts.oids {
        out.extend_from_slice(oid.as_bytes());
    }
    for time in parts.times {
        out.extend_from_slice(&time.to_le_bytes());
    }
    put_u32s(&mut out, parts.parent_start);
    put_u32s(&mut out, parts.parents);
    put_u32s(&mut out, parts.trailer_start);
    put_u32s(&mut out, parts.trailers);
    put_u64(&mut out, parts.keys.len() as u64);
    for key in parts.keys {
        put_u64(&mut out, key.len() as u64);
        out.extend_from_slice(key.as_bytes());
    }
    put_u64(&mut out, parts.paths.fingerprint);
    put_u64(&mut out, parts.paths.words as u64);
    out.extend(parts.paths.known.iter().map(|k| u8::from(*k)));
    for word in &parts.paths.masks {
        out.extend_from_slice(&word.to_le_bytes());
    }
    let digest = Sha256::digest(&out);
    out.extend_from_slice(&digest);
    out
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u32s(out: &mut Vec<u8>, items: &[u32]) {
    put_u64(out, items.len() as u64);
    for item in items {
        out.extend_from_slice(&item.to_le_bytes());
    }
}

/// Reads fixed-size fields, refusing any length the remaining bytes cannot
/// hold (so a damaged count cannot make us allocate gigabytes).
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        if len > self.rest.len() {
            return None;
        }
        let (head, tail) = self.rest.split_at(len);
        self.rest = tail;
        Some(head)
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn count(&mut self, item_size: usize) -> Option<usize> {
        let n = usize::try_from(self.u64()?).ok()?;
        (n.checked_mul(item_size)? <= self.rest.len()).then_some(n)
    }

    fn u32s(&mut self) -> Option<Vec<u32>> {
        let n = self.count(4)?;
        let bytes = self.take(n * 4)?;
        Some(
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }
}

fn decode(bytes: &[u8]) -> Option<Graph> {
    let body_len = bytes.len().checked_sub(DIGEST_LEN)?;
    let (body, digest) = bytes.split_at(body_len);
    if Sha256::digest(body).as_slice() != digest {
        return None;
    }
    let mut r = Reader { rest: body };
    if r.take(MAGIC.len())? != MAGIC {
        return None;
    }
    let n = r.count(28)?;
    let oids = r
        .take(n * 20)?
        .chunks_exact(20)
        .map(Oid::from_bytes)
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let times = r
        .take(n * 8)?
        .chunks_exact(8)
        .map(|c| c.try_into().map(i64::from_le_bytes))
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let parent_start = r.u32s()?;
    let parents = r.u32s()?;
    let trailer_start = r.u32s()?;
    let trailers = r.u32s()?;
    let key_count = r.count(8)?;
    let mut keys = Vec::with_capacity(key_count);
    for _ in 0..key_count {
        let len = r.count(1)?;
        keys.push(String::from_utf8(r.take(len)?.to_vec()).ok()?);
    }
    let fingerprint = r.u64()?;
    let words = usize::try_from(r.u64()?).ok()?;
    let known = r.take(n)?.iter().map(|b| *b == 1).collect();
    let mask_bytes = n.checked_mul(words)?.checked_mul(8)?;
    let masks = r
        .take(mask_bytes)?
        .chunks_exact(8)
        .map(|c| c.try_into().map(u64::from_le_bytes))
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    if !r.rest.is_empty() {
        return None;
    }
    Graph::from_parts(GraphParts {
        oids,
        times,
        parent_start,
        parents,
        trailer_start,
        trailers,
        keys,
        paths: PathFacts {
            fingerprint,
            words,
            masks,
            known,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::overlay::graph::RawCommit;

    fn oid(i: u8) -> Oid {
        Oid::from_bytes(&[i; 20]).expect("20 bytes")
    }

    fn sample() -> Graph {
        let mut graph = Graph::default();
        let mut read = |id: Oid| -> Result<RawCommit, ()> {
            let i = id.as_bytes()[0];
            Ok(RawCommit {
                parents: if i == 1 { vec![] } else { vec![oid(i - 1)] },
                time: i64::from(i) * 60,
                trailers: if i == 2 {
                    vec!["security".into()]
                } else {
                    vec![]
                },
            })
        };
        graph.ensure(oid(4), &mut read).expect("load");
        graph.use_path_signals(7, 1);
        graph.set_path_mask(1, &[0b101]);
        graph
    }

    #[test]
    fn a_saved_graph_loads_back_equal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = path_in(dir.path());
        let mut graph = sample();
        save(&path, &graph).expect("save");
        graph.mark_clean();
        assert_eq!(load(&path).expect("load"), graph);
    }

    #[test]
    fn missing_truncated_or_flipped_files_are_not_used() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = path_in(dir.path());
        assert!(matches!(load(&path), Err(LoadFailure::Missing)));
        save(&path, &sample()).expect("save");
        let bytes = std::fs::read(&path).expect("read");
        for damaged in [
            bytes[..bytes.len() / 2].to_vec(),
            {
                let mut b = bytes.clone();
                b[20] ^= 1;
                b
            },
            Vec::new(),
        ] {
            std::fs::write(&path, &damaged).expect("write");
            assert!(matches!(load(&path), Err(LoadFailure::Damaged)));
        }
    }
}

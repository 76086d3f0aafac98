//! Cold start from a local repository: seed an empty mirror with the
//! source's pack files instead of having libgit2 copy every object.
//!
//! libgit2's local transport builds a pack in-process, object by object, for
//! whatever the mirror lacks: for a fresh mirror of a long history that is
//! minutes where `git clone --mirror` (which hard-links the object files)
//! takes a moment. Pack files are immutable and named by their content, so
//! a fresh mirror can take them as they are — hard-linked when source and
//! mirror share a filesystem, else copied whole — and the fetch that
//! follows finds every wanted commit present and only updates the refs.
//!
//! Owns only that seeding step. It must never write to the source (a hard
//! link adds a name, not a change; the mirror's link keeps the data alive if
//! the source later repacks), never touch a mirror that already has refs
//! (later fetches are small and go through libgit2), and never make a
//! failure fatal: anything that goes wrong leaves the ordinary fetch to do
//! the whole transfer.

use std::path::Path;

/// Links or copies every `pack-*.pack` (with its `.idx`) of the repository
/// at `source` into `mirror_dir` that the mirror does not have yet. Returns
/// how many packs were added.
pub(crate) fn seed_packs(source: &Path, mirror_dir: &Path) -> std::io::Result<usize> {
    let source_packs = objects_dir(source)?.join("pack");
    let mirror_packs = mirror_dir.join("objects").join("pack");
    std::fs::create_dir_all(&mirror_packs)?;
    let mut added = 0;
    let entries = match std::fs::read_dir(&source_packs) {
        Ok(entries) => entries,
        // A repository with only loose objects has no pack directory.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let name = entry?.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".idx")) else {
            continue;
        };
        if !stem.starts_with("pack-") || mirror_packs.join(format!("{stem}.idx")).exists() {
            continue;
        }
        // The pack first, its index last: libgit2 finds packs by their
        // index, so it never sees one whose data is still arriving.
        let pack = format!("{stem}.pack");
        if !source_packs.join(&pack).exists() {
            continue;
        }
        place(&source_packs.join(&pack), &mirror_packs.join(&pack))?;
        place(
            &source_packs.join(format!("{stem}.idx")),
            &mirror_packs.join(format!("{stem}.idx")),
        )?;
        added += 1;
    }
    Ok(added)
}

/// Where a repository at `path` (bare, or a work tree with `.git`) keeps
/// its objects.
fn objects_dir(path: &Path) -> std::io::Result<std::path::PathBuf> {
    let dot_git = path.join(".git");
    let git_dir = if dot_git.is_dir() {
        dot_git
    } else {
        path.to_path_buf()
    };
    let objects = git_dir.join("objects");
    if objects.is_dir() {
        Ok(objects)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{} has no objects directory", git_dir.display()),
        ))
    }
}

/// Hard-links `from` to `to`, or copies it when a link is not possible
/// (another filesystem, protected hard links); through a temporary name, so
/// `to` appears complete or not at all.
fn place(from: &Path, to: &Path) -> std::io::Result<()> {
    let tmp = to.with_extension(format!("seed-tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    if std::fs::hard_link(from, &tmp).is_err()
        && let Err(e) = std::fs::copy(from, &tmp)
    {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, to).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_are_placed_index_last_and_only_once() {
        let source = tempfile::tempdir().expect("tempdir");
        let mirror = tempfile::tempdir().expect("tempdir");
        let packs = source.path().join("objects").join("pack");
        std::fs::create_dir_all(&packs).expect("mkdir");
        std::fs::write(packs.join("pack-aa.pack"), b"pack").expect("write");
        std::fs::write(packs.join("pack-aa.idx"), b"idx").expect("write");
        // An index without its pack, and a stray file: both skipped.
        std::fs::write(packs.join("pack-bb.idx"), b"idx").expect("write");
        std::fs::write(packs.join("notes.txt"), b"x").expect("write");
        assert_eq!(seed_packs(source.path(), mirror.path()).expect("seed"), 1);
        let placed = mirror.path().join("objects").join("pack");
        assert_eq!(
            std::fs::read(placed.join("pack-aa.pack")).expect("pack"),
            b"pack"
        );
        assert!(placed.join("pack-aa.idx").exists());
        assert!(!placed.join("pack-bb.idx").exists());
        assert_eq!(seed_packs(source.path(), mirror.path()).expect("again"), 0);
    }

    #[test]
    fn a_source_without_packs_seeds_nothing() {
        let source = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(source.path().join("objects")).expect("mkdir");
        let mirror = tempfile::tempdir().expect("tempdir");
        assert_eq!(seed_packs(source.path(), mirror.path()).expect("seed"), 0);
        assert!(seed_packs(&source.path().join("missing"), mirror.path()).is_err());
    }
}

//! scripts/release-check (issue 34 item 1): the repository's own versions
//! agree (Cargo.toml = the newest CHANGELOG.md section), and each mismatch
//! the release workflow would refuse is refused here too, naming both sides.
//! The build, package and `--version` steps run in `.ci/run`.

use std::path::Path;
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn release_check(args: &[&str]) -> Output {
    Command::new("bash")
        .arg(root().join("scripts/release-check"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

fn crate_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

fn shown(out: &Output) -> String {
    format!(
        "exit {:?}\n{}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn the_crate_version_is_the_newest_changelog_section() {
    let out = release_check(&["--versions-only"]);
    assert_eq!(out.status.code(), Some(0), "{}", shown(&out));
    let v = crate_version();
    let tagged = release_check(&["--versions-only", "--tag", &format!("v{v}")]);
    assert_eq!(tagged.status.code(), Some(0), "{}", shown(&tagged));
    assert!(
        String::from_utf8_lossy(&tagged.stdout).contains(&format!("tag v{v} = Cargo.toml {v}")),
        "{}",
        shown(&tagged)
    );
}

#[test]
fn a_mismatched_changelog_or_tag_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    let v = crate_version();
    let cases = [
        (
            "## [Unreleased]\n\n- something\n".to_string(),
            None,
            "no version section",
        ),
        (
            format!(
                "## [Unreleased]\n\n## [9.9.9] - 2026-12-05\n\n- new\n\n## [{v}] - 2026-01-01\n\n- old\n"
            ),
            None,
            "[9.9.9]",
        ),
        (
            format!("## [Unreleased]\n\n## [{v}]\n\n- no date\n"),
            None,
            "YYYY-MM-DD",
        ),
        (
            format!(
                "## [Unreleased]\n\n## [{v}] - 2026-12-05\n\n## [0.0.1] - 2026-01-01\n\n- old\n"
            ),
            None,
            "is empty",
        ),
        (
            format!("## [Unreleased]\n\n## [{v}] - 2026-12-05\n\n- notes\n"),
            Some("v9.9.9"),
            "tag v9.9.9 does not match",
        ),
    ];
    for (i, (changelog, tag, says)) in cases.into_iter().enumerate() {
        let path = dir.path().join(format!("CHANGELOG-{i}.md"));
        std::fs::write(&path, &changelog).unwrap();
        let path = path.display().to_string();
        let mut args = vec!["--versions-only", "--changelog", path.as_str()];
        if let Some(tag) = tag {
            args.extend(["--tag", tag]);
        }
        let out = release_check(&args);
        let text = shown(&out);
        assert_eq!(out.status.code(), Some(1), "case {i}: {text}");
        assert!(text.contains(says), "case {i}: expected {says:?}: {text}");
    }
    // An unknown argument is a usage error, not a pass.
    let out = release_check(&["--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2), "{}", shown(&out));
}

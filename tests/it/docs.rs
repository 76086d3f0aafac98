//! The doc check (issue 34 item 6): every `fleet-reconciler …` command shown
//! in a code block of README.md or docs/*.md parses with the binary's own
//! clap definition ([`fleet_reconciler::cli::Cli`]), so the text and the
//! binary cannot disagree on a command, a flag or a combination of flags.

use std::path::{Path, PathBuf};

use clap::Parser as _;
use fleet_reconciler::cli::Cli;

const BIN_NAME: &str = "fleet-reconciler";

/// One command as the docs show it: where, and its words.
#[derive(Debug)]
struct Shown {
    at: String,
    words: Vec<String>,
}

/// The Markdown files the check reads: the README and every docs/*.md.
fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The lines of the fenced code blocks of `text`, numbered from 1, with
/// `\`-continued lines joined (numbered by their first line).
fn code_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => {
                fence = Some(m);
                continue;
            }
            (Some(f), Some(m)) if f == m => {
                fence = None;
                if let Some(p) = pending.take() {
                    out.push(p);
                }
                continue;
            }
            (None, None) => continue,
            _ => {}
        }
        let (n, mut joined) = pending.take().unwrap_or((i + 1, String::new()));
        match line.strip_suffix('\\') {
            Some(head) => {
                joined.push_str(head);
                joined.push(' ');
                pending = Some((n, joined));
            }
            None => {
                joined.push_str(line);
                out.push((n, joined));
            }
        }
    }
    out
}

/// Shell words of `line` up to its first operator (`&&`, `|`, `;`, a
/// redirection) or comment; quotes group and are removed. `None` when the
/// words run into something this splitter does not follow (`$(`, a
/// backtick), so it never invents a command.
fn words(line: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some(q) if q == c => break,
                        Some('$') if c == '"' && chars.peek() == Some(&'(') => return None,
                        Some(q) => word.push(q),
                        None => return None,
                    }
                }
            }
            '`' => return None,
            '$' if chars.peek() == Some(&'(') => return None,
            ' ' | '\t' => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '#' if !in_word => break,
            // A placeholder (`<40-hex>`), not a redirection.
            '<' if chars.clone().take_while(|&c| c != ' ').any(|c| c == '>') => {
                in_word = true;
                word.push(c);
                for p in chars.by_ref() {
                    word.push(p);
                    if p == '>' {
                        break;
                    }
                }
            }
            '&' | '|' | ';' | '>' | '<' => break,
            _ => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        // A redirection such as `2>` leaves its digit behind: drop it.
        if !(word.chars().all(|c| c.is_ascii_digit()) && line.contains('>')) {
            out.push(word);
        }
    }
    Some(out)
}

/// Every `fleet-reconciler …` command in `line`: the binary (by name or a
/// path ending in it, or `cargo run … --`) in command position, at the
/// start, after a prompt (`$`), a shell operator or `-C "` (`fly ssh
/// console -C "fleet-reconciler status …"`).
fn commands_in(line: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    // Split at the operators first: each segment is one command.
    let mut line = line.to_string();
    for q in ['"', '\''] {
        let open = format!("-C {q}");
        while let Some(i) = line.find(&open) {
            let rest = &line[i + open.len()..];
            let end = rest.find(q).unwrap_or(rest.len());
            line = format!(
                "{} && {} ; {}",
                &line[..i],
                &rest[..end],
                rest.get(end + 1..).unwrap_or("")
            );
        }
    }
    for segment in line.split(['&', '|', ';', '(']) {
        let segment = segment.trim_start().trim_start_matches("$ ");
        let Some(ws) = words(segment) else { continue };
        let ws: Vec<String> = ws
            .into_iter()
            .skip_while(|w| w == "exec" || w == "sudo" || w.contains('=') && !w.starts_with('-'))
            .collect();
        let Some(first) = ws.first() else { continue };
        let args = if first == BIN_NAME || first.ends_with(&format!("/{BIN_NAME}")) {
            ws[1..].to_vec()
        } else if first == "cargo"
            && ws.get(1).is_some_and(|w| w == "run")
            // Another program of the package (`--example agent`).
            && !ws.iter().any(|w| w == "--example" || w == "--bin")
        {
            match ws.iter().position(|w| w == "--") {
                Some(i) => ws[i + 1..].to_vec(),
                None => continue,
            }
        } else {
            continue;
        };
        // `fleet-reconciler` alone or with only `--help`/`--version`.
        out.push(args);
    }
    out
}

fn shown_commands() -> Vec<Shown> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for path in documents() {
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.strip_prefix(root).unwrap().display().to_string();
        for (n, line) in code_lines(&text) {
            for args in commands_in(&line) {
                out.push(Shown {
                    at: format!("{name}:{n}"),
                    words: args,
                });
            }
        }
    }
    out
}

/// Why clap refuses `args`, or `None` when it parses (or asks only for
/// help or the version, which is a parse too).
fn refusal(args: &[String]) -> Option<String> {
    let argv = std::iter::once(BIN_NAME.to_string()).chain(args.iter().cloned());
    match Cli::try_parse_from(argv) {
        Ok(_) => None,
        Err(e) => match e.kind() {
            clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => None,
            _ => Some(e.to_string().lines().next().unwrap_or_default().to_string()),
        },
    }
}

#[test]
fn every_command_the_docs_show_parses_with_the_binarys_own_definition() {
    let shown = shown_commands();
    // The extraction still finds the docs' commands (their number only grows).
    assert!(
        shown.len() >= 40,
        "only {} commands found: {shown:#?}",
        shown.len()
    );
    for sub in [
        "demo",
        "check",
        "status",
        "approve",
        "revoke",
        "hold",
        "release",
        "preflight",
        "validate-config",
        "run",
    ] {
        assert!(
            shown
                .iter()
                .any(|s| s.words.first().is_some_and(|w| w == sub)),
            "no `{BIN_NAME} {sub}` in a code block of the docs"
        );
    }
    let wrong: Vec<String> = shown
        .iter()
        .filter_map(|s| {
            refusal(&s.words)
                .map(|why| format!("{}: `{BIN_NAME} {}`: {why}", s.at, s.words.join(" ")))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "commands the binary refuses:\n{}",
        wrong.join("\n")
    );
}

/// The check catches what it is for: a flag the binary does not have, two
/// flags it refuses together, a command that is not there.
#[test]
fn the_doc_check_refuses_commands_the_binary_refuses() {
    let text = "```sh\n$ fleet-reconciler approve m1 --now --when-idle\nfleet-reconciler check --format json | jq .\nfly ssh console -C \"fleet-reconciler unhold m1\"\nfleet-reconciler approve m1 --yes\n```\n";
    let shown: Vec<Vec<String>> = code_lines(text)
        .iter()
        .flat_map(|(_, l)| commands_in(l))
        .collect();
    assert_eq!(shown.len(), 4, "{shown:?}");
    for args in &shown {
        assert!(refusal(args).is_some(), "{args:?} parsed");
    }
    // And the extraction leaves other programs alone.
    let other = "```sh\nfly apps create fleet-reconciler --org acme\nfly tokens create deploy -a fleet-reconciler\nexport X=\"$(fleet-reconciler check)\"\n```\n";
    let shown: Vec<Vec<String>> = code_lines(other)
        .iter()
        .flat_map(|(_, l)| commands_in(l))
        .collect();
    assert!(shown.is_empty(), "{shown:?}");
}

/// The README is what a newcomer reads (issue 34 item 6): short, with the
/// quick start's two commands (`.ci/run` runs its test command verbatim)
/// and a way to everything else.
#[test]
fn the_readme_stays_a_readme() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines < 400,
        "README.md has {lines} lines: move reference material into docs/"
    );
    for needed in [
        "cargo run --release -- demo",
        "cargo test",
        "docs/pilot.md",
        "docs/deploy.md",
        "docs/reference.md",
    ] {
        assert!(readme.contains(needed), "README.md lost {needed:?}");
    }
}

/// `--help` says what a script needs (issue 34 item 7): every command's
/// exit codes, and `demo` does not offer `--config`, which it refuses.
#[test]
fn help_names_exit_codes_and_demo_offers_no_config() {
    let help = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fleet-reconciler"))
            .args(args)
            .arg("--help")
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    for cmd in [
        "check",
        "plan",
        "validate-config",
        "preflight",
        "run",
        "status",
        "approve",
        "revoke",
        "hold",
        "release",
    ] {
        let text = help(&[cmd]);
        assert!(
            text.contains("Exit 0") || text.contains("exit 0"),
            "`{cmd} --help` names no exit codes:\n{text}"
        );
        assert!(
            text.contains("2 "),
            "`{cmd} --help` does not say when it exits 2:\n{text}"
        );
    }
    let demo = help(&["demo"]);
    assert!(!demo.contains("--config "), "{demo}");
    assert!(demo.contains("--demo-config"), "{demo}");
    // The others still take it, after the command or before it.
    assert!(help(&["check"]).contains("--config "));
    for args in [
        ["fleet-reconciler", "check", "--config", "x.toml"],
        ["fleet-reconciler", "--config", "x.toml", "check"],
    ] {
        let cli = Cli::try_parse_from(args).unwrap();
        assert_eq!(
            cli.config_path()
                .map(|p| p.display().to_string())
                .as_deref(),
            Some("x.toml")
        );
    }
}

/// Issue 34 item 4: nothing shipped has an operator export flyctl's
/// `FLY_API_TOKEN` (every later `fly` command in that shell would run with
/// the reconciler's token) or name it as a config's `fly.token_env`.
#[test]
fn nothing_shipped_takes_over_flyctls_token() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(root.join("config")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let config: toml::Table = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let var = config
            .get("fly")
            .and_then(|f| f.get("token_env"))
            .and_then(|v| v.as_str());
        if var == Some("FLY_API_TOKEN") {
            wrong.push(format!(
                "{}: fly.token_env = \"FLY_API_TOKEN\"",
                path.display()
            ));
        }
    }
    let mut files = documents();
    files.extend([root.join("fly.toml"), root.join("deploy/README.md")]);
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            if line.contains("export FLY_API_TOKEN=") {
                wrong.push(format!("{}:{}: {line}", path.display(), n + 1));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "use FLEET_RECONCILER_FLY_TOKEN:\n{}",
        wrong.join("\n")
    );
}

/// The commands tables (issue 34 item 6: the README once said there was no
/// `revoke`, and that plain `approve` ends live work). In every table headed
/// `| command |` of README.md and docs/*.md, each row's first cell shows
/// commands as `` `name ARGS [--flag …]` ``: each must be a command of the
/// binary and each flag one it takes. And every command has a row, in one of
/// those tables, showing every flag it takes, so a command or a flag added
/// without its reference fails here. `--config`, `--log-format` and `--help`
/// are said once for all commands, not per row.
#[test]
fn the_commands_tables_agree_with_the_binary() {
    use std::collections::BTreeSet;

    use clap::CommandFactory as _;
    let cli = Cli::command();
    let flags_of = |name: &str| -> Option<BTreeSet<String>> {
        let sub = cli.find_subcommand(name)?;
        Some(
            sub.get_arguments()
                .filter(|a| !a.is_hide_set())
                .filter_map(|a| a.get_long())
                .filter(|l| !["config", "log-format", "help"].contains(l))
                .map(str::to_string)
                .collect(),
        )
    };
    let mut wrong = Vec::new();
    // Per command: the most complete row's flags.
    let mut shown: std::collections::BTreeMap<String, BTreeSet<String>> = Default::default();
    for path in documents() {
        let text = std::fs::read_to_string(&path).unwrap();
        let mut in_table = false;
        for (n, line) in text.lines().enumerate() {
            if !line.starts_with('|') {
                in_table = false;
                continue;
            }
            if line.to_ascii_lowercase().starts_with("| command |") {
                in_table = true;
                continue;
            }
            if !in_table || line.starts_with("| ---") {
                continue;
            }
            let at = format!("{}:{}", path.display(), n + 1);
            // `\|` inside a cell ("text\|json") is not a column break.
            let line = line.replace("\\|", "/");
            let cell = line.split('|').nth(1).unwrap_or_default();
            // The backticked spans of the first cell: "`hold …`, `release …`".
            for span in cell.split('`').skip(1).step_by(2) {
                let Some(name) = span.split_whitespace().next() else {
                    continue;
                };
                let Some(takes) = flags_of(name) else {
                    wrong.push(format!("{at}: `{name}` is not a command of the binary"));
                    continue;
                };
                let flags: BTreeSet<String> = span
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .filter_map(|w| w.strip_prefix("--"))
                    .filter(|f| !f.is_empty())
                    .map(str::to_string)
                    .collect();
                for f in flags.difference(&takes) {
                    wrong.push(format!("{at}: `{name}` takes no --{f}"));
                }
                let best = shown.entry(name.to_string()).or_default();
                if flags.len() > best.len() {
                    *best = flags;
                }
            }
        }
    }
    for sub in cli.get_subcommands() {
        let name = sub.get_name();
        if name == "help" {
            continue;
        }
        let takes = flags_of(name).unwrap_or_default();
        match shown.get(name) {
            None => wrong.push(format!("`{name}` has no row in a commands table")),
            Some(flags) => {
                for f in takes.difference(flags) {
                    wrong.push(format!("no commands table row shows `{name} --{f}`"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

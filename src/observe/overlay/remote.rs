//! The remote: where the overlay comes from ([`OverlaySource`]) and the
//! rules on its URL and token: how the URL is kept (relative paths made
//! absolute) and shown (no userinfo, no query), where the token may be sent
//! (the configured origin only, over https or to loopback), and the
//! [`Redactor`] that takes every secret out of libgit2's messages before
//! they go into an error.
//!
//! Pure text rules: it must never open a repository or touch the network,
//! and never return text that still holds the token or a URL's password.

use std::fmt;
use std::path::PathBuf;

use secrecy::SecretString;

use super::GitCause;

pub(super) const REDACTED: &str = "[redacted]";

/// Where the overlay comes from and where the mirror lives.
#[derive(Clone)]
pub struct OverlaySource {
    /// A URL (`https://…`, `file://…`) or a local filesystem path.
    pub repo: String,
    /// The release branch whose tip is the expected ref.
    pub branch: String,
    /// The bare mirror kept by the daemon.
    pub mirror_dir: PathBuf,
    /// Token for https remotes (from `OVERLAY_GIT_TOKEN`); never logged.
    pub token: Option<SecretString>,
}

// Hand-written so that `{:?}` of a config never prints the token or a
// password embedded in the URL.
impl fmt::Debug for OverlaySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OverlaySource")
            .field("repo", &display_repo(&self.repo))
            .field("branch", &self.branch)
            .field("mirror_dir", &self.mirror_dir)
            .field("token", &self.token)
            .finish()
    }
}

/// Why the token is not sent where libgit2 asks for credentials.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum TokenRefusal {
    /// The request goes to another scheme, host or port than configured.
    OtherServer { asked: String, configured: String },
    /// Plain `http` to a host off this machine would carry it in clear text.
    PlainHttp { host: String },
}

impl fmt::Display for TokenRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenRefusal::OtherServer { asked, configured } => write!(
                f,
                "the overlay remote redirected to {asked}, which asks for credentials; the token goes only to the configured remote {configured}"
            ),
            TokenRefusal::PlainHttp { host } => write!(
                f,
                "the overlay remote {host} asks for the token over plain http; use https (plain http is allowed only to loopback)"
            ),
        }
    }
}

/// The token goes only to the configured remote's own scheme, host and
/// port, and only over https (or plain http to loopback, for a local git
/// server). `asked` is the URL libgit2 is about to authenticate to.
pub(super) fn token_may_go_to(configured: &str, asked: &str) -> Result<(), TokenRefusal> {
    let origin = |u: &str| {
        url::Url::parse(u).ok().and_then(|u| {
            let host = u.host()?.to_owned();
            Some((u.scheme().to_owned(), host, u.port_or_known_default()))
        })
    };
    let shown = |o: &Option<(String, url::Host, Option<u16>)>, raw: &str| match o {
        Some((scheme, host, Some(port))) => format!("{scheme}://{host}:{port}"),
        Some((scheme, host, None)) => format!("{scheme}://{host}"),
        None => display_repo(raw),
    };
    let (want, got) = (origin(configured), origin(asked));
    if want.is_none() || want != got {
        return Err(TokenRefusal::OtherServer {
            asked: shown(&got, asked),
            configured: shown(&want, configured),
        });
    }
    match got {
        Some((scheme, host, _)) if scheme == "http" && !crate::http::is_loopback(&host) => {
            Err(TokenRefusal::PlainHttp {
                host: host.to_string(),
            })
        }
        _ => Ok(()),
    }
}

fn is_url(repo: &str) -> bool {
    repo.contains("://")
}

/// `user@host:path` (scp-like ssh syntax): a colon before any slash.
fn is_scp_like(repo: &str) -> bool {
    match (repo.find(':'), repo.find('/')) {
        (Some(colon), Some(slash)) => colon < slash && colon > 0,
        (Some(colon), None) => colon > 0,
        _ => false,
    }
}

/// A relative local path is made absolute, so the mirror's `origin` does not
/// depend on the daemon's working directory; URLs are kept as written.
pub(super) fn normalize_repo(repo: &str) -> String {
    if is_url(repo) || is_scp_like(repo) {
        return repo.to_owned();
    }
    match std::path::absolute(repo) {
        Ok(path) => path.to_str().map_or_else(|| repo.to_owned(), str::to_owned),
        Err(_) => repo.to_owned(),
    }
}

/// The filesystem path behind a local remote, if it is one.
pub(super) fn local_path(url: &str) -> Option<PathBuf> {
    if url.starts_with("file://") {
        return url::Url::parse(url).ok()?.to_file_path().ok();
    }
    (!is_url(url) && !is_scp_like(url)).then(|| PathBuf::from(url))
}

/// The repository as it may appear in logs and errors: no userinfo (which
/// may be a token), no query or fragment.
pub(super) fn display_repo(repo: &str) -> String {
    if is_url(repo) {
        if let Some(mut url) = url::Url::parse(repo).ok().filter(|u| !u.cannot_be_a_base()) {
            // Both setters only fail for URLs without a host, and those
            // (`file:///…`) carry no userinfo to hide.
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url.set_query(None);
            url.set_fragment(None);
            return url.to_string();
        }
        // Unparseable: hide whatever sits between the scheme and an `@`.
        return match (repo.find("://"), repo.rfind('@')) {
            (Some(scheme_end), Some(at)) if at > scheme_end => {
                format!("{}{REDACTED}{}", &repo[..scheme_end + 3], &repo[at..])
            }
            _ => repo.to_owned(),
        };
    }
    match repo.find('@') {
        // `user:password@host:path`
        Some(at) if is_scp_like(repo) && repo[..at].contains(':') => {
            format!("{REDACTED}{}", &repo[at..])
        }
        _ => repo.to_owned(),
    }
}

/// The (username, password) written into a URL or scp-like remote, found
/// by hand so that a URL the `url` crate rejects still has its secrets known.
fn userinfo(repo: &str) -> Option<(&str, Option<&str>)> {
    let userinfo = match repo.find("://") {
        Some(scheme_end) => {
            let rest = &repo[scheme_end + 3..];
            let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
            &authority[..authority.rfind('@')?]
        }
        None if is_scp_like(repo) => &repo[..repo.find('@')?],
        None => return None,
    };
    Some(match userinfo.split_once(':') {
        Some((username, password)) => (username, Some(password)),
        None => (userinfo, None),
    })
}

/// Removes secrets from text that libgit2 produced (it may quote the URL).
pub(super) struct Redactor {
    /// (needle, replacement), longest needle first so a URL is replaced
    /// before the password inside it.
    replacements: Vec<(String, String)>,
}

impl Redactor {
    pub(super) fn new(repos: &[&str], token: Option<&str>) -> Redactor {
        let mut replacements: Vec<(String, String)> = Vec::new();
        let mut secret = |s: &str| {
            if !s.is_empty() {
                replacements.push((s.to_owned(), REDACTED.to_owned()));
                let decoded = percent_decode(s);
                if decoded != s {
                    replacements.push((decoded, REDACTED.to_owned()));
                }
            }
        };
        if let Some(token) = token {
            secret(token);
        }
        for repo in repos {
            if let Some((username, password)) = userinfo(repo) {
                if let Some(password) = password {
                    secret(password);
                }
                // A token is often given as the username alone
                // (`https://TOKEN@host/…`); short names like `git` are not.
                if username.len() >= 8 {
                    secret(username);
                }
            }
        }
        for repo in repos {
            let shown = display_repo(repo);
            if shown != *repo {
                replacements.push(((*repo).to_owned(), shown));
            }
        }
        replacements.sort_by_key(|(needle, _)| std::cmp::Reverse(needle.len()));
        Redactor { replacements }
    }

    fn redact(&self, text: &str) -> String {
        let mut text = text.to_owned();
        for (needle, replacement) in &self.replacements {
            if text.contains(needle.as_str()) {
                text = text.replace(needle.as_str(), replacement);
            }
        }
        text
    }

    pub(super) fn cause(&self, e: &git2::Error) -> GitCause {
        GitCause {
            code: e.code(),
            class: e.class(),
            message: self.redact(e.message()),
        }
    }
}

/// `%40` → `@`: libgit2 may print the decoded form of a URL's password.
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_of_source_hides_token_and_password() {
        let source = OverlaySource {
            repo: "https://user:hunter2pw@example.com/acme/overlay.git".into(),
            branch: "release".into(),
            mirror_dir: PathBuf::from("/data/overlay.git"),
            token: Some("ghp_secret_token".into()),
        };
        let shown = format!("{source:?}");
        assert!(!shown.contains("ghp_secret_token"), "{shown}");
        assert!(!shown.contains("hunter2pw"), "{shown}");
        assert!(shown.contains("example.com/acme/overlay.git"), "{shown}");
    }

    #[test]
    fn the_token_goes_only_to_the_configured_origin_over_https() {
        let ok = |configured: &str, asked: &str| token_may_go_to(configured, asked).is_ok();
        assert!(ok(
            "https://git.example.com/org/overlay.git",
            "https://git.example.com/org/overlay.git/info/refs?service=git-upload-pack"
        ));
        assert!(ok(
            "https://git.example.com/o.git",
            "https://GIT.example.com:443/o.git"
        ));
        assert!(ok("http://127.0.0.1:9418/o.git", "http://127.0.0.1:9418/o"));
        assert!(ok("http://localhost:80/o.git", "http://localhost/o.git"));
        assert!(ok("http://[::1]:8080/o.git", "http://[::1]:8080/x"));
        // Another host, port or scheme: a redirect.
        assert!(!ok(
            "https://git.example.com/o.git",
            "https://evil.example/o.git"
        ));
        assert!(!ok(
            "https://git.example.com/o.git",
            "https://git.example.com:8443/o.git"
        ));
        assert!(!ok(
            "https://git.example.com/o.git",
            "http://git.example.com/o.git"
        ));
        assert!(!ok("http://127.0.0.1:1/o.git", "http://127.0.0.1:2/o.git"));
        assert!(!ok("https://git.example.com/o.git", "not a url"));
        // Plain http off this machine: never, even to the configured host.
        assert_eq!(
            token_may_go_to(
                "http://git.example.com/o.git",
                "http://git.example.com/o.git"
            ),
            Err(TokenRefusal::PlainHttp {
                host: "git.example.com".into()
            })
        );
    }

    #[test]
    fn display_repo_strips_userinfo_and_query() {
        assert_eq!(
            display_repo("https://x-access-token:abc123@github.com/acme/o.git?t=1"),
            "https://github.com/acme/o.git"
        );
        assert_eq!(
            display_repo("https://ghp_abcdefgh@github.com/acme/o.git"),
            "https://github.com/acme/o.git"
        );
        assert_eq!(
            display_repo("user:pw@host:acme/o.git"),
            "[redacted]@host:acme/o.git"
        );
        assert_eq!(display_repo("git@host:acme/o.git"), "git@host:acme/o.git");
        assert_eq!(display_repo("/srv/overlay"), "/srv/overlay");
        assert_eq!(display_repo("file:///srv/overlay"), "file:///srv/overlay");
    }

    #[test]
    fn redactor_removes_token_password_and_raw_url() {
        let raw = "https://bob:p%40ss%2Fword@example.com/o.git";
        let redactor = Redactor::new(&[raw], Some("tok-123456"));
        let text = format!("failed {raw} with p@ss/word and tok-123456 and p%40ss%2Fword");
        let clean = redactor.redact(&text);
        assert!(!clean.contains("p@ss/word"), "{clean}");
        assert!(!clean.contains("p%40ss%2Fword"), "{clean}");
        assert!(!clean.contains("tok-123456"), "{clean}");
        assert!(clean.contains("https://example.com/o.git"), "{clean}");
    }

    #[test]
    fn redactor_finds_secrets_in_urls_the_url_crate_rejects() {
        let raw = "https://bob:SECRET-pw@127.0.0.1:99999/o.git";
        let redactor = Redactor::new(&[raw], None);
        let clean = redactor.redact("malformed URL 'bob:SECRET-pw@127.0.0.1:99999'");
        assert!(!clean.contains("SECRET"), "{clean}");
        let scp = Redactor::new(&["deploy:SECRET-pw@host:acme/o.git"], None);
        assert!(!scp.redact("auth SECRET-pw failed").contains("SECRET"));
        let user_token = Redactor::new(&["https://ghp_SECRETTOKEN@github.com/o.git"], None);
        assert!(!user_token.redact("user ghp_SECRETTOKEN").contains("SECRET"));
        assert_eq!(userinfo("https://github.com/a@b/o.git"), None);
        assert_eq!(userinfo("/srv/o"), None);
    }

    #[test]
    fn normalize_repo_makes_relative_paths_absolute_and_keeps_urls() {
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(
            normalize_repo("fixtures/overlay"),
            cwd.join("fixtures/overlay").to_str().expect("utf-8 cwd")
        );
        assert_eq!(normalize_repo("/srv/overlay"), "/srv/overlay");
        for url in [
            "https://github.com/acme/o.git",
            "file:///srv/overlay",
            "git@github.com:acme/o.git",
        ] {
            assert_eq!(normalize_repo(url), url);
        }
    }

    #[test]
    fn local_path_recognises_paths_and_file_urls_only() {
        assert_eq!(local_path("/srv/o"), Some(PathBuf::from("/srv/o")));
        assert_eq!(local_path("file:///srv/o"), Some(PathBuf::from("/srv/o")));
        assert_eq!(local_path("https://h/o.git"), None);
        assert_eq!(local_path("git@h:o.git"), None);
    }
}

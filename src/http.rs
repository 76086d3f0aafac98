//! Small helpers shared by the outbound HTTP clients (Fly API, agent probes).
//!
//! Owns how we name ourselves, that no client goes through an environment
//! proxy, which hosts count as loopback (where plain http may carry a
//! secret), and how a transport failure is described. It
//! must never put a URL in a description: the caller says which machine or
//! app it was talking to, and URLs may carry what logs should not.

/// `User-Agent` of every request the daemon makes.
pub const USER_AGENT: &str = concat!("fleet-reconciler/", env!("CARGO_PKG_VERSION"));

/// The builder every outbound client starts from: our user agent, and no
/// proxy. reqwest would otherwise honour `HTTP(S)_PROXY`/`ALL_PROXY` from the
/// environment and hand the Fly token, agent tokens and webhook URLs to
/// whatever proxy it names.
pub fn client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder().user_agent(USER_AGENT).no_proxy()
}

/// Whether a URL's host is this machine (`localhost`, 127.0.0.0/8, `::1`):
/// the one place plain http may carry a secret.
pub fn is_loopback<S: AsRef<str>>(host: &url::Host<S>) -> bool {
    match host {
        url::Host::Domain(d) => d.as_ref().eq_ignore_ascii_case("localhost"),
        url::Host::Ipv4(ip) => ip.is_loopback(),
        url::Host::Ipv6(ip) => ip.is_loopback(),
    }
}

/// A transport failure and its causes, without the URL reqwest would print.
pub fn describe(e: &reqwest::Error) -> String {
    let mut msg = String::from(if e.is_timeout() {
        "request timed out"
    } else if e.is_connect() {
        "connection failed"
    } else if e.is_body() || e.is_decode() {
        "error reading the response body"
    } else {
        "request failed"
    });
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

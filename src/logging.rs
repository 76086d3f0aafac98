//! The process log's line discipline: one event, one line; and its filter.
//!
//! Owns the writer the log subscriber writes each formatted event through,
//! and reading `RUST_LOG` ([`filter`]): a filter that does not parse is an
//! error naming the directive, never a silent fallback to the default.
//! Log fields carry text from outside (agents' reports, Fly metadata such as
//! markers and holds, git servers' messages); a carriage return or newline in
//! one could forge a log line, and terminal control sequences could rewrite
//! an operator's screen. The formatter escapes some of these in field values;
//! this writer makes it a guarantee for every byte it writes. It must never
//! drop or reorder what it is given, only escape it.

use std::io::{self, Write};

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// The filter when `RUST_LOG` is unset or empty.
pub const DEFAULT_FILTER: &str = "warn,fleet_reconciler=info";

/// A `RUST_LOG` that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("RUST_LOG={value:?} is not a valid log filter: {reason} (e.g. RUST_LOG={DEFAULT_FILTER})")]
pub struct FilterError {
    pub value: String,
    pub reason: String,
}

/// The log filter from `RUST_LOG`'s value: the default when it is unset or
/// blank, else the directives it gives, every one of which must parse.
pub fn filter(rust_log: Option<&str>) -> Result<EnvFilter, FilterError> {
    let value = rust_log.map(str::trim).filter(|v| !v.is_empty());
    EnvFilter::builder()
        .parse(value.unwrap_or(DEFAULT_FILTER))
        .map_err(|e| FilterError {
            value: value.unwrap_or_default().to_string(),
            reason: e.to_string(),
        })
}

/// Makes [`Escaping`] writers over stderr.
#[derive(Clone, Copy, Debug)]
pub struct EscapedStderr {
    /// Keep ESC, for colour codes on a terminal (the formatter escapes ESC
    /// inside field values itself when colours are on).
    pub keep_ansi: bool,
}

impl<'a> MakeWriter<'a> for EscapedStderr {
    type Writer = Escaping<io::Stderr>;

    fn make_writer(&'a self) -> Self::Writer {
        Escaping {
            inner: io::stderr(),
            keep_ansi: self.keep_ansi,
        }
    }
}

/// Writes each buffer (the formatter hands over one whole event per write)
/// with its control characters escaped, except the newline that ends it.
#[derive(Debug)]
pub struct Escaping<W> {
    pub inner: W,
    pub keep_ansi: bool,
}

impl<W: Write> Write for Escaping<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_all(buf)?;
        Ok(buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.inner.write_all(&escape_event(buf, self.keep_ansi))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// `buf` with every C0 control byte, DEL and C1 control character written
/// as `\xNN` / `\u{NN}`, except tab and a final newline.
pub fn escape_event(buf: &[u8], keep_ansi: bool) -> Vec<u8> {
    let (body, end) = match buf.strip_suffix(b"\n") {
        Some(body) => (body, &b"\n"[..]),
        None => (buf, &b""[..]),
    };
    let mut out = Vec::with_capacity(buf.len());
    let mut i = 0;
    while i < body.len() {
        let b = body[i];
        match b {
            b'\t' => out.push(b),
            0x1b if keep_ansi => out.push(b),
            0x00..=0x1f | 0x7f => {
                let _ = write!(out, "\\x{b:02x}");
            }
            // U+0080..U+009F in UTF-8: 0xC2 followed by 0x80..0x9F.
            0xc2 if body.get(i + 1).is_some_and(|n| (0x80..=0x9f).contains(n)) => {
                let _ = write!(out, "\\u{{{:x}}}", body[i + 1]);
                i += 1;
            }
            _ => out.push(b),
        }
        i += 1;
    }
    out.extend_from_slice(end);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn escaped(s: &str) -> String {
        String::from_utf8(escape_event(s.as_bytes(), false)).unwrap_or_default()
    }

    #[test]
    fn one_event_stays_one_line() {
        assert_eq!(
            escaped("a reason=\"x\r\n2026-01-01T00:00:00Z ERROR forged\"\n"),
            "a reason=\"x\\x0d\\x0a2026-01-01T00:00:00Z ERROR forged\"\n"
        );
        assert_eq!(
            escaped("bell\x07 esc\x1b[2J del\x7f\n"),
            "bell\\x07 esc\\x1b[2J del\\x7f\n"
        );
        assert_eq!(
            escaped("c1 \u{9b}31m é ok\tkept\n"),
            "c1 \\u{9b}31m é ok\tkept\n"
        );
        assert_eq!(escaped("no newline"), "no newline");
        assert_eq!(escaped("two\n\n"), "two\\x0a\n");
    }

    #[test]
    fn a_malformed_filter_is_an_error_not_the_default() {
        assert!(filter(None).is_ok());
        assert!(filter(Some("  ")).is_ok());
        assert!(filter(Some("debug,hyper=warn")).is_ok());
        for bad in ["fleet_reconciler=loud", "warn,[", "=info"] {
            let e = filter(Some(bad)).err().map(|e| e.to_string());
            let e = e.unwrap_or_else(|| panic!("{bad:?} was accepted"));
            assert!(
                e.starts_with(&format!("RUST_LOG={bad:?} is not a valid log filter")),
                "{e}"
            );
        }
    }

    #[test]
    fn colours_survive_on_a_terminal() {
        let out = escape_event(b"\x1b[32mINFO\x1b[0m x\ry\n", true);
        assert_eq!(out, b"\x1b[32mINFO\x1b[0m x\\x0dy\n");
    }

    #[test]
    fn the_writer_passes_every_byte_through_escaped() {
        let mut w = Escaping {
            inner: Vec::new(),
            keep_ansi: false,
        };
        w.write_all(b"one\rtwo\n").unwrap();
        w.write_all(b"three\n").unwrap();
        assert_eq!(w.inner, b"one\\x0dtwo\nthree\n");
    }
}

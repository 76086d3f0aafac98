//! Text that came from outside the process (agent reports, machine
//! metadata, Fly error bodies, config values): how long it may grow, and one
//! way to decode a JSON value someone else wrote.
//!
//! Owns the bounds every stage applies before such text reaches a report, a
//! log line or an error. It must never hold state or do I/O; it is
//! vocabulary, named by observe, metadata, config and the Fly client alike.

/// Longest `detail` kept from an agent's answer: a parse error may quote the
/// agent's whole bad value, and 10,000 machines × 60 KB is a report nobody
/// can hold or read.
pub const MAX_DETAIL_CHARS: usize = 256;
/// Longest rotation tag accepted in a report (ours are about 40 characters).
pub const MAX_TAG_CHARS: usize = 128;

/// `s` cut to `max` characters, an ellipsis marking the cut.
pub fn bounded(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        None => s.to_string(),
        Some((end, _)) => format!("{}…", &s[..end]),
    }
}

/// A serde error with the path of the field at fault (`what` names the
/// whole value when the fault is at its root).
pub(crate) fn json_error(e: serde_path_to_error::Error<serde_json::Error>, what: &str) -> String {
    let path = e.path().to_string();
    let inner = e.into_inner();
    if path == "." {
        format!("not a JSON {what}: {inner}")
    } else {
        format!("field `{path}`: {inner}")
    }
}

/// Decodes a JSON value someone else may have written (machine metadata),
/// naming the field at fault when it is not a `T`; the error is bounded to
/// [`MAX_DETAIL_CHARS`].
pub(crate) fn decode_json<T: serde::de::DeserializeOwned>(value: &str) -> Result<T, String> {
    let mut de = serde_json::Deserializer::from_str(value);
    let decoded = serde_path_to_error::deserialize(&mut de)
        .map_err(|e| bounded(&json_error(e, "value"), MAX_DETAIL_CHARS))?;
    de.end()
        .map_err(|_| "trailing data after the JSON value".to_string())?;
    Ok(decoded)
}

//! Sealed records: the HMAC-SHA256 envelope that makes a metadata value the
//! daemon (or an operator) wrote one an agent cannot forge.
//!
//! Any root process in an agent machine can read and write the metadata of
//! every machine of its app through `/.fly/api`, with no token
//! (docs/safety.md, "Threat model"). So every record the daemon relies on
//! later is kept as one metadata value
//! `{"sealed":1,"kid":"<key id>","mac":"<hex>","body":"<record text>"}`
//! whose MAC covers a domain tag, the machine id, the metadata key and the
//! body's exact bytes: a sealed value cannot be altered, nor moved to another
//! machine or key. (It can be replayed on the same machine and key: what a
//! replay gains nothing is argued per record in docs/safety.md.)
//!
//! Owns the record key (`[records] key_env`, optional `previous_key_env`),
//! sealing with the current key and opening with the current or previous
//! one, in constant time. It must never do I/O nor read the environment (the
//! binary's edge reads the variables), and a key never reaches `Debug`, a
//! log or a payload: only its [`KeyId`] is shown.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use secrecy::{ExposeSecret, SecretSlice};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// What the MAC input starts with: a record of this scheme, version 1.
const DOMAIN: &[u8] = b"fleet-reconciler/sealed-record/v1";
/// The envelope version this reconciler writes and reads.
pub const SEALED_VERSION: u32 = 1;
/// Shortest record key accepted, in bytes (hex digits / 2).
pub const MIN_KEY_BYTES: usize = 32;

/// Which key sealed a record: the first 8 hex digits of the SHA-256 of the
/// key, so a rotation needs no extra configuration and a record names its key
/// without revealing it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KeyId(String);

impl KeyId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One record key: its id and the HMAC keyed with it (the key's bytes are
/// not kept; `Debug` shows the id only).
#[derive(Clone)]
pub struct RecordKey {
    id: KeyId,
    keyed: Arc<HmacSha256>,
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordKey({})", self.id)
    }
}

/// Why a record key's text is not a key (the variable is named by the caller).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("is not hex (make one with `openssl rand -hex 32`)")]
    NotHex,
    #[error(
        "is {0} bytes; a record key is at least {MIN_KEY_BYTES} bytes (64 hex digits; make one with `openssl rand -hex 32`)"
    )]
    TooShort(usize),
}

impl RecordKey {
    /// A key from its hex text (surrounding blanks ignored).
    pub fn from_hex(text: &str) -> Result<RecordKey, KeyError> {
        let bytes = hex::decode(text.trim()).map_err(|_| KeyError::NotHex)?;
        if bytes.len() < MIN_KEY_BYTES {
            return Err(KeyError::TooShort(bytes.len()));
        }
        let bytes = SecretSlice::from(bytes);
        let digest = Sha256::digest(bytes.expose_secret());
        let id = KeyId(hex::encode(digest.get(..4).unwrap_or_default()));
        // HMAC accepts a key of any length: this never fails.
        let keyed = HmacSha256::new_from_slice(bytes.expose_secret())
            .map_err(|_| KeyError::TooShort(bytes.expose_secret().len()))?;
        Ok(RecordKey {
            id,
            keyed: Arc::new(keyed),
        })
    }

    pub fn id(&self) -> &KeyId {
        &self.id
    }

    fn mac(&self, machine_id: &str, key_name: &str, body: &str) -> HmacSha256 {
        let mut mac = HmacSha256::clone(&self.keyed);
        // Each part length-prefixed: no two (machine, key, body) share an input.
        for part in [
            DOMAIN,
            machine_id.as_bytes(),
            key_name.as_bytes(),
            body.as_bytes(),
        ] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        mac
    }
}

/// The keys this daemon (or operator) holds: the current one seals and
/// verifies, the previous one (during a rotation) only verifies.
#[derive(Clone, Debug)]
pub struct RecordKeys {
    pub current: RecordKey,
    pub previous: Option<RecordKey>,
}

impl RecordKeys {
    pub fn new(current: RecordKey) -> RecordKeys {
        RecordKeys {
            current,
            previous: None,
        }
    }

    /// `value` is the metadata value of `key_name` on `machine_id`: `body`
    /// sealed with the current key.
    pub fn seal(&self, machine_id: &str, key_name: &str, body: &str) -> String {
        let mac = self.current.mac(machine_id, key_name, body).finalize();
        let envelope = Envelope {
            sealed: SEALED_VERSION,
            kid: self.current.id.clone(),
            mac: hex::encode(mac.into_bytes()),
            body: body.to_string(),
        };
        // Strings and a number always serialize.
        serde_json::to_string(&envelope).unwrap_or_default()
    }

    /// What the metadata value of `key_name` on `machine_id` is: a record
    /// sealed by one of these keys (its body), a value that is no envelope
    /// (unsigned: written before sealing existed, or by anyone), or an
    /// envelope that does not verify (forged, altered, moved, or sealed by
    /// a key this daemon no longer holds).
    pub fn open<'v>(&self, machine_id: &str, key_name: &str, value: &'v str) -> Opened<'v> {
        let envelope = match Envelope::read(value) {
            Read::NotAnEnvelope => return Opened::Unsigned(value),
            Read::Malformed(why) => return Opened::Forged(Forgery::Malformed(why)),
            Read::Envelope(e) => e,
        };
        let Ok(mac) = hex::decode(&envelope.mac) else {
            return Opened::Forged(Forgery::Malformed("field `mac`: not hex".into()));
        };
        let key = [Some(&self.current), self.previous.as_ref()]
            .into_iter()
            .flatten()
            .find(|k| k.id == envelope.kid);
        let Some(key) = key else {
            return Opened::Forged(Forgery::UnknownKey(envelope.kid));
        };
        // Constant time: `verify_slice` compares without early exit.
        match key
            .mac(machine_id, key_name, &envelope.body)
            .verify_slice(&mac)
        {
            Ok(()) => Opened::Sealed {
                by_previous: key.id != self.current.id,
                body: envelope.body,
            },
            Err(_) => Opened::Forged(Forgery::BadMac(envelope.kid)),
        }
    }
}

/// A sealed value's body, unverified (for readers without a key, which act
/// on nothing); `None` when the value is no well-formed envelope.
pub fn body_unverified(value: &str) -> Option<String> {
    match Envelope::read(value) {
        Read::Envelope(e) => Some(e.body),
        _ => None,
    }
}

/// A metadata value, opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Opened<'v> {
    /// Sealed by one of our keys for this machine and key: the record's text.
    Sealed { body: String, by_previous: bool },
    /// No envelope at all: the value as written.
    Unsigned(&'v str),
    /// An envelope that does not verify.
    Forged(Forgery),
}

/// Why an envelope does not verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Forgery {
    /// Not the envelope's shape (the field at fault).
    Malformed(String),
    /// Names a key this daemon does not hold (forged, or sealed by a key
    /// already dropped from `previous_key_env`).
    UnknownKey(KeyId),
    /// The MAC does not match: altered, or moved from another machine or key.
    BadMac(KeyId),
}

impl fmt::Display for Forgery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Forgery::Malformed(why) => write!(f, "a malformed sealed envelope ({why})"),
            Forgery::UnknownKey(kid) => write!(
                f,
                "a value sealed by key id {kid}, which this reconciler does not hold"
            ),
            Forgery::BadMac(kid) => write!(
                f,
                "a value whose MAC (key id {kid}) does not verify: altered, or copied from another machine or key"
            ),
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    sealed: u32,
    kid: KeyId,
    mac: String,
    body: String,
}

enum Read {
    NotAnEnvelope,
    Malformed(String),
    Envelope(Envelope),
}

/// Longest key id an envelope may name (ours are 8 characters).
const MAX_KID_CHARS: usize = 64;

impl Envelope {
    /// An envelope is a JSON object with a `sealed` field; any other value
    /// is no envelope at all.
    fn read(value: &str) -> Read {
        let Ok(serde_json::Value::Object(object)) = serde_json::from_str(value) else {
            return Read::NotAnEnvelope;
        };
        if !object.contains_key("sealed") {
            return Read::NotAnEnvelope;
        }
        match crate::text::decode_json::<Envelope>(value) {
            Ok(e) if e.sealed != SEALED_VERSION => {
                Read::Malformed(format!("field `sealed`: version {}", e.sealed))
            }
            Ok(e) if e.kid.0.chars().count() > MAX_KID_CHARS => {
                Read::Malformed("field `kid`: too long".into())
            }
            Ok(e) => Read::Envelope(e),
            Err(why) => Read::Malformed(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> RecordKey {
        RecordKey::from_hex(&hex::encode([byte; 32])).expect("a key")
    }

    const BODY: &str = r#"{"tag":"t","phase":"draining"}"#;

    #[test]
    fn a_sealed_record_opens_only_on_its_machine_and_key() {
        let keys = RecordKeys::new(key(1));
        let value = keys.seal("m1", "fleet_reconciler_rotation", BODY);
        assert_eq!(
            keys.open("m1", "fleet_reconciler_rotation", &value),
            Opened::Sealed {
                body: BODY.into(),
                by_previous: false
            }
        );
        // Moved to another machine, or to another key: does not verify.
        for (m, k) in [
            ("m2", "fleet_reconciler_rotation"),
            ("m1", "fleet_reconciler_unprobed"),
        ] {
            assert!(
                matches!(keys.open(m, k, &value), Opened::Forged(Forgery::BadMac(_))),
                "{m} {k}"
            );
        }
        // Another key's seal: unknown key id.
        let other = RecordKeys::new(key(2));
        assert!(matches!(
            other.open("m1", "fleet_reconciler_rotation", &value),
            Opened::Forged(Forgery::UnknownKey(_))
        ));
    }

    #[test]
    fn any_altered_byte_of_the_body_or_mac_fails() {
        let keys = RecordKeys::new(key(1));
        let value = keys.seal("m1", "k", BODY);
        let altered_body = value.replace("draining", "restarting");
        assert_ne!(altered_body, value);
        assert!(matches!(
            keys.open("m1", "k", &altered_body),
            Opened::Forged(Forgery::BadMac(_))
        ));
        let envelope: serde_json::Value = serde_json::from_str(&value).unwrap();
        let mac = envelope["mac"].as_str().unwrap().to_string();
        let flipped = format!(
            "{}{}",
            if mac.starts_with('0') { "1" } else { "0" },
            &mac[1..]
        );
        let altered_mac = value.replace(&mac, &flipped);
        assert!(matches!(
            keys.open("m1", "k", &altered_mac),
            Opened::Forged(Forgery::BadMac(_))
        ));
        let extra = value.replacen('{', r#"{"x":1,"#, 1);
        assert!(matches!(
            keys.open("m1", "k", &extra),
            Opened::Forged(Forgery::Malformed(_))
        ));
        assert!(matches!(
            keys.open("m1", "k", r#"{"sealed":2}"#),
            Opened::Forged(Forgery::Malformed(_))
        ));
    }

    #[test]
    fn the_previous_key_verifies_and_only_the_current_one_seals() {
        let old = RecordKeys::new(key(1));
        let value = old.seal("m1", "k", BODY);
        let rotated = RecordKeys {
            current: key(2),
            previous: Some(key(1)),
        };
        assert_eq!(
            rotated.open("m1", "k", &value),
            Opened::Sealed {
                body: BODY.into(),
                by_previous: true
            }
        );
        let resealed = rotated.seal("m1", "k", BODY);
        assert!(resealed.contains(&format!("\"kid\":\"{}\"", key(2).id())));
        assert!(matches!(
            old.open("m1", "k", &resealed),
            Opened::Forged(Forgery::UnknownKey(_))
        ));
    }

    #[test]
    fn a_value_without_an_envelope_is_unsigned() {
        let keys = RecordKeys::new(key(1));
        for v in [BODY, "ops says wait", "", "[1]", r#"{"tag":"t"}"#] {
            assert_eq!(keys.open("m1", "k", v), Opened::Unsigned(v));
        }
    }

    #[test]
    fn keys_are_hex_of_at_least_32_bytes_and_never_shown() {
        assert_eq!(RecordKey::from_hex("zz").map(|_| ()), Err(KeyError::NotHex));
        assert_eq!(
            RecordKey::from_hex(&"ab".repeat(16)).map(|_| ()),
            Err(KeyError::TooShort(16))
        );
        let text = "ab".repeat(32);
        let k = RecordKey::from_hex(&format!(" {text}\n")).expect("blanks ignored");
        assert_eq!(k.id().as_str().len(), 8);
        let shown = format!("{:?}", RecordKeys::new(k));
        assert!(!shown.contains(&text) && !shown.contains("abab"), "{shown}");
    }
}

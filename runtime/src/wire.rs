//! The wire codec: msgpack of typed structs (rmp-serde), with size limits checked before
//! decoding, and a text token form for shipping descriptions through argv or environment.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// Largest control message accepted by default (weights never travel in control messages).
pub const MAX_CONTROL_MESSAGE: usize = 16 * 1024 * 1024;

/// Encodes a value as named msgpack (fields by name, so added fields stay compatible).
///
/// # Errors
/// [`Error::Wire`] if the value cannot be encoded.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>> {
    rmp_serde::to_vec_named(value).map_err(|e| Error::Wire(format!("encode: {e}")))
}

/// Decodes a value, refusing inputs longer than `max` before touching them.
///
/// # Errors
/// [`Error::Wire`] if too long or malformed.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], max: usize) -> Result<T> {
    if bytes.len() > max {
        return Err(Error::Wire(format!(
            "message of {} bytes exceeds the {max}-byte limit",
            bytes.len()
        )));
    }
    rmp_serde::from_slice(bytes).map_err(|e| Error::Wire(format!("decode: {e}")))
}

/// The `protocol` field of a message [`encode`] wrote from a struct that has one, read
/// without the rest of the message: a handshake reads it first, so that a peer of another
/// version is refused naming both versions (see [`Error::Protocol`]) rather than failing
/// on a field it does not know. 0 when the message has no such field (a peer from before
/// protocol versions).
///
/// # Errors
/// [`Error::Wire`] if too long or not a msgpack map.
pub fn peek_protocol(bytes: &[u8], max: usize) -> Result<u32> {
    #[derive(serde::Deserialize)]
    struct Versioned {
        #[serde(default)]
        protocol: u32,
    }
    Ok(decode::<Versioned>(bytes, max)?.protocol)
}

/// Encodes a value as a hex token (msgpack inside), for argv or environment variables.
///
/// # Errors
/// [`Error::Wire`] if the value cannot be encoded.
pub fn to_token<T: Serialize + ?Sized>(value: &T) -> Result<String> {
    let bytes = encode(value)?;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        s.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
    }
    Ok(s)
}

/// Decodes a token written by [`to_token`]; errors call it "the text" (see [`from_text`] to
/// name what it should be).
///
/// # Errors
/// As [`from_text`].
pub fn from_token<T: DeserializeOwned>(token: &str) -> Result<T> {
    from_text(token, "the text")
}

/// Decodes a token written by [`to_token`], calling it `what` in errors (`"receiver spec"`:
/// a user who pasted the wrong line reads what was expected, not the word "token", which
/// they take for the cluster token).
///
/// # Errors
/// [`Error::Wire`] naming `what` on bad hex, an odd or oversized length or a malformed
/// message.
pub fn from_text<T: DeserializeOwned>(text: &str, what: &str) -> Result<T> {
    let t = text.trim().as_bytes();
    if t.is_empty() {
        return Err(Error::Wire(format!("{what} is empty")));
    }
    if t.len() / 2 > MAX_CONTROL_MESSAGE {
        return Err(Error::Wire(format!(
            "{what} is too long ({} characters; at most {})",
            t.len(),
            2 * MAX_CONTROL_MESSAGE
        )));
    }
    if let Some(&c) = t.iter().find(|c| !matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        let shown = if c.is_ascii_graphic() {
            format!("`{}`", char::from(c))
        } else {
            format!("the byte {c:#04x}")
        };
        return Err(Error::Wire(format!(
            "{what} is not Refit's hex text: it holds {shown}"
        )));
    }
    if !t.len().is_multiple_of(2) {
        return Err(Error::Wire(format!(
            "{what} is cut short: an odd number of hex digits ({})",
            t.len()
        )));
    }
    let nib = |c: u8| {
        if c.is_ascii_digit() {
            c - b'0'
        } else {
            c - b'a' + 10
        }
    };
    let bytes: Vec<u8> = t
        .chunks_exact(2)
        .map(|p| nib(p[0]) << 4 | nib(p[1]))
        .collect();
    decode(&bytes, MAX_CONTROL_MESSAGE).map_err(|e| match e {
        Error::Wire(reason) => Error::Wire(format!(
            "{what} does not decode: {}",
            reason.strip_prefix("decode: ").unwrap_or(&reason)
        )),
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Msg {
        id: uuid::Uuid,
        n: u64,
        #[serde(with = "serde_bytes")]
        blob: Vec<u8>,
    }

    #[test]
    fn tokens_round_trip_and_refuse_garbage() {
        let m = Msg {
            id: uuid::Uuid::new_v4(),
            n: 7,
            blob: vec![1, 2, 255],
        };
        let t = to_token(&m).unwrap();
        assert_eq!(from_token::<Msg>(&t).unwrap(), m);
        assert!(from_token::<Msg>("zz").is_err());
        assert!(from_token::<Msg>("abc").is_err());
        assert!(from_token::<Msg>("00").is_err());
        // errors name what was being decoded, never "token"
        for (text, says) in [
            (
                "127.0.0.1:29611",
                "receiver spec is not Refit's hex text: it holds `.`",
            ),
            (
                "abc",
                "receiver spec is cut short: an odd number of hex digits (3)",
            ),
            ("", "receiver spec is empty"),
            ("00", "receiver spec does not decode"),
        ] {
            let e = from_text::<Msg>(text, "receiver spec")
                .unwrap_err()
                .to_string();
            assert!(e.contains(says) && !e.contains("token"), "{text}: {e}");
        }
        assert!(
            decode::<Msg>(&encode(&m).unwrap(), 3)
                .unwrap_err()
                .to_string()
                .contains("limit")
        );
    }

    #[test]
    fn the_protocol_field_is_read_alone() {
        #[derive(Serialize)]
        struct Hello {
            protocol: u32,
            name: String,
        }
        let v7 = encode(&Hello {
            protocol: 7,
            name: "x".into(),
        })
        .unwrap();
        assert_eq!(peek_protocol(&v7, 4096).unwrap(), 7);
        // a message from before protocol versions reads as 0
        let old = encode(&Msg {
            id: uuid::Uuid::new_v4(),
            n: 1,
            blob: vec![],
        })
        .unwrap();
        assert_eq!(peek_protocol(&old, 4096).unwrap(), 0);
        let e = Error::check_protocol("peer x", "node", 1, 7).unwrap_err();
        assert_eq!(
            e.to_string(),
            "peer x speaks node protocol version 7, this process speaks version 1: run the \
             same Refit release at both ends"
        );
        assert!(Error::check_protocol("peer x", "node", 1, 1).is_ok());
    }
}

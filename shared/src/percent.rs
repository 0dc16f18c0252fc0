//! Percent-decoding (`%XX` escapes), as URLs' user info and the OpenTelemetry variables'
//! `key=value` lists use it.

/// `s` with its `%XX` escapes decoded; `None` for an escape that is not two hex digits or a
/// result that is not UTF-8.
pub fn decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            // `get`, not indexing: the two characters after `%` may not be ASCII.
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::decode;

    #[test]
    fn escapes_are_decoded_and_bad_ones_refused() {
        assert_eq!(decode("p%40ss%3Aw%2Fd").as_deref(), Some("p@ss:w/d"));
        assert_eq!(decode("caf%C3%A9").as_deref(), Some("café"));
        assert_eq!(decode("plain").as_deref(), Some("plain"));
        for bad in ["%", "%4", "%zz", "%é1", "%ff"] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}

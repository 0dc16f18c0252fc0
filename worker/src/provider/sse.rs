//! Server-sent events, as the model APIs stream their answers (`text/event-stream`).
//!
//! [`SseParser`] takes the body's bytes as they arrive, in chunks cut anywhere (inside a
//! line, inside a UTF-8 character), and gives back the complete events: their `event:`
//! name (empty when none) and their `data:` lines joined by `\n`. Lines end with `\n`,
//! `\r\n` or `\r`; an event ends at a blank line; comments (`:`) and other fields (`id:`,
//! `retry:`) are skipped.

/// One event of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field; empty when the event had none (OpenAI's chunks).
    pub name: String,
    pub data: String,
}

/// Cuts a byte stream into [`SseEvent`]s.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the line being read.
    line: Vec<u8>,
    /// A `\r` ended the last line: a `\n` right after it belongs to it.
    after_cr: bool,
    name: String,
    data: String,
    /// The event being read has a `data:` line.
    has_data: bool,
}

impl SseParser {
    /// The events `chunk` completes.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for &b in chunk {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\n' => self.end_line(&mut out),
                b'\r' => {
                    self.after_cr = true;
                    self.end_line(&mut out);
                }
                _ => self.line.push(b),
            }
        }
        out
    }

    /// Bytes held for the event being read (its line and data so far).
    pub fn pending_bytes(&self) -> usize {
        self.line.len() + self.data.len()
    }

    /// The event still open when the stream ended without its blank line.
    pub fn finish(&mut self) -> Option<SseEvent> {
        if !self.line.is_empty() {
            let mut out = Vec::new();
            self.end_line(&mut out);
        }
        self.take_event()
    }

    fn end_line(&mut self, out: &mut Vec<SseEvent>) {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            out.extend(self.take_event());
            return;
        }
        let line = String::from_utf8_lossy(&line);
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_ref(), ""),
        };
        match field {
            "event" => self.name = value.to_string(),
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            _ => {}
        }
    }

    fn take_event(&mut self) -> Option<SseEvent> {
        let name = std::mem::take(&mut self.name);
        let data = std::mem::take(&mut self.data);
        let had = std::mem::replace(&mut self.has_data, false);
        had.then_some(SseEvent { name, data })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::default();
        let mut out: Vec<SseEvent> = chunks.iter().flat_map(|c| p.push(c)).collect();
        out.extend(p.finish());
        out
    }

    fn ev(name: &str, data: &str) -> SseEvent {
        SseEvent {
            name: name.into(),
            data: data.into(),
        }
    }

    #[test]
    fn events_are_cut_at_blank_lines_whatever_the_chunks() {
        let stream =
            "event: message_start\ndata: {\"a\":1}\n\n: ping\ndata: x\ndata: y\n\ndata: [DONE]\n\n";
        let want = vec![
            ev("message_start", "{\"a\":1}"),
            ev("", "x\ny"),
            ev("", "[DONE]"),
        ];
        assert_eq!(all(&[stream.as_bytes()]), want);
        // One byte at a time.
        let bytes: Vec<&[u8]> = stream.as_bytes().chunks(1).collect();
        assert_eq!(all(&bytes), want);
        // CRLF and CR line ends.
        let crlf = stream.replace('\n', "\r\n");
        assert_eq!(all(&[crlf.as_bytes()]), want);
        let split: Vec<&[u8]> = crlf.as_bytes().chunks(3).collect();
        assert_eq!(all(&split), want);
        let cr = stream.replace('\n', "\r");
        assert_eq!(all(&[cr.as_bytes()]), want);
    }

    #[test]
    fn a_character_cut_between_chunks_is_whole_and_a_last_event_is_kept() {
        let text = "data: é\n\ndata: end";
        let bytes = text.as_bytes();
        // Cut inside `é` (two bytes).
        let at = text.find('é').unwrap() + 1;
        assert_eq!(
            all(&[&bytes[..at], &bytes[at..]]),
            vec![ev("", "é"), ev("", "end")]
        );
        // Fields without data make no event; `data` without a colon is an empty line.
        assert_eq!(all(&[b"event: x\nid: 1\n\ndata\n\n"]), vec![ev("", "")]);
    }
}

//! Unified diffs of one path, cached per distinct outcome, with the placeholders for
//! binary and unavailable content and the truncation of long diffs.

use super::{KEEP_DIFF_LINES, MAX_DIFF_LINES};
use crate::blob::BlobHash;
use crate::manifest::FileEntry;
use crate::path::WsPath;
use bytes::Bytes;
use similar::TextDiff;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

/// The longest a single text diff may compute before `similar` approximates.
const DIFF_TIMEOUT: Duration = Duration::from_millis(500);

/// A cached diff text and whether it was truncated.
type CachedDiff = (Arc<str>, bool);

/// Unified diffs of one path, computed once per distinct outcome. The old side is fixed
/// per path, so keying by the new side's (hash, mode) is keying by (old, new).
pub(super) struct DiffCache<'a> {
    path: &'a WsPath,
    old: Option<&'a FileEntry>,
    old_text: Option<Option<Bytes>>,
    blobs: &'a dyn Fn(&BlobHash) -> Option<Bytes>,
    context: usize,
    done: HashMap<Option<(BlobHash, u32)>, CachedDiff>,
}

impl<'a> DiffCache<'a> {
    pub(super) fn new(
        path: &'a WsPath,
        old: Option<&'a FileEntry>,
        blobs: &'a dyn Fn(&BlobHash) -> Option<Bytes>,
        context: usize,
    ) -> Self {
        Self {
            path,
            old,
            old_text: None,
            blobs,
            context,
            done: HashMap::new(),
        }
    }

    pub(super) fn get(&mut self, new: Option<&FileEntry>) -> CachedDiff {
        let key = new.map(|e| (e.hash, e.mode));
        if let Some((text, truncated)) = self.done.get(&key) {
            return (Arc::clone(text), *truncated);
        }
        let (text, truncated) = self.compute(new);
        let text: Arc<str> = Arc::from(text);
        self.done.insert(key, (Arc::clone(&text), truncated));
        (text, truncated)
    }

    fn old_bytes(&mut self) -> Option<Bytes> {
        let old = self.old?;
        let blobs = self.blobs;
        self.old_text
            .get_or_insert_with(|| blobs(&old.hash))
            .clone()
    }

    fn compute(&mut self, new: Option<&FileEntry>) -> (String, bool) {
        let old = self.old;
        if let Some(n) = new.filter(|n| n.binary) {
            return match old.filter(|o| !o.binary) {
                Some(o) => (
                    format!("{} → {}", text_placeholder(o), binary_placeholder(n)),
                    false,
                ),
                None => (binary_placeholder(n), false),
            };
        }
        if let Some(o) = old.filter(|o| o.binary) {
            return match new {
                Some(n) => (
                    format!("{} → {}", binary_placeholder(o), text_placeholder(n)),
                    false,
                ),
                None => (binary_placeholder(o), false),
            };
        }
        let a = match old {
            Some(_) => format!("a/{}", self.path.as_str()),
            None => "/dev/null".to_string(),
        };
        let b = match new {
            Some(_) => format!("b/{}", self.path.as_str()),
            None => "/dev/null".to_string(),
        };
        let old_bytes = match old {
            Some(o) => match self.old_bytes() {
                Some(b) => b,
                None => return (unavailable(o), false),
            },
            None => Bytes::new(),
        };
        let new_bytes = match new {
            Some(n) => match (self.blobs)(&n.hash) {
                Some(b) => b,
                None => return (unavailable(n), false),
            },
            None => Bytes::new(),
        };
        let old_text = String::from_utf8_lossy(&old_bytes);
        let new_text = String::from_utf8_lossy(&new_bytes);
        let mut text = TextDiff::configure()
            .timeout(DIFF_TIMEOUT)
            .diff_lines(old_text.as_ref(), new_text.as_ref())
            .unified_diff()
            .context_radius(self.context)
            .header(&a, &b)
            .to_string();
        if text.is_empty() {
            // No hunks: an empty file created or deleted, or a mode-only change.
            text = format!("--- {a}\n+++ {b}\n");
            if let (Some(o), Some(n)) = (old, new) {
                if o.mode != n.mode {
                    let _ = writeln!(text, "mode {:o} → {:o}", o.mode, n.mode);
                }
            }
        }
        truncate_lines(text)
    }
}

/// `[binary · {size} bytes · sha256:{first 12 hex}]`
pub fn binary_placeholder(e: &FileEntry) -> String {
    format!("[binary · {} bytes · sha256:{}]", e.size, e.hash.short())
}

fn text_placeholder(e: &FileEntry) -> String {
    format!("[text · {} bytes · sha256:{}]", e.size, e.hash.short())
}

fn unavailable(e: &FileEntry) -> String {
    format!(
        "[content unavailable · {} bytes · sha256:{}]",
        e.size,
        e.hash.short()
    )
}

/// Keep the first and last [`KEEP_DIFF_LINES`] lines of a diff longer than
/// [`MAX_DIFF_LINES`], with a `... [N lines truncated] ...` marker between them.
pub fn truncate_lines(text: String) -> (String, bool) {
    let total = text.lines().count();
    if total <= MAX_DIFF_LINES {
        return (text, false);
    }
    // Byte offset just past the KEEP-th newline, and the start of line total-KEEP.
    let newline_ends: Vec<usize> = text.match_indices('\n').map(|(i, _)| i + 1).collect();
    let head_end = newline_ends
        .get(KEEP_DIFF_LINES - 1)
        .copied()
        .unwrap_or(text.len());
    let tail_start = newline_ends
        .get(total - KEEP_DIFF_LINES - 1)
        .copied()
        .unwrap_or(head_end);
    let cut = total - 2 * KEEP_DIFF_LINES;
    let mut out = String::with_capacity(head_end + (text.len() - tail_start) + 40);
    out.push_str(&text[..head_end]);
    let _ = writeln!(out, "... [{cut} lines truncated] ...");
    out.push_str(&text[tail_start..]);
    (out, true)
}

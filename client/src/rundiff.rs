//! `forkfleet runs diff A B`: where two runs' histories part (their conversational events
//! compared in order, whatever their seqs: the first that differ, each run's seq there, and
//! the first field of it that does) and how their files differ (each path one run's
//! workspace has differently from the other's, with a unified diff of text).

use crate::client::Client;
use crate::error::ClientError;
use forkfleet_shared::api::{ApiClient as _, LoggedEvent, RunDetail};
use forkfleet_shared::blob::{fetch, BlobHash};
use forkfleet_shared::event::{history_events, Event};
use forkfleet_shared::ids::RunId;
use forkfleet_shared::manifest::{FileEntry, Manifest};
use forkfleet_shared::overlay::{ChangeOp, Overlay};
use forkfleet_shared::path::WsPath;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// Lines of a path's unified diff shown, at most (the rest counted).
const DIFF_LINES: usize = 200;
/// A file larger than this gets no unified diff, only its sizes.
const DIFF_BYTES: u64 = 1 << 20;
/// The longest one file's diff may compute before it approximates.
const DIFF_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);
/// Characters of a differing value a text report quotes.
const QUOTE_CHARS: usize = 160;

/// Two runs compared.
#[derive(Debug, Clone, Serialize)]
pub struct RunsDiff {
    pub a: RunId,
    pub b: RunId,
    /// Events in each run's log.
    pub a_events: usize,
    pub b_events: usize,
    /// How many conversational events (system, user, model, tool result, steer, follow-up,
    /// summary; rewinds honoured) the two histories share from their start. Their seqs
    /// need not be alike: a child copies its parent's conversation under seqs of its own,
    /// without its status, usage and file events.
    pub same_events: usize,
    /// Where they part; `None` when the histories are the same.
    pub parted: Option<Parting>,
    /// Each run's current workspace version (a branch's is computed, not stored).
    pub a_workspace: BlobHash,
    pub b_workspace: BlobHash,
    /// Each path the two workspaces hold differently, in path order.
    pub files: Vec<FileDiff>,
}

/// The first place two histories differ.
#[derive(Debug, Clone, Serialize)]
pub struct Parting {
    /// The seq of each run's event there (`None`: its history has ended).
    pub a_seq: Option<u64>,
    pub b_seq: Option<u64>,
    /// The first differing field of the two events, as a JSON path into them (`type`,
    /// `text`, `tool_calls[0].args.path`); `(end)` where one history has ended.
    pub field: String,
    /// Each run's value of that field (`null` where it has none).
    pub a: Value,
    pub b: Value,
}

/// One path the two workspaces hold differently.
#[derive(Debug, Clone, Serialize)]
pub struct FileDiff {
    pub path: String,
    /// Each run's file at the path (`None`: it has none).
    pub a: Option<FileEntry>,
    pub b: Option<FileEntry>,
    /// The unified diff from A's to B's text (up to 200 lines); `None` for binary or
    /// large files, or where only the mode differs.
    pub diff: Option<String>,
}

/// Compare runs `a` and `b`.
pub async fn runs_diff(coord: &Client, a: RunId, b: RunId) -> Result<RunsDiff, ClientError> {
    let (a_log, b_log) = (coord.run_events(a).await?, coord.run_events(b).await?);
    let (a_detail, b_detail) = (coord.run(a).await?, coord.run(b).await?);
    let (same_events, parted) = parting(&a_log, &b_log)?;
    let a_files = files_of(coord, &a_detail, &a_log).await?;
    let b_files = files_of(coord, &b_detail, &b_log).await?;
    let mut files = Vec::new();
    let paths: std::collections::BTreeSet<_> = a_files.keys().chain(b_files.keys()).collect();
    for path in paths {
        let (ea, eb) = (a_files.get(path), b_files.get(path));
        if let (Some(x), Some(y)) = (ea, eb) {
            if x.same_as(y) {
                continue;
            }
        }
        let diff = text_diff(coord, path.as_str(), ea, eb).await?;
        files.push(FileDiff {
            path: path.to_string(),
            a: ea.cloned(),
            b: eb.cloned(),
            diff,
        });
    }
    Ok(RunsDiff {
        a,
        b,
        a_events: a_log.len(),
        b_events: b_log.len(),
        same_events,
        parted,
        a_workspace: a_detail.workspace,
        b_workspace: b_detail.workspace,
        files,
    })
}

/// Where two runs' histories part: how many conversational events they share, and the
/// first difference.
fn parting(a: &[LoggedEvent], b: &[LoggedEvent]) -> Result<(usize, Option<Parting>), ClientError> {
    let history = |log: &[LoggedEvent]| -> Result<Vec<(u64, Value)>, ClientError> {
        let events: Vec<(u64, Event)> = log.iter().map(|e| (e.seq, e.event.clone())).collect();
        history_events(&events, None)
            .into_iter()
            .filter(|(_, e)| e.is_conversational())
            .map(|(seq, e)| {
                serde_json::to_value(e)
                    .map(|v| (*seq, v))
                    .map_err(|e| ClientError::decode("an event", e))
            })
            .collect()
    };
    let (a, b) = (history(a)?, history(b)?);
    for i in 0..a.len().max(b.len()) {
        let parted = match (a.get(i), b.get(i)) {
            (Some((sa, va)), Some((sb, vb))) => {
                first_difference(va, vb, String::new()).map(|(field, x, y)| Parting {
                    a_seq: Some(*sa),
                    b_seq: Some(*sb),
                    field,
                    a: x,
                    b: y,
                })
            }
            (x, y) => Some(Parting {
                a_seq: x.map(|(s, _)| *s),
                b_seq: y.map(|(s, _)| *s),
                field: "(end)".to_string(),
                a: x.map_or(Value::Null, |(_, v)| v.clone()),
                b: y.map_or(Value::Null, |(_, v)| v.clone()),
            }),
        };
        if let Some(p) = parted {
            return Ok((i, Some(p)));
        }
    }
    Ok((a.len(), None))
}

/// The first field where `a` and `b` differ, as a JSON path (`type` first: events of
/// different kinds differ in kind), with each side's value there.
fn first_difference(a: &Value, b: &Value, at: String) -> Option<(String, Value, Value)> {
    if a == b {
        return None;
    }
    let join = |key: &str| {
        if at.is_empty() {
            key.to_string()
        } else {
            format!("{at}.{key}")
        }
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let kind = |v: &serde_json::Map<String, Value>| v.get("type").cloned();
            if kind(x) != kind(y) {
                return Some((
                    join("type"),
                    kind(x).unwrap_or(Value::Null),
                    kind(y).unwrap_or(Value::Null),
                ));
            }
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let (vx, vy) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                first_difference(vx, vy, join(k))
            })
        }
        (Value::Array(x), Value::Array(y)) => (0..x.len().max(y.len())).find_map(|i| {
            let (vx, vy) = (
                x.get(i).unwrap_or(&Value::Null),
                y.get(i).unwrap_or(&Value::Null),
            );
            first_difference(vx, vy, format!("{at}[{i}]"))
        }),
        _ => Some((at, a.clone(), b.clone())),
    }
}

/// A run's files now: a root run's workspace version; a branch's fork snapshot with the
/// file changes of its history (rewinds honoured), as the coordinator computes it.
async fn files_of(
    coord: &Client,
    detail: &RunDetail,
    log: &[LoggedEvent],
) -> Result<BTreeMap<WsPath, FileEntry>, ClientError> {
    if detail.run.fork_id.is_none() {
        return Ok(manifest(coord, &detail.workspace).await?.files);
    }
    let base = manifest(coord, &detail.run.workspace).await?;
    let events: Vec<(u64, Event)> = log.iter().map(|e| (e.seq, e.event.clone())).collect();
    let changes: Vec<ChangeOp> = history_events(&events, None)
        .into_iter()
        .filter_map(|(_, e)| match e {
            Event::FileChange { change } => Some(change.clone()),
            _ => None,
        })
        .collect();
    let overlay = Overlay::from_log(Arc::new(base), &changes)
        .map_err(|e| ClientError::decode("a run's file changes", e))?;
    Ok(overlay.files().into_iter().collect())
}

async fn manifest(coord: &Client, hash: &BlobHash) -> Result<Manifest, ClientError> {
    let bytes = fetch(coord.blobs().as_ref(), hash)
        .await
        .map_err(|e| ClientError::blob("reading a run's workspace version", e))?;
    Manifest::from_blob(&bytes).map_err(|e| ClientError::decode("a run's workspace version", e))
}

/// A's text to B's as a unified diff, when both sides (or the one there is) are text of
/// at most 1 MiB and the contents differ.
async fn text_diff(
    coord: &Client,
    path: &str,
    a: Option<&FileEntry>,
    b: Option<&FileEntry>,
) -> Result<Option<String>, ClientError> {
    let text = |e: Option<&FileEntry>| e.is_none_or(|e| !e.binary && e.size <= DIFF_BYTES);
    if !text(a) || !text(b) || a.zip(b).is_some_and(|(x, y)| x.hash == y.hash) {
        return Ok(None);
    }
    let mut sides = Vec::with_capacity(2);
    for e in [a, b] {
        sides.push(match e {
            Some(e) => {
                let bytes = fetch(coord.blobs().as_ref(), &e.hash)
                    .await
                    .map_err(|err| ClientError::blob("reading a file to compare", err))?;
                String::from_utf8_lossy(&bytes).into_owned()
            }
            None => String::new(),
        });
    }
    // Bounded: past the timeout `similar` approximates rather than search on.
    let diff = similar::TextDiff::configure()
        .timeout(DIFF_TIMEOUT)
        .diff_lines(&sides[0], &sides[1])
        .unified_diff()
        .context_radius(3)
        .header(&format!("a/{path}"), &format!("b/{path}"))
        .to_string();
    let lines: Vec<&str> = diff.lines().collect();
    let mut out: String = lines
        .iter()
        .take(DIFF_LINES)
        .flat_map(|l| [*l, "\n"])
        .collect();
    if lines.len() > DIFF_LINES {
        let _ = writeln!(out, "... ({} more lines)", lines.len() - DIFF_LINES);
    }
    Ok(Some(out))
}

impl RunsDiff {
    /// The report as text.
    pub fn text(&self) -> String {
        let mut out = format!(
            "A {} ({} events)\nB {} ({} events)\n",
            self.a, self.a_events, self.b, self.b_events
        );
        match &self.parted {
            None => {
                let _ = writeln!(
                    out,
                    "history: the same ({} conversational events)",
                    self.same_events
                );
            }
            Some(p) => {
                let seq = |s: Option<u64>| s.map_or("its end".to_string(), |s| format!("seq {s}"));
                let _ = writeln!(
                    out,
                    "history: the same for {} conversational events, then parts at A's {} and B's {}, field `{}`:",
                    self.same_events,
                    seq(p.a_seq),
                    seq(p.b_seq),
                    p.field
                );
                let _ = writeln!(out, "  A: {}", quote(&p.a));
                let _ = writeln!(out, "  B: {}", quote(&p.b));
            }
        }
        if self.files.is_empty() {
            out.push_str("files: the same\n");
            return out;
        }
        let _ = writeln!(
            out,
            "files: {} differ",
            crate::render::count(self.files.len(), "path", "paths")
        );
        for f in &self.files {
            let how = match (&f.a, &f.b) {
                (Some(_), None) => "only in A".to_string(),
                (None, Some(_)) => "only in B".to_string(),
                (Some(x), Some(y)) if x.hash == y.hash => {
                    format!("mode {:o} -> {:o}", x.mode, y.mode)
                }
                (Some(x), Some(y)) if f.diff.is_none() => {
                    format!("differ ({} -> {} bytes)", x.size, y.size)
                }
                _ => "differ".to_string(),
            };
            let _ = writeln!(out, "  {:<10} {}", how, f.path);
        }
        for d in self.files.iter().filter_map(|f| f.diff.as_deref()) {
            out.push('\n');
            out.push_str(d);
        }
        out
    }
}

/// A value as one line, cut to [`QUOTE_CHARS`].
fn quote(v: &Value) -> String {
    let s = match v {
        Value::Null => "(none)".to_string(),
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    };
    let cut: String = s.chars().take(QUOTE_CHARS).collect();
    if cut.len() < s.len() {
        format!("{cut}…")
    } else {
        cut
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_first_difference_names_its_field() {
        let a = json!({"type": "model_response", "text": "hi", "tool_calls": [{"name": "w", "args": {"path": "a"}}]});
        let b = json!({"type": "model_response", "text": "hi", "tool_calls": [{"name": "w", "args": {"path": "b"}}]});
        let (field, x, y) = first_difference(&a, &b, String::new()).unwrap();
        assert_eq!(field, "tool_calls[0].args.path");
        assert_eq!((x, y), (json!("a"), json!("b")));
        let c = json!({"type": "tool_result", "text": "hi"});
        assert_eq!(first_difference(&a, &c, String::new()).unwrap().0, "type");
        assert!(first_difference(&a, &a.clone(), String::new()).is_none());
    }
}

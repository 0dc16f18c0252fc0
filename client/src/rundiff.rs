//! `forkfleet runs diff A B`: where two runs' events part (the first seq whose events
//! differ, and the first field of it that does) and how their files differ (each path one
//! run's workspace has differently from the other's, with a unified diff of text).

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
    /// The last seq through which the two logs are the same (`None`: they differ at their
    /// first event). Two runs that both start with a lineage event (seq 0: a fork's
    /// branch, a child) are compared from seq 1.
    pub same_through: Option<u64>,
    /// Where they part; `None` when the logs are the same.
    pub parted: Option<Parting>,
    /// Each run's current workspace version (a branch's is computed, not stored).
    pub a_workspace: BlobHash,
    pub b_workspace: BlobHash,
    /// Each path the two workspaces hold differently, in path order.
    pub files: Vec<FileDiff>,
}

/// The first place two logs differ.
#[derive(Debug, Clone, Serialize)]
pub struct Parting {
    pub seq: u64,
    /// The first differing field of the event at `seq`, as a JSON path into it (`type`,
    /// `text`, `tool_calls[0].args.path`); `(end)` where one log has no event at `seq`.
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
    let (same_through, parted) = parting(&a_log, &b_log)?;
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
        same_through,
        parted,
        a_workspace: a_detail.workspace,
        b_workspace: b_detail.workspace,
        files,
    })
}

/// Where two logs part: the last seq they share, and the first difference.
fn parting(
    a: &[LoggedEvent],
    b: &[LoggedEvent],
) -> Result<(Option<u64>, Option<Parting>), ClientError> {
    let json = |e: &LoggedEvent| {
        serde_json::to_value(&e.event).map_err(|e| ClientError::decode("an event", e))
    };
    // Each branch's seq 0 is its own lineage event (its fork, label, cutoff): not where
    // two runs' work parts, so not compared.
    let lineage = |log: &[LoggedEvent]| {
        log.first()
            .is_some_and(|e| e.seq == 0 && matches!(e.event, Event::Fork { .. }))
    };
    let first = usize::from(lineage(a) && lineage(b));
    let mut same_through = None;
    for i in first..a.len().max(b.len()) {
        let (x, y) = (a.get(i), b.get(i));
        let parted = match (x, y) {
            (Some(x), Some(y)) if x.seq == y.seq => {
                let (vx, vy) = (json(x)?, json(y)?);
                first_difference(&vx, &vy, String::new()).map(|(field, a, b)| Parting {
                    seq: x.seq,
                    field,
                    a,
                    b,
                })
            }
            (x, y) => {
                let seq = x
                    .map_or(u64::MAX, |e| e.seq)
                    .min(y.map_or(u64::MAX, |e| e.seq));
                let at = |e: Option<&LoggedEvent>| -> Result<Value, ClientError> {
                    match e.filter(|e| e.seq == seq) {
                        Some(e) => json(e),
                        None => Ok(Value::Null),
                    }
                };
                Some(Parting {
                    seq,
                    field: "(end)".to_string(),
                    a: at(x)?,
                    b: at(y)?,
                })
            }
        };
        match parted {
            Some(p) => return Ok((same_through, Some(p))),
            None => same_through = x.map(|e| e.seq),
        }
    }
    Ok((same_through, None))
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
    let diff = similar::TextDiff::from_lines(&sides[0], &sides[1])
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
        match (&self.parted, self.same_through) {
            (None, _) => out.push_str("events: the same\n"),
            (Some(p), through) => {
                match through {
                    Some(s) => {
                        let _ = writeln!(out, "events: the same through seq {s}");
                    }
                    None => out.push_str("events: different from the first compared\n"),
                }
                let _ = writeln!(out, "parted at seq {}, field `{}`:", p.seq, p.field);
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

//! The tools a branch's model calls, over the branch's [`Overlay`].
//!
//! Every path goes through [`WsPath::parse`] (confined to the workspace) and symlinks are
//! followed with [`Overlay::resolve`], their targets read from the worker's blob cache.
//! A tool's failure (bad arguments, a missing file, an edit that does not match) is a
//! result with `ok = false` that the model reads, never an error of the worker. Only a
//! failing blob store is an error ([`BlobError`]): the branch cannot go on without it.
//!
//! New content is put into the blob store (through the cache) before the tool returns, so
//! the `file_change` events the caller publishes next always name blobs that exist.
//!
//! A branch's tools are a [`ToolBox`] built from its task: the standard tools, plus
//! `run_command` when the task has one ([`BranchTask::run_command`], the spec's
//! `[run_command]` table).
//!
//! What the model is offered (the tools' definitions) and what a tool answers
//! ([`ToolOutcome`], its output cut to [`MAX_OUTPUT_CHARS`]) are in [`crate::toolspec`];
//! this module runs the tools.
//!
//! ## Layout
//! - here: the [`ToolBox`], the dispatch ([`run_tool`]), and what the tools share
//!   (argument parsing, paths followed through symlinks, file contents).
//! - `files`: `read_file`, `write_file`, `edit_file`, `delete_file`, `list_files`.
//! - `search`: `glob` and `grep`.
//! - `command`: `run_command` (how a command's changes are taken back is told there).

mod command;
mod files;
mod search;

pub use crate::toolspec::{tool_specs, ToolOutcome, MAX_OUTPUT_CHARS, RUN_COMMAND};
pub use command::MAX_IMPORT_FILE_BYTES;

use crate::cache::BlobCache;
use crate::error::WorkerError;
use crate::runner::{TreeKey, Trees};
use crate::toolspec::{offered, ToolSpec};
use bytes::Bytes;
use forkfleet_shared::blob::BlobError;
use forkfleet_shared::endpoint::CommandTool;
use forkfleet_shared::event::ToolCall;
use forkfleet_shared::manifest::FileEntry;
use forkfleet_shared::overlay::{Overlay, OverlayError};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::BranchTask;
use serde::de::DeserializeOwned;
use serde_json::json;
use std::cell::Cell;
use std::sync::Arc;

/// Lines `read_file` shows when no limit is given.
pub const DEFAULT_READ_LIMIT: usize = 2_000;
/// Longest line `read_file` and `grep` show before cutting it.
pub const MAX_LINE_CHARS: usize = 2_000;
/// Matches `grep` reports before stopping.
pub const MAX_GREP_MATCHES: usize = 500;
/// Paths `glob` lists before stopping.
pub const MAX_GLOB_PATHS: usize = 1_000;

/// The names of every tool, in the order the model is told about them.
pub const TOOL_NAMES: &[&str] = forkfleet_shared::approval::STANDARD_TOOLS;

/// The tools of one branch: the standard ones, and `run_command` when its task enables it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolBox {
    command: Option<CommandTool>,
    /// The fork tools are offered too (they run in `crate::forktools`).
    forking: bool,
    /// Where `run_command` keeps the branch's tree between calls; `None`: every call runs
    /// in a fresh copy.
    trees: Option<TreeSlot>,
    /// With the checkpoint tools: the whole list offered (the static one and those, as
    /// the spec describes them); they run in `crate::agent`.
    listed: Option<Arc<Vec<ToolSpec>>>,
}

/// A branch's place among the worker's kept command trees.
#[derive(Clone)]
pub struct TreeSlot {
    pub trees: Arc<Trees>,
    pub key: TreeKey,
    /// The blob hash of the fork's snapshot, the branch overlay's base: it names a base
    /// kept beside the store (ADR 32).
    pub snapshot: forkfleet_shared::blob::BlobHash,
}

impl std::fmt::Debug for TreeSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TreeSlot").field("key", &self.key).finish()
    }
}

impl PartialEq for TreeSlot {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.trees, &other.trees) && self.key == other.key
    }
}

impl ToolBox {
    /// The standard tools only.
    pub fn standard() -> Self {
        Self::default()
    }

    /// The tools `task` offers its model.
    pub fn for_task(task: &BranchTask) -> Self {
        let listed = task.checkpoint_tools.as_ref().map(|c| {
            let mut all = offered(task.run_command.is_some(), task.forking).to_vec();
            all.extend(crate::toolspec::checkpoint_tool_specs(&c.descriptions));
            Arc::new(all)
        });
        Self {
            command: task.run_command.clone(),
            forking: task.forking,
            trees: None,
            listed,
        }
    }

    /// `run_command` keeps the branch's tree in `slot` between calls.
    pub fn with_trees(self, slot: TreeSlot) -> Self {
        Self {
            trees: Some(slot),
            ..self
        }
    }

    /// The standard tools, and `run_command` with these settings when given.
    pub fn with_command(command: Option<CommandTool>) -> Self {
        Self {
            command,
            forking: false,
            trees: None,
            listed: None,
        }
    }

    /// The definitions given to the model: static lists ([`offered`]), so a provider's
    /// estimate can use their size measured once
    /// ([`measured_json_bytes`](crate::toolspec::measured_json_bytes)), but with the
    /// checkpoint tools (described as the spec says) one of the task's own.
    pub fn specs(&self) -> &[ToolSpec] {
        match &self.listed {
            Some(list) => list.as_slice(),
            None => offered(self.command.is_some(), self.forking),
        }
    }

    /// The names of the tools offered, in order.
    pub fn names(&self) -> Vec<&str> {
        self.specs().iter().map(|s| s.name.as_str()).collect()
    }

    /// Run one tool call against the overlay. `Err` only when the worker cannot go on (the
    /// blob store fails); everything else is a result the model reads.
    pub async fn run(
        &self,
        call: &ToolCall,
        overlay: &mut Overlay,
        blobs: &BlobCache,
    ) -> Result<ToolOutcome, WorkerError> {
        if call.name == RUN_COMMAND {
            return match &self.command {
                Some(tool) => match args(call) {
                    Ok(a) => {
                        command::run_command(tool, a, overlay, blobs, self.trees.as_ref()).await
                    }
                    Err(e) => Ok(e),
                },
                None => Ok(ToolOutcome::err(format!(
                    "`{RUN_COMMAND}` is not enabled for this run (the fork spec has no \
                     [run_command] table); available tools: {}",
                    self.names().join(", ")
                ))),
            };
        }
        if !TOOL_NAMES.contains(&call.name.as_str()) {
            return Ok(ToolOutcome::err(format!(
                "unknown tool `{}`; available tools: {}",
                call.name,
                self.names().join(", ")
            )));
        }
        Ok(run_tool(call, overlay, blobs).await?)
    }
}

/// Run one tool call against the overlay. `Err` only when the blob store fails.
pub async fn run_tool(
    call: &ToolCall,
    overlay: &mut Overlay,
    blobs: &BlobCache,
) -> Result<ToolOutcome, BlobError> {
    let outcome = match call.name.as_str() {
        "read_file" => match args(call) {
            Ok(a) => files::read_file(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "write_file" => match args(call) {
            Ok(a) => files::write_file(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "edit_file" => match args(call) {
            Ok(a) => files::edit_file(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "delete_file" => match args(call) {
            Ok(a) => files::delete_file(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "list_files" => match args(call) {
            Ok(a) => files::list_files(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "glob" => match args(call) {
            Ok(a) => search::glob(a, overlay),
            Err(e) => e,
        },
        "grep" => match args(call) {
            Ok(a) => search::grep(a, overlay, blobs).await?,
            Err(e) => e,
        },
        other => ToolOutcome::err(format!(
            "unknown tool `{other}`; available tools: {}",
            TOOL_NAMES.join(", ")
        )),
    };
    Ok(outcome)
}

fn args<T: DeserializeOwned>(call: &ToolCall) -> Result<T, ToolOutcome> {
    let parsed = if call.args.is_null() {
        T::deserialize(json!({}))
    } else {
        T::deserialize(&call.args)
    };
    parsed.map_err(|e| ToolOutcome::err(format!("invalid arguments for {}: {e}", call.name)))
}

fn cut_line(line: &str) -> std::borrow::Cow<'_, str> {
    match line.char_indices().nth(MAX_LINE_CHARS) {
        Some((i, _)) => format!("{} [line truncated]", &line[..i]).into(),
        None => line.into(),
    }
}

/// Parse a path argument; `Err` is the tool result to return.
fn parse_path(input: &str, allow_root: bool) -> Result<WsPath, ToolOutcome> {
    let parsed = if allow_root {
        WsPath::parse(input)
    } else {
        WsPath::parse_file(input)
    };
    parsed.map_err(|e| ToolOutcome::err(e.to_string()))
}

/// Follow symlinks in `path`, fetching link targets into the cache as they are met.
async fn resolve(
    overlay: &Overlay,
    blobs: &BlobCache,
    path: &WsPath,
) -> Result<Result<WsPath, ToolOutcome>, BlobError> {
    // Each round either resolves or fetches one more link target; a chain is at most 40
    // links long before `resolve` reports a loop.
    for _ in 0..64 {
        let (result, missing) = {
            let missing = Cell::new(None);
            let read_link = |e: &FileEntry| match blobs.get_now(&e.hash) {
                Some(b) => String::from_utf8(b.to_vec()).ok(),
                None => {
                    missing.set(Some(e.hash));
                    None
                }
            };
            let r = overlay.resolve(path, &read_link);
            (r, missing.get())
        };
        match (result, missing) {
            (Ok(p), _) => return Ok(Ok(p)),
            (Err(_), Some(hash)) => match blobs.get(&hash).await {
                Ok(_) => continue,
                Err(BlobError::Backend(m)) => return Err(BlobError::Backend(m)),
                Err(e) => return Ok(Err(ToolOutcome::err(format!("cannot read a symlink: {e}")))),
            },
            (Err(e), None) => return Ok(Err(ToolOutcome::err(e.to_string()))),
        }
    }
    Ok(Err(ToolOutcome::err(
        OverlayError::SymlinkLoop(path.clone()).to_string(),
    )))
}

/// Parse and resolve a path argument, or say why not.
macro_rules! path_or_return {
    ($input:expr, $allow_root:expr, $overlay:expr, $blobs:expr) => {{
        let p = match $crate::tools::parse_path($input, $allow_root) {
            Ok(p) => p,
            Err(e) => return Ok(e),
        };
        match $crate::tools::resolve($overlay, $blobs, &p).await? {
            Ok(p) => p,
            Err(e) => return Ok(e),
        }
    }};
}
use path_or_return;

/// The bytes of a file, or the tool result saying why they cannot be had.
async fn content(
    blobs: &BlobCache,
    path: &WsPath,
    entry: &FileEntry,
) -> Result<Result<Bytes, ToolOutcome>, BlobError> {
    match blobs.get(&entry.hash).await {
        Ok(b) => Ok(Ok(b)),
        Err(BlobError::Backend(m)) => Err(BlobError::Backend(m)),
        Err(e) => Ok(Err(ToolOutcome::err(format!("cannot read `{path}`: {e}")))),
    }
}

/// The text of a file, or the tool result saying it is binary or unreadable.
async fn text(
    blobs: &BlobCache,
    path: &WsPath,
    entry: &FileEntry,
) -> Result<Result<String, ToolOutcome>, BlobError> {
    let binary = || {
        ToolOutcome::err(format!(
            "`{path}` is a binary file ({} bytes, {:?}); it cannot be shown or edited as text",
            entry.size, entry.hash
        ))
    };
    if entry.binary {
        return Ok(Err(binary()));
    }
    let bytes = match content(blobs, path, entry).await? {
        Ok(b) => b,
        Err(e) => return Ok(Err(e)),
    };
    match String::from_utf8(bytes.to_vec()) {
        Ok(s) => Ok(Ok(s)),
        Err(_) => Ok(Err(binary())),
    }
}

fn overlay_err(e: OverlayError) -> ToolOutcome {
    ToolOutcome::err(e.to_string())
}

#[cfg(test)]
mod tests;

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
//! ## Layout
//! - here: the [`ToolBox`] and the tool definitions, the dispatch ([`run_tool`]), and what
//!   the tools share (argument parsing, paths followed through symlinks, file contents,
//!   output cut to [`MAX_OUTPUT_CHARS`]).
//! - `files`: `read_file`, `write_file`, `edit_file`, `delete_file`, `list_files`.
//! - `search`: `glob` and `grep`.
//! - `command`: `run_command` (how a command's changes are taken back is told there).

mod command;
mod files;
mod search;

pub use command::MAX_IMPORT_FILE_BYTES;

use crate::cache::BlobCache;
use crate::error::WorkerError;
use crate::forktools::fork_tool_specs;
use crate::provider::{tools_json_bytes, ToolSpec};
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
use std::fmt::Write as _;
use std::sync::OnceLock;

/// Tool outputs longer than this many characters are truncated with a marker.
pub const MAX_OUTPUT_CHARS: usize = 30_000;
/// Lines `read_file` shows when no limit is given.
pub const DEFAULT_READ_LIMIT: usize = 2_000;
/// Longest line `read_file` and `grep` show before cutting it.
pub const MAX_LINE_CHARS: usize = 2_000;
/// Matches `grep` reports before stopping.
pub const MAX_GREP_MATCHES: usize = 500;
/// Paths `glob` lists before stopping.
pub const MAX_GLOB_PATHS: usize = 1_000;

/// The names of every tool, in the order the model is told about them.
pub const TOOL_NAMES: &[&str] = &[
    "read_file",
    "write_file",
    "edit_file",
    "delete_file",
    "list_files",
    "glob",
    "grep",
];

/// The name of the command tool, offered only when a task enables it.
pub const RUN_COMMAND: &str = "run_command";

/// The tools of one branch: the standard ones, and `run_command` when its task enables it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolBox {
    command: Option<CommandTool>,
    /// The fork tools are offered too (they run in `crate::forktools`).
    forking: bool,
}

impl ToolBox {
    /// The standard tools only.
    pub fn standard() -> Self {
        Self::default()
    }

    /// The tools `task` offers its model.
    pub fn for_task(task: &BranchTask) -> Self {
        Self {
            command: task.run_command.clone(),
            forking: task.forking,
        }
    }

    /// The standard tools, and `run_command` with these settings when given.
    pub fn with_command(command: Option<CommandTool>) -> Self {
        Self {
            command,
            forking: false,
        }
    }

    /// The definitions given to the model. Static lists, so a provider's estimate can use
    /// their size measured once ([`measured_json_bytes`]).
    pub fn specs(&self) -> &'static [ToolSpec] {
        match (self.command.is_some(), self.forking) {
            (false, false) => tool_specs(),
            (true, false) => &with_command_specs().specs,
            (false, true) => &with_fork_specs().specs,
            (true, true) => &with_command_and_fork_specs().specs,
        }
    }

    /// The names of the tools offered, in order.
    pub fn names(&self) -> Vec<&'static str> {
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
                    Ok(a) => command::run_command(tool, a, overlay, blobs).await,
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

/// A static tool list and its size as JSON, measured once.
struct SpecSet {
    specs: Vec<ToolSpec>,
    json_bytes: usize,
}

/// The standard tools and `run_command`.
fn with_command_specs() -> &'static SpecSet {
    static SET: OnceLock<SpecSet> = OnceLock::new();
    SET.get_or_init(|| SpecSet::of(tool_specs().iter().chain([&command::run_command_spec()])))
}

/// The standard tools and the fork tools.
fn with_fork_specs() -> &'static SpecSet {
    static SET: OnceLock<SpecSet> = OnceLock::new();
    SET.get_or_init(|| SpecSet::of(tool_specs().iter().chain(fork_tool_specs())))
}

/// The standard tools, `run_command` and the fork tools.
fn with_command_and_fork_specs() -> &'static SpecSet {
    static SET: OnceLock<SpecSet> = OnceLock::new();
    SET.get_or_init(|| SpecSet::of(with_command_specs().specs.iter().chain(fork_tool_specs())))
}

impl SpecSet {
    fn of<'a>(specs: impl Iterator<Item = &'a ToolSpec>) -> Self {
        let specs: Vec<ToolSpec> = specs.cloned().collect();
        let json_bytes = tools_json_bytes(&specs);
        SpecSet { specs, json_bytes }
    }
}

/// The JSON size of `tools` when it is one of the static lists a [`ToolBox`] hands out
/// (the same slice, not an equal copy), measured once; `None` for any other list.
pub fn measured_json_bytes(tools: &[ToolSpec]) -> Option<usize> {
    if std::ptr::eq(tools, tool_specs()) {
        return Some(tool_specs_json_bytes());
    }
    [
        with_command_specs(),
        with_fork_specs(),
        with_command_and_fork_specs(),
    ]
    .into_iter()
    .find(|set| std::ptr::eq(tools, set.specs.as_slice()))
    .map(|set| set.json_bytes)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutcome {
    pub ok: bool,
    pub output: String,
}

impl ToolOutcome {
    fn ok(output: String) -> Self {
        Self {
            ok: true,
            output: truncate(output),
        }
    }

    fn err(output: impl Into<String>) -> Self {
        Self {
            ok: false,
            output: truncate(output.into()),
        }
    }
}

/// Bytes of [`tool_specs`] encoded as JSON (see [`tools_json_bytes`]), measured once.
pub fn tool_specs_json_bytes() -> usize {
    static BYTES: OnceLock<usize> = OnceLock::new();
    *BYTES.get_or_init(|| tools_json_bytes(tool_specs()))
}

/// The tool definitions given to the model.
pub fn tool_specs() -> &'static [ToolSpec] {
    static SPECS: OnceLock<Vec<ToolSpec>> = OnceLock::new();
    SPECS.get_or_init(|| {
        let spec = |name: &str, description: &str, parameters: serde_json::Value| ToolSpec {
            name: name.to_string(),
            description: description.to_string(),
            parameters,
        };
        let path = |d: &str| json!({"type": "string", "description": d});
        vec![
            spec(
                "read_file",
                "Read a text file of the workspace. Lines are numbered from 1, like `cat -n`. \
                 Use offset and limit to read part of a long file.",
                json!({"type": "object", "properties": {
                    "path": path("File path, relative to the workspace root."),
                    "offset": {"type": "integer", "minimum": 1, "description": "First line to show (from 1)."},
                    "limit": {"type": "integer", "minimum": 1, "description": "Most lines to show (default 2000)."}
                }, "required": ["path"]}),
            ),
            spec(
                "write_file",
                "Create a file or replace its whole content. Missing parent directories are created.",
                json!({"type": "object", "properties": {
                    "path": path("File path, relative to the workspace root."),
                    "content": {"type": "string", "description": "The complete new content."}
                }, "required": ["path", "content"]}),
            ),
            spec(
                "edit_file",
                "Replace an exact string in a file. old_string must occur exactly once unless \
                 replace_all is true; include surrounding lines to make it unique.",
                json!({"type": "object", "properties": {
                    "path": path("File path, relative to the workspace root."),
                    "old_string": {"type": "string", "description": "The exact text to replace."},
                    "new_string": {"type": "string", "description": "The replacement text."},
                    "replace_all": {"type": "boolean", "description": "Replace every occurrence (default false)."}
                }, "required": ["path", "old_string", "new_string"]}),
            ),
            spec(
                "delete_file",
                "Delete a file, or a directory with everything below it.",
                json!({"type": "object", "properties": {
                    "path": path("File or directory path, relative to the workspace root.")
                }, "required": ["path"]}),
            ),
            spec(
                "list_files",
                "List a directory's entries; directories end with `/`.",
                json!({"type": "object", "properties": {
                    "path": path("Directory path, relative to the workspace root (default: the root).")
                }}),
            ),
            spec(
                "glob",
                "Find files whose path matches a glob pattern, e.g. `src/**/*.rs` (`*` does not \
                 cross `/`; `**` does).",
                json!({"type": "object", "properties": {
                    "pattern": {"type": "string", "description": "Glob pattern over workspace-relative paths."}
                }, "required": ["pattern"]}),
            ),
            spec(
                "grep",
                "Search file contents with a regular expression. Prints `path:line:text` for \
                 each matching line.",
                json!({"type": "object", "properties": {
                    "pattern": {"type": "string", "description": "Regular expression (Rust regex syntax)."},
                    "path": path("File or directory to search (default: the whole workspace)."),
                    "glob": {"type": "string", "description": "Only files matching this glob; without a `/` it matches file names."}
                }, "required": ["pattern"]}),
            ),
        ]
    })
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

/// Cut `s` to [`MAX_OUTPUT_CHARS`] characters, saying how much was left out.
pub fn truncate(mut s: String) -> String {
    if s.len() <= MAX_OUTPUT_CHARS {
        return s;
    }
    let Some((cut, _)) = s.char_indices().nth(MAX_OUTPUT_CHARS) else {
        return s;
    };
    let rest = s[cut..].chars().count();
    s.truncate(cut);
    let _ = write!(s, "\n[output truncated: {rest} more characters]");
    s
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

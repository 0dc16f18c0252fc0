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
//! ## `run_command`
//!
//! The branch's current tree (the fork-time snapshot with the branch's changes,
//! [`Overlay::to_manifest`]) is materialised in a fresh temporary directory from the blob
//! cache ([`Workdir`], the same path as a resolve's test job; a symlink pointing outside the
//! tree is not created), and the command runs there ([`crate::runner::run_command`]): no
//! shell, the environment cleared to `PATH`, `HOME`, `TMPDIR`, `LANG` and the spec's `env`
//! (`HOME` and `TMPDIR` are scratch directories outside the tree, so caches and temporary
//! files do not become changes), the whole process group killed at the timeout (the model's
//! `timeout_s`, capped at the spec's). Afterwards (also after a timeout) the directory is
//! compared with the tree it was materialised from ([`crate::runner::tree_changes`]: a file
//! whose inode, size, mode and times are as written is not read again) and what the command
//! did becomes overlay changes, in the order of that change log: deleted files (`delete`)
//! and directories (`rmdir`), new empty directories (`mkdir`), then new files (`write`) and
//! changed ones (`edit`; a `chmod +x` is an edit that changes the mode); every new blob is
//! stored before the changes are recorded. Not taken back, and reported to the model: a symlink
//! pointing outside the workspace, a new or changed file over [`MAX_IMPORT_FILE_BYTES`],
//! anything that is not a file, directory or symlink, an unreadable entry; such a path stays
//! as it was.
//!
//! The result is `ok` when the command exited with code 0; a non-zero exit, a signal, a
//! timeout or a command that could not start is `ok = false`. The output is the outcome
//! line (`exit code N`, `timed out after N s`, `could not start: ...`), stdout and stderr
//! together cut in the middle to the spec's `max_output_bytes` (a marker says how many bytes
//! were left out), and a line listing the files created, changed and deleted.

use crate::cache::BlobCache;
use crate::error::WorkerError;
use crate::forktools::fork_tool_specs;
use crate::provider::{tools_json_bytes, ToolSpec};
use crate::runner::{CommandOutcome, CommandSpec, TreeChanges, Workdir};
use bytes::Bytes;
use forkfleet_shared::blob::BlobError;
use forkfleet_shared::endpoint::CommandTool;
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::event::ToolCall;
use forkfleet_shared::manifest::{FileEntry, Node, MODE_FILE};
use forkfleet_shared::overlay::{apply_edit, ChangeOp, Overlay, OverlayError};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::BranchTask;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::json;
use std::cell::Cell;
use std::fmt::Write as _;
use std::sync::OnceLock;
use std::time::Duration;

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
/// A file a command creates or changes is taken back into the workspace only up to this
/// size (64 MiB); a larger one is reported and the path left as it was.
pub const MAX_IMPORT_FILE_BYTES: u64 = 64 << 20;
/// Paths of each kind (created, changed, deleted, ...) a `run_command` result names.
const MAX_LISTED_PATHS: usize = 50;

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
                    Ok(a) => run_command(tool, a, overlay, blobs).await,
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
    SET.get_or_init(|| SpecSet::of(tool_specs().iter().chain([&run_command_spec()])))
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

fn run_command_spec() -> ToolSpec {
    ToolSpec {
        name: RUN_COMMAND.to_string(),
        description: "Run a command in a copy of the workspace as it is now (with your changes) \
            and see its exit code and output (stdout and stderr together; the middle of a long \
            output is left out). There is no shell: `command` is a list of words, or a string \
            split into words as a shell would (quotes, backslashes) with nothing expanded; for \
            pipes, redirections, `&&` or variables run [\"sh\", \"-c\", \"...\"]. Files the \
            command creates, changes or deletes become changes of the workspace, also when it \
            times out. Only PATH, HOME, TMPDIR, LANG and the run's configured variables are set."
            .to_string(),
        parameters: json!({"type": "object", "properties": {
            "command": {
                "anyOf": [
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    {"type": "string"}
                ],
                "description": "The program and its arguments, e.g. [\"cargo\", \"test\"] or \"pytest -q tests\"."
            },
            "timeout_s": {"type": "number", "exclusiveMinimum": 0, "description": "Seconds before the command and everything it started are killed (default and most: the run's limit)."},
            "cwd": {"type": "string", "description": "Directory to run in, relative to the workspace root (default: the root)."}
        }, "required": ["command"]}),
    }
}

/// What one tool call produced. The changes it made are the overlay's new log entries.
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
            Ok(a) => read_file(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "write_file" => match args(call) {
            Ok(a) => write_file(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "edit_file" => match args(call) {
            Ok(a) => edit_file(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "delete_file" => match args(call) {
            Ok(a) => delete_file(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "list_files" => match args(call) {
            Ok(a) => list_files(a, overlay, blobs).await?,
            Err(e) => e,
        },
        "glob" => match args(call) {
            Ok(a) => glob(a, overlay),
            Err(e) => e,
        },
        "grep" => match args(call) {
            Ok(a) => grep(a, overlay, blobs).await?,
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
        let p = match parse_path($input, $allow_root) {
            Ok(p) => p,
            Err(e) => return Ok(e),
        };
        match resolve($overlay, $blobs, &p).await? {
            Ok(p) => p,
            Err(e) => return Ok(e),
        }
    }};
}

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

#[derive(Deserialize)]
struct ReadArgs {
    path: String,
    #[serde(default)]
    offset: Option<usize>,
    #[serde(default)]
    limit: Option<usize>,
}

async fn read_file(
    a: ReadArgs,
    ov: &mut Overlay,
    blobs: &BlobCache,
) -> Result<ToolOutcome, BlobError> {
    let path = path_or_return!(&a.path, false, ov, blobs);
    let entry = match ov.node(&path) {
        Node::File(e) => e,
        Node::Dir => {
            return Ok(ToolOutcome::err(format!(
                "`{path}` is a directory; use list_files to see what it holds"
            )))
        }
        Node::Missing => return Ok(overlay_err(OverlayError::NotFound(path))),
    };
    let text = match text(blobs, &path, &entry).await? {
        Ok(t) => t,
        Err(e) => return Ok(e),
    };
    if text.is_empty() {
        return Ok(ToolOutcome::ok(format!("(`{path}` is empty)")));
    }
    let offset = a.offset.unwrap_or(1).max(1);
    let limit = a.limit.unwrap_or(DEFAULT_READ_LIMIT).max(1);
    let total = text.lines().count();
    if offset > total {
        return Ok(ToolOutcome::err(format!(
            "`{path}` has {total} lines; offset {offset} is past the end"
        )));
    }
    let mut out = String::with_capacity(text.len().min(MAX_OUTPUT_CHARS) + 64);
    let mut last = offset;
    for (i, line) in text.lines().enumerate().skip(offset - 1).take(limit) {
        last = i + 1;
        let _ = writeln!(out, "{:>6}\t{}", i + 1, cut_line(line));
    }
    if offset > 1 || last < total {
        let _ = write!(
            out,
            "(lines {offset}-{last} of {total}; use offset and limit to read more)"
        );
    }
    Ok(ToolOutcome::ok(out))
}

#[derive(Deserialize)]
struct WriteArgs {
    path: String,
    content: String,
}

async fn write_file(
    a: WriteArgs,
    ov: &mut Overlay,
    blobs: &BlobCache,
) -> Result<ToolOutcome, BlobError> {
    let path = path_or_return!(&a.path, false, ov, blobs);
    let (mode, existed) = match ov.node(&path) {
        Node::File(e) if !e.is_symlink() => (e.mode, true),
        _ => (MODE_FILE, false),
    };
    let bytes = Bytes::from(a.content.into_bytes());
    let entry = FileEntry::for_bytes(&bytes, mode);
    if let Err(e) = ov.write(&path, entry) {
        return Ok(overlay_err(e));
    }
    blobs.put_known(entry.hash, bytes).await?;
    let verb = if existed { "overwrote" } else { "created" };
    Ok(ToolOutcome::ok(format!(
        "{verb} `{path}` ({} bytes)",
        entry.size
    )))
}

#[derive(Deserialize)]
struct EditArgs {
    path: String,
    old_string: String,
    new_string: String,
    #[serde(default)]
    replace_all: bool,
}

async fn edit_file(
    a: EditArgs,
    ov: &mut Overlay,
    blobs: &BlobCache,
) -> Result<ToolOutcome, BlobError> {
    let path = path_or_return!(&a.path, false, ov, blobs);
    let old = match ov.file(&path) {
        Ok(e) => e,
        Err(e) => return Ok(overlay_err(e)),
    };
    let content = match text(blobs, &path, &old).await? {
        Ok(t) => t,
        Err(e) => return Ok(e),
    };
    let edited = match apply_edit(&content, &a.old_string, &a.new_string, a.replace_all) {
        Ok(s) => s,
        Err(e) => return Ok(ToolOutcome::err(format!("cannot edit `{path}`: {e}"))),
    };
    let count = if a.replace_all {
        content.matches(a.old_string.as_str()).count()
    } else {
        1
    };
    let bytes = Bytes::from(edited.into_bytes());
    let entry = FileEntry::for_bytes(&bytes, old.mode);
    if let Err(e) = ov.edit(&path, entry) {
        return Ok(overlay_err(e));
    }
    blobs.put_known(entry.hash, bytes).await?;
    let plural = if count == 1 { "" } else { "s" };
    Ok(ToolOutcome::ok(format!(
        "edited `{path}`: replaced {count} occurrence{plural}"
    )))
}

#[derive(Deserialize)]
struct DeleteArgs {
    path: String,
}

async fn delete_file(
    a: DeleteArgs,
    ov: &mut Overlay,
    blobs: &BlobCache,
) -> Result<ToolOutcome, BlobError> {
    let given = match parse_path(&a.path, false) {
        Ok(p) => p,
        Err(e) => return Ok(e),
    };
    // Follow links in the parent directories, but delete a link itself, not its target.
    let parent = given.parent().unwrap_or_default();
    let parent = match resolve(ov, blobs, &parent).await? {
        Ok(p) => p,
        Err(e) => return Ok(e),
    };
    let path = match parent.join(given.file_name()) {
        Ok(p) => p,
        Err(e) => return Ok(ToolOutcome::err(e.to_string())),
    };
    let what = match ov.node(&path) {
        Node::Dir => format!("deleted directory `{path}` and everything below it"),
        _ => format!("deleted `{path}`"),
    };
    match ov.delete(&path) {
        Ok(()) => Ok(ToolOutcome::ok(what)),
        Err(e) => Ok(overlay_err(e)),
    }
}

#[derive(Deserialize)]
struct ListArgs {
    #[serde(default)]
    path: Option<String>,
}

async fn list_files(
    a: ListArgs,
    ov: &mut Overlay,
    blobs: &BlobCache,
) -> Result<ToolOutcome, BlobError> {
    let path = path_or_return!(a.path.as_deref().unwrap_or(""), true, ov, blobs);
    let entries = match ov.list(&path) {
        Ok(e) => e,
        Err(e) => return Ok(overlay_err(e)),
    };
    if entries.is_empty() {
        return Ok(ToolOutcome::ok(format!("(`{path}` is empty)")));
    }
    let mut out = String::new();
    for e in entries {
        if e.is_dir {
            let _ = writeln!(out, "{}/", e.name);
        } else {
            let _ = writeln!(out, "{} ({} bytes)", e.name, e.size);
        }
    }
    Ok(ToolOutcome::ok(out))
}

#[derive(Deserialize)]
struct GlobArgs {
    pattern: String,
}

fn build_glob(pattern: &str) -> Result<globset::GlobMatcher, ToolOutcome> {
    let pattern = pattern.trim_start_matches("./").trim_start_matches('/');
    globset::GlobBuilder::new(pattern)
        .literal_separator(true)
        .build()
        .map(|g| g.compile_matcher())
        .map_err(|e| ToolOutcome::err(format!("invalid glob pattern: {e}")))
}

fn glob(a: GlobArgs, ov: &Overlay) -> ToolOutcome {
    let matcher = match build_glob(&a.pattern) {
        Ok(m) => m,
        Err(e) => return e,
    };
    let mut out = String::new();
    let mut found = 0usize;
    for (p, _) in ov.files() {
        if matcher.is_match(p.as_str()) {
            found += 1;
            if found <= MAX_GLOB_PATHS {
                let _ = writeln!(out, "{p}");
            }
        }
    }
    if found == 0 {
        return ToolOutcome::ok(format!("no files match `{}`", a.pattern));
    }
    if found > MAX_GLOB_PATHS {
        let _ = write!(out, "[{} more paths not shown]", found - MAX_GLOB_PATHS);
    }
    ToolOutcome::ok(out)
}

#[derive(Deserialize)]
struct GrepArgs {
    pattern: String,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    glob: Option<String>,
}

async fn grep(a: GrepArgs, ov: &mut Overlay, blobs: &BlobCache) -> Result<ToolOutcome, BlobError> {
    let re = match regex::RegexBuilder::new(&a.pattern)
        .size_limit(1 << 22)
        .build()
    {
        Ok(r) => r,
        Err(e) => return Ok(ToolOutcome::err(format!("invalid regular expression: {e}"))),
    };
    let filter = match a.glob.as_deref().map(build_glob).transpose() {
        Ok(f) => f,
        Err(e) => return Ok(e),
    };
    let by_name = a.glob.as_deref().is_some_and(|g| !g.contains('/'));
    let root = path_or_return!(a.path.as_deref().unwrap_or(""), true, ov, blobs);
    let files: Vec<(WsPath, FileEntry)> = match ov.node(&root) {
        Node::File(e) => vec![(root.clone(), e)],
        Node::Dir => ov
            .files()
            .into_iter()
            .filter(|(p, _)| p.starts_with(&root))
            .collect(),
        Node::Missing => return Ok(overlay_err(OverlayError::NotFound(root))),
    };
    let mut out = String::new();
    let mut matches = 0usize;
    'files: for (p, e) in files {
        if e.binary || e.is_symlink() {
            continue;
        }
        if let Some(f) = &filter {
            let subject = if by_name { p.file_name() } else { p.as_str() };
            if !f.is_match(subject) {
                continue;
            }
        }
        let bytes = match content(blobs, &p, &e).await? {
            Ok(b) => b,
            Err(_) => continue,
        };
        let Ok(text) = std::str::from_utf8(&bytes) else {
            continue;
        };
        for (i, line) in text.lines().enumerate() {
            if re.is_match(line) {
                matches += 1;
                if matches > MAX_GREP_MATCHES {
                    let _ = write!(out, "[stopped after {MAX_GREP_MATCHES} matches]");
                    break 'files;
                }
                let _ = writeln!(out, "{p}:{}:{}", i + 1, cut_line(line));
            }
        }
    }
    if matches == 0 {
        return Ok(ToolOutcome::ok(format!("no matches for `{}`", a.pattern)));
    }
    Ok(ToolOutcome::ok(out))
}

#[derive(Deserialize)]
struct CommandArgs {
    command: serde_json::Value,
    #[serde(default)]
    timeout_s: Option<f64>,
    #[serde(default)]
    cwd: Option<String>,
}

/// The argv of a `command` argument: a list of words, or a line split as a shell would.
fn command_argv(command: &serde_json::Value) -> Result<Vec<String>, String> {
    let argv = match command {
        serde_json::Value::String(line) => forkfleet_shared::spec::split_words(line)?,
        serde_json::Value::Array(words) => words
            .iter()
            .map(|w| {
                w.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("every word of `command` must be a string, got {w}"))
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => {
            return Err(format!(
                "`command` must be a list of words or a string, got {other}"
            ))
        }
    };
    match argv.first() {
        Some(program) if !program.is_empty() => Ok(argv),
        _ => Err("`command` is empty; name the program to run".to_string()),
    }
}

/// The directory a command runs in: `cwd` inside the workspace (symlinks followed in the
/// overlay), an existing directory; `Err` is the tool result saying why not.
async fn command_dir(
    cwd: Option<&str>,
    ov: &Overlay,
    blobs: &BlobCache,
) -> Result<Result<WsPath, ToolOutcome>, BlobError> {
    let Some(input) = cwd.filter(|c| !c.trim().is_empty()) else {
        return Ok(Ok(WsPath::root()));
    };
    if input.starts_with('/') || input.starts_with('\\') {
        return Ok(Err(ToolOutcome::err(format!(
            "cwd `{input}` is an absolute path; give a directory relative to the workspace \
             root, such as `src` (default: the root)"
        ))));
    }
    let path = match WsPath::parse(input) {
        Ok(p) => p,
        Err(forkfleet_shared::path::PathError::Escapes(_)) => {
            return Ok(Err(ToolOutcome::err(format!(
                "cwd `{input}` leaves the workspace; give a directory inside it, relative to \
                 the workspace root"
            ))))
        }
        Err(e) => return Ok(Err(ToolOutcome::err(format!("cwd: {e}")))),
    };
    let path = match resolve(ov, blobs, &path).await? {
        Ok(p) => p,
        Err(e) => return Ok(Err(ToolOutcome::err(format!("cwd: {}", e.output)))),
    };
    Ok(match ov.node(&path) {
        Node::Dir => Ok(path),
        Node::File(_) => Err(ToolOutcome::err(format!(
            "cwd `{input}` is a file, not a directory"
        ))),
        Node::Missing => Err(ToolOutcome::err(format!(
            "cwd `{input}` does not exist in the workspace"
        ))),
    })
}

/// Seconds shown without a trailing `.0`.
fn secs(s: f64) -> String {
    format!("{s}")
}

async fn run_command(
    tool: &CommandTool,
    a: CommandArgs,
    ov: &mut Overlay,
    blobs: &BlobCache,
) -> Result<ToolOutcome, WorkerError> {
    let argv = match command_argv(&a.command) {
        Ok(v) => v,
        Err(e) => return Ok(ToolOutcome::err(e)),
    };
    let limit = if tool.timeout_s.is_finite() && tool.timeout_s > 0.0 {
        tool.timeout_s
    } else {
        forkfleet_shared::endpoint::DEFAULT_COMMAND_TIMEOUT_S
    };
    let (timeout_s, capped) = match a.timeout_s {
        None => (limit, false),
        Some(t) if !(t.is_finite() && t > 0.0) => {
            return Ok(ToolOutcome::err(format!(
                "timeout_s is {t}; give a number of seconds above 0 (at most {})",
                secs(limit)
            )))
        }
        Some(t) if t > limit => (limit, true),
        Some(t) => (t, false),
    };
    let timeout = Duration::try_from_secs_f64(timeout_s).unwrap_or(Duration::from_secs(60));
    let cwd = match command_dir(a.cwd.as_deref(), ov, blobs).await? {
        Ok(p) => p,
        Err(e) => return Ok(e),
    };
    let not_started = |why: String| ToolOutcome::err(format!("could not start: {why}"));
    let started = std::time::Instant::now();
    let work = match Workdir::create("forkfleet-cmd-", ov.to_manifest(), blobs).await {
        Ok(w) => w,
        // The blob store failed: another attempt may work.
        Err(e) if e.kind() == ErrorKind::Unavailable => return Err(e),
        Err(e) if e.is_materialize() => {
            return Ok(not_started(format!(
                "cannot copy the workspace to run in: {e}"
            )))
        }
        Err(e) => return Ok(not_started(e.to_string())),
    };
    let materialized = started.elapsed();
    let (files, bytes) = (work.written().files, work.written().bytes);
    let spec = CommandSpec {
        argv,
        env: tool.env.clone(),
        timeout,
        max_output_bytes: usize::try_from(tool.max_output_bytes).unwrap_or(usize::MAX),
    };
    let run = work.run(&cwd, &spec, std::future::pending()).await;
    let compare_started = std::time::Instant::now();
    let changes = if matches!(run.outcome, CommandOutcome::SpawnFailed { .. }) {
        work.remove().await;
        TreeChanges::default()
    } else {
        work.changes(MAX_IMPORT_FILE_BYTES).await
    };
    tracing::debug!(
        files,
        bytes,
        materialize_ms = materialized.as_millis() as u64,
        run_ms = run.duration.as_millis() as u64,
        compare_and_remove_ms = compare_started.elapsed().as_millis() as u64,
        files_read = changes.read,
        outcome = ?run.outcome,
        "run_command done"
    );
    let applied = apply_changes(changes, ov, blobs).await?;

    let mut out = match &run.outcome {
        CommandOutcome::Exited { code } => format!("exit code {code}"),
        CommandOutcome::Signalled { signal } => format!("killed by signal {signal}"),
        CommandOutcome::TimedOut => format!(
            "timed out after {} s; the command and everything it started were killed",
            secs(timeout_s)
        ),
        CommandOutcome::Cancelled => "cancelled".to_string(),
        CommandOutcome::SpawnFailed { error } => format!("could not start: {error}"),
    };
    if capped {
        let _ = write!(
            out,
            " (timeout_s {} is over this run's limit; {} s was used)",
            a.timeout_s.map(secs).unwrap_or_default(),
            secs(limit)
        );
    }
    out.push('\n');
    if run.output.trim().is_empty() {
        out.push_str("(no output)\n");
    } else {
        out.push_str(&run.output);
        if !run.output.ends_with('\n') {
            out.push('\n');
        }
    }
    out.push_str(&applied.report());
    Ok(ToolOutcome {
        ok: run.outcome == CommandOutcome::Exited { code: 0 },
        output: out,
    })
}

/// What of a command's changes went into the overlay, for the model.
#[derive(Debug, Default)]
struct Applied {
    created: Vec<String>,
    changed: Vec<String>,
    made_executable: Vec<String>,
    made_not_executable: Vec<String>,
    deleted: Vec<String>,
    new_dirs: Vec<String>,
    not_imported: Vec<(String, String)>,
}

impl Applied {
    /// The `files:` line, and a `not taken back:` line when something was left out.
    fn report(&self) -> String {
        let mut parts = Vec::new();
        for (what, paths) in [
            ("created", &self.created),
            ("changed", &self.changed),
            ("made executable", &self.made_executable),
            ("made not executable", &self.made_not_executable),
            ("deleted", &self.deleted),
            ("new empty directories", &self.new_dirs),
        ] {
            if !paths.is_empty() {
                parts.push(format!(
                    "{what} {}",
                    listed(paths.iter().map(|p| format!("`{p}`")))
                ));
            }
        }
        let mut out = if parts.is_empty() {
            "files: no changes\n".to_string()
        } else {
            format!("files: {}\n", parts.join("; "))
        };
        if !self.not_imported.is_empty() {
            let _ = writeln!(
                out,
                "not taken back (left as they were): {}",
                listed(
                    self.not_imported
                        .iter()
                        .map(|(p, why)| format!("`{p}` ({why})"))
                )
            );
        }
        out
    }
}

/// Items joined by `, `, at most [`MAX_LISTED_PATHS`] of them and a count of the rest.
fn listed(items: impl ExactSizeIterator<Item = String>) -> String {
    let total = items.len();
    let mut shown: Vec<String> = items.take(MAX_LISTED_PATHS).collect();
    if total > MAX_LISTED_PATHS {
        shown.push(format!("and {} more", total - MAX_LISTED_PATHS));
    }
    shown.join(", ")
}

/// Record a command's changes in the overlay, in the order of `changes.ops` (removals
/// first: a path may change from a directory to a file or back), every new blob stored
/// first. A change to a file the overlay has is an `edit`. A change the overlay refuses is
/// reported, not recorded.
async fn apply_changes(
    changes: TreeChanges,
    ov: &mut Overlay,
    blobs: &BlobCache,
) -> Result<Applied, BlobError> {
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(changes.blobs)
        .map(|(hash, bytes)| blobs.put_known(hash, bytes))
        .buffer_unordered(BLOB_PUTS_IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    let mut applied = Applied {
        not_imported: changes.not_imported,
        ..Applied::default()
    };
    for op in changes.ops {
        let path = op.path().clone();
        let (done, list, shown) = match op {
            ChangeOp::Delete { .. } => (ov.delete(&path), &mut applied.deleted, path.to_string()),
            ChangeOp::Rmdir { .. } => (ov.delete(&path), &mut applied.deleted, format!("{path}/")),
            ChangeOp::Mkdir { .. } => (ov.mkdir(&path), &mut applied.new_dirs, format!("{path}/")),
            ChangeOp::Write { entry, .. } | ChangeOp::Edit { entry, .. } => match ov.file(&path) {
                Err(_) => (
                    ov.write(&path, entry),
                    &mut applied.created,
                    path.to_string(),
                ),
                Ok(before) => {
                    let mode_only =
                        before.hash == entry.hash && !before.is_symlink() && !entry.is_symlink();
                    let list = if !mode_only {
                        &mut applied.changed
                    } else if entry.mode & 0o111 != 0 {
                        &mut applied.made_executable
                    } else {
                        &mut applied.made_not_executable
                    };
                    (ov.edit(&path, entry), list, path.to_string())
                }
            },
        };
        match done {
            Ok(()) => list.push(shown),
            Err(e) => applied.not_imported.push((path.to_string(), e.to_string())),
        }
    }
    Ok(applied)
}

/// Blobs of a command's new files stored at once.
const BLOB_PUTS_IN_FLIGHT: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn commands_are_words_or_a_line_split_like_a_shell() {
        assert_eq!(
            command_argv(&json!(["sh", "-c", "echo a b"])).unwrap(),
            ["sh", "-c", "echo a b"]
        );
        assert_eq!(
            command_argv(&json!(r#"pytest -q "tests/a b.py" 'x y' c\ d $HOME"#)).unwrap(),
            ["pytest", "-q", "tests/a b.py", "x y", "c d", "$HOME"]
        );
        for (bad, says) in [
            (json!([]), "empty"),
            (json!(""), "empty"),
            (json!(["", "x"]), "empty"),
            (json!(["ls", 3]), "must be a string"),
            (json!(42), "a list of words or a string"),
            (json!("echo 'open"), "unterminated"),
        ] {
            let err = command_argv(&bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn the_static_tool_lists_are_measured_once() {
        let standard = ToolBox::standard();
        let with = ToolBox::with_command(Some(CommandTool {
            timeout_s: 5.0,
            env: BTreeMap::new(),
            max_output_bytes: 1024,
        }));
        assert!(std::ptr::eq(standard.specs(), tool_specs()));
        assert_eq!(with.specs().len(), tool_specs().len() + 1);
        assert!(std::ptr::eq(with.specs(), ToolBox::clone(&with).specs()));
        let forking = ToolBox {
            forking: true,
            ..ToolBox::standard()
        };
        let both = ToolBox {
            forking: true,
            ..with.clone()
        };
        let forks = crate::forktools::fork_tool_specs().len();
        assert_eq!(forking.specs().len(), tool_specs().len() + forks);
        assert_eq!(both.specs().len(), tool_specs().len() + 1 + forks);
        assert!(both.names().contains(&"fork_run") && both.names().contains(&RUN_COMMAND));
        for tools in [
            standard.specs(),
            with.specs(),
            forking.specs(),
            both.specs(),
        ] {
            assert_eq!(measured_json_bytes(tools), Some(tools_json_bytes(tools)));
            let copy = tools.to_vec();
            assert_eq!(measured_json_bytes(&copy), None, "a copy is measured anew");
        }
    }

    #[test]
    fn the_files_line_lists_and_bounds_what_changed() {
        assert_eq!(Applied::default().report(), "files: no changes\n");
        let many: Vec<String> = (0..MAX_LISTED_PATHS + 3).map(|i| format!("f{i}")).collect();
        let applied = Applied {
            created: many,
            changed: vec!["a.txt".into()],
            made_executable: vec!["run.sh".into()],
            deleted: vec!["old/".into(), "x".into()],
            not_imported: vec![("evil".into(), "a symlink to `/etc`".into())],
            ..Applied::default()
        };
        let report = applied.report();
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(lines.len(), 2, "{report}");
        assert!(
            lines[0].starts_with("files: created `f0`, `f1`"),
            "{report}"
        );
        assert!(
            lines[0].contains(
                "`f49`, and 3 more; changed `a.txt`; made executable `run.sh`; deleted `old/`, `x`"
            ),
            "{report}"
        );
        assert!(!lines[0].contains("`f50`"));
        assert_eq!(
            lines[1],
            "not taken back (left as they were): `evil` (a symlink to `/etc`)"
        );
    }
}

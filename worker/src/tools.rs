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

use crate::cache::BlobCache;
use crate::provider::{tools_json_bytes, ToolSpec};
use bytes::Bytes;
use forkfleet_shared::blob::BlobError;
use forkfleet_shared::event::ToolCall;
use forkfleet_shared::manifest::{FileEntry, Node, MODE_FILE};
use forkfleet_shared::overlay::{apply_edit, Overlay, OverlayError};
use forkfleet_shared::path::WsPath;
use serde::de::DeserializeOwned;
use serde::Deserialize;
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

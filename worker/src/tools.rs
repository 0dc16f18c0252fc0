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
//! A branch's tools are a [`ToolBox`] built from its task's tool settings
//! ([`ToolSettings`], the spec's): the standard tools, plus each optional tool its settings
//! enable.
//!
//! What the model is offered (the tools' definitions) and what a tool answers
//! ([`ToolOutcome`], its output cut to [`MAX_OUTPUT_CHARS`]) are in [`crate::toolspec`];
//! this module runs the tools.
//!
//! ## How a tool is declared
//! Its name, the setting that offers it and the approval rules that gate it are its entry
//! in `forkfleet_shared::tools::TOOLS` (with its settings, if any, in `ToolSettings`);
//! what the model is told of it and how it runs are a [`Tool`] in its own file here,
//! registered by one line of [`REGISTRY`]. The fork tools and the checkpoint tools are the
//! agent's (they call the coordinator): `crate::forktools`, `crate::agent`.
//!
//! ## Layout
//! - here: the [`ToolBox`], the [`REGISTRY`], the lists offered ([`offered`]), and what
//!   the tools share (argument parsing, paths followed through symlinks, file contents).
//! - `files`: `read_file`, `write_file`, `edit_file`, `delete_file`, `list_files`.
//! - `search`: `glob` and `grep`.
//! - `command`: `run_command` (how a command's changes are taken back is told there).
//! - `http_get`: `http_get`, a URL on an allowed host, fetched by the worker itself.

mod command;
mod files;
mod http_get;
mod search;

pub use crate::toolspec::{tool_specs, ToolOutcome, MAX_OUTPUT_CHARS, RUN_COMMAND};
pub use command::MAX_IMPORT_FILE_BYTES;

use crate::cache::BlobCache;
use crate::error::WorkerError;
use crate::runner::{TreeKey, Trees};
use crate::toolspec::{fork_tool_specs, tools_json_bytes, ToolSpec};
use bytes::Bytes;
use forkfleet_shared::blob::BlobError;
use forkfleet_shared::endpoint::CommandTool;
use forkfleet_shared::event::ToolCall;
use forkfleet_shared::manifest::FileEntry;
use forkfleet_shared::overlay::{Overlay, OverlayError};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::BranchTask;
use forkfleet_shared::tools::{ToolSettings, TOOLS};
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde_json::json;
use std::cell::Cell;
use std::sync::{Arc, RwLock};

/// Lines `read_file` shows when no limit is given.
pub const DEFAULT_READ_LIMIT: usize = 2_000;
/// Longest line `read_file` and `grep` show before cutting it.
pub const MAX_LINE_CHARS: usize = 2_000;
/// Matches `grep` reports before stopping.
pub const MAX_GREP_MATCHES: usize = 500;
/// Paths `glob` lists before stopping.
pub const MAX_GLOB_PATHS: usize = 1_000;

/// The standard tools' names, in the order the model is told about them.
pub fn tool_names() -> Vec<&'static str> {
    forkfleet_shared::tools::standard_names()
}

/// What a tool runs with: the branch's overlay, the worker's blob cache, the branch's tool
/// settings, and its place among the kept command trees.
pub struct Env<'a> {
    pub overlay: &'a mut Overlay,
    pub blobs: &'a BlobCache,
    pub settings: &'a ToolSettings,
    pub trees: Option<&'a TreeSlot>,
}

/// How a tool runs a call: `Err` only when the worker cannot go on (the blob store
/// fails); everything else is a result the model reads.
pub type RunFn =
    for<'a> fn(&'a ToolCall, Env<'a>) -> BoxFuture<'a, Result<ToolOutcome, WorkerError>>;

/// A tool the worker runs over a branch's overlay: what the model is told of it, and how
/// it runs. Its name matches its declaration in `forkfleet_shared::tools::TOOLS`.
pub struct Tool {
    pub name: &'static str,
    /// Its description and the JSON schema of its arguments.
    pub spec: fn() -> ToolSpec,
    pub run: RunFn,
}

/// Every tool the worker runs itself, one line each.
pub const REGISTRY: &[&Tool] = &[
    &files::READ_FILE,
    &files::WRITE_FILE,
    &files::EDIT_FILE,
    &files::DELETE_FILE,
    &files::LIST_FILES,
    &search::GLOB,
    &search::GREP,
    &command::TOOL,
    &http_get::TOOL,
];

/// The registered tool named `name`.
fn registered(name: &str) -> Option<&'static Tool> {
    REGISTRY.iter().copied().find(|t| t.name == name)
}

/// A [`Tool`] named `$name`, told to the model as `$spec` says, whose runner parses the
/// call's arguments into `$a` (their type is what `$body` takes) and answers `$body` (a
/// future of `Result<ToolOutcome, E>` with `WorkerError: From<E>`), with the [`Env`] as
/// `$env`. Arguments that do not parse are answered as failed, naming the tool.
macro_rules! tool {
    ($name:expr, $spec:expr, |$a:ident, $env:ident| $body:expr) => {
        $crate::tools::Tool {
            name: $name,
            spec: $spec,
            run: |call, $env| {
                Box::pin(async move {
                    match $crate::tools::args(call) {
                        Ok($a) => Ok($body.await?),
                        Err(e) => Ok(e),
                    }
                })
            },
        }
    };
}
use tool;

/// A list of tools offered, in order, and its size as JSON, measured once.
pub struct Offered {
    specs: Vec<ToolSpec>,
    json_bytes: usize,
}

/// Every list handed out so far, by the set of tools in it: one per combination of the
/// optional tools a worker has met.
static OFFERED: RwLock<Vec<(u64, &'static Offered)>> = RwLock::new(Vec::new());

/// The lists handed out so far (read on every model call's estimate).
fn offered_lists() -> std::sync::RwLockReadGuard<'static, Vec<(u64, &'static Offered)>> {
    OFFERED.read().unwrap_or_else(|p| p.into_inner())
}

/// The list offered to a branch with `settings`: the declared tools they enable, in
/// [`TOOLS`] order. The same settings get the same list (the same slice), so a provider's
/// estimate of a request's size can use its JSON size measured once
/// ([`measured_json_bytes`]).
pub fn offered(settings: &ToolSettings) -> &'static Offered {
    let mask = TOOLS
        .iter()
        .enumerate()
        .filter(|(_, t)| (t.offered)(settings))
        .fold(0u64, |m, (i, _)| m | (1 << i));
    if let Some((_, list)) = offered_lists().iter().find(|(m, _)| *m == mask) {
        return list;
    }
    let mut lists = OFFERED.write().unwrap_or_else(|p| p.into_inner());
    if let Some((_, list)) = lists.iter().find(|(m, _)| *m == mask) {
        return list;
    }
    let specs: Vec<ToolSpec> = TOOLS
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .filter_map(|(_, t)| spec_of(t.name))
        .collect();
    let json_bytes = tools_json_bytes(&specs);
    // At most one list per combination of optional tools, for the process's life.
    let list: &'static Offered = Box::leak(Box::new(Offered { specs, json_bytes }));
    lists.push((mask, list));
    list
}

/// What the model is told of the declared tool `name`: a registered tool's spec, or a
/// fork tool's.
fn spec_of(name: &str) -> Option<ToolSpec> {
    match registered(name) {
        Some(t) => Some((t.spec)()),
        None => fork_tool_specs().iter().find(|s| s.name == name).cloned(),
    }
}

/// The JSON size of `tools` when it is a list [`offered`] handed out (the same slice, not
/// an equal copy), measured once; `None` for any other list.
pub fn measured_json_bytes(tools: &[ToolSpec]) -> Option<usize> {
    offered_lists()
        .iter()
        .find(|(_, l)| std::ptr::eq(tools, l.specs.as_slice()))
        .map(|(_, l)| l.json_bytes)
}

/// The tools of one branch: the standard ones, and the optional ones its settings enable.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolBox {
    settings: ToolSettings,
    /// What the model is offered (the checkpoint tools aside).
    offered: &'static [ToolSpec],
    /// Where `run_command` keeps the branch's tree between calls; `None`: every call runs
    /// in a fresh copy.
    trees: Option<TreeSlot>,
    /// With the checkpoint tools: the whole list offered (the static one and those, as
    /// the spec describes them); they run in `crate::agent`.
    listed: Option<Arc<Vec<ToolSpec>>>,
}

impl Default for ToolBox {
    fn default() -> Self {
        Self::with_settings(ToolSettings::default())
    }
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

    /// The tools `settings` offer.
    pub fn with_settings(settings: ToolSettings) -> Self {
        let offered = offered(&settings).specs.as_slice();
        let listed = settings.checkpoint_tools.as_ref().map(|c| {
            let mut all = offered.to_vec();
            all.extend(crate::toolspec::checkpoint_tool_specs(&c.descriptions));
            Arc::new(all)
        });
        Self {
            settings,
            offered,
            trees: None,
            listed,
        }
    }

    /// The tools `task` offers its model.
    pub fn for_task(task: &BranchTask) -> Self {
        Self::with_settings(task.tools.clone())
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
        Self::with_settings(ToolSettings {
            run_command: command,
            ..ToolSettings::default()
        })
    }

    /// The definitions given to the model: a list [`offered`] hands out, so a provider's
    /// estimate can use its size measured once ([`measured_json_bytes`]), but with the
    /// checkpoint tools (described as the spec says) one of the task's own.
    pub fn specs(&self) -> &[ToolSpec] {
        match &self.listed {
            Some(list) => list.as_slice(),
            None => self.offered,
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
        let (Some(tool), Some(decl)) = (
            registered(&call.name),
            forkfleet_shared::tools::decl(&call.name),
        ) else {
            return Ok(ToolOutcome::err(format!(
                "unknown tool `{}`; available tools: {}",
                call.name,
                self.names().join(", ")
            )));
        };
        if !(decl.offered)(&self.settings) {
            return Ok(ToolOutcome::err(format!(
                "`{}` is not enabled for this run (the fork spec has no {}); available tools: {}",
                call.name,
                decl.enabled_by,
                self.names().join(", ")
            )));
        }
        let env = Env {
            overlay,
            blobs,
            settings: &self.settings,
            trees: self.trees.as_ref(),
        };
        (tool.run)(call, env).await
    }
}

/// Run one call of a standard tool against the overlay. `Err` only when the worker
/// cannot go on (the blob store fails).
pub async fn run_tool(
    call: &ToolCall,
    overlay: &mut Overlay,
    blobs: &BlobCache,
) -> Result<ToolOutcome, WorkerError> {
    ToolBox::standard().run(call, overlay, blobs).await
}

pub(crate) fn args<T: DeserializeOwned>(call: &ToolCall) -> Result<T, ToolOutcome> {
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

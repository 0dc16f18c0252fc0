//! What the model is offered, and what a tool answers.
//!
//! A tool's definition ([`ToolSpec`]: name, description, JSON schema of its arguments) is
//! data: the standard tools' ([`tool_specs`]), `run_command`'s ([`run_command_spec`]) and
//! the fork tools' ([`fork_tool_specs`]) are here, a newer tool's is in its own file
//! (`tools/http_get.rs`). The lists a branch is offered are `tools::offered`'s, built
//! once per combination of tools, with their JSON size ([`tools_json_bytes`]) measured
//! once. A tool's answer is a [`ToolOutcome`].
//!
//! What runs the tools is elsewhere: the file, search and command tools in `tools`, the
//! fork tools in `forktools`. This module uses neither of them, nor `provider`, so all
//! three can use it.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::sync::OnceLock;

/// A tool the model may call: its name, what it does, and its arguments as a JSON schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub parameters: serde_json::Value,
}

/// What a tool call answered: the output the model reads, and whether the tool did what
/// was asked (`ok = false`: bad arguments, a missing file, a command that failed, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutcome {
    pub ok: bool,
    pub output: String,
}

impl ToolOutcome {
    pub(crate) fn ok(output: String) -> Self {
        Self {
            ok: true,
            output: truncate(output),
        }
    }

    pub(crate) fn err(output: impl Into<String>) -> Self {
        Self {
            ok: false,
            output: truncate(output.into()),
        }
    }
}

/// Tool outputs longer than this many characters are truncated with a marker.
pub const MAX_OUTPUT_CHARS: usize = 30_000;

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

/// The name of the command tool, offered only when a task enables it.
pub const RUN_COMMAND: &str = "run_command";

pub const FORK_RUN: &str = "fork_run";
pub const INSPECT_BRANCHES: &str = "inspect_branches";
pub const MERGE_OR_SELECT: &str = "merge_or_select";
pub const TERMINATE_BRANCH: &str = "terminate_branch";
pub const DIFF_BRANCHES: &str = "diff_branches";
pub const FORK_COST: &str = "fork_cost";

pub const SAVE_CHECKPOINT: &str = "save_checkpoint";
pub const LIST_CHECKPOINTS: &str = "list_checkpoints";
pub const REWIND_TO: &str = "rewind_to";

/// The agents' checkpoint tools (`checkpoint_tools = true`), each with the description the
/// spec gives it (`[tool_descriptions]`) or the built-in one.
pub fn checkpoint_tool_specs(
    descriptions: &std::collections::BTreeMap<String, String>,
) -> Vec<ToolSpec> {
    let spec = |name: &str, builtin: &str, parameters: Value| ToolSpec {
        name: name.to_string(),
        description: descriptions
            .get(name)
            .cloned()
            .unwrap_or_else(|| builtin.to_string()),
        parameters,
    };
    vec![
        spec(
            SAVE_CHECKPOINT,
            "Save a named checkpoint of this run as it is now (the conversation before this answer of yours, and the files): rewind_to can bring both back later.",
            json!({"type": "object", "properties": {
                "label": {"type": "string", "description": "A name for it: letters, digits, -, _ and ."}
            }, "required": ["label"]}),
        ),
        spec(
            LIST_CHECKPOINTS,
            "List this run's checkpoints: label, the turn it was taken at, named or automatic.",
            json!({"type": "object", "properties": {}}),
        ),
        spec(
            REWIND_TO,
            "Rewind this run to a checkpoint (its label or id): the conversation and the files go back to what they were then, and everything after it is gone from both. Use it to abandon an approach that went wrong.",
            json!({"type": "object", "properties": {
                "checkpoint": {"type": "string", "description": "The checkpoint's label (or id)."}
            }, "required": ["checkpoint"]}),
        ),
    ]
}

/// True for a checkpoint tool's name.
pub fn is_checkpoint_tool(name: &str) -> bool {
    [SAVE_CHECKPOINT, LIST_CHECKPOINTS, REWIND_TO].contains(&name)
}

/// The longest `inspect_branches` waits for the branches to finish.
pub const MAX_WAIT_S: f64 = 600.0;

/// The standard tools' definitions (the file and search tools), in the order of
/// `forkfleet_shared::tools::TOOLS`.
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

/// The definition of the standard tool `name` (a copy of its entry in [`tool_specs`]).
pub(crate) fn standard_spec(name: &str) -> ToolSpec {
    tool_specs()
        .iter()
        .find(|s| s.name == name)
        .cloned()
        .unwrap_or_else(|| ToolSpec {
            name: name.to_string(),
            description: String::new(),
            parameters: json!({"type": "object"}),
        })
}

/// The definition of `run_command`, offered when a task enables it.
pub fn run_command_spec() -> ToolSpec {
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

/// The fork tools' definitions.
pub fn fork_tool_specs() -> &'static [ToolSpec] {
    static SPECS: OnceLock<Vec<ToolSpec>> = OnceLock::new();
    SPECS.get_or_init(|| {
        let spec = |name: &str, description: &str, parameters: Value| ToolSpec {
            name: name.to_string(),
            description: description.to_string(),
            parameters,
        };
        let fork_id = json!({"type": "string", "description": "The fork (default: the last one you made)."});
        vec![
            spec(
                FORK_RUN,
                "Fork this run into parallel branches that each try an approach in their own copy of the workspace (as it is now), sharing this conversation up to here. The branches run while you continue. Then call inspect_branches (wait_s to wait), diff_branches, and resolve the fork with merge_or_select before you finish. You cannot fork past the configured depth.",
                json!({"type": "object", "properties": {
                    "branches": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                        "label": {"type": "string", "description": "A short unique name: letters, digits, -, _ and ."},
                        "steer": {"type": "string", "description": "What this branch should try."},
                        "model": {"type": "string", "description": "A configured model (default: yours)."},
                        "budget_usd": {"type": "number", "minimum": 0},
                        "extra_instructions": {"type": "string"}
                    }, "required": ["label", "steer"]}},
                    "strategy": {"type": "string", "enum": ["manual", "auto", "auto_with_fallback", "vote"]},
                    "aggregate_budget_usd": {"type": "number", "minimum": 0, "description": "A cap on the whole fork's spend."},
                    "isolation": {"type": "object", "description": "What the branches share with you; these are the only values (and the defaults): each starts from a copy of this conversation, works in its own copy of the workspace, and is steered on its own.", "properties": {
                        "history": {"type": "string", "enum": ["copy"]},
                        "backend": {"type": "string", "enum": ["copy"]},
                        "message_queue": {"type": "string", "enum": ["isolated"]}
                    }, "additionalProperties": false}
                }, "required": ["branches"]}),
            ),
            spec(
                INSPECT_BRANCHES,
                "The fork's branches: state (pending, running, done, failed, terminated, budget_exhausted, aggregate_budget_exhausted, paused), turns, changes, cost. With wait_s, wait up to that many seconds for every branch to finish first.",
                json!({"type": "object", "properties": {
                    "fork_id": fork_id,
                    "wait_s": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S}
                }}),
            ),
            spec(
                MERGE_OR_SELECT,
                "Resolve the fork: `pick:<label>` merges that branch's file changes into your workspace (the other branches are stopped), `auto` lets the configured judge pick, `abort` discards every branch. A branch must have finished to be picked.",
                json!({"type": "object", "properties": {
                    "action": {"type": "string", "description": "pick:<label>, auto or abort"},
                    "fork_id": fork_id
                }, "required": ["action"]}),
            ),
            spec(
                TERMINATE_BRANCH,
                "Stop one branch of the fork; it keeps the work it did.",
                json!({"type": "object", "properties": {
                    "label": {"type": "string"},
                    "fork_id": fork_id
                }, "required": ["label"]}),
            ),
            spec(
                DIFF_BRANCHES,
                "Compare the branches: every path any branch touched, what each did, and where they agree.",
                json!({"type": "object", "properties": {
                    "paths": {"type": "array", "items": {"type": "string"}, "description": "Only these files or directories."},
                    "fork_id": fork_id
                }}),
            ),
            spec(
                FORK_COST,
                "What each branch of the fork spent, holds and may still spend, and the total.",
                json!({"type": "object", "properties": {"fork_id": fork_id}}),
            ),
        ]
    })
}

/// Bytes of the tool schemas encoded as JSON (as a request would carry them).
pub fn tools_json_bytes(tools: &[ToolSpec]) -> usize {
    let mut c = CountBytes::default();
    match serde_json::to_writer(&mut c, tools) {
        Ok(()) => c.0 as usize,
        Err(_) => 0,
    }
}

/// A writer that only counts the bytes written.
#[derive(Default)]
struct CountBytes(u64);

impl std::io::Write for CountBytes {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_tool_descriptions_are_the_specs_when_given() {
        let mut d = std::collections::BTreeMap::new();
        d.insert(
            SAVE_CHECKPOINT.to_string(),
            "Remember this point.".to_string(),
        );
        let specs = checkpoint_tool_specs(&d);
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, [SAVE_CHECKPOINT, LIST_CHECKPOINTS, REWIND_TO]);
        assert_eq!(specs[0].description, "Remember this point.");
        assert!(specs[2].description.starts_with("Rewind this run"));
        assert!(names.iter().all(|n| is_checkpoint_tool(n)));
    }
}

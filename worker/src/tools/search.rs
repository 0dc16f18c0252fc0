//! The search tools: `glob` over the workspace's paths and `grep` over its text files.

use super::{content, cut_line, overlay_err, path_or_return, ToolOutcome};
use super::{MAX_GLOB_PATHS, MAX_GREP_MATCHES};
use crate::cache::BlobCache;
use forkfleet_shared::blob::BlobError;
use forkfleet_shared::manifest::{FileEntry, Node};
use forkfleet_shared::overlay::{Overlay, OverlayError};
use forkfleet_shared::path::WsPath;
use serde::Deserialize;
use std::fmt::Write as _;

use super::{tool, Tool};
use crate::toolspec::standard_spec;

pub(super) const GLOB: Tool = tool!("glob", || standard_spec("glob"), |a, env| {
    std::future::ready(Ok::<_, BlobError>(glob(a, env.overlay)))
});
pub(super) const GREP: Tool = tool!("grep", || standard_spec("grep"), |a, env| {
    grep(a, env.overlay, env.blobs)
});

#[derive(Deserialize)]
pub(super) struct GlobArgs {
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

pub(super) fn glob(a: GlobArgs, ov: &Overlay) -> ToolOutcome {
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
pub(super) struct GrepArgs {
    pattern: String,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    glob: Option<String>,
}

pub(super) async fn grep(
    a: GrepArgs,
    ov: &mut Overlay,
    blobs: &BlobCache,
) -> Result<ToolOutcome, BlobError> {
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

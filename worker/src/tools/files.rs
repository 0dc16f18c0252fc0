//! The file tools: `read_file`, `write_file`, `edit_file`, `delete_file` and `list_files`.

use super::{cut_line, overlay_err, parse_path, path_or_return, resolve, text, ToolOutcome};
use super::{DEFAULT_READ_LIMIT, MAX_OUTPUT_CHARS};
use crate::cache::BlobCache;
use bytes::Bytes;
use forkfleet_shared::blob::BlobError;
use forkfleet_shared::manifest::{FileEntry, Node, MODE_FILE};
use forkfleet_shared::overlay::{apply_edit, Overlay, OverlayError};
use serde::Deserialize;
use std::fmt::Write as _;

use super::{tool, Tool};
use crate::toolspec::standard_spec;

pub(super) const READ_FILE: Tool = tool!("read_file", || standard_spec("read_file"), |a, env| {
    read_file(a, env.overlay, env.blobs)
});
pub(super) const WRITE_FILE: Tool =
    tool!("write_file", || standard_spec("write_file"), |a, env| {
        write_file(a, env.overlay, env.blobs)
    });
pub(super) const EDIT_FILE: Tool = tool!("edit_file", || standard_spec("edit_file"), |a, env| {
    edit_file(a, env.overlay, env.blobs)
});
pub(super) const DELETE_FILE: Tool =
    tool!("delete_file", || standard_spec("delete_file"), |a, env| {
        delete_file(a, env.overlay, env.blobs)
    });
pub(super) const LIST_FILES: Tool =
    tool!("list_files", || standard_spec("list_files"), |a, env| {
        list_files(a, env.overlay, env.blobs)
    });

#[derive(Deserialize)]
pub(super) struct ReadArgs {
    path: String,
    #[serde(default)]
    offset: Option<usize>,
    #[serde(default)]
    limit: Option<usize>,
}

pub(super) async fn read_file(
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
pub(super) struct WriteArgs {
    path: String,
    content: String,
}

pub(super) async fn write_file(
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
pub(super) struct EditArgs {
    path: String,
    old_string: String,
    new_string: String,
    #[serde(default)]
    replace_all: bool,
}

pub(super) async fn edit_file(
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
pub(super) struct DeleteArgs {
    path: String,
}

pub(super) async fn delete_file(
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
pub(super) struct ListArgs {
    #[serde(default)]
    path: Option<String>,
}

pub(super) async fn list_files(
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

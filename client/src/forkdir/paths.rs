//! Names and paths in the fork directory: every component checked, every path confined.

use super::*;
pub use crate::error::UnsafeName;

/// Check that `name` is exactly one normal path component: not empty, not `.` or `..`,
/// no `/` or `\`, no NUL or control character, at most 255 bytes (and on Windows no `:`).
/// Joined to a directory, such a name stays inside it.
pub fn check_component(name: &str) -> Result<(), UnsafeName> {
    let bad = |reason| {
        Err(UnsafeName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("it is empty");
    }
    if name == "." || name == ".." {
        return bad("it names a directory itself or its parent");
    }
    if name.contains(['/', '\\']) {
        return bad("it contains a path separator");
    }
    if name.chars().any(char::is_control) {
        return bad("it contains a NUL or control character");
    }
    if cfg!(windows) && name.contains(':') {
        return bad("it contains `:`");
    }
    if name.len() > MAX_NAME_BYTES {
        return bad("it is longer than 255 bytes");
    }
    let mut parts = Path::new(name).components();
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(_)), None) => Ok(()),
        _ => bad("it is not a plain file name"),
    }
}

/// `root` joined with the `/`-separated relative path `rel`, every component checked by
/// [`check_component`]: the result is always strictly inside `root`.
pub fn confined(root: &Path, rel: &str) -> Result<PathBuf, UnsafeName> {
    let mut out = root.to_path_buf();
    for part in rel.split('/') {
        check_component(part).map_err(|e| UnsafeName {
            name: rel.to_string(),
            reason: e.reason,
        })?;
        out.push(part);
    }
    Ok(out)
}

/// The directory name of a branch under `branches/`: the label itself when it is a valid
/// spec label and a plain name, else `~` and 16 hex digits of its SHA-256 (a valid label
/// never contains `~`, so the two never collide). `manifest.json` maps labels to
/// directories.
pub fn branch_dir_name(label: &str) -> String {
    if spec::check_label(label).is_ok() && check_component(label).is_ok() {
        label.to_string()
    } else {
        let hex = BlobHash::of(label.as_bytes()).to_hex();
        format!("~{}", hex.get(..16).unwrap_or(&hex))
    }
}

/// The fork directory of `fork` under `workspace`: `<workspace>/.forkfleet/forks/<id>`.
pub fn fork_dir(workspace: &Path, fork: ForkId) -> Result<PathBuf, UnsafeName> {
    let id = fork.to_string();
    check_component(&id)?;
    let mut dir = workspace.to_path_buf();
    for part in FORKS_DIR {
        dir.push(part);
    }
    dir.push(id);
    Ok(dir)
}

/// The workspace of `view` on this machine and its fork directory: an error when the
/// fork has no workspace or it is not a directory here.
pub(crate) fn locate(view: &ForkView) -> Result<(PathBuf, PathBuf), ClientError> {
    let Some(ws) = view.workspace.as_deref() else {
        return Err(ClientError::NoWorkspace { fork: view.fork_id });
    };
    let ws = PathBuf::from(ws);
    if !ws.is_dir() {
        return Err(ClientError::WorkspaceNotHere { path: ws });
    }
    let dir = fork_dir(&ws, view.fork_id)?;
    Ok((ws, dir))
}

/// Create the directories from `workspace` down to `dir` (`.forkfleet/forks/<id>`),
/// refusing to go through anything that is not a real directory.
pub(crate) fn prepare_root(workspace: &Path, dir: &Path) -> Result<(), ClientError> {
    let blocked = |path: &Path, why| ClientError::Blocked {
        path: path.to_path_buf(),
        why,
    };
    let rel = dir
        .strip_prefix(workspace)
        .map_err(|_| blocked(dir, "is not under the fork's workspace"))?;
    let mut cur = workspace.to_path_buf();
    for part in rel.components() {
        let Component::Normal(name) = part else {
            return Err(blocked(
                dir,
                "is not a plain path under the fork's workspace",
            ));
        };
        cur.push(name);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(blocked(
                    &cur,
                    "is a symbolic link; the fork directory is never written through one",
                ))
            }
            Ok(_) => return Err(blocked(&cur, "is in the way: it is not a directory")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => match std::fs::create_dir(&cur) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && cur.is_dir() => {}
                Err(e) => return Err(ClientError::io("create", cur, e)),
            },
            Err(e) => return Err(ClientError::io("read", cur, e)),
        }
    }
    Ok(())
}

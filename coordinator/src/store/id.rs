//! The store id: a UUID created with the run store, kept in the file `store-id` of the data
//! dir beside sled's files, so another process reads it without opening the store (sled
//! locks the directory to one process). The coordinator lease names it, so a coordinator
//! tells a standby of its own store from one of another.

use crate::error::CoordinatorError;
use std::io::Write as _;
use std::path::Path;

/// The file holding the store id, in the data dir.
/// The same name the workspace scan knows a data dir by.
pub const STORE_ID_FILE: &str = forkfleet_shared::scan::DATA_DIR_MARK;

/// The store id of the data dir `dir`, created (and the directory with it) if it has none.
/// Two processes creating it at once agree: the file appears whole or not at all (written
/// aside, then linked into place, which fails if it exists), and the loser reads the
/// winner's.
pub fn store_id(dir: &Path) -> Result<String, CoordinatorError> {
    let err = |what: &str, e: std::io::Error| CoordinatorError::StoreOpen {
        dir: dir.to_path_buf(),
        message: format!("{what} {STORE_ID_FILE}: {e}"),
    };
    let path = dir.join(STORE_ID_FILE);
    if let Some(id) = read(&path).map_err(|e| err("cannot read", e))? {
        return Ok(id);
    }
    std::fs::create_dir_all(dir).map_err(|e| err("cannot create the directory of", e))?;
    let id = uuid::Uuid::now_v7().to_string();
    let mut tmp = tempfile_in(dir).map_err(|e| err("cannot write", e))?;
    tmp.1
        .write_all(format!("{id}\n").as_bytes())
        .and_then(|()| tmp.1.sync_all())
        .map_err(|e| err("cannot write", e))?;
    let linked = std::fs::hard_link(&tmp.0, &path);
    let _ = std::fs::remove_file(&tmp.0);
    match linked {
        Ok(()) => Ok(id),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read(&path)
            .map_err(|e| err("cannot read", e))?
            .ok_or_else(|| err("cannot read", std::io::Error::other("it is empty"))),
        Err(e) => Err(err("cannot create", e)),
    }
}

/// The id in `path`, `None` if there is no such file.
fn read(path: &Path) -> std::io::Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let id = text.trim();
            if id.is_empty() {
                Err(std::io::Error::other("it is empty"))
            } else {
                Ok(Some(id.to_string()))
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A new file of a unique name in `dir`, and its path.
fn tempfile_in(dir: &Path) -> std::io::Result<(std::path::PathBuf, std::fs::File)> {
    let path = dir.join(format!(".{STORE_ID_FILE}.{}", uuid::Uuid::now_v7()));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)?;
    Ok((path, file))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn created_once_then_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let id = store_id(&data).unwrap();
        assert_eq!(id.len(), 36, "{id}");
        assert_eq!(store_id(&data).unwrap(), id);
        let other = store_id(&dir.path().join("other")).unwrap();
        assert_ne!(other, id);
        // Nothing but the id file is left behind.
        let names: Vec<_> = std::fs::read_dir(&data)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [STORE_ID_FILE]);
    }
}

//! The in-memory parents: a manifest ([`ManifestTarget`], how the coordinator computes the
//! parent's next workspace version) and a branch's overlay.

use super::FlushTarget;
use crate::manifest::{FileEntry, Manifest, Node};
use crate::path::WsPath;

/// An in-memory parent: a manifest mutated in place.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ManifestTarget {
    manifest: Manifest,
}

impl ManifestTarget {
    pub fn new(manifest: Manifest) -> Self {
        Self { manifest }
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn into_manifest(self) -> Manifest {
        self.manifest
    }

    fn file_in_the_way(&self, path: &WsPath) -> Option<WsPath> {
        path.ancestors()
            .find(|a| self.manifest.files.contains_key(a))
    }
}

impl FlushTarget for ManifestTarget {
    fn node(&self, path: &WsPath) -> Node {
        self.manifest.node(path)
    }

    fn files_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.manifest
            .files_under(dir)
            .map(|(p, _)| p.clone())
            .collect()
    }

    fn dirs_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.manifest.dirs_under(dir).cloned().collect()
    }

    fn write(&mut self, path: &WsPath, entry: &FileEntry) -> Result<(), String> {
        if path.is_root() || self.manifest.dirs.contains(path) {
            return Err(format!("`{path}` is a directory"));
        }
        if let Some(a) = self.file_in_the_way(path) {
            return Err(format!("`{a}` is a file, not a directory"));
        }
        self.manifest.insert_file(path.clone(), *entry);
        Ok(())
    }

    fn delete_file(&mut self, path: &WsPath) -> Result<(), String> {
        if self.manifest.dirs.contains(path) {
            return Err(format!("`{path}` is a directory"));
        }
        self.manifest.files.remove(path);
        Ok(())
    }

    fn mkdir(&mut self, path: &WsPath) -> Result<(), String> {
        if path.is_root() {
            return Ok(());
        }
        if self.manifest.files.contains_key(path) {
            return Err(format!(
                "cannot create directory `{path}`: a file exists there"
            ));
        }
        if let Some(a) = self.file_in_the_way(path) {
            return Err(format!("`{a}` is a file, not a directory"));
        }
        for a in path.ancestors() {
            self.manifest.dirs.insert(a);
        }
        self.manifest.dirs.insert(path.clone());
        Ok(())
    }

    fn remove_dir_if_empty(&mut self, path: &WsPath) -> Result<bool, String> {
        if !self.manifest.dirs.contains(path)
            || self.manifest.files_under(path).next().is_some()
            || self.manifest.dirs_under(path).next().is_some()
        {
            return Ok(false);
        }
        Ok(self.manifest.dirs.remove(path))
    }
}

// ---------------------------------------------------------------------------------------
// An overlay as the parent

/// A branch's overlay as the parent: a fork an agent made inside its branch merges into
/// that branch's overlay (ADR 14). Every replayed op lands in the overlay's change log, so
/// the branch publishes (or its fork actor appends) them as its own file changes.
impl FlushTarget for crate::overlay::Overlay {
    fn node(&self, path: &WsPath) -> Node {
        crate::overlay::Overlay::node(self, path)
    }

    fn files_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.files()
            .into_iter()
            .map(|(p, _)| p)
            .filter(|p| p.starts_with(dir) && p != dir)
            .collect()
    }

    fn dirs_under(&self, dir: &WsPath) -> Vec<WsPath> {
        self.dirs()
            .into_iter()
            .filter(|p| p.starts_with(dir) && p != dir)
            .collect()
    }

    fn write(&mut self, path: &WsPath, entry: &FileEntry) -> Result<(), String> {
        crate::overlay::Overlay::write(self, path, *entry).map_err(|e| e.to_string())
    }

    fn delete_file(&mut self, path: &WsPath) -> Result<(), String> {
        match crate::overlay::Overlay::node(self, path) {
            Node::Dir => Err(format!("`{path}` is a directory")),
            Node::Missing => Ok(()),
            Node::File(_) => self.delete(path).map_err(|e| e.to_string()),
        }
    }

    fn mkdir(&mut self, path: &WsPath) -> Result<(), String> {
        if path.is_root() {
            return Ok(());
        }
        crate::overlay::Overlay::mkdir(self, path).map_err(|e| e.to_string())
    }

    fn remove_dir_if_empty(&mut self, path: &WsPath) -> Result<bool, String> {
        if crate::overlay::Overlay::node(self, path) != Node::Dir || path.is_root() {
            return Ok(false);
        }
        match self.list(path) {
            Ok(children) if children.is_empty() => {
                self.rmdir(path).map_err(|e| e.to_string())?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

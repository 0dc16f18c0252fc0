//! Helpers shared by the integration tests of forkfleet-shared.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_FILE};
use forkfleet_shared::path::WsPath;
use std::collections::HashMap;

pub fn p(s: &str) -> WsPath {
    WsPath::parse(s).unwrap()
}

pub fn entry(content: &str) -> FileEntry {
    FileEntry::for_bytes(content.as_bytes(), MODE_FILE)
}

/// A blob map that remembers every content it has handed out an entry for.
#[derive(Default, Clone)]
pub struct Blobs(pub HashMap<BlobHash, Bytes>);

impl Blobs {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn entry_mode(&mut self, content: &[u8], mode: u32) -> FileEntry {
        let e = FileEntry::for_bytes(content, mode);
        self.0.insert(e.hash, Bytes::copy_from_slice(content));
        e
    }

    pub fn entry(&mut self, content: &str) -> FileEntry {
        self.entry_mode(content.as_bytes(), MODE_FILE)
    }

    pub fn get(&self, h: &BlobHash) -> Option<Bytes> {
        self.0.get(h).cloned()
    }
}

/// A manifest with the given files (text contents), registering their blobs.
pub fn manifest(blobs: &mut Blobs, files: &[(&str, &str)]) -> Manifest {
    let mut m = Manifest::default();
    for (path, content) in files {
        m.insert_file(p(path), blobs.entry(content));
    }
    m
}

//! The diff report's JSON form: branch labels instead of indices on output, labels or
//! indices on input, and the field helpers for hashes and shared diff texts.

use super::{Agreement, BranchChange, DiffReport, DiffSummary, FileInfo, Operation, PathDiff};
use crate::path::WsPath;
use serde::ser::{SerializeMap, SerializeSeq, SerializeStruct};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::HashMap;
use std::sync::Arc;

pub(super) mod hex_hash {
    use crate::blob::BlobHash;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(h: &BlobHash, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&h.to_hex())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BlobHash, D::Error> {
        let s = String::deserialize(d)?;
        BlobHash::from_hex(&s).ok_or_else(|| serde::de::Error::custom("invalid sha256 hex"))
    }
}

pub(super) mod arc_str_opt {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::sync::Arc;

    pub fn serialize<S: Serializer>(v: &Option<Arc<str>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(t) => s.serialize_some(t.as_ref()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Arc<str>>, D::Error> {
        Ok(Option::<String>::deserialize(d)?.map(Arc::from))
    }
}

struct PathsView<'a>(&'a DiffReport);
struct PathView<'a>(&'a DiffReport, &'a PathDiff);
struct OperationsView<'a>(&'a DiffReport, &'a PathDiff);
struct ChangesView<'a>(&'a DiffReport, &'a PathDiff);
struct ChangeView<'a>(&'a DiffReport, &'a BranchChange);

impl Serialize for DiffReport {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("DiffReport", 3)?;
        st.serialize_field("branches", &self.branches)?;
        st.serialize_field("summary", &self.summary)?;
        st.serialize_field("paths", &PathsView(self))?;
        st.end()
    }
}

impl Serialize for PathsView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.paths.len()))?;
        for p in &self.0.paths {
            seq.serialize_element(&PathView(self.0, p))?;
        }
        seq.end()
    }
}

impl Serialize for PathView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let p = self.1;
        let mut st = s.serialize_struct("PathDiff", 5)?;
        st.serialize_field("path", &p.path)?;
        st.serialize_field("agreement", &p.agreement)?;
        st.serialize_field("parent", &p.parent)?;
        st.serialize_field("operations", &OperationsView(self.0, p))?;
        st.serialize_field("changes", &ChangesView(self.0, p))?;
        st.end()
    }
}

impl Serialize for OperationsView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.1.changes.len()))?;
        for c in &self.1.changes {
            map.serialize_entry(self.0.label(c.branch), &c.operation)?;
        }
        map.end()
    }
}

impl Serialize for ChangesView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.1.changes.len()))?;
        for c in &self.1.changes {
            seq.serialize_element(&ChangeView(self.0, c))?;
        }
        seq.end()
    }
}

impl Serialize for ChangeView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let c = self.1;
        let mut st = s.serialize_struct("BranchChange", 5)?;
        st.serialize_field("branch", self.0.label(c.branch))?;
        st.serialize_field("operation", &c.operation)?;
        st.serialize_field("entry", &c.entry)?;
        st.serialize_field("diff", &c.diff.as_deref())?;
        st.serialize_field("truncated", &c.truncated)?;
        st.end()
    }
}

#[derive(Deserialize)]
struct RawReport {
    branches: Vec<String>,
    summary: DiffSummary,
    paths: Vec<RawPath>,
}

#[derive(Deserialize)]
struct RawPath {
    path: WsPath,
    agreement: Agreement,
    parent: Option<FileInfo>,
    #[serde(default)]
    changes: Vec<RawChange>,
}

#[derive(Deserialize)]
struct RawChange {
    branch: RawBranch,
    operation: Operation,
    entry: Option<FileInfo>,
    #[serde(default)]
    diff: Option<String>,
    #[serde(default)]
    truncated: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawBranch {
    Index(u32),
    Label(String),
}

impl<'de> Deserialize<'de> for DiffReport {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawReport::deserialize(d)?;
        let mut index: HashMap<&str, u32> = HashMap::new();
        for (i, b) in raw.branches.iter().enumerate() {
            let i = u32::try_from(i).map_err(serde::de::Error::custom)?;
            index.entry(b.as_str()).or_insert(i);
        }
        let mut paths = Vec::with_capacity(raw.paths.len());
        for p in raw.paths {
            let mut changes = Vec::with_capacity(p.changes.len());
            for c in p.changes {
                let branch = match c.branch {
                    RawBranch::Index(i) => i,
                    RawBranch::Label(l) => *index.get(l.as_str()).ok_or_else(|| {
                        serde::de::Error::custom(format!("unknown branch label `{l}`"))
                    })?,
                };
                changes.push(BranchChange {
                    branch,
                    operation: c.operation,
                    entry: c.entry,
                    diff: c.diff.map(Arc::from),
                    truncated: c.truncated,
                });
            }
            changes.sort_by_key(|c| c.branch);
            paths.push(PathDiff {
                path: p.path,
                agreement: p.agreement,
                parent: p.parent,
                changes,
            });
        }
        Ok(DiffReport {
            branches: raw.branches,
            summary: raw.summary,
            paths,
        })
    }
}

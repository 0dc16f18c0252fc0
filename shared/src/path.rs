//! Workspace paths: normalised, relative, `/`-separated, and confined to the workspace root.
//!
//! Every path that enters the system from a spec, a tool call or a CLI argument is parsed
//! here. `..` that would leave the root, absolute paths outside the root, NUL bytes and empty
//! components are rejected; `.` and repeated separators are folded away.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// A normalised path relative to the workspace root. The root itself is the empty path.
///
/// The text is shared (`Arc<str>`): a manifest of a large workspace is cloned and compared
/// with another on every command a branch runs (ADR 31), and a clone of a path is then a
/// count, not an allocation; two paths of one allocation compare equal without reading it.
#[derive(Clone, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WsPath(Arc<str>);

impl Default for WsPath {
    fn default() -> Self {
        Self::root()
    }
}

impl PartialEq for WsPath {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl Eq for WsPath {}

impl std::hash::Hash for WsPath {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As `str` hashes, which `Borrow<str>` requires.
        self.0.hash(state)
    }
}

impl PartialOrd for WsPath {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for WsPath {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        if Arc::ptr_eq(&self.0, &other.0) {
            return std::cmp::Ordering::Equal;
        }
        self.0.cmp(&other.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("path `{0}` leaves the workspace (a `..` climbs above the root)")]
    Escapes(String),
    #[error("path `{0}` contains a NUL byte")]
    Nul(String),
    #[error("path `{0}` is empty; name a file or directory inside the workspace")]
    Empty(String),
    #[error("path `{path}` is a symlink that points outside the workspace (to `{target}`)")]
    SymlinkEscapes { path: String, target: String },
}

impl WsPath {
    /// The workspace root.
    pub fn root() -> Self {
        static ROOT: std::sync::OnceLock<Arc<str>> = std::sync::OnceLock::new();
        Self(ROOT.get_or_init(|| Arc::from("")).clone())
    }

    /// Parse a path given by a user or an agent. A leading `/` means the workspace root
    /// (agents often write `/src/main.rs`), so absolute-looking paths are taken relative to it.
    pub fn parse(input: &str) -> Result<Self, PathError> {
        Self::parse_in(&WsPath::root(), input)
    }

    /// Parse `input` relative to the directory `base` (used for symlink targets).
    pub fn parse_in(base: &WsPath, input: &str) -> Result<Self, PathError> {
        if input.contains('\0') {
            return Err(PathError::Nul(input.to_string()));
        }
        let normalised = input.replace('\\', "/");
        let mut parts: Vec<&str> = if normalised.starts_with('/') {
            Vec::new()
        } else {
            base.components().collect()
        };
        for part in normalised.split('/') {
            match part {
                "" | "." => {}
                ".." => {
                    if parts.pop().is_none() {
                        return Err(PathError::Escapes(input.to_string()));
                    }
                }
                other => parts.push(other),
            }
        }
        Ok(Self(Arc::from(parts.join("/"))))
    }

    /// Like [`WsPath::parse`], but the root itself is not a valid answer.
    pub fn parse_file(input: &str) -> Result<Self, PathError> {
        let p = Self::parse(input)?;
        if p.is_root() {
            return Err(PathError::Empty(input.to_string()));
        }
        Ok(p)
    }

    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn components(&self) -> impl DoubleEndedIterator<Item = &str> {
        self.0.split('/').filter(|c| !c.is_empty())
    }

    /// The last component; empty for the root.
    pub fn file_name(&self) -> &str {
        self.0.rsplit('/').next().unwrap_or("")
    }

    /// The parent directory; `None` for the root.
    pub fn parent(&self) -> Option<WsPath> {
        if self.is_root() {
            return None;
        }
        Some(match self.0.rfind('/') {
            Some(i) => WsPath(Arc::from(&self.0[..i])),
            None => WsPath::root(),
        })
    }

    /// Every proper ancestor as a string slice, nearest the root first (root excluded).
    pub fn ancestor_strs(&self) -> impl Iterator<Item = &str> + '_ {
        self.0.match_indices('/').map(move |(i, _)| &self.0[..i])
    }

    /// Every proper ancestor, nearest the root first (the root itself excluded).
    pub fn ancestors(&self) -> impl Iterator<Item = WsPath> + '_ {
        self.0
            .match_indices('/')
            .map(move |(i, _)| WsPath(Arc::from(&self.0[..i])))
    }

    pub fn join(&self, name: &str) -> Result<WsPath, PathError> {
        // One plain name (a directory's entry): appended, nothing to normalise.
        let plain =
            !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0']);
        if plain {
            let mut s = String::with_capacity(self.0.len() + 1 + name.len());
            if !self.0.is_empty() {
                s.push_str(&self.0);
                s.push('/');
            }
            s.push_str(name);
            return Ok(Self(Arc::from(s)));
        }
        Self::parse_in(self, name)
    }

    /// True when `self` is `other` or lies below it.
    pub fn starts_with(&self, other: &WsPath) -> bool {
        other.is_root()
            || self.0 == other.0
            || (self.0.len() > other.0.len()
                && self.0.starts_with(&*other.0)
                && self.0.as_bytes()[other.0.len()] == b'/')
    }

    /// The key prefix of everything strictly below this directory.
    pub fn child_prefix(&self) -> String {
        if self.is_root() {
            String::new()
        } else {
            format!("{}/", self.0)
        }
    }

    /// The path as a relative OS path under `root`.
    pub fn to_os_path(&self, root: &std::path::Path) -> std::path::PathBuf {
        let mut p = root.to_path_buf();
        for c in self.components() {
            p.push(c);
        }
        p
    }
}

impl fmt::Display for WsPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_root() {
            f.write_str(".")
        } else {
            f.write_str(&self.0)
        }
    }
}

impl fmt::Debug for WsPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::borrow::Borrow<str> for WsPath {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for WsPath {
    type Error = PathError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        // A path as this type writes it (every path of a stored manifest) is taken as it
        // is: parsing would give it back unchanged.
        if is_normal(&value) {
            return Ok(Self(Arc::from(value)));
        }
        Self::parse(&value)
    }
}

/// True when [`WsPath::parse`] would return `s` unchanged: no NUL or backslash, and
/// `/`-separated components none of which is empty, `.` or `..`.
fn is_normal(s: &str) -> bool {
    s.is_empty()
        || (!s.contains(['\0', '\\']) && s.split('/').all(|c| !matches!(c, "" | "." | "..")))
}

impl From<WsPath> for String {
    fn from(value: WsPath) -> Self {
        value.0.to_string()
    }
}

impl std::str::FromStr for WsPath {
    type Err = PathError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A path taken as it is when decoded is one that parsing gives back unchanged,
        /// and every other text is parsed (or refused) as ever.
        #[test]
        fn a_decoded_path_is_what_parsing_gives(s in "[a./\\\\\\x00]{0,12}") {
            let decoded: Result<WsPath, _> = WsPath::try_from(s.clone());
            let parsed = WsPath::parse(&s);
            proptest::prop_assert_eq!(decoded.as_ref().map(WsPath::as_str).ok(), parsed.as_ref().map(WsPath::as_str).ok());
            if is_normal(&s) {
                proptest::prop_assert_eq!(parsed.map(|p| p.as_str().to_string()).ok(), Some(s));
            }
        }
    }

    #[test]
    fn normalises() {
        assert_eq!(WsPath::parse("a/./b//c").unwrap().as_str(), "a/b/c");
        assert_eq!(
            WsPath::parse("/src/main.rs").unwrap().as_str(),
            "src/main.rs"
        );
        assert_eq!(WsPath::parse("a/b/../c").unwrap().as_str(), "a/c");
        assert!(WsPath::parse("./").unwrap().is_root());
    }

    #[test]
    fn rejects_escape_and_nul() {
        assert!(matches!(WsPath::parse("../x"), Err(PathError::Escapes(_))));
        assert!(matches!(
            WsPath::parse("a/../../x"),
            Err(PathError::Escapes(_))
        ));
        assert!(matches!(
            WsPath::parse("/../etc/passwd"),
            Err(PathError::Escapes(_))
        ));
        assert!(matches!(WsPath::parse("a\0b"), Err(PathError::Nul(_))));
        assert!(matches!(WsPath::parse_file("/"), Err(PathError::Empty(_))));
    }

    #[test]
    fn relations() {
        let p = WsPath::parse("a/b/c").unwrap();
        assert_eq!(p.parent().unwrap().as_str(), "a/b");
        assert_eq!(p.file_name(), "c");
        let anc: Vec<_> = p.ancestors().map(|a| a.0.to_string()).collect();
        assert_eq!(anc, vec!["a", "a/b"]);
        assert!(p.starts_with(&WsPath::parse("a").unwrap()));
        assert!(!WsPath::parse("ab")
            .unwrap()
            .starts_with(&WsPath::parse("a").unwrap()));
        assert!(p.starts_with(&WsPath::root()));
        let rel = WsPath::parse_in(&WsPath::parse("a/b").unwrap(), "../x").unwrap();
        assert_eq!(rel.as_str(), "a/x");
    }

    #[test]
    fn serde_rejects_escaping_paths() {
        let bad: Result<WsPath, _> = serde_json::from_str("\"../../etc\"");
        assert!(bad.is_err());
    }
}

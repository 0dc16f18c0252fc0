//! The materialised fork directory: every branch's version of what a fork touched, as real
//! files, for people and their diff tools (`docs/FORKDIR.md`).
//!
//! ```text
//! <workspace>/.forkfleet/forks/<fork id>/
//! ├── manifest.json      the fork, its branches (state, cost, turns, what each touched)
//! │                      and every touched path (parent file, per branch operation)
//! ├── parent/            every touched path as it was at fork time
//! └── branches/<label>/  the same paths as each branch has them: a path the branch
//!                        deleted is absent, one it did not touch is the parent's version
//! ```
//!
//! Everything comes from the coordinator's API ([`Client`]: the fork view, the
//! diff report, blob contents), so it works embedded and against a cluster. A sync
//! ([`Materializer`]) is incremental and idempotent: a file is written only when its
//! content differs, an entry no longer part of the view is removed, `manifest.json` is
//! replaced atomically. [`follow`] keeps the directory in step while a fork runs (at most
//! one sync per [`LIVE_SYNC_EVERY`], and a final one); [`remove_after_merge`] deletes it
//! once the fork is merged unless the plan says `keep_artifacts`; [`open`] syncs it and
//! launches a diff tool on it.
//!
//! **Confinement.** Nothing is written outside the fork directory, whatever a coordinator
//! sends: a branch label that is not a plain name (see [`branch_dir_name`]) is replaced by
//! an encoded one, every path component is checked ([`check_component`], [`confined`]),
//! the directories from the workspace down to the fork directory must be real directories
//! (never followed through a symbolic link), inside the fork directory anything standing
//! where a directory belongs is removed rather than followed, and symbolic links in a
//! branch are written as plain files holding their target.

use crate::client::Client;
use crate::error::ClientError;
use crate::watch::{follow_with, Until};
use bytes::Bytes;
use forkfleet_shared::api::ApiClient;
use forkfleet_shared::api::ForkView;
use forkfleet_shared::blob::{self, BlobHash, BlobStore};
use forkfleet_shared::diff::{
    BranchChange, DiffOptions, DiffReport, FileInfo, Operation, PathDiff,
};
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::manifest::MODE_EXEC;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::spec;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::io::{self, IsTerminal};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The directory under a workspace that holds the fork directories.
pub const FORKS_DIR: [&str; 2] = [".forkfleet", "forks"];
/// The fork directory's description of itself.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The fork-time versions of the touched paths.
pub const PARENT_DIR: &str = "parent";
/// One directory per branch under it.
pub const BRANCHES_DIR: &str = "branches";
/// The diff tool template of `forkfleet fork open`.
pub const DIFFTOOL_ENV: &str = "FORKFLEET_DIFFTOOL";
/// The most often [`follow`] syncs while a fork runs.
pub const LIVE_SYNC_EVERY: Duration = Duration::from_secs(1);
/// The version of `manifest.json`'s layout.
pub const MANIFEST_FORMAT: u32 = 1;
/// The longest a file name may be (most file systems: 255 bytes).
const MAX_NAME_BYTES: usize = 255;
/// Temporary files (a write in progress) start with this.
const TMP_PREFIX: &str = ".ff-tmp-";
/// A temporary file younger than this may be another process's write in progress.
const TMP_GRACE: Duration = Duration::from_secs(60);
/// The most editor tabs `fork open` opens at once without a PATH (VS Code).
pub const MAX_PAIRS: usize = 16;
/// The most touched paths an error message lists.
const MAX_LISTED: usize = 20;

mod cleanup;
mod layout;
mod live;
mod open;
mod paths;
mod sync;
mod termdiff;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;

pub use cleanup::*;
use layout::*;
pub use live::*;
pub use open::*;
pub use paths::*;
pub use sync::*;
pub use termdiff::*;

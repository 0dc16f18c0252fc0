//! The change log between two workspace versions (a rewind to a checkpoint).

use crate::manifest::Manifest;
use crate::overlay::ChangeOp;
use crate::path::WsPath;

/// The change log that turns workspace version `from` into version `to` (a rewind to a
/// checkpoint): deletes of the files only `from` has (outside the directories removed),
/// rmdirs of the topmost directories only `from` has, mkdirs of the new directories no
/// write creates, and writes of the files `to` has new or different (content or mode).
///
/// Replayed with [`flush`](super::flush()) against `from` as the snapshot, a target at version `from` ends
/// at version `to`; a path of the target that differs from `from` (edited since) is a
/// conflict, kept under [`ConflictPolicy::KeepParent`](super::ConflictPolicy::KeepParent).
pub fn changes_between(from: &Manifest, to: &Manifest) -> Vec<ChangeOp> {
    let gone_dir = |d: &WsPath| !to.dirs.contains(d);
    // Topmost: its parent stays (or is the root).
    let removed_dirs: Vec<&WsPath> = from
        .dirs
        .iter()
        .filter(|d| gone_dir(d))
        .filter(|d| d.parent().is_none_or(|p| p.is_root() || !gone_dir(&p)))
        .collect();
    let under_removed = |p: &WsPath| {
        p.ancestor_strs()
            .any(|a| from.dirs.contains(a) && !to.dirs.contains(a))
    };
    let mut ops = Vec::new();
    // Both file maps are in path order: one merge walk pairs them (no lookups).
    let mut old = from.files.iter().peekable();
    let mut writes = Vec::new();
    for (path, entry) in &to.files {
        while let Some((p, _)) = old.next_if(|(p, _)| *p < path) {
            if !under_removed(p) {
                ops.push(ChangeOp::Delete { path: p.clone() });
            }
        }
        let same = old
            .next_if(|(p, _)| *p == path)
            .is_some_and(|(_, e)| e.same_as(entry));
        if !same {
            writes.push(ChangeOp::Write {
                path: path.clone(),
                entry: *entry,
            });
        }
    }
    for (p, _) in old {
        if !under_removed(p) {
            ops.push(ChangeOp::Delete { path: p.clone() });
        }
    }
    for d in removed_dirs {
        ops.push(ChangeOp::Rmdir { path: d.clone() });
    }
    for d in to.dirs.difference(&from.dirs) {
        let leaf = to.files_under(d).next().is_none() && to.dirs_under(d).next().is_none();
        if leaf {
            ops.push(ChangeOp::Mkdir { path: d.clone() });
        }
    }
    ops.extend(writes);
    ops
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::flush::{flush, ConflictPolicy, FlushReport, ManifestTarget};
    use crate::manifest::{FileEntry, MODE_EXEC, MODE_FILE};

    fn p(s: &str) -> WsPath {
        WsPath::parse(s).unwrap()
    }

    fn manifest(files: &[(&str, &str, u32)], dirs: &[&str]) -> Manifest {
        let mut m = Manifest::default();
        for (path, content, mode) in files {
            m.insert_file(p(path), FileEntry::for_bytes(content.as_bytes(), *mode));
        }
        for d in dirs {
            let d = p(d);
            m.dirs.extend(d.ancestors());
            m.dirs.insert(d);
        }
        m
    }

    fn replay(from: &Manifest, to: &Manifest) -> (Vec<ChangeOp>, Manifest, FlushReport) {
        let ops = changes_between(from, to);
        let mut target = ManifestTarget::new(from.clone());
        let report = flush(&ops, from, &mut target, ConflictPolicy::KeepParent);
        (ops, target.into_manifest(), report)
    }

    #[test]
    fn replaying_the_changes_between_two_versions_reaches_the_second() {
        let from = manifest(
            &[
                ("a.txt", "one", MODE_FILE),
                ("keep.txt", "same", MODE_FILE),
                ("run.sh", "echo", MODE_FILE),
                ("old/deep/x.txt", "x", MODE_FILE),
                ("was_file", "f", MODE_FILE),
                ("was_dir/y.txt", "y", MODE_FILE),
            ],
            &["empty_old"],
        );
        let to = manifest(
            &[
                ("a.txt", "two", MODE_FILE),
                ("keep.txt", "same", MODE_FILE),
                ("run.sh", "echo", MODE_EXEC),
                ("new/z.txt", "z", MODE_FILE),
                ("was_file/inner.txt", "i", MODE_FILE),
                ("was_dir", "now a file", MODE_FILE),
            ],
            &["empty_new/leaf"],
        );
        let (ops, reached, report) = replay(&from, &to);
        assert_eq!(reached, to, "{ops:?}");
        assert!(
            report.conflicts.is_empty() && report.errors.is_empty(),
            "{report:?}"
        );
        // Minimal: one rmdir for the removed tree, nothing for the unchanged file, one
        // mkdir for the empty leaf only.
        let kinds: Vec<String> = ops
            .iter()
            .map(|o| format!("{} {}", o.kind(), o.path()))
            .collect();
        assert!(kinds.contains(&"rmdir old".to_string()), "{kinds:?}");
        assert!(!kinds.iter().any(|k| k.contains("old/deep")), "{kinds:?}");
        assert!(!kinds.iter().any(|k| k.contains("keep.txt")), "{kinds:?}");
        assert!(
            kinds.contains(&"mkdir empty_new/leaf".to_string()),
            "{kinds:?}"
        );
        assert!(!kinds.contains(&"mkdir empty_new".to_string()), "{kinds:?}");
        assert!(kinds.contains(&"write run.sh".to_string()), "{kinds:?}");
        // And back.
        let (_, back, report) = replay(&to, &from);
        assert_eq!(back, from);
        assert!(report.conflicts.is_empty() && report.errors.is_empty());
        assert!(changes_between(&to, &to).is_empty());
    }

    #[test]
    fn a_target_edited_since_keeps_its_edit_as_a_conflict() {
        let from = manifest(
            &[("a.txt", "merged", MODE_FILE), ("b.txt", "b", MODE_FILE)],
            &[],
        );
        let to = manifest(&[("a.txt", "original", MODE_FILE)], &[]);
        let ops = changes_between(&from, &to);
        // The target edited a.txt after version `from`, and made c.txt.
        let mut edited = from.clone();
        edited.insert_file(p("a.txt"), FileEntry::for_bytes(b"local edit", MODE_FILE));
        let mut target = ManifestTarget::new(edited);
        let report = flush(&ops, &from, &mut target, ConflictPolicy::KeepParent);
        assert_eq!(report.conflicts, vec![p("a.txt")]);
        assert_eq!(report.deleted_paths, vec![p("b.txt")]);
        let m = target.into_manifest();
        assert_eq!(
            m.files[&p("a.txt")].hash,
            FileEntry::for_bytes(b"local edit", MODE_FILE).hash
        );
    }
}

//! The cross-branch diff report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::common;

use common::{p, Blobs};
use forkfleet_shared::diff::{
    diff_overlays, diff_report, render_summary, Agreement, DiffOptions, DiffReport, Operation,
    KEEP_DIFF_LINES,
};
use forkfleet_shared::manifest::{FileEntry, Manifest, MODE_EXEC, MODE_FILE};
use forkfleet_shared::overlay::{NetChange, Overlay};
use forkfleet_shared::path::WsPath;
use std::collections::BTreeMap;
use std::sync::Arc;

struct Fixture {
    base: Arc<Manifest>,
    blobs: Blobs,
    branches: Vec<(String, Overlay)>,
}

impl Fixture {
    fn report(&self, opts: &DiffOptions) -> DiffReport {
        let inputs: Vec<(&str, &Overlay)> =
            self.branches.iter().map(|(l, o)| (l.as_str(), o)).collect();
        let blobs = &self.blobs;
        diff_overlays(&self.base, &inputs, &|h| blobs.get(h), opts)
    }
}

/// base: x.txt s.txt d.txt keep.txt sub/one.txt sub/two.txt
/// b0: x->A, s->S, delete d, create new0, sub/one->1
/// b1: x->B, s->S, delete d, sub/two->2, create gone (then delete it: no net change),
///     write keep.txt back with its original content (no net change)
/// b2: create only2
fn fixture() -> Fixture {
    let mut blobs = Blobs::new();
    let base = Arc::new(common::manifest(
        &mut blobs,
        &[
            ("x.txt", "base\n"),
            ("s.txt", "s\n"),
            ("d.txt", "d\n"),
            ("keep.txt", "k\n"),
            ("sub/one.txt", "one\n"),
            ("sub/two.txt", "two\n"),
        ],
    ));
    let mut b0 = Overlay::new(base.clone());
    b0.write(&p("x.txt"), blobs.entry("A\n")).unwrap();
    b0.write(&p("s.txt"), blobs.entry("S\n")).unwrap();
    b0.delete(&p("d.txt")).unwrap();
    b0.write(&p("new0.txt"), blobs.entry("new\n")).unwrap();
    b0.edit(&p("sub/one.txt"), blobs.entry("1\n")).unwrap();
    let mut b1 = Overlay::new(base.clone());
    b1.write(&p("x.txt"), blobs.entry("B\n")).unwrap();
    b1.write(&p("s.txt"), blobs.entry("S\n")).unwrap();
    b1.delete(&p("d.txt")).unwrap();
    b1.write(&p("sub/two.txt"), blobs.entry("2\n")).unwrap();
    b1.write(&p("gone.txt"), blobs.entry("tmp\n")).unwrap();
    b1.delete(&p("gone.txt")).unwrap();
    b1.write(&p("keep.txt"), blobs.entry("k\n")).unwrap();
    let mut b2 = Overlay::new(base.clone());
    b2.write(&p("only2.txt"), blobs.entry("two only\n"))
        .unwrap();
    Fixture {
        base,
        blobs,
        branches: vec![("b0".into(), b0), ("b1".into(), b1), ("b2".into(), b2)],
    }
}

fn agreement(r: &DiffReport, path: &str) -> Agreement {
    r.path(&p(path))
        .unwrap_or_else(|| panic!("{path} not in report"))
        .agreement
}

#[test]
fn every_agreement_class_and_the_summary() {
    let f = fixture();
    let r = f.report(&DiffOptions::default());
    let listed: Vec<&str> = r.paths.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(
        listed,
        vec![
            "d.txt",
            "new0.txt",
            "only2.txt",
            "s.txt",
            "sub/one.txt",
            "sub/two.txt",
            "x.txt"
        ]
    );
    assert_eq!(agreement(&r, "x.txt"), Agreement::Split);
    assert_eq!(agreement(&r, "s.txt"), Agreement::UnanimousChange);
    assert_eq!(
        agreement(&r, "d.txt"),
        Agreement::UnanimousChange,
        "all deleters agree"
    );
    assert_eq!(agreement(&r, "new0.txt"), Agreement::Unique);
    assert_eq!(agreement(&r, "only2.txt"), Agreement::Unique);
    assert_eq!(agreement(&r, "sub/one.txt"), Agreement::Unique);
    // written back identically / created then deleted: not a change
    assert!(r.path(&p("keep.txt")).is_none());
    assert!(r.path(&p("gone.txt")).is_none());

    let s = &r.summary;
    assert_eq!(s.total_paths_touched, 7);
    assert_eq!(s.unanimous_paths, 2);
    assert_eq!(s.split_paths, 1);
    assert_eq!(s.branches, 3);
    assert!((s.agreement_score - (1.0 - 1.0 / 7.0)).abs() < 1e-12);
    let unique: Vec<(&str, usize)> = s
        .per_branch_unique
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(unique, vec![("b0", 2), ("b1", 1), ("b2", 1)]);

    // operations, sparse per path
    let x = r.path(&p("x.txt")).unwrap();
    assert_eq!(x.changes.len(), 2);
    assert_eq!(x.operation(0), Operation::Modified);
    assert_eq!(x.operation(1), Operation::Modified);
    assert_eq!(x.operation(2), Operation::Untouched);
    assert_eq!(x.parent.unwrap().hash, f.base.files[&p("x.txt")].hash);
    let new0 = r.path(&p("new0.txt")).unwrap();
    assert_eq!(new0.operation(0), Operation::Created);
    assert!(new0.parent.is_none());
    let d = r.path(&p("d.txt")).unwrap();
    assert_eq!(d.operation(1), Operation::Deleted);
    assert!(d.changes.iter().all(|c| c.entry.is_none()));
}

fn nets(pairs: &[(&str, Vec<(&str, NetChange)>)]) -> Nets {
    pairs
        .iter()
        .map(|(l, cs)| (l.to_string(), cs.iter().map(|(k, v)| (p(k), *v)).collect()))
        .collect()
}

fn report_from_nets(
    base: &Manifest,
    n: &[(String, BTreeMap<WsPath, NetChange>)],
    opts: &DiffOptions,
) -> DiffReport {
    let inputs: Vec<(&str, &BTreeMap<WsPath, NetChange>)> =
        n.iter().map(|(l, m)| (l.as_str(), m)).collect();
    diff_report(base, &inputs, &|_| None, opts)
}

#[test]
fn split_on_operation_or_content_unanimous_on_both() {
    let base = common::manifest(&mut Blobs::new(), &[("m", "m\n")]);
    let a = common::entry("a");
    let b = common::entry("b");
    let n = nets(&[
        (
            "one",
            vec![
                ("m", NetChange::Modified(a)),
                ("c", NetChange::Created(a)),
                ("k", NetChange::Created(b)),
            ],
        ),
        (
            "two",
            vec![
                ("m", NetChange::Deleted),
                ("c", NetChange::Created(b)),
                ("k", NetChange::Created(b)),
            ],
        ),
        ("three", vec![("k", NetChange::Created(b))]),
    ]);
    let r = report_from_nets(
        &base,
        &n,
        &DiffOptions {
            unified: false,
            ..Default::default()
        },
    );
    assert_eq!(agreement(&r, "m"), Agreement::Split, "modify vs delete");
    assert_eq!(agreement(&r, "c"), Agreement::Split, "different content");
    assert_eq!(agreement(&r, "k"), Agreement::UnanimousChange);
    assert!(r
        .paths
        .iter()
        .flat_map(|p| &p.changes)
        .all(|c| c.diff.is_none()));
    assert_eq!(r.summary.per_branch_unique.values().sum::<usize>(), 0);
    assert_eq!(r.summary.per_branch_unique.len(), 3, "every label present");
}

#[test]
fn filter_keeps_the_summary_and_names_untouched_paths() {
    let f = fixture();
    let full = f.report(&DiffOptions::default());
    let opts = DiffOptions {
        paths: Some(vec![p("x.txt"), p("sub"), p("keep.txt"), p("nowhere/file")]),
        ..Default::default()
    };
    let r = f.report(&opts);
    let listed: Vec<(&str, Agreement)> = r
        .paths
        .iter()
        .map(|p| (p.path.as_str(), p.agreement))
        .collect();
    assert_eq!(
        listed,
        vec![
            ("keep.txt", Agreement::UnanimousNoChange),
            ("nowhere/file", Agreement::UnanimousNoChange),
            ("sub/one.txt", Agreement::Unique),
            ("sub/two.txt", Agreement::Unique),
            ("x.txt", Agreement::Split),
        ]
    );
    // the summary is over all touched paths, whatever the filter
    assert_eq!(r.summary, full.summary);
    let keep = r.path(&p("keep.txt")).unwrap();
    assert!(keep.changes.is_empty());
    assert_eq!(keep.parent.unwrap().hash, f.base.files[&p("keep.txt")].hash);
    assert!(r.path(&p("nowhere/file")).unwrap().parent.is_none());
    // without a filter, unanimous_no_change never appears
    assert!(full
        .paths
        .iter()
        .all(|p| p.agreement != Agreement::UnanimousNoChange));
    // the root matches everything
    let all = f.report(&DiffOptions {
        paths: Some(vec![WsPath::root()]),
        ..Default::default()
    });
    assert_eq!(all, full);
}

#[test]
fn agreement_score_with_nothing_touched_is_one() {
    let f = fixture();
    let base = (*f.base).clone();
    let r = report_from_nets(
        &base,
        &nets(&[("a", vec![]), ("b", vec![])]),
        &DiffOptions::default(),
    );
    assert_eq!(r.summary.total_paths_touched, 0);
    assert_eq!(r.summary.agreement_score, 1.0);
    assert!(r.paths.is_empty());
    let none = report_from_nets(&base, &[], &DiffOptions::default());
    assert_eq!(none.summary.branches, 0);
    assert_eq!(none.summary.agreement_score, 1.0);
}

#[test]
fn unified_diffs_have_headers_and_dev_null() {
    let f = fixture();
    let r = f.report(&DiffOptions::default());
    let x = r.path(&p("x.txt")).unwrap();
    let d0 = x.change(0).unwrap().diff.as_deref().unwrap();
    assert_eq!(d0, "--- a/x.txt\n+++ b/x.txt\n@@ -1 +1 @@\n-base\n+A\n");
    let created = r.path(&p("new0.txt")).unwrap().changes[0]
        .diff
        .clone()
        .unwrap();
    assert!(
        created.starts_with("--- /dev/null\n+++ b/new0.txt\n"),
        "{created}"
    );
    assert!(created.contains("+new\n"));
    let deleted = r.path(&p("d.txt")).unwrap().changes[0]
        .diff
        .clone()
        .unwrap();
    assert!(
        deleted.starts_with("--- a/d.txt\n+++ /dev/null\n"),
        "{deleted}"
    );
    assert!(deleted.contains("-d\n"));
    assert!(!x.changes.iter().any(|c| c.truncated));
}

#[test]
fn context_option_is_honoured() {
    let mut blobs = Blobs::new();
    let old: String = (0..20).map(|i| format!("line {i}\n")).collect();
    let new = old.replace("line 10\n", "LINE 10\n");
    let base = Arc::new(common::manifest(&mut blobs, &[("f", &old)]));
    let mut ov = Overlay::new(base.clone());
    ov.write(&p("f"), blobs.entry(&new)).unwrap();
    let get = |ctx: usize| {
        let r = diff_overlays(
            &base,
            &[("b", &ov)],
            &|h| blobs.get(h),
            &DiffOptions {
                context: ctx,
                ..Default::default()
            },
        );
        r.paths[0].changes[0].diff.clone().unwrap()
    };
    assert_eq!(get(3).lines().count(), 2 + 1 + 3 + 2 + 3);
    assert_eq!(get(0).lines().count(), 2 + 1 + 2);
}

#[test]
fn binary_files_get_a_placeholder() {
    let mut blobs = Blobs::new();
    let base = Arc::new(common::manifest(&mut blobs, &[("t.txt", "text\n")]));
    let bin = blobs.entry_mode(b"\x00\x01\x02binary", MODE_FILE);
    assert!(bin.binary);
    let mut ov = Overlay::new(base.clone());
    ov.write(&p("img.png"), bin).unwrap();
    ov.write(&p("t.txt"), bin).unwrap();
    let r = diff_overlays(
        &base,
        &[("b", &ov)],
        &|h| blobs.get(h),
        &DiffOptions::default(),
    );
    let want = format!("[binary · 9 bytes · sha256:{}]", bin.hash.short());
    assert_eq!(want.len() - "[binary · 9 bytes · sha256:]".len(), 12);
    let img = &r.path(&p("img.png")).unwrap().changes[0];
    assert_eq!(img.diff.as_deref(), Some(want.as_str()));
    assert!(img.entry.unwrap().binary);
    let t = r.path(&p("t.txt")).unwrap().changes[0]
        .diff
        .clone()
        .unwrap();
    assert!(t.ends_with(&want), "{t}");
    assert!(
        !t.contains("-text") && !t.contains("@@"),
        "binary is never text-diffed: {t}"
    );
}

#[test]
fn long_diffs_are_truncated_to_head_marker_tail() {
    let mut blobs = Blobs::new();
    let old: String = (0..600).map(|i| format!("old {i}\n")).collect();
    let new: String = (0..600).map(|i| format!("new {i}\n")).collect();
    let base = Arc::new(common::manifest(&mut blobs, &[("big.txt", &old)]));
    let mut ov = Overlay::new(base.clone());
    ov.write(&p("big.txt"), blobs.entry(&new)).unwrap();
    let r = diff_overlays(
        &base,
        &[("b", &ov)],
        &|h| blobs.get(h),
        &DiffOptions::default(),
    );
    let c = &r.paths[0].changes[0];
    assert!(c.truncated);
    let full = similar::TextDiff::from_lines(old.as_str(), new.as_str())
        .unified_diff()
        .header("a/big.txt", "b/big.txt")
        .to_string();
    let full_lines: Vec<&str> = full.lines().collect();
    assert_eq!(full_lines.len(), 2 + 1 + 1200);
    let text = c.diff.as_deref().unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2 * KEEP_DIFF_LINES + 1);
    assert_eq!(&lines[..200], &full_lines[..200]);
    assert_eq!(
        lines[200],
        format!("... [{} lines truncated] ...", full_lines.len() - 400)
    );
    assert_eq!(&lines[201..], &full_lines[full_lines.len() - 200..]);
    assert!(text.ends_with('\n'));

    // exactly 500 lines: kept whole
    let old: String = (0..497).map(|i| format!("{i}\n")).collect();
    let base = Arc::new(common::manifest(&mut blobs, &[("f", &old)]));
    let mut ov = Overlay::new(base.clone());
    ov.delete(&p("f")).unwrap();
    let r = diff_overlays(
        &base,
        &[("b", &ov)],
        &|h| blobs.get(h),
        &DiffOptions::default(),
    );
    let c = &r.paths[0].changes[0];
    assert_eq!(c.diff.as_deref().unwrap().lines().count(), 500);
    assert!(!c.truncated);
}

#[test]
fn identical_outcomes_share_one_diff() {
    let mut blobs = Blobs::new();
    let base = Arc::new(common::manifest(&mut blobs, &[("f", "f\n")]));
    let mut branches = Vec::new();
    for i in 0..4 {
        let mut ov = Overlay::new(base.clone());
        let content = if i < 3 { "same\n" } else { "other\n" };
        ov.write(&p("f"), blobs.entry(content)).unwrap();
        branches.push((format!("b{i}"), ov));
    }
    let calls = std::cell::Cell::new(0usize);
    let lookup = |h: &forkfleet_shared::blob::BlobHash| {
        calls.set(calls.get() + 1);
        blobs.get(h)
    };
    let inputs: Vec<(&str, &Overlay)> = branches.iter().map(|(l, o)| (l.as_str(), o)).collect();
    let r = diff_overlays(&base, &inputs, &lookup, &DiffOptions::default());
    let cs = &r.paths[0].changes;
    let d = |i: usize| cs[i].diff.clone().unwrap();
    assert!(Arc::ptr_eq(&d(0), &d(1)));
    assert!(Arc::ptr_eq(&d(0), &d(2)));
    assert!(!Arc::ptr_eq(&d(0), &d(3)));
    assert_ne!(d(0), d(3));
    assert_eq!(calls.get(), 3, "parent once, each distinct outcome once");
    assert_eq!(r.paths[0].agreement, Agreement::Split);
}

#[test]
fn mode_only_change_is_modified_with_a_visible_diff() {
    let mut blobs = Blobs::new();
    let base = Arc::new(common::manifest(&mut blobs, &[("run.sh", "echo\n")]));
    let mut ov = Overlay::new(base.clone());
    ov.write(&p("run.sh"), blobs.entry_mode(b"echo\n", MODE_EXEC))
        .unwrap();
    let r = diff_overlays(
        &base,
        &[("b", &ov)],
        &|h| blobs.get(h),
        &DiffOptions::default(),
    );
    let c = &r.paths[0].changes[0];
    assert_eq!(c.operation, Operation::Modified);
    assert_eq!(c.entry.unwrap().mode, MODE_EXEC);
    assert!(c.diff.as_deref().unwrap().contains("mode 644 → 755"));
}

#[test]
fn precomputed_net_changes_give_the_same_report() {
    let f = fixture();
    let n: Vec<(String, BTreeMap<WsPath, NetChange>)> = f
        .branches
        .iter()
        .map(|(l, o)| (l.clone(), o.net_changes()))
        .collect();
    let inputs: Vec<(&String, &BTreeMap<WsPath, NetChange>)> =
        n.iter().map(|(l, m)| (l, m)).collect();
    let blobs = &f.blobs;
    let r = diff_report(&f.base, &inputs, &|h| blobs.get(h), &DiffOptions::default());
    assert_eq!(r, f.report(&DiffOptions::default()));
}

#[test]
fn json_uses_labels_and_round_trips() {
    let f = fixture();
    let r = f.report(&DiffOptions::default());
    let v = r.to_json_value();
    assert_eq!(v, serde_json::to_value(&r).unwrap());
    assert_eq!(v["branches"], serde_json::json!(["b0", "b1", "b2"]));
    assert_eq!(v["summary"]["split_paths"], 1);
    assert_eq!(v["summary"]["per_branch_unique"]["b2"], 1);
    let x = v["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["path"] == "x.txt")
        .unwrap();
    assert_eq!(x["agreement"], "split");
    assert_eq!(
        x["operations"],
        serde_json::json!({"b0": "modified", "b1": "modified"})
    );
    assert_eq!(x["changes"][1]["branch"], "b1");
    assert_eq!(x["changes"][1]["operation"], "modified");
    assert_eq!(
        x["parent"]["hash"],
        f.base.files[&p("x.txt")].hash.to_hex(),
        "hashes are hex"
    );
    assert!(x["changes"][0]["diff"]
        .as_str()
        .unwrap()
        .starts_with("--- a/x.txt"));
    let text = serde_json::to_string(&r).unwrap();
    let back: DiffReport = serde_json::from_str(&text).unwrap();
    assert_eq!(back, r);
    // an unknown label is refused
    let bad = text.replace("\"branch\":\"b2\"", "\"branch\":\"zz\"");
    assert!(serde_json::from_str::<DiffReport>(&bad).is_err());
}

#[test]
fn render_summary_shows_who_did_what() {
    let f = fixture();
    let r = f.report(&DiffOptions::default());
    let text = render_summary(&r);
    assert!(
        text.starts_with("3 branches · 7 paths touched · 2 unanimous · 1 split · agreement 0.86"),
        "{text}"
    );
    let line = |path: &str| {
        text.lines()
            .find(|l| l.starts_with(path))
            .unwrap_or_else(|| panic!("no row for {path}:\n{text}"))
            .to_string()
    };
    let x = line("x.txt");
    assert!(x.contains("split"), "{x}");
    assert!(
        x.contains("modified#") && x.contains(": b0") && x.contains(": b1"),
        "{x}"
    );
    let d = line("d.txt");
    assert!(
        d.contains("unanimous_change") && d.contains("deleted: b0, b1"),
        "{d}"
    );
    assert!(line("new0.txt").contains("created: b0"));
    assert!(
        text.contains("unique paths per branch: b0=2 b1=1 b2=1"),
        "{text}"
    );
    let filtered = f.report(&DiffOptions {
        paths: Some(vec![p("keep.txt")]),
        ..Default::default()
    });
    assert!(render_summary(&filtered).contains("(no branch)"));
}

type Nets = Vec<(String, BTreeMap<WsPath, NetChange>)>;

/// The bench workload: branch b, write j, category (b+j)%3.
fn workload(branches: usize) -> (Manifest, Blobs, Nets) {
    let mut blobs = Blobs::new();
    let mut files: Vec<(String, String)> = (0..10)
        .map(|j| {
            (
                format!("shared/split_{j}.txt"),
                format!("base {j}\n").repeat(10),
            )
        })
        .collect();
    files.push(("README.md".into(), "readme\n".into()));
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let base = common::manifest(&mut blobs, &refs);
    let mut out = Vec::new();
    for b in 0..branches {
        let mut m = BTreeMap::new();
        for j in 0..10 {
            let (path, content) = match (b + j) % 3 {
                0 => (
                    format!("shared/split_{j}.txt"),
                    (0..10)
                        .map(|l| format!("branch {b} line {l}\n"))
                        .collect::<String>(),
                ),
                1 => (format!("unique/b{b}/f{j}.txt"), format!("unique {b} {j}\n")),
                _ => (format!("shared/agree_{j}.txt"), format!("agreed {j}\n")),
            };
            let e: FileEntry = blobs.entry(&content);
            let path = p(&path);
            let change = if base.files.contains_key(&path) {
                NetChange::Modified(e)
            } else {
                NetChange::Created(e)
            };
            m.insert(path, change);
        }
        out.push((format!("branch-{b}"), m));
    }
    (base, blobs, out)
}

#[test]
fn thousand_branches_are_sparse_and_deduplicated() {
    let (base, blobs, n) = workload(1000);
    let inputs: Vec<(&str, &BTreeMap<WsPath, NetChange>)> =
        n.iter().map(|(l, m)| (l.as_str(), m)).collect();
    let started = std::time::Instant::now();
    let r = diff_report(&base, &inputs, &|h| blobs.get(h), &DiffOptions::default());
    eprintln!("1000 x 10 report: {:?}", started.elapsed());
    assert_eq!(
        r.paths.iter().map(|p| p.changes.len()).sum::<usize>(),
        10_000,
        "one entry per touch, none per untouched pair"
    );
    let unique = r
        .paths
        .iter()
        .filter(|p| p.agreement == Agreement::Unique)
        .count();
    assert_eq!(r.summary.total_paths_touched, 10 + 10 + unique);
    assert_eq!(r.summary.split_paths, 10);
    assert_eq!(r.summary.unanimous_paths, 10);
    assert_eq!(r.summary.per_branch_unique.len(), 1000);
    assert_eq!(r.summary.per_branch_unique.values().sum::<usize>(), unique);
    let agree = r.path(&p("shared/agree_0.txt")).unwrap();
    let first = agree.changes[0].diff.clone().unwrap();
    assert!(agree
        .changes
        .iter()
        .all(|c| Arc::ptr_eq(c.diff.as_ref().unwrap(), &first)));
}

//! Property tests of the cross-branch diff report: for random branch change sets over a
//! small pool of paths and contents (so branches often agree), the report lists every
//! touched path once with exactly the branches that touched it, classifies each path as
//! a model of the rules says, and its summary counts what the paths say.

use super::common::{self, p, Blobs};
use forkfleet_shared::diff::{diff_report, Agreement, DiffOptions, DiffReport, Operation};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::overlay::NetChange;
use forkfleet_shared::path::WsPath;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// Paths in the parent (a branch may modify or delete them).
const BASE_PATHS: [&str; 4] = ["a.txt", "src/x.rs", "src/deep/z.rs", "docs/r.md"];
/// Paths not in the parent (a branch may create them).
const NEW_PATHS: [&str; 3] = ["b.txt", "src/y.rs", "src/deep/w.rs"];
/// Contents a branch writes: few, so that branches often write the same.
const CONTENTS: [&str; 3] = ["one\n", "two\n", "three\n"];
/// Path filters: directories, a file, and a path that matches nothing.
const FILTERS: [&str; 5] = ["src", "src/deep", "docs/r.md", "b.txt", "nope"];

/// What one branch does to one path: `None` is a delete, `Some(i)` writes `CONTENTS[i]`.
type Choice = Option<usize>;

/// `PROPTEST_CASES` overrides the default case count (for stress runs).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn base(blobs: &mut Blobs) -> Manifest {
    let files: Vec<(&str, &str)> = BASE_PATHS.iter().map(|p| (*p, "base\n")).collect();
    common::manifest(blobs, &files)
}

/// One branch's changes: for each path of the pool, untouched or one choice. A base path
/// is modified or deleted; a new path is only ever created.
fn branch_strategy() -> impl Strategy<Value = BTreeMap<&'static str, Choice>> {
    let base = prop::collection::vec(
        prop::option::of(prop::option::of(0..CONTENTS.len())),
        BASE_PATHS.len(),
    );
    let new = prop::collection::vec(prop::option::of(0..CONTENTS.len()), NEW_PATHS.len());
    (base, new).prop_map(|(base, new)| {
        let mut m = BTreeMap::new();
        for (path, choice) in BASE_PATHS.iter().zip(base) {
            if let Some(c) = choice {
                m.insert(*path, c);
            }
        }
        for (path, choice) in NEW_PATHS.iter().zip(new) {
            if let Some(i) = choice {
                m.insert(*path, Some(i));
            }
        }
        m
    })
}

fn branches_strategy() -> impl Strategy<Value = Vec<BTreeMap<&'static str, Choice>>> {
    prop::collection::vec(branch_strategy(), 1..6)
}

/// The net changes of one branch, registering written contents in `blobs`.
fn net(blobs: &mut Blobs, choices: &BTreeMap<&str, Choice>) -> BTreeMap<WsPath, NetChange> {
    choices
        .iter()
        .map(|(path, choice)| {
            let change = match choice {
                None => NetChange::Deleted,
                Some(i) if BASE_PATHS.contains(path) => {
                    NetChange::Modified(blobs.entry(CONTENTS[*i]))
                }
                Some(i) => NetChange::Created(blobs.entry(CONTENTS[*i])),
            };
            (p(path), change)
        })
        .collect()
}

fn label(i: usize) -> String {
    format!("b{i}")
}

struct Built {
    blobs: Blobs,
    base: Manifest,
    nets: Vec<(String, BTreeMap<WsPath, NetChange>)>,
}

fn build(branches: &[BTreeMap<&'static str, Choice>]) -> Built {
    let mut blobs = Blobs::new();
    let base = base(&mut blobs);
    let nets = branches
        .iter()
        .enumerate()
        .map(|(i, b)| (label(i), net(&mut blobs, b)))
        .collect();
    Built { blobs, base, nets }
}

fn report(built: &Built, opts: &DiffOptions) -> DiffReport {
    let inputs: Vec<(&str, &BTreeMap<WsPath, NetChange>)> =
        built.nets.iter().map(|(l, m)| (l.as_str(), m)).collect();
    let blobs = &built.blobs;
    diff_report(&built.base, &inputs, &|h| blobs.get(h), opts)
}

/// The operation and content a change leaves: what "the same change" compares.
fn outcome(change: &NetChange) -> (Operation, Option<forkfleet_shared::blob::BlobHash>) {
    match change {
        NetChange::Created(e) => (Operation::Created, Some(e.hash)),
        NetChange::Modified(e) => (Operation::Modified, Some(e.hash)),
        NetChange::Deleted => (Operation::Deleted, None),
    }
}

/// Per touched path, the (branch index, change) pairs in branch order.
fn touches(built: &Built) -> BTreeMap<WsPath, Vec<(u32, &NetChange)>> {
    let mut out: BTreeMap<WsPath, Vec<(u32, &NetChange)>> = BTreeMap::new();
    for (i, (_, net)) in built.nets.iter().enumerate() {
        for (path, change) in net {
            out.entry(path.clone())
                .or_default()
                .push((i as u32, change));
        }
    }
    out
}

/// The agreement the rules give a touched path.
fn expected_agreement(touched: &[(u32, &NetChange)]) -> Agreement {
    match touched {
        [] => Agreement::UnanimousNoChange,
        [_] => Agreement::Unique,
        [(_, first), rest @ ..] => {
            if rest.iter().all(|(_, c)| outcome(c) == outcome(first)) {
                Agreement::UnanimousChange
            } else {
                Agreement::Split
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(256)))]

    #[test]
    fn every_touched_path_once_with_the_branches_that_touched_it(
        branches in branches_strategy(),
        unified in any::<bool>(),
    ) {
        let built = build(&branches);
        let r = report(&built, &DiffOptions { unified, ..Default::default() });
        let touches = touches(&built);

        let listed: Vec<&WsPath> = r.paths.iter().map(|d| &d.path).collect();
        let want: Vec<&WsPath> = touches.keys().collect();
        prop_assert_eq!(listed, want, "every touched path exactly once, in path order");
        prop_assert_eq!(r.branches.len(), branches.len());

        for d in &r.paths {
            let touched = &touches[&d.path];
            let got: Vec<u32> = d.changes.iter().map(|c| c.branch).collect();
            let want: Vec<u32> = touched.iter().map(|(b, _)| *b).collect();
            prop_assert_eq!(got, want, "branches of {}", d.path);
            for (c, (_, change)) in d.changes.iter().zip(touched) {
                let (operation, hash) = outcome(change);
                prop_assert_eq!(c.operation, operation, "{}", d.path);
                prop_assert_eq!(c.entry.map(|e| e.hash), hash, "{}", d.path);
                prop_assert_eq!(c.diff.is_some(), unified, "{}: a diff iff asked", d.path);
                prop_assert_eq!(d.operation(c.branch), operation);
            }
            prop_assert_eq!(
                d.parent.map(|e| e.hash),
                built.base.files.get(&d.path).map(|e| e.hash),
                "{}: the parent's entry",
                d.path
            );
            for b in 0..branches.len() as u32 {
                if !want_contains(touched, b) {
                    prop_assert_eq!(d.operation(b), Operation::Untouched);
                    prop_assert!(d.change(b).is_none());
                }
            }
        }
    }

    #[test]
    fn agreement_follows_the_rules_and_the_summary_counts_it(
        branches in branches_strategy(),
    ) {
        let built = build(&branches);
        let r = report(&built, &DiffOptions { unified: false, ..Default::default() });
        let touches = touches(&built);

        let mut unique_per_branch = vec![0usize; branches.len()];
        let (mut unanimous, mut split) = (0usize, 0usize);
        for d in &r.paths {
            let touched = &touches[&d.path];
            let want = expected_agreement(touched);
            prop_assert_eq!(d.agreement, want, "{}", d.path);
            // `unique` iff exactly one branch touched the path; `unanimous_change` iff two
            // or more did and all made the same change.
            prop_assert_eq!(d.agreement == Agreement::Unique, touched.len() == 1);
            let all_same = touched.iter().all(|(_, c)| outcome(c) == outcome(touched[0].1));
            prop_assert_eq!(
                d.agreement == Agreement::UnanimousChange,
                touched.len() >= 2 && all_same
            );
            prop_assert_ne!(d.agreement, Agreement::UnanimousNoChange);
            match d.agreement {
                Agreement::Unique => unique_per_branch[touched[0].0 as usize] += 1,
                Agreement::UnanimousChange => unanimous += 1,
                Agreement::Split => split += 1,
                Agreement::UnanimousNoChange => {}
            }
        }

        let s = &r.summary;
        prop_assert_eq!(s.total_paths_touched, touches.len());
        prop_assert_eq!(s.unanimous_paths, unanimous);
        prop_assert_eq!(s.split_paths, split);
        prop_assert_eq!(s.branches, branches.len());
        let per_branch: BTreeMap<String, usize> = unique_per_branch
            .iter()
            .enumerate()
            .map(|(i, n)| (label(i), *n))
            .collect();
        prop_assert_eq!(&s.per_branch_unique, &per_branch, "every label, with its count");
        prop_assert_eq!(
            s.per_branch_unique.values().sum::<usize>() + unanimous + split,
            s.total_paths_touched
        );
        prop_assert!((0.0..=1.0).contains(&s.agreement_score), "score {}", s.agreement_score);
        prop_assert_eq!(s.agreement_score == 1.0, split == 0, "score {}", s.agreement_score);
        let want_score = 1.0 - split as f64 / touches.len().max(1) as f64;
        prop_assert!((s.agreement_score - want_score).abs() < 1e-12);
    }

    #[test]
    fn branches_making_the_same_changes_agree_everywhere(
        changes in branch_strategy(),
        copies in 2usize..6,
    ) {
        let built = build(&vec![changes.clone(); copies]);
        let r = report(&built, &DiffOptions { unified: false, ..Default::default() });
        prop_assert_eq!(r.paths.len(), changes.len());
        for d in &r.paths {
            prop_assert_eq!(d.agreement, Agreement::UnanimousChange, "{}", d.path);
            prop_assert_eq!(d.changes.len(), copies);
        }
        prop_assert_eq!(r.summary.agreement_score, 1.0);
        prop_assert_eq!(r.summary.unanimous_paths, changes.len());
        prop_assert_eq!(r.summary.split_paths, 0);
        prop_assert!(r.summary.per_branch_unique.values().all(|n| *n == 0));
    }

    #[test]
    fn a_path_filter_selects_paths_and_leaves_the_summary_whole(
        branches in branches_strategy(),
        filter in prop::collection::vec(prop::sample::select(FILTERS.to_vec()), 1..4),
    ) {
        let built = build(&branches);
        let all = report(&built, &DiffOptions { unified: false, ..Default::default() });
        let filter: Vec<WsPath> = filter.iter().map(|f| p(f)).collect();
        let r = report(
            &built,
            &DiffOptions { unified: false, paths: Some(filter.clone()), ..Default::default() },
        );
        prop_assert_eq!(&r.summary, &all.summary, "the summary covers every touched path");

        let mut want: Vec<&forkfleet_shared::diff::PathDiff> = all
            .paths
            .iter()
            .filter(|d| filter.iter().any(|f| d.path.starts_with(f)))
            .collect();
        let unmatched: BTreeSet<&WsPath> = filter
            .iter()
            .filter(|f| !all.paths.iter().any(|d| d.path.starts_with(f)))
            .collect();
        let placeholders: Vec<forkfleet_shared::diff::PathDiff> = unmatched
            .iter()
            .map(|f| forkfleet_shared::diff::PathDiff {
                path: (*f).clone(),
                agreement: Agreement::UnanimousNoChange,
                parent: built.base.files.get(*f).map(Into::into),
                changes: Vec::new(),
            })
            .collect();
        want.extend(placeholders.iter());
        want.sort_by(|a, b| a.path.cmp(&b.path));
        let got: Vec<&forkfleet_shared::diff::PathDiff> = r.paths.iter().collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn the_json_form_reads_back_as_the_same_report(
        branches in branches_strategy(),
        unified in any::<bool>(),
    ) {
        let built = build(&branches);
        let r = report(&built, &DiffOptions { unified, ..Default::default() });
        let mut back: DiffReport = serde_json::from_value(r.to_json_value()).unwrap();
        // JSON carries the score as a decimal: equal up to the last bit.
        prop_assert!((back.summary.agreement_score - r.summary.agreement_score).abs() < 1e-12);
        back.summary.agreement_score = r.summary.agreement_score;
        prop_assert_eq!(back, r);
    }
}

fn want_contains(touched: &[(u32, &NetChange)], branch: u32) -> bool {
    touched.iter().any(|(b, _)| *b == branch)
}

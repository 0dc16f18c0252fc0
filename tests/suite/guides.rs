//! Guides that cannot drift: every module is named in its crate's tour (the crate root's
//! `//!` documentation), every file a guide names exists, and every ADR says its status and
//! is in the index (docs/adr/README.md).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The crate roots whose `//!` documentation tours their modules.
const CRATE_ROOTS: &[&str] = &[
    "src/lib.rs",
    "shared/src/lib.rs",
    "bus/src/lib.rs",
    "client/src/lib.rs",
    "coordinator/src/lib.rs",
    "worker/src/lib.rs",
    "tui/src/lib.rs",
    "http/src/lib.rs",
    "node/src/lib.rs",
    "bench/src/lib.rs",
];

/// The module a line of a crate root declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`).
fn declared_module(line: &str) -> Option<&str> {
    let rest = line
        .strip_prefix("pub(crate) mod ")
        .or_else(|| line.strip_prefix("pub mod "))
        .or_else(|| line.strip_prefix("mod "))?;
    rest.strip_suffix(';')
}

#[test]
fn every_module_is_in_its_crates_tour() {
    let mut missing = Vec::new();
    for lib in CRATE_ROOTS {
        let text = read(&root().join(lib));
        let tour: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("//!"))
            .collect::<Vec<_>>()
            .join("\n");
        for module in text.lines().filter_map(declared_module) {
            if !tour.contains(&format!("`{module}`")) {
                missing.push(format!("{lib}: `{module}`"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "modules missing from their crate's tour (name each, in backticks, in the crate root's //! docs):\n{}",
        missing.join("\n")
    );
}

/// The top folders of this repository a guide's path may start with.
const TOP: &[&str] = &[
    "src/",
    "shared/",
    "bus/",
    "client/",
    "coordinator/",
    "worker/",
    "tui/",
    "http/",
    "node/",
    "bench/",
    "docs/",
    "scripts/",
    "deploy/",
    "tests/",
    "examples/",
];

/// Backticked paths of this repository's files in `text` (`worker/src/tools.rs`): a top
/// folder, then a name with an extension.
fn named_files(text: &str) -> Vec<&str> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| TOP.iter().any(|t| s.starts_with(t)))
        .filter(|s| !s.contains(['<', '*', ' ', '{']))
        .filter(|s| {
            s.rsplit('/')
                .next()
                .is_some_and(|name| name.contains('.') && !name.ends_with('.'))
        })
        .collect()
}

#[test]
fn every_file_a_guide_names_exists() {
    let mut guides = vec![root().join("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            guides.push(path);
        }
    }
    let mut gone = Vec::new();
    for guide in &guides {
        for file in named_files(&read(guide)) {
            if !root().join(file).exists() {
                gone.push(format!("{}: `{file}`", guide.display()));
            }
        }
    }
    assert!(
        gone.is_empty(),
        "guides name files that do not exist:\n{}",
        gone.join("\n")
    );
}

#[test]
fn every_adr_has_a_status_and_is_in_the_index() {
    let dir = root().join("docs/adr");
    let index = read(&dir.join("README.md"));
    let mut wrong = Vec::new();
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name == "README.md" || !name.ends_with(".md") {
            continue;
        }
        count += 1;
        let text = read(&path);
        if !text.lines().take(6).any(|l| l.starts_with("Status: ")) {
            wrong.push(format!("{name}: no `Status: ` line in its first lines"));
        }
        if !index.contains(&format!("({name})")) {
            wrong.push(format!("{name}: not linked from docs/adr/README.md"));
        }
    }
    assert!(count >= 38, "only {count} ADRs found");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_file_finder_sees_paths_and_skips_other_backticks() {
    let text = "see `worker/src/tools.rs`, `docs/HTTP.md`, `http/protobuf`, `src/cli/`, \
                `.forkfleet/forks/<id>/`, `tests/suite/*.rs` and `forkfleet run`";
    assert_eq!(named_files(text), ["worker/src/tools.rs", "docs/HTTP.md"]);
}

//! The workspace snapshot as a user's real repository needs it: ignore files honoured (and
//! what they left out told by `--dry-run`, the run and `fork show`), and only what is in the
//! snapshot uploaded.

use super::harness::{forkfleet, json, path_str, Example};
use forkfleet_client::workspace::upload_workspace;
use forkfleet_shared::blob::{BlobHash, BlobStore, MemBlobStore};
use forkfleet_shared::scan::ScanOptions;

/// The quickstart with a Rust project's build output and a JavaScript project's
/// dependencies in its workspace, each ignored as such projects do.
fn with_build_output() -> Example {
    let ex = Example::quickstart();
    let ws = ex.workspace();
    std::fs::write(ws.join(".gitignore"), "target/\n*.log\n!keep.log\n").unwrap();
    std::fs::create_dir_all(ws.join("target/debug/deps")).unwrap();
    std::fs::write(ws.join("target/debug/deps/big.rlib"), vec![7u8; 300_000]).unwrap();
    std::fs::write(ws.join("target/debug/app"), vec![1u8; 50_000]).unwrap();
    std::fs::write(ws.join("build.log"), "noise\n").unwrap();
    std::fs::write(ws.join("keep.log"), "kept by `!keep.log`\n").unwrap();
    // (Not `node_modules`: a snapshot skips that by name already, `DEFAULT_EXCLUDE`.)
    std::fs::create_dir_all(ws.join("web/vendored/left-pad")).unwrap();
    std::fs::write(ws.join("web/vendored/left-pad/index.js"), "x\n").unwrap();
    std::fs::write(ws.join("web/.forkfleetignore"), "vendored/\n").unwrap();
    std::fs::write(ws.join("web/app.js"), "app\n").unwrap();
    ex
}

#[tokio::test]
async fn ignored_build_output_is_not_in_the_snapshot_nor_uploaded() {
    let ex = with_build_output();
    let store = MemBlobStore::new();
    let opts = ScanOptions::snapshot(&[".git".into(), ".forkfleet".into()], true);
    let (manifest, upload) = upload_workspace(&store, &ex.workspace(), &opts, [])
        .await
        .unwrap();
    let paths: Vec<&str> = manifest.files.keys().map(|p| p.as_str()).collect();
    assert!(!paths.iter().any(|p| p.starts_with("target")), "{paths:?}");
    assert!(!paths.iter().any(|p| p.contains("vendored")), "{paths:?}");
    assert!(!paths.contains(&"build.log"), "{paths:?}");
    for kept in [
        "keep.log",
        ".gitignore",
        "web/app.js",
        "web/.forkfleetignore",
    ] {
        assert!(paths.contains(&kept), "{kept} missing: {paths:?}");
    }
    // The big file's bytes never reached the store.
    let big = BlobHash::of(&vec![7u8; 300_000]);
    assert_eq!(store.missing(&[big]).await.unwrap(), vec![big]);
    // Everything the manifest names did.
    let named: Vec<BlobHash> = manifest.files.values().map(|e| e.hash).collect();
    assert!(store.missing(&named).await.unwrap().is_empty());
    assert_eq!(upload.left_out.ignored_files, 4);
    assert_eq!(upload.left_out.ignored_bytes, 350_000 + 6 + 2);
    assert_eq!(upload.left_out.largest[0].path, "target/");
    assert_eq!(
        upload.left_out.largest[0].rule.as_deref(),
        Some(".gitignore: target/")
    );

    // `respect_gitignore = false`: the git ignore files are not read, `.forkfleetignore` is.
    let all = ScanOptions::snapshot(&[".git".into()], false);
    let (manifest, _) = upload_workspace(&store, &ex.workspace(), &all, [])
        .await
        .unwrap();
    let paths: Vec<&str> = manifest.files.keys().map(|p| p.as_str()).collect();
    assert!(paths.contains(&"target/debug/deps/big.rlib"), "{paths:?}");
    assert!(paths.contains(&"build.log"));
    assert!(!paths.iter().any(|p| p.contains("vendored")), "{paths:?}");
}

#[test]
fn dry_run_run_and_fork_show_say_what_was_left_out() {
    let ex = with_build_output();
    let spec = path_str(&ex.spec()).to_string();
    let dry = json(&forkfleet(&["run", &spec, "--dry-run", "--json"]));
    assert_eq!(dry["dry_run"], true);
    assert_eq!(dry["left_out"]["ignored_files"], 4, "{dry}");
    assert_eq!(dry["left_out"]["largest"][0]["path"], "target/", "{dry}");
    assert!(!ex.data().exists(), "a dry run stores nothing");
    let text = forkfleet(&["run", &spec, "--dry-run"]);
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(
        text.contains("left out: 4 files, 350.0 KB (ignore files)"),
        "{text}"
    );
    assert!(
        text.contains("target/ (2 files, 350.0 KB, .gitignore: target/)"),
        "{text}"
    );

    // A real run records it with the fork.
    let doc = json(&forkfleet(&["run", &spec, "--json", "--timeout-s", "120"]));
    assert_eq!(doc["left_out"]["ignored_files"], 4, "{doc}");
    let fork = doc["fork_id"].as_str().unwrap();
    let data = ex.data();
    let shown = forkfleet(&["fork", "show", fork, "--data", path_str(&data)]);
    let shown = String::from_utf8_lossy(&shown.stdout).to_string();
    assert!(shown.contains("workspace: "), "{shown}");
    assert!(shown.contains(".gitignore: target/"), "{shown}");
}

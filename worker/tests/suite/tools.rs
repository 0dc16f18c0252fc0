//! Each tool's behaviour and errors, over a real overlay and blob cache.

use super::common::Fixture;
use forkfleet_shared::event::ToolCall;
use forkfleet_shared::manifest::{Node, MODE_EXEC};
use forkfleet_shared::overlay::{ChangeOp, Overlay};
use forkfleet_shared::path::WsPath;
use forkfleet_worker::cache::BlobCache;
use forkfleet_worker::tools::{run_tool, tool_names, tool_specs, ToolOutcome, MAX_OUTPUT_CHARS};
use serde_json::{json, Value};
use std::sync::Arc;

struct Ws {
    fx: Fixture,
    ov: Overlay,
    cache: BlobCache,
}

impl Ws {
    fn new(files: &[(&str, &str)]) -> Self {
        let fx = Fixture::store_only();
        let (base, _) = fx.snapshot(files);
        let cache = BlobCache::new(Arc::new(fx.store.clone()), 1 << 20);
        Self {
            ov: Overlay::new(base),
            cache,
            fx,
        }
    }

    async fn call(&mut self, name: &str, args: Value) -> ToolOutcome {
        let call = ToolCall {
            id: "c1".into(),
            name: name.into(),
            args,
        };
        run_tool(&call, &mut self.ov, &self.cache).await.unwrap()
    }

    async fn ok(&mut self, name: &str, args: Value) -> String {
        let out = self.call(name, args).await;
        assert!(out.ok, "{name} failed: {}", out.output);
        out.output
    }

    async fn err(&mut self, name: &str, args: Value) -> String {
        let before = self.ov.changes().len();
        let out = self.call(name, args).await;
        assert!(!out.ok, "{name} should fail, said: {}", out.output);
        assert_eq!(
            self.ov.changes().len(),
            before,
            "a failed tool changes nothing"
        );
        out.output
    }

    fn content(&self, path: &str) -> String {
        let entry = self.ov.file(&WsPath::parse(path).unwrap()).unwrap();
        let bytes = self
            .fx
            .store
            .get_now(&entry.hash)
            .expect("blob in the store");
        String::from_utf8(bytes.to_vec()).unwrap()
    }
}

fn files() -> Vec<(&'static str, &'static str)> {
    vec![
        ("README.md", "line one\nline two\nline three\n"),
        ("src/main.rs", "fn main() {\n    println!(\"hi\");\n}\n"),
        (
            "src/lib.rs",
            "pub fn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n",
        ),
        ("docs/guide.md", "# Guide\nfn in docs\n"),
        ("dup.txt", "same same same\n"),
        ("bin.dat", "a\0b"),
        ("link.md", "->README.md"),
        ("srclink", "->src"),
        ("escape", "->../../etc/passwd"),
    ]
}

#[test]
fn every_tool_has_a_spec_with_an_object_schema() {
    let specs = tool_specs();
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, tool_names());
    for s in specs {
        assert_eq!(s.parameters["type"], "object", "{}", s.name);
        assert!(!s.description.is_empty());
    }
}

#[tokio::test]
async fn read_file_numbers_lines_and_pages() {
    let mut ws = Ws::new(&files());
    let out = ws.ok("read_file", json!({"path": "README.md"})).await;
    assert_eq!(
        out,
        "     1\tline one\n     2\tline two\n     3\tline three\n"
    );
    let out = ws
        .ok(
            "read_file",
            json!({"path": "/README.md", "offset": 2, "limit": 1}),
        )
        .await;
    assert!(out.starts_with("     2\tline two\n"), "{out}");
    assert!(out.contains("lines 2-2 of 3"), "{out}");
    let e = ws
        .err("read_file", json!({"path": "README.md", "offset": 9}))
        .await;
    assert!(e.contains("past the end"), "{e}");
    // Through a symlink, to a file and through a linked directory.
    let out = ws.ok("read_file", json!({"path": "link.md"})).await;
    assert!(out.contains("line one"));
    let out = ws.ok("read_file", json!({"path": "srclink/main.rs"})).await;
    assert!(out.contains("println"));
}

#[tokio::test]
async fn read_file_errors() {
    let mut ws = Ws::new(&files());
    let e = ws.err("read_file", json!({"path": "bin.dat"})).await;
    assert!(e.contains("binary"), "{e}");
    let e = ws.err("read_file", json!({"path": "src"})).await;
    assert!(e.contains("is a directory"), "{e}");
    let e = ws.err("read_file", json!({"path": "nope.txt"})).await;
    assert!(e.contains("does not exist"), "{e}");
    let e = ws.err("read_file", json!({"path": "../x"})).await;
    assert!(e.contains("leaves the workspace"), "{e}");
    let e = ws.err("read_file", json!({"path": "escape"})).await;
    assert!(e.contains("outside the workspace"), "{e}");
    let e = ws.err("read_file", json!({"file": "README.md"})).await;
    assert!(
        e.contains("invalid arguments for read_file") && e.contains("path"),
        "{e}"
    );
    let e = ws.err("read_file", json!("README.md")).await;
    assert!(e.contains("invalid arguments"), "{e}");
}

#[tokio::test]
async fn write_file_creates_overwrites_and_stores_blobs() {
    let mut ws = Ws::new(&files());
    let out = ws
        .ok(
            "write_file",
            json!({"path": "new/deep/file.txt", "content": "hello"}),
        )
        .await;
    assert!(out.contains("created `new/deep/file.txt`"), "{out}");
    assert_eq!(ws.content("new/deep/file.txt"), "hello");
    assert_eq!(ws.ov.node(&WsPath::parse("new/deep").unwrap()), Node::Dir);
    let out = ws
        .ok(
            "write_file",
            json!({"path": "README.md", "content": "replaced"}),
        )
        .await;
    assert!(out.contains("overwrote"), "{out}");
    assert_eq!(ws.content("README.md"), "replaced");
    // Writing through a symlink writes its target.
    ws.ok(
        "write_file",
        json!({"path": "link.md", "content": "via link"}),
    )
    .await;
    assert_eq!(ws.content("README.md"), "via link");
    assert!(matches!(ws.ov.changes()[0], ChangeOp::Write { .. }));
    assert_eq!(ws.ov.changes().len(), 3);
}

#[tokio::test]
async fn write_file_keeps_an_executable_mode() {
    let mut ws = Ws::new(&[("run.sh", "echo")]);
    // Make the file executable in the overlay first.
    let p = WsPath::parse("run.sh").unwrap();
    let mut entry = ws.ov.file(&p).unwrap();
    entry.mode = MODE_EXEC;
    ws.ov.write(&p, entry).unwrap();
    ws.ok(
        "write_file",
        json!({"path": "run.sh", "content": "echo hi"}),
    )
    .await;
    assert_eq!(ws.ov.file(&p).unwrap().mode, MODE_EXEC);
}

#[tokio::test]
async fn write_file_errors() {
    let mut ws = Ws::new(&files());
    let e = ws
        .err("write_file", json!({"path": "src", "content": "x"}))
        .await;
    assert!(e.contains("is a directory"), "{e}");
    let e = ws
        .err("write_file", json!({"path": "../x", "content": "x"}))
        .await;
    assert!(e.contains("leaves the workspace"), "{e}");
    let e = ws
        .err("write_file", json!({"path": "/", "content": "x"}))
        .await;
    assert!(e.contains("empty"), "{e}");
    let e = ws
        .err(
            "write_file",
            json!({"path": "README.md/child", "content": "x"}),
        )
        .await;
    assert!(e.contains("not a directory"), "{e}");
    let e = ws.err("write_file", json!({"path": "a.txt"})).await;
    assert!(e.contains("content"), "{e}");
}

#[tokio::test]
async fn edit_file_replaces_exact_strings() {
    let mut ws = Ws::new(&files());
    let out = ws
        .ok(
            "edit_file",
            json!({"path": "README.md", "old_string": "line two", "new_string": "LINE 2"}),
        )
        .await;
    assert!(out.contains("replaced 1 occurrence"), "{out}");
    assert_eq!(ws.content("README.md"), "line one\nLINE 2\nline three\n");
    assert!(matches!(ws.ov.changes()[0], ChangeOp::Edit { .. }));
    let out = ws
        .ok(
            "edit_file",
            json!({"path": "dup.txt", "old_string": "same", "new_string": "diff", "replace_all": true}),
        )
        .await;
    assert!(out.contains("replaced 3 occurrences"), "{out}");
    assert_eq!(ws.content("dup.txt"), "diff diff diff\n");
}

#[tokio::test]
async fn edit_file_errors() {
    let mut ws = Ws::new(&files());
    let e = ws
        .err(
            "edit_file",
            json!({"path": "dup.txt", "old_string": "same", "new_string": "x"}),
        )
        .await;
    assert!(e.contains("occurs 3 times"), "{e}");
    let e = ws
        .err(
            "edit_file",
            json!({"path": "README.md", "old_string": "absent", "new_string": "x"}),
        )
        .await;
    assert!(e.contains("not found"), "{e}");
    let e = ws
        .err(
            "edit_file",
            json!({"path": "missing.md", "old_string": "a", "new_string": "b"}),
        )
        .await;
    assert!(e.contains("does not exist"), "{e}");
    let e = ws
        .err(
            "edit_file",
            json!({"path": "bin.dat", "old_string": "a", "new_string": "b"}),
        )
        .await;
    assert!(e.contains("binary"), "{e}");
    let e = ws
        .err(
            "edit_file",
            json!({"path": "src", "old_string": "a", "new_string": "b"}),
        )
        .await;
    assert!(e.contains("is a directory"), "{e}");
}

#[tokio::test]
async fn delete_file_removes_files_directories_and_links() {
    let mut ws = Ws::new(&files());
    let out = ws.ok("delete_file", json!({"path": "README.md"})).await;
    assert!(out.contains("deleted `README.md`"), "{out}");
    let out = ws.ok("delete_file", json!({"path": "src"})).await;
    assert!(out.contains("deleted directory `src`"), "{out}");
    assert_eq!(
        ws.ov.node(&WsPath::parse("src/main.rs").unwrap()),
        Node::Missing
    );
    // A link is deleted itself, not its target.
    ws.ok("delete_file", json!({"path": "link.md"})).await;
    assert_eq!(
        ws.ov.node(&WsPath::parse("link.md").unwrap()),
        Node::Missing
    );
    let e = ws.err("delete_file", json!({"path": "README.md"})).await;
    assert!(e.contains("does not exist"), "{e}");
    let e = ws.err("delete_file", json!({"path": "../outside"})).await;
    assert!(e.contains("leaves the workspace"), "{e}");
    let e = ws.err("delete_file", json!({"path": "."})).await;
    assert!(e.contains("empty"), "{e}");
}

#[tokio::test]
async fn list_files_lists_a_directory() {
    let mut ws = Ws::new(&files());
    let out = ws.ok("list_files", json!({})).await;
    assert!(out.contains("src/\n"), "{out}");
    assert!(out.contains("README.md (29 bytes)"), "{out}");
    let out = ws.ok("list_files", json!({"path": "srclink"})).await;
    assert_eq!(out, "lib.rs (48 bytes)\nmain.rs (34 bytes)\n");
    ws.ok("write_file", json!({"path": "empty/.keep", "content": ""}))
        .await;
    ws.ok("delete_file", json!({"path": "empty/.keep"})).await;
    let out = ws.ok("list_files", json!({"path": "empty"})).await;
    assert!(out.contains("is empty"), "{out}");
    let e = ws.err("list_files", json!({"path": "README.md"})).await;
    assert!(e.contains("not a directory"), "{e}");
    let e = ws.err("list_files", json!({"path": "nowhere"})).await;
    assert!(e.contains("does not exist"), "{e}");
}

#[tokio::test]
async fn glob_matches_visible_files() {
    let mut ws = Ws::new(&files());
    ws.ok("write_file", json!({"path": "src/extra.rs", "content": ""}))
        .await;
    ws.ok("delete_file", json!({"path": "src/lib.rs"})).await;
    let out = ws.ok("glob", json!({"pattern": "src/*.rs"})).await;
    assert_eq!(out, "src/extra.rs\nsrc/main.rs\n");
    let out = ws.ok("glob", json!({"pattern": "**/*.md"})).await;
    assert!(
        out.contains("docs/guide.md") && out.contains("README.md"),
        "{out}"
    );
    let out = ws.ok("glob", json!({"pattern": "*.rs"})).await;
    assert!(out.contains("no files match"), "{out}");
    let e = ws.err("glob", json!({"pattern": "src/[.rs"})).await;
    assert!(e.contains("invalid glob"), "{e}");
}

#[tokio::test]
async fn grep_finds_lines() {
    let mut ws = Ws::new(&files());
    let out = ws.ok("grep", json!({"pattern": "^fn|pub fn"})).await;
    assert_eq!(
        out,
        "docs/guide.md:2:fn in docs\nsrc/lib.rs:1:pub fn add(a: i32, b: i32) -> i32 {\nsrc/main.rs:1:fn main() {\n"
    );
    let out = ws
        .ok("grep", json!({"pattern": "fn", "glob": "*.md"}))
        .await;
    assert_eq!(out, "docs/guide.md:2:fn in docs\n");
    let out = ws
        .ok("grep", json!({"pattern": "fn", "path": "docs"}))
        .await;
    assert_eq!(out, "docs/guide.md:2:fn in docs\n");
    let out = ws
        .ok("grep", json!({"pattern": "a \\+ b", "path": "src/lib.rs"}))
        .await;
    assert_eq!(out, "src/lib.rs:2:    a + b\n");
    let out = ws.ok("grep", json!({"pattern": "zzz"})).await;
    assert!(out.contains("no matches"), "{out}");
    let e = ws.err("grep", json!({"pattern": "("})).await;
    assert!(e.contains("invalid regular expression"), "{e}");
    let e = ws
        .err("grep", json!({"pattern": "x", "path": "../up"}))
        .await;
    assert!(e.contains("leaves the workspace"), "{e}");
}

#[tokio::test]
async fn long_outputs_are_truncated_with_a_marker() {
    let mut ws = Ws::new(&[]);
    let big: String = (0..5000)
        .map(|i| format!("row {i} of the big file\n"))
        .collect();
    ws.ok("write_file", json!({"path": "big.txt", "content": big}))
        .await;
    let out = ws.ok("read_file", json!({"path": "big.txt"})).await;
    assert!(out.chars().count() < MAX_OUTPUT_CHARS + 100);
    assert!(
        out.contains("[output truncated:"),
        "{}",
        &out[out.len() - 80..]
    );
}

#[tokio::test]
async fn unknown_tools_are_results_not_crashes() {
    let mut ws = Ws::new(&[]);
    let e = ws.err("rm_rf", json!({})).await;
    assert!(
        e.contains("unknown tool `rm_rf`") && e.contains("write_file"),
        "{e}"
    );
}

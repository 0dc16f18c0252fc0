//! The `http_get` tool end to end, as a user enables it: a spec's `[tools.http_get]`
//! allow-list, a scripted branch that fetches a page on a real local server and a host the
//! list does not name, both answers in its log; off without the table; a bad table or an
//! approval rule naming a tool that does not exist refused before anything runs.

use super::harness::{command, stderr};
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;

/// A server on 127.0.0.1 answering every GET with a page naming its path, on a thread
/// that ends with the process; its port.
fn serve() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            // The rest of the request's head.
            let mut header = String::new();
            while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
                header.clear();
            }
            let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
            let body = format!("the page at {path}");
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    port
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn write_project(dir: &Path, port: u16, other: u16, table: &str) {
    std::fs::create_dir(dir.join("ws")).unwrap();
    std::fs::write(dir.join("ws/README"), "x\n").unwrap();
    std::fs::write(
        dir.join("script.toml"),
        format!(
            r#"[[turns.a]]
tool_calls = [
  {{ name = "http_get", args = {{ url = "http://127.0.0.1:{port}/docs/intro" }} }},
  {{ name = "http_get", args = {{ url = "http://127.0.0.1:{other}/secret" }} }},
]

[[turns.a]]
text = "read it"
"#
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("fork.toml"),
        format!(
            r#"goal = "read the docs"
workspace = "ws"
model = "scripted:web"

[models."scripted:web"]
script = "script.toml"
{table}
[[branches]]
label = "a"
"#
        ),
    )
    .unwrap();
}

/// `forkfleet run fork.toml --json` in `dir`, then the branch's log as text.
fn run(dir: &Path) -> (std::process::Output, String) {
    let out = command()
        .current_dir(dir)
        .args(["run", "fork.toml", "--json"])
        .output()
        .unwrap();
    let Ok(doc) = serde_json::from_slice::<Value>(&out.stdout) else {
        return (out, String::new());
    };
    let fork = doc["fork_id"].as_str().unwrap().to_string();
    let log = command()
        .current_dir(dir)
        .args(["log", &format!("{fork}/a"), "--json"])
        .output()
        .unwrap();
    (out, String::from_utf8_lossy(&log.stdout).into_owned())
}

#[test]
fn a_spec_that_allows_a_host_lets_the_branch_read_it_and_nothing_else() {
    let (port, other) = (serve(), closed_port());
    let dir = tempfile::tempdir().unwrap();
    let table = format!("\n[tools.http_get]\nallow = [\"127.0.0.1:{port}\"]\nmax_bytes = 4096\n");
    write_project(dir.path(), port, other, &table);
    let (out, log) = run(dir.path());
    assert!(out.status.success(), "{}\n{log}", stderr(&out));
    assert!(log.contains("the page at /docs/intro"), "{log}");
    assert!(
        log.contains(&format!("host `127.0.0.1` (port {other}) is not allowed")),
        "{log}"
    );
}

#[test]
fn without_the_table_http_get_is_not_enabled() {
    let dir = tempfile::tempdir().unwrap();
    write_project(dir.path(), closed_port(), closed_port(), "");
    let (out, log) = run(dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(log.contains("`http_get` is not enabled"), "{log}");
    assert!(!log.contains("the page at"), "{log}");
}

#[test]
fn bad_tool_tables_and_unknown_tools_are_refused_before_anything_runs() {
    for (table, says) in [
        (
            "\n[tools.http_get]\nallow = [\"https://docs.rs\"]\n",
            "tools.http_get.allow",
        ),
        ("\n[tools.http_get]\nallow = []\n", "is empty"),
        ("\n[tools.http_gett]\nallow = [\"docs.rs\"]\n", "http_gett"),
        (
            "\n[approval]\ntools = [\"http_gett\"]\n",
            "valid: read_file",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write_project(dir.path(), closed_port(), closed_port(), table);
        let (out, _) = run(dir.path());
        assert_eq!(out.status.code(), Some(2), "{table}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{table}: {}", stderr(&out));
        assert!(!dir.path().join(".forkfleet").join("runs").exists());
    }
    // An approval rule may name it.
    let dir = tempfile::tempdir().unwrap();
    write_project(
        dir.path(),
        closed_port(),
        closed_port(),
        "\n[tools.http_get]\nallow = [\"docs.rs\"]\n\n[approval]\ntools = [\"http_get\"]\n",
    );
    let out = command()
        .current_dir(dir.path())
        .args(["fork", "create", "fork.toml", "--dry-run"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    // The dry run says the tool is on, and for which hosts.
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("http_get (allow docs.rs)"), "{text}");
}

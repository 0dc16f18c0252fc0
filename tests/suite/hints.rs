//! Every command a hint prints runs as printed, from any directory (issue 13): the data
//! directory absolute and quoted, the cluster's flags included. Each test runs the hint
//! through `sh` from `/`, a placeholder (`LABEL`, `X`) filled in.

use super::harness::{command, forkfleet, json, path_str, stderr, Example};
use super::resolve::{setup, verdict, TESTED};
use std::process::Output;

/// Run `hint` (a line that starts with `forkfleet`) through `sh -c` in `/`, after
/// `replace`ments of its placeholders.
fn run_hint(hint: &str, replace: &[(&str, &str)]) -> Output {
    let mut line = hint.trim().to_string();
    assert!(line.starts_with("forkfleet "), "not a command: {line}");
    for (from, to) in replace {
        assert!(line.contains(from), "no `{from}` in {line}");
        line = line.replacen(from, to, 1);
    }
    let line = line.replacen(
        "forkfleet",
        &format!("'{}'", env!("CARGO_BIN_EXE_forkfleet")),
        1,
    );
    // The environment the harness gives the binary (`FORKFLEET_*` cleared), in `/`.
    let mut cmd = std::process::Command::new("sh");
    cmd.arg("-c")
        .arg(&line)
        .current_dir("/")
        .env("RUST_LOG", "warn");
    for (k, _) in std::env::vars_os() {
        if let Some(k) = k.to_str() {
            if k.starts_with("FORKFLEET_") && k != "FORKFLEET_NATS_SERVER" {
                cmd.env_remove(k);
            }
        }
    }
    cmd.output().unwrap()
}

/// The first line of `text` holding `marker`, from `forkfleet` on.
fn hint_after<'a>(text: &'a str, marker: &str) -> &'a str {
    let line = text
        .lines()
        .find(|l| l.contains(marker))
        .unwrap_or_else(|| panic!("no `{marker}` in:\n{text}"));
    let at = line
        .find("forkfleet ")
        .unwrap_or_else(|| panic!("no command in `{line}`"));
    line[at..].trim_end_matches('`')
}

/// `forkfleet run` from the example's directory, its spec and data dir relative.
fn run_here(ex: &Example, spec: &str, extra: &[&str]) -> Output {
    command()
        .current_dir(ex.dir.path())
        .args(["run", spec, "--timeout-s", "120"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn the_unresolved_runs_merge_hint_runs_from_anywhere() {
    let ex = Example::quickstart();
    let out = run_here(&ex, "fork.toml", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let hint = hint_after(&text, "forkfleet fork merge");
    assert!(hint.contains(" --data /"), "an absolute data dir: {hint}");
    let merged = run_hint(hint, &[("LABEL", "concise")]);
    assert!(merged.status.success(), "{hint}\n{}", stderr(&merged));
}

#[test]
fn the_manual_decision_and_the_judges_suggestion_run_from_anywhere() {
    // A person picks (strategy manual).
    let ex = Example::quickstart();
    let doc = json(
        &command()
            .current_dir(ex.dir.path())
            .args(["run", "fork.toml", "--json", "--timeout-s", "120"])
            .output()
            .unwrap(),
    );
    let id = doc["fork_id"].as_str().unwrap();
    let out = command()
        .current_dir(ex.dir.path())
        .args([
            "fork",
            "resolve",
            id,
            "--strategy",
            "manual",
            "--data",
            ".forkfleet",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let hint = hint_after(&text, "a person picks:");
    let merged = run_hint(hint, &[("LABEL", "tidy")]);
    assert!(merged.status.success(), "{hint}\n{}", stderr(&merged));

    // The judge's pick below the threshold (auto_with_fallback): accept it as printed.
    let (ex, spec) = setup(
        &format!(
            "strategy = \"auto_with_fallback\"\nconfidence_threshold = 0.9\njudge_model = \"scripted:judge1\"\n{TESTED}"
        ),
        &[verdict("good", 0.8)],
    );
    let name = spec.file_name().unwrap().to_str().unwrap().to_string();
    let out = run_here(&ex, &name, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let hint = hint_after(&text, "accept it with:");
    let merged = run_hint(hint, &[]);
    assert!(merged.status.success(), "{hint}\n{}", stderr(&merged));
    assert_eq!(ex.read("result.txt").as_deref(), Some("ok\n"));
}

#[test]
fn the_paused_branchs_top_up_hint_runs_from_anywhere() {
    let ex = Example::quickstart();
    let text = std::fs::read_to_string(ex.spec()).unwrap();
    ex.write_spec(&format!(
        "aggregate_budget_usd = 0.0005\non_exhausted = \"pause\"\nmax_output_tokens = 200\n{text}"
    ));
    let out = run_here(&ex, "custom.toml", &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    let hint = hint_after(&err, "# the fork's cap");
    let topped = run_hint(hint, &[("X", "1")]);
    assert!(topped.status.success(), "{hint}\n{}", stderr(&topped));
    // Nothing is left paused.
    let data = ex.data();
    let list = json(&forkfleet(&[
        "fork",
        "ls",
        "--data",
        path_str(&data),
        "--json",
    ]));
    assert!(
        list[0]["branches"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["state"] != "paused"),
        "{list}"
    );
}

use super::command::{command_argv, Applied, MAX_LISTED_PATHS};
use super::*;
use crate::toolspec::{fork_tool_specs, tools_json_bytes};
use forkfleet_shared::tools::{HttpGetSection, ToolSettings};
use std::collections::BTreeMap;

#[test]
fn commands_are_words_or_a_line_split_like_a_shell() {
    assert_eq!(
        command_argv(&json!(["sh", "-c", "echo a b"])).unwrap(),
        ["sh", "-c", "echo a b"]
    );
    assert_eq!(
        command_argv(&json!(r#"pytest -q "tests/a b.py" 'x y' c\ d $HOME"#)).unwrap(),
        ["pytest", "-q", "tests/a b.py", "x y", "c d", "$HOME"]
    );
    for (bad, says) in [
        (json!([]), "empty"),
        (json!(""), "empty"),
        (json!(["", "x"]), "empty"),
        (json!(["ls", 3]), "must be a string"),
        (json!(42), "a list of words or a string"),
        (json!("echo 'open"), "unterminated"),
    ] {
        let err = command_argv(&bad).unwrap_err();
        assert!(err.contains(says), "{bad}: {err}");
    }
}

#[test]
fn every_declared_tool_is_told_to_the_model_and_every_registered_one_declared() {
    for decl in forkfleet_shared::tools::TOOLS {
        let spec = spec_of(decl.name).unwrap_or_else(|| panic!("{} has no spec", decl.name));
        assert_eq!(spec.name, decl.name);
        assert!(!spec.description.is_empty(), "{}", decl.name);
        // The worker's registry runs every tool but the fork tools, which the agent runs
        // (`forktools`, whose specs are `fork_tool_specs`).
        let runs_here = registered(decl.name).is_some();
        let forks = decl.kind == forkfleet_shared::tools::ToolKind::Fork;
        assert!(runs_here != forks, "{}: runs in one place", decl.name);
        assert_eq!(
            forks,
            fork_tool_specs().iter().any(|s| s.name == decl.name),
            "{}",
            decl.name
        );
    }
    for tool in REGISTRY {
        assert!(
            forkfleet_shared::tools::decl(tool.name).is_some(),
            "{}",
            tool.name
        );
    }
}

#[test]
fn the_static_tool_lists_are_measured_once() {
    let standard = ToolBox::standard();
    let with = ToolBox::with_command(Some(CommandTool {
        timeout_s: 5.0,
        env: BTreeMap::new(),
        max_output_bytes: 1024,
        sandbox: Default::default(),
    }));
    assert_eq!(standard.specs(), tool_specs());
    assert!(std::ptr::eq(standard.specs(), ToolBox::standard().specs()));
    assert_eq!(with.specs().len(), tool_specs().len() + 1);
    assert!(std::ptr::eq(with.specs(), ToolBox::clone(&with).specs()));
    let forking = ToolBox::with_settings(ToolSettings {
        forking: true,
        ..ToolSettings::default()
    });
    let both = ToolBox::with_settings(ToolSettings {
        forking: true,
        run_command: with.settings.run_command.clone(),
        ..ToolSettings::default()
    });
    let get = ToolBox::with_settings(ToolSettings {
        http_get: Some(
            HttpGetSection {
                allow: vec!["docs.rs".into()],
                ..Default::default()
            }
            .build()
            .unwrap(),
        ),
        ..ToolSettings::default()
    });
    assert_eq!(get.names().last(), Some(&"http_get"));
    let forks = fork_tool_specs().len();
    assert_eq!(forking.specs().len(), tool_specs().len() + forks);
    assert_eq!(both.specs().len(), tool_specs().len() + 1 + forks);
    assert!(both.names().contains(&"fork_run") && both.names().contains(&RUN_COMMAND));
    for tools in [
        standard.specs(),
        with.specs(),
        forking.specs(),
        both.specs(),
        get.specs(),
    ] {
        assert_eq!(measured_json_bytes(tools), Some(tools_json_bytes(tools)));
        let copy = tools.to_vec();
        assert_eq!(measured_json_bytes(&copy), None, "a copy is measured anew");
    }
}

#[test]
fn the_files_line_lists_and_bounds_what_changed() {
    assert_eq!(Applied::default().report(), "files: no changes\n");
    let many: Vec<String> = (0..MAX_LISTED_PATHS + 3).map(|i| format!("f{i}")).collect();
    let applied = Applied {
        created: many,
        changed: vec!["a.txt".into()],
        made_executable: vec!["run.sh".into()],
        deleted: vec!["old/".into(), "x".into()],
        not_imported: vec![("evil".into(), "a symlink to `/etc`".into())],
        ..Applied::default()
    };
    let report = applied.report();
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(lines.len(), 2, "{report}");
    assert!(
        lines[0].starts_with("files: created `f0`, `f1`"),
        "{report}"
    );
    assert!(
        lines[0].contains(
            "`f49`, and 3 more; changed `a.txt`; made executable `run.sh`; deleted `old/`, `x`"
        ),
        "{report}"
    );
    assert!(!lines[0].contains("`f50`"));
    assert_eq!(
        lines[1],
        "not taken back (left as they were): `evil` (a symlink to `/etc`)"
    );
}

//! `forkfleet chat` (docs/TERMINAL.md), driven in a real terminal: the binary runs in
//! tmux at 80x24, keys go in with `send-keys`, the screen comes out with `capture-pane`.
//! The same walk runs embedded and against a cluster of real worker processes. With
//! `FORKFLEET_CAPTURES=update`, the embedded walk writes its screens to
//! `tests/captures/chat/` (what docs/TERMINAL.md shows).

use super::fleet::{Fleet, Options, COMMAND_LIMIT, POLL};
use super::harness::{path_str, Example, Tmux};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The branches' scripted turns for the walk: `a` answers slowly enough to be steered
/// mid-run, `c` would think for a minute (it is stopped with Esc).
const SCRIPT: &str = r#"
[defaults]
usage = { input_tokens = 900, output_tokens = 120 }

[[turns.main]]
text = "Let me read the tool first."
tool_calls = [{ name = "read_file", args = { path = "greet.py" } }]

[[turns.main]]
text = "greet.py prints a bare greeting. Fork me to try a few ways side by side."

[[turns.main]]
text = "I have the merged version now: the greeting and its notes are in the workspace."
repeat = 20

[[turns.a]]
latency_ms = 300
text = "Trying approach a."
tool_calls = [{ name = "write_file", args = { path = "notes/a.md", content = "approach a\n" } }]

[[turns.a]]
latency_ms = 5000
tool_calls = [{ name = "edit_file", args = { path = "greet.py", old_string = "Hello", new_string = "Hello from a" } }]

[[turns.a]]
text = "Done with approach a."
repeat = 20

[[turns.b]]
latency_ms = 300
text = "Trying approach b."
tool_calls = [{ name = "write_file", args = { path = "notes/b.md", content = "approach b\n" } }]

[[turns.b]]
latency_ms = 1500
tool_calls = [{ name = "edit_file", args = { path = "greet.py", old_string = "Hello", new_string = "Hello from b" } }]

[[turns.b]]
text = "Done with approach b."
repeat = 20

[[turns.c]]
latency_ms = 60000
text = "Thinking hard."
"#;

/// Where the embedded walk keeps its screens when asked to.
fn captures_dir() -> Option<PathBuf> {
    (std::env::var("FORKFLEET_CAPTURES").as_deref() == Ok("update"))
        .then(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/captures/chat"))
}

/// A chat in tmux, with the workspace it works in.
struct Chat {
    tmux: Tmux,
    workspace: PathBuf,
    captures: Option<PathBuf>,
}

impl Chat {
    /// `forkfleet chat` on a copy of `examples/chat` with [`SCRIPT`], `extra` flags after.
    fn start(ex: &Example, extra: &str, captures: Option<PathBuf>) -> Chat {
        std::fs::write(ex.dir.path().join("script.toml"), SCRIPT).unwrap();
        let workspace = ex.workspace();
        let tmux = Tmux::start_sized(
            &format!(
                "cd {} && env NO_COLOR=1 {} chat --spec chat.toml --workspace workspace {extra}; echo CHAT-EXIT-$?; sleep 600",
                path_str(ex.dir.path()),
                env!("CARGO_BIN_EXE_forkfleet")
            ),
            80,
            24,
        );
        Chat {
            tmux,
            workspace,
            captures,
        }
    }

    /// Until the screen shows `text` (bounded); the screen then.
    fn wait(&self, text: &str) -> String {
        self.tmux.wait_for(text, |s| s.contains(text))
    }

    /// Keep the screen as step `name` (when captures are asked for).
    fn capture(&self, name: &str) {
        if let Some(dir) = &self.captures {
            std::fs::create_dir_all(dir).unwrap();
            let screen = self.tmux.visible();
            let trimmed: Vec<&str> = screen.lines().map(str::trim_end).collect();
            std::fs::write(dir.join(format!("{name}.txt")), trimmed.join("\n") + "\n").unwrap();
        }
    }

    /// Until `path` in the workspace holds `text` (bounded).
    fn wait_file(&self, path: &str, text: &str) {
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            let now = std::fs::read_to_string(self.workspace.join(path)).unwrap_or_default();
            if now.contains(text) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{path} never held `{text}`: {now:?}\n{}",
                self.tmux.visible()
            );
            std::thread::sleep(POLL);
        }
    }
}

/// The tab strip: the first line of the screen.
fn tab_strip(screen: &str) -> &str {
    screen.lines().next().unwrap_or_default()
}

/// The walk the issue names: chat, `/fork` into three tabs that go from running to done with
/// their tool calls streamed, steer one mid-run, Esc-terminate one, resolve to the
/// acceptance step (its diff, cancel, `/merge` shows it again), override to the picker and
/// merge another branch through it, see the workspace change, and talk on.
fn walk(chat: &Chat) {
    let t = &chat.tmux;
    chat.wait("Type a message");
    chat.capture("01-start");
    t.type_line("Make the greeting friendlier");
    let screen = chat.wait("Fork me to try");
    // The tool call and its result, folded to a line each.
    assert!(screen.contains("⚙ read_file"), "{screen}");
    assert!(screen.contains("↳ read_file ok"), "{screen}");
    chat.capture("02-answer");

    t.type_line("/fork");
    chat.wait("fork into 3 branches");
    // The labels come prefilled and the first steer has the focus.
    for (i, steer) in ["keep it short", "add a docstring", "tidy up"]
        .iter()
        .enumerate()
    {
        t.type_text(steer);
        if i < 2 {
            t.keys(&["Tab", "Tab", "Tab", "Tab"]);
        }
    }
    chat.capture("03-fork-form");
    t.keys(&["Enter"]);
    let screen = t.wait_for("three running tabs", |s| {
        let strip = tab_strip(s);
        strip.contains("● a") && strip.contains("● c")
    });
    assert!(tab_strip(&screen).contains("0 overview"), "{screen}");
    chat.capture("04-overview-running");

    // Steer `a` while its second call runs (5 s).
    t.keys(&["1"]);
    let screen = chat.wait("Trying approach a.");
    assert!(screen.contains("branch a · ● running"), "{screen}");
    t.type_line("also handle a missing name");
    chat.wait("steered `a`");

    // Esc on `c`: asked first, then stopped; the others go on.
    t.keys(&["3"]);
    chat.wait("branch c · ● running");
    t.keys(&["Escape"]);
    chat.wait("terminate `c`?");
    chat.capture("05-terminate-confirm");
    t.keys(&["y"]);
    t.wait_for("c terminated, a and b done", |s| {
        let strip = tab_strip(s);
        strip.contains("⊘ c") && strip.contains("✓ a") && strip.contains("✓ b")
    });

    // `a`'s tab: its own calls streamed, and the steer before its last answer.
    t.keys(&["1"]);
    let screen = chat.wait("Done with approach a.");
    let steer = screen
        .find("(steer) also handle a missing name")
        .expect(&screen);
    let done = screen.find("Done with approach a.").unwrap();
    assert!(steer < done, "the steer came after the end:\n{screen}");
    assert!(screen.contains("⚙ edit_file"), "{screen}");
    chat.capture("06-branch-a");
    t.keys(&["0"]);
    let screen = chat.wait("every branch finished");
    assert!(screen.contains("terminated"), "{screen}");
    chat.capture("07-overview-done");

    // The acceptance step: nothing merges before Enter.
    t.type_line("/resolve");
    let screen = chat.wait("accept the judges' pick?");
    assert!(screen.contains("merge `b`"), "{screen}");
    chat.capture("08-accept");
    t.keys(&["d"]);
    let screen = chat.wait("diff (");
    assert!(screen.contains("greet.py"), "{screen}");
    chat.capture("09-accept-diff");
    t.keys(&["Escape"]);
    chat.wait("accept the judges' pick?");
    t.keys(&["Escape"]);
    chat.wait("nothing merged: /merge shows");
    assert!(!std::fs::read_to_string(chat.workspace.join("greet.py"))
        .unwrap()
        .contains("from"));
    // The kept verdict: the step again, without a new resolve.
    t.type_line("/merge");
    chat.wait("accept the judges' pick?");
    // Override: the picker, the judges' pick preselected; merge `a` through it.
    t.keys(&["o"]);
    let screen = chat.wait("merge which branch into the chat?");
    assert!(screen.contains("▶ 2"), "b preselected:\n{screen}");
    chat.capture("10-picker");
    t.keys(&["1", "Enter"]);
    chat.wait("merged `a` into the chat");
    chat.wait_file("greet.py", "Hello from a");
    chat.wait_file("notes/a.md", "approach a");
    let screen = t.wait_for("the tabs closed", |s| !tab_strip(s).contains("overview"));
    assert!(screen.contains("merged branch `a`"), "{screen}");
    chat.capture("11-merged");

    // The chat goes on from the merged history.
    t.type_line("thanks, what now?");
    chat.wait("I have the merged version now");
    chat.capture("12-goes-on");
    t.keys(&["C-c"]);
    let screen = chat.wait("CHAT-EXIT-");
    assert!(screen.contains("CHAT-EXIT-0"), "{screen}");
    assert!(
        screen.contains("resume it with forkfleet chat --resume"),
        "{screen}"
    );
}

#[test]
fn chat_forks_steers_stops_resolves_merges_and_goes_on_embedded() {
    let ex = Example::named("chat");
    let chat = Chat::start(&ex, "", captures_dir());
    walk(&chat);
    drop(chat);
    // Resumed: the same conversation, and the /fork defaults kept.
    let again = Chat::start(&ex, "--resume", None);
    let screen = again.wait("I have the merged version now");
    // The history the merge adopted: `a`'s steers and answer.
    assert!(
        screen.contains("(steer) also handle a missing name"),
        "{screen}"
    );
    again.tmux.type_line("/fork-branches 2");
    again.wait("fork_branches = 2");
    again.tmux.keys(&["C-c"]);
    again.wait("CHAT-EXIT-0");
    let settings = std::fs::read_to_string(ex.workspace().join(".forkfleet/chat.toml")).unwrap();
    assert!(settings.contains("fork_branches = 2"), "{settings}");
}

#[test]
fn chat_runs_the_same_walk_on_a_cluster_of_worker_processes() {
    let fleet = Fleet::start(2, 8, Options::default());
    let ex = Example::named("chat");
    let chat = Chat::start(&ex, &format!("--nats {}", fleet.nats.url()), None);
    walk(&chat);
    // The runs live on the cluster's coordinator, not in the workspace.
    let forks = fleet.client(&["fork", "ls", "--json"]).json();
    assert_eq!(forks.as_array().map(Vec::len), Some(2), "{forks}");
}

#[test]
fn chat_refuses_what_it_cannot_do_and_keeps_the_message() {
    let ex = Example::named("chat");
    let chat = Chat::start(&ex, "--model nope:model", captures_dir());
    chat.wait("Type a message");
    chat.tmux.keys(&["?"]);
    chat.wait("keys and commands");
    chat.capture("00-help");
    chat.tmux.keys(&["Escape"]);
    chat.tmux.type_line("/fork");
    chat.wait("say something first");
    chat.tmux.type_line("/nonsense");
    chat.wait("/nonsense is not a command");
    chat.tmux.keys(&["C-u"]);
    chat.tmux.type_line("hello");
    // An unknown model: the error names it, and the message waits in the input.
    let screen = chat.wait("nope:model");
    assert!(screen.lines().any(|l| l.starts_with("› hello")), "{screen}");
    chat.tmux.keys(&["C-c"]);
    chat.wait("CHAT-EXIT-0");
}

#[test]
fn chat_outside_a_terminal_says_so() {
    let ex = Example::named("chat");
    let out = super::harness::forkfleet(&["chat", "--workspace", path_str(&ex.workspace())]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("terminal UI"), "{err}");
}

#[test]
fn chat_asks_for_consent_in_the_focused_tab() {
    let ex = Example::named("chat");
    let spec = ex.dir.path().join("chat.toml");
    let mut text = std::fs::read_to_string(&spec).unwrap();
    text.push_str("\n[approval]\ntools = [\"delete_file\"]\n");
    std::fs::write(&spec, text).unwrap();
    let chat = Chat::start(&ex, "", None);
    std::fs::write(
        ex.dir.path().join("script.toml"),
        r#"
[[turns.main]]
text = "Removing the stale readme."
tool_calls = [{ name = "delete_file", args = { path = "README.md" } }]

[[turns.main]]
text = "Fine, I left it."
repeat = 20

[[turns.a]]
tool_calls = [{ name = "delete_file", args = { path = "greet.py" } }]

[[turns.a]]
text = "Deleted on a."
repeat = 20
"#,
    )
    .unwrap();
    let t = &chat.tmux;
    chat.wait("Type a message");
    t.type_line("tidy up");
    // The agent's call waits: the prompt opens over the chat.
    let screen = chat.wait("`main` asks to run");
    assert!(screen.contains("delete_file"), "{screen}");
    assert!(screen.contains("rule: tools: delete_file"), "{screen}");
    t.keys(&["n"]);
    chat.wait("reason:");
    t.type_text("keep the readme");
    t.keys(&["Enter"]);
    let screen = chat.wait("Fine, I left it.");
    assert!(screen.contains("denied by"), "{screen}");
    assert!(screen.contains("keep the readme"), "{screen}");
    assert!(chat.workspace.join("README.md").exists());

    // A branch's request: its tab shows the badge, focusing it opens the prompt.
    t.type_line("/fork-branches 1");
    chat.wait("fork_branches = 1");
    t.type_line("/fork");
    chat.wait("fork into 1 branches");
    t.type_text("delete greet.py");
    t.keys(&["Enter"]);
    t.wait_for("a waits", |s| tab_strip(s).contains("? a"));
    t.keys(&["1"]);
    chat.wait("`a` asks to run");
    t.keys(&["y"]);
    let screen = chat.wait("Deleted on a.");
    assert!(screen.contains("approved by"), "{screen}");

    // Esc on the overview aborts the whole fork, once confirmed; `n` keeps it.
    t.type_line("/merge");
    chat.wait("merge which branch into the chat?");
    t.keys(&["Escape"]);
    t.keys(&["0"]);
    chat.wait("every branch finished");
    t.keys(&["Escape"]);
    chat.wait("abort the entire fork");
    t.keys(&["n"]);
    chat.wait("nothing stopped");
    assert!(tab_strip(&t.visible()).contains("overview"));
    t.keys(&["Escape"]);
    chat.wait("abort the entire fork");
    t.keys(&["y"]);
    t.wait_for("the tabs closed", |s| !tab_strip(s).contains("overview"));
    assert!(
        chat.workspace.join("greet.py").exists(),
        "an aborted fork changes nothing"
    );
    t.keys(&["C-c"]);
    chat.wait("CHAT-EXIT-0");
}

#[test]
fn the_agents_own_fork_opens_the_same_tabs_and_o_opens_the_diff_tool() {
    let ex = Example::named("chat");
    let spec = ex.dir.path().join("chat.toml");
    let text = std::fs::read_to_string(&spec).unwrap();
    std::fs::write(&spec, format!("forking = true\n{text}")).unwrap();
    // The diff tool: a script that says what it was given.
    let opener = ex.dir.path().join("opener.sh");
    std::fs::write(
        &opener,
        "#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/opened.txt\"\n",
    )
    .unwrap();
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&opener)
        .status()
        .unwrap();
    std::fs::write(
        ex.dir.path().join("script.toml"),
        r#"
[[turns.main]]
text = "Two ways to do it: I fork."
tool_calls = [{ name = "fork_run", args = { branches = [{ label = "x", steer = "the short way" }, { label = "y", steer = "the long way" }] } }]

[[turns.main]]
text = "Both run: pick the one you like."

[[turns.main]]
text = "Good choice."
repeat = 20

[[turns."*"]]
latency_ms = 300
tool_calls = [{ name = "write_file", args = { path = "way-{label}.md", content = "{label}\n" } }]

[[turns."*"]]
text = "Way {label} written."
repeat = 20
"#,
    )
    .unwrap();
    let tmux = Tmux::start_sized(
        &format!(
            "cd {} && env NO_COLOR=1 FORKFLEET_DIFFTOOL={} {} chat --spec chat.toml --workspace workspace; echo CHAT-EXIT-$?; sleep 600",
            path_str(ex.dir.path()),
            path_str(&opener),
            env!("CARGO_BIN_EXE_forkfleet")
        ),
        80,
        24,
    );
    let chat = Chat {
        tmux,
        workspace: ex.workspace(),
        captures: None,
    };
    let t = &chat.tmux;
    chat.wait("Type a message");
    t.type_line("do it two ways");
    // The agent's fork_run: its branches become tabs without a /fork.
    t.wait_for("the agent's branches done", |s| {
        let strip = tab_strip(s);
        strip.contains("✓ x") && strip.contains("✓ y")
    });
    t.type_line("/merge");
    chat.wait("merge which branch into the chat?");
    t.keys(&["2", "o"]);
    chat.wait("press Enter to go back to the chat");
    let opened = std::fs::read_to_string(ex.dir.path().join("opened.txt")).unwrap();
    assert!(opened.contains("y"), "{opened}");
    t.keys(&["Enter"]);
    // Back at the modal once the diff tool's prompt is gone (the modal's text is on the
    // screen before it too): an Enter sent earlier would only leave the tool.
    t.wait_for("the merge modal again", |s| {
        s.contains("merge which branch into the chat?")
            && !s.contains("press Enter to go back to the chat")
    });
    t.keys(&["Enter"]);
    chat.wait("merged `y` into the chat");
    chat.wait_file("way-y.md", "y");
    t.type_line("thanks");
    let screen = chat.wait("Good choice.");
    assert!(
        screen.contains("Both run: pick the one you like."),
        "{screen}"
    );
    t.keys(&["C-c"]);
    chat.wait("CHAT-EXIT-0");
}

#[test]
fn a_lost_connection_shows_in_the_status_line_and_the_chat_recovers() {
    let mut fleet = Fleet::start(1, 8, Options::default());
    let ex = Example::named("chat");
    let chat = Chat::start(&ex, &format!("--nats {}", fleet.nats.url()), None);
    let t = &chat.tmux;
    chat.wait("Type a message");
    t.type_line("Make the greeting friendlier");
    chat.wait("Fork me to try");
    fleet.nats.stop();
    chat.wait("connection lost");
    // The UI still answers while the calls fail.
    t.keys(&["?"]);
    chat.wait("keys and commands");
    t.keys(&["Escape"]);
    fleet.nats.resume();
    let deadline = Instant::now() + COMMAND_LIMIT;
    while fleet.client(&["fork", "ls"]).code != Some(0) {
        assert!(
            Instant::now() < deadline,
            "the cluster did not come back\n{}",
            fleet.logs()
        );
        std::thread::sleep(POLL);
    }
    let deadline = Instant::now() + COMMAND_LIMIT;
    while t.visible().contains("connection lost") {
        assert!(
            Instant::now() < deadline,
            "the chat did not recover\n{}\n{}",
            t.visible(),
            std::fs::read_to_string(chat.workspace.join(".forkfleet/chat.log")).unwrap_or_default()
        );
        std::thread::sleep(POLL);
    }
    t.type_line("and now?");
    chat.wait("I have the merged version now");
    t.keys(&["C-c"]);
    chat.wait("CHAT-EXIT-0");
}

/// A colour in an SGR sequence tmux writes (fore- or background; 39 and 49, the defaults,
/// are none).
fn has_colour(styled: &str) -> bool {
    styled.split('\u{1b}').any(|seq| {
        let Some(params) = seq.strip_prefix('[').and_then(|s| s.split('m').next()) else {
            return false;
        };
        params.split(';').any(|p| {
            matches!(
                p.parse::<u32>(),
                Ok(30..=37 | 40..=47 | 90..=97 | 100..=107)
            ) || p == "38"
                || p == "48"
        })
    })
}

#[test]
fn colours_follow_no_color() {
    let ex = Example::named("chat");
    for (env, coloured) in [("env -u NO_COLOR", true), ("env NO_COLOR=1", false)] {
        let tmux = Tmux::start_sized(
            &format!(
                "cd {} && {env} {} chat --spec chat.toml --workspace workspace; sleep 600",
                path_str(ex.dir.path()),
                env!("CARGO_BIN_EXE_forkfleet")
            ),
            80,
            24,
        );
        tmux.wait_for("the chat", |s| s.contains("Type a message"));
        let styled = tmux.visible_styled();
        assert_eq!(has_colour(&styled), coloured, "{env}: {styled:?}");
        tmux.keys(&["C-c"]);
    }
}

//! `forkfleet chat`: a terminal UI over a root run (docs/TERMINAL.md). The conversation
//! with one agent, forked mid-conversation into branch tabs that stream live, steered,
//! stopped, merged or resolved, after which the chat goes on from the winner.
//!
//! Layout: `app` (state and keys), `ui` (drawing), `poll` (the background: following
//! forks, actions), `transcript` (a log as lines), `settings` (`/fork-*` defaults),
//! `theme` (colours and `NO_COLOR`).

mod app;
mod poll;
mod settings;
mod theme;
mod transcript;
mod ui;

use super::*;
use app::{App, ChatRun, Start};
use forkfleet_shared::blob::BlobHash;
use futures::StreamExt;
use poll::Msg;

#[derive(Debug, Args)]
pub struct ChatArgs {
    /// The workspace the agent works in (default: the current directory); its directory
    /// follows the chat's agent.
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// The model, `provider:name` (default: the spec's).
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,
    /// A fork spec whose settings the chat runs with (models, system prompt, limits, tools,
    /// approvals, resolve); its goal and branches are not used: the first message is the
    /// goal, `/fork` makes the branches.
    #[arg(long, value_name = "FILE")]
    pub spec: Option<PathBuf>,
    /// Resume a chat: the one of root run RUN (id or unique prefix; the status line shows
    /// it), or without RUN the newest chat of this workspace.
    #[arg(long, value_name = "RUN", num_args = 0..=1, default_missing_value = "")]
    pub resume: Option<String>,
    /// The data directory of the embedded store (default: `.forkfleet/` in the workspace).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub(crate) async fn cmd_chat(args: ChatArgs) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let workspace =
        std::path::absolute(args.workspace.clone().unwrap_or_else(|| PathBuf::from(".")))?;
    if !workspace.is_dir() {
        return Err(BadInput(format!(
            "--workspace `{}` is not a directory; give the directory the agent works in",
            workspace.display()
        ))
        .into());
    }
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        return Err(BadInput(
            "forkfleet chat is a terminal UI: run it in a terminal (for scripts: forkfleet run, fork continue, fork steer)".into(),
        )
        .into());
    }
    // Log lines would scribble over the screen: they go to a file while the chat runs.
    let _log = Stderr::to_file(&workspace.join(".forkfleet").join("chat.log"));
    let client_args = ClientArgs {
        data: Some(
            args.data
                .clone()
                .unwrap_or_else(|| workspace.join(".forkfleet")),
        ),
        json: false,
        config: ConfigArgs {
            ..args.config.clone()
        },
    };
    let config = client_args.load_config()?;
    let pricing = Config::load_pricing(args.config.config.as_deref(), &config::process_env)?;
    let settings_file = settings::path(&workspace);
    let settings = settings::Settings::load(&settings_file)?;
    // A resumed chat's unfinished turns run again here.
    let local = if args.resume.is_some() && config.nats_config_for(config::Role::Client).is_none() {
        Local::Resume
    } else {
        Local::Run
    };
    let Some(session) = Session::connect(&client_args, &config, local).await? else {
        return Ok(());
    };
    let client = session.client.clone();
    let result = chat(client, args, workspace, pricing, settings).await;
    let closed = session.close().await;
    let root = result?;
    if let Some(root) = root {
        println!("chat run {root}: resume it with forkfleet chat --resume {root}");
    }
    closed
}

/// The chat `--resume RUN` names (the newest of `workspace` when RUN is empty): its fork,
/// root run and agent.
async fn find_chat(
    client: &Client,
    run: &str,
    workspace: &Path,
) -> anyhow::Result<(ChatRun, ForkView)> {
    let is_chat = |f: &ForkView| f.branches.len() == 1 && f.branches[0].label == SOLO_LABEL;
    let forks = client.forks().await?;
    let view = if run.is_empty() {
        let here = workspace.display().to_string();
        forks
            .into_iter()
            .filter(|f| is_chat(f) && f.workspace.as_deref() == Some(here.as_str()))
            .max_by_key(|f| f.created_at_ms)
            .ok_or_else(|| {
                BadInput(format!(
                    "no chat of workspace `{here}` to resume: start one with forkfleet chat, or name its run with --resume RUN"
                ))
            })?
    } else {
        let run = client.find_run(run).await?;
        forks
            .into_iter()
            .find(|f| is_chat(f) && (f.parent_run == run || f.branches[0].run_id == run))
            .ok_or_else(|| {
                BadInput(format!(
                    "run {run} is not a chat (a root run with one agent, `{SOLO_LABEL}`): `forkfleet runs ls` lists runs"
                ))
            })?
    };
    let chat = ChatRun {
        fork: view.fork_id,
        root: view.parent_run,
        main: view.branches[0].run_id,
        policy: Default::default(),
    };
    Ok((chat, view))
}

/// Run the UI until the person quits; the chat's root run, if one was made.
async fn chat(
    client: Client,
    args: ChatArgs,
    workspace: PathBuf,
    pricing: std::collections::BTreeMap<String, forkfleet_shared::pricing::Price>,
    settings: settings::Settings,
) -> anyhow::Result<Option<RunId>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let reach = if client.is_remote() {
        "cluster".to_string()
    } else {
        format!("embedded {}", client_data(&client))
    };
    let start = Start {
        spec: args.spec.clone(),
        workspace: workspace.clone(),
        model: args.model.clone(),
        pricing,
    };
    tokio::spawn(poll::watch_bus(client.clone(), tx.clone()));
    let mut app = App::new(client.clone(), tx, start, reach, settings);
    if let Some(run) = &args.resume {
        let (mut chat, view) = find_chat(&client, run, &workspace).await?;
        chat.policy = app.spec_policy();
        let synced = app
            .settings
            .synced
            .get(&chat.root.to_string())
            .and_then(|h| BlobHash::from_hex(h))
            .unwrap_or(view.snapshot);
        app.chat_view = Some(view);
        app.adopt_chat(chat, synced);
    }
    let mut terminal = ratatui::try_init()?;
    let _ = crossterm::execute!(std::io::stdout(), crossterm::event::EnableBracketedPaste);
    let result = ui_loop(&mut terminal, &mut app, &mut rx).await;
    let _ = crossterm::execute!(std::io::stdout(), crossterm::event::DisableBracketedPaste);
    ratatui::try_restore()?;
    result?;
    Ok(app.chat.as_ref().map(|c| c.root))
}

/// Standard error sent to a file until dropped (then back where it was).
struct Stderr {
    saved: Option<std::os::fd::OwnedFd>,
}

impl Stderr {
    /// Send fd 2 to `path` (appended); nothing changes when that fails.
    fn to_file(path: &Path) -> Stderr {
        use std::os::fd::{AsRawFd, FromRawFd};
        let opened = path
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .and_then(|_| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
            });
        let Ok(file) = opened else {
            return Stderr { saved: None };
        };
        // SAFETY: dup and dup2 on descriptors this process owns; the duplicate is owned
        // by the OwnedFd from then on.
        let saved = unsafe {
            let fd = libc::dup(2);
            if fd < 0 || libc::dup2(file.as_raw_fd(), 2) < 0 {
                if fd >= 0 {
                    libc::close(fd);
                }
                return Stderr { saved: None };
            }
            std::os::fd::OwnedFd::from_raw_fd(fd)
        };
        Stderr { saved: Some(saved) }
    }
}

impl Drop for Stderr {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        if let Some(fd) = &self.saved {
            // SAFETY: dup2 of a descriptor we own onto fd 2.
            unsafe {
                libc::dup2(fd.as_raw_fd(), 2);
            }
        }
    }
}

/// Where the embedded store is, for the status line.
fn client_data(client: &Client) -> String {
    client
        .reach()
        .trim()
        .trim_start_matches("--data")
        .trim()
        .to_string()
}

async fn ui_loop(
    terminal: &mut ratatui::DefaultTerminal,
    app: &mut App,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Msg>,
) -> anyhow::Result<()> {
    let mut keys = crossterm::event::EventStream::new();
    // Redraws now and then even when nothing arrives (a resize, a notice's age).
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        terminal.draw(|f| ui::draw(f, app))?;
        tokio::select! {
            key = keys.next() => match key {
                Some(Ok(ev)) => app.on_term(ev),
                Some(Err(e)) => return Err(e.into()),
                None => return Ok(()),
            },
            Some(msg) = rx.recv() => {
                app.on_msg(msg);
                while let Ok(msg) = rx.try_recv() {
                    app.on_msg(msg);
                }
                app.offer_approval();
            }
            _ = tick.tick() => {}
        }
        if app.quit {
            return Ok(());
        }
        if let Some((fork, label)) = app.open_request.take() {
            // The diff tool gets the terminal; the chat comes back after it.
            drop(keys);
            ratatui::try_restore()?;
            let opened =
                forkdir::open(&app.client, fork, None, &[label], Default::default(), false).await;
            // On stdout: standard error goes to the chat's log.
            if let Err(e) = opened {
                println!("{}", render::error_chain(&e));
            }
            println!("\npress Enter to go back to the chat");
            let _ = prompt::read_line().await;
            *terminal = ratatui::try_init()?;
            keys = crossterm::event::EventStream::new();
        }
    }
}

//! `forkfleet chat`: a terminal UI over a root run (docs/TERMINAL.md). The conversation
//! with one agent, forked mid-conversation into branch tabs that stream live, steered,
//! stopped, merged or resolved, after which the chat goes on from the winner.
//!
//! The binary parses the command line, loads the configuration and connects a
//! [`Client`] (embedded or to a cluster); this crate is the terminal from then on:
//! [`run`] until the person quits.
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

pub use app::ChatRun;
pub use settings::{path as settings_path, Settings};

use app::{App, Start};
use forkfleet_client::{forkdir, render, Client};
use forkfleet_shared::api::ForkView;
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::ids::RunId;
use futures::StreamExt;
use poll::Msg;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What a chat starts from.
pub struct Options {
    /// A fork spec whose settings the chat runs with (its goal and branches are not used).
    pub spec: Option<PathBuf>,
    /// The workspace the agent works in (absolute).
    pub workspace: PathBuf,
    /// The model, `provider:name` (default: the spec's).
    pub model: Option<String>,
    /// Prices of the models, for the cost chips.
    pub pricing: std::collections::BTreeMap<String, forkfleet_shared::pricing::Price>,
    /// Where the chat runs, for the status line (`cluster`, `embedded DIR`).
    pub reach: String,
    /// The `/fork-*` defaults ([`Settings::load`] of [`settings_path`]).
    pub settings: Settings,
    /// The chat to resume: its run and its fork as it is now.
    pub resume: Option<(ChatRun, ForkView)>,
}

/// Run the UI until the person quits; the chat's root run, if one was made.
pub async fn run(client: Client, opts: Options) -> anyhow::Result<Option<RunId>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = Start {
        spec: opts.spec,
        workspace: opts.workspace,
        model: opts.model,
        pricing: opts.pricing,
    };
    tokio::spawn(poll::watch_bus(client.clone(), tx.clone()));
    let mut app = App::new(client.clone(), tx, start, opts.reach, opts.settings);
    if let Some((mut chat, view)) = opts.resume {
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
pub struct Stderr {
    saved: Option<std::os::fd::OwnedFd>,
}

impl Stderr {
    /// Send fd 2 to `path` (appended); nothing changes when that fails.
    pub fn to_file(path: &Path) -> Stderr {
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
            let _ = forkfleet_client::prompt::read_line().await;
            *terminal = ratatui::try_init()?;
            keys = crossterm::event::EventStream::new();
        }
    }
}

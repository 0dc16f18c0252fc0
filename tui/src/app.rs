//! The chat's state and what each key and each report from the background does to it.
//! Nothing here waits on the network: an action is a task ([`poll::spawn`]) whose answer
//! comes back as a [`Msg`].

use super::poll::{self, ChatDuty, Msg};
use super::settings::{self, Settings};
use super::theme::Theme;

mod keys;
mod modal;

use crossterm::event::{Event as TermEvent, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use forkfleet_client::{forkdir, render, ApiClient, Client};
use forkfleet_shared::api::{AgentBranch, ForkView, LoggedEvent, ResolveReport};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::budget::ForkCost;
use forkfleet_shared::diff::{DiffOptions, DiffReport};
use forkfleet_shared::event::Event;
use forkfleet_shared::flush::ConflictPolicy;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::resolve::{Decision, Strategy};
use forkfleet_shared::spec::SOLO_LABEL;
use forkfleet_shared::state::BranchState;
pub use modal::{Asking, Confirmed, ForkForm, FormRow, Modal, Picker, FORM_COLUMNS};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use tokio::sync::mpsc::UnboundedSender;
use tokio::task::JoinHandle;

/// How the chat makes its fork: the spec and flags `forkfleet chat` was given.
pub struct Start {
    pub spec: Option<PathBuf>,
    pub workspace: PathBuf,
    pub model: Option<String>,
    pub pricing: BTreeMap<String, forkfleet_shared::pricing::Price>,
}

/// The chat's own fork: one agent, `main`, whose conversation the chat is.
#[derive(Debug, Clone)]
pub struct ChatRun {
    pub fork: ForkId,
    /// The root run (what `--resume` takes).
    pub root: RunId,
    pub main: RunId,
    pub policy: ConflictPolicy,
}

/// One run's transcript as the chat has it.
#[derive(Debug, Default)]
pub struct Pane {
    pub events: Vec<LoggedEvent>,
    /// Lines scrolled up from the bottom (0: follows the end).
    pub scroll: u16,
}

/// A fork made from the chat (or by its agent), shown as tabs.
pub struct ForkTabs {
    pub view: ForkView,
    pub cost: Option<ForkCost>,
    pub diff: Option<DiffReport>,
    /// The last resolve's report, kept so `/merge` shows its acceptance step again without
    /// asking the judges again.
    pub verdict: Option<ResolveReport>,
    pub resolving: bool,
    follower: JoinHandle<()>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Focus {
    Chat,
    Overview,
    Branch(usize),
}

/// The line under the panes: what just happened.
#[derive(Debug, Clone)]
pub struct Notice {
    pub text: String,
    pub bad: bool,
}

pub struct App {
    pub client: Client,
    pub tx: UnboundedSender<Msg>,
    pub theme: Theme,
    pub start: Start,
    /// Where the embedded store is, or the cluster (for the status line).
    pub reach: String,
    pub settings: Settings,
    pub chat: Option<ChatRun>,
    pub chat_view: Option<ForkView>,
    pub chat_cost: Option<ForkCost>,
    /// The first message while the chat's fork is being made.
    pub starting: Option<String>,
    pub panes: BTreeMap<RunId, Pane>,
    pub tabs: Option<ForkTabs>,
    pub focus: Focus,
    pub input: String,
    /// The cursor, in characters.
    pub cursor: usize,
    pub modal: Option<Modal>,
    pub notice: Option<Notice>,
    pub connection: Option<String>,
    /// The bus's connection is down (NATS reconnecting).
    pub bus_down: bool,
    pub unfold: bool,
    /// Requests for consent the person put aside (Esc), by call id.
    /// By [`Asking::key`].
    pub dismissed: BTreeSet<String>,
    /// Open the fork's branch in the diff tool (the UI loop leaves the screen for it).
    pub open_request: Option<(ForkId, String)>,
    pub quit: bool,
    chat_follower: Option<JoinHandle<()>>,
}

impl App {
    pub fn new(
        client: Client,
        tx: UnboundedSender<Msg>,
        start: Start,
        reach: String,
        settings: Settings,
    ) -> Self {
        Self {
            client,
            tx,
            theme: Theme::from_env(),
            start,
            reach,
            settings,
            chat: None,
            chat_view: None,
            chat_cost: None,
            starting: None,
            panes: BTreeMap::new(),
            tabs: None,
            focus: Focus::Chat,
            input: String::new(),
            cursor: 0,
            modal: None,
            notice: None,
            connection: None,
            bus_down: false,
            unfold: false,
            dismissed: BTreeSet::new(),
            open_request: None,
            quit: false,
            chat_follower: None,
        }
    }

    fn note(&mut self, text: impl Into<String>) {
        self.notice = Some(Notice {
            text: text.into(),
            bad: false,
        });
    }

    fn warn(&mut self, text: impl Into<String>) {
        self.notice = Some(Notice {
            text: text.into(),
            bad: true,
        });
    }

    fn settings_file(&self) -> PathBuf {
        settings::path(&self.start.workspace)
    }

    fn save_settings(&mut self) {
        if let Err(e) = self.settings.save(&self.settings_file()) {
            self.warn(format!("the chat's settings were not saved: {e}"));
        }
    }

    /// The agent of the chat, as its fork's view has it.
    pub fn main(&self) -> Option<&forkfleet_shared::api::BranchView> {
        self.chat_view.as_ref().and_then(|v| v.branch(SOLO_LABEL))
    }

    /// Follow the chat's fork (from `synced`, the version the directory holds).
    pub fn adopt_chat(&mut self, chat: ChatRun, synced: BlobHash) {
        if let Some(h) = self.chat_follower.take() {
            h.abort();
        }
        let duty = ChatDuty {
            dir: self.start.workspace.clone(),
            synced,
            policy: chat.policy,
            checked_at: 0,
        };
        self.chat_follower = Some(tokio::spawn(poll::follow(
            self.client.clone(),
            chat.fork,
            self.tx.clone(),
            Some(duty),
        )));
        self.chat = Some(chat);
    }

    /// Show fork `view` as tabs (the chat's `/fork`, or a fork the agent made).
    fn adopt_fork(&mut self, view: ForkView) {
        if let Some(t) = self.tabs.take() {
            t.follower.abort();
        }
        let follower = tokio::spawn(poll::follow(
            self.client.clone(),
            view.fork_id,
            self.tx.clone(),
            None,
        ));
        self.tabs = Some(ForkTabs {
            view,
            cost: None,
            diff: None,
            verdict: None,
            resolving: false,
            follower,
        });
        self.focus = Focus::Overview;
    }

    // ---- reports from the background --------------------------------------------------

    pub fn on_msg(&mut self, msg: Msg) {
        match msg {
            Msg::View { view, cost } => self.on_view(view, cost),
            Msg::Events { run, events } => {
                self.panes.entry(run).or_default().events.extend(events);
            }
            Msg::Diff { fork, report } => {
                if let Some(t) = self.tabs.as_mut().filter(|t| t.view.fork_id == fork) {
                    t.diff = Some(report);
                }
            }
            Msg::AgentForks(forks) => {
                if self.tabs.is_none() {
                    if let Some(f) = forks.into_iter().next() {
                        self.note(format!(
                            "the agent forked into {}: watch them here, merge with /merge",
                            f.branches.len()
                        ));
                        self.adopt_fork(f);
                    }
                }
            }
            Msg::Synced { version, report } => {
                if let Some(chat) = &self.chat {
                    self.settings
                        .synced
                        .insert(chat.root.to_string(), version.to_string());
                    self.save_settings();
                }
                // What just happened (a merge) stays in front.
                let before = self
                    .notice
                    .as_ref()
                    .filter(|n| !n.bad)
                    .map(|n| format!("{} · ", n.text))
                    .unwrap_or_default();
                if !report.conflicts.is_empty() {
                    let paths: Vec<String> =
                        report.conflicts.iter().map(|p| p.to_string()).collect();
                    self.warn(format!(
                        "workspace: {} changed here since the agent read them, kept as they are: {}",
                        render::count(paths.len(), "file", "files"),
                        paths.join(", ")
                    ));
                } else if !report.applied_paths.is_empty() {
                    self.note(format!(
                        "{before}workspace updated: {}",
                        render::count(report.applied_paths.len(), "path", "paths")
                    ));
                }
            }
            Msg::Connection(Ok(())) => self.connection = None,
            Msg::Bus(up) => self.bus_down = !up,
            Msg::Connection(Err(e)) => self.connection = Some(e),
            Msg::Started(view) => self.on_started(view),
            Msg::Forked(view) => {
                self.note(format!(
                    "forked into {}: Tab moves between them, Esc on a tab stops it",
                    render::count(view.branches.len(), "branch", "branches")
                ));
                self.adopt_fork(view);
            }
            Msg::Resolved(report) => self.on_resolved(report),
            Msg::Merged {
                fork,
                winner,
                applied,
            } => {
                self.note(format!(
                    "merged `{winner}` into the chat ({}): the conversation goes on from it",
                    render::count(applied, "path", "paths")
                ));
                if self.tabs.as_ref().is_some_and(|t| t.view.fork_id == fork) {
                    self.close_tabs();
                }
            }
            Msg::DiffText(lines) => {
                let back = self.modal.take().map(Box::new);
                self.modal = Some(Modal::Diff {
                    lines,
                    scroll: 0,
                    back,
                });
            }
            Msg::Note(text) => self.note(text),
            Msg::Failed(text) => {
                if let Some(first) = self.starting.take() {
                    // Nothing is lost: the first message comes back to the input.
                    if self.input.is_empty() {
                        self.set_input(first);
                    }
                }
                if let Some(t) = self.tabs.as_mut() {
                    t.resolving = false;
                }
                self.warn(text);
            }
        }
    }

    fn on_view(&mut self, view: ForkView, cost: Option<ForkCost>) {
        if self.chat.as_ref().is_some_and(|c| c.fork == view.fork_id) {
            self.chat_view = Some(view);
            self.chat_cost = cost;
            return;
        }
        let Some(t) = self
            .tabs
            .as_mut()
            .filter(|t| t.view.fork_id == view.fork_id)
        else {
            return;
        };
        let resolved = view.state.is_resolved();
        let state = view.state.clone();
        t.view = view;
        if cost.is_some() {
            t.cost = cost;
        }
        if resolved {
            match state {
                forkfleet_shared::state::ForkState::Merged { winner } => {
                    self.note(format!("branch `{winner}` was merged into the chat"))
                }
                _ => self.note("the fork was aborted: its branches' work stays in the store (forkfleet fork show)"),
            }
            self.close_tabs();
        }
    }

    fn close_tabs(&mut self) {
        if let Some(t) = self.tabs.take() {
            t.follower.abort();
        }
        if matches!(self.modal, Some(Modal::Picker(_) | Modal::Accept { .. })) {
            self.modal = None;
        }
        self.focus = Focus::Chat;
    }

    fn on_started(&mut self, view: ForkView) {
        self.starting = None;
        let Some(main) = view.branch(SOLO_LABEL) else {
            self.warn("the chat's fork has no agent");
            return;
        };
        let chat = ChatRun {
            fork: view.fork_id,
            root: view.parent_run,
            main: main.run_id,
            policy: self.spec_policy(),
        };
        self.note(format!(
            "chat started (run {}): resume it later with forkfleet chat --resume {}",
            chat.root, chat.root
        ));
        let synced = view.snapshot;
        self.chat_view = Some(view);
        self.adopt_chat(chat, synced);
    }

    /// The conflict policy of the chat's spec (the default without one).
    pub fn spec_policy(&self) -> ConflictPolicy {
        self.load_spec(String::from("-"))
            .map(|l| l.plan.conflict_policy)
            .unwrap_or_default()
    }

    fn load_spec(&self, goal: String) -> anyhow::Result<forkfleet_shared::spec::LoadedSpec> {
        use toml::Value as V;
        let mut over = toml::Table::new();
        over.insert("goal".into(), V::String(goal));
        over.insert(
            "workspace".into(),
            V::String(self.start.workspace.display().to_string()),
        );
        if let Some(m) = &self.start.model {
            over.insert("model".into(), V::String(m.clone()));
        }
        // The chat is one agent: `/fork` makes the branches.
        over.insert("branches".into(), V::Array(Vec::new()));
        // Every model the spec configures is offered to `/fork`'s rows, used or not yet.
        if let Some(path) = &self.start.spec {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--spec {}: {e}", path.display()))?;
            let table: toml::Table = toml::from_str(&text).map_err(|e| {
                anyhow::anyhow!("--spec {}: {}", path.display(), e.to_string().trim())
            })?;
            if let Some(V::Table(models)) = table.get("models") {
                let mut models = models.clone();
                for (_, m) in models.iter_mut() {
                    if let V::Table(m) = m {
                        m.insert("spare".into(), V::Boolean(true));
                    }
                }
                over.insert("models".into(), V::Table(models));
            }
        }
        Ok(forkfleet_shared::spec::load_overridden(
            self.start.spec.as_deref(),
            over,
            &self.start.pricing,
        )?)
    }

    fn on_resolved(&mut self, report: ResolveReport) {
        let Some(t) = self.tabs.as_mut() else {
            return;
        };
        t.resolving = false;
        t.verdict = Some(report.clone());
        self.show_verdict(&report);
    }

    /// After a resolve (or `/merge` with one kept): the acceptance step, a merge, or the
    /// picker with the judges' suggestion.
    fn show_verdict(&mut self, report: &ResolveReport) {
        let reasoning = report
            .judges
            .iter()
            .find_map(|j| j.run.verdict.as_ref().map(|v| v.reasoning.clone()))
            .unwrap_or_default();
        match &report.decision {
            Decision::Commit { winner, confidence } => {
                if matches!(report.strategy, Strategy::AutoWithFallback { .. }) {
                    self.modal = Some(Modal::Accept {
                        winner: winner.clone(),
                        confidence: *confidence,
                        reasoning,
                    });
                } else {
                    self.merge(winner.clone());
                }
            }
            Decision::Defer { pick, confidence } => self.open_picker(
                Some(pick.as_str()),
                Some(format!(
                    "the judges suggest `{pick}` at {confidence:.2}, below the threshold: pick one"
                )),
            ),
            Decision::Manual => self.open_picker(
                None,
                Some("the judges gave no verdict: pick a branch".into()),
            ),
        }
    }

    fn open_picker(&mut self, preselect: Option<&str>, subtitle: Option<String>) {
        let Some(t) = &self.tabs else {
            self.warn("no fork to merge: /fork first");
            return;
        };
        let selected = preselect
            .and_then(|p| t.view.branches.iter().position(|b| b.label == p))
            .or_else(|| {
                t.view
                    .branches
                    .iter()
                    .position(|b| b.state == BranchState::Done)
            })
            .unwrap_or(0);
        self.modal = Some(Modal::Picker(Picker { selected, subtitle }));
    }
}

/// The label `/fork` prefills for row `n` (1-based): a, b, c, ...
pub fn slot_label(n: usize) -> String {
    let letters = "abcdefghijklmnopqrstuvwxyz";
    letters
        .chars()
        .nth((n.max(1) - 1) % letters.len())
        .map(String::from)
        .unwrap_or_else(|| format!("b{n}"))
}

/// Events shown in a branch's tab: from its own start (its steer), not the copied
/// conversation before it.
pub fn own_events(events: &[LoggedEvent]) -> &[LoggedEvent] {
    let start = events
        .iter()
        .position(|e| matches!(e.event, Event::Steer { .. }))
        .unwrap_or(0);
    &events[start..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_lettered_and_a_branch_tab_starts_at_its_steer() {
        assert_eq!(slot_label(1), "a");
        assert_eq!(slot_label(3), "c");
        let events = vec![
            LoggedEvent {
                seq: 0,
                event: Event::UserMessage {
                    text: "copied".into(),
                },
            },
            LoggedEvent {
                seq: 1,
                event: Event::Steer {
                    text: "mine".into(),
                },
            },
        ];
        assert_eq!(own_events(&events).len(), 1);
        assert_eq!(own_events(&events[..1]).len(), 1, "no steer: everything");
    }
}

//! The chat's state and what each key and each report from the background does to it.
//! Nothing here waits on the network: an action is a task ([`poll::spawn`]) whose answer
//! comes back as a [`Msg`].

use super::poll::{self, ChatDuty, Msg};
use super::settings::{self, Settings};
use super::theme::Theme;
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

/// What a confirmation does when answered yes.
#[derive(Debug, Clone)]
pub enum Confirmed {
    Terminate { fork: ForkId, label: String },
    Abort { fork: ForkId },
}

/// One row of the `/fork` form.
#[derive(Debug, Clone, Default)]
pub struct FormRow {
    pub label: String,
    pub steer: String,
    pub model: String,
    pub budget: String,
}

/// The `/fork` form: a row per branch, then the fork's cap. `field` counts the text
/// fields in reading order (four per row, then the cap).
#[derive(Debug, Clone)]
pub struct ForkForm {
    pub rows: Vec<FormRow>,
    pub aggregate: String,
    pub field: usize,
    /// The chat's model, shown where a row names none.
    pub default_model: String,
    pub error: Option<String>,
}

pub const FORM_COLUMNS: usize = 4;

impl ForkForm {
    fn fields(&self) -> usize {
        self.rows.len() * FORM_COLUMNS + 1
    }

    pub fn current(&mut self) -> &mut String {
        let (row, col) = (self.field / FORM_COLUMNS, self.field % FORM_COLUMNS);
        match self.rows.get_mut(row) {
            Some(r) => match col {
                0 => &mut r.label,
                1 => &mut r.steer,
                2 => &mut r.model,
                _ => &mut r.budget,
            },
            None => &mut self.aggregate,
        }
    }

    /// The branches and cap the form asks for, or what is wrong.
    fn branches(&self) -> Result<(Vec<AgentBranch>, Option<f64>), String> {
        let mut out = Vec::new();
        for (i, r) in self.rows.iter().enumerate() {
            let n = i + 1;
            if r.label.trim().is_empty() {
                return Err(format!("row {n}: give the branch a label"));
            }
            if r.steer.trim().is_empty() {
                return Err(format!(
                    "row {n} (`{}`): give it a steer, what this branch should try",
                    r.label.trim()
                ));
            }
            let budget_usd = match r.budget.trim() {
                "" => None,
                b => Some(crate::cli::parse_usd(b).map_err(|e| format!("row {n} budget: {e}"))?),
            };
            out.push(AgentBranch {
                label: r.label.trim().to_string(),
                steer: r.steer.trim().to_string(),
                model: Some(r.model.trim().to_string()).filter(|m| !m.is_empty()),
                budget_usd,
                extra_instructions: None,
            });
        }
        let aggregate = match self.aggregate.trim() {
            "" => None,
            a => Some(crate::cli::parse_usd(a).map_err(|e| format!("aggregate budget: {e}"))?),
        };
        Ok((out, aggregate))
    }
}

/// The merge picker: each branch with its answer and diff; Enter merges the selected one.
#[derive(Debug, Clone)]
pub struct Picker {
    pub selected: usize,
    /// Why the picker opened (the judges' suggestion, an override).
    pub subtitle: Option<String>,
}

#[derive(Debug, Clone)]
pub enum Modal {
    Help,
    Confirm {
        question: String,
        action: Confirmed,
    },
    Form(ForkForm),
    Picker(Picker),
    /// The acceptance step of `auto_with_fallback`: the judges' pick, before any merge.
    Accept {
        winner: String,
        confidence: f64,
        reasoning: String,
    },
    /// A request for consent of the focused branch; `reason` is being typed after `n`.
    Approval {
        fork: ForkId,
        label: String,
        call_id: String,
        what: String,
        rule: String,
        reason: Option<String>,
    },
    /// A diff, scrolled; Esc goes back to `back`.
    Diff {
        lines: Vec<String>,
        scroll: u16,
        back: Option<Box<Modal>>,
    },
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
    pub unfold: bool,
    /// Requests for consent the person put aside (Esc), by call id.
    /// By [`asked`]: call ids repeat across runs.
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

    // ---- keys ---------------------------------------------------------------------------

    pub fn on_term(&mut self, ev: TermEvent) {
        match ev {
            TermEvent::Key(k) if k.kind != KeyEventKind::Release => self.on_key(k),
            TermEvent::Paste(text) => {
                let text = text.replace(['\r', '\n'], " ");
                match self.modal.as_mut() {
                    Some(Modal::Form(f)) => f.current().push_str(&text),
                    _ => self.insert(&text),
                }
            }
            _ => {}
        }
    }

    fn on_key(&mut self, k: KeyEvent) {
        let ctrl = k.modifiers.contains(KeyModifiers::CONTROL);
        if ctrl && matches!(k.code, KeyCode::Char('c') | KeyCode::Char('q')) {
            self.quit = true;
            return;
        }
        if self.modal.is_some() {
            self.on_modal_key(k);
            return;
        }
        let alt = k.modifiers.contains(KeyModifiers::ALT);
        match k.code {
            KeyCode::Tab => self.cycle(1),
            KeyCode::BackTab => self.cycle(-1),
            KeyCode::Char(c @ '0'..='9') if alt || self.input.is_empty() => self.focus_number(c),
            KeyCode::Char('?') if self.input.is_empty() => self.modal = Some(Modal::Help),
            KeyCode::F(1) => self.modal = Some(Modal::Help),
            KeyCode::Char('o') if ctrl => self.unfold = !self.unfold,
            KeyCode::Char('u') if ctrl => self.set_input(String::new()),
            KeyCode::Char('w') if ctrl => self.delete_word(),
            KeyCode::Char(c) if !ctrl && !alt => self.insert(&c.to_string()),
            KeyCode::Backspace => self.backspace(),
            KeyCode::Delete => {
                let at = self.byte_at(self.cursor);
                if at < self.input.len() {
                    self.input.remove(at);
                }
            }
            KeyCode::Left => self.cursor = self.cursor.saturating_sub(1),
            KeyCode::Right => self.cursor = (self.cursor + 1).min(self.input.chars().count()),
            KeyCode::Home => self.cursor = 0,
            KeyCode::End => self.cursor = self.input.chars().count(),
            KeyCode::PageUp | KeyCode::Up => {
                self.scroll(if k.code == KeyCode::Up { 1 } else { 10 })
            }
            KeyCode::PageDown | KeyCode::Down => {
                self.scroll(if k.code == KeyCode::Down { -1 } else { -10 })
            }
            KeyCode::Esc => self.on_esc(),
            KeyCode::Enter => self.submit(),
            _ => {}
        }
        self.offer_approval();
    }

    /// The focused run (the chat's agent or a branch): its fork, label and view.
    pub fn focused(&self) -> Option<(ForkId, &forkfleet_shared::api::BranchView)> {
        match self.focus {
            Focus::Chat => Some((self.chat.as_ref()?.fork, self.main()?)),
            Focus::Overview => None,
            Focus::Branch(i) => {
                let t = self.tabs.as_ref()?;
                Some((t.view.fork_id, t.view.branches.get(i)?))
            }
        }
    }

    /// Open the request for consent of the focused run, unless put aside.
    pub fn offer_approval(&mut self) {
        if self.modal.is_some() {
            return;
        }
        let Some((fork, b)) = self.focused() else {
            return;
        };
        let Some(p) = b
            .approval
            .as_ref()
            .filter(|_| b.state == BranchState::AwaitingApproval)
        else {
            return;
        };
        if self.dismissed.contains(&asked(fork, &b.label, &p.call_id)) {
            return;
        }
        self.modal = Some(Modal::Approval {
            fork,
            label: b.label.clone(),
            call_id: p.call_id.clone(),
            what: format!(
                "{} {}",
                p.tool,
                render::one_line(&render::args_line(&p.args), 200)
            ),
            rule: p.rule.clone(),
            reason: None,
        });
    }

    fn tab_count(&self) -> usize {
        self.tabs.as_ref().map_or(0, |t| t.view.branches.len())
    }

    fn cycle(&mut self, step: i32) {
        let n = self.tab_count();
        if n == 0 {
            self.focus = Focus::Chat;
            return;
        }
        // chat, overview, branch 0..n
        let order = n + 2;
        let at = match self.focus {
            Focus::Chat => 0,
            Focus::Overview => 1,
            Focus::Branch(i) => i + 2,
        } as i32;
        let next = (at + step).rem_euclid(order as i32) as usize;
        self.focus = match next {
            0 => Focus::Chat,
            1 => Focus::Overview,
            i => Focus::Branch(i - 2),
        };
    }

    fn focus_number(&mut self, c: char) {
        let n = c.to_digit(10).unwrap_or(0) as usize;
        let tabs = self.tab_count();
        if tabs == 0 {
            self.note("no fork yet: /fork makes one");
            return;
        }
        self.focus = match n {
            0 => Focus::Overview,
            n if n <= tabs => Focus::Branch(n - 1),
            _ => {
                self.warn(format!("no branch {n}: this fork has {tabs}"));
                return;
            }
        };
    }

    fn pane_mut(&mut self) -> Option<&mut Pane> {
        let run = self.focused().map(|(_, b)| b.run_id)?;
        self.panes.get_mut(&run)
    }

    fn scroll(&mut self, by: i32) {
        if let Some(p) = self.pane_mut() {
            p.scroll = (p.scroll as i32 + by).clamp(0, u16::MAX as i32) as u16;
        }
    }

    fn byte_at(&self, chars: usize) -> usize {
        self.input
            .char_indices()
            .nth(chars)
            .map_or(self.input.len(), |(i, _)| i)
    }

    fn insert(&mut self, s: &str) {
        let at = self.byte_at(self.cursor);
        self.input.insert_str(at, s);
        self.cursor += s.chars().count();
    }

    fn backspace(&mut self) {
        if self.cursor > 0 {
            self.cursor -= 1;
            let at = self.byte_at(self.cursor);
            self.input.remove(at);
        }
    }

    fn delete_word(&mut self) {
        let before: String = self.input.chars().take(self.cursor).collect();
        let kept = before
            .trim_end()
            .rsplit_once(' ')
            .map_or("", |(a, _)| a)
            .to_string();
        let rest: String = self.input.chars().skip(self.cursor).collect();
        self.cursor = kept.chars().count() + usize::from(!kept.is_empty());
        self.input = if kept.is_empty() {
            rest
        } else {
            format!("{kept} {rest}")
        };
    }

    fn set_input(&mut self, s: String) {
        self.cursor = s.chars().count();
        self.input = s;
    }

    fn on_esc(&mut self) {
        match self.focus {
            Focus::Chat => {
                let running = self
                    .main()
                    .filter(|m| !m.state.is_stopped())
                    .map(|m| m.label.clone());
                match (self.chat.as_ref(), running) {
                    (Some(chat), Some(label)) => {
                        self.modal = Some(Modal::Confirm {
                            question:
                                "stop the agent's turn? (its work so far stays; type to go on)"
                                    .into(),
                            action: Confirmed::Terminate {
                                fork: chat.fork,
                                label,
                            },
                        })
                    }
                    _ => self
                        .note("nothing runs in the chat (Ctrl-C quits; the chat can be resumed)"),
                }
            }
            Focus::Overview => {
                if let Some(t) = &self.tabs {
                    self.modal = Some(Modal::Confirm {
                        question: format!(
                            "abort the entire fork ({})? finished work stays in the store",
                            render::count(t.view.branches.len(), "branch", "branches")
                        ),
                        action: Confirmed::Abort {
                            fork: t.view.fork_id,
                        },
                    });
                }
            }
            Focus::Branch(i) => {
                if let Some(t) = &self.tabs {
                    if let Some(b) = t.view.branches.get(i) {
                        if b.state.is_terminal() {
                            self.note(format!("`{}` has already finished ({})", b.label, b.state));
                        } else {
                            self.modal = Some(Modal::Confirm {
                                question: format!(
                                    "terminate `{}`? the other branches keep running, and its work stays mergeable",
                                    b.label
                                ),
                                action: Confirmed::Terminate {
                                    fork: t.view.fork_id,
                                    label: b.label.clone(),
                                },
                            });
                        }
                    }
                }
            }
        }
    }

    // ---- what Enter sends -----------------------------------------------------------------

    fn submit(&mut self) {
        let text = self.input.trim().to_string();
        if text.is_empty() {
            // Enter on a run waiting for consent asks again.
            if let Some((fork, b)) = self.focused() {
                if let Some(p) = &b.approval {
                    let key = asked(fork, &b.label, &p.call_id);
                    self.dismissed.remove(&key);
                }
            }
            return;
        }
        self.set_input(String::new());
        if let Some(cmd) = text.strip_prefix('/') {
            self.command(cmd, &text);
            return;
        }
        if let Some(rest) = text.strip_prefix(">>") {
            let (label, msg) = rest.split_once(' ').unwrap_or((rest, ""));
            self.steer_label(label.trim(), msg.trim(), &text);
            return;
        }
        self.send_message(text);
    }

    /// A plain message: to the focused run, as a steer while it runs, as a new turn after.
    fn send_message(&mut self, text: String) {
        match self.focus {
            Focus::Overview => {
                self.warn(
                    "focus a branch (Tab, or its number) to talk to it; /merge picks the winner",
                );
                self.set_input(text);
            }
            Focus::Chat => {
                if self.tabs.is_some() {
                    self.warn("a fork is open: /merge or /resolve it, or Esc on the overview to abort it, before the chat goes on");
                    self.set_input(text);
                    return;
                }
                if self.chat.is_none() {
                    self.start_chat(text);
                    return;
                }
                let (Some(chat), Some(main)) = (self.chat.clone(), self.main().cloned()) else {
                    self.warn("the chat's agent is not known yet: try again in a moment");
                    self.set_input(text);
                    return;
                };
                self.talk(chat.fork, main.label, main.state, text);
            }
            Focus::Branch(i) => {
                let Some(t) = &self.tabs else { return };
                let Some(b) = t.view.branches.get(i) else {
                    return;
                };
                let (fork, label, state) = (t.view.fork_id, b.label.clone(), b.state);
                self.talk(fork, label, state, text);
            }
        }
    }

    /// Steer a run that runs, continue one that finished.
    fn talk(&mut self, fork: ForkId, label: String, state: BranchState, text: String) {
        let client = self.client.clone();
        if state.is_terminal() {
            poll::spawn(&self.tx, "the follow-up", async move {
                client.continue_branch(fork, label.clone(), text).await?;
                Ok(Msg::Note(format!("`{label}` goes on with your message")))
            });
        } else if matches!(state, BranchState::Paused) {
            self.warn(format!(
                "`{label}` is paused by a budget cap: raise it with forkfleet fork topup {fork} --branch {label} --usd N{}",
                self.reach
            ));
            self.set_input(text);
        } else {
            poll::spawn(&self.tx, "the steer", async move {
                client.steer(fork, label.clone(), text).await?;
                Ok(Msg::Note(format!(
                    "steered `{label}`: it reads it before its next model call"
                )))
            });
        }
    }

    fn steer_label(&mut self, label: &str, msg: &str, typed: &str) {
        let Some(t) = &self.tabs else {
            self.warn(">>LABEL steers a branch of an open fork; there is none");
            self.set_input(typed.to_string());
            return;
        };
        let Some(b) = t.view.branch(label) else {
            let labels: Vec<&str> = t.view.branches.iter().map(|b| b.label.as_str()).collect();
            self.warn(format!(
                "no branch `{label}`: the branches are {}",
                labels.join(", ")
            ));
            self.set_input(typed.to_string());
            return;
        };
        if msg.is_empty() {
            self.warn(format!("usage: >>{label} MESSAGE"));
            self.set_input(typed.to_string());
            return;
        }
        let (fork, state) = (t.view.fork_id, b.state);
        self.talk(fork, label.to_string(), state, msg.to_string());
    }

    fn start_chat(&mut self, text: String) {
        if self.starting.is_some() {
            self.warn("the chat is starting: wait for it");
            self.set_input(text);
            return;
        }
        let loaded = match self.load_spec(text.clone()) {
            Ok(l) => l,
            Err(e) => {
                self.warn(render::error_chain(&*e));
                self.set_input(text);
                return;
            }
        };
        self.starting = Some(text);
        self.note("starting the chat: uploading the workspace…");
        let client = self.client.clone();
        poll::spawn(&self.tx, "starting the chat", async move {
            let (view, _) = forkfleet_client::run::create_fork(&client, &loaded, None).await?;
            Ok(Msg::Started(view))
        });
    }

    fn command(&mut self, cmd: &str, typed: &str) {
        let mut words = cmd.split_whitespace();
        let name = words.next().unwrap_or_default();
        let args: Vec<&str> = words.collect();
        match name {
            "help" => self.modal = Some(Modal::Help),
            "quit" | "exit" => self.quit = true,
            "fork" => self.open_form(),
            "fork-branches" | "fork-model" | "fork-budget" => {
                if self.tabs.is_some() && !args.is_empty() {
                    self.warn("the fork settings are for the next fork: change them once this one is merged or aborted");
                    return;
                }
                match self.settings.command(name, &args) {
                    Ok(text) => {
                        self.save_settings();
                        if self.notice.as_ref().is_none_or(|n| !n.bad) {
                            self.note(text);
                        }
                    }
                    Err(e) => {
                        self.warn(e);
                        self.set_input(typed.to_string());
                    }
                }
            }
            "merge" => match self.tabs.as_ref().and_then(|t| t.verdict.clone()) {
                Some(r) if matches!(r.decision, Decision::Commit { .. }) => self.show_verdict(&r),
                _ => self.open_picker(None, None),
            },
            "resolve" => self.resolve(),
            "diff" => self.request_diff(None),
            "abort" => {
                self.focus = Focus::Overview;
                self.on_esc();
            }
            "cost" => {
                let chat = self.chat_cost.as_ref().map(|c| c.spent_usd).unwrap_or(0.0);
                let fork = self
                    .tabs
                    .as_ref()
                    .and_then(|t| t.cost.as_ref())
                    .map(|c| c.spent_usd);
                self.note(format!(
                    "the chat's agent spent ${chat:.4}{}",
                    fork.map(|f| format!(" · the open fork ${f:.4}"))
                        .unwrap_or_default()
                ));
            }
            other => {
                self.warn(format!(
                    "/{other} is not a command: /fork /fork-branches /fork-model /fork-budget /merge /resolve /diff /abort /cost /help /quit"
                ));
                self.set_input(typed.to_string());
            }
        }
    }

    fn open_form(&mut self) {
        if self.tabs.is_some() {
            self.warn("a fork is open already: resolve it first (/merge, /resolve, or Esc on the overview)");
            return;
        }
        let Some(main) = self.main() else {
            self.warn("say something first: a fork starts from the conversation so far");
            return;
        };
        if !main.state.is_terminal() {
            self.warn(format!(
                "the agent is {}: wait for its answer (or Esc to stop it), then /fork",
                main.state
            ));
            return;
        }
        let default_model = self
            .load_spec("-".into())
            .map(|l| l.plan.model.clone())
            .unwrap_or_default();
        let rows = (1..=self.settings.fork_branches)
            .map(|n| FormRow {
                label: slot_label(n),
                steer: String::new(),
                model: self.settings.model_of(n).unwrap_or_default().to_string(),
                budget: self
                    .settings
                    .fork_budget_usd
                    .map(|b| b.to_string())
                    .unwrap_or_default(),
            })
            .collect();
        self.modal = Some(Modal::Form(ForkForm {
            rows,
            aggregate: self
                .settings
                .fork_aggregate_usd
                .map(|b| b.to_string())
                .unwrap_or_default(),
            // The first steer: labels come prefilled.
            field: 1,
            default_model,
            error: None,
        }));
    }

    fn submit_form(&mut self, form: ForkForm) {
        let (branches, aggregate) = match form.branches() {
            Ok(b) => b,
            Err(e) => {
                self.modal = Some(Modal::Form(ForkForm {
                    error: Some(e),
                    ..form
                }));
                return;
            }
        };
        let (Some(chat), Some(main)) = (self.chat.clone(), self.main().cloned()) else {
            return;
        };
        let client = self.client.clone();
        self.note(format!(
            "forking into {}…",
            render::count(branches.len(), "branch", "branches")
        ));
        poll::spawn(&self.tx, "the fork", async move {
            let snapshot = client.run_workspace(main.run_id).await?;
            let cutoff = main.events.saturating_sub(1);
            let view = client
                .agent_fork(
                    chat.main,
                    cutoff,
                    snapshot,
                    branches,
                    None::<Strategy>,
                    aggregate,
                )
                .await?;
            Ok(Msg::Forked(view))
        });
    }

    fn resolve(&mut self) {
        let Some(t) = self.tabs.as_mut() else {
            self.warn("no fork to resolve: /fork first");
            return;
        };
        if !t.view.settled() {
            self.warn("some branches still run: wait for them (or Esc on a tab to stop one), then /resolve");
            return;
        }
        if t.resolving {
            self.note("the resolve is running");
            return;
        }
        t.resolving = true;
        let fork = t.view.fork_id;
        let client = self.client.clone();
        self.note("resolving: tests on every branch, then the judges…");
        poll::spawn(&self.tx, "the resolve", async move {
            // Nothing merges before the person has seen the decision.
            let report = client
                .resolve(fork, None::<Strategy>, true, Vec::<String>::new())
                .await?;
            Ok(Msg::Resolved(report))
        });
    }

    fn merge(&mut self, pick: String) {
        let Some(t) = &self.tabs else { return };
        let fork = t.view.fork_id;
        let client = self.client.clone();
        self.modal = None;
        self.note(format!("merging `{pick}`…"));
        poll::spawn(&self.tx, "the merge", async move {
            let outcome = client.merge(fork, pick).await?;
            forkdir::cleanup_after_merge(&client, fork).await;
            Ok(Msg::Merged {
                fork,
                winner: outcome.winner,
                applied: outcome.report.applied_paths.len(),
            })
        });
    }

    /// Ask for the fork's diff (one branch's, or every one's) to show in a modal.
    fn request_diff(&mut self, label: Option<String>) {
        let Some(t) = &self.tabs else {
            self.warn("no fork to diff: /fork first");
            return;
        };
        let fork = t.view.fork_id;
        let client = self.client.clone();
        poll::spawn(&self.tx, "the diff", async move {
            let mut report = client
                .diff(
                    fork,
                    DiffOptions {
                        unified: true,
                        ..DiffOptions::default()
                    },
                )
                .await?;
            if let Some(label) = &label {
                if let Some(i) = report.branch_index(label) {
                    report.paths.retain(|p| p.change(i).is_some());
                    for p in &mut report.paths {
                        p.changes.retain(|c| c.branch == i);
                    }
                }
            }
            let text = render::diff_text(&report, true);
            let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
            if let Some(label) = label {
                lines.insert(0, format!("branch `{label}`"));
            }
            Ok(Msg::DiffText(lines))
        });
    }

    // ---- modals ---------------------------------------------------------------------------

    fn on_modal_key(&mut self, k: KeyEvent) {
        let Some(modal) = self.modal.take() else {
            return;
        };
        match modal {
            Modal::Help => {}
            Modal::Confirm { question, action } => match k.code {
                KeyCode::Char('y') | KeyCode::Char('Y') => self.confirmed(action),
                KeyCode::Char('n') | KeyCode::Char('N') | KeyCode::Esc | KeyCode::Enter => {
                    self.note("nothing stopped")
                }
                _ => self.modal = Some(Modal::Confirm { question, action }),
            },
            Modal::Form(form) => self.form_key(form, k),
            Modal::Picker(p) => self.picker_key(p, k),
            Modal::Accept {
                winner,
                confidence,
                reasoning,
            } => match k.code {
                KeyCode::Enter => self.merge(winner),
                KeyCode::Char('d') => {
                    self.modal = Some(Modal::Accept {
                        winner: winner.clone(),
                        confidence,
                        reasoning,
                    });
                    self.request_diff(Some(winner));
                }
                KeyCode::Char('o') => self.open_picker(
                    Some(winner.as_str()),
                    Some(format!(
                        "override: the judges picked `{winner}` ({confidence:.2}); {reasoning}"
                    )),
                ),
                KeyCode::Esc => self.note("nothing merged: /merge shows the judges' pick again"),
                _ => {
                    self.modal = Some(Modal::Accept {
                        winner,
                        confidence,
                        reasoning,
                    })
                }
            },
            Modal::Approval {
                fork,
                label,
                call_id,
                what,
                rule,
                reason,
            } => self.approval_key(k, fork, label, call_id, what, rule, reason),
            Modal::Diff {
                lines,
                scroll,
                back,
            } => match k.code {
                KeyCode::Esc | KeyCode::Char('q') => self.modal = back.map(|b| *b),
                KeyCode::Down | KeyCode::Char('j') => {
                    self.modal = Some(Modal::Diff {
                        lines,
                        scroll: scroll.saturating_add(1),
                        back,
                    })
                }
                KeyCode::Up | KeyCode::Char('k') => {
                    self.modal = Some(Modal::Diff {
                        lines,
                        scroll: scroll.saturating_sub(1),
                        back,
                    })
                }
                KeyCode::PageDown | KeyCode::Char(' ') => {
                    self.modal = Some(Modal::Diff {
                        lines,
                        scroll: scroll.saturating_add(15),
                        back,
                    })
                }
                KeyCode::PageUp => {
                    self.modal = Some(Modal::Diff {
                        lines,
                        scroll: scroll.saturating_sub(15),
                        back,
                    })
                }
                _ => {
                    self.modal = Some(Modal::Diff {
                        lines,
                        scroll,
                        back,
                    })
                }
            },
        }
    }

    fn confirmed(&mut self, action: Confirmed) {
        let client = self.client.clone();
        match action {
            Confirmed::Terminate { fork, label } => {
                poll::spawn(&self.tx, "the terminate", async move {
                    client.terminate(fork, label.clone()).await?;
                    Ok(Msg::Note(format!(
                        "`{label}` stopped: its work so far stays mergeable"
                    )))
                })
            }
            Confirmed::Abort { fork } => poll::spawn(&self.tx, "the abort", async move {
                client.abort(fork).await?;
                Ok(Msg::Note("fork aborted".into()))
            }),
        }
    }

    fn form_key(&mut self, mut form: ForkForm, k: KeyEvent) {
        match k.code {
            KeyCode::Esc => {
                self.note("no fork made");
                return;
            }
            KeyCode::Enter => {
                self.submit_form(form);
                return;
            }
            KeyCode::Tab | KeyCode::Down => form.field = (form.field + 1) % form.fields(),
            KeyCode::BackTab | KeyCode::Up => {
                form.field = (form.field + form.fields() - 1) % form.fields()
            }
            KeyCode::Backspace => {
                form.current().pop();
            }
            KeyCode::Char('u') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                form.current().clear()
            }
            KeyCode::Char(c) => form.current().push(c),
            _ => {}
        }
        self.modal = Some(Modal::Form(form));
    }

    fn picker_key(&mut self, mut p: Picker, k: KeyEvent) {
        let Some(t) = &self.tabs else { return };
        let n = t.view.branches.len().max(1);
        let label = t
            .view
            .branches
            .get(p.selected)
            .map(|b| (b.label.clone(), b.state));
        match k.code {
            KeyCode::Esc => {
                self.note("nothing merged");
                return;
            }
            KeyCode::Down | KeyCode::Char('j') | KeyCode::Tab => p.selected = (p.selected + 1) % n,
            KeyCode::Up | KeyCode::Char('k') | KeyCode::BackTab => {
                p.selected = (p.selected + n - 1) % n
            }
            KeyCode::Char(c @ '1'..='9') => {
                let i = c.to_digit(10).unwrap_or(1) as usize - 1;
                if i < n {
                    p.selected = i;
                }
            }
            KeyCode::Enter => match label {
                Some((label, state)) if state.is_terminal() => {
                    self.merge(label);
                    return;
                }
                Some((label, state)) => {
                    p.subtitle = Some(format!(
                        "`{label}` is {state}: only a finished branch merges (Esc on its tab stops it, and its work stays)"
                    ));
                }
                None => {}
            },
            KeyCode::Char('d') => {
                if let Some((label, _)) = label {
                    self.modal = Some(Modal::Picker(p));
                    self.request_diff(Some(label));
                    return;
                }
            }
            KeyCode::Char('o') => {
                if let Some((label, _)) = label {
                    self.open_request = Some((t.view.fork_id, label));
                }
            }
            _ => {}
        }
        self.modal = Some(Modal::Picker(p));
    }

    #[allow(clippy::too_many_arguments)]
    fn approval_key(
        &mut self,
        k: KeyEvent,
        fork: ForkId,
        label: String,
        call_id: String,
        what: String,
        rule: String,
        reason: Option<String>,
    ) {
        let keep = |reason| Modal::Approval {
            fork,
            label: label.clone(),
            call_id: call_id.clone(),
            what: what.clone(),
            rule: rule.clone(),
            reason,
        };
        match (reason, k.code) {
            (None, KeyCode::Char('y') | KeyCode::Char('a')) => {
                self.decide(fork, label, call_id, true, None)
            }
            (None, KeyCode::Char('n') | KeyCode::Char('d')) => {
                self.modal = Some(keep(Some(String::new())))
            }
            (None, KeyCode::Esc) => {
                self.dismissed.insert(asked(fork, &label, &call_id));
                self.note(format!(
                    "`{label}` still waits: Enter on its tab asks again"
                ));
            }
            (None, _) => self.modal = Some(keep(None)),
            (Some(_), KeyCode::Esc) => self.modal = Some(keep(None)),
            (Some(r), KeyCode::Enter) => {
                let reason = Some(r.trim().to_string()).filter(|r| !r.is_empty());
                self.decide(fork, label, call_id, false, reason)
            }
            (Some(mut r), KeyCode::Backspace) => {
                r.pop();
                self.modal = Some(keep(Some(r)));
            }
            (Some(mut r), KeyCode::Char(c)) => {
                r.push(c);
                self.modal = Some(keep(Some(r)));
            }
            (Some(r), _) => self.modal = Some(keep(Some(r))),
        }
    }

    fn decide(
        &mut self,
        fork: ForkId,
        label: String,
        call_id: String,
        approve: bool,
        reason: Option<String>,
    ) {
        let client = self.client.clone();
        self.dismissed.insert(asked(fork, &label, &call_id));
        poll::spawn(&self.tx, "the answer", async move {
            let outcome = client
                .decide(fork, label, Some(call_id), approve, reason)
                .await?;
            Ok(Msg::Note(
                render::decision_text(&outcome).trim().to_string(),
            ))
        });
    }
}

/// A request for consent: fork, branch and call.
fn asked(fork: ForkId, label: &str, call_id: &str) -> String {
    format!("{fork}/{label}/{call_id}")
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

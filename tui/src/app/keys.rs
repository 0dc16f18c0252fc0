//! What keys do outside a modal: focus, scrolling, the input line, and what Enter sends
//! (a message, a steer, a slash command).

use super::*;

impl App {
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

    pub(super) fn on_key(&mut self, k: KeyEvent) {
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
        let asking = Asking {
            fork,
            label: b.label.clone(),
            call_id: p.call_id.clone(),
            what: format!(
                "{} {}",
                p.tool,
                render::one_line(&render::args_line(&p.args), 200)
            ),
            rule: p.rule.clone(),
        };
        if self.dismissed.contains(&asking.key()) {
            return;
        }
        self.modal = Some(Modal::Approval {
            asking,
            reason: None,
        });
    }

    pub(super) fn tab_count(&self) -> usize {
        self.tabs.as_ref().map_or(0, |t| t.view.branches.len())
    }

    pub(super) fn cycle(&mut self, step: i32) {
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

    pub(super) fn focus_number(&mut self, c: char) {
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

    pub(super) fn pane_mut(&mut self) -> Option<&mut Pane> {
        let run = self.focused().map(|(_, b)| b.run_id)?;
        self.panes.get_mut(&run)
    }

    pub(super) fn scroll(&mut self, by: i32) {
        if let Some(p) = self.pane_mut() {
            p.scroll = (p.scroll as i32 + by).clamp(0, u16::MAX as i32) as u16;
        }
    }

    pub(super) fn byte_at(&self, chars: usize) -> usize {
        self.input
            .char_indices()
            .nth(chars)
            .map_or(self.input.len(), |(i, _)| i)
    }

    pub(super) fn insert(&mut self, s: &str) {
        let at = self.byte_at(self.cursor);
        self.input.insert_str(at, s);
        self.cursor += s.chars().count();
    }

    pub(super) fn backspace(&mut self) {
        if self.cursor > 0 {
            self.cursor -= 1;
            let at = self.byte_at(self.cursor);
            self.input.remove(at);
        }
    }

    pub(super) fn delete_word(&mut self) {
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

    pub(super) fn set_input(&mut self, s: String) {
        self.cursor = s.chars().count();
        self.input = s;
    }

    pub(super) fn on_esc(&mut self) {
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
                                "stop the agent's turn? its work so far stays, and your next message goes on from it"
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

    pub(super) fn submit(&mut self) {
        let text = self.input.trim().to_string();
        if text.is_empty() {
            // Enter on a run waiting for consent asks again.
            if let Some((fork, b)) = self.focused() {
                if let Some(p) = &b.approval {
                    let key = Asking::key_of(fork, &b.label, &p.call_id);
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
    pub(super) fn send_message(&mut self, text: String) {
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
    pub(super) fn talk(&mut self, fork: ForkId, label: String, state: BranchState, text: String) {
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
                match client.steer(fork, label.clone(), text.clone()).await {
                    Ok(_) => Ok(Msg::Note(format!(
                        "steered `{label}`: it reads it before its next model call"
                    ))),
                    // The run ended while the message was typed: it is not lost, it starts
                    // the run's next turn, as a message after the answer does.
                    Err(e) => {
                        let view = client.fork(fork).await?;
                        if view.branch(&label).is_some_and(|b| b.state.is_terminal()) {
                            client.continue_branch(fork, label.clone(), text).await?;
                            Ok(Msg::Note(format!(
                                "`{label}` had just answered: it goes on with your message"
                            )))
                        } else {
                            Err(e.into())
                        }
                    }
                }
            });
        }
    }

    pub(super) fn steer_label(&mut self, label: &str, msg: &str, typed: &str) {
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

    pub(super) fn start_chat(&mut self, text: String) {
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

    pub(super) fn command(&mut self, cmd: &str, typed: &str) {
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

    pub(super) fn open_form(&mut self) {
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

    pub(super) fn submit_form(&mut self, form: ForkForm) {
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

    pub(super) fn resolve(&mut self) {
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

    pub(super) fn merge(&mut self, pick: String) {
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
    pub(super) fn request_diff(&mut self, label: Option<String>) {
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
}

//! The modals over the chat (help, confirmations, the `/fork` form, the merge picker, the
//! acceptance step, a request for consent, a diff) and what keys do in them.

use super::*;

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
    pub(super) fn fields(&self) -> usize {
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
    pub(super) fn branches(&self) -> Result<(Vec<AgentBranch>, Option<f64>), String> {
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
                b => Some(
                    forkfleet_shared::budget::parse_usd(b)
                        .map_err(|e| format!("row {n} budget: {e}"))?,
                ),
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
            a => Some(
                forkfleet_shared::budget::parse_usd(a)
                    .map_err(|e| format!("aggregate budget: {e}"))?,
            ),
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

/// A call that waits for consent: whose, what, and the rule that stopped it.
#[derive(Debug, Clone)]
pub struct Asking {
    pub fork: ForkId,
    pub label: String,
    pub call_id: String,
    /// The tool and its arguments, on a line.
    pub what: String,
    pub rule: String,
}

impl Asking {
    /// Its key in [`App::dismissed`]: call ids repeat across runs.
    pub fn key(&self) -> String {
        Self::key_of(self.fork, &self.label, &self.call_id)
    }

    pub fn key_of(fork: ForkId, label: &str, call_id: &str) -> String {
        format!("{fork}/{label}/{call_id}")
    }
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
    /// A request for consent of the focused run; `reason` is being typed after `n`.
    Approval {
        asking: Asking,
        reason: Option<String>,
    },
    /// A diff, scrolled; Esc goes back to `back`.
    Diff {
        lines: Vec<String>,
        scroll: u16,
        back: Option<Box<Modal>>,
    },
}

impl App {
    // ---- modals ---------------------------------------------------------------------------

    pub(super) fn on_modal_key(&mut self, k: KeyEvent) {
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
            Modal::Approval { asking, reason } => self.approval_key(k, asking, reason),
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

    pub(super) fn confirmed(&mut self, action: Confirmed) {
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

    pub(super) fn form_key(&mut self, mut form: ForkForm, k: KeyEvent) {
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

    pub(super) fn picker_key(&mut self, mut p: Picker, k: KeyEvent) {
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

    pub(super) fn approval_key(&mut self, k: KeyEvent, asking: Asking, reason: Option<String>) {
        let keep = |asking: Asking, reason| Modal::Approval { asking, reason };
        match (reason, k.code) {
            (None, KeyCode::Char('y') | KeyCode::Char('a')) => self.decide(asking, true, None),
            (None, KeyCode::Char('n') | KeyCode::Char('d')) => {
                self.modal = Some(keep(asking, Some(String::new())))
            }
            (None, KeyCode::Esc) => {
                self.note(format!(
                    "`{}` still waits: Enter on its tab asks again",
                    asking.label
                ));
                self.dismissed.insert(asking.key());
            }
            (None, _) => self.modal = Some(keep(asking, None)),
            (Some(_), KeyCode::Esc) => self.modal = Some(keep(asking, None)),
            (Some(r), KeyCode::Enter) => {
                let reason = Some(r.trim().to_string()).filter(|r| !r.is_empty());
                self.decide(asking, false, reason)
            }
            (Some(mut r), KeyCode::Backspace) => {
                r.pop();
                self.modal = Some(keep(asking, Some(r)));
            }
            (Some(mut r), KeyCode::Char(c)) => {
                r.push(c);
                self.modal = Some(keep(asking, Some(r)));
            }
            (Some(r), _) => self.modal = Some(keep(asking, Some(r))),
        }
    }

    pub(super) fn decide(&mut self, asking: Asking, approve: bool, reason: Option<String>) {
        let client = self.client.clone();
        self.dismissed.insert(asking.key());
        poll::spawn(&self.tx, "the answer", async move {
            let outcome = client
                .decide(
                    asking.fork,
                    asking.label,
                    Some(asking.call_id),
                    approve,
                    reason,
                )
                .await?;
            Ok(Msg::Note(
                render::decision_text(&outcome).trim().to_string(),
            ))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(rows: &[(&str, &str, &str)], aggregate: &str) -> ForkForm {
        ForkForm {
            rows: rows
                .iter()
                .map(|(label, steer, budget)| FormRow {
                    label: label.to_string(),
                    steer: steer.to_string(),
                    model: String::new(),
                    budget: budget.to_string(),
                })
                .collect(),
            aggregate: aggregate.to_string(),
            field: 0,
            default_model: "scripted:x".into(),
            error: None,
        }
    }

    #[test]
    fn the_fork_form_names_what_is_missing_or_wrong() {
        let ok = form(&[("a", "short", "0.25"), ("b", "long", "")], "2");
        let (branches, aggregate) = ok.branches().unwrap();
        assert_eq!(branches.len(), 2);
        assert_eq!(branches[0].budget_usd, Some(0.25));
        assert_eq!(branches[1].budget_usd, None);
        assert_eq!(branches[1].model, None);
        assert_eq!(aggregate, Some(2.0));
        let e = form(&[("a", "", "")], "").branches().unwrap_err();
        assert!(e.contains("row 1 (`a`): give it a steer"), "{e}");
        let e = form(&[("", "x", "")], "").branches().unwrap_err();
        assert!(e.contains("label"), "{e}");
        let e = form(&[("a", "x", "lots")], "").branches().unwrap_err();
        assert!(e.contains("row 1 budget"), "{e}");
        let e = form(&[("a", "x", "")], "-1").branches().unwrap_err();
        assert!(e.contains("aggregate budget"), "{e}");
    }

    #[test]
    fn tab_moves_through_every_field_and_wraps() {
        let mut f = form(&[("a", "", ""), ("b", "", "")], "");
        assert_eq!(f.fields(), 9);
        f.field = 8;
        f.current().push('3');
        assert_eq!(f.aggregate, "3");
        f.field = 5;
        f.current().push_str("go");
        assert_eq!(f.rows[1].steer, "go");
    }
}

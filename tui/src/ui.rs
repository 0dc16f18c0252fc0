//! Drawing the chat: the tab strip, the focused pane, the notice, the input and the status
//! line, and a modal over them. Everything fits 80x24; wider and taller screens show more.

use super::app::{own_events, App, Focus, Modal, FORM_COLUMNS};
use super::transcript;
use forkfleet_client::render;
use forkfleet_shared::api::{BranchView, ForkView};
use forkfleet_shared::budget::ForkCost;
use forkfleet_shared::diff::DiffReport;
use ratatui::layout::{Constraint, Layout, Position, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Wrap};
use ratatui::Frame;

pub fn draw(f: &mut Frame, app: &App) {
    // A long notice (an error naming what is valid) takes up to three lines.
    let notice_lines = app.notice.as_ref().map_or(1, |n| {
        let width = f.area().width.max(1) as usize;
        n.text.chars().count().div_ceil(width).clamp(1, 3) as u16
    });
    let [tabs, body, notice, input, status] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(3),
        Constraint::Length(notice_lines),
        Constraint::Length(1),
        Constraint::Length(1),
    ])
    .areas(f.area());
    f.render_widget(Paragraph::new(tab_strip(app)), tabs);
    match app.focus {
        Focus::Overview => overview(f, app, body),
        _ => pane(f, app, body),
    }
    if let Some(n) = &app.notice {
        let style = if n.bad {
            app.theme.bad()
        } else {
            app.theme.good()
        };
        f.render_widget(
            Paragraph::new(Line::styled(n.text.clone(), style)).wrap(Wrap { trim: false }),
            notice,
        );
    }
    let prompt = "› ";
    let shown = input_window(
        &app.input,
        app.cursor,
        input.width.saturating_sub(3) as usize,
    );
    f.render_widget(
        Paragraph::new(Line::from(vec![
            Span::styled(prompt, app.theme.user()),
            Span::raw(shown.0),
        ])),
        input,
    );
    if app.modal.is_none() {
        f.set_cursor_position(Position::new(input.x + 2 + shown.1 as u16, input.y));
    }
    f.render_widget(
        Paragraph::new(Line::from(status_line(app))).style(app.theme.status()),
        status,
    );
    if let Some(m) = &app.modal {
        modal(f, app, m);
    }
}

/// The part of `input` that fits `width` with the cursor in it, and the cursor's column.
fn input_window(input: &str, cursor: usize, width: usize) -> (String, usize) {
    let width = width.max(1);
    let start = cursor.saturating_sub(width.saturating_sub(1));
    let shown: String = input.chars().skip(start).take(width).collect();
    (shown, cursor - start)
}

fn tab_strip(app: &App) -> Line<'static> {
    let t = &app.theme;
    let style = |on: bool| if on { t.selected() } else { Style::default() };
    let mut spans = vec![Span::styled(
        " chat ",
        style(app.focus == Focus::Chat).patch(t.title()),
    )];
    if let Some(tabs) = &app.tabs {
        spans.push(Span::raw(" "));
        spans.push(Span::styled(
            " 0 overview ",
            style(app.focus == Focus::Overview),
        ));
        for (i, b) in tabs.view.branches.iter().enumerate() {
            let (badge, bstyle) = t.badge(b.state);
            spans.push(Span::raw(" "));
            let on = app.focus == Focus::Branch(i);
            spans.push(Span::styled(format!(" {} ", i + 1), style(on)));
            spans.push(Span::styled(badge.to_string(), style(on).patch(bstyle)));
            spans.push(Span::styled(format!(" {} ", b.label), style(on)));
        }
    } else {
        spans.push(Span::styled("  (no fork: /fork makes one)", t.dim()));
    }
    spans.push(Span::styled("   ? help", t.dim()));
    Line::from(spans)
}

fn usd(v: f64) -> String {
    format!("${v:.4}")
}

/// `spent / cap` of a branch, from the fork's costs.
fn spend(cost: Option<&ForkCost>, b: &BranchView) -> String {
    let cap = cost
        .and_then(|c| c.branches.iter().find(|x| x.run_id == b.run_id))
        .and_then(|c| c.cap_usd);
    match cap {
        Some(cap) => format!("{} / ${cap}", usd(b.cost_usd)),
        None => usd(b.cost_usd),
    }
}

fn status_line(app: &App) -> Vec<Span<'static>> {
    let mut spans = Vec::new();
    if app.bus_down {
        spans.push(Span::styled(
            " ⚠ connection lost: reconnecting ",
            app.theme.bad(),
        ));
    } else if let Some(e) = &app.connection {
        spans.push(Span::styled(
            format!(" ⚠ connection lost, retrying: {} ", render::one_line(e, 60)),
            app.theme.bad(),
        ));
    }
    let mut parts = Vec::new();
    if let Some(m) = app.main() {
        let (badge, _) = app.theme.badge(m.state);
        let mut s = format!(
            "agent {badge} {} {}",
            m.state,
            spend(app.chat_cost.as_ref(), m)
        );
        if let Some(cap) = app.chat_cost.as_ref().and_then(|c| c.cap_usd) {
            s.push_str(&format!(" (cap ${cap})"));
        }
        parts.push(s);
    } else if app.starting.is_some() {
        parts.push("starting…".into());
    }
    if let Some(t) = &app.tabs {
        let running = t
            .view
            .branches
            .iter()
            .filter(|b| !b.state.is_stopped())
            .count();
        let cap = t.cost.as_ref().and_then(|c| c.cap_usd);
        parts.push(format!(
            "fork {running}/{} running {}{}{}",
            t.view.branches.len(),
            usd(t.view.total_cost_usd()),
            cap.map(|c| format!(" / ${c}")).unwrap_or_default(),
            if t.resolving { " · resolving…" } else { "" }
        ));
    }
    parts.push(app.reach.trim().to_string());
    if let Some(chat) = &app.chat {
        parts.push(format!("run {}", chat.root));
    }
    spans.push(Span::raw(format!(" {}", parts.join(" · "))));
    spans
}

fn short_id(id: &str) -> String {
    id.chars().take(13).collect()
}

/// The chat's agent or a branch: a header line, then its transcript, scrolled.
fn pane(f: &mut Frame, app: &App, area: Rect) {
    let t = &app.theme;
    let [head, rest] = Layout::vertical([Constraint::Length(1), Constraint::Min(1)]).areas(area);
    let focused = app.focused();
    let Some((_, b)) = focused else {
        let text = if app.starting.is_some() {
            "starting the chat…".to_string()
        } else {
            "Type a message and press Enter to start. The agent works in a copy of the workspace; \
             its changes reach the directory when it stops. /fork tries several approaches side \
             by side, ? shows every key and command."
                .to_string()
        };
        f.render_widget(
            Paragraph::new(Line::styled("chat · no conversation yet", t.title())),
            head,
        );
        f.render_widget(
            Paragraph::new(text)
                .style(t.dim())
                .wrap(Wrap { trim: false }),
            rest,
        );
        return;
    };
    let (badge, bstyle) = t.badge(b.state);
    let who = if app.focus == Focus::Chat {
        "chat".to_string()
    } else {
        format!("branch {}", b.label)
    };
    let mut header = vec![
        Span::styled(format!("{who} · "), t.title()),
        Span::styled(format!("{badge} {}", b.state), bstyle),
        Span::raw(format!(
            " · {} · {}",
            render::count(b.turns as usize, "turn", "turns"),
            spend(
                if app.focus == Focus::Chat {
                    app.chat_cost.as_ref()
                } else {
                    app.tabs.as_ref().and_then(|x| x.cost.as_ref())
                },
                b
            )
        )),
    ];
    if let Some(e) = &b.error {
        header.push(Span::styled(
            format!(" · {}", render::one_line(e, 60)),
            t.bad(),
        ));
    }
    if b.approval.is_some() {
        header.push(Span::styled(" · waits for your answer: Enter", t.warn()));
    }
    f.render_widget(Paragraph::new(Line::from(header)), head);
    let Some(p) = app.panes.get(&b.run_id) else {
        f.render_widget(Paragraph::new("…").style(t.dim()), rest);
        return;
    };
    let events = if app.focus == Focus::Chat {
        &p.events[..]
    } else {
        own_events(&p.events)
    };
    let lines = transcript::lines(events, rest.width, app.unfold, t);
    let height = rest.height as usize;
    let max_scroll = lines.len().saturating_sub(height);
    let scroll = (p.scroll as usize).min(max_scroll);
    let start = lines.len().saturating_sub(height + scroll);
    let shown: Vec<Line> = lines.into_iter().skip(start).take(height).collect();
    f.render_widget(Paragraph::new(shown), rest);
}

/// Files branch `label` touched, from the diff report.
fn files_of(diff: Option<&DiffReport>, label: &str) -> Option<Vec<String>> {
    let d = diff?;
    let i = d.branch_index(label)?;
    Some(
        d.paths
            .iter()
            .filter(|p| p.change(i).is_some())
            .map(|p| p.path.to_string())
            .collect(),
    )
}

fn overview(f: &mut Frame, app: &App, area: Rect) {
    let t = &app.theme;
    let Some(tabs) = &app.tabs else { return };
    let v: &ForkView = &tabs.view;
    let mut lines = vec![Line::from(vec![
        Span::styled(
            format!(
                "fork {} · {}",
                short_id(&v.fork_id.to_string()),
                v.state.as_str()
            ),
            t.title(),
        ),
        Span::raw(format!(
            " · {} · {}{}{}",
            render::count(v.branches.len(), "branch", "branches"),
            usd(v.total_cost_usd()),
            tabs.cost
                .as_ref()
                .and_then(|c| c.cap_usd)
                .map(|c| format!(" of ${c}"))
                .unwrap_or_default(),
            tabs.diff
                .as_ref()
                .map(|d| format!(" · agreement {:.2}", d.summary.agreement_score))
                .unwrap_or_default()
        )),
    ])];
    let width = area.width as usize;
    lines.push(Line::styled(
        format!(
            " #  {:<10} {:<14} {:>5}  {:<18} {}",
            "branch", "state", "turns", "spent / cap", "files"
        ),
        t.dim(),
    ));
    for (i, b) in v.branches.iter().enumerate() {
        let (badge, bstyle) = t.badge(b.state);
        let files = files_of(tabs.diff.as_ref(), &b.label);
        lines.push(Line::from(vec![
            Span::raw(format!(
                " {:<2} {:<10} ",
                i + 1,
                render::one_line(&b.label, 10)
            )),
            Span::styled(format!("{badge} {:<12}", b.state.to_string()), bstyle),
            Span::raw(format!(
                " {:>5}  {:<18} {}",
                b.turns,
                spend(tabs.cost.as_ref(), b),
                files
                    .as_ref()
                    .map_or("…".to_string(), |f| f.len().to_string())
            )),
        ]));
        // Under each row: the files it changed, then the start of its last answer.
        let mut detail = Vec::new();
        if let Some(f) = files.filter(|f| !f.is_empty()) {
            detail.push(f.join(", "));
        }
        if let Some(a) = &b.last_message_preview {
            detail.push(a.clone());
        }
        if !detail.is_empty() {
            lines.push(Line::styled(
                format!(
                    "      {}",
                    render::one_line(&detail.join(" · "), width.saturating_sub(7))
                ),
                t.dim(),
            ));
        }
    }
    lines.push(Line::raw(""));
    let hint = if tabs.resolving {
        "resolving: tests, then the judges…"
    } else if v.settled() {
        "every branch finished: /merge picks one, /resolve asks the tests and judges"
    } else {
        "Tab or 1-9 opens a branch · type in its tab to steer it · Esc here aborts the fork"
    };
    lines.push(Line::styled(hint, t.dim()));
    f.render_widget(Paragraph::new(lines).wrap(Wrap { trim: false }), area);
}

fn centered(area: Rect, width: u16, height: u16) -> Rect {
    let w = width.min(area.width);
    let h = height.min(area.height);
    Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    )
}

fn modal(f: &mut Frame, app: &App, m: &Modal) {
    let t = &app.theme;
    let area = f.area();
    let width = area.width.saturating_sub(4).min(100);
    let (title, lines, focus_line): (String, Vec<Line>, Option<usize>) = match m {
        Modal::Help => ("keys and commands".into(), help_lines(t), None),
        Modal::Confirm { question, .. } => (
            "confirm".into(),
            vec![
                Line::raw(question.clone()),
                Line::raw(""),
                Line::styled("[y] yes · [n] no", t.warn()),
            ],
            None,
        ),
        Modal::Form(form) => {
            let mut lines = Vec::new();
            let mut focus = 0;
            let field = |i: usize, value: &str, placeholder: &str| -> Span<'static> {
                let on = form.field == i;
                let text = if value.is_empty() {
                    placeholder.to_string()
                } else {
                    value.to_string()
                };
                let style = if on {
                    t.selected()
                } else if value.is_empty() {
                    t.dim()
                } else {
                    Style::default()
                };
                Span::styled(format!("[{text}{}]", if on { "▏" } else { "" }), style)
            };
            for (r, row) in form.rows.iter().enumerate() {
                let base = r * FORM_COLUMNS;
                if form.field / FORM_COLUMNS == r {
                    focus = lines.len();
                }
                lines.push(Line::from(vec![
                    Span::styled(format!("{} ", r + 1), t.title()),
                    Span::raw("label "),
                    field(base, &row.label, "label"),
                    Span::raw("  model "),
                    field(
                        base + 2,
                        &row.model,
                        &format!("default: {}", form.default_model),
                    ),
                    Span::raw("  budget "),
                    field(base + 3, &row.budget, "none"),
                ]));
                lines.push(Line::from(vec![
                    Span::raw("  steer "),
                    field(base + 1, &row.steer, "what this branch should try"),
                ]));
            }
            if form.field >= form.rows.len() * FORM_COLUMNS {
                focus = lines.len();
            }
            lines.push(Line::from(vec![
                Span::raw("aggregate budget (the whole fork) "),
                field(form.rows.len() * FORM_COLUMNS, &form.aggregate, "none"),
            ]));
            if let Some(e) = &form.error {
                lines.push(Line::styled(e.clone(), t.bad()));
            }
            lines.push(Line::styled(
                "Tab/↓ next field · ↑ previous · Enter fork · Esc cancel",
                t.dim(),
            ));
            (
                format!("fork into {} branches", form.rows.len()),
                lines,
                Some(focus),
            )
        }
        Modal::Picker(p) => picker_lines(app, p.selected, p.subtitle.as_deref(), width),
        Modal::Accept {
            winner,
            confidence,
            reasoning,
        } => (
            "accept the judges' pick?".into(),
            vec![
                Line::styled(
                    format!("merge `{winner}` (confidence {confidence:.2})"),
                    t.title(),
                ),
                Line::raw(reasoning.clone()),
                Line::raw(""),
                Line::styled(
                    "[enter] accept · [d] diff · [o] override: pick another · [esc] cancel",
                    t.warn(),
                ),
            ],
            None,
        ),
        Modal::Approval { asking, reason } => {
            let (label, what, rule) = (&asking.label, &asking.what, &asking.rule);
            let mut lines = vec![
                Line::styled(format!("`{label}` asks to run"), t.title()),
                Line::raw(what.clone()),
                Line::styled(format!("rule: {rule}"), t.dim()),
                Line::raw(""),
            ];
            match reason {
                None => lines.push(Line::styled(
                    "[y] approve · [n] deny with a reason · [esc] later",
                    t.warn(),
                )),
                Some(r) => {
                    lines.push(Line::from(vec![
                        Span::raw("reason: "),
                        Span::styled(format!("{r}▏"), t.selected()),
                    ]));
                    lines.push(Line::styled("Enter denies · Esc back", t.dim()));
                }
            }
            ("approval".into(), lines, None)
        }
        Modal::Diff { lines, scroll, .. } => {
            let styled: Vec<Line> = lines
                .iter()
                .skip(*scroll as usize)
                .map(|l| {
                    let style = if l.starts_with('+') && !l.starts_with("+++") {
                        t.good()
                    } else if l.starts_with('-') && !l.starts_with("---") {
                        t.bad()
                    } else if l.starts_with("@@") {
                        t.tool()
                    } else {
                        Style::default()
                    };
                    Line::styled(l.clone(), style)
                })
                .collect();
            ("diff (↑↓ PgUp PgDn scroll · Esc back)".into(), styled, None)
        }
    };
    let inner_width = width.saturating_sub(2).max(1);
    let needed: usize = lines
        .iter()
        .map(|l| (l.width() / inner_width as usize) + 1)
        .sum();
    let height = (needed as u16 + 2)
        .min(area.height.saturating_sub(2))
        .max(3);
    let rect = centered(area, width, height);
    f.render_widget(Clear, rect);
    let room = height.saturating_sub(2) as usize;
    let skip = focus_line.map_or(0, |fl| fl.saturating_sub(room.saturating_sub(4)));
    let block = Block::default()
        .borders(Borders::ALL)
        .title(Span::styled(format!(" {title} "), t.title()));
    let lines: Vec<Line> = lines.into_iter().skip(skip).collect();
    f.render_widget(
        Paragraph::new(lines)
            .block(block)
            .wrap(Wrap { trim: false }),
        rect,
    );
}

fn picker_lines<'a>(
    app: &App,
    selected: usize,
    subtitle: Option<&str>,
    width: u16,
) -> (String, Vec<Line<'a>>, Option<usize>) {
    let t = &app.theme;
    let mut lines = Vec::new();
    if let Some(s) = subtitle {
        lines.push(Line::styled(s.to_string(), t.warn()));
    }
    let mut focus = 0;
    if let Some(tabs) = &app.tabs {
        for (i, b) in tabs.view.branches.iter().enumerate() {
            let (badge, bstyle) = t.badge(b.state);
            let on = i == selected;
            if on {
                focus = lines.len();
            }
            let files = files_of(tabs.diff.as_ref(), &b.label).unwrap_or_default();
            let row = if on { t.selected() } else { Style::default() };
            lines.push(Line::from(vec![
                Span::styled(format!("{} {} ", if on { "▶" } else { " " }, i + 1), row),
                Span::styled(badge.to_string(), bstyle),
                Span::styled(
                    format!(
                        " {} · {} · {} · {}",
                        b.label,
                        b.state,
                        render::count(b.turns as usize, "turn", "turns"),
                        usd(b.cost_usd)
                    ),
                    row,
                ),
            ]));
            lines.push(Line::styled(
                format!(
                    "    {}",
                    if files.is_empty() {
                        "no file changed".to_string()
                    } else {
                        format!(
                            "{}: {}",
                            render::count(files.len(), "file", "files"),
                            files.join(", ")
                        )
                    }
                ),
                t.dim(),
            ));
            if let Some(a) = &b.last_message_preview {
                lines.push(Line::raw(format!(
                    "    {}",
                    render::one_line(a, width.saturating_sub(8) as usize)
                )));
            }
        }
    }
    lines.push(Line::styled(
        "↑↓/1-9 choose · Enter merge · d diff · o open in the diff tool · Esc cancel",
        t.dim(),
    ));
    (
        "merge which branch into the chat?".into(),
        lines,
        Some(focus),
    )
}

fn help_lines(t: &super::theme::Theme) -> Vec<Line<'static>> {
    let rows: &[(&str, &str)] = &[
        ("Enter", "send: a new turn, or a steer while the run works"),
        (
            "Tab  Shift-Tab",
            "next / previous tab: chat, overview, branches",
        ),
        (
            "0-9  Alt+0-9",
            "the overview / branch N (digits: input empty)",
        ),
        ("Esc", "stop the agent · terminate a branch · abort (asks)"),
        ("↑↓  PgUp PgDn", "scroll the transcript"),
        ("Ctrl-O", "unfold tool calls and results"),
        ("Ctrl-U  Ctrl-W", "clear the input · delete a word"),
        ("Ctrl-C", "quit; runs stay: forkfleet chat --resume"),
        ("/fork", "fork: label, steer, model, budget per branch"),
        ("/fork-branches N", "rows /fork opens with (saved)"),
        (
            "/fork-model N M",
            "branch N's model; N clear; clear (saved)",
        ),
        (
            "/fork-budget",
            "per-branch USD · aggregate USD · clear (saved)",
        ),
        (">>LABEL text", "steer branch LABEL from any tab"),
        (
            "/merge",
            "pick the winner: answers, diffs (d), diff tool (o)",
        ),
        (
            "/resolve",
            "tests and judges, then accept, d diff, o override",
        ),
        (
            "/diff /cost /abort",
            "the fork's diff · spend · abort it · /quit",
        ),
    ];
    let mut lines: Vec<Line> = rows
        .iter()
        .map(|(k, v)| {
            Line::from(vec![
                Span::styled(format!("{k:<19}"), t.title()),
                Span::raw(v.to_string()),
            ])
        })
        .collect();
    lines.push(Line::styled("any key closes this", t.dim()));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_input_window_keeps_the_cursor_in_view() {
        assert_eq!(input_window("hello", 5, 10), ("hello".to_string(), 5));
        let (shown, col) = input_window("abcdefghijklmnop", 16, 5);
        assert_eq!((shown.as_str(), col), ("mnop", 4));
        let (shown, col) = input_window("abcdefghijklmnop", 2, 5);
        assert_eq!((shown.as_str(), col), ("abcde", 2));
    }
}

//! A run's log as the chat shows it: the conversation in full, tool calls and their
//! results folded to a line each (unfolded with Ctrl-O), bookkeeping left out.

use super::theme::Theme;
use forkfleet_client::render::{args_line, one_line};
use forkfleet_shared::api::LoggedEvent;
use forkfleet_shared::event::Event;
use ratatui::text::{Line, Span};

/// The most lines of one tool result an unfolded view shows.
const UNFOLDED_LINES: usize = 40;

/// One transcript entry: a styled first-line prefix and a text, before wrapping.
struct Entry {
    prefix: &'static str,
    style: ratatui::style::Style,
    text: String,
}

/// The lines of `events` at `width` columns.
pub fn lines(
    events: &[LoggedEvent],
    width: u16,
    unfold: bool,
    theme: &Theme,
) -> Vec<Line<'static>> {
    let mut out = Vec::new();
    for e in events {
        for entry in entries(&e.event, unfold, theme) {
            push_wrapped(&mut out, &entry, width);
        }
    }
    out
}

fn entries(e: &Event, unfold: bool, t: &Theme) -> Vec<Entry> {
    let one = |prefix, style, text: String| {
        vec![Entry {
            prefix,
            style,
            text,
        }]
    };
    match e {
        Event::UserMessage { text } | Event::FollowUp { text } => one("› ", t.user(), text.clone()),
        Event::Steer { text } => one("» ", t.user(), format!("(steer) {text}")),
        Event::ModelResponse {
            text,
            tool_calls,
            finish_reason,
            ..
        } => {
            let mut v = Vec::new();
            if let Some(text) = text.as_deref().filter(|s| !s.trim().is_empty()) {
                let cut = match finish_reason.as_deref() {
                    Some("budget_cut") => " [cut mid-answer: budget]",
                    Some("length" | "max_tokens" | "max_output_tokens") => " [truncated]",
                    _ => "",
                };
                v.push(Entry {
                    prefix: "◆ ",
                    style: t.model(),
                    text: format!("{text}{cut}"),
                });
            }
            for c in tool_calls {
                v.push(Entry {
                    prefix: "⚙ ",
                    style: t.tool(),
                    text: format!(
                        "{} {}",
                        c.name,
                        if unfold {
                            c.args.to_string()
                        } else {
                            one_line(&args_line(&c.args), 70)
                        }
                    ),
                });
            }
            v
        }
        Event::ToolResult {
            name, ok, output, ..
        } => {
            let lines = output.lines().count();
            let text = if unfold {
                let shown: Vec<&str> = output.lines().take(UNFOLDED_LINES).collect();
                let more = lines.saturating_sub(UNFOLDED_LINES);
                let mut s = format!(
                    "{name} {}\n{}",
                    if *ok { "ok" } else { "error" },
                    shown.join("\n")
                );
                if more > 0 {
                    s.push_str(&format!("\n… {more} more lines"));
                }
                s
            } else {
                format!(
                    "{name} {} · {}{}",
                    if *ok { "ok" } else { "error" },
                    one_line(
                        output
                            .lines()
                            .map(str::trim)
                            .find(|l| !l.is_empty())
                            .unwrap_or_default(),
                        60
                    ),
                    if lines > 1 {
                        format!(" ({lines} lines)")
                    } else {
                        String::new()
                    }
                )
            };
            one("  ↳ ", if *ok { t.dim() } else { t.bad() }, text)
        }
        Event::BranchSummary { text } => one("⎇ ", t.good(), text.clone()),
        Event::ApprovalRequested {
            tool, args, rule, ..
        } => one(
            "? ",
            t.warn(),
            format!(
                "asks to run {tool} {} (rule {rule})",
                one_line(&args_line(args), 60)
            ),
        ),
        Event::ApprovalDecided {
            approved,
            by,
            reason,
            ..
        } => one(
            "✓ ",
            if *approved { t.good() } else { t.bad() },
            format!(
                "{} by {by}{}",
                if *approved { "approved" } else { "denied" },
                reason
                    .as_deref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
        ),
        Event::Status { state, error } if state.is_terminal() || error.is_some() => one(
            "· ",
            if error.is_some() { t.bad() } else { t.dim() },
            format!(
                "{state}{}",
                error
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            ),
        ),
        Event::Checkpoint { label } if !label.starts_with("auto") => {
            one("· ", t.dim(), format!("checkpoint {label}"))
        }
        Event::Rewind { label, .. } => one("· ", t.dim(), format!("rewound to checkpoint {label}")),
        _ => Vec::new(),
    }
}

/// `entry` wrapped at `width` columns: its prefix on the first line, an indent after.
fn push_wrapped(out: &mut Vec<Line<'static>>, entry: &Entry, width: u16) {
    let indent = entry.prefix.chars().count();
    // A tab or a control character would move the terminal's cursor where the screen
    // buffer does not expect it.
    let text: String = entry
        .text
        .chars()
        .map(|c| match c {
            '\t' => ' ',
            '\n' => '\n',
            c if c.is_control() => '�',
            c => c,
        })
        .collect();
    let room = (width as usize).saturating_sub(indent).max(8);
    let mut first = true;
    for para in text.split('\n') {
        for piece in wrap(para, room) {
            let lead = if first {
                entry.prefix.to_string()
            } else {
                " ".repeat(indent)
            };
            first = false;
            out.push(Line::from(vec![
                Span::styled(lead, entry.style),
                Span::styled(piece, entry.style),
            ]));
        }
    }
}

/// `text` cut into lines of at most `width` characters, at spaces where it can.
pub fn wrap(text: &str, width: usize) -> Vec<String> {
    let width = width.max(1);
    let mut lines = Vec::new();
    let mut line = String::new();
    let mut len = 0;
    for word in text.split(' ') {
        let wlen = word.chars().count();
        if len > 0 && len + 1 + wlen > width {
            lines.push(std::mem::take(&mut line));
            len = 0;
        }
        if len > 0 {
            line.push(' ');
            len += 1;
        }
        // A word longer than a line is cut.
        let mut chars = word.chars().peekable();
        while chars.peek().is_some() {
            if len == width {
                lines.push(std::mem::take(&mut line));
                len = 0;
            }
            if let Some(c) = chars.next() {
                line.push(c);
                len += 1;
            }
        }
    }
    lines.push(line);
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkfleet_shared::event::ToolCall;

    fn logged(event: Event) -> LoggedEvent {
        LoggedEvent { seq: 0, event }
    }

    fn text(lines: &[Line<'_>]) -> Vec<String> {
        lines
            .iter()
            .map(|l| l.spans.iter().map(|s| s.content.as_ref()).collect())
            .collect()
    }

    #[test]
    fn wrap_breaks_at_spaces_and_cuts_long_words() {
        assert_eq!(wrap("one two three", 7), vec!["one two", "three"]);
        assert_eq!(wrap("abcdefghij", 4), vec!["abcd", "efgh", "ij"]);
        assert_eq!(wrap("", 4), vec![""]);
    }

    #[test]
    fn tool_calls_and_results_fold_to_a_line_each_and_unfold() {
        let events = vec![
            logged(Event::UserMessage {
                text: "fix it".into(),
            }),
            logged(Event::ModelResponse {
                model: "m".into(),
                text: Some("Looking.".into()),
                tool_calls: vec![ToolCall {
                    id: "1".into(),
                    name: "read_file".into(),
                    args: serde_json::json!({"path": "a.py"}),
                }],
                finish_reason: None,
                reasoning: None,
                request: None,
            }),
            logged(Event::ToolResult {
                call_id: "1".into(),
                name: "read_file".into(),
                ok: true,
                output: "line 1\nline 2\nline 3".into(),
                request: None,
            }),
            logged(Event::Usage {
                model: "m".into(),
                usage: Default::default(),
                cost_usd: 0.0,
                reservation: None,
                cached: false,
            }),
        ];
        let theme = Theme::new(false);
        let folded = text(&lines(&events, 80, false, &theme));
        assert_eq!(folded.len(), 4, "{folded:?}");
        assert_eq!(folded[0], "› fix it");
        assert!(folded[2].starts_with("⚙ read_file"), "{folded:?}");
        assert!(folded[3].contains("(3 lines)"), "{folded:?}");
        let unfolded = text(&lines(&events, 80, true, &theme));
        assert!(
            unfolded.iter().any(|l| l.trim() == "line 3"),
            "{unfolded:?}"
        );
    }
}

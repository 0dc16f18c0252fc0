//! The chat's styles: colours, or none when `NO_COLOR` is set (https://no-color.org), in
//! which case emphasis is bold, dim and reversed text alone.

use forkfleet_shared::state::BranchState;
use ratatui::style::{Color, Modifier, Style};

#[derive(Debug, Clone, Copy)]
pub struct Theme {
    color: bool,
}

impl Theme {
    pub fn new(color: bool) -> Self {
        Self { color }
    }

    /// Colours unless `NO_COLOR` is set to anything but the empty string.
    pub fn from_env() -> Self {
        Self::new(std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()))
    }

    fn fg(&self, c: Color) -> Style {
        if self.color {
            Style::default().fg(c)
        } else {
            Style::default()
        }
    }

    pub fn user(&self) -> Style {
        self.fg(Color::Cyan).add_modifier(Modifier::BOLD)
    }
    pub fn model(&self) -> Style {
        Style::default()
    }
    pub fn tool(&self) -> Style {
        self.fg(Color::Yellow)
    }
    pub fn dim(&self) -> Style {
        self.fg(Color::DarkGray).add_modifier(Modifier::DIM)
    }
    pub fn good(&self) -> Style {
        self.fg(Color::Green)
    }
    pub fn bad(&self) -> Style {
        self.fg(Color::Red).add_modifier(Modifier::BOLD)
    }
    pub fn warn(&self) -> Style {
        self.fg(Color::Magenta).add_modifier(Modifier::BOLD)
    }
    pub fn title(&self) -> Style {
        self.fg(Color::Cyan).add_modifier(Modifier::BOLD)
    }
    /// The focused tab, the selected row.
    pub fn selected(&self) -> Style {
        Style::default().add_modifier(Modifier::REVERSED | Modifier::BOLD)
    }
    pub fn status(&self) -> Style {
        if self.color {
            Style::default().bg(Color::Blue).fg(Color::White)
        } else {
            Style::default().add_modifier(Modifier::REVERSED)
        }
    }

    /// A branch state's badge and its style.
    pub fn badge(&self, state: BranchState) -> (&'static str, Style) {
        match state {
            BranchState::Pending | BranchState::Idle => ("…", self.dim()),
            BranchState::Running => ("●", self.fg(Color::Yellow)),
            BranchState::Paused => ("‖", self.warn()),
            BranchState::AwaitingApproval => ("?", self.warn()),
            BranchState::Done => ("✓", self.good()),
            BranchState::Failed => ("✗", self.bad()),
            BranchState::Terminated => ("⊘", self.dim()),
            BranchState::BudgetExhausted | BranchState::AggregateBudgetExhausted => {
                ("$$", self.bad())
            }
            BranchState::Truncated => ("…✂", self.warn()),
            BranchState::Refused => ("⊗", self.warn()),
        }
    }
}

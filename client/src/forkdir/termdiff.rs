//! The coloured terminal diff `fork open` prints when no diff tool is found.

use super::*;

/// ANSI styles of the terminal diff.
pub(crate) struct Style {
    pub(crate) on: bool,
}

impl Style {
    pub(crate) fn paint(&self, code: &str, text: &str) -> String {
        if self.on {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }
}

/// The unified diff of every pair, parent first (`a`: the parent, `b`: the branch): the
/// coordinator's text (as `forkfleet diff` shows it), its `a/PATH` and `b/PATH` headers
/// replaced by the files in the fork directory.
pub(crate) fn terminal_diff(pairs: &[Pair], color: bool) -> String {
    let style = Style { on: color };
    let mut out = String::new();
    for pair in pairs {
        let parent_shown = format!("{PARENT_DIR}/{}", pair.path);
        let (a, b, what) = match (&pair.parent, &pair.branch) {
            (None, _) => (
                "/dev/null".to_string(),
                pair.shown.clone(),
                format!(" (created by {})", pair.label),
            ),
            (_, None) => (
                parent_shown.clone(),
                "/dev/null".to_string(),
                format!(" (deleted by {})", pair.label),
            ),
            _ => (parent_shown.clone(), pair.shown.clone(), String::new()),
        };
        let _ = writeln!(
            out,
            "{}",
            style.paint("1", &format!("diff {parent_shown} {}{what}", pair.shown))
        );
        let text = pair.diff.as_deref().unwrap_or("[no diff text]\n");
        // A text diff starts with its `---` and `+++` lines; a binary one is a placeholder.
        let body = if text.starts_with("--- ") {
            let _ = writeln!(out, "{}", style.paint("1", &format!("--- {a}")));
            let _ = writeln!(out, "{}", style.paint("1", &format!("+++ {b}")));
            text.splitn(3, '\n').nth(2).unwrap_or("")
        } else {
            text
        };
        for line in body.lines() {
            let painted = if line.starts_with("@@") {
                style.paint("36", line)
            } else if line.starts_with('+') {
                style.paint("32", line)
            } else if line.starts_with('-') {
                style.paint("31", line)
            } else {
                line.to_string()
            };
            let _ = writeln!(out, "{painted}");
        }
        out.push('\n');
    }
    out
}

/// What `fork open` did.
#[derive(Debug, Clone, Serialize)]
pub struct Opened {
    pub fork_id: String,
    pub dir: PathBuf,
    pub tool: &'static str,
    /// The command lines launched, each as its words.
    pub commands: Vec<Vec<String>>,
    pub notes: Vec<String>,
    /// The terminal diff (uncoloured), when that was the tool.
    pub diff: Option<String>,
    pub sync: SyncStats,
}

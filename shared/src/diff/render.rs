//! The diff report as a short table for terminals.

use super::{Agreement, DiffReport, Outcome, PathDiff};
use std::fmt::Write as _;

/// A short table for terminals: a summary line, one row per reported path (path,
/// agreement, which branches did what), and the per-branch unique counts.
pub fn render_summary(report: &DiffReport) -> String {
    const MAX_LABELS: usize = 6;
    const MAX_GROUPS: usize = 4;
    const MAX_UNIQUE: usize = 12;
    let s = &report.summary;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} branches · {} paths touched · {} unanimous · {} split · agreement {:.2}",
        s.branches, s.total_paths_touched, s.unanimous_paths, s.split_paths, s.agreement_score
    );
    if report.paths.is_empty() {
        out.push_str("no changes\n");
    } else {
        let width = report
            .paths
            .iter()
            .map(|p| p.path.as_str().chars().count())
            .max()
            .unwrap_or(4)
            .clamp(4, 60);
        let _ = writeln!(out, "{:<width$}  {:<19}  BRANCHES", "PATH", "AGREEMENT");
        for p in &report.paths {
            let mut path = p.path.to_string();
            if path.chars().count() > width {
                let skip = path.chars().count() - (width - 1);
                path = format!("…{}", path.chars().skip(skip).collect::<String>());
            }
            let _ = writeln!(
                out,
                "{:<width$}  {:<19}  {}",
                path,
                p.agreement.as_str(),
                who_did_what(report, p, MAX_LABELS, MAX_GROUPS)
            );
        }
    }
    if !report.branches.is_empty() {
        out.push_str("unique paths per branch:");
        for (i, (label, n)) in s.per_branch_unique.iter().enumerate() {
            if i == MAX_UNIQUE {
                let _ = write!(out, " … (+{} more)", s.per_branch_unique.len() - MAX_UNIQUE);
                break;
            }
            let _ = write!(out, " {label}={n}");
        }
        out.push('\n');
    }
    out
}

/// `modified: a, b · deleted: c`; on a split, outcomes that differ only by content carry
/// the content's short hash.
fn who_did_what(report: &DiffReport, p: &PathDiff, max_labels: usize, max_groups: usize) -> String {
    if p.changes.is_empty() {
        return "(no branch)".to_string();
    }
    // Outcomes in first-seen order, with the branches that reached each.
    let mut outcomes: Vec<(Outcome, Vec<u32>)> = Vec::new();
    for c in &p.changes {
        let key = (c.operation, c.entry.map(|e| e.hash));
        match outcomes.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(c.branch),
            None => outcomes.push((key, vec![c.branch])),
        }
    }
    let show_hash = p.agreement == Agreement::Split;
    let mut parts = Vec::new();
    for ((op, hash), members) in outcomes.iter().take(max_groups) {
        let mut s = op.as_str().to_string();
        if let (true, Some(h)) = (show_hash, hash) {
            let short = h.short();
            let _ = write!(s, "#{}", short.get(..6).unwrap_or(&short));
        }
        s.push_str(": ");
        let names: Vec<&str> = members
            .iter()
            .take(max_labels)
            .map(|b| report.label(*b))
            .collect();
        s.push_str(&names.join(", "));
        if members.len() > max_labels {
            let _ = write!(s, " +{} more", members.len() - max_labels);
        }
        parts.push(s);
    }
    let mut line = parts.join(" · ");
    if outcomes.len() > max_groups {
        let _ = write!(line, " · +{} other outcomes", outcomes.len() - max_groups);
    }
    line
}

//! `forkfleet fork resolve` and the resolve step of `forkfleet run`: ask the coordinator
//! to resolve a fork (tests on every branch and the judges run on workers), apply a
//! committed merge to a directory, and print the verdicts, signals and decision.

use super::*;
use forkfleet_client::changes;
use forkfleet_shared::api::ResolveReport;
use forkfleet_shared::resolve::{Decision, Strategy, DEFAULT_THRESHOLD, STRATEGY_NAMES};
use forkfleet_shared::testsignal::TestOutcome;
use serde_json::{json, Value};
use std::fmt::Write as _;

/// `--strategy NAME [--threshold X]` as a strategy; `None` keeps the spec's.
pub fn strategy_from_flags(
    name: Option<&str>,
    threshold: Option<f64>,
) -> Result<Option<Strategy>, String> {
    let Some(name) = name else {
        if threshold.is_some() {
            return Err(
                "--threshold needs --strategy auto_with_fallback (the spec's threshold is used otherwise)"
                    .to_string(),
            );
        }
        return Ok(None);
    };
    let strategy = Strategy::from_name(name, threshold.unwrap_or(DEFAULT_THRESHOLD))
        .ok_or_else(|| format!("--strategy `{name}` is not a strategy; valid: {STRATEGY_NAMES}"))?;
    if threshold.is_some() && !matches!(strategy, Strategy::AutoWithFallback { .. }) {
        return Err(format!(
            "--threshold is for auto_with_fallback, not `{}`",
            strategy.as_str()
        ));
    }
    strategy.validate().map_err(|e| e.to_string())?;
    Ok(Some(strategy))
}

/// An error to exit with when the resolve could not decide what its strategy asked for:
/// every judge failed. `None` when the decision is what the strategy allows.
pub fn failure(report: &ResolveReport, reach: &str) -> Option<String> {
    if !report.strategy.needs_judge() || !matches!(report.decision, Decision::Manual) {
        return None;
    }
    let errors: Vec<String> = report
        .judges
        .iter()
        .filter_map(|j| j.run.error.clone())
        .collect();
    Some(format!(
        "no judge gave a valid verdict ({}); nothing was merged: pick a branch with `forkfleet fork merge {} --pick LABEL{reach}`",
        if errors.is_empty() {
            "no judge ran".to_string()
        } else {
            errors.join("; ")
        },
        report.fork_id
    ))
}

fn outcome_text(o: &TestOutcome) -> String {
    match o {
        TestOutcome::Exited { code } => format!("exit {code}"),
        TestOutcome::Signalled => "killed by a signal".to_string(),
        TestOutcome::TimedOut => "timed out".to_string(),
        TestOutcome::SpawnFailed { error } => format!("not run: {error}"),
    }
}

/// The report for people: tests, each judge, the decision.
/// The report for people; `reach` is appended to the commands it suggests (see
/// `Client::reach`).
pub fn report_text(report: &ResolveReport, reach: &str) -> String {
    let mut out = String::new();
    if !report.tests.is_empty() {
        let width = report
            .tests
            .iter()
            .map(|t| t.label.chars().count())
            .max()
            .unwrap_or(5)
            .max(5);
        let _ = writeln!(out, "\ntests:");
        for t in &report.tests {
            let ratio = match t.signal.pass_ratio {
                Some(r) => format!("{:>4.0}%", r * 100.0),
                None => "  — ".to_string(),
            };
            let _ = writeln!(
                out,
                "  {:<width$}  {ratio}  {} · {} · {:.1} s",
                t.label,
                t.signal.reason,
                outcome_text(&t.outcome),
                t.duration_ms as f64 / 1000.0
            );
        }
    }
    for j in &report.judges {
        match (&j.run.verdict, j.confidence, &j.signals) {
            (Some(v), Some(c), Some(s)) => {
                let tests = s
                    .test_pass_ratio
                    .map_or("none".to_string(), |t| format!("{t:.2}"));
                let _ = writeln!(
                    out,
                    "\njudge {}: picked `{}` (judge {:.2}; effective {:.2} by {}: tests {tests}, agreement {:.2}, consistency {:.2})",
                    j.run.model,
                    v.winner,
                    v.confidence,
                    c,
                    report.formula,
                    s.agreement_score,
                    s.internal_consistency
                );
                if !v.reasoning.trim().is_empty() {
                    let _ = writeln!(out, "  reasoning: {}", v.reasoning.trim());
                }
                for (label, note) in &v.notes {
                    let _ = writeln!(out, "  {label}: {note}");
                }
            }
            _ => {
                let _ = writeln!(
                    out,
                    "\njudge {}: no verdict: {}",
                    j.run.model,
                    j.run.error.as_deref().unwrap_or("unknown error")
                );
            }
        }
        for r in &j.run.refused {
            let _ = writeln!(out, "  refused an earlier answer: {r}");
        }
    }
    if !report.judges.is_empty() {
        let _ = writeln!(
            out,
            "judges' cost: ${:.6} ({} in, {} out tokens; not part of the branches' spend)",
            report.judge_cost_usd,
            report.judge_usage.input_tokens,
            report.judge_usage.output_tokens
        );
    }
    let strategy = match &report.strategy {
        Strategy::AutoWithFallback { threshold } => {
            format!("auto_with_fallback at {threshold:.2}")
        }
        s => s.as_str().to_string(),
    };
    let _ = match &report.decision {
        Decision::Commit { winner, confidence } if report.no_commit => writeln!(
            out,
            "\ndecision ({strategy}): merge `{winner}` (confidence {confidence:.2}); not merged\n  merge it with: forkfleet fork merge {} --pick {}{reach}",
            report.fork_id,
            render::shell_word(winner)
        ),
        Decision::Commit { winner, confidence } => writeln!(
            out,
            "\ndecision ({strategy}): merge `{winner}` (confidence {confidence:.2})"
        ),
        Decision::Defer { pick, confidence } => writeln!(
            out,
            "\ndecision ({strategy}): `{pick}` suggested at {confidence:.2}, below the threshold: nothing merged\n  accept it with: forkfleet fork merge {} --pick {}{reach}",
            report.fork_id,
            render::shell_word(pick)
        ),
        Decision::Manual => writeln!(
            out,
            "\ndecision ({strategy}): a person picks: forkfleet fork merge {} --pick LABEL{reach}",
            report.fork_id
        ),
    };
    out
}

/// The report as JSON, with what applying the merge did.
pub fn report_json(resolved: &flow::Resolved) -> Value {
    let mut doc = serde_json::to_value(&resolved.report).unwrap_or(Value::Null);
    if let (Some(r), Some(obj)) = (&resolved.applied, doc.as_object_mut()) {
        obj.insert(
            "applied".to_string(),
            json!({
                "applied_paths": r.applied_paths,
                "deleted_paths": r.deleted_paths,
                "conflicts": r.conflicts,
                "overwritten": r.overwritten,
                "errors": r.errors.iter().map(|e| json!({"path": e.path, "op": e.op, "message": e.message})).collect::<Vec<_>>(),
            }),
        );
    }
    doc
}

/// The acceptance step: `winner` passed the threshold; the person accepts it (Enter), looks
/// at the diff (`d`), picks another branch (`o`) or cancels (`q`, Esc, or the end of
/// stdin). The branch to merge, if any.
async fn accept(
    coord: &Client,
    id: ForkId,
    view: &ForkView,
    winner: &str,
) -> anyhow::Result<Option<String>> {
    let labels: Vec<&str> = view.branches.iter().map(|b| b.label.as_str()).collect();
    loop {
        eprint!(
            "\nmerge `{winner}`? [enter] accept · [d] diff · [o] pick another branch · [q] cancel: "
        );
        let Some(line) = crate::cli::prompt::read_line().await? else {
            return Ok(None);
        };
        match line.as_str() {
            "" | "y" | "yes" => return Ok(Some(winner.to_string())),
            "d" => {
                let report = coord
                    .diff(
                        id,
                        DiffOptions {
                            unified: true,
                            ..DiffOptions::default()
                        },
                    )
                    .await?;
                eprint!("{}", render::diff_text(&report, true));
            }
            "o" => {
                eprint!("branch to merge ({}): ", labels.join(", "));
                let Some(pick) = crate::cli::prompt::read_line().await? else {
                    return Ok(None);
                };
                if labels.contains(&pick.as_str()) {
                    return Ok(Some(pick));
                }
                eprintln!("`{pick}` is not a branch of this fork");
            }
            "q" | "\u{1b}" | "n" | "no" => {
                eprintln!("nothing merged");
                return Ok(None);
            }
            other => eprintln!("`{other}`: press enter, d, o or q"),
        }
    }
}

pub(crate) async fn fork_resolve(
    coord: &Client,
    fork: &str,
    ask: flow::ResolveAsk,
    target: MergeTarget<'_>,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let view = coord.fork(id).await?;
    let (dir, policy) = target.resolve(&view)?;
    // Everything a git branch needs is checked before the resolve can merge.
    let repo = match target.git_branch {
        Some(name) => Some(changes::open_repo(&view, name).await?),
        None => None,
    };
    // Embedded, unfinished branches run here (this session's workers) before the resolve.
    if !coord.is_remote() && !view.settled() {
        forkdir::follow(coord, id, timeout, AT_ONCE, !json).await?;
    }
    // A person at the terminal confirms what `auto_with_fallback` would merge (the
    // reference's acceptance step): the resolve decides without merging, then asks.
    let accepting = crate::cli::prompt::interactive(json)
        && !ask.no_commit
        && ask
            .strategy
            .as_ref()
            .is_none_or(|s| matches!(s, Strategy::AutoWithFallback { .. }));
    let resolved = if accepting {
        let asked = flow::ResolveAsk {
            no_commit: true,
            ..ask
        };
        let mut resolved = flow::resolve_and_apply(coord, id, asked, None, None).await?;
        if let Decision::Commit { winner, .. } = resolved.report.decision.clone() {
            let pick = if matches!(resolved.report.strategy, Strategy::AutoWithFallback { .. }) {
                accept(coord, id, &view, &winner).await?
            } else {
                Some(winner)
            };
            if let Some(pick) = pick {
                let outcome = coord.merge(id, pick.as_str()).await?;
                resolved.applied =
                    Some(flow::apply_outcome(coord, &outcome, dir.as_deref(), policy).await?);
                resolved.report.merge = Some(outcome);
                resolved.report.no_commit = false;
            }
        }
        resolved
    } else {
        flow::resolve_and_apply(coord, id, ask, dir.as_deref(), policy).await?
    };
    if resolved.report.merge.is_some() {
        forkdir::cleanup_after_merge(coord, id).await;
    }
    let git = match (repo, &resolved.report.merge) {
        (Some(repo), Some(merge)) => {
            let commit = changes::write_commit(coord, &view, &merge.winner, &repo)
                .await
                .map_err(|e| {
                    anyhow::Error::from(e).context(format!(
                        "the merge of `{}` is recorded, but its commit for branch `{}` was not written",
                        merge.winner, repo.branch
                    ))
                })?;
            Some(finish_branch(repo, commit, id, &merge.winner).await?)
        }
        _ => None,
    };
    if json {
        let mut doc = report_json(&resolved);
        if let (Some(g), Some(obj)) = (&git, doc.as_object_mut()) {
            obj.insert("git_branch".to_string(), g.json());
        }
        print_json(&doc)?;
    } else {
        print!("{}", report_text(&resolved.report, coord.reach()));
        if let (Some(merge), Some(applied)) = (&resolved.report.merge, &resolved.applied) {
            print!("{}", render::merge_text(&merge.winner, applied));
        }
        match (&git, target.git_branch) {
            (Some(g), _) => print!("{}", g.text()),
            (None, Some(name)) => println!(
                "
nothing merged, so branch `{name}` was not made"
            ),
            (None, None) => {}
        }
    }
    if let Some(e) = failure(&resolved.report, coord.reach()) {
        return Err(Incomplete::Failed(e).into());
    }
    match &resolved.applied {
        Some(applied) if resolved.report.merge.is_some() => applied_in_full(
            "the merge",
            applied,
            Some(crate::cli::reapply_command(id, target.apply, coord.reach())),
        ),
        _ => Ok(()),
    }
}

pub(crate) async fn fork_merge(
    coord: &Client,
    fork: &str,
    pick: &str,
    target: MergeTarget<'_>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let view = coord.fork(id).await?;
    let (dir, policy) = target.resolve(&view)?;
    // A git branch: checked, and its commit written (no ref yet), before the merge, which
    // is final.
    let prepared = match target.git_branch {
        Some(name) => {
            let repo = changes::open_repo(&view, name).await?;
            let label = changes::pick_branch(&view, Some(pick))?;
            let commit = changes::write_commit(coord, &view, &label, &repo).await?;
            Some((repo, commit))
        }
        None => None,
    };
    let (winner, report) = flow::merge_and_apply(coord, id, pick, dir.as_deref(), policy).await?;
    let git = match prepared {
        Some((repo, commit)) => Some(finish_branch(repo, commit, id, &winner).await?),
        None => None,
    };
    let view = coord.fork(id).await?;
    // What the winner's work does not include: its calls that were not run.
    let blocked = view
        .branch(&winner)
        .map(|b| b.blocked.clone())
        .unwrap_or_default();
    if json {
        let mut doc = render::fork_json(&view, None, Some((winner.as_str(), &report)));
        doc["blocked"] = render::to_json(&blocked)?;
        if let (Some(g), Some(obj)) = (&git, doc.as_object_mut()) {
            obj.insert("git_branch".to_string(), g.json());
        }
        print_json(&doc)?;
    } else {
        for c in &blocked {
            println!("not run in `{winner}`: {}", render::blocked_line(c));
        }
        match (&git, &dir) {
            // Nothing was applied to a directory: the store's merge, said so.
            (Some(_), None) => println!(
                "\nmerged `{winner}` in the store; no directory was touched (--apply DIR also applies it to one)"
            ),
            _ => print!("{}", render::merge_text(&winner, &report)),
        }
        if let Some(g) = &git {
            print!("{}", g.text());
        }
    }
    applied_in_full(
        "the merge",
        &report,
        Some(crate::cli::reapply_command(id, target.apply, coord.reach())),
    )
}

/// `fork merge FORK --reapply`: apply a merged fork's merge to the directory again, from
/// the fork's snapshot to the parent's `post-fork` version; files edited since the fork
/// are kept unless `--overwrite`. The store is not touched.
pub(crate) async fn fork_reapply(
    coord: &Client,
    fork: &str,
    target: MergeTarget<'_>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let view = coord.fork(id).await?;
    let forkfleet_shared::state::ForkState::Merged { winner } = &view.state else {
        return Err(BadInput(format!(
            "fork {id} is not merged (it is {}): nothing to apply again; merge a branch with `forkfleet fork merge {id} --pick LABEL{}`",
            view.state.as_str(),
            coord.reach()
        ))
        .into());
    };
    let label = format!("post-fork:{id}");
    let merged = coord
        .checkpoints(view.parent_run)
        .await?
        .into_iter()
        .find(|c| c.label == label)
        .ok_or_else(|| {
            BadInput(format!(
                "fork {id}'s parent run {} has no checkpoint `{label}` to apply again: it was removed (`checkpoint rm`), or the merge went into the branch of the agent that forked, which has no directory",
                view.parent_run
            ))
        })?;
    let (dir, _) = target.resolve(&view)?;
    let Some(dir) = dir else {
        return Err(BadInput(format!(
            "fork {id} was made from no directory: name the one to apply its merge to with --apply DIR"
        ))
        .into());
    };
    // Edited files are kept unless --overwrite (whatever the plan's policy: applying
    // again is asked for by hand).
    let policy = if target.overwrite {
        ConflictPolicy::Overwrite
    } else {
        ConflictPolicy::KeepParent
    };
    let report = forkfleet_client::workspace::reapply_version(
        coord.blobs().as_ref(),
        &view.snapshot,
        &merged.snapshot,
        &dir,
        policy,
    )
    .await?;
    if json {
        print_json(&render::fork_json(
            &view,
            None,
            Some((winner.as_str(), &report)),
        ))?;
    } else {
        println!(
            "fork {id}: the merge of `{winner}` applied again to {} (the store is as it was)",
            dir.display()
        );
        print!("{}", render::merge_text(winner, &report));
    }
    applied_in_full(
        "the merge",
        &report,
        Some(crate::cli::reapply_command(id, target.apply, coord.reach())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_flags() {
        assert_eq!(strategy_from_flags(None, None).unwrap(), None);
        assert_eq!(
            strategy_from_flags(Some("auto_with_fallback"), Some(0.5)).unwrap(),
            Some(Strategy::AutoWithFallback { threshold: 0.5 })
        );
        assert_eq!(
            strategy_from_flags(Some("auto_with_fallback"), None).unwrap(),
            Some(Strategy::AutoWithFallback {
                threshold: DEFAULT_THRESHOLD
            })
        );
        assert!(strategy_from_flags(Some("best"), None)
            .unwrap_err()
            .contains("valid: manual, auto"));
        assert!(strategy_from_flags(Some("auto"), Some(0.5))
            .unwrap_err()
            .contains("--threshold is for auto_with_fallback"));
        assert!(strategy_from_flags(None, Some(0.5)).is_err());
        assert!(strategy_from_flags(Some("auto_with_fallback"), Some(1.5))
            .unwrap_err()
            .contains("[0, 1]"));
    }
}

//! `forkfleet runs ...`: every run of the store and its lineage, and forking any recorded
//! run at any event into a child run (docs/LINEAGE.md): `ls`, `show`, `tree`, `fork`,
//! `resume`.

use super::fork::turns::wait_for_branch;
use super::*;
use forkfleet_client::render::runs::{
    end_text, fork_text, runs_table, show_text, tree_json, tree_text,
};
use forkfleet_shared::api::{ContinueOutcome, RunForkOptions};
use forkfleet_shared::event::Event;
use forkfleet_shared::lineage::SummaryMode;
use serde_json::{json, Value};

#[derive(Debug, Subcommand)]
pub enum RunsCommand {
    /// Every run of the store, oldest first: kind, label, state, parent and cutoff, events,
    /// cost.
    Ls {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// One run: lineage, settings, state, cost, workspace version, children.
    Show {
        /// The run: its id, a unique prefix of one, or a fork's branch as FORK/LABEL.
        run: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// The session tree: every run under its parent (forks of forks, branches of a fork,
    /// checkpoint forks, children of `runs fork`, merge winners), from lineage only.
    Tree {
        /// Only the tree under this run (id, unique prefix, or FORK/LABEL).
        run: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Fork a recorded run at an event into a new child run: the parent's history through
    /// the cutoff copied (or re-executed with --replay), its files as they were then, its
    /// settings with --set applied. Prints the child's id.
    Fork {
        /// The parent run (id, unique prefix, or a fork's branch as FORK/LABEL).
        parent: String,
        /// The last parent event the child copies (default: the parent's last replayable
        /// one: a system, user_message, model_response, tool_result, steer or follow_up).
        #[arg(long, value_name = "SEQ")]
        at_event: Option<u64>,
        /// The child's label (default: at-<SEQ>).
        #[arg(long, value_name = "LABEL")]
        label: Option<String>,
        /// Override a setting of the child: model, temperature, system_prompt, max_turns,
        /// max_output_tokens, budget, tools.run_command, tools.forking.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Record a branch summary after the copied prefix: deterministic (counts and
        /// names from the log, the default) or model (written by the run's model).
        #[arg(long, value_name = "HOW", num_args = 0..=1, default_missing_value = "deterministic", value_parser = ["deterministic", "model"])]
        summarize: Option<String>,
        /// Re-execute the prefix instead of copying it: each model and tool call whose
        /// request hashes as the parent's is served from its record at no cost; the first
        /// that differs fails the child (replay_divergence). The child then goes on live.
        #[arg(long)]
        replay: bool,
        /// With --replay: at the first divergence go on live and record the answers.
        #[arg(long, requires = "replay")]
        record: bool,
        /// Print the plan (events to copy, skipped kinds, summary, settings, files) and
        /// write nothing.
        #[arg(long)]
        dry_run: bool,
        /// With --replay on a cluster: wait for the child to finish.
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds (the child keeps running).
        #[arg(long, value_name = "S")]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Where two runs part: their conversational events compared in order (each run's seq
    /// where they first differ, and the first field that does), and each path their
    /// workspaces hold differently, with unified diffs of text (e.g. two branches of a
    /// fork, or a run and its child).
    Diff {
        /// Run A (id, unique prefix, or a fork's branch as FORK/LABEL).
        a: String,
        /// Run B, the same ways.
        b: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Run a child on the workers: an idle child from its copied history (MESSAGE, when
    /// given, as a new user message first), or a finished run continued with MESSAGE.
    Resume {
        /// The run (id, unique prefix, or a fork's branch as FORK/LABEL).
        run: String,
        message: Option<String>,
        /// On a cluster: wait for the run to finish and print its answer (always,
        /// embedded).
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds (the run keeps running).
        #[arg(long, value_name = "S")]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

impl RunsCommand {
    pub fn client(&self) -> &ClientArgs {
        match self {
            RunsCommand::Ls { client }
            | RunsCommand::Show { client, .. }
            | RunsCommand::Diff { client, .. }
            | RunsCommand::Tree { client, .. }
            | RunsCommand::Fork { client, .. }
            | RunsCommand::Resume { client, .. } => client,
        }
    }

    /// What an embedded session needs: workers for what runs.
    fn local(&self) -> Local {
        match self {
            RunsCommand::Fork {
                replay: true,
                dry_run: false,
                ..
            }
            | RunsCommand::Resume { .. } => Local::Resume,
            // A model summary is written on a worker.
            RunsCommand::Fork {
                summarize: Some(how),
                ..
            } if how == "model" => Local::Resume,
            _ => Local::Read,
        }
    }
}

pub(crate) async fn cmd_runs(command: RunsCommand) -> anyhow::Result<()> {
    let local = command.local();
    with_session!(command.client(), local, |coord| run(coord, &command))
}

async fn run(coord: &Client, command: &RunsCommand) -> anyhow::Result<()> {
    let json_out = command.client().json;
    match command {
        RunsCommand::Ls { .. } => {
            let runs = coord.runs().await?;
            if json_out {
                return print_json(&serde_json::to_value(&runs)?);
            }
            print!("{}", runs_table(&runs, now_ms()));
            Ok(())
        }
        RunsCommand::Show { run, .. } => {
            let id = coord.find_run(run).await?;
            let detail = coord.run(id).await?;
            if json_out {
                return print_json(&serde_json::to_value(&detail)?);
            }
            print!("{}", show_text(&detail));
            Ok(())
        }
        RunsCommand::Diff { a, b, .. } => {
            let (a, b) = (coord.find_run(a).await?, coord.find_run(b).await?);
            let diff = forkfleet_client::rundiff::runs_diff(coord, a, b).await?;
            if json_out {
                return print_json(&serde_json::to_value(&diff)?);
            }
            print!("{}", diff.text());
            Ok(())
        }
        RunsCommand::Tree { run, .. } => {
            let runs = coord.runs().await?;
            let root = match run {
                Some(r) => Some(coord.find_run(r).await?),
                None => None,
            };
            if json_out {
                return print_json(&tree_json(&runs, root));
            }
            print!("{}", tree_text(&runs, root));
            Ok(())
        }
        RunsCommand::Fork {
            parent,
            at_event,
            label,
            set,
            summarize,
            replay,
            record,
            dry_run,
            wait,
            timeout_s,
            ..
        } => {
            let parent = coord.find_run(parent).await?;
            let summarize = summarize.as_deref().map(|s| match s {
                "model" => SummaryMode::Model,
                _ => SummaryMode::Deterministic,
            });
            let outcome = coord
                .run_fork(
                    parent,
                    RunForkOptions {
                        at_event: *at_event,
                        label: label.clone(),
                        set: set.clone(),
                        summarize,
                        replay: *replay,
                        record: *record,
                        dry_run: *dry_run,
                    },
                )
                .await?;
            let follow = outcome.replay && !outcome.dry_run && (*wait || !coord.is_remote());
            // One JSON shape whatever the mode: the outcome's fields, and `run`, the
            // child's detail once followed to its end (null when not followed).
            let doc = |detail: Option<&forkfleet_shared::api::RunDetail>| {
                let mut doc = serde_json::to_value(&outcome)?;
                doc["run"] = serde_json::to_value(detail)?;
                Ok::<_, serde_json::Error>(doc)
            };
            if !follow {
                if json_out {
                    return print_json(&doc(None)?);
                }
                print!("{}", fork_text(&outcome, coord.reach()));
                return Ok(());
            }
            if !json_out {
                print!("{}", fork_text(&outcome, coord.reach()));
            }
            let (Some(fork), Some(run)) = (outcome.fork_id, outcome.run_id) else {
                return Ok(());
            };
            let view = wait_for_branch(
                coord,
                fork,
                &outcome.label,
                timeout_s.map(Duration::from_secs),
            )
            .await?;
            let detail = coord.run(run).await?;
            if json_out {
                return print_json(&doc(Some(&detail))?);
            }
            print!("{}", end_text(&detail));
            finished_ok(&view, &outcome.label)
        }
        RunsCommand::Resume {
            run,
            message,
            wait,
            timeout_s,
            ..
        } => {
            let id = coord.find_run(run).await?;
            let outcome = coord.run_resume(id, message.clone()).await?;
            if !*wait && coord.is_remote() {
                if json_out {
                    return print_json(&serde_json::to_value(resume_json(&outcome))?);
                }
                print!("{}", resume_text(&outcome));
                println!(
                    "follow it with `forkfleet fork watch {}{}`, or wait with `runs resume --wait`",
                    outcome.fork_id,
                    coord.reach()
                );
                return Ok(());
            }
            if !json_out {
                print!("{}", resume_text(&outcome));
            }
            let view = wait_for_branch(
                coord,
                outcome.fork_id,
                &outcome.label,
                timeout_s.map(Duration::from_secs),
            )
            .await?;
            let detail = coord.run(id).await?;
            let answer = last_answer(&coord.run_events(id).await?, outcome.seq);
            if json_out {
                return print_json(&json!({
                    "resume": resume_json(&outcome),
                    "run": detail,
                    "answer": answer,
                }));
            }
            print!("{}", end_text(&detail));
            if let Some(text) = answer {
                println!("{text}");
            }
            finished_ok(&view, &outcome.label)
        }
    }
}

/// Exit 1 unless the run finished `done`.
fn finished_ok(view: &ForkView, label: &str) -> anyhow::Result<()> {
    match view.branch(label) {
        Some(b) if b.state == forkfleet_shared::state::BranchState::Done => Ok(()),
        Some(b) => Err(anyhow::anyhow!(
            "the run finished {}{}",
            b.state,
            b.error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        )),
        None => Err(anyhow::anyhow!("the run's fork has no branch `{label}`")),
    }
}

fn resume_json(o: &ContinueOutcome) -> Value {
    json!({
        "run_id": o.run_id,
        "fork_id": o.fork_id,
        "label": o.label,
        "previous": o.previous,
        "seq": o.seq,
        "state": o.branch.state,
    })
}

fn resume_text(o: &ContinueOutcome) -> String {
    format!(
        "run {} ({}) was {}; now {} on the workers\n",
        o.run_id, o.label, o.previous, o.branch.state
    )
}

/// The last answer of a run after seq `after`.
fn last_answer(events: &[forkfleet_shared::api::LoggedEvent], after: u64) -> Option<String> {
    events
        .iter()
        .filter(|e| e.seq > after)
        .filter_map(|e| match &e.event {
            Event::ModelResponse {
                text: Some(text), ..
            } if !text.trim().is_empty() => Some(text.clone()),
            _ => None,
        })
        .next_back()
}

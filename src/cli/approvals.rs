//! `forkfleet approvals`, `fork approve` and `fork deny`: the tool calls that wait for a
//! person's consent, and the answers (docs/APPROVALS.md).

use super::*;
use crate::cli::fork::{print_view, settle_resumed};

#[derive(Debug, Args)]
pub struct ApprovalsArgs {
    /// Only this fork's requests (id or a unique prefix of one).
    pub fork: Option<String>,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct AnswerArgs {
    /// Fork id (or a unique prefix of one).
    pub fork: String,
    /// The branch's label.
    pub label: String,
    /// The call the answer is for (default: the one that waits); an answer naming a call
    /// that no longer waits is refused.
    pub call_id: Option<String>,
    /// Why (a denial's reason is what the model reads).
    #[arg(long, value_name = "TEXT")]
    pub reason: Option<String>,
    /// Embedded only: give up waiting for the branch after this many seconds.
    #[arg(long)]
    pub timeout_s: Option<u64>,
    #[command(flatten)]
    pub client: ClientArgs,
}

pub(crate) async fn cmd_approvals(args: ApprovalsArgs) -> anyhow::Result<()> {
    let ApprovalsArgs { fork, client } = args;
    with_session!(&client, Local::Read, |coord| async {
        let id = match &fork {
            Some(prefix) => Some(coord.find_fork(prefix).await?),
            None => None,
        };
        let list = coord.approvals(id).await?;
        if client.json {
            print_json(&render::to_json(&list)?)
        } else {
            print!("{}", render::approvals_table(&list, now_ms()));
            if !list.is_empty() {
                println!(
                    "\nanswer with `forkfleet fork approve FORK LABEL{0}` or `forkfleet fork deny FORK LABEL --reason TEXT{0}`",
                    coord.reach()
                );
            }
            Ok(())
        }
    })
}

pub(crate) async fn cmd_answer(args: AnswerArgs, approve: bool) -> anyhow::Result<()> {
    let AnswerArgs {
        fork,
        label,
        call_id,
        reason,
        timeout_s,
        client,
    } = args;
    spec::check_label(&label).map_err(|e| BadInput(format!("LABEL: {e}")))?;
    // Embedded, the session's workers run the answered branch.
    with_session!(&client, Local::Resume, |coord| async {
        let id = coord.find_fork(&fork).await?;
        let outcome = coord
            .decide(id, label.clone(), call_id.clone(), approve, reason.clone())
            .await?;
        if !coord.is_remote() {
            settle_resumed(coord, &[id], timeout_s, client.json).await?;
        }
        if client.json {
            let mut doc = render::to_json(&outcome)?;
            if !coord.is_remote() {
                doc["fork"] = render::fork_json(&coord.fork(id).await?, None, None);
            }
            print_json(&doc)
        } else {
            print!("{}", render::decision_text(&outcome));
            if !coord.is_remote() {
                print_view(&coord.fork(id).await?, false, coord.reach())?;
            }
            Ok(())
        }
    })
}

/// Whether `fork watch` asks for answers: a person at a terminal (stdin and stderr), and
/// text output.
pub(crate) fn interactive(json: bool) -> bool {
    use std::io::IsTerminal;
    !json && std::io::stdin().is_terminal() && std::io::stderr().is_terminal()
}

/// One line from stdin (`None` at its end), read off the runtime.
pub(crate) async fn read_line() -> anyhow::Result<Option<String>> {
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        match std::io::stdin().read_line(&mut line)? {
            0 => Ok(None),
            _ => Ok(Some(line.trim().to_string())),
        }
    })
    .await?
}

/// Ask the person at the terminal about each request that waits in `view`: approve, deny
/// (with a reason) or skip. True when an answer was given (the watch goes on); false when
/// every request was skipped or stdin ended.
pub(crate) async fn ask(coord: &Client, view: &ForkView) -> anyhow::Result<bool> {
    let mut answered = false;
    for b in &view.branches {
        let Some(p) = b
            .approval
            .as_ref()
            .filter(|_| b.state == forkfleet_shared::state::BranchState::AwaitingApproval)
        else {
            continue;
        };
        eprintln!(
            "\nbranch `{}` asks to run {} {}\n  rule {} · call {} · {} after {} s",
            b.label,
            p.tool,
            render::args_line(&p.args),
            p.rule,
            p.call_id,
            p.on_timeout.as_str(),
            p.deadline_ms.saturating_sub(p.requested_at_ms) / 1000
        );
        let approve = loop {
            eprint!("approve? [y]es / [n]o / [s]kip: ");
            let Some(line) = read_line().await? else {
                return Ok(answered);
            };
            match line.to_ascii_lowercase().as_str() {
                "y" | "yes" => break Some(true),
                "n" | "no" => break Some(false),
                "s" | "skip" | "" => break None,
                other => eprintln!("`{other}`: answer y, n or s"),
            }
        };
        let Some(approve) = approve else {
            continue;
        };
        let reason = if approve {
            None
        } else {
            eprint!("reason (the model reads it; empty for none): ");
            read_line().await?.filter(|r| !r.is_empty())
        };
        match coord
            .decide(
                view.fork_id,
                b.label.clone(),
                Some(p.call_id.clone()),
                approve,
                reason,
            )
            .await
        {
            Ok(outcome) => {
                eprint!("{}", render::decision_text(&outcome));
                answered = true;
            }
            // Answered meanwhile by someone else, or ended: said, and the watch goes on.
            Err(e) => {
                eprintln!("not answered: {e}");
                answered = true;
            }
        }
    }
    Ok(answered)
}

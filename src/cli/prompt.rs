//! Questions to the person at the terminal: the answers to requests for consent that
//! `fork watch` asks for, and the one-line reads the resolve's acceptance step makes.

use super::*;

/// Whether `fork watch` asks for answers: a person at a terminal (stdin and stderr), and
/// text output.
pub(crate) fn interactive(json: bool) -> bool {
    use std::io::IsTerminal;
    !json && std::io::stdin().is_terminal() && std::io::stderr().is_terminal()
}

pub(crate) use forkfleet_client::prompt::read_line;

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

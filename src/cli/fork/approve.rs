//! `fork approve` and `fork deny`: answering a branch's request for consent
//! (docs/APPROVALS.md).

use super::*;

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

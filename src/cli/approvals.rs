//! `forkfleet approvals`: the tool calls that wait for a person's consent
//! (docs/APPROVALS.md). Answering them is `fork approve` and `fork deny`
//! (`fork/approve.rs`), or `fork watch` at a terminal (`prompt.rs`).

use super::*;

#[derive(Debug, Args)]
pub struct ApprovalsArgs {
    /// Only this fork's requests (id or a unique prefix of one).
    pub fork: Option<String>,
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

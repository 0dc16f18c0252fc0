//! `forkfleet account ...`: the budget accounts forks charge.

use super::*;

#[derive(Debug, Subcommand)]
pub enum AccountCommand {
    /// Create an account or change its cap; a higher cap resumes what the old one paused.
    #[command(group(clap::ArgGroup::new("cap_choice").required(true).args(["cap", "no_cap"])))]
    Set {
        /// 1 to 64 letters, digits, `-`, `_`, `.`, not starting with `.`.
        name: String,
        /// The cap in USD (finite, 0 or more).
        #[arg(long, value_name = "USD", value_parser = parse_cap, allow_hyphen_values = true)]
        cap: Option<f64>,
        /// Remove the cap (the account still tracks spend).
        #[arg(long)]
        no_cap: bool,
        /// Embedded only: give up waiting for resumed branches after this many seconds.
        #[arg(long)]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show every account, or the one named: cap, spent, reserved, remaining, forks.
    Show {
        name: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

pub(crate) async fn cmd_account(command: AccountCommand) -> anyhow::Result<()> {
    match command {
        AccountCommand::Set {
            name,
            cap,
            // clap's argument group gives exactly one of --cap (checked by `parse_cap`)
            // and --no-cap, so `cap` alone says which.
            no_cap: _,
            timeout_s,
            client,
        } => {
            spec::check_account_name(&name)?;
            // Embedded, the store may not exist yet: setting up an account comes first.
            with_session!(&client, Local::Run, |coord| async {
                let view = coord.account_set(&name, cap).await?;
                let view = if coord.is_remote() {
                    view
                } else {
                    // A higher cap resumes what the old one paused: run it here.
                    let mut forks = Vec::new();
                    for f in coord.forks().await? {
                        if render::paused_labels(&f).is_empty() || f.state.is_resolved() {
                            continue;
                        }
                        let cost = coord.fork_cost(f.fork_id).await?;
                        if cost.account.as_ref().is_some_and(|a| a.name == name) {
                            forks.push(f.fork_id);
                        }
                    }
                    super::fork::settle_resumed(coord, &forks, timeout_s, client.json).await?;
                    find_account(coord, &name).await?
                };
                if client.json {
                    print_json(&render::to_json(&view)?)
                } else {
                    print!("{}", render::account_text(&view));
                    Ok(())
                }
            })
        }
        AccountCommand::Show { name, client } => {
            with_session!(&client, Local::Read, |coord| async {
                match &name {
                    Some(name) => {
                        let view = find_account(coord, name).await?;
                        if client.json {
                            print_json(&render::to_json(&view)?)
                        } else {
                            print!("{}", render::account_text(&view));
                            Ok(())
                        }
                    }
                    None => {
                        let all = coord.accounts().await?;
                        if client.json {
                            print_json(&render::to_json(&all)?)
                        } else {
                            print!("{}", render::account_table(&all, coord.reach()));
                            Ok(())
                        }
                    }
                }
            })
        }
    }
}

/// The account named `name`, or a bad-input error listing the accounts there are.
pub(crate) async fn find_account(
    coord: &Client,
    name: &str,
) -> anyhow::Result<forkfleet_shared::budget::AccountView> {
    let all = coord.accounts().await?;
    if let Some(a) = all.iter().find(|a| a.name == name) {
        return Ok(a.clone());
    }
    let known = if all.is_empty() {
        format!(
            "there are no accounts yet; create one with `forkfleet account set NAME --cap USD{}`",
            coord.reach()
        )
    } else {
        format!("accounts: {}", labels(all.iter().map(|a| a.name.as_str())))
    };
    Err(BadInput(format!("no account named `{name}`; {known}")).into())
}

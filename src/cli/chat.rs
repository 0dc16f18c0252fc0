//! `forkfleet chat`: a terminal UI over a root run (docs/TERMINAL.md), in the
//! `forkfleet-tui` crate. Here: its arguments, its configuration and connection, and the
//! chat `--resume` names.

use super::*;
use forkfleet_tui::{ChatRun, Options, Settings, Stderr};

#[derive(Debug, Args)]
pub struct ChatArgs {
    /// The workspace the agent works in (default: the current directory); its directory
    /// follows the chat's agent.
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// The model, `provider:name` (default: the spec's).
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,
    /// A fork spec whose settings the chat runs with (models, system prompt, limits, tools,
    /// approvals, resolve); its goal and branches are not used: the first message is the
    /// goal, `/fork` makes the branches.
    #[arg(long, value_name = "FILE")]
    pub spec: Option<PathBuf>,
    /// Resume a chat: the one of root run RUN (id or unique prefix; the status line shows
    /// it), or without RUN the newest chat of this workspace.
    #[arg(long, value_name = "RUN", num_args = 0..=1, default_missing_value = "")]
    pub resume: Option<String>,
    /// The data directory of the embedded store (default: `.forkfleet/` in the workspace).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub(crate) async fn cmd_chat(args: ChatArgs) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let workspace =
        std::path::absolute(args.workspace.clone().unwrap_or_else(|| PathBuf::from(".")))?;
    if !workspace.is_dir() {
        return Err(BadInput(format!(
            "--workspace `{}` is not a directory; give the directory the agent works in",
            workspace.display()
        ))
        .into());
    }
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        return Err(BadInput(
            "forkfleet chat is a terminal UI: run it in a terminal (for scripts: forkfleet run, fork continue, fork steer)".into(),
        )
        .into());
    }
    // Log lines would scribble over the screen: they go to a file while the chat runs.
    let _log = Stderr::to_file(&workspace.join(".forkfleet").join("chat.log"));
    let client_args = ClientArgs {
        data: Some(
            args.data
                .clone()
                .unwrap_or_else(|| workspace.join(".forkfleet")),
        ),
        json: false,
        config: ConfigArgs {
            ..args.config.clone()
        },
    };
    let config = client_args.load_config()?;
    let pricing = Config::load_pricing(args.config.config.as_deref(), &config::process_env)?;
    let settings = Settings::load(&forkfleet_tui::settings_path(&workspace))?;
    // A resumed chat's unfinished turns run again here.
    let local = if args.resume.is_some() && config.nats_config_for(config::Role::Client).is_none() {
        Local::Resume
    } else {
        Local::Run
    };
    let Some(session) = Session::connect(&client_args, &config, local).await? else {
        return Ok(());
    };
    let client = session.client.clone();
    let result = async {
        let resume = match &args.resume {
            Some(run) => Some(find_chat(&client, run, &workspace).await?),
            None => None,
        };
        let reach = if client.is_remote() {
            "cluster".to_string()
        } else {
            format!("embedded {}", client_data(&client))
        };
        let opts = Options {
            spec: args.spec.clone(),
            workspace: workspace.clone(),
            model: args.model.clone(),
            pricing,
            reach,
            settings,
            resume,
        };
        forkfleet_tui::run(client, opts).await
    }
    .await;
    let closed = session.close().await;
    let root = result?;
    if let Some(root) = root {
        println!("chat run {root}: resume it with forkfleet chat --resume {root}");
    }
    closed
}

/// The chat `--resume RUN` names (the newest of `workspace` when RUN is empty): its fork,
/// root run and agent.
async fn find_chat(
    client: &Client,
    run: &str,
    workspace: &Path,
) -> anyhow::Result<(ChatRun, ForkView)> {
    let is_chat = |f: &ForkView| f.branches.len() == 1 && f.branches[0].label == SOLO_LABEL;
    let forks = client.forks().await?;
    let view = if run.is_empty() {
        let here = workspace.display().to_string();
        forks
            .into_iter()
            .filter(|f| is_chat(f) && f.workspace.as_deref() == Some(here.as_str()))
            .max_by_key(|f| f.created_at_ms)
            .ok_or_else(|| {
                BadInput(format!(
                    "no chat of workspace `{here}` to resume: start one with forkfleet chat, or name its run with --resume RUN"
                ))
            })?
    } else {
        let run = client.find_run(run).await?;
        forks
            .into_iter()
            .find(|f| is_chat(f) && (f.parent_run == run || f.branches[0].run_id == run))
            .ok_or_else(|| {
                BadInput(format!(
                    "run {run} is not a chat (a root run with one agent, `{SOLO_LABEL}`): `forkfleet runs ls` lists runs"
                ))
            })?
    };
    let chat = ChatRun {
        fork: view.fork_id,
        root: view.parent_run,
        main: view.branches[0].run_id,
        policy: Default::default(),
    };
    Ok((chat, view))
}

/// Where the embedded store is, for the status line.
fn client_data(client: &Client) -> String {
    client
        .reach()
        .trim()
        .trim_start_matches("--data")
        .trim()
        .to_string()
}

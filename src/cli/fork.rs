//! `forkfleet fork ...`: create, inspect, steer, stop, resolve and merge forks.

pub(crate) mod approve;
pub(crate) mod git;
pub(crate) mod resolve;
pub(crate) mod turns;

use super::*;
use crate::cli::prompt;
use git::*;
use resolve::*;
use turns::*;

/// After a top-up resumed branches, how long a fork may still look quiet (the resumed
/// branches stay `paused` until a worker takes them).
pub(crate) const RESUME_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Subcommand)]
pub enum ForkCommand {
    /// Create a fork from a spec file and print its id.
    ///
    /// Uploads only the workspace blobs the store lacks. On a cluster it returns at once
    /// (follow with `fork watch`); embedded (no NATS URL) the fork runs here to the end,
    /// since no worker outlives the command.
    Create(CreateArgs),
    /// List forks, newest first.
    Ls(ClientArgs),
    /// Show a fork's branches: state, turns, cost, the start of each one's last answer;
    /// with LABEL, that branch: its steer, its whole final answer, cost and changes.
    Show {
        /// Fork id (or a unique prefix of one).
        fork: String,
        /// One branch's label.
        label: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Follow a fork's branches (states, turns, costs) until every one has finished.
    Watch {
        /// Fork id (or a unique prefix of one).
        fork: String,
        /// Give up after this many seconds (exit 1; the fork keeps running).
        #[arg(long)]
        timeout_s: Option<u64>,
        /// Print every branch's events as they land (tool calls, results, answers), each
        /// line led by its label (`--json`: one object a line), until every branch stops.
        #[arg(long)]
        events: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show what the branches changed and where they agree.
    Diff(DiffArgs),
    /// Stop one branch; it keeps its partial work and can still be merged.
    Terminate {
        fork: String,
        /// The branch's label.
        label: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Stop every branch still running and mark the fork aborted (nothing can be merged).
    Abort {
        fork: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Send a running (or pending) branch a user message: it applies it before its next
    /// model call, and the branch's log shows it as a `steer` event. An unknown label, an
    /// empty message and a finished branch (see `fork continue`) are refused.
    ///
    /// Embedded (no NATS URL), what a stopped process left unfinished runs here, steered,
    /// until nothing runs.
    Steer {
        /// Fork id (or a unique prefix of one).
        fork: String,
        /// The branch's label.
        label: String,
        /// The message.
        message: String,
        /// Embedded only: give up waiting for the branches after this many seconds.
        #[arg(long)]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Start a new turn of a finished branch (done, failed or terminated) with a user
    /// message: it runs again with its whole history, writing into the same overlay (the
    /// fork's diff and a merge then hold both turns' work). Prints the branch's new state.
    ///
    /// A running branch is refused (steer it), and so is a fork merged or aborted. Embedded
    /// (no NATS URL) the new turn runs here to its end, then its final text is printed; on
    /// a cluster, --wait waits for it.
    Continue {
        /// Fork id (or a unique prefix of one).
        fork: String,
        /// The branch's label.
        label: String,
        /// The user message that starts the turn.
        message: String,
        /// Wait for the turn to end and print the branch's final text (always, embedded).
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds (exit 1; the branch keeps running).
        #[arg(long)]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a finished fork (merged, aborted, or every branch finished) with its branch
    /// runs, checkpoints, fork directory and the blobs nothing else refers to; refused,
    /// saying why, while a branch runs or when something that stays refers to it.
    Rm {
        /// Fork id, a unique prefix of one, or its name.
        fork: String,
        /// Say what would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Approve a branch's tool call that waits for consent (docs/APPROVALS.md): any
    /// worker takes the branch over and runs the call. Refused when the branch does not
    /// wait, or waits for another call than CALL_ID.
    ///
    /// Embedded (no NATS URL), the branch then runs here until nothing runs.
    Approve(approve::AnswerArgs),
    /// Deny a branch's tool call that waits for consent: the call is not run, the model
    /// reads that it was denied (with --reason) and goes on; the call is listed as blocked
    /// in `fork show`, `fork diff` and the merge.
    ///
    /// Embedded (no NATS URL), the branch then runs here until nothing runs.
    Deny(approve::AnswerArgs),
    /// A fork's money: per branch spent, reserved, cap, remaining and state; the fork's
    /// and its account's totals.
    Cost {
        /// Fork id (or a unique prefix of one).
        fork: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Raise a cap and resume the branches it paused: a branch's own cap with --branch,
    /// else the fork's aggregate cap. Prints the cost report.
    ///
    /// Embedded (no NATS URL), the resumed branches run here until nothing runs.
    Topup {
        /// Fork id (or a unique prefix of one).
        fork: String,
        /// The branch whose own cap to raise (default: the fork's aggregate cap).
        #[arg(long, value_name = "LABEL")]
        branch: Option<String>,
        /// How much to add, in USD (finite, greater than 0).
        #[arg(long, value_name = "USD", value_parser = parse_usd, allow_hyphen_values = true)]
        usd: f64,
        /// Embedded only: give up waiting for the resumed branches after this many seconds.
        #[arg(long)]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Move cap from one branch of a fork to another (both must have a cap); resumes the
    /// receiving branch if it was paused. Prints the cost report.
    MoveBudget(MoveBudgetArgs),
    /// Resolve a fork: run the spec's test command on every branch's tree (on workers), ask
    /// the judge(s), and decide by the strategy; a commit merges the winner and applies it
    /// to the workspace directory. Prints the tests, each verdict with its confidence, and
    /// the decision.
    ///
    /// Embedded (no NATS URL), unfinished branches run here first, then the tests and
    /// judges run on in-process workers.
    Resolve(ResolveArgs),
    /// Show the report of the fork's last resolve (tests, each judge's verdict with its
    /// signals and confidence, the decision) as stored: nothing runs again.
    Verdict {
        /// Fork id (or a unique prefix of one).
        fork: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Open the fork directory in a diff tool: the parent against each branch that
    /// changed something (at PATH, when given).
    ///
    /// Syncs `<workspace>/.forkfleet/forks/<fork>/` first, then launches
    /// $FORKFLEET_DIFFTOOL (a template with {parent} and {branches}), else PyCharm (a
    /// 3-way diff), else VS Code (`code --diff`, pairwise), else prints a unified diff.
    Open(OpenArgs),
    /// Merge a branch into the fork's parent and apply it to the workspace directory, or
    /// commit it on a new git branch (--git-branch) without touching the workspace.
    Merge(MergeArgs),
}

/// Where a merge goes (`fork merge`, and `fork resolve` when it commits).
#[derive(Debug, Args)]
pub struct MergeTargetArgs {
    /// Apply a merge to this directory instead of the workspace the fork was made from.
    #[arg(long, conflicts_with = "no_apply")]
    pub apply: Option<PathBuf>,
    /// Commit the winner's changes on a new branch NAME of the git repository the
    /// workspace was in, on top of the commit it was at when the fork was made; the
    /// working tree, index and current branch are left alone, and an existing NAME is
    /// refused. With it, no directory is applied to unless --apply DIR names one.
    #[arg(long, value_name = "NAME")]
    pub git_branch: Option<String>,
    /// Merge in the store only; leave every directory alone.
    #[arg(long)]
    pub no_apply: bool,
    /// Overwrite files changed in the directory since the fork (default: the spec's
    /// `conflict_policy`, which keeps them unless it says `overwrite`).
    #[arg(long)]
    pub overwrite: bool,
}

impl MergeTargetArgs {
    fn target(&self) -> MergeTarget<'_> {
        MergeTarget {
            apply: self.apply.as_deref(),
            git_branch: self.git_branch.as_deref(),
            no_apply: self.no_apply,
            overwrite: self.overwrite,
        }
    }
}

// The arguments of `fork create` (its help is the variant's).
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// The fork spec (TOML). See docs/SPEC.md.
    pub spec: PathBuf,
    /// Embedded only: give up waiting for the branches after this many seconds.
    #[arg(long)]
    pub timeout_s: Option<u64>,
    /// Fork this existing root run (id or unique prefix) as it is now: its conversation
    /// and its workspace version (a run merged into, or made by `checkpoint fork`),
    /// instead of a new run from the spec's goal and workspace directory.
    #[arg(long, value_name = "RUN")]
    pub from_run: Option<String>,
    /// Check the spec and say what the workspace snapshot would hold and leave out
    /// (and why), reading no file's contents; nothing is uploaded or created.
    #[arg(long)]
    pub dry_run: bool,
    /// A name for the fork (overrides the spec's `name`), usable where its id is.
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    #[command(flatten)]
    pub client: ClientArgs,
}

// The arguments of `fork diff` (its help is the variant's).
#[derive(Debug, Args)]
pub struct DiffArgs {
    pub fork: String,
    /// Only these paths (files or directories).
    #[arg(long = "path")]
    pub paths: Vec<String>,
    /// Print unified diffs, not only the summary.
    #[arg(long)]
    pub unified: bool,
    /// Write one branch's changes (against the fork snapshot) as a git patch that
    /// `git apply` takes, to FILE (whole or not at all), or to stdout without FILE or
    /// with `-`. Binary files are `GIT binary patch` hunks, symlinks mode 120000.
    #[arg(
        long,
        value_name = "FILE",
        num_args = 0..=1,
        default_missing_value = "-",
        conflicts_with = "unified"
    )]
    pub patch: Option<PathBuf>,
    /// The branch --patch writes (default: the merged winner, else the fork's only
    /// branch; a fork of several branches needs it).
    #[arg(long, value_name = "LABEL", requires = "patch")]
    pub branch: Option<String>,
    #[command(flatten)]
    pub client: ClientArgs,
}

// The arguments of `fork resolve` (its help is the variant's).
#[derive(Debug, Args)]
pub struct ResolveArgs {
    /// Fork id (or a unique prefix of one).
    pub fork: String,
    /// Override the spec's strategy: manual, auto, auto_with_fallback, vote.
    #[arg(long, value_name = "NAME")]
    pub strategy: Option<String>,
    /// auto_with_fallback's threshold in [0, 1] (default 0.80).
    #[arg(long, value_name = "X", allow_hyphen_values = true)]
    pub threshold: Option<f64>,
    /// Run the tests and judges and print the decision, but merge nothing; `fork
    /// verdict` shows the report again later.
    #[arg(long, alias = "no-commit")]
    pub judge_only: bool,
    /// The judge's model instead of the spec's (repeat for `vote`). Without one in the
    /// spec either, a default judge is taken from the models the workers offer.
    #[arg(long = "judge-model", value_name = "MODEL")]
    pub judge_models: Vec<String>,
    #[command(flatten)]
    pub target: MergeTargetArgs,
    /// Embedded only: give up waiting for unfinished branches after this many seconds.
    #[arg(long)]
    pub timeout_s: Option<u64>,
    #[command(flatten)]
    pub client: ClientArgs,
}

// The arguments of `fork open` (its help is the variant's).
#[derive(Debug, Args)]
pub struct OpenArgs {
    /// Fork id (or a unique prefix of one).
    pub fork: String,
    /// A workspace-relative path the fork touched (default: the whole directories).
    pub path: Option<String>,
    /// Only this branch against the parent (repeat: `--branch a --branch b` for a
    /// 3-way diff of those two); default every branch that changed something.
    #[arg(long = "branch", value_name = "LABEL")]
    pub branches: Vec<String>,
    /// Keep the fork directory in sync while the fork runs (every branch's files as
    /// they change), until every branch has finished; then open it.
    #[arg(long)]
    pub follow: bool,
    /// With --follow: give up after this many seconds (exit 1; the fork keeps running).
    #[arg(long, requires = "follow")]
    pub timeout_s: Option<u64>,
    /// Colour the terminal diff.
    #[arg(long, value_enum, default_value_t = forkdir::ColorChoice::Auto)]
    pub color: forkdir::ColorChoice,
    #[command(flatten)]
    pub client: ClientArgs,
}

// The arguments of `fork merge` (its help is the variant's).
#[derive(Debug, Args)]
pub struct MergeArgs {
    pub fork: String,
    /// The winning branch's label.
    #[arg(long, required_unless_present = "reapply")]
    pub pick: Option<String>,
    /// Apply a merged fork's merge to the directory again (the workspace it was made from,
    /// or --apply DIR): what a merge kept because it was edited since the fork is replaced
    /// with --overwrite. The store is not touched.
    #[arg(long, conflicts_with_all = ["pick", "git_branch", "no_apply"])]
    pub reapply: bool,
    #[command(flatten)]
    pub target: MergeTargetArgs,
    #[command(flatten)]
    pub client: ClientArgs,
}

// The arguments of `fork move-budget` (its help is the variant's).
#[derive(Debug, Args)]
pub struct MoveBudgetArgs {
    /// Fork id (or a unique prefix of one).
    pub fork: String,
    /// The branch giving cap (it keeps at least what it spent and holds).
    #[arg(long, value_name = "LABEL")]
    pub from: String,
    /// The branch receiving it.
    #[arg(long, value_name = "LABEL")]
    pub to: String,
    /// How much to move, in USD (finite, greater than 0).
    #[arg(long, value_name = "USD", value_parser = parse_usd, allow_hyphen_values = true)]
    pub usd: f64,
    /// Embedded only: give up waiting for the resumed branch after this many seconds.
    #[arg(long)]
    pub timeout_s: Option<u64>,
    #[command(flatten)]
    pub client: ClientArgs,
}

pub(crate) async fn cmd_fork(command: ForkCommand) -> anyhow::Result<()> {
    match command {
        ForkCommand::Create(args) => fork_create_cmd(args).await,
        ForkCommand::Ls(client) => {
            with_session!(&client, Local::Read, |coord| fork_ls(coord, client.json))
        }
        ForkCommand::Show {
            fork,
            label,
            client,
        } => with_session!(&client, Local::Read, |coord| fork_show(
            coord,
            &fork,
            label.as_deref(),
            client.json
        )),
        // Embedded, watching also runs what a stopped process left unfinished.
        ForkCommand::Watch {
            fork,
            timeout_s,
            events: true,
            client,
        } => with_session!(&client, Local::Resume, |coord| fork_watch_events(
            coord,
            &fork,
            timeout_s.map(Duration::from_secs),
            client.json
        )),
        ForkCommand::Watch {
            fork,
            timeout_s,
            events: false,
            client,
        } => with_session!(&client, Local::Resume, |coord| fork_watch(
            coord,
            &fork,
            timeout_s.map(Duration::from_secs),
            client.json
        )),
        ForkCommand::Diff(args) => fork_diff_cmd(args).await,
        ForkCommand::Terminate {
            fork,
            label,
            client,
        } => with_session!(&client, Local::Read, |coord| fork_terminate(
            coord,
            &fork,
            &label,
            client.json
        )),
        ForkCommand::Abort { fork, client } => {
            with_session!(&client, Local::Read, |coord| fork_abort(
                coord,
                &fork,
                client.json
            ))
        }
        ForkCommand::Steer {
            fork,
            label,
            message,
            timeout_s,
            client,
        } => {
            check_turn_args(&label, &message)?;
            // Embedded, the session's workers run what a stopped process left unfinished.
            with_session!(&client, Local::Resume, |coord| fork_steer(
                coord,
                &fork,
                &label,
                &message,
                timeout_s.map(Duration::from_secs),
                client.json
            ))
        }
        ForkCommand::Continue {
            fork,
            label,
            message,
            wait,
            timeout_s,
            client,
        } => {
            check_turn_args(&label, &message)?;
            // Embedded, the session's workers run the new turn.
            with_session!(&client, Local::Resume, |coord| fork_continue(
                coord,
                &fork,
                &label,
                &message,
                wait,
                timeout_s.map(Duration::from_secs),
                client.json
            ))
        }
        ForkCommand::Rm {
            fork,
            dry_run,
            client,
        } => crate::cli::gc::cmd_remove(&fork, dry_run, &client).await,
        ForkCommand::Approve(args) => approve::cmd_answer(args, true).await,
        ForkCommand::Deny(args) => approve::cmd_answer(args, false).await,
        ForkCommand::Cost { fork, client } => {
            with_session!(&client, Local::Read, |coord| async {
                let id = coord.find_fork(&fork).await?;
                print_cost(&coord.fork_cost(id).await?, client.json)
            })
        }
        ForkCommand::Topup {
            fork,
            branch,
            usd,
            timeout_s,
            client,
        } => {
            if let Some(label) = &branch {
                spec::check_label(label).map_err(|e| BadInput(format!("--branch: {e}")))?;
            }
            with_session!(&client, Local::Resume, |coord| fork_topup(
                coord,
                &fork,
                branch.clone(),
                usd,
                timeout_s,
                client.json
            ))
        }
        ForkCommand::MoveBudget(args) => fork_move_budget_cmd(args).await,
        ForkCommand::Resolve(args) => fork_resolve_cmd(args).await,
        ForkCommand::Verdict { fork, client } => {
            with_session!(&client, Local::Read, |coord| fork_verdict(
                coord,
                &fork,
                client.json
            ))
        }
        ForkCommand::Open(args) => fork_open_cmd(args).await,
        ForkCommand::Merge(args) => fork_merge_cmd(args).await,
    }
}

async fn fork_create_cmd(args: CreateArgs) -> anyhow::Result<()> {
    let CreateArgs {
        spec: spec_path,
        timeout_s,
        from_run,
        dry_run,
        name,
        client,
    } = args;

    // Validate the spec before connecting: bad input creates nothing anywhere.
    let config = client.load_config()?;
    let mut over = toml::Table::new();
    if let Some(n) = name {
        over.insert("name".into(), toml::Value::String(n));
    }
    let loaded = spec::load_overridden(Some(&spec_path), over, &config.pricing)?;
    if dry_run {
        // Embedded: the workers' catalogue is this configuration's.
        let offer = config
            .nats
            .url
            .is_none()
            .then(|| config.catalogue().offer());
        return super::run::dry_run(&loaded, offer.as_ref(), client.json).await;
    }
    with_session!(
        @open Session::connect(&client, &config, Local::Run),
        |coord| fork_create(
            coord,
            &loaded,
            from_run.as_deref(),
            timeout_s.map(Duration::from_secs),
            client.json
        )
    )
}

async fn fork_diff_cmd(args: DiffArgs) -> anyhow::Result<()> {
    let DiffArgs {
        fork,
        paths,
        unified,
        patch,
        branch,
        client,
    } = args;

    let filter = paths
        .iter()
        .map(|p| WsPath::parse(p).map_err(|e| BadInput(format!("--path: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(out) = patch {
        let to = PatchTo::parse(out, client.json)?;
        return with_session!(&client, Local::Read, |coord| fork_diff_patch(
            coord,
            &fork,
            branch.as_deref(),
            (!filter.is_empty()).then(|| filter.clone()),
            &to,
            client.json
        ));
    }
    with_session!(&client, Local::Read, |coord| fork_diff(
        coord,
        &fork,
        filter.clone(),
        unified,
        client.json
    ))
}

async fn fork_resolve_cmd(args: ResolveArgs) -> anyhow::Result<()> {
    let ResolveArgs {
        fork,
        strategy,
        threshold,
        judge_only,
        judge_models,
        target,
        timeout_s,
        client,
    } = args;

    let strategy =
        resolve::strategy_from_flags(strategy.as_deref(), threshold).map_err(BadInput)?;
    for m in &judge_models {
        spec::split_model(m).map_err(|e| BadInput(format!("--judge-model: {e}")))?;
    }
    let ask = flow::ResolveAsk {
        strategy,
        no_commit: judge_only,
        judge_models,
    };
    with_session!(&client, Local::Resume, |coord| fork_resolve(
        coord,
        &fork,
        ask.clone(),
        target.target(),
        timeout_s.map(Duration::from_secs),
        client.json
    ))
}

async fn fork_open_cmd(args: OpenArgs) -> anyhow::Result<()> {
    let OpenArgs {
        fork,
        path,
        branches,
        follow,
        timeout_s,
        color,
        client,
    } = args;
    with_session!(
        &client,
        if follow { Local::Resume } else { Local::Read },
        |coord| fork_open(
            coord,
            &fork,
            path.as_deref(),
            &branches,
            follow.then(|| timeout_s.map(Duration::from_secs)),
            color,
            client.json
        )
    )
}

async fn fork_merge_cmd(args: MergeArgs) -> anyhow::Result<()> {
    let MergeArgs {
        fork,
        pick,
        reapply,
        target,
        client,
    } = args;
    match pick {
        Some(pick) if !reapply => with_session!(&client, Local::Read, |coord| fork_merge(
            coord,
            &fork,
            &pick,
            target.target(),
            client.json
        )),
        _ => with_session!(&client, Local::Read, |coord| resolve::fork_reapply(
            coord,
            &fork,
            target.target(),
            client.json
        )),
    }
}

async fn fork_move_budget_cmd(args: MoveBudgetArgs) -> anyhow::Result<()> {
    let MoveBudgetArgs {
        fork,
        from,
        to,
        usd,
        timeout_s,
        client,
    } = args;

    for (flag, label) in [("--from", &from), ("--to", &to)] {
        spec::check_label(label).map_err(|e| BadInput(format!("{flag}: {e}")))?;
    }
    if from == to {
        return Err(BadInput(format!(
            "--from and --to both name branch `{from}`; move budget between two different branches"
        ))
        .into());
    }
    with_session!(&client, Local::Resume, |coord| async {
        let id = coord.find_fork(&fork).await?;
        let cost = coord.move_budget(id, &from, &to, usd).await?;
        let done = format!("moved ${usd:.6} of cap from `{from}` to `{to}`");
        after_resume(coord, cost, &done, timeout_s, client.json).await
    })
}

/// `fork ls`.
async fn fork_ls(coord: &Client, json: bool) -> anyhow::Result<()> {
    let forks = coord.forks().await?;
    if json {
        let docs: Vec<_> = forks
            .iter()
            .map(|v| render::fork_json(v, None, None))
            .collect();
        print_json(&serde_json::Value::Array(docs))
    } else {
        print!("{}", render::fork_list(&forks));
        Ok(())
    }
}

/// `fork show FORK [LABEL]`.
async fn fork_show(
    coord: &Client,
    fork: &str,
    label: Option<&str>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    match label {
        Some(label) => show_branch(coord, id, label, json).await,
        None => {
            let view = coord.fork(id).await?;
            print_view(&view, json, coord.reach())
        }
    }
}

/// `fork watch --events`: every event of every branch as it lands, then the view.
async fn fork_watch_events(
    coord: &Client,
    fork: &str,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let mut each = |label: &str, e: &forkfleet_shared::api::LoggedEvent| {
        if json {
            println!(
                "{}",
                serde_json::json!({"label": label, "seq": e.seq, "event": e.event})
            );
        } else {
            println!("{label}  {:>5}  {}", e.seq, render::event_line(&e.event));
        }
    };
    let view = forkfleet_client::watch::follow_events(coord, id, None, timeout, &mut each).await?;
    if !json {
        print_view(&view, false, coord.reach())?;
    }
    crate::cli::failed_branches(&view).map_or(Ok(()), |failed| Err(failed.into()))
}

/// `fork watch`: the fork directory follows the fork until it finishes (embedded: until
/// nothing runs), asking for consent on a terminal; then the view.
async fn fork_watch(
    coord: &Client,
    fork: &str,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    // Embedded, branches a stopped process left pending or running were enqueued again
    // when this session started and its workers run them; paused ones wait for a top-up,
    // which nothing can give while this process holds the store, so the watch ends once
    // nothing runs. On a cluster another client may top up: it waits for every branch to
    // finish. On a terminal, a request for consent is asked for here and the watch goes on.
    let ask = prompt::interactive(json);
    let until = match (coord.is_remote(), ask) {
        (true, true) => Until::Asking,
        (true, false) => Until::Finished,
        (false, _) => AT_ONCE,
    };
    let view = loop {
        // The fork directory follows the fork live.
        let view = forkdir::follow(coord, id, timeout, until, !json).await?;
        if !ask || view.state.is_resolved() || !prompt::ask(coord, &view).await? {
            break view;
        }
    };
    print_view(&view, json, coord.reach())?;
    crate::cli::failed_branches(&view).map_or(Ok(()), |failed| Err(failed.into()))
}

/// `fork diff`: every branch's changes against the fork-time snapshot, with the calls
/// each branch did not run.
async fn fork_diff(
    coord: &Client,
    fork: &str,
    filter: Vec<WsPath>,
    unified: bool,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let opts = DiffOptions {
        paths: (!filter.is_empty()).then_some(filter),
        unified: unified || json,
        ..DiffOptions::default()
    };
    let report = coord.diff(id, opts).await?;
    // The calls each branch did not run belong with what it changed.
    let view = coord.fork(id).await?;
    if json {
        let mut doc = render::diff_json(&report, true);
        let blocked: serde_json::Map<String, serde_json::Value> = view
            .branches
            .iter()
            .filter(|b| !b.blocked.is_empty())
            .map(|b| Ok((b.label.clone(), render::to_json(&b.blocked)?)))
            .collect::<anyhow::Result<_>>()?;
        doc["blocked"] = serde_json::Value::Object(blocked);
        print_json(&doc)
    } else {
        print!("{}", render::diff_text(&report, unified));
        print!("{}", render::blocked_text(&view));
        Ok(())
    }
}

/// `fork terminate FORK LABEL`.
async fn fork_terminate(coord: &Client, fork: &str, label: &str, json: bool) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let outcome = coord.terminate(id, label).await?;
    if json {
        print_json(&render::terminate_json(&outcome))
    } else {
        print!("{}", render::terminate_text(&outcome));
        Ok(())
    }
}

/// `fork abort FORK`: every branch ended, the fork directory removed.
async fn fork_abort(coord: &Client, fork: &str, json: bool) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let outcome = coord.abort(id).await?;
    // An aborted fork's directory goes as a merged one's does (unless `keep_artifacts`):
    // nothing will be merged from it.
    forkdir::cleanup_after_merge(coord, id).await;
    if json {
        print_json(&render::abort_json(&outcome))
    } else {
        print!("{}", render::abort_text(&outcome));
        Ok(())
    }
}

/// `fork topup FORK [--branch LABEL] --usd USD`: a cap raised, paused branches resumed.
async fn fork_topup(
    coord: &Client,
    fork: &str,
    branch: Option<String>,
    usd: f64,
    timeout_s: Option<u64>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let what = match &branch {
        Some(b) => format!("branch `{b}`'s cap"),
        None => "the fork's cap".to_string(),
    };
    let cost = coord.topup(id, branch, usd).await?;
    let done = format!("raised {what} by ${usd:.6}");
    after_resume(coord, cost, &done, timeout_s, json).await
}

/// `fork verdict FORK`: the last resolve's report.
async fn fork_verdict(coord: &Client, fork: &str, json: bool) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let Some(report) = coord.verdict(id).await? else {
        return Err(BadInput(format!(
            "fork {id} was never resolved: `forkfleet fork resolve {id}{} --judge-only` judges it without merging",
            coord.reach()
        ))
        .into());
    };
    let resolved = flow::Resolved {
        report,
        applied: None,
    };
    if json {
        print_json(&report_json(&resolved))
    } else {
        print!("{}", report_text(&resolved.report, coord.reach()));
        Ok(())
    }
}

/// `fork open FORK`: the fork directory synced (and with `--follow`, following the fork
/// until it finishes, for at most the timeout given), then opened in a diff tool.
async fn fork_open(
    coord: &Client,
    fork: &str,
    path: Option<&str>,
    branches: &[String],
    follow: Option<Option<Duration>>,
    color: forkdir::ColorChoice,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    if let Some(timeout) = follow {
        // The fork directory follows the fork live (embedded, this session's workers run
        // what a stopped process left unfinished).
        let until = if coord.is_remote() {
            Until::Finished
        } else {
            AT_ONCE
        };
        forkdir::follow(coord, id, timeout, until, !json).await?;
    }
    forkdir::open(coord, id, path, branches, color, json).await?;
    Ok(())
}

/// `fork show FORK LABEL`: one branch, its steer, whole final answer, cost and changes.
async fn show_branch(coord: &Client, id: ForkId, label: &str, json: bool) -> anyhow::Result<()> {
    let view = coord.fork(id).await?;
    let Some(b) = view.branch(label) else {
        return Err(render::no_branch(&view, label).into());
    };
    let events = coord.run_events(b.run_id).await?;
    let detail = render::branch_detail(b, &events);
    if json {
        print_json(&detail.json())
    } else {
        print!("{}", detail.text(id));
        Ok(())
    }
}

/// A fork's view; `reach` (see `Client::reach`) ends the commands its hints print.
pub(crate) fn print_view(view: &ForkView, json: bool, reach: &str) -> anyhow::Result<()> {
    if json {
        print_json(&render::fork_json(view, None, None))
    } else {
        print!("{}", render::fork_header(view));
        print!("{}", render::branch_table(view));
        print!("{}", render::answers_text(view));
        print!("{}", render::blocked_text(view));
        if !view.state.is_resolved() {
            let waiting = render::approvals_hint(view, reach);
            if !waiting.is_empty() {
                print!("\n{waiting}");
            }
        }
        let paused = render::paused_labels(view);
        if !paused.is_empty() && !view.state.is_resolved() {
            print!(
                "\n{}",
                render::paused_hint(view.fork_id, &paused, view.branches.len(), None, reach)
            );
        }
        Ok(())
    }
}

pub(crate) fn print_cost(cost: &ForkCost, json: bool) -> anyhow::Result<()> {
    if json {
        print_json(&render::to_json(cost)?)
    } else {
        print!("{}", render::cost_table(cost));
        Ok(())
    }
}

/// After a cap change: embedded, run what it resumed here until nothing runs (no worker
/// outlives the command), then report the fork's cost; on a cluster, report at once.
pub(crate) async fn after_resume(
    coord: &Client,
    cost: ForkCost,
    done: &str,
    timeout_s: Option<u64>,
    json: bool,
) -> anyhow::Result<()> {
    let id = cost.fork_id;
    let cost = if coord.is_remote() {
        cost
    } else {
        settle_resumed(coord, &[id], timeout_s, json).await?;
        coord.fork_cost(id).await?
    };
    if json {
        return print_cost(&cost, true);
    }
    println!("{done}");
    print!("{}", render::cost_table(&cost));
    let paused: Vec<&str> = cost
        .branches
        .iter()
        .filter(|b| b.state == forkfleet_shared::state::BranchState::Paused)
        .map(|b| b.label.as_str())
        .collect();
    if !paused.is_empty() {
        print!(
            "\n{}",
            render::paused_hint(id, &paused, cost.branches.len(), Some(&cost), coord.reach())
        );
    }
    Ok(())
}

/// Embedded: follow `forks` until nothing runs in them (resumed branches included).
pub(crate) async fn settle_resumed(
    coord: &Client,
    forks: &[ForkId],
    timeout_s: Option<u64>,
    json: bool,
) -> anyhow::Result<()> {
    let until = Until::Quiet {
        grace: RESUME_GRACE,
    };
    for id in forks {
        let view = coord.fork(*id).await?;
        if view.state.is_resolved() || view.settled() {
            continue;
        }
        // The fork directory follows what the resumed branches do.
        forkdir::follow(coord, *id, timeout_s.map(Duration::from_secs), until, !json).await?;
    }
    Ok(())
}

pub(crate) async fn fork_create(
    coord: &Client,
    loaded: &spec::LoadedSpec,
    from_run: Option<&str>,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<()> {
    let from = match from_run {
        Some(prefix) => Some(coord.find_run(prefix).await?),
        None => None,
    };
    let (view, from_text) = flow::create_fork(coord, loaded, from).await?;
    if !json {
        forkfleet_client::render::say(&format!(
            "fork {}: {} · {from_text}",
            view.fork_id,
            render::count(view.branches.len(), "branch", "branches")
        ));
    }
    // Embedded, the workers live in this process: the fork runs to the end here (or until
    // what is left waits, paused, for a top-up).
    let view = if coord.is_remote() {
        view
    } else {
        // The fork directory follows the fork live.
        forkdir::follow(coord, view.fork_id, timeout, AT_ONCE, !json).await?
    };
    if json {
        print_json(&render::fork_json(&view, None, None))?;
    } else {
        println!("{}", view.fork_id);
    }
    let waiting = render::approvals_hint(&view, coord.reach());
    if !coord.is_remote() && !waiting.is_empty() {
        return Err(anyhow::anyhow!("{}", waiting.trim_end()));
    }
    let paused = render::paused_labels(&view);
    if !coord.is_remote() && !paused.is_empty() {
        let cost = coord.fork_cost(view.fork_id).await.ok();
        return Err(anyhow::anyhow!(
            "{}",
            render::paused_hint(
                view.fork_id,
                &paused,
                view.branches.len(),
                cost.as_ref(),
                coord.reach()
            )
            .trim_end()
        ));
    }
    // Embedded, the fork ran here: a branch that failed is this command's failure.
    crate::cli::failed_branches(&view)
        .filter(|_| !coord.is_remote())
        .map_or(Ok(()), |failed| Err(failed.into()))
}

/// Where a merge is applied, and the git branch it is committed on.
pub(crate) struct MergeTarget<'a> {
    apply: Option<&'a Path>,
    /// `--git-branch NAME`: commit the winner on a new branch; no directory is applied to
    /// unless `--apply DIR` names one.
    git_branch: Option<&'a str>,
    no_apply: bool,
    overwrite: bool,
}

impl MergeTarget<'_> {
    /// The directory a merge of `view` is applied to (checked before the merge: a merge is
    /// final, and its result must land somewhere), and the conflict policy a flag asks for
    /// (`None`: the plan's `conflict_policy`).
    fn resolve(
        &self,
        view: &ForkView,
    ) -> anyhow::Result<(Option<PathBuf>, Option<ConflictPolicy>)> {
        let dir = if self.no_apply {
            None
        } else {
            match (self.apply, &view.workspace) {
                (Some(a), _) => Some(a.to_path_buf()),
                // A git branch alone leaves every directory alone.
                (None, _) if self.git_branch.is_some() => None,
                (None, Some(w)) => Some(PathBuf::from(w)),
                (None, None) => None,
            }
        };
        if let Some(d) = &dir {
            if !d.is_dir() {
                return Err(BadInput(format!(
                    "cannot apply the merge: `{}` is not a directory (pass --apply DIR or --no-apply)",
                    d.display()
                ))
                .into());
            }
        }
        let policy = self.overwrite.then_some(ConflictPolicy::Overwrite);
        Ok((dir, policy))
    }
}

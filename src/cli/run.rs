//! `forkfleet run`: a fork from a spec file, embedded, start to merge.

use super::*;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The fork spec (TOML). See docs/SPEC.md. Optional with --goal, --workspace, --model
    /// and --branch, which also override a spec's keys.
    pub spec: Option<PathBuf>,
    /// A name for the fork (overrides the spec's `name`): lists show it, and commands take
    /// it where a fork id goes (the newest fork of that name).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// The goal (overrides the spec's `goal`).
    #[arg(long, value_name = "TEXT")]
    pub goal: Option<String>,
    /// The workspace directory (overrides the spec's `workspace`; relative to the spec's
    /// directory with a spec, else to the current one).
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// The model, `provider:name` (overrides the spec's `model`).
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,
    /// A branch, `LABEL=STEER` (repeat; replaces the spec's branches). Without any, a spec
    /// with no branches runs one agent.
    #[arg(long = "branch", value_name = "LABEL=STEER")]
    pub branches: Vec<String>,
    /// Each branch's cap in USD (overrides the spec's `budget_usd`).
    #[arg(long, value_name = "USD", allow_hyphen_values = true)]
    pub budget_usd: Option<f64>,
    /// The fork's cap in USD (overrides the spec's `aggregate_budget_usd`).
    #[arg(long, value_name = "USD", allow_hyphen_values = true)]
    pub aggregate_budget_usd: Option<f64>,
    /// Merge this branch into the workspace when the fork settles.
    #[arg(long)]
    pub pick: Option<String>,
    /// The data directory (default: `.forkfleet/` next to the spec).
    #[arg(long, env = "FORKFLEET_DATA")]
    pub data: Option<PathBuf>,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
    /// In-process workers.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Branches each worker runs at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Give up waiting for the branches after this many seconds (they stay in the store).
    #[arg(long)]
    pub timeout_s: Option<u64>,
    /// A TOML config file (default: $FORKFLEET_CONFIG); `run` uses its `[pricing]`.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Check the spec and say what the workspace snapshot would hold and leave out (and
    /// why), reading no file's contents; nothing is run, uploaded or stored.
    #[arg(long)]
    pub dry_run: bool,
}

/// `--dry-run`: the spec is valid (loaded already), its real models are offered by
/// `workers` (the embedded system's catalogue; `None` on a cluster, whose coordinator
/// checks them against its live workers when the fork is created); what the snapshot of
/// its workspace would hold and leave out.
pub(crate) async fn dry_run(
    loaded: &spec::LoadedSpec,
    workers: Option<&forkfleet_shared::catalogue::Offer>,
    json: bool,
) -> anyhow::Result<()> {
    if let Some(offer) = workers {
        forkfleet_shared::catalogue::check_plan(
            &loaded.plan,
            forkfleet_shared::protocol::DEFAULT_POOL,
            std::slice::from_ref(offer),
        )
        .map_err(BadInput)?;
    }
    let listing =
        forkfleet_client::workspace::list_workspace(&loaded.workspace, &loaded.scan).await?;
    let labels: Vec<&str> = loaded
        .plan
        .branches
        .iter()
        .map(|b| b.label.as_str())
        .collect();
    let plan = &loaded.plan;
    if json {
        print_json(&serde_json::json!({
            "dry_run": true,
            "branches": labels,
            "plan": {
                "goal": plan.goal,
                "model": plan.model,
                "branches": plan.branches.iter().map(|b| serde_json::json!({
                    "label": b.label,
                    "model": b.model,
                    "steer": b.steer,
                    "budget_usd": b.budget_usd,
                    "max_turns": b.max_turns,
                    "approval": plan.approval_for(b),
                })).collect::<Vec<_>>(),
                "aggregate_budget_usd": plan.aggregate_budget_usd,
                "budget": plan.budget,
                "strategy": plan.resolve.strategy.as_str(),
                "judge_models": plan.resolve.judge_models,
                "test_command": plan.resolve.test.as_ref().map(|t| &t.argv),
                "max_turns": plan.limits.max_turns,
                "run_command": plan.tools.run_command.is_some(),
                "forking": plan.tools.forking,
                "tools": optional_tools(plan),
                "http_get": plan.tools.http_get,
            },
            "workspace": loaded.workspace.display().to_string(),
            "files": listing.files.len(),
            "bytes": listing.bytes(),
            "dirs": listing.dirs.len(),
            "exclude": loaded.scan.exclude,
            "respect_gitignore": loaded.scan.respect_gitignore,
            "left_out": listing.left_out,
        }))?;
    } else {
        println!(
            "spec ok: {} ({})",
            render::count(labels.len(), "branch", "branches"),
            labels.join(", ")
        );
        let width = labels.iter().map(|l| l.chars().count()).max().unwrap_or(5);
        for b in &plan.branches {
            println!(
                "  {:<width$}  {}  cap {}  max_turns {}{}  {}",
                b.label,
                b.model,
                b.budget_usd.map_or("none".to_string(), |u| format!("${u}")),
                b.max_turns,
                if plan.approval_for(b).is_some() {
                    "  approvals"
                } else {
                    ""
                },
                render::one_line(&b.steer, 60)
            );
        }
        println!(
            "fork cap {} · budget {} · resolve {}{}",
            plan.aggregate_budget_usd
                .map_or("none".to_string(), |u| format!("${u}")),
            plan.budget.mode.as_str(),
            plan.resolve.strategy.as_str(),
            if plan.resolve.judge_models.is_empty() {
                String::new()
            } else {
                format!(" (judges {})", plan.resolve.judge_models.join(", "))
            }
        );
        let mut tools = vec!["the standard ones".to_string()];
        tools.extend(
            optional_tools(plan)
                .into_iter()
                .map(|t| match &plan.tools.http_get {
                    Some(get) if t == "http_get" => {
                        format!("http_get (allow {})", get.allow.join(", "))
                    }
                    _ => t.to_string(),
                }),
        );
        println!("tools: {}", tools.join(", "));
        println!(
            "workspace {}: {}, {} would be snapshotted",
            loaded.workspace.display(),
            render::count(listing.files.len(), "file", "files"),
            forkfleet_shared::scan::human_bytes(listing.bytes())
        );
        println!("{}", listing.left_out.summary());
        println!("dry run: nothing was uploaded, created or run");
    }
    Ok(())
}

/// The tools beyond the standard ones the plan's agents are offered, in order.
fn optional_tools(plan: &forkfleet_shared::spec::ForkPlan) -> Vec<&'static str> {
    plan.tools
        .offered()
        .filter(|t| t.kind != forkfleet_shared::tools::ToolKind::Standard)
        .map(|t| t.name)
        .collect()
}

/// The spec `run` runs: the file (if any) with the flags' keys over it.
fn load_spec(
    args: &RunArgs,
    pricing: &std::collections::BTreeMap<String, forkfleet_shared::pricing::Price>,
) -> anyhow::Result<spec::LoadedSpec> {
    use toml::Value as V;
    let mut over = toml::Table::new();
    if let Some(n) = &args.name {
        over.insert("name".into(), V::String(n.clone()));
    }
    if let Some(g) = &args.goal {
        over.insert("goal".into(), V::String(g.clone()));
    }
    if let Some(w) = &args.workspace {
        over.insert("workspace".into(), V::String(w.display().to_string()));
    }
    if let Some(m) = &args.model {
        over.insert("model".into(), V::String(m.clone()));
    }
    if let Some(b) = args.budget_usd {
        over.insert("budget_usd".into(), V::Float(b));
    }
    if let Some(b) = args.aggregate_budget_usd {
        over.insert("aggregate_budget_usd".into(), V::Float(b));
    }
    if !args.branches.is_empty() {
        let mut list = Vec::new();
        for b in &args.branches {
            let Some((label, steer)) = b.split_once('=') else {
                return Err(BadInput(format!(
                    "--branch `{b}` is not LABEL=STEER (e.g. --branch fast=\"make the smallest change\")"
                ))
                .into());
            };
            let mut t = toml::Table::new();
            t.insert("label".into(), V::String(label.trim().to_string()));
            t.insert("steer".into(), V::String(steer.trim().to_string()));
            list.push(V::Table(t));
        }
        over.insert("branches".into(), V::Array(list));
    }
    if args.spec.is_none() {
        for (key, flag) in [
            ("goal", "--goal"),
            ("workspace", "--workspace"),
            ("model", "--model"),
        ] {
            if !over.contains_key(key) {
                return Err(BadInput(format!(
                    "no spec file and no {flag}: give a spec (`forkfleet run fork.toml`), or --goal, --workspace and --model (and --branch LABEL=STEER per branch)"
                ))
                .into());
            }
        }
    }
    Ok(spec::load_overridden(args.spec.as_deref(), over, pricing)?)
}

pub(crate) async fn cmd_run(args: RunArgs) -> anyhow::Result<()> {
    // Only the config's `[pricing]` matters here; the data dir is `--data` or next to the
    // spec, as always.
    let pricing = Config::load_pricing(args.config.as_deref(), &config::process_env)?;
    // The `[telemetry]` table was read before the command started; its errors show here.
    Config::load_telemetry(
        args.config.as_deref(),
        &config::process_env,
        Layer::default(),
    )?;
    let catalogue = Config::load_catalogue(args.config.as_deref(), &config::process_env)?;
    let loaded = load_spec(&args, &pricing)?;
    if args.dry_run {
        return dry_run(&loaded, Some(&catalogue.offer()), args.json).await;
    }
    if let Some(pick) = &args.pick {
        if !loaded.plan.branches.iter().any(|b| &b.label == pick) {
            return Err(BadInput(format!(
                "--pick `{pick}` is not a branch of this spec; branches: {}",
                labels(loaded.plan.branches.iter().map(|b| b.label.as_str()))
            ))
            .into());
        }
    }
    let data_dir = match (&args.data, &args.spec) {
        (Some(d), _) => d.clone(),
        (None, Some(spec)) => spec
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
            .join(".forkfleet"),
        (None, None) => PathBuf::from(".forkfleet"),
    };
    let opts = EmbeddedOptions {
        workers: args.workers.max(1),
        concurrency: args.concurrency.max(1),
        requeue_unfinished: false,
        catalogue: std::sync::Arc::new(catalogue),
        ..EmbeddedOptions::default()
    };
    let system = Embedded::start(&data_dir, opts).await?;
    let result = run_fork(&system, &loaded, &args).await;
    let shutdown = system.shutdown().await;
    result?;
    shutdown
}

/// Run the fork with the client's workflow ([`forkfleet_client::run::run_fork`]), then say
/// what happened: the branches, the diff, the resolve report and the merge, or what is
/// left to do.
async fn run_fork(
    system: &Embedded,
    loaded: &spec::LoadedSpec,
    args: &RunArgs,
) -> anyhow::Result<()> {
    let coord = system.client();
    let opts = flow::RunOptions {
        pick: args.pick.clone(),
        timeout: args.timeout_s.map(Duration::from_secs),
        show: !args.json,
    };
    let out = flow::run_fork(&coord, loaded, &opts).await?;
    let fork_id = out.view.fork_id;
    // Every command a hint prints runs as printed from any directory.
    let data_flag = coord.reach().to_string();
    if !out.solo_unresolved.is_empty() {
        // On stderr whatever the output format: the run did not do what it usually does.
        let open: Vec<String> = out.solo_unresolved.iter().map(ForkId::to_string).collect();
        forkfleet_client::render::say(&format!(
            "the agent left its fork(s) {} unresolved, so its work is not merged yet: resolve each (`forkfleet fork merge FORK --pick LABEL{data_flag}` or `fork abort`), then `forkfleet fork merge {fork_id} --pick {SOLO_LABEL}{data_flag}`",
            open.join(", "),
        ));
    }
    if args.json {
        let mut doc = render::fork_json(
            &out.view,
            Some(&out.diff),
            out.merge.as_ref().map(|(w, r)| (w.as_str(), r)),
        );
        if let Some(r) = &out.resolved {
            doc["resolve"] = fork::resolve::report_json(r);
        }
        print_json(&doc)?;
    } else {
        print!("{}", render::branch_table(&out.view));
        print!("{}", render::answers_text(&out.view));
        print!("{}", render::blocked_text(&out.view));
        println!();
        print!("{}", render::diff_text(&out.diff, false));
        if let Some(r) = &out.resolved {
            print!("{}", fork::resolve::report_text(&r.report, &data_flag));
        }
        match &out.merge {
            Some((winner, report)) => print!("{}", render::merge_text(winner, report)),
            None if out.paused.is_empty()
                && !out.view.state.is_resolved()
                && out.resolved.is_none()
                && render::awaiting_labels(&out.view).is_empty() =>
            {
                println!(
                "\nunresolved: merge a branch with\n  forkfleet fork merge {fork_id} --pick LABEL{data_flag}"
            )
            }
            None => {}
        }
    }
    if matches!(out.view.state, forkfleet_shared::state::ForkState::Aborted) {
        return Err(Incomplete::Failed(format!(
            "fork {fork_id} was aborted while it ran (`fork abort`, from another terminal or process): nothing was merged"
        ))
        .into());
    }
    if let Some(e) = out
        .resolved
        .as_ref()
        .and_then(|r| fork::resolve::failure(&r.report, &data_flag))
    {
        return Err(Incomplete::Failed(e).into());
    }
    let waiting = render::approvals_hint(&out.view, &data_flag);
    if out.merge.is_none() && !waiting.is_empty() {
        let picked = match &args.pick {
            Some(p) => {
                format!("--pick `{p}` waits for approval, not finished: nothing was merged; ")
            }
            None => String::new(),
        };
        return Err(Incomplete::Failed(format!(
            "{picked}{waiting}then merge a finished branch with `forkfleet fork merge {fork_id} --pick LABEL{data_flag}`"
        ))
        .into());
    }
    if out.merge.is_none() && !out.paused.is_empty() {
        let cost = coord.fork_cost(fork_id).await.ok();
        let refs: Vec<&str> = out.paused.iter().map(String::as_str).collect();
        let hint = render::paused_hint(
            fork_id,
            &refs,
            out.view.branches.len(),
            cost.as_ref(),
            &data_flag,
        );
        let picked = match &args.pick {
            Some(p) => format!("--pick `{p}` is paused, not finished: nothing was merged; "),
            None => String::new(),
        };
        return Err(Incomplete::Failed(format!(
            "{picked}{}then merge a finished branch with `forkfleet fork merge {fork_id} --pick LABEL{data_flag}`",
            hint
        ))
        .into());
    }
    if let Some(p) = &args.pick {
        if let Some((b, how)) = out
            .view
            .branch(p)
            .and_then(|b| Some((b, crate::cli::did_not_finish(b.state)?)))
        {
            return Err(Incomplete::Failed(format!(
                "--pick `{p}` {how} ({}): nothing was merged; its partial work stays in the fork: merge it anyway with `forkfleet fork merge {fork_id} --pick {p}{data_flag}`",
                b.error.as_deref().unwrap_or("no reason recorded")
            ))
            .into());
        }
    }
    if let Some((_, report)) = &out.merge {
        let again = crate::cli::reapply_command(out.view.fork_id, None, &data_flag);
        applied_in_full("the merge", report, Some(again))?;
    }
    crate::cli::failed_branches(&out.view).map_or(Ok(()), |failed| Err(failed.into()))
}

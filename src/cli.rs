//! The command line. Each command is a function from parsed arguments to an exit code:
//! 0 success, 1 failure, 2 bad input.

use crate::client;
use crate::embedded::{Embedded, EmbeddedOptions};
use crate::render;
use crate::BadInput;
use clap::{Args, Parser, Subcommand};
use forkfleet_coordinator::{CoordinatorError, CoordinatorHandle};
use forkfleet_shared::api::{CreateFork, ForkView, ParentRun};
use forkfleet_shared::diff::{DiffOptions, DiffReport};
use forkfleet_shared::flush::{ConflictPolicy, FlushReport};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::spec;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "forkfleet",
    version,
    about = "Fork one agent run into many branches, judge them, merge the winner."
)]
pub struct Cli {
    /// More logging on stderr (-v info, -vv debug). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a fork from a spec file on this machine (embedded coordinator and workers).
    Run(RunArgs),
    /// Inspect and resolve forks in a data directory.
    Fork {
        #[command(subcommand)]
        command: ForkCommand,
    },
    /// Print a run's event log.
    Log(LogArgs),
    /// Whole-system benchmarks.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

#[derive(Debug, Args)]
pub struct DataArgs {
    /// The data directory holding the run store.
    #[arg(long, env = "FORKFLEET_DATA", default_value = ".forkfleet")]
    pub data: PathBuf,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The fork spec (TOML). See docs/SPEC.md.
    pub spec: PathBuf,
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
}

#[derive(Debug, Subcommand)]
pub enum ForkCommand {
    /// List forks, newest first.
    Ls(DataArgs),
    /// Show a fork's branches: state, turns, cost.
    Show {
        /// Fork id (or a unique prefix of one).
        fork: String,
        #[command(flatten)]
        data: DataArgs,
    },
    /// Show what the branches changed and where they agree.
    Diff {
        fork: String,
        /// Only these paths (files or directories).
        #[arg(long = "path")]
        paths: Vec<String>,
        /// Print unified diffs, not only the summary.
        #[arg(long)]
        unified: bool,
        #[command(flatten)]
        data: DataArgs,
    },
    /// Merge a branch into the fork's parent and apply it to the workspace directory.
    Merge {
        fork: String,
        /// The winning branch's label.
        #[arg(long)]
        pick: String,
        /// Apply to this directory instead of the workspace the fork was made from.
        #[arg(long, conflicts_with = "no_apply")]
        apply: Option<PathBuf>,
        /// Merge in the store only; leave every directory alone.
        #[arg(long)]
        no_apply: bool,
        /// Overwrite files changed in the directory since the fork (default: keep them).
        #[arg(long)]
        overwrite: bool,
        #[command(flatten)]
        data: DataArgs,
    },
}

#[derive(Debug, Args)]
pub struct LogArgs {
    /// Run id.
    pub run: String,
    #[command(flatten)]
    pub data: DataArgs,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// N branches, each making K write_file calls then answering (the peer's fan-out work).
    Fanout(crate::bench::FanoutArgs),
}

pub fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Run a command; print its error; return the exit code.
pub async fn run(cli: Cli) -> u8 {
    let result = match cli.command {
        Command::Run(args) => cmd_run(args).await,
        Command::Fork { command } => cmd_fork(command).await,
        Command::Log(args) => cmd_log(args).await,
        Command::Bench { command } => match command {
            BenchCommand::Fanout(args) => crate::bench::cmd_fanout(args).await,
        },
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            let code = exit_code(&e);
            eprintln!("error: {}", render::error_chain(&e));
            code
        }
    }
}

fn exit_code(e: &anyhow::Error) -> u8 {
    for cause in e.chain() {
        if cause.is::<BadInput>() || cause.is::<spec::SpecError>() {
            return 2;
        }
        if let Some(c) = cause.downcast_ref::<CoordinatorError>() {
            return if c.is_bad_input() { 2 } else { 1 };
        }
    }
    1
}

async fn cmd_run(args: RunArgs) -> anyhow::Result<()> {
    let loaded = spec::load(&args.spec)?;
    if let Some(pick) = &args.pick {
        if !loaded.plan.branches.iter().any(|b| &b.label == pick) {
            return Err(BadInput(format!(
                "--pick `{pick}` is not a branch of this spec; branches: {}",
                labels(loaded.plan.branches.iter().map(|b| b.label.as_str()))
            ))
            .into());
        }
    }
    let data_dir = match &args.data {
        Some(d) => d.clone(),
        None => args
            .spec
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
            .join(".forkfleet"),
    };
    let opts = EmbeddedOptions {
        workers: args.workers.max(1),
        concurrency: args.concurrency.max(1),
    };
    let system = Embedded::start(&data_dir, opts).await?;
    let result = run_fork(&system, &loaded, &args).await;
    let shutdown = system.shutdown().await;
    result?;
    shutdown
}

async fn run_fork(
    system: &Embedded,
    loaded: &spec::LoadedSpec,
    args: &RunArgs,
) -> anyhow::Result<()> {
    let coord = system.coordinator();
    let blobs = system.bus.blobs();
    let (_, upload) = client::upload_workspace(
        blobs.as_ref(),
        &loaded.workspace,
        &loaded.exclude,
        loaded.blobs.clone(),
    )
    .await?;
    let view = coord
        .create_fork(CreateFork {
            plan: loaded.plan.clone(),
            parent: ParentRun::New,
            snapshot: upload.snapshot,
            workspace: Some(loaded.workspace.display().to_string()),
        })
        .await?;
    let fork_id = view.fork_id;
    if !args.json {
        eprintln!(
            "fork {fork_id}: {} branches · workspace {} ({} files, {} new blobs uploaded)",
            view.branches.len(),
            loaded.workspace.display(),
            upload.files,
            upload.blobs_sent
        );
    }
    let timeout = args.timeout_s.map(Duration::from_secs);
    let view = render::follow(&coord, fork_id, timeout, !args.json).await?;
    let diff = coord.diff(fork_id, DiffOptions::default()).await?;
    let merge = match &args.pick {
        Some(pick) => Some(
            merge_and_apply(
                &coord,
                system,
                fork_id,
                pick,
                Some(&loaded.workspace),
                loaded.plan.conflict_policy,
            )
            .await?,
        ),
        None => None,
    };
    let view = if merge.is_some() {
        coord.fork(fork_id).await?
    } else {
        view
    };
    if args.json {
        let doc = render::fork_json(
            &view,
            Some(&diff),
            merge.as_ref().map(|(w, r)| (w.as_str(), r)),
        );
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", render::branch_table(&view));
        println!();
        print!("{}", render::diff_text(&diff, false));
        match &merge {
            Some((winner, report)) => print!("{}", render::merge_text(winner, report)),
            None => println!(
                "\nunresolved: merge a branch with\n  forkfleet fork merge {fork_id} --pick LABEL --data {}",
                system.data_dir.display()
            ),
        }
    }
    Ok(())
}

/// Merge `pick` in the store, then apply it to `dir` (if any). Returns the winner and the
/// report of what happened to the directory (or to the parent's snapshot without one).
async fn merge_and_apply(
    coord: &CoordinatorHandle,
    system: &Embedded,
    fork_id: ForkId,
    pick: &str,
    dir: Option<&Path>,
    policy: ConflictPolicy,
) -> anyhow::Result<(String, FlushReport)> {
    let outcome = coord.merge(fork_id, pick).await?;
    let report = match dir {
        Some(dir) => {
            client::apply_merge(system.bus.blobs().as_ref(), &outcome, dir, policy).await?
        }
        None => outcome.report.clone(),
    };
    Ok((outcome.winner.clone(), report))
}

async fn open_store(data: &DataArgs) -> anyhow::Result<Embedded> {
    if !data.data.is_dir() {
        return Err(BadInput(format!(
            "data dir `{}` does not exist; pass --data DIR (forkfleet run keeps it in `.forkfleet/` next to the spec)",
            data.data.display()
        ))
        .into());
    }
    Embedded::start(
        &data.data,
        EmbeddedOptions {
            workers: 0,
            concurrency: 1,
        },
    )
    .await
}

async fn cmd_fork(command: ForkCommand) -> anyhow::Result<()> {
    match command {
        ForkCommand::Ls(data) => {
            let system = open_store(&data).await?;
            let forks = system.coordinator().forks().await;
            system.shutdown().await?;
            let forks = forks?;
            if data.json {
                let docs: Vec<_> = forks
                    .iter()
                    .map(|v| render::fork_json(v, None, None))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&docs)?);
            } else {
                print!("{}", render::fork_list(&forks));
            }
            Ok(())
        }
        ForkCommand::Show { fork, data } => {
            let system = open_store(&data).await?;
            let result = async {
                let coord = system.coordinator();
                let id = coord.find_fork(&fork).await?;
                Ok::<ForkView, anyhow::Error>(coord.fork(id).await?)
            }
            .await;
            system.shutdown().await?;
            let view = result?;
            if data.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&render::fork_json(&view, None, None))?
                );
            } else {
                print!("{}", render::fork_header(&view));
                print!("{}", render::branch_table(&view));
            }
            Ok(())
        }
        ForkCommand::Diff {
            fork,
            paths,
            unified,
            data,
        } => {
            let filter = paths
                .iter()
                .map(|p| WsPath::parse(p).map_err(|e| BadInput(format!("--path: {e}"))))
                .collect::<Result<Vec<_>, _>>()?;
            let system = open_store(&data).await?;
            let result = async {
                let coord = system.coordinator();
                let id = coord.find_fork(&fork).await?;
                let opts = DiffOptions {
                    paths: if filter.is_empty() {
                        None
                    } else {
                        Some(filter)
                    },
                    unified: unified || data.json,
                    ..DiffOptions::default()
                };
                Ok::<DiffReport, anyhow::Error>(coord.diff(id, opts).await?)
            }
            .await;
            system.shutdown().await?;
            let report = result?;
            if data.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&render::diff_json(&report, true))?
                );
            } else {
                print!("{}", render::diff_text(&report, unified));
            }
            Ok(())
        }
        ForkCommand::Merge {
            fork,
            pick,
            apply,
            no_apply,
            overwrite,
            data,
        } => {
            let system = open_store(&data).await?;
            let result = async {
                let coord = system.coordinator();
                let id = coord.find_fork(&fork).await?;
                let view = coord.fork(id).await?;
                let dir = if no_apply {
                    None
                } else {
                    match (&apply, &view.workspace) {
                        (Some(a), _) => Some(a.clone()),
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
                let policy = if overwrite {
                    ConflictPolicy::Overwrite
                } else {
                    ConflictPolicy::KeepParent
                };
                let merged =
                    merge_and_apply(&coord, &system, id, &pick, dir.as_deref(), policy).await?;
                let view = coord.fork(id).await?;
                Ok::<_, anyhow::Error>((view, merged))
            }
            .await;
            system.shutdown().await?;
            let (view, (winner, report)) = result?;
            if data.json {
                let doc = render::fork_json(&view, None, Some((winner.as_str(), &report)));
                println!("{}", serde_json::to_string_pretty(&doc)?);
            } else {
                print!("{}", render::merge_text(&winner, &report));
            }
            Ok(())
        }
    }
}

async fn cmd_log(args: LogArgs) -> anyhow::Result<()> {
    let run: RunId = args
        .run
        .parse()
        .map_err(|e: forkfleet_shared::ids::IdError| BadInput(e.to_string()))?;
    let system = open_store(&args.data).await?;
    let events = system.coordinator().run_events(run).await;
    system.shutdown().await?;
    let events = events?;
    if args.data.json {
        let docs: Vec<_> = events
            .iter()
            .map(|(seq, e)| serde_json::json!({"seq": seq, "event": e}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&docs)?);
    } else {
        for (seq, e) in &events {
            println!("{seq:>5}  {}", render::event_line(e));
        }
    }
    Ok(())
}

fn labels<'a>(it: impl Iterator<Item = &'a str>) -> String {
    it.collect::<Vec<_>>().join(", ")
}

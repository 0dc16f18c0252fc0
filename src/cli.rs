//! The command line. Each command is a function from parsed arguments to an exit code:
//! 0 success, 1 failure, 2 bad input.
//!
//! Client commands (`fork ...`, `account ...`, `workers`, `log`) talk to a [`Client`]: a
//! remote coordinator when a NATS URL is configured (`--nats`, `FORKFLEET_NATS_URL`, or
//! the `--config` file), else the embedded one over the run store in `--data`.

use crate::config::{self, Config, Layer, NatsLayer, TlsLayer};
use crate::embedded::{Embedded, EmbeddedOptions};
use crate::resolve_cmd;
use crate::service;
use clap::{Args, Parser, Subcommand};
use forkfleet_client::forkdir;
use forkfleet_client::render;
use forkfleet_client::watch::Until;
use forkfleet_client::workspace as ws;
use forkfleet_client::BadInput;
use forkfleet_client::{ApiClient, Client, ClientError};
use forkfleet_coordinator::CoordinatorError;
use forkfleet_shared::api::{CreateFork, ForkView, ParentRun};
use forkfleet_shared::budget::ForkCost;
use forkfleet_shared::diff::DiffOptions;
use forkfleet_shared::flush::{ConflictPolicy, FlushReport};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::now_ms;
use forkfleet_shared::resolve::Strategy;
use forkfleet_shared::spec::{self, SOLO_LABEL};
use forkfleet_shared::state::BranchState;
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
    /// Run the coordinator service of a cluster (NATS) until SIGINT or SIGTERM.
    Coordinator(CoordinatorArgs),
    /// Run a worker of a cluster (NATS) until SIGINT or SIGTERM, then drain.
    Worker(WorkerArgs),
    /// Create, inspect, stop and resolve forks (on a cluster with --nats, else in --data).
    Fork {
        #[command(subcommand)]
        command: ForkCommand,
    },
    /// Set and show the budget accounts forks charge (shared by every fork that names one).
    Account {
        #[command(subcommand)]
        command: AccountCommand,
    },
    /// List a cluster's live workers: id, pool, running branches, last heartbeat.
    Workers(ClusterArgs),
    /// Print a run's event log.
    Log(LogArgs),
    /// List, save and remove a run's checkpoints; rewind a run to one (its conversation,
    /// its workspace version and, with --apply, a directory); start a new run from one.
    Checkpoint {
        #[command(subcommand)]
        command: crate::checkpoint_cmd::CheckpointCommand,
    },
    /// Whole-system benchmarks.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

/// Where the configuration comes from and how to reach NATS. Every key also comes from a
/// `FORKFLEET_*` environment variable or the `--config` file (flags win; see
/// `docs/CLUSTER.md`). Secrets are taken from files only on the command line.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Configuration and cluster")]
pub struct ConfigArgs {
    /// A TOML config file (default: $FORKFLEET_CONFIG).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The NATS server of the cluster, e.g. nats://127.0.0.1:4222.
    #[arg(long, value_name = "URL")]
    pub nats: Option<String>,
    /// The NATS connection name (default: forkfleet-<role>).
    #[arg(long, value_name = "NAME")]
    pub nats_name: Option<String>,
    /// NATS user (with --nats-password-file).
    #[arg(long, value_name = "USER")]
    pub nats_user: Option<String>,
    /// A file holding the NATS password.
    #[arg(long, value_name = "FILE")]
    pub nats_password_file: Option<PathBuf>,
    /// A file holding the NATS token.
    #[arg(long, value_name = "FILE")]
    pub nats_token_file: Option<PathBuf>,
    /// A file holding the NATS nkey seed.
    #[arg(long, value_name = "FILE")]
    pub nats_nkey_seed_file: Option<PathBuf>,
    /// A NATS credentials file (JWT and nkey seed).
    #[arg(long, value_name = "FILE")]
    pub nats_creds: Option<PathBuf>,
    /// Extra CA certificates (PEM) to trust for the NATS server.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// The client certificate (PEM), with --tls-key.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Require TLS to the NATS server.
    #[arg(long)]
    pub tls_require: bool,
    /// Seconds a pulled task may go unacked before another worker gets it (default: 30;
    /// $FORKFLEET_NATS_ACK_WAIT_S). A cluster-wide setting: give every process the same.
    #[arg(long, value_name = "SECONDS")]
    pub nats_ack_wait_s: Option<u64>,
    /// Deliveries of a task before its branch is failed (default: 5;
    /// $FORKFLEET_NATS_MAX_DELIVER). A cluster-wide setting.
    #[arg(long, value_name = "N")]
    pub nats_max_deliver: Option<u32>,
    /// Print the effective configuration (secrets redacted) and exit.
    #[arg(long)]
    pub print_config: bool,
}

impl ConfigArgs {
    /// The flags as the top configuration layer.
    fn layer(&self) -> Layer {
        Layer {
            nats: NatsLayer {
                url: self.nats.clone(),
                name: self.nats_name.clone(),
                user: self.nats_user.clone(),
                password_file: self.nats_password_file.clone(),
                token_file: self.nats_token_file.clone(),
                nkey_seed_file: self.nats_nkey_seed_file.clone(),
                creds_file: self.nats_creds.clone(),
                ack_wait_s: self.nats_ack_wait_s,
                max_deliver: self.nats_max_deliver,
                tls: TlsLayer {
                    ca_file: self.tls_ca.clone(),
                    cert_file: self.tls_cert.clone(),
                    key_file: self.tls_key.clone(),
                    require: self.tls_require.then_some(true),
                },
                ..NatsLayer::default()
            },
            ..Layer::default()
        }
    }

    /// Resolve the configuration with `extra` flags (data, pool, ...) on top.
    fn load(&self, extra: Layer) -> Result<Config, config::ConfigError> {
        let mut flags = self.layer();
        flags.data = extra.data;
        flags.pool = extra.pool;
        flags.concurrency = extra.concurrency;
        flags.drain_grace_s = extra.drain_grace_s;
        Config::load(self.config.as_deref(), &config::process_env, flags)
    }
}

/// The arguments of a client command: where the forks are, and the output format.
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The data directory of the embedded store, when no NATS URL is configured
    /// (default: .forkfleet; $FORKFLEET_DATA).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub config: ConfigArgs,
}

impl ClientArgs {
    /// The configuration these arguments resolve to.
    fn load_config(&self) -> Result<Config, config::ConfigError> {
        self.config.load(Layer {
            data: self.data.clone(),
            ..Layer::default()
        })
    }
}

/// The arguments of a command that needs a cluster.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub config: ConfigArgs,
}

#[derive(Debug, Args)]
pub struct CoordinatorArgs {
    /// The data directory of the run store (default: .forkfleet; $FORKFLEET_DATA).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// The task queue branch tasks go to (default: default; $FORKFLEET_POOL).
    #[arg(long, value_name = "NAME")]
    pub pool: Option<String>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The task queue to pull from (default: default; $FORKFLEET_POOL).
    #[arg(long, value_name = "NAME")]
    pub pool: Option<String>,
    /// Branches run at once (default: 64; $FORKFLEET_CONCURRENCY).
    #[arg(long, value_name = "N")]
    pub concurrency: Option<usize>,
    /// On SIGTERM, seconds running branches get to finish before they are handed back
    /// (default: 30; $FORKFLEET_DRAIN_GRACE_S).
    #[arg(long, value_name = "SECONDS")]
    pub drain_grace_s: Option<u64>,
    #[command(flatten)]
    pub config: ConfigArgs,
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
    /// A TOML config file (default: $FORKFLEET_CONFIG); `run` uses its `[pricing]`.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum ForkCommand {
    /// Create a fork from a spec file and print its id.
    ///
    /// Uploads only the workspace blobs the store lacks. On a cluster it returns at once
    /// (follow with `fork watch`); embedded (no NATS URL) the fork runs here to the end,
    /// since no worker outlives the command.
    Create {
        /// The fork spec (TOML). See docs/SPEC.md.
        spec: PathBuf,
        /// Embedded only: give up waiting for the branches after this many seconds.
        #[arg(long)]
        timeout_s: Option<u64>,
        /// Fork this existing root run (id or unique prefix) as it is now: its conversation
        /// and its workspace version (a run merged into, or made by `checkpoint fork`),
        /// instead of a new run from the spec's goal and workspace directory.
        #[arg(long, value_name = "RUN")]
        from_run: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List forks, newest first.
    Ls(ClientArgs),
    /// Show a fork's branches: state, turns, cost.
    Show {
        /// Fork id (or a unique prefix of one).
        fork: String,
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
        #[command(flatten)]
        client: ClientArgs,
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
        client: ClientArgs,
    },
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
    MoveBudget {
        /// Fork id (or a unique prefix of one).
        fork: String,
        /// The branch giving cap (it keeps at least what it spent and holds).
        #[arg(long, value_name = "LABEL")]
        from: String,
        /// The branch receiving it.
        #[arg(long, value_name = "LABEL")]
        to: String,
        /// How much to move, in USD (finite, greater than 0).
        #[arg(long, value_name = "USD", value_parser = parse_usd, allow_hyphen_values = true)]
        usd: f64,
        /// Embedded only: give up waiting for the resumed branch after this many seconds.
        #[arg(long)]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Resolve a fork: run the spec's test command on every branch's tree (on workers), ask
    /// the judge(s), and decide by the strategy; a commit merges the winner and applies it
    /// to the workspace directory. Prints the tests, each verdict with its confidence, and
    /// the decision.
    ///
    /// Embedded (no NATS URL), unfinished branches run here first, then the tests and
    /// judges run on in-process workers.
    Resolve {
        /// Fork id (or a unique prefix of one).
        fork: String,
        /// Override the spec's strategy: manual, auto, auto_with_fallback, vote.
        #[arg(long, value_name = "NAME")]
        strategy: Option<String>,
        /// auto_with_fallback's threshold in [0, 1] (default 0.80).
        #[arg(long, value_name = "X", allow_hyphen_values = true)]
        threshold: Option<f64>,
        /// Apply a merge to this directory instead of the workspace the fork was made from.
        #[arg(long, conflicts_with = "no_apply")]
        apply: Option<PathBuf>,
        /// Merge in the store only; leave every directory alone.
        #[arg(long)]
        no_apply: bool,
        /// Overwrite files changed in the directory since the fork (default: keep them).
        #[arg(long)]
        overwrite: bool,
        /// Embedded only: give up waiting for unfinished branches after this many seconds.
        #[arg(long)]
        timeout_s: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Open the fork directory in a diff tool: the parent against each branch that
    /// changed something (at PATH, when given).
    ///
    /// Syncs `<workspace>/.forkfleet/forks/<fork>/` first, then launches
    /// $FORKFLEET_DIFFTOOL (a template with {parent} and {branches}), else PyCharm (a
    /// 3-way diff), else VS Code (`code --diff`, pairwise), else prints a unified diff.
    Open {
        /// Fork id (or a unique prefix of one).
        fork: String,
        /// A workspace-relative path the fork touched (default: the whole directories).
        path: Option<String>,
        /// Colour the terminal diff.
        #[arg(long, value_enum, default_value_t = forkdir::ColorChoice::Auto)]
        color: forkdir::ColorChoice,
        #[command(flatten)]
        client: ClientArgs,
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
        client: ClientArgs,
    },
}

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

/// `--usd`: a finite amount greater than 0.
fn parse_usd(s: &str) -> Result<f64, String> {
    parse_amount(s, false, "a finite amount of USD greater than 0, e.g. 0.5")
}

/// `--cap`: a finite amount of 0 or more.
fn parse_cap(s: &str) -> Result<f64, String> {
    parse_amount(
        s,
        true,
        "a finite cap in USD of 0 or more, e.g. 25 (or --no-cap)",
    )
}

/// A finite number above 0 (or of 0 or more with `zero_ok`); `valid` says what is.
fn parse_amount(s: &str, zero_ok: bool, valid: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number; give {valid}"))?;
    let ok = v.is_finite() && if zero_ok { v >= 0.0 } else { v > 0.0 };
    if !ok {
        return Err(format!("{v} is not valid; give {valid}"));
    }
    Ok(v)
}

#[derive(Debug, Args)]
pub struct LogArgs {
    /// Run id.
    pub run: String,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// N branches, each making K write_file calls then answering (the peer's fan-out work),
    /// embedded (`--bus local`) or on a cluster of its own (`--bus nats`).
    Fanout(crate::bench::FanoutArgs),
    /// The peer's aggregate-cap table: 100 branches under caps of 10%, 25% and 50% of their
    /// uncapped spend, in strict and best-effort mode; true spend against each cap.
    Budget(crate::bench::budget::BudgetArgs),
}

/// The process's subscriber: log lines on stderr, and an OpenTelemetry layer.
///
/// - **Logs**: filtered by `RUST_LOG`, else by `-v` (warn, info, debug).
/// - **Traces**: forkfleet's own spans at info and above, whatever the log filter, get
///   OpenTelemetry trace and span ids from an SDK tracer (sampled unless a remote parent
///   says otherwise), so trace context propagates over the bus: tasks carry the
///   `fork.create` span's `traceparent` and branch spans hang under it
///   (`forkfleet_shared::trace`). Events and other crates' spans (ractor's `Actor`, ...)
///   stay out of it. There is no exporter yet, so nothing leaves the process: spans are
///   dropped as they end and the provider has no thread or buffer to flush at exit.
pub fn init_tracing(verbose: u8) {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;

    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let provider = SdkTracerProvider::builder()
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
        .build();
    // The tracer keeps the provider alive for the life of the process.
    let traces = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("forkfleet"))
        .with_threads(false)
        .with_filter(
            tracing_subscriber::filter::filter_fn(|meta| {
                meta.is_span()
                    && *meta.level() <= tracing::Level::INFO
                    && meta.target().starts_with("forkfleet")
            })
            // Without the hint, `log` records (sled's trace logging) would all be converted
            // and dispatched only to be dropped.
            .with_max_level_hint(tracing::Level::INFO),
        );
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init();
}

/// Run a command; print its error; return the exit code.
pub async fn run(cli: Cli) -> u8 {
    let result = match cli.command {
        Command::Run(args) => cmd_run(args).await,
        Command::Coordinator(args) => cmd_coordinator(args).await,
        Command::Worker(args) => cmd_worker(args).await,
        Command::Fork { command } => cmd_fork(command).await,
        Command::Account { command } => cmd_account(command).await,
        Command::Workers(args) => cmd_workers(args).await,
        Command::Log(args) => cmd_log(args).await,
        Command::Checkpoint { command } => cmd_checkpoint(command).await,
        Command::Bench { command } => match command {
            BenchCommand::Fanout(args) => crate::bench::cmd_fanout(args).await,
            BenchCommand::Budget(args) => crate::bench::budget::cmd_budget(args).await,
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
        if cause.is::<BadInput>()
            || cause.is::<spec::SpecError>()
            || cause.is::<config::ConfigError>()
        {
            return 2;
        }
        if let Some(c) = cause.downcast_ref::<CoordinatorError>() {
            return if c.is_bad_input() { 2 } else { 1 };
        }
        if let Some(c) = cause.downcast_ref::<ClientError>() {
            return if c.is_bad_input() { 2 } else { 1 };
        }
    }
    1
}

// ---- services ------------------------------------------------------------------------

async fn cmd_coordinator(args: CoordinatorArgs) -> anyhow::Result<()> {
    let config = args.config.load(Layer {
        data: args.data,
        pool: args.pool,
        ..Layer::default()
    })?;
    if args.config.print_config {
        print!("{}", config.render());
        return Ok(());
    }
    service::run_coordinator(&config, service::shutdown_signal()).await
}

async fn cmd_worker(args: WorkerArgs) -> anyhow::Result<()> {
    let config = args.config.load(Layer {
        pool: args.pool,
        concurrency: args.concurrency,
        drain_grace_s: args.drain_grace_s,
        ..Layer::default()
    })?;
    if args.config.print_config {
        print!("{}", config.render());
        return Ok(());
    }
    service::run_worker(&config, service::shutdown_signal()).await
}

// ---- client sessions -----------------------------------------------------------------

/// A client's connection to a coordinator: remote, or embedded over a data dir (then the
/// embedded system must be shut down after the command, which [`Session::close`] does).
struct Session {
    client: Client,
    embedded: Option<Embedded>,
}

/// What an embedded session needs.
enum Local {
    /// Only read or resolve forks: the data dir must exist, no workers.
    Read,
    /// Create and run forks here: in-process workers.
    Run,
    /// Resume paused branches of existing forks: the data dir must exist; in-process
    /// workers run what is resumed.
    Resume,
}

impl Session {
    /// Connect as `args` configure. Returns `None` after `--print-config`.
    async fn open(args: &ClientArgs, local: Local) -> anyhow::Result<Option<Session>> {
        let config = args.load_config()?;
        Self::connect(args, &config, local).await
    }

    /// [`Session::open`] with the configuration already loaded.
    async fn connect(
        args: &ClientArgs,
        config: &Config,
        local: Local,
    ) -> anyhow::Result<Option<Session>> {
        if args.config.print_config {
            print!("{}", config.render());
            return Ok(None);
        }
        if let Some(nats) = config.nats_config("forkfleet-client") {
            let bus = service::connect_nats(nats).await?;
            return Ok(Some(Session {
                client: Client::remote(bus),
                embedded: None,
            }));
        }
        let data = &config.data.value;
        let opts = match local {
            Local::Read | Local::Resume => {
                if !data.is_dir() {
                    return Err(BadInput(format!(
                        "data dir `{}` does not exist; pass --data DIR (forkfleet run keeps it in `.forkfleet/` next to the spec), or --nats URL for a cluster",
                        data.display()
                    ))
                    .into());
                }
                if matches!(local, Local::Resume) {
                    // What a stopped process left unfinished runs here too.
                    EmbeddedOptions {
                        requeue_unfinished: true,
                        ..EmbeddedOptions::default()
                    }
                } else {
                    EmbeddedOptions {
                        workers: 0,
                        concurrency: 1,
                        requeue_unfinished: false,
                    }
                }
            }
            Local::Run => EmbeddedOptions::default(),
        };
        let system = Embedded::start(data, opts).await?;
        Ok(Some(Session {
            client: system.client(),
            embedded: Some(system),
        }))
    }

    async fn close(self) -> anyhow::Result<()> {
        match self.embedded {
            Some(system) => system.shutdown().await,
            None => Ok(()),
        }
    }
}

/// Run `body` against the session `args` configure, then close it (the body's error
/// first).
macro_rules! with_session {
    ($args:expr, $local:expr, |$client:ident| $body:expr) => {
        with_session!(@open Session::open($args, $local), |$client| $body)
    };
    (@open $open:expr, |$client:ident| $body:expr) => {{
        match $open.await? {
            None => Ok(()),
            Some(session) => {
                let result = {
                    let $client = &session.client;
                    $body.await
                };
                let closed = session.close().await;
                result.and(closed)
            }
        }
    }};
}

fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

// ---- forkfleet run -------------------------------------------------------------------

async fn cmd_run(args: RunArgs) -> anyhow::Result<()> {
    // Only the config's `[pricing]` matters here; the data dir is `--data` or next to the
    // spec, as always.
    let pricing = Config::load_pricing(args.config.as_deref(), &config::process_env)?;
    let loaded = spec::load_with(&args.spec, &pricing)?;
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
        requeue_unfinished: false,
    };
    let system = Embedded::start(&data_dir, opts).await?;
    let result = run_fork(&system, &loaded, &args).await;
    let shutdown = system.shutdown().await;
    result?;
    shutdown
}

/// Nothing is left to wait for once every branch has finished or is paused: an embedded
/// run's paused branches wait for a top-up, which only a later command can give.
const AT_ONCE: Until = Until::Quiet {
    grace: Duration::ZERO,
};
/// After a top-up resumed branches, how long a fork may still look quiet (the resumed
/// branches stay `paused` until a worker takes them).
const RESUME_GRACE: Duration = Duration::from_secs(2);

/// Whether a single agent run's work is merged into the workspace: when its agent is
/// `done` and left no fork of its own unresolved (then it says which, and how to finish).
async fn solo_merge(
    coord: &Client,
    view: &ForkView,
    data_dir: &Path,
) -> anyhow::Result<Option<&'static str>> {
    let Some(agent) = view.branch(SOLO_LABEL) else {
        return Ok(None);
    };
    if agent.state != BranchState::Done {
        return Ok(None);
    }
    let open: Vec<String> = coord
        .forks()
        .await?
        .into_iter()
        .filter(|f| f.parent_run == agent.run_id && !f.state.is_resolved())
        .map(|f| f.fork_id.to_string())
        .collect();
    if open.is_empty() {
        return Ok(Some(SOLO_LABEL));
    }
    // On stderr whatever the output format: the run did not do what it usually does.
    eprintln!(
        "the agent left its fork(s) {} unresolved, so its work is not merged yet: resolve each (`forkfleet fork merge FORK --pick LABEL --data {dir}` or `fork abort`), then `forkfleet fork merge {} --pick {SOLO_LABEL} --data {dir}`",
        open.join(", "),
        view.fork_id,
        dir = data_dir.display()
    );
    Ok(None)
}

async fn run_fork(
    system: &Embedded,
    loaded: &spec::LoadedSpec,
    args: &RunArgs,
) -> anyhow::Result<()> {
    let coord = system.client();
    let view = create(&coord, loaded, !args.json).await?;
    let fork_id = view.fork_id;
    let timeout = args.timeout_s.map(Duration::from_secs);
    // The fork directory follows the fork live.
    let view = forkdir::follow(&coord, fork_id, timeout, AT_ONCE, !args.json).await?;
    let diff = coord.diff(fork_id, DiffOptions::default()).await?;
    let paused: Vec<String> = render::paused_labels(&view)
        .into_iter()
        .map(str::to_string)
        .collect();
    // A single agent run merges its agent's work once the agent is done.
    let solo_pick = if loaded.plan.solo && args.pick.is_none() {
        solo_merge(&coord, &view, &system.data_dir).await?
    } else {
        None
    };
    let requested = args.pick.as_deref().or(solo_pick);
    // With branches paused, merge only a pick that has finished.
    let pick = requested
        .filter(|p| paused.is_empty() || view.branch(p).is_some_and(|b| b.state.is_terminal()));
    let merge = match pick {
        Some(pick) => Some(
            merge_and_apply(
                &coord,
                fork_id,
                pick,
                Some(&loaded.workspace),
                loaded.plan.conflict_policy,
            )
            .await?,
        ),
        None => None,
    };
    // Without a pick, the spec's resolve path: tests and judges when it has any.
    let plan_resolves =
        loaded.plan.resolve.strategy.needs_judge() || loaded.plan.resolve.test.is_some();
    let resolved = if requested.is_none() && paused.is_empty() && plan_resolves && !loaded.plan.solo
    {
        Some(
            resolve_cmd::resolve_and_apply(
                &coord,
                fork_id,
                None,
                Some(&loaded.workspace),
                loaded.plan.conflict_policy,
            )
            .await?,
        )
    } else {
        None
    };
    if resolved.as_ref().is_some_and(|r| r.report.merge.is_some()) {
        forkdir::cleanup_after_merge(&coord, fork_id).await;
    }
    let merge = match (merge, &resolved) {
        (Some(m), _) => Some(m),
        (None, Some(r)) => match (&r.report.merge, &r.applied) {
            (Some(outcome), Some(applied)) => Some((outcome.winner.clone(), applied.clone())),
            _ => None,
        },
        (None, None) => None,
    };
    let view = if merge.is_some() {
        coord.fork(fork_id).await?
    } else {
        view
    };
    let data_flag = format!(" --data {}", system.data_dir.display());
    if args.json {
        let mut doc = render::fork_json(
            &view,
            Some(&diff),
            merge.as_ref().map(|(w, r)| (w.as_str(), r)),
        );
        if let Some(r) = &resolved {
            doc["resolve"] = resolve_cmd::report_json(r);
        }
        print_json(&doc)?;
    } else {
        print!("{}", render::branch_table(&view));
        println!();
        print!("{}", render::diff_text(&diff, false));
        if let Some(r) = &resolved {
            print!("{}", resolve_cmd::report_text(&r.report));
        }
        match &merge {
            Some((winner, report)) => print!("{}", render::merge_text(winner, report)),
            None if paused.is_empty() && resolved.is_none() => println!(
                "\nunresolved: merge a branch with\n  forkfleet fork merge {fork_id} --pick LABEL{data_flag}"
            ),
            None => {}
        }
    }
    if let Some(e) = resolved
        .as_ref()
        .and_then(|r| resolve_cmd::failure(&r.report))
    {
        return Err(anyhow::anyhow!("{e}"));
    }
    if merge.is_none() && !paused.is_empty() {
        let cost = coord.fork_cost(fork_id).await.ok();
        let refs: Vec<&str> = paused.iter().map(String::as_str).collect();
        let hint = render::paused_hint(
            fork_id,
            &refs,
            view.branches.len(),
            cost.as_ref(),
            &data_flag,
        );
        let picked = match &args.pick {
            Some(p) => format!("--pick `{p}` is paused, not finished: nothing was merged; "),
            None => String::new(),
        };
        return Err(anyhow::anyhow!(
            "{picked}{}then merge a finished branch with `forkfleet fork merge {fork_id} --pick LABEL{data_flag}`",
            hint
        ));
    }
    Ok(())
}

/// Upload the spec's workspace (only the blobs the store lacks) and create the fork.
async fn create(coord: &Client, loaded: &spec::LoadedSpec, show: bool) -> anyhow::Result<ForkView> {
    create_from(coord, loaded, None, show).await
}

/// [`create`], forking the existing root run `from` (its conversation and workspace
/// version) when given; the spec's scripts are uploaded either way.
async fn create_from(
    coord: &Client,
    loaded: &spec::LoadedSpec,
    from: Option<RunId>,
    show: bool,
) -> anyhow::Result<ForkView> {
    let blobs = coord.blobs();
    let (parent, snapshot, from_text) = match from {
        Some(run_id) => {
            let snapshot = coord.run_workspace(run_id).await?;
            for (hash, bytes) in &loaded.blobs {
                blobs.put(*hash, bytes.clone()).await?;
            }
            (
                ParentRun::Existing { run_id },
                snapshot,
                format!("from run {run_id}"),
            )
        }
        None => {
            let (_, upload) = ws::upload_workspace(
                blobs.as_ref(),
                &loaded.workspace,
                &loaded.exclude,
                loaded.blobs.clone(),
            )
            .await?;
            (
                ParentRun::New,
                upload.snapshot,
                format!(
                    "workspace {} ({} files, {} new blobs uploaded)",
                    loaded.workspace.display(),
                    upload.files,
                    upload.blobs_sent
                ),
            )
        }
    };
    let view = coord
        .call(CreateFork {
            plan: loaded.plan.clone(),
            parent,
            snapshot,
            workspace: Some(loaded.workspace.display().to_string()),
        })
        .await?;
    if show {
        eprintln!(
            "fork {}: {} branches · {from_text}",
            view.fork_id,
            view.branches.len()
        );
    }
    Ok(view)
}

/// Merge `pick` in the store, then apply it to `dir` (if any). Returns the winner and the
/// report of what happened to the directory (or to the parent's snapshot without one).
async fn merge_and_apply(
    coord: &Client,
    fork_id: ForkId,
    pick: &str,
    dir: Option<&Path>,
    policy: ConflictPolicy,
) -> anyhow::Result<(String, FlushReport)> {
    let outcome = coord.merge(fork_id, pick).await?;
    let report = match dir {
        // A fork an agent made merges into its branch, not into a directory.
        Some(dir) if !outcome.into_branch => {
            ws::apply_merge(coord.blobs().as_ref(), &outcome, dir, policy).await?
        }
        _ => outcome.report.clone(),
    };
    // The fork is resolved: its fork directory goes unless `keep_artifacts`.
    forkdir::cleanup_after_merge(coord, fork_id).await;
    Ok((outcome.winner.clone(), report))
}

// ---- forkfleet fork ... --------------------------------------------------------------

async fn cmd_fork(command: ForkCommand) -> anyhow::Result<()> {
    match command {
        ForkCommand::Create {
            spec: spec_path,
            timeout_s,
            from_run,
            client,
        } => {
            // Validate the spec before connecting: bad input creates nothing anywhere.
            let config = client.load_config()?;
            let loaded = spec::load_with(&spec_path, &config.pricing)?;
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
        ForkCommand::Ls(client) => with_session!(&client, Local::Read, |coord| async {
            let forks = coord.forks().await?;
            if client.json {
                let docs: Vec<_> = forks
                    .iter()
                    .map(|v| render::fork_json(v, None, None))
                    .collect();
                print_json(&serde_json::Value::Array(docs))
            } else {
                print!("{}", render::fork_list(&forks));
                Ok(())
            }
        }),
        ForkCommand::Show { fork, client } => {
            with_session!(&client, Local::Read, |coord| async {
                let id = coord.find_fork(&fork).await?;
                let view = coord.fork(id).await?;
                print_view(&view, client.json)
            })
        }
        // Embedded, watching also runs what a stopped process left unfinished.
        ForkCommand::Watch {
            fork,
            timeout_s,
            client,
        } => with_session!(&client, Local::Resume, |coord| async {
            let id = coord.find_fork(&fork).await?;
            // Embedded, branches a stopped process left pending or running were enqueued
            // again when this session started and its workers run them; paused ones wait
            // for a top-up, which nothing can give while this process holds the store, so
            // the watch ends once nothing runs. On a cluster another client may top up:
            // it waits for every branch to finish.
            let until = if coord.is_remote() {
                Until::Finished
            } else {
                AT_ONCE
            };
            let timeout = timeout_s.map(Duration::from_secs);
            // The fork directory follows the fork live.
            let view = forkdir::follow(coord, id, timeout, until, !client.json).await?;
            print_view(&view, client.json)
        }),
        ForkCommand::Diff {
            fork,
            paths,
            unified,
            client,
        } => {
            let filter = paths
                .iter()
                .map(|p| WsPath::parse(p).map_err(|e| BadInput(format!("--path: {e}"))))
                .collect::<Result<Vec<_>, _>>()?;
            with_session!(&client, Local::Read, |coord| async {
                let id = coord.find_fork(&fork).await?;
                let opts = DiffOptions {
                    paths: if filter.is_empty() {
                        None
                    } else {
                        Some(filter)
                    },
                    unified: unified || client.json,
                    ..DiffOptions::default()
                };
                let report = coord.diff(id, opts).await?;
                if client.json {
                    print_json(&render::diff_json(&report, true))
                } else {
                    print!("{}", render::diff_text(&report, unified));
                    Ok(())
                }
            })
        }
        ForkCommand::Terminate {
            fork,
            label,
            client,
        } => with_session!(&client, Local::Read, |coord| async {
            let id = coord.find_fork(&fork).await?;
            let outcome = coord.terminate(id, &label).await?;
            if client.json {
                print_json(&render::terminate_json(&outcome))
            } else {
                print!("{}", render::terminate_text(&outcome));
                Ok(())
            }
        }),
        ForkCommand::Abort { fork, client } => {
            with_session!(&client, Local::Read, |coord| async {
                let id = coord.find_fork(&fork).await?;
                let outcome = coord.abort(id).await?;
                if client.json {
                    print_json(&render::abort_json(&outcome))
                } else {
                    print!("{}", render::abort_text(&outcome));
                    Ok(())
                }
            })
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
        ForkCommand::Cost { fork, client } => {
            with_session!(&client, Local::Read, |coord| async {
                let id = coord.find_fork(&fork).await?;
                let cost = coord.fork_cost(id).await?;
                print_cost(&cost, client.json)
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
            with_session!(&client, Local::Resume, |coord| async {
                let id = coord.find_fork(&fork).await?;
                let cost = coord.topup(id, branch.clone(), usd).await?;
                let what = match &branch {
                    Some(b) => format!("branch `{b}`'s cap"),
                    None => "the fork's cap".to_string(),
                };
                let done = format!("raised {what} by ${usd:.6}");
                after_resume(coord, cost, &done, timeout_s, client.json).await
            })
        }
        ForkCommand::MoveBudget {
            fork,
            from,
            to,
            usd,
            timeout_s,
            client,
        } => {
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
        ForkCommand::Resolve {
            fork,
            strategy,
            threshold,
            apply,
            no_apply,
            overwrite,
            timeout_s,
            client,
        } => {
            let strategy = resolve_cmd::strategy_from_flags(strategy.as_deref(), threshold)
                .map_err(BadInput)?;
            with_session!(&client, Local::Resume, |coord| fork_resolve(
                coord,
                &fork,
                strategy,
                MergeTarget {
                    apply: apply.as_deref(),
                    no_apply,
                    overwrite
                },
                timeout_s.map(Duration::from_secs),
                client.json
            ))
        }
        ForkCommand::Open {
            fork,
            path,
            color,
            client,
        } => with_session!(&client, Local::Read, |coord| async {
            let id = coord.find_fork(&fork).await?;
            forkdir::open(coord, id, path.as_deref(), color, client.json).await
        }),
        ForkCommand::Merge {
            fork,
            pick,
            apply,
            no_apply,
            overwrite,
            client,
        } => with_session!(&client, Local::Read, |coord| fork_merge(
            coord,
            &fork,
            &pick,
            MergeTarget {
                apply: apply.as_deref(),
                no_apply,
                overwrite
            },
            client.json
        )),
    }
}

fn print_view(view: &ForkView, json: bool) -> anyhow::Result<()> {
    if json {
        print_json(&render::fork_json(view, None, None))
    } else {
        print!("{}", render::fork_header(view));
        print!("{}", render::branch_table(view));
        let paused = render::paused_labels(view);
        if !paused.is_empty() && !view.state.is_resolved() {
            print!(
                "\n{}",
                render::paused_hint(view.fork_id, &paused, view.branches.len(), None, "")
            );
        }
        Ok(())
    }
}

fn print_cost(cost: &ForkCost, json: bool) -> anyhow::Result<()> {
    if json {
        print_json(&render::to_json(cost)?)
    } else {
        print!("{}", render::cost_table(cost));
        Ok(())
    }
}

/// After a cap change: embedded, run what it resumed here until nothing runs (no worker
/// outlives the command), then report the fork's cost; on a cluster, report at once.
async fn after_resume(
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
            render::paused_hint(id, &paused, cost.branches.len(), Some(&cost), "")
        );
    }
    Ok(())
}

/// Embedded: follow `forks` until nothing runs in them (resumed branches included).
async fn settle_resumed(
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

/// The label and message of `fork steer` and `fork continue`, checked before connecting.
fn check_turn_args(label: &str, message: &str) -> anyhow::Result<()> {
    spec::check_label(label).map_err(|e| BadInput(format!("LABEL: {e}")))?;
    if message.trim().is_empty() {
        return Err(BadInput("MESSAGE is empty; give the text to send the branch".into()).into());
    }
    Ok(())
}

async fn fork_steer(
    coord: &Client,
    fork: &str,
    label: &str,
    message: &str,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let outcome = coord.steer(id, label, message).await?;
    if json {
        print_json(&render::steer_json(&outcome))?;
    } else {
        print!("{}", render::steer_text(&outcome));
    }
    // Embedded, the steered branch runs in this process: until nothing runs.
    if !coord.is_remote() {
        forkdir::follow(coord, id, timeout, AT_ONCE, !json).await?;
    }
    Ok(())
}

/// Start a new turn of a finished branch; wait for it (embedded always, on a cluster with
/// `wait`) and show how it ended with its final text.
async fn fork_continue(
    coord: &Client,
    fork: &str,
    label: &str,
    message: &str,
    wait: bool,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let outcome = coord.continue_branch(id, label, message).await?;
    if !wait && coord.is_remote() {
        if json {
            return print_json(&render::continue_json(&outcome, None));
        }
        print!("{}", render::continue_text(&outcome));
        println!("follow it with `forkfleet fork watch {id}`, or wait with `fork continue --wait`");
        return Ok(());
    }
    if !json {
        print!("{}", render::continue_text(&outcome));
    }
    let view = if coord.is_remote() {
        wait_for_branch(coord, id, label, timeout).await?
    } else {
        // Embedded, the workers live in this process: the turn runs here to its end (the
        // fork directory follows it).
        forkdir::follow(coord, id, timeout, AT_ONCE, !json).await?
    };
    let Some(branch) = view.branch(label) else {
        return Err(anyhow::anyhow!(
            "fork {id} has no branch `{label}` any more"
        ));
    };
    let events = coord.run_events(outcome.run_id).await?;
    let text = events
        .iter()
        .filter(|e| e.seq > outcome.seq)
        .filter_map(|e| match &e.event {
            forkfleet_shared::event::Event::ModelResponse {
                text: Some(text), ..
            } => Some(text.as_str()),
            _ => None,
        })
        .next_back();
    let end = render::TurnEnd { branch, text };
    if json {
        print_json(&render::continue_json(&outcome, Some(&end)))?;
    } else {
        print!("{}", render::turn_end_text(&end));
    }
    if branch.state == forkfleet_shared::state::BranchState::Paused {
        let cost = coord.fork_cost(id).await.ok();
        return Err(anyhow::anyhow!(
            "{}",
            render::paused_hint(id, &[label], view.branches.len(), cost.as_ref(), "").trim_end()
        ));
    }
    Ok(())
}

/// Follow fork `id` until branch `label` has finished or paused (or the fork was merged or
/// aborted), giving up after `timeout`.
async fn wait_for_branch(
    coord: &Client,
    id: ForkId,
    label: &str,
    timeout: Option<Duration>,
) -> anyhow::Result<ForkView> {
    const ROUND: Duration = Duration::from_secs(10);
    let started = std::time::Instant::now();
    let mut seen = None;
    loop {
        let wait = timeout.map_or(ROUND, |t| t.saturating_sub(started.elapsed()).min(ROUND));
        let watched = coord.watch(id, seen, wait).await?;
        seen = Some(watched.version);
        let Some(b) = watched.view.branch(label) else {
            return Err(anyhow::anyhow!(
                "fork {id} has no branch `{label}` any more"
            ));
        };
        if b.state.is_stopped() || watched.view.state.is_resolved() {
            return Ok(watched.view);
        }
        if let Some(t) = timeout {
            if started.elapsed() >= t {
                return Err(anyhow::anyhow!(
                    "gave up waiting after {} s: branch `{label}` is {} (it keeps running; `forkfleet fork watch {id}`)",
                    t.as_secs(),
                    b.state
                ));
            }
        }
    }
}

async fn fork_create(
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
    let view = create_from(coord, loaded, from, !json).await?;
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
                ""
            )
            .trim_end()
        ));
    }
    Ok(())
}

/// Where a merge is applied.
struct MergeTarget<'a> {
    apply: Option<&'a Path>,
    no_apply: bool,
    overwrite: bool,
}

impl MergeTarget<'_> {
    /// The directory a merge of `view` is applied to (checked before the merge: a merge is
    /// final, and its result must land somewhere), and the conflict policy.
    fn resolve(&self, view: &ForkView) -> anyhow::Result<(Option<PathBuf>, ConflictPolicy)> {
        let dir = if self.no_apply {
            None
        } else {
            match (self.apply, &view.workspace) {
                (Some(a), _) => Some(a.to_path_buf()),
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
        let policy = if self.overwrite {
            ConflictPolicy::Overwrite
        } else {
            ConflictPolicy::KeepParent
        };
        Ok((dir, policy))
    }
}

async fn fork_resolve(
    coord: &Client,
    fork: &str,
    strategy: Option<Strategy>,
    target: MergeTarget<'_>,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let view = coord.fork(id).await?;
    let (dir, policy) = target.resolve(&view)?;
    // Embedded, unfinished branches run here (this session's workers) before the resolve.
    if !coord.is_remote() && !view.settled() {
        forkdir::follow(coord, id, timeout, AT_ONCE, !json).await?;
    }
    let resolved =
        resolve_cmd::resolve_and_apply(coord, id, strategy, dir.as_deref(), policy).await?;
    if resolved.report.merge.is_some() {
        forkdir::cleanup_after_merge(coord, id).await;
    }
    if json {
        print_json(&resolve_cmd::report_json(&resolved))?;
    } else {
        print!("{}", resolve_cmd::report_text(&resolved.report));
        if let (Some(merge), Some(applied)) = (&resolved.report.merge, &resolved.applied) {
            print!("{}", render::merge_text(&merge.winner, applied));
        }
    }
    match resolve_cmd::failure(&resolved.report) {
        Some(e) => Err(anyhow::anyhow!(e)),
        None => Ok(()),
    }
}

async fn fork_merge(
    coord: &Client,
    fork: &str,
    pick: &str,
    target: MergeTarget<'_>,
    json: bool,
) -> anyhow::Result<()> {
    let id = coord.find_fork(fork).await?;
    let view = coord.fork(id).await?;
    let (dir, policy) = target.resolve(&view)?;
    let (winner, report) = merge_and_apply(coord, id, pick, dir.as_deref(), policy).await?;
    if json {
        let view = coord.fork(id).await?;
        print_json(&render::fork_json(
            &view,
            None,
            Some((winner.as_str(), &report)),
        ))
    } else {
        print!("{}", render::merge_text(&winner, &report));
        Ok(())
    }
}

// ---- forkfleet account ... -----------------------------------------------------------

async fn cmd_account(command: AccountCommand) -> anyhow::Result<()> {
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
                    settle_resumed(coord, &forks, timeout_s, client.json).await?;
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
                            print!("{}", render::account_table(&all));
                            Ok(())
                        }
                    }
                }
            })
        }
    }
}

/// The account named `name`, or a bad-input error listing the accounts there are.
async fn find_account(
    coord: &Client,
    name: &str,
) -> anyhow::Result<forkfleet_shared::budget::AccountView> {
    let all = coord.accounts().await?;
    if let Some(a) = all.iter().find(|a| a.name == name) {
        return Ok(a.clone());
    }
    let known = if all.is_empty() {
        "there are no accounts yet; create one with `forkfleet account set NAME --cap USD`"
            .to_string()
    } else {
        format!("accounts: {}", labels(all.iter().map(|a| a.name.as_str())))
    };
    Err(BadInput(format!("no account named `{name}`; {known}")).into())
}

// ---- forkfleet workers, forkfleet log ------------------------------------------------

async fn cmd_workers(args: ClusterArgs) -> anyhow::Result<()> {
    let config = args.config.load(Layer::default())?;
    if args.config.print_config {
        print!("{}", config.render());
        return Ok(());
    }
    let Some(nats) = config.nats_config("forkfleet-client") else {
        return Err(ClientError::NeedsCluster(
            "`forkfleet workers` lists the workers of a cluster: pass --nats URL (or set FORKFLEET_NATS_URL)",
        )
        .into());
    };
    let workers = Client::remote(service::connect_nats(nats).await?)
        .workers()
        .await?;
    let now = now_ms();
    if args.json {
        print_json(&render::workers_json(&workers, now))
    } else {
        print!("{}", render::worker_table(&workers, now));
        Ok(())
    }
}

// ---- checkpoints: the command bodies are in `checkpoint_cmd.rs` ----
async fn cmd_checkpoint(command: crate::checkpoint_cmd::CheckpointCommand) -> anyhow::Result<()> {
    with_session!(command.client(), Local::Read, |coord| {
        crate::checkpoint_cmd::run(coord, &command)
    })
}

async fn cmd_log(args: LogArgs) -> anyhow::Result<()> {
    let run: RunId = args
        .run
        .parse()
        .map_err(|e: forkfleet_shared::ids::IdError| BadInput(e.to_string()))?;
    let json = args.client.json;
    with_session!(&args.client, Local::Read, |coord| async {
        let events = coord.run_events(run).await?;
        if json {
            let docs: Vec<_> = events
                .iter()
                .map(|e| serde_json::json!({"seq": e.seq, "event": e.event}))
                .collect();
            print_json(&serde_json::Value::Array(docs))
        } else {
            for e in &events {
                println!("{:>5}  {}", e.seq, render::event_line(&e.event));
            }
            Ok(())
        }
    })
}

fn labels<'a>(it: impl Iterator<Item = &'a str>) -> String {
    it.collect::<Vec<_>>().join(", ")
}

//! The command line. Each command is a function from parsed arguments to an exit code:
//! 0 success, 1 failure, 2 bad input.
//!
//! Client commands (`fork ...`, `account ...`, `workers`, `log`) talk to a [`Client`]: a
//! remote coordinator when a NATS URL is configured (`--nats`, `FORKFLEET_NATS_URL`, or
//! the `--config` file), else the embedded one over the run store in `--data`. When another
//! process (`forkfleet run`) holds that store, the command reaches that process's embedded
//! coordinator through its socket `<data>/api.sock` instead.

use account::AccountCommand;
use fork::ForkCommand;
use forkfleet_bench::BenchCommand;
use log::LogArgs;
use run::RunArgs;
use services::{CoordinatorArgs, WorkerArgs};

use clap::{Args, Parser, Subcommand};
use forkfleet::config::{self, Config, CoordinatorLayer, Layer, NatsLayer, TlsLayer};
use forkfleet::embedded::{Embedded, EmbeddedOptions};
use forkfleet::service;
use forkfleet::BadInput;
use forkfleet_bus::BusError;
use forkfleet_client::forkdir;
use forkfleet_client::render;
use forkfleet_client::run::{self as flow, AT_ONCE};
use forkfleet_client::watch::Until;
use forkfleet_client::{ApiClient, Client, ClientError};
use forkfleet_coordinator::CoordinatorError;
use forkfleet_shared::api::ForkView;
use forkfleet_shared::budget::ForkCost;
use forkfleet_shared::diff::DiffOptions;
use forkfleet_shared::error::ErrorKind;
use forkfleet_shared::flush::{ConflictPolicy, FlushReport};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::now_ms;
use forkfleet_shared::spec::{self, SOLO_LABEL};
use forkfleet_worker::WorkerError;
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
    /// Log lines on stderr as `text` (the default) or `json`, one object per line with the
    /// current trace_id and span_id ($FORKFLEET_LOG_FORMAT; [telemetry] log_format).
    #[arg(long, global = true, value_name = "FORMAT", value_parser = ["text", "json"])]
    pub log_format: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a fork from a spec file on this machine (embedded coordinator and workers).
    Run(RunArgs),
    /// Chat with an agent in a terminal UI, fork it into live branch tabs, steer, merge,
    /// accept (docs/TERMINAL.md); embedded, or on a cluster with --nats.
    Chat(chat::ChatArgs),
    /// Serve the HTTP API of an embedded store on this machine, under a token made for
    /// this run (docs/HTTP.md), until Ctrl-C.
    Ui(ui::UiArgs),
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
    /// Delete merged and aborted forks older than a duration, with their branch runs,
    /// checkpoints, fork directories and the blobs nothing refers to any more; forks that
    /// something kept refers to (a child run, a run started from a checkpoint) or that
    /// charge an account stay, and it says why. Operators only on a cluster.
    Gc(gc::GcArgs),
    /// List the tool calls that wait for a person's consent, across the fleet (or one
    /// fork's): fork, branch, tool, call id, age, what the timeout decides and when, the
    /// rule that matched, the arguments. Answer with `fork approve` or `fork deny`
    /// (docs/APPROVALS.md).
    Approvals(approvals::ApprovalsArgs),
    /// Set up a cluster's security: `cluster auth` writes the NATS permissions and
    /// credentials of each role.
    Cluster {
        #[command(subcommand)]
        command: cluster::ClusterCommand,
    },
    /// Print a run's event log.
    Log(LogArgs),
    /// Every run and its lineage; fork any recorded run at any event into a child run,
    /// copied or replayed from its record, with changed settings (docs/LINEAGE.md).
    Runs {
        #[command(subcommand)]
        command: runs::RunsCommand,
    },
    /// List, save and remove a run's checkpoints; rewind a run to one (its conversation,
    /// its workspace version and, with --apply, a directory); start a new run from one.
    Checkpoint {
        #[command(subcommand)]
        command: checkpoint::CheckpointCommand,
    },
    /// Whole-system benchmarks.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// Print the shell's completion script for forkfleet's commands and flags, e.g.
    /// `forkfleet completions bash > ~/.local/share/bash-completion/completions/forkfleet`
    /// (zsh: a file `_forkfleet` on `$fpath`; fish: `~/.config/fish/completions/forkfleet.fish`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: CompletionShell,
    },
}

/// The shells `forkfleet completions` writes for.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

/// `forkfleet completions SHELL`: the script on stdout.
fn cmd_completions(shell: CompletionShell) -> anyhow::Result<()> {
    use clap::CommandFactory as _;
    use clap_complete::Shell;
    let shell = match shell {
        CompletionShell::Bash => Shell::Bash,
        CompletionShell::Zsh => Shell::Zsh,
        CompletionShell::Fish => Shell::Fish,
    };
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "forkfleet", &mut out);
    use std::io::Write as _;
    std::io::stdout().write_all(&out)?;
    Ok(())
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
    /// Deliveries of a task before it is judged dead: queued again when its branch made a
    /// turn or an outage explains them, else failed (default: 5;
    /// $FORKFLEET_NATS_MAX_DELIVER). A cluster-wide setting.
    #[arg(long, value_name = "N")]
    pub nats_max_deliver: Option<u32>,
    /// Replicas of the streams and buckets the coordinator creates, 1 to 5 (default: 1;
    /// $FORKFLEET_NATS_REPLICAS); 3 on a NATS cluster.
    #[arg(long, value_name = "N")]
    pub nats_replicas: Option<usize>,
    /// This client's identity: its requests go to ff.api.client.<IDENTITY>, and it acts on
    /// the forks of its accounts only ($FORKFLEET_NATS_IDENTITY; see docs/CLUSTER.md,
    /// "Security").
    #[arg(long, value_name = "IDENTITY")]
    pub identity: Option<String>,
    /// Seconds to keep trying to reach NATS, and for a client command the coordinator,
    /// before giving up (default: 15; $FORKFLEET_NATS_CONNECT_TIMEOUT_S).
    #[arg(long, value_name = "SECONDS")]
    pub nats_connect_timeout_s: Option<u64>,
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
                replicas: self.nats_replicas,
                identity: self.identity.clone(),
                connect_timeout_s: self.nats_connect_timeout_s,
                tls: TlsLayer {
                    ca_file: self.tls_ca.clone(),
                    cert_file: self.tls_cert.clone(),
                    key_file: self.tls_key.clone(),
                    require: self.tls_require.then_some(true),
                },
                ..NatsLayer::default()
            },
            telemetry: config::TelemetryLayer {
                log_format: LOG_FORMAT_FLAG.get().cloned().flatten(),
                ..config::TelemetryLayer::default()
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
        flags.tree_cache_mb = extra.tree_cache_mb;
        flags.http_addr = extra.http_addr;
        flags.coordinator = extra.coordinator;
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

pub(crate) use forkfleet_shared::budget::{parse_cap, parse_usd};

impl Command {
    /// A command whose output may be piped into another program (not a long-running
    /// service).
    pub fn prints(&self) -> bool {
        !matches!(self, Command::Coordinator(_) | Command::Worker(_))
    }

    /// The command's words as typed (`fork create`, `run`): the subcommands of the
    /// process's arguments, each found in the command tree below the last.
    pub fn path() -> String {
        use clap::CommandFactory as _;
        // The process's arguments parsed again (they parsed once already): the chain of
        // subcommands clap matched, never an argument's value.
        let Ok(matches) = Cli::command().try_get_matches_from(std::env::args_os()) else {
            return String::new();
        };
        let mut words = Vec::new();
        let mut at = &matches;
        while let Some((name, sub)) = at.subcommand() {
            words.push(name.to_string());
            at = sub;
        }
        words.join(" ")
    }

    /// What the process is, for its default `service.name`.
    pub fn service(&self) -> forkfleet::telemetry::Service {
        use forkfleet::telemetry::Service;
        match self {
            Command::Coordinator(_) => Service::Coordinator,
            Command::Worker(_) => Service::Worker,
            _ => Service::Command,
        }
    }

    /// The `--config` file the command was given, for the telemetry settings read before
    /// the command runs; `None` for the commands whose `[telemetry]` comes from
    /// `FORKFLEET_CONFIG` alone (the `fork` and `account` groups, `cluster`, `bench`).
    fn config_file(&self) -> Option<&Path> {
        match self {
            Command::Run(a) => a.config.as_deref(),
            Command::Chat(a) => a.config.config.as_deref(),
            Command::Ui(a) => a.config.config.as_deref(),
            Command::Coordinator(a) => a.config.config.as_deref(),
            Command::Worker(a) => a.config.config.as_deref(),
            Command::Workers(a) => a.config.config.as_deref(),
            Command::Approvals(a) => a.client.config.config.as_deref(),
            Command::Gc(a) => a.client.config.config.as_deref(),
            Command::Log(a) => a.client.config.config.as_deref(),
            Command::Runs { command } => command.client().config.config.as_deref(),
            Command::Checkpoint { command } => command.client().config.config.as_deref(),
            _ => None,
        }
    }
}

impl Cli {
    /// The telemetry settings of this invocation: the command's config file, the
    /// environment and `--log-format`. When they cannot be read, those of the environment
    /// alone (the command reports the configuration's error itself), else the defaults.
    pub fn telemetry_settings(&self) -> config::TelemetrySettings {
        let flags = || Layer {
            telemetry: config::TelemetryLayer {
                log_format: self.log_format.clone(),
                ..config::TelemetryLayer::default()
            },
            ..Layer::default()
        };
        let file = self.command.config_file();
        Config::load_telemetry(file, &config::process_env, flags())
            .or_else(|_| {
                let env_only = |var: &str| {
                    (var != config::CONFIG_ENV)
                        .then(|| config::process_env(var))
                        .flatten()
                };
                Config::load_telemetry(None, &env_only, flags())
            })
            .unwrap_or_default()
    }
}

/// The global `--log-format`, for the configuration the commands load (and show with
/// `--print-config`): set once by [`run`].
static LOG_FORMAT_FLAG: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// Run a command; print its error; return the exit code.
pub async fn run(cli: Cli) -> u8 {
    let _ = LOG_FORMAT_FLAG.set(cli.log_format.clone());
    let result = match cli.command {
        Command::Run(args) => run::cmd_run(args).await,
        Command::Chat(args) => chat::cmd_chat(args).await,
        Command::Ui(args) => ui::cmd_ui(args).await,
        Command::Coordinator(args) => services::cmd_coordinator(args).await,
        Command::Worker(args) => services::cmd_worker(args).await,
        Command::Fork { command } => fork::cmd_fork(command).await,
        Command::Account { command } => account::cmd_account(command).await,
        Command::Workers(args) => workers::cmd_workers(args).await,
        Command::Approvals(args) => approvals::cmd_approvals(args).await,
        Command::Gc(args) => gc::cmd_gc(args).await,
        Command::Cluster { command } => cluster::cmd_cluster(command).await,
        Command::Log(args) => log::cmd_log(args).await,
        Command::Runs { command } => runs::cmd_runs(command).await,
        Command::Checkpoint { command } => checkpoint::cmd_checkpoint(command).await,
        Command::Bench { command } => forkfleet_bench::run(command).await,
        Command::Completions { shell } => cmd_completions(shell),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            let code = exit_code(&e);
            if forkfleet_client::render::json_logs() {
                // A log line like every other under JSON logs.
                tracing::error!(target: "forkfleet::command", exit_code = code, "error: {}", render::error_chain(&*e));
            } else {
                eprintln!("error: {}", render::error_chain(&*e));
            }
            code
        }
    }
}

/// The exit code of a failed command: that of the kind of the first cause in its chain
/// whose kind is known ([`error_kind`]), through [`ErrorKind::exit_code`]; 1 when none is.
fn exit_code(e: &anyhow::Error) -> u8 {
    if let Some(i) = e.downcast_ref::<Incomplete>() {
        return i.exit_code();
    }
    e.chain()
        .find_map(error_kind)
        .map_or(1, ErrorKind::exit_code)
}

/// A command that ran but did not do all it was asked. Its output (the `--json` document
/// included) is printed first; this only sets the exit code and says why on stderr.
///
/// The exit codes (README, "Exit codes"): 0 when what was asked happened in full; 1 when
/// it ran and failed or applied only in part; 2 for input that cannot succeed; 3 when it
/// applied everything but kept local edits as conflicts.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Incomplete {
    /// It ran and failed, or applied only in part: exit 1.
    #[error("{0}")]
    Failed(String),
    /// It applied, but left paths edited locally as they were: exit 3.
    #[error("{0}")]
    ConflictsKept(String),
}

impl Incomplete {
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            Incomplete::Failed(_) => 1,
            Incomplete::ConflictsKept(_) => 3,
        }
    }
}

/// How a branch in `state` ended without doing its task, for the exit code: `failed`, or
/// `refused` (the model refused it or a content filter stopped it); `None` otherwise.
pub(crate) fn did_not_finish(state: forkfleet_shared::state::BranchState) -> Option<&'static str> {
    use forkfleet_shared::state::BranchState;
    match state {
        BranchState::Failed => Some("failed"),
        BranchState::Refused => Some("refused"),
        _ => None,
    }
}

/// The branches of `view` that failed or were refused, as the exit code's reason: a
/// command that waited for a fork to finish exits 1 when any did (README, "Exit codes"),
/// after printing what it prints.
pub(crate) fn failed_branches(view: &forkfleet_shared::api::ForkView) -> Option<Incomplete> {
    let mut refusals = false;
    let failed: Vec<String> = view
        .branches
        .iter()
        .filter_map(|b| Some((b, did_not_finish(b.state)?)))
        .map(|(b, how)| {
            let how = if how == "refused" {
                refusals = true;
                "refused: "
            } else {
                ""
            };
            match &b.error {
                Some(e) => {
                    let short: String = e.chars().take(200).collect();
                    let more = if short.len() < e.len() { "…" } else { "" };
                    format!("`{}` ({how}{short}{more})", b.label)
                }
                None if how.is_empty() => format!("`{}`", b.label),
                None => format!("`{}` (refused)", b.label),
            }
        })
        .collect();
    (!failed.is_empty()).then(|| {
        Incomplete::Failed(format!(
            "{} of {} {}: {}",
            render::count(failed.len(), "branch", "branches"),
            view.branches.len(),
            if refusals { "did not finish" } else { "failed" },
            failed.join("; ")
        ))
    })
}

/// What applying `report` (a merge, a rewind) to `dir` means for the exit code: errors
/// are a failure, conflicts kept are exit 3, a clean apply is success. `again`: the
/// command that applies it again over them (else: the same command with --overwrite).
pub(crate) fn applied_in_full(
    what: &str,
    report: &FlushReport,
    again: Option<String>,
) -> anyhow::Result<()> {
    if !report.errors.is_empty() {
        return Err(Incomplete::Failed(format!(
            "{what} applied in part: {} failed (see above)",
            render::count(report.errors.len(), "path", "paths")
        ))
        .into());
    }
    if !report.conflicts.is_empty() {
        return Err(Incomplete::ConflictsKept(format!(
            "{what} applied, but {} edited since kept as {} ({} replaces them)",
            render::count(report.conflicts.len(), "path", "paths"),
            if report.conflicts.len() == 1 {
                "it is"
            } else {
                "they are"
            },
            again.as_deref().unwrap_or("--overwrite")
        ))
        .into());
    }
    Ok(())
}

/// The kind of `e` when it is one of the errors the commands know: a crate's error enum
/// (the client's, the coordinator's, the worker's, the bus's), or input the command
/// line refused (a spec, the configuration, an argument). `None` for any other error.
fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
    if let Some(e) = e.downcast_ref::<ClientError>() {
        Some(e.kind())
    } else if let Some(e) = e.downcast_ref::<CoordinatorError>() {
        Some(e.kind())
    } else if let Some(e) = e.downcast_ref::<WorkerError>() {
        Some(e.kind())
    } else if let Some(e) = e.downcast_ref::<BusError>() {
        Some(e.kind())
    } else if e.is::<BadInput>() || e.is::<spec::SpecError>() || e.is::<config::ConfigError>() {
        Some(ErrorKind::BadInput)
    } else {
        None
    }
}

/// The command that applies fork `fork`'s merge to `dir` again over what it kept (`dir`:
/// `--apply DIR` when it was given one; `reach`: the flags that reach the store).
pub(crate) fn reapply_command(fork: ForkId, dir: Option<&Path>, reach: &str) -> String {
    let apply = dir.map_or(String::new(), |d| {
        format!(" --apply {}", render::shell_word(&d.display().to_string()))
    });
    format!("`forkfleet fork merge {fork} --reapply --overwrite{apply}{reach}`")
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
        if let Some(nats) = config.nats_config_for(config::Role::Client) {
            let reach = nats_reach(args, &nats.url);
            let retry = forkfleet_bus::apicall::Retry {
                bound: nats.connect_timeout,
                url: forkfleet_bus::nats::redact_url(&nats.url),
            };
            let bus = service::connect_nats(nats).await?;
            return Ok(Some(Session {
                client: Client::on_subject_retrying(bus, &config.api_subject(), retry)
                    .with_reach(reach),
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
                        catalogue: std::sync::Arc::new(config.catalogue()),
                        ..EmbeddedOptions::default()
                    }
                } else {
                    EmbeddedOptions {
                        workers: 0,
                        concurrency: 1,
                        // No worker runs, but a fork or child it creates is checked
                        // against what the workers would offer.
                        catalogue: std::sync::Arc::new(config.catalogue()),
                        ..EmbeddedOptions::default()
                    }
                }
            }
            Local::Run => EmbeddedOptions {
                catalogue: std::sync::Arc::new(config.catalogue()),
                ..EmbeddedOptions::default()
            },
        };
        // A live embedded process that holds the store answers on its socket: ask it
        // first, rather than wait out the store's lock retry (`RunStore::open`) to learn
        // the store is taken.
        if let Some(client) = Self::live_holder(data).await {
            return Ok(Some(Session {
                client,
                embedded: None,
            }));
        }
        match Embedded::start(data, opts).await {
            Ok(system) => Ok(Some(Session {
                client: system.client(),
                embedded: Some(system),
            })),
            Err(e) if store_locked(&e) => Ok(Some(Session {
                client: Self::holder(data, e).await?,
                embedded: None,
            })),
            Err(e) => Err(e),
        }
    }

    /// A client of the embedded process that holds the store in `data`, through the socket
    /// it serves there; `None` when nobody listens (a socket file a killed process left is
    /// removed).
    #[cfg(unix)]
    async fn live_holder(data: &Path) -> Option<Client> {
        use forkfleet_client::local;
        let path = local::socket_path(data);
        match local::connect(&path).await {
            Ok(Some(transport)) => {
                tracing::info!(api.socket = %path.display(), "the store is held by another process: using its socket");
                Some(
                    Client::over_socket(transport)
                        .with_reach(forkfleet::embedded::data_reach(data)),
                )
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(api.socket = %path.display(), error = %e, "the socket of the process holding the store cannot be reached");
                None
            }
        }
    }

    /// No Unix sockets: no other process can be reached.
    #[cfg(not(unix))]
    async fn live_holder(_data: &Path) -> Option<Client> {
        None
    }

    /// The store in `data` is locked by another process (`locked`): its socket if it
    /// started serving since [`Session::live_holder`] looked, else the lock error.
    async fn holder(data: &Path, locked: anyhow::Error) -> anyhow::Result<Client> {
        Self::live_holder(data).await.ok_or(locked)
    }

    async fn close(self) -> anyhow::Result<()> {
        match self.embedded {
            Some(system) => system.shutdown().await,
            None => Ok(()),
        }
    }
}

/// The flags a printed command needs to reach the same cluster from any directory: the
/// `--config` file (absolute), and `--nats URL` unless the URL carries credentials (a hint
/// never prints a secret: such a URL must come from the environment or the config file).
fn nats_reach(args: &ClientArgs, url: &str) -> String {
    let mut out = String::new();
    if let Some(file) = &args.config.config {
        let file = std::path::absolute(file).unwrap_or_else(|_| file.clone());
        out.push_str(&format!(
            " --config {}",
            render::shell_word(&file.to_string_lossy())
        ));
    }
    if !url.contains('@') {
        out.push_str(&format!(" --nats {}", render::shell_word(url)));
    }
    out
}

/// True when `e` says the run store is locked by another process.
fn store_locked(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<CoordinatorError>(),
            Some(CoordinatorError::StoreLocked { .. })
        )
    })
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

pub(crate) fn labels<'a>(it: impl Iterator<Item = &'a str>) -> String {
    it.collect::<Vec<_>>().join(", ")
}

// The command groups, after `with_session!` (macros are in scope below their definition).
mod account;
mod approvals;
mod chat;
mod checkpoint;
mod cluster;
mod fork;
mod gc;
mod log;
mod prompt;
mod run;
mod runs;
mod services;
mod ui;
mod workers;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use forkfleet_shared::api::ApiError;

    #[test]
    fn the_first_known_cause_gives_the_exit_code() {
        let conflict: ClientError = ApiError::new(ErrorKind::Conflict, "fork is merged").into();
        let cases: Vec<(anyhow::Error, u8)> = vec![
            (anyhow::Error::from(conflict).context("merging"), 2),
            (
                anyhow::Error::from(ClientError::NoWorkspace {
                    fork: ForkId::new(),
                }),
                2,
            ),
            (
                anyhow::Error::from(ClientError::DiffTool {
                    failed: vec!["`meld` exited with 1".into()],
                }),
                1,
            ),
            (
                anyhow::Error::from(BusError::Closed).context("connecting"),
                1,
            ),
            (anyhow::Error::from(BadInput("--cap: -1".into())), 2),
            (anyhow::anyhow!("something else"), 1),
        ];
        for (e, code) in cases {
            assert_eq!(exit_code(&e), code, "{}", render::error_chain(&*e));
        }
    }

    #[test]
    fn every_known_kind_maps_through_error_kind_exit_code() {
        for kind in ErrorKind::ALL {
            let e = anyhow::Error::from(ClientError::from(ApiError::new(kind, "x")));
            assert_eq!(exit_code(&e), kind.exit_code(), "{kind}");
        }
    }
}

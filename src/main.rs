//! The `forkfleet` binary: parse, configure, call the library, map the outcome to an exit
//! code (0 success, 1 failure, 2 bad input).

use clap::Parser;

mod cli;

/// jemalloc, not glibc's malloc (ADR 41): side by side on the fan-out benchmark it took
/// 0.80x of the embedded fork's wall and CPU and two thirds of its context switches, at the
/// same peak RSS (with the options below).
#[cfg(all(target_os = "linux", not(target_env = "musl")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read when it starts (`_RJEM_MALLOC_CONF` in the environment adds to
/// them): an arena per CPU, not four (jemalloc's default peaked 30 to 40 % above glibc's
/// RSS on the fan-out and the workspace benchmark), and freed pages given back after half a
/// second (as allocations go on: no background thread).
#[cfg(all(target_os = "linux", not(target_env = "musl")))]
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: MallocConf =
    MallocConf(c"percpu_arena:percpu,dirty_decay_ms:500,muzzy_decay_ms:0".as_ptr());

/// A C string jemalloc reads (`const char *malloc_conf`).
#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);

// SAFETY: the pointer is to a static, immutable, NUL-terminated byte string.
unsafe impl Sync for MallocConf {}

fn main() -> std::process::ExitCode {
    // A container's first process with no init of its own: serve as one (ADR 43).
    if let Some(code) = forkfleet::init::run_if_pid1() {
        return std::process::ExitCode::from(code);
    }
    limit_malloc_arenas();
    let cli = cli::Cli::parse();
    if cli.command.prints() {
        forkfleet::telemetry::exit_quietly_on_broken_pipe();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    // The telemetry settings are known before the first log line; the gRPC exporter's
    // connection lives on the runtime, so it is built inside it and flushed before the
    // runtime drops.
    let settings = cli.telemetry_settings();
    let telemetry = {
        let _entered = runtime.enter();
        forkfleet::telemetry::init(cli.verbose, &settings, cli.command.service())
    };
    // A command (not a service) is one span, the root of what it asks of the cluster:
    // its requests carry its trace context, and the coordinator's and workers' spans
    // continue it. `TRACEPARENT` in the environment makes it a child of the caller's trace.
    let path = if cli.command.service() == forkfleet::telemetry::Service::Command {
        cli::Command::path()
    } else {
        String::new()
    };
    // A session (`chat`, `ui`, `fork watch`) is no one trace: its requests are each their own.
    let traced = !path.is_empty()
        && !["chat", "ui", "fork watch"]
            .iter()
            .any(|p| path == *p || path.starts_with(&format!("{p} ")));
    let code = if traced {
        let span = forkfleet::telemetry::command_span(&path);
        let code = {
            use tracing::Instrument as _;
            runtime.block_on(cli::run(cli).instrument(span.clone()))
        };
        forkfleet::telemetry::end_command_span(&span, code);
        code
    } else {
        runtime.block_on(cli::run(cli))
    };
    // Every command and service ends here: the last spans go out before the process does.
    telemetry.shutdown();
    drop(runtime);
    std::process::ExitCode::from(code)
}

/// What still allocates with glibc's malloc (C code linked in; Rust's allocations go to
/// jemalloc, above): glibc gives threads that allocate at once arenas of their own, up to eight per core,
/// and keeps what is freed in each: a worker's blocking pool (hundreds of threads
/// materialising and comparing command trees) then holds far more than it uses. Two per
/// core: 32 branches x 10 commands on a 257 MB tree peaked at 270 to 285 MB with glibc's
/// default, 187 MB with this (docs/BENCHMARKS.md). `MALLOC_ARENA_MAX`, when set, decides.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let arenas = libc::c_int::try_from(cores * 2).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt takes two integers; called before any thread is started.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, arenas);
        }
    }
}

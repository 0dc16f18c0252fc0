//! The `forkfleet` binary: parse, configure, call the library, map the outcome to an exit
//! code (0 success, 1 failure, 2 bad input).

use clap::Parser;

mod cli;

fn main() -> std::process::ExitCode {
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
    let code = runtime.block_on(cli::run(cli));
    // Every command and service ends here: the last spans go out before the process does.
    telemetry.shutdown();
    drop(runtime);
    std::process::ExitCode::from(code)
}

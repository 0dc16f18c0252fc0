//! The `forkfleet` binary: parse, configure, call the library, map the outcome to an exit
//! code (0 success, 1 failure, 2 bad input).

use clap::Parser;

mod cli;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    if cli.command.prints() {
        forkfleet::telemetry::exit_quietly_on_broken_pipe();
    }
    forkfleet::telemetry::init(cli.verbose);
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
    let code = runtime.block_on(cli::run(cli));
    std::process::ExitCode::from(code)
}

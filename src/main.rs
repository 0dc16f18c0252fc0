//! The `forkfleet` binary: parse, configure, call the library, map the outcome to an exit
//! code (0 success, 1 failure, 2 bad input).

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = forkfleet::cli::Cli::parse();
    forkfleet::cli::init_tracing(cli.verbose);
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
    let code = runtime.block_on(forkfleet::cli::run(cli));
    std::process::ExitCode::from(code)
}

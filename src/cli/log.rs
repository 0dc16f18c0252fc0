//! `forkfleet log RUN`: a run's event log, or a branch's followed live.

use super::*;
use forkfleet_shared::api::LoggedEvent;

#[derive(Debug, Args)]
pub struct LogArgs {
    /// The run: its id, a unique prefix of one, or a fork's branch as FORK/LABEL (FORK an
    /// id or a unique prefix).
    pub run: String,
    /// Print the events as they land until the branch stops (finishes, pauses or waits for
    /// approval); `--json` prints one JSON object a line.
    #[arg(long)]
    pub follow: bool,
    /// With --follow: give up after this many seconds (exit 1; the branch goes on).
    #[arg(long)]
    pub timeout_s: Option<u64>,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// A run named as `log` and `fork show` name one: its id and, for a fork's branch, the
/// fork and the label.
pub(crate) struct NamedRun {
    pub run: RunId,
    pub branch: Option<(ForkId, String)>,
}

/// Find the run `arg` names (every way the client's `find_run` takes), with its fork and
/// label when it is a fork's branch.
pub(crate) async fn find_run(coord: &Client, arg: &str) -> anyhow::Result<NamedRun> {
    let run = coord.find_run(arg).await?;
    let detail = coord.run(run).await?;
    let branch = match (detail.run.fork_id, detail.run.label) {
        (Some(fork), Some(label)) => Some((fork, label)),
        _ => None,
    };
    Ok(NamedRun { run, branch })
}

fn print_event(json: bool, label: Option<&str>, e: &LoggedEvent) {
    if json {
        let mut doc = serde_json::json!({"seq": e.seq, "event": e.event});
        if let Some(l) = label {
            doc["label"] = serde_json::json!(l);
        }
        println!("{doc}");
    } else {
        match label {
            Some(l) => println!("{l}  {:>5}  {}", e.seq, render::event_line(&e.event)),
            None => println!("{:>5}  {}", e.seq, render::event_line(&e.event)),
        }
    }
}

pub(crate) async fn cmd_log(args: LogArgs) -> anyhow::Result<()> {
    let json = args.client.json;
    // Following a live branch: embedded, a process that runs it answers over its socket;
    // if none does, this one runs what a stopped process left unfinished, as `fork watch`.
    let local = if args.follow {
        Local::Resume
    } else {
        Local::Read
    };
    with_session!(&args.client, local, |coord| async {
        let named = find_run(coord, &args.run).await?;
        match (args.follow, &named.branch) {
            (true, Some((fork, label))) => {
                let timeout = args.timeout_s.map(Duration::from_secs);
                let mut each = |_: &str, e: &LoggedEvent| print_event(json, None, e);
                forkfleet_client::watch::follow_events(
                    coord,
                    *fork,
                    Some(label.as_str()),
                    timeout,
                    &mut each,
                )
                .await?;
                Ok(())
            }
            _ => {
                let events = coord.run_events(named.run).await?;
                if json && !args.follow {
                    let docs: Vec<_> = events
                        .iter()
                        .map(|e| serde_json::json!({"seq": e.seq, "event": e.event}))
                        .collect();
                    print_json(&serde_json::Value::Array(docs))
                } else {
                    // A root run: no worker adds to it, so following ends at once.
                    for e in &events {
                        print_event(json, None, e);
                    }
                    Ok(())
                }
            }
        }
    })
}

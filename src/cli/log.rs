//! `forkfleet log RUN`: a run's event log.

use super::*;

#[derive(Debug, Args)]
pub struct LogArgs {
    /// Run id.
    pub run: String,
    #[command(flatten)]
    pub client: ClientArgs,
}

pub(crate) async fn cmd_log(args: LogArgs) -> anyhow::Result<()> {
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

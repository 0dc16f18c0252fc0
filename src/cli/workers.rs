//! `forkfleet workers`: a cluster's live workers, from their heartbeats.

use super::*;

pub(crate) async fn cmd_workers(args: ClusterArgs) -> anyhow::Result<()> {
    let config = args.config.load(Layer::default())?;
    if args.config.print_config {
        print!("{}", config.render());
        return Ok(());
    }
    let Some(nats) = config.nats_config_for(config::Role::Client) else {
        return Err(ClientError::NeedsCluster(
            "`forkfleet workers` lists the workers of a cluster: pass --nats URL (or set FORKFLEET_NATS_URL)",
        )
        .into());
    };
    // A client with an identity asks the coordinator (it may not read the heartbeats, and
    // sees the running branches of its own forks only); an operator reads them directly,
    // so the listing works while no coordinator runs.
    let scoped = nats.blob_broker.is_some();
    let client = Client::on_subject(service::connect_nats(nats).await?, &config.api_subject());
    let workers = if scoped {
        ApiClient::list_workers(&client).await?
    } else {
        client.workers().await?
    };
    let now = now_ms();
    if args.json {
        print_json(&render::workers_json(&workers, now))
    } else {
        print!("{}", render::worker_table(&workers, now));
        Ok(())
    }
}

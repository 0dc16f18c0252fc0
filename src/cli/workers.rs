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

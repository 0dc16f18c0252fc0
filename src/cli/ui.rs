//! `forkfleet ui`: the embedded system with the HTTP API (docs/HTTP.md) and the web console
//! (docs/CONSOLE.md) on this machine's loopback, under a token made for this run and
//! printed in the console's URL, until Ctrl-C. Merges made there are applied to the fork's
//! workspace directory, as `fork merge` applies them.

use super::*;
use forkfleet::http_api::{audit::Audit, auth, ApiHttp, Serving, Slot};

#[derive(Debug, Args)]
pub struct UiArgs {
    /// The data directory of the embedded store (default: .forkfleet; $FORKFLEET_DATA).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Where to listen: a loopback address (default 127.0.0.1, a free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    pub addr: std::net::SocketAddr,
    /// In-process workers.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub(crate) async fn cmd_ui(args: UiArgs) -> anyhow::Result<()> {
    if !args.addr.ip().is_loopback() {
        return Err(BadInput(format!(
            "--addr {}: forkfleet ui listens on this machine only (127.0.0.1 or [::1]); a shared API is the coordinator's, with tokens (docs/HTTP.md)",
            args.addr
        ))
        .into());
    }
    let config = args.config.load(Layer {
        data: args.data.clone(),
        ..Layer::default()
    })?;
    let data = config.data.value.clone();
    let system = Embedded::start(
        &data,
        EmbeddedOptions {
            workers: args.workers.max(1),
            requeue_unfinished: true,
            catalogue: std::sync::Arc::new(config.catalogue()),
            ..EmbeddedOptions::default()
        },
    )
    .await?;
    let token = auth::new_token()?;
    let tokens = auth::Tokens::new(
        [(
            "ui".to_string(),
            config::HttpToken {
                sha256: auth::hash(&token),
                scopes: [forkfleet_shared::api::Access::Admin].into(),
                accounts: None,
            },
        )]
        .into(),
    );
    let slot = Slot::default();
    slot.set(Some(Serving::new(system.coordinator(), system.bus.clone())));
    let api = ApiHttp::with_local(
        slot,
        tokens,
        Audit::new(Some(data.join("audit.log"))),
        Some(system.client()),
    );
    let readiness = service::http::Readiness::new("starting");
    readiness.ready();
    let endpoint = service::http::HttpEndpoint::start_with(args.addr, readiness, Some(api)).await;
    let endpoint = match endpoint {
        Ok(e) => e,
        Err(e) => {
            let _ = system.shutdown().await;
            return Err(e);
        }
    };
    let addr = endpoint.addr();
    println!(
        "forkfleet ui: the API of {} on http://{addr}/api/v1",
        data.display()
    );
    println!("console: http://{addr}/#token={token}");
    println!("token (this run only): {token}");
    println!("try: curl -H 'Authorization: Bearer {token}' http://{addr}/api/v1/forks");
    println!("Ctrl-C stops it");
    let _ = tokio::signal::ctrl_c().await;
    endpoint.stop().await;
    system.shutdown().await
}

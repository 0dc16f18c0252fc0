//! The services' HTTP endpoint (`http_addr`, off unless set): the coordinator's HTTP API
//! under `/api/v1` (`crate::router`, docs/HTTP.md), and `GET /metrics` (the
//! registry in the Prometheus text format 0.0.4), `GET /healthz` (200 `ok` while the
//! process runs) and `GET /readyz` (200 `ready` when [`Readiness`] says so, else 503 with
//! the reason in plain text). It stops with its service ([`HttpEndpoint::stop`]).

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long requests in progress may take once the endpoint is told to stop.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// The content type of the Prometheus text exposition format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

type Probe = Arc<dyn Fn() -> bool + Send + Sync>;

/// Whether a service is ready for `/readyz`: a phase it sets as it starts and stops (why it
/// is not ready, or ready), and whether its bus is connected now.
#[derive(Clone)]
pub struct Readiness {
    inner: Arc<Mutex<ReadyState>>,
}

struct ReadyState {
    /// Why the service is not ready; `None` once it serves.
    not_ready: Option<String>,
    /// Whether the bus is connected, once there is one.
    connected: Option<Probe>,
}

impl Readiness {
    /// Not ready, because of `reason`.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(ReadyState {
                not_ready: Some(reason.into()),
                connected: None,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReadyState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Not ready, because of `reason`.
    pub fn not_ready(&self, reason: impl Into<String>) {
        self.lock().not_ready = Some(reason.into());
    }

    /// Ready, while the bus (if any) is connected.
    pub fn ready(&self) {
        self.lock().not_ready = None;
    }

    /// Ready only while `connected` answers true (the NATS connection is up).
    pub fn watch_bus(&self, connected: impl Fn() -> bool + Send + Sync + 'static) {
        self.lock().connected = Some(Arc::new(connected));
    }

    /// Ready, or why not.
    pub fn check(&self) -> Result<(), String> {
        let (not_ready, connected) = {
            let s = self.lock();
            (s.not_ready.clone(), s.connected.clone())
        };
        if let Some(why) = not_ready {
            return Err(why);
        }
        match connected {
            Some(up) if !up() => Err("not connected to NATS (reconnecting)".to_string()),
            _ => Ok(()),
        }
    }
}

/// A running HTTP endpoint.
pub struct HttpEndpoint {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl HttpEndpoint {
    /// Listen on `addr` and serve the three paths; fails at once when the address cannot
    /// be bound. The address bound (its port when `addr`'s is 0) is logged at INFO.
    pub async fn start(addr: SocketAddr, readiness: Readiness) -> anyhow::Result<HttpEndpoint> {
        Self::start_with(addr, readiness, None).await
    }

    /// [`HttpEndpoint::start`], with the HTTP API (`/api/v1`) when `api` is given.
    pub async fn start_with(
        addr: SocketAddr,
        readiness: Readiness,
        api: Option<std::sync::Arc<crate::ApiHttp>>,
    ) -> anyhow::Result<HttpEndpoint> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            let why = match e.kind() {
                std::io::ErrorKind::AddrInUse => "address in use".to_string(),
                std::io::ErrorKind::AddrNotAvailable => {
                    "address not available on this machine".to_string()
                }
                std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
                _ => e.to_string(),
            };
            anyhow::anyhow!("cannot listen on {addr} (http_addr): {why}")
        })?;
        let addr = listener.local_addr()?;
        let mut app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(ready))
            .with_state(readiness);
        if let Some(api) = api {
            app = app.merge(crate::router(api));
        }
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = stopped.await;
            });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "http endpoint failed");
            }
        });
        tracing::info!(http.addr = %addr, "http endpoint listening on {addr}");
        Ok(HttpEndpoint { addr, stop, task })
    }

    /// The address bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop serving: requests in progress get `STOP_GRACE` (2 s) to finish, then their
    /// connections are dropped (a scraper holding one open never holds up a stop).
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let abort = self.task.abort_handle();
        if tokio::time::timeout(STOP_GRACE, self.task).await.is_err() {
            abort.abort();
        }
    }
}

async fn metrics() -> impl IntoResponse {
    let text = tokio::task::spawn_blocking(forkfleet_shared::metrics::render_prometheus)
        .await
        .unwrap_or_default();
    ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], text)
}

async fn ready(
    axum::extract::State(readiness): axum::extract::State<Readiness>,
) -> impl IntoResponse {
    match readiness.check() {
        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

/// Start the endpoint when `addr` is set (with the HTTP API when `api` is given).
pub async fn start_if(
    addr: Option<SocketAddr>,
    readiness: &Readiness,
    api: Option<std::sync::Arc<crate::ApiHttp>>,
) -> anyhow::Result<Option<HttpEndpoint>> {
    match addr {
        Some(addr) => Ok(Some(
            HttpEndpoint::start_with(addr, readiness.clone(), api).await?,
        )),
        None => Ok(None),
    }
}

/// Stop the endpoint, if there is one.
pub async fn stop(endpoint: Option<HttpEndpoint>) {
    if let Some(e) = endpoint {
        e.stop().await;
    }
}

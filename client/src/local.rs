//! The API over a Unix domain socket in the data directory: how another process on this
//! machine reaches an embedded coordinator while that process holds the run store (which
//! sled locks to one process), so a second terminal can watch, steer, terminate, cost and
//! top up a live `forkfleet run`.
//!
//! - [`SocketServer`]: listens on `<data>/api.sock` ([`socket_path`], mode 0600) and
//!   answers each request through `forkfleet_shared::api::dispatch` with any
//!   [`ApiHandler`], one task per connection; the socket file is removed when it stops.
//! - [`SocketTransport`]: the client side, a [`Transport`] for [`Client::over_socket`];
//!   [`connect`] finds a live server and removes a socket file a killed process left.
//! - [`SocketBlobs`]: the run store's blobs read through the socket (operation
//!   `get_blob`), so what a client reads from blobs (the fork directory of `fork watch`, a
//!   merge to apply) works too. It cannot upload: creating a fork needs the store itself.
//!
//! **Who may connect.** The socket's mode (0600) keeps other users out, but not a process
//! of the same user: a command an agent runs (`run_command`, a test command) is one, and
//! Landlock does not govern connecting to a socket file. So the server writes a random
//! token to `<data>/api.token` (mode 0600, [`token_path`]) and a connection's first frame
//! must be that token; one that is not is answered with an error and closed. A client
//! reads the file; a sandboxed command cannot (Landlock keeps it out of the data dir).
//!
//! Framing: a frame is a `u32` big-endian length, then that many bytes, at most
//! [`MAX_FRAME_BYTES`]. A request frame holds a wire-encoded [`ApiRequest`], its answer a
//! wire-encoded [`ApiResponse`]. A connection carries any number of requests, one after
//! the other; [`SocketTransport`] opens one per request. A request that does not decode is
//! answered with a `bad_input` error and the connection stays open; a frame announced
//! larger than [`MAX_FRAME_BYTES`] is answered with a `bad_input` error and the connection
//! closed (its bytes are never read).
//!
//! [`Client::over_socket`]: crate::Client::over_socket

use crate::client::Transport;
use async_trait::async_trait;
use bytes::Bytes;
use forkfleet_bus::apicall::CallError;
use forkfleet_shared::api::{
    dispatch, ApiError, ApiErrorKind, ApiHandler, ApiReply, ApiRequest, ApiResponse, Caller,
    GetBlob, Operation,
};
use forkfleet_shared::blob::{BlobError, BlobHash, BlobStore};
use forkfleet_shared::wire::{self, WIRE_VERSION};
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;

/// The socket's file name in the data directory.
pub const SOCKET_FILE: &str = "api.sock";
/// The largest frame either side sends or accepts (64 MiB).
pub const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;
/// Connections served at once; more wait in the listener's backlog.
const MAX_CONNECTIONS: usize = 256;
/// How long [`connect`] waits for a connection to a socket file.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a stopping server lets the requests in flight finish (a long-poll `watch`
/// with nothing to report is cut short).
const DRAIN: Duration = Duration::from_secs(2);
/// Pause after a failed `accept` (e.g. out of file descriptors) before the next one.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The socket of the embedded process holding the store in `data_dir`.
pub fn socket_path(data_dir: &Path) -> PathBuf {
    data_dir.join(SOCKET_FILE)
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("a frame of {len} bytes is larger than the {MAX_FRAME_BYTES} bytes allowed")]
    TooLarge { len: u64 },
}

/// Read one frame; `None` when the other side closed the connection between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; 4];
    match r.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(header);
    if len as usize > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len: len.into() });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// Write one frame (refused, with nothing written, when `bytes` exceeds
/// [`MAX_FRAME_BYTES`]).
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> Result<(), FrameError> {
    let len = u32::try_from(bytes.len())
        .ok()
        .filter(|len| *len as usize <= MAX_FRAME_BYTES)
        .ok_or(FrameError::TooLarge {
            len: bytes.len() as u64,
        })?;
    w.write_all(&len.to_be_bytes()).await?;
    w.write_all(bytes).await?;
    w.flush().await?;
    Ok(())
}

// ---- server ----------------------------------------------------------------------------

/// The API served on a socket file, bound: connections made from now on are answered once
/// it runs.
pub struct SocketServer {
    listener: UnixListener,
    path: PathBuf,
    /// What a connection's first frame must be (also in [`token_path`]).
    token: Arc<[u8]>,
}

/// The token file beside the socket file `socket`.
pub fn token_path(socket: &Path) -> PathBuf {
    socket.with_file_name(TOKEN_FILE)
}

/// The token file's name, beside [`SOCKET_FILE`].
pub const TOKEN_FILE: &str = "api.token";

/// Bytes of a token.
const TOKEN_BYTES: usize = 32;

/// A new random token, written to `path` (mode 0600, created anew: through a private
/// temporary name, then renamed).
fn new_token(path: &Path) -> io::Result<Arc<[u8]>> {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let mut raw = [0u8; TOKEN_BYTES];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut raw)?;
    let token: Vec<u8> = raw
        .iter()
        .flat_map(|b| format!("{b:02x}").into_bytes())
        .collect();
    let tmp = path.with_file_name(format!(".{TOKEN_FILE}-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&token)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(token.into())
}

/// Equal, in time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl SocketServer {
    /// Listen on `path`, replacing whatever socket file is there. Call it only while
    /// holding the run store, so no other process can be serving that file.
    ///
    /// The socket is bound in a private directory (mode 0700) next to `path`, given mode
    /// 0600 and then moved to `path`, so no other user can connect in between.
    pub fn bind(path: &Path) -> io::Result<Self> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let dir = path.parent().unwrap_or(Path::new("."));
        let staging = dir.join(format!(".api-{}", std::process::id()));
        if let Err(e) = std::fs::remove_dir_all(&staging) {
            if e.kind() != io::ErrorKind::NotFound {
                return Err(e);
            }
        }
        std::fs::DirBuilder::new().mode(0o700).create(&staging)?;
        let bound = (|| -> io::Result<UnixListener> {
            let tmp = staging.join("s");
            let listener = UnixListener::bind(&tmp)?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
            std::fs::rename(&tmp, path)?;
            Ok(listener)
        })();
        let _ = std::fs::remove_dir_all(&staging);
        let listener = bound?;
        // The token before any connection is answered.
        let token = new_token(&token_path(path))?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            token,
        })
    }

    /// The socket file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Answer requests with `handler` until `shutdown` completes, each connection in its
    /// own task; then stop taking connections, give the requests in flight a moment to
    /// finish, close the connections still open (their clients see it closed) and remove
    /// the socket file.
    pub async fn run<H: ApiHandler + Clone + 'static>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) {
        let SocketServer {
            listener,
            path,
            token,
        } = self;
        tracing::info!(api.socket = %path.display(), "api.socket serving");
        tokio::pin!(shutdown);
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept(), if connections.len() < MAX_CONNECTIONS => {
                    match accepted {
                        Ok((stream, _)) => {
                            connections.spawn(serve_connection(
                                handler.clone(),
                                stream,
                                token.clone(),
                            ));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "api.socket accept failed");
                            tokio::select! {
                                _ = &mut shutdown => break,
                                _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                            }
                        }
                    }
                }
                Some(done) = connections.join_next(), if !connections.is_empty() => {
                    if let Err(e) = done {
                        if e.is_panic() {
                            tracing::error!(error = %e, "api.socket request handler panicked");
                        }
                    }
                }
            }
        }
        drop(listener);
        let drained = tokio::time::timeout(DRAIN, async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::debug!(
                connections = connections.len(),
                "api.socket stopping: connections still open are closed"
            );
            connections.abort_all();
        }
        for file in [path.clone(), token_path(&path)] {
            if let Err(e) = std::fs::remove_file(&file) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(api.socket = %file.display(), error = %e, "api.socket file not removed");
                }
            }
        }
        tracing::info!(api.socket = %path.display(), "api.socket stopped");
    }
}

/// Answer the requests of one connection, one after the other, until the client closes it.
async fn serve_connection<H: ApiHandler>(handler: H, mut stream: UnixStream, token: Arc<[u8]>) {
    // The token first: a process that cannot read it (a sandboxed command) gets nothing.
    match read_frame(&mut stream).await {
        Ok(Some(first)) if same(&first, &token) => {}
        Ok(None) => return,
        Ok(Some(_)) | Err(FrameError::TooLarge { .. }) => {
            tracing::warn!(
                "api.socket connection refused: it did not begin with the data dir's token"
            );
            let refused = ApiResponse::Err(ApiError::new(
                ApiErrorKind::BadInput,
                format!(
                    "this socket answers only clients that begin with the token in `{TOKEN_FILE}` beside it (a process of the embedded process's user, outside a command sandbox)"
                ),
            ));
            let _ = write_frame(&mut stream, &encode_response(&refused)).await;
            return;
        }
        Err(FrameError::Io(e)) => {
            tracing::debug!(error = %e, "api.socket connection ended");
            return;
        }
    }
    loop {
        let (response, close) = match read_frame(&mut stream).await {
            Ok(None) => return,
            Ok(Some(bytes)) => (answer(&handler, &bytes).await, false),
            Err(FrameError::TooLarge { len }) => (
                ApiResponse::Err(ApiError::new(
                    ApiErrorKind::BadInput,
                    format!(
                        "a request of {len} bytes is larger than the {MAX_FRAME_BYTES} bytes the local socket accepts"
                    ),
                )),
                true,
            ),
            Err(FrameError::Io(e)) => {
                tracing::debug!(error = %e, "api.socket connection ended");
                return;
            }
        };
        if let Err(e) = write_frame(&mut stream, &encode_response(&response)).await {
            tracing::debug!(error = %e, "api.socket reply not sent (the client left?)");
            return;
        }
        if close {
            return;
        }
    }
}

/// Decode one request and answer it; never fails: every outcome is a response.
async fn answer<H: ApiHandler>(handler: &H, bytes: &[u8]) -> ApiResponse {
    match wire::decode::<ApiRequest>(bytes) {
        Ok(req) => {
            let op = req.op();
            let result = dispatch(handler, &Caller::Admin, req).await;
            if let Err(e) = &result {
                tracing::debug!(api.op = op, api.error = e.kind.as_str(), error = %e.message, "api.socket request refused");
            }
            ApiResponse::from(result)
        }
        Err(e) => {
            tracing::warn!(bytes_in = bytes.len(), error = %e, "api.socket request rejected: it does not decode");
            let message = match e {
                wire::WireError::Version { .. } => format!(
                    "{e}; upgrade the client or the embedded process so both speak wire version {WIRE_VERSION}"
                ),
                _ => format!("malformed API request: {e}"),
            };
            ApiResponse::Err(ApiError::new(ApiErrorKind::BadInput, message))
        }
    }
}

/// The bytes of a response: an error response when it cannot be encoded or is larger than
/// a frame.
fn encode_response(response: &ApiResponse) -> Bytes {
    let failure = match wire::encode(response) {
        Ok(bytes) if bytes.len() <= MAX_FRAME_BYTES => return bytes,
        Ok(bytes) => ApiError::new(
            ApiErrorKind::Failure,
            format!(
                "the reply ({} bytes) is larger than the {MAX_FRAME_BYTES} bytes the local socket carries",
                bytes.len()
            ),
        ),
        Err(e) => ApiError::new(
            ApiErrorKind::Failure,
            format!("the reply cannot be encoded: {e}"),
        ),
    };
    tracing::error!(error = %failure.message, "api.socket reply not sent");
    // An error response is small and always encodes; an empty frame (a reply that does not
    // decode on the client) is the last resort.
    wire::encode(&ApiResponse::Err(failure)).unwrap_or_default()
}

// ---- client ----------------------------------------------------------------------------

/// A coordinator served on a socket file ([`SocketServer`]): one connection per request.
#[derive(Debug, Clone)]
pub struct SocketTransport {
    path: PathBuf,
}

impl SocketTransport {
    /// The server on `path`, unchecked (see [`connect`]).
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
        }
    }

    /// The socket file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn unreachable(&self, what: impl std::fmt::Display) -> CallError {
        CallError::Api(ApiError::new(
            ApiErrorKind::Unavailable,
            format!(
                "cannot reach the embedded process on `{}`: {what}",
                self.path.display()
            ),
        ))
    }

    async fn exchange(&self, req: &ApiRequest) -> Result<ApiReply, CallError> {
        let payload = wire::encode(req)?;
        let token = std::fs::read(token_path(&self.path)).map_err(|e| {
            self.unreachable(format!(
                "cannot read its token `{}`: {e}",
                token_path(&self.path).display()
            ))
        })?;
        let mut stream = UnixStream::connect(&self.path)
            .await
            .map_err(|e| self.unreachable(e))?;
        write_frame(&mut stream, &token)
            .await
            .map_err(|e| self.unreachable(e))?;
        write_frame(&mut stream, &payload)
            .await
            .map_err(|e| self.unreachable(e))?;
        let answer = read_frame(&mut stream)
            .await
            .map_err(|e| self.unreachable(e))?
            .ok_or_else(|| {
                self.unreachable("it closed the connection before answering (it is stopping?)")
            })?;
        match wire::decode::<ApiResponse>(&answer)? {
            ApiResponse::Ok(reply) => Ok(*reply),
            ApiResponse::Err(e) => Err(CallError::Api(e)),
        }
    }
}

#[async_trait]
impl Transport for SocketTransport {
    async fn request(&self, req: ApiRequest, timeout: Duration) -> Result<ApiReply, CallError> {
        let op = req.op();
        match tokio::time::timeout(timeout, self.exchange(&req)).await {
            Ok(reply) => reply,
            Err(_) => Err(CallError::Api(ApiError::new(
                ApiErrorKind::Unavailable,
                format!(
                    "`{op}` got no answer from the embedded process on `{}` within {} ms",
                    self.path.display(),
                    timeout.as_millis()
                ),
            ))),
        }
    }
}

/// The server on the socket file `path`, if one listens there. No file: `None`. A socket
/// file nobody listens on (its process was killed) is removed: `None`. Anything else that
/// is not a socket is left alone: `None`. An error only when the file is there but cannot
/// be examined or connected to for another reason.
pub async fn connect(path: &Path) -> io::Result<Option<SocketTransport>> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Ok(None);
    }
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(path))
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no connection within {} s", CONNECT_TIMEOUT.as_secs()),
            )
        })?;
    match connected {
        Ok(_) => Ok(Some(SocketTransport::new(path))),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
            ) =>
        {
            tracing::info!(api.socket = %path.display(), "api.socket stale: nobody listens; removing it");
            match std::fs::remove_file(path) {
                Ok(()) => Ok(None),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

/// The run store's blobs, read through the socket (`get_blob`). Uploading a blob the store
/// lacks is refused: only the process holding the store can create forks in it.
pub struct SocketBlobs {
    transport: Arc<SocketTransport>,
}

impl SocketBlobs {
    pub fn new(transport: Arc<SocketTransport>) -> Self {
        Self { transport }
    }
}

#[async_trait]
impl BlobStore for SocketBlobs {
    async fn put(&self, hash: BlobHash, _bytes: Bytes) -> Result<(), BlobError> {
        if self.get(&hash).await?.is_some() {
            return Ok(());
        }
        Err(BlobError::Backend(format!(
            "cannot upload blob {} through `{}`: the embedded process holding this data dir serves reads and steering, not new forks; create forks once it has stopped, or on a cluster (--nats)",
            hash.short(),
            self.transport.path().display()
        )))
    }

    async fn get(&self, hash: &BlobHash) -> Result<Option<Bytes>, BlobError> {
        let op = GetBlob { blob: *hash };
        let timeout = op.timeout();
        let reply = self
            .transport
            .request(op.into(), timeout)
            .await
            .map_err(|e| BlobError::Backend(e.message()))?;
        GetBlob::from_reply(reply).map_err(|got| {
            BlobError::Backend(format!(
                "the embedded process answered `{got}` to a `{}` request",
                GetBlob::NAME
            ))
        })
    }

    async fn missing(&self, hashes: &[BlobHash]) -> Result<Vec<BlobHash>, BlobError> {
        let mut out = Vec::new();
        for hash in hashes {
            if self.get(hash).await?.is_none() {
                out.push(*hash);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;

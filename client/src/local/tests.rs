use super::*;
use forkfleet_shared::api::{Handler, Ping};
use std::os::unix::fs::PermissionsExt;

/// A server that answers every operation with a `not_found` error naming it, so a test
/// sees which handler a request reached.
#[derive(Clone)]
struct Echo;

impl<O: Operation> Handler<O> for Echo {
    async fn handle(&self, _caller: &Caller, _op: O) -> Result<O::Reply, ApiError> {
        Err(ApiError::new(ApiErrorKind::NotFound, O::NAME))
    }
}

const LIMIT: Duration = Duration::from_secs(10);

/// A server on `dir/api.sock` and the sender that stops it.
fn start(
    dir: &Path,
) -> (
    PathBuf,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let path = socket_path(dir);
    let server = SocketServer::bind(&path).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(Echo, async {
        let _ = stopped.await;
    }));
    (path, stop, task)
}

/// A connection to the server on `path` that has sent the token (as every client does).
async fn open(path: &Path) -> UnixStream {
    let mut stream = UnixStream::connect(path).await.unwrap();
    let token = std::fs::read(token_path(path)).unwrap();
    write_frame(&mut stream, &token).await.unwrap();
    stream
}

async fn response(stream: &mut UnixStream) -> ApiResponse {
    let bytes = tokio::time::timeout(LIMIT, read_frame(stream))
        .await
        .unwrap()
        .unwrap()
        .expect("an answer");
    wire::decode::<ApiResponse>(&bytes).unwrap()
}

#[tokio::test]
async fn requests_reach_their_handler_and_the_socket_is_private_and_removed_after() {
    let dir = tempfile::tempdir().unwrap();
    let (path, stop, task) = start(dir.path());
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");

    let transport = connect(&path).await.unwrap().expect("a live server");
    let err = transport.request(Ping.into(), LIMIT).await.unwrap_err();
    match err {
        CallError::Api(e) => {
            assert_eq!(e.kind, ApiErrorKind::NotFound);
            assert_eq!(e.message, "ping");
        }
        other => panic!("{other}"),
    }
    let blobs = SocketBlobs::new(Arc::new(transport));
    let hash = BlobHash::of(b"x");
    assert!(blobs.get(&hash).await.is_err(), "the error comes through");

    stop.send(()).unwrap();
    tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    assert!(!path.exists(), "the socket file is removed on shutdown");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test]
async fn a_connection_without_the_token_gets_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (path, stop, task) = start(dir.path());
    let token = token_path(&path);
    let mode = std::fs::metadata(&token).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "token mode {mode:o}");
    assert_eq!(std::fs::read(&token).unwrap().len(), 64);
    // A request straight away (a process that could not read the token): refused, closed.
    let mut stream = UnixStream::connect(&path).await.unwrap();
    write_frame(&mut stream, &wire::encode(&ApiRequest::from(Ping)).unwrap())
        .await
        .unwrap();
    match response(&mut stream).await {
        ApiResponse::Err(e) => assert!(e.message.contains("api.token"), "{}", e.message),
        other => panic!("{other:?}"),
    }
    let closed = tokio::time::timeout(LIMIT, read_frame(&mut stream))
        .await
        .unwrap();
    assert!(
        matches!(closed, Ok(None) | Err(_)),
        "the connection is closed"
    );
    // A wrong token likewise; the right one is answered.
    let mut stream = UnixStream::connect(&path).await.unwrap();
    write_frame(&mut stream, &[b'0'; 64]).await.unwrap();
    assert!(matches!(response(&mut stream).await, ApiResponse::Err(_)));
    let transport = connect(&path).await.unwrap().expect("a live server");
    let err = transport.request(Ping.into(), LIMIT).await.unwrap_err();
    assert!(matches!(err, CallError::Api(e) if e.message == "ping"));
    stop.send(()).unwrap();
    tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    assert!(!token.exists(), "the token goes with the socket");
}

#[tokio::test]
async fn garbage_is_answered_with_bad_input_and_the_connection_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (path, stop, task) = start(dir.path());
    let mut stream = open(&path).await;
    write_frame(&mut stream, b"\xc1 not msgpack").await.unwrap();
    match response(&mut stream).await {
        ApiResponse::Err(e) => {
            assert_eq!(e.kind, ApiErrorKind::BadInput);
            assert!(e.message.contains("malformed"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    // A response is not a request.
    let wrong = wire::encode(&ApiResponse::Err(ApiError::new(ApiErrorKind::Failure, "x"))).unwrap();
    write_frame(&mut stream, &wrong).await.unwrap();
    assert!(matches!(response(&mut stream).await, ApiResponse::Err(e) if e.is_bad_input()));
    // The same connection still answers a real request.
    write_frame(&mut stream, &wire::encode(&ApiRequest::from(Ping)).unwrap())
        .await
        .unwrap();
    assert!(matches!(response(&mut stream).await, ApiResponse::Err(e) if e.message == "ping"));
    stop.send(()).unwrap();
    tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
}

#[tokio::test]
async fn a_frame_over_the_limit_is_refused_and_the_connection_closed() {
    let dir = tempfile::tempdir().unwrap();
    let (path, stop, task) = start(dir.path());
    let mut stream = open(&path).await;
    let len = (MAX_FRAME_BYTES as u32) + 1;
    stream.write_all(&len.to_be_bytes()).await.unwrap();
    match response(&mut stream).await {
        ApiResponse::Err(e) => {
            assert_eq!(e.kind, ApiErrorKind::BadInput);
            assert!(e.message.contains("larger than"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    let next = tokio::time::timeout(LIMIT, read_frame(&mut stream))
        .await
        .unwrap()
        .unwrap();
    assert!(next.is_none(), "the server closed the connection");
    // Writing a frame over the limit is refused before anything is sent.
    let big = vec![0u8; MAX_FRAME_BYTES + 1];
    let mut sink = Vec::new();
    assert!(matches!(
        write_frame(&mut sink, &big).await,
        Err(FrameError::TooLarge { .. })
    ));
    assert!(sink.is_empty());
    stop.send(()).unwrap();
    tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
}

#[tokio::test]
async fn a_stale_socket_file_is_removed_and_other_files_are_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_path(dir.path());
    assert!(connect(&path).await.unwrap().is_none(), "no file");

    // A socket nobody listens on any more (its process was killed).
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    assert!(connect(&path).await.unwrap().is_none());
    assert!(!path.exists(), "the stale socket file is removed");

    std::fs::write(&path, "not a socket").unwrap();
    assert!(connect(&path).await.unwrap().is_none());
    assert!(path.exists(), "a file that is not a socket is not removed");
    std::fs::remove_file(&path).unwrap();

    // A new server replaces a stale file.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let (path, stop, task) = start(dir.path());
    assert!(connect(&path).await.unwrap().is_some());
    stop.send(()).unwrap();
    tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
}

//! Talking to a coordinator: [`CoordinatorClient`] is what every CLI command uses. Each of
//! its methods is one [`ApiRequest`], answered by the embedded coordinator in this process
//! (`forkfleet_coordinator::service::dispatch`, the service's own dispatch) or sent by
//! [`RemoteCoordinator`] over the bus's request/reply, so every command works unchanged,
//! errors included, against either.
//!
//! Every remote call is bounded: the request carries the coordinator's own wait (capped at
//! [`MAX_API_WAIT_MS`]), and the bus request times out a margin after it.

use forkfleet_bus::apicall::{self, CallError};
use forkfleet_bus::Bus;
use forkfleet_coordinator::CoordinatorHandle;
use forkfleet_shared::api::{
    AbortOutcome, ApiError, ApiErrorKind, ApiReply, ApiRequest, CheckpointView, ContinueOutcome,
    CreateFork, ForkView, ForkWatch, LoggedEvent, MergeOutcome, NewRunOutcome, ResolveReport,
    RewindOutcome, ServerInfo, SteerOutcome, TerminateOutcome, API_SUBJECT, MAX_API_WAIT_MS,
};
use forkfleet_shared::blob::{BlobHash, BlobStore};
use forkfleet_shared::budget::{AccountView, ForkCost};
use forkfleet_shared::diff::{DiffOptions, DiffReport};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::protocol::WorkerInfo;
use forkfleet_shared::resolve::Strategy;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bound of a quick call (views, lists, a terminate).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound of a call that does real work on the coordinator (create, diff, merge).
pub const WORK_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest a resolve may take: tests on every branch (each bounded by the plan's
/// `test_timeout_s`, at most an hour), then the judges.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2 * 3600);
/// What a waiting call adds to the wait it asks for, for the trip and the answer.
const WAIT_MARGIN: Duration = Duration::from_secs(10);

/// Why a call to a coordinator failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The coordinator answered with an error (embedded or remote alike), could not be
    /// reached, or answered something unexpected.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The command needs something only a cluster has.
    #[error("{0}")]
    NeedsCluster(&'static str),
}

impl ClientError {
    /// True when the request can be fixed by the user (exit code 2).
    pub fn is_bad_input(&self) -> bool {
        match self {
            ClientError::Call(CallError::Api(e)) => e.is_bad_input(),
            ClientError::NeedsCluster(_) => true,
            _ => false,
        }
    }
}

/// A coordinator reached over the bus.
#[derive(Clone)]
pub struct RemoteCoordinator {
    bus: Arc<dyn Bus>,
    subject: String,
}

/// Pull the expected variant out of a reply, or say what came instead.
macro_rules! expect_reply {
    ($reply:expr, $op:expr, $variant:path) => {
        match $reply {
            $variant(v) => Ok(v),
            other => Err(ClientError::Call(CallError::UnexpectedReply {
                op: $op,
                got: other.name(),
            })),
        }
    };
}

impl RemoteCoordinator {
    /// The coordinator serving [`API_SUBJECT`] on `bus`.
    pub fn new(bus: Arc<dyn Bus>) -> Self {
        Self::on_subject(bus, API_SUBJECT)
    }

    pub fn on_subject(bus: Arc<dyn Bus>, subject: &str) -> Self {
        Self {
            bus,
            subject: subject.to_string(),
        }
    }

    pub fn bus(&self) -> &Arc<dyn Bus> {
        &self.bus
    }

    /// Send one request and decode its answer (see [`apicall::call`]).
    pub async fn call(&self, req: ApiRequest, timeout: Duration) -> Result<ApiReply, ClientError> {
        Ok(apicall::call(self.bus.as_ref(), &self.subject, req, timeout).await?)
    }
}

/// The coordinator a CLI command talks to: the one embedded in this process (over its
/// run store) or a remote one (over NATS). Every method is one [`ApiRequest`] through
/// [`CoordinatorClient::call`], so both answer alike, errors included.
#[derive(Clone)]
pub enum CoordinatorClient {
    Embedded {
        handle: CoordinatorHandle,
        bus: Arc<dyn Bus>,
    },
    Remote(RemoteCoordinator),
}

impl CoordinatorClient {
    pub fn is_remote(&self) -> bool {
        matches!(self, CoordinatorClient::Remote(_))
    }

    /// Where the client uploads blobs and reads merge results.
    pub fn blobs(&self) -> Arc<dyn BlobStore> {
        match self {
            CoordinatorClient::Embedded { bus, .. } => bus.blobs(),
            CoordinatorClient::Remote(r) => r.bus.blobs(),
        }
    }

    /// The bus the client is on (the in-process one when embedded).
    pub fn bus(&self) -> &Arc<dyn Bus> {
        match self {
            CoordinatorClient::Embedded { bus, .. } => bus,
            CoordinatorClient::Remote(r) => &r.bus,
        }
    }

    /// One API request: answered in this process by the embedded coordinator (the same
    /// dispatch the coordinator's service runs), or sent over the bus.
    pub async fn call(&self, req: ApiRequest, timeout: Duration) -> Result<ApiReply, ClientError> {
        match self {
            CoordinatorClient::Embedded { handle, .. } => {
                let op = req.op();
                match tokio::time::timeout(
                    timeout,
                    forkfleet_coordinator::service::dispatch(handle, req),
                )
                .await
                {
                    Ok(reply) => reply.map_err(|e| CallError::Api(e).into()),
                    Err(_) => Err(CallError::Api(ApiError::new(
                        ApiErrorKind::Failure,
                        format!("`{op}` did not finish within {} ms", timeout.as_millis()),
                    ))
                    .into()),
                }
            }
            CoordinatorClient::Remote(r) => r.call(req, timeout).await,
        }
    }

    pub async fn ping(&self) -> Result<ServerInfo, ClientError> {
        let r = self.call(ApiRequest::Ping, CALL_TIMEOUT).await?;
        expect_reply!(r, "ping", ApiReply::Info)
    }

    /// Create a fork. Its blobs must be in the bus's blob store first
    /// (`client::upload_workspace` on [`Bus::blobs`]).
    pub async fn create_fork(&self, req: CreateFork) -> Result<ForkView, ClientError> {
        let r = self
            .call(ApiRequest::CreateFork(Box::new(req)), WORK_TIMEOUT)
            .await?;
        expect_reply!(r, "create_fork", ApiReply::Fork)
    }

    pub async fn fork(&self, fork: ForkId) -> Result<ForkView, ClientError> {
        let r = self.call(ApiRequest::Fork { fork }, CALL_TIMEOUT).await?;
        expect_reply!(r, "fork", ApiReply::Fork)
    }

    pub async fn forks(&self) -> Result<Vec<ForkView>, ClientError> {
        let r = self.call(ApiRequest::Forks, CALL_TIMEOUT).await?;
        expect_reply!(r, "forks", ApiReply::Forks)
    }

    pub async fn find_fork(&self, prefix: &str) -> Result<ForkId, ClientError> {
        // A full id needs no round trip (and so works while the coordinator is away: an
        // unknown one is reported by the call that uses it).
        if let Ok(id) = prefix.parse::<ForkId>() {
            return Ok(id);
        }
        let req = ApiRequest::FindFork {
            prefix: prefix.to_string(),
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "find_fork", ApiReply::ForkId)
    }

    /// The view once nothing runs (every branch is terminal, or paused by a budget cap
    /// waiting for a top-up), waiting at most `timeout` (asking again every
    /// [`MAX_API_WAIT_MS`]).
    pub async fn wait_settled(
        &self,
        fork: ForkId,
        timeout: Duration,
    ) -> Result<ForkView, ClientError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let wait = left.min(Duration::from_millis(MAX_API_WAIT_MS));
            let req = ApiRequest::WaitSettled {
                fork,
                timeout_ms: wait.as_millis() as u64,
            };
            let asked = Instant::now();
            match self.call(req, wait + WAIT_MARGIN).await {
                Ok(ApiReply::Fork(view)) => return Ok(view),
                Ok(other) => {
                    return Err(ClientError::Call(CallError::UnexpectedReply {
                        op: "wait_settled",
                        got: other.name(),
                    }))
                }
                // Not settled within this round (the coordinator answers a timeout only
                // after the whole wait): ask again while time is left.
                Err(ClientError::Call(CallError::Api(e)))
                    if e.kind == ApiErrorKind::Failure
                        && asked.elapsed() >= wait
                        && Instant::now() < deadline =>
                {
                    tracing::debug!(error = %e.message, "api.wait_settled: asking again");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The view once its version differs from `seen`, or after `wait` (capped at
    /// [`MAX_API_WAIT_MS`]).
    pub async fn watch(
        &self,
        fork: ForkId,
        seen: Option<u64>,
        wait: Duration,
    ) -> Result<ForkWatch, ClientError> {
        let wait = wait.min(Duration::from_millis(MAX_API_WAIT_MS));
        let req = ApiRequest::Watch {
            fork,
            seen,
            timeout_ms: wait.as_millis() as u64,
        };
        let r = self.call(req, wait + WAIT_MARGIN).await?;
        expect_reply!(r, "watch", ApiReply::Watch)
    }

    pub async fn diff(
        &self,
        fork: ForkId,
        options: DiffOptions,
    ) -> Result<DiffReport, ClientError> {
        let r = self
            .call(ApiRequest::Diff { fork, options }, WORK_TIMEOUT)
            .await?;
        expect_reply!(r, "diff", ApiReply::Diff)
    }

    pub async fn merge(&self, fork: ForkId, pick: &str) -> Result<MergeOutcome, ClientError> {
        let req = ApiRequest::Merge {
            fork,
            pick: pick.to_string(),
        };
        let r = self.call(req, WORK_TIMEOUT).await?;
        expect_reply!(r, "merge", ApiReply::Merge)
    }

    pub async fn terminate(
        &self,
        fork: ForkId,
        label: &str,
    ) -> Result<TerminateOutcome, ClientError> {
        let req = ApiRequest::Terminate {
            fork,
            label: label.to_string(),
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "terminate", ApiReply::Terminate)
    }

    pub async fn abort(&self, fork: ForkId) -> Result<AbortOutcome, ClientError> {
        let r = self.call(ApiRequest::Abort { fork }, CALL_TIMEOUT).await?;
        expect_reply!(r, "abort", ApiReply::Abort)
    }

    /// Send a pending or running branch a user message, applied before its next model call.
    pub async fn steer(
        &self,
        fork: ForkId,
        label: &str,
        text: &str,
    ) -> Result<SteerOutcome, ClientError> {
        let req = ApiRequest::Steer {
            fork,
            label: label.to_string(),
            text: text.to_string(),
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "steer", ApiReply::Steer)
    }

    /// Start a new turn of a finished branch with a user message (ADR 13).
    pub async fn continue_branch(
        &self,
        fork: ForkId,
        label: &str,
        text: &str,
    ) -> Result<ContinueOutcome, ClientError> {
        let req = ApiRequest::Continue {
            fork,
            label: label.to_string(),
            text: text.to_string(),
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "continue", ApiReply::Continue).map(|b| *b)
    }

    pub async fn run_events(&self, run: RunId) -> Result<Vec<LoggedEvent>, ClientError> {
        let r = self
            .call(ApiRequest::RunEvents { run }, CALL_TIMEOUT)
            .await?;
        expect_reply!(r, "run_events", ApiReply::Events)
    }

    pub async fn checkpoints(&self, run: RunId) -> Result<Vec<CheckpointView>, ClientError> {
        let r = self
            .call(ApiRequest::Checkpoints { run }, CALL_TIMEOUT)
            .await?;
        expect_reply!(r, "checkpoints", ApiReply::Checkpoints)
    }

    /// Spent, reserved, cap and remaining per branch, for the fork and its account.
    pub async fn fork_cost(&self, fork: ForkId) -> Result<ForkCost, ClientError> {
        let r = self
            .call(ApiRequest::ForkCost { fork }, CALL_TIMEOUT)
            .await?;
        expect_reply!(r, "fork_cost", ApiReply::Cost)
    }

    /// Raise a cap by `usd` (branch `branch`'s, else the fork's aggregate cap) and resume
    /// what it paused.
    pub async fn topup(
        &self,
        fork: ForkId,
        branch: Option<&str>,
        usd: f64,
    ) -> Result<ForkCost, ClientError> {
        let req = ApiRequest::Topup {
            fork,
            branch: branch.map(str::to_string),
            usd,
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "topup", ApiReply::Cost)
    }

    /// Move `usd` of cap from branch `from` to branch `to`.
    pub async fn move_budget(
        &self,
        fork: ForkId,
        from: &str,
        to: &str,
        usd: f64,
    ) -> Result<ForkCost, ClientError> {
        let req = ApiRequest::MoveBudget {
            fork,
            from: from.to_string(),
            to: to.to_string(),
            usd,
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "move_budget", ApiReply::Cost)
    }

    /// Create account `name` or change its cap (`None`: no cap).
    pub async fn account_set(
        &self,
        name: &str,
        cap_usd: Option<f64>,
    ) -> Result<AccountView, ClientError> {
        let req = ApiRequest::AccountSet {
            name: name.to_string(),
            cap_usd,
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "account_set", ApiReply::Account)
    }

    /// Every account, by name.
    pub async fn accounts(&self) -> Result<Vec<AccountView>, ClientError> {
        let r = self.call(ApiRequest::Accounts, CALL_TIMEOUT).await?;
        expect_reply!(r, "accounts", ApiReply::Accounts)
    }

    /// Resolve a fork (tests, judges, decision, merge on a commit). Bounded by
    /// [`RESOLVE_TIMEOUT`]: the coordinator bounds each test by the plan's timeout and
    /// each judge call by its own.
    pub async fn resolve(
        &self,
        fork: ForkId,
        strategy: Option<Strategy>,
    ) -> Result<ResolveReport, ClientError> {
        let r = self
            .call(ApiRequest::Resolve { fork, strategy }, RESOLVE_TIMEOUT)
            .await?;
        expect_reply!(r, "resolve", ApiReply::Resolve).map(|b| *b)
    }

    /// The live workers (from their heartbeats on the bus, not from the coordinator).
    pub async fn workers(&self) -> Result<Vec<WorkerInfo>, ClientError> {
        Ok(self.bus().workers().await.map_err(CallError::from)?)
    }

    /// A run by full id or unique prefix.
    /// A root run's current workspace version.
    pub async fn run_workspace(&self, run: RunId) -> Result<BlobHash, ClientError> {
        let r = self
            .call(ApiRequest::RunWorkspace { run }, CALL_TIMEOUT)
            .await?;
        expect_reply!(r, "run_workspace", ApiReply::Workspace)
    }

    pub async fn find_run(&self, prefix: &str) -> Result<RunId, ClientError> {
        if let Ok(id) = prefix.trim().parse::<RunId>() {
            return Ok(id);
        }
        let req = ApiRequest::FindRun {
            prefix: prefix.to_string(),
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "find_run", ApiReply::RunId)
    }

    pub async fn checkpoint_save(
        &self,
        run: RunId,
        label: &str,
    ) -> Result<CheckpointView, ClientError> {
        let req = ApiRequest::CheckpointSave {
            run,
            label: label.to_string(),
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "checkpoint_save", ApiReply::Checkpoint)
    }

    pub async fn checkpoint_remove(
        &self,
        run: RunId,
        checkpoint: &str,
    ) -> Result<CheckpointView, ClientError> {
        let req = ApiRequest::CheckpointRemove {
            run,
            checkpoint: checkpoint.to_string(),
        };
        let r = self.call(req, CALL_TIMEOUT).await?;
        expect_reply!(r, "checkpoint_remove", ApiReply::Checkpoint)
    }

    pub async fn checkpoint_clear(&self, run: RunId) -> Result<Vec<CheckpointView>, ClientError> {
        let r = self
            .call(ApiRequest::CheckpointClear { run }, CALL_TIMEOUT)
            .await?;
        expect_reply!(r, "checkpoint_clear", ApiReply::Checkpoints)
    }

    pub async fn rewind(
        &self,
        run: RunId,
        checkpoint: &str,
        dry_run: bool,
    ) -> Result<RewindOutcome, ClientError> {
        let req = ApiRequest::Rewind {
            run,
            checkpoint: checkpoint.to_string(),
            dry_run,
        };
        let r = self.call(req, WORK_TIMEOUT).await?;
        expect_reply!(r, "rewind", ApiReply::Rewind).map(|b| *b)
    }

    pub async fn fork_checkpoint(
        &self,
        run: RunId,
        checkpoint: &str,
    ) -> Result<NewRunOutcome, ClientError> {
        let req = ApiRequest::ForkCheckpoint {
            run,
            checkpoint: checkpoint.to_string(),
        };
        let r = self.call(req, WORK_TIMEOUT).await?;
        expect_reply!(r, "fork_checkpoint", ApiReply::NewRun)
    }
}

//! The coordinator's API, declared once.
//!
//! Each operation is one entry of the `operations!` invocation at the bottom of this file:
//! its request type (with its fields and docs), its name on the wire, the client method
//! that sends it, the [`ApiReply`] variant it answers with, whether asking twice is the same
//! as asking once, and how long a client waits for the answer. From that one entry come:
//!
//! - the request struct (`Merge { fork, pick }`) and its [`Operation`] impl;
//! - its variant of [`ApiRequest`] (what travels on the wire) and [`ApiRequest::op`];
//! - the [`Handler`] bound of [`ApiHandler`], so a server that lacks a handler for it does
//!   not compile, and its arm of [`dispatch`];
//! - the [`ApiClient`] method (`client.merge(fork, "a")`) every client gets for free by
//!   implementing [`ApiClient::call`];
//! - its name in [`OPERATIONS`].
//!
//! A new operation is therefore one entry here plus one `impl Handler<NewOp>` in the
//! coordinator (`coordinator/src/api.rs`).
//!
//! The wire form is `{"op": "<name>", "args": {<the struct's fields>}}`; operations without
//! arguments are `{"op": "<name>"}`. Waits are bounded by [`MAX_API_WAIT_MS`].

use super::caller::Caller;
use super::views::*;
use super::{ApiError, ApiErrorKind, MAX_API_WAIT_MS};
use crate::blob::BlobHash;
use crate::budget::{AccountView, ForkCost};
use crate::diff::{DiffOptions, DiffReport};
use crate::ids::{ForkId, RunId};
use crate::resolve::Strategy;
use crate::scan::LeftOut;
use crate::spec::ForkPlan;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::time::Duration;

/// What a caller must be allowed to do for an operation: read (views, lists, logs), write
/// (create, steer, stop, merge, spend), or administer (accounts' caps, garbage collection).
/// The HTTP API's token scopes are these (`docs/HTTP.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    Read,
    Write,
    Admin,
}

impl Access {
    pub fn as_str(&self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
            Access::Admin => "admin",
        }
    }
}

/// One operation's HTTP route, from its declaration: `method` and `path` (under
/// `/api/v1`; `{field}` segments are the request's fields), the access it needs, whether
/// asking twice is asking once, its doc comment, its fields (name and Rust type, in
/// order) and its reply's Rust type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub name: &'static str,
    pub method: &'static str,
    pub path: &'static str,
    pub access: Access,
    pub idempotent: bool,
    pub doc: &'static str,
    pub fields: &'static [(&'static str, &'static str)],
    pub reply: &'static str,
}

impl Route {
    /// The fields its path names (`{fork}` in `/forks/{fork}`), in order.
    pub fn path_fields(&self) -> impl Iterator<Item = &'static str> {
        self.path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
    }

    /// The route of the operation named `name`.
    pub fn of(name: &str) -> Option<&'static Route> {
        ROUTES.iter().find(|r| r.name == name)
    }
}

/// How long a client waits for a quick answer (views, lists, a terminate).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client waits for an operation that does real work on the coordinator
/// (create, diff, merge, rewind).
pub const WORK_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a client waits for a resolve: tests on every branch (each bounded by the plan's
/// `test_timeout_s`, at most an hour), then the judges (each call bounded by its own).
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2 * 3600);
/// What a waiting operation's client adds to the wait it asks for, for the trip and the
/// answer.
pub const WAIT_MARGIN: Duration = Duration::from_secs(10);

/// One operation of the API: a request type and what it answers.
pub trait Operation: Into<ApiRequest> + Send + Sized + 'static {
    /// The name on the wire (`{"op": NAME}`) and in logs and traces.
    const NAME: &'static str;
    /// Asking twice has the same effect as asking once (reads, and writes that set a value
    /// or stop something), so a client may ask again when no answer came.
    const IDEMPOTENT: bool;
    /// What a successful answer carries.
    type Reply: Send + 'static;
    /// How long a client waits for the answer to this request.
    fn timeout(&self) -> Duration;
    /// The reply on the wire.
    fn into_reply(reply: Self::Reply) -> ApiReply;
    /// The reply from the wire; `Err` names the kind of a reply of another kind.
    fn from_reply(reply: ApiReply) -> Result<Self::Reply, &'static str>;
}

/// Answers one operation. The coordinator implements it once per operation; [`dispatch`]
/// routes each request to its handler, with who sent it ([`Caller`]).
pub trait Handler<O: Operation>: Send + Sync {
    fn handle(
        &self,
        caller: &Caller,
        op: O,
    ) -> impl Future<Output = Result<O::Reply, ApiError>> + Send;
}

/// The wait a waiting request asks for, as the coordinator honours it (capped at
/// [`MAX_API_WAIT_MS`]).
pub fn bounded_wait(timeout_ms: u64) -> Duration {
    Duration::from_millis(timeout_ms.min(MAX_API_WAIT_MS))
}

macro_rules! idempotent {
    (idempotent) => {
        true
    };
    (changes) => {
        false
    };
}

macro_rules! timeout_of {
    ($self:ident, quick) => {
        CALL_TIMEOUT
    };
    ($self:ident, work) => {
        WORK_TIMEOUT
    };
    ($self:ident, resolve) => {
        RESOLVE_TIMEOUT
    };
    // A waiting operation has a `timeout_ms` field: the coordinator holds the request that
    // long (capped), so the client waits that plus a margin.
    ($self:ident, wait) => {
        bounded_wait($self.timeout_ms) + WAIT_MARGIN
    };
}

/// `impl Operation` for one declared operation.
macro_rules! operation_impl {
    ($T:ident, $wire:literal, $idem:ident, $time:ident, $RV:ident($R:ty)) => {
        impl Operation for $T {
            const NAME: &'static str = $wire;
            const IDEMPOTENT: bool = idempotent!($idem);
            type Reply = $R;
            fn timeout(&self) -> Duration {
                timeout_of!(self, $time)
            }
            fn into_reply(reply: $R) -> ApiReply {
                ApiReply::$RV(reply)
            }
            fn from_reply(reply: ApiReply) -> Result<$R, &'static str> {
                match reply {
                    ApiReply::$RV(v) => Ok(v),
                    other => Err(other.name()),
                }
            }
        }
    };
}

macro_rules! access_of {
    (read) => {
        Access::Read
    };
    (write) => {
        Access::Write
    };
    (admin) => {
        Access::Admin
    };
}

macro_rules! operations {
    (
        without_args {
            $(
                $(#[doc = $udoc:literal])*
                $U:ident = $uwire:literal, fn $umethod:ident
                    -> $URV:ident($UR:ty), $uidem:ident, $utime:ident,
                    $uaccess:ident, $uhmethod:ident $uhpath:literal;
            )*
        }
        with_args {
            $(
                $(#[doc = $doc:literal])*
                $N:ident = $wire:literal, fn $method:ident {
                    $( $(#[$fmeta:meta])* $field:ident : $fty:ty ),* $(,)?
                } -> $RV:ident($R:ty), $idem:ident, $time:ident,
                    $access:ident, $hmethod:ident $hpath:literal;
            )*
        }
    ) => {
        /// Every operation's HTTP route and what a caller needs for it, in declaration
        /// order: what the HTTP API (`/api/v1`) serves and its OpenAPI document says.
        pub const ROUTES: &[Route] = &[
            $( Route {
                name: $uwire,
                method: stringify!($uhmethod),
                path: $uhpath,
                access: access_of!($uaccess),
                idempotent: idempotent!($uidem),
                doc: concat!($($udoc, "\n",)*),
                fields: &[],
                reply: stringify!($UR),
            }, )*
            $( Route {
                name: $wire,
                method: stringify!($hmethod),
                path: $hpath,
                access: access_of!($access),
                idempotent: idempotent!($idem),
                doc: concat!($($doc, "\n",)*),
                fields: &[$( (stringify!($field), stringify!($fty)), )*],
                reply: stringify!($R),
            }, )*
        ];

        $(
            $(#[doc = $udoc])*
            #[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
            pub struct $U;

            operation_impl!($U, $uwire, $uidem, $utime, $URV($UR));

            impl From<$U> for ApiRequest {
                fn from(_: $U) -> Self {
                    ApiRequest::$U
                }
            }
        )*
        $(
            $(#[doc = $doc])*
            #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
            pub struct $N {
                $( $(#[$fmeta])* pub $field: $fty, )*
            }

            operation_impl!($N, $wire, $idem, $time, $RV($R));

            impl From<$N> for ApiRequest {
                fn from(op: $N) -> Self {
                    ApiRequest::$N(op)
                }
            }
        )*

        /// A request to the coordinator's API: one variant per operation, encoded in the
        /// wire envelope (kind `api_request`) as `{"op": "<name>", "args": {...}}`; the
        /// answer is an [`super::ApiResponse`].
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "op", content = "args")]
        // A request lives for one call; boxing the large ones would only add allocations.
        #[allow(clippy::large_enum_variant)]
        pub enum ApiRequest {
            $( $(#[doc = $udoc])* #[serde(rename = $uwire)] $U, )*
            $( $(#[doc = $doc])* #[serde(rename = $wire)] $N($N), )*
            /// The request itself is too large for one message: it is the `api_request`
            /// envelope stored as this blob in the bus's blob store.
            #[serde(rename = "stored")]
            Stored { blob: BlobHash },
        }

        impl ApiRequest {
            /// The operation's name, as on the wire.
            pub fn op(&self) -> &'static str {
                match self {
                    $( ApiRequest::$U => $uwire, )*
                    $( ApiRequest::$N(_) => $wire, )*
                    ApiRequest::Stored { .. } => "stored",
                }
            }

            /// Asking twice has the same effect as asking once (see
            /// [`Operation::IDEMPOTENT`]).
            pub fn is_idempotent(&self) -> bool {
                match self {
                    $( ApiRequest::$U => <$U as Operation>::IDEMPOTENT, )*
                    $( ApiRequest::$N(_) => <$N as Operation>::IDEMPOTENT, )*
                    ApiRequest::Stored { .. } => false,
                }
            }
        }

        /// Every operation's name on the wire, in declaration order.
        pub const OPERATIONS: &[&str] = &[$($uwire,)* $($wire,)*];

        /// A server of the whole API: a [`Handler`] for every operation. Implemented for
        /// any type that has them all, so a missing handler is a compile error where the
        /// server is used.
        pub trait ApiHandler: $(Handler<$U> +)* $(Handler<$N> +)* Send + Sync {}

        impl<T> ApiHandler for T where T: $(Handler<$U> +)* $(Handler<$N> +)* Send + Sync {}

        /// Answer one request from `caller` with `handler`: what the coordinator's service
        /// does for each request it receives (the caller from its subject), and what an
        /// in-process client calls directly (as [`Caller::Admin`]).
        pub async fn dispatch<H: ApiHandler>(
            handler: &H,
            caller: &Caller,
            req: ApiRequest,
        ) -> Result<ApiReply, ApiError> {
            // Every transport's requests are bounded alike (HTTP, NATS, in process).
            super::limits::check_request_size(&req)?;
            match req {
                $( ApiRequest::$U => <H as Handler<$U>>::handle(handler, caller, $U).await.map(<$U>::into_reply), )*
                $( ApiRequest::$N(op) => <H as Handler<$N>>::handle(handler, caller, op).await.map(<$N>::into_reply), )*
                ApiRequest::Stored { .. } => Err(ApiError::new(
                    ApiErrorKind::BadInput,
                    "a stored request cannot name another stored request",
                )),
            }
        }

        /// A client of the API: implement [`ApiClient::call`] (send one request, wait for
        /// its answer) and get one method per operation.
        pub trait ApiClient: Send + Sync {
            /// Why a call failed (the API's error, or the transport's).
            type Error: From<ApiError> + Send;

            /// Send one request and wait (at most [`Operation::timeout`]) for its answer.
            fn call<O: Operation>(
                &self,
                op: O,
            ) -> impl Future<Output = Result<O::Reply, Self::Error>> + Send;

            $(
                $(#[doc = $udoc])*
                fn $umethod(&self) -> impl Future<Output = Result<$UR, Self::Error>> + Send {
                    self.call($U)
                }
            )*
            $(
                $(#[doc = $doc])*
                fn $method(
                    &self,
                    $( $field: impl Into<$fty> + Send, )*
                ) -> impl Future<Output = Result<$R, Self::Error>> + Send {
                    self.call($N { $( $field: $field.into(), )* })
                }
            )*
        }
    };
}

operations! {
    without_args {
        /// The coordinator's version and wire version.
        Ping = "ping", fn ping -> Info(ServerInfo), idempotent, quick, read, GET "/ping";
        /// Every fork, newest first.
        Forks = "forks", fn forks -> Forks(Vec<ForkView>), idempotent, quick, read, GET "/forks";
        /// Every account, by name.
        Accounts = "accounts", fn accounts -> Accounts(Vec<AccountView>), idempotent, quick, read, GET "/accounts";
        /// Every run of the store, oldest first, with its lineage (docs/LINEAGE.md).
        Runs = "runs", fn runs -> Runs(Vec<RunView>), idempotent, quick, read, GET "/runs";
        /// The live workers (their heartbeats) and the branches each runs; a scoped client
        /// sees the running branches of its accounts' forks only.
        ListWorkers = "workers", fn list_workers -> Workers(Vec<crate::protocol::WorkerInfo>), idempotent, quick, read, GET "/workers";
    }
    with_args {
        /// Create a fork. Every blob the snapshot names (the workspace's files, scripts)
        /// must already be in the bus's blob store.
        CreateFork = "create_fork", fn create_fork {
            plan: ForkPlan,
            parent: ParentRun,
            /// The workspace snapshot (a `Manifest` blob).
            snapshot: BlobHash,
            /// Where the workspace lives on the client, for display only.
            workspace: Option<String>,
            /// What the snapshot left out (`exclude`, the ignore files), for display only.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            left_out: Option<LeftOut>,
            /// The git commit the workspace was at, when it is in a git repository (what
            /// `fork merge --git-branch` commits on top of). Absent from older clients.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            git: Option<GitHead>,
        } -> Fork(ForkView), changes, work, write, POST "/forks";

        /// An agent forks its own branch run: the coordinator makes the fork's plan from
        /// the plan of the fork the agent's run belongs to (goal, models, limits, budget
        /// policy, resolve settings, tools), with these branches.
        AgentFork = "agent_fork", fn agent_fork {
            /// The agent's run (a branch run).
            parent_run: RunId,
            /// The last seq of the parent's log the branches' history includes.
            cutoff_seq: u64,
            /// The agent's workspace as it is now (a `Manifest` blob in the bus's blob
            /// store).
            snapshot: BlobHash,
            branches: Vec<AgentBranch>,
            /// The resolve strategy (the parent plan's when absent).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            strategy: Option<Strategy>,
            /// A cap on the new fork's total spend.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            aggregate_budget_usd: Option<f64>,
        } -> Fork(ForkView), changes, work, write, POST "/runs/{parent_run}/forks";

        /// The agent that made a fork merges branch `pick` into its own run: the fork is
        /// recorded as merged and the winner's change log returned, which the agent (still
        /// running, the only writer of its log) applies to its overlay.
        AgentMerge = "agent_merge", fn agent_merge {
            fork: ForkId,
            pick: String,
            parent_run: RunId,
        } -> Merge(MergeOutcome), changes, work, write, POST "/forks/{fork}/agent-merge";

        /// One fork's view.
        GetFork = "fork", fn fork { fork: ForkId } -> Fork(ForkView), idempotent, quick, read, GET "/forks/{fork}";

        /// A fork by full id or unique prefix.
        FindFork = "find_fork", fn find_fork { prefix: String } -> ForkId(ForkId), idempotent, quick, read, GET "/fork-prefixes/{prefix}";

        /// The view once every branch is terminal or paused, waiting at most `timeout_ms`
        /// (capped at [`MAX_API_WAIT_MS`]; a `failure` error when it does not settle in
        /// time).
        WaitSettled = "wait_settled", fn wait_settled {
            fork: ForkId,
            timeout_ms: u64,
        } -> Fork(ForkView), idempotent, wait, read, GET "/forks/{fork}/settled";

        /// The view once its version differs from `seen` (at once when `seen` is absent or
        /// already stale), or after `timeout_ms` unchanged (capped at [`MAX_API_WAIT_MS`]).
        Watch = "watch", fn watch {
            fork: ForkId,
            seen: Option<u64>,
            timeout_ms: u64,
        } -> Watch(ForkWatch), idempotent, wait, read, GET "/forks/{fork}/watch";

        /// The diff report of a fork's branches.
        Diff = "diff", fn diff {
            fork: ForkId,
            /// What the report holds (the defaults when absent).
            #[serde(default)]
            options: DiffOptions,
        } -> Diff(DiffReport), idempotent, work, read, GET "/forks/{fork}/diff";

        /// Merge the branch labelled `pick` into the fork's parent.
        Merge = "merge", fn merge { fork: ForkId, pick: String } -> Merge(MergeOutcome), changes, work, write, POST "/forks/{fork}/merge";

        /// Stop one branch (it keeps its partial work).
        Terminate = "terminate", fn terminate {
            fork: ForkId,
            label: String,
        } -> Terminate(TerminateOutcome), idempotent, quick, write, POST "/forks/{fork}/branches/{label}/terminate";

        /// Stop every branch still running and mark the fork aborted.
        Abort = "abort", fn abort { fork: ForkId } -> Abort(AbortOutcome), idempotent, quick, write, POST "/forks/{fork}/abort";

        /// Send a user message to a pending or running branch, applied before its next
        /// model call.
        Steer = "steer", fn steer {
            fork: ForkId,
            label: String,
            text: String,
        } -> Steer(SteerOutcome), changes, quick, write, POST "/forks/{fork}/branches/{label}/steer";

        /// The requests for consent that wait (docs/APPROVALS.md), oldest first: every
        /// fork's the caller may see, or one fork's.
        Approvals = "approvals", fn approvals {
            fork: Option<ForkId>,
        } -> Approvals(Vec<crate::approval::ApprovalView>), idempotent, quick, read, GET "/approvals";

        /// Answer the request for consent of branch `label` (the one for `call_id` when
        /// given): approve runs the call, deny answers it as failed with `reason`.
        Decide = "decide", fn decide {
            fork: ForkId,
            label: String,
            call_id: Option<String>,
            approve: bool,
            reason: Option<String>,
        } -> Decision(DecisionOutcome), changes, quick, write, POST "/forks/{fork}/branches/{label}/decide";

        /// Start a new turn of a finished branch (`done`, `failed`, `terminated`) with this
        /// user message, on its whole history and in the same overlay (ADR 13).
        Continue = "continue", fn continue_branch {
            fork: ForkId,
            label: String,
            text: String,
        } -> Continue(ContinueOutcome), changes, quick, write, POST "/forks/{fork}/branches/{label}/continue";

        /// A run's log from seq 0 to the first gap.
        RunEvents = "run_events", fn run_events { run: RunId } -> Events(Vec<LoggedEvent>), idempotent, quick, read, GET "/runs/{run}/events";

        /// A run's checkpoints, oldest first.
        Checkpoints = "checkpoints", fn checkpoints {
            run: RunId,
        } -> Checkpoints(Vec<CheckpointView>), idempotent, quick, read, GET "/runs/{run}/checkpoints";

        /// Spent, reserved, cap and remaining per branch, for the fork and its account.
        GetForkCost = "fork_cost", fn fork_cost { fork: ForkId } -> Cost(ForkCost), idempotent, quick, read, GET "/forks/{fork}/cost";

        /// Raise a cap by `usd` and resume what it paused: the branch's own cap with
        /// `branch`, else the fork's aggregate cap.
        Topup = "topup", fn topup {
            fork: ForkId,
            branch: Option<String>,
            usd: f64,
        } -> Cost(ForkCost), changes, quick, write, POST "/forks/{fork}/topup";

        /// Move `usd` of cap from branch `from` to branch `to` of a fork (both capped;
        /// `from` keeps at least what it spent and holds).
        MoveBudget = "move_budget", fn move_budget {
            fork: ForkId,
            from: String,
            to: String,
            usd: f64,
        } -> Cost(ForkCost), changes, quick, write, POST "/forks/{fork}/move-budget";

        /// Create an account or change its cap (`None`: no cap); resumes what its cap
        /// paused.
        AccountSet = "account_set", fn account_set {
            name: String,
            cap_usd: Option<f64>,
        } -> Account(AccountView), idempotent, quick, admin, PUT "/accounts/{name}";

        /// Resolve a settled fork: run the test command on every branch, ask the judges,
        /// decide by `strategy` (the plan's when absent) and merge when the decision is a
        /// commit.
        Resolve = "resolve", fn resolve {
            fork: ForkId,
            strategy: Option<Strategy>,
            /// Run the tests and judges and decide, but merge nothing (the report is kept
            /// as the fork's verdict).
            #[serde(default, skip_serializing_if = "std::ops::Not::not")]
            no_commit: bool,
            /// The judges' models instead of the plan's (one for `auto` and
            /// `auto_with_fallback`, any number for `vote`).
            #[serde(default, skip_serializing_if = "Vec::is_empty")]
            judge_models: Vec<String>,
        } -> Resolve(ResolveReport), changes, resolve, write, POST "/forks/{fork}/resolve";

        /// The report of a fork's last resolve (verdicts, signals, confidence, decision),
        /// as stored; nothing runs again. `None` when it was never resolved.
        Verdict = "verdict", fn verdict {
            fork: ForkId,
        } -> Verdict(Option<ResolveReport>), idempotent, quick, read, GET "/forks/{fork}/verdict";

        /// Delete merged and aborted forks created at least `older_than_ms` ago (any age
        /// when absent) with their branch runs, checkpoints and the blobs nothing else
        /// refers to; forks something that stays refers to are kept, and the report says
        /// why. With `dry_run`, nothing is deleted. Operators only.
        Gc = "gc", fn gc {
            older_than_ms: Option<u64>,
            dry_run: bool,
            /// Blobs stored more recently than this are kept (an upload for a fork being
            /// created); 10 minutes when absent.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            grace_ms: Option<u64>,
        } -> Gc(GcReport), changes, work, admin, POST "/gc";

        /// Delete one finished fork (merged, aborted, or every branch finished) as `gc`
        /// would; refused, saying why, for a fork still running or one something refers to.
        RemoveFork = "remove_fork", fn remove_fork {
            fork: ForkId,
            dry_run: bool,
        } -> Gc(GcReport), changes, work, write, DELETE "/forks/{fork}";

        /// A run by full id or unique prefix.
        FindRun = "find_run", fn find_run { prefix: String } -> RunId(RunId), idempotent, quick, read, GET "/run-prefixes/{prefix}";

        /// Save a named checkpoint at the run's current end.
        CheckpointSave = "checkpoint_save", fn checkpoint_save {
            run: RunId,
            label: String,
            /// At this seq of the run's log instead of its end (an agent's
            /// `save_checkpoint`: the coordinator waits, bounded, for the log to reach it).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            at: Option<u64>,
        } -> Checkpoint(CheckpointView), changes, quick, write, POST "/runs/{run}/checkpoints";

        /// Remove the checkpoint with this label or id (the reply is the removed one).
        CheckpointRemove = "checkpoint_remove", fn checkpoint_remove {
            run: RunId,
            checkpoint: String,
        } -> Checkpoint(CheckpointView), changes, quick, write, DELETE "/runs/{run}/checkpoints/{checkpoint}";

        /// Remove every checkpoint of a run (the reply lists the removed ones).
        CheckpointClear = "checkpoint_clear", fn checkpoint_clear {
            run: RunId,
        } -> Checkpoints(Vec<CheckpointView>), idempotent, quick, write, DELETE "/runs/{run}/checkpoints";

        /// Send a run back to a checkpoint (label or id): its history and its workspace
        /// version; with `dry_run`, only say what would change.
        Rewind = "rewind", fn rewind {
            run: RunId,
            checkpoint: String,
            dry_run: bool,
        } -> Rewind(RewindOutcome), changes, work, write, POST "/runs/{run}/rewind";

        /// Start a new root run from a checkpoint (label or id): its conversation up to the
        /// checkpoint, on the checkpoint's workspace version.
        ForkCheckpoint = "fork_checkpoint", fn fork_checkpoint {
            run: RunId,
            checkpoint: String,
        } -> NewRun(NewRunOutcome), changes, work, write, POST "/runs/{run}/checkpoints/{checkpoint}/fork";

        /// A root run's current workspace version, to fork the run as it is now (a branch
        /// run is `bad_input`: merge it, or start a new run from one of its checkpoints).
        RunWorkspace = "run_workspace", fn run_workspace {
            run: RunId,
        } -> Workspace(BlobHash), idempotent, quick, read, GET "/runs/{run}/workspace";

        /// One run with its settings and workspace version.
        GetRun = "run", fn run { run: RunId } -> Run(RunDetail), idempotent, work, read, GET "/runs/{run}";

        /// Fork a recorded run at event `at_event` (default: its last replayable event)
        /// into a new child run (docs/LINEAGE.md): its history copied (or, with `replay`,
        /// re-executed from the record), its workspace as it was at the cutoff, `set`
        /// (`KEY=VALUE`) applied to its settings. With `dry_run`, nothing is written.
        RunFork = "run_fork", fn run_fork {
            parent: RunId,
            options: RunForkOptions,
        } -> RunFork(RunForkOutcome), changes, work, write, POST "/runs/{parent}/fork";

        /// Run a child (or a finished branch) again on the workers: an idle child from its
        /// copied history, with `text` as a new user message when given; a finished run
        /// needs `text` (a follow-up turn, like `continue`).
        RunResume = "run_resume", fn run_resume {
            run: RunId,
            text: Option<String>,
        } -> Continue(ContinueOutcome), changes, quick, write, POST "/runs/{run}/resume";

        /// A blob of the run store, `None` when the store lacks it: how a client of
        /// another process's embedded coordinator (over its local socket) reads what it
        /// cannot read from the store itself, e.g. the files of `fork watch`'s fork
        /// directory.
        GetBlob = "get_blob", fn get_blob { blob: BlobHash } -> Blob(Option<Bytes>), idempotent, quick, read, GET "/blobs/{blob}";

        /// Which of `blobs` the caller must upload: those the store lacks and, for a
        /// scoped client, those none of its accounts owns (a blob another tenant stored is
        /// uploaded again, proving its bytes are the caller's; nothing says it exists).
        /// At most [`super::limits::MAX_BLOBS_PER_CALL`] hashes per call. A `write` scope:
        /// it is the first step of an upload (and a list too long for a URL).
        MissingBlobs = "missing_blobs", fn missing_blobs {
            blobs: Vec<BlobHash>,
        } -> Blobs(Vec<BlobHash>), idempotent, quick, write, POST "/blob-checks";

        /// Upload a blob, in parts of at most [`super::limits::MAX_BLOB_PART_BYTES`] from `offset` 0
        /// on, each part at the offset the last answer's `received` names; `total` is the
        /// whole blob's size. The coordinator hashes the bytes once all arrived (a blob is
        /// stored under its own SHA-256 only), repairs a stored copy whose content is
        /// wrong, and counts the blob against the caller's quota (`[coordinator]
        /// blob_quota_mb`). `PUT /blobs/{blob}` is the HTTP form (one body).
        PutBlobPart = "put_blob_part", fn put_blob_part {
            blob: BlobHash,
            offset: u64,
            total: u64,
            bytes: Bytes,
        } -> BlobUpload(BlobUpload), idempotent, quick, write, POST "/blobs/{blob}/parts";

        /// Part of a blob: at most `len` bytes (and at most
        /// [`super::limits::MAX_BLOB_PART_BYTES`]) from byte `start`; `None` when the store
        /// lacks it or, for a scoped client, none of its accounts owns it.
        GetBlobPart = "get_blob_part", fn get_blob_part {
            blob: BlobHash,
            start: u64,
            len: u64,
        } -> BlobPart(Option<BlobPart>), idempotent, quick, read, GET "/blobs/{blob}/parts";
    }
}

impl crate::wire::WireMessage for ApiRequest {
    const KIND: &'static str = "api_request";
}

/// A successful answer, one variant per kind of result (several operations may share one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", content = "body", rename_all = "snake_case")]
// A reply lives for one call; boxing the large ones would only add allocations.
#[allow(clippy::large_enum_variant)]
pub enum ApiReply {
    Info(ServerInfo),
    Fork(ForkView),
    Forks(Vec<ForkView>),
    ForkId(ForkId),
    Watch(ForkWatch),
    Diff(DiffReport),
    Merge(MergeOutcome),
    Terminate(TerminateOutcome),
    Abort(AbortOutcome),
    Steer(SteerOutcome),
    Continue(ContinueOutcome),
    Approvals(Vec<crate::approval::ApprovalView>),
    Decision(DecisionOutcome),
    Events(Vec<LoggedEvent>),
    Checkpoints(Vec<CheckpointView>),
    Cost(ForkCost),
    Account(AccountView),
    Accounts(Vec<AccountView>),
    Resolve(ResolveReport),
    Verdict(Option<ResolveReport>),
    Gc(GcReport),
    RunId(RunId),
    Checkpoint(CheckpointView),
    Rewind(RewindOutcome),
    NewRun(NewRunOutcome),
    Runs(Vec<RunView>),
    Run(RunDetail),
    RunFork(RunForkOutcome),
    /// A workspace version (a `Manifest` blob).
    Workspace(BlobHash),
    /// A blob's bytes (`None`: not in the store).
    Blob(Option<Bytes>),
    /// The live workers.
    Workers(Vec<crate::protocol::WorkerInfo>),
    /// Blob hashes (those to upload).
    Blobs(Vec<BlobHash>),
    /// Where an upload in parts stands.
    BlobUpload(BlobUpload),
    /// Part of a blob (`None`: not in the store, or not the caller's).
    BlobPart(Option<BlobPart>),
    /// The reply is too large for one message: it is the `api_response` envelope stored
    /// as this blob in the bus's blob store.
    Stored {
        blob: BlobHash,
        bytes: u64,
    },
}

impl ApiReply {
    /// The reply's name, as on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            ApiReply::Info(_) => "info",
            ApiReply::Fork(_) => "fork",
            ApiReply::Forks(_) => "forks",
            ApiReply::ForkId(_) => "fork_id",
            ApiReply::Watch(_) => "watch",
            ApiReply::Diff(_) => "diff",
            ApiReply::Merge(_) => "merge",
            ApiReply::Terminate(_) => "terminate",
            ApiReply::Abort(_) => "abort",
            ApiReply::Steer(_) => "steer",
            ApiReply::Continue(_) => "continue",
            ApiReply::Approvals(_) => "approvals",
            ApiReply::Decision(_) => "decision",
            ApiReply::Events(_) => "events",
            ApiReply::Checkpoints(_) => "checkpoints",
            ApiReply::Cost(_) => "cost",
            ApiReply::Account(_) => "account",
            ApiReply::Accounts(_) => "accounts",
            ApiReply::Resolve(_) => "resolve",
            ApiReply::Verdict(_) => "verdict",
            ApiReply::Gc(_) => "gc",
            ApiReply::RunId(_) => "run_id",
            ApiReply::Checkpoint(_) => "checkpoint",
            ApiReply::Rewind(_) => "rewind",
            ApiReply::NewRun(_) => "new_run",
            ApiReply::Runs(_) => "runs",
            ApiReply::Run(_) => "run",
            ApiReply::RunFork(_) => "run_fork",
            ApiReply::Workspace(_) => "workspace",
            ApiReply::Blob(_) => "blob",
            ApiReply::Workers(_) => "workers",
            ApiReply::Blobs(_) => "blobs",
            ApiReply::BlobUpload(_) => "blob_upload",
            ApiReply::BlobPart(_) => "blob_part",
            ApiReply::Stored { .. } => "stored",
        }
    }
}

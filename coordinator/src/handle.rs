//! [`CoordinatorHandle`]: the coordinator's API. Cheap to clone; every method is bounded in
//! time (actor calls time out) and slow store work runs on blocking threads.

use crate::blobs;
use crate::budget::Ledger;
use crate::checkpoint;
use crate::create;
use crate::error::CoordinatorError;
use crate::fork::Requeue;
use crate::root::RootHandle;
use crate::store::{RunRecord, RunStore};
use crate::CoordinatorConfig;
use forkfleet_bus::Bus;
use forkfleet_shared::api::{
    AbortOutcome, CheckpointView, ContinueOutcome, CreateFork, ForkView, ForkWatch, MergeOutcome,
    NewRunOutcome, RewindOutcome, SteerOutcome, TerminateOutcome,
};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::budget::{AccountView, ForkCost};
use forkfleet_shared::diff::{DiffOptions, DiffReport};
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::protocol::now_ms;
use forkfleet_shared::spec::ForkPlan;
use forkfleet_shared::wire;
use futures::{StreamExt, TryStreamExt};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tracing::Instrument;

/// What a branch task carries besides its plan (ids, budget, attempt, trace), at most:
/// the margin a child's plan leaves under the bus's message limit.
const TASK_OVERHEAD: usize = 16 * 1024;

/// Branch tasks enqueued at once when a fork is created.
const ENQUEUE_IN_FLIGHT: usize = 64;

#[derive(Clone)]
pub struct CoordinatorHandle {
    root: RootHandle,
    store: RunStore,
    bus: Arc<dyn Bus>,
    config: Arc<CoordinatorConfig>,
    ledger: Arc<Ledger>,
    transfers: Arc<crate::tenancy::Transfers>,
}

impl CoordinatorHandle {
    pub(crate) fn new(
        root: RootHandle,
        store: RunStore,
        bus: Arc<dyn Bus>,
        config: CoordinatorConfig,
        ledger: Arc<Ledger>,
    ) -> Self {
        Self {
            root,
            store,
            bus,
            config: Arc::new(config),
            ledger,
            transfers: Arc::default(),
        }
    }

    /// Validate and create a fork, enqueue one task per branch, and return its view
    /// (branches pending). On a validation error nothing is written.
    ///
    /// The work runs in its own task: a caller that gives up half-way (a timeout, a
    /// dropped request) cannot leave a fork written but not enqueued.
    pub async fn create_fork(&self, req: CreateFork) -> Result<ForkView, CoordinatorError> {
        let this = self.clone();
        // The fork's span: its branches, resolve and merge hang under it. It is the child
        // of the request that asked (`api.request`, an HTTP request's span, a command's in
        // the embedded mode), which continues the caller's trace: the trace starts where
        // the user acted (ADR 9), though the request ends long before the fork does.
        let span = tracing::info_span!(
            "fork.create",
            fork.id = tracing::field::Empty,
            fork.branches = i64::try_from(req.plan.branches.len()).unwrap_or(i64::MAX)
        );
        tokio::spawn(async move { this.create_inner(req).await }.instrument(span)).await?
    }

    async fn create_inner(&self, req: CreateFork) -> Result<ForkView, CoordinatorError> {
        // The cheap checks first: a plan that cannot be created copies no blobs.
        create::validate_plan(&req.plan)?;
        self.check_models_offered(&req.plan).await?;
        if let Some(account) = &req.plan.budget.account {
            self.ledger.check_account(account)?;
        }
        if !blobs::shared_with_bus(&self.store, &self.bus) {
            blobs::import_for_fork(&self.store, &self.bus.blobs(), &req).await?;
        }
        let store = self.store.clone();
        // The fork's record keeps this span's trace context.
        let trace = forkfleet_shared::trace::current_traceparent();
        let prepared =
            tokio::task::spawn_blocking(move || create::create_fork(&store, req, now_ms(), trace))
                .await?
                .inspect_err(|e| tracing::info!(error = %e, "fork.create refused"))?;
        let fork_id = prepared.fork.fork_id;
        tracing::Span::current().record("fork.id", tracing::field::display(fork_id));
        // Workers read the prefix from the bus's blob store (the same store when embedded).
        let prefix = prepared.fork.prefix;
        self.bus
            .blobs()
            .put(prefix, prepared.prefix_bytes.clone())
            .await
            .map_err(forkfleet_bus::BusError::from)?;
        let mut payloads = Vec::with_capacity(prepared.tasks.len());
        for t in &prepared.tasks {
            let payload = wire::encode(t)?;
            // Refused here, before anything is written, rather than left pending: a task
            // the bus cannot carry would never reach a worker.
            if let Some(limit) = self.bus.max_payload().filter(|l| payload.len() > *l) {
                return Err(CoordinatorError::BadRequest(format!(
                    "branch `{}`'s task is {} bytes, more than the bus carries in one message ({limit} bytes, the NATS server's max_payload): shorten its system prompt, goal, steer or history (or raise max_payload on the server)",
                    t.label,
                    payload.len()
                )));
            }
            payloads.push(payload);
        }
        let fork = self.root.start_fork(prepared).await?;
        let view = fork.view().await?;
        // Concurrently: over NATS each enqueue waits for its JetStream ack.
        futures::stream::iter(payloads)
            .map(|p| self.bus.enqueue_task(&self.config.pool, p))
            .buffer_unordered(ENQUEUE_IN_FLIGHT)
            .try_collect::<()>()
            .await?;
        tracing::info!(fork.id = %fork_id, branches = view.branches.len(), "fork.created");
        Ok(view)
    }

    /// Check the plan's real models against the catalogues the live workers of the pool
    /// advertise ([`forkfleet_shared::catalogue::check_plan`], ADR 16). With no live worker
    /// (or the list unreadable) the fork is accepted with a warning: start order must not
    /// matter, and each worker checks every task again before any request.
    async fn check_models_offered(&self, plan: &ForkPlan) -> Result<(), CoordinatorError> {
        use forkfleet_shared::catalogue::{check_plan, dialect_of};
        if !plan.models.keys().any(|m| dialect_of(m).is_some()) {
            return Ok(());
        }
        let pool = &self.config.pool;
        let offers: Vec<_> = match self.bus.workers().await {
            Ok(workers) => workers
                .iter()
                .filter(|w| &w.pool == pool)
                .map(|w| w.offer())
                .collect(),
            Err(e) => {
                tracing::warn!(pool = %pool, error = %e, "fork.create cannot list the workers: its models are checked by the workers only");
                return Ok(());
            }
        };
        let offers = match (offers.is_empty(), &self.config.idle_offer) {
            // The embedded system's workers, not started by this command.
            (true, Some(offer)) => vec![offer.clone()],
            (true, None) => {
                tracing::warn!(pool = %pool, "fork.create: no live worker in the pool; its models are checked by the workers when they run the branches");
                return Ok(());
            }
            (false, _) => offers,
        };
        check_plan(plan, pool, &offers).map_err(|e| {
            tracing::info!(error = %e, "fork.create refused");
            CoordinatorError::ModelNotOffered(e)
        })
    }

    /// The real models the live workers of the coordinator's pool offer (their catalogues:
    /// `provider:name`), each once; none when the workers cannot be listed.
    pub(crate) async fn offered_models(&self) -> Result<Vec<String>, CoordinatorError> {
        let pool = &self.config.pool;
        let workers = match self.bus.workers().await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(pool = %pool, error = %e, "cannot list the workers for their models");
                return Ok(Vec::new());
            }
        };
        let mut names: Vec<String> = workers
            .iter()
            .filter(|w| &w.pool == pool)
            .flat_map(|w| w.offer().models.into_iter().map(|m| m.name))
            .collect();
        names.sort_unstable();
        names.dedup();
        Ok(names)
    }

    pub async fn fork(&self, id: ForkId) -> Result<ForkView, CoordinatorError> {
        self.root.fork(id).await?.view().await
    }

    /// The actor of a fork.
    pub(crate) async fn fork_handle(
        &self,
        id: ForkId,
    ) -> Result<crate::fork::ForkHandle, CoordinatorError> {
        self.root.fork(id).await
    }

    /// Enqueue again every pending or running branch of every open fork, for a process
    /// whose task queue started empty: the embedded mode's local bus keeps tasks in memory,
    /// so a fork interrupted with its process goes on from its stored logs (a branch a
    /// worker had started is taken over from its log; one never started starts). Not for a
    /// cluster: its queue is durable and redelivers by itself. Returns how many were queued.
    pub async fn requeue_unfinished(&self) -> Result<usize, CoordinatorError> {
        let mut total = 0;
        for fork in self.root.list().await? {
            total += fork
                .resume(self.config.pool.clone(), Requeue::Unfinished)
                .await?;
        }
        if total > 0 {
            tracing::info!(
                requeued = total,
                "fork.requeued: unfinished branches enqueued again"
            );
        }
        Ok(total)
    }

    /// Every fork, newest first.
    pub async fn forks(&self) -> Result<Vec<ForkView>, CoordinatorError> {
        let mut out = Vec::new();
        for f in self.root.list().await? {
            match f.view().await {
                Ok(v) => out.push(v),
                // A fork actor restarting right now: leave it out of this listing.
                Err(CoordinatorError::Closed(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// A fork by full id or unique prefix of its id.
    pub async fn find_fork(&self, prefix: &str) -> Result<ForkId, CoordinatorError> {
        self.root.find(prefix.to_string()).await
    }

    /// The fork's view once every branch is terminal. The fork actor answers when the last
    /// branch finishes; nothing polls.
    pub async fn wait_settled(
        &self,
        id: ForkId,
        timeout: Duration,
    ) -> Result<ForkView, CoordinatorError> {
        self.root.fork(id).await?.wait_settled(timeout).await
    }

    /// A version counter bumped whenever the fork's view changes (at most once per batch
    /// of events): wait with `changed()`, then read [`CoordinatorHandle::fork`]. If the
    /// fork actor is restarted, `changed()` fails: subscribe again.
    pub async fn changes(&self, id: ForkId) -> Result<watch::Receiver<u64>, CoordinatorError> {
        self.root.fork(id).await?.subscribe().await
    }

    /// The fork's view with its version: at once when `seen` is `None` or differs from
    /// the current version, else once the version changes or `wait` passes (then the
    /// unchanged view). Versions restart from 0 with the coordinator, hence "differs".
    pub async fn watch(
        &self,
        id: ForkId,
        seen: Option<u64>,
        wait: Duration,
    ) -> Result<ForkWatch, CoordinatorError> {
        let fork = self.root.fork(id).await?;
        let mut versions = fork.subscribe().await?;
        let current = *versions.borrow_and_update();
        if seen == Some(current) {
            // A closed channel (the fork actor restarting) ends the wait early; the view
            // below then says what is there.
            let _ = tokio::time::timeout(wait, versions.changed()).await;
        }
        let version = *versions.borrow();
        let view = fork.view().await?;
        Ok(ForkWatch { version, view })
    }

    /// Stop the branch labelled `label`; it keeps its partial work. A branch that already
    /// finished is left as it is (`sent` is false).
    pub async fn terminate(
        &self,
        id: ForkId,
        label: &str,
    ) -> Result<TerminateOutcome, CoordinatorError> {
        self.root.fork(id).await?.terminate(label.to_string()).await
    }

    /// Mark the fork aborted and stop every branch still running. Nothing can be merged
    /// afterwards; aborting twice is not an error.
    pub async fn abort(&self, id: ForkId) -> Result<AbortOutcome, CoordinatorError> {
        self.root.fork(id).await?.abort().await
    }

    /// Send the pending or running branch labelled `label` a user message, which its
    /// worker applies (a `steer` event) before its next model call. An unknown label, an
    /// empty message or a finished or paused branch is refused; nothing is sent then.
    pub async fn steer(
        &self,
        id: ForkId,
        label: &str,
        text: String,
    ) -> Result<SteerOutcome, CoordinatorError> {
        self.root
            .fork(id)
            .await?
            .steer(label.to_string(), text)
            .await
    }

    /// Answer the request for consent of branch `label` of fork `id` (the one for
    /// `call_id` when given): approved, the call runs; denied, the model reads it was not
    /// run and why. `by` is who answers. Refused for a branch that does not wait, or waits
    /// for another call; nothing changes then.
    pub async fn decide(
        &self,
        id: ForkId,
        label: &str,
        call_id: Option<String>,
        approved: bool,
        by: String,
        reason: Option<String>,
    ) -> Result<forkfleet_shared::api::DecisionOutcome, CoordinatorError> {
        self.root
            .fork(id)
            .await?
            .decide(crate::fork::Answer {
                label: label.to_string(),
                call_id,
                approved,
                by,
                reason,
            })
            .await
    }

    /// The requests for consent that wait in `forks` (their views), oldest first.
    pub(crate) fn pending_approvals(
        forks: &[ForkView],
    ) -> Vec<forkfleet_shared::approval::ApprovalView> {
        let mut out: Vec<_> = forks
            .iter()
            .flat_map(|f| {
                f.branches.iter().filter_map(move |b| {
                    b.approval
                        .as_ref()
                        .filter(|_| {
                            b.state == forkfleet_shared::state::BranchState::AwaitingApproval
                        })
                        .map(|p| forkfleet_shared::approval::ApprovalView {
                            fork_id: f.fork_id,
                            label: b.label.clone(),
                            run_id: b.run_id,
                            request: p.clone(),
                        })
                })
            })
            .collect();
        out.sort_by_key(|a| a.request.requested_at_ms);
        out
    }

    /// Start a new turn of the finished branch labelled `label` with the user message
    /// `text`: its whole history, its overlay, a worker taking it over from its log
    /// (ADR 13). Refused for a branch that has not finished (steer it), one stopped by a
    /// cap with no room left, and a fork merged, aborted, being merged or being resolved.
    pub async fn follow_up(
        &self,
        id: ForkId,
        label: &str,
        text: String,
    ) -> Result<ContinueOutcome, CoordinatorError> {
        self.root
            .fork(id)
            .await?
            .follow_up(self.config.pool.clone(), label.to_string(), Some(text))
            .await
    }

    /// `runs resume`: start an idle child of `runs fork` (with `text` as a user message when
    /// given), or continue a finished branch run with `text` (docs/LINEAGE.md).
    pub async fn resume_run(
        &self,
        run: RunId,
        text: Option<String>,
    ) -> Result<ContinueOutcome, CoordinatorError> {
        let record = self.run_record(run).await?;
        let Some(fork_id) = record.fork_id else {
            return Err(CoordinatorError::BadRequest(format!(
                "run {run} is a root run: no worker runs it; fork it (`forkfleet runs fork {run}`) and resume the child"
            )));
        };
        let label = self
            .blocking(move |s| {
                s.branches(fork_id)?
                    .into_iter()
                    .find(|b| b.run_id == run)
                    .map(|b| b.label)
                    .ok_or(CoordinatorError::UnknownRun(run))
            })
            .await?;
        self.root
            .fork(fork_id)
            .await?
            .follow_up(self.config.pool.clone(), label, text)
            .await
    }

    /// The cross-branch diff, computed on a blocking thread from the replicas.
    pub async fn diff(
        &self,
        id: ForkId,
        opts: DiffOptions,
    ) -> Result<DiffReport, CoordinatorError> {
        let fork = self.root.fork(id).await?;
        if opts.unified && !blobs::shared_with_bus(&self.store, &self.bus) {
            // On a cluster the branches' files are in the bus's blob store: bring the ones
            // the report shows into the run store first (a report without text is cheap).
            let plain = fork
                .diff(DiffOptions {
                    unified: false,
                    ..opts.clone()
                })
                .await?;
            blobs::import_for_diff(&self.store, &self.bus.blobs(), &plain).await?;
        }
        fork.diff(opts).await
    }

    /// Merge the branch labelled `pick` into the fork's parent run.
    ///
    /// A fork an agent made inside its branch merges into that branch (ADR 14): refused
    /// while the agent runs (it merges its forks itself), else replayed onto the finished
    /// branch by its fork actor; the outcome's report is that replay's.
    pub async fn merge(&self, id: ForkId, pick: &str) -> Result<MergeOutcome, CoordinatorError> {
        let fork = self.root.fork(id).await?;
        let parent_run = fork.view().await?.parent_run;
        let Some(parent_fork) = self.run_record(parent_run).await?.fork_id else {
            return fork.merge(pick.to_string()).await;
        };
        let parent_fork = self.root.fork(parent_fork).await?;
        let parent_view = parent_fork.view().await?;
        if let Some(b) = parent_view
            .branches
            .iter()
            .find(|b| b.run_id == parent_run && !b.state.is_terminal())
        {
            return Err(CoordinatorError::AgentMerges {
                fork: id,
                parent: parent_view.fork_id,
                label: b.label.clone(),
                state: b.state,
            });
        }
        let mut outcome = fork.merge_into_agent(pick.to_string()).await?;
        outcome.report = parent_fork.adopt(parent_run, outcome.clone()).await?;
        Ok(outcome)
    }

    /// Store work on a blocking thread.
    pub(crate) async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&RunStore) -> Result<T, CoordinatorError> + Send + 'static,
    ) -> Result<T, CoordinatorError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store)).await?
    }

    /// The account fork `fork` charges (`None`: none).
    pub(crate) async fn fork_account(
        &self,
        fork: ForkId,
    ) -> Result<Option<String>, CoordinatorError> {
        self.blocking(move |s| Ok(s.fork(fork)?.and_then(|f| f.plan.budget.account)))
            .await
    }

    /// The account charged by the fork `run` belongs to (`None`: a root run, or a fork
    /// without an account).
    pub(crate) async fn account_of_run(
        &self,
        run: RunId,
    ) -> Result<Option<String>, CoordinatorError> {
        self.blocking(move |s| {
            let Some(fork) = s.run(run)?.and_then(|r| r.fork_id) else {
                return Ok(None);
            };
            Ok(s.fork(fork)?.and_then(|f| f.plan.budget.account))
        })
        .await
    }

    /// A run's record (`UnknownRun` when there is none).
    pub(crate) async fn run_record(&self, run: RunId) -> Result<RunRecord, CoordinatorError> {
        self.blocking(move |s| s.run(run)?.ok_or(CoordinatorError::UnknownRun(run)))
            .await
    }

    /// A run's log, from seq 0 to the first gap.
    pub async fn run_events(&self, run: RunId) -> Result<Vec<(u64, Event)>, CoordinatorError> {
        self.blocking(move |s| {
            s.run(run)?.ok_or(CoordinatorError::UnknownRun(run))?;
            s.run_log(run)
        })
        .await
    }

    /// Every run of the store with its lineage, oldest first; each branch's state and money
    /// as the ledger has them now.
    pub async fn runs(&self) -> Result<Vec<forkfleet_shared::api::RunView>, CoordinatorError> {
        let mut views = self.blocking(crate::lineage::run_views).await?;
        for v in &mut views {
            self.live_money(v);
        }
        Ok(views)
    }

    /// A branch's state and money from the ledger (the store's records are written at
    /// state changes only).
    fn live_money(&self, v: &mut forkfleet_shared::api::RunView) {
        let Some(fork) = v.fork_id else { return };
        if let Ok(cost) = self.ledger.fork_cost(fork) {
            if let Some(b) = cost.branches.iter().find(|b| b.run_id == v.run_id) {
                v.state = Some(b.state);
                v.cost_usd = b.spent_usd;
                v.calls = b.calls;
                v.cached_calls = b.cached_calls;
            }
        }
    }

    /// One run with its settings, workspace and children (`runs show`).
    pub async fn run_detail(
        &self,
        run: RunId,
    ) -> Result<forkfleet_shared::api::RunDetail, CoordinatorError> {
        let mut detail = self
            .blocking(move |s| crate::lineage::run_detail(s, run))
            .await?;
        self.live_money(&mut detail.run);
        Ok(detail)
    }

    /// `runs fork`: plan a child of a recorded run (and with `dry_run` stop there), write
    /// it, start its fork's actor, and enqueue its task when it replays (docs/LINEAGE.md).
    pub async fn fork_run(
        &self,
        parent: RunId,
        options: forkfleet_shared::api::RunForkOptions,
    ) -> Result<forkfleet_shared::api::RunForkOutcome, CoordinatorError> {
        let dry_run = options.dry_run;
        let req = crate::lineage::ForkRunRequest { parent, options };
        let planned = req.clone();
        let mut child = self
            .blocking(move |s| crate::lineage::plan_child(s, &planned))
            .await?;
        // `--set model=` a model no worker offers is refused now, as a fork's would be
        // (dry run or not), not when the child runs. Only the child's model: the plan
        // keeps the source's other models, which the child never calls.
        let mut used = child.plan.clone();
        used.models
            .retain(|name, _| used.branches.iter().any(|b| &b.model == name));
        self.check_models_offered(&used).await?;
        // A dry run calls no model: the summary is written (and paid for) only when the
        // child is.
        if child.wants_model_summary && !dry_run {
            let text = crate::resolve::model_summary(self, &req, &child).await?;
            let text = format!(
                "[model summary by {}; lossy: the events before this are the record] {text}",
                child.outcome.settings.model
            );
            crate::lineage::with_summary(&mut child, text);
        }
        if dry_run {
            return Ok(child.outcome);
        }
        // A child's task carries its plan (system prompt, goal, steer): one the bus cannot
        // carry is refused before anything is written, rather than left pending.
        if let Some(limit) = self.bus.max_payload() {
            let size = child.plan_bytes()?;
            if size + TASK_OVERHEAD > limit {
                return Err(CoordinatorError::BadRequest(format!(
                    "the child run's plan is {size} bytes, more than the bus carries in one task ({limit} bytes, the NATS server's max_payload, less {TASK_OVERHEAD} for the rest of the task): shorten its system prompt, goal or steer"
                )));
            }
        }
        let written = self
            .blocking(move |s| crate::lineage::write_child(s, child, now_ms()))
            .await?;
        // Workers read the prefix, the record and the snapshot from the bus's blob store.
        let child_fork = written.fork_id;
        let owner = self
            .blocking(move |s| Ok(s.fork(child_fork)?.and_then(|f| f.plan.budget.account)))
            .await?;
        checkpoint::publish_blobs(
            self.store(),
            &self.bus(),
            owner.as_deref(),
            &[written.snapshot],
            &[],
        )
        .await?;
        for (hash, bytes) in written.blobs {
            self.bus
                .blobs()
                .put(hash, bytes)
                .await
                .map_err(forkfleet_bus::BusError::from)?;
        }
        self.root.load_fork(written.fork_id).await?;
        if let Some(task) = written.task {
            self.bus
                .enqueue_task(&self.config.pool, wire::encode(&task)?)
                .await?;
        }
        Ok(written.outcome)
    }

    /// A run's checkpoints, oldest first.
    pub async fn checkpoints(&self, run: RunId) -> Result<Vec<CheckpointView>, CoordinatorError> {
        self.blocking(move |s| {
            s.run(run)?.ok_or(CoordinatorError::UnknownRun(run))?;
            s.checkpoints(run)
        })
        .await
    }

    /// A root run's current workspace version (see [`ApiRequest::RunWorkspace`]).
    ///
    /// [`ApiRequest::RunWorkspace`]: forkfleet_shared::api::ApiRequest::RunWorkspace
    pub async fn root_workspace(&self, run: RunId) -> Result<BlobHash, CoordinatorError> {
        let record = self.run_record(run).await?;
        let Some(fork) = record.fork_id else {
            return Ok(record.workspace);
        };
        // A branch run no worker runs (a child of `runs fork`, a finished branch): its
        // current version, its fork snapshot with its file changes.
        let stopped = self
            .ledger
            .fork_cost(fork)
            .ok()
            .and_then(|c| c.branches.into_iter().find(|b| b.run_id == run))
            .is_some_and(|b| b.state.is_stopped());
        if !stopped {
            return Err(CoordinatorError::NotARootRun { run, fork });
        }
        let hash = self
            .blocking(move |s| crate::lineage::current_workspace(s, run, true))
            .await?
            .0;
        let owner = self.account_of_run(run).await?;
        checkpoint::publish_blobs(self.store(), &self.bus(), owner.as_deref(), &[hash], &[])
            .await?;
        Ok(hash)
    }

    /// A run's current workspace version (a `Manifest` blob).
    pub async fn workspace(&self, run: RunId) -> Result<BlobHash, CoordinatorError> {
        Ok(self.run_record(run).await?.workspace)
    }

    /// Spent, reserved, cap and remaining per branch, for the fork and its account; calls
    /// are the model calls paid for (fenced attempts' included, ADR 18).
    pub async fn fork_cost(&self, id: ForkId) -> Result<ForkCost, CoordinatorError> {
        // Through the root: an unknown fork is `UnknownFork` either way, and a fork whose
        // actor is still loading is waited for.
        self.root.fork(id).await?;
        let mut cost = self.ledger.fork_cost(id)?;
        if let Some(report) = self.blocking(move |s| s.resolution(id)).await? {
            cost.judge_cost_usd = report.judge_cost_usd;
            cost.judge_unpriced = report.judge_unpriced.clone();
            cost.judge_usage = report.judge_usage;
        }
        // Tokens per branch from its log's summary, and what the prompt cache saved at its
        // model's price.
        let view = self.root.fork(id).await?.view().await?;
        let plan = self.blocking(move |s| s.fork(id)).await?.map(|r| r.plan);
        for b in &mut cost.branches {
            let Some(v) = view.branches.iter().find(|v| v.run_id == b.run_id) else {
                continue;
            };
            b.usage = v.usage;
            b.unpriced_model = v.unpriced_model.clone();
            let price = plan.as_ref().and_then(|p| {
                let model = &p.branches.iter().find(|x| x.label == b.label)?.model;
                p.models.get(model)?.price
            });
            b.cache_saved_usd = price.map_or(0.0, |p| p.cache_saving(&v.usage));
            cost.usage.add(&v.usage);
            cost.cache_saved_usd += b.cache_saved_usd;
        }
        Ok(cost)
    }

    /// Enqueue the branches a cap change made room for, fork by fork.
    async fn resume(&self, runs: Vec<(ForkId, RunId)>) -> Result<(), CoordinatorError> {
        let mut by_fork: std::collections::BTreeMap<ForkId, Vec<RunId>> = Default::default();
        for (fork, run) in runs {
            by_fork.entry(fork).or_default().push(run);
        }
        for (fork, runs) in by_fork {
            let n = self
                .root
                .fork(fork)
                .await?
                .resume(self.config.pool.clone(), Requeue::Paused(runs))
                .await?;
            tracing::info!(fork.id = %fork, resumed = n, "budget.resumed");
        }
        Ok(())
    }

    /// Raise the cap of branch `branch` (else the fork's aggregate cap) by `usd`, and
    /// resume the branches it paused.
    pub async fn topup(
        &self,
        id: ForkId,
        branch: Option<&str>,
        usd: f64,
    ) -> Result<ForkCost, CoordinatorError> {
        self.root.fork(id).await?;
        let resume = self.ledger.topup(id, branch, usd)?;
        self.store.flush_async().await?;
        self.resume(resume).await?;
        self.fork_cost(id).await
    }

    /// Move `usd` of cap from branch `from` to branch `to`; resumes `to` if it was paused.
    pub async fn move_budget(
        &self,
        id: ForkId,
        from: &str,
        to: &str,
        usd: f64,
    ) -> Result<ForkCost, CoordinatorError> {
        self.root.fork(id).await?;
        let resume = self.ledger.move_budget(id, from, to, usd)?;
        self.store.flush_async().await?;
        self.resume(resume).await?;
        self.fork_cost(id).await
    }

    /// Create account `name` or change its cap; resumes what its cap paused.
    pub async fn account_set(
        &self,
        name: &str,
        cap_usd: Option<f64>,
    ) -> Result<AccountView, CoordinatorError> {
        let (view, resume) = self.ledger.account_set(name, cap_usd)?;
        self.store.flush_async().await?;
        self.resume(resume).await?;
        Ok(view)
    }

    /// Every account, by name.
    pub async fn accounts(&self) -> Result<Vec<AccountView>, CoordinatorError> {
        Ok(self.ledger.accounts())
    }

    pub(crate) fn config(&self) -> &CoordinatorConfig {
        &self.config
    }

    /// Uploads and reads of blobs in parts (`crate::tenancy`).
    pub(crate) fn transfers(&self) -> &crate::tenancy::Transfers {
        &self.transfers
    }

    pub(crate) fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub(crate) fn root(&self) -> &RootHandle {
        &self.root
    }

    pub(crate) fn bus(&self) -> Arc<dyn Bus> {
        self.bus.clone()
    }

    /// A blob by its hash: from the coordinator's store, else from the bus's blob store
    /// (where uploads go on a cluster: `PUT /blobs/{hash}` then `GET` finds it).
    pub async fn blob(&self, hash: &BlobHash) -> Result<Option<bytes::Bytes>, CoordinatorError> {
        if let Some(bytes) = self.store().blob(hash)? {
            return Ok(Some(bytes));
        }
        // Embedded, the bus's store is this one: nothing more to look in.
        if blobs::shared_with_bus(&self.store, &self.bus) {
            return Ok(None);
        }
        Ok(self
            .bus
            .blobs()
            .get(hash)
            .await
            .map_err(forkfleet_bus::BusError::from)?)
    }

    /// The coordinator's store (blobs for diffs and merges, checkpoints).
    pub fn store(&self) -> &RunStore {
        &self.store
    }
}

impl CoordinatorHandle {
    // ---- checkpoints (ADR 12): the work is `crate::checkpoint`'s ----

    /// A run by full id or unique prefix of its id.
    pub async fn find_run(&self, prefix: &str) -> Result<RunId, CoordinatorError> {
        let prefix = prefix.to_string();
        self.blocking(move |s| checkpoint::find_run(s, &prefix))
            .await
    }

    /// Save checkpoint `label` at the run's current end (a named one: never evicted).
    /// Save checkpoint `label` at the run's end, or at seq `at` of its log (an agent's
    /// `save_checkpoint`: the log is waited for, bounded, until it reaches `at`).
    pub async fn checkpoint_save(
        &self,
        run: RunId,
        label: &str,
        at: Option<u64>,
    ) -> Result<CheckpointView, CoordinatorError> {
        if let Some(seq) = at {
            if let Some(fork) = self.run_record(run).await?.fork_id {
                self.wait_for_log(fork, run, seq).await?;
            }
        }
        let label = label.to_string();
        self.blocking(move |s| checkpoint::save_named(s, run, &label, at))
            .await
    }

    /// Remove the checkpoint with this label or id.
    pub async fn checkpoint_remove(
        &self,
        run: RunId,
        reference: &str,
    ) -> Result<CheckpointView, CoordinatorError> {
        let reference = reference.to_string();
        self.blocking(move |s| checkpoint::remove(s, run, &reference))
            .await
    }

    /// Remove every checkpoint of a run; returns the removed ones.
    pub async fn checkpoint_clear(
        &self,
        run: RunId,
    ) -> Result<Vec<CheckpointView>, CoordinatorError> {
        self.blocking(move |s| checkpoint::clear(s, run)).await
    }

    /// Send a run back to a checkpoint (label or id): its history and its workspace
    /// version. With `dry_run` nothing changes and the outcome says what would. A branch
    /// run must have finished.
    pub async fn rewind(
        &self,
        run: RunId,
        reference: &str,
        dry_run: bool,
    ) -> Result<RewindOutcome, CoordinatorError> {
        let reference = reference.to_string();
        let plan = self
            .blocking(move |s| checkpoint::rewind_in_store(s, run, &reference, dry_run))
            .await?;
        let checkpoint::RewindPlan {
            mut outcome,
            marker,
            next_seq,
            fork,
        } = plan;
        if let (Some(fork), false) = (fork, dry_run) {
            let seq = self
                .root()
                .fork(fork)
                .await?
                .rewind(run, marker, next_seq)
                .await?;
            outcome.marker_seq = Some(seq);
            tracing::info!(run.id = %run, fork.id = %fork, checkpoint = %outcome.checkpoint.label, seq, changes = outcome.changes.len(), "checkpoint.rewind of a branch");
        }
        let owner = self.account_of_run(run).await?;
        checkpoint::publish_blobs(
            self.store(),
            &self.bus(),
            owner.as_deref(),
            &[outcome.from_snapshot, outcome.to_snapshot],
            &outcome.changes,
        )
        .await?;
        Ok(outcome)
    }

    /// Start a new root run from a checkpoint (label or id): the conversation up to it,
    /// on its workspace version.
    pub async fn fork_checkpoint(
        &self,
        run: RunId,
        reference: &str,
    ) -> Result<NewRunOutcome, CoordinatorError> {
        let reference = reference.to_string();
        let outcome = self
            .blocking(move |s| checkpoint::fork_from(s, run, &reference))
            .await?;
        let owner = self.account_of_run(run).await?;
        checkpoint::publish_blobs(
            self.store(),
            &self.bus(),
            owner.as_deref(),
            &[outcome.snapshot],
            &[],
        )
        .await?;
        Ok(outcome)
    }
}

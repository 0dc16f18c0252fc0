//! The coordinator's handler of every API operation.
//!
//! The operations are declared once in `forkfleet_shared::api::ops`; here each gets its
//! [`Handler`] on [`CoordinatorHandle`], one line each, given who sent the request
//! ([`Caller`], from the subject it arrived on) so it can scope it (`crate::access`). `forkfleet_shared::api::dispatch`
//! routes a request to its handler: the bus service ([`crate::service`]) calls it for every
//! request it receives, and an in-process client calls it directly. A declared operation
//! without a handler here is a compile error wherever the handle is used as an
//! [`forkfleet_shared::api::ApiHandler`].

use crate::handle::CoordinatorHandle;
use forkfleet_shared::api::*;
use forkfleet_shared::wire::WIRE_VERSION;

/// `handlers! { Op(handle, caller, op) => expression; ... }`: the expression answers `op`
/// from `caller` with the coordinator's handle, as a `Result<_, CoordinatorError>` (mapped
/// to the API's error). Scoping (ADR 17, `crate::access`) is the expression's first step:
/// `admit_fork`/`admit_run` before it acts, or a listing for the caller.
macro_rules! handlers {
    ($( $op:ident($h:ident, $c:pat, $o:pat) => $body:expr; )*) => {
        $(
            impl Handler<$op> for CoordinatorHandle {
                async fn handle(&self, caller: &Caller, op: $op) -> Result<<$op as Operation>::Reply, ApiError> {
                    let $h = self;
                    let $c = caller;
                    let $o = op;
                    Ok($body?)
                }
            }
        )*
    };
}

/// The coordinator's version, for [`Ping`].
fn server_info() -> Result<ServerInfo, crate::CoordinatorError> {
    Ok(ServerInfo {
        version: env!("CARGO_PKG_VERSION").to_string(),
        wire_version: WIRE_VERSION,
    })
}

handlers! {
    Ping(_h, _, _) => server_info();
    Forks(h, c, _) => h.forks_for(c).await;
    Accounts(h, c, _) => h.accounts_for(c).await;
    CreateFork(h, c, op) => { let op = h.scope_create(c, op).await?; h.admit_snapshot(c, &op).await?; h.admit_room(op.plan.budget.account.clone()).await?; h.create_fork(op).await };
    AgentFork(h, c, op) => { h.admit_run(c, op.parent_run).await?; h.admit_agent_snapshot(c, &op).await?; h.admit_room_of_run(op.parent_run).await?; h.agent_fork(op).await };
    AgentMerge(h, c, op) => { h.admit_fork(c, op.fork).await?; h.agent_merge(op.fork, &op.pick, op.parent_run).await };
    GetFork(h, c, op) => { h.admit_fork(c, op.fork).await?; h.fork(op.fork).await };
    FindFork(h, c, op) => h.find_fork_for(c, &op.prefix).await;
    WaitSettled(h, c, op) => { h.admit_fork(c, op.fork).await?; h.wait_settled(op.fork, bounded_wait(op.timeout_ms)).await };
    Watch(h, c, op) => { h.admit_fork(c, op.fork).await?; h.watch(op.fork, op.seen, bounded_wait(op.timeout_ms)).await };
    Diff(h, c, op) => { h.admit_fork(c, op.fork).await?; h.diff(op.fork, op.options).await };
    Merge(h, c, op) => { h.admit_fork(c, op.fork).await?; h.merge(op.fork, &op.pick).await };
    Terminate(h, c, op) => { h.admit_fork(c, op.fork).await?; h.terminate(op.fork, &op.label).await };
    Abort(h, c, op) => { h.admit_fork(c, op.fork).await?; h.abort(op.fork).await };
    Steer(h, c, op) => { h.admit_fork(c, op.fork).await?; h.steer(op.fork, &op.label, op.text).await };
    Approvals(h, c, op) => match op.fork {
        Some(fork) => { h.admit_fork(c, fork).await?; Ok::<_, crate::CoordinatorError>(CoordinatorHandle::pending_approvals(&[h.fork(fork).await?])) }
        None => Ok(CoordinatorHandle::pending_approvals(&h.forks_for(c).await?)),
    };
    Decide(h, c, op) => { h.admit_fork(c, op.fork).await?; h.decide(op.fork, &op.label, op.call_id, op.approve, c.name().to_string(), op.reason).await };
    Continue(h, c, op) => { h.admit_fork(c, op.fork).await?; h.admit_room(h.fork_account(op.fork).await?).await?; h.follow_up(op.fork, &op.label, op.text).await };
    RunEvents(h, c, op) => { h.admit_run(c, op.run).await?; h.run_events(op.run).await.map(|events| {
        events.into_iter().map(|(seq, event)| LoggedEvent { seq, event }).collect::<Vec<_>>()
    }) };
    Checkpoints(h, c, op) => { h.admit_run(c, op.run).await?; h.checkpoints(op.run).await };
    GetForkCost(h, c, op) => { h.admit_fork(c, op.fork).await?; h.fork_cost(op.fork).await };
    Topup(h, c, op) => { h.admit_fork(c, op.fork).await?; h.topup(op.fork, op.branch.as_deref(), op.usd).await };
    MoveBudget(h, c, op) => { h.admit_fork(c, op.fork).await?; h.move_budget(op.fork, &op.from, &op.to, op.usd).await };
    AccountSet(h, c, op) => { h.admit_admin(c, "changing an account's cap")?; h.account_set(&op.name, op.cap_usd).await };
    // Tests on every branch and the judges (on workers), the decision, the merge.
    Resolve(h, c, op) => { h.admit_fork(c, op.fork).await?; crate::resolve::resolve(h, op.fork, crate::resolve::Options { strategy: op.strategy, no_commit: op.no_commit, judge_models: op.judge_models }).await };
    Verdict(h, c, op) => { h.admit_fork(c, op.fork).await?; h.fork(op.fork).await?; h.store().resolution(op.fork) };
    Gc(h, c, op) => { h.admit_admin(c, "collecting garbage across every account")?; crate::gc::collect(h, crate::gc::Pick::OlderThan(op.older_than_ms.map(std::time::Duration::from_millis)), op.dry_run, op.grace_ms.map(std::time::Duration::from_millis)).await };
    RemoveFork(h, c, op) => { h.admit_fork(c, op.fork).await?; crate::gc::collect(h, crate::gc::Pick::One(op.fork), op.dry_run, None).await };
    FindRun(h, c, op) => h.find_run_for(c, &op.prefix).await;
    CheckpointSave(h, c, op) => { h.admit_run(c, op.run).await?; h.checkpoint_save(op.run, &op.label, op.at).await };
    CheckpointRemove(h, c, op) => { h.admit_run(c, op.run).await?; h.checkpoint_remove(op.run, &op.checkpoint).await };
    CheckpointClear(h, c, op) => { h.admit_run(c, op.run).await?; h.checkpoint_clear(op.run).await };
    Rewind(h, c, op) => { h.admit_run(c, op.run).await?; h.rewind(op.run, &op.checkpoint, op.dry_run).await };
    ForkCheckpoint(h, c, op) => { h.admit_run(c, op.run).await?; h.fork_checkpoint(op.run, &op.checkpoint).await };
    RunWorkspace(h, c, op) => { h.admit_run(c, op.run).await?; h.root_workspace(op.run).await };
    // Blobs belong to tenants (`crate::tenancy`): a scoped client reads its accounts' own.
    GetBlob(h, c, op) => h.blob_for(c, &op.blob).await;
    ListWorkers(h, c, _) => h.workers_for(c).await;
    MissingBlobs(h, c, op) => h.missing_blobs_for(c, op.blobs).await;
    PutBlobPart(h, c, op) => h.put_blob_part_for(c, op).await;
    GetBlobPart(h, c, op) => h.blob_part_for(c, op).await;
    // Runs and lineage (docs/LINEAGE.md).
    Runs(h, c, _) => h.runs_for(c).await;
    GetRun(h, c, op) => { h.admit_run(c, op.run).await?; h.run_detail(op.run).await };
    RunFork(h, c, op) => { h.admit_run(c, op.parent).await?; h.admit_room_of_run(op.parent).await?; h.fork_run(op.parent, op.options).await };
    RunResume(h, c, op) => { h.admit_run(c, op.run).await?; h.admit_room_of_run(op.run).await?; h.resume_run(op.run, op.text).await };
}

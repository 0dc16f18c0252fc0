//! The coordinator's handler of every API operation.
//!
//! The operations are declared once in `forkfleet_shared::api::ops`; here each gets its
//! [`Handler`] on [`CoordinatorHandle`], one line each. `forkfleet_shared::api::dispatch`
//! routes a request to its handler: the bus service ([`crate::service`]) calls it for every
//! request it receives, and an in-process client calls it directly. A declared operation
//! without a handler here is a compile error wherever the handle is used as an
//! [`forkfleet_shared::api::ApiHandler`].

use crate::handle::CoordinatorHandle;
use forkfleet_shared::api::*;
use forkfleet_shared::wire::WIRE_VERSION;

/// `handlers! { Op(handle, op) => expression; ... }`: the expression answers `op` with the
/// coordinator's handle, as a `Result<_, CoordinatorError>` (mapped to the API's error).
macro_rules! handlers {
    ($( $op:ident($h:ident, $o:pat) => $body:expr; )*) => {
        $(
            impl Handler<$op> for CoordinatorHandle {
                async fn handle(&self, op: $op) -> Result<<$op as Operation>::Reply, ApiError> {
                    let $h = self;
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
    Ping(_h, _) => server_info();
    Forks(h, _) => h.forks().await;
    Accounts(h, _) => h.accounts().await;
    CreateFork(h, op) => h.create_fork(op).await;
    AgentFork(h, op) => h.agent_fork(op).await;
    AgentMerge(h, op) => h.agent_merge(op.fork, &op.pick, op.parent_run).await;
    GetFork(h, op) => h.fork(op.fork).await;
    FindFork(h, op) => h.find_fork(&op.prefix).await;
    WaitSettled(h, op) => h.wait_settled(op.fork, bounded_wait(op.timeout_ms)).await;
    Watch(h, op) => h.watch(op.fork, op.seen, bounded_wait(op.timeout_ms)).await;
    Diff(h, op) => h.diff(op.fork, op.options).await;
    Merge(h, op) => h.merge(op.fork, &op.pick).await;
    Terminate(h, op) => h.terminate(op.fork, &op.label).await;
    Abort(h, op) => h.abort(op.fork).await;
    Steer(h, op) => h.steer(op.fork, &op.label, op.text).await;
    Continue(h, op) => h.follow_up(op.fork, &op.label, op.text).await;
    RunEvents(h, op) => h.run_events(op.run).await.map(|events| {
        events.into_iter().map(|(seq, event)| LoggedEvent { seq, event }).collect::<Vec<_>>()
    });
    Checkpoints(h, op) => h.checkpoints(op.run).await;
    GetForkCost(h, op) => h.fork_cost(op.fork).await;
    Topup(h, op) => h.topup(op.fork, op.branch.as_deref(), op.usd).await;
    MoveBudget(h, op) => h.move_budget(op.fork, &op.from, &op.to, op.usd).await;
    AccountSet(h, op) => h.account_set(&op.name, op.cap_usd).await;
    // Tests on every branch and the judges (on workers), the decision, the merge.
    Resolve(h, op) => crate::resolve::resolve(h, op.fork, op.strategy).await;
    FindRun(h, op) => h.find_run(&op.prefix).await;
    CheckpointSave(h, op) => h.checkpoint_save(op.run, &op.label).await;
    CheckpointRemove(h, op) => h.checkpoint_remove(op.run, &op.checkpoint).await;
    CheckpointClear(h, op) => h.checkpoint_clear(op.run).await;
    Rewind(h, op) => h.rewind(op.run, &op.checkpoint, op.dry_run).await;
    ForkCheckpoint(h, op) => h.fork_checkpoint(op.run, &op.checkpoint).await;
    RunWorkspace(h, op) => h.root_workspace(op.run).await;
    GetBlob(h, op) => h.store().blob(&op.blob);
}

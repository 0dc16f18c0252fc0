//! The root actor: owns the forks (fork id -> fork actor), supervises them, and routes.
//! On start it loads every fork of the store; a fork actor that fails is restarted from the
//! store (its replica is rebuilt from the event log).

use crate::budget::Ledger;
use crate::create::PreparedFork;
use crate::error::{actor_call, CoordinatorError};
use crate::fork::{ForkActor, ForkArgs, ForkHandle, CALL_TIMEOUT_MS};
use crate::store::RunStore;
use forkfleet_bus::Bus;
use forkfleet_shared::clock::Clock;
use forkfleet_shared::ids::ForkId;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::collections::BTreeMap;
use std::sync::Arc;

pub(crate) struct RootActor;

pub(crate) struct RootArgs {
    /// The pool the forks' branch tasks go to (an answer to a request for consent, or a
    /// timeout, enqueues the branch again there).
    pub pool: String,
    pub store: RunStore,
    pub bus: Arc<dyn Bus>,
    pub ledger: Arc<Ledger>,
    /// The time that decides (the forks' deadlines of requests for consent).
    pub clock: Arc<dyn Clock>,
}

pub(crate) struct RootState {
    pool: String,
    store: RunStore,
    bus: Arc<dyn Bus>,
    ledger: Arc<Ledger>,
    clock: Arc<dyn Clock>,
    forks: BTreeMap<ForkId, ForkHandle>,
}

pub(crate) enum RootMsg {
    /// Start the actor of a fork just written to the store.
    StartFork(
        Box<PreparedFork>,
        RpcReplyPort<Result<ForkHandle, CoordinatorError>>,
    ),
    /// Start the actor of a fork just written to the store, loading it from the store
    /// (a child of `runs fork`, whose log already holds its own events).
    LoadFork(ForkId, RpcReplyPort<Result<ForkHandle, CoordinatorError>>),
    Lookup(ForkId, RpcReplyPort<Option<ForkHandle>>),
    /// Every fork, newest first.
    List(RpcReplyPort<Vec<ForkHandle>>),
    Find(String, RpcReplyPort<Result<ForkId, CoordinatorError>>),
    /// Stop a fork's actor and forget it (the fork is being deleted, `gc`).
    Remove(ForkId, RpcReplyPort<()>),
}

#[derive(Clone)]
pub(crate) struct RootHandle(ActorRef<RootMsg>);

fn call_error<T>(e: ractor::RactorErr<T>) -> CoordinatorError {
    actor_call(e, "root actor", "a call to the root actor", CALL_TIMEOUT_MS)
}

impl RootHandle {
    pub fn new(actor: ActorRef<RootMsg>) -> Self {
        Self(actor)
    }

    pub async fn start_fork(&self, prepared: PreparedFork) -> Result<ForkHandle, CoordinatorError> {
        ractor::call_t!(
            self.0,
            RootMsg::StartFork,
            CALL_TIMEOUT_MS,
            Box::new(prepared)
        )
        .map_err(call_error)?
    }

    pub async fn load_fork(&self, id: ForkId) -> Result<ForkHandle, CoordinatorError> {
        ractor::call_t!(self.0, RootMsg::LoadFork, CALL_TIMEOUT_MS, id).map_err(call_error)?
    }

    /// Stop fork `id`'s actor and forget it (see [`RootMsg::Remove`]).
    pub async fn remove(&self, id: ForkId) -> Result<(), CoordinatorError> {
        ractor::call_t!(self.0, RootMsg::Remove, CALL_TIMEOUT_MS, id).map_err(call_error)
    }

    pub async fn lookup(&self, id: ForkId) -> Result<Option<ForkHandle>, CoordinatorError> {
        ractor::call_t!(self.0, RootMsg::Lookup, CALL_TIMEOUT_MS, id).map_err(call_error)
    }

    pub async fn fork(&self, id: ForkId) -> Result<ForkHandle, CoordinatorError> {
        self.lookup(id)
            .await?
            .ok_or_else(|| CoordinatorError::UnknownFork(id.to_string()))
    }

    pub async fn list(&self) -> Result<Vec<ForkHandle>, CoordinatorError> {
        ractor::call_t!(self.0, RootMsg::List, CALL_TIMEOUT_MS).map_err(call_error)
    }

    pub async fn find(&self, prefix: String) -> Result<ForkId, CoordinatorError> {
        ractor::call_t!(self.0, RootMsg::Find, CALL_TIMEOUT_MS, prefix).map_err(call_error)?
    }
}

impl RootState {
    async fn spawn_fork(
        &mut self,
        myself: &ActorRef<RootMsg>,
        id: ForkId,
        args: ForkArgs,
    ) -> Result<ForkHandle, CoordinatorError> {
        let (actor, _join) = Actor::spawn_linked(None, ForkActor, args, myself.get_cell())
            .await
            .map_err(|e| {
                CoordinatorError::Internal(format!("cannot start the actor of fork {id}: {e}"))
            })?;
        let handle = ForkHandle::new(actor);
        self.forks.insert(id, handle.clone());
        Ok(handle)
    }

    fn load_args(&self, fork: ForkId) -> ForkArgs {
        ForkArgs::Load {
            pool: self.pool.clone(),
            fork,
            store: self.store.clone(),
            bus: self.bus.clone(),
            ledger: self.ledger.clone(),
            clock: self.clock.clone(),
        }
    }

    fn find(&self, prefix: &str) -> Result<ForkId, CoordinatorError> {
        if let Ok(id) = crate::prefix::needle(prefix).parse::<ForkId>() {
            return if self.forks.contains_key(&id) {
                Ok(id)
            } else {
                Err(CoordinatorError::UnknownFork(prefix.to_string()))
            };
        }
        // By the start of the id only: a fork's name is looked for before its tail
        // (`CoordinatorHandle::find_fork_for`).
        let ids = crate::prefix::keyed(self.forks.keys().copied());
        let matches = crate::prefix::matching_by(ids, prefix, false);
        crate::prefix::one_fork(&matches, prefix)
    }
}

impl Actor for RootActor {
    type Msg = RootMsg;
    type State = RootState;
    type Arguments = RootArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut state = RootState {
            pool: args.pool,
            store: args.store,
            bus: args.bus,
            ledger: args.ledger,
            clock: args.clock,
            forks: BTreeMap::new(),
        };
        let store = state.store.clone();
        let records = tokio::task::spawn_blocking(move || store.forks()).await??;
        for r in records {
            let args = state.load_args(r.fork_id);
            if let Err(e) = state.spawn_fork(&myself, r.fork_id, args).await {
                // One unreadable fork must not keep the others down.
                tracing::error!(fork.id = %r.fork_id, error = %e, "fork could not be loaded; skipped");
            }
        }
        tracing::info!(forks = state.forks.len(), "coordinator.loaded");
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RootMsg::StartFork(prepared, reply) => {
                let id = prepared.fork.fork_id;
                let args = ForkArgs::Created {
                    prepared,
                    pool: state.pool.clone(),
                    store: state.store.clone(),
                    bus: state.bus.clone(),
                    ledger: state.ledger.clone(),
                    clock: state.clock.clone(),
                };
                let _ = reply.send(state.spawn_fork(&myself, id, args).await);
            }
            RootMsg::LoadFork(id, reply) => {
                let args = state.load_args(id);
                let _ = reply.send(state.spawn_fork(&myself, id, args).await);
            }
            RootMsg::Lookup(id, reply) => {
                let _ = reply.send(state.forks.get(&id).cloned());
            }
            RootMsg::List(reply) => {
                let _ = reply.send(state.forks.values().rev().cloned().collect());
            }
            RootMsg::Find(prefix, reply) => {
                let _ = reply.send(state.find(&prefix));
            }
            RootMsg::Remove(id, reply) => {
                if let Some(fork) = state.forks.remove(&id) {
                    fork.actor().stop(Some("the fork is deleted".to_string()));
                }
                let _ = reply.send(());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorFailed(cell, err) => {
                let Some(id) = state
                    .forks
                    .iter()
                    .find(|(_, h)| h.actor().get_id() == cell.get_id())
                    .map(|(id, _)| *id)
                else {
                    return Ok(());
                };
                tracing::error!(fork.id = %id, error = %err, "fork actor failed; restarting it from the store");
                state.forks.remove(&id);
                let args = state.load_args(id);
                if let Err(e) = state.spawn_fork(&myself, id, args).await {
                    tracing::error!(fork.id = %id, error = %e, "fork actor could not be restarted");
                }
            }
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                state
                    .forks
                    .retain(|_, h| h.actor().get_id() != cell.get_id());
            }
            _ => {}
        }
        Ok(())
    }
}

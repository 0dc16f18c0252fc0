//! Automatic checkpoints of branch runs: where an applied step puts one under the fork's
//! `checkpoints` policy, saving and evicting them as the fork actor applies events, and
//! the repair on load (see the parent module's documentation).

use super::{tool_label, turn_label};
use crate::error::CoordinatorError;
use crate::replica::Step;
use crate::store::RunStore;
use forkfleet_shared::api::{CheckpointKind, CheckpointView};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::ids::{CheckpointId, RunId};
use forkfleet_shared::protocol::now_ms;
use forkfleet_shared::spec::{CheckpointFrequency, CheckpointPolicy};
use std::collections::{HashMap, VecDeque};

/// One automatic checkpoint to save: its position, label, turn and tool.
#[derive(Debug, Clone, PartialEq, Eq)]
struct AutoPoint {
    seq: u64,
    label: String,
    turn: u32,
    tool: Option<String>,
}

impl AutoPoint {
    /// Where an applied step puts an automatic checkpoint under `frequency`, if anywhere:
    /// `every_turn` just before a model response, `every_tool` at a tool result.
    fn of(step: &Step, frequency: CheckpointFrequency) -> Option<AutoPoint> {
        match (frequency, step) {
            (CheckpointFrequency::EveryTurn, Step::Response { seq, turn }) => Some(AutoPoint {
                seq: seq.saturating_sub(1),
                label: turn_label(*turn),
                turn: turn - 1,
                tool: None,
            }),
            (
                CheckpointFrequency::EveryTool,
                Step::Tool {
                    seq,
                    call,
                    name,
                    turn,
                },
            ) => Some(AutoPoint {
                seq: *seq,
                label: tool_label(*call, name),
                turn: *turn,
                tool: Some(name.clone()),
            }),
            _ => None,
        }
    }
}

/// The state of one branch run's automatic checkpoints.
#[derive(Debug, Default)]
struct AutoRun {
    /// The highest position saved (or decided) so far: a point at or before it is not
    /// saved again.
    through: Option<u64>,
    /// The automatic checkpoints this actor knows, oldest first (a superset of the store's:
    /// one removed by hand is dropped here when its turn to be evicted comes).
    saved: VecDeque<CheckpointId>,
}

/// The automatic checkpoints of one fork's branches, owned by its fork actor.
pub(crate) struct AutoCheckpoints {
    policy: CheckpointPolicy,
    /// The fork snapshot: every branch checkpoint's `snapshot`.
    snapshot: BlobHash,
    runs: HashMap<RunId, AutoRun>,
}

impl AutoCheckpoints {
    /// A fork just created: no checkpoints yet.
    pub fn new(policy: CheckpointPolicy, snapshot: BlobHash) -> Self {
        Self {
            policy,
            snapshot,
            runs: HashMap::new(),
        }
    }

    /// A fork loaded from the store: pick up each branch's counts and automatic
    /// checkpoints, and save the points a crash lost (see the module documentation).
    /// `steps` are each branch's, as its replica was rebuilt from its log.
    pub fn load(
        store: &RunStore,
        policy: CheckpointPolicy,
        snapshot: BlobHash,
        steps: Vec<(RunId, Vec<Step>)>,
    ) -> Result<Self, CoordinatorError> {
        let mut this = Self::new(policy, snapshot);
        if policy.frequency == CheckpointFrequency::ManualOnly {
            return Ok(this);
        }
        for (run_id, steps) in steps {
            let autos: Vec<CheckpointView> = store
                .checkpoints(run_id)?
                .into_iter()
                .filter(|c| c.kind == CheckpointKind::Auto)
                .collect();
            let mark = store.checkpoint_mark(run_id)?;
            let through = autos
                .iter()
                .map(|c| c.seq)
                .chain((mark > 0).then_some(mark))
                .max();
            let mut run = AutoRun {
                through,
                saved: {
                    let mut ids: Vec<(u64, CheckpointId)> =
                        autos.iter().map(|c| (c.created_at_ms, c.id)).collect();
                    ids.sort();
                    ids.into_iter().map(|(_, id)| id).collect()
                },
            };
            let missing: Vec<AutoPoint> = steps
                .iter()
                .filter_map(|step| AutoPoint::of(step, policy.frequency))
                .filter(|p| through.is_none_or(|t| p.seq > t))
                .collect();
            // Older ones would be evicted at once.
            let keep = policy.max_checkpoints as usize;
            let skip = missing.len().saturating_sub(keep);
            if !missing.is_empty() {
                tracing::info!(run.id = %run_id, repaired = missing.len() - skip, "checkpoint.repair: saving automatic checkpoints a restart found missing");
            }
            for p in missing.into_iter().skip(skip) {
                this.save(store, run_id, &mut run, p)?;
            }
            this.runs.insert(run_id, run);
        }
        Ok(this)
    }

    /// `run`'s replica applied `steps`: save the automatic checkpoints they make and evict
    /// the oldest. A failure is logged, never fatal to applying events.
    pub fn on_applied(&mut self, store: &RunStore, run: RunId, steps: &[Step]) {
        if self.policy.frequency == CheckpointFrequency::ManualOnly || steps.is_empty() {
            return;
        }
        let mut state = self.runs.remove(&run).unwrap_or_default();
        for p in steps
            .iter()
            .filter_map(|step| AutoPoint::of(step, self.policy.frequency))
        {
            if state.through.is_some_and(|t| p.seq <= t) {
                continue;
            }
            if let Err(e) = self.save(store, run, &mut state, p) {
                tracing::error!(run.id = %run, error = %e, "checkpoint.auto: cannot save an automatic checkpoint");
                break;
            }
        }
        self.runs.insert(run, state);
    }

    fn save(
        &self,
        store: &RunStore,
        run: RunId,
        state: &mut AutoRun,
        p: AutoPoint,
    ) -> Result<(), CoordinatorError> {
        let mut metadata = std::collections::BTreeMap::new();
        if let Some(tool) = p.tool {
            metadata.insert("tool".to_string(), tool);
        }
        let c = CheckpointView {
            id: CheckpointId::new(),
            run_id: run,
            label: p.label,
            seq: p.seq,
            snapshot: self.snapshot,
            created_at_ms: now_ms(),
            base_seq: 0,
            turn: p.turn,
            kind: CheckpointKind::Auto,
            metadata,
        };
        store.save_checkpoint(&c)?;
        state.through = Some(p.seq);
        state.saved.push_back(c.id);
        while state.saved.len() > self.policy.max_checkpoints as usize {
            if let Some(old) = state.saved.pop_front() {
                store.remove_checkpoint(run, old)?;
            }
        }
        Ok(())
    }
}

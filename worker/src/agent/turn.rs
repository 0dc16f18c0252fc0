//! One turn of the agent loop: control commands, the turn and budget checks, the model
//! call, then its usage, its response and its tool calls published.

use super::approval::Gated;
use super::control::{exhausted, until_halted};
use super::coordinator::{reserve, Reserved};
use super::learn;
use super::replay::{Answer, Next};
use super::{lease_lost, AgentState, Publisher, Run, Step};
use crate::error::WorkerError;
use crate::forktools::{ForkCall, MERGE_OR_SELECT};
use crate::genai::{error_type, tool_failed, tool_span, ChatSpan};
use crate::provider::{
    is_refused, is_truncated, ModelRequest, SpendCap, StreamMeter, BUDGET_CUT, RESERVATION_CUT,
};
use crate::tools::ToolBox;
use crate::warmup::{self, Turn as WarmTurn};
use forkfleet_shared::budget::OnExhausted;
use forkfleet_shared::budget::{estimate_cost, Settle};
use forkfleet_shared::event::{messages_from_events, Event, Message, Usage};
use forkfleet_shared::ids::ReservationId;
use forkfleet_shared::lineage::{tool_call_hash, RequestHash, RequestHasher};
use forkfleet_shared::overlay::ChangeOp;
use forkfleet_shared::protocol::BranchTask;
use forkfleet_shared::spec::{OnTruncated, CONTINUE_TRUNCATED};
use forkfleet_shared::state::BranchState;
use forkfleet_shared::tools::{self, ToolKind};
use tracing::Instrument;

/// How far past its reservation a streamed answer may run before it is cut (strict mode):
/// its output is estimated at four characters a token as it streams, which a legitimate
/// answer of `max_output_tokens` may exceed a little.
const RESERVATION_MARGIN: f64 = 1.25;

/// Count and publish the metered `usage` of a call that gave no reply (cancelled, or
/// broken after some of its answer): what the provider bills for it, estimated.
async fn pay_metered(
    out: &mut Publisher,
    run: &mut Run,
    task: &BranchTask,
    reservation: Option<ReservationId>,
    usage: Usage,
) -> Result<(), WorkerError> {
    let cost_usd = task.price.map_or(0.0, |p| p.cost(&usage));
    run.spent_usd += cost_usd;
    run.last_settle = settle(reservation, cost_usd);
    out.publish(Event::Usage {
        model: task.model.clone(),
        usage,
        cost_usd,
        reservation,
        cached: false,
    })
    .await?;
    Ok(())
}

/// What the next reservation request says of this call.
fn settle(reservation: Option<ReservationId>, cost_usd: f64) -> Option<Settle> {
    reservation.map(|reservation| Settle {
        reservation,
        cost_usd,
    })
}

/// Run the next turn of the branch: the step it leads to. Its phases, in order: the
/// commands that came ([`Turn::take_commands`]), a parked response's remaining calls, a
/// replay's recorded inputs, the turn and budget limits ([`Turn::limits`]), the request's
/// hash, the answer (from the record, [`Turn::recorded`], or from the provider,
/// [`Turn::call_model`]), then the answer recorded and acted on ([`Turn::act_on`]).
pub(super) async fn run_turn(state: &mut AgentState) -> Result<Step, WorkerError> {
    let AgentState {
        ctx,
        lease,
        task,
        out,
        control,
        pending,
        run,
        ..
    } = state;
    let Some(run) = run.as_mut() else {
        return Ok(Step::Finish(
            BranchState::Failed,
            Some("internal error: a turn ran before the branch was loaded".into()),
        ));
    };
    let mut turn = Turn {
        ctx,
        lease,
        task,
        out,
        control,
        pending,
    };
    if let Some(step) = turn.take_commands(run).await? {
        return Ok(step);
    }
    // A branch resumed after an answer to its request for consent: its last response's
    // remaining calls run first (their results must follow that response).
    if let Some(parked) = run.parked.take() {
        let tools = run.tools.clone();
        let mut calls = Calls {
            turn,
            tools: &tools,
        };
        return calls.run(run, &parked.calls, parked.cutoff_seq).await;
    }
    turn.replay_inputs(run).await?;
    if let Some(step) = turn.limits(run) {
        return Ok(step);
    }
    // Checked before reserving (a lost lease must not hold money) and so before the call.
    if let Some(step) = lease_lost(turn.lease) {
        return Ok(step);
    }
    let tools = run.tools.clone();
    let request = request_hash(run, turn.task, &tools);
    // The call's output cap: the task's, or lower to fit a partial reservation.
    let mut call_cap = turn.task.max_output_tokens;
    let answer = match turn.recorded(run, &request) {
        Recorded::Served(answer) => {
            turn.publish_served_usage(run).await?;
            answer
        }
        Recorded::Live => match turn.call_model(run, &tools, &mut call_cap).await? {
            Ok(answer) => answer,
            Err(step) => return Ok(step),
        },
        Recorded::Diverged(step) => return Ok(step),
    };
    turn.act_on(run, answer, request, call_cap, &tools).await
}

/// The content hash of the request this turn makes, recorded with its response (and
/// compared with the record's by a replay).
fn request_hash(run: &mut Run, task: &BranchTask, tools: &ToolBox) -> RequestHash {
    run.messages_hash.update(&run.history);
    run.hasher
        .get_or_insert_with(|| {
            RequestHasher::new(
                &task.model,
                &RequestHash::tools_hash(tools.specs()),
                task.temperature,
                task.max_output_tokens,
            )
        })
        .hash(&run.messages_hash)
}

/// What a replay's record says of this turn's call.
enum Recorded {
    /// The record answers it (the same request).
    Served(Answer),
    /// No record (or none left, or it diverged and the branch records live): the provider
    /// answers.
    Live,
    /// The request differs from the record's: the branch ends with this step.
    Diverged(Step),
}

/// The agent's state a turn works with, borrowed for its phases.
struct Turn<'a> {
    ctx: &'a crate::context::WorkerCtx,
    lease: &'a crate::lease::TaskLease,
    task: &'a BranchTask,
    out: &'a mut Publisher,
    control: &'a mut Option<tokio::sync::mpsc::UnboundedReceiver<bytes::Bytes>>,
    pending: &'a mut super::Pending,
}

impl Turn<'_> {
    /// What arrived during the last call, then control commands sent since, one by one in
    /// order: steers are applied, a stop ends the branch (between calls a graceful stop is
    /// as good as an immediate one).
    async fn take_commands(&mut self, run: &mut Run) -> Result<Option<Step>, WorkerError> {
        loop {
            for text in std::mem::take(&mut self.pending.steers) {
                apply_steer(self.out, run, text).await?;
            }
            if let Some(step) = self.pending.halt.take() {
                return Ok(Some(step));
            }
            let Some(bytes) = self.control.as_mut().and_then(|rx| rx.try_recv().ok()) else {
                return Ok(None);
            };
            if let Some(step) = self
                .pending
                .file(&bytes, self.task.run_id, self.out.attempt)
            {
                return Ok(Some(step));
            }
        }
    }

    /// A replaying child: what the parent's record holds before its next call.
    async fn replay_inputs(&mut self, run: &mut Run) -> Result<(), WorkerError> {
        let Some(replay) = run.replay.as_mut() else {
            return Ok(());
        };
        let inputs = replay.inputs();
        if matches!(replay.next(), Next::Done) {
            tracing::info!("replay: the record is used up; the branch goes on live");
            run.replay = None;
        }
        for event in inputs {
            publish_recorded(self.out, run, event).await?;
        }
        Ok(())
    }

    /// The step a branch at its `max_turns`, or (without reservations) at its own cap,
    /// takes instead of a call.
    fn limits(&self, run: &Run) -> Option<Step> {
        let task = self.task;
        if run.turns.saturating_sub(run.turn_base) >= task.max_turns {
            return Some(Step::Finish(
                BranchState::Failed,
                Some(format!("max_turns ({}) reached", task.max_turns)),
            ));
        }
        // Without reservations, the branch's own cap is checked here; with them the
        // coordinator's ledger is authoritative (and the cap may have been topped up).
        let budget = task.budget_usd.filter(|_| !task.reserve)?;
        (run.spent_usd >= budget).then(|| {
            exhausted(
                task.on_exhausted,
                BranchState::BudgetExhausted,
                format!(
                    "branch budget of ${budget} reached (spent ${:.6})",
                    run.spent_usd
                ),
            )
        })
    }

    /// Whether a replay's record answers the call of `request`.
    fn recorded(&self, run: &mut Run, request: &RequestHash) -> Recorded {
        let Some(replay) = run.replay.as_mut() else {
            return Recorded::Live;
        };
        match replay.next() {
            Next::Done => Recorded::Live,
            Next::Call {
                seq,
                request: recorded,
            } if recorded.hash == request.hash => {
                tracing::debug!(
                    parent.seq = seq,
                    "replay: model call served from the record"
                );
                replay
                    .serve_response()
                    .map_or(Recorded::Live, Recorded::Served)
            }
            Next::Call {
                seq,
                request: recorded,
            } => {
                let why = replay.divergence(self.out.seq + 1, seq, recorded, request);
                if !replay.record_live() {
                    tracing::info!(reason = %why, "replay diverged");
                    return Recorded::Diverged(Step::Finish(BranchState::Failed, Some(why)));
                }
                tracing::info!(reason = %why, "replay diverged; going on live and recording (--record)");
                run.replay = None;
                Recorded::Live
            }
        }
    }

    /// An answer served from the record counts a turn, and costs nothing.
    async fn publish_served_usage(&mut self, run: &mut Run) -> Result<(), WorkerError> {
        run.turns += 1;
        self.out
            .publish(Event::Usage {
                model: self.task.model.clone(),
                usage: Default::default(),
                cost_usd: 0.0,
                reservation: None,
                cached: true,
            })
            .await?;
        Ok(())
    }

    /// The provider's answer to this turn's call: wait for the fork's prompt cache to be
    /// warm, reserve (strict mode), call, and publish what it cost; or the step the branch
    /// takes instead (a command, a refused reservation, a lost lease, a failed call).
    async fn call_model(
        &mut self,
        run: &mut Run,
        tools: &ToolBox,
        call_cap: &mut u32,
    ) -> Result<Result<Answer, Step>, WorkerError> {
        let task = self.task;
        let attempt = self.out.attempt;
        // What this turn published so far (steers, a replay's inputs), stored before the
        // call is reserved and made.
        self.out.flush().await?;
        // Best-effort mode stopping at the branch's cap: the answer is metered as it
        // streams and cut when its running cost passes what is left.
        let spend_cap = match (task.reserve, task.on_exhausted, task.budget_usd, task.price) {
            (false, OnExhausted::Stop, Some(budget), Some(price)) => Some(SpendCap {
                price,
                remaining_usd: (budget - run.spent_usd).max(0.0),
                reservation: false,
            }),
            _ => None,
        };
        let meter = StreamMeter::default();
        let mut req = ModelRequest {
            model: &task.model,
            messages: &run.history,
            tools: tools.specs(),
            max_output_tokens: task.max_output_tokens,
            label: &task.label,
            index: task.index,
            turn: run.turns,
            temperature: task.temperature,
            cache_key: Some(&run.cache_key),
            shared_prefix: run.shared_prefix,
            spend_cap,
            meter: Some(&meter),
        };
        let _warming = match self.warm_up(run).await {
            Ok(held) => held,
            Err(step) => return Ok(Err(step)),
        };
        let (reservation, estimated) = if task.reserve {
            match self.reserve_call(run, &mut req).await? {
                Ok((id, estimate)) => (Some(id), Some(estimate)),
                Err(step) => return Ok(Err(step)),
            }
        } else {
            (None, None)
        };
        *call_cap = req.max_output_tokens;
        // A graceful stop that came while reserving waits in `pending` until this call,
        // paid for by its reservation, is made and recorded. The call runs until it
        // answers or a command stops the branch; a cancelled call is dropped (aborted, its
        // stream closed); what it had streamed was paid for and is published as its usage
        // when a command ended the branch.
        let chat = ChatSpan::new(
            &req,
            task.fork_id,
            Some(task.run_id),
            run.provider.server_address(),
        );
        let call = run.provider.complete(&req).instrument(chat.span().clone());
        let halted = until_halted(
            call,
            self.control,
            task.run_id,
            attempt,
            self.pending,
            Some(&self.ctx.handback),
        )
        .await;
        let reply = match halted {
            Err(step) => {
                chat.cancelled();
                tracing::info!("model call cancelled: the branch stops or is handed back");
                if let (Step::Finish(..), Some(usage)) = (&step, meter.get()) {
                    pay_metered(self.out, run, task, reservation, usage).await?;
                }
                return Ok(Err(step));
            }
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                chat.failed(&error_type(&e));
                tracing::warn!(error = %e, "model call failed");
                // A stream that broke after some of the answer: the provider generated it
                // and bills it; it is counted (estimated from what arrived).
                if let Some(usage) = meter.generated() {
                    pay_metered(self.out, run, task, reservation, usage).await?;
                }
                return Ok(Err(Step::Finish(
                    BranchState::Failed,
                    Some(format!("model call failed: {e}")),
                )));
            }
        };
        run.turns += 1;
        tracing::debug!(
            usage.input_tokens = reply.usage.input_tokens,
            usage.output_tokens = reply.usage.output_tokens,
            tool_calls = reply.tool_calls.len(),
            "model replied"
        );
        // Usage first: the call is paid for whether or not its response is recorded. If
        // this worker is lost before the response is, the branch's next worker makes the
        // call again, and both calls are counted, as both were paid.
        if let Some(estimate) = &estimated {
            run.learned.observe(estimate, &reply.usage);
        }
        let cost_usd = task.price.map_or(0.0, |p| p.cost(&reply.usage));
        chat.replied(&reply, task.price.map(|_| cost_usd));
        run.spent_usd += cost_usd;
        run.last_settle = settle(reservation, cost_usd);
        self.out
            .publish(Event::Usage {
                model: task.model.clone(),
                usage: reply.usage,
                cost_usd,
                reservation,
                cached: false,
            })
            .await?;
        // A lease lost during the call: its usage is out (the provider bills it, and the
        // coordinator counts it even from a fenced attempt); nothing more is done.
        if let Some(step) = lease_lost(self.lease) {
            return Ok(Err(step));
        }
        Ok(Ok(Answer {
            text: reply.text,
            tool_calls: reply.tool_calls,
            finish_reason: reply.finish_reason,
            reasoning: reply.reasoning,
        }))
    }

    /// The branch's first call with a prompt cache: one per fork on this worker writes the
    /// shared history to the cache (it holds what this returns until its call is made),
    /// the others wait for it and read it.
    async fn warm_up(&mut self, run: &Run) -> Result<Option<warmup::Held>, Step> {
        let warmups =
            self.ctx.warmups.as_ref().filter(|_| {
                run.turns == 0 && run.shared_prefix > 0 && run.provider.caches_prompts()
            });
        let Some(warmups) = warmups else {
            return Ok(None);
        };
        match warmups.enter(&run.cache_key, self.task.prefix) {
            WarmTurn::Go(held) => Ok(Some(held)),
            WarmTurn::Wait(rx) => {
                tracing::debug!("waiting for this fork's first call to warm the prompt cache");
                until_halted(
                    warmup::wait(rx),
                    self.control,
                    self.task.run_id,
                    self.out.attempt,
                    self.pending,
                    Some(&self.ctx.handback),
                )
                .await?;
                // The wait took time: the lease is checked again before the call.
                match lease_lost(self.lease) {
                    Some(step) => Err(step),
                    None => Ok(None),
                }
            }
        }
    }

    /// Strict mode: reserve the call's cost at the coordinator's ledger before it is made
    /// (its id and the estimate it was asked for), fitting `req`'s output cap to a partial
    /// grant and metering its stream against what was granted; or the step the branch
    /// takes when it gets none.
    async fn reserve_call(
        &mut self,
        run: &Run,
        req: &mut ModelRequest<'_>,
    ) -> Result<Result<(ReservationId, Usage), Step>, WorkerError> {
        let task = self.task;
        let attempt = self.out.attempt;
        let estimate = run.provider.estimate(req);
        // What the branch's calls say this one needs: the ledger may grant less than the
        // estimate (the room a cap has left), if at least this.
        let least = if run.provider.estimate_is_exact() {
            estimate
        } else {
            run.learned.least(&estimate)
        };
        // A hand-back ends the waits between requests (for room, or for a coordinator
        // that is away); a request in flight finishes, so its answer is acted on.
        let reserving = reserve(
            &self.ctx.bus,
            super::coordinator::Waits::until(self.lease, &self.ctx.handback),
            task,
            attempt,
            estimate,
            least,
            run.last_settle,
        );
        let granted = match until_halted(
            reserving,
            self.control,
            task.run_id,
            attempt,
            self.pending,
            None,
        )
        .await
        {
            Err(step) => return Ok(Err(step)),
            Ok(granted) => granted?,
        };
        let (id, partial) = match granted {
            Reserved::Granted(id, partial) => (id, partial),
            Reserved::Refused { state, reason } => {
                tracing::info!(reason = %reason, "budget reservation refused");
                return Ok(Err(exhausted(task.on_exhausted, state, reason)));
            }
            Reserved::Gone(reason) => return Ok(Err(Step::Drop(reason))),
            Reserved::HandedBack => return Ok(Err(Step::HandBack)),
            Reserved::Superseded(by) => {
                return Ok(Err(Step::Lost(
                    self.lease.lose(super::superseded(by, attempt)),
                )));
            }
        };
        // The reservation took time: the lease is checked again before the call.
        if let Some(step) = lease_lost(self.lease) {
            return Ok(Err(step));
        }
        let mut held = task.price.map(|p| estimate_cost(&p, &estimate));
        if let (Some(usd), Some(price)) = (partial, task.price) {
            // Less than the estimate: the call's output cap fits it.
            req.max_output_tokens =
                learn::fitted_output_cap(&price, &estimate, &least, usd, task.max_output_tokens);
            held = Some(usd);
            tracing::info!(
                granted_usd = usd,
                max_output_tokens = req.max_output_tokens,
                "budget: the cap had room for less than the call's bound; its output cap is lowered to fit"
            );
        }
        // Strict mode holds against a provider that bills past the output cap: the answer
        // is metered as it streams and cut once its running cost passes the reservation
        // (with a margin for the four-characters-a-token estimate).
        req.spend_cap = task.price.zip(held).map(|(price, usd)| SpendCap {
            price,
            remaining_usd: usd * RESERVATION_MARGIN,
            reservation: true,
        });
        Ok(Ok((id, estimate)))
    }

    /// Record the answer to the call of `request` (made with the output cap `call_cap`)
    /// and act on it: a cut or refused answer ends the branch, one without tool calls
    /// finishes it (or continues a truncated one, `on_truncated`), and a response's tool
    /// calls run.
    async fn act_on(
        self,
        run: &mut Run,
        answer: Answer,
        request: RequestHash,
        call_cap: u32,
        tools: &ToolBox,
    ) -> Result<Step, WorkerError> {
        let task = self.task;
        let finish_reason = answer.finish_reason.as_deref();
        let cut = finish_reason == Some(BUDGET_CUT);
        // Cut at its reservation: the provider went past `max_output_tokens`; the answer
        // is treated as one cut at the output cap (`on_truncated`).
        let reservation_cut = finish_reason == Some(RESERVATION_CUT);
        if reservation_cut {
            tracing::warn!(
                max_output_tokens = call_cap,
                "the provider streamed past max_output_tokens: the answer was cut when its cost reached the call's reservation"
            );
        }
        let truncated = is_truncated(finish_reason) || reservation_cut;
        let refused = is_refused(finish_reason);
        let filtered = finish_reason == Some("content_filter");
        // A fork the response asks for gets the history before it.
        let cutoff_seq = self.out.seq.saturating_sub(1);
        let response = self
            .out
            .publish(Event::ModelResponse {
                model: task.model.clone(),
                text: answer.text,
                tool_calls: answer.tool_calls,
                finish_reason: answer.finish_reason,
                reasoning: answer.reasoning,
                request: Some(request),
            })
            .await?;
        let Event::ModelResponse {
            text,
            tool_calls,
            reasoning,
            ..
        } = response
        else {
            return Ok(Step::Continue);
        };

        if run.replay.as_ref().is_some_and(|r| r.exhausted()) {
            tracing::info!("replay: the record is used up; the branch goes on live");
            run.replay = None;
        }
        if cut {
            // The partial answer is recorded (marked `budget_cut`); the branch stops here.
            run.history.push(Message::Assistant {
                text,
                tool_calls,
                reasoning,
            });
            let budget = task.budget_usd.unwrap_or(0.0);
            return Ok(exhausted(
                task.on_exhausted,
                BranchState::BudgetExhausted,
                format!(
                    "branch budget of ${budget} reached mid-answer (spent ${:.6}): the answer was cut as it streamed, its partial text kept",
                    run.spent_usd
                ),
            ));
        }
        if refused {
            // The model refused (or the provider's filter stopped it): its text is kept,
            // the branch ends here as `refused`, not `done`.
            let why = match &text {
                _ if filtered => {
                    "the provider's content filter stopped the answer (its text so far is kept)"
                        .to_string()
                }
                Some(t) if !t.trim().is_empty() => {
                    let short: String = t.chars().take(300).collect();
                    format!("the model refused: {short}")
                }
                _ => "the model refused, saying nothing".to_string(),
            };
            run.history.push(Message::Assistant {
                text,
                tool_calls: Vec::new(),
                reasoning,
            });
            return Ok(Step::Finish(BranchState::Refused, Some(why)));
        }
        if tool_calls.is_empty() {
            run.history.push(Message::Assistant {
                text,
                tool_calls,
                reasoning,
            });
            // A replay whose record goes on (the parent was continued after this answer)
            // replays the rest before the branch ends.
            if run.replay.is_some() {
                return Ok(Step::Continue);
            }
            if truncated {
                let cap = if call_cap < task.max_output_tokens {
                    format!(
                        "{call_cap}, lowered from {} to fit the room the budget had left",
                        task.max_output_tokens
                    )
                } else {
                    call_cap.to_string()
                };
                return on_truncated(self.out, run, task.on_truncated, &cap).await;
            }
            return Ok(Step::Finish(BranchState::Done, None));
        }

        // The response goes into the history before its calls run, each result after it.
        let calls_of_response = tool_calls.clone();
        run.history.push(Message::Assistant {
            text,
            tool_calls,
            reasoning,
        });
        run.approvals.clear();
        let mut calls = Calls { turn: self, tools };
        calls.run(run, &calls_of_response, cutoff_seq).await
    }
}

/// What running a response's tool calls needs: the turn's state and its tools.
struct Calls<'a> {
    turn: Turn<'a>,
    tools: &'a ToolBox,
}

impl Calls<'_> {
    /// Run `calls` (of the response after seq `cutoff_seq`) in order, publishing each
    /// one's file changes and then its result, which goes into the history; then the
    /// branch goes on. A call the approval rules gate runs only once approved; without an
    /// answer the branch asks (`approval_requested`) and stops `awaiting_approval` there.
    async fn run(
        &mut self,
        run: &mut Run,
        calls: &[forkfleet_shared::event::ToolCall],
        cutoff_seq: u64,
    ) -> Result<Step, WorkerError> {
        match self.each(run, calls, cutoff_seq).await? {
            Some(step) => Ok(step),
            None => Ok(Step::Continue),
        }
    }

    /// [`Calls::run`]'s loop: `Some(step)` when the branch stops before every call ran.
    async fn each(
        &mut self,
        run: &mut Run,
        calls: &[forkfleet_shared::event::ToolCall],
        cutoff_seq: u64,
    ) -> Result<Option<Step>, WorkerError> {
        let Calls {
            turn:
                Turn {
                    ctx,
                    lease,
                    task,
                    out,
                    control,
                    pending,
                },
            tools,
        } = self;
        let attempt = out.attempt;
        for call in calls {
            if let Some(step) = lease_lost(lease) {
                return Ok(Some(step));
            }
            // A tool other than the file and search tools (all in memory, at once) calls
            // the coordinator or takes time: what came before it is stored first.
            if !tools::is(ToolKind::Standard, &call.name) {
                out.flush().await?;
            }
            // A replay serves the recorded call: its recorded file changes, then its result.
            if let Some((changes, result)) = run.replay.as_mut().and_then(|r| r.serve_tool(call)) {
                for change in changes {
                    apply_recorded(run, &change)?;
                    out.publish(Event::FileChange { change }).await?;
                }
                let result = out.publish(result).await?;
                run.history.extend(messages_from_events([&result]));
                continue;
            }
            match run.approvals.gated(run.gate.as_ref(), call) {
                Gated::Run => {}
                Gated::Denied(output) => {
                    tracing::info!(tool = %call.name, call.id = %call.id, "tool call denied: answered as failed");
                    publish_result(out, run, call, false, output).await?;
                    continue;
                }
                Gated::Ask(rule) => {
                    // A stop that already came wins over asking.
                    while let Some(bytes) = control.as_mut().and_then(|rx| rx.try_recv().ok()) {
                        if let Some(step) = pending.file(&bytes, task.run_id, attempt) {
                            return Ok(Some(step));
                        }
                    }
                    if let Some(step) = pending.halt.take() {
                        return Ok(Some(step));
                    }
                    let timeout_s = task
                        .approval
                        .as_ref()
                        .map_or(forkfleet_shared::approval::DEFAULT_TIMEOUT_S, |r| {
                            r.timeout_s
                        });
                    let on_timeout = task
                        .approval
                        .as_ref()
                        .map(|r| r.on_timeout)
                        .unwrap_or_default();
                    tracing::info!(
                        tool = %call.name,
                        call.id = %call.id,
                        approval.rule = %rule,
                        approval.timeout_s = timeout_s,
                        "tool call needs approval: the branch stops and waits"
                    );
                    out.publish(Event::ApprovalRequested {
                        call_id: call.id.clone(),
                        tool: call.name.clone(),
                        args: call.args.clone(),
                        rule,
                        requested_at_ms: forkfleet_shared::protocol::now_ms(),
                        timeout_s,
                        on_timeout,
                    })
                    .await?;
                    return Ok(Some(Step::Finish(BranchState::AwaitingApproval, None)));
                }
            }
            if task.tools.checkpoint_tools.is_some()
                && crate::toolspec::is_checkpoint_tool(&call.name)
            {
                let tool_span = tool_span(call, task.fork_id, task.run_id);
                let done = super::checkpoints::run(ctx, task, out, run, call, cutoff_seq)
                    .instrument(tool_span.clone())
                    .await?;
                let outcome = match done {
                    // The answer's other calls belong to the timeline left behind.
                    super::checkpoints::Done::Rewound => return Ok(Some(Step::Continue)),
                    super::checkpoints::Done::Result(o) => o,
                };
                if !outcome.ok {
                    tool_failed(&tool_span);
                }
                publish_result(out, run, call, outcome.ok, outcome.output).await?;
                continue;
            }
            let before = run.overlay.changes().len();
            let tool_span = tool_span(call, task.fork_id, task.run_id);
            let running = async {
                if task.tools.forking && tools::is(ToolKind::Fork, &call.name) {
                    let fork_call = ForkCall {
                        bus: ctx.bus.as_ref(),
                        blobs: &ctx.blobs,
                        run_id: task.run_id,
                        cutoff_seq,
                        overlay: &mut run.overlay,
                    };
                    Ok(run.forks.run(call, fork_call).await)
                } else {
                    tools.run(call, &mut run.overlay, &ctx.blobs).await
                }
            }
            .instrument(tool_span.clone());
            let outcome = if call.name == MERGE_OR_SELECT {
                // A merge is not cut short: the fork would be recorded merged and not applied.
                running.await?
            } else {
                // A command or a wait on branches ends when the branch is stopped (what it did
                // is not published: the branch ends here).
                match until_halted(
                    running,
                    control,
                    task.run_id,
                    attempt,
                    pending,
                    Some(&ctx.handback),
                )
                .await
                {
                    Ok(outcome) => outcome?,
                    Err(step) => return Ok(Some(step)),
                }
            };
            for op in &run.overlay.changes()[before..] {
                if let Some((hash, bytes)) = op
                    .written()
                    .filter(|e| !e.binary && out.attaching())
                    .and_then(|e| Some((e.hash, ctx.blobs.get_now(&e.hash)?)))
                {
                    out.attach(hash, bytes);
                }
                out.publish(Event::FileChange { change: op.clone() })
                    .await?;
            }
            if !outcome.ok {
                tool_failed(&tool_span);
                tracing::debug!(tool = %call.name, "tool call failed");
            }
            publish_result(out, run, call, outcome.ok, outcome.output).await?;
        }
        Ok(None)
    }
}

/// Publish `call`'s result and add it to the history.
async fn publish_result(
    out: &mut Publisher,
    run: &mut Run,
    call: &forkfleet_shared::event::ToolCall,
    ok: bool,
    output: String,
) -> Result<(), WorkerError> {
    let result = out
        .publish(Event::ToolResult {
            call_id: call.id.clone(),
            name: call.name.clone(),
            ok,
            output,
            request: Some(tool_call_hash(call)),
        })
        .await?;
    run.history.extend(messages_from_events([&result]));
    Ok(())
}

/// An answer cut at the output cap with no tool call: the branch is asked to go on (a
/// user message, recorded), or ends `truncated`, as the spec's `on_truncated` says.
async fn on_truncated(
    out: &mut Publisher,
    run: &mut Run,
    setting: OnTruncated,
    max_output_tokens: &str,
) -> Result<Step, WorkerError> {
    match setting {
        OnTruncated::Stop => Ok(Step::Finish(
            BranchState::Truncated,
            Some(format!(
                "the model's answer was cut at max_output_tokens ({max_output_tokens}) with no tool call (on_truncated = \"stop\")"
            )),
        )),
        OnTruncated::Continue => {
            tracing::info!(
                max_output_tokens = %max_output_tokens,
                "the answer was cut at the output cap: the model is asked to go on"
            );
            let asked = out
                .publish(Event::UserMessage {
                    text: CONTINUE_TRUNCATED.to_string(),
                })
                .await?;
            run.history.extend(messages_from_events([&asked]));
            Ok(Step::Continue)
        }
    }
}

/// Publish a steer and add it to the model's history.
async fn apply_steer(out: &mut Publisher, run: &mut Run, text: String) -> Result<(), WorkerError> {
    tracing::info!("steering message applied");
    if let Event::Steer { text } = out.publish(Event::Steer { text }).await? {
        run.history.push(Message::User { text });
    }
    Ok(())
}

/// A recorded file change applied to the branch's overlay (a replay's).
fn apply_recorded(run: &mut Run, change: &ChangeOp) -> Result<(), WorkerError> {
    run.overlay
        .apply(change.clone())
        .map_err(|e| WorkerError::Replay {
            change: change.kind(),
            path: change.path().to_string(),
            message: e.to_string(),
        })
}

/// Publish an event a replay copies from its record as it is (the conversation no
/// recorded call made, and changes of calls not served), into the history or the overlay.
async fn publish_recorded(
    out: &mut Publisher,
    run: &mut Run,
    event: Event,
) -> Result<(), WorkerError> {
    if let Event::FileChange { change } = &event {
        apply_recorded(run, change)?;
    }
    if matches!(event, Event::FollowUp { .. }) {
        // A follow-up turn of the parent: max_turns counts from here, as on a load.
        run.turn_base = run.turns;
    }
    let event = out.publish(event).await?;
    run.history.extend(messages_from_events([&event]));
    Ok(())
}

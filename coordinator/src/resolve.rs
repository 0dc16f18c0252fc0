//! Resolving a fork: tests on every branch and the judges run on workers, the decision and
//! the merge here (ADR 11).
//!
//! 1. The fork actor checks the fork can be resolved (not merged or aborted, every branch
//!    finished, no other resolve running) and hands over its records and replicas.
//! 2. **Tests** (with a `test_command`): each branch's tree (the fork-time snapshot with
//!    its changes) is put in the bus's blob store as a manifest, and a [`TestJob`] per
//!    branch goes to the workers on [`RESOLVE_SUBJECT`], all at once; a worker
//!    materialises the tree and runs the command. A job no worker answers in time is asked
//!    again (another worker may take it), then counts as no signal.
//! 3. **Judges** (every strategy but `manual`): the bounded prompt (goal, diff report,
//!    per-branch outcomes with test results) goes to each judge model as a [`JudgeJob`]:
//!    one judge for `auto` and `auto_with_fallback`, every `judge_models` entry for `vote`.
//!    When the tests gave any signal, the judges may only pick among the branches with the
//!    best pass ratio (a pick outside them is retried once like an unknown label).
//! 4. **Confidence**: for each verdict, the signals of the branch it picked (the diff's
//!    agreement, the branch's test pass ratio, its internal consistency from its log) and
//!    the plan's formula give the effective confidence.
//! 5. **Decision** ([`decide`]) and, on a commit, the merge (which stops the losers). The
//!    report is stored (`fork show` and `fork cost` read the judges' cost from it) and
//!    returned.

use crate::error::CoordinatorError;
use crate::fork::{ForkHandle, ResolveInputs};
use crate::handle::CoordinatorHandle;
use crate::store::BranchRecord;
use forkfleet_bus::{Bus, BusError};
use forkfleet_shared::api::{JudgedBy, ResolveReport};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::diff::{render_summary, DiffOptions, DiffReport};
use forkfleet_shared::event::{Event, Usage};
use forkfleet_shared::ids::ForkId;
use forkfleet_shared::protocol::{
    now_ms, JudgeJob, JudgeRun, ResolveJob, ResolveJobReply, TestJob, TestRun, RESOLVE_SUBJECT,
};
use forkfleet_shared::resolve::{
    decide, internal_consistency, judge_prompt, BranchOutcome, ConfidenceSignals, Decision,
    Strategy,
};
use forkfleet_shared::spec::ForkPlan;
use forkfleet_shared::wire;
use futures::future::join_all;
use std::fmt::Write as _;
use std::time::Duration;

/// Times a job is sent before the coordinator gives up on it (no worker answered).
const JOB_TRIES: u32 = 3;
/// Pause between tries of a job no worker answered.
const JOB_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// A test job may take this much longer than its command's timeout (materialising the
/// tree, starting the process, the reply).
const TEST_MARGIN: Duration = Duration::from_secs(60);
/// Longest a judge job may take: two model calls of at most five minutes, and the reply.
const JUDGE_JOB_TIMEOUT: Duration = Duration::from_secs(11 * 60);

/// What a resolve request asks beyond the plan.
#[derive(Debug, Clone, Default)]
pub(crate) struct Options {
    /// The plan's strategy when absent.
    pub strategy: Option<Strategy>,
    /// Decide, but merge nothing.
    pub no_commit: bool,
    /// The judges' models instead of the plan's.
    pub judge_models: Vec<String>,
}

pub(crate) async fn resolve(
    handle: &CoordinatorHandle,
    id: ForkId,
    options: Options,
) -> Result<ResolveReport, CoordinatorError> {
    let fork = handle.root().fork(id).await?;
    deny_waiting(handle, &fork, id, options.strategy.as_ref()).await?;
    let inputs = fork.resolve_start().await?;
    // Whatever happens below (an error, the caller giving up), the fork stops resolving.
    let _end = EndResolve(fork.clone());
    let span = tracing::info_span!("fork.resolve", fork.id = %id);
    // In the fork's trace, under its `fork.create`; the request that asked is linked.
    if inputs.record.trace.is_some() {
        forkfleet_shared::trace::set_parent(&span, inputs.record.trace.as_deref());
        span.follows_from(tracing::Span::current());
    }
    tracing::Instrument::instrument(run(handle, inputs, options), span).await
}

/// How long a resolve that does not wait for a person waits for the branches it denied
/// requests of to finish.
const DENIED_SETTLE: Duration = Duration::from_secs(600);

/// A resolve that decides without a person (`auto`, `auto_with_fallback`, `vote`) does not
/// wait for one: every request for consent that waits is denied by policy, and the
/// branches go on (the model reads the denial) until each has finished or waits again
/// (denied again), bounded by [`DENIED_SETTLE`]. `manual` leaves them to the person.
async fn deny_waiting(
    handle: &CoordinatorHandle,
    fork: &ForkHandle,
    id: ForkId,
    strategy: Option<&Strategy>,
) -> Result<(), CoordinatorError> {
    let strategy = match strategy {
        Some(s) => s.clone(),
        None => {
            let store = handle.store().clone();
            tokio::task::spawn_blocking(move || store.fork(id))
                .await??
                .ok_or_else(|| CoordinatorError::UnknownFork(id.to_string()))?
                .plan
                .resolve
                .strategy
        }
    };
    if !strategy.needs_judge() {
        return Ok(());
    }
    let reason = format!(
        "the fork is resolved by `{}`, which does not wait for a person",
        strategy.as_str()
    );
    let deadline = tokio::time::Instant::now() + DENIED_SETTLE;
    loop {
        let denied = fork
            .deny_waiting(
                forkfleet_shared::approval::BY_POLICY.to_string(),
                reason.clone(),
            )
            .await?;
        if denied.is_empty() {
            return Ok(());
        }
        tracing::info!(fork.id = %id, branches = ?denied, strategy = strategy.as_str(), "fork.resolve: requests for consent denied by policy; waiting for the branches");
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        fork.wait_settled(left).await?;
    }
}

/// Ends the fork's resolve when dropped.
struct EndResolve(ForkHandle);

impl Drop for EndResolve {
    fn drop(&mut self) {
        self.0.resolve_end();
    }
}

async fn run(
    handle: &CoordinatorHandle,
    inputs: ResolveInputs,
    options: Options,
) -> Result<ResolveReport, CoordinatorError> {
    let plan = &inputs.record.plan;
    let fork_id = inputs.record.fork_id;
    let strategy = options
        .strategy
        .unwrap_or_else(|| plan.resolve.strategy.clone());
    strategy.validate()?;
    // The request's judges, else the plan's, else a default one the workers offer.
    let named = if options.judge_models.is_empty() {
        plan.resolve.judge_models.clone()
    } else {
        check_judges(plan, &options.judge_models)?;
        options.judge_models.clone()
    };
    let named = if strategy.needs_judge() && named.is_empty() {
        vec![default_judge(handle, plan, &strategy).await?]
    } else {
        named
    };
    let judges: Vec<String> = match &strategy {
        Strategy::Manual => Vec::new(),
        Strategy::Vote => named,
        Strategy::Auto | Strategy::AutoWithFallback { .. } => named.into_iter().take(1).collect(),
    };
    let bus = handle.bus();
    // Every job is a child of this `fork.resolve` span, across processes.
    let trace = forkfleet_shared::trace::current_traceparent();
    let labels: Vec<String> = inputs
        .branches
        .iter()
        .map(|(r, _)| r.label.clone())
        .collect();

    // 2. Tests, every branch at once.
    let tests = run_tests(&bus, plan, &inputs, trace.clone()).await;

    // 3. Judges. The diff's text and the branches' logs are for them: without a judge only
    // the agreement score is read.
    let diff = handle
        .diff(
            fork_id,
            DiffOptions {
                unified: !judges.is_empty(),
                ..DiffOptions::default()
            },
        )
        .await?;
    let logs = if judges.is_empty() {
        Vec::new()
    } else {
        branch_logs(handle, &inputs.branches).await?
    };
    let runs = run_judges(&bus, plan, &inputs, &judges, &tests, &diff, &logs, trace).await;

    // 4. Confidence of each verdict.
    let agreement = diff.summary.agreement_score;
    let judged: Vec<JudgedBy> = runs
        .into_iter()
        .map(|run| {
            let signals = run.verdict.as_ref().and_then(|v| {
                let i = labels.iter().position(|l| *l == v.winner)?;
                let (record, _) = &inputs.branches[i];
                let test = tests
                    .iter()
                    .find(|t| t.label == v.winner)
                    .and_then(|t| t.signal.pass_ratio);
                Some(ConfidenceSignals::new(
                    agreement,
                    test,
                    logs[i].consistency(record),
                ))
            });
            let confidence = match (&run.verdict, &signals) {
                (Some(v), Some(s)) => {
                    Some(plan.resolve.confidence_formula.effective(s, v.confidence))
                }
                _ => None,
            };
            JudgedBy {
                run,
                signals,
                confidence,
            }
        })
        .collect();
    let verdicts: Vec<_> = judged
        .iter()
        .filter_map(|j| Some((j.run.verdict.clone()?, j.confidence?)))
        .collect();

    // 5. Decision, and the merge on a commit.
    let decision = decide(&strategy, &verdicts);
    let mut judge_usage = Usage::default();
    let mut judge_cost_usd = 0.0;
    let mut judge_unpriced: Vec<String> = Vec::new();
    for j in &judged {
        judge_usage.add(&j.run.usage);
        judge_cost_usd += j.run.cost_usd;
        let model = &j.run.model;
        let real = forkfleet_shared::catalogue::dialect_of(model).is_some();
        if real && judge_price(&plan.models, model).is_none() && !judge_unpriced.contains(model) {
            judge_unpriced.push(model.clone());
        }
    }
    let mut report = ResolveReport {
        fork_id,
        strategy,
        formula: plan.resolve.confidence_formula,
        tests,
        judges: judged,
        agreement_score: agreement,
        decision,
        merge: None,
        no_commit: options.no_commit,
        judge_usage,
        judge_cost_usd,
        judge_unpriced,
        resolved_at_ms: now_ms(),
    };
    if let (Decision::Commit { winner, confidence }, true) = (&report.decision, options.no_commit) {
        tracing::info!(winner = %winner, confidence, "fork.resolve decided a commit; not merged (no_commit)");
    } else if let Decision::Commit { winner, confidence } = &report.decision {
        tracing::info!(winner = %winner, confidence, "fork.resolve commits");
        match handle.merge(fork_id, winner).await {
            Ok(outcome) => report.merge = Some(outcome),
            // A fork of a running agent: the agent merges the pick itself (ADR 14).
            Err(why @ CoordinatorError::AgentMerges { .. }) => {
                tracing::info!(reason = %why, "fork.resolve leaves the merge to the agent")
            }
            Err(e) => return Err(e),
        }
    } else {
        tracing::info!(decision = ?report.decision, "fork.resolve does not merge");
    }
    let store = handle.store().clone();
    let stored = report.clone();
    tokio::task::spawn_blocking(move || store.put_resolution(fork_id, &stored)).await??;
    handle.store().flush_async().await?;
    Ok(report)
}

/// Step 2 of [`run`]: the plan's test command on every branch's tree, on workers, all at
/// once (none without one).
async fn run_tests(
    bus: &std::sync::Arc<dyn Bus>,
    plan: &ForkPlan,
    inputs: &ResolveInputs,
    trace: Option<String>,
) -> Vec<TestRun> {
    let fork_id = inputs.record.fork_id;
    match &plan.resolve.test {
        None => Vec::new(),
        Some(test) => {
            // The test command is confined as the `run_command` tool's commands are.
            let sandbox = plan
                .tools
                .run_command
                .as_ref()
                .map(|t| t.sandbox.clone())
                .unwrap_or_default();
            let sandbox = &sandbox;
            let jobs = inputs.branches.iter().map(|(record, overlay)| {
                let bus = bus.clone();
                let tree = overlay.to_manifest();
                let job_base = (record.label.clone(), test.clone());
                let trace = trace.clone();
                async move {
                    let (label, test) = job_base;
                    let hash = match put_tree(bus.as_ref(), &tree).await {
                        Ok(h) => h,
                        Err(e) => return no_signal(&label, format!("cannot store the tree: {e}")),
                    };
                    let timeout = Duration::from_secs_f64(test.timeout_s);
                    let job = ResolveJob::Test(TestJob {
                        fork_id,
                        label: label.clone(),
                        tree: hash,
                        argv: test.argv.clone(),
                        timeout_ms: timeout.as_millis() as u64,
                        env: test.env.clone(),
                        sandbox: sandbox.clone(),
                        trace: trace.clone(),
                    });
                    match ask(bus.as_ref(), &job, timeout + TEST_MARGIN).await {
                        Ok(ResolveJobReply::Test(run)) => run,
                        Ok(other) => no_signal(&label, unexpected(&other)),
                        Err(e) => no_signal(&label, e),
                    }
                }
            });
            join_all(jobs).await
        }
    }
}

/// Step 3 of [`run`]: each judge's verdict on the branches, on workers, all at once
/// (none without judges).
#[allow(clippy::too_many_arguments)]
async fn run_judges(
    bus: &std::sync::Arc<dyn Bus>,
    plan: &ForkPlan,
    inputs: &ResolveInputs,
    judges: &[String],
    tests: &[TestRun],
    diff: &DiffReport,
    logs: &[LogSummary],
    trace: Option<String>,
) -> Vec<JudgeRun> {
    let fork_id = inputs.record.fork_id;
    let labels: Vec<String> = inputs
        .branches
        .iter()
        .map(|(r, _)| r.label.clone())
        .collect();
    if judges.is_empty() {
        Vec::new()
    } else {
        let outcomes: Vec<BranchOutcome> = inputs
            .branches
            .iter()
            .zip(logs)
            .map(|((r, _), log)| BranchOutcome {
                label: r.label.clone(),
                steer: plan
                    .branches
                    .get(r.index as usize)
                    .map(|b| b.steer.clone())
                    .filter(|s| !s.trim().is_empty()),
                state: r.state,
                final_message: log.final_message.clone(),
                cost_usd: r.cost_usd,
                turns: r.turns,
                error: r.error.clone(),
                test: tests
                    .iter()
                    .find(|t| t.label == r.label)
                    .map(|t| t.signal.reason.clone()),
            })
            .collect();
        let prompt = judge_prompt(&plan.goal, &diff_text(diff), &outcomes);
        let (candidates, candidates_reason) = candidates(tests);
        let jobs = judges.iter().map(|model| {
            let model_plan = plan.models.get(model);
            let job = ResolveJob::Judge(JudgeJob {
                fork_id,
                model: model.clone(),
                price: judge_price(&plan.models, model),
                script: model_plan.and_then(|m| m.script),
                prompt: prompt.clone(),
                labels: labels.clone(),
                candidates: candidates.clone(),
                candidates_reason: candidates_reason.clone(),
                max_output_tokens: plan.limits.max_output_tokens,
                endpoint: model_plan.and_then(|m| m.endpoint.clone()),
                trace: trace.clone(),
            });
            let bus = bus.clone();
            async move {
                match ask(bus.as_ref(), &job, JUDGE_JOB_TIMEOUT).await {
                    Ok(ResolveJobReply::Judge(run)) => run,
                    Ok(other) => failed_judge(model, unexpected(&other)),
                    Err(e) => failed_judge(model, e),
                }
            }
        });
        join_all(jobs).await
    }
}

/// Judges a request names: `provider:name` models; a scripted one must be the plan's
/// (its script is there).
fn check_judges(plan: &ForkPlan, models: &[String]) -> Result<(), CoordinatorError> {
    for m in models {
        forkfleet_shared::spec::split_model(m)
            .map_err(|e| CoordinatorError::BadRequest(format!("--judge-model `{m}`: {e}")))?;
        if m.starts_with("scripted:") && !plan.models.contains_key(m) {
            return Err(CoordinatorError::BadRequest(format!(
                "--judge-model `{m}` is a scripted model the fork's spec does not configure (its script is in the spec); configured models: {}",
                crate::error::list(plan.models.keys())
            )));
        }
    }
    Ok(())
}

/// The judge of a resolve that needs one when neither the request nor the plan names
/// one (docs/SPEC.md, "Resolving"): the fork's own model if the live workers offer it
/// and it is not scripted, else the first model the workers' catalogues offer (by name).
async fn default_judge(
    handle: &CoordinatorHandle,
    plan: &ForkPlan,
    strategy: &Strategy,
) -> Result<String, CoordinatorError> {
    let offered: std::collections::BTreeSet<String> = handle
        .offered_models()
        .await?
        .into_iter()
        .filter(|m| !m.starts_with("scripted:"))
        .collect();
    if !plan.model.starts_with("scripted:") && offered.contains(&plan.model) {
        return Ok(plan.model.clone());
    }
    offered
        .into_iter()
        .next()
        .ok_or_else(|| CoordinatorError::NoJudge {
            strategy: strategy.as_str().to_string(),
        })
}

/// The branches a judge may pick: when any branch has a test signal, those with the best
/// pass ratio (tests outrank the judge's taste; a branch without a signal is then not one);
/// otherwise any branch (empty list).
fn candidates(tests: &[TestRun]) -> (Vec<String>, Option<String>) {
    let best = tests
        .iter()
        .filter_map(|t| t.signal.pass_ratio)
        .fold(None, |best: Option<f64>, r| {
            Some(best.map_or(r, |b| b.max(r)))
        });
    let Some(best) = best else {
        return (Vec::new(), None);
    };
    let chosen: Vec<String> = tests
        .iter()
        .filter(|t| t.signal.pass_ratio == Some(best))
        .map(|t| t.label.clone())
        .collect();
    if chosen.len() == tests.len() {
        return (Vec::new(), None);
    }
    let reason = format!(
        "the tests pass best ({:.0}%) on {}; the others do worse or gave no signal",
        best * 100.0,
        chosen.join(", ")
    );
    (chosen, Some(reason))
}

/// Store a branch's tree as a manifest blob where workers read (the bus's blob store).
async fn put_tree(
    bus: &dyn Bus,
    tree: &forkfleet_shared::manifest::Manifest,
) -> Result<BlobHash, String> {
    let bytes = tree.to_blob().map_err(|e| e.to_string())?;
    let hash = BlobHash::of(&bytes);
    bus.blobs()
        .put(hash, bytes)
        .await
        .map_err(|e| e.to_string())?;
    Ok(hash)
}

/// Send a job to a worker, asking again when none answers in time.
async fn ask(
    bus: &dyn Bus,
    job: &ResolveJob,
    timeout: Duration,
) -> Result<ResolveJobReply, String> {
    let payload = wire::encode(job).map_err(|e| format!("cannot encode the job: {e}"))?;
    let mut last = String::new();
    for attempt in 1..=JOB_TRIES {
        match bus.request(RESOLVE_SUBJECT, payload.clone(), timeout).await {
            Ok(bytes) => {
                return wire::decode::<ResolveJobReply>(&bytes)
                    .map_err(|e| format!("a worker's reply is malformed: {e}"))
            }
            Err(e @ (BusError::Timeout { .. } | BusError::NoResponders(_))) => {
                tracing::warn!(attempt, error = %e, "fork.resolve: no worker answered a job");
                last = match e {
                    BusError::NoResponders(_) => {
                        "no worker serves resolve jobs (start a `forkfleet worker`)".to_string()
                    }
                    other => other.to_string(),
                };
                if attempt < JOB_TRIES {
                    tokio::time::sleep(JOB_RETRY_PAUSE).await;
                }
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Err(format!("{last} (tried {JOB_TRIES} times)"))
}

fn unexpected(reply: &ResolveJobReply) -> String {
    match reply {
        ResolveJobReply::Failed { error } => error.clone(),
        _ => "a worker answered with the wrong kind of result".to_string(),
    }
}

/// A test no worker ran: no signal.
fn no_signal(label: &str, error: String) -> TestRun {
    TestRun::not_run(label, "", 0, error)
}

fn failed_judge(model: &str, error: String) -> JudgeRun {
    JudgeRun {
        model: model.to_string(),
        verdict: None,
        error: Some(error),
        calls: 0,
        refused: Vec::new(),
        usage: Usage::default(),
        cost_usd: 0.0,
    }
}

/// What a branch's log says for the judge and the confidence.
struct LogSummary {
    final_message: Option<String>,
    /// Tool calls that failed (the model had to try again).
    retries: u32,
    /// Model responses repeating the previous one's tool calls exactly.
    stuck: u32,
}

impl LogSummary {
    fn of<'a>(events: impl IntoIterator<Item = &'a (u64, Event)>) -> Self {
        let mut s = LogSummary {
            final_message: None,
            retries: 0,
            stuck: 0,
        };
        let mut previous: Option<&Vec<forkfleet_shared::event::ToolCall>> = None;
        for (_, e) in events {
            match e {
                Event::ModelResponse {
                    text, tool_calls, ..
                } => {
                    if let Some(t) = text.as_ref().filter(|t| !t.trim().is_empty()) {
                        s.final_message = Some(t.clone());
                    }
                    if !tool_calls.is_empty() && previous.is_some_and(|p| same_calls(p, tool_calls))
                    {
                        s.stuck += 1;
                    }
                    previous = Some(tool_calls);
                }
                Event::ToolResult { ok: false, .. } => s.retries += 1,
                _ => {}
            }
        }
        s
    }

    fn consistency(&self, record: &BranchRecord) -> f64 {
        internal_consistency(self.retries, self.stuck, record.turns)
    }
}

/// Same tools with the same arguments (call ids differ from call to call).
fn same_calls(
    a: &[forkfleet_shared::event::ToolCall],
    b: &[forkfleet_shared::event::ToolCall],
) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.name == y.name && x.args == y.args)
}

/// A judge's price: the fork's plan's for its model, else the built-in table's (a judge
/// named by `--judge-model` need not be in the spec); `None` when neither has one.
fn judge_price(
    models: &std::collections::BTreeMap<String, forkfleet_shared::spec::ModelPlan>,
    model: &str,
) -> Option<forkfleet_shared::pricing::Price> {
    models
        .get(model)
        .and_then(|m| m.price)
        .or_else(|| forkfleet_shared::pricing::builtin_price(model))
}

/// Every branch's log summary, read on a blocking thread.
async fn branch_logs(
    handle: &CoordinatorHandle,
    branches: &[(BranchRecord, forkfleet_shared::overlay::Overlay)],
) -> Result<Vec<LogSummary>, CoordinatorError> {
    let store = handle.store().clone();
    let runs: Vec<_> = branches
        .iter()
        .map(|(r, _)| (r.run_id, r.first_seq))
        .collect();
    tokio::task::spawn_blocking(move || {
        runs.into_iter()
            .map(|(run, first_seq)| {
                // A rewound branch's history: the events it keeps; its own, not the
                // parent's answers its copied prefix holds.
                store.run_log(run).map(|log| {
                    LogSummary::of(
                        forkfleet_shared::event::history_events(&log, None)
                            .into_iter()
                            .filter(|(seq, _)| *seq >= first_seq),
                    )
                })
            })
            .collect()
    })
    .await?
}

/// The diff report as the judge reads it: the summary table, then each path's unified
/// diffs by branch (the prompt is cut to its limit later).
fn diff_text(report: &DiffReport) -> String {
    let mut out = render_summary(report);
    for p in &report.paths {
        let _ = writeln!(out, "\n### {} ({})", p.path, p.agreement.as_str());
        for c in &p.changes {
            let _ = writeln!(
                out,
                "-- branch `{}`: {}",
                report.label(c.branch),
                c.operation.as_str()
            );
            if let Some(d) = &c.diff {
                out.push_str(d);
                if !d.ends_with('\n') {
                    out.push('\n');
                }
            }
        }
    }
    out
}

/// `runs fork --summarize=model` (docs/LINEAGE.md): the child's branch summary written by
/// the parent run's model, on a worker (as a judge's call is). Its cost is the summary's
/// own, never part of a fork's spend; a model that fails or writes nothing is an error and
/// nothing is written.
pub(crate) async fn model_summary(
    h: &CoordinatorHandle,
    req: &crate::lineage::ForkRunRequest,
    child: &crate::lineage::ChildPlan,
) -> Result<String, CoordinatorError> {
    use forkfleet_shared::protocol::SummaryJob;
    let settings = &child.outcome.settings;
    let model_plan = child.plan_model(&settings.model);
    let job = ResolveJob::Summary(SummaryJob {
        run_id: req.parent,
        fork_id: child.parent_fork(),
        model: settings.model.clone(),
        price: model_plan.and_then(|m| m.price),
        script: model_plan.and_then(|m| m.script),
        endpoint: model_plan.and_then(|m| m.endpoint.clone()),
        prompt: forkfleet_shared::lineage::summary_prompt(&child.summary_source),
        max_output_tokens: settings.max_output_tokens,
        trace: forkfleet_shared::trace::current_traceparent(),
    });
    let failed = |why: String| {
        CoordinatorError::BadRequest(format!(
            "--summarize=model: model `{}` wrote no summary: {why}; use --summarize (deterministic) instead",
            settings.model
        ))
    };
    match ask(h.bus().as_ref(), &job, JUDGE_JOB_TIMEOUT).await {
        Ok(ResolveJobReply::Summary(run)) => {
            tracing::info!(run.id = %req.parent, model = %run.model, cost_usd = run.cost_usd, "runs.fork: model summary written");
            match (run.text, run.error) {
                (Some(text), _) if !text.trim().is_empty() => Ok(text),
                (_, Some(error)) => Err(failed(error)),
                _ => Err(failed("an empty answer".to_string())),
            }
        }
        Ok(other) => Err(failed(unexpected(&other))),
        Err(e) => Err(failed(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkfleet_shared::testsignal::{test_signal, TestOutcome};

    /// A judge named by `--judge-model` is not in the fork's plan: it is priced from the
    /// built-in table (it cost $0), and one neither knows has no price (its cost unknown).
    #[test]
    fn a_judge_outside_the_plan_is_priced_from_the_built_in_table() {
        let none = std::collections::BTreeMap::new();
        assert_eq!(
            judge_price(&none, "openai:gpt-4o-mini"),
            forkfleet_shared::pricing::builtin_price("openai:gpt-4o-mini")
        );
        assert!(judge_price(&none, "openai:gpt-4o-mini").is_some());
        assert_eq!(judge_price(&none, "openai:house-model"), None);
    }

    fn run(label: &str, outcome: TestOutcome, output: &str) -> TestRun {
        TestRun {
            label: label.to_string(),
            signal: test_signal(&outcome, output),
            outcome,
            output_tail: String::new(),
            duration_ms: 0,
            worker: String::new(),
        }
    }

    #[test]
    fn candidates_are_the_best_tested_branches() {
        let pass = |l| run(l, TestOutcome::Exited { code: 0 }, "3 passed, 0 failed");
        let part = |l| run(l, TestOutcome::Exited { code: 1 }, "2 passed, 1 failed");
        let none = |l| run(l, TestOutcome::TimedOut, "");
        // No tests, or every branch equal: anyone.
        assert_eq!(candidates(&[]), (Vec::new(), None));
        assert_eq!(candidates(&[pass("a"), pass("b")]).0, Vec::<String>::new());
        assert_eq!(candidates(&[none("a"), none("b")]).0, Vec::<String>::new());
        // The best pass ratio wins; no signal is not a candidate once anyone has one.
        let (c, why) = candidates(&[part("a"), pass("b"), none("c"), pass("d")]);
        assert_eq!(c, vec!["b".to_string(), "d".to_string()]);
        assert!(why.unwrap().contains("100%"));
        let (c, _) = candidates(&[part("a"), none("b")]);
        assert_eq!(c, vec!["a".to_string()]);
    }

    #[test]
    fn consistency_counts_failed_tools_and_repeated_calls() {
        let call = |n: &str| forkfleet_shared::event::ToolCall {
            id: format!("c-{n}"),
            name: "read_file".into(),
            args: serde_json::json!({"path": n}),
        };
        let response = |calls: Vec<forkfleet_shared::event::ToolCall>, text: Option<&str>| {
            Event::ModelResponse {
                model: "scripted:x".into(),
                text: text.map(str::to_string),
                tool_calls: calls,
                request: None,
                finish_reason: None,
                reasoning: None,
            }
        };
        let log = vec![
            (1, response(vec![call("a")], None)),
            (
                2,
                Event::ToolResult {
                    call_id: "c-a".into(),
                    name: "read_file".into(),
                    ok: false,
                    output: "no".into(),
                    request: None,
                },
            ),
            (3, response(vec![call("a")], None)),
            (4, response(vec![call("b")], Some("done"))),
        ];
        let s = LogSummary::of(&log);
        assert_eq!((s.retries, s.stuck), (1, 1));
        assert_eq!(s.final_message.as_deref(), Some("done"));
    }
}

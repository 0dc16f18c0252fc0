//! Resolve jobs: the work a worker does for the coordinator while it resolves a fork.
//!
//! Every worker serves [`RESOLVE_SUBJECT`] (one queue group: each job reaches one worker)
//! with at most `resolve_concurrency` jobs at once; a job over the limit waits for a slot.
//!
//! - **Test** ([`TestJob`]): the branch's tree is materialised in a fresh temporary
//!   directory ([`Workdir`], as for the `run_command` tool), the command runs there without
//!   a shell, with the minimal environment (`HOME` and `TMPDIR` scratch directories beside
//!   the tree) plus the plan's variables, until it exits or its timeout kills its process
//!   group, in the sandbox of the job's settings (the plan's `[run_command]` ones, or the
//!   defaults: [`crate::runner::sandbox`]); the output becomes a
//!   [`TestSignal`](forkfleet_shared::testsignal::TestSignal). The directory is removed
//!   afterwards, whatever happened.
//! - **Judge** ([`JudgeJob`]): one call to the judge model with the bounded prompt; the
//!   answer is parsed and validated against the fork's labels and, when the tests narrowed
//!   them, the candidates (the branches with the best pass ratio). An answer that is not a
//!   valid verdict (an unknown winner, a branch outside the candidates, a malformed answer)
//!   is retried once, with the error and the valid labels, then reported as an error. The judge's usage and cost are in the
//!   reply, for the coordinator to keep apart from the branches' spend.
//!
//! A job the worker stops serving midway (shutdown) drops its future: the test command's
//! process group is killed, the model call abandoned; the coordinator asks again.

use crate::context::WorkerCtx;
use crate::genai::{error_type, ChatSpan};
use crate::provider::ModelRequest;
use crate::runner::{CommandOutcome, CommandSpec, SandboxSpec, TreeKey};
use forkfleet_bus::Request;
use forkfleet_shared::event::{Message, Usage};
use forkfleet_shared::manifest::Manifest;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::{
    JudgeJob, JudgeRun, ResolveJob, ResolveJobReply, SummaryJob, SummaryRun, TestJob, TestRun,
    RESOLVE_SUBJECT,
};
use forkfleet_shared::resolve::{parse_verdict, JudgeVerdict};
use forkfleet_shared::testsignal::{test_signal, TestOutcome};
use forkfleet_shared::wire;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tracing::Instrument;

/// Output of a test command kept for the signal (head and tail).
const TEST_OUTPUT_BYTES: usize = 256 * 1024;
/// The end of a test's output sent back for people.
const OUTPUT_TAIL_CHARS: usize = 4_000;
/// Longest one judge call may take.
const JUDGE_CALL_TIMEOUT: Duration = Duration::from_secs(300);

const JUDGE_SYSTEM: &str = "You are a careful code reviewer acting as the judge of a fork. \
Answer with one JSON object only: {\"winner\": \"<label>\", \"confidence\": <0..1>, \
\"reasoning\": \"...\", \"notes\": {\"<label>\": \"...\"}}.";

/// Serve resolve jobs until the bus closes the subscription or the task is aborted.
pub(crate) async fn serve(ctx: Arc<WorkerCtx>, concurrency: usize) {
    let mut requests = match ctx.bus.serve(RESOLVE_SUBJECT).await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "worker.resolve: cannot serve resolve jobs");
            return;
        }
    };
    let slots = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut running = tokio::task::JoinSet::new();
    while let Some(req) = requests.recv().await {
        // Reap finished jobs so the set does not grow.
        while running.try_join_next().is_some() {}
        let ctx = ctx.clone();
        let slots = slots.clone();
        running.spawn(async move {
            let Ok(_slot) = slots.acquire_owned().await else {
                return;
            };
            answer(&ctx, req).await;
        });
    }
    // Dropping the set aborts the jobs still running (their commands are killed).
}

async fn answer(ctx: &WorkerCtx, req: Request) {
    let reply = match wire::decode::<ResolveJob>(&req.payload) {
        Ok(ResolveJob::Test(job)) => ResolveJobReply::Test(run_test(ctx, job).await),
        Ok(ResolveJob::Judge(job)) => ResolveJobReply::Judge(run_judge(ctx, &job).await),
        Ok(ResolveJob::Summary(job)) => ResolveJobReply::Summary(run_summary(ctx, &job).await),
        Err(e) => {
            // The decoder's message may quote the payload: cut it short.
            let error = forkfleet_shared::api::limits::truncated_to(&e.to_string(), 300);
            tracing::warn!(
                bytes_in = req.payload.len(),
                error = %error,
                "worker.resolve: malformed job rejected"
            );
            ResolveJobReply::Failed {
                error: format!("malformed resolve job: {error}"),
            }
        }
    };
    let bytes = match wire::encode(&reply) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "worker.resolve: cannot encode a reply");
            return;
        }
    };
    if let Err(e) = req.respond(bytes).await {
        tracing::warn!(error = %e, "worker.resolve: cannot send a reply");
    }
}

/// Run a test job; every failure of the worker's own (a blob missing, no temporary
/// directory) is a `SpawnFailed` outcome: no signal, never a pass.
pub(crate) async fn run_test(ctx: &WorkerCtx, job: TestJob) -> TestRun {
    let span =
        tracing::info_span!("resolve.test", fork.id = %job.fork_id, branch.label = %job.label);
    // A child of the coordinator's `fork.resolve`, whose context the job carries.
    forkfleet_shared::trace::set_parent(&span, job.trace.as_deref());
    test_in_span(ctx, job).instrument(span).await
}

async fn test_in_span(ctx: &WorkerCtx, job: TestJob) -> TestRun {
    let worker = ctx.worker_id.to_string();
    let started = std::time::Instant::now();
    let failed = |error: String| failed_test(&job.label, &worker, started, error);
    let tree = match ctx.blobs.get(&job.tree).await {
        Ok(bytes) => match Manifest::from_blob(&bytes) {
            Ok(m) => m,
            Err(e) => return failed(format!("the branch's tree is not a manifest: {e}")),
        },
        Err(e) => return failed(format!("cannot read the branch's tree: {e}")),
    };
    let prefix = format!("forkfleet-test-{}-", job.fork_id);
    // The branch's command tree, when it ran here and the tree is still kept: brought up to
    // date with the paths that differ, not written whole.
    let key = TreeKey {
        fork: job.fork_id,
        label: job.label.clone(),
    };
    let work = match ctx
        .trees
        .checkout(
            &key,
            &prefix,
            tree,
            None,
            ctx.blobs.as_ref(),
            crate::runner::sandbox::confines(&job.sandbox),
        )
        .await
    {
        Ok((w, checkout)) => {
            tracing::debug!(?checkout, "resolve.test tree ready");
            w
        }
        Err(e) if e.is_materialize() => {
            return failed(format!("cannot materialise the branch's tree: {e}"))
        }
        Err(e) => return failed(e.to_string()),
    };
    let spec = CommandSpec {
        argv: job.argv.clone(),
        env: job.env.clone(),
        timeout: Duration::from_millis(job.timeout_ms.max(1)),
        max_output_bytes: TEST_OUTPUT_BYTES,
        sandbox: SandboxSpec {
            settings: job.sandbox.clone(),
            writable: Vec::new(),
            exec: Vec::new(),
            layers: None,
        },
    };
    let run = work
        .run(&WsPath::root(), &spec, std::future::pending())
        .await;
    work.remove().await;
    let outcome = match run.outcome {
        CommandOutcome::Exited { code } => TestOutcome::Exited { code },
        CommandOutcome::Signalled { .. } => TestOutcome::Signalled,
        CommandOutcome::TimedOut => TestOutcome::TimedOut,
        CommandOutcome::Cancelled => TestOutcome::SpawnFailed {
            error: "cancelled".into(),
        },
        CommandOutcome::SpawnFailed { error } => TestOutcome::SpawnFailed { error },
    };
    let signal = test_signal(&outcome, &run.output);
    tracing::info!(outcome = ?outcome, reason = %signal.reason, duration_ms = run.duration.as_millis() as u64, "resolve.test done");
    TestRun {
        label: job.label,
        outcome,
        signal,
        output_tail: tail_chars(&run.output, OUTPUT_TAIL_CHARS),
        duration_ms: run.duration.as_millis() as u64,
        worker,
    }
}

/// A test that could not run: no signal.
fn failed_test(label: &str, worker: &str, started: std::time::Instant, error: String) -> TestRun {
    TestRun::not_run(label, worker, started.elapsed().as_millis() as u64, error)
}

/// A valid verdict must also name a candidate, when the job restricts them.
fn check_candidate(verdict: JudgeVerdict, job: &JudgeJob) -> Result<JudgeVerdict, String> {
    if job.candidates.is_empty() || job.candidates.contains(&verdict.winner) {
        return Ok(verdict);
    }
    Err(format!(
        "the judge picked {:?}, which is not among the branches it may pick ({}){}",
        verdict.winner,
        job.candidates
            .iter()
            .map(|c| format!("{c:?}"))
            .collect::<Vec<_>>()
            .join(", "),
        job.candidates_reason
            .as_deref()
            .map(|r| format!(": {r}"))
            .unwrap_or_default()
    ))
}

/// What the judge is told after an answer that was not a valid verdict.
fn retry_prompt(error: &str, labels: &[String]) -> String {
    let mut valid = String::new();
    for (i, l) in labels.iter().enumerate() {
        if i > 0 {
            valid.push_str(", ");
        }
        valid.push_str(&format!("{l:?}"));
    }
    format!(
        "{error}. Answer again with one JSON object whose \"winner\" is exactly one of: {valid}."
    )
}

/// The last `n` characters of `text` (whole characters), marked when cut.
fn tail_chars(text: &str, n: usize) -> String {
    let count = text.chars().count();
    if count <= n {
        return text.to_string();
    }
    let start = text.char_indices().nth(count - n).map_or(0, |(i, _)| i);
    format!(
        "[... {} characters before ...]\n{}",
        count - n,
        &text[start..]
    )
}

/// Ask the judge; retry once when the answer is not a valid verdict.
/// One call of a resolve-side model (a judge, a summary) under its `chat` span, bounded by
/// [`JUDGE_CALL_TIMEOUT`]: the reply and its cost, or why it failed (`who`: "judge", "model").
async fn call_once(
    provider: &dyn crate::provider::ModelProvider,
    req: &ModelRequest<'_>,
    span: (
        forkfleet_shared::ids::ForkId,
        Option<forkfleet_shared::ids::RunId>,
    ),
    price: Option<&forkfleet_shared::pricing::Price>,
    who: &str,
) -> Result<(crate::provider::ModelReply, Option<f64>), String> {
    let chat = ChatSpan::new(req, span.0, span.1, provider.server_address());
    let call = provider.complete(req).instrument(chat.span().clone());
    match tokio::time::timeout(JUDGE_CALL_TIMEOUT, call).await {
        Ok(Ok(reply)) => {
            let cost = price.map(|p| p.cost(&reply.usage));
            chat.replied(&reply, cost);
            Ok((reply, cost))
        }
        Ok(Err(e)) => {
            chat.failed(&error_type(&e));
            Err(format!("{who} `{}` failed: {e}", req.model))
        }
        Err(_) => {
            chat.failed("timeout");
            Err(format!(
                "{who} `{}` did not answer within {} s",
                req.model,
                JUDGE_CALL_TIMEOUT.as_secs()
            ))
        }
    }
}

/// What a summary model is told (`runs fork --summarize=model`, docs/LINEAGE.md).
const SUMMARY_SYSTEM: &str = "You write the branch summary of an agent run: a short, factual operational summary for whoever continues the run. Plain text, no preamble.";

/// One call of the run's model writing a child's branch summary.
pub(crate) async fn run_summary(ctx: &WorkerCtx, job: &SummaryJob) -> SummaryRun {
    let span = tracing::info_span!("runs.summary", run.id = %job.run_id, gen_ai.request.model = %job.model);
    forkfleet_shared::trace::set_parent(&span, job.trace.as_deref());
    async {
        let mut run = SummaryRun {
            model: job.model.clone(),
            text: None,
            error: None,
            usage: Usage::default(),
            cost_usd: 0.0,
        };
        let provider = match ctx
            .providers
            .provider(&job.model, job.script, job.endpoint.as_ref())
            .await
        {
            Ok(p) => p,
            Err(e) => {
                run.error = Some(format!("model `{}`: {e}", job.model));
                return run;
            }
        };
        let messages = vec![
            Message::System {
                text: SUMMARY_SYSTEM.to_string(),
            },
            Message::User {
                text: job.prompt.clone(),
            },
        ];
        let req = ModelRequest {
            label: "summary",
            ..ModelRequest::new(&job.model, &messages, &[], job.max_output_tokens)
        };
        // A root run has no fork: its spans carry the nil id.
        let fork_id = job
            .fork_id
            .unwrap_or(forkfleet_shared::ids::ForkId::from_bytes([0; 16]));
        let span = (fork_id, Some(job.run_id));
        match call_once(provider.as_ref(), &req, span, job.price.as_ref(), "model").await {
            Ok((reply, cost)) => {
                run.usage = reply.usage;
                run.cost_usd = cost.unwrap_or(0.0);
                run.text = reply.text.filter(|t| !t.trim().is_empty());
                if run.text.is_none() {
                    run.error = Some("the model answered without text".to_string());
                }
            }
            Err(e) => run.error = Some(e),
        }
        run
    }
    .instrument(span)
    .await
}

pub(crate) async fn run_judge(ctx: &WorkerCtx, job: &JudgeJob) -> JudgeRun {
    let span =
        tracing::info_span!("resolve.judge", fork.id = %job.fork_id, judge.model = %job.model);
    // A child of the coordinator's `fork.resolve`, whose context the job carries.
    forkfleet_shared::trace::set_parent(&span, job.trace.as_deref());
    judge_in_span(ctx, job).instrument(span).await
}

async fn judge_in_span(ctx: &WorkerCtx, job: &JudgeJob) -> JudgeRun {
    let mut run = JudgeRun {
        model: job.model.clone(),
        verdict: None,
        error: None,
        calls: 0,
        refused: Vec::new(),
        usage: Usage::default(),
        cost_usd: 0.0,
    };
    let provider = match ctx
        .providers
        .provider(&job.model, job.script, job.endpoint.as_ref())
        .await
    {
        Ok(p) => p,
        Err(e) => {
            run.error = Some(format!("judge `{}`: {e}", job.model));
            return run;
        }
    };
    let mut messages = vec![
        Message::System {
            text: JUDGE_SYSTEM.to_string(),
        },
        Message::User {
            text: job.prompt.clone(),
        },
    ];
    for turn in 0..2u32 {
        let req = ModelRequest {
            label: "judge",
            turn,
            ..ModelRequest::new(&job.model, &messages, &[], job.max_output_tokens)
        };
        run.calls += 1;
        let span = (job.fork_id, None);
        let (reply, cost) =
            match call_once(provider.as_ref(), &req, span, job.price.as_ref(), "judge").await {
                Ok(answer) => answer,
                Err(e) => {
                    run.error = Some(e);
                    return run;
                }
            };
        run.usage.add(&reply.usage);
        run.cost_usd += cost.unwrap_or(0.0);
        let text = reply.text.unwrap_or_default();
        let parsed = {
            let labels: Vec<&str> = job.labels.iter().map(String::as_str).collect();
            parse_verdict(&text, &labels)
        }
        .map_err(|e| e.to_string())
        .and_then(|v| check_candidate(v, job));
        match parsed {
            Ok(verdict) => {
                run.verdict = Some(verdict);
                run.error = None;
                return run;
            }
            Err(e) => {
                tracing::info!(turn, error = %e, "resolve.judge answer refused");
                run.error = Some(format!("judge `{}`: {e}", job.model));
                run.refused.push(e.clone());
                messages.push(Message::Assistant {
                    text: Some(text),
                    tool_calls: Vec::new(),
                    reasoning: None,
                });
                let valid = if job.candidates.is_empty() {
                    &job.labels
                } else {
                    &job.candidates
                };
                messages.push(Message::User {
                    text: retry_prompt(&e, valid),
                });
            }
        }
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_whole_characters() {
        assert_eq!(tail_chars("abc", 5), "abc");
        let t = tail_chars("ééééé", 2);
        assert!(t.ends_with("éé"), "{t}");
        assert!(t.contains("3 characters before"), "{t}");
    }
}

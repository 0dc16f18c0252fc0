//! Trace context: a branch's `branch.run` span is a child of the span its task was enqueued
//! in (the coordinator's `fork.create`), through the bus, with the OpenTelemetry SDK as the
//! binary installs it; the spans are read back from the SDK as they end. The GenAI spans
//! under it (`invoke_agent`, `chat`, `execute_tool`) and their attributes; resolve jobs
//! under the context they carry.

use super::common::*;
use forkfleet_bus::testkit::SpanCollector;
use forkfleet_shared::event::Event;
use forkfleet_shared::ids::RunId;
use forkfleet_shared::pricing::Price;
use forkfleet_shared::protocol::{JudgeJob, ResolveJob, ResolveJobReply, TestJob};
use forkfleet_shared::trace::{span_context_of, traceparent_of};
use opentelemetry::Value;
use opentelemetry_sdk::trace::SpanData;
use tracing::Instrument;

const ANSWER: &str = r#"
[[turns."*"]]
text = "done"
"#;

/// Every span the SDK ends (the test kit's collector, with this suite's lookups).
#[derive(Debug, Clone, Default)]
struct Collector(SpanCollector);

impl Collector {
    /// The first ended span `pick` accepts, waiting for it at most [`WAIT`].
    async fn wait_for(&self, what: &str, pick: impl Fn(&SpanData) -> bool) -> SpanData {
        let found = self
            .0
            .wait_until(|spans| spans.iter().find(|s| pick(s)).cloned());
        tokio::time::timeout(WAIT, found)
            .await
            .unwrap_or_else(|_| panic!("the {what} span did not end in time"))
    }

    /// The ended `branch.run` span of `run`, waiting for it at most [`WAIT`].
    async fn branch_run(&self, run: &str) -> SpanData {
        self.wait_for("branch.run", |s| {
            s.name.starts_with("invoke_agent ") && attribute(s, "branch.id") == Some(run)
        })
        .await
    }

    fn ended(&self, name: &str) -> Vec<SpanData> {
        let spans = self.0.all();
        spans.into_iter().filter(|s| s.name == name).collect()
    }

    /// Every ended span.
    fn all(&self) -> Vec<SpanData> {
        self.0.all()
    }

    /// The ended spans whose parent is `parent`.
    fn children(&self, parent: &SpanData) -> Vec<SpanData> {
        let id = parent.span_context.span_id();
        self.all()
            .into_iter()
            .filter(|s| s.parent_span_id == id)
            .collect()
    }
}

/// A subscriber with the OpenTelemetry layer over an SDK provider whose spans `collector`
/// keeps (without an exporter).
fn traced(collector: &Collector) -> impl tracing::Subscriber + Send + Sync {
    collector.0.subscriber("worker-test")
}

/// A span attribute's value.
fn value<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

fn int(span: &SpanData, key: &str) -> Option<i64> {
    match value(span, key) {
        Some(Value::I64(v)) => Some(*v),
        _ => None,
    }
}

fn float(span: &SpanData, key: &str) -> Option<f64> {
    match value(span, key) {
        Some(Value::F64(v)) => Some(*v),
        _ => None,
    }
}

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a str> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .and_then(|kv| match &kv.value {
            Value::String(s) => Some(s.as_str()),
            _ => None,
        })
}

#[tokio::test]
async fn a_branch_span_is_a_child_of_the_span_that_enqueued_its_task() {
    let collector = Collector::default();
    // This thread's tasks (the test, the node, its agents: a current-thread runtime).
    let _default = tracing::subscriber::set_default(traced(&collector));

    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(ANSWER);
    let traced = fx.task("traced", 0, snap, script);
    let untraced = fx.task("untraced", 1, snap, script);

    let fork = tracing::info_span!("fork.create");
    let fork_sc = span_context_of(&traceparent_of(&fork).unwrap()).unwrap();
    fx.enqueue(&traced).instrument(fork.clone()).await;
    fx.enqueue(&untraced).await;

    let mut events = fx.events().await;
    let worker = start(&fx, config(2)).await;
    events
        .until_terminal(&[traced.run_id, untraced.run_id])
        .await;
    shutdown(worker).await;

    // The traced branch hangs under the fork's span, across the bus.
    let run = collector.branch_run(&traced.run_id.to_string()).await;
    assert_eq!(run.span_context.trace_id(), fork_sc.trace_id());
    assert_eq!(run.parent_span_id, fork_sc.span_id());
    assert!(run.parent_span_is_remote);
    assert!(run.span_context.is_sampled());
    // Its turns are in the same trace, under it.
    let turns: Vec<SpanData> = collector
        .ended("branch.turn")
        .into_iter()
        .filter(|t| t.parent_span_id == run.span_context.span_id())
        .collect();
    assert!(!turns.is_empty(), "no branch.turn span under branch.run");
    for t in &turns {
        assert_eq!(t.span_context.trace_id(), fork_sc.trace_id());
    }

    // A task enqueued outside any span carries no context: its branch keeps the parent it
    // would have had (the span of the actor's start), nothing remote.
    let lone = collector.branch_run(&untraced.run_id.to_string()).await;
    assert_ne!(lone.span_context.trace_id(), fork_sc.trace_id());
    assert!(!lone.parent_span_is_remote);
}

/// Two turns: a tool call, then an answer; the branch `fails` has only the first, so its
/// second call fails.
const GENAI: &str = r#"
[[turns."*"]]
tool_calls = [{ name = "write_file", args = { path = "notes/{label}.md", content = "hi\n" } }]
usage = { input_tokens = 120, output_tokens = 30 }

[[turns."*"]]
text = "done"
usage = { input_tokens = 200, output_tokens = 10 }

[[turns.fails]]
tool_calls = [{ name = "read_file", args = { path = "no/such/file.md" } }]
usage = { input_tokens = 120, output_tokens = 30 }
"#;

/// Text of the branch's prompt (its prefix and tail): never in a span unless captured.
const PROMPT_TEXTS: [&str; 3] = ["Write the notes.", "careful engineer", "Take approach"];

/// Whether any attribute of `span` holds prompt text.
fn holds_prompt_text(span: &SpanData) -> bool {
    span.attributes.iter().any(|kv| {
        let text = kv.value.as_str();
        PROMPT_TEXTS.iter().any(|p| text.contains(p))
    })
}

/// The spans of one branch run: its `invoke_agent` span, its turns and the spans under them.
struct BranchSpans {
    run: SpanData,
    turns: Vec<SpanData>,
    /// `chat {model}` spans, in call order (by start time).
    chats: Vec<SpanData>,
    tools: Vec<SpanData>,
}

async fn branch_spans(collector: &Collector, run_id: RunId) -> BranchSpans {
    let run = collector.branch_run(&run_id.to_string()).await;
    let turns = collector.children(&run);
    let mut chats = Vec::new();
    let mut tools = Vec::new();
    for turn in &turns {
        assert_eq!(turn.name, "branch.turn");
        for child in collector.children(turn) {
            if child.name.starts_with("chat ") {
                chats.push(child);
            } else if child.name.starts_with("execute_tool ") {
                tools.push(child);
            }
        }
    }
    chats.sort_by_key(|c| c.start_time);
    BranchSpans {
        run,
        turns,
        chats,
        tools,
    }
}

#[tokio::test]
async fn branch_spans_follow_the_genai_conventions_and_capture_text_only_when_enabled() {
    let collector = Collector::default();
    let _default = tracing::subscriber::set_default(traced(&collector));
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[]);
    let script = fx.script(GENAI);
    let price = Price {
        input_per_mtok: 1.0,
        output_per_mtok: 2.0,
        cached_per_mtok: None,
        cache_write_per_mtok: None,
    };
    let mut plain = fx.task("plain", 0, snap, script);
    plain.price = Some(price);
    let fails = fx.task("fails", 1, snap, script);
    let captured = fx.task("captured", 2, snap, script);

    let fork = tracing::info_span!("fork.create");
    let fork_sc = span_context_of(&traceparent_of(&fork).unwrap()).unwrap();
    fx.enqueue(&plain).instrument(fork.clone()).await;
    fx.enqueue(&fails).instrument(fork.clone()).await;
    let mut events = fx.events().await;
    let worker = start(&fx, config(2)).await;
    events.until_terminal(&[plain.run_id, fails.run_id]).await;

    // The branch run: `invoke_agent {label}` under the fork's span, across the bus.
    let spans = branch_spans(&collector, plain.run_id).await;
    let run = &spans.run;
    assert_eq!(run.name, "invoke_agent plain");
    assert_eq!(run.span_context.trace_id(), fork_sc.trace_id());
    assert_eq!(run.parent_span_id, fork_sc.span_id());
    let fork_id = plain.fork_id.to_string();
    let run_id = plain.run_id.to_string();
    assert_eq!(
        attribute(run, "gen_ai.operation.name"),
        Some("invoke_agent")
    );
    assert_eq!(attribute(run, "gen_ai.agent.name"), Some("plain"));
    assert_eq!(attribute(run, "branch.label"), Some("plain"));
    assert_eq!(attribute(run, "branch.id"), Some(run_id.as_str()));
    // (120 + 2 * 30 + 200 + 2 * 10) tokens at a dollar a million.
    let cost = float(run, "forkfleet.cost_usd").expect("the run's cost");
    assert!((cost - 400e-6).abs() < 1e-12, "{cost}");

    // Two turns, each with its model call; the first with its tool call.
    assert_eq!(spans.turns.len(), 2, "{:?}", spans.turns);
    assert_eq!(spans.chats.len(), 2);
    for (chat, (input, output, finish)) in spans
        .chats
        .iter()
        .zip([(120, 30, "tool_calls"), (200, 10, "stop")])
    {
        assert_eq!(chat.name, "chat test");
        assert_eq!(chat.span_kind, opentelemetry::trace::SpanKind::Client);
        assert_eq!(attribute(chat, "gen_ai.operation.name"), Some("chat"));
        assert_eq!(
            attribute(chat, "gen_ai.provider.name"),
            Some("forkfleet.scripted")
        );
        assert_eq!(attribute(chat, "gen_ai.request.model"), Some("test"));
        assert_eq!(attribute(chat, "gen_ai.response.model"), Some("test"));
        assert_eq!(int(chat, "gen_ai.request.max_tokens"), Some(1000));
        assert_eq!(int(chat, "gen_ai.usage.input_tokens"), Some(input));
        assert_eq!(int(chat, "gen_ai.usage.output_tokens"), Some(output));
        assert_eq!(
            value(chat, "gen_ai.response.finish_reasons"),
            Some(&Value::Array(
                vec![opentelemetry::StringValue::from(finish)].into()
            ))
        );
        let call_cost = (input + 2 * output) as f64 * 1e-6;
        assert!((float(chat, "forkfleet.cost_usd").unwrap() - call_cost).abs() < 1e-12);
        assert_eq!(attribute(chat, "branch.id"), Some(run_id.as_str()));
        assert_eq!(value(chat, "error.type"), None);
    }
    let [tool] = spans.tools.as_slice() else {
        panic!("expected one tool span, got {:?}", spans.tools);
    };
    assert_eq!(tool.name, "execute_tool write_file");
    assert_eq!(tool.parent_span_id, spans.chats[0].parent_span_id);
    assert_eq!(
        attribute(tool, "gen_ai.operation.name"),
        Some("execute_tool")
    );
    assert_eq!(attribute(tool, "gen_ai.tool.name"), Some("write_file"));
    let call_id = events
        .of(plain.run_id)
        .into_iter()
        .find_map(|e| match e {
            Event::ModelResponse { tool_calls, .. } if !tool_calls.is_empty() => {
                Some(tool_calls[0].id.clone())
            }
            _ => None,
        })
        .expect("the tool call's response");
    assert_eq!(
        attribute(tool, "gen_ai.tool.call.id"),
        Some(call_id.as_str())
    );

    // Every span of the fork's trace but the test's own carries the fork's id, and none
    // holds prompt text by default.
    let in_trace: Vec<SpanData> = collector
        .all()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == fork_sc.trace_id())
        .collect();
    assert!(in_trace.len() >= 10, "{in_trace:?}");
    for span in &in_trace {
        assert_eq!(
            attribute(span, "fork.id"),
            Some(fork_id.as_str()),
            "{span:?}"
        );
        assert!(!holds_prompt_text(span), "{span:?}");
        assert_eq!(value(span, "gen_ai.input.messages"), None);
        assert_eq!(value(span, "gen_ai.output.messages"), None);
    }

    // A failed model call: its class in error.type, the span's status an error.
    let failed = branch_spans(&collector, fails.run_id).await;
    assert_eq!(failed.chats.len(), 2);
    let last = &failed.chats[1];
    assert_eq!(attribute(last, "error.type"), Some("script"));
    assert!(
        matches!(last.status, opentelemetry::trace::Status::Error { .. }),
        "{:?}",
        last.status
    );
    assert_eq!(int(last, "gen_ai.usage.input_tokens"), None);
    assert_eq!(value(&failed.chats[0], "error.type"), None);
    // A tool call that failed (the file does not exist; the model is told): its span's
    // error.type and status say so.
    let [tool] = failed.tools.as_slice() else {
        panic!("expected one tool span, got {:?}", failed.tools);
    };
    assert_eq!(tool.name, "execute_tool read_file");
    assert_eq!(attribute(tool, "error.type"), Some("tool_error"));
    assert!(
        matches!(tool.status, opentelemetry::trace::Status::Error { .. }),
        "{:?}",
        tool.status
    );
    assert!(matches!(
        spans.tools[0].status,
        opentelemetry::trace::Status::Unset
    ));

    // With capture on, the model call spans carry the messages (as JSON), and only them.
    forkfleet_shared::trace::set_capture_message_content(true);
    fx.enqueue(&captured).instrument(fork.clone()).await;
    events.until_terminal(&[captured.run_id]).await;
    forkfleet_shared::trace::set_capture_message_content(false);
    shutdown(worker).await;
    let with_text = branch_spans(&collector, captured.run_id).await;
    assert_eq!(with_text.chats.len(), 2);
    let first = &with_text.chats[0];
    let input: serde_json::Value =
        serde_json::from_str(attribute(first, "gen_ai.input.messages").unwrap()).unwrap();
    assert_eq!(input[0]["role"], "system");
    assert_eq!(input[1]["parts"][0]["content"], "Write the notes.");
    let output: serde_json::Value =
        serde_json::from_str(attribute(first, "gen_ai.output.messages").unwrap()).unwrap();
    assert_eq!(output[0]["role"], "assistant");
    assert_eq!(output[0]["parts"][0]["type"], "tool_call");
    assert_eq!(output[0]["parts"][0]["name"], "write_file");
    assert_eq!(output[0]["finish_reason"], "tool_calls");
    let second = &with_text.chats[1];
    assert!(attribute(second, "gen_ai.output.messages")
        .unwrap()
        .contains("done"));
    let input: serde_json::Value =
        serde_json::from_str(attribute(second, "gen_ai.input.messages").unwrap()).unwrap();
    let result = &input.as_array().unwrap().last().unwrap()["parts"][0];
    assert_eq!(result["type"], "tool_call_response");
    assert_eq!(
        result["id"], output[0]["parts"][0]["id"],
        "the tool's result answers the call"
    );
    assert!(!holds_prompt_text(&with_text.run));
    for turn in &with_text.turns {
        assert!(!holds_prompt_text(turn));
    }
}

const JUDGE: &str = r#"
[[turns.judge]]
text = '{"winner": "a", "confidence": 0.9, "reasoning": "a is simpler"}'
usage = { input_tokens = 300, output_tokens = 20 }
"#;

/// The coordinator's `fork.resolve` span, as a job carries it.
const RESOLVE_PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test]
async fn resolve_job_spans_are_children_of_the_context_the_job_carries() {
    let collector = Collector::default();
    let _default = tracing::subscriber::set_default(traced(&collector));
    let fx = Fixture::new().await;
    let (_, tree) = fx.snapshot(&[("a.txt", "a\n")]);
    let script = fx.script(JUDGE);
    fx.publish_blobs().await;
    let worker = start(&fx, config(1)).await;

    let test = ResolveJob::Test(TestJob {
        fork_id: fx.fork_id,
        label: "a".into(),
        tree,
        argv: vec!["true".into()],
        timeout_ms: 10_000,
        env: Default::default(),
        sandbox: Default::default(),
        trace: Some(RESOLVE_PARENT.into()),
    });
    let judge = ResolveJob::Judge(JudgeJob {
        fork_id: fx.fork_id,
        model: "scripted:judge".into(),
        price: None,
        script: Some(script),
        prompt: "Pick a or b.".into(),
        labels: vec!["a".into(), "b".into()],
        candidates: Vec::new(),
        candidates_reason: None,
        max_output_tokens: 200,
        endpoint: None,
        trace: Some(RESOLVE_PARENT.into()),
    });
    assert!(matches!(
        ask_resolve(&fx, &test).await,
        ResolveJobReply::Test(_)
    ));
    let ResolveJobReply::Judge(verdict) = ask_resolve(&fx, &judge).await else {
        panic!("not a judge reply");
    };
    assert_eq!(verdict.error, None);
    shutdown(worker).await;

    let parent = span_context_of(RESOLVE_PARENT).unwrap();
    let fork_id = fx.fork_id.to_string();
    for name in ["resolve.test", "resolve.judge"] {
        let span = collector.wait_for(name, |s| s.name == name).await;
        assert_eq!(span.span_context.trace_id(), parent.trace_id(), "{name}");
        assert_eq!(span.parent_span_id, parent.span_id(), "{name}");
        assert!(span.parent_span_is_remote, "{name}");
        assert_eq!(attribute(&span, "fork.id"), Some(fork_id.as_str()));
    }
    // The judge's model call under its span.
    let judge_span = collector
        .wait_for("resolve.judge", |s| s.name == "resolve.judge")
        .await;
    let [chat] = collector
        .children(&judge_span)
        .try_into()
        .unwrap_or_else(|c| {
            panic!("expected one span under resolve.judge, got {c:?}");
        });
    assert_eq!(chat.name, "chat judge");
    assert_eq!(int(&chat, "gen_ai.usage.input_tokens"), Some(300));
    assert_eq!(int(&chat, "gen_ai.usage.output_tokens"), Some(20));
    assert_eq!(attribute(&chat, "fork.id"), Some(fork_id.as_str()));
    assert_eq!(value(&chat, "branch.id"), None);
}

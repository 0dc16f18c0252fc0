//! The coordinator's spans, read back from the OpenTelemetry SDK as the binary installs it:
//! `fork.create` is the child of the request that asked (the trace starts where the user
//! acted), its tasks carry its context, and `budget.reserve`, `fork.diff` and `fork.resolve` join that
//! trace; resolve jobs carry the context of `fork.resolve`.

use super::support::*;
use forkfleet_bus::testkit::SpanCollector;
use forkfleet_shared::api::{dispatch, ApiRequest, Caller, ParentRun, Resolve};
use forkfleet_shared::budget::BudgetReply;
use forkfleet_shared::diff::DiffOptions;
use forkfleet_shared::event::Event;
use forkfleet_shared::protocol::{BranchTask, ResolveJob, ResolveJobReply, RESOLVE_SUBJECT};
use forkfleet_shared::spec::TestPlan;
use forkfleet_shared::state::{BranchState, ForkState};
use forkfleet_shared::trace::{span_context_of, traceparent_of};
use forkfleet_shared::wire;
use opentelemetry::Value;
use opentelemetry_sdk::trace::SpanData;
use tracing::Instrument;

/// Every span the SDK ends (the test kit's collector, with this suite's lookups).
#[derive(Debug, Clone, Default)]
struct Collector(SpanCollector);

impl Collector {
    /// The first `n` ended spans named `name`, waiting for them (bounded).
    async fn wait_for(&self, name: &str, n: usize) -> Vec<SpanData> {
        within(self.0.wait_until(|spans| {
            let found: Vec<SpanData> = spans.iter().filter(|s| s.name == name).cloned().collect();
            (found.len() >= n).then_some(found)
        }))
        .await
    }
}

fn value<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

async fn reserve(fx: &Fixture, task: &BranchTask, usd: f64, trace: Option<String>) -> BudgetReply {
    super::budget::reserve_traced(fx, task, 1, usd, trace).await
}

#[tokio::test]
async fn a_fork_is_one_trace_under_the_request_that_created_it() {
    let collector = Collector::default();
    let subscriber = collector.0.subscriber("coordinator-test");
    // The test and the coordinator's actors run on this thread (a current-thread runtime).
    let _default = tracing::subscriber::set_default(subscriber);

    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let mut capped = plan(&["a", "b"]);
    capped.aggregate_budget_usd = Some(1.0);
    // Created in a request's span: the fork's trace is the request's.
    let request = tracing::info_span!("api.request");
    let request_sc = span_context_of(&traceparent_of(&request).unwrap()).unwrap();
    let view = fx
        .create(capped, ParentRun::New, snap)
        .instrument(request.clone())
        .await;
    drop(request);
    let fork_id = view.fork_id.to_string();

    let [create] = collector
        .wait_for("fork.create", 1)
        .await
        .try_into()
        .unwrap();
    assert_eq!(
        create.parent_span_id,
        request_sc.span_id(),
        "fork.create is the request's child"
    );
    assert_eq!(create.span_context.trace_id(), request_sc.trace_id());
    assert_eq!(
        value(&create, "fork.id"),
        Some(&Value::from(fork_id.clone()))
    );
    assert_eq!(value(&create, "fork.branches"), Some(&Value::I64(2)));

    // Every task carries the context of fork.create.
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let (task, delivery) = fx.pull().await;
        let sc = span_context_of(delivery.trace.as_deref().expect("a traceparent")).unwrap();
        assert_eq!(sc.trace_id(), create.span_context.trace_id());
        assert_eq!(sc.span_id(), create.span_context.span_id());
        delivery.ack().await.unwrap();
        fx.publish(
            task.fork_id,
            task.run_id,
            task.first_seq,
            Event::Status {
                state: BranchState::Running,
                error: None,
            },
        )
        .await;
        tasks.push((task, delivery.trace));
    }
    tasks.sort_by_key(|(t, _)| t.index);

    // A reservation decided under the context the request carries (a worker's turn; here
    // the task's own), granted or refused.
    let (a, a_trace) = &tasks[0];
    assert!(matches!(
        reserve(&fx, a, 0.4, a_trace.clone()).await,
        BudgetReply::Granted { .. }
    ));
    assert!(matches!(
        reserve(&fx, a, 5.0, a_trace.clone()).await,
        BudgetReply::Refused { .. }
    ));
    let reserves = collector.wait_for("budget.reserve", 2).await;
    let run_id = a.run_id.to_string();
    for (span, (usd, granted)) in reserves.iter().zip([(0.4, true), (5.0, false)]) {
        assert_eq!(span.span_context.trace_id(), create.span_context.trace_id());
        assert_eq!(span.parent_span_id, create.span_context.span_id());
        assert_eq!(value(span, "fork.id"), Some(&Value::from(fork_id.clone())));
        assert_eq!(value(span, "branch.id"), Some(&Value::from(run_id.clone())));
        assert_eq!(value(span, "budget.usd"), Some(&Value::F64(usd)));
        assert_eq!(value(span, "budget.granted"), Some(&Value::Bool(granted)));
    }

    // A worker's turn sends its context as the request's header (no `trace` in the
    // payload): the reservation is that turn's child.
    let turn = tracing::info_span!("branch.turn");
    forkfleet_shared::trace::set_parent(&turn, a_trace.as_deref());
    let turn_sc = span_context_of(&traceparent_of(&turn).unwrap()).unwrap();
    // (Refused: the refusal above stopped the fork; decided under the turn all the same.)
    reserve(&fx, a, 0.1, None).instrument(turn.clone()).await;
    let reserves = collector.wait_for("budget.reserve", 3).await;
    let by_header = &reserves[2];
    assert_eq!(by_header.parent_span_id, turn_sc.span_id());
    assert_eq!(
        by_header.span_context.trace_id(),
        create.span_context.trace_id()
    );

    // Later work on the fork, asked in another request's span, joins the fork's trace.
    let other = tracing::info_span!("api.request");
    within(fx.h().diff(view.fork_id, DiffOptions::default()))
        .instrument(other)
        .await
        .unwrap();
    for diff in collector.wait_for("fork.diff", 1).await {
        assert_eq!(diff.span_context.trace_id(), create.span_context.trace_id());
        assert_eq!(diff.parent_span_id, create.span_context.span_id());
        assert_eq!(value(&diff, "fork.id"), Some(&Value::from(fork_id.clone())));
        assert_eq!(value(&diff, "fork.branches"), Some(&Value::I64(2)));
    }
}

#[tokio::test]
async fn resolve_joins_the_fork_trace_and_its_jobs_carry_its_context() {
    let collector = Collector::default();
    let subscriber = collector.0.subscriber("coordinator-test");
    let _default = tracing::subscriber::set_default(subscriber);

    let fx = Fixture::start().await;
    let snap = fx.upload(&[("a.txt", "1\n")]).await;
    let mut tested = plan(&["a"]);
    tested.resolve.test = Some(TestPlan {
        argv: vec!["true".into()],
        timeout_s: 5.0,
        env: Default::default(),
    });
    let view = fx.create(tested, ParentRun::New, snap).await;
    fx.fake_worker(1, |t| simple(t, "a.txt")).await;
    wait_view(&fx.h(), view.fork_id, |v| v.state == ForkState::Settled).await;
    let [create] = collector
        .wait_for("fork.create", 1)
        .await
        .try_into()
        .unwrap();

    // The test acts as the worker: it takes the job and keeps the context it carries.
    let mut jobs = within(fx.bus.serve(RESOLVE_SUBJECT)).await.unwrap();
    let serve = async {
        let req = within(jobs.recv()).await.expect("a resolve job");
        let ResolveJob::Test(job) = wire::decode::<ResolveJob>(&req.payload).unwrap() else {
            panic!("expected a test job");
        };
        let reply = ResolveJobReply::Failed {
            error: "not run by this test".into(),
        };
        req.respond(wire::encode(&reply).unwrap()).await.unwrap();
        job.trace
    };
    let request = tracing::info_span!("api.request");
    let request_sc = span_context_of(&traceparent_of(&request).unwrap()).unwrap();
    let resolve = ApiRequest::from(Resolve {
        fork: view.fork_id,
        strategy: None,
        no_commit: false,
        judge_models: Vec::new(),
    });
    let h = fx.h();
    let (job_trace, report) = tokio::join!(
        serve,
        within(dispatch(&h, &Caller::Admin, resolve)).instrument(request)
    );
    report.unwrap();

    let [resolve] = collector
        .wait_for("fork.resolve", 1)
        .await
        .try_into()
        .unwrap();
    assert_eq!(
        resolve.span_context.trace_id(),
        create.span_context.trace_id()
    );
    assert_eq!(resolve.parent_span_id, create.span_context.span_id());
    assert!(resolve
        .links
        .iter()
        .any(|l| l.span_context.span_id() == request_sc.span_id()));
    let job_sc = span_context_of(&job_trace.expect("the job carries a traceparent")).unwrap();
    assert_eq!(job_sc.trace_id(), resolve.span_context.trace_id());
    assert_eq!(job_sc.span_id(), resolve.span_context.span_id());
}

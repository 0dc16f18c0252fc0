#![allow(clippy::unwrap_used)]
//! Wire format: encoding and decoding the messages on the hot path (one branch event per
//! tool call and per model turn; one task per branch).

use criterion::{criterion_group, criterion_main, Criterion};
use forkfleet_shared::blob::BlobHash;
use forkfleet_shared::event::{Event, ToolCall, Usage};
use forkfleet_shared::ids::{ForkId, RunId};
use forkfleet_shared::manifest::FileEntry;
use forkfleet_shared::overlay::ChangeOp;
use forkfleet_shared::path::WsPath;
use forkfleet_shared::protocol::{BranchEvent, BranchTask};
use forkfleet_shared::script::Script;
use forkfleet_shared::wire::{decode, encode};
use std::hint::black_box;
use std::time::Duration;

fn events() -> Vec<BranchEvent> {
    let (fork_id, run_id) = (ForkId::new(), RunId::new());
    let content = "branch 7 line 3 of file 2\n".repeat(10);
    let kinds = vec![
        Event::ModelResponse {
            model: "scripted:bench".into(),
            text: None,
            tool_calls: vec![ToolCall {
                id: "call_3_0".into(),
                name: "write_file".into(),
                args: serde_json::json!({"path": "shared/split_2.txt", "content": content}),
            }],
            request: None,
            finish_reason: None,
            reasoning: None,
        },
        Event::Usage {
            model: "scripted:bench".into(),
            usage: Usage {
                input_tokens: 1000,
                output_tokens: 200,
                cached_tokens: 0,
                cache_write_tokens: 0,
                reasoning_tokens: 0,
            },
            cost_usd: 0.00027,
            reservation: None,
            cached: false,
        },
        Event::FileChange {
            change: ChangeOp::Write {
                path: WsPath::parse("shared/split_2.txt").unwrap(),
                entry: FileEntry::for_bytes(content.as_bytes(), 0o644),
            },
        },
        Event::ToolResult {
            call_id: "call_3_0".into(),
            name: "write_file".into(),
            ok: true,
            output: "wrote 260 bytes to shared/split_2.txt".into(),
            request: None,
        },
    ];
    kinds
        .into_iter()
        .enumerate()
        .map(|(seq, event)| BranchEvent {
            fork_id,
            run_id,
            seq: seq as u64,
            at_ms: 1_700_000_000_000,
            event,
            attempt: 1,
        })
        .collect()
}

fn task() -> BranchTask {
    BranchTask {
        approval: None,
        fork_id: ForkId::new(),
        run_id: RunId::new(),
        label: "b7".into(),
        index: 7,
        model: "scripted:bench".into(),
        price: None,
        script: Some(BlobHash::of(b"script")),
        prefix: BlobHash::of(b"prefix"),
        tail: vec![Event::Steer {
            text: "BENCH b=7 k=10 tool=write_file".into(),
        }],
        snapshot: BlobHash::of(b"snapshot"),
        first_seq: 3,
        max_turns: 15,
        max_output_tokens: 4096,
        budget_usd: None,
        reserve: false,
        on_exhausted: Default::default(),
        attempt_base: 0,
        endpoint: None,
        tools: Default::default(),
        temperature: None,
        replay: None,
        fork_root: None,
        on_truncated: Default::default(),
        event_batches: false,
    }
}

fn bench_wire(c: &mut Criterion) {
    let evs = events();
    let encoded: Vec<_> = evs.iter().map(|e| encode(e).unwrap()).collect();
    let mut g = c.benchmark_group("wire");
    g.sample_size(20).measurement_time(Duration::from_secs(2));
    g.bench_function("encode one turn of events (4)", |b| {
        b.iter(|| {
            for e in &evs {
                black_box(encode(black_box(e)).unwrap());
            }
        })
    });
    g.bench_function("decode one turn of events (4)", |b| {
        b.iter(|| {
            for bytes in &encoded {
                black_box(decode::<BranchEvent>(black_box(bytes)).unwrap());
            }
        })
    });
    let t = task();
    let tb = encode(&t).unwrap();
    g.bench_function("encode task", |b| {
        b.iter(|| black_box(encode(black_box(&t)).unwrap()))
    });
    g.bench_function("decode task", |b| {
        b.iter(|| black_box(decode::<BranchTask>(black_box(&tb)).unwrap()))
    });
    g.finish();
}

/// The scripted model's script of `forkfleet bench fanout` (1,000 branches x 10 writes):
/// parsed by every worker process at its first branch of the fork.
fn bench_script(c: &mut Criterion) {
    let script = forkfleet_bench::fanout_script(1000, 10, 10);
    let text = toml::to_string(&script).unwrap();
    let mut g = c.benchmark_group("script");
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    g.bench_function("parse the fan-out script (1,000 x 10), TOML", |b| {
        b.iter(|| black_box(Script::parse(black_box(&text)).unwrap()))
    });
    let json = serde_json::to_string(&script).unwrap();
    g.bench_function("parse the fan-out script (1,000 x 10), JSON", |b| {
        b.iter(|| black_box(Script::parse(black_box(&json)).unwrap()))
    });
    g.finish();
}

criterion_group!(benches, bench_wire, bench_script);
criterion_main!(benches);

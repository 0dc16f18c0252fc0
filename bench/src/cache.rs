//! `forkfleet bench cache`: what fork-aware prompt caching saves (issue 19).
//!
//! The work: a fork of `--branches` (10) branches, each making `--turns` (10) model calls
//! (a `write_file` call per turn, a final answer on the last), from a parent history of
//! about `--history-tokens` (20,000) tokens, on an `anthropic:` model priced like Claude
//! Sonnet 4 ($3 per million input tokens, reads $0.30, writes $3.75, output $15).
//!
//! The model is a local server speaking the Messages API (streamed, as the provider asks
//! by default) that bills a prompt cache as Anthropic does: a request's prompt is its
//! tools, its system prompt and its messages' blocks, in that order, at four characters a
//! token; every `cache_control` breakpoint at or past 1,024 tokens names a cacheable
//! prefix; a request reads the longest cached prefix ending at a breakpoint or up to 20
//! blocks before one, writes the rest up to its last breakpoint, and pays the base price
//! for what follows. An entry becomes readable when the request that wrote it is answered
//! (after `--latency-ms`), not when it arrives, so calls sent at once all miss, as they do
//! at Anthropic.
//!
//! Two rows, one fork each on the same embedded system: `cache = "auto"` (breakpoints on
//! the system prompt, the tools, the end of the shared history and the end of the
//! request, and the first call per worker warming the cache for the others) and
//! `cache = "off"`. Each reports the server's bill (fresh, read and written input tokens,
//! output tokens, their cost) and what `fork cost` tracked.

use super::peak_rss_mb;
use anyhow::Context;
use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use clap::Args;
use forkfleet_client::workspace as ws;
use forkfleet_client::{ApiClient, Client};
use forkfleet_node::embedded::{Embedded, EmbeddedOptions};
use forkfleet_shared::catalogue::{CatalogueModel, ModelCatalogue};
use forkfleet_shared::endpoint::{CacheMode, Endpoint};
use forkfleet_shared::event::Message;
use forkfleet_shared::flush::ConflictPolicy;
use forkfleet_shared::pricing::{builtin_price, Price};
use forkfleet_shared::spec::{BranchPlan, ForkPlan, Limits, ModelPlan};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The model of the bench, as the workers' catalogue offers it.
const MODEL: &str = "anthropic:claude-sonnet-4";
/// The least prefix Anthropic caches (Claude Sonnet), tokens.
const MIN_CACHEABLE: u64 = 1024;
/// How far before a breakpoint a cache hit is looked for, blocks.
const LOOKBACK: usize = 20;
/// Output tokens of every answer.
const OUTPUT_TOKENS: u64 = 100;

#[derive(Debug, Args)]
pub struct CacheArgs {
    /// Branches of the fork.
    #[arg(long, default_value_t = 10)]
    pub branches: usize,
    /// Model calls per branch.
    #[arg(long, default_value_t = 10)]
    pub turns: usize,
    /// The parent history's size, tokens (four characters each).
    #[arg(long, default_value_t = 20_000)]
    pub history_tokens: usize,
    /// In-process workers.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// The model server's time to answer, milliseconds.
    #[arg(long, default_value_t = 100)]
    pub latency_ms: u64,
    /// Give up on a row after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
    /// Print one JSON object per row.
    #[arg(long)]
    pub json: bool,
    /// Turn the workers' prompt-cache warm-up off: every branch's first call goes at once.
    #[arg(long)]
    pub no_warmup: bool,
}

/// What the server billed.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Bill {
    pub calls: u64,
    /// Input at the base price.
    pub fresh_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
    pub output_tokens: u64,
}

/// One row.
#[derive(Debug, Clone, Serialize)]
pub struct CacheRow {
    /// `auto` or `off`.
    pub cache: &'static str,
    /// The workers' first-call warm-up was on.
    pub warmup: bool,
    pub branches: usize,
    pub turns: usize,
    pub workers: usize,
    /// The shared prefix the server saw (tools, system prompt, parent history), tokens.
    pub shared_prefix_tokens: u64,
    pub bill: Bill,
    /// The bill's input at the model's price.
    pub input_cost_usd: f64,
    /// The bill's input and output.
    pub total_cost_usd: f64,
    /// What `fork cost` tracked (input and output).
    pub tracked_usd: f64,
    /// What `fork cost` says the cache saved.
    pub tracked_saved_usd: f64,
    pub states: BTreeMap<String, usize>,
    pub wall_s: f64,
}

/// The emulated API's state.
struct Emulator {
    latency: Duration,
    turns: usize,
    /// Cached prefixes (by the hash of their blocks).
    cache: Mutex<HashMap<u64, ()>>,
    bill: Mutex<Bill>,
    /// The largest count of tokens before the first branch-own block seen (the shared
    /// prefix).
    shared: Mutex<u64>,
}

/// One block of a prompt: its hash chained with those before it, its tokens so far, and
/// whether it carries a breakpoint.
struct Block {
    chain: u64,
    cumulative: u64,
    breakpoint: bool,
}

/// A block's JSON without its breakpoint, and whether it had one.
fn strip(v: &Value) -> (String, bool) {
    let mut v = v.clone();
    let marked = match &mut v {
        Value::Object(m) => m.remove("cache_control").is_some(),
        _ => false,
    };
    (v.to_string(), marked)
}

/// The prompt's blocks in cache order: tools, system, messages.
fn blocks(body: &Value) -> Vec<Block> {
    let mut raw: Vec<(String, bool)> = Vec::new();
    for t in body["tools"].as_array().into_iter().flatten() {
        raw.push(strip(t));
    }
    match &body["system"] {
        Value::String(s) => raw.push((json!({"type": "text", "text": s}).to_string(), false)),
        Value::Array(a) => raw.extend(a.iter().map(strip)),
        _ => {}
    }
    for m in body["messages"].as_array().into_iter().flatten() {
        let role = m["role"].as_str().unwrap_or("");
        match &m["content"] {
            Value::String(s) => raw.push((format!("{role}:{s}"), false)),
            Value::Array(a) => {
                for (i, b) in a.iter().enumerate() {
                    let (text, marked) = strip(b);
                    let text = if i == 0 {
                        format!("{role}:{text}")
                    } else {
                        text
                    };
                    raw.push((text, marked));
                }
            }
            _ => {}
        }
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let mut cumulative = 0u64;
    raw.into_iter()
        .map(|(text, breakpoint)| {
            text.hash(&mut hasher);
            cumulative += (text.chars().count() as u64).div_ceil(4);
            Block {
                chain: hasher.finish(),
                cumulative,
                breakpoint,
            }
        })
        .collect()
}

impl Emulator {
    /// Bill a request: (fresh, read, written) input tokens, and the prefixes it writes.
    fn bill(&self, blocks: &[Block]) -> (u64, u64, u64, Vec<u64>) {
        let total = blocks.last().map_or(0, |b| b.cumulative);
        let marks: Vec<usize> = (0..blocks.len())
            .filter(|&i| blocks[i].breakpoint && blocks[i].cumulative >= MIN_CACHEABLE)
            .collect();
        let cache = self.cache.lock().map(|c| c.clone()).unwrap_or_default();
        let read = marks
            .iter()
            .flat_map(|&k| (k.saturating_sub(LOOKBACK)..=k).rev())
            .filter(|&j| cache.contains_key(&blocks[j].chain))
            .map(|j| blocks[j].cumulative)
            .max()
            .unwrap_or(0);
        let last = marks.last().map_or(0, |&k| blocks[k].cumulative);
        let written = last.saturating_sub(read);
        let writes = marks.iter().map(|&k| blocks[k].chain).collect();
        (total - read - written, read, written, writes)
    }
}

/// The answer of turn `turn` (the calls the branch made before).
fn answer(turn: usize, last: bool) -> (Value, &'static str) {
    if last {
        (
            json!({"type": "text", "text": format!("Done after {} turns.", turn + 1)}),
            "end_turn",
        )
    } else {
        (
            json!({"type": "tool_use", "id": format!("bench_{turn}"), "name": "write_file",
                   "input": {"path": format!("notes/t{turn}.md"),
                             "content": format!("Notes of turn {turn}: the approach holds so far.\n")}}),
            "tool_use",
        )
    }
}

async fn messages(
    axum::extract::State(emu): axum::extract::State<Arc<Emulator>>,
    body: Bytes,
) -> Response {
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return (axum::http::StatusCode::BAD_REQUEST, "not JSON").into_response();
    };
    let blocks = blocks(&body);
    let (fresh, read, written, writes) = emu.bill(&blocks);
    // The shared prefix: everything before the first block of the branch's own (the
    // breakpoint at the end of the shared history), as the biggest one seen.
    if let Some(b) = blocks.iter().filter(|b| b.breakpoint).nth(2) {
        if let Ok(mut s) = emu.shared.lock() {
            *s = (*s).max(b.cumulative);
        }
    }
    let turn = body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|m| m["content"].as_array().into_iter().flatten())
        .filter(|b| {
            b["type"] == "tool_use" && b["id"].as_str().is_some_and(|i| i.starts_with("bench_"))
        })
        .count();
    tokio::time::sleep(emu.latency).await;
    // Written entries become readable once the answer goes out.
    if let Ok(mut c) = emu.cache.lock() {
        for w in writes {
            c.insert(w, ());
        }
    }
    if let Ok(mut b) = emu.bill.lock() {
        b.calls += 1;
        b.fresh_tokens += fresh;
        b.cache_read_tokens += read;
        b.cache_write_tokens += written;
        b.output_tokens += OUTPUT_TOKENS;
    }
    let (block, stop) = answer(turn, turn + 1 >= emu.turns);
    let usage = json!({"input_tokens": fresh, "cache_read_input_tokens": read,
                       "cache_creation_input_tokens": written, "output_tokens": OUTPUT_TOKENS});
    if body["stream"] != true {
        let answer = json!({"id": "msg_bench", "type": "message", "role": "assistant",
                            "model": "claude-sonnet-4-bench", "content": [block],
                            "stop_reason": stop, "usage": usage});
        return axum::Json(answer).into_response();
    }
    // Streamed: the events a Messages stream has.
    let mut start_block = block.clone();
    let delta = match block["type"].as_str() {
        Some("text") => {
            start_block["text"] = json!("");
            json!({"type": "text_delta", "text": block["text"]})
        }
        _ => {
            start_block["input"] = json!({});
            json!({"type": "input_json_delta", "partial_json": block["input"].to_string()})
        }
    };
    let mut start_usage = usage.clone();
    start_usage["output_tokens"] = json!(1);
    let events = [
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_bench", "type": "message",
                   "role": "assistant", "model": "claude-sonnet-4-bench", "content": [],
                   "stop_reason": null, "usage": start_usage}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": start_block}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": delta}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop},
                   "usage": {"output_tokens": OUTPUT_TOKENS}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ];
    let mut text = String::new();
    for (name, data) in events {
        let _ = write!(text, "event: {name}\ndata: {data}\n\n");
    }
    ([("content-type", "text/event-stream")], text).into_response()
}

/// The parent history: user and assistant turns of about 500 tokens each, `tokens` in all.
fn history(tokens: usize) -> Vec<Message> {
    let words = [
        "the", "module", "reads", "its", "config", "and", "retries", "each", "request", "with",
        "backoff", "while", "the", "cache", "keeps", "recent", "answers",
    ];
    let turn_chars = 2_000;
    let mut out = Vec::new();
    let mut i = 0usize;
    while out.len() * turn_chars / 4 < tokens {
        let mut text = format!("Turn {} of the earlier session: ", out.len());
        while text.len() < turn_chars {
            text.push_str(words[i % words.len()]);
            text.push(' ');
            i += 1;
        }
        out.push(if out.len() % 2 == 0 {
            Message::User { text }
        } else {
            Message::Assistant {
                text: Some(text),
                tool_calls: Vec::new(),
                reasoning: None,
            }
        });
    }
    out
}

fn plan(args: &CacheArgs, caching: bool, price: Price) -> ForkPlan {
    let turns = u32::try_from(args.turns).unwrap_or(u32::MAX);
    ForkPlan {
        name: None,
        approval: None,
        goal: "Write notes on how the module handles retries.".into(),
        system_prompt: Some(
            "You are a careful engineer. Work in small steps and record them in notes.".into(),
        ),
        history: history(args.history_tokens),
        model: MODEL.into(),
        limits: Limits {
            max_branches: args.branches.max(1),
            max_turns: turns + 2,
            ..Limits::default()
        },
        conflict_policy: ConflictPolicy::KeepParent,
        aggregate_budget_usd: None,
        budget: Default::default(),
        resolve: Default::default(),
        models: BTreeMap::from([(
            MODEL.to_string(),
            ModelPlan {
                price: Some(price),
                script: None,
                endpoint: (!caching).then(|| Endpoint {
                    cache: Some(CacheMode::Off),
                    ..Endpoint::default()
                }),
            },
        )]),
        branches: (0..args.branches)
            .map(|b| BranchPlan {
                approval: None,
                label: format!("b{b}"),
                steer: format!("Take approach {b}."),
                model: MODEL.into(),
                budget_usd: None,
                extra_instructions: None,
                max_turns: turns + 2,
                max_output_tokens: None,
                temperature: None,
            })
            .collect(),
        tools: Default::default(),
        solo: false,
    }
}

pub async fn cmd_cache(args: CacheArgs) -> anyhow::Result<()> {
    let price = builtin_price(MODEL).context("the bench model's built-in price")?;
    let emu = Arc::new(Emulator {
        latency: Duration::from_millis(args.latency_ms),
        turns: args.turns.max(1),
        cache: Mutex::default(),
        bill: Mutex::default(),
        shared: Mutex::default(),
    });
    let app = axum::Router::new()
        .route("/v1/messages", axum::routing::post(messages))
        .with_state(emu.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let tmp = tempfile::tempdir().context("temporary directory")?;
    let workspace = tmp.path().join("workspace");
    std::fs::create_dir_all(&workspace)?;
    std::fs::write(workspace.join("README.md"), "the module\n")?;
    let catalogue = ModelCatalogue {
        models: BTreeMap::from([(
            MODEL.to_string(),
            CatalogueModel {
                base_url: Some(format!("http://{addr}/v1")),
                ..CatalogueModel::default()
            },
        )]),
        allowed_hosts: Vec::new(),
    };
    let system = Embedded::start(
        &tmp.path().join("data"),
        EmbeddedOptions {
            workers: args.workers.max(1),
            concurrency: 64,
            requeue_unfinished: false,
            catalogue: Arc::new(catalogue),
            prompt_cache_warmup: !args.no_warmup,
        },
    )
    .await?;
    let client = system.client();
    let mut rows = Vec::new();
    for caching in [true, false] {
        let row = run_row(&client, &workspace, &args, &emu, caching, price).await;
        match row {
            Ok(row) => rows.push(row),
            Err(e) => {
                system.shutdown().await?;
                server.abort();
                return Err(e);
            }
        }
    }
    system.shutdown().await?;
    server.abort();
    print_rows(&args, &rows)?;
    tracing::info!(peak_rss_mb = peak_rss_mb(), "bench.cache done");
    Ok(())
}

async fn run_row(
    client: &Client,
    workspace: &std::path::Path,
    args: &CacheArgs,
    emu: &Emulator,
    caching: bool,
    price: Price,
) -> anyhow::Result<CacheRow> {
    if let Ok(mut b) = emu.bill.lock() {
        *b = Bill::default();
    }
    if let Ok(mut s) = emu.shared.lock() {
        *s = 0;
    }
    let (_, upload) = ws::upload_workspace(
        client.blobs().as_ref(),
        workspace,
        &forkfleet_shared::scan::ScanOptions::names_only(&[]),
        [],
    )
    .await?;
    let super::Settled { view, wall_s, .. } = super::settled_fork(
        client,
        plan(args, caching, price),
        upload.snapshot,
        workspace,
        args.timeout_s,
    )
    .await?;
    let cost = client.fork_cost(view.fork_id).await?;
    let bill = emu.bill.lock().map(|b| *b).unwrap_or_default();
    let mut states = BTreeMap::new();
    for b in &view.branches {
        *states.entry(b.state.to_string()).or_insert(0) += 1;
    }
    let per = |tokens: u64, rate: f64| tokens as f64 * rate / 1e6;
    let input_cost_usd = per(bill.fresh_tokens, price.input_per_mtok)
        + per(bill.cache_read_tokens, price.cached_rate())
        + per(bill.cache_write_tokens, price.cache_write_rate());
    Ok(CacheRow {
        cache: if caching { "auto" } else { "off" },
        warmup: !args.no_warmup,
        branches: args.branches,
        turns: args.turns,
        workers: args.workers,
        shared_prefix_tokens: emu.shared.lock().map(|s| *s).unwrap_or(0),
        bill,
        input_cost_usd,
        total_cost_usd: input_cost_usd + per(bill.output_tokens, price.output_per_mtok),
        tracked_usd: cost.spent_usd,
        tracked_saved_usd: cost.cache_saved_usd,
        states,
        wall_s,
    })
}

fn print_rows(args: &CacheArgs, rows: &[CacheRow]) -> anyhow::Result<()> {
    if args.json {
        for r in rows {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "prompt cache: {} branches x {} turns, ~{} tokens of parent history, {} workers, {} ms per answer, warm-up {}",
        args.branches,
        args.turns,
        args.history_tokens,
        args.workers,
        args.latency_ms,
        if args.no_warmup { "off" } else { "on" }
    );
    let _ = writeln!(
        out,
        "{:<6} {:>6} {:>12} {:>12} {:>12} {:>14} {:>14} {:>12} {:>12}  states",
        "cache",
        "calls",
        "fresh_in",
        "cache_read",
        "cache_write",
        "input_usd",
        "total_usd",
        "tracked_usd",
        "saved_usd"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<6} {:>6} {:>12} {:>12} {:>12} {:>14.6} {:>14.6} {:>12.6} {:>12.6}  {:?}",
            r.cache,
            r.bill.calls,
            r.bill.fresh_tokens,
            r.bill.cache_read_tokens,
            r.bill.cache_write_tokens,
            r.input_cost_usd,
            r.total_cost_usd,
            r.tracked_usd,
            r.tracked_saved_usd,
            r.states
        );
    }
    if let [cached, uncached] = rows {
        let _ = writeln!(
            out,
            "input cost with caching / without: {:.4} (shared prefix {} tokens)",
            cached.input_cost_usd / uncached.input_cost_usd.max(1e-12),
            cached.shared_prefix_tokens
        );
    }
    print!("{out}");
    Ok(())
}

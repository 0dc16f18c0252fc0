//! `forkfleet bench stream`: what a live fork's Server-Sent Events stream sends (issue 38).
//!
//! The work: a fork of `--branches` (1,000) branches on the embedded system, each making
//! `--turns` (10) `write_file` calls then answering, every call taking `--latency-ms`
//! (1,000) plus up to as much again (fixed per branch and turn), so the fork stays busy for
//! the whole window. The API (docs/HTTP.md) serves it on a loopback port, and one client
//! reads `GET /forks/{fork}/stream` for `--seconds` (20) from the fork's creation, as the
//! console does: the bytes it received, its events (`fork`: the whole view; `delta`: what
//! changed), the rows the deltas carried, and what the same events would have weighed had
//! each carried the whole view (the size of the first, times the events).

use anyhow::Context;
use clap::Args;
use forkfleet_client::workspace as ws;
use forkfleet_client::ApiClient;
use forkfleet_http::{audit::Audit, auth, ApiHttp, Serving, Slot};
use forkfleet_node::embedded::Embedded;
use forkfleet_shared::api::{Abort, Access, CreateFork, GetFork, ParentRun};
use forkfleet_shared::blob::BlobHash;
use serde::Serialize;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct StreamArgs {
    /// Branches of the fork.
    #[arg(long, default_value_t = 1000)]
    pub branches: usize,
    /// `write_file` calls per branch before its answer.
    #[arg(long, default_value_t = 10)]
    pub turns: usize,
    /// Least time a model call takes, ms (each takes up to as much again).
    #[arg(long, default_value_t = 1000)]
    pub latency_ms: u64,
    /// How long the client reads the stream, from the fork's creation.
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// In-process workers.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Branches each worker runs at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct StreamResult {
    pub branches: usize,
    pub seconds: u64,
    /// Bytes the client received (the SSE text, comments included).
    pub bytes: u64,
    /// Events `fork` (the whole view) and `delta` (what changed).
    pub fork_events: u64,
    pub delta_events: u64,
    /// Bytes of the first event's data: the whole view of the fork.
    pub first_event_bytes: u64,
    /// Branch rows the deltas carried (the view's and the cost's), and the most one carried.
    pub delta_rows: u64,
    pub largest_delta_rows: u64,
    /// What the events would have weighed had each carried the whole view: the first
    /// event's size times the events (a lower bound: the view grows as branches answer).
    pub whole_view_bytes: u64,
    /// Model turns the branches took in the window (the fork's work, for scale).
    pub model_turns: u64,
}

/// One Server-Sent Event's name and data, from its lines.
#[derive(Default)]
struct Sse {
    name: String,
    data: String,
}

/// Count what a stream's text carries; `pending` holds a line cut by the chunk's end (a
/// character of several bytes too).
#[derive(Default)]
struct Tally {
    pending: Vec<u8>,
    event: Sse,
    result: Counts,
}

#[derive(Default)]
struct Counts {
    fork: u64,
    delta: u64,
    first: u64,
    rows: u64,
    largest: u64,
}

impl Tally {
    fn feed(&mut self, chunk: &[u8]) {
        self.pending.extend_from_slice(chunk);
        while let Some(end) = self.pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            self.line(line.trim_end_matches(['\n', '\r']));
        }
    }

    fn line(&mut self, line: &str) {
        if line.is_empty() {
            let e = std::mem::take(&mut self.event);
            self.event_done(&e);
        } else if let Some(v) = line.strip_prefix("event:") {
            self.event.name = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("data:") {
            self.event.data.push_str(v.trim_start());
        }
    }

    fn event_done(&mut self, e: &Sse) {
        let c = &mut self.result;
        match e.name.as_str() {
            "fork" => {
                c.fork += 1;
                if c.first == 0 {
                    c.first = e.data.len() as u64;
                }
            }
            "delta" => {
                c.delta += 1;
                // Rows of the view's branches and of the cost's.
                let rows = serde_json::from_str::<serde_json::Value>(&e.data).map_or(0, |d| {
                    ["view", "cost"]
                        .iter()
                        .filter_map(|k| d[*k]["branches"].as_object())
                        .map(|r| r.len() as u64)
                        .sum()
                });
                c.rows += rows;
                c.largest = c.largest.max(rows);
            }
            _ => {}
        }
    }
}

fn script(turns: usize, latency_ms: u64) -> String {
    format!(
        "[defaults]\nlatency_ms = {latency_ms}\nlatency_jitter_ms = {latency_ms}\nusage = {{ input_tokens = 1000, output_tokens = 200 }}\n\n\
         [[turns.\"*\"]]\nrepeat = {turns}\ntool_calls = [{{ name = \"write_file\", args = {{ path = \"{{label}}/f{{repeat}}.txt\", content = \"turn {{turn}} of {{label}}\\n\" }} }}]\n\n\
         [[turns.\"*\"]]\ntext = \"{{label}} done\"\n"
    )
}

/// Run the benchmark: the fork, the API, one client reading the stream for the window.
pub async fn stream(args: &StreamArgs) -> anyhow::Result<StreamResult> {
    let tmp = tempfile::tempdir().context("temporary directory")?;
    let workspace = tmp.path().join("workspace");
    std::fs::create_dir_all(&workspace)?;
    std::fs::write(workspace.join("README.md"), "stream bench\n")?;
    let system =
        super::start_embedded(&tmp.path().join("data"), args.workers, args.concurrency).await?;
    let result = measure(&system, &workspace, args).await;
    system.shutdown().await?;
    result
}

async fn measure(
    system: &Embedded,
    workspace: &std::path::Path,
    args: &StreamArgs,
) -> anyhow::Result<StreamResult> {
    let token = auth::new_token()?;
    let tokens = auth::Tokens::new(
        [(
            "bench".to_string(),
            auth::HttpToken {
                sha256: auth::hash(&token),
                scopes: [Access::Admin].into(),
                accounts: None,
            },
        )]
        .into(),
    );
    let slot = Slot::default();
    slot.set(Some(Serving::new(system.coordinator(), system.bus.clone())));
    let api = ApiHttp::with_local(slot, tokens, Audit::new(None), Some(system.client()));
    let readiness = forkfleet_http::endpoint::Readiness::new("starting");
    readiness.ready();
    let endpoint = forkfleet_http::endpoint::HttpEndpoint::start_with(
        "127.0.0.1:0".parse()?,
        readiness,
        Some(api),
    )
    .await?;
    let base = format!("http://{}/api/v1", endpoint.addr());

    let client = system.client();
    let text = bytes::Bytes::from(script(args.turns, args.latency_ms).into_bytes());
    let hash = BlobHash::of(&text);
    let (_, upload) = ws::upload_workspace(
        client.blobs().as_ref(),
        workspace,
        &forkfleet_shared::scan::ScanOptions::names_only(&[]),
        [(hash, text)],
    )
    .await?;
    let start = Instant::now();
    let view = client
        .call(CreateFork {
            // The fan-out's plan: its branches play the script's `*` turns.
            plan: super::fanout_plan(args.branches.max(1), args.turns, hash),
            parent: ParentRun::New,
            snapshot: upload.snapshot,
            workspace: Some(workspace.display().to_string()),
            left_out: None,
            git: None,
        })
        .await?;
    let fork = view.fork_id;
    let window = Duration::from_secs(args.seconds);
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()?;
    let opened = tokio::time::timeout(
        Duration::from_secs(30),
        http.get(format!("{base}/forks/{fork}/stream"))
            .bearer_auth(&token)
            .send(),
    )
    .await
    .context("the stream did not answer in 30 s")?;
    let mut resp = opened?.error_for_status()?;
    let (mut bytes, mut tally) = (0u64, Tally::default());
    let deadline = tokio::time::Instant::from_std(start + window);
    loop {
        let chunk = match tokio::time::timeout_at(deadline, resp.chunk()).await {
            Err(_) | Ok(Ok(None)) => break,
            Ok(Ok(Some(c))) => c,
            Ok(Err(e)) => return Err(e.into()),
        };
        bytes += chunk.len() as u64;
        tally.feed(&chunk);
    }
    drop(resp);
    let settled = client.call(GetFork { fork }).await?;
    let model_turns = settled.branches.iter().map(|b| u64::from(b.turns)).sum();
    if let Err(e) = client.call(Abort { fork }).await {
        tracing::warn!(error = %e, "bench stream: the fork could not be aborted");
    }
    endpoint.stop().await;
    let c = tally.result;
    Ok(StreamResult {
        branches: args.branches,
        seconds: args.seconds,
        bytes,
        fork_events: c.fork,
        delta_events: c.delta,
        first_event_bytes: c.first,
        delta_rows: c.rows,
        largest_delta_rows: c.largest,
        whole_view_bytes: c.first * (c.fork + c.delta),
        model_turns,
    })
}

pub async fn cmd_stream(args: StreamArgs) -> anyhow::Result<()> {
    let r = stream(&args).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "a live fork of {} branches, its stream's first {} s: {:.2} MB in {} events ({} whole view, {} deltas carrying {} rows, at most {}); each event the whole view: at least {:.1} MB; {} model turns in the window",
        r.branches,
        r.seconds,
        mb(r.bytes),
        r.fork_events + r.delta_events,
        r.fork_events,
        r.delta_events,
        r.delta_rows,
        r.largest_delta_rows,
        mb(r.whole_view_bytes),
        r.model_turns
    );
    Ok(())
}

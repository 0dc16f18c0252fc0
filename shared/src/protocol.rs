//! Messages between the coordinator and the workers.
//!
//! - [`BranchTask`] on the task queue: run (or resume) one branch.
//! - [`BranchEvent`] on the event stream: one event of a branch's log, numbered by
//!   (run, seq) so delivery can be at-least-once and applying idempotent.
//!   Between two flushes a worker may send several as one [`BranchEventBatch`]
//!   ([`pack_events`]); the coordinator reads either ([`read_events`]).
//! - [`Control`] to a running branch: terminate or steer.

use crate::blob::BlobHash;
use crate::event::Event;
use crate::ids::{ForkId, RunId};
use crate::pricing::Price;
use crate::state::BranchState;
use crate::wire::WireMessage;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The queue branch tasks are published to (one pool for now).
pub const DEFAULT_POOL: &str = "default";

/// Run one branch: everything a worker needs, with large parts by blob reference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchTask {
    pub fork_id: ForkId,
    pub run_id: RunId,
    pub label: String,
    /// Position of the branch in its fork, from 0.
    pub index: u32,
    pub model: String,
    /// The model's price, when known (usage events carry the cost).
    pub price: Option<Price>,
    /// Scripted models: the script file.
    pub script: Option<BlobHash>,
    /// The parent's conversational events copied into the branch (its log's seqs 1..=P),
    /// as an rmp blob of `Vec<Event>` shared by all branches of the fork. The `fork`
    /// lineage event at seq 0 stays in the coordinator's store: the model never needs it.
    pub prefix: BlobHash,
    /// The branch-specific events after the prefix: extra instructions and the steer.
    /// `prefix + tail` is the branch's log from seq 1; the worker continues at
    /// `first_seq = 1 + P + tail.len()`.
    pub tail: Vec<Event>,
    /// The fork-time workspace snapshot (a `Manifest` blob).
    pub snapshot: BlobHash,
    /// The seq the worker's first event takes.
    pub first_seq: u64,
    pub max_turns: u32,
    pub max_output_tokens: u32,
    /// The branch's own cap when the task was made (the worker's early check; the
    /// coordinator's ledger is authoritative and may have been topped up).
    pub budget_usd: Option<f64>,
    /// Strict budget mode with a cap on the branch, its fork or its account: reserve on
    /// [`crate::budget::BUDGET_SUBJECT`] before every model call.
    #[serde(default, skip_serializing_if = "is_false")]
    pub reserve: bool,
    /// What a refused reservation or a stop for budget does to the branch.
    #[serde(default, skip_serializing_if = "crate::budget::OnExhausted::is_stop")]
    pub on_exhausted: crate::budget::OnExhausted,
    /// Added to the delivery count to make the task attempt. A task enqueued again for a
    /// branch that already ran (resumed after a pause) starts above every attempt before
    /// it, so it takes the branch over from the coordinator's log like a redelivery.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempt_base: u32,
    /// Real models: the spec's settings (its own base URL, timeout, retries; never a key
    /// source). The worker resolves the model in its own catalogue (ADR 16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<crate::endpoint::Endpoint>,
    /// The agent's optional tools, as its plan enables them (flattened: each keeps its
    /// own key on the wire).
    #[serde(flatten)]
    pub tools: crate::tools::ToolSettings,
    /// The sampling temperature sent with each model call (the provider's default when
    /// absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// A child of `runs fork --replay` (docs/LINEAGE.md): re-execute the parent's recorded
    /// prefix, serving each model call and tool call from the record while its request
    /// hashes the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<ReplayTask>,
    /// The root run of the branch's fork tree: every branch of the tree shares its
    /// provider prompt cache (OpenAI's `prompt_cache_key`). `None` from an older
    /// coordinator: the fork is the cache's scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_root: Option<RunId>,
    /// What an answer cut at the output cap with no tool call does.
    #[serde(default, skip_serializing_if = "crate::spec::OnTruncated::is_continue")]
    pub on_truncated: crate::spec::OnTruncated,
    /// The tool calls that wait for a person's consent (the branch's rules, else the
    /// fork's; docs/APPROVALS.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<crate::approval::ApprovalRules>,
    /// The coordinator reads [`BranchEventBatch`]es: the worker may publish the events
    /// between two flushes as one message. Absent (false) from a coordinator that
    /// predates them, whose workers then publish one message per event.
    #[serde(default, skip_serializing_if = "is_false")]
    pub event_batches: bool,
}

/// What a replaying child re-executes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayTask {
    /// The parent's events the child replays, in order (an rmp `Vec<(u64, Event)>` blob in
    /// the bus's blob store, each with its seq in the parent's log): its conversation on
    /// its history through the cutoff, with the file changes its recorded tool calls made,
    /// and the child's branch summary last when it asked for one.
    pub record: BlobHash,
    /// The parent run, named in a divergence error.
    pub parent_run: RunId,
    /// `--record`: at the first request that differs from the record, go on live (and
    /// record the live answers in the child) instead of failing the child.
    #[serde(default, skip_serializing_if = "is_false")]
    pub record_live: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl WireMessage for BranchTask {
    const KIND: &'static str = "branch_task";
}

/// One event of a branch run's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchEvent {
    pub fork_id: ForkId,
    pub run_id: RunId,
    pub seq: u64,
    pub at_ms: u64,
    pub event: Event,
    /// The delivery attempt of the task that produced the event (1 for the first). Once a
    /// branch resumes under attempt N, the coordinator drops events of earlier attempts,
    /// so a worker presumed dead can never interleave with the one that took over.
    #[serde(default)]
    pub attempt: u32,
}

impl WireMessage for BranchEvent {
    const KIND: &'static str = "branch_event";
}

/// Several [`BranchEvent`]s of one run in one bus message (what a worker publishes
/// between two flushes, when its task says `event_batches`): on NATS one stored message,
/// one delivery and one ack instead of one per event. Each element is a whole wire-encoded
/// `branch_event`, in seq order. It borrows what it carries both ways: the worker writes
/// its encoded events into the message, the coordinator decodes each where it lies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchEventBatch<'a> {
    #[serde(borrow)]
    pub events: Vec<&'a serde_bytes::Bytes>,
    /// The contents of small text blobs the events write, sent along so that the
    /// coordinator need not fetch them from the bus's blob store (where the worker put them
    /// first, as always). A reader keeps one only for a hash an applied event names, and
    /// checks the bytes against it.
    #[serde(default, skip_serializing_if = "Vec::is_empty", borrow)]
    pub blobs: Vec<SentBlob<'a>>,
}

/// A blob's contents sent along with the events that write it, under the hash they claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SentBlob<'a> {
    pub hash: BlobHash,
    #[serde(borrow)]
    pub bytes: &'a serde_bytes::Bytes,
}

impl BranchEventBatch<'_> {
    /// Its wire kind (it borrows, so it is not a [`WireMessage`]: `wire::encode_kind`).
    pub const KIND: &'static str = "branch_event_batch";
}

/// What one message of the event stream carries: its events, and the blobs a batch brought
/// along under the hashes they claim (unchecked: see [`BranchEventBatch::blobs`]).
#[derive(Debug, Default)]
pub struct EventMessage {
    pub events: Vec<BranchEvent>,
    pub blobs: Vec<(BlobHash, Bytes)>,
}

/// Room left in a bus message for the batch's envelope and the message's headers.
const BATCH_MARGIN: usize = 1024;

/// An element's size in a batch: its bytes and a `bin 32` header at most.
fn element(bytes: &Bytes) -> usize {
    bytes.len().saturating_add(5)
}

/// A sent blob's size in a batch: its bytes, its hash, their keys and headers, at most.
fn sent_size(bytes: &Bytes) -> usize {
    bytes.len().saturating_add(64)
}

/// Wire-encoded `branch_event`s, in order, as the fewest messages of at most `max_payload`
/// bytes: consecutive events packed into [`BranchEventBatch`]es, an event alone (or too
/// large to share a message) as it is, so what a bus carries today it carries packed.
pub fn pack_events(
    payloads: &[Bytes],
    max_payload: Option<usize>,
) -> Result<Vec<Bytes>, crate::wire::WireError> {
    pack_events_with(payloads, &[], max_payload)
}

/// [`pack_events`], with `blobs` (contents the events write, by hash) in the last message
/// when they fit there; those that do not are left out (the coordinator fetches them). The
/// coordinator matches a blob with the events it applied together with it: those of the
/// last message, and as a rule the whole flush's (its messages arrive together).
pub fn pack_events_with(
    payloads: &[Bytes],
    blobs: &[(BlobHash, Bytes)],
    max_payload: Option<usize>,
) -> Result<Vec<Bytes>, crate::wire::WireError> {
    if payloads.len() < 2 && blobs.is_empty() {
        return Ok(payloads.to_vec());
    }
    let limit = max_payload.map_or(usize::MAX, |m| m.saturating_sub(BATCH_MARGIN));
    let mut out = Vec::new();
    let mut group: Vec<&Bytes> = Vec::new();
    let mut size = 0usize;
    for payload in payloads {
        let n = element(payload);
        if !group.is_empty() && size.saturating_add(n) > limit {
            out.push(pack_group(&std::mem::take(&mut group), &[])?);
            size = 0;
        }
        if n > limit {
            out.push(payload.clone());
            continue;
        }
        size += n;
        group.push(payload);
    }
    if group.is_empty() {
        return Ok(out);
    }
    let mut fitting = Vec::with_capacity(blobs.len());
    for blob in blobs {
        let n = sent_size(&blob.1);
        if size.saturating_add(n) <= limit {
            size += n;
            fitting.push(blob);
        }
    }
    out.push(pack_group(&group, &fitting)?);
    Ok(out)
}

/// The events of one message of the event stream: a `branch_event`, or each of a
/// `branch_event_batch`'s, in order.
pub fn read_events(payload: &[u8]) -> Result<Vec<BranchEvent>, crate::wire::WireError> {
    read_message(payload).map(|m| m.events)
}

/// The events of one message of the event stream, and the blobs a batch carries.
pub fn read_message(payload: &[u8]) -> Result<EventMessage, crate::wire::WireError> {
    if crate::wire::kind_of(payload)? == BranchEventBatch::KIND {
        let batch: BranchEventBatch<'_> =
            crate::wire::decode_kind(BranchEventBatch::KIND, payload)?;
        return Ok(EventMessage {
            events: batch
                .events
                .iter()
                .map(|e| crate::wire::decode::<BranchEvent>(e))
                .collect::<Result<_, _>>()?,
            blobs: batch
                .blobs
                .iter()
                .map(|b| (b.hash, Bytes::copy_from_slice(b.bytes)))
                .collect(),
        });
    }
    Ok(EventMessage {
        events: vec![crate::wire::decode(payload)?],
        blobs: Vec::new(),
    })
}

/// Bytes as msgpack `bin` (not an array of numbers).
fn as_bin(b: &Bytes) -> &serde_bytes::Bytes {
    serde_bytes::Bytes::new(b)
}

/// One message of `group`'s events: the event itself when it is alone with no blobs.
fn pack_group(
    group: &[&Bytes],
    blobs: &[&(BlobHash, Bytes)],
) -> Result<Bytes, crate::wire::WireError> {
    if let ([one], []) = (group, blobs) {
        return Ok((*one).clone());
    }
    crate::wire::encode_kind(
        BranchEventBatch::KIND,
        &BranchEventBatch {
            events: group.iter().map(|b| as_bin(b)).collect(),
            blobs: blobs
                .iter()
                .map(|(hash, b)| SentBlob {
                    hash: *hash,
                    bytes: as_bin(b),
                })
                .collect(),
        },
    )
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum ControlCommand {
    /// Stop as `terminated`, cancelling a model call in flight.
    Terminate {
        reason: String,
    },
    Steer {
        text: String,
    },
    /// A budget cap was crossed: stop as `state` (`budget_exhausted` or
    /// `aggregate_budget_exhausted`), cancelling a model call in flight unless `graceful`.
    Stop {
        state: BranchState,
        reason: String,
        /// Let a model call in flight finish and be recorded first (strict mode: the call
        /// is paid for by its reservation), then stop before the next one.
        #[serde(default, skip_serializing_if = "is_false")]
        graceful: bool,
    },
    /// Another worker took the branch over under task attempt `by` (its task was delivered
    /// again): a worker running an earlier attempt stops the branch at once, publishing
    /// nothing more and leaving the task unsettled (the other worker holds it now). A
    /// model call in flight finishes, so its usage is published and counted (ADR 18).
    Superseded {
        by: u32,
    },
    /// A budget cap was crossed and the fork pauses instead of stopping: publish `paused`,
    /// hand the task back as finished, and wait for a top-up to enqueue the branch again.
    Pause {
        reason: String,
        /// As for `stop`.
        #[serde(default, skip_serializing_if = "is_false")]
        graceful: bool,
    },
}

/// A command to one running branch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Control {
    pub run_id: RunId,
    pub command: ControlCommand,
    /// The last task attempt the command is meant for: a later attempt (a branch resumed
    /// after a pause, which watches the run's control channel from its start) ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
}

impl WireMessage for Control {
    const KIND: &'static str = "control";
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A worker's heartbeat: what `forkfleet workers` lists. Workers put it on the bus every
/// few seconds; an entry not refreshed within [`WORKER_TTL_MS`] is gone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub worker_id: crate::ids::WorkerId,
    pub pool: String,
    pub concurrency: usize,
    /// The branches it runs now.
    pub running: Vec<RunId>,
    pub hostname: String,
    pub version: String,
    pub started_at_ms: u64,
    pub heartbeat_at_ms: u64,
    /// The real models of its catalogue: names, dialects, base URLs, never a key source
    /// (ADR 16). The coordinator checks a fork's models against them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<crate::catalogue::OfferedModel>,
    /// The hosts (`host` or `host:port`) a spec's own `base_url` may point at.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_model_hosts: Vec<String>,
    /// What its commands run in, as its probe at start found (`None`: an older worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commands: Option<CommandSetupInfo>,
}

/// The set-up a worker's commands get (`run_command`, test commands), chosen at start by
/// starting one: layered trees or whole ones, Landlock or the limits only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandSetupInfo {
    /// Trees are layered over a base per fork (overlayfs in a user namespace).
    pub layered: bool,
    /// The Landlock ABI commands are confined with; 0: resource limits only.
    pub landlock_abi: i32,
    /// The kernel's Landlock ABI.
    pub kernel_landlock_abi: i32,
    /// Why a stronger set-up was not taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
}

impl WorkerInfo {
    /// What it advertises of its catalogue.
    pub fn offer(&self) -> crate::catalogue::Offer {
        crate::catalogue::Offer {
            models: self.models.clone(),
            allowed_hosts: self.allowed_model_hosts.clone(),
        }
    }
}

impl WireMessage for WorkerInfo {
    const KIND: &'static str = "worker_info";
}

/// A heartbeat older than this means the worker is gone.
pub const WORKER_TTL_MS: u64 = 30_000;

/// The request/reply subject on which the coordinator hands a redelivered branch its log.
pub const RESUME_SUBJECT: &str = "coord.resume";

/// A worker took over a branch (its task was delivered again): fence off the earlier
/// attempts and send the branch's log as the coordinator has it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumeRequest {
    pub fork_id: ForkId,
    pub run_id: RunId,
    pub attempt: u32,
    /// The delivery the worker holds, as its bus reported it: without it (or when it does
    /// not check out) the coordinator refuses the request (ADR 18).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskProof>,
}

/// The delivery a [`ResumeRequest`] comes from: the task's position in its queue (the
/// stream sequence on NATS) and the bus's delivery count. The coordinator reads the task at
/// `seq` from the queue: it must still be queued or held, be this branch's, and its
/// `attempt_base + delivered` must be the request's attempt, with `delivered` within the
/// queue's `max_deliver`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskProof {
    pub seq: u64,
    pub delivered: u32,
}

impl WireMessage for ResumeRequest {
    const KIND: &'static str = "resume_request";
}

/// The answer to a [`ResumeRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ResumeReply {
    /// The branch's whole log, seq 0 (the `fork` event) first. The worker continues at the
    /// seq after the last one.
    Log { events: Vec<(u64, Event)> },
    /// The coordinator knows no such branch, or the fork was resolved: drop the task.
    Gone { reason: String },
    /// Try again later (the coordinator could not read its store).
    Retry { reason: String },
    /// The request does not come from the worker holding the branch's current task (its
    /// delivery proof does not check out, or a later attempt took the branch over):
    /// nothing was fenced. The worker stops the branch without settling its task.
    Refused { reason: String },
    /// The `Log` answer was larger than the bus carries in one message: it is the blob
    /// `blob` (the encoded `ResumeReply::Log`), to read from the blob store.
    LogBlob { blob: crate::blob::BlobHash },
}

impl WireMessage for ResumeReply {
    const KIND: &'static str = "resume_reply";
}

// ---- resolve jobs ---------------------------------------------------------------------

/// The request/reply subject on which workers take resolve jobs (tests on a branch's tree,
/// a judge's call). Every worker serves it in one queue group: each job goes to one worker.
pub const RESOLVE_SUBJECT: &str = "worker.resolve";

/// Work the coordinator hands a worker while resolving a fork. A job is idempotent and
/// leaves nothing behind on the worker, so the coordinator simply asks again (another
/// worker may answer) when a reply does not come in time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "job", rename_all = "snake_case")]
pub enum ResolveJob {
    Test(TestJob),
    Judge(JudgeJob),
    /// `runs fork --summarize=model` (docs/LINEAGE.md): one call of the run's model.
    Summary(SummaryJob),
}

/// Write a child's branch summary with the parent run's model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryJob {
    /// The run summarised, and its fork (a root run has none).
    pub run_id: RunId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_id: Option<ForkId>,
    /// `provider:name`.
    pub model: String,
    pub price: Option<Price>,
    /// Scripted models: the script file; the scripted provider plays the turns of label
    /// `summary` (or `*`), turn 0.
    pub script: Option<BlobHash>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<crate::endpoint::Endpoint>,
    /// The bounded prompt ([`crate::lineage::summary_prompt`]).
    pub prompt: String,
    pub max_output_tokens: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

/// What a summary job wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryRun {
    pub model: String,
    /// The summary; `None` with `error` when the call failed or wrote nothing.
    pub text: Option<String>,
    pub error: Option<String>,
    pub usage: crate::event::Usage,
    pub cost_usd: f64,
}

impl WireMessage for ResolveJob {
    const KIND: &'static str = "resolve_job";
}

/// Run the test command in a branch's tree (its snapshot with its changes applied).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestJob {
    pub fork_id: ForkId,
    pub label: String,
    /// The branch's tree: a `Manifest` blob in the bus's blob store.
    pub tree: BlobHash,
    /// The program and its arguments; no shell.
    pub argv: Vec<String>,
    pub timeout_ms: u64,
    /// Set on top of the worker's minimal environment (PATH, HOME, TMPDIR, LANG).
    pub env: std::collections::BTreeMap<String, String>,
    /// How the command is confined: the plan's `[run_command]` sandbox settings, or the
    /// defaults when the plan has no `run_command` table (a message without it decodes to
    /// the defaults).
    #[serde(default)]
    pub sandbox: crate::endpoint::CommandSandbox,
    /// The W3C `traceparent` of the coordinator's `fork.resolve` span: the worker's
    /// `resolve.test` span is its child (`crate::trace`). `None` without trace context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

/// Ask one judge model for a verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JudgeJob {
    pub fork_id: ForkId,
    /// `provider:name`.
    pub model: String,
    pub price: Option<Price>,
    /// Scripted judges: the script file. The scripted provider plays the turns of label
    /// `judge` (or `*`): turn 0 for the verdict, turn 1 for the one retry.
    pub script: Option<BlobHash>,
    /// The bounded judge prompt (`resolve::judge_prompt`).
    pub prompt: String,
    /// The fork's branch labels.
    pub labels: Vec<String>,
    /// The branches the winner must be one of: those with the best test pass ratio when
    /// any branch has a test signal (tests outrank the judge's taste); empty: any branch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<String>,
    /// Why the candidates are restricted, for the judge (e.g. the test results).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidates_reason: Option<String>,
    pub max_output_tokens: u32,
    /// Real judge models: the spec's settings, resolved in the worker's catalogue as a
    /// branch task's are (ADR 16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<crate::endpoint::Endpoint>,
    /// The W3C `traceparent` of the coordinator's `fork.resolve` span: the worker's
    /// `resolve.judge` span is its child (`crate::trace`). `None` without trace context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

/// A worker's answer to a [`ResolveJob`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ResolveJobReply {
    Test(TestRun),
    Judge(JudgeRun),
    Summary(SummaryRun),
    /// The job could not be run at all (a blob is missing, the job is malformed): asking
    /// again will not help.
    Failed {
        error: String,
    },
}

impl WireMessage for ResolveJobReply {
    const KIND: &'static str = "resolve_job_reply";
}

/// What a test command did on one branch's tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestRun {
    pub label: String,
    pub outcome: crate::testsignal::TestOutcome,
    pub signal: crate::testsignal::TestSignal,
    /// The end of the output (at most a few KiB), for people.
    pub output_tail: String,
    pub duration_ms: u64,
    /// The worker that ran it.
    pub worker: String,
}

impl TestRun {
    /// A test that could not be run (its tree unreadable, no worker answered, ...): no
    /// signal, never a pass.
    pub fn not_run(label: &str, worker: &str, duration_ms: u64, error: String) -> TestRun {
        let outcome = crate::testsignal::TestOutcome::SpawnFailed { error };
        TestRun {
            label: label.to_string(),
            signal: crate::testsignal::test_signal(&outcome, ""),
            outcome,
            output_tail: String::new(),
            duration_ms,
            worker: worker.to_string(),
        }
    }
}

/// What one judge said.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JudgeRun {
    pub model: String,
    /// The validated verdict; `None` with `error` when the judge failed (a model error, or
    /// an unknown winner twice).
    pub verdict: Option<crate::resolve::JudgeVerdict>,
    pub error: Option<String>,
    /// Model calls made (2 when the first answer was retried).
    pub calls: u32,
    /// Why earlier answers were refused (an unknown winner, a branch outside the
    /// candidates, not a verdict), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<String>,
    /// The judge's own usage and cost, never counted in the branches' spend.
    pub usage: crate::event::Usage,
    pub cost_usd: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire;
    use uuid::Uuid;

    fn event(seq: u64, text_len: usize) -> BranchEvent {
        BranchEvent {
            fork_id: ForkId(Uuid::from_u128(1)),
            run_id: RunId(Uuid::from_u128(2)),
            seq,
            at_ms: 1_700_000_000_000,
            event: Event::Steer {
                text: "x".repeat(text_len),
            },
            attempt: 1,
        }
    }

    fn read_all(messages: &[Bytes]) -> Vec<BranchEvent> {
        messages
            .iter()
            .flat_map(|m| read_events(m).unwrap())
            .collect()
    }

    #[test]
    fn packed_events_read_back_in_order_within_the_payload_limit() {
        let events: Vec<BranchEvent> = (0..40)
            .map(|seq| event(seq, 100 + seq as usize * 50))
            .collect();
        let encoded: Vec<Bytes> = events.iter().map(|e| wire::encode(e).unwrap()).collect();
        // No limit: one message.
        let one = pack_events(&encoded, None).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(wire::kind_of(&one[0]).unwrap(), BranchEventBatch::KIND);
        assert_eq!(read_all(&one), events);
        // A limit: several messages, none over it, the same events in the same order.
        let limit = 8 * 1024;
        let many = pack_events(&encoded, Some(limit)).unwrap();
        assert!(many.len() > 2, "{} messages", many.len());
        assert!(
            many.iter().all(|m| m.len() + BATCH_MARGIN / 2 <= limit),
            "{:?}",
            many.iter().map(Bytes::len).collect::<Vec<_>>()
        );
        assert_eq!(read_all(&many), events);
    }

    #[test]
    fn an_event_too_large_to_share_a_message_goes_alone_and_one_event_is_not_wrapped() {
        let limit = 4 * 1024;
        let events = vec![event(0, 10), event(1, 10_000), event(2, 10), event(3, 10)];
        let encoded: Vec<Bytes> = events.iter().map(|e| wire::encode(e).unwrap()).collect();
        let messages = pack_events(&encoded, Some(limit)).unwrap();
        let kinds: Vec<_> = messages
            .iter()
            .map(|m| wire::kind_of(m).unwrap().into_owned())
            .collect();
        // The first alone (a group of one is sent as it is), the large one as it is, then a batch.
        assert_eq!(
            kinds,
            ["branch_event", "branch_event", "branch_event_batch"]
        );
        assert_eq!(messages[1], encoded[1]);
        assert_eq!(read_all(&messages), events);
        let single = pack_events(&encoded[..1], Some(limit)).unwrap();
        assert_eq!(single, vec![encoded[0].clone()]);
        assert!(pack_events(&[], None).unwrap().is_empty());
    }

    #[test]
    fn blobs_ride_in_the_last_message_when_they_fit_and_are_left_out_when_not() {
        let events: Vec<BranchEvent> = (0..3).map(|seq| event(seq, 10)).collect();
        let encoded: Vec<Bytes> = events.iter().map(|e| wire::encode(e).unwrap()).collect();
        let sent = |b: &'static [u8]| (BlobHash::of(b), Bytes::from_static(b));
        let (small, other) = (sent(b"note 1 of a\n"), sent(b"note 2 of a\n"));
        let large = Bytes::from(vec![b'x'; 6 * 1024]);
        let limit = 4 * 1024;
        let messages = pack_events_with(
            &encoded,
            &[
                small.clone(),
                (BlobHash::of(&large), large.clone()),
                other.clone(),
            ],
            Some(limit),
        )
        .unwrap();
        assert_eq!(messages.len(), 1);
        // Within the limit, most of its margin for headers kept.
        assert!(messages[0].len() + BATCH_MARGIN / 2 <= limit);
        let read = read_message(&messages[0]).unwrap();
        assert_eq!(read.events, events);
        assert_eq!(read.blobs, vec![small.clone(), other]);
        // One event with a blob is still a batch (the blob needs a carrier); with none, the
        // event as it is.
        let one = pack_events_with(&encoded[..1], std::slice::from_ref(&small), None).unwrap();
        assert_eq!(wire::kind_of(&one[0]).unwrap(), BranchEventBatch::KIND);
        assert_eq!(read_message(&one[0]).unwrap().blobs, vec![small]);
        // A single event's message carries none.
        assert!(read_message(&encoded[0]).unwrap().blobs.is_empty());
    }

    #[test]
    fn a_batch_with_a_bad_element_is_an_error_not_a_shorter_list() {
        let good = wire::encode(&event(0, 5)).unwrap();
        let batch = pack_events(
            &[good.clone(), Bytes::from_static(b"\x00 not an event")],
            None,
        )
        .unwrap();
        assert_eq!(batch.len(), 1);
        assert!(read_events(&batch[0]).is_err());
        assert!(read_events(b"garbage").is_err());
        assert_eq!(read_events(&good).unwrap(), vec![event(0, 5)]);
    }
}

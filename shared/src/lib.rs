//! # forkfleet-shared
//!
//! Types and pure logic shared by the coordinator, the workers and the CLI. No service loops
//! live here: only data and the rules over it, and the bus-facing types (subjects, the wire
//! envelope, the blob store trait, trace context). The bus, its implementations and
//! the `nats-server` launcher are the `forkfleet-bus` crate's.
//!
//! ## Layout
//! - [`ids`]: UUID v7 newtypes (`RunId`, `ForkId`, ...).
//! - [`path`]: workspace paths, normalised and confined to the root.
//! - [`blob`], [`manifest`]: content-addressed blobs and workspace snapshots; [`scan`]: reading
//!   a workspace for a snapshot (ignore files, parallel hashing, a stat cache).
//! - [`overlay`]: the copy-on-write view a branch works in, with its change log.
//! - [`diff`]: the cross-branch diff report; in `diff/`: `unified` (unified diffs of one path),
//!   `render` (the terminal table), `json` (the report's JSON form).
//! - [`flush`]: replaying a branch's change log onto a parent, with conflict detection; in
//!   `flush/`: `memory` (manifest and overlay targets), `dir` (a directory target),
//!   `between` (the change log between two workspace versions).
//! - [`event`], [`state`]: run events and branch / fork states.
//! - [`approval`]: which tool calls wait for a person's consent (rules, their matcher, the
//!   views of a pending request and a blocked call).
//! - [`lineage`]: forking a recorded run at any event: copy rules, `--set` settings,
//!   request hashes for replay, summaries.
//! - [`pricing`], [`budget`]: model prices; budget policy, reservations, cost reports.
//! - [`error`]: the kind every crate's errors answer (bad input, not found, ...), its exit code.
//! - [`clock`]: the time that decides behaviour (reservation expiry, heartbeats), which tests
//!   replace with a manual clock.
//! - [`trace`]: W3C trace context carried by bus messages.
//! - [`metrics`]: the process-wide metric registry (counters, gauges, histograms), its
//!   Prometheus text and snapshot; in `metrics/`: `catalog` (every metric), `render`.
//! - [`percent`]: percent-decoding, for URLs' user info and `key=value` lists.
//! - [`testsignal`]: test runner output and exit status to a branch's test signal.
//! - [`resolve`]: confidence scoring, the judge's verdict and bounded prompt, merge strategies;
//!   in `resolve/`: `confidence`, `verdict`, `prompt`, `strategy` and `tests`.
//! - [`api`]: the coordinator's API, every operation declared once (`api::ops`), and the
//!   views and outcomes it answers with.
//! - [`spec`]: the TOML fork spec, the `ForkPlan` it becomes, and the plan's one
//!   validation.
//! - [`script`]: the scripted model's turn file.
//! - [`protocol`]: tasks, branch events, control commands and resolve jobs on the bus.
//! - [`subjects`]: every bus subject and stream name, built in one place.
//! - [`endpoint`]: a real model API's endpoint and the `run_command` tool's settings.
//! - [`catalogue`]: the workers' model catalogue: the real models a worker offers, their
//!   APIs and key sources, and the hosts a spec's own `base_url` may name (ADR 16).
//! - [`tools`]: every tool declared once (name, what offers it, the approval rules that
//!   gate it) and the optional tools' settings, which travel as one from plan to task.
//! - [`provider`]: the model providers a model's name starts with, declared once.
//! - [`wire`]: the versioned MessagePack envelope every message travels in.

/// Every setting's environment variable starts so (`FORKFLEET_NATS_URL`, ...).
pub const ENV_PREFIX: &str = "FORKFLEET_";

pub mod api;
pub mod approval;
pub mod blob;
pub mod budget;
pub mod catalogue;
pub mod clock;
pub mod diff;
pub mod endpoint;
pub mod error;
pub mod event;
pub mod flush;
pub mod ids;
pub mod lineage;
pub mod manifest;
pub mod metrics;
pub mod overlay;
pub mod path;
pub mod percent;
pub mod pricing;
pub mod protocol;
pub mod provider;
pub mod resolve;
pub mod scan;
pub mod script;
pub mod spec;
pub mod state;
pub mod subjects;
pub mod testsignal;
pub mod tools;
pub mod trace;
pub mod wire;

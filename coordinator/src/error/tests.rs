//! Tests of the error type: its messages, kinds and helpers.

use super::*;

#[test]
fn lists_are_bounded() {
    assert_eq!(list(["a", "b"].iter()), "a, b");
    let many: Vec<String> = (0..25).map(|i| i.to_string()).collect();
    let s = list(many.iter());
    assert!(s.ends_with("and 15 more"), "{s}");
}

/// Every variant: its kind, and words its message must hold (what was wrong, and
/// what to do or what is valid).
#[test]
fn each_error_has_its_kind_and_names_what_was_wrong() {
    use CoordinatorError as E;
    use ErrorKind::*;
    let (fork, parent, child, run) = (ForkId::new(), ForkId::new(), ForkId::new(), RunId::new());
    let (f, r) = (fork.to_string(), run.to_string());
    let s = |x: &str| x.to_string();
    let hash = BlobHash::of(b"x");
    let table: Vec<(CoordinatorError, ErrorKind, Vec<String>)> = vec![
        (
            E::AmbiguousFork {
                prefix: s("01"),
                count: 2,
                matches: s("a, b"),
            },
            BadInput,
            vec![s("`01` matches 2 forks (a, b)")],
        ),
        (
            E::AmbiguousRun {
                prefix: s("01"),
                count: 3,
                matches: s("x, y, z"),
            },
            BadInput,
            vec![s("`01` matches 3 runs (x, y, z)")],
        ),
        (
            E::AmbiguousRun {
                prefix: s("0"),
                count: 11,
                matches: s("m"),
            },
            BadInput,
            vec![s("matches more than 10 runs")],
        ),
        (E::MissingRunId, BadInput, vec![s("give a run id")]),
        (
            E::AmbiguousCheckpoint {
                run,
                reference: s("0190"),
                count: 2,
                matches: s("p, q"),
            },
            BadInput,
            vec![s("`0190` matches 2 checkpoints"), r.clone()],
        ),
        (
            E::InvalidPlan(SpecError::NoBranches),
            BadInput,
            vec![s("invalid fork plan")],
        ),
        (
            E::DuplicateLabel(s("a")),
            BadInput,
            vec![s("`a` is used twice")],
        ),
        (
            E::UnknownModel {
                label: s("a"),
                model: s("x:y"),
                valid: s("scripted:demo"),
            },
            BadInput,
            vec![s("x:y"), s("configured models: scripted:demo")],
        ),
        (
            E::missing_blobs(&[hash]),
            BadInput,
            vec![hash.short().to_string(), s("upload")],
        ),
        (
            E::BadSnapshot {
                hash,
                message: s("bad"),
            },
            BadInput,
            vec![s("not a workspace manifest")],
        ),
        (
            E::BadStrategy(StrategyError::Threshold(2.0)),
            BadInput,
            vec![s("cannot resolve"), s("threshold 2")],
        ),
        (
            E::NoJudge {
                strategy: s("auto"),
            },
            BadInput,
            vec![s("strategy `auto` needs a judge"), s("--strategy manual")],
        ),
        (
            E::EmptyMessage {
                what: "steering message",
            },
            BadInput,
            vec![s("a steering message cannot be empty")],
        ),
        (
            E::EmptyCheckpointLabel,
            BadInput,
            vec![s("a checkpoint label cannot be empty")],
        ),
        (
            E::BadCheckpointLabel {
                label: s(".x"),
                rule: s("checkpoint label `.x` starts with `.`"),
            },
            BadInput,
            vec![s("`.x`")],
        ),
        (
            E::AutomaticCheckpointLabel { label: s("turn-1") },
            BadInput,
            vec![s("`turn-1`"), s("automatic")],
        ),
        (
            E::CheckpointLabelIsId { label: s("0190") },
            BadInput,
            vec![s("`0190` looks like a checkpoint id")],
        ),
        (
            E::NoConversation {
                run,
                label: s("fork"),
            },
            BadInput,
            vec![s("checkpoint `fork`"), r.clone()],
        ),
        (
            E::RootRunForks { run },
            BadInput,
            vec![format!("run {r} is a root run")],
        ),
        (
            E::NoAgentBranches,
            BadInput,
            vec![s("at least one branch"), s("{label, steer}")],
        ),
        (
            E::MissingSteer { label: s("a") },
            BadInput,
            vec![s("branch `a` has no steer")],
        ),
        (
            E::NotMadeByRun { fork, run },
            BadInput,
            vec![format!("fork {f} was not made by run {r}")],
        ),
        (
            E::NotARootRun { run, fork },
            BadInput,
            vec![format!("run {r} is a branch of fork {f}")],
        ),
        (
            E::BadRequest(s("no such thing")),
            BadInput,
            vec![s("no such thing")],
        ),
        (
            E::BadBudget(s("-1 is not an amount")),
            BadInput,
            vec![s("-1 is not an amount")],
        ),
        (
            E::UnknownFork(s("zz")),
            NotFound,
            vec![s("no fork has the id, id prefix or name `zz`")],
        ),
        (
            E::UnknownRun(run),
            NotFound,
            vec![format!("run {r} does not exist")],
        ),
        (
            E::UnknownRunPrefix { prefix: s("zz") },
            NotFound,
            vec![s("no run matches `zz`")],
        ),
        (
            E::UnknownLabel {
                fork,
                label: s("q"),
                valid: s("a, b"),
            },
            NotFound,
            vec![s("`q`"), s("valid labels: a, b")],
        ),
        (
            E::UnknownCheckpoint {
                run,
                reference: s("nope"),
                valid: s("checkpoints: a"),
            },
            NotFound,
            vec![s("no checkpoint `nope`"), s("checkpoints: a")],
        ),
        (
            E::UnknownAccount {
                name: s("team"),
                valid: s("accounts: x"),
            },
            NotFound,
            vec![s("no account named `team`"), s("accounts: x")],
        ),
        (
            E::AlreadyMerged {
                fork,
                winner: s("a"),
            },
            Conflict,
            vec![s("already merged (winner `a`)")],
        ),
        (
            E::Aborted(fork),
            Conflict,
            vec![format!("fork {f} was aborted")],
        ),
        (
            E::MergeInProgress(fork),
            Conflict,
            vec![s("being merged right now")],
        ),
        (
            E::StillRunning {
                label: s("a"),
                state: BranchState::Running,
            },
            Conflict,
            vec![s("branch `a` is running: still running")],
        ),
        (
            E::ForkBusy {
                fork,
                activity: "resolved",
                then: s("continue its branches"),
            },
            Conflict,
            vec![s(
                "being resolved right now; continue its branches afterwards",
            )],
        ),
        (
            E::ResolveInProgress(fork),
            Conflict,
            vec![s("cannot resolve"), s("being resolved right now")],
        ),
        (
            E::Unfinished {
                fork,
                unfinished: vec![s("`a` (running)"), s("`b` (paused)")],
            },
            Conflict,
            vec![s("not finished: `a` (running), `b` (paused)")],
        ),
        (
            E::AgentMerges {
                fork,
                parent,
                label: s("a"),
                state: BranchState::Running,
            },
            Conflict,
            vec![
                format!("branch `a` of fork {parent}, which is running"),
                s("the agent merges it itself"),
            ],
        ),
        (
            E::AgentStillRunning {
                fork,
                label: s("a"),
                state: BranchState::Running,
                child,
            },
            Conflict,
            vec![format!("its agent merges fork {child} itself")],
        ),
        (
            E::RewindRunning {
                run,
                fork,
                label: s("a"),
                state: BranchState::Running,
            },
            Conflict,
            vec![
                s("a running branch cannot be rewound"),
                format!("forkfleet fork terminate {f} a"),
            ],
        ),
        (
            E::RewindRaced { label: s("a") },
            Conflict,
            vec![s("branch `a`'s log changed"), s("ask again")],
        ),
        (
            E::EmptyLog(run),
            Conflict,
            vec![format!("run {r} has no events")],
        ),
        (
            E::CheckpointPastEnd {
                run,
                label: s("c"),
                seq: 9,
                end: 4,
            },
            Conflict,
            vec![s("checkpoint `c` is at seq 9"), s("ends at 4")],
        ),
        (
            E::CheckpointLabelTaken {
                run,
                label: s("c"),
                seq: 3,
            },
            Conflict,
            vec![
                s("already has a checkpoint labelled `c` (at seq 3)"),
                s("checkpoint rm"),
            ],
        ),
        (
            E::SteerPaused {
                fork,
                label: s("a"),
            },
            Conflict,
            vec![
                s("paused by a budget cap"),
                format!("forkfleet fork topup {f} --branch a"),
            ],
        ),
        (
            E::SteerFinished {
                fork,
                label: s("a"),
                state: BranchState::Done,
            },
            Conflict,
            vec![
                s("has finished (done)"),
                format!("forkfleet fork continue {f} a"),
            ],
        ),
        (
            E::SteerStopping {
                fork,
                phase: "merged",
            },
            Conflict,
            vec![format!("fork {f} is merged"), s("nothing to steer")],
        ),
        (
            E::ContinueMerged {
                fork,
                winner: s("a"),
            },
            Conflict,
            vec![s("was merged (winner `a`)"), s("cannot be continued")],
        ),
        (
            E::ContinueAborted(fork),
            Conflict,
            vec![s("was aborted: its branches cannot be continued")],
        ),
        (
            E::CapFull {
                fork,
                label: s("a"),
                state: BranchState::BudgetExhausted,
                full: "the fork's cap",
            },
            Conflict,
            vec![
                s("the fork's cap has no room left"),
                s("forkfleet fork topup"),
            ],
        ),
        (
            E::ContinuePaused {
                fork,
                label: s("a"),
            },
            Conflict,
            vec![
                s("paused by a budget cap, not finished"),
                format!("forkfleet fork steer {f} a"),
            ],
        ),
        (
            E::ContinueRunning {
                fork,
                label: s("a"),
                state: BranchState::Running,
            },
            Conflict,
            vec![
                s("is running (still running)"),
                format!("forkfleet fork steer {f} a"),
            ],
        ),
        (
            E::StoreLocked {
                dir: PathBuf::from("/d"),
                message: s("held"),
            },
            Unavailable,
            vec![s("`/d` is locked by another process")],
        ),
        (
            E::Bus(BusError::Closed),
            Unavailable,
            vec![s("the bus is closed")],
        ),
        (
            E::Bus(BusError::Backend(s("down"))),
            Unavailable,
            vec![s("down")],
        ),
        (
            E::Timeout {
                what: "merge",
                ms: 50,
            },
            Unavailable,
            vec![s("merge did not finish within 50 ms")],
        ),
        (E::Closed("root"), Unavailable, vec![s("its root stopped")]),
        (
            E::StoreOpen {
                dir: PathBuf::from("/d"),
                message: s("eio"),
            },
            Failure,
            vec![s("cannot open the run store in `/d`: eio")],
        ),
        (
            E::Store(sled::Error::Unsupported(s("x"))),
            Failure,
            vec![s("run store failed")],
        ),
        (
            E::codec("fork record", "truncated"),
            Failure,
            vec![s(
                "a stored fork record could not be read or written: truncated",
            )],
        ),
        (
            E::Wire(WireError::Version {
                found: 9,
                supported: 1,
            }),
            Failure,
            vec![s("wire version 9")],
        ),
        (
            E::Internal(s("broken")),
            Failure,
            vec![s("internal error: broken")],
        ),
    ];
    for (e, kind, words) in table {
        assert_eq!(e.kind(), kind, "{e:?}");
        assert_eq!(
            e.is_bad_input(),
            matches!(kind, BadInput | NotFound | Conflict),
            "{e:?}"
        );
        let text = e.to_string();
        for w in words {
            assert!(text.contains(&w), "`{w}` not in: {text}");
        }
    }
}

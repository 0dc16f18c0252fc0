//! The resolve module's tests: confidence formulas, verdict parsing, the bounded judge prompt
//! and the strategies' decisions.

use super::prompt::{allocate, truncate_chars};
use super::*;
use crate::state::BranchState;
use std::collections::BTreeMap;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

// --- confidence ---------------------------------------------------------------------------

#[test]
fn peer_v1_reproduces_the_agreement_defect() {
    // PEER.md: branches that agree, tests passing, full consistency, judge fully confident.
    let s = ConfidenceSignals::new(1.0, Some(1.0), 1.0);
    let c = ConfidenceFormula::PeerV1.effective(&s, 1.0);
    assert!(close(c, 0.60), "{c}");
    assert!(c < DEFAULT_THRESHOLD);
}

#[test]
fn peer_v1_formula_and_no_test_cap() {
    let s = ConfidenceSignals::new(0.0, Some(1.0), 1.0);
    assert!(close(ConfidenceFormula::PeerV1.heuristic(&s), 1.0));
    let s = ConfidenceSignals::new(0.5, Some(0.5), 0.5);
    assert!(close(
        ConfidenceFormula::PeerV1.heuristic(&s),
        0.2 + 0.2 + 0.1
    ));
    // No test signal: test term 0, capped at 0.65 (0.4 + 0.2 = 0.6 stays 0.6).
    let s = ConfidenceSignals::new(0.0, None, 1.0);
    assert!(close(ConfidenceFormula::PeerV1.heuristic(&s), 0.6));
    let s = ConfidenceSignals {
        agreement_score: 0.0,
        test_pass_ratio: None,
        internal_consistency: 1.0,
    };
    assert!(ConfidenceFormula::PeerV1.heuristic(&s) <= NO_TEST_CAP);
    assert!(close(ConfidenceFormula::PeerV1.effective(&s, 0.5), 0.3));
}

#[test]
fn evidence_agreeing_passing_confident_commits() {
    let s = ConfidenceSignals::new(1.0, Some(1.0), 1.0);
    let f = ConfidenceFormula::EvidenceV1;
    assert!(close(f.effective(&s, 1.0), 1.0));
    assert!(f.effective(&s, 0.85) >= DEFAULT_THRESHOLD);
    // The PEER.md case is fixed: agreement is not punished.
    assert!(f.effective(&s, 1.0) > ConfidenceFormula::PeerV1.effective(&s, 1.0));
    // Agreement raises the score; a full split only trims it.
    let split = ConfidenceSignals::new(0.0, Some(1.0), 1.0);
    assert!(f.effective(&split, 1.0) < f.effective(&s, 1.0));
    assert!(close(f.effective(&split, 1.0), 0.85));
}

#[test]
fn evidence_without_tests_stays_under_the_rail() {
    let f = ConfidenceFormula::EvidenceV1;
    for judge in [0.0, 0.3, 0.8, 1.0] {
        for agreement in [0.0, 0.5, 1.0] {
            for consistency in [0.0, 0.5, 1.0] {
                let s = ConfidenceSignals::new(agreement, None, consistency);
                let c = f.effective(&s, judge);
                assert!(c <= NO_TEST_CAP * judge + 1e-12, "{c}");
                assert!(c < DEFAULT_THRESHOLD);
            }
        }
    }
    let best = ConfidenceSignals::new(1.0, None, 1.0);
    assert!(close(f.effective(&best, 1.0), NO_TEST_CAP));
}

#[test]
fn evidence_failing_tests_score_low() {
    let f = ConfidenceFormula::EvidenceV1;
    let failing = ConfidenceSignals::new(1.0, Some(0.0), 1.0);
    assert!(close(f.effective(&failing, 1.0), 0.0));
    let half = ConfidenceSignals::new(1.0, Some(0.5), 1.0);
    assert!(f.effective(&half, 1.0) <= 0.5);
    // Failing is worse than no signal at all.
    let none = ConfidenceSignals::new(1.0, None, 1.0);
    assert!(f.effective(&failing, 1.0) < f.effective(&none, 1.0));
}

#[test]
fn evidence_judge_confidence_scales() {
    let f = ConfidenceFormula::EvidenceV1;
    let s = ConfidenceSignals::new(0.6, Some(0.9), 0.8);
    let h = f.heuristic(&s);
    assert!(close(h, 0.9 * (0.7 + 0.15 * 0.6 + 0.15 * 0.8)));
    for judge in [0.0, 0.25, 0.5, 1.0] {
        assert!(close(f.effective(&s, judge), h * judge));
    }
    assert!(f.effective(&s, 0.5) < f.effective(&s, 0.9));
}

#[test]
fn bad_inputs_are_clamped() {
    for f in [ConfidenceFormula::PeerV1, ConfidenceFormula::EvidenceV1] {
        let wild = ConfidenceSignals {
            agreement_score: 7.0,
            test_pass_ratio: Some(3.0),
            internal_consistency: -2.0,
        };
        for judge in [f64::NAN, -1.0, 0.5, 2.0, f64::INFINITY] {
            let c = f.effective(&wild, judge);
            assert!(c.is_finite() && (0.0..=1.0).contains(&c), "{f} {judge} {c}");
        }
        assert_eq!(f.effective(&wild, f64::NAN), 0.0);
        // A non-finite test ratio is no test signal: the rail holds.
        let nan_test = ConfidenceSignals::new(1.0, Some(f64::NAN), 1.0);
        assert!(f.effective(&nan_test, 1.0) <= NO_TEST_CAP);
        let inf_test = ConfidenceSignals::new(1.0, Some(f64::INFINITY), 1.0);
        assert!(f.effective(&inf_test, 1.0) <= NO_TEST_CAP);
    }
    // A NaN agreement counts as none (a full split), above 1 as full agreement.
    let split = ConfidenceSignals::new(0.0, None, 1.0);
    let nan = ConfidenceSignals::new(f64::NAN, None, 1.0);
    let full = ConfidenceSignals::new(1.0, None, 1.0);
    let over = ConfidenceSignals::new(1.5, None, 1.0);
    for f in [ConfidenceFormula::PeerV1, ConfidenceFormula::EvidenceV1] {
        assert_eq!(f.heuristic(&nan), f.heuristic(&split));
        assert_eq!(f.heuristic(&over), f.heuristic(&full));
    }
}

#[test]
fn internal_consistency_counts_retries_and_loops() {
    assert!(close(internal_consistency(0, 0, 0), 1.0));
    assert!(close(internal_consistency(1, 1, 8), 0.75));
    assert!(close(internal_consistency(5, 5, 2), 0.0));
    assert!(close(internal_consistency(1, 0, 0), 0.0));
}

#[test]
fn formula_serde_names() {
    let json = serde_json::to_string(&ConfidenceFormula::PeerV1).unwrap();
    assert_eq!(json, "\"peer_v1\"");
    let json = serde_json::to_string(&ConfidenceFormula::EvidenceV1).unwrap();
    assert_eq!(json, "\"evidence_v1\"");
    let f: ConfidenceFormula = serde_json::from_str("\"default\"").unwrap();
    assert_eq!(f, ConfidenceFormula::EvidenceV1);
    assert_eq!(ConfidenceFormula::default(), ConfidenceFormula::EvidenceV1);
    assert_eq!(ConfidenceFormula::PeerV1.to_string(), "peer_v1");
}

// --- verdict ------------------------------------------------------------------------------

const LABELS: [&str; 3] = ["concise", "thorough", "Risky"];

#[test]
fn parses_bare_fenced_and_prose_json() {
    let bare = r#"{"winner": "concise", "confidence": 0.9, "reasoning": "short", "notes": {"concise": "good"}}"#;
    let v = JudgeVerdict::parse(bare).unwrap();
    assert_eq!(v.winner, "concise");
    assert!(close(v.confidence, 0.9));
    assert_eq!(v.notes["concise"], "good");

    let fenced = format!("Here is my verdict:\n```json\n{bare}\n```\nThanks.");
    assert_eq!(JudgeVerdict::parse(&fenced).unwrap(), v);

    // Prose with braces that are not JSON, and braces inside JSON strings.
    let prose = r#"I compared {both} branches. {"winner": "thorough", "confidence": "0.7",
        "reasoning": "handles {edge} cases and \"quotes\" }", "notes": {"concise": ["a", 1], "thorough": null}}
        and that is all {"#;
    let v = JudgeVerdict::parse(prose).unwrap();
    assert_eq!(v.winner, "thorough");
    assert!(close(v.confidence, 0.7));
    assert_eq!(v.reasoning, "handles {edge} cases and \"quotes\" }");
    assert_eq!(
        v.notes.get("concise").map(String::as_str),
        Some("[\"a\",1]")
    );
    assert!(!v.notes.contains_key("thorough"));

    // Missing reasoning and notes default to empty.
    let v = JudgeVerdict::parse(r#"{"winner":"concise","confidence":1}"#).unwrap();
    assert!(v.reasoning.is_empty() && v.notes.is_empty());
}

#[test]
fn parse_skips_objects_that_are_not_verdicts() {
    let text = r#"Schema: {"type": "object"}. Answer: {"winner": "concise", "confidence": 0.5}"#;
    assert_eq!(JudgeVerdict::parse(text).unwrap().winner, "concise");
    // A verdict nested inside a wrapper object is found too.
    let text = r#"{"verdict": {"winner": "concise", "confidence": 0.5}}"#;
    assert_eq!(JudgeVerdict::parse(text).unwrap().winner, "concise");
}

#[test]
fn malformed_answers() {
    for text in [
        "",
        "I pick concise.",
        "{\"winner\": \"concise\"",
        "{\"winner\": \"concise\"}",
        "{\"winner\": \"concise\", \"confidence\": \"high\"}",
        "[{\"winner\": \"concise\", \"confidence\": 0.5}]xx{",
    ] {
        match JudgeVerdict::parse(text) {
            Err(VerdictError::Malformed(_)) => {}
            // A JSON array's inner object is still a balanced object and a verdict.
            Ok(v) if text.starts_with('[') => assert_eq!(v.winner, "concise"),
            other => panic!("{text:?}: {other:?}"),
        }
    }
    let err = JudgeVerdict::parse("{\"winner\": 3, \"confidence\": 0.5}").unwrap_err();
    assert!(matches!(err, VerdictError::Malformed(_)));
}

#[test]
fn validate_rejects_an_unknown_winner_and_lists_the_labels() {
    let v = JudgeVerdict {
        winner: "bold".into(),
        confidence: 0.9,
        reasoning: String::new(),
        notes: BTreeMap::new(),
    };
    let err = validate(v, &LABELS).unwrap_err();
    assert_eq!(
        err,
        VerdictError::UnknownWinner {
            winner: "bold".into(),
            valid: LABELS.iter().map(|l| l.to_string()).collect(),
        }
    );
    let msg = err.to_string();
    assert!(msg.contains("\"bold\""), "{msg}");
    for l in LABELS {
        assert!(msg.contains(&format!("\"{l}\"")), "{msg}");
    }
    // The end-to-end form: a judge naming a non-existent branch.
    let err = parse_verdict(r#"{"winner": "branch-9", "confidence": 1.0}"#, &LABELS);
    assert!(matches!(err, Err(VerdictError::UnknownWinner { .. })));
}

#[test]
fn validate_normalises_labels_and_drops_unknown_notes() {
    let text = r#"{"winner": " RISKY ", "confidence": 0.4, "reasoning": "r",
        "notes": {"concise": "ok", "Concise": "dup", "risky": "bold", "ghost": "x"}}"#;
    let v = parse_verdict(text, &LABELS).unwrap();
    assert_eq!(v.winner, "Risky");
    let keys: Vec<&str> = v.notes.keys().map(String::as_str).collect();
    assert_eq!(keys, ["Risky", "concise"]);
    assert_eq!(v.notes["concise"], "ok");
    assert_eq!(v.notes["Risky"], "bold");
    // Case-insensitive matching only when it is unambiguous.
    let v = |winner: &str| JudgeVerdict {
        winner: winner.into(),
        confidence: 0.5,
        reasoning: String::new(),
        notes: BTreeMap::new(),
    };
    assert_eq!(validate(v("A"), &["a", "b"]).unwrap().winner, "a");
    assert_eq!(validate(v("ab"), &["AB", "ab"]).unwrap().winner, "ab");
    assert!(matches!(
        validate(v("Ab"), &["AB", "ab"]),
        Err(VerdictError::UnknownWinner { .. })
    ));
}

#[test]
fn validate_rejects_out_of_range_confidence() {
    for c in [-0.1, 1.01, 85.0, f64::NAN, f64::INFINITY] {
        let v = JudgeVerdict {
            winner: "concise".into(),
            confidence: c,
            reasoning: String::new(),
            notes: BTreeMap::new(),
        };
        assert!(
            matches!(
                validate(v, &LABELS),
                Err(VerdictError::InvalidConfidence { .. })
            ),
            "{c}"
        );
    }
    for c in [0.0, 1.0] {
        let v = JudgeVerdict {
            winner: "concise".into(),
            confidence: c,
            reasoning: String::new(),
            notes: BTreeMap::new(),
        };
        assert!(validate(v, &LABELS).is_ok());
    }
}

// --- prompt -------------------------------------------------------------------------------

fn outcome(label: &str, message: &str) -> BranchOutcome {
    BranchOutcome {
        steer: None,
        label: label.into(),
        state: BranchState::Done,
        final_message: Some(message.into()),
        cost_usd: 0.0123,
        turns: 4,
        error: None,
        test: Some("12 passed, 0 failed".into()),
    }
}

#[test]
fn small_prompt_is_whole() {
    let mut outcomes = vec![
        outcome("concise", "Done.\nTwo lines."),
        outcome("thorough", ""),
    ];
    outcomes[1].state = BranchState::BudgetExhausted;
    outcomes[1].error = Some("budget cap reached".into());
    outcomes[1].test = None;
    outcomes[1].turns = 1;
    let p = judge_prompt("Fix the parser", "2 branches · 1 path touched", &outcomes);
    assert!(p.contains("## Goal\nFix the parser\n"));
    assert!(p.contains("## Diff report\n2 branches · 1 path touched\n"));
    assert!(p.contains("- branch \"concise\": done · cost $0.0123 · 4 turns"));
    assert!(p.contains("    Done.\n    Two lines."));
    assert!(p.contains("- branch \"thorough\": budget_exhausted · cost $0.0123 · 1 turn\n"));
    assert!(p.contains("  tests: no test signal"));
    assert!(p.contains("  error: budget cap reached"));
    assert!(p.contains("must be exactly one of these labels: \"concise\", \"thorough\"."));
    assert!(!p.contains("truncated"));
}

#[test]
fn huge_diff_is_truncated_and_every_branch_survives() {
    // Multi-byte characters everywhere: the cut must count characters, not bytes.
    let diff: String = "é日本語 line of a very large diff 🦀\n".repeat(20_000);
    let goal = "Make the tests pass ✓. ".repeat(2_000);
    let outcomes: Vec<BranchOutcome> = (0..10)
        .map(|i| {
            let mut o = outcome(
                &format!("branch-{i}"),
                &"ünïcode final words ".repeat(5_000),
            );
            if i == 3 {
                o.error = Some("boom: the worker crashed".into());
            }
            o
        })
        .collect();
    let p = judge_prompt(&goal, &diff, &outcomes);
    let n = p.chars().count();
    assert!(n <= MAX_JUDGE_PROMPT_CHARS, "{n}");
    assert!(n > MAX_JUDGE_PROMPT_CHARS - 500, "budget left unused: {n}");
    assert!(p.contains("[... truncated "));
    for o in &outcomes {
        assert!(
            p.contains(&format!("- branch \"{}\": done", o.label)),
            "{}",
            o.label
        );
    }
    // Short details are not crowded out by long ones.
    assert!(p.contains("  error: boom: the worker crashed"));
    assert_eq!(p.matches("  tests: 12 passed, 0 failed").count(), 10);
    // Each section keeps a share: goal, diff and the outcomes all appear and are cut.
    let diff_part = &p[p.find("## Diff report").unwrap()..p.find("## Branch outcomes").unwrap()];
    assert!(
        diff_part.chars().count() > 8_000,
        "{}",
        diff_part.chars().count()
    );
    let outcome_part =
        &p[p.find("## Branch outcomes").unwrap()..p.find("## Your verdict").unwrap()];
    assert!(outcome_part.chars().count() > 8_000);
    assert!(p.ends_with("the winner is the best branch."));
}

#[test]
fn short_sections_leave_their_budget_to_the_others() {
    let diff = "§".repeat(100_000);
    let p = judge_prompt("goal", &diff, &[outcome("a", "ok")]);
    assert!(p.chars().count() <= MAX_JUDGE_PROMPT_CHARS);
    // Goal and outcomes are tiny, so the diff gets nearly all of the budget.
    let kept = p.matches('§').count();
    assert!(kept > 29_000, "{kept}");
    let marker = format!("[... truncated {} characters ...]", 100_000 - kept);
    assert!(p.contains(&marker), "{marker}");
}

#[test]
fn absurd_labels_still_bound_the_prompt() {
    let outcomes: Vec<BranchOutcome> = (0..4)
        .map(|i| outcome(&format!("{i}{}", "l".repeat(20_000)), "m"))
        .collect();
    let p = judge_prompt("g", "d", &outcomes);
    assert!(p.chars().count() <= MAX_JUDGE_PROMPT_CHARS);
    assert!(p.contains("[... truncated "));
    let p = judge_prompt("", "", &[]);
    assert!(p.contains("(no goal given)") && p.contains("(no changes)"));
    assert!(p.contains("(no branches)"));
}

#[test]
fn truncation_counts_characters_and_prefers_line_ends() {
    let text = "日本語".repeat(100);
    let t = truncate_chars(&text, 100);
    assert!(t.chars().count() <= 100);
    assert!(t.starts_with("日本語"));
    let kept = t.lines().next().unwrap().chars().count();
    assert!(t.ends_with(&format!("[... truncated {} characters ...]", 300 - kept)));

    let lines = "0123456789\n".repeat(100);
    let t = truncate_chars(&lines, 200);
    assert!(t.chars().count() <= 200);
    assert!(t
        .lines()
        .all(|l| l == "0123456789" || l.starts_with("[... truncated")));

    assert_eq!(truncate_chars("short", 5), "short");
    assert_eq!(truncate_chars("longer text", 6), "[...]");
    assert_eq!(truncate_chars("longer text", 3), "");
}

#[test]
fn allocate_water_fills() {
    assert_eq!(allocate(&[10, 10, 10], &[1, 3, 2], 100), [10, 10, 10]);
    assert_eq!(allocate(&[10, 1000, 1000], &[1, 3, 2], 610), [10, 360, 240]);
    assert_eq!(allocate(&[1000, 1000], &[1, 1], 100), [50, 50]);
    assert_eq!(allocate(&[], &[], 100), Vec::<usize>::new());
    let caps = allocate(&[5, 500, 50, 5000], &[1, 1, 1, 1], 1000);
    assert_eq!(caps, [5, 472, 50, 472]);
    assert!(caps.iter().sum::<usize>() <= 1000);
}

// --- strategies ---------------------------------------------------------------------------

fn verdict(winner: &str, confidence: f64) -> JudgeVerdict {
    JudgeVerdict {
        winner: winner.into(),
        confidence,
        reasoning: String::new(),
        notes: BTreeMap::new(),
    }
}

#[test]
fn manual_never_uses_a_judge() {
    assert!(!Strategy::Manual.needs_judge());
    assert_eq!(decide(&Strategy::Manual, &[]), Decision::Manual);
    assert_eq!(
        decide(&Strategy::Manual, &[(verdict("a", 1.0), 1.0)]),
        Decision::Manual
    );
}

#[test]
fn auto_commits_at_once() {
    assert!(Strategy::Auto.needs_judge());
    assert_eq!(
        decide(&Strategy::Auto, &[(verdict("a", 0.2), 0.1)]),
        Decision::Commit {
            winner: "a".into(),
            confidence: 0.1
        }
    );
    assert_eq!(decide(&Strategy::Auto, &[]), Decision::Manual);
}

#[test]
fn auto_with_fallback_commits_at_the_threshold_else_defers() {
    assert_eq!(Strategy::default(), Strategy::Manual);
    let s = Strategy::AutoWithFallback {
        threshold: DEFAULT_THRESHOLD,
    };
    assert_eq!(
        decide(&s, &[(verdict("a", 1.0), 0.80)]),
        Decision::Commit {
            winner: "a".into(),
            confidence: 0.80
        }
    );
    assert_eq!(
        decide(&s, &[(verdict("a", 1.0), 0.7999)]),
        Decision::Defer {
            pick: "a".into(),
            confidence: 0.7999
        }
    );
    assert!(matches!(
        decide(&s, &[(verdict("a", 1.0), f64::NAN)]),
        Decision::Defer { .. }
    ));
    assert_eq!(decide(&s, &[]), Decision::Manual);

    // PEER.md's case end to end: peer_v1 defers, the default commits.
    let signals = ConfidenceSignals::new(1.0, Some(1.0), 1.0);
    let peer = ConfidenceFormula::PeerV1.effective(&signals, 1.0);
    let ours = ConfidenceFormula::EvidenceV1.effective(&signals, 1.0);
    assert!(matches!(
        decide(&s, &[(verdict("a", 1.0), peer)]),
        Decision::Defer { .. }
    ));
    assert!(matches!(
        decide(&s, &[(verdict("a", 1.0), ours)]),
        Decision::Commit { .. }
    ));
    // Without tests the default never commits at 0.80, however confident the judge.
    let untested = ConfidenceSignals::new(1.0, None, 1.0);
    let c = ConfidenceFormula::EvidenceV1.effective(&untested, 1.0);
    assert!(matches!(
        decide(&s, &[(verdict("a", 1.0), c)]),
        Decision::Defer { .. }
    ));
}

#[test]
fn vote_takes_the_majority() {
    let s = Strategy::Vote;
    let d = decide(
        &s,
        &[
            (verdict("a", 0.9), 0.9),
            (verdict("b", 0.5), 0.5),
            (verdict("b", 0.7), 0.7),
        ],
    );
    match d {
        Decision::Commit { winner, confidence } => {
            assert_eq!(winner, "b");
            assert!(close(confidence, 0.6));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(decide(&s, &[]), Decision::Manual);
}

#[test]
fn vote_tie_goes_to_the_highest_confidence() {
    let s = Strategy::Vote;
    let d = decide(
        &s,
        &[
            (verdict("a", 0.6), 0.6),
            (verdict("b", 0.95), 0.95),
            (verdict("c", 0.7), 0.7),
        ],
    );
    assert_eq!(
        d,
        Decision::Commit {
            winner: "b".into(),
            confidence: 0.95
        }
    );
    // Two-two tie: the pair holding the single most confident verdict wins.
    let d = decide(
        &s,
        &[
            (verdict("a", 0.8), 0.8),
            (verdict("a", 0.8), 0.8),
            (verdict("b", 0.3), 0.3),
            (verdict("b", 0.9), 0.9),
        ],
    );
    assert!(matches!(d, Decision::Commit { ref winner, .. } if winner == "b"));
    // Equal confidences too: the first named wins.
    let d = decide(&s, &[(verdict("x", 0.5), 0.5), (verdict("y", 0.5), 0.5)]);
    assert!(matches!(d, Decision::Commit { ref winner, .. } if winner == "x"));
}

#[test]
fn strategy_serde_and_validation() {
    let s: Strategy = serde_json::from_str(r#"{"kind": "auto_with_fallback"}"#).unwrap();
    assert_eq!(s, Strategy::AutoWithFallback { threshold: 0.80 });
    let s: Strategy = serde_json::from_str(r#"{"kind": "vote"}"#).unwrap();
    assert_eq!(s.as_str(), "vote");
    assert!(s.validate().is_ok());
    let s: Strategy = toml::from_str("kind = \"manual\"").unwrap();
    assert_eq!(s, Strategy::Manual);
    assert_eq!(
        serde_json::to_value(Strategy::AutoWithFallback { threshold: 0.9 }).unwrap(),
        serde_json::json!({"kind": "auto_with_fallback", "threshold": 0.9})
    );
    assert_eq!(
        Strategy::AutoWithFallback { threshold: 1.5 }.validate(),
        Err(StrategyError::Threshold(1.5))
    );
    assert_eq!(
        serde_json::to_value(Decision::Defer {
            pick: "a".into(),
            confidence: 0.5
        })
        .unwrap(),
        serde_json::json!({"kind": "defer", "pick": "a", "confidence": 0.5})
    );
}

#[test]
fn the_prompt_says_what_each_branch_was_asked() {
    let mut a = outcome("a", "done");
    a.steer = Some("keep it short".into());
    let p = judge_prompt("g", "", &[a, outcome("b", "done too")]);
    assert!(p.contains("  steer: keep it short"), "{p}");
    assert_eq!(p.matches("steer:").count(), 1, "{p}");
}

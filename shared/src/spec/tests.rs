//! The spec loader's tests: specs as written, through [`validate`] and [`validate_with`].

use super::*;
use crate::budget::{BudgetMode, BudgetPolicy, OnExhausted};
use crate::pricing::Price;
use crate::resolve::{ConfidenceFormula, Strategy};
use std::collections::BTreeMap;

fn parse(s: &str) -> Result<ForkPlan, SpecError> {
    let f: SpecFile = toml::from_str(s).map_err(|e| SpecError::Toml {
        path: "t".into(),
        message: e.to_string(),
    })?;
    validate(&f, 0)
}

/// A spec with `top` keys, the demo model (with `model` extra keys) and `rest`.
fn spec(top: &str, model: &str, rest: &str) -> String {
    format!("goal = \"g\"\nworkspace = \"w\"\nmodel = \"scripted:demo\"\n{top}\n[models.\"scripted:demo\"]\nscript = \"s.toml\"\n{model}\n{rest}")
}

#[test]
fn labels_absent_and_duplicates() {
    let p = parse(&spec(
        "",
        "",
        "[[branches]]\nsteer = \"a\"\n[[branches]]\nlabel = \"x\"\n[[branches]]\nlabel = \"x\"\n[[branches]]\nsteer = \"b\"\n[[branches]]\nlabel = \"x\"",
    ))
    .unwrap();
    let labels: Vec<_> = p.branches.iter().map(|b| b.label.as_str()).collect();
    assert_eq!(labels, ["branch-1", "x", "x-2", "branch-4", "x-3"]);
}

/// An absent label defaults to `branch-N`; one given empty (or blank) is bad input that
/// names the branch, not a silent default.
#[test]
fn an_empty_label_is_refused_with_its_position() {
    for blank in ["\"\"", "\" \""] {
        let err = parse(&spec(
            "",
            "",
            &format!("[[branches]]\nlabel = \"a\"\n[[branches]]\nlabel = {blank}"),
        ))
        .unwrap_err();
        assert!(matches!(err, SpecError::EmptyLabel { index: 1 }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("`branches[1].label` is empty"), "{text}");
        assert!(text.contains("branch-2"), "{text}");
    }
}

#[test]
fn checkpoint_keys_default_and_are_validated() {
    let b = "[[branches]]\nsteer = \"a\"";
    let p = parse(&spec("", "", b)).unwrap();
    assert_eq!(p.limits.checkpoints, CheckpointPolicy::default());
    assert_eq!(
        p.limits.checkpoints.frequency,
        CheckpointFrequency::EveryTool
    );
    assert_eq!(p.limits.checkpoints.max_checkpoints, 20);
    let p = parse(&spec(
        "checkpoints = \"every_turn\"\nmax_checkpoints = 3",
        "",
        b,
    ))
    .unwrap();
    assert_eq!(
        p.limits.checkpoints,
        CheckpointPolicy {
            frequency: CheckpointFrequency::EveryTurn,
            max_checkpoints: 3
        }
    );
    let err = parse(&spec("checkpoints = \"sometimes\"", "", b)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("`checkpoints`") && msg.contains("sometimes"),
        "{msg}"
    );
    assert!(msg.contains("every_turn, every_tool, manual_only"), "{msg}");
    for bad in ["0", "-3"] {
        let err = parse(&spec(&format!("max_checkpoints = {bad}"), "", b)).unwrap_err();
        assert!(err.to_string().contains("`max_checkpoints`"), "{err}");
    }
    // Branches are checked first (the documented order).
    assert!(matches!(
        parse(&spec("max_checkpoints = 0\nmax_branches = 0", "", "")),
        Err(SpecError::TooManyBranches { .. })
    ));
    // A plan stored before the keys existed has no automatic checkpoints.
    let limits: Limits = serde_json::from_str(
        r#"{"max_branches": 1, "max_depth": 2, "max_turns": 3, "max_output_tokens": 4}"#,
    )
    .unwrap();
    assert_eq!(
        limits.checkpoints.frequency,
        CheckpointFrequency::ManualOnly
    );
}

#[test]
fn real_models_take_endpoints_and_tools_are_enabled_per_spec() {
    let text = "goal = \"g\"\nworkspace = \"w\"\nmodel = \"openai:gpt-4o-mini\"\nforking = true\n\
        [run_command]\ntimeout_s = 5\nenv = { A = \"1\" }\n\
        [models.\"openai:gpt-4o-mini\"]\nbase_url = \"http://127.0.0.1:9/v1\"\nmax_retries = 2\n\
        [[branches]]\nlabel = \"a\"\nmax_output_tokens = 7\n";
    let p = parse(text).unwrap();
    let m = &p.models["openai:gpt-4o-mini"];
    let e = m.endpoint.as_ref().unwrap();
    assert_eq!(e.base_url.as_deref(), Some("http://127.0.0.1:9/v1"));
    assert_eq!(e.api_key_env, None);
    assert_eq!(e.max_retries, Some(2));
    assert!(p.tools.forking && !p.solo);
    let tool = p.tools.run_command.as_ref().unwrap();
    assert_eq!(tool.timeout_s, 5.0);
    assert_eq!(tool.env["A"], "1");
    assert_eq!(p.branches[0].max_output_tokens, Some(7));

    let err = parse(&text.replace("max_output_tokens = 7", "max_output_tokens = 0")).unwrap_err();
    assert!(
        err.to_string().contains("branches[0].max_output_tokens"),
        "{err}"
    );
    let err = parse(&text.replace("http://127.0.0.1:9/v1", "127.0.0.1")).unwrap_err();
    assert!(err.to_string().contains("base_url"), "{err}");
    let err = parse(&text.replace("timeout_s = 5", "timeout_s = -5")).unwrap_err();
    assert!(err.to_string().contains("[run_command]"), "{err}");
    // A scripted model takes no endpoint.
    let err = parse(&spec("", "base_url = \"http://x\"", "[[branches]]")).unwrap_err();
    assert!(
        err.to_string().contains("scripted model takes only"),
        "{err}"
    );
}

#[test]
fn model_call_settings_are_per_model_and_checked() {
    let text = "goal = \"g\"\nworkspace = \"w\"\nmodel = \"openai:o4-mini\"\non_truncated = \"stop\"\n\
        [models.\"openai:o4-mini\"]\nreasoning_effort = \"low\"\napi = \"responses\"\ncache = \"off\"\nstream = false\n\
        [models.\"anthropic:claude-sonnet-4-5\"]\nthinking_budget = 2048\nspare = true\n\
        [models.\"openai:local\"]\nbase_url = \"http://127.0.0.1:8080/v1\"\ntoken_param = \"max_tokens\"\nspare = true\n\
        [[branches]]\nlabel = \"a\"\n";
    let p = parse(text).unwrap();
    assert_eq!(p.limits.on_truncated, OnTruncated::Stop);
    let o4 = p.models["openai:o4-mini"].endpoint.clone().unwrap();
    assert_eq!(o4.reasoning_effort.as_deref(), Some("low"));
    assert_eq!(o4.api, Some(crate::endpoint::OpenAiApi::Responses));
    assert!(!o4.caches() && !o4.streams());
    let claude = p.models["anthropic:claude-sonnet-4-5"]
        .endpoint
        .clone()
        .unwrap();
    assert_eq!(claude.thinking_budget, Some(2048));
    assert!(claude.caches() && claude.streams());
    // The built-in price has the cache rates.
    let price = p.models["anthropic:claude-sonnet-4-5"].price.unwrap();
    assert_eq!(price.cache_write_per_mtok, Some(3.75));
    let local = p.models["openai:local"].endpoint.clone().unwrap();
    assert_eq!(
        local.token_param,
        Some(crate::endpoint::TokenParam::MaxTokens)
    );
    // Not given: continue.
    let p = parse(&text.replace("on_truncated = \"stop\"\n", "")).unwrap();
    assert_eq!(p.limits.on_truncated, OnTruncated::Continue);

    for (from, to, says) in [
        (
            "reasoning_effort = \"low\"",
            "reasoning_effort = \"extreme\"",
            "reasoning_effort is `extreme`; valid: minimal, low, medium, high",
        ),
        (
            "thinking_budget = 2048",
            "thinking_budget = 100",
            "thinking_budget is 100; it must be at least 1024",
        ),
        (
            "reasoning_effort = \"low\"",
            "thinking_budget = 4096",
            "thinking_budget is for anthropic: models; a openai: model does not take it",
        ),
        (
            "thinking_budget = 2048",
            "reasoning_effort = \"high\"",
            "reasoning_effort is for openai: models",
        ),
        (
            "token_param = \"max_tokens\"",
            "token_param = \"max_tokens\"\napi = \"responses\"",
            "token_param is for api = \"chat\"",
        ),
    ] {
        let err = parse(&text.replace(from, to)).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
    for (from, to, says) in [
        ("api = \"responses\"", "api = \"completions\"", "chat"),
        ("cache = \"off\"", "cache = \"on\"", "auto"),
        (
            "on_truncated = \"stop\"",
            "on_truncated = \"ignore\"",
            "continue",
        ),
        ("stream = false", "streaming = false", "stream"),
    ] {
        let err = parse(&text.replace(from, to)).unwrap_err().to_string();
        // The bad value or key is named with what is valid.
        let bad = to.split(' ').next().unwrap().trim_matches('"');
        let bad_value = to.rsplit(' ').next().unwrap().trim_matches('"');
        assert!(
            err.contains(says) && (err.contains(bad) || err.contains(bad_value)),
            "{err}"
        );
    }
    // A scripted model takes none of them.
    let err = parse(&spec("", "cache = \"off\"", "[[branches]]")).unwrap_err();
    assert!(
        err.to_string().contains("scripted model takes only"),
        "{err}"
    );
}

#[test]
fn a_spec_never_names_a_key_source() {
    let text = "goal = \"g\"\nworkspace = \"w\"\nmodel = \"openai:gpt-4o\"\n\
        [models.\"openai:gpt-4o\"]\nbase_url = \"http://127.0.0.1:9/v1\"\nKEY\n[[branches]]\n";
    for (line, field) in [
        ("api_key_env = \"OPENAI_API_KEY\"", "api_key_env"),
        (
            "api_key_file = \"/run/secrets/nats-password\"",
            "api_key_file",
        ),
    ] {
        let err = parse(&text.replace("KEY", line)).unwrap_err().to_string();
        for says in [
            "[models.\"openai:gpt-4o\"]",
            &format!("{field} is not allowed in a spec"),
            "key sources belong to the workers' catalogue",
            "define model `openai:gpt-4o` in the worker's config `[models.\"openai:gpt-4o\"]`",
        ] {
            assert!(err.contains(says), "{says:?} not in {err}");
        }
    }
    // Without a key source the spec's own base_url is fine (the workers' allow-list decides).
    parse(&text.replace("KEY", "")).unwrap();
}

#[test]
fn unknown_key_lists_valid_keys() {
    let err = parse(&spec("colour = 1", "", "[[branches]]\nsteer = \"a\"")).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("unknown field `colour`"), "{msg}");
    assert!(
        msg.contains("goal") && msg.contains("max_branches"),
        "{msg}"
    );
    let err = parse(&spec("", "", "[[branches]]\nsteer = \"a\"\nbudget = 1")).unwrap_err();
    assert!(err.to_string().contains("budget_usd"), "{err}");
}

#[test]
fn validation_order_and_limits() {
    // No branches: a root run of one agent, unless there is no goal either.
    let solo = parse(&spec("", "", "")).unwrap();
    assert!(solo.solo);
    assert_eq!(solo.branches.len(), 1);
    assert_eq!(solo.branches[0].label, SOLO_LABEL);
    assert_eq!(solo.branches[0].steer, "");
    assert!(matches!(
        parse(&spec("", "", "").replace("goal = \"g\"", "goal = \" \"")),
        Err(SpecError::NoBranches)
    ));
    let many = spec("max_branches = 2", "", &"[[branches]]\n".repeat(3));
    assert!(matches!(
        parse(&many),
        Err(SpecError::TooManyBranches {
            requested: 3,
            max: 2
        })
    ));
    assert!(matches!(
        check_depth(2, 2),
        Err(SpecError::DepthExceeded { .. })
    ));
    assert!(check_depth(1, 2).is_ok());
}

#[test]
fn bad_labels_budgets_models() {
    for l in ["../../x", "a/b", ".hidden", "a b"] {
        let err = parse(&spec("", "", &format!("[[branches]]\nlabel = \"{l}\""))).unwrap_err();
        assert!(matches!(err, SpecError::BadLabel { .. }), "{l}: {err}");
    }
    let err = parse(&spec("", "", "[[branches]]\nbudget_usd = -1.0")).unwrap_err();
    assert!(matches!(err, SpecError::BadBudget { .. }), "{err}");
    let err = parse("goal = \"g\"\nworkspace = \"w\"\nmodel = \"gpt\"\n[[branches]]").unwrap_err();
    assert!(matches!(err, SpecError::BadModelName { .. }), "{err}");
    let err =
        parse("goal = \"g\"\nworkspace = \"w\"\nmodel = \"nope:x\"\n[[branches]]").unwrap_err();
    assert!(
        err.to_string().contains("valid providers: scripted"),
        "{err}"
    );
    let err =
        parse("goal = \"g\"\nworkspace = \"w\"\nmodel = \"scripted:x\"\n[[branches]]").unwrap_err();
    assert!(matches!(err, SpecError::NoScript { .. }), "{err}");
}

#[test]
fn budget_policy_and_accounts() {
    let plan = parse(&spec(
        "account = \"team-a\"\nbudget_mode = \"best_effort\"\non_exhausted = \"pause\"",
        "price = { input_per_mtok = 1.0, output_per_mtok = 2.0 }",
        "[[branches]]",
    ))
    .unwrap();
    assert_eq!(plan.budget.account.as_deref(), Some("team-a"));
    assert_eq!(plan.budget.mode, BudgetMode::BestEffort);
    assert_eq!(plan.budget.on_exhausted, OnExhausted::Pause);
    let plan = parse(&spec("", "", "[[branches]]")).unwrap();
    assert_eq!(plan.budget, BudgetPolicy::default());
    let err = parse(&spec("account = \"../x\"", "", "[[branches]]")).unwrap_err();
    assert!(err.to_string().contains("account name `../x`"), "{err}");
    let err = parse(&spec("budget_mode = \"loose\"", "", "[[branches]]")).unwrap_err();
    assert!(err.to_string().contains("strict"), "{err}");
    // An account needs priced models, like any cap.
    let err = parse(&spec("account = \"team-a\"", "", "[[branches]]")).unwrap_err();
    assert!(err.to_string().contains("`account` sets a budget"), "{err}");
}

#[test]
fn resolve_settings_are_validated() {
    let plan = parse(&spec("", "", "[[branches]]")).unwrap();
    assert_eq!(plan.resolve, ResolvePlan::default());
    assert_eq!(plan.resolve.strategy, Strategy::Manual);
    let judge = "[models.\"scripted:judge\"]\nscript = \"j.toml\"";
    let plan = parse(&spec(
        "strategy = \"auto_with_fallback\"\nconfidence_threshold = 0.7\njudge_model = \"scripted:judge\"\ntest_command = \"pytest -q 'tests/a b.py'\"\ntest_timeout_s = 30\ntest_env = { PYTHONHASHSEED = \"0\" }\nconfidence_formula = \"peer_v1\"\nkeep_artifacts = true",
        "",
        &format!("{judge}\n[[branches]]"),
    ))
    .unwrap();
    assert_eq!(
        plan.resolve.strategy,
        Strategy::AutoWithFallback { threshold: 0.7 }
    );
    assert_eq!(
        plan.resolve.judge_models,
        vec!["scripted:judge".to_string()]
    );
    assert!(plan.models.contains_key("scripted:judge"));
    let test = plan.resolve.test.as_ref().unwrap();
    assert_eq!(test.argv, vec!["pytest", "-q", "tests/a b.py"]);
    assert_eq!(test.timeout_s, 30.0);
    assert_eq!(plan.resolve.confidence_formula, ConfidenceFormula::PeerV1);
    assert!(plan.resolve.keep_artifacts);
    let vote = parse(&spec(
        "strategy = \"vote\"\njudge_models = [\"scripted:judge\", \"scripted:judge\"]\ntest_command = [\"cargo\", \"test\"]",
        "",
        &format!("{judge}\n[[branches]]"),
    ))
    .unwrap();
    assert_eq!(vote.resolve.strategy, Strategy::Vote);
    assert_eq!(vote.resolve.judge_models.len(), 2);
    for (top, needle) in [
        ("strategy = \"best\"", "valid: manual, auto"),
        ("strategy = \"auto\"", "needs a judge"),
        ("strategy = \"vote\"", "at least one judge model"),
        ("strategy = \"vote\"\njudge_model = \"scripted:judge\"", "judge_models = [...]"),
        ("judge_model = \"scripted:judge\"\njudge_models = [\"scripted:judge\"]", "not both"),
        ("test_command = \"pytest\"\ntest_timeout_s = 7200", "at most 3600"),
        ("confidence_threshold = 0.5", "only `auto_with_fallback`"),
        ("strategy = \"auto_with_fallback\"\njudge_model = \"scripted:judge\"\nconfidence_threshold = 1.5", "not a number in [0, 1]"),
        ("test_command = \"\"", "the command is empty"),
        ("test_command = \"pytest 'unclosed\"", "unterminated single quote"),
        ("test_command = \"pytest\"\ntest_timeout_s = 0", "above 0"),
        ("test_timeout_s = 5", "need a `test_command`"),
        ("test_command = \"x\"\ntest_env = { \"1BAD\" = \"v\" }", "not a variable name"),
        ("strategy = \"auto\"\njudge_model = \"nope:judge\"", "unknown provider"),
    ] {
        let err = parse(&spec(top, "", &format!("{judge}\n[[branches]]")))
            .or_else(|e| {
                // Without a judge using it, the judge's model section is unused: try
                // without it so the error under test is the one reported.
                if matches!(e, SpecError::UnusedModel { .. }) {
                    parse(&spec(top, "", "[[branches]]"))
                } else {
                    Err(e)
                }
            })
            .unwrap_err();
        assert!(err.to_string().contains(needle), "{top}: {err}");
    }
}

#[test]
fn words_split_like_a_shell_without_one() {
    assert_eq!(
        split_words(r#"cargo test -- --exact "a b" 'c d' e\ f"#).unwrap(),
        vec!["cargo", "test", "--", "--exact", "a b", "c d", "e f"]
    );
    assert_eq!(split_words("  ").unwrap(), Vec::<String>::new());
    assert_eq!(split_words("a ''").unwrap(), vec!["a", ""]);
    assert_eq!(split_words(r#""$HOME""#).unwrap(), vec!["$HOME"]);
    assert!(split_words("a\\").is_err());
    assert!(split_words("\"open").is_err());
}

#[test]
fn config_prices_fill_in_after_the_spec() {
    let f: SpecFile =
        toml::from_str(&spec("aggregate_budget_usd = 1.0", "", "[[branches]]")).unwrap();
    let mut prices = BTreeMap::new();
    prices.insert(
        "scripted:demo".to_string(),
        Price {
            input_per_mtok: 1.0,
            output_per_mtok: 2.0,
            cached_per_mtok: None,
            cache_write_per_mtok: None,
        },
    );
    let plan = validate_with(&f, 0, &prices).unwrap();
    assert_eq!(
        plan.models["scripted:demo"]
            .price
            .map(|p| p.output_per_mtok),
        Some(2.0)
    );
    assert!(validate(&f, 0).is_err());
}

#[test]
fn budget_needs_a_price() {
    let err = parse(&spec("aggregate_budget_usd = 1.0", "", "[[branches]]")).unwrap_err();
    assert!(matches!(err, SpecError::NoPrice { .. }), "{err}");
    assert!(err.to_string().contains("scripted:demo"));
    let ok = parse(&spec(
        "aggregate_budget_usd = 1.0",
        "price = { input_per_mtok = 1.0, output_per_mtok = 2.0 }",
        "[[branches]]",
    ));
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn a_branch_budget_from_the_top_level_key_is_named_by_it() {
    let err = parse(&spec("budget_usd = 1.0", "", "[[branches]]")).unwrap_err();
    assert!(
        matches!(err, SpecError::NoPrice { ref field, .. } if field == "budget_usd"),
        "{err}"
    );
    let err = parse(&spec(
        "budget_usd = 1.0",
        "",
        "[[branches]]\n[[branches]]\nbudget_usd = 2.0",
    ))
    .unwrap_err();
    // The first branch inherits the top-level budget.
    assert!(
        err.to_string().contains("`budget_usd` sets a budget"),
        "{err}"
    );
    let err = parse(&spec(
        "",
        "",
        "[[branches]]\n[[branches]]\nbudget_usd = 2.0",
    ))
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("`branches[1].budget_usd` sets a budget"),
        "{err}"
    );
    let err = parse(&spec("budget_usd = -1.0", "", "[[branches]]")).unwrap_err();
    assert!(
        matches!(err, SpecError::BadBudget { ref field, .. } if field == "budget_usd"),
        "{err}"
    );
}

#[test]
fn plan_rules_apply_to_specs_in_order() {
    // A label made long by its repeat suffix breaks the plan's label rule.
    let long = "x".repeat(64);
    let err = parse(&spec(
        "",
        "",
        &format!("[[branches]]\nlabel = \"{long}\"\n[[branches]]\nlabel = \"{long}\""),
    ))
    .unwrap_err();
    assert!(matches!(err, SpecError::BadLabel { .. }), "{err}");
    // Depth is checked after the plan's rules.
    let f: SpecFile = toml::from_str(&spec("max_depth = 1", "", "[[branches]]")).unwrap();
    assert!(matches!(
        validate(&f, 1),
        Err(SpecError::DepthExceeded { .. })
    ));
    let f: SpecFile =
        toml::from_str(&spec("max_depth = 1\nmax_turns = 0", "", "[[branches]]")).unwrap();
    assert!(matches!(validate(&f, 1), Err(SpecError::ZeroLimit { .. })));
}

#[test]
fn approval_rules_are_per_fork_replaced_per_branch_and_checked() {
    let rest = "[approval]\ntools = [\"delete_file\"]\nrun_command = [\"git push*\"]\npaths = [\"migrations/**\"]\ntimeout_s = 60\non_timeout = \"approve\"\n\
                [[branches]]\nlabel = \"a\"\n[[branches]]\nlabel = \"b\"\napproval = {}\n[[branches]]\nlabel = \"c\"\napproval = { tools = [\"run_command\"] }";
    let p = parse(&spec("", "", rest)).unwrap();
    let fork = p.approval.clone().unwrap();
    assert_eq!(fork.timeout_s, 60);
    assert_eq!(fork.on_timeout, crate::approval::OnTimeout::Approve);
    assert_eq!(p.approval_for(&p.branches[0]), Some(&fork));
    // An empty table lifts the fork's rules; a branch's own replace them whole.
    assert_eq!(p.approval_for(&p.branches[1]), None);
    let c = p.approval_for(&p.branches[2]).unwrap();
    assert_eq!(c.tools, ["run_command"]);
    assert!(c.paths.is_empty());
    assert_eq!(c.timeout_s, crate::approval::DEFAULT_TIMEOUT_S);
    // The plan's validation checks them again (a client may skip the loader).
    let mut bad = p.clone();
    bad.branches[2].approval = Some(crate::approval::ApprovalRules {
        tools: vec!["nope".into()],
        ..c.clone()
    });
    let err = bad.validate().unwrap_err().to_string();
    assert!(
        err.contains("`branches[2].approval.tools` names `nope`"),
        "{err}"
    );

    for (rest, want) in [
        (
            "[approval]\ntool = [\"x\"]\n[[branches]]\nlabel = \"a\"",
            "unknown field `tool`",
        ),
        (
            "[approval]\npaths = [\"/etc/**\"]\n[[branches]]\nlabel = \"a\"",
            "`approval.paths` pattern `/etc/**` is outside the workspace",
        ),
        (
            "[[branches]]\nlabel = \"a\"\napproval = { run_command = [\"[x\"] }",
            "`branches[0].approval.run_command` pattern `[x` is not valid",
        ),
        (
            "[approval]\non_timeout = \"later\"\n[[branches]]\nlabel = \"a\"",
            "unknown variant `later`",
        ),
    ] {
        let err = parse(&spec("", "", rest)).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
}

#[test]
fn checkpoint_tools_and_their_descriptions_are_checked() {
    let p = parse(&spec(
        "checkpoint_tools = true\n[tool_descriptions]\nrewind_to = \"go back\"",
        "",
        "[[branches]]\nlabel = \"a\"",
    ))
    .unwrap();
    assert_eq!(
        p.tools.checkpoint_tools.unwrap().descriptions["rewind_to"],
        "go back"
    );
    let none = parse(&spec("", "", "[[branches]]\nlabel = \"a\"")).unwrap();
    assert!(none.tools.checkpoint_tools.is_none());
    for (top, want) in [
        (
            "checkpoint_tools = true\n[tool_descriptions]\nread_file = \"x\"",
            "`tool_descriptions` names `read_file`, which is not a checkpoint tool; valid: save_checkpoint",
        ),
        (
            "[tool_descriptions]\nrewind_to = \"x\"",
            "`checkpoint_tools = true` enables",
        ),
        (
            "checkpoint_tools = true\n[tool_descriptions]\nrewind_to = \" \"",
            "1 to 4096 characters",
        ),
    ] {
        let err = parse(&spec(top, "", "[[branches]]\nlabel = \"a\"")).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
}

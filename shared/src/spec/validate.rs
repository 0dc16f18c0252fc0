//! The rules every [`ForkPlan`] holds, whoever built it: the spec loader checks the plan it
//! built with [`ForkPlan::validate`], and the coordinator checks every plan it is sent with
//! it again (a client may have skipped the loader, or be older).

use super::{
    CheckpointPolicy, ForkPlan, ResolvePlan, SpecError, TestPlan, MAX_LABEL_LEN, MAX_TEST_TIMEOUT_S,
};
use crate::resolve::Strategy;
use std::collections::{BTreeMap, BTreeSet};

/// How many names an error message lists before it says "and N more".
const LIST_LIMIT: usize = 10;

impl ForkPlan {
    /// Check the plan, in this order:
    /// - branches: at least one, at most `limits.max_branches`; the limits at least 1 and
    ///   the checkpoint policy valid;
    /// - labels: safe directory names, not empty, unique; a branch's own `max_turns` and
    ///   `max_output_tokens` at least 1; a single agent run (`solo`) has exactly one branch,
    ///   labelled `main`;
    /// - budgets: finite and zero or more, the account name valid;
    /// - models: every name of the form `provider:name` with a known provider, the fork's,
    ///   every branch's and every judge's model configured in `models`, their prices and
    ///   connection settings valid, and a price known for every model a cap applies to;
    /// - the resolve settings and the `run_command` tool.
    ///
    /// The fork's depth needs its parent: [`check_depth`] checks it.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.check_limits()?;
        self.check_branches()?;
        self.check_budgets()?;
        self.check_models()?;
        self.check_prices_for_caps()?;
        self.tools.check()?;
        if let Some(rules) = &self.approval {
            rules.check("approval").map_err(SpecError::BadApproval)?;
        }
        for (i, b) in self.branches.iter().enumerate() {
            if let Some(rules) = &b.approval {
                rules
                    .check(&format!("branches[{i}].approval"))
                    .map_err(SpecError::BadApproval)?;
            }
        }
        Ok(())
    }

    fn check_limits(&self) -> Result<(), SpecError> {
        if self.branches.is_empty() {
            return Err(SpecError::NoBranches);
        }
        if self.branches.len() > self.limits.max_branches {
            return Err(SpecError::TooManyBranches {
                requested: self.branches.len(),
                max: self.limits.max_branches,
            });
        }
        for (field, v) in [
            ("max_branches", self.limits.max_branches as u64),
            ("max_turns", u64::from(self.limits.max_turns)),
            (
                "max_output_tokens",
                u64::from(self.limits.max_output_tokens),
            ),
        ] {
            if v == 0 {
                return Err(SpecError::ZeroLimit {
                    field: field.to_string(),
                });
            }
        }
        self.limits.checkpoints.validate()
    }

    fn check_branches(&self) -> Result<(), SpecError> {
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, b) in self.branches.iter().enumerate() {
            if b.label.is_empty() {
                return Err(SpecError::BadLabel {
                    label: String::new(),
                    reason: "it is empty",
                });
            }
            check_label(&b.label)?;
            if let Some(first) = seen.insert(b.label.as_str(), i) {
                return Err(SpecError::DuplicateLabel {
                    label: b.label.clone(),
                    first,
                    index: i,
                });
            }
            for (field, v) in [
                ("max_turns", Some(b.max_turns)),
                ("max_output_tokens", b.max_output_tokens),
            ] {
                if v == Some(0) {
                    return Err(SpecError::ZeroLimit {
                        field: format!("branches[{i}].{field}"),
                    });
                }
            }
            if let Some(t) = b
                .temperature
                .filter(|t| !(t.is_finite() && (0.0..=2.0).contains(t)))
            {
                return Err(SpecError::BadTemperature {
                    field: format!("branches[{i}].temperature"),
                    value: t,
                });
            }
        }
        // A spec's single agent is `main`; a child of `runs fork` keeps its own label.
        if self.solo && self.branches.len() != 1 {
            return Err(SpecError::BadSolo {
                count: self.branches.len(),
                labels: names(self.branches.iter().map(|b| format!("`{}`", b.label))),
            });
        }
        Ok(())
    }

    fn check_budgets(&self) -> Result<(), SpecError> {
        check_budget("aggregate_budget_usd", self.aggregate_budget_usd)?;
        if let Some(name) = &self.budget.account {
            check_account_name(name)?;
        }
        for (i, b) in self.branches.iter().enumerate() {
            check_budget(&format!("branches[{i}].budget_usd"), b.budget_usd)?;
        }
        Ok(())
    }

    /// Model names, that every model used is configured, and each configured model's price
    /// and connection settings.
    fn check_models(&self) -> Result<(), SpecError> {
        check_model_name(&self.model)?;
        for name in self.models.keys() {
            check_model_name(name)?;
        }
        self.check_configured("model".to_string(), &self.model)?;
        for (i, b) in self.branches.iter().enumerate() {
            check_model_name(&b.model)?;
            self.check_configured(format!("branches[{i}].model"), &b.model)?;
        }
        self.resolve.validate()?;
        for (j, judge) in self.resolve.judge_models.iter().enumerate() {
            self.check_configured(format!("judge_models[{j}]"), judge)?;
        }
        for (name, m) in &self.models {
            if let Some(price) = &m.price {
                price.validate().map_err(|message| SpecError::BadPrice {
                    model: name.clone(),
                    message,
                })?;
            }
            let bad_model = |message: &str| SpecError::BadModel {
                model: name.clone(),
                message: message.to_string(),
            };
            let scripted = name.starts_with("scripted:");
            let endpoint = m.endpoint.clone().unwrap_or_default();
            if scripted && !endpoint.is_empty() {
                return Err(bad_model(SCRIPTED_TAKES_NO_ENDPOINT));
            }
            if !scripted && m.script.is_some() {
                return Err(bad_model(ONLY_SCRIPTED_TAKE_A_SCRIPT));
            }
            for (field, set) in [
                ("api_key_env", endpoint.api_key_env.is_some()),
                ("api_key_file", endpoint.api_key_file.is_some()),
            ] {
                if set {
                    return Err(bad_model(&crate::catalogue::key_source_refusal(
                        name, field,
                    )));
                }
            }
            let provider = name.split_once(':').map_or("", |(p, _)| p);
            endpoint.validate_for(provider).map_err(|m| bad_model(&m))?;
        }
        Ok(())
    }

    fn check_configured(&self, field: String, model: &str) -> Result<(), SpecError> {
        if self.models.contains_key(model) {
            return Ok(());
        }
        Err(SpecError::UnknownModel {
            field,
            model: model.to_string(),
            valid: if self.models.is_empty() {
                "none".to_string()
            } else {
                names(self.models.keys())
            },
        })
    }

    /// A cap on a model with no known price would be a silently disabled cap: every branch
    /// under a cap (its own, the fork's, or an account's) uses a priced model.
    fn check_prices_for_caps(&self) -> Result<(), SpecError> {
        for (i, b) in self.branches.iter().enumerate() {
            let field = if b.budget_usd.is_some() {
                format!("branches[{i}].budget_usd")
            } else if self.aggregate_budget_usd.is_some() {
                "aggregate_budget_usd".to_string()
            } else if self.budget.account.is_some() {
                "account".to_string()
            } else {
                continue;
            };
            if self.models.get(&b.model).and_then(|m| m.price).is_none() {
                return Err(SpecError::NoPrice {
                    model: b.model.clone(),
                    field,
                });
            }
        }
        Ok(())
    }
}

/// Why a scripted model's section may not set connection settings.
pub(super) const SCRIPTED_TAKES_NO_ENDPOINT: &str = "a scripted model takes only `script` and `price`; base_url, api_key_env, api_key_file, timeout_s, max_retries, api, cache, stream, reasoning_effort, token_param, tool_choice and thinking_budget are for openai: and anthropic: models";

/// Why a real model's section may not name a script.
pub(super) const ONLY_SCRIPTED_TAKE_A_SCRIPT: &str = "only scripted: models take a `script`";

/// `a, b, c and N more`: at most [`LIST_LIMIT`] items.
fn names<S: std::fmt::Display>(items: impl ExactSizeIterator<Item = S>) -> String {
    let total = items.len();
    let mut out: Vec<String> = items.take(LIST_LIMIT).map(|s| s.to_string()).collect();
    if total > LIST_LIMIT {
        out.push(format!("and {} more", total - LIST_LIMIT));
    }
    out.join(", ")
}

impl CheckpointPolicy {
    /// `max_checkpoints` is at least 1.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.max_checkpoints == 0 {
            return Err(SpecError::BadCheckpoints {
                field: "max_checkpoints",
                message: "0 is not valid; keep at least 1 (automatic checkpoints beyond it \
                          evict the oldest)"
                    .to_string(),
            });
        }
        Ok(())
    }
}

impl ResolvePlan {
    /// The rules a plan holds whoever built it (the spec parser, or a client of the
    /// coordinator's API, which checks again): the strategy's threshold, as many judges as
    /// the strategy has (none, one, or at least one for a vote), judge models of the form
    /// `provider:name`, and a test command with a program, a timeout above 0 and variable
    /// names for its environment.
    pub fn validate(&self) -> Result<(), SpecError> {
        let bad = |field, message: String| SpecError::BadResolve { field, message };
        self.strategy
            .validate()
            .map_err(|e| bad("strategy", e.to_string()))?;
        let kind = self.strategy.as_str();
        let judges = self.judge_models.len();
        match self.strategy {
            Strategy::Auto | Strategy::AutoWithFallback { .. } if judges != 1 => {
                return Err(bad(
                    "judge_model",
                    format!("strategy `{kind}` has one judge, not {judges}: set `judge_model = \"provider:name\"`"),
                ))
            }
            Strategy::Vote if judges == 0 => {
                return Err(bad(
                    "judge_models",
                    "a vote needs at least one judge model: set `judge_models = [...]`"
                        .to_string(),
                ))
            }
            _ => {}
        }
        for judge in &self.judge_models {
            check_model_name(judge)?;
        }
        if let Some(test) = &self.test {
            test.validate().map_err(|(field, m)| bad(field, m))?;
        }
        Ok(())
    }
}

impl TestPlan {
    /// A program to run, a timeout above 0, and variable names for the environment; the
    /// key at fault and why.
    fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.argv.first().is_none_or(|p| p.trim().is_empty()) {
            return Err((
                "test_command",
                "the command is empty; give a program and its arguments".to_string(),
            ));
        }
        if !self.timeout_s.is_finite()
            || self.timeout_s <= 0.0
            || self.timeout_s > MAX_TEST_TIMEOUT_S
        {
            return Err((
                "test_timeout_s",
                format!(
                    "{} is not a number of seconds above 0 and at most {MAX_TEST_TIMEOUT_S}",
                    self.timeout_s
                ),
            ));
        }
        for key in self.env.keys() {
            if !crate::endpoint::is_env_name(key) {
                return Err((
                    "test_env",
                    format!("`{key}` is not a variable name (letters, digits and `_`, not starting with a digit)"),
                ));
            }
        }
        Ok(())
    }
}

/// A fork from a parent at `depth` is allowed while `depth < max_depth`.
pub fn check_depth(depth: u32, max_depth: u32) -> Result<(), SpecError> {
    if depth >= max_depth {
        return Err(SpecError::DepthExceeded {
            depth,
            max: max_depth,
            last: max_depth.saturating_sub(1),
        });
    }
    Ok(())
}

pub(super) fn check_budget(field: &str, v: Option<f64>) -> Result<(), SpecError> {
    match v {
        Some(v) if !v.is_finite() || v < 0.0 => Err(SpecError::BadBudget {
            field: field.to_string(),
            value: v,
        }),
        _ => Ok(()),
    }
}

pub(super) fn check_model_name(model: &str) -> Result<(), SpecError> {
    split_model(model).map(|_| ())
}

/// Split a model name `provider:name`, checking the provider is a
/// [`Provider`](crate::provider::Provider).
pub fn split_model(model: &str) -> Result<(&str, &str), SpecError> {
    let valid = crate::provider::Provider::names;
    match model.split_once(':') {
        Some((provider, name)) if !name.is_empty() => {
            if crate::provider::Provider::parse(provider).is_some() {
                Ok((provider, name))
            } else {
                Err(SpecError::UnknownProvider {
                    model: model.to_string(),
                    provider: provider.to_string(),
                    valid: valid(),
                })
            }
        }
        _ => Err(SpecError::BadModelName {
            model: model.to_string(),
            valid: valid(),
        }),
    }
}

/// Blank labels become `branch-{i+1}`; a repeated label gets `-2`, `-3`, ... Labels must
/// be safe as a directory name.
pub fn normalise_labels<'a>(
    labels: impl IntoIterator<Item = Option<&'a str>>,
) -> Result<Vec<String>, SpecError> {
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut out = Vec::new();
    for (i, l) in labels.into_iter().enumerate() {
        // An absent label defaults; one given empty is a mistake, not a request for the
        // default.
        let base = match l.map(str::trim) {
            None => format!("branch-{}", i + 1),
            Some("") => return Err(SpecError::EmptyLabel { index: i }),
            Some(s) => s.to_string(),
        };
        check_label(&base)?;
        let mut label = base.clone();
        let mut n = 2;
        while seen.contains(&label) {
            label = format!("{base}-{n}");
            n += 1;
        }
        seen.insert(label.clone());
        out.push(label);
    }
    Ok(out)
}

/// A label is a safe single directory name.
pub fn check_label(label: &str) -> Result<(), SpecError> {
    let bad = |reason| {
        Err(SpecError::BadLabel {
            label: crate::api::limits::truncated(label),
            reason,
        })
    };
    if label.len() > MAX_LABEL_LEN {
        return bad("it is longer than 64 characters");
    }
    if label.contains('/') || label.contains('\\') {
        return bad("it contains a path separator");
    }
    if label.starts_with('.') {
        return bad("it starts with `.`");
    }
    if !label
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return bad("it contains a character other than letters, digits, `-`, `_` and `.`");
    }
    Ok(())
}

/// An account name follows the label rules (it names a ledger, and shows in paths and
/// subjects nowhere, but one rule is easier to remember) and is not empty.
pub fn check_account_name(name: &str) -> Result<(), SpecError> {
    if name.is_empty() {
        return Err(SpecError::BadAccount {
            name: name.to_string(),
            reason: "it is empty",
        });
    }
    check_label(name).map_err(|e| match e {
        SpecError::BadLabel { reason, .. } => SpecError::BadAccount {
            name: crate::api::limits::truncated(name),
            reason,
        },
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::{CommandTool, Endpoint};
    use crate::pricing::Price;
    use crate::spec::{BranchPlan, Limits, ModelPlan, SOLO_LABEL};

    const MODEL: &str = "scripted:demo";

    /// A valid plan of `labels`, built by hand (as a client of the coordinator may).
    fn plan(labels: &[&str]) -> ForkPlan {
        ForkPlan {
            tools: Default::default(),
            name: None,
            approval: None,
            goal: "g".into(),
            system_prompt: None,
            history: Vec::new(),
            model: MODEL.into(),
            limits: Limits::default(),
            conflict_policy: Default::default(),
            aggregate_budget_usd: None,
            budget: Default::default(),
            resolve: Default::default(),
            models: BTreeMap::from([(
                MODEL.to_string(),
                ModelPlan {
                    price: Some(Price {
                        input_per_mtok: 1.0,
                        output_per_mtok: 2.0,
                        cached_per_mtok: None,
                        cache_write_per_mtok: None,
                    }),
                    script: None,
                    endpoint: None,
                },
            )]),
            branches: labels
                .iter()
                .map(|l| BranchPlan {
                    approval: None,
                    label: l.to_string(),
                    steer: format!("try {l}"),
                    model: MODEL.into(),
                    budget_usd: None,
                    extra_instructions: None,
                    max_turns: 10,
                    max_output_tokens: None,
                    temperature: None,
                })
                .collect(),
            solo: false,
        }
    }

    /// `plan` changed by `change` is refused, with a message holding every `needle`.
    fn refused(change: impl FnOnce(&mut ForkPlan), needles: &[&str]) -> SpecError {
        let mut p = plan(&["a", "b", "c"]);
        change(&mut p);
        let err = p.validate().unwrap_err();
        for needle in needles {
            assert!(err.to_string().contains(needle), "{needle}: {err}");
        }
        err
    }

    #[test]
    fn a_valid_plan_passes() {
        plan(&["a", "b"]).validate().unwrap();
        let mut solo = plan(&[SOLO_LABEL]);
        solo.solo = true;
        solo.validate().unwrap();
    }

    #[test]
    fn branches_and_limits() {
        let err = refused(|p| p.branches.clear(), &[]);
        assert!(matches!(err, SpecError::NoBranches), "{err}");
        let err = refused(
            |p| p.limits.max_branches = 2,
            &["3 branches", "max_branches is 2"],
        );
        assert!(matches!(
            err,
            SpecError::TooManyBranches {
                requested: 3,
                max: 2
            }
        ));
        refused(
            |p| p.limits.max_turns = 0,
            &["`max_turns` must be at least 1"],
        );
        refused(|p| p.limits.max_output_tokens = 0, &["`max_output_tokens`"]);
        refused(
            |p| p.limits.checkpoints.max_checkpoints = 0,
            &["`max_checkpoints`", "at least 1"],
        );
        refused(
            |p| p.branches[1].max_turns = 0,
            &["`branches[1].max_turns` must be at least 1"],
        );
        refused(
            |p| p.branches[2].max_output_tokens = Some(0),
            &["`branches[2].max_output_tokens`"],
        );
    }

    #[test]
    fn labels_are_safe_and_unique() {
        let err = refused(
            |p| p.branches[2].label = "a".into(),
            &[
                "`branches[2].label` is `a`",
                "`branches[0].label`",
                "unique",
            ],
        );
        assert!(
            matches!(err, SpecError::DuplicateLabel { ref label, first: 0, index: 2 } if label == "a"),
            "{err}"
        );
        for bad in ["", "../x", ".hidden", "a b", &"x".repeat(65)] {
            let err = refused(
                |p| p.branches[0].label = bad.to_string(),
                &["letters, digits"],
            );
            assert!(matches!(err, SpecError::BadLabel { .. }), "{bad}: {err}");
        }
        // A single agent run: one branch (`main` from a spec; a `runs fork` child keeps its
        // own label).
        let err = refused(|p| p.solo = true, &["exactly one branch", "`a`, `b`, `c`"]);
        assert!(matches!(err, SpecError::BadSolo { count: 3, .. }), "{err}");
        let mut solo = plan(&["retry"]);
        solo.solo = true;
        solo.validate().unwrap();
    }

    #[test]
    fn temperatures_are_from_0_to_2() {
        for bad in [-0.1, 2.5, f64::NAN] {
            refused(
                |p| p.branches[1].temperature = Some(bad),
                &["`branches[1].temperature`", "from 0 to 2"],
            );
        }
        let mut p = plan(&["a"]);
        p.branches[0].temperature = Some(0.0);
        p.validate().unwrap();
    }

    #[test]
    fn budgets_are_finite_and_not_negative() {
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let err = refused(
                |p| p.branches[2].budget_usd = Some(bad),
                &["`branches[2].budget_usd`", "zero or more"],
            );
            assert!(matches!(err, SpecError::BadBudget { .. }), "{err}");
            refused(
                |p| p.aggregate_budget_usd = Some(bad),
                &["`aggregate_budget_usd`"],
            );
        }
        refused(
            |p| p.budget.account = Some("../x".into()),
            &["account name `../x`"],
        );
        let mut zero = plan(&["a"]);
        zero.branches[0].budget_usd = Some(0.0);
        zero.aggregate_budget_usd = Some(0.0);
        zero.validate().unwrap();
    }

    #[test]
    fn models_are_named_configured_and_priced() {
        let err = refused(
            |p| p.branches[1].model = "scripted:other".into(),
            &[
                "`branches[1].model` is `scripted:other`",
                "configured models: scripted:demo",
            ],
        );
        assert!(matches!(err, SpecError::UnknownModel { .. }), "{err}");
        refused(
            |p| p.model = "scripted:other".into(),
            &["`model` is `scripted:other`"],
        );
        refused(
            |p| {
                p.resolve.strategy = Strategy::Auto;
                p.resolve.judge_models = vec!["scripted:judge".into()];
            },
            &["`judge_models[0]` is `scripted:judge`"],
        );
        let err = refused(|p| p.branches[0].model = "gpt".into(), &["provider:name"]);
        assert!(matches!(err, SpecError::BadModelName { .. }), "{err}");
        refused(
            |p| {
                let m = p.models.remove(MODEL).unwrap();
                p.models.insert("nope:x".into(), m);
                p.model = "nope:x".into();
                for b in &mut p.branches {
                    b.model = "nope:x".into();
                }
            },
            &["unknown provider `nope`"],
        );
        // A judge strategy needs its judge.
        refused(
            |p| p.resolve.strategy = Strategy::Auto,
            &["has one judge, not 0"],
        );
        // Prices, connection settings.
        refused(
            |p| {
                p.models
                    .get_mut(MODEL)
                    .unwrap()
                    .price
                    .as_mut()
                    .unwrap()
                    .input_per_mtok = -1.0
            },
            &["price of model `scripted:demo`"],
        );
        refused(
            |p| {
                p.models.get_mut(MODEL).unwrap().endpoint = Some(Endpoint {
                    base_url: Some("http://x".into()),
                    ..Endpoint::default()
                })
            },
            &["a scripted model takes only"],
        );
        refused(
            |p| {
                let m = p.models.remove(MODEL).unwrap();
                p.models.insert(
                    "openai:x".into(),
                    ModelPlan {
                        endpoint: Some(Endpoint {
                            base_url: Some("127.0.0.1".into()),
                            ..Endpoint::default()
                        }),
                        ..m
                    },
                );
                p.model = "openai:x".into();
                for b in &mut p.branches {
                    b.model = "openai:x".into();
                }
            },
            &["[models.\"openai:x\"]", "base_url"],
        );
    }

    #[test]
    fn a_cap_needs_a_price() {
        let unpriced = |p: &mut ForkPlan| p.models.get_mut(MODEL).unwrap().price = None;
        // No cap: no price needed.
        let mut p = plan(&["a"]);
        unpriced(&mut p);
        p.validate().unwrap();
        let err = refused(
            |p| {
                unpriced(p);
                p.branches[1].budget_usd = Some(1.0);
            },
            &["`branches[1].budget_usd` sets a budget", "scripted:demo"],
        );
        assert!(matches!(err, SpecError::NoPrice { .. }), "{err}");
        refused(
            |p| {
                unpriced(p);
                p.aggregate_budget_usd = Some(1.0);
            },
            &["`aggregate_budget_usd` sets a budget"],
        );
        refused(
            |p| {
                unpriced(p);
                p.budget.account = Some("team".into());
            },
            &["`account` sets a budget"],
        );
    }

    #[test]
    fn the_command_tool_is_checked() {
        let tool = CommandTool {
            timeout_s: 5.0,
            env: BTreeMap::new(),
            max_output_bytes: 4096,
            sandbox: Default::default(),
        };
        let mut p = plan(&["a"]);
        p.tools.run_command = Some(tool.clone());
        p.validate().unwrap();
        refused(
            |p| {
                p.tools.run_command = Some(CommandTool {
                    timeout_s: -5.0,
                    ..tool.clone()
                })
            },
            &["[run_command]", "timeout_s"],
        );
        refused(
            |p| {
                p.tools.run_command = Some(CommandTool {
                    max_output_bytes: 1,
                    ..tool.clone()
                })
            },
            &["[run_command]", "max_output_bytes"],
        );
        refused(
            |p| {
                p.tools.run_command = Some(CommandTool {
                    sandbox: crate::endpoint::CommandSandbox {
                        max_file_size_mb: 0,
                        ..Default::default()
                    },
                    ..tool.clone()
                })
            },
            &["[run_command]", "max_file_size_mb"],
        );
    }
}

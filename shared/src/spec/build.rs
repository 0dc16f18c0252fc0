//! From a spec file to a [`ForkPlan`]: defaults, labels, prices and the keys only a spec
//! has, then the plan's own rules ([`ForkPlan::validate`]); [`load`] also reads the files
//! the spec names.

use super::file::{BranchSection, ModelSection, SpecFile, TestCommand};
use super::plan::{
    BranchPlan, CheckpointFrequency, CheckpointPolicy, CheckpointTools, ForkPlan, Limits,
    LoadedSpec, ModelPlan, ResolvePlan, TestPlan, DEFAULT_MAX_CHECKPOINTS, DEFAULT_TEST_TIMEOUT_S,
    SOLO_LABEL,
};
use super::validate::{
    check_budget, check_depth, check_label, normalise_labels, ONLY_SCRIPTED_TAKE_A_SCRIPT,
};
use super::{
    SpecError, DEFAULT_MAX_BRANCHES, DEFAULT_MAX_DEPTH, DEFAULT_MAX_OUTPUT_TOKENS,
    DEFAULT_MAX_TURNS,
};
use crate::blob::BlobHash;
use crate::budget::BudgetPolicy;
use crate::pricing::{builtin_price, Price};
use crate::resolve::{Strategy, DEFAULT_THRESHOLD, STRATEGY_NAMES};
use crate::script::{Script, ScriptError};
use crate::tools::ToolSettings;
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What a snapshot leaves out when the spec's `exclude` does not say: version control and
/// forkfleet's own directory, and the heavy directories tools rebuild (virtual
/// environments, dependency folders, caches, build output). A spec's `exclude` replaces
/// the list (docs/SPEC.md, "The workspace snapshot").
pub const DEFAULT_EXCLUDE: &[&str] = &[
    ".git",
    ".forkfleet",
    ".venv",
    "venv",
    "node_modules",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".tox",
    "dist",
    "build",
];

/// Read, parse and validate a spec file; read the files it names. Prices come from the
/// spec, else the built-in table.
pub fn load(spec_path: &Path) -> Result<LoadedSpec, SpecError> {
    load_with(spec_path, &BTreeMap::new())
}

/// [`load`], with price overrides (the config's `[pricing]`) consulted after the spec's
/// own `[models."NAME"] price` and before the built-in table.
pub fn load_with(
    spec_path: &Path,
    prices: &BTreeMap<String, Price>,
) -> Result<LoadedSpec, SpecError> {
    load_overridden(Some(spec_path), toml::Table::new(), prices)
}

/// [`load_with`] of the spec at `spec_path` (none: an empty one, its paths relative to the
/// current directory) with `overrides` replacing its top-level keys: how `forkfleet run
/// --goal ... --branch LABEL=STEER` builds the plan a spec would. The result is checked
/// like any spec (a key the overrides leave missing is named as a spec's is).
pub fn load_overridden(
    spec_path: Option<&Path>,
    overrides: toml::Table,
    prices: &BTreeMap<String, Price>,
) -> Result<LoadedSpec, SpecError> {
    let shown = spec_path.map_or_else(|| PathBuf::from("(command-line flags)"), Path::to_path_buf);
    let mut table = match spec_path {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            toml::from_str::<toml::Table>(&text).map_err(|e| SpecError::Toml {
                path: path.to_path_buf(),
                message: e.to_string().trim().to_string(),
            })?
        }
        None => toml::Table::new(),
    };
    table.extend(overrides);
    let file: SpecFile = table
        .try_into()
        .map_err(|e: toml::de::Error| SpecError::Toml {
            path: shown.clone(),
            message: e.to_string().trim().to_string(),
        })?;
    let spec_path = shown.as_path();
    let dir = match spec_path_dir(spec_path) {
        Some(d) => d,
        None => PathBuf::from("."),
    };
    let mut plan = validate_with(&file, 0, prices)?;

    let workspace = dir.join(&file.workspace);
    if !workspace.is_dir() {
        return Err(SpecError::WorkspaceMissing(workspace));
    }
    let workspace = workspace
        .canonicalize()
        .map_err(|_| SpecError::WorkspaceMissing(workspace.clone()))?;

    if let Some(h) = &file.history {
        let path = dir.join(h);
        let text = std::fs::read_to_string(&path).map_err(|e| SpecError::History {
            path: path.clone(),
            message: e.to_string(),
        })?;
        plan.history = serde_json::from_str(&text).map_err(|e| SpecError::History {
            path: path.clone(),
            message: e.to_string(),
        })?;
    }

    let mut blobs = BTreeMap::new();
    for (name, section) in &file.models {
        let Some(script_file) = &section.script else {
            continue;
        };
        let path = dir.join(script_file);
        let text = std::fs::read_to_string(&path).map_err(|e| SpecError::Script {
            model: name.clone(),
            path: path.clone(),
            source: ScriptError::Parse(e.to_string()),
        })?;
        let script = Script::parse(&text).map_err(|source| SpecError::Script {
            model: name.clone(),
            path: path.clone(),
            source,
        })?;
        for b in plan.branches.iter().filter(|b| &b.model == name) {
            script
                .check_label(&b.label)
                .map_err(|source| SpecError::Script {
                    model: name.clone(),
                    path: path.clone(),
                    source,
                })?;
        }
        let bytes = Bytes::from(text.into_bytes());
        let hash = BlobHash::of(&bytes);
        blobs.insert(hash, bytes);
        if let Some(m) = plan.models.get_mut(name) {
            m.script = Some(hash);
        }
    }

    Ok(LoadedSpec {
        plan,
        spec_path: spec_path.to_path_buf(),
        workspace,
        scan: crate::scan::ScanOptions::snapshot(
            &file
                .exclude
                .clone()
                .unwrap_or_else(|| DEFAULT_EXCLUDE.iter().map(|s| s.to_string()).collect()),
            file.respect_gitignore.unwrap_or(true),
        ),
        blobs,
    })
}

/// The directory a spec's relative paths start from: its file's (`None`: the current
/// directory, also for a plan made of flags alone).
fn spec_path_dir(spec_path: &Path) -> Option<PathBuf> {
    if !spec_path.is_file() {
        return None;
    }
    spec_path
        .parent()
        .map(Path::to_path_buf)
        .filter(|d| !d.as_os_str().is_empty())
}

/// Validate a parsed spec for a fork whose parent is at `depth` (0 for a root run).
/// Script blobs are filled in by [`load`].
pub fn validate(file: &SpecFile, depth: u32) -> Result<ForkPlan, SpecError> {
    validate_with(file, depth, &BTreeMap::new())
}

/// [`validate`] with price overrides (see [`load_with`]).
///
/// Builds the plan, checking on the way what only a spec has (a goal for a spec without
/// branches, label syntax before repeats get their suffix, the top-level `budget_usd`, the
/// checkpoint and resolve keys, models configured but unused, scripted models without a
/// script); then checks the plan with [`ForkPlan::validate`], and the depth.
pub fn validate_with(
    file: &SpecFile,
    depth: u32,
    prices: &BTreeMap<String, Price>,
) -> Result<ForkPlan, SpecError> {
    let solo = file.branches.is_empty();
    if solo && file.goal.trim().is_empty() {
        return Err(SpecError::NoBranches);
    }
    let solo_branch = [BranchSection {
        label: Some(SOLO_LABEL.to_string()),
        ..BranchSection::default()
    }];
    let sections: &[BranchSection] = if solo { &solo_branch } else { &file.branches };
    let limits = Limits {
        max_branches: file.max_branches.unwrap_or(DEFAULT_MAX_BRANCHES),
        max_depth: file.max_depth.unwrap_or(DEFAULT_MAX_DEPTH),
        max_turns: file.max_turns.unwrap_or(DEFAULT_MAX_TURNS),
        max_output_tokens: file.max_output_tokens.unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS),
        checkpoints: checkpoint_policy(file)?,
        on_truncated: file.on_truncated.unwrap_or_default(),
    };
    let labels = normalise_labels(sections.iter().map(|b| b.label.as_deref()))?;
    // The default of every branch's budget; the plan has only the branches'.
    check_budget("budget_usd", file.budget_usd)?;

    let branches: Vec<BranchPlan> = sections
        .iter()
        .zip(labels)
        .map(|(b, label)| BranchPlan {
            label,
            steer: b.steer.clone().unwrap_or_default(),
            model: b.model.clone().unwrap_or_else(|| file.model.clone()),
            budget_usd: b.budget_usd.or(file.budget_usd),
            extra_instructions: b.extra_instructions.clone(),
            max_turns: b.max_turns.unwrap_or(limits.max_turns),
            max_output_tokens: b.max_output_tokens,
            temperature: b.temperature.or(file.temperature),
            approval: None,
        })
        .collect();
    let mut branches = branches;
    for (i, (b, section)) in branches.iter_mut().zip(sections).enumerate() {
        if let Some(a) = &section.approval {
            b.approval = Some(
                a.build(&format!("branches[{i}].approval"))
                    .map_err(SpecError::BadApproval)?,
            );
        }
    }

    let resolve = resolve_plan(file)?;
    let mut used: BTreeSet<&str> = branches.iter().map(|b| b.model.as_str()).collect();
    used.insert(file.model.as_str());
    used.extend(resolve.judge_models.iter().map(String::as_str));
    used.extend(
        file.models
            .iter()
            .filter(|(_, m)| m.spare)
            .map(|(name, _)| name.as_str()),
    );
    for name in file.models.keys() {
        if !used.contains(name.as_str()) {
            return Err(SpecError::UnusedModel {
                model: name.clone(),
            });
        }
    }
    let mut models = BTreeMap::new();
    for name in used {
        let section = file.models.get(name);
        let has_script = section.and_then(|s| s.script.as_ref()).is_some();
        // The plan's script is filled in by `load`: until then, its rules are checked here.
        if name.starts_with("scripted:") {
            if !has_script {
                return Err(SpecError::NoScript {
                    model: name.to_string(),
                });
            }
        } else if has_script {
            return Err(SpecError::BadModel {
                model: name.to_string(),
                message: ONLY_SCRIPTED_TAKE_A_SCRIPT.to_string(),
            });
        }
        let price = section
            .and_then(|s| s.price)
            .or_else(|| prices.get(name).copied())
            .or_else(|| builtin_price(name));
        let endpoint = section.map(ModelSection::endpoint).unwrap_or_default();
        models.insert(
            name.to_string(),
            ModelPlan {
                price,
                script: None,
                endpoint: (!endpoint.is_empty()).then_some(endpoint),
            },
        );
    }

    if let Some(name) = &file.name {
        check_label(name).map_err(|e| match e {
            SpecError::BadLabel { reason, .. } => SpecError::BadName {
                name: name.clone(),
                reason,
            },
            other => other,
        })?;
    }
    let plan = ForkPlan {
        name: file.name.clone(),
        goal: file.goal.clone(),
        system_prompt: file.system_prompt.clone(),
        history: Vec::new(),
        model: file.model.clone(),
        limits,
        conflict_policy: file.conflict_policy.unwrap_or_default(),
        aggregate_budget_usd: file.aggregate_budget_usd,
        budget: BudgetPolicy {
            mode: file.budget_mode.unwrap_or_default(),
            on_exhausted: file.on_exhausted.unwrap_or_default(),
            account: file.account.clone(),
            cancel_in_flight: file.cancel_in_flight,
        },
        resolve,
        models,
        branches,
        tools: tool_settings(file)?,
        approval: match &file.approval {
            Some(a) => Some(a.build("approval").map_err(SpecError::BadApproval)?),
            None => None,
        },
        solo,
    };
    plan.validate()
        .map_err(|e| spec_key(e, file.budget_usd.is_some(), sections))?;
    check_depth(depth, plan.limits.max_depth)?;
    Ok(plan)
}

/// An error about a branch's budget that the branch took from the top-level `budget_usd`
/// names that key, the one the user wrote.
fn spec_key(e: SpecError, top_budget: bool, sections: &[BranchSection]) -> SpecError {
    match e {
        SpecError::NoPrice { model, field } => {
            let inherited = top_budget
                && sections.iter().enumerate().any(|(i, s)| {
                    s.budget_usd.is_none() && field == format!("branches[{i}].budget_usd")
                });
            SpecError::NoPrice {
                model,
                field: if inherited {
                    "budget_usd".to_string()
                } else {
                    field
                },
            }
        }
        other => other,
    }
}

/// The resolve settings of a spec, parsed (in the order the keys are documented); the
/// rules over them are [`ResolvePlan::validate`]'s.
fn resolve_plan(file: &SpecFile) -> Result<ResolvePlan, SpecError> {
    let bad = |field, message: String| SpecError::BadResolve { field, message };
    let kind = file.strategy.as_deref().unwrap_or("manual");
    if file.confidence_threshold.is_some() && kind != "auto_with_fallback" {
        return Err(bad(
            "confidence_threshold",
            format!("only `auto_with_fallback` uses a threshold; the strategy is `{kind}`"),
        ));
    }
    let one_judge = || -> Result<Vec<String>, SpecError> {
        if file.judge_models.is_some() {
            return Err(bad(
                "judge_models",
                format!("`{kind}` has one judge: set `judge_model`; `judge_models` is for `vote`"),
            ));
        }
        match &file.judge_model {
            Some(m) => Ok(vec![m.clone()]),
            None => Err(bad(
                "judge_model",
                format!("strategy `{kind}` needs a judge: set `judge_model = \"provider:name\"`"),
            )),
        }
    };
    let threshold = file.confidence_threshold.unwrap_or(DEFAULT_THRESHOLD);
    let Some(strategy) = Strategy::from_name(kind, threshold) else {
        return Err(bad(
            "strategy",
            format!("`{kind}` is not a strategy; valid: {STRATEGY_NAMES}"),
        ));
    };
    let judges = match &strategy {
        // A manual fork runs no judge by itself, but may name one (or several) for a
        // later `forkfleet fork resolve --strategy ...`.
        Strategy::Manual => match (&file.judge_model, &file.judge_models) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "judge_models",
                    "set `judge_model` or `judge_models`, not both".to_string(),
                ))
            }
            (Some(m), None) => vec![m.clone()],
            (None, Some(ms)) => ms.clone(),
            (None, None) => Vec::new(),
        },
        Strategy::Auto | Strategy::AutoWithFallback { .. } => one_judge()?,
        Strategy::Vote => {
            if file.judge_model.is_some() {
                return Err(bad(
                    "judge_model",
                    "`vote` has several judges: set `judge_models = [...]`".to_string(),
                ));
            }
            file.judge_models.clone().unwrap_or_default()
        }
    };
    let test = match &file.test_command {
        None => {
            if file.test_timeout_s.is_some() || !file.test_env.is_empty() {
                return Err(bad(
                    "test_command",
                    "`test_timeout_s` and `test_env` need a `test_command`".to_string(),
                ));
            }
            None
        }
        Some(cmd) => {
            let argv = match cmd {
                TestCommand::Argv(v) => v.clone(),
                TestCommand::Line(line) => split_words(line).map_err(|m| bad("test_command", m))?,
            };
            Some(TestPlan {
                argv,
                timeout_s: file.test_timeout_s.unwrap_or(DEFAULT_TEST_TIMEOUT_S),
                env: file.test_env.clone(),
            })
        }
    };
    Ok(ResolvePlan {
        strategy,
        judge_models: judges,
        confidence_formula: file.confidence_formula.unwrap_or_default(),
        test,
        keep_artifacts: file.keep_artifacts.unwrap_or(false),
    })
}

/// `checkpoints` and `max_checkpoints` of a spec, parsed.
fn checkpoint_policy(file: &SpecFile) -> Result<CheckpointPolicy, SpecError> {
    let bad = |field, message: String| SpecError::BadCheckpoints { field, message };
    let frequency = match &file.checkpoints {
        None => CheckpointFrequency::default(),
        Some(s) => CheckpointFrequency::parse(s).ok_or_else(|| {
            bad(
                "checkpoints",
                format!("`{s}` is not valid; valid: {}", CheckpointFrequency::VALID),
            )
        })?,
    };
    let max_checkpoints = match file.max_checkpoints {
        None => DEFAULT_MAX_CHECKPOINTS,
        // 0 is refused with the policy's own rule (`ForkPlan::validate`).
        Some(n) if n >= 0 && n <= i64::from(u32::MAX) => n as u32,
        Some(n) => {
            return Err(bad(
                "max_checkpoints",
                format!("{n} is not valid; give a whole number of at least 1"),
            ))
        }
    };
    Ok(CheckpointPolicy {
        frequency,
        max_checkpoints,
    })
}

/// Split a command line into words as a POSIX shell would for plain words, quotes and
/// backslashes, without expanding anything (no variables, globs, pipes: the command runs
/// without a shell).
pub fn split_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(ch) => cur.push(ch),
                        None => return Err(format!("unterminated single quote in `{line}`")),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(ch @ ('"' | '\\' | '$' | '`')) => cur.push(ch),
                            Some(ch) => {
                                cur.push('\\');
                                cur.push(ch);
                            }
                            None => return Err(format!("unterminated double quote in `{line}`")),
                        },
                        Some(ch) => cur.push(ch),
                        None => return Err(format!("unterminated double quote in `{line}`")),
                    }
                }
            }
            '\\' => match chars.next() {
                Some(ch) => {
                    in_word = true;
                    cur.push(ch);
                }
                None => return Err(format!("`{line}` ends with a lone backslash")),
            },
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// The optional tools' settings as the spec writes them: `[run_command]`, `forking`,
/// `checkpoint_tools` with `[tool_descriptions]`, and the `[tools]` table.
fn tool_settings(file: &SpecFile) -> Result<ToolSettings, SpecError> {
    let mut tools = ToolSettings {
        run_command: match &file.run_command {
            Some(section) => Some(section.validate().map_err(SpecError::BadRunCommand)?),
            None => None,
        },
        forking: file.forking.unwrap_or(false),
        checkpoint_tools: match (file.checkpoint_tools.unwrap_or(false), &file.tool_descriptions) {
            (true, d) => Some(CheckpointTools {
                descriptions: d.clone(),
            }),
            (false, d) if d.is_empty() => None,
            (false, _) => {
                return Err(SpecError::BadCheckpoints {
                    field: "tool_descriptions",
                    message: "describes the checkpoint tools, which `checkpoint_tools = true` enables; add it".to_string(),
                })
            }
        },
        ..ToolSettings::default()
    };
    file.tools.apply(&mut tools).map_err(SpecError::BadTool)?;
    Ok(tools)
}

//! The chat's own settings: the defaults `/fork` prefills (`/fork-branches`, `/fork-model`,
//! `/fork-budget`) and, per chat, the workspace version last written to the directory.
//! They live in `<workspace>/.forkfleet/chat.toml`, written through on every change (a
//! temporary file renamed over the old one, so a crash leaves one or the other).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The most branches `/fork-branches` takes (a spec's `max_branches` may refuse fewer).
pub const MAX_FORK_BRANCHES: usize = 10;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Rows `/fork` opens with.
    #[serde(default = "default_branches")]
    pub fork_branches: usize,
    /// The model of branch slot N (1-based, as `/fork-model N MODEL` names it).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fork_models: BTreeMap<String, String>,
    /// Each row's cap, prefilled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_budget_usd: Option<f64>,
    /// The fork's cap, prefilled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_aggregate_usd: Option<f64>,
    /// Per chat (its root run id): the workspace version last written to the directory.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub synced: BTreeMap<String, String>,
}

fn default_branches() -> usize {
    3
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            fork_branches: default_branches(),
            fork_models: BTreeMap::new(),
            fork_budget_usd: None,
            fork_aggregate_usd: None,
            synced: BTreeMap::new(),
        }
    }
}

/// Where a workspace's chat settings live.
pub fn path(workspace: &Path) -> PathBuf {
    workspace.join(".forkfleet").join("chat.toml")
}

impl Settings {
    /// The settings at `file`; the defaults when it does not exist.
    pub fn load(file: &Path) -> anyhow::Result<Settings> {
        match std::fs::read_to_string(file) {
            Ok(text) => toml::from_str(&text).map_err(|e| {
                anyhow::anyhow!(
                    "{}: {} (the chat's settings; delete the file to start from the defaults)",
                    file.display(),
                    e.to_string().trim()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Settings::default()),
            Err(e) => Err(anyhow::anyhow!("{}: {e}", file.display())),
        }
    }

    /// Write them to `file` (its directory made when missing).
    pub fn save(&self, file: &Path) -> anyhow::Result<()> {
        let text = toml::to_string(self)?;
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = file.with_extension("toml.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, file)?;
        Ok(())
    }

    /// The model of slot `n` (1-based), if one is set.
    pub fn model_of(&self, n: usize) -> Option<&str> {
        self.fork_models.get(&n.to_string()).map(String::as_str)
    }

    /// Apply one of `/fork-branches`, `/fork-model`, `/fork-budget` (`cmd` without its
    /// slash, `args` split on whitespace). `Ok(text)`: what changed (or the value shown,
    /// without arguments); `Err(text)`: what was wrong and what is valid.
    pub fn command(&mut self, cmd: &str, args: &[&str]) -> Result<String, String> {
        match (cmd, args) {
            ("fork-branches", []) => Ok(format!("fork_branches = {}", self.fork_branches)),
            ("fork-branches", [n]) => {
                let n: usize = n
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_FORK_BRANCHES).contains(n))
                    .ok_or_else(|| {
                        format!("/fork-branches takes a count from 1 to {MAX_FORK_BRANCHES}, not `{n}`")
                    })?;
                self.fork_branches = n;
                Ok(format!("fork_branches = {n}"))
            }
            ("fork-model", []) => Ok(if self.fork_models.is_empty() {
                "no branch has a model of its own: every branch runs the chat's model".into()
            } else {
                self.fork_models
                    .iter()
                    .map(|(n, m)| format!("branch {n} = {m}"))
                    .collect::<Vec<_>>()
                    .join(" · ")
            }),
            ("fork-model", ["clear"]) => {
                self.fork_models.clear();
                Ok("every branch runs the chat's model".into())
            }
            ("fork-model", [slot, model]) => {
                let n = slot_number(slot)?;
                if *model == "clear" {
                    self.fork_models.remove(&n.to_string());
                    return Ok(format!("branch {n} runs the chat's model"));
                }
                if !model.contains(':') {
                    return Err(format!(
                        "/fork-model: `{model}` has no provider; give provider:name, e.g. openai:gpt-4o"
                    ));
                }
                self.fork_models.insert(n.to_string(), model.to_string());
                Ok(format!("branch {n} = {model}"))
            }
            ("fork-budget", []) => Ok(format!(
                "per-branch budget = {} · aggregate budget = {}",
                usd_or_none(self.fork_budget_usd),
                usd_or_none(self.fork_aggregate_usd)
            )),
            ("fork-budget", ["clear"]) => {
                self.fork_budget_usd = None;
                self.fork_aggregate_usd = None;
                Ok("no budgets: per-branch and aggregate unset".into())
            }
            ("fork-budget", [which @ ("per-branch" | "aggregate"), usd]) => {
                let v = forkfleet_shared::budget::parse_usd(usd).map_err(|e| format!("/fork-budget: {e}"))?;
                if *which == "per-branch" {
                    self.fork_budget_usd = Some(v);
                    Ok(format!("per-branch budget = ${v}"))
                } else {
                    self.fork_aggregate_usd = Some(v);
                    Ok(format!("aggregate budget = ${v}"))
                }
            }
            ("fork-branches", _) => Err("usage: /fork-branches N".into()),
            ("fork-model", _) => {
                Err("usage: /fork-model N provider:name · /fork-model N clear · /fork-model clear".into())
            }
            ("fork-budget", _) => Err(
                "usage: /fork-budget per-branch USD · /fork-budget aggregate USD · /fork-budget clear"
                    .into(),
            ),
            (other, _) => Err(format!("/{other} is not a settings command")),
        }
    }
}

fn slot_number(slot: &str) -> Result<usize, String> {
    slot.parse()
        .ok()
        .filter(|n| (1..=MAX_FORK_BRANCHES).contains(n))
        .ok_or_else(|| {
            format!("/fork-model: the branch number is 1 to {MAX_FORK_BRANCHES}, not `{slot}`")
        })
}

fn usd_or_none(v: Option<f64>) -> String {
    v.map_or_else(|| "none".to_string(), |v| format!("${v}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_change_the_defaults_and_refuse_bad_values() {
        let mut s = Settings::default();
        assert_eq!(
            s.command("fork-branches", &["4"]).unwrap(),
            "fork_branches = 4"
        );
        assert_eq!(s.fork_branches, 4);
        assert!(s
            .command("fork-branches", &["0"])
            .unwrap_err()
            .contains("1 to 10"));
        assert!(s.command("fork-branches", &["11"]).is_err());
        s.command("fork-model", &["2", "openai:gpt-4o"]).unwrap();
        assert_eq!(s.model_of(2), Some("openai:gpt-4o"));
        assert!(s
            .command("fork-model", &["2", "gpt-4o"])
            .unwrap_err()
            .contains("provider"));
        s.command("fork-model", &["2", "clear"]).unwrap();
        assert_eq!(s.model_of(2), None);
        s.command("fork-budget", &["per-branch", "0.25"]).unwrap();
        s.command("fork-budget", &["aggregate", "2"]).unwrap();
        assert_eq!(
            (s.fork_budget_usd, s.fork_aggregate_usd),
            (Some(0.25), Some(2.0))
        );
        assert!(s.command("fork-budget", &["aggregate", "-1"]).is_err());
        s.command("fork-budget", &["clear"]).unwrap();
        assert_eq!((s.fork_budget_usd, s.fork_aggregate_usd), (None, None));
    }

    #[test]
    fn settings_survive_a_save_and_a_load() {
        let dir = tempfile::tempdir().unwrap();
        let file = path(dir.path());
        assert_eq!(Settings::load(&file).unwrap(), Settings::default());
        let mut s = Settings::default();
        s.command("fork-branches", &["5"]).unwrap();
        s.command("fork-model", &["1", "scripted:demo"]).unwrap();
        s.synced.insert("run".into(), "hash".into());
        s.save(&file).unwrap();
        assert_eq!(Settings::load(&file).unwrap(), s);
        std::fs::write(&file, "nonsense = 1\n").unwrap();
        assert!(Settings::load(&file)
            .unwrap_err()
            .to_string()
            .contains("chat.toml"));
    }
}

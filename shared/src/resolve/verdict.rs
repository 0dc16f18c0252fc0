//! The judge's verdict: parsed leniently from the judge model's text and checked against the
//! real branch labels.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// The judge's structured answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JudgeVerdict {
    /// The winning branch's label.
    pub winner: String,
    /// The judge's own confidence in `[0, 1]`.
    pub confidence: f64,
    #[serde(default)]
    pub reasoning: String,
    /// Per-branch notes, by label.
    #[serde(default)]
    pub notes: BTreeMap<String, String>,
}

/// Why a judge's answer was not accepted. The caller retries an [`VerdictError::UnknownWinner`]
/// once, then reports the error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VerdictError {
    #[error(
        "the judge picked {winner:?}, which is not a branch; the valid labels are: {}",
        quoted_list(valid)
    )]
    UnknownWinner { winner: String, valid: Vec<String> },
    #[error("the judge's confidence {confidence} is not a number in [0, 1]")]
    InvalidConfidence { confidence: f64 },
    #[error("the judge's answer is not a verdict: {0}")]
    Malformed(String),
}

fn quoted_list(labels: &[String]) -> String {
    if labels.is_empty() {
        return "(none)".to_owned();
    }
    labels
        .iter()
        .map(|l| format!("{l:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The lenient wire form a model produces: confidence may be a numeric string, notes may hold
/// non-string values, reasoning and notes may be missing or null.
#[derive(Deserialize)]
struct RawVerdict {
    winner: String,
    confidence: Value,
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    notes: Option<BTreeMap<String, Value>>,
}

impl RawVerdict {
    fn into_verdict(self) -> Result<JudgeVerdict, String> {
        let confidence = match &self.confidence {
            Value::Number(n) => n.as_f64(),
            Value::String(s) => s.trim().parse::<f64>().ok(),
            _ => None,
        }
        .ok_or_else(|| format!("confidence {} is not a number", self.confidence))?;
        let notes = self
            .notes
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(label, note)| match note {
                Value::Null => None,
                Value::String(s) => Some((label, s)),
                other => Some((label, other.to_string())),
            })
            .collect();
        Ok(JudgeVerdict {
            winner: self.winner,
            confidence,
            reasoning: self.reasoning.unwrap_or_default(),
            notes,
        })
    }
}

impl JudgeVerdict {
    /// Parses a verdict from the judge model's text: the first balanced JSON object that reads
    /// as a verdict, whether the text is bare JSON, a ```json fenced block, or JSON inside prose.
    /// Accepts a numeric string as confidence and stringifies non-string notes. Does not check
    /// labels or ranges: see [`validate`].
    pub fn parse(text: &str) -> Result<JudgeVerdict, VerdictError> {
        let mut first_error: Option<String> = None;
        for candidate in json_objects(text) {
            let Ok(value) = serde_json::from_str::<Value>(candidate) else {
                continue;
            };
            if !value.is_object() {
                continue;
            }
            match serde_json::from_value::<RawVerdict>(value)
                .map_err(|e| e.to_string())
                .and_then(RawVerdict::into_verdict)
            {
                Ok(verdict) => return Ok(verdict),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        Err(VerdictError::Malformed(first_error.unwrap_or_else(|| {
            "no JSON object found in the judge's answer".to_owned()
        })))
    }
}

/// Every balanced `{...}` span of `text`, in order of its opening brace (nested spans
/// included). Braces inside JSON strings do not count.
fn json_objects(text: &str) -> impl Iterator<Item = &str> {
    text.char_indices()
        .filter(|&(_, c)| c == '{')
        .filter_map(move |(start, _)| {
            balanced_end(&text[start..]).map(|end| &text[start..start + end])
        })
}

/// The byte length of the balanced object `s` starts with (`s` starts with `{`).
fn balanced_end(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' => depth += 1,
            '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// Checks a verdict against the real branch labels.
///
/// - The winner must name a label: exactly, after trimming whitespace, or case-insensitively
///   when exactly one label matches that way; it is rewritten to the real label. Otherwise
///   [`VerdictError::UnknownWinner`] names it and lists the valid labels.
/// - The confidence must be finite and in `[0, 1]`; it is not clamped, since a judge that
///   answers 85 (a percentage) or -1 did not follow the format: [`VerdictError::InvalidConfidence`].
/// - Notes are kept for labels that resolve the same way (keyed by the real label) and dropped
///   for anything else.
pub fn validate(verdict: JudgeVerdict, labels: &[&str]) -> Result<JudgeVerdict, VerdictError> {
    let Some(winner) = resolve_label(&verdict.winner, labels) else {
        return Err(VerdictError::UnknownWinner {
            winner: verdict.winner,
            valid: labels.iter().map(|l| (*l).to_owned()).collect(),
        });
    };
    if !verdict.confidence.is_finite() || !(0.0..=1.0).contains(&verdict.confidence) {
        return Err(VerdictError::InvalidConfidence {
            confidence: verdict.confidence,
        });
    }
    let mut notes = BTreeMap::new();
    for (key, note) in verdict.notes {
        if let Some(label) = resolve_label(&key, labels) {
            if key == label {
                notes.insert(label.to_owned(), note);
            } else {
                notes.entry(label.to_owned()).or_insert(note);
            }
        }
    }
    Ok(JudgeVerdict {
        winner: winner.to_owned(),
        confidence: verdict.confidence,
        reasoning: verdict.reasoning,
        notes,
    })
}

/// [`JudgeVerdict::parse`] then [`validate`].
pub fn parse_verdict(text: &str, labels: &[&str]) -> Result<JudgeVerdict, VerdictError> {
    validate(JudgeVerdict::parse(text)?, labels)
}

fn resolve_label<'a>(name: &str, labels: &[&'a str]) -> Option<&'a str> {
    if let Some(l) = labels.iter().find(|l| **l == name) {
        return Some(l);
    }
    let trimmed = name.trim();
    if let Some(l) = labels.iter().find(|l| **l == trimmed) {
        return Some(l);
    }
    let lower = trimmed.to_lowercase();
    let mut matches = labels.iter().filter(|l| l.to_lowercase() == lower);
    match (matches.next(), matches.next()) {
        (Some(l), None) => Some(l),
        _ => None,
    }
}

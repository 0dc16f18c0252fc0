//! The model providers, declared once: the prefix of a model's name (`provider:name`)
//! says which. The spec's checks, the workers' catalogue (which dialects an entry may
//! speak) and the worker's construction of a provider all read [`Provider`]; a match on it
//! is exhaustive, so a new provider's every place is one the compiler names.

use std::fmt;

/// A model provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Provider {
    /// The scripted model (a turn file; no network): demos, tests and benchmarks.
    Scripted,
    /// OpenAI's APIs and every OpenAI-compatible server (chat completions, or the
    /// Responses API with `api = "responses"`).
    OpenAi,
    /// Anthropic's Messages API.
    Anthropic,
}

impl Provider {
    /// Every provider, in the order errors list them.
    pub const ALL: [Provider; 3] = [Provider::Scripted, Provider::OpenAi, Provider::Anthropic];

    /// The prefix of its models' names.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Scripted => "scripted",
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
        }
    }

    /// The provider whose models' names start `prefix:`.
    pub fn parse(prefix: &str) -> Option<Provider> {
        Self::ALL.into_iter().find(|p| p.name() == prefix)
    }

    /// The provider of `model` (`provider:name`, the name not empty).
    pub fn of(model: &str) -> Option<Provider> {
        let (prefix, name) = model.split_once(':')?;
        if name.is_empty() {
            return None;
        }
        Self::parse(prefix)
    }

    /// A real model's provider: reached over HTTP through a worker's catalogue, which
    /// names it as the dialect an endpoint speaks.
    pub fn is_real(self) -> bool {
        self != Provider::Scripted
    }

    /// Every provider's prefix, for an error: `scripted, openai, anthropic`.
    pub fn names() -> String {
        Self::ALL.map(Provider::name).join(", ")
    }

    /// The real providers' prefixes (the catalogue's dialects).
    pub fn dialects() -> impl Iterator<Item = Provider> {
        Self::ALL.into_iter().filter(|p| p.is_real())
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_provider_parses_from_its_own_name_only() {
        for p in Provider::ALL {
            assert_eq!(Provider::parse(p.name()), Some(p));
            assert_eq!(Provider::of(&format!("{p}:m")), Some(p));
        }
        assert_eq!(Provider::of("openai:"), None);
        assert_eq!(Provider::of("gpt-4o"), None);
        assert_eq!(Provider::parse("OpenAI"), None);
        assert_eq!(Provider::names(), "scripted, openai, anthropic");
        assert!(!Provider::dialects().any(|p| p == Provider::Scripted));
    }
}

//! Secrets (NATS password, token, nkey seed): never shown, given as a value or read from a
//! `*_file`.

use super::{ConfigError, Origin};
use serde::Deserialize;
use std::fmt;
use std::path::PathBuf;

/// A secret value. `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub(super) String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself: only for handing it to the NATS client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

/// A secret as resolved: its value, and where it came from (a value or a file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretSetting {
    pub value: Secret,
    pub origin: Origin,
    /// The file it was read from, when it came from a `*_file`.
    pub file: Option<PathBuf>,
}

/// A secret as one layer gives it: a value or a file to read it from.
pub(super) enum SecretSource {
    Value(Secret),
    File(PathBuf),
}

/// The secret of the highest layer that sets it, and where it came from.
pub(super) struct LayeredSecret {
    pub(super) source: SecretSource,
    pub(super) origin: Origin,
}

/// One secret slot of a layer: a value or a file, never both.
pub(super) fn secret_of(
    what: &'static str,
    value: Option<Secret>,
    file: Option<PathBuf>,
    origin: &Origin,
) -> Result<Option<SecretSource>, ConfigError> {
    match (value, file) {
        (Some(_), Some(_)) => Err(ConfigError::SecretTwice {
            what,
            origin: origin.to_string(),
        }),
        (Some(v), None) => Ok(Some(SecretSource::Value(v))),
        (None, Some(f)) => Ok(Some(SecretSource::File(f))),
        (None, None) => Ok(None),
    }
}

pub(super) fn resolve_secret(
    what: &'static str,
    slot: Option<LayeredSecret>,
) -> Result<Option<SecretSetting>, ConfigError> {
    let Some(LayeredSecret { source, origin }) = slot else {
        return Ok(None);
    };
    let path = match source {
        SecretSource::Value(value) => {
            return Ok(Some(SecretSetting {
                value,
                origin,
                file: None,
            }))
        }
        SecretSource::File(path) => path,
    };
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::SecretFile {
        what,
        path: path.clone(),
        origin: origin.to_string(),
        source,
    })?;
    let value = text.trim_end_matches(['\n', '\r']).to_string();
    if value.is_empty() {
        return Err(ConfigError::EmptySecret {
            what,
            path,
            origin: origin.to_string(),
        });
    }
    Ok(Some(SecretSetting {
        value: Secret(value),
        origin,
        file: Some(path),
    }))
}

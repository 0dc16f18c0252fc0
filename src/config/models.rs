//! Workers' model catalogue (`[models."MODEL"]`) and the allow-list of hosts a spec's own
//! `base_url` may point at (`[model_hosts] allow`), checked: ADR 16.

use super::{Config, ConfigError, Layer, Origin, SourcedLayer};
use forkfleet_shared::catalogue::{check_allowed_host, CatalogueModel, ModelCatalogue};
use std::path::Path;

impl Config {
    /// The catalogue and allow-list the workers of this configuration use and advertise.
    pub fn catalogue(&self) -> ModelCatalogue {
        ModelCatalogue {
            models: self.models.clone(),
            allowed_hosts: self.model_hosts.value.clone(),
        }
    }

    /// Only the catalogue of the layers [`Config::load`] reads (`forkfleet run`'s embedded
    /// workers need nothing else).
    pub fn load_catalogue(
        file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<ModelCatalogue, ConfigError> {
        let (layers, _) = Self::layers(file, env, Layer::default())?;
        let mut c = Config::merge_defaults();
        merge_models(&mut c, &layers)?;
        Ok(c.catalogue())
    }
}

/// Merge the layers' catalogue entries (a higher layer's entry replaces a lower one's
/// whole entry) and allow-lists (a higher layer's list replaces a lower one's), checked.
pub(super) fn merge_models(c: &mut Config, layers: &[SourcedLayer]) -> Result<(), ConfigError> {
    for SourcedLayer { layer, origin } in layers {
        for (model, value) in &layer.models {
            let from = origin("models");
            let entry = model_of(model, value, &from)?;
            c.models.insert(model.clone(), entry);
            c.models_origins.insert(model.clone(), from);
        }
        if let Some(allow) = &layer.model_hosts.allow {
            let from = origin("model_hosts.allow");
            for host in allow {
                check_allowed_host(host).map_err(|message| ConfigError::BadModelHost {
                    origin: from.to_string(),
                    message,
                })?;
            }
            c.model_hosts = super::Sourced {
                value: allow.iter().map(|h| h.trim().to_string()).collect(),
                origin: from,
            };
        }
    }
    Ok(())
}

/// One `[models."MODEL"]` entry, checked: the known keys, each valid.
fn model_of(
    model: &str,
    value: &toml::Value,
    origin: &Origin,
) -> Result<CatalogueModel, ConfigError> {
    let bad = |message: String| ConfigError::BadModel {
        model: model.to_string(),
        origin: origin.to_string(),
        message,
    };
    let entry: CatalogueModel = value
        .clone()
        .try_into()
        .map_err(|e: toml::de::Error| bad(e.message().trim().to_string()))?;
    entry.validate(model).map_err(bad)?;
    Ok(entry)
}

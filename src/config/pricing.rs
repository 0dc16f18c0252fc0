//! Model prices: one `[pricing."MODEL"]` entry checked, and the pricing table alone.

use super::{Config, ConfigError, Layer, Origin};
use forkfleet_shared::pricing::Price;
use std::collections::BTreeMap;
use std::path::Path;

impl Config {
    /// Only the `[pricing]` table of the layers [`Config::load`] reads (`forkfleet run`
    /// needs nothing else): a NATS setting it does not use cannot make it fail.
    pub fn load_pricing(
        file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<BTreeMap<String, Price>, ConfigError> {
        let (layers, _) = Self::layers(file, env, Layer::default())?;
        let mut pricing = BTreeMap::new();
        for l in &layers {
            for (model, value) in &l.layer.pricing {
                let price = price_of(model, value, &(l.origin)("pricing"))?;
                pricing.insert(model.clone(), price);
            }
        }
        Ok(pricing)
    }
}

/// One `[pricing."MODEL"]` entry, checked: a table of the known keys, the two required
/// ones present, every value a finite number >= 0 (integers are fine).
pub fn price_of(model: &str, value: &toml::Value, origin: &Origin) -> Result<Price, ConfigError> {
    let bad = |message: String| ConfigError::BadPrice {
        model: model.to_string(),
        origin: origin.to_string(),
        message,
    };
    if model.is_empty() {
        return Err(bad("the model name is empty".into()));
    }
    // The spec's own price type: unknown, missing and mistyped keys are its errors.
    let price: Price = value
        .clone()
        .try_into()
        .map_err(|e: toml::de::Error| bad(e.message().trim().to_string()))?;
    price.validate().map_err(bad)?;
    Ok(price)
}

//! Reading the registry: the Prometheus text exposition format (0.0.4) and the snapshot
//! the OTLP bridge exports.

use super::{catalog, collect, lock, Family, Kind, Series};
use std::fmt::Write as _;
use std::sync::atomic::Ordering;

/// One family's series as of a [`snapshot`].
#[derive(Debug, Clone, PartialEq)]
pub struct FamilySnapshot {
    /// The OTel name (dotted).
    pub name: &'static str,
    pub help: &'static str,
    /// The OTel unit (`s`, `USD`, `{token}`, ...).
    pub unit: &'static str,
    pub kind: Kind,
    pub series: Vec<SeriesSnapshot>,
}

/// One series: its labels (OTel names, in the family's order) and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct SeriesSnapshot {
    pub labels: Vec<(&'static str, String)>,
    pub value: SnapshotValue,
}

#[derive(Debug, Clone, PartialEq)]
pub enum SnapshotValue {
    /// A counter's or a gauge's value.
    Value(f64),
    Histogram {
        /// The buckets' upper bounds (`+Inf` implied after the last).
        bounds: &'static [f64],
        /// Observations per bucket, not cumulative: one more than `bounds` (the `+Inf`
        /// bucket last).
        counts: Vec<u64>,
        sum: f64,
        count: u64,
    },
}

/// Every metric of [`catalog`], after running the collectors.
pub fn snapshot() -> Vec<FamilySnapshot> {
    collect();
    snapshot_of(catalog::ALL)
}

/// The series of `families`, as they are now.
pub fn snapshot_of(families: &[&Family]) -> Vec<FamilySnapshot> {
    families
        .iter()
        .map(|f| FamilySnapshot {
            name: f.name,
            help: f.help,
            unit: f.unit,
            kind: f.kind,
            series: lock(&f.series)
                .iter()
                .map(|(values, s)| SeriesSnapshot {
                    labels: f
                        .labels
                        .iter()
                        .copied()
                        .zip(values.iter().cloned())
                        .collect(),
                    value: match &**s {
                        Series::Value(v) => {
                            SnapshotValue::Value(f64::from_bits(v.load(Ordering::Relaxed)))
                        }
                        Series::Histogram(h) => {
                            let h = lock(h);
                            SnapshotValue::Histogram {
                                bounds: f.buckets,
                                counts: h.counts.clone(),
                                sum: h.sum,
                                count: h.count,
                            }
                        }
                    },
                })
                .collect(),
        })
        .collect()
}

/// Every metric of [`catalog`] in the Prometheus text format, after running the
/// collectors (what `GET /metrics` answers).
pub fn render_prometheus() -> String {
    collect();
    render(catalog::ALL)
}

/// The Prometheus name of a family: dots as underscores, `_seconds` for a unit of `s`,
/// `_total` for a counter.
pub fn prometheus_name(f: &Family) -> String {
    let mut name = f.name.replace('.', "_");
    if f.unit == "s" {
        name.push_str("_seconds");
    }
    if f.kind == Kind::Counter {
        name.push_str("_total");
    }
    name
}

/// `families` in the Prometheus text exposition format 0.0.4.
pub fn render(families: &[&Family]) -> String {
    let mut out = String::new();
    for snap in snapshot_of(families) {
        let Some(f) = families.iter().find(|f| f.name == snap.name) else {
            continue;
        };
        let name = prometheus_name(f);
        let _ = writeln!(out, "# HELP {name} {}", escape_help(snap.help));
        let _ = writeln!(out, "# TYPE {name} {}", snap.kind.as_str());
        for s in &snap.series {
            let labels: Vec<String> = s
                .labels
                .iter()
                .map(|(k, v)| format!("{}=\"{}\"", k.replace('.', "_"), escape_value(v)))
                .collect();
            match &s.value {
                SnapshotValue::Value(v) => {
                    let _ = writeln!(out, "{name}{} {}", braces(&labels), number(*v));
                }
                SnapshotValue::Histogram {
                    bounds,
                    counts,
                    sum,
                    count,
                } => {
                    let mut cumulative = 0u64;
                    for (i, c) in counts.iter().enumerate() {
                        cumulative += c;
                        let le = bounds.get(i).map_or("+Inf".to_string(), |b| number(*b));
                        let mut with_le = labels.clone();
                        with_le.push(format!("le=\"{le}\""));
                        let _ = writeln!(out, "{name}_bucket{} {cumulative}", braces(&with_le));
                    }
                    let _ = writeln!(out, "{name}_sum{} {}", braces(&labels), number(*sum));
                    let _ = writeln!(out, "{name}_count{} {count}", braces(&labels));
                }
            }
        }
    }
    out
}

fn braces(labels: &[String]) -> String {
    if labels.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", labels.join(","))
    }
}

/// A sample value as Prometheus spells it (`+Inf`, `-Inf`, `NaN`).
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_string()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else {
        v.to_string()
    }
}

fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

//! forkfleet's own metric registry: process-wide, always on, cheap to record into.
//!
//! A metric is a [`Family`]: a name (OTel style, dotted: `forkfleet.branches`), help text, a
//! unit, a kind (counter, gauge or histogram with fixed buckets) and label names; each set
//! of label values is one series. The typed statics [`Counter`], [`Gauge`] and
//! [`Histogram`] are declared in [`catalog`] (every metric forkfleet records, in one
//! place); recording looks the series up under the family's short lock and updates it
//! with an atomic (a counter or gauge) or under the series' own lock (a histogram).
//!
//! Reading: [`render_prometheus`] (text exposition format 0.0.4) and [`snapshot`] (the
//! values as data, for the OTLP bridge). Both first run the registered collectors
//! ([`register_collector`]): functions that bring gauges read from elsewhere (a budget
//! ledger's sums) up to date.
//!
//! Prometheus names: dots become underscores, a family in seconds (unit `s`) ends in
//! `_seconds`, a counter in `_total`; label names likewise have dots as underscores.
//!
//! Cardinality is the recorder's business: no per-branch labels; per-fork series are
//! removed ([`Gauge::remove`]) a grace period after their fork ended ([`GracePeriod`]).
//!
//! Layout: this file holds the families, the collectors and the grace period; `render`
//! the Prometheus text and the snapshot; `catalog` the metrics themselves.

pub mod catalog;
mod render;

pub use render::{
    prometheus_name, render, render_prometheus, snapshot, snapshot_of, FamilySnapshot,
    SeriesSnapshot, SnapshotValue,
};

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How long a finished fork's series stay before they are removed.
pub const DEFAULT_FORK_GRACE: Duration = Duration::from_secs(300);

/// Histogram buckets of durations in seconds (model calls and the like: 10 ms to 5 min).
pub const DURATION_BUCKETS: &[f64] = &[
    0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0,
];
/// Histogram buckets of short durations in seconds (applying events: 100 µs to 10 s).
pub const FAST_DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];
/// Histogram buckets of token counts (the GenAI conventions' advice: 1 to 64 Mi tokens).
pub const TOKEN_BUCKETS: &[f64] = &[
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];

/// What a family measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (from process start).
    Counter,
    /// Set to a value, or moved up and down.
    Gauge,
    /// Observations counted into fixed buckets, with their sum and count.
    Histogram,
}

impl Kind {
    /// The Prometheus `# TYPE` of the kind.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One series: its value (an `f64` in an atomic) or its histogram.
#[derive(Debug)]
enum Series {
    Value(AtomicU64),
    Histogram(Mutex<HistogramState>),
}

#[derive(Debug, Clone, Default)]
struct HistogramState {
    /// Observations per bucket (not cumulative); the last one is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a holder panicked mid-update of one number.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A metric: its description and its series by label values (in label-name order).
#[derive(Debug)]
pub struct Family {
    name: &'static str,
    help: &'static str,
    unit: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    /// Upper bounds of the histogram's buckets, ascending (`+Inf` is implied).
    buckets: &'static [f64],
    series: Mutex<BTreeMap<Vec<String>, Arc<Series>>>,
}

impl Family {
    /// A family; `buckets` only matter for a histogram.
    pub const fn new(
        kind: Kind,
        name: &'static str,
        help: &'static str,
        unit: &'static str,
        labels: &'static [&'static str],
        buckets: &'static [f64],
    ) -> Family {
        Family {
            name,
            help,
            unit,
            kind,
            labels,
            buckets,
            series: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn labels(&self) -> &'static [&'static str] {
        self.labels
    }

    /// The series of `values` (one per label name; missing ones are empty, extra ones
    /// ignored), created on first use.
    fn series(&self, values: &[&str]) -> Arc<Series> {
        let key: Vec<String> = (0..self.labels.len())
            .map(|i| values.get(i).copied().unwrap_or("").to_string())
            .collect();
        let mut all = lock(&self.series);
        if let Some(s) = all.get(&key) {
            return s.clone();
        }
        let s = Arc::new(match self.kind {
            Kind::Histogram => Series::Histogram(Mutex::new(HistogramState {
                counts: vec![0; self.buckets.len() + 1],
                sum: 0.0,
                count: 0,
            })),
            Kind::Counter | Kind::Gauge => Series::Value(AtomicU64::new(0f64.to_bits())),
        });
        all.insert(key, s.clone());
        s
    }

    fn update(&self, values: &[&str], f: impl Fn(f64) -> f64) {
        if let Series::Value(v) = &*self.series(values) {
            let _ = v.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some(f(f64::from_bits(bits)).to_bits())
            });
        }
    }

    fn value(&self, values: &[&str]) -> Option<f64> {
        let key: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        match lock(&self.series).get(&key).map(|s| &**s) {
            Some(Series::Value(v)) => Some(f64::from_bits(v.load(Ordering::Relaxed))),
            _ => None,
        }
    }

    /// How many series the family has.
    pub fn series_count(&self) -> usize {
        lock(&self.series).len()
    }

    /// Whether the series of `values` exists.
    pub fn has(&self, values: &[&str]) -> bool {
        let key: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        lock(&self.series).contains_key(&key)
    }

    /// Remove the series of `values` (it is no longer rendered); absent is fine.
    pub fn remove(&self, values: &[&str]) {
        let key: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        lock(&self.series).remove(&key);
    }

    /// Remove every series.
    pub fn clear(&self) {
        lock(&self.series).clear();
    }
}

/// A counter family (see [`Family`]).
#[derive(Debug)]
pub struct Counter(pub Family);

impl Counter {
    pub const fn new(
        name: &'static str,
        help: &'static str,
        unit: &'static str,
        labels: &'static [&'static str],
    ) -> Counter {
        Counter(Family::new(Kind::Counter, name, help, unit, labels, &[]))
    }

    /// Add 1 to the series of `labels`.
    pub fn inc(&self, labels: &[&str]) {
        self.add(labels, 1.0);
    }

    /// Add `v` to the series of `labels`; a negative or non-finite `v` is ignored (a
    /// counter only goes up).
    pub fn add(&self, labels: &[&str], v: f64) {
        if v.is_finite() && v > 0.0 {
            self.0.update(labels, |x| x + v);
        }
    }

    /// The value of the series of `labels`, if it exists.
    pub fn get(&self, labels: &[&str]) -> Option<f64> {
        self.0.value(labels)
    }

    /// Make the series of `labels` exist (at 0 when new): a counter is served from the
    /// start, so `rate()` and `increase()` see its first increment.
    pub fn touch(&self, labels: &[&str]) {
        self.0.update(labels, |x| x);
    }

    /// Raise the series of `labels` to `total` (a monotonic total read elsewhere, such as
    /// the process's CPU time); a lower or non-finite `total` is ignored.
    pub fn advance_to(&self, labels: &[&str], total: f64) {
        if total.is_finite() {
            self.0.update(labels, |x| x.max(total));
        }
    }
}

/// A gauge family (see [`Family`]).
#[derive(Debug)]
pub struct Gauge(pub Family);

impl Gauge {
    pub const fn new(
        name: &'static str,
        help: &'static str,
        unit: &'static str,
        labels: &'static [&'static str],
    ) -> Gauge {
        Gauge(Family::new(Kind::Gauge, name, help, unit, labels, &[]))
    }

    pub fn set(&self, labels: &[&str], v: f64) {
        self.0.update(labels, |_| v);
    }

    /// Move the series of `labels` by `v` (negative to lower it).
    pub fn add(&self, labels: &[&str], v: f64) {
        self.0.update(labels, |x| x + v);
    }

    /// The value of the series of `labels`, if it exists.
    pub fn get(&self, labels: &[&str]) -> Option<f64> {
        self.0.value(labels)
    }

    /// Remove the series of `labels`.
    pub fn remove(&self, labels: &[&str]) {
        self.0.remove(labels);
    }

    /// +1 on the series of `labels` now, -1 when the guard is dropped (a thing that exists
    /// while the guard lives: a running branch).
    pub fn hold(&'static self, labels: &[&str], v: f64) -> GaugeHold {
        self.add(labels, v);
        GaugeHold {
            gauge: self,
            labels: labels.iter().map(|l| l.to_string()).collect(),
            v,
        }
    }
}

/// What [`Gauge::hold`] added, taken off again on drop.
#[derive(Debug)]
pub struct GaugeHold {
    gauge: &'static Gauge,
    labels: Vec<String>,
    v: f64,
}

impl Drop for GaugeHold {
    fn drop(&mut self) {
        let labels: Vec<&str> = self.labels.iter().map(String::as_str).collect();
        self.gauge.add(&labels, -self.v);
    }
}

/// A histogram family with fixed buckets (see [`Family`]).
#[derive(Debug)]
pub struct Histogram(pub Family);

impl Histogram {
    /// `buckets`: upper bounds, ascending (`+Inf` is implied).
    pub const fn new(
        name: &'static str,
        help: &'static str,
        unit: &'static str,
        labels: &'static [&'static str],
        buckets: &'static [f64],
    ) -> Histogram {
        Histogram(Family::new(
            Kind::Histogram,
            name,
            help,
            unit,
            labels,
            buckets,
        ))
    }

    /// Count `v` into the series of `labels`; a non-finite `v` is ignored.
    pub fn observe(&self, labels: &[&str], v: f64) {
        if !v.is_finite() {
            return;
        }
        if let Series::Histogram(h) = &*self.0.series(labels) {
            let i = self
                .0
                .buckets
                .iter()
                .position(|b| v <= *b)
                .unwrap_or(self.0.buckets.len());
            let mut h = lock(h);
            if let Some(c) = h.counts.get_mut(i) {
                *c += 1;
            }
            h.sum += v;
            h.count += 1;
        }
    }

    /// Observations of the series of `labels` so far (0 when it does not exist).
    pub fn count(&self, labels: &[&str]) -> u64 {
        let key: Vec<String> = labels.iter().map(|v| v.to_string()).collect();
        match lock(&self.0.series).get(&key).map(|s| &**s) {
            Some(Series::Histogram(h)) => lock(h).count,
            _ => 0,
        }
    }
}

type Collect = Arc<dyn Fn() + Send + Sync>;

struct Collectors {
    next: u64,
    all: Vec<(u64, Collect)>,
}

static COLLECTORS: Mutex<Collectors> = Mutex::new(Collectors {
    next: 0,
    all: Vec::new(),
});

/// Run `collect` before every read of the registry ([`render_prometheus`], [`snapshot`])
/// until the guard is dropped. A collector sets gauges from state kept elsewhere; it must
/// not register collectors itself.
#[must_use = "the collector is unregistered when the guard is dropped"]
pub fn register_collector(collect: impl Fn() + Send + Sync + 'static) -> CollectorGuard {
    let mut c = lock(&COLLECTORS);
    let id = c.next;
    c.next += 1;
    c.all.push((id, Arc::new(collect)));
    CollectorGuard { id }
}

/// Unregisters its collector when dropped.
#[derive(Debug)]
pub struct CollectorGuard {
    id: u64,
}

impl Drop for CollectorGuard {
    fn drop(&mut self) {
        lock(&COLLECTORS).all.retain(|(id, _)| *id != self.id);
    }
}

/// Run every registered collector (outside the registry's locks).
pub fn collect() {
    let all: Vec<Collect> = lock(&COLLECTORS)
        .all
        .iter()
        .map(|(_, c)| c.clone())
        .collect();
    for c in all {
        c();
    }
}

/// Which keys' series to keep: a live key's always, an ended key's for `grace` after it
/// was first seen ended (by the caller's clock, in milliseconds).
#[derive(Debug)]
pub struct GracePeriod<K> {
    grace_ms: u64,
    ended_at: HashMap<K, u64>,
}

impl<K: Hash + Eq + Clone> GracePeriod<K> {
    pub fn new(grace: Duration) -> Self {
        Self {
            grace_ms: u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
            ended_at: HashMap::new(),
        }
    }

    /// Whether `key`'s series are to be kept at `now_ms`, given whether it has `ended`. A
    /// key that is live again (a fork reopened by a follow-up) starts over.
    pub fn keep(&mut self, key: &K, ended: bool, now_ms: u64) -> bool {
        if !ended {
            self.ended_at.remove(key);
            return true;
        }
        let at = *self.ended_at.entry(key.clone()).or_insert(now_ms);
        now_ms.saturating_sub(at) < self.grace_ms
    }

    /// Forget keys `present` says are gone.
    pub fn retain(&mut self, present: impl Fn(&K) -> bool) {
        self.ended_at.retain(|k, _| present(k));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;

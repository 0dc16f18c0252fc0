use super::*;

static REQUESTS: Counter = Counter::new(
    "test.requests",
    "Requests served.\nSecond line with a \\ backslash.",
    "{request}",
    &["api.op"],
);
static TEMPERATURE: Gauge = Gauge::new("test.temperature", "A gauge.", "Cel", &["room"]);
static LATENCY: Histogram = Histogram::new("test.latency", "A histogram.", "s", &[], &[0.1, 1.0]);

#[test]
fn a_small_registry_renders_exactly() {
    REQUESTS.inc(&["fork.create"]);
    REQUESTS.add(&["fork.create"], 2.0);
    REQUESTS.add(&["fork.create"], -5.0); // ignored: a counter only goes up
    REQUESTS.inc(&["say \"hi\"\\\n"]);
    TEMPERATURE.set(&["b"], 21.5);
    TEMPERATURE.set(&["a"], -3.0);
    TEMPERATURE.set(&["gone"], 1.0);
    TEMPERATURE.remove(&["gone"]);
    LATENCY.observe(&[], 0.0625);
    LATENCY.observe(&[], 0.1);
    LATENCY.observe(&[], 0.5);
    LATENCY.observe(&[], 7.0);
    LATENCY.observe(&[], f64::NAN); // ignored
    let text = render(&[&REQUESTS.0, &TEMPERATURE.0, &LATENCY.0]);
    let expected = r#"# HELP test_requests_total Requests served.\nSecond line with a \\ backslash.
# TYPE test_requests_total counter
test_requests_total{api_op="fork.create"} 3
test_requests_total{api_op="say \"hi\"\\\n"} 1
# HELP test_temperature A gauge.
# TYPE test_temperature gauge
test_temperature{room="a"} -3
test_temperature{room="b"} 21.5
# HELP test_latency_seconds A histogram.
# TYPE test_latency_seconds histogram
test_latency_seconds_bucket{le="0.1"} 2
test_latency_seconds_bucket{le="1"} 3
test_latency_seconds_bucket{le="+Inf"} 4
test_latency_seconds_sum 7.6625
test_latency_seconds_count 4
"#;
    assert_eq!(text, expected);
}

#[test]
fn the_snapshot_has_labels_values_and_buckets() {
    static CALLS: Counter = Counter::new("test.calls", "Calls.", "{call}", &["a.b", "c"]);
    static SIZES: Histogram = Histogram::new("test.sizes", "Sizes.", "By", &["k"], &[10.0]);
    CALLS.inc(&["x", "y"]);
    SIZES.observe(&["k1"], 3.0);
    SIZES.observe(&["k1"], 30.0);
    let snap = snapshot_of(&[&CALLS.0, &SIZES.0]);
    assert_eq!(snap[0].name, "test.calls");
    assert_eq!(snap[0].kind, Kind::Counter);
    assert_eq!(
        snap[0].series,
        vec![SeriesSnapshot {
            labels: vec![("a.b", "x".to_string()), ("c", "y".to_string())],
            value: SnapshotValue::Value(1.0),
        }]
    );
    assert_eq!(snap[1].unit, "By");
    assert_eq!(
        snap[1].series[0].value,
        SnapshotValue::Histogram {
            bounds: &[10.0],
            counts: vec![1, 1],
            sum: 33.0,
            count: 2,
        }
    );
}

#[test]
fn concurrent_recording_loses_nothing() {
    static HITS: Counter = Counter::new("test.hits", "Hits.", "{hit}", &["t"]);
    static LEVEL: Gauge = Gauge::new("test.level", "Level.", "1", &[]);
    static SPREAD: Histogram = Histogram::new("test.spread", "Spread.", "1", &[], &[1.0]);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                let label = format!("{}", t % 2);
                for _ in 0..1000 {
                    HITS.inc(&[&label]);
                    LEVEL.add(&[], 1.0);
                    LEVEL.add(&[], -0.5);
                    SPREAD.observe(&[], 0.5);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(HITS.get(&["0"]), Some(4000.0));
    assert_eq!(HITS.get(&["1"]), Some(4000.0));
    assert_eq!(LEVEL.get(&[]), Some(4000.0));
    assert_eq!(SPREAD.count(&[]), 8000);
}

#[test]
fn a_hold_is_taken_off_when_dropped() {
    static RUNNING: Gauge = Gauge::new("test.running", "Running.", "1", &[]);
    let a = RUNNING.hold(&[], 1.0);
    let b = RUNNING.hold(&[], 1.0);
    assert_eq!(RUNNING.get(&[]), Some(2.0));
    drop(a);
    assert_eq!(RUNNING.get(&[]), Some(1.0));
    drop(b);
    assert_eq!(RUNNING.get(&[]), Some(0.0));
}

#[test]
fn collectors_run_before_a_read_until_dropped() {
    static SEEN: Gauge = Gauge::new("test.collected", "Collected.", "1", &[]);
    let guard = register_collector(|| SEEN.add(&[], 1.0));
    collect();
    collect();
    assert_eq!(SEEN.get(&[]), Some(2.0));
    drop(guard);
    collect();
    assert_eq!(SEEN.get(&[]), Some(2.0));
}

#[test]
fn an_ended_key_is_kept_for_the_grace_period_only() {
    let mut grace = GracePeriod::new(Duration::from_secs(300));
    assert!(grace.keep(&"f", false, 1_000));
    assert!(grace.keep(&"f", true, 2_000));
    assert!(grace.keep(&"f", true, 2_000 + 299_999));
    assert!(!grace.keep(&"f", true, 2_000 + 300_000));
    // Live again (a follow-up): kept, and its grace starts over when it ends again.
    assert!(grace.keep(&"f", false, 400_000));
    assert!(grace.keep(&"f", true, 500_000));
    assert!(grace.keep(&"f", true, 799_999));
    assert!(!grace.keep(&"f", true, 800_000));
    grace.retain(|_| false);
    assert!(grace.ended_at.is_empty());
}

/// The registry serves exactly the metrics `deploy/observability/metrics.txt` lists (the
/// names, types and labels the dashboard may query): a metric added, renamed or relabelled
/// on one side only fails here.
#[test]
fn the_catalogue_is_the_dashboards_list() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/observability/metrics.txt");
    let text = std::fs::read_to_string(&path).unwrap();
    let listed: std::collections::BTreeSet<(String, String, String)> = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(fields.len(), 3, "`{l}` in {}", path.display());
            let labels = if fields[2] == "-" { "" } else { fields[2] };
            (fields[0].into(), fields[1].into(), labels.into())
        })
        .collect();
    let served: std::collections::BTreeSet<(String, String, String)> = catalog::ALL
        .iter()
        .map(|f| {
            let labels: Vec<String> = f.labels().iter().map(|l| l.replace('.', "_")).collect();
            (
                render::prometheus_name(f),
                f.kind().as_str().to_string(),
                labels.join(","),
            )
        })
        .collect();
    assert_eq!(served, listed);
}

#[test]
fn the_cost_counter_holds_a_bounded_number_of_models() {
    // Within the bound, each model its own series; past it, new ones count as `_OTHER`
    // (what exists keeps counting under its own name).
    let account = "cost-bound-test";
    catalog::add_cost(account, "m-0", 1.0);
    let mut i = 1;
    while catalog::COST.0.series_count() < catalog::COST_MAX_SERIES {
        catalog::add_cost(account, &format!("m-{i}"), 1.0);
        i += 1;
    }
    catalog::add_cost(account, "one-too-many", 2.0);
    assert_eq!(catalog::COST.get(&[account, "one-too-many"]), None);
    assert_eq!(catalog::COST.get(&[account, "_OTHER"]), Some(2.0));
    catalog::add_cost(account, "m-0", 1.0);
    assert_eq!(catalog::COST.get(&[account, "m-0"]), Some(2.0));
}

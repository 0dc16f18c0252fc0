//! OTLP export of the process's metric registry (`forkfleet_shared::metrics`).
//!
//! The registry is the one source of every metric (it also serves `/metrics`); this module
//! turns a [`snapshot`](forkfleet_shared::metrics::snapshot) into an OTLP
//! `ExportMetricsServiceRequest` every `metrics_interval` and sends it, over HTTP/protobuf
//! or gRPC as the traces go. Counters are monotonic cumulative sums, gauges gauges,
//! histograms cumulative explicit-bucket histograms, all starting at the process's start.
//! A family with no series is left out; a series the registry dropped (a finished fork's,
//! after its grace period) is no longer sent.
//!
//! It runs on its own thread with its own single-threaded runtime, so it neither needs nor
//! slows the process's runtime; [`MetricsExport::shutdown`] sends one last snapshot within
//! [`FLUSH_BOUND`](super::FLUSH_BOUND). A failing collector is reported once (and its
//! recovery once), like the span exporter's.

use crate::config::{OtlpProtocol, TelemetrySettings};
use forkfleet_shared::metrics::{FamilySnapshot, Kind, SnapshotValue};
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient;
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{
    metric, number_data_point, AggregationTemporality, Gauge, Histogram, HistogramDataPoint,
    Metric, NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long one export request may take before it fails.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(4);

/// Nanoseconds since the Unix epoch, now.
fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn string_kv(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_string())),
        }),
        ..Default::default()
    }
}

/// The OTLP unit of a registry unit: curly-brace annotations pass as they are; a currency
/// (not a UCUM unit, which a Prometheus receiver would append to the name) becomes an
/// annotation.
fn otlp_unit(unit: &str) -> String {
    match unit {
        "USD" => "{USD}".to_string(),
        u => u.to_string(),
    }
}

/// One export request: `families` as of now, from a process started at `start_ns`, under
/// `resource`.
pub fn request(
    families: &[FamilySnapshot],
    resource: &[(String, String)],
    start_ns: u64,
    now_ns: u64,
) -> ExportMetricsServiceRequest {
    let cumulative = AggregationTemporality::Cumulative as i32;
    let metrics = families
        .iter()
        .filter(|f| !f.series.is_empty())
        .map(|f| {
            let attributes = |labels: &[(&'static str, String)]| {
                labels
                    .iter()
                    .map(|(k, v)| string_kv(k, v))
                    .collect::<Vec<_>>()
            };
            let numbers = || {
                f.series
                    .iter()
                    .filter_map(|s| match &s.value {
                        SnapshotValue::Value(v) => Some(NumberDataPoint {
                            attributes: attributes(&s.labels),
                            start_time_unix_nano: start_ns,
                            time_unix_nano: now_ns,
                            value: Some(number_data_point::Value::AsDouble(*v)),
                            ..Default::default()
                        }),
                        SnapshotValue::Histogram { .. } => None,
                    })
                    .collect::<Vec<_>>()
            };
            let data = match f.kind {
                Kind::Counter => metric::Data::Sum(Sum {
                    data_points: numbers(),
                    aggregation_temporality: cumulative,
                    is_monotonic: true,
                }),
                Kind::Gauge => metric::Data::Gauge(Gauge {
                    data_points: numbers(),
                }),
                Kind::Histogram => metric::Data::Histogram(Histogram {
                    data_points: f
                        .series
                        .iter()
                        .filter_map(|s| match &s.value {
                            SnapshotValue::Histogram {
                                bounds,
                                counts,
                                sum,
                                count,
                            } => Some(HistogramDataPoint {
                                attributes: attributes(&s.labels),
                                start_time_unix_nano: start_ns,
                                time_unix_nano: now_ns,
                                count: *count,
                                sum: Some(*sum),
                                bucket_counts: counts.clone(),
                                explicit_bounds: bounds.to_vec(),
                                ..Default::default()
                            }),
                            SnapshotValue::Value(_) => None,
                        })
                        .collect(),
                    aggregation_temporality: cumulative,
                }),
            };
            Metric {
                name: f.name.to_string(),
                description: f.help.to_string(),
                unit: otlp_unit(f.unit),
                data: Some(data),
                ..Default::default()
            }
        })
        .collect();
    ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(Resource {
                attributes: resource.iter().map(|(k, v)| string_kv(k, v)).collect(),
                ..Default::default()
            }),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(InstrumentationScope {
                    name: "forkfleet".to_string(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    ..Default::default()
                }),
                metrics,
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// Where and how requests go.
enum Sender {
    Http {
        client: reqwest::Client,
        url: String,
        headers: reqwest::header::HeaderMap,
    },
    Grpc {
        client: MetricsServiceClient<tonic::transport::Channel>,
        metadata: tonic::metadata::MetadataMap,
    },
}

impl Sender {
    fn new(settings: &TelemetrySettings, endpoint: &str) -> Result<Sender, String> {
        Ok(match settings.otlp_protocol.value {
            OtlpProtocol::HttpProtobuf => {
                let mut headers = reqwest::header::HeaderMap::new();
                for (k, v) in &settings.otlp_headers {
                    let name = reqwest::header::HeaderName::from_bytes(k.as_bytes())
                        .map_err(|_| format!("header `{k}` is not a valid HTTP header name"))?;
                    let value =
                        reqwest::header::HeaderValue::from_str(v.value.expose()).map_err(|_| {
                            format!("the value of header `{k}` is not a valid HTTP header value")
                        })?;
                    headers.insert(name, value);
                }
                Sender::Http {
                    client: super::export::OtlpTls::load(settings)?.async_client()?,
                    url: endpoint.to_string(),
                    headers,
                }
            }
            OtlpProtocol::Grpc => {
                let mut metadata = tonic::metadata::MetadataMap::new();
                for (k, v) in &settings.otlp_headers {
                    let key = tonic::metadata::MetadataKey::from_bytes(k.as_bytes())
                        .map_err(|_| format!("header `{k}` is not a valid gRPC metadata name"))?;
                    let value = v.value.expose().parse().map_err(|_| {
                        format!("the value of header `{k}` is not valid gRPC metadata")
                    })?;
                    metadata.insert(key, value);
                }
                let mut channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())
                    .map_err(|e| format!("invalid gRPC endpoint: {e}"))?
                    .timeout(EXPORT_TIMEOUT)
                    .connect_timeout(EXPORT_TIMEOUT);
                if let Some(tls) = super::export::OtlpTls::load(settings)?.tonic() {
                    channel = channel
                        .tls_config(tls)
                        .map_err(|e| format!("the collector's TLS settings: {e}"))?;
                }
                let channel = channel.connect_lazy();
                Sender::Grpc {
                    client: MetricsServiceClient::new(channel),
                    metadata,
                }
            }
        })
    }

    async fn send(&mut self, req: ExportMetricsServiceRequest) -> Result<(), String> {
        match self {
            Sender::Http {
                client,
                url,
                headers,
            } => {
                use prost::Message as _;
                let reply = client
                    .post(url.as_str())
                    .headers(headers.clone())
                    .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
                    .body(req.encode_to_vec())
                    .send()
                    .await
                    .map_err(|e| e.without_url().to_string())?;
                if reply.status().is_success() {
                    Ok(())
                } else {
                    Err(format!("the collector answered {}", reply.status()))
                }
            }
            Sender::Grpc { client, metadata } => {
                let mut request = tonic::Request::new(req);
                *request.metadata_mut() = metadata.clone();
                client
                    .export(request)
                    .await
                    .map(|_| ())
                    .map_err(|s| format!("gRPC {:?}: {}", s.code(), s.message()))
            }
        }
    }
}

/// The running export: its thread, told to stop by dropping `stop`.
pub(super) struct MetricsExport {
    stop: mpsc::Sender<()>,
    done: mpsc::Receiver<()>,
}

impl MetricsExport {
    /// Start exporting to `endpoint` every `settings.metrics_interval`, the resource
    /// attributes of `resource`.
    pub(super) fn start(
        settings: &TelemetrySettings,
        endpoint: &str,
        resource: Vec<(String, String)>,
        reporter: super::export::Reporter,
    ) -> Result<MetricsExport, String> {
        let interval = settings.metrics_interval.value;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the metric export's runtime: {e}"))?;
        // The gRPC channel is created on the thread's own runtime.
        let mut sender = {
            let _entered = runtime.enter();
            Sender::new(settings, endpoint)?
        };
        let (stop, stopped) = mpsc::channel::<()>();
        let (finished, done) = mpsc::channel::<()>();
        let start_ns = now_ns();
        std::thread::Builder::new()
            .name("forkfleet-otlp-metrics".to_string())
            .spawn(move || {
                loop {
                    let last = !matches!(
                        stopped.recv_timeout(interval),
                        Err(mpsc::RecvTimeoutError::Timeout)
                    );
                    let req = request(
                        &forkfleet_shared::metrics::snapshot(),
                        &resource,
                        start_ns,
                        now_ns(),
                    );
                    match runtime.block_on(sender.send(req)) {
                        Ok(()) => reporter.succeeded(),
                        Err(e) => reporter.failed(&e),
                    }
                    if last {
                        break;
                    }
                }
                let _ = finished.send(());
            })
            .map_err(|e| format!("cannot start the metric export's thread: {e}"))?;
        Ok(MetricsExport { stop, done })
    }

    /// Tell the thread to send its last snapshot and stop.
    pub(super) fn stop(self) -> Stopping {
        drop(self.stop);
        Stopping { done: self.done }
    }
}

/// A [`MetricsExport`] sending its last snapshot.
pub(super) struct Stopping {
    done: mpsc::Receiver<()>,
}

impl Stopping {
    /// Wait for the last snapshot to be sent, until `deadline` at the latest.
    pub(super) fn wait_until(self, deadline: std::time::Instant) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let _ = self.done.recv_timeout(left);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use forkfleet_shared::metrics::SeriesSnapshot;

    fn family(name: &'static str, unit: &'static str, kind: Kind) -> FamilySnapshot {
        FamilySnapshot {
            name,
            help: "help",
            unit,
            kind,
            series: Vec::new(),
        }
    }

    #[test]
    fn a_snapshot_becomes_cumulative_otlp_metrics() {
        let mut counter = family("forkfleet.events.applied", "{event}", Kind::Counter);
        counter.series.push(SeriesSnapshot {
            labels: vec![],
            value: SnapshotValue::Value(7.0),
        });
        let mut gauge = family("forkfleet.fork.spent_usd", "USD", Kind::Gauge);
        gauge.series.push(SeriesSnapshot {
            labels: vec![("fork_id", "f1".to_string())],
            value: SnapshotValue::Value(0.25),
        });
        let mut histogram = family("gen_ai.client.operation.duration", "s", Kind::Histogram);
        histogram.series.push(SeriesSnapshot {
            labels: vec![("gen_ai.request.model", "m".to_string())],
            value: SnapshotValue::Histogram {
                bounds: &[0.1, 1.0],
                counts: vec![2, 1, 0],
                sum: 1.5,
                count: 3,
            },
        });
        let empty = family("forkfleet.bus.reconnects", "{reconnect}", Kind::Counter);
        let req = request(
            &[counter, gauge, histogram, empty],
            &[("service.name".into(), "svc".into())],
            10,
            20,
        );
        let rm = &req.resource_metrics[0];
        assert_eq!(
            rm.resource.as_ref().unwrap().attributes[0].key,
            "service.name"
        );
        let metrics = &rm.scope_metrics[0].metrics;
        // The family with no series is left out.
        assert_eq!(metrics.len(), 3);
        let Some(metric::Data::Sum(sum)) = &metrics[0].data else {
            panic!("{:?}", metrics[0]);
        };
        assert!(sum.is_monotonic);
        assert_eq!(
            sum.aggregation_temporality,
            AggregationTemporality::Cumulative as i32
        );
        assert_eq!(sum.data_points[0].start_time_unix_nano, 10);
        assert_eq!(sum.data_points[0].time_unix_nano, 20);
        assert_eq!(
            sum.data_points[0].value,
            Some(number_data_point::Value::AsDouble(7.0))
        );
        assert_eq!(metrics[1].unit, "{USD}");
        let Some(metric::Data::Gauge(gauge)) = &metrics[1].data else {
            panic!("{:?}", metrics[1]);
        };
        assert_eq!(gauge.data_points[0].attributes[0].key, "fork_id");
        let Some(metric::Data::Histogram(h)) = &metrics[2].data else {
            panic!("{:?}", metrics[2]);
        };
        let p = &h.data_points[0];
        assert_eq!(p.explicit_bounds, vec![0.1, 1.0]);
        assert_eq!(p.bucket_counts, vec![2, 1, 0]);
        assert_eq!((p.count, p.sum), (3, Some(1.5)));
    }
}

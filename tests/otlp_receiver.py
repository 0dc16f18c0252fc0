#!/usr/bin/env python3
"""A small OTLP/HTTP receiver for the tests: writes what it receives as JSON lines.

    python3 tests/otlp_receiver.py [--count] [--tls CERT KEY [--client-ca CA]] OUT.jsonl

Listens on a free loopback port and prints that port on stdout, then serves until killed:

- POST /v1/traces (protobuf): one line per span, `{"signal": "span", "trace_id",
  "span_id", "parent_span_id", "name", "kind", "attributes": {...}, "resource": {...},
  "status": {...}}`, ids in lowercase hex ("" for no parent), attribute values flattened
  to JSON (strings, numbers, booleans, lists);
- POST /v1/metrics (protobuf): one line per metric, `{"signal": "metric", "name",
  "unit", "resource", "data": <the metric's data as protobuf's JSON mapping>}`;
- POST /v1/logs: accepted, nothing written.

With `--count` (for benchmarks, where the receiver should cost little) a request is
decoded but only counted: one line per request, `{"signal": "count", "spans": N}` or
`"metrics": N`.

With `--tls` it serves HTTPS with that certificate and key (PEM); with `--client-ca` it
also requires a client certificate signed by that CA (mutual TLS).

A request's lines are written and flushed before it is answered, so once the exporting
process has exited after its final flush, the file holds everything it sent. Needs PyPI's
`opentelemetry-proto` (scripts/setup installs it).
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

LOCK = threading.Lock()


def value_of(any_value):
    """An OTLP AnyValue as a plain JSON value."""
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [value_of(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value_of(kv.value) for kv in any_value.kvlist_value.values}
    if kind == "bytes_value":
        return any_value.bytes_value.hex()
    return getattr(any_value, kind)


def attributes_of(key_values):
    return {kv.key: value_of(kv.value) for kv in key_values}


def count_lines(path, body):
    """The one line `--count` writes for a request."""
    if path == "/v1/traces":
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return [{"signal": "count", "spans": n}]
    request = metrics_service_pb2.ExportMetricsServiceRequest()
    request.ParseFromString(body)
    n = sum(len(sm.metrics) for rm in request.resource_metrics for sm in rm.scope_metrics)
    return [{"signal": "count", "metrics": n}]


def span_lines(body):
    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(body)
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield {
                    "signal": "span",
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                    "name": span.name,
                    "kind": span.kind,
                    "scope": scope_spans.scope.name,
                    "attributes": attributes_of(span.attributes),
                    "resource": resource,
                    "status": {"code": span.status.code, "message": span.status.message},
                    "start_unix_nano": span.start_time_unix_nano,
                    "end_unix_nano": span.end_time_unix_nano,
                }


def metric_lines(body):
    request = metrics_service_pb2.ExportMetricsServiceRequest()
    request.ParseFromString(body)
    for resource_metrics in request.resource_metrics:
        resource = attributes_of(resource_metrics.resource.attributes)
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                data = MessageToDict(metric)
                for key in ("name", "unit", "description"):
                    data.pop(key, None)
                yield {
                    "signal": "metric",
                    "name": metric.name,
                    "unit": metric.unit,
                    "resource": resource,
                    "data": data,
                }


class Handler(BaseHTTPRequestHandler):
    out = None
    count = False

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        try:
            if self.count and self.path in ("/v1/traces", "/v1/metrics"):
                lines = count_lines(self.path, body)
                response = (trace_service_pb2.ExportTraceServiceResponse()
                            if self.path == "/v1/traces"
                            else metrics_service_pb2.ExportMetricsServiceResponse())
            elif self.path == "/v1/traces":
                lines = list(span_lines(body))
                response = trace_service_pb2.ExportTraceServiceResponse()
            elif self.path == "/v1/metrics":
                lines = list(metric_lines(body))
                response = metrics_service_pb2.ExportMetricsServiceResponse()
            elif self.path == "/v1/logs":
                lines = []
                response = None
            else:
                self.send_error(404, "OTLP paths are /v1/traces, /v1/metrics and /v1/logs")
                return
        except Exception as e:  # a body that does not decode: the exporter's error
            self.send_error(400, f"cannot decode the body: {e}")
            return
        with LOCK:
            for line in lines:
                self.out.write(json.dumps(line, sort_keys=True) + "\n")
            self.out.flush()
        payload = response.SerializeToString() if response is not None else b""
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format, *args):
        pass


def main():
    args = sys.argv[1:]
    if args[:1] == ["--count"]:
        Handler.count = True
        args = args[1:]
    tls = None
    client_ca = None
    if args[:1] == ["--tls"] and len(args) >= 3:
        tls = (args[1], args[2])
        args = args[3:]
        if args[:1] == ["--client-ca"] and len(args) >= 2:
            client_ca = args[1]
            args = args[2:]
    if len(args) != 1:
        print("usage: otlp_receiver.py [--count] [--tls CERT KEY [--client-ca CA]] OUT.jsonl",
              file=sys.stderr)
        sys.exit(2)
    Handler.out = open(args[0], "a", encoding="utf-8")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls:
        import ssl
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        if client_ca:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(client_ca)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

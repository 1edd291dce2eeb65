"""A local OTLP collector for tests: HTTP (POST /v1/traces) and gRPC (TraceService/Export).

Both decode the body as ExportTraceServiceRequest and keep the spans, flattened
to dicts: name, ids (hex), parent, kind, attributes, events, links, resource.
"""
from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v):
    d = MessageToDict(v)
    if "arrayValue" in d:
        return [_value_any(x) for x in d["arrayValue"].get("values", [])]
    return _value_any(d)


def _value_any(d: dict):
    for key, conv in (("stringValue", str), ("intValue", int), ("doubleValue", float), ("boolValue", bool)):
        if key in d:
            return conv(d[key])
    return d


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict]:
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append({
                    "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                    "parent_id": s.parent_span_id.hex() or None, "kind": s.kind,
                    "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                    "attributes": {a.key: _value(a.value) for a in s.attributes},
                    "events": [{"name": e.name, "attributes": {a.key: _value(a.value) for a in e.attributes}}
                               for e in s.events],
                    "links": [{"trace_id": lk.trace_id.hex(), "span_id": lk.span_id.hex()} for lk in s.links],
                    "resource": resource})
    return spans


class Collector:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def add(self, body: bytes) -> None:
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        with self.lock:
            self.spans.extend(flatten(req))


class HttpReceiver(Collector):
    def __enter__(self) -> "HttpReceiver":
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok = self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf"
                if ok:
                    collector.add(body)
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver(Collector):
    def __enter__(self) -> "GrpcReceiver":
        collector = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802
                collector.add(request.SerializeToString())
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"grpc://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(None)

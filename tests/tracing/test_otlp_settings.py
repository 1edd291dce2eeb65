"""Live OTLP export configured as OpenTelemetry's environment variables say
(tracing/span_export.py: otlp_settings), never losing spans silently: an HTTP
endpoint without a protocol is spoken to over HTTP, a contradiction is refused at
start-up, and a failing export is counted and reported once."""
import logging

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from vllm_anatomy.tracing.span_export import CountingExporter, make_otlp_exporter, otlp_settings

ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
       "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("arg,env,expected", [
    (None, {}, None),                                                                   # nothing asked
    # Jaeger's documented HTTP form, alone: HTTP, the exporter reads the URL as is
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces"}, ("http/protobuf", None)),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318"}, ("http/protobuf", None)),  # base URL: + /v1/traces
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317"}, ("grpc", None)),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:9000"}, ("grpc", None)),          # no hint: gRPC, as vLLM
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:9000", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     ("http/protobuf", None)),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:9000/v1/traces",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
     ("http/protobuf", None)),                                                         # the signal's own wins
    ("grpc://h:4317", {}, ("grpc", "http://h:4317")),                                  # vLLM's spelling
    ("http://h:4318", {}, ("http/protobuf", "http://h:4318/v1/traces")),
    ("http://h:4318/v1/traces", {}, ("http/protobuf", "http://h:4318/v1/traces")),
    ("http://h:9000", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, ("http/protobuf", "http://h:9000/v1/traces")),
    ("http://h:4318", {"OTEL_TRACES_EXPORTER": "none"}, None),
    ("http://h:4318", {"OTEL_SDK_DISABLED": "true"}, None),
])
def test_settings(monkeypatch, arg, env, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert otlp_settings(arg) == expected


@pytest.mark.parametrize("arg,env,says", [
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTLP/HTTP"),
    ("http://h:4317", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, "OTLP/gRPC"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318/v1/traces"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT instead"),
    ("h:9000", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, "http:// or https://"),
    ("http://h:9000", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "no OTLP/JSON exporter"),
    ("http://h:9000", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"}, "not supported"),
    ("http://h:9000", {"OTEL_TRACES_EXPORTER": "zipkin"}, "OTLP only"),
])
def test_refused_at_start_up(monkeypatch, arg, env, says):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=says):
        otlp_settings(arg)


def test_http_endpoint_alone_makes_an_http_exporter(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    exporter = make_otlp_exporter(None)
    assert isinstance(exporter, CountingExporter)
    assert type(exporter.inner).__module__.startswith("opentelemetry.exporter.otlp.proto.http")
    assert exporter.inner._endpoint == "http://127.0.0.1:4318/v1/traces"
    exporter.shutdown()


class Failing(SpanExporter):
    calls = 0

    def export(self, spans):
        Failing.calls += 1
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass


def test_failed_exports_are_counted_and_reported_once(caplog):
    exporter = CountingExporter(Failing(), "http/protobuf http://nowhere/v1/traces")
    with caplog.at_level(logging.WARNING, logger="vllm_anatomy.tracing.span_export"):
        for _ in range(3):
            assert exporter.export([object()] * 4) is SpanExportResult.FAILURE
    assert Failing.calls == 1                   # the next two came within the cool-down: dropped at once
    assert (exporter.failed_exports, exporter.failed_spans) == (3, 12)
    assert len(caplog.records) == 1 and "nowhere" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_anatomy.tracing.span_export"):
        exporter.shutdown()
    assert len(caplog.records) == 1 and "12 of 12 spans lost in 3 failed exports" in caplog.records[0].getMessage()

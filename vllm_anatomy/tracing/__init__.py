"""Tracing: the Recorder every orchestration layer reports through, the run store, OpenTelemetry, exporters.

This project's own: vLLM v0.27.1 has OpenTelemetry request spans only (vllm/tracing/).
"""

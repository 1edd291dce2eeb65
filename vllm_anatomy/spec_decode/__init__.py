"""Speculative decoding: draft proposers, their metadata and metrics (vllm/v1/spec_decode/)."""

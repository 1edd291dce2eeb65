#!/bin/bash
# The Python 3.12 wheels a lent GPU machine (torch 2.11 cu130, transformers, numpy; no network) lacks
# for vllm_anatomy's server and benches, and for `vllm serve` beside ../shared/peers/vllm/'s slim
# offline bundle (its OpenAI server imports uvicorn, uvloop, prometheus-fastapi-instrumentator,
# model-hosting-container-standards, aiohttp, watchfiles at start-up). One folder, ~17 MiB:
#
#   bash bench/peers/device_wheels.sh .whl          # here, where PyPI is reachable
#   # there: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#
# Versions shared with the slim vLLM bundle are pinned to the bundle's (one version of each).
set -euo pipefail
OUT=${1:-.whl}
PL="--only-binary=:all: --python-version 3.12 --implementation cp"
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do PL="$PL --platform ${p}_x86_64"; done
python3 -m pip download -q $PL -d "$OUT" \
  "fastapi==0.136.3" "starlette==1.10.0" "pydantic==2.14.4" "pydantic-core==2.50.5" "typing-extensions==4.16.0" \
  "msgspec==0.23.0" "pyzmq==27.3.0" uvicorn uvloop httptools prometheus-client prometheus-fastapi-instrumentator \
  model-hosting-container-standards aiohttp watchfiles python-multipart httpx requests gguf \
  opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http opentelemetry-instrumentation-fastapi \
  pytest pytest-timeout
# What the machine already has (a second copy would only shadow it).
rm -f "$OUT"/numpy-* "$OUT"/setuptools-* "$OUT"/packaging-* "$OUT"/pyyaml-* "$OUT"/tqdm-*
du -sh "$OUT"

# Two commands: `make run` (the main job) and `make test` (lint and type check, then all tests).
# Both depend on `make setup`, which is idempotent. `make test-fast` is the inner loop.
#
# Installs are locked: requirements.lock pins every package `make setup` installs (with its
# hashes), so a fresh machine next month gets what CI tested today. The lock is for CPython
# 3.11 on Linux x86_64 (the CI machines). Upgrading it is a deliberate step: `make test-latest`
# tries the newest versions pyproject.toml's ranges allow, then `make lock` writes them.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
LOCK   := requirements.lock
STAMP  := $(VENV)/.lock-installed
EDITABLE := $(VENV)/.editable-installed

.PHONY: setup run test test-fast test-latest lock lint typecheck gpu-test jaeger-test download browser clean-venv

setup: $(EDITABLE) browser download

# NOTE: a changed lock starts from a new venv, so nothing the old lock installed lingers.
# --no-deps: the lock is the whole set; --require-hashes: each file is the one CI tested.
# torch is the lock's CPU build (torch==2.13.0+cpu), found through pip's find-links (/opt/wheels
# on these machines); elsewhere add PyTorch's CPU index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make setup
$(STAMP): $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { \
	  echo "$(LOCK) is for CPython 3.11 (Linux x86_64); run: make setup PYTHON=python3.11"; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --require-hashes --no-deps -r $(LOCK)
	$(PIP) check
	touch $(STAMP)

# The package itself, editable, built by the lock's setuptools (no isolated build env to resolve).
$(EDITABLE): $(STAMP) pyproject.toml
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	touch $(EDITABLE)

# Debian's chromium for the browser tests (Playwright drives it; it never downloads a browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	  else echo "note: chromium is not installed and this is not root: browser tests will be skipped"; fi; }
	@# a CJK font, so the screenshots of the Self-test page show the article's questions (中文), not boxes
	@fc-list :lang=zh 2>/dev/null | grep -q . || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get install -y -qq fonts-wqy-microhei || { apt-get update -qq && apt-get install -y -qq fonts-wqy-microhei; }; \
	  else echo "note: no CJK font: the Chinese questions show as boxes in screenshots"; fi; }

download: $(EDITABLE)
	$(VENV)/bin/vllm-anatomy download

# The port: $STREAMLIT_SERVER_PORT (Streamlit's own variable), else 8501; or pass CLI flags:
#   STREAMLIT_SERVER_PORT=8600 make run      make run ARGS="--port 8600 --trace-dir /tmp/runs"
run: setup
	$(VENV)/bin/vllm-anatomy dashboard $(ARGS)

test: setup lint
	$(PY) -m pytest -q

# The inner loop: unit tests, the kernels in Triton's interpreter, the dashboard's pages
# (Streamlit AppTest) -- the tests marked `fast` (tests/conftest.py). No server, no browser;
# the default model is the one `download` cached.
test-fast: download
	$(PY) -m pytest -q -m fast

lint: $(EDITABLE)
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory typecheck

# mypy over vllm_anatomy/ (its kernels included), bench/, dashboard/, tests/ and lessons/
# ([tool.mypy] in pyproject.toml says what is checked, how the bench scripts', the tests' and
# the lessons' imports resolve, and what is still a follow-up).
typecheck: $(EDITABLE)
	$(VENV)/bin/mypy

# Only the GPU tests (kernels compiled for the device, CUDA graphs, device timings).
# Where there is no CUDA device they are all skipped, each with its reason.
# NOTE: no `setup` here: on a GPU box torch usually comes with its CUDA build.
gpu-test:
	python3 -m pytest -q -m gpu -rs tests/gpu tests/kernel_tests tests/unit/test_model_runner.py

# A real Jaeger receives a live three-process run and says, through its own API, what a user sees
# (tests/tracing/test_jaeger_live.py). Needs a `jaeger` binary on PATH (v1.75.0's all-in-one:
# `go install github.com/jaegertracing/jaeger/cmd/jaeger@v1.75.0`); skipped, with its reason, without one.
jaeger-test: setup
	$(PY) -m pytest -q -rs tests/tracing/test_jaeger_live.py

# The guard for the next upstream break (not in CI's path): the newest versions pyproject.toml's
# ranges allow, in a venv of their own, through the inner loop. torch stays the CPU 2.13.0 wheel
# (a newer one is a CUDA build of several GB: upgrade it on purpose). It prints what differs
# from the lock; if the tests pass, `make lock` takes the new versions.
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST)/bin/python -m pip install --quiet torch==2.13.0
	@# NOTE: without the constraint, --upgrade-strategy eager upgrades torch too: to the newest
	@# CUDA build (2.14.1 and its nvidia-* wheels, several GB) on 2026-12-06.
	echo "torch==2.13.0" > $(LATEST)/torch-constraint.txt
	$(LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -c $(LATEST)/torch-constraint.txt -e '.[test]'
	$(LATEST)/bin/python scripts/lock_diff.py $(LOCK)
	touch $(LATEST)/.lock-installed $(LATEST)/.editable-installed
	$(MAKE) --no-print-directory test-fast VENV=$(LATEST)

# Regenerate requirements.lock from pyproject.toml (+ its test extra) and requirements.in, with
# uv (itself pinned, in a venv of its own). Run `make test-latest` first; commit the lock with
# the change that needed it.
UV_VENV := .cache/uv-venv
lock:
	test -x $(UV_VENV)/bin/uv || { $(PYTHON) -m venv $(UV_VENV) && $(UV_VENV)/bin/pip install --quiet uv==0.13.9; }
	$(UV_VENV)/bin/uv pip compile pyproject.toml requirements.in --extra test --generate-hashes \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  --find-links /opt/wheels --no-emit-find-links --custom-compile-command 'make lock' -o $(LOCK)

clean-venv:
	rm -rf $(VENV) $(LATEST)

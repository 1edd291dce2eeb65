# Two commands: `make run` (the main job) and `make test` (lint and type check, then all tests).
# Both depend on `make setup`, which is idempotent. `make test-fast` is the inner loop.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-done

.PHONY: setup run test test-fast lint typecheck gpu-test download browser clean-venv

setup: $(STAMP) browser download

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and alone: the CPU wheel (pulling anything newer drags in CUDA).
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

# Debian's chromium for the browser tests (Playwright drives it; it never downloads a browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	  else echo "note: chromium is not installed and this is not root: browser tests will be skipped"; fi; }
	@# a CJK font, so the screenshots of the Self-test page show the article's questions (中文), not boxes
	@fc-list :lang=zh 2>/dev/null | grep -q . || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get install -y -qq fonts-wqy-microhei || { apt-get update -qq && apt-get install -y -qq fonts-wqy-microhei; }; \
	  else echo "note: no CJK font: the Chinese questions show as boxes in screenshots"; fi; }

download: $(STAMP)
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

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory typecheck

# mypy over vllm_anatomy/ and kernels/ ([tool.mypy] in pyproject.toml says what is
# checked and which packages are still a follow-up).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Only the GPU tests (kernels compiled for the device, CUDA graphs, device timings).
# Where there is no CUDA device they are all skipped, each with its reason.
# NOTE: no `setup` here: on a GPU box torch usually comes with its CUDA build.
gpu-test:
	python3 -m pytest -q -m gpu -rs tests/gpu tests/kernels tests/unit/test_model_runner.py

clean-venv:
	rm -rf $(VENV)

"""A run killed with SIGKILL mid-way is still readable up to its last committed step."""
import os
import signal
import subprocess
import sys
import time

import pytest

from vllm_anatomy.tracing.reader import list_runs, open_run

pytestmark = pytest.mark.model

_CHILD = """
import sys
from vllm_anatomy import LLM, SamplingParams
llm = LLM(sys.argv[1], trace_level="full", trace_dir=sys.argv[2])
llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 2,
             SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), use_tqdm=False)
"""


def _committed_steps(trace_dir):
    runs = [r for r in list_runs(trace_dir) if "error" not in r]
    if not runs:
        return []
    with open_run(runs[0]["path"]) as run:
        return run.steps()


def test_killed_run_is_readable(default_model_dir, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, default_model_dir, str(tmp_path)])
    try:
        deadline = time.monotonic() + 240
        while len(_committed_steps(str(tmp_path))) < 4:     # read while the run goes on
            assert proc.poll() is None and time.monotonic() < deadline, "child died or too slow"
            time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    [meta] = list_runs(str(tmp_path))
    assert "end_time_ns" not in meta                          # it never shut down
    with open_run(meta["path"]) as run:
        steps = run.steps()
        assert len(steps) >= 4 and steps == list(range(1, len(steps) + 1))
        for i in steps:                                        # every committed step is whole
            step, mr = run.snapshot(i), run.snapshot(i, "model_runner")
            assert step["step_id"] == i and mr["prepare_inputs"]["req_ids"]
        assert len(steps) < 500

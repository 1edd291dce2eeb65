"""The shipped H100 sample (samples/h100-smollm2-full.sqlite: CUDA graphs, async scheduling) as
a learner on a CPU machine reads it: what the pages say about it must hold for a GPU run.

Found by walking the dashboard in Chromium (1440x900) on the sample:
- Processes, chain ①–⑪ of the run's last steps (nothing scheduled, no forward): ⑧ and ⑨ said
  "a CPU run", ⑦ and ⑩ "a plain call ... no span of its own", on an H100 run.
"""
import os

import pytest

from dashboard import processes
from dashboard.answers.source import RunSource
from tests.dashboard.conftest import GPU_SAMPLE, ROOT

TP_SAMPLE = os.path.join(ROOT, "samples", "cpu-smollm2-tp3-full.sqlite")
pytestmark = pytest.mark.skipif(not os.path.exists(GPU_SAMPLE), reason="samples/h100-smollm2-full.sqlite not shipped")


@pytest.fixture(scope="module")
def gpu():
    return RunSource(GPU_SAMPLE)


def _rows(src: RunSource, step: int) -> dict[str, dict]:
    return {r["#"]: r for r in processes.chain_rows(processes.step_view(src, step), step)}


def test_processes_chain_of_a_step_without_a_forward_on_a_gpu_run(gpu):
    idle = [s for s in gpu.steps if not (gpu.snap(s) or {}).get("scheduler_output", {}).get("total_num_scheduled_tokens")]
    assert idle, "the sample's last steps schedule nothing (async scheduling: the last tokens are in flight)"
    rows = _rows(gpu, idle[-1])
    for marker in ("⑦", "⑧", "⑨", "⑩"):
        why = rows[marker]["process · thread"]
        assert "CPU run" not in why and "plain call" not in why, (marker, why)
        assert "no forward" in why and "nothing was scheduled" in why, (marker, why)


def test_processes_chain_of_a_graph_replay_and_of_a_cpu_run(gpu):
    replay = _rows(gpu, 5)          # 7 decodes, a full CUDA graph replay
    assert replay["⑨"]["this run's spans"] == "GPU.model_forward"
    assert "CPU run" not in replay["⑧"]["process · thread"]
    if os.path.exists(TP_SAMPLE):   # a CPU run with a forward still says why there is no kernel launch
        cpu = RunSource(TP_SAMPLE)
        step = cpu.steps[len(cpu.steps) // 2]
        rows = _rows(cpu, step)
        assert "CPU run" in rows["⑧"]["process · thread"] and "CPU run" in rows["⑨"]["process · thread"]

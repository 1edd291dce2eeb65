"""The async output's device-to-host copy runs on its own stream but after the
sampler: with the compute stream held busy, the copy must still read the values
the compute stream writes (a copy stream that does not wait would read memory
the sampler has not written yet)."""
import pytest
import torch

from vllm_anatomy.tracing.recorder import NullRecorder
from vllm_anatomy.tracing.runner_tracer import RunnerTracer
from vllm_anatomy.worker.async_output import AsyncGPUModelRunnerOutput

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_copy_stream_waits_for_the_compute_stream():
    device = torch.device("cuda")
    copy_stream = torch.cuda.Stream(device)
    for trial in range(5):
        # The "sampler": the compute stream sleeps ~tens of ms, then writes the ids.
        sampled = torch.zeros(4096, dtype=torch.int64, device=device)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        sampled.fill_(1000 + trial)
        out = AsyncGPUModelRunnerOutput.__new__(AsyncGPUModelRunnerOutput)
        out._tracer = RunnerTracer(NullRecorder(), device)
        host = out._copy_on_stream((sampled,), copy_stream)
        out._ready.synchronize()
        assert host[0].is_pinned()
        assert torch.equal(host[0], torch.full((4096,), 1000 + trial, dtype=torch.int64)), \
            f"trial {trial}: the copy did not wait for the compute stream"

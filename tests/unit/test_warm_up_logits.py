"""GPUModelRunner._warm_up_logits (worker/model_runner_startup.py): before the first request,
compute_logits runs at a row count in every size bucket the lm_head's gemm can pick a kernel
variant for, so no step of a live run compiles one (GPU-free: a fabricated runner and model)."""
from types import SimpleNamespace

import pytest
import torch

from vllm_anatomy.worker.gpu_model_runner import GPUModelRunner


@pytest.mark.parametrize("max_num_reqs", [1, 5, 16, 17, 100, 256, 300])
def test_every_bucket_of_rows_is_warmed(max_num_reqs):
    # NOTE: imported here, not at the top: the kernel module's decorators must not run
    # before tests/kernel_tests/conftest.py has had its say about TRITON_INTERPRET.
    from vllm_anatomy.kernels.skinny_gemm import m_bucket
    rows = []
    model = SimpleNamespace(compute_logits=lambda hidden: rows.append(tuple(hidden.shape)))
    runner = SimpleNamespace(max_num_reqs=max_num_reqs, device=torch.device("cpu"), model=model)
    GPUModelRunner._warm_up_logits(runner, 8, torch.float32)
    counts = [r for r, _ in rows]
    assert counts[0] == 1 and counts[-1] == max_num_reqs and counts == sorted(set(counts))
    assert all(h == 8 for _, h in rows)
    assert {m_bucket(r) for r in counts} == {m_bucket(r) for r in range(1, max_num_reqs + 1)}
    assert len(counts) <= max_num_reqs.bit_length() + 1              # a handful of launches, not one per size

"""Without a GPU and without the interpreter, every kernel wrapper refuses CPU
tensors with one clear error (vllm_anatomy/kernels/launch.py), instead of crashing in Triton."""
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = """
import torch
from vllm_anatomy.kernels.silu_and_mul import silu_and_mul
from vllm_anatomy.kernels.rms_norm import rms_norm
for call in (lambda: silu_and_mul(torch.ones(2, 8)), lambda: rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)):
    try:
        call()
    except RuntimeError as e:
        print("REFUSED:", e)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU box CPU tensors are a caller bug, not this guard")
def test_cpu_tensors_without_interpreter_get_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    refused = [line for line in out.stdout.splitlines() if line.startswith("REFUSED:")]
    assert len(refused) == 2, out.stdout + out.stderr
    assert all("TRITON_INTERPRET=1" in line for line in refused)

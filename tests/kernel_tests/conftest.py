"""Kernel tests run on a GPU when there is one, else in Triton's interpreter.

NOTE: TRITON_INTERPRET must be set before the kernels' @triton.jit decorators
run (i.e. before vllm_anatomy.kernels.* is first imported): the decorator
picks compiled or interpreted once, at import. pytest imports this conftest
before the test modules of this folder, so setting it here is early enough,
provided nothing imported the kernels earlier in the session (the attention
selector imports the Triton backend lazily for that reason).
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _early = [m for m in sys.modules if m.startswith("vllm_anatomy.kernels.")]
    if _early and os.environ["TRITON_INTERPRET"] == "1":
        raise RuntimeError(f"{_early} were imported before tests/kernel_tests/conftest.py set "
                           "TRITON_INTERPRET=1; run with TRITON_INTERPRET=1 in the environment")

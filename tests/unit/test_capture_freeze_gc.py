"""CUDA-graph capture runs with the cyclic GC collected once and frozen (vLLM: GPUModelRunner._freeze_gc).

A garbage collection inside a capture can free an earlier engine's pinned host
buffers, whose CUDA event queries invalidate the capture (model_runner_startup.py's
NOTE). These run on a CPU: the context manager itself, and capture_model calling
every capture inside it (torch.cuda's two calls and the captures replaced by recorders).
"""
import contextlib
import gc
import weakref

import pytest

from vllm_anatomy.worker.model_runner_startup import ModelRunnerStartupMixin


class _Node:
    def __init__(self):
        self.me = self          # a reference cycle: only the cyclic GC frees it


def _cycle_ref() -> weakref.ref:
    return weakref.ref(_Node())


def test_garbage_from_before_is_collected_on_entry_and_not_during():
    gc.collect()
    old_garbage = _cycle_ref()
    alive_then_dropped = _Node()
    dropped = weakref.ref(alive_then_dropped)
    with ModelRunnerStartupMixin._freeze_gc():
        assert old_garbage() is None            # collected before any capture begins
        assert gc.get_freeze_count() > 0
        del alive_then_dropped                  # garbage now, but frozen: no collection frees it in here
        gc.collect()
        assert dropped() is not None
    assert dropped() is None                    # collected once the capture is over
    assert gc.get_freeze_count() == 0


def test_capture_model_captures_every_size_inside_the_frozen_gc(monkeypatch):
    import torch

    seen = []

    class Runner(ModelRunnerStartupMixin):
        def __init__(self):
            self.cudagraph_dispatcher = type("D", (), dict(enabled=True, cudagraph_mode=type("M", (), {"name": "X"}),
                                                           capture_sizes=[8, 4], piecewise_sizes=[8, 4],
                                                           decode_sizes=[4]))()
            self.device = "cpu"
            self.tracer = type("T", (), dict(device_timer=type("DT", (), {"capturing": False})(),
                                              span=lambda self, *a, **k: contextlib.nullcontext(
                                                  type("S", (), {"set_attribute": lambda *a: None})())))()

        def _capture_sizes(self, mode, sizes):
            seen.extend((mode.name, s, gc.get_freeze_count() > 0) for s in sizes)

        def _capture_drafter_model(self):
            seen.append(("drafter", 0, gc.get_freeze_count() > 0))

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1, 1))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    Runner().capture_model()
    assert seen == [("PIECEWISE", 8, True), ("PIECEWISE", 4, True), ("FULL", 4, True), ("drafter", 0, True)]
    assert gc.get_freeze_count() == 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))

"""Where a step's K/V is written, as the KV tab's slot_mapping note and self-test Q3 say it: the
attention backend's reshape_and_cache launches, or (on CUDA, steps of <= 256 tokens) the fused
q/k norm + RoPE + KV write launch (vllm_anatomy/compilation/qk_norm_rope_kvcache_fusion.py), or Llama's
RoPE + KV write (vllm_anatomy/compilation/rope_kvcache_fusion.py);
a draft model's launches are not the target's. Fabricated spans, no Streamlit run."""
from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from dashboard.answers.q3_block_table import KV_WRITE_CALLS, kv_write, kv_write_kernel, kv_write_launches
from dashboard.components.slot_mapping import kv_write_note


def frame(*rows: tuple[str, float, bool]) -> pd.DataFrame:
    return pd.DataFrame([{"name": n, "dur_ms": d, "drafter": drafter} for n, d, drafter in rows])


def test_note_names_the_kernel_that_wrote_the_step():
    plain = frame(*[("GPU.kernel.reshape_and_cache", 0.002, False)] * 3)
    assert "`reshape_and_cache` writes" in kv_write_note(plain, "NONE", "cuda:0")
    assert "**3 launches**" in kv_write_note(plain, "NONE", "cuda:0")
    fused = frame(*[("GPU.kernel.fused_qk_norm_rope_kvcache", 0.003, False)] * 28,
                  ("GPU.kernel.reshape_and_cache", 0.002, True))            # the draft model's own write
    note = kv_write_note(fused, "NONE", "cuda:0")
    assert "`fused_qk_norm_rope_kvcache` writes" in note and "fused on this model" in note
    assert "**28 launches**" in note and "3.0 µs" in note
    llama = frame(*[("GPU.kernel.fused_rope_kvcache", 0.002, False)] * 30)
    note = kv_write_note(llama, "NONE", "cuda:0")
    assert "`fused_rope_kvcache` writes" in note and "layer's RoPE: they are fused" in note and "**30 launches**" in note
    only_drafter = frame(("GPU.kernel.reshape_and_cache", 0.002, True))
    assert "no kernel span was recorded" in kv_write_note(only_drafter, "NONE", "cuda:0")
    assert "CUDA graph replay" in kv_write_note(None, "FULL", "cuda:0")


class Source:
    """The few RunSource calls kv_write makes: spans by name, steps, ranks, meta."""

    def __init__(self, spans: list[SimpleNamespace]) -> None:
        self._spans, self.steps, self.meta = spans, [1, 2, 3], {"device": "cuda:0"}
        self.ranks: dict[int, int] = {}

    def spans(self, name: str) -> list[SimpleNamespace]:
        return [s for s in self._spans if s.name == name]


def span(name: str, step: int, start: int, drafter: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=f"GPU.kernel.{name}", step_id=step, start_ns=start, duration_ns=3000, pid=1,
                           attributes={"vllm_anatomy.num_tokens": 4, "vllm_anatomy.grid": [1],
                                       **({"vllm_anatomy.drafter": True} if drafter else {})})


def test_q3_follows_the_fused_kernel_and_finds_an_eager_step():
    src = Source([span("fused_qk_norm_rope_kvcache", 2, t) for t in (20, 10)]
                 + [span("reshape_and_cache", 3, 30), span("reshape_and_cache", 1, 5, drafter=True)])
    kernel, launches = kv_write_launches(src, 2)
    assert kernel == "fused_qk_norm_rope_kvcache" and [s.start_ns for s in launches] == [10, 20]
    assert kv_write_launches(src, 3)[0] == "reshape_and_cache"
    assert kv_write_launches(src, 1) == ("reshape_and_cache", [])      # only the draft model's write
    text, eager = kv_write(src, 2, tok=0, slot=35, bs=16, mode="NONE")
    assert text.startswith("2 launches of `fused_qk_norm_rope_kvcache` (fused with the layer's q/k norm and RoPE)")
    assert "slot 35 (block 2, offset 3)" in text and eager == 2
    llama = Source([span("fused_rope_kvcache", 2, 10)])
    assert kv_write(llama, 2, tok=0, slot=35, bs=16, mode="NONE")[0].startswith(
        "1 launch of `fused_rope_kvcache` (fused with the layer's RoPE)")
    text, eager = kv_write(src, 1, tok=0, slot=35, bs=16, mode="FULL")
    assert "replayed one CUDA graph" in text and eager == 2            # the first step that shows the launches


def test_q3_chain_row_names_the_call_that_wrote():
    fused = Source([span("fused_qk_norm_rope_kvcache", 2, 10)])
    assert kv_write_kernel(fused, 2) == "fused_qk_norm_rope_kvcache"
    assert "do_qk_norm_rope_kvcache_update" in KV_WRITE_CALLS[kv_write_kernel(fused, 2)]
    llama = Source([span("fused_rope_kvcache", 2, 10)])
    assert KV_WRITE_CALLS[kv_write_kernel(llama, 2)] == "fused_rope_kvcache (impl.do_rope_and_kv_cache_update)"
    plain = Source([span("reshape_and_cache", 3, 30)])
    assert KV_WRITE_CALLS[kv_write_kernel(plain, 3)].startswith("reshape_and_cache (Attention.do_kv_cache_update)")
    assert kv_write_kernel(plain, None) == "reshape_and_cache"        # no eager step: the plain path's name

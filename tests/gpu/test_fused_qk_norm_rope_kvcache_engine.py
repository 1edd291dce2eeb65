"""The whole engine on the GPU with Qwen3's q/k norm + RoPE + KV-cache write in one launch
(kernels/fused_qk_norm_rope_kvcache.py, compilation/qk_norm_rope_kvcache_fusion.py): the same
greedy tokens with VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE=1 and =0 and with the torch backend,
fp32, CUDA graphs on; the first step (> 256 tokens) keeps reshape_and_cache, the decodes take
the fused launch; at trace level full its kernel span stands for the cache write."""
import pytest
import torch

from tests.gpu.conftest import NUM_BLOCKS
from tests.helpers import count_calls
from tests.gpu.test_fused_qk_norm_rope_engine import tiny_qwen3_dir  # noqa: F401  (a fixture)
from vllm_anatomy.tracing.recorder import InMemoryRecorder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LENS = [3, 17, 40, 90, 1, 33, 64, 120, 7]     # 375 tokens: the first step holds > 256 of them
MAX_TOKENS = 12


def _tokens(model_dir, backend="triton", **kw):
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model_dir, device="cuda", dtype="float32", attention_backend=backend, max_model_len=512,
              num_gpu_blocks_override=NUM_BLOCKS, max_num_batched_tokens=512, max_num_seqs=16, **kw)
    num_layers = llm.llm_engine.vllm_config.model_config.num_hidden_layers
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for j in range(n)]} for i, n in enumerate(LENS)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    llm.llm_engine.shutdown()
    return num_layers, [list(o.outputs[0].token_ids) for o in outs]


def assert_fused_write_spans(rec: InMemoryRecorder, num_layers: int, kernel: str, fuses: list[str]) -> None:
    """A step of <= 256 tokens: one GPU.kernel.<kernel> span per layer, naming the slot_mapping write
    (and what it fuses), no reshape_and_cache; a bigger step: one reshape_and_cache per layer."""
    by_step: dict[int, list[str]] = {}
    fused_spans = []
    for s in rec.spans:
        if s.name.startswith("GPU.kernel."):
            by_step.setdefault(s.attrs["vllm_anatomy.step_id"], []).append(s.name)
        if s.name == f"GPU.kernel.{kernel}":
            fused_spans.append(s)
    kinds = set()
    for names in by_step.values():
        fused, rc = names.count(f"GPU.kernel.{kernel}"), names.count("GPU.kernel.reshape_and_cache")
        assert (fused, rc) in ((num_layers, 0), (0, num_layers)), names
        kinds.add(fused > 0)
    assert kinds == {True, False}
    assert fused_spans and all(s.attrs["vllm_anatomy.kv_cache_update"] == "slot_mapping"
                               and s.attrs["vllm_anatomy.fuses"] == fuses
                               and s.attrs["vllm_anatomy.num_tokens"] <= 256 for s in fused_spans)


def assert_switch_matches_unfused_and_torch(model_dir, monkeypatch, env: str, fused_module, fused_name: str) -> None:
    """With env=1 some steps (graph capture included) take the fused launch and the > 256-token first
    step keeps reshape_and_cache; with env=0 none takes it; the same greedy tokens either way and
    with the torch backend."""
    calls = count_calls(monkeypatch, fused_module, fused_name)
    monkeypatch.setenv(env, "1")
    _, on = _tokens(model_dir)
    assert calls["fused"] > 0, "no step took the fused launch (graph capture included)"
    assert calls["reshape_and_cache"] > 0, "the > 256-token first step must keep reshape_and_cache"
    calls.update(fused=0, reshape_and_cache=0)
    monkeypatch.setenv(env, "0")
    _, off = _tokens(model_dir)
    assert calls["fused"] == 0 and calls["reshape_and_cache"] > 0
    _, torch_tokens = _tokens(model_dir, "torch")
    assert on == off == torch_tokens


def test_switch_matches_unfused_and_torch_backend(tiny_qwen3_dir, monkeypatch):  # noqa: F811
    from vllm_anatomy.kernels import fused_qk_norm_rope_kvcache as fkv
    assert_switch_matches_unfused_and_torch(tiny_qwen3_dir, monkeypatch, "VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE",
                                            fkv, "fused_qk_norm_rope_kvcache")


def test_full_trace_times_the_fused_write(tiny_qwen3_dir, monkeypatch):  # noqa: F811
    """Eager steps at level full: a step of <= 256 tokens has one fused_qk_norm_rope_kvcache span
    per layer (attributes naming the slot_mapping write) and no reshape_and_cache; the first
    step (> 256 tokens) one reshape_and_cache per layer. Tokens as untraced."""
    monkeypatch.setenv("VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE", "1")
    rec = InMemoryRecorder("full")
    num_layers, traced = _tokens(tiny_qwen3_dir, recorder=rec, enforce_eager=True)
    assert traced == _tokens(tiny_qwen3_dir)[1]
    assert_fused_write_spans(rec, num_layers, "fused_qk_norm_rope_kvcache", ["fused_qk_norm_rope", "reshape_and_cache"])

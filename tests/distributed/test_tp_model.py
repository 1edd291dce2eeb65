"""The sharded model itself: N gloo ranks compute the same logits as one process.

Each rank builds the model through the loader (its slices of every weight,
read with safetensors' get_slice), runs a prefill chunk, a second chunk and
two decode steps of two sequences on its own paged KV cache (its own heads),
and every rank ends with the full [T, V] logits (all-gather). They equal the
unsharded model's to fp32 tolerance, for Llama, Qwen2 and Qwen3, at TP=2 and
at TP=4 (each KV head replicated on two ranks).
"""
import pickle
import queue
import time

import pytest
import torch
import torch.multiprocessing as mp

from vllm_anatomy.config import ModelConfig
from vllm_anatomy.distributed import parallel_state as ps
from vllm_anatomy.model_executor.loader import get_model
from vllm_anatomy.model_executor.models.llama import LlamaDecoderLayer
from vllm_anatomy.utils.network_utils import get_distributed_init_method, get_open_port

from tests.helpers import PagedSequences

PROMPTS = {"a": [5, 17, 300, 42, 8, 99, 7, 450, 3, 12, 13, 14, 200, 201, 202, 1, 2, 3, 77],
           "b": [400, 401, 9, 9, 9, 100]}


def _run_model(model_dir: str) -> tuple[list[torch.Tensor], dict]:
    """Logits of every step, and this rank's shard shapes."""
    model = get_model(ModelConfig(model=model_dir, max_model_len=512))
    seqs = PagedSequences(model, num_blocks=16, block_size=16, seed=1)
    a, b = PROMPTS["a"], PROMPTS["b"]
    logits = seqs.step([("a", a[:11]), ("b", b)])          # a's first chunk, b whole
    logits += seqs.step([("a", a[11:]), ("b", [77])])      # a's second chunk, b decodes
    logits += seqs.step([("a", [3]), ("b", [4])])          # both decode
    layer = model.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    attn = layer.self_attn
    shapes = {"qkv": tuple(attn.qkv_proj.weight.shape), "o": tuple(attn.o_proj.weight.shape),
              "gate_up": tuple(layer.mlp.gate_up_proj.weight.shape),
              "embed": tuple(model.model.embed_tokens.weight.shape),
              "heads": (attn.num_heads, attn.num_kv_heads), "kv_cache": tuple(seqs.kv_caches[0].shape)}
    return logits, shapes


def _rank_main(rank: int, world_size: int, init_method: str, model_dirs: list[str], results) -> None:
    torch.set_num_threads(1)
    ps.init_distributed_environment(world_size, rank, init_method, rank, "gloo")
    ps.initialize_model_parallel(world_size)
    try:
        # NOTE: pickled here, by value: a tensor put on a multiprocessing queue travels as a
        # shared-memory file descriptor the parent fetches from this process, and on a loaded
        # machine this process could already have exited (EOFError in the parent, seen in CI).
        results.put((rank, pickle.dumps([_run_model(d) for d in model_dirs])))
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def _run_ranks(world_size: int, model_dirs: list[str]) -> list[list[tuple[list[torch.Tensor], dict]]]:
    """Per rank, _run_model's (logits, shapes) of each model dir."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_method, model_dirs, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, list[tuple[list[torch.Tensor], dict]]] = {}
    deadline = time.monotonic() + 300
    try:
        while len(out) < world_size:
            try:
                rank, value = results.get(timeout=0.5)
                out[rank] = pickle.loads(value)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank exited with {dead}"
                assert time.monotonic() < deadline, "the ranks did not finish"
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


@pytest.fixture(scope="module")
def reference(tiny_tp_models):
    torch.set_num_threads(1)
    return {arch: _run_model(d) for arch, d in tiny_tp_models.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_logits_equal_unsharded(tp, tiny_tp_models, reference):
    archs = list(tiny_tp_models)
    per_rank = _run_ranks(tp, [tiny_tp_models[a] for a in archs])
    for i, arch in enumerate(archs):
        ref_logits, ref_shapes = reference[arch]
        for rank, results in enumerate(per_rank):
            logits, shapes = results[i]
            for step, (got, want) in enumerate(zip(logits, ref_logits)):
                # NOTE: logits reach ~10 here; 1e-4 is 1e-5 of that scale. The
                # ranks' sums only run in another order than one process' sums.
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"{arch} tp={tp} rank {rank} chunk {step}: {m}")
            # Each rank holds 1/N of the split weights (KV heads: at least one).
            kv_heads = max(1, 2 // tp)
            head_dim = ref_shapes["qkv"][0] // (4 + 2 * 2)
            assert shapes["heads"] == (4 // tp, kv_heads)
            assert shapes["qkv"] == ((4 // tp + 2 * kv_heads) * head_dim, 128)
            assert shapes["o"] == (128, ref_shapes["o"][1] // tp)
            assert shapes["gate_up"] == (2 * 256 // tp, 128)
            assert shapes["embed"] == (512 // tp, 128)
            assert shapes["kv_cache"][-2] == kv_heads          # the cache holds this rank's KV heads

"""The decode LPT order (attention/backends/decode_order.py): unified_attention's 2D kernel
walking a decode-only batch in a given order computes exactly what batch order computes,
the order is really applied (a bogus order shows), ignored where it must be (a batch with
a prefill, the 3D path), and the runner builds it from host facts into a buffer that a
captured graph replays.
"""
import numpy as np
import pytest
import torch

from tests.helpers import build_attn_metadata
from tests.kernel_tests.kernel_utils import DEVICE, ON_GPU, block_tables_for
from tests.kernel_tests.test_prefill_split import _greedy_tokens
from tests.kernel_tests.test_unified_attention import MIXED, make_batch, padded_decode_batch, segm_buffers
from vllm_anatomy.attention.backends.decode_order import DecodeSeqOrder, lpt_order
from vllm_anatomy.attention.selector import get_attn_backend
from vllm_anatomy.kernels import unified_attention as ua
from vllm_anatomy.kernels.reshape_and_cache import reshape_and_cache_ref

CONTEXTS = [0, 5, 15, 16, 37, 63, 64, 100, 200, 257, 31]     # ragged, unsorted, one empty context


def _order(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _attend(q, cache, block_table, qsl, seq_lens, max_q, **kwargs):
    out = torch.full_like(q, float("nan"))
    ua.unified_attention(q, cache[0], cache[1], out, qsl, max_q, seq_lens, int(seq_lens.max()),
                         q.shape[-1] ** -0.5, block_table, **kwargs)
    return out


def _same(a, b):
    """Bitwise on the interpreter (the same per-request arithmetic); to rounding on a GPU."""
    if ON_GPU:
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, equal_nan=True)
    else:
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# -- the kernel ------------------------------------------------------------------------------

@pytest.mark.parametrize("num_queries_per_kv", [1, 3, 8])
def test_any_order_equals_batch_order_and_reference(num_queries_per_kv):
    """fp32, GQA 1/3/8: LPT, a random permutation and the identity all equal batch order
    (the kernel's search path) and the torch reference."""
    requests = [(c, 1) for c in CONTEXTS]
    num_kv_heads = 2 if num_queries_per_kv < 8 else 1
    q, cache, block_table, qsl, seq_lens = make_batch(requests, num_queries_per_kv * num_kv_heads,
                                                      num_kv_heads, 64, torch.float32,
                                                      seed=num_queries_per_kv)
    plain = _attend(q, cache, block_table, qsl, seq_lens, 1)
    ref = ua.unified_attention_ref(q, cache[0], cache[1], qsl, seq_lens, 64 ** -0.5, block_table)
    torch.testing.assert_close(plain, ref, atol=2e-5, rtol=2e-5)
    gen = torch.Generator().manual_seed(num_queries_per_kv)
    orders = [lpt_order(seq_lens.cpu().numpy()), torch.randperm(len(requests), generator=gen).tolist(),
              list(range(len(requests)))]
    for order in orders:
        _same(_attend(q, cache, block_table, qsl, seq_lens, 1, seq_order=_order(list(order))), plain)


def test_padded_graph_batch():
    """A decode batch padded to a graph size (padding requests: query_len 0, seq_len 0): with
    the pads mapped to themselves, and with them shuffled among the real requests, the real
    rows equal the reference and the padding rows are left alone."""
    head_dim = 64
    q, cache, block_table, qsl, seq_lens = padded_decode_batch((9, 40, 130, 3), 4, 2, head_dim, pad=3, seed=2)
    ref = ua.unified_attention_ref(q[:4], cache[0], cache[1], qsl[:5], seq_lens[:4], head_dim ** -0.5,
                                   block_table[:4])
    lpt = lpt_order(seq_lens.cpu().numpy()).tolist()
    assert lpt == [2, 1, 0, 3, 4, 5, 6]          # the padding sorts last, each onto itself
    for order in (lpt, [4, 2, 6, 1, 0, 5, 3]):
        out = _attend(q, cache, block_table, qsl, seq_lens, 1, seq_order=_order(order))
        torch.testing.assert_close(out[:4], ref, atol=2e-5, rtol=2e-5)
        assert out[4:].isnan().all()


def test_order_is_applied_to_a_decode_batch():
    """The kernel reads the order: with request 1 listed twice and request 2 not at all,
    request 2's rows stay unwritten (NaN) and every other row is right. (Fails if the
    order is handed over but not applied.)"""
    requests = [(c, 1) for c in (20, 70, 45, 7)]
    q, cache, block_table, qsl, seq_lens = make_batch(requests, 4, 2, 64, torch.float32, seed=6)
    ref = ua.unified_attention_ref(q, cache[0], cache[1], qsl, seq_lens, 64 ** -0.5, block_table)
    out = _attend(q, cache, block_table, qsl, seq_lens, 1, seq_order=_order([1, 1, 0, 3]))
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()
    torch.testing.assert_close(out[[0, 1, 3]], ref[[0, 1, 3]], atol=2e-5, rtol=2e-5)
    grid = ua.default_grid(4, 4, 4, 2, 64, 1, seq_order=True)
    assert grid == (2, 4)                        # exactly one program per (KV head, request)


def test_order_is_ignored_for_a_batch_with_a_prefill_and_for_3d():
    """A batch with prefill chunks (max_seqlen_q > 1) keeps the search: the same bogus order
    changes nothing. A small decode batch on the split-KV (3D) path ignores it too."""
    q, cache, block_table, qsl, seq_lens = make_batch(MIXED, 6, 2, 64, torch.float32, seed=8)
    bogus = _order([0] * len(MIXED))
    ref = ua.unified_attention_ref(q, cache[0], cache[1], qsl, seq_lens, 64 ** -0.5, block_table)
    out = _attend(q, cache, block_table, qsl, seq_lens, 17, seq_order=bogus)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert not ua.use_seq_order(17, False, True)

    requests = [(c, 1) for c in (20, 70, 45)]
    q, cache, block_table, qsl, seq_lens = make_batch(requests, 4, 2, 64, torch.float32, seed=9)
    segm = segm_buffers(q.shape[0], 4, 4, 64)
    out = _attend(q, cache, block_table, qsl, seq_lens, 1, seq_order=_order([0, 0, 0]),
                  seq_threshold_3D=8, tile_size=16, **segm)
    assert not segm["softmax_segm_max"].isnan().all()                  # 3D ran
    ref = ua.unified_attention_ref(q, cache[0], cache[1], qsl, seq_lens, 64 ** -0.5, block_table)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert not ua.use_seq_order(1, True, True) and ua.use_seq_order(1, False, True)


# -- the order itself and the runner's buffer -----------------------------------------------------

def test_lpt_order_longest_first_stable():
    seq_lens = np.array([5, 300, 5, 0, 301, 300, 0], dtype=np.int32)
    assert lpt_order(seq_lens).tolist() == [4, 1, 5, 0, 2, 3, 6]


def test_decode_seq_order_buffer():
    """prepare: decode-only steps only; the batch's rows longest first, identity past them
    (a padded graph replay reads those), whatever an earlier, larger step left there;
    for_capture: the identity, a view of the same buffer (the address a graph keeps)."""
    order = DecodeSeqOrder(8, torch.device(DEVICE), pin_memory=False)
    captured = order.for_capture(6, 1)
    assert captured.tolist() == list(range(6))
    assert order.for_capture(6, 4) is None
    seq_lens = np.array([3, 9, 1, 9, 4, 2, 8, 7], dtype=np.int32)
    assert order.prepare(seq_lens, 8, 1).tolist() == [1, 3, 6, 7, 4, 0, 5, 2]
    step = order.prepare(seq_lens, 3, 1)
    assert step.tolist() == [1, 0, 2]
    assert order.buffer.gpu.tolist() == [1, 0, 2, 3, 4, 5, 6, 7]
    assert step.data_ptr() == captured.data_ptr() == order.buffer.gpu.data_ptr()
    assert order.prepare(seq_lens, 3, 2) is None
    # The 3D path's batches (at most seq_threshold_3D requests) get no order, and the
    # buffer is left as it was (no sort, no copy); a larger one still does.
    order.seq_threshold_3D = 3
    assert order.prepare(seq_lens[::-1].copy(), 3, 1) is None
    assert order.buffer.gpu.tolist() == [1, 0, 2, 3, 4, 5, 6, 7]
    assert order.prepare(seq_lens, 4, 1).tolist() == [1, 3, 0, 2]


def _runner(tmp_path, monkeypatch, lpt):
    import transformers

    from tests.kernel_tests.test_triton_backend import write_random_checkpoint
    from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm_anatomy.worker.gpu_model_runner import GPUModelRunner
    monkeypatch.setenv("VLLM_ANATOMY_DECODE_LPT", lpt)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    write_random_checkpoint(tmp_path, config, torch.float32, seed=0)
    vc = VllmConfig(ModelConfig(model=str(tmp_path), max_model_len=128, device=DEVICE, attention_backend="triton"),
                    CacheConfig(block_size=16, num_gpu_blocks_override=12),
                    SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128))
    return GPUModelRunner(vc, DEVICE)


def test_runner_metadata_carries_the_order(tmp_path, monkeypatch):
    """GPUModelRunner._attn_metadata: a decode-only step's metadata carries the LPT order of
    the host's seq_lens (a view of the buffer the captured dummy metadata points at); a step
    with a longer query carries none; VLLM_ANATOMY_DECODE_LPT=0: never. load_model gives the
    order the backend's split-KV threshold: batches the 3D path takes carry none."""
    from vllm_anatomy.attention.backends import triton_attn
    runner = _runner(tmp_path, monkeypatch, "1")
    runner.load_model()
    assert runner.decode_seq_order.seq_threshold_3D == triton_attn.decode_seq_threshold_3D(2) > 5
    assert runner._attn_metadata(5, 5, 1).decode_seq_order is None         # the 3D path's batch
    monkeypatch.setattr(triton_attn, "MIN_LAUNCH_GRID_SIZE_2D", 0)         # no 3D path at all
    runner = _runner(tmp_path, monkeypatch, "1")
    runner.load_model()
    assert runner.decode_seq_order.seq_threshold_3D == 0
    captured = runner._dummy_attn_metadata(8, 8, 1).decode_seq_order
    assert runner._dummy_attn_metadata(2, 8, 4).decode_seq_order is None
    runner.seq_lens.np[:5] = [10, 40, 20, 40, 1]
    runner.seq_lens.np[5:] = 0
    meta = runner._attn_metadata(5, 5, 1)
    assert meta.decode_seq_order.tolist() == [1, 3, 2, 0, 4]
    assert meta.decode_seq_order.data_ptr() == captured.data_ptr()
    assert runner.decode_seq_order.buffer.gpu[5:].tolist() == [5, 6, 7]
    assert runner._attn_metadata(5, 9, 5).decode_seq_order is None
    runner = _runner(tmp_path, monkeypatch, "0")
    assert runner.decode_seq_order is None
    assert runner._attn_metadata(5, 5, 1).decode_seq_order is None


# -- the backend ----------------------------------------------------------------------------------

def _backend_step(query_lens, seq_lens, decode_seq_order):
    """The Triton backend's forward over a cache holding every request's K/V."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    block_table = block_tables_for(seq_lens, block_size, num_blocks,
                                   max(-(-s // block_size) for s in seq_lens), seed=3)
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    for i, s in enumerate(seq_lens):
        kv = torch.randn(2, s, num_kv_heads, head_dim, generator=gen)
        slots = torch.tensor([int(block_table[i, p // block_size]) * block_size + p % block_size
                              for p in range(s)])
        reshape_and_cache_ref(kv[0], kv[1], cache[0], cache[1], slots)
    cache = cache.to(DEVICE)
    _, meta = build_attn_metadata(query_lens, seq_lens, block_table.tolist(), block_size, device=DEVICE)
    meta.decode_seq_order = decode_seq_order
    q = 2 * torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(DEVICE)
    outs = {}
    for name in ("triton", "torch"):
        impl = get_attn_backend(name).get_impl_cls()(num_heads, head_dim, num_kv_heads, head_dim ** -0.5)
        outs[name] = impl.forward(q, cache, meta, torch.full_like(q, float("nan")))
    attrs = get_attn_backend("triton").get_impl_cls()(num_heads, head_dim, num_kv_heads,
                                                      1.0)._attention_launch_attrs(q, meta)
    return outs["triton"], outs["torch"], attrs


def test_backend_applies_the_order_to_decode_steps_only(monkeypatch):
    """TritonAttentionImpl hands the metadata's order to the kernel for a decode-only step
    (a bogus order leaves a row unwritten; the LPT order equals the torch backend) and not
    for a step with a prefill (the bogus order changes nothing). Threshold 0: no 3D."""
    from vllm_anatomy.attention.backends import triton_attn
    monkeypatch.setattr(triton_attn, "MIN_LAUNCH_GRID_SIZE_2D", 0)
    seq_lens = [33, 90, 17, 64]
    out, oracle, attrs = _backend_step([1] * 4, seq_lens, _order(lpt_order(np.array(seq_lens)).tolist()))
    torch.testing.assert_close(out, oracle, atol=2e-5, rtol=2e-5)
    assert attrs["vllm_anatomy.seq_order"] == "lpt" and attrs["vllm_anatomy.grid"] == [2, 4]
    out, oracle, _ = _backend_step([1] * 4, seq_lens, _order([1, 1, 2, 3]))
    assert out[0].isnan().all()
    torch.testing.assert_close(out[1:], oracle[1:], atol=2e-5, rtol=2e-5)
    out, oracle, attrs = _backend_step([1, 5, 1, 3], seq_lens, _order([1, 1, 1, 1]))
    torch.testing.assert_close(out, oracle, atol=2e-5, rtol=2e-5)
    assert "vllm_anatomy.seq_order" not in attrs


# -- the engine -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="CPU engine on the interpreter; tests/gpu/test_triton_engine.py is its GPU twin")
def test_engine_greedy_lpt_on_equals_off_and_transformers(tiny_llama_dir, monkeypatch):
    """The whole engine (interpreted kernels, tiny random Llama, split-KV off so that every
    decode step takes the 2D kernel): greedy tokens with VLLM_ANATOMY_DECODE_LPT=1 equal those
    with =0 and transformers'; with it on, decode steps really launched with an order."""
    import transformers

    from vllm_anatomy.attention.backends import triton_attn
    monkeypatch.setattr(triton_attn, "MIN_LAUNCH_GRID_SIZE_2D", 0)
    ordered = []
    real = ua.unified_attention
    monkeypatch.setattr(ua, "unified_attention", lambda *a, **k: ordered.append(
        ua.use_seq_order(k["max_seqlen_q"], False, k.get("seq_order") is not None)) or real(*a, **k))
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate([3, 40, 17, 90, 1])]
    max_tokens = 5
    tokens = {}
    for switch in ("0", "1"):
        ordered.clear()
        monkeypatch.setenv("VLLM_ANATOMY_DECODE_LPT", switch)
        tokens[switch] = _greedy_tokens(tiny_llama_dir, "triton", prompts, max_tokens)
        assert any(ordered) == (switch == "1")       # (the engine runs in this process)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokens["hf"] = [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                min_new_tokens=max_tokens)[0, len(p):].tolist() for p in prompts]
    assert tokens["1"] == tokens["0"] == tokens["hf"]

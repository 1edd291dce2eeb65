"""The Triton backend's prefill split (VLLM_ANATOMY_PREFILL_KERNEL=1, or =cudnn) equals the torch backend.

A padded step whose fresh prefills sit between decodes, a chunk continuing
cached context and a prefix-cache-hit-like request: the fresh ones go to the
prefill kernel (reading the step's key/value), the rest to unified_attention
(which must leave the fresh ones' rows alone), and the output equals the torch
reference backend's, padding rows zero. With =cudnn the long fresh prefills
go to torch SDPA (whatever backend SDPA picks on a CPU) and the short ones to
the prefill kernel.
"""
import numpy as np
import pytest
import torch

from tests.helpers import build_attn_metadata
from tests.kernel_tests.kernel_utils import DEVICE, ON_GPU, block_tables_for, forward_through_backends, rel_err
from tests.kernel_tests.test_unified_attention import check
from vllm_anatomy.attention.backends.prefill_split import (fresh_prefill_mask, split_fresh_prefills,
                                                           warm_up_prefill_len)
from vllm_anatomy.attention.selector import get_attn_backend
from vllm_anatomy.kernels import prefill_attention as pa
from vllm_anatomy.kernels import unified_attention as ua

# (context_len, query_len): decode, fresh prefill, chunk continuation, fresh, a 1-token prompt
# (no context but one token: unified_attention's), a fresh 2-token prompt, decode.
STEP = [(30, 1), (0, 37), (16, 21), (0, 50), (0, 1), (0, 2), (47, 1)]
FRESH = [False, True, False, True, False, True, False]


def test_fresh_prefill_mask():
    query_lens = np.array([q for _, q in STEP])
    seq_lens = np.array([c + q for c, q in STEP])
    assert fresh_prefill_mask(query_lens, seq_lens).tolist() == FRESH


def _step(num_heads, num_kv_heads, head_dim, dtype, block_size=16, pad=3, seed=0):
    seq_lens = [c + q for c, q in STEP]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    block_table = block_tables_for(seq_lens, block_size, num_blocks,
                                   max(-(-s // block_size) for s in seq_lens), seed=seed)
    ctx = [(c, i) for i, (c, _) in enumerate(STEP) if c > 0]
    _, meta_ctx = build_attn_metadata([c for c, _ in ctx], [c for c, _ in ctx],
                                      [block_table[i].tolist() for _, i in ctx], block_size, device=DEVICE)
    num_tokens = sum(q for _, q in STEP)
    _, meta = build_attn_metadata([q for _, q in STEP], seq_lens, block_table.tolist(), block_size,
                                  num_padded_tokens=num_tokens + pad, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    k1 = torch.randn(meta_ctx.num_actual_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v1 = torch.randn(k1.shape, generator=gen).to(dtype).to(DEVICE)
    # key/value as views of one qkv tensor, as the model hands them over.
    qkv = torch.randn(num_tokens + pad, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv[:, :num_heads * head_dim] *= 2.0
    q, k2, v2 = qkv.to(dtype).to(DEVICE).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    shape = lambda n: (num_tokens + pad, n, head_dim)                        # noqa: E731
    return (meta_ctx, meta, num_blocks, k1, v1, q.view(shape(num_heads)), k2.view(shape(num_kv_heads)),
            v2.view(shape(num_kv_heads)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_queries_per_kv,head_dim", [(2, 64), (4, 128)])
def test_backend_split_matches_torch(monkeypatch, dtype, num_queries_per_kv, head_dim):
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", "1")
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
    calls = {"prefill": 0, "unified_skip": 0}
    real_pa, real_ua = pa.context_attention_fwd, ua.unified_attention

    def counting_pa(*args, **kwargs):
        calls["prefill"] += 1
        return real_pa(*args, **kwargs)

    def counting_ua(*args, **kwargs):
        calls["unified_skip"] += kwargs.get("skip_seq") is not None
        return real_ua(*args, **kwargs)
    monkeypatch.setattr(pa, "context_attention_fwd", counting_pa)
    monkeypatch.setattr(ua, "unified_attention", counting_ua)

    num_kv_heads, block_size = 2, 16
    num_heads = num_queries_per_kv * num_kv_heads
    meta_ctx, meta, num_blocks, k1, v1, query, k2, v2 = _step(num_heads, num_kv_heads, head_dim, dtype)
    outs, (_, impl) = forward_through_backends(("torch", "triton"), (num_heads, head_dim, num_kv_heads),
                                               num_blocks, block_size, dtype,
                                               [(k1, v1, meta_ctx), (k2, v2, meta)], query, key=k2, value=v2)
    assert impl.use_prefill_kernel
    assert calls == {"prefill": 1, "unified_skip": 1}
    assert (outs[1][-3:] == 0).all()
    check(outs[1], outs[0], dtype)
    split = meta.prefill_split[1]
    assert (split.num_prefill_reqs, split.num_prefill_tokens) == (3, 37 + 50 + 2)
    assert (split.num_other_reqs, split.num_other_tokens, split.max_other_query_len) == (4, 24, 21)
    assert split.skip_seq.tolist() == [int(f) for f in FRESH]
    # A second layer of the same step reuses the split (one host->device copy per step).
    assert split_fresh_prefills(meta, split.block_q, torch.device(DEVICE)) is split
    attrs = impl._prefill_launch_attrs(query, split)
    assert attrs["vllm_anatomy.num_tokens"] == 89 and attrs["vllm_anatomy.grid"][1] == split.work_list.shape[0]


def test_only_fresh_prefills_is_one_launch_and_switch_off_is_unchanged(monkeypatch):
    """A step of fresh prefills only: no unified_attention launch. Switch off (the
    default): no split, and the step's metadata is never touched."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    lens = [20, 33]
    block_table = block_tables_for(lens, block_size, 6, 3, seed=1)
    _, meta = build_attn_metadata(lens, lens, block_table.tolist(), block_size, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    query = (2 * torch.randn(53, num_heads, head_dim, generator=gen)).to(DEVICE)
    key, value = (torch.randn(53, num_kv_heads, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    backend = get_attn_backend("triton")
    launches = []
    monkeypatch.setattr(ua, "unified_attention", lambda *a, **k: launches.append("unified"))
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", switch)
        monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
        impl = backend.get_impl_cls()(num_heads, head_dim, num_kv_heads, 0.125)
        cache = torch.zeros(backend.get_kv_cache_shape(6, block_size, num_kv_heads, head_dim), device=DEVICE)
        impl.do_kv_cache_update(key, value, cache, meta.slot_mapping)
        meta.prefill_split = None
        outs[switch] = impl.forward(query, cache, meta, torch.empty_like(query), key=key, value=value)
        if switch == "0":
            assert launches == ["unified"] and meta.prefill_split is None
    assert launches == ["unified"], "the fresh-only step launched unified_attention"
    ref = pa.prefill_attention_ref(query, key, value, [0, 20], lens, 0.125)
    torch.testing.assert_close(outs["1"], ref, atol=2e-5, rtol=2e-5)


# VLLM_ANATOMY_PREFILL_KERNEL=cudnn with VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN=40: the fresh 50-token
# prompt of STEP is long (SDPA), the fresh 37- and 2-token ones short (the Triton prefill kernel).
SDPA_MIN_LEN = 40
STEP_STARTS = [sum(q for _, q in STEP[:i]) for i in range(len(STEP))]


def test_cudnn_split_sends_long_fresh_prefills_to_sdpa():
    """The three-way split: long fresh prefills -> SDPA (host ints), short ones -> the work
    list, the rest -> unified_attention, which skips both kinds of fresh prefill."""
    seq_lens = [c + q for c, q in STEP]
    _, meta = build_attn_metadata([q for _, q in STEP], seq_lens, [[0] * 4] * len(STEP), 16, device=DEVICE)
    split = split_fresh_prefills(meta, 32, torch.device(DEVICE), SDPA_MIN_LEN)
    assert split.sdpa_prefills == ((STEP_STARTS[3], 50),) and split.num_sdpa_tokens == 50
    assert (split.num_prefill_reqs, split.num_prefill_tokens) == (2, 37 + 2)
    assert sorted(split.work_list[:, 0].unique().tolist()) == [STEP_STARTS[1], STEP_STARTS[5]]
    assert split.work_list.shape[0] == 2 + 1                      # 37 tokens: 2 blocks of 32; 2 tokens: 1
    assert split.skip_seq.tolist() == [int(f) for f in FRESH]
    assert (split.num_other_reqs, split.num_other_tokens) == (4, 24)
    # The same metadata asked with the Triton-only switch: a split of its own, as with =1.
    only_triton = split_fresh_prefills(meta, 32, torch.device(DEVICE))
    assert only_triton is not split and only_triton.sdpa_prefills == () and only_triton.num_prefill_reqs == 3
    # Every fresh prefill long: no work item at all.
    all_long = split_fresh_prefills(meta, 32, torch.device(DEVICE), 2)
    assert all_long.num_prefill_reqs == 0 and all_long.work_list.shape == (0, 3)
    assert [q for _, q in all_long.sdpa_prefills] == [37, 50, 2]


def test_sdpa_takes_what_cudnn_takes():
    """On CUDA only fp16/bf16 with head_dim a multiple of 8 up to 128 (an fp32 engine keeps
    its long prompts on the Triton kernel); on a CPU anything."""
    from vllm_anatomy.kernels.prefill_attention_sdpa import sdpa_takes
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sdpa_takes(torch.bfloat16, 128, cuda) and sdpa_takes(torch.float16, 64, cuda)
    assert not sdpa_takes(torch.float32, 128, cuda)
    assert not sdpa_takes(torch.bfloat16, 256, cuda) and not sdpa_takes(torch.bfloat16, 100, cuda)
    assert sdpa_takes(torch.float32, 128, cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("min_len", [SDPA_MIN_LEN, 2], ids=["mixed", "all_long"])
def test_backend_cudnn_split_matches_torch(monkeypatch, dtype, min_len):
    """Switch "cudnn" on the padded mixed step (decodes, a chunk continuation, short and
    long fresh prefills): SDPA for the long, the Triton kernel for the short (not launched
    when none is short), unified_attention for the rest; output equals the torch backend's."""
    from vllm_anatomy.kernels import prefill_attention_sdpa as pa_sdpa
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", "cudnn")
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN", str(min_len))
    calls = {"prefill": 0, "sdpa": [], "unified_skip": 0}
    real_pa, real_sdpa, real_ua = pa.context_attention_fwd, pa_sdpa.sdpa_prefill_attention, ua.unified_attention

    def counting_pa(*args, **kwargs):
        calls["prefill"] += 1
        return real_pa(*args, **kwargs)

    def counting_sdpa(q, k, v, o, prefills, scale):
        calls["sdpa"].append(prefills)
        return real_sdpa(q, k, v, o, prefills, scale)

    def counting_ua(*args, **kwargs):
        calls["unified_skip"] += kwargs.get("skip_seq") is not None
        return real_ua(*args, **kwargs)
    monkeypatch.setattr(pa, "context_attention_fwd", counting_pa)
    monkeypatch.setattr(pa_sdpa, "sdpa_prefill_attention", counting_sdpa)
    monkeypatch.setattr(ua, "unified_attention", counting_ua)

    num_kv_heads, num_heads, head_dim, block_size = 2, 4, 64, 16
    meta_ctx, meta, num_blocks, k1, v1, query, k2, v2 = _step(num_heads, num_kv_heads, head_dim, dtype)
    outs, (_, impl) = forward_through_backends(("torch", "triton"), (num_heads, head_dim, num_kv_heads),
                                               num_blocks, block_size, dtype,
                                               [(k1, v1, meta_ctx), (k2, v2, meta)], query, key=k2, value=v2)
    assert (impl.prefill_kernel, impl.sdpa_min_len) == ("cudnn", min_len)
    # (on a GPU cuDNN takes bf16, not fp32: an fp32 step splits as with =1)
    takes = pa_sdpa.sdpa_takes(dtype, head_dim, torch.device(DEVICE))
    assert takes == (not ON_GPU or dtype == torch.bfloat16)
    long_ = [(STEP_STARTS[i], q) for i, (_, q) in enumerate(STEP) if FRESH[i] and q >= min_len and takes]
    assert calls == {"prefill": int(min_len == SDPA_MIN_LEN or not takes), "sdpa": [tuple(long_)] if takes else [],
                     "unified_skip": 1}
    assert (outs[1][-3:] == 0).all()
    sdpa_rows = torch.zeros(query.shape[0], dtype=torch.bool, device=DEVICE)
    for start, n in long_:
        sdpa_rows[start:start + n] = True
    check(outs[1][~sdpa_rows], outs[0][~sdpa_rows], dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(outs[1][sdpa_rows], outs[0][sdpa_rows], atol=2e-5, rtol=2e-5)
    else:
        # SDPA multiplies in bf16 (P rounded to bf16), on a CPU as on a GPU: bf16's epsilon,
        # not one final rounding (test_unified_attention.check's GPU bound).
        assert rel_err(outs[1][sdpa_rows], outs[0][sdpa_rows]) < 1e-2
    split = meta.prefill_split[1]
    if not takes:
        return
    attrs = impl._sdpa_launch_attrs(query, split)
    assert attrs["vllm_anatomy.num_tokens"] == sum(q for _, q in long_)
    assert attrs["vllm_anatomy.num_reqs"] == len(long_)


@pytest.mark.parametrize("name,value", [("VLLM_ANATOMY_PREFILL_KERNEL", "cudn"),
                                        ("VLLM_ANATOMY_PREFILL_KERNEL", "2"),
                                        ("VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN", "0"),
                                        ("VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN", "2k"),
                                        ("VLLM_ANATOMY_PREFILL_MIN_LEN", "0"),
                                        ("VLLM_ANATOMY_PREFILL_MIN_LEN", "-5")])
def test_prefill_switch_refuses_bad_values(monkeypatch, name, value):
    """A misspelt switch is an error when the backend is built, not a silent Triton run."""
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", "cudnn")
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        get_attn_backend("triton").get_impl_cls()(4, 64, 2, 0.125)


def test_min_len_keeps_short_fresh_prefills_with_unified_attention():
    """Only fresh prefills of at least min_len tokens are split off; shorter ones stay with
    unified_attention (not skipped by it); none long enough: no split at all."""
    seq_lens = [c + q for c, q in STEP]
    _, meta = build_attn_metadata([q for _, q in STEP], seq_lens, [[0] * 4] * len(STEP), 16, device=DEVICE)
    split = split_fresh_prefills(meta, 32, torch.device(DEVICE), None, 40)        # only the 50-token one
    assert (split.num_prefill_reqs, split.num_prefill_tokens) == (1, 50)
    assert split.work_list[:, 0].unique().tolist() == [STEP_STARTS[3]]
    assert split.skip_seq.tolist() == [0, 0, 0, 1, 0, 0, 0]
    assert (split.num_other_reqs, split.num_other_tokens) == (6, sum(q for _, q in STEP) - 50)
    assert split.max_other_query_len == 37
    # Asked again with another threshold: a split of its own, not the cached one.
    every = split_fresh_prefills(meta, 32, torch.device(DEVICE), None, 2)
    assert every is not split and every.num_prefill_reqs == 3
    assert split_fresh_prefills(meta, 32, torch.device(DEVICE), None, 51) is None


@pytest.mark.parametrize("switch,min_len,max_tokens,max_len,expect", [
    ("1", 2048, 16384, 4096, 2048), ("1", 2048, 1024, 4096, None), ("1", 2048, 16384, 1024, None),
    ("0", 2048, 16384, 4096, None), ("cudnn", 64, 128, 128, 64)])
def test_warm_up_prefill_len(monkeypatch, switch, min_len, max_tokens, max_len, expect):
    """Start-up compiles the prefill kernel with one dummy prefill the split takes, unless
    the switch is off or no step can hold a fresh prefill that long."""
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", switch)
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", str(min_len))
    assert warm_up_prefill_len(max_tokens, max_len) == expect


def test_prefill_switch_defaults(monkeypatch):
    """On by default, for fresh prefills of at least 2048 tokens."""
    from vllm_anatomy import envs
    monkeypatch.delenv("VLLM_ANATOMY_PREFILL_KERNEL", raising=False)
    monkeypatch.delenv("VLLM_ANATOMY_PREFILL_MIN_LEN", raising=False)
    assert (envs.VLLM_ANATOMY_PREFILL_KERNEL, envs.VLLM_ANATOMY_PREFILL_MIN_LEN) == ("1", 2048)
    impl = get_attn_backend("triton").get_impl_cls()(4, 64, 2, 0.125)
    assert (impl.use_prefill_kernel, impl.prefill_min_len) == (True, 2048)


def test_no_host_copies_no_split(monkeypatch):
    """Captured graphs' dummy metadata has no host copies: never split (a FULL graph
    must hold unified_attention alone)."""
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", "1")
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
    _, meta = build_attn_metadata([5], [5], [[0]], 16, device=DEVICE)
    meta.query_start_loc_cpu = None
    assert split_fresh_prefills(meta, 32, torch.device(DEVICE)) is None


def test_unified_attention_skip_seq_leaves_rows_alone():
    """unified_attention with skip_seq writes every row but the skipped requests'."""
    from tests.kernel_tests.test_unified_attention import make_batch
    requests = [(0, 17), (35, 1), (0, 13), (16, 16)]
    q, cache, block_table, qsl, seq_lens = make_batch(requests, 4, 2, 64, torch.float32, seed=4)
    skip = torch.tensor([1, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    out = ua.unified_attention(q, cache[0], cache[1], torch.full_like(q, float("nan")), qsl, 17, seq_lens,
                               int(seq_lens.max()), 0.125, block_table, skip_seq=skip)
    ref = ua.unified_attention_ref(q, cache[0], cache[1], qsl, seq_lens, 0.125, block_table)
    skipped = torch.zeros(q.shape[0], dtype=torch.bool)
    skipped[0:17] = skipped[18:31] = True
    assert out[skipped].isnan().all()
    torch.testing.assert_close(out[~skipped], ref[~skipped], atol=2e-5, rtol=2e-5)


def _greedy_tokens(model_dir, backend, prompts, max_tokens):
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model_dir, device="cpu", dtype="float32", attention_backend=backend, max_model_len=256,
              num_gpu_blocks_override=64, max_num_batched_tokens=64, max_num_seqs=8)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="CPU engine on the interpreter; tests/gpu/test_triton_engine.py is its GPU twin")
def test_engine_greedy_switch_on_equals_off_and_transformers(tiny_llama_dir, monkeypatch):
    """The whole engine (interpreted Triton kernels, tiny random Llama): greedy tokens with
    the prefill split on (=1, and =cudnn with fresh prefills of >= 30 tokens through SDPA)
    equal those with it off, the torch backend's and transformers'.
    Prompts of 3..90 tokens under a 64-token budget: fresh prefills, first chunks (fresh),
    continuations and decodes in the same steps."""
    import transformers

    from vllm_anatomy.kernels import prefill_attention_sdpa as pa_sdpa
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate([3, 17, 40, 90, 1, 33])]
    max_tokens = 6
    tokens: dict = {}
    launches: dict = {"triton": [], "sdpa": []}
    real, real_sdpa = pa.context_attention_fwd, pa_sdpa.sdpa_prefill_attention
    monkeypatch.setattr(pa, "context_attention_fwd", lambda *a, **k: launches["triton"].append(1) or real(*a, **k))
    monkeypatch.setattr(pa_sdpa, "sdpa_prefill_attention",
                        lambda *a, **k: launches["sdpa"].append(1) or real_sdpa(*a, **k))
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN", "30")
    for switch in ("0", "1", "cudnn"):
        launches["triton"].clear()
        launches["sdpa"].clear()
        monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", switch)
        monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
        tokens[switch] = _greedy_tokens(tiny_llama_dir, "triton", prompts, max_tokens)
        # (the engine runs in this process)
        assert bool(launches["triton"]) == (switch != "0") and bool(launches["sdpa"]) == (switch == "cudnn")
    tokens["torch"] = _greedy_tokens(tiny_llama_dir, "torch", prompts, max_tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokens["hf"] = [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                min_new_tokens=max_tokens)[0, len(p):].tolist() for p in prompts]
    assert tokens["cudnn"] == tokens["1"] == tokens["0"] == tokens["torch"] == tokens["hf"]

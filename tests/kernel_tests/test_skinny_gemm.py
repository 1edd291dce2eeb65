"""skinny_gemm (kernels/skinny_gemm.py) against its torch reference, bit-for-bit repeatable,
and the seam that sends a layer's matmul to it (model_executor/layers/utils.py:
dispatch_skinny_unquantized_gemm) with VLLM_ANATOMY_SKINNY_GEMM=1 (or =tuned where a row
was measured) and few tokens.
On a GPU the kernels compile; here they run in Triton's interpreter (fp32 dots)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_tests.kernel_utils import DEVICE, ON_GPU, assert_close_ulp, requires_cuda
from vllm_anatomy.kernels import skinny_gemm as sg
from vllm_anatomy.kernels.skinny_gemm import SkinnyGemmConfig, skinny_gemm, skinny_gemm_ref
from vllm_anatomy.model_executor.layers import utils as layer_utils
from vllm_anatomy.model_executor.layers.linear import LinearBase, RowParallelLinear
from vllm_anatomy.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

# (M, N, K): M = 1, tails of every tile side, K not a multiple of BLOCK_K, K split unevenly.
SHAPES = [(1, 96, 64), (5, 130, 200), (17, 200, 96), (40, 64, 256)]
CONFIGS = {
    "default": None,
    "serial": SkinnyGemmConfig(16, 32, 32, split_k=4),
    "kernel_swap": SkinnyGemmConfig(16, 32, 32, split_k=3, swap_ab=True, reduce="kernel"),
    "tma_serial": SkinnyGemmConfig(32, 64, 32, split_k=2, tma=True),
    "tma_swap": SkinnyGemmConfig(64, 16, 16, swap_ab=True, tma=True),
}


def _inputs(m, n, k, dtype, bias=True, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEVICE) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype) if bias else None
    return x, w, b


def _check(out, ref):
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert_close_ulp(out, ref, ulps=1.0, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference(name, shape, dtype):
    m, n, k = shape
    x, w, b = _inputs(m, n, k, dtype, bias=name != "serial")
    out = skinny_gemm(x, w, b, config=CONFIGS[name])
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    _check(out, skinny_gemm_ref(x, w, b))


@pytest.mark.parametrize("name", ["default", "serial", "tma_serial"])
def test_strided_rows_and_leading_dims(name):
    """x a column slice of a wider tensor (row stride > K; misaligned for TMA, which then
    falls back to pointers) and x with two leading dims."""
    k, n = 72, 80
    wide = torch.randn(9, k + 5, device=DEVICE)
    x = wide[:, 3:3 + k]
    _, w, b = _inputs(9, n, k, torch.float32)
    _check(skinny_gemm(x, w, b, config=CONFIGS[name]), skinny_gemm_ref(x, w, b))
    x3 = torch.randn(2, 3, k, device=DEVICE)
    out = skinny_gemm(x3, w, None, config=CONFIGS[name])
    assert out.shape == (2, 3, n)
    _check(out, skinny_gemm_ref(x3, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_equal_run_to_run_and_across_reductions(dtype):
    """The split sum's order is fixed: repeated runs, the in-launch ("serial") and the second
    launch ("kernel") reductions give the same bits."""
    x, w, b = _inputs(24, 160, 320, dtype, seed=3)
    serial = SkinnyGemmConfig(16, 32, 32, split_k=5)
    first = skinny_gemm(x, w, b, config=serial)
    for _ in range(3):
        assert torch.equal(skinny_gemm(x, w, b, config=serial), first)
    assert torch.equal(skinny_gemm(x, w, b, config=SkinnyGemmConfig(16, 32, 32, split_k=5, reduce="kernel")), first)


def test_counters_are_left_zeroed_for_the_next_launch():
    x, w, b = _inputs(20, 96, 256, torch.float32)
    cfg = SkinnyGemmConfig(16, 32, 32, split_k=4)
    counters = sg.new_counters(96, 32, DEVICE)
    assert counters.numel() >= sg.launch_grid(20, 96, 256, cfg)[0] * sg.launch_grid(20, 96, 256, cfg)[1]
    a = skinny_gemm(x, w, b, config=cfg, counters=counters)
    assert not counters.any()
    assert torch.equal(skinny_gemm(x, w, b, config=cfg, counters=counters), a)
    with pytest.raises(ValueError, match="counters"):
        skinny_gemm(x, w, b, config=cfg, counters=counters[:3])


def test_bad_input_is_refused():
    x, w, b = _inputs(4, 32, 48, torch.float32)
    with pytest.raises(ValueError, match="do not multiply"):
        skinny_gemm(x, w[:, :40])
    with pytest.raises(ValueError, match="do not multiply"):
        skinny_gemm(x, w[0])
    with pytest.raises(ValueError, match="share"):
        skinny_gemm(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="share"):
        skinny_gemm(x.to(torch.int32), w.to(torch.int32))
    with pytest.raises(ValueError, match="contiguous last"):
        skinny_gemm(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(x, w, b[:5])
    with pytest.raises(ValueError, match="power of two"):
        SkinnyGemmConfig(16, 24, 32)
    with pytest.raises(ValueError, match="reduce"):
        SkinnyGemmConfig(16, 32, 32, reduce="atomic")
    assert skinny_gemm(x[:0], w, b).shape == (0, 32)


QWEN3_0_6B = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
              "down_proj": (1024, 3072), "lm_head": (151936, 1024)}


@pytest.mark.parametrize("m", [1, 4, 16, 32, 64, 128, 192, 256])
def test_default_table_fills_the_gpu_from_shapes_alone(m):
    """Host-side choice only (no launch): for every Qwen3-0.6B decode shape the default
    config keeps every split non-empty, gives at least one wave of 132 programs or stops
    at two BLOCK_K steps per split or where the fp32 partials would outweigh W, never
    splits the lm_head, and is a function of shapes."""
    for name, (n, k) in QWEN3_0_6B.items():
        cfg = sg.default_config(m, n, k, torch.bfloat16, 132)
        assert cfg == sg.default_config(m, n, k, torch.bfloat16, 132)
        tiles_m, tiles_n, splits = sg.launch_grid(m, n, k, cfg)
        k_per_split, _ = sg.launch_splits(cfg, k)
        steps = k_per_split // cfg.block_k
        assert (splits - 1) * k_per_split < k <= splits * k_per_split and steps >= 2
        partials_double = 2 * splits * m * 4 > k * 2           # twice the split: partials outweigh W
        assert tiles_m * tiles_n * splits >= 132 or steps < 4 or splits == 16 or partials_double, (name, cfg)
        assert splits * m * 4 <= k * 2, (name, cfg)
        assert cfg.swap_ab == (m <= 64) and cfg.block_m >= min(m, 128)
        if name == "lm_head":
            assert splits == 1
        assert (cfg.block_m + cfg.block_n) * cfg.block_k * 2 * cfg.num_stages <= 160 * 1024


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", list(QWEN3_0_6B))
def test_qwen3_shapes_in_cuda_graphs(name):
    """The real decode shapes, bf16, default configs: within one bf16 ulp of the fp32 reference,
    and CUDA-graph replays (reusing the tile counters, as the engine does) give the eager bits;
    the in-launch and the second-launch reductions agree bit for bit."""
    n, k = QWEN3_0_6B[name]
    for m in (1, 16, 64, 256):
        x, w, _ = _inputs(m, n, k, torch.bfloat16, bias=False, seed=m)
        counters = sg.new_counters(n, 256, DEVICE)
        eager = skinny_gemm(x, w, counters=counters)
        assert_close_ulp(eager, skinny_gemm_ref(x, w), ulps=1.0, atol=1e-3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = skinny_gemm(x, w, counters=counters)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), (name, m)
        assert not counters.any()
        cfg = sg.pick_config(m, n, k, torch.bfloat16, sg.num_sms_of(x.device))
        if sg.launch_splits(cfg, k)[1] > 1:
            other = dataclasses.replace(cfg, reduce="kernel" if cfg.reduce == "serial" else "serial")
            assert torch.equal(skinny_gemm(x, w, config=other), eager), (name, m)


def test_tuned_rows_override_the_default(monkeypatch):
    row = SkinnyGemmConfig(32, 128, 64, split_k=2, num_warps=8, num_stages=5, tma=True)
    monkeypatch.setattr(sg, "TUNED_CONFIGS", {})                          # not the shipped rows
    monkeypatch.setitem(sg.TUNED_CONFIGS, (1024, 2048, 32), row)
    monkeypatch.setitem(sg.TUNED_CONFIGS, (1024, 2048, 64), None)
    assert sg.pick_config(17, 1024, 2048, torch.bfloat16) == row        # M 17..32: bucket 32
    assert sg.pick_config(33, 1024, 2048, torch.bfloat16) != row
    assert sg.pick_config(17, 1024, 2048, torch.float32) != row         # rows are for 16-bit types
    assert [sg.prefers_cublas(m, 1024, 2048, torch.bfloat16) for m in (32, 33, 64, 65)] == [False, True, True, False]
    assert not sg.prefers_cublas(40, 1024, 2048, torch.float32)
    assert sg.pick_config(40, 1024, 2048, torch.bfloat16) == sg.default_config(40, 1024, 2048, torch.bfloat16)


def test_launch_splits_are_never_empty():
    cfg = SkinnyGemmConfig(16, 32, 64, split_k=8)
    assert sg.launch_splits(cfg, 64 * 10) == (128, 5)       # 10 steps in 8 -> 2 per split -> 5 splits
    assert sg.launch_splits(cfg, 100) == (64, 2)
    assert sg.launch_splits(cfg, 64) == (64, 1)


# ------------------------------------------------------------------ the seam


def _layers():
    torch.manual_seed(0)
    lin = LinearBase(48, 40, bias=True).to(DEVICE)
    row = RowParallelLinear(48, 24, bias=True).to(DEVICE)
    embed = VocabParallelEmbedding(56, 48).to(DEVICE)
    head = ParallelLMHead(56, 48).to(DEVICE).tie_weights(embed)
    with torch.no_grad():
        for p in (lin.weight, lin.bias, row.weight, row.bias, embed.weight):
            p.copy_(torch.randn_like(p))
    return lin, row, head


def test_switches(monkeypatch):
    """"tuned" by default, "1" and "0" (and their spellings) too, anything else refused;
    never off CUDA; the threshold is a positive int, 256 by default."""
    monkeypatch.delenv("VLLM_ANATOMY_SKINNY_GEMM", raising=False)
    monkeypatch.delenv("VLLM_ANATOMY_SKINNY_GEMM_MAX_M", raising=False)
    from vllm_anatomy import envs
    assert envs.VLLM_ANATOMY_SKINNY_GEMM == "tuned" and envs.VLLM_ANATOMY_SKINNY_GEMM_MAX_M == 256
    lin, _, _ = _layers()
    assert not layer_utils.dispatch_skinny_unquantized_gemm(lin) and "gemm" not in vars(lin)   # no row for 40x48
    monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM", "1")
    assert layer_utils.dispatch_skinny_unquantized_gemm(lin) == ON_GPU       # CPU tensors: never
    for value, parsed in (("0", "0"), ("false", "0"), ("", "0"), ("true", "1"), ("tuned", "tuned")):
        monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM", value)
        assert envs.VLLM_ANATOMY_SKINNY_GEMM == parsed
        if parsed == "0":
            assert not layer_utils.dispatch_skinny_unquantized_gemm(_layers()[0])
    for bad in ("2", "Tuned", "on"):
        monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM", bad)
        with pytest.raises(ValueError, match="VLLM_ANATOMY_SKINNY_GEMM="):
            envs.VLLM_ANATOMY_SKINNY_GEMM  # noqa: B018
    monkeypatch.delenv("VLLM_ANATOMY_SKINNY_GEMM")
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM_MAX_M", bad)
        with pytest.raises(ValueError, match="VLLM_ANATOMY_SKINNY_GEMM_MAX_M"):
            envs.VLLM_ANATOMY_SKINNY_GEMM_MAX_M  # noqa: B018


def test_tuned_mode_takes_only_the_measured_rows(monkeypatch):
    """VLLM_ANATOMY_SKINNY_GEMM=tuned (the default): a 16-bit weight with a config row in some
    bucket gets a gemm that runs the kernel in those buckets only (no row, or a None row:
    F.linear); a weight without any config row, an fp32 one, or one off Hopper keeps F.linear."""
    monkeypatch.delenv("VLLM_ANATOMY_SKINNY_GEMM", raising=False)
    monkeypatch.setenv("VLLM_ANATOMY_CPU_ONEDNN_GEMM", "0")
    monkeypatch.setattr(layer_utils, "_on_cuda", lambda weight: True)
    hopper = [True]
    monkeypatch.setattr(layer_utils, "_on_hopper", lambda weight: hopper[0])
    calls = []
    real = sg.skinny_gemm

    def counting(x, weight, bias=None, **kw):
        calls.append(x.shape[0])
        return real(x, weight, bias, **kw)
    monkeypatch.setattr(sg, "skinny_gemm", counting)
    row = SkinnyGemmConfig(16, 32, 32, split_k=2, num_warps=4, num_stages=2)
    monkeypatch.setitem(sg.TUNED_CONFIGS, (40, 48, 32), row)          # M 17..32 only
    monkeypatch.setitem(sg.TUNED_CONFIGS, (40, 48, 64), None)         # cuBLAS measured faster
    dtype = torch.float16
    lin = LinearBase(48, 40, bias=True).to(DEVICE, dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn_like(lin.weight))
        lin.bias.copy_(torch.randn_like(lin.bias))
    assert layer_utils.dispatch_unquantized_gemm(lin) and "gemm" in vars(lin)
    for t in (3, 17, 32, 33, 64, 100):
        x = torch.randn(t, 48, device=DEVICE).to(dtype)
        calls.clear()
        ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        torch.testing.assert_close(lin(x).float(), ref, rtol=2e-2, atol=2e-2)
        assert calls == ([t] if 17 <= t <= 32 else []), t
    other = LinearBase(48, 24).to(DEVICE, dtype)                       # no row for 24x48
    assert not layer_utils.dispatch_unquantized_gemm(other) and "gemm" not in vars(other)
    fp32 = LinearBase(48, 40).to(DEVICE)                               # rows are for 16-bit types
    assert not layer_utils.dispatch_unquantized_gemm(fp32) and "gemm" not in vars(fp32)
    hopper[0] = False
    elsewhere = LinearBase(48, 40).to(DEVICE, dtype)
    assert not layer_utils.dispatch_unquantized_gemm(elsewhere) and "gemm" not in vars(elsewhere)


def test_the_committed_rows_name_qwen3_shapes_and_win_somewhere():
    """The shipped TUNED_CONFIGS (measured on an H100): every key is a Qwen3-0.6B decode shape
    and a bucket of M_BUCKETS, and some rows are configs (else "tuned" would be "0")."""
    shapes = set(QWEN3_0_6B.values())
    assert sg.TUNED_CONFIGS and all((n, k) in shapes and b in sg.M_BUCKETS for n, k, b in sg.TUNED_CONFIGS)
    assert any(isinstance(c, SkinnyGemmConfig) for c in sg.TUNED_CONFIGS.values())
    assert sg.tuned_buckets(1024, 3072) == [16, 32, 64]                 # down_proj, split-K 4


def test_seam_takes_the_kernel_under_the_threshold_only(monkeypatch):
    """With the switch on, a linear layer (with bias), a row-parallel one and the tied lm_head
    each get their own gemm: skinny_gemm for <= VLLM_ANATOMY_SKINNY_GEMM_MAX_M tokens (with the
    layer's counters), F.linear above; results equal F.linear's to rounding."""
    monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM", "1")
    monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM_MAX_M", "8")
    monkeypatch.setenv("VLLM_ANATOMY_CPU_ONEDNN_GEMM", "0")         # CPU: let the dispatch reach CUDA's
    monkeypatch.setattr(layer_utils, "_on_cuda", lambda weight: True)
    calls = []
    real = sg.skinny_gemm

    def counting(x, weight, bias=None, **kw):
        calls.append((x.shape[0], kw["counters"].data_ptr()))
        return real(x, weight, bias, **kw)
    monkeypatch.setattr(sg, "skinny_gemm", counting)
    lin, row, head = _layers()
    for layer in (lin, row, head):
        assert layer_utils.dispatch_unquantized_gemm(layer) and "gemm" in vars(layer)
    for t in (1, 8, 9, 20):
        x = torch.randn(t, 48, device=DEVICE)
        calls.clear()
        _check(lin(x), F.linear(x, lin.weight, lin.bias))
        _check(row(x), F.linear(x, row.weight, row.bias))
        _check(head.gemm(x, head.weight, None), F.linear(x, head.weight))
        assert [c[0] for c in calls] == ([t] * 3 if t <= 8 else [])
        assert len({c[1] for c in calls}) == len(calls)              # each layer its own counters
    # A None row of the table (bf16/fp16 only): cuBLAS measured faster there, F.linear stays.
    monkeypatch.setitem(sg.TUNED_CONFIGS, (40, 48, 16), None)
    lin16 = LinearBase(48, 40).to(DEVICE, torch.bfloat16)
    assert layer_utils.dispatch_unquantized_gemm(lin16)
    calls.clear()
    lin16(torch.randn(3, 48, device=DEVICE, dtype=torch.bfloat16))
    lin(torch.randn(3, 48, device=DEVICE))
    row(torch.randn(3, 48, device=DEVICE))
    assert [c[0] for c in calls] == [3, 3]                               # the fp32 ones only
    monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM", "0")
    plain = _layers()[0]
    assert not layer_utils.dispatch_unquantized_gemm(plain) and "gemm" not in vars(plain)

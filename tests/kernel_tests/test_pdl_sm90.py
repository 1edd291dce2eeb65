"""PDL (kernels/pdl.py) in the decode kernels' PTX for sm_90, compiled offline (no GPU): with
USE_PDL=True every kernel holds griddepcontrol.wait and no global load, store or atomic comes
before it (the GEMM's L2 prefetches of W alone do), the GEMM prefetches and every kernel lets its
dependents launch; with USE_PDL=False none of those instructions is there.
(A subprocess: this folder's tests import the kernels interpreted.)"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AOT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_anatomy.kernels import (fused_qk_norm_rope as fqk, fused_qk_norm_rope_kvcache as fkv, rms_norm as rn,
                                  silu_and_mul as sm, skinny_gemm as sg, unified_attention as ua)

FLOATS = {"eps", "scale_log2"}
INT_PTRS = {"block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr", "skip_seq_ptr", "seq_order_ptr",
            "counter_ptr", "positions_ptr"}
FP32_PTRS = {"partial_ptr", "cos_sin_ptr", "segm_output_ptr", "segm_max_ptr", "segm_expsum_ptr"}

def sig_of(fn, constexprs, types):
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name in types:
            return types[name]
        if name in FLOATS:
            return "fp32"
        if name.endswith("_ptr"):
            return "*i64" if name == "slot_mapping_ptr" else "*i32" if name in INT_PTRS \
                else "*fp32" if name in FP32_PTRS else "*bf16"
        return "i32"
    return {name: kind(name) for name in fn.arg_names}

def compile_ptx(fn, constexprs, types=None, num_warps=4, num_stages=2):
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name.endswith("_ptr") or name.startswith("stride") or name in ("N", "K", "split_size")}
    k = triton.compile(ASTSource(fn, sig_of(fn, constexprs, types or {}), constexprs, attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    return k.asm["ptx"]

GLOBAL = re.compile(r"\b(ld|st|atom|red)\.global|\bcp\.async|\bcp\.reduce")

def facts(ptx):
    lines = [l.strip() for l in ptx.splitlines()]
    wait = [i for i, l in enumerate(lines) if l.startswith("griddepcontrol.wait")]
    prefetch = [i for i, l in enumerate(lines) if l.startswith("prefetch.global.L2")]
    access = [i for i, l in enumerate(lines) if GLOBAL.search(l)]
    stores = [i for i, l in enumerate(lines) if re.search(r"\b(st|atom|red)\.global|\bcp\.reduce", l)]
    return {"wait": len(wait), "launch": sum(l.startswith("griddepcontrol.launch_dependents") for l in lines),
            "prefetch": len(prefetch), "accesses": len(access), "stores": len(stores),
            "prefetch_before_wait": bool(wait) and all(i < wait[0] for i in prefetch),
            "access_after_wait": bool(wait) and all(i > wait[0] for i in access),
            "any_griddep": "griddepcontrol" in ptx}

def gemm(cfg, k, use):
    split = "none" if sg.launch_splits(cfg, k)[1] == 1 else cfg.reduce
    c = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "SPLIT": split,
         "SWAP_AB": cfg.swap_ab, "TMA": cfg.tma, "HAS_BIAS": False, "EVEN_K": k % cfg.block_k == 0,
         "DOT_FP32": False, "USE_PDL": use, "PF_LINES": sg.prefetch_lines(cfg.block_k, 2)}
    types = {"x_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>" if cfg.tma else "*bf16",
             "w_desc": f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>" if cfg.tma else "*bf16"}
    return compile_ptx(sg._skinny_gemm_kernel, c, types, cfg.num_warps, cfg.num_stages)

def kernels(use):
    nrp = dict(NUM_Q_HEADS=16, Q_HEADS_PADDED=16, NUM_K_HEADS=8, K_HEADS_PADDED=8, HEAD_SIZE=128, ROT_HALF=64,
               ROT_HALF_PADDED=64, PASS_PADDED=0, IS_NEOX=True, BLOCK_T=1, USE_PDL=use)
    attn = dict(NUM_QUERIES_PER_KV=2, HEAD_DIM=128, HEAD_DIM_PADDED=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=8,
                TILE_SIZE=64, DOT_FP32=False, USE_PDL=use)
    return {
        "gemm_down_split4_serial": gemm(sg.pick_config(16, 1024, 3072, sg.torch.bfloat16, 132), 3072, use),
        "gemm_gate_up_tma": gemm(sg.SkinnyGemmConfig(16, 64, 128, num_stages=4, swap_ab=True, tma=True), 1024, use),
        "gemm_k_tail": gemm(sg.SkinnyGemmConfig(16, 64, 128, split_k=2, swap_ab=True), 1000, use),
        "splitk_reduce": compile_ptx(sg._splitk_reduce_kernel, dict(BLOCK=1024, HAS_BIAS=True, USE_PDL=use),
                                     {"partial_ptr": "*fp32"}),
        "rms_norm": compile_ptx(rn._rms_norm_kernel, dict(NUM_HEADS=1, HIDDEN=1024, HIDDEN_PADDED=1024, BLOCK_R=2,
                                                           HAS_RESIDUAL=True, USE_PDL=use)),
        "silu_and_mul": compile_ptx(sm._silu_and_mul_kernel, dict(BLOCK_T=2, BLOCK_D=1024, USE_PDL=use)),
        "fused_qk_norm_rope": compile_ptx(fqk._fused_qk_norm_rope_kernel, nrp),
        "fused_qk_norm_rope_kvcache": compile_ptx(fkv._fused_qk_norm_rope_kvcache_kernel,
                                                  dict(nrp, BLOCK_SIZE=16, HEAD_SIZE_PADDED=128, APPLY_NORM=True)),
        # (Llama's RoPE + KV write, fused_rope_kvcache.py: the same kernel, no norm, no weights; SmolLM2's heads)
        "fused_rope_kvcache": compile_ptx(fkv._fused_qk_norm_rope_kvcache_kernel,
                                          dict(nrp, NUM_Q_HEADS=9, Q_HEADS_PADDED=16, NUM_K_HEADS=3, K_HEADS_PADDED=4,
                                               HEAD_SIZE=64, ROT_HALF=32, ROT_HALF_PADDED=32, BLOCK_T=2,
                                               BLOCK_SIZE=16, HEAD_SIZE_PADDED=64, APPLY_NORM=False,
                                               q_weight_ptr=None, k_weight_ptr=None)),
        "unified_attention_2d": compile_ptx(ua._unified_attention_kernel,
                                            dict(attn, HAS_SKIP=False, USE_SEQ_ORDER=True)),
        "unified_attention_3d": compile_ptx(ua._unified_attention_3d_kernel, dict(attn, NUM_SEGMENTS_PER_SEQ=16)),
        "reduce_segments": compile_ptx(ua.reduce_segments, dict(HEAD_DIM=128, HEAD_DIM_PADDED=128, TILE_SIZE=64,
                                                                NUM_SEGMENTS_PER_SEQ=16, USE_PDL=use)),
    }

print(json.dumps({str(use): {name: facts(ptx) for name, ptx in kernels(use).items()} for use in (True, False)}))
"""


@pytest.fixture(scope="module")
def ptx_facts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", AOT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_pdl_kernels_wait_before_any_global_access(ptx_facts):
    on = ptx_facts["True"]
    assert len(on) == 12
    for name, f in on.items():
        assert f["wait"] >= 1 and f["launch"] >= 1, (name, f)
        assert f["accesses"] > 0 and f["stores"] > 0, (name, f)               # the parse saw the kernel's traffic
        assert f["access_after_wait"], (name, f)                              # pdl.py NOTE (a), (d)
        if name.startswith("gemm_"):
            assert f["prefetch"] >= 1 and f["prefetch_before_wait"], (name, f)   # W into L2 first
        else:
            assert f["prefetch"] == 0, (name, f)


@pytest.mark.slow
def test_without_pdl_the_ptx_holds_none_of_it(ptx_facts):
    for name, f in ptx_facts["False"].items():
        assert not f["any_griddep"] and f["prefetch"] == 0, (name, f)

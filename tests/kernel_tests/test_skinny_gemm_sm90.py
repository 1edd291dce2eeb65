"""skinny_gemm's configs compile for Hopper without a GPU: Triton's compiler and its bundled ptxas
target sm_90 offline. Every default config of the Qwen3-0.6B decode shapes (and the switches the
benchmark sweeps: TMA, the second-launch reduction, untransposed small tiles) compiles, fits in a
block's shared memory, spills nothing, loads 16 bytes at a time (or by TMA) and runs its dots on
wgmma where the tile allows. (A subprocess: this folder's tests import the kernels interpreted.)"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AOT = r"""
import json, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_anatomy.kernels import skinny_gemm as sg

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
MS = [1, 4, 16, 32, 64, 128, 192, 256]
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def compile_cfg(cfg, k):
    fn = sg._skinny_gemm_kernel
    split = "none" if sg.launch_splits(cfg, k)[1] == 1 else cfg.reduce
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "bias_ptr": "*bf16", "partial_ptr": "*fp32",
             "counter_ptr": "*i32",
             "x_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>" if cfg.tma else "*bf16",
             "w_desc": f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>" if cfg.tma else "*bf16"}
    constexprs = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "SPLIT": split,
                  "SWAP_AB": cfg.swap_ab, "TMA": cfg.tma, "HAS_BIAS": False, "EVEN_K": k % cfg.block_k == 0,
                  "DOT_FP32": False, "USE_PDL": False, "PF_LINES": sg.prefetch_lines(cfg.block_k, 2)}
    sig = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    # as launched: 16-byte aligned pointers; N, K, M * N and the row strides divisible by 16
    aligned = {"x_ptr", "w_ptr", "out_ptr", "bias_ptr", "partial_ptr", "counter_ptr", "N", "K", "split_size",
               "stride_xm", "stride_wn"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in aligned and not (cfg.tma and name.endswith("_desc"))}
    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    ptx = kernel.asm["ptx"]
    return {"name": cfg.name, "k": k, "shared": kernel.metadata.shared, "local": local, "wgmma": "wgmma" in ptx,
            "cp_async_16": "cp.async.cg.shared.global" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
            "swap": cfg.swap_ab, "block_m": cfg.block_m, "uses_tma": cfg.tma}

cfgs = {}
for n, k in SHAPES:
    for m in MS:
        cfg = sg.pick_config(m, n, k, torch.bfloat16, 132)
        cfgs[(cfg, k)] = None
extra = [sg.SkinnyGemmConfig(16, 64, 128, split_k=4, num_stages=4, swap_ab=True, tma=True),
         sg.SkinnyGemmConfig(128, 64, 128, split_k=4, num_stages=3, reduce="kernel"),
         sg.SkinnyGemmConfig(16, 64, 128, split_k=4, num_stages=4)]
for cfg in extra:
    cfgs[(cfg, 1024)] = None
print(json.dumps([compile_cfg(cfg, k) for cfg, k in cfgs]))
"""


@pytest.mark.slow
def test_configs_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", AOT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) >= 10
    for r in rows:
        assert r["shared"] <= 227 * 1024 and r["local"] == 0, r          # fits a block; no spills
        assert r["tma"] if r["uses_tma"] else r["cp_async_16"], r          # 16-byte (or TMA) loads
        if r["swap"] or r["block_m"] >= 64:
            assert r["wgmma"], r                                            # Hopper's MMA

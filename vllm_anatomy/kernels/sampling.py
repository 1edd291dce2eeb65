"""gumbel_sample: temperature + random sampling + greedy argmax in one read of the logits.

Mirrors vLLM's gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py: the
Triton sampler of v0.27.1's second GPU model runner), which the Sampler's
fused path calls (vllm_anatomy/model_executor/sampler.py, Sampler.forward:
it says when). The reference is the Sampler's torch path:

    probs = softmax(logits.float() / T)            [R, V] fp32
    q     = Exp(1) noise                           [R, V] fp32
    id    = argmax(probs / q)                      the exponential race

Here, per row, with the same distribution (the Gumbel-max trick):

    id    = argmax(logits / T - log E),   E ~ Exp(1) i.i.d. per token
          = argmax(logits)                for greedy rows (T < _SAMPLING_EPS)

since probs_i / E_i = exp(logits_i / T - lse) / E_i, and log is monotonic:
the winner of the race is the token with the largest logits_i / T - log E_i
(the row's log-sum-exp is the same for every token, so no softmax is needed;
-log E is Gumbel noise). The random numbers come from Triton's Philox,
keyed by one 64-bit `seed` per launch (the Sampler draws it from torch's
generator each step), with the row in the high word of the counter and the
token position in the low word: every (row, token) gets its own noise, and
the same seed gives the same ids.

Memory layout:
    logits       [R, V]   bf16, fp16 or fp32, any row stride, last dim contiguous;
                          read once, upcast to fp32 in registers, not written
    temperature  [R]      fp32; rows below _SAMPLING_EPS are greedy
    seed         [1]      int64, on the logits' device (read by the kernel: no host sync)
    local_max    [R, NB]  NEW fp32: each block's best score     (NB = cdiv(V, BLOCK_SIZE))
    local_argmax [R, NB]  NEW int64: that score's token id
    returns      [R]      NEW int64 sampled ids

Grid: (R, NB). One program reads BLOCK_SIZE logits of one row, as four
sub-blocks of BLOCK_SIZE / 4: one Philox call (tl.randint4x) yields four
random words, one per sub-block (a quarter of the Philox work of tl.rand per
token). It keeps the best score and its token id; torch then takes the best
block of each row (argmax + gather, as vLLM does). Ties go to the lowest
token id everywhere (tl.max's left tie-break, strict > across sub-blocks,
argmax across blocks), as torch.argmax: greedy rows match it exactly.

NOTE: Exp(1) noise from a uniform u in [0, 1) as E = -log(1 - u), not
-log(u): the race is won by the smallest E / p, and small E then comes from
small u, where fp32 resolves values down to 2**-31 (near u = 1 its spacing
is 2**-24). vLLM writes -log1p(-u) with libdevice's log1p; here the series
u + u^2/2 + u^3/3 + u^4/4 covers u < 1/64 (error below fp32's rounding) and
-log(1 - u) the rest. u = 0 is clamped to tl.rand's smallest step (as vLLM
does), so no token can get infinite noise.

NOTE: the scores are kept in base 2: log2(e) * (logits / T - ln E) =
logits * (log2(e) / T) - log2(E2) + const, with E2 = E * log2(e) = -log2(1 - u):
the same argmax, and on the GPU log2 is one hardware instruction
(lg2.approx.f32, FAST_LOG2) where tl.log / tl.log2 compile to a ~15-instruction
libdevice routine; the kernel takes two logs per token, and was compute-bound
with them (~97 instructions per token in SASS). lg2.approx is off by at most
~2**-22 (absolute, for 1 - u in [1/2, 1)): E2 relative to 1e-5 at u = 1/64,
far below the logits' own bf16 rounding (2**-8). Triton's interpreter has no
libdevice: there (FAST_LOG2 off) it is tl.log2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.random import uint_to_uniform_float

from vllm_anatomy.kernels.launch import check_launchable, is_interpreted
from vllm_anatomy.sampling_params import _SAMPLING_EPS

# NOTE: 4096 logits per program: 38 programs per row of a 151,936-token
# vocabulary (Qwen3), 9,728 for a batch of 256. bench/sampling.py measures
# other sizes (--block-sizes).
BLOCK_SIZE = 4096
# tl.rand's smallest positive value (1 step of its 31-bit uniform).
_TL_RAND_MIN = tl.constexpr(4.6566127342e-10)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _log2(x, FAST_LOG2: tl.constexpr):
    if FAST_LOG2:
        return libdevice.fast_log2f(x)                               # lg2.approx.f32
    else:
        return tl.log2(x)


@triton.jit
def _exponential_noise(bits, FAST_LOG2: tl.constexpr):
    """Random 32-bit words -> E2 = E * log2(e), E ~ Exp(1); fp32, finite and > 0."""
    u = tl.maximum(uint_to_uniform_float(bits), _TL_RAND_MIN)       # [2**-31, 1)
    series = u * _LOG2E * (1.0 + u * (0.5 + u * (1.0 / 3.0 + u * 0.25)))   # -log2(1 - u), small u
    return tl.where(u < 0.015625, series, -_log2(1.0 - u, FAST_LOG2))


@triton.jit
def _sub_block_argmax(logits_ptr, row_start, col_start, vocab_size, bits, temp, scale,
                      best_score, best_id, SAMPLING_EPS: tl.constexpr, SUB: tl.constexpr,
                      FAST_LOG2: tl.constexpr):
    """Fold logits [col_start, col_start + SUB) of a row into the running (best score, its id)."""
    col = col_start + tl.arange(0, SUB)
    mask = col < vocab_size
    x = tl.load(logits_ptr + row_start + col, mask=mask, other=float("-inf")).to(tl.float32)
    # Greedy rows: the logits themselves. Others: log2(e) * (logits / T - ln E) + const.
    noisy = x * scale - _log2(_exponential_noise(bits, FAST_LOG2), FAST_LOG2)
    score = tl.where(temp < SAMPLING_EPS, x, noisy)
    score = tl.where(mask, score, float("-inf"))
    top, idx = tl.max(score, axis=0, return_indices=True)
    better = top > best_score                          # strict: ties keep the lower id
    return tl.where(better, top, best_score), tl.where(better, (col_start + idx).to(tl.int64), best_id)


@triton.jit
def _gumbel_sample_kernel(
    local_argmax_ptr,              # [R, NB] int64
    local_max_ptr,                 # [R, NB] fp32
    logits_ptr,                    # [R, V], row stride logits_stride
    logits_stride,
    temp_ptr,                      # [R] fp32
    seed_ptr,                      # [1] int64
    vocab_size,
    num_blocks,                    # NB (the local arrays' row stride)
    SAMPLING_EPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FAST_LOG2: tl.constexpr,       # lg2.approx (GPU) or tl.log2 (interpreter)
):
    row = tl.program_id(0).to(tl.int64)
    block_idx = tl.program_id(1)
    SUB: tl.constexpr = BLOCK_SIZE // 4
    temp = tl.load(temp_ptr + row).to(tl.float32)
    # Greedy rows' noise is computed and then ignored (no division by 0: no inf/nan).
    scale = _LOG2E / tl.where(temp < SAMPLING_EPS, 1.0, temp)
    seed = tl.load(seed_ptr)
    # Philox counter: the row in the high 32 bits, this program's lane in the low.
    counter = (row << 32) | (block_idx * SUB + tl.arange(0, SUB)).to(tl.int64)
    bits0, bits1, bits2, bits3 = tl.randint4x(seed, counter)
    row_start = row * logits_stride
    start = block_idx * BLOCK_SIZE
    best_score = float("-inf")
    best_id = start.to(tl.int64)
    for j in tl.static_range(4):               # sub-block j takes Philox word j
        bits = bits0 if j == 0 else (bits1 if j == 1 else (bits2 if j == 2 else bits3))
        best_score, best_id = _sub_block_argmax(
            logits_ptr, row_start, start + j * SUB, vocab_size, bits, temp, scale,
            best_score, best_id, SAMPLING_EPS, SUB, FAST_LOG2)
    tl.store(local_argmax_ptr + row * num_blocks + block_idx, best_id)
    tl.store(local_max_ptr + row * num_blocks + block_idx, best_score)


def _block_size(vocab_size: int, block_size: int) -> int:
    # Small vocabularies (tests) get one block; 4 sub-blocks of at least 16.
    return max(64, min(block_size, 4 * triton.next_power_of_2(triton.cdiv(vocab_size, 4))))


def launch_grid(num_rows: int, vocab_size: int, block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """One program per (row, BLOCK_SIZE logits) (for tracing)."""
    return (num_rows, triton.cdiv(vocab_size, _block_size(vocab_size, block_size)))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                  block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """logits [R, V], temperature [R], seed [1] int64 -> sampled token ids [R] int64.

    Rows with temperature < _SAMPLING_EPS are greedy (their argmax); the
    others sample from softmax(logits / temperature). Nothing is modified.
    """
    num_rows, vocab_size = logits.shape
    assert temperature.shape == (num_rows,), f"temperature {tuple(temperature.shape)} for {num_rows} rows"
    assert seed.numel() == 1 and seed.dtype == torch.int64, "seed: one int64, on the logits' device"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    check_launchable(logits, _gumbel_sample_kernel)
    block = _block_size(vocab_size, block_size)
    num_blocks = triton.cdiv(vocab_size, block)
    local_argmax = torch.empty(num_rows, num_blocks, dtype=torch.int64, device=logits.device)
    local_max = torch.empty(num_rows, num_blocks, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return local_argmax.view(-1)
    _gumbel_sample_kernel[(num_rows, num_blocks)](
        local_argmax, local_max, logits, logits.stride(0),
        temperature.to(torch.float32), seed, vocab_size, num_blocks,
        SAMPLING_EPS=_SAMPLING_EPS, BLOCK_SIZE=block,
        FAST_LOG2=not is_interpreted(_gumbel_sample_kernel))
    # The best block of each row (the first, on a tie: the lowest token id).
    best_block = local_max.argmax(dim=-1, keepdim=True)                       # [R, 1]
    return local_argmax.gather(-1, best_block).view(-1)                       # [R]

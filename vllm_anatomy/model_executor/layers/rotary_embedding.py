"""Rotary position embedding (RoPE), neox style, with Llama-3 frequency scaling.

Mirrors vllm/model_executor/layers/rotary_embedding/ (base.py RotaryEmbedding,
llama3_rope.py Llama3RotaryEmbedding, and get_rope in __init__.py).

RoPE rotates each (x1[i], x2[i]) pair of a query/key head by the angle
position * inv_freq[i]. "Neox style" pairs dimension i with i + d/2 (the
first and second halves of the head), which is what HF Llama/Qwen checkpoints
expect. cos and sin for every position are computed once into
`cos_sin_cache` [max_position, rotary_dim] = [cos | sin] and looked up by the
token's position — the runner's `positions` tensor is exactly that index.
"""
from __future__ import annotations

import math

import torch
from torch import nn

_SUPPORTED_ROPE_TYPES = ("default", "llama3")


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor          # a buffer: [max_position, rotary_dim]

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool = True) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        # NOTE: kept in fp32 and not a persistent buffer: it is derived from the
        # config, never loaded, and casting it to bf16 once per forward (at use)
        # is what transformers does too, so both sides round the same way.
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        # inv_freq[i] = base^(-2i / rotary_dim), i in [0, rotary_dim / 2)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float()
        return 1.0 / (base ** (exponents / self.rotary_dim))

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)                 # [rotary_dim / 2]
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                             # [max_pos, rotary_dim / 2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)         # [max_pos, rotary_dim]

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, nh * head_size]; key [T, nkv * head_size]."""
        # NOTE: dispatch as vLLM's CustomOp does. On CUDA the torch code below
        # is 16 tiny kernels per layer (a lookup, a cast, then 7 for q and 7 for
        # k); fusing them (with the norms and SiLU*mul) cut a profiled decode
        # step's GPU time by about a third (bench/results/
        # step_overhead_h200_before_fused_kernels.json), so CUDA takes one
        # Triton launch for q and k (vllm_anatomy/kernels/rotary_embedding.py), rounding as
        # torch does. Everywhere else (the CPU path, and the kernel's oracle)
        # plain torch. The torch code handles only rotary_dim == head_size
        # (get_rope builds no other), so the kernel is used only then.
        # (Qwen3 on CUDA does not come here: LlamaAttention fuses its q/k
        # norms and this RoPE into one kernel, vllm_anatomy/kernels/fused_qk_norm_rope.py,
        # reading cos_sin_cache and is_neox_style from this layer.)
        if query.is_cuda and self.rotary_dim == self.head_size:
            return self.forward_cuda(positions, query, key)
        return self.forward_native(positions, query, key)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin_cache.index_select(0, positions)     # [T, rotary_dim]
        cos, sin = cos_sin.to(query.dtype).chunk(2, dim=-1)         # [T, rotary_dim / 2] each
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)                  # [T, heads, head_size]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)               # [T, 1, rotary_dim / 2]
        if self.is_neox_style:
            x1, x2 = x.chunk(2, dim=-1)                             # halves of each head
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:  # GPT-J style: pairs are adjacent dims (0, 1), (2, 3), ...
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return out.reshape(num_tokens, -1)                          # [T, heads * head_size]

    def forward_cuda(self, positions: torch.Tensor, query: torch.Tensor,
                     key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # query/key may be column views of the qkv output (read in place); the
        # results are new contiguous tensors, the inputs are not written.
        # NOTE: imported lazily: CPU runs never need the kernel module.
        from vllm_anatomy.kernels.rotary_embedding import rotary_embedding
        return rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size,
                                self.is_neox_style)

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
                f"is_neox_style={self.is_neox_style}")


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1's long-context trick: slow down only the low frequencies.

    Wavelengths shorter than original_max_position / high_freq_factor are
    kept, longer than original_max_position / low_freq_factor are divided by
    `scaling_factor`, and the band in between is interpolated smoothly.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, scaling_factor: float,
                 low_freq_factor: float, high_freq_factor: float,
                 orig_max_position: int) -> None:
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq(base)
        low_freq_wavelen = self.orig_max_position / self.low_freq_factor
        high_freq_wavelen = self.orig_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = ((self.orig_max_position / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.scaling_factor, inv_freq)
        smoothed = (1 - smooth) * scaled / self.scaling_factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def get_rope_parameters(hf_config: dict) -> dict:
    """The config's RoPE settings as one flat dict with "rope_type" and "rope_theta".

    transformers >= 5 writes `rope_parameters: {"rope_type", "rope_theta", ...}`
    (and `rope_theta` at the top level is gone); older configs have a top-level
    `rope_theta` plus an optional `rope_scaling: {"rope_type" | "type", ...}`.
    """
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters {list(params)} are not supported")
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params["rope_theta"] = params.get("rope_theta") or hf_config.get("rope_theta") or 10000.0
    return params


_ROPE_DICT: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_size: int, max_position: int, is_neox_style: bool = True,
             rope_parameters: dict | None = None) -> RotaryEmbedding:
    """Build (or reuse) the rotary embedding for these settings.

    NOTE: as in vLLM, instances are cached: every layer of a model asks for the
    same RoPE, and one cos/sin table is enough for all of them. The cache is
    keyed by all settings *and* the default device active at build time (the
    loader builds models directly on their device; moving a model afterwards
    with .to() would move the shared table under every other model too).
    """
    params = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    rope_type = params.get("rope_type", "default")
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE scaling type {rope_type!r} is not supported "
                         f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported")
    base = float(params["rope_theta"])
    key = (head_size, max_position, is_neox_style, base, tuple(sorted(params.items())),
           str(torch.get_default_device()))
    if key in _ROPE_DICT:
        return _ROPE_DICT[key]
    rope: RotaryEmbedding
    if rope_type == "llama3":
        rope = Llama3RotaryEmbedding(
            head_size, head_size, max_position, base, is_neox_style,
            scaling_factor=params["factor"], low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            orig_max_position=params.get("original_max_position_embeddings", max_position))
    else:
        rope = RotaryEmbedding(head_size, head_size, max_position, base, is_neox_style)
    _ROPE_DICT[key] = rope
    return rope

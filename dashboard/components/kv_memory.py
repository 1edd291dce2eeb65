"""How much memory KV blocks are: one block holds K and V of block_size tokens in
every layer,

    block bytes = 2 × num_layers × num_kv_heads × head_dim × block_size × dtype bytes

(GPUModelRunner.get_kv_cache_bytes_per_block). Read, in this order, from the run's
meta (`kv_cache_bytes_per_block`, recorded by newer runs), from the worker's step
snapshot (`kv_cache_shape` = [2, num_blocks, block_size, num_kv_heads, head_dim] and
`num_kv_cache_layers`, with the meta's dtype), else from the model's config.json next
to its weights. None when none of them is there: the pages then show blocks only.
"""
from __future__ import annotations

import json
import math
import os

from dashboard.words import n_of

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}
MB = 2 ** 20      # the run header's MB (dashboard/components/run_header.py)


def _dtype_bytes(meta: dict) -> int | None:
    cfg = (meta.get("config") or {}).get("model_config") or {}
    dtype = str(cfg.get("dtype") or "").replace("torch.", "")
    return DTYPE_BYTES.get(dtype)


def _from_model_dir(meta: dict, block_size: int) -> int | None:
    path = os.path.join(str(meta.get("model") or ""), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        layers, heads = int(hf["num_hidden_layers"]), int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    nbytes = _dtype_bytes(meta)
    return 2 * layers * heads * head_dim * block_size * nbytes if nbytes else None


def block_bytes(meta: dict, mr: dict | None = None, block_size: int | None = None) -> int | None:
    """Bytes of one KV block (all layers, K and V), or None when the run does not tell."""
    per = meta.get("kv_cache_bytes_per_block")
    if isinstance(per, (int, float)) and per > 0:
        return int(per)
    per = rank_block_bytes(meta, mr)
    if per is not None:
        return per
    bs = block_size or ((meta.get("config") or {}).get("cache_config") or {}).get("block_size")
    return _from_model_dir(meta, int(bs)) if bs else None


def rank_block_bytes(meta: dict, mr: dict | None) -> int | None:
    """Bytes of one KV block in one worker's cache (its own KV heads), from its step snapshot
    (`kv_cache_shape`, `num_kv_cache_layers`) and the meta's dtype; None when they are absent.
    With tensor parallelism this is one rank's share; the meta's kv_cache_bytes_per_block is all ranks'."""
    shape, layers = (mr or {}).get("kv_cache_shape"), (mr or {}).get("num_kv_cache_layers")
    nbytes = _dtype_bytes(meta)
    if shape and layers and nbytes and len(shape) >= 2 and shape[1]:
        return int(math.prod(shape) // shape[1] * layers * nbytes)
    return None


def mb(nbytes: float | None) -> str:
    """`1.4 MB` (MiB, as the run header writes it); small sizes keep two decimals."""
    if nbytes is None:
        return "? MB"
    v = nbytes / MB
    return f"{v:,.2f} MB" if v < 10 else f"{v:,.1f} MB"


def blocks_mb(n_blocks: int, per_block: int | None) -> str:
    """`3 blocks (1.05 MB)`, or `3 blocks` when the block size in bytes is not known."""
    s = n_of(n_blocks, "block")
    return f"{s} ({mb(n_blocks * per_block)})" if per_block else s

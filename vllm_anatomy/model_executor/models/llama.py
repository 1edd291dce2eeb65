"""Llama-family decoders: Llama, Qwen2 (Llama + q/k/v bias), Qwen3 (Llama + per-head q/k RMSNorm).

Mirrors vllm/model_executor/models/llama.py (LlamaMLP, LlamaAttention,
LlamaDecoderLayer, LlamaModel, LlamaForCausalLM), qwen2.py and qwen3.py, which
in vLLM are near-copies of llama.py; here the two differences are flags.

What makes this a *serving* model rather than a transformers one:
- the batch is flat: input_ids [T] and positions [T] hold the tokens of every
  request of the step back to back (prefill chunks and decodes mixed); there
  is no batch dimension and no padding mask;
- attention reads and writes a paged KV cache (one tensor per layer) through
  attn_metadata (slot_mapping, block_table, query_start_loc, seq_lens);
- checkpoint tensors are packed at load time: q/k/v into `qkv_proj` and
  gate/up into `gate_up_proj` (vLLM's `stacked_params_mapping`), so each
  layer runs 4 GEMMs instead of 7;
- with tensor parallelism (N ranks, layers/linear.py) each rank holds nh/N
  query heads, their KV heads and I/N MLP features; a forward then costs
  2 all-reduces per layer (after o_proj and down_proj), one for the
  embedding lookup and one all-gather of the logits.
Simplified away: pipeline parallelism, quantization, LoRA, sliding window.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from vllm_anatomy import envs
from vllm_anatomy.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm_anatomy.attention.backends.torch_ref import TorchReferenceBackend
from vllm_anatomy.attention.layer import Attention
from vllm_anatomy.compilation.qk_norm_rope_kvcache_fusion import (
    fuse_qk_norm_rope_kvcache_enabled,
    fused_qk_norm_rope_and_unified_kv_cache_update,
    takes_fused_kvcache_update,
)
from vllm_anatomy.compilation.rope_kvcache_fusion import (
    fuse_rope_kvcache_enabled,
    fused_rope_and_unified_kv_cache_update,
    takes_fused_rope_kvcache_update,
)
from vllm_anatomy.distributed.communication_op import tensor_model_parallel_all_gather
from vllm_anatomy.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm_anatomy.distributed.utils import divide
from vllm_anatomy.model_executor.layers.activation import SiluAndMul
from vllm_anatomy.model_executor.layers.layernorm import RMSNorm
from vllm_anatomy.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from vllm_anatomy.model_executor.layers.rotary_embedding import get_rope, get_rope_parameters
from vllm_anatomy.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)


class LlamaMLP(nn.Module):

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)            # [T, 2 * I / N]   (N = tp_size)
        x = self.act_fn(gate_up)                  # [T, I / N]
        return self.down_proj(x)                  # [T, H], summed over the ranks


class LlamaAttention(nn.Module):

    def __init__(self, config: dict, attn_backend: type[AttentionBackend], qkv_bias: bool,
                 o_bias: bool, qk_norm: bool, prefix: str = "") -> None:
        super().__init__()
        hidden_size = config["hidden_size"]
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config["num_attention_heads"]
        self.total_num_kv_heads = config.get("num_key_value_heads") or self.total_num_heads
        # This rank's heads: nh / N query heads, and the KV heads they use
        # (at least one: replicated when N > nkv, see QKVParallelLinear).
        self.num_heads = divide(self.total_num_heads, tp_size)
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        # NOTE: head_dim is not always hidden_size / num_heads (Qwen3: 128 with
        # hidden 1024 and 16 heads), so read it when the config has it.
        self.head_dim = config.get("head_dim") or hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5

        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, hidden_size, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:  # Qwen3: RMSNorm over each head's head_dim values, before RoPE
            self.q_norm = RMSNorm(self.head_dim, eps=config["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, eps=config["rms_norm_eps"])
        self.rotary_emb = get_rope(self.head_dim, config["max_position_embeddings"],
                                   is_neox_style=True, rope_parameters=get_rope_parameters(config))
        # (the performance seam below; vLLM's pass_config name)
        self.enable_qk_norm_rope_fusion = qk_norm and _qk_norm_rope_fusion_enabled()
        self.fuse_qk_norm_rope_kvcache = self.enable_qk_norm_rope_fusion and fuse_qk_norm_rope_kvcache_enabled()
        self.fuse_rope_kvcache = not qk_norm and fuse_rope_kvcache_enabled()   # Llama: RoPE + KV write
        self.pdl = envs.VLLM_ANATOMY_PDL          # CUDA: PDL launches (kernels/pdl.py), read once
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads,
                              attn_backend, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                kv_cache: torch.Tensor | None,
                attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)        # [T, q_size + 2 * kv_size] (this rank's heads)
        kv_cache_updated = False                  # (True: the fused kernel also wrote K/V into the cache)
        if self._use_fused_qk_norm_rope(qkv):     # CUDA, Qwen3: one kernel (see the NOTE there)
            q, k, v, kv_cache_updated = self._fused_qk_norm_rope(positions, qkv, kv_cache, attn_metadata)
        elif self.fuse_rope_kvcache and takes_fused_rope_kvcache_update(self.attn, qkv, kv_cache, attn_metadata):
            q, k, v, kv_cache_updated = self._fused_rope_kvcache(positions, qkv, kv_cache, attn_metadata)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm:
                q, k = self._qk_norm(q, k)
            q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, kv_cache, attn_metadata, kv_cache_updated)   # [T, q_size]
        return self.o_proj(attn_output)           # [T, H], summed over the ranks

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        q_by_head = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))     # [T, nh, hd]
        k_by_head = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, nkv, hd]
        return q_by_head.view(num_tokens, self.q_size), k_by_head.view(num_tokens, self.kv_size)

    # ---- performance seam: q_norm + k_norm + RoPE fused (CUDA only) ----
    # NOTE: what this replaces. On CUDA, q_norm, k_norm and RoPE above are three
    # launch-bound Triton kernels per layer on tiny tensors (~2 us each; 84 of a
    # Qwen3-0.6B step's launches). vllm_anatomy/kernels/fused_qk_norm_rope.py does all three
    # in one launch, in place on the qkv output, rounding as the unfused ops
    # round. It is v0.27.1's `fused_qk_norm_rope` op, which vLLM pattern-matches
    # in only with pass_config.enable_qk_norm_rope_fusion (off at O0-O3); ours is
    # on by default on CUDA, off with VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION=0
    # (read when the model is built). The CPU always runs the readable path.
    # With VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE (on by default; =0 turns it off) a step of at most 256
    # tokens also writes K/V into the cache in that launch, and the attention layer
    # skips its reshape_and_cache: compilation/qk_norm_rope_kvcache_fusion.py says when and why.
    def _use_fused_qk_norm_rope(self, qkv: torch.Tensor) -> bool:
        return (self.enable_qk_norm_rope_fusion and qkv.is_cuda
                and qkv.dtype == self.q_norm.weight.dtype == self.k_norm.weight.dtype)

    def _fused_qk_norm_rope(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor | None,
                            attn_metadata: AttentionMetadata | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(q, k, v, whether K/V are already in the cache)."""
        kv_cache_updated = (self.fuse_qk_norm_rope_kvcache
                            and takes_fused_kvcache_update(self.attn, qkv, kv_cache, attn_metadata))
        if kv_cache_updated:
            assert kv_cache is not None and attn_metadata is not None
            fused_qk_norm_rope_and_unified_kv_cache_update(
                self.attn, qkv, positions, self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon,
                self.rotary_emb.cos_sin_cache, self.rotary_emb.is_neox_style, kv_cache, attn_metadata)
        else:
            from vllm_anatomy.kernels.fused_qk_norm_rope import fused_qk_norm_rope   # lazy: CPU never needs it
            fused_qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.num_kv_heads, self.head_dim,
                               self.q_norm.variance_epsilon, self.q_norm.weight, self.k_norm.weight,
                               self.rotary_emb.cos_sin_cache, self.rotary_emb.is_neox_style, positions,
                               pdl=self.pdl)
        # q and k are column views of qkv (row stride q_size + 2 * kv_size), as v
        # always is: attention and the cache write read them strided, no copy.
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v, kv_cache_updated

    # ---- performance seam: RoPE + the KV-cache write fused (CUDA only, no q/k norm) ----
    # NOTE: with VLLM_ANATOMY_FUSE_ROPE_KVCACHE=1 (off by default; read when the model is built)
    # a Llama step of at most 256 tokens rotates q and k in place on qkv and writes K/V into
    # the cache in one launch, instead of rotary_embedding here and reshape_and_cache in the
    # attention layer, which then skips its write: compilation/rope_kvcache_fusion.py says why
    # that is exact.
    def _fused_rope_kvcache(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor | None,
                            attn_metadata: AttentionMetadata | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(q, k, v, True): K/V are in the cache (takes_fused_rope_kvcache_update said this step may)."""
        assert kv_cache is not None and attn_metadata is not None
        fused_rope_and_unified_kv_cache_update(self.attn, qkv, positions, self.rotary_emb.cos_sin_cache,
                                               self.rotary_emb.is_neox_style, kv_cache, attn_metadata)
        # column views of qkv, as after fused_qk_norm_rope
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v, True


class LlamaDecoderLayer(nn.Module):

    def __init__(self, config: dict, attn_backend: type[AttentionBackend], qkv_bias: bool,
                 o_bias: bool, qk_norm: bool, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend, qkv_bias, o_bias, qk_norm,
                                        prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config["hidden_size"], config["intermediate_size"],
                            bias=config.get("mlp_bias", False))
        self.input_layernorm = RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor | None,
                attn_metadata: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: the residual stream is carried *beside* hidden_states and added
        # inside the next norm (RMSNorm.forward(x, residual)): the same sums as
        # transformers' `residual + hidden`, arranged so vLLM can fuse add+norm.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class LlamaModel(nn.Module):

    def __init__(self, config: dict, attn_backend: type[AttentionBackend], qkv_bias: bool,
                 o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend, qkv_bias, o_bias, qk_norm,
                              prefix=f"model.layers.{i}")
            for i in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)          # [T, H]
        residual = None
        for i, layer in enumerate(self.layers):
            # NOTE: kv_caches may be empty for a dummy run before the cache exists.
            kv_cache = kv_caches[i] if kv_caches else None
            hidden_states, residual = layer(positions, hidden_states, residual,
                                            kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # (checkpoint tensor name part -> packed parameter name part, shard id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    # What this family member adds to Llama (subclasses below override).
    qk_norm: bool = False

    def __init__(self, config: dict, attn_backend: type[AttentionBackend] | None = None) -> None:
        super().__init__()
        _check_supported(config)
        self.config = config
        self.attn_backend = attn_backend or TorchReferenceBackend
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = LlamaModel(config, self.attn_backend, qkv_bias, o_bias, self.qk_norm)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"])
        if self.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        attn = self.model.layers[0].self_attn
        assert isinstance(attn, LlamaAttention)
        self.num_layers = config["num_hidden_layers"]
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.vocab_size = config["vocab_size"]
        self.hidden_size = config["hidden_size"]

    @staticmethod
    def attention_biases(config: dict) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj): Llama's `attention_bias` sets both."""
        bias = bool(config.get("attention_bias", False))
        return bias, bias

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        """input_ids [T] long, positions [T] long -> hidden_states [T, H]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [R, H] -> logits [R, V] in the model's dtype, on every rank.

        vLLM: LogitsProcessor (model_executor/layers/logits_processor.py). The
        runner passes only the rows at logits_indices (each request's last
        scheduled token): the [T, V] matmul for every token would dwarf the rest
        of a long prefill (V = 49152 here, 150k+ for Qwen).
        NOTE: all-gather, not a gather to rank 0, as v0.27.1 does on every
        platform (Platform.use_all_gather): every rank then samples the same
        token from the same logits (same seeds), so each rank's copy of the
        batch (token_ids_cpu, the next step's input_ids) stays identical with
        no broadcast of the sampled ids. Only the output rank reports them.
        NOTE: no upcast here, as v0.27.1's LogitsProcessor returns the lm_head's
        dtype: the Sampler casts to float32 itself (after raw logprobs, which
        log_softmax in float32), so the sampled tokens are the same, and a bf16
        model skips writing an fp32 copy of [R, V] every step. The grammar
        bitmask (xgrammar) masks bf16/fp16 logits in place as well.
        """
        logits = self.lm_head.gemm(hidden_states, self.lm_head.weight, None)   # [R, V / N]
        if self.lm_head.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits)      # [R, V], rank-ordered columns
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (checkpoint name, tensor) pairs; returns the parameter names fully loaded."""
        params_dict = dict(self.named_parameters())
        loaded_params: set[str] = set()
        loaded_shards: dict[str, set] = {}
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:       # derived from the config, not a weight
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                # NOTE: with tied embeddings lm_head *is* embed_tokens; some
                # checkpoints still store a copy, which we must not load over it.
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = _lookup(params_dict, name)
                getattr(param, "weight_loader")(param, loaded_weight, shard_id)   # (a packed layer's)
                loaded_shards.setdefault(name, set()).add(shard_id)
                break
            else:
                param = _lookup(params_dict, name)
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                weight_loader(param, loaded_weight)
                loaded_params.add(name)
        # A packed parameter counts as loaded only once every one of its shards has been.
        for name, shards in loaded_shards.items():
            expected = {s for p, _, s in self.stacked_params_mapping if p in name}
            if shards == expected:
                loaded_params.add(name)
        return loaded_params


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with a bias on q/k/v (always) and none on o_proj."""

    @staticmethod
    def attention_biases(config: dict) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama plus an RMSNorm on each query and key head before RoPE."""
    qk_norm = True


def _qk_norm_rope_fusion_enabled() -> bool:
    """VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION (default 1): fuse Qwen3's q/k norm and RoPE on CUDA."""
    return bool(envs.VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION)


def _lookup(params_dict: dict[str, nn.Parameter], name: str) -> nn.Parameter:
    if name not in params_dict:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
    return params_dict[name]


def _check_supported(config: dict) -> None:
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        raise ValueError("sliding-window attention is not supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only silu)")


# The model registry (vLLM: vllm/model_executor/models/registry.py, _TEXT_GENERATION_MODELS).
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def resolve_model_cls(hf_config: dict) -> type[LlamaForCausalLM]:
    """The model class for a config.json: by `architectures`, else by `model_type`."""
    architectures = hf_config.get("architectures") or []
    for arch in architectures:
        if arch in _MODELS:
            return _MODELS[arch]
    model_type = hf_config.get("model_type")
    if not architectures and model_type in _MODEL_TYPES:
        return _MODELS[_MODEL_TYPES[model_type]]
    raise ValueError(f"unsupported model: architectures={architectures}, model_type={model_type!r}; "
                     f"supported architectures: {', '.join(_MODELS)}")

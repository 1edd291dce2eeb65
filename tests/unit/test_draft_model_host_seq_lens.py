"""The host's view of the draft model's seq_lens, step by step (v0.27.1's seq_lens_cpu_upper_bound).

With async scheduling the draft model's K - 1 decode forwards run a padded batch (propose_padded):
only the device knows how many drafts the target rejected, so the host has no exact seq_lens
there (_seq_lens_cpu None), only an upper bound that counts every draft as accepted: the first
pass's lengths, plus one per decode forward. Where the host knows the lengths (the target's
steps, the first pass, every forward of the synchronous drafter) the bound is the exact copy.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/test_draft_model_host_seq_lens.py
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from tests.helpers import build_attn_metadata
from vllm_anatomy.attention.backends.abstract import AttentionMetadata

K = 3
NUM_REQS = 3
PROMPT_LEN = 12


@pytest.fixture(scope="module")
def other_tiny_llama_dir(tmp_path_factory, tiny_llama_dir):
    """tiny_llama_dir's vocabulary and tokenizer, other random weights and an untied lm_head: a draft
    that is often rejected (the tied random models both mostly repeat the last token)."""
    import shutil

    import transformers
    path = tmp_path_factory.mktemp("other_tiny_llama")
    config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = f"{tiny_llama_dir}/{name}"
        try:
            shutil.copy(src, path / name)
        except FileNotFoundError:
            pass
    return str(path)


def run_drafter(target_dir: str, draft_dir: str, async_scheduling: bool) -> list[dict]:
    """Generate greedily; record, per draft-model forward, the host's view when it was called
    and the device's seq_lens (what attention used)."""
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(target_dir, max_model_len=256, async_scheduling=async_scheduling, speculative_config={
        "method": "draft_model", "model": draft_dir, "num_speculative_tokens": K})
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == async_scheduling
    drafter = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.drafter
    forwards: list[dict] = []
    forward = drafter.model.forward

    def spy(input_ids, positions, kv_caches, attn_metadata: AttentionMetadata):
        exact = attn_metadata._seq_lens_cpu
        upper_bound = attn_metadata.seq_lens_cpu_upper_bound
        forwards.append({
            "exact": None if exact is None else exact.tolist(),
            "upper_bound": None if upper_bound is None else upper_bound.tolist(),
            "device": attn_metadata.seq_lens.tolist(), "max_query_len": attn_metadata.max_query_len,
            "max_seq_len": attn_metadata.max_seq_len})
        return forward(input_ids, positions, kv_caches, attn_metadata)
    drafter.model.forward = spy
    try:
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randint(3, 500) for _ in range(PROMPT_LEN)]} for _ in range(NUM_REQS)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return forwards


def per_step(forwards: list[dict]) -> list[list[dict]]:
    """The forwards grouped by drafter call: a first pass, then K - 1 decode forwards."""
    assert len(forwards) % K == 0, len(forwards)
    return [forwards[i:i + K] for i in range(0, len(forwards), K)]


@pytest.mark.parametrize("same_draft", [True, False], ids=["draft_is_target", "other_draft"])
def test_padded_decode_forwards_carry_an_upper_bound_bumped_by_one(tiny_llama_dir, other_tiny_llama_dir,
                                                                  same_draft):
    draft = tiny_llama_dir if same_draft else other_tiny_llama_dir
    steps = per_step(run_drafter(tiny_llama_dir, draft, async_scheduling=True))
    assert len(steps) >= 3
    rejected = 0
    for first, *decodes in steps:
        # The first pass: the padded layout is the host's, so its lengths are exact.
        assert first["exact"] == first["upper_bound"] == first["device"]
        assert first["max_seq_len"] == max(first["device"])
        for k, step in enumerate(decodes, start=1):
            assert step["max_query_len"] == 1
            # No exact host copy (only the device knows the rejected drafts), an upper bound instead:
            # the first pass's lengths + k (v0.27.1 bumps it by one per drafter step).
            assert step["exact"] is None
            assert step["upper_bound"] == [min(s + k, 256) for s in first["upper_bound"]]
            assert step["max_seq_len"] == max(step["upper_bound"])
            assert all(u >= d for u, d in zip(step["upper_bound"], step["device"])), step
            rejected += sum(u - d for u, d in zip(step["upper_bound"], step["device"]))
    if same_draft:      # every draft accepted: the bound is exact
        assert rejected == 0
    else:               # drafts rejected: the device's lengths fall short of the bound
        assert rejected > 0


def test_synchronous_drafter_forwards_have_exact_host_seq_lens(tiny_llama_dir, other_tiny_llama_dir):
    """Without async scheduling the accepted counts are on the host before the drafter runs:
    every forward's lengths are exact, and the bound is that same copy."""
    steps = per_step(run_drafter(tiny_llama_dir, other_tiny_llama_dir, async_scheduling=False))
    compared = 0
    for first, *decodes in steps:
        for step in (first, *decodes):
            assert step["exact"] == step["upper_bound"] == step["device"], step
        for k, step in enumerate(decodes, start=1):      # one token more per forward
            if len(step["exact"]) == len(first["exact"]):     # (every row proposes)
                assert step["exact"] == [min(s + k, 256) for s in first["exact"]]
                compared += 1
    assert compared >= 2 * (K - 1)


# -- the backends that loop on the host read the exact copy, and the device only without one -------
def paged_metadata() -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A prefill chunk with context and two decodes over a random paged cache (shuffled blocks):
    (query [T, 4, 8], metadata, kv_cache)."""
    gen = torch.Generator().manual_seed(0)
    query_lens, seq_lens, block_size = [5, 1, 1], [9, 6, 11], 4
    blocks = torch.randperm(12, generator=gen).tolist()
    block_tables = [blocks[0:3], blocks[3:5], blocks[5:8]]
    _, metadata = build_attn_metadata(query_lens, seq_lens, block_tables, block_size)
    kv_cache = torch.randn(2, 12, block_size, 2, 8, generator=gen)
    return torch.randn(sum(query_lens), 4, 8, generator=gen), metadata, kv_cache


def test_seq_lens_cpu_property_reads_the_device_once_and_only_without_a_host_copy():
    _, metadata, _ = paged_metadata()
    exact = metadata._seq_lens_cpu
    assert exact is not None
    # A host copy: the device tensor is never read (a meta tensor cannot be).
    on_meta = replace(metadata, seq_lens=torch.empty(3, dtype=torch.int32, device="meta"))
    assert on_meta.seq_lens_cpu is exact
    # None: one copy from the device, then kept.
    device_only = replace(metadata, _seq_lens_cpu=None)
    copied = device_only.seq_lens_cpu
    assert copied.tolist() == exact.tolist() and device_only._seq_lens_cpu is copied
    device_only.seq_lens = torch.empty(3, dtype=torch.int32, device="meta")
    assert device_only.seq_lens_cpu is copied


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_host_looping_backends_mask_with_exact_lengths_and_never_the_upper_bound(backend):
    """With an exact host copy they do not read the device; without one they read it (a loose
    upper bound beside it changes nothing: the keys are masked by the exact lengths)."""
    from vllm_anatomy.attention.selector import get_attn_backend
    query, metadata, kv_cache = paged_metadata()
    impl = get_attn_backend(backend).get_impl_cls()(num_heads=4, head_dim=8, num_kv_heads=2, scale=8 ** -0.5)
    want = impl.forward(query, kv_cache, metadata, torch.empty_like(query)).clone()
    on_meta = replace(metadata, seq_lens=torch.empty(3, dtype=torch.int32, device="meta"))
    assert torch.equal(impl.forward(query, kv_cache, on_meta, torch.empty_like(query)), want)
    loose = metadata.seq_lens_cpu_upper_bound + torch.tensor([0, 2, 3], dtype=torch.int32)
    bounded = replace(metadata, _seq_lens_cpu=None, seq_lens_cpu_upper_bound=loose)
    assert torch.equal(impl.forward(query, kv_cache, bounded, torch.empty_like(query)), want)

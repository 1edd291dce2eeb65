"""The real default model (SmolLM2-135M-Instruct): our paged forward equals transformers.

1. Logits at every position, for prompts run through a paged cache with
   shuffled blocks: a first step mixing a prefill chunk and full prefills, a
   second mixing decodes with a chunk that continues the context the first
   step wrote, all compared with transformers' full-sequence logits.
2. Greedy generation of up to 32 tokens, batched across prompts (prefill,
   then one token per request per step), equals transformers' `generate`.
transformers' model is loaded once per module from the same converted directory.
"""
import pytest
import torch

# NOTE: transformers is a declared dependency: a failed import fails the module (an
# importorskip here once could have hidden a broken install as "skipped").
import transformers
from tests.helpers import PagedSequences
from vllm_anatomy.config import ModelConfig
from vllm_anatomy.model_executor.loader import get_model
from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer

pytestmark = pytest.mark.model

MAX_NEW_TOKENS = 32
CHAT = ["What is the capital of France?", "Name three colors of the rainbow.",
        "Write one sentence about the sea."]
RAW = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return get_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def model(default_model_dir):
    return get_model(ModelConfig(model=default_model_dir))


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in CHAT]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in chats + RAW]


def test_paged_logits_match_hf(model, hf_model, prompts):
    p0, p1, p2, p3 = prompts[0], prompts[1], prompts[3], prompts[4]
    with torch.inference_mode():
        ref = [hf_model(torch.tensor([p])).logits[0] for p in (p0, p1, p2, p3)]   # [L, V] each
    seqs = PagedSequences(model, num_blocks=64, block_size=16, seed=7)
    split = 17                                   # not a block boundary; p0 has > 33 tokens
    assert len(p0) > split + 16
    step1 = seqs.step([("p1", p1[:-1]), ("p0", p0[:split]), ("p2", p2[:-1]), ("p3", p3[:-1])])
    # Decodes around a prefill chunk whose context (p0[:split]) is already in the cache;
    # the chunk crosses at least one block boundary.
    step2 = seqs.step([("p2", p2[-1:]), ("p0", p0[split:]), ("p3", p3[-1:]), ("p1", p1[-1:])])
    table = seqs.block_ids["p0"]
    assert any(b != a + 1 for a, b in zip(table, table[1:])), "block table should be non-contiguous"
    expected1 = [ref[1][:-1], ref[0][:split], ref[2][:-1], ref[3][:-1]]
    expected2 = [ref[2][-1:], ref[0][split:], ref[3][-1:], ref[1][-1:]]
    # NOTE: fp32 logits of magnitude ~10-20 after 30 layers; on a CPU our linears run oneDNN
    # (layers/utils.py) and HF's MKL, whose additions come in another order: up to ~1.1e-4
    # apart. A wrong mask, position or block is off by far more (and the greedy tests check tokens).
    for got, want in zip(step1 + step2, expected1 + expected2):
        torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-4)


def greedy_paged(model, prompts, eos_token_id):
    """Our model driving a toy paged loop: one prefill step, then one decode per request per step."""
    seqs = PagedSequences(model, num_blocks=64, block_size=16, seed=1)
    outputs = {i: [] for i in range(len(prompts))}
    chunks = [(i, p) for i, p in enumerate(prompts)]
    while chunks:
        logits = seqs.step(chunks)
        next_chunks = []
        for (i, _), req_logits in zip(chunks, logits):
            token = int(req_logits[-1].argmax())
            outputs[i].append(token)
            if token != eos_token_id and len(outputs[i]) < MAX_NEW_TOKENS:
                next_chunks.append((i, [token]))
        chunks = next_chunks
    return [outputs[i] for i in range(len(prompts))]


def test_greedy_generation_matches_hf(model, hf_model, tokenizer, prompts):
    eos_token_id = model.config["eos_token_id"]
    ours = greedy_paged(model, prompts, eos_token_id)
    for prompt, got in zip(prompts, ours):
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                    eos_token_id=eos_token_id, pad_token_id=eos_token_id)
        want = out[0, len(prompt):].tolist()
        assert got == want, (tokenizer.decode(got), tokenizer.decode(want))
    assert "Paris" in tokenizer.decode(ours[0])
    assert sum(len(o) == MAX_NEW_TOKENS for o in ours) >= 2, "most prompts should run the full 32"

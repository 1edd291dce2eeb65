import pytest

# NOTE: a tiny model's KV block is a few KB: sized from 92 % of an H200 the pool
# would hold millions of blocks, i.e. millions of Python KVCacheBlock objects
# per engine (seconds to build, and at trace level full each step's snapshot).
# The tests' workloads need a few hundred.
NUM_BLOCKS = 2048


@pytest.fixture(scope="session")
def qwen3_shape_dir(tmp_path_factory):
    """Qwen3-0.6B's shape (hidden 1024, 16/8 heads, head_dim 128, q/k norm, vocab
    151936) with 3 of its 28 layers, random bf16 weights, a word-level tokenizer."""
    import json
    import os

    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    path = tmp_path_factory.mktemp("qwen3_shape")
    cfg = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=3,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "unk_token": "t0"}, f)
    return str(path)


def generate_greedy_and_close(llm, prompts, max_tokens: int, before=None):
    """Greedy token ids of `prompts` (lists of ids, ignore_eos) from `llm`, which is then shut down
    and its GPU memory released, error or not. before(llm), if given, runs first (to inspect the model)."""
    import gc

    import torch

    from vllm_anatomy import SamplingParams
    try:
        if before is not None:
            before(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
        gc.collect()
        torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs]

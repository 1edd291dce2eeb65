"""The whole engine on the GPU with Qwen3's fused q/k norm + RoPE (vllm_anatomy/kernels/fused_qk_norm_rope.py):
the same greedy tokens as with the unfused kernels (VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION=0)
and as transformers' greedy generate, fp32, CUDA graphs on (full decode graphs and
piecewise mixed batches), a batch of mixed lengths with chunked prefill."""
import pytest
import torch

from tests.conftest import save_word_level_tokenizer
from tests.gpu.conftest import NUM_BLOCKS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LENS = [3, 17, 40, 90, 1, 33, 64, 120, 7]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    """q/k norm, GQA 4:2, head_dim 64 != hidden / heads (as Qwen3-0.6B's 128 != 1024 / 16)."""
    import transformers
    path = tmp_path_factory.mktemp("tiny_qwen3")
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    save_word_level_tokenizer(str(path))
    return str(path)


def _prompts():
    return [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate(LENS)]


def _tokens(model_dir, fused: bool, monkeypatch):
    import gc

    from vllm_anatomy import LLM, SamplingParams
    from vllm_anatomy.model_executor.models.llama import LlamaAttention
    monkeypatch.setenv("VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION", "1" if fused else "0")
    llm = LLM(model_dir, device="cuda", dtype="float32", max_model_len=512,
              num_gpu_blocks_override=NUM_BLOCKS, max_num_batched_tokens=128, max_num_seqs=16)
    core = llm.llm_engine.engine_core          # None with the engine in its own process
    if core is not None:                       # check the seam took the setting
        model = core.model_executor.driver_worker.model_runner.model
        attns = [m for m in model.modules() if isinstance(m, LlamaAttention)]
        assert attns and all(a.enable_qk_norm_rope_fusion == fused for a in attns)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_fused_matches_unfused_and_transformers(tiny_qwen3_dir, monkeypatch):
    import transformers
    fused = _tokens(tiny_qwen3_dir, True, monkeypatch)
    unfused = _tokens(tiny_qwen3_dir, False, monkeypatch)
    assert fused == unfused
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for prompt, ours in zip(_prompts(), fused):
            ids = torch.tensor([prompt], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=MAX_TOKENS)
            want = out[0, len(prompt):].tolist()     # (shorter if it stopped at an eos: we ignore eos)
            assert want and ours[:len(want)] == want

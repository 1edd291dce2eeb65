"""CUDA graphs: same greedy tokens as eager with full decode graphs and with
piecewise graphs for mixed batches; replays recorded with their padded size."""
import pytest
import torch

from vllm_anatomy.tracing.recorder import InMemoryRecorder

from tests.gpu.conftest import NUM_BLOCKS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LENS = [3, 17, 40, 90, 1, 33, 64, 120, 7]       # 9 requests: decode batches 9, 8, ... pad to 16, 8, 8, 8, 4 ...


def _run(model_dir, dtype, enforce_eager, recorder=None, max_tokens=24, async_scheduling=None,
         num_blocks=NUM_BLOCKS, cudagraph_mode="FULL_AND_PIECEWISE"):
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model_dir, device="cuda", dtype=dtype, max_model_len=512, num_gpu_blocks_override=num_blocks,
              max_num_batched_tokens=128, max_num_seqs=16, enforce_eager=enforce_eager, recorder=recorder,
              async_scheduling=async_scheduling, cudagraph_mode=cudagraph_mode)
    vocab = llm.llm_engine.vllm_config.model_config.hf_config["vocab_size"]
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % (vocab - 10) + 5 for j in range(n)]}
               for i, n in enumerate(LENS)]
    # Different lengths of output, so the decode batch shrinks through odd sizes.
    params = [SamplingParams(temperature=0, max_tokens=max_tokens - 2 * i, ignore_eos=True)
              for i in range(len(LENS))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    cc = llm.llm_engine.vllm_config.compilation_config
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == (async_scheduling is not False)
    _run.preemptions = llm.get_metrics()["vllm:num_preemptions"]
    llm.llm_engine.shutdown()
    del llm
    _free_gpu()
    return cc, [o.outputs[0].token_ids for o in outs]


def _free_gpu():
    # NOTE: the KV cache takes most of the device: the next engine of this
    # process sizes its own only after the previous one's is really gone.
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def _forward_spans(rec, mode):
    return [s for s in rec.find("GPUModelRunner._model_forward") if s.attrs["vllm_anatomy.cudagraph_mode"] == mode]


def test_graphs_match_eager_fp32(tiny_llama_dir):
    rec = InMemoryRecorder("spans")
    cc, graph_tokens = _run(tiny_llama_dir, "float32", False, rec)
    assert cc.cudagraph_mode == "FULL_AND_PIECEWISE"
    _, eager_tokens = _run(tiny_llama_dir, "float32", True)
    assert graph_tokens == eager_tokens
    # Start-up: warm-up, then piecewise captures for every size, then full
    # graphs for the decode sizes (<= max_num_seqs), each largest first.
    (capture,) = rec.find("GPUModelRunner.capture_model")
    captures = [(s.attrs["vllm_anatomy.cudagraph_mode"], s.attrs["vllm_anatomy.cudagraph_size"])
                for s in rec.find("CUDAGraph.capture")]
    sizes = sorted(cc.cudagraph_capture_sizes, reverse=True)
    assert captures == [("PIECEWISE", n) for n in sizes] + [("FULL", n) for n in sizes if n <= 16]
    assert rec.find("GPUModelRunner.warm_up")
    # Every step: full graphs for pure decodes, pieces for the rest (all fit in 128 tokens).
    full, pieces = _forward_spans(rec, "FULL"), _forward_spans(rec, "PIECEWISE")
    assert full and pieces and not _forward_spans(rec, "NONE")
    assert {s.attrs["vllm_anatomy.cudagraph_reason_code"] for s in full} == {"pure_decode"}
    assert {s.attrs["vllm_anatomy.cudagraph_reason_code"] for s in pieces} == {"mixed_batch"}
    padded = {s.attrs["vllm_anatomy.num_padded_tokens"] for s in full + pieces}
    assert padded <= set(cc.cudagraph_capture_sizes)
    assert any("padded" in s.attrs["vllm_anatomy.cudagraph_reason"] for s in full)


def test_full_decode_only_matches_eager(tiny_llama_dir):
    rec = InMemoryRecorder("spans")
    cc, graph_tokens = _run(tiny_llama_dir, "float32", False, rec, cudagraph_mode="FULL_DECODE_ONLY")
    assert cc.cudagraph_mode == "FULL_DECODE_ONLY" and max(cc.cudagraph_capture_sizes) == 16
    _, eager_tokens = _run(tiny_llama_dir, "float32", True)
    assert graph_tokens == eager_tokens
    assert [s.attrs["vllm_anatomy.cudagraph_mode"] for s in rec.find("CUDAGraph.capture")] == \
        ["FULL"] * len(cc.cudagraph_capture_sizes)
    full, eager = _forward_spans(rec, "FULL"), _forward_spans(rec, "NONE")
    assert full and eager and not _forward_spans(rec, "PIECEWISE")      # the prefill steps ran eager
    assert {s.attrs["vllm_anatomy.cudagraph_reason_code"] for s in full} == {"pure_decode"}
    assert all("prefill" in s.attrs["vllm_anatomy.cudagraph_reason"] for s in eager)
    assert {s.attrs["vllm_anatomy.cudagraph_reason_code"] for s in eager} == {"prefill_in_batch"}


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_graphs_match_eager_qwen3_shape_bf16(qwen3_shape_dir, mode):
    """The throughput bench's model shape (3 of its layers), random bf16 weights."""
    _, graph_tokens = _run(qwen3_shape_dir, "bfloat16", False, max_tokens=40, cudagraph_mode=mode)
    _, eager_tokens = _run(qwen3_shape_dir, "bfloat16", True, max_tokens=40)
    assert graph_tokens == eager_tokens


@pytest.mark.parametrize("num_blocks", [NUM_BLOCKS, 33], ids=["roomy", "preempting"])
def test_async_scheduling_matches_sync(tiny_llama_dir, num_blocks):
    """Async scheduling (the GPU default) splices last step's sampled ids into
    input_ids on the device and waits one step late; greedy tokens must not
    change, with graphs replaying and with preemptions dropping in-flight tokens."""
    rec = InMemoryRecorder("spans")
    _, async_tokens = _run(tiny_llama_dir, "float32", False, rec, num_blocks=num_blocks)
    async_preemptions = _run.preemptions
    _, sync_tokens = _run(tiny_llama_dir, "float32", False, async_scheduling=False, num_blocks=num_blocks)
    assert async_tokens == sync_tokens
    if num_blocks == 33:            # 32 usable blocks of 16 for max_model_len 512: the requests must share
        assert async_preemptions > 0
    gets = rec.find("AsyncGPUModelRunnerOutput.get_output")
    steps = rec.find("EngineCore.step")
    assert gets and len(gets) <= len(steps)
    assert any(s.attrs["vllm_anatomy.cudagraph_mode"] == "FULL" for s in rec.find("GPUModelRunner._model_forward"))
    # Device spans, placed by the clock anchor even when the wait was zero:
    # each step's phases in order, inside a plausible window.
    device = [s for s in rec.spans if s.attrs.get("vllm_anatomy.lane") == "device" and s.name.startswith("GPU.")]
    assert device and all(s.end_ns >= s.start_ns for s in device)
    first, last = min(s.start_ns for s in steps), max(s.end_ns for s in steps)
    assert all(first - 10**9 <= s.start_ns <= last + 10**9 for s in device)

"""The run meta's model_weight_bytes: the bytes of the weights the worker loaded (one rank's).

Before it, the dashboard guessed them from the model's files on the recording machine (Q5's
memory account and Compare's "weights (one rank) (MB)" row said "not recorded" elsewhere).
The tensor-parallel case is tests/distributed/test_tp_trace.py's."""
import json
import os

from vllm_anatomy import LLM
from vllm_anatomy.model_executor.dummy_configs import num_parameters
from vllm_anatomy.tracing.reader import open_run


def test_the_run_meta_records_the_bytes_of_the_loaded_weights(tiny_llama_dir, tmp_path):
    llm = LLM(tiny_llama_dir, trace_level="spans", trace_dir=str(tmp_path), max_model_len=64,
              num_gpu_blocks_override=16)
    try:
        runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
        params = list(runner.model.parameters())
        loaded = sum(p.nbytes for p in params)
        itemsize = params[0].element_size()
        path = llm.llm_engine.recorder.run_path
    finally:
        llm.llm_engine.shutdown()
    with open_run(path) as run:
        meta = run.meta
    assert meta["model_weight_bytes"] == loaded
    # the checkpoint's parameters, the tied LM head counted once (it is the embedding)
    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        assert loaded == num_parameters(json.load(f)) * itemsize
    from dashboard.answers.source import weight_bytes_of
    assert weight_bytes_of({**meta, "model": "/nowhere"}) == (loaded, "recorded in the run meta")


def test_a_weight_two_models_share_is_counted_once():
    """A draft model's weights count with the target's (vLLM measures both under one DeviceMemoryProfiler);
    a tensor both hold (a tied or shared embedding) once."""
    import torch

    from vllm_anatomy.worker.model_runner_startup import loaded_weight_bytes
    target = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False))
    target[1].weight = target[0].weight                              # tied: [16, 8] once
    draft = torch.nn.Sequential(target[0], torch.nn.Linear(8, 4))    # shares the embedding
    assert loaded_weight_bytes(target) == 16 * 8 * 4
    assert loaded_weight_bytes(target, draft) == (16 * 8 + 8 * 4 + 4) * 4
    assert loaded_weight_bytes(target, None) == loaded_weight_bytes(target)

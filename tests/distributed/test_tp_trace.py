"""The communication account of a TP=2 run, read back from its run store.

Every step, on both ranks, Worker.execute_model carries the step's
collectives: 2 all-reduces per layer (o_proj, down_proj) plus the embedding's,
each of the [T, H] activation, and one all-gather of the logits. At level
full each collective is also a span of its own. The meta knows the TP size
and both ranks' pids, which are the pids of the spans' processes.
"""
import pytest

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.tracing.reader import open_run

NUM_LAYERS, HIDDEN, VOCAB, FP32 = 2, 128, 512, 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _traced_run(model: str, level: str, trace_dir) -> tuple[str, list[dict]]:
    llm = LLM(model=model, tensor_parallel_size=2, num_gpu_blocks_override=64, max_model_len=256,
              max_num_batched_tokens=16, trace_level=level, trace_dir=str(trace_dir))
    try:
        llm.generate(["t5 t6 t7 t8 t9", " ".join(f"t{i}" for i in range(300, 320))], PARAMS, use_tqdm=False)
        ranks = llm.llm_engine.engine_core.model_executor.rank_info
    finally:
        llm.llm_engine.shutdown()
    (path,) = trace_dir.glob("run-*.sqlite")
    return str(path), ranks


@pytest.fixture(scope="module")
def spans_run(tiny_tp_models, tmp_path_factory):
    return _traced_run(tiny_tp_models["llama"], "spans", tmp_path_factory.mktemp("spans"))


def test_every_step_counts_its_collectives_on_both_ranks(spans_run):
    path, ranks = spans_run
    with open_run(path) as run:
        workers = run.spans("Worker.execute_model")
        runners = {(s.pid, s.parent_id): s for s in run.spans("GPUModelRunner.execute_model")}
        steps = {s.step_id for s in run.spans("EngineCore.step")} - {None}
        assert run.meta["tensor_parallel_size"] == 2
        assert [r["pid"] for r in run.meta["ranks"]] == [r["pid"] for r in ranks]
    pids = [r["pid"] for r in ranks]
    assert {s.pid for s in workers} == set(pids)             # both ranks' spans are in the store
    for pid in pids:
        mine = [s for s in workers if s.pid == pid]
        assert len(steps) >= 5 and sorted(s.step_id for s in mine) == sorted(steps)   # every step, once
        for span in mine:
            attrs = span.attributes
            num_tokens = runners[(pid, span.span_id)].attributes["vllm_anatomy.num_scheduled_tokens"]
            if num_tokens == 0:
                continue
            assert attrs["vllm_anatomy.num_all_reduce"] == 2 * NUM_LAYERS + 1
            assert attrs["vllm_anatomy.all_reduce_bytes"] == (2 * NUM_LAYERS + 1) * num_tokens * HIDDEN * FP32
            assert attrs["vllm_anatomy.num_all_gather"] == 1
            num_reqs = attrs["vllm_anatomy.all_gather_bytes"] // (VOCAB // 2 * FP32)
            assert 1 <= num_reqs <= 2
            assert attrs["vllm_anatomy.num_broadcast"] == 0


def test_the_run_meta_records_one_ranks_weights(spans_run, tiny_tp_models):
    """model_weight_bytes is one rank's (the dashboard's "weights (one rank)"): each rank holds half of
    every sharded weight (the vocabulary, attention, MLP) and the whole of each replicated norm."""
    import json
    import os

    from vllm_anatomy.model_executor.dummy_configs import num_parameters
    with open(os.path.join(tiny_tp_models["llama"], "config.json")) as f:
        total = num_parameters(json.load(f))                  # the tied LM head is the embedding
    norms = 2 * NUM_LAYERS * HIDDEN + HIDDEN                  # input/post-attention norms, the final norm
    path, _ = spans_run
    with open_run(path) as run:
        assert run.meta["model_weight_bytes"] == ((total - norms) // 2 + norms) * FP32


def test_level_full_has_one_span_per_collective(tiny_tp_models, tmp_path):
    path, ranks = _traced_run(tiny_tp_models["llama"], "full", tmp_path)
    with open_run(path) as run:
        workers = run.spans("Worker.execute_model")
        all_reduces = run.spans("GroupCoordinator.all_reduce")
        all_gathers = run.spans("GroupCoordinator.all_gather")
    for pid in (r["pid"] for r in ranks):
        mine = [s for s in workers if s.pid == pid]
        assert sum(s.attributes["vllm_anatomy.num_all_reduce"] for s in mine) == \
            len([s for s in all_reduces if s.pid == pid and s.start_ns >= min(w.start_ns for w in mine)])
        assert sum(s.attributes["vllm_anatomy.num_all_gather"] for s in mine) == \
            len([s for s in all_gathers if s.pid == pid and s.start_ns >= min(w.start_ns for w in mine)])
    span = next(s for s in all_reduces if s.start_ns >= min(w.start_ns for w in workers))
    assert span.attributes["vllm_anatomy.collective"] == "all_reduce"
    assert span.attributes["vllm_anatomy.group_size"] == 2
    assert span.attributes["vllm_anatomy.bytes"] % (HIDDEN * FP32) == 0

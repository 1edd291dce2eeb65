"""GPUModelRunner on CPU with a tiny random Llama: prepare_inputs tensors, the step
split, chunked prefill, finish, preemption + resume, and greedy parity with transformers."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm_anatomy.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from vllm_anatomy.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.tracing.recorder import InMemoryRecorder
from vllm_anatomy.worker.gpu_model_runner import GPUModelRunner
from vllm_anatomy.worker.worker import Worker

BLOCK_SIZE = 4
VOCAB = 97
# The same scenarios on CUDA when there is one (pinned buffers, transfer_event, device generators).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random 2-layer Llama (GQA 4/2 heads) saved with save_pretrained; returns (dir, hf model)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.3, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None     # never stop early: compare fixed lengths
    model.generation_config.pad_token_id = 0
    return path, model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def make_runner(path, recorder=None, device="cpu") -> GPUModelRunner:
    vc = VllmConfig(ModelConfig(model=str(path), max_model_len=64, device=device),
                    CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=32),
                    SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64))
    runner = GPUModelRunner(vc, device, recorder or InMemoryRecorder("full"))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_available_blocks())
    return runner


def new(req_id, prompt, blocks, **sp) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=list(prompt),
                          sampling_params=SamplingParams(max_tokens=None, **sp), block_ids=(list(blocks),),
                          num_computed_tokens=0)


def make_so(step, num_scheduled, new_reqs=(), cached=(), finished=(), preempted=()) -> SchedulerOutput:
    """cached: (req_id, num_computed_tokens, new_blocks | None, resumed_token_ids | None)."""
    cd = CachedRequestData(
        req_ids=[c[0] for c in cached], resumed_req_ids={c[0] for c in cached if c[3] is not None},
        new_token_ids=[], all_token_ids={c[0]: c[3] for c in cached if c[3] is not None},
        new_block_ids=[None if c[2] is None else (list(c[2]),) for c in cached],
        num_computed_tokens=[c[1] for c in cached], num_output_tokens=[0] * len(cached))
    so = SchedulerOutput(scheduled_new_reqs=list(new_reqs), scheduled_cached_reqs=cd,
                         num_scheduled_tokens=dict(num_scheduled), total_num_scheduled_tokens=sum(num_scheduled.values()),
                         finished_req_ids=set(finished), preempted_req_ids=set(preempted), step_id=step)
    # Through the wire format, as a worker in another process would receive it.
    return msgspec.msgpack.decode(msgspec.msgpack.encode(so), type=SchedulerOutput)


def step(runner, so):
    assert runner.execute_model(so) is None
    return runner.sample_tokens(None)


def prompt(seed, n):
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_inputs_article_example(tiny_llama, device):
    """num_scheduled [2, 5, 3] -> cu [2, 7, 10], arange [0,1,0,1,2,3,4,0,1,2]."""
    runner = make_runner(tiny_llama[0], device=device)
    pa, pb, pc = prompt(1, 2), prompt(2, 5), prompt(3, 3)
    out = step(runner, make_so(1, {"a": 2, "b": 5, "c": 3},
                               [new("a", pa, [3], temperature=0), new("b", pb, [5, 9], temperature=0),
                                new("c", pc, [7], temperature=0)]))
    rec = runner.last_prepare_inputs
    assert rec["cu_num_tokens"] == [2, 7, 10]
    assert rec["arange"] == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
    assert rec["req_indices"] == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    assert rec["positions"] == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
    assert rec["input_ids"] == pa + pb + pc
    assert rec["query_start_loc"] == [0, 2, 7, 10]
    assert rec["seq_lens"] == [2, 5, 3]
    # block 3 -> slots 12.., block 5 -> 20..23 then block 9 -> 36, block 7 -> 28..
    assert rec["slot_mapping"] == [12, 13, 20, 21, 22, 23, 36, 28, 29, 30]
    assert rec["logits_indices"] == [1, 6, 9]
    # The recorded lists are what the device buffers hold.
    assert runner.input_ids.gpu[:10].tolist() == rec["input_ids"]
    assert runner.positions.gpu[:10].tolist() == rec["positions"]
    assert runner.query_start_loc.gpu[:4].tolist() == rec["query_start_loc"]
    assert (runner.query_start_loc.np[4:] == 10).all()   # padded: stays non-decreasing
    assert runner.seq_lens.gpu[:3].tolist() == rec["seq_lens"]
    bt = runner.input_batch.block_table
    assert bt.slot_mapping[:10].tolist() == rec["slot_mapping"]
    assert bt.block_table[:3, :2].tolist() == [[3, 0], [5, 9], [7, 0]]
    assert out.req_ids == ["a", "b", "c"] and all(len(t) == 1 for t in out.sampled_token_ids)
    # Decode step: positions continue from num_computed_tokens; b needs no new block.
    step(runner, make_so(2, {"a": 1, "b": 1, "c": 1},
                         cached=[("a", 2, None, None), ("b", 5, None, None), ("c", 3, None, None)]))
    rec = runner.last_prepare_inputs
    assert rec["positions"] == [2, 5, 3]
    assert rec["input_ids"] == [t[0] for t in out.sampled_token_ids]   # the tokens just sampled
    assert rec["seq_lens"] == [3, 6, 4]
    assert rec["slot_mapping"] == [14, 37, 31]


@pytest.mark.parametrize("device", DEVICES)
def test_scenario_matches_transformers_greedy(tiny_llama, device):
    path, hf = tiny_llama
    rec = InMemoryRecorder("full")
    runner = make_runner(path, rec, device)
    pa, pb, pc = prompt(10, 6), prompt(11, 10), prompt(12, 5)
    toks = {"A": [], "B": [], "C": []}

    def run(so):
        out = step(runner, so)
        for req_id, ids in zip(out.req_ids, out.sampled_token_ids):
            toks[req_id] += ids
            assert out.req_id_to_index[req_id] == out.req_ids.index(req_id)
        return out

    # 1. Two new requests: A whole, B only its first 4-token chunk (discarded sample).
    out = run(make_so(1, {"A": 6, "B": 4}, [new("A", pa, [1, 2], temperature=0),
                                             new("B", pb, [3], temperature=0, logprobs=2)]))
    # One batched LogprobsLists: a row per request (A's too), as wide as the batch's largest `logprobs` + 1.
    assert out.sampled_token_ids[1] == [] and out.logprobs.logprob_token_ids.shape == (2, 3)
    # 2. A decodes, B finishes its prompt (2 new blocks), C arrives.
    out = run(make_so(2, {"A": 1, "B": 6, "C": 5}, [new("C", pc, [6, 7], temperature=0)],
                      cached=[("A", 6, None, None), ("B", 4, [4, 5], None)]))
    assert runner.last_prepare_inputs["positions"] == [6, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    lp = out.logprobs.slice_request(1, 1)
    assert lp.logprob_token_ids.shape == (1, 3)
    assert lp.logprob_token_ids[0][0] == toks["B"][0] and lp.sampled_token_ranks.tolist() == [1]
    # 3. A finished: its row 0 is filled by the last row (C).
    out = run(make_so(3, {"B": 1, "C": 1}, cached=[("B", 10, None, None), ("C", 5, None, None)],
                      finished={"A"}))
    assert out.req_ids == ["C", "B"]
    assert runner.input_batch.last_condense_moves == [(2, 0)]
    assert "A" not in runner.requests
    # 4-5. B preempted: out of the batch, its state kept. C decodes (new block at pos 8).
    run(make_so(4, {"C": 1}, cached=[("C", 6, None, None)], preempted={"B"}))
    assert "B" in runner.requests and "B" not in runner.input_batch.req_id_to_index
    run(make_so(5, {"C": 1}, cached=[("C", 7, None, None)]))
    # The freed blocks of B get reused by someone else: clobber them.
    for kv in runner.kv_caches:
        kv[:, [3, 4, 5]] = 1e3
    # 6. B resumes with new blocks replacing the old ones: recompute 8 of its 12 tokens.
    b_tokens = pb + toks["B"]
    out = run(make_so(6, {"C": 1, "B": 8}, cached=[("C", 8, [8], None), ("B", 0, [10, 11], b_tokens)]))
    assert out.req_ids == ["C", "B"] and out.sampled_token_ids[1] == []
    assert runner.input_batch.snapshot()["rows"][1]["block_ids"] == [10, 11]
    # 7-8. B finishes recomputing, then decodes; C keeps decoding.
    run(make_so(7, {"C": 1, "B": 4}, cached=[("C", 9, None, None), ("B", 8, [12], None)]))
    run(make_so(8, {"C": 1, "B": 1}, cached=[("C", 10, None, None), ("B", 12, [14], None)]))
    assert runner.input_batch.snapshot()["rows"][1]["block_ids"] == [10, 11, 12, 14]

    assert len(toks["A"]) == 2 and len(toks["B"]) == 4 and len(toks["C"]) == 7
    for req_id, p in (("A", pa), ("B", pb), ("C", pc)):
        assert toks[req_id] == hf_greedy(hf, p, len(toks[req_id])), req_id
    assert runner.requests["B"].output_token_ids == toks["B"]

    names = rec.span_names()
    for name in ("GPUModelRunner._update_states", "GPUModelRunner._prepare_inputs",
                 "GPUModelRunner._model_forward", "GPUModelRunner._bookkeeping_sync"):
        assert names.count(name) == 8, name
    assert [s[0] for s in rec.snapshots].count("model_runner") == 8
    snap = runner.snapshot()
    assert snap["kv_cache_shape"] == [2, 32, BLOCK_SIZE, 2, 16]
    assert {r["req_id"]: r["num_tokens"] for r in snap["input_batch"]["rows"]} == {"C": 12, "B": 14}


def test_logprobs_match_transformers(tiny_llama):
    path, hf = tiny_llama
    runner = make_runner(path)
    p = prompt(20, 7)
    out = step(runner, make_so(1, {"x": 7}, [new("x", p, [2, 3], temperature=0, logprobs=3)]))
    lp = out.logprobs.slice_request(0, 1)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), -1)
    assert lp.logprob_token_ids[0][1:].tolist() == ref.topk(3).indices.tolist()
    torch.testing.assert_close(torch.as_tensor(lp.logprobs[0]), ref[torch.as_tensor(lp.logprob_token_ids[0])],
                               rtol=1e-4, atol=1e-4)


def test_prompt_logprobs_match_transformers_across_chunks(tiny_llama):
    """prompt_logprobs=2 over a prompt prefilled in two chunks: nothing after the first,
    then every position's logprob of the next prompt token, its rank and the top-2."""
    path, hf = tiny_llama
    runner = make_runner(path)
    p = prompt(5, 12)
    out = step(runner, make_so(1, {"x": 5}, [new("x", p, [2, 3], temperature=0, prompt_logprobs=2)]))
    assert out.prompt_logprobs_dict == {} and out.sampled_token_ids == [[]]
    out = step(runner, make_so(2, {"x": 7}, cached=[("x", 5, [4], None)]))
    plp = out.prompt_logprobs_dict["x"]
    assert plp.logprob_token_ids.shape == (11, 3) and plp.selected_token_ranks.shape == (11,)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0, :-1].float(), -1)     # position i scores p[i + 1]
    assert plp.logprob_token_ids[:, 0].tolist() == p[1:]
    assert plp.logprob_token_ids[:, 1:].tolist() == ref.topk(2).indices.tolist()
    torch.testing.assert_close(plp.logprobs[:, 0], ref[torch.arange(11), torch.tensor(p[1:])], rtol=1e-4, atol=1e-4)
    expected_ranks = (ref >= ref[torch.arange(11), torch.tensor(p[1:])][:, None]).sum(-1)
    assert plp.selected_token_ranks.tolist() == expected_ranks.tolist()
    assert runner.num_prompt_logprobs == {} and runner.in_progress_prompt_logprobs_cpu == {}


def seeded_tokens(path, chunks: list[int], seed: int, num_decodes: int = 3, device="cpu") -> list[int]:
    runner = make_runner(path, device=device)
    p = prompt(30, sum(chunks))
    blocks = list(range(1, 1 + -(-(sum(chunks) + num_decodes) // BLOCK_SIZE)))
    toks, done = [], 0
    for i, n in enumerate(chunks):
        so = (make_so(i, {"s": n}, [new("s", p, blocks, temperature=1.5, seed=seed)]) if i == 0
              else make_so(i, {"s": n}, cached=[("s", done, None, None)]))
        out = step(runner, so)
        done += n
        toks += out.sampled_token_ids[0]
    for j in range(num_decodes - 1):
        toks += step(runner, make_so(10 + j, {"s": 1}, cached=[("s", done, None, None)])).sampled_token_ids[0]
        done += 1
    return toks


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_independent_of_chunking(tiny_llama, device):
    path = tiny_llama[0]
    whole = seeded_tokens(path, [10], seed=7, device=device)
    assert seeded_tokens(path, [4, 4, 2], seed=7, device=device) == whole   # generator rolled back
    assert seeded_tokens(path, [10], seed=8, device=device) != whole        # and the seed matters


def test_step_protocol_errors_and_empty_step(tiny_llama):
    runner = make_runner(tiny_llama[0])
    with pytest.raises(RuntimeError):
        runner.sample_tokens(None)
    so = make_so(1, {"r": 3}, [new("r", prompt(40, 3), [1], temperature=0)])
    runner.execute_model(so)
    with pytest.raises(RuntimeError):
        runner.execute_model(so)
    runner.sample_tokens(None)
    # Everything finished: nothing scheduled, the batch empties, and (as in vLLM)
    # execute_model itself answers EMPTY: there is nothing to sample.
    assert runner.execute_model(make_so(2, {}, finished={"r"})) is EMPTY_MODEL_RUNNER_OUTPUT
    with pytest.raises(RuntimeError):
        runner.sample_tokens(None)
    assert runner.input_batch.num_reqs == 0 and not runner.requests


def test_worker_start_up_by_method_name(tiny_llama):
    path = tiny_llama[0]
    vc = VllmConfig(ModelConfig(model=str(path), max_model_len=64), CacheConfig(block_size=BLOCK_SIZE),
                    SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2, max_model_len=64))
    worker = Worker(vc, "cpu")
    for method in ("init_device", "load_model"):
        getattr(worker, method)()
    num_blocks = worker.determine_num_available_blocks()
    # CPU: the fixed byte budget over (2 x block_size x kv_heads x head_dim x 4 bytes x layers).
    assert num_blocks == vc.cache_config.cpu_kv_cache_space_bytes // (2 * BLOCK_SIZE * 2 * 16 * 4 * 2)
    worker.initialize_from_config(8)
    assert vc.cache_config.num_gpu_blocks == 8
    out = (worker.execute_model(make_so(1, {"w": 2}, [new("w", [5, 6], [1], temperature=0)])),
           worker.sample_tokens(None))
    assert out[0] is None and out[1].req_ids == ["w"] and len(out[1].sampled_token_ids[0]) == 1
    assert worker.snapshot()["kv_cache_shape"] == [2, 8, BLOCK_SIZE, 2, 16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_num_blocks_from_memory_profile(tiny_llama):
    """KV blocks fill what gpu_memory_utilization leaves after weights + the dummy step's peak."""
    vc = VllmConfig(ModelConfig(model=str(tiny_llama[0]), max_model_len=64, device="cuda"),
                    CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.05),
                    SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64))
    rec = InMemoryRecorder("full")
    # What the budget cannot have: memory outside this process's torch allocator (the CUDA
    # context, other processes, what earlier tests in this process left to the driver).
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    elsewhere = (total - free0) - torch.cuda.memory_reserved()
    worker = Worker(vc, "cuda", rec)
    worker.init_device()
    worker.load_model()
    num_blocks = worker.determine_num_available_blocks()
    free, total = torch.cuda.mem_get_info()
    budget = 0.05 * total
    bytes_per_block = worker.model_runner.get_kv_cache_bytes_per_block()
    assert 0.5 * (budget - elsewhere) < num_blocks * bytes_per_block <= budget
    worker.initialize_from_config(num_blocks)
    used = total - torch.cuda.mem_get_info()[0]
    assert used <= budget + (total - free) + 64 * 2**20       # the cache fits the budget
    worker.execute_model(make_so(1, {"g": 3}, [new("g", [5, 6, 7], [num_blocks - 1], temperature=0)]))
    out = worker.sample_tokens(None)
    assert len(out.sampled_token_ids[0]) == 1
    sync = rec.find("GPUModelRunner._bookkeeping_sync")[0]
    assert sync.attrs["vllm_anatomy.device"] == "cuda" and sync.attrs["vllm_anatomy.sync_wait_ms"] >= 0


@pytest.mark.parametrize("device", DEVICES)
def test_trace_level_never_changes_what_is_computed(tiny_llama, device):
    """off, spans and full: the same tokens and the same device buffers; at full the
    snapshot reads what was computed (the slot mapping from the buffer the kernels read)."""
    from vllm_anatomy.tracing.runner_tracer import NULL_KERNEL_TIMER, NULL_STEP_SNAPSHOTS
    pa, pb = prompt(11, 9), prompt(12, 6)
    steps = [make_so(1, {"a": 6, "b": 6}, [new("a", pa, [3, 4, 5], temperature=0),
                                           new("b", pb, [8, 9], temperature=0)]),
             make_so(2, {"a": 3, "b": 1}, cached=[("a", 6, None, None), ("b", 6, [10], None)]),
             make_so(3, {"a": 1, "b": 1}, cached=[("a", 9, None, None), ("b", 7, None, None)])]
    results = {}
    for level in ("off", "spans", "full"):
        rec = InMemoryRecorder(level)
        runner = make_runner(tiny_llama[0], rec, device=device)
        tokens, buffers = [], []
        for so in steps:
            tokens.append(step(runner, so).sampled_token_ids)
            total = so.total_num_scheduled_tokens
            buffers.append((runner.input_ids.gpu[:total].tolist(), runner.positions.gpu[:total].tolist(),
                            runner.input_batch.block_table.slot_mapping[:total].tolist()))
            if level == "full":
                snap = [d for kind, _, d in rec.snapshots if kind == "model_runner"][-1]
                assert snap["prepare_inputs"]["slot_mapping"] == buffers[-1][2]
                assert snap["prepare_inputs"]["cudagraph"]["reason_code"] == "cudagraphs_off"
            else:
                assert runner.last_prepare_inputs is None
        results[level] = (tokens, buffers)
        full = level == "full"
        assert (runner.tracer.snapshots is NULL_STEP_SNAPSHOTS) != full
        assert (runner.tracer.kernel_timer is NULL_KERNEL_TIMER) == (not full or device == "cpu")
    assert results["off"] == results["spans"] == results["full"]
    assert results["full"][1][0][2][:6] == [12, 13, 14, 15, 16, 17]       # a: blocks 3, 4 (block_size 4)

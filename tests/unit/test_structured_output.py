"""Structured output in the scheduler, GPU-free: real xgrammar grammars over a tiny
vocabulary, fabricated ModelRunnerOutputs (no model, no tokenizer).

What is pinned (v0.27.1's rules):
  * a structured request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR (in
    skipped_waiting) while its grammar compiles, never blocks the requests
    behind it, and is promoted to WAITING once the Future is done;
  * a failed compile finishes that request alone with FINISHED_ERROR;
  * get_grammar_bitmask: one row per scheduled structured request that samples
    (no partial prefill chunk), in scheduling order, each row what the
    request's own matcher allows after the tokens it has accepted;
  * update_from_output advances the grammar; a token it refuses is an error;
  * async scheduling: pending_structured_output_tokens when a structured
    request's previous token is still in flight;
  * apply_grammar_bitmask maps the scheduler's rows onto the worker's batch rows.
"""
from __future__ import annotations

import time
import types
from concurrent.futures import Future

import numpy as np
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm_anatomy.core.outputs import ModelRunnerOutput
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.async_scheduler import AsyncScheduler
from vllm_anatomy.core.sched.output import GrammarOutput
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.engine.protocol import FinishReason
from vllm_anatomy.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_anatomy.structured_output import StructuredOutputManager
from vllm_anatomy.structured_output.backend_types import StructuredOutputBackend
from vllm_anatomy.structured_output.backend_xgrammar import XgrammarBackend
from vllm_anatomy.structured_output.request import StructuredOutputRequest
from vllm_anatomy.structured_output.utils import apply_grammar_bitmask
from tests.unit.core_utils import new_scheduler

# A raw vocabulary: id = index. 0 is EOS (xgrammar's stop token). Ids 18, 19 are
# padding rows of the "model's" vocabulary: never allowed.
VOCAB = ["<eos>", "{", "}", '"', "a", "b", ":", ",", "1", "2", " ", "x", "yes", "no", "y", "es", "n", "o"]
VOCAB_SIZE = 20
EOS = 0
CHOICES = {"yn": ["yes", "no"], "ab": ["a", "b", "ab"], "digits": ["1", "12", "21"]}


def tok(text: str) -> int:
    return VOCAB.index(text)


def make_config(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=False) -> VllmConfig:
    return VllmConfig(ModelConfig(model="fake", max_model_len=64), CacheConfig(block_size=16),
                      SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      max_model_len=64, async_scheduling=async_scheduling))


def make_manager(config: VllmConfig) -> StructuredOutputManager:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS])
    return StructuredOutputManager(config, backend=XgrammarBackend(config, tokenizer=info, vocab_size=VOCAB_SIZE))


def make_scheduler(**kw) -> Scheduler:
    config = make_config(**kw)
    cls = AsyncScheduler if kw.get("async_scheduling") else Scheduler
    return new_scheduler(config, 100, cls, make_manager(config))


def make_request(req_id: str, prompt_len: int = 4, choice: str | None = None, max_tokens: int = 8) -> Request:
    so = StructuredOutputsParams(choice=CHOICES[choice]) if choice else None
    return Request(req_id, [100 + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, structured_outputs=so, eos_token_id=EOS))


def so_request(request: Request) -> StructuredOutputRequest:
    """The request's structured-output state (one made with a constraint has it)."""
    assert request.structured_output_request is not None, f"{request.request_id} has no constraint"
    return request.structured_output_request


def backend_of(s: Scheduler) -> StructuredOutputBackend:
    """The scheduler's grammar backend (made by the first grammar_init)."""
    assert s.structured_output_manager.backend is not None, "no grammar_init yet"
    return s.structured_output_manager.backend


def add(s: Scheduler, request: Request) -> Request:
    """As EngineCore.preprocess_add_request + add_request: grammar_init, then queue."""
    s.structured_output_manager.grammar_init(request)
    while request.use_structured_output and not so_request(request).is_grammar_ready:
        time.sleep(0.001)                                        # compiling (a few ms)
    s.add_request(request)
    return request


def allowed(row: np.ndarray) -> set[int]:
    return {t for t in range(VOCAB_SIZE) if (int(row[t // 32]) >> (t % 32)) & 1}


def output(so, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [tokens.get(r, []) for r in req_ids])


def finishes(outs) -> dict[str, FinishReason | None]:
    return {o.request_id: o.finish_reason for eco in outs.values() for o in eco.outputs}


def test_request_waits_for_its_grammar_without_blocking_the_queue():
    s = make_scheduler()
    slow = make_request("slow", choice="yn")
    pending: Future = Future()
    slow.structured_output_request.grammar = pending          # still compiling
    s.add_request(slow)
    s.add_request(make_request("plain"))
    assert slow.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["plain"]          # passed over, not waited for
    snap = s.snapshot()
    assert [(r["request_id"], r["status"]) for r in snap["skipped_waiting"]] == \
        [("slow", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR")]
    assert snap["step_record"]["deferred_req_ids"] == ["slow"] and snap["step_record"]["grammar_ready_req_ids"] == []
    assert snap["step_record"]["deferred_reasons"] == {"slow": "grammar_compiling"}
    s.update_from_output(so, output(so, {"plain": [7]}))

    pending.set_result(s.structured_output_manager.backend.compile_grammar(
        *slow.structured_output_request.structured_output_key))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"plain": 1, "slow": 4}
    assert slow.status == RequestStatus.RUNNING
    assert s.last_step_record.grammar_ready_req_ids == ["slow"]
    # (what the tracer's grammar spans read; kept with the step record off too, as below level full)
    assert s.last_grammar_ready_req_ids == ["slow"]


def test_failed_compile_finishes_that_request_alone():
    s = make_scheduler()
    bad = make_request("bad", choice="yn")
    failed: Future = Future()
    failed.set_exception(RuntimeError("cannot compile"))
    bad.structured_output_request.grammar = failed
    s.add_request(bad)
    s.add_request(make_request("ok"))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["ok"]
    assert s.last_step_record.deferred_reasons == {"bad": "grammar_failed"}
    outs = s.update_from_output(so, output(so, {"ok": [7]}))
    assert finishes(outs) == {"ok": None, "bad": FinishReason.ERROR}
    assert "bad" not in s.requests and bad.status == RequestStatus.FINISHED_ERROR
    assert [r.request_id for r in s.running] == ["ok"] and not s.skipped_waiting


def test_grammar_advances_and_a_refused_token_is_an_error():
    s = make_scheduler()
    good, bad = add(s, make_request("good", choice="yn")), add(s, make_request("bad", choice="yn"))
    so = s.schedule()
    go = s.get_grammar_bitmask(so)
    assert go.structured_output_request_ids == ["good", "bad"]
    assert allowed(go.grammar_bitmask[0]) == {tok("yes"), tok("no"), tok("y"), tok("n")}
    outs = s.update_from_output(so, output(so, {"good": [tok("y")], "bad": [tok("a")]}))
    assert finishes(outs) == {"good": None, "bad": FinishReason.ERROR}
    assert bad.status == RequestStatus.FINISHED_ERROR and [r.request_id for r in s.running] == ["good"]
    so = s.schedule()
    assert allowed(s.get_grammar_bitmask(so).grammar_bitmask[0]) == {tok("es")}
    s.update_from_output(so, output(so, {"good": [tok("es")]}))
    so = s.schedule()
    assert allowed(s.get_grammar_bitmask(so).grammar_bitmask[0]) == {EOS}      # "yes" is complete
    outs = s.update_from_output(so, output(so, {"good": [EOS]}))
    assert finishes(outs) == {"good": FinishReason.STOP} and list(good.output_token_ids) == [tok("y"), tok("es"), EOS]


def test_no_bitmask_without_structured_requests_or_for_a_partial_prefill():
    s = make_scheduler(max_num_batched_tokens=6)
    add(s, make_request("plain", prompt_len=3))
    so = s.schedule()
    assert not so.has_structured_output_requests and s.get_grammar_bitmask(so) is None
    s.update_from_output(so, output(so, {"plain": [7]}))
    add(s, make_request("long", prompt_len=10, choice="ab"))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"plain": 1, "long": 5}     # long: a partial prefill chunk
    assert not so.has_structured_output_requests and s.get_grammar_bitmask(so) is None


@st.composite
def batches(draw):
    n = draw(st.integers(1, 6))
    kinds = draw(st.lists(st.sampled_from([None, *CHOICES]), min_size=n, max_size=n))
    lens = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    return list(zip(kinds, lens)), draw(st.randoms(use_true_random=False))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_bitmask_rows_are_each_requests_own_grammar_in_scheduling_order(batch):
    """Random batches (plain and structured requests, chunked prefills): every
    step's rows are exactly the structured requests that sample, in scheduling
    order, and each row is what a fresh matcher fed the same tokens allows."""
    spec, rng = batch
    s = make_scheduler(max_num_batched_tokens=16)
    backend = s.structured_output_manager.backend
    reference = {}
    for i, (kind, prompt_len) in enumerate(spec):
        req = add(s, make_request(f"r{i}", prompt_len, choice=kind, max_tokens=6))
        if kind:
            reference[req.request_id] = backend.compile_grammar(*req.structured_output_request.structured_output_key)
    for _ in range(30):
        if not s.has_requests():
            break
        so = s.schedule()
        go = s.get_grammar_bitmask(so)
        expect = [r for r in so.num_scheduled_tokens if r in reference and not s.requests[r].is_prefill_chunk]
        assert (go.structured_output_request_ids if go else []) == expect
        tokens = {}
        for row, req_id in enumerate(expect):
            mask = np.zeros((1, 1), dtype=np.int32)
            reference[req_id].fill_bitmask(torch.from_numpy(mask), 0)
            assert allowed(go.grammar_bitmask[row]) == allowed(mask[0])
            tokens[req_id] = [rng.choice(sorted(allowed(mask[0])))]
            assert reference[req_id].accept_tokens(req_id, tokens[req_id])
        for req_id in so.num_scheduled_tokens:
            if req_id not in reference and not s.requests[req_id].is_prefill_chunk:
                tokens[req_id] = [rng.choice(range(1, VOCAB_SIZE))]
        outs = s.update_from_output(so, output(so, tokens))
        assert FinishReason.ERROR not in finishes(outs).values()
    assert not s.has_requests()


def test_async_pending_tokens_when_a_structured_token_is_in_flight():
    s = make_scheduler(async_scheduling=True)
    add(s, make_request("so", choice="ab"))
    add(s, make_request("plain"))
    so1 = s.schedule()                  # both prefill: nothing in flight yet
    assert so1.has_structured_output_requests and not so1.pending_structured_output_tokens
    so2 = s.schedule()                  # step 1's tokens still in flight
    assert so2.num_scheduled_tokens == {"so": 1, "plain": 1}
    assert so2.has_structured_output_requests and so2.pending_structured_output_tokens
    # EngineCore then defers step 2's sampling until step 1's token advanced the grammar:
    s.update_from_output(so1, output(so1, {"so": [tok("a")], "plain": [7]}))
    assert allowed(s.get_grammar_bitmask(so2).grammar_bitmask[0]) == {tok("b"), EOS}


def test_async_plain_requests_never_wait():
    s = make_scheduler(async_scheduling=True)
    add(s, make_request("plain"))
    s.schedule()
    so2 = s.schedule()
    assert not so2.has_structured_output_requests and not so2.pending_structured_output_tokens


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA device")])])
def test_apply_grammar_bitmask_follows_the_workers_rows(device):
    """The scheduler's rows (b, a) land on the batch rows of b and a (2 and 0);
    row 1, a plain request, is untouched (xgrammar's CPU kernel, or its CUDA one)."""
    logits = torch.zeros(3, VOCAB_SIZE, device=device)
    bitmask = np.zeros((2, 1), dtype=np.int32)
    bitmask[0, 0] = 1 << 5                  # b may only sample token 5
    bitmask[1, 0] = (1 << 1) | (1 << 2)     # a: tokens 1 and 2
    batch = types.SimpleNamespace(req_ids=["a", "plain", "b"], req_id_to_index={"a": 0, "plain": 1, "b": 2})
    no_drafts = types.SimpleNamespace(scheduled_spec_decode_tokens={})     # (a SchedulerOutput's one field read)
    apply_grammar_bitmask(no_drafts, GrammarOutput(["b", "a"], bitmask), batch, logits)
    finite = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert finite == [{1, 2}, set(range(VOCAB_SIZE)), {5}]


def test_grammar_output_crosses_the_wire():
    from vllm_anatomy.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
    go = GrammarOutput(["a", "b"], np.arange(6, dtype=np.int32).reshape(2, 3))
    back = MsgpackDecoder(GrammarOutput | None).decode(MsgpackEncoder().encode(go))
    assert back.structured_output_request_ids == ["a", "b"]
    assert back.grammar_bitmask.dtype == np.int32 and (back.grammar_bitmask == go.grammar_bitmask).all()


@pytest.mark.parametrize("params, message", [
    (dict(json='{"type": "nonsense"}'), "Unsupported type"),
    (dict(json="{not json"), "Invalid JSON"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="root ::= "), "grammar"),
    (dict(choice=[]), "empty list"),
    (dict(json={"type": "string", "format": "not-a-format"}), "not supported by xgrammar"),
])
def test_bad_constraints_are_refused_with_the_compilers_message(params, message):
    with pytest.raises(ValueError, match=message) as info:
        SamplingParams(structured_outputs=StructuredOutputsParams(**params)).verify(VOCAB_SIZE)
    assert info.value.parameter == "structured_outputs"


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


# -- issue 29: the grammar ends a structured output cleanly; compiles are cancelled ----------
def test_a_terminated_grammar_stops_the_request_even_under_ignore_eos():
    """vLLM 0.27.1 samples on after the grammar accepted EOS (ignore_eos) and then fails the
    request when the grammar refuses the next token; here the grammar's end is the end."""
    s = make_scheduler()
    req = make_request("r", choice="yn")
    req.sampling_params.ignore_eos, req.sampling_params.eos_token_id = True, None
    add(s, req)
    for token in (tok("yes"), EOS):
        so = s.schedule()
        s.get_grammar_bitmask(so)
        outs = s.update_from_output(so, output(so, {"r": [token]}))
    assert finishes(outs) == {"r": FinishReason.STOP}
    assert req.status == RequestStatus.FINISHED_STOPPED and list(req.output_token_ids) == [tok("yes"), EOS]


def test_a_complete_grammar_refusing_a_token_stops_instead_of_failing():
    """min_tokens masks the stop tokens, the only ones a complete grammar allows: the sampler
    then picks a token the grammar refuses. The output is complete: stop, without that token."""
    s = make_scheduler()
    req = make_request("r", choice="yn")
    req.sampling_params.min_tokens = 4
    add(s, req)
    so = s.schedule()
    s.get_grammar_bitmask(so)
    s.update_from_output(so, output(so, {"r": [tok("no")]}))
    so = s.schedule()
    assert allowed(s.get_grammar_bitmask(so).grammar_bitmask[0]) == {EOS}
    outs = s.update_from_output(so, output(so, {"r": [tok("a")]}))     # (what all -inf logits yield)
    [out] = [o for eco in outs.values() for o in eco.outputs]
    assert out.finish_reason == FinishReason.STOP and out.new_token_ids == []
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_a_grammar_that_allows_no_token_fails_its_request_with_the_reason():
    from vllm_anatomy.structured_output import GRAMMAR_ERROR_PREFIX
    s = make_scheduler()
    req = Request("empty", [100, 101], SamplingParams(max_tokens=4, eos_token_id=EOS,
                                                     structured_outputs=StructuredOutputsParams(grammar="root ::= root")))
    s.structured_output_manager.grammar_init(req)
    while not req.structured_output_request.is_grammar_ready:
        time.sleep(0.001)
    s.add_request(req)
    so = s.schedule()
    assert not so.num_scheduled_tokens
    outs = s.update_from_output(so, output(so, {}))
    [out] = [o for eco in outs.values() for o in eco.outputs]
    assert out.finish_reason == FinishReason.ERROR
    assert out.stop_reason.startswith(GRAMMAR_ERROR_PREFIX) and "can match nothing" in out.stop_reason


def test_an_aborted_request_cancels_its_compile():
    import threading
    config = make_config()
    manager = make_manager(config)
    gate, started = threading.Event(), threading.Event()
    compile_grammar = manager.backend.compile_grammar

    def slow_compile(*args):
        started.set()
        gate.wait(30)               # a compile xgrammar cannot interrupt
        return compile_grammar(*args)
    manager.backend.compile_grammar = slow_compile
    s = new_scheduler(config, 100, Scheduler, manager)
    req = make_request("r", choice="yn")
    manager.grammar_init(req)
    s.add_request(req)
    assert started.wait(20)
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    future = req.structured_output_request._grammar
    deadline = time.monotonic() + 20
    while not future.cancelled():
        assert time.monotonic() < deadline, "the abort did not cancel the compile"
        time.sleep(0.01)
    assert manager.executor.num_abandoned == 1      # its thread ends when the C++ call returns
    gate.set()


def test_validation_refuses_constraints_that_can_match_nothing():
    for so in (StructuredOutputsParams(regex=r"[^\s\S]"), StructuredOutputsParams(grammar="root ::= root"),
               StructuredOutputsParams(grammar="root ::= [^\\x00-\\U0010FFFF]")):
        with pytest.raises(ValueError, match="can match no output") as info:
            SamplingParams(structured_outputs=so).verify(VOCAB_SIZE)
        assert info.value.parameter == "structured_outputs"
    with pytest.raises(ValueError, match="min_tokens=4 can never be reached") as info:
        SamplingParams(min_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes"])).verify(VOCAB_SIZE)
    assert info.value.parameter == "min_tokens"
    SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(choice=["yes"])).verify(VOCAB_SIZE)


@pytest.mark.parametrize("so, longest", [
    (StructuredOutputsParams(regex="(yes|no)!?"), 4),
    (StructuredOutputsParams(regex="abc"), 3),
    (StructuredOutputsParams(grammar='root ::= "hi" | "hello"'), 5),
    (StructuredOutputsParams(json={"type": "boolean"}), 5),
    (StructuredOutputsParams(json={"enum": ["a", "bb"]}), 4),        # '"bb"'
    (StructuredOutputsParams(regex="\u00e9{2}"), 4),                 # two 2-byte characters
])
def test_min_tokens_past_a_bounded_constraints_longest_output_is_refused(so, longest):
    """Every token holds at least one byte: an output of n bytes is at most n tokens."""
    with pytest.raises(ValueError, match=f"min_tokens={longest + 1} can never be reached.*{longest} bytes") as info:
        SamplingParams(min_tokens=longest + 1, structured_outputs=so).verify(VOCAB_SIZE)
    assert info.value.parameter == "min_tokens"
    SamplingParams(min_tokens=longest, structured_outputs=so).verify(VOCAB_SIZE)


@pytest.mark.parametrize("so", [
    StructuredOutputsParams(regex="[a-z]+"),                          # unbounded
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(regex="[a-z]{0,5}"),    # bounded (5 bytes), but a tree too wide to walk: admitted
])
def test_min_tokens_is_admitted_when_the_walk_cannot_prove_it_unreachable(so):
    SamplingParams(min_tokens=8, structured_outputs=so).verify(VOCAB_SIZE)


def test_a_compile_past_its_budget_fails_its_request_with_the_reason():
    import threading
    from vllm_anatomy.structured_output import GRAMMAR_ERROR_PREFIX
    config = make_config()
    manager = make_manager(config)
    manager.compile_timeout_s = 0.1
    done = threading.Event()

    def burning_compile(*args):             # CPU time, as xgrammar's C++ spends it
        while not done.is_set():
            sum(range(1000))
    manager.backend.compile_grammar = burning_compile
    s = new_scheduler(config, 100, Scheduler, manager)
    req = make_request("r", choice="yn")
    manager.grammar_init(req)
    s.add_request(req)
    deadline = time.monotonic() + 300     # (a low-priority thread on a loaded machine: 0.1 s of CPU may take long)
    while not req.structured_output_request.is_grammar_ready:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    so = s.schedule()
    outs = s.update_from_output(so, output(so, {}))
    [out] = [o for eco in outs.values() for o in eco.outputs]
    assert out.finish_reason == FinishReason.ERROR
    assert out.stop_reason == f"{GRAMMAR_ERROR_PREFIX}it did not compile within 0.1 s of CPU time"
    # The compile window ended with the budget (the tracer draws it), though the thread runs on.
    assert req.structured_output_request.compile_end is not None and manager.executor.num_abandoned == 1
    done.set()


def test_the_engines_recheck_bounds_the_constraint_but_leaves_compiling_to_the_pool():
    """EngineCore re-checks SamplingParams (validate_params); a constraint is compiled only in
    the frontend's check and in the engine's low-priority pool, never at normal priority there."""
    from vllm_anatomy.engine.input_processor import validate_params
    nothing = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"[^\s\S]"))
    validate_params(nothing, VOCAB_SIZE)                               # EngineCore: no compile
    with pytest.raises(ValueError, match="can match no output"):
        validate_params(nothing, VOCAB_SIZE, check_grammar=True)      # the frontend
    huge = SamplingParams(structured_outputs=StructuredOutputsParams(choice=[str(i) for i in range(5000)]))
    with pytest.raises(ValueError, match="at most 1024"):
        validate_params(huge, VOCAB_SIZE)                              # the bounds, everywhere


def test_the_server_answers_an_engine_side_grammar_failure_with_a_400():
    from vllm_anatomy.entrypoints.openai.serving_engine import OpenAIError, raise_if_error
    from vllm_anatomy.structured_output import GRAMMAR_ERROR_PREFIX
    with pytest.raises(OpenAIError) as info:
        raise_if_error("error", "cmpl-1", f"{GRAMMAR_ERROR_PREFIX}it did not compile within 20 s of CPU time")
    assert info.value.status_code == 400
    assert info.value.response.error.param == "structured_outputs"
    assert "did not compile within 20 s" in info.value.response.error.message
    with pytest.raises(OpenAIError) as info:
        raise_if_error("error", "cmpl-1", None)                 # anything else inside the engine: a 500
    assert info.value.status_code == 500
    raise_if_error("stop", "cmpl-1", "\n\n")


def test_clearing_the_backend_twice_is_safe():
    """EngineCore.shutdown may run twice (LLMEngine.shutdown(), then the LLM's finalizer):
    the second must not raise (it used to: `del self.compiler` on a destroyed backend)."""
    manager = make_manager(make_config())
    manager.clear_backend()
    assert manager.backend is None
    manager.clear_backend()

"""Speculative decoding for structured-output requests, GPU-free: real xgrammar grammars over
the tiny vocabulary of test_structured_output.py, fabricated worker outputs (no model).

What is pinned (v0.27.1's rules):
  * Scheduler.update_draft_token_ids cuts a structured request's drafts at the
    first one its grammar refuses (grammar.validate_tokens), and the grammar
    does not move;
  * get_grammar_bitmask gives each structured request 1 + its scheduled drafts
    rows (each draft position, then the bonus token), in scheduling order, row i
    what the grammar allows after the first i drafts; afterwards the grammar is
    where it was before (rolled back);
  * async scheduling: update_draft_token_ids_in_output replaces refused drafts
    by -1 (num_invalid_spec_tokens), the rows from the first -1 on allow
    everything, and the spec-decode stats do not count the refused drafts;
    EngineCore checks a step's drafts against the grammar once;
  * apply_grammar_bitmask puts a request's rows on its logits rows: its draft
    positions and its bonus, after the earlier requests' drafts.

Run: PYTHONPATH=. python -m pytest tests/unit/test_structured_output_spec_decode.py
"""
from __future__ import annotations

import types

import numpy as np
import torch

from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm_anatomy.core.outputs import DraftTokenIds
from vllm_anatomy.core.request import Request
from vllm_anatomy.core.sched.async_scheduler import AsyncScheduler
from vllm_anatomy.core.sched.output import GrammarOutput
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.engine.protocol import EngineCoreOutputs, FinishReason
from vllm_anatomy.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_anatomy.structured_output.backend_xgrammar import XgrammarGrammar
from vllm_anatomy.structured_output.utils import apply_grammar_bitmask
from tests.unit.core_utils import new_scheduler
from tests.unit.test_structured_output import (EOS, VOCAB_SIZE, add, allowed, finishes, make_manager, output,
                                               so_request, tok)

K = 3
ALL = set(range(VOCAB_SIZE))


def make_scheduler(async_scheduling: bool = False) -> Scheduler:
    spec = SpeculativeConfig(num_speculative_tokens=K, method="draft_model", model="fake-draft") \
        if async_scheduling else SpeculativeConfig(num_speculative_tokens=K, method="ngram", model="ngram")
    config = VllmConfig(ModelConfig(model="fake", max_model_len=64), CacheConfig(block_size=16),
                        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                                        async_scheduling=async_scheduling),
                        speculative_config=spec)
    return new_scheduler(config, 100, AsyncScheduler if async_scheduling else Scheduler, make_manager(config))


def make_request(req_id: str, regex: str | None = None) -> Request:
    so = StructuredOutputsParams(regex=regex) if regex else None
    return Request(req_id, [100, 101, 102, 103], SamplingParams(max_tokens=8, structured_outputs=so, eos_token_id=EOS))


def grammar_state(s: Scheduler, req_id: str) -> tuple[set[int], int, bool]:
    """What the request's grammar allows next, how many tokens it has taken, whether it ended."""
    grammar = so_request(s.requests[req_id]).grammar
    assert isinstance(grammar, XgrammarGrammar), grammar        # compiled, not failed
    mask = torch.zeros((1, 1), dtype=torch.int32)
    grammar.fill_bitmask(mask, 0)
    return allowed(mask.numpy()[0]), grammar.num_processed_tokens, grammar.is_terminated()


def prefill(s: Scheduler, first_tokens: dict[str, int]) -> None:
    so = s.schedule()
    s.update_from_output(so, output(so, {r: [t] for r, t in first_tokens.items()}))


def test_drafts_are_cut_at_the_first_one_the_grammar_refuses():
    s = make_scheduler()
    for req in (make_request("plain"), make_request("s", regex="ab12"), make_request("t", regex="[ab]+")):
        add(s, req)
    prefill(s, {"plain": 5, "s": tok("a"), "t": tok("b")})
    before = grammar_state(s, "s")
    s.update_draft_token_ids(DraftTokenIds(
        ["plain", "s", "t"], [[5, 6, 7], [tok("b"), tok("1"), tok("x")], [tok("1"), tok("a"), tok("b")]]))
    assert s.requests["plain"].spec_token_ids == [5, 6, 7]          # no grammar: untouched
    assert s.requests["s"].spec_token_ids == [tok("b"), tok("1")]    # "x" breaks "ab12"
    assert s.requests["t"].spec_token_ids == []                      # "1" is no [ab]: none left
    assert grammar_state(s, "s") == before                           # validate_tokens does not move it


def test_bitmask_has_a_row_per_draft_and_the_bonus_then_rolls_the_grammar_back():
    s = make_scheduler()
    for req in (make_request("s", regex="ab12"), make_request("plain"), make_request("t", regex="[ab]1")):
        add(s, req)
    prefill(s, {"s": tok("a"), "plain": 5, "t": tok("a")})
    s.update_draft_token_ids(DraftTokenIds(["s", "plain", "t"], [[tok("b"), tok("1"), tok("x")], [5, 6, 7],
                                                                  [tok("1"), EOS, tok("a")]]))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"s": [tok("b"), tok("1")], "plain": [5, 6, 7], "t": [tok("1"), EOS]}
    before = {r: grammar_state(s, r) for r in ("s", "t")}
    go = s.get_grammar_bitmask(so)
    assert go.structured_output_request_ids == ["s", "t"]
    rows = [allowed(row) for row in go.grammar_bitmask]
    # s: 2 drafts + bonus; t: 2 drafts (the last one its end) + bonus, after s's rows.
    assert rows == [{tok("b")}, {tok("1")}, {tok("2")},
                    {tok("1")}, {EOS}, ALL]          # a terminated grammar constrains nothing
    assert {r: grammar_state(s, r) for r in ("s", "t")} == before   # rolled back over the drafts
    # The verify step: s accepts both drafts and samples the bonus "2"; t accepts "1", EOS.
    outs = s.update_from_output(so, output(so, {"s": [tok("b"), tok("1"), tok("2")], "plain": [5, 9],
                                                "t": [tok("1"), EOS]}))
    assert list(s.requests["s"].output_token_ids) == [tok(c) for c in "ab12"]
    assert finishes(outs)["t"] == FinishReason.STOP and FinishReason.ERROR not in finishes(outs).values()
    assert grammar_state(s, "s")[0] == {EOS}


def test_async_refused_drafts_become_minus_one_and_are_not_counted():
    s = make_scheduler(async_scheduling=True)
    add(s, make_request("s", regex="ab12"))
    so1 = s.schedule()                                  # the prompt
    so2 = s.schedule()                                  # its first decode, with K -1 placeholder drafts
    assert so2.scheduled_spec_decode_tokens == {"s": [-1] * K} and so2.pending_structured_output_tokens
    s.update_from_output(so1, output(so1, {"s": [tok("a")]}))
    # EngineCore: the drafts proposed on the device after step 1, checked before step 2's bitmask.
    s.update_draft_token_ids_in_output(DraftTokenIds(["s"], [[tok("b"), tok("x"), tok("2")]]), so2)
    assert so2.scheduled_spec_decode_tokens == {"s": [tok("b"), -1, -1]}
    assert so2.num_invalid_spec_tokens == {"s": 2}
    before = grammar_state(s, "s")
    go = s.get_grammar_bitmask(so2)
    assert [allowed(row) for row in go.grammar_bitmask] == [{tok("b")}, {tok("1")}, ALL, ALL]
    assert grammar_state(s, "s") == before
    # The step's output: "b" accepted, the -1 rejected for the recovered "1". (EngineCore does not
    # check its verified drafts again: they are in place already.)
    s.schedule()
    outs = s.update_from_output(so2, output(so2, {"s": [tok("b"), tok("1")]}))
    stats = [eco.scheduler_stats for eco in outs.values() if eco.scheduler_stats is not None][0].spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 1, 1)
    assert list(s.requests["s"].output_token_ids) == [tok("a"), tok("b"), tok("1")]


def test_apply_grammar_bitmask_puts_each_requests_rows_on_its_draft_and_bonus_logits():
    """Batch [a (2 drafts), plain (1 draft), b (no draft)]: logits rows a0 a1 a2 | p0 p1 | b0;
    the scheduler's rows come as b, a."""
    logits = torch.zeros(6, VOCAB_SIZE)
    bitmask = np.zeros((4, 1), dtype=np.int32)
    bitmask[0, 0] = 1 << 5                                   # b
    bitmask[1, 0], bitmask[2, 0], bitmask[3, 0] = 1 << 1, 1 << 2, 1 << 3   # a's draft positions and bonus
    batch = types.SimpleNamespace(req_ids=["a", "plain", "b"], req_id_to_index={"a": 0, "plain": 1, "b": 2})
    so = types.SimpleNamespace(scheduled_spec_decode_tokens={"a": [7, 8], "plain": [9]})
    apply_grammar_bitmask(so, GrammarOutput(["b", "a"], bitmask), batch, logits)
    finite = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert finite == [{1}, {2}, {3}, ALL, ALL, {5}]


# -- EngineCore under async scheduling: each step's drafts checked against the grammar once ----------
class FabricatedExecutor:
    """Stands in for the workers of an async draft-model engine (no model): every request proposes
    the drafts DRAFTS[req_id] after every step; a verify step samples what OUTPUT[req_id] says
    (its drafts up to the first refused one, then the recovered token), and reports the drafts it
    verified; a step without drafts samples OUTPUT[req_id][:1]."""

    DRAFTS = {"s": [tok("a"), tok("x"), tok("b")], "plain": [5, 6, 7]}
    OUTPUT = {"s": [tok("a"), tok("b")], "plain": [5, 6, 7, 8]}

    def __init__(self, vllm_config, recorder=None) -> None:
        self.launched: list = []            # scheduler outputs launched, not yet sampled (FIFO)
        self.last_req_ids: list[str] = []

    def determine_num_available_blocks(self) -> int:
        return 100

    def initialize_from_config(self, num_gpu_blocks: int) -> None:
        pass

    def execute_model(self, scheduler_output, non_block: bool = False):
        from concurrent.futures import Future

        from vllm_anatomy.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT
        future: Future = Future()
        if not scheduler_output.total_num_scheduled_tokens:
            future.set_result(EMPTY_MODEL_RUNNER_OUTPUT)       # nothing to sample
            return future
        self.launched.append(scheduler_output)
        future.set_result(None)             # (sample_tokens next)
        return future

    def sample_tokens(self, grammar_output, non_block: bool = False):
        from concurrent.futures import Future

        from vllm_anatomy.core.outputs import ModelRunnerOutput
        so = self.launched.pop(0)
        req_ids = list(so.num_scheduled_tokens)
        num_drafts = [len(so.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids]
        sampled = [self.OUTPUT[r] if n else self.OUTPUT[r][:1] for r, n in zip(req_ids, num_drafts)]
        self.last_req_ids = req_ids
        future: Future = Future()
        future.set_result(ModelRunnerOutput(
            req_ids, {r: i for i, r in enumerate(req_ids)}, sampled,
            verified_draft_token_ids=[self.DRAFTS[r][:n] for r, n in zip(req_ids, num_drafts)]))
        return future

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return DraftTokenIds(list(self.last_req_ids), [list(self.DRAFTS[r]) for r in self.last_req_ids])

    def shutdown(self) -> None:
        pass


def test_async_engine_checks_a_structured_requests_drafts_once_per_step(monkeypatch):
    """v0.27.1's EngineCore.step_with_batch_queue checks a deferred structured step's drafts
    (update_draft_token_ids_in_output, before its bitmask) and never again; ours once too,
    though it also writes the verified drafts of undeferred steps for the records."""
    from vllm_anatomy.engine.core import EngineCore
    from vllm_anatomy.structured_output.backend_xgrammar import XgrammarGrammar
    spec = SpeculativeConfig(num_speculative_tokens=K, method="draft_model", model="fake-draft")
    config = VllmConfig(ModelConfig(model="fake", max_model_len=64), CacheConfig(block_size=16),
                        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                                        async_scheduling=True),
                        speculative_config=spec)
    validated: list[list[int]] = []
    validate = XgrammarGrammar.validate_tokens
    monkeypatch.setattr(XgrammarGrammar, "validate_tokens",
                        lambda self, tokens: validated.append(list(tokens)) or validate(self, tokens))
    engine = EngineCore(config, executor_class=FabricatedExecutor)
    try:
        manager = make_manager(config)
        engine.structured_output_manager = engine.scheduler.structured_output_manager = manager
        add(engine.scheduler, make_request("s", regex="[ab]+"))
        add(engine.scheduler, make_request("plain"))
        verified: list[tuple[list[int], dict | None]] = []     # ("s"'s drafts, num_invalid) per step
        update = engine.scheduler.update_from_output

        def spy(scheduler_output, model_output):
            if "s" in scheduler_output.scheduled_spec_decode_tokens:
                verified.append((list(scheduler_output.scheduled_spec_decode_tokens["s"]),
                                 scheduler_output.num_invalid_spec_tokens))
            return update(scheduler_output, model_output)
        engine.scheduler.update_from_output = spy
        outs = []
        for _ in range(30):
            if not engine.has_work():
                break
            outs.append(engine.step_fn()[0])
        assert not engine.has_work()
    finally:
        engine.shutdown()
    tokens = {o.request_id: [] for eco in outs for o in eco.get(0, EngineCoreOutputs()).outputs}
    for eco in outs:
        for o in eco.get(0, EngineCoreOutputs()).outputs:
            tokens[o.request_id] += o.new_token_ids
            assert o.finish_reason != FinishReason.ERROR
    assert tokens["s"] == [tok("a")] + [tok("a"), tok("b")] * 3 + [tok("a")]     # max_tokens 8
    # Every verify step of "s": its drafts cut at "x" (-1s after), counted as invalid ...
    assert len(verified) >= 3
    assert all(v == ([tok("a"), -1, -1], {"s": 2}) for v in verified), verified
    # ... and checked against its grammar once per step (the plain request has no grammar).
    assert validated == [FabricatedExecutor.DRAFTS["s"]] * len(verified)

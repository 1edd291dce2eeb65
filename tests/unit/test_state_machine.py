"""The request state machine as declared (vllm_anatomy/core/state_machine.py) against
the real scheduler, GPU-free: scenarios with fabricated outputs drive every status
change this engine can make, a watcher records each request's status after every
schedule() and update_from_output(), and

  * every change observed is declared (declared_moves()), and
  * every transition declared as used is observed in some scenario,

so the diagram the dashboard draws from these definitions is the engine's own.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

from tests.unit.core_utils import new_scheduler
from tests.unit.test_async_scheduler import Pipeline
from tests.unit.test_async_scheduler import create_request as create_async_request
from tests.unit.test_async_scheduler import create_scheduler as create_async_scheduler
from tests.unit.test_scheduler import create_request, create_scheduler, make_output
from tests.unit.test_structured_output import make_config, make_manager
from tests.unit.test_structured_output import make_request as make_structured_request
from tests.unit.test_structured_output import make_scheduler as make_structured_scheduler
from tests.unit.test_structured_output import backend_of, output, so_request, tok
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.core.state_machine import (ARRIVAL, ARTICLE_PATHS, FINISH_REASONS, NEVER_FROM_A_QUEUE,
                                             PATH_ONLY_EDGES, STATUS_DESCRIPTIONS, STATUS_TRANSITIONS,
                                             UNUSED_STATUSES, article_edges, declared_moves, finished_status_of)


class Watcher:
    """Every request's status after each scheduler call; the changes seen."""

    def __init__(self, scheduler) -> None:
        self.s = scheduler
        self.last: dict[str, str] = {}                       # request id -> its status's name
        self.moves: set[tuple[str, str]] = set()             # (from, to) status names
        self.known: dict[str, Request] = {}
        self._scheduled: set[str] = set()    # RUNNING requests the last schedule() gave tokens

    def add(self, request) -> None:
        self.known[request.request_id] = request
        self.s.add_request(request)
        self.look()

    def look(self) -> None:
        for req_id, req in self.known.items():
            now = req.status.name
            was = self.last.get(req_id, ARRIVAL)
            if now != was:
                self.moves.add((was, now))
            elif now == "RUNNING" and req_id in self._scheduled:
                self.moves.add(("RUNNING", "RUNNING"))
            self.last[req_id] = now
        self._scheduled = set()

    def step(self, tokens=None, default=7):
        so = self.s.schedule()
        self._scheduled = {r for r in so.num_scheduled_tokens if self.last.get(r) == "RUNNING"}
        self.look()
        outs = self.s.update_from_output(so, make_output(self.s, so, tokens, default))
        self.look()
        return so, outs


def sync_scenarios() -> set:
    moves = set()
    # Preemption and resumption, finishes by length and by EOS.
    s = create_scheduler(block_size=4, num_blocks=5, max_model_len=16)
    w = Watcher(s)
    w.add(create_request("a", [1, 2, 3, 4, 5, 6, 7], block_size=4, max_tokens=6))
    w.add(create_request("b", [11, 12, 13, 14, 15, 16, 17], block_size=4, max_tokens=6, eos_token_id=2))
    for i in range(30):
        if not s.has_requests():
            break
        w.step(tokens={"b": [2]} if i > 8 else None)
    assert not s.has_requests()
    moves |= w.moves
    # Aborts: running, waiting, preempted; an over-long prompt; an error while running.
    s = create_scheduler(block_size=4, num_blocks=5, max_model_len=16, max_num_seqs=2)
    w = Watcher(s)
    for name in "abc":
        w.add(create_request(name, [1, 2, 3, 4, 5, 6, 7], block_size=4, max_tokens=8))
    w.add(create_request("long", list(range(20)), block_size=4))
    w.step()
    w.step()
    w.step()                                              # a needs a third block: b preempted
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    s.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)      # preempted, waiting
    w.look()
    s.finish_requests("a", RequestStatus.FINISHED_ERROR)  # as EngineCore._finish_error_requests does
    w.look()
    w.add(create_request("d", [1, 2, 3], block_size=4, max_tokens=8))
    w.step()
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    w.look()
    return moves | w.moves


def structured_scenarios() -> set:
    s = make_structured_scheduler()
    w = Watcher(s)
    slow = make_structured_request("slow", choice="yn")
    pending: Future = Future()
    so_request(slow).grammar = pending
    w.add(slow)
    bad = make_structured_request("bad", choice="yn")
    failed: Future = Future()
    failed.set_exception(RuntimeError("cannot compile"))
    so_request(bad).grammar = failed
    w.add(bad)
    gone = make_structured_request("gone", choice="yn")
    so_request(gone).grammar = Future()
    w.add(gone)
    so = s.schedule()
    w.look()
    s.update_from_output(so, output(so, {}))
    w.look()
    s.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    w.look()
    pending.set_result(backend_of(s).compile_grammar(*so_request(slow).structured_output_key))
    so = s.schedule()                                     # promoted, then scheduled
    w.look()
    s.update_from_output(so, output(so, {"slow": [tok("x")]}))   # the grammar refuses it
    w.look()
    assert slow.status == RequestStatus.FINISHED_ERROR
    moves = w.moves
    # Promoted, but no room for it in the KV cache: WAITING for now.
    config = make_config()
    config.cache_config.enable_prefix_caching = False    # the test prompts share their first tokens
    s = new_scheduler(config, 6, Scheduler, make_manager(config))   # 5 usable
    w = Watcher(s)
    w.add(make_structured_request("p1", prompt_len=30))
    w.add(make_structured_request("p2", prompt_len=30))
    w.step()                                              # 4 of the 5 blocks held
    late = make_structured_request("late", prompt_len=20, choice="yn")
    grammar: Future = Future()
    grammar.set_result(backend_of(s).compile_grammar(*so_request(late).structured_output_key))
    so_request(late).grammar = grammar
    w.add(late)
    w.step()
    assert late.status == RequestStatus.WAITING
    assert s.last_step_record is not None and s.last_step_record.admission_stop_reason == "no_free_blocks"
    return moves | w.moves


def stale_token_scenarios() -> set:
    """Async scheduling: a token sampled before the preemption finishes the request after it."""
    moves = set()
    for kw, token in (({"max_tokens": 2}, 5), ({"max_tokens": 8, "eos_token_id": 2}, 2)):
        s = create_async_scheduler(block_size=4, num_blocks=5, max_model_len=16)
        a = create_async_request("a", [1, 2, 3, 4, 5, 6, 7], block_size=4, max_tokens=4)
        b = create_async_request("b", [11, 12, 13, 14, 15, 16, 17], block_size=4, **kw)
        w = Watcher(s)
        w.add(a)
        w.add(b)
        p = Pipeline(s, token_for=lambda req_id, step_id, t=token: t if (req_id, step_id) == ("b", 2) else 50)
        p.launch()
        w.look()
        p.launch()
        w.look()
        p.finish()
        w.look()
        s.running.remove(b)
        s._preempt_request(b, time.monotonic())                             # as a smaller pool would
        w.look()
        p.finish()                                        # the stale token ends b
        w.look()
        moves |= w.moves
    return moves


def test_every_observed_status_change_is_declared_and_every_used_one_happens():
    observed = sync_scenarios() | structured_scenarios() | stale_token_scenarios()
    declared = declared_moves()
    assert observed <= declared, f"status changes the state machine does not declare: {observed - declared}"
    assert declared <= observed, f"declared as used but never seen: {declared - observed}"
    # A request that left a queue finished with the status its finish reason names.
    left_a_queue = {now for was, now in observed if was != ARRIVAL and RequestStatus.is_finished(RequestStatus[now])}
    assert {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED", "FINISHED_ERROR"} <= left_a_queue
    for status in left_a_queue:
        assert finished_status_of(FINISH_REASONS[status]) == status


def test_the_declarations_cover_every_status_and_are_consistent():
    names = {s.name for s in RequestStatus}
    drawn = {t.source for t in STATUS_TRANSITIONS} | {t.target for t in STATUS_TRANSITIONS}
    assert drawn == names | {ARRIVAL}, "every RequestStatus is drawn (and nothing else)"
    assert set(UNUSED_STATUSES) <= names
    for t in STATUS_TRANSITIONS:       # an edge touching an unused status is never taken here
        assert t.used == (t.source not in UNUSED_STATUSES and t.target not in UNUSED_STATUSES), t
    edges = {(t.source, t.target) for t in STATUS_TRANSITIONS}
    for move, path in ARTICLE_PATHS.items():
        assert (path[0], path[-1]) == move and set(zip(path, path[1:])) <= edges
        assert article_edges(move) == list(zip(path, path[1:]))
    assert PATH_ONLY_EDGES <= edges
    article = {(t.source, t.target) for t in STATUS_TRANSITIONS if t.in_article}
    # The article's diagram, edge for edge (§四.1).
    assert (RequestStatus.PREEMPTED.name, RequestStatus.WAITING.name) in article
    assert len(article) == 16


def test_finish_reasons_and_descriptions_cover_every_status():
    names = {s.name for s in RequestStatus}
    assert set(STATUS_DESCRIPTIONS) == names
    assert set(FINISH_REASONS) == {s.name for s in RequestStatus if RequestStatus.is_finished(s)}
    assert FINISH_REASONS["FINISHED_IGNORED"] == FINISH_REASONS["FINISHED_LENGTH_CAPPED"] == "length"
    # Not invertible in general, but a queued request never ends FINISHED_IGNORED.
    assert finished_status_of("length") == "FINISHED_LENGTH_CAPPED"
    assert {finished_status_of(reason) for reason in FINISH_REASONS.values()} == \
        set(FINISH_REASONS) - NEVER_FROM_A_QUEUE

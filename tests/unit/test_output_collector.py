"""RequestOutputCollector (the per-request mailbox of AsyncLLM) and IterationStats."""
import asyncio

import pytest

from vllm_anatomy.engine.output_processor import RequestOutputCollector
from vllm_anatomy.engine.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput
from vllm_anatomy.metrics.stats import IterationStats, RequestStateStats
from vllm_anatomy.outputs import CompletionOutput, RequestOutput
from vllm_anatomy.sampling_params import RequestOutputKind


def make_output(text, token_ids, finished=False, finish_reason=None):
    return RequestOutput("r", None, [1], None, [CompletionOutput(0, text, list(token_ids),
                                                          finish_reason=finish_reason)], finished)


def test_delta_outputs_are_merged_while_the_consumer_is_behind():
    q = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    q.put(make_output("Hel", [1]))
    q.put(make_output("lo", [2, 3]))
    q.put(make_output("!", [4], finished=True, finish_reason="stop"))
    out = q.get_nowait()
    assert out.outputs[0].text == "Hello!"
    assert out.outputs[0].token_ids == [1, 2, 3, 4]
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert q.get_nowait() is None


def test_cumulative_outputs_replace_each_other():
    q = RequestOutputCollector(RequestOutputKind.CUMULATIVE, "r")
    q.put(make_output("Hel", [1]))
    q.put(make_output("Hello", [1, 2]))
    out = q.get_nowait()
    assert out.outputs[0].text == "Hello" and out.outputs[0].token_ids == [1, 2]


def test_an_exception_replaces_the_slot_and_wins():
    q = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    q.put(make_output("a", [1]))
    q.put(RuntimeError("engine died"))
    q.put(make_output("b", [2]))
    with pytest.raises(RuntimeError, match="engine died"):
        q.get_nowait()
    assert q.get_nowait() is None


def test_get_waits_for_put_and_producer_never_blocks():
    async def main():
        q = RequestOutputCollector(RequestOutputKind.DELTA, "r")
        consumer = asyncio.create_task(q.get())
        await asyncio.sleep(0.01)
        assert not consumer.done()          # nothing yet: the consumer waits
        q.put(make_output("x", [7]))         # a plain call: the producer cannot block
        out = await asyncio.wait_for(consumer, 1.0)
        assert out.outputs[0].text == "x"
        # Many puts with nobody reading still leave exactly one pending output.
        for i in range(100):
            q.put(make_output(str(i % 10), [i]))
        out = await q.get()
        assert len(out.outputs[0].token_ids) == 100
    asyncio.run(main())


def test_iteration_stats_ttft_itl_and_finished_request():
    req_stats = RequestStateStats(arrival_time=100.0)
    first = IterationStats(iteration_timestamp=100.5)
    events = [EngineCoreEvent(EngineCoreEventType.QUEUED, 10.0),
              EngineCoreEvent(EngineCoreEventType.SCHEDULED, 10.1)]
    first.update_from_output(EngineCoreOutput("r", [5], events=events), 10.3, True, 7, req_stats)
    assert first.num_prompt_tokens == 7 and first.num_generation_tokens == 1
    assert first.time_to_first_tokens_iter == [pytest.approx(0.5)]
    assert first.inter_token_latencies_iter == []

    second = IterationStats(iteration_timestamp=101.0)
    preempted = [EngineCoreEvent(EngineCoreEventType.PREEMPTED, 10.35),
                 EngineCoreEvent(EngineCoreEventType.SCHEDULED, 10.4)]
    second.update_from_output(EngineCoreOutput("r", [6], events=preempted), 10.5, False, 7, req_stats)
    second.update_from_output(EngineCoreOutput("r", [8]), 10.7, False, 7, req_stats)
    assert second.num_prompt_tokens == 0 and second.num_generation_tokens == 2
    assert second.num_preempted_reqs == 1
    assert second.inter_token_latencies_iter == [pytest.approx(0.2), pytest.approx(0.2)]

    second.update_from_finished_request("length", 7, 3, req_stats, num_cached_tokens=0)
    (fin,) = second.finished_requests
    assert fin.finish_reason == "length" and fin.num_generation_tokens == 3
    assert fin.e2e_latency == pytest.approx(1.0)
    assert fin.queued_time == pytest.approx(0.1)      # first SCHEDULED, not the re-schedule
    assert fin.prefill_time == pytest.approx(0.2)
    assert fin.decode_time == pytest.approx(0.4)
    assert fin.mean_time_per_output_token == pytest.approx(0.2)


def test_finished_before_scheduling_has_zero_intervals():
    stats = IterationStats(iteration_timestamp=5.0)
    stats.update_from_finished_request("abort", 4, 16, RequestStateStats(arrival_time=4.0))
    (fin,) = stats.finished_requests
    assert (fin.queued_time, fin.prefill_time, fin.decode_time) == (0.0, 0.0, 0.0)
    assert fin.e2e_latency == pytest.approx(1.0)

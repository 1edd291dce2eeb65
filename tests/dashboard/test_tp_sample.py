"""The shipped tensor-parallel sample (samples/cpu-smollm2-tp3-full.sqlite, recorded with
`scripts/record_sample_run.py --tp 3` on a CPU: the offline LLM, EngineCore in its
process, three worker processes over gloo) as the dashboard reads it: lanes named by
rank and in rank order, one device lane (rank 0's), hops that name their lanes, replies
from the output rank only, and collectives counted once per rank, not once per rank x 3.
"""
import os
import re

import pytest

from dashboard import processes, spans
from dashboard.answers import q5_accounts
from dashboard.answers.source import RunSource
from dashboard.components.timeline_fig import rows_of
from tests.dashboard.conftest import ROOT

TP_SAMPLE = os.path.join(ROOT, "samples", "cpu-smollm2-tp3-full.sqlite")
NUM_LAYERS = 30                      # SmolLM2-135M
ALL_REDUCES_PER_STEP = 2 * NUM_LAYERS + 1   # o_proj and down_proj of each layer, and the embedding

pytestmark = pytest.mark.skipif(not os.path.exists(TP_SAMPLE), reason="samples/cpu-smollm2-tp3-full.sqlite not shipped")


@pytest.fixture(scope="module")
def src():
    return RunSource(TP_SAMPLE)


def test_the_sample_is_a_three_rank_run(src):
    assert src.tp == 3
    assert sorted(src.ranks.values()) == [0, 1, 2]
    assert set(src.ranks) == src.pids["worker"]
    assert "engine_core" not in src.pids and len(src.pids["frontend"]) == 1


def test_processes_lanes_name_the_in_process_engine_and_the_ranks_in_order(src):
    lay = processes.layout(src)
    labels = [label for _, label in lay["lanes"]]
    assert lay["inproc_engine"] and not lay["single"]
    assert not any("API server" in x for x in labels), labels         # no HTTP server in an offline run
    assert any("LLM process" in x and "EngineCore.step (in-process)" in x for x in labels), labels
    workers = [x for x in labels if x.startswith("WorkerProc")]
    assert [int(re.search(r"rank (\d+)", x)[1]) for x in workers] == [0, 1, 2], workers
    rank0 = next(p for p, r in src.ranks.items() if r == 0)
    assert lay["output_pids"] == {rank0}


def test_a_step_broadcasts_to_every_rank_and_only_rank_0_replies(src):
    step = src.steps[len(src.steps) // 2]
    view = processes.step_view(src, step)
    lanes = dict(view["layout"]["lanes"])
    for h in view["hops"]:                   # every hop's ends are drawn lanes (no raw "busy:pid")
        assert h.src_lane in lanes and h.dst_lane in lanes, h
    down = [h for h in view["hops"] if "rpc_broadcast_mq" in h.boundary]
    up = [h for h in view["hops"] if "worker_response_mq" in h.boundary]
    rank_of_lane = {f"worker:{pid}": r for pid, r in src.ranks.items()}
    for marker in ("⑤", "⑩"):
        assert sorted(rank_of_lane[h.dst_lane] for h in down if h.marker == marker) == [0, 1, 2]
        assert [rank_of_lane[h.src_lane] for h in up if h.marker == marker] == [0]
    # The engine loop's spans are on the LLM process's busy lane, not its frontend lane.
    sched = [s for s in view["spans"] if s["name"] == "Scheduler.schedule"]
    assert sched and all(s["lane"].startswith("busy:") for s in sched)


def test_timeline_lanes_are_ranks_in_order_and_one_device_lane(src):
    df = spans.span_table(TP_SAMPLE, (), "cpu")
    lanes = [lane for lane, _ in rows_of(df.assign(level=df["depth"].map(lambda d: f"depth {d}")))]
    lanes = list(dict.fromkeys(lanes))
    workers = [x for x in lanes if x.startswith("WorkerProc")]
    assert [int(re.search(r"rank (\d+)", x)[1]) for x in workers] == [0, 1, 2], lanes
    assert lanes[-1] == "device"
    rank0 = next(p for p, r in src.ranks.items() if r == 0)
    dev = df[df["lane"] == "device"]
    forwards = df[(df["name"] == "GPUModelRunner._model_forward") & (df["lane"] != "device")]
    assert len(forwards) == 3 * len(dev[dev["name"] == "GPUModelRunner._model_forward"])
    # the device lane is rank 0's host timing of its device work, once per step
    assert set(dev["rank"]) == {0}
    on_rank0 = forwards[forwards["lane"] == f"WorkerProc rank 0 · pid {rank0}"]
    assert sorted(dev.loc[dev["name"] == "GPUModelRunner._model_forward", "start_ns"]) == sorted(on_rank0["start_ns"])


def test_communication_account_counts_each_collective_once(src):
    ans = q5_accounts.answer(src)
    f = ans.facts
    assert f["have_counts"]
    assert f["collectives"]["all_reduce"][0] == ALL_REDUCES_PER_STEP * len(f["steps"]), (f["collectives"], f["steps"])
    assert f["collectives"]["all_gather"][0] == len(f["steps"])      # the logits, once per step
    assert "each joined by all 3 ranks" in next(r["value"] for r in ans.tables["the five accounts"]
                                               if r["account"] == "communication")


def test_memory_account_is_per_rank_like_the_weights(src):
    mem = q5_accounts.answer(src).facts["memory"]
    # a rank holds 1 of the 3 KV heads of every block: 30 layers x K,V x 16 tokens x 64 dims x fp32
    per_rank_block = 30 * 2 * 16 * 1 * 64 * 4
    assert mem["per rank"]
    assert mem["KV MB"] == pytest.approx(mem["peak KV blocks"] * per_rank_block / 2 ** 20)
    assert mem["weights MB"] == pytest.approx(134_515_008 * 4 / 3 / 2 ** 20, rel=1e-6)


def test_run_header_says_the_kv_blocks_are_over_the_ranks(src):
    from dashboard.components.run_header import header_fields
    fields = {k: v for k, v, _ in header_fields(src.meta, os.path.basename(TP_SAMPLE), src.mr(src.steps[0]))}
    assert fields["TP"] == "3"
    assert re.fullmatch(r"24 \(\d+\.\d+ MB over 3 ranks\)", fields["KV blocks"]), fields["KV blocks"]


def test_the_tensor_parallel_lesson_card_finds_only_tp_runs():
    import pandas as pd

    from dashboard.lessons import BY_KEY, Facts
    df = pd.DataFrame({"step": [1, 2, 3], "tokens": [5, 40, 1]})
    assert BY_KEY["tp"].find(Facts(df, tp=3)) == (2, None)      # the busiest step: the most all-reduce bytes
    assert BY_KEY["tp"].find(Facts(df)) == (None, None)

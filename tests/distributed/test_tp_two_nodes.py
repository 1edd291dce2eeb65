"""Two "nodes" on one machine: node 0 (the engine and rank 0) and a headless node 1 (rank 1).

They are two separate process trees that meet only over 127.0.0.1: the ranks'
gloo world at master_addr:master_port, the rpc queue's remote reader and
rank 1's reply queue over TCP. TP=2 across them generates what TP=1 does; the
run store lists both ranks; when the engine shuts down, node 1 exits 0 and
leaves nothing running.
"""
import json
import os
import sqlite3
import subprocess
import sys
import time

import psutil
import pytest
import torch

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.utils.network_utils import get_open_port

PROMPTS = ["t5 t6 t7 t8 t9", " ".join(f"t{i}" for i in range(300, 330))]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE_ARGS = dict(num_gpu_blocks_override=64, max_model_len=256, max_num_batched_tokens=16)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _headless(model: str, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_anatomy.entrypoints.cli.main", "serve", "--headless", "--model", model,
         "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--num-gpu-blocks-override", "64", "--max-model-len", "256",
         "--max-num-batched-tokens", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_nodes_over_loopback(tiny_tp_models, tmp_path):
    model = tiny_tp_models["qwen3"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = LLM(model=model, **ENGINE_ARGS)
        expected = _tokens(reference)
        reference.llm_engine.shutdown()
    finally:
        torch.set_num_threads(threads)

    port = get_open_port()
    node1 = _headless(model, port)
    try:
        llm = LLM(model=model, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                  master_port=port, trace_level="spans", trace_dir=str(tmp_path), **ENGINE_ARGS)
        node1_tree = [node1.pid] + [p.pid for p in psutil.Process(node1.pid).children(recursive=True)]
        executor = llm.llm_engine.engine_core.model_executor
        try:
            assert len(executor.workers) == 1 and len(executor.response_mqs) == 2   # one local rank, two replies
            assert _tokens(llm) == expected
            assert executor.collective_rpc("determine_num_available_blocks") == [64, 64]
            ranks = executor.rank_info
        finally:
            llm.llm_engine.shutdown()
        out, _ = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
    assert node1.returncode == 0, out
    assert "headless node 1 of 2: ranks 1..1 of 2, meeting at 127.0.0.1" in out
    # Rank 1 is node 1's worker process (its pid came over the world group).
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[1]["pid"] in node1_tree[1:]
    time.sleep(0.5)
    assert not [pid for pid in node1_tree if psutil.pid_exists(pid) and
                psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    (store,) = tmp_path.glob("run-*.sqlite")
    meta = dict(sqlite3.connect(store).execute("SELECT key, value FROM meta").fetchall())
    assert json.loads(meta["tensor_parallel_size"]) == 2
    assert [r["pid"] for r in json.loads(meta["ranks"])] == [r["pid"] for r in ranks]


def test_a_dead_rank_on_node_1_fails_the_engine(tiny_tp_models):
    model = tiny_tp_models["qwen3"]
    port = get_open_port()
    node1 = _headless(model, port)
    try:
        llm = LLM(model=model, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port,
                  **ENGINE_ARGS)
        try:
            rank1 = llm.llm_engine.engine_core.model_executor.rank_info[1]["pid"]
            os.kill(rank1, 9)
            t0 = time.monotonic()
            # NOTE: node 0's monitor sees only its own processes; rank 0 learns it
            # in the next all-reduce, whose gloo connection to rank 1 is gone.
            with pytest.raises(RuntimeError, match=r"Worker \(rank 0\) failed in execute_model(.|\n)*peer"):
                _tokens(llm)
            assert time.monotonic() - t0 < 30
        finally:
            llm.llm_engine.shutdown()
        out, _ = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
    assert node1.returncode == 1, out

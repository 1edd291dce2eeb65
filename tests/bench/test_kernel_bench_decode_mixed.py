"""bench/kernel_bench.py --decode-mixed (GPU-free parts): the throughput workload's decode
batches, their engine-like block allocation and batch order; and the mode's JSON/table
against a fabricated result."""
from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import imported_from

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
BENCH_MODULES = ("kernel_bench", "vs_vllm", "side_by_side", "throughput")


@pytest.fixture(scope="module")
def kb():
    """bench/kernel_bench.py as a module, bench/ on sys.path only while this file's tests run."""
    with imported_from(BENCH, BENCH_MODULES):
        import kernel_bench
        yield kernel_bench


@pytest.mark.fast
def test_steps_blocks_and_rows_as_the_engine(kb):
    """Four sequences, blocks of 4: at step s the ones with more than s + 1 outputs run at
    prompt + s + 1 keys; blocks are handed out per prompt, then interleaved across rows at
    decode boundaries; a finished row's hole takes the last row (InputBatch.condense)."""
    prompts, outputs = [3, 5, 4, 8], [10, 3, 10, 10]
    cases, num_blocks = kb.decode_mixed_steps(prompts, outputs, steps=(0, 2, 5), block_size=4)
    assert [c["step"] for c in cases] == [0, 2, 5]
    assert cases[0]["seqs"] == [0, 1, 2, 3] and cases[0]["seq_lens"] == [4, 6, 5, 9]
    # Request 1 (3 outputs) leaves after step 1: the last row (request 3) moves into its hole.
    assert cases[1]["seqs"] == [0, 3, 2] and cases[1]["seq_lens"] == [6, 11, 7]
    assert cases[2]["seq_lens"] == [9, 14, 10]
    # Prompts: [0], [1, 2], [3], [4, 5]; then decodes take the next block in row order when
    # they cross a boundary: step 0 requests 2, 3 (6, 7), step 1 request 0 (8), step 4
    # requests 3, 2 (9, 10: rows 1, 2 after the condense), step 5 request 0 (11).
    assert cases[0]["block_ids"] == [[0], [1, 2], [3, 6], [4, 5, 7]]
    assert cases[2]["block_ids"] == [[0, 8, 11], [4, 5, 7, 9], [3, 6, 10]]
    assert num_blocks == 12
    for c in cases:                                   # every row's blocks cover its keys, none shared
        flat = [b for row in c["block_ids"] for b in row]
        assert len(flat) == len(set(flat))
        assert all(len(row) == -(-n // 4) for row, n in zip(c["block_ids"], c["seq_lens"]))


@pytest.mark.fast
def test_nano_vllm_batches(kb):
    """The workload's batches at steps 0, 200, .., 800 (the sizes the docstring states)."""
    from vs_vllm import nano_vllm_workload
    prompts, outputs = nano_vllm_workload()
    cases, _ = kb.decode_mixed_steps([len(p) for p in prompts], outputs)
    assert [len(c["seqs"]) for c in cases] == [256, 217, 153, 101, 59]
    assert all(min(c["seq_lens"]) >= 100 + c["step"] for c in cases)


@pytest.mark.fast
def test_table_prints_every_case(kb, capsys):
    def variant(ms):
        return {"ms": ms, "bytes_per_s": 1e12, "fraction": 0.9 / ms}
    cases = [{"step": s, "batch": b, "min_seq_len": 100, "max_seq_len": 2000, "bytes": 1,
              "batch_order": variant(1.0), "batch_order_no_search": variant(0.98), "lpt": variant(0.9),
              "spt": variant(1.1),
              "speedup_lpt": 1 / 0.9, "outputs_equal": True} for s, b in ((0, 256), (800, 59))]
    res = {"cases": cases, "speedup_lpt": 1.111,
           "total": {k: variant(2 * v) for k, v in (("batch_order", 1.0), ("batch_order_no_search", 0.98),
                                                     ("lpt", 0.9), ("spt", 1.1))}}
    kb.print_decode_mixed(res)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[1].split()[:2] == ["0", "256"] and lines[-1].split()[-1] == "1.111"


@pytest.mark.slow
def test_decode_mixed_runs_on_the_interpreter(tmp_path):
    """The whole measurement, in a subprocess with TRITON_INTERPRET=1 (the kernels must be
    interpreted from their import on): a small workload, a stand-in timer; every variant ran
    and computed the same outputs (bitwise)."""
    import json
    import subprocess
    code = (
        "import json, sys; sys.path.insert(0, 'bench'); import kernel_bench as kb; "
        "calls = []; res = kb.decode_mixed(1e12, ([20, 40, 9], [5, 3, 9]), steps=(0, 3), device='cpu', "
        "timer=lambda fn: calls.append(fn()) or 1.0 + 0.01 * len(calls)); "
        "print('RESULT ' + json.dumps(res))")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert [(c["step"], c["batch"]) for c in res["cases"]] == [(0, 3), (3, 2)]
    assert all(c["outputs_equal"] and c["max_abs_diff"] == 0.0 for c in res["cases"])
    assert (res["cases"][1]["min_seq_len"], res["cases"][1]["max_seq_len"]) == (13, 24)   # 9 + 4, 20 + 4
    assert set(res["total"]) == {"batch_order", "batch_order_no_search", "lpt", "spt"}

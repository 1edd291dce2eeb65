"""parallel_state over gloo: two real ranks (processes) on this CPU.

all_reduce sums, all_gather concatenates in rank order along any dim, the
host-byte exchanges deliver, and every collective is counted with its bytes.
The backend choice fails early and clearly (NCCL on a CPU).
"""
import os

import pytest
import torch
import torch.multiprocessing as mp

from vllm_anatomy.distributed import parallel_state as ps
from vllm_anatomy.utils.network_utils import get_distributed_init_method, get_open_port


def _rank_main(rank: int, world_size: int, init_method: str, results) -> None:
    torch.set_num_threads(1)
    ps.init_distributed_environment(world_size, rank, init_method, rank, "gloo")
    ps.initialize_model_parallel(world_size)
    tp = ps.get_tp_group()
    try:
        x = torch.full((2, 3), float(rank + 1))
        summed = tp.all_reduce(x.clone())                                 # [2, 3]
        last = tp.all_gather(torch.arange(2.0).view(1, 2) + 10 * rank)   # [1, 2 * N]
        first = tp.all_gather(torch.full((1, 2), float(rank)), dim=0)     # [N, 2]
        handle = tp.broadcast_bytes(b"handle-of-rank-0" if rank == 0 else None)
        everyone = tp.all_gather_bytes(f"pid {rank}".encode() * (rank + 1))
        counts = tp.tracer.take_step_counts()
        results.put((rank, summed.tolist(), last.tolist(), first.tolist(), handle, everyone, counts,
                     ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()))
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def test_collectives_on_two_gloo_ranks():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=_rank_main, args=(r, 2, init_method, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = sorted(_get(results, procs) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    for rank, summed, last, first, handle, everyone, counts, tp_rank, tp_size in out:
        assert (tp_rank, tp_size) == (rank, 2)
        assert summed == [[3.0] * 3] * 2
        assert last == [[0.0, 1.0, 10.0, 11.0]]
        assert first == [[0.0, 0.0], [1.0, 1.0]]
        assert handle == b"handle-of-rank-0"
        assert everyone == [b"pid 0", b"pid 1pid 1"]
        # host-byte exchanges go over the cpu group and are not model collectives: not counted
        assert counts["vllm_anatomy.num_all_reduce"] == 1 and counts["vllm_anatomy.all_reduce_bytes"] == 6 * 4
        assert counts["vllm_anatomy.num_all_gather"] == 2 and counts["vllm_anatomy.all_gather_bytes"] == 2 * 2 * 4


def _get(results, procs, timeout_s: float = 120.0):
    """The next result; fails at once when a rank died (its peer would wait in a collective)."""
    import queue
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank exited with {dead}"
    raise TimeoutError("no result from the ranks")


def test_no_group_means_one_rank():
    assert not ps.model_parallel_is_initialized()
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (1, 0)


def test_backend_is_resolved_per_device():
    assert ps.resolve_backend(None, "cpu") == "gloo"
    assert ps.resolve_backend("gloo", "cpu") == "gloo"
    with pytest.raises(ValueError, match="'nccl' needs CUDA devices, but this run is on the CPU"):
        ps.resolve_backend("nccl", "cpu")
    with pytest.raises(ValueError, match="'gloo' carries CPU tensors here, but this run is on CUDA"):
        ps.resolve_backend("gloo", "cuda")
    with pytest.raises(ValueError, match="must be one of nccl, gloo"):
        ps.resolve_backend("mpi", "cpu")

"""The process groups of a run: the world, and the tensor-parallel group inside it.

Mirrors vllm/distributed/parallel_state.py (GroupCoordinator,
init_distributed_environment, initialize_model_parallel, get_world_group,
get_tp_group, get_tensor_model_parallel_rank / _world_size,
destroy_model_parallel, destroy_distributed_environment).

Each worker process is one rank. At start-up it calls

    init_distributed_environment(world_size, rank, "tcp://127.0.0.1:29500", local_rank, "gloo")
    initialize_model_parallel(tensor_model_parallel_size=world_size)

and from then on the model's layers reach their group through get_tp_group()
(module-level state, as in vLLM: a layer deep inside the model has no other
way to find it). The collectives are torch.distributed's:

    backend  devices   what carries the bytes
    nccl     CUDA      NVLink / PCIe / InfiniBand, launched on the current stream
    gloo     CPU       TCP sockets between the processes (also over 127.0.0.1)

NOTE: with tensor_parallel_size = 1 nothing here is initialized: the engine
runs its one worker in-process without torch.distributed, and
get_tensor_model_parallel_world_size() answers 1 (vLLM initializes a
one-process group even then; we keep the single-process path free of it).

Simplified: no pipeline / data / expert / context parallel groups, no custom
all-reduce or pynccl communicator (torch.distributed's NCCL collectives are
captured into CUDA graphs as they are), no shared-memory broadcaster per group.
"""
from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from vllm_anatomy.tracing.collectives import CollectiveTracer

logger = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")


class GroupCoordinator:
    """One group of ranks and the collectives among them (vLLM's GroupCoordinator).

    rank: the global rank; ranks: the global ranks of the group; rank_in_group:
    this process' index among them (the TP rank); local_rank: which device of
    this host it drives. With 2 nodes x 2 ranks:
        process  node  rank  local_rank  rank_in_group
           0      0     0        0            0
           1      0     1        1            1
           2      1     2        0            2
           3      1     3        1            3
    device_group: the backend's group (nccl or gloo); cpu_group: always gloo,
    for small host-side exchanges (handles, barriers) that must not touch a GPU.
    """

    def __init__(self, group_ranks: list[list[int]], local_rank: int, torch_distributed_backend: str,
                 group_name: str) -> None:
        self.unique_name = group_name
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self.backend = torch_distributed_backend
        self.device_group = self.cpu_group = None
        for ranks in group_ranks:
            # NOTE: new_group is itself collective: every rank creates every
            # group, in the same order, even those it is not a member of.
            device_group = dist.new_group(ranks, backend=torch_distributed_backend)
            cpu_group = device_group if torch_distributed_backend == "gloo" else \
                dist.new_group(ranks, backend="gloo")
            if self.rank in ranks:
                self.ranks = ranks
                self.world_size = len(ranks)
                self.rank_in_group = ranks.index(self.rank)
                self.device_group, self.cpu_group = device_group, cpu_group
        assert self.device_group is not None, f"rank {self.rank} is in no group of {group_ranks}"
        self.device = torch.device("cuda", local_rank) if torch_distributed_backend == "nccl" \
            else torch.device("cpu")
        # Counts every collective (and times it at trace level full); the
        # Worker replaces it with one bound to its recorder and device timer.
        self.tracer = CollectiveTracer()

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.first_rank

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum `input_` over the group, in place; every rank gets the sum."""
        if self.world_size == 1:
            return input_
        with self.tracer.collective("all_reduce", input_, self.world_size):
            dist.all_reduce(input_, group=self.device_group)
        return input_

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `input_` along `dim`, in rank order; every rank gets it.

        input_ [..., d, ...] -> [..., world_size * d, ...] (d at `dim`)."""
        if self.world_size == 1:
            return input_
        dim = dim % input_.dim()
        input_ = input_.contiguous()
        # NOTE: the backends gather into one flat buffer, rank after rank on dim 0.
        output = torch.empty((self.world_size * input_.shape[0], *input_.shape[1:]),
                             dtype=input_.dtype, device=input_.device)   # [N * s0, s1, ...]
        with self.tracer.collective("all_gather", input_, self.world_size):
            _all_gather_into_tensor(output, input_, self.device_group)
        # [N * s0, ...] -> [N, s0, ..., d, ...] -> [s0, ..., N, d, ...] -> [s0, ..., N * d, ...]
        output = output.view(self.world_size, *input_.shape).movedim(0, dim)
        return output.reshape(*input_.shape[:dim], self.world_size * input_.shape[dim],
                              *input_.shape[dim + 1:])

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `input_` with rank_in_group `src`'s, on every rank."""
        if self.world_size == 1:
            return input_
        with self.tracer.collective("broadcast", input_, self.world_size):
            dist.broadcast(input_, src=self.ranks[src], group=self.device_group)
        return input_

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Small host data (a msgspec-encoded handle) from `src` to all, over the gloo group.

        NOTE: vLLM uses broadcast_object (pickle); we never pickle: the caller
        encodes with msgspec, this moves the bytes as a uint8 tensor."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=self.ranks[src], group=self.cpu_group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None \
            else torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=self.ranks[src], group=self.cpu_group)
        return buf.numpy().tobytes()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Each rank's small host data, on every rank (over the gloo group)."""
        sizes = torch.zeros(self.world_size, dtype=torch.int64)
        _all_gather_into_tensor(sizes, torch.tensor([len(data)], dtype=torch.int64), self.cpu_group)
        # Every rank sends the same number of bytes: its data, zero-padded to the longest.
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        padded[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        out = torch.empty(self.world_size * padded.numel(), dtype=torch.uint8)
        _all_gather_into_tensor(out, padded, self.cpu_group)
        out = out.view(self.world_size, -1)                                      # [N, longest]
        return [out[i, :int(sizes[i])].numpy().tobytes() for i in range(self.world_size)]

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        for group in {id(g): g for g in (self.device_group, self.cpu_group) if g is not None}.values():
            dist.destroy_process_group(group)
        self.device_group = self.cpu_group = None


def _all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor, group) -> None:
    # NOTE: torch 2.13 renamed all_gather_into_tensor to all_gather_single
    # (the old name warns); the GPU hosts may run an older torch.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input_, group=group)


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None


def get_world_group() -> GroupCoordinator:
    assert _WORLD is not None, "world group is not initialized (init_distributed_environment)"
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    assert _TP is not None, "tensor model parallel group is not initialized (initialize_model_parallel)"
    return _TP


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tensor_model_parallel_world_size() -> int:
    """How many ranks split each layer (1 when no group exists: the single-process engine)."""
    return _TP.world_size if _TP is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group if _TP is not None else 0


def resolve_backend(backend: str | None, device: str) -> str:
    """The torch.distributed backend for ranks on `device`: nccl on CUDA, gloo on CPU.

    NOTE: NCCL moves GPU memory only and gloo here moves host tensors (the
    layers' all-reduce works in place on the device's tensors), so each
    device has exactly one backend that works; asking for the other is an
    error before anything starts, not a hang in the first all-reduce."""
    on_cuda = str(device).startswith("cuda")
    wanted = backend or ("nccl" if on_cuda else "gloo")
    if wanted not in BACKENDS:
        raise ValueError(f"distributed backend must be one of {', '.join(BACKENDS)}; got {wanted!r}")
    if wanted == "nccl" and not on_cuda:
        raise ValueError("distributed backend 'nccl' needs CUDA devices, but this run is on the CPU: "
                         "use 'gloo' (the default on the CPU)")
    if wanted == "nccl" and not dist.is_nccl_available():
        raise ValueError("distributed backend 'nccl' is not available in this torch build")
    if wanted == "gloo" and on_cuda:
        raise ValueError("distributed backend 'gloo' carries CPU tensors here, but this run is on CUDA: "
                         "use 'nccl' (the default on CUDA)")
    return wanted


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str,
                                 local_rank: int, backend: str,
                                 timeout: datetime.timedelta | None = None) -> None:
    """Join the run's world: every rank calls this once with the same world_size and
    init method (tcp://host:port: rank 0 serves the rendezvous store there)."""
    global _WORLD
    if not dist.is_initialized():
        logger.info("world_size=%d rank=%d local_rank=%d distributed_init_method=%s backend=%s",
                    world_size, rank, local_rank, distributed_init_method, backend)
        device_id = torch.device("cuda", local_rank) if backend == "nccl" else None
        dist.init_process_group(backend=backend, init_method=distributed_init_method,
                                world_size=world_size, rank=rank, timeout=timeout, device_id=device_id)
    if _WORLD is None:
        _WORLD = GroupCoordinator([list(range(dist.get_world_size()))], local_rank, backend, "world")
    elif _WORLD.world_size != dist.get_world_size():
        raise RuntimeError("world group already initialized with a different world size")


def initialize_model_parallel(tensor_model_parallel_size: int = 1, backend: str | None = None) -> None:
    """Split the world into groups of tensor_model_parallel_size consecutive ranks.

    NOTE: consecutive, so that on a multi-GPU host the ranks that all-reduce
    twice per layer share its fast links; with one engine (no pipeline or
    data parallelism) there is exactly one TP group: the whole world."""
    global _TP
    world = get_world_group()
    if world.world_size % tensor_model_parallel_size:
        raise ValueError(f"world size {world.world_size} is not a multiple of "
                         f"tensor_model_parallel_size {tensor_model_parallel_size}")
    group_ranks = [list(range(start, start + tensor_model_parallel_size))
                   for start in range(0, world.world_size, tensor_model_parallel_size)]
    _TP = GroupCoordinator(group_ranks, world.local_rank, backend or world.backend, "tp")


def ensure_model_parallel_initialized(tensor_model_parallel_size: int, backend: str | None = None) -> None:
    if not model_parallel_is_initialized():
        initialize_model_parallel(tensor_model_parallel_size, backend)
    elif get_tensor_model_parallel_world_size() != tensor_model_parallel_size:
        raise RuntimeError(f"tensor parallel group already initialized with size "
                           f"{get_tensor_model_parallel_world_size()}, not {tensor_model_parallel_size}")


def destroy_model_parallel() -> None:
    global _TP
    if _TP is not None and _TP is not _WORLD:
        _TP.destroy()
    _TP = None


def destroy_distributed_environment() -> None:
    global _WORLD
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()

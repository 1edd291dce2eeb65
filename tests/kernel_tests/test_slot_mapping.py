"""compute_slot_mapping (Triton) equals its torch reference and the worker's numpy version."""
import numpy as np
import pytest
import torch

from tests.kernel_tests.kernel_utils import DEVICE, block_tables_for, requires_cuda
from vllm_anatomy.kernels.slot_mapping import compute_slot_mapping, compute_slot_mapping_ref
from vllm_anatomy.worker.block_table import BlockTable

POISON = 987654321


def make_batch(query_lens, context_lens, block_size, width, seed, device=DEVICE):
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    block_table = block_tables_for(seq_lens, block_size, num_blocks, width, seed)
    qsl = torch.tensor([0] + list(np.cumsum(query_lens)), dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)]
                          + [torch.zeros(0, dtype=torch.long)]).long()
    return block_table.to(device), qsl.to(device), positions.to(device)


def run_both(query_lens, context_lens, block_size, pad_extra, seed, device=DEVICE, width=None):
    width = width or max(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)) + 2
    block_table, qsl, positions = make_batch(query_lens, context_lens, block_size, width, seed,
                                             device)
    num_reqs, num_tokens = len(query_lens), int(sum(query_lens))
    pad_to = num_tokens + pad_extra
    # Poisoned output, one element longer than pad_to: every element below
    # pad_to must be written, the one past it must not.
    out = torch.full((pad_to + 1,), POISON, dtype=torch.int64, device=device)
    compute_slot_mapping(block_table, qsl, positions, block_size, num_reqs, out, pad_to)
    ref = compute_slot_mapping_ref(block_table, qsl, positions, block_size, num_reqs, pad_to)
    return out, ref, (block_table, positions, query_lens, num_tokens)


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_and_worker(block_size, seed):
    gen = np.random.default_rng(seed)
    num_reqs = 5
    # decodes (query_len 1), chunks continuing context, fresh prefills; lengths
    # not multiples of the block size, so chunks cross block boundaries.
    query_lens = [1, 1, int(gen.integers(2, 70)), int(gen.integers(2, 40)), 1]
    context_lens = [int(gen.integers(0, 50)), 0, int(gen.integers(1, 40)), 0,
                    int(gen.integers(10, 90))]
    out, ref, (block_table, positions, qlens, num_tokens) = run_both(
        query_lens, context_lens, block_size, pad_extra=7, seed=seed)
    assert torch.equal(out[:-1].cpu(), ref.cpu())
    assert out[-1] == POISON, "wrote past pad_to"
    assert (out[num_tokens:-1] == -1).all()

    # The same numbers as BlockTable.compute_slot_mapping on a CPU (numpy; vllm_anatomy/worker/block_table.py).
    table = BlockTable(block_size, max_num_reqs=num_reqs, max_num_blocks_per_req=block_table.shape[1],
                       max_num_batched_tokens=num_tokens + 7, device="cpu")
    table.block_table_np[:num_reqs] = block_table.cpu().numpy()
    table.commit_block_table(num_reqs)
    qsl = torch.tensor([0] + list(np.cumsum(qlens)), dtype=torch.int32)
    table.compute_slot_mapping(num_reqs, qsl, positions.cpu())     # (-1 to the end of its buffer)
    assert np.array_equal(table.slot_mapping.numpy(), out[:-1].cpu().numpy())


def test_padding_only_batch():
    """No requests at all: the padding program alone fills -1."""
    block_table = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    qsl = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    positions = torch.zeros(0, dtype=torch.long, device=DEVICE)
    out = torch.full((10,), POISON, dtype=torch.int64, device=DEVICE)
    compute_slot_mapping(block_table, qsl, positions, 16, 0, out, pad_to=9)
    assert (out[:9] == -1).all() and out[9] == POISON


def test_exact_slots_by_hand():
    """Two requests spelled out: [ctx 14, 3 new] in blocks (7, 2); [1 decode at pos 16] in (4, 9)."""
    block_table = torch.tensor([[7, 2, 0], [4, 9, 0]], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([14, 15, 16, 16], device=DEVICE)
    out = compute_slot_mapping(block_table, qsl, positions, 16, 2, pad_to=6)
    assert out.tolist() == [7 * 16 + 14, 7 * 16 + 15, 2 * 16 + 0, 9 * 16 + 0, -1, -1]




@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 32])
def test_large_batch_gpu(block_size):
    """256 decodes + a few 2k-token chunks, padded to a CUDA-graph size."""
    gen = np.random.default_rng(3)
    query_lens = [1] * 256 + [2048, 1500, 3000]
    context_lens = [int(x) for x in gen.integers(1, 4000, 256)] + [0, 700, 5000]
    out, ref, _ = run_both(query_lens, context_lens, block_size, pad_extra=500, seed=3)
    assert torch.equal(out[:-1], ref) and out[-1] == POISON

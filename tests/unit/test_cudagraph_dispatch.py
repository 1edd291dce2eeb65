"""Which steps replay a CUDA graph, padded to what: pure logic, no GPU needed."""
import pytest

from vllm_anatomy.config import CompilationConfig, default_capture_sizes
from vllm_anatomy.engine.arg_utils import EngineArgs
from vllm_anatomy.worker.cudagraph import BatchDescriptor, CUDAGraphMode, CudagraphDispatcher, CudagraphReason


def dispatcher(sizes=(1, 2, 4, 8, 16, 24), mode="FULL_DECODE_ONLY", max_num_reqs=None):
    return CudagraphDispatcher(CompilationConfig(mode, list(sizes), max(sizes)), max_num_reqs)


def test_default_capture_sizes_follow_vllm():
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]      # the max itself is always captured
    # steps of 16 from 256, as vLLM's _set_cudagraph_sizes
    assert default_capture_sizes(300)[-6:] == [240, 248, 256, 272, 288, 300]
    assert len(default_capture_sizes(512)) == 3 + 31 + 17


@pytest.mark.parametrize("n,padded", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (17, 24), (24, 24)])
def test_pure_decode_pads_to_next_capture_size(n, padded):
    d = dispatcher().decide(num_tokens=n, num_reqs=n, max_query_len=1)
    assert (d.mode, d.num_tokens, d.num_padded_tokens) == (CUDAGraphMode.FULL, n, padded)
    assert d.batch_descriptor == BatchDescriptor(padded, padded, uniform=True)
    assert d.reason_code is CudagraphReason.PURE_DECODE
    assert ("padded" in d.reason) == (n != padded)
    assert d.to_dict() == {"mode": "FULL", "num_tokens": n, "num_padded_tokens": padded,
                           "reason": d.reason, "reason_code": "pure_decode"}


def test_prefill_oversize_and_off_run_eager():
    mixed = dispatcher().decide(num_tokens=20, num_reqs=3, max_query_len=15)
    assert (mixed.mode, mixed.num_padded_tokens) == (CUDAGraphMode.NONE, 20) and "prefill" in mixed.reason
    assert mixed.reason_code is CudagraphReason.PREFILL_IN_BATCH
    big = dispatcher().decide(num_tokens=25, num_reqs=25, max_query_len=1)
    assert (big.mode, big.num_padded_tokens) == (CUDAGraphMode.NONE, 25) and "24" in big.reason
    assert big.reason_code is CudagraphReason.BATCH_TOO_LARGE
    off = CudagraphDispatcher(CompilationConfig()).decide(4, 4, 1)
    assert off.mode is CUDAGraphMode.NONE and "off" in off.reason
    assert off.to_dict()["reason_code"] == "cudagraphs_off"
    # The configured mode says which runtime mode each kind of batch gets.
    assert CUDAGraphMode.FULL_DECODE_ONLY.decode_mode() is CUDAGraphMode.FULL
    assert CUDAGraphMode.FULL_DECODE_ONLY.mixed_mode() is CUDAGraphMode.NONE
    assert CUDAGraphMode.FULL_AND_PIECEWISE.mixed_mode() is CUDAGraphMode.PIECEWISE
    with pytest.raises(ValueError, match="cudagraph_mode"):
        CudagraphDispatcher(CompilationConfig("PIECEWISE", [1], 1))


def test_full_and_piecewise_mixed_batches_replay_pieces():
    d = dispatcher(sizes=(1, 2, 4, 8, 16, 24, 32), mode="FULL_AND_PIECEWISE", max_num_reqs=8)
    assert (d.decode_sizes, d.piecewise_sizes) == ([1, 2, 4, 8], [1, 2, 4, 8, 16, 24, 32])
    # A uniform decode with a full graph: FULL, as with FULL_DECODE_ONLY.
    dec = d.decide(num_tokens=3, num_reqs=3, max_query_len=1)
    assert (dec.mode, dec.batch_descriptor) == (CUDAGraphMode.FULL, BatchDescriptor(4, 4, uniform=True))
    # A mixed batch: pieces, keyed by the padded token count alone.
    mixed = d.decide(num_tokens=20, num_reqs=3, max_query_len=15)
    assert (mixed.mode, mixed.batch_descriptor) == (CUDAGraphMode.PIECEWISE, BatchDescriptor(24))
    assert mixed.reason_code is CudagraphReason.MIXED_BATCH and "padded 20 -> 24" in mixed.reason
    assert mixed.to_dict()["mode"] == "PIECEWISE"
    # More decodes than max_num_seqs' full graphs: pieces too (vLLM's relaxed key).
    many = d.decide(num_tokens=12, num_reqs=12, max_query_len=1)
    assert (many.mode, many.num_padded_tokens) == (CUDAGraphMode.PIECEWISE, 16) and "12 decodes" in many.reason
    # Past the largest size: eager.
    big = d.decide(num_tokens=33, num_reqs=2, max_query_len=30)
    assert (big.mode, big.num_padded_tokens, big.reason_code) == \
        (CUDAGraphMode.NONE, 33, CudagraphReason.BATCH_TOO_LARGE) and "32" in big.reason


def test_dispatch_returns_vllms_mode_and_batch_descriptor():
    """v0.27.1's signature and return: dispatch(num_tokens, uniform_decode=...) -> (CUDAGraphMode, BatchDescriptor)."""
    d = dispatcher(sizes=(1, 2, 4, 8, 16, 24, 32), mode="FULL_AND_PIECEWISE", max_num_reqs=8)
    assert d.dispatch(3, uniform_decode=True) == (CUDAGraphMode.FULL, BatchDescriptor(4, 4, uniform=True))
    assert d.dispatch(3) == (CUDAGraphMode.PIECEWISE, BatchDescriptor(4))             # not uniform: pieces
    assert d.dispatch(33, uniform_decode=True) == (CUDAGraphMode.NONE, BatchDescriptor(33))
    # Modes can be ruled out (vLLM: cascade attention forbids FULL; a forced-eager step allows only NONE).
    assert d.dispatch(3, uniform_decode=True, invalid_modes={CUDAGraphMode.FULL}) == \
        (CUDAGraphMode.PIECEWISE, BatchDescriptor(4))
    assert d.dispatch(3, uniform_decode=True, valid_modes={CUDAGraphMode.NONE}) == \
        (CUDAGraphMode.NONE, BatchDescriptor(3))
    with pytest.raises(AssertionError, match="No allowed"):
        d.dispatch(3, valid_modes={CUDAGraphMode.FULL}, invalid_modes={CUDAGraphMode.FULL})
    assert BatchDescriptor(4).has_lora is False and BatchDescriptor(4).num_active_loras == 0


def test_engine_args_resolve_compilation_config():
    cpu = EngineArgs(device="cpu").create_engine_config().compilation_config
    assert cpu.cudagraph_mode == "NONE" and cpu.cudagraph_capture_sizes == []
    # Explicit sizes are validated and capped by max_num_seqs even where they would be ignored.
    with pytest.raises(ValueError, match="positive"):
        EngineArgs(device="cpu", cudagraph_capture_sizes=[0, 4]).create_engine_config()
    # FULL_AND_PIECEWISE (the default on a GPU): sizes up to min(token budget, 2048).
    gpu = EngineArgs(device="cpu")._compilation_config(True, 12, 4096)
    assert gpu.cudagraph_mode == "FULL_AND_PIECEWISE" and gpu.max_cudagraph_capture_size == 2048
    assert EngineArgs(device="cpu")._compilation_config(True, 12, 1000).max_cudagraph_capture_size == 1000
    # FULL_DECODE_ONLY: a graph is one token per request, so capped by max_num_seqs.
    args = EngineArgs(device="cpu", max_num_seqs=12, cudagraph_mode="FULL_DECODE_ONLY")
    assert args._compilation_config(True, 12, 2048).cudagraph_capture_sizes == [1, 2, 4, 8]
    assert args._compilation_config(True, 300, 2048).max_cudagraph_capture_size == 288
    eager = EngineArgs(device="cpu", enforce_eager=True)._compilation_config(True, 12, 2048)
    assert eager.cudagraph_mode == "NONE"
    assert EngineArgs(device="cpu", cudagraph_mode="NONE")._compilation_config(True, 12, 2048).cudagraph_mode == "NONE"
    with pytest.raises(ValueError, match="cudagraph_mode"):
        EngineArgs(device="cpu", cudagraph_mode="PIECEWISE")._compilation_config(True, 12, 2048)

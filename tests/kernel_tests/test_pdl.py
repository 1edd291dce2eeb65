"""VLLM_ANATOMY_PDL (kernels/pdl.py) off a GPU: the switch's parsing, the layers and the attention
backend reading it once when built, and use_pdl saying no to the interpreter and to CPU tensors,
so the kernels run as without it (bit for bit). What PDL does on Hopper: test_pdl_sm90.py (the
PTX) and tests/gpu/test_pdl_engine.py (whole runs)."""
import pytest
import torch

from tests.kernel_tests.kernel_utils import DEVICE
from vllm_anatomy import envs
from vllm_anatomy.kernels import pdl
from vllm_anatomy.kernels.launch import is_interpreted
from vllm_anatomy.kernels.rms_norm import rms_norm
from vllm_anatomy.kernels.silu_and_mul import silu_and_mul
from vllm_anatomy.kernels.skinny_gemm import SkinnyGemmConfig, skinny_gemm


def test_switch_parsing(monkeypatch):
    monkeypatch.delenv("VLLM_ANATOMY_PDL", raising=False)
    assert envs.VLLM_ANATOMY_PDL is False                                  # off by default
    for value, want in (("1", True), ("true", True), ("0", False), ("False", False), ("", False)):
        monkeypatch.setenv("VLLM_ANATOMY_PDL", value)
        assert envs.VLLM_ANATOMY_PDL is want
    monkeypatch.setenv("VLLM_ANATOMY_PDL", "on")
    with pytest.raises(ValueError, match="VLLM_ANATOMY_PDL"):
        envs.VLLM_ANATOMY_PDL


def test_use_pdl_says_no_off_hopper_or_interpreted():
    x = torch.zeros(4, device=DEVICE)
    assert not pdl.use_pdl(x, False)
    # NOTE: this folder runs the interpreter on a CPU machine but compiled Triton on a GPU one.
    compiled_hopper = (x.is_cuda and not is_interpreted(pdl.pdl_wait)
                       and torch.cuda.get_device_capability(x.device)[0] >= 9)
    assert pdl.use_pdl(x, True) is compiled_hopper
    assert not pdl.use_pdl(torch.zeros(4), True)


def test_layers_and_backend_read_the_switch_when_built(monkeypatch):
    from vllm_anatomy.attention.backends.triton_attn import TritonAttentionImpl
    from vllm_anatomy.model_executor.layers.activation import SiluAndMul
    from vllm_anatomy.model_executor.layers.layernorm import RMSNorm
    monkeypatch.setenv("VLLM_ANATOMY_PDL", "1")
    built = [RMSNorm(8), SiluAndMul(), TritonAttentionImpl(4, 16, 2, 0.25)]
    monkeypatch.setenv("VLLM_ANATOMY_PDL", "0")
    assert all(m.pdl is True for m in built)                             # read once, at build time
    assert RMSNorm(8).pdl is False


def test_switch_on_changes_nothing_in_the_interpreter():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(5, 64, generator=g, device=DEVICE)
    r = torch.randn(5, 64, generator=g, device=DEVICE)
    w = torch.randn(64, generator=g, device=DEVICE)
    for a, b in zip(rms_norm(x, w, 1e-6, r, pdl=True), rms_norm(x, w, 1e-6, r, pdl=False)):
        assert torch.equal(a, b)
    assert torch.equal(silu_and_mul(x, pdl=True), silu_and_mul(x, pdl=False))
    wt = torch.randn(48, 64, generator=g, device=DEVICE)
    for cfg in (SkinnyGemmConfig(16, 16, 16, split_k=2), SkinnyGemmConfig(16, 16, 16, split_k=2, reduce="kernel")):
        assert torch.equal(skinny_gemm(x, wt, config=cfg, pdl=True), skinny_gemm(x, wt, config=cfg, pdl=False))

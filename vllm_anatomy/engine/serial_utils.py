"""What goes over the frontend <-> EngineCoreProc sockets, and how it is encoded.

Mirrors vllm/v1/serial_utils.py (MsgpackEncoder / MsgpackDecoder) and the
message-type bytes of vllm/v1/engine/__init__.py (EngineCoreRequestType).

Every message is a ZMQ multipart message of two frames:

    frame 0: one type byte      (EngineCoreRequestType / EngineCoreOutputType)
    frame 1: msgpack payload    (a msgspec Struct, a list of ids, or a string)

NOTE: msgpack via msgspec, never pickle: a socket peer can only make us build
the declared types, and decoding is validated against them. vLLM falls back to
pickle for types it cannot encode (tensors as raw zero-copy frames, other
objects behind an env flag); here an unsupported type is an error, said clearly.

Simplified: vLLM's EngineCoreOutputs carries `utility_output` and signals death
with a raw b"ENGINE_CORE_DEAD" frame; here the output side has the same
two-frame envelope as the input side (EngineCoreOutputType, ours).
"""
from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np


class EngineCoreRequestType(enum.Enum):
    """Frontend -> engine message types (the values are vLLM's)."""
    ADD = b"\x00"        # payload: EngineCoreRequest
    ABORT = b"\x01"      # payload: list[str] (request ids)
    UTILITY = b"\x03"    # payload: UtilityRequest


class EngineCoreOutputType(enum.Enum):
    """Engine -> frontend message types (ours; see the module docstring)."""
    OUTPUTS = b"\x00"            # payload: EngineCoreOutputs
    UTILITY = b"\x01"            # payload: UtilityOutput
    ENGINE_CORE_DEAD = b"\x02"   # payload: str, why the engine is exiting


class EngineCoreReadyResponse(msgspec.Struct, array_like=True, gc=False):
    """First message of a started engine: what the frontend must know about it."""
    engine_index: int
    pid: int
    num_gpu_blocks: int
    block_size: int
    max_model_len: int


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):
    """Call `method_name(*args)` on the EngineCore, answer with a UtilityOutput.

    vLLM sends the tuple (client_index, call_id, method_name, args).
    """
    client_index: int
    call_id: int
    method_name: str
    args: list[Any] = []


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to one UtilityRequest: a plain-data result, or why it failed."""
    call_id: int
    failure_message: str | None = None
    result: Any = None


def _refuse(obj: Any) -> Any:
    raise TypeError(
        f"Objects of type {type(obj).__name__} cannot cross the process boundary: only "
        f"msgspec Structs and plain data (str, int, float, list, dict, ...) are encoded; "
        f"there is no pickle fallback.")


# msgpack extension type of a CPU tensor (prompt logprobs cross the wire as LogprobsTensors).
TENSOR_EXT = 1


def enc_hook(obj: Any) -> Any:
    """numpy arrays as [dtype, shape, raw bytes] (vLLM's encoder sends them as
    raw buffers too: the grammar bitmask crosses to the workers this way);
    CPU tensors as a msgpack extension (ext_hook rebuilds them whatever the
    declared type: the pure core declares tensor fields Any, it does not
    import torch); anything else msgspec cannot encode is refused."""
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    if type(obj).__name__ == "Tensor" and type(obj).__module__ == "torch":
        array = obj.detach().cpu().numpy()       # (int32 / int64 / float32 here: numpy has them all)
        return msgspec.msgpack.Ext(TENSOR_EXT, msgspec.msgpack.encode(
            (array.dtype.str, array.shape, np.ascontiguousarray(array).tobytes())))
    return _refuse(obj)


def ext_hook(code: int, data: memoryview) -> Any:
    """The inverse of enc_hook for a tensor."""
    if code != TENSOR_EXT:
        raise TypeError(f"Unknown msgpack extension type {code}")
    import torch
    dtype, shape, raw = msgspec.msgpack.decode(data)
    # (a writable copy: torch warns on, and must not write through, a read-only buffer)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy())


def dec_hook(t: type, obj: Any) -> Any:
    """The inverse of enc_hook for a field declared np.ndarray."""
    if t is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    raise TypeError(f"Cannot decode type {t!r}")


class MsgpackEncoder:
    """msgpack encoder for the wire types (msgspec Structs, enums, builtins, numpy arrays)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self.encoder.encode(obj)

    def encode_into(self, obj: Any, buf: bytearray) -> None:
        """Encode into a reusable buffer (vLLM reuses them to avoid allocations)."""
        self.encoder.encode_into(obj, buf)


class MsgpackDecoder:
    """msgpack decoder checking the payload against one declared type."""

    def __init__(self, t: Any = Any) -> None:
        self.type = t
        self.decoder = msgspec.msgpack.Decoder(t, dec_hook=dec_hook, ext_hook=ext_hook)

    def decode(self, buf: bytes | bytearray | memoryview) -> Any:
        """Decode; a payload that is not valid msgpack of `t` raises msgspec.DecodeError."""
        return self.decoder.decode(buf)

"""The wire format between the frontend and EngineCoreProc: msgpack round trips
of every message type, and refusals (no pickle fallback, validated decoding)."""
import msgspec
import pytest

from vllm_anatomy.core.outputs import LogprobsLists, LogprobsTensors, ModelRunnerOutput
from vllm_anatomy.engine.protocol import (EngineCoreEvent, EngineCoreEventType, EngineCoreOutput,
                                          EngineCoreOutputs, EngineCoreRequest, FinishReason, SchedulerStats)
from vllm_anatomy.engine.serial_utils import (EngineCoreOutputType, EngineCoreReadyResponse,
                                              EngineCoreRequestType, MsgpackDecoder, MsgpackEncoder,
                                              UtilityOutput, UtilityRequest)
from vllm_anatomy.sampling_params import RequestOutputKind, SamplingParams


def roundtrip(obj, t):
    return MsgpackDecoder(t).decode(MsgpackEncoder().encode(obj))


def test_request_types_are_vllms_bytes():
    assert EngineCoreRequestType.ADD.value == b"\x00"
    assert EngineCoreRequestType.ABORT.value == b"\x01"
    assert EngineCoreRequestType.UTILITY.value == b"\x03"
    assert len({t.value for t in EngineCoreOutputType}) == len(EngineCoreOutputType)


def test_engine_core_request_roundtrip_keeps_params_and_trace_headers():
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=9, stop=["###", "\n\n"],
                            output_kind=RequestOutputKind.DELTA, logprobs=2, eos_token_id=2)
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
               "tracestate": "vendor=1"}
    req = EngineCoreRequest("req-1", [1, 2, 49151], params, 1234.5, cache_salt="s",
                            trace_headers=headers, external_req_id="ext")
    back = roundtrip(req, EngineCoreRequest)
    assert back == req
    assert back.trace_headers == headers
    assert back.sampling_params.output_kind is RequestOutputKind.DELTA
    assert back.sampling_params.stop == ["###", "\n\n"]


def test_engine_core_outputs_roundtrip():
    out = EngineCoreOutput("r", [5, 6], finish_reason=FinishReason.STOP, stop_reason=2,
                           events=[EngineCoreEvent(EngineCoreEventType.QUEUED, 1.5)],
                           trace_headers={"traceparent": "x"}, num_cached_tokens=16)
    outs = EngineCoreOutputs(engine_index=0, outputs=[out], timestamp=99.0,
                             scheduler_stats=SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25),
                             finished_requests={"r", "q"})
    back = roundtrip(outs, EngineCoreOutputs)
    assert back == outs
    assert back.outputs[0].finish_reason is FinishReason.STOP
    assert back.outputs[0].events[0].type is EngineCoreEventType.QUEUED
    assert back.timestamp == 99.0   # the engine's clock, not re-stamped on arrival


def test_utility_and_ready_messages_roundtrip():
    req = UtilityRequest(0, 7, "get_scheduler_stats", [1, "a"])
    assert roundtrip(req, UtilityRequest) == req
    ok = UtilityOutput(7, result=msgspec.to_builtins(SchedulerStats(num_waiting_reqs=3)))
    back = roundtrip(ok, UtilityOutput)
    assert back.failure_message is None
    assert msgspec.convert(back.result, SchedulerStats).num_waiting_reqs == 3
    failed = roundtrip(UtilityOutput(8, failure_message="boom"), UtilityOutput)
    assert failed.failure_message == "boom" and failed.result is None
    ready = EngineCoreReadyResponse(0, 1234, 100, 16, 512)
    assert roundtrip(ready, EngineCoreReadyResponse) == ready


def test_arbitrary_objects_are_refused_not_pickled():
    class Secret:
        pass
    with pytest.raises(TypeError, match="no pickle fallback"):
        MsgpackEncoder().encode({"x": Secret()})


def test_decoding_checks_the_declared_type():
    dec = MsgpackDecoder(EngineCoreRequest)
    with pytest.raises(msgspec.DecodeError):
        dec.decode(b"\xc1not msgpack")
    with pytest.raises(msgspec.ValidationError):
        dec.decode(MsgpackEncoder().encode(["id", "not a list of ints", {}, 0.0]))
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(list[str]).decode(MsgpackEncoder().encode([1, 2]))


def test_encode_into_reuses_a_buffer():
    enc, buf = MsgpackEncoder(), bytearray()
    enc.encode_into(["a", "b"], buf)
    assert MsgpackDecoder(list[str]).decode(buf) == ["a", "b"]


def test_logprobs_cross_the_wire_as_numpy_and_tensors():
    """LogprobsLists (numpy arrays) and prompt logprobs (LogprobsTensors of CPU tensors) round-trip
    exactly; the decoder rebuilds the tensors although the pure core types them Any."""
    import numpy as np
    import torch
    lp = LogprobsLists(np.array([[5, 1], [6, 2]]), np.array([[-0.1, -2.0], [-0.3, -1.0]], dtype=np.float32),
                       np.array([1, 1]))
    plp = LogprobsTensors(torch.tensor([[3, 4]], dtype=torch.int32), torch.tensor([[-0.5, -0.7]]),
                          torch.tensor([2], dtype=torch.int32))
    back = roundtrip(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [5, 6], new_logprobs=lp,
                                                                 new_prompt_logprobs_tensors=plp)]),
                     EngineCoreOutputs).outputs[0]
    assert isinstance(back.new_logprobs, LogprobsLists)
    assert back.new_logprobs.logprob_token_ids.tolist() == [[5, 1], [6, 2]]
    assert back.new_logprobs.logprobs.dtype == np.float32
    got = back.new_prompt_logprobs_tensors
    assert isinstance(got.logprobs, torch.Tensor) and got.logprob_token_ids.dtype == torch.int32
    assert torch.equal(got.logprobs, plp.logprobs) and got.selected_token_ranks.tolist() == [2]
    mro = roundtrip(ModelRunnerOutput(["r"], {"r": 0}, [[5]], logprobs=lp, prompt_logprobs_dict={"r": plp}),
                    ModelRunnerOutput)
    assert mro.logprobs.slice_request(1, 1).sampled_token_ranks.tolist() == [1]
    assert torch.equal(mro.prompt_logprobs_dict["r"].logprob_token_ids, plp.logprob_token_ids)

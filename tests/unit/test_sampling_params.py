import msgspec
import pytest

from vllm_anatomy.engine.protocol import EngineCoreRequest
from vllm_anatomy.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"n": 2}, "n"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"seed": 1.5}, "seed"),
    ({"temperature": "hot"}, "temperature"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field)


def test_defaults_and_normalisation():
    sp = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert sp.stop == ["###"] and sp.top_k == 0 and sp.sampling_type_greedy
    assert not SamplingParams(temperature=0.7).sampling_type_greedy


def test_request_round_trips_through_msgpack():
    sp = SamplingParams(temperature=0.5, top_p=0.9, seed=7, stop=["x"], logprobs=3)
    req = EngineCoreRequest("r1", [1, 2, 3], sp, 12.5, trace_headers={"traceparent": "00-ab-cd-01"})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back == req

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
    ({"n": 0}, "n"),
    ({"n": 2, "temperature": 0.0}, "n"),          # n greedy samples would be identical (vLLM refuses too)
    ({"n": 16385}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
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


def test_clone_is_as_independent_as_a_deep_copy():
    """The engine keeps a clone of each request's params (vLLM deep-copies them): changing the
    clone's mutable fields must leave the caller's params as they were."""
    from vllm_anatomy.sampling_params import StructuredOutputsParams
    sp = SamplingParams(temperature=0.6, max_tokens=10, stop=["a", "b"], stop_token_ids=[3],
                        logit_bias={1: 2.0}, structured_outputs=StructuredOutputsParams(choice=["x", "y"]))
    clone = sp.clone()
    assert clone == sp and clone is not sp
    clone.stop.append("c")
    clone.stop_token_ids.append(4)
    clone.logit_bias[5] = -1.0
    clone.structured_outputs.choice.append("z")
    assert sp.stop == ["a", "b"] and sp.stop_token_ids == [3] and sp.logit_bias == {1: 2.0}
    assert sp.structured_outputs.choice == ["x", "y"]
    assert SamplingParams().clone() == SamplingParams()

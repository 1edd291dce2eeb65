"""Issue 14: a bad request is refused at the edge, re-checked by EngineCore, and
one that still fails inside a step fails alone (the others continue, the engine
stays up). CPU, the tiny random Llama of conftest (vocabulary 512)."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.core.request import Request
from vllm_anatomy.engine.input_processor import InputProcessor, validate_text
from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.model_executor.sampler import Sampler, apply_logit_bias, apply_top_k_top_p
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata

VOCAB = 512


# -- SamplingParams: types and ranges --------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"top_k": 10**30}, "top_k"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": -math.inf}, "min_p"),
    ({"logit_bias": {1: math.nan}}, "logit_bias"),
    ({"logit_bias": {"1": 1.0}}, "logit_bias"),
    ({"logit_bias": {2**64: 1.0}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
])
def test_out_of_range_fields_name_the_field(kwargs, field):
    with pytest.raises(VLLMValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.parameter == field and str(e.value).startswith(field)
    assert isinstance(e.value, ValueError)          # callers catching ValueError still do


def test_int64_edges_and_vllm_normalisation_are_accepted():
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=-1).seed is None      # vLLM: -1 means no seed
    assert SamplingParams(temperature=2.0, logit_bias={3: -100.0}).logit_bias == {3: -100.0}


@pytest.mark.parametrize("kwargs, field", [
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [1, 999999]}, "stop_token_ids"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
])
def test_verify_refuses_ids_outside_the_vocabulary(kwargs, field):
    sp = SamplingParams(**kwargs)
    with pytest.raises(VLLMValidationError) as e:
        sp.verify(VOCAB)
    assert e.value.parameter == field and f"[0, {VOCAB})" in str(e.value)
    SamplingParams(stop_token_ids=[VOCAB - 1], logit_bias={0: 1.0}).verify(VOCAB)


def test_validate_text_refuses_lone_surrogates():
    assert validate_text("héllo 🙂", "prompt") == "héllo 🙂"
    with pytest.raises(VLLMValidationError) as e:
        validate_text("ab\ud800c", "messages.0.content")
    assert e.value.parameter == "messages.0.content" and "character 2" in str(e.value)


# -- the sampler -------------------------------------------------------------------------
def test_tiny_top_p_keeps_the_top_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    p = torch.tensor([1e-50, 1e-50], dtype=torch.float32)     # 0.0 in float32
    assert p[0].item() == 0.0
    out = apply_top_k_top_p(logits, None, p)
    assert torch.isfinite(out).sum(dim=1).tolist() == [1, 1]
    assert out.argmax(dim=1).tolist() == [1, 0]
    md = SamplingMetadata(temperature=torch.ones(2), all_greedy=False, all_random=True, top_p=p, top_k=None,
                          min_p=None, generators={}, max_num_logprobs=None)
    for _ in range(20):     # random sampling can only pick the top token
        assert Sampler()(logits, md).sampled_token_ids.tolist() == [1, 0]


def test_logit_bias_is_added_to_its_rows_only():
    logits = torch.zeros(2, 5)
    bias = (torch.tensor([0, 0, 1]), torch.tensor([3, 4, 1]), torch.tensor([2.0, -100.0, 7.0]))
    out = apply_logit_bias(logits, bias)
    assert out[0].tolist() == [0, 0, 0, 2.0, -100.0] and out[1].tolist() == [0, 7.0, 0, 0, 0]
    assert logits.abs().sum() == 0                                   # the model's logits are untouched


# -- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", max_model_len=128, block_size=8, num_gpu_blocks_override=64,
              async_scheduling=request.param)
    yield llm
    llm.llm_engine.shutdown()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 6, **kw})


PROMPT = [5, 6, 7, 8, 9, 10, 11]


def test_llm_generate_refuses_bad_params_and_keeps_working(llm):
    expected = llm.generate([PROMPT], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    for bad in (greedy(stop_token_ids=[VOCAB], min_tokens=2), greedy(logit_bias={10**6: 1.0})):
        with pytest.raises(VLLMValidationError):
            llm.generate([PROMPT, PROMPT], [greedy(), bad], use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="out of vocabulary"):
        llm.generate([[1, 2, VOCAB]], greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()         # nothing was added
    assert llm.generate([PROMPT], greedy(), use_tqdm=False)[0].outputs[0].token_ids == expected


def test_logit_bias_steers_greedy_decoding(llm):
    out = llm.generate([PROMPT], greedy(max_tokens=4, logit_bias={42: 100.0}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [42] * 4


def test_logit_bias_follows_its_request_across_rows(llm):
    """A finishes first; condense() moves B (the last row) into A's row: B's bias must move with it."""
    alone = llm.generate([PROMPT], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    a, c, b = llm.generate([PROMPT, PROMPT, PROMPT],
                           [greedy(max_tokens=2, logit_bias={42: 100.0}), greedy(),
                            greedy(logit_bias={43: 100.0})], use_tqdm=False)
    assert a.outputs[0].token_ids == [42, 42] and b.outputs[0].token_ids == [43] * 6
    assert c.outputs[0].token_ids == alone


def test_engine_core_rechecks_what_it_relies_on(llm):
    engine = llm.llm_engine
    _, request = engine.process_inputs("r", {"prompt_token_ids": PROMPT}, greedy())
    request.sampling_params.stop_token_ids = [VOCAB + 5]      # as if the frontend had missed it
    with pytest.raises(VLLMValidationError, match="stop_token_ids"):
        engine.engine_core.add_request(request)
    request.sampling_params.stop_token_ids = None
    request.prompt_token_ids = PROMPT + [VOCAB]
    with pytest.raises(VLLMValidationError, match="out of vocabulary"):
        engine.add_processed_request(None, request)
    assert not engine.has_unfinished_requests()               # refused, forgotten, nothing leaked


def _inject_unchecked(engine, req_id: str, **bad) -> None:
    """Add a request with fields no check let through, straight into the scheduler
    (a Request skips EngineCore.preprocess_add_request): a stand-in for a gap
    in validation, to exercise the last line, inside the step."""
    _, request = engine.process_inputs(req_id, {"prompt_token_ids": PROMPT}, greedy())
    for name, value in bad.items():
        setattr(request.sampling_params, name, value)
    engine.output_processor.add_request(request, None)
    engine.engine_core.add_request(Request.from_engine_core_request(request, engine.engine_core.request_block_hasher))


def test_a_request_failing_inside_a_step_fails_alone(llm, caplog):
    engine = llm.llm_engine
    core = engine.engine_core
    expected = llm.generate([PROMPT], greedy(max_tokens=12), use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("good", {"prompt_token_ids": PROMPT}, greedy(max_tokens=12))
    engine.step()                                              # "good" is running
    # The crash: min_tokens masking with a stop id past the vocabulary.
    _inject_unchecked(engine, "bad-stop", stop_token_ids=[VOCAB], min_tokens=2)
    _inject_unchecked(engine, "bad-seed", seed=2**70, temperature=1.0)   # torch.Generator refuses it
    _inject_unchecked(engine, "bad-bias", logit_bias={VOCAB * 10: 1.0})
    finished = {}
    with caplog.at_level(logging.ERROR, logger="vllm_anatomy.worker.gpu_model_runner"):
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                finished[out.request_id] = out
    assert {rid: o.outputs[0].finish_reason for rid, o in finished.items()} == {
        "good": "length", "bad-stop": "error", "bad-seed": "error", "bad-bias": "error"}
    assert finished["good"].outputs[0].token_ids == expected              # unharmed
    assert all(finished[r].outputs[0].token_ids == [] for r in ("bad-stop", "bad-seed", "bad-bias"))
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(r in logged for r in ("bad-stop", "bad-seed", "bad-bias"))
    assert core.scheduler.get_kv_cache_usage() == 0 and not core.scheduler.requests   # blocks freed
    # The engine is up: the next batch runs, and the worker forgot the failed ones.
    assert llm.generate([PROMPT], greedy(max_tokens=12), use_tqdm=False)[0].outputs[0].token_ids == expected
    assert core.model_executor.driver_worker.model_runner.failed_req_ids == {}


def test_every_request_of_a_step_failing_leaves_an_empty_step(llm):
    engine = llm.llm_engine
    _inject_unchecked(engine, "only-bad", stop_token_ids=[VOCAB], min_tokens=1)
    outs = []
    for _ in range(10):
        if not engine.has_unfinished_requests():
            break
        outs += engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("only-bad", "error")]
    assert engine.engine_core.scheduler.get_kv_cache_usage() == 0


def test_assign_request_id_keeps_the_callers_id():
    from vllm_anatomy.engine.protocol import EngineCoreRequest
    a = EngineCoreRequest("same", [1], SamplingParams(), 0.0)
    b = EngineCoreRequest("same", [1], SamplingParams(), 0.0)
    InputProcessor.assign_request_id(a)
    InputProcessor.assign_request_id(b)
    assert a.external_req_id == b.external_req_id == "same"
    assert a.request_id.startswith("same-") and b.request_id.startswith("same-") and a.request_id != b.request_id
    with pytest.raises(ValueError):
        InputProcessor.assign_request_id(a)

"""Speculative decoding on the real default model: greedy output equals transformers'
(and so equals the engine without speculation), token for token, for ngram and
draft_model, under chunked prefill, preemption and prefix caching; the regime and the
speculation itself (drafts scheduled, some accepted, some rejected) are asserted from
the engine's own counters.

Draft models: the target itself (greedy drafts are then always accepted) and a
6-layer cut of it (write_truncated_draft: mostly rejected, so the rollback and the
recovered tokens run on every step).

The Sampler's logits processors at draft positions: greedy with a repetition
penalty equals transformers' generate(repetition_penalty=...) with ngram drafts
(which come from the prompt, the very tokens the penalty pushes down), and bad
words, presence and frequency penalties give the same tokens with speculation as
without it.

Async scheduling with a draft model beside the other features: parallel sampling (n = 3,
seeded: the synchronous engine's tokens), structured output (a choice and a regex, their
sampling deferred for the token in flight) and the worker-process executor.

Structured output with drafts (as v0.27.1): a choice, a regex and a JSON schema get drafts
with ngram, the model as its own draft, and that with async scheduling; some are accepted, and
the outputs equal the same requests' greedy outputs without speculation.
"""
import re

import pytest

from tests.integration.test_llm_generate import (MAX_TOKENS, PENALTY, QUESTIONS, RAW, SYSTEM, _chat_ids,
                                                 _check_equal, _engine_tokens, hf_greedy, hf_model, prompts,
                                                 shared_prefix_prompts, tokenizer)
from vllm_anatomy import LLM, SamplingParams

pytestmark = pytest.mark.model
__all__ = ["hf_model", "prompts", "shared_prefix_prompts", "tokenizer", "QUESTIONS", "RAW", "SYSTEM"]

K = 3
# A copy task: the model repeats its prompt, which prompt lookup (ngram) predicts.
COPY = "Repeat this sentence exactly: the small red boat sails across the quiet blue lake at dawn."


@pytest.fixture(scope="module")
def truncated_draft(default_model_dir, tmp_path_factory):
    from vllm_anatomy.transformers_utils.draft_model_utils import write_truncated_draft
    return write_truncated_draft(default_model_dir, 6, tmp_path_factory.mktemp("draft6"))


@pytest.fixture(scope="module")
def spec_prompts(prompts, tokenizer):
    return prompts + [_chat_ids(tokenizer, COPY)]


def speculative_config(method: str, default_model_dir: str, truncated_draft: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    model = default_model_dir if method == "draft_self" else truncated_draft
    return {"method": "draft_model", "model": model, "num_speculative_tokens": K}


METHODS = pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_cut"])


def check_speculated(llm: LLM, method: str) -> dict:
    m = llm.get_metrics()
    assert m["vllm:spec_decode_num_drafts"] > 0 and m["vllm:spec_decode_num_draft_tokens"] > 0, m
    accepted, drafted = m["vllm:spec_decode_num_accepted_tokens"], m["vllm:spec_decode_num_draft_tokens"]
    if method == "draft_self":
        assert accepted == drafted, m              # the target agrees with itself
    else:
        assert 0 < accepted < drafted, m           # some accepted, some rejected
    per_pos = [m[f"vllm:spec_decode_num_accepted_tokens_per_pos:{p}"] for p in range(K)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    return m


@METHODS
def test_greedy_equals_transformers(default_model_dir, truncated_draft, hf_model, spec_prompts, method):
    llm = LLM(default_model_dir, max_model_len=2048,
              speculative_config=speculative_config(method, default_model_dir, truncated_draft))
    got, _ = _engine_tokens(llm, spec_prompts)
    _check_equal(hf_model, spec_prompts, got)
    m = check_speculated(llm, method)
    if method == "draft_self":
        # Up to K + 1 tokens per step: far fewer steps than tokens.
        assert m["vllm_anatomy:engine_steps"] < m["vllm:generation_tokens"] / 2, m


@METHODS
def test_chunked_prefill(default_model_dir, truncated_draft, hf_model, spec_prompts, method):
    llm = LLM(default_model_dir, max_model_len=2048, max_num_batched_tokens=32,
              speculative_config=speculative_config(method, default_model_dir, truncated_draft))
    got, _ = _engine_tokens(llm, spec_prompts)
    _check_equal(hf_model, spec_prompts, got)
    assert max(len(p) for p in spec_prompts) > 32
    check_speculated(llm, method)


@METHODS
def test_preemption(default_model_dir, truncated_draft, hf_model, spec_prompts, method):
    # 12 usable blocks for 10 requests of ~30-60 tokens (plus drafts, and a draft model's
    # lookahead): the scheduler must preempt, dropping drafts in flight.
    llm = LLM(default_model_dir, num_gpu_blocks_override=13, max_model_len=192, enable_prefix_caching=False,
              speculative_config=speculative_config(method, default_model_dir, truncated_draft))
    got, _ = _engine_tokens(llm, spec_prompts)
    _check_equal(hf_model, spec_prompts, got)
    assert llm.get_metrics()["vllm:num_preemptions"] > 0
    check_speculated(llm, method)


@METHODS
def test_prefix_caching(default_model_dir, truncated_draft, hf_model, shared_prefix_prompts, method):
    # NOTE: with a draft model, a hit gives the draft its KV too: it was computed in the
    # same blocks when the first request filled them.
    llm = LLM(default_model_dir, max_model_len=2048,
              speculative_config=speculative_config(method, default_model_dir, truncated_draft))
    got0, _ = _engine_tokens(llm, shared_prefix_prompts[:1])
    got1, outs = _engine_tokens(llm, shared_prefix_prompts[1:])
    _check_equal(hf_model, shared_prefix_prompts, got0 + got1)
    assert llm.get_metrics()["vllm:prefix_cache_hits"] > 0
    assert all(o.num_cached_tokens >= 16 for o in outs)
    assert llm.get_metrics()["vllm:spec_decode_num_drafts"] > 0


ASYNC_DRAFT = pytest.mark.parametrize("method", ["draft_self", "draft_cut"])


@ASYNC_DRAFT
@pytest.mark.parametrize("engine_kwargs", [
    pytest.param({}, id="plain"),
    pytest.param({"max_num_batched_tokens": 32}, id="chunked_prefill"),
    pytest.param({"num_gpu_blocks_override": 13, "max_model_len": 192, "enable_prefix_caching": False},
                 id="preemption"),
])
def test_async_scheduling_greedy_equals_transformers(default_model_dir, truncated_draft, hf_model, spec_prompts,
                                                     method, engine_kwargs):
    """Explicit async scheduling with a draft model (v0.27.1 runs it): the drafts stay on the
    device, the scheduler plans with -1 placeholders; greedy output is still transformers'."""
    kwargs = {"max_model_len": 2048, **engine_kwargs}
    llm = LLM(default_model_dir, async_scheduling=True,
              speculative_config=speculative_config(method, default_model_dir, truncated_draft), **kwargs)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    got, _ = _engine_tokens(llm, spec_prompts)
    _check_equal(hf_model, spec_prompts, got)
    check_speculated(llm, method)
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.get_metrics()["vllm:num_preemptions"] > 0


def test_async_scheduling_prefix_caching(default_model_dir, truncated_draft, hf_model, shared_prefix_prompts):
    """A prefix-cache hit gives the draft its KV under async scheduling too: the same drafts
    are verified and accepted as without it (greedy drafts are deterministic)."""
    counters = []
    for async_scheduling in (False, True):
        llm = LLM(default_model_dir, max_model_len=2048, async_scheduling=async_scheduling,
                  speculative_config=speculative_config("draft_cut", default_model_dir, truncated_draft))
        got0, _ = _engine_tokens(llm, shared_prefix_prompts[:1])
        got1, outs = _engine_tokens(llm, shared_prefix_prompts[1:])
        _check_equal(hf_model, shared_prefix_prompts, got0 + got1)
        m = llm.get_metrics()
        assert m["vllm:prefix_cache_hits"] > 0 and m["vllm:spec_decode_num_drafts"] > 0
        assert all(o.num_cached_tokens >= 16 for o in outs)
        counters.append({k: v for k, v in m.items() if k.startswith("vllm:spec_decode")})
    assert counters[0] == counters[1]


def test_seeded_random_sampling_reproduces_and_logprobs(default_model_dir, spec_prompts):
    """Random sampling goes through the rejection sampler: a seeded request gives the same
    tokens in two runs (batched differently), and every output token has its logprob."""
    config = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    sp = SamplingParams(temperature=0.8, top_k=50, seed=1234, max_tokens=MAX_TOKENS, logprobs=2)
    llm = LLM(default_model_dir, max_model_len=2048, speculative_config=config)
    first = llm.generate([{"prompt_token_ids": spec_prompts[-1]}], sp, use_tqdm=False)[0].outputs[0]
    both = llm.generate([{"prompt_token_ids": p} for p in (spec_prompts[0], spec_prompts[-1])], sp,
                        use_tqdm=False)
    assert both[1].outputs[0].token_ids == first.token_ids
    assert first.logprobs is not None and len(first.logprobs) == len(first.token_ids)
    assert all(tok in lp for tok, lp in zip(first.token_ids, first.logprobs))


def test_refusals(default_model_dir):
    config = {"method": "ngram", "num_speculative_tokens": K}
    with pytest.raises(ValueError, match="async scheduling is only supported"):
        LLM(default_model_dir, async_scheduling=True, speculative_config=config)
    llm = LLM(default_model_dir, max_model_len=512, speculative_config=config)
    for bad in (SamplingParams(min_p=0.1), SamplingParams(logit_bias={5: 1.0})):
        with pytest.raises(ValueError, match="not yet supported with speculative decoding"):
            llm.generate("hello", bad, use_tqdm=False)
    # Accepted, as v0.27.1 accepts them: the rejection sampler applies them at every draft position.
    accepted = [dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5), dict(bad_words=["hello"]),
                dict(allowed_token_ids=[5, 6, 7]), dict(min_tokens=2)]
    outs = llm.generate(["hello"] * len(accepted), [SamplingParams(max_tokens=4, ignore_eos=True, **kw)
                                                    for kw in accepted], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] * len(accepted)
    assert set(outs[2].outputs[0].token_ids) <= {5, 6, 7}
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(default_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "nope": 1})


def test_worker_process_executor(default_model_dir, hf_model, spec_prompts):
    """The drafts cross the shared-memory RPC (Executor.take_draft_token_ids) from a worker process."""
    llm = LLM(default_model_dir, max_model_len=512, distributed_executor_backend="mp",
              speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    try:
        got, _ = _engine_tokens(llm, spec_prompts[-2:])
        _check_equal(hf_model, spec_prompts[-2:], got)
        assert llm.get_metrics()["vllm:spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.shutdown()


def test_structured_output_beside_drafts(default_model_dir, hf_model, spec_prompts, tokenizer, tmp_path):
    """A structured-output request gets drafts too (v0.27.1), checked against its grammar, and
    shares steps with a plain one that has them: each of its bitmask rows must land on its own
    logits rows (its draft positions and bonus, offset by the other rows' draft rows). The run
    store shows drafts accepted for the structured request itself."""
    from vllm_anatomy.sampling_params import StructuredOutputsParams
    from vllm_anatomy.tracing.reader import open_run
    llm = LLM(default_model_dir, max_model_len=1024, trace_level="full", trace_dir=str(tmp_path),
              speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    copy = spec_prompts[-1]
    outs = llm.generate([{"prompt_token_ids": copy}, {"prompt_token_ids": copy}],
                        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                        structured_outputs=StructuredOutputsParams(regex=COPY_REGEX))],
                        use_tqdm=False)
    _check_equal(hf_model, [copy], [outs[0].outputs[0].token_ids])
    assert re.fullmatch(COPY_REGEX, outs[1].outputs[0].text), outs[1].outputs[0].text
    with open_run(llm.llm_engine.recorder.run_path) as run:
        verified = [v for s in run.steps() for v in run.verified_drafts(s)]
    accepted = {r: sum(v.num_accepted for v in verified if v.request_id == r) for r in (outs[0].request_id,
                                                                                        outs[1].request_id)}
    assert all(n > 0 for n in accepted.values()), accepted


# -- structured output with drafts (v0.27.1: drafts cut where the grammar refuses them, every
# draft position and the bonus masked) ---------------------------------------------------------
# The copy task's answer under a regex the prompt's words fit, so prompt lookup (ngram) drafts them.
COPY_REGEX = r"[A-Za-z ,.]+"
CHOICES = ["yes, certainly", "no, never"]
YEAR_SCHEMA = {"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"],
               "additionalProperties": False}


def structured_requests(tokenizer) -> tuple[list[dict], list[SamplingParams]]:
    """A choice, a regex and a JSON schema, greedy."""
    from vllm_anatomy.sampling_params import StructuredOutputsParams
    cases = [("Is the sky blue? Answer yes or no.", StructuredOutputsParams(choice=CHOICES)),
             (COPY, StructuredOutputsParams(regex=COPY_REGEX)),
             ("In which year did the first humans land on the moon? Answer in JSON.",
              StructuredOutputsParams(json=YEAR_SCHEMA))]
    return ([{"prompt_token_ids": _chat_ids(tokenizer, q)} for q, _ in cases],
            [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so) for _, so in cases])


def check_structured(texts: list[str]) -> None:
    import json
    choice, copied, answer = texts
    assert choice in CHOICES, choice
    assert re.fullmatch(COPY_REGEX, copied), copied
    data = json.loads(answer)
    assert set(data) == {"year"} and isinstance(data["year"], int), answer


@pytest.fixture(scope="module")
def structured_without_speculation(default_model_dir, tokenizer) -> list[list[int]]:
    llm = LLM(default_model_dir, max_model_len=1024)
    outs = llm.generate(*structured_requests(tokenizer), use_tqdm=False)
    check_structured([o.outputs[0].text for o in outs])
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("method, async_scheduling", [("ngram", False), ("draft_self", False), ("draft_self", True)])
def test_structured_output_gets_drafts(default_model_dir, tokenizer, structured_without_speculation, method,
                                       async_scheduling):
    """Structured requests alone, with ngram drafts, the model as its own draft, and that with async
    scheduling (drafts on the device, the refused ones -1 before the bitmask): they get drafts and
    some are accepted (without drafts for them the counters stay at 0), the outputs hold, and they
    equal the same requests' greedy outputs without speculation, token for token."""
    llm = LLM(default_model_dir, max_model_len=1024, async_scheduling=async_scheduling,
              speculative_config=speculative_config(method, default_model_dir, ""))
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == async_scheduling
    outs = llm.generate(*structured_requests(tokenizer), use_tqdm=False)
    check_structured([o.outputs[0].text for o in outs])
    assert [list(o.outputs[0].token_ids) for o in outs] == structured_without_speculation
    m = llm.get_metrics()
    drafts, drafted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_draft_tokens"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and accepted > 0, m
    if method == "draft_self" and not async_scheduling:
        # The target agrees with its own drafts wherever the grammar let them through.
        assert accepted == drafted, m
    if async_scheduling:
        # K placeholders per verification; the drafts the grammars refused (-1s) are not counted.
        # (Drafts past a grammar's stop token, on the device, verify against all-allowed rows
        # and may count as accepted, as in v0.27.1: accepted may exceed drafted here.)
        assert drafted < K * drafts, m


# -- the Sampler's logits processors at every draft position ------------------------------------
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_repetition_penalty_equals_transformers(default_model_dir, hf_model, spec_prompts):
    """Each draft position is penalized as if the drafts before it had been sampled
    (tests/unit/test_spec_decode_penalties.py checks the bonus position and the rest)."""
    llm = LLM(default_model_dir, max_model_len=2048, speculative_config=NGRAM)
    got, _ = _engine_tokens(llm, spec_prompts, PENALTY)
    _check_equal(hf_model, spec_prompts, got, PENALTY)
    check_speculated(llm, "ngram")
    # The test can fail: the penalty changes the copy task's greedy answer.
    copy = spec_prompts[-1]
    assert hf_greedy(hf_model, copy, repetition_penalty=PENALTY) != hf_greedy(hf_model, copy)


def test_bad_words_and_penalties_equal_no_speculation(default_model_dir, spec_prompts):
    """The copy task, past its EOS (ngram drafts its next words from the prompt, then from
    the answer's own repeats): a two-token bad word from the middle of the copied sentence,
    where the drafts propose it, and presence and frequency penalties (which read only the
    output) give the same tokens with and without speculation."""
    copy = {"prompt_token_ids": spec_prompts[-1]}

    def generate(llm: LLM, cases: list[dict]) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **case) for case in cases]
        return [list(o.outputs[0].token_ids) for o in llm.generate([copy] * len(cases), params, use_tqdm=False)]

    plain_llm = LLM(default_model_dir, max_model_len=2048)
    [plain] = generate(plain_llm, [{}])
    k = 7
    a, b = plain[k - 1], plain[k]
    cases = [dict(bad_words_token_ids=[[a, b]]), dict(presence_penalty=1.0, frequency_penalty=0.5)]
    want = generate(plain_llm, cases)
    del plain_llm
    spec_llm = LLM(default_model_dir, max_model_len=2048, speculative_config=NGRAM)
    got = generate(spec_llm, cases)
    assert got == want
    check_speculated(spec_llm, "ngram")
    # The test can fail: each case changes the plain answer, and the bad word never appears.
    assert all(w != plain for w in want)
    assert want[0][:k] == plain[:k] and all((x, y) != (a, b) for x, y in zip(got[0], got[0][1:]))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_past_max_tokens_or_stop_are_not_emitted(default_model_dir, spec_prompts, async_scheduling):
    """The target drafting for itself accepts every draft, so each step verifies K drafts and
    would give K + 1 tokens; a request whose max_tokens or stop token falls inside them ends
    exactly where the engine without speculation ends it, and emits nothing past it."""
    prompt = {"prompt_token_ids": spec_prompts[0]}
    plain = LLM(default_model_dir, max_model_len=512)
    greedy = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    ref = list(greedy.outputs[0].token_ids)
    stop = ref[5]
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 6)] + \
        [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])]
    expected = [[o.outputs[0].token_ids for o in plain.generate([prompt], sp, use_tqdm=False)][0] for sp in cases]
    assert expected[:3] == [ref[:1], ref[:2], ref[:6]] and expected[3] == ref[:ref.index(stop) + 1]
    del plain
    llm = LLM(default_model_dir, max_model_len=512, async_scheduling=async_scheduling,
              speculative_config={"method": "draft_model", "model": default_model_dir, "num_speculative_tokens": K})
    for sp, want in zip(cases, expected):
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == list(want), sp
    m = llm.get_metrics()
    assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"] > 0
    assert m["vllm:generation_tokens"] == sum(len(w) for w in expected)


def test_all_drafts_rejected_still_give_the_greedy_token(default_model_dir, spec_prompts, tmp_path):
    """A 1-layer cut of the model drafts badly: the steps whose drafts are all rejected emit
    exactly one token from the bonus row (the recovered token), which is greedy's."""
    from vllm_anatomy.transformers_utils.draft_model_utils import write_truncated_draft
    draft = write_truncated_draft(default_model_dir, 1, tmp_path / "draft1")
    prompts = [{"prompt_token_ids": p} for p in spec_prompts[:3]]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(default_model_dir, max_model_len=512)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, sp, use_tqdm=False)]
    del plain
    llm = LLM(default_model_dir, max_model_len=512, enable_prefix_caching=False,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K})
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    m = llm.get_metrics()
    # Steps with every draft rejected happened (position 0's acceptances are fewer than the drafts) ...
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos:0"] < m["vllm:spec_decode_num_drafts"], m
    # ... and every verifying step emitted its accepted drafts plus exactly one token.
    assert m["vllm:generation_tokens"] == sum(len(w) for w in want)


# -- async scheduling with a draft model, beside parallel sampling, structured output, worker processes --
def async_draft_llm(default_model_dir: str, draft: str, **kwargs) -> LLM:
    """Async scheduling with a draft model (its drafts stay on the device: -1 placeholders)."""
    llm = LLM(default_model_dir, async_scheduling=True,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K}, **kwargs)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    return llm


def test_async_draft_parallel_sampling(default_model_dir, truncated_draft, spec_prompts):
    """n = 3 (ParentRequest fan-out; v0.27.1 refuses n > 1 with greedy sampling) with async scheduling
    and drafts on the device: seeded random children (a seed each) are exactly the synchronous
    engine's, token for token, and not all alike; the drafts were verified (some accepted)."""
    prompts = [{"prompt_token_ids": p} for p in spec_prompts[-2:]]
    seeded_n = SamplingParams(n=3, temperature=0.8, top_k=50, seed=7, max_tokens=MAX_TOKENS)
    config = {"method": "draft_model", "model": truncated_draft, "num_speculative_tokens": K}
    got = {}
    for async_scheduling in (False, True):
        llm = LLM(default_model_dir, max_model_len=1024, async_scheduling=async_scheduling, speculative_config=config)
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == async_scheduling
        got[async_scheduling] = [[list(c.token_ids) for c in o.outputs]
                                 for o in llm.generate(prompts, seeded_n, use_tqdm=False)]
        m = llm.get_metrics()
        assert m["vllm:spec_decode_num_accepted_tokens"] > 0, m
        del llm
    assert got[True] == got[False]
    assert all(len(o) == 3 and len({tuple(c) for c in o}) > 1 for o in got[True])


def test_async_draft_structured_output_beside_drafts(default_model_dir, hf_model, spec_prompts, tokenizer):
    """Async scheduling, a draft model and structured output (v0.27.1 runs the three together): the
    structured request's sampling waits for its previous token (pending_structured_output_tokens)
    while the copy request's drafts are verified beside it; a choice and a regex hold, the copy is
    transformers' greedy output."""
    from vllm_anatomy.sampling_params import StructuredOutputsParams
    choices = ["yes, certainly", "no, never"]
    llm = async_draft_llm(default_model_dir, default_model_dir, max_model_len=1024)
    copy = spec_prompts[-1]
    question = _chat_ids(tokenizer, "Is the sky blue? Answer yes or no.")
    year = _chat_ids(tokenizer, "In which year did the first humans land on the moon?")
    outs = llm.generate([{"prompt_token_ids": copy}, {"prompt_token_ids": question}, {"prompt_token_ids": year}],
                        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                         SamplingParams(temperature=0, max_tokens=16,
                                        structured_outputs=StructuredOutputsParams(choice=choices)),
                         SamplingParams(temperature=0, max_tokens=16,
                                        structured_outputs=StructuredOutputsParams(regex=r"19[0-9]{2}"))],
                        use_tqdm=False)
    _check_equal(hf_model, [copy], [outs[0].outputs[0].token_ids])
    assert outs[1].outputs[0].text in choices
    assert re.fullmatch(r"19[0-9]{2}", outs[2].outputs[0].text), outs[2].outputs[0].text
    check_speculated(llm, "draft_self")


def test_async_draft_worker_process_executor(default_model_dir, truncated_draft, hf_model, spec_prompts, tmp_path):
    """Async scheduling with a draft model in a worker process (distributed_executor_backend="mp"):
    a 6-layer draft, so rejections (rollbacks, recovered tokens) happen there too; the drafts each
    step verified come back in the ModelRunnerOutput through the shared-memory RPC, and the run
    store records them (real ids, no -1 placeholder left) for every step that had drafts."""
    from vllm_anatomy.tracing.reader import open_run
    llm = async_draft_llm(default_model_dir, truncated_draft, max_model_len=512, distributed_executor_backend="mp",
                          trace_level="full", trace_dir=str(tmp_path))
    try:
        got, _ = _engine_tokens(llm, spec_prompts)
        _check_equal(hf_model, spec_prompts, got)
        m = check_speculated(llm, "draft_cut")
    finally:
        llm.shutdown()
    with open_run(llm.llm_engine.recorder.run_path) as run:
        verified = [v for s in run.steps() for v in run.verified_drafts(s)]
    assert len(verified) == m["vllm:spec_decode_num_drafts"]
    assert all(t >= 0 for v in verified for t in v.draft_token_ids)
    assert sum(v.num_accepted for v in verified) == m["vllm:spec_decode_num_accepted_tokens"]

"""The scheduler features of v0.27.1 end to end through LLM, on a tiny random Llama (CPU):
prompt_logprobs against transformers, the priority policy, reset_prefix_cache with running
requests, KV cache events over ZMQ."""
from __future__ import annotations

import msgspec
import pytest
import torch
import zmq

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.config import KVEventsConfig
from vllm_anatomy.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

pytestmark = pytest.mark.slow


def token_prompt(seed: int, n: int) -> dict:
    return {"prompt_token_ids": [(seed * 37 + 11 * j) % 500 + 3 for j in range(n)]}


def test_prompt_logprobs_match_transformers_and_skip_the_prefix_cache(tiny_llama_dir):
    import transformers
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompt = token_prompt(1, 40)
    ids = prompt["prompt_token_ids"]
    llm = LLM(tiny_llama_dir, max_model_len=256, max_num_batched_tokens=16)   # 40 tokens: three chunks
    try:
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
        first, second = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    finally:
        llm.shutdown()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    plp = first.prompt_logprobs
    assert len(plp) == 40 and plp[0] is None
    for i, entry in enumerate(plp[1:]):
        token = ids[i + 1]
        assert token in entry and set(ref[i].topk(3).indices.tolist()) <= set(entry)
        assert entry[token].logprob == pytest.approx(ref[i, token].item(), abs=1e-4)
        assert entry[token].rank == int((ref[i] >= ref[i, token]).sum())
    # The same prompt again: a prefix-cache hit would skip the very tokens it must score.
    assert second.num_cached_tokens == 0
    assert [sorted(e.items()) for e in second.prompt_logprobs[1:]] == [sorted(e.items()) for e in plp[1:]]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_priority_policy_serves_lower_priority_values_first(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=256, max_num_seqs=1, scheduling_policy="priority")
    try:
        prompts = [token_prompt(i, 12) for i in range(3)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                            use_tqdm=False, priority=[5, 0, 1])
        with pytest.raises(ValueError, match="priority"):
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False, priority=[0])
    finally:
        llm.shutdown()
    first_token = {o.request_id: o.metrics.first_token_time for o in outs}
    assert sorted(first_token, key=first_token.get) == [outs[1].request_id, outs[2].request_id, outs[0].request_id]


def test_reset_prefix_cache_with_running_requests_keeps_the_outputs(tiny_llama_dir):
    prompts = [token_prompt(i, 20 + 7 * i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(reset_at: int | None) -> list[list[int]]:
        llm = LLM(tiny_llama_dir, max_model_len=256, max_num_batched_tokens=32)
        try:
            engine = llm.llm_engine
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, params)
            tokens: dict[str, list[int]] = {}
            step = 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens[out.request_id] = out.outputs[0].token_ids
                step += 1
                if step == reset_at:
                    assert not llm.reset_prefix_cache()                     # blocks are held
                    assert llm.reset_prefix_cache(reset_running_requests=True)
                    assert not engine.engine_core_client.engine_core.scheduler.running
        finally:
            llm.shutdown()
        return [tokens[str(i)] for i in range(3)]

    assert run(reset_at=4) == run(reset_at=None)


def test_kv_events_are_published_over_zmq(tiny_llama_dir, tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    llm = LLM(tiny_llama_dir, max_model_len=256, block_size=16,
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint,
                                              replay_endpoint=replay))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        prompt = token_prompt(3, 40)
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        decoder, events = msgspec.msgpack.Decoder(KVEventBatch), []
        while True:
            assert dealer.poll(10_000), "no replay"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                break
            events += decoder.decode(payload).events
    finally:
        dealer.close(linger=0)
        llm.shutdown()
    stored = [e for e in events if isinstance(e, BlockStored)]
    # The prompt's two full blocks (40 tokens of 16), as the engine hashed them.
    assert [t for e in stored for t in e.token_ids] == prompt["prompt_token_ids"][:32]
    assert all(e.block_size == 16 and e.kv_cache_spec_kind == "full_attention" for e in stored)


def test_openai_requests_carry_priority_to_the_scheduler(tiny_llama_dir):
    """vLLM's extra request field "priority", through the HTTP layer and AsyncLLM into the Request."""
    import argparse
    import asyncio

    import httpx

    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.engine.async_llm import AsyncLLM
    from vllm_anatomy.entrypoints.openai.api_server import build_app
    from vllm_anatomy.entrypoints.openai.chat_protocol import ChatCompletionRequest

    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "priority": 4}).priority == 4
    llm = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_dir, device="cpu", max_model_len=128,
                                               scheduling_policy="priority"), multiprocess=False)
    scheduler = llm.engine_core.engine_core.scheduler
    seen: list[int] = []
    add_request = scheduler.add_request

    def spy(request):
        seen.append(request.priority)
        add_request(request)
    scheduler.add_request = spy
    app = build_app(llm, argparse.Namespace(served_model_name=["tiny"], model=None, api_key=None))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            ok = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "priority": -3})
            bad = await c.post("/v1/completions", json={"prompt": [5], "max_tokens": 1, "priority": "high"})
            return ok.status_code, bad.status_code
    try:
        assert asyncio.run(run()) == (200, 400)
    finally:
        llm.shutdown()
    assert seen == [-3]                                   # the refused one never reached the engine

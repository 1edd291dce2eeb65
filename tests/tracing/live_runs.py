"""Fresh runs for the trace-shape checks (tests/tracing/test_trace_rules.py, scripts/trace_report.py).

    three_process_run(trace_dir)   the API server, EngineCoreProc and a worker behind the
                                   shared-memory ring, chat completions sent over HTTP
                                   (streamed and not, with a stop string), as `vllm-anatomy serve`
    three_process_run(trace_dir, requests=fan_out_requests)
                                   the same server, requests that fan out into several engine
                                   requests: chat with n=3, chat and completions with n=2
                                   (streamed), batched /v1/completions (n=1, and n=2)
    tensor_parallel_run(trace_dir) the offline LLM with 3 tensor-parallel ranks (gloo on a CPU)

Both at trace level full on the default model; each returns the run store's path.
"""
from __future__ import annotations

SYSTEM = "You are a concise assistant."
PROMPTS = ["What is the capital of France?", "Name three colors.", "Count from one to ten.",
           "What do bees make?"]


def chat_requests(max_tokens: int) -> list[tuple[str, dict]]:
    """Four chat completions: plain, streamed, one cut by a stop string."""
    return [("/v1/chat/completions",
             {"model": "live", "temperature": 0, "max_tokens": max_tokens,
              "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
              "stream": i % 2 == 1, **({"stop": [" "]} if i == 2 else {})})
            for i, q in enumerate(PROMPTS)]


def fan_out_requests(max_tokens: int) -> list[tuple[str, dict]]:
    """HTTP requests that each become several engine requests (one trace each all the same):
    n=3 chat, n=2 chat streamed and seeded, n=2 completions, batched completions (n=1, n=2)."""
    chat = {"model": "live", "temperature": 0.8, "max_tokens": max_tokens, "n": 3,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[0]}]}
    return [("/v1/chat/completions", chat),
            ("/v1/chat/completions", {**chat, "n": 2, "stream": True, "seed": 3}),
            ("/v1/completions", {"model": "live", "prompt": "One, two,", "max_tokens": max_tokens, "n": 2,
                                 "temperature": 0.8, "stream": True}),
            ("/v1/completions", {"model": "live", "prompt": ["The sky is", "Bees make", "Red, green,"],
                                 "max_tokens": max_tokens, "temperature": 0}),
            ("/v1/completions", {"model": "live", "prompt": ["The sky is", "Bees make"], "n": 2,
                                 "max_tokens": max_tokens, "temperature": 0.8, "stream": True})]


def three_process_run(trace_dir: str, max_tokens: int = 8, otlp_endpoint: str | None = None,
                      requests=chat_requests) -> str:
    """`requests(max_tokens)`'s (path, body) pairs sent over HTTP together (default: four chat
    completions: plain, streamed, one cut by a stop string)."""
    import asyncio
    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.tracing.factory import make_recorder
    config = EngineArgs(trace_level="full", trace_dir=trace_dir, distributed_executor_backend="mp",
                        otlp_traces_endpoint=otlp_endpoint, max_model_len=256,
                        num_gpu_blocks_override=64).create_engine_config()
    recorder = make_recorder(config, "frontend")
    asyncio.run(_serve_and_send(config, recorder, requests(max_tokens)))
    path = recorder.run_path
    recorder.shutdown()
    assert path is not None
    return path


async def _serve_and_send(config, recorder, requests: list[tuple[str, dict]]) -> None:
    """`vllm-anatomy serve` as the dashboard's live run starts it (AsyncLLM behind the OpenAI app)."""
    import asyncio
    import os
    import sys

    import httpx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from dashboard.live_engine import _start_server
    engine, server, port = _start_server(config, recorder)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            async def send(path: str, body: dict) -> None:
                r = await client.post(path, json=body)
                r.raise_for_status()
                await r.aread()
            await asyncio.gather(*(send(path, body) for path, body in requests))
    finally:
        server.should_exit = True
        await serving
        engine.shutdown()


def tensor_parallel_run(trace_dir: str, tp: int = 3, max_tokens: int = 4) -> str:
    """Two requests on `tp` ranks (the default model's 3 KV heads allow 3)."""
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(trace_level="full", trace_dir=trace_dir, tensor_parallel_size=tp, max_model_len=128,
              num_gpu_blocks_override=32)
    llm.generate(["The capital of France is", "One, two, three,"],
                 SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    path = llm.llm_engine.recorder.run_path
    llm.llm_engine.shutdown()
    assert path is not None
    return path

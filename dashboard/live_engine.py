"""The engine process of a live run; dashboard/live.py spawns it (the repo root on PYTHONPATH):

    python dashboard/live_engine.py SPEC.json STATUS.json [--wait DASHBOARD_PID]

One process: `drive(llm, spec)` adds each prompt at its arrival step and calls
`LLMEngine.step()` until all requests finish (the offline LLM.generate loop,
with arrivals spread over time so continuous batching is visible).

Three processes (`spec["processes"] == 3`): it starts the engine the way
`vllm-anatomy serve` does — the OpenAI API server (FastAPI + AsyncLLM, in this
process, on 127.0.0.1 and a free port), EngineCoreProc in its own process, the
worker behind the shared-memory ring (distributed_executor_backend="mp") — and
sends each prompt as an HTTP chat completion once the engine has committed
`arrive_step` steps (`drive_http`). All three processes write the same run store.

Either way it keeps the status file up to date (dashboard/live.py: LiveRun.status reads it).
Before the engine starts, `check_prompts` refuses a spec that one of the two ways could not
run (a prompt whose tokens and max_tokens exceed max_model_len: the API server refuses it
with a 400, as vLLM's does), in one sentence. What goes wrong later reaches the status file
as one message (a request the server refused is named with the server's own words, and the
others run on); tracebacks go to the log file only, never to the page.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

from dashboard.live import WARM_MAX_S, write_json

_stop_requested = False


def _on_sigterm(signum, frame) -> None:
    global _stop_requested
    _stop_requested = True


class SpecRefused(ValueError):
    """A live-run spec the engine would refuse: its message says which prompt and what to change."""


def _prompt_ids(tok, p: dict) -> dict:
    conv = ([{"role": "system", "content": p["system"]}] if p.get("system") else []) + \
           [{"role": "user", "content": p["text"]}]
    return {"prompt_token_ids": tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True,
                                                        return_dict=False)}


def check_prompts(tok, spec: dict, max_model_len: int) -> None:
    """Refuse a spec with a prompt that cannot get its max_tokens within max_model_len.

    NOTE: the OpenAI server refuses such a request with a 400 (as vLLM's does:
    prompt tokens + max_tokens must fit max_model_len), while the offline engine
    would run it and stop early at max_model_len. A live run must mean the same in
    one process and in three, so the spec is refused before either starts, with the
    numbers that decide it."""
    problems = []
    for i, p in enumerate(spec["prompts"]):
        n = len(_prompt_ids(tok, p)["prompt_token_ids"])
        if n + spec["max_tokens"] > max_model_len:
            text = p["text"] if len(p["text"]) <= 40 else p["text"][:40] + "…"
            problems.append(f"prompt {i + 1} (\"{text}\") has {n} tokens with its chat template, and "
                            f"{n} + max_tokens {spec['max_tokens']} = {n + spec['max_tokens']} > max_model_len "
                            f"{max_model_len}")
    if problems:
        raise SpecRefused("Not started: " + "; ".join(problems) + ". Raise max_model_len or lower max_tokens "
                          "(the API server refuses such a request with 400 Bad Request, as vLLM's does).")


def drive(llm, spec: dict, on_step=None) -> dict[str, str]:
    """Run the spec's requests through llm.llm_engine; return request id -> text."""
    from vllm_anatomy.sampling_params import SamplingParams
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"])
    pending = sorted(enumerate(spec["prompts"]), key=lambda ip: (ip[1]["arrive_step"], ip[0]))
    outputs: dict[str, str] = {}
    step = 0        # the arrival clock (it jumps ahead when nothing runs)
    done = 0        # engine steps run: what on_step reports (the run store's step count)
    while (pending or engine.has_unfinished_requests()) and not _stop_requested:
        if not engine.has_unfinished_requests():
            step = max(step, pending[0][1]["arrive_step"])   # nothing runs: jump to the next arrival
        while pending and pending[0][1]["arrive_step"] <= step:
            i, p = pending.pop(0)
            engine.add_request(str(i), _prompt_ids(tok, p), params)
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].text
        step += 1
        done += 1
        if on_step:
            on_step(done, outputs)
        if spec.get("step_delay_s"):
            time.sleep(spec["step_delay_s"])
    if _stop_requested:
        engine.abort_request(list(engine.output_processor.request_states))
    return outputs


def _committed_steps(run_path: str) -> int:
    """Steps committed to the run store so far (read-only; 0 while it cannot be read)."""
    from vllm_anatomy.tracing.reader import TraceStoreError, open_run
    try:
        with open_run(run_path) as run:
            return run.num_steps()
    except TraceStoreError:
        return 0


def drive_http(config, recorder, spec: dict, on_step=None, refused: dict[str, str] | None = None) -> dict[str, str]:
    """Serve the engine as `vllm-anatomy serve` does and send the spec's prompts over HTTP;
    return request index -> text. A request the server refuses goes into `refused` (request
    index -> the server's status and message) and the others run on. Runs its own event loop."""
    import asyncio
    return asyncio.run(_serve_and_send(config, recorder, spec, on_step, {} if refused is None else refused))


def _start_server(config, recorder):
    """AsyncLLM (EngineCoreProc in its own process) behind the OpenAI app, on 127.0.0.1 and a
    free port: (engine, server not yet serving, port). Called on the running event loop."""
    import argparse
    import socket

    import uvicorn

    from vllm_anatomy.engine.async_llm import AsyncLLM
    from vllm_anatomy.entrypoints.launcher import UvicornServer
    from vllm_anatomy.entrypoints.openai.api_server import build_app
    from vllm_anatomy.entrypoints.openai.cli_args import make_arg_parser
    engine = AsyncLLM(config, multiprocess=True, recorder=recorder)
    recorder.set_run_meta("config", run_meta_config(config))   # num_gpu_blocks, resolved by the engine
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--model", config.model_config.model])
    args.served_model_name = ["live"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = UvicornServer(uvicorn.Config(build_app(engine, args), host="127.0.0.1", port=port,
                                          log_level="warning", access_log=False))
    return engine, server, port


async def _serve_and_send(config, recorder, spec: dict, on_step, refused: dict[str, str]) -> dict[str, str]:
    import asyncio

    import httpx
    engine, server, port = _start_server(config, recorder)
    serving = asyncio.create_task(server.serve())
    outputs: dict[str, str] = {}
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            tasks = await _send_on_arrival(client, spec, recorder.run_path, outputs, refused, on_step)
            while tasks and not all(t.done() for t in tasks) and not _stop_requested:
                if on_step:
                    on_step(_committed_steps(recorder.run_path), outputs)
                await asyncio.sleep(0.1)
            for t in tasks:
                if t.done() and t.exception() is not None:
                    # the server could not be reached (a refusal is not an exception: _send_chat
                    # records it); an engine that died says why it died
                    why = getattr(getattr(engine.engine_core, "resources", None), "dead_reason", None)
                    raise RuntimeError(f"the API server did not answer ({type(t.exception()).__name__}: "
                                       f"{t.exception()})" + (f" — {why}" if why else "")) from t.exception()
    finally:
        server.should_exit = True
        await serving
        engine.shutdown()
    return outputs


async def _send_on_arrival(client, spec: dict, run_path: str, outputs: dict[str, str], refused: dict[str, str],
                           on_step) -> list:
    """Send each prompt once the engine has committed its arrive_step steps; the tasks sending them."""
    import asyncio
    pending = sorted(enumerate(spec["prompts"]), key=lambda ip: (ip[1]["arrive_step"], ip[0]))
    tasks = []
    while pending and not _stop_requested:
        steps = _committed_steps(run_path)
        while pending and pending[0][1]["arrive_step"] <= steps:
            i, p = pending.pop(0)
            tasks.append(asyncio.create_task(_send_chat(client, spec, i, p, outputs, refused)))
        if on_step:
            on_step(steps, outputs)
        # Nothing running: the next arrival comes now (as drive() jumps ahead).
        if pending and (not tasks or all(t.done() for t in tasks)):
            i, p = pending.pop(0)
            tasks.append(asyncio.create_task(_send_chat(client, spec, i, p, outputs, refused)))
        await asyncio.sleep(0.05)
    return tasks


async def _send_chat(client, spec: dict, i: int, p: dict, outputs: dict[str, str], refused: dict[str, str]) -> None:
    conv = ([{"role": "system", "content": p["system"]}] if p.get("system") else []) + \
           [{"role": "user", "content": p["text"]}]
    r = await client.post("/v1/chat/completions", json={
        "model": "live", "messages": conv, "max_tokens": spec["max_tokens"], "temperature": 0,
        "ignore_eos": spec["ignore_eos"]})
    if r.status_code != 200:
        # NOTE: one refused request never stops the others: it is recorded with the server's
        # own words (the OpenAI error body), and the run goes on.
        refused[str(i)] = f"{r.status_code} {r.reason_phrase}: {_error_message(r)}"
        return
    outputs[str(i)] = r.json()["choices"][0]["message"]["content"]


def _error_message(r) -> str:
    """The message of an OpenAI error response ({"error": {"message": ...}}), else its text."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300]


def run_meta_config(config) -> dict:
    from vllm_anatomy.tracing.factory import run_meta
    return run_meta(config)["config"]


class _Engine:
    """What drive() needs of an `LLM`: its LLMEngine and tokenizer."""

    def __init__(self, engine) -> None:
        self.llm_engine = engine

    def get_tokenizer(self):
        return self.llm_engine.tokenizer


def _wait_for_spec(spec_path: str, status_path: str, parent: int) -> bool:
    """Pre-started: import what the engine needs, then wait for the spec file (True when it
    came; False when the dashboard (pid `parent`) went away or nothing came for WARM_MAX_S)."""
    import torch  # noqa: F401
    import vllm_anatomy.engine.llm_engine  # noqa: F401
    import vllm_anatomy.tracing.otel  # noqa: F401
    from transformers import PreTrainedTokenizerFast  # noqa: F401
    write_json(status_path, {"state": "warm", "pid": os.getpid(), "t_warm_ns": time.time_ns()})
    deadline = time.monotonic() + WARM_MAX_S
    while not os.path.exists(spec_path):
        # NOTE: the dashboard's pid comes on the command line: if it died during our
        # imports, os.getppid() would already name our new parent.
        if _stop_requested or os.getppid() != parent or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def child_main(spec_path: str, status_path: str, wait_for: int | None = None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    wait = wait_for is not None
    parent = wait_for if wait_for is not None else os.getppid()     # the dashboard: if it goes, so do we
    if wait_for is not None and not _wait_for_spec(spec_path, status_path, wait_for):
        write_json(status_path, {"state": "stopped", "pid": os.getpid()})
        return 0
    status = {"state": "loading", "pid": os.getpid(), "t_process_ns": time.time_ns(), "prestarted": wait}
    write_json(status_path, status)
    recorder = None
    try:
        with open(spec_path) as f:
            spec = json.load(f)
        from vllm_anatomy.engine.arg_utils import EngineArgs, teaching_attention_backend
        from vllm_anatomy.tracing.factory import make_recorder
        three = spec.get("processes") == 3
        engine_args = {"attention_backend": teaching_attention_backend(), **spec["engine_args"],
                       **({"distributed_executor_backend": "mp"} if three else {})}
        config = EngineArgs(model=spec.get("model"), trace_level="full", trace_dir=spec["trace_dir"],
                            **engine_args).create_engine_config()
        from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
        check_prompts(get_tokenizer(config.model_config.model), spec, config.model_config.max_model_len)
        # NOTE: the recorder (and with it the run store) is made before the engine,
        # as LLMEngine would make it, so the page can follow the start-up spans
        # (load model, KV cache, warm-up) while the engine is still being built.
        recorder = make_recorder(config, "frontend")
        if spec.get("pair"):        # one side of a pair (views/compare.py): which knob, which side
            recorder.set_run_meta("pair", spec["pair"])
        status.update(run_path=recorder.run_path, t_imported_ns=time.time_ns())
        write_json(status_path, status)
        run = _run_three_processes if three else _run_in_process
        run(config, recorder, spec, status, status_path, parent)
        return 0
    except BaseException as e:   # noqa: BLE001 - reported to the UI, then re-raised as an exit code
        # NOTE: the page gets one message; the traceback goes to the log (this process's stdout).
        traceback.print_exc(file=sys.stdout)
        sys.stdout.flush()
        status.update(state="error", error=str(e) if isinstance(e, SpecRefused) else f"{type(e).__name__}: {e}")
        if recorder is not None and recorder.run_path is not None:
            status["step"] = _committed_steps(recorder.run_path)     # what the page can show, not an older count
        write_json(status_path, status)
        if recorder is not None:
            recorder.shutdown()
        return 1


def _status_writer(status: dict, status_path: str, parent: int, **fields):
    """on_step for drive / drive_http: the step and outputs into the status file; a stop
    requested when the dashboard (pid `parent`) went away: do not run on as an orphan."""
    def on_step(step: int, outputs: dict[str, str]) -> None:
        global _stop_requested
        if os.getppid() != parent:
            _stop_requested = True
        status.update(step=step, outputs=outputs, **fields)
        write_json(status_path, status)
    return on_step


def _run_three_processes(config, recorder, spec: dict, status: dict, status_path: str, parent: int) -> None:
    refused: dict[str, str] = {}      # filled by drive_http, written with every status update
    status["refused"] = refused
    outputs = drive_http(config, recorder, spec, _status_writer(status, status_path, parent, state="running"),
                         refused)
    recorder.shutdown()
    status.update(state="stopped" if _stop_requested else "done", outputs=outputs,
                  step=_committed_steps(recorder.run_path))
    write_json(status_path, status)


def _run_in_process(config, recorder, spec: dict, status: dict, status_path: str, parent: int) -> None:
    from vllm_anatomy.engine.llm_engine import LLMEngine
    from vllm_anatomy.tracing.factory import run_meta
    llm = _Engine(LLMEngine(config, recorder))
    recorder.set_run_meta("config", run_meta(config)["config"])   # resolved at start-up (num_gpu_blocks)
    status.update(state="running")
    write_json(status_path, status)
    drive(llm, spec, _status_writer(status, status_path, parent))
    llm.llm_engine.shutdown()
    recorder.shutdown()
    status.update(state="stopped" if _stop_requested else "done", step=_committed_steps(recorder.run_path))
    write_json(status_path, status)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1], sys.argv[2], int(sys.argv[4]) if sys.argv[3:4] == ["--wait"] else None))

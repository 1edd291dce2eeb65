"""A live engine in a background process, writing a run store at trace level "full".

Parent side (the Streamlit session): `LiveRun.start(spec, trace_dir)` spawns

    python dashboard/live.py SPEC.json STATUS.json

and `LiveRun.status()` reads the status file the child keeps up to date
({"state": loading|running|done|stopped|error, "run_path", "step", "outputs", "error"}).
A child that dies without saying why (killed, segfault) is reported as "crashed"
with the tail of its log. The UI never waits on the child: it reads the run
store, which is committed step by step.

Child side: `drive(llm, spec)` adds each prompt at its arrival step and calls
`LLMEngine.step()` until all requests finish (the offline LLM.generate loop,
with arrivals spread over time so continuous batching is visible).

Three processes (`spec["processes"] == 3`): the child starts the engine the way
`vllm-anatomy serve` does — the OpenAI API server (FastAPI + AsyncLLM, in the
child, on 127.0.0.1 and a free port), EngineCoreProc in its own process, the
worker behind the shared-memory ring (distributed_executor_backend="mp") — and
sends each prompt as an HTTP chat completion once the engine has committed
`arrive_step` steps (`drive_http`). All three processes write the same run store.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIVE_DIR = ".live"   # under trace_dir: spec, status and log files of live runs

# Start-up stages, each ended by what the run store (or the status file) records:
# (name, what happens, the mark that ends it). Marks: "store" = the run store exists
# (meta start_time_ns), a span name = that start-up span ended (its end_ns),
# "first_step" = the first step's "step" snapshot is committed.
STARTUP_STAGES = [
    ("start process", "Python starts, imports torch and the engine (ahead of time, while the landing page "
                      "was open, when it could), creates the run store", "store"),
    ("load model", "tokenizer, Worker.init_device, GPUModelRunner.load_model: the weights into memory",
     "GPUModelRunner.load_model"),
    ("allocate KV cache", "GPUModelRunner.determine_num_available_blocks, then initialize_kv_cache",
     "GPUModelRunner.initialize_kv_cache"),
    ("warm up", "Worker.compile_or_warm_up_model (Triton JIT and CUDA-graph capture on a GPU; "
                "nothing to compile on a CPU), the scheduler", "EngineCore.__init__"),
    ("first step", "the first requests arrive, EngineCore.step runs and is committed", "first_step"),
]
STARTUP_SPANS = [mark for _, _, mark in STARTUP_STAGES if mark not in ("store", "first_step")]


def startup_stages(t_start_ns: int, marks: dict[str, int], now_ns: int) -> list[dict]:
    """Each stage: name, what, state (done | running | waiting) and seconds (taken, or
    so far). A stage counts as done once its own mark or any later one is known."""
    ends = [marks.get(mark) for _, _, mark in STARTUP_STAGES]
    out, prev, running_seen = [], t_start_ns, False
    for i, (name, what, _) in enumerate(STARTUP_STAGES):
        end = ends[i]
        if end is None and any(e is not None for e in ends[i + 1:]):
            end = next(e for e in ends[i + 1:] if e is not None)
        if end is not None:
            out.append({"name": name, "what": what, "state": "done", "seconds": max(0.0, (end - prev) / 1e9)})
            prev = end
        elif not running_seen:
            running_seen = True
            out.append({"name": name, "what": what, "state": "running", "seconds": max(0.0, (now_ns - prev) / 1e9)})
        else:
            out.append({"name": name, "what": what, "state": "waiting", "seconds": None})
    return out


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)   # readers never see a half-written file


def _child_env() -> dict:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # NOTE: one intra-op thread unless the user chose (as the lessons do): a live
    # run's batches are small, and on a small CPU shared with the dashboard (and
    # anything else) torch's spinning threads made the first step several times slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _spawn(trace_dir: str, wait: bool) -> tuple[subprocess.Popen, str, str, str]:
    """An engine child: (process, spec path, status path, log path). With wait, it imports
    torch and the engine, then waits for its spec file (prewarm)."""
    live_dir = os.path.join(trace_dir, LIVE_DIR)
    os.makedirs(live_dir, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    spec_path, status_path, log_path = (os.path.join(live_dir, f"{token}.{ext}")
                                        for ext in ("spec.json", "status.json", "log"))
    _write_json(status_path, {"state": "starting"})
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), spec_path, status_path]
                                + (["--wait", str(os.getpid())] if wait else []),
                                stdout=log, stderr=subprocess.STDOUT, env=_child_env(), cwd=REPO_ROOT,
                                start_new_session=True)
    return proc, spec_path, status_path, log_path


# -- a pre-started engine process ----------------------------------------------------------------
# NOTE: importing torch and the engine is most of a live run's start-up on a small CPU
# (the "start process" stage). While the landing page is open, one engine process per
# dashboard server does that ahead of time and waits for a spec; Start hands it one.
# It exits by itself when the dashboard goes away (its parent changes), after WARM_MAX_S
# without a spec, or at the dashboard's exit.
WARM_MAX_S = 600.0
PREWARM_ENV = "VLLM_ANATOMY_PREWARM"       # "0": never pre-start an engine process
_warm: dict | None = None
_warm_lock = threading.Lock()


def prewarm(trace_dir: str) -> None:
    """Pre-start an engine process for the next live run (one per dashboard process)."""
    global _warm
    if os.environ.get(PREWARM_ENV, "1") == "0":
        return
    trace_dir = os.path.abspath(trace_dir)
    with _warm_lock:
        if _warm is not None and _warm["proc"].poll() is None and _warm["trace_dir"] == trace_dir:
            return
        _discard_warm()
        proc, spec_path, status_path, log_path = _spawn(trace_dir, wait=True)
        _warm = {"proc": proc, "spec_path": spec_path, "status_path": status_path, "log_path": log_path,
                 "trace_dir": trace_dir}


def _take_warm(trace_dir: str) -> dict | None:
    global _warm
    with _warm_lock:
        w, _warm = _warm, None
    if w is None or w["proc"].poll() is not None or w["trace_dir"] != os.path.abspath(trace_dir):
        if w is not None:
            _stop_proc(w["proc"])
        return None
    return w


def _discard_warm() -> None:
    global _warm
    w, _warm = _warm, None
    if w is not None:
        _stop_proc(w["proc"])


def _stop_proc(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


atexit.register(lambda: _discard_warm())


class LiveRun:
    """Handle on one engine child process (kept in st.session_state)."""

    def __init__(self, proc: subprocess.Popen, status_path: str, log_path: str, spec: dict,
                 t_start_ns: int | None = None) -> None:
        self.proc, self.status_path, self.log_path, self.spec = proc, status_path, log_path, spec
        self.t_start_ns = t_start_ns or time.time_ns()     # when Start was pressed (the process spawned)

    @classmethod
    def start(cls, spec: dict, trace_dir: str) -> "LiveRun":
        """Run `spec` in the pre-started engine process if there is one, else in a new one."""
        spec = {**spec, "trace_dir": os.path.abspath(trace_dir)}
        t_start_ns = time.time_ns()
        warm = _take_warm(trace_dir)
        if warm is not None:
            _write_json(warm["spec_path"], spec)          # atomic: the child sees all of it or nothing
            return cls(warm["proc"], warm["status_path"], warm["log_path"], spec, t_start_ns)
        proc, spec_path, status_path, log_path = _spawn(trace_dir, wait=False)
        _write_json(spec_path, spec)
        return cls(proc, status_path, log_path, spec, t_start_ns)

    def status(self) -> dict:
        try:
            with open(self.status_path) as f:
                st = json.load(f)
        except (OSError, ValueError):
            st = {"state": "starting"}
        rc = self.proc.poll()
        st["returncode"] = rc
        if rc is not None and st["state"] in ("starting", "warm", "loading", "running"):
            st["state"] = "crashed"
            st["error"] = f"the engine process exited with code {rc}.\n" + self.log_tail()
        return st

    def startup(self, status: dict | None = None, marks: dict[str, int] | None = None) -> list[dict]:
        """The start-up stages so far (startup_stages), from the run store's start-up spans."""
        status = status if status is not None else self.status()
        marks = dict(marks or {})
        if status.get("t_imported_ns"):
            marks.setdefault("store", status["t_imported_ns"])
        end = None if status.get("returncode") is None else time.time_ns()
        return startup_stages(self.t_start_ns, marks, end or time.time_ns())

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop after the current step (SIGTERM); kill it if it hangs."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- child side ------------------------------------------------------------------------------
_stop_requested = False


def _on_sigterm(signum, frame) -> None:
    global _stop_requested
    _stop_requested = True


def _prompt_ids(tok, p: dict) -> dict:
    conv = ([{"role": "system", "content": p["system"]}] if p.get("system") else []) + \
           [{"role": "user", "content": p["text"]}]
    return {"prompt_token_ids": tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True,
                                                        return_dict=False)}


def drive(llm, spec: dict, on_step=None) -> dict[str, str]:
    """Run the spec's requests through llm.llm_engine; return request id -> text."""
    from vllm_anatomy.sampling_params import SamplingParams
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"])
    pending = sorted(enumerate(spec["prompts"]), key=lambda ip: (ip[1]["arrive_step"], ip[0]))
    outputs: dict[str, str] = {}
    step = 0
    while (pending or engine.has_unfinished_requests()) and not _stop_requested:
        if not engine.has_unfinished_requests():
            step = max(step, pending[0][1]["arrive_step"])   # nothing runs: jump to the next arrival
        while pending and pending[0][1]["arrive_step"] <= step:
            i, p = pending.pop(0)
            engine.add_request(str(i), _prompt_ids(tok, p), params)
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].text
        step += 1
        if on_step:
            on_step(step, outputs)
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


def drive_http(config, recorder, spec: dict, on_step=None) -> dict[str, str]:
    """Serve the engine as `vllm-anatomy serve` does and send the spec's prompts over HTTP;
    return request index -> text. Runs its own event loop."""
    import argparse
    import asyncio
    import socket

    import httpx
    import uvicorn

    from vllm_anatomy.engine.async_llm import AsyncLLM
    from vllm_anatomy.entrypoints.openai.api_server import UvicornServer, build_app
    from vllm_anatomy.entrypoints.openai.cli_args import make_arg_parser

    async def main() -> dict[str, str]:
        engine = AsyncLLM(config, multiprocess=True, recorder=recorder)
        recorder.set_run_meta("config", run_meta_config(config))   # num_gpu_blocks, resolved by the engine
        args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--model", config.model_config.model])
        args.served_model_name = ["live"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = UvicornServer(uvicorn.Config(build_app(engine, args), host="127.0.0.1", port=port,
                                              log_level="warning", access_log=False))
        serving = asyncio.create_task(server.serve())
        outputs: dict[str, str] = {}
        try:
            while not server.started:
                await asyncio.sleep(0.02)
            pending = sorted(enumerate(spec["prompts"]), key=lambda ip: (ip[1]["arrive_step"], ip[0]))

            async def send(client: httpx.AsyncClient, i: int, p: dict) -> None:
                conv = ([{"role": "system", "content": p["system"]}] if p.get("system") else []) + \
                       [{"role": "user", "content": p["text"]}]
                r = await client.post("/v1/chat/completions", json={
                    "model": "live", "messages": conv, "max_tokens": spec["max_tokens"], "temperature": 0,
                    "ignore_eos": spec["ignore_eos"]})
                r.raise_for_status()
                outputs[str(i)] = r.json()["choices"][0]["message"]["content"]

            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                tasks = []
                while pending and not _stop_requested:
                    steps = _committed_steps(recorder.run_path)
                    while pending and pending[0][1]["arrive_step"] <= steps:
                        i, p = pending.pop(0)
                        tasks.append(asyncio.create_task(send(client, i, p)))
                    if on_step:
                        on_step(steps, outputs)
                    # Nothing running: the next arrival comes now (as drive() jumps ahead).
                    if pending and (not tasks or all(t.done() for t in tasks)):
                        i, p = pending.pop(0)
                        tasks.append(asyncio.create_task(send(client, i, p)))
                    await asyncio.sleep(0.05)
                while tasks and not all(t.done() for t in tasks) and not _stop_requested:
                    if on_step:
                        on_step(_committed_steps(recorder.run_path), outputs)
                    await asyncio.sleep(0.1)
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        # say why the server refused (an engine that died says why it died)
                        why = getattr(getattr(engine.engine_core, "resources", None), "dead_reason", None)
                        raise RuntimeError(f"{t.exception()}" + (f" — {why}" if why else "")) from t.exception()
        finally:
            server.should_exit = True
            await serving
            engine.shutdown()
        return outputs

    return asyncio.run(main())


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
    _write_json(status_path, {"state": "warm", "pid": os.getpid(), "t_warm_ns": time.time_ns()})
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
    parent = wait_for if wait else os.getppid()     # the dashboard: if it goes, so do we
    if wait and not _wait_for_spec(spec_path, status_path, wait_for):
        _write_json(status_path, {"state": "stopped", "pid": os.getpid()})
        return 0
    status = {"state": "loading", "pid": os.getpid(), "t_process_ns": time.time_ns(), "prestarted": wait}
    _write_json(status_path, status)
    recorder = None
    try:
        with open(spec_path) as f:
            spec = json.load(f)
        from vllm_anatomy.engine.arg_utils import EngineArgs
        from vllm_anatomy.engine.llm_engine import LLMEngine
        from vllm_anatomy.tracing.factory import make_recorder, run_meta
        three = spec.get("processes") == 3
        engine_args = {**spec["engine_args"], **({"distributed_executor_backend": "mp"} if three else {})}
        config = EngineArgs(model=spec.get("model"), trace_level="full", trace_dir=spec["trace_dir"],
                            **engine_args).create_engine_config()
        # NOTE: the recorder (and with it the run store) is made before the engine,
        # as LLMEngine would make it, so the page can follow the start-up spans
        # (load model, KV cache, warm-up) while the engine is still being built.
        recorder = make_recorder(config, "frontend")
        status.update(run_path=recorder.run_path, t_imported_ns=time.time_ns())
        _write_json(status_path, status)
        if three:
            def on_http_step(step, outputs):
                global _stop_requested
                if os.getppid() != parent:
                    _stop_requested = True
                status.update(state="running", step=step, outputs=outputs)
                _write_json(status_path, status)
            outputs = drive_http(config, recorder, spec, on_http_step)
            recorder.shutdown()
            status.update(state="stopped" if _stop_requested else "done", outputs=outputs,
                          step=_committed_steps(recorder.run_path))
            _write_json(status_path, status)
            return 0
        llm = _Engine(LLMEngine(config, recorder))
        recorder.set_run_meta("config", run_meta(config)["config"])   # resolved at start-up (num_gpu_blocks)
        status.update(state="running")
        _write_json(status_path, status)

        def on_step(step, outputs):
            global _stop_requested
            if os.getppid() != parent:   # the dashboard went away: do not run on as an orphan
                _stop_requested = True
            status.update(step=step, outputs=outputs)
            _write_json(status_path, status)

        drive(llm, spec, on_step)
        llm.llm_engine.shutdown()
        recorder.shutdown()
        status.update(state="stopped" if _stop_requested else "done")
        _write_json(status_path, status)
        return 0
    except BaseException as e:   # noqa: BLE001 - reported to the UI, then re-raised as an exit code
        status.update(state="error", error=f"{type(e).__name__}: {e}\n\n{traceback.format_exc()[-3000:]}")
        _write_json(status_path, status)
        if recorder is not None:
            recorder.shutdown()
        return 1


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    sys.exit(child_main(sys.argv[1], sys.argv[2], int(sys.argv[4]) if sys.argv[3:4] == ["--wait"] else None))

"""A live engine in a background process, writing a run store at trace level "full".

Parent side (the Streamlit session): `LiveRun.start(spec, trace_dir)` spawns

    python dashboard/live_engine.py SPEC.json STATUS.json

and `LiveRun.status()` reads the status file the child keeps up to date
({"state": loading|running|done|stopped|error, "run_path", "step", "outputs", "error"}).
A child that dies without saying why (killed, segfault) is reported as "crashed"
with the tail of its log. The UI never waits on the child: it reads the run
store, which is committed step by step.

Child side: dashboard/live_engine.py (the engine process: it drives the
requests in one process, or serves them over HTTP from three).
"""
from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIVE_DIR = ".live"   # under trace_dir: spec, status and log files of live runs
ENGINE_SCRIPT = os.path.join(REPO_ROOT, "dashboard", "live_engine.py")

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


def write_json(path: str, data: dict) -> None:
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
    write_json(status_path, {"state": "starting"})
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, ENGINE_SCRIPT, spec_path, status_path]
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


def last_error_line(log: str) -> str | None:
    """The line of a log that says what went wrong (a traceback's closing `SomeError: ...` line),
    else its last non-empty line; None for an empty log. The page shows this line, never the
    traceback (the log file keeps it)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?", ln)]
    return (errors or lines)[-1] if lines else None


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
            write_json(warm["spec_path"], spec)          # atomic: the child sees all of it or nothing
            return cls(warm["proc"], warm["status_path"], warm["log_path"], spec, t_start_ns)
        proc, spec_path, status_path, log_path = _spawn(trace_dir, wait=False)
        write_json(spec_path, spec)
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
            last = last_error_line(self.log_tail())
            st["error"] = f"the engine process exited with code {rc}" + (f". The last it said: {last}" if last else
                                                                         " without a word.")
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

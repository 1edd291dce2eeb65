"""`vllm-anatomy dashboard`: the Streamlit dashboard, served headless.

    vllm-anatomy dashboard [--trace-dir DIR] [--port 8501] [--host 127.0.0.1] [--run RUN] [--step N]

Runs `streamlit run dashboard/app.py` from the repository checkout this package is
installed from (editable install: the dashboard is not part of the package), with
VLLM_ANATOMY_TRACE_DIR set, and prints the URL (a deep link when --run is given).

--port defaults to $STREAMLIT_SERVER_PORT (Streamlit's own variable), else 8501.
--run takes a run's file name or path; the URL names it by file name (the dashboard
opens runs by name only, from its trace directory, the lessons folder under it and
the shipped samples). A path elsewhere becomes the trace directory when --trace-dir
is not given.

SIGTERM, SIGINT (Ctrl-C) and SIGHUP stop the Streamlit child too: it runs in a
process group of its own, which gets SIGTERM, then SIGKILL after a grace period.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.parse

from vllm_anatomy.tracing.factory import DEFAULT_TRACE_DIR

PORT_ENV = "STREAMLIT_SERVER_PORT"
STOP_GRACE_S = 5.0


def dashboard_app() -> str:
    """dashboard/app.py next to the vllm_anatomy package (the repository root)."""
    import vllm_anatomy
    root = os.path.dirname(os.path.dirname(os.path.abspath(vllm_anatomy.__file__)))
    app = os.path.join(root, "dashboard", "app.py")
    if not os.path.isfile(app):
        raise FileNotFoundError(f"{app} not found: the dashboard runs from a checkout of the repository "
                                f"(pip install -e .), not from an installed wheel")
    return app


def default_port() -> int:
    try:
        return int(os.environ.get(PORT_ENV, "") or 8501)
    except ValueError:
        return 8501


def run_dirs(trace_dir: str) -> list[str]:
    """Where the dashboard looks a run name up (dashboard/state.py: run_dirs)."""
    root = os.path.dirname(os.path.dirname(dashboard_app()))
    lessons = os.environ.get("VLLM_ANATOMY_LESSON_TRACE_DIR") or os.path.join(trace_dir, "lessons")
    samples = os.environ.get("VLLM_ANATOMY_SAMPLES_DIR") or os.path.join(root, "samples")
    return [os.path.abspath(d) for d in (trace_dir, lessons, samples)]


def run_param(run: str | None, trace_dir: str) -> str | None:
    """The run's name for the URL: its file name. A path must be in one of the dashboard's
    run directories (ValueError otherwise: the dashboard would refuse it)."""
    if not run:
        return None
    if os.sep not in run and "/" not in run:
        return run
    path = os.path.abspath(run)
    if os.path.dirname(path) not in run_dirs(os.path.abspath(trace_dir)):
        raise ValueError(f"{run} is not in the dashboard's run directories ({', '.join(run_dirs(trace_dir))}): "
                         f"pass --trace-dir {os.path.dirname(path)}")
    return os.path.basename(path)


def url_for(host: str, port: int, run: str | None, step: int | None, page: str | None) -> str:
    query = {k: v for k, v in (("run", run), ("page", page),
                               ("step", None if step is None else str(step))) if v}
    path = f"/{page}" if page else "/"
    return f"http://{host}:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")


def streamlit_cmd(app: str, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", app, "--server.headless", "true",
            "--server.address", host, "--server.port", str(port),
            "--browser.gatherUsageStats", "false", "--client.toolbarMode", "minimal"]


def serve(cmd: list[str], env: dict, cwd: str) -> int:
    """Run the Streamlit child until it exits or we are told to stop; never leave it behind.

    NOTE: the handler only signals the child's process group (SIGTERM; SIGKILL for a
    second signal); the waiting is done here, with a timeout: a handler that waited on
    the child itself would deadlock with the wait it interrupted."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True)
    stopping: list[float] = []

    def on_signal(signum, frame):
        _signal_group(proc, signal.SIGKILL if stopping else signal.SIGTERM)
        stopping.append(time.monotonic())

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        rc = None
        while rc is None:
            try:
                rc = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() - stopping[0] > STOP_GRACE_S:
                    _signal_group(proc, signal.SIGKILL)
    finally:
        if proc.poll() is None:          # an exception here: do not leave the child running
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        for s, h in old.items():
            signal.signal(s, h)
    return 0 if stopping else rc


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's process group (Streamlit and anything it started)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _run(args: argparse.Namespace) -> int:
    app = dashboard_app()
    trace_dir = args.trace_dir
    if args.run and (os.sep in args.run or "/" in args.run) and trace_dir is None:
        trace_dir = os.path.dirname(os.path.abspath(args.run))   # open a run stored anywhere: list its folder
    trace_dir = os.path.abspath(trace_dir or DEFAULT_TRACE_DIR)
    try:
        name = run_param(args.run, trace_dir)
    except ValueError as e:
        print(f"[vllm-anatomy] {e}", file=sys.stderr)
        return 2
    env = {**os.environ, "VLLM_ANATOMY_TRACE_DIR": trace_dir}
    page = args.page or ("inspector" if args.run else None)
    print(f"[vllm-anatomy] dashboard on {url_for(args.host, args.port, name, args.step, page)} "
          f"(runs from {trace_dir}; Ctrl-C stops it)", flush=True)
    return serve(streamlit_cmd(app, args.host, args.port), env, os.path.dirname(os.path.dirname(app)))


def add_parser(sub) -> None:
    p = sub.add_parser("dashboard", help="the Streamlit dashboard (live runs and recorded runs)")
    p.add_argument("--trace-dir", default=None,
                   help=f"where run stores are (and live runs go); default {DEFAULT_TRACE_DIR}")
    p.add_argument("--port", type=int, default=default_port(), help=f"default ${PORT_ENV}, else 8501")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--run", help="open this run (a file name under --trace-dir, or a path)")
    p.add_argument("--step", type=int, help="open this step of --run")
    p.add_argument("--page", choices=["live", "timeline", "inspector", "journey", "metrics", "lessons"])


def run(args: argparse.Namespace) -> int:
    return _run(args)

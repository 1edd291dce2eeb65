"""`vllm-anatomy dashboard`: the Streamlit dashboard, served headless.

    vllm-anatomy dashboard [--trace-dir DIR] [--port 8501] [--host 127.0.0.1] [--run RUN] [--step N]

Runs `streamlit run dashboard/app.py` from the repository checkout this package is
installed from (editable install: the dashboard is not part of the package), with
VLLM_ANATOMY_TRACE_DIR set, and prints the URL (a deep link when --run is given).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import urllib.parse

from vllm_anatomy.tracing.factory import DEFAULT_TRACE_DIR


def dashboard_app() -> str:
    """dashboard/app.py next to the vllm_anatomy package (the repository root)."""
    import vllm_anatomy
    root = os.path.dirname(os.path.dirname(os.path.abspath(vllm_anatomy.__file__)))
    app = os.path.join(root, "dashboard", "app.py")
    if not os.path.isfile(app):
        raise FileNotFoundError(f"{app} not found: the dashboard runs from a checkout of the repository "
                                f"(pip install -e .), not from an installed wheel")
    return app


def run_param(run: str | None, trace_dir: str) -> str | None:
    """A run under trace_dir is named by its file name, any other by its absolute path."""
    if not run or os.sep not in run:
        return run
    path = os.path.abspath(run)
    return os.path.basename(path) if os.path.dirname(path) == trace_dir else path


def url_for(host: str, port: int, run: str | None, step: int | None, page: str | None) -> str:
    query = {k: v for k, v in (("run", run), ("page", page),
                               ("step", None if step is None else str(step))) if v}
    path = f"/{page}" if page else "/"
    return f"http://{host}:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")


def _run(args: argparse.Namespace) -> int:
    app = dashboard_app()
    trace_dir = os.path.abspath(args.trace_dir)
    env = {**os.environ, "VLLM_ANATOMY_TRACE_DIR": trace_dir}
    cmd = [sys.executable, "-m", "streamlit", "run", app, "--server.headless", "true",
           "--server.address", args.host, "--server.port", str(args.port),
           "--browser.gatherUsageStats", "false"]
    page = args.page or ("inspector" if args.run else None)
    print(f"[vllm-anatomy] dashboard on {url_for(args.host, args.port, run_param(args.run, trace_dir), args.step, page)} "
          f"(runs from {trace_dir}; Ctrl-C stops it)", flush=True)
    try:
        return subprocess.call(cmd, env=env, cwd=os.path.dirname(os.path.dirname(app)))
    except KeyboardInterrupt:
        return 0


def add_parser(sub) -> None:
    p = sub.add_parser("dashboard", help="the Streamlit dashboard (live runs and recorded runs)")
    p.add_argument("--trace-dir", default=DEFAULT_TRACE_DIR, help="where run stores are (and live runs go)")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--run", help="open this run (a file name under --trace-dir)")
    p.add_argument("--step", type=int, help="open this step of --run")
    p.add_argument("--page", choices=["live", "timeline", "inspector", "journey", "metrics", "lessons"])


def run(args: argparse.Namespace) -> int:
    return _run(args)

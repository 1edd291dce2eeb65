"""Lesson 7 — the call chain from an HTTP request to the model forward, across three processes.

What it teaches
    `vllm-anatomy serve --distributed-executor-backend mp` runs three kinds of process:
    the API server (FastAPI + AsyncLLM: tokenize, detokenize), EngineCoreProc (the scheduler
    loop, reached over ZMQ) and a worker process (the model runner, reached over a
    shared-memory ring buffer). No Python frame spans two of them: each hop is a message.
    The lesson starts such a server on a free port with tracing at level "full", sends one
    chat request carrying a W3C `traceparent`, stops the server (and every child), exports
    the run store with the export CLI to Jaeger JSON and Perfetto JSON, and walks the chain
    in the exported files:

        HTTP span -> llm_request ~> EngineCore.add_request          (request's trace; ~>: follows
                                                                     from, nothing waits for it)
        EngineCore.step (linked to llm_request) -> Scheduler.schedule
            -> Executor.execute_model -> Worker.execute_model
            -> GPUModelRunner.execute_model -> GPUModelRunner._model_forward   (step's trace)

    checking the process of each hop in both exports and that the client's trace id is kept.

Run
    python lessons/07_call_chain.py      # about 20-40 s on 2 CPU cores (three processes start)
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402
import psutil  # noqa: E402
from _common import LESSON_TRACE_DIR, Stopwatch, check, dashboard_link, open_run, say, title  # noqa: E402
from vllm_anatomy.engine.arg_utils import teaching_attention_backend  # noqa: E402

# The `vllm-anatomy` entry point, run with this interpreter.
_CLI = "import sys; from vllm_anatomy.entrypoints.cli.main import main; sys.exit(main(sys.argv[1:]))"
QUESTION = "In one sentence, what is a GPU?"
MAX_TOKENS = 4

# The step's trace, hop by hop: (span name, its parent's name, the process kind it runs in).
STEP_CHAIN = [("EngineCore.step", None, "engine_core"),
              ("Scheduler.schedule", "EngineCore.step", "engine_core"),
              ("Executor.execute_model", "EngineCore.step", "engine_core"),
              ("Worker.execute_model", "Executor.execute_model", "worker"),
              ("GPUModelRunner.execute_model", "Worker.execute_model", "worker"),
              ("GPUModelRunner._model_forward", "GPUModelRunner.execute_model", "worker")]



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm-anatomy serve` as a child process; stop() ends it and every process it started."""

    def __init__(self, trace_dir: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-c", _CLI, "serve", "--port", str(self.port), "--max-model-len", "512",
               "--trace-level", "full", "--trace-dir", trace_dir, "--distributed-executor-backend", "mp",
               "--attention-backend", teaching_attention_backend(),
               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        # NOTE: three processes share the machine's cores: one intra-op thread each.
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(cmd, env=env)
        self.family: dict[int, str] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} while starting")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s")

    def processes(self) -> dict[int, str]:
        """pid -> command line head of the server and all its descendants (while they run)."""
        root = psutil.Process(self.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                self.family[p.pid] = " ".join(p.cmdline())[:300]
            except psutil.NoSuchProcess:
                pass
        return self.family

    def stop(self) -> None:
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.terminate()          # SIGTERM: the server shuts its engine and worker down
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for child in children:             # anything left (a hung engine, the resource tracker)
            try:
                child.wait(timeout=10)
            except psutil.TimeoutExpired:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def serving_and_helpers(family: dict[int, str]) -> tuple[list[int], list[int]]:
    """The server's processes split into the three that serve (API server, engine core, worker) and
    Python's helpers (multiprocessing's resource tracker: it only tracks shared memory to clean up)."""
    helpers = [pid for pid, cmd in family.items() if "resource_tracker" in cmd or "semaphore_tracker" in cmd]
    return [pid for pid in family if pid not in helpers], helpers


def export(run_path: str, fmt: str, out: str) -> dict:
    subprocess.run([sys.executable, "-c", _CLI, "export", run_path, "--format", fmt, "-o", out], check=True)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    title("Lesson 7 — from HTTP to the model forward, across three processes")
    os.makedirs(LESSON_TRACE_DIR, exist_ok=True)
    trace_dir = tempfile.mkdtemp(prefix="serve-", dir=LESSON_TRACE_DIR)
    client_trace_id = secrets.token_hex(16)
    traceparent = f"00-{client_trace_id}-{secrets.token_hex(8)}-01"

    server = Server(trace_dir)
    try:
        with Stopwatch() as startup:
            server.wait_healthy()
        family = server.processes()
        with Stopwatch() as request_time:
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=180, headers={"traceparent": traceparent},
                           json={"messages": [{"role": "user", "content": QUESTION}],
                                 "max_tokens": MAX_TOKENS, "temperature": 0})
        r.raise_for_status()
        answer = r.json()
    finally:
        server.stop()                      # every process flushes its spans as it exits
    leftovers = [pid for pid in family if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    [run_path] = [os.path.join(trace_dir, f) for f in os.listdir(trace_dir) if f.endswith(".sqlite")]

    serving, helpers = serving_and_helpers(family)
    extra = (f" (plus {len(helpers)} helper of Python's multiprocessing, its resource tracker, which only "
             "cleans up shared memory)" if helpers else "")
    say(f"""The server started in {startup.seconds:.1f} s as {len(serving)} processes{extra}, answered one
        chat request ({answer['usage']['prompt_tokens']} prompt tokens, {answer['usage']['completion_tokens']}
        generated: {answer['choices'][0]['message']['content']!r}) in {request_time.seconds:.2f} s,
        and was stopped. The request carried traceparent {traceparent}. All three processes wrote
        spans into one run store; we export it with the CLI, as a learner would.""")
    check(len(serving) == 3, f"three serving processes (API server, EngineCoreProc, worker): pids {serving}"
          + (f"; {len(helpers)} multiprocessing helper besides" if helpers else ""))
    check(not leftovers, f"the server and all {len(family) - 1} of its child processes are gone")

    jaeger_path = os.path.join(trace_dir, "run.jaeger.json")
    perfetto_path = os.path.join(trace_dir, "run.perfetto.json")
    jaeger = export(run_path, "jaeger", jaeger_path)
    perfetto = export(run_path, "perfetto", perfetto_path)

    # -- the Jaeger view: spans by id, each with its process (kind, pid) -----------------
    spans, proc_of = {}, {}
    for trace in jaeger["data"]:
        for s in trace["spans"]:
            tags = {t["key"]: t["value"] for t in trace["processes"][s["processID"]]["tags"]}
            spans[s["spanID"]] = s
            proc_of[s["spanID"]] = (tags["vllm_anatomy.process.kind"], tags["process.pid"])

    def parent(s):
        refs = [r["spanID"] for r in s["references"] if r["refType"] == "CHILD_OF"]
        return spans.get(refs[0]) if refs else None

    def cause(s):
        """What a span follows from: its first reference, a FOLLOWS_FROM one into its own trace."""
        refs = s["references"][:1]
        return spans.get(refs[0]["spanID"]) if refs and refs[0]["refType"] == "FOLLOWS_FROM" else None

    def named(name, **where):
        return [s for s in spans.values() if s["operationName"] == name
                and all(f(s) for f in where.values())]

    [request] = named("llm_request")
    http = parent(request)
    [add] = named("EngineCore.add_request")
    req_chain = [http, request, add]
    steps = named("EngineCore.step", linked=lambda s: any(
        r["refType"] == "FOLLOWS_FROM" and r["spanID"] == request["spanID"] for r in s["references"]))
    step = steps[0]                        # the first step: the prefill
    step_chain, cur = [step], step
    for name, parent_name, _ in STEP_CHAIN[1:]:
        parent_span = next(s for s in step_chain if s["operationName"] == parent_name)
        kids = [s for s in named(name) if s["traceID"] == step["traceID"] and parent(s) is parent_span]
        cur = kids[0] if len(kids) == 1 else None
        if cur is None:
            raise AssertionError(f"lesson fact does not hold: one {name} under {parent_name} in the step's trace")
        step_chain.append(cur)

    # -- the Perfetto view: the same spans as slices, each on its process' pid ---------------
    pid_name = {e["pid"]: e["args"]["name"] for e in perfetto["traceEvents"]
                if e["ph"] == "M" and e["name"] == "process_name"}
    slice_proc = {e["args"]["span_id"]: pid_name[e["pid"]] for e in perfetto["traceEvents"]
                  if e["ph"] == "X" and "mirror_of" not in e["args"]}

    t0 = http["startTime"]
    print(f"  {'process':<12} {'pid':>7} {'start ms':>9} {'dur ms':>9}  span")
    for label, chain in (("request trace " + request["traceID"], req_chain),
                         ("step trace " + step["traceID"] + " (linked to llm_request)", step_chain)):
        print(f"  -- {label}")
        for s in chain:
            kind, pid = proc_of[s["spanID"]]
            print(f"  {kind:<12} {pid:>7} {(s['startTime'] - t0) / 1e3:9.2f} {s['duration'] / 1e3:9.2f}  "
                  f"{s['operationName']}")
    print()

    kinds = {name: proc_of[s["spanID"]] for name, s in
             [("http", http), ("request", request), ("add", add)] + [(s["operationName"], s) for s in step_chain]}
    frontend_pid, engine_pid, worker_pid = kinds["http"][1], kinds["add"][1], kinds["Worker.execute_model"][1]
    zmq_hop = (add["startTime"] - request["startTime"]) / 1e3
    shm_hop = (step_chain[3]["startTime"] - step_chain[2]["startTime"]) / 1e3
    fwd = step_chain[-1]["duration"] / 1e3
    say(f"""Three processes, three pids: the API server ({frontend_pid}) holds the HTTP span and
        llm_request; EngineCoreProc ({engine_pid}) received the request over ZMQ and ran
        EngineCore.add_request {zmq_hop:.2f} ms after llm_request began; its busy loop's step
        scheduled it and Executor.execute_model broadcast the
        SchedulerOutput through shared memory; the worker ({worker_pid}) started
        Worker.execute_model {shm_hop:.2f} ms later and spent {fwd:.1f} ms in
        GPUModelRunner._model_forward. The request's trace and the {len(steps)} step traces are
        separate trees: a step serves many requests, so it links to each request (a Jaeger
        FOLLOWS_FROM reference) instead of nesting under one.""")

    check(request["traceID"] == client_trace_id and http["traceID"] == client_trace_id
          and add["traceID"] == client_trace_id,
          f"the client's trace id {client_trace_id} is kept by the HTTP span, llm_request and add_request")
    check(http is not None and "chat/completions" in http["operationName"] and proc_of[http["spanID"]][0] == "frontend",
          f"llm_request's parent is the HTTP span {http['operationName']!r}, in the API server process")
    check(parent(add) is None and cause(add) is request and proc_of[request["spanID"]] == proc_of[http["spanID"]]
          and proc_of[add["spanID"]][0] == "engine_core",
          "EngineCore.add_request follows from llm_request (in its trace; nothing in the API server waits "
          "for it), and runs in the engine process")
    n_gen = answer["usage"]["completion_tokens"]
    check(len(steps) == n_gen and all(s["traceID"] != client_trace_id and parent(s) is None for s in steps),
          f"{len(steps)} EngineCore.step spans link to the request, one per generated token, "
          "each the root of its own trace")
    check(all(proc_of[s["spanID"]][0] == kind for s, (_, _, kind) in zip(step_chain, STEP_CHAIN)),
          "schedule and Executor.execute_model run in the engine process; Worker.execute_model, "
          "GPUModelRunner.execute_model and _model_forward in the worker process")
    check(len({frontend_pid, engine_pid, worker_pid}) == 3,
          f"three distinct processes: frontend {frontend_pid}, engine {engine_pid}, worker {worker_pid}")
    check(all(slice_proc[s["spanID"]].endswith(f"(pid {proc_of[s['spanID']][1]})")
              and f" {proc_of[s['spanID']][0]} " in slice_proc[s["spanID"]] for s in req_chain + step_chain),
          "the Perfetto export puts every hop on the same process (kind and pid) as the Jaeger export")

    with open_run(run_path) as run:
        device = run.meta["device"]
    if str(device).startswith("cuda"):
        say(f"""The third boundary is inside the worker: from GPUModelRunner._model_forward on, Python
            only launches kernels on {device}; the span measures the launches, and the device runs
            them asynchronously (lesson 6 shows that timeline).""")
    else:
        say("""The third boundary of the article, Python -> CUDA, is not crossed in this run: the
            worker runs on the CPU, so _model_forward's span is the computation itself, on the
            worker's own thread. On a CUDA machine that span would only measure kernel launches.""")
    say(f"""Open {jaeger_path} in Jaeger (Search -> JSON File) to see both trees, or
        {perfetto_path} in ui.perfetto.dev to see the three processes as lanes on one time axis.""")
    # The dashboard opens runs by name from the lessons folder: the run store moves there
    # (the exports stay beside the server's own trace directory).
    with open_run(run_path) as run:
        reqs = run.requests()
        req_ids = [s.request_id for s in reqs]
        # The first engine step that served the first request (its span links to the request's span).
        first_step = min((s.step_id for s in run.spans("EngineCore.step") if s.step_id is not None and reqs and any(
            lk["span_id"] == reqs[0].span_id for lk in s.links)), default=None)
    shown = os.path.join(LESSON_TRACE_DIR, os.path.basename(run_path))
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(run_path + suffix):
            shutil.move(run_path + suffix, shown + suffix)
    say("""The Processes page draws this request on the three processes' lanes: the ZMQ hop ③ with
        its size, the shared-memory hop ⑤ both ways, and the outputs ⑪ back to the API server. (The
        request-journey page shows the same request's llm_request span and every step that served it.)""")
    dashboard_link(shown, "processes", step=first_step, request=req_ids[0] if req_ids else None)


if __name__ == "__main__":
    main()

"""The article's call chain ①–⑪ (§六) in a run's real spans: one lane per process and
thread, the hops between them with their message sizes and latencies.

Lanes. A three-process run (`vllm-anatomy serve`, or a live run started with three
processes) has
    API server · event loop      frontend pid: the HTTP span, AsyncLLM.add_request,
                                 InputProcessor, MPClient._send_input / _decode_output,
                                 OutputProcessor
    EngineCoreProc · input thread    EngineCoreProc.process_input_sockets (one span per message)
    EngineCoreProc · run_busy_loop() EngineCore.add_request, EngineCore.step and its children (the
                                     article's process tree, §六: the main thread's stack ends in
                                     run_busy_loop() → step())
    EngineCoreProc · output thread   EngineCoreProc.process_output_sockets (one span per message)
    WorkerProc · worker_busy_loop()  Worker.* and GPUModelRunner.* (one lane per worker pid)
    device                           GPU.* spans (CUDA runs)
A one-process run (LLM / LLMEngine with UniProcExecutor) is labelled as such: its
engine loop and its in-process worker calls are two lanes of the same thread. An
offline run with worker processes (LLM with tensor_parallel_size > 1, or the mp
executor) has the LLM process's two lanes (frontend calls, EngineCore.step in-process)
and one WorkerProc lane per rank. Worker lanes are named by their tensor-parallel
rank (the run meta's `ranks`), in rank order; only the output rank (0) answers
execute_model and sample_tokens, as in vLLM's MultiprocExecutor.

Hops (for one step; a ZMQ hop's latency runs from the sending span's start, before
encoding, to the receiving span's end, after decoding: the two spans overlap in time): ③ EngineCoreRequest over ZMQ (frontend send → input thread →
input_queue → busy loop), ⑤ SchedulerOutput over the shared-memory ring (Executor →
Worker.execute_model) and back, sample_tokens and its ModelRunnerOutput, ⑪
EngineCoreOutputs over ZMQ (busy loop → output_queue → output thread → frontend).
ZMQ sizes are the spans' `vllm_anatomy.message_bytes`; shared-memory sizes are the
step's SchedulerOutput and ModelRunnerOutput msgpack-encoded as the executor encodes
them (re-encoded from the step's snapshots: the ring itself records no size).
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from dashboard.answers.source import RunSource
from dashboard.theme import short_req_id

FRONT, IN, BUSY, OUT, WORKER, DEVICE = "frontend", "input", "busy", "output", "worker", "device"
ENGINE_SIDE = ("EngineCore.", "Scheduler.", "Executor.", "KVCacheManager.", "EngineCoreProc.")
WORKER_SIDE = ("Worker.", "GPUModelRunner.", "AsyncGPUModelRunnerOutput.", "GroupCoordinator.")
# Spans drawn as the thin outer bar of their lane (they contain the others).
OUTER = {"EngineCore.step", "Worker.execute_model", "Worker.sample_tokens", "AsyncLLM.add_request",
         "GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens", "Executor.execute_model",
         "Executor.sample_tokens"}
SKIP = {"llm_request", "ParentRequest", "KVCacheManager.get_computed_blocks", "KVCacheManager.allocate_slots",
        "GPU.step", "Request"}     # (containers: a step's device work, a request's life in the engine)

# The article's chain (§六): marker, what the article names, our span names.
CHAIN = [
    ("①", "api_server.py: create_chat_completion() — Python (FastAPI)", ["POST /v1/chat/completions",
                                                                        "POST /v1/completions"]),
    ("②", "AsyncLLM.add_request() → Tokenizer", ["AsyncLLM.add_request", "InputProcessor.process_inputs"]),
    ("③", "IPC: ZMQ + msgspec → EngineCore.add_request()", ["MPClient._send_input",
                                                          "EngineCoreProc.process_input_sockets",
                                                          "EngineCore.add_request"]),
    ("④", "Scheduler.schedule() → SchedulerOutput", ["Scheduler.schedule"]),
    ("⑤", "process boundary (shared-memory MessageQueue) → Worker.execute_model()", ["Executor.execute_model",
                                                                                   "Worker.execute_model"]),
    ("⑥", "ModelRunner._execute_model → prepare_inputs()", ["GPUModelRunner._update_states",
                                                          "GPUModelRunner._prepare_inputs"]),
    ("⑦", "Python → CUDA boundary: model.forward()", ["GPUModelRunner._model_forward"]),
    ("⑧", "CUDA kernel launch: attention backend", ["GPU.kernel.unified_attention",
                                                         "GPU.kernel.prefill_attention", "GPU.layer"]),
    ("⑨", "CUDA Graph replay (decode)", ["GPU.model_forward"]),
    ("⑩", "GPU → CPU: sampling → sampled_token_ids", ["Executor.sample_tokens", "GPUModelRunner._sample",
                                                     "GPUModelRunner._bookkeeping_sync", "GPU.d2h"]),
    ("⑪", "ModelRunnerOutput → update_from_output → Detokenizer → client", [
        "Scheduler.update_from_output", "EngineCoreProc.process_output_sockets", "MPClient._decode_output",
        "OutputProcessor.process_outputs"]),
]


@dataclass
class Hop:
    marker: str
    what: str            # "EngineCoreRequest → input thread"
    boundary: str        # "ZMQ", "shared memory", "queue.Queue (thread)"
    src_lane: str
    dst_lane: str
    t_send: int          # ns
    t_recv: int
    nbytes: int | None
    size_from: str       # "recorded" | "re-encoded from the snapshot" | ""
    step: int
    request: str | None = None

    @property
    def latency_us(self) -> float:
        return (self.t_recv - self.t_send) / 1e3


def process_name(kind: str, pid: int, kinds: dict[str, set[int]], rank: int | None = None) -> str:
    """A process's name as every page says it (the lanes here, the Timeline's): "single process",
    "LLM process" (the offline LLM with worker processes), "API server", "EngineCoreProc",
    "WorkerProc rank R" — and its pid."""
    if kind == "worker":
        return f"WorkerProc{'' if rank is None else f' rank {rank}'} · pid {pid}"
    if kind == "engine_core":
        return f"EngineCoreProc · pid {pid}"
    if kind == "frontend":
        if kinds.get("engine_core"):
            return f"API server · pid {pid}"
        if kinds.get("worker"):
            return f"LLM process · pid {pid}"
        return f"single process · pid {pid}"
    return f"{kind} · pid {pid}"


def layout(src: RunSource) -> dict:
    """How many processes the run had and the lanes to draw, in order: [(lane key, label)].
    single: one process; inproc_engine: EngineCore runs in the frontend's process (offline
    LLM) while the workers are processes of their own; output_pids: the workers whose
    replies the executor reads (the output rank's)."""
    pids = src.pids
    single = set(pids) <= {"frontend"} and len(pids.get("frontend", ())) <= 1
    lanes = []
    if single:
        pid = next(iter(pids.get("frontend", {0})))
        lanes = [(f"{FRONT}:{pid}", f"single process · pid {pid} · frontend calls (LLM / LLMEngine)"),
                 (f"{BUSY}:{pid}", f"single process · pid {pid} · EngineCore.step (in-process)"),
                 (f"{WORKER}:{pid}", f"single process · pid {pid} · worker (UniProcExecutor: a plain call)"),
                 (f"{DEVICE}:{pid}", f"device · pid {pid}")]
        return {"single": True, "inproc_engine": True, "lanes": lanes, "output_pids": {pid}}
    ranks = src.ranks
    workers = sorted(pids.get("worker", ()), key=lambda p: (ranks.get(p, len(ranks)), p))
    inproc = not pids.get("engine_core") and bool(workers)
    for pid in sorted(pids.get("frontend", ())):
        if inproc:
            lanes += [(f"{FRONT}:{pid}", f"LLM process · pid {pid} · frontend calls (LLM / LLMEngine)"),
                      (f"{BUSY}:{pid}", f"LLM process · pid {pid} · EngineCore.step (in-process)")]
        else:
            lanes.append((f"{FRONT}:{pid}", f"API server · pid {pid} · event loop"))
    for pid in sorted(pids.get("engine_core", ())):
        lanes += [(f"{IN}:{pid}", f"EngineCoreProc · pid {pid} · input thread"),
                  (f"{BUSY}:{pid}", f"EngineCoreProc · pid {pid} · run_busy_loop()"),
                  (f"{OUT}:{pid}", f"EngineCoreProc · pid {pid} · output thread")]
    for pid in workers:
        rank = f" rank {ranks[pid]}" if pid in ranks else ""
        lanes += [(f"{WORKER}:{pid}", f"WorkerProc{rank} · pid {pid} · worker_busy_loop()"),
                  (f"{DEVICE}:{pid}", f"device{rank} · pid {pid}")]
    # NOTE: runs recorded before the meta had `ranks` had one worker: it is the output rank.
    output = {p for p, r in ranks.items() if r == 0} or set(workers[:1])
    return {"single": False, "inproc_engine": inproc, "lanes": lanes, "output_pids": output}


def lane_of(span, lay: dict) -> str | None:
    if span.name in SKIP:
        return None
    a = span.attributes
    if a.get("vllm_anatomy.lane") == "device":
        return f"{DEVICE}:{span.pid}"
    kind = span.process_kind
    if kind == "engine_core" or (lay["inproc_engine"] and kind != "worker" and span.name.startswith(ENGINE_SIDE)):
        thread = a.get("vllm_anatomy.thread")
        return f"{IN if thread == 'input' else OUT if thread == 'output' else BUSY}:{span.pid}"
    if kind == "worker" or (lay["single"] and span.name.startswith(WORKER_SIDE)):
        return f"{WORKER}:{span.pid}"
    return f"{FRONT}:{span.pid}"


def _first(spans, name, after: int | None = None, pred=None):
    c = [s for s in spans if s.name == name and (after is None or s.start_ns >= after) and (pred is None or pred(s))]
    return min(c, key=lambda s: s.start_ns) if c else None


def _enc_size(obj, typ) -> int | None:
    try:
        return len(msgspec.msgpack.encode(msgspec.convert(obj, typ)))
    except Exception:  # noqa: BLE001 - a snapshot of another version: fall back to the plain encoding
        try:
            return len(msgspec.msgpack.encode(obj))
        except Exception:  # noqa: BLE001
            return None


def step_view(src: RunSource, step: int) -> dict:
    """The spans drawn for one step (with its request arrivals and its outputs) and its hops."""
    from vllm_anatomy.tracing.reader import open_run
    lay = layout(src)
    root = src.step_spans.get(step)
    so = src.scheduler_output(step)
    # NOTE: a step that schedules no token runs no forward (⑦–⑩ have no span because nothing ran,
    # not because of the device); the run's device says whether a missing kernel span means a CPU run.
    facts = {"device": str(src.meta.get("device") or ""), "forward": bool(so.get("total_num_scheduled_tokens", 1))}
    if root is None:
        return {"layout": lay, "spans": [], "hops": [], "t0": 0, "t1": 0, **facts}
    so_new = so.get("scheduled_new_reqs", [])
    admitted = [str(r["req_id"]) for r in so_new]
    t0, t1 = root.start_ns, root.end_ns
    with open_run(src.path) as run:
        # Arrivals of the requests this step admitted (if they came shortly before) and its outputs after.
        near = run.spans(where="end_ns >= ? AND start_ns <= ?", args=(t0 - 200_000_000, t1 + 200_000_000))
    in_step = [s for s in near if s.trace_id == root.trace_id]
    sends = [s for s in near if s.name == "MPClient._send_input" and s.attributes.get("vllm_anatomy.request_id") in admitted]
    hops = _arrival_hops(near, sends, step)
    t0 = min([t0] + [snd.start_ns for snd in sends])
    # Also the HTTP and add_request spans of those requests.
    # NOTE: AsyncLLM.add_request knows the client's id (the engine's id adds a suffix: InputProcessor.
    # assign_request_id) and the tokenizer's span none: both are found by the request trace they share
    # with the send, or by their id being the head of an admitted one.
    traces = {snd.trace_id for snd in sends}
    extra = [s for s in near if s.name in ("AsyncLLM.add_request", "InputProcessor.process_inputs",
                                           "EngineCore.add_request", "EngineCoreProc.process_input_sockets",
                                           "MPClient._send_input")
             and (s.trace_id in traces or _owns(s.request_id or s.attributes.get("vllm_anatomy.request_id"), admitted))]
    https = [s for s in near if s.name.startswith("POST ") and not s.name.endswith((" http receive", " http send"))
             and any(s.start_ns <= x.start_ns <= s.end_ns for x in sends)]
    hops += _shm_hops(src, step, in_step, lay)
    output_hops, output_spans, t1 = _output_hops(src, step, near, in_step, lay, t1)
    hops += output_hops
    drawn, t0, t1 = _drawn(in_step + extra + output_spans + https, lay, t0, t1)
    return {"layout": lay, "spans": drawn, "hops": hops, "t0": t0, "t1": t1, "admitted": admitted, **facts}


def _owns(rid, admitted: list[str]) -> bool:
    """Is `rid` an admitted request's id, or the client's id it was made from (`<id>-<suffix>`)?"""
    return rid is not None and any(a == str(rid) or a.startswith(f"{rid}-") for a in admitted)


def _arrival_hops(near: list, sends: list, step: int) -> list[Hop]:
    """③ each admitted request: frontend → input thread (ZMQ) → busy loop (a queue)."""
    hops: list[Hop] = []
    for snd in sends:
        rid = snd.attributes["vllm_anatomy.request_id"]
        rcv = _first(near, "EngineCoreProc.process_input_sockets", snd.start_ns,
                     lambda s: s.attributes.get("vllm_anatomy.request_id") == rid)
        add = _first(near, "EngineCore.add_request", snd.start_ns, lambda s: str(s.request_id) == rid)
        if rcv is not None:
            pid_e = rcv.pid
            hops.append(Hop("③", f"EngineCoreRequest {short_req_id(rid)}", "ZMQ + msgspec", f"{FRONT}:{snd.pid}",
                            f"{IN}:{pid_e}", snd.start_ns, rcv.end_ns, rcv.attributes.get("vllm_anatomy.message_bytes"),
                            "recorded", step, rid))
            if add is not None:
                hops.append(Hop("③", "Request → run_busy_loop()", "input_queue (thread → thread)", f"{IN}:{pid_e}",
                                f"{BUSY}:{pid_e}", rcv.end_ns, add.start_ns, None, "", step, rid))
    return hops


def _shm_hops(src: RunSource, step: int, in_step: list, lay: dict) -> list[Hop]:
    """⑤ and ⑩, the shared-memory hops: execute_model and sample_tokens, down and back."""
    from vllm_anatomy.core.outputs import ModelRunnerOutput
    from vllm_anatomy.core.sched.output import SchedulerOutput
    snap, mr = src.snap(step) or {}, src.mr(step)
    so_bytes = _enc_size(snap.get("scheduler_output"), SchedulerOutput) if snap.get("scheduler_output") else None
    pi = mr.get("prepare_inputs") or {}
    mro = {"req_ids": pi.get("req_ids", []), "req_id_to_index": {r: i for i, r in enumerate(pi.get("req_ids", []))},
           "sampled_token_ids": mr.get("sampled_token_ids") or []}
    mro_bytes = _enc_size(mro, ModelRunnerOutput) if pi else None
    hops: list[Hop] = []
    for ex_name, w_name, what_down, what_up, down_bytes, up_bytes, marker in (
            ("Executor.execute_model", "Worker.execute_model", "execute_model(SchedulerOutput, non_block=True)",
             "a Future of None (logits stay on the worker)",
             so_bytes, None, "⑤"),
            ("Executor.sample_tokens", "Worker.sample_tokens", "sample_tokens(grammar_output)", "ModelRunnerOutput",
             None, mro_bytes, "⑩")):
        ex = _first(in_step, ex_name)
        for w in [s for s in in_step if s.name == w_name]:
            if ex is None or (lay["single"]):
                continue
            hops.append(Hop(marker, what_down, "shared-memory ring (rpc_broadcast_mq)", f"{BUSY}:{ex.pid}",
                            f"{WORKER}:{w.pid}", ex.start_ns, w.start_ns, down_bytes,
                            "re-encoded from the snapshot" if down_bytes else "", step))
            # NOTE: execute_model(non_block=True) returns a future at once: its reply is read from the
            # response queue later, by whatever busy-loop call comes after the worker answered.
            t_back = ex.end_ns if ex.end_ns >= w.end_ns else min(
                (x.start_ns for x in in_step if x.pid == ex.pid and x.start_ns >= w.end_ns), default=None)
            # NOTE: every rank reads the one broadcast; only the output rank writes a reply
            # (unique_reply_rank): the other ranks' results stay where they are.
            if t_back is not None and w.pid in lay["output_pids"]:
                hops.append(Hop(marker, what_up if ex.end_ns >= w.end_ns else f"{what_up} (read later: non_block)",
                                "shared-memory ring (worker_response_mq)", f"{WORKER}:{w.pid}",
                                f"{BUSY}:{ex.pid}", w.end_ns, t_back, up_bytes,
                                "re-encoded from the snapshot" if up_bytes else "", step))
    return hops


def _output_hops(src: RunSource, step: int, near: list, in_step: list, lay: dict,
                 t1: int) -> tuple[list[Hop], list, int]:
    """⑪ the outputs: busy loop → output thread → frontend; the hops, the spans they add, the view's new end."""
    hops: list[Hop] = []
    spans: list = []
    upd = _first(in_step, "Scheduler.update_from_output")
    if upd is not None and not lay["inproc_engine"]:
        out = _first(near, "EngineCoreProc.process_output_sockets", upd.end_ns - 1)
        if out is not None:
            hops.append(Hop("⑪", "EngineCoreOutputs → output thread", "output_queue (thread → thread)",
                            f"{BUSY}:{upd.pid}", f"{OUT}:{out.pid}", upd.end_ns, out.start_ns, None, "", step))
            dec = _first(near, "MPClient._decode_output", out.start_ns)
            if dec is not None:
                hops.append(Hop("⑪", "EngineCoreOutputs", "ZMQ + msgspec", f"{OUT}:{out.pid}", f"{FRONT}:{dec.pid}",
                                out.start_ns, dec.end_ns, out.attributes.get("vllm_anatomy.message_bytes"),
                                "recorded", step))
                proc = _first(near, "OutputProcessor.process_outputs", dec.start_ns)
                t1 = max(t1, dec.end_ns, proc.end_ns if proc is not None else 0)
                spans += [s for s in (out, dec, proc) if s is not None]
        elif src.pids.get("engine_core"):
            proc = _first(near, "OutputProcessor.process_outputs", upd.end_ns)
            if proc is not None:
                spans.append(proc)
                t1 = max(t1, proc.end_ns)
    elif lay["inproc_engine"]:
        proc = _first(near, "OutputProcessor.process_outputs", upd.end_ns - 1 if upd else t1)
        if proc is not None:
            spans.append(proc)
            t1 = max(t1, proc.end_ns)
    return hops, spans, t1


def _drawn(spans: list, lay: dict, t0: int, t1: int) -> tuple[list[dict], int, int]:
    """The spans to draw, once each, on their lanes; the view's time range widened to hold them."""
    drawn, seen = [], set()
    for s in spans:
        if s.span_id in seen:
            continue
        seen.add(s.span_id)
        lane = lane_of(s, lay)
        if lane is None or s.name.endswith((" http receive", " http send")):
            continue
        drawn.append({"name": s.name, "lane": lane, "start_ns": s.start_ns, "end_ns": s.end_ns,
                      "outer": s.name in OUTER or s.name.startswith("POST ") or s.name == "GPU.model_forward",
                      "attrs": s.attributes, "pid": s.pid, "process_kind": s.process_kind})
        if not s.name.startswith("POST "):      # a request's HTTP span lasts its whole life: drawn clipped
            t0 = min(t0, s.start_ns)
            t1 = max(t1, s.end_ns)
    return drawn, t0, t1


def forward_mode(view: dict) -> str | None:
    """The step's CUDA-graph mode (FULL, PIECEWISE, NONE) from its forward spans; None on a CPU run."""
    for s in view["spans"]:
        if s["name"] in ("GPU.model_forward", "GPUModelRunner._model_forward"):
            mode = s["attrs"].get("vllm_anatomy.cudagraph_mode")
            if mode:
                return str(mode)
    return None


NO_FORWARD = "no forward this step: nothing was scheduled (total_num_scheduled_tokens 0)"


def _on_cuda(view: dict) -> bool:
    return view.get("device", "").startswith("cuda") or any(s["lane"].startswith(f"{DEVICE}:") for s in view["spans"])


def _no_kernel_why(view: dict) -> str:
    """Why a step has no attention-kernel span (⑧) on this run."""
    mode = forward_mode(view)
    if mode == "FULL":
        return "inside this step's CUDA graph replay (⑨): a replay records no span per kernel"
    if _on_cuda(view):
        return "no kernel span recorded for this step (kernel spans need trace level full)"
    return "a CPU run: attention is torch code on the CPU, no CUDA kernel launch"


def chain_rows(view: dict, step: int) -> list[dict]:
    """①–⑪: the article's link, this run's span(s) in the step's view, where, how long."""
    lanes = dict(view["layout"]["lanes"])
    rows = []
    for marker, what, names in CHAIN:
        found = [s for s in view["spans"] if s["name"] in names]
        if marker == "⑨":
            found = [s for s in found if s["attrs"].get("vllm_anatomy.cudagraph_mode") == "FULL"]
        if found:
            total = sum(s["end_ns"] - s["start_ns"] for s in found) / 1e6
            where = sorted({lanes.get(s["lane"], s["lane"]) for s in found})
            rows.append({"#": marker, "the article": what, "this run's spans": ", ".join(sorted({s["name"] for s in found})),
                         "process · thread": "; ".join(where), "ms (sum)": round(total, 3)})
        else:
            why = ("not in this step (no request arrived here)" if marker in ("①", "②", "③") else
                   NO_FORWARD if marker in ("⑦", "⑧", "⑨", "⑩") and not view.get("forward", True) else
                   _no_kernel_why(view) if marker in ("⑧", "⑨") else
                   "a plain call in one process: no span of its own" if view["layout"]["single"] else "not recorded")
            if marker == "①" and not any(s["name"].startswith("POST ") for s in view["spans"]):
                why = "not in this step/run (no HTTP server: requests came through LLM / AsyncLLM)" \
                    if not view.get("admitted") else "not in this run (no HTTP server: LLM / AsyncLLM)"
            if marker == "⑨" and view.get("forward", True):
                mode = forward_mode(view) if any(s["name"] == "GPU.model_forward" for s in view["spans"]) else None
                why = ("piecewise CUDA graphs this step (not a pure decode batch: attention runs eager between the "
                       "graph pieces)" if mode == "PIECEWISE" else "eager forward this step (no CUDA graph replay)"
                       if mode is not None else "no CUDA-graph mode recorded for this step" if _on_cuda(view)
                       else "a CPU run: no CUDA graphs")
            rows.append({"#": marker, "the article": what, "this run's spans": "—", "process · thread": why,
                         "ms (sum)": "—"})
    return rows

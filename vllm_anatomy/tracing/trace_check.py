"""The rules Jaeger and Perfetto apply to our traces, as a test oracle.

    python -m vllm_anatomy.tracing.trace_check RUN.sqlite ...      # one line of counts per run

Jaeger v1.75.0's query service (what `/api/traces` returns, and what its UI draws)
runs a fixed sequence of adjusters over each trace before it answers
(cmd/query/app/querysvc/v2/adjuster: StandardAdjusters). The one that speaks
about our spans' times is CorrectClockSkew, with `max_clock_skew_adjust` 0 by
default. Its documented behaviour, re-implemented here from that description:
- spans are keyed by span id; a second span with an id already seen gets the
  warning "duplicate span IDs; skipping clock skew adjustment";
- a span whose parent id is set but not in the trace gets "parent span ID=<id>
  is not in the trace; skipping clock skew adjustment" and is treated as a root;
- from each root down, a span is compared with its parent only when the two come
  from different hosts: a host is named by the span's resource attribute
  `host.id`, else `host.ip` (a string, or the first of a list), else
  `host.name`; with none of them the span is always compared. A span on the same
  (named) host as its parent inherits the parent's correction instead;
- the correction ("delta") of a compared span: 0 when it lies within its parent;
  when it lasted longer than the parent, only a start before the parent's counts
  (delta = parent start - span start); otherwise the span is centred in its
  parent (delta = parent start + (parent duration - span duration) / 2 - span start);
- a non-zero delta is applied if it is at most max_clock_skew_adjust; at the
  default 0 it never is, and the span gets the warning "clock skew adjustment
  disabled; not applying calculated delta of <Go duration>".
Links (FOLLOWS_FROM references) are not part of this: only the parent is.

`strict_violations` is the stronger rule the traces are held to (docs/trace-format.md):
every span lies within its parent, whatever the hosts.

Perfetto (Chrome JSON importer): `X` slices on one track (pid, tid) must nest;
times are µs, read as ns with llround(value * 1000). A slice that starts inside
another and ends after it is a partial overlap. A flow (`s`/`f` with one id)
binds to the slice enclosing its timestamp on its track.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict
from typing import Any, Iterable

# (an n > 1 request's ParentRequest span is over its children's llm_request spans)
from vllm_anatomy.tracing.span_names import REQUEST_SPAN, REQUEST_SPANS

# What a trace is, by its roots (spans without a parent).
STEP_ROOT = "EngineCore.step"
STARTUP_ROOT = "EngineCore.__init__"

WARN_DUPLICATE = "duplicate span IDs; skipping clock skew adjustment"
WARN_MISSING_PARENT = "parent span ID={} is not in the trace; skipping clock skew adjustment"
WARN_DISABLED = "clock skew adjustment disabled; not applying calculated delta of {}"
WARN_EXCEEDED = "max clock skew adjustment delta of {} exceeded; not applying calculated delta of {}"
WARN_ADJUSTED = "This span's timestamps were adjusted by {}"


def go_duration(ns: int) -> str:
    """Go's time.Duration.String(): "0s", "850ns", "1.5µs", "35.123ms", "2.5s", "1m30s"."""
    if ns == 0:
        return "0s"
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{_trim(ns, 1_000)}µs"
    if ns < 1_000_000_000:
        return f"{sign}{_trim(ns, 1_000_000)}ms"
    hours, rest = divmod(ns, 3_600_000_000_000)
    minutes, rest = divmod(rest, 60_000_000_000)
    out = f"{hours}h" if hours else ""
    out += f"{minutes}m" if hours or minutes else ""
    return f"{sign}{out}{_trim(rest, 1_000_000_000)}s"


def _trim(value: int, unit: int) -> str:
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")


def host_key(resource: dict[str, Any] | None) -> str:
    """The host a span came from, as Jaeger's clock-skew adjuster names it ("" = unknown)."""
    if not resource:
        return ""
    if "host.id" in resource:
        return str(resource["host.id"])
    ip = resource.get("host.ip")
    if isinstance(ip, str):
        return ip
    if isinstance(ip, (list, tuple)) and ip:
        return str(ip[0])
    return str(resource.get("host.name", ""))


@dataclasses.dataclass
class _Node:
    span: Any
    host: str
    start: int
    end: int
    children: list["_Node"] = dataclasses.field(default_factory=list)


def jaeger_warnings(spans: list, resource_of, max_delta_ns: int = 0) -> dict[str, list[str]]:
    """Span id -> the warnings Jaeger's clock-skew adjuster gives the spans of one trace.

    `spans`: objects with span_id, parent_id, start_ns, end_ns (SpanRow); `resource_of(span)`:
    its resource attributes (None when unknown)."""
    warnings: dict[str, list[str]] = defaultdict(list)
    nodes: dict[str, _Node] = {}
    for s in spans:
        if s.span_id in nodes:
            warnings[s.span_id].append(WARN_DUPLICATE)
            continue
        nodes[s.span_id] = _Node(s, host_key(resource_of(s)), s.start_ns, s.end_ns)
    roots = []
    for n in nodes.values():
        parent_id = n.span.parent_id
        if not parent_id:
            roots.append(n)
        elif parent_id in nodes:
            nodes[parent_id].children.append(n)
        else:
            warnings[n.span.span_id].append(WARN_MISSING_PARENT.format(parent_id))
            roots.append(n)
    # (node, parent, (host, delta) handed down); iterative: a step tree can be deep
    stack: list[tuple[_Node, _Node | None, tuple[str, int]]] = [(r, None, (r.host, 0)) for r in roots]
    while stack:
        n, parent, skew = stack.pop()
        if parent is not None and (n.host != skew[0] or n.host == ""):
            skew = (n.host, _skew(n, parent))
        delta = skew[1]
        if delta:
            if abs(delta) > max_delta_ns:
                warnings[n.span.span_id].append(
                    WARN_DISABLED.format(go_duration(delta)) if max_delta_ns == 0
                    else WARN_EXCEEDED.format(go_duration(max_delta_ns), go_duration(delta)))
            else:
                n.start += delta            # (Jaeger moves the start only; the end stays)
                warnings[n.span.span_id].append(WARN_ADJUSTED.format(go_duration(delta)))
        stack.extend((c, n, skew) for c in n.children)
    return dict(warnings)


def _skew(child: _Node, parent: _Node) -> int:
    parent_dur, child_dur = parent.end - parent.start, child.end - child.start
    if child_dur > parent_dur:
        # (longer than its parent: only a start before the parent's is corrected)
        return parent.start - child.start if child.start < parent.start else 0
    if child.start >= parent.start and child.end <= parent.end:
        return 0
    return parent.start + (parent_dur - child_dur) // 2 - child.start


def strict_violations(spans: list) -> list[tuple[Any, Any]]:
    """(child, parent) pairs of one trace where the child does not lie within its parent."""
    by_id = {s.span_id: s for s in spans}
    out = []
    for s in spans:
        p = by_id.get(s.parent_id) if s.parent_id else None
        if p is not None and (s.start_ns < p.start_ns or s.end_ns > p.end_ns):
            out.append((s, p))
    return out


def trace_kind(spans: list) -> str:
    """"request", "step", "startup" or "other": what a trace is, by the spans it holds."""
    names = {s.name for s in spans}
    roots = {s.name for s in spans if not s.parent_id}
    if names.intersection(REQUEST_SPANS) or any(s.kind == "server" and not s.parent_id for s in spans):
        return "request"
    if STEP_ROOT in roots:
        return "step"
    if STARTUP_ROOT in roots:
        return "startup"
    return "other"


def caller_requests(spans: list) -> list:
    """The requests callers made, one span each: an HTTP request's server span (the FastAPI
    span, a root), or offline a request span (`llm_request`, or `ParentRequest` for n > 1)
    that is part of neither. One HTTP request may hold several engine requests (a batch of
    prompts, n > 1 choices): it is one request, and one trace, all the same."""
    by_id = {s.span_id: s for s in spans}
    out = []
    for s in spans:
        parent = by_id.get(s.parent_id) if s.parent_id else None
        if s.name in REQUEST_SPANS:
            # (under a server span: the HTTP request's or its ParentRequest's part)
            if parent is None or parent.kind != "server":
                out.append(s)
        elif s.kind == "server" and parent is None and not s.links:
            out.append(s)
    return out


# -- Perfetto ------------------------------------------------------------------------------------
def _ns(us: float) -> int:
    return int(round(us * 1000))


def perfetto_problems(doc: dict) -> dict[str, list]:
    """{"overlaps": [(track, outer name, inner name)], "unbound_flows": [(id, phase)]} of a
    Chrome trace-event document, by Perfetto's nesting rule."""
    tracks: dict[tuple, list[tuple[int, int, str]]] = defaultdict(list)
    for e in doc.get("traceEvents", []):
        if e.get("ph") == "X":
            start = _ns(e["ts"])
            tracks[(e["pid"], e["tid"])].append((start, start + _ns(e.get("dur", 0)), e.get("name", "")))
    overlaps = []
    for track, slices in tracks.items():
        slices.sort(key=lambda x: (x[0], -x[1]))
        stack: list[tuple[int, int, str]] = []
        for sl in slices:
            while stack and stack[-1][1] <= sl[0]:
                stack.pop()
            if stack and stack[-1][1] < sl[1]:
                overlaps.append((track, stack[-1][2], sl[2]))
                continue                     # (Perfetto would not nest it either)
            stack.append(sl)
    unbound = []
    for e in doc.get("traceEvents", []):
        if e.get("ph") in ("s", "f"):
            t = _ns(e["ts"])
            if not any(a <= t <= b for a, b, _ in tracks.get((e["pid"], e["tid"]), ())):
                unbound.append((e.get("id"), e["ph"]))
    return {"overlaps": overlaps, "unbound_flows": unbound}


# -- one run -------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunReport:
    path: str
    spans: int
    traces: int
    single_span_traces: int
    jaeger_warnings: int            # spans with a clock-skew (or parent) warning, Jaeger's rules
    strict_violations: int          # spans not within their parent, whatever the hosts
    missing_parents: int
    other_traces: int               # neither a request's, a step's nor the start-up trace
    split_requests: int             # requests whose own spans lie in more than one trace
    requests: int                   # HTTP / LLM requests (caller_requests)
    request_traces: int             # traces of kind "request" (one per request, when all is well)
    engine_requests: int            # llm_request spans: one per engine request (a batch, n > 1: several)
    services: int
    perfetto_overlaps: int
    perfetto_unbound_flows: int
    examples: list[str] = dataclasses.field(default_factory=list)

    COLUMNS = ("spans", "traces", "single_span_traces", "jaeger_warnings", "strict_violations",
               "missing_parents", "other_traces", "split_requests", "requests", "request_traces",
               "engine_requests", "services", "perfetto_overlaps", "perfetto_unbound_flows")

    def row(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in self.COLUMNS}


def resources_of(run) -> dict[int, dict]:
    """pid -> the resource attributes its process recorded (meta `resource.<pid>`; none in old runs)."""
    return {int(k.split(".", 1)[1]): v for k, v in run.meta.items()
            if k.startswith("resource.") and k.split(".", 1)[1].isdigit() and isinstance(v, dict)}


def check_run(run, perfetto_doc: dict | None = None, max_examples: int = 8) -> RunReport:
    """Every rule above, over one run store (a reader.Run)."""
    spans = run.spans()
    resources = resources_of(run)
    by_trace: dict[str, list] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    warned = strict = missing = other = 0
    examples: list[str] = []
    step_traces, request_traces = set(), set()
    for trace_id, members in by_trace.items():
        warns = jaeger_warnings(members, lambda s: resources.get(s.pid))
        warned += len(warns)
        missing += sum(any(w.startswith("parent span ID=") for w in ws) for ws in warns.values())
        bad = strict_violations(members)
        strict += len(bad)
        kind = trace_kind(members)
        other += kind == "other"
        if kind == "step":
            step_traces.add(trace_id)
        elif kind == "request":
            request_traces.add(trace_id)
        for child, parent in bad[:max(0, max_examples - len(examples))]:
            examples.append(f"{child.name} not within {parent.name}: starts {(child.start_ns - parent.start_ns) / 1e6:+.3f} ms, "
                            f"ends {(child.end_ns - parent.end_ns) / 1e6:+.3f} ms (trace {trace_id[:8]})")
        if kind == "other" and len(examples) < max_examples:
            examples.append(f"trace {trace_id[:8]} belongs to no request, step or start-up: "
                            f"{sorted({s.name for s in members})[:4]}")
    # A request's own spans (by request id: the engine's, an n > 1 parent's) lie in its trace.
    by_request: dict[str, set[str]] = defaultdict(set)
    for s in spans:
        rid = s.request_id or s.attributes.get("vllm_anatomy.request_id")
        if rid is not None and s.trace_id not in step_traces:
            by_request[str(rid)].add(s.trace_id)
    request_spans = [s for s in spans if s.name in REQUEST_SPANS]
    split = 0
    for r in request_spans:
        rid = str(r.request_id or r.attributes.get("vllm_anatomy.request_id"))
        split += by_request[rid] != {r.trace_id}
    callers = caller_requests(spans)
    if len(callers) != len(request_traces) and len(examples) < max_examples:
        examples.append(f"{len(callers)} requests in {len(request_traces)} request traces")
    if perfetto_doc is None:
        from vllm_anatomy.tracing.exporters import perfetto
        perfetto_doc = perfetto.export(run)
    pp = perfetto_problems(perfetto_doc)
    return RunReport(run.path, len(spans), len(by_trace), sum(len(m) == 1 for m in by_trace.values()),
                     warned, strict, missing, other, split, len(callers), len(request_traces),
                     sum(s.name == REQUEST_SPAN for s in spans), len({s.service for s in spans}),
                     len(pp["overlaps"]), len(pp["unbound_flows"]), examples)


def format_table(reports: Iterable[RunReport], names: Iterable[str] | None = None) -> str:
    reports = list(reports)
    names = list(names) if names is not None else [r.path for r in reports]
    short = ["spans", "traces", "1-span", "warned", "strict", "no-parent", "other", "split-req", "requests",
             "req-trace", "engine-req", "services", "pf-overlap", "pf-flow"]
    width = max([len(n) for n in names] + [8])
    lines = [f"{'run':<{width}} " + " ".join(f"{h:>9}" for h in short)]
    for n, r in zip(names, reports):
        lines.append(f"{n:<{width}} " + " ".join(f"{v:>9}" for v in r.row().values()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--json", action="store_true", help="one JSON object per run")
    args = ap.parse_args(argv)
    from vllm_anatomy.tracing.reader import open_run
    reports = []
    for path in args.runs:
        with open_run(path) as run:
            reports.append(check_run(run))
    if args.json:
        for r in reports:
            print(json.dumps({"path": r.path, **r.row(), "examples": r.examples}))
    else:
        print(format_table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())

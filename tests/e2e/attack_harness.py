"""Measure what one client's attack does to everyone else: /health latency and a bystander's stream.

Used by tests/e2e/test_isolation.py (one test per row of issue 29) and by
bench/attacks_under_load.py (the table and JSON). For one attack:

  1. a bystander streams a long completion (ignore_eos, greedy); its tokens are
     counted from the stream's continuous usage;
  2. a probe asks GET /health every PROBE_GAP_S, all along;
  3. after the stream flows, a baseline window (`baseline_s`) gives the
     bystander's token rate; then the attack runs, and the attack window (from
     its start until it ends, at least `min_attack_s`) gives the rate under attack.

The numbers that matter are ratios within one measurement (the machine is
shared and loaded): the bystander's rate under attack over its own rate just
before, and /health's worst latency (its idle latency is milliseconds).

measure_with_control also measures the attack's control (the same requests made
benign, isolation_attacks.as_control) the same way, right after: an attack whose
answers are generated shares the bystander's batch, which on a CPU slows it as
any request would; `relative_ratio` (attack ratio / control ratio) is the harm.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

import httpx

PROBE_GAP_S = 0.05
PROBE_TIMEOUT_S = 15.0


@dataclass
class AttackResult:
    name: str
    baseline_tok_s: float
    attack_tok_s: float
    worst_1s_tok_s: float            # the slowest 1-second window of the bystander under attack
    health_max_s: float
    health_p50_s: float
    health_n: int
    health_failures: int             # probes that timed out or did not answer 200
    attack_s: float
    outcome: Any = None              # what the attack returned (statuses, messages)
    notes: list[str] = field(default_factory=list)
    control: AttackResult | None = None     # the same measurement of the attack's control, if taken

    @property
    def rate_ratio(self) -> float:
        """Bystander tokens/s under attack over the baseline (1.0 = unaffected)."""
        return self.attack_tok_s / self.baseline_tok_s if self.baseline_tok_s > 0 else 0.0

    @property
    def relative_ratio(self) -> float:
        """rate_ratio over the control's (1.0 = harms the bystander no more than benign requests
        of the same shape); rate_ratio when no control was measured."""
        if self.control is None:
            return self.rate_ratio
        return self.rate_ratio / self.control.rate_ratio if self.control.rate_ratio > 0 else 0.0

    def as_dict(self) -> dict:
        out = {**asdict(self), "rate_ratio": self.rate_ratio, "relative_ratio": self.relative_ratio}
        if self.control is not None:
            out["control"] = {**self.control.as_dict(), "outcome": None}
        return out

    def summary(self) -> str:
        control = "" if self.control is None else (
            f"; control x{self.control.rate_ratio:.2f} (/health max {self.control.health_max_s:.3f} s), "
            f"relative x{self.relative_ratio:.2f}")
        return self._summary() + control

    def _summary(self) -> str:
        return (f"{self.name}: bystander {self.baseline_tok_s:.1f} -> {self.attack_tok_s:.1f} tok/s "
                f"(x{self.rate_ratio:.2f}, worst 1 s {self.worst_1s_tok_s:.1f}), /health max {self.health_max_s:.3f} s "
                f"p50 {self.health_p50_s:.3f} s over {self.health_n} probes ({self.health_failures} failed), "
                f"attack {self.attack_s:.1f} s")


async def _bystander(url: str, model: str, token_times: list[float], started: asyncio.Event) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 100_000, "ignore_eos": True,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    # NOTE: max_tokens past the context is refused: ask the server for room.
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        models = (await client.get("/v1/models")).json()["data"][0]
        body["max_tokens"] = models["max_model_len"] - 16
        seen = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                usage = json.loads(line[6:]).get("usage") or {}
                done = usage.get("completion_tokens", seen)
                now = time.perf_counter()
                token_times.extend([now] * (done - seen))
                seen = done
                if seen >= 3:
                    started.set()


async def _probe(url: str, latencies: list[float], failures: list[str], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=PROBE_TIMEOUT_S) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = await client.get("/health")
                if r.status_code != 200:
                    failures.append(f"HTTP {r.status_code}")
            except httpx.HTTPError as e:
                failures.append(type(e).__name__)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(PROBE_GAP_S)


def _rate(times: list[float], start: float, end: float) -> float:
    n = sum(1 for t in times if start <= t < end)
    return n / (end - start) if end > start else 0.0


def _worst_window(times: list[float], start: float, end: float, width: float = 1.0) -> float:
    if end - start < width:
        return _rate(times, start, end)
    worst, t = float("inf"), start
    while t + width <= end:
        worst = min(worst, _rate(times, t, t + width))
        t += 0.25
    return worst


async def measure_attack(url: str, model: str, name: str, attack: Callable[[], Awaitable[Any]],
                         baseline_s: float = 3.0, min_attack_s: float = 3.0) -> AttackResult:
    """Run `attack()` (a coroutine factory) against the server at `url` while measuring."""
    token_times: list[float] = []
    latencies: list[float] = []
    failures: list[str] = []
    started, stop = asyncio.Event(), asyncio.Event()
    stream = asyncio.create_task(_bystander(url, model, token_times, started))
    probe = None
    try:
        await asyncio.wait_for(started.wait(), timeout=120)
        probe = asyncio.create_task(_probe(url, latencies, failures, stop))
        t_base = time.perf_counter()
        await asyncio.sleep(baseline_s)
        t_attack = time.perf_counter()
        outcome = await attack()
        t_done = time.perf_counter()
        t_end = max(t_done, t_attack + min_attack_s)
        await asyncio.sleep(max(0.0, t_end - time.perf_counter()))
        # (the last probe started before t_end must answer: a stalled loop is seen)
        stop.set()
        await probe
        if stream.done():
            stream.result()             # (raises what broke the bystander)
    finally:
        stop.set()
        stream.cancel()
        for task in (stream, probe):
            if task is not None:
                try:
                    await task
                except (asyncio.CancelledError, httpx.HTTPError):
                    pass
    lat = sorted(latencies) or [0.0]
    return AttackResult(name=name, baseline_tok_s=_rate(token_times, t_base, t_attack),
                        attack_tok_s=_rate(token_times, t_attack, t_end),
                        worst_1s_tok_s=_worst_window(token_times, t_attack, t_end),
                        health_max_s=lat[-1], health_p50_s=lat[len(lat) // 2],
                        health_n=len(latencies), health_failures=len(failures), attack_s=t_done - t_attack,
                        outcome=outcome)


async def measure_with_control(url: str, model: str, name: str, attack: Callable[[], Awaitable[Any]],
                               control: Callable[[], Awaitable[Any]], baseline_s: float = 3.0,
                               min_attack_s: float = 3.0) -> AttackResult:
    """measure_attack of `attack`, then of `control` (its benign twin), the second attached to the first."""
    result = await measure_attack(url, model, name, attack, baseline_s, min_attack_s)
    result.control = await measure_attack(url, model, f"{name} control", control, baseline_s, min_attack_s)
    return result


def error_of(r: httpx.Response) -> dict:
    """The OpenAI error object of a response (or a stand-in for a non-JSON body)."""
    try:
        return r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": r.text[:300], "param": None}

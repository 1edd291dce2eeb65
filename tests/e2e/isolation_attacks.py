"""The attacks of issue 29, one coroutine per row (F1-F7).

Each `attack(url, model)` sends what one user may send within the body limit and
returns what came back (statuses, messages, timings), for test_isolation.py to
check and bench/attacks_under_load.py to tabulate, both while attack_harness.py
measures /health and a bystander's stream.

`as_control(attack)` is the same attack made harmless: the same requests at the
same moments, each reduced to its prompt, max_tokens and the fields that set its
length (benign()), so its answers share the bystander's batch as the attack's
would. The bystander's ratio under the attack over its ratio under the control
separates harm from batch sharing (on a CPU, any extra sequence slows the others).
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import time
from typing import Any

import httpx

from attack_harness import error_of

# engine/stop_strings.py's bound (a literal, so these attacks also run against older trees).
MAX_STOP_STRINGS = 256
# NOTE: the attacks' own generations are short: on a CPU any second sequence in the
# batch slows the bystander's steps, which is sharing, not harm.
STREAM_TOKENS = 16
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def optional_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


# A regex within every bound (14 bytes per piece, each repetition 1,000) that takes
# xgrammar ~15-20 s of CPU to compile against SmolLM2's vocabulary (the cost grows
# with the square of the number of distinct pieces), and ~0.2 s against the
# server's 257-token validation vocabulary.
SLOW_REGEX = "".join(f"[a-{chr(ord('k') + i)}]{{0,1000}}" for i in range(14)) + \
    "".join(f"[0-{i}]{{0,1000}}" for i in range(1, 10))


# -- controls ---------------------------------------------------------------------------------------
CONTROL: contextvars.ContextVar[bool] = contextvars.ContextVar("isolation_control", default=False)
# What a control request keeps of an attack's request: its prompt and what sets its length.
BENIGN_FIELDS = ("model", "prompt", "messages", "max_tokens", "temperature", "stream", "stream_options",
                 "ignore_eos", "n")


def benign(body: dict | bytes) -> dict | bytes:
    """Under a control (CONTROL set), `body` reduced to BENIGN_FIELDS; else `body` itself."""
    if not CONTROL.get():
        return body
    data = json.loads(body) if isinstance(body, bytes) else body
    return {k: v for k, v in data.items() if k in BENIGN_FIELDS}


def as_control(attack):
    """The control of `attack`: the same coroutine, every request it sends made benign."""
    async def control(url: str, model: str) -> Any:
        token = CONTROL.set(True)
        try:
            return await attack(url, model)
        finally:
            CONTROL.reset(token)
    control.__name__ = f"control_of_{getattr(attack, '__name__', 'attack')}"
    return control


def _chat(model: str, **kw: Any) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Answer yes or no."}],
            "max_tokens": 8, "temperature": 0, **kw}


def _completion(model: str, **kw: Any) -> dict:
    return {"model": model, "prompt": "Answer:", "max_tokens": 8, "temperature": 0, **kw}


async def _post(client: httpx.AsyncClient, path: str, body: dict | bytes, **kw: Any) -> dict:
    t0 = time.perf_counter()
    if CONTROL.get():
        body = benign(body)
        kw.pop("headers", None)
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"Content-Type": "application/json", **kw.pop("headers", {})},
                              **kw)
    else:
        r = await client.post(path, json=body, **kw)
    out: dict = {"status": r.status_code, "seconds": round(time.perf_counter() - t0, 3)}
    if r.status_code == 200:
        data = r.json()
        choice = data["choices"][0]
        out.update(id=data["id"], finish_reason=choice["finish_reason"],
                   text=choice.get("text", (choice.get("message") or {}).get("content")),
                   logprobs=choice.get("logprobs"))
    else:
        err = error_of(r)
        out.update(message=err.get("message"), param=err.get("param"))
    return out


# -- F1: schemas that are expensive to parse, or deeper than Python's recursion limit ----------
async def f1_deep_schemas(url: str, model: str) -> dict:
    deep_text = '{"type": "array", "items": ' * 2000 + '{"type": "string"}' + "}" * 2000
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        arrays = [_post(client, CHAT, _chat(model, response_format={
            "type": "json_schema", "json_schema": {"name": "deep", "schema": nested_arrays(300)}}))
            for _ in range(3)]
        objects = _post(client, COMPLETIONS, _completion(model, structured_outputs={"json": nested_objects(150)}))
        deepest = _post(client, COMPLETIONS, _completion(model, structured_outputs={"json": deep_text}))
        results = await asyncio.gather(*arrays, objects, deepest)
    return {"arrays_300": results[:3], "objects_150": results[3], "arrays_2000_text": results[4]}


# -- F2: schemas that are expensive to compile; a client that gives up ---------------------------
async def f2_slow_compiles(url: str, model: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        huge = await _post(client, COMPLETIONS, _completion(model, structured_outputs={"json": optional_properties(2000)}))
        # A compile that passes every bound and is slow: the client gives up after 2 s.
        t0 = time.perf_counter()
        try:
            await client.post(COMPLETIONS, json=benign(_completion(model, structured_outputs={"regex": SLOW_REGEX})),
                              timeout=2.0)
            gave_up = False
        except httpx.TimeoutException:
            gave_up = True
        slow_s = time.perf_counter() - t0
        # The next structured request must not wait for the abandoned compile.
        small = await _post(client, COMPLETIONS, _completion(model, structured_outputs={"choice": ["yes", "no"]}))
    return {"optional_2000": huge, "slow_gave_up": gave_up, "slow_s": round(slow_s, 3), "small_after": small}


# -- F3: constraints that can match nothing or end too early ---------------------------------------
async def f3_impossible_constraints(url: str, model: str) -> dict:
    cases = {
        "regex_matches_nothing": _completion(model, structured_outputs={"regex": r"[^\s\S]"}),
        "grammar_root_is_root": _completion(model, structured_outputs={"grammar": "root ::= root"}),
        "grammar_empty_class": _completion(model, structured_outputs={"grammar": "root ::= [^\\x00-\\U0010FFFF]"}),
        "choice_shorter_than_min_tokens": _completion(model, structured_outputs={"choice": ["yes"]}, min_tokens=4),
        "regex_shorter_than_min_tokens": _completion(model, structured_outputs={"regex": "(yes|no)!?"}, min_tokens=5),
        "regex_under_ignore_eos": _completion(model, structured_outputs={"regex": "abc"}, ignore_eos=True),
        "json_under_min_tokens": _chat(model, response_format={"type": "json_object"}, min_tokens=6, max_tokens=12),
    }
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        results = await asyncio.gather(*(_post(client, CHAT if "messages" in body else COMPLETIONS, body)
                                         for body in cases.values()))
    return dict(zip(cases, results))


# -- F4: stop lists ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def stop_list_body(model: str, n: int) -> bytes:
    """A completion body with `n` stop strings, encoded once.

    NOTE: building it takes the measuring process's event loop ~1 s on a loaded CPU
    (a probe in flight then looks slow): prepare() builds it before any measurement."""
    return json.dumps(_completion(model, stop=[f"s{i}" for i in range(n)]), separators=(",", ":")).encode()


def prepare(model: str) -> None:
    """Build what the attacks send, before anything is measured."""
    for n in (700_000, 200_000):
        stop_list_body(model, n)


async def f4_stop_lists(url: str, model: str) -> dict:
    huge = stop_list_body(model, 700_000)           # ~6.9 MB, under the 8 MiB body limit
    many = [f"never-{i:04d}-" + "z" * 40 for i in range(MAX_STOP_STRINGS)]
    async def stream(client: httpx.AsyncClient, stop: list[str]) -> dict:
        t0 = time.perf_counter()
        tokens = 0
        async with client.stream("POST", COMPLETIONS, json=benign(_completion(
                model, stop=stop, max_tokens=STREAM_TOKENS, ignore_eos=True, stream=True,
                stream_options={"include_usage": True}))) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                    tokens = usage["completion_tokens"]
        return {"status": status, "tokens": tokens, "seconds": round(time.perf_counter() - t0, 3)}

    # Within the body decoder's bound on values (request_body.MAX_JSON_VALUES): the stop list's own bound answers.
    large = stop_list_body(model, 200_000)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        over = await _post(client, COMPLETIONS, _completion(model) if CONTROL.get() else huge)
        over_200k = await _post(client, COMPLETIONS, _completion(model) if CONTROL.get() else large)
        # The same stream with one stop string, then with the most accepted (matched every token).
        one = await stream(client, many[:1])
        at_bound = await stream(client, many)
    return {"stop_700k": {**over, "body_mb": round(len(huge) / 1e6, 2)},
            "stop_200k": {**over_200k, "body_mb": round(len(large) / 1e6, 2)}, "stop_one": one, "stop_at_bound": at_bound}


# -- F5: request fields that must change the answer or be refused ------------------------------------
async def f5_fields(url: str, model: str) -> dict:
    conversation = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    cases = {
        "chat_template": (CHAT, _chat(model, chat_template="{{ 'Say hi.' }}")),
        "chat_template_kwargs.chat_template": (CHAT, _chat(model, chat_template_kwargs={"chat_template": "{{ 'x' }}"})),
        "continue_final_message+echo": (CHAT, _chat(model, messages=conversation, continue_final_message=True,
                                                     add_generation_prompt=False, echo=True)),
        "continue_final_message+add_generation_prompt": (CHAT, _chat(model, messages=conversation,
                                                                     continue_final_message=True)),
        "return_tokens_as_token_ids": (COMPLETIONS, _completion(model, logprobs=1, max_tokens=3,
                                                                return_tokens_as_token_ids=True)),
        "cache_salt": (COMPLETIONS, _completion(model, cache_salt="tenant-a")),
        "return_token_ids": (COMPLETIONS, _completion(model, return_token_ids=True)),
        "priority": (COMPLETIONS, _completion(model, priority=5)),
    }
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        results = await asyncio.gather(*(_post(client, path, body) for path, body in cases.values()))
    return dict(zip(cases, results))


# -- F6: request ids with control characters -----------------------------------------------------------
HOSTILE_ID = "req\x1b[2J\x1b[31mFAKE LOG LINE\r\n"


async def f6_request_ids(url: str, model: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        header = await _post(client, COMPLETIONS, _completion(model),
                             headers={"X-Request-Id": HOSTILE_ID.replace("\r\n", "").encode("latin-1")})
        body = await _post(client, COMPLETIONS, _completion(model, request_id=HOSTILE_ID))
        safe = await _post(client, COMPLETIONS, _completion(model), headers={"X-Request-Id": "client-42.a:b"})
    return {"header": header, "body": body, "safe": safe}


# -- F7: connections that never finish a request ------------------------------------------------------
async def open_connection(url: str, first_bytes: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    if first_bytes:
        writer.write(first_bytes)
        await writer.drain()
    return reader, writer


async def closed_by_server(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Whether the server closes the connection within `timeout` (a response first is read and skipped)."""
    async def drain() -> None:
        while await reader.read(65536):
            pass
    try:
        await asyncio.wait_for(drain(), timeout)
        return True
    except ConnectionError:
        return True
    except asyncio.TimeoutError:
        return False


async def f7_idle_connections(url: str, model: str, num_sockets: int = 300, hold_s: float = 3.0,
                              wait_close_s: float = 7.0, body_wait_s: float = 13.0) -> dict:
    """`num_sockets` connections, half silent and half stopping inside the request line, held
    `hold_s`; then how many the server has closed (within `wait_close_s` more), and whether it
    closes one whose body never comes (within `body_wait_s`)."""
    conns = []
    refused = 0
    for i in range(num_sockets):
        try:
            conns.append(await open_connection(url, b"" if i % 2 else b"GET /hea"))
        except OSError:
            refused += 1
    await asyncio.sleep(hold_s)
    closed = await asyncio.gather(*(closed_by_server(r, wait_close_s) for r, _ in conns))
    for _, w in conns:
        w.close()
    reader, writer = await open_connection(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    t0 = time.perf_counter()
    body_closed = await closed_by_server(reader, body_wait_s)
    body_s = time.perf_counter() - t0
    writer.close()
    return {"sockets": len(conns), "refused": refused, "closed": sum(closed), "slow_body_closed": body_closed,
            "slow_body_closed_after_s": round(body_s, 2)}


# F7 sends no request (raw sockets): it has no control.
CONTROLLED = ("F1", "F2", "F3", "F4", "F5", "F6")

ATTACKS = {"F1": f1_deep_schemas, "F2": f2_slow_compiles, "F3": f3_impossible_constraints,
           "F4": f4_stop_lists, "F5": f5_fields, "F6": f6_request_ids, "F7": f7_idle_connections}

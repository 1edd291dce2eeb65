"""Issue 29: one user's request must never slow the others. One test per row (F1-F7).

A live `vllm-anatomy serve` (default model, CPU, EngineCore in its own process).
Each test runs its attack (isolation_attacks.py) while attack_harness.py measures
GET /health (every 50 ms) and a bystander's stream, and checks both what the
attacker got back (a clear 400, or a correct answer, never a 500) and what the
others saw.

Bounds: the issue's goals are /health under 0.5 s and a bystander at most 25 %
slower; on this shared, loaded 2-core machine the tests allow /health 2 s and a
bystander at half its own rate just before the attack (ratios within one
measurement, not absolute speeds). F3-F6's answers are generated in the
bystander's batch, which slows it as any request would: their bound is on the
ratio relative to a control (the same requests made benign, sent the same way;
attack_harness.measure_with_control). Before the fix, the attacks here blocked
/health for 4-9 s or cut the bystander to under a tenth of its rate, and F3's
requests got 500s.

F7 has its own server, started with 256 file descriptors (so the default
connection cap is 128) and short read timeouts.
"""
from __future__ import annotations

import asyncio
import json
import resource
import socket
import time

import httpx
import pytest

from attack_harness import AttackResult, error_of, measure_attack, measure_with_control
from isolation_attacks import (STREAM_TOKENS, as_control, closed_by_server, prepare, f1_deep_schemas, f2_slow_compiles,
                               f3_impossible_constraints, f4_stop_lists, f5_fields, f6_request_ids,
                               f7_idle_connections, open_connection)
from server_utils import RemoteOpenAIServer, wait_idle

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "smol"
HEALTH_MAX_S = 2.0
MIN_RATE_RATIO = 0.5
WINDOW_S = 4.0          # the bystander's baseline window, and the least of its attack window


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("isolation") / "server.log"
    prepare(MODEL)
    with RemoteOpenAIServer("--served-model-name", MODEL, "--max-model-len", "1024", log_path=str(log)) as s:
        s.log_file = log
        yield s


def run(server, name: str, attack, controlled: bool = False) -> AttackResult:
    """Measure `attack` (and, if `controlled`, its control right after)."""
    if controlled:
        result = asyncio.run(measure_with_control(
            server.url, MODEL, name, lambda: attack(server.url, MODEL),
            lambda: as_control(attack)(server.url, MODEL), baseline_s=WINDOW_S, min_attack_s=WINDOW_S))
    else:
        result = asyncio.run(measure_attack(server.url, MODEL, name, lambda: attack(server.url, MODEL),
                                            baseline_s=WINDOW_S, min_attack_s=WINDOW_S))
    print(result.summary())
    return result


def attacked(server, name: str, attack, controlled: bool = False) -> tuple[AttackResult, dict]:
    """(the measurement, what the attacker got back)."""
    result = run(server, name, attack, controlled)
    return result, result.outcome


def _isolated(result: AttackResult) -> bool:
    # (relative_ratio is rate_ratio when no control was measured)
    return (result.health_failures == 0 and result.health_max_s <= HEALTH_MAX_S
            and result.relative_ratio >= MIN_RATE_RATIO)


def assert_isolated(result: AttackResult, server, attack) -> None:
    """The others were not harmed. NOTE: other jobs share this machine and its load
    swings within seconds; a measurement that misses a bound is taken once more
    (the attack is the same: it harms every time, noise does not)."""
    if not _isolated(result):
        again = run(server, result.name + " (again)", attack, controlled=result.control is not None)
        assert _isolated(again), f"{result.summary()}\nagain: {again.summary()}"


def assert_400(outcome: dict, param: str, *words: str) -> None:
    assert outcome["status"] == 400, outcome
    assert outcome["param"] == param, outcome
    for word in words:
        assert word in outcome["message"], outcome


def test_f1_deep_schemas_are_refused_off_the_event_loop(server):
    attack = f1_deep_schemas
    result, out = attacked(server, "F1 deep schemas", attack)
    for o in out["arrays_300"]:
        assert_400(o, "response_format", "levels deep")
    assert_400(out["objects_150"], "structured_outputs", "levels deep")
    assert_400(out["arrays_2000_text"], "structured_outputs", "levels deep")
    for o in [*out["arrays_300"], out["objects_150"], out["arrays_2000_text"]]:
        assert "recursion" not in o["message"]
    assert_isolated(result, server, attack)


def _small_structured(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": "Answer:", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200, r.text


def test_f2_slow_compiles_are_bounded_and_cancelled(server):
    # Not part of the attack: the first structured request loads xgrammar and the vocabulary.
    _small_structured(server.url)

    async def attack(url, model):
        # The same small structured request before and after, for a ratio.
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json={"model": model, "prompt": "Answer:", "max_tokens": 4,
                                                           "structured_outputs": {"choice": ["yes", "no"]}})
            before = {"status": r.status_code, "seconds": time.perf_counter() - t0}
        return {**await f2_slow_compiles(url, model), "small_before": before}
    result, out = attacked(server, "F2 slow compiles", attack)
    assert_400(out["optional_2000"], "structured_outputs", "optional properties", "256")
    assert out["optional_2000"]["seconds"] < 10
    assert out["slow_gave_up"], out
    small_before, small_after = out["small_before"], out["small_after"]
    assert small_before["status"] == 200 and small_after["status"] == 200, out
    # The abandoned compile (~15 s of CPU) neither holds the pool nor the forward pass.
    assert small_after["seconds"] <= 2 * small_before["seconds"] + 3.0, out
    assert_isolated(result, server, attack)


def test_f3_impossible_constraints_get_a_400_or_a_clean_stop(server):
    attack = f3_impossible_constraints
    result, out = attacked(server, "F3 impossible constraints", attack, controlled=True)
    for name in ("regex_matches_nothing", "grammar_root_is_root", "grammar_empty_class"):
        assert_400(out[name], "structured_outputs", "can match no output")
    assert_400(out["choice_shorter_than_min_tokens"], "min_tokens", "can never be reached")
    assert_400(out["regex_shorter_than_min_tokens"], "min_tokens", "can never be reached", "4 bytes")
    ignore_eos = out["regex_under_ignore_eos"]
    assert ignore_eos["status"] == 200 and ignore_eos["text"] == "abc" and ignore_eos["finish_reason"] == "stop", \
        ignore_eos
    min_tokens = out["json_under_min_tokens"]
    assert min_tokens["status"] == 200 and min_tokens["finish_reason"] in ("stop", "length"), min_tokens
    if min_tokens["finish_reason"] == "stop":
        assert isinstance(json.loads(min_tokens["text"]), dict), min_tokens
    assert all(o["status"] != 500 for o in out.values()), out
    assert_isolated(result, server, attack)


def test_f4_stop_lists_are_bounded_and_cheap(server):
    attack = f4_stop_lists
    result, out = attacked(server, "F4 stop lists", attack, controlled=True)
    # 700,000 values: past the body decoder's bound (in its thread, off the event loop); 200,000: the stop bound.
    assert out["stop_700k"]["status"] == 400 and "262144 JSON values" in out["stop_700k"]["message"], out
    assert_400(out["stop_200k"], "stop", "at most 256")
    for name in ("stop_one", "stop_at_bound"):
        assert out[name] == {**out[name], "status": 200, "tokens": STREAM_TOKENS}, out
    # (generous: the machine is shared; what the bound prevents is seconds per token)
    assert out["stop_at_bound"]["seconds"] <= 3 * out["stop_one"]["seconds"] + 5.0, out
    assert_isolated(result, server, attack)


def test_f5_fields_change_the_answer_or_are_refused(server):
    attack = f5_fields
    result, out = attacked(server, "F5 request fields", attack, controlled=True)
    assert_400(out["chat_template"], "chat_template", "--trust-request-chat-template")
    assert_400(out["chat_template_kwargs.chat_template"], "chat_template", "--trust-request-chat-template")
    cont = out["continue_final_message+echo"]
    assert cont["status"] == 200 and cont["text"].startswith("My favourite color is") \
        and len(cont["text"]) > len("My favourite color is"), cont
    assert_400(out["continue_final_message+add_generation_prompt"], "continue_final_message")
    as_ids = out["return_tokens_as_token_ids"]
    assert as_ids["status"] == 200 and as_ids["logprobs"]["tokens"], as_ids
    assert all(t.startswith("token_id:") for t in as_ids["logprobs"]["tokens"]), as_ids
    assert all(k.startswith("token_id:") for top in as_ids["logprobs"]["top_logprobs"] for k in top), as_ids
    for field in ("cache_salt", "return_token_ids"):
        assert_400(out[field], field, "not supported")
    # NOTE: priority is implemented since issue 31 (--scheduling-policy priority); under
    # this server's fcfs it is accepted and ignored, as vLLM 0.27.1's input processor does.
    assert out["priority"]["status"] == 200 and out["priority"]["finish_reason"] == "length", out["priority"]
    assert_isolated(result, server, attack)


def test_f6_request_ids_are_restricted_and_logs_stay_printable(server):
    attack = f6_request_ids
    result, out = attacked(server, "F6 request ids", attack, controlled=True)
    assert_400(out["header"], "X-Request-Id", "may contain only")
    assert_400(out["body"], "request_id", "may contain only")
    assert out["safe"]["status"] == 200 and out["safe"]["id"] == "cmpl-client-42.a:b", out
    log = server.log_file.read_bytes()
    assert b"\x1b" not in log and b"FAKE LOG LINE" not in log
    assert_isolated(result, server, attack)


# -- F7: idle and slow connections ------------------------------------------------------------------
FD_LIMIT = 256                  # -> the default --limit-concurrency: 256 - 128 = 128
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
WRITE_TIMEOUT_S = 2.0


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("isolation_f7") / "server.log"
    with RemoteOpenAIServer("--served-model-name", MODEL, "--max-model-len", "1024",
                            "--header-read-timeout", str(HEADER_TIMEOUT_S), "--body-read-timeout", str(BODY_TIMEOUT_S),
                            "--write-timeout", str(WRITE_TIMEOUT_S),
                            log_path=str(log), preexec_fn=_low_fd_limit) as s:
        s.log_file = log
        yield s


def test_f7_idle_and_half_sent_connections_are_closed(guarded_server):
    server = guarded_server
    log_size_before = server.log_file.stat().st_size

    async def attack(url, model):
        # More sockets than the server has file descriptors: half silent, half a partial request line.
        return await f7_idle_connections(url, model, num_sockets=300, hold_s=HEADER_TIMEOUT_S + 1.0,
                                         wait_close_s=HEADER_TIMEOUT_S + 5.0, body_wait_s=BODY_TIMEOUT_S + 10.0)
    result, out = attacked(server, "F7 idle connections", attack)
    assert out["closed"] == out["sockets"] == 300, out
    assert out["slow_body_closed"] and out["slow_body_closed_after_s"] < BODY_TIMEOUT_S + 5.0, out
    assert_isolated(result, server, attack)
    assert server.log_file.stat().st_size - log_size_before < 100_000


def test_f7_connection_cap_answers_503_when_every_connection_is_busy(guarded_server):
    url = guarded_server.url

    async def scenario() -> dict:
        busy = []
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        for _ in range(140):        # > 128: every connection mid-body, none idle
            busy.append(await open_connection(url, head))
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            over = await client.get("/health")
            over_error = error_of(over)
        await asyncio.sleep(BODY_TIMEOUT_S + 1.0)      # their bodies time out: room again
        for _, w in busy:
            w.close()
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            after = await client.get("/health")
        return {"over_status": over.status_code, "over_error": over_error, "after_status": after.status_code}
    out = asyncio.run(scenario())
    assert out["over_status"] == 503 and out["over_error"]["type"] == "ServiceUnavailableError", out
    assert "--limit-concurrency" in out["over_error"]["message"], out
    assert out["after_status"] == 200, out


def test_f7_a_flood_of_bad_requests_is_rate_limited_in_the_log(guarded_server):
    server = guarded_server
    before = server.log_file.read_bytes()

    async def flood() -> None:
        for _ in range(10):
            conns = [await open_connection(server.url, b"NOT HTTP AT ALL\r\n\r\n") for _ in range(30)]
            await asyncio.gather(*(closed_by_server(r, 10.0) for r, _ in conns))
            for _, w in conns:
                w.close()
    asyncio.run(flood())
    new = server.log_file.read_bytes()[len(before):]
    from vllm_anatomy.entrypoints.openai.log_guard import PER_KEY_BURST
    assert new.count(b"Invalid HTTP request received") <= PER_KEY_BURST + 2, new[-2000:]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_client_that_never_reads_its_stream_is_cut_off_and_its_request_aborted(guarded_server):
    """A stream whose client reads nothing: once its send buffers are full for --write-timeout,
    the connection is aborted and the request is aborted in the engine, long before its
    max_tokens (before the fix it ran to the end and its connection stayed open for ever)."""
    server = guarded_server
    before = server.metrics()
    length_key = 'vllm:request_success_total{finished_reason="length"}'
    log_size_before = server.log_file.stat().st_size
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
                       "n": 8, "logprobs": 20, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # a small window: the server's buffers fill
    sock.connect(("127.0.0.1", server.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        t0 = time.monotonic()
        # (900 tokens x 8 take minutes on this CPU; the buffers fill within seconds)
        while b"--write-timeout" not in server.log_file.read_bytes()[log_size_before:]:
            assert time.monotonic() - t0 < 120, "the stalled stream was never cut off"
            time.sleep(0.5)
        metrics = wait_idle(server, timeout=30)
        # Aborted: no longer running, none ran to its max_tokens, far fewer tokens than asked were made.
        assert metrics["vllm:num_requests_running"] == 0, metrics
        assert metrics.get(length_key, 0.0) == before.get(length_key, 0.0), metrics
        made = metrics["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        assert 0 < made < 8 * 900 / 2, made
        # What the client got is cut short: no [DONE].
        sock.settimeout(10)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionError, socket.timeout):
            pass
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received, received[-300:]
    finally:
        sock.close()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200

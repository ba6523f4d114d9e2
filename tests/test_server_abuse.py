"""Hostile and careless clients: no request can hurt another. Each defect of the abuse run has its
test here (each failed before its fix): one row's fault fails that row alone (batch isolation, with
each poisoned input sent beside 7 normal requests), subnormal temperatures, 400 instead of 500 (and a
500 logged once), tokenization off the event loop, bounded stop strings, connection limits, the
drain at shutdown, no local paths and loopback-only hosts without a key, drafter retries."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import httpx
import pytest
import torch

import specdecode.engine
from specdecode.drafters.base import DrafterBase, Proposal
from specdecode.drafters.guard import GuardedDrafter
from specdecode.sampling import NonFiniteProbabilities, SamplingParams, warp
from specdecode.server import protocol as P
from specdecode.server.cli import served_model_name
from specdecode.server.connections import ConnectionLimits, OncePerInterval, accept_error_handler
from specdecode.text import MAX_STOP_CHARS

from test_server_harness import one_torch_thread  # noqa: F401 (autouse fixture)
from test_server_harness import CLIENT_TIMEOUT_S, KEY, HeldSteps, engine, serve, sse_events, until

# the 7 bystanders: greedy and seeded samples, all long enough to share many steps with the poison
NORMAL = [
    {"prompt": p, "max_tokens": 24, "ignore_eos": True} | extra
    for p, extra in [
        ("abc", {"temperature": 0}),
        ("hello", {"temperature": 0.9, "seed": 1}),
        ("xyzzy", {"temperature": 0}),
        ("AbCdEf", {"temperature": 0.7, "top_p": 0.9, "seed": 2}),
        ("mmmm", {"temperature": 0}),
        ("kitten", {"temperature": 1.0, "top_k": 5, "seed": 3}),
        ("rst", {"temperature": 0}),
    ]
]
POISON_PROMPT = "Qqq"


def _json(r: httpx.Response):
    try:
        return r.json()
    except ValueError:
        return r.text


async def _send(client: httpx.AsyncClient, body) -> tuple[int, object]:
    if isinstance(body, str):  # raw text (invalid JSON, lone surrogates)
        r = await client.post(
            "/v1/completions",
            content=body.encode("utf-8", "surrogatepass"),
            headers={"content-type": "application/json"},
        )
    else:
        r = await client.post("/v1/completions", json=body)
    return r.status_code, _json(r)


def co_batched(s, bodies: list, queued: int) -> list[tuple[int, object]]:
    """Send ``bodies`` with the engine held: the first alone (it takes the first step), then the rest at
    once, released when ``queued`` requests wait in the server: the rest are admitted together and
    share every decoding step with the first and each other."""
    held = HeldSteps(s.scheduler.engine)

    def waiting(n: int) -> bool:
        return sum(map(s.scheduler.state().get, ("queued", "running"))) >= n

    async def run():
        async with httpx.AsyncClient(
            base_url=s.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=CLIENT_TIMEOUT_S, trust_env=False
        ) as client:
            first = asyncio.ensure_future(_send(client, bodies[0]))
            await asyncio.to_thread(until, lambda: waiting(1), "the first request in")
            rest = [asyncio.ensure_future(_send(client, b)) for b in bodies[1:]]
            await asyncio.to_thread(until, lambda: waiting(queued), "the requests queued")
            held.release()
            return await asyncio.gather(first, *rest)

    try:
        return asyncio.run(run())
    finally:
        held.release()


def alone(s, body: dict) -> dict:
    with s.http() as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()


def _poison_warp(monkeypatch):
    """Sampling raises for any batch holding a row at temperature 0.37 (as a bug in one row's warp would)."""
    real = specdecode.engine.warp

    def flaky(logits, temperature, top_k, top_p):
        if bool(((temperature - 0.37).abs() < 1e-6).any()):
            raise RuntimeError("simulated fault in one row's sampling")
        return real(logits, temperature, top_k, top_p)

    monkeypatch.setattr(specdecode.engine, "warp", flaky)


def _poison_drafter(s):
    """The drafter raises for any batch holding the poisoned prompt (as a bug on one row's input would)."""
    inner = s.scheduler.engine.drafter.inner
    real, poison = inner.propose, s.scheduler.engine.tokenizer(POISON_PROMPT).input_ids

    def flaky(seqs, ks):
        if any(seq.token_ids[: len(poison)] == poison for seq, k in zip(seqs, ks) if k):
            raise RuntimeError("simulated drafter fault on one row")
        return real(seqs, ks)

    inner.propose = flaky


POISONS = {  # name: (body, expected status of the poisoned request)
    "top_k 2**63": ({"prompt": POISON_PROMPT, "max_tokens": 16, "temperature": 0.8, "top_k": 2**63, "seed": 5}, 200),
    "temperature 1e-40": ({"prompt": POISON_PROMPT, "max_tokens": 16, "temperature": 1e-40}, 200),
    "16 stop strings of the longest length": (
        {
            "prompt": POISON_PROMPT,
            "max_tokens": 16,
            "temperature": 0.5,
            "seed": 7,
            "stop": ["Z" * (MAX_STOP_CHARS - 1) + str(i % 10) for i in range(P.MAX_STOP_STRINGS)],
        },
        200,
    ),
    "a lone surrogate": ('{"prompt": "Qq\\ud800", "max_tokens": 16}', 400),
    "nested JSON": ('{"prompt": "Qq", "stop": ' + "[" * 5000 + "]" * 5000 + "}", 400),
    "a fault in its sampling": ({"prompt": POISON_PROMPT, "max_tokens": 16, "temperature": 0.37}, 500),
    "a drafter fault on its row": ({"prompt": POISON_PROMPT, "max_tokens": 16, "temperature": 0}, 200),
}


@pytest.mark.parametrize("poison", list(POISONS))
def test_a_poisoned_request_never_hurts_the_seven_it_is_batched_with(poison, monkeypatch):
    body, status = POISONS[poison]
    with serve(engine(k=3, slots=8)) as s:
        before = [alone(s, b) for b in NORMAL]
        if poison == "a fault in its sampling":
            _poison_warp(monkeypatch)
        if poison == "a drafter fault on its row":
            _poison_drafter(s)
        results = co_batched(s, NORMAL[:1] + [body] + NORMAL[1:], queued=len(NORMAL) + (status != 400))
        (got_status, got), rest = results[1], results[:1] + results[2:]
        assert got_status == status, got
        for (st, out), ref in zip(rest, before):
            assert st == 200, out
            assert out["choices"][0]["text"] == ref["choices"][0]["text"]
            # the bystanders drafted as they do alone (a drafter fault of the poison is retried per row)
            assert {k: out["speculation"][k] for k in ("drafted", "accepted")} == {
                k: ref["speculation"][k] for k in ("drafted", "accepted")
            }
        assert sum(out["speculation"]["drafted"] for _, out in rest) > 0  # speculation was exercised
        if status == 400:
            assert set(got["error"]) == {"message", "type", "param", "code"}
        if status == 500:
            assert got["error"]["code"] == "internal_error"
        m = s.metrics()
        if poison == "a drafter fault on its row":
            assert m["specdecode_draft_failures_total"] == 1 and m["specdecode_draft_retries_total"] >= 2
            monkeypatch.undo()
        if status == 200 and poison != "a drafter fault on its row":
            # the poisoned request itself got the law it asked for: top_k past the vocabulary is off,
            # a subnormal temperature is greedy, stops that never occur change nothing
            same = {"top_k 2**63": {"top_k": 0}, "temperature 1e-40": {"temperature": 0}}.get(poison, {"stop": None})
            assert got["choices"][0]["text"] == alone(s, body | same)["choices"][0]["text"]
        s.wait_idle()


def test_subnormal_temperatures_are_greedy_and_nan_never_reaches_sampling():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    logits = torch.zeros(2, 8)
    logits[1, 3] = float("nan")
    t, k, p = torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0])
    with pytest.raises(NonFiniteProbabilities):
        warp(logits, t, k, p)
    assert warp(logits[:1], t[:1], k[:1], p[:1]).sum().item() == pytest.approx(1.0)  # control: a finite row
    # a top_k past any tensor's range is the same law as off (clamped by params_tensors, never overflows)
    from specdecode.sampling import params_tensors

    x = torch.randn(1, 8)
    huge, off = params_tensors([SamplingParams(temperature=1.0, top_k=2**63)]), params_tensors([SamplingParams(1.0)])
    assert torch.equal(warp(x, *huge), warp(x, *off))


@pytest.mark.parametrize(
    "path,raw,code",
    [
        ("/v1/completions", "[" * 5000 + "]" * 5000, "invalid_json"),  # RecursionError in the parser
        ("/v1/completions", '{"prompt": "a", "stop": ' + "[" * 40 + "]" * 40 + "}", "invalid_json"),
        ("/v1/completions", '{"prompt": "ab\\ud800"}', "invalid_unicode"),
        ("/v1/completions", '{"prompt": "ab", "stop": "\\udfff"}', "invalid_unicode"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "invalid_unicode"),
    ],
)
def test_request_caused_errors_are_400_not_500(path, raw, code):
    with serve(engine(k=3)) as s, s.http() as c:
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == code and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert c.post(
            path,
            content=raw.replace("\\ud800", "").replace("\\udfff", "x"),
            headers={"content-type": "application/json"},
        ).status_code in (200, 400)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_server_bug_is_a_500_with_the_error_body_logged_once(monkeypatch):
    def broken(req):
        raise RuntimeError("a bug in the server")

    records = _Records()
    loggers = [logging.getLogger(n) for n in ("specdecode", "uvicorn", "uvicorn.error", "")]
    with serve(engine(k=3)) as s, s.http() as c:
        for lg in loggers:  # (after uvicorn configured its loggers, which drops handlers added before)
            lg.addHandler(records)
        try:
            monkeypatch.setattr(P, "chat_messages", broken)
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
            assert "a bug" not in r.text and "Traceback" not in r.text
            assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200
        finally:
            for lg in loggers:
                lg.removeHandler(records)
    logged = {id(r): r for r in records.records if r.exc_info and "a bug in the server" in str(r.exc_info[1])}
    assert len(logged) == 1, [r.getMessage() for r in logged.values()]


class _HeldTokenizer:
    """The engine's tokenizer, except that encoding a text with ``HOLD`` in it waits until released."""

    def __init__(self, inner) -> None:
        self.inner, self.entered, self.release, self.calls = inner, threading.Event(), threading.Event(), 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, *args, **kwargs):
        self.calls += 1
        if "HOLD" in text:
            self.entered.set()
            self.release.wait(600)  # only a guard, so that a failed test still ends
        return self.inner(text, *args, **kwargs)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "HOLDabc", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "HOLDabc"}], "max_tokens": 3}),
    ],
)
def test_tokenizing_never_stalls_the_event_loop(path, body):
    """While one request's text is being tokenized, /health and other requests are answered (an
    ordering: the tokenizer is released only after they return)."""
    eng = engine(k=3)
    tok = eng.tokenizer = _HeldTokenizer(eng.tokenizer)
    with serve(eng) as s:
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=s.http().post(path, json=body)))
        thread.start()
        try:
            assert tok.entered.wait(CLIENT_TIMEOUT_S)
            with s.http() as c:
                assert c.get("/health").status_code == 200
                assert c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200
        finally:
            tok.release.set()
            thread.join(CLIENT_TIMEOUT_S)
        assert result["r"].status_code == 200, result["r"].text


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing():
    eng = engine(k=3)
    tok = eng.tokenizer = _HeldTokenizer(eng.tokenizer)
    with serve(eng) as s, s.http() as c:
        limit = s.app.state.max_prompt_chars
        r = c.post("/v1/completions", json={"prompt": "a" * (limit + 1)})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * (limit + 1)}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert tok.calls == 0
        r = c.post("/v1/completions", json={"prompt": "a" * limit})  # control: at the bound it is tokenized
        assert r.status_code == 400 and tok.calls == 1


def test_stop_strings_are_bounded_in_length():
    with serve(engine(k=3)) as s, s.http() as c:
        r = c.post("/v1/completions", json={"prompt": "abc", "stop": ["x" * (MAX_STOP_CHARS + 1)]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
        assert c.post("/v1/completions", json={"prompt": "abc", "stop": ["x" * MAX_STOP_CHARS]}).status_code == 200
    with pytest.raises(ValueError):
        SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),))


def _port(s) -> int:
    return int(s.url.rsplit(":", 1)[1])


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server closes the connection (EOF or reset); waits for it (a guard, not a bound)."""
    sock.settimeout(CLIENT_TIMEOUT_S)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _refused(sock: socket.socket) -> bool:
    """True when the server closes the connection without answering a byte."""
    sock.settimeout(CLIENT_TIMEOUT_S)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def _health_on(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(CLIENT_TIMEOUT_S)
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def test_a_slow_request_head_is_closed_fresh_or_after_a_response():
    with serve(engine(k=3), limits=ConnectionLimits(header_timeout_s=0.3)) as s:
        fresh = socket.create_connection(("127.0.0.1", _port(s)))
        fresh.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
        reused = socket.create_connection(("127.0.0.1", _port(s)))
        assert b" 200 " in _health_on(reused)
        reused.sendall(b"GET /health HTTP/1.1\r\n")
        assert _closed_by_server(fresh) and _closed_by_server(reused)
        with s.http() as c:  # the server serves on
            assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200


def test_connections_past_the_cap_are_closed_at_once():
    with serve(engine(k=3), limits=ConnectionLimits(header_timeout_s=600, max_connections=3)) as s:
        held = []
        for _ in range(3):  # open, seen by the server (a response), then holding half a request head
            sock = socket.create_connection(("127.0.0.1", _port(s)))
            assert b" 200 " in _health_on(sock)
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            held.append(sock)
        extra = socket.create_connection(("127.0.0.1", _port(s)))
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _refused(extra)  # closed at once, unanswered
        held.pop().close()

        def served() -> bool:
            try:
                return httpx.get(s.url + "/health", timeout=CLIENT_TIMEOUT_S, trust_env=False).status_code == 200
            except httpx.TransportError:
                return False

        until(served, "a connection is served again once one closed")
        for sock in held:
            sock.close()


def test_a_slow_body_gets_408():
    with serve(engine(k=3), body_timeout_s=0.3) as s:
        sock = socket.create_connection(("127.0.0.1", _port(s)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\""
        )
        sock.settimeout(CLIENT_TIMEOUT_S)
        reply = b""
        while b'"body_timeout"' not in reply:  # the head and the body may arrive in separate reads
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in reply
        sock.close()


def test_repeated_accept_errors_are_logged_once_per_interval(caplog):
    now = [0.0]
    limited = OncePerInterval("accept failed", interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="specdecode.server"):
        for i in range(1000):
            now[0] = i * 0.025  # 25 s of a flood
            limited("EMFILE")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "more in the last" in messages[1]

    loop, seen = asyncio.new_event_loop(), []
    try:
        loop.set_exception_handler(lambda lp, ctx: seen.append(ctx["message"]))
        handler = accept_error_handler(loop)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specdecode.server"):
            for _ in range(50):
                handler(loop, {"message": "socket.accept() out of system resource", "exception": OSError(24, "EMFILE")})
            handler(loop, {"message": "something else"})
        assert len(caplog.records) == 1 and seen == ["something else"]  # the rest goes where it went before
    finally:
        loop.close()


def test_past_the_graceful_timeout_open_requests_get_a_503_and_streams_end_properly():
    with serve(engine(k=3), graceful_timeout_s=0.2) as s:
        held = HeldSteps(s.scheduler.engine)
        replies = {}

        def plain():
            with s.http() as c:
                replies["plain"] = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 50})

        def stream():
            with (
                s.http() as c,
                c.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 50, "stream": True}) as r,
            ):
                replies["stream"] = (r.status_code, sse_events(r))

        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        try:
            for t in threads:
                t.start()
            until(lambda: sum(map(s.scheduler.state().get, ("queued", "running"))) == 2, "both requests in")
            s.server.should_exit = True  # as SIGTERM does
            for t in threads:
                t.join(CLIENT_TIMEOUT_S)
        finally:
            held.release()
        r = replies["plain"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        status, events = replies["stream"]
        assert status == 200 and events[-1] == "[DONE]"
        assert '"shutting_down"' in events[-2]


def test_the_served_model_name_shows_no_local_path(tmp_path):
    gguf = tmp_path / "qwen-1.5b-q4.gguf"
    gguf.write_bytes(b"GGUF")
    assert served_model_name(str(gguf)) == "qwen-1.5b-q4"
    assert served_model_name(str(tmp_path)) == tmp_path.name
    assert served_model_name("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"  # an alias
    assert served_model_name("Qwen/Qwen2.5-Coder-1.5B") == "Qwen/Qwen2.5-Coder-1.5B"  # a hub id


@pytest.mark.parametrize(
    "host,allowed,status",
    [
        ("127.0.0.1:8000", (), 200),
        ("localhost", (), 200),
        ("[::1]:8000", (), 200),
        ("127.0.0.2", (), 200),
        ("evil.example", (), 400),
        ("evil.example:8000", (), 400),
        ("10.0.0.5:8000", (), 400),
        ("api.example:443", ("api.example",), 200),
        ("evil.example", ("*",), 200),
    ],
)
def test_without_an_api_key_only_loopback_hosts_are_answered(host, allowed, status):
    with (
        serve(engine(k=3), api_key=None, allowed_hosts=allowed) as s,
        httpx.Client(base_url=s.url, timeout=CLIENT_TIMEOUT_S, trust_env=False) as c,
    ):
        r = c.get("/v1/models", headers={"host": host})
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["code"] == "invalid_host"
        assert c.get("/health", headers={"host": host}).status_code == 200  # public: probes need no Host rule


def test_with_an_api_key_the_key_decides_not_the_host():
    with serve(engine(k=3)) as s, httpx.Client(base_url=s.url, timeout=CLIENT_TIMEOUT_S, trust_env=False) as c:
        assert c.get("/v1/models", headers={"host": "evil.example"}).status_code == 401
        assert (
            c.get("/v1/models", headers={"host": "evil.example", "Authorization": f"Bearer {KEY}"}).status_code == 200
        )


class _RowDrafter(DrafterBase):
    """Proposes token ``10 + slot`` per position; any call with a row in ``bad`` raises."""

    name = "rows"

    def __init__(self, bad: set[int], tree: bool = False) -> None:
        self.bad, self.tree, self.calls = bad, tree, []

    def start(self, slots, prompts):
        self.calls.append(("start", list(slots)))
        if self.bad & set(slots):
            raise RuntimeError("bad row")

    def propose(self, seqs, ks):
        self.calls.append(("propose", [s.slot for s in seqs]))
        if self.bad & {s.slot for s, k in zip(seqs, ks) if k}:
            raise RuntimeError("bad row")
        width = max(ks)
        tokens = torch.tensor([[10 + s.slot] * width for s in seqs])
        parents = torch.tensor([[j - 1 for j in range(width)]] * len(seqs)) if self.tree else None
        return Proposal(tokens, None, torch.tensor(ks), parents, "deterministic" if self.tree else None)

    def release(self, slot):
        self.calls.append(("release", slot))


def _seq(slot):
    return type("S", (), {"slot": slot, "token_ids": [1, 2], "params": None, "generator": None})()


@pytest.mark.parametrize("tree", [False, True])
def test_a_drafter_fault_is_retried_row_by_row_and_only_the_culprit_falls_back(tree):
    inner, failures, retries = _RowDrafter(bad={2}, tree=tree), [], []
    guard = GuardedDrafter(inner, failures.append, lambda where, rows: retries.append((where, rows)))
    guard.start([0, 1, 2, 3], [[1], [1], [1], [1]])
    assert guard.live == {0, 1, 3} and retries == [("start", 4)] and failures == ["start"]
    inner.bad = {1}
    p = guard.propose([_seq(s) for s in range(4)], [2, 2, 2, 2])
    assert p.num_tokens.tolist() == [2, 0, 0, 2]  # slot 2 was already out; slot 1 fails alone
    assert p.tokens[0].tolist() == [10, 10] and p.tokens[3].tolist() == [13, 13]
    assert (p.parents is not None) == tree
    assert guard.live == {0, 3} and failures == ["start", "propose"] and retries[-1] == ("propose", 3)
    inner.bad = set()  # the next step: the survivors draft together again, in one call
    p = guard.propose([_seq(s) for s in range(4)], [2, 2, 2, 2])
    assert p.num_tokens.tolist() == [2, 0, 0, 2] and inner.calls[-1] == ("propose", [0, 1, 2, 3])


def test_a_top_p_below_float32s_range_keeps_the_top_token_and_a_trailing_slash_is_a_404():
    """Found by the fuzzer: top_p 5e-324 rounded to 0 in float32 and failed its batch's step; a
    trailing slash was answered by a 307 redirect with an empty body."""
    with serve(engine(k=3)) as s, s.http() as c:
        body = {"prompt": "abc", "max_tokens": 12, "temperature": 0.9, "seed": 3}
        r = c.post("/v1/completions", json=body | {"top_p": 5e-324})
        assert r.status_code == 200, r.text
        greedy = c.post("/v1/completions", json=body | {"temperature": 0}).json()["choices"][0]["text"]
        assert r.json()["choices"][0]["text"] == greedy  # a nucleus of one token: the argmax
        r = c.post("/v1/completions/", json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"

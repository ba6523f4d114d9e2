"""End-to-end: the real server on loopback with a tiny model, driven by the official `openai`
client (completions, chat, streaming) and by raw HTTP (bad input, auth, limits, load)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tiny import serving
from test_server_harness import one_torch_thread  # noqa: F401 (autouse fixture)
from test_server_harness import (
    CLIENT_TIMEOUT_S,
    KEY,
    MAX_LEN,
    MODEL,
    HeldSteps,
    engine,
    reference,
    serve,
    sse_events,
    tokenizer,
    until,
)

PROMPTS = ["abc", "hello", "xyzzy", "q", "AbCdEf", "mmmm", "zyx", "Qq", "hi", "kitten", "B", "rst"]


@pytest.fixture(scope="module")
def srv():
    with serve(engine(k=3, slots=4)) as s:
        yield s


@pytest.fixture(scope="module")
def chunked():
    """A server whose steps carry 6 tokens: every prompt here is prefilled a token or two per step."""
    with serve(engine(k=3, slots=4, max_num_batched_tokens=6, batched_tokens_per_seq=0)) as s:
        yield s


def ids(text: str) -> list[int]:
    return tokenizer()(text).input_ids


def chat_ids(messages: list[dict]) -> list[int]:
    tok = tokenizer()
    return tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    ).input_ids


# -- the openai client ----------------------------------------------------------------------------
def test_completion_matches_target_alone_and_reports_speculation(srv):
    r = srv.openai().completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0)
    text, finish, n = reference(ids("abc"), max_new_tokens=20)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, finish)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, n, 3 + n)
    spec = r.model_extra["speculation"]
    assert set(spec) >= {"drafted", "accepted", "acceptance_rate", "tokens_per_step"}
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["tokens_per_step"] == pytest.approx(n / spec["target_steps"])


def test_token_id_prompt_and_batch_of_one(srv):
    client = srv.openai()
    a = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=12, temperature=0)
    b = client.completions.create(model=MODEL, prompt=[[1, 2, 3]], max_tokens=12, temperature=0)
    assert a.choices[0].text == b.choices[0].text == reference([1, 2, 3], max_new_tokens=12)[0]


def test_chat_completion_uses_the_chat_template(srv):
    messages = [{"role": "system", "content": "bq"}, {"role": "user", "content": "hello"}]
    r = srv.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    text, finish, n = reference(chat_ids(messages), max_new_tokens=30)
    assert r.object == "chat.completion"
    assert (r.choices[0].message.role, r.choices[0].message.content, r.choices[0].finish_reason) == (
        "assistant",
        text,
        finish,
    )
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(chat_ids(messages)), n)
    assert "speculation" in r.model_extra


def test_chat_default_max_tokens_is_the_rest_of_the_context(srv):
    messages = [{"role": "user", "content": "abc"}]
    r = srv.openai().chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_LEN


def test_streaming_completion_equals_non_streaming(srv):
    client = srv.openai()
    full = client.completions.create(model=MODEL, prompt="kitten", max_tokens=40, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="kitten",
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == []
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")  # the times differ from request to request
    assert [getattr(chunks[-1].usage, k) for k in tokens] == [getattr(full.usage, k) for k in tokens]
    assert chunks[-1].usage.model_extra["time_to_first_token_s"] > 0
    assert chunks[-1].model_extra["speculation"] == full.model_extra["speculation"]


def test_streaming_chat_and_done_marker(srv):
    messages = [{"role": "user", "content": "xyz"}]
    chunks = list(
        srv.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=25, temperature=0, stream=True)
    )
    text, finish, _ = reference(chat_ids(messages), max_new_tokens=25)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish and "speculation" in chunks[-1].model_extra
    with (
        srv.http() as c,
        c.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "stream": True}) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])


def test_n_choices_are_the_seeded_requests_seed_plus_i(srv):
    """n = 3 at T = 1 with a seed: choice i is the request with seed + i run alone (each reproducible), streamed
    or not; usage counts the prompt once and every choice's tokens; speculation counts are the choices' sums."""
    client = srv.openai()
    kw = dict(model=MODEL, prompt="hello", max_tokens=8, temperature=1.0, seed=41)
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(**(kw | {"seed": 41 + i})) for i in range(3)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in r.choices}) > 1  # independent samples
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    spec = r.model_extra["speculation"]
    assert spec["drafted"] == sum(a.model_extra["speculation"]["drafted"] for a in alone) and spec["drafted"] > 0
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    texts, finished = ["", "", ""], set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == [c.text for c in r.choices] and finished == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_n_greedy_chat_choices_are_identical_and_stream_per_index(srv):
    client = srv.openai()
    messages = [{"role": "user", "content": "abc"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert (
        r.choices[0].message.content
        == r.choices[1].message.content
        == reference(chat_ids(messages), max_new_tokens=10)[0]
    )
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, n=2, stream=True)
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]  # each choice opens with its role
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [r.choices[0].message.content] * 2
    srv.wait_idle()


def test_models_route_and_unknown_model(srv):
    client = srv.openai()
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-nope", prompt="a", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_sampling_with_seed_is_reproducible(srv):
    client = srv.openai()
    runs = [
        client.completions.create(
            model=MODEL, prompt="abc", max_tokens=30, temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 20}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


# -- bad input over raw HTTP -------------------------------------------------------------------
def _body(**kw):
    return json.dumps({"prompt": "abc", "max_tokens": 4} | kw)


LONG = "ab" * MAX_LEN  # 256 tokens > MAX_LEN
BAD = [  # (case, body, status, param)
    ("malformed json", '{"prompt": "a",', 400, None),
    ("not an object", "[1, 2]", 400, None),
    ("missing prompt", '{"max_tokens": 3}', 400, "prompt"),
    ("empty prompt", _body(prompt=""), 400, "prompt"),
    ("empty token list", _body(prompt=[]), 400, "prompt"),
    ("prompt of wrong type", _body(prompt=5), 400, "prompt"),
    ("batched prompts", _body(prompt=["a", "b"]), 400, "prompt"),
    ("token id too large", _body(prompt=[1, 32]), 400, "prompt"),
    ("negative token id", _body(prompt=[1, -1]), 400, "prompt"),
    ("temperature NaN", '{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("temperature inf", '{"prompt": "a", "temperature": Infinity}', 400, "temperature"),
    ("temperature negative", _body(temperature=-0.5), 400, "temperature"),
    ("temperature above 2", _body(temperature=2.01), 400, "temperature"),
    ("temperature as string", _body(temperature="1"), 400, "temperature"),
    ("temperature as bool", _body(temperature=True), 400, "temperature"),
    ("top_p zero", _body(top_p=0), 400, "top_p"),
    ("top_p above 1", _body(top_p=1.5), 400, "top_p"),
    ("top_p NaN", '{"prompt": "a", "top_p": NaN}', 400, "top_p"),
    ("top_k negative", _body(top_k=-2), 400, "top_k"),
    ("top_k fractional", _body(top_k=2.5), 400, "top_k"),
    ("max_tokens zero", _body(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", _body(max_tokens=-3), 400, "max_tokens"),
    ("max_tokens fractional", _body(max_tokens=2.5), 400, "max_tokens"),
    ("max_tokens huge", _body(max_tokens=10**30), 400, None),
    ("prompt + max_tokens over the context", _body(max_tokens=MAX_LEN - 2), 400, None),
    ("prompt longer than the context", _body(prompt=LONG, max_tokens=1), 400, None),
    ("n above the cap", _body(n=17), 400, "n"),
    ("n zero", _body(n=0), 400, "n"),
    ("logprobs above 5", _body(logprobs=6), 400, "logprobs"),
    ("echo", _body(echo=True), 400, "echo"),
    ("penalty", _body(presence_penalty=2.5), 400, "presence_penalty"),
    ("unknown field", _body(temprature=0.5), 400, "temprature"),
    ("empty stop string", _body(stop=[""]), 400, "stop"),
    ("seed too large", _body(seed=2**70), 400, "seed"),
]
BAD_CHAT = [
    ("missing messages", '{"max_tokens": 3}', 400, "messages"),
    ("empty messages", '{"messages": []}', 400, "messages"),
    ("bad role", '{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role"),
    ("chat logprobs as a number", '{"messages": [{"role": "user", "content": "x"}], "logprobs": 1}', 400, "logprobs"),
    (
        "chat top_logprobs without logprobs",
        '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
        400,
        "top_logprobs",
    ),
]


def _assert_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text and "File \"" not in r.text
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    "path,case,body,status,param",
    [("/v1/completions", *c) for c in BAD] + [("/v1/chat/completions", *c) for c in BAD_CHAT],
    ids=[c[0] for c in BAD + BAD_CHAT],
)
def test_bad_requests_get_openai_errors(srv, path, case, body, status, param):
    with srv.http() as c:
        _assert_error(c.post(path, content=body, headers={"content-type": "application/json"}), status, param)


def test_context_boundary_is_exact(srv):
    prompt = "abcd"
    with srv.http() as c:
        ok = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_LEN - 4, "ignore_eos": True})
        over = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_LEN - 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == MAX_LEN - 4
    assert _assert_error(over, 400)["code"] == "context_length_exceeded"


def test_content_type_body_size_and_unknown_route(srv):
    with srv.http() as c:
        _assert_error(c.post("/v1/completions", content=_body(), headers={"content-type": "text/plain"}), 415)
        _assert_error(c.post("/v1/completions", data={"prompt": "a"}), 415)
        big = json.dumps({"prompt": "a" * (2 << 20)})
        _assert_error(c.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
        _assert_error(c.get("/v1/nothing-here"), 404)
        _assert_error(c.get("/v1/completions"), 405)
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/no-such-route"),
    ],
)
@pytest.mark.parametrize("key", [None, "wrong-key", KEY + "x", ""])
def test_api_key_required_except_health(srv, method, path, key):
    with srv.http(key=key) as c:
        r = c.request(method, path, json={"prompt": "a"} if method == "POST" else None)
        _assert_error(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/health").status_code == 200


# -- correctness and robustness under load -----------------------------------------------------
def _cases() -> list[dict]:
    """Greedy requests with EOS, stop strings and length limits landing anywhere in a step."""
    rng = random.Random(0)
    cases = []
    for i, prompt in enumerate(PROMPTS * 2):
        case = {"prompt": prompt, "max_tokens": rng.randint(1, 40), "temperature": 0}
        if i % 3 == 1:
            case["ignore_eos"] = True
        if i % 4 == 2:
            text, _, _ = reference(ids(prompt), max_new_tokens=40, ignore_eos=True)
            start = rng.randint(1, max(1, len(text) - 3))
            case["stop"] = [text[start : start + rng.randint(1, 3)], "ZZZZ"]
            case["ignore_eos"] = True
        if i % 5 == 3:
            case["speculation"] = False
        cases.append(case)
    return cases


def _expected(case: dict) -> tuple[str, str, int]:
    return reference(
        ids(case["prompt"]),
        max_new_tokens=case["max_tokens"],
        stop=tuple(case.get("stop", ())),
        ignore_eos=case.get("ignore_eos", False),
    )


async def _post(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, dict | str]:
    if not body.get("stream"):
        r = await client.post(path, json=body)
        return r.status_code, r.json()
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread())
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return 200, {
        "text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
        "finish_reason": chunks[-1]["choices"][0]["finish_reason"],
        "speculation": chunks[-1]["speculation"],
    }


def _client(srv) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=CLIENT_TIMEOUT_S, trust_env=False
    )


@pytest.mark.parametrize("server", ["srv", "chunked"])
def test_concurrent_greedy_requests_equal_each_request_alone(server, request):
    srv = request.getfixturevalue(server)
    cases = _cases()
    expected = [_expected(c) for c in cases]
    stream = [i % 2 == 0 for i in range(len(cases))]

    async def run():
        async with _client(srv) as client:
            return await asyncio.gather(
                *[_post(client, "/v1/completions", c | {"stream": s}) for c, s in zip(cases, stream)]
            )

    results = asyncio.run(run())
    accepted = 0
    for case, s, (status, got), (text, finish, n) in zip(cases, stream, results, expected):
        assert status == 200, got
        choice = got if s else got["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (text, finish), case
        if not s:
            assert got["usage"]["completion_tokens"] == n
        spec = got["speculation"]
        if case.get("speculation") is False:
            assert spec["drafted"] == 0
        accepted += spec["accepted"]
    assert accepted > 0
    assert any(f == "stop" for _, f, _ in expected) and any(f == "length" for _, f, _ in expected)
    srv.wait_idle()


def test_seeded_samples_under_concurrency_and_chunked_prefill_equal_each_request_alone(chunked):
    bodies = [
        {"prompt": p * 3, "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "seed": i, "ignore_eos": True}
        for i, p in enumerate(PROMPTS[:8])
    ]
    with chunked.http() as c:
        alone = [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]

    async def run():
        async with _client(chunked) as client:
            return await asyncio.gather(*[_post(client, "/v1/completions", b) for b in bodies])

    results = asyncio.run(run())
    assert [got["choices"][0]["text"] for _, got in results] == alone
    chunked.wait_idle()


def test_many_requests_with_random_cancels_leave_no_trace(srv):
    """48 simultaneous requests (completions and chat, streamed or not, greedy or sampled); about
    40% are abandoned at a random moment: while queued, in prefill, decoding or streaming."""
    rng = random.Random(1)

    async def one(client, i):
        body = {
            "prompt": rng.choice(PROMPTS),
            "max_tokens": rng.randint(1, 60),
            "stream": rng.random() < 0.5,
            "temperature": rng.choice([0, 0.8]),
            "ignore_eos": rng.random() < 0.5,
        }
        path = "/v1/completions"
        if i % 4 == 0:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": body.pop("prompt")}]
        cancel_after = rng.uniform(0, 1.0) if rng.random() < 0.4 else None
        task = asyncio.ensure_future(_post_chat_or_completion(client, path, body))
        if cancel_after is not None and not (await asyncio.wait({task}, timeout=cancel_after))[0]:
            task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return None

    async def left_mid_stream(client):
        """Abandoned for certain while the server holds it (the random cancels above are clocked, and
        on a busy machine they may all fire before their requests are sent): it leaves after its
        first streamed chunk, with over a hundred steps (one token each) still to go."""
        body = {"prompt": "abc", "max_tokens": MAX_LEN - 3, "ignore_eos": True, "stream": True, "speculation": False}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return None  # closes the connection mid-stream
        raise AssertionError("the stream ended without a chunk")

    async def run():
        async with _client(srv) as client:
            assert (await client.get("/health")).status_code == 200  # connect once: cancels hit the server
            return await asyncio.gather(*[one(client, i) for i in range(48)], left_mid_stream(client))

    aborts = 'specdecode_requests_total{finish_reason="abort"}'
    before = srv.metrics()
    results = asyncio.run(run())
    statuses = [r[0] for r in results if r is not None]
    assert statuses and all(s < 500 for s in statuses), statuses
    srv.wait_idle()
    # the abort is counted just after its slot is freed: wait for the count, not for a clock
    until(lambda: srv.metrics().get(aborts, 0) > before.get(aborts, 0), "no request was aborted")
    after = srv.wait_idle()
    five_xx = sum(v for k, v in after.items() if k.startswith("specdecode_http_requests_total") and 'code="5' in k)
    assert five_xx == 0
    with srv.http() as c:  # still serving
        assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code == 200


async def _post_chat_or_completion(client, path, body):
    if path == "/v1/completions":
        return await _post(client, path, body)
    if not body.get("stream"):
        r = await client.post(path, json=body)
        return r.status_code, r.json()
    async with client.stream("POST", path, json=body) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return r.status_code, lines


def test_queue_full_gets_429_and_admitted_requests_complete():
    eng = engine(k=3, slots=1)
    held = HeldSteps(eng)  # no step until the test says: nothing finishes while the six arrive
    with serve(eng, max_queue=1) as s:
        body = {"prompt": "abc", "max_tokens": 60, "ignore_eos": True, "temperature": 0}

        async def run():
            async with _client(s) as client:
                posts = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(6)]
                # one slot and one queue place: with the engine held, four (or five) answers come back at once
                pending = set(posts)
                while len(pending) > 2:  # (120 s: a guard only, against a server that never turns one away)
                    done, pending = await asyncio.wait(pending, timeout=120, return_when=asyncio.FIRST_COMPLETED)
                    assert done, "no answer while the engine was held"
                held.release()
                return await asyncio.gather(*posts)

        try:
            responses = asyncio.run(run())
        finally:
            held.release()
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        text, _, _ = reference(ids("abc"), max_new_tokens=60, ignore_eos=True)
        for r in responses:
            if r.status_code == 429:
                assert _assert_error(r, 429)["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
            else:
                assert r.json()["choices"][0]["text"] == text
        s.wait_idle()


def test_disconnect_while_streaming_or_queued_frees_the_slot():
    eng = engine(k=3, slots=1)
    held = HeldSteps(eng, permits=1)  # one step (the first chunk), then the engine waits for the test
    aborts = 'specdecode_requests_total{finish_reason="abort"}'
    with serve(eng, max_queue=4) as s:
        try:
            long = {"prompt": "abc", "max_tokens": MAX_LEN - 3, "ignore_eos": True, "stream": True}
            with s.http() as c, c.stream("POST", "/v1/completions", json=long) as r:
                lines = r.iter_lines()  # held: a dropped iterator would close the connection
                next(lines)  # admitted and decoding; the engine now waits before its second step
                with s.http() as c2, pytest.raises(httpx.ReadTimeout):
                    c2.post("/v1/completions", json=long | {"stream": False}, timeout=0.3)  # waits in the queue
                assert s.metrics()["specdecode_queue_depth"] <= 1
            # both clients are gone; once the server has seen it, the engine may go on
            running = s.scheduler._running
            until(
                lambda: (
                    s.metrics()["specdecode_queue_depth"] == 0
                    and s.metrics().get(aborts) == 1
                    and len(running) == 1
                    and all(h.cancelled for h in list(running.values()))
                ),
                "the server did not notice both clients leaving",
            )
        finally:
            held.release()
        # the stream is aborted between steps and the queued one never runs
        until(lambda: s.metrics().get(aborts) == 2, "the stream was not aborted")
        m = s.wait_idle()
        assert m[aborts] == 2
        assert m["specdecode_generation_tokens_total"] < MAX_LEN - 3


def test_a_queued_request_whose_client_left_leaves_the_queue_at_once():
    eng = engine(k=3, slots=1)
    held = HeldSteps(eng, permits=1)  # one step, then the engine's next call lasts until the test releases it
    aborts = 'specdecode_requests_total{finish_reason="abort"}'

    with serve(eng, max_queue=4) as s:
        long = {"prompt": "abc", "max_tokens": MAX_LEN - 3, "ignore_eos": True, "stream": True}
        try:
            with s.http() as c, c.stream("POST", "/v1/completions", json=long) as r:
                lines = r.iter_lines()  # held: a dropped iterator would close the connection
                next(lines)  # admitted and decoding; the engine now waits inside its next call
                for _ in range(3):  # each waits in the queue until its client gives up
                    with s.http() as c2, pytest.raises(httpx.ReadTimeout):
                        c2.post("/v1/completions", json=long | {"stream": False}, timeout=0.2)
                # all three leave the queue while the engine is still inside that one call
                until(lambda: s.metrics().get(aborts) == 3, "the queued requests did not leave the queue")
                m = s.metrics()
                assert m["specdecode_queue_depth"] == 0 and m["specdecode_running_requests"] == 1
                assert m[aborts] == 3
        finally:
            held.release()
        s.wait_idle()


@pytest.mark.parametrize("budget, per_seq", [(12, 0), (8, 10)])
def test_long_prompt_is_prefilled_in_chunks_while_a_stream_decodes(budget, per_seq):
    """A long prompt arriving while a request decodes is prefilled a bounded chunk per step, the
    running request emitting tokens between its chunks; both answers equal the requests alone. With
    ``batched_tokens_per_seq`` the step budget is that many tokens per admitted request (two here)
    when that is more than ``max_num_batched_tokens``: chunks bigger than the fixed budget, never
    bigger than the scaled one."""
    eng = engine(k=3, slots=4, max_num_batched_tokens=budget, batched_tokens_per_seq=per_seq)
    gate, step, prefill, log, armed = threading.Event(), eng.step, eng.target.prefill, [], [True]
    gate.set()

    def held_step():
        gate.wait(600)  # the test opens it again (600 s: a guard only)
        events = step()
        if armed[0] and any(ev.new_token_ids for ev in events):  # the first request's first token:
            armed[0] = False  # hold the engine before its next step (here, not from the test's thread, so
            gate.clear()  # the first request cannot finish before the long one arrives, however fast)
        return events

    eng.step = held_step

    def logged_prefill(slots, prompts, layers=(), starts=None):
        running = [len(s.output_ids) for s in eng.running]
        log.append((sum(len(p) for p in prompts), running))
        return prefill(slots, prompts, layers, starts=starts)

    eng.target.prefill = logged_prefill
    first = {"prompt": "abc", "max_tokens": MAX_LEN - 3, "ignore_eos": True, "temperature": 0}
    prompt = "".join(random.Random(5).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(60))
    long = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0}

    async def arrived(condition, what):
        deadline = time.monotonic() + 120  # generous; ends as soon as the condition holds
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def run(s):
        async with _client(s) as client:
            a = asyncio.ensure_future(client.post("/v1/completions", json=first))
            await arrived(lambda: not armed[0], "the first request did not start")
            b = asyncio.ensure_future(client.post("/v1/completions", json=long))
            # queued, or already given a slot by a loop iteration that began before the gate closed (its
            # prefill has not started either way: the engine is held before its next step)
            await arrived(
                lambda: s.scheduler.state()["queued"] == 1 or eng.prefilling, "the long request did not arrive"
            )
            gate.set()
            return await asyncio.gather(a, b)

    with serve(eng) as s:
        try:
            responses = asyncio.run(run(s))
        finally:
            gate.set()
    assert (
        responses[0].json()["choices"][0]["text"]
        == reference(ids("abc"), max_new_tokens=MAX_LEN - 3, ignore_eos=True)[0]
    )
    assert responses[1].json()["choices"][0]["text"] == reference(ids(prompt), max_new_tokens=12, ignore_eos=True)[0]
    chunks = [(n, running[0]) for n, running in log[1:]]  # after the first request's own prefill
    bound = max(budget, 2 * per_seq)
    assert sum(n for n, _ in chunks) == len(ids(prompt)) - 1 and len(chunks) >= (len(ids(prompt)) - 1) / bound
    assert all(n <= bound for n, _ in chunks) and len(chunks) >= 3
    if per_seq:  # the running row's verify window (4) comes off the scaled budget: 20 - 4
        assert max(n for n, _ in chunks) == 16 > budget
    emitted = [tokens for _, tokens in chunks]
    assert emitted == sorted(set(emitted))  # the running request advanced between every two chunks


def test_speculation_off_for_the_server():
    with serve(engine(k=3), speculation=False) as s:
        r = s.openai().completions.create(model=MODEL, prompt="hello", max_tokens=20, temperature=0)
        assert r.model_extra["speculation"]["drafted"] == 0
        assert r.choices[0].text == reference(ids("hello"), max_new_tokens=20)[0]
        assert s.metrics()["specdecode_speculation_enabled"] == 0


def test_a_quantized_target_is_marked_lossy_in_every_response():
    eng = engine(k=3)
    eng.target_quantization = "int8"  # what build sets for --target-quantization int8
    eng.lossy = {"target_quantization": "int8"}
    with serve(eng) as s:
        r = s.openai().completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
        assert r.model_extra["speculation"]["lossy"] is True
        assert r.model_extra["speculation"]["target_quantization"] == "int8"
    with serve(engine(k=3)) as s:
        r = s.openai().completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
        assert "lossy" not in r.model_extra["speculation"]


def test_a_tree_drafting_server_answers_concurrent_greedy_requests_like_target_only():
    from specdecode.config import EngineSettings
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.engine import Engine
    from specdecode.models.hf import HFRunner
    from test_server_harness import pair

    target, draft = pair()
    eng = Engine(
        HFRunner(target),
        tokenizer(),
        DraftModelDrafter(HFRunner(draft), tree_topk=2, tree_nodes=6),
        3,
        EngineSettings(max_batch_size=3, max_context=MAX_LEN, **serving()),
    )
    prompts = ["abc", "hello", "xyz", "tree"]
    with serve(eng) as s:
        client = s.openai()
        with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: the batch holds several trees at once
            responses = list(
                pool.map(
                    lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0), prompts
                )
            )
    for p, r in zip(prompts, responses):
        assert r.choices[0].text == reference(ids(p), max_new_tokens=16)[0]
    assert sum(r.model_extra["speculation"]["nodes"] for r in responses) > 0

"""Structured outputs no request can turn against the server (issue 59), over HTTP: a spec that crashes the
grammar compiler (a forced segfault in the sandbox child), long $ref / rule chains, pathological regexes,
unsatisfiable and never-ending grammars, and a request that drives a shared spec's lexer into its limit —
each answered 400 (``invalid_grammar``, naming the bound) or 200 with a clean end, never a 5xx; bystanders
decoding at the same time get the outputs they get alone; the server serves on. Tiny model, built in code."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_grammar_limits import any_of_chain, lark_chain, ref_chain
from test_server_harness import CHAT_TEMPLATE, one_torch_thread, pair, serve  # noqa: F401 (autouse fixture)
from tiny import make_engine, make_tokenizer, serving

CACHE_POISON = "x[A-C]{3}|a(b{1000}){1000}"  # the spec in the tiny vocabulary (letters, no digits)
A, X = 0, 23  # token ids of "a" and "x"


@pytest.fixture(scope="module")
def server():
    tok = make_tokenizer(32)  # its own tokenizer object: its own grammar compiler, sandbox and fault marker
    tok.chat_template = CHAT_TEMPLATE
    target, draft = pair()
    eng = make_engine(target, tok, draft, k=3, num_slots=8, max_len=128, **serving())
    eng.grammars.start_sandbox(fault_marker="FAULT")  # the server's startup keeps this one (idempotent)
    with serve(eng) as s:
        yield s
    eng.grammars.close()


POISON = [  # (extra body fields, status, param, words in the message)
    ({"regex": "FAULT:crash"}, 400, "regex", "crashed"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(2500)}}},
        400,
        "response_format",
        "max_schema_depth",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": any_of_chain(1000)}}},
        400,
        "response_format",
        "max_schema_depth",
    ),
    ({"grammar": lark_chain(4000)}, 400, "grammar", "max_rule_depth"),
    ({"regex": "(x{2000}){500}"}, 400, "regex", "max_matcher_bytes"),
    ({"regex": "a{1000000}"}, 400, "regex", "max_matcher_bytes"),
    ({"regex": "((x{100}){100}){100}"}, 400, "regex", "max_matcher_bytes"),
    ({"regex": "[a&&b]"}, 400, "regex", "vocabulary"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}},
        400,
        "response_format",
        "",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
                },
            }
        },
        400,
        "response_format",
        "",
    ),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", "vocabulary"),  # letters: no "{"
    ({"grammar": 'start: "a" start'}, 200, None, ""),
    ({"grammar": 'start: "a" <[31]> "b"'}, 200, None, ""),  # the end token mid-output
    ({"regex": CACHE_POISON, "logit_bias": {str(A): 100}}, 200, None, ""),
]
BYSTANDERS = [
    {"prompt": "abcab", "max_tokens": 16, "temperature": 0},
    {"prompt": "hello", "max_tokens": 12, "temperature": 0, "regex": "[a-e]+f?"},
    {"prompt": "cab", "max_tokens": 10, "temperature": 0.9, "seed": 7, "sampler": "coupled"},
]


def _text(r) -> str:
    return r.json()["choices"][0]["text"]


def test_poison_specs_answer_cleanly_and_bystanders_are_unchanged(server):
    with server.http() as c:
        alone = [_text(c.post("/v1/completions", json=b)) for b in BYSTANDERS]
        restarts = server.scheduler.engine.grammars.sandbox.restarts

        def send(body):
            return c.post("/v1/completions", json=body)

        poison = [{"prompt": "abc", "max_tokens": 8, "temperature": 0} | extra for extra, *_ in POISON]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(send, BYSTANDERS * 2 + poison + BYSTANDERS))
        assert [_text(r) for r in answers[:6] + answers[-3:]] == alone * 3
        for r, (extra, status, param, words) in zip(answers[6:-3], POISON):
            assert r.status_code == status, (extra, r.text)
            if status == 400:
                error = r.json()["error"]
                assert error["param"] == param and error["code"] == "invalid_grammar", error
                assert words in error["message"], error
            else:
                assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
        assert server.scheduler.engine.grammars.sandbox.restarts == restarts + 1  # the crash cost the child
        assert c.get("/health").status_code == 200
        assert [_text(send(b)) for b in BYSTANDERS] == alone


def test_a_request_that_exhausts_a_shared_specs_lexer_harms_no_later_request(server):
    """Request A, biased toward "a", drives the spec's lexer toward its limit; B (same spec, biased toward
    "x") still gets a complete match. With matchers copied from one cached root, B got a 500."""
    with server.http() as c:
        for _ in range(2):
            r = c.post(
                "/v1/completions",
                json={"prompt": "abc", "max_tokens": 12, "regex": CACHE_POISON, "logit_bias": {str(A): 100}},
            )
            assert r.status_code == 200, r.text
        r = c.post(
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": 12, "regex": CACHE_POISON, "logit_bias": {str(X): 100}},
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"][0] == "x" and len(choice["text"]) == 4 and choice["finish_reason"] == "stop", choice


@pytest.mark.parametrize(
    "extra",
    [
        {"regex": "a+", "json_whitespace": "flexible"},
        {"json_whitespace": "compact"},
        {"response_format": {"type": "json_object"}, "json_whitespace": "loose"},
    ],
)
def test_json_whitespace_applies_to_json_only(server, extra):
    with server.http() as c:
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4} | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == "json_whitespace", r.text


def test_the_sandbox_restarts_after_each_crash(server):
    grammars = server.scheduler.engine.grammars
    with server.http() as c:
        for i in range(3):
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "regex": f"FAULT:crash{i}"})
            assert r.status_code == 400 and "crashed" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "regex": f"[a-e]{{{i + 1}}}"})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    assert json.dumps(grammars.limits.parser_dict())  # the limits are plain data (docs/server.md lists them)


@pytest.fixture(scope="module")
def bystanders_alone(server):
    from test_server_abuse import NORMAL, alone

    return [alone(server, b) for b in NORMAL]


@pytest.mark.parametrize(
    "i", range(len(POISON)), ids=[f"{status}-{next(iter(extra))}-{n}" for n, (extra, status, *_) in enumerate(POISON)]
)
def test_each_poison_spec_batched_with_seven_bystanders_leaves_them_unchanged(server, bystanders_alone, i):
    """Batch isolation (as tests/test_server_abuse.py's): the poison request shares every decoding step
    with seven greedy and seeded bystanders (a 400 never reaches the engine), whose texts and speculation
    equal theirs alone."""
    from test_server_abuse import NORMAL, co_batched

    extra, status, *_ = POISON[i]
    body = {"prompt": "abc", "max_tokens": 16, "temperature": 0} | extra
    results = co_batched(server, NORMAL[:1] + [body] + NORMAL[1:], queued=len(NORMAL) + (status != 400))
    (got_status, got), rest = results[1], results[:1] + results[2:]
    assert got_status == status, got
    for (code, out), ref in zip(rest, bystanders_alone):
        assert code == 200, out
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
        assert {k: out["speculation"][k] for k in ("drafted", "accepted")} == {
            k: ref["speculation"][k] for k in ("drafted", "accepted")
        }
    server.wait_idle()


def test_a_known_spec_is_not_queued_behind_new_specs_waiting_on_the_sandbox(server):
    """New specs wait on the sandbox (here held by the test: as if it worked on a poison spec); enough of them
    occupy every grammar thread. A request whose spec the server has served before needs no sandbox job and
    is answered meanwhile. It used to queue behind them (found by docs/bench/structured/poison_load.py: a
    cached-schema stream's first token waited 1.5 s under 2 poison specs per second)."""
    known = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "regex": "[a-e]+f"}
    sandbox = server.scheduler.engine.grammars.sandbox
    with server.http() as c:
        assert c.post("/v1/completions", json=known).status_code == 200
        with ThreadPoolExecutor(4) as pool:
            with sandbox._lock:
                waiting = [
                    pool.submit(c.post, "/v1/completions", json=known | {"regex": f"[a-e]{{{i + 2}}}g"})
                    for i in range(3)
                ]
                r = pool.submit(c.post, "/v1/completions", json=known).result(timeout=60)
                assert r.status_code == 200, r.text
                assert not any(f.done() for f in waiting)  # they did wait on the sandbox
            assert all(f.result().status_code == 200 for f in waiting)

"""Property-based API fuzzing of the OpenAI-compatible server (hypothesis, a real server on loopback).

Request bodies for ``/v1/completions`` and ``/v1/chat/completions`` mix well-formed values with hostile
ones: every known field with right and wrong JSON types, numbers at and past their range edges (huge
integers, subnormal floats, ``NaN`` and ``1e400`` written raw), lone surrogates, NUL, long and exotic
strings, unknown keys, deep nesting, odd prompts and chat messages; structured outputs (JSON schemas,
regexes and grammars, hostile ones often: deep ``$ref`` and rule chains, repetition blow-ups, unsatisfiable
classes, never-ending grammars, an end token mid-grammar); plus raw bodies (not JSON, not an object, wrong
content type, empty, too large) and odd methods and paths.

The property, for every request: the status is 2xx or 4xx, never 5xx; a 4xx carries exactly OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}``; a streamed 200 ends with
``data: [DONE]`` and any error event in it has the same shape and is no server error; a tiny nonzero
temperature answers as greedy does. After the run the server still answers ``/health`` and a greedy
request exactly as before it.

``SPECDECODE_FUZZ_EXAMPLES`` sets the examples per fuzz test (default 300: about a minute on 2 CPU
cores). ``scripts/fuzz_server.py`` runs these strategies for longer, against this tiny server or any
endpoint, and collects every 5xx instead of stopping at the first.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from hypothesis import HealthCheck, given, settings  # (a dev dependency: never skipped)
from hypothesis import strategies as st

from test_server_harness import one_torch_thread  # noqa: F401 (autouse fixture)
from test_server_harness import KEY, MODEL, engine, serve

EXAMPLES = int(os.environ.get("SPECDECODE_FUZZ_EXAMPLES", "300"))
TIMEOUT_S = 120.0  # per request: only a guard against a hang, never a speed check
ERROR_KEYS = {"message", "type", "param", "code"}
GREEDY_PROBE = {"prompt": "abc", "max_tokens": 20, "temperature": 0}
VOCAB_CHARS = "abcdefghijklmnopqrstuvwxyzABCDE"  # the tiny tokenizer's 31 characters (then <eos>)


# -- bodies: JSON text with hostile literals ------------------------------------------------------
class Raw(str):
    """JSON text written into the body verbatim (``NaN``, ``1e400``, 5000 levels of ``[``...)."""


def to_json(value: Any, ascii_only: bool = True) -> str:
    """JSON text of ``value``; :class:`Raw` parts go in as they are. With ``ascii_only`` a lone
    surrogate becomes the escape ``\\ud800``; without it, raw (then the body is not valid UTF-8)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{to_json(str(k), ascii_only)}:{to_json(v, ascii_only)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(to_json(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)  # floats: NaN / Infinity as Python writes them


@dataclass(frozen=True)
class Case:
    """One HTTP request. ``value`` is the body before serialization (None for raw bodies)."""

    path: str
    body: bytes
    method: str = "POST"
    content_type: str | None = "application/json"
    auth: bool = True
    value: Any = field(default=None, compare=False)

    def __repr__(self) -> str:  # hypothesis prints the falsifying case: keep a 1 MiB body out of it
        return f"Case({self.shown(500)})"

    def shown(self, limit: int = 2000) -> str:
        text = self.body.decode("utf-8", "backslashreplace")
        text = text if len(text) <= limit else f"{text[:limit]}... ({len(self.body)} bytes)"
        return f"{self.method} {self.path} content-type={self.content_type!r} auth={self.auth} body={text}"


def json_case(path: str, value: Any, ascii_only: bool = True) -> Case:
    return Case(path, to_json(value, ascii_only).encode("utf-8", "surrogatepass"), value=value)


# -- strategies -------------------------------------------------------------------------------------
def rarely(common: st.SearchStrategy, rare: st.SearchStrategy, one_in: int = 4) -> st.SearchStrategy:
    """``rare`` one time in ``one_in``, else ``common`` (which shrinking prefers)."""
    return st.sampled_from(range(one_in)).flatmap(lambda i: rare if i == one_in - 1 else common)


HUGE_INTS = [
    2**31 - 1,
    2**31,
    -(2**31),
    2**53 + 1,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    2**64 - 1,
    2**64,
    2**80,
    -(2**80),
    10**30,
]
EDGE_INTS = [0, 1, -1, 2, 31, 32, 127, 128, *HUGE_INTS]
EDGE_FLOATS = [
    0.0,
    -0.0,
    5e-324,
    1e-40,
    -1e-40,
    1e-300,
    1e-12,
    1e-6,
    1e-5,
    0.5,
    0.9999999999999999,
    1.0,
    1.0000000000000002,
    2.0,
    2.0000000000000004,
    100.0,
    1e308,
    -1e308,
    1.7976931348623157e308,
]
RAW_NUMBERS = [
    Raw(x)
    for x in (
        "NaN",
        "-NaN",
        "Infinity",
        "-Infinity",
        "1e400",
        "-1e400",
        "1e-400",
        "-0",
        "1E2",
        "1.0",
        "0e0",
        "1" * 5000,
        "0." + "0" * 400 + "1",
    )
]
HOSTILE_STRINGS = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\ud800",
    "\udfff",
    "a\ud800b",
    "\udc00\ud800",
    "\ufeff",
    "\u2028",
    "\uffff",
    "\U0010ffff",
    "é",
    "日本語",
    "😀" * 50,
    "<eos>",
    "a<eos>b",
    "{{ messages }}",
    "{% for x in range(10**9) %}",
    "\r\n",
    "\\",
    '"',
    "abc" * 3000,
    "\x1b[31m",
    "null",
]


def deep(depth: int, open_: str, close: str) -> Raw:
    return Raw(open_ * depth + "1" + close * depth)


DEEP = [
    deep(33, "[", "]"),
    deep(100, "[", "]"),
    deep(1000, "[", "]"),
    deep(3000, '{"a":', "}"),
    deep(5000, "[", "]"),
]  # shallowest first: shrinking keeps the shallowest that fails

vocab_text = st.text(VOCAB_CHARS, min_size=1, max_size=30)
strings = st.one_of(
    vocab_text,
    st.text(max_size=40),
    st.sampled_from(HOSTILE_STRINGS),
    rarely(st.text(max_size=20), st.text(st.characters(codec=None), max_size=20)),
)  # + surrogates
ints = st.one_of(st.integers(-3, 40), st.sampled_from(EDGE_INTS), st.integers())
floats = st.one_of(st.floats(-3, 3), st.sampled_from(EDGE_FLOATS), st.floats())  # NaN, inf: written raw
numbers = st.one_of(ints, floats, st.sampled_from(RAW_NUMBERS))
scalars = st.one_of(st.none(), st.booleans(), numbers, strings)
# any JSON value: the wrong type for a field, an unknown key's value; sometimes deeply nested
nested = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings, inner, max_size=4), max_leaves=8
)
junk = rarely(nested, st.sampled_from(DEEP), one_in=10)
unknown_keys = st.one_of(
    st.sampled_from(
        [
            "functions",
            "tools",
            "response_format",
            "logit_bias ",
            "Prompt",
            "",
            "__proto__",
            "max_tokens\x00",
            "\ud800",
            "prompt_ids",
        ]
    ),
    strings,
)

token_ids = st.lists(st.integers(0, 31), min_size=1, max_size=12)
odd_prompts = st.one_of(
    strings,
    st.lists(st.one_of(st.integers(-3, 40), st.sampled_from(EDGE_INTS), st.booleans()), max_size=8),  # OOV, -1
    st.lists(vocab_text, max_size=3),  # [str], batches, []
    st.lists(token_ids, max_size=3),  # [[ids]], batches
    st.lists(st.one_of(strings, token_ids, ints), max_size=3),  # mixed
    st.builds(lambda n: "a" * n, st.integers(100, 5000)),  # longer than the context
    junk,
)
prompts = rarely(st.one_of(vocab_text, token_ids, st.lists(vocab_text, min_size=1, max_size=1)), odd_prompts, one_in=3)
# small most of the time (every token costs time), sometimes anything
max_tokens = rarely(st.integers(1, 8), st.one_of(st.integers(-2, 200), st.sampled_from(EDGE_INTS)))
TINY_FLOATS = [5e-324, 1e-300, 1e-45, 1e-40, 1e-39, 1.1754942e-38, 1.2e-38, 1e-30, 1e-12]  # float32: subnormal, 0
temperatures = rarely(
    st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 2, -0.0]), st.sampled_from(TINY_FLOATS)), floats
)
stops = rarely(
    st.one_of(st.none(), vocab_text, st.lists(st.text(VOCAB_CHARS, min_size=1, max_size=3), max_size=4)),
    st.one_of(strings, st.lists(strings, max_size=20), st.lists(st.text(max_size=2000), max_size=3)),
)
stream_options = rarely(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}), junk)
logit_bias = rarely(
    st.just({}),
    st.one_of(
        st.dictionaries(st.integers(-5, 40).map(str), st.integers(-100, 100), max_size=3),
        st.dictionaries(strings, junk, max_size=3),
    ),
)


def neutral(value: Any, other: st.SearchStrategy) -> st.SearchStrategy:
    return rarely(st.just(value), other)


# -- structured outputs: schemas, regexes and grammars, hostile ones included (issue 59) -------------------
def ref_chain(n: int, link=lambda i: {"$ref": f"#/$defs/d{i + 1}"}) -> dict:
    """A JSON schema whose ``$defs`` chain ``n`` links (2,500 plain links crashed llguidance's compile)."""
    return {"$defs": {f"d{i}": link(i) for i in range(n)} | {f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def any_of_link(i: int) -> dict:
    return {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}]}


def rule_chain(n: int, gbnf: bool) -> str:
    if gbnf:
        return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} | [a-c]\n" for i in range(n)) + f'r{n} ::= "a"\n'
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} | "b"\n' for i in range(n)) + f'r{n}: "a"\n'


chain_lengths = st.one_of(st.integers(0, 80), st.sampled_from([100, 500, 1000, 2500, 4000]))
vocab_regex = st.lists(
    st.sampled_from(["a", "b", "c", "[a-e]", "[A-E]+", "(ab|cd)", "x?", "[a-z]{1,4}", "E*"]), min_size=1, max_size=5
).map("".join)
REGEX_BLOWUPS = [
    "(x{2000}){500}",
    "a{1000000}",
    "((x{100}){100}){100}",
    "x[A-C]{3}|a(b{1000}){1000}",
    "(a|aa)*b",
    "(a*)*b",
    "[a-z]{0,100000}",
    "(.{1,1000}){1,1000}",
]
UNSATISFIABLE_REGEXES = ["[a&&b]", r"a[^\x00-\x{10FFFF}]", "[^\\s\\S]", "0", "\\d+", "{}"]  # digits: no such token
regexes = st.one_of(
    vocab_regex,
    st.sampled_from(REGEX_BLOWUPS + UNSATISFIABLE_REGEXES + ["(ab", "a)", "\\", "(?<=a)b", "\\1"]),
    st.builds(
        lambda c, a, b: f"({c}{{{a}}}){{{b}}}", st.sampled_from("abx"), st.integers(0, 5000), st.integers(0, 5000)
    ),
    st.builds(lambda n: "(" * n + "a" + ")" * n, st.integers(1, 600)),
    strings,
)
small_schemas = st.recursive(
    st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
        st.fixed_dictionaries(
            {"type": st.just("string")},
            optional={
                "minLength": st.integers(-1, 100),
                "maxLength": st.integers(-1, 100),
                "pattern": st.one_of(vocab_regex, st.sampled_from(REGEX_BLOWUPS)),
            },
        ),
        st.fixed_dictionaries({"type": st.just("integer")}, optional={"minimum": ints, "maximum": ints}),
        st.fixed_dictionaries({"enum": st.lists(scalars, max_size=3)}),
        st.booleans(),
    ),
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(vocab_text, inner, max_size=3)},
            optional={"required": st.lists(vocab_text, max_size=3), "additionalProperties": st.booleans()},
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={"minItems": st.integers(0, 50)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
    ),
    max_leaves=6,
)
HOSTILE_SCHEMAS = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$ref": "#/nope"},
    {"$ref": "http://example.com/schema"},
    {"type": "string", "minLength": 5, "maxLength": 2},
    {"enum": []},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "object"},
    {"x-guidance": {"whitespace_pattern": "(a{1000}){1000}"}, "type": "object"},
    {"x-guidance": {"whitespace_pattern": "("}, "type": "object"},
]
schemas = st.one_of(
    small_schemas,
    st.sampled_from(HOSTILE_SCHEMAS),
    st.builds(ref_chain, chain_lengths),
    st.builds(lambda n: ref_chain(n, any_of_link), chain_lengths),
    nested,
)
response_formats = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {"schema": schemas}, optional={"name": strings, "strict": st.booleans()}
            ),
        }
    ),
    junk,
)
EOS_ID = len(VOCAB_CHARS)
grammars = st.one_of(
    st.builds(lambda r: f"start: /{r}/", vocab_regex),
    st.builds(lambda r: f'root ::= "{r}"+', vocab_text),
    st.builds(rule_chain, chain_lengths, st.booleans()),
    st.sampled_from(
        [
            'start: "a" start',
            'root ::= "a" root',
            f'start: "a" <[{EOS_ID}]> "b"',
            f"start: <[{EOS_ID}]>",
            'start: "a" <[99999]>',
            "start: missing",
            "start: " + "(" * 3000 + '"a"' + ")" * 3000,
            "start: %json " + json.dumps(ref_chain(2500)),
            'start: "9"',
            "root ::= [^\\x00-\\U0010FFFF]",
        ]
    ),
    strings,
)
GRAMMAR_FIELDS = {
    "response_format": response_formats,
    "regex": regexes,
    "grammar": grammars,
    "json_whitespace": rarely(st.sampled_from(["bounded", "flexible", "compact"]), strings),
}


COMMON = {  # the fields of both endpoints: right types and edges mostly; the hostile edits add the rest
    "model": neutral(MODEL, strings),
    "max_tokens": max_tokens,
    "temperature": temperatures,
    "top_p": rarely(
        st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from(TINY_FLOATS)),
        st.one_of(st.sampled_from([0, -0.0, 1.0000001]), floats),
    ),
    "top_k": rarely(st.integers(-1, 40), st.sampled_from(HUGE_INTS)),
    "seed": rarely(st.integers(0, 2**32), st.one_of(st.sampled_from(HUGE_INTS), st.integers())),
    "stop": stops,
    "stream": st.booleans(),
    "stream_options": stream_options,
    "n": neutral(1, ints),
    "presence_penalty": neutral(0, floats),
    "frequency_penalty": neutral(0.0, floats),
    "logit_bias": logit_bias,
    "user": strings,
    "ignore_eos": st.booleans(),
    "speculation": st.booleans(),
} | GRAMMAR_FIELDS
COMPLETION_FIELDS = COMMON | {
    "prompt": prompts,
    "logprobs": neutral(None, ints),
    "echo": neutral(False, st.booleans()),
    "best_of": neutral(1, ints),
    "suffix": neutral("", strings),
}
parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": strings}),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["image_url", "input_audio", "TEXT", ""]), "text": strings},
            optional={"image_url": junk},
        ),
        junk,
    ),
    max_size=3,
)
roles = rarely(
    st.sampled_from(["system", "developer", "user", "assistant"]),
    st.one_of(st.sampled_from(["tool", "function", "", "USER", "user\x00", "\ud800"]), strings),
    one_in=8,
)
message = rarely(
    st.fixed_dictionaries(
        {
            "role": roles,
            "content": rarely(st.text(VOCAB_CHARS, max_size=20), st.one_of(strings, parts, st.none(), junk)),
        }
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "role": roles,
            "content": st.one_of(strings, parts, junk),
            "name": junk,
            "tool_calls": junk,
            "tool_call_id": strings,
        },
    ),
    one_in=8,
)
messages = rarely(st.lists(message, min_size=1, max_size=3), st.one_of(st.lists(message, max_size=0), junk), one_in=10)
CHAT_FIELDS = COMMON | {
    "messages": messages,
    "max_completion_tokens": max_tokens,
    "logprobs": neutral(False, st.one_of(st.booleans(), ints)),
    "top_logprobs": neutral(None, ints),
}
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stream")
EDITS = ["none", "none", "none", "junk", "junk", "unknown", "null", "drop"]


@st.composite
def bodies(draw, fields: dict[str, st.SearchStrategy], required: str) -> Any:
    """A request: ``required``, some of the ``SAMPLING`` and other known fields (mostly well-formed,
    with edge values), then 0-2 hostile edits (a field set to any JSON value or null, an unknown key,
    the required field removed); rarely the whole body replaced by a value that is no object."""
    body = {required: draw(fields[required])}
    body |= draw(st.fixed_dictionaries({}, optional={k: fields[k] for k in SAMPLING}))  # each one time in two
    for key in draw(st.lists(st.sampled_from([k for k in fields if k not in body]), max_size=3, unique=True)):
        body[key] = draw(fields[key])
    if "max_tokens" not in body and "max_completion_tokens" not in body and draw(st.booleans()):
        body["max_tokens"] = draw(max_tokens)  # a chat answer's default is the rest of the context
    for edit in draw(st.lists(st.sampled_from(EDITS), max_size=2)):
        if edit == "unknown":
            body[draw(unknown_keys)] = draw(junk)
        elif edit == "drop":
            body.pop(required, None)
        elif edit != "none":
            key = draw(st.sampled_from(list(fields)))
            body[key] = None if edit == "null" else draw(junk)
    return draw(rarely(st.just(body), junk, one_in=50))  # not an object (or an empty one) now and then


def api_cases(path: str, body_strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(json_case, st.just(path), body_strategy, rarely(st.just(True), st.just(False)))


completion_cases = api_cases("/v1/completions", bodies(COMPLETION_FIELDS, "prompt"))
chat_cases = api_cases("/v1/chat/completions", bodies(CHAT_FIELDS, "messages"))


@st.composite
def structured_bodies(draw, fields: dict[str, st.SearchStrategy], required: str) -> Any:
    """A request (as :func:`bodies`) that always carries a schema, regex or grammar, hostile ones often:
    deep ``$ref`` and rule chains, repetition blow-ups, unsatisfiable classes, never-ending grammars."""
    body = draw(bodies(fields, required))
    if isinstance(body, dict):
        key = draw(st.sampled_from(["response_format", "regex", "grammar"]))
        body[key] = draw(GRAMMAR_FIELDS[key])
        if draw(st.integers(0, 3)) == 0:
            body["json_whitespace"] = draw(GRAMMAR_FIELDS["json_whitespace"])
    return body


structured_cases = st.one_of(
    api_cases("/v1/completions", structured_bodies(COMPLETION_FIELDS, "prompt")),
    api_cases("/v1/chat/completions", structured_bodies(CHAT_FIELDS, "messages")),
)

RAW_BODIES = [
    b"",
    b" ",
    b"not json",
    b"{",
    b"}",
    b"null",
    b"[]",
    b"{}",
    b"42",
    b'"abc"',
    b"true",
    b"\xff\xfe\x00",
    b"\xef\xbb\xbf{\"prompt\": \"abc\"}",
    '{"prompt": "abc"}'.encode("utf-16"),
    b'{"prompt": "abc", "max_tokens": 1, "max_tokens": "x"}',
    b'{"prompt": "abc"} trailing',
    b'{"prompt": "abc", "max_tokens": 1,}',
    b"{'prompt': 'abc'}",
    b'{"prompt": "\\ud800", "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
    b'{"prompt": "a\\u0000b"}',
    b'{"prompt": "abc", "max_tokens": NaN}',
    b'{"prompt": "abc", "temperature": NaN, "max_tokens": 1}',
    b'{"prompt": "abc", "temperature": 1e-400, "max_tokens": 1}',
    b"[" * 5000 + b"]" * 5000,
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b"[" * 100000,
    b'"' + b"a" * 200 + b'"',
    b'{"prompt": "' + b"a" * (1 << 20) + b'"}',
]  # the last is over the body limit
raw_bodies = st.one_of(
    st.sampled_from(RAW_BODIES),
    st.binary(max_size=100),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
raw_cases = st.builds(
    Case,
    path=rarely(
        st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        st.sampled_from(
            ["/v1/completions/", "/v1/embeddings", "/", "/v1/models", "/health", "/v1/%00", "/v1/" + "x" * 3000]
        ),
    ),
    body=raw_bodies,
    method=rarely(st.just("POST"), st.sampled_from(["GET", "PUT", "DELETE", "OPTIONS", "PATCH", "HEAD"])),
    content_type=rarely(
        st.sampled_from(["application/json", "application/json; charset=utf-8", "APPLICATION/JSON"]),
        st.sampled_from(
            [
                None,
                "",
                "text/plain",
                "application/x-www-form-urlencoded",
                "multipart/form-data",
                "application/json-patch+json",
            ]
        ),
    ),
    auth=rarely(st.just(True), st.just(False), one_in=10),
)


# -- sending and the property ---------------------------------------------------------------------------
def client(url: str, api_key: str = KEY, timeout: float = TIMEOUT_S) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout, trust_env=False, headers={"Authorization": f"Bearer {api_key}"})


def send(http: httpx.Client, case: Case) -> httpx.Response:
    headers = {} if case.content_type is None else {"Content-Type": case.content_type}
    if not case.auth:
        headers["Authorization"] = ""
    req = http.build_request(case.method, case.path, content=case.body, headers=headers)
    if case.content_type is None:
        req.headers.pop("Content-Type", None)
    try:
        return http.send(req)
    except (httpx.NetworkError, httpx.RemoteProtocolError):
        # once more on a new connection: the server may close a kept-alive connection after a response
        # that left a body unread (a 413, a 404), and that race hits the next request; twice is no race
        return http.send(req)


def error_shape(payload: Any) -> str | None:
    """What is wrong with an OpenAI error body, or None."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not (isinstance(payload, dict) and set(payload) == {"error"} and isinstance(err, dict)):
        return f"not an OpenAI error body: {str(payload)[:300]}"
    if set(err) != ERROR_KEYS:
        return f"error keys {sorted(err)} != {sorted(ERROR_KEYS)}"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return f"error message/type not strings: {err}"
    return None


def _events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]


def _stream_problems(response: httpx.Response) -> list[str]:
    events = _events(response)
    if not events or events[-1] != "[DONE]":
        return [f"stream does not end with data: [DONE] (last events: {events[-2:]})"]
    problems = []
    for event in events[:-1]:
        try:
            payload = json.loads(event)
        except ValueError:
            problems.append(f"stream event is not JSON: {event[:200]}")
            continue
        if isinstance(payload, dict) and "error" in payload:
            if (shape := error_shape(payload)) is not None:
                problems.append(f"stream error event: {shape}")
            elif payload["error"]["type"] == "server_error":
                problems.append(f"server error inside the stream (a 5xx after the headers): {payload['error']}")
    return problems


def _streamed(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def problems_of(response: httpx.Response) -> list[str]:
    """Where one response breaks the property (empty when it holds)."""
    status = response.status_code
    if status >= 500 or status < 200 or 300 <= status < 400:
        return [f"status {status}: {response.text[:300]}"]
    if response.request.method == "HEAD":
        return []  # no body, by HTTP's rules
    if status >= 400:
        try:
            shape = error_shape(response.json())
        except ValueError:
            shape = f"error body is not JSON: {response.text[:300]}"
        return [f"status {status}: {shape}"] if shape else []
    if _streamed(response):
        return _stream_problems(response)
    try:
        payload = response.json()
    except ValueError:
        return [f"200 body is not JSON: {response.text[:300]}"]
    if isinstance(payload, dict) and "error" in payload:
        return [f"error body with status 200: {payload}"]
    return []


def generated_text(response: httpx.Response) -> str:
    """The text of a completion or chat answer, streamed or not."""
    payloads = [json.loads(e) for e in _events(response)[:-1]] if _streamed(response) else [response.json()]
    choices = [c for p in payloads for c in p.get("choices", [])]
    return "".join(c.get("text") or (c.get("message") or c.get("delta") or {}).get("content") or "" for c in choices)


def check(http: httpx.Client, case: Case) -> tuple[httpx.Response, list[str]]:
    """Send ``case``; the response and the property's violations. A 200 for a tiny nonzero temperature
    (below 1e-10: greedy in effect, whatever the server's threshold) must give temperature 0's text."""
    response = send(http, case)
    problems = problems_of(response)
    value = case.value
    if (
        not problems
        and response.status_code == 200
        and isinstance(value, dict)
        and type(value.get("temperature")) is float
        and 0 < value["temperature"] < 1e-10
    ):
        greedy = send(http, json_case(case.path, value | {"temperature": 0}))
        if greedy.status_code != 200 or generated_text(greedy) != generated_text(response):
            problems.append(
                f"temperature {value['temperature']!r} answered {generated_text(response)!r}, "
                f"temperature 0 answered {greedy.status_code} {greedy.text[:300]!r}"
            )
    return response, problems


def greedy_probe(http: httpx.Client) -> str:
    r = http.post("/v1/completions", json=GREEDY_PROBE)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# -- the tests --------------------------------------------------------------------------------------------
@dataclass
class Fuzzed:
    http: httpx.Client
    baseline: str  # the greedy probe's text before any fuzzing


@pytest.fixture(scope="module")
def fuzzed():
    with serve(engine(k=3)) as s, client(s.url) as http:
        yield Fuzzed(http, greedy_probe(http))


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)


def _holds(fuzzed: Fuzzed, case: Case) -> None:
    response, problems = check(fuzzed.http, case)
    assert not problems, f"{case.shown()}\n-> {response.status_code}: " + "\n".join(problems)


@FUZZ
@given(case=completion_cases)
def test_fuzz_completions(fuzzed, case):
    _holds(fuzzed, case)


@FUZZ
@given(case=chat_cases)
def test_fuzz_chat_completions(fuzzed, case):
    _holds(fuzzed, case)


@FUZZ
@given(case=raw_cases)
def test_fuzz_raw_requests(fuzzed, case):
    _holds(fuzzed, case)


@FUZZ
@given(case=structured_cases)
def test_fuzz_structured_outputs(fuzzed, case):
    _holds(fuzzed, case)


def test_server_unchanged_after_fuzzing(fuzzed):
    assert fuzzed.http.get("/health").status_code == 200
    assert greedy_probe(fuzzed.http) == fuzzed.baseline

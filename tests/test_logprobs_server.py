"""Logprobs through the real server and the official `openai` client: completions ``logprobs=N`` (OpenAI's
legacy object) and chat ``logprobs=True, top_logprobs=N``, streamed and not, on a speculating server
(draft model, k = 3, 4 slots): the values equal target-only decoding's (the engine's own tests compare
both with a teacher-forced reference), and token strings, bytes and offsets agree with the text."""

from __future__ import annotations

import json

import pytest

from specdecode.sampling import SamplingParams
from test_logprobs import ATOL
from test_server_harness import one_torch_thread  # noqa: F401 (autouse fixture)
from test_server_harness import MODEL, _reference_engine, engine, serve, sse_events, tokenizer

PROMPTS = ["abc", "hello", "xyzzy", "kitten"]  # 24, 1, 24 and 11 tokens greedy (EOS)
EOS = "<eos>"


@pytest.fixture(scope="module")
def srv():
    with serve(engine(k=3, slots=4)) as s:
        yield s


def target_only(prompt_ids: list[int], top: int, max_new_tokens: int):
    """The request alone on a target-only engine: its tokens and logprobs."""
    return _reference_engine().generate([prompt_ids], SamplingParams(max_new_tokens=max_new_tokens, logprobs=top))[0]


def chat_ids(messages: list[dict]) -> list[int]:
    tok = tokenizer()
    return tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    ).input_ids


def spelled(token_id: int) -> str:
    return tokenizer().decode([token_id])


def check_completion_logprobs(lp: dict, text: str, ref) -> None:
    """OpenAI's legacy object against the target-only run ``ref``; offsets index the text."""
    assert lp["tokens"] == [spelled(t) for t in ref.token_ids]
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs], abs=ATOL)
    for top, e, token in zip(lp["top_logprobs"], ref.logprobs, lp["tokens"]):
        want = {spelled(i): v for i, v in e.top} | {token: e.logprob}
        assert top.keys() == want.keys() and list(top.values()) == pytest.approx(list(want.values()), abs=ATOL)
    offsets = lp["text_offset"] + [len(text)]
    for i, token in enumerate(lp["tokens"]):
        assert text[offsets[i] : offsets[i + 1]] == ("" if token == EOS else token)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_logprobs_equal_target_only_streamed_or_not(srv, prompt):
    client = srv.openai()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=2)
    choice = r.choices[0]
    ref = target_only(tokenizer()(prompt).input_ids, 2, 24)
    assert choice.text == ref.text
    check_completion_logprobs(choice.logprobs.model_dump(), choice.text, ref)
    assert r.model_extra["speculation"]["drafted"] > 0 or r.usage.completion_tokens <= 2  # (its second step drafts)
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=2, stream=True
    ):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                for key, values in c.logprobs.model_dump().items():
                    merged[key] += values
    assert text == choice.text
    assert merged == choice.logprobs.model_dump()


def check_chat_logprobs(content: list, text: str, ref, top: int) -> None:
    assert [e["token"] for e in content] == [spelled(t) for t in ref.token_ids]
    assert [e["logprob"] for e in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=ATOL)
    assert b"".join(bytes(e["bytes"]) for e in content if e["token"] != EOS).decode() == text
    for e, r in zip(content, ref.logprobs):
        assert bytes(e["bytes"]) == e["token"].encode()
        assert [t["token"] for t in e["top_logprobs"]] == [spelled(i) for i, _ in r.top]
        assert len(e["top_logprobs"]) == top
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx([v for _, v in r.top], abs=ATOL)


@pytest.mark.parametrize("content", ["hi", "abcabc"])
def test_chat_logprobs_equal_target_only_streamed_or_not(srv, content):
    client = srv.openai()
    messages = [{"role": "user", "content": content}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    ref = target_only(chat_ids(messages), 3, 24)
    assert choice.message.content == ref.text
    got = [e.model_dump(exclude_none=True) for e in choice.logprobs.content]
    check_chat_logprobs(got, choice.message.content, ref, 3)
    assert r.model_extra["speculation"]["drafted"] > 0
    streamed, text = [], ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3, stream=True
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                streamed += [e.model_dump(exclude_none=True) for e in c.logprobs.content]
    assert text == choice.message.content and streamed == got


def test_chat_logprobs_without_top_entries_and_requests_without_logprobs(srv):
    client = srv.openai()
    messages = [{"role": "user", "content": "xyz"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    with srv.http() as c:
        plain = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4}).json()
        assert plain["choices"][0]["logprobs"] is None
        events = sse_events(
            c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "stream": True})
        )
        assert all(c["logprobs"] is None for e in events if e != "[DONE]" for c in json.loads(e)["choices"])


def test_sampled_request_reports_finite_values_for_every_token(srv):
    """A truncated law (top-k 2 at T = 1.5): values are before truncation, so always finite."""
    with srv.http() as c:
        body = c.post(
            "/v1/completions",
            json={"prompt": "hello", "max_tokens": 16, "temperature": 1.5, "top_k": 2, "logprobs": 5, "seed": 3},
        ).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == body["usage"]["completion_tokens"]
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(len(t) in (5, 6) for t in lp["top_logprobs"])


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "abc", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "abc", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "abc", "logprobs": True}, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ],
)
def test_out_of_range_logprobs_get_a_400_naming_the_parameter(srv, path, body, param):
    with srv.http() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_stop_string_cuts_the_text_and_every_generated_token_is_still_listed(srv):
    """Tokens of a stop string are generated (usage counts them) and listed; the text ends before them."""
    with srv.http() as c:
        full = c.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": 24, "temperature": 0, "logprobs": 1}
        ).json()["choices"][0]
        stop = full["text"][5:7]  # a stop string that completes inside the run
        cut = c.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": 24, "temperature": 0, "logprobs": 1, "stop": stop}
        ).json()
    choice = cut["choices"][0]
    assert choice["text"] == full["text"][: full["text"].index(stop)] and choice["finish_reason"] == "stop"
    n = cut["usage"]["completion_tokens"]
    assert len(choice["logprobs"]["tokens"]) == n
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(full["logprobs"]["token_logprobs"][:n], abs=ATOL)

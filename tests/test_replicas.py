"""The server as Ray Serve replicas (specdecode.server.replicas): the routing and metrics functions alone,
then one local Ray cluster (2 CPUs, 2 replicas of the tiny pair) started once for the module: routes,
streaming, API key and errors as the single-process server gives them, greedy outputs, prefix routing, and
a replica killed while it streams.

The replicas' engines hold their steps at a gate (a file: after a few steps once it appears, each step waits
while it exists), so the crash test knows a stream is in flight on the replica it kills: an ordering, no clock.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

import ray
from ray import serve

from specdecode.server.app import ServerConfig
from specdecode.server.replicas import (
    APP_NAME,
    INGRESS_HEADER,
    REPLICA_HEADER,
    Route,
    aggregate_metrics,
    build_app,
    rank_replicas,
    ring_owner,
    routing_key,
)
from test_server_harness import one_torch_thread  # noqa: F401 (autouse fixture)
from test_server_harness import serve as serve_one
from test_server_harness import CLIENT_TIMEOUT_S, KEY, MODEL, engine, reference, scrape, sse_events, tokenizer, until

GATE_ENV = "SPECDECODE_TEST_REPLICA_GATE"
STEPS_BEFORE_HOLD = 4  # engine steps a replica takes after the gate appears, before it waits
PREFIX_CHARS = 8
HEADER = REPLICA_HEADER.decode()
INGRESS = INGRESS_HEADER.decode()


# -- pure: routing and metrics --------------------------------------------------------------------------
IDS = [f"SERVE_REPLICA::app#Replica#r{i}" for i in range(4)]


def test_a_key_has_one_owner_and_removing_a_replica_moves_only_its_keys():
    keys = [f"prompt {i}" for i in range(400)]
    before = {k: ring_owner(IDS, k) for k in keys}
    assert all(ring_owner(list(reversed(IDS)), k) == before[k] for k in keys)  # order of the ids does not matter
    counts = {r: sum(o == r for o in before.values()) for r in IDS}
    assert min(counts.values()) > 400 / 4 / 3  # every replica owns a share (64 points each)
    after = {k: ring_owner(IDS[:3], k) for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert moved and all(before[k] == IDS[3] for k in moved)


def test_rank_replicas_prefers_the_owner_unless_it_holds_too_many_more():
    owner = ring_owner(IDS, "abc")
    others = [r for r in IDS if r != owner]
    assert rank_replicas(IDS, Route("abc"), {}) == [[owner], others]
    assert rank_replicas(IDS, Route("abc"), dict.fromkeys(IDS, 3) | {owner: 11}, imbalance=8) == [[owner], others]
    assert rank_replicas(IDS, Route("abc"), dict.fromkeys(IDS, 3) | {owner: 12}, imbalance=8) == [others, [owner]]
    assert rank_replicas(IDS, Route(pin=IDS[2]), {}) == [[IDS[2]]]
    assert rank_replicas(IDS, Route(pin="gone"), {}) == []
    two = rank_replicas(IDS, Route(), {}, rng=random.Random(0))
    assert len(two) == 1 and len(set(two[0])) == 2 and set(two[0]) <= set(IDS)
    assert rank_replicas([], Route("abc"), {}) == []


def test_routing_key_is_the_prompt_prefix():
    body = lambda obj: json.dumps(obj).encode()  # noqa: E731
    assert routing_key("/v1/completions", body({"prompt": "abcdefghij"}), 4) == "abcd"
    assert routing_key("/v1/completions", body({"prompt": ["abcdefghij"]}), 4) == "abcd"
    assert routing_key("/v1/completions", body({"prompt": [5, 6, 7]}), 4) == "5,6,"
    chat = routing_key(
        "/v1/chat/completions",
        body({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
        64,
    )
    assert chat.startswith("system\x00be brief\x00user\x00hi")
    assert routing_key("/v1/models", b"", 4) is None
    assert routing_key("/v1/completions", b"{not json", 4) is None
    assert routing_key("/v1/completions", body({"prompt": ""}), 4) is None


def test_aggregate_metrics_sums_counters_and_labels_what_does_not_sum():
    a = (
        '# HELP specdecode_requests_total r\n# TYPE specdecode_requests_total counter\n'
        'specdecode_requests_total{finish_reason="stop"} 2.0\n'
        '# HELP specdecode_queue_depth q\n# TYPE specdecode_queue_depth gauge\nspecdecode_queue_depth 1.0\n'
        '# HELP specdecode_speculation_enabled s\n# TYPE specdecode_speculation_enabled gauge\n'
        'specdecode_speculation_enabled 1.0\n'
    )
    b = a.replace("} 2.0", "} 5.0").replace("depth 1.0", "depth 3.0").replace("enabled 1.0", "enabled 0.0")
    m = scrape(aggregate_metrics({"r0": a, "r1": b, "r2": None}).decode())
    assert m['specdecode_requests_total{finish_reason="stop"}'] == 7.0
    assert m["specdecode_queue_depth"] == 4.0
    assert (m['specdecode_speculation_enabled{replica="r0"}'], m['specdecode_speculation_enabled{replica="r1"}']) == (
        1.0,
        0.0,
    )
    assert [m[f'specdecode_replica_up{{replica="{r}"}}'] for r in ("r0", "r1", "r2")] == [1.0, 1.0, 0.0]


# -- a local Ray cluster ----------------------------------------------------------------------------------
def gated_engine():
    """A replica's engine (tiny pair, k = 3): each step first passes the gate (module docstring)."""
    import torch

    torch.set_num_threads(1)
    eng = engine(k=3, slots=4)
    step, seen = eng.step, {"gate": None, "steps": 0}

    def gated_step(*args, **kwargs):
        gate = Path(os.environ[GATE_ENV])
        try:
            mark = gate.read_text()
        except FileNotFoundError:
            mark = None
        if mark is not None:
            if mark != seen["gate"]:
                seen["gate"], seen["steps"] = mark, 0
            seen["steps"] += 1
            deadline = time.monotonic() + 600  # only a guard, so that a failed test still ends
            while seen["steps"] > STEPS_BEFORE_HOLD and gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return step(*args, **kwargs)

    eng.step = gated_step
    return eng


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, url: str, gate: Path) -> None:
        self.url, self.gate = url, gate

    def http(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=CLIENT_TIMEOUT_S, trust_env=False)

    def openai(self):
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=KEY,
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
            http_client=httpx.Client(trust_env=False),
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    gate = tmp_path_factory.mktemp("replicas") / "gate"
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", GATE_ENV)}
    tests_dir = str(Path(__file__).parent)  # the replicas import this module for gated_engine
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, saved["PYTHONPATH"]) if p)
    os.environ[GATE_ENV] = str(gate)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            gated_engine,
            ServerConfig(model_name=MODEL, api_key=KEY),
            replicas=2,
            replica_cpus=1,
            graceful_timeout_s=2,
            prefix_chars=PREFIX_CHARS,
        )
        serve.run(app, name=APP_NAME, route_prefix="/")
        yield Cluster(f"http://127.0.0.1:{port}", gate)
    finally:
        gate.unlink(missing_ok=True)
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def single():
    with serve_one(engine(k=3, slots=4)) as s:
        yield s


def ids(text: str) -> list[int]:
    return tokenizer()(text).input_ids


def test_completions_and_chat_match_the_target_alone(cluster):
    client = cluster.openai()
    drafted = 0
    for prompt in ("abc", "hello", "xyzzy", "kitten"):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        text, finish, n = reference(ids(prompt), max_new_tokens=20)
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (text, finish, n)
        drafted += r.model_extra["speculation"]["drafted"]
    assert drafted > 0
    messages = [{"role": "system", "content": "bq"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    tok = tokenizer()
    chat_ids = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    ).input_ids
    assert r.choices[0].message.content == reference(chat_ids, max_new_tokens=30)[0]
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_streaming_matches_the_target_alone(cluster):
    client = cluster.openai()
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="hello",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text, finish, n = reference(ids("hello"), max_new_tokens=24)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == n
    with (
        cluster.http() as c,
        c.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "abc"}], "max_tokens": 10, "temperature": 0, "stream": True},
        ) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")


BAD = [  # (method, path, body, headers, key): answered alike by one process and by the replicas
    ("POST", "/v1/completions", b'{"prompt": "abc"}', {}, None),  # no key
    ("POST", "/v1/completions", b'{"prompt": "abc"}', {}, "wrong"),
    ("GET", "/v1/models", b"", {}, "wrong"),
    ("POST", "/v1/completions", b'{"prompt": "abc", "model": "other"}', {}, KEY),
    ("POST", "/v1/completions", b'{"prompt": ', {}, KEY),
    ("POST", "/v1/completions", b'{"prompt": ""}', {}, KEY),
    ("POST", "/v1/completions", b'{"prompt": "abc", "max_tokens": -1}', {}, KEY),
    ("POST", "/v1/completions", b'{"prompt": "abc", "temperature": "hot"}', {}, KEY),
    ("POST", "/v1/completions", b'{"prompt": "abc"}', {"content-type": "text/plain"}, KEY),
    ("POST", "/v1/completions", b'{"prompt": "' + b"a" * (1 << 20) + b'"}', {}, KEY),  # over the body limit
    ("POST", "/v1/chat/completions", b'{"messages": []}', {}, KEY),
    ("GET", "/v1/nothing", b"", {}, KEY),
    ("DELETE", "/v1/models", b"", {}, KEY),
]


@pytest.mark.parametrize("method,path,body,headers,key", BAD, ids=[f"{m}{p}-{i}" for i, (m, p, *_) in enumerate(BAD)])
def test_errors_and_api_key_as_one_process_gives_them(cluster, single, method, path, body, headers, key):
    headers = {"content-type": "application/json"} | headers
    answers = []
    for url in (single.url, cluster.url):
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S, trust_env=False) as c:
            r = c.request(method, path, content=body, headers=headers | auth)
        answers.append((r.status_code, r.json(), r.headers.get("www-authenticate")))
    assert answers[1] == answers[0]
    assert answers[0][0] >= 400


def test_health_and_metrics_of_every_replica(cluster):
    with cluster.http(key=None) as c:
        assert c.get("/health").json() == {"status": "ok"}
    with cluster.http() as c:
        for prompt in ("m1", "m2", "m3", "m4"):
            assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}).status_code == 200
        m = scrape(c.get("/metrics").text)
    up = {k: v for k, v in m.items() if k.startswith("specdecode_replica_up")}
    assert len(up) == 2 and set(up.values()) == {1.0}
    assert sum(v for k, v in m.items() if k.startswith("specdecode_requests_total")) >= 4
    assert m['specdecode_ingress_http_requests_total{code="200",route="/v1/completions"}'] >= 4
    assert sum(1 for k in m if k.startswith("specdecode_speculation_enabled{replica=")) == 2


def test_requests_sharing_a_prefix_meet_the_same_replica(cluster):
    seen: dict[str, set[str]] = {}
    with cluster.http() as c:
        for prefix in ("aaaaaaaa", "bbbbbbbb", "cdcdcdcd", "qrstuvwx", "ABCDEFGH", "zzzzzzzz"):
            for tail in ("", "x", "yz", "hello"):
                r = c.post("/v1/completions", json={"prompt": prefix + tail, "max_tokens": 2})
                assert r.status_code == 200
                seen.setdefault(prefix, set()).add(r.headers[HEADER])
    assert all(len(replicas) == 1 for replicas in seen.values()), seen


def _stream(cluster: Cluster, prompt: str, out: dict) -> None:
    """One streamed completion: out gets the replica header, the events, or the non-200 answer."""
    try:
        with (
            cluster.http() as c,
            c.stream(
                "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 80, "ignore_eos": True, "stream": True}
            ) as r,
        ):
            out["status"], out["replica"], out["ingress"] = r.status_code, r.headers.get(HEADER), r.headers.get(INGRESS)
            if r.status_code != 200:
                out["body"] = json.loads(r.read())
                return
            out["events"] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[len("data: ") :])
    except Exception as exc:  # noqa: BLE001 (the assertion below says what happened)
        out["exception"] = repr(exc)


def _complete(cluster: Cluster, prompt: str, out: dict) -> None:
    try:
        with cluster.http() as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "ignore_eos": True})
        out["status"], out["replica"], out["body"] = r.status_code, r.headers.get(HEADER), r.json()
    except Exception as exc:  # noqa: BLE001
        out["exception"] = repr(exc)


def _in_flight(cluster: Cluster) -> float:
    with cluster.http() as c:
        m = scrape(c.get("/metrics").text)
    return m["specdecode_running_requests"] + m["specdecode_queue_depth"]


def _outcome(out: dict) -> str:
    """'ok' (finished), 'error' (a clean error: a 503 body, or an error event then [DONE]), or what went wrong."""
    if "exception" in out:
        return f"exception {out['exception']}"
    if out["status"] != 200:
        return "error" if out["body"]["error"]["code"] == "replica_unavailable" else f"status {out}"
    events = out["events"]
    if not events or events[-1] != "[DONE]":
        return f"unfinished {events[-3:]}"
    last = json.loads(events[-2])
    if "error" in last:
        return "error" if last["error"]["code"] == "replica_unavailable" else f"error event {last}"
    return "ok" if last["choices"][0]["finish_reason"] == "length" else f"finish {last}"


def test_a_replica_killed_mid_stream(cluster):
    """Kill the replica of a stream held at the gate while every request is in a replica: the streams it had
    begun end with an error event and [DONE]; its requests that had sent nothing are served by the other
    replica; every other request finishes; later requests are served."""
    prompts = [f"{c * 8}tail" for c in "abcdefghijkl"]  # 12 prefixes: both replicas hold streams
    outs = [{} for _ in prompts]
    plain = [{} for _ in range(6)]  # non-streaming: nothing reaches the client before the end
    cluster.gate.write_text(uuid.uuid4().hex)
    threads = [threading.Thread(target=_stream, args=(cluster, p, o), daemon=True) for p, o in zip(prompts, outs)]
    threads += [
        threading.Thread(target=_complete, args=(cluster, f"{c * 8}plain", o), daemon=True)
        for c, o in zip("abcdef", plain)
    ]
    try:
        for t in threads:
            t.start()
        until(lambda: any(o.get("events") for o in outs), "no stream began")
        until(lambda: _in_flight(cluster) == len(threads), "not every request reached a replica")
        victim = next(o["replica"] for o in outs if o.get("events"))
        held = [o for o in outs if o.get("events") and o["replica"] == victim]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        until(lambda: all(o.get("events", [None])[-1:] == ["[DONE]"] for o in held), "the held streams did not end")
    finally:
        cluster.gate.unlink(missing_ok=True)
        for t in threads:
            t.join(CLIENT_TIMEOUT_S)
    outcomes = [_outcome(o) for o in outs]
    assert set(outcomes) <= {"ok", "error"}, outcomes
    assert all(_outcome(o) == "error" for o in held)
    assert all(_outcome(o) == "ok" for o in outs if o.get("replica") not in (None, victim))
    assert [(o.get("status"), o["replica"] != victim) for o in plain] == [(200, True)] * len(plain), plain
    with cluster.http() as c:  # the deployment keeps serving (the dead replica's requests go elsewhere)
        for p in prompts:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 4})
            assert r.status_code == 200 and r.headers[HEADER] != victim


def _ingress_replicas() -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and f"#{APP_NAME}#Ingress#" in f"#{a['name'].split('::')[-1]}"
    )


def test_an_ingress_replica_killed_leaves_the_other_serving(cluster):
    """Two ingress replicas: kill one while streams pass through them. The streams through the other finish;
    every request sent right after the kill is answered by the ingress that was already serving (before: one
    ingress, so every one waited for Ray Serve to start a replacement); those through the dead one end as Ray's
    proxy ends them (cut: docs/replicas.md)."""
    until(lambda: len(_ingress_replicas()) == 2, "two ingress replicas")
    prompts = [f"{c * 8}tail" for c in "mnopqr"]
    outs = [{} for _ in prompts]
    cluster.gate.write_text(uuid.uuid4().hex)
    threads = [threading.Thread(target=_stream, args=(cluster, p, o), daemon=True) for p, o in zip(prompts, outs)]
    try:
        for t in threads:
            t.start()
        until(lambda: any(o.get("events") for o in outs), "no stream began")
        until(lambda: _in_flight(cluster) == len(threads), "not every request reached a replica")
        victim = next(o["ingress"] for o in outs if o.get("events"))
        serving = set(_ingress_replicas())
        assert victim in serving
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    finally:
        cluster.gate.unlink(missing_ok=True)
    with cluster.http() as c:  # at once: the survivor answers every one (no retry, no wait on the client side)
        answers = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 4}) for p in prompts]
    assert [r.status_code for r in answers] == [200] * len(prompts), [r.text for r in answers]
    # by the ingress that was already serving, not by a replacement (with one ingress, a replacement answers)
    assert {r.headers[INGRESS] for r in answers} <= serving - {victim}
    for t in threads:
        t.join(CLIENT_TIMEOUT_S)
    survived = [o for o in outs if o.get("ingress") not in (None, victim)]
    assert all(_outcome(o) == "ok" for o in survived), outs
    lost = [o for o in outs if not any(o is x for x in survived)]  # through the dead one (or no head yet)
    assert lost and all(_outcome(o) != "ok" for o in lost), lost  # lost with it (docs/replicas.md)

"""Shared helpers for the server tests (no tests here): tiny engines, a real uvicorn server on
loopback in a background thread, Prometheus scraping, and a one-thread torch fixture."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specdecode.sampling import SamplingParams
from specdecode.server.app import ServerConfig, create_app
from specdecode.server.connections import ConnectionLimits, DrainingServer, uvicorn_config
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy, serving

V = 32
MAX_LEN = 128
MODEL = "tiny"
KEY = "test-key"
# for requests that must succeed: only a guard against a hang (a busy CI machine can be many times slower)
CLIENT_TIMEOUT_S = 300
# role initial, content; the generation prompt is "A" (every character is one token of the tiny vocabulary)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A{% endif %}"
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread, and the CPUs are shared: more threads only spin and
    wait (10-80x slower steps under load). Import this fixture into each server test module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def tokenizer():
    tok = make_tokenizer(V)
    tok.chat_template = CHAT_TEMPLATE
    return tok


@functools.cache
def pair():
    """A target whose greedy outputs vary (EOS, repeats, mixed text) and a draft that mostly agrees."""
    target = make_model(V, seed=1)
    return target, perturbed_copy(target, noise=0.15)


def engine(
    k: int = 3, slots: int = 4, max_len: int = MAX_LEN, draft: bool = True, backend: str | None = None, **budget
):
    """A tiny engine built for serving (tiny.serving; ``budget``: its step budget) on $SPECDECODE_TEST_BACKEND
    (torch by default; see tiny.runner_for) or ``backend``."""
    target, draft_model = pair()
    return make_engine(
        target,
        tokenizer(),
        draft_model if draft and k else None,
        k=k if draft else 0,
        num_slots=slots,
        max_len=max_len,
        backend=backend,
        **serving(**budget),
    )


@functools.cache
def _reference_engine():
    return engine(k=0, slots=1)


def reference(prompt_ids: list[int], **params) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of the request run alone, target-only."""
    out = _reference_engine().generate([prompt_ids], SamplingParams(**params))[0]
    return out.text, out.finish_reason, len(out.token_ids)


@dataclass
class Served:
    url: str
    app: object
    server: DrainingServer

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def http(self, key: str | None = KEY, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=CLIENT_TIMEOUT_S, trust_env=False, **kw)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=KEY,
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
            http_client=httpx.Client(trust_env=False),
        )

    def metrics(self) -> dict[str, float]:
        with self.http() as c:
            return scrape(c.get("/metrics").text)

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Metrics once nothing is queued, running or holding KV (fails after ``timeout``)."""
        names = (
            "specdecode_queue_depth",
            "specdecode_running_requests",
            "specdecode_kv_slots_used",
            "specdecode_kv_tokens_used",
            "specdecode_draft_slots_used",
        )
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if all(m[n] == 0 for n in names) or time.monotonic() > deadline:
                assert {n: m[n] for n in names} == dict.fromkeys(names, 0.0)
                return m
            time.sleep(0.05)


class HeldSteps:
    """Hold the engine between decoding steps: each ``eng.step`` call first takes one of ``permits``,
    so a test decides how far the engine gets (an ordering, not a clock). ``release()`` lets every
    later step run; call it in a ``finally``."""

    def __init__(self, eng, permits: int = 0) -> None:
        self._permits = threading.Semaphore(permits)
        self._open = threading.Event()
        step = eng.step

        def held_step(*args, **kwargs):
            if not self._open.is_set():
                self._permits.acquire(timeout=600)  # only a guard, so that a failed test still ends
            return step(*args, **kwargs)

        eng.step = held_step

    def release(self) -> None:
        self._open.set()
        self._permits.release()


def until(condition, what: str, timeout: float = 120.0) -> None:
    """Poll ``condition()`` until it holds; fail after ``timeout`` (generous: it ends as soon as it holds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def scrape(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with sorted labels: value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@contextlib.contextmanager
def serve(
    eng, limits: ConnectionLimits = ConnectionLimits(), graceful_timeout_s: float = 5.0, **config
) -> Iterator[Served]:
    """A real uvicorn server on 127.0.0.1 (a free port) in a background thread, configured as
    `specdecode serve` configures it (connection limits, drain at shutdown)."""
    config = {"model_name": MODEL, "api_key": KEY} | config
    app = create_app(eng, ServerConfig(**config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = DrainingServer(
        uvicorn_config(app, limits=limits, graceful_timeout_s=graceful_timeout_s, log_level="warning")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # generous; ends as soon as the server is up
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", app, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a streamed response, in order."""
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]

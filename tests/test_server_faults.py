"""Faults: a failing drafter, a failing or stuck target, a dead engine loop, a client leaving during
prefill, and SIGTERM draining a real `serve` process."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from specdecode.sampling import SamplingParams

from test_server_harness import one_torch_thread  # noqa: F401 (autouse fixture)
from test_server_harness import HeldSteps, KEY, engine, pair, reference, serve, tokenizer

ROOT = Path(__file__).resolve().parents[1]
LONG_STREAM = {"prompt": "abc", "max_tokens": 120, "ignore_eos": True, "stream": True, "speculation": False}


def ids(text: str) -> list[int]:
    return tokenizer()(text).input_ids


def one_shot_failure(obj, name: str):
    """Make ``obj.name`` raise once after ``arm()``; returns ``arm``."""
    real = getattr(obj, name)
    armed = threading.Event()

    def flaky(*args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("simulated device fault")
        return real(*args, **kwargs)

    setattr(obj, name, flaky)
    return armed.set


def _error_of(payload: str) -> dict:
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in payload
    return err


@pytest.mark.parametrize("where", ["propose", "start"])
def test_drafter_failure_falls_back_to_target_only(where):
    with serve(engine(k=3)) as s:

        def boom(*args, **kwargs):
            raise RuntimeError("draft model exploded")

        setattr(s.scheduler.engine.drafter.inner, where, boom)  # the drafter inside the fault guard
        reached_drafter = 0
        with s.http() as c:
            for prompt in ("abc", "hello"):
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 25, "temperature": 0})
                assert r.status_code == 200
                assert r.json()["choices"][0]["text"] == reference(ids(prompt), max_new_tokens=25)[0]
                assert r.json()["speculation"]["drafted"] == 0
                # the drafter starts after the first token: a request that ends there never reaches it
                reached_drafter += r.json()["usage"]["completion_tokens"] > 1
            assert c.get("/health").status_code == 200
        m = s.wait_idle()
        assert reached_drafter >= 1
        assert m["specdecode_draft_failures_total"] == reached_drafter  # once per request, then target-only


def test_target_failure_mid_stream_sends_error_then_done_and_server_recovers():
    with serve(engine(k=3)) as s:
        arm = one_shot_failure(s.scheduler.engine.target, "forward")
        # one step, then the engine waits until the fault is armed: the failure lands mid-stream
        # however late this thread reads the first chunk (an ordering, not a clock)
        held = HeldSteps(s.scheduler.engine, permits=1)
        with s.http() as c:
            with c.stream("POST", "/v1/completions", json=LONG_STREAM) as r:
                lines = r.iter_lines()
                try:
                    first = next(line for line in lines if line.startswith("data: "))
                    arm()
                finally:
                    held.release()
                events = [first[6:]] + [line[6:] for line in lines if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "[DONE]"
            assert "choices" in json.loads(events[0])
            assert _error_of(events[-2])["type"] == "server_error"

            arm()  # a non-streaming request fails with a 500 in the OpenAI shape
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 10})
            assert r.status_code == 500 and _error_of(r.text)["code"] == "internal_error"

            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 10, "temperature": 0})
            assert r.json()["choices"][0]["text"] == reference(ids("abc"), max_new_tokens=10)[0]
        assert s.wait_idle()["specdecode_step_failures_total"] >= 1


def test_prefill_failure_fails_only_that_request():
    with serve(engine(k=3)) as s:
        arm = one_shot_failure(s.scheduler.engine.target, "prefill")
        with s.http() as c:
            arm()
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
            assert r.status_code == 500 and _error_of(r.text)["code"] == "internal_error"
            assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5}).status_code == 200
        s.wait_idle()


def test_a_failed_prefill_of_an_n_choice_request_fails_it_once_with_its_own_error():
    """n = 3 shares one prefill: its failure aborts every choice; the answer is the prefill's 500 (not a
    sibling's), streamed or not, and the next n = 3 request is served whole."""
    with serve(engine(k=3)) as s:
        arm = one_shot_failure(s.scheduler.engine.target, "prefill")
        body = {"prompt": "abcab", "max_tokens": 5, "n": 3, "temperature": 0}
        with s.http() as c:
            arm()
            r = c.post("/v1/completions", json=body)
            err = _error_of(r.text)
            assert r.status_code == 500 and err["code"] == "internal_error"
            assert "another choice" not in err["message"]
            arm()
            with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and _error_of(events[-2])["code"] == "internal_error"
            r = c.post("/v1/completions", json=body)
            texts = [ch["text"] for ch in r.json()["choices"]]
            assert r.status_code == 200 and texts == [reference(ids("abcab"), max_new_tokens=5)[0]] * 3
        s.wait_idle()


def test_health_reports_a_wedged_engine():
    with serve(engine(k=3), wedge_timeout_s=0.3) as s:
        runner, release, entered = s.scheduler.engine.target, threading.Event(), threading.Event()
        real = runner.forward

        def stuck(*args, **kwargs):
            entered.set()
            release.wait(600)  # the test releases it (600 s: a guard only)
            return real(*args, **kwargs)

        runner.forward = stuck
        with s.http() as c:
            result = {}
            t = threading.Thread(
                target=lambda: result.update(
                    r=s.http().post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
                )
            )
            t.start()
            assert entered.wait(120)
            time.sleep(0.4)  # a lower bound: the engine call has lasted longer than wedge_timeout_s
            health = c.get("/health")
            assert health.status_code == 503 and _error_of(health.text)["code"] == "unhealthy"
            runner.forward = real
            release.set()
            t.join(300)
            assert not t.is_alive() and result["r"].status_code == 200
            assert c.get("/health").status_code == 200


def test_dead_engine_loop_fails_requests_fast_and_health_says_so():
    with serve(engine(k=3)) as s:

        def broken():
            raise RuntimeError("engine state corrupted")

        s.scheduler.engine.free_slots = broken
        with s.http() as c:
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
            assert r.status_code == 503 and _error_of(r.text)["code"] == "engine_unavailable"
            assert c.get("/health").status_code == 503
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
            assert r.status_code == 503


def test_client_gone_during_prefill_never_gets_a_step():
    with serve(engine(k=3)) as s:
        runner, entered, gone = s.scheduler.engine.target, threading.Event(), threading.Event()
        real = runner.prefill

        def held_prefill(*args, **kwargs):
            entered.set()
            gone.wait(30)  # the prefill lasts until the client has left (ordering, not a clock)
            time.sleep(0.2)  # and a little longer, so the server can notice the disconnect
            return real(*args, **kwargs)

        runner.prefill = held_prefill
        body = json.dumps({"prompt": "abc", "max_tokens": 50}).encode()
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert entered.wait(30)
        gone.set()  # the client has closed its connection while the prefill runs
        m = s.wait_idle()
        assert m['specdecode_requests_total{finish_reason="abort"}'] == 1
        assert m["specdecode_generation_tokens_total"] == 0


def test_specdecode_serve_sigterm_drains_in_flight_streams(tmp_path):
    """The real `specdecode serve` command (saved tiny model, n-gram drafts): a greedy stream in
    flight when SIGTERM arrives completes exactly; new connections are refused meanwhile."""
    target, _ = pair()
    target.save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "specdecode.cli",
        "serve",
        "--target",
        str(tmp_path),
        "--draft",
        "ngram",
        "-k",
        "3",
        "--dtype",
        "float32",
        "--max-context",
        "256",
        "--port",
        "0",
        "--api-key",
        KEY,
        "--graceful-timeout",
        "600",
    ]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
    log: list[str] = []
    port: list[int] = []
    started = threading.Event()

    def read_stderr():
        for line in proc.stderr:
            log.append(line)
            if m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
                port.append(int(m.group(1)))
                started.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        assert started.wait(600), "".join(log)  # generous: a busy machine imports torch slowly
        url = f"http://127.0.0.1:{port[0]}"
        body = {
            "model": tmp_path.name,
            "prompt": "abc",
            "max_tokens": 240,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with (
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60, trust_env=False) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            # no new connections while draining: wait (generously, ending at the first refusal) for
            # the server to handle the signal, instead of assuming it has after a fixed sleep
            deadline = time.monotonic() + 120
            while True:
                try:
                    httpx.get(url + "/health", timeout=30, trust_env=False)
                except httpx.ConnectError:
                    break
                except (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError):
                    pass  # connected just before the listener closed
                assert time.monotonic() < deadline, "still accepting connections 120 s after SIGTERM"
                time.sleep(0.05)
            events = [first[6:]] + [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 240
        assert {ch["model"] for ch in chunks} == {tmp_path.name}  # the served name: no local path
        text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
        reference = engine(k=0, slots=1, max_len=256, backend="torch")  # the served model runs on torch
        alone = reference.generate([ids("abc")], SamplingParams(max_new_tokens=240, ignore_eos=True))
        assert text == alone[0].text
        # uvicorn re-raises the signal once it has shut down cleanly
        assert proc.wait(300) in (0, -signal.SIGTERM), "".join(log)
        assert "Application shutdown complete" in "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

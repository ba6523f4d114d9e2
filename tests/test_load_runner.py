"""The load runner against a fake streaming server with known delays (127.0.0.1 only)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fake_openai import Behaviour, FakeServer, free_port

from specdecode.bench.prompts import Prompt
from specdecode.load.client import Target
from specdecode.load.records import SweepResult
from specdecode.load.runner import LoadConfig, NoProgress, arrival_times, run_sweep, run_sweep_async
from specdecode.load.stats import summarize

CHAT = Prompt("chat/0", "qa", None, [{"role": "user", "content": "hello"}], "chat")
CODE = Prompt("code/0", "humaneval", "def f():", None, "completion")


def _chat(content: str) -> Prompt:
    return Prompt(content, "test", None, [{"role": "user", "content": content}], "chat")


def _config(
    url: str, prompts: list[Prompt], model: str | None = None, extra_body: dict[str, object] | None = None, **kw: object
) -> LoadConfig:
    # Limits that no answering request or level may reach, even on a busy CI machine (they are
    # only guards there): tests that check a limit pass their own.
    defaults: dict[str, object] = dict(
        levels=[1], num_requests=4, duration_s=600, output_len=(8, 8), request_timeout_s=120
    )
    target = Target("A", url, model, extra_body or {})
    return LoadConfig(targets=[target], prompts=prompts, **{**defaults, **kw})  # type: ignore


def test_timing_matches_the_server_schedule() -> None:
    behaviour = Behaviour(
        first_token_s=0.05,
        token_interval_s=0.01,
        speculation={"drafted": 4, "accepted": 3, "acceptance_rate": 0.75, "tokens_per_step": 2.0},
    )
    with FakeServer(behaviour) as server:
        result = run_sweep(_config(server.url, [CHAT, CODE], levels=[1, 2], extra_body={"temperature": 0}))
    assert result.endpoints["A"]["model"] == "fake-model"
    assert [(run.level, run.issued, run.cancelled) for run in result.levels] == [(1, 4, 0), (2, 4, 0)]
    records = [r for run in result.levels for r in run.records]
    assert len(records) == 8 and all(r.ok for r in records)
    for r in records:
        assert r.output_tokens == 8 and r.token_source == "usage" and r.content_chunks == 8
        assert r.speculation == behaviour.speculation and len(r.itl_s) == 7
        # Hard bounds: the server never sends early. The empty role chunk sent at t=0 must not
        # count as the first token.
        assert r.ttft_s is not None and r.ttft_s >= 0.05 and r.latency_s >= 0.05 + 7 * 0.01
    # No upper bound on any time (a busy machine wakes late): the summary must be the records' own
    # medians, and each record's TPOT its decode time over its later tokens.
    summary = summarize(result.levels[0])
    level = result.levels[0].records
    assert summary.ttft is not None and summary.ttft["p50"] >= 0.05
    assert summary.ttft["p50"] == pytest.approx(float(np.median([r.ttft_s for r in level])))
    for r in records:
        assert r.tpot_s == pytest.approx((r.latency_s - r.ttft_s) / (r.output_tokens - 1))
        assert 0 <= sum(r.itl_s) <= r.latency_s - r.ttft_s + 1e-9  # gaps between chunks, within the decode
    assert summary.tpot is not None and summary.tpot["p50"] == pytest.approx(
        float(np.median([r.tpot_s for r in level]))
    )
    assert summary.itl is not None and summary.itl["p50"] >= 0
    assert {r.kind for r in records} == {"chat", "completion"}
    body = behaviour.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model" and body["temperature"] == 0 and body["max_tokens"] == 8


def test_tokens_from_usage_or_from_chunks() -> None:
    with FakeServer(Behaviour(first_token_s=0, token_interval_s=0, tokens_per_chunk=2)) as server:
        with_usage = run_sweep(_config(server.url, [CODE]))
        server.behaviour.send_usage = False
        from_chunks = run_sweep(_config(server.url, [CODE]))
    r = with_usage.levels[0].records[0]
    assert (r.output_tokens, r.content_chunks, r.token_source) == (8, 4, "usage")
    r = from_chunks.levels[0].records[0]
    assert (r.output_tokens, r.content_chunks, r.token_source) == (4, 4, "chunks")


def test_errors_are_classified() -> None:
    prompts = [_chat("status:500"), _chat("status:429"), _chat("stream-error"), _chat("fine")]
    with FakeServer(Behaviour(first_token_s=0, token_interval_s=0)) as server:
        # A generous timeout for the requests that answer (a busy CI machine can take seconds to
        # open five connections); a short one only where the server never answers.
        result = run_sweep(_config(server.url, prompts, levels=[4], num_requests=4, request_timeout_s=60))
        hung = run_sweep(_config(server.url, [_chat("hang")], num_requests=1, request_timeout_s=0.3))
    errors = {r.prompt_id: r.error for r in result.levels[0].records + hung.levels[0].records}
    assert errors == {
        "status:500": "http_500",
        "status:429": "http_429",
        "stream-error": "stream_error",
        "hang": "timeout",
        "fine": None,
    }
    down = run_sweep(_config(f"http://127.0.0.1:{free_port()}", [CHAT], model="m", num_requests=2))
    assert [r.error for r in down.levels[0].records] == ["connection", "connection"]


def test_level_stops_at_its_duration_and_the_run_at_its_time_limit() -> None:
    # 8 tokens: >= 10.5 s a request at the server, so every level ends mid-request. Whatever the
    # machine's speed, levels end in this order: a level that starts ends at its own 10 s or at the
    # run's 18 s, whichever comes first; the second level starts >= 10 s into the run, so its own end
    # (>= 20 s) is past the limit and it is cut by the limit; the third can never start. Only the
    # setup time (connecting, before the first level) decides whether the second level starts at all
    # (setup < 8 s, any unloaded machine) or the first is already the one the limit cuts.
    slow = Behaviour(first_token_s=0.01, token_interval_s=1.5)
    with FakeServer(slow) as server:
        result = run_sweep(
            _config(
                server.url, [CHAT], model="m", levels=[2, 4, 8], num_requests=1000, duration_s=10.0, time_limit_s=18.0
            )
        )
    levels = [r.level for r in result.levels]
    assert levels in ([2, 4], [2]), [(r.level, r.stopped_by) for r in result.levels]
    # every level but the last stopped at its own duration; the last was cut by the run's limit
    assert [r.stopped_by for r in result.levels] == ["duration"] * (len(levels) - 1) + ["time_limit"]
    assert all(r.hit_time_limit for r in result.levels)
    for run in result.levels:  # closed loop: one request per worker, all still mid-request when cut
        assert len(run.records) == 0 and run.cancelled == run.level == run.issued
    assert result.skipped == [("A", level) for level in (4, 8) if level not in levels]


def test_open_loop_follows_seeded_poisson_arrivals() -> None:
    times = arrival_times(rate=20, n=2000, seed=1)
    assert times == arrival_times(rate=20, n=2000, seed=1) != arrival_times(20, 2000, seed=2)
    assert times[0] == 0 and times[-1] / 1999 == pytest.approx(1 / 20, rel=0.1)
    # The fake answers nobody before all six requests are in: only an open loop (sending on its
    # schedule, not after answers) completes. Each request goes at its seeded time or later; how much
    # later is the machine's business (no upper bound: a busy machine wakes late).
    expected = arrival_times(40, 6, seed=0)
    with FakeServer(Behaviour(first_token_s=0, token_interval_s=0, hold_until=6)) as server:
        result = run_sweep(_config(server.url, [CODE], mode="open", levels=[40], num_requests=6, request_timeout_s=60))
    records = sorted(result.levels[0].records, key=lambda r: r.index)
    assert [r.index for r in records] == list(range(6)) and all(r.ok for r in records), records
    assert all(r.start_s >= at - 1e-3 for r, at in zip(records, expected)), [r.start_s for r in records]
    assert [r.start_s for r in records] == sorted(r.start_s for r in records)  # issued in order


def test_cancel_keeps_what_finished() -> None:
    class FirstDone(NoProgress):
        def __init__(self) -> None:
            self.event = asyncio.Event()

        def request_done(self, run, record) -> None:
            self.event.set()

    async def cancel_midway(result: SweepResult) -> None:
        with FakeServer(Behaviour(first_token_s=0.01, token_interval_s=0.02)) as server:
            # 100 requests of >= 0.15 s each at the server: the sweep cannot finish before the cancel
            config = _config(server.url, [CHAT], num_requests=100)
            progress = FirstDone()
            task = asyncio.create_task(run_sweep_async(config, result, progress))
            # cancel once a request has finished (an event, not a clock); the deadline is only a guard
            await asyncio.wait_for(progress.event.wait(), timeout=120)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    result = SweepResult()
    asyncio.run(cancel_midway(result))
    run = result.levels[0]
    assert 1 <= len(run.records) < 100 and all(r.ok for r in run.records)
    assert run.wall_s is not None and run.cancelled == 1


def test_ctrl_c_stops_the_sweep_even_when_a_request_swallows_the_cancellation(monkeypatch) -> None:
    """The cause of a Ctrl-C test that hung at random: httpx closes a cancelled stream in a shielded
    anyio scope, and asyncio's one cancellation landing there is lost. A request that swallows its
    cancellation stands for that here; SIGINT must still end the sweep after the request in flight."""
    import os
    import signal

    import specdecode.load.runner as R
    from specdecode.load.records import RequestRecord

    served = []

    async def swallowing(client, target, prompt, max_tokens, index, t0, timeout):
        served.append(index)
        if index == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this request streams
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:  # what the shielded close did: cancellation gone
            await asyncio.sleep(0.01)
        return RequestRecord(index, prompt.id, prompt.kind, max_tokens, 0.0, latency_s=0.01, output_tokens=1)

    async def no_model(client):
        return "m"

    monkeypatch.setattr(R, "stream_request", swallowing)
    monkeypatch.setattr(R, "first_model", no_model)
    result = run_sweep(_config("http://127.0.0.1:9", [CHAT], levels=[1, 2], num_requests=1000))
    assert result.interrupted
    assert len(served) < 10 and len(result.levels) == 1  # stopped within the level, the next never started
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


@pytest.mark.parametrize("mode, level", [("closed", 1), ("closed", 2), ("open", 50.0)])
def test_rounds_alternate_the_endpoints_slice_by_slice(mode: str, level: float) -> None:
    # One fake server, two endpoints told apart by an extra body field: the order in which it receives
    # requests is the order the sweep issued them (an ordering check, no clock).
    prompts = [_chat(f"p{i}") for i in range(7)]
    with FakeServer(Behaviour(first_token_s=0, token_interval_s=0)) as server:
        targets = [Target(label, server.url, "m", {"tag": label}) for label in ("A", "B")]
        config = LoadConfig(
            targets=targets,
            prompts=prompts,
            mode=mode,
            levels=[level],
            num_requests=7,
            rounds=3,
            duration_s=600,
            output_len=(2, 2),
            request_timeout_s=120,
        )
        result = run_sweep(config)
        bodies = server.behaviour.bodies
    # slices of 3, 2 and 2 requests: A's first, B's first, A's second, ...
    tags = [b["tag"] for b in bodies]
    assert tags == ["A"] * 3 + ["B"] * 3 + ["A"] * 2 + ["B"] * 2 + ["A"] * 2 + ["B"] * 2
    # one level run per endpoint holding every slice; request i is the same prompt for both
    assert [(run.label, run.level, run.issued, run.cancelled) for run in result.levels] == [
        ("A", level, 7, 0),
        ("B", level, 7, 0),
    ]
    a, b = ({r.index: r.prompt_id for r in run.records} for run in result.levels)
    assert a == b and sorted(a) == list(range(7))
    for run in result.levels:
        by_index = sorted(run.records, key=lambda r: r.index)
        # the run's clock goes on across slices: a later slice starts after the earlier one ended
        assert by_index[3].start_s >= by_index[2].start_s + by_index[2].latency_s
        assert run.wall_s is not None and run.wall_s >= by_index[-1].start_s + by_index[-1].latency_s


def test_a_slow_slice_takes_time_from_the_later_ones_not_the_whole_level(monkeypatch) -> None:
    # Requests 0-1 (the first slice) take 2 s each, the rest answer at once. With 6 s per level and
    # endpoint, an even share (3 s a slice) would cut the first slice mid-request and never issue the
    # second; the endpoint's whole budget lets the first slice finish (4 s) and the second run in the
    # 2 s left. (Both bounds are seconds apart: only a machine stalled for seconds could upset them.)
    import specdecode.load.runner as R
    from specdecode.load.records import RequestRecord

    async def uneven(client, target, prompt, max_tokens, index, t0, timeout):
        await asyncio.sleep(2.0 if index < 2 else 0.0)
        return RequestRecord(
            index, prompt.id, prompt.kind, max_tokens, 0.0, latency_s=0.01, ttft_s=0.01, output_tokens=1
        )

    async def no_model(client):
        return "m"

    monkeypatch.setattr(R, "stream_request", uneven)
    monkeypatch.setattr(R, "first_model", no_model)
    result = run_sweep(_config("http://127.0.0.1:9", [CHAT], num_requests=4, rounds=2, duration_s=6.0))
    (run,) = result.levels
    assert sorted(r.index for r in run.records) == [0, 1, 2, 3] and run.cancelled == 0
    assert not run.hit_time_limit
    # and a budget the first slice alone overruns still stops the endpoint there (later slices not issued)
    cut = run_sweep(_config("http://127.0.0.1:9", [CHAT], num_requests=4, rounds=2, duration_s=3.0))
    (run,) = cut.levels
    assert run.hit_time_limit and run.stopped_by == "duration"
    assert sorted(r.index for r in run.records) == [0] and run.issued == 2  # request 1 cut, 2-3 never sent


def test_one_round_issues_each_endpoints_level_in_one_stretch() -> None:
    with FakeServer(Behaviour(first_token_s=0, token_interval_s=0)) as server:
        targets = [Target(label, server.url, "m", {"tag": label}) for label in ("A", "B")]
        result = run_sweep(
            LoadConfig(
                targets=targets,
                prompts=[CHAT],
                levels=[1],
                num_requests=3,
                duration_s=600,
                output_len=(2, 2),
                request_timeout_s=120,
            )
        )
        assert [b["tag"] for b in server.behaviour.bodies] == ["A"] * 3 + ["B"] * 3
    assert [len(run.records) for run in result.levels] == [3, 3]


@pytest.mark.parametrize("rounds", [0, 5])
def test_rounds_must_fit_the_requests(rounds: int) -> None:
    with pytest.raises(ValueError, match="rounds must be between 1 and the number of requests"):
        LoadConfig(targets=[Target("A", "http://127.0.0.1:9")], prompts=[CHAT], num_requests=4, rounds=rounds)

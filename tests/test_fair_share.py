"""A fair share for ``n > 1`` (issue 59, finding 9): the choices of one request count against one request's share
of the slots. Before, an ``n = 16`` request took every slot and queued its other choices ahead of later
requests: a 100-token request sent just after it waited for all 16. Now a later request is admitted at the
next step (an ordering of engine steps, counted; no clock)."""

from __future__ import annotations

import asyncio
import threading

import httpx

from specdecode.server.scheduler import fair_pick, group_cap
from test_server_harness import one_torch_thread  # noqa: F401 (autouse fixture)
from test_server_harness import CLIENT_TIMEOUT_S, KEY, engine, serve, until


def test_a_free_slot_goes_to_the_oldest_choice_of_the_group_holding_fewest():
    # plain requests (groups of one) are first come, first served
    assert fair_pick(["a", "b", "c"], {}, cap=3) == 0
    # a later request beats the queued choices of a group that already holds slots
    assert fair_pick(["big", "big", "late"], {"big": 3}, cap=3) == 2
    assert fair_pick(["big", "big", "late"], {"big": 2}, cap=3) == 2
    # two multi-choice groups alternate: the one holding fewer goes first, oldest first on a tie
    assert fair_pick(["x", "x", "y", "y"], {"x": 2, "y": 1}, cap=3) == 2
    assert fair_pick(["x", "y"], {"x": 1, "y": 1}, cap=3) == 0
    # a group at its cap waits, even with slots free; nothing eligible: None
    assert fair_pick(["big", "big"], {"big": 3}, cap=3) is None
    assert fair_pick([], {}, cap=3) is None


def test_a_group_never_holds_every_slot_while_there_are_two():
    assert [group_cap(s) for s in (1, 2, 4, 8)] == [1, 1, 3, 7]


class CountedSteps:
    """``eng.step`` waits for a permit before each call and counts the calls begun, so a test can run the
    engine one step at a time and read what happened between two steps."""

    def __init__(self, eng) -> None:
        self.begun = 0
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        step = eng.step

        def counted(*args, **kwargs):
            self.begun += 1
            if not self._open.is_set():
                self._permits.acquire(timeout=600)  # only a guard, so that a failed test still ends
            return step(*args, **kwargs)

        eng.step = counted

    def one(self) -> None:
        """Let one step run, and wait until the engine thread is at the start of the next one."""
        begun = self.begun
        self._permits.release()
        until(lambda: self.begun > begun, "the next step")

    def release(self) -> None:
        self._open.set()
        self._permits.release()


def test_a_request_after_an_n16_request_is_admitted_within_one_step():
    """max_batch_size 4: the n = 16 request holds at most 3 slots, so a later plain request is admitted at the
    first step boundary after it arrives (before the fix: behind the 12 queued choices); both complete."""
    eng = engine(k=3, slots=4)
    steps = CountedSteps(eng)
    with serve(eng) as s:
        sched = s.scheduler

        def groups() -> set[str]:
            return {h.group for h in list(sched._running.values())}

        async def run():
            async with httpx.AsyncClient(
                base_url=s.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=CLIENT_TIMEOUT_S, trust_env=False
            ) as client:
                big = asyncio.ensure_future(
                    client.post(
                        "/v1/completions",
                        json={
                            "prompt": "abc",
                            "max_tokens": 24,
                            "ignore_eos": True,
                            "n": 16,
                            "temperature": 1.0,
                            "seed": 5,
                        },
                    )
                )
                await asyncio.to_thread(until, lambda: steps.begun == 1, "the n=16 request's first step")
                for _ in range(2):  # it is running, its remaining choices queued
                    await asyncio.to_thread(steps.one)
                queued = sched.state()["queued"]
                assert len(groups()) == 1 and queued > 0
                late = asyncio.ensure_future(
                    client.post(
                        "/v1/completions",
                        json={"prompt": "xyzzy", "max_tokens": 8, "ignore_eos": True, "temperature": 0},
                    )
                )
                await asyncio.to_thread(until, lambda: sched.state()["queued"] == queued + 1, "the late request queued")
                await asyncio.to_thread(steps.one)  # one step: the late request is admitted at its end
                assert len(groups()) == 2, "the late request was not admitted within one step"
                steps.release()
                return await big, await late

        try:
            big, late = asyncio.run(run())
        finally:
            steps.release()
        assert big.status_code == 200 and late.status_code == 200, (big.text, late.text)
        assert len(big.json()["choices"]) == 16 and all(c["finish_reason"] == "length" for c in big.json()["choices"])
        assert late.json()["usage"]["completion_tokens"] == 8
        s.wait_idle()

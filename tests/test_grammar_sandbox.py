"""The grammar sandbox on a busy machine (issue 59): its time budget counts the child's CPU, not the wall
clock (a legitimate spec whose child is starved of CPU is served, never refused), a child that neither
finishes nor burns CPU is stopped by a wall-clock limit, no child outlives its sandbox (closed, dropped,
or its server killed mid-compile), and the threads that must not wait (the engine's, the event loop's)
never reach the sandbox. No test here asserts how long anything takes."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from specdecode.grammar import GrammarCompiler, GrammarError, GrammarSpec
from specdecode.grammar_bounds import GrammarLimits
from specdecode.grammar_worker import GrammarSandbox, SandboxClosed
from test_structured import json_tokenizer


@pytest.fixture(scope="module")
def bpe():
    return json_tokenizer()


def sandboxed(bpe, **limits) -> GrammarCompiler:
    compiler = GrammarCompiler(bpe, limits=GrammarLimits(**limits))
    compiler.start_sandbox(fault_marker="FAULT")
    return compiler


def gone(pid: int) -> bool:
    """No such process, or a zombie (its parent gone, not yet reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_starved_of_cpu_past_the_budget_still_serves_the_spec(bpe):
    """FAULT:stall makes the child sleep 1.5 s (no CPU) before compiling, as a niced child on a busy
    machine waits for a core. With a wall-clock budget of 0.5 s it was refused (a 400 for a good spec)."""
    compiler = sandboxed(bpe, time_budget_s=0.5)
    try:
        compiler.validate(GrammarSpec.regex("[a-z]+|FAULT:stall"))
        assert compiler.sandbox.restarts == 0
    finally:
        compiler.close()


def test_a_spec_that_burns_cpu_past_the_budget_is_refused(bpe):
    compiler = sandboxed(bpe, time_budget_s=0.3)
    try:
        with pytest.raises(GrammarError, match="grammar_time_budget_s"):
            compiler.validate(GrammarSpec.regex("FAULT:hang"))  # spins
        compiler.validate(GrammarSpec.regex("[a-z]+ after the spin"))
    finally:
        compiler.close()


def test_a_child_that_neither_answers_nor_computes_meets_the_wall_clock_limit(bpe):
    compiler = sandboxed(bpe, wall_limit_s=1.0)
    try:
        with pytest.raises(GrammarError, match="grammar_wall_limit_s"):
            compiler.validate(GrammarSpec.regex("FAULT:sleep"))
        compiler.validate(GrammarSpec.regex("[a-z]+ after the sleep"))
    finally:
        compiler.close()


def test_a_closed_sandbox_starts_no_child(bpe):
    """A grammar thread still running at server shutdown used to start a fresh child after close():
    a process nobody stops."""
    compiler = sandboxed(bpe)
    sandbox = compiler.sandbox
    pid = sandbox.pid
    compiler.close()
    assert gone(pid)
    with pytest.raises(SandboxClosed):
        sandbox.check("regex", "[a-z]+", None)
    assert sandbox.pid is None
    compiler.start_sandbox()  # a new server over the same tokenizer opens it again
    try:
        compiler.validate(GrammarSpec.regex("[a-z]+ reopened"))
    finally:
        compiler.close()


def test_a_dropped_sandbox_takes_its_child_with_it(bpe):
    sandbox = GrammarSandbox(
        {"tokens": [b"a".hex(), b"b".hex()], "n_vocab": 2, "eos": 1},
        [1],
        {},
        time_budget_s=1.0,
        memory_budget_bytes=0,
        max_matcher_bytes=1 << 30,
    )
    sandbox.start()
    pid = sandbox.pid
    del sandbox
    gc.collect()
    assert gone(pid)


CHILD_OF_A_KILLED_SERVER = """
from specdecode.grammar_worker import GrammarSandbox, _write_message
sandbox = GrammarSandbox({"tokens": ["61", "62"], "n_vocab": 2, "eos": 1}, [1], {}, time_budget_s=0.5,
                         memory_budget_bytes=0, max_matcher_bytes=1 << 30, wall_limit_s=3600)
sandbox.start()
_write_message(sandbox._fds[1], {"kind": "regex", "text": "a", "limits": {}, "fault": "hang"})  # nobody watches it
print(sandbox.pid, flush=True)
import time; time.sleep(3600)
"""


def test_a_spinning_child_does_not_outlive_a_killed_server():
    """The server is SIGKILLed while its child spins on a job that only the child itself can stop: its own
    CPU limit (the time budget and a margin) ends it. It used to run on, an orphan."""
    server = subprocess.Popen([sys.executable, "-c", CHILD_OF_A_KILLED_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(server.stdout.readline())
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    for _ in range(3000):  # an ordering, not a bound: it ends by itself, however busy the machine
        if gone(pid):
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the sandbox child outlived its server")


def test_the_engine_thread_and_the_event_loop_never_reach_the_sandbox(bpe, monkeypatch):
    """After the request thread's prepare(), the event loop's validate() and the engine thread's compile()
    take the spec as served, even once the cache has dropped it: no sandbox job (which waits behind every
    other spec's), no compile in validate()."""
    compiler = sandboxed(bpe, cache_entries=1)
    try:
        spec, other = GrammarSpec.regex("[a-c]+x"), GrammarSpec.regex("[d-f]+y")
        compiler.prepare(spec)
        compiler.prepare(other)  # evicts spec
        assert spec not in compiler._cache

        def no(*args, **kwargs):
            raise AssertionError("reached the sandbox or compiled")

        monkeypatch.setattr(compiler.sandbox, "check", no)
        monkeypatch.setattr(compiler, "_new_matcher", no)
        compiler.validate(spec)  # the event loop's check: approved once, nothing to do
        monkeypatch.undo()
        compiler._approved.clear()  # forgotten too (thousands of newer specs): still never the sandbox
        monkeypatch.setattr(compiler.sandbox, "check", no)
        assert compiler.compile(spec) is not None
    finally:
        compiler.close()


def test_the_approved_set_keeps_no_spec_text(bpe):
    """It outlives the cache by 64 times its entries; keeping each spec (up to 128 KiB of text) made it up to
    512 MiB."""
    compiler = GrammarCompiler(bpe, limits=GrammarLimits(cache_entries=1))
    for i in range(4):
        compiler.validate(GrammarSpec.regex(f"[a-c]{{{i + 1}}}" + "x" * 10_000))
    assert len(compiler._approved) == 4
    assert sum(len(repr(key)) for key in compiler._approved) < 4 * 1000


def test_closing_stops_a_job_in_flight(bpe):
    """Server shutdown closes the sandbox while a grammar thread waits on a child that sleeps: the job ends
    as closed (the server answers 503), and close() did not wait for the wall-clock limit first."""
    compiler = sandboxed(bpe, wall_limit_s=30.0)
    sandbox = compiler.sandbox
    outcome: list = []

    def job() -> None:
        try:
            sandbox.check("regex", "FAULT:sleep", None)
        except Exception as e:  # noqa: BLE001 (the test reads which)
            outcome.append(e)

    thread = threading.Thread(target=job)
    thread.start()
    while sandbox._lock.acquire(blocking=False):  # until the job holds the lock
        sandbox._lock.release()
        time.sleep(0.01)
    time.sleep(0.2)  # the job is in the child
    pid = sandbox.pid
    compiler.close()
    thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], SandboxClosed), outcome
    assert gone(pid)

import os
import threading
import time

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP barriers
# make them many times slower; one thread keeps the suite fast and its timing stable.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread_after_each_test():
    """A command run in-process sets torch's threads (its --threads or the idle cores): back to one."""
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _calibrations_count_as_quiet(monkeypatch):
    """The suite runs on machines busy with other work: a calibration made here is judged quiet, so
    tests of caching do not depend on the load (the busy rule itself is tested with explicit noise)."""
    from specdecode import costmodel

    monkeypatch.setattr(costmodel, "judge", lambda cpu, spreads: costmodel.Noise())


@pytest.fixture(autouse=True, scope="session")
def _private_cache_root(tmp_path_factory):
    """The suite never reads or writes the user's cache (``~/.cache/specdecode``): calibration results,
    converted models and the registry go to a directory of this run (subprocesses inherit it), so two
    runs on one machine cannot meet in a shared file. A test that needs its own root still sets
    ``SPECDECODE_CACHE`` itself."""
    before = os.environ.get("SPECDECODE_CACHE")
    os.environ["SPECDECODE_CACHE"] = str(tmp_path_factory.mktemp("specdecode-cache"))
    yield
    if before is None:
        os.environ.pop("SPECDECODE_CACHE", None)
    else:
        os.environ["SPECDECODE_CACHE"] = before


HEARTBEAT_S = 8  # a test running longer says so this often: the test command is never silent for long


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A line every :data:`HEARTBEAT_S` seconds while one test (its setup included) runs, so ``pytest -q``
    never looks stuck: some tests run whole commands against tiny models for a minute or more."""
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    capture = item.config.pluginmanager.get_plugin("capturemanager")
    # the terminal as it was before pytest captured fd 1 (its saved copy; fd 1 itself when nothing
    # redirects it), written to directly: the test's own capture is never suspended, so nothing it
    # prints meanwhile can miss its capsys
    out = getattr(getattr(capture, "_global_capturing", None), "out", None)
    terminal = getattr(out, "targetfd_save", 1)
    done = threading.Event()

    def beat() -> None:
        start = time.monotonic()
        while not done.wait(HEARTBEAT_S):
            line = f"\n  ... {item.nodeid} still running ({time.monotonic() - start:.0f} s)\n"
            try:
                os.write(terminal, line.encode())
            except OSError:
                return

    thread = threading.Thread(target=beat, daemon=True) if reporter is not None else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        done.set()

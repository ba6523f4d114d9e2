"""The default thread count: the cores other processes leave idle when a model command starts."""

from __future__ import annotations

import pytest
import torch

from specdecode import machine
from specdecode.cli import main


@pytest.fixture
def cores(monkeypatch):
    """Two usable cores whose busy percentages the test sets."""
    busy = [0.0, 0.0]
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    import psutil

    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None, percpu=False: list(busy))
    return busy


@pytest.mark.parametrize(
    "busy, threads", [([0, 0], 2), ([10, 30], 2), ([100, 100], 1), ([60, 70], 1), ([100, 0], 1), ([40, 0], 2)]
)
def test_the_default_is_the_idle_cores(cores, busy, threads):
    cores[:] = busy
    got, why = machine.default_threads()
    assert got == threads and (why is None) == (threads == 2)
    if why:
        assert "of the 2 cores" in why and "busy with other processes" in why


def test_a_command_on_a_busy_machine_uses_one_thread_and_says_so(cores, capsys):
    cores[:] = [100, 100]
    assert main(["generate", "--backend", "toy", "--target", "toy:0", "--prompt", "ab", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "threads: 1 (" in err and "--threads N" in err and torch.get_num_threads() == 1
    cores[:] = [0, 0]  # quiet: every core, and nothing said
    assert main(["generate", "--backend", "toy", "--target", "toy:0", "--prompt", "ab", "--max-new-tokens", "2"]) == 0
    assert "threads:" not in capsys.readouterr().err and torch.get_num_threads() == 2
    cores[:] = [100, 100]  # --threads wins, nothing measured or said
    assert (
        main(
            [
                "generate",
                "--backend",
                "toy",
                "--target",
                "toy:0",
                "--prompt",
                "ab",
                "--max-new-tokens",
                "2",
                "--threads",
                "2",
            ]
        )
        == 0
    )
    assert "threads:" not in capsys.readouterr().err and torch.get_num_threads() == 2


def test_bad_input_on_a_busy_machine_is_still_one_line(cores, capsys):
    cores[:] = [100, 100]
    assert main(["generate", "--backend", "toy", "--target", "toy:0", "--prompt", "ab", "--max-new-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max-new-tokens" in err[0]
    cores[:] = [0, 0]  # the next command in this process does not say the line the failed one kept
    assert main(["generate", "--backend", "toy", "--target", "toy:0", "--prompt", "ab", "--max-new-tokens", "2"]) == 0
    assert "threads:" not in capsys.readouterr().err

"""What this machine offers a run now: the cores this process may use, and how many of them other
processes leave idle.

The default thread count (``--threads`` unset) is the idle cores, measured over a short sample when a
model command starts: a CPU kernel's threads wait for each other at every layer, and beside other busy
processes a thread that waits for a descheduled sibling wastes its share, so two threads on two cores
that other work also wants run several times slower than one (docs/bench/threads/README.md).
"""

from __future__ import annotations

import os

SAMPLE_S = 0.25  # how long the idle cores are sampled for


def usable_cores() -> int:
    """Cores this process may run on (its affinity; every core where that cannot be read)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def idle_cores(sample_s: float = SAMPLE_S) -> float:
    """Cores of this process's affinity that other processes left idle over ``sample_s`` seconds (this
    process is idle meanwhile); all of them where usage cannot be read."""
    try:
        import psutil

        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        busy = psutil.cpu_percent(interval=sample_s, percpu=True)
        if cpus is not None:
            busy = [busy[c] for c in cpus if c < len(busy)]
        return sum(100.0 - b for b in busy) / 100.0
    except Exception:  # noqa: BLE001 - no psutil or /proc: assume a quiet machine
        return float(usable_cores())


_NOTE: list[str] = []  # the line about a reduced default, said once the models start loading


def say_later(line: str) -> None:
    """Keep ``line`` for :func:`take_note` (bad input is answered first, on one line of its own)."""
    _NOTE[:] = [line]


def take_note() -> str | None:
    return _NOTE.pop() if _NOTE else None


def default_threads(sample_s: float = SAMPLE_S) -> tuple[int, str | None]:
    """Threads for a run that names none: the idle cores (at least 1), and why when that is fewer than
    this process may use (None otherwise)."""
    cores = usable_cores()
    idle = idle_cores(sample_s)
    threads = max(1, min(cores, int(idle + 0.5)))
    if threads == cores:
        return threads, None
    return threads, f"{cores - idle:.1f} of the {cores} cores this process may use are busy with other processes"

"""Where and with what a benchmark ran: command, commit, machine, library versions, memory."""

from __future__ import annotations

import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
SHARED_NOTE = "shared with other processes (no isolation); interleaving and medians are meant to absorb that"


def command_line() -> str:
    """The command that is running: ``specdecode ...``, or ``python <script> ...`` for a benchmark script
    (its path relative to the repository when it lies inside it)."""
    if not sys.argv:
        return "?"
    head = "specdecode"
    if sys.argv[0].endswith(".py"):
        script = Path(sys.argv[0]).resolve()
        root = Path(__file__).resolve().parents[2]
        head = "python " + shlex.quote(str(script.relative_to(root) if script.is_relative_to(root) else script))
    return " ".join([head] + [shlex.quote(a) for a in sys.argv[1:]])


def commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def machine() -> dict:
    import psutil
    import torch

    cpu, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("?", "x86_64", ""):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu_flags": " ".join(f for f in _FLAGS if f in flags) or "none of " + " ".join(_FLAGS),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "note": SHARED_NOTE,
    }


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("specdecode", "torch", "transformers", "accelerate", "numpy", "llama_cpp_python"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def peak_rss_gib() -> float:
    """Peak resident set size of this process (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")

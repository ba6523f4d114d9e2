"""Where profiles are kept: one JSON file per (machine, backend, target, threads, context) under
``<cache>/profile`` (``$SPECDECODE_CACHE``, default ``~/.cache/specdecode``).

The machine is its CPU model and flags; the target is its spec with the size and modification time of its
files (:func:`fingerprint`), so a profile of other weights, another CPU or another thread count is never
reused. A draft's measurement is kept inside its target's file with its own fingerprint and is dropped when
its files change. :func:`cached` is what ``--backend auto`` and the auto policy read; it measures nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path

from specdecode.profile.result import CONTEXT, FORMAT, Machine, Profile


def this_machine() -> Machine:
    """This machine's CPU model name and flags (from /proc/cpuinfo; ``platform`` elsewhere)."""
    fallback = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return Machine(fallback)
    cpu, flags = "", ()
    for line in lines:  # the first processor's (x86: model name, flags; ARM: Features)
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "Model") and not cpu:
            cpu = value.strip()
        elif name in ("flags", "Features") and not flags:
            flags = tuple(sorted(value.split()))
    cpu = cpu or fallback
    return Machine(cpu, flags)


def fingerprint(spec: str) -> str:
    """``spec`` with the total size and latest modification time of the files it names (a name alone where it
    names no local files: a hub id, a toy model)."""
    from specdecode.models.loading import ModelNotFoundError, resolve

    try:
        path = resolve(spec).path
    except ModelNotFoundError:
        return spec
    if path is None:
        return spec
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    stats = [os.stat(f) for f in files]
    return f"{spec}:{sum(s.st_size for s in stats)}:{max((s.st_mtime_ns for s in stats), default=0)}"


def key(backend: str, target: str, threads: int, context: int = CONTEXT, machine: Machine | None = None) -> str:
    """What a profile was measured for, as one string (the cache file is named by its hash)."""
    m = machine or this_machine()
    return json.dumps(
        {
            "format": FORMAT,
            "cpu": m.cpu,
            "flags": hashlib.sha256(" ".join(m.flags).encode()).hexdigest()[:16],
            "backend": backend,
            "target": fingerprint(target),
            "threads": threads,
            "context": context,
        },
        sort_keys=True,
    )


def path_for(profile_key: str, cache_dir: Path | None = None) -> Path:
    from specdecode.models.fetch import cache_root

    digest = hashlib.sha256(profile_key.encode()).hexdigest()[:16]
    return (cache_dir or cache_root()) / "profile" / f"{digest}.json"


def store(profile: Profile, cache_dir: Path | None = None) -> Path:
    """Write ``profile`` under its key (replacing what was there); its path."""
    from specdecode.fsutil import make_readable

    path = path_for(profile.key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    make_readable(path)
    return path


def cached(
    target: str, backend: str, threads: int, cache_dir: Path | None = None, context: int = CONTEXT
) -> Profile | None:
    """The stored profile of ``target`` on ``backend`` with ``threads`` threads on this machine, with only the
    drafts whose files are unchanged; None when there is none (or it was measured for anything else)."""
    profile_key = key(backend, target, threads, context)
    path = path_for(profile_key, cache_dir)
    try:
        profile = Profile.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if profile.key != profile_key:
        return None
    drafts = {name: d for name, d in profile.drafts.items() if d.fingerprint == fingerprint(name)}
    return replace(profile, drafts=drafts)


def measured_speeds(cfg) -> Callable[[str, str], float | None] | None:
    """:func:`decode_speeds` for a command's config (``--backend auto`` only, with its thread count): what the
    commands hand :func:`specdecode.build.choose_backend`; None where nothing is to be read."""
    if cfg.backend != "auto" or not cfg.threads:
        return None
    return decode_speeds(cfg.threads)


def decode_speeds(threads: int, cache_dir: Path | None = None) -> Callable[[str, str], float | None]:
    """What ``--backend auto`` reads (``specdecode.models.backends.choose``'s ``measured``): (backend, target) ->
    the one-token decode tok/s of the cached profile with ``threads`` threads on this machine, or None."""

    def measured(backend: str, target: str) -> float | None:
        profile = cached(target, backend, threads, cache_dir)
        return None if profile is None else profile.target.tok_s

    return measured

"""Measuring a profile: load a target and its drafts on one backend, time them (specdecode.profile.measure),
and put the medians into a :class:`~specdecode.profile.result.Profile` under its cache key."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from specdecode.profile import cache
from specdecode.profile.measure import DRAFT_WIDTHS, WIDTHS, Clock, Probe, run_rounds
from specdecode.profile.result import CONTEXT, Machine, Profile


def profile_runners(
    backend: str,
    threads: int,
    target: tuple[str, object],
    drafts: Sequence[tuple[str, object]] = (),
    budget_s: float = 30.0,
    clock: Clock = time.perf_counter,
    progress: str | None = None,
    context: int = CONTEXT,
    machine: Machine | None = None,
) -> Profile:
    """The profile of ``target`` = (spec, runner) and each draft (spec, runner), all on ``backend`` with
    ``threads`` threads: every model's forwards timed in interleaved rounds that fit ``budget_s`` seconds
    of ``clock``."""
    from specdecode.costmodel import CpuShare

    machine = machine or cache.this_machine()
    probes = [Probe(target[0], cache.fingerprint(target[0]), target[1], WIDTHS, context, clock)]
    probes += [Probe(spec, cache.fingerprint(spec), runner, DRAFT_WIDTHS, context, clock) for spec, runner in drafts]
    cpu = CpuShare()
    _, seconds = run_rounds(probes, budget_s, clock, progress)
    others = cpu.others()
    spreads = [s for p in probes for s in p.spreads()]
    costs = [p.cost(str(getattr(p.runner, "where", backend))) for p in probes]
    return Profile(
        backend,
        threads,
        machine,
        context,
        costs[0],
        {c.spec: c for c in costs[1:]},
        others_cpu=others,
        spread=statistics.median(spreads) if spreads else 1.0,
        measured_s=seconds,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        key=cache.key(backend, target[0], threads, context, machine),
    )


def profile_backend(
    name: str,
    target: str,
    drafts: list[str],
    threads: int,
    budget_s: float,
    say=print,
    clock: Clock = time.perf_counter,
) -> Profile:
    """Load ``target`` and ``drafts`` on backend ``name`` (the registry's) and measure them."""
    from specdecode.models.backends import Settings, get

    backend = get(name)
    t0 = time.perf_counter()
    say(f"{name}: loading {target}" + "".join(f" and {d}" for d in drafts))
    models = [backend.load(target, Settings(threads=threads, role="target"))]
    models += [backend.load(d, Settings(threads=threads, role="draft")) for d in drafts]
    runners = [m.runner(draft=i > 0) for i, m in enumerate(models)]
    say(f"{name}: loaded in {time.perf_counter() - t0:.0f} s; timing forwards after {CONTEXT} tokens of context")
    specs = [target, *drafts]
    return profile_runners(
        name,
        threads,
        (target, runners[0]),
        list(zip(specs[1:], runners[1:])),
        budget_s,
        clock,
        progress=f"profiling {name}",
    )

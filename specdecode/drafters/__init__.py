"""The drafter registry: ``--draft SPEC`` -> a drafter, one factory per drafter file.

A spec is ``KIND:ARG`` for a registered kind (``ngram``, ``ngram:4``, ``model:PATH``) or, for anything
else, the name of a draft model (an alias, a directory, a ``.gguf`` file or a hub id), i.e.
``model:SPEC``; ``medusa:DIR`` and ``eagle:DIR`` name trained drafters. A model may carry its quantization: ``qwen2.5-coder-0.5b@int8``. Adding a drafter is one file with a ``build(arg, ctx)`` function and one line here.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

from specdecode.config import DraftSettings
from specdecode.drafters.base import Drafter
from specdecode.errors import UserError
from specdecode.models.base import Runner


class DraftSpecError(UserError, ValueError):
    """A ``--draft`` spec that names no usable drafter."""


@dataclass(frozen=True)
class DrafterKind:
    """A registry entry: where the drafter's factory lives, what its ARG names, and what it offers beyond the
    engine's protocol (:class:`specdecode.drafters.base.Drafter`): ``capabilities``, names from
    :data:`specdecode.drafters.base.CAPABILITIES` (a test checks each against the drafter it builds)."""

    module: str  # holds ``build(arg, ctx) -> Drafter``
    loads_model: bool  # ARG names a model that build() gets through ``ctx.draft_runner()``
    help: str
    needs_arg: bool = False  # KIND alone is not a spec (medusa:DIR)
    reads_layers: bool = False  # reads intermediate layers and feeds input embeddings (a backend must expose them)
    files: bool = False  # ARG names weights (a model, trained heads): resolved and checked as files
    cross_vocabulary: bool = False  # its model has its own tokenizer: it drafts for any target (reads text)
    capabilities: frozenset[str] = frozenset()  # optional capabilities (catch_up, free, runners, history)


_LAZY_MODEL = frozenset({"catch_up", "runners"})  # a draft model: starts late and catches up; runs its own model
KINDS: dict[str, DrafterKind] = {
    "model": DrafterKind(
        "specdecode.drafters.draft_model",
        True,
        "a smaller causal LM with the target's vocabulary",
        files=True,
        capabilities=_LAZY_MODEL | {"prefixes"},
    ),
    "xvocab": DrafterKind(
        "specdecode.drafters.cross_vocab",
        True,
        "a causal LM with its own tokenizer, any target (string-level exact match; "
        "xvocab-tli:MODEL: token-level intersection)",
        files=True,
        cross_vocabulary=True,
        capabilities=_LAZY_MODEL,
    ),
    "xvocab-tli": DrafterKind(
        "specdecode.drafters.cross_vocab_tli",
        True,
        "a causal LM with its own tokenizer, any target (token-level intersection)",
        files=True,
        cross_vocabulary=True,
        capabilities=_LAZY_MODEL,
    ),
    "ngram": DrafterKind(
        "specdecode.drafters.ngram",
        False,
        "prompt lookup: copy what followed the suffix earlier",
        capabilities=frozenset({"free"}),
    ),
    "suffix": DrafterKind(
        "specdecode.drafters.suffix",
        False,
        "suffix-tree lookup over the sequence and earlier outputs (SuffixDecoding)",
        capabilities=frozenset({"free", "history"}),
    ),
    "medusa": DrafterKind(
        "specdecode.drafters.medusa",
        False,
        "Medusa heads on the target's final hidden state (medusa:DIR from `specdecode heads train`)",
        needs_arg=True,
        files=True,
    ),
    "eagle": DrafterKind(
        "specdecode.drafters.eagle",
        False,
        "an EAGLE draft layer on the target's features (eagle:DIR from `specdecode heads train --kind eagle`)",
        needs_arg=True,
        reads_layers=True,
        files=True,
        capabilities=frozenset({"runners"}),
    ),
}


@dataclass(frozen=True)
class DraftSpec:
    kind: str
    arg: str
    quantization: str | None = None  # a model's ``@int8``/``@int4``/``@auto``/``@none``/``@gguf``/``@q4_0``... suffix

    @property
    def loads_model(self) -> bool:
        return KINDS[self.kind].loads_model

    @property
    def kind_entry(self) -> DrafterKind:
        """Its kind's registry entry (what its ARG names, its capabilities)."""
        return KINDS[self.kind]


def parse_draft(spec: str) -> DraftSpec:
    from specdecode.models.quantize import DRAFT_MODES

    kind, sep, arg = spec.partition(":")
    if kind not in KINDS:
        kind, arg = "model", spec
    if not arg and (kind == "model" or KINDS[kind].loads_model):
        raise DraftSpecError(f"draft spec {spec!r}: name the model, e.g. {kind}:PATH" if spec else "empty draft spec")
    if not arg and KINDS[kind].needs_arg:
        raise DraftSpecError(f"draft spec {spec!r}: {KINDS[kind].help}")
    quantization = None
    if KINDS[kind].loads_model:
        name, at, suffix = arg.rpartition("@")
        if at and suffix in DRAFT_MODES:
            arg, quantization = name, suffix
    return DraftSpec(kind, arg, quantization)


@dataclass
class DraftContext:
    """What a drafter factory may use."""

    target: Runner
    config: DraftSettings | None  # the drafters' slice of the EngineConfig (None: every default)
    make_draft_runner: Callable[[], Runner] | None = None  # for kinds that load a model
    tokenizer: Any = None  # the target's (a cross-vocabulary draft reads the text)
    draft_tokenizer: Any = None  # the loaded draft model's own

    def __post_init__(self) -> None:
        if self.config is None:
            self.config = DraftSettings()

    def draft_runner(self) -> Runner:
        if self.make_draft_runner is None:
            raise ValueError("this drafter needs a draft model, and none was loaded")
        return self.make_draft_runner()


def check_draft(spec: str) -> DraftSpec:
    """Parse ``spec`` and run its drafter's cheap checks (``validate(arg)``, e.g. that a heads
    directory exists), so a bad spec fails before any model loads."""
    parsed = parse_draft(spec)
    module = importlib.import_module(KINDS[parsed.kind].module)
    if hasattr(module, "validate"):
        module.validate(parsed.arg)
    return parsed


def build_drafter(spec: str | DraftSpec, ctx: DraftContext) -> Drafter:
    spec = parse_draft(spec) if isinstance(spec, str) else spec
    return importlib.import_module(KINDS[spec.kind].module).build(spec.arg, ctx)


def draft_label(spec: str) -> str:
    """A short name for a drafter spec: its kind, or a model's file/directory name."""
    from pathlib import Path

    parsed = parse_draft(spec)
    name = parsed.kind if parsed.kind != "model" else Path(parsed.arg).name.removesuffix(".gguf")
    return re.sub(r"[^\w.-]", "_", name) or "draft"


def unique_labels(specs: list[str]) -> list[str]:
    """:func:`draft_label` of each spec, numbered where two would be equal (``ngram``, ``ngram2``)."""
    out: list[str] = []
    for spec in specs:
        label = draft_label(spec)
        out.append(label if label not in out else f"{label}{len(out) + 1}")
    return out

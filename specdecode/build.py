"""From model names to a ready :class:`Engine`: the one place commands (generate, bench, check,
serve) turn their ``--target/--draft`` flags into models, runners and a drafter."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from specdecode.config import (  # noqa: F401  (EngineConfig, ConfigError, config_from_args: re-exported)
    DEFAULTS,
    DRAFT_MODES,
    POLICIES,
    ConfigError,
    EngineConfig,
    add_setting,
    config_from_args,
    default,
)
from specdecode.errors import UserError
from specdecode.models import backends
from specdecode.models.backends import BackendRefused, Choice, Model, Request, Settings

if TYPE_CHECKING:
    from pathlib import Path

    from specdecode.drafters.base import Drafter
    from specdecode.engine import Engine
    from specdecode.models.base import Runner


class PairError(UserError, ValueError):
    """A draft/target pair that cannot be used together."""


class DraftAction(argparse.Action):
    """``--draft`` may repeat: the first is ``args.draft``, the others go to ``args.extra_drafts``."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is None:
            setattr(namespace, self.dest, values)
        else:
            namespace.extra_drafts = [*(getattr(namespace, "extra_drafts", None) or []), values]


@dataclass
class LoadedPair:
    """The target and, when drafters need them, the draft models: loaded once, runners made per engine.

    ``draft`` is the first draft model; ``extra`` the others (``--draft-policy auto`` may choose among
    several, e.g. a same-vocabulary draft and a cross-vocabulary one), keyed by their ``--draft`` spec."""

    target: Model
    draft: Model | None = None
    draft_spec: str | None = None  # the --draft spec that loaded ``draft``
    extra: dict = field(default_factory=dict)  # spec -> Model: the other draft models

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def backend(self) -> str:  # what runs the target (a draft model may run on another backend beside it)
        return self.target.backend

    @property
    def draft_quantization(self) -> str:
        modes = [m.quantization for m in self.draft_models().values()]
        return ",".join(dict.fromkeys(modes)) if modes else "none"

    @property
    def target_quantization(self) -> str:  # not "none": not the model the user named (LOSSY)
        return self.target.quantization

    def draft_models(self) -> dict:
        """Every loaded draft model by its spec, the first one first."""
        first = {self.draft_spec or "": self.draft} if self.draft is not None else {}
        return {**first, **self.extra}

    def draft_for(self, spec: str) -> Model | None:
        """The draft model a ``--draft`` spec loaded (a pair built by hand, without specs: its one draft)."""
        if spec in self.extra:
            return self.extra[spec]
        if self.draft_spec is None or spec == self.draft_spec:
            return self.draft
        raise ConfigError(
            f"--draft {spec!r} names no draft model this pair loaded "
            f"({', '.join(self.draft_models())}); load the pair with it"
        )


def _quantizations(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in DRAFT_MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"draft quantization must be one of {', '.join(DRAFT_MODES)}, got {text!r}")
    return modes


# the engine settings every model command has, in the order --help lists them (specdecode.config has each one)
MODEL_SETTINGS = (
    "num_draft_tokens",
    "device",
    "dtype",
    "max_context",
    "draft_policy",
    "max_draft_tokens",
    "catch_up_tokens",
    "recalibrate",
    "draft_confidence",
    "draft_context",
    "draft_quantization",
    "target_quantization",
    "tree_topk",
    "tree_nodes",
    "acceptance",
    "typical_epsilon",
    "typical_alpha",
    "sampler",
    "batch_invariant",
    "backend",
    "threads",
    "weights",
    "verify_budget",
)


def add_model_arguments(
    parser: argparse.ArgumentParser,
    draft_required: bool = False,
    quantization_sweep: bool = False,
    target_required: bool = True,
    tool: str | None = None,
) -> None:
    """The models group: ``--target``, ``--draft`` and every setting of :data:`MODEL_SETTINGS`, each flag
    made from its :class:`EngineConfig` field (``tool``: the command, for the defaults a field declares for
    it). ``quantization_sweep`` (bench): ``--draft-quantization`` takes several modes to compare."""
    g = parser.add_argument_group("models")
    add_setting(g, "target", tool, required=target_required)
    add_setting(
        g,
        "draft",
        tool,
        "" if draft_required else "; omit for target-only",
        required=draft_required,
        action=DraftAction,
    )
    parser.set_defaults(extra_drafts=[])
    for name in MODEL_SETTINGS:
        if name == "draft_quantization" and quantization_sweep:
            add_setting(
                g,
                name,
                tool,
                type=_quantizations,
                choices=None,
                default=[default(name, tool)],
                metavar="MODE,...",
                help=f"draft quantizations to compare side by side ({', '.join(DRAFT_MODES)}), "
                "e.g. none,int8,gguf; configs other than none are named <config>@<mode>. The target is untouched",
            )
        else:
            add_setting(g, name, tool)


def backend_request(cfg: EngineConfig) -> Request:
    """What decides which backend can run ``cfg`` (see :mod:`specdecode.models.backends`)."""
    from specdecode.drafters import KINDS, parse_draft

    specs = [parse_draft(d) for d in cfg.drafts]
    modes = {spec.quantization or cfg.draft_quantization for spec in specs if spec.loads_model} - {"none"}
    return Request(
        cfg.target,
        cfg.device,
        cfg.dtype,
        cfg.target_quantization,
        frozenset(modes),
        cfg.batch_invariant,
        features=any(KINDS[spec.kind].reads_layers for spec in specs),
        trees=cfg.trees,
    )


def choose_backend(cfg: EngineConfig, measured=None) -> Choice:
    """The backend for ``cfg.backend`` (``auto``: one a cached profile measured faster on this machine, by
    ``measured(backend, target) -> tok/s`` that a command passes (``specdecode.profile.decode_speeds``), else the
    first in the registry that can run these settings) and why; a clear error when the one asked for cannot.
    Loads nothing."""
    return backends.choose(cfg.backend, backend_request(cfg), measured)


def announce(cfg: EngineConfig, choice: Choice) -> None:
    """``--backend auto`` says what it chose and why, on one line (stderr); and the default thread count
    when it is fewer than the cores (:mod:`specdecode.machine`)."""
    import sys

    from specdecode.machine import take_note

    if cfg.backend == "auto":
        print(choice.line(), file=sys.stderr, flush=True)
    if (note := take_note()) is not None:
        print(note, file=sys.stderr, flush=True)


def load_pair(cfg: EngineConfig, backend: str) -> LoadedPair:
    """Load the target on ``backend`` (a name :func:`choose_backend` gave) and every draft model a drafter
    spec names: each on the backend that applies its quantization (``--draft-quantization`` or the
    spec's ``@mode``), else beside the target on the target's backend when that opens it."""
    import sys

    from specdecode.drafters import parse_draft
    from specdecode.models.loading import tokenizers_compatible

    def load(where: str, name: str, settings: Settings) -> Model:  # a model's load takes seconds: say which
        print(f"loading {settings.role} {name} ({where}) ...", file=sys.stderr, flush=True)
        return backends.get(where).load(name, settings)

    names = model_drafts(cfg)
    specs = [parse_draft(name) for name in names]  # a bad spec fails before anything loads
    target_backend = backends.get(backend)
    target_backend.spec_kind(cfg.target)  # a target that cannot be found fails before the drafts' load
    target_settings = Settings(
        cfg.device,
        cfg.dtype,
        cfg.threads,
        cfg.target_quantization,
        "target",
        batch_invariant=cfg.batch_invariant == "on",
        weights=cfg.weights,
    )
    if not specs:
        return LoadedPair(load(backend, cfg.target, target_settings))
    plans = [_draft_plan(cfg, spec, backend) for spec in specs]  # every draft's backend checked before any load
    loaded: dict[str, Model] = {}
    for name, (where, settings, quantized) in zip(names, plans):  # quantized drafts first: their
        if quantized:  # unquantized weights are gone before the target's load
            loaded[name] = load(where, parse_draft(name).arg, settings)
    target = load(backend, cfg.target, target_settings)
    for name, (where, settings, quantized) in zip(names, plans):
        if not quantized:
            loaded[name] = load(where, parse_draft(name).arg, settings)
    for name, spec in zip(names, specs):
        if spec.kind_entry.cross_vocabulary:  # it reads text: any tokenizer drafts for any target
            continue
        draft = loaded[name]
        problem = tokenizers_compatible(target.tokenizer, draft.tokenizer, target.token_rows, draft.token_rows)
        if problem:
            raise PairError(
                f"draft {name!r} cannot draft for target {cfg.target!r}: {problem}; a draft with "
                f"another tokenizer drafts through --draft xvocab:{spec.arg} (or xvocab-tli:{spec.arg})"
            )
    first = names[0]
    return LoadedPair(target, loaded[first], first, {n: loaded[n] for n in names[1:]})


def _draft_plan(cfg: EngineConfig, spec, backend: str) -> tuple[str, Settings, bool]:
    """Where one draft model runs, with which settings, and whether it is quantized (raises, before
    any load, when that backend cannot open it or is not installed)."""
    mode = spec.quantization or cfg.draft_quantization
    where = backends.draft_backend(mode, backend, spec.arg)
    draft_backend = backends.get(where)
    if mode != "none":  # is the draft something that backend opens, is it installed? (before any load)
        if not draft_backend.opens(spec.arg):
            draft_backend.spec_kind(spec.arg)  # a draft that cannot be found says so
            text = draft_backend.supports.opens_text
            raise ConfigError(
                f"--draft-quantization {mode} runs the draft on {where}, which loads {text}; "
                f"{spec.arg!r} is not {text} (use none, int8, int4 or auto for it)"
            )
        missing = draft_backend.missing()
        if missing:
            raise BackendRefused(f"--draft-quantization {mode} runs the draft on {where}: {missing}")
    device, dtype = (cfg.device, cfg.dtype) if where == backend else ("cpu", "float32")  # beside a target elsewhere
    return where, Settings(device, dtype, cfg.threads, mode, "draft", weights=cfg.weights), mode != "none"


def make_policy(cfg: EngineConfig, selector=None):
    """The draft-length policy: fixed k, per-sequence from acceptance, or ``selector`` (``--draft-policy
    auto``, built with its drafters: :func:`engine_from_pair`); under a verify budget when one is set."""
    from specdecode.policy import AcceptancePolicy, BudgetPolicy, FixedPolicy

    k = cfg.num_draft_tokens if cfg.draft else 0
    policy = selector if selector is not None else FixedPolicy(k)
    if selector is None and cfg.draft and cfg.draft_policy == "acceptance":
        policy = AcceptancePolicy(start_k=k, max_k=max(k, cfg.max_draft_tokens))
    return BudgetPolicy(policy, cfg.verify_budget) if cfg.verify_budget else policy


def engine_from_pair(pair: LoadedPair, cfg: EngineConfig) -> Engine:
    from specdecode.drafters import DraftContext, build_drafter, parse_draft
    from specdecode.engine import Engine

    model_ctx = pair.target.max_position
    max_context = cfg.context_for(model_ctx)
    if max_context > model_ctx:
        raise ConfigError(f"--max-context {max_context} exceeds the model's {model_ctx}")
    invariant = batch_invariant_on(cfg, pair.target)
    trees = cfg.trees
    if trees:  # a backend may have a finite pool for trees (llama.cpp's sequence ids): refuse what could run out
        pair.target.check_tree(cfg.max_batch_size, cfg.tree_nodes, "the target's tree verify")
        for draft_model in {id(m): m for m in map(pair.draft_for, model_drafts(cfg))}.values():  # the ones it uses
            cast(Model, draft_model).check_tree(  # (load_pair loaded a model for each of these specs)
                cfg.max_batch_size, cfg.tree_topk * cfg.num_draft_tokens + 1, "the draft model's tree growth"
            )
    target = pair.target.runner(batch_invariant=invariant, trees=trees)  # the engine sizes its cache
    drafter: Drafter | None = None
    selector = None
    if cfg.draft:
        draft_settings = cfg.draft_settings(invariant)  # --batch-invariant as resolved for this target

        def context(spec: str) -> DraftContext:  # what the drafter of one spec may use: its own draft model
            model = pair.draft_for(spec) if parse_draft(spec).loads_model else None
            make = (
                (lambda: model.runner(batch_invariant=invariant, trees=trees, draft=True))
                if model is not None
                else None
            )
            return DraftContext(
                target, draft_settings, make, pair.tokenizer, model.tokenizer if model is not None else None
            )

        if cfg.draft_policy == "auto":  # the selector and the drafters it routes among, built together
            from specdecode.drafters import unique_labels
            from specdecode.selector import auto_drafting

            parts = {
                name: build_drafter(spec, context(spec)) for name, spec in zip(unique_labels(cfg.drafts), cfg.drafts)
            }
            drafter, selector = auto_drafting(
                parts,
                cost_model(target, parts, cfg, pair, max_context),
                max_k=cfg.max_draft_tokens,
                catch_up_tokens=cfg.catch_up_tokens,
            )
        else:
            drafter = build_drafter(cfg.draft, context(cfg.draft))
    verifier = None
    if cfg.acceptance == "typical":
        from specdecode.verify.typical import typical_verifier

        verifier = typical_verifier(cfg.typical_epsilon, cfg.typical_alpha)
    settings = cfg.engine_settings(max_context, pair.target_quantization, lossy_labels(pair.target_quantization, cfg))
    return Engine(target, pair.tokenizer, drafter, make_policy(cfg, selector), settings, verifier=verifier)


def cost_model(target: Runner, parts: dict, cfg: EngineConfig, pair: LoadedPair, max_context: int, cache_dir=None):
    """The selector's cost model for ``target`` and the drafters ``parts``, sized as the engine will size
    them (its batch, its verify window of chains): from the cache when these models, device, dtype,
    backend, threads and grid were measured before, else measured now (a few seconds to a minute)."""
    import sys

    import torch

    from specdecode import costmodel

    batch, window = cfg.max_batch_size, cfg.max_draft_tokens + 1  # Engine.window for chains of max_k
    key = "|".join(
        [
            "cost-model v5",
            _fingerprint(cfg.target),
            *(f"{n}={_fingerprint(d)}{_quantized(pair, d)}" for n, d in zip(parts, cfg.drafts)),
            f"draft quantization {pair.draft_quantization}",
            f"target quantization {pair.target_quantization}",
            f"device {target.device}",
            f"dtype {target.dtype}",
            f"backend {target.backend}",
            f"threads {cfg.threads or torch.get_num_threads()}",
            f"torch {torch.__version__}",
            f"batch {batch}",
            f"window {window}",
            f"confidence {cfg.draft_confidence}",
        ]
    )

    def measure():
        print(
            f"calibrating step costs for --draft-policy auto (batch <= {batch}, draft <= {window - 1}; once: "
            "cached for the next run when the machine is quiet)",
            file=sys.stderr,
            flush=True,
        )
        target.ensure_capacity(batch, max_context + window)
        for part in parts.values():
            part.reserve(batch, max_context + window)
        return costmodel.calibrate(target, parts, batch, window, window - 1, max_context, progress=True)

    return costmodel.cached(
        key, measure, cache_dir, cfg.recalibrate, say=lambda line: print(line, file=sys.stderr, flush=True)
    )


def _quantized(pair: LoadedPair, spec: str) -> str:
    """``@mode`` of the draft model a spec loaded (each model's own mode, for the cost model's key)."""
    from specdecode.drafters import parse_draft

    if not (parse_draft(spec).loads_model and pair.draft_models()):
        return ""
    return f"@{cast(Model, pair.draft_for(spec)).quantization}"


def _fingerprint(name: str) -> str:
    """A model or drafter spec, with the size and modification time of what it names on disk, so a
    cost model measured for other weights is not reused."""
    import os
    from pathlib import Path

    from specdecode.drafters import parse_draft

    try:
        spec = parse_draft(name)
    except ValueError:
        return name
    if not spec.kind_entry.files or not spec.arg:
        return name
    path = Path(spec.arg).expanduser()
    if spec.loads_model and not path.exists():  # an alias (`specdecode models fetch`)
        found = _model_path(spec.arg)
        if found is None:  # a hub id: its name is all we know
            return name
        path = found
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.is_file()) if path.is_dir() else []
    stats = [os.stat(f) for f in files[:64]]
    return f"{name}:{sum(st.st_size for st in stats)}:{max((st.st_mtime_ns for st in stats), default=0)}"


def batch_invariant_on(cfg: EngineConfig, target: Model) -> bool:
    """Resolve ``cfg.batch_invariant`` (on/off/auto) for the loaded target."""
    if cfg.batch_invariant != "auto":
        return cfg.batch_invariant == "on"
    # trees are not covered; nor is a quantized target's kernel
    return target.batch_invariant_default(cfg.trees, quantized=cfg.target_quantization != "none")


def lossy_labels(target_quantization: str, cfg: EngineConfig) -> dict:
    """Why outputs would not follow the named target's law ({} = exact): what reports and JSON print."""
    labels: dict = {}
    if target_quantization != "none":
        labels["target_quantization"] = target_quantization
    if cfg.acceptance != "exact" and cfg.draft:
        labels["acceptance"] = f"{cfg.acceptance} (epsilon {cfg.typical_epsilon}, alpha {cfg.typical_alpha})"
    return labels


def validate_config(cfg: EngineConfig) -> None:
    """What an :class:`EngineConfig` cannot check by itself because it reads files (raises UserError
    naming the flag), before any model loads: each drafter spec's own checks (a heads directory
    exists) and no draft model named twice."""
    from specdecode.drafters import check_draft

    specs = [check_draft(spec) for spec in cfg.drafts]
    same_draft_model(cfg.drafts, cfg.draft_quantization, ConfigError)
    if cfg.draft_context and not any(s.kind == "model" for s in specs):
        raise ConfigError("--draft-context bounds what a draft model (same vocabulary) reads: give one with --draft")


def build_engine(cfg: EngineConfig, measured=None) -> Engine:
    """The engine ``cfg`` names, its models loaded (``measured``: see :func:`choose_backend`)."""
    validate_config(cfg)
    cfg = without_idle_draft(cfg)
    choice = choose_backend(cfg, measured)
    pair = load_pair(cfg, choice.name)
    announce(cfg, choice)
    return engine_from_pair(pair, cfg)


def build_engine_from(values: dict) -> Engine:
    """:func:`build_engine` in another process (a replica): the config as plain data
    (:func:`specdecode.config.config_dict`), made and so checked again here."""
    return build_engine(EngineConfig(**values))


def without_idle_draft(cfg: EngineConfig) -> EngineConfig:
    """``-k 0`` with a fixed draft length drafts nothing: say so, and do not load the draft."""
    import sys
    from dataclasses import replace

    if cfg.drafts and cfg.num_draft_tokens == 0 and cfg.draft_policy == "fixed":
        print(f"note: -k 0 decodes target-only; --draft {', '.join(cfg.drafts)} is not loaded", file=sys.stderr)
        return replace(cfg, draft=None, extra_drafts=())
    return cfg


def same_draft_model(drafts, draft_quantization: str, error=ConfigError) -> None:
    """Refuse a draft model named twice (the same kind, path and quantization): several draft models
    may share an engine (``auto`` chooses among them), each once."""
    from specdecode.drafters import parse_draft

    seen: dict[tuple, str] = {}
    for text in drafts:
        spec = parse_draft(text)
        if spec.loads_model:
            key = (spec.kind, _model_identity(spec.arg), spec.quantization or draft_quantization)
            if key in seen:
                raise error(f"--draft {text!r} names the same draft model as --draft {seen[key]!r}")
            seen[key] = text


def _model_path(name: str) -> Path | None:
    """The file or folder a model name points at (a path, or a fetched alias's file); None for a hub id
    or a name nothing answers to (load_pair then says what is wrong with it)."""
    from specdecode.models.loading import ModelNotFoundError, resolve

    try:
        return resolve(name).path
    except (ModelNotFoundError, ValueError):
        return None


def _model_identity(name: str) -> str:
    """What a model name points at on disk (an alias and its file are the same model), else the name."""
    path = _model_path(name)
    return str(path) if path is not None else os.path.normpath(os.path.expanduser(name))


def model_drafts(cfg: EngineConfig) -> list[str]:
    """The drafter specs whose models :func:`load_pair` loads, in ``--draft`` order."""
    from specdecode.drafters import parse_draft

    return list(dict.fromkeys(d for d in cfg.drafts if parse_draft(d).loads_model))

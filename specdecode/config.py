"""Every engine setting, once: its name, type, default, range or choices and help live on its field here.

:class:`EngineConfig` is frozen and checks itself once, when it is made (as
:class:`specdecode.sampling.SamplingParams` does): a bad value raises :class:`ConfigError` naming the flag,
before anything loads. The commands' flags are produced from the fields (:func:`add_setting`), so a flag's
default is its field's; where a tool wants another default (``serve`` decodes 8 sequences together, in
steps of 512 tokens) the field declares it beside its own (``tools``). Choices come from the registry that
defines them (samplers, backends, quantization modes), read when first needed so that ``--help`` imports no
torch. The engine and the drafters take typed slices of the config (:class:`EngineSettings`,
:class:`DraftSettings`), never loose keyword parameters or ``getattr`` with a default.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, MISSING, Field, dataclass, field, fields
from typing import Any

from specdecode.errors import UserError


class ConfigError(UserError, ValueError):
    """Engine settings that cannot work (a negative draft length, an unknown policy, ...)."""


class Names(Sequence):
    """A registry's names, read on first use (its module may import torch; building a parser must not)."""

    def __init__(self, read: Callable[[], Sequence[str]]) -> None:
        self._read = read

    def __getitem__(self, i):
        return tuple(self._read())[i]

    def __len__(self) -> int:
        return len(tuple(self._read()))

    def __repr__(self) -> str:
        return repr(tuple(self._read()))


def _samplers() -> Sequence[str]:
    from specdecode.sampling import SAMPLERS

    return SAMPLERS


def _backends() -> Sequence[str]:
    from specdecode.models import backends

    return ("auto", *backends.names())


def _draft_modes() -> Sequence[str]:
    from specdecode.models.quantize import DRAFT_MODES

    return DRAFT_MODES


def _target_modes() -> Sequence[str]:
    from specdecode.models.quantize import TARGET_MODES

    return TARGET_MODES


POLICIES = ("fixed", "acceptance", "auto")  # --draft-policy (specdecode.policy, specdecode.selector)
ACCEPTANCES = ("exact", "typical")  # --acceptance (specdecode.verify.typical is the lossy one)
INVARIANCE = ("auto", "on", "off")  # --batch-invariant (specdecode.models.batch_invariant)
WEIGHTS = ("resident", "mapped")  # --weights (specdecode.models.backends.base.Settings)
SAMPLERS = Names(_samplers)  # --sampler: specdecode.sampling.SAMPLERS
BACKENDS = Names(_backends)  # --backend: auto or a registered backend (specdecode.models.backends)
DRAFT_MODES = Names(_draft_modes)  # --draft-quantization: specdecode.models.quantize.DRAFT_MODES
TARGET_MODES = Names(_target_modes)  # --target-quantization: specdecode.models.quantize.TARGET_MODES
CONTEXT_CAP = 4096  # --max-context's default: the model's context, at most this many tokens


def setting(
    default: Any = MISSING,
    *flags: str,
    help: str | None = None,
    type: Callable | None = None,
    choices: Sequence | None = None,
    minimum: float | None = None,
    tools: Mapping[str, Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    text: Callable[[Any], str] | None = None,
    **argparse_options: Any,
) -> Any:
    """A field that is a setting: its default, its flag(s) (none: no command sets it by flag), help, the
    argparse ``type``, its choices or minimum (checked by :func:`check_fields`), and the other defaults a tool
    declares for it (``tools={"serve": 8}``). A value the flag gives as text is read by ``parse`` when the
    config is made (:func:`values_from_args`; its default is shown by ``text``). ``argparse_options``:
    ``metavar`` and the like."""
    metadata = {
        "flags": flags,
        "help": help,
        "type": type,
        "choices": choices,
        "minimum": minimum,
        "tools": dict(tools or {}),
        "parse": parse,
        "text": text,
        "argparse": argparse_options,
    }
    return field(default=default, metadata=metadata)


def flag_name(f: Field) -> str:
    """The flag a field's errors name (its long flag; ``--name`` for a field without one)."""
    return next((x for x in f.metadata.get("flags", ()) if x.startswith("--")), "--" + f.name.replace("_", "-"))


def _or(names: Sequence) -> str:
    names = [str(n) for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_fields(obj) -> None:
    """Check every setting field of a dataclass against its declared type, minimum and choices (raises
    :class:`ConfigError` naming the flag): the one validator of each setting."""
    for f in fields(obj):
        meta, value = f.metadata, getattr(obj, f.name)
        if not meta:
            continue
        kind, flag = meta.get("type"), flag_name(f)
        if value is None:  # "not set" where the default is None (--max-context: the model's), else refused
            if f.default is not None and kind is not None:
                raise ConfigError(f"{flag} must be given, got None")
            continue
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{flag} must be a number, got {value!r}")
        if kind is not None and kind not in (int, float, str):  # a flag's parser (--device, --dtype)
            try:
                kind(value)
            except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                raise ConfigError(f"{flag}: {exc}") from None
        if meta.get("minimum") is not None and value < meta["minimum"]:
            raise ConfigError(f"{flag} must be >= {meta['minimum']}, got {value}")
        # (a default is one of its choices: tests/test_settings.py; not asked here, so that the defaults are
        # made without importing the registries)
        if meta.get("choices") is not None and value != f.default and value not in meta["choices"]:
            raise ConfigError(f"{flag} must be {_or(meta['choices'])}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how an engine is built and decodes (the flags of generate, bench, check and
    serve; replicas and Python callers make one too). Frozen; checked once, when made."""

    target: str = setting(MISSING, "--target", help="alias, local dir, .gguf file or hub id of the target model")
    draft: str | None = setting(  # a drafter spec (see specdecode.drafters), or None for target-only
        None,
        "--draft",
        help="draft model (alias/dir/.gguf/hub id), 'ngram' (or ngram:MAX, ngram:MIN-MAX) for prompt "
        "lookup, 'suffix' (or suffix:depth=64,history=32768,prob=0.1,factor=1.0) for suffix-tree "
        "lookup over the sequence and earlier outputs, or medusa:DIR / eagle:DIR for trained heads "
        "(`specdecode heads train`); repeat it with --draft-policy auto to let the selector choose "
        "among several (models included: a same-vocabulary draft beside an xvocab: one)",
    )
    _: KW_ONLY  # the rest by name only: a positional call once put a draft length into extra_drafts
    # more drafters (a repeated --draft: build.DraftAction): the auto policy chooses among all
    extra_drafts: tuple[str, ...] = ()
    num_draft_tokens: int = setting(
        4, "--num-draft-tokens", "-k", type=int, minimum=0, help="tokens drafted per step (default %(default)s)"
    )
    device: str = setting(
        "auto",
        "--device",
        type=lambda name: _device_arg(name),
        help="auto | cpu | cuda | cuda:N (default auto: CUDA when present, else the CPU)",
    )
    dtype: str = setting(
        "auto",
        "--dtype",
        type=lambda name: _dtype_arg(name),
        help="bfloat16 | float16 | float32 | auto (default: bfloat16 where the device has native bf16 "
        "matmuls (CUDA, AVX512-BF16/AMX CPUs), else float32)",
    )
    max_batch_size: int = setting(
        1,
        "--max-batch-size",
        type=int,
        minimum=1,
        tools={"serve": 8},  # a server decodes concurrent requests together; a library call, one at a time
        help="sequences decoded together (default %(default)s)",
    )
    max_context: int | None = setting(
        None,
        "--max-context",
        type=int,
        minimum=1,
        help=f"max prompt+generated tokens (default min(model, {CONTEXT_CAP}))",
    )
    draft_policy: str = setting(
        "fixed",
        "--draft-policy",
        choices=POLICIES,
        help="fixed: always -k tokens; acceptance: start at -k, +2 after a fully accepted step, "
        "-1 after a rejection, per sequence, up to --max-draft-tokens; auto: before each step "
        "choose per sequence the drafter (of the --draft given), the length up to "
        "--max-draft-tokens, or no drafting, from this machine's measured costs (cached; "
        "--recalibrate) and each request's acceptance (docs/architecture.md)",
    )
    max_draft_tokens: int = setting(
        16,
        "--max-draft-tokens",
        type=int,
        minimum=1,
        help="upper bound for --draft-policy acceptance and auto (default %(default)s)",
    )
    catch_up_tokens: int = setting(
        64,
        "--catch-up-tokens",
        type=int,
        minimum=1,
        metavar="N",
        help="--draft-policy auto: beside other sequences, a draft model starting late on a request "
        "reads its history N tokens per step in all, so no step waits for a whole prompt "
        "(alone it reads at once; default %(default)s)",
    )
    recalibrate: bool = setting(
        False,
        "--recalibrate",
        action="store_true",
        help="--draft-policy auto: measure the step costs again instead of using the cached ones",
    )
    draft_confidence: float = setting(
        0.0,
        "--draft-confidence",
        type=float,
        metavar="P",
        help="draft model and Medusa heads: end a sequence's draft chain after a token whose draft probability "
        "is below P (0 = off, the default; transformers' assisted generation uses 0.4). "
        "Exact either way: only the draft length changes",
    )
    draft_context: int = setting(
        0,
        "--draft-context",
        type=int,
        minimum=0,
        metavar="N",
        help="draft model: read only the last N tokens of each prompt (the target still reads and verifies "
        "all of it, so the output is exact): a shorter draft prefill, at some cost in acceptance "
        "(measured: docs/benchmarks.md); 0 = the whole prompt (default %(default)s)",
    )
    verify_budget: int = setting(
        0,
        "--verify-budget",
        type=int,
        minimum=0,
        metavar="N",
        help="load-aware draft length: verify at most N tokens per step across the batch, so each of "
        "B sequences drafts at most N // B - 1 (target-only once B >= N); 0 = no cap (default)",
    )
    draft_quantization: str = setting(
        "none",
        "--draft-quantization",
        choices=DRAFT_MODES,
        help="quantize the draft model's weights (the target is untouched, so output stays exact): "
        "int8, int4, or auto (the fastest on this machine, measured once and cached); for a .gguf "
        "draft, gguf keeps the file's own quantization and runs the draft on llama.cpp's kernels "
        "beside any target, q8_0/q4_0 requantize it once (cached) and do the same; a draft spec's "
        "@mode suffix (e.g. qwen2.5-coder-0.5b@int8) wins. Default none",
    )
    target_quantization: str = setting(
        "none",
        "--target-quantization",
        choices=TARGET_MODES,
        help="LOSSY: quantize the target itself. Output then follows the quantized target's law (still "
        "exactly, speculation included), not the model you named; every output is marked "
        '"lossy": true. Never the default',
    )
    tree_topk: int = setting(
        1,
        "--tree-topk",
        type=int,
        minimum=1,
        metavar="K",
        help="draft a tree: K children per expanded node (1 = a chain, the default); depth = -k. "
        "Exact for greedy and sampling (docs/architecture.md)",
    )
    tree_nodes: int = setting(
        16,
        "--tree-nodes",
        type=int,
        minimum=1,
        metavar="N",
        help="trees: draft nodes verified per step, the pending token excluded (default %(default)s)",
    )
    acceptance: str = setting(
        "exact",
        "--acceptance",
        choices=ACCEPTANCES,
        help="exact (default): rejection sampling, the output follows the target's law. typical: LOSSY "
        "Medusa-style typical acceptance for sampled requests (accept a draft token when its target "
        "probability exceeds min(epsilon, alpha * exp(-entropy))); every output is marked "
        '"lossy": true and `check` fails it',
    )
    typical_epsilon: float = setting(
        0.09, "--typical-epsilon", type=float, help="typical acceptance: epsilon (default %(default)s)"
    )
    typical_alpha: float = setting(
        0.3, "--typical-alpha", type=float, help="typical acceptance: alpha (default %(default)s)"
    )
    sampler: str = setting(
        "rejection",
        "--sampler",
        choices=SAMPLERS,
        help="how sampled requests draw (greedy ones are unchanged). rejection (default): speculative "
        "rejection sampling, the output follows the target's law. coupled: every position by "
        "Gumbel-max with noise keyed by (seed, position), the drafter proposing with the same noise, "
        "so a seeded request's tokens equal target-only decoding's whatever drafts them (with "
        "--batch-invariant, bit for bit); also exact, with lower acceptance (docs/exactness.md). "
        'The server\'s default: a request may name its own "sampler"',
    )
    # a bool is taken for on/off and kept as its name
    batch_invariant: str = setting(
        "auto",
        "--batch-invariant",
        choices=INVARIANCE,
        nargs="?",
        const="on",
        help="compute every row the same way whatever else is in the batch: greedy outputs and seeded "
        "samples then do not depend on concurrent requests or on the verify width, so speculation "
        "reproduces target-only decoding bit for bit in bf16 too. auto (default): on for bf16/fp16 "
        "on a CPU, off in float32 (there only exact near-ties can differ), on CUDA and on llama.cpp; "
        "on llama.cpp, on loads the target without CPU repack and decodes in probed invariant "
        "widths (its verify otherwise moves logits by up to ~0.5); costs speed "
        "(docs/benchmarks.md); chains only (with --tree-topk > 1, auto means off)",
    )
    backend: str = setting(
        "auto",
        "--backend",
        choices=BACKENDS,
        help="what runs the models (`specdecode models backends` prints what each supports): torch "
        "(PyTorch, CPU or CUDA), llamacpp (llama.cpp's kernels on the CPU, .gguf files as they are "
        "quantized; `scripts/install-llamacpp.sh`), toy (a built-in tiny model, --target toy:SEED, "
        "for trying things out), or auto (default): the first that can run the settings, llamacpp "
        "for a .gguf target when it is installed and nothing asked needs torch (EAGLE, --dtype, "
        "quantization flags, --batch-invariant on, CUDA), else torch; it says which on one line",
    )
    threads: int | None = setting(
        None,
        "--threads",
        type=int,
        minimum=1,
        metavar="N",
        help="CPU threads, torch's and llama.cpp's (default: the cores that other processes leave "
        "idle when the command starts, measured then; it says so when that is fewer than all)",
    )
    weights: str = setting(
        "resident",
        "--weights",
        choices=WEIGHTS,
        help="where a CPU model's weights live. resident (default): read into this process's memory, "
        "so the kernel never drops them and reads them back from disk in the middle of a request "
        "(a page-out makes the next step of a mapped 0.5B take 6x as long: docs/benchmarks.md); mapped: "
        "file-backed pages (torch's safetensors mmap, llama.cpp's mmap), shared between processes on one "
        "machine (--replicas), and evictable",
    )
    # streamed output: a sequence's first token comes from the target alone, so the drafter never delays it
    # (Engine.add_batch); the commands that stream say so (no flag)
    first_token_from_target: bool = setting(False, tools={"serve": True, "generate": True})
    # a drafter exception makes the rows involved decode target-only instead of failing them
    # (specdecode.drafters.guard): the server's engines (no flag)
    isolate_drafter_faults: bool = setting(False, tools={"serve": True})
    max_num_batched_tokens: int | None = setting(
        None,
        "--max-num-batched-tokens",
        type=int,
        minimum=1,
        tools={"serve": 512},  # the scheduler needs a step budget; a library call prefills a prompt whole
        help="tokens one engine step carries: the running sequences' verify windows plus a chunk of "
        "waiting prompts (at least a quarter of it), so a long prompt stalls the running streams "
        "for one chunk at most (default %(default)s)",
    )  # None (a library call's default): a prompt is prefilled whole in the step after its admission
    batched_tokens_per_seq: int = setting(
        0,
        "--batched-tokens-per-seq",
        type=int,
        minimum=0,
        help="under load the step budget grows to this many tokens per admitted request when that is "
        "more than --max-num-batched-tokens (running rows make each step dearer, so a bigger chunk "
        "costs them relatively less); 0 keeps the budget fixed (default %(default)s: on a CPU it measured "
        "worse at concurrency 16, docs/server.md)",
    )
    prefix_cache_mb: int = setting(
        0,
        "--prefix-cache-mb",
        type=int,
        minimum=0,
        metavar="MB",
        tools={"serve": 1536},
        help="keep the target's KV of finished prompts and outputs, up to this many MiB, and start a request "
        "whose prompt begins with one of them from there: only the rest is prefilled (specdecode.prefix_cache; "
        "least recently used entries go first); 0 turns it off (default %(default)s)",
    )

    def __post_init__(self) -> None:
        if self.batch_invariant in (True, False):  # a bool is on/off
            object.__setattr__(self, "batch_invariant", "on" if self.batch_invariant else "off")
        object.__setattr__(self, "extra_drafts", tuple(self.extra_drafts or ()))
        check_fields(self)
        drafts = self.drafts
        if self.extra_drafts and self.draft_policy != "auto":
            raise ConfigError(f"several --draft ({', '.join(drafts)}) need --draft-policy auto to choose among them")
        if self.draft_policy == "auto":
            if not self.draft:
                raise ConfigError("--draft-policy auto chooses among drafters: give at least one --draft")
            if self.tree_topk > 1:
                raise ConfigError("--draft-policy auto chooses among chains; drop --tree-topk")
            if len(set(drafts)) != len(drafts):
                raise ConfigError(f"a --draft is given twice: {', '.join(drafts)}")
        if self.sampler == "coupled" and self.acceptance != "exact":
            raise ConfigError("--sampler coupled verifies by its own rule: drop --acceptance typical")
        if self.acceptance == "typical" and not (0 < self.typical_epsilon <= 1 and self.typical_alpha > 0):
            raise ConfigError(
                "typical acceptance needs 0 < epsilon <= 1 and alpha > 0, "
                f"got {self.typical_epsilon}, {self.typical_alpha}"
            )
        if self.batch_invariant == "on" and self.trees:
            raise ConfigError(
                "--batch-invariant covers chain drafting only: a tree writes a candidate's key at another "
                "index than a chain does, which reorders the attention sum; use --tree-topk 1"
            )

    @property
    def drafts(self) -> list[str]:
        """Every drafter spec: ``draft`` and the extra ones."""
        return ([self.draft] if self.draft else []) + list(self.extra_drafts)

    @property
    def trees(self) -> bool:
        """Whether the drafter proposes trees (``--tree-topk`` > 1 with a drafter)."""
        return bool(self.draft) and self.tree_topk > 1

    def context_for(self, model_context: int) -> int:
        """``--max-context``, or its default for a model with this context: min(model, CONTEXT_CAP)."""
        return self.max_context or min(model_context, CONTEXT_CAP)

    def engine_settings(
        self, max_context: int, target_quantization: str = "none", lossy: Mapping | None = None
    ) -> EngineSettings:
        """The engine's slice, for the loaded target (its context, what it was quantized to, why outputs
        would not follow the named target's law)."""
        return EngineSettings(
            max_batch_size=self.max_batch_size,
            max_context=max_context,
            max_tree_nodes=self.tree_nodes if self.trees else 0,
            first_token_from_target=self.first_token_from_target,
            max_num_batched_tokens=self.max_num_batched_tokens,
            batched_tokens_per_seq=self.batched_tokens_per_seq,
            sampler=self.sampler,
            isolate_drafter_faults=self.isolate_drafter_faults,
            prefix_cache_mb=self.prefix_cache_mb,
            target_quantization=target_quantization,
            lossy=dict(lossy or {}),
        )

    def draft_settings(self, batch_invariant: bool = False) -> DraftSettings:
        """The drafters' slice, with ``--batch-invariant`` as resolved for the loaded target."""
        return DraftSettings(
            self.draft_confidence, self.tree_topk, self.tree_nodes, batch_invariant, self.draft_context
        )


def tool_defaults(tool: str) -> dict[str, Any]:
    """The defaults ``tool`` declares for the settings (``serve``: 8 sequences, a 512-token step budget, first
    tokens from the target, drafter faults isolated): ``EngineConfig(target, **tool_defaults("serve"))`` is
    an engine as that command builds it by default."""
    return {name: f.metadata["tools"][tool] for name, f in _FIELDS.items() if tool in f.metadata.get("tools", {})}


def default(name: str, tool: str | None = None) -> Any:
    """The default of setting ``name`` (the one a ``tool`` declares for it, where it declares one)."""
    f = _FIELDS[name]
    return f.metadata.get("tools", {}).get(tool, f.default)


def _same(name: str, **changes: Any) -> Any:
    """A field of a slice: the setting ``name``'s default and checks (``changes``: a slice's own default)."""
    f = _FIELDS[name]
    return field(default=changes.get("default", f.default), metadata=f.metadata)


_FIELDS: dict[str, Field] = {f.name: f for f in fields(EngineConfig)}


@dataclass(frozen=True)
class EngineSettings:
    """What :class:`specdecode.engine.Engine` takes: :meth:`EngineConfig.engine_settings` for loaded models,
    or made directly (tests, scripts). Each field is its setting's, with the same checks."""

    max_batch_size: int | None = _same("max_batch_size", default=None)  # None: the target runner's slots
    max_context: int | None = _same("max_context")  # None: the runner's cache length less the verify window
    max_tree_nodes: int = setting(0, type=int, minimum=0)  # > 0: the drafter's trees have up to this many nodes
    first_token_from_target: bool = _same("first_token_from_target")
    max_num_batched_tokens: int | None = _same("max_num_batched_tokens")
    batched_tokens_per_seq: int = _same("batched_tokens_per_seq")
    sampler: str = _same("sampler")  # a request's sampler when its params name none
    isolate_drafter_faults: bool = _same("isolate_drafter_faults")
    prefix_cache_mb: int = _same("prefix_cache_mb")  # > 0: the target's prefix cache (specdecode.prefix_cache)
    target_quantization: str = _same("target_quantization")  # not none: a LOSSY, quantized target
    lossy: Mapping = field(default_factory=dict)  # why outputs would not follow the named target's law ({}: exact)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DraftSettings:
    """What a drafter factory reads from the config (``DraftContext.config``)."""

    draft_confidence: float = _same("draft_confidence")
    tree_topk: int = _same("tree_topk")
    tree_nodes: int = _same("tree_nodes")
    batch_invariant: bool = False  # resolved for the loaded target: the drafter's own module computes rows alike
    draft_context: int = _same("draft_context")  # > 0: a draft model reads only the last N tokens of a prompt

    def __post_init__(self) -> None:
        check_fields(self)


def _device_arg(name: str) -> str:
    from specdecode.models.device import device_arg

    return device_arg(name)


def _dtype_arg(name: str) -> str:
    from specdecode.models.device import dtype_arg

    return dtype_arg(name)


def add_setting(group, name: str, tool: str | None = None, more_help: str = "", **overrides: Any) -> argparse.Action:
    """Add setting ``name``'s flag to an argparse ``group``, from its :class:`EngineConfig` field (see
    :func:`add_field`)."""
    return add_field(group, _FIELDS[name], tool, more_help, **overrides)


def add_field(group, f: Field, tool: str | None = None, more_help: str = "", **overrides: Any) -> argparse.Action:
    """Add a setting field's flag to an argparse ``group``: its flags, help, type, choices and default
    (``tool``'s own where the field declares one; as text for a field read by ``parse``). ``more_help``: what
    a command adds to the help; ``overrides``: argparse options a command changes (``required``, ``action``)."""
    meta = f.metadata
    value = meta["tools"].get(tool, f.default)
    if meta["parse"] is not None and value is not MISSING:
        value = meta["text"](value) if meta["text"] else str(value)
    options: dict[str, Any] = {"default": value, "help": meta["help"] + more_help, **meta["argparse"]}
    if meta["type"] is not None:
        options["type"] = meta["type"]
    if meta["choices"] is not None:
        options["choices"] = meta["choices"]
    options.update(overrides)
    if options.get("default") is MISSING:
        del options["default"]
    flags = meta["flags"] or ("--" + f.name.replace("_", "-"),)
    return group.add_argument(*flags, dest=f.name, **options)


def values_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
    """Each field of dataclass ``cls`` that ``args`` has a flag for, read by the field's ``parse`` where the
    flag gave text (an error names the flag)."""
    values = {}
    for f in fields(cls):
        if not hasattr(args, f.name):
            continue
        value, parse = getattr(args, f.name), f.metadata.get("parse")
        if parse is not None and isinstance(value, str):
            try:
                value = parse(value)
            except ValueError as exc:
                raise ConfigError(f"{flag_name(f)}: {exc}") from None
        values[f.name] = value
    return values


def config_from_args(args: argparse.Namespace, tool: str | None = None, **decided: Any) -> EngineConfig:
    """The one :class:`EngineConfig` of a command: each field from the flag of the same name where the
    command has that flag, else ``tool``'s declared default, else the field's; ``decided``: what the
    command sets itself (generate: ``max_batch_size=--num-samples``)."""
    values = {**(tool_defaults(tool) if tool else {}), **values_from_args(EngineConfig, args)}
    if not getattr(args, "dtype_given", True):  # cli.py resolved --dtype auto for reports: the plan keeps auto
        values["dtype"] = "auto"
    if isinstance(values.get("draft_quantization"), list):  # bench sweeps several: the first is the plan's
        values["draft_quantization"] = values["draft_quantization"][0]
    return EngineConfig(**{**values, **decided})


def config_dict(cfg: EngineConfig) -> dict[str, Any]:
    """The fields of ``cfg`` as plain data, for another process to make the config again (and so check it:
    a pickled dataclass is restored unchecked)."""
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


DEFAULTS = EngineConfig("")  # every setting's default (a target of "" is never loaded)
__all__ = [
    "DEFAULTS",
    "ConfigError",
    "DraftSettings",
    "EngineConfig",
    "EngineSettings",
    "add_setting",
    "config_from_args",
    "default",
]

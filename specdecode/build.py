"""From model names to a ready :class:`Engine`: the one place commands (generate, bench, check,
serve) turn their ``--target/--draft`` flags into models, runners and a drafter."""

from __future__ import annotations

import argparse
import os
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import TYPE_CHECKING

from specdecode.errors import UserError
from specdecode.models import backends
from specdecode.models.backends import BackendRefused, Choice, Model, Request, Settings
from specdecode.models.device import device_arg, dtype_arg

if TYPE_CHECKING:
    from specdecode.engine import Engine
    from specdecode.models.base import Runner


class PairError(UserError, ValueError):
    """A draft/target pair that cannot be used together."""


class ConfigError(UserError, ValueError):
    """Engine settings that cannot work (a negative draft length, an unknown policy, ...)."""


def backend_arg(name: str) -> str:
    """argparse ``type=`` for ``--backend``: auto or a registered backend (read when the flag is parsed)."""
    if name != "auto" and name not in backends.names():
        raise argparse.ArgumentTypeError(f"must be auto or one of {', '.join(backends.names())}, got {name!r}")
    return name


POLICIES = ("fixed", "acceptance", "auto")
KINDS_WITH_FILES = {"model", "medusa", "eagle", "xvocab", "xvocab-tli"}  # drafter kinds whose argument names weights
CROSS_VOCABULARY = {"xvocab", "xvocab-tli"}  # drafter kinds whose model has its own tokenizer (drafters.cross_vocab)


@dataclass
class EngineConfig:
    target: str
    draft: str | None = None  # a drafter spec (see specdecode.drafters), or None for target-only
    _: KW_ONLY  # the rest by name only: a positional call once put a draft length into extra_drafts
    extra_drafts: tuple[str, ...] = ()  # more drafters (a repeated --draft): the auto policy chooses among all
    num_draft_tokens: int = 4
    dtype: str = "auto"  # decided for the device (specdecode.models.device)
    device: str = "auto"  # auto: CUDA when present, else the CPU
    max_batch_size: int = 1
    max_context: int | None = None  # default: min(model context, 4096)
    draft_policy: str = "fixed"  # "fixed": always num_draft_tokens; "acceptance": adapt per sequence;
    # "auto": choose drafter and length per sequence and step from measured cost and acceptance (selector)
    max_draft_tokens: int = 16  # upper bound for the acceptance and auto policies
    catch_up_tokens: int = 64  # auto: a late-starting draft model's reads per step beside other sequences
    draft_confidence: float = 0.0  # draft model: end a chain after a token the draft gives less than this
    verify_budget: int = 0  # > 0: at most this many tokens verified per step across the batch (load-aware k)
    draft_quantization: str = (
        "none"  # none | int8 | int4 | auto | gguf | q8_0 | q4_0 (the draft only; a spec's @mode wins)
    )
    target_quantization: str = "none"  # none | int8 | int4: LOSSY w.r.t. the named target; outputs say so
    tree_topk: int = 1  # children per expanded node; 1 = chains
    tree_nodes: int = 16  # trees: draft nodes verified per step (root excluded); depth = num_draft_tokens
    acceptance: str = "exact"  # exact | typical (Medusa's typical acceptance: LOSSY, outputs say so)
    typical_epsilon: float = 0.09
    typical_alpha: float = 0.3
    # how sampled requests draw (specdecode.sampling.SAMPLERS): rejection (the exact rule against the draft's
    # law) or coupled (Gumbel-max keyed by seed and position: a seed's tokens do not depend on the drafter)
    sampler: str = "rejection"
    # rows computed alike whatever the batch (specdecode.models.batch_invariant): on | off | auto (on for
    # bf16/fp16 on a CPU, where plain kernels flip greedy tokens with the batch; off in float32 and on CUDA)
    batch_invariant: str | bool = "auto"
    # a registered backend (specdecode.models.backends) or auto: the first that can run these settings
    backend: str = "auto"
    threads: int | None = None  # CPU threads (None: every core this process may use; the CLI measures the idle ones)
    # where CPU weights live: resident (copied into the process's memory: never dropped and read back from
    # disk in the middle of a request) or mapped (file-backed pages, shared between processes, evictable)
    weights: str = "resident"
    recalibrate: bool = False  # auto policy: measure the cost model again instead of reading its cache
    # streamed output (generate, serve): a sequence's first token comes from the target alone, so the drafter
    # never delays it (Engine.add_batch)
    first_token_from_target: bool = False
    # tokens one engine step carries: the running verify windows + a chunk of waiting prompts (serve's
    # --max-num-batched-tokens); None: a prompt is prefilled whole in the step after its admission
    max_num_batched_tokens: int | None = None
    batched_tokens_per_seq: int = 0  # > 0: the step budget grows to this many tokens per admitted sequence

    @property
    def drafts(self) -> list[str]:
        """Every drafter spec: ``draft`` and the extra ones."""
        return ([self.draft] if self.draft else []) + list(self.extra_drafts)


DEFAULTS = EngineConfig("")  # every flag's default is its field's: one default from flag to use


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

    def draft_for(self, spec: str) -> "Model | None":
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
    from specdecode.models.quantize import DRAFT_MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in DRAFT_MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"draft quantization must be one of {', '.join(DRAFT_MODES)}, got {text!r}")
    return modes


def add_model_arguments(
    parser: argparse.ArgumentParser,
    draft_required: bool = False,
    quantization_sweep: bool = False,
    target_required: bool = True,
) -> None:
    g = parser.add_argument_group("models")
    g.add_argument(
        "--target", required=target_required, help="alias, local dir, .gguf file or hub id of the target model"
    )
    g.add_argument(
        "--draft",
        required=draft_required,
        default=None,
        action=DraftAction,
        help="draft model (alias/dir/.gguf/hub id), 'ngram' (or ngram:MAX, ngram:MIN-MAX) for prompt "
        "lookup, 'suffix' (or suffix:depth=64,history=32768,prob=0.1,factor=1.0) for suffix-tree "
        "lookup over the sequence and earlier outputs, or medusa:DIR / eagle:DIR for trained heads "
        "(`specdecode heads train`); repeat it with --draft-policy auto to let the selector choose "
        "among several (models included: a same-vocabulary draft beside an xvocab: one)"
        + ("" if draft_required else "; omit for target-only"),
    )
    parser.set_defaults(extra_drafts=[])
    g.add_argument(
        "--num-draft-tokens",
        "-k",
        type=int,
        default=DEFAULTS.num_draft_tokens,
        help=f"tokens drafted per step (default {DEFAULTS.num_draft_tokens})",
    )
    g.add_argument(
        "--device",
        type=device_arg,
        default=DEFAULTS.device,
        help="auto | cpu | cuda | cuda:N (default auto: CUDA when present, else the CPU)",
    )
    g.add_argument(
        "--dtype",
        type=dtype_arg,
        default=DEFAULTS.dtype,
        help="bfloat16 | float16 | float32 | auto (default: bfloat16 where the device has native bf16 "
        "matmuls (CUDA, AVX512-BF16/AMX CPUs), else float32)",
    )
    g.add_argument(
        "--max-context",
        type=int,
        default=DEFAULTS.max_context,
        help="max prompt+generated tokens (default min(model, 4096))",
    )
    g.add_argument(
        "--draft-policy",
        choices=POLICIES,
        default=DEFAULTS.draft_policy,
        help="fixed: always -k tokens; acceptance: start at -k, +2 after a fully accepted step, "
        "-1 after a rejection, per sequence, up to --max-draft-tokens; auto: before each step "
        "choose per sequence the drafter (of the --draft given), the length up to "
        "--max-draft-tokens, or no drafting, from this machine's measured costs (cached; "
        "--recalibrate) and each request's acceptance (docs/architecture.md)",
    )
    g.add_argument(
        "--max-draft-tokens",
        type=int,
        default=DEFAULTS.max_draft_tokens,
        help=f"upper bound for --draft-policy acceptance and auto (default {DEFAULTS.max_draft_tokens})",
    )
    g.add_argument(
        "--catch-up-tokens",
        type=int,
        default=DEFAULTS.catch_up_tokens,
        metavar="N",
        help="--draft-policy auto: beside other sequences, a draft model starting late on a request "
        "reads its history N tokens per step in all, so no step waits for a whole prompt "
        "(alone it reads at once; default 64)",
    )
    g.add_argument(
        "--recalibrate",
        action="store_true",
        help="--draft-policy auto: measure the step costs again instead of using the cached ones",
    )
    g.add_argument(
        "--draft-confidence",
        type=float,
        default=DEFAULTS.draft_confidence,
        metavar="P",
        help="draft model and Medusa heads: end a sequence's draft chain after a token whose draft probability "
        "is below P (0 = off, the default; transformers' assisted generation uses 0.4). "
        "Exact either way: only the draft length changes",
    )
    if quantization_sweep:
        g.add_argument(
            "--draft-quantization",
            type=_quantizations,
            default=["none"],
            metavar="MODE,...",
            help="draft quantizations to compare side by side (none, int8, int4, auto, gguf, q8_0, q4_0), "
            "e.g. none,int8,gguf; "
            "configs other than none are named <config>@<mode>. The target is untouched",
        )
    else:
        g.add_argument(
            "--draft-quantization",
            choices=("none", "int8", "int4", "auto", "gguf", "q8_0", "q4_0"),
            default=DEFAULTS.draft_quantization,
            help="quantize the draft model's weights (the target is untouched, so output stays exact): "
            "int8, int4, or auto (the fastest on this machine, measured once and cached); for a .gguf "
            "draft, gguf keeps the file's own quantization and runs the draft on llama.cpp's kernels "
            "beside any target, q8_0/q4_0 requantize it once (cached) and do the same; a draft spec's "
            "@mode suffix (e.g. qwen2.5-coder-0.5b@int8) wins. Default none",
        )
    g.add_argument(
        "--target-quantization",
        choices=("none", "int8", "int4"),
        default=DEFAULTS.target_quantization,
        help="LOSSY: quantize the target itself. Output then follows the quantized target's law (still "
        "exactly, speculation included), not the model you named; every output is marked "
        "\"lossy\": true. Never the default",
    )
    g.add_argument(
        "--tree-topk",
        type=int,
        default=DEFAULTS.tree_topk,
        metavar="K",
        help="draft a tree: K children per expanded node (1 = a chain, the default); depth = -k. "
        "Exact for greedy and sampling (docs/architecture.md)",
    )
    g.add_argument(
        "--tree-nodes",
        type=int,
        default=DEFAULTS.tree_nodes,
        metavar="N",
        help="trees: draft nodes verified per step, the pending token excluded (default 16)",
    )
    g.add_argument(
        "--acceptance",
        choices=("exact", "typical"),
        default=DEFAULTS.acceptance,
        help="exact (default): rejection sampling, the output follows the target's law. typical: LOSSY "
        "Medusa-style typical acceptance for sampled requests (accept a draft token when its target "
        "probability exceeds min(epsilon, alpha * exp(-entropy))); every output is marked "
        "\"lossy\": true and `check` fails it",
    )
    g.add_argument(
        "--typical-epsilon",
        type=float,
        default=DEFAULTS.typical_epsilon,
        help=f"typical acceptance: epsilon (default {DEFAULTS.typical_epsilon})",
    )
    g.add_argument(
        "--typical-alpha",
        type=float,
        default=DEFAULTS.typical_alpha,
        help=f"typical acceptance: alpha (default {DEFAULTS.typical_alpha})",
    )
    g.add_argument(
        "--sampler",
        choices=("rejection", "coupled"),
        default=DEFAULTS.sampler,
        help="how sampled requests draw (greedy ones are unchanged). rejection (default): speculative "
        "rejection sampling, the output follows the target's law. coupled: every position by "
        "Gumbel-max with noise keyed by (seed, position), the drafter proposing with the same noise, "
        "so a seeded request's tokens equal target-only decoding's whatever drafts them (with "
        "--batch-invariant, bit for bit); also exact, with lower acceptance (docs/exactness.md). "
        "The server's default: a request may name its own \"sampler\"",
    )
    g.add_argument(
        "--batch-invariant",
        nargs="?",
        const="on",
        default=DEFAULTS.batch_invariant,
        choices=("auto", "on", "off"),
        help="compute every row the same way whatever else is in the batch: greedy outputs and seeded "
        "samples then do not depend on concurrent requests or on the verify width, so speculation "
        "reproduces target-only decoding bit for bit in bf16 too. auto (default): on for bf16/fp16 "
        "on a CPU, off in float32 (there only exact near-ties can differ), on CUDA and on llama.cpp; "
        "on llama.cpp, on loads the target without CPU repack and decodes in probed invariant "
        "widths (its verify otherwise moves logits by up to ~0.5); costs speed "
        "(docs/benchmarks.md); chains only (with --tree-topk > 1, auto means off)",
    )
    g.add_argument(
        "--backend",
        type=backend_arg,
        default=DEFAULTS.backend,
        metavar="{auto," + ",".join(backends.names()) + "}",
        help="what runs the models (`specdecode models backends` prints what each supports): torch "
        "(PyTorch, CPU or CUDA), llamacpp (llama.cpp's kernels on the CPU, .gguf files as they are "
        "quantized; `scripts/install-llamacpp.sh`), toy (a built-in tiny model, --target toy:SEED, "
        "for trying things out), or auto (default): the first that can run the settings, llamacpp "
        "for a .gguf target when it is installed and nothing asked needs torch (EAGLE, --dtype, "
        "quantization flags, --batch-invariant on, CUDA), else torch; it says which on one line",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=DEFAULTS.threads,
        metavar="N",
        help="CPU threads, torch's and llama.cpp's (default: the cores that other processes leave "
        "idle when the command starts, measured then; it says so when that is fewer than all)",
    )
    g.add_argument(
        "--weights",
        choices=("resident", "mapped"),
        default=DEFAULTS.weights,
        help="where a CPU model's weights live. resident (default): read into this process's memory, "
        "so the kernel never drops them and reads them back from disk in the middle of a request "
        "(a page-out makes the next step of a mapped 0.5B take 6x as long: docs/benchmarks.md); mapped: file-backed pages (torch's safetensors mmap, llama.cpp's "
        "mmap), shared between processes on one machine (--replicas), and evictable",
    )
    g.add_argument(
        "--verify-budget",
        type=int,
        default=DEFAULTS.verify_budget,
        metavar="N",
        help="load-aware draft length: verify at most N tokens per step across the batch, so each of "
        "B sequences drafts at most N // B - 1 (target-only once B >= N); 0 = no cap (default)",
    )


def config_from_args(args: argparse.Namespace, max_batch_size: int = 1, **decided) -> EngineConfig:
    """The one plan of a command: every :class:`EngineConfig` field from the flag of the same name where the
    command has that flag, else the field's default (the flags' defaults are the fields'); ``decided``:
    what the command sets itself (serve and generate stream: ``first_token_from_target=True``)."""
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    values["extra_drafts"] = tuple(values.get("extra_drafts") or ())
    if not getattr(args, "dtype_given", True):  # cli.py resolved --dtype auto for reports: the plan keeps auto
        values["dtype"] = "auto"
    if "draft_quantization" in values:  # bench sweeps several: the first is the plan's
        values["draft_quantization"] = _single(values["draft_quantization"])
    return EngineConfig(**{**values, "max_batch_size": max_batch_size, **decided})


def _single(mode) -> str:
    return mode[0] if isinstance(mode, list) else mode


def backend_request(cfg: EngineConfig) -> Request:
    """What decides which backend can run ``cfg`` (see :mod:`specdecode.models.backends`)."""
    from specdecode.drafters import KINDS, parse_draft

    specs = [parse_draft(d) for d in cfg.drafts]
    modes = {spec.quantization or cfg.draft_quantization for spec in specs if spec.loads_model} - {"none"}
    invariant = {True: "on", False: "off"}.get(cfg.batch_invariant, cfg.batch_invariant)  # type: ignore[call-overload]
    return Request(
        cfg.target,
        cfg.device,
        cfg.dtype,
        cfg.target_quantization,
        frozenset(modes),
        invariant,
        features=any(KINDS[spec.kind].reads_layers for spec in specs),
        trees=bool(cfg.draft) and cfg.tree_topk > 1,
    )


def choose_backend(cfg: EngineConfig) -> Choice:
    """The backend for ``cfg.backend`` (``auto``: the first in the registry that can run these settings)
    and why; a clear error when the one asked for cannot. Loads nothing."""
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {cfg.threads}")
    if cfg.backend != "auto" and cfg.backend not in backends.names():
        raise ConfigError(f"--backend must be auto or one of {', '.join(backends.names())}, got {cfg.backend!r}")
    return backends.choose(cfg.backend, backend_request(cfg))


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
    from specdecode.drafters import parse_draft
    from specdecode.models.loading import tokenizers_compatible

    import sys

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
        batch_invariant=cfg.batch_invariant in (True, "on"),
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
        if spec.kind in CROSS_VOCABULARY:  # it reads text: any tokenizer drafts for any target
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


def check_policy(cfg: EngineConfig) -> None:
    """The draft-length settings that cannot work (raises ConfigError), before anything loads."""
    if cfg.num_draft_tokens < 0:
        raise ConfigError(f"--num-draft-tokens must be >= 0, got {cfg.num_draft_tokens}")
    if cfg.draft_policy not in POLICIES:
        raise ConfigError(f"unknown draft policy {cfg.draft_policy!r}: {', '.join(POLICIES)}")
    if cfg.extra_drafts and cfg.draft_policy != "auto":
        raise ConfigError(f"several --draft ({', '.join(cfg.drafts)}) need --draft-policy auto to choose among them")
    if cfg.draft_policy == "auto":
        if not cfg.draft:
            raise ConfigError("--draft-policy auto chooses among drafters: give at least one --draft")
        if cfg.max_draft_tokens < 1:
            raise ConfigError(f"--max-draft-tokens must be >= 1, got {cfg.max_draft_tokens}")
        if cfg.catch_up_tokens < 1:
            raise ConfigError(f"--catch-up-tokens must be >= 1, got {cfg.catch_up_tokens}")
        if cfg.tree_topk > 1:
            raise ConfigError("--draft-policy auto chooses among chains; drop --tree-topk")
        if len(set(cfg.drafts)) != len(cfg.drafts):
            raise ConfigError(f"a --draft is given twice: {', '.join(cfg.drafts)}")
    if cfg.verify_budget < 0:
        raise ConfigError(f"--verify-budget must be >= 0, got {cfg.verify_budget}")
    if cfg.tree_topk < 1 or cfg.tree_nodes < 1:
        raise ConfigError(f"--tree-topk and --tree-nodes must be >= 1, got {cfg.tree_topk}, {cfg.tree_nodes}")


def make_policy(cfg: EngineConfig, selector=None):
    """The draft-length policy: fixed k, per-sequence from acceptance, or ``selector`` (``--draft-policy
    auto``, built with its drafters: :func:`engine_from_pair`); under a verify budget when one is set."""
    from specdecode.policy import AcceptancePolicy, BudgetPolicy, FixedPolicy

    check_policy(cfg)
    k = cfg.num_draft_tokens if cfg.draft else 0
    policy = selector if selector is not None else FixedPolicy(k)
    if selector is None and cfg.draft and cfg.draft_policy == "acceptance":
        policy = AcceptancePolicy(start_k=k, max_k=max(k, cfg.max_draft_tokens))
    return BudgetPolicy(policy, cfg.verify_budget) if cfg.verify_budget else policy


def engine_from_pair(pair: LoadedPair, cfg: EngineConfig) -> "Engine":
    from specdecode.drafters import DraftContext, build_drafter, parse_draft
    from specdecode.engine import Engine

    check_policy(cfg)
    model_ctx = pair.target.max_position
    max_context = cfg.max_context or min(model_ctx, 4096)
    if max_context > model_ctx:
        raise ConfigError(f"max context {max_context} exceeds the model's {model_ctx}")
    invariant = batch_invariant_on(cfg, pair.target)
    trees = bool(cfg.draft) and cfg.tree_topk > 1
    if trees:  # a backend may have a finite pool for trees (llama.cpp's sequence ids): refuse what could run out
        pair.target.check_tree(cfg.max_batch_size, cfg.tree_nodes, "the target's tree verify")
        for draft_model in {id(m): m for m in map(pair.draft_for, model_drafts(cfg))}.values():  # the ones it uses
            draft_model.check_tree(
                cfg.max_batch_size, cfg.tree_topk * cfg.num_draft_tokens + 1, "the draft model's tree growth"
            )
    target = pair.target.runner(batch_invariant=invariant, trees=trees)  # the engine sizes its cache
    drafter, selector = None, None
    if cfg.draft:

        def context(spec: str) -> DraftContext:  # what the drafter of one spec may use: its own draft model
            model = pair.draft_for(spec) if parse_draft(spec).loads_model else None
            make = (
                (lambda: model.runner(batch_invariant=invariant, trees=trees, draft=True))
                if model is not None
                else None
            )
            return DraftContext(target, cfg, make, pair.tokenizer, model.tokenizer if model is not None else None)

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
    policy = make_policy(cfg, selector)
    tree_nodes = cfg.tree_nodes if trees else 0
    verifier = None
    if cfg.acceptance == "typical":
        from specdecode.verify.typical import typical_verifier

        verifier = typical_verifier(cfg.typical_epsilon, cfg.typical_alpha)
    elif cfg.acceptance != "exact":
        raise ConfigError(f"unknown acceptance {cfg.acceptance!r}: exact or typical")
    engine = Engine(
        target,
        pair.tokenizer,
        drafter,
        policy,
        max_batch_size=cfg.max_batch_size,
        max_context=max_context,
        max_tree_nodes=tree_nodes,
        verifier=verifier,
        target_quantization=pair.target_quantization,
        lossy=lossy_labels(pair.target_quantization, cfg),
        first_token_from_target=cfg.first_token_from_target,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        batched_tokens_per_seq=cfg.batched_tokens_per_seq,
        sampler=cfg.sampler,
    )
    return engine


def cost_model(target: "Runner", parts: dict, cfg: EngineConfig, pair: LoadedPair, max_context: int, cache_dir=None):
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

    return f"@{pair.draft_for(spec).quantization}" if parse_draft(spec).loads_model and pair.draft_models() else ""


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
    if spec.kind not in KINDS_WITH_FILES or not spec.arg:
        return name
    path = Path(spec.arg).expanduser()
    if spec.loads_model and not path.exists():  # an alias (`specdecode models fetch`)
        path = _model_path(spec.arg)
        if path is None:  # a hub id: its name is all we know
            return name
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.is_file()) if path.is_dir() else []
    stats = [os.stat(f) for f in files[:64]]
    return f"{name}:{sum(st.st_size for st in stats)}:{max((st.st_mtime_ns for st in stats), default=0)}"


def batch_invariant_on(cfg: EngineConfig, target: Model) -> bool:
    """Resolve ``cfg.batch_invariant`` (on/off/auto, or a bool) for the loaded target."""
    mode = {True: "on", False: "off"}.get(cfg.batch_invariant, cfg.batch_invariant)  # type: ignore[call-overload]
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"--batch-invariant must be auto, on or off, got {cfg.batch_invariant!r}")
    if mode != "auto":
        return mode == "on"
    trees = bool(cfg.draft) and cfg.tree_topk > 1  # not covered; nor is a quantized target's kernel
    return target.batch_invariant_default(trees, quantized=cfg.target_quantization != "none")


def lossy_labels(target_quantization: str, cfg: EngineConfig) -> dict:
    """Why outputs would not follow the named target's law ({} = exact): what reports and JSON print."""
    labels: dict = {}
    if target_quantization != "none":
        labels["target_quantization"] = target_quantization
    if cfg.acceptance != "exact" and cfg.draft:
        labels["acceptance"] = f"{cfg.acceptance} (epsilon {cfg.typical_epsilon}, alpha {cfg.typical_alpha})"
    return labels


def validate_config(cfg: EngineConfig) -> None:
    """Check the settings that need no model (raises ValueError), so bad flags fail before any load."""
    from specdecode.drafters import check_draft

    check_policy(cfg)
    specs = [check_draft(d) for d in cfg.drafts]
    same_draft_model(cfg.drafts, cfg.draft_quantization, ConfigError)
    if cfg.acceptance not in ("exact", "typical"):
        raise ConfigError(f"unknown acceptance {cfg.acceptance!r}: exact or typical")
    if cfg.sampler not in ("rejection", "coupled"):
        raise ConfigError(f"--sampler must be rejection or coupled, got {cfg.sampler!r}")
    if cfg.sampler == "coupled" and cfg.acceptance != "exact":
        raise ConfigError("--sampler coupled verifies by its own rule: drop --acceptance typical")
    if cfg.acceptance == "typical" and not (0 < cfg.typical_epsilon <= 1 and cfg.typical_alpha > 0):
        raise ConfigError(
            f"typical acceptance needs 0 < epsilon <= 1 and alpha > 0, got {cfg.typical_epsilon}, {cfg.typical_alpha}"
        )
    from specdecode.models.quantize import GGUF_MODES

    gguf = [
        mode
        for spec in specs
        if spec.loads_model
        for mode in [spec.quantization or cfg.draft_quantization]
        if mode in GGUF_MODES
    ]
    if cfg.batch_invariant in (True, "on") and cfg.draft and cfg.tree_topk > 1:
        raise ConfigError(
            "--batch-invariant covers chain drafting only: a tree writes a candidate's key at another "
            "index than a chain does, which reorders the attention sum; use --tree-topk 1"
        )
    if cfg.max_batch_size < 1:
        raise ConfigError(f"max batch size must be >= 1, got {cfg.max_batch_size}")
    if cfg.max_context is not None and cfg.max_context < 1:
        raise ConfigError(f"--max-context must be >= 1, got {cfg.max_context}")
    if cfg.max_num_batched_tokens is not None and cfg.max_num_batched_tokens < 1:
        raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {cfg.max_num_batched_tokens}")
    if cfg.batched_tokens_per_seq < 0:
        raise ConfigError(f"--batched-tokens-per-seq must be >= 0, got {cfg.batched_tokens_per_seq}")


def build_engine(cfg: EngineConfig) -> "Engine":
    validate_config(cfg)
    cfg = without_idle_draft(cfg)
    choice = choose_backend(cfg)
    pair = load_pair(cfg, choice.name)
    announce(cfg, choice)
    return engine_from_pair(pair, cfg)


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


def _model_path(name: str) -> "Path | None":
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

"""From model names to a ready :class:`Engine`: the one place commands (generate, bench, check,
serve) turn their ``--target/--draft`` flags into models, runners and a drafter."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from specdecode.engine import Engine

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def native_bf16() -> bool:
    """True where bf16 matrix products run natively (CUDA, or a CPU with AVX512-BF16 / AMX-BF16).

    Elsewhere (e.g. AVX2-only CPUs) a bf16 matmul is compute-bound: verifying k + 1 tokens costs about
    k + 1 single-token steps, so speculation cannot pay (measured in docs/benchmarks.md).
    """
    import torch

    if torch.cuda.is_available():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str) -> str:
    """'auto' -> bfloat16 where it is native (see :func:`native_bf16`), else float32; aliases -> canonical."""
    if name == "auto":
        return "bfloat16" if native_bf16() else "float32"
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}: choose auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


class PairError(ValueError):
    """A draft/target pair that cannot be used together."""


@dataclass
class EngineConfig:
    target: str
    draft: str | None = None  # a model spec, "ngram" for prompt lookup, or None for target-only
    num_draft_tokens: int = 4
    dtype: str = "auto"
    max_batch_size: int = 1
    max_context: int | None = None  # default: min(model context, 4096)
    draft_policy: str = "fixed"  # "fixed": always num_draft_tokens; "acceptance": adapt per sequence
    max_draft_tokens: int = 16  # upper bound for the acceptance policy
    draft_confidence: float = 0.0  # draft model: end a chain after a token the draft gives less than this
    verify_budget: int = 0  # > 0: at most this many tokens verified per step across the batch (load-aware k)


@dataclass
class LoadedPair:
    target: "torch.nn.Module"
    tokenizer: object
    draft: "torch.nn.Module | None"
    draft_tokenizer: object | None


def add_model_arguments(parser: argparse.ArgumentParser, draft_required: bool = False) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--target", required=True, help="alias, local dir, .gguf file or hub id of the target model")
    g.add_argument("--draft", required=draft_required, default=None,
                   help="draft model (alias/dir/.gguf/hub id) or 'ngram' for prompt lookup; omit for target-only")
    g.add_argument("--num-draft-tokens", "-k", type=int, default=4, help="tokens drafted per step (default 4)")
    g.add_argument("--dtype", type=resolve_dtype, default="auto",
                   help="bfloat16 | float32 | auto (default: bfloat16 where the hardware has native bf16 "
                        "matmuls, else float32)")
    g.add_argument("--max-context", type=int, default=None, help="max prompt+generated tokens (default min(model, 4096))")
    g.add_argument("--draft-policy", choices=("fixed", "acceptance"), default="fixed",
                   help="fixed: always -k tokens; acceptance: start at -k, +2 after a fully accepted step, "
                        "-1 after a rejection, per sequence, up to --max-draft-tokens")
    g.add_argument("--max-draft-tokens", type=int, default=16, help="upper bound for --draft-policy acceptance")
    g.add_argument("--draft-confidence", type=float, default=0.0, metavar="P",
                   help="draft model only: end a sequence's draft chain after a token whose draft probability "
                        "is below P (0 = off, the default; transformers' assisted generation uses 0.4). "
                        "Exact either way: only the draft length changes")
    g.add_argument("--verify-budget", type=int, default=0, metavar="N",
                   help="load-aware draft length: verify at most N tokens per step across the batch, so each of "
                        "B sequences drafts at most N // B - 1 (target-only once B >= N); 0 = no cap (default)")


def config_from_args(args: argparse.Namespace, max_batch_size: int = 1) -> EngineConfig:
    return EngineConfig(args.target, args.draft, args.num_draft_tokens, args.dtype, max_batch_size, args.max_context,
                        getattr(args, "draft_policy", "fixed"), getattr(args, "max_draft_tokens", 16),
                        getattr(args, "draft_confidence", 0.0), getattr(args, "verify_budget", 0))


def load_pair(target: str, draft: str | None, dtype: str = "bfloat16") -> LoadedPair:
    import torch

    from specdecode.models.loading import load_model, tokenizers_compatible

    torch_dtype = getattr(torch, resolve_dtype(dtype))
    target_model, tokenizer = load_model(target, torch_dtype)
    if draft is None or draft == "ngram":
        return LoadedPair(target_model, tokenizer, None, None)
    draft_model, draft_tokenizer = load_model(draft, torch_dtype)
    problem = tokenizers_compatible(tokenizer, draft_tokenizer, target_model, draft_model)
    if problem:
        raise PairError(f"draft {draft!r} cannot draft for target {target!r}: {problem}")
    return LoadedPair(target_model, tokenizer, draft_model, draft_tokenizer)


def engine_from_pair(pair: LoadedPair, cfg: EngineConfig) -> "Engine":
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.drafters.ngram import NgramDrafter
    from specdecode.engine import Engine
    from specdecode.models.runner import ModelRunner
    from specdecode.policy import AcceptancePolicy, BudgetPolicy, FixedPolicy

    if cfg.num_draft_tokens < 0:
        raise ValueError(f"--num-draft-tokens must be >= 0, got {cfg.num_draft_tokens}")
    model_ctx = getattr(pair.target.config, "max_position_embeddings", 4096)
    max_context = cfg.max_context or min(model_ctx, 4096)
    if max_context > model_ctx:
        raise ValueError(f"max context {max_context} exceeds the model's {model_ctx}")
    k = cfg.num_draft_tokens if cfg.draft else 0
    policy = FixedPolicy(k)
    if cfg.draft and cfg.draft_policy == "acceptance":
        policy = AcceptancePolicy(start_k=k, max_k=max(k, cfg.max_draft_tokens))
    elif cfg.draft_policy not in ("fixed", "acceptance"):
        raise ValueError(f"unknown draft policy {cfg.draft_policy!r}")
    if cfg.verify_budget < 0:
        raise ValueError(f"--verify-budget must be >= 0, got {cfg.verify_budget}")
    if cfg.verify_budget:
        policy = BudgetPolicy(policy, cfg.verify_budget)
    longest = policy.max_k
    cache_len = max_context + longest + 1  # room for a padded verify window at the very end
    target = ModelRunner(pair.target, cfg.max_batch_size, cache_len)
    drafter = None
    if cfg.draft == "ngram":
        drafter = NgramDrafter()
    elif pair.draft is not None:
        drafter = DraftModelDrafter(ModelRunner(pair.draft, cfg.max_batch_size, cache_len), target.vocab_size,
                                    cfg.draft_confidence)
    return Engine(target, pair.tokenizer, drafter, policy, max_batch_size=cfg.max_batch_size, max_context=max_context)


def build_engine(cfg: EngineConfig) -> "Engine":
    return engine_from_pair(load_pair(cfg.target, cfg.draft, cfg.dtype), cfg)

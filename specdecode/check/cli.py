"""`specdecode check --target T --draft D`: prove on this machine that speculation is lossless.

Exit status: 0 when every selected part passes, 1 when a part fails (or lacks power), 2 when the
check could not run (bad flags, models that do not load or do not pair).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace

from specdecode.check.common import CheckConfig
from specdecode.check.processors import SAMPLES as PROCESSOR_SAMPLES
from specdecode.config import ConfigError, add_field, add_setting, values_from_args

# Short completion prompts (code and prose): cheap to prefill on a CPU, and they work for base and
# instruct models alike. --prompts replaces them.
DEFAULT_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "import numpy as np\n\n# normalise each row of the matrix x\n",
    "Once upon a time, in a small village by the sea,",
    "SELECT name, email FROM users WHERE",
    "class Stack:\n    def __init__(self):\n",
]

# CheckConfig's fields in the order --help lists them, by group (each field has its flag)
GENERAL = ("alpha", "seed")
BUDGETS = (
    "law_contexts",
    "law_samples",
    "law_settings",
    "e2e_prompts",
    "e2e_samples",
    "e2e_tokens",
    "e2e_batch",
    "e2e_settings",
    "greedy_tokens",
    "greedy_batch",
    "stop_tokens",
    "seed_tokens",
    "seed_batch",
    "coupled_tokens",
    "coupled_ks",
    "coupled_setting",
    "coupled_samples",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.build import add_model_arguments

    add_model_arguments(parser, draft_required=True, tool="check")
    by_name = {f.name: f for f in fields(CheckConfig)}
    g = parser.add_argument_group("check")
    g.add_argument(
        "--prompts",
        default=None,
        help="a .jsonl prompt file, 'spec-bench' or 'humaneval' (default: the first --num-prompts of six "
        "short built-in prompts)",
    )
    g.add_argument("--num-prompts", type=int, default=4, help="prompts used, from whichever set (default 4)")
    g.add_argument(
        "--max-prompt-tokens", type=int, default=64, help="keep the last N tokens of each prompt (default 64)"
    )
    g.add_argument(
        "--parts",
        default=None,
        help="parts to run, e.g. 1,3 (default 1-5, and 6 with --sampler coupled; 7: logit bias, penalties, "
        "min-p and a regex grammar under speculation)",
    )
    for name in GENERAL:
        add_field(g, by_name[name])
    add_setting(
        g,
        "prefix_cache_mb",
        "check",
        "; on, every speculative engine restores each prompt from it and the reference keeps none "
        "(specdecode.check.cache_hits)",
    )
    g.add_argument("--json", metavar="PATH", default=None, help="write the full evidence as JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")

    b = parser.add_argument_group("budgets")
    for name in BUDGETS:
        add_field(b, by_name[name])
    b.add_argument(
        "--processor-samples",
        type=int,
        default=PROCESSOR_SAMPLES,
        help="part 7: requests per prompt, setting and engine (default %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> CheckConfig:
    """The check's config from its flags, in one call (each field from its flag; checked when made)."""
    spec = args.parts or ("1,2,3,4,5,6" if getattr(args, "sampler", "rejection") == "coupled" else "1,2,3,4,5")
    try:
        parts = tuple(sorted({int(p) for p in spec.split(",") if p.strip()}))
    except ValueError:
        parts = ()
    if not parts or any(p not in range(1, 8) for p in parts):
        raise ConfigError(f"--parts must list numbers 1-7, got {spec!r}")
    for name in ("num_prompts", "max_prompt_tokens", "processor_samples"):  # the command's own, not the parts'
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    return CheckConfig(**{**values_from_args(CheckConfig, args), "parts": parts})


def encode_prompts(tokenizer, prompts, max_tokens: int) -> list[list[int]]:
    """Chat prompts go through the chat template; completion prompts are encoded as they are."""
    out = []
    for p in prompts:
        if p.kind == "chat":
            ids = tokenizer.apply_chat_template(
                p.messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        else:
            ids = tokenizer(p.text)["input_ids"]
        ids = list(ids)[-max_tokens:]
        if ids:
            out.append(ids)
    if not out:
        raise ValueError("every prompt encoded to zero tokens")
    return out


def load_prompts(spec: str | None, n: int, seed: int):
    from specdecode.bench.prompts import Prompt, load_prompt_set

    if spec is None:
        return [
            Prompt(id=f"builtin/{i}", category="builtin", text=t, messages=None, kind="completion")
            for i, t in enumerate(DEFAULT_PROMPTS[:n])
        ]
    return load_prompt_set(spec, n=n, seed=seed)


def _part7(factory, prompts: list[list[int]], cfg: CheckConfig, samples: int, progress):
    """Part 7 (:mod:`specdecode.check.processors`) on the first ``--law-contexts`` prompts; an exception is
    the part's ERROR, as in ``run_check``."""
    import time
    import traceback

    from specdecode.check.cache_hits import HitCount, account, forcing_hits
    from specdecode.check.common import EnginePool, NullProgress
    from specdecode.check.processors import NAME, NUMBER, check_processors
    from specdecode.check.report import ERROR, PartResult

    t0 = time.perf_counter()
    pool = EnginePool(forcing_hits(factory, prompts), cfg.num_draft_tokens)
    count = HitCount(pool)
    try:
        result = check_processors(
            pool, prompts[: cfg.law_contexts], cfg.part_alpha(), progress or NullProgress(), samples, cfg.seed
        )
        result = account(result, count)
    except Exception as exc:
        result = PartResult(NUMBER, NAME, ERROR, f"{type(exc).__name__}: {exc}", {"traceback": traceback.format_exc()})
    result.seconds = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    return result


def main(args: argparse.Namespace) -> int:
    import torch

    from specdecode.bench.prompts import PromptSetError
    from specdecode.build import PairError, announce, choose_backend, engine_from_pair, load_pair
    from specdecode.profile.cache import measured_speeds
    from specdecode.build import config_from_args as engine_config
    from specdecode.check.common import TqdmProgress
    from specdecode.check.prefix import reuse_prefills
    from specdecode.check.runner import run_check

    try:
        cfg = config_from_args(args)
        base = engine_config(args, "check")  # the engines' settings: each part's engine changes a few
        prompts = load_prompts(args.prompts, args.num_prompts, args.seed)
        choice = choose_backend(base, measured_speeds(base))
        pair = load_pair(base, choice.name)
        announce(base, choice)
        ids = encode_prompts(pair.tokenizer, prompts, args.max_prompt_tokens)
    except (ValueError, PromptSetError, PairError, OSError) as exc:
        print(f"specdecode check: {exc}", file=sys.stderr)
        return 2
    longest_output = max(cfg.greedy_tokens, cfg.stop_tokens, cfg.seed_tokens + 4, cfg.e2e_tokens, cfg.coupled_tokens)
    max_context = base.max_context or max(len(p) for p in ids) + longest_output + 8
    store: dict = {}

    def factory(k: int, batch: int):
        changes: dict = {"max_batch_size": batch, "num_draft_tokens": k, "max_context": max_context}
        if not k:  # the target-only reference
            changes.update(draft=None, extra_drafts=(), draft_policy="fixed")
        elif base.draft_policy == "auto":  # the selector drafts up to k tokens
            changes.update(max_draft_tokens=k)
        engine = engine_from_pair(pair, replace(base, **changes))
        reuse_prefills(engine, store)
        return engine

    meta = {
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "num_draft_tokens": cfg.num_draft_tokens,
        "extra_drafts": list(getattr(args, "extra_drafts", None) or []),
        "draft_policy": args.draft_policy,
        "draft_quantization": pair.draft_quantization,
        "tree_topk": args.tree_topk,
        "tree_nodes": args.tree_nodes,
        "target_quantization": pair.target_quantization,
        "acceptance": args.acceptance,
        "sampler": args.sampler,
        "prefix_cache_mb": base.prefix_cache_mb,  # > 0: restored from the engines' prefix caches (cache_hits)
        "batch_invariant": args.batch_invariant,  # auto | on | off, as asked (auto: on for bf16/fp16 on a CPU)
        "verified_against": (
            f"the {pair.target_quantization}-quantized target (LOSSY w.r.t. {args.target})"
            if pair.target_quantization != "none"
            else "the target as loaded"
        ),
        "backend": pair.backend,
        "torch": torch.__version__,
        "threads": pair.target.threads or torch.get_num_threads(),
        "prompts": [{"id": p.id, "tokens": len(t)} for p, t in zip(prompts, ids)],
    }
    progress = None if args.no_progress else TqdmProgress()
    report = run_check(factory, ids, cfg, progress=progress, meta=meta)
    if 7 in cfg.parts:  # (its own part: run beside run_check's, over engines of the same factory)
        report.parts.append(_part7(factory, ids, cfg, args.processor_samples, progress))
    report.render()
    if args.json:
        report.write_json(args.json)
        print(f"evidence written to {args.json}")
    return 0 if report.passed else 1

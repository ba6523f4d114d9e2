"""`specdecode bench`: is speculation worth it for *this* draft/target pair on *these* prompts?

Runs target-only, speculative decoding at each draft length and the `transformers` baselines side by
side, interleaved, and writes ``records.jsonl`` (appended as runs finish; rerun the same command to
resume), ``results.json``, ``report.md`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

SETTINGS_KEYS = (
    "target",
    "draft",
    "dtype",
    "max_new_tokens",
    "ignore_eos",
    "seed",
    "draft_schedule",
    "backend",
    "grammar",
)
OLD_DEFAULTS = {"backend": "torch", "grammar": False}  # what runs recorded before a setting existed used


def _csv(kind):
    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.build import add_model_arguments

    add_model_arguments(parser, quantization_sweep=True, target_required=False)  # not with --report-only
    p = parser.add_argument_group("prompts")
    p.add_argument(
        "--prompts",
        action="append",
        default=None,
        help="'spec-bench', 'humaneval', 'fim', 'code_edit', 'json_extract', 'editor_replay' (each with :dev "
        "/ :test halves, e.g. humaneval:test, fim:dev; editor_replay: a file typed into, a FIM request per "
        "keystroke group; docs/workloads.md) or a .jsonl path; repeatable (default humaneval)",
    )
    p.add_argument(
        "--spec-bench-path",
        default=None,
        help="Spec-Bench question.jsonl (default: $SPECDECODE_SPEC_BENCH or the shared data directory)",
    )
    p.add_argument(
        "--num-prompts",
        "-n",
        type=int,
        default=None,
        help="prompts per category for spec-bench, in total otherwise (default all)",
    )
    p.add_argument("--categories", type=_csv(str), default=None, help="comma-separated categories to keep")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling and generation seed (default 0)")
    p.add_argument("--skip-too-long", action="store_true", help="leave out prompts that do not fit the context")
    p.add_argument(
        "--no-grammar",
        dest="grammar",
        action="store_false",
        help="decode structured prompts (json_extract) unconstrained; by default the engine configs "
        "enforce each prompt's response_format (docs/structured-outputs.md). Either way every "
        "output is checked: parsed as JSON, valid against the schema (report's structured section)",
    )
    r = parser.add_argument_group("runs")
    r.add_argument(
        "--draft-lengths",
        type=_csv(int),
        default=None,
        help="comma-separated draft lengths to sweep (default: --num-draft-tokens)",
    )
    r.add_argument(
        "--tree-shapes",
        type=_csv(str),
        default=[],
        metavar="TxN,...",
        help="also run trees at each draft length (its depth): T children per expanded node, N nodes "
        "verified per step, e.g. 2x8,4x16 (configs spec-k<k>-t<T>n<N>)",
    )
    r.add_argument(
        "--draft-contexts",
        type=_csv(int),
        default=[],
        metavar="N,...",
        help="also run the draft model reading only the last N tokens of each prompt, for each N, at every "
        "draft length (configs spec-k<k>-ctx<N>; --draft-context sets it for every config instead)",
    )
    r.add_argument(
        "--extra-draft",
        action="append",
        default=[],
        metavar="SPEC",
        help="also run this drafter in the same interleaved run, at every draft length and tree shape "
        "(configs spec-k<k>[<label>]), or at its own: SPEC|k=2,4|trees=4x16 (trees=none: chains "
        "only); repeatable; ngram, suffix, medusa:DIR, eagle:DIR, or another draft model (a same-vocabulary "
        "one, xvocab:M) beside a --draft model",
    )
    r.add_argument(
        "--sampling",
        type=_csv(str),
        default=["greedy"],
        help="comma-separated settings: greedy, t<T>[-p<top_p>] (e.g. greedy,t0.7-p0.95,t1.0)",
    )
    r.add_argument(
        "--baselines",
        type=_csv(str),
        default=["hf", "hf-assisted"],
        help="transformers baselines: hf, hf-assisted, or 'none' (default both)",
    )
    r.add_argument(
        "--only",
        type=_csv(str),
        default=None,
        metavar="CONFIG,...",
        help="run only these configurations, by the names the report gives them (spec-k4, spec-k4[ngram], "
        "auto, hf, ...); target always runs: every ratio is against it",
    )
    r.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per (prompt, config), each a pass over the prompts; before each pass every drafter "
        "forgets the outputs it kept (the suffix drafter's history), so a repeat never drafts "
        "from its own earlier output; medians are reported",
    )
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="stop at EOS (default: ignore EOS so every configuration generates the same number of tokens)",
    )
    r.add_argument("--warmup-tokens", type=int, default=4, help="tokens per warm-up run of each config (0 = none)")
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("runs/bench"), help="output directory (default runs/bench)")
    o.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the report from --out without running (the models are the stored run's)",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--memory-check",
        type=int,
        metavar="CONTEXT",
        default=None,
        help="only measure peak RSS of one batch-1 request at this context length (run it alone)",
    )


def main(args: argparse.Namespace) -> int:
    from specdecode.bench.prompts import PromptSetError
    from specdecode.bench.runner import BenchInputError

    try:
        if args.memory_check is not None:
            return _memory_check(args)
        return _run(args)
    except (PromptSetError, BenchInputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _settings(args: argparse.Namespace, cfg) -> dict:
    """What the run records (meta.json): its flags, and the backend ``cfg`` (the run's engine settings) runs on."""
    from specdecode.build import announce, choose_backend
    from specdecode.profile.cache import measured_speeds

    choice = choose_backend(cfg, measured_speeds(cfg))
    announce(cfg, choice)
    return {
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "backend": choice.name,  # resolved: a registered backend (specdecode.models.backends)
        "ignore_eos": not args.stop_at_eos,
        "seed": args.seed,
        "repeats": args.repeats,
        "grammar": getattr(args, "grammar", True),  # structured prompts constrained (--no-grammar: not)
        "sampling": args.sampling,
        "draft_lengths": _draft_lengths(args),
        "baselines": args.baselines,
        "threads": args.threads,
        "draft_schedule": draft_schedule(args),
        "tree_shapes": args.tree_shapes,
        "draft_contexts": args.draft_contexts,
        "draft_context": args.draft_context,
        "draft_quantization": args.draft_quantization,
        "extra_drafts": args.extra_draft,
        "target_quantization": args.target_quantization,
        "acceptance": args.acceptance,
        "sampler": getattr(args, "sampler", "rejection"),
        "typical": [args.typical_epsilon, args.typical_alpha] if args.acceptance == "typical" else None,
    }


def _draft_lengths(args: argparse.Namespace) -> list[int]:
    return args.draft_lengths or [args.num_draft_tokens]


def draft_schedule(args: argparse.Namespace) -> str | None:
    """How spec-k<k> configs choose their draft length beyond a fixed k; None for plain fixed k."""
    parts = []
    if args.draft_policy == "acceptance":
        parts.append(f"{args.draft_policy} policy starting at k, up to {args.max_draft_tokens}")
    if args.draft_confidence:
        parts.append(f"chains end below draft confidence {args.draft_confidence}")
    if args.verify_budget:
        parts.append(f"verify budget {args.verify_budget} tokens per step")
    return "; ".join(parts) or None


def _run(args: argparse.Namespace) -> int:
    from specdecode.bench import env
    from specdecode.bench.report import write_report
    from specdecode.bench.runner import BenchInputError, RecordStore

    if not args.target and not args.report_only:
        raise BenchInputError("--target is required (except with --report-only)")
    # in bench, a repeated --draft is one more drafter to compare (and for the auto config to choose from)
    args.extra_draft = [*getattr(args, "extra_drafts", []), *args.extra_draft]
    args.extra_drafts = []
    from specdecode.config import config_from_args

    cfg = None if args.report_only else config_from_args(args, "bench")  # the run's engine settings, checked
    configs, samplings = _configs(args)
    store = RecordStore(args.out / "records.jsonl")
    if args.report_only:  # the settings are the stored run's, whatever the flags say
        if not (args.out / "meta.json").exists():
            raise BenchInputError(f"no benchmark in {args.out} (meta.json is missing)")
        write_report(args.out, store.records, json.loads((args.out / "meta.json").read_text(encoding="utf-8")))
        print(f"report written to {args.out / 'report.md'}", file=sys.stderr)
        return 0
    meta = _meta(args.out, _settings(args, cfg), env)
    prompts = _load_prompts(args)
    if store.dropped_lines:
        print(
            f"warning: {store.dropped_lines} unreadable line(s) in {store.path} (a run cut short); they are redone",
            file=sys.stderr,
        )
    runner = _prepare(args, meta, configs, samplings, prompts, store, cfg)
    return _session(args, runner, store, meta)


def _configs(args: argparse.Namespace) -> tuple[list, list]:
    from specdecode.bench.runner import bench_setting, make_configs

    samplings = [bench_setting(s) for s in args.sampling]
    baselines = [] if args.baselines == ["none"] else args.baselines
    configs = make_configs(
        _draft_lengths(args) if args.draft or args.extra_draft else [],
        baselines,
        args.tree_shapes,
        args.draft_quantization,
        args.extra_draft,
        main_draft=bool(args.draft),
        auto_k=args.max_draft_tokens if args.draft_policy == "auto" else 0,
        contexts=args.draft_contexts,
    )
    from specdecode.drafters import parse_draft

    if not args.draft or not parse_draft(args.draft).loads_model:  # HF's assistant_model needs a model
        configs = [c for c in configs if not c.assisted]
    if args.only:
        from specdecode.bench.runner import TARGET, BenchInputError

        names = [c.name for c in configs]
        if unknown := [n for n in args.only if n not in names]:
            raise BenchInputError(
                f"--only {','.join(unknown)}: not a configuration of this run; its configurations: {', '.join(names)}"
            )
        configs = [c for c in configs if c.name == TARGET or c.name in args.only]
    return configs, samplings


def _load_prompts(args: argparse.Namespace) -> list:
    from specdecode.bench.prompts import load_prompt_set
    from specdecode.bench.runner import BenchInputError

    prompts = []
    for spec in args.prompts or ["humaneval"]:
        cats = args.categories if spec != "humaneval" else None
        prompts += load_prompt_set(spec, args.num_prompts, args.seed, cats, args.spec_bench_path)
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise BenchInputError(
            f"duplicate prompt ids across prompt sets: {sorted({i for i in ids if ids.count(i) > 1})[:5]}"
        )
    return prompts


def _prepare(args: argparse.Namespace, meta: dict, configs: list, samplings: list, prompts: list, store, cfg):
    """Load the pair, tokenize and check the prompts, and build the runner (nothing is written before);
    ``cfg``: the run's engine settings (each config's engine is made from it)."""
    from specdecode.bench.runner import BenchInputError, BenchRunner, tokenize_prompts
    from specdecode.build import load_pair, same_draft_model
    from specdecode.drafters import parse_draft

    extra_models = tuple(
        dict.fromkeys(
            spec for spec in (text.split("|")[0] for text in args.extra_draft) if parse_draft(spec).loads_model
        )
    )
    if extra_models and not args.draft:
        raise BenchInputError(f"--extra-draft {extra_models[0]!r}: give the first draft model as --draft")
    if extra_models and not parse_draft(args.draft).loads_model:
        raise BenchInputError(
            f"--extra-draft {extra_models[0]!r}: give a draft model as the first --draft "
            f"(not {args.draft!r}); the others may follow it"
        )
    same_draft_model([args.draft, *extra_models] if args.draft else [], "none", BenchInputError)
    if args.draft and parse_draft(args.draft).quantization:
        raise BenchInputError(
            f"--draft {args.draft!r}: in bench, give the draft unquantized and compare modes with "
            "--draft-quantization none,int8,..."
        )
    from specdecode.build import ConfigError
    from specdecode.models import backends

    backend = meta["settings"]["backend"]
    supports = backends.get(backend).supports
    modes = sorted({c.quantization for c in configs} - {"none"})
    if modes and args.draft:  # each mode's backend opens the draft and is installed: checked before any model loads
        draft = parse_draft(args.draft).arg
        for mode in modes:
            where = backends.draft_backend(mode, backend, draft)
            if not backends.get(where).opens(draft):
                backends.get(where).spec_kind(draft)  # a draft that cannot be found says so
                text = backends.get(where).supports.opens_text
                raise BenchInputError(
                    f"--draft-quantization {mode} runs the draft on {where}, which loads {text}; "
                    f"--draft {args.draft!r} is not {text}"
                )
            missing = backends.get(where).missing()
            if missing:
                raise BenchInputError(f"--draft-quantization {mode} runs the draft on {where}: {missing}")
    if not supports.transformers and [c for c in configs if c.kind == "hf"]:  # they run transformers modules
        configs[:] = [c for c in configs if c.kind != "hf"]
        print(
            f"note: the transformers baselines are left out: the models run on {backend} "
            "(--backend torch compares with transformers)",
            file=sys.stderr,
        )
    if [m for m in modes if m not in supports.draft_modes]:
        raise BenchInputError(
            f"--draft-quantization {','.join(m for m in modes if m not in supports.draft_modes)} "
            f"cannot pair with a target on {backend} (it pairs {', '.join(supports.draft_modes)})"
        )
    try:  # the draft unquantized: make_backend makes a quantized copy per mode
        pair = load_pair(replace(cfg, draft_quantization="none", extra_drafts=extra_models), backend)
    except ConfigError as exc:
        raise BenchInputError(str(exc)) from exc
    model_ctx = pair.target.max_position
    limit = cfg.context_for(model_ctx)
    if limit > model_ctx:
        raise BenchInputError(f"--max-context {limit} exceeds the model's context of {model_ctx}")
    bench_prompts, skipped = tokenize_prompts(
        prompts, pair.tokenizer, args.max_new_tokens, limit, args.skip_too_long, grammar=args.grammar
    )
    if skipped:
        print(f"skipped {len(skipped)} prompt(s) too long for {limit} tokens: {', '.join(skipped)}", file=sys.stderr)
    meta["prompt_summary"] = _prompt_summary(bench_prompts, args, skipped)
    _write_meta(args.out, meta)
    backend = make_backend(pair, args, cfg, max(len(p.ids) + p.max_new_tokens for p in bench_prompts) + 8)
    return BenchRunner(
        backend,
        bench_prompts,
        configs,
        samplings,
        args.repeats,
        store,
        args.seed,
        ignore_eos=not args.stop_at_eos,
        warmup_tokens=args.warmup_tokens,
        progress=not args.no_progress,
    )


def _session(args: argparse.Namespace, runner, store, meta: dict) -> int:
    """Run what is left; whatever happens, record the session and write the report."""
    import torch

    from specdecode.bench import env
    from specdecode.bench.report import write_report

    previous_handler = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops a run as cleanly as Ctrl-C
    session = {"type": "session", "command": env.command_line(), "started": env.now(), "loadavg_start": env.loadavg()}
    code = 0
    try:
        with torch.inference_mode():
            runner.run()
        meta["interrupted"] = False
    except KeyboardInterrupt:
        meta["interrupted"] = True
        code = 130
        print(
            f"\ninterrupted: finished runs are kept in {store.path}; rerun the same command to resume", file=sys.stderr
        )
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        session.update(
            {
                "ended": env.now(),
                "runs": runner.runs_done,
                "peak_rss_gib": env.peak_rss_gib(),
                "loadavg_end": env.loadavg(),
                "interrupted": code != 0,
            }
        )
        store.append(session)
        _write_meta(args.out, meta)
        write_report(args.out, store.records, meta)
        print(f"report written to {args.out / 'report.md'}", file=sys.stderr)
    return code


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def make_backend(pair, args: argparse.Namespace, base, max_context: int):
    """The runner's backend: an engine per config, each ``base`` (the run's engine settings) with the config's
    drafter, length and tree, and the transformers baselines."""
    import torch

    from specdecode.bench.baselines import HFBaseline
    from specdecode.bench.runner import Backend
    from specdecode.build import engine_from_pair

    engines: dict[tuple, object] = {}
    hf: dict[bool, HFBaseline] = {}
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else pair.tokenizer.eos_token_id

    drafts: dict[str, object] = {}

    def draft_pair(mode: str):
        """The pair with its draft quantized to ``mode`` (a copy per mode; the original stays for HF)."""
        from specdecode.models import backends
        from specdecode.models.backends import Settings

        if mode == "none" or pair.draft is None:
            return pair
        if mode not in drafts:
            where = backends.draft_backend(mode, pair.backend, args.draft)
            if where == pair.draft.backend:  # a copy of the loaded draft (auto: the fastest measured here)
                drafts[mode] = replace(pair, draft=pair.draft.requantized(mode))
            else:  # loaded again by the backend that applies the mode (a .gguf draft on llama.cpp)
                drafts[mode] = replace(
                    pair,
                    draft=backends.get(where).load(args.draft, Settings("cpu", "float32", args.threads, mode, "draft")),
                )
        return drafts[mode]

    def engine_for(config):
        key = (config.k, config.tree, config.quantization, config.draft, config.auto, config.context)
        if key not in engines:
            topk, nodes = config.tree or (1, base.tree_nodes)
            cfg = replace(
                base,
                draft=(config.draft or args.draft) if config.k else None,
                extra_drafts=(),
                draft_policy="fixed" if args.draft_policy == "auto" else args.draft_policy,
                num_draft_tokens=config.k,
                max_context=max_context,
                tree_topk=topk,
                tree_nodes=nodes,
                draft_context=base.draft_context if config.context is None else config.context,
            )
            if config.auto:  # the selector over the main drafter and every extra one, at their own specs
                extras = tuple(dict.fromkeys(text.split("|")[0] for text in args.extra_draft))
                cfg = replace(
                    cfg,
                    draft=args.draft,
                    extra_drafts=extras,
                    draft_policy="auto",
                    max_draft_tokens=config.k,
                    num_draft_tokens=min(args.num_draft_tokens, config.k),
                )
            engines[key] = engine_from_pair(draft_pair(config.quantization), cfg)
        return engines[key]

    def hf_for(assisted: bool) -> HFBaseline:
        if assisted not in hf:
            hf[assisted] = HFBaseline(pair.target.hf_model, pair.draft.hf_model if assisted else None, pad)
        return hf[assisted]

    from specdecode.bench.runner import RunConfig

    target_only = engine_for(RunConfig("target", "engine"))

    @torch.inference_mode()
    def target_logits(ids: list[int]) -> torch.Tensor:  # [V]
        return pair.target.next_token_logits(ids, target_only.target)

    eps = target_only.target.logit_eps or torch.finfo(target_only.target.dtype).eps
    return Backend(
        engine_for,
        hf_for,
        target_logits,
        sorted(target_only.eos_token_ids),
        eps,
        decode=lambda ids: pair.tokenizer.decode(ids, skip_special_tokens=True),
    )


def _meta(out: Path, settings: dict, env) -> dict:
    from specdecode.bench.runner import BenchInputError

    path = out / "meta.json"
    if path.exists():
        meta = json.loads(path.read_text(encoding="utf-8"))
        old = meta.get("settings", {})
        changed = [k for k in SETTINGS_KEYS if old.get(k, OLD_DEFAULTS.get(k)) != settings.get(k)]
        if changed:
            diff = ", ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in changed)
            raise BenchInputError(f"{out} holds a run with other settings ({diff}); use another --out to start afresh")
        meta["settings"] = settings  # configs, samplings, repeats may grow between sessions
        meta["commands"] = meta.get("commands", []) + [env.command_line()]
        meta["commit"] = env.commit()
        return meta
    return {
        "settings": settings,
        "commands": [env.command_line()],
        "commit": env.commit(),
        "machine": env.machine(),
        "versions": env.versions(),
    }


def _write_meta(out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _prompt_summary(prompts, args: argparse.Namespace, skipped: list[str]) -> str:
    from collections import Counter

    counts = Counter(p.category for p in prompts)
    lengths = sorted(len(p.ids) for p in prompts)
    text = ", ".join(f"{cat} {n}" for cat, n in counts.items())
    text += (
        f" ({len(prompts)} in all; sets {args.prompts or ['humaneval']}, seed {args.seed}; prompt lengths "
        f"{lengths[0]}–{lengths[-1]} tokens, median {lengths[len(lengths) // 2]})"
    )
    if skipped:
        text += f"; {len(skipped)} skipped as too long"
    return text


def _memory_check(args: argparse.Namespace) -> int:
    from specdecode.bench.memory import measure

    result = measure(
        args.target, args.draft, args.dtype, args.memory_check, args.num_draft_tokens, min(args.max_new_tokens, 32)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0

"""`specdecode heads ...`: extract target features from a corpus, train drafter heads on them.

    specdecode heads extract --target qwen2.5-coder-1.5b --out ~/feats        # stdlib source by default
    specdecode heads train --kind medusa --features ~/feats --out ~/heads     # or --kind eagle --out ~/eagle
    specdecode generate --target qwen2.5-coder-1.5b --draft medusa:~/heads ...   # or --draft eagle:~/eagle

Both steps resume after an interruption (rerun the same command).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdecode.models.device import DTYPE_CHOICES, device_arg, dtype_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="heads_command", required=True)

    ex = sub.add_parser("extract", help="run the target over a corpus, store token ids, hidden states, soft labels")
    ex.add_argument("--target", required=True, help="alias, local dir, .gguf file or hub id of the target model")
    ex.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        metavar="SRC",
        help="files, directories, .jsonl (\"text\" or chat \"messages\"), or 'stdlib' (the default: the "
        "Python standard library source of this interpreter). Never benchmark prompts",
    )
    ex.add_argument("--out", type=Path, required=True, help="feature directory (resumes if it holds a partial run)")
    ex.add_argument("--max-tokens", type=int, default=50_000, help="tokens to extract in all (default 50000)")
    ex.add_argument(
        "--layers",
        default="final",
        help="hidden-state layers to store: final (the normed last state; Medusa, EAGLE-1) and/or "
        "decoder-layer indices, e.g. final,2,14,25 for EAGLE-3 as well (default final)",
    )
    ex.add_argument("--seq-len", type=int, default=512, help="tokens per forward chunk (default 512)")
    ex.add_argument(
        "--topk", type=int, default=8, help="soft labels: top-k of the target's distribution kept (default 8)"
    )
    ex.add_argument(
        "--shard-tokens", type=int, default=8192, help="tokens per shard, the resume granularity (default 8192)"
    )
    ex.add_argument(
        "--max-doc-tokens",
        type=int,
        default=4096,
        help="tokens taken from one document at most, so a budget covers many (default 4096)",
    )
    ex.add_argument("--device", type=device_arg, default="auto", help="auto | cpu | cuda | cuda:N")
    ex.add_argument(
        "--dtype",
        type=dtype_arg,
        default="auto",
        metavar="|".join(DTYPE_CHOICES),
        help="the target's compute dtype (default auto); features are stored as bfloat16",
    )
    ex.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    ex.add_argument("--no-progress", action="store_true", help="no progress bar")

    try:
        from specdecode.heads.train import add_train_arguments
    except ModuleNotFoundError:  # pragma: no cover - training not built yet
        return
    add_train_arguments(
        sub.add_parser("train", help="train a drafter (Medusa heads or an EAGLE layer) on extracted features")
    )


def _extract(args: argparse.Namespace) -> int:
    import torch

    from specdecode.heads.corpus import CorpusError, describe, documents, fingerprint
    from specdecode.heads.features import ExtractSettings, FeatureError, extract, parse_layers
    from specdecode.models.device import resolve_device, resolve_dtype
    from specdecode.models.hf import HFRunner
    from specdecode.models.loading import ModelNotFoundError, load_model

    for name in ("max_tokens", "seq_len", "topk", "shard_tokens", "max_doc_tokens"):
        if getattr(args, name) < 1:
            print(f"specdecode heads extract: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        layers = parse_layers(args.layers)
        sources = args.corpus
        probe_docs = documents(sources, render_chat=lambda m: "")  # validate sources before loading the model
    except (ValueError, CorpusError) as exc:
        print(f"specdecode heads extract: {exc}", file=sys.stderr)
        return 2
    del probe_docs
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    try:
        model, tokenizer = load_model(args.target, dtype, device)
    except ModelNotFoundError as exc:
        print(f"specdecode heads extract: {exc}", file=sys.stderr)
        return 2
    runner = HFRunner(model)
    try:
        parse_layers(args.layers, runner.num_layers)
        docs = documents(sources, render_chat=lambda m: tokenizer.apply_chat_template(m, tokenize=False))
    except (ValueError, CorpusError) as exc:
        print(f"specdecode heads extract: {exc}", file=sys.stderr)
        return 2
    settings = ExtractSettings(
        layers=layers,
        seq_len=args.seq_len,
        max_tokens=args.max_tokens,
        topk=args.topk,
        shard_tokens=args.shard_tokens,
        max_doc_tokens=args.max_doc_tokens,
    )
    meta = {
        "spec": args.target,
        "model_type": model.config.model_type,
        "num_layers": runner.num_layers,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "corpus": describe(sources),
    }
    try:
        manifest = extract(
            runner, tokenizer, docs, args.out, settings, meta, fingerprint(docs), progress=not args.no_progress
        )
    except FeatureError as exc:
        print(f"specdecode heads extract: {exc}", file=sys.stderr)
        return 2
    print(
        f"{manifest['tokens']} tokens in {len(manifest['shards'])} shards under {args.out}"
        f" (layers {', '.join(manifest['layers'])}, top-{manifest['topk']} soft labels)"
    )
    return 0


def _train(args: argparse.Namespace) -> int:
    """Validate, load the features, train the chosen kind, report: one path for Medusa and EAGLE."""
    import torch

    from specdecode.allocator import retain_freed_memory
    from specdecode.heads.eagle_train import EagleSettings, train as train_eagle
    from specdecode.heads.features import FeatureError, FeatureSet
    from specdecode.heads.train import TrainSettings, train as train_medusa
    from specdecode.models.device import native_bf16

    compute = args.compute_dtype
    if compute == "auto":
        compute = "bfloat16" if native_bf16("cpu") else "float32"
    common = dict(
        draft_vocab=args.draft_vocab,
        epochs=args.epochs,
        lr=args.lr or 1e-3,
        weight_decay=args.weight_decay,
        warmup=args.warmup,
        soft_weight=args.soft_weight,
        held_out=args.held_out,
        max_train_tokens=args.max_train_tokens,
        seed=args.seed,
        compute_dtype=compute,
    )
    if args.kind == "eagle":
        run = train_eagle
        settings = EagleSettings(
            layers=args.eagle_layers,
            intermediate_size=args.intermediate_size,
            ttt_steps=args.ttt_steps,
            batch_chunks=args.batch_chunks,
            level_decay=args.level_decay,
            feature_weight=args.feature_weight,
            feature_noise=args.feature_noise,
            **common,
        )
    else:
        run = train_medusa
        settings = TrainSettings(
            num_heads=args.num_heads,
            depth=args.depth,
            train_output=args.train_output,
            batch_size=args.batch_size,
            head_decay=args.head_decay,
            **common,
        )
    try:
        settings.validate()
        if args.checkpoint_every < 1:
            raise ValueError("--checkpoint-every must be >= 1")
        fs = FeatureSet(args.features)
    except (ValueError, FeatureError) as exc:
        print(f"specdecode heads train: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_memory()  # each step frees and reallocates the same large blocks (see specdecode.allocator)
    target = args.target or fs.manifest["target"].get("spec")
    try:
        model = run(fs, args.out, settings, target, args.checkpoint_every, args.evals, not args.no_progress)
    except (ValueError, FeatureError) as exc:
        print(f"specdecode heads train: {exc}", file=sys.stderr)
        return 2
    training = model.config.training
    if args.kind == "eagle" and model.config.accuracy:
        acc = model.config.accuracy
        print(
            f"EAGLE drafter written to {args.out}: held-out top-1 by draft position {acc['top1']}, chain "
            f"{acc['chain']} -> greedy tokens/step {acc['tokens_per_step']} ({training['seconds']} s)"
        )
    elif training.get("held_out"):
        held = training["held_out"]
        print(
            f"heads written to {args.out}: held-out top-1 by head {held['top1']}, top-5 {held['top5']} "
            f"({training['seconds']} s, {training['tokens_seen']} tokens seen)"
        )
    return 0


def main(args: argparse.Namespace) -> int:
    if args.heads_command == "extract":
        return _extract(args)
    return _train(args)

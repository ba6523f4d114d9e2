"""`specdecode generate`: decode a prompt with the target alone or with speculation."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.build import add_model_arguments

    add_model_arguments(parser)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (continued raw; use --chat to apply the chat template)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    parser.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    s = parser.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    s.add_argument("--seed", type=int, default=None, help="seed of the first sample (sample i uses seed+i)")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--num-samples", type=int, default=1, help="independent samples, decoded as one batch")
    parser.add_argument("--json", action="store_true", help="print one JSON object per sample")


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
    if args.chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
    return tokenizer(args.prompt, add_special_tokens=False).input_ids


def main(args: argparse.Namespace) -> int:
    from specdecode.build import build_engine, config_from_args
    from specdecode.engine import RequestError
    from specdecode.sampling import SamplingError, SamplingParams

    if args.num_samples < 1:
        print("error: --num-samples must be >= 1", file=sys.stderr)
        return 2
    try:
        params = [
            SamplingParams(args.temperature, args.top_k, args.top_p,
                           None if args.seed is None else args.seed + i, args.max_new_tokens, tuple(args.stop), args.ignore_eos)
            for i in range(args.num_samples)
        ]
        engine = build_engine(config_from_args(args, max_batch_size=args.num_samples))
        prompt = _prompt_ids(args, engine.tokenizer)
        outputs = engine.generate([prompt] * args.num_samples, params)
    except (SamplingError, RequestError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if engine.target_quantization != "none":
        print(f"warning: LOSSY — the target was quantized to {engine.target_quantization} "
              "(--target-quantization): output follows that model, not the one named", file=sys.stderr)
    if "acceptance" in engine.lossy:
        print(f"warning: LOSSY — {engine.lossy['acceptance']} acceptance: sampled output does not follow the "
              "target's law", file=sys.stderr)
    for i, out in enumerate(outputs):
        if args.json:
            print(json.dumps({"sample": i, "token_ids": out.token_ids, "text": out.text,
                              "finish_reason": out.finish_reason, "stats": out.stats.to_dict(),
                              "target_quantization": engine.target_quantization, "lossy": bool(engine.lossy)}
                             | ({"lossy_because": engine.lossy} if engine.lossy else {})))
        else:
            s = out.stats
            rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
            print(out.text)
            tree = f"; {s.nodes / s.target_steps:.1f} tree nodes/step" if s.nodes > s.drafted else ""
            print(f"[{out.finish_reason}; {len(out.token_ids)} tokens in {s.target_steps} target steps; "
                  f"acceptance {rate}; {s.tokens_per_step:.2f} tokens/step{tree}; "
                  f"draft {s.draft_s:.2f}s verify {s.verify_s:.2f}s]", file=sys.stderr)
    return 0

"""`specdecode generate`: decode a prompt with the target alone or with speculation."""

from __future__ import annotations

import argparse
import json
import sys

from specdecode.fim import DEFAULT_FIM_STOP, FIM_STOPS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.build import add_model_arguments

    add_model_arguments(parser, tool="generate")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (continued raw; use --chat to apply the chat template)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    parser.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    parser.add_argument(
        "--suffix",
        default=None,
        help="fill in the middle: --prompt is the text before the cursor, this the text after it "
        "(the model's own FIM tokens; ends at its FIM end tokens)",
    )
    parser.add_argument(
        "--fim-stop",
        choices=FIM_STOPS,
        default=None,
        help="with --suffix, also end the completion at the first newline (line) or where the "
        f"cursor's block ends (block: a line indented less than the cursor's), or only at the "
        f"model's end tokens (none); default {DEFAULT_FIM_STOP}",
    )
    s = parser.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    s.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="keep tokens at least this times as likely as the most likely one (after temperature); 0 = off",
    )
    s.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable)",
    )
    s.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="-2..2: subtracted from the logit of every token generated so far (default 0)",
    )
    s.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="-2..2: times a token's count among the generated tokens, subtracted from its logit (default 0)",
    )
    s.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="0.5..2: a prompt or generated token's logit divided by it if positive, else multiplied (1 = off)",
    )
    s.add_argument("--seed", type=int, default=None, help="seed of the first sample (sample i uses seed+i)")
    s.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g = parser.add_argument_group("structured output (one of; exact under speculation: docs/structured-outputs.md)")
    g = g.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against the JSON schema in FILE")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object (any)")
    g.add_argument("--regex", metavar="R", help="the whole output matches the regex R (Rust regex syntax)")
    g.add_argument(
        "--grammar",
        metavar="FILE",
        help="the output follows the grammar in FILE (llguidance's Lark-like syntax or llama.cpp GBNF)",
    )
    parser.add_argument("--num-samples", type=int, default=1, help="independent samples, decoded as one batch")
    parser.add_argument("--json", action="store_true", help="print one JSON object per sample")
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's log-probability under the target (its law: docs/server.md) "
        "and the N (0-20) most likely tokens",
    )


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _logit_bias(items: list[str]) -> dict[int, float]:
    out = {}
    for item in items:
        tok, sep, bias = item.partition("=")
        try:
            out[int(tok)] = float(bias)
        except ValueError:
            raise ValueError(f"--logit-bias takes ID=BIAS (a token id and a number), got {item!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias takes ID=BIAS, got {item!r}")
    if len(out) < len(items):
        raise ValueError("--logit-bias names a token twice")
    return out


def _grammar(args):
    """The structured-output spec of the flags (None: free text); GrammarError (a ValueError) if malformed."""
    from pathlib import Path

    if not (args.json_object or args.json_schema is not None or args.regex is not None or args.grammar is not None):
        return None  # free text needs no grammar (nor llguidance, the `structured` extra)
    from specdecode.grammar import GrammarError, GrammarSpec

    def read(path: str, flag: str) -> str:
        try:
            return Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise GrammarError(f"{flag}: cannot read {path!r}: {exc}") from None

    if args.json_object:
        return GrammarSpec.json_object()
    if args.json_schema is not None:
        return GrammarSpec.json_schema(read(args.json_schema, "--json-schema"))
    if args.regex is not None:
        return GrammarSpec.regex(args.regex)
    if args.grammar is not None:
        return GrammarSpec.grammar(read(args.grammar, "--grammar"))
    return None


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        return _parse_ids(args.prompt_ids)

    if args.chat:
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return tokenizer(args.prompt, add_special_tokens=False).input_ids


def _summary(out, timing: dict, where: dict[str, str] | None = None) -> str:
    s = out.stats
    rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
    tree = f"; {s.nodes / s.target_steps:.1f} tree nodes/step" if s.nodes > s.drafted else ""
    return (
        f"[{out.finish_reason}; {len(out.token_ids)} tokens in {timing['total_s']:.2f} s ({timing['tok_s']:.1f} tok/s); "
        f"time to first token {timing['ttft_s']:.2f} s (prefill {s.prefill_s:.2f} s); decode {timing['decode_s']:.2f} s "
        f"({timing['decode_tok_s']:.1f} tok/s); acceptance {rate}; {s.tokens_per_step:.2f} tokens/step{tree}; "
        f"draft {s.draft_s:.2f} s verify {s.verify_s:.2f} s"
        + "".join(f"; {role} on {place}" for role, place in (where or {}).items())
        + _choices(s)
        + "]"
    )


def _choices(s) -> str:
    """What ``--draft-policy auto`` chose: the most frequent choices and their share of the steps."""
    if not s.choices:
        return ""
    total = sum(s.choices.values())
    top = sorted(s.choices.items(), key=lambda kv: -kv[1])[:4]
    return "; chose " + ", ".join(f"{label} {n / total:.0%}" for label, n in top)


def _timing(start: float, first: float | None, end: float, tokens: int) -> dict:
    total = end - start
    ttft = (first if first is not None else end) - start
    decode = end - (first if first is not None else end)
    return {
        "total_s": round(total, 4),
        "ttft_s": round(ttft, 4),
        "decode_s": round(decode, 4),
        "tok_s": round(tokens / total, 3) if total > 0 else 0.0,
        "decode_tok_s": round((tokens - 1) / decode, 3) if decode > 0 and tokens > 1 else 0.0,
    }


def _logprobs_json(entries, tokenizer) -> list[dict]:
    """Each generated token's id, text and log-probability, and its top entries' (specdecode.logprobs)."""
    from specdecode.logprobs import TokenSpeller, reported

    speller = TokenSpeller(tokenizer)

    def one(token_id: int, value: float) -> dict:
        return {"token_id": token_id, "token": speller.spell(token_id).token, "logprob": reported(value)}

    return [one(e.token_id, e.logprob) | {"top": [one(i, v) for i, v in e.top]} for e in entries]


def _validate(args: argparse.Namespace) -> None:
    """What can be checked before any model loads (a user error costs no waiting)."""
    if args.num_samples < 1:
        raise ValueError("--num-samples must be >= 1")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prompt is not None and not args.prompt and args.suffix is None:
        raise ValueError("--prompt is empty")
    if args.suffix is not None and (args.chat or args.prompt is None):
        raise ValueError(
            "--suffix fills in the middle of --prompt's text: it cannot go with "
            + ("--chat" if args.chat else "--prompt-ids")
        )
    if args.fim_stop not in (None, "none") and args.suffix is None:
        raise ValueError("--fim-stop applies to fill-in-the-middle: give --suffix too ('' at the end of a file)")
    if args.prompt_ids is not None and not _parse_ids(args.prompt_ids):
        raise ValueError("--prompt-ids is empty")
    if args.logprobs is not None and not args.json:
        raise ValueError("--logprobs are printed in the --json output: add --json")


def main(args: argparse.Namespace) -> int:
    import time

    from specdecode.build import build_engine, config_from_args
    from specdecode.profile.cache import measured_speeds
    from specdecode.engine import Output, RequestError
    from specdecode.models.loading import ModelNotFoundError
    from specdecode.sampling import SamplingError, SamplingParams

    try:
        _validate(args)
        grammar = _grammar(args)

        def params(fim: dict) -> list[SamplingParams]:  # fim: a FIM request's stop fields (specdecode.fim)
            stop = tuple(args.stop) + tuple(s for s in fim.pop("stop", ()) if s not in args.stop)
            return [
                SamplingParams(
                    args.temperature,
                    args.top_k,
                    args.top_p,
                    None if args.seed is None else args.seed + i,
                    args.max_new_tokens,
                    stop,
                    args.ignore_eos,
                    min_p=args.min_p,
                    logit_bias=_logit_bias(args.logit_bias),
                    presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty,
                    repetition_penalty=args.repetition_penalty,
                    grammar=grammar,
                    logprobs=args.logprobs,
                    **fim,
                )
                for i in range(args.num_samples)
            ]

        params({})  # the sampling flags are checked before anything loads
        # the samples decode as one batch; streamed (the config's generate default): the first token never
        # waits for the drafter
        cfg = config_from_args(args, "generate", max_batch_size=args.num_samples)
        engine = build_engine(cfg, measured_speeds(cfg))
        fim = {}
        if args.suffix is None:
            prompt = _prompt_ids(args, engine.tokenizer)
        else:  # the model's own FIM prompt; its end tokens stop it, and so does the --fim-stop rule
            from specdecode.fim import fim_prompt, fim_tokens, stop_fields

            tokens = fim_tokens(engine.tokenizer)
            prompt = fim_prompt(engine.tokenizer, args.prompt, args.suffix, tokens)
            fim = stop_fields(tokens, args.fim_stop or DEFAULT_FIM_STOP, args.prompt)
        if engine.target_quantization != "none":
            print(
                f"warning: LOSSY — the target was quantized to {engine.target_quantization} "
                "(--target-quantization): output follows that model, not the one named",
                file=sys.stderr,
            )
        if "acceptance" in engine.lossy:
            print(
                f"warning: LOSSY — {engine.lossy['acceptance']} acceptance: sampled output does not follow the "
                "target's law",
                file=sys.stderr,
            )
        live = not args.json and args.num_samples == 1  # stream the one sample's text as it is accepted
        start = time.perf_counter()
        first: dict[str, float] = {}
        ended: dict[str, tuple[Output, float]] = {}
        for ev in engine.stream([prompt] * args.num_samples, params(fim)):
            seq = ev.seq
            if ev.new_token_ids and seq.request_id not in first:
                first[seq.request_id] = time.perf_counter()
            if live:
                text = seq.text.delta(final=ev.finished)
                if text:
                    sys.stdout.write(text)
                    sys.stdout.flush()
            if ev.finished:
                ended[seq.request_id] = (
                    Output(
                        seq.request_id,
                        seq.prompt_ids,
                        seq.output_ids,
                        seq.text.finish(),
                        seq.finish_reason,
                        seq.stats,
                        seq.logprobs,
                    ),
                    time.perf_counter(),
                )
    except (SamplingError, RequestError, ValueError, ModelNotFoundError) as exc:
        print(f"specdecode generate: {exc}", file=sys.stderr)
        return 2
    for i in range(args.num_samples):
        out, end = ended[str(i)]
        timing = _timing(start, first.get(str(i)), end, len(out.token_ids))
        if args.json:
            print(
                json.dumps(
                    {
                        "sample": i,
                        "token_ids": out.token_ids,
                        "text": out.text,
                        "finish_reason": out.finish_reason,
                        "stats": out.stats.to_dict(),
                        "timing": timing,
                        "backend": engine.backend,
                        "where": engine.where(),
                        "target_quantization": engine.target_quantization,
                        "lossy": bool(engine.lossy),
                    }
                    | ({"logprobs": _logprobs_json(out.logprobs, engine.tokenizer)} if out.logprobs is not None else {})
                    | ({"lossy_because": engine.lossy} if engine.lossy else {})
                )
            )
            continue
        if live:
            print()
        else:
            print(out.text)
        print(_summary(out, timing, engine.where()), file=sys.stderr)
    return 0

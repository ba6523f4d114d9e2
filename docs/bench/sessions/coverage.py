"""How much of each session request's prompt a prefix cache can cover: the longest common token prefix
with the session's previous request, over the model's own prompt (FIM order, chat template).

    python docs/bench/sessions/coverage.py --tokenizer qwen2.5-coder-1.5b --prompts editor_replay:dev

Also reports the share an order with the suffix first (suffix-prefix-middle) would let a cache cover,
for comparison only (the served model is prompted in its own order). Chat turns use a fixed stand-in
answer in the history and count only the previous turn's prompt as cached (a cache that also keeps the
generated answer's tokens covers more).
"""

import argparse
import json
import statistics

from specdecode.bench.prompts import load_prompt_set
from specdecode.bench.sessions import sessions, with_history
from specdecode.drafters.base import common_prefix
from specdecode.fim import fim_tokens
from transformers import AutoTokenizer


def _default_tokenizer():
    from pathlib import Path

    found = sorted(Path("~/.cache/specdecode/converted").expanduser().glob("qwen2.5-coder-1.5b-*-tokenizer"))
    return found[-1] if found else "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=str(_default_tokenizer()))
    ap.add_argument("--prompts", default="editor_replay:dev")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids) if text else []

    fim = None
    stats: dict[str, list[tuple[int, int]]] = {"model order": [], "suffix first (for comparison)": []}
    for unit in sessions(load_prompt_set(args.prompts)):
        prev: dict[str, list[int]] = {}
        answers: list[str] = []
        for p in unit:
            if p.is_fim:
                fim = fim or fim_tokens(tok)
                pre, suf = encode(p.text), encode(p.suffix)
                orders = {
                    "model order": [*fim.lead, fim.prefix, *pre, fim.suffix, *suf, fim.middle],
                    "suffix first (for comparison)": [*fim.lead, fim.suffix, *suf, fim.prefix, *pre, fim.middle],
                }
            else:
                p = with_history(p, answers)
                text = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
                orders = {"model order": encode(text)}
                answers.append("A stand-in answer of a few sentences. " * 8)
            for name, ids in orders.items():
                if name in prev:
                    stats[name].append((common_prefix(prev[name], ids), len(ids)))
                prev[name] = ids
    out = {}
    for name, rows in stats.items():
        if not rows:
            continue
        shares = [hit / total for hit, total in rows]
        out[name] = {
            "requests": len(rows),
            "cached share of prompt tokens": round(sum(h for h, _ in rows) / sum(t for _, t in rows), 3),
            "median share per request": round(statistics.median(shares), 3),
            "median prompt tokens": statistics.median(t for _, t in rows),
        }
    print(json.dumps({"prompts": args.prompts, "tokenizer": args.tokenizer, **out}, indent=1))


if __name__ == "__main__":
    main()

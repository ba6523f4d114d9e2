"""Bounded vs flexible JSON whitespace on a weak model (issue 59, finding 6).

A random-weight tiny model over a real tokenizer (Qwen2.5's, from a local model directory: no download)
samples 30 requests (T = 1, at most 64 tokens) under a 3-property JSON schema, with bounded whitespace
(the default) and with flexible whitespace; prints how many outputs are valid JSON, validate and end by
themselves, per model seed.

    python docs/bench/structured/whitespace.py --tokenizer ~/.cache/specdecode/converted/qwen2.5-coder-0.5b-*/ --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from specdecode.grammar import GrammarSpec  # noqa: E402
from specdecode.sampling import SamplingParams  # noqa: E402
from tiny import make_engine, make_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="a local model directory with a tokenizer")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "name, ok and n as JSON"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok(text, add_special_tokens=False).input_ids
    for seed in args.seeds:
        target = make_model(len(tok), seed=seed)
        target.config.eos_token_id = target.generation_config.eos_token_id = tok.eos_token_id
        engine = make_engine(target, tok, num_slots=10, max_len=len(prompt) + args.max_tokens + 8)
        for ws in ("bounded", "flexible"):
            params = [
                SamplingParams(
                    1.0, max_new_tokens=args.max_tokens, seed=100 + i, grammar=GrammarSpec.json_schema(SCHEMA, ws)
                )
                for i in range(args.requests)
            ]
            valid = 0
            for out in engine.generate([prompt] * args.requests, params):
                try:
                    jsonschema.validate(json.loads(out.text), SCHEMA)
                    valid += out.finish_reason == "stop"
                except (ValueError, jsonschema.ValidationError):
                    pass
            print(f"seed {seed} {ws:8s} valid {valid}/{args.requests}", flush=True)


if __name__ == "__main__":
    main()

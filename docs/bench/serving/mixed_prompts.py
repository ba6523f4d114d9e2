"""Write a mixed-length prompt file for `specdecode load --prompts FILE.jsonl`: Spec-Bench
summarization (chat, long articles) and HumanEval test problems 100-163 (completion, short).

    python docs/bench/serving/mixed_prompts.py runs/mixed.jsonl --max-chars 3000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.prompts import HUMANEVAL_TEST, load_humaneval, load_spec_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-chars", type=int, default=3000, help="longest summarization article kept")
    args = parser.parse_args()
    rows = [
        {"id": p.id, "category": "summarization", "messages": p.messages}
        for p in load_spec_bench(categories=["summarization"])
        if len(p.messages[0]["content"]) <= args.max_chars
    ]
    rows += [{"id": p.id, "category": "humaneval", "prompt": p.text} for p in load_humaneval(problems=HUMANEVAL_TEST)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(
        f"{args.out}: {sum(r['category'] == 'summarization' for r in rows)} summarization, "
        f"{sum(r['category'] == 'humaneval' for r in rows)} HumanEval prompts"
    )


if __name__ == "__main__":
    main()

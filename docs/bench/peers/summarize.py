"""The peers table of a `peers.sh` run folder: per prompt set and level, every endpoint's output tok/s,
TTFT, latency and cached share (read from each `specdecode load` run's summary.json), and its ratio to
the bar, the fastest ordinary decoder at that level.

`specdecode load`'s own report.md already has the per-endpoint tables and each endpoint's ratios to the
first endpoint; what it cannot know is which endpoints decode without speculation, so the bar is chosen
here, after the run: among the ordinary decoders (--bar), the one with the most output tok/s at that
level that completed requests without errors and read the prompts the others read.

That last check is here because a server can answer a request it did not understand: llama-server's
`/v1/completions` ignores OpenAI's `suffix`, so on fill-in-the-middle prompts it completes the prefix alone
(a third of the tokens, and every keystroke's prompt extends the last one's). Per level, an endpoint whose
prompt tokens (summed over the requests every endpoint completed, from requests.jsonl) differ by more than
TOLERANCE from the upper median of all endpoints' sums is marked "other prompt": no bar, no ratios.

    python docs/bench/peers/summarize.py RUN_DIR [--bar llama-server,llamacpp-target,ik-target]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ORDINARY = ("llama-server", "llamacpp-target", "ik-target")
HEADER_FILES = ("commit.txt", "machine.txt", "versions.txt", "settings.txt", "skipped.txt")
TOLERANCE = 0.1  # chat templates and a session's own earlier answers move prompt tokens a little, a lost suffix a lot

Row = dict[str, Any]  # one LevelSummary of load's summary.json


def load_sets(run_dir: Path) -> list[tuple[str, str, list[Row]]]:
    """(prompt set, folder name, level rows) for every load run under ``run_dir``, in the order they ran.
    Each row gets ``mean_prompt_tokens`` and ``other_prompt`` (see the module docstring) from requests.jsonl."""
    found = []
    for summary in run_dir.glob("*/summary.json"):
        data = json.loads(summary.read_text(encoding="utf-8"))
        name = data.get("config", {}).get("prompt_set") or summary.parent.name
        rows = data.get("levels", [])
        mark_prompts(rows, read_prompt_tokens(summary.parent / "requests.jsonl"))
        found.append((summary.stat().st_mtime, name, summary.parent.name, rows))
    return [(name, folder, rows) for _, name, folder, rows in sorted(found, key=lambda f: f[0])]


PromptTokens = dict[tuple[str, float], dict[int, int]]  # (endpoint, level) -> request index -> prompt tokens


def read_prompt_tokens(requests: Path) -> PromptTokens:
    tokens: PromptTokens = {}
    if not requests.is_file():
        return tokens
    with requests.open(encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            if r.get("error") is None and isinstance(r.get("prompt_tokens"), int):
                tokens.setdefault((r["endpoint"], r["level"]), {})[r["index"]] = r["prompt_tokens"]
    return tokens


def mark_prompts(rows: list[Row], tokens: PromptTokens) -> None:
    """Set each row's ``mean_prompt_tokens`` and ``other_prompt`` (its sum off the level's upper median)."""
    for level in {r["level"] for r in rows}:
        at_level = [r for r in rows if r["level"] == level and (r["label"], level) in tokens]
        if not at_level:
            continue
        common = set.intersection(*(set(tokens[(r["label"], level)]) for r in at_level))
        sums = {r["label"]: sum(tokens[(r["label"], level)][i] for i in common) for r in at_level}
        reference = sorted(sums.values())[len(sums) // 2]
        for row in at_level:
            row["mean_prompt_tokens"] = sums[row["label"]] / len(common) if common else None
            row["other_prompt"] = bool(common) and abs(sums[row["label"]] - reference) > TOLERANCE * reference


def usable(row: Row) -> bool:
    """Whether a level run can be the bar: requests completed, none failed, the others' prompts read."""
    ok = bool(row.get("completed")) and not row.get("errors") and not row.get("other_prompt")
    return ok and row.get("output_throughput") is not None


def pick_bar(rows: list[Row], ordinary: tuple[str, ...] = ORDINARY) -> Row | None:
    """The fastest ordinary decoder (by output tok/s) among ``rows`` of one level, or None."""
    candidates = [r for r in rows if r["label"] in ordinary and usable(r)]
    return max(candidates, key=lambda r: r["output_throughput"], default=None)


def ratio(value: float | None, bar: float | None) -> float | None:
    return None if value is None or not bar else value / bar


def quantile(row: Row, metric: str, q: str) -> float | None:
    dist = row.get(metric)
    return None if dist is None else dist.get(q)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ms(value: float | None) -> str:
    return _num(None if value is None else value * 1000, ".0f")


def level_table(name: str, folder: str, rows: list[Row], ordinary: tuple[str, ...]) -> list[str]:
    lines = [
        f"## {name} ([report]({folder}/report.md))",
        "",
        "| concurrency | endpoint | done | errors | prompt tokens | output tok/s | × bar | TTFT p50 (ms) | × bar "
        "| TTFT p99 (ms) | latency p50 / p99 (ms) | cached share | acceptance |",
        "|---" * 13 + "|",
    ]
    levels = sorted({r["level"] for r in rows})
    for level in levels:
        at_level = [r for r in rows if r["level"] == level]
        bar = pick_bar(at_level, ordinary)
        for row in at_level:
            errors = ", ".join(f"{k}: {v}" for k, v in sorted((row.get("errors") or {}).items())) or "0"
            label = f"**{row['label']}** (bar)" if row is bar else row["label"]
            prompt = _num(row.get("mean_prompt_tokens"), ".0f") + (" (other prompt)" if row.get("other_prompt") else "")
            comparable = bar is not None and not row.get("other_prompt")
            ttft50 = quantile(row, "ttft", "p50")
            share = row.get("cached_share")
            spec = row.get("speculation") or {}
            cells = [
                f"{level:g}",
                label,
                str(row.get("completed", 0)),
                errors,
                prompt,
                _num(row.get("output_throughput"), ".2f"),
                _num(ratio(row.get("output_throughput"), bar["output_throughput"]) if comparable else None, ".2f"),
                _ms(ttft50),
                _num(ratio(ttft50, quantile(bar, "ttft", "p50")) if comparable else None, ".2f"),
                _ms(quantile(row, "ttft", "p99")),
                f"{_ms(quantile(row, 'latency', 'p50'))} / {_ms(quantile(row, 'latency', 'p99'))}",
                "-" if share is None else f"{share:.0%}",
                _num(spec.get("acceptance_rate"), ".2f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        if bar is None:
            lines.append(f"| {level:g} | no bar: no ordinary decoder completed this level as asked |" + " |" * 11)
    return lines


def render(run_dir: Path, ordinary: tuple[str, ...] = ORDINARY) -> str:
    lines = [f"# Peers side by side: {run_dir.name}", ""]
    for file in HEADER_FILES:
        path = run_dir / file
        if path.is_file():
            lines += [f"{file}:", "", "```", path.read_text(encoding="utf-8").rstrip(), "```", ""]
    lines += [
        "The bar (per prompt set and level): the fastest ordinary decoder among "
        + ", ".join(ordinary)
        + " that completed the level without errors and read the same prompts. × bar: the endpoint's output "
        "tok/s over the bar's (above 1 is faster) and its TTFT p50 over the bar's (below 1 is sooner). Prompt "
        "tokens: the mean over the requests every endpoint completed, as each server counted them; \"other "
        f"prompt\": more than {TOLERANCE:.0%} off the others (e.g. a server that dropped a fill-in-the-middle suffix), "
        "so neither the bar nor compared. Cached share: prompt tokens the server's prefix cache answered, "
        "where the server says.",
        "",
    ]
    for name, folder, rows in load_sets(run_dir):
        lines += [*level_table(name, folder, rows, ordinary), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--bar", default=",".join(ORDINARY), help="the ordinary decoders' labels, comma-separated")
    args = parser.parse_args()
    print(render(args.run_dir, tuple(args.bar.split(","))))


if __name__ == "__main__":
    main()
